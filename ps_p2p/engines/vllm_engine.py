"""An engine backed by a vLLM server, over its OpenAI-compatible HTTP API.

The server is started apart from the node, e.g.
``vllm serve MODEL --enable-prefix-caching --port 8000`` (prefix caching is what makes PlanetServe's
HR-tree forwarding pay off: requests that share a prefix reuse its KV cache). The client is
``httpx.AsyncClient``, which runs on trio.

Shapes assumed (vLLM's documented OpenAI-compatible server; :mod:`ps_p2p.testing.fake_vllm`
implements the same):

``POST /v1/completions``
    request ``{"model", "prompt": str | [int], "max_tokens", "temperature", "top_p", "seed",
    "stream", "stream_options": {"include_usage": true}, "prompt_logprobs": int}``
    (``prompt_logprobs`` is vLLM's extension). Answer ``{"id": "cmpl-...", "object":
    "text_completion", "created", "model", "choices": [{"index": 0, "text", "logprobs": null,
    "finish_reason": "stop" | "length", "stop_reason", "prompt_logprobs"}], "usage":
    {"prompt_tokens", "completion_tokens", "total_tokens"}}``. ``prompt_logprobs`` is a list
    aligned with the prompt tokens: ``null`` first, then per token a dict from token-ID string
    to ``{"logprob": float, "rank": int, "decoded_token": str}``, holding the prompt token itself
    and the ``prompt_logprobs`` most likely tokens.
    With ``"stream": true``: server-sent events ``data: {chunk}`` with the same ``choices``
    carrying text deltas (``finish_reason`` set on the last), then, with ``include_usage``, a
    chunk with ``"choices": []`` and ``usage``, then ``data: [DONE]``. A failure after the stream
    started is an event ``data: {"error": {...}}``.
``POST /tokenize``
    ``{"model", "prompt", "add_special_tokens"}`` -> ``{"count", "max_model_len", "tokens"}``.
``POST /detokenize``
    ``{"model", "tokens"}`` -> ``{"prompt": str}``.
``GET /v1/models``
    ``{"object": "list", "data": [{"id", "object": "model", "max_model_len", ...}]}``.
Errors
    HTTP 4xx/5xx with ``{"object": "error", "message", "type", "param", "code"}`` (newer
    versions nest it: ``{"error": {"message", "type", "param", "code"}}``; both are read). A
    prompt that does not fit gets 400 with "This model's maximum context length is N tokens..."
    (or "... longer than the maximum model length ..."); an unknown model gets 404 "The model
    `x` does not exist.".

Mapping: 400 about the context length -> :class:`~ps_p2p.errors.PromptTooLongError`; any other
HTTP error, a connection failure, a timeout or a malformed answer ->
:class:`~ps_p2p.errors.EngineError` naming the server and the cause.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from ps_p2p.engines.base import (
    FINISH_STOP,
    Completion,
    Engine,
    SamplingParams,
    StreamChunk,
    TokenScores,
)
from ps_p2p.errors import EngineError, PromptTooLongError

log = logging.getLogger(__name__)

#: seconds to wait for the server between two pieces of an answer (generation can be slow)
DEFAULT_TIMEOUT = 600.0
#: seconds to wait for a TCP connection
DEFAULT_CONNECT_TIMEOUT = 10.0

_CONTEXT_ERROR_HINTS = (
    "maximum context length",
    "maximum model length",
    "max_model_len",
    "context length",
    "context window",
    "prompt is too long",
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
    ) -> None:
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        self.base_url = base
        self.model = model
        self.model_id = model_id or model
        self.max_context = 0
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._client = httpx.AsyncClient(timeout=self._timeout, transport=transport)

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
        """Stream ``POST /v1/completions`` with ``stream: true``; counts come from ``usage``.

        Raises:
            PromptTooLongError, EngineError: see :meth:`Engine.generate`.
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
                            final = StreamChunk(text, finish_reason=finish_reason)
                        elif text:
                            yield StreamChunk(text)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if final is None:
            raise EngineError(f"vLLM at {self.base_url}: the stream ended without a finish reason")
        yield final

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        """One non-streaming ``POST /v1/completions``.

        Raises:
            PromptTooLongError, EngineError: see :meth:`Engine.complete`.
        """
        body = self._completion_body(prompt, params)
        payload = await self._request("POST", "/v1/completions", body)
        try:
            choice = payload["choices"][0]
            usage = payload["usage"]
            return Completion(
                text=str(choice["text"]),
                prompt_tokens=int(usage["prompt_tokens"]),
                completion_tokens=int(usage["completion_tokens"]),
                finish_reason=str(choice.get("finish_reason") or FINISH_STOP),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM at {self.base_url}: malformed completion: {exc!r}") from exc

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

    # -- token-level API ------------------------------------------------------------------

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``POST /tokenize``."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        payload = await self._request("POST", "/tokenize", body)
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list):
            raise EngineError(f"vLLM at {self.base_url}: malformed /tokenize answer")
        return [int(t) for t in tokens]

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
        ``prompt_logprobs: top_k``: the server's prefill is the one forward pass.

        Raises:
            ValueError: ``start`` out of [1, len(token_ids)], or ``top_k`` < 0.
            PromptTooLongError: ``len(token_ids) + 1`` > ``max_model_len``.
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
                logprobs.append(float(own["logprob"]))
                ranks.append(int(own["rank"]))
                if top is not None:
                    top.append({
                        int(key): float(value["logprob"])
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
        if isinstance(payload, dict):
            message = _error_message(payload) or message
        if status == 400 and _is_context_error(message):
            return PromptTooLongError(f"vLLM ({self.model}): {message}")
        if status == 404:
            return EngineError(f"vLLM at {self.base_url} (model {self.model!r}): 404 {message}")
        return EngineError(f"vLLM at {self.base_url} answered HTTP {status}: {message}")

    def _event_error(self, event: dict[str, Any]) -> EngineError:
        message = _error_message(event) or json.dumps(event)[:1000]
        error = event.get("error") if isinstance(event.get("error"), dict) else event
        code = error.get("code") if isinstance(error, dict) else None
        if code == 400 and _is_context_error(message):
            return PromptTooLongError(f"vLLM ({self.model}): {message}")
        return EngineError(f"vLLM at {self.base_url} failed during the stream: {message}")


def _error_message(payload: dict[str, Any]) -> str | None:
    """The message of vLLM's error object, old (flat) or new (nested under "error")."""
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


def _is_context_error(message: str) -> bool:
    lowered = message.lower()
    return any(hint in lowered for hint in _CONTEXT_ERROR_HINTS)
