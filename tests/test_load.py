"""LoadTracker: the load factor F_LB = L * (Q / C) and admission (PlanetServe sec. 3.3)."""

import pytest

from ps_p2p.errors import PsError
from ps_p2p.gossip.load import EWMA_ALPHA, LoadTracker


def test_load_factor_is_zero_before_any_latency_sample():
    t = LoadTracker(capacity=2, max_queue=4)
    assert t.try_admit()
    assert t.load_factor() == 0.0


def test_ewma_moves_one_eighth_towards_each_sample():
    t = LoadTracker(capacity=1, max_queue=4)
    for latency in (1.0, 3.0):
        t.try_admit()
        t.start()
        t.finish(latency)
    assert t.latency_ewma == pytest.approx(1.0 + EWMA_ALPHA * (3.0 - 1.0))


def test_load_factor_counts_the_requests_waiting_over_capacity():
    t = LoadTracker(capacity=2, max_queue=8)
    t.try_admit()
    t.start()
    t.finish(0.5)
    for _ in range(3):
        t.try_admit()
    t.start()
    # one in service + two queued, capacity 2: Q is the two waiting (sec. 3.3, issue 19)
    assert t.load_factor() == pytest.approx(0.5 * 2 / 2)


def test_a_request_being_routed_holds_an_admission_place_but_is_not_in_q():
    # issue 19 finding 3: the node routing a request must not count it against itself
    t = LoadTracker(capacity=1, max_queue=1, latency_ewma=1.0)
    assert t.try_admit(routing=True)
    assert (t.routing, t.queued, t.load_factor(), t.report(b"p", "m", 1).queued) == (1, 0, 0, 0)
    assert t.try_admit(routing=True)
    assert not t.try_admit()  # the places held while routing still bound the queue
    t.routed_here()  # kept here: it joins Q
    assert (t.routing, t.queued) == (1, 1)
    t.cancel()  # the other one was forwarded
    assert (t.routing, t.queued) == (0, 1)


def test_admission_refuses_beyond_capacity_plus_queue():
    t = LoadTracker(capacity=2, max_queue=1)
    admitted = [t.try_admit() for _ in range(4)]
    assert admitted == [True, True, True, False]
    assert t.refused == 1


@pytest.mark.parametrize("capacity,max_queue", [(0, 1), (1, -1)])
def test_bad_settings_are_refused(capacity, max_queue):
    with pytest.raises(PsError):
        LoadTracker(capacity=capacity, max_queue=max_queue)
