"""Strict reading of the canonical byte strings of the consensus package, pure.

Writing reuses :mod:`ps_p2p.records.canonical` (``u32``, ``u64``, ``lp``, ``lps``: big-endian
integers, ``bytes(b) = u32(len(b)) || b``). Reading is a :class:`Reader` over a peer's bytes:
every length is checked against a caller-given bound before anything is sliced, and
:meth:`Reader.done` refuses trailing bytes, so a value decodes only from its one canonical form.
"""

from __future__ import annotations

import struct

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.records.canonical import lp, lps, u32, u64


def u8(n: int) -> bytes:
    """``n`` as 1 byte (``struct.error`` outside [0, 256))."""
    return struct.pack(">B", n)


class Reader:
    """Reads a canonical byte string front to back.

    Args:
        data: the bytes to read.
        error: the exception class raised on malformed input (a :class:`RemoteProtocolError`
            subclass, so the caller's error names what was malformed).
        what: a noun for error messages (``"block"``, ``"transaction"``).
    """

    def __init__(
        self, data: bytes, error: type[RemoteProtocolError] = RemoteProtocolError,
        what: str = "message",
    ) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise error(f"{what} is a {type(data).__name__}, not bytes")
        self._data = bytes(data)
        self._pos = 0
        self._error = error
        self._what = what

    def fail(self, reason: str) -> RemoteProtocolError:
        """The error to raise for ``reason`` (the caller raises it)."""
        return self._error(f"malformed {self._what}: {reason}")

    def _take(self, n: int, field: str) -> bytes:
        if self._pos + n > len(self._data):
            raise self.fail(f"{field} truncated")
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def u8(self, field: str) -> int:
        return self._take(1, field)[0]

    def u32(self, field: str) -> int:
        return int.from_bytes(self._take(4, field), "big")

    def u64(self, field: str) -> int:
        return int.from_bytes(self._take(8, field), "big")

    def lp(self, field: str, max_bytes: int, exact: int | None = None) -> bytes:
        """A length-prefixed byte string of at most ``max_bytes`` (exactly ``exact`` if given)."""
        n = self.u32(field)
        if n > max_bytes:
            raise self.fail(f"{field} of {n} bytes (max {max_bytes})")
        if exact is not None and n != exact:
            raise self.fail(f"{field} of {n} bytes (expected {exact})")
        return self._take(n, field)

    def lps(self, field: str, max_bytes: int) -> str:
        """A length-prefixed UTF-8 string of at most ``max_bytes`` bytes."""
        raw = self.lp(field, max_bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{field} is not UTF-8") from None

    def prefix(self, expected: bytes, field: str) -> None:
        """Consume ``expected`` (a domain-separation prefix or magic)."""
        if self._take(len(expected), field) != expected:
            raise self.fail(f"wrong {field}")

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def done(self) -> None:
        """Refuse trailing bytes."""
        if self._pos != len(self._data):
            raise self.fail(f"{len(self._data) - self._pos} trailing bytes")


__all__ = ["Reader", "lp", "lps", "u8", "u32", "u64"]
