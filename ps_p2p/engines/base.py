"""The inference-engine interface of model nodes.

An :class:`Engine` serves one model. Model nodes call :meth:`Engine.complete` (or stream with
:meth:`Engine.generate`) for requests, and verifiers call :meth:`Engine.score` to rate a model
node's response by its perplexity under their own copy of the model (PlanetServe sec. 3.4): a
whole response is scored in one forward pass, not one engine call per token.

Two implementations: :class:`~ps_p2p.engines.transformers_engine.TransformersEngine` (in-process,
CPU or GPU, off the trio thread) and :class:`~ps_p2p.engines.vllm_engine.VLLMEngine` (a
``vllm serve`` process over HTTP). :class:`~ps_p2p.testing.fakes.InstantEngine` is the test fake.

Besides the required text-level methods, an engine may offer a token-level API
(:meth:`Engine.encode`, :meth:`Engine.decode`, :meth:`Engine.score_ids`, :meth:`Engine.stream`);
the defaults here raise :class:`~ps_p2p.errors.EngineError` or approximate from the text-level
methods. The fake vLLM server (:mod:`ps_p2p.testing.fake_vllm`) needs it for token-ID prompts and
``prompt_logprobs``.

Errors: :class:`~ps_p2p.errors.PromptTooLongError` when the prompt leaves no room for one token
in the context window; a ``max_tokens`` that overflows it is cut to what fits, the answer then
ending with ``finish_reason`` "length" (what a vLLM server >= 0.32 does, and the transformers
engine and the sim engine do the same: see :mod:`~ps_p2p.engines.vllm_engine`; the test fake
:class:`~ps_p2p.testing.fakes.InstantEngine` still refuses an overflow);
:class:`~ps_p2p.errors.EngineParameterError` (also a ``ValueError``) for a parameter the engine
refuses whatever the prompt, such as ``max_tokens`` above the whole context window;
:class:`~ps_p2p.errors.EngineError` for every other failure of the engine.

KV-cache state: an engine with a prefix cache reports which prompt-prefix blocks it holds as
KV-cache events (:mod:`ps_p2p.engines.kv_events`), drained with :meth:`Engine.drain_kv_events`,
for the model node's HR-tree (PlanetServe sec. 3.3); :attr:`Engine.kv_block_size` is then its
tokens per block. The defaults here say "no prefix cache".

Chats: :meth:`Engine.chat_prompt` turns :class:`ChatMessage` lists into a prompt with the model's
chat template, or :func:`default_chat_prompt` for a model without one.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ps_p2p.engines.kv_events import KVCacheEvent
from ps_p2p.errors import EngineError
from ps_p2p.inference import ChatMessage  # noqa: F401  (re-exported: engines render chats)

#: finish reasons, as OpenAI's and vLLM's APIs spell them
FINISH_STOP = "stop"  # the model emitted an end-of-sequence token
FINISH_LENGTH = "length"  # max_tokens reached

#: Chat roles a request may use (OpenAI's chat completions API).
CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})

_MAX_SEED = 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        max_tokens: most tokens to generate, >= 1.
        temperature: >= 0; 0 means greedy (argmax), deterministic.
        top_p: nucleus sampling mass in (0, 1]; 1 keeps the whole distribution.
        seed: seeds the sampler when temperature > 0 (same seed, same prompt, same engine: same
            text); None draws a fresh seed. In [0, 2**64).

    Raises:
        ValueError: a value out of its range.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, not {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number, not {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int or None, not {self.seed!r}")
            if not 0 <= self.seed < _MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**64), not {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0)."""
        return self.temperature == 0


@dataclass
class Completion:
    """A finished generation.

    Attributes:
        text: the generated text (without the prompt, without the end-of-sequence token).
        prompt_tokens: tokens in the prompt, special tokens (BOS) included.
        completion_tokens: tokens generated (an end-of-sequence token is not counted).
        finish_reason: ``"stop"`` (end of sequence) or ``"length"`` (max_tokens reached, or the
            context window full); a vLLM server may also say ``"repetition"``.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass
class StreamChunk:
    """One piece of a streamed generation (see :meth:`Engine.stream`).

    Attributes:
        text: the new text; may be "" on the last chunk.
        finish_reason: None except on the last chunk, where it is ``"stop"`` or ``"length"``.
        prompt_tokens, completion_tokens: set on the last chunk when the engine knows them.
    """

    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def default_chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The prompt for a model without a chat template: one ``"<Role>: <content>"`` line per
    message (roles capitalised, e.g. ``"User: hi"``), then ``"Assistant:"`` for the answer.

    A plain transcript is what a base model continues best; it is documented in
    ``docs/api.md`` so clients know what the model sees.
    """
    lines = [f"{m.role.capitalize()}: {m.content}" for m in messages]
    lines.append("Assistant:")
    return "\n".join(lines)


