"""Dishonest model nodes for verification experiments (issue "Verification of model serving").

TEST ONLY. Three ways a model node can claim one model and serve less (paper sec. 3.4, figs.
10-11), each an engine a model node can run:

* :func:`degraded_copy`: a substituted model: the same architecture with Gaussian noise on
  every weight (``noise`` times that tensor's standard deviation, seeded), made at run time
  from the shared model, so nothing extra is stored;
* :class:`DishonestEngine` with ``keep_fraction``: the right model, but every answer cut to
  that fraction of the tokens asked for (and reported as finished by ``"length"``);
* :class:`DishonestEngine` with ``temperature``: the right model, sampled at a forced (high)
  temperature whatever the request asks.

Everything else (scoring, tokenization, chat templates, KV-cache events) is the inner
engine's, so a verifier cannot tell the engines apart except by the answers.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import AsyncIterator, Sequence

from ps_p2p.engines.base import (
    FINISH_LENGTH,
    ChatMessage,
    Engine,
    SamplingParams,
    StreamChunk,
    TokenScores,
)
from ps_p2p.engines.kv_events import KVCacheEvent


def degraded_copy(path: str | os.PathLike[str], *, noise: float, seed: int = 0,
                  model_id: str | None = None):  # type: ignore[no-untyped-def]
    """A :class:`~ps_p2p.engines.transformers_engine.TransformersEngine` of the model at
    ``path`` whose every weight tensor ``w`` became ``w + noise * std(w) * N(0, 1)`` (seeded).

    Args:
        noise: relative noise, >= 0 (0.1: clearly degraded text on stories260K).
        model_id: announced model ID (default: the real model's, which is the point).

    Raises:
        ValueError: ``noise`` negative or not finite.
    """
    import torch

    from ps_p2p.engines.transformers_engine import TransformersEngine

    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite number >= 0, not {noise!r}")
    engine = TransformersEngine.load(path, model_id=model_id, prefix_cache_blocks=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in engine.model.parameters():
            if tensor.numel() > 1:
                scale = noise * float(tensor.float().std())
                tensor.add_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
                            * scale)
    return engine


class DishonestEngine(Engine):
    """The inner engine, answering worse (module docstring).

    Args:
        inner: the real engine.
        keep_fraction: cut each answer to ``ceil(keep_fraction * max_tokens)`` tokens, in
            (0, 1]; None: no cut.
        temperature: sample at this temperature whatever the request asks; None: as asked.

    Raises:
        ValueError: ``keep_fraction`` outside (0, 1] or ``temperature`` negative.
    """

    def __init__(self, inner: Engine, *, keep_fraction: float | None = None,
                 temperature: float | None = None) -> None:
        if keep_fraction is not None and not 0 < keep_fraction <= 1:
            raise ValueError(f"keep_fraction must be in (0, 1], not {keep_fraction!r}")
        if temperature is not None and not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, not {temperature!r}")
        self.inner = inner
        self.keep_fraction = keep_fraction
        self.temperature = temperature
        self.model_id = inner.model_id
        self.max_context = inner.max_context

    def _params(self, params: SamplingParams) -> SamplingParams:
        changes: dict[str, object] = {}
        if self.keep_fraction is not None:
            changes["max_tokens"] = max(1, math.ceil(self.keep_fraction * params.max_tokens))
        if self.temperature is not None:
            changes["temperature"] = self.temperature
            if params.seed is None:
                changes["seed"] = 0
        return dataclasses.replace(params, **changes)

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        async for chunk in self.stream(prompt, params):
            if chunk.text:
                yield chunk.text

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        async for chunk in self.inner.stream(prompt, self._params(params)):
            if chunk.finish_reason is not None and self.keep_fraction is not None:
                chunk = dataclasses.replace(chunk, finish_reason=FINISH_LENGTH)
            yield chunk

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        return await self.inner.score(prompt, continuation)

    async def tokenize(self, text: str) -> list[int]:
        return await self.inner.tokenize(text)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.inner.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await self.inner.decode(token_ids)

    async def score_ids(self, token_ids: Sequence[int], start: int, *,
                        top_k: int = 0) -> TokenScores:
        return await self.inner.score_ids(token_ids, start, top_k=top_k)

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        return await self.inner.chat_prompt(messages)

    def chat_template(self) -> str | None:
        return self.inner.chat_template()

    @property
    def kv_block_size(self) -> int | None:
        return self.inner.kv_block_size

    def drain_kv_events(self) -> list[KVCacheEvent]:
        return self.inner.drain_kv_events()

    async def aclose(self) -> None:
        await self.inner.aclose()


__all__ = ["DishonestEngine", "degraded_copy"]
