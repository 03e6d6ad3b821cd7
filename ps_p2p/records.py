"""Node records, the directory and the verifiers' registry (PlanetServe sec. 3.2, 3.4), pure.

A *node record* is what a node tells the network about itself: peer ID, multiaddrs, roles, the
X25519 onion key its relays use, model ID, organization, capacity and validity window, signed by
its identity key. The *directory* is the list of live records at a registry height, signed by
verifiers; once consensus lands it carries 2f+1 signatures (a quorum certificate) and
:func:`verify_directory` already takes the quorum as a parameter.

Every signature covers a canonical byte string with a domain-separation prefix and
length-prefixed fields (DESIGN.md "Wire"), never a re-serialized protobuf::

    record    = b"planetserve/v1/node-record\\x00" || bytes(peer_id) || u32(#addrs) || str(addr)*
                || u32(#roles) || u32(role)* (ascending) || bytes(onion_key) || str(model_id)
                || str(organization) || u64(capacity) || u64(issued_at_ms) || u64(expires_at_ms)
    directory = b"planetserve/v1/directory\\x00" || u64(height) || u64(issued_at_ms)
                || u64(expires_at_ms) || u32(#records)
                || SHA-256(bytes(record signing bytes) || bytes(record signature), for each record)
    response  = b"planetserve/v1/response\\x00" || bytes(request_id) || bytes(request hash)
                || bytes(content digest) || u64(signed_at_ms) || bytes(model node peer ID)

where ``bytes(b) = u32(len(b)) || b``, ``str(s) = bytes(utf8(s))`` and integers are big-endian.
The directory signature deliberately excludes the verifier signatures themselves.

Nothing here does I/O, reads a clock or imports trio, libp2p or the generated protobuf modules:
times come in as ``now_ms`` (unix milliseconds). Ed25519 verification uses libsodium through
PyNaCl (a dependency of py-libp2p; ~55 us per check against ~105 us with ``cryptography`` on the
2-core dev machine) and falls back to ``cryptography`` when PyNaCl is absent.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

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

#: Most multiaddrs a record may list.
MAX_ADDRS = 16
#: Longest multiaddr, model ID or organization (characters).
MAX_STRING_CHARS = 256
#: An X25519 public key.
ONION_KEY_BYTES = 32
#: An Ed25519 signature.
SIGNATURE_BYTES = 64
#: Longest validity window of a record (expires_at_ms - issued_at_ms).
MAX_RECORD_LIFETIME_MS = 24 * HOUR_MS
#: How far in the future a record or directory may be issued (clock skew allowance).
MAX_CLOCK_SKEW_MS = 5 * MINUTE_MS
#: Default bound of a :class:`Registry` (and of a directory's record count on the wire).
MAX_RECORDS = 100_000

_U32 = 2**32
_U64 = 2**64

#: identity multihash (0x00), length 36, protobuf PublicKey{Type: Ed25519, Data: 32 bytes}.
_ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
_ED25519_PEER_ID_BYTES = len(_ED25519_PEER_ID_PREFIX) + 32

RECORD_DOMAIN = b"planetserve/v1/node-record\x00"
DIRECTORY_DOMAIN = b"planetserve/v1/directory\x00"
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
        addrs: multiaddrs without ``/p2p/`` (at most :data:`MAX_ADDRS`).
        roles: non-empty.
        onion_key: X25519 public key, 32 bytes.
        model_id: the served model (model nodes only; required with :attr:`Role.MODEL`).
        organization: free text, shown to users.
        capacity: concurrent requests (model nodes), < 2**32.
        issued_at_ms, expires_at_ms: unix milliseconds; the lifetime is at most 24 h.
        signature: Ed25519 by ``peer_id``'s key over :func:`record_signing_bytes`.
    """

    peer_id: bytes
    addrs: tuple[str, ...]
    roles: frozenset[Role]
    onion_key: bytes
    model_id: str = ""
    organization: str = ""
    capacity: int = 0
    issued_at_ms: int = 0
    expires_at_ms: int = 0
    signature: bytes = b""


