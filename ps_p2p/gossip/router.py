"""One model node's routing state and decisions, pure: what a deployed node and the simulator run.

PlanetServe sec. 3.3 (Algorithms 1-2). A :class:`GroupRouter` holds, for one model node of a
group:

* the group's HR-tree (:class:`~ps_p2p.gossip.hr_tree.HRTree`): its own subtree, built from its
  engine's KV-cache events (:class:`~ps_p2p.gossip.cache_view.CacheView` ->
  :class:`~ps_p2p.gossip.hr_tree.SubtreePublisher`), and one
  :class:`~ps_p2p.gossip.hr_tree.SubtreeReplica` per peer fed by the peer's deltas and snapshots;
* the peers' load (:class:`~ps_p2p.gossip.load.LoadBook`, the requests this node forwarded to a
  peer counted until its next report) and what this node observed of them
  (:class:`~ps_p2p.gossip.load.PeerLedger`);
* the policy (:class:`~ps_p2p.gossip.forwarding.HRTreeForwarding`, or the
  :class:`~ps_p2p.gossip.forwarding.LeastLoad` baseline), with a tie-break draw.

:meth:`GroupRouter.route` is the one routing path: the model node (``ps_p2p.roles.forwarding``)
calls it for a request it has admitted but not yet queued (``LoadTracker.routing``: the request
is not in the node's own Q while it is routed, issue 19 finding 3), and so does the forwarding
simulator (``ps_p2p.testing.forwarding_sim``), with the same objects, in the same order
(search, decide, record in the ledger, count the forward in the book, mark it sent), and the
same defaults (``ps_p2p.config.ForwardingConfig``; issue 19 finding 5).

**Own routing decisions.** Load: a forward is counted against its peer, once, until the peer's
next report (``LoadBook.note_forwarded``): an optimistic local increment, reconciled when a
newer report arrives (Mitzenmacher, "How useful is old information?", IEEE TPDS 11(1), 2000:
acting on a bulletin board without one's own sends since it makes every dispatcher herd onto
the queue it shows shortest). The other entry nodes' sends since the report are *not* guessed:
in a steady state they replace the requests the peer finished since, so the report plus our
own sends is the unbiased estimate of its queue now (measured: toolbench at 1.1 of saturation,
8 seeds, error of the estimated queue of a peer against the exact one at every decision, mean
-0.01 requests; counting each forward k times for the k entry nodes, the rule before issue
19's third session, +1.75, every peer looking busier than it is, and a holder passed over
after one forward: mean latency 6.85 s with k, 6.09 s once, the central router 5.28 s;
``docs/forwarding.md``, "Decisions" 15).
Cache: a node that sent a
prompt to a peer (or kept it) knows that node will hold the prompt's prefix well before the
node's delta says so (its engine caches the prompt when it prefills it; the delta follows within
``load_interval + delta_interval`` and a gossip delay). Until then the next prompts with that
prefix would miss it and spread the prefix over the group. The router therefore counts, for
:data:`RECENT_HORIZON_INTERVALS` x (``load_interval`` + ``delta_interval``) seconds, each of its
own routes as that node holding the prompt's chunk chain (:class:`_RecentRoutes`, at most
:data:`MAX_RECENT_HASHES` chunk hashes); a search takes, per node, the longer of the tree's and
these matches.

**Tree bounds** (issue 19 finding 4): each peer may hold :func:`tree_limits` entries, sized from
the engine's KV cache (blocks x block size / chunk length, +25%), not a fixed share of a global
cap that a single node's cache overflowed. Past the bound nothing is dropped silently: an own
subtree that overflows stops growing (the engine's later blocks are not advertised; counted in
``dropped["own_tree_full"]``, logged once), a peer's replica that overflows is dropped and
re-fetched by snapshot (counted in ``dropped["peer_tree_full"]``, logged once per peer): that
peer then gets requests by load only, until its subtree fits.

This module is a pure core: no trio, libp2p, protobuf or clock (``now`` is passed in); the
tie-break draw is injected.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from ps_p2p.engines.kv_events import KVCacheEvent
from ps_p2p.errors import HRTreeFullError, PsError
from ps_p2p.gossip import hr_tree
from ps_p2p.gossip.cache_view import CacheView
from ps_p2p.gossip.forwarding import (
    Decision,
    ForwardingConfig,
    HRTreeForwarding,
    LeastLoad,
    Reason,
    RequestContext,
)
from ps_p2p.gossip.hr_tree import (
    Delta,
    HRTree,
    NeedSnapshot,
    Snapshot,
    SubtreePublisher,
    SubtreeReplica,
    SyncOutcome,
)
from ps_p2p.gossip.load import (
    ForwardOutcome,
    LoadBook,
    LoadReport,
    LoadReporter,
    LoadTracker,
    PeerLedger,
    ReportOutcome,
)
from ps_p2p.gossip.sentry import ChunkLengths

__all__ = ["DEFAULT_ASSUMED_CACHE_BLOCKS", "MAX_RECENT_HASHES", "RECENT_HORIZON_INTERVALS",
           "TREE_MARGIN", "GroupRouter", "RouterSettings", "tree_limits"]

log = logging.getLogger(__name__)

DEFAULT_ASSUMED_CACHE_BLOCKS = 32_768
"""KV-cache blocks assumed when neither the config nor the engine tells (about the ~30k vLLM
blocks of an 8B model on an 80 GB GPU)."""
TREE_MARGIN = 1.25
"""Entries allowed per peer beyond what its cache can hold (its gossip lags its cache: evictions
of a delta arrive with the inserts that replaced them)."""


RECENT_HORIZON_INTERVALS = 1.0
"""Own routes are remembered for this many (load_interval + delta_interval): the time until the
chosen node's delta can carry the prefix."""
MAX_RECENT_HASHES = 1 << 16
"""Chunk hashes of remembered routes at most (the oldest routes are forgotten first)."""


