"""In-process inference with Hugging Face transformers, on CPU or GPU, off the trio thread.

:class:`TransformersEngine` loads a Hugging Face model folder (``config.json``, weights,
tokenizer files; local files only, never the hub) or a single ``.gguf`` file, and serves it:

* every forward pass runs in a worker thread (``trio.to_thread.run_sync``); one ``trio.Lock``
  serialises use of the model, so concurrent requests take turns token by token (streams) or
  request by request (:meth:`~TransformersEngine.complete`);
* decoding is our own loop over the KV cache: greedy at temperature 0, otherwise temperature +
  top-p (nucleus) sampling with a CPU ``torch.Generator`` seeded by ``SamplingParams.seed``, so a
  seeded sample is the same on CPU and GPU, and streamed and non-streamed text are identical;
* text is detokenized incrementally (a window of a few tokens, as vLLM does), so pieces keep
  their leading spaces and never split a multi-byte character;
* :meth:`~TransformersEngine.score` is one forward pass over prompt + continuation tokens;
  :meth:`~TransformersEngine.logprob_rows` (the challenge scorer's) runs a prefix shared by
  several sequences once and the rest in right-padded batches of similar lengths;
* :meth:`~TransformersEngine.complete_batch` decodes many requests together (one pass per
  token for all: ~3x less CPU for 60 requests of stories260K), each sampled with its own
  generator, so the answers are those of :meth:`~TransformersEngine.complete` (a batched
  matrix product may round differently, so a near-tie could go the other way: 0 of 60 test
  answers differed);
* :meth:`~TransformersEngine.chat_prompt` renders the tokenizer's chat template (or the default
  chat prompt when it has none);
* a prefix cache (:mod:`~ps_p2p.engines.prefix_cache`) keeps the key/value tensors of recent
  prompts' full blocks of ``block_size`` tokens: a prompt that starts with cached blocks reuses
  their key/values and prefills only the rest (at least its last token, whose logits pick the
  first generated token), then caches its own new full blocks. Each block's payload is, per
  layer, the ``(key, value)`` slices of its positions (``[1, kv_heads, block_size, head_dim]``
  each, on the model's device): ``2 * layers * kv_heads * head_dim * block_size`` numbers a block
  (stories260K, float32: 10 KiB; an 8B Llama in float16: 2 MiB). The cache changes are reported
  as KV-cache events (:meth:`~TransformersEngine.drain_kv_events`). Only prompt tokens are cached,
  not generated ones; :meth:`~TransformersEngine.score` does not use the cache (as vLLM skips it
  for ``prompt_logprobs``). Models whose cache is not a plain per-layer key/value cache (sliding
  windows, linear attention) run without it.

Cancellation: a cancelled stream stops before its next token; a cancelled ``complete`` sets a
flag that the worker thread checks between tokens, and is waited for (at most one token).

GGUF: with ``accelerate`` installed, transformers' own ``gguf_file=`` loader is tried first. Without
it (transformers refuses GGUF then), or when that fails, the file's tensors are dequantized with
transformers' GGUF reader into a model built from the file's config. The tokenizer comes from
transformers' GGUF support too; files whose special-token IDs are out of range (llama.cpp writes
``2**32 - 1`` for "none", which transformers 5.x rejects) are sanitized first.

``HF_HUB_OFFLINE`` is set to 1 (unless set) before transformers is imported: model nodes never
download anything.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import threading  # noqa: E402
from collections.abc import AsyncIterator, Callable, Iterator, Sequence  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
import trio  # noqa: E402

from ps_p2p.engines.base import (  # noqa: E402
    FINISH_LENGTH,
    FINISH_STOP,
    ChatMessage,
    Completion,
    Engine,
    SamplingParams,
    StreamChunk,
    TokenScores,
    check_messages,
    default_chat_prompt,
)
from ps_p2p.engines.kv_events import KVCacheEvent  # noqa: E402
from ps_p2p.engines.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCacheIndex  # noqa: E402
from ps_p2p.errors import EngineError, EngineParameterError, PromptTooLongError  # noqa: E402

log = logging.getLogger(__name__)

T = TypeVar("T")

#: prompt tokens kept as left context when detokenizing generated tokens (vLLM uses 5)
DETOKENIZE_CONTEXT_TOKENS = 5
#: positions per log_softmax slice in score_ids (bounds memory at about this many x vocab floats)
SCORE_CHUNK_POSITIONS = 512
#: most logits (sequences x padded length x vocab) one batched forward pass of logprob_rows
#: makes (float32: 64 MiB); a sequence alone may exceed it
ROWS_BATCH_ELEMENTS = 1 << 24
#: most padded positions per real one in such a batch (attention grows with the padded length)
ROWS_BATCH_PADDING = 1.25
#: shortest prefix (tokens before ``start``) that logprob_rows computes once for all the
#: sequences that share it (a challenge prompt and its answers)
ROWS_SHARED_PREFIX = 16
#: the context window assumed when a model's config names none
DEFAULT_CONTEXT = 2048
#: blocks the prefix cache holds by default (4,096 tokens of 16; an 8B Llama in float16: 512 MiB)
DEFAULT_PREFIX_CACHE_BLOCKS = 256

#: one block's payload: per layer, (key, value) of the block's positions
_BlockKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]

_CONTEXT_KEYS = (
    "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
)


class TransformersEngine(Engine):
    """A causal LM served in-process with transformers. Build with :meth:`load`.

    Args:
        model: a loaded ``PreTrainedModel`` (causal LM), already on ``device`` and in eval mode.
        tokenizer: its tokenizer (a fast tokenizer).
        model_id: announced model ID.
        max_context: context window in tokens (prompt + generated).
        prefix_cache_blocks: blocks of the prefix cache (module docstring), >= 0; 0 disables it.
        block_size: tokens per cached block.

    Attributes:
        model, tokenizer: the loaded model and tokenizer (tests compare against them).
        device: the torch device the model runs on.
        tokens_generated: tokens generated since loading (all requests).
        prompt_tokens_prefilled: prompt tokens run through the model since loading.
        prompt_tokens_cached: prompt tokens whose key/values came from the prefix cache instead.

    Raises:
        ConfigError: ``prefix_cache_blocks`` or ``block_size`` out of range.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        max_context: int,
        prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_context = max_context
        self.device = next(model.parameters()).device
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.tokens_generated = 0
        self.prompt_tokens_prefilled = 0
        self.prompt_tokens_cached = 0
        self._lock = trio.Lock()
        self._closed = False
        if prefix_cache_blocks and not _plain_kv_cache(model):
            log.warning(
                "%s: the model's KV cache is not a plain per-layer key/value cache; "
                "running without a prefix cache", model_id,
            )
            prefix_cache_blocks = 0
        # the index is touched by the worker thread (lookup, store) and by the trio thread
        # (drain, clear): every use holds _cache_lock, briefly
        self._cache_lock = threading.Lock()
        self._prefix: PrefixCacheIndex[_BlockKV] = PrefixCacheIndex(
            prefix_cache_blocks, block_size
        )
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._logits_to_keep = "logits_to_keep" in params
        #: the KV cache's argument and output name: ``cache`` since transformers 5.x (which
        #: warns, FutureWarning, on ``past_key_values``), ``past_key_values`` before
        self._cache_name = "cache" if "cache" in params else "past_key_values"
        #: complete_batch can join per-request key/values (a plain per-layer cache)
        self._batchable = _plain_kv_cache(model)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        model_id: str | None = None,
        dtype: str | torch.dtype | None = None,
        cpu_threads: int | None = None,
        prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> TransformersEngine:
        """Load a model folder or ``.gguf`` file onto ``device`` (blocking: seconds to minutes).

        Args:
            path: a Hugging Face model folder (with ``config.json``) or a ``.gguf`` file.
            device: a torch device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``...
            model_id: announced model ID; defaults to the folder name or the file's stem.
            dtype: weights dtype (``"float16"``, ``"bfloat16"``, ``torch.float32``...); None keeps
                transformers' default for the checkpoint.
            cpu_threads: torch's intra-op threads on a CPU device (process-wide). None: one
                core fewer than the machine has (at least 1), unless ``OMP_NUM_THREADS`` says
                otherwise: the node's own event loop (relaying, signing, S-IDA) needs a core,
                and torch's threads spinning on every core slowed streamed answers 40-fold on a
                2-core machine (benchmarks/README.md, "API").
            prefix_cache_blocks: blocks of the prefix cache (0: none); see the module docstring.
            block_size: tokens per cached block.

        Raises:
            EngineError: no model at ``path``, unknown or unavailable device, or loading failed.
            ConfigError: ``prefix_cache_blocks`` or ``block_size`` out of range.
        """
        p = pathlib.Path(path)
        torch_device = _torch_device(device)
        if torch_device.type == "cpu":
            _set_cpu_threads(cpu_threads)
        if isinstance(dtype, str) and dtype != "auto":
            resolved = getattr(torch, dtype, None)
            if not isinstance(resolved, torch.dtype):
                raise EngineError(f"unknown dtype {dtype!r}")
            dtype = resolved
        if p.is_file() and p.suffix.lower() == ".gguf":
            model, tokenizer = _load_gguf(p, dtype)
            default_id = p.stem
        elif p.is_dir() and (p / "config.json").is_file():
            model, tokenizer = _load_folder(p, dtype)
            default_id = p.name
        elif p.exists():
            raise EngineError(f"{p} is neither a model folder with config.json nor a .gguf file")
        else:
            raise EngineError(f"no model at {p}")
        try:
            model.to(torch_device)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, AssertionError...
            raise EngineError(f"cannot move the model to {device}: {exc}") from exc
        model.eval()
        engine = cls(
            model,
            tokenizer,
            model_id=model_id or default_id,
            max_context=_context_window(model.config),
            prefix_cache_blocks=prefix_cache_blocks,
            block_size=block_size,
        )
        log.info(
            "loaded %s from %s on %s (%d parameters, context %d)",
            engine.model_id, p, torch_device, sum(t.numel() for t in model.parameters()),
            engine.max_context,
        )
        return engine

    @classmethod
    async def load_async(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        model_id: str | None = None,
        dtype: str | torch.dtype | None = None,
        prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
    ) -> TransformersEngine:
        """:meth:`load` in a worker thread, so the trio loop keeps running meanwhile."""
        load = functools.partial(
            cls.load, path, device=device, model_id=model_id, dtype=dtype,
            prefix_cache_blocks=prefix_cache_blocks,
        )
        return await trio.to_thread.run_sync(load)

    # -- text-level API -------------------------------------------------------------------

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        async for chunk in self.stream(prompt, params):
            if chunk.text:
                yield chunk.text

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        """Stream the continuation of ``prompt``; one forward pass per worker-thread call.

        The lock is taken per token, so concurrent streams interleave; nothing runs between
        two iterations, and a stream that is cancelled or dropped costs nothing further.
        Chunks with no new text (an incomplete UTF-8 character) are not yielded; the last chunk
        carries the finish reason and token counts.

        Raises:
            PromptTooLongError, EngineError: see :meth:`Engine.generate`.
        """
        prompt_ids, generation = self._start(prompt, params)
        try:
            while generation.finish_reason is None:
                async with self._lock:
                    self._check_open()
                    piece = await self._in_thread(generation.step)
                if generation.finish_reason is not None:
                    yield StreamChunk(
                        piece,
                        finish_reason=generation.finish_reason,
                        prompt_tokens=len(prompt_ids),
                        completion_tokens=len(generation.token_ids),
                    )
                elif piece:
                    yield StreamChunk(piece)
        finally:
            generation.release()

    def _start(self, prompt: str, params: SamplingParams) -> tuple[list[int], "_Generation"]:
        """Tokenize ``prompt``, check it fits, and set up a generation (release it when done).

        Raises:
            PromptTooLongError, EngineError.
        """
        self._check_open()
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = self._fit(len(prompt_ids), params.max_tokens)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return prompt_ids, _Generation(self, prompt_ids, params)

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        """Generate the whole continuation in one worker-thread call (holding the lock).

        Raises:
            PromptTooLongError, EngineError: see :meth:`Engine.complete`.
        """
        prompt_ids, generation = self._start(prompt, params)
        try:
            async with self._lock:
                self._check_open()
                text = await self._in_thread_interruptible(generation.run)
        finally:
            generation.release()
        assert generation.finish_reason is not None  # run() only returns early when cancelled
        return Completion(
            text=text,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(generation.token_ids),
            finish_reason=generation.finish_reason,
        )

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        """See :meth:`Engine.score`; an empty continuation gives empty scores.

        Raises:
            PromptTooLongError: prompt + continuation tokens > ``max_context``.
            EngineError: an empty prompt and a tokenizer without BOS (the first continuation
                token would have no context), or the forward pass failed.
        """
        self._check_open()
        prompt_ids = self._prompt_ids(prompt)
        continuation_ids = self._encode(continuation, add_special_tokens=False)
        if not continuation_ids:
            return TokenScores([], [], ranks=[])
        return await self.score_ids(prompt_ids + continuation_ids, len(prompt_ids))

    async def tokenize(self, text: str) -> list[int]:
        self._check_open()
        return self._encode(text, add_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's ``chat_template`` (None or "" when the model has none: None)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) and template else None

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The tokenizer's chat template rendered with ``add_generation_prompt=True``
        (``apply_chat_template(..., tokenize=False)``), or :func:`default_chat_prompt` when the
        tokenizer has no ``chat_template`` (stories260K has none).

        A template usually starts with ``{{ bos_token }}``; when the tokenizer adds BOS itself
        (as :meth:`complete` does), that leading BOS text is dropped, so the model sees one BOS,
        as vLLM's chat completions (which tokenize the rendered text without special tokens).

        Raises:
            ValueError: no messages, or a role outside :data:`CHAT_ROLES`.
            EngineError: the template failed to render (a syntax error, ``raise_exception``
                for a conversation it does not accept), or the engine is closed.
        """
        check_messages(messages)
        self._check_open()
        template = self.chat_template
        if template is None:
            return default_chat_prompt(messages)
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # noqa: BLE001 - jinja2 TemplateError, ValueError, KeyError...
            raise EngineError(
                f"chat template of {self.model_id} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise EngineError(
                f"chat template of {self.model_id} gave {type(text).__name__}, not text"
            )
        bos = self.tokenizer.bos_token
        if isinstance(bos, str) and bos and text.startswith(bos) and self._adds_bos():
            text = text[len(bos):]
        return text

    async def aclose(self) -> None:
        """Free the model and the prefix cache (waits for a forward pass in progress); later
        calls raise EngineError. The cache's ``AllBlocksCleared`` can still be drained."""
        if self._closed:
            return
        async with self._lock:
            self._closed = True
            on_cuda = self.device.type == "cuda"
            self.model = None
            self.reset_prefix_cache()
            if on_cuda:
                torch.cuda.empty_cache()

    # -- prefix cache ---------------------------------------------------------------------

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per prefix-cache block; None when the cache is disabled."""
        return self._prefix.block_size if self._prefix.capacity else None

    @property
    def prefix_cache_blocks(self) -> int:
        """Capacity of the prefix cache in blocks (0: disabled)."""
        return self._prefix.capacity

    def drain_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's events since the last call (see :meth:`Engine.drain_kv_events`
        and :mod:`~ps_p2p.engines.prefix_cache`); safe while a generation runs."""
        with self._cache_lock:
            return self._prefix.drain_events()

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (emits ``AllBlocksCleared``); generations in progress keep
        their own key/values."""
        with self._cache_lock:
            self._prefix.clear()

    def _cached_prefix(self, prompt_ids: list[int]) -> tuple[Any, int]:
        """``(past_key_values, cached tokens)`` of the longest cached block prefix of the prompt,
        leaving at least its last token to compute; ``(None, 0)`` on a miss. Worker thread."""
        if not self._prefix.capacity:
            return None, 0
        with self._cache_lock:
            match = self._prefix.lookup(
                prompt_ids, max_blocks=(len(prompt_ids) - 1) // self._prefix.block_size
            )
        if not match.blocks:
            return None, 0
        layers = [
            (
                torch.cat([block[i][0] for block in match.payloads], dim=-2),
                torch.cat([block[i][1] for block in match.payloads], dim=-2),
            )
            for i in range(len(match.payloads[0]))
        ]
        return _cache_from_layers(self.model, layers), match.tokens

    def _store_prefix(self, prompt_ids: list[int], past: Any) -> None:
        """Cache the prompt's full blocks from the key/values after its prefill. Worker thread."""
        size = self._prefix.block_size
        if not self._prefix.capacity or len(prompt_ids) < size:
            return
        layers = _cache_layers(past)

        def payload(i: int) -> _BlockKV:
            lo, hi = i * size, (i + 1) * size
            # clones: a view would keep the whole prompt's tensors alive
            return tuple((k[..., lo:hi, :].clone(), v[..., lo:hi, :].clone()) for k, v in layers)

        with self._cache_lock:
            self._prefix.store(prompt_ids, payload)

    # -- token-level API ------------------------------------------------------------------

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._check_open()
        return self._encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: Sequence[int]) -> str:
        self._check_open()
        ids = self._check_ids(token_ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    async def score_ids(
        self, token_ids: Sequence[int], start: int, *, top_k: int = 0
    ) -> TokenScores:
        """See :meth:`Engine.score_ids`; one forward pass in the worker thread."""
        self._check_open()
        ids = self._check_ids(token_ids)
        if not 1 <= start <= len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}], not {start}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {top_k}")
        if len(ids) > self.max_context:
            raise PromptTooLongError(
                f"{len(ids)} tokens exceed the context of {self.max_context} tokens of "
                f"{self.model_id}"
            )
        if start == len(ids):
            return TokenScores([], [], ranks=[], top_logprobs=[] if top_k else None)
        async with self._lock:
            self._check_open()
            return await self._in_thread(functools.partial(self._score_sync, ids, start, top_k))

    async def logprob_rows(
        self, sequences: Sequence[tuple[Sequence[int], int]]
    ) -> list[Any]:
        """See :meth:`Engine.logprob_rows`; all sequences in one worker-thread call."""
        self._check_open()
        checked: list[tuple[list[int], int]] = []
        for token_ids, start in sequences:
            ids = self._check_ids(token_ids)
            if not 1 <= start <= len(ids):
                raise ValueError(f"start must be in [1, {len(ids)}], not {start}")
            if len(ids) > self.max_context:
                raise PromptTooLongError(
                    f"{len(ids)} tokens exceed the context of {self.max_context} tokens of "
                    f"{self.model_id}")
            checked.append((ids, start))
        async with self._lock:
            self._check_open()
            return await self._in_thread(functools.partial(self._rows_sync, checked))

    @property
    def end_token_ids(self) -> frozenset[int]:
        return frozenset(self.eos_token_ids)

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"engine of {self.model_id} is closed")

    def _fit(self, prompt_tokens: int, max_tokens: int) -> int:
        """``max_tokens`` cut to the room the prompt leaves in the context, as a vLLM server
        >= 0.32 cuts it (one behaviour for both engines: the answer ends with
        ``finish_reason`` "length" when it used all the room).

        Raises:
            EngineParameterError: ``max_tokens`` alone exceeds the context (vLLM: "max_tokens=X
                cannot be greater than max_model_len=Y").
            PromptTooLongError: the prompt leaves no room for one token.
        """
        if max_tokens > self.max_context:
            raise EngineParameterError(
                f"max_tokens={max_tokens} cannot be greater than the context of "
                f"{self.max_context} tokens of {self.model_id}")
        if prompt_tokens >= self.max_context:
            raise PromptTooLongError(
                f"prompt of {prompt_tokens} tokens leaves no room in the context of "
                f"{self.max_context} tokens of {self.model_id}")
        return min(max_tokens, self.max_context - prompt_tokens)

    def _adds_bos(self) -> bool:
        """True when encoding with special tokens puts BOS first."""
        bos_id = self.tokenizer.bos_token_id
        return bos_id is not None and self._encode("", add_special_tokens=True)[:1] == [bos_id]

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(
                f"token IDs {bad[:5]} out of the vocabulary of {self.vocab_size} of {self.model_id}"
            )
        return ids

    def _prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's tokens; an empty prompt is [BOS] (the model needs one token of context)."""
        ids = self._encode(prompt, add_special_tokens=True)
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise EngineError(f"{self.model_id}: empty prompt and no BOS token to start from")
            ids = [bos]
        return ids

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as exc:  # noqa: BLE001 - tokenizers raise a variety of types
            raise EngineError(f"tokenizer of {self.model_id} failed: {exc}") from exc

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a worker thread (not cancellable: it is one forward pass)."""
        try:
            return await trio.to_thread.run_sync(fn)
        except (EngineError, ValueError):
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, OOM errors...
            raise EngineError(f"{self.model_id}: {type(exc).__name__}: {exc}") from exc

    async def _in_thread_interruptible(self, fn: Callable[[threading.Event], T]) -> T:
        """Run ``fn(stop)`` in a worker thread; cancellation sets ``stop`` and waits for ``fn``.

        ``fn`` must check ``stop`` often (between tokens) and return soon after it is set.
        """
        stop = threading.Event()

        async def set_stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stop.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(set_stop_when_cancelled)
            result = await self._in_thread(functools.partial(fn, stop))
            nursery.cancel_scope.cancel()
        return result

    def _score_sync(self, ids: list[int], start: int, top_k: int) -> TokenScores:
        model = self.model
        assert model is not None
        input_ids = torch.tensor([ids], device=self.device)
        # Only positions start-1 .. n-2 predict scored tokens.
        keep = len(ids) - start + 1
        kwargs: dict[str, Any] = {"use_cache": False}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with torch.inference_mode():
            logits = model(input_ids=input_ids, **kwargs).logits[0]
            logits = logits[-keep:-1]
            targets = torch.tensor(ids[start:], device=logits.device)
            logprobs: list[float] = []
            ranks: list[int] = []
            top: list[dict[int, float]] | None = [] if top_k else None
            for lo in range(0, logits.shape[0], SCORE_CHUNK_POSITIONS):
                part = torch.log_softmax(logits[lo : lo + SCORE_CHUNK_POSITIONS].float(), dim=-1)
                target = targets[lo : lo + SCORE_CHUNK_POSITIONS].unsqueeze(1)
                chosen = part.gather(1, target)
                logprobs.extend(chosen.squeeze(1).tolist())
                ranks.extend(((part > chosen).sum(dim=1) + 1).tolist())
                if top is not None:
                    values, indices = part.topk(min(top_k, part.shape[1]), dim=-1)
                    for vs, ix in zip(values.tolist(), indices.tolist()):
                        top.append(dict(zip(ix, vs)))
        return TokenScores(ids[start:], logprobs, ranks=ranks, top_logprobs=top)


    def _rows_sync(self, sequences: list[tuple[list[int], int]]) -> list[Any]:
        """Rows of each sequence (:meth:`logprob_rows`): the sequences sorted by length and run
        in right-padded batches of at most ROWS_BATCH_ELEMENTS logits (a causal model's
        prediction at position i sees only positions <= i, so padding after a sequence does
        not change its rows; the batched matrix products may differ in the last float bits)."""
        model = self.model
        assert model is not None
        out: list[Any] = [None] * len(sequences)
        vocab = max(1, self.vocab_size)
        shared: dict[tuple[int, ...], list[int]] = {}
        for i, (ids, start) in enumerate(sequences):
            if start >= ROWS_SHARED_PREFIX and self._batchable:
                shared.setdefault(tuple(ids[:start]), []).append(i)
        rest = set(range(len(sequences)))
        with torch.inference_mode():
            for prefix, group in shared.items():
                if len(group) < 2:
                    continue
                self._rows_after_prefix(list(prefix), [sequences[i][0] for i in group],
                                        group, out)
                rest -= set(group)
        order = sorted(rest, key=lambda i: len(sequences[i][0]))
        with torch.inference_mode():
            k = 0
            while k < len(order):
                width = total = len(sequences[order[k]][0])
                batch = [order[k]]
                k += 1
                while k < len(order):  # sorted: the next one sets the padded width
                    longest = len(sequences[order[k]][0])
                    padded = (len(batch) + 1) * longest
                    if (padded * vocab > ROWS_BATCH_ELEMENTS
                            or padded > ROWS_BATCH_PADDING * (total + longest)):
                        break
                    batch.append(order[k])
                    width, total = longest, total + longest
                    k += 1
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                for row, i in enumerate(batch):
                    seq = sequences[i][0]
                    ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                logits = model(input_ids=ids.to(self.device), use_cache=False).logits
                for row, i in enumerate(batch):
                    seq, start = sequences[i]
                    part = logits[row, start - 1 : len(seq)]
                    out[i] = torch.log_softmax(part.double(), dim=-1).cpu().numpy()
        return out

    def _rows_after_prefix(self, prefix: list[int], sequences: list[list[int]],
                           where: list[int], out: list[Any]) -> None:
        """Rows of sequences that all start with ``prefix`` (their ``start``): the prefix once,
        then their continuations right-padded in one pass over its key/values (the
        continuation's rows as a KV-cached decode computes them). Worker thread."""
        model = self.model
        assert model is not None
        first = model(input_ids=torch.tensor([prefix], device=self.device), use_cache=True)
        head = torch.log_softmax(first.logits[0, -1:].double(), dim=-1).cpu().numpy()
        layers = _cache_layers(first[self._cache_name])
        tails = [seq[len(prefix):] for seq in sequences]
        width = max(len(t) for t in tails)
        if not width:
            for i in where:
                out[i] = head
            return
        vocab = max(1, self.vocab_size)
        step = max(1, ROWS_BATCH_ELEMENTS // (width * vocab))
        import numpy as np

        for lo in range(0, len(tails), step):
            part = tails[lo:lo + step]
            ids = torch.zeros((len(part), width), dtype=torch.long)
            for row, t in enumerate(part):
                ids[row, : len(t)] = torch.tensor(t, dtype=torch.long)
            past = _cache_from_layers(model, [
                (k.expand(len(part), -1, -1, -1).contiguous(),
                 v.expand(len(part), -1, -1, -1).contiguous()) for k, v in layers])
            logits = model(input_ids=ids.to(self.device), use_cache=True,
                           **{self._cache_name: past}).logits
            for row, t in enumerate(part):
                rows = torch.log_softmax(logits[row, : len(t)].double(), dim=-1).cpu().numpy()
                out[where[lo + row]] = np.concatenate([head, rows])

    async def complete_batch(
        self, requests: Sequence[tuple[str, SamplingParams]]
    ) -> list[Completion]:
        """:meth:`complete` of several requests at once: one forward pass per token for all
        of them (left-padded prompts, a shared KV cache), each request sampled with its own
        seeded generator as :meth:`complete` samples it. The same tokens as one request at a
        time up to the last float bits of the batched matrix products (a near-tie may go the
        other way). The prefix cache is not used.

        Raises:
            PromptTooLongError, EngineError: see :meth:`complete` (for any of the requests).
        """
        self._check_open()
        starts = [self._start(prompt, params) for prompt, params in requests]
        try:
            async with self._lock:
                self._check_open()
                await self._in_thread_interruptible(
                    functools.partial(self._batch_sync, [g for _, g in starts]))
        finally:
            for _, g in starts:
                g.release()
        return [Completion(text=g.text, prompt_tokens=len(ids),
                           completion_tokens=len(g.token_ids),
                           finish_reason=g.finish_reason or FINISH_LENGTH)
                for ids, g in starts]

    def _batch_sync(self, generations: list["_Generation"], stop: threading.Event) -> None:
        """Each distinct prompt prefilled on its own (no padding: the same first token as
        :meth:`complete`), then one decoding pass per token for all, over their key/values
        joined left-padded (zeros, masked out). Worker thread."""
        model = self.model
        assert model is not None
        if not self._batchable:  # not a plain key/value cache: one request at a time
            for g in generations:
                g.pieces.append(g.run(stop))
            return
        layers_of = []
        prefilled: dict[tuple[int, ...], tuple[Any, torch.Tensor]] = {}  # one per prompt
        with torch.inference_mode():
            for g in generations:
                if stop.is_set():
                    return
                key = tuple(g._prompt_ids)
                if key not in prefilled:
                    out = model(input_ids=torch.tensor([g._prompt_ids], device=self.device),
                                use_cache=True)
                    prefilled[key] = (_cache_layers(out[self._cache_name]), out.logits[0, -1])
                layers, logits = prefilled[key]
                layers_of.append(layers)
                g.pieces.append(g.accept(g._pick(logits)))
            del prefilled
            width = max(len(g._prompt_ids) for g in generations)
            rows = len(generations)
            joined = []
            for i in range(len(layers_of[0])):
                pair = []
                for j in (0, 1):
                    one = layers_of[0][i][j]
                    t = one.new_zeros((rows, one.shape[1], width, one.shape[3]))
                    for row, layers in enumerate(layers_of):
                        kv = layers[i][j]
                        t[row, :, width - kv.shape[2]:] = kv[0]
                    pair.append(t)
                joined.append((pair[0], pair[1]))
            del layers_of
            past = _cache_from_layers(model, joined)
            _grow_in_place(past, max(g.params.max_tokens for g in generations) + 1)
            mask = torch.zeros((rows, width), dtype=torch.long)
            for row, g in enumerate(generations):
                mask[row, width - len(g._prompt_ids):] = 1
            positions = torch.tensor([[len(g._prompt_ids)] for g in generations])
            while not stop.is_set() and any(g.finish_reason is None for g in generations):
                ids = torch.tensor([[g.token_ids[-1] if g.token_ids else 0]
                                    for g in generations])
                mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], 1)
                out = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            position_ids=positions.to(self.device), use_cache=True,
                            **{self._cache_name: past})
                past = out[self._cache_name]
                positions = positions + 1
                for row, g in enumerate(generations):
                    if g.finish_reason is None:
                        g.pieces.append(g.accept(g._pick(out.logits[row, -1])))


