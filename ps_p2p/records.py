"""Node records, the directory and the verifiers' registry (PlanetServe sec. 3.2, 3.4), pure.

A *node record* is what a node tells the network about itself: peer ID, multiaddrs, roles, the
X25519 onion key its relays use, model ID, organization, capacity and validity window, signed by
its identity key. The *directory* is the set of live records at a registry height. Verifiers sign
only its *head* (height, validity window, record count and a digest of the whole set); the records
travel in bounded pages and deltas ("what changed since height H"), and a client checks that the
set it assembled has the signed digest. Once consensus lands a head carries 2f+1 signatures (a
quorum certificate) and :func:`verify_head` already takes the quorum as a parameter.

Every signature covers a canonical byte string with a domain-separation prefix and
length-prefixed fields (DESIGN.md "Wire"), never a re-serialized protobuf::

    record    = b"planetserve/v1/node-record\\x00" || bytes(peer_id) || u32(#addrs) || bytes(addr)*
                || u32(#roles) || u32(role)* (ascending) || bytes(onion_key) || str(model_id)
                || str(organization) || u64(capacity) || u64(issued_at_ms) || u64(expires_at_ms)
    head      = b"planetserve/v1/directory-head\\x00" || u64(height) || u64(issued_at_ms)
                || u64(expires_at_ms) || u32(#records) || bytes(root)
    response  = b"planetserve/v1/response\\x00" || bytes(request_id) || bytes(request hash)
                || bytes(content digest) || u64(signed_at_ms) || bytes(model node peer ID)

where ``bytes(b) = u32(len(b)) || b``, ``str(s) = bytes(utf8(s))``, integers are big-endian and
``addr`` is a multiaddr in its binary form (what the record stores and what was validated). The
*root* of a record set is a two-level hash (a Merkle tree of fixed shape, so one change costs
one bucket, not the whole set)::

    leaf(r)   = SHA-256(b"planetserve/v1/record-leaf\\x00" || bytes(record(r)) || bytes(sig(r)))
    bucket(b) = SHA-256(leaf(r) for the records r with peer_id[6] == b, ascending peer ID)
    root      = SHA-256(b"planetserve/v1/record-set\\x00" || u32(#records) || bucket(0..255))

``peer_id[6]`` is the first byte of the Ed25519 key of an identity-multihash peer ID (the only
kind a record may have), so the buckets are consecutive ranges of peer IDs. A verifier signature
does not cover the other verifiers' signatures, so verifiers sign independently.

Record field limits are in bytes (DESIGN.md "Security invariants"); the largest signed record is
about 720 bytes as a protobuf (:data:`MAX_RECORD_WIRE_BYTES` bounds it at 1 KiB)::

    peer ID 38 | multiaddrs 4 x <= 100 (binary) | roles <= 3 | onion key 32 | model ID <= 64
    | organization <= 64 | capacity, issue and expiry times | signature 64

Liveness is the verifiers' business, content the node's: a renewal that only moves a record's
issue and expiry times forward keeps the *published* record (same leaf, same height) and only
extends how long the registry keeps it; so a directory lists records whose own ``expires_at_ms``
may have passed while their node keeps renewing, and clients trust a record for as long as the
head that lists it is valid. A published record is replaced by its newest renewal once it is
:data:`REPUBLISH_AFTER_MS` old, so no listed record is much older than that.

Nothing here does I/O, reads a clock or imports trio, libp2p or the generated protobuf modules:
times come in as ``now_ms`` (unix milliseconds). Ed25519 verification uses libsodium through
PyNaCl (a dependency of py-libp2p; ~55 us per check against ~105 us with ``cryptography`` on the
2-core dev machine) and falls back to ``cryptography`` when PyNaCl is absent. Multiaddrs are
parsed with the pure ``multiaddr`` package (~25 us a round trip).
"""

from __future__ import annotations

import bisect
import collections
import enum
import functools
import hashlib
import heapq
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from multiaddr import transforms as _ma

from ps_p2p.errors import (
    ExpiredError,
    InvalidSignatureError,
    LocalProtocolError,
    RemoteProtocolError,
)

# ---------------------------------------------------------------------------------- limits

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS

#: Most multiaddrs a record may list (a node listens on a few interfaces and transports).
MAX_ADDRS = 4
#: Longest multiaddr in its binary form (``/dns4/<63-byte label>/tcp/<port>`` is 70 bytes;
#: ``/ip6/.../udp/<port>/quic-v1`` 23).
MAX_ADDR_BYTES = 100
#: Longest model ID (UTF-8 bytes; a Hugging Face ``org/name`` fits).
MAX_MODEL_ID_BYTES = 64
#: Longest organization (UTF-8 bytes).
MAX_ORGANIZATION_BYTES = 64
#: Bound of a whole signed record as a protobuf (the largest legal one is ~720 bytes).
MAX_RECORD_WIRE_BYTES = 1024
#: An X25519 public key.
ONION_KEY_BYTES = 32
#: An Ed25519 signature.
SIGNATURE_BYTES = 64
#: Longest validity window of a record (expires_at_ms - issued_at_ms).
MAX_RECORD_LIFETIME_MS = 24 * HOUR_MS
#: A renewal with unchanged content replaces the published record once that one is this old.
REPUBLISH_AFTER_MS = 12 * HOUR_MS
#: How far in the future a record or directory may be issued (clock skew allowance).
MAX_CLOCK_SKEW_MS = 5 * MINUTE_MS
#: Default bound of a :class:`Registry` and of a :class:`DirectoryReplica`.
MAX_RECORDS = 100_000
#: Default bound of the verified-record cache of a :class:`DirectoryReplica` (~150 bytes each).
VERIFIED_CACHE_ENTRIES = 2 * MAX_RECORDS
#: Number of buckets of the record-set root.
ROOT_BUCKETS = 256

_U32 = 2**32
_U64 = 2**64

#: identity multihash (0x00), length 36, protobuf PublicKey{Type: Ed25519, Data: 32 bytes}.
_ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
_ED25519_PEER_ID_BYTES = len(_ED25519_PEER_ID_PREFIX) + 32
_BUCKET_BYTE = len(_ED25519_PEER_ID_PREFIX)

RECORD_DOMAIN = b"planetserve/v1/node-record\x00"
DIRECTORY_DOMAIN = b"planetserve/v1/directory-head\x00"
RECORD_LEAF_DOMAIN = b"planetserve/v1/record-leaf\x00"
RECORD_SET_DOMAIN = b"planetserve/v1/record-set\x00"
RESPONSE_DOMAIN = b"planetserve/v1/response\x00"


# ---------------------------------------------------------------------------------- types


