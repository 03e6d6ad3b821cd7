"""Dishonest model nodes for verification experiments (issue "Verification of model serving",
issue 18 "Verification a dishonest model node cannot dodge").

TEST ONLY. Ways a model node can claim one model and serve less (paper sec. 3.4, figs.
10-11), each an engine a model node can run:

* :func:`degraded_copy`: a substituted model: the same architecture with Gaussian noise on
  every weight (``noise`` times that tensor's standard deviation, seeded), made at run time
  from the shared model, so nothing extra is stored;
* :class:`DishonestEngine` with ``keep_fraction``: the right model, but every answer cut to
  that fraction of the tokens asked for (and reported as finished by ``"length"``);
* :class:`DishonestEngine` with ``temperature``: the right model, sampled at a forced (high)
  temperature whatever the request asks (``temperature_scale``: at a multiple of the asked
  one); ``finish_reason`` "stop": a cut answer that claims the model stopped;
* :func:`quantized_copy`: the weights rounded to ``bits`` (int4: 4) per group of 32;
* :func:`substitute_model` (:mod:`ps_p2p.testing.substitute`): a smaller model with the same
  tokenizer, distilled from the real one on the shared text;
* :class:`FixedAnswerEngine`: one text for every prompt, no model run at all;
* :class:`OtherPromptEngine`: the right model's answer to another prompt (the previous
  request's, or a fixed one): a copied answer;
* :class:`NearestPromptEngine`: a cache of the right model's answers to a set of prompts,
  answering each request with the cached answer of the most similar prompt;
* :class:`SelectiveEngine`: an honest engine for requests a predicate flags as challenges,
  a cheap one for the rest (the predicate: a classifier such as ``ps_p2p.testing.
  challenge_classifier``, or a stand-in); with an honest *peer's* engine as the honest one it
  is also the node that forwards what it takes for challenges to an honest peer;
* :class:`TrustAwareEngine`: honest only while its committed reputation says untrusted, the
  cheap engine while trusted (it needs no classifier).

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
    FINISH_STOP,
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
                 temperature: float | None = None, temperature_scale: float | None = None,
                 finish_reason: str = FINISH_LENGTH) -> None:
        if keep_fraction is not None and not 0 < keep_fraction <= 1:
            raise ValueError(f"keep_fraction must be in (0, 1], not {keep_fraction!r}")
        if temperature is not None and not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, not {temperature!r}")
        if temperature_scale is not None and not temperature_scale > 0:
            raise ValueError(f"temperature_scale must be > 0, not {temperature_scale!r}")
        self.inner = inner
        self.keep_fraction = keep_fraction
        self.temperature = temperature
        self.temperature_scale = temperature_scale
        self.finish_reason = finish_reason
        self.model_id = inner.model_id
        self.max_context = inner.max_context

    def _params(self, params: SamplingParams) -> SamplingParams:
        changes: dict[str, object] = {}
        if self.keep_fraction is not None:
            changes["max_tokens"] = max(1, math.ceil(self.keep_fraction * params.max_tokens))
        t = self.temperature
        if self.temperature_scale is not None:  # greedy asked: sample at T = scale - 1 > 0
            t = (params.temperature * self.temperature_scale if params.temperature > 0
                 else abs(self.temperature_scale - 1.0) or 0.5)
        if t is not None:
            changes["temperature"] = t
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
                chunk = dataclasses.replace(chunk, finish_reason=self.finish_reason)
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


def quantized_copy(path: str | os.PathLike[str], *, bits: int = 4, group: int = 32,
                   model_id: str | None = None):  # type: ignore[no-untyped-def]
    """A :class:`~ps_p2p.engines.transformers_engine.TransformersEngine` of the model at
    ``path`` with every matrix rounded to ``bits``-bit integers, symmetric, one scale per
    ``group`` consecutive weights of a row (round to nearest; int4: ``bits=4``), as a
    weight-only quantised deployment would serve it.

    Raises:
        ValueError: ``bits`` not in [2, 8] or ``group`` < 1.
    """
    import torch

    from ps_p2p.engines.transformers_engine import TransformersEngine

    if not 2 <= bits <= 8 or group < 1:
        raise ValueError(f"bits must be in [2, 8] and group >= 1, not {bits!r}, {group!r}")
    engine = TransformersEngine.load(path, model_id=model_id, prefix_cache_blocks=0)
    top = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for tensor in engine.model.parameters():
            if tensor.dim() != 2 or tensor.shape[1] % group:
                continue
            w = tensor.float().reshape(tensor.shape[0], -1, group)
            scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / top
            tensor.copy_((torch.round(w / scale).clamp(-top - 1, top) * scale)
                         .reshape(tensor.shape).to(tensor.dtype))
    return engine


class _TextEngine(Engine):
    """Base of the engines below: answers are whole texts, finishing with "stop" (or "length"
    when the text has max_tokens tokens or more); the token-level API is the ``tokenizer``
    engine's (the real model's tokenizer, so the answers re-tokenise like real ones)."""

    def __init__(self, tokenizer: Engine) -> None:
        self.tok = tokenizer
        self.model_id = tokenizer.model_id
        self.max_context = tokenizer.max_context

    async def answer(self, prompt: str, params: SamplingParams) -> tuple[str, str]:
        raise NotImplementedError

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        async for chunk in self.stream(prompt, params):
            if chunk.text:
                yield chunk.text

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        text, finish = await self.answer(prompt, params)
        ids = await self.tok.encode(text, add_special_tokens=False)
        if len(ids) > params.max_tokens:
            text, finish = await self.tok.decode(ids[: params.max_tokens]), FINISH_LENGTH
        prompt_tokens = len(await self.tok.tokenize(prompt))
        yield StreamChunk(text, finish_reason=finish, prompt_tokens=prompt_tokens,
                          completion_tokens=min(len(ids), params.max_tokens))

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        return await self.tok.score(prompt, continuation)

    async def tokenize(self, text: str) -> list[int]:
        return await self.tok.tokenize(text)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.tok.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await self.tok.decode(token_ids)

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        return await self.tok.chat_prompt(messages)

    def chat_template(self) -> str | None:
        return self.tok.chat_template()

    async def aclose(self) -> None:
        return None


class FixedAnswerEngine(_TextEngine):
    """The same ``text`` for every prompt (no model run); finish reason "stop"."""

    def __init__(self, tokenizer: Engine, text: str) -> None:
        super().__init__(tokenizer)
        self.text = text

    async def answer(self, prompt: str, params: SamplingParams) -> tuple[str, str]:
        return self.text, FINISH_STOP


class OtherPromptEngine(_TextEngine):
    """The ``inner`` engine's answer to another prompt: ``other`` when given, else the previous
    request's prompt (the first request is answered with ``other or ""``)."""

    def __init__(self, inner: Engine, other: str | None = None) -> None:
        super().__init__(inner)
        self.other = other
        self._previous = other or ""

    async def answer(self, prompt: str, params: SamplingParams) -> tuple[str, str]:
        asked = self.other if self.other is not None else self._previous
        self._previous = prompt
        done = await self.tok.complete(asked, params)
        return done.text, done.finish_reason or FINISH_STOP


