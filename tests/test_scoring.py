"""Credibility of a response (PlanetServe sec. 3.4, Algorithm 3): the pure normalisation, the
tempered log-probabilities, and one-pass scoring against the paper's per-token loop on the real
stories260K model."""

from __future__ import annotations

import math
import pathlib
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps_p2p.engines.base import Engine, SamplingParams, TokenScores
from ps_p2p.errors import EngineError
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.verification.scoring import (
    DEFAULT_FLOOR_LOGPROB,
    ScoringParams,
    credibility,
    mean_credibility,
    score_response,
    score_response_per_token,
    scoring_temperature,
    tempered_logprobs,
)

LN = math.log


# ---------------------------------------------------------------------------- credibility


def test_credibility_is_the_inverse_perplexity():
    # two tokens of probability 1/4 and 1: geometric mean 1/2
    assert credibility([LN(0.25), 0.0]) == pytest.approx(0.5)
    assert credibility([LN(0.5)] * 7) == pytest.approx(0.5)


def test_credibility_of_a_certain_answer_is_one():
    assert credibility([0.0, 0.0, 0.0]) == 1.0


def test_credibility_of_an_empty_answer_is_zero():
    assert credibility([]) == 0.0
    assert credibility([], min_tokens=10) == 0.0


def test_tokens_below_the_floor_count_as_the_floor():
    floor = LN(1e-4)
    assert credibility([-math.inf, 0.0], floor=floor) == pytest.approx(math.sqrt(1e-4))
    assert credibility([LN(1e-9), 0.0], floor=floor) == pytest.approx(math.sqrt(1e-4))
    # above the floor a token counts as itself
    assert credibility([LN(1e-3), 0.0], floor=floor) == pytest.approx(math.sqrt(1e-3))


def test_positive_rounding_errors_count_as_probability_one():
    assert credibility([1e-7, 0.0]) == 1.0


def test_missing_tokens_count_as_the_floor():
    floor = LN(0.01)
    # one certain token, one missing: sqrt(1 * 0.01)
    assert credibility([0.0], floor=floor, min_tokens=2) == pytest.approx(0.1)
    # long enough: no padding
    assert credibility([0.0, 0.0], floor=floor, min_tokens=2) == 1.0
    assert credibility([0.0, 0.0, 0.0], floor=floor, min_tokens=2) == 1.0


@pytest.mark.parametrize("bad", [[math.nan], ["x"], [None], [True]])
def test_credibility_refuses_non_numbers(bad):
    with pytest.raises(ValueError):
        credibility(bad)


@pytest.mark.parametrize("kwargs", [
    {"floor": 0.0}, {"floor": 0.5}, {"floor": -101.0}, {"floor": math.nan},
    {"min_tokens": -1}, {"min_tokens": 1.5},
])
def test_credibility_refuses_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        credibility([LN(0.5)], **kwargs)


@given(st.lists(st.floats(max_value=0.0, allow_nan=False), min_size=1, max_size=200),
       st.floats(min_value=-50.0, max_value=-0.01))
def test_credibility_lies_between_the_floor_and_one(logprobs, floor):
    c = credibility(logprobs, floor=floor)
    assert math.exp(floor) * (1 - 1e-9) <= c <= 1.0


@given(st.lists(st.floats(min_value=-30.0, max_value=0.0), min_size=1, max_size=50),
       st.data())
def test_a_likelier_token_never_lowers_credibility(logprobs, data):
    i = data.draw(st.integers(0, len(logprobs) - 1))
    raised = list(logprobs)
    raised[i] = data.draw(st.floats(min_value=logprobs[i], max_value=0.0))
    assert credibility(raised) >= credibility(logprobs) * (1 - 1e-12)


def test_mean_credibility_averages_an_epochs_scores():
    assert mean_credibility([0.2, 0.4, 0.9]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mean_credibility([])
    with pytest.raises(ValueError):
        mean_credibility([0.5, 1.2])


# --------------------------------------------------------------------------- temperature


def test_greedy_challenges_are_scored_at_the_greedy_temperature():
    assert scoring_temperature(0.0) == 0.25
    assert scoring_temperature(0, ScoringParams(greedy_temperature=0.1)) == 0.1
    assert scoring_temperature(0.7) == 0.7
    assert scoring_temperature(1.0) == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.01, 2.0, math.nan, math.inf])
def test_challenge_temperatures_outside_zero_one_are_refused(bad):
    with pytest.raises(ValueError):
        scoring_temperature(bad)


@pytest.mark.parametrize("kwargs", [
    {"greedy_temperature": 0.0}, {"greedy_temperature": 1.5}, {"top_k": 0}, {"top_k": 1001},
    {"floor_logprob": 0.0},
])
def test_scoring_params_refuse_values_out_of_range(kwargs):
    with pytest.raises(ValueError):
        ScoringParams(**kwargs)


def _distribution(seed: int, vocab: int = 40) -> list[float]:
    rng = random.Random(seed)
    logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
    top = max(logits)
    log_z = top + LN(sum(math.exp(x - top) for x in logits))
    return [x - log_z for x in logits]


def _scores(dists: list[list[float]], tokens: list[int], top_k: int) -> TokenScores:
    top = []
    for d in dists:
        best = sorted(range(len(d)), key=lambda j: -d[j])[:top_k]
        top.append({j: d[j] for j in best})
    return TokenScores(tokens, [d[t] for d, t in zip(dists, tokens)], top_logprobs=top)