async def stop_at(chunks: AsyncIterator[StreamChunk], stop: Sequence[str]) -> AsyncIterator[StreamChunk]:
    """Cut a stream at the first of the ``stop`` strings, as OpenAI's ``stop`` parameter does.

    The stop string itself is not returned, and the last chunk then says ``"stop"``. Text that
    could be the start of a stop string is held back until it is known not to be one, so
    nothing past a stop string is ever yielded. Closing the source stream (leaving the loop)
    stops its generation. Without ``stop`` the chunks pass through unchanged.

    Token counts on the last chunk are those of the whole generation (the engine's), which may
    include tokens past the stop string when it ended inside a token.
    """
    if not stop:
        async for chunk in chunks:
            yield chunk
        return
    longest = max(len(s) for s in stop)
    pending = ""
    try:
        async for chunk in chunks:
            pending += chunk.text
            cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                yield StreamChunk(
                    pending[:cut], finish_reason=FINISH_STOP,
                    prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                )
                return
            if chunk.finish_reason is not None:
                yield StreamChunk(
                    pending, finish_reason=chunk.finish_reason,
                    prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                )
                return
            keep = min(len(pending), longest - 1)
            if len(pending) > keep:
                yield StreamChunk(pending[: len(pending) - keep])
                pending = pending[len(pending) - keep:]
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    if pending:
        yield StreamChunk(pending, finish_reason=FINISH_STOP)


