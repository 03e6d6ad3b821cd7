"""A fake vLLM KV-cache event publisher for tests: ZMQ live batches and the replay ROUTER.

It follows ``DESIGN.md`` ("vLLM 0.33", KV-cache events), the format
:mod:`ps_p2p.engines.vllm_kv_events` reads:

* live: ``[topic, seq (8 bytes big-endian, from 0), msgpack [ts, events, data_parallel_rank]]``,
  each event a msgpack map tagged by ``"type"`` (built by :func:`block_stored`,
  :func:`block_removed`, :func:`all_blocks_cleared`, with vLLM's field names and order);
* replay: a ROUTER answering ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq,
  payload]`` for each buffered batch with ``seq >= start_seq`` (the last ``buffer_steps``
  batches), then ``[identity, b"", b"", 0xFFFFFFFFFFFFFFFF, b""]``.

Differences from vLLM, for tests: the live socket is an XPUB, which sends exactly as vLLM's PUB
and also lets :meth:`FakeKVPublisher.wait_subscribed` see a subscription arrive (ZMQ's "slow
joiner": a PUB drops what it sends before the subscription is in place, so a test waits on that
instead of sleeping); both sockets bind to ``127.0.0.1`` on ephemeral ports unless told a port;
:meth:`FakeKVPublisher.publish` can keep a batch from the live socket (``deliver=False``) to
make a gap, and :meth:`FakeKVPublisher.restart` starts seq again at 0 with an empty buffer, as a
new vLLM process would.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import trio
import zmq

from ps_p2p.engines.vllm_engine import zmq_recv_multipart
from ps_p2p.engines.vllm_kv_events import END_SEQ, encode_seq

__all__ = [
    "FakeKVPublisher",
    "all_blocks_cleared",
    "block_removed",
    "block_stored",
    "open_fake_kv_publisher",
    "open_fake_kv_publishers",
]


def block_stored(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A ``BlockStored`` event map as vLLM >= 0.24 sends it; ``extra`` fields (``extra_keys``,
    ``group_idx``, anything) are appended after vLLM's."""
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
        **extra,
    }


def block_removed(
    block_hashes: Sequence[int], *, medium: str | None = "GPU", **extra: Any
) -> dict[str, Any]:
    """A ``BlockRemoved`` event map."""
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium, **extra}


def all_blocks_cleared() -> dict[str, Any]:
    """An ``AllBlocksCleared`` event map."""
    return {"type": "AllBlocksCleared"}


