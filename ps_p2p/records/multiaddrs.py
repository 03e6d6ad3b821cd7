"""Multiaddrs in the binary form node records store and sign, pure.

A record lists at most :data:`~ps_p2p.records.limits.MAX_ADDRS` multiaddrs (multiformats
multiaddr spec), each in its binary form of at most
:data:`~ps_p2p.records.limits.MAX_ADDR_BYTES` bytes and without ``/p2p/``.
:func:`multiaddr_bytes` turns a node's own text multiaddr into that form (a local error if it is
not one); :func:`check_multiaddr` parses a peer's bytes strictly, so what is stored and signed is
exactly what was validated. Parsing uses the pure ``multiaddr`` package (~25 us a round trip; a
DNS multiaddr ~0.4 ms for IDNA, hence a bounded memo of addresses already checked).
"""

from __future__ import annotations

import collections

from multiaddr import transforms as _ma

from ps_p2p.errors import LocalProtocolError, RemoteProtocolError
from ps_p2p.records.limits import MAX_ADDR_BYTES


def multiaddr_bytes(text: str) -> bytes:
    """The binary form of a text multiaddr (e.g. ``/ip4/127.0.0.1/tcp/4001`` -> 8 bytes).

    Raises:
        LocalProtocolError: ``text`` is not a multiaddr.
    """
    try:
        data = _ma.string_to_bytes(text)
    except Exception as exc:
        raise LocalProtocolError(f"{text[:120]!r} is not a multiaddr: {exc}") from exc
    if not data:
        raise LocalProtocolError("an empty multiaddr")
    return bytes(data)


#: Binary multiaddrs that passed :func:`check_multiaddr` (a pure memo, least recently used out):
#: a DNS multiaddr costs ~0.4 ms to check (IDNA), and nodes renew with the same addresses.
_CHECKED_ADDRS: collections.OrderedDict[bytes, str] = collections.OrderedDict()
_CHECKED_ADDRS_MAX = 16_384


def check_multiaddr(addr: bytes) -> str:
    """Parse a binary multiaddr strictly; returns its text form.

    The bytes must be exactly the canonical encoding of what they parse to (no trailing bytes,
    no non-minimal varints), so what is stored is what was validated.

    Raises:
        RemoteProtocolError: not bytes, empty, longer than :data:`MAX_ADDR_BYTES`, or not a
            canonical multiaddr.
    """
    if not isinstance(addr, bytes):
        raise RemoteProtocolError(f"record address is a {type(addr).__name__}, not bytes")
    if not 0 < len(addr) <= MAX_ADDR_BYTES:
        raise RemoteProtocolError(
            f"record address of {len(addr)} bytes (1 to {MAX_ADDR_BYTES} allowed)"
        )
    known = _CHECKED_ADDRS.get(addr)
    if known is not None:
        _CHECKED_ADDRS.move_to_end(addr)
        return known
    try:
        text = _ma.bytes_to_string(addr)
        canonical = _ma.string_to_bytes(text)
    except Exception as exc:
        raise RemoteProtocolError(f"record address is not a multiaddr: {exc}") from None
    if canonical != addr:
        raise RemoteProtocolError("record address is not a canonical multiaddr")
    _CHECKED_ADDRS[addr] = text
    if len(_CHECKED_ADDRS) > _CHECKED_ADDRS_MAX:
        _CHECKED_ADDRS.popitem(last=False)
    return text


__all__ = ["check_multiaddr", "multiaddr_bytes"]
