"""An engine backed by a vLLM server, over its OpenAI-compatible HTTP API.

The server is started apart from the node, e.g.
``vllm serve MODEL --enable-prefix-caching --port 8000`` (prefix caching is what makes PlanetServe's
HR-tree forwarding pay off: requests that share a prefix reuse its KV cache). The client is
``httpx.AsyncClient``, which runs on trio.

Shapes assumed (vLLM 0.33's OpenAI-compatible server, as ``DESIGN.md`` records it;
:mod:`ps_p2p.testing.fake_vllm` implements the same):

``POST /v1/completions``
    request ``{"model", "prompt": str | [int], "max_tokens", "temperature", "top_p", "seed",
    "stream", "stream_options": {"include_usage": true}, "prompt_logprobs": int}``
    (``prompt_logprobs`` is vLLM's extension). Answer ``{"id": "cmpl-...", "object":
    "text_completion", "created", "model", "choices": [{"index": 0, "text", "logprobs": null,
    "finish_reason": "stop" | "length" | "abort" | "repetition", "stop_reason",
    "prompt_logprobs"}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}``.
    ``prompt_logprobs`` is a list aligned with the prompt tokens: ``null`` first, then per token a
    dict from token-ID string to ``{"logprob": float, "rank": int, "decoded_token": str}``,
    holding the prompt token itself (first, with its true rank) and the ``prompt_logprobs`` most
    likely tokens; ``-inf`` arrives as -9999.0. ``prompt_logprobs`` above the server's
    ``--max-logprobs`` (default 20), or -1 (the whole vocabulary), get a 400.
    With ``"stream": true``: server-sent events ``data: {chunk}``, each chunk ``{"id", "object":
    "text_completion", "created", "model", "choices": [{"index", "text", "logprobs",
    "finish_reason", "stop_reason"}]}`` carrying a text delta (``finish_reason`` set on the last),
    then, with ``include_usage``, a chunk with ``"choices": []`` and ``usage``, then
    ``data: [DONE]``. A failure after the stream started is an event ``data: {"error": {...}}``
    before ``[DONE]``.
``POST /tokenize``
    ``{"model", "prompt", "add_special_tokens"}`` -> ``{"count", "max_model_len", "tokens"}``;
    for a chat, ``{"model", "messages": [{"role", "content"}], "add_generation_prompt": true,
    "add_special_tokens": false}`` gives the tokens of the server's chat template, or 400 "...
    you must provide a chat template if the tokenizer does not define one." without one.
``POST /detokenize``
    ``{"model", "tokens"}`` -> ``{"prompt": str}``.
``GET /v1/models``
    ``{"object": "list", "data": [{"id", "object": "model", "max_model_len", ...}]}``.
Errors
    HTTP 4xx/5xx with ``{"error": {"message", "type", "param", "code"}}`` (vLLM >= 0.10.1; the
    older flat ``{"object": "error", "message", "type", "param", "code"}`` is read too); an
    unknown model gets 404 "The model `x` does not exist.".

Context window (vLLM >= 0.32): prompt + ``max_tokens`` beyond ``max_model_len`` is **accepted**:
the server cuts ``max_tokens`` to what fits, and the completion is a normal one, ending with
``finish_reason: "length"`` when it used all the room (this engine raises no
``PromptTooLongError`` for an overflowing ``max_tokens``, and
:class:`~ps_p2p.engines.transformers_engine.TransformersEngine` cuts it the same way). The server answers 400 only when the
prompt alone does not leave room for one token ("... your prompt contains M input tokens, which
exceeds this limit even without any output tokens"), or when ``max_tokens`` alone exceeds the
window ("max_tokens=X cannot be greater than max_model_len=Y").

Mapping of errors:

* 400 about ``max_tokens`` (``param`` "max_tokens", or the "max_tokens=X cannot be greater than"
  message, which also names ``max_model_len``) -> :class:`~ps_p2p.errors.EngineParameterError`:
  the parameter is wrong whatever the prompt, so it is not a too-long prompt;
* other 400 about the context length ("maximum context length", "context length", ``param``
  "input_tokens"...; older servers' prompt + ``max_tokens`` overflow too) ->
  :class:`~ps_p2p.errors.PromptTooLongError`;
* any other 400 (a parameter the server refuses, e.g. too many ``prompt_logprobs``) ->
  :class:`~ps_p2p.errors.EngineParameterError`;
* a ``finish_reason`` of ``"abort"`` (the server gave up the request) -> ``EngineError``;
  ``"repetition"`` and other reasons pass through as the completion's ``finish_reason``;
* any other HTTP error, a connection failure, a timeout or a malformed answer ->
  :class:`~ps_p2p.errors.EngineError` naming the server and the cause.

The same mapping applies to an error event inside a stream (its ``code`` is the status).

KV-cache events (optional): with ``kv_events_endpoint`` set, the engine subscribes to the
server's ZMQ publisher (``vllm serve ... --kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic":
"kv"}'``) with a :class:`KVEventSubscriber`; wire format, gaps and replay are in
:mod:`ps_p2p.engines.vllm_kv_events`. The subscriber is a task the owner of the engine runs in
its nursery, beside the engine's users, and cancels when it stops::

    engine = VLLMEngine(url, model, kv_events_endpoint="tcp://127.0.0.1:5557",
                        kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve_kv_events)   # sockets open and connected
        ...
        events = engine.drain_kv_events()              # e.g. once a gossip round
        nursery.cancel_scope.cancel()
    await engine.aclose()

:meth:`VLLMEngine.serve_kv_events` returns at once when no endpoint is configured, so a node can
always start it; :meth:`VLLMEngine.aclose` does not stop it (cancelling its nursery does).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import trio
import zmq

from ps_p2p.engines.base import (
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
from ps_p2p.engines.kv_events import KVCacheEvent
from ps_p2p.engines.vllm_kv_events import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_BUFFERED_WEIGHT,
    EventBuffer,
    EventsDecoded,
    KVEventLimits,
    KVEventStats,
    KVEventStream,
    MessageRejected,
    Output,
    Resynced,
    endpoint_for_rank,
    replay_request,
)
from ps_p2p.errors import (
    ConfigError,
    EngineError,
    EngineParameterError,
    PromptTooLongError,
)

log = logging.getLogger(__name__)

#: seconds to wait for the server between two pieces of an answer (generation can be slow)
DEFAULT_TIMEOUT = 600.0
#: seconds to wait for a TCP connection
DEFAULT_CONNECT_TIMEOUT = 10.0

#: what vLLM sends for a -inf log-probability; read back as -inf
LOGPROB_FLOOR = -9999.0
#: finish reason of a request the server gave up (vLLM)
FINISH_ABORT = "abort"
#: seconds a whole replay of KV-cache events may take before it counts as failed (a resnapshot)
DEFAULT_REPLAY_TIMEOUT = 10.0

_CONTEXT_ERROR_HINTS = (
    "maximum context length",
    "maximum model length",
    "max_model_len",
    "context length",
    "context window",
    "prompt is too long",
)
#: vLLM's "max_tokens=X cannot be greater than max_model_len=Y" (also spelled with
#: max_completion_tokens, max_output_tokens, or "max_model_len=max_total_tokens=Y")
_MAX_TOKENS_ERROR = re.compile(r"max_\w*tokens\s*=\s*-?\d+\s*cannot be greater than")
_MAX_TOKENS_PARAMS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})
_PROMPT_LENGTH_PARAMS = frozenset({"input_tokens", "input_text"})
#: phrases of the 400 a server without a chat template answers to chat messages
_NO_CHAT_TEMPLATE_HINTS = (
    "default chat template is no longer allowed",
    "must provide a chat template",
    "chat_template is not set",
    "does not define one",
)
_INT63 = 2**63


class VLLMEngine(Engine):
    """A model served by ``vllm serve``; see the module docstring for the HTTP shapes.

    The constructor does no I/O; ``max_context`` stays 0 until :meth:`refresh` (or
    :meth:`refresh_blocking`) read ``max_model_len`` from ``GET /v1/models``. Requests do not
    need it: the server checks the context itself.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is dropped).
        model: the model name the server serves (``vllm serve MODEL`` or
            ``--served-model-name``), sent in every request.
        model_id: announced model ID; defaults to ``model``.
        timeout: seconds to wait for each read from the server (default 600 s).
        connect_timeout: seconds to wait for a connection (default 10 s).
        transport: an httpx transport to use instead of TCP (tests).
        kv_events_endpoint: the server's KV-cache event publisher to connect to, e.g.
            ``tcp://127.0.0.1:5557`` (the host of vLLM's ``"endpoint": "tcp://*:5557"``); None
            (default): no KV-cache events, :meth:`drain_kv_events` returns [].
        kv_events_replay_endpoint: its replay endpoint, e.g. ``tcp://127.0.0.1:5558``; without
            one, lost batches reset the view instead of being replayed.
        kv_events_topic: the topic vLLM publishes under (``"topic"`` of its config), matched
            exactly; None (default) accepts any.
        kv_events_data_parallel_size: data-parallel ranks of the server; rank r is read at the
            endpoints' ports + r (default 1).

    Raises:
        ConfigError: a KV events endpoint that cannot be connected to, a replay endpoint
            without an endpoint, or a data-parallel size < 1.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        model_id: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
        kv_events_topic: str | None = None,
        kv_events_data_parallel_size: int = 1,
    ) -> None:
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        self.base_url = base
        self.model = model
        self.model_id = model_id or model
        self.max_context = 0
        if kv_events_endpoint is None and kv_events_replay_endpoint is not None:
            raise ConfigError("a KV events replay endpoint needs kv_events_endpoint too")
        #: the KV-cache event subscriber, None without ``kv_events_endpoint``
        self.kv_events: KVEventSubscriber | None = None
        if kv_events_endpoint is not None:
            self.kv_events = KVEventSubscriber(
                kv_events_endpoint,
                replay_endpoint=kv_events_replay_endpoint,
                topic=kv_events_topic,
                data_parallel_size=kv_events_data_parallel_size,
            )
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._client = httpx.AsyncClient(timeout=self._timeout, transport=transport)
        self._special_prefix: list[int] | None = None  # what /tokenize puts before any text

    # -- server metadata ------------------------------------------------------------------

    async def served_models(self) -> dict[str, int]:
        """``GET /v1/models``: served model name -> ``max_model_len`` (0 when not given).

        Raises:
            EngineError: the server is unreachable or answered something else.
        """
        return self._parse_models(await self._request("GET", "/v1/models"))

    def served_models_blocking(self) -> dict[str, int]:
        """:meth:`served_models` with a blocking HTTP client, for synchronous start-up code."""
        try:
            with httpx.Client(timeout=self._timeout) as client:
                response = client.get(self.base_url + "/v1/models")
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        return self._parse_models(self._payload(response.status_code, response.content))

    async def refresh(self) -> None:
        """Set ``max_context`` to the ``max_model_len`` the server reports for ``model``.

        Raises:
            EngineError: the server is unreachable or does not serve ``model``.
        """
        self.max_context = self._context_of(await self.served_models())

    def refresh_blocking(self) -> None:
        """:meth:`refresh` with a blocking HTTP client, for synchronous start-up code."""
        self.max_context = self._context_of(self.served_models_blocking())

    def _context_of(self, served: dict[str, int]) -> int:
        if self.model not in served:
            raise EngineError(
                f"vLLM at {self.base_url} serves {sorted(served)}, not {self.model!r}"
            )
        return served[self.model]

    def _parse_models(self, payload: Any) -> dict[str, int]:
        try:
            served = {}
            for entry in payload["data"]:
                value = entry.get("max_model_len")
                served[str(entry["id"])] = value if isinstance(value, int) and value > 0 else 0
        except (KeyError, TypeError, AttributeError) as exc:
            raise EngineError(f"vLLM at {self.base_url}: malformed /v1/models answer") from exc
        return served

    # -- text-level API -------------------------------------------------------------------

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        async for chunk in self.stream(prompt, params):
            if chunk.text:
                yield chunk.text

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        """Stream ``POST /v1/completions`` with ``stream: true`` and
        ``stream_options: {"include_usage": true}``.

        The last chunk carries the ``finish_reason`` and the token counts of the server's usage
        chunk (None when the server sent none). An overflowing ``max_tokens`` is cut by the
        server (see the module docstring): the stream then ends with ``"length"``.

        Raises:
            PromptTooLongError: the prompt alone fills the context window.
            EngineParameterError: ``max_tokens`` > ``max_model_len``, or another parameter the
                server refused.
            EngineError: the server failed, aborted the request, or the stream ended without a
                finish reason.
        """
        body = self._completion_body(prompt, params)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        final: StreamChunk | None = None
        try:
            url = self.base_url + "/v1/completions"
            async with self._client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raise self._http_error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, other SSE fields
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    event = self._decode_json(data.encode())
                    if "error" in event or event.get("object") == "error":
                        raise self._event_error(event)
                    usage = event.get("usage")
                    if usage and final is not None:
                        final.prompt_tokens = usage.get("prompt_tokens")
                        final.completion_tokens = usage.get("completion_tokens")
                    for choice in event.get("choices") or []:
                        text = choice.get("text") or ""
                        finish_reason = choice.get("finish_reason")
                        if finish_reason:
                            self._check_finish(finish_reason)
                            final = StreamChunk(text, finish_reason=str(finish_reason))
                        elif text:
                            yield StreamChunk(text)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if final is None:
            raise EngineError(f"vLLM at {self.base_url}: the stream ended without a finish reason")
        yield final

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        """One non-streaming ``POST /v1/completions``.

        prompt + ``max_tokens`` beyond the context window is not an error: the server generates
        what fits and says ``"length"`` (see the module docstring).

        Raises:
            PromptTooLongError, EngineParameterError, EngineError: as :meth:`stream`.
        """
        body = self._completion_body(prompt, params)
        payload = await self._request("POST", "/v1/completions", body)
        try:
            choice = payload["choices"][0]
            usage = payload["usage"]
            completion = Completion(
                text=str(choice["text"]),
                prompt_tokens=int(usage["prompt_tokens"]),
                completion_tokens=int(usage["completion_tokens"]),
                finish_reason=str(choice.get("finish_reason") or FINISH_STOP),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM at {self.base_url}: malformed completion: {exc!r}") from exc
        self._check_finish(completion.finish_reason)
        return completion

    def _check_finish(self, finish_reason: Any) -> None:
        if finish_reason == FINISH_ABORT:
            raise EngineError(f"vLLM at {self.base_url} aborted the request")

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text of ``messages`` under the server's chat template.

        ``POST /tokenize`` with ``messages``, ``add_generation_prompt: true`` and
        ``add_special_tokens: false`` renders the template on the server; a leading BOS (what
        ``/tokenize`` puts before an empty prompt with special tokens, asked once and cached)
        is dropped, since :meth:`complete` adds it again; ``POST /detokenize`` turns the rest
        into text. Three requests the first time, two afterwards.

        A server without a chat template (its 400 "... you must provide a chat template if the
        tokenizer does not define one.") gets :func:`default_chat_prompt`, as a
        :class:`~ps_p2p.engines.transformers_engine.TransformersEngine` on a model without a
        template does: both engines give the same prompt for the same model.

        Raises:
            ValueError: no messages, or a role outside :data:`CHAT_ROLES`.
            EngineParameterError: the template refused the conversation (400).
            EngineError: the server failed or is unreachable.
        """
        check_messages(messages)
        body = {
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
        try:
            payload = await self._request("POST", "/tokenize", body)
        except EngineParameterError as exc:
            if any(hint in str(exc).lower() for hint in _NO_CHAT_TEMPLATE_HINTS):
                log.debug("vLLM at %s has no chat template: default chat prompt", self.base_url)
                return default_chat_prompt(messages)
            raise
        tokens = self._tokens_of(payload)
        if self._special_prefix is None:
            self._special_prefix = await self.encode("", add_special_tokens=True)
        prefix = self._special_prefix
        if prefix and tokens[: len(prefix)] == prefix:
            tokens = tokens[len(prefix):]
        return await self.decode(tokens)

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        """Tokenize both parts (``/tokenize``), then :meth:`score_ids` (one forward pass).

        Raises:
            PromptTooLongError: prompt + continuation + 1 token exceed ``max_model_len``.
            EngineError: the server failed, or an empty prompt tokenizes to nothing.
        """
        prompt_ids = await self.encode(prompt, add_special_tokens=True)
        continuation_ids = await self.encode(continuation, add_special_tokens=False)
        if not continuation_ids:
            return TokenScores([], [], ranks=[])
        if not prompt_ids:
            raise EngineError(
                f"{self.model}: cannot score after an empty prompt without a BOS token"
            )
        return await self.score_ids(prompt_ids + continuation_ids, len(prompt_ids))

    async def tokenize(self, text: str) -> list[int]:
        return await self.encode(text, add_special_tokens=True)

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- KV-cache events ------------------------------------------------------------------

    async def serve_kv_events(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the KV-cache event subscriber until cancelled (start it with ``nursery.start``).

        Returns at once (after ``task_status.started()``) when the engine has no
        ``kv_events_endpoint``. See :meth:`KVEventSubscriber.serve`.
        """
        if self.kv_events is None:
            task_status.started()
            return
        await self.kv_events.serve(task_status=task_status)

    def drain_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events received since the last call, oldest first ([] without a
        subscriber). A reset (lost batches, a server restart, an undrained backlog) appears as
        an ``AllBlocksCleared`` at its place in the list."""
        if self.kv_events is None:
            return []
        return self.kv_events.drain()

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per KV-cache block, from the last ``BlockStored`` event; None before one."""
        return None if self.kv_events is None else self.kv_events.block_size

    # -- token-level API ------------------------------------------------------------------

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``POST /tokenize``."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        return self._tokens_of(await self._request("POST", "/tokenize", body))

    def _tokens_of(self, payload: Any) -> list[int]:
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise EngineError(f"vLLM at {self.base_url}: malformed /tokenize answer")
        return list(tokens)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """``POST /detokenize``."""
        body = {"model": self.model, "tokens": [int(t) for t in token_ids]}
        payload = await self._request("POST", "/detokenize", body)
        text = payload.get("prompt") if isinstance(payload, dict) else None
        if not isinstance(text, str):
            raise EngineError(f"vLLM at {self.base_url}: malformed /detokenize answer")
        return text

    async def score_ids(
        self, token_ids: Sequence[int], start: int, *, top_k: int = 0
    ) -> TokenScores:
        """``POST /v1/completions`` with the token IDs as prompt, ``max_tokens: 1`` and
        ``prompt_logprobs: top_k``: the server's prefill is the one forward pass (vLLM skips
        its prefix cache for such requests). A logprob of -9999.0 (vLLM's JSON for ``-inf``)
        reads as ``-inf``.

        Raises:
            ValueError: ``start`` out of [1, len(token_ids)], or ``top_k`` < 0.
            PromptTooLongError: ``len(token_ids)`` >= ``max_model_len`` (no room for the one
                generated token).
            EngineParameterError: ``top_k`` above the server's ``--max-logprobs`` (default 20).
            EngineError: the server failed or its answer lacks ``prompt_logprobs``.
        """
        ids = [int(t) for t in token_ids]
        if not 1 <= start <= len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}], not {start}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {top_k}")
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
        }
        payload = await self._request("POST", "/v1/completions", body)
        try:
            entries = payload["choices"][0]["prompt_logprobs"]
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise ValueError(f"{len(entries) if isinstance(entries, list) else entries!r} "
                                 f"entries for {len(ids)} prompt tokens")
            logprobs: list[float] = []
            ranks: list[int] = []
            top: list[dict[int, float]] | None = [] if top_k else None
            for token_id, entry in zip(ids[start:], entries[start:]):
                own = entry[str(token_id)]
                logprobs.append(_logprob(own["logprob"]))
                ranks.append(int(own["rank"]))
                if top is not None:
                    top.append({
                        int(key): _logprob(value["logprob"])
                        for key, value in entry.items()
                        if int(value["rank"]) <= top_k
                    })
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(
                f"vLLM at {self.base_url}: no usable prompt_logprobs in the answer ({exc!r})"
            ) from exc
        return TokenScores(ids[start:], logprobs, ranks=ranks, top_logprobs=top)

    # -- HTTP ---------------------------------------------------------------------------

    def _completion_body(self, prompt: str, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
        }
        if params.seed is not None:
            body["seed"] = params.seed % _INT63  # vLLM takes a signed 64-bit seed
        return body

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._client.request(method, self.base_url + path, json=body)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        return self._payload(response.status_code, response.content)

    def _payload(self, status: int, content: bytes) -> Any:
        if status != 200:
            raise self._http_error(status, content)
        return self._decode_json(content)

    def _decode_json(self, content: bytes) -> Any:
        try:
            payload = json.loads(content)
        except ValueError as exc:
            raise EngineError(f"vLLM at {self.base_url} answered non-JSON") from exc
        if not isinstance(payload, dict):
            raise EngineError(f"vLLM at {self.base_url} answered JSON that is not an object")
        return payload

    def _transport_error(self, exc: httpx.HTTPError) -> EngineError:
        if isinstance(exc, httpx.TimeoutException):
            return EngineError(f"vLLM at {self.base_url} timed out ({type(exc).__name__})")
        if isinstance(exc, httpx.ConnectError):
            return EngineError(f"cannot connect to vLLM at {self.base_url}: {exc}")
        return EngineError(f"vLLM at {self.base_url} failed: {type(exc).__name__}: {exc}")

    def _http_error(self, status: int, content: bytes) -> EngineError:
        message = content.decode("utf-8", "replace")[:1000]
        try:
            payload = json.loads(content)
        except ValueError:
            payload = None
        param = None
        if isinstance(payload, dict):
            message = _error_message(payload) or message
            param = _error_param(payload)
        if status == 404:
            return EngineError(f"vLLM at {self.base_url} (model {self.model!r}): 404 {message}")
        return self._classify(status, message, param, f"answered HTTP {status}")

    def _event_error(self, event: dict[str, Any]) -> EngineError:
        message = _error_message(event) or json.dumps(event)[:1000]
        error = event.get("error") if isinstance(event.get("error"), dict) else event
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, str) and code.isdigit():  # some proxies send the code as text
            code = int(code)
        status = code if isinstance(code, int) else 500
        return self._classify(status, message, _error_param(event), "failed during the stream")

    def _classify(self, status: int, message: str, param: Any, what: str) -> EngineError:
        """The error for an HTTP status (or a stream error's ``code``); see the module docstring."""
        if status == 400:
            if param in _MAX_TOKENS_PARAMS or _MAX_TOKENS_ERROR.search(message):
                return EngineParameterError(f"vLLM ({self.model}) refused max_tokens: {message}")
            if param in _PROMPT_LENGTH_PARAMS or _is_context_error(message):
                return PromptTooLongError(f"vLLM ({self.model}): {message}")
            return EngineParameterError(f"vLLM ({self.model}) refused the request: {message}")
        return EngineError(f"vLLM at {self.base_url} {what}: {message}")


