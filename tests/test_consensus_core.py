"""Tables of (state, input) -> (outputs, new state) for Algorithm 1 of Buchman, Kwon, Milosevic,
"The latest gossip on BFT consensus" (arXiv 1807.04938), one or more per line that acts
(``test_L22_...`` cites line 22), and the vote keeper's counting.

The committee is A, B, C, D of power 1 (N = 4, f = 1: 2f+1 = 3, f+1 = 2); the proposer of
(h, r) is ``[A, B, C, D][(h + r) % 4]``.
"""

from __future__ import annotations

import random

import pytest

from ps_p2p.consensus.core import ConsensusConfig, ConsensusCore, RoundState, proposer_cycle
from ps_p2p.consensus.types import (
    NIL_ROUND,
    BroadcastProposal,
    BroadcastVote,
    Decide,
    Equivocation,
    GetValue,
    Proposal,
    ProposalEquivocation,
    ProposalReceived,
    ProposeValue,
    ScheduleTimeout,
    StartHeight,
    Step,
    TimeoutFired,
    TimeoutKind,
    ValidateValue,
    Validator,
    ValueValidated,
    Vote,
    VoteReceived,
    VoteType,
    value_id,
)
from ps_p2p.consensus.votes import MAX_FUTURE_ROUNDS_PER_VALIDATOR, AddVoteResult, VoteKeeper
from ps_p2p.errors import LocalProtocolError

A, B, C, D = b"val-a", b"val-b", b"val-c", b"val-d"
E = b"val-e"  # not a validator
VALS = tuple(Validator(x) for x in (A, B, C, D))
V, W = b"V-value", b"W-value"
IV, IW = value_id(V), value_id(W)
PV, PC = VoteType.PREVOTE, VoteType.PRECOMMIT
CFG = ConsensusConfig(
    timeout_propose=3.0,
    timeout_propose_delta=0.5,
    timeout_prevote=1.0,
    timeout_prevote_delta=0.25,
    timeout_precommit=2.0,
    timeout_precommit_delta=0.125,
)
PROPOSER = {0: A, 1: B, 2: C, 3: D}  # round -> proposer at height 0


def prop(r: int, value: bytes = V, vr: int = NIL_ROUND, h: int = 0) -> Proposal:
    return Proposal(h, r, value, vr, PROPOSER[(h + r) % 4])


def vote(t: VoteType, r: int, vid: bytes | None, who: bytes, h: int = 0) -> Vote:
    return Vote(t, h, r, vid, who)


def make(
    me: bytes = A,
    *,
    round_: int = 0,
    step: Step = Step.PROPOSE,
    locked: tuple[bytes | None, int] = (None, NIL_ROUND),
    valid: tuple[bytes | None, int] = (None, NIL_ROUND),
    proposals: tuple[Proposal, ...] = (),
    votes: tuple[Vote, ...] = (),
    validity: dict[bytes, bool] | None = None,
) -> ConsensusCore:
    """A core at height 0 in the given state of Algorithm 1 (variables and message log),
    built without firing any rule."""
    core = ConsensusCore(me, CFG)
    core.handle(StartHeight(0, VALS), 0.0)
    core.round, core.step = round_, step
    core.keeper.set_round(round_)
    core._awaiting_value = None
    core.locked_value, core.locked_round = locked
    core.valid_value, core.valid_round = valid
    out: list = []
    for p in proposals:
        core._on_proposal(ProposalReceived(p), out)
    for v in votes:
        core._on_vote(VoteReceived(v), out)
    for vid, ok in (validity or {}).items():
        core._validating.discard(vid)
        core._validity[vid] = ok
    return core


def st(
    round_: int = 0,
    step: Step = Step.PROPOSE,
    locked: tuple[bytes | None, int] = (None, NIL_ROUND),
    valid: tuple[bytes | None, int] = (None, NIL_ROUND),
    decided: bytes | None = None,
    height: int = 0,
) -> RoundState:
    return RoundState(height, round_, step, locked[0], locked[1], valid[0], valid[1], decided)


def prevotes(r: int, vid: bytes | None, *who: bytes) -> tuple[Vote, ...]:
    return tuple(vote(PV, r, vid, w) for w in who)


def precommits(r: int, vid: bytes | None, *who: bytes) -> tuple[Vote, ...]:
    return tuple(vote(PC, r, vid, w) for w in who)


def timeout(kind: TimeoutKind, r: int, h: int = 0) -> ScheduleTimeout:
    return ScheduleTimeout(kind, h, r, CFG.timeout(kind, r))


# ----------------------------------------------------------------------------- the table

