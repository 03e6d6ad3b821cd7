"""py-libp2p 0.8.1 work-arounds (ps_p2p.protocols.libp2p_patches): installed with the host
module, refused on another py-libp2p, the same Yamux frames on the wire with and without them,
and the behaviour they keep (lock cancellation and FIFO hand-off, back-pressure, ordering,
stream resets, buffered reads that lose no byte to a cancellation).
"""

from __future__ import annotations

import logging
import random
import struct

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.yamux import yamux

from ps_p2p.keys import Identity
from ps_p2p.protocols import libp2p_patches
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.testing.waits import wait_until

PROTOCOL = TProtocol("/planetserve/test-patches/1.0.0")


@pytest.fixture
def restore_patches():
    before = libp2p_patches.installed()
    yield
    libp2p_patches.uninstall()
    libp2p_patches.install(before)


def test_host_module_installs_the_default_patches_on_py_libp2p_0_8_1():
    assert libp2p_patches.installed() == libp2p_patches.DEFAULT
    assert all(libp2p_patches.check(name) == [] for name in ("fast_locks", "bufread"))


def test_a_patch_whose_pinned_source_differs_is_refused_with_one_warning(
    restore_patches, monkeypatch, caplog
):
    libp2p_patches.uninstall(("bufread",))
    monkeypatch.setitem(libp2p_patches.PINNED, "bufread", {"TrioTCPStream": "0" * 16})
    monkeypatch.setattr(libp2p_patches, "_refused_logged", set())
    original_read = TrioTCPStream.read
    with caplog.at_level(logging.WARNING, logger=libp2p_patches.__name__):
        assert "bufread" not in libp2p_patches.install(("bufread",))
        libp2p_patches.install(("bufread",))
    assert TrioTCPStream.read is original_read
    warnings = [r for r in caplog.records if "bufread not installed" in r.getMessage()]
    assert len(warnings) == 1 and "TrioTCPStream" in warnings[0].getMessage()


def test_selection_by_environment():
    assert libp2p_patches.selected("none") == ()
    assert libp2p_patches.selected("all") == libp2p_patches.NAMES
    assert libp2p_patches.selected("default") == ("fast_locks", "lean_yamux", "bufread")
    assert libp2p_patches.selected("bufread, fast_locks") == ("fast_locks", "bufread")


# ------------------------------------------------------------------ FastAcquire


async def test_fast_lock_raises_cancelled_for_a_cancelled_task_and_stays_free():
    lock = libp2p_patches.FastAcquire(trio.Lock())
    with trio.CancelScope() as scope:
        scope.cancel()
        await lock.acquire()
        pytest.fail("acquired under a cancelled scope")  # pragma: no cover
    assert scope.cancelled_caught and not lock.locked()


async def test_fast_lock_hands_over_in_arrival_order_and_nobody_overtakes_a_waiter():
    lock = libp2p_patches.FastAcquire(trio.Lock())
    order: list[str] = []

    async def take(name: str) -> None:
        async with lock:
            order.append(name)
            await trio.lowlevel.checkpoint()

    await lock.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "first waiter")
        await trio.testing.wait_all_tasks_blocked()
        lock.release()  # handed to the waiter: a newcomer must not get it first
        nursery.start_soon(take, "newcomer")
    assert order == ["first waiter", "newcomer"]


async def test_fast_lock_refuses_a_release_by_another_task():
    lock = libp2p_patches.FastAcquire(trio.Lock())
    await lock.acquire()

    refused: list[BaseException] = []

    async def release() -> None:
        try:
            lock.release()
        except RuntimeError as exc:
            refused.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release)
    assert len(refused) == 1 and lock.locked()
    lock.release()


async def test_fast_lock_waiter_can_be_cancelled_while_parked():
    lock = libp2p_patches.FastAcquire(trio.Lock())
    await lock.acquire()
    with trio.move_on_after(0.05) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lock.acquire)
    assert scope.cancelled_caught and lock.statistics().tasks_waiting == 0
    lock.release()
    assert not lock.locked()


# ------------------------------------------------------------------ bufread


