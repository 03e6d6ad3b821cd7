"""Frozen hosts in the path pool core (issue 20 sec. 4): a path that stays silent leaves the
ready set at once, each path keeps its own probe deadline, and setups waiting on a silent first
hop free their slot. Pure core, injected time."""

from __future__ import annotations

import random

import pytest

from ps_p2p.overlay.path_pool import (
    OpenPath,
    PathLost,
    PathPool,
    PathSuspended,
    PoolConfig,
    SendProbe,
)

RELAYS = [bytes([i]) * 8 for i in range(1, 21)]


def _pool(**overrides) -> PathPool:
    fields = {"total": 4, "paths": 5, "hops": 3, "max_setups": 5}
    fields.update(overrides)
    return PathPool(PoolConfig(**fields), rng=random.Random(3))


def _of(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def _ready_pool(now: float = 0.0, rtt: float = 0.01, **overrides) -> PathPool:
    """A pool whose paths are all ready, each first probe answered after ``rtt`` s."""
    pool = _pool(**overrides)
    for command in _of(pool.tick(now, RELAYS), OpenPath):
        for probe in _of(pool.path_ready(command.path_id, now), SendProbe):
            pool.probe_reply(probe.path_id, probe.nonce, now + rtt)
    pool.tick(now + rtt, RELAYS)
    assert len(pool.ready_paths()) == pool.config.paths
    return pool


def _ready_ids(pool: PathPool) -> set[int]:
    return {p.path_id for p in pool.ready_paths()}


# ------------------------------------------------------------------ silence leaves the ready set


@pytest.mark.parametrize(
    "silence",
    ["probe", "request clove"],
)
def test_a_path_with_an_unanswered_probe_or_request_clove_leaves_the_ready_set_at_once(silence):
    pool = _ready_pool()
    victim = pool.ready_paths()[0]
    if silence == "probe":
        assert _of(pool.clove_sent(victim.path_id, 5.0), SendProbe)
        commands = pool.tick(5.0 + victim.rtt.rto, RELAYS)  # its first timeout
    else:
        commands = pool.path_silent(victim.path_id, 5.0)
    assert PathSuspended(victim.path_id) in commands
    assert victim.path_id not in _ready_ids(pool)
    assert _of(commands, PathLost) == []  # not dropped: a late answer may bring it back


def test_a_silent_path_is_probed_and_a_probe_answer_brings_it_back():
    pool = _ready_pool()
    victim = pool.ready_paths()[0]
    (probe,) = _of(pool.path_silent(victim.path_id, 5.0), SendProbe)
    assert probe.path_id == victim.path_id
    pool.probe_reply(victim.path_id, probe.nonce, 5.05)
    # its replacement is not answered yet: the path that answered serves again
    assert victim.path_id in _ready_ids(pool)


def test_a_suspended_path_is_replaced_at_once_and_retired_when_it_comes_back_to_a_full_pool():
    pool = _ready_pool(maintenance_interval=100.0)
    victim = pool.ready_paths()[0]
    (probe,) = _of(pool.path_silent(victim.path_id, 5.0), SendProbe)
    (replacement,) = _of(pool.tick(5.0, RELAYS), OpenPath)
    assert victim.proxy not in replacement.relays  # built around the silent path's relays
    for p in _of(pool.path_ready(replacement.path_id, 5.5), SendProbe):
        pool.probe_reply(p.path_id, p.nonce, 5.51)
    pool.probe_reply(victim.path_id, probe.nonce, 6.0)  # late: the pool is full again
    assert victim.path_id not in _ready_ids(pool)
    assert pool.path(victim.path_id).retiring
    assert len(pool.ready_paths()) == pool.config.paths


def test_a_replacement_ready_after_the_silent_path_came_back_retires_that_path():
    """The other order: the silent path answers first (it serves again, one path short of a
    spare), then its replacement is confirmed; the pool holds one path too many, and the one
    that went silent is let go, not kept beside the replacement until rotation."""
    pool = _ready_pool(maintenance_interval=100.0)
    victim = pool.ready_paths()[0]
    (probe,) = _of(pool.path_silent(victim.path_id, 5.0), SendProbe)
    (replacement,) = _of(pool.tick(5.0, RELAYS), OpenPath)
    pool.probe_reply(victim.path_id, probe.nonce, 5.2)  # back before its replacement is in
    assert victim.path_id in _ready_ids(pool)
    for p in _of(pool.path_ready(replacement.path_id, 5.5), SendProbe):
        pool.probe_reply(p.path_id, p.nonce, 5.51)
    assert replacement.path_id in _ready_ids(pool)
    assert pool.path(victim.path_id).retiring
    assert len(pool.ready_paths()) == pool.config.paths


# ------------------------------------------------------------------ a frozen path stops quickly


@pytest.mark.parametrize("probe_rtt", [0.001, 0.05, 0.2])
def test_a_frozen_path_stops_carrying_cloves_within_3_s_of_an_unanswered_clove(probe_rtt):
    pool = _ready_pool(rtt=probe_rtt)
    victim = pool.ready_paths()[0]
    pool.tick(4.0, RELAYS)
    sent_at = 4.0  # a request clove goes out; the path's relay froze after its last answer
    commands = pool.clove_sent(victim.path_id, sent_at)
    assert _of(commands, SendProbe), "a clove on a path silent for a while probes it along"
    suspended_at = None
    now = sent_at
    while now < sent_at + 10:
        now = max(pool.next_deadline() or now, now + 0.001)
        if PathSuspended(victim.path_id) in pool.tick(now, RELAYS):
            suspended_at = now
            break
    assert suspended_at is not None and suspended_at - sent_at <= 3.0


def test_a_clove_on_a_path_that_answered_recently_sends_no_probe():
    pool = _ready_pool()
    victim = pool.ready_paths()[0]
    pool.heard_from(victim.path_id, 4.0)
    assert pool.clove_sent(victim.path_id, 4.5) == []
    assert _of(pool.clove_sent(victim.path_id, 5.5), SendProbe)
    assert pool.clove_sent(victim.path_id, 5.6) == []  # one probe out at a time


# ------------------------------------------------------------------ per-path deadlines


def test_each_path_keeps_its_own_probe_deadline():
    """A slow (or dead) path's round trips and timeouts lengthen no other path's deadline."""
    pool = _ready_pool(maintenance_interval=100.0)
    slow, fast = pool.ready_paths()[:2]
    for k in range(8):  # the slow path answers in 3 s, every time
        (probe,) = _of(pool.clove_sent(slow.path_id, 20.0 + 10 * k), SendProbe)
        pool.probe_reply(slow.path_id, probe.nonce, 23.0 + 10 * k)
    assert slow.rtt.rto > 3.0
    (probe,) = _of(pool.clove_sent(fast.path_id, 200.0), SendProbe)
    assert fast.rtt.rto < 2.0
    commands = pool.tick(200.0 + fast.rtt.rto, RELAYS)
    assert PathSuspended(fast.path_id) in commands


def test_a_dead_paths_timeouts_do_not_lengthen_a_new_paths_deadline():
    pool = _ready_pool(maintenance_interval=0.5, probe_attempts=2)
    before = pool.probe_rtt.rto
    dead = pool.ready_paths()[0]
    pool.clove_sent(dead.path_id, 5.0)
    now = 5.0
    while pool.path(dead.path_id) is not None and now < 60:
        now += 0.25
        pool.tick(now, RELAYS)
    assert pool.path(dead.path_id) is None  # replaced after its probes went unanswered
    assert pool.probe_rtt.rto == before
    (opened, *_) = _of(pool.tick(now + 1, RELAYS), OpenPath) or [None]
    if opened is not None:
        pool.path_ready(opened.path_id, now + 1)
        assert pool.path(opened.path_id).rtt.rto == before


# ------------------------------------------------------------------ setup slots


def test_a_setup_unanswered_for_the_slot_time_frees_its_slot_within_a_bound():
    pool = _pool(max_setups=2, setup_slot_time=5.0, maintenance_interval=0.5)
    assert len(_of(pool.tick(0.0, RELAYS), OpenPath)) == 2  # two slots
    assert _of(pool.tick(4.9, RELAYS), OpenPath) == []
    # both setups wait on a silent first hop: their slots go to two more setups at the next
    # maintenance
    assert len(_of(pool.tick(5.4, RELAYS), OpenPath)) == 2
    assert pool.setting_up == 4
    # the bound: never more than 2 * max_setups in flight
    assert _of(pool.tick(10.9, RELAYS), OpenPath) == []
    assert pool.setting_up == 4


def test_the_first_hop_of_a_setup_unanswered_for_the_slot_time_is_avoided_by_the_next_ones():
    few = RELAYS[:4]  # one relay to spare: the next setup can leave the suspect out
    for seed in range(20):
        pool = PathPool(PoolConfig(total=1, paths=2, hops=3, max_setups=1, setup_slot_time=5.0,
                                   maintenance_interval=0.5), rng=random.Random(seed))
        (stuck,) = _of(pool.tick(0.0, few), OpenPath)
        assert pool.penalty(stuck.relays[0]) == 0
        (following,) = _of(pool.tick(5.0, few), OpenPath)
        assert pool.penalty(stuck.relays[0]) == 1
        assert stuck.relays[0] not in following.relays


def test_a_path_answering_late_keeps_its_backed_off_deadline_and_no_other_path_gets_it():
    """Karn (RFC 6298 5.7): a late answer gives no sample, so the doubled RTO stays with that
    path until a probe is answered in time; a machine slowed past the RTO then suspends each
    path once, not at every probe."""
    pool = _ready_pool(maintenance_interval=100.0, probe_interval=1000.0)
    slow, other = pool.ready_paths()[:2]
    base = slow.rtt.rto
    (first,) = _of(pool.clove_sent(slow.path_id, 10.0), SendProbe)
    pool.tick(10.0 + base, RELAYS)  # unanswered in time: suspended, probed again
    pool.probe_reply(slow.path_id, first.nonce, 10.0 + base + 0.5)  # the late answer
    assert slow.path_id in _ready_ids(pool)
    (probe,) = _of(pool.clove_sent(slow.path_id, 20.0), SendProbe)
    # within its doubled deadline
    assert PathSuspended(slow.path_id) not in pool.tick(20.0 + 1.5 * base, RELAYS)
    pool.probe_reply(slow.path_id, probe.nonce, 20.0 + 1.5 * base)
    assert other.rtt.rto == base
