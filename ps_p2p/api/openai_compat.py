"""The local HTTP API of a user node: OpenAI-compatible, on Starlette (ASGI) served by hypercorn
on trio, bodies validated by pydantic models. docs/api.md has the full reference.

Endpoints (bind to loopback: anyone who can reach it can spend the user's anonymity):

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` — OpenAI's request bodies. The
  prompt (or the chat, rendered by the model node with its model's chat template) goes through
  the anonymous overlay. Honoured: ``model``, ``max_tokens`` (``max_completion_tokens`` for
  chats), ``temperature``, ``top_p``, ``seed``, ``stop`` (string or up to 4), ``n`` (up to 8:
  n anonymous requests), ``stream`` with ``stream_options.include_usage`` (server-sent events in
  OpenAI's chunk format, ``data: [DONE]`` last; the text is streamed through the overlay as the
  model node generates it, docs/streaming.md), and our extension ``timeout`` (seconds).
  Parameters we cannot honour (``logprobs``, ``echo``, ``suffix``, ``best_of`` > 1,
  ``logit_bias``, non-zero penalties, tools) are refused with a 400 naming the field, as is
  any value out of range; nothing is silently ignored. Every answer has an extra
  ``planetserve`` member: ``served_by`` (peer ID), ``forwarded_by`` (the model node asked,
  when it forwarded the request to ``served_by``; else null), ``signature_valid``,
  ``cloves_received``, ``latency_ms``, ``attempts``.
* ``GET /v1/models`` and ``GET /v1/models/{id}`` — the model IDs of the directory's model nodes.
* ``GET /status`` — peer ID, directory size, ready paths and ``ready`` (what a script waits for).
* ``GET /health`` — 200 ``{"ok": true, "reasons": []}`` when the node can serve its roles, else
  503 with the reasons (:func:`ps_p2p.health.node_health`), as vLLM's ``/health``.
* ``GET /``, ``GET /web``, ``GET /web/network.json``, ``GET /web/chat`` — the node's web page
  (the network as it sees it, and a chat over this API: :mod:`ps_p2p.api.web`).
* ``GET /metrics`` — the node's Prometheus metrics (:mod:`ps_p2p.metrics`), as vLLM serves them
  on its API port (``--metrics`` serves them on a port of their own, for nodes without an API).

Errors are OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``: 400 for a
bad body or a request the model node refused (``invalid_request_error``), 404 for an unknown
model (``model_not_found``) or route, 503 when the network cannot serve it now (no paths, no
model node, overloaded), 504 when the deadline passed, 502 for anything else; chosen by the
class of the request's typed outcome (:func:`http_status`). In a stream that has started, an
error is an event ``data: {"error": ...}`` before ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

import trio
from libp2p.peer.id import ID
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ps_p2p.api.asgi import serve_asgi
from ps_p2p.api.web import web_routes
from ps_p2p.errors import (
    DirectoryError,
    ModelNodeLostError,
    OverloadedError,
    PathError,
    PsError,
    RequestRefusedError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from ps_p2p.inference import ChatMessage
from ps_p2p.roles.user import Answer
from ps_p2p.verification.mix import RequestShape

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
#: Longest deadline a request may ask for (seconds).
MAX_TIMEOUT_S = 3600.0
#: Most choices one request may ask for (each is its own anonymous request).
MAX_N = 8
#: Most tokens a request may ask for (the model nodes' limit, ps_p2p.serving.dispatch).
MAX_TOKENS = 4096
DEFAULT_MAX_TOKENS = 128


def _b58(peer: bytes) -> str:
    return ID(peer).to_base58() if peer else ""


# ---------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    """Fields common to both endpoints (OpenAI's names and ranges)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None  # accepted, never sent anywhere
    timeout: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S)  # our extension
    # refused unless at their neutral value (validated in _refuse_unsupported)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """``null`` for an optional parameter means its default, as OpenAI and vLLM take it."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not 0 < len(s) <= 256 for s in stops):
            raise ValueError("stop strings must have 1..256 characters")
        return value

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Body):
    """``POST /v1/completions``."""

    prompt: str | list[str]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[str]) -> str | list[str]:
        prompts = [value] if isinstance(value, str) else value
        if len(prompts) != 1:
            raise ValueError("exactly one prompt (a string) per request")
        if not prompts[0].strip():
            raise ValueError("the prompt must not be empty")
        return value

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class _Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _check_parts(cls, value: str | list[dict[str, Any]] | None) -> Any:
        """Content parts must be ``{"type": "text", "text": str}``: a model node serves text
        only, so an image, audio or file part is refused by name, not by a schema dump."""
        for part in value if isinstance(value, list) else ():
            if part.get("type") != "text":
                raise ValueError(
                    f"only text content is supported (got a {part.get('type')!r} part)")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text part needs a 'text' string")  # noqa: TRY004 (pydantic)
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    """``POST /v1/chat/completions`` (text messages only)."""

    messages: Annotated[list[_Message], Field(min_length=1, max_length=256)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None

    def chat(self) -> tuple[ChatMessage, ...]:
        return tuple(ChatMessage(m.role, m.text()) for m in self.messages)


def _refuse_unsupported(body: _Body) -> None:
    """A 400 naming the first parameter we cannot honour at the value asked."""
    checks: list[tuple[str, bool]] = [
        ("presence_penalty", bool(body.presence_penalty)),
        ("frequency_penalty", bool(body.frequency_penalty)),
        ("logit_bias", bool(body.logit_bias)),
        ("logprobs", body.logprobs not in (None, False, 0)),
    ]
    if isinstance(body, CompletionBody):
        checks += [
            ("echo", body.echo),
            ("suffix", bool(body.suffix)),
            ("best_of", body.best_of not in (None, 1)),
        ]
    if isinstance(body, ChatBody):
        checks += [
            ("tools", bool(body.tools)),
            ("tool_choice", body.tool_choice not in (None, "none")),
            ("response_format", (body.response_format or {}).get("type", "text") != "text"),
            ("top_logprobs", bool(body.top_logprobs)),
        ]
    for param, refused in checks:
        if refused:
            raise ApiError(400, f"'{param}' is not supported by this network", param=param)
    if body.stream and body.n > 1:
        raise ApiError(400, "'n' > 1 cannot be streamed; ask n requests instead", param="n")


# ---------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(
        self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
        code: str | None = None, extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _KIND_BY_STATUS.get(status, "api_error")
        self.param = param
        self.code = code
        self.extra = extra or {}

    def payload(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code},
            **self.extra,
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status)


