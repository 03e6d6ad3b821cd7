"""A fake ``vllm serve`` for tests: vLLM's OpenAI-compatible HTTP API over any :class:`Engine`.

:class:`FakeVLLM` is a plain ASGI application answering like vLLM 0.33's server (request
validation, response shapes, error objects, server-sent events); :func:`serve_fake_vllm` runs it
with hypercorn on trio, and :func:`open_fake_vllm` is the same as an async context manager. Backed
by :class:`~ps_p2p.engines.transformers_engine.TransformersEngine` it answers with a real model.
The rules followed are those of ``DESIGN.md`` ("vLLM 0.33, verified from its source").

Endpoints (shapes in :mod:`ps_p2p.engines.vllm_engine`):

* ``GET /v1/models``, ``GET /health``, ``GET /version``;
* ``POST /v1/completions``: ``model`` (optional; another name -> 404), ``prompt`` (a string or a
  list of token IDs, one prompt), ``max_tokens`` (default 16; ``null``: all the room left),
  ``temperature`` (default 1), ``top_p``, ``seed``, ``stream``, ``stream_options.include_usage``,
  ``prompt_logprobs`` (needs the engine's token-level API);
* ``POST /tokenize``: ``prompt`` + ``add_special_tokens`` (default true), or chat ``messages``
  + ``add_generation_prompt`` (default true) + ``add_special_tokens`` (default false), rendered
  with the engine's :meth:`~ps_p2p.engines.base.Engine.chat_prompt`;
* ``POST /detokenize`` (``tokens``).

Context window (``max_model_len``, as vLLM >= 0.32):

* ``max_tokens`` > ``max_model_len`` -> 400 "max_tokens=X cannot be greater than
  max_model_len=Y..." (``param`` ``"max_tokens"``), checked before the prompt;
* a prompt of ``max_model_len`` tokens or more -> 400 "This model's maximum context length is N
  tokens. However, your prompt contains M input tokens, which exceeds this limit even without any
  output tokens..." (or "... which leaves no room for any output tokens" when M = N;
  ``param`` ``"input_tokens"``);
* otherwise prompt + ``max_tokens`` beyond the window is accepted: ``max_tokens`` is cut to
  ``max_model_len`` - prompt tokens, and an answer that uses all of them ends with
  ``finish_reason: "length"``.

``prompt_logprobs=k``: 400 when k (or the vocabulary size for k = -1) exceeds ``max_logprobs``
(default 20, vLLM's ``--max-logprobs``; -1 lifts the limit). Entries: ``None`` for the first
token, then per token ``{str(token_id): {"logprob", "rank", "decoded_token"}}`` with the prompt's
own token first (its true rank), then the k most likely tokens (ranks 1..k; a top token equal
to the prompt token appears once). ``-inf`` is sent as -9999.0, as vLLM does.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status in ``code``
(vLLM >= 0.10.1); an error after a stream started is the event ``data: {"error": {...}}``, then
``data: [DONE]``. A chat request when the engine has no chat template (``Engine.chat_template``
is None) gets vLLM's 400 "As of transformers v4.44, default chat template is no longer allowed,
so you must provide a chat template if the tokenizer does not define one.".

Not faithful (answers 400 saying so): several prompts in one request, ``n`` > 1, ``logprobs``
of generated tokens, ``echo``, ``stop``, chat completions (``/v1/chat/completions``), chat
``/tokenize`` requests with ``add_generation_prompt: false``, ``continue_final_message``, their
own ``chat_template`` or ``tools``. A prompt given as token IDs is decoded to text and generated
from that text (vLLM generates from the IDs themselves); its ``prompt_logprobs`` are of the IDs
as given. ``decoded_token`` is each token decoded alone. ``/detokenize`` uses the engine's
``decode``, which skips special tokens (vLLM's keeps them). A chat template's leading BOS is
left to the tokenizer (:meth:`~ps_p2p.engines.transformers_engine.TransformersEngine.chat_prompt`
drops it from the text), so chat token IDs start with BOS only when ``add_special_tokens``.
"""

from __future__ import annotations

import functools
import json
import math
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from ps_p2p.engines.base import ChatMessage, Engine, SamplingParams
from ps_p2p.errors import EngineError, PromptTooLongError
from ps_p2p.api.asgi import Receive, Scope, Send, serve_lifespan

log = logging.getLogger(__name__)


MAX_BODY_BYTES = 16 * 1024 * 1024
#: vLLM's default ``--max-logprobs``: most ``prompt_logprobs`` (and ``logprobs``) per request
DEFAULT_MAX_LOGPROBS = 20
#: what vLLM sends for a ``-inf`` log-probability (JSON has no infinities)
LOGPROB_FLOOR = -9999.0
#: vLLM's answer to a chat request when the model has no chat template (400)
NO_CHAT_TEMPLATE_MESSAGE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: request fields the fake does not implement -> the values it accepts for them (the defaults)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None,),
    "echo": (None, False),
    "stop": (None, "", []),
    "stop_token_ids": (None, []),
    "suffix": (None,),
}


