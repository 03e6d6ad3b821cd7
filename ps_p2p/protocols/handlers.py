"""Stream handlers one service registers on a host, and removes again, together.

A service may run on a host that another application owns (docs/embedding.md), so it must be
able to leave that host as it found it: :class:`StreamHandlers` registers the service's
handlers, refuses a protocol ID the host already serves (another application's handler, or a
second copy of the same service), remembers the inbound streams its handlers are serving, and
:meth:`StreamHandlers.aclose` removes the handlers and resets those streams.

py-libp2p 0.8.1 keeps handlers in ``host.get_mux().handlers`` (a dict protocol ID -> handler,
written by ``BasicHost.set_stream_handler`` and emptied by ``remove_stream_handler``); a stream
whose protocol was negotiated just before the removal reaches a handler that resets it at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol

from ps_p2p.errors import ConfigError

log = logging.getLogger(__name__)

StreamHandler = Callable[[INetStream], Awaitable[None]]
T = TypeVar("T")

#: Seconds allowed for resetting the open streams when the handlers are removed.
RESET_TIMEOUT = 1.0


def registered_protocols(host: IHost) -> frozenset[str]:
    """Protocol IDs ``host`` has a stream handler for (every service's, not only ours)."""
    handlers = getattr(host.get_mux(), "handlers", {})
    return frozenset(str(p) for p in handlers if p is not None)


class StreamHandlers:
    """The stream handlers of one service on one host (see the module docstring).

    Args:
        host: a py-libp2p host (``BasicHost`` API: ``set_stream_handler``,
            ``remove_stream_handler``, ``get_mux().handlers``).
    """

    def __init__(self, host: IHost) -> None:
        self._host = host
        self._handlers: dict[TProtocol, StreamHandler] = {}
        self._streams: dict[INetStream, trio.CancelScope] = {}
        self._closed = False

    @property
    def protocols(self) -> frozenset[str]:
        """The protocol IDs registered through this object and not yet removed."""
        return frozenset(str(p) for p in self._handlers)

    def add(self, protocol_id: str, handler: StreamHandler) -> None:
        """Serve ``protocol_id`` with ``handler`` (which must never raise) on the host.

        Raises:
            ConfigError: the host already has a handler for ``protocol_id`` (another
                application's, or these services are already attached to the host), or this
                object was closed.
        """
        if self._closed:
            raise ConfigError("these stream handlers were removed; register on a new object")
        protocol = TProtocol(protocol_id)
        if protocol_id in registered_protocols(self._host):
            raise ConfigError(
                f"the host already has a stream handler for {protocol_id} (is a ps_p2p node "
                "already attached to it?)"
            )

        async def tracked(stream: INetStream) -> None:
            if self._closed:  # negotiated just before the handler was removed
                await reset_quietly(stream)
                return
            # the handler runs in a task of the host; aclose() stops it through this scope
            with trio.CancelScope() as scope:
                self._streams[stream] = scope
                try:
                    await handler(stream)
                finally:
                    self._streams.pop(stream, None)

        self._handlers[protocol] = tracked
        self._host.set_stream_handler(protocol, tracked)

    async def aclose(self) -> None:
        """Remove the handlers (only those still ours), stop the handler calls still running
        and reset their streams.

        Idempotent; runs shielded from cancellation, at most :data:`RESET_TIMEOUT` seconds.
        """
        self._closed = True
        handlers = getattr(self._host.get_mux(), "handlers", None)
        for protocol, tracked in self._handlers.items():
            if handlers is not None and handlers.get(protocol) is not tracked:
                continue  # someone else registered the protocol since: leave theirs
            self._host.remove_stream_handler(protocol)
        self._handlers.clear()
        streams, self._streams = self._streams, {}
        if not streams:
            return
        for scope in streams.values():
            scope.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(RESET_TIMEOUT):
            for stream in streams:
                await reset_quietly(stream)
        log.debug("reset %d inbound stream(s) of removed handlers", len(streams))


async def serve_handlers(
    host: IHost, handlers: dict[str, StreamHandler], *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handlers`` (protocol ID -> handler) on ``host`` until cancelled, then remove them
    (a service's ``serve``; ``task_status.started()`` once registered).

    Raises:
        ConfigError: the host already serves one of them.
    """
    registered = StreamHandlers(host)
    try:
        for protocol_id, handler in handlers.items():
            registered.add(protocol_id, handler)
        task_status.started()
        await trio.sleep_forever()
    finally:
        await registered.aclose()


async def exchange(
    host: IHost, peer: bytes, protocol_id: str, body: Callable[[INetStream], Awaitable[T]], *,
    timeout: float,
) -> T:
    """Open a stream to ``peer`` (within ``timeout`` seconds), run ``body`` on it and close it;
    if ``body`` raises (or is cancelled) the stream is reset instead (a client's request).

    Raises:
        trio.TooSlowError: no stream within ``timeout``; what ``body`` raises; py-libp2p's dial
            and negotiation errors.
    """
    from libp2p.peer.id import ID

    with trio.fail_after(timeout):
        stream = await host.new_stream(ID(peer), [TProtocol(protocol_id)])
    try:
        result = await body(stream)
    except BaseException:
        with trio.CancelScope(shield=True):
            await reset_quietly(stream)
        raise
    try:
        await stream.close()
    except Exception as exc:
        log.debug("closing %s stream: %r", protocol_id, exc)
    return result


async def reset_quietly(stream: INetStream) -> None:
    """Reset ``stream``, ignoring a stream that is already closed or reset (for handlers that
    drop a peer's stream after bad input)."""
    try:
        await stream.reset()
    except Exception as exc:  # already closed or reset: nothing more to do
        log.debug("stream reset failed: %r", exc)


__all__ = [
    "RESET_TIMEOUT", "StreamHandler", "StreamHandlers", "exchange", "registered_protocols",
    "reset_quietly", "serve_handlers",
]
