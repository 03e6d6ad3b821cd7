"""The path pool core (ps_p2p.overlay.path_pool): events in, commands out, on injected time."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest

from ps_p2p.overlay.path_pool import (
    ClosePath,
    OpenPath,
    PathLost,
    PathPool,
    PoolChanged,
    PoolConfig,
    PoolStats,
    SendProbe,
    choose_distinct_proxies,
)

RELAYS = [bytes([i]) * 8 for i in range(1, 21)]


def _pool(**overrides) -> PathPool:
    fields = dict(total=4, paths=5, hops=3, probe_interval=2.0, probe_timeout=4.0,
                  rotate_period=900.0, retire_grace=120.0, failed_relay_cooldown=30.0,
                  max_setups=5)
    fields.update(overrides)
    return PathPool(PoolConfig(**fields), rng=random.Random(7))


def _of(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def _open_all(pool: PathPool, now: float, relays=RELAYS, *, confirm: bool = True) -> list[OpenPath]:
    """Tick once; every path opened gets ready (and its first probe answered)."""
    opened = _of(pool.tick(now, relays), OpenPath)
    for command in opened:
        probes = _of(pool.path_ready(command.path_id, now), SendProbe)
        if confirm:
            for probe in probes:
                pool.probe_reply(probe.path_id, probe.nonce, now + 0.01)
    pool.tick(now + 0.01, relays)  # the maintenance the changes asked for
    return opened


# ------------------------------------------------------------------ choice


def test_a_fresh_pool_opens_n_paths_of_distinct_relays_and_distinct_proxies():
    pool = _pool()
    opened = _of(pool.tick(0.0, RELAYS), OpenPath)
    assert len(opened) == 5 and pool.setting_up == 5
    relays = [r for c in opened for r in c.relays]
    assert all(len(c.relays) == 3 for c in opened)
    assert len(relays) == len(set(relays))  # 20 relays >= n*l + 1: no reuse
    assert len({c.relays[-1] for c in opened}) == 5


@pytest.mark.parametrize("others", [3, 4], ids=["4-user-network", "5-user-network"])
def test_relays_repeating_across_paths_are_logged_once_at_info(caplog, others):
    pool = _pool()
    with caplog.at_level(logging.INFO, logger="ps_p2p.overlay.path_pool"):
        pool.tick(0.0, RELAYS[:others])
        pool.tick(1.0, RELAYS[:others])

    reports = [r for r in caplog.records if "candidate relays" in r.getMessage()]
    assert [r.levelno for r in reports] == [logging.INFO]
    assert "some relays serve two paths of this user (a network of >= 16 users" in (
        reports[0].getMessage()
    )


def test_without_a_directory_nothing_opens_and_the_pool_retries_at_the_maintenance_interval():
    pool = _pool()
    assert pool.tick(0.0, None) == []
    assert pool.next_deadline() == pytest.approx(0.5)
    assert pool.tick(0.2, RELAYS) == []  # not due yet
    assert len(_of(pool.tick(0.5, RELAYS), OpenPath)) == 5


def test_paths_still_opening_count_against_the_missing_ones():
    pool = _pool()
    pool.tick(0.0, RELAYS)
    assert _of(pool.tick(1.0, RELAYS), OpenPath) == []


def test_at_most_max_setups_paths_are_set_up_at_once_and_the_next_starts_as_one_finishes():
    pool = _pool(max_setups=2)
    first = _of(pool.tick(0.0, RELAYS), OpenPath)
    assert len(first) == 2 and pool.setting_up == 2
    assert _of(pool.tick(0.5, RELAYS), OpenPath) == []  # two in flight: nothing more
    pool.path_ready(first[0].path_id, 0.6)  # a setup finished: the next one starts at once
    assert pool.next_deadline() is None
    second = _of(pool.tick(0.6, RELAYS), OpenPath)
    assert len(second) == 1 and pool.setting_up == 2
    pool.path_failed(first[1].path_id, 0.7)  # a failure frees its slot at the next maintenance
    assert _of(pool.tick(0.7, RELAYS), OpenPath) == []
    third = _of(pool.tick(0.7 + 0.5, RELAYS), OpenPath)
    assert len(third) == 1 and pool.setting_up == 2
    # the pool still fills up to N paths, two setups at a time
    now = 2.0
    while len(pool.live_paths()) < 5:
        for command in _of(pool.tick(now, RELAYS), OpenPath):
            assert pool.setting_up <= 2
        for path_id in list(pool._opening):
            pool.path_ready(path_id, now)
        now += 0.5
    assert len(pool.live_paths()) == 5 and pool.setting_up == 0


@pytest.mark.parametrize("value", [0, -1])
def test_max_setups_below_one_is_refused(value):
    from ps_p2p.errors import ConfigError

    with pytest.raises(ConfigError):
        PoolConfig(max_setups=value)


def test_a_convicted_proxy_is_never_chosen_as_a_proxy_while_flagged():
    pool = _pool(paths=4)
    bad = RELAYS[0]
    pool.convict_proxy(bad, 0.0)
    for command in _of(pool.tick(0.0, RELAYS), OpenPath):
        assert command.relays[-1] != bad
    assert bad in pool.bad_proxies


@dataclass
class _Ref:
    name: str
    proxy: bytes


@pytest.mark.parametrize(
    "proxies, count, distinct",
    [
        ([b"a", b"b", b"c", b"d", b"e"], 4, 4),
        ([b"a", b"a", b"b", b"c", b"d"], 4, 4),  # a repeated proxy is left out while others exist
        ([b"a", b"a", b"b", b"b"], 4, 2),  # too few proxies: repeats fill up
    ],
)
def test_choose_distinct_proxies_takes_one_path_per_proxy_where_possible(
    proxies, count, distinct, caplog
):
    refs = [_Ref(str(i), p) for i, p in enumerate(proxies)]
    with caplog.at_level(logging.WARNING, logger="ps_p2p.overlay.path_pool"):
        chosen = choose_distinct_proxies(refs, count, random.Random(1))
    assert len(chosen) == count
    assert len({c.proxy for c in chosen}) == distinct
    assert len({c.name for c in chosen}) == count
    warnings = [r.getMessage() for r in caplog.records]
    if distinct < count:  # only a request that must double up a proxy warns
        assert warnings == [f"only {distinct} distinct proxies among {len(proxies)} ready paths: "
                            "one proxy carries two cloves of this request (a network of >= 5 "
                            "users avoids this)"]
    else:
        assert warnings == []


# ------------------------------------------------------------------ confirmation and probes


def test_a_path_is_not_used_for_requests_before_its_first_probe_reply():
    pool = _pool(paths=1, total=1)
    (opened,) = _of(pool.tick(0.0, RELAYS), OpenPath)
    commands = pool.path_ready(opened.path_id, 1.0)
    (probe,) = _of(commands, SendProbe)
    assert _of(commands, PoolChanged)
    assert pool.ready_paths() == [] and len(pool.live_paths()) == 1
    assert pool.probe_reply(opened.path_id, probe.nonce, 1.2) == [PoolChanged()]
    assert [p.path_id for p in pool.ready_paths()] == [opened.path_id]


def test_a_probe_reply_with_another_nonce_confirms_nothing():
    pool = _pool(paths=1, total=1)
    (opened,) = _of(pool.tick(0.0, RELAYS), OpenPath)
    (probe,) = _of(pool.path_ready(opened.path_id, 0.0), SendProbe)
    assert pool.probe_reply(opened.path_id, probe.nonce ^ 1, 0.1) == []
    assert pool.ready_paths() == []


def test_the_next_probe_goes_out_a_probe_interval_after_the_last_reply():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0)
    (opened,) = _open_all(pool, 0.0)
    assert pool.next_deadline() == pytest.approx(0.01 + 2.0)
    assert _of(pool.tick(1.5, RELAYS), SendProbe) == []
    pool.heard_from(opened.path_id, 1.5)  # a response clove counts as a sign of life
    assert _of(pool.tick(2.2, RELAYS), SendProbe) == []
    assert [c.path_id for c in _of(pool.tick(3.5, RELAYS), SendProbe)] == [opened.path_id]


def _probe_gaps(pool: PathPool, path_id: int, count: int) -> list[float]:
    """Seconds from each answer to the path's next probe, for its next ``count`` probes (the
    pool ticked at its own deadlines; each probe answered 0.05 s after it went out)."""
    gaps: list[float] = []
    path = pool.path(path_id)
    while len(gaps) < count:
        answered = max(path.last_reply_at, path.probe_sent_at)
        probes: list[SendProbe] = []
        now = answered
        while not probes:  # deadlines without a probe: the pool's maintenance
            deadline = pool.next_deadline()  # None: at once
            now = now if deadline is None else max(now, deadline)
            probes = [p for p in _of(pool.tick(now, RELAYS), SendProbe) if p.path_id == path_id]
        (probe,) = probes
        gaps.append(round(now - answered, 6))
        pool.probe_reply(path_id, probe.nonce, now + 0.05)
    return gaps


def test_an_idle_path_that_keeps_answering_is_probed_less_often_up_to_its_ceiling():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0, probe_interval=10.0)
    (opened,) = _open_all(pool, 0.0)
    # 10 s, then twice as long after each answer, up to 4 x 10 s
    assert _probe_gaps(pool, opened.path_id, 6) == [10.0, 20.0, 40.0, 40.0, 40.0, 40.0]


def test_a_request_clove_brings_an_idle_path_back_to_the_probe_interval():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0, probe_interval=10.0)
    (opened,) = _open_all(pool, 0.0)
    assert _probe_gaps(pool, opened.path_id, 3)[-1] == 40.0
    path = pool.path(opened.path_id)
    now = path.last_reply_at + 5.0
    (probe,) = _of(pool.clove_sent(opened.path_id, now), SendProbe)  # silent > probe_on_use
    pool.probe_reply(opened.path_id, probe.nonce, now + 0.05)
    assert pool.next_deadline() == pytest.approx(now + 0.05 + 10.0)


def test_a_path_that_went_silent_is_probed_at_the_probe_interval_after_it_answers_again():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0, probe_interval=10.0,
                 probe_attempts=3)
    (opened,) = _open_all(pool, 0.0)
    assert _probe_gaps(pool, opened.path_id, 3)[-1] == 40.0
    path = pool.path(opened.path_id)
    now = path.last_reply_at + 40.0
    (_,) = _of(pool.tick(now, RELAYS), SendProbe)
    # unanswered past its deadline: suspended, probed again, then answered late
    (again,) = _of(pool.tick(now + pool.path(opened.path_id).rtt.rto, RELAYS), SendProbe)
    assert path.suspended
    pool.probe_reply(opened.path_id, again.nonce, now + 5.0)
    assert not path.suspended
    assert _probe_gaps(pool, opened.path_id, 2) == [10.0, 20.0]  # backs off from the start


@pytest.mark.parametrize("interval, factor, most", [(10.0, 100, 40.0), (60.0, 4, 60.0),
                                                     (10.0, 1, 10.0)])
def test_an_idle_path_waits_at_most_the_ceiling_or_the_probe_interval(interval, factor, most):
    config = PoolConfig(probe_interval=interval, probe_idle_factor=factor)
    assert config.probe_idle_max == most


def test_a_probe_unanswered_past_the_rto_replaces_the_path_and_penalizes_its_relays():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0, probe_attempts=1)
    (opened,) = _open_all(pool, 0.0)
    (probe,) = _of(pool.tick(2.01, RELAYS), SendProbe)
    assert pool.next_deadline() == pytest.approx(2.01 + pool.probe_rtt.rto)
    assert _of(pool.tick(2.01 + pool.probe_rtt.rto - 0.1, RELAYS), ClosePath) == []
    commands = pool.tick(2.01 + pool.probe_rtt.rto, RELAYS)
    assert ClosePath(opened.path_id, "probe timeout") in commands
    assert PathLost(opened.path_id) in commands
    assert all(pool.penalty(r) == 1 for r in opened.relays)
    (rebuilt,) = _of(commands, OpenPath)  # at once, around the suspects
    assert not set(rebuilt.relays) & set(opened.relays)


def test_an_unanswered_probe_is_sent_again_with_twice_the_timeout_before_the_path_is_replaced():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0, probe_attempts=2)
    (opened,) = _open_all(pool, 0.0)
    (first,) = _of(pool.tick(2.01, RELAYS), SendProbe)
    rto = pool.probe_rtt.rto
    commands = pool.tick(2.01 + rto, RELAYS)  # first timeout: probe again, path kept
    (second,) = _of(commands, SendProbe)
    assert second.nonce != first.nonce
    assert _of(commands, ClosePath) == [] and _of(commands, PathLost) == []
    assert all(pool.penalty(r) == 0 for r in opened.relays)
    assert pool.next_deadline() == pytest.approx(2.01 + rto + 2 * rto)  # RFC 6298 5.5
    assert _of(pool.tick(2.01 + rto + 2 * rto - 0.1, RELAYS), ClosePath) == []
    commands = pool.tick(2.01 + 3 * rto, RELAYS)  # second timeout: replaced
    assert ClosePath(opened.path_id, "probe timeout") in commands
    assert all(pool.penalty(r) == 1 for r in opened.relays)


def test_a_late_answer_to_an_earlier_probe_of_the_series_keeps_the_path_without_an_rtt_sample():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0, probe_attempts=2)
    (opened,) = _open_all(pool, 0.0)
    srtt = pool.probe_rtt.srtt
    (first,) = _of(pool.tick(2.01, RELAYS), SendProbe)
    rto = pool.probe_rtt.rto
    (second,) = _of(pool.tick(2.01 + rto, RELAYS), SendProbe)
    pool.probe_reply(opened.path_id, first.nonce, 2.01 + rto + 0.5)  # the first one, late
    assert pool.probe_rtt.srtt == srtt  # ambiguous round trip: not sampled (Karn)
    assert [p.path_id for p in pool.ready_paths()] == [opened.path_id]
    commands = pool.tick(2.01 + 3 * rto + 1, RELAYS)  # the series is over: nothing times out
    assert _of(commands, ClosePath) == []
    pool.probe_reply(opened.path_id, second.nonce, 2.01 + 3 * rto + 2)  # stale now: ignored
    assert pool.probe_rtt.srtt == srtt
    # a nonce never sent counts for nothing
    (third,) = _of(pool.tick(100.0, RELAYS), SendProbe)
    pool.probe_reply(opened.path_id, third.nonce ^ 1, 100.1)
    assert pool.paths()[0].probe_nonce == third.nonce


def test_the_probe_deadline_grows_with_measured_round_trips():
    pool = _pool(paths=1, total=1, maintenance_interval=100.0)
    (opened,) = _of(pool.tick(0.0, RELAYS), OpenPath)
    (probe,) = _of(pool.path_ready(opened.path_id, 0.0), SendProbe)
    pool.probe_reply(opened.path_id, probe.nonce, 3.0)  # a loaded machine: 3 s round trips
    assert pool.probe_rtt.rto > 4.0
    (probe,) = _of(pool.tick(5.0, RELAYS), SendProbe)
    assert _of(pool.tick(9.5, RELAYS), ClosePath) == []  # past the 4 s floor, within the RTO
    assert pool.next_deadline() == pytest.approx(5.0 + pool.probe_rtt.rto)


def test_a_probe_that_could_not_be_sent_is_retried_after_the_maintenance_interval():
    pool = _pool(paths=1, total=1)
    (opened,) = _open_all(pool, 0.0)
    (probe,) = _of(pool.tick(2.01, RELAYS), SendProbe)
    pool.probe_not_sent(opened.path_id, probe.nonce, 2.01)
    assert _of(pool.tick(2.2, RELAYS), SendProbe) == []
    assert _of(pool.tick(2.6, RELAYS), SendProbe)
    assert _of(pool.tick(2.6 + 3.9, RELAYS), ClosePath) == []


# ------------------------------------------------------------------ penalties


def test_a_probe_reply_clears_the_relays_before_the_proxy_only():
    relays = RELAYS[:3]
    pool = _pool(paths=1, total=1)
    (first,) = _of(pool.tick(0.0, relays), OpenPath)
    pool.path_failed(first.path_id, 0.1)
    assert all(pool.penalty(r) == 1 for r in relays)
    (second,) = _of(pool.tick(0.6, relays), OpenPath)  # the least suspected fill up
    (probe,) = _of(pool.path_ready(second.path_id, 0.7), SendProbe)
    pool.probe_reply(second.path_id, probe.nonce, 0.8)
    assert [pool.penalty(r) for r in second.relays] == [0, 0, 1]


@pytest.mark.parametrize("first_hop_down, suspects", [(True, 1), (False, 3)])
def test_a_failed_setup_makes_its_relays_suspect(first_hop_down, suspects):
    pool = _pool(paths=1, total=1)
    (opened,) = _of(pool.tick(0.0, RELAYS), OpenPath)
    assert pool.path_failed(opened.path_id, 0.1, first_hop_down=first_hop_down) == []
    assert [pool.penalty(r) for r in opened.relays] == [1] * suspects + [0] * (3 - suspects)
    (rebuilt,) = _of(pool.tick(0.6, RELAYS), OpenPath)
    assert not set(rebuilt.relays) & set(opened.relays[:suspects])


def test_penalties_are_forgotten_after_the_cooldown():
    pool = _pool(paths=1, total=1)
    (opened,) = _of(pool.tick(0.0, RELAYS), OpenPath)
    pool.path_failed(opened.path_id, 0.1)
    pool.tick(30.2, RELAYS)
    assert all(pool.penalty(r) == 0 for r in opened.relays)


# ------------------------------------------------------------------ loss, conviction, rotation


def test_a_ready_path_that_goes_down_is_reported_lost_and_rebuilt():
    pool = _pool()
    opened = _open_all(pool, 0.0)
    victim = opened[0].path_id
    assert pool.path_down(victim, 1.0) == [PathLost(victim), PoolChanged()]
    assert pool.path_down(victim, 1.0) == []
    assert len(_of(pool.tick(1.0, RELAYS), OpenPath)) == 1


def test_a_convicted_proxy_loses_every_path_it_serves():
    pool = _pool()
    opened = _open_all(pool, 0.0)
    proxy = opened[0].relays[-1]
    commands = pool.convict_proxy(proxy, 1.0)
    assert commands[:2] == [ClosePath(opened[0].path_id, "proxy altered a clove"),
                            PathLost(opened[0].path_id)]
    (rebuilt,) = _of(pool.tick(1.0, RELAYS), OpenPath)
    assert rebuilt.relays[-1] != proxy


def test_paths_rotate_after_the_rotation_period_and_close_after_the_grace():
    pool = _pool(paths=1, total=1, rotate_period=10.0, retire_grace=5.0, probe_interval=100.0)
    (opened,) = _open_all(pool, 0.0)
    assert pool.next_deadline() == pytest.approx(0.51)
    commands = pool.tick(10.0, RELAYS)
    assert pool.ready_paths() == []  # retired: no new request
    assert len(_of(commands, OpenPath)) == 1  # its replacement
    assert pool.path(opened.path_id) is not None  # still carries answers
    assert ClosePath(opened.path_id, "rotated") in pool.tick(15.0, RELAYS)


def test_rotate_all_retires_every_path_at_once_and_the_next_tick_replaces_them():
    pool = _pool(paths=2, total=2, max_setups=2, retire_grace=5.0, probe_interval=100.0)
    opened = _open_all(pool, 0.0)
    assert len(pool.ready_paths()) == 2
    pool.rotate_all(1.0)
    assert pool.ready_paths() == []  # no new request goes over a published proxy
    assert all(pool.path(o.path_id) is not None for o in opened)  # still carry answers
    replacements = _of(pool.tick(1.0, RELAYS), OpenPath)
    assert len(replacements) == 2
    assert {r.path_id for r in replacements}.isdisjoint(o.path_id for o in opened)
    closed = _of(pool.tick(6.0, RELAYS), ClosePath)
    assert {c.path_id for c in closed} == {o.path_id for o in opened}


def test_rebalancing_replaces_a_path_that_shares_relays_once_free_relays_appear():
    pool = _pool(paths=2, total=2)
    few = RELAYS[:4]
    opened = _open_all(pool, 0.0, few)
    assert len({r for c in opened for r in c.relays}) < 6  # 4 relays for 2 x 3 hops
    assert _of(pool.tick(0.6, few), OpenPath) == []  # no free relay: nothing to do
    commands = pool.tick(1.2, RELAYS)
    (replacement,) = _of(commands, OpenPath)
    assert len(pool.ready_paths()) == 1  # one path retired
    kept = pool.ready_paths()[0]
    assert not set(replacement.relays) & set(kept.relays)


def test_rebalancing_counts_the_victims_own_relays_as_free():
    # 2 paths of 3 hops over 5 relays share one; with 7 relays the pool can be disjoint although
    # only 2 relays are used by neither path
    pool = _pool(paths=2, total=2)
    opened = _open_all(pool, 0.0, RELAYS[:5])
    used = {r for c in opened for r in c.relays}
    assert len(used) == 5
    seven = RELAYS[:7]
    (replacement,) = _of(pool.tick(0.6, seven), OpenPath)
    (kept,) = pool.ready_paths()
    assert not set(replacement.relays) & set(kept.relays)



def test_a_full_pool_forgives_penalties_after_the_cooldown_and_then_rebalances():
    r = RELAYS
    pool = _pool(paths=2, total=2)
    for command in _of(pool.tick(0.0, [r[0], r[5], r[6]]), OpenPath):
        pool.path_failed(command.path_id, 0.1)  # e.g. while the network was starting
    opened = _open_all(pool, 0.6, r[:5])  # the 4 clean relays, shared by 2 paths
    assert {x for c in opened for x in c.relays} <= set(r[1:5])
    assert _of(pool.tick(1.0, r[:7]), OpenPath) == []  # 1 clean relay outside a path: wait
    (replacement,) = _of(pool.tick(31.0, r[:7]), OpenPath)  # forgiven: the shared path goes
    (kept,) = pool.ready_paths()
    assert not set(replacement.relays) & set(kept.relays)


# ------------------------------------------------------------------ counters (PoolStats)


def _ready(pool: PathPool, path_id: int, now: float) -> None:
    """The path's setup is acknowledged and its first probe answered."""
    for probe in _of(pool.path_ready(path_id, now), SendProbe):
        pool.probe_reply(probe.path_id, probe.nonce, now)