async def _tcp_pair() -> tuple[TrioTCPStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return TrioTCPStream(trio.SocketStream(a)), trio.SocketStream(b)


async def test_buffered_read_returns_at_most_n_in_order_and_end_of_stream_after_the_buffer():
    reader, writer = await _tcp_pair()
    await writer.send_all(b"0123456789")
    await wait_until(lambda: True)  # the bytes are in the socket buffer already
    assert await reader.read(2) == b"01"
    assert await reader.read(3) == b"234"
    await writer.send_all(b"abc")
    assert await reader.read(100) == b"56789"  # what was buffered, before the socket again
    assert await reader.read(None) == b"abc"
    await writer.aclose()
    assert await reader.read(5) == b""
    assert await reader.read(0) == b""


async def test_buffered_read_cancelled_while_waiting_loses_no_byte():
    reader, writer = await _tcp_pair()
    with trio.move_on_after(0.05) as scope:
        await reader.read(4)
    assert scope.cancelled_caught
    await writer.send_all(b"abcdef")
    assert await reader.read(4) == b"abcd"
    assert await reader.read(4) == b"ef"


# ------------------------------------------------------------------ two hosts

#: Message sizes of the echo exchange: under half the 256 KiB receive window in all, so no
#: WINDOW_UPDATE (whose timing and auto-tuned increment depend on the clock) is due.
_SIZES = [1, 12, 700, 5_000, 20_000, 3, 17, 30_000, 300, 9, 64, 1_000] * 2


def _messages() -> list[bytes]:
    rng = random.Random(22)
    return [rng.randbytes(n) for n in _SIZES]


async def _read_exactly(stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        out += await stream.read(n - len(out))
    return bytes(out)


async def _echo_exchange(frames: list[tuple[str, bytes]]) -> None:
    """One stream, strictly alternating messages and their echoes, then a close: the Yamux
    frames of that stream, in both directions, are then a function of the messages only."""
    messages = _messages()
    a_id, b_id = Identity.generate(), Identity.generate()
    done = trio.Event()

    async def echo(stream) -> None:
        for message in messages:
            await stream.write(await _read_exactly(stream, len(message)))
        with pytest.raises(StreamEOF):
            await stream.read(1)
        await stream.close()
        done.set()

    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(PROTOCOL, echo)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            frames.clear()  # identify and ping carry keys and addresses: not this stream
            stream = await a.new_stream(ID(b_id.peer_id), [PROTOCOL])
            for message in messages:
                await stream.write(message)
                assert await _read_exactly(stream, len(message)) == message
            await stream.close()
            with pytest.raises(StreamEOF):
                await stream.read(1)
            await done.wait()


def _stream_frames(frames: list[tuple[str, bytes]]) -> list[tuple[str, int, int, int, bytes]]:
    """(side, type, flags, length, payload) of the test stream's frames, each side's in the
    order it wrote them (the stream whose protocol negotiation names :data:`PROTOCOL`;
    identify and ping run beside it). How the two sides interleave is scheduling; each
    side's own sequence is that direction's bytes on the wire."""
    parsed = []
    for side, data in frames:
        _, typ, flags, sid, length = struct.unpack(yamux.YAMUX_HEADER_FORMAT, data[:12])
        if typ in (yamux.TYPE_DATA, yamux.TYPE_WINDOW_UPDATE):
            parsed.append((side, sid, typ, flags, length, bytes(data[12:])))
    negotiation = PROTOCOL.encode() + b"\n"  # multistream-select's line (identify's lists it too)
    ours = next(sid for side, sid, *_, payload in parsed
                if side == "dialer" and payload[1:] == negotiation)
    ours_only = [(side, typ, flags, length, payload)
                 for side, sid, typ, flags, length, payload in parsed if sid == ours]
    return sorted(ours_only, key=lambda frame: frame[0] == "listener")  # stable: per side


async def test_yamux_frames_on_the_wire_are_the_same_with_and_without_the_patches(
    restore_patches, monkeypatch
):
    frames: list[tuple[str, bytes]] = []
    original = SecureSession.write

    async def recording(self, data: bytes) -> None:
        frames.append(("dialer" if self.is_initiator else "listener", bytes(data)))
        await original(self, data)

    monkeypatch.setattr(SecureSession, "write", recording)
    libp2p_patches.uninstall()
    await _echo_exchange(frames)
    without = _stream_frames(frames)
    assert libp2p_patches.install(libp2p_patches.NAMES) == libp2p_patches.NAMES
    await _echo_exchange(frames)
    with_patches = _stream_frames(frames)
    assert len(without) >= 2 * len(_SIZES)
    assert with_patches == without


async def test_back_pressure_a_writer_waits_for_a_reader_and_every_byte_arrives_in_order():
    a_id, b_id = Identity.generate(), Identity.generate()
    payload = random.Random(5).randbytes(400_000)  # more than the 256 KiB receive window
    inbound: list = []
    got = trio.Event()

    async def hold(stream) -> None:
        inbound.append(stream)
        got.set()
        await trio.sleep_forever()

    written = trio.Event()
    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(PROTOCOL, hold)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [PROTOCOL])

            async def write() -> None:
                await stream.write(payload)
                written.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                await got.wait()
                await wait_until(lambda: stream.muxed_stream.send_window == 0)
                assert not written.is_set()  # blocked on the window, not buffered away
                received = await _read_exactly(inbound[0], len(payload))
            assert written.is_set() and received == payload


async def _reset_seen_by_reader() -> list[str]:
    a_id, b_id = Identity.generate(), Identity.generate()
    outcome: list[str] = []
    finished = trio.Event()

    async def read_until_reset(stream) -> None:
        try:
            while True:
                outcome.append(repr(await stream.read(1024)))
        except BaseException as exc:
            outcome.append(type(exc).__name__)
            raise
        finally:
            finished.set()

    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(PROTOCOL, read_until_reset)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [PROTOCOL])
            await stream.write(b"hello")
            await wait_until(lambda: "b'hello'" in outcome)
            await stream.reset()
            await finished.wait()
            with pytest.raises(StreamReset):
                await stream.write(b"more")
    return outcome


