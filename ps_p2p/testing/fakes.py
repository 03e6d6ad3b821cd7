"""Fakes for tests and benchmarks: an engine that answers at once, or when released."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from ps_p2p.engines.base import Completion, Engine, SamplingParams, TokenScores
from ps_p2p.errors import PromptTooLongError


class InstantEngine(Engine):
    """A deterministic engine: the answer is ``reply_bytes`` characters derived from the prompt.

    Tokens are characters (so ``max_context`` counts characters). With ``gate`` set, every call
    waits until the gate event is set (to hold requests in service for overload tests).

    Args:
        model_id: announced model ID.
        reply_bytes: length of every answer (0 = echo the prompt's first 64 characters reversed).
        max_context: prompt + max_tokens limit in characters.
    """

    def __init__(
        self,
        model_id: str = "fake-model",
        *,
        reply_bytes: int = 0,
        max_context: int = 1 << 20,
        gate: trio.Event | None = None,
    ) -> None:
        self.model_id = model_id
        self.max_context = max_context
        self.reply_bytes = reply_bytes
        self.gate = gate
        self.calls = 0
        #: set when a call starts waiting at ``gate`` (a request is in service)
        self.entered = trio.Event()

    def answer_for(self, prompt: str, max_tokens: int) -> str:
        """The text this engine answers to ``prompt``."""
        if self.reply_bytes:
            return ("x" * self.reply_bytes)[: max(self.reply_bytes, 0)]
        return prompt[:64][::-1][:max_tokens]

    def _check(self, prompt: str, params: SamplingParams) -> None:
        if len(prompt) + params.max_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} "
                f"exceeds the context of {self.max_context}"
            )

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        self._check(prompt, params)
        self.calls += 1
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        text = self.answer_for(prompt, params.max_tokens)
        for i in range(0, len(text), 16):
            yield text[i : i + 16]

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        self._check(prompt, params)
        self.calls += 1
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        text = self.answer_for(prompt, params.max_tokens)
        return Completion(
            text=text,
            prompt_tokens=len(prompt),
            completion_tokens=len(text),
            finish_reason="length",
        )

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        return TokenScores(token_ids=[ord(c) for c in continuation], logprobs=[-1.0] * len(continuation))

    async def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    async def aclose(self) -> None:
        return None
