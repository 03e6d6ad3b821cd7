"""What a forwarder observed of its peers (ps_p2p.gossip.load.PeerLedger) and how Algorithm 2
uses it (ps_p2p.gossip.forwarding with a ledger): a load report is the reporter's word, and a
member that lies "idle and instantly fast" must not capture its entry node's requests (issue 16,
HIGH 2)."""

from __future__ import annotations

import pytest

from ps_p2p.errors import ConfigError
from ps_p2p.gossip.forwarding import HRTreeForwarding, RequestContext
from ps_p2p.gossip.load import (
    DEFAULT_PENALTY,
    LoadBook,
    LoadReport,
    LoadTracker,
    PeerLedger,
)

MODEL = "m"
SELF = b"\x50" * 38
LIAR = b"\x01" * 38  # sorts first: wins every tie without the ledger
B = b"\x0b" * 38
C = b"\x0c" * 38
NOW = 100.0


def _group(liar_latency_us: int = 0, honest_q: int = 3, self_q: int = 3,
           ledger: PeerLedger | None = None):
    """SELF and honest B, C have L = 1 s, C = 2 and Q requests; LIAR reports Q = 0 and
    ``liar_latency_us`` with C = 4096."""
    tracker = LoadTracker(capacity=2, max_queue=100, latency_ewma=1.0)
    tracker.queued = self_q
    book = LoadBook(SELF, MODEL, {SELF, LIAR, B, C}, max_age=1e9)
    book.receive(LoadReport(LIAR, MODEL, 1, 4096, 0, 0, liar_latency_us), NOW)
    for peer in (B, C):
        book.receive(LoadReport(peer, MODEL, 1, 2, honest_q, 0, 1_000_000), NOW)
    policy = HRTreeForwarding(SELF, tracker, book, ledger=ledger)
    return policy, book


def _route(policy: HRTreeForwarding, book: LoadBook, ledger: PeerLedger | None, n: int,
           now: float = NOW) -> dict[bytes | None, int]:
    """``n`` decisions, each forward answered at once (the liar's garbage is instant)."""
    counts: dict[bytes | None, int] = {}
    for _ in range(n):
        peer = policy.decide(RequestContext(), now).forward_to
        counts[peer] = counts.get(peer, 0) + 1
        if ledger is not None:
            ledger.record(peer, now)
            if peer is not None:
                ledger.sent(peer, now)
                ledger.answered(peer, 0.001, now)
    return counts


def test_without_a_ledger_a_member_claiming_idle_and_instant_takes_every_request():
    policy, book = _group()
    assert _route(policy, book, None, 64) == {LIAR: 64}  # the attack, as it was


def test_a_member_claiming_idle_and_instant_takes_at_most_its_share_of_decisions():
    ledger = PeerLedger(max_outstanding=2)
    ledger.set_members({LIAR: 2, B: 2, C: 2})
    policy, book = _group(ledger=ledger)
    counts = _route(policy, book, ledger, 64)
    assert ledger.share_limit(4) == 0.25  # min(max_share, 1 / k) with k = 4
    assert counts[LIAR] <= 16 + ledger.burst and sum(counts.values()) == 64
    counts = _route(policy, book, ledger, 640)  # and so in every window of 64 decisions
    assert counts[LIAR] <= 10 * (16 + ledger.burst)


def test_in_a_large_group_the_share_is_what_share_factor_fair_shares_allow():
    ledger = PeerLedger(max_outstanding=2, window=100, burst=0, share_factor=1.5)
    assert ledger.share_limit(20) == pytest.approx(0.075)
    for _ in range(100):
        if ledger.refusal(LIAR, NOW, 20) is None:
            ledger.record(LIAR, NOW)
        else:
            ledger.record(None, NOW)
    assert ledger.taken(LIAR) == 8  # ceil(0.075 * 100)


