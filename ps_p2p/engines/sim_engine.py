"""The simulated engine (``--engine sim``): a GPU's latencies without a model.

:class:`SimEngine` answers every request with deterministic dummy text of exactly ``max_tokens``
tokens (finish reason ``"length"``), after sleeping as long as the cost model of
:mod:`ps_p2p.engines.sim_cost` says a real engine would take: the prefill of the prompt tokens its
prefix cache misses, then one decode step per token at the current batch size. It has a real
prefix-cache index (:class:`~ps_p2p.engines.prefix_cache.PrefixCacheIndex`, no payloads) and
reports it as KV-cache events, like the transformers engine, so the model node's HR-tree and
overlay forwarding see the same cache state they would see on a GPU.

Scheduling: at most ``max_batch`` requests run at once (later ones wait, first come first
served); a running request does its prefill, stores its prompt's full blocks in the prefix cache,
then decodes, each step taking :meth:`~ps_p2p.engines.sim_cost.SimCostModel.step_seconds` of the
number of requests running at that moment. Prefills do not slow other requests' decode steps
(vLLM's chunked prefill mixes them; the simplification is deliberate).

Time: every wait is a ``trio.sleep``, so under ``trio.testing.MockClock(autojump_threshold=0)``
a test runs in no real time and reads exact durations with ``trio.current_time()``.

Scoring: :meth:`SimEngine.score` raises :class:`~ps_p2p.errors.EngineError`: a made-up score
would let a verifier rate a model node with no model behind it; the sim engine is for model
nodes only.

Tokens: :func:`~ps_p2p.engines.sim_cost.encode` (3 UTF-8 bytes a token, BOS first); token-ID
prompts go to :meth:`SimEngine.stream_ids`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import trio

from ps_p2p.engines import sim_cost
from ps_p2p.engines.base import (
    FINISH_LENGTH,
    Engine,
    SamplingParams,
    StreamChunk,
    TokenScores,
)
from ps_p2p.engines.kv_events import KVCacheEvent
from ps_p2p.engines.prefix_cache import PrefixCacheIndex
from ps_p2p.engines.sim_cost import SimCostModel, SimParams, SimTiming
from ps_p2p.errors import EngineError, EngineParameterError, PromptTooLongError

__all__ = ["SimCostModel", "SimEngine", "SimParams", "SimTiming"]


class SimEngine(Engine):
    """An engine that spends a modelled GPU's time and answers dummy text. See the module docstring.

    Args:
        model_id: announced model ID.
        params: cost model and cache parameters (default: Llama 3 8B on an A6000, estimates).

    Attributes:
        params, cost: the parameters and their cost model.
        running: requests in prefill or decode now (the batch).
        waiting: requests waiting for a slot.
        prompt_tokens_prefilled: prompt tokens computed (charged prefill time) since start.
        prompt_tokens_cached: prompt tokens found in the prefix cache instead.
        tokens_generated: output tokens since start.
    """

    def __init__(self, model_id: str = "sim", params: SimParams | None = None) -> None:
        self.params = params or SimParams()
        self.cost = SimCostModel(self.params)
        self.model_id = model_id
        self.max_context = self.params.max_context
        self.running = 0
        self.waiting = 0
        self.prompt_tokens_prefilled = 0
        self.prompt_tokens_cached = 0
        self.tokens_generated = 0
        self._slots = trio.Semaphore(self.params.max_batch)
        self._prefix: PrefixCacheIndex[None] = PrefixCacheIndex(
            self.params.cache_blocks, self.params.block_size
        )
        self._closed = False

    # -- generation -----------------------------------------------------------------------

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        async for chunk in self.stream(prompt, params):
            if chunk.text:
                yield chunk.text

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        """One chunk per token; the last carries ``"length"`` and the token counts.

        Raises:
            PromptTooLongError: the prompt leaves no room in ``max_context`` (a ``max_tokens``
                beyond the room is cut to it, as vLLM does).
            EngineParameterError: ``max_tokens`` > ``max_context``.
            EngineError: the engine is closed.
        """
        self._check_open()
        async for chunk in self.stream_ids(sim_cost.encode(prompt), params):
            yield chunk

    async def stream_ids(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[StreamChunk]:
        """:meth:`stream` of a prompt given as token IDs (BOS included if wanted).

        Raises:
            PromptTooLongError: ``len(prompt_ids)`` >= ``max_context`` (a ``max_tokens`` beyond
                the room left is cut to it, as vLLM does).
            EngineParameterError: ``max_tokens`` > ``max_context``.
            EngineError: the engine is closed, no prompt tokens, or an ID outside the sim
                vocabulary (:data:`~ps_p2p.engines.sim_cost.MAX_TOKEN_ID`).
        """
        self._check_open()
        if not prompt_ids:
            raise EngineError("the sim engine needs at least one prompt token")
        # first: bounds the work below. Like a vLLM server >= 0.32 (and the other engines), an
        # overflowing max_tokens is cut to the room the prompt leaves
        if params.max_tokens > self.max_context:
            raise EngineParameterError(
                f"max_tokens={params.max_tokens} cannot be greater than the context of "
                f"{self.max_context} tokens of {self.model_id}")
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                f"{self.max_context} tokens of {self.model_id}")
        max_tokens = min(params.max_tokens, self.max_context - len(prompt_ids))
        ids = self._check_ids(prompt_ids)
        seed = 0 if params.greedy or params.seed is None else params.seed
        pieces = sim_cost.dummy_text(ids, max_tokens, seed)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            match = self._prefix.lookup(ids, max_blocks=(len(ids) - 1) // self.params.block_size)
            uncached = len(ids) - match.tokens
            self.prompt_tokens_cached += match.tokens
            self.prompt_tokens_prefilled += uncached
            await trio.sleep(self.cost.prefill_seconds(uncached))
            self._check_open()
            self._prefix.store(ids, _no_payload)
            for i, piece in enumerate(pieces):
                await trio.sleep(self.cost.step_seconds(self.running))
                self.tokens_generated += 1
                if i + 1 < len(pieces):
                    yield StreamChunk(piece)
                else:
                    yield StreamChunk(
                        piece, finish_reason=FINISH_LENGTH, prompt_tokens=len(ids),
                        completion_tokens=len(pieces),
                    )
        finally:
            self.running -= 1
            self._slots.release()

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        """Always raises: the sim engine has no model to score with (module docstring).

        Raises:
            EngineError: always.
        """
        raise EngineError(f"{self.model_id}: the sim engine has no model and cannot score text")

    # -- tokens ---------------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        self._check_open()
        return sim_cost.encode(text)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._check_open()
        return sim_cost.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (see :func:`~ps_p2p.engines.sim_cost.decode`).

        Raises:
            EngineError: an ID outside the sim vocabulary, or the engine is closed.
        """
        self._check_open()
        return sim_cost.decode(token_ids)

    # -- prefix cache ---------------------------------------------------------------------

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per prefix-cache block; None when ``cache_blocks`` is 0."""
        return self.params.block_size if self.params.cache_blocks else None

    def drain_kv_events(self) -> list[KVCacheEvent]:
        """See :meth:`Engine.drain_kv_events` (everything runs on the trio thread)."""
        return self._prefix.drain_events()

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (emits ``AllBlocksCleared``)."""
        self._prefix.clear()

    async def aclose(self) -> None:
        """Close: later calls raise EngineError; requests in prefill stop after it; the cache is
        cleared (its ``AllBlocksCleared`` can still be drained)."""
        if not self._closed:
            self._closed = True
            self._prefix.clear()

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"engine of {self.model_id} is closed")

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = list(token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= sim_cost.MAX_TOKEN_ID:
                raise EngineError(
                    f"token ID {t!r} is out of the sim vocabulary [0, {sim_cost.MAX_TOKEN_ID}]"
                )
        return ids


def _no_payload(_block: int) -> None:
    return None
