"""Verification epochs (PlanetServe sec. 3.4): the leader draw, the seed commit-reveal, the
challenge plan, the >1/3 miss tally and the score tolerance (pure cores)."""

from __future__ import annotations

import collections
import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps_p2p.consensus.types import Validator
from ps_p2p.errors import (
    InvalidPlanError,
    InvalidRevealError,
    InvalidScoreError,
    LocalProtocolError,
    VerificationError,
)
from ps_p2p.keys import Identity
from ps_p2p.records.peer_ids import ED25519_PEER_ID_PREFIX
from ps_p2p.verification import epochs
from ps_p2p.verification.epochs import (
    Challenge,
    MissTally,
    Plan,
    check_response_time,
    check_reveal,
    check_scores,
    decode_plan,
    derive_plan,
    derive_secret,
    epoch_seed,
    leader,
    seed_commitment,
    verify_plan,
    within_tolerance,
)

CHAIN = "planetserve-test"
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
ADDRS = [k.peer_id for k in KEYS]
EQUAL = tuple(Validator(a) for a in ADDRS)
WEIGHTED = tuple(Validator(a, p) for a, p in zip(ADDRS, (1, 2, 3, 4)))
PREV = hashlib.sha256(b"last block of epoch 6").digest()


def node(i: int) -> bytes:
    """A model node's peer ID (only its length is checked by the plan)."""
    return ED25519_PEER_ID_PREFIX + i.to_bytes(32, "big")


REGISTRY = [node(i) for i in range(1, 11)]
SEED = hashlib.sha256(b"seed").digest()


# ------------------------------------------------------------------------------------ leader


def test_the_leader_is_the_same_for_everyone():
    first = leader(7, PREV, WEIGHTED)
    assert leader(7, PREV, WEIGHTED) == first
    assert leader(7, PREV, tuple(reversed(WEIGHTED))) == first  # order of the set is irrelevant
    assert first in ADDRS


def test_the_leader_is_drawn_in_proportion_to_voting_power():
    counts = collections.Counter(
        leader(e, hashlib.sha256(e.to_bytes(8, "big")).digest(), WEIGHTED) for e in range(4000)
    )
    for v in WEIGHTED:
        share = counts[v.address] / 4000
        assert share == pytest.approx(v.power / 10, abs=0.03)


def test_a_new_attempt_or_block_hash_draws_again():
    by_attempt = {leader(7, PREV, EQUAL, attempt=a) for a in range(40)}
    by_hash = {leader(7, hashlib.sha256(bytes([i])).digest(), EQUAL) for i in range(40)}
    assert by_attempt == set(ADDRS)
    assert by_hash == set(ADDRS)


def test_a_single_validator_always_leads():
    assert {leader(e, PREV, EQUAL[:1]) for e in range(20)} == {ADDRS[0]}


@pytest.mark.parametrize(("epoch", "prev", "validators", "attempt", "error"), [
    (-1, PREV, EQUAL, 0, ValueError),
    (2**64, PREV, EQUAL, 0, ValueError),
    (1, PREV[:31], EQUAL, 0, ValueError),
    (1, PREV, EQUAL, -1, ValueError),
    (1, PREV, (), 0, LocalProtocolError),
    (1, PREV, (EQUAL[0], EQUAL[0]), 0, LocalProtocolError),
    (1, PREV, (Validator(ADDRS[0], 0),), 0, LocalProtocolError),
])
def test_leader_refuses_bad_input(epoch, prev, validators, attempt, error):
    with pytest.raises(error):
        leader(epoch, prev, validators, attempt=attempt)


# ------------------------------------------------------------------------ seed commit-reveal


def test_a_revealed_secret_opens_its_commitment():
    secret = derive_secret(b"m" * 32, CHAIN, 7)
    commitment = seed_commitment(CHAIN, 7, ADDRS[0], secret)
    check_reveal(commitment, CHAIN, 7, ADDRS[0], secret)


@pytest.mark.parametrize("change", ["secret", "epoch", "validator", "chain", "short"])
def test_any_other_reveal_is_refused(change):
    secret = derive_secret(b"m" * 32, CHAIN, 7)
    commitment = seed_commitment(CHAIN, 7, ADDRS[0], secret)
    args = {"chain_id": CHAIN, "epoch": 7, "validator": ADDRS[0], "secret": secret}
    args.update({
        "secret": {"secret": bytes(32)}, "epoch": {"epoch": 8},
        "validator": {"validator": ADDRS[1]}, "chain": {"chain_id": "other"},
        "short": {"secret": secret[:31]},
    }[change])
    with pytest.raises(InvalidRevealError):
        check_reveal(commitment, **args)


