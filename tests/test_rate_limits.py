"""Token buckets per peer and in total (ps_p2p.rate_limits), driven with explicit times."""

from __future__ import annotations

import pytest

from ps_p2p.rate_limits import PeerBudgets, TokenBucket, TokenBuckets

A, B = b"peer A", b"peer B"


def budgets(**kwargs) -> PeerBudgets:
    params = dict(rate=100.0, burst=1000.0, total_rate=1000.0, total_burst=10_000.0)
    params.update(kwargs)
    return PeerBudgets(**params)


def test_a_bucket_refills_at_its_rate_up_to_its_burst_and_a_charge_may_leave_debt():
    bucket = TokenBucket(rate=10.0, burst=50.0)
    bucket.charge(80.0, now=0.0)
    assert bucket.tokens == -30.0 and bucket.wait(0.0) == pytest.approx(3.0)
    assert bucket.wait(3.0) == 0.0
    assert bucket.refill(100.0) == 50.0
    assert bucket.refill(90.0) == 50.0  # a clock going back adds nothing


def test_one_answer_of_any_size_passes_then_the_peer_waits_until_its_debt_is_repaid():
    b = budgets()
    assert b.admit(A, 0.0) is None
    b.charge(A, 4500.0, 0.0)  # a full directory, far over the burst
    b.release(A)
    reason = b.admit(A, 1.0)
    assert reason is not None and "retry in 34.0 s" in reason
    assert b.admit(A, 35.0) is None


def test_peers_have_their_own_buckets_and_share_the_total():
    b = budgets(total_burst=2000.0)
    for peer in (A, B):
        assert b.admit(peer, 0.0) is None
        b.charge(peer, 1200.0, 0.0)
        b.release(peer)
    assert "this peer's rate" in b.admit(A, 0.0)
    reason = b.admit(b"peer C", 0.0)  # a fresh identity is held by the total
    assert reason is not None and "total rate" in reason
    assert b.refused == 2 and b.admitted == 2


def test_concurrent_requests_are_capped_per_peer_and_in_total():
    b = budgets(max_inflight_per_peer=1, max_inflight=2)
    assert b.admit(A, 0.0) is None
    assert "already being answered" in b.admit(A, 0.0)
    assert b.admit(B, 0.0) is None
    assert "already being answered" in b.admit(b"peer C", 0.0)
    b.release(A)
    assert b.admit(b"peer C", 0.0) is None


def test_at_most_max_peers_buckets_are_kept_and_one_in_flight_is_never_forgotten():
    b = budgets(max_peers=3, max_inflight=10)
    assert b.admit(A, 0.0) is None  # in flight
    for i in range(10):
        peer = b"sybil %d" % i
        assert b.admit(peer, 0.0) is None
        b.release(peer)
    assert len(b) == 3
    b.charge(A, 5000.0, 0.0)
    b.release(A)
    assert "this peer's rate" in b.admit(A, 0.0)


def test_a_table_of_buckets_makes_a_key_s_bucket_full_and_forgets_the_least_recently_used():
    table: TokenBuckets[str] = TokenBuckets(rate=1.0, burst=4.0, max_keys=2)
    table.get("a", 0.0).charge(4.0, 0.0)
    table.get("b", 0.0)
    table.get("a", 1.0)  # "a" used again: "b" is now the least recently used
    assert table.peek("c") is None and len(table) == 2  # peek makes nothing
    table.get("c", 1.0)
    assert "b" not in table and "a" in table and "c" in table
    assert table.get("a", 2.0).refill(2.0) == 2.0  # "a" kept its debt: 0 + 2 s at 1/s
    assert table.get("b", 2.0).refill(2.0) == 4.0  # a forgotten key starts full again


def test_a_table_of_buckets_never_forgets_a_pinned_key():
    held = {"a"}
    table: TokenBuckets[str] = TokenBuckets(rate=1.0, burst=4.0, max_keys=1,
                                            pinned=lambda key: key in held)
    table.get("a", 0.0)
    table.get("b", 0.0)
    assert "a" in table and "b" in table  # over max_keys while "a" is pinned
    table.get("c", 0.0)
    assert "a" in table and "b" not in table and "c" in table


def test_a_table_of_buckets_refuses_a_bound_below_one():
    with pytest.raises(ValueError):
        TokenBuckets(rate=1.0, burst=4.0, max_keys=0)