@dataclass
class TokenScores:
    """Log-probabilities of given tokens under the model.

    Attributes:
        token_ids: the scored tokens.
        logprobs: natural-log probability of each token given everything before it (<= 0).
        ranks: optional, 1-based rank of each token in the model's distribution (1 = argmax).
        top_logprobs: optional, per position the ``top_k`` most likely tokens -> logprob.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int] | None = None
    top_logprobs: list[dict[int, float]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"{len(self.token_ids)} token IDs but {len(self.logprobs)} logprobs"
            )

    @property
    def mean_logprob(self) -> float:
        """Mean log-probability per token; -inf for no tokens."""
        if not self.logprobs:
            return -math.inf
        return math.fsum(self.logprobs) / len(self.logprobs)

    @property
    def perplexity(self) -> float:
        """exp(-mean logprob): 1 for a certain text, larger for a less likely one.

        No tokens give ``inf``, so an empty answer scores 1/PPL = 0 (PlanetServe sec. 3.4).
        """
        mean = self.mean_logprob
        if mean == -math.inf:
            return math.inf
        return math.exp(-mean)


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Raise ValueError unless ``messages`` is non-empty and every role is in :data:`CHAT_ROLES`."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    for m in messages:
        if m.role not in CHAT_ROLES:
            raise ValueError(f"unknown chat role {m.role!r}")


class Engine(abc.ABC):
    """An inference engine serving one model. See the module docstring.

    Subclasses set ``model_id`` and ``max_context`` in their ``__init__`` (no call to
    ``Engine.__init__`` is needed) and implement :meth:`generate`, :meth:`score`,
    :meth:`tokenize` and :meth:`aclose`. Methods are safe to call from concurrent trio tasks.
    An engine is an async context manager that closes itself on exit.

    Attributes:
        model_id: the model ID announced in the node record and matched against requests.
        max_context: context window in tokens (prompt + generated); 0 when not known yet.
    """

    model_id: str
    max_context: int

    @abc.abstractmethod
    def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        """Stream the continuation of ``prompt`` as text pieces (an async generator).

        The concatenated pieces equal ``(await complete(prompt, params)).text`` for greedy or
        seeded sampling. Breaking out of the loop or cancelling stops generation within a token.

        Raises:
            PromptTooLongError: prompt tokens + ``params.max_tokens`` > ``max_context`` (raised
                on the first iteration, before any piece); with vLLM, only a prompt that leaves
                no room for one token (the server cuts ``max_tokens`` otherwise).
            EngineParameterError: a parameter the engine refuses (vLLM: ``max_tokens`` >
                ``max_model_len``).
            EngineError: the engine failed.
        """

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        """Like :meth:`generate`, with the finish reason and token counts on the last chunk.

        This default wraps :meth:`generate`; it cannot tell ``"length"`` from ``"stop"`` and
        says ``"stop"`` without token counts. Engines that know better override it.
        """
        async for piece in self.generate(prompt, params):
            yield StreamChunk(piece)
        yield StreamChunk("", finish_reason=FINISH_STOP)

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        """Generate the whole continuation of ``prompt``.

        This default collects :meth:`stream`; when the engine gives no token counts they are
        estimated with :meth:`tokenize`.

        Raises:
            PromptTooLongError: prompt tokens + ``params.max_tokens`` > ``max_context``.
            EngineError: the engine failed.
        """
        pieces: list[str] = []
        last = StreamChunk("")
        async for chunk in self.stream(prompt, params):
            pieces.append(chunk.text)
            last = chunk
        text = "".join(pieces)
        prompt_tokens = last.prompt_tokens
        if prompt_tokens is None:
            prompt_tokens = len(await self.tokenize(prompt))
        completion_tokens = last.completion_tokens
        if completion_tokens is None and text:
            try:
                completion_tokens = len(await self.encode(text, add_special_tokens=False))
            except EngineError:
                completion_tokens = len(await self.tokenize(text))
        return Completion(
            text, prompt_tokens, completion_tokens or 0, last.finish_reason or FINISH_STOP
        )

    @abc.abstractmethod
    async def score(self, prompt: str, continuation: str) -> TokenScores:
        """Log-probabilities of ``continuation``'s tokens given ``prompt``, in one forward pass.

        The scored tokens are ``tokenize(continuation)`` without special tokens, appended to
        the prompt's tokens (BOS included); so the result does not depend on how the text of
        prompt + continuation would have been split as one string.

        Raises:
            PromptTooLongError: prompt + continuation exceed ``max_context``.
            EngineError: the engine failed.
        """

    @abc.abstractmethod
    async def tokenize(self, text: str) -> list[int]:
        """Token IDs of ``text`` as a prompt (special tokens such as BOS included)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the model, connections and threads; the engine is unusable afterwards."""

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text for a chat: the model's chat template with the generation prompt
        when it has one, else :func:`default_chat_prompt`. This default always uses the latter.

        The text is meant for :meth:`complete` / :meth:`stream`, which add the tokenizer's
        special tokens (BOS) themselves: engines leave a template's leading BOS out of it.

        Raises:
            ValueError: no messages, or a role outside :data:`CHAT_ROLES`.
            EngineError: the template failed to render.
        """
        check_messages(messages)
        return default_chat_prompt(messages)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (Jinja source) when this engine holds it, else None.

        None also when the template is applied elsewhere (a vLLM server renders its own); the
        fake vLLM server reads it to answer chat requests as a server without a template would.
        """
        return None

    # -- optional KV-cache state -----------------------------------------------------------

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per block of this engine's prefix cache; None when it has none (this default)."""
        return None

    def drain_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first; [] when there are none.

        Applied in order to an empty view, the events of all calls since the engine started give
        the blocks its prefix cache holds now (an engine whose event buffer overflowed sends
        ``AllBlocksCleared`` and its whole contents again: :mod:`~ps_p2p.engines.prefix_cache`).
        Non-blocking; safe to call from the trio thread while requests run. This default: an
        engine without a prefix cache, always [].
        """
        return []

    # -- optional token-level API ---------------------------------------------------------

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token IDs of ``text``; without special tokens when ``add_special_tokens`` is False.

        Raises:
            EngineError: this engine cannot tokenize without special tokens.
        """
        if add_special_tokens:
            return await self.tokenize(text)
        raise EngineError(f"{type(self).__name__} has no token-level API (encode)")

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped.

        Raises:
            EngineError: this engine has no token-level API, or an ID is out of the vocabulary.
        """
        raise EngineError(f"{type(self).__name__} has no token-level API (decode)")

    async def score_ids(
        self, token_ids: Sequence[int], start: int, *, top_k: int = 0
    ) -> TokenScores:
        """Log-probabilities of ``token_ids[start:]``, each given all tokens before it.

        One forward pass over ``token_ids``. ``ranks`` is always set; ``top_logprobs`` when
        ``top_k`` > 0.

        Args:
            token_ids: the whole sequence (prompt tokens first, BOS included).
            start: index of the first scored token, >= 1 (the first token has no context).
            top_k: how many most likely alternatives to report per position (0: none).

        Raises:
            ValueError: ``start`` out of [1, len(token_ids)], or ``top_k`` < 0.
            PromptTooLongError: more tokens than ``max_context``.
            EngineError: this engine has no token-level API, or it failed.
        """
        raise EngineError(f"{type(self).__name__} has no token-level API (score_ids)")

    async def logprob_rows(
        self, sequences: Sequence[tuple[Sequence[int], int]]
    ) -> list[Any]:
        """The model's whole next-token distribution at every scored position, for several
        sequences (the challenge scorer's input: :mod:`ps_p2p.verification.scoring`).

        For each ``(token_ids, start)``: a float64 numpy array of shape
        ``(len(token_ids) - start + 1, vocab)``, row i the natural-log softmax of the logits
        that predict ``token_ids[start + i]``; the last row predicts the token after the
        sequence (where an end-of-sequence would come). An engine may batch the sequences'
        forward passes (the rows then differ only in float rounding).

        Raises:
            ValueError: a ``start`` out of [1, len(token_ids)].
            PromptTooLongError: a sequence longer than ``max_context``.
            EngineError: this engine has no token-level API, or it failed.
        """
        raise EngineError(f"{type(self).__name__} has no token-level API (logprob_rows)")

    @property
    def end_token_ids(self) -> frozenset[int]:
        """Token IDs that end a generation (end-of-sequence); empty when unknown."""
        return frozenset()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
