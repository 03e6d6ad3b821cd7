"""Small ASGI helpers shared by the local API, the web page and the fake vLLM server (ASGI 3.0
spec)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def serve_lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI ``lifespan`` scope: acknowledge startup, return at shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def serve_asgi(
    app: Any, bind: str, flag: str, announce: str, *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` with hypercorn on ``bind`` until cancelled: ``bind`` checked
    first (errors name ``flag``), ``announce % url`` logged at INFO once bound, then
    ``task_status.started(url)``.

    Raises:
        ConfigError: ``bind`` is not HOST:PORT.
        AddressInUseError: ``"<flag> <bind> is already in use"``.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from ps_p2p.config import parse_host_port
    from ps_p2p.preflight import check_address_free

    host, port = parse_host_port(bind, flag)
    check_address_free(host, port, f"{flag} {bind}")
    config = Config()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.bind = [bind]
    config.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)  # type: ignore[arg-type]
        url = binds[0] if binds else f"http://{bind}"
        log.info(announce, url)
        task_status.started(url)
