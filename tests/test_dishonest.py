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
