"""Checking node records before anything trusts them, pure.

What a peer sends is checked cheapest first: field sizes and counts against
:mod:`ps_p2p.records.limits` (bytes), then the record's Ed25519 signature (RFC 8032, ~55 us,
:mod:`ps_p2p.records.signatures`), then the multiaddr parsing (up to ~0.4 ms an address,
memoized, :mod:`ps_p2p.records.multiaddrs`), then the times (unix milliseconds, with
:data:`~ps_p2p.records.limits.MAX_CLOCK_SKEW_MS` of skew allowed). An onion key must also be a
usable X25519 point (RFC 7748 sec. 6.1). :class:`VerifiedCache` remembers, by leaf (32 bytes), the
signed records that passed, so a client checks each distinct record once.

A directory is trusted for its commit, not here: the committee checks every record it lists
(:func:`check_record`, in :func:`ps_p2p.registry.check_tx`), and a node checks the commit,
the app hash and each new record of what a verifier serves
(:func:`ps_p2p.registry.directory.verify_directory`, with a :class:`VerifiedCache`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Hashable

from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)

from ps_p2p.errors import (
    ExpiredError,
    InvalidMembershipError,
    InvalidSignatureError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.records.canonical import record_signing_bytes
from ps_p2p.records.limits import (
    MAX_ADDR_BYTES,
    MAX_ADDRS,
    MAX_CLOCK_SKEW_MS,
    MAX_MODEL_ID_BYTES,
    MAX_ORGANIZATION_BYTES,
    MAX_RECORD_LIFETIME_MS,
    ONION_KEY_BYTES,
    SIGNATURE_BYTES,
    UINT32_BOUND,
    UINT64_BOUND,
    VERIFIED_CACHE_ENTRIES,
)
from ps_p2p.records.multiaddrs import check_multiaddr
from ps_p2p.records.peer_ids import (
    ED25519_PEER_ID_BYTES,
    peer_label,
    public_key_from_peer_id,
)
from ps_p2p.records.recordset import record_leaf
from ps_p2p.records.signatures import verify_membership, verify_signature
from ps_p2p.records.types import Membership, NodeRecord, Role

# ---------------------------------------------------------------------------------- records


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
            not in (0, 24 h]; or a signature that is not 64 bytes; an organization without a
            membership certificate or the reverse, a certificate whose organization key is not
            an Ed25519 peer ID or whose signature is not 64 bytes, or a record that outlives
            its certificate.
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
    if not isinstance(record.capacity, int) or not 0 <= record.capacity < UINT32_BOUND:
        raise RemoteProtocolError(f"record capacity {record.capacity} out of range")
    times = (("issued_at_ms", record.issued_at_ms), ("expires_at_ms", record.expires_at_ms))
    for name, value in times:
        if not isinstance(value, int) or not 0 <= value < UINT64_BOUND:
            raise RemoteProtocolError(f"record {name} {value} out of range")
    lifetime = record.expires_at_ms - record.issued_at_ms
    if not 0 < lifetime <= MAX_RECORD_LIFETIME_MS:
        raise RemoteProtocolError(
            f"record lifetime {lifetime} ms outside (0, {MAX_RECORD_LIFETIME_MS}] ms"
        )
    if not isinstance(record.signature, bytes) or len(record.signature) != SIGNATURE_BYTES:
        raise RemoteProtocolError(f"record signature of {len(record.signature)} bytes")
    _check_membership_fields(record)


def _check_membership_fields(record: NodeRecord) -> None:
    """An organization is named with its key's certificate, and only then (issue 16)."""
    membership = record.membership
    if membership is None:
        if record.organization:
            raise RemoteProtocolError(
                f"record names organization {record.organization!r} without a membership "
                "certificate of its organization key (ps-node org sign)")
        return
    if not isinstance(membership, Membership):
        raise RemoteProtocolError("record membership is not a Membership")
    if not record.organization:
        raise RemoteProtocolError("record carries a membership certificate but no organization")
    if not isinstance(membership.org_key, bytes) \
            or len(membership.org_key) != ED25519_PEER_ID_BYTES:
        raise RemoteProtocolError("membership organization key is not an Ed25519 peer ID")
    public_key_from_peer_id(membership.org_key)
    if not isinstance(membership.signature, bytes) \
            or len(membership.signature) != SIGNATURE_BYTES:
        raise RemoteProtocolError(
            f"membership signature of {len(membership.signature)} bytes (expected 64)")
    expires = membership.expires_at_ms
    if not isinstance(expires, int) or not 0 <= expires < UINT64_BOUND:
        raise RemoteProtocolError(f"membership expiry {expires} out of range")
    if record.expires_at_ms > expires:
        raise RemoteProtocolError(
            f"record expires {record.expires_at_ms - expires} ms after its membership "
            "certificate")


_PROBE_KEY = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"planetserve/v1/probe").digest())


def _usable_x25519_key(public: bytes) -> bool:
    """False for the low-order points whose X25519 shared secret is all zeros (RFC 7748 sec. 6.1):
    a path through such a "relay" would have no secret keys at all."""
    try:
        _PROBE_KEY.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


def _verify_record_signature(record: NodeRecord) -> None:
    try:
        verify_signature(record.peer_id, record_signing_bytes(record), record.signature)
    except InvalidSignatureError:
        raise InvalidSignatureError(
            f"node record of {peer_label(record.peer_id)} has an invalid signature"
        ) from None
    try:
        verify_membership(record)
    except InvalidSignatureError:
        raise InvalidMembershipError(
            f"node record of {peer_label(record.peer_id)} names organization "
            f"{record.organization!r} with a membership certificate its organization key did "
            "not sign for it") from None


def _check_record_time(record: NodeRecord, now_ms: int) -> None:
    if record.issued_at_ms > now_ms + MAX_CLOCK_SKEW_MS:
        raise RemoteProtocolError(
            f"node record issued {record.issued_at_ms - now_ms} ms in the future"
        )
    if now_ms >= record.expires_at_ms:
        raise ExpiredError(
            f"node record of {peer_label(record.peer_id)} expired "
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
        InvalidMembershipError: (an InvalidSignatureError) the membership certificate does
            not verify under its organization key for this peer ID and organization name.
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


#: Commits a :class:`VerifiedCache` remembers as checked (the current one and a few before).
VERIFIED_COMMITS = 4


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
        # commits (chain ID, validator set, height, block ID, votes) whose quorum and
        # signatures were checked: a refresh that brings no new block checks none again
        self._commits: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.commit_hits = 0

    def commit_checked(self, key: Hashable) -> bool:
        """Whether the commit ``key`` (everything its check reads, votes and signatures
        included, compared whole: any other byte is another key) passed before."""
        if key in self._commits:
            self._commits.move_to_end(key)
            self.commit_hits += 1
            return True
        return False

    def remember_commit(self, key: Hashable) -> None:
        """Record that the commit ``key`` passed its check (the last few are kept)."""
        self._commits[key] = None
        while len(self._commits) > VERIFIED_COMMITS:
            self._commits.popitem(last=False)

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


__all__ = [
    "VerifiedCache",
    "check_record",
    "check_record_fields",
]