@dataclass(frozen=True)
class VerifierSignature:
    """A verifier's signature over :func:`directory_signing_bytes`."""

    verifier_id: bytes
    signature: bytes


@dataclass(frozen=True)
class Directory:
    """The signed list of live node records at a registry height.

    Attributes:
        height: increases with every change of the record set.
        issued_at_ms, expires_at_ms: unix milliseconds.
        records: sorted by peer ID when built by a :class:`Registry`.
        signatures: one per verifier (2f+1 of a committee once consensus lands).
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

    @functools.cached_property
    def _index(self) -> dict[bytes, NodeRecord]:
        return {r.peer_id: r for r in self.records}


# ---------------------------------------------------------------------------------- encoding


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


def _u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def _lp(data: bytes) -> bytes:
    return _u32(len(data)) + data


def _lps(text: str) -> bytes:
    return _lp(text.encode("utf-8"))


def record_signing_bytes(record: NodeRecord) -> bytes:
    """The canonical byte string a record's signature covers (see the module docstring).

    Raises:
        LocalProtocolError: a field out of its wire range (negative or too large integer,
            a string that is not encodable as UTF-8).
    """
    try:
        parts = [RECORD_DOMAIN, _lp(bytes(record.peer_id)), _u32(len(record.addrs))]
        parts.extend(_lps(a) for a in record.addrs)
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
    except (struct.error, UnicodeError, TypeError, AttributeError) as exc:
        raise LocalProtocolError(f"node record field out of range: {exc}") from exc
    return b"".join(parts)


def _records_digest(records: Iterable[NodeRecord]) -> bytes:
    h = hashlib.sha256()
    for record in records:
        h.update(_lp(record_signing_bytes(record)))
        h.update(_lp(bytes(record.signature)))
    return h.digest()


def directory_signing_bytes(directory: Directory) -> bytes:
    """The canonical byte string a verifier signs: height, times, and a SHA-256 over the records.

    The verifier signatures are not covered, so verifiers sign independently.

    Raises:
        LocalProtocolError: an integer out of its wire range.
    """
    try:
        head = (
            DIRECTORY_DOMAIN
            + _u64(directory.height)
            + _u64(directory.issued_at_ms)
            + _u64(directory.expires_at_ms)
            + _u32(len(directory.records))
        )
    except struct.error as exc:
        raise LocalProtocolError(f"directory field out of range: {exc}") from exc
    return head + _records_digest(directory.records)


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


def _check_string(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise RemoteProtocolError(f"record {name} is not a string")
    if len(value) > MAX_STRING_CHARS:
        raise RemoteProtocolError(f"record {name} longer than {MAX_STRING_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeError as exc:
        raise RemoteProtocolError(f"record {name} is not valid Unicode") from exc


def check_record_fields(record: NodeRecord) -> None:
    """Check every field a peer controls against its limit (no signature, no clock).

    Raises:
        RemoteProtocolError: a non-Ed25519 peer ID, more than :data:`MAX_ADDRS` addresses, a
            string over :data:`MAX_STRING_CHARS` characters, an onion key that is not 32 bytes,
            no or unknown roles, a model record without a model ID, an integer outside its wire
            range, a lifetime that is not in (0, 24 h], or a signature that is not 64 bytes.
    """
    public_key_from_peer_id(record.peer_id)
    if len(record.addrs) > MAX_ADDRS:
        raise RemoteProtocolError(f"record lists {len(record.addrs)} addresses (max {MAX_ADDRS})")
    for addr in record.addrs:
        _check_string("address", addr)
    if not record.roles:
        raise RemoteProtocolError("record has no roles")
    for role in record.roles:
        if not isinstance(role, Role):
            raise RemoteProtocolError(f"record has an unknown role {role!r}")
    if len(record.onion_key) != ONION_KEY_BYTES:
        raise RemoteProtocolError(f"onion key of {len(record.onion_key)} bytes (expected 32)")
    if not _usable_x25519_key(record.onion_key):
        raise RemoteProtocolError("onion key is a low-order X25519 point (no shared secret)")
    _check_string("model ID", record.model_id)
    _check_string("organization", record.organization)
    if Role.MODEL in record.roles and not record.model_id:
        raise RemoteProtocolError("a model node record needs a model ID")
    if not 0 <= record.capacity < _U32:
        raise RemoteProtocolError(f"record capacity {record.capacity} out of range")
    times = (("issued_at_ms", record.issued_at_ms), ("expires_at_ms", record.expires_at_ms))
    for name, value in times:
        if not 0 <= value < _U64:
            raise RemoteProtocolError(f"record {name} {value} out of range")
    lifetime = record.expires_at_ms - record.issued_at_ms
    if not 0 < lifetime <= MAX_RECORD_LIFETIME_MS:
        raise RemoteProtocolError(
            f"record lifetime {lifetime} ms outside (0, {MAX_RECORD_LIFETIME_MS}] ms"
        )
    if len(record.signature) != SIGNATURE_BYTES:
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
    """Check a record's fields, its signature and its validity at ``now_ms``, in that order.

    Raises:
        RemoteProtocolError: a field out of its limits (:func:`check_record_fields`), or issued
            more than 5 minutes after ``now_ms``.
        InvalidSignatureError: the signature does not verify under ``peer_id``'s key.
        ExpiredError: ``now_ms >= expires_at_ms``.
    """
    check_record_fields(record)
    _verify_record_signature(record)
    _check_record_time(record, now_ms)


# ---------------------------------------------------------------------------------- directory


def sign_directory(identity: Signer, directory: Directory) -> Directory:
    """``directory`` with the identity's :class:`VerifierSignature` appended.

    An earlier signature by the same verifier is replaced.

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    signature = identity.sign(directory_signing_bytes(directory))
    others = tuple(s for s in directory.signatures if s.verifier_id != identity.peer_id)
    return replace(
        directory, signatures=others + (VerifierSignature(identity.peer_id, signature),)
    )


