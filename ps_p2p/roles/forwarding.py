"""A model node's forwarding: its group's HR-tree, peers' load, and the gossip that keeps both.

PlanetServe sec. 3.3 (Algorithms 1-2; A6): every model node of a group (the model nodes of one
model ID in the verified directory that users may send to: :meth:`~ps_p2p.records.Directory.
serving`, trusted ones, or provisional ones while none is proven) keeps

* the group's HR-tree (:class:`~ps_p2p.gossip.hr_tree.HRTree`): its own subtree, built from its
  engine's KV-cache events (:class:`~ps_p2p.gossip.cache_view.CacheView` ->
  :class:`~ps_p2p.gossip.hr_tree.SubtreePublisher`), and a replica of every peer's subtree
  (:class:`~ps_p2p.gossip.hr_tree.SubtreeReplica`) fed by their signed deltas, with a snapshot
  over ``/planetserve/hrtree-sync/1.0.0`` when a gap shows;
* the peers' load (:class:`~ps_p2p.gossip.load.LoadBook`), fed by their signed load reports
  checked every second and sent when it changed meaningfully or on a heartbeat (DESIGN.md: a
  stale view of load loses most of the gain; :class:`~ps_p2p.gossip.load.LoadReporter`), with the
  requests this node forwarded to a peer counted against it until its next report;
* what it observed of each peer as a forwarder (:class:`~ps_p2p.gossip.load.PeerLedger`): the
  model node reports how each forward ended (:meth:`GroupForwarding.forward_done`); a peer's
  claimed load is held to the latency measured and the forwards outstanding, a failed forward
  bans the peer for a while, and no peer takes more than its share of this node's requests
  (issue 16: one member reporting "idle and instantly fast" took 19 to 22 of 30, now 10);

and routes each admitted request (:meth:`GroupForwarding.route`): its prompt's chunk hashes
(the group key, and the group's chunk lengths L) are searched in the tree and
:class:`~ps_p2p.gossip.forwarding.HRTreeForwarding` (Algorithm 2, one hop, session affinity)
picks this node or a peer. The gossip goes over GossipSub (:mod:`ps_p2p.protocols.hrtree_gossip`).

The group key: derived from ``group_key`` of :class:`ForwardingConfig` (hex), the secret the
operators of a group share (:meth:`ForwardingConfig.key_bytes`); without one a node does not
forward (``ForwardingConfig.active``). Only members speak GossipSub with us
(:class:`~ps_p2p.protocols.hrtree_gossip.MemberGate`).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from ps_p2p.config import ForwardingConfig
from ps_p2p.engines.base import Engine
from ps_p2p.errors import PsError, RemoteProtocolError
from ps_p2p.gossip.hr_tree import Delta, NeedSnapshot, Snapshot
from ps_p2p.gossip.load import (
    ForwardOutcome,
    LoadTracker,
    ReportOutcome,
    decode_report,
    encode_report,
)
from ps_p2p.gossip.router import GroupRouter
from ps_p2p.inference import InferenceQuery
from ps_p2p.keys import Identity
from ps_p2p.protocols import hrtree_gossip as wire
from ps_p2p.records import Directory, Role
from ps_p2p.records.peer_ids import peer_label

log = logging.getLogger(__name__)

#: Seconds between two snapshot fetches from one peer (twice that after a failure).
SNAPSHOT_INTERVAL = 10.0

def engine_cache_blocks(engine: Engine) -> int | None:
    """The engine's KV-cache blocks when it tells (sim engine's params, transformers' prefix
    cache), else None (vLLM: set ``[forwarding] cache_blocks``)."""
    for value in (getattr(getattr(engine, "params", None), "cache_blocks", None),
                  getattr(engine, "prefix_cache_blocks", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class GroupForwarding:
    """The forwarding state and gossip of one model node (module docstring).

    Args:
        identity: the node's identity (signs gossip).
        engine: tokenizes prompts; its KV-cache events (``drain_kv_events``) build the node's
            own subtree.
        load: the node's own :class:`LoadTracker` (its load reports, and F_LB of itself).
        config: :class:`ForwardingConfig`.
        clock: trio time.

    Attributes:
        dropped: gossip messages dropped, by reason.
        decisions: routing decisions, by :class:`~ps_p2p.gossip.forwarding.Reason` value.
    """

    def __init__(self, identity: Identity, engine: Engine, load: LoadTracker,
                 config: ForwardingConfig | None = None, *,
                 clock: Callable[[], float] = trio.current_time,
                 choose: Callable[[int], int] | None = None) -> None:
        self.identity = identity
        self.me = identity.peer_id
        self.engine = engine
        self.model_id = engine.model_id
        self._group = wire.group_of(self.model_id)  # what our envelopes are signed for
        self.config = config or ForwardingConfig()
        self._key = self.config.key_bytes(self.model_id)  # ConfigError without a group_key
        self._clock = clock
        #: the pure routing state and decisions, the very object the simulator drives
        #: (:mod:`ps_p2p.gossip.router`); ties among peers are drawn at random (issue 19)
        self.router = GroupRouter(
            self.me, self.model_id, self._key, load, self.config,
            incarnation=time.time_ns(),
            choose=choose or random.SystemRandom().randrange,
            cache_blocks=engine_cache_blocks(engine),
            block_size=getattr(engine, "block_size", None) or 16)
        self.lengths = self.router.lengths
        self.load = load
        #: the model nodes of our model in the verified directory; ``members``: those (at most
        #: ``max_peers``) whose gossip we follow
        self.group: frozenset[bytes] = frozenset()
        self.members: frozenset[bytes] = frozenset()
        self._next_snapshot: dict[bytes, float] = {}  # peer -> earliest next fetch (pacing)
        self._load_seq = time.time_ns()  # increasing across restarts
        self._need_snapshot: set[bytes] = set()
        self._snapshot_wanted = trio.Event()
        self._changed = trio.Event()
        self._gate: wire.MemberGate | None = None

    # the router's parts, under the names the node, metrics and tests use
    tree = property(lambda self: self.router.tree)
    book = property(lambda self: self.router.book)
    ledger = property(lambda self: self.router.ledger)
    policy = property(lambda self: self.router.policy)
    publisher = property(lambda self: self.router.publisher)
    view = property(lambda self: self.router.view)
    replicas = property(lambda self: self.router.replicas)
    decisions = property(lambda self: self.router.decisions)
    dropped = property(lambda self: self.router.dropped)

    # ------------------------------------------------------------------ membership

    def set_directory(self, directory: Directory | None) -> None:
        """Follow the group of a newly verified directory: model nodes of our model ID (others'
        subtrees and load are dropped)."""
        if directory is None:
            return
        group = frozenset(  # those users may send to (issue 9: the committee's reputation;
            # issue 16: provisional ones only while no node of the model is proven)
            r.peer_id for r in directory.serving(self.model_id)
            if r.peer_id != self.me and Role.MODEL in r.roles
        )
        if group != self.group and self._gate is not None:
            self._gate.refresh()  # pubsub with members only (hrtree_gossip.MemberGate)
        self.group = group
        members = group
        if len(members) > self.config.max_peers:
            # the peers we follow, by a hash keyed with our own ID: nobody can grind peer IDs
            # that every node of the group would pick
            members = frozenset(sorted(members, key=lambda p: hashlib.sha256(
                b"planetserve/v1/group-sample\x00" + self.me + p).digest())
                [: self.config.max_peers])
        listed = {r.peer_id: r.capacity for r in directory.model_nodes()}
        self.router.set_members({p: listed.get(p, 0) for p in members})  # capacities may change
        self.members = members

    async def wait_changed(self) -> None:
        """Wait until the next gossip message or snapshot from a peer is applied."""
        await self._changed.wait()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def is_member(self, peer: bytes) -> bool:
        """Whether ``peer`` is a model node of our group in the verified directory (all of
        them, also beyond the ``max_peers`` whose gossip we follow)."""
        return peer in self.group

    # ------------------------------------------------------------------ routing

    async def route(self, query: InferenceQuery) -> bytes | None:
        """Where to serve ``query``, admitted here and not yet queued (``LoadTracker.routing``:
        it is not in our own Q while routed): a peer of the group, or None for here
        (Algorithms 1-2, :meth:`ps_p2p.gossip.router.GroupRouter.route`)."""
        if not self.config.enabled or not self.members:
            return None
        try:
            prompt = query.prompt or await self.engine.chat_prompt(query.messages)
            ids = await self.engine.encode(prompt)
            chain = self.router.chain(ids)
        except PsError as exc:
            log.info("routing %s: cannot hash the prompt (%s); served here",
                     query.request_id.hex()[:8], exc)
            return None
        decision = self.router.route_chain(chain, len(ids), self._clock(),
                                           query.preferred_model_node or None)
        if decision.forward_to is not None:
            log.info("request %s -> %s (%s, %d of %d tokens cached there)",
                     query.request_id.hex()[:8], peer_label(decision.forward_to),
                     decision.reason.value, decision.matched_tokens, len(ids))
        return decision.forward_to

    def forward_done(self, peer: bytes, outcome: ForwardOutcome, seconds: float) -> None:
        """How a forward :meth:`route` sent to ``peer`` ended, ``seconds`` after it was sent
        (:class:`~ps_p2p.gossip.load.ForwardOutcome`): counted in the ledger (a failure bans
        the peer for a while, OVERLOADED pauses forwards to it). The caller reports every
        forward it sent, once."""
        self.router.forward_done(peer, outcome, seconds, self._clock())
        if outcome is ForwardOutcome.FAILED:
            log.info("forward to %s failed; no forwards to it for a while", peer_label(peer))

    # ------------------------------------------------------------------ own state out

    def absorb_engine_events(self) -> int:
        """Turn the engine's new KV-cache events into subtree operations; returns how many."""
        return self.router.absorb(self.engine.drain_kv_events())

    def load_envelope(self) -> bytes:
        """This node's signed load report, now."""
        self._load_seq += 1
        report = self.router.load_report(self._load_seq)
        return wire.seal(self.identity, wire.KIND_LOAD, encode_report(report), self._group)

    def load_envelope_due(self) -> bytes | None:
        """This node's signed load report if one is due now (a meaningful change since the
        last one, or the heartbeat: :meth:`ps_p2p.gossip.router.GroupRouter.load_report_due`),
        else None."""
        report = self.router.load_report_due(self._load_seq + 1, self._clock())
        if report is None:
            return None
        self._load_seq += 1
        return wire.seal(self.identity, wire.KIND_LOAD, encode_report(report), self._group)

    def delta_envelopes(self) -> list[bytes]:
        """The subtree operations not yet published, as signed delta envelopes."""
        return [wire.seal(self.identity, wire.KIND_DELTA, d.encode(), self._group)
                for d in self.router.take_deltas()]

    def snapshot_envelope(self) -> bytes:
        """This node's whole subtree, signed (the sync protocol's answer)."""
        return wire.seal(self.identity, wire.KIND_SNAPSHOT, self.publisher.snapshot().encode(),
                         self._group)

    # ------------------------------------------------------------------ peers' state in

    def _drop(self, reason: str) -> None:
        self.router._drop(reason)

    def receive(self, publisher: bytes, data: bytes) -> None:
        """A gossip message ``publisher`` published (pubsub's authenticated ``from_id``):
        checked, then applied; a bad one is dropped and counted (never raises)."""
        if publisher == self.me:
            return
        if publisher not in self.members:
            self._drop("not_member")
            return
        try:
            kind, body = wire.open_envelope(data, publisher, self._group)
            if kind == wire.KIND_LOAD:
                report = decode_report(body, publisher, self.model_id)
                outcome = self.router.receive_load(report, self._clock())
                if outcome is not ReportOutcome.ACCEPTED:
                    self._drop(f"load_{outcome.value}")
                    return
            elif kind == wire.KIND_DELTA:
                self._apply_delta(publisher, Delta.decode(body))
            else:
                raise RemoteProtocolError("a snapshot is not gossiped")
            self._signal()
        except PsError as exc:
            self._drop(type(exc).__name__)
            log.debug("gossip from %s dropped: %s", peer_label(publisher), exc)

    def _apply_delta(self, peer: bytes, delta: Delta) -> None:
        outcome = self.router.apply_delta(peer, delta)
        if isinstance(outcome, NeedSnapshot) and peer not in self._need_snapshot:
            self._need_snapshot.add(peer)
            self._snapshot_wanted.set()

    def apply_snapshot(self, peer: bytes, data: bytes) -> None:
        """A sealed snapshot ``peer`` answered to our sync request.

        Raises:
            RemoteProtocolError: malformed, badly signed, or not applicable.
        """
        kind, body = wire.open_envelope(data, peer, self._group,
                                        wire.MAX_SNAPSHOT_ENVELOPE_BYTES)
        if kind != wire.KIND_SNAPSHOT:
            raise RemoteProtocolError("sync answer is not a snapshot")
        if peer in self.members:
            self.router.apply_snapshot(peer, Snapshot.decode(body))
            self._signal()

    # ------------------------------------------------------------------ the service

    async def run(self, host: Any, pubsub: Any, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Gossip on the group's topic, answer snapshot requests and fetch snapshots, until
        cancelled. ``pubsub``: a running Pubsub (:func:`~ps_p2p.protocols.hrtree_gossip.
        running_pubsub`) on ``host``."""
        topic = wire.topic_for(self.model_id)
        # only members' messages within their publisher's budget are taken, relayed on or
        # queued (GossipSub validates before it relays); the envelope's own signature is
        # checked in receive()
        pubsub.set_topic_validator(
            topic, wire.GossipAdmission(self.me, lambda peer: peer in self.members,
                                        clock=self._clock, on_drop=self._drop), False)
        subscription = await pubsub.subscribe(topic)
        self._gate = wire.member_gate(pubsub)  # nobody else reads or writes the topic
        self._gate.admit(self.is_member)
        server = wire.SnapshotServer(  # answers built once per subtree state, budgeted
            self.snapshot_envelope, self.is_member, clock=self._clock,
            state=lambda: (self.publisher.version, self.publisher.incarnation,
                           self.publisher.seq))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, host)
            nursery.start_soon(self._receive_loop, subscription)
            nursery.start_soon(self._publish_loop, pubsub, topic)
            nursery.start_soon(self._sync_loop, host)
            nursery.start_soon(self._connect_loop, host)
            task_status.started()

    async def _receive_loop(self, subscription: Any) -> None:
        async for message in subscription:
            self.receive(bytes(message.from_id), bytes(message.data))

    async def _publish_loop(self, pubsub: Any, topic: str) -> None:
        next_delta = 0.0
        while True:
            now = self._clock()
            try:
                self.absorb_engine_events()
                load = self.load_envelope_due()
                if load is not None:
                    await pubsub.publish(topic, load)
                if now >= next_delta:
                    next_delta = now + self.config.delta_interval
                    for envelope in self.delta_envelopes():
                        await pubsub.publish(topic, envelope)
            except Exception as exc:  # gossip must never stop the node
                log.warning("forwarding gossip: publish failed: %r", exc)
            await trio.sleep(self.config.load_interval)

    async def _sync_loop(self, host: Any) -> None:
        """Fetch the snapshots gaps asked for: a few peers at a time, each peer at most every
        :data:`SNAPSHOT_INTERVAL` seconds (doubling after a failure), so a member that sends
        gapped deltas on purpose cannot make us fetch and apply snapshots all the time."""
        limit = trio.CapacityLimiter(4)

        async def fetch(peer: bytes) -> None:
            async with limit:
                try:
                    self.apply_snapshot(peer, await wire.fetch_snapshot(host, peer))
                    self._next_snapshot[peer] = self._clock() + SNAPSHOT_INTERVAL
                except (PsError, trio.TooSlowError, Exception) as exc:
                    log.info("snapshot of %s failed: %r", peer_label(peer), exc)
                    self._next_snapshot[peer] = self._clock() + 2 * SNAPSHOT_INTERVAL

        async with trio.open_nursery() as nursery:
            while True:
                await self._snapshot_wanted.wait()
                self._snapshot_wanted = trio.Event()
                now = self._clock()
                for peer in sorted(self._need_snapshot):
                    if peer not in self.members:
                        self._need_snapshot.discard(peer)
                    elif self._next_snapshot.get(peer, 0.0) <= now:
                        self._need_snapshot.discard(peer)
                        self._next_snapshot[peer] = now + SNAPSHOT_INTERVAL  # in flight
                        nursery.start_soon(fetch, peer)
                if self._need_snapshot:  # paced ones: look again when the next one is due
                    due = min(self._next_snapshot.get(p, now) for p in self._need_snapshot)
                    with trio.move_on_at(due):
                        await self._snapshot_wanted.wait()
                    self._snapshot_wanted.set()

    async def _connect_loop(self, host: Any) -> None:
        """Keep connections to the group's members (GossipSub meshes over connections)."""
        while True:
            for peer in sorted(self.members):
                if not host.get_network().get_connections(ID(peer)):
                    try:
                        with trio.move_on_after(5):
                            await host.connect(host.get_peerstore().peer_info(ID(peer)))
                    except Exception as exc:
                        log.debug("cannot connect to group member %s: %r", peer_label(peer), exc)
            await trio.sleep(max(1.0, self.config.delta_interval))


__all__ = ["ForwardingConfig", "GroupForwarding"]