def test_derived_secrets_differ_per_epoch_and_chain_and_repeat_after_a_restart():
    master = b"k" * 32
    assert derive_secret(master, CHAIN, 1) == derive_secret(master, CHAIN, 1)
    assert derive_secret(master, CHAIN, 1) != derive_secret(master, CHAIN, 2)
    assert derive_secret(master, CHAIN, 1) != derive_secret(master, "other", 1)
    with pytest.raises(ValueError):
        derive_secret(b"short", CHAIN, 1)


def test_the_seed_depends_on_every_committed_input():
    secret = b"s" * 32
    base = epoch_seed(CHAIN, 7, PREV, ADDRS[0], secret)
    assert epoch_seed(CHAIN, 7, PREV, ADDRS[0], secret) == base
    others = {
        epoch_seed("other", 7, PREV, ADDRS[0], secret),
        epoch_seed(CHAIN, 8, PREV, ADDRS[0], secret),
        epoch_seed(CHAIN, 7, bytes(32), ADDRS[0], secret),
        epoch_seed(CHAIN, 7, PREV, ADDRS[1], secret),
        epoch_seed(CHAIN, 7, PREV, ADDRS[0], b"t" * 32),
        epoch_seed(CHAIN, 7, PREV, ADDRS[0], secret, attempt=1),
    }
    assert base not in others and len(others) == 6


# -------------------------------------------------------------------------------------- plan


def test_the_plan_challenges_every_registered_node_with_distinct_prompts():
    plan = derive_plan(SEED, REGISTRY, pool_size=80)
    assert plan.model_nodes == tuple(sorted(REGISTRY))
    prompts = [c.prompt_index for c in plan.challenges]
    assert len(set(prompts)) == len(REGISTRY)
    assert all(0 <= p < 80 for p in prompts)


def test_the_plan_depends_only_on_the_seed_and_the_registry():
    plan = derive_plan(SEED, REGISTRY, 80)
    assert derive_plan(SEED, list(reversed(REGISTRY)), 80) == plan
    assert derive_plan(hashlib.sha256(b"other").digest(), REGISTRY, 80) != plan


def test_the_leader_cannot_steer_the_plan():
    """The leader's only input is its secret, committed before the block hash existed: a
    different secret does not open the commitment, so the plan every verifier derives from the
    revealed one is the only plan."""
    me = leader(7, PREV, EQUAL)
    secret = derive_secret(b"leader master key..............!", CHAIN, 7)
    commitment = seed_commitment(CHAIN, 7, me, secret)
    committed_plan = derive_plan(epoch_seed(CHAIN, 7, PREV, me, secret), REGISTRY, 80)
    for i in range(50):  # a leader grinding for a plan it likes
        other = hashlib.sha256(b"grind" + bytes([i])).digest()
        if derive_plan(epoch_seed(CHAIN, 7, PREV, me, other), REGISTRY, 80) != committed_plan:
            with pytest.raises(InvalidRevealError):
                check_reveal(commitment, CHAIN, 7, me, other)
    # another validator cannot lead the epoch with its own (valid) secret: it is not the leader
    others = [a for a in ADDRS if a != me]
    assert all(leader(7, PREV, EQUAL) != a for a in others)


def test_a_plan_naming_an_unregistered_node_is_refused():
    expected = derive_plan(SEED, REGISTRY, 80)
    first = expected.challenges[0]
    forged = Plan(SEED, tuple(sorted(
        (Challenge(node(99), first.prompt_index),) + expected.challenges[1:])))
    with pytest.raises(InvalidPlanError, match="not a registered model node"):
        verify_plan(forged, expected, REGISTRY)


def test_a_plan_that_drops_swaps_or_repeats_is_refused():
    expected = derive_plan(SEED, REGISTRY, 80)
    c0, c1 = expected.challenges[:2]
    dropped = Plan(SEED, expected.challenges[1:])
    swapped = Plan(SEED, tuple(sorted(
        (Challenge(c0.model_node, c1.prompt_index), Challenge(c1.model_node, c0.prompt_index))
        + expected.challenges[2:])))
    repeated = Plan(SEED, tuple(sorted(
        (c0, Challenge(c1.model_node, c0.prompt_index)) + expected.challenges[2:])))
    other_seed = Plan(hashlib.sha256(b"x").digest(), expected.challenges)
    for claimed, reason in [(dropped, "differs|challenges"), (swapped, "differs"),
                            (repeated, "twice"), (other_seed, "seed")]:
        with pytest.raises(InvalidPlanError, match=reason):
            verify_plan(claimed, expected, REGISTRY)
    verify_plan(expected, expected, REGISTRY)


def test_excluded_prompts_are_never_asked():
    excluded = set(range(0, 80, 2))
    plan = derive_plan(SEED, REGISTRY, 80, exclude=excluded)
    assert not excluded & {c.prompt_index for c in plan.challenges}