def verify_directory(
    directory: Directory,
    *,
    trusted_verifiers: frozenset[bytes],
    quorum: int,
    now_ms: int,
) -> Directory:
    """Check a directory and return it without its expired records.

    Steps: the directory's validity window; at least ``quorum`` valid signatures by distinct
    verifiers of ``trusted_verifiers`` (others are ignored); every record's fields and signature;
    one record per peer ID. Records expired at ``now_ms`` or issued more than 5 minutes in its
    future are dropped. The returned directory keeps the original signatures, which then no
    longer cover a filtered record list: verify what came off the wire, not the result.

    Raises:
        LocalProtocolError: ``quorum`` < 1.
        ExpiredError: ``now_ms >= expires_at_ms``, or issued more than 5 minutes after ``now_ms``.
        InvalidSignatureError: fewer than ``quorum`` valid trusted signatures, or a record whose
            signature does not verify (one bad record invalidates the whole directory).
        RemoteProtocolError: a record field out of its limits, or two records of one peer ID.
    """
    if quorum < 1:
        raise LocalProtocolError(f"quorum must be >= 1, not {quorum}")
    if now_ms >= directory.expires_at_ms:
        raise ExpiredError(
            f"directory at height {directory.height} expired "
            f"{now_ms - directory.expires_at_ms} ms ago"
        )
    if directory.issued_at_ms > now_ms + MAX_CLOCK_SKEW_MS:
        raise ExpiredError(
            f"directory issued {directory.issued_at_ms - now_ms} ms in the future"
        )
    try:
        data = directory_signing_bytes(directory)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"directory field out of range: {exc}") from exc
    signers: set[bytes] = set()
    for sig in directory.signatures:
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
            f"directory at height {directory.height} has {len(signers)} valid signature(s) by "
            f"trusted verifiers; {quorum} needed"
        )
    seen: set[bytes] = set()
    kept: list[NodeRecord] = []
    for record in directory.records:
        check_record_fields(record)
        if record.peer_id in seen:
            raise RemoteProtocolError(f"directory lists {_short(record.peer_id)} twice")
        seen.add(record.peer_id)
        _verify_record_signature(record)
        try:
            _check_record_time(record, now_ms)
        except (ExpiredError, RemoteProtocolError):
            continue
        kept.append(record)
    if len(kept) == len(directory.records):
        return directory
    return replace(directory, records=tuple(kept))


