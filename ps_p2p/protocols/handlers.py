"""Stream handlers one service registers on a host, and removes again, together.

A service may run on a host that another application owns (docs/embedding.md), so it must be
able to leave that host as it found it: :class:`StreamHandlers` registers the service's
handlers, refuses a protocol ID the host already serves (another application's handler, or a
second copy of the same service), remembers the inbound streams its handlers are serving, and
:meth:`StreamHandlers.aclose` removes the handlers and resets those streams.

py-libp2p 0.8.1 keeps handlers in ``host.get_mux().handlers`` (a dict protocol ID -> handler,
written by ``BasicHost.set_stream_handler`` and emptied by ``remove_stream_handler``); a stream
whose protocol was negotiated just before the removal reaches a handler that resets it at once.
A stream whose negotiation is in flight at the removal is reset too: py-libp2p's
``Multiselect.negotiate`` checks ``protocol in handlers``, awaits its reply's write, then reads
``handlers[protocol]``, and a handler removed during that write raised ``KeyError`` out of the
connection's task into the host's nursery (a loaded machine widens the write; a localnet test
failed at teardown, load 13). :class:`StreamHandlers` gives the host's mux a
:class:`RemovedHandlerDict`, whose missing entries read as a handler that resets the stream.

Every inbound stream our handlers serve is bounded (issue 16: 195 streams that never sent a byte
were held for ever):

* by count, across all services of one host (:class:`StreamBudget`): at most
  :data:`MAX_STREAMS_PER_PEER` (256: the forward service alone may serve 256 requests of one model
  node at once) per peer ID, :data:`MAX_STREAMS_PER_ADDRESS` (512) per remote IP (IPv6 /64) and
  :data:`MAX_STREAMS` (8,192) in all; a stream over a bound is reset before its handler runs;
* in time before its first byte: a stream that has sent nothing :data:`FIRST_BYTE_TIMEOUT`
  (10 s) after its handler started reads :class:`~ps_p2p.errors.RemoteProtocolError`, which every
  handler answers by resetting that stream. Time between frames is the protocols' own business
  (a link stream is rightly silent for minutes); a frame begun and not finished is bounded by
  :class:`~ps_p2p.protocols.framing.FrameReader` (30 s) or the service's read deadline.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol

from ps_p2p.errors import ConfigError, RemoteProtocolError
from ps_p2p.protocols.admission import address_keys

log = logging.getLogger(__name__)

StreamHandler = Callable[[INetStream], Awaitable[None]]
T = TypeVar("T")

#: Seconds allowed for resetting the open streams when the handlers are removed.
RESET_TIMEOUT = 1.0

#: Inbound streams of one peer ID our handlers serve at once on one host (forward: 256 a peer).
MAX_STREAMS_PER_PEER = 256

#: Inbound streams from one remote IP (IPv6 /64) our handlers serve at once on one host.
MAX_STREAMS_PER_ADDRESS = 512

#: Inbound streams our handlers serve at once on one host, all peers (py-libp2p queues more
#: than 10,000 in all: it would hold them, not refuse them).
MAX_STREAMS = 8192

#: Seconds an inbound stream may stay without its first byte once its handler has started.
FIRST_BYTE_TIMEOUT = 10.0

_REFUSED_LOG_INTERVAL = 60.0


class StreamBudget:
    """Inbound streams served at once on one host, per peer ID, per remote address and in all
    (shared by every :class:`StreamHandlers` of the host: :meth:`of`).

    Args:
        per_peer, per_address, total: the bounds (defaults: the module constants).
    """

    def __init__(self, per_peer: int = MAX_STREAMS_PER_PEER,
                 per_address: int = MAX_STREAMS_PER_ADDRESS, total: int = MAX_STREAMS) -> None:
        self.per_peer, self.per_address, self.total = per_peer, per_address, total
        self._peers: dict[bytes, int] = {}
        self._addresses: dict[str, int] = {}
        self.open = 0
        self._refused = 0
        self._reported_at = -math.inf

    @classmethod
    def of(cls, host: IHost) -> "StreamBudget":
        """The host's budget (made on first use, kept on the host object)."""
        budget = getattr(host, "_ps_stream_budget", None)
        if budget is None:
            budget = cls()
            setattr(host, "_ps_stream_budget", budget)
        return budget

    def take(self, peer: bytes, address: str) -> str | None:
        """Count one more stream of ``peer`` from ``address``; or the bound it would exceed."""
        if self.open >= self.total:
            return f"{self.total} inbound streams open in all"
        if self._peers.get(peer, 0) >= self.per_peer:
            return f"{self.per_peer} inbound streams open from this peer"
        if self._addresses.get(address, 0) >= self.per_address:
            return f"{self.per_address} inbound streams open from {address}"
        self._peers[peer] = self._peers.get(peer, 0) + 1
        self._addresses[address] = self._addresses.get(address, 0) + 1
        self.open += 1
        return None

    def give_back(self, peer: bytes, address: str) -> None:
        """One stream :meth:`take` counted has ended."""
        for counter, key in ((self._peers, peer), (self._addresses, address)):
            left = counter.get(key, 0) - 1
            if left > 0:
                counter[key] = left
            else:
                counter.pop(key, None)
        self.open = max(0, self.open - 1)

    def report_refused(self, protocol_id: str, peer: object, reason: str) -> None:
        """WARNING at most once a minute per host; the others are counted in the next one."""
        self._refused += 1
        now = trio.current_time()
        if now - self._reported_at < _REFUSED_LOG_INTERVAL:
            return
        log.warning("%s: resetting a stream from %s: %s (%d more reset since the last report)",
                    protocol_id, peer, reason, self._refused - 1)
        self._reported_at, self._refused = now, 0