class Role(enum.IntEnum):
    """A node's roles; the numbers are those of ``planetserve.v1.Role``."""

    USER = 1
    MODEL = 2
    VERIFIER = 3


class Signer(Protocol):
    """What signs records and directories (``ps_p2p.keys.Identity``)."""

    @property
    def peer_id(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


@dataclass(frozen=True)
class NodeRecord:
    """One node's self-signed description (PlanetServe sec. 3.2 "node record").

    Attributes:
        peer_id: libp2p peer ID bytes (an Ed25519 identity multihash, 38 bytes).
        addrs: multiaddrs in binary form, without ``/p2p/`` (at most :data:`MAX_ADDRS` of at
            most :data:`MAX_ADDR_BYTES` bytes). Text multiaddrs given to the constructor are
            converted (:func:`multiaddr_bytes`); :meth:`multiaddrs` renders them as text.
        roles: non-empty.
        onion_key: X25519 public key, 32 bytes.
        model_id: the served model (model nodes only; required with :attr:`Role.MODEL`), at
            most :data:`MAX_MODEL_ID_BYTES` UTF-8 bytes.
        organization: free text, shown to users, at most :data:`MAX_ORGANIZATION_BYTES` bytes.
        capacity: concurrent requests (model nodes), < 2**32.
        issued_at_ms, expires_at_ms: unix milliseconds; the lifetime is at most 24 h.
        signature: Ed25519 by ``peer_id``'s key over :func:`record_signing_bytes`.

    Raises:
        LocalProtocolError: (constructor) a text address that is not a multiaddr.
    """

    peer_id: bytes
    addrs: tuple[bytes, ...]
    roles: frozenset[Role]
    onion_key: bytes
    model_id: str = ""
    organization: str = ""
    capacity: int = 0
    issued_at_ms: int = 0
    expires_at_ms: int = 0
    signature: bytes = b""

    def __post_init__(self) -> None:
        if any(isinstance(a, str) for a in self.addrs):
            converted = tuple(multiaddr_bytes(a) if isinstance(a, str) else a for a in self.addrs)
            object.__setattr__(self, "addrs", converted)

    def multiaddrs(self) -> list[str]:
        """The addresses as text multiaddrs (those that do not parse are left out)."""
        out = []
        for addr in self.addrs:
            try:
                out.append(_ma.bytes_to_string(bytes(addr)))
            except Exception:
                continue
        return out

    def content(self) -> tuple:
        """Everything a client uses: the record without its times and signature."""
        return (
            self.peer_id, self.addrs, self.roles, self.onion_key, self.model_id,
            self.organization, self.capacity,
        )


@dataclass(frozen=True)
class VerifierSignature:
    """A verifier's signature over :func:`head_signing_bytes`."""

    verifier_id: bytes
    signature: bytes


@dataclass(frozen=True)
class DirectoryHead:
    """What verifiers sign: a record set's height, validity window, size and root.

    Attributes:
        height: increases with every change of the record set (a record added, removed or
            its content changed); renewals that only move times do not count.
        issued_at_ms, expires_at_ms: unix milliseconds; the records it lists are live until
            ``expires_at_ms``.
        record_count: number of records in the set.
        root: :func:`record_set_root` of the set (32 bytes).
        signatures: one per verifier (2f+1 of a committee once consensus lands).
    """

    height: int
    issued_at_ms: int
    expires_at_ms: int
    record_count: int
    root: bytes
    signatures: tuple[VerifierSignature, ...] = ()


@dataclass(frozen=True)
class Directory:
    """The signed set of live node records at a registry height.

    Attributes:
        height: increases with every change of the record set.
        issued_at_ms, expires_at_ms: unix milliseconds (the head's).
        records: sorted by peer ID when built by a :class:`Registry` or a
            :class:`DirectoryReplica`.
        signatures: the head's; they cover :func:`directory_signing_bytes`.
    """

    height: int
    issued_at_ms: int
    expires_at_ms: int
    records: tuple[NodeRecord, ...]
    signatures: tuple[VerifierSignature, ...] = ()

    def users(self) -> list[NodeRecord]:
        """Records with :attr:`Role.USER`, in directory order."""
        return [r for r in self.records if Role.USER in r.roles]

    def model_nodes(self) -> list[NodeRecord]:
        """Records with :attr:`Role.MODEL`, in directory order."""
        return [r for r in self.records if Role.MODEL in r.roles]

    def record(self, peer_id: bytes) -> NodeRecord | None:
        """The record of ``peer_id``, or None (dict lookup, index built on first use)."""
        return self._index.get(peer_id)

    def head(self) -> DirectoryHead:
        """The head these records make (root computed here: O(records))."""
        return DirectoryHead(
            self.height, self.issued_at_ms, self.expires_at_ms, len(self.records),
            record_set_root(self.records), self.signatures,
        )

    @functools.cached_property
    def _index(self) -> dict[bytes, NodeRecord]:
        return {r.peer_id: r for r in self.records}


@dataclass(frozen=True)
class DirectoryPage:
    """One answer to "what changed since height ``since_height``" (a bounded page).

    Attributes:
        head: the signed head of the verifier's current set.
        since_height: the height the page starts from (0 when ``reset``).
        reset: the asked height could not be served as a delta (too old, or unknown): the
            client starts from an empty set.
        records: records added or changed after ``since_height`` (newest content each).
        removed: peer IDs removed after ``since_height``.
        next_height: the height this page brings the client to; equals ``head.height`` when
            not ``more``.
        more: ask again with ``since_height = next_height``.
    """

    head: DirectoryHead
    since_height: int
    reset: bool
    records: tuple[NodeRecord, ...]
    removed: tuple[bytes, ...]
    next_height: int
    more: bool


# ---------------------------------------------------------------------------------- encoding


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


def _u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def _lp(data: bytes) -> bytes:
    return _u32(len(data)) + data


def _lps(text: str) -> bytes:
    return _lp(text.encode("utf-8"))


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


def record_signing_bytes(record: NodeRecord) -> bytes:
    """The canonical byte string a record's signature covers (see the module docstring).

    Raises:
        LocalProtocolError: a field out of its wire range (negative or too large integer,
            a string that is not encodable as UTF-8).
    """
    try:
        parts = [RECORD_DOMAIN, _lp(bytes(record.peer_id)), _u32(len(record.addrs))]
        parts.extend(_lp(bytes(a)) for a in record.addrs)
        roles = sorted(int(r) for r in record.roles)
        parts.append(_u32(len(roles)))
        parts.extend(_u32(r) for r in roles)
        parts += [
            _lp(bytes(record.onion_key)),
            _lps(record.model_id),
            _lps(record.organization),
            _u64(record.capacity),
            _u64(record.issued_at_ms),
            _u64(record.expires_at_ms),
        ]
    except (struct.error, UnicodeError, TypeError, AttributeError, ValueError) as exc:
        raise LocalProtocolError(f"node record field out of range: {exc}") from exc
    return b"".join(parts)


def record_leaf(record: NodeRecord) -> bytes:
    """The record's leaf of the set root (module docstring): SHA-256, 32 bytes.

    Two records have the same leaf only if they are the same signed record, so the leaf also
    keys the cache of verified records.

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    return hashlib.sha256(
        RECORD_LEAF_DOMAIN
        + _lp(record_signing_bytes(record))
        + _lp(bytes(record.signature))
    ).digest()


_EMPTY_BUCKET = hashlib.sha256(b"").digest()


def _bucket_of(peer_id: bytes) -> int:
    return peer_id[_BUCKET_BYTE] if len(peer_id) > _BUCKET_BYTE else 0


class RecordSet:
    """A set of records, one per peer ID, with its root kept up to date incrementally.

    A change marks one bucket; :meth:`root` rehashes only the marked buckets (each ~1/256 of
    the set) and the 256 bucket digests (8 KiB): O(changes), never the whole set.
    """

    def __init__(self, records: Iterable[NodeRecord] = ()) -> None:
        self._records: dict[bytes, tuple[NodeRecord, bytes]] = {}
        self._buckets: list[list[bytes]] = [[] for _ in range(ROOT_BUCKETS)]
        self._digests: list[bytes | None] = [_EMPTY_BUCKET] * ROOT_BUCKETS
        self._root: bytes | None = None
        self._sorted: tuple[NodeRecord, ...] | None = ()
        for record in records:
            self.put(record)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, peer_id: bytes) -> bool:
        return peer_id in self._records

    def get(self, peer_id: bytes) -> NodeRecord | None:
        """The record of ``peer_id``, or None."""
        held = self._records.get(peer_id)
        return held[0] if held is not None else None

    def leaf(self, peer_id: bytes) -> bytes | None:
        """The leaf of ``peer_id``'s record, or None."""
        held = self._records.get(peer_id)
        return held[1] if held is not None else None

    def put(self, record: NodeRecord, leaf: bytes | None = None) -> NodeRecord | None:
        """Add or replace the record of ``record.peer_id``; returns the one it replaced.

        Args:
            leaf: :func:`record_leaf` of ``record`` when the caller has it.
        """
        if leaf is None:
            leaf = record_leaf(record)
        peer = record.peer_id
        old = self._records.get(peer)
        self._records[peer] = (record, leaf)
        bucket = _bucket_of(peer)
        if old is None:
            bisect.insort(self._buckets[bucket], peer)
        self._digests[bucket] = None
        self._root = None
        self._sorted = None
        return old[0] if old is not None else None

    def remove(self, peer_id: bytes) -> NodeRecord | None:
        """Remove ``peer_id``'s record; returns it (None when absent)."""
        old = self._records.pop(peer_id, None)
        if old is None:
            return None
        bucket = _bucket_of(peer_id)
        peers = self._buckets[bucket]
        del peers[bisect.bisect_left(peers, peer_id)]
        self._digests[bucket] = None
        self._root = None
        self._sorted = None
        return old[0]

    def root(self) -> bytes:
        """:func:`record_set_root` of the set (32 bytes), rehashing only changed buckets."""
        if self._root is None:
            for b, digest in enumerate(self._digests):
                if digest is None:
                    records = self._records
                    self._digests[b] = hashlib.sha256(
                        b"".join(records[p][1] for p in self._buckets[b])
                    ).digest()
            digests: list[bytes] = self._digests  # type: ignore[assignment]  # none left None
            self._root = hashlib.sha256(
                RECORD_SET_DOMAIN + _u32(len(self._records)) + b"".join(digests)
            ).digest()
        return self._root

    def records(self) -> tuple[NodeRecord, ...]:
        """All records, ascending peer ID (cached until the next change)."""
        if self._sorted is None:
            records = self._records
            self._sorted = tuple(records[p][0] for bucket in self._buckets for p in bucket)
        return self._sorted


def record_set_root(records: Iterable[NodeRecord]) -> bytes:
    """The root of a list of records (module docstring); O(records).

    A list naming one peer ID twice has the root of the set that keeps the last of them; the
    count in a head tells the two apart.
    """
    return RecordSet(records).root()


def head_signing_bytes(head: DirectoryHead) -> bytes:
    """The canonical byte string a verifier signs (module docstring).

    Raises:
        LocalProtocolError: an integer out of its wire range.
    """
    try:
        return (
            DIRECTORY_DOMAIN
            + _u64(head.height)
            + _u64(head.issued_at_ms)
            + _u64(head.expires_at_ms)
            + _u32(head.record_count)
            + _lp(bytes(head.root))
        )
    except (struct.error, TypeError) as exc:
        raise LocalProtocolError(f"directory head field out of range: {exc}") from exc


def directory_signing_bytes(directory: Directory) -> bytes:
    """What a verifier signs for a whole directory: :func:`head_signing_bytes` of its head.

    The verifier signatures are not covered, so verifiers sign independently. O(records).

    Raises:
        LocalProtocolError: an integer out of its wire range.
    """
    return head_signing_bytes(directory.head())


CLOVE_DOMAIN = b"planetserve/v1/response-clove\x00"


def clove_signing_bytes(message_id: bytes, clove: bytes) -> bytes:
    """What a model node signs for each response clove it sends: the response's message ID and
    the SHA-256 of the serialized clove. A user then tells a clove its proxy altered (bad
    signature) from one the model node itself sent wrong.
    """
    return CLOVE_DOMAIN + message_id + hashlib.sha256(clove).digest()


def response_signing_bytes(
    request_id: bytes,
    req_hash: bytes,
    content_digest: bytes,
    signed_at_ms: int,
    model_node: bytes,
) -> bytes:
    """The canonical byte string a model node signs for one response (PlanetServe sec. 3.2).

    Args:
        request_id: the request's ID as sent by the user.
        req_hash: SHA-256 of the decoded request Q (32 bytes).
        content_digest: ``ResponseContent.digest()`` (32 bytes).
        signed_at_ms: unix milliseconds.
        model_node: the signing model node's peer ID.

    Raises:
        RemoteProtocolError: ``signed_at_ms`` outside [0, 2**64).
    """
    if not 0 <= signed_at_ms < _U64:
        raise RemoteProtocolError(f"response time {signed_at_ms} out of range")
    return b"".join(
        (
            RESPONSE_DOMAIN,
            _lp(bytes(request_id)),
            _lp(bytes(req_hash)),
            _lp(bytes(content_digest)),
            _u64(signed_at_ms),
            _lp(bytes(model_node)),
        )
    )


# ---------------------------------------------------------------------------------- signatures


def public_key_from_peer_id(peer_id: bytes) -> bytes:
    """The raw Ed25519 public key inside an identity-multihash peer ID.

    Raises:
        RemoteProtocolError: not an Ed25519 identity-multihash peer ID (e.g. an RSA key's
            SHA-256 peer ID, or the wrong length).
    """
    if len(peer_id) != _ED25519_PEER_ID_BYTES or not peer_id.startswith(_ED25519_PEER_ID_PREFIX):
        raise RemoteProtocolError("not an Ed25519 identity-multihash peer ID")
    return bytes(peer_id[len(_ED25519_PEER_ID_PREFIX):])


try:
    from nacl.bindings import crypto_sign_open as _sodium_open
    from nacl.exceptions import CryptoError as _SodiumError

    def _ed25519_verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
        try:
            _sodium_open(signature + data, public_key)
        except (_SodiumError, ValueError, TypeError):
            return False
        return True

except ImportError:  # pragma: no cover - PyNaCl comes with py-libp2p
    from cryptography.exceptions import InvalidSignature as _InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    def _ed25519_verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
        except (_InvalidSignature, ValueError):
            return False
        return True


def verify_signature(peer_id: bytes, data: bytes, signature: bytes) -> None:
    """Check an Ed25519 signature by ``peer_id``'s key over ``data``.

    Raises:
        RemoteProtocolError: ``peer_id`` is not an Ed25519 identity-multihash peer ID.
        InvalidSignatureError: the signature does not verify (or is not 64 bytes).
    """
    public_key = public_key_from_peer_id(peer_id)
    if len(signature) != SIGNATURE_BYTES or not _ed25519_verify(public_key, data, bytes(signature)):
        raise InvalidSignatureError("Ed25519 signature does not verify")


# ---------------------------------------------------------------------------------- records


def sign_record(identity: Signer, record: NodeRecord) -> NodeRecord:
    """``record`` with ``peer_id`` set to the identity's and signed by it.

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    record = replace(record, peer_id=identity.peer_id, signature=b"")
    return replace(record, signature=identity.sign(record_signing_bytes(record)))


def _check_string(name: str, value: object, max_bytes: int) -> None:
    if not isinstance(value, str):
        raise RemoteProtocolError(f"record {name} is not a string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeError as exc:
        raise RemoteProtocolError(f"record {name} is not valid Unicode") from exc
    if size > max_bytes:
        raise RemoteProtocolError(
            f"record {name} of {size} UTF-8 bytes (max {max_bytes} bytes)"
        )


def check_record_fields(record: NodeRecord) -> None:
    """Check every field a peer controls against its limit (no signature, no clock).

    Raises:
        RemoteProtocolError: a non-Ed25519 peer ID; more than :data:`MAX_ADDRS` addresses, or
            one that is not a canonical binary multiaddr of at most :data:`MAX_ADDR_BYTES`
            bytes (:func:`check_multiaddr`); a model ID or organization over 64 UTF-8 bytes; an
            onion key that is not a usable 32-byte X25519 key; no or unknown roles; a model
            record without a model ID; an integer outside its wire range; a lifetime that is
            not in (0, 24 h]; or a signature that is not 64 bytes.
    """
    _check_cheap_fields(record)
    _check_addrs(record)


def _check_addrs(record: NodeRecord) -> None:
    for addr in record.addrs:
        check_multiaddr(addr)


def _check_cheap_fields(record: NodeRecord) -> None:
    """Every field limit but the multiaddr parsing (the costly part, done last)."""
    public_key_from_peer_id(record.peer_id)
    if len(record.addrs) > MAX_ADDRS:
        raise RemoteProtocolError(f"record lists {len(record.addrs)} addresses (max {MAX_ADDRS})")
    for addr in record.addrs:
        if not isinstance(addr, bytes) or not 0 < len(addr) <= MAX_ADDR_BYTES:
            check_multiaddr(addr)  # raises the error that says which limit
    if not record.roles:
        raise RemoteProtocolError("record has no roles")
    for role in record.roles:
        if not isinstance(role, Role):
            raise RemoteProtocolError(f"record has an unknown role {role!r}")
    if not isinstance(record.onion_key, bytes) or len(record.onion_key) != ONION_KEY_BYTES:
        raise RemoteProtocolError(f"onion key of {len(record.onion_key)} bytes (expected 32)")
    if not _usable_x25519_key(record.onion_key):
        raise RemoteProtocolError("onion key is a low-order X25519 point (no shared secret)")
    _check_string("model ID", record.model_id, MAX_MODEL_ID_BYTES)
    _check_string("organization", record.organization, MAX_ORGANIZATION_BYTES)
    if Role.MODEL in record.roles and not record.model_id:
        raise RemoteProtocolError("a model node record needs a model ID")
    if not isinstance(record.capacity, int) or not 0 <= record.capacity < _U32:
        raise RemoteProtocolError(f"record capacity {record.capacity} out of range")
    times = (("issued_at_ms", record.issued_at_ms), ("expires_at_ms", record.expires_at_ms))
    for name, value in times:
        if not isinstance(value, int) or not 0 <= value < _U64:
            raise RemoteProtocolError(f"record {name} {value} out of range")
    lifetime = record.expires_at_ms - record.issued_at_ms
    if not 0 < lifetime <= MAX_RECORD_LIFETIME_MS:
        raise RemoteProtocolError(
            f"record lifetime {lifetime} ms outside (0, {MAX_RECORD_LIFETIME_MS}] ms"
        )
    if not isinstance(record.signature, bytes) or len(record.signature) != SIGNATURE_BYTES:
        raise RemoteProtocolError(f"record signature of {len(record.signature)} bytes")


def _verify_record_signature(record: NodeRecord) -> None:
    try:
        verify_signature(record.peer_id, record_signing_bytes(record), record.signature)
    except InvalidSignatureError:
        raise InvalidSignatureError(
            f"node record of {_short(record.peer_id)} has an invalid signature"
        ) from None


def _check_record_time(record: NodeRecord, now_ms: int) -> None:
    if record.issued_at_ms > now_ms + MAX_CLOCK_SKEW_MS:
        raise RemoteProtocolError(
            f"node record issued {record.issued_at_ms - now_ms} ms in the future"
        )
    if now_ms >= record.expires_at_ms:
        raise ExpiredError(
            f"node record of {_short(record.peer_id)} expired "
            f"{now_ms - record.expires_at_ms} ms ago"
        )


def check_record(record: NodeRecord, now_ms: int) -> None:
    """Check a record's fields, its signature and its validity at ``now_ms``.

    Cheapest first: sizes and counts, then the signature (~55 us), then the multiaddr parsing
    (up to ~0.4 ms an address, memoized), then the times.

    Raises:
        RemoteProtocolError: a field out of its limits (:func:`check_record_fields`), or issued
            more than 5 minutes after ``now_ms``.
        InvalidSignatureError: the signature does not verify under ``peer_id``'s key.
        ExpiredError: ``now_ms >= expires_at_ms``.
    """
    _check_cheap_fields(record)
    _verify_record_signature(record)
    _check_addrs(record)  # after the signature: a forged record costs no parsing
    _check_record_time(record, now_ms)


def _remote_leaf(record: NodeRecord) -> bytes:
    try:
        return record_leaf(record)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(str(exc)) from exc


class VerifiedCache:
    """Leaves (:func:`record_leaf`) of records whose fields and signature were checked.

    Bounded, least recently used first out. A leaf covers the record's signed bytes and its
    signature, so a hit means exactly this signed record passed :func:`check_record_fields`
    and its signature check.
    """

    def __init__(self, max_entries: int = VERIFIED_CACHE_ENTRIES) -> None:
        if max_entries < 0:
            raise LocalProtocolError("max_entries must be >= 0")
        self.max_entries = max_entries
        self._leaves: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.hits = 0
        self.checks = 0

    def __len__(self) -> int:
        return len(self._leaves)

    def check(self, record: NodeRecord, leaf: bytes | None = None) -> bytes:
        """Check ``record``'s fields and signature unless its leaf was checked before.

        Returns:
            the record's leaf.

        Raises:
            RemoteProtocolError: a field beyond its limit (nothing is cached).
            InvalidSignatureError: a bad signature (nothing is cached).
        """
        if leaf is None:
            leaf = _remote_leaf(record)
        if leaf in self._leaves:
            self._leaves.move_to_end(leaf)
            self.hits += 1
            return leaf
        _check_cheap_fields(record)
        _verify_record_signature(record)
        _check_addrs(record)
        self.checks += 1
        if self.max_entries:
            self._leaves[leaf] = None
            if len(self._leaves) > self.max_entries:
                self._leaves.popitem(last=False)
        return leaf


# ---------------------------------------------------------------------------------- directory


def _add_signature(
    signatures: tuple[VerifierSignature, ...], identity: Signer, data: bytes
) -> tuple[VerifierSignature, ...]:
    others = tuple(s for s in signatures if s.verifier_id != identity.peer_id)
    return others + (VerifierSignature(identity.peer_id, identity.sign(data)),)


def sign_head(identity: Signer, head: DirectoryHead) -> DirectoryHead:
    """``head`` with the identity's :class:`VerifierSignature` appended (an earlier one by the
    same verifier is replaced).

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    data = head_signing_bytes(head)
    return replace(head, signatures=_add_signature(head.signatures, identity, data))