# ---------------------------------------------------------------------------------- registry


class Registry:
    """The node records a verifier keeps (the application state of the committee, sec. 3.4).

    Pure: no clock, no I/O. At most one record per peer ID, the newest by ``issued_at_ms``.

    Attributes:
        height: increases by one whenever the record set changes (a record added, replaced or
            expired).
        max_records: bound on distinct peers (expired records are dropped before refusing).
    """

    def __init__(self, *, max_records: int = MAX_RECORDS) -> None:
        self.max_records = max_records
        self.height = 0
        self._records: dict[bytes, NodeRecord] = {}
        self._sorted: tuple[NodeRecord, ...] | None = ()

    def __len__(self) -> int:
        return len(self._records)

    def register(self, record: NodeRecord, now_ms: int) -> int:
        """Check ``record`` and store it unless an equal or newer one of the same peer is held.

        Registering the very record already held changes nothing (same height).

        Returns:
            the record's ``expires_at_ms``.

        Raises:
            RemoteProtocolError: bad fields (:func:`check_record`), a record older than the one
                held, a different record with the same ``issued_at_ms``, or "registry full".
            InvalidSignatureError: bad signature.
            ExpiredError: already expired at ``now_ms``.
        """
        check_record(record, now_ms)
        held = self._records.get(record.peer_id)
        if held is not None:
            if record == held:
                return record.expires_at_ms
            if record.issued_at_ms < held.issued_at_ms:
                raise RemoteProtocolError(
                    f"record of {_short(record.peer_id)} issued at {record.issued_at_ms} is older "
                    f"than the one held (issued at {held.issued_at_ms})"
                )
            if record.issued_at_ms == held.issued_at_ms:
                raise RemoteProtocolError(
                    f"a different record of {_short(record.peer_id)} with the same issue time "
                    "is already held"
                )
        elif len(self._records) >= self.max_records:
            self.expire(now_ms)
            if len(self._records) >= self.max_records:
                raise RemoteProtocolError(f"registry full ({self.max_records} records)")
        self._records[record.peer_id] = record
        self._changed()
        return record.expires_at_ms

    def expire(self, now_ms: int) -> int:
        """Drop the records expired at ``now_ms``; returns how many."""
        dead = [p for p, r in self._records.items() if now_ms >= r.expires_at_ms]
        for peer_id in dead:
            del self._records[peer_id]
        if dead:
            self._changed()
        return len(dead)

    def records(self, now_ms: int) -> tuple[NodeRecord, ...]:
        """The live records at ``now_ms`` (expired ones are dropped first), sorted by peer ID."""
        self.expire(now_ms)
        if self._sorted is None:
            self._sorted = tuple(self._records[p] for p in sorted(self._records))
        return self._sorted

    def get(self, peer_id: bytes) -> NodeRecord | None:
        """The record held for ``peer_id`` (possibly expired), or None."""
        return self._records.get(peer_id)

    def _changed(self) -> None:
        self.height += 1
        self._sorted = None


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
    "short_peer_id",
    "DIRECTORY_DOMAIN",
    "MAX_ADDRS",
    "MAX_CLOCK_SKEW_MS",
    "MAX_RECORDS",
    "MAX_RECORD_LIFETIME_MS",
    "MAX_STRING_CHARS",
    "RECORD_DOMAIN",
    "RESPONSE_DOMAIN",
    "Directory",
    "NodeRecord",
    "Registry",
    "Role",
    "Signer",
    "VerifierSignature",
    "check_record",
    "check_record_fields",
    "directory_signing_bytes",
    "public_key_from_peer_id",
    "record_signing_bytes",
    "response_signing_bytes",
    "sign_directory",
    "sign_record",
    "verify_directory",
    "verify_signature",
]