def _ready_all(pool: PathPool, now: float) -> list[OpenPath]:
    """Tick at ``now``; every path opened gets ready and confirmed."""
    opened = _of(pool.tick(now, RELAYS), OpenPath)
    for command in opened:
        _ready(pool, command.path_id, now)
    return opened


def _fill(pool: PathPool) -> list[OpenPath]:
    return _ready_all(pool, 0.0)


def _fresh(pool):
    _fill(pool)


def _setup_fails(pool):
    (first, *_) = _of(pool.tick(0.0, RELAYS), OpenPath)
    pool.path_failed(first.path_id, 0.1)


def _down_then_repaired(pool):
    (first, *_) = _fill(pool)
    pool.path_down(first.path_id, 1.0)
    _ready_all(pool, 1.0)


def _down_repair_fails_then_repaired(pool):
    (first, *_) = _fill(pool)
    pool.path_down(first.path_id, 1.0)
    (repair,) = _of(pool.tick(1.0, RELAYS), OpenPath)
    pool.path_failed(repair.path_id, 1.1)
    _ready_all(pool, 2.0)


def _down_not_yet_repaired(pool):
    (first, *_) = _fill(pool)
    pool.path_down(first.path_id, 1.0)
    pool.tick(1.0, RELAYS)  # the replacement is still setting up