class _RecentRoutes:
    """The chunk chains this node recently routed, by the node it routed them to (pure).

    Chunk hashes are chained, so one hash names its whole prefix: a per-hash count of routes per
    node is a trie of the routes, and a walk along a prompt's chain finds each node's depth.
    """

    def __init__(self, horizon: float, max_hashes: int = MAX_RECENT_HASHES) -> None:
        self.horizon = horizon
        self.max_hashes = max_hashes
        self._routes: deque[tuple[float, bytes, Sequence[bytes]]] = deque()
        self._held: dict[bytes, dict[bytes, int]] = {}  # chunk hash -> node -> routes
        self._hashes = 0

    def add(self, node: bytes, chain: Sequence[bytes], now: float) -> None:
        self.expire(now)
        if not chain:
            return
        self._routes.append((now + self.horizon, node, chain))
        self._hashes += len(chain)
        for h in chain:
            by_node = self._held.setdefault(h, {})
            by_node[node] = by_node.get(node, 0) + 1
        while self._hashes > self.max_hashes and self._routes:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, node, chain = self._routes.popleft()
        self._hashes -= len(chain)
        for h in chain:
            by_node = self._held[h]
            left = by_node[node] - 1
            if left:
                by_node[node] = left
            else:
                del by_node[node]
                if not by_node:
                    del self._held[h]

    def expire(self, now: float) -> None:
        while self._routes and self._routes[0][0] <= now:
            self._drop_oldest()

    def depths(self, chain: Sequence[bytes]) -> dict[bytes, int]:
        """Chunks of ``chain`` each node was recently routed, for nodes with at least one."""
        out: dict[bytes, int] = {}
        alive: set[bytes] | None = None
        for d, h in enumerate(chain, start=1):
            by_node = self._held.get(h)
            if not by_node:
                break
            alive = set(by_node) if alive is None else alive & by_node.keys()
            if not alive:
                break
            for node in alive:
                out[node] = d
        return out