def _exact_tempered(d: list[float], token: int, temperature: float) -> float:
    scaled = [x / temperature for x in d]
    top = max(scaled)
    return scaled[token] - top - LN(sum(math.exp(x - top) for x in scaled))


def test_tempered_logprobs_with_the_whole_vocabulary_are_exact():
    dists = [_distribution(s) for s in range(6)]
    tokens = [3, 0, 17, 39, 5, 22]
    scores = _scores(dists, tokens, top_k=40)
    for t in (0.1, 0.25, 0.7):
        got = tempered_logprobs(scores, t)
        want = [_exact_tempered(d, tok, t) for d, tok in zip(dists, tokens)]
        assert got == pytest.approx(want, abs=1e-9)


def test_tempered_logprobs_at_temperature_one_are_the_engines():
    dists = [_distribution(s) for s in range(3)]
    scores = _scores(dists, [1, 2, 3], top_k=2)
    assert tempered_logprobs(scores, 1.0) == pytest.approx(scores.logprobs)
    # no alternatives needed at T = 1
    assert tempered_logprobs(TokenScores([1], [LN(0.3)]), 1.0) == [LN(0.3)]


@given(st.integers(0, 10_000), st.integers(1, 39), st.integers(0, 39),
       st.floats(min_value=0.05, max_value=1.0))
def test_truncated_alternatives_never_raise_a_tempered_score(seed, top_k, token, temperature):
    d = _distribution(seed)
    truncated = tempered_logprobs(_scores([d], [token], top_k), temperature)[0]
    assert truncated <= _exact_tempered(d, token, temperature) + 1e-9


def test_tempered_scores_need_alternatives():
    with pytest.raises(ValueError, match="top_logprobs"):
        tempered_logprobs(TokenScores([1], [LN(0.3)]), 0.5)


def test_a_greedy_token_scores_higher_when_sharpened():
    d = _distribution(7)
    argmax = max(range(len(d)), key=lambda j: d[j])
    scores = _scores([d], [argmax], top_k=40)
    assert tempered_logprobs(scores, 0.25)[0] > d[argmax]


# ------------------------------------------------------------------------- engine helpers


async def test_sharpened_scoring_needs_the_token_level_api():
    engine = InstantEngine()
    with pytest.raises(EngineError):
        await score_response(engine, "a prompt", "an answer", temperature=0.0)
    # at T = 1 the text-level score is enough
    c = await score_response(engine, "a prompt", "an answer", temperature=1.0)
    assert 0.0 <= c <= 1.0


# ------------------------------------------------------------------------ the real model

_loaded: dict[pathlib.Path, Engine] = {}


@pytest.fixture
def engine(shared: pathlib.Path) -> Engine:
    """TransformersEngine on ../shared/models/stories260K, loaded once (do not close)."""
    pytest.importorskip("transformers")
    path = shared / "models" / "stories260K"
    if path not in _loaded:
        from ps_p2p.engines.transformers_engine import TransformersEngine

        _loaded[path] = TransformersEngine.load(path)
    return _loaded[path]


PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.mark.needs_shared
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
async def test_one_pass_equals_the_per_token_loop(engine, temperature):
    answer = await engine.complete(PROMPT, SamplingParams(max_tokens=48, temperature=0.8, seed=3))
    assert answer.completion_tokens == 48
    one = await score_response(engine, PROMPT, answer.text, temperature=temperature)
    loop = await score_response_per_token(engine, PROMPT, answer.text, temperature=temperature)
    assert 0.0 < one < 1.0
    assert one == pytest.approx(loop, rel=1e-5, abs=1e-7)


@pytest.mark.needs_shared
async def test_the_models_own_greedy_answer_beats_a_shuffled_one(engine):
    answer = (await engine.complete(PROMPT, SamplingParams(max_tokens=64))).text
    words = answer.split(" ")
    random.Random(1).shuffle(words)
    honest = await score_response(engine, PROMPT, answer)
    shuffled = await score_response(engine, PROMPT, " ".join(words))
    assert honest > 0.5
    assert shuffled < honest / 2


@pytest.mark.needs_shared
async def test_a_truncated_answer_loses_its_credibility(engine):
    answer = (await engine.complete(PROMPT, SamplingParams(max_tokens=64))).text
    ids = await engine.encode(answer, add_special_tokens=False)
    half = await engine.decode(ids[:32])
    full = await score_response(engine, PROMPT, answer, min_tokens=60)
    cut = await score_response(engine, PROMPT, half, min_tokens=60)
    assert cut < full / 2
    # without the length rule the cut answer keeps a good score (the paper's PPL)
    assert await score_response(engine, PROMPT, half) > full / 2


@pytest.mark.needs_shared
async def test_an_empty_answer_scores_zero(engine):
    assert await score_response(engine, PROMPT, "") == 0.0
    assert await score_response_per_token(engine, PROMPT, "") == 0.0
    assert await score_response(engine, PROMPT, "", temperature=1.0) == 0.0


def test_default_floor_is_algorithm_3s_epsilon():
    assert math.exp(DEFAULT_FLOOR_LOGPROB) == pytest.approx(1e-4)