class _Generation:
    """One request's decoding state: KV cache, sampler, detokenizer.

    :meth:`step` and :meth:`run` run in a worker thread, under the engine's lock.
    """

    def __init__(self, engine: TransformersEngine, prompt_ids: list[int], params: SamplingParams):
        self.engine = engine
        self.params = params
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        #: text pieces of a batched generation (:meth:`TransformersEngine.complete_batch`)
        self.pieces: list[str] = []
        self._prompt_ids = prompt_ids
        self._pending: list[int] = prompt_ids  # tokens the next forward pass reads
        self._past: Any = None
        self._prefilled = False
        #: logits of the last position of the last forward pass (None before the first)
        self.last_logits: torch.Tensor | None = None
        self._detokenizer = _Detokenizer(engine.tokenizer, prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device="cpu")
            if params.seed is not None:
                self._generator.manual_seed(params.seed)
            else:
                self._generator.seed()

    def step(self) -> str:
        """One forward pass and one token; returns the new text (may be "")."""
        engine = self.engine
        model = engine.model
        assert model is not None and self.finish_reason is None
        prefill = not self._prefilled
        with torch.inference_mode():
            if prefill:
                self._past, cached = engine._cached_prefix(self._prompt_ids)
                self._pending = self._prompt_ids[cached:]
                engine.prompt_tokens_cached += cached
                engine.prompt_tokens_prefilled += len(self._pending)
            input_ids = torch.tensor([self._pending], device=engine.device)
            cache = engine._cache_name
            out = model(input_ids=input_ids, use_cache=True, **{cache: self._past})
            self._past = out[cache]
            if prefill:
                self._prefilled = True
                engine._store_prefix(self._prompt_ids, self._past)
            self.last_logits = out.logits[0, -1]
            token = self._pick(self.last_logits)
        return self.accept(token)

    def accept(self, token: int) -> str:
        """Take the picked ``token``: the end, or one more token; returns the new text."""
        if token in self.engine.eos_token_ids:
            self.finish_reason = FINISH_STOP
            return self._detokenizer.flush()
        self.token_ids.append(token)
        self.engine.tokens_generated += 1
        piece = self._detokenizer.push(token)
        if len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = FINISH_LENGTH
            return piece + self._detokenizer.flush()
        self._pending = [token]
        return piece

    def run(self, stop: threading.Event) -> str:
        """Steps until finished, or until ``stop`` is set; returns the text generated."""
        pieces = []
        while self.finish_reason is None and not stop.is_set():
            pieces.append(self.step())
        return "".join(pieces)

    @property
    def text(self) -> str:
        """The text of a batched generation so far."""
        return "".join(self.pieces)

    def release(self) -> None:
        """Drop the KV cache."""
        self._past = None

    def _pick(self, logits: torch.Tensor) -> int:
        if self._generator is None:
            return int(torch.argmax(logits).item())
        scaled = logits.float().cpu() / self.params.temperature
        probs = torch.softmax(scaled, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
            sorted_probs = torch.where(before < self.params.top_p, sorted_probs, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._generator).item())