async def test_a_reset_ends_the_reader_of_the_other_side_as_without_the_patches(restore_patches):
    """py-libp2p 0.8.1 shows a remote reset to a reader waiting on the stream as StreamEOF
    (the stream's buffer is gone before the reader wakes); the patches keep that."""
    with_patches = await _reset_seen_by_reader()
    libp2p_patches.uninstall()
    without = await _reset_seen_by_reader()
    assert with_patches == without == ["b'hello'", "StreamEOF"]


class _Steps(trio.abc.Instrument):
    """Counts task steps (passes through trio's scheduler) of every task."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task) -> None:
        self.steps += 1


async def test_fast_lock_takes_a_schedule_point_only_every_checkpoint_every_free_acquires(
    monkeypatch,
):
    monkeypatch.setattr(libp2p_patches, "_since_checkpoint", 0)
    every = libp2p_patches.CHECKPOINT_EVERY
    for lock, most in ((libp2p_patches.FastAcquire(trio.Lock()), 100 // every),
                       (trio.Lock(), 100)):
        steps = _Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            for _ in range(100):
                async with lock:
                    pass
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert steps.steps == most, type(lock).__name__


async def _longest_run_without_the_other_task(acquire_once, count: int) -> int:
    """Calls ``acquire_once()`` ``count`` times while another task counts its own steps;
    returns the most calls in a row during which that task did not run."""
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await trio.lowlevel.checkpoint()

    longest = run = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        seen = ticks
        for _ in range(count):
            await acquire_once()
            run = 0 if ticks != seen else run + 1
            seen = ticks
            longest = max(longest, run)
        stop = True
    return longest


async def test_a_loop_of_free_lock_acquires_still_lets_the_other_tasks_run(monkeypatch):
    monkeypatch.setattr(libp2p_patches, "_since_checkpoint", 0)
    lock = libp2p_patches.FastAcquire(trio.Lock())

    async def once() -> None:
        async with lock:
            pass

    every = libp2p_patches.CHECKPOINT_EVERY  # trio runs each runnable task once per batch:
    assert await _longest_run_without_the_other_task(once, 20 * every) < 2 * every


async def test_a_loop_of_free_lock_acquires_is_cancelled_by_another_task(monkeypatch):
    monkeypatch.setattr(libp2p_patches, "_since_checkpoint", 0)
    lock = libp2p_patches.FastAcquire(trio.Lock())
    every = libp2p_patches.CHECKPOINT_EVERY
    done = 0
    scope = trio.CancelScope()

    async def cancel() -> None:  # runs only if the loop below lets it
        scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel)
        with scope:
            for _ in range(100 * every):
                async with lock:
                    done += 1
    assert scope.cancelled_caught and done <= 2 * every  # trio's batch order: one more pass


async def test_a_loop_of_free_lock_acquires_ends_at_its_deadline():
    lock = libp2p_patches.FastAcquire(trio.Lock())
    done = 0
    with trio.move_on_after(0.001) as scope:
        for _ in range(300_000):  # far longer than 1 ms on any machine
            async with lock:
                done += 1
    assert scope.cancelled_caught and done < 300_000


async def test_a_task_reading_a_stream_at_its_end_in_a_loop_does_not_starve_the_others(
    restore_patches, monkeypatch
):
    """py-libp2p answers a read at a stream's end (and a write on a reset stream) with only
    lock acquires; with ``fast_locks`` a caller retrying it must still let the process run."""
    libp2p_patches.install(libp2p_patches.NAMES)
    monkeypatch.setattr(libp2p_patches, "_since_checkpoint", 0)
    a_id, b_id = Identity.generate(), Identity.generate()

    async def close_at_once(stream) -> None:
        await stream.close()

    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(PROTOCOL, close_at_once)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [PROTOCOL])
            assert isinstance(stream._state_lock, libp2p_patches.FastAcquire)
            with pytest.raises(StreamEOF):
                await stream.read(1)

            async def read_at_end() -> None:
                with pytest.raises(StreamEOF):
                    await stream.read(1)

            every = libp2p_patches.CHECKPOINT_EVERY
            longest = await _longest_run_without_the_other_task(read_at_end, 20 * every)
            assert longest < 2 * every


async def test_a_stream_of_writes_lets_the_other_tasks_run_between_writes(restore_patches):
    libp2p_patches.install(libp2p_patches.NAMES)
    a_id, b_id = Identity.generate(), Identity.generate()

    async def drain(stream) -> None:
        while await stream.read(65536):
            pass

    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(PROTOCOL, drain)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [PROTOCOL])

            async def write() -> None:
                await stream.write(b"x" * 1000)

            assert await _longest_run_without_the_other_task(write, 300) <= 1  # batch order


async def _exchange_on_one_stream(count: int, measure) -> int:
    """Write and echo ``count`` 1 KB messages on one stream; returns what ``measure()`` added
    during them (after the connection and the stream are up)."""
    a_id, b_id = Identity.generate(), Identity.generate()

    async def echo(stream) -> None:
        for _ in range(count):
            await stream.write(await _read_exactly(stream, 1000))

    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(PROTOCOL, echo)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [PROTOCOL])
            await stream.write(b"x" * 1000)
            await _read_exactly(stream, 1000)
            before = measure()
            for _ in range(count - 1):
                await stream.write(b"x" * 1000)
                await _read_exactly(stream, 1000)
            return measure() - before


async def test_yamux_formats_no_debug_message_per_frame_when_debug_is_off(
    restore_patches, monkeypatch
):
    from libp2p.peer import id as peer_id_module

    formatted = [0]
    original = peer_id_module.ID.__str__

    def counting(self) -> str:
        formatted[0] += 1
        return original(self)

    monkeypatch.setattr(peer_id_module.ID, "__str__", counting)
    logging.getLogger("libp2p").setLevel(logging.INFO)
    with_patches = await _exchange_on_one_stream(20, lambda: formatted[0])
    libp2p_patches.uninstall(("lean_yamux",))
    without = await _exchange_on_one_stream(20, lambda: formatted[0])
    # not per frame: fewer than one per round trip (identify, pings and other background work
    # of the two hosts may name a peer now and then, more on a loaded machine)
    assert with_patches < 19, with_patches
    assert without >= 19 * 4, without  # the peer ID formatted for DEBUG lines nobody reads


async def test_yamux_debug_lines_still_appear_when_debug_is_on(caplog):
    with caplog.at_level(logging.DEBUG, logger="libp2p.stream_muxer.yamux.yamux"):
        await _exchange_on_one_stream(3, lambda: 0)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("YAMUX TX: type=0") for m in messages)
    assert any(m.startswith("YAMUX RX: type=DATA") for m in messages)