_KIND_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
    502: "planetserve_error",
}

#: HTTP status of a failed request by its outcome's class (first match in this order).
_STATUS_BY_ERROR: tuple[tuple[type[PsError], int], ...] = (
    (RequestTimeoutError, 504),
    (OverloadedError, 503),
    (PathError, 503),  # NoPathError: too few paths ready
    (DirectoryError, 503),  # NoModelNodeError: no model node for the model ID
    (ModelNodeLostError, 503),  # the model node died under the request, none other left
    (RequestRefusedError, 400),  # BAD_REQUEST, WRONG_MODEL, PROMPT_TOO_LONG (signed)
    (RequestTooLargeError, 400),
)


def http_status(error: PsError | None) -> int:
    """The HTTP status of a request's typed outcome: 504 deadline passed; 503 no paths, no
    model node (none listed, or the one asked stopped answering) or overloaded; 400 the request itself is at fault; 502 anything else (another
    signed error status, a bug)."""
    for cls, code in _STATUS_BY_ERROR:
        if isinstance(error, cls):
            return code
    return 502


def _meta(answer: Answer) -> dict[str, Any]:
    return {
        "request_id": answer.request_id.hex(),
        "served_by": _b58(answer.served_by),
        "forwarded_by": _b58(answer.forwarded_by) if answer.forwarded_by else None,
        "signature_valid": answer.signature_valid,
        "cloves_received": answer.cloves_received,
        "latency_ms": round(answer.latency_ms, 1),
        "attempts": answer.attempts,
    }


def answer_error(answer: Answer) -> ApiError:
    """The error answer of a failed request."""
    meta = _meta(answer)
    meta["error_type"] = answer.error_type.__name__ if answer.error_type else None
    status = http_status(answer.exception)
    kind = "invalid_request_error" if status == 400 else "planetserve_error"
    return ApiError(status, answer.error, kind=kind, code=meta["error_type"],
                    extra={"planetserve": meta})


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)) or None
    message = first.get("msg", "invalid body")
    if param:
        message = f"'{param}': {message}"
    return ApiError(400, message, param=param.split(".")[0] if param else None)


# ---------------------------------------------------------------------------- application