class _Detokenizer:
    """Incremental detokenization: text pieces of a growing token sequence.

    Decodes a small window (a prefix already emitted + the new tokens) and emits the difference,
    so a piece keeps the leading space a tokenizer would strip at the start of a sequence, and
    an incomplete UTF-8 character (U+FFFD at the end) is held back until it completes.
    """

    def __init__(self, tokenizer: Any, context_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context_ids)
        self._prefix = 0  # start of the decoded window
        self._read = len(self._ids)  # end of the text already emitted

    def _delta(self, force: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (force or not new_text.endswith("\ufffd")):
            piece = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return piece
        return ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._delta(force=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end of generation)."""
        return self._delta(force=True)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))


# -- KV caches ------------------------------------------------------------------------------


def _plain_kv_cache(model: Any) -> bool:
    """True when the model's KV cache is one growing (key, value) pair per layer, which the
    prefix cache can cut into blocks and join again."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x: no per-layer types; refuse sliding windows
        return getattr(model.config, "sliding_window", None) is None
    layers = getattr(cache, "layers", None)
    if not layers:
        return getattr(model.config, "sliding_window", None) is None
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in layers)


def _cache_layers(past: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the ``(key, value)`` tensors ``[batch, kv_heads, positions, head_dim]``."""
    layers = getattr(past, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(past, "key_cache"):
        return list(zip(past.key_cache, past.value_cache))
    return [(k, v) for k, v in past]  # legacy tuple of tuples


def _grow_in_place(past: Any, room: int) -> None:
    """Let ``past``'s layers take ``room`` more positions without copying the whole cache at
    every token (a dynamic layer concatenates: O(positions) per token): each layer's keys and
    values become views of buffers with that room, written in place. Caches of another
    structure (transformers < 4.56) are left as they are."""
    from transformers.cache_utils import DynamicLayer

    for layer in getattr(past, "layers", None) or ():
        if type(layer) is not DynamicLayer or not getattr(layer, "is_initialized", False):
            continue
        k, v = layer.keys, layer.values
        n = k.shape[-2]
        bufs = [t.new_zeros((*t.shape[:-2], n + room, t.shape[-1])) for t in (k, v)]
        bufs[0][..., :n, :], bufs[1][..., :n, :] = k, v
        layer.keys, layer.values = bufs[0][..., :n, :], bufs[1][..., :n, :]

        def update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   _layer: Any = layer, _bufs: list[torch.Tensor] = bufs,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            at, m = _layer.keys.shape[-2], key_states.shape[-2]
            if at + m > _bufs[0].shape[-2]:  # out of room: concatenate as before
                _layer.keys = torch.cat([_layer.keys, key_states], dim=-2)
                _layer.values = torch.cat([_layer.values, value_states], dim=-2)
                return _layer.keys, _layer.values
            _bufs[0][..., at:at + m, :] = key_states
            _bufs[1][..., at:at + m, :] = value_states
            _layer.keys, _layer.values = _bufs[0][..., :at + m, :], _bufs[1][..., :at + m, :]
            return _layer.keys, _layer.values

        layer.update = update


def _cache_from_layers(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` holding ``layers`` (see :func:`_cache_layers`), for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(ddp_cache_data=layers, config=model.config)
    except TypeError:  # transformers 4.x
        return DynamicCache.from_legacy_cache(tuple(layers))


# -- loading --------------------------------------------------------------------------------


def _set_cpu_threads(threads: int | None) -> None:
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return  # the operator chose
        threads = max(1, (os.cpu_count() or 2) - 1)
    if threads < 1:
        raise EngineError(f"cpu_threads must be >= 1, not {threads}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("torch uses %d CPU thread(s) for inference", threads)


def _torch_device(device: str) -> torch.device:
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EngineError(f"unknown device {device!r}: {exc}") from exc
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} requested, but torch sees no CUDA GPU")
    if torch_device.type == "mps" and not torch.backends.mps.is_available():
        raise EngineError(f"device {device!r} requested, but MPS is not available")
    return torch_device


def _dtype_kwargs(dtype: torch.dtype | str | None) -> dict[str, Any]:
    if dtype is None:
        return {}
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without transformers' progress bars (its "Loading weights" tqdm bar on stderr: a node's
    log says "model ... loaded" instead)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _load_folder(path: pathlib.Path, dtype: torch.dtype | str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, **_dtype_kwargs(dtype)
            )
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...
        raise EngineError(f"cannot load the model folder {path}: {exc}") from exc
    return model, tokenizer


def _load_gguf(path: pathlib.Path, dtype: torch.dtype | str | None) -> tuple[Any, Any]:
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        metadata = load_gguf_checkpoint(str(path))
    except Exception as exc:  # noqa: BLE001 - ImportError (no gguf package), parse errors
        raise EngineError(f"cannot read the GGUF file {path}: {exc}") from exc
    tokenizer = _gguf_tokenizer(path, metadata)
    model = None
    if importlib.util.find_spec("accelerate") is not None:
        from transformers import AutoModelForCausalLM

        try:
            with _no_progress_bars():
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, local_files_only=True,
                    **_dtype_kwargs(dtype),
                )
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "transformers' GGUF loader failed on %s (%s); dequantizing instead", path, exc
            )
    if model is None:
        model = _gguf_model_dequantized(path, metadata, dtype)
    return model, tokenizer


def _gguf_model_dequantized(
    path: pathlib.Path, metadata: dict[str, Any], dtype: torch.dtype | str | None
) -> Any:
    """A float model from a GGUF file without ``accelerate``: build from config, load tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config_dict = dict(metadata["config"])
        vocab_size = int(config_dict.get("vocab_size") or 0)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
            value = config_dict.get(key)
            if isinstance(value, int) and not 0 <= value < vocab_size:
                config_dict[key] = None  # llama.cpp's 2**32 - 1 means "none"
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        model = AutoModelForCausalLM.from_config(config)
        loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
        tensors = loaded["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        missing = [
            k for k in result.missing_keys
            if not (getattr(config, "tie_word_embeddings", False) and k.startswith("lm_head."))
        ]
        if missing:
            raise EngineError(f"the file lacks tensors {missing[:5]}")
        if isinstance(dtype, torch.dtype):
            model.to(dtype)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"cannot load the GGUF model {path}: {exc}") from exc
    return model


