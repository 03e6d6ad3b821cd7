"""HR-tree and load gossip among the model nodes of one group (PlanetServe sec. 3.3, A6).

Two protocols:

* GossipSub topic ``/planetserve/hrtree/1/<model_id>`` (:func:`topic_for`): each model node
  publishes signed *envelopes*: its load report about every second
  (:func:`ps_p2p.gossip.load.encode_report`) and the deltas of its own HR-subtree every few
  seconds (:meth:`ps_p2p.gossip.hr_tree.Delta.encode`). GossipSub is set up per DESIGN.md's
  py-libp2p notes (:func:`make_pubsub`): heartbeat 1 s, protocols 1.1 and 1.0 only (1.2's
  IDONTWANT doubles the CPU), spam protection off (it drops a publisher's own messages above
  10/s per topic), strict signing on (the pubsub layer authenticates ``from_id``).
* ``/planetserve/hrtree-sync/1.0.0``: a node that sees a gap in a peer's deltas asks that peer
  for a signed snapshot of its subtree (one request per stream).

Envelope (bytes; ``u8``/``u32`` big-endian)::

    envelope = b"planetserve/v1/hrtree-gossip\\x00" || u8(kind) || u32(len(body)) || body
               || signature (64 bytes, Ed25519 of the publisher over everything before it)
    kind     = 1: load report | 2: subtree delta | 3: subtree snapshot (sync answers only)

A receiver accepts an envelope only from a model node of its group listed in its verified
directory (the pubsub ``from_id``, checked by strict signing, and our own signature under that
peer ID's key); anything else is dropped and counted, never relayed on by us. Sizes are bounded
(:data:`MAX_ENVELOPE_BYTES`, :data:`MAX_SNAPSHOT_ENVELOPE_BYTES`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamError

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.gossip.hr_tree import MAX_DELTA_BYTES, MAX_SNAPSHOT_BYTES
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.handlers import StreamHandlers, exchange, reset_quietly, serve_handlers
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.signatures import verify_signature
from ps_p2p.records.types import Signer

log = logging.getLogger(__name__)

HRTREE_SYNC_PROTOCOL_ID = TProtocol("/planetserve/hrtree-sync/1.0.0")
GOSSIPSUB_PROTOCOLS = (TProtocol("/meshsub/1.1.0"), TProtocol("/meshsub/1.0.0"))
ENVELOPE_DOMAIN = b"planetserve/v1/hrtree-gossip\x00"
KIND_LOAD = 1
KIND_DELTA = 2
KIND_SNAPSHOT = 3
SIGNATURE_BYTES = 64
_HEADER = len(ENVELOPE_DOMAIN) + 1 + 4
#: Largest gossiped envelope (a delta of at most MAX_DELTA_BYTES, or a ~200-byte load report).
MAX_ENVELOPE_BYTES = _HEADER + MAX_DELTA_BYTES + SIGNATURE_BYTES
#: Largest snapshot answer of the sync protocol.
MAX_SNAPSHOT_ENVELOPE_BYTES = _HEADER + MAX_SNAPSHOT_BYTES + SIGNATURE_BYTES
#: Seconds a peer has to send its snapshot request once the stream is open.
SYNC_READ_TIMEOUT = 10.0
#: The sync request: one fixed frame.
SYNC_REQUEST = b"planetserve/v1/hrtree-sync\x00"


def topic_for(model_id: str) -> str:
    """The GossipSub topic of the model group serving ``model_id``."""
    return f"/planetserve/hrtree/1/{model_id}"


def seal(signer: Signer, kind: int, body: bytes) -> bytes:
    """An envelope of ``body`` signed by ``signer`` (module docstring)."""
    head = ENVELOPE_DOMAIN + struct.pack(">BI", kind, len(body)) + body
    return head + signer.sign(head)


def open_envelope(data: bytes, publisher: bytes, max_bytes: int = MAX_ENVELOPE_BYTES
                  ) -> tuple[int, bytes]:
    """Check an envelope ``publisher`` signed; returns ``(kind, body)``.

    Raises:
        RemoteProtocolError: oversized, malformed, an unknown kind, or a signature that does
            not verify under ``publisher``'s key (InvalidSignatureError).
    """
    if len(data) > max_bytes:
        raise RemoteProtocolError(f"gossip envelope of {len(data)} bytes (max {max_bytes})")
    if len(data) < _HEADER + SIGNATURE_BYTES or not data.startswith(ENVELOPE_DOMAIN):
        raise RemoteProtocolError("not an HR-tree gossip envelope")
    kind, length = struct.unpack_from(">BI", data, len(ENVELOPE_DOMAIN))
    if kind not in (KIND_LOAD, KIND_DELTA, KIND_SNAPSHOT):
        raise RemoteProtocolError(f"gossip envelope of unknown kind {kind}")
    if _HEADER + length + SIGNATURE_BYTES != len(data):
        raise RemoteProtocolError("gossip envelope length does not match its body")
    head, signature = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
    verify_signature(publisher, head, signature)
    return kind, data[_HEADER:-SIGNATURE_BYTES]


def make_pubsub(host: IHost):  # type: ignore[no-untyped-def]
    """A py-libp2p Pubsub with GossipSub set up for small groups (module docstring)."""
    from libp2p.pubsub.gossipsub import GossipSub
    from libp2p.pubsub.pubsub import Pubsub

    router = GossipSub(
        protocols=list(GOSSIPSUB_PROTOCOLS), degree=6, degree_low=4, degree_high=12,
        heartbeat_initial_delay=0.1, heartbeat_interval=1, spam_protection_enabled=False,
        time_to_live=30,
    )
    return Pubsub(host, router, strict_signing=True,
                  max_inbound_rpc_size=4 * MAX_ENVELOPE_BYTES), router


@asynccontextmanager
async def running_pubsub(host: IHost) -> AsyncIterator[object]:
    """Run :func:`make_pubsub`'s Pubsub and GossipSub services for the block (start them
    before the host makes connections: an early pubsub stream otherwise crashes the host).

    py-libp2p's pubsub stream handler lets a malformed RPC's ``DecodeError`` escape, which
    kills the host (found by ``ps_p2p.testing.fuzz``): its handlers are replaced by guarded
    ones that reset that stream only, and removed when the block ends.

    Raises:
        ConfigError: the host already serves a GossipSub protocol (another pubsub runs on it).
    """
    from libp2p.tools.anyio_service.context import background_trio_service

    from ps_p2p.errors import ConfigError
    from ps_p2p.protocols.handlers import registered_protocols

    taken = sorted(set(map(str, GOSSIPSUB_PROTOCOLS)) & registered_protocols(host))
    if taken:
        raise ConfigError(f"the host already serves {', '.join(taken)} (another pubsub); "
                          "turn forwarding off ([forwarding] enabled = false) to attach")
    pubsub, router = make_pubsub(host)

    async def guarded(stream: INetStream) -> None:
        try:
            await pubsub.stream_handler(stream)
        except Exception as exc:  # an escaping exception kills the py-libp2p host
            log.info("pubsub stream from %s reset: %r",
                     peer_label(stream.muxed_conn.peer_id.to_bytes()), exc)
            await reset_quietly(stream)
            return
        # its read loop returns at the peer's end of the stream but leaves ours open: the
        # connection would hold the stream as long as it lives (found by the fuzzer). Pubsub
        # writes on streams it opens itself, never on this one: end it.
        await reset_quietly(stream)

    for protocol in GOSSIPSUB_PROTOCOLS:
        host.remove_stream_handler(protocol)
    handlers = StreamHandlers(host)
    for protocol in GOSSIPSUB_PROTOCOLS:
        handlers.add(protocol, guarded)
    try:
        async with background_trio_service(pubsub):
            async with background_trio_service(router):
                for service in (pubsub, router):
                    _guard_tasks(service.manager)
                await pubsub.wait_until_ready()
                yield pubsub
    finally:
        await handlers.aclose()


def _guard_tasks(manager: Any) -> None:
    """Make the non-daemon tasks a py-libp2p service manager runs log and drop their exceptions
    instead of stopping the service (and with it the node): e.g. ``Pubsub.push_msg`` re-raises
    when a message's public key does not parse, so one message from anyone would stop a model
    node (found by review; tests/test_group_forwarding.py)."""
    run_task = manager.run_task

    def guarded_run_task(async_fn: Any, *args: Any, daemon: bool = False, **kwargs: Any) -> Any:
        if daemon:
            return run_task(async_fn, *args, daemon=daemon, **kwargs)

        async def guarded(*a: Any) -> None:
            try:
                await async_fn(*a)
            except Exception as exc:  # a peer's bad input must cost its message, not the node
                log.info("pubsub task %s failed: %r", getattr(async_fn, "__name__", "?"), exc)

        return run_task(guarded, *args, daemon=daemon, **kwargs)

    manager.run_task = guarded_run_task


class SnapshotServer:
    """The serving side of :data:`HRTREE_SYNC_PROTOCOL_ID`.

    Args:
        snapshot: returns this node's sealed snapshot envelope (kind 3).
        may_ask: whether a peer may ask (a model node of the group).
        min_interval: seconds between two answers to one peer (others are reset).
    """

    def __init__(self, snapshot: Callable[[], bytes], may_ask: Callable[[bytes], bool], *,
                 min_interval: float = 1.0) -> None:
        self._snapshot = snapshot
        self._may_ask = may_ask
        self.min_interval = min_interval
        self._last: dict[bytes, float] = {}
        self.served = 0
        self.refused = 0

    async def serve(self, host: IHost, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve on ``host`` until cancelled, then remove the handler."""
        await serve_handlers(host, {HRTREE_SYNC_PROTOCOL_ID: self._handle},
                             task_status=task_status)

    async def _handle(self, stream: INetStream) -> None:
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            if not self._may_ask(sender):  # before reading anything
                raise RemoteProtocolError("not a model node of this group")
            with trio.fail_after(SYNC_READ_TIMEOUT):
                if await read_frame(stream, len(SYNC_REQUEST)) != SYNC_REQUEST:
                    raise RemoteProtocolError("not a snapshot request")
            now = trio.current_time()
            if now < self._last.get(sender, -1e9) + self.min_interval:
                raise RemoteProtocolError("snapshot asked again too soon")
            if len(self._last) > 4096:
                self._last.clear()
            self._last[sender] = now
            await stream.write(encode_frame(self._snapshot()))
            await stream.close()
            self.served += 1
        except RemoteProtocolError as exc:
            self.refused += 1
            log.info("snapshot request from %s refused: %s", peer_label(sender), exc)
            await reset_quietly(stream)
        except (StreamError, StreamEOF, trio.TooSlowError) as exc:
            log.info("snapshot stream from %s failed: %r", peer_label(sender), exc)
            await reset_quietly(stream)
        except Exception:
            log.exception("snapshot stream from %s: unexpected error", peer_label(sender))
            await reset_quietly(stream)


