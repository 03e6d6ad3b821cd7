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
  for a signed snapshot of its subtree (one request per stream). Members only, within a budget
  per asker and in total, the answer built once per subtree state (:class:`SnapshotServer`).

What a member may cost us: its gossip is taken within a per-publisher and a total budget of
messages and bytes (:class:`GossipAdmission`, :mod:`ps_p2p.gossip.budget`), checked before
GossipSub delivers or relays a message.

Envelope (bytes)::

    envelope = u8(kind) || body || signature
    signed   = b"planetserve/v1/hrtree-gossip2\\x00" || u8(len(group)) || group || u8(kind)
               || body
    kind     = 1: load report | 2: subtree delta | 3: subtree snapshot (sync answers only)

``signature`` (64 bytes) is the publisher's Ed25519 signature over ``signed``; ``group`` is the
group's model ID (UTF-8, at most 255 bytes). The domain and the group are signed, not sent: a
receiver knows both (its own group), so an envelope of another group or another signed kind
never verifies, and a message costs 65 bytes beside its body (issue 19: the first envelope sent
its 29-byte domain and a 4-byte length, which the pubsub message already gives, with every
load report).

A receiver accepts an envelope only from a model node of its group listed in its verified
directory (the pubsub ``from_id``, checked by strict signing, and our own signature under that
peer ID's key); anything else is dropped and counted, never relayed on by us. Sizes are bounded
(:data:`MAX_ENVELOPE_BYTES`, :data:`MAX_SNAPSHOT_ENVELOPE_BYTES`).

**Who may read the topic** (issue 16: a js-libp2p peer outside the directory subscribed and
received every load report and delta). py-libp2p 0.8.1's Pubsub has no per-peer subscription
filter (``allowed_topics`` filters topics, not peers), and GossipSub sends a topic's messages to
whoever announced a subscription, grafts whoever sends GRAFT (without checking subscriptions)
and answers IWANT from anyone. So the gate sits one level lower, on the pubsub *streams*
(:class:`MemberGate`): every RPC a peer sends (SUBSCRIBE, GRAFT, IWANT, PUBLISH) arrives on the
meshsub stream it opened to us, and everything we send goes on the one we opened to it. The
gate resets an inbound meshsub stream from a peer it does not admit before reading a byte, does
not open ours to such a peer, and when the admitted set shrinks it resets both streams of a peer
that left and drops it from pubsub's and the router's state. What it admits is the forwarding
service's business (the model nodes of the group in the verified directory); until told, it
admits nobody. It relies on three py-libp2p internals, checked by
``tests/test_gossip_gate.py``: ``Pubsub._handle_new_peer`` (replaced on the instance),
``Pubsub.peers`` and ``Pubsub._handle_dead_peer``.
"""

from __future__ import annotations

import logging
import struct
import weakref
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamError

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.gossip.budget import PeerBudget, PublisherBudget
from ps_p2p.gossip.hr_tree import MAX_DELTA_BYTES, MAX_SNAPSHOT_BYTES
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.handlers import StreamHandlers, exchange, reset_quietly, serve_handlers
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.signatures import verify_signature
from ps_p2p.records.types import Signer

log = logging.getLogger(__name__)

HRTREE_SYNC_PROTOCOL_ID = TProtocol("/planetserve/hrtree-sync/1.0.0")
GOSSIPSUB_PROTOCOLS = (TProtocol("/meshsub/1.1.0"), TProtocol("/meshsub/1.0.0"))
ENVELOPE_DOMAIN = b"planetserve/v1/hrtree-gossip2\x00"
KIND_LOAD = 1
KIND_DELTA = 2
KIND_SNAPSHOT = 3
SIGNATURE_BYTES = 64
MAX_GROUP_BYTES = 255
_HEADER = 1  # the kind
#: Bytes an envelope adds to its body: the kind and the signature.
ENVELOPE_OVERHEAD = _HEADER + SIGNATURE_BYTES
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


def _signed(group: bytes, head: bytes) -> bytes:
    if len(group) > MAX_GROUP_BYTES:
        raise RemoteProtocolError(f"group name of {len(group)} bytes (max {MAX_GROUP_BYTES})")
    return ENVELOPE_DOMAIN + struct.pack(">B", len(group)) + group + head


def group_of(model_id: str) -> bytes:
    """The ``group`` an envelope of ``model_id``'s group is signed for (module docstring)."""
    return model_id.encode("utf-8")


def seal(signer: Signer, kind: int, body: bytes, group: bytes) -> bytes:
    """An envelope of ``body`` signed by ``signer`` for ``group`` (module docstring)."""
    head = struct.pack(">B", kind) + body
    return head + signer.sign(_signed(group, head))


def open_envelope(data: bytes, publisher: bytes, group: bytes,
                  max_bytes: int = MAX_ENVELOPE_BYTES) -> tuple[int, bytes]:
    """Check an envelope ``publisher`` signed for ``group``; returns ``(kind, body)``.

    Raises:
        RemoteProtocolError: oversized, malformed, an unknown kind, or a signature that does
            not verify under ``publisher``'s key for ``group`` (InvalidSignatureError).
    """
    if len(data) > max_bytes:
        raise RemoteProtocolError(f"gossip envelope of {len(data)} bytes (max {max_bytes})")
    if len(data) < _HEADER + SIGNATURE_BYTES:
        raise RemoteProtocolError("not an HR-tree gossip envelope")
    kind = data[0]
    if kind not in (KIND_LOAD, KIND_DELTA, KIND_SNAPSHOT):
        raise RemoteProtocolError(f"gossip envelope of unknown kind {kind}")
    head, signature = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
    verify_signature(publisher, _signed(group, head), signature)
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
    ones that reset that stream only, and removed when the block ends. Those handlers are the
    pubsub's :class:`MemberGate` (:func:`member_gate`), which admits nobody until the
    forwarding service says who (module docstring, "Who may read the topic").

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
    gate = MemberGate(host, pubsub)

    for protocol in GOSSIPSUB_PROTOCOLS:
        host.remove_stream_handler(protocol)
    handlers = StreamHandlers(host)
    for protocol in GOSSIPSUB_PROTOCOLS:
        handlers.add(protocol, gate.serve_inbound)
    try:
        async with background_trio_service(pubsub):
            async with background_trio_service(router):
                for service in (pubsub, router):
                    _guard_tasks(service.manager)
                await pubsub.wait_until_ready()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(gate.run)
                    _GATES[pubsub] = gate
                    try:
                        yield pubsub
                    finally:
                        _GATES.pop(pubsub, None)
                        nursery.cancel_scope.cancel()
    finally:
        await handlers.aclose()


_GATES: "weakref.WeakKeyDictionary[Any, MemberGate]" = weakref.WeakKeyDictionary()


def member_gate(pubsub: Any) -> MemberGate:
    """The :class:`MemberGate` of a Pubsub that :func:`running_pubsub` runs.

    Raises:
        KeyError: ``pubsub`` is not one :func:`running_pubsub` is running.
    """
    return _GATES[pubsub]


class MemberGate:
    """Only admitted peers speak GossipSub with this node (module docstring, "Who may read").

    Default: nobody is admitted. :meth:`admit` sets who is; call :meth:`refresh` whenever the
    answer may have changed (a new verified directory). Resources: one set of inbound streams
    per admitted peer (py-libp2p's per-peer stream limits bound it); a refused peer costs one
    stream negotiation and a reset.

    Attributes:
        refused: inbound pubsub streams reset because the peer was not admitted.
        evicted: peers dropped from pubsub when they stopped being admitted.
    """

    def __init__(self, host: IHost, pubsub: Any) -> None:
        from libp2p.peer.id import ID

        self._id = ID
        self._host = host
        self._pubsub = pubsub
        self._admits: Callable[[bytes], bool] = lambda peer: False
        self._inbound: dict[bytes, set[INetStream]] = {}
        self._changed = trio.Event()
        self.refused = 0
        self.evicted = 0
        self._logged: set[bytes] = set()
        # py-libp2p internal (0.8.1): every outbound pubsub stream is opened here, both for a
        # new connection (the notifee's peer queue) and for the retries after a dead stream
        self._open_outbound = pubsub._handle_new_peer
        pubsub._handle_new_peer = self._handle_new_peer

    def admit(self, admits: Callable[[bytes], bool]) -> None:
        """Admit the peers (peer ID bytes) ``admits`` says yes to, from now on."""
        self._admits = admits
        self.refresh()

    def admits(self, peer: bytes) -> bool:
        """Whether ``peer`` may speak GossipSub with us now."""
        try:
            return bool(self._admits(peer))
        except Exception:  # a broken predicate must not open the topic
            log.exception("pubsub gate: admission check failed")
            return False

    def refresh(self) -> None:
        """The admitted set may have changed: drop those that left, connect those that came."""
        self._changed.set()

    async def serve_inbound(self, stream: INetStream) -> None:
        """The meshsub stream handler: a peer not admitted gets its stream reset unread."""
        peer = stream.muxed_conn.peer_id.to_bytes()
        if not self.admits(peer):
            self.refused += 1
            _log_once(self._logged, peer, "pubsub stream from %s refused: not a model node of "
                      "this group", peer_label(peer))
            await reset_quietly(stream)
            return
        streams = self._inbound.setdefault(peer, set())
        streams.add(stream)
        try:
            await self._pubsub.stream_handler(stream)
        except Exception as exc:  # an escaping exception kills the py-libp2p host
            log.info("pubsub stream from %s reset: %r", peer_label(peer), exc)
            await reset_quietly(stream)
        else:
            # its read loop returns at the peer's end of the stream but leaves ours open: the
            # connection would hold the stream as long as it lives (found by the fuzzer). Pubsub
            # writes on streams it opens itself, never on this one: end it.
            await reset_quietly(stream)
        finally:
            streams.discard(stream)
            if not streams and self._inbound.get(peer) is streams:
                del self._inbound[peer]

    async def _handle_new_peer(self, peer_id: Any) -> None:
        if self.admits(peer_id.to_bytes()):
            await self._open_outbound(peer_id)

    async def run(self) -> None:
        """Apply :meth:`refresh` calls until cancelled."""
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            try:
                await self._apply()
            except Exception:  # py-libp2p internals changed under us: keep the node up
                log.exception("pubsub gate: applying the group's membership failed")

    async def _apply(self) -> None:
        pubsub = self._pubsub
        known = {p.to_bytes() for p in list(pubsub.peers)} | set(self._inbound)
        for peer in sorted(known):
            if not self.admits(peer):
                await self._evict(peer)
        connected = self._host.get_network().get_connections_map()
        for peer_id in connected:
            if peer_id not in pubsub.peers and self.admits(peer_id.to_bytes()) \
                    and pubsub.manager.is_running:
                pubsub.manager.run_task(pubsub._handle_new_peer_with_retry, peer_id, 15.0)

    async def _evict(self, peer: bytes) -> None:
        self.evicted += 1
        log.info("pubsub: %s is no longer a model node of this group; dropped",
                 peer_label(peer))
        for stream in list(self._inbound.pop(peer, ())):
            await reset_quietly(stream)
        peer_id = self._id(peer)
        outbound = self._pubsub.peers.get(peer_id)
        if outbound is not None:
            await reset_quietly(outbound)
        # py-libp2p internal: forgets its subscriptions and removes it from the router (mesh,
        # fanout); the retry it schedules ends at once in _handle_new_peer
        self._pubsub._handle_dead_peer(peer_id)


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

    Costs (issue 16: a snapshot of 32k entries took 49 ms of CPU, and a member could ask every
    second): only a member may ask (checked before reading anything); answers are charged to a
    :class:`~ps_p2p.gossip.budget.PeerBudget` (per peer and in total, refused beyond: the
    stream is reset); the sealed answer is built once per subtree state (``state()``: a member
    asking again without a change costs a write), and rebuilt at most every ``min_rebuild``
    seconds whatever the askers (a snapshot at most that much older than the subtree is still
    exact at its ``seq``: the deltas after it bring the asker up to date, as long as it was built
    after the delta the asker missed was taken, hence ``min_rebuild`` below the publisher's
    ``delta_interval``, 2 s by default). Worst case at 32k entries: one 49 ms build a second.

    Args:
        snapshot: returns this node's sealed snapshot envelope (kind 3).
        may_ask: whether a peer may ask (a model node of the group).
        state: a value that changes whenever ``snapshot()`` would (e.g. the publisher's
            ``(version, incarnation, seq)``); None: no caching.
        budget: the answers' budget (default: :data:`~ps_p2p.gossip.budget.SNAPSHOT_PER_PEER`,
            :data:`~ps_p2p.gossip.budget.SNAPSHOT_TOTAL`).
        min_rebuild: seconds between two builds of the answer.
        clock: seconds, monotonic (trio time).

    Attributes:
        served, refused: answers sent; requests refused (not a member, malformed, over budget).
        built: answers built (``snapshot()`` calls).
    """

    def __init__(self, snapshot: Callable[[], bytes], may_ask: Callable[[bytes], bool], *,
                 state: Callable[[], object] | None = None, budget: PeerBudget | None = None,
                 min_rebuild: float = 1.0,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._snapshot = snapshot
        self._may_ask = may_ask
        self._state = state
        self.budget = budget or PeerBudget()
        self.min_rebuild = min_rebuild
        self._clock = clock
        self._cached: tuple[object, float, bytes] | None = None  # (state, built at, envelope)
        self.served = 0
        self.refused = 0
        self.built = 0
        self._logged: set[bytes] = set()

    def answer(self) -> bytes:
        """The sealed snapshot to send now (cached, see the class docstring)."""
        now = self._clock()
        state = self._state() if self._state is not None else None
        cached = self._cached
        if cached is not None and self._state is not None and (
                cached[0] == state or now < cached[1] + self.min_rebuild):
            return cached[2]
        envelope = self._snapshot()
        self.built += 1
        self._cached = (state, now, envelope)
        return envelope

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
            if not self.budget.admit(sender, self._clock()):
                raise RemoteProtocolError("snapshot asked too often (over its budget)")
            await stream.write(encode_frame(self.answer()))
            await stream.close()
            self.served += 1
        except RemoteProtocolError as exc:
            self.refused += 1
            _log_once(self._logged, sender, "snapshot request from %s refused: %s",
                      peer_label(sender), exc)
            await reset_quietly(stream)
        except (StreamError, StreamEOF, trio.TooSlowError) as exc:
            log.info("snapshot stream from %s failed: %r", peer_label(sender), exc)
            await reset_quietly(stream)
        except Exception:
            log.exception("snapshot stream from %s: unexpected error", peer_label(sender))
            await reset_quietly(stream)


def _log_once(logged: set[bytes], peer: bytes, message: str, *args: object) -> None:
    """Log ``message`` at INFO the first time for ``peer`` (at most 1,024 peers remembered,
    then forgotten together), at DEBUG after: a peer repeating itself cannot flood the log."""
    if peer in logged:
        log.debug(message, *args)
        return
    if len(logged) >= 1024:
        logged.clear()
    logged.add(peer)
    log.info(message, *args)


class GossipAdmission:
    """The group topic's validator: which messages a model node takes and relays.

    GossipSub runs it on every message before delivering or relaying it (py-libp2p
    ``Pubsub.set_topic_validator``, synchronous): a message is taken when its publisher (the
    ``from_id`` strict signing checked) is ``me`` or a member, and the
    :class:`~ps_p2p.gossip.budget.PublisherBudget` of that publisher and of all of them covers
    it (issue 16: one publisher's flood of large deltas cost every member CPU without limit).
    A refused message is neither delivered nor relayed and costs nothing more (pubsub caches
    the verdict by message ID). Envelope signatures are checked later, by the receiver.

    Args:
        me: this node's peer ID (its own messages always pass).
        is_member: whether a publisher is a member whose gossip we take.
        budget: default :class:`~ps_p2p.gossip.budget.PublisherBudget` ().
        clock: seconds, monotonic (trio time).
        on_drop: called with a reason (``"not_member"``, ``"over_budget"``) per refusal.
    """

    def __init__(self, me: bytes, is_member: Callable[[bytes], bool], *,
                 budget: PublisherBudget | None = None,
                 clock: Callable[[], float] = trio.current_time,
                 on_drop: Callable[[str], None] = lambda reason: None) -> None:
        self.me = me
        self._is_member = is_member
        self.budget = budget or PublisherBudget()
        self._clock = clock
        self._on_drop = on_drop
        self._logged: set[bytes] = set()

    def __call__(self, forwarder: Any, message: Any) -> bool:
        publisher = bytes(message.from_id)
        if publisher == self.me:
            return True
        if not self._is_member(publisher):
            self._on_drop("not_member")
            return False
        if not self.budget.admit(publisher, len(message.data), self._clock()):
            self._on_drop("over_budget")
            _log_once(self._logged, publisher, "gossip from %s over its budget: dropped "
                      "(%d so far)", peer_label(publisher), self.budget.refused.get(publisher, 0))
            return False
        return True


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
    "ENVELOPE_OVERHEAD",
    "GOSSIPSUB_PROTOCOLS",
    "HRTREE_SYNC_PROTOCOL_ID",
    "KIND_DELTA",
    "KIND_LOAD",
    "KIND_SNAPSHOT",
    "MAX_ENVELOPE_BYTES",
    "MAX_SNAPSHOT_ENVELOPE_BYTES",
    "GossipAdmission",
    "MemberGate",
    "SnapshotServer",
    "fetch_snapshot",
    "group_of",
    "make_pubsub",
    "member_gate",
    "open_envelope",
    "running_pubsub",
    "seal",
    "topic_for",
]