CASES = [
    # name, core, input, expected outputs, expected state
    (
        "L11_L18_proposer_without_valid_value_asks_the_application",
        lambda: ConsensusCore(A, CFG),
        StartHeight(0, VALS),
        [GetValue(0, 0), timeout(TimeoutKind.PROPOSE, 0)],
        st(),
    ),
    (
        "L21_non_proposer_schedules_timeout_propose",
        lambda: ConsensusCore(B, CFG),
        StartHeight(0, VALS),
        [timeout(TimeoutKind.PROPOSE, 0)],
        st(),
    ),
    (
        "L15_L19_proposer_with_valid_value_proposes_it_with_valid_round",
        lambda: make(B, step=Step.PRECOMMIT, valid=(V, 0), locked=(V, 0)),
        TimeoutFired(TimeoutKind.PRECOMMIT, 0, 0),
        [BroadcastProposal(Proposal(0, 1, V, 0, B))],
        st(1, Step.PROPOSE, locked=(V, 0), valid=(V, 0)),
    ),
    (
        "L22_L24_valid_proposal_unlocked_prevotes_its_id",
        lambda: make(B, proposals=(prop(0),)),
        ValueValidated(0, 0, IV, True),
        [BroadcastVote(vote(PV, 0, IV, B))],
        st(0, Step.PREVOTE),
    ),
    (
        "L22_L26_invalid_proposal_prevotes_nil",
        lambda: make(B, proposals=(prop(0),)),
        ValueValidated(0, 0, IV, False),
        [BroadcastVote(vote(PV, 0, None, B))],
        st(0, Step.PREVOTE),
    ),
    (
        "L22_L26_locked_on_another_value_prevotes_nil",
        lambda: make(B, round_=4, locked=(W, 2), valid=(W, 2), validity={IV: True}),
        ProposalReceived(prop(4)),
        [BroadcastVote(vote(PV, 4, None, B))],
        st(4, Step.PREVOTE, locked=(W, 2), valid=(W, 2)),
    ),
    (
        "L22_L24_locked_on_the_same_value_prevotes_its_id",
        lambda: make(B, round_=4, locked=(V, 2), valid=(V, 2), validity={IV: True}),
        ProposalReceived(prop(4)),
        [BroadcastVote(vote(PV, 4, IV, B))],
        st(4, Step.PREVOTE, locked=(V, 2), valid=(V, 2)),
    ),
    (
        "L22_waits_for_validity_and_asks_for_it",
        lambda: make(B),
        ProposalReceived(prop(0)),
        [ValidateValue(0, 0, V)],
        st(0, Step.PROPOSE),
    ),
    (
        "L22_proposal_not_from_the_proposer_is_ignored",
        lambda: make(C, validity={IV: True}),
        ProposalReceived(Proposal(0, 0, V, NIL_ROUND, B)),
        [],
        st(0, Step.PROPOSE),
    ),
    (
        "L28_L30_polka_for_valid_round_prevotes_id_when_locked_round_at_most_vr",
        lambda: make(
            C,
            round_=2,
            locked=(W, 0),
            valid=(W, 0),
            votes=prevotes(1, IV, A, B, D),
            validity={IV: True},
        ),
        ProposalReceived(prop(2, V, vr=1)),
        [BroadcastVote(vote(PV, 2, IV, C))],
        st(2, Step.PREVOTE, locked=(W, 0), valid=(W, 0)),
    ),
    (
        "L28_L32_locked_in_a_later_round_on_another_value_prevotes_nil",
        lambda: make(
            C,
            round_=3,
            locked=(W, 2),
            valid=(W, 2),
            votes=prevotes(1, IV, A, B, D),
            validity={IV: True},
        ),
        ProposalReceived(prop(3, V, vr=1)),
        [BroadcastVote(vote(PV, 3, None, C))],
        st(3, Step.PREVOTE, locked=(W, 2), valid=(W, 2)),
    ),
    (
        "L28_L32_invalid_value_with_polka_prevotes_nil",
        lambda: make(C, round_=2, votes=prevotes(1, IV, A, B, D), validity={IV: False}),
        ProposalReceived(prop(2, V, vr=1)),
        [BroadcastVote(vote(PV, 2, None, C))],
        st(2, Step.PREVOTE),
    ),
    (
        "L28_without_2f1_prevotes_for_valid_round_waits",
        lambda: make(C, round_=2, votes=prevotes(1, IV, A, B), validity={IV: True}),
        ProposalReceived(prop(2, V, vr=1)),
        [],
        st(2, Step.PROPOSE),
    ),
    (
        "L28_the_prevote_completing_the_polka_of_valid_round_fires_it",
        lambda: make(
            C,
            round_=2,
            proposals=(prop(2, V, vr=1),),
            votes=prevotes(1, IV, A, B),
            validity={IV: True},
        ),
        VoteReceived(vote(PV, 1, IV, D)),
        [BroadcastVote(vote(PV, 2, IV, C))],
        st(2, Step.PREVOTE),
    ),
    (
        "L34_L35_2f1_prevotes_of_any_values_schedule_timeout_prevote",
        lambda: make(
            B, round_=1, step=Step.PREVOTE, votes=prevotes(1, IV, A) + prevotes(1, None, B)
        ),
        VoteReceived(vote(PV, 1, IW, C)),
        [timeout(TimeoutKind.PREVOTE, 1)],
        st(1, Step.PREVOTE),
    ),
    (
        "L36_L41_polka_for_the_proposal_in_prevote_locks_and_precommits",
        lambda: make(
            B,
            step=Step.PREVOTE,
            proposals=(prop(0),),
            votes=prevotes(0, IV, A, B),
            validity={IV: True},
        ),
        VoteReceived(vote(PV, 0, IV, C)),
        [BroadcastVote(vote(PC, 0, IV, B))],
        st(0, Step.PRECOMMIT, locked=(V, 0), valid=(V, 0)),
    ),
    (
        "L36_L42_polka_in_precommit_step_sets_valid_value_only",
        lambda: make(
            B,
            step=Step.PRECOMMIT,
            proposals=(prop(0),),
            votes=prevotes(0, IV, A, B),
            validity={IV: True},
        ),
        VoteReceived(vote(PV, 0, IV, C)),
        [],
        st(0, Step.PRECOMMIT, valid=(V, 0)),
    ),
    (
        "L36_polka_for_an_invalid_value_does_nothing",
        lambda: make(
            B,
            step=Step.PREVOTE,
            proposals=(prop(0),),
            votes=prevotes(0, IV, A, B),
            validity={IV: False},
        ),
        VoteReceived(vote(PV, 0, IV, C)),
        [timeout(TimeoutKind.PREVOTE, 0)],  # L34 only
        st(0, Step.PREVOTE),
    ),
    (
        "L44_L46_2f1_nil_prevotes_precommit_nil",
        lambda: make(B, step=Step.PREVOTE, votes=prevotes(0, None, A, B)),
        VoteReceived(vote(PV, 0, None, D)),
        [BroadcastVote(vote(PC, 0, None, B))],
        st(0, Step.PRECOMMIT),
    ),
    (
        "L47_L48_2f1_precommits_of_any_values_schedule_timeout_precommit",
        lambda: make(B, step=Step.PRECOMMIT, votes=precommits(0, None, A, B)),
        VoteReceived(vote(PC, 0, IV, C)),
        [timeout(TimeoutKind.PRECOMMIT, 0)],
        st(0, Step.PRECOMMIT),
    ),
    (
        "L49_L51_proposal_and_2f1_precommits_decide_in_any_round",
        lambda: make(
            B, round_=2, proposals=(prop(1),), votes=precommits(1, IV, A, C), validity={IV: True}
        ),
        VoteReceived(vote(PC, 1, IV, D)),
        [Decide(0, 1, V, precommits(1, IV, A, C, D))],
        st(2, Step.PROPOSE, decided=V),
    ),
    (
        "L49_the_proposal_arriving_last_decides",
        lambda: make(C, votes=precommits(0, IV, A, B, D), validity={IV: True}),
        ProposalReceived(prop(0)),
        [Decide(0, 0, V, precommits(0, IV, A, B, D))],
        st(0, Step.PROPOSE, decided=V),
    ),
    (
        "L50_2f1_precommits_for_an_invalid_value_decide_nothing",
        lambda: make(
            B,
            step=Step.PRECOMMIT,
            proposals=(prop(0),),
            votes=precommits(0, IV, A, C),
            validity={IV: False},
        ),
        VoteReceived(vote(PC, 0, IV, D)),
        [timeout(TimeoutKind.PRECOMMIT, 0)],
        st(0, Step.PRECOMMIT),
    ),
    (
        "L55_L56_f1_messages_of_a_higher_round_start_it",
        lambda: make(A, step=Step.PREVOTE, proposals=(prop(3, W),)),  # D proposed in round 3
        VoteReceived(vote(PV, 3, None, C)),
        [timeout(TimeoutKind.PROPOSE, 3)],
        st(3, Step.PROPOSE),
    ),
    (
        "L55_one_validator_sending_proposal_and_votes_counts_once",
        lambda: make(A, step=Step.PREVOTE, proposals=(prop(3, W),), votes=prevotes(3, None, D)),
        VoteReceived(vote(PC, 3, None, D)),
        [],
        st(0, Step.PREVOTE),
    ),
    (
        "L57_L60_timeout_propose_in_propose_prevotes_nil",
        lambda: make(B, round_=1),
        TimeoutFired(TimeoutKind.PROPOSE, 0, 1),
        [BroadcastVote(vote(PV, 1, None, B))],
        st(1, Step.PREVOTE),
    ),
    (
        "L58_timeout_propose_of_an_old_round_does_nothing",
        lambda: make(B, round_=1),
        TimeoutFired(TimeoutKind.PROPOSE, 0, 0),
        [],
        st(1, Step.PROPOSE),
    ),
    (
        "L58_timeout_propose_after_prevoting_does_nothing",
        lambda: make(B, step=Step.PREVOTE),
        TimeoutFired(TimeoutKind.PROPOSE, 0, 0),
        [],
        st(0, Step.PREVOTE),
    ),
    (
        "L61_L64_timeout_prevote_in_prevote_precommits_nil",
        lambda: make(B, step=Step.PREVOTE),
        TimeoutFired(TimeoutKind.PREVOTE, 0, 0),
        [BroadcastVote(vote(PC, 0, None, B))],
        st(0, Step.PRECOMMIT),
    ),
    (
        "L62_timeout_prevote_in_precommit_does_nothing",
        lambda: make(B, step=Step.PRECOMMIT),
        TimeoutFired(TimeoutKind.PREVOTE, 0, 0),
        [],
        st(0, Step.PRECOMMIT),
    ),
    (
        "L65_L67_timeout_precommit_starts_the_next_round",
        lambda: make(A, round_=1, step=Step.PRECOMMIT),
        TimeoutFired(TimeoutKind.PRECOMMIT, 0, 1),
        [timeout(TimeoutKind.PROPOSE, 2)],
        st(2, Step.PROPOSE),
    ),
    (
        "L66_timeout_precommit_of_another_height_does_nothing",
        lambda: make(A, step=Step.PRECOMMIT),
        TimeoutFired(TimeoutKind.PRECOMMIT, 1, 0),
        [],
        st(0, Step.PRECOMMIT),
    ),
]