class _FirstByteDeadline:
    """An inbound stream as its handler sees it: reads raise RemoteProtocolError when nothing
    has arrived by ``deadline`` (trio time); everything else is the stream's own."""

    def __init__(self, stream: INetStream, deadline: float) -> None:
        self._ps_stream = stream
        self._ps_deadline: float | None = deadline

    def __getattr__(self, name: str) -> object:
        return getattr(self._ps_stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if self._ps_deadline is None:
            return await self._ps_stream.read(n)
        with trio.move_on_at(self._ps_deadline):
            data = await self._ps_stream.read(n)
            self._ps_deadline = None
            return data
        raise RemoteProtocolError(
            f"no data {FIRST_BYTE_TIMEOUT:g} s after the stream was opened"
        )


def _stream_address(stream: INetStream) -> str:
    """The remote IP key (:func:`~ps_p2p.protocols.admission.address_keys`) of ``stream``."""
    try:
        remote = stream.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        keys = address_keys(str(remote[0])) if remote else None
    except Exception:
        keys = None
    return keys[0] if keys else "unknown"


def registered_protocols(host: IHost) -> frozenset[str]:
    """Protocol IDs ``host`` has a stream handler for (every service's, not only ours)."""
    handlers = getattr(host.get_mux(), "handlers", {})
    return frozenset(str(p) for p in handlers if p is not None)


class RemovedHandlerDict(dict):  # type: ignore[type-arg]
    """A host mux's handler table (protocol ID -> handler) in which a protocol removed while
    a negotiation of it was in flight reads as :func:`reset_removed` instead of ``KeyError``
    (module docstring); ``in``, ``get`` and the protocol list are a dict's."""

    def __missing__(self, protocol: object) -> StreamHandler:
        return reset_removed


async def reset_removed(stream: INetStream) -> None:
    """The handler of a protocol removed during its stream's negotiation: reset the stream."""
    await reset_quietly(stream)


def _removal_safe(host: IHost) -> None:
    """Give ``host``'s mux a :class:`RemovedHandlerDict` (once; same entries)."""
    mux = host.get_mux()
    handlers = getattr(mux, "handlers", None)
    if isinstance(handlers, dict) and not isinstance(handlers, RemovedHandlerDict):
        mux.handlers = RemovedHandlerDict(handlers)  # type: ignore[attr-defined]


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

        budget = StreamBudget.of(self._host)

        async def tracked(stream: INetStream) -> None:
            if self._closed:  # negotiated just before the handler was removed
                await reset_quietly(stream)
                return
            try:
                peer = stream.muxed_conn.peer_id.to_bytes()
            except Exception:
                peer = b""
            address = _stream_address(stream)
            refused = budget.take(peer, address)
            if refused is not None:
                budget.report_refused(protocol_id, getattr(stream.muxed_conn, "peer_id", "?"),
                                      refused)
                await reset_quietly(stream)
                return
            # the handler runs in a task of the host; aclose() stops it through this scope
            try:
                with trio.CancelScope() as scope:
                    self._streams[stream] = scope
                    try:
                        deadline = trio.current_time() + FIRST_BYTE_TIMEOUT
                        await handler(_FirstByteDeadline(stream, deadline))  # type: ignore[arg-type]
                    finally:
                        self._streams.pop(stream, None)
            finally:
                budget.give_back(peer, address)

        self._handlers[protocol] = tracked
        _removal_safe(self._host)
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
    "FIRST_BYTE_TIMEOUT",
    "MAX_STREAMS",
    "MAX_STREAMS_PER_ADDRESS",
    "MAX_STREAMS_PER_PEER",
    "RESET_TIMEOUT",
    "RemovedHandlerDict",
    "StreamBudget",
    "StreamHandler",
    "StreamHandlers",
    "exchange",
    "registered_protocols",
    "reset_quietly",
    "reset_removed",
    "serve_handlers",
]
