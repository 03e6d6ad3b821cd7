"""Frames: an unsigned-varint length prefix followed by one protobuf message.

The prefix is the unsigned varint of the multiformats spec (https://github.com/multiformats/unsigned-varint),
as used by libp2p's own length-prefixed protocols. Every protocol has its own frame size limit; a
length above it is rejected *before* the body is read, so a peer cannot make us buffer more than
the limit. A frame is always written in one ``write()`` (DESIGN.md, py-libp2p pitfalls).
"""

from __future__ import annotations

from typing import Protocol

import trio
from libp2p.utils.varint import encode_uvarint

from ps_p2p.errors import FrameTooLargeError, RemoteProtocolError

#: A varint longer than this many bytes encodes more than 63 bits: malformed.
MAX_VARINT_BYTES = 9


class _Reader(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...


def encode_varint(n: int) -> bytes:
    """Unsigned LEB128 varint of ``n`` (0 <= n < 2**63), by py-libp2p's own encoder
    (:func:`libp2p.utils.varint.encode_uvarint`), bounded to what our readers accept.

    Raises:
        ValueError: ``n`` negative or 2**63 and above.

    Decoding stays ours (:func:`read_frame`, :class:`FrameReader`): py-libp2p's decoders accept
    non-minimal encodings, which the unsigned-varint spec forbids and which would let one
    length have several encodings, and its stream decoder reads one byte per call (a Yamux read
    each); ours parse what one read brought and keep a per-frame deadline.
    """
    if n >= 1 << 63:
        raise ValueError(f"varint of {n}: at most 2**63 - 1 (9 bytes)")
    return encode_uvarint(n)


def encode_frame(message: bytes) -> bytes:
    """``varint(len(message)) + message``, ready for one ``stream.write``."""
    return encode_varint(len(message)) + message


async def _read_exactly(stream: _Reader, n: int) -> bytes:
    parts: list[bytes] = []
    remaining = n
    while remaining:
        chunk = await stream.read(remaining)
        if not chunk:  # some streams signal EOF with b"" instead of StreamEOF
            raise RemoteProtocolError(f"stream ended {remaining} bytes short of a frame")
        parts.append(chunk)
        remaining -= len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_frame(stream: _Reader, max_bytes: int) -> bytes:
    """Read one frame's body from ``stream``.

    Args:
        stream: anything with ``async read(n)`` (a libp2p ``INetStream``).
        max_bytes: the protocol's frame limit; a longer length prefix is refused unread.

    Returns:
        the frame body (may be empty).

    Raises:
        libp2p StreamEOF (or the stream's own error): the stream ended before the first byte.
        FrameTooLargeError: the length prefix exceeds ``max_bytes``.
        RemoteProtocolError: a malformed varint, or the stream ended inside the frame.
    """
    length = 0
    shift = 0
    for i in range(MAX_VARINT_BYTES + 1):
        if i == MAX_VARINT_BYTES:
            raise RemoteProtocolError("frame length varint too long")
        if i == 0:
            byte = await stream.read(1)
        else:
            try:
                byte = await stream.read(1)
            except EOFError as exc:  # libp2p's StreamEOF and MuxedStreamEOF are EOFErrors
                raise RemoteProtocolError("stream ended inside a frame length") from exc
        if not byte:
            raise RemoteProtocolError("stream ended inside a frame length")
        b = byte[0]
        length |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if i > 0 and b == 0:
                raise RemoteProtocolError("non-minimal frame length varint")
            break
    if length > max_bytes:
        raise FrameTooLargeError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    if length == 0:
        return b""
    try:
        return await _read_exactly(stream, length)
    except EOFError as exc:
        raise RemoteProtocolError("stream ended inside a frame") from exc


#: Bytes asked of the stream per read by :class:`FrameReader`.
READ_CHUNK = 256 * 1024


#: Seconds a frame may take from its first byte to its last (:class:`FrameReader`): a peer that
#: sends half a frame and stops must not hold the buffer and the stream for ever.
FRAME_TIMEOUT = 30.0


class FrameReader:
    """Reads frames from one stream through a buffer: one ``stream.read`` per chunk of bytes
    that arrived, not one per varint byte (a py-libp2p Yamux read costs tens of microseconds, so
    on a stream of many small frames this is most of the receive cost).

    Args:
        stream: anything with ``async read(n)`` returning up to ``n`` available bytes.
        max_bytes: the protocol's frame limit.
        frame_timeout: seconds from a frame's first byte to its last (default
            :data:`FRAME_TIMEOUT`); None waits for ever. Time between frames is not limited.
    """

    def __init__(
        self, stream: _Reader, max_bytes: int, *, frame_timeout: float | None = FRAME_TIMEOUT
    ) -> None:
        self._stream = stream
        self._max = max_bytes
        self._frame_timeout = frame_timeout
        # what the last read brought, as it came (bytes: a frame inside it is copied once, by
        # its slice); a bytearray only while a frame spans several reads
        self._buf: bytes | bytearray = b""
        self._pos = 0

    def _parse_length(self) -> tuple[int, int] | None:
        """(length, header bytes) of the frame at the buffer's position, None if incomplete."""
        length = 0
        shift = 0
        buf, pos = self._buf, self._pos
        for i in range(MAX_VARINT_BYTES):
            if pos + i >= len(buf):
                return None
            b = buf[pos + i]
            length |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                if i > 0 and b == 0:
                    raise RemoteProtocolError("non-minimal frame length varint")
                if length > self._max:
                    raise FrameTooLargeError(
                        f"frame of {length} bytes exceeds the {self._max}-byte limit"
                    )
                return length, i + 1
        raise RemoteProtocolError("frame length varint too long")

    async def _fill(self) -> None:
        pending = len(self._buf) - self._pos
        try:
            chunk = await self._stream.read(READ_CHUNK)
        except EOFError as exc:  # libp2p's StreamEOF and MuxedStreamEOF are EOFErrors
            if pending:
                raise RemoteProtocolError("stream ended inside a frame") from exc
            raise
        if not chunk:
            if pending:
                raise RemoteProtocolError("stream ended inside a frame")
            raise RemoteProtocolError("stream returned no data")
        if not pending:
            self._buf = chunk  # kept as it came: no copy
        elif isinstance(self._buf, bytearray):
            del self._buf[: self._pos]
            self._buf += chunk
        else:
            self._buf = bytearray(memoryview(self._buf)[self._pos :]) + chunk
        self._pos = 0

    async def read_frame(self) -> bytes:
        """The next frame's body.

        Raises:
            the stream's EOF error (StreamEOF) at a clean end between frames;
            FrameTooLargeError: a length prefix above the limit (before the body is read);
            RemoteProtocolError: a malformed prefix, the stream ended inside a frame, or the
                frame was not complete ``frame_timeout`` seconds after its first byte.
        """
        deadline = None
        while True:
            parsed = self._parse_length()
            if parsed is not None:
                length, header = parsed
                start = self._pos + header
                end = start + length
                if len(self._buf) >= end:
                    self._pos = end
                    if isinstance(self._buf, bytes):
                        return self._buf[start:end]
                    return bytes(memoryview(self._buf)[start:end])
            if self._pos >= len(self._buf) or self._frame_timeout is None:
                await self._fill()  # between frames: no deadline
                continue
            if deadline is None:
                deadline = trio.current_time() + self._frame_timeout
            with trio.move_on_at(deadline):
                await self._fill()
                continue
            raise RemoteProtocolError(
                f"frame incomplete {self._frame_timeout:.0f} s after its first byte"
            )


__all__ = ["FrameReader", "encode_frame", "encode_varint", "read_frame"]
