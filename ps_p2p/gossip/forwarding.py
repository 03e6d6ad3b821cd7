"""Overlay forwarding among the model nodes of a group: serve here or forward (pure core).

Source: PlanetServe sec. 3.3 ("Forwarding logic") and Algorithm 2 of its appendix (Load
Balancing); GenTorrent sec. 3.3 (the earlier version: drop candidates over the load threshold,
and with none left fall back to the miss case). Every model node that receives a request runs
the policy once:

1. A request another model node forwarded is served here: one hop only, so no request bounces
   between nodes whose views of each other's load disagree.
2. Session affinity: a request that names the model node that served the user's previous
   prompt goes there (it holds that conversation's KV cache) unless that node is overloaded,
   or is not a trusted member of the group, or its load is unknown.
3. Algorithm 2 on the HR-tree search (``matched_depth`` chunks matched, held by
   ``cached_peers``): on a hit the holder with the lowest load factor F_LB takes it, unless its
   F_LB reaches the overload threshold; a miss, or an overloaded best holder, goes to the node
   of the group with the lowest F_LB. This node always counts among the candidates.

The candidates are this node and the peers the :class:`~ps_p2p.gossip.load.LoadBook` lists as
members of the group (the trusted model nodes of this model per the verified directory) whose
load report is fresh. A node the directory does not list in this group, an untrusted one, or a
peer whose load is unknown or stale is never chosen, whatever the HR-tree or the request says.

With a :class:`~ps_p2p.gossip.load.PeerLedger` (a deployed node always has one; issue 16), a
peer's claimed load is held to what this node observed of it (measured latency of its answers,
forwards outstanding there, its listed capacity), and a peer that is under penalty for a failed
forward, has its share of outstanding forwards, or already took its share of this node's recent
decisions is no candidate either: a member that reports "idle and instantly fast" takes at most
about 1/k of this node's requests instead of all of them.

Ties of F_LB go to this node first (no forwarding hop for nothing), then to the lowest peer ID,
or, when a ``choose`` callable is injected, to ``tied[choose(len(tied))]`` over the tied peers
sorted by peer ID (one draw per decision, and only when two or more peers tie without this
node): deterministic entry nodes all pick the same idle peer, a random tie-break spreads them.

The policies a benchmark compares share one interface, :class:`ForwardingPolicy`:
:class:`NoForwarding` (every node serves what it receives), :class:`LeastLoad` (F_LB only, no
cache) and :class:`HRTreeForwarding` (this design). A decision never changes the load book: the
caller that actually forwards calls :meth:`~ps_p2p.gossip.load.LoadBook.note_forwarded`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from ps_p2p.errors import ConfigError, LocalProtocolError
from ps_p2p.gossip.load import LoadBook, LoadTracker, PeerLedger, load_factor

__all__ = [
    "DEFAULT_OVERLOAD_THRESHOLD",
    "DEFAULT_TAU_C",
    "Decision",
    "ForwardingConfig",
    "ForwardingPolicy",
    "HRTreeForwarding",
    "LeastLoad",
    "NoForwarding",
    "PrefixMatch",
    "Reason",
    "RequestContext",
    "load_balance",
]

DEFAULT_TAU_C = 1
"""tau_c: chunks the HR-tree must match for a hit. The Sentry (PlanetServe appendix A3) makes the
first chunk a common system prompt, so one matched chunk is already a reusable prefix."""

DEFAULT_OVERLOAD_THRESHOLD = 5.0
"""F_LB in seconds from which a node counts as overloaded (Algorithm 2 L7's threshold). F_LB is
about the latency of the work queued per slot; past ~5 s the wait exceeds what reusing a
prefix's KV cache saves on prefill for prompts of a few thousand tokens. A tunable: the
forwarding benchmark should sweep it."""

Chooser = Callable[[int], int]
"""``choose(n) -> i`` with 0 <= i < n, e.g. ``random.Random(seed).randrange``."""


class Reason(enum.Enum):
    """Which rule made a :class:`Decision` (for logs and reports)."""

    ALREADY_FORWARDED = "already_forwarded"  # a peer forwarded it: served here, one hop only
    NO_FORWARDING = "no_forwarding"  # the NoForwarding baseline
    AFFINITY = "affinity"  # the node that served the session's previous prompt
    CACHE_HIT = "cache_hit"  # least-loaded holder of the matched prefix (Alg.2 L6-L8)
    OVERLOADED_FALLBACK = "overloaded_fallback"  # best holder overloaded: least loaded (L10)
    HOLDERS_UNAVAILABLE = "holders_unavailable"  # hit, but no holder usable: miss case
    LEAST_LOADED = "least_loaded"  # a miss: least-loaded node of the group (L3-L4)
    NO_CANDIDATES = "no_candidates"  # no peer with a known load: served here


class PrefixMatch(Protocol):
    """What the HR-tree search answers (``ps_p2p.gossip.hr_tree``'s ``SearchResult``)."""

    @property
    def peers(self) -> frozenset[bytes]:
        """Model nodes holding the longest matched prefix."""
        ...

    @property
    def depth(self) -> int:
        """Chunks of the prompt matched."""
        ...


@dataclass(frozen=True)
class RequestContext:
    """What the forwarding decision needs to know of one request.

    Attributes:
        cached_peers: model nodes holding the prompt's longest matched prefix (HR-tree search);
            this node may be among them.
        matched_depth: chunks of the prompt the HR-tree matched (>= 0).
        forwarded: the request came from another model node (the forward protocol), not from
            a user's proxies.
        previous_node: the model node that served the session's previous prompt, if the
            request names one (the request's preferred model node); a user sets it, so it is
            only a hint.

    Raises:
        LocalProtocolError: ``matched_depth`` < 0.
    """

    cached_peers: frozenset[bytes] = frozenset()
    matched_depth: int = 0
    forwarded: bool = False
    previous_node: bytes | None = None

    def __post_init__(self) -> None:
        if self.matched_depth < 0:
            raise LocalProtocolError("matched_depth must be >= 0")

    @classmethod
    def from_search(
        cls, match: PrefixMatch, *, forwarded: bool = False, previous_node: bytes | None = None
    ) -> RequestContext:
        """A context from an HR-tree search result (anything with ``peers`` and ``depth``)."""
        return cls(frozenset(match.peers), match.depth, forwarded, previous_node)


@dataclass(frozen=True)
class Decision:
    """Serve here or forward to one peer, and why.

    Attributes:
        forward_to: the peer to forward to; None to serve here.
        reason: the rule that decided.
        load_factor: F_LB (seconds) of the chosen node when loads were compared, else None.
        cache_hit: the HR-tree search was a hit (depth >= tau_c and some holder).
        affinity_overridden: the request named a previous node that was not chosen because it
            was overloaded, unknown, untrusted, of another group or had a stale load.
    """

    forward_to: bytes | None
    reason: Reason
    load_factor: float | None = None
    cache_hit: bool = False
    affinity_overridden: bool = False

    @property
    def serve_locally(self) -> bool:
        """True when this node serves the request itself."""
        return self.forward_to is None


@dataclass(frozen=True)
class ForwardingConfig:
    """Thresholds of Algorithm 2.

    Attributes:
        tau_c: a search that matched fewer chunks is a miss (>= 1).
        overload_threshold: F_LB in seconds; a node at or above it is overloaded (> 0).

    Raises:
        ConfigError: a value out of range.
    """

    tau_c: int = DEFAULT_TAU_C
    overload_threshold: float = DEFAULT_OVERLOAD_THRESHOLD

    def __post_init__(self) -> None:
        if self.tau_c < 1:
            raise ConfigError("tau_c must be >= 1 chunk")
        if not self.overload_threshold > 0:
            raise ConfigError("overload_threshold must be > 0 seconds")


class ForwardingPolicy(Protocol):
    """The interface every forwarding policy offers (ours and the benchmark's baselines)."""

    name: str

    def decide(self, request: RequestContext, now: float) -> Decision:
        """Serve ``request`` here or forward it; ``now`` in seconds (ages of load reports)."""
        ...


# ---------------------------------------------------------------------------------- Algorithm 2


def _least_loaded(
    self_id: bytes, loads: Mapping[bytes, float], choose: Chooser | None
) -> tuple[bytes, float]:
    """The node of ``loads`` (non-empty) with the lowest F_LB; ties: self, then peer ID/choose."""
    best = min(loads.values())
    tied = sorted(p for p, f in loads.items() if f == best)
    if self_id in tied:
        return self_id, best
    if choose is None or len(tied) == 1:
        return tied[0], best
    index = choose(len(tied))
    if not 0 <= index < len(tied):
        raise LocalProtocolError(f"choose({len(tied)}) returned {index}")
    return tied[index], best


def _to(self_id: bytes, node: bytes) -> bytes | None:
    return None if node == self_id else node


def load_balance(
    self_id: bytes,
    self_load: float,
    peer_loads: Mapping[bytes, float],
    cached_peers: frozenset[bytes],
    matched_depth: int,
    config: ForwardingConfig,
    choose: Chooser | None = None,
) -> Decision:
    """Algorithm 2 (Load Balancing) of PlanetServe's appendix, on loads already gathered; pure.

    Args:
        self_id: this node's peer ID.
        self_load: this node's F_LB in seconds.
        peer_loads: F_LB of every usable peer (trusted member of the group, fresh load), by peer
            ID; must not contain ``self_id``.
        cached_peers: holders of the longest matched prefix (HR-tree search); holders missing
            from ``peer_loads`` (and not this node) are ignored.
        matched_depth: chunks matched.
        config: tau_c and the overload threshold.
        choose: tie-break among peers (see the module docstring); None: lowest peer ID.

    Returns:
        A decision with reason CACHE_HIT, OVERLOADED_FALLBACK, HOLDERS_UNAVAILABLE,
        LEAST_LOADED or NO_CANDIDATES (no usable peer: served here).
    """
    group = {**peer_loads, self_id: self_load}
    # Alg.2 L2: modelNodeList <- search(HRTree, request, tau_c), restricted to usable nodes
    hit = matched_depth >= config.tau_c and bool(cached_peers)
    holders = {p: group[p] for p in cached_peers if p in group} if hit else {}

    def fallback(reason: Reason) -> Decision:
        if not peer_loads:  # nobody else to compare with: served here
            return Decision(None, Reason.NO_CANDIDATES, self_load, hit)
        node, f_lb = _least_loaded(self_id, group, choose)
        return Decision(_to(self_id, node), reason, f_lb, hit)

    if not hit:  # Alg.2 L3: cache miss
        return fallback(Reason.LEAST_LOADED)  # Alg.2 L4: fewest relative requests
    if not holders:  # GenTorrent sec. 3.3: no candidate left, revert to the miss case
        return fallback(Reason.HOLDERS_UNAVAILABLE)
    # Alg.2 L5-L6: cache hit; candidate <- least-loaded node of modelNodeList
    candidate, f_lb = _least_loaded(self_id, holders, choose)
    if f_lb < config.overload_threshold:  # Alg.2 L7: candidate.load < threshold
        return Decision(_to(self_id, candidate), Reason.CACHE_HIT, f_lb, hit)  # Alg.2 L8
    return fallback(Reason.OVERLOADED_FALLBACK)  # Alg.2 L9-L10: fall back to load balancing


# ---------------------------------------------------------------------------------- policies


def _group_loads(
    self_id: bytes, tracker: LoadTracker, book: LoadBook, now: float,
    ledger: PeerLedger | None = None,
) -> tuple[float, dict[bytes, float]]:
    """This node's F_LB and that of every usable peer (member, fresh report, not self; with a
    ledger: not refused by it, and its F_LB as the ledger judges it)."""
    self_load = load_factor(
        tracker.latency_ewma, tracker.requests, tracker.capacity, book.unknown_latency
    )
    members = book.members
    fresh = {p: load for p, load in book.fresh_loads(now).items()
             if p in members and p != self_id}
    if ledger is None:
        return self_load, {p: load.load_factor(book.unknown_latency) for p, load in fresh.items()}
    group_size = len(members - {self_id}) + 1
    return self_load, {
        p: ledger.judge(load, book.unknown_latency) for p, load in fresh.items()
        if ledger.refusal(p, now, group_size) is None
    }


class NoForwarding:
    """Baseline: every model node serves the requests it receives."""

    name = "no-forwarding"

    def decide(self, request: RequestContext, now: float) -> Decision:
        """Always serve here (reason ALREADY_FORWARDED or NO_FORWARDING)."""
        reason = Reason.ALREADY_FORWARDED if request.forwarded else Reason.NO_FORWARDING
        return Decision(None, reason)


class LeastLoad:
    """Baseline: the node of the group with the lowest F_LB, ignoring the HR-tree and affinity.

    Args:
        self_id: this node's peer ID.
        tracker: this node's :class:`~ps_p2p.gossip.load.LoadTracker`.
        book: the group's :class:`~ps_p2p.gossip.load.LoadBook` (members and their loads).
        choose: tie-break among peers (module docstring); None: lowest peer ID.
        ledger: what this node observed of its peers (module docstring); None: reports taken
            at their word (simulations of an honest group).
    """

    name = "least-load"

    def __init__(
        self,
        self_id: bytes,
        tracker: LoadTracker,
        book: LoadBook,
        choose: Chooser | None = None,
        ledger: PeerLedger | None = None,
    ) -> None:
        self.self_id = self_id
        self.tracker = tracker
        self.book = book
        self.choose = choose
        self.ledger = ledger

    def decide(self, request: RequestContext, now: float) -> Decision:
        """ALREADY_FORWARDED, else LEAST_LOADED (or NO_CANDIDATES with no usable peer)."""
        if request.forwarded:
            return Decision(None, Reason.ALREADY_FORWARDED)
        self_load, peers = _group_loads(self.self_id, self.tracker, self.book, now, self.ledger)
        return load_balance(
            self.self_id, self_load, peers, frozenset(), 0, ForwardingConfig(), self.choose
        )


class HRTreeForwarding:
    """PlanetServe's forwarding: one hop, session affinity, then Algorithm 2 (module docstring).

    Args:
        self_id: this node's peer ID.
        tracker: this node's :class:`~ps_p2p.gossip.load.LoadTracker` (its own F_LB, exact).
        book: the group's :class:`~ps_p2p.gossip.load.LoadBook`: its members are the trusted
            model nodes of this node's group, its fresh reports their loads.
        config: tau_c and the overload threshold.
        choose: tie-break among peers (module docstring); None: lowest peer ID.
        ledger: what this node observed of its peers (module docstring); None: reports taken
            at their word (simulations of an honest group).
    """

    name = "hr-tree"

    def __init__(
        self,
        self_id: bytes,
        tracker: LoadTracker,
        book: LoadBook,
        config: ForwardingConfig | None = None,
        choose: Chooser | None = None,
        ledger: PeerLedger | None = None,
    ) -> None:
        self.self_id = self_id
        self.tracker = tracker
        self.book = book
        self.config = config or ForwardingConfig()
        self.choose = choose
        self.ledger = ledger

    def decide(self, request: RequestContext, now: float) -> Decision:
        """Serve ``request`` here or forward it to one peer of the group.

        Args:
            request: the HR-tree search result and the request's flags.
            now: local time in seconds; reports older than the book's ``max_age`` are unknown.

        Returns:
            The decision; ``forward_to`` is always a fresh, trusted member of the group (and
            one the ledger does not refuse).
        """
        if request.forwarded:  # one hop only: a forwarded request is served where it lands
            return Decision(None, Reason.ALREADY_FORWARDED)
        self_load, peers = _group_loads(self.self_id, self.tracker, self.book, now, self.ledger)
        hit = request.matched_depth >= self.config.tau_c and bool(request.cached_peers)
        overridden = False
        previous = request.previous_node
        if previous is not None:
            f_lb = self_load if previous == self.self_id else peers.get(previous)
            if f_lb is not None and f_lb < self.config.overload_threshold:
                return Decision(_to(self.self_id, previous), Reason.AFFINITY, f_lb, hit)
            overridden = True  # overloaded, or not a usable member: Algorithm 2 decides
        decision = load_balance(  # Alg.2 L1: LoadBalancing(HRTree, request, tau_c)
            self.self_id,
            self_load,
            peers,
            request.cached_peers,
            request.matched_depth,
            self.config,
            self.choose,
        )
        return replace(decision, affinity_overridden=overridden) if overridden else decision
