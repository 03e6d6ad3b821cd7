"""Overlay forwarding among the model nodes of a group: serve here or forward (pure core).

Source: PlanetServe sec. 3.3 ("Forwarding logic") and Algorithm 2 of its appendix (Load
Balancing); GenTorrent sec. 3.3 (the earlier version: drop candidates over the load threshold,
and with none left fall back to the miss case). Every model node that receives a request runs
the policy once:

1. A request another model node forwarded is served here: one hop only, so no request bounces
   between nodes whose views of each other's load disagree.
2. Session affinity: a request that names the model node that served the user's previous
   prompt goes there (it holds that conversation's KV cache) unless the request would wait for
   a slot there while another node of the group would start it sooner, or that node is not a
   trusted member of the group, or its load is unknown.
3. Algorithm 2, cost-aware (issue 19). For every candidate node n the policy estimates what
   serving the request there costs, in seconds::

       cost(n) = wait(n) + (P - M(n)) / R + busy_weight * (P / R) * running(n) / C(n) + hop(n)

   * ``wait(n) = L(n) * Q'(n) / C(n)``: Algorithm 2's load factor F_LB with the paper's Q, the
     requests *waiting* (sec. 3.3), counted with this request added: ``Q' = Q + 1`` when no slot
     is free, 0 when one is. It is the expected queueing delay, and it is 0 on any node with a
     free slot, whatever its output lengths (finding 1 of issue 19: Q counted the running
     requests and was compared with a fixed threshold, so long outputs made every node
     "overloaded" and the policy cache-oblivious);
   * ``(P - M(n)) / R``: the prefill left to compute, P the prompt's tokens, M(n) the tokens of
     its prefix node n holds (the HR-tree, Algorithm 1, per holder; a match shorter than
     ``tau_c`` chunks counts 0), R the prefill throughput (tokens/s). A hit is worth exactly
     the prefill it saves, so a shared system prompt of 100 tokens weighs 100 tokens, not
     "a hit" (finding 2: with tau_c = 1 such a match made its first holders the only choice);
   * ``busy_weight * (P / R) * running / C``: a busy slot costs, at weight 1, this prompt's whole
     prefill per full batch. A holder therefore takes a request while the fraction of the prompt
     it holds beyond the others' exceeds its extra occupancy; past that an idler node takes it,
     caches the prefix, and a hot prefix is replicated instead of queueing at one node. The
     term is scale-free (relative to the group's occupancies and to the prompt's own prefill),
     so it does not depend on output lengths either;
   * ``hop(n)``: ``hop_seconds`` for a peer, 0 here (ties stay here: no hop for nothing).

   The node with the lowest cost takes the request. The reason reported follows Algorithm 2's
   branches: CACHE_HIT when it holds the longest match among the candidates, OVERLOADED_FALLBACK
   when a holder of a longer match was passed over for its load, LEAST_LOADED on a miss.

The candidates are this node and the peers the :class:`~ps_p2p.gossip.load.LoadBook` lists as
members of the group (the trusted model nodes of this model per the verified directory) whose
load report is fresh. A node the directory does not list in this group, an untrusted one, or a
peer whose load is unknown or stale is never chosen, whatever the HR-tree or the request says.

With a :class:`~ps_p2p.gossip.load.PeerLedger` (a deployed node always has one; issue 16), a
peer's claimed load is held to what this node observed of it (measured latency of its answers,
forwards outstanding there, its listed capacity), and a peer that is under penalty for a failed
forward, has its share of outstanding forwards, or already took its share of this node's recent
decisions is no candidate either: a member that reports "idle and instantly fast" takes at most
about 1/k of this node's requests instead of all of them. One exception (issue 19): a peer past
its fair share but under the ledger's ``max_share`` (1/2) stays a candidate for a request whose
longest match only such peers hold, since a hot prefix's holder serves it at a fraction of the
cost (a member that also advertises prefixes it does not hold takes at most ``max_share``).

Ties of cost (every idle node of equal match) go to this node first, then, when a ``choose``
callable is injected, to ``tied[choose(len(tied))]`` over the tied peers sorted by peer ID (one
draw per decision, only when two or more peers tie without this node), else to the lowest peer
ID. A deployed node injects a random draw (``ps_p2p.gossip.router``): deterministic entry nodes
all picked the same lowest-ID idle peer on a miss (finding 3).

The policies a benchmark compares share one interface, :class:`ForwardingPolicy`:
:class:`NoForwarding` (every node serves what it receives), :class:`LeastLoad` (load only, no
cache) and :class:`HRTreeForwarding` (this design). A decision never changes the load book: the
caller that actually forwards calls :meth:`~ps_p2p.gossip.load.LoadBook.note_forwarded`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from ps_p2p.errors import ConfigError, LocalProtocolError
from ps_p2p.gossip.load import LoadBook, LoadTracker, PeerLedger, PeerLoad

__all__ = [
    "DEFAULT_BUSY_WEIGHT",
    "DEFAULT_HOP_SECONDS",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "DEFAULT_TAU_C",
    "Decision",
    "ForwardingConfig",
    "ForwardingPolicy",
    "HRTreeForwarding",
    "LeastLoad",
    "NoForwarding",
    "NodeLoad",
    "Reason",
    "RequestContext",
    "load_balance",
]

DEFAULT_TAU_C = 1
"""tau_c: chunks a node must hold for its match to count (Algorithm 2's threshold). With the
cost model a short match weighs only the prefill it saves, so one chunk is enough."""

DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
"""R: prompt tokens a node prefills per second, converting matched tokens into seconds saved.
The cost model's estimate for Llama-3-8B on an A6000 (``ps_p2p.engines.sim_cost``); an operator
sets the engine's (only the ratio of queueing delay to prefill matters)."""

DEFAULT_HOP_SECONDS = 0.05
"""What one forwarding hop costs (a stream to a peer and the answer relayed back): a tie, or a
gain smaller than this, is served here."""

DEFAULT_BUSY_WEIGHT = 1.0
"""Weight of a node's occupancy (running / C) in units of this prompt's whole prefill (module
docstring). 0 is Algorithm 2 with the paper's Q alone: every request goes to the best holder
until its slots are full, so a hot prefix stays on one node."""

Chooser = Callable[[int], int]
"""``choose(n) -> i`` with 0 <= i < n, e.g. ``random.Random(seed).randrange``."""

_TIE = 1e-9  # seconds: costs closer than this are equal


class Reason(enum.Enum):
    """Which rule made a :class:`Decision` (for logs and reports)."""

    ALREADY_FORWARDED = "already_forwarded"  # a peer forwarded it: served here, one hop only
    NO_FORWARDING = "no_forwarding"  # the NoForwarding baseline
    AFFINITY = "affinity"  # the node that served the session's previous prompt
    CACHE_HIT = "cache_hit"  # a holder of the longest usable match (Alg.2 L6-L8)
    OVERLOADED_FALLBACK = "overloaded_fallback"  # that holder cost more for its load (L10)
    HOLDERS_UNAVAILABLE = "holders_unavailable"  # holders, but none usable: miss case
    LEAST_LOADED = "least_loaded"  # a miss: least-loaded node of the group (L3-L4)
    NO_CANDIDATES = "no_candidates"  # no peer with a known load: served here


@dataclass(frozen=True)
class NodeLoad:
    """One candidate's load as the policy sees it.

    Attributes:
        latency: L, seconds (the service latency EWMA, or the prior of a node without sample).
        waiting: Q, requests waiting for a slot (>= 0).
        running: requests in service (>= 0).
        capacity: C, slots (>= 1).
    """

    latency: float
    waiting: int
    running: int
    capacity: int

    @property
    def load_factor(self) -> float:
        """F_LB = L * Q / C with Q the requests waiting (sec. 3.3), seconds."""
        return self.latency * self.waiting / self.capacity

    @property
    def wait(self) -> float:
        """Expected seconds one more request waits for a slot: F_LB with it added to Q when no
        slot is free, 0 when one is."""
        if self.waiting == 0 and self.running < self.capacity:
            return 0.0
        return self.latency * (self.waiting + 1) / self.capacity

    @property
    def occupancy(self) -> float:
        """running / C, in [0, 1]."""
        return min(1.0, self.running / self.capacity)

    @classmethod
    def of_tracker(cls, tracker: LoadTracker, unknown_latency: float) -> NodeLoad:
        """This node's own load (requests being routed are not in it)."""
        latency = unknown_latency if tracker.latency_ewma is None else tracker.latency_ewma
        return cls(latency, tracker.queued, tracker.in_service, tracker.capacity)

    @classmethod
    def of_peer(cls, load: PeerLoad, unknown_latency: float) -> NodeLoad:
        """A peer's load from its report and our forwards since (:class:`PeerLoad`)."""
        latency = unknown_latency if load.latency_ewma is None else load.latency_ewma
        return cls(latency, load.waiting, load.running, max(1, load.capacity))


@dataclass(frozen=True)
class RequestContext:
    """What the forwarding decision needs to know of one request.

    Attributes:
        matched: tokens of the prompt's prefix each node holds, by peer ID (this node may be
            among them): the HR-tree's per-holder match (:meth:`~ps_p2p.gossip.hr_tree.HRTree.
            match_depths`) in tokens, 0 or absent for a node holding less than tau_c chunks.
        prompt_tokens: P, the prompt's tokens (>= every matched value).
        forwarded: the request came from another model node (the forward protocol), not from
            a user's proxies.
        previous_node: the model node that served the session's previous prompt, if the
            request names one (the request's preferred model node); a user sets it, so it is
            only a hint.

    Raises:
        LocalProtocolError: a negative token count.
    """

    matched: Mapping[bytes, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    forwarded: bool = False
    previous_node: bytes | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or any(m < 0 for m in self.matched.values()):
            raise LocalProtocolError("token counts must be >= 0")

    @classmethod
    def from_depths(
        cls,
        depths: Mapping[bytes, int],
        chunk_end: Callable[[int], int],
        prompt_tokens: int,
        tau_c: int,
        *,
        forwarded: bool = False,
        previous_node: bytes | None = None,
    ) -> RequestContext:
        """A context from the HR-tree's per-holder depths in chunks; ``chunk_end(i)``: the
        token position after chunk i (``ChunkLengths.end``). Depths below ``tau_c`` count 0."""
        matched = {p: min(prompt_tokens, chunk_end(d - 1)) for p, d in depths.items()
                   if d >= tau_c and d > 0}
        return cls(matched, prompt_tokens, forwarded, previous_node)


@dataclass(frozen=True)
class Decision:
    """Serve here or forward to one peer, and why.

    Attributes:
        forward_to: the peer to forward to; None to serve here.
        reason: the rule that decided.
        load_factor: F_LB (seconds, Q waiting) of the chosen node when loads were compared.
        cache_hit: some usable node held a match (the request's prefix is cached in the group).
        affinity_overridden: the request named a previous node that was not chosen because a
            request would wait there longer than elsewhere, or it is unknown, untrusted, of
            another group or had a stale load.
        cost: the chosen node's estimated cost in seconds (module docstring), when compared.
        matched_tokens: tokens of the prompt the chosen node holds.
    """

    forward_to: bytes | None
    reason: Reason
    load_factor: float | None = None
    cache_hit: bool = False
    affinity_overridden: bool = False
    cost: float | None = None
    matched_tokens: int = 0

    @property
    def serve_locally(self) -> bool:
        """True when this node serves the request itself."""
        return self.forward_to is None


@dataclass(frozen=True)
class ForwardingConfig:
    """Parameters of the cost-aware Algorithm 2 (module docstring).

    Attributes:
        tau_c: chunks a node must hold for its match to count (>= 1).
        prefill_tokens_per_s: R, tokens/s (> 0).
        hop_seconds: cost of forwarding (>= 0).
        busy_weight: weight of occupancy, in this prompt's prefills per full batch (>= 0).

    Raises:
        ConfigError: a value out of range.
    """

    tau_c: int = DEFAULT_TAU_C
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    hop_seconds: float = DEFAULT_HOP_SECONDS
    busy_weight: float = DEFAULT_BUSY_WEIGHT

    def __post_init__(self) -> None:
        if self.tau_c < 1:
            raise ConfigError("tau_c must be >= 1 chunk")
        if not 0 < self.prefill_tokens_per_s < math.inf:
            raise ConfigError("prefill_tokens_per_s must be > 0")
        if not 0 <= self.hop_seconds < math.inf or not 0 <= self.busy_weight < math.inf:
            raise ConfigError("hop_seconds and busy_weight must be >= 0")


class ForwardingPolicy(Protocol):
    """The interface every forwarding policy offers (ours and the benchmark's baselines)."""

    name: str

    def decide(self, request: RequestContext, now: float) -> Decision:
        """Serve ``request`` here or forward it; ``now`` in seconds (ages of load reports)."""
        ...


# ---------------------------------------------------------------------------------- Algorithm 2


def _to(self_id: bytes, node: bytes) -> bytes | None:
    return None if node == self_id else node


def _cheapest(self_id: bytes, costs: Mapping[bytes, float], choose: Chooser | None) -> bytes:
    """The node of ``costs`` (non-empty) with the lowest cost; ties: self, then choose/ID."""
    best = min(costs.values())
    tied = sorted(p for p, c in costs.items() if c <= best + _TIE)
    if self_id in tied:
        return self_id
    if choose is None or len(tied) == 1:
        return tied[0]
    index = choose(len(tied))
    if not 0 <= index < len(tied):
        raise LocalProtocolError(f"choose({len(tied)}) returned {index}")
    return tied[index]


def node_cost(load: NodeLoad, matched: int, prompt_tokens: int, config: ForwardingConfig,
              hop: bool) -> float:
    """cost(n) of the module docstring, seconds."""
    rate = config.prefill_tokens_per_s
    return (load.wait + max(0, prompt_tokens - matched) / rate
            + config.busy_weight * (prompt_tokens / rate) * load.occupancy
            + (config.hop_seconds if hop else 0.0))


def load_balance(
    self_id: bytes,
    self_load: NodeLoad,
    peer_loads: Mapping[bytes, NodeLoad],
    request: RequestContext,
    config: ForwardingConfig,
    choose: Chooser | None = None,
) -> Decision:
    """Algorithm 2 (Load Balancing) of PlanetServe's appendix, cost-aware (module docstring).

    Args:
        self_id: this node's peer ID.
        self_load: this node's load (without the request being routed).
        peer_loads: every usable peer's load (trusted member of the group, fresh load), by
            peer ID; must not contain ``self_id``.
        request: the per-node matched tokens and the prompt's length; holders missing from
            ``peer_loads`` (and not this node) are ignored.
        config: the cost model's parameters.
        choose: tie-break among peers (module docstring); None: lowest peer ID.

    Returns:
        A decision with reason CACHE_HIT, OVERLOADED_FALLBACK, HOLDERS_UNAVAILABLE,
        LEAST_LOADED or NO_CANDIDATES (no usable peer: served here).
    """
    group = {**peer_loads, self_id: self_load}
    matched = {p: m for p, m in request.matched.items() if m > 0}
    usable = {p: m for p, m in matched.items() if p in group}
    hit = bool(usable)
    if not peer_loads:  # nobody else to compare with: served here
        return Decision(None, Reason.NO_CANDIDATES, self_load.load_factor, hit,
                        matched_tokens=usable.get(self_id, 0))
    costs = {p: node_cost(load, usable.get(p, 0), request.prompt_tokens, config, p != self_id)
             for p, load in group.items()}
    node = _cheapest(self_id, costs, choose)
    chosen = usable.get(node, 0)
    if not hit:  # Alg.2 L3-L4: a miss, the least-loaded node
        reason = Reason.HOLDERS_UNAVAILABLE if matched else Reason.LEAST_LOADED
    elif chosen >= max(usable.values()):  # Alg.2 L6-L8: a holder of the longest match
        reason = Reason.CACHE_HIT
    else:  # Alg.2 L9-L10: that holder costs more with its load
        reason = Reason.OVERLOADED_FALLBACK
    return Decision(_to(self_id, node), reason, group[node].load_factor, hit,
                    cost=costs[node], matched_tokens=chosen)


# ---------------------------------------------------------------------------------- policies


def _group_loads(
    self_id: bytes, tracker: LoadTracker, book: LoadBook, now: float,
    ledger: PeerLedger | None = None,
) -> tuple[NodeLoad, dict[bytes, NodeLoad], dict[bytes, NodeLoad]]:
    """This node's load, that of every usable peer (member, fresh report, not self; with a
    ledger: not refused by it, and its load as the ledger judges it), and that of the peers the
    ledger refuses only for their fair share while they are under the ledger's largest share
    (``max_share``): candidates for a cache hit only (:class:`HRTreeForwarding`)."""
    unknown = book.unknown_latency
    self_load = NodeLoad.of_tracker(tracker, unknown)
    members = book.members
    fresh = {p: load for p, load in book.fresh_loads(now).items()
             if p in members and p != self_id}
    if ledger is None:
        return self_load, {p: NodeLoad.of_peer(load, unknown) for p, load in fresh.items()}, {}
    group_size = len(members - {self_id}) + 1
    usable: dict[bytes, NodeLoad] = {}
    capped: dict[bytes, NodeLoad] = {}
    for p, load in fresh.items():
        refusal = ledger.refusal(p, now, group_size)
        if refusal is None:
            usable[p] = NodeLoad.of_peer(ledger.adjust(load), unknown)
        elif refusal == "share" and ledger.refusal(p, now, 1) is None:  # under max_share
            capped[p] = NodeLoad.of_peer(ledger.adjust(load), unknown)
    return self_load, usable, capped


def _longest_holders(request: RequestContext, self_id: bytes,
                     candidates: Mapping[bytes, NodeLoad]) -> set[bytes]:
    """The nodes (this one or ``candidates``) holding the longest match, none on a miss."""
    held = {p: m for p, m in request.matched.items()
            if m > 0 and (p == self_id or p in candidates)}
    if not held:
        return set()
    best = max(held.values())
    return {p for p, m in held.items() if m == best}


class NoForwarding:
    """Baseline: every model node serves the requests it receives."""

    name = "no-forwarding"

    def decide(self, request: RequestContext, now: float) -> Decision:
        """Always serve here (reason ALREADY_FORWARDED or NO_FORWARDING)."""
        reason = Reason.ALREADY_FORWARDED if request.forwarded else Reason.NO_FORWARDING
        return Decision(None, reason)


class LeastLoad:
    """Baseline: the node of the group with the lowest load (expected wait, then occupancy),
    ignoring the HR-tree and affinity.

    Args:
        self_id: this node's peer ID.
        tracker: this node's :class:`~ps_p2p.gossip.load.LoadTracker`.
        book: the group's :class:`~ps_p2p.gossip.load.LoadBook` (members and their loads).
        choose: tie-break among peers (module docstring); None: lowest peer ID.
        ledger: what this node observed of its peers (module docstring); None: reports taken
            at their word (simulations of an honest group).
        config: the cost model (its prefill terms are equal for every node without matches).
    """

    name = "least-load"

    def __init__(
        self,
        self_id: bytes,
        tracker: LoadTracker,
        book: LoadBook,
        choose: Chooser | None = None,
        ledger: PeerLedger | None = None,
        config: ForwardingConfig | None = None,
    ) -> None:
        self.self_id = self_id
        self.tracker = tracker
        self.book = book
        self.choose = choose
        self.ledger = ledger
        self.config = config or ForwardingConfig()

    def decide(self, request: RequestContext, now: float) -> Decision:
        """ALREADY_FORWARDED, else LEAST_LOADED (or NO_CANDIDATES with no usable peer)."""
        if request.forwarded:
            return Decision(None, Reason.ALREADY_FORWARDED)
        self_load, peers, _ = _group_loads(self.self_id, self.tracker, self.book, now,
                                           self.ledger)
        blind = replace(request, matched={})
        return load_balance(self.self_id, self_load, peers, blind, self.config, self.choose)


class HRTreeForwarding:
    """PlanetServe's forwarding: one hop, session affinity, then Algorithm 2 (module docstring).

    Args:
        self_id: this node's peer ID.
        tracker: this node's :class:`~ps_p2p.gossip.load.LoadTracker` (its own load, exact).
        book: the group's :class:`~ps_p2p.gossip.load.LoadBook`: its members are the trusted
            model nodes of this node's group, its fresh reports their loads.
        config: the cost model's parameters.
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
            request: the HR-tree's per-node matches and the request's flags.
            now: local time in seconds; reports older than the book's ``max_age`` are unknown.

        Returns:
            The decision; ``forward_to`` is always a fresh, trusted member of the group (and
            one the ledger does not refuse).
        """
        if request.forwarded:  # one hop only: a forwarded request is served where it lands
            return Decision(None, Reason.ALREADY_FORWARDED)
        self_load, peers, capped = _group_loads(self.self_id, self.tracker, self.book, now,
                                                self.ledger)
        # a peer over its fair share stays a candidate where only such peers hold the longest
        # match: a hot prefix's holder serves more than 1/k of the requests at a fraction of
        # their cost (issue 19: under cache pressure the 1/k cap sent long documents to nodes
        # without them); up to the ledger's max_share, whatever the peer claims
        longest = _longest_holders(request, self.self_id, {**peers, **capped})
        if longest and longest <= capped.keys():
            peers.update((p, capped[p]) for p in longest)
        overridden = False
        previous = request.previous_node
        if previous is not None:
            load = self_load if previous == self.self_id else peers.get(previous)
            if load is not None:
                soonest = min([self_load.wait, *(p.wait for p in peers.values())])
                if load.wait <= soonest + _TIE:  # nobody would start it sooner
                    hit = any(m > 0 and (p == self.self_id or p in peers)
                              for p, m in request.matched.items())
                    return Decision(_to(self.self_id, previous), Reason.AFFINITY,
                                    load.load_factor, hit,
                                    matched_tokens=request.matched.get(previous, 0))
            overridden = True  # it would wait there, or not a usable member: Algorithm 2
        decision = load_balance(  # Alg.2 L1: LoadBalancing(HRTree, request, tau_c)
            self.self_id, self_load, peers, request, self.config, self.choose)
        return replace(decision, affinity_overridden=overridden) if overridden else decision