@pytest.mark.parametrize(
    ("core", "inp", "outputs", "state"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_algorithm_1_line(core, inp, outputs, state):
    c = core()
    assert c.handle(inp, 10.0) == outputs
    assert c.state() == state


def test_table_names_every_acting_line():
    named = {int(part[1:]) for c in CASES for part in c[0].split("_") if part[:1] == "L"}
    acting = {
        11,
        15,
        18,
        19,
        21,
        22,
        24,
        26,
        28,
        30,
        32,
        34,
        36,
        41,
        42,
        44,
        47,
        49,
        50,
        51,
        55,
        57,
        61,
        65,
    }
    assert acting <= named


# ----------------------------------------------------------------------------- core behaviour


def test_L18_the_applications_value_is_proposed_with_nil_valid_round():
    core = ConsensusCore(A, CFG)
    core.handle(StartHeight(0, VALS), 0.0)
    out = core.handle(ProposeValue(0, 0, V), 1.0)
    assert out == [BroadcastProposal(Proposal(0, 0, V, NIL_ROUND, A))]
    assert core.handle(ProposeValue(0, 0, W), 1.0) == []  # asked once, answered once


def test_L18_a_value_for_a_round_not_asked_is_ignored():
    core = ConsensusCore(A, CFG)
    core.handle(StartHeight(0, VALS), 0.0)
    assert core.handle(ProposeValue(0, 1, V), 1.0) == []


def test_own_proposal_is_valid_without_asking_the_application():
    core = ConsensusCore(A, CFG)
    core.handle(StartHeight(0, VALS), 0.0)
    (bp,) = core.handle(ProposeValue(0, 0, V), 1.0)
    assert core.handle(ProposalReceived(bp.proposal), 1.0) == [BroadcastVote(vote(PV, 0, IV, A))]


def test_own_vote_counts_only_when_looped_back():
    core = make(B, proposals=(prop(0),), validity={IV: True})
    core.handle(VoteReceived(vote(PV, 0, IV, A)), 0.0)
    core.handle(VoteReceived(vote(PV, 0, IV, C)), 0.0)
    # prevoting (L22) emits B's prevote; the quorum needs it back as an input
    assert core.state().step == Step.PREVOTE
    assert core.keeper.power_for(0, PV, IV) == 2
    assert core.handle(VoteReceived(vote(PV, 0, IV, B)), 0.0) == [BroadcastVote(vote(PC, 0, IV, B))]


def test_timeouts_grow_linearly_with_the_round():
    assert CFG.timeout(TimeoutKind.PROPOSE, 0) == 3.0
    assert CFG.timeout(TimeoutKind.PROPOSE, 4) == 5.0
    assert CFG.timeout(TimeoutKind.PREVOTE, 4) == 2.0
    assert CFG.timeout(TimeoutKind.PRECOMMIT, 8) == 3.0


def test_proposer_rotation_is_round_robin_by_address_with_equal_power():
    assert proposer_cycle(tuple(reversed(VALS))) == (A, B, C, D)
    core = make(A)
    assert [core.proposer(h, r) for h, r in [(0, 0), (0, 1), (1, 0), (2, 3)]] == [A, B, B, B]


def test_proposer_rotation_is_weighted_by_power_and_spread():
    cycle = proposer_cycle((Validator(A, 3), Validator(B, 1), Validator(C, 2)))
    assert sorted(cycle) == [A, A, A, B, C, C]
    assert all(cycle[i] != cycle[i + 1] or cycle[i] == A for i in range(len(cycle) - 1))
    assert proposer_cycle((Validator(A, 10), Validator(B, 10))) == (A, B)  # gcd reduced


def test_second_proposal_of_a_round_is_kept_only_with_a_quorum_for_it():
    core = make(C, step=Step.PREVOTE, proposals=(prop(0, V),), validity={IV: True, IW: True})
    # the second value is the proposer's equivocation: reported, not kept
    assert core.handle(ProposalReceived(prop(0, W)), 0.0) == [
        ProposalEquivocation(prop(0, V), prop(0, W))]
    assert IW not in core._proposals[0]
    for who in (A, B, D):
        core.handle(VoteReceived(vote(PC, 0, IW, who)), 0.0)
    out = core.handle(ProposalReceived(prop(0, W)), 0.0)
    assert out == [Decide(0, 0, W, precommits(0, IW, A, B, D))]


def test_double_proposal_is_reported_once_per_round_as_evidence():
    core = make(C, step=Step.PREVOTE, proposals=(prop(0, V),), validity={IV: True})
    out = core.handle(ProposalReceived(prop(0, W)), 0.0)
    assert out == [ProposalEquivocation(prop(0, V), prop(0, W))]
    assert core.handle(ProposalReceived(prop(0, b"X-value")), 0.0) == []  # once per round
    assert core.handle(ProposalReceived(prop(0, V)), 0.0) == []  # the same value again: none


def test_excluded_validators_are_skipped_by_the_proposer_rotation():
    vals = tuple(Validator(x) for x in (A, B, C, D))
    core = ConsensusCore(A)
    core.handle(StartHeight(1, vals, frozenset({B})), 0.0)
    proposers = [core.proposer(1, r) for r in range(6)]
    assert B not in proposers and set(proposers) == {A, C, D}
    assert core.keeper is not None and core.keeper.total_power == 4  # B still votes
    everyone = ConsensusCore(A)
    everyone.handle(StartHeight(1, vals, frozenset({A, B, C, D})), 0.0)
    assert {everyone.proposer(1, r) for r in range(4)} == {A, B, C, D}  # never nobody


def test_proposal_with_pol_round_not_below_its_round_is_dropped():
    core = make(B, round_=2, validity={IV: True})
    assert core.handle(ProposalReceived(prop(2, V, vr=2)), 0.0) == []
    assert 2 not in core._proposals


def test_equivocation_is_reported_as_evidence():
    core = make(B, step=Step.PREVOTE)
    first, second = vote(PV, 0, IV, D), vote(PV, 0, IW, D)
    core.handle(VoteReceived(first), 0.0)
    assert core.handle(VoteReceived(second), 0.0) == [Equivocation(first, second)]


def test_next_height_messages_are_kept_and_replayed_by_start_height():
    core = make(B, proposals=(prop(0),), votes=precommits(0, IV, A, C, D), validity={IV: True})
    core._apply_rule([])  # decide height 0
    assert core.decision is not None
    p1 = Proposal(1, 0, W, NIL_ROUND, B)  # B proposes (1, 0)
    assert core.handle(ProposalReceived(p1), 0.0) == []
    assert core.handle(VoteReceived(vote(PV, 0, IW, A, h=1)), 0.0) == []
    out = core.handle(StartHeight(1, VALS), 0.0)
    assert ValidateValue(1, 0, W) in out
    assert core.keeper.power_for(0, PV, IW) == 1
    assert core.state() == st(0, Step.PROPOSE, height=1)


def test_messages_two_heights_ahead_are_dropped():
    core = make(B)
    core.handle(VoteReceived(vote(PV, 0, IW, A, h=2)), 0.0)
    assert core._next == []
    core.handle(VoteReceived(vote(PV, 0, IW, A, h=1)), 0.0)
    assert core._next == [VoteReceived(vote(PV, 0, IW, A, h=1))]


def test_next_height_buffer_is_bounded_per_validator():
    core = make(B)
    limit = CFG.next_height_buffer
    for r in range(limit + 5):
        core.handle(VoteReceived(vote(PV, r, IW, A, h=1)), 0.0)
    core.handle(VoteReceived(vote(PV, 0, IW, E, h=1)), 0.0)
    assert len(core._next) == limit


def test_messages_of_a_decided_height_are_ignored():
    core = make(B, proposals=(prop(0),), votes=precommits(0, IV, A, C, D), validity={IV: True})
    core.handle(VoteReceived(vote(PC, 0, IV, B)), 0.0)
    assert core.decision is not None
    assert core.handle(TimeoutFired(TimeoutKind.PRECOMMIT, 0, 0), 0.0) == []
    assert core.handle(VoteReceived(vote(PV, 5, None, A)), 0.0) == []


def test_start_height_must_increase():
    core = make(B)
    with pytest.raises(LocalProtocolError):
        core.handle(StartHeight(0, VALS), 0.0)


def test_inputs_before_start_height_are_ignored():
    core = ConsensusCore(A, CFG)
    assert core.handle(VoteReceived(vote(PV, 0, IV, B)), 0.0) == []
    assert core.state().height is None


def test_a_correct_core_never_votes_twice_in_a_round():
    core = make(B, proposals=(prop(0),), validity={IV: True})
    out = core.handle(ValueValidated(0, 0, IV, True), 0.0)
    out += core.handle(TimeoutFired(TimeoutKind.PROPOSE, 0, 0), 0.0)
    out += core.handle(ProposalReceived(prop(0)), 0.0)
    assert [o for o in out if isinstance(o, BroadcastVote)] == [BroadcastVote(vote(PV, 0, IV, B))]
    assert core.state().step == Step.PREVOTE


# ----------------------------------------------------------------------------- vote keeper


def keeper(*powers: int) -> VoteKeeper:
    return VoteKeeper(0, tuple(Validator(a, p) for a, p in zip((A, B, C, D), powers)))


def test_keeper_quorum_is_more_than_two_thirds_of_power():
    k = keeper(1, 1, 1, 1)
    k.add_vote(vote(PV, 0, IV, A))
    k.add_vote(vote(PV, 0, IV, B))
    assert not k.has_quorum(0, PV, IV)
    k.add_vote(vote(PV, 0, IV, C))
    assert k.has_quorum(0, PV, IV)
    assert k.quorum_value(0, PV) == (True, IV)


def test_keeper_counts_by_power_not_by_heads():
    k = keeper(5, 1, 1)  # total 7: 2f+1 means power >= 5
    k.add_vote(vote(PC, 0, IV, A))
    assert k.has_quorum(0, PC, IV)
    k2 = keeper(4, 1, 1, 1)  # total 7, 4 is not > 14/3
    k2.add_vote(vote(PC, 0, IV, A))
    assert not k2.has_quorum(0, PC, IV)
    assert k2.is_one_third(4) and not k2.is_one_third(2)


def test_keeper_quorum_any_counts_different_values():
    k = keeper(1, 1, 1, 1)
    for who, vid in ((A, IV), (B, IW), (C, None)):
        k.add_vote(vote(PV, 0, vid, who))
    assert k.has_quorum_any(0, PV)
    assert k.quorum_value(0, PV) == (False, None)
    assert not k.has_quorum_any(0, PC)


def test_keeper_refuses_duplicates_and_counts_them_once():
    k = keeper(1, 1, 1, 1)
    assert k.add_vote(vote(PV, 0, IV, A)) == (AddVoteResult.ADDED, None)
    assert k.add_vote(vote(PV, 0, IV, A)) == (AddVoteResult.DUPLICATE, None)
    assert k.power_for(0, PV, IV) == 1


def test_keeper_refuses_non_validators_and_other_heights():
    k = keeper(1, 1, 1, 1)
    assert k.add_vote(vote(PV, 0, IV, E))[0] == AddVoteResult.NOT_VALIDATOR
    assert k.add_vote(vote(PV, 0, IV, A, h=1))[0] == AddVoteResult.NOT_VALIDATOR
    assert k.power_for(0, PV, IV) == 0
    assert not k.add_proposal(0, E)


def test_keeper_turns_conflicting_votes_into_evidence_once():
    k = keeper(1, 1, 1, 1)
    first, second, third = vote(PV, 0, IV, A), vote(PV, 0, IW, A), vote(PV, 0, None, A)
    k.add_vote(first)
    assert k.add_vote(second) == (AddVoteResult.CONFLICT, Equivocation(first, second))
    assert k.add_vote(third) == (AddVoteResult.CONFLICT, None)
    assert k.power_for(0, PV, IV) == 1
    assert k.power_for(0, PV, IW) == 0  # not wanted: no proposal holds W
    assert k.power_for(0, PV, None) == 1  # nil is always wanted
    k.add_vote(vote(PV, 0, IV, B))
    assert not k.has_quorum_any(0, PV)  # A counts once for "any"


def test_keeper_counts_a_conflicting_vote_for_a_wanted_value():
    k = keeper(1, 1, 1, 1)
    k.want(IW)
    k.add_vote(vote(PV, 0, IV, D))
    k.add_vote(vote(PV, 0, IW, D))
    k.add_vote(vote(PV, 0, IW, B))
    k.add_vote(vote(PV, 0, IW, C))
    assert k.has_quorum(0, PV, IW)
    assert [v.validator for v in k.votes_for(0, PV, IW)] == [B, C, D]


def test_keeper_f1_senders_of_a_round_counted_once_each():
    k = keeper(1, 1, 1, 1)
    k.add_proposal(5, D)
    k.add_vote(vote(PV, 5, None, D))
    k.add_vote(vote(PC, 5, None, D))
    assert k.skip_round(0) is None
    k.add_vote(vote(PV, 5, None, C))
    assert k.skip_round(0) == 5
    assert k.skip_round(5) is None


def test_keeper_bounds_future_rounds_per_validator():
    k = keeper(1, 1, 1, 1)
    for r in range(1, MAX_FUTURE_ROUNDS_PER_VALIDATOR + 1):
        assert k.add_vote(vote(PV, r, None, A))[0] == AddVoteResult.ADDED
    far = vote(PV, 99, None, A)
    assert k.add_vote(far)[0] == AddVoteResult.ROUND_REFUSED
    assert k.add_vote(vote(PV, 99, None, B))[0] == AddVoteResult.ADDED  # B has its own budget
    k.set_round(2)
    assert k.add_vote(far)[0] == AddVoteResult.ADDED
    assert k.add_vote(vote(PV, -1, None, B))[0] == AddVoteResult.ROUND_REFUSED


def test_the_core_says_which_messages_it_would_ignore_whatever_their_signature():
    core = make(B)
    for r in range(1, MAX_FUTURE_ROUNDS_PER_VALIDATOR + 1):  # A's two future rounds
        assert not core.ignores(vote(PV, r, None, A))
        core.handle(VoteReceived(vote(PV, r, None, A)), 0.0)
    useless = [
        vote(PV, 50, None, A),  # a third future round of A: refused by the keeper
        vote(PV, 1, None, A),  # held already
        vote(PV, 0, None, E),  # no validator
        vote(PV, 0, None, A, h=5),  # far height
    ]
    for message in useless:
        assert core.ignores(message)
        before = (core.state(), core._keeper.powers(1, PV), list(core._next))
        assert core.handle(VoteReceived(message), 0.0) == []
        assert (core.state(), core._keeper.powers(1, PV), list(core._next)) == before
    assert not core.ignores(vote(PV, 1, IV, A))  # a first conflict: evidence
    core.handle(VoteReceived(vote(PV, 1, IV, A)), 0.0)
    assert core.ignores(vote(PV, 1, b"unwanted value", A))  # A accused: adds nothing
    assert core.ignores(vote(PV, 1, IV, A))
    assert not core.ignores(vote(PV, 50, None, C))  # C's own budget
    assert not core.ignores(vote(PV, 0, IW, A, h=1))  # next height: buffered
    for r in range(CFG.next_height_buffer):
        core.handle(VoteReceived(vote(PV, r, IW, A, h=1)), 0.0)
    assert core.ignores(vote(PV, 99, IW, A, h=1))  # A's buffer is full
    wrong_proposer = Proposal(0, 1, V, NIL_ROUND, A)
    assert core.ignores(wrong_proposer)


@pytest.mark.parametrize("seed", range(5))
def test_a_message_the_core_says_it_ignores_changes_nothing_when_handled(seed):
    rng = random.Random(seed)
    core = make(B)

    def snapshot():
        k = core._keeper
        tallies = {(r, t): k.powers(r, t) for r in k.rounds() for t in (PV, PC)}
        return (core.state(), tallies, len(core._next), dict(core._next_count),
                {r: set(v) for r, v in core._wanted.items()}, set(k._wanted))

    ignored = 0
    for _ in range(600):
        who = rng.choice((A, B, C, D, E))
        h = rng.choice((0, 0, 0, 1, 3))
        r = max(0, core.round + rng.choice((-3, -1, 0, 0, 1, 2, 3, 10)))
        if rng.random() < 0.2:
            message = Proposal(h, r, rng.choice((V, W)), rng.choice((NIL_ROUND, 0)),
                               rng.choice((PROPOSER[(h + r) % 4], who)))
            inp = ProposalReceived(message)
        else:
            message = vote(rng.choice((PV, PC)), r, rng.choice((IV, IW, None)), who, h=h)
            inp = VoteReceived(message)
        if core.ignores(message):
            ignored += 1
            before = snapshot()
            assert core.handle(inp, 0.0) == []
            assert snapshot() == before
        else:
            core.handle(inp, 0.0)
        if rng.random() < 0.02:
            core.handle(TimeoutFired(TimeoutKind.PRECOMMIT, 0, core.round), 0.0)
    assert ignored > 100


def test_proposals_of_rounds_the_keeper_refuses_are_ignored_and_leave_nothing_behind():
    core = make(A)
    for r in (5, 9):  # two future rounds of B (proposer of rounds 1, 5, 9, ...)
        core.handle(ProposalReceived(prop(r)), 0.0)
    wanted = {r: set(v) for r, v in core._wanted.items()}
    for r in range(13, 13 + 4 * 50, 4):  # B's later rounds: refused, never wanted
        late = prop(r, value=b"value %d" % r)
        assert core.ignores(late)
        assert core.handle(ProposalReceived(late), 0.0) == []
    assert core._wanted == wanted and len(core._keeper._wanted) == 2


def test_keeper_rejects_bad_validator_sets():
    with pytest.raises(ValueError):
        VoteKeeper(0, ())
    with pytest.raises(ValueError):
        VoteKeeper(0, (Validator(A), Validator(A)))
    with pytest.raises(ValueError):
        VoteKeeper(0, (Validator(A, 0),))


def test_refused_second_proposal_still_makes_conflicting_votes_for_it_count():
    # D equivocated: C counted D's precommit for V first; the committee committed W
    core = make(
        C,
        round_=1,
        proposals=(prop(0, V),),
        votes=precommits(0, IV, D),
        validity={IV: True, IW: True},
    )
    out = core.handle(ProposalReceived(prop(0, W)), 0.0)  # no quorum for W yet: not kept
    assert out == [ProposalEquivocation(prop(0, V), prop(0, W))]
    for who in (A, B, D):
        core.handle(VoteReceived(vote(PC, 0, IW, who)), 0.0)
    assert core.keeper.power_for(0, PC, IW) == 3  # D's conflicting vote counts: W is wanted
    out = core.handle(ProposalReceived(prop(0, W)), 0.0)  # sent again
    assert out == [Decide(0, 0, W, precommits(0, IW, A, B, D))]


def test_votes_carry_the_configured_value_id_the_block_id_for_registry_blocks():
    """With ``ConsensusConfig.value_id`` = the registry's block-ID function, a validator
    prevotes for the block ID (a hash of the header only), which is what a commit must cover
    for a node that checks it from the header alone."""
    import dataclasses

    from ps_p2p.consensus.block import BlockLimits, block_id, consensus_value_id, encode_block, make_block
    from ps_p2p.consensus.types import BroadcastVote, ValidateValue
    from ps_p2p.keys import NodeKeys

    limits = BlockLimits()
    keys = [bytes([i]) * 38 for i in range(4)]
    block = make_block(chain_id="c", height=1, time_ms=1, prev_block_id=bytes(32),
                       app_hash=bytes(32), proposer=NodeKeys.generate().identity.peer_id)
    value = encode_block(block)
    config = dataclasses.replace(CFG, value_id=consensus_value_id(limits))
    validators = tuple(Validator(k) for k in keys)
    from ps_p2p.consensus.core import proposer_cycle

    cycle = proposer_cycle(validators)
    proposer = cycle[1 % len(cycle)]  # proposer(h=1, r=0)
    core = ConsensusCore(next(k for k in keys if k != proposer), config)
    core.handle(StartHeight(1, validators), 0.0)
    out = core.handle(ProposalReceived(Proposal(1, 0, value, NIL_ROUND, proposer)), 0.1)
    (ask,) = [o for o in out if isinstance(o, ValidateValue)]
    assert consensus_value_id(limits)(ask.value) == block_id(block.header)
    out = core.handle(ValueValidated(1, 0, block_id(block.header), True), 0.2)
    (prevote,) = [o.vote for o in out if isinstance(o, BroadcastVote)]
    assert prevote.type == PV and prevote.value_id == block_id(block.header) != value_id(value)
    # an undecodable value still gets an ID (and never one of a real block)
    junk_id = consensus_value_id(limits)(b"\xff" * 10)
    assert len(junk_id) == 32 and junk_id != value_id(b"\xff" * 10)


def test_L38_a_lock_restored_after_a_restart_makes_the_validator_prevote_nil_for_another_value():
    from ps_p2p.consensus.types import BroadcastVote, RestoreLock

    core = make(B, round_=2)
    core.handle(RestoreLock(0, 1, W), 0.0)
    state = core.state()
    assert (state.locked_value, state.locked_round) == (W, 1)
    assert (state.valid_value, state.valid_round) == (W, 1)
    core.handle(ProposalReceived(prop(2, V)), 0.1)
    out = core.handle(ValueValidated(0, 2, IV, True), 0.2)
    votes = [o.vote for o in out if isinstance(o, BroadcastVote)]
    assert votes == [vote(PV, 2, None, B)]  # L23: locked on W, so nil for V
    # an older lock never replaces a newer one
    core.handle(RestoreLock(0, 0, V), 0.3)
    assert core.state().locked_value == W


# ----------------------------------------------------------------------------- issue 17


def test_L22_a_fresh_proposal_late_on_arrival_gets_a_nil_prevote():
    core = make(B)
    out = core.handle(ProposalReceived(prop(0), timely=False), 0.0)
    assert out == [ValidateValue(0, 0, V)]
    out = core.handle(ValueValidated(0, 0, IV, True), 0.0)
    assert out == [BroadcastVote(vote(PV, 0, None, B))]  # L26: not timely
    assert core.state().step == Step.PREVOTE


def test_L28_a_value_late_at_round_0_is_prevoted_when_re_proposed_with_its_pol():
    """Timeliness is read by L22 only: the value stays valid(v) for L28 at round r > 0."""
    core = make(B)
    core.handle(ProposalReceived(prop(0), timely=False), 0.0)
    core.handle(ValueValidated(0, 0, IV, True), 0.0)  # L26: nil prevote in round 0
    core.handle(TimeoutFired(TimeoutKind.PROPOSE, 0, 0), 0.0)
    for v in precommits(0, None, A, C, D):  # round 0 ends
        core.handle(VoteReceived(v), 0.0)
    core.handle(TimeoutFired(TimeoutKind.PRECOMMIT, 0, 0), 0.0)
    assert core.state().round == 1 and core.state().step == Step.PROPOSE
    out = core.handle(ProposalReceived(prop(1, V, vr=0)), 1.0)
    assert out == []  # valid(v) is known; the POL is not held yet
    for v in prevotes(0, IV, A, C, D):  # the POL certificate of round 0 (L28)
        out += core.handle(VoteReceived(v), 1.0)
    assert out == [BroadcastVote(vote(PV, 1, IV, B))]  # L30


def test_L28_a_restarted_validator_prevotes_a_re_proposal_once_its_pol_certificate_arrives():
    """A validator that never saw round 0 (it was down) gets the re-proposal of round 2 and
    the 2f+1 prevotes of its valid round 0 (what the proposer sends with it): L28 fires."""
    core = make(B, round_=2)
    out = core.handle(ProposalReceived(prop(2, V, vr=0)), 0.0)
    assert out == [ValidateValue(0, 2, V)]
    out = core.handle(ValueValidated(0, 2, IV, True), 0.0)
    assert out == []  # L28 waits for the POL
    for v in prevotes(0, IV, A, C, D):
        out += core.handle(VoteReceived(v), 0.0)
    assert out == [BroadcastVote(vote(PV, 2, IV, B))]
    assert core.proposals(2) == (prop(2, V, vr=0),)
    assert core.proposal_for(2, IV) == prop(2, V, vr=0) and core.proposal_for(1, IV) is None
# ----------------------------------------------------------------------------- issue 17: tests
# that kill mutants the tests above let through (scripts/consensus_mutants.py)


def test_keeper_quorum_is_strictly_more_than_two_thirds_with_unequal_powers():
    # total 6: power 4 is exactly 2/3 (a ">= 2/3" reading would count it), 5 is more
    k = keeper(2, 2, 1, 1)
    for who in (A, B):
        k.add_vote(vote(PC, 0, IV, who))
        k.add_vote(vote(PV, 0, None, who))
    assert k.power_for(0, PC, IV) == 4
    assert not k.has_quorum(0, PC, IV) and not k.has_quorum_any(0, PC)
    assert k.quorum_value(0, PC) == (False, None) and k.rounds_with_quorum(PC) == []
    assert not k.has_quorum(0, PV, None)
    k.add_vote(vote(PC, 0, IV, C))
    assert k.has_quorum(0, PC, IV) and k.quorum_value(0, PC) == (True, IV)
    assert k.has_quorum_any(0, PC)  # L47 counts power too: 5 of 6, though 3 of 4 heads
    # f+1 likewise: 2 of 6 is exactly 1/3, 3 is more
    assert not k.is_one_third(2) and k.is_one_third(3)


def test_L61_timeout_prevote_precommits_nil_even_while_holding_the_proposal():
    core = make(B, step=Step.PREVOTE, proposals=(prop(0, V),), votes=prevotes(0, IV, A, B),
                validity={IV: True})
    out = core.handle(TimeoutFired(TimeoutKind.PREVOTE, 0, 0), 1.0)
    assert out == [BroadcastVote(vote(PC, 0, None, B))]  # L63: nil, never the proposal
    assert core.state() == st(0, Step.PRECOMMIT)


def test_L49_f_plus_1_precommits_for_the_proposal_do_not_decide():
    core = make(B, step=Step.PRECOMMIT, proposals=(prop(0, V),),
                votes=precommits(0, IV, A, C), validity={IV: True})
    out = core.handle(VoteReceived(vote(PC, 0, None, D)), 1.0)
    assert not [o for o in out if isinstance(o, Decide)]  # f+1 = 2 of 4: no decision
    assert core.state().decided is None
    out = core.handle(VoteReceived(vote(PC, 0, IV, B)), 1.1)
    assert [o.value for o in out if isinstance(o, Decide)] == [V]  # 2f+1 = 3


def test_L58_L62_L66_a_timeout_of_an_earlier_round_does_nothing_in_a_later_one():
    for kind, step in ((TimeoutKind.PROPOSE, Step.PROPOSE), (TimeoutKind.PREVOTE, Step.PREVOTE),
                       (TimeoutKind.PRECOMMIT, Step.PRECOMMIT)):
        core = make(C, round_=2, step=step)
        assert core.handle(TimeoutFired(kind, 0, 1), 1.0) == []
        assert core.state() == st(2, step)