async def fetch_snapshot(host: IHost, peer: bytes, *, timeout: float = 10.0) -> bytes:
    """Ask ``peer`` for its sealed snapshot envelope (not yet checked: :func:`open_envelope`).

    Raises:
        RemoteProtocolError: a frame over :data:`MAX_SNAPSHOT_ENVELOPE_BYTES` or a closed stream.
        trio.TooSlowError: not within ``timeout`` seconds.
        Exception: py-libp2p's dial and negotiation errors.
    """
    async def body(stream: INetStream) -> bytes:
        with trio.fail_after(timeout):
            await stream.write(encode_frame(SYNC_REQUEST))
            try:
                return await read_frame(stream, MAX_SNAPSHOT_ENVELOPE_BYTES)
            except StreamEOF:
                raise RemoteProtocolError("snapshot stream closed without an answer") from None

    return await exchange(host, peer, HRTREE_SYNC_PROTOCOL_ID, body, timeout=timeout)


__all__ = [
    "GOSSIPSUB_PROTOCOLS", "HRTREE_SYNC_PROTOCOL_ID", "KIND_DELTA", "KIND_LOAD",
    "KIND_SNAPSHOT", "MAX_ENVELOPE_BYTES", "MAX_SNAPSHOT_ENVELOPE_BYTES", "SnapshotServer",
    "fetch_snapshot", "make_pubsub", "open_envelope", "running_pubsub", "seal", "topic_for",
]