class UserAPI:
    """The ASGI application over a running :class:`~ps_p2p.node.Node` with the user role
    (or anything with its ``user``, ``directory``, ``keys``, ``config`` and ``listen_addrs``)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        #: model IDs listed since start: asked for while no model node serves them, they get
        #: 503 "no model node" (the network cannot serve it now), not 404 (never heard of)
        self._seen_models: set[str] = set()
        self.app = Starlette(
            routes=[
                Route("/status", self._status, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self._model, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                *web_routes(node, chat=True),  # the web page and its chat (ps_p2p.api.web)
            ],
            exception_handlers={HTTPException: self._http_error, ApiError: self._api_error},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    @staticmethod
    async def _http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return ApiError(exc.status_code, message, kind="invalid_request_error", code=code).response()

    @staticmethod
    async def _api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    # -- read-only endpoints ----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        node = self.node
        directory = node.directory
        paths = []
        if node.user is not None:
            for p in node.user.ready_paths():
                paths.append({
                    "relays": [_b58(r) for r in p.relays],
                    "proxy": _b58(p.relays[-1]),
                    "age_s": round(trio.current_time() - p.created_at, 1),
                })
        return {
            "peer_id": node.keys.identity.peer_id_str,
            "roles": list(node.config.roles),
            "listen": node.listen_addrs,
            "directory": None if directory is None else {
                "height": directory.height,
                "users": len(directory.users()),
                "model_nodes": len(directory.model_nodes()),
            },
            "ready_paths": paths,
            "ready": (
                directory is not None and bool(self.model_ids())
                and len({p["proxy"] for p in paths}) >= node.config.user.total
            ),
        }

    def model_ids(self) -> list[str]:
        """The models of the reachable trusted model nodes (a model node found lost is left
        out until it renews its record: :meth:`UserClient.reachable_model_nodes`)."""
        user = self.node.user
        ids = sorted({r.model_id for r in (user.reachable_model_nodes() if user else [])})
        self._seen_models.update(ids)
        return ids

    @staticmethod
    def _model_object(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "planetserve"}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_object(m) for m in self.model_ids()]}

    async def _status(self, request: Request) -> Response:
        return JSONResponse(self.status())

    async def _health(self, request: Request) -> Response:
        from ps_p2p.health import node_health

        health = node_health(self.node)
        return JSONResponse(health.as_json(), status_code=200 if health.ok else 503)

    async def _metrics(self, request: Request) -> Response:
        metrics = getattr(self.node, "metrics", None)
        if metrics is None:
            raise ApiError(404, "this node keeps no metrics", code="not_found")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # on the node's trio thread: the collector reads the node directly (ps_p2p.metrics)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        return JSONResponse(self.models())

    async def _model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in self.model_ids():
            raise _unknown_model(model_id)
        return JSONResponse(self._model_object(model_id))

    # -- generation -------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionBody)
        return await self._generate(body, prompt=body.prompt_text(), chat=False,
                                    max_tokens=body.max_tokens)

    async def _chat(self, request: Request) -> Response:
        body = await _parse(request, ChatBody)
        return await self._generate(body, messages=body.chat(), chat=True,
                                    max_tokens=body.max_completion_tokens or body.max_tokens)

    async def _generate(
        self, body: _Body, *, chat: bool, max_tokens: int | None, prompt: str = "",
        messages: tuple[ChatMessage, ...] = (),
    ) -> Response:
        _refuse_unsupported(body)
        user = self.node.user
        if user is None:
            raise ApiError(503, "this node has no user role", code="no_user_role")
        if (body.model is not None and body.model not in self.model_ids()
                and body.model not in self._seen_models):
            raise _unknown_model(body.model)  # a model seen before fails below with 503
        model_id = body.model
        if body.stream and model_id is None:
            # every chunk names the model (OpenAI's chunks do), so fix it before the first:
            # the model of the trusted model node listed first (highest reputation)
            model_id = next((r.model_id for r in user.model_nodes()), None)
        ask = _Ask(
            user, prompt=prompt, messages=messages, model_id=model_id,
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=body.temperature,
            top_p=body.top_p, seed=body.seed, stop=body.stops(), timeout=body.timeout,
        )
        recorder = getattr(self.node, "shape_recorder", None)
        if recorder is not None:  # a verifier learns its users' mix: buckets, never text
            shape = RequestShape.of_ask(prompt, messages, stream=bool(body.stream),
                                        **{k: ask.kwargs[k] for k in _SHAPE_ARGS})
            for _ in range(1 if body.stream else body.n):
                recorder.record(shape)
        if body.stream:
            return _EventStream(ask, chat=chat, include_usage=body.include_usage())
        answers = await ask.many(body.n)
        failed = next((a for a in answers if not a.ok), None)
        if failed is not None:
            raise answer_error(failed)
        return JSONResponse(_completion_object(answers, chat=chat))


def _unknown_model(model_id: str) -> ApiError:
    return ApiError(404, f"The model '{model_id}' does not exist", param="model",
                    code="model_not_found")


async def _parse(request: Request, model: type[_Body]) -> Any:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(400, f"body over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ApiError(400, f"body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


#: The ``ask`` arguments a request's shape reads (:class:`~ps_p2p.verification.mix.RequestShape`).
_SHAPE_ARGS = ("max_tokens", "temperature", "top_p", "seed", "stop")


class _Ask:
    """One API request's arguments to :meth:`~ps_p2p.roles.user.UserClient.ask`."""

    def __init__(self, user: Any, **kwargs: Any) -> None:
        self.user = user
        self.kwargs = kwargs
        self.created = int(time.time())
        self.stream_id = secrets.token_hex(12)

    async def one(self, index: int = 0, on_text: Any = None) -> Answer:
        kwargs = dict(self.kwargs)
        if index and kwargs["seed"] is not None:
            kwargs["seed"] = (kwargs["seed"] + index) % 2**63  # n seeded choices differ
        return await self.user.ask(**kwargs, on_text=on_text)

    async def many(self, n: int) -> list[Answer]:
        answers: list[Answer | None] = [None] * n

        async def run(i: int) -> None:
            answers[i] = await self.one(i)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(run, i)
        return [a for a in answers if a is not None]


