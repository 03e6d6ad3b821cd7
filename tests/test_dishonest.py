"""TEST ONLY dishonest model nodes (ps_p2p.testing.dishonest) on the real model: each answers
visibly worse than the honest engine under the verifier's one-pass scoring."""

from __future__ import annotations

import pathlib

import pytest

from ps_p2p.engines.base import FINISH_LENGTH, SamplingParams
from ps_p2p.testing.dishonest import DishonestEngine, degraded_copy
from ps_p2p.verification.scoring import score_response

PROMPTS = ["Once upon a time, there was a little girl named Lily.",
           "Tom had a big red ball. One day,", "The sun was hot and the dog was tired."]
_loaded: dict[str, object] = {}


def _engines(shared: pathlib.Path):
    pytest.importorskip("transformers")
    path = shared / "models" / "stories260K"
    if "honest" not in _loaded:
        from ps_p2p.engines.transformers_engine import TransformersEngine

        _loaded["honest"] = TransformersEngine.load(path)
        _loaded["noisy"] = degraded_copy(path, noise=0.1, seed=1)
    return _loaded["honest"], _loaded["noisy"]


async def _mean_score(verifier, engine, **params) -> float:
    scores = []
    for prompt in PROMPTS:
        answer = await engine.complete(prompt, SamplingParams(max_tokens=48, **params))
        scores.append(await score_response(verifier, prompt, answer.text, min_tokens=48))
    return sum(scores) / len(scores)


@pytest.mark.needs_shared
async def test_each_dishonest_engine_scores_below_the_honest_one(shared):
    honest, noisy = _engines(shared)
    assert noisy.model_id == honest.model_id  # it claims the same model
    fair = await _mean_score(honest, honest)
    assert await _mean_score(honest, noisy) < fair - 0.2
    assert await _mean_score(honest, DishonestEngine(honest, temperature=2.0)) < fair - 0.2
    assert await _mean_score(honest, DishonestEngine(honest, keep_fraction=0.25)) < fair - 0.2


@pytest.mark.needs_shared
async def test_a_truncating_engine_cuts_answers_and_says_length(shared):
    honest, _ = _engines(shared)
    cut = DishonestEngine(honest, keep_fraction=0.25)
    answer = await cut.complete(PROMPTS[0], SamplingParams(max_tokens=40))
    assert answer.completion_tokens == 10 and answer.finish_reason == FINISH_LENGTH
    with pytest.raises(ValueError):
        DishonestEngine(honest, keep_fraction=0.0)


# --------------------------------------------------------- issue 18's stronger adversaries


@pytest.mark.needs_shared
async def test_a_truncating_engine_can_claim_the_model_stopped(shared):
    honest, _ = _engines(shared)
    cut = DishonestEngine(honest, keep_fraction=0.25, finish_reason="stop")
    answer = await cut.complete(PROMPTS[0], SamplingParams(max_tokens=40))
    assert answer.completion_tokens == 10 and answer.finish_reason == "stop"


@pytest.mark.needs_shared
async def test_a_temperature_scaling_engine_samples_at_a_multiple_of_the_asked_one(shared):
    honest, _ = _engines(shared)
    hot = DishonestEngine(honest, temperature_scale=1.5)
    assert hot._params(SamplingParams(temperature=0.6)).temperature == pytest.approx(0.9)
    assert hot._params(SamplingParams(temperature=0.0)).temperature == pytest.approx(0.5)


@pytest.mark.needs_shared
def test_a_quantized_copy_keeps_at_most_2_to_the_bits_levels_per_group(shared):
    import torch

    from ps_p2p.testing.dishonest import quantized_copy

    engine = quantized_copy(shared / "models" / "stories260K", bits=4, group=32)
    matrices = [t for t in engine.model.parameters() if t.dim() == 2 and t.shape[1] % 32 == 0]
    assert matrices
    for t in matrices:
        groups = t.detach().reshape(t.shape[0], -1, 32)
        levels = max(len(torch.unique(g)) for g in groups.reshape(-1, 32)[:50])
        assert levels <= 16


@pytest.mark.needs_shared
async def test_text_engines_answer_without_the_asked_prompt(shared):
    from ps_p2p.testing.dishonest import (
        FixedAnswerEngine,
        NearestPromptEngine,
        OtherPromptEngine,
        SelectiveEngine,
        TrustAwareEngine,
    )

    honest, _ = _engines(shared)
    params = SamplingParams(max_tokens=16)
    fixed = FixedAnswerEngine(honest, "The end.")
    assert (await fixed.complete(PROMPTS[0], params)).text == "The end."
    other = OtherPromptEngine(honest)
    await other.complete(PROMPTS[0], params)  # answers "" first
    second = await other.complete(PROMPTS[1], params)
    assert second.text == (await honest.complete(PROMPTS[0], params)).text  # the previous one's
    nearest = NearestPromptEngine(honest, ["Tom had a big red ball.", "A cat sat on a mat."])
    assert nearest.nearest("Tom had a big blue ball.") == 0
    assert (await nearest.complete("Tom had a big blue ball.", params)).text == (
        await honest.complete("Tom had a big red ball.", params)).text
    picky = SelectiveEngine(honest, fixed, lambda prompt, p: "Lily" in prompt)
    assert (await picky.complete(PROMPTS[1], params)).text == "The end."
    assert (await picky.complete(PROMPTS[0], params)).text != "The end."
    assert picky.routed == {"honest": 1, "cheap": 1} and picky.last_route == "honest"
    aware = TrustAwareEngine(honest, fixed)  # a fresh subject is trusted: cheap at once
    assert (await aware.complete(PROMPTS[0], params)).text == "The end."
    aware.trusted = False  # untrusted: honest on everything, challenge or not
    assert (await aware.complete(PROMPTS[0], params)).text == (
        await honest.complete(PROMPTS[0], params)).text
    assert aware.routed == {"honest": 1, "cheap": 1}