def test_a_pool_too_small_for_the_plan_is_refused():
    with pytest.raises(ValueError, match="usable prompts"):
        derive_plan(SEED, REGISTRY, 12, challenges_per_node=2)
    with pytest.raises(ValueError, match="usable prompts"):
        derive_plan(SEED, REGISTRY, 12, exclude=range(3))
    # exactly enough: every prompt is used once
    plan = derive_plan(SEED, REGISTRY, 12, exclude=range(2))
    assert sorted(c.prompt_index for c in plan.challenges) == list(range(2, 12))


def test_a_sample_of_nodes_is_drawn_from_the_registry():
    plan = derive_plan(SEED, REGISTRY, 80, max_nodes=4)
    assert len(plan.model_nodes) == 4 and set(plan.model_nodes) <= set(REGISTRY)
    picked = collections.Counter(
        n for s in range(300)
        for n in derive_plan(hashlib.sha256(bytes([s % 256, s // 256])).digest(), REGISTRY, 80,
                             max_nodes=4).model_nodes
    )
    assert set(picked) == set(REGISTRY)
    assert all(k / 300 == pytest.approx(0.4, abs=0.1) for k in picked.values())


def test_several_challenges_per_node_and_sampling_options():
    plan = derive_plan(SEED, REGISTRY, 200, challenges_per_node=3, sampling_options=4)
    for n in REGISTRY:
        assert len(plan.for_node(n)) == 3
    assert {c.sampling for c in plan.challenges} <= {0, 1, 2, 3}
    assert len({c.sampling for c in plan.challenges}) > 1


def test_prompts_are_drawn_uniformly_from_the_pool():
    counts = collections.Counter(
        c.prompt_index for s in range(400)
        for c in derive_plan(hashlib.sha256(s.to_bytes(2, "big")).digest(), REGISTRY, 20)
        .challenges
    )
    assert set(counts) == set(range(20))
    assert all(k / 4000 == pytest.approx(1 / 20, abs=0.02) for k in counts.values())


@pytest.mark.parametrize("kwargs", [
    {"seed": b"short"}, {"model_nodes": [node(1), node(1)]}, {"model_nodes": [b"x" * 10]},
    {"pool_size": 0}, {"pool_size": 2**32}, {"challenges_per_node": 0},
    {"challenges_per_node": 65}, {"sampling_options": 0}, {"exclude": [-1]},
    {"max_nodes": -1},
])
def test_derive_plan_refuses_bad_input(kwargs):
    args = {"seed": SEED, "model_nodes": REGISTRY, "pool_size": 80} | kwargs
    with pytest.raises(ValueError):
        derive_plan(**args)


def test_more_challenges_than_a_plan_may_hold_are_refused():
    many = [node(i) for i in range(epochs.MAX_PLAN_CHALLENGES + 1)]
    with pytest.raises(ValueError, match="max_nodes"):
        derive_plan(SEED, many, 2**20)
    assert len(derive_plan(SEED, many, 2**20, max_nodes=10).challenges) == 10


@given(st.binary(min_size=32, max_size=32), st.integers(0, 30), st.integers(1, 3),
       st.integers(0, 200), st.sets(st.integers(0, 400), max_size=40),
       st.one_of(st.none(), st.integers(0, 30)))
def test_every_plan_is_well_formed(seed, nodes, per_node, extra, exclude, max_nodes):
    registry = [node(i) for i in range(nodes)]
    pool = nodes * per_node + len(exclude) + extra + 1
    plan = derive_plan(seed, registry, pool, per_node, max_nodes=max_nodes, exclude=exclude)
    prompts = [c.prompt_index for c in plan.challenges]
    assert len(set(prompts)) == len(prompts)
    assert all(0 <= p < pool and p not in exclude for p in prompts)
    assert set(plan.model_nodes) <= set(registry)
    assert len(plan.model_nodes) == min(nodes, nodes if max_nodes is None else max_nodes)
    assert all(len(plan.for_node(n)) == per_node for n in plan.model_nodes)
    assert decode_plan(plan.encode()) == plan


# ------------------------------------------------------------------------------ plan bytes


def test_plan_bytes_round_trip_and_hash():
    plan = derive_plan(SEED, REGISTRY, 80, sampling_options=3)
    data = plan.encode()
    assert data.startswith(epochs.PLAN_DOMAIN)
    assert decode_plan(data) == plan
    assert plan.hash() == hashlib.sha256(data).digest()


def test_malformed_plan_bytes_are_refused():
    plan = derive_plan(SEED, REGISTRY, 80)
    data = plan.encode()
    c = plan.challenges
    unsorted = Plan(SEED, (c[1], c[0]) + c[2:]).encode()
    twice = Plan(SEED, (c[0], Challenge(c[1].model_node, c[0].prompt_index)) + c[2:]).encode()
    huge = epochs.PLAN_DOMAIN + epochs.lp(SEED) + epochs.u32(epochs.MAX_PLAN_CHALLENGES + 1)
    for bad in [data + b"\x00", data[:-1], b"x" + data[1:], unsorted, twice, huge, "text"]:
        with pytest.raises(InvalidPlanError):
            decode_plan(bad)


# ------------------------------------------------------------------------------------ misses


def test_a_miss_needs_more_than_a_third_of_the_power():
    tally = MissTally(EQUAL, REGISTRY[:2])  # 4 validators of power 1
    assert tally.report(ADDRS[0], REGISTRY[0])  # the leader's report alone: 1/4
    assert not tally.missed(REGISTRY[0])
    assert tally.report(ADDRS[1], REGISTRY[0])  # 2/4 > 1/3
    assert tally.missed(REGISTRY[0])
    assert tally.missed_nodes() == [REGISTRY[0]]


def test_exactly_a_third_is_not_enough():
    tally = MissTally(EQUAL[:3], REGISTRY[:1])
    tally.report(ADDRS[0], REGISTRY[0])
    assert tally.reported_power(REGISTRY[0]) == 1 and not tally.missed(REGISTRY[0])
    tally.report(ADDRS[1], REGISTRY[0])
    assert tally.missed(REGISTRY[0])


def test_misses_are_weighed_by_voting_power():
    tally = MissTally(WEIGHTED, REGISTRY[:2])  # powers 1, 2, 3, 4; total 10
    tally.report(ADDRS[0], REGISTRY[0])
    tally.report(ADDRS[1], REGISTRY[0])  # 3/10
    assert not tally.missed(REGISTRY[0])
    tally.report(ADDRS[3], REGISTRY[1])  # 4/10 > 1/3
    assert tally.missed(REGISTRY[1])


def test_a_duplicate_report_counts_once():
    tally = MissTally(EQUAL, REGISTRY[:1])
    assert tally.report(ADDRS[0], REGISTRY[0])
    assert not tally.report(ADDRS[0], REGISTRY[0])
    assert not tally.report(ADDRS[0], REGISTRY[0])
    assert tally.reported_power(REGISTRY[0]) == 1 and not tally.missed(REGISTRY[0])


def test_reports_from_strangers_or_about_unplanned_nodes_are_refused():
    tally = MissTally(EQUAL, REGISTRY[:1])
    with pytest.raises(VerificationError, match="not a validator"):
        tally.report(KEYS[0].peer_id[:-1] + b"\xff", REGISTRY[0])
    with pytest.raises(VerificationError, match="not in the epoch's plan"):
        tally.report(ADDRS[0], REGISTRY[1])
    assert tally.reported_power(REGISTRY[1]) == 0


# ------------------------------------------------------------------------- scores and times


def test_scores_within_the_tolerance_are_accepted():
    assert within_tolerance(0.70, 0.71)
    assert within_tolerance(0.70, 0.68)
    assert not within_tolerance(0.70, 0.75)
    assert within_tolerance(0.5, 0.5, tolerance=0.0)
    assert not within_tolerance(0.5, 0.51, tolerance=0.005)


@pytest.mark.parametrize("bad", [-0.1, 1.1, math.nan, math.inf, None, "0.5", True])
def test_a_proposed_score_outside_zero_one_is_refused(bad):
    with pytest.raises(InvalidScoreError):
        within_tolerance(0.5, bad)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_a_tolerance_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError):
        within_tolerance(0.5, 0.5, tolerance=bad)


def test_a_leader_that_proposes_wrong_scores_is_refused():
    own = {REGISTRY[0]: 0.81, REGISTRY[1]: 0.30}
    check_scores(own, {REGISTRY[0]: 0.80, REGISTRY[1]: 0.31})
    with pytest.raises(VerificationError, match="off"):
        check_scores(own, {REGISTRY[0]: 0.80, REGISTRY[1]: 0.75})  # lifts a cheater
    with pytest.raises(VerificationError, match="not for the challenges"):
        check_scores(own, {REGISTRY[0]: 0.80})
    with pytest.raises(InvalidScoreError):
        check_scores(own, {REGISTRY[0]: 0.80, REGISTRY[1]: 2.0})


def test_a_response_signed_outside_its_epoch_is_refused():
    start, end = 1_000_000, 1_060_000
    check_response_time(start + 5, start, end, max_skew_ms=0)
    check_response_time(start - 100, start, end, max_skew_ms=1000)
    with pytest.raises(VerificationError, match="before its epoch"):
        check_response_time(start - 1, start, end, max_skew_ms=0)
    with pytest.raises(VerificationError, match="after its epoch"):
        check_response_time(end + 1, start, end, max_skew_ms=0)
    with pytest.raises(ValueError):
        check_response_time(start, end, start)
