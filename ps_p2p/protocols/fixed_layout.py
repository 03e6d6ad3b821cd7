"""Protobuf wire form of the overlay's hot frames without building protobuf objects (issue 22).

The schema stays ``protos/planetserve/v1/clove.proto``: this module writes and reads the same
bytes as the generated classes for the messages whose layout is fixed: a oneof's one sub-message
holding ``bytes`` fields (protobuf encoding: https://protobuf.dev/programming-guides/encoding/).

* Encoding writes what protobuf's own serializer writes: fields in field-number order, an empty
  ``bytes`` field left out (proto3), the oneof's sub-message always present (``tag 00`` when
  empty), minimal varints. ``tests/test_fixed_layout.py`` checks byte for byte against the
  generated classes.
* Decoding takes only that canonical layout (each field at most once, in order, minimal varints,
  nothing else) and returns None for anything else, which the callers then parse with the
  generated classes: every input decodes to what the schema's parser would give, or is refused
  as it would refuse it (the fuzz-equivalence test in the same file).

Why: a relay handles every cell twice (decode, encode) and each ``CloveFrame`` round through the
generated classes costs two message objects and five calls into them; these functions cost a few
slices. Shapes: ``bytes`` in, ``bytes`` out; no errors are raised (None means "not canonical").
"""

from __future__ import annotations

#: Wire type 2 (LEN) tags of fields 1-5: (field << 3) | 2.
TAG = (b"", b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a")


def uvarint(n: int) -> bytes:
    """Minimal unsigned LEB128 of ``0 <= n < 2**63`` (protobuf's and multiformats' varint).

    Raises:
        ValueError: ``n`` negative or too large.
    """
    if 0 <= n < 0x80:
        return _SMALL[n]
    if n < 0 or n >= 1 << 63:
        raise ValueError(f"varint of {n}: 0 to 2**63 - 1")
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = tuple(bytes((i,)) for i in range(0x80))


def read_uvarint(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(value, position after it) of the minimal varint at ``data[pos:end]``; None when it is
    truncated, longer than 9 bytes or not minimal (a trailing zero byte)."""
    if pos + 1 < end:  # the lengths of cells: one or two bytes, read without a loop
        b = data[pos]
        if b < 0x80:
            return b, pos + 1
        c = data[pos + 1]
        if c < 0x80:
            return None if c == 0 else ((b & 0x7F) | c << 7, pos + 2)
    value = 0
    shift = 0
    for i in range(pos, min(end, pos + 9)):
        b = data[i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if b == 0 and i > pos:
                return None
            return value, i + 1
        shift += 7
    return None


def message(*fields: bytes) -> bytes:
    """A message of ``bytes`` fields 1, 2, ... as protobuf writes it (empty ones left out)."""
    parts: list[bytes] = []
    for number, value in enumerate(fields, 1):
        if value:
            parts += (TAG[number], uvarint(len(value)), value)
    return b"".join(parts)


def oneof(number: int, *fields: bytes) -> bytes:
    """An envelope whose oneof holds, as field ``number``, a message of ``bytes`` fields."""
    inner = message(*fields)
    return b"".join((TAG[number], uvarint(len(inner)), inner))


def read_message(data: bytes, start: int, end: int, count: int) -> list[bytes] | None:
    """The ``count`` ``bytes`` fields (1..count, absent ones b"") of the message that fills
    ``data[start:end]`` in the canonical layout, or None for any other layout."""
    values = [b""] * count
    pos = start
    expected = 1
    while pos < end:
        tag = data[pos]
        number = tag >> 3
        if tag & 7 != 2 or number < expected or number > count:
            return None
        read = read_uvarint(data, pos + 1, end)
        if read is None:
            return None
        length, pos = read
        stop = pos + length
        if stop > end:
            return None
        values[number - 1] = data[pos:stop]
        pos = stop
        expected = number + 1
    return values


def read_oneof(data: bytes, count: int) -> tuple[int, list[bytes]] | None:
    """(field number, its ``count`` ``bytes`` fields) of an envelope that is one oneof field
    holding a message of ``bytes`` fields, in the canonical layout; None otherwise."""
    n = len(data)
    if n < 2:
        return None
    tag = data[0]
    if tag & 7 != 2 or tag >> 3 == 0 or tag > 0x7F:
        return None
    read = read_uvarint(data, 1, n)
    if read is None:
        return None
    length, pos = read
    if pos + length != n:
        return None
    values = read_message(data, pos, n, count)
    return None if values is None else (tag >> 3, values)


__all__ = ["message", "oneof", "read_message", "read_oneof", "read_uvarint", "uvarint"]
