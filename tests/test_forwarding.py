"""Overlay forwarding (ps_p2p.gossip.forwarding): one hop, session affinity, then Algorithm 2 of
PlanetServe's appendix on the HR-tree search result and the group's load reports."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.errors import ConfigError, LocalProtocolError
from ps_p2p.gossip.forwarding import (
    Decision,
    ForwardingConfig,
    ForwardingPolicy,
    HRTreeForwarding,
    LeastLoad,
    NoForwarding,
    Reason,
    RequestContext,
    load_balance,
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
THRESHOLD = 5.0  # with L = 1 s and C = 1, F_LB = Q: overloaded from Q = 5
CONFIG = ForwardingConfig(tau_c=2, overload_threshold=THRESHOLD)


def setup(self_q=4, peers=None, stale=(), latency_none=()):
    """A node SELF in the group {SELF, A, B, C} (U was in it); every node has L = 1 s, C = 1,
    so F_LB = Q. ``peers``: Q by peer; ``stale`` reported 5 s ago (max age 3 s)."""
    if peers is None:
        peers = {A: 1, B: 2, C: 3}
    tracker = LoadTracker(capacity=1, max_queue=100, latency_ewma=1.0)
    tracker.queued = self_q
    book = LoadBook(SELF, MODEL, {SELF, A, B, C, U}, max_age=MAX_AGE)
    for seq, (peer, q) in enumerate(sorted(peers.items()), start=1):
        latency = None if peer in latency_none else 1_000_000
        r = LoadReport(peer, MODEL, seq, 1, q, 0, latency)
        book.receive(r, NOW - 5.0 if peer in stale else NOW - 0.5)
    book.receive(LoadReport(U, MODEL, 1, 1, 0, 0, 1_000_000), NOW)  # idle, but...
    book.set_members({SELF, A, B, C})  # ...no longer trusted
    book.receive(LoadReport(X, "another/model", 1, 1, 0, 0, 1_000_000), NOW)  # refused
    return tracker, book


def ctx(cached=(), depth=0, forwarded=False, previous=None):
    return RequestContext(frozenset(cached), depth, forwarded, previous)


# (id, setup kwargs, request, expected forward_to, reason, affinity overridden)
TABLE = [
    ("miss goes to the least-loaded peer",
     {}, ctx(), A, Reason.LEAST_LOADED, False),
    ("miss is served here when this node is least loaded",
     {"self_q": 0}, ctx(), None, Reason.LEAST_LOADED, False),
    ("a match shorter than tau_c is a miss",
     {}, ctx({C}, depth=1), A, Reason.LEAST_LOADED, False),
    ("hit goes to the least-loaded holder, not the least-loaded node",
     {}, ctx({B, C}, depth=3), B, Reason.CACHE_HIT, False),
    ("hit on a prefix this node holds is served here",
     {"self_q": 2}, ctx({SELF, C}, depth=2), None, Reason.CACHE_HIT, False),
    ("a tie between this node and a holder is served here",
     {"self_q": 2}, ctx({SELF, B}, depth=2), None, Reason.CACHE_HIT, False),
    ("overloaded holder falls back to the least-loaded node",
     {"peers": {A: 1, B: 2, C: 6}}, ctx({C}, depth=2), A, Reason.OVERLOADED_FALLBACK, False),
    ("a holder exactly at the threshold is overloaded",
     {"peers": {A: 1, B: 2, C: 5}}, ctx({C}, depth=2), A, Reason.OVERLOADED_FALLBACK, False),
    ("overloaded fallback may pick this node",
     {"self_q": 0, "peers": {A: 1, C: 7}}, ctx({C}, depth=2), None,
     Reason.OVERLOADED_FALLBACK, False),
    ("a holder with a stale load is not used",
     {"stale": {B}}, ctx({B}, depth=2), A, Reason.HOLDERS_UNAVAILABLE, False),
    ("an idle peer with a stale load is not the least loaded",
     {"peers": {A: 0, B: 2}, "stale": {A}}, ctx(), B, Reason.LEAST_LOADED, False),
    ("an untrusted holder is never chosen",
     {}, ctx({U}, depth=4), A, Reason.HOLDERS_UNAVAILABLE, False),
    ("a holder of another group is never chosen",
     {}, ctx({X}, depth=4), A, Reason.HOLDERS_UNAVAILABLE, False),
    ("session affinity is honoured over a better cache hit",
     {}, ctx({B}, depth=2, previous=C), C, Reason.AFFINITY, False),
    ("session affinity to this node is served here",
     {"self_q": 3}, ctx({B}, depth=2, previous=SELF), None, Reason.AFFINITY, False),
    ("session affinity is overridden when that node is overloaded",
     {"peers": {A: 1, B: 2, C: 6}}, ctx({B}, depth=2, previous=C), B, Reason.CACHE_HIT, True),
    ("session affinity to this node is overridden when it is overloaded",
     {"self_q": 8}, ctx(previous=SELF), A, Reason.LEAST_LOADED, True),
    ("session affinity to an untrusted node is overridden",
     {}, ctx(previous=U), A, Reason.LEAST_LOADED, True),
    ("session affinity to a node of another group is overridden",
     {}, ctx(previous=X), A, Reason.LEAST_LOADED, True),
    ("session affinity to a peer with a stale load is overridden",
     {"stale": {C}}, ctx(previous=C), A, Reason.LEAST_LOADED, True),
    ("an already forwarded request is served here, even overloaded and with a hit elsewhere",
     {"self_q": 9}, ctx({B}, depth=5, forwarded=True, previous=C), None,
     Reason.ALREADY_FORWARDED, False),
    ("no peer with a known load: served here",
     {"peers": {}}, ctx({B}, depth=3), None, Reason.NO_CANDIDATES, False),
    ("no peer with a known load: served here even overloaded",
     {"self_q": 9, "peers": {A: 0}, "stale": {A}}, ctx({SELF}, depth=3), None,
     Reason.NO_CANDIDATES, False),
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


def test_decision_reports_the_chosen_load_and_the_hit():
    tracker, book = setup()
    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx({B, C}, depth=3), NOW)
    assert (decision.load_factor, decision.cache_hit) == (2.0, True)
    miss = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx({B}, depth=1), NOW)
    assert (miss.load_factor, miss.cache_hit) == (1.0, False)


def test_forwarded_requests_steer_the_next_decisions_until_the_peer_reports():
    tracker, book = setup(peers={A: 1, B: 2})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG)
    first = policy.decide(ctx(), NOW)
    assert first.forward_to == A
    assert book.get(A).forwarded == 0  # deciding records nothing
    book.note_forwarded(A, 2)  # the forward service sent two requests: A's Q is now 3
    assert policy.decide(ctx(), NOW).forward_to == B
    book.receive(LoadReport(A, MODEL, 10, 1, 1, 0, 1_000_000), NOW)  # A served them
    assert policy.decide(ctx(), NOW).forward_to == A


def test_a_new_peer_without_latency_sample_is_not_taken_for_idle():
    tracker, book = setup(peers={A: 3, B: 2}, latency_none={A})
    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx(), NOW)
    assert decision.forward_to == B  # the paper's L * Q / C would give A F_LB = 0


def test_ties_among_peers_go_to_the_lowest_peer_id_by_default():
    tracker, book = setup(self_q=3, peers={A: 1, B: 1, C: 2})
    assert HRTreeForwarding(SELF, tracker, book, CONFIG).decide(ctx(), NOW).forward_to == A


def test_ties_among_peers_use_the_injected_chooser():
    asked = []

    def choose(n):
        asked.append(n)
        return n - 1

    tracker, book = setup(self_q=3, peers={A: 1, B: 1, C: 2})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG, choose=choose)
    assert policy.decide(ctx(), NOW).forward_to == B
    assert asked == [2]


def test_the_chooser_is_not_drawn_when_this_node_ties():
    tracker, book = setup(self_q=1, peers={A: 1, B: 1})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG, choose=lambda n: pytest.fail("drawn"))
    assert policy.decide(ctx(), NOW).serve_locally


def test_a_chooser_out_of_range_is_a_local_error():
    tracker, book = setup(self_q=3, peers={A: 1, B: 1})
    policy = HRTreeForwarding(SELF, tracker, book, CONFIG, choose=lambda n: n)
    with pytest.raises(LocalProtocolError):
        policy.decide(ctx(), NOW)


def test_least_load_ignores_the_cache_and_affinity():
    tracker, book = setup()
    decision = LeastLoad(SELF, tracker, book).decide(ctx({C}, depth=9, previous=B), NOW)
    assert (decision.forward_to, decision.reason) == (A, Reason.LEAST_LOADED)


def test_no_forwarding_serves_everything_here():
    decision = NoForwarding().decide(ctx({A}, depth=9, previous=A), NOW)
    assert (decision.forward_to, decision.reason) == (None, Reason.NO_FORWARDING)


def test_every_policy_serves_an_already_forwarded_request_here():
    tracker, book = setup(self_q=50)
    policies: list[ForwardingPolicy] = [
        NoForwarding(), LeastLoad(SELF, tracker, book), HRTreeForwarding(SELF, tracker, book)
    ]
    for policy in policies:
        decision = policy.decide(ctx({A}, depth=9, forwarded=True), NOW)
        assert (decision.forward_to, decision.reason) == (None, Reason.ALREADY_FORWARDED)
    assert len({p.name for p in policies}) == 3


@dataclass(frozen=True)
class SearchResult:  # the shape of ps_p2p.gossip.hr_tree's search result
    peers: frozenset[bytes]
    depth: int


def test_context_from_an_hr_tree_search_result():
    request = RequestContext.from_search(SearchResult(frozenset({B}), 3), previous_node=C)
    assert request == RequestContext(frozenset({B}), 3, False, C)


@pytest.mark.parametrize("kwargs", [{"tau_c": 0}, {"overload_threshold": 0.0}])
def test_bad_forwarding_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        ForwardingConfig(**kwargs)


def test_negative_match_depth_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        RequestContext(frozenset(), -1)


# ---------------------------------------------------------------------------------- properties

NODES = [bytes([i]) * 38 for i in range(0x10, 0x18)]  # none is SELF


@settings(max_examples=200, deadline=None)
@given(
    self_q=st.integers(0, 10),
    loads=st.dictionaries(st.sampled_from(NODES), st.integers(0, 10), max_size=8),
    stale=st.sets(st.sampled_from(NODES)),
    members=st.sets(st.sampled_from(NODES)),
    cached=st.sets(st.sampled_from(NODES + [SELF])),
    depth=st.integers(0, 4),
    previous=st.none() | st.sampled_from(NODES + [SELF]),
)
def test_forwarding_only_ever_targets_a_fresh_trusted_member(
    self_q, loads, stale, members, cached, depth, previous
):
    tracker = LoadTracker(capacity=1, max_queue=100, latency_ewma=1.0)
    tracker.queued = self_q
    book = LoadBook(SELF, MODEL, set(loads), max_age=MAX_AGE)
    for peer, q in loads.items():
        book.receive(LoadReport(peer, MODEL, 1, 1, q, 0, 1_000_000),
                     NOW - 5.0 if peer in stale else NOW)
    book.set_members(members | {SELF})  # the directory changed: some are no longer trusted
    usable = {p: q for p, q in loads.items() if p in members and p not in stale}

    decision = HRTreeForwarding(SELF, tracker, book, CONFIG).decide(
        ctx(cached, depth, previous=previous), NOW
    )
    assert decision.forward_to is None or decision.forward_to in usable
    if decision.reason in (Reason.LEAST_LOADED, Reason.OVERLOADED_FALLBACK,
                           Reason.HOLDERS_UNAVAILABLE):
        assert decision.load_factor == min([self_q, *usable.values()])
    if decision.reason is Reason.CACHE_HIT:
        assert decision.load_factor < THRESHOLD
    if decision.reason is Reason.NO_CANDIDATES:
        assert not usable and decision.serve_locally


def test_load_balance_is_algorithm_2_on_plain_loads():
    assert load_balance(SELF, 3.0, {A: 1.0, B: 2.0}, frozenset({B}), 2, CONFIG) == Decision(
        B, Reason.CACHE_HIT, 2.0, True
    )