def _error_message(payload: dict[str, Any]) -> str | None:
    """The message of vLLM's error object, new (nested under "error") or old (flat)."""
    error = payload.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(payload.get("message"), str):
        return payload["message"]
    if isinstance(error, str):
        return error
    detail = payload.get("detail")  # FastAPI's own errors (unknown route, bad method)
    if detail is not None:
        return str(detail)
    return None


def _error_param(payload: dict[str, Any]) -> Any:
    """The ``param`` of vLLM's error object (the request field at fault), or None."""
    error = payload.get("error")
    source = error if isinstance(error, dict) else payload
    return source.get("param")


def _logprob(value: Any) -> float:
    """A logprob as sent by vLLM -> float, with its -inf stand-in (-9999.0) back to -inf."""
    logprob = float(value)
    return -math.inf if logprob <= LOGPROB_FLOOR else logprob


def _is_context_error(message: str) -> bool:
    lowered = message.lower()
    return any(hint in lowered for hint in _CONTEXT_ERROR_HINTS)


# -- KV-cache events: the trio adapter of vllm_kv_events.KVEventStream ------------------------


class KVEventSubscriber:
    """Subscribes to a vLLM server's KV-cache events over ZMQ; buffers them for :meth:`drain`.

    One SUB socket per data-parallel rank, each read by its own task that owns the rank's
    :class:`~ps_p2p.engines.vllm_kv_events.KVEventStream` (the pure core: seq tracking, replay
    decisions, decoding); a replay uses a fresh DEALER socket to the rank's replay endpoint and
    ends at the end marker or after ``replay_timeout`` seconds (then it counts as failed and the
    view resets). While a rank replays, its live messages wait in the SUB socket's queue (ZMQ's
    receive high-water mark, 1000 messages; beyond it ZMQ drops them, which the next live batch
    shows as a gap). Events of all ranks go to one :class:`EventBuffer` in arrival order; a reset
    of one rank (``AllBlocksCleared``) clears the consumer's whole view, which then under-reports
    the other ranks' blocks until they are stored again.

    Reading ZMQ from trio: each socket is used non-blocking (``zmq.NOBLOCK``) and the task waits
    with ``trio.lowlevel.wait_readable`` on the socket's ``zmq.FD``. That descriptor is
    edge-triggered and only says "``zmq.EVENTS`` may have changed", so :func:`zmq_recv_multipart`
    checks ``zmq.EVENTS`` before every wait and reads every queued message before waiting again.
    No thread is involved, and cancellation is immediate (no blocking ``recv`` with a poll
    timeout in a worker thread).

    Args:
        endpoint: the publisher to connect to, ``tcp://HOST:PORT`` (rank r at PORT + r).
        replay_endpoint: its replay ROUTER (rank r at its port + r); None: no replay.
        topic: the topic expected exactly (the SUB subscribes to it); None: any.
        data_parallel_size: ranks to subscribe to, >= 1.
        replay_timeout: seconds a whole replay may take.
        limits: see :class:`~ps_p2p.engines.vllm_kv_events.KVEventLimits`.
        max_buffered_weight: bound of the undrained events (see :class:`EventBuffer`).

    Raises:
        ConfigError: an endpoint that cannot be connected to, or ``data_parallel_size`` < 1.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str | None = None,
        data_parallel_size: int = 1,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
        limits: KVEventLimits = DEFAULT_LIMITS,
        max_buffered_weight: int = DEFAULT_MAX_BUFFERED_WEIGHT,
    ) -> None:
        if data_parallel_size < 1:
            raise ConfigError(f"data-parallel size must be >= 1, not {data_parallel_size}")
        ranks = range(data_parallel_size)
        self.endpoints = [endpoint_for_rank(endpoint, rank) for rank in ranks]
        self.replay_endpoints = (
            None if replay_endpoint is None
            else [endpoint_for_rank(replay_endpoint, rank) for rank in ranks]
        )
        topic_bytes = None if topic is None else topic.encode("utf-8")
        self._topic = topic_bytes
        self._streams = [
            KVEventStream(
                topic=topic_bytes, rank=rank, replay=replay_endpoint is not None, limits=limits
            )
            for rank in ranks
        ]
        self._limits = limits
        self._replay_timeout = replay_timeout
        self._buffer = EventBuffer(max_buffered_weight)
        self._changed = trio.Event()
        self._warned_types: set[str] = set()

    @property
    def block_size(self) -> int | None:
        """Tokens per block from the last ``BlockStored`` of any rank; None before one."""
        sizes = [s.block_size for s in self._streams if s.block_size is not None]
        return sizes[-1] if sizes else None

    @property
    def stats(self) -> KVEventStats:
        """The counters of all ranks, summed (a copy)."""
        total = KVEventStats()
        for stream in self._streams:
            total.add(stream.stats)
        return total

    @property
    def overflows(self) -> int:
        """Times the undrained events exceeded their bound and were replaced by a reset."""
        return self._buffer.overflows

    def drain(self) -> list[KVCacheEvent]:
        """All events received and not drained yet, oldest first."""
        return self._buffer.drain()

    async def wait_changed(self) -> None:
        """Wait until the next message (live or replayed) or replay failure was handled,
        whatever came of it; for callers waiting on a condition of :attr:`stats` or the
        buffer."""
        await self._changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect to every rank, then read until cancelled.

        ``task_status.started()`` comes once the sockets are connecting (ZMQ connects in the
        background and reconnects by itself; a subscription takes effect some milliseconds
        later, and messages published before it are lost to us and recovered by a replay). At
        start, each rank asks for a replay from seq 0 (when a replay endpoint is configured),
        which brings what the server still buffers of its past.

        Raises:
            EngineError: a ZMQ socket failed (not a bad message: those are dropped and
                counted); from a rank's task, inside trio's exception group.
        """
        context = zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        try:
            async with trio.open_nursery() as nursery:
                for rank, stream in enumerate(self._streams):
                    sub = self._socket(context, zmq.SUB)
                    sockets.append(sub)
                    try:
                        sub.setsockopt(zmq.SUBSCRIBE, self._topic or b"")
                        sub.connect(self.endpoints[rank])
                    except zmq.ZMQError as exc:
                        raise EngineError(f"KV events {self.endpoints[rank]}: {exc}") from exc
                    nursery.start_soon(self._serve_rank, context, rank, stream, sub)
                task_status.started()
        finally:
            for sock in sockets:
                _close(sock)
            context.destroy(linger=0)

    def _socket(self, context: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # a larger frame drops the connection before it is read (ZMQ checks it per frame)
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_payload_bytes)
        return sock

    async def _serve_rank(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        rank: int,
        stream: KVEventStream,
        sub: zmq.Socket[bytes],
    ) -> None:
        self._handle(rank, stream.start())
        while True:
            if stream.replaying:
                await self._replay(context, rank, stream)
                continue
            try:
                frames = await zmq_recv_multipart(sub)
            except zmq.ZMQError as exc:
                raise EngineError(f"KV events {self.endpoints[rank]}: {exc}") from exc
            self._handle(rank, stream.receive_live(frames))

    async def _replay(
        self, context: zmq.Context[zmq.Socket[bytes]], rank: int, stream: KVEventStream
    ) -> None:
        assert self.replay_endpoints is not None
        endpoint = self.replay_endpoints[rank]
        log.debug("KV events rank %d: replay from seq %d at %s", rank, stream.next_seq, endpoint)
        dealer = self._socket(context, zmq.DEALER)
        try:
            dealer.connect(endpoint)
            # a connecting DEALER queues the request until the connection is up
            dealer.send_multipart(replay_request(stream.next_seq), zmq.NOBLOCK)
            with trio.move_on_after(self._replay_timeout):
                while stream.replaying:
                    self._handle(rank, stream.receive_replay(await zmq_recv_multipart(dealer)))
                return
            reason = f"no end marker from {endpoint} within {self._replay_timeout:g} s"
        except zmq.ZMQError as exc:
            reason = f"{endpoint}: {exc}"
        finally:
            _close(dealer)
        self._handle(rank, stream.replay_failed(reason))

    def _handle(self, rank: int, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, EventsDecoded):
                self._buffer.extend(out.events)
                for kind in out.skipped_types:
                    if kind not in self._warned_types and len(self._warned_types) < 64:
                        self._warned_types.add(kind)
                        log.warning("KV events rank %d: skipping events of unknown type %r "
                                    "(counted in stats.skipped_events)", rank, kind)
            elif isinstance(out, Resynced):
                log.warning("KV events rank %d: view reset (%s): %s", rank, out.reason, out.detail)
            elif isinstance(out, MessageRejected):
                log.warning("KV events rank %d: dropped message (seq %s): %s", rank, out.seq,
                            out.error)
        changed, self._changed = self._changed, trio.Event()
        changed.set()


async def zmq_recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Receive one multipart message from a pyzmq socket without blocking trio.

    Checks ``zmq.EVENTS`` before each wait on the socket's (edge-triggered) ``zmq.FD``, so a
    message already queued is never left waiting for a wake-up that will not come. A
    cancellation point before a message is taken; never cancelled after one is taken (nothing
    is lost to a cancellation). One task per socket.
    """
    fd = sock.getsockopt(zmq.FD)
    await trio.lowlevel.checkpoint_if_cancelled()
    while True:
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return frames
        await trio.lowlevel.wait_readable(fd)


def _close(sock: zmq.Socket[bytes]) -> None:
    if not sock.closed:
        trio.lowlevel.notify_closing(sock.getsockopt(zmq.FD))
        sock.close(linger=0)
