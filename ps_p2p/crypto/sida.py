"""S-IDA: secret sharing made short (pure core).

Source: H. Krawczyk, "Secret sharing made short", CRYPTO '93; PlanetServe sec. 3.2.

A message M becomes ``total`` (n) cloves, any ``threshold`` (k) of which give M back:

1. M is sealed with AES-256-GCM under a fresh key K. The additional data binds the message ID, n
   and k (``AAD_PREFIX || message_id || n || k``), so a clove that lies about them fails the
   check. The nonce is fixed (twelve zero bytes): that is safe because K is drawn fresh for each
   message and seals exactly one plaintext, so a (key, nonce) pair is never used twice.
2. The ciphertext (tag included) is padded to a multiple of k with p bytes of value p, 1 <= p <= k,
   and cut into k data fragments; the systematic k-of-n erasure code of ``zfec`` (Rizzo's
   Vandermonde code) adds n - k parity fragments. Fragment i is data block i for i < k.
3. K is cut by Shamir k-of-n secret sharing over GF(2^8), byte by byte: each of the 32 key bytes is
   the constant term of its own random polynomial of degree k - 1, and key share i holds the 32
   values at x = i + 1. The field is GF(2^8) modulo x^8 + x^4 + x^3 + x + 1 (0x11B, the AES
   polynomial). Any k - 1 shares are uniformly distributed whatever K is, so they reveal nothing
   of K; the erasure-coded fragments may reveal ciphertext, which is useless without K.

Clove i is (message ID, i, n, k, fragment i, key share i). Any k cloves with distinct indices
decode. A tampered fragment or key share makes the AEAD check (or, for a byte that lands in the
padding, the padding check) fail, and :func:`decode` then tries the other k-subsets, so with n > k
one bad relay cannot deny service.

This module is a pure core: no trio, libp2p, protobuf, clock or global randomness (randomness comes
in as ``random_bytes``, default :func:`os.urandom`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import zfec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ps_p2p.errors import DecodeError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "AAD_PREFIX",
    "DEFAULT_THRESHOLD",
    "DEFAULT_TOTAL",
    "KEY_BYTES",
    "MAX_FRAGMENT_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_TOTAL",
    "MESSAGE_ID_BYTES",
    "TAG_BYTES",
    "Clove",
    "decode",
    "decode_subset",
    "encode",
]

DEFAULT_TOTAL = 4
"""n: cloves per message (PlanetServe's default)."""
DEFAULT_THRESHOLD = 3
"""k: cloves needed to decode (PlanetServe's default)."""
MAX_TOTAL = 16
"""Largest n accepted (locally and from peers)."""
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest plaintext :func:`encode` accepts: 4 MiB."""
KEY_BYTES = 32
"""AES-256 key length; also the length of every key share."""
MESSAGE_ID_BYTES = 16
"""Length of a message ID."""
TAG_BYTES = 16
"""AES-GCM authentication tag length."""
MAX_FRAGMENT_BYTES = MAX_MESSAGE_BYTES + TAG_BYTES + 1
"""Largest fragment: a 4 MiB message sealed (+16 B tag) and padded (+1 B) for k = 1."""

AAD_PREFIX = b"planetserve/v1/sida\x00"
"""Domain-separation prefix of the AEAD additional data."""

_NONCE = bytes(12)  # safe: every key seals exactly one message (see module docstring)
_ORDER = "little"

RandomBytes = Callable[[int], bytes]


# ---------------------------------------------------------------------------------------- GF(2^8)


def _build_mul_tables() -> tuple[bytes, ...]:
    """MUL[c][x] = c * x in GF(2^8) mod 0x11B, as 256 translate tables of 256 bytes each."""
    xtime = bytes(((x << 1) ^ 0x11B) if x & 0x80 else (x << 1) for x in range(256))
    identity = bytes(range(256))
    identity_int = int.from_bytes(identity, _ORDER)
    tables = [bytes(256), identity]
    for c in range(2, 256):
        if c & 1:  # c = (c - 1) + 1
            row = (int.from_bytes(tables[c - 1], _ORDER) ^ identity_int).to_bytes(256, _ORDER)
        else:  # c = 2 * (c / 2): apply xtime to every product
            row = tables[c >> 1].translate(xtime)
        tables.append(row)
    return tuple(tables)


MUL: tuple[bytes, ...] = _build_mul_tables()
"""``MUL[c]``: 256-byte table, ``MUL[c][x] == c * x`` in GF(2^8) mod 0x11B.

``s.translate(MUL[c])`` multiplies every byte of ``s`` by ``c``.
"""


def _gf_mul(a: int, b: int) -> int:
    return MUL[a][b]


def _gf_inv(a: int) -> int:
    return MUL[a].index(1)


_INV = bytes([0] + [_gf_inv(a) for a in range(1, 256)])

def _powers(x: int) -> tuple[int, ...]:
    out = [1]
    for _ in range(MAX_TOTAL - 1):
        out.append(_gf_mul(out[-1], x))
    return tuple(out)


_POW: tuple[tuple[int, ...], ...] = tuple(_powers(x) for x in range(MAX_TOTAL + 1))
"""``_POW[x][j] = x^j`` for the share points x = 1..MAX_TOTAL and j < MAX_TOTAL."""

_LAGRANGE_CACHE: dict[tuple[int, ...], tuple[int, ...]] = {}
_LAGRANGE_CACHE_MAX = 4096  # distinct index sets a peer can make us cache


def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Lagrange basis values L_i(0) = prod_{j != i} x_j / (x_j - x_i) over GF(2^8) (cached)."""
    coeffs = _LAGRANGE_CACHE.get(xs)
    if coeffs is None:
        out = []
        for i, xi in enumerate(xs):
            num = den = 1
            for j, xj in enumerate(xs):
                if j != i:
                    num = _gf_mul(num, xj)
                    den = _gf_mul(den, xj ^ xi)
            out.append(_gf_mul(num, _INV[den]))
        if len(_LAGRANGE_CACHE) >= _LAGRANGE_CACHE_MAX:
            _LAGRANGE_CACHE.clear()
        coeffs = _LAGRANGE_CACHE[xs] = tuple(out)
    return coeffs


def _share_key(key: bytes, coefficients: bytes, total: int, threshold: int) -> list[bytes]:
    """Shamir-share ``key`` byte-wise: share i = f(i + 1), f(0) = key, a_1..a_{k-1} given."""
    if threshold == 1:
        return [key] * total
    key_int = int.from_bytes(key, _ORDER)
    coeffs = [
        coefficients[j * KEY_BYTES:(j + 1) * KEY_BYTES] for j in range(threshold - 1)
    ]  # a_1 .. a_{k-1}
    shares = []
    for x in range(1, total + 1):
        powers = _POW[x]
        acc = key_int
        for j, a in enumerate(coeffs, start=1):
            acc ^= int.from_bytes(a.translate(MUL[powers[j]]), _ORDER)
        shares.append(acc.to_bytes(KEY_BYTES, _ORDER))
    return shares


def _combine_key(shares: Sequence[bytes], xs: tuple[int, ...]) -> bytes:
    """Interpolate f(0) from k shares at the distinct points ``xs`` (byte-wise, GF(2^8))."""
    acc = 0
    for share, c in zip(shares, _lagrange_at_zero(xs)):
        acc ^= int.from_bytes(share.translate(MUL[c]), _ORDER)
    return acc.to_bytes(KEY_BYTES, _ORDER)


# -------------------------------------------------------------------------------------- zfec cache

_ENCODERS: dict[tuple[int, int], tuple[zfec.Encoder, tuple[int, ...]]] = {}
_DECODERS: dict[tuple[int, int], zfec.Decoder] = {}


def _encoder(k: int, n: int) -> tuple[zfec.Encoder, tuple[int, ...]]:
    entry = _ENCODERS.get((k, n))
    if entry is None:
        entry = _ENCODERS[(k, n)] = (zfec.Encoder(k, n), tuple(range(k, n)))
    return entry


def _decoder(k: int, n: int) -> zfec.Decoder:
    decoder = _DECODERS.get((k, n))
    if decoder is None:
        decoder = _DECODERS[(k, n)] = zfec.Decoder(k, n)
    return decoder


_DISAGREE = "cloves disagree on message ID, total, threshold or fragment size"


def _aad(message_id: bytes, total: int, threshold: int) -> bytes:
    return AAD_PREFIX + message_id + bytes((total, threshold))


# ---------------------------------------------------------------------------------------- cloves


@dataclass(frozen=True)
class Clove:
    """One S-IDA share of a message: a fragment of its ciphertext and a share of its key.

    Attributes:
        message_id: 16 bytes, the same in all cloves of a message.
        index: i in [0, total); fragment i of the erasure code, key share at x = i + 1.
        total: n, 1 <= threshold <= n <= MAX_TOTAL (16).
        threshold: k, the number of cloves needed to decode.
        fragment: 1 .. MAX_FRAGMENT_BYTES bytes; equally long in all cloves of a message.
        key_share: KEY_BYTES (32) bytes.
    """

    message_id: bytes
    index: int
    total: int
    threshold: int
    fragment: bytes
    key_share: bytes

    def check(self) -> None:
        """Check field ranges (not the content; that is the AEAD's job).

        Raises:
            RemoteProtocolError: message ID not 16 bytes; not 1 <= threshold <= total <= 16;
                index not in [0, total); key share not 32 bytes; fragment empty or over
                MAX_FRAGMENT_BYTES.
        """
        if len(self.message_id) != MESSAGE_ID_BYTES:
            raise RemoteProtocolError(
                f"clove message ID is {len(self.message_id)} bytes, not {MESSAGE_ID_BYTES}"
            )
        if not 1 <= self.threshold <= self.total <= MAX_TOTAL:
            raise RemoteProtocolError(
                f"clove threshold/total {self.threshold}/{self.total} out of range "
                f"(need 1 <= threshold <= total <= {MAX_TOTAL})"
            )
        if not 0 <= self.index < self.total:
            raise RemoteProtocolError(f"clove index {self.index} not in [0, {self.total})")
        if len(self.key_share) != KEY_BYTES:
            raise RemoteProtocolError(
                f"clove key share is {len(self.key_share)} bytes, not {KEY_BYTES}"
            )
        if not 0 < len(self.fragment) <= MAX_FRAGMENT_BYTES:
            raise RemoteProtocolError(
                f"clove fragment of {len(self.fragment)} bytes (need 1..{MAX_FRAGMENT_BYTES})"
            )


def encode(
    message: bytes,
    total: int = DEFAULT_TOTAL,
    threshold: int = DEFAULT_THRESHOLD,
    *,
    random_bytes: RandomBytes = os.urandom,
    message_id: bytes | None = None,
) -> list[Clove]:
    """Split ``message`` into ``total`` cloves, any ``threshold`` of which decode it.

    Randomness is drawn in this order: the message ID (16 bytes, only when ``message_id`` is None),
    the key K (32 bytes), then the Shamir coefficients a_1..a_{k-1} (32 * (k - 1) bytes, one call,
    only when k > 1; coefficient j of key byte b is byte ``32 * (j - 1) + b``).

    Args:
        message: plaintext, 0 .. MAX_MESSAGE_BYTES (4 MiB).
        total: n, number of cloves, threshold <= n <= MAX_TOTAL (16).
        threshold: k, cloves needed to decode, >= 1.
        random_bytes: ``f(n) -> n random bytes``; a CSPRNG (default :func:`os.urandom`).
        message_id: 16 bytes; default: fresh random.

    Returns:
        ``total`` cloves, clove i at position i. Each fragment is
        ceil((len(message) + 17) / k) bytes long.

    Raises:
        LocalProtocolError: bad total/threshold, message over MAX_MESSAGE_BYTES, message ID not
            16 bytes, or ``random_bytes`` returned the wrong length (all the caller's errors).
    """
    if not 1 <= threshold <= total <= MAX_TOTAL:
        raise LocalProtocolError(
            f"need 1 <= threshold <= total <= {MAX_TOTAL}, got threshold={threshold} total={total}"
        )
    if len(message) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(f"message of {len(message)} bytes is over {MAX_MESSAGE_BYTES}")
    if message_id is None:
        message_id = _draw(random_bytes, MESSAGE_ID_BYTES)
    elif len(message_id) != MESSAGE_ID_BYTES:
        raise LocalProtocolError(
            f"message ID must be {MESSAGE_ID_BYTES} bytes, got {len(message_id)}"
        )
    else:
        message_id = bytes(message_id)
    key = _draw(random_bytes, KEY_BYTES)
    coefficients = _draw(random_bytes, KEY_BYTES * (threshold - 1)) if threshold > 1 else b""

    ciphertext = AESGCM(key).encrypt(_NONCE, message, _aad(message_id, total, threshold))
    size = len(ciphertext)
    pad = threshold - size % threshold  # 1..k
    frag_len = (size + pad) // threshold
    last = (threshold - 1) * frag_len
    if pad > frag_len:  # tiny message: the padding spans more than the last fragment
        ciphertext += bytes((pad,)) * pad
        blocks = [ciphertext[i:i + frag_len] for i in range(0, size + pad, frag_len)]
    else:  # usual case: pad only the last fragment (saves copying the whole ciphertext)
        blocks = [ciphertext[i:i + frag_len] for i in range(0, last, frag_len)]
        blocks.append(ciphertext[last:] + bytes((pad,)) * pad)
    if total > threshold:
        encoder, parity_nums = _encoder(threshold, total)
        blocks.extend(encoder.encode(blocks, parity_nums))

    shares = _share_key(key, coefficients, total, threshold)
    return [
        Clove(message_id, i, total, threshold, fragment, share)
        for i, (fragment, share) in enumerate(zip(blocks, shares))
    ]


def _draw(random_bytes: RandomBytes, n: int) -> bytes:
    data = random_bytes(n)
    if len(data) != n:
        raise LocalProtocolError(f"random_bytes({n}) returned {len(data)} bytes")
    return bytes(data)


def decode_subset(cloves: Sequence[Clove]) -> bytes:
    """Decode from exactly k cloves with distinct indices; no retry.

    For a reassembler that picks its own subsets. The cloves need not be sorted.

    Args:
        cloves: exactly ``threshold`` cloves of one message.

    Returns:
        The plaintext.

    Raises:
        RemoteProtocolError: a clove fails :meth:`Clove.check`; the cloves disagree on message
            ID, total, threshold or fragment length, repeat an index, or are not exactly
            ``threshold`` many.
        DecodeError: the AEAD check fails (a tampered fragment or key share) or the padding is
            malformed.
    """
    if not cloves:
        raise RemoteProtocolError("decode_subset needs cloves, got none")
    first = cloves[0]
    k, n, message_id, frag_len = first.threshold, first.total, first.message_id, len(first.fragment)
    if len(cloves) != k:
        raise RemoteProtocolError(f"decode_subset needs exactly {k} cloves, got {len(cloves)}")
    for clove in cloves:
        clove.check()
        if (
            clove.message_id != message_id
            or clove.total != n
            or clove.threshold != k
            or len(clove.fragment) != frag_len
        ):
            raise RemoteProtocolError(_DISAGREE)
    ordered = sorted(cloves, key=_index)
    indices = tuple(c.index for c in ordered)
    if len(set(indices)) != k:  # zfec would loop forever on a repeated block number
        raise RemoteProtocolError(f"repeated clove index in {indices}")
    return _decode_sorted(ordered, indices, k, n, message_id, frag_len)


def _index(clove: Clove) -> int:
    return clove.index


def _decode_sorted(
    ordered: Sequence[Clove],
    indices: tuple[int, ...],
    k: int,
    n: int,
    message_id: bytes,
    frag_len: int,
) -> bytes:
    """Decode k consistent cloves sorted by distinct index (checked by the caller)."""
    if indices[-1] == k - 1:  # exactly the data fragments 0..k-1: no erasure decoding
        data = [c.fragment for c in ordered]
    else:
        data = _decoder(k, n).decode([c.fragment for c in ordered], indices)
    padded = b"".join(data)
    pad = padded[-1]
    size = k * frag_len - pad
    # Check every pad byte, so that any change to any fragment byte is caught (here or by the AEAD).
    if not 1 <= pad <= k or size < TAG_BYTES or padded.count(pad, size) != pad:
        raise DecodeError("malformed S-IDA padding")
    ciphertext = memoryview(padded)[:size]
    key = _combine_key([c.key_share for c in ordered], tuple(i + 1 for i in indices))
    try:
        return AESGCM(key).decrypt(_NONCE, ciphertext, _aad(message_id, n, k))
    except InvalidTag:
        raise DecodeError("S-IDA AEAD check failed (tampered fragment or key share)") from None


def decode(cloves: Iterable[Clove], *, max_attempts: int | None = None) -> bytes:
    """Recover the message from any k cloves, retrying other k-subsets after an AEAD failure.

    Cloves are deduplicated by index (the first clove of each index is kept) and sorted; the
    k-subsets are tried in lexicographic order of indices, so the data fragments 0..k-1 (no
    erasure decoding) go first. Cost: one AEAD check per subset tried, at most C(n, k).

    Args:
        cloves: cloves of one message, any order.
        max_attempts: stop after this many subsets (None: try all).

    Returns:
        The plaintext.

    Raises:
        RemoteProtocolError: a clove fails :meth:`Clove.check`, or the cloves disagree on
            message ID, total, threshold or fragment length.
        DecodeError: fewer than k distinct indices, or no subset tried decodes.
    """
    by_index: dict[int, Clove] = {}
    first: Clove | None = None
    for clove in cloves:
        clove.check()
        if first is None:
            first = clove
        elif (
            clove.message_id != first.message_id
            or clove.total != first.total
            or clove.threshold != first.threshold
            or len(clove.fragment) != len(first.fragment)
        ):
            raise RemoteProtocolError(_DISAGREE)
        by_index.setdefault(clove.index, clove)
    if first is None:
        raise DecodeError("no cloves")
    k, n = first.threshold, first.total
    if len(by_index) < k:
        raise DecodeError(f"{len(by_index)} distinct cloves, need {k}")
    ordered = [by_index[i] for i in sorted(by_index)]
    message_id, frag_len = first.message_id, len(first.fragment)
    attempts = 0
    for subset in itertools.combinations(ordered, k):
        if max_attempts is not None and attempts >= max_attempts:
            break
        attempts += 1
        try:
            return _decode_sorted(
                subset, tuple(c.index for c in subset), k, n, message_id, frag_len
            )
        except DecodeError:
            continue
    raise DecodeError(f"no {k}-subset of {len(ordered)} cloves decodes ({attempts} tried)")
