"""Overlay forwarding (ps_p2p.gossip.forwarding): one hop, session affinity, then the cost-aware
Algorithm 2 of PlanetServe's appendix on the HR-tree's per-node matches and the group's loads
(issue 19: Q = requests waiting, a hit weighs the prefill it saves, an idle node may take work,
random tie-breaks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.errors import ConfigError, LocalProtocolError
from ps_p2p.gossip.forwarding import (
    ForwardingConfig,
    ForwardingPolicy,
    HRTreeForwarding,
    LeastLoad,
    NodeLoad,
    NoForwarding,
    Reason,
    RequestContext,
    load_balance,
    node_cost,
)
from ps_p2p.gossip.load import LoadBook, LoadReport, LoadTracker

MODEL = "stories260K"
SELF = b"\x50" * 38  # sorts after every peer: ties must prefer it on purpose
A = b"\x0a" * 38
B = b"\x0b" * 38
C = b"\x0c" * 38
U = b"\x0d" * 38  # was trusted, then fell below the reputation threshold
X = b"\x0e" * 38  # a model node of another model's group
NOW = 100.0
MAX_AGE = 3.0
P = 1000  # prompt tokens: at 1,000 tokens/s its whole prefill takes 1 s
CONFIG = ForwardingConfig(tau_c=1, prefill_tokens_per_s=1000.0, hop_seconds=0.05,
                          busy_weight=1.0)
SLOTS = 4  # C of every node: a busy slot costs 1 s x 1/4 at busy weight 1


def setup(self_run=0, self_wait=0, peers=None, stale=(), latency_none=(), latency=1.0):
    """SELF in the group {SELF, A, B, C} (U was in it); every node has C = 4 and L = ``latency``
    (``latency`` may be a dict by node). ``peers``: (running, waiting) by peer, default idle;
    ``stale``: reported 5 s ago (max age 3 s)."""
    lat = latency if isinstance(latency, dict) else {}
    default = latency if not isinstance(latency, dict) else 1.0
    if peers is None:
        peers = {A: (0, 0), B: (0, 0), C: (0, 0)}
    tracker = LoadTracker(capacity=SLOTS, max_queue=100, latency_ewma=lat.get(SELF, default))
    tracker.in_service, tracker.queued = self_run, self_wait
    book = LoadBook(SELF, MODEL, {SELF, A, B, C, U}, max_age=MAX_AGE)
    for seq, (peer, (run, wait)) in enumerate(sorted(peers.items()), start=1):
        us = None if peer in latency_none else round(lat.get(peer, default) * 1_000_000)
        book.receive(LoadReport(peer, MODEL, seq, SLOTS, wait, run, us),
                     NOW - 5.0 if peer in stale else NOW - 0.5)
    book.receive(LoadReport(U, MODEL, 1, SLOTS, 0, 0, 1_000_000), NOW)  # idle, but...
    book.set_members({SELF, A, B, C})  # ...no longer trusted
    book.receive(LoadReport(X, "another/model", 1, SLOTS, 0, 0, 1_000_000), NOW)  # refused
    return tracker, book


def ctx(matched=None, forwarded=False, previous=None, prompt=P):
    return RequestContext(dict(matched or {}), prompt, forwarded, previous)


IDLE = {A: (0, 0), B: (0, 0), C: (0, 0)}

# (id, setup kwargs, request, expected forward_to, reason, affinity overridden)
TABLE = [
    ("a miss goes to the least-loaded node",
     {"self_run": 2, "peers": {A: (0, 0), B: (1, 0), C: (3, 0)}}, ctx(), A,
     Reason.LEAST_LOADED, False),
    ("a miss with every node equally idle is served here: no hop for nothing",
     {}, ctx(), None, Reason.LEAST_LOADED, False),
    ("a holder with free slots takes the request over an idle node that holds nothing",
     {"peers": {A: (0, 0), B: (2, 0), C: (0, 0)}}, ctx({B: 900}), B, Reason.CACHE_HIT, False),
    # finding 2: a shared system prompt alone must not make a node "the holder"
    ("a short match (a shared system prompt) does not outweigh the holder's busier slots",
     {"self_run": 1, "peers": {A: (0, 0), B: (2, 0), C: (2, 0)}}, ctx({B: 100}), A,
     Reason.OVERLOADED_FALLBACK, False),
    # finding 1: Q counts requests waiting, so long outputs do not make a holder "overloaded"
    ("a holder with long outputs and no request waiting still takes the request",
     {"peers": {A: (0, 0), B: (3, 0), C: (0, 0)}, "latency": 30.0}, ctx({B: 900}), B,
     Reason.CACHE_HIT, False),
    ("a holder with requests waiting passes the request to an idle node",
     {"peers": {A: (1, 0), B: (4, 2), C: (1, 0)}}, ctx({B: 900}), None,
     Reason.OVERLOADED_FALLBACK, False),
    ("between two equally loaded holders the longer match wins",
     {"peers": {A: (1, 0), B: (1, 0), C: (0, 0)}, "self_run": 1}, ctx({A: 200, B: 800}), B,
     Reason.CACHE_HIT, False),
    ("this node's own match counts: served here",
     {"self_run": 2}, ctx({SELF: 900}), None, Reason.CACHE_HIT, False),
    ("a holder with a stale load is not used",
     {"stale": {B}, "self_run": 1}, ctx({B: 900}), A, Reason.HOLDERS_UNAVAILABLE, False),
    ("an idle peer with a stale load is not the least loaded",
     {"self_run": 2, "peers": {A: (0, 0), B: (1, 0)}, "stale": {A}}, ctx(), B,
     Reason.LEAST_LOADED, False),
    ("an untrusted holder is never chosen",
     {"self_run": 1}, ctx({U: 1000}), A, Reason.HOLDERS_UNAVAILABLE, False),
    ("a holder of another group is never chosen",
     {"self_run": 1}, ctx({X: 1000}), A, Reason.HOLDERS_UNAVAILABLE, False),
    ("session affinity is honoured over a better cache hit while it has a free slot",
     {"peers": {A: (0, 0), B: (0, 0), C: (3, 0)}}, ctx({B: 900}, previous=C), C,
     Reason.AFFINITY, False),
    ("session affinity to this node is served here",
     {"self_run": 3}, ctx({B: 900}, previous=SELF), None, Reason.AFFINITY, False),
    ("session affinity is overridden when a request would wait there and not elsewhere",
     {"peers": {A: (0, 0), B: (1, 0), C: (4, 1)}}, ctx({B: 900}, previous=C), B,
     Reason.CACHE_HIT, True),
    ("session affinity to an untrusted node is overridden",
     {"self_run": 1}, ctx(previous=U), A, Reason.LEAST_LOADED, True),
    ("session affinity to a node of another group is overridden",
     {"self_run": 1}, ctx(previous=X), A, Reason.LEAST_LOADED, True),
    ("session affinity to a peer with a stale load is overridden",
     {"self_run": 1, "stale": {C}}, ctx(previous=C), A, Reason.LEAST_LOADED, True),
    ("an already forwarded request is served here, even overloaded and with a hit elsewhere",
     {"self_run": 4, "self_wait": 9}, ctx({B: 900}, forwarded=True, previous=C), None,
     Reason.ALREADY_FORWARDED, False),
    ("no peer with a known load: served here",
     {"peers": {}}, ctx({B: 900}), None, Reason.NO_CANDIDATES, False),
    ("no peer with a known load: served here even overloaded",
     {"self_run": 4, "self_wait": 9, "peers": {A: (0, 0)}, "stale": {A}}, ctx({SELF: 900}),
     None, Reason.NO_CANDIDATES, False),
]


@pytest.mark.parametrize(
    "kwargs,request_ctx,target,reason,overridden",
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_hr_tree_forwarding_table(kwargs, request_ctx, target, reason, overridden):
    tracker, book = setup(**kwargs)
    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(request_ctx, NOW)
    assert (decision.forward_to, decision.reason, decision.affinity_overridden) == (
        target, reason, overridden
    )
    assert decision.serve_locally == (target is None)


# (id, load, matched, expected cost in seconds) with P = 1000 tokens at 1,000 tokens/s
COSTS = [
    ("idle, nothing cached: the whole prefill", NodeLoad(1.0, 0, 0, 4), 0, 1.0),
    ("idle, 900 tokens cached: the rest of the prefill", NodeLoad(1.0, 0, 0, 4), 900, 0.1),
    ("half the slots busy: half a prefill more", NodeLoad(30.0, 0, 2, 4), 900, 0.6),
    ("all slots busy, none waiting: one slot's wait (F_LB with this request)",
     NodeLoad(2.0, 0, 4, 4), 1000, 0.5 + 1.0),
    ("two waiting: three slots' wait", NodeLoad(2.0, 2, 4, 4), 1000, 1.5 + 1.0),
]


@pytest.mark.parametrize("load,matched,cost", [r[1:] for r in COSTS], ids=[r[0] for r in COSTS])
def test_the_cost_of_serving_on_a_node(load, matched, cost):
    assert node_cost(load, matched, P, CONFIG, hop=False) == pytest.approx(cost)
    assert node_cost(load, matched, P, CONFIG, hop=True) == pytest.approx(cost + 0.05)


def test_f_lb_counts_the_requests_waiting_not_those_running():
    # PlanetServe sec. 3.3: Q is the requests waiting; a node with free slots has F_LB 0
    assert NodeLoad(30.0, 0, 31, 32).load_factor == 0.0
    assert NodeLoad(30.0, 0, 31, 32).wait == 0.0
    assert NodeLoad(30.0, 8, 32, 32).load_factor == pytest.approx(7.5)
    tracker = LoadTracker(capacity=32, max_queue=8, latency_ewma=30.0)
    tracker.in_service = 11
    assert tracker.load_factor() == 0.0  # was 30 x 11 / 32 = 10.3 s: "overloaded" at 10 s


def test_an_idle_node_takes_work_from_a_busy_holder_so_the_prefix_replicates():
    # finding 2: nodes that missed the first second must not stay idle forever. B holds the
    # whole hot prefix; as it fills up, the idle node A takes the next request.
    tracker, book = setup(self_run=4, peers={A: (0, 0), B: (0, 0), C: (4, 0)})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG)
    chosen = []
    for _ in range(6):
        decision = policy.decide(ctx({B: 950}), NOW)
        chosen.append(decision.forward_to)
        book.note_forwarded(decision.forward_to)
    assert chosen[:3] == [B, B, B]  # 0.05 + 0.05 + 1 x running / 4 < A's whole prefill
    assert A in chosen[3:]  # B's fourth busy slot costs more than A's missing prefix


def test_decision_reports_the_chosen_load_cost_and_match():
    tracker, book = setup(peers={A: (0, 0), B: (2, 0), C: (0, 0)})
    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx({B: 900}), NOW)
    assert (decision.load_factor, decision.cache_hit, decision.matched_tokens) == (0.0, True, 900)
    assert decision.cost == pytest.approx(0.1 + 0.5 + 0.05)
    miss = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx(), NOW)
    assert (miss.cache_hit, miss.matched_tokens) == (False, 0)


def test_forwarded_requests_steer_the_next_decisions_until_the_peer_reports():
    tracker, book = setup(self_run=2, peers={A: (0, 0), B: (1, 0)})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG)
    first = policy.decide(ctx(), NOW)
    assert first.forward_to == A
    assert book.get(A).forwarded == 0  # deciding records nothing
    book.note_forwarded(A, 2)  # the forward service sent two requests: A runs 2 now
    assert policy.decide(ctx(), NOW).forward_to == B
    book.receive(LoadReport(A, MODEL, 10, SLOTS, 0, 0, 1_000_000), NOW)  # A served them
    assert policy.decide(ctx(), NOW).forward_to == A


def test_forwards_beyond_a_peers_free_slots_count_as_waiting():
    _, book = setup(peers={A: (3, 0)})
    book.note_forwarded(A, 3)
    load = book.get(A)
    assert (load.running, load.waiting) == (4, 2)


def test_a_new_peer_without_latency_sample_is_not_taken_for_idle():
    tracker, book = setup(self_run=4, self_wait=1, peers={A: (4, 3), B: (4, 0)},
                          latency_none={A})
    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx(), NOW)
    assert decision.forward_to == B  # the paper's L * Q / C would give A F_LB = 0


def test_ties_among_peers_go_to_the_lowest_peer_id_by_default():
    tracker, book = setup(self_run=3, peers={A: (1, 0), B: (1, 0), C: (2, 0)})
    assert HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx(), NOW).forward_to == A


def test_ties_among_peers_use_the_injected_chooser():
    asked = []

    def choose(n):
        asked.append(n)
        return n - 1

    tracker, book = setup(self_run=3, peers={A: (1, 0), B: (1, 0), C: (2, 0)})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG, choose=choose)
    assert policy.decide(ctx(), NOW).forward_to == B
    assert asked == [2]


def test_the_chooser_is_not_drawn_when_this_node_ties():
    tracker, book = setup()
    no_hop = ForwardingConfig(prefill_tokens_per_s=1000.0, hop_seconds=0.0)
    policy = HRTreeForwarding(SELF, tracker, book, no_hop, choose=lambda n: pytest.fail("drawn"))
    assert policy.decide(ctx(), NOW).serve_locally


def test_a_chooser_out_of_range_is_a_local_error():
    tracker, book = setup(self_run=3, peers={A: (1, 0), B: (1, 0)})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG, choose=lambda n: n)
    with pytest.raises(LocalProtocolError):
        policy.decide(ctx(), NOW)


def test_least_load_ignores_the_cache_and_affinity():
    tracker, book = setup(self_run=2, peers={A: (0, 0), B: (1, 0), C: (3, 0)})
    decision = LeastLoad(SELF, tracker, book, config=CONFIG).decide(
        ctx({C: 1000}, previous=B), NOW)
    assert (decision.forward_to, decision.reason) == (A, Reason.LEAST_LOADED)


def test_no_forwarding_serves_everything_here():
    decision = NoForwarding().decide(ctx({A: 900}, previous=A), NOW)
    assert (decision.forward_to, decision.reason) == (None, Reason.NO_FORWARDING)


def test_every_policy_serves_an_already_forwarded_request_here():
    tracker, book = setup(self_run=4, self_wait=50)
    policies: list[ForwardingPolicy] = [
        NoForwarding(), LeastLoad(SELF, tracker, book), HRTreeForwarding(SELF, tracker, book)
    ]
    for policy in policies:
        decision = policy.decide(ctx({A: 900}, forwarded=True), NOW)
        assert (decision.forward_to, decision.reason) == (None, Reason.ALREADY_FORWARDED)
    assert len({p.name for p in policies}) == 3


def test_context_from_hr_tree_depths_in_tokens():
    ends = [100, 104, 120, 136]  # L = (100, 4) then 16-token chunks

    def end(i):
        return ends[i]

    request = RequestContext.from_depths({A: 1, B: 3, C: 4}, end, 130, 2, previous_node=C)
    # A matched fewer than tau_c = 2 chunks: no match; C's match is cut to the prompt
    assert request == RequestContext({B: 120, C: 130}, 130, False, C)


@pytest.mark.parametrize("kwargs", [{"tau_c": 0}, {"prefill_tokens_per_s": 0.0},
                                    {"hop_seconds": -1.0}, {"busy_weight": -0.5}])
def test_bad_forwarding_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        ForwardingConfig(**kwargs)


def test_negative_token_counts_are_a_local_error():
    with pytest.raises(LocalProtocolError):
        RequestContext({A: -1}, 10)
    with pytest.raises(LocalProtocolError):
        RequestContext({}, -1)


# ---------------------------------------------------------------------------------- properties

NODES = [bytes([i]) * 38 for i in range(0x10, 0x18)]  # none is SELF


@settings(max_examples=200, deadline=None)
@given(
    self_load=st.tuples(st.integers(0, 4), st.integers(0, 6)),
    loads=st.dictionaries(st.sampled_from(NODES), st.tuples(st.integers(0, 4), st.integers(0, 6)),
                          max_size=8),
    stale=st.sets(st.sampled_from(NODES)),
    members=st.sets(st.sampled_from(NODES)),
    matched=st.dictionaries(st.sampled_from(NODES + [SELF]), st.integers(0, P)),
    previous=st.none() | st.sampled_from(NODES + [SELF]),
)
def test_forwarding_only_ever_targets_a_fresh_trusted_member_at_the_lowest_cost(
    self_load, loads, stale, members, matched, previous
):
    tracker = LoadTracker(capacity=SLOTS, max_queue=100, latency_ewma=1.0)
    tracker.in_service, tracker.queued = self_load[0], self_load[1] if self_load[0] == 4 else 0
    book = LoadBook(SELF, MODEL, set(loads), max_age=MAX_AGE)
    for peer, (run, wait) in loads.items():
        book.receive(LoadReport(peer, MODEL, 1, SLOTS, wait if run == SLOTS else 0, run,
                                1_000_000), NOW - 5.0 if peer in stale else NOW)
    book.set_members(members | {SELF})  # the directory changed: some are no longer trusted
    usable = {p for p in loads if p in members and p not in stale}

    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(
        ctx(matched, previous=previous), NOW)
    assert decision.forward_to is None or decision.forward_to in usable
    if decision.reason in (Reason.CACHE_HIT, Reason.OVERLOADED_FALLBACK, Reason.LEAST_LOADED,
                           Reason.HOLDERS_UNAVAILABLE):
        group = {SELF: NodeLoad.of_tracker(tracker, 1.0)}
        group.update({p: NodeLoad.of_peer(book.get(p), 1.0) for p in usable})
        costs = [node_cost(load, matched.get(p, 0), P, CONFIG, p != SELF)
                 for p, load in group.items()]
        assert decision.cost == pytest.approx(min(costs))
    if decision.reason is Reason.NO_CANDIDATES:
        assert not usable and decision.serve_locally


def test_load_balance_on_plain_loads():
    idle, busy = NodeLoad(1.0, 0, 0, 4), NodeLoad(1.0, 0, 2, 4)
    decision = load_balance(SELF, busy, {A: idle, B: busy}, ctx({B: 900}), CONFIG)
    assert (decision.forward_to, decision.reason) == (B, Reason.CACHE_HIT)