def _probe_timeout_then_repaired(pool):
    _fill(pool)
    pool.tick(2.0, RELAYS)  # every path sends a probe; none is answered
    pool.tick(2.0 + pool.probe_rtt.rto, RELAYS)
    for path in list(pool._opening):  # the replacements open in the same tick
        _ready(pool, path, 7.0)


def _bad_proxy(pool):
    (first, *_) = _fill(pool)
    pool.convict_proxy(first.relays[-1], 1.0)


def _rotated_and_replaced(pool):
    _fill(pool)
    pool.tick(10.0, RELAYS)  # every path retires; replacements open
    for path in list(pool._opening):
        _ready(pool, path, 10.0)
    pool.tick(15.0, RELAYS)  # the grace is over: the retired paths close


def _retiring_path_down(pool):
    (first, *_) = _fill(pool)
    pool.tick(10.0, RELAYS)  # every path retires; replacements open
    for path in list(pool._opening):
        _ready(pool, path, 10.0)
    pool.path_down(first.path_id, 11.0)  # its replacement is already built
    _ready_all(pool, 11.0)


@pytest.mark.parametrize(
    "scenario, expected",
    [
        (_fresh, PoolStats(built=2)),
        (_setup_fails, PoolStats(setups_failed=1)),
        (_down_then_repaired, PoolStats(built=3, lost={"down": 1}, repaired=1)),
        (_down_repair_fails_then_repaired,
         PoolStats(built=3, setups_failed=1, lost={"down": 1}, repaired=1)),
        (_down_not_yet_repaired, PoolStats(built=2, lost={"down": 1})),
        (_probe_timeout_then_repaired,
         PoolStats(built=4, lost={"probe_timeout": 2}, repaired=2)),
        (_bad_proxy, PoolStats(built=2, lost={"bad_proxy": 1})),
        (_rotated_and_replaced, PoolStats(built=4, rotated=2)),
        (_retiring_path_down, PoolStats(built=4, lost={"down": 1})),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "",
)
def test_pool_counters_count_builds_failures_losses_repairs_and_rotations(scenario, expected):
    # probes every 2 s (unanswered ones fail the path at once) in the probe timeout scenario;
    # elsewhere no probe falls due
    probe_interval = 2.0 if scenario is _probe_timeout_then_repaired else 100.0
    pool = _pool(paths=2, total=2, probe_interval=probe_interval, probe_attempts=1,
                 rotate_period=10.0, retire_grace=5.0, maintenance_interval=0.5)

    scenario(pool)

    assert pool.stats == expected


def test_paths_rotating_at_one_tick_are_logged_in_one_line_naming_each_once(caplog):
    """Issue 21: "rotating path via X" came once per path, so two paths of one first hop read
    as the same line twice."""
    import logging

    pool = _pool(rotate_period=10.0, retire_grace=5.0, probe_interval=100.0)
    opened = _open_all(pool, 0.0)
    caplog.set_level(logging.INFO, logger="ps_p2p.overlay.path_pool")

    pool.tick(10.0, RELAYS)

    (line,) = [r.getMessage() for r in caplog.records if "rotating" in r.getMessage()]
    assert line.startswith(f"rotating {len(opened)} path(s) older than 10 s")
    from ps_p2p.records import short_peer_id

    for command in opened:  # distinct proxies: each path named exactly once
        assert line.count(f"..{short_peer_id(command.relays[-1])}") == 1


def _suspect(pool: PathPool, relays: list[bytes], now: float) -> None:
    """Every setup over ``relays`` fails (e.g. at a start, a relay that did not know the next
    hop's address yet): each of them is suspect."""
    for command in _of(pool.tick(now, relays), OpenPath):
        pool.path_failed(command.path_id, now + 0.1)
    assert all(pool.penalty(r) > 0 for r in relays)


def test_suspect_relays_fill_up_to_n_distinct_proxies_when_the_clean_ones_are_too_few():
    # 3 clean relays of 7 after a start's failed setups: the pool must still reach n = 4
    # distinct proxies (else every request waits out the request core's distinct-proxy
    # grace, 1 s) instead of waiting out the 30 s cooldown
    pool = _pool(paths=5, total=4)
    _suspect(pool, RELAYS[3:7], 0.0)
    opened = _open_all(pool, 0.6, RELAYS[:7])
    assert len({c.relays[-1] for c in opened}) >= 4


def test_a_full_pool_short_of_n_distinct_proxies_rebalances_onto_a_suspect_relay():
    pool = _pool(paths=5, total=4)
    _suspect(pool, RELAYS[3:7], 0.0)
    opened = _open_all(pool, 0.6, RELAYS[:3])  # 3 users known: 3 distinct proxies at most
    assert len({c.relays[-1] for c in opened}) == 3
    (replacement,) = _of(pool.tick(1.2, RELAYS[:7]), OpenPath)
    assert replacement.relays[-1] in RELAYS[3:7]  # a fourth proxy, although a suspect one


def test_a_setup_abandoned_after_an_address_change_makes_no_relay_suspect():
    pool = _pool(paths=1, total=1)
    (opened,) = _of(pool.tick(0.0, RELAYS), OpenPath)
    assert pool.path_failed(opened.path_id, 0.1, blameless=True) == []
    assert [pool.penalty(r) for r in opened.relays] == [0, 0, 0]
    assert (pool.stats.setups_abandoned, pool.stats.setups_failed) == (1, 0)
    (rebuilt,) = _of(pool.tick(0.6, RELAYS), OpenPath)  # rebuilt at the next maintenance
    assert rebuilt.path_id != opened.path_id


def test_an_address_change_forgives_the_relays_that_failed_since_its_first_signs():
    # the first hops "went down" because this node's own connections died, not theirs
    pool = _pool(paths=2, total=2)
    before, during = _of(pool.tick(0.0, RELAYS), OpenPath)
    pool.path_failed(before.path_id, 1.0, first_hop_down=True)  # long before the change
    pool.path_failed(during.path_id, 9.0, first_hop_down=True)
    assert pool.address_changed(since=8.0, now=10.0) == []  # no ready path to probe
    assert pool.penalty(during.relays[0]) == 0
    assert pool.penalty(before.relays[0]) == 1


def test_an_address_change_probes_every_ready_path_and_replaces_the_dead_within_a_deadline():
    # a path whose first hop's connection died with all the others, but that carried nothing
    # since, is found one probe deadline after the change, not at its next probe 10 s on
    pool = _pool(probe_interval=10.0, probe_timeout=1.0)
    opened = _open_all(pool, 0.0)
    probes = _of(pool.address_changed(since=4.0, now=5.0), SendProbe)
    assert sorted(p.path_id for p in probes) == sorted(c.path_id for c in opened)
    live = probes[0]
    pool.probe_reply(live.path_id, live.nonce, 5.1)
    rebuilt = _of(pool.tick(6.5, RELAYS), OpenPath)  # the other four: suspended, replaced
    assert len(rebuilt) == 4
    assert [p.path_id for p in pool.ready_paths()] == [live.path_id]
