"""The consensus simulator: every property on 500+ random schedules (N = 3f+1, f = 1..3, up to
f Byzantine validators, drops, delays, reorders and partitions before GST), and the checker
catching deliberately broken cores."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from ps_p2p.consensus.core import ConsensusCore
from ps_p2p.consensus.types import Step, TimeoutKind, VoteType
from ps_p2p.testing.consensus_sim import (
    BEHAVIOURS,
    PROPERTIES,
    SimParams,
    run_schedule,
    summarize,
    termination_rounds,
)

SCHEDULES = 510
HEIGHTS = 3


def test_every_property_holds_on_500_schedules():
    start = time.perf_counter()
    results = [run_schedule(seed, heights=HEIGHTS) for seed in range(SCHEDULES)]
    elapsed = time.perf_counter() - start
    bad = [(r.seed, r.violations) for r in results if not r.ok]
    assert bad == []
    summary = summarize(results)
    assert summary["heights_decided"] == SCHEDULES * HEIGHTS
    assert {r.f for r in results} == {1, 2, 3}
    assert sum(len(r.byzantine) for r in results) > SCHEDULES // 2  # faults were injected
    assert elapsed < 120, f"{SCHEDULES} schedules took {elapsed:.0f} s"


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_f_byzantine_validators_of_one_behaviour_break_nothing(behaviour):
    for seed in range(12):
        f = 1 + seed % 3
        params = SimParams(
            f=f,
            heights=2,
            gst=1.5,
            drop=0.2,
            pre_gst_delay=0.3,
            delta=0.05,
            app_delay=0.01,
            partitions=(),
            byzantine={i: behaviour for i in range(0, 3 * f + 1, 3)[:f]},
        )
        result = run_schedule(seed, params=params)
        assert result.ok, (seed, result.violations)
        assert result.heights_decided == 2


def test_the_same_seed_gives_the_same_schedule():
    a, b = run_schedule(77), run_schedule(77)
    assert (a.rounds, a.deliveries, a.end_time, a.byzantine) == (
        b.rounds,
        b.deliveries,
        b.end_time,
        b.byzantine,
    )
    assert run_schedule(78).deliveries != a.deliveries


class DecidesOnPrevotes(ConsensusCore):
    """Broken L49: decides on 2f+1 prevotes (the wrong vote type) instead of precommits."""

    def _precommit_quorums(self):
        k = self.keeper
        found = []
        for r in k.rounds_with_quorum(VoteType.PREVOTE):
            _, vid = k.quorum_value(r, VoteType.PREVOTE)
            if vid is not None:
                found.append((r, vid))
        return found


class SkipsValidation(ConsensusCore):
    """Broken L23/L29/L50: takes every proposed value as valid without asking."""

    def _on_proposal(self, inp, out):
        super()._on_proposal(inp, out)
        p = inp.proposal
        if p.height == self.height and p.value_id in self._proposals.get(p.round, {}):
            self._validating.discard(p.value_id)
            self._validity[p.value_id] = True


class TimeoutProposeIgnoresStep(ConsensusCore):
    """Broken L58: prevotes nil on timeout propose even after prevoting."""

    def _on_timeout(self, inp, out):
        if (
            inp.kind == TimeoutKind.PROPOSE
            and inp.height == self.height
            and inp.round == self.round
            and self.decision is None
        ):
            self._vote(VoteType.PREVOTE, None, out)
            self.step = max(self.step, Step.PREVOTE)
            return
        super()._on_timeout(inp, out)


@pytest.mark.parametrize(
    ("broken", "seeds", "prop"),
    [
        # seeds chosen where this schedule generator exposes the bug (about 1 in 150 for this one)
        (DecidesOnPrevotes, range(80, 150), "agreement"),
        (SkipsValidation, range(60), "validity"),
        (TimeoutProposeIgnoresStep, range(10), "no-double-sign"),
    ],
)
def test_checker_catches_a_broken_core(broken, seeds, prop):
    caught = [s for s in seeds if prop in run_schedule(s, core_factory=broken).violations]
    assert caught, f"{broken.__name__} was not caught on seeds {seeds}"
    assert all(run_schedule(s).ok for s in caught)  # the correct core passes the same schedules


def test_checker_reports_non_termination_with_more_than_f_silent_validators():
    params = SimParams(
        f=1,
        heights=1,
        gst=0.0,
        drop=0.0,
        pre_gst_delay=0.1,
        delta=0.05,
        app_delay=0.0,
        partitions=(),
        byzantine={0: "silent", 1: "silent"},
        max_time=20.0,
    )
    result = run_schedule(1, params=params)
    assert list(result.violations) == ["termination"]
    assert result.heights_decided == 0


def test_summary_counts_rounds_and_violations_by_property():
    results = [run_schedule(s, heights=2) for s in range(5)]
    s = summarize(results)
    assert s["schedules"] == 5
    assert sum(s["rounds_per_height"].values()) == s["heights_decided"] == 10
    assert set(s["violations"]) == set(PROPERTIES)
    assert termination_rounds(4) == 6


def test_summary_counts_schedules_and_failures_by_adversary_and_feature():
    import random

    from ps_p2p.testing.consensus_sim import features

    restarted = next(p for p in (draw_adversarial_params(random.Random(s), 1, 1)
                                 for s in range(100)) if p.restarts)
    assert features(restarted)[0] == "mixed" and "restarts" in features(restarted)
    results = [run_schedule(s, mode="adversarial", heights=1) for s in range(40)]
    results.append(run_schedule(1, params=dataclasses.replace(
        restarted, byzantine={0: "silent", 1: "silent"}, restarts=(), max_time=3.0)))
    s = summarize(results)
    assert s["schedules_by_feature"]["mixed"] == sum(r.adversary == "mixed" for r in results)
    assert s["schedules_by_feature"]["quorum-split"] > 0
    assert s["failed_by_feature"] == {f: 1 for f in results[-1].features}


def test_a_validator_that_saw_an_equivocators_other_value_still_catches_up():
    # seed 5012: a Byzantine proposer showed val-05 another value; it must count the commit
    result = run_schedule(5012)
    assert result.ok, result.violations


# ----------------------------------------------------------------------------- issue 17: the
# adversarial schedules (restarts with WAL replay, unequal powers, delays above the timeouts,
# link cuts, quorum split, twins) and the gossip policies shared with the service

from ps_p2p.consensus.gossip_policy import OwnRecentRoundsBefore, RelayAll  # noqa: E402
from ps_p2p.consensus.types import Proposal, Vote  # noqa: E402
from ps_p2p.testing.consensus_sim import (  # noqa: E402
    SIM_CONFIG,
    draw_adversarial_params,
    quorum_split_params,
    rounds_to_cover,
)


def test_every_property_holds_on_300_adversarial_schedules():
    results = [run_schedule(seed, mode="adversarial", heights=2) for seed in range(300)]
    bad = [(r.seed, r.adversary, r.violations) for r in results if not r.ok]
    assert bad == []
    kinds = {r.adversary for r in results}
    assert kinds == {"mixed", "quorum-split", "twins", "one-third", "lock-race"}
    assert sum(r.wal_refused for r in results) > 0  # restarts re-derived votes the WAL refused


def test_adversarial_draws_cover_restarts_powers_slow_links_and_byzantine_power_below_a_third():
    import random

    drawn = [draw_adversarial_params(random.Random(s), 1 + s % 3, 2) for s in range(300)]
    mixed = [p for p in drawn if p.adversary == "mixed"]
    assert any(p.restarts for p in mixed) and any(p.cuts for p in mixed)
    assert any(len(set(p.powers)) > 1 for p in mixed)
    assert any(p.delta > SIM_CONFIG.timeout_prevote for p in drawn)  # above the base timeout
    for p in drawn:
        powers = p.powers or (1,) * p.n
        byz = 3 * sum(powers[i] for i in p.byzantine)
        if p.adversary == "one-third":  # exactly 1/3: safety only
            assert byz == sum(powers) and not p.termination
        else:
            assert byz < sum(powers) and p.termination
        assert all(crash <= restart <= p.gst for crash, restart, _ in p.restarts)


def test_timeouts_must_cover_the_delay_before_the_termination_bound_counts():
    assert rounds_to_cover(0.05, SIM_CONFIG) == 0
    r = rounds_to_cover(0.5, SIM_CONFIG)
    assert SIM_CONFIG.timeout(TimeoutKind.PROPOSE, r) >= 1.5
    assert SIM_CONFIG.timeout(TimeoutKind.PROPOSE, r - 1) < 1.5 or (
        SIM_CONFIG.timeout(TimeoutKind.PREVOTE, r - 1) < 1.0)


class DecidesOnOneThird(ConsensusCore):
    """Broken L49: decides on f+1 (more than 1/3 of the power) precommits."""

    def _precommit_quorums(self):
        k = self.keeper
        found = []
        for r in k.rounds():
            for vid, power in k.powers(r, VoteType.PRECOMMIT).items():
                if vid is not None and k.is_one_third(power):
                    found.append((r, vid))
        return found


def test_quorum_split_catches_deciding_on_f_plus_1_precommits_every_time():
    import random

    caught = 0
    for seed in range(20):
        params = quorum_split_params(random.Random(seed), 1 + seed % 3, heights=1)
        assert run_schedule(seed, params=params).ok
        result = run_schedule(seed, params=params, core_factory=DecidesOnOneThird)
        caught += "agreement" in result.violations
    assert caught == 20


class IgnoresLockAtL29(ConsensusCore):
    """Broken L29: prevotes a re-proposal with a POL whatever its lock."""

    def _apply_rule(self, out):
        saved = self.locked_round
        if self.step == Step.PROPOSE:
            self.locked_round = -1
        try:
            return super()._apply_rule(out)
        finally:
            if self.locked_round == -1:
                self.locked_round = saved


def test_the_lock_property_is_checked_on_what_a_validator_signs():
    # the broken core prevotes another value while locked on an older POL somewhere in these
    caught = [s for s in range(200)
              if "lock" in run_schedule(s, mode="adversarial", heights=2,
                                        core_factory=IgnoresLockAtL29).violations]
    assert caught, "IgnoresLockAtL29 was not caught in 200 adversarial schedules"


def test_a_restarted_validator_replays_its_wal_and_never_signs_twice():
    params = SimParams(
        f=1, heights=2, gst=2.0, drop=0.1, pre_gst_delay=0.2, delta=0.05, app_delay=0.01,
        partitions=(), byzantine={3: "equivocate"},
        restarts=((0.2, 0.9, 0), (0.5, 1.5, 1)),
    )
    results = [run_schedule(seed, params=params) for seed in range(20)]
    assert all(r.ok for r in results), [(r.seed, r.violations) for r in results if not r.ok]
    assert all(r.heights_decided == 2 for r in results)


def test_twins_of_one_key_in_two_partitions_break_nothing():
    for seed in range(15):
        f = 1 + seed % 3
        params = SimParams(
            f=f, heights=2, gst=1.5, drop=0.0, pre_gst_delay=0.1, delta=0.05, app_delay=0.0,
            partitions=(), byzantine={0: "twin"},
            twins=((0, frozenset(range(1, 3 * f + 1, 2))),),
        )
        result = run_schedule(seed, params=params)
        assert result.ok, (seed, result.violations)


def test_unequal_powers_weight_the_quorums():
    params = SimParams(
        f=1, heights=2, gst=1.0, drop=0.1, pre_gst_delay=0.2, delta=0.05, app_delay=0.0,
        partitions=(), byzantine={0: "vote-all"}, powers=(2, 3, 3, 1, 1),
    )
    for seed in range(15):
        result = run_schedule(seed, params=params)
        assert result.ok, (seed, result.violations)
        assert result.n == 5


def test_own_recent_rounds_resends_only_own_messages_of_the_last_two_rounds():
    policy = OwnRecentRoundsBefore(0.2)
    mine = [Vote(VoteType.PREVOTE, 1, r, None, b"a") for r in range(4)]
    old = Vote(VoteType.PREVOTE, 0, 5, None, b"a")
    for m in (*mine, old):
        policy.on_send(m, 0.0)
    policy.on_receive(Vote(VoteType.PREVOTE, 1, 3, None, b"b"), b"b", 0.0)
    assert policy.tick(0.0, 1, 3) == [(None, mine[2]), (None, mine[3])]
    assert policy.tick(0.1, 1, 3) == []  # not due
    assert policy.next_tick() == pytest.approx(0.2)
    assert policy.tick(0.2, 2, 0) == []  # a new height: nothing of it sent yet


def test_relay_all_resends_everything_heard_while_the_height_is_stuck():
    policy = RelayAll(0.5, start=1.0)
    p = Proposal(0, 0, b"V1", -1, b"a")
    theirs = Vote(VoteType.PREVOTE, 0, 0, None, b"b")
    policy.on_send(p, 0.0)
    policy.on_receive(theirs, b"b", 0.0)
    assert policy.tick(0.5, 0, 0) == []  # before its start (GST in the simulator)
    assert policy.tick(1.0, 0, 0) == [(None, p), (None, theirs)]
    assert policy.tick(1.5, 0, 0) == [(None, p), (None, theirs)]
    assert policy.tick(2.0, 1, 0) == []  # the height moved since the last tick


# Issue 17, finding 2: the service re-sent only its own messages of its last two rounds, and
# the simulator with that policy failed termination (seeds 78, 88, 105 of run_schedule(seed,
# gossip="before")). The simulator's "service" mode now runs the service's own Gossip object
# (ServiceGossip), and those schedules terminate.
def test_the_services_rebroadcast_policy_terminates_on_every_schedule():
    seeds = (78, 88, 105, 114, *range(40))
    results = [run_schedule(s, gossip="service") for s in seeds]
    assert all(r.ok for r in results), [(r.seed, r.violations) for r in results if not r.ok]
    adversarial = [run_schedule(s, gossip="service", mode="adversarial", heights=2)
                   for s in (203, 296, 305, *range(20))]
    assert all(r.ok for r in adversarial), [
        (r.seed, r.adversary, r.violations) for r in adversarial if not r.ok]


def test_the_old_own_messages_only_rebroadcast_halts_where_the_service_gossip_does_not():
    """The "before" model still shows finding 2 (so the simulator would catch a return to it)."""
    for seed in (78, 88, 105):
        assert "termination" in run_schedule(seed, gossip="before").violations
        assert run_schedule(seed, gossip="service").ok


def test_the_simulators_service_mode_runs_the_services_gossip_object():
    from ps_p2p.consensus.gossip import Gossip
    from ps_p2p.consensus.gossip_policy import ServiceGossip
    from ps_p2p.testing.consensus_sim import _Sim

    sim = _Sim(0, dataclasses.replace(draw_adversarial_params(random.Random(0), 1, 1),
                                      gossip="service"), ConsensusCore, SIM_CONFIG)
    policy = sim.new_policy(0)
    assert isinstance(policy, ServiceGossip) and type(policy.gossip) is Gossip


def test_service_gossip_sends_a_re_proposals_pol_certificate_to_peers_that_lack_it():
    from ps_p2p.consensus.core import ConsensusConfig
    from ps_p2p.consensus.gossip_policy import ServiceGossip
    from ps_p2p.consensus.types import StartHeight, Validator, VoteReceived, value_id

    addrs = [b"a", b"b", b"c", b"d"]
    core = ConsensusCore(b"a", ConsensusConfig())
    core.handle(StartHeight(0, tuple(Validator(x, 1) for x in addrs)), 0.0)
    policy = ServiceGossip(b"a", addrs, lambda: core, 0.2)
    pol = [Vote(VoteType.PREVOTE, 0, 0, value_id(b"V1"), x) for x in (b"b", b"c", b"d")]
    for v in pol:
        core.handle(VoteReceived(v), 0.0)
        policy.on_receive(v, v.validator, 0.0)
    sends = policy.on_send(Proposal(0, 1, b"V1", 0, b"a"), 0.1)
    # each peer lacks the two prevotes it did not sign
    assert sorted((peer, m.validator) for peer, m in sends) == [
        (b"b", b"c"), (b"b", b"d"), (b"c", b"b"), (b"c", b"d"), (b"d", b"b"), (b"d", b"c")]


@pytest.mark.slow
def test_mutation_check_short_form():
    """A few mutants of scripts/consensus_mutants.py, each caught by the tests or the
    simulator (the full table: ``python scripts/consensus_mutants.py``)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "consensus_mutants.py"
    spec = importlib.util.spec_from_file_location("consensus_mutants", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("consensus_mutants", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    names = ("quorum read as >= 2/3", "L49 decide on f+1 precommits",
             "L61 precommit the proposal on timeoutPrevote", "L29 ignore the lock")
    mutants = tuple(m for m in mod.MUTANTS if m.name in names)
    assert len(mutants) == len(names)
    rows = mod.check(mutants, ref=None, schedules=15, tests=True, sim=True, budget=60,
                     baseline=False)
    assert [r["mutant"] for r in rows if not r["caught"]] == []


def test_byzantine_third_of_the_power_catches_quorum_read_as_two_thirds_or_more(monkeypatch):
    import random

    from ps_p2p.consensus.votes import VoteKeeper
    from ps_p2p.testing.consensus_sim import one_third_params

    drawn = [(s, one_third_params(random.Random(s), 1 + s % 3)) for s in range(30)]
    assert all(run_schedule(s, params=p).ok for s, p in drawn)  # > 2/3 is safe at 1/3 faulty
    monkeypatch.setattr(VoteKeeper, "is_quorum", lambda k, power: 3 * power >= 2 * k.total_power)
    caught = [s for s, p in drawn if "agreement" in run_schedule(s, params=p).violations]
    assert len(caught) >= 5, caught


def test_the_lock_race_catches_ignoring_the_lock_at_L29_every_time():
    import random

    from ps_p2p.testing.consensus_sim import lock_race_params

    for seed in range(10):
        params = lock_race_params(random.Random(seed))
        assert run_schedule(seed, params=params).ok
        result = run_schedule(seed, params=params, core_factory=IgnoresLockAtL29)
        assert "lock" in result.violations, seed


# Found by the adversarial campaign (4 of 10,000 schedules, relay gossip: seeds 2268, 2529,
# 5802, 9265): a correct validator locks in round 0 on a polka that includes a Byzantine
# vote only it received, then crashes; RestoreLock gave it back its lock and validRound but
# not the 2f+1 prevotes behind them, so no correct validator could ever accept its
# re-proposal (L28) while it prevoted nil for every other value (L29) and the Byzantine one
# withheld the third vote. The WAL now keeps the polka's prevotes with the lock and a restart
# replays them (the POL certificate of the re-proposal).
@pytest.mark.parametrize("seed", [2268, 2529, 5802, 9265])
def test_a_restarted_locked_validator_can_still_get_its_value_accepted(seed):
    result = run_schedule(seed, mode="adversarial", heights=2)
    assert result.ok, result.violations


# Found by a 10,000-schedule adversarial campaign with the service's gossip (seed 9984, a
# lock-race schedule): at height 1, validators 1 and 2 precommitted in the decided round but
# validator 0's precommit to them was lost (a cut until GST) and the Byzantine one never
# precommitted; they held two precommits, too few for L49 (decide) and for L47 (so no
# timeoutPrecommit, no later round). Validator 0 decided and moved on: its gossip sent the
# last commit only to a peer in a *later* round of the decided height, and its own precommit
# was no longer among its "own messages" (those of its new height). Now a peer at the decided
# height that may lack one of our own messages of the commit (we know it lost frames from us)
# is sent the commit it lacks. Run with no unchecked heights past the last checked one (the
# deciders then say nothing of a next height, whose messages would let 1 and 2 block-sync):
# only the commit rule can end the height, so the test fails without it.
def test_the_service_gossip_decides_the_lock_race_schedule_9984(monkeypatch):
    import ps_p2p.testing.consensus_sim as consensus_sim

    monkeypatch.setattr(consensus_sim, "UNCHECKED_HEIGHTS", 0)
    result = run_schedule(9984, gossip="service", mode="adversarial", heights=2)
    assert result.ok, result.violations


# Found by a 10,000-schedule classic campaign with the service's gossip (seed 8476, 1 of
# 10,000; the same on the code before the seed-9984 fix): val-00 proposes height 0, then a
# partition cuts it from all six others from 0.03 s to 0.80 s (GST 1.06 s). The others decide
# heights 0, 1 and 2 (the last checked one) by 0.78 s. When the simulated validators stopped
# there, they had nothing of a next height to send, so val-00 never heard a higher height and
# never block-synced. A service starts the next height: the simulator now runs unchecked
# heights past the checked ones (UNCHECKED_HEIGHTS) until every correct validator has decided
# every checked height, and val-00 syncs from their messages of height 3.
def test_the_service_gossip_decides_the_classic_schedule_8476():
    result = run_schedule(8476, gossip="service")
    assert result.ok, result.violations