def _words(text: str) -> frozenset[str]:
    return frozenset(w for w in text.lower().split() if w.isalnum() or len(w) > 2)


class NearestPromptEngine(_TextEngine):
    """A cache of ``inner``'s answers to ``prompts`` (made lazily, one per prompt, with the
    sampling parameters of the first request that needed it):
    each request gets the cached answer of the most similar prompt (Jaccard similarity of word
    sets), never a fresh run: a node that serves from a cache of public prompts."""

    def __init__(self, inner: Engine, prompts: Sequence[str]) -> None:
        super().__init__(inner)
        self.prompts = list(prompts)
        self._sets = [_words(p) for p in self.prompts]
        self._cache: dict[int, tuple[str, str]] = {}

    def nearest(self, prompt: str) -> int:
        """Index of the cached prompt most similar to ``prompt`` (itself excluded)."""
        mine = _words(prompt)

        def sim(i: int) -> float:
            if self.prompts[i] == prompt:
                return -1.0
            union = len(mine | self._sets[i])
            return len(mine & self._sets[i]) / union if union else 0.0
        return max(range(len(self.prompts)), key=sim)

    async def answer(self, prompt: str, params: SamplingParams) -> tuple[str, str]:
        key = self.nearest(prompt)
        if key not in self._cache:  # one answer per cached prompt, whatever is asked now
            done = await self.tok.complete(self.prompts[key], params)
            self._cache[key] = (done.text, done.finish_reason or FINISH_STOP)
        return self._cache[key]


class SelectiveEngine(_TextEngine):
    """``honest`` for requests ``is_challenge(prompt, params)`` flags, ``cheap`` for the rest.

    ``is_challenge`` is the node's guess (a trained classifier of the request's fields, or a
    stand-in); ``honest`` may be another node's engine (a node that forwards what it takes for
    challenges to an honest peer and serves the rest itself). Counts the requests of each kind
    in ``routed``; ``last_route`` is the last one's ("honest" or "cheap").
    """

    def __init__(self, honest: Engine, cheap: Engine, is_challenge) -> None:  # type: ignore
        super().__init__(honest)
        self.honest, self.cheap, self.is_challenge = honest, cheap, is_challenge
        self.routed = {"honest": 0, "cheap": 0}
        self.last_route = ""

    async def answer(self, prompt: str, params: SamplingParams) -> tuple[str, str]:
        flagged = bool(self.is_challenge(prompt, params))
        self.last_route = "honest" if flagged else "cheap"
        self.routed[self.last_route] += 1
        done = await (self.honest if flagged else self.cheap).complete(prompt, params)
        return done.text, done.finish_reason or FINISH_STOP


class TrustAwareEngine(SelectiveEngine):
    """Honest only while untrusted: ``honest`` for every request while :attr:`trusted` is
    False, ``cheap`` for every request while it is True (issue 18, "honest only while
    untrusted"). The node needs no classifier: its committed reputation is public (``ps-node
    status``, the directory), and while it is untrusted users used to send it nothing, so all
    it received were challenges. Whoever runs it sets :attr:`trusted` from the chain (the
    benchmark before each epoch). ``routed`` and ``last_route`` as :class:`SelectiveEngine`.
    """

    def __init__(self, honest: Engine, cheap: Engine, *, trusted: bool = True) -> None:
        super().__init__(honest, cheap, lambda prompt, params: not self.trusted)
        self.trusted = trusted


def substitute_model(path: str | os.PathLike[str], **kwargs):  # type: ignore[no-untyped-def]
    """:func:`ps_p2p.testing.substitute.substitute_model` (a distilled smaller model)."""
    from ps_p2p.testing.substitute import substitute_model as make

    return make(path, **kwargs)


__all__ = [
    "DishonestEngine",
    "FixedAnswerEngine",
    "NearestPromptEngine",
    "OtherPromptEngine",
    "SelectiveEngine",
    "TrustAwareEngine",
    "degraded_copy",
    "quantized_copy",
    "substitute_model",
]
