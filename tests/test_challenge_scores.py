"""Challenge scores that tie an answer to its prompt and its sampling parameters (issue 18):
calibrated statistics on synthetic distributions (honest samples are N(0, 1) at every
temperature; wrong temperatures, other models and other prompts are not), greedy top choices,
the claimed end, decoy draws; then the real stories260K model with the adversaries of
ps_p2p.testing.dishonest."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest

from ps_p2p.engines.base import SamplingParams
from ps_p2p.verification.scoring import (
    DEFAULT_CHALLENGE_SCORING,
    AnswerStats,
    ChallengeScoring,
    answer_stats,
    challenge_credibility,
    challenge_stats,
    challenge_stats_many,
    decoy_indices,
    sampling_logprobs,
    score_challenge,
)

VOCAB = 64
EOS = 2


def _rows(rng: np.random.Generator, n: int, sharpness: float = 2.0) -> np.ndarray:
    """n + 1 random log-softmax rows (a made-up model's distributions at n + 1 positions)."""
    logits = rng.normal(0.0, sharpness, size=(n + 1, VOCAB))
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def _sample(rng: np.random.Generator, rows: np.ndarray, t: float, top_p: float) -> list[int]:
    q = np.exp(sampling_logprobs(rows[:-1], t, top_p))
    return [int(rng.choice(VOCAB, p=row / row.sum())) for row in q]


# ------------------------------------------------------------------------ sampling distribution


def test_the_sampling_distribution_is_the_engines_tempered_nucleus():
    row = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    # T = 1, top_p 0.8: 0.5 and 0.3 (the mass before 0.15 is 0.8, not below 0.8), renormalised
    q = np.exp(sampling_logprobs(row, 1.0, 0.8))[0]
    assert q == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    # the first token always stays, even when it alone exceeds top_p
    assert np.exp(sampling_logprobs(row, 1.0, 0.1))[0] == pytest.approx([1, 0, 0, 0])
    # T = 2 flattens: p^(1/2) normalised
    flat = np.sqrt([0.5, 0.3, 0.15, 0.05])
    assert np.exp(sampling_logprobs(row, 2.0))[0] == pytest.approx(flat / flat.sum())


# -------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("t, top_p", [(0.3, 1.0), (0.7, 0.9), (1.0, 1.0), (1.5, 0.95), (2.0, 1.0)])
def test_honest_samples_give_a_standard_normal_statistic_at_every_temperature(t, top_p):
    rng = np.random.default_rng(7)
    z_fit, z_tie = [], []
    for _ in range(300):
        rows = _rows(rng, 32)
        decoys = [_rows(rng, 32) for _ in range(3)]
        stats = answer_stats(rows, _sample(rng, rows, t, top_p), temperature=t, top_p=top_p,
                             decoy_rows=decoys, params=ChallengeScoring(trim=0))
        z_fit.append(stats.z_fit)
        z_tie.append(stats.z_tie)
    for z in (np.array(z_fit), np.array(z_tie)):
        assert abs(z.mean()) < 0.2 and 0.75 < z.std() < 1.15  # the variance prior shrinks it a bit
        assert (np.abs(z) > DEFAULT_CHALLENGE_SCORING.z_ok).mean() < 0.05


@pytest.mark.parametrize("asked, used", [(0.7, 1.05), (1.0, 1.5), (1.0, 0.5), (2.0, 1.0)])
def test_an_answer_sampled_at_another_temperature_scores_low(asked, used):
    rng = np.random.default_rng(3)
    scores = []
    for _ in range(100):
        rows = _rows(rng, 64)
        stats = answer_stats(rows, _sample(rng, rows, used, 1.0), temperature=asked)
        scores.append(challenge_credibility(stats))
    assert np.mean(scores) < 0.5


def test_an_answer_from_another_model_scores_low_at_the_asked_temperature():
    rng = np.random.default_rng(4)
    scores = []
    for _ in range(100):
        rows = _rows(rng, 64)
        other = rows + rng.normal(0.0, 2.0, size=rows.shape)  # a clearly different model
        other -= np.log(np.exp(other).sum(axis=1, keepdims=True))
        stats = answer_stats(rows, _sample(rng, other, 0.7, 1.0), temperature=0.7)
        scores.append(challenge_credibility(stats))
    assert np.mean(scores) < 0.5


def test_an_answer_to_another_prompt_fails_the_decoy_comparison():
    """The answer fits a decoy prompt's distributions, not the asked prompt's: z_tie < 0."""
    rng = np.random.default_rng(5)
    honest, copied = [], []
    for _ in range(100):
        rows, elsewhere = _rows(rng, 32), _rows(rng, 32)
        decoys = [_rows(rng, 32) for _ in range(3)]
        for answer, out in ((_sample(rng, rows, 1.0, 1.0), honest),
                            (_sample(rng, elsewhere, 1.0, 1.0), copied)):
            out.append(answer_stats(rows, answer, temperature=1.0, decoy_rows=decoys).z_tie)
    assert np.median(honest) > -1.0
    assert np.median(copied) < -DEFAULT_CHALLENGE_SCORING.z_bad


# ------------------------------------------------------------------------------- greedy


def test_a_greedy_answer_must_be_the_models_top_choice_up_to_near_ties():
    rows = np.log(np.full((5, 4), 0.01))
    rows[:, 0] = math.log(0.5)
    rows[:, 1] = math.log(0.49)  # a near-tie at every position (0.02 nats)
    rows[4, EOS] = math.log(0.97)
    top = answer_stats(rows, [0, 0, 1, 0], temperature=0.0)
    assert top.misses == 0 and challenge_credibility(top) == 1.0
    wrong = answer_stats(rows, [0, 3, 3, 3], temperature=0.0)
    assert wrong.misses == 3 and challenge_credibility(wrong) == 0.0
    # one clear miss is forgiven (re-tokenisation), two are not
    assert challenge_credibility(answer_stats(rows, [0, 3, 0, 0], temperature=0.0)) == 1.0
    assert challenge_credibility(answer_stats(rows, [0, 3, 3, 0], temperature=0.0)) == 0.5


# --------------------------------------------------------------------------- claimed end


def _end_rows(eos_prob: float) -> np.ndarray:
    rows = np.log(np.full((4, 4), 0.1 / 3))
    rows[:, 0] = math.log(0.9)
    rows[3] = math.log((1 - eos_prob) / 3)
    rows[3, EOS] = math.log(eos_prob)
    return rows


@pytest.mark.parametrize("finish, eos_prob, tokens, ok", [
    ("stop", 1e-6, 3, False),   # cut short and signed "stop": the model would not end there
    ("stop", 0.3, 3, True),     # it would
    ("length", 0.3, 3, False),  # "length" with 3 of 32 tokens
    ("length", 1e-6, 30, True),  # "length" within the slack of max_tokens
    ("stop", 1e-6, 30, True),   # "stop" at max_tokens: nothing was cut
])
def test_the_claimed_end_must_be_plausible(finish, eos_prob, tokens, ok):
    rows = _end_rows(eos_prob)
    if tokens > 3:
        rows = np.concatenate([np.repeat(rows[:1], tokens, axis=0), rows[3:]])
    stats = answer_stats(rows, [0] * tokens, temperature=1.0, finish_reason=finish,
                         max_tokens=32, end_ids={EOS})
    assert stats.end_ok is ok
    assert (challenge_credibility(stats) == 0.0) is (not ok)


def test_an_empty_answer_scores_zero():
    assert challenge_credibility(AnswerStats(0, False, 0.0, 0.0, 0, True)) == 0.0


# ------------------------------------------------------------------------------- decoys


def test_decoys_are_the_same_for_every_verifier_distinct_and_never_the_asked_prompt():
    a = decoy_indices(b"request hash", 10, 3, 4)
    assert a == decoy_indices(b"request hash", 10, 3, 4)
    assert len(set(a)) == 4 and 3 not in a and all(0 <= i < 10 for i in a)
    assert a != decoy_indices(b"another hash", 10, 3, 4)
    assert sorted(decoy_indices(b"k", 3, 1, 8)) == [0, 2]  # fewer when the pool is small


def test_scoring_parameters_out_of_range_are_refused():
    for bad in ({"z_ok": 5.0, "z_bad": 4.0}, {"end_prob": 0.0}, {"decoys": -1},
                {"variance_prior": 0.0}, {"trim": 65}):
        with pytest.raises(ValueError):
            ChallengeScoring(**bad)


# ------------------------------------------------------------------------ the real model

_loaded: dict[str, object] = {}
PROMPTS = ["Once upon a time, there was a little girl named Lily.",
           "Tom had a big red ball. One day,", "The sun was hot and the dog was tired.",
           "What is the capital of France? Answer in one word.",
           "Write a short poem about the sea."]


def _reference(shared: pathlib.Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    if "ref" not in _loaded:
        from ps_p2p.engines.transformers_engine import TransformersEngine

        _loaded["ref"] = TransformersEngine.load(shared / "models" / "stories260K")
    return _loaded["ref"]


async def _scores(ref, engine, t: float, top_p: float = 1.0, *, ask=None) -> list[float]:  # type: ignore
    out = []
    for i, prompt in enumerate(PROMPTS):
        answer = await engine.complete(ask(i) if ask else prompt, SamplingParams(
            max_tokens=32, temperature=t, top_p=top_p, seed=i))
        decoys = [p for p in PROMPTS if p != prompt]
        out.append(await score_challenge(
            ref, prompt, answer.text, temperature=t, top_p=top_p, max_tokens=32,
            finish_reason=answer.finish_reason, decoys=decoys))
    return out


@pytest.mark.needs_shared
@pytest.mark.parametrize("t, top_p", [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9), (2.0, 1.0)])
async def test_the_right_model_scores_as_honest_at_every_temperature(shared, t, top_p):
    ref = _reference(shared)
    assert min(await _scores(ref, ref, t, top_p)) >= 0.5


@pytest.mark.needs_shared
async def test_dishonest_answers_score_low_on_greedy_challenges(shared):
    from ps_p2p.testing.dishonest import (
        DishonestEngine,
        FixedAnswerEngine,
        OtherPromptEngine,
        quantized_copy,
    )

    ref = _reference(shared)
    story = (await ref.complete(PROMPTS[0], SamplingParams(max_tokens=32))).text
    for cheat in (FixedAnswerEngine(ref, story), OtherPromptEngine(ref, PROMPTS[1]),
                  DishonestEngine(ref, keep_fraction=0.25, finish_reason="stop"),
                  DishonestEngine(ref, temperature_scale=1.5),
                  quantized_copy(shared / "models" / "stories260K", bits=3)):
        scores = await _scores(ref, cheat, 0.0)
        assert np.mean(scores) < 0.5, type(cheat).__name__


@pytest.mark.needs_shared
async def test_an_answer_cut_short_and_signed_stop_scores_zero_when_sampled(shared):
    from ps_p2p.testing.dishonest import DishonestEngine

    ref = _reference(shared)
    cut = DishonestEngine(ref, keep_fraction=0.25, finish_reason="stop")
    assert max(await _scores(ref, cut, 0.7)) < 0.5


@pytest.mark.needs_shared
async def test_logprob_rows_are_the_models_whole_distribution_at_each_scored_position(shared):
    ref = _reference(shared)
    ids = await ref.tokenize(PROMPTS[0] + " She liked to play.")
    start = len(await ref.tokenize(PROMPTS[0]))
    [rows, again] = await ref.logprob_rows([(ids, start), (ids, start)])
    scores = await ref.score_ids(ids, start)
    assert rows.shape == (len(ids) - start + 1, ref.vocab_size)  # one more: what follows
    assert np.exp(rows).sum(axis=1) == pytest.approx(1.0)
    got = [rows[i, t] for i, t in enumerate(ids[start:])]
    assert got == pytest.approx(scores.logprobs, abs=1e-5)
    # the same sequence twice in one batch: the same rows up to the batched products' rounding
    assert np.abs(rows - again).max() < 1e-5


@pytest.mark.needs_shared
async def test_scoring_many_answers_at_once_gives_each_answers_own_statistics(
        shared, monkeypatch):
    from ps_p2p.testing.dishonest import DishonestEngine

    ref = _reference(shared)
    cut = DishonestEngine(ref, keep_fraction=0.25, finish_reason="stop")
    answers = []
    for i, prompt in enumerate(PROMPTS):
        for engine, t, top_p in ((ref, 0.0, 1.0), (ref, 0.7, 0.9), (ref, 1.0, 1.0),
                                 (cut, 0.7, 1.0)):
            done = await engine.complete(prompt, SamplingParams(
                max_tokens=32, temperature=t, top_p=top_p, seed=i))
            answers.append({"prompt": prompt, "response": done.text, "temperature": t,
                            "top_p": top_p, "max_tokens": 32, "finish_reason": done.finish_reason,
                            "decoys": [p for p in PROMPTS if p != prompt]})
        # a greedy answer that is not the model's own: scored token by token
        answers.append(dict(answers[-1], temperature=0.0, top_p=1.0, response=PROMPTS[i - 1]))
    together = await challenge_stats_many(ref, answers)
    calls = []
    batched = ref.logprob_rows

    async def one_by_one(sequences):  # the per-sequence forward passes of the engine before
        calls.append(len(sequences))
        return [(await batched([s]))[0] for s in sequences]

    monkeypatch.setattr(ref, "logprob_rows", one_by_one)
    alone = [await challenge_stats(ref, **a) for a in answers]
    assert len(calls) == len(answers) - len(PROMPTS)  # honest greedy answers need no rows
    assert any(n > 1 for n in calls)  # decoys were scored
    for a, b in zip(alone, together):
        assert (a.tokens, a.greedy, a.misses, a.end_ok) == (b.tokens, b.greedy, b.misses, b.end_ok)
        assert a.z_fit == pytest.approx(b.z_fit, abs=1e-4)
        assert a.z_tie == pytest.approx(b.z_tie, abs=1e-4)
        assert challenge_credibility(a) == pytest.approx(challenge_credibility(b), abs=1e-4)
    assert {challenge_credibility(s) > 0.5 for s in together} == {True, False}


#: An honest answer of stories260K at T = 0.1, top_p = 0.9 (seed 161) to an MT-Bench prompt:
#: the model generated "i" then "g" at its end, which the tokenizer encodes as one token "ig"
#: that the model gives e**-105 at this temperature (1 such answer in 1,000 at low T).
RETOKENISED_PROMPT = (
    "Given a set of complex equations, extract all unique variable names from each equation. "
    "Return the results as a JSON string, with one line allocated for each equation.\n```\n"
    "1) y = (3/4)x^3 - e^(2x) + sin(pi*x) - sqrt(7)\n2) 2A - B/(3+C) * sum(N=1 to 5; ln(N)^2) "
    "= 5D*integral(a=0 to pi; cos(comb(N=1 to 10; N*a)))\n3) E = m(c^2) + gamma*(v/d)/"
    "(-(alpha/2) + sqrt(beta^2 + (alpha/2)^2))\n```")
RETOKENISED_ANSWER = " a small party. Well all the parts and make a colorigo"


@pytest.mark.needs_shared
async def test_an_honest_answer_whose_text_encodes_to_other_tokens_than_generated_scores_honest(
        shared):
    """The verifier scores the tokenisation of the signed text the model finds plausible: the
    encoder's merge of two generated tokens into one the model never emits at T = 0.1 made
    this honest answer score 0 (z_fit -6.3)."""
    ref = _reference(shared)
    kwargs = {"temperature": 0.1, "top_p": 0.9, "max_tokens": 32, "finish_reason": "length",
              "decoys": PROMPTS}
    as_encoded = await challenge_stats(ref, RETOKENISED_PROMPT, RETOKENISED_ANSWER,
                                       params=ChallengeScoring(retokenise_rounds=0), **kwargs)
    assert challenge_credibility(as_encoded) == 0.0  # the cause: the encoded tokens
    stats = await challenge_stats(ref, RETOKENISED_PROMPT, RETOKENISED_ANSWER, **kwargs)
    assert stats.tokens == as_encoded.tokens + 1  # "ig" scored as the generated "i", "g"
    assert abs(stats.z_fit) < DEFAULT_CHALLENGE_SCORING.z_ok
    assert challenge_credibility(stats) == 1.0


@pytest.mark.needs_shared
async def test_re_tokenisation_does_not_rescue_an_answer_the_model_would_not_write(shared):
    """Only spellings of the same text are tried: a fixed story asked at T = 0.1 stays at 0."""
    ref = _reference(shared)
    for prompt in PROMPTS[2:]:
        stats = await challenge_stats(ref, prompt, RETOKENISED_ANSWER, temperature=0.1,
                                      top_p=0.9, max_tokens=32, finish_reason="length",
                                      decoys=PROMPTS)
        assert challenge_credibility(stats) == 0.0


#: A ShareGPT prompt ending "...js" and stories260K's honest answer at T = 0.1, top_p = 0.9
#: (seed 26): the model continued the prompt's last word ("e", "en"), and the prompt + answer
#: encode "s" + "e" as one token "se", so the answer's tokens cannot be cut from the joint
#: encoding and were encoded on their own, with a word boundary: "▁e", another text.
BOUNDARY_PROMPT = (
    "I was hoping you could create a React component for me. Ultimately, I need the jsx code "
    "for a modal component. The modal component should display some information about a "
    "feature within a web application that allowed users to browse data in a \"Portal\". The "
    "information in the modal component is not important and can be very generic. It is "
    "important that the modal is created in the style of a modal that exists in this file on "
    "GitHub: https://github.com/nasa/earthdata-search/blob/master/static/src/js/components/"
    "AboutCwicModal/AboutCwicModal.js")
BOUNDARY_ANSWER = "een the most beautiful pictures. And they all lived happily e"
#: Honest at T = 1.0, top_p = 0.95 (seed 22): "Gotpard" encodes with tokens outside the
#: nucleus of top_p 0.95 that the model did not generate.
NUCLEUS_ANSWER = " and her cat. Gotpard splashed at it with a beautiful p"


@pytest.mark.needs_shared
@pytest.mark.parametrize("prompt, answer, t, top_p", [
    (BOUNDARY_PROMPT, BOUNDARY_ANSWER, 0.1, 0.9), ("Trading View", NUCLEUS_ANSWER, 1.0, 0.95)])
async def test_an_honest_answer_spelt_across_the_prompt_boundary_or_the_nucleus_scores_honest(
        shared, prompt, answer, t, top_p):
    """The 3 honest answers that scored 0 in bench_reputation's honest bank (runs 7 to 9):
    the scored tokens must spell the answer's own text after the prompt's tokens, and a token
    outside the asked nucleus is re-spelt (module docstring, "Re-tokenisation")."""
    ref = _reference(shared)
    stats = await challenge_stats(ref, prompt, answer, temperature=t, top_p=top_p,
                                  max_tokens=32, finish_reason="length", decoys=PROMPTS)
    assert abs(stats.z_fit) < DEFAULT_CHALLENGE_SCORING.z_ok
    assert challenge_credibility(stats) == 1.0