class _HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's ``ErrorResponse`` (nested since 0.10.1)."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            },
        }


def _bad_request(message: str, param: str | None = None) -> _HTTPError:
    return _HTTPError(400, message, param=param)


class FakeVLLM:
    """ASGI application: vLLM's OpenAI-compatible server answering from ``engine``.

    Args:
        engine: answers the requests.
        served_model_name: the model name clients must send; defaults to ``engine.model_id``.
        max_model_len: context window reported and enforced; defaults to ``engine.max_context``.
        max_logprobs: most ``prompt_logprobs`` per request (vLLM's ``--max-logprobs``, default
            20); -1 for no limit.

    Attributes:
        requests: ``(method, path)`` of every HTTP request served, in order.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name or engine.model_id
        self.max_model_len = max_model_len or engine.max_context
        self.max_logprobs = max_logprobs
        self.requests: list[tuple[str, str]] = []
        self._created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        self.requests.append((method, path))
        routes: dict[str, tuple[str, Callable[[Any, Send], Awaitable[None]]]] = {
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/version": ("GET", self._version),
            "/v1/completions": ("POST", self._completions),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
        }
        try:
            if path not in routes:
                await _send_json(send, 404, {"detail": "Not Found"})
                return
            allowed, handler = routes[path]
            if method != allowed:
                await _send_json(send, 405, {"detail": "Method Not Allowed"})
                return
            body = await _read_json(receive) if method == "POST" else None
            await handler(body, send)
        except _HTTPError as exc:
            await _send_json(send, exc.status, exc.body())

    # -- endpoints ------------------------------------------------------------------------

    async def _health(self, body: Any, send: Send) -> None:
        await _send(send, 200, b"", b"application/json")

    async def _version(self, body: Any, send: Send) -> None:
        await _send_json(send, 200, {"version": "0.0.0+fake"})

    async def _models(self, body: Any, send: Send) -> None:
        name = self.served_model_name
        await _send_json(send, 200, {
            "object": "list",
            "data": [{
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [],
            }],
        })

    async def _tokenize(self, body: dict[str, Any], send: Send) -> None:
        self._check_model(body)
        if "messages" in body:
            tokens = await self._tokenize_chat(body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise _bad_request("`prompt` must be a string", param="prompt")
            add_special = _boolean(body, "add_special_tokens", True)
            tokens = await self._engine_call(
                self.engine.encode(prompt, add_special_tokens=add_special)
            )
        await _send_json(send, 200, {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        })

    async def _tokenize_chat(self, body: dict[str, Any]) -> list[int]:
        """Token IDs of the chat ``messages`` as the engine's chat template renders them."""
        for key, accepted in _UNSUPPORTED_CHAT.items():
            if body.get(key) not in accepted:
                raise _bad_request(f"the fake vLLM server does not support `{key}`", param=key)
        if not _boolean(body, "add_generation_prompt", True):
            raise _bad_request(
                "the fake vLLM server always adds the generation prompt",
                param="add_generation_prompt",
            )
        add_special = _boolean(body, "add_special_tokens", False)
        messages = _chat_messages(body.get("messages"))
        if self.engine.chat_template is None:
            raise _bad_request(NO_CHAT_TEMPLATE_MESSAGE)
        try:
            text = await self.engine.chat_prompt(messages)
        except (EngineError, ValueError) as exc:  # vLLM: a failing template is a bad request
            raise _bad_request(str(exc), param="messages") from exc
        return list(
            await self._engine_call(self.engine.encode(text, add_special_tokens=add_special))
        )

    async def _detokenize(self, body: dict[str, Any], send: Send) -> None:
        self._check_model(body)
        tokens = body.get("tokens")
        if not _is_token_list(tokens, allow_empty=True):
            raise _bad_request("`tokens` must be a list of token IDs", param="tokens")
        text = await self._engine_call(self.engine.decode(tokens))
        await _send_json(send, 200, {"prompt": text})

    async def _completions(self, body: dict[str, Any], send: Send) -> None:
        self._check_model(body)
        for key, accepted in _UNSUPPORTED.items():
            if body.get(key) not in accepted:
                raise _bad_request(f"the fake vLLM server does not support `{key}`", param=key)
        requested = _max_tokens(body)
        if requested is not None and requested > self.max_model_len:
            raise _bad_request(
                f"max_tokens={requested} cannot be greater than "
                f"max_model_len={self.max_model_len}. Please request fewer output tokens.",
                param="max_tokens",
            )
        sampling = _sampling_fields(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad_request("`stream` must be a boolean", param="stream")
        stream_options = body.get("stream_options")
        if stream_options is not None and not stream:
            raise _bad_request(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if stream_options is not None and not isinstance(stream_options, dict):
            raise _bad_request("`stream_options` must be an object", param="stream_options")
        include_usage = bool((stream_options or {}).get("include_usage", False))
        prompt_logprobs = self._check_prompt_logprobs(body.get("prompt_logprobs"), stream)

        text, prompt_ids = await self._prompt(body.get("prompt"))
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            outcome = (
                "exceeds this limit even without any output tokens" if room < 0
                else "leaves no room for any output tokens"
            )
            raise _bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(prompt_ids)} input tokens, which {outcome}. "
                f"Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        # vLLM >= 0.32: an overflowing max_tokens is cut to the room left (None: all of it)
        max_tokens = room if requested is None else min(requested, room)
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            await self._stream(
                send, request_id, created, text, len(prompt_ids), params, include_usage
            )
            return

        completion = await self._engine_call(self.engine.complete(text, params))
        choice: dict[str, Any] = {
            "index": 0,
            "text": completion.text,
            "logprobs": None,
            "finish_reason": completion.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = await self._prompt_logprobs(prompt_ids, prompt_logprobs)
        await _send_json(send, 200, {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.served_model_name,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), completion.completion_tokens),
        })

    # -- helpers --------------------------------------------------------------------------

    def _check_prompt_logprobs(self, value: Any, stream: bool) -> int | None:
        """The request's ``prompt_logprobs`` (None: not asked), checked as vLLM checks it."""
        if value is None:
            return None
        if not _is_int(value) or value < -1:
            raise _bad_request(
                "`prompt_logprobs` must be an integer >= -1", param="prompt_logprobs"
            )
        if stream:
            raise _bad_request(
                "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
        if value and self.max_logprobs != -1:
            vocab_size = getattr(self.engine, "vocab_size", None)
            wanted: float = value
            if value == -1:  # the whole vocabulary
                wanted = vocab_size if _is_int(vocab_size) else math.inf
            if wanted > self.max_logprobs:
                shown = "the whole vocabulary" if wanted == math.inf else int(wanted)
                raise _bad_request(
                    f"Requested prompt logprobs of {shown}, which is greater than max allowed: "
                    f"{self.max_logprobs}",
                    param="prompt_logprobs",
                )
        return value

    async def _stream(
        self,
        send: Send,
        request_id: str,
        created: int,
        text: str,
        prompt_tokens: int,
        params: SamplingParams,
        include_usage: bool,
    ) -> None:
        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return event({
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.served_model_name,
                "choices": choices,
                **extra,
            })

        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
        })
        completion_tokens = 0
        try:
            async for piece in self.engine.stream(text, params):
                if piece.completion_tokens is not None:
                    completion_tokens = piece.completion_tokens
                if not piece.text and piece.finish_reason is None:
                    continue
                choice = {
                    "index": 0,
                    "text": piece.text,
                    "logprobs": None,
                    "finish_reason": piece.finish_reason,
                    "stop_reason": None,
                }
                await _send_more(send, chunk([choice]))
            if include_usage:  # vLLM drops the null fields of this one
                usage = _usage(prompt_tokens, completion_tokens)
                del usage["prompt_tokens_details"]
                await _send_more(send, chunk([], usage=usage))
        except (EngineError, ValueError) as exc:
            if isinstance(exc, (PromptTooLongError, ValueError)):
                error = _bad_request(str(exc))
            else:
                error = _HTTPError(500, str(exc), "InternalServerError")
            await _send_more(send, event(error.body()))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.served_model_name:
            raise _HTTPError(
                404, f"The model `{model}` does not exist.", "NotFoundError", param="model"
            )

    async def _prompt(self, prompt: Any) -> tuple[str, list[int]]:
        """(text, token IDs) of the request's single prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, await self._engine_call(self.engine.tokenize(prompt))
        if _is_token_list(prompt, allow_empty=False):
            if any(t < 0 for t in prompt):
                raise _bad_request("token IDs must be >= 0", param="prompt")
            text = await self._engine_call(self.engine.decode(prompt))
            return text, list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise _bad_request("the fake vLLM server serves one prompt per request", param="prompt")
        raise _bad_request(
            "`prompt` must be a string or a non-empty list of token IDs", param="prompt"
        )

    async def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[str, Any] | None]:
        if len(ids) < 2:
            return [None] * len(ids)
        top_k = k if k >= 0 else 1 << 30
        scores = await self._engine_call(self.engine.score_ids(ids, 1, top_k=top_k))
        names: dict[int, str] = {}

        async def name(token_id: int) -> str:
            if token_id not in names:
                names[token_id] = await self._engine_call(self.engine.decode([token_id]))
            return names[token_id]

        entries: list[dict[str, Any] | None] = [None]
        ranks = scores.ranks or [0] * len(scores.token_ids)
        tops = scores.top_logprobs or [{} for _ in scores.token_ids]
        for token_id, logprob, rank, top in zip(scores.token_ids, scores.logprobs, ranks, tops):
            entry = {
                str(token_id): {
                    "logprob": _json_logprob(logprob),
                    "rank": rank,
                    "decoded_token": await name(token_id),
                },
            }
            ordered = sorted(top.items(), key=lambda item: -item[1])
            for position, (alt, alt_logprob) in enumerate(ordered, start=1):
                if str(alt) not in entry:
                    entry[str(alt)] = {
                        "logprob": _json_logprob(alt_logprob),
                        "rank": position,
                        "decoded_token": await name(alt),
                    }
            entries.append(entry)
        return entries

    async def _engine_call(self, awaitable: Awaitable[Any]) -> Any:
        try:
            return await awaitable
        except PromptTooLongError as exc:
            raise _bad_request(str(exc), param="input_tokens") from exc
        except EngineError as exc:
            raise _HTTPError(500, str(exc), "InternalServerError") from exc
        except ValueError as exc:
            raise _bad_request(str(exc)) from exc


#: chat ``/tokenize`` fields the fake does not implement -> the values it accepts for them
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "tools": (None, []),
    "mm_processor_kwargs": (None, {}),
}


def _chat_messages(value: Any) -> list[ChatMessage]:
    """OpenAI chat messages -> :class:`ChatMessage`; content is a string or a list of text parts
    (joined with newlines, as vLLM's "string" content format does)."""
    if not isinstance(value, list):
        raise _bad_request("`messages` must be a list of messages", param="messages")
    messages = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise _bad_request("every message needs a `role`", param="messages")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise _bad_request(
                        "the fake vLLM server takes text content parts only", param="messages"
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad_request("`content` must be a string or a list of parts", param="messages")
        messages.append(ChatMessage(item["role"], content))
    return messages


def _boolean(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise _bad_request(f"`{key}` must be a boolean", param=key)
    return value


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The request's ``max_tokens`` (default 16, vLLM's for completions); None: not limited."""
    value = body.get("max_tokens", 16)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad_request("`max_tokens` must be an integer", param="max_tokens")
    if value < 1:
        raise _bad_request(f"max_tokens must be at least 1, got {value}.", param="max_tokens")
    return value


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """``temperature``, ``top_p`` and ``seed`` of the request, checked."""

    def number(key: str, default: float) -> float:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad_request(f"`{key}` must be a number", param=key)
        return float(value)

    temperature = number("temperature", 1.0)
    if temperature < 0:
        raise _bad_request(
            f"temperature must be non-negative, got {temperature}.", param="temperature"
        )
    top_p = number("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad_request(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not _INT64_MIN <= seed <= _INT64_MAX:
            raise _bad_request("`seed` must be a 64-bit signed integer", param="seed")
        seed %= 2**64
    return {"temperature": temperature, "top_p": top_p, "seed": seed}


def _json_logprob(logprob: float) -> float:
    """``logprob`` as vLLM sends it: -inf (and NaN) become :data:`LOGPROB_FLOOR`."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any, *, allow_empty: bool) -> bool:
    return isinstance(value, list) and (allow_empty or bool(value)) and all(map(_is_int, value))


async def _read_json(receive: Receive) -> dict[str, Any]:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _bad_request("client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _HTTPError(413, "request body too large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise _bad_request(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad_request("the request body must be a JSON object")
    return body


async def _send(send: Send, status: int, data: bytes, content_type: bytes) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type), (b"content-length", str(len(data)).encode())],
    })
    await send({"type": "http.response.body", "body": data})


async def _send_more(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send(send, status, json.dumps(payload).encode(), b"application/json")


async def serve_fake_vllm(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve :class:`FakeVLLM` over ``engine`` with hypercorn until cancelled.

    ``task_status.started(url)`` gives the base URL actually bound (port 0 picks a free port),
    e.g. ``http://127.0.0.1:43117``.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    app = FakeVLLM(
        engine,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        max_logprobs=max_logprobs,
    )
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 0.5
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)  # type: ignore[arg-type]
        url = binds[0]
        log.debug("fake vLLM server for %s on %s", app.served_model_name, url)
        task_status.started(url)


@asynccontextmanager
async def open_fake_vllm(engine: Engine, **kwargs: Any) -> AsyncIterator[str]:
    """Run :func:`serve_fake_vllm` for the duration of the block; yields its base URL."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve_fake_vllm, engine, **kwargs))
        try:
            yield url
        finally:
            nursery.cancel_scope.cancel()
