"""Varint-length-prefixed frames (ps_p2p.protocols.framing)."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.network.stream.exceptions import StreamEOF

from ps_p2p.errors import FrameTooLargeError, RemoteProtocolError
from ps_p2p.protocols.framing import FrameReader, encode_frame, encode_varint, read_frame


class FakeStream:
    """Serves ``data`` in reads of at most ``chunk`` bytes, then raises StreamEOF like libp2p."""

    def __init__(self, data: bytes, chunk: int = 7) -> None:
        self.data = data
        self.chunk = chunk
        self.reads = 0

    async def read(self, n: int | None = None) -> bytes:
        if not self.data:
            raise StreamEOF("eof")
        self.reads += 1
        n = min(n or len(self.data), self.chunk)
        out, self.data = self.data[:n], self.data[n:]
        return out


@given(bodies=st.lists(st.binary(max_size=3000), max_size=5))
async def test_frames_round_trip_in_order_whatever_the_read_sizes(bodies):
    stream = FakeStream(b"".join(encode_frame(b) for b in bodies))
    got = [await read_frame(stream, 4096) for _ in bodies]
    assert got == bodies
    with pytest.raises(StreamEOF):
        await read_frame(stream, 4096)


async def test_a_length_over_the_limit_is_refused_before_the_body_is_read():
    stream = FakeStream(encode_varint(10_000_000) + b"x" * 100, chunk=1)
    with pytest.raises(FrameTooLargeError):
        await read_frame(stream, 1024)
    assert stream.reads == len(encode_varint(10_000_000))  # the body was never read


async def test_stream_ending_inside_a_frame_is_a_remote_error():
    with pytest.raises(RemoteProtocolError, match="frame"):
        await read_frame(FakeStream(encode_varint(50) + b"short"), 1024)
    with pytest.raises(RemoteProtocolError):
        await read_frame(FakeStream(b"\x80"), 1024)


async def test_overlong_or_non_minimal_varints_are_refused():
    with pytest.raises(RemoteProtocolError):
        await read_frame(FakeStream(b"\xff" * 12), 1 << 62)
    with pytest.raises(RemoteProtocolError, match="non-minimal"):
        await read_frame(FakeStream(b"\x81\x00" + b"x"), 1024)


def test_varint_matches_the_multiformats_examples():
    assert encode_varint(1) == b"\x01"
    assert encode_varint(127) == b"\x7f"
    assert encode_varint(128) == b"\x80\x01"
    assert encode_varint(300) == b"\xac\x02"
    assert encode_varint(16384) == b"\x80\x80\x01"


async def test_the_largest_length_a_reader_accepts_is_the_largest_the_writer_encodes():
    top = (1 << 63) - 1
    assert len(encode_varint(top)) == 9
    with pytest.raises(ValueError):
        encode_varint(top + 1)
    with pytest.raises(ValueError):
        encode_varint(-1)
    with pytest.raises(FrameTooLargeError):  # read, and refused by the limit, not malformed
        await read_frame(FakeStream(encode_varint(top)), 1 << 62)


@given(
    bodies=st.lists(st.binary(max_size=3000), max_size=6),
    chunk=st.integers(1, 5000),
)
async def test_buffered_reader_returns_the_same_frames_whatever_the_chunking(bodies, chunk):
    stream = FakeStream(b"".join(encode_frame(b) for b in bodies), chunk=chunk)
    reader = FrameReader(stream, 4096)
    assert [await reader.read_frame() for _ in bodies] == bodies
    with pytest.raises(StreamEOF):
        await reader.read_frame()


async def test_buffered_reader_refuses_an_oversized_length_before_its_body_arrives():
    reader = FrameReader(FakeStream(encode_varint(1 << 30) + b"x" * 10, chunk=4), 1024)
    with pytest.raises(FrameTooLargeError):
        await reader.read_frame()


async def test_buffered_reader_reports_a_stream_ending_inside_a_frame():
    reader = FrameReader(FakeStream(encode_frame(b"whole") + encode_varint(40) + b"part"), 1024)
    assert await reader.read_frame() == b"whole"
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        await reader.read_frame()


async def test_buffered_reader_reads_many_small_frames_in_few_reads():
    data = b"".join(encode_frame(b"x" * 10) for _ in range(100))
    stream = FakeStream(data, chunk=1 << 20)
    reader = FrameReader(stream, 1024)
    for _ in range(100):
        await reader.read_frame()
    assert stream.reads == 1


class _HalfFrameStream:
    """Sends the first half of a 100-byte frame, then stays silent for ever."""

    def __init__(self) -> None:
        self.sent = False

    async def read(self, n: int | None = None) -> bytes:
        if not self.sent:
            self.sent = True
            return encode_frame(b"x" * 100)[:50]
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_half_sent_frame_times_out(autojump_clock):
    reader = FrameReader(_HalfFrameStream(), 1024, frame_timeout=30.0)
    started = trio.current_time()
    with pytest.raises(RemoteProtocolError, match="incomplete"):
        await reader.read_frame()
    assert trio.current_time() - started == pytest.approx(30.0)


async def test_silence_between_frames_has_no_deadline(autojump_clock):
    class Idle:
        async def read(self, n=None):
            await trio.sleep_forever()

    reader = FrameReader(Idle(), 1024, frame_timeout=1.0)
    with trio.move_on_after(3600) as scope:
        await reader.read_frame()
    assert scope.cancelled_caught  # still waiting after an hour: no frame had started
