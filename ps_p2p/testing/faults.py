"""TEST ONLY: network faults and a clock offset for real ``ps-node run`` processes (issue 17).

Never used unless a node's config names a control file (``[testing] faults_file``, no command
line flag); the node then logs a warning at start. What it does, per remote peer:

* **delay**: every byte to and from the peer is held ``delay_s`` seconds in each direction
  (a round trip gains ``2 * delay_s``), in order: a byte never overtakes an earlier one, also
  when the delay shrinks (it then waits behind the bytes still held, as in a FIFO link);
* **partition**: open connections to the peer are cut at once (reads and writes fail, the
  underlying connection is closed), and new ones, dialled or accepted, are closed right after
  the security handshake (when the peer is known) until the rule is lifted.

Where: :meth:`FaultInjector.install` wraps the host's ``upgrader.upgrade_connection``, so every
connection is wrapped (a :class:`DelayedConn`) between its Noise session and its Yamux muxer:
every protocol sees the fault, as on a real network. Not delayed: the TCP and Noise handshakes
of a new connection (the peer is unknown before the handshake). Refused connections fail
fast, as a network answering with a reset would, not as one dropping packets.

Plus a **clock offset**: ``clock_offset_s`` seconds added to the wall clock the verifier uses
for its block times and the timeliness check (:meth:`FaultInjector.unix_ms`, injected into the
consensus service; nothing patched globally).

The control file is JSON, re-read when its modification time or size changes (polled every
``interval`` seconds, a ``stat`` call); write it atomically (:func:`write_faults`). Shape::

    {"clock_offset_s": -28.0,
     "default": {"delay_s": 0.0},
     "peers": {"12D3KooW...": {"delay_s": 4.5}, "12D3KooX...": {"partitioned": true}}}

``default`` applies to every peer not listed (a WAN profile). The pure part, :class:`Faults`
and :func:`parse_faults`, and :class:`DelayedConn` (any py-libp2p ``ReadWriteCloser``: a raw
TCP connection or a secure session) are meant for reuse, e.g. by a multi-host testnet's WAN
profiles (issue 20).

Accuracy (measured, docs/consensus/perturb.md): a timer wakes a held chunk when it is due, so
a chunk is late by the event loop's scheduling latency only (a loaded loop: more).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import base58
import trio
from libp2p.io.exceptions import ConnectionClosedError

from ps_p2p.errors import ConfigError

log = logging.getLogger(__name__)

#: Bytes one direction of a :class:`DelayedConn` holds at most; a writer waits, the reader
#: stops reading (the peer's TCP flow control then applies) beyond it.
MAX_HELD_BYTES = 32 << 20
#: Seconds a closing :class:`DelayedConn` waits for its held bytes (a Yamux GoAway...).
CLOSE_FLUSH_S = 1.0
#: Seconds between two checks of the control file's modification time.
WATCH_INTERVAL = 0.2


@dataclass(frozen=True)
class LinkRule:
    """The faults of one link (this node to one peer).

    Attributes:
        delay_s: seconds each byte is held, in each direction (>= 0).
        partitioned: no connection to the peer (open ones cut, new ones refused).
    """

    delay_s: float = 0.0
    partitioned: bool = False


NO_FAULT = LinkRule()


@dataclass(frozen=True)
class Faults:
    """The faults in force (immutable: a new file makes a new one).

    Attributes:
        peers: rule by peer ID (bytes).
        default: the rule of every peer not in ``peers``.
        clock_offset_s: seconds added to the verifier's wall clock (negative: behind).
    """

    peers: Mapping[bytes, LinkRule] = field(default_factory=dict)
    default: LinkRule = NO_FAULT
    clock_offset_s: float = 0.0

    def rule(self, peer: bytes) -> LinkRule:
        """The rule for ``peer`` (its own, else ``default``)."""
        return self.peers.get(peer, self.default)


def _rule(value: Any, where: str) -> LinkRule:
    if not isinstance(value, dict) or set(value) - {"delay_s", "partitioned"}:
        raise ConfigError(f"faults: {where} must be {{\"delay_s\": s, \"partitioned\": bool}}")
    delay = value.get("delay_s", 0.0)
    partitioned = value.get("partitioned", False)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) \
            or not 0 <= delay < math.inf:
        raise ConfigError(f"faults: {where} delay_s must be a number >= 0, not {delay!r}")
    if not isinstance(partitioned, bool):
        raise ConfigError(f"faults: {where} partitioned must be true or false")
    return LinkRule(float(delay), partitioned)


def parse_faults(data: Any) -> Faults:
    """Build :class:`Faults` from the control file's JSON value (shape: module docstring).

    Raises:
        ConfigError: not that shape (unknown key, bad peer ID, negative delay...).
    """
    if not isinstance(data, dict) or set(data) - {"peers", "default", "clock_offset_s"}:
        raise ConfigError("faults: expected an object with peers, default, clock_offset_s")
    peers: dict[bytes, LinkRule] = {}
    raw_peers = data.get("peers", {})
    if not isinstance(raw_peers, dict):
        raise ConfigError("faults: peers must be an object {peer ID: rule}")
    for text, value in raw_peers.items():
        try:
            peer = base58.b58decode(text)
        except ValueError:
            raise ConfigError(f"faults: {text!r} is not a base58 peer ID") from None
        peers[peer] = _rule(value, f"peer {text}")
    default = _rule(data.get("default", {}), "default")
    offset = data.get("clock_offset_s", 0.0)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(
            offset):
        raise ConfigError(f"faults: clock_offset_s must be a number, not {offset!r}")
    return Faults(peers, default, float(offset))


def load_faults(path: str | pathlib.Path) -> Faults:
    """Read and parse the control file; a missing file means no fault.

    Raises:
        ConfigError: unreadable, not JSON, or not the shape of :func:`parse_faults`.
    """
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        return Faults()
    except OSError as exc:
        raise ConfigError(f"faults: cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"faults: {path} is not JSON: {exc}") from exc
    return parse_faults(data)


def write_faults(path: str | pathlib.Path, *, peers: Mapping[str, LinkRule] | None = None,
                 default: LinkRule = NO_FAULT, clock_offset_s: float = 0.0) -> None:
    """Write a control file atomically (a temporary file renamed over it), for scripts.

    Args:
        peers: rule by base58 peer ID.
    """
    path = pathlib.Path(path)
    data = {"clock_offset_s": clock_offset_s,
            "default": {"delay_s": default.delay_s, "partitioned": default.partitioned},
            "peers": {p: {"delay_s": r.delay_s, "partitioned": r.partitioned}
                      for p, r in (peers or {}).items()}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class LinkCut(ConnectionClosedError):
    """TEST ONLY: a read or write on a connection cut by a partition rule (py-libp2p's
    connection-closed error, so every layer above treats it as a closed connection)."""


class _Direction:
    """Chunks held in one direction: (due time, bytes or an exception to raise), in order."""

    def __init__(self) -> None:
        self.chunks: collections.deque[tuple[float, bytes | BaseException]] = collections.deque()
        self.held = 0
        self.last_due = -math.inf
        self.changed = trio.Event()

    def put(self, due: float, item: bytes | BaseException) -> None:
        due = max(due, self.last_due)  # order kept when the delay shrinks
        self.last_due = due
        self.chunks.append((due, item))
        if isinstance(item, bytes):
            self.held += len(item)
        self.wake()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class DelayedConn:
    """TEST ONLY: a py-libp2p ``ReadWriteCloser`` whose bytes are held ``delay()`` seconds in
    each direction, in order (see the module docstring).

    Two tasks run in ``nursery`` while the connection is open: one reads the inner connection
    as bytes arrive (stamping each chunk with its arrival time), one writes held chunks once
    due. ``delay`` is read for each chunk, so a rule change applies to the next byte.
    Every other attribute (``is_initiator``, ``get_remote_peer``...) is the inner one's.

    Args:
        inner: the connection wrapped (raw TCP or a secure session).
        delay: seconds to hold a chunk, now.
        nursery: where the two tasks run.
        clock: trio's clock (seconds).
    """

    def __init__(self, inner: Any, delay: Callable[[], float], nursery: trio.Nursery, *,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.inner = inner
        self._delay = delay
        self._clock = clock
        self._in = _Direction()
        self._out = _Direction()
        self._cut: BaseException | None = None
        self._closed = False
        self._writing = False
        self._read_lock = trio.Lock()
        self._cancel = trio.CancelScope()
        nursery.start_soon(self._pumps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ the two pumps

    async def _pumps(self) -> None:
        with self._cancel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_in)
                nursery.start_soon(self._pump_out)

    async def _pump_in(self) -> None:
        while True:
            while self._in.held >= MAX_HELD_BYTES:
                await self._in.changed.wait()
            try:
                data = await self.inner.read(None)
            except trio.Cancelled:
                raise
            except Exception as exc:  # noqa: BLE001  # its end: raised after its bytes
                self._in.put(self._clock() + self._delay(), exc)
                return
            self._in.put(self._clock() + self._delay(), data)
            if not data:  # EOF: reads return b"" after the bytes before it
                return

    async def _pump_out(self) -> None:
        out = self._out
        while True:
            while not out.chunks:
                await out.changed.wait()
            due, item = out.chunks[0]
            wait = due - self._clock()
            if wait > 0:
                await trio.sleep(wait)
                continue
            out.chunks.popleft()
            assert isinstance(item, bytes)
            out.held -= len(item)
            self._writing = True
            try:
                await self.inner.write(item)
                self._writing = False
                out.wake()
            except trio.Cancelled:
                raise
            except Exception as exc:  # noqa: BLE001  # a write failure of any kind cuts the link
                self._cut = self._cut or exc
                out.chunks.clear()
                out.wake()
                self._in.wake()
                return

    # ------------------------------------------------------------------ ReadWriteCloser

    async def read(self, n: int | None = None) -> bytes:
        """Up to ``n`` bytes (None: what is due) once due; b"" at the inner EOF.

        Raises:
            LinkCut: the link was cut; the inner connection's error, after its bytes.
        """
        if n == 0:
            return b""
        async with self._read_lock:
            inq = self._in
            while True:
                if self._cut is not None:
                    raise LinkCut(str(self._cut))
                if self._closed:
                    raise LinkCut("connection closed")
                if inq.chunks:
                    due, item = inq.chunks[0]
                    wait = due - self._clock()
                    if wait <= 0:
                        break
                    with trio.move_on_after(wait):
                        await inq.changed.wait()
                else:
                    await inq.changed.wait()
            parts: list[bytes] = []
            size = 0
            now = self._clock()
            while inq.chunks and inq.chunks[0][0] <= now and (n is None or size < n):
                item = inq.chunks[0][1]
                if isinstance(item, BaseException):
                    if parts:
                        break
                    raise item
                if not item:  # EOF
                    if parts:
                        break
                    return b""
                take = item if n is None else item[: n - size]
                if len(take) < len(item):
                    inq.chunks[0] = (inq.chunks[0][0], item[len(take):])
                else:
                    inq.chunks.popleft()
                parts.append(take)
                size += len(take)
            inq.held -= size
            inq.wake()
            return b"".join(parts)

    async def write(self, data: bytes) -> None:
        """Hold ``data`` for the delay, then write it (returns once held, as a socket buffer).

        Raises:
            LinkCut: the link was cut or closed; a failed earlier write's error.
        """
        while self._out.held >= MAX_HELD_BYTES and self._cut is None and not self._closed:
            await self._out.changed.wait()
        if self._cut is not None:
            raise LinkCut(str(self._cut))
        if self._closed:
            raise LinkCut("connection closed")
        if data:
            self._out.put(self._clock() + self._delay(), bytes(data))

    async def close(self) -> None:
        """Write the bytes held (at most :data:`CLOSE_FLUSH_S` seconds: those due later are
        dropped, as a reset would), then close the inner connection."""
        if not self._closed and self._cut is None:
            with trio.move_on_after(CLOSE_FLUSH_S):
                while (self._out.chunks or self._writing) and self._cut is None:
                    await self._out.changed.wait()
        if not self._closed:
            self._closed = True
            self._cancel.cancel()
            self._in.wake()
            self._out.wake()
        await self.inner.close()

    def cut(self) -> None:
        """Fail every read and write from now on (a partition); the caller closes the inner
        connection (:meth:`close`)."""
        self._cut = self._cut or LinkCut("link cut by a TEST ONLY partition rule")
        self._in.wake()
        self._out.wake()


def _relayed(secured_conn: Any) -> bool:
    try:
        addrs = secured_conn.get_transport_addresses()
    except Exception:  # noqa: BLE001 - a connection type without addresses: a direct one
        return False
    return any("/p2p-circuit" in str(a) for a in addrs or ())


class FaultInjector:
    """TEST ONLY: the faults in force on one host, and the connections they apply to.

    Args:
        faults: the initial faults.
        clock: trio's clock (seconds).
    """

    def __init__(self, faults: Faults | None = None, *,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.faults = faults or Faults()
        self._clock = clock
        self._conns: dict[bytes, set[DelayedConn]] = collections.defaultdict(set)
        self._nursery: trio.Nursery | None = None
        self._host: Any = None
        #: connections refused or cut by a partition rule
        self.refused = 0
        self.cut = 0

    def unix_ms(self, base: Callable[[], int]) -> Callable[[], int]:
        """``base`` (a unix-ms wall clock) with the current ``clock_offset_s`` added."""
        return lambda: base() + round(self.faults.clock_offset_s * 1000)

    def set(self, faults: Faults) -> None:
        """Put ``faults`` in force: a delay applies to the next byte; a partition cuts the open
        connections to its peer now."""
        if faults != self.faults:
            log.warning("TEST ONLY faults now: %s", describe(faults))
        self.faults = faults
        for peer, conns in list(self._conns.items()):
            if faults.rule(peer).partitioned:
                for conn in list(conns):
                    self._sever(peer, conn)
        if self._host is not None and self._nursery is not None:
            # connections opened before install() are not wrapped: the swarm closes them
            from libp2p.peer.id import ID

            network = self._host.get_network()
            for peer in faults.peers:
                if faults.rule(peer).partitioned and network.get_connections(ID(peer)):
                    self._nursery.start_soon(_quietly, network.close_peer, ID(peer))

    def _sever(self, peer: bytes, conn: DelayedConn) -> None:
        conn.cut()
        self.cut += 1
        self._conns[peer].discard(conn)
        if self._nursery is not None:
            self._nursery.start_soon(_close_quietly, conn)

    def wrap(self, conn: Any, peer: bytes, nursery: trio.Nursery) -> DelayedConn:
        """Wrap a new connection to ``peer`` (a partitioned peer's is wrapped and cut: the
        caller closes it).

        Raises:
            LinkCut: ``peer`` is partitioned (the connection is closed in ``nursery``).
        """
        self._nursery = nursery
        wrapped = DelayedConn(conn, lambda: self.faults.rule(peer).delay_s, nursery,
                              clock=self._clock)
        if self.faults.rule(peer).partitioned:
            self.refused += 1
            wrapped.cut()
            nursery.start_soon(_close_quietly, wrapped)
            raise LinkCut("peer partitioned by a TEST ONLY rule")
        conns = self._conns[peer]
        conns.add(wrapped)
        # forget it once closed (checked lazily: on the next connection to the peer)
        for old in [c for c in conns if c._closed]:
            conns.discard(old)
        return wrapped

    def install(self, host: Any, nursery: trio.Nursery) -> None:
        """Wrap every connection ``host`` opens or accepts from now on (its swarm's
        ``upgrader.upgrade_connection``, between the security session and the muxer), except
        a Circuit Relay v2 connection: it runs inside two connections (to and from the relay)
        that are wrapped already, so wrapping it too would count a third link's delay."""
        self._nursery = nursery
        self._host = host
        upgrader = host.get_network().upgrader
        upgrade = upgrader.upgrade_connection

        async def upgrade_connection(secured_conn: Any, peer_id: Any) -> Any:
            from libp2p.transport.exceptions import MuxerUpgradeFailure

            if _relayed(secured_conn):  # its two legs, to and from the relay, hold the delays
                return await upgrade(secured_conn, peer_id)
            try:
                wrapped = self.wrap(secured_conn, peer_id.to_bytes(), nursery)
            except LinkCut as exc:
                raise MuxerUpgradeFailure(str(exc)) from exc
            return await upgrade(wrapped, peer_id)

        upgrader.upgrade_connection = upgrade_connection

    async def watch(self, path: str | pathlib.Path, interval: float = WATCH_INTERVAL, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the control file at ``path`` now and whenever its mtime or size changes,
        until cancelled. A bad file is logged and the faults in force are kept.

        Raises:
            ConfigError: the file is bad at start.
        """
        path = pathlib.Path(path)

        def stamp() -> tuple[int, int] | None:
            try:
                st = path.stat()
            except OSError:
                return None
            return (st.st_mtime_ns, st.st_size)

        seen = stamp()
        self.set(load_faults(path))
        task_status.started()
        while True:
            await trio.sleep(interval)
            now = stamp()
            if now == seen:
                continue
            seen = now
            try:
                self.set(load_faults(path))
            except ConfigError as exc:
                log.warning("TEST ONLY faults file ignored: %s", exc)


def describe(faults: Faults) -> str:
    """One line for logs."""
    parts = [f"clock {faults.clock_offset_s:+.1f} s"]
    if faults.default != NO_FAULT:
        parts.append(f"default {faults.default}")
    for peer, rule in faults.peers.items():
        parts.append(f"{base58.b58encode(peer).decode()[-6:]}: "
                     + ("partitioned" if rule.partitioned else f"delay {rule.delay_s} s"))
    return ", ".join(parts)


async def _close_quietly(conn: DelayedConn) -> None:
    await _quietly(conn.close)


async def _quietly(call: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(Exception):
        await call(*args)


__all__ = [
    "NO_FAULT",
    "DelayedConn",
    "FaultInjector",
    "Faults",
    "LinkCut",
    "LinkRule",
    "describe",
    "load_faults",
    "parse_faults",
    "write_faults",
]