def test_a_failed_forward_bans_the_peer_then_probation_allows_one_forward_at_a_time():
    ledger = PeerLedger(max_outstanding=4, max_share=1.0, share_factor=100.0)
    ledger.set_members({B: 2})
    ledger.sent(B, NOW)
    ledger.failed(B, NOW)  # timed out, refused, or an answer that did not verify
    assert ledger.refusal(B, NOW + DEFAULT_PENALTY - 0.1, 2) == "penalty"
    later = NOW + DEFAULT_PENALTY
    assert ledger.refusal(B, later, 2) is None
    ledger.sent(B, later)
    assert ledger.refusal(B, later, 2) == "outstanding"  # on probation: one at a time
    ledger.failed(B, later)  # a second failure in a row: twice as long
    assert ledger.refusal(B, later + 2 * DEFAULT_PENALTY - 0.1, 2) == "penalty"
    assert ledger.refusal(B, later + 2 * DEFAULT_PENALTY, 2) is None


def test_a_good_answer_takes_a_strike_off_and_ends_probation():
    ledger = PeerLedger(max_outstanding=4, max_share=1.0, share_factor=100.0, penalty=0.0)
    ledger.set_members({B: 4})
    ledger.sent(B, NOW)
    ledger.failed(B, NOW)
    ledger.sent(B, NOW)
    ledger.answered(B, 1.0, NOW)
    for _ in range(3):
        ledger.sent(B, NOW)
    assert ledger.refusal(B, NOW, 2) is None and ledger.outstanding(B) == 3


def test_forwards_outstanding_at_a_peer_are_capped_and_count_in_its_q():
    ledger = PeerLedger(max_outstanding=2, max_share=1.0, share_factor=100.0)
    ledger.set_members({LIAR: 0})
    policy, book = _group(liar_latency_us=1_000_000, ledger=ledger)
    load = book.get(LIAR)
    assert ledger.judge(load, 1.0) == 0.0  # what it claims: nothing queued
    ledger.sent(LIAR, NOW)
    assert ledger.adjust(load).requests == 1  # our forward is in service there at least
    ledger.sent(LIAR, NOW)  # a peer that holds our forwards without answering...
    assert ledger.refusal(LIAR, NOW, 4) == "outstanding"  # ...gets no more
    assert policy.decide(RequestContext(), NOW).forward_to != LIAR


def test_a_peer_slower_than_it_claims_is_judged_by_what_this_node_measured():
    ledger = PeerLedger(max_outstanding=8, max_share=1.0, share_factor=100.0)
    ledger.set_members({LIAR: 2})
    policy, book = _group(liar_latency_us=1_000, honest_q=2, ledger=ledger)  # claims 1 ms
    load = book.get(LIAR)
    ledger.sent(LIAR, NOW)
    ledger.answered(LIAR, 4.0, NOW)  # its answers take 4 s
    ledger.sent(LIAR, NOW)
    # L = 4 s measured, 1 outstanding, C = 2 as listed in the directory (not 4096)
    judged = ledger.adjust(load)
    assert (judged.latency_ewma, judged.requests, judged.capacity) == (4.0, 1, 2)
    for _ in range(2):
        ledger.sent(LIAR, NOW)
    assert ledger.judge(load, 1.0) == pytest.approx(4.0 * 1 / 2)  # 3 outstanding: 1 waits
    assert policy.decide(RequestContext(), NOW).forward_to in (B, C, None)


def test_an_honest_peer_measured_close_to_its_claim_is_judged_by_its_report():
    ledger = PeerLedger(max_outstanding=8)
    ledger.set_members({B: 2})
    _, book = _group(ledger=ledger)
    ledger.sent(B, NOW)
    ledger.answered(B, 1.5, NOW)  # its 1 s service plus a round trip: within the factor
    assert ledger.judge(book.get(B), 1.0) == pytest.approx(1.0 * 3 / 2)


