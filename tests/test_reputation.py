"""The reputation rule (PlanetServe sec. 3.4) against tables computed by hand, the untrusted
threshold, subjects per organization, and the bounded book."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps_p2p.errors import InvalidScoreError, LocalProtocolError, ReputationBookFullError
from ps_p2p.verification.reputation import (
    ReputationBook,
    ReputationParams,
    ReputationState,
    check_score,
    is_trusted,
    on_probation,
    subject_of,
    update,
)

PARAMS = ReputationParams()  # alpha 0.4, beta 0.6, W 5, tau 0.5, gamma 1/5, untrusted < 0.4
PAPER = ReputationParams(probation=0)  # the paper's rule alone, no probation


def run(credibilities, params=PARAMS, start=None):
    state = start or ReputationState.fresh(params)
    out = []
    for c in credibilities:
        state = update(state, c, params)
        out.append(state)
    return out


# Each row: C(T), abnormal values in the window after C(T) enters, R(T), trusted. Computed by
# hand from R(T) = 0.4 R(T-1) + w C(T), w = 0.6 or, when c/5 > 1/5, 6 / (5 + 5c + 2).

# A node that answers well: no abnormal value, w = 0.6 throughout. R(0) = 0.5.
HONEST = [
    (0.8, 0, 0.68, True),        # 0.4*0.5    + 0.6*0.8
    (0.9, 0, 0.812, True),       # 0.4*0.68   + 0.6*0.9
    (0.7, 0, 0.7448, True),      # 0.4*0.812  + 0.6*0.7
    (0.8, 0, 0.77792, True),     # 0.4*0.7448 + 0.6*0.8
]

# Abnormal values (< 0.5) enter and leave the window of 5. R(0) = 0.5.
WINDOW = [
    (0.8, 0, 0.68, True),                   # window .8
    (0.3, 1, 0.452, True),                  # .8 .3: c/W = 1/5, not above 1/5: w = 0.6
    (0.9, 1, 0.7208, True),                 # .8 .3 .9
    (0.2, 2, 0.3589082353, False),          # .8 .3 .9 .2: w = 6/17; 0.28832 + 1.2/17
    (0.1, 3, 0.1708360214, False),          # .8 .3 .9 .2 .1: w = 6/22; 0.14356329 + 0.3/11
    (0.9, 3, 0.3137889540, False),          # .3 .9 .2 .1 .9 (.8 left): 0.06833441 + 2.7/11
    (0.9, 2, 0.4431626404, True),           # .9 .2 .1 .9 .9 (.3 left): w = 6/17 again
    (0.9, 2, 0.4949121150, True),           # .2 .1 .9 .9 .9: 0.17726506 + 5.4/17
    (0.9, 1, 0.7379648460, True),           # .1 .9 .9 .9 .9: back to w = 0.6
]

# A steady cheater with C = 0.3, every value abnormal. R(0) = 0.5.
CHEATER = [
    (0.3, 1, 0.38, False),                  # w = 0.6: 0.2 + 0.18, untrusted after one epoch
    (0.3, 2, 0.2578823529, False),          # w = 6/17: 0.152 + 1.8/17
    (0.3, 3, 0.1849711230, False),          # w = 6/22: 0.10315294 + 0.9/11
    (0.3, 4, 0.1406551159, False),          # w = 6/27: 0.07398845 + 0.6/9
    (0.3, 5, 0.1125120464, False),          # w = 6/32: 0.05626205 + 0.05625
    (0.3, 5, 0.1012548185, False),          # 0.04500482 + 0.05625 (limit 0.05625/0.6 = 0.09375)
]


@pytest.mark.parametrize("table", [HONEST, WINDOW, CHEATER], ids=["honest", "window", "cheater"])
def test_reputation_follows_the_hand_computed_table(table):
    states = run([row[0] for row in table], PAPER)
    for T, ((c, abnormal, r, trusted), state) in enumerate(zip(table, states), start=1):
        assert sum(v < PARAMS.tau for v in state.window) == abnormal, f"epoch {T}"
        assert state.reputation == pytest.approx(r, abs=1e-9), f"epoch {T}"
        assert is_trusted(state, PAPER) is trusted, f"epoch {T}"
        assert state.epochs == T
        assert len(state.window) == min(T, PARAMS.window)


# ------------------------------------------------------------------------------- probation

CAP = 0.399999  # the largest micro unit below the threshold 0.4

# "Honest only while untrusted": cheap (C = 0.1) whenever trusted, honest (C = 0.9) otherwise.
# Each row: C(T), strikes, clean, R(T), trusted. R(0) = 0.5, probation 8.
SELECTIVE = [
    (0.1, 1, 0, 0.26, False),          # 0.2 + 0.06: below 0.4 from trusted, a conviction
    (0.9, 1, 1, CAP, False),           # 0.104 + 0.54 = 0.644, capped: 1 of 8 clean epochs
    (0.9, 1, 2, CAP, False),           # 0.4*CAP + 0.54 = 0.6999996, capped
    (0.9, 1, 3, CAP, False),
    (0.9, 1, 4, CAP, False),
    (0.9, 1, 5, CAP, False),
    (0.9, 1, 6, CAP, False),
    (0.9, 1, 7, CAP, False),           # the paper's rule alone trusted it from epoch 2
    (0.9, 1, 8, 0.6999996, True),      # 8 clean epochs: 0.4*CAP + 0.6*0.9, trusted again
    (0.1, 2, 0, 0.33999984, False),    # 0.27999984 + 0.06, a second conviction
]


def test_probation_keeps_a_convicted_node_untrusted_for_its_clean_epochs():
    states = run([row[0] for row in SELECTIVE])
    for T, ((c, strikes, clean, r, trusted), state) in enumerate(zip(SELECTIVE, states), 1):
        assert (state.strikes, state.clean) == (strikes, clean), f"epoch {T}"
        assert state.reputation == pytest.approx(r, abs=1e-9), f"epoch {T}"
        assert is_trusted(state, PARAMS) is trusted, f"epoch {T}"
        assert on_probation(state, PARAMS) is (strikes > 0 and clean < 8 * 2 ** (strikes - 1))


def test_each_conviction_doubles_the_clean_record_a_node_needs():
    # the selective node over 100 epochs: trusted after 8, 16, 32 clean epochs, each time for
    # one epoch; the paper's rule alone trusts it again after every first clean epoch
    def trusted_epochs(params):
        state, out = ReputationState.fresh(params), []
        for epoch in range(1, 101):
            state = update(state, 0.1 if is_trusted(state, params) else 0.9, params)
            if is_trusted(state, params):
                out.append(epoch)
        return out

    assert trusted_epochs(PARAMS) == [9, 26, 59]  # 1 + 8, 10 + 16, 27 + 32; then 64 from 60
    assert len(trusted_epochs(PAPER)) >= 40


@pytest.mark.parametrize(("strikes", "required"), [
    (0, 0), (1, 8), (2, 16), (3, 32), (7, 512), (8, 1024), (9, 1024), (65535, 1024),
])
def test_required_clean_epochs_double_up_to_the_cap(strikes, required):
    assert PARAMS.required_clean(strikes) == required


def test_a_node_on_parole_is_convicted_by_one_abnormal_epoch():
    # strikes 1, probation served: C = 0.45 once would leave R at 0.28 + 0.27 = 0.55 under the
    # paper's rule (one abnormal value in five is tolerated), but not on parole
    served = ReputationState(0.7, (0.9,) * 5, 20, strikes=1, clean=9)
    after = update(served, 0.45, PARAMS)
    assert (after.strikes, after.clean, after.reputation) == (2, 0, CAP)
    assert not is_trusted(after, PARAMS)
    never = ReputationState(0.7, (0.9,) * 5, 20)  # the same record without a conviction
    assert is_trusted(update(never, 0.45, PARAMS), PARAMS)
    assert update(never, 0.45, PARAMS).strikes == 0


def test_an_abnormal_epoch_on_probation_restarts_the_count_without_a_new_strike():
    state = ReputationState(CAP, (0.9,) * 5, 20, strikes=1, clean=5)
    after = update(state, 0.2, PARAMS)
    assert (after.strikes, after.clean) == (1, 0)
    assert after.reputation < 0.4


def test_clean_epochs_while_trusted_forgive_one_strike_at_a_time():
    params = ReputationParams(probation=2, forgive=3)
    # strikes 2 (needs 4 clean); forgiven at 4 + 3 = 7 clean, then counted from 2 (needs 1):
    # the next strike goes at 2 + 3 = 5, i.e. 3 epochs later
    state = ReputationState(0.8, (0.9,) * 5, 10, strikes=2, clean=4)
    strikes = []
    for _ in range(7):
        state = update(state, 0.9, params)
        strikes.append((state.strikes, state.clean))
    assert strikes == [(2, 5), (2, 6), (1, 2), (1, 3), (1, 4), (0, 0), (0, 1)]
    never = ReputationParams(probation=2, forgive=0)
    state = ReputationState(0.8, (0.9,) * 5, 10, strikes=2, clean=4)
    for _ in range(50):
        state = update(state, 0.9, never)
    assert state.strikes == 2


def test_a_node_that_never_scores_below_tau_gets_no_strike():
    states = run([0.5, 1.0, 0.6, 0.5] * 10)
    assert all(s.strikes == 0 and is_trusted(s, PARAMS) for s in states)
    assert states[-1].clean == 40


def test_probation_zero_is_the_papers_rule():
    seq = [0.1] + [0.9] * 10 + [0.2, 0.9, 0.3] * 5
    for a, b in zip(run(seq, PAPER), run(seq, ReputationParams(probation=0, forgive=0))):
        assert a.reputation == b.reputation
    assert is_trusted(run(seq[:2], PAPER)[-1], PAPER)  # back after one clean epoch


@pytest.mark.parametrize("threshold", [0.4, 0.3333333, 0.0000004, 1.0])
def test_the_probation_cap_is_below_the_threshold_in_micro_units(threshold):
    params = ReputationParams(untrusted_below=threshold)
    assert round(params.probation_cap * 1_000_000) / 1_000_000 < threshold
    assert params.probation_cap >= threshold - 1e-6 - 1e-12


def test_a_lenient_gamma_of_one_never_punishes():
    # the paper's Level-1 (fig. 11a): c/W never exceeds 1, so R converges to C
    lenient = ReputationParams(gamma=1.0, probation=0)
    states = run([0.3] * 3, lenient)
    assert [s.reputation for s in states] == pytest.approx([0.38, 0.332, 0.3128])


@pytest.mark.parametrize(("abnormal", "weight"), [
    (0, 0.6), (1, 0.6), (2, 6 / 17), (3, 6 / 22), (4, 6 / 27), (5, 6 / 32),
])
def test_weight_on_credibility_by_abnormal_count(abnormal, weight):
    assert PARAMS.weight(abnormal) == pytest.approx(weight)


def test_a_third_gamma_punishes_from_two_abnormal_values():
    third = ReputationParams(gamma=1 / 3)
    assert not third.punished(1)  # 1/5 < 1/3
    assert third.punished(2)      # 2/5 > 1/3
    assert third.weight(2) == pytest.approx(6 / 13)


def test_one_fifth_is_not_above_one_fifth():
    assert not PARAMS.punished(1)


def test_untrusted_is_strictly_below_the_threshold():
    assert is_trusted(ReputationState(0.4), PARAMS)
    assert not is_trusted(ReputationState(0.39999), PARAMS)


@pytest.mark.parametrize("bad", [-0.01, 1.01, math.nan, math.inf, "0.5", None, True])
def test_a_score_outside_zero_one_is_refused(bad):
    with pytest.raises(InvalidScoreError):
        update(ReputationState.fresh(), bad)
    with pytest.raises(InvalidScoreError):
        check_score(bad)


@pytest.mark.parametrize("kwargs", [
    {"alpha": 0.5, "beta": 0.6}, {"alpha": 1.0, "beta": 0.0}, {"beta": 0.0}, {"window": 0},
    {"window": 65}, {"window": 2.5}, {"gamma": 0.0}, {"tau": 1.5}, {"untrusted_below": -0.1},
    {"initial": math.nan}, {"alpha": True}, {"probation": -1}, {"probation": 2.0},
    {"forgive": 10**7}, {"probation": 8, "max_probation": 4}, {"max_probation": True},
])
def test_params_out_of_range_are_refused(kwargs):
    with pytest.raises(LocalProtocolError):
        ReputationParams(**kwargs)


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=40),
       st.floats(min_value=0.0, max_value=1.0))
def test_reputation_stays_in_zero_one(credibilities, initial):
    params = ReputationParams(initial=initial)
    for state in run(credibilities, params):
        assert 0.0 <= state.reputation <= 1.0


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=0, max_size=10),
       st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0))
def test_a_higher_credibility_never_lowers_the_next_reputation_when_both_are_normal(
    history, low, high
):
    low, high = sorted((max(low, PARAMS.tau), max(high, PARAMS.tau)))
    before = (run(history) or [ReputationState.fresh()])[-1]
    assert update(before, high).reputation >= update(before, low).reputation


# --------------------------------------------------------------------------------- subjects


A = b"\x00\x24\x08\x01\x12\x20" + b"\x01" * 32
B = b"\x00\x24\x08\x01\x12\x20" + b"\x02" * 32
ACME = b"\x00\x24\x08\x01\x12\x20" + b"\x0a" * 32  # organization keys (peer IDs)
OTHER = b"\x00\x24\x08\x01\x12\x20" + b"\x0b" * 32


def test_nodes_of_one_organization_share_a_subject():
    assert subject_of(A, ACME) == subject_of(B, ACME)
    assert subject_of(A) != subject_of(B)
    assert subject_of(A, ACME) != subject_of(A, OTHER)


@given(st.binary(min_size=38, max_size=38), st.binary(min_size=38, max_size=38))
def test_organization_and_node_subjects_never_collide(org_key, peer_id):
    assert subject_of(A, org_key) != subject_of(peer_id)


def test_an_organization_gets_one_update_with_the_mean_of_its_nodes():
    book = ReputationBook(PARAMS)
    org = subject_of(A, ACME)
    book.apply_epoch({org: [0.9, 0.7]})  # C(T) = 0.8
    assert book.reputation(org) == pytest.approx(0.68)
    assert book.get(org).epochs == 1


def test_a_subject_never_scored_starts_at_the_initial_reputation():
    book = ReputationBook(ReputationParams(initial=0.7))
    assert book.reputation(b"node\x00x") == 0.7
    assert book.trusted(b"node\x00x")
    assert b"node\x00x" not in book


def test_book_follows_the_cheater_table_and_lists_it_untrusted():
    book = ReputationBook(PARAMS)
    cheat, good = subject_of(A), subject_of(B)
    for (c, _, r, _), good_c in zip(CHEATER, [0.8, 0.9, 0.7, 0.8, 0.8, 0.8]):
        book.apply_epoch({cheat: [c], good: [good_c]})
        assert book.reputation(cheat) == pytest.approx(r, abs=1e-9)
    assert book.untrusted() == [cheat]
    assert book.trusted(good)


def test_a_full_book_refuses_a_new_subject_and_stays_unchanged():
    book = ReputationBook(PARAMS, max_subjects=2)
    book.record(b"s1", 0.8)
    book.record(b"s2", 0.8)
    book.record(b"s1", 0.9)  # a known subject still updates
    with pytest.raises(ReputationBookFullError):
        book.record(b"s3", 0.8)
    with pytest.raises(ReputationBookFullError):
        book.apply_epoch({b"s1": [0.1], b"s3": [0.8]})
    assert list(book) == [b"s1", b"s2"]
    assert book.get(b"s1").epochs == 2  # the refused epoch changed nothing


def test_an_epoch_with_a_bad_score_changes_nothing():
    book = ReputationBook(PARAMS)
    book.record(b"s1", 0.8)
    with pytest.raises(InvalidScoreError):
        book.apply_epoch({b"s1": [0.9], b"s2": [1.5]})
    assert book.get(b"s1").epochs == 1
    assert b"s2" not in book


def test_a_subject_without_scores_is_left_alone():
    book = ReputationBook(PARAMS)
    book.record(b"s1", 0.8)
    assert book.apply_epoch({b"s1": []}) == {}
    assert book.get(b"s1").epochs == 1


def test_forget_drops_a_subject():
    book = ReputationBook(PARAMS)
    book.record(b"s1", 0.1)
    book.forget(b"s1")
    book.forget(b"absent")
    assert len(book) == 0
    assert book.reputation(b"s1") == PARAMS.initial


@given(st.floats(min_value=0.0, max_value=1.0),
       st.lists(st.floats(min_value=0.0, max_value=0.4999), min_size=3, max_size=3))
def test_a_node_scoring_below_tau_is_untrusted_within_three_epochs(initial, credibilities):
    # even from a perfect reputation (R = 1): 0.69994, 0.45641, 0.3189 at C = 0.4999
    states = run(credibilities, ReputationParams(initial=initial))
    assert not is_trusted(states[-1], PARAMS)


@given(st.floats(min_value=0.4, max_value=1.0),
       st.lists(st.floats(min_value=0.5, max_value=1.0), min_size=1, max_size=30))
def test_a_node_never_scoring_below_tau_stays_trusted(initial, credibilities):
    # no abnormal value: R(T) >= 0.4 * 0.4 + 0.6 * 0.5 = 0.46
    for state in run(credibilities, ReputationParams(initial=initial)):
        assert is_trusted(state, PARAMS)