def _usage(answers: Sequence[Answer]) -> dict[str, int]:
    prompt = answers[0].prompt_tokens if answers else 0
    completion = sum(a.completion_tokens for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _completion_object(answers: Sequence[Answer], *, chat: bool) -> dict[str, Any]:
    first = answers[0]
    choices: list[dict[str, Any]] = []
    for i, a in enumerate(answers):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": a.text},
                            "finish_reason": a.finish_reason or "stop", "logprobs": None})
        else:
            choices.append({"index": i, "text": a.text, "finish_reason": a.finish_reason or "stop",
                            "logprobs": None})
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + first.request_id.hex(),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": first.model_id,
        "choices": choices,
        "usage": _usage(answers),
        "planetserve": _meta(first) if len(answers) == 1 else [_meta(a) for a in answers],
    }


class _EventStream(Response):
    """Server-sent events of one streamed request (OpenAI's chunk format), written by
    Starlette's :class:`~starlette.responses.StreamingResponse` (which also stops the stream
    when the client disconnects; the request is then cancelled).

    What Starlette does not do, and this class does: the HTTP status is chosen once the first
    text or the outcome arrives, so a request that fails before any text gets its error status
    and object, like an unstreamed one (a ``StreamingResponse`` sends 200 before its first
    chunk); once text has been sent, a failure is an error event before ``[DONE]``.
    """

    def __init__(self, ask: _Ask, *, chat: bool, include_usage: bool) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.ask = ask
        self.chat = chat
        self.include_usage = include_usage

    def _chunk(self, answer_id: str, model: str, delta: str | None,
               finish_reason: str | None = None, *, role: bool = False) -> dict[str, Any]:
        if self.chat:
            d: dict[str, Any] = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish_reason,
                                      "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason,
                      "logprobs": None}
        return {
            "id": answer_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.ask.created,
            "model": model,
            "choices": [choice],
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events_in, events_out = trio.open_memory_channel[str | Answer](math.inf)

        async def run() -> None:
            answer = await self.ask.one(0, on_text=events_in.send_nowait)
            events_in.send_nowait(answer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            first = await events_out.receive()
            if isinstance(first, Answer) and not first.ok:
                response: Response = answer_error(first).response()
            else:
                response = StreamingResponse(
                    self._events(first, events_out), media_type="text/event-stream",
                    headers={"cache-control": "no-cache"})
            await response(scope, receive, send)
            nursery.cancel_scope.cancel()  # the client went away mid-stream: stop the request

    async def _events(
        self, first: str | Answer, events: trio.MemoryReceiveChannel[str | Answer]
    ) -> AsyncIterator[str]:
        answer_id = ("chatcmpl-" if self.chat else "cmpl-") + self.ask.stream_id
        model = self.ask.kwargs.get("model_id") or ""

        def event(payload: dict[str, Any] | str) -> str:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            return f"data: {data}\n\n"

        if self.chat:
            yield event(self._chunk(answer_id, model, "", role=True))
        item = first
        while not isinstance(item, Answer):
            yield event(self._chunk(answer_id, model, item))
            item = await events.receive()
        answer = item
        if answer.ok:
            yield event(self._chunk(answer_id, answer.model_id or model,
                                    None if self.chat else "", answer.finish_reason or "stop"))
            if self.include_usage:
                chunk = self._chunk(answer_id, answer.model_id or model, None)
                chunk["choices"] = []
                chunk["usage"] = _usage([answer])
                chunk["planetserve"] = _meta(answer)
                yield event(chunk)
        else:
            yield event(answer_error(answer).payload())
        yield event("[DONE]")


async def serve_api(
    node: Any, bind: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve :class:`UserAPI` on ``bind`` ("127.0.0.1:0" picks a port) until cancelled.

    ``task_status.started(url)`` gives the base URL actually bound, e.g. ``http://127.0.0.1:43117``.

    Raises:
        ConfigError: ``bind`` is not HOST:PORT.
        AddressInUseError: ``"--api <bind> is already in use"`` (one line, instead of
            hypercorn's traceback).
    """
    await serve_asgi(UserAPI(node), bind, "--api", "local API on %s", task_status=task_status)