def test_observations_of_a_peer_that_left_the_group_are_forgotten():
    ledger = PeerLedger(max_outstanding=2)
    ledger.set_members({B: 2})
    ledger.sent(B, NOW)
    ledger.failed(B, NOW)
    ledger.set_members({C: 2})
    assert ledger.outstanding(B) == 0 and ledger.refusal(B, NOW, 2) is None
    ledger.sent(B, NOW)  # not a member: nothing kept for it
    assert ledger.outstanding(B) == 0


@pytest.mark.parametrize("kwargs", [
    {"max_outstanding": 0}, {"max_outstanding": 1, "window": 0},
    {"max_outstanding": 1, "max_share": 0.0}, {"max_outstanding": 1, "share_factor": 0.0},
    {"max_outstanding": 1, "burst": -1},
    {"max_outstanding": 1, "penalty": 10.0, "max_penalty": 5.0},
    {"max_outstanding": 1, "contradiction": 0.5}, {"max_outstanding": 1, "busy_backoff": -1.0},
])
def test_bad_ledger_bounds_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        PeerLedger(**kwargs)


def test_an_overloaded_answer_pauses_forwards_briefly_without_a_strike():
    from ps_p2p.gossip.load import DEFAULT_BUSY_BACKOFF, ForwardOutcome

    ledger = PeerLedger(max_outstanding=4, max_share=1.0, share_factor=100.0)
    ledger.set_members({B: 4})
    for _ in range(5):  # a saturated honest peer, again and again
        ledger.sent(B, NOW)
        ledger.done(B, ForwardOutcome.BUSY, 0.1, NOW)
    assert ledger.refusal(B, NOW + DEFAULT_BUSY_BACKOFF - 0.1, 2) == "penalty"
    later = NOW + DEFAULT_BUSY_BACKOFF
    for _ in range(4):  # no probation: as many outstanding as before
        assert ledger.refusal(B, later, 2) is None
        ledger.sent(B, later)


def test_a_peer_holds_no_more_of_our_forwards_than_its_record_lists():
    ledger = PeerLedger(max_outstanding=8, max_share=1.0, share_factor=100.0)
    ledger.set_members({B: 2})  # it admits 2 forwarded jobs from one forwarder
    ledger.sent(B, NOW)
    ledger.sent(B, NOW)
    assert ledger.refusal(B, NOW, 2) == "outstanding"


@pytest.mark.parametrize(("matched", "expected"), [
    # B alone holds the prompt's prefix: past its fair share (1/k = 1/4 of 64, + 2 of burst)
    # it stays the choice up to the ledger's max_share (1/2 of 64 + 2): a hot prefix's holder;
    # C, idle, takes its fair share of the rest, and the rest is served here
    ({B: 1_000}, {B: 34, C: 18, None: 12}),
    # B and C hold it: C takes over at B's fair share, then both past theirs hold the longest
    # match and take everything, each up to max_share
    ({B: 1_000, C: 1_000}, {B: 34, C: 30}),
    # nobody holds it: load only, B and C capped at their fair shares, the rest served here
    ({}, {B: 18, C: 18, None: 28}),
])
def test_a_peer_past_its_fair_share_is_still_chosen_where_only_such_peers_hold_the_longest_match(
        matched, expected):
    ledger = PeerLedger(max_outstanding=2)
    ledger.set_members({LIAR: 2, B: 2, C: 2})
    policy, book = _group(honest_q=0, ledger=ledger)
    book.receive(LoadReport(LIAR, MODEL, 2, 2, 5, 2, 1_000_000), NOW)  # busy: not chosen
    request = RequestContext(matched, prompt_tokens=1_100)
    counts: dict[bytes | None, int] = {}
    for _ in range(64):
        peer = policy.decide(request, NOW).forward_to
        counts[peer] = counts.get(peer, 0) + 1
        ledger.record(peer, NOW)
        if peer is not None:
            ledger.sent(peer, NOW)
            ledger.answered(peer, 1.0, NOW)
    assert ledger.burst == 2 and ledger.share_limit(4) == 0.25 and ledger.max_share == 0.5
    assert counts == expected