def _gguf_tokenizer(path: pathlib.Path, metadata: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    spec = metadata.get("tokenizer", {})
    n_tokens = len(spec.get("tokens") or ())
    special_ids = [spec.get(f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")]
    first_error: Exception | str = "special-token IDs out of the vocabulary"
    if all(i is None or (isinstance(i, int) and 0 <= i < n_tokens) for i in special_ids):
        try:
            return AutoTokenizer.from_pretrained(
                path.parent, gguf_file=path.name, local_files_only=True
            )
        except Exception as exc:  # noqa: BLE001
            first_error = exc
    try:
        return _gguf_tokenizer_sanitized(metadata)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(
            f"cannot build the tokenizer of the GGUF file {path}: {first_error}; "
            f"with sanitized metadata: {exc}"
        ) from exc


def _gguf_tokenizer_sanitized(metadata: dict[str, Any]) -> Any:
    """The GGUF tokenizer with out-of-range special-token IDs dropped."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import convert_gguf_tokenizer

    spec = dict(metadata["tokenizer"])
    tokens = spec["tokens"]
    specials: dict[str, str] = {}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = spec.get(f"{name}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            specials[f"{name}_token"] = tokens[token_id]
        else:
            spec.pop(f"{name}_token_id", None)
    backend, extra = convert_gguf_tokenizer(metadata["config"]["model_type"], spec)
    # llama.cpp adds BOS to a sentencepiece ("llama") vocabulary unless the file says otherwise
    default_bos = spec.get("tokenizer_type") == "llama"
    add_bos = bool(metadata.get("tokenizer_config", {}).get("add_bos_token", default_bos))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, add_bos_token=add_bos, **specials, **(extra or {})
    )
    bos = specials.get("bos_token")
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        if tokenizer("a")["input_ids"][:1] != [bos_id]:
            tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
    return tokenizer


def _context_window(config: Any) -> int:
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    log.warning("the model config names no context window; assuming %d tokens", DEFAULT_CONTEXT)
    return DEFAULT_CONTEXT


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources = [
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ]
    for value in sources:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0:
                ids.add(v)
    return frozenset(ids)
