"""RFC 6298 estimators (ps_p2p.overlay.rtt)."""

from __future__ import annotations

import pytest

from ps_p2p.overlay.rtt import RttEstimator, RttTable


@pytest.mark.parametrize(
    "samples, expected_srtt, expected_rttvar",
    [
        ([0.1], 0.1, 0.05),  # 2.2: SRTT = R, RTTVAR = R/2
        ([0.1, 0.3], 0.1 * 7 / 8 + 0.3 / 8, 0.05 * 3 / 4 + 0.2 / 4),  # 2.3
    ],
)
def test_samples_update_srtt_and_rttvar_as_rfc_6298_says(samples, expected_srtt, expected_rttvar):
    estimator = RttEstimator(min_rto=0.0)
    for rtt in samples:
        estimator.sample(rtt)
    assert estimator.srtt == pytest.approx(expected_srtt)
    assert estimator.rttvar == pytest.approx(expected_rttvar)
    assert estimator.rto == pytest.approx(expected_srtt + 4 * expected_rttvar)


def test_rto_never_falls_below_the_floor_and_starts_at_the_initial_value():
    estimator = RttEstimator(initial_rto=4.0, min_rto=2.0)
    assert estimator.rto == 4.0
    estimator.sample(0.001)
    assert estimator.rto == 2.0


def test_a_starved_peer_gets_a_longer_timeout_instead_of_being_declared_dead():
    estimator = RttEstimator(initial_rto=2.0, min_rto=2.0)
    for rtt in [0.02, 1.5, 3.0, 2.5]:  # the machine gets loaded
        estimator.sample(rtt)
    assert estimator.rto > 3.0


def test_timeouts_double_the_rto_until_a_good_sample():
    estimator = RttEstimator(initial_rto=1.0, min_rto=1.0, max_rto=5.0)
    estimator.timed_out()
    assert estimator.rto == 2.0
    estimator.timed_out()
    estimator.timed_out()
    assert estimator.rto == 5.0  # capped
    estimator.sample(0.01)
    assert estimator.rto == 1.0


def test_the_table_is_bounded_and_forgets_the_least_recently_used():
    table = RttTable(initial_rto=1.0, min_rto=0.5, max_keys=2)
    table.get("a").sample(3.0)
    table.get("b")
    table.get("a")
    table.get("c")  # evicts b
    assert table.rto("a") > 1.0
    assert "b" not in table._estimators
    assert table.rto("unknown") == 1.0