def sign_directory(identity: Signer, directory: Directory) -> Directory:
    """``directory`` with the identity's :class:`VerifierSignature` over its head appended.

    An earlier signature by the same verifier is replaced. O(records) (the root is computed).

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    data = directory_signing_bytes(directory)
    return replace(directory, signatures=_add_signature(directory.signatures, identity, data))


def verify_head(
    head: DirectoryHead,
    *,
    trusted_verifiers: frozenset[bytes],
    quorum: int,
    now_ms: int,
) -> DirectoryHead:
    """Check a head's validity window and its quorum of trusted signatures; returns it.

    Signatures by verifiers outside ``trusted_verifiers``, repeated ones and bad ones are
    ignored; at least ``quorum`` distinct trusted verifiers must have signed.

    Raises:
        LocalProtocolError: ``quorum`` < 1.
        ExpiredError: ``now_ms >= expires_at_ms``, or issued more than 5 minutes after ``now_ms``.
        InvalidSignatureError: fewer than ``quorum`` valid trusted signatures.
        RemoteProtocolError: a field out of its wire range, or a root that is not 32 bytes.
    """
    if quorum < 1:
        raise LocalProtocolError(f"quorum must be >= 1, not {quorum}")
    if now_ms >= head.expires_at_ms:
        raise ExpiredError(
            f"directory at height {head.height} expired {now_ms - head.expires_at_ms} ms ago"
        )
    if head.issued_at_ms > now_ms + MAX_CLOCK_SKEW_MS:
        raise ExpiredError(f"directory issued {head.issued_at_ms - now_ms} ms in the future")
    if len(head.root) != 32:
        raise RemoteProtocolError(f"directory root of {len(head.root)} bytes")
    try:
        data = head_signing_bytes(head)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"directory field out of range: {exc}") from exc
    signers: set[bytes] = set()
    for sig in head.signatures:
        if sig.verifier_id in signers or sig.verifier_id not in trusted_verifiers:
            continue
        try:
            verify_signature(sig.verifier_id, data, sig.signature)
        except RemoteProtocolError:  # InvalidSignatureError included: ignore, count the others
            continue
        signers.add(sig.verifier_id)
        if len(signers) >= quorum:
            break
    if len(signers) < quorum:
        raise InvalidSignatureError(
            f"directory at height {head.height} has {len(signers)} valid signature(s) by "
            f"trusted verifiers; {quorum} needed"
        )
    return head


def verify_directory(
    directory: Directory,
    *,
    trusted_verifiers: frozenset[bytes],
    quorum: int,
    now_ms: int,
    cache: VerifiedCache | None = None,
) -> Directory:
    """Check a whole directory: its head (:func:`verify_head`), every record, and the root.

    Records are live while the directory is (module docstring): a listed record whose own
    ``expires_at_ms`` has passed is kept, since its node renewed it with the verifiers.

    Args:
        cache: verified records to skip and to remember (None: check every record).

    Returns:
        ``directory`` itself.

    Raises:
        LocalProtocolError: ``quorum`` < 1.
        ExpiredError: the directory is expired or issued more than 5 minutes after ``now_ms``.
        InvalidSignatureError: fewer than ``quorum`` valid trusted signatures over the head of
            these records (a record swapped, added or dropped after signing), or a record whose
            signature does not verify (one bad record invalidates the whole directory).
        RemoteProtocolError: a record field out of its limits, or two records of one peer ID.
    """
    if quorum < 1:
        raise LocalProtocolError(f"quorum must be >= 1, not {quorum}")
    if now_ms >= directory.expires_at_ms or directory.issued_at_ms > now_ms + MAX_CLOCK_SKEW_MS:
        verify_head(  # raises the ExpiredError
            DirectoryHead(directory.height, directory.issued_at_ms, directory.expires_at_ms,
                          0, bytes(32)),
            trusted_verifiers=trusted_verifiers, quorum=quorum, now_ms=now_ms,
        )
    cache = cache if cache is not None else VerifiedCache(0)
    seen: set[bytes] = set()
    leaves = []
    for record in directory.records:
        if record.peer_id in seen:
            raise RemoteProtocolError(f"directory lists {_short(record.peer_id)} twice")
        seen.add(record.peer_id)
        leaves.append(_remote_leaf(record))
    root = RecordSet()
    for record, leaf in zip(directory.records, leaves):
        root.put(record, leaf)
    verify_head(
        DirectoryHead(directory.height, directory.issued_at_ms, directory.expires_at_ms,
                      len(directory.records), root.root(), directory.signatures),
        trusted_verifiers=trusted_verifiers, quorum=quorum, now_ms=now_ms,
    )
    for record, leaf in zip(directory.records, leaves):
        cache.check(record, leaf)
    return directory


# ---------------------------------------------------------------------------------- registry


@dataclass
class _Entry:
    record: NodeRecord  # the published record (what the directory lists)
    leaf: bytes
    version: int  # the height at which it was published
    live_until_ms: int  # expiry of the newest record the node sent (a renewal moves it)
    latest_issued_ms: int
    latest_leaf: bytes


class Registry:
    """The node records a verifier keeps (the application state of the committee, sec. 3.4).

    Pure: no clock, no I/O. At most one published record per peer ID. A renewal (a newer
    record with the same :meth:`NodeRecord.content`) only extends how long the peer stays
    listed; a content change, an addition or a removal publishes a new version (height + 1).
    Expiry is indexed by a heap (O(expired) per call, never a scan of every record); the root of
    the set is kept incrementally (:class:`RecordSet`); the changes since any recent height are
    found by bisection in a log ordered by version (O(changes)).

    Attributes:
        height: the version of the newest change; each added, changed or removed record takes
            the next height, so versions are unique.
        floor: deltas from a height below it cannot be served (their removals were forgotten):
            :meth:`changes_since` then answers with a reset.
        max_records: bound on distinct peers (expired records are dropped before refusing).
        max_tombstones: removals remembered for deltas (oldest forgotten first).
    """

    def __init__(
        self, *, max_records: int = MAX_RECORDS, max_tombstones: int | None = None
    ) -> None:
        self.max_records = max_records
        self.max_tombstones = max_records if max_tombstones is None else max_tombstones
        self.height = 0
        self.floor = 0
        self._set = RecordSet()
        self._entries: dict[bytes, _Entry] = {}
        self._tombstones: dict[bytes, int] = {}
        self._tomb_order: collections.deque[tuple[int, bytes]] = collections.deque()
        self._log: list[tuple[int, bytes]] = []  # (version, peer ID), ascending version
        self._expiry: list[tuple[int, bytes]] = []  # heap of (live_until_ms, peer ID), lazy

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, record: NodeRecord, now_ms: int) -> int:
        """Check ``record`` and publish it, or take it as a renewal of the published one.

        A newer record with the same content as the published one (only its times differ)
        is a renewal: the peer stays listed until the renewal's ``expires_at_ms`` and the height
        does not move, unless the published record is :data:`REPUBLISH_AFTER_MS` older than
        the renewal, which is then published. Registering a record already taken changes
        nothing.

        Returns:
            the record's ``expires_at_ms`` (until when the peer stays listed).

        Raises:
            RemoteProtocolError: bad fields (:func:`check_record`), a record older than the
                newest one taken from that peer, a different record with the same
                ``issued_at_ms``, or "registry full".
            InvalidSignatureError: bad signature.
            ExpiredError: already expired at ``now_ms``.
        """
        check_record(record, now_ms)
        leaf = record_leaf(record)
        peer = record.peer_id
        held = self._entries.get(peer)
        if held is not None:
            if leaf == held.latest_leaf or leaf == held.leaf:
                return record.expires_at_ms
            if record.issued_at_ms < held.latest_issued_ms:
                raise RemoteProtocolError(
                    f"record of {_short(peer)} issued at {record.issued_at_ms} is older "
                    f"than the one held (issued at {held.latest_issued_ms})"
                )
            if record.issued_at_ms == held.latest_issued_ms:
                raise RemoteProtocolError(
                    f"a different record of {_short(peer)} with the same issue time "
                    "is already held"
                )
            held.latest_issued_ms = record.issued_at_ms
            held.latest_leaf = leaf
            if (
                record.content() == held.record.content()
                and record.issued_at_ms - held.record.issued_at_ms < REPUBLISH_AFTER_MS
            ):
                self._set_live_until(held, record.expires_at_ms)
                return record.expires_at_ms
        elif len(self._entries) >= self.max_records:
            self.expire(now_ms)
            if len(self._entries) >= self.max_records:
                raise RemoteProtocolError(f"registry full ({self.max_records} records)")
        self._publish(record, leaf)
        return record.expires_at_ms

    def expire(self, now_ms: int) -> int:
        """Drop the peers whose newest record expired at ``now_ms``; returns how many.

        O(expired + stale heap entries), amortized O(expired).
        """
        dropped = 0
        heap = self._expiry
        while heap and heap[0][0] <= now_ms:
            until, peer = heapq.heappop(heap)
            entry = self._entries.get(peer)
            if entry is None or entry.live_until_ms != until:
                continue  # renewed or removed since: a stale heap entry
            self._remove(peer)
            dropped += 1
        return dropped

    def records(self, now_ms: int) -> tuple[NodeRecord, ...]:
        """The live records at ``now_ms`` (expired ones are dropped first), sorted by peer ID.

        O(n) after a change (cached until the next one); prefer :meth:`changes_since`.
        """
        self.expire(now_ms)
        return self._set.records()

    def root(self) -> bytes:
        """:func:`record_set_root` of the published records (O(changed buckets))."""
        return self._set.root()

    def get(self, peer_id: bytes) -> NodeRecord | None:
        """The published record of ``peer_id`` (possibly past its own expiry), or None."""
        entry = self._entries.get(peer_id)
        return entry.record if entry is not None else None

    def live_until(self, peer_id: bytes) -> int | None:
        """Until when ``peer_id`` stays listed (unix ms), or None."""
        entry = self._entries.get(peer_id)
        return entry.live_until_ms if entry is not None else None

    def changes_since(
        self, since: int
    ) -> tuple[bool, Iterator[tuple[int, bytes, NodeRecord | None]]]:
        """What changed after height ``since``, oldest change first.

        Returns:
            ``(reset, changes)``: ``changes`` yields ``(version, peer ID, record)`` for each
            peer whose newest change is after ``since``, ``record`` None for a removal. With
            ``reset`` (``since`` is 0, above :attr:`height` or below :attr:`floor`) it yields
            every published record and no removals: the client starts from an empty set. The
            iterator reads the live registry: consume it before the next change.
        """
        reset = since <= 0 or since > self.height or since < self.floor
        start = 0 if reset else bisect.bisect_right(self._log, since, key=lambda e: e[0])
        return reset, self._iter_log(start, reset)

    def _iter_log(self, start: int, reset: bool) -> Iterator[tuple[int, bytes, NodeRecord | None]]:
        log = self._log
        for i in range(start, len(log)):
            version, peer = log[i]
            entry = self._entries.get(peer)
            if entry is not None:
                if entry.version == version:
                    yield version, peer, entry.record
            elif not reset and self._tombstones.get(peer) == version:
                yield version, peer, None

    # ---- internals

    def _set_live_until(self, entry: _Entry, until: int) -> None:
        entry.live_until_ms = until
        heapq.heappush(self._expiry, (until, entry.record.peer_id))
        if len(self._expiry) > 2 * len(self._entries) + 64:
            self._expiry = [(e.live_until_ms, p) for p, e in self._entries.items()]
            heapq.heapify(self._expiry)

    def _publish(self, record: NodeRecord, leaf: bytes) -> None:
        self.height += 1
        peer = record.peer_id
        self._set.put(record, leaf)
        self._tombstones.pop(peer, None)
        entry = _Entry(record, leaf, self.height, 0, record.issued_at_ms, leaf)
        self._entries[peer] = entry
        self._set_live_until(entry, record.expires_at_ms)
        self._append_log(peer)

    def _remove(self, peer: bytes) -> None:
        self.height += 1
        self._set.remove(peer)
        del self._entries[peer]
        self._tombstones[peer] = self.height
        self._tomb_order.append((self.height, peer))
        while len(self._tombstones) > self.max_tombstones:
            version, old = self._tomb_order.popleft()
            if self._tombstones.get(old) == version:
                del self._tombstones[old]
                self.floor = max(self.floor, version)
        self._append_log(peer)

    def _append_log(self, peer: bytes) -> None:
        self._log.append((self.height, peer))
        live = len(self._entries) + len(self._tombstones)
        if len(self._log) > 2 * live + 64:  # amortized O(1) a change
            self._log = sorted(
                [(e.version, p) for p, e in self._entries.items()]
                + [(v, p) for p, v in self._tombstones.items()]
            )
        if len(self._tomb_order) > 2 * len(self._tombstones) + 64:
            self._tomb_order = collections.deque(
                sorted((v, p) for p, v in self._tombstones.items())
            )


# ---------------------------------------------------------------------------------- client copy


class DirectoryReplica:
    """A client's verified copy of one verifier's directory, brought up to date by deltas.

    Pure: pages come in (:meth:`begin`, :meth:`ReplicaUpdate.receive`), a verified
    :class:`Directory` comes out (:meth:`ReplicaUpdate.commit`). Records are checked once per
    distinct signed record (:class:`VerifiedCache`); a delta costs O(changes), plus O(records)
    pointer copies to build the returned :class:`Directory` when something changed. Not
    thread-safe: one update at a time.

    Args:
        trusted_verifiers, quorum: as for :func:`verify_head`.
        max_records: most records a directory may have.
        cache: verified records (default: a new :class:`VerifiedCache`).

    Attributes:
        source: the verifier whose heights :attr:`head` counts (heights of different verifiers
            are unrelated until consensus lands).
        head, directory: the last verified ones (None before the first).
        last_changed: the records added or changed by the last commit (all after a reset).
        last_reset: whether the last commit started from an empty set.
    """

    def __init__(
        self,
        *,
        trusted_verifiers: frozenset[bytes],
        quorum: int,
        max_records: int = MAX_RECORDS,
        cache: VerifiedCache | None = None,
    ) -> None:
        if quorum < 1:
            raise LocalProtocolError(f"quorum must be >= 1, not {quorum}")
        self.trusted_verifiers = trusted_verifiers
        self.quorum = quorum
        self.max_records = max_records
        self.cache = cache if cache is not None else VerifiedCache()
        self.source: bytes | None = None
        self.head: DirectoryHead | None = None
        self.directory: Directory | None = None
        self.last_changed: tuple[NodeRecord, ...] = ()
        self.last_reset = False
        self._set = RecordSet()

    def since(self, source: bytes) -> int:
        """The height to ask ``source`` for changes since (0: everything)."""
        if self.head is None or source != self.source:
            return 0
        return self.head.height

    def begin(self, source: bytes, *, full: bool = False) -> ReplicaUpdate:
        """Start an update from ``source`` (a delta from :meth:`since`, or everything)."""
        return ReplicaUpdate(self, source, 0 if full else self.since(source))


class ReplicaUpdate:
    """One update of a :class:`DirectoryReplica`: pages in, then :meth:`commit`.

    Attributes:
        since: the height to ask for next (``GetDirectory.since_height``).
        done: the last page came (``more`` was false): call :meth:`commit`.
        pages: pages received.
    """

    def __init__(self, replica: DirectoryReplica, source: bytes, since: int) -> None:
        self.replica = replica
        self.source = source
        self.since = since
        self.done = False
        self.pages = 0
        self._reset = since == 0
        self._pending: dict[bytes, tuple[NodeRecord, bytes] | None] = {}
        self._head: DirectoryHead | None = None
        self._entries = 0
        # a fetch may see the set change while it pages: allow that much churn, then give up
        self._max_entries = 2 * replica.max_records + 4096

    @property
    def staged(self) -> int:
        """Changes received and not yet committed."""
        return len(self._pending)

    def receive(self, page: DirectoryPage) -> None:
        """Check one page and stage its changes (records checked here, cached by leaf).

        Raises:
            RemoteProtocolError: a page that does not continue the previous one (wrong
                ``since_height``, no progress, ``next_height`` beyond the head, an empty page
                with ``more``), a peer listed twice, more entries than the replica's bound
                allows, or a record field beyond its limit.
            InvalidSignatureError: a record whose signature does not verify.
            LocalProtocolError: the update is already done.
        """
        if self.done:
            raise LocalProtocolError("page received after the last one")
        head = page.head
        if page.reset:
            if page.since_height != 0:
                raise RemoteProtocolError("a reset page must start from height 0")
            self._reset = True
            self._pending.clear()
        elif page.since_height != self.since:
            raise RemoteProtocolError(
                f"page starts at height {page.since_height}, asked for {self.since}"
            )
        if page.next_height > head.height:
            raise RemoteProtocolError(
                f"page reaches height {page.next_height} beyond its head's {head.height}"
            )
        if page.more:
            if page.next_height <= page.since_height or not (page.records or page.removed):
                raise RemoteProtocolError("a page with more to come made no progress")
        elif page.next_height != head.height:
            raise RemoteProtocolError("the last page does not reach its head's height")
        if head.record_count > self.replica.max_records:
            raise RemoteProtocolError(f"directory of {head.record_count} records")
        self._entries += len(page.records) + len(page.removed)
        if self._entries > self._max_entries:
            raise RemoteProtocolError(f"over {self._max_entries} changes in one update")
        seen: set[bytes] = set()
        staged = []
        for record in page.records:
            if record.peer_id in seen:
                raise RemoteProtocolError(f"page lists {_short(record.peer_id)} twice")
            seen.add(record.peer_id)
            staged.append((record, self.replica.cache.check(record)))
        for peer in page.removed:
            if peer in seen:
                raise RemoteProtocolError(f"page lists {_short(bytes(peer))} twice")
            seen.add(peer)
        pending = self._pending
        for record, leaf in staged:
            pending[record.peer_id] = (record, leaf)
        for peer in page.removed:
            if self._reset:
                pending.pop(peer, None)
            else:
                pending[bytes(peer)] = None
        if self._reset and len(pending) > self.replica.max_records:
            raise RemoteProtocolError(f"over {self.replica.max_records} records")
        self._head = head
        self.since = page.next_height
        self.pages += 1
        self.done = not page.more

    def commit(self, now_ms: int) -> Directory:
        """Verify the assembled set against the last page's signed head and adopt it.

        On any error the replica is left as it was.

        Returns:
            the new verified directory (records sorted by peer ID).

        Raises:
            ExpiredError: the head is expired (or issued too far in the future).
            InvalidSignatureError: too few trusted signatures on the head, or the assembled
                records do not have the signed count and root (the client's base was not the
                verifier's, or the verifier sent a wrong set: retry with ``full=True``).
            RemoteProtocolError: the head is older than the one held from the same verifier.
            LocalProtocolError: the update is not done.
        """
        replica = self.replica
        if not self.done or self._head is None:
            raise LocalProtocolError("commit before the last page")
        head = verify_head(
            self._head,
            trusted_verifiers=replica.trusted_verifiers, quorum=replica.quorum, now_ms=now_ms,
        )
        held = replica.head
        if (
            held is not None
            and self.source == replica.source
            and head.height < held.height
            and head.issued_at_ms <= held.issued_at_ms
        ):
            raise RemoteProtocolError(
                f"directory at height {head.height} is older than the one held ({held.height})"
            )
        mismatch = InvalidSignatureError(
            f"the records received do not match the signed directory at height {head.height}"
        )
        if self._reset:
            fresh = RecordSet()
            for staged in self._pending.values():
                if staged is not None:
                    fresh.put(*staged)
            if len(fresh) != head.record_count or fresh.root() != head.root:
                raise mismatch
            replica._set = fresh
            changed = fresh.records()
        else:
            rset = replica._set
            undo: list[tuple[bytes, tuple[NodeRecord, bytes] | None]] = []
            changed_list = []
            for peer, staged in self._pending.items():
                old = rset._records.get(peer)
                if staged is None:
                    if old is not None:
                        undo.append((peer, old))
                        rset.remove(peer)
                elif old is None or old[1] != staged[1]:
                    undo.append((peer, old))
                    rset.put(*staged)
                    changed_list.append(staged[0])
            if len(rset) != head.record_count or rset.root() != head.root:
                for peer, old in reversed(undo):
                    if old is None:
                        rset.remove(peer)
                    else:
                        rset.put(*old)
                raise mismatch
            changed = tuple(changed_list)
            if not undo and replica.directory is not None and self.source == replica.source:
                old_dir = replica.directory
                directory = Directory(
                    head.height, head.issued_at_ms, head.expires_at_ms, old_dir.records,
                    head.signatures,
                )
                if "_index" in old_dir.__dict__:  # keep the lookup index: O(1) when unchanged
                    directory.__dict__["_index"] = old_dir.__dict__["_index"]
                return self._adopt(head, directory, (), False)
        directory = Directory(
            head.height, head.issued_at_ms, head.expires_at_ms, replica._set.records(),
            head.signatures,
        )
        return self._adopt(head, directory, changed, self._reset)

    def _adopt(
        self, head: DirectoryHead, directory: Directory, changed: tuple[NodeRecord, ...],
        reset: bool,
    ) -> Directory:
        replica = self.replica
        replica.source = self.source
        replica.head = head
        replica.directory = directory
        replica.last_changed = changed
        replica.last_reset = reset
        return directory


_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


_PROBE_KEY = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"planetserve/v1/probe").digest())


def _usable_x25519_key(public: bytes) -> bool:
    """False for the low-order points whose X25519 shared secret is all zeros (RFC 7748 sec. 6.1):
    a path through such a "relay" would have no secret keys at all."""
    try:
        _PROBE_KEY.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


def short_peer_id(peer_id: bytes) -> str:
    """The last 8 base58 characters of a peer ID (what logs show of a peer)."""
    n = int.from_bytes(peer_id, "big")
    out = []
    for _ in range(8):
        n, digit = divmod(n, 58)
        out.append(_B58_ALPHABET[digit])
    return "".join(reversed(out))


def _short(peer_id: bytes) -> str:
    return "peer …" + short_peer_id(peer_id)



__all__ = [
    "DIRECTORY_DOMAIN",
    "MAX_ADDRS",
    "MAX_ADDR_BYTES",
    "MAX_CLOCK_SKEW_MS",
    "MAX_MODEL_ID_BYTES",
    "MAX_ORGANIZATION_BYTES",
    "MAX_RECORDS",
    "MAX_RECORD_LIFETIME_MS",
    "MAX_RECORD_WIRE_BYTES",
    "RECORD_DOMAIN",
    "REPUBLISH_AFTER_MS",
    "RESPONSE_DOMAIN",
    "Directory",
    "DirectoryHead",
    "DirectoryPage",
    "DirectoryReplica",
    "NodeRecord",
    "RecordSet",
    "Registry",
    "ReplicaUpdate",
    "Role",
    "Signer",
    "VerifiedCache",
    "VerifierSignature",
    "check_multiaddr",
    "check_record",
    "check_record_fields",
    "directory_signing_bytes",
    "head_signing_bytes",
    "multiaddr_bytes",
    "public_key_from_peer_id",
    "record_leaf",
    "record_set_root",
    "record_signing_bytes",
    "response_signing_bytes",
    "short_peer_id",
    "sign_directory",
    "sign_head",
    "sign_record",
    "verify_directory",
    "verify_head",
    "verify_signature",
]