class RouterSettings(Protocol):
    """What :class:`GroupRouter` reads of ``ps_p2p.config.ForwardingConfig``."""

    tau_c: int
    prefill_tokens_per_s: float
    hop_seconds: float
    busy_weight: float
    load_max_age: float
    load_heartbeat: float
    load_deadband: float
    load_interval: float
    delta_interval: float
    max_peers: int
    cache_blocks: int

    def lengths(self) -> ChunkLengths: ...


def tree_limits(lengths: ChunkLengths, cache_blocks: int, block_size: int,
                max_peers: int) -> tuple[int, int]:
    """(entries per peer, entries in total) for a group whose nodes cache ``cache_blocks``
    blocks of ``block_size`` tokens, cut by ``lengths``.

    A cached block completes at most ``ceil(block_size / shortest chunk)`` chunks (one at 16-token
    chunks and blocks), each one entry; times :data:`TREE_MARGIN`, at most the snapshot limit
    (:data:`~ps_p2p.gossip.hr_tree.MAX_SNAPSHOT_ENTRIES`). Total: that for every followed peer and
    this node.
    """
    shortest = min((*lengths.lengths, lengths.default))
    per_block = max(1, math.ceil(block_size / shortest))
    per_peer = math.ceil(max(1, cache_blocks) * per_block * TREE_MARGIN)
    per_peer = min(hr_tree.MAX_SNAPSHOT_ENTRIES, per_peer)
    return per_peer, per_peer * (max_peers + 1)


