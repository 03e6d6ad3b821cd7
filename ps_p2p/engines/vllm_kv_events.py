"""vLLM's KV-cache events over ZMQ: frames in, :mod:`ps_p2p.engines.kv_events` events out (pure).

Source: ``DESIGN.md`` "vLLM 0.33, verified from its source" (KV-cache events); the events feed a
model node's subtree of the HR-tree (PlanetServe sec. 3.3). The trio adapter that owns the ZMQ
sockets is :class:`ps_p2p.engines.vllm_engine.KVEventSubscriber`; this module does no I/O, reads
no clock and imports neither trio nor zmq.

vLLM publishes with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}'``. Data-parallel
rank r publishes on the endpoint's port + r (and replays on the replay port + r), with its own
sequence numbers (:func:`endpoint_for_rank`).

Live message (PUB -> SUB), three frames::

    [topic (UTF-8, b"" by default), seq (8 bytes, big-endian unsigned, from 0 per process), payload]

Payload, a msgpack array (vLLM's ``KVEventBatch``; a trailing ``data_parallel_rank`` equal to
its default None may be left out, and fields appended by later versions are ignored)::

    [ts (float seconds), events (array), data_parallel_rank (int | nil)]

Each event (vLLM >= 0.24) is a msgpack **map** tagged by ``"type"``, read by field name; fields
not listed are ignored (``lora_id``, ``lora_name``, ``medium``, ``extra_keys``, ``group_idx``...):

* ``{"type": "BlockStored", "block_hashes": [uint64...], "parent_block_hash": uint64 | nil,
  "token_ids": [int...], "block_size": int, ...}`` (a missing ``parent_block_hash`` reads as nil);
* ``{"type": "BlockRemoved", "block_hashes": [uint64...], ...}``;
* ``{"type": "AllBlocksCleared"}``.

Events of another ``"type"`` are skipped and named in :attr:`DecodedBatch.skipped_types` (a newer
vLLM may add kinds). Events given as arrays (vLLM < 0.24) are refused. Block hashes are unsigned
64-bit integers (msgpack uint64, so above 2**63 too); a negative, a float, a bool or bytes is an
error.

Replay (DEALER -> the ROUTER ``replay_endpoint``): send ``[b"", start_seq (8 bytes)]``; the
answer is one message per buffered batch with ``seq >= start_seq``, ``[b"", topic, seq,
payload]``, then the end marker ``[b"", b"", 0xFFFFFFFFFFFFFFFF, b""]``. The same framing
without the topic frame (``[b"", seq, payload]``, end ``[b"", END, b""]``) is read too.

Sequence numbers (:class:`KVEventStream`): the stream expects every seq from 0 once, in order.

* A **gap** (a live seq above the next expected one; ZMQ PUB drops messages at its high-water
  mark and before a subscription is in place) asks for a replay from the first missing seq;
  live messages that arrive meanwhile are held (bounded) and applied after it.
* **Duplicates** (a replayed or held batch already applied, or a live batch that a replay
  already brought: live messages keep arriving, or wait in the socket's queue, while a replay
  runs) are dropped, counted.
* When a replay cannot fill the gap (no replay endpoint, the replay failed or timed out, the
  publisher's buffer no longer holds the missing batches, or a gap remains after it) the stream
  **resnapshots**: it emits :class:`~ps_p2p.engines.kv_events.AllBlocksCleared` and rebuilds from
  what follows. vLLM has no snapshot of its cache to ask for, so blocks stored before the lost
  batches and still cached stay unknown until evicted and stored again: the view under-reports
  (a forwarding miss, never a false hit for blocks the engine reported removed).
* A live seq **not above the previous live seq** means the publisher restarted (ZMQ hands a
  subscriber one publisher's messages once each, in order, and seq restarts at 0 in a new vLLM
  process): the new process has an empty cache, so the stream emits ``AllBlocksCleared``
  and expects seq 0 of it (a running replay is dropped). A restart before the first live
  message, or one whose first live seq is above the last one seen, is not detected; the seqs
  of the new process then read as duplicates or a gap.
* A message that cannot be decoded (:class:`~ps_p2p.errors.KVEventDecodeError`: malformed
  msgpack, a wrong type, a limit exceeded) is dropped alone and counted; its seq still counts as
  received (a replay would return the same bytes), so its events are missing from the view.

With several data-parallel ranks, run one :class:`KVEventStream` per rank.

Not told apart: events of every ``medium`` (vLLM's GPU cache, or CPU with KV offloading), LoRA
adapter and KV-cache group (hybrid models' ``group_idx``) go into one view, the prefixes the
engine holds anywhere; a ``BlockRemoved`` in one of them removes the hash from the view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ps_p2p.engines.kv_events import (
    MAX_BLOCK_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from ps_p2p.errors import ConfigError, KVEventDecodeError

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_BUFFERED_WEIGHT",
    "END_SEQ",
    "DecodedBatch",
    "EventBuffer",
    "EventsDecoded",
    "KVEventLimits",
    "KVEventStats",
    "KVEventStream",
    "MessageRejected",
    "Output",
    "ReplayEnd",
    "ReplayRequested",
    "Resynced",
    "decode_batch",
    "decode_seq",
    "encode_seq",
    "endpoint_for_rank",
    "parse_live_message",
    "parse_replay_message",
    "replay_request",
]

#: the seq frame of the replay's end marker (vLLM writes -1 as 8 signed bytes)
END_SEQ = 2**64 - 1
_SEQ_BYTES = 8


@dataclass(frozen=True)
class KVEventLimits:
    """Bounds on what a publisher can make us decode or hold; every one is checked per message.

    Attributes:
        max_payload_bytes: bytes of one payload frame (also the ZMQ ``MAXMSGSIZE`` of the
            sockets: a larger frame drops the connection before it is read). 8 MiB: a step that
            stores a 128k-token prompt sends ~0.7 MB.
        max_events_per_batch: events in one payload (a step evicting many blocks sends one
            ``BlockRemoved`` per eviction call).
        max_block_hashes_per_event: hashes in one event (65,536 blocks: 1M tokens at 16 a block).
        max_token_ids_per_event: token IDs in one ``BlockStored`` (2**20).
        max_block_size: tokens per block.
        max_topic_bytes: bytes of the topic frame.
        max_str_bytes: bytes of any msgpack string in a payload (type names, ``medium``,
            ``lora_name``, strings inside ``extra_keys``).
        max_pending_batches: live batches held while a replay runs; more abandon the replay
            (a resnapshot).
        max_pending_bytes: payload bytes held while a replay runs; more abandon the replay.
        max_replay_batches: batches one replay may return (vLLM buffers 10,000 steps by
            default); more end the replay as failed.
    """

    max_payload_bytes: int = 8 * 1024 * 1024
    max_events_per_batch: int = 65_536
    max_block_hashes_per_event: int = 65_536
    max_token_ids_per_event: int = 1 << 20
    max_block_size: int = 1 << 16
    max_topic_bytes: int = 256
    max_str_bytes: int = 64 * 1024
    max_pending_batches: int = 1024
    max_pending_bytes: int = 64 * 1024 * 1024
    max_replay_batches: int = 100_000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KVEventLimits.{name} must be a positive integer, not {value!r}")


DEFAULT_LIMITS = KVEventLimits()


# -- frames -----------------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian frame vLLM sends.

    Raises:
        ValueError: ``seq`` outside [0, 2**64).
    """
    if not 0 <= seq <= END_SEQ:
        raise ValueError(f"seq {seq} is not an unsigned 64-bit integer")
    return seq.to_bytes(_SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The unsigned integer of an 8-byte big-endian seq frame.

    Raises:
        KVEventDecodeError: the frame is not 8 bytes long.
    """
    if len(frame) != _SEQ_BYTES:
        raise KVEventDecodeError(f"seq frame of {len(frame)} bytes, expected {_SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to vLLM's replay ROUTER: ``[b"", start_seq]``."""
    return [b"", encode_seq(start_seq)]


def parse_live_message(
    frames: Sequence[bytes], *, topic: bytes | None, limits: KVEventLimits = DEFAULT_LIMITS
) -> tuple[int, bytes]:
    """Split a live message ``[topic, seq, payload]`` into (seq, payload).

    Args:
        frames: the multipart message as received by the SUB socket.
        topic: the topic expected exactly (a SUB subscription only matches a prefix); None
            accepts any topic.
        limits: ``max_topic_bytes`` and ``max_payload_bytes`` apply.

    Raises:
        KVEventDecodeError: not three frames, another topic, a seq frame not of 8 bytes, or a
            frame over its limit.
    """
    if len(frames) != 3:
        raise KVEventDecodeError(f"live message of {len(frames)} frames, expected 3")
    topic_frame, seq_frame, payload = frames
    _check_topic(topic_frame, topic, limits)
    seq = decode_seq(seq_frame)
    _check_payload_size(payload, limits)
    return seq, bytes(payload)


@dataclass(frozen=True)
class ReplayEnd:
    """The end marker of a replay."""


def parse_replay_message(
    frames: Sequence[bytes], *, topic: bytes | None, limits: KVEventLimits = DEFAULT_LIMITS
) -> tuple[int, bytes] | ReplayEnd:
    """One message a DEALER received from the replay ROUTER: (seq, payload) or the end marker.

    Accepts ``[b"", topic, seq, payload]`` and ``[b"", b"", END_SEQ, b""]`` (DESIGN.md), and the
    same without the topic frame.

    Raises:
        KVEventDecodeError: another frame count, a non-empty delimiter, another topic, a bad
            seq frame, or a frame over its limit.
    """
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise KVEventDecodeError(
            f"replay message of {len(frames)} frames, expected [b'', topic, seq, payload]"
        )
    if len(frames) == 4:
        _, topic_frame, seq_frame, payload = frames
    else:
        _, seq_frame, payload = frames
        topic_frame = None
    seq = decode_seq(seq_frame)
    if seq == END_SEQ:
        return ReplayEnd()
    if topic_frame is not None:
        _check_topic(topic_frame, topic, limits)
    _check_payload_size(payload, limits)
    return seq, bytes(payload)


def _check_topic(frame: bytes, topic: bytes | None, limits: KVEventLimits) -> None:
    if len(frame) > limits.max_topic_bytes:
        raise KVEventDecodeError(
            f"topic frame of {len(frame)} bytes, limit {limits.max_topic_bytes}"
        )
    if topic is not None and frame != topic:
        raise KVEventDecodeError(f"topic {bytes(frame)!r}, expected {topic!r}")


def _check_payload_size(payload: bytes, limits: KVEventLimits) -> None:
    if len(payload) > limits.max_payload_bytes:
        raise KVEventDecodeError(
            f"payload of {len(payload)} bytes, limit {limits.max_payload_bytes}"
        )


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` publishes on: the TCP port + ``rank``.

    Args:
        endpoint: the address to connect to, ``tcp://HOST:PORT`` (``HOST`` may be a
            bracketed IPv6 address); ``ipc://`` and ``inproc://`` endpoints serve rank 0 only.
        rank: data-parallel rank, >= 0.

    Raises:
        ConfigError: not a connectable endpoint (no host, ``*`` as host, no port, a port outside
            1..65535 after adding ``rank``), or a rank > 0 on a non-TCP endpoint.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ConfigError(f"KV events endpoint {endpoint!r}: expected tcp://HOST:PORT")
    if rank < 0:
        raise ConfigError(f"data-parallel rank must be >= 0, not {rank}")
    if scheme != "tcp":
        if rank:
            raise ConfigError(f"KV events endpoint {endpoint!r}: ranks > 0 need a tcp:// endpoint")
        return endpoint
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host or not port_text.isdigit():
        raise ConfigError(f"KV events endpoint {endpoint!r}: expected tcp://HOST:PORT")
    if host == "*":
        raise ConfigError(
            f"KV events endpoint {endpoint!r}: '*' is how vLLM binds; connect to a host "
            "such as tcp://127.0.0.1:5557"
        )
    port = int(port_text) + rank
    if not 1 <= port <= 65535:
        raise ConfigError(f"KV events endpoint {endpoint!r}: port {port} for rank {rank}")
    return f"tcp://{host}:{port}"


# -- payloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedBatch:
    """One payload, decoded.

    Attributes:
        ts: the publisher's timestamp (seconds since the epoch; informative only).
        events: the known events, in the publisher's order.
        data_parallel_rank: the rank the publisher named, None when it sent none.
        skipped_types: the ``"type"`` of each event skipped as unknown.
    """

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None
    skipped_types: tuple[str, ...] = ()


def decode_batch(payload: bytes, limits: KVEventLimits = DEFAULT_LIMITS) -> DecodedBatch:
    """Decode one payload ``[ts, events, data_parallel_rank]`` (see the module docstring).

    The msgpack decoder itself is bounded (array, map and string lengths), so a hostile payload
    cannot make it allocate more than a few times its own size.

    Raises:
        KVEventDecodeError: over ``limits``, not msgpack (or trailing bytes), or any field of
            the wrong type or range; the message names the field.
    """
    _check_payload_size(payload, limits)
    longest_array = max(
        limits.max_events_per_batch,
        limits.max_block_hashes_per_event,
        limits.max_token_ids_per_event,
    )
    try:
        batch = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_payload_bytes,
            max_array_len=longest_array,
            max_map_len=256,
            max_ext_len=limits.max_str_bytes,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KVEventDecodeError(f"payload is not one msgpack value: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2:
        raise KVEventDecodeError("payload is not an array [ts, events, data_parallel_rank]")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventDecodeError(f"ts is {type(ts).__name__}, expected a number")
    if rank is not None and not _is_uint(rank):
        raise KVEventDecodeError(f"data_parallel_rank is {rank!r}, expected an int >= 0 or nil")
    if not isinstance(raw_events, list):
        raise KVEventDecodeError(f"events is {type(raw_events).__name__}, expected an array")
    if len(raw_events) > limits.max_events_per_batch:
        raise KVEventDecodeError(
            f"{len(raw_events)} events in one batch, limit {limits.max_events_per_batch}"
        )
    events: list[KVCacheEvent] = []
    skipped: list[str] = []
    for index, raw in enumerate(raw_events):
        if not isinstance(raw, dict):
            raise KVEventDecodeError(
                f"event {index} is {type(raw).__name__}, expected a map (vLLM >= 0.24)"
            )
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise KVEventDecodeError(f"event {index} has no string 'type'")
        if kind == "BlockStored":
            events.append(_block_stored(raw, index, limits))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(tuple(_hashes(raw, "block_hashes", index, limits))))
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            skipped.append(kind)
    return DecodedBatch(float(ts), tuple(events), rank, tuple(skipped))


def _block_stored(raw: dict[str, Any], index: int, limits: KVEventLimits) -> BlockStored:
    hashes = _hashes(raw, "block_hashes", index, limits)
    parent = raw.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise KVEventDecodeError(
            f"event {index}: parent_block_hash is {parent!r}, expected a uint64 or nil"
        )
    token_ids = raw.get("token_ids")
    if not isinstance(token_ids, list):
        raise KVEventDecodeError(f"event {index}: token_ids missing or not an array")
    if len(token_ids) > limits.max_token_ids_per_event:
        raise KVEventDecodeError(
            f"event {index}: {len(token_ids)} token IDs, limit {limits.max_token_ids_per_event}"
        )
    if not all(_is_uint(t) for t in token_ids):
        raise KVEventDecodeError(f"event {index}: token_ids must be integers >= 0")
    block_size = raw.get("block_size")
    if not _is_uint(block_size) or not 1 <= block_size <= limits.max_block_size:
        raise KVEventDecodeError(
            f"event {index}: block_size is {block_size!r}, expected 1..{limits.max_block_size}"
        )
    # vLLM stores full blocks only; allow a shorter last block, never more tokens than blocks.
    if (hashes or token_ids) and not (
        (len(hashes) - 1) * block_size < len(token_ids) <= len(hashes) * block_size
    ):
        raise KVEventDecodeError(
            f"event {index}: {len(token_ids)} token IDs for {len(hashes)} blocks of {block_size}"
        )
    return BlockStored(tuple(hashes), parent, tuple(token_ids), block_size)


def _hashes(raw: dict[str, Any], key: str, index: int, limits: KVEventLimits) -> list[int]:
    hashes = raw.get(key)
    if not isinstance(hashes, list):
        raise KVEventDecodeError(f"event {index}: {key} missing or not an array")
    if len(hashes) > limits.max_block_hashes_per_event:
        raise KVEventDecodeError(
            f"event {index}: {len(hashes)} block hashes, limit {limits.max_block_hashes_per_event}"
        )
    for value in hashes:
        if not _is_hash(value):
            raise KVEventDecodeError(
                f"event {index}: block hash {value!r} is not an unsigned 64-bit integer"
            )
    return hashes


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_hash(value: Any) -> bool:
    return _is_uint(value) and value <= MAX_BLOCK_HASH


# -- the sequence-tracking core ---------------------------------------------------------------


@dataclass(frozen=True)
class EventsDecoded:
    """Events to hand to the consumer, in order (seq None for the ``AllBlocksCleared`` of a
    resnapshot or restart)."""

    seq: int | None
    events: tuple[KVCacheEvent, ...]
    skipped_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplayRequested:
    """Ask the replay endpoint for every batch from ``start_seq`` (send :func:`replay_request`);
    feed the answers to :meth:`KVEventStream.receive_replay` and its failure (timeout, socket
    error) to :meth:`KVEventStream.replay_failed`."""

    start_seq: int


@dataclass(frozen=True)
class Resynced:
    """The view was reset (an ``AllBlocksCleared`` follows in an :class:`EventsDecoded`).

    ``reason``: ``"restart"`` (seq went back: a new publisher process) or ``"gap"`` (batches lost
    for good), with ``detail`` for the log.
    """

    reason: str
    detail: str


@dataclass(frozen=True)
class MessageRejected:
    """A message dropped alone (:class:`~ps_p2p.errors.KVEventDecodeError`); log and go on."""

    seq: int | None
    error: KVEventDecodeError


Output = EventsDecoded | ReplayRequested | Resynced | MessageRejected


@dataclass
class KVEventStats:
    """Counters of one stream (or, summed, of a subscriber's ranks)."""

    batches: int = 0  #: batches applied
    events: int = 0  #: events emitted, resnapshots' AllBlocksCleared included
    skipped_events: int = 0  #: events of an unknown type
    rejected: int = 0  #: messages dropped as malformed or over a limit
    duplicates: int = 0  #: batches dropped as already applied
    gaps: int = 0  #: gaps in seq seen
    replays: int = 0  #: replays requested
    replay_failures: int = 0  #: replays that failed, timed out or were abandoned
    resnapshots: int = 0  #: resets after batches were lost for good
    restarts: int = 0  #: publisher restarts (seq went back)

    def add(self, other: KVEventStats) -> None:
        """Add ``other``'s counters to these."""
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


class KVEventStream:
    """One publisher's (one data-parallel rank's) batches in seq order, gaps replayed (sans-I/O).

    Feed it every live message (:meth:`receive_live`), and while :attr:`replaying` every replay
    message (:meth:`receive_replay`) or the replay's failure (:meth:`replay_failed`); execute
    the :class:`ReplayRequested` it returns and hand the :class:`EventsDecoded` to the consumer in
    order. The rules are in the module docstring.

    Args:
        topic: the topic expected exactly, None for any.
        rank: the data-parallel rank expected in payloads that name one; None accepts any.
        replay: whether a replay endpoint exists; without one a gap resnapshots at once.
        limits: see :class:`KVEventLimits`.
    """

    def __init__(
        self,
        *,
        topic: bytes | None = None,
        rank: int | None = None,
        replay: bool = True,
        limits: KVEventLimits = DEFAULT_LIMITS,
    ) -> None:
        self._topic = topic
        self._rank = rank
        self._replay = replay
        self._limits = limits
        self._next_seq = 0
        self._last_live: int | None = None
        self._replaying = False
        self._replayed = 0
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self.block_size: int | None = None
        self.stats = KVEventStats()

    @property
    def next_seq(self) -> int:
        """The seq expected next."""
        return self._next_seq

    @property
    def replaying(self) -> bool:
        """True between a :class:`ReplayRequested` and the replay's end or failure."""
        return self._replaying

    def start(self) -> list[Output]:
        """Catch up on what was published before we subscribed: a replay from seq 0 when a
        replay endpoint exists, else nothing."""
        if not self._replay or self._replaying:
            return []
        return self._request_replay()

    def receive_live(self, frames: Sequence[bytes]) -> list[Output]:
        """One live message ``[topic, seq, payload]``.

        Returns:
            The outputs, in order: events to apply, a replay to request, a rejection to log.
        """
        try:
            seq, payload = parse_live_message(frames, topic=self._topic, limits=self._limits)
        except KVEventDecodeError as exc:
            self.stats.rejected += 1
            return [MessageRejected(None, exc)]
        last_live, self._last_live = self._last_live, seq
        if last_live is not None and seq <= last_live:
            # ZMQ hands us one publisher's messages once each, in order: a new process.
            self.stats.restarts += 1
            detail = f"live seq {seq} after live seq {last_live}: the publisher restarted"
            self._replaying = False
            self._take_pending()
            self._next_seq = 0
            out: list[Output] = [Resynced("restart", detail), *self._cleared()]
            return out + self._live_in_order(seq, payload)
        if self._replaying:
            return self._hold(seq, payload)
        return self._live_in_order(seq, payload)

    def receive_replay(self, frames: Sequence[bytes]) -> list[Output]:
        """One message from the replay endpoint (ignored when no replay is running)."""
        if not self._replaying:
            return []
        try:
            parsed = parse_replay_message(frames, topic=self._topic, limits=self._limits)
        except KVEventDecodeError as exc:
            self.stats.rejected += 1
            return [MessageRejected(None, exc)]
        if isinstance(parsed, ReplayEnd):
            return self._finish_replay()
        seq, payload = parsed
        self._replayed += 1
        if self._replayed > self._limits.max_replay_batches:
            return self.replay_failed(f"more than {self._limits.max_replay_batches} batches")
        if seq < self._next_seq:
            self.stats.duplicates += 1
            return []
        out: list[Output] = []
        if seq > self._next_seq:
            out += self._resnapshot(
                f"replay from {self._next_seq} started at {seq}: the publisher no longer has "
                f"{seq - self._next_seq} batch(es)"
            )
            self._next_seq = seq
        return out + self._apply(seq, payload)

    def replay_failed(self, reason: str) -> list[Output]:
        """The replay failed (timeout, socket error): resnapshot, then apply the held batches."""
        if not self._replaying:
            return []
        self.stats.replay_failures += 1
        self._replaying = False
        out = self._resnapshot(f"replay from {self._next_seq} failed: {reason}")
        held = self._take_pending()
        if held:
            self._next_seq = held[0][0]
        for seq, payload in held:
            if seq > self._next_seq:  # no second replay after a failed one
                out += self._resnapshot(f"seq {seq} after {self._next_seq - 1}, replay failed")
                self._next_seq = seq
            out += self._apply(seq, payload)
        return out

    # -- internals ------------------------------------------------------------------------

    def _live_in_order(self, seq: int, payload: bytes) -> list[Output]:
        if seq < self._next_seq:
            self.stats.duplicates += 1
            return []
        if seq == self._next_seq:
            return self._apply(seq, payload)
        self.stats.gaps += 1
        if self._replay:
            self._hold(seq, payload)
            return self._request_replay()
        out = self._resnapshot(f"seq {seq} after {self._next_seq - 1}, no replay endpoint")
        self._next_seq = seq
        return out + self._apply(seq, payload)

    def _request_replay(self) -> list[Output]:
        self._replaying = True
        self._replayed = 0
        self.stats.replays += 1
        return [ReplayRequested(self._next_seq)]

    def _hold(self, seq: int, payload: bytes) -> list[Output]:
        if seq in self._pending or seq < self._next_seq:
            self.stats.duplicates += 1
            return []
        self._pending[seq] = payload
        self._pending_bytes += len(payload)
        if (
            len(self._pending) > self._limits.max_pending_batches
            or self._pending_bytes > self._limits.max_pending_bytes
        ):
            return self.replay_failed("too many live batches held meanwhile")
        return []

    def _take_pending(self) -> list[tuple[int, bytes]]:
        held = sorted(self._pending.items())
        self._pending.clear()
        self._pending_bytes = 0
        return held

    def _finish_replay(self) -> list[Output]:
        self._replaying = False
        out: list[Output] = []
        for seq, payload in self._take_pending():
            if seq > self._next_seq:
                # The replay ended short of a batch we hold: the batches between are gone.
                out += self._resnapshot(
                    f"replay ended at {self._next_seq - 1}, next held batch is {seq}"
                )
                self._next_seq = seq
            out += self._live_in_order(seq, payload)
        return out

    def _resnapshot(self, detail: str) -> list[Output]:
        self.stats.resnapshots += 1
        return [Resynced("gap", detail), *self._cleared()]

    def _cleared(self) -> list[Output]:
        self.stats.events += 1
        return [EventsDecoded(None, (AllBlocksCleared(),))]

    def _apply(self, seq: int, payload: bytes) -> list[Output]:
        self._next_seq = seq + 1
        try:
            batch = decode_batch(payload, self._limits)
            if (
                self._rank is not None
                and batch.data_parallel_rank is not None
                and batch.data_parallel_rank != self._rank
            ):
                raise KVEventDecodeError(
                    f"batch of data-parallel rank {batch.data_parallel_rank} on the endpoint "
                    f"of rank {self._rank}"
                )
        except KVEventDecodeError as exc:
            self.stats.rejected += 1
            return [MessageRejected(seq, exc)]
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.skipped_events += len(batch.skipped_types)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.block_size = event.block_size
        return [EventsDecoded(seq, batch.events, batch.skipped_types)]


# -- what the consumer has not drained yet ----------------------------------------------------


DEFAULT_MAX_BUFFERED_WEIGHT = 1 << 21
"""Weight of undrained events held (1 per event + 1 per block hash and token ID): ~2M integers,
~70 MB at worst. vLLM stores at most ~max_num_batched_tokens tokens a step, so a consumer that
drains about every second never comes near it."""


class EventBuffer:
    """Events waiting for :meth:`drain`, bounded by weight.

    Past ``max_weight`` the buffer is replaced by a single ``AllBlocksCleared`` (counted in
    ``overflows``), then fills again: the consumer's view is reset rather than wrong, and
    under-reports blocks stored before the overflow until they are stored again.

    Args:
        max_weight: 1 per event plus 1 per block hash and token ID, >= 1.
    """

    def __init__(self, max_weight: int = DEFAULT_MAX_BUFFERED_WEIGHT) -> None:
        if max_weight < 1:
            raise ConfigError(f"max_weight must be >= 1, not {max_weight}")
        self.max_weight = max_weight
        self.overflows = 0
        self._events: list[KVCacheEvent] = []
        self._weight = 0

    def extend(self, events: Sequence[KVCacheEvent]) -> None:
        """Append ``events`` (in order)."""
        for event in events:
            weight = _weight_of(event)
            if self._weight + weight > self.max_weight:
                self.overflows += 1
                self._events = [AllBlocksCleared()]
                self._weight = 1
                if isinstance(event, AllBlocksCleared):
                    continue
            self._events.append(event)
            self._weight += weight

    def drain(self) -> list[KVCacheEvent]:
        """All buffered events, oldest first; the buffer is empty afterwards."""
        events, self._events, self._weight = self._events, [], 0
        return events

    def __len__(self) -> int:
        return len(self._events)


def _weight_of(event: KVCacheEvent) -> int:
    if isinstance(event, BlockStored):
        return 1 + len(event.block_hashes) + len(event.token_ids)
    if isinstance(event, BlockRemoved):
        return 1 + len(event.block_hashes)
    return 1
