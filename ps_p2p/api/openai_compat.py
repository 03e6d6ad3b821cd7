"""The local HTTP API of a user node (OpenAI-compatible completions), served by hypercorn on trio.

Endpoints (bind to loopback: anyone who can reach it can spend the user's anonymity):

* ``POST /v1/completions`` — body as OpenAI's completions API: ``prompt`` (string), ``model``
  (optional: any model node's model ID), ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
  and our extension ``timeout`` (seconds). The prompt goes through the anonymous overlay; the
  reply is a ``text_completion`` object with an extra ``planetserve`` member: ``served_by``
  (peer ID), ``signature_valid``, ``cloves_received``, ``latency_ms``, ``attempts``.
  Failures answer OpenAI-style ``{"error": {"message", "type", "code"}}`` with 400 (bad body, or
  a request the model node refused), 503 (no paths or model node; overloaded), 504 (deadline
  passed) or 502 (other), chosen by the class of the request's typed outcome (:func:`http_status`);
  ``planetserve.error_type`` names that class.
* ``GET /v1/models`` — the model IDs of the directory's model nodes.
* ``GET /status`` — peer ID, directory size, this user's ready paths (relay peer IDs) and
  ``ready``: a model node is known and the ready paths reach n distinct proxies, so a request
  goes out at once with one clove per proxy (what a script waits for before its first request).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import trio
from libp2p.peer.id import ID

from ps_p2p.errors import (
    DirectoryError,
    OverloadedError,
    PathError,
    PsError,
    RequestRefusedError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from ps_p2p.roles.user import Answer
from ps_p2p.api.asgi import Receive, Scope, Send, serve_lifespan

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
#: Longest deadline a request may ask for (seconds).
MAX_TIMEOUT_S = 3600.0



def _b58(peer: bytes) -> str:
    return ID(peer).to_base58() if peer else ""


class UserAPI:
    """ASGI application over a running :class:`~ps_p2p.node.Node` with the user role."""

    def __init__(self, node: Any) -> None:
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if method == "GET" and path == "/status":
                await _json(send, 200, self.status())
            elif method == "GET" and path == "/v1/models":
                await _json(send, 200, self.models())
            elif method == "POST" and path == "/v1/completions":
                body = await _read_body(receive)
                status, payload = await self.completions(body)
                await _json(send, status, payload)
            else:
                await _json(send, 404, _error(f"no route {method} {path}", "not_found"))
        except _BadRequest as exc:
            await _json(send, 400, _error(str(exc), "invalid_request_error"))

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
                directory is not None and bool(directory.model_nodes())
                and len({p["proxy"] for p in paths}) >= node.config.user.total
            ),
        }

    def models(self) -> dict[str, Any]:
        ids = sorted({r.model_id for r in (self.node.user.model_nodes() if self.node.user else [])})
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "planetserve"} for m in ids]}

    async def completions(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.node.user is None:
            return 503, _error("this node has no user role", "unavailable")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _BadRequest("'prompt' must be a non-empty string")
        try:
            kwargs = dict(
                model_id=body.get("model") or None,
                max_tokens=int(body.get("max_tokens", 128)),
                temperature=float(body.get("temperature", 0.0)),
                top_p=float(body.get("top_p", 1.0)),
                seed=int(body.get("seed") or 0),
                timeout=float(body["timeout"]) if "timeout" in body else None,
            )
        except (TypeError, ValueError) as exc:
            raise _BadRequest(f"bad parameter: {exc}") from exc
        if not 1 <= kwargs["max_tokens"] <= 4096:
            raise _BadRequest("'max_tokens' must be in 1..4096")
        timeout = kwargs["timeout"]
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:  # also refuses NaN
            raise _BadRequest(f"'timeout' must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")
        answer = await self.node.user.ask(prompt, **kwargs)
        return _answer_to_http(answer)


#: HTTP status of a failed request by its outcome's class (first match in this order).
_STATUS_BY_ERROR: tuple[tuple[type[PsError], int], ...] = (
    (RequestTimeoutError, 504),
    (OverloadedError, 503),
    (PathError, 503),  # NoPathError: too few paths ready
    (DirectoryError, 503),  # NoModelNodeError: no model node for the model ID
    (RequestRefusedError, 400),  # BAD_REQUEST, WRONG_MODEL, PROMPT_TOO_LONG (signed)
    (RequestTooLargeError, 400),
)


def http_status(error: PsError | None) -> int:
    """The HTTP status of a request's typed outcome: 504 deadline passed; 503 no paths, no
    model node or overloaded; 400 the request itself is at fault; 502 anything else (another
    signed error status, a bug)."""
    for cls, code in _STATUS_BY_ERROR:
        if isinstance(error, cls):
            return code
    return 502


def _answer_to_http(answer: Answer) -> tuple[int, dict[str, Any]]:
    meta = {
        "request_id": answer.request_id.hex(),
        "served_by": _b58(answer.served_by),
        "signature_valid": answer.signature_valid,
        "cloves_received": answer.cloves_received,
        "latency_ms": round(answer.latency_ms, 1),
        "attempts": answer.attempts,
    }
    if not answer.ok:
        code = http_status(answer.exception)
        meta["error_type"] = answer.error_type.__name__ if answer.error_type else None
        payload = _error(answer.error, "planetserve_error")
        payload["planetserve"] = meta
        return code, payload
    return 200, {
        "id": "cmpl-" + answer.request_id.hex(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": answer.model_id,
        "choices": [{"index": 0, "text": answer.text, "finish_reason": None, "logprobs": None}],
        "usage": {"completion_tokens": answer.completion_tokens},
        "planetserve": meta,
    }


class _BadRequest(Exception):
    pass


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None}}


async def _read_body(receive: Receive) -> dict[str, Any]:
    chunks = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BadRequest(f"body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except ValueError as exc:
        raise _BadRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    return body


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
    })
    await send({"type": "http.response.body", "body": data})


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
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from ps_p2p.config import parse_host_port
    from ps_p2p.preflight import check_address_free

    host, port = parse_host_port(bind, "--api")
    check_address_free(host, port, f"--api {bind}")

    config = Config()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.bind = [bind]
    config.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, UserAPI(node), config)  # type: ignore[arg-type]
        url = binds[0] if binds else f"http://{bind}"
        log.info("local API on %s", url)
        task_status.started(url)
