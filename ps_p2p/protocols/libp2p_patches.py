"""Version-pinned work-arounds for py-libp2p 0.8.1's per-message cost (issue 22).

A profile of an anonymous round trip (all hosts in one process, py-spy, busy minus idle) put a
third of its CPU in trio's scheduler, most of it schedule points that py-libp2p takes on locks
nobody else holds, and another tenth in Yamux debug work done whether DEBUG logging is on or
not. Per 10 KB message py-libp2p took ~17 scheduler steps (7 to send: the NetStream state lock,
Yamux's stream write lock, window lock and connection write lock, an explicit checkpoint after
every frame, the TCP write lock, the socket send; ~10 to read, two of them separate socket reads
of a Noise message's length and of its body).

Three patches, each installed by :func:`install` (``ps_p2p.protocols.host`` calls it at import,
so every py-libp2p host of the process has them) and each refused, with one WARNING, when the
installed py-libp2p's source of what it replaces differs from the 0.8.1 source it was written
against (:data:`PINNED`: SHA-256 of ``inspect.getsource`` of every function or class a patch
replaces or relies on). None changes a byte on the wire (``tests/test_libp2p_patches.py``
compares the Yamux frames two hosts exchange with and without them).

``PS_LIBP2P_PATCHES`` (environment, read by :func:`install`): unset or ``default`` installs
:data:`DEFAULT` (every patch; ``default`` and ``all`` are the same since ``fast_locks``
joined them, see there); ``none`` (or ``0``) none; a comma-separated list of names only those (for
A/B benchmarks with ``benchmarks/bench_overlay.py --cpu``).

``fast_locks``
--------------
*What py-libp2p does.* ``NetStream.read``/``write`` take ``NetStream._state_lock`` (a
``trio.Lock``) only to read the state; ``YamuxStream.write`` takes ``rw_lock.write_lock()`` (a
``trio.Semaphore`` behind an ``asynccontextmanager``) and ``window_lock``;
``Yamux._write_frame`` takes ``_write_lock``; ``TrioTCPStream.write``/``read`` take
``write_lock``/``read_lock``. ``trio.Lock.acquire`` ends with
``cancel_shielded_checkpoint()``, a full pass through the scheduler, even when the lock is free.

*What it costs.* 5 scheduler steps per frame sent, ~40% of trio's share of a round trip.

*Proposed change.* Acquire with ``acquire_nowait()`` first and fall back to ``await acquire()``
only when contended (:class:`FastAcquire`), and take trio's schedule point anyway on every
:data:`CHECKPOINT_EVERY`-th uncontended acquire (so no loop of them starves the other tasks
or outlives its deadline). Kept: a task already cancelled gets ``Cancelled`` at
the acquire (``checkpoint_if_cancelled``), a contended acquire parks in trio's FIFO (a free lock
with waiters is not free: ``acquire_nowait`` refuses it, so nobody overtakes a waiter), the
owner checks of ``trio.Lock`` (release by another task raises). Every frame sent still passes one
schedule point: the socket send (trio's ``send`` always ends in a checkpoint); the one path
that did not (``TrioTCPStream.write`` swallowing ``ClosedResourceError`` after the stream
closed) gets an explicit checkpoint, so a writer looping on a closed connection still lets the
Yamux reader run.

``lean_yamux``
--------------
*What py-libp2p does.* Yamux's hot methods (``YamuxStream.read``/``write``/
``send_window_update``, ``Yamux.read_stream``/``handle_incoming``/``_write_frame``, Noise's
``read_msg``) build ``logger.debug(f"...")`` messages for every frame (the f-string is formatted
before ``debug`` looks at the level), ``_write_frame`` unpacks and names every header only to log
it and ends with an explicit ``trio.lowlevel.checkpoint()``, and ``_py_yamux_env`` reads
``os.environ`` several times per frame (``PY_YAMUX_DATA_READ_TIMEOUT`` per DATA body,
``RELEASE_ON_READ``/``DEBUG`` per window update).

*What it costs.* ~10% of a round trip's CPU (Yamux's share of the profile, most of it formatting
nobody reads).

*Proposed change.* Guard each debug call with ``if logger.isEnabledFor(logging.DEBUG)`` (done
here by rewriting the methods' syntax trees: same code, each ``logger.debug(...)`` statement
under that guard, so DEBUG logging still shows every line when enabled); drop the trailing
checkpoint of ``_write_frame`` (the socket send is one); read the ``PY_YAMUX_*`` variables once.
Here they are read when the patch is installed (at the import of ``ps_p2p.protocols.host``): an
operator sets them before starting the process.

``bufread``
-----------
*What py-libp2p does.* Noise reads each transport message as ``read_exactly(conn, 2)`` then
``read_exactly(conn, length)`` on the ``TrioTCPStream``, each a ``receive_some`` of exactly that
many bytes: two socket reads (two system calls, two schedule points, the read lock twice) per
message, and multistream-select reads its varints byte by byte the same way.

*What it costs.* One extra socket read and ~3 scheduler steps per Noise message.

*Proposed change.* ``TrioTCPStream.read(n)`` receives ``max(n, 64 KiB)`` and keeps the surplus
for the next reads (at most one receive's worth per connection, 64 KiB, consumed by the
connection's reader as fast as it reads); ``read(n)`` still returns at most ``n`` bytes, ``b""``
only at the end of the stream, and ``read(None)`` what is buffered or one receive.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import logging
import os
import textwrap
from collections.abc import Callable
from typing import Any

import trio
from libp2p.io import trio as _io_trio
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.network.stream import net_stream as _net_stream
from libp2p.security.noise import io as _noise_io
from libp2p.stream_muxer import rw_lock as _rw_lock
from libp2p.stream_muxer.yamux import yamux as _yamux

log = logging.getLogger(__name__)

ENV = "PS_LIBP2P_PATCHES"
"""Environment variable selecting the patches (see the module docstring)."""

#: Bytes asked of the socket per buffered read (trio's own default receive size).
RECEIVE_SIZE = 65536

#: At most this many uncontended :class:`FastAcquire` acquires (of any lock, by any task) between
#: two of them that take trio's schedule point anyway: a loop whose only awaits are such acquires
#: (a read retried at a stream's end, a write retried on a reset stream, the Yamux reader going
#: through frames already buffered) still lets the other tasks and trio's deadlines run.
CHECKPOINT_EVERY = 32

_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
_cancel_shielded_checkpoint = trio.lowlevel.cancel_shielded_checkpoint
_since_checkpoint = 0


class FastAcquire:
    """A trio ``Lock`` or ``Semaphore`` whose uncontended acquire takes no schedule point.

    Wraps ``inner`` (the primitive py-libp2p built): ``acquire`` raises ``Cancelled`` if the task
    is already cancelled, then takes ``inner`` with ``acquire_nowait``; only when that would
    block does it ``await inner.acquire()`` (parking in trio's FIFO queue). ``release``,
    ``acquire_nowait``, ``statistics`` (and ``locked`` for a lock) are ``inner``'s.
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @trio.lowlevel.enable_ki_protection
    async def acquire(self) -> None:
        global _since_checkpoint
        await _checkpoint_if_cancelled()
        try:
            self._inner.acquire_nowait()
        except trio.WouldBlock:
            await self._inner.acquire()
            return
        _since_checkpoint += 1
        if _since_checkpoint >= CHECKPOINT_EVERY:
            _since_checkpoint = 0
            await _cancel_shielded_checkpoint()  # what trio.Lock does on every acquire

    def acquire_nowait(self) -> None:
        self._inner.acquire_nowait()

    def release(self) -> None:
        self._inner.release()

    def locked(self) -> bool:
        return bool(self._inner.locked())

    def statistics(self) -> Any:
        return self._inner.statistics()

    @trio.lowlevel.enable_ki_protection
    async def __aenter__(self) -> None:
        global _since_checkpoint
        await _checkpoint_if_cancelled()
        try:
            self._inner.acquire_nowait()
        except trio.WouldBlock:
            await self._inner.acquire()
            return
        _since_checkpoint += 1
        if _since_checkpoint >= CHECKPOINT_EVERY:
            _since_checkpoint = 0
            await _cancel_shielded_checkpoint()  # what trio.Lock does on every acquire

    @trio.lowlevel.enable_ki_protection
    async def __aexit__(self, *exc_info: object) -> None:
        self._inner.release()


class _FastReadWriteLock(_rw_lock.ReadWriteLock):
    """py-libp2p's ``ReadWriteLock`` whose ``write_lock()`` is a :class:`FastAcquire` of its
    writer semaphore (the readers' side, unused by Yamux, is unchanged and shares it)."""

    def __init__(self) -> None:
        super().__init__()
        self._fast_writer = FastAcquire(self._writer_lock)

    def write_lock(self) -> FastAcquire:  # type: ignore[override]
        return self._fast_writer


# ---------------------------------------------------------------------------- pinning

#: SHA-256 (first 16 hex digits) of ``inspect.getsource`` of what each patch replaces or
#: relies on, in py-libp2p 0.8.1. A patch whose sources differ is not installed.
PINNED: dict[str, dict[str, str]] = {
    "fast_locks": {
        "NetStream.__init__": "c1bafd9d5782acb4",
        "NetStream.read": "cc3b280850abe4b3",
        "NetStream.write": "b0662734215dfe68",
        "YamuxStream.__init__": "ab24c0709285d573",
        "Yamux.__init__": "3b11a2a71ca444ca",
        "ReadWriteLock": "4c503b1027c3ef85",
        "TrioTCPStream": "4f214585e03d69e1",
    },
    "lean_yamux": {
        "YamuxStream.write": "d87f74dfb53ab194",
        "YamuxStream.read": "ca585f2199fd4e83",
        "YamuxStream.send_window_update": "f76fe6e67077b4a3",
        "Yamux.read_stream": "d07c99299384666d",
        "Yamux.handle_incoming": "ad15ff6943feac20",
        "BaseNoiseMsgReadWriter.read_msg": "b2fa218c135c82c0",
        "Yamux._write_frame": "16ff969cdd0d2b1b",
        "_py_yamux_env": "1c26e5bb6db0a6ba",
        "_py_yamux_env_set": "48dcb1f17d9207de",
    },
    "bufread": {"TrioTCPStream": "4f214585e03d69e1"},
}


def _source_hash(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def _pin_targets(name: str) -> dict[str, Any]:
    if name == "fast_locks":
        return {
            "NetStream.__init__": _net_stream.NetStream.__init__,
            "NetStream.read": _net_stream.NetStream.read,
            "NetStream.write": _net_stream.NetStream.write,
            "YamuxStream.__init__": _yamux.YamuxStream.__init__,
            "Yamux.__init__": _yamux.Yamux.__init__,
            "ReadWriteLock": _rw_lock.ReadWriteLock,
            "TrioTCPStream": _io_trio.TrioTCPStream,
        }
    if name == "lean_yamux":
        targets = {f"{cls.__name__}.{meth}": getattr(cls, meth) for cls, meth in _LEAN_METHODS}
        targets["Yamux._write_frame"] = _yamux.Yamux._write_frame
        targets["_py_yamux_env"] = _yamux._py_yamux_env
        targets["_py_yamux_env_set"] = _yamux._py_yamux_env_set
        return targets
    if name == "bufread":
        return {"TrioTCPStream": _io_trio.TrioTCPStream}
    raise KeyError(name)


# ---------------------------------------------------------------------------- fast_locks

_LOCK_ATTRIBUTES: tuple[tuple[type, tuple[str, ...]], ...] = (
    (_net_stream.NetStream, ("_state_lock",)),
    (_yamux.YamuxStream, ("window_lock", "close_lock")),
    (_yamux.Yamux, ("streams_lock", "_write_lock")),
    (_io_trio.TrioTCPStream, ("read_lock", "write_lock")),
)


def _fast_init(original: Callable[..., None], names: tuple[str, ...], rw: bool) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for attribute in names:
            setattr(self, attribute, FastAcquire(getattr(self, attribute)))
        if rw:
            self.rw_lock = _FastReadWriteLock()

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


async def _tcp_write(self: Any, data: bytes) -> None:
    """``TrioTCPStream.write`` of py-libp2p 0.8.1 with a checkpoint on the locally-closed path
    (its only path without a schedule point once the write lock takes none)."""
    async with self.write_lock:
        try:
            await self.stream.send_all(data)
        except trio.BrokenResourceError as error:
            raise ConnectionClosedError(
                f"TCP connection reset by remote peer: {error}", transport="tcp"
            ) from error
        except trio.ClosedResourceError:
            await trio.lowlevel.checkpoint()
            return


# ---------------------------------------------------------------------------- lean_yamux

_LEAN_METHODS: tuple[tuple[type, str], ...] = (
    (_yamux.YamuxStream, "write"),
    (_yamux.YamuxStream, "read"),
    (_yamux.YamuxStream, "send_window_update"),
    (_yamux.Yamux, "read_stream"),
    (_yamux.Yamux, "handle_incoming"),
    (_noise_io.BaseNoiseMsgReadWriter, "read_msg"),
)


class _GuardDebug(ast.NodeTransformer):
    """Puts every ``logger.debug(...)`` statement under ``if logger.isEnabledFor(10):``."""

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "debug"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "logger"
        ):
            test = ast.Call(
                func=ast.Attribute(value=ast.Name("logger", ast.Load()), attr="isEnabledFor",
                                   ctx=ast.Load()),
                args=[ast.Constant(logging.DEBUG)], keywords=[],
            )
            guarded = ast.If(test=test, body=[node], orelse=[])
            return ast.copy_location(guarded, node)
        return node


def _without_eager_debug(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` recompiled from its own source with each ``logger.debug`` call guarded
    (same globals, same file and line numbers in tracebacks)."""
    source = textwrap.dedent(inspect.getsource(function))
    if "super()" in source or "__class__" in source:  # pragma: no cover - pinned sources lack it
        raise ValueError(f"{function.__qualname__} needs its class cell")
    tree = ast.parse(source)
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    tree = ast.fix_missing_locations(_GuardDebug().visit(tree))
    namespace: dict[str, Any] = {}
    # the installed py-libp2p's own source (pinned by hash), recompiled: not foreign input
    exec(compile(tree, function.__code__.co_filename, "exec"), function.__globals__, namespace)  # noqa: S102
    rebuilt = namespace[function.__name__]
    rebuilt.__qualname__ = function.__qualname__
    rebuilt.__module__ = function.__module__
    rebuilt.__doc__ = function.__doc__
    rebuilt.__wrapped__ = function
    return rebuilt


_yamux_logger = _yamux.logger
_YAMUX_HEADER = _yamux.HEADER_SIZE


async def _write_frame(self: Any, data: bytes) -> None:
    """``Yamux._write_frame`` without the per-frame header decoding for a DEBUG line nobody
    reads (still logged when DEBUG is on) and without the trailing checkpoint (the socket
    send is one)."""
    if _yamux_logger.isEnabledFor(logging.DEBUG) and len(data) >= _YAMUX_HEADER:
        _, typ, flags, sid, length = _yamux.struct.unpack(
            _yamux.YAMUX_HEADER_FORMAT, data[:_YAMUX_HEADER]
        )
        _yamux_logger.debug(
            "YAMUX TX: type=%s flags=%#x stream=%d length=%d is_initiator=%s payload_bytes=%d",
            typ, flags, sid, length, self.is_initiator_value, len(data) - _YAMUX_HEADER,
        )
    async with self._write_lock:
        await self.secured_conn.write(data)


def _env_snapshot() -> tuple[Callable[..., str], Callable[[str], bool]]:
    snapshot = {k: v for k, v in os.environ.items() if k.startswith("PY_YAMUX_")}

    def _py_yamux_env(name: str, default: str = "") -> str:
        return snapshot.get(f"PY_YAMUX_{name}", default)

    def _py_yamux_env_set(name: str) -> bool:
        return f"PY_YAMUX_{name}" in snapshot

    return _py_yamux_env, _py_yamux_env_set


# ---------------------------------------------------------------------------- bufread


async def _buffered_read(self: Any, n: int | None = None) -> bytes:
    """``TrioTCPStream.read`` through a per-connection buffer (see ``bufread``)."""
    if n == 0:
        return b""
    if n is not None and n < 0:
        raise ValueError("max_bytes must be >= 1")  # what trio's receive_some raises
    buf: bytes = getattr(self, "_ps_rbuf", b"")
    if buf:
        if n is None or n >= len(buf):
            self._ps_rbuf = b""
            return buf
        self._ps_rbuf = buf[n:]
        return buf[:n]
    async with self.read_lock:
        buf = self._ps_rbuf if hasattr(self, "_ps_rbuf") else b""
        if buf:  # filled while this task waited for the lock
            if n is None or n >= len(buf):
                self._ps_rbuf = b""
                return buf
            self._ps_rbuf = buf[n:]
            return buf[:n]
        try:
            data = await self.stream.receive_some(
                RECEIVE_SIZE if n is None else max(n, RECEIVE_SIZE)
            )
        except trio.BrokenResourceError as error:
            raise ConnectionClosedError(
                f"TCP connection reset by remote peer: {error}", transport="tcp"
            ) from error
        except trio.ClosedResourceError:
            return b""
        if n is None or len(data) <= n:
            return bytes(data)
        self._ps_rbuf = bytes(data[n:])
        return bytes(data[:n])


# ---------------------------------------------------------------------------- install

_installed: dict[str, list[tuple[Any, str, Any]]] = {}
_refused_logged: set[str] = set()

NAMES = ("fast_locks", "lean_yamux", "bufread")
"""Every patch, in the order :func:`install` applies them."""

DEFAULT = NAMES
"""The patches installed unless ``PS_LIBP2P_PATCHES`` says otherwise: all three.

``fast_locks`` was left out at first because ``tests/test_overlay_security.py``'s localnet
tests timed out with it in 2 of 3 runs on a loaded machine (0 of 3 without). What was found
(2026-11-26): a lost wakeup in those tests' own ``_until`` helper (fixed with
``CoreDriver.processed``); after it, at load 35-47 on 2 cores, 1 of 3 runs failed with it and
1 of 3 without, with the same symptoms (a process starved of CPU). An audit of every acquire
of the patched locks in py-libp2p 0.8.1 (``NetStream``, ``YamuxStream``, ``Yamux``,
``TrioTCPStream``) and in ``ps_p2p`` found no loop that spins on them: every loop also
writes to a socket, waits on an event or sleeps. What the missing schedule points did change:
(1) a read at a stream's end, or a write on a reset or closed stream, answered with only lock
acquires, so a caller retrying it in a loop would have frozen the whole process (and never
reached its deadline: trio notices expired deadlines between task steps) instead of
busy-looping beside the others; (2) the Yamux reader went through every frame already
buffered (up to a Noise message and a 64 KiB socket read) in one task step. Both are bounded
by :data:`CHECKPOINT_EVERY`, after which ``tests/test_overlay_security.py`` passed 3 of 3 runs
with ``fast_locks`` and 3 of 3 without (load 15-25 on 2 cores, 2026-11-26). Cancellation is
unchanged: trio's own uncontended acquire is a *cancel-shielded* schedule point, so it never
delivered a cancellation that ``checkpoint_if_cancelled`` (kept) does not."""


def _set(undo: list[tuple[Any, str, Any]], owner: Any, attribute: str, value: Any) -> None:
    undo.append((owner, attribute, owner.__dict__.get(attribute, _MISSING)))
    setattr(owner, attribute, value)


_MISSING = object()


def _apply(name: str) -> list[tuple[Any, str, Any]]:
    undo: list[tuple[Any, str, Any]] = []
    if name == "fast_locks":
        for cls, attributes in _LOCK_ATTRIBUTES:
            rw = cls is _yamux.YamuxStream
            _set(undo, cls, "__init__", _fast_init(cls.__init__, attributes, rw))
        _set(undo, _io_trio.TrioTCPStream, "write", _tcp_write)
    elif name == "lean_yamux":
        rebuilt = [(cls, meth, _without_eager_debug(getattr(cls, meth)))
                   for cls, meth in _LEAN_METHODS]
        for cls, meth, function in rebuilt:
            _set(undo, cls, meth, function)
        _set(undo, _yamux.Yamux, "_write_frame", _write_frame)
        env, env_set = _env_snapshot()
        _set(undo, _yamux, "_py_yamux_env", env)
        _set(undo, _yamux, "_py_yamux_env_set", env_set)
    elif name == "bufread":
        _set(undo, _io_trio.TrioTCPStream, "read", _buffered_read)
    else:
        raise KeyError(name)
    return undo


def check(name: str) -> list[str]:
    """The pinned sources of patch ``name`` that the installed py-libp2p does not match
    (empty: the patch applies)."""
    pins = PINNED.get(name, {})
    targets = _pin_targets(name)
    return [key for key, obj in targets.items() if pins.get(key) != _source_hash(obj)]


def selected(env: str | None = None) -> tuple[str, ...]:
    """The patch names ``PS_LIBP2P_PATCHES`` (or ``env``) selects."""
    value = (os.environ.get(ENV, "default") if env is None else env).strip().lower()
    if value in ("", "default", "1"):
        return DEFAULT
    if value == "all":
        return NAMES
    if value in ("none", "0"):
        return ()
    return tuple(n for n in NAMES if n in {p.strip() for p in value.split(",")})


def install(names: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Install the patches ``names`` (default: :func:`selected`) that are not yet installed
    and whose pinned sources match; returns the names installed now, in all.

    A patch whose sources differ is skipped with one WARNING per process (the host works as
    py-libp2p wrote it, only slower). Idempotent.
    """
    for name in selected() if names is None else names:
        if name in _installed:
            continue
        mismatched = check(name)
        if mismatched:
            if name not in _refused_logged:
                _refused_logged.add(name)
                log.warning(
                    "py-libp2p work-around %s not installed: the installed py-libp2p's %s "
                    "differ(s) from the 0.8.1 source it was written for",
                    name, ", ".join(mismatched),
                )
            continue
        _installed[name] = _apply(name)
    return tuple(n for n in NAMES if n in _installed)


def uninstall(names: tuple[str, ...] | None = None) -> None:
    """Restore py-libp2p's own code for ``names`` (default: every installed patch); objects
    built while a patch was installed keep its locks (for tests and A/B benchmarks)."""
    for name in reversed(NAMES):
        if (names is None or name in names) and name in _installed:
            for owner, attribute, previous in reversed(_installed.pop(name)):
                if previous is _MISSING:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, previous)


def installed() -> tuple[str, ...]:
    """Names of the patches installed now."""
    return tuple(n for n in NAMES if n in _installed)


__all__ = [
    "DEFAULT",
    "ENV",
    "NAMES",
    "PINNED",
    "FastAcquire",
    "check",
    "install",
    "installed",
    "selected",
    "uninstall",
]