class GroupRouter:
    """The routing state of one model node (module docstring).

    Args:
        self_id: this node's peer ID.
        model_id: the group's model.
        key: the group's HR-tree key (16..64 bytes).
        tracker: this node's :class:`LoadTracker` (its own load, exact).
        settings: ``ps_p2p.config.ForwardingConfig`` (:class:`RouterSettings`).
        incarnation: this run of the node (its subtree's deltas carry it; increasing).
        choose: tie-break draw ``choose(n) -> [0, n)``; a deployed node passes a random one.
        cache_blocks: the engine's KV-cache blocks when ``settings.cache_blocks`` is 0 (None:
            :data:`DEFAULT_ASSUMED_CACHE_BLOCKS`).
        block_size: tokens per KV-cache block.
        least_load: use the :class:`LeastLoad` baseline instead of the HR-tree (benchmarks).
        count_forwards: count our forwards against a peer until its next report (off only for
            the benchmark's stale-view variant).
        ledger: hold peers' reports to what we observed (always on a deployed node).

    Attributes:
        decisions: routing decisions by reason value.
        dropped: what was not applied, by reason (module docstring).
    """

    def __init__(
        self,
        self_id: bytes,
        model_id: str,
        key: bytes,
        tracker: LoadTracker,
        settings: RouterSettings,
        *,
        incarnation: int,
        choose: Callable[[int], int] | None,
        cache_blocks: int | None = None,
        block_size: int = 16,
        least_load: bool = False,
        count_forwards: bool = True,
        ledger: bool = True,
    ) -> None:
        self.me = self_id
        self.model_id = model_id
        self.settings = settings
        self.lengths = settings.lengths()
        self.tau_c = settings.tau_c
        blocks = settings.cache_blocks or cache_blocks or DEFAULT_ASSUMED_CACHE_BLOCKS
        self.per_peer, total = tree_limits(self.lengths, blocks, block_size, settings.max_peers)
        self.tree = HRTree(version=self.lengths.version, max_peers=settings.max_peers + 1,
                           max_entries_per_peer=self.per_peer, max_entries=total)
        self.publisher = SubtreePublisher(self.tree, self_id, incarnation=incarnation)
        self.view = CacheView(self.lengths, key)
        self.key = key
        self.replicas: dict[bytes, SubtreeReplica] = {}
        self.book = LoadBook(self_id, model_id, (), max_age=settings.load_max_age,
                             max_peers=settings.max_peers)
        self.tracker = tracker
        self.reporter = LoadReporter(heartbeat=settings.load_heartbeat,
                                     deadband=settings.load_deadband)
        # a peer holds at most as many of our forwards as we serve at once ourselves
        self.ledger = (PeerLedger(max_outstanding=max(1, tracker.capacity),
                                  max_peers=settings.max_peers) if ledger else None)
        policy_config = ForwardingConfig(
            tau_c=settings.tau_c, prefill_tokens_per_s=settings.prefill_tokens_per_s,
            hop_seconds=settings.hop_seconds, busy_weight=settings.busy_weight)
        self.policy: HRTreeForwarding | LeastLoad = (
            LeastLoad(self_id, tracker, self.book, choose, self.ledger, policy_config)
            if least_load else
            HRTreeForwarding(self_id, tracker, self.book, policy_config, choose, self.ledger))
        self.use_tree = not least_load
        self.recent = _RecentRoutes(RECENT_HORIZON_INTERVALS
                                    * (settings.load_interval + settings.delta_interval))
        self.count_forwards = count_forwards

        self.members: frozenset[bytes] = frozenset()
        self.decisions: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self._full_logged: set[bytes] = set()

    # ------------------------------------------------------------------ membership

    def set_members(self, capacities: Mapping[bytes, int]) -> None:
        """The followed members of the group with their listed capacity (0: none); replicas of
        others are dropped."""
        members = frozenset(p for p in capacities if p != self.me)
        if self.ledger is not None:
            self.ledger.set_members({p: c for p, c in capacities.items() if p != self.me})
        if members == self.members:
            return
        for gone in self.members - members:
            replica = self.replicas.pop(gone, None)
            if replica is not None:
                replica.drop()
        self.members = members
        self.book.set_members(members)

    # ------------------------------------------------------------------ routing

    def chain(self, token_ids: Sequence[int]) -> list[bytes]:
        """The prompt's chunk hashes (Algorithm 1, lines 2-8)."""
        return hr_tree.chunk_hashes(token_ids, self.lengths, self.key)

    def route(self, token_ids: Sequence[int], now: float,
              previous: bytes | None = None) -> Decision:
        """:meth:`route_chain` on the prompt's token IDs.

        Raises:
            LocalProtocolError: a token ID out of [0, 2**32).
        """
        return self.route_chain(self.chain(token_ids), len(token_ids), now, previous)

    def route_chain(self, chain: Sequence[bytes], prompt_tokens: int, now: float,
                    previous: bytes | None = None) -> Decision:
        """Decide where a request this node admitted is served, and book the decision.

        Args:
            chain: the prompt's chunk hashes (:meth:`chain`).
            prompt_tokens: the prompt's length in tokens.
            now: local time, seconds.
            previous: the node the request names as its session's previous one (a hint).

        Returns:
            The decision: ``forward_to`` a fresh, trusted member, or None to serve here. A
            forward is counted in the book and the ledger (:meth:`forward_done` must follow).
        """
        if previous is not None and previous != self.me and previous not in self.members:
            previous = None
        depths: dict[bytes, int] = {}
        if self.use_tree:
            depths = self.tree.match_depths(chain)
            self.recent.expire(now)
            for node, d in self.recent.depths(chain).items():
                if d > depths.get(node, 0):
                    depths[node] = d
        request = RequestContext.from_depths(depths, self.lengths.end, prompt_tokens,
                                             self.tau_c, previous_node=previous)
        decision = self.policy.decide(request, now)
        reason = decision.reason.value
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        if self.ledger is not None:
            self.ledger.record(decision.forward_to, now)
        if self.use_tree and decision.reason is not Reason.NO_CANDIDATES:
            self.recent.add(decision.forward_to or self.me, chain, now)
        if decision.forward_to is not None:
            if self.count_forwards:  # ours, once, until the peer's next report
                self.book.note_forwarded(decision.forward_to)
            if self.ledger is not None:
                self.ledger.sent(decision.forward_to, now)
        return decision

    def forward_done(self, peer: bytes, outcome: ForwardOutcome, seconds: float,
                     now: float) -> None:
        """How a forward :meth:`route_chain` sent to ``peer`` ended, ``seconds`` after it left."""
        if self.ledger is not None:
            self.ledger.done(peer, outcome, seconds, now)

    # ------------------------------------------------------------------ own state out

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def absorb(self, events: Iterable[KVCacheEvent]) -> int:
        """Turn the engine's KV-cache events into subtree operations; returns how many applied.
        An op over the tree's bound is counted, logged once, and skipped (module docstring)."""
        ops = 0
        for event in events:
            try:
                changes = self.view.apply(event)
            except PsError as exc:
                self._drop("engine_event")
                log.warning("KV-cache event not applied: %s", exc)
                continue
            for op in changes:
                try:
                    ops += self.publisher.apply(op)
                except HRTreeFullError as exc:
                    self._drop("own_tree_full")
                    if self.me not in self._full_logged:
                        self._full_logged.add(self.me)
                        log.warning("own HR-subtree full (%d entries per peer): later cached "
                                    "prefixes are not advertised (%s)", self.per_peer, exc)
        return ops

    def load_report(self, seq: int) -> LoadReport:
        """This node's load report now."""
        return self.tracker.report(self.me, self.model_id, seq)

    def load_report_due(self, seq: int, now: float) -> LoadReport | None:
        """This node's load report with ``seq`` if one is due at ``now`` (a meaningful change
        or the heartbeat, :class:`~ps_p2p.gossip.load.LoadReporter`; counted as sent), else
        None. The node's publish loop and the simulator both ask this every
        ``load_interval``."""
        report = self.load_report(seq)
        return report if self.reporter.check(report, now, self.tracker.taken_in) else None

    def take_deltas(self) -> list[Delta]:
        """The subtree operations not yet published."""
        return self.publisher.take_deltas()

    def snapshot(self) -> Snapshot:
        """This node's whole subtree."""
        return self.publisher.snapshot()

    # ------------------------------------------------------------------ peers' state in

    def receive_load(self, report: LoadReport, now: float) -> ReportOutcome:
        """A peer's load report (signature and publisher already checked)."""
        return self.book.receive(report, now)

    def _replica(self, peer: bytes) -> SubtreeReplica:
        replica = self.replicas.get(peer)
        if replica is None:
            replica = self.replicas[peer] = SubtreeReplica(self.tree, peer)
        return replica

    def _peer_full(self, peer: bytes, exc: HRTreeFullError) -> NeedSnapshot:
        self._drop("peer_tree_full")
        if peer not in self._full_logged:
            self._full_logged.add(peer)
            log.warning("HR-subtree of %s over %d entries: dropped, routed by load only until "
                        "a snapshot fits (%s)", peer.hex()[-12:], self.per_peer, exc)
        return NeedSnapshot(None)

    def apply_delta(self, peer: bytes, delta: Delta) -> SyncOutcome:
        """A member's delta. Returns the replica's outcome; :class:`NeedSnapshot` asks the
        caller for a snapshot of ``peer``.

        Raises:
            SubtreeSyncError: a delta of another L version, or malformed.
        """
        if peer not in self.members:
            self._drop("not_member")
            return NeedSnapshot(None)
        try:
            return self._replica(peer).apply_delta(delta)
        except HRTreeFullError as exc:
            return self._peer_full(peer, exc)

    def apply_snapshot(self, peer: bytes, snapshot: Snapshot) -> SyncOutcome | None:
        """A member's snapshot (None: not a member, ignored).

        Raises:
            SubtreeSyncError: of another version, or not canonical.
        """
        if peer not in self.members:
            return None
        try:
            return self._replica(peer).apply_snapshot(snapshot)
        except HRTreeFullError as exc:
            return self._peer_full(peer, exc)