class FakeKVPublisher:
    """One data-parallel rank of vLLM's ZMQ KV-cache event publisher (binds on construction).

    Args:
        topic: the topic frame (vLLM's ``"topic"``).
        data_parallel_rank: written in every payload (None: the 2-element payload vLLM sends
            when the rank is its default).
        buffer_steps: batches kept for replay (vLLM's default 10,000).
        port, replay_port: TCP ports on 127.0.0.1; 0 picks free ones.
        replay_with_topic: answer replays with the topic frame (DESIGN.md); False leaves it out.

    Attributes:
        endpoint, replay_endpoint: where to connect, ``tcp://127.0.0.1:PORT``.
        next_seq: the seq of the next batch.
        replay_requests: start seqs of the replay requests answered, in order.
    """

    def __init__(
        self,
        *,
        topic: str = "kv",
        data_parallel_rank: int | None = 0,
        buffer_steps: int = 10_000,
        port: int = 0,
        replay_port: int = 0,
        replay_with_topic: bool = True,
    ) -> None:
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self.next_seq = 0
        self.replay_requests: list[int] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay_with_topic = replay_with_topic
        self._subscriptions = 0
        self._context = zmq.Context()
        try:
            self._pub = self._context.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.endpoint = _bind(self._pub, port)
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 0)  # never drop a replay
            self.replay_endpoint = _bind(self._router, replay_port)
        except zmq.ZMQError:
            self._context.destroy(linger=0)
            raise

    def publish(
        self, events: Sequence[dict[str, Any]], *, ts: float | None = None, deliver: bool = True
    ) -> int:
        """Publish one batch of event maps; returns its seq.

        Args:
            events: maps from :func:`block_stored` etc. (or any msgpack-able values).
            ts: the batch's timestamp; the wall clock by default, as vLLM.
            deliver: False keeps the batch in the replay buffer only (a batch the subscriber
                lost).
        """
        batch: list[Any] = [time.time() if ts is None else ts, list(events)]
        if self.data_parallel_rank is not None:
            batch.append(self.data_parallel_rank)
        return self.publish_payload(msgpack.packb(batch), deliver=deliver)

    def publish_payload(self, payload: bytes, *, deliver: bool = True) -> int:
        """Publish raw payload bytes (malformed ones too) as the next batch; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if deliver:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], zmq.NOBLOCK)
        return seq

    def restart(self) -> None:
        """Behave as a new vLLM process: seq from 0 again, nothing to replay."""
        self.next_seq = 0
        self._buffer.clear()

    async def wait_subscribed(self, count: int = 1) -> None:
        """Wait until ``count`` subscriptions reached the live socket; batches published
        afterwards reach those subscribers. Not concurrently with :meth:`publish`."""
        while self._subscriptions < count:
            (message, *_) = await zmq_recv_multipart(self._pub)
            if message[:1] == b"\x01":
                self._subscriptions += 1
            elif message[:1] == b"\x00":
                self._subscriptions -= 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled; a malformed request is ignored."""
        while True:
            frames = await zmq_recv_multipart(self._router)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests.append(start)
            topic = [self.topic] if self._replay_with_topic else []
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart(
                        [identity, b"", *topic, encode_seq(seq), payload], zmq.NOBLOCK
                    )
            self._router.send_multipart(
                [identity, b"", *([b""] if self._replay_with_topic else []), encode_seq(END_SEQ),
                 b""],
                zmq.NOBLOCK,
            )

    def close(self) -> None:
        """Close the sockets (no task may be using them)."""
        for sock in (self._pub, self._router):
            trio.lowlevel.notify_closing(sock.getsockopt(zmq.FD))
            sock.close(linger=0)
        self._context.destroy(linger=0)


def _bind(sock: zmq.Socket[bytes], port: int) -> str:
    sock.bind(f"tcp://127.0.0.1:{port or '*'}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


@asynccontextmanager
async def open_fake_kv_publisher(**kwargs: Any) -> AsyncIterator[FakeKVPublisher]:
    """A :class:`FakeKVPublisher` (``kwargs`` as its constructor) answering replays until the
    block exits."""
    publisher = FakeKVPublisher(**kwargs)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.serve_replay)
            yield publisher
            nursery.cancel_scope.cancel()
    finally:
        publisher.close()


@asynccontextmanager
async def open_fake_kv_publishers(
    ranks: int, *, attempts: int = 20, **kwargs: Any
) -> AsyncIterator[list[FakeKVPublisher]]:
    """``ranks`` publishers, rank r at rank 0's ports + r as vLLM's data-parallel ranks are.

    Rank 0 takes free ports; when a port + r is taken, all are closed and bound again (up to
    ``attempts`` times).

    Raises:
        zmq.ZMQError: no run of free ports found.
    """
    for attempt in range(attempts):
        publishers: list[FakeKVPublisher] = []
        try:
            first = FakeKVPublisher(data_parallel_rank=0, **kwargs)
            publishers.append(first)
            port = int(first.endpoint.rsplit(":", 1)[1])
            replay_port = int(first.replay_endpoint.rsplit(":", 1)[1])
            for rank in range(1, ranks):
                publishers.append(FakeKVPublisher(
                    data_parallel_rank=rank, port=port + rank, replay_port=replay_port + rank,
                    **kwargs,
                ))
        except zmq.ZMQError:
            for publisher in publishers:
                publisher.close()
            if attempt == attempts - 1:
                raise
            continue
        break
    try:
        async with trio.open_nursery() as nursery:
            for publisher in publishers:
                nursery.start_soon(publisher.serve_replay)
            yield publishers
            nursery.cancel_scope.cancel()
    finally:
        for publisher in publishers:
            publisher.close()
