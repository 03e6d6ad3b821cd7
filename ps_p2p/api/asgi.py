"""Small ASGI helpers shared by the local API and the fake vLLM server (ASGI 3.0 spec)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

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
