"""The canonical byte strings that record, response and clove signatures cover, pure.

Every signature covers a canonical byte string with a domain-separation prefix
(:mod:`ps_p2p.records.limits`) and length-prefixed fields (DESIGN.md "Wire"), never a
re-serialized protobuf::

    record    = b"planetserve/v1/node-record\\x00" || bytes(peer_id) || u32(#addrs) || bytes(addr)*
                || u32(#roles) || u32(role)* (ascending) || bytes(onion_key) || str(model_id)
                || str(organization) || u64(capacity) || u64(issued_at_ms) || u64(expires_at_ms)
                (no membership; the organization is then "")
    record v2 = b"planetserve/v2/node-record\\x00" || the same fields up to str(organization)
                || bytes(org_key) || u64(membership expires_at_ms) || bytes(membership signature)
                || u64(capacity) || u64(issued_at_ms) || u64(expires_at_ms)
                (a record with a membership: it names an organization)
    membership = b"planetserve/v1/org-membership\\x00" || bytes(org_key) || str(organization)
                || bytes(member peer_id) || u64(expires_at_ms)
    response  = b"planetserve/v1/response\\x00" || bytes(request_id) || bytes(request hash)
                || bytes(content digest) || u64(signed_at_ms) || bytes(model node peer ID)
    clove     = b"planetserve/v1/response-clove\\x00" || message_id || SHA-256(clove)

(the organization key signs ``membership``; the member signs its whole record, certificate
included, so a record's bytes have one form: v1 without an organization, v2 with one) where
``bytes(b) = u32(len(b)) || b``, ``str(s) = bytes(utf8(s))``, integers are big-endian and
``addr`` is a multiaddr in its binary form (what the record stores and what was validated).
Source: PlanetServe sec. 3.2 (node records, signed responses). The committee's own signed bytes
(votes, transactions, block headers) are in :mod:`ps_p2p.consensus`, built from :func:`lp`,
:func:`u32` and :func:`u64` here.

Bytes only: the signing and checking (Ed25519, RFC 8032) are in
:mod:`ps_p2p.records.signatures` and :mod:`ps_p2p.records.validation`.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

from ps_p2p.errors import LocalProtocolError, RemoteProtocolError
from ps_p2p.records.limits import (
    CLOVE_DOMAIN,
    MEMBERSHIP_DOMAIN,
    ORG_RECORD_DOMAIN,
    RECORD_DOMAIN,
    RESPONSE_DOMAIN,
    UINT64_BOUND,
)

if TYPE_CHECKING:  # annotations only: types comes after this module (records/__init__.py)
    from ps_p2p.records.types import NodeRecord

# ---------------------------------------------------------------------------------- encoding


def u32(n: int) -> bytes:
    """``n`` as 4 big-endian bytes (``struct.error`` outside [0, 2**32))."""
    return struct.pack(">I", n)


def u64(n: int) -> bytes:
    """``n`` as 8 big-endian bytes (``struct.error`` outside [0, 2**64))."""
    return struct.pack(">Q", n)


def lp(data: bytes) -> bytes:
    """``bytes(data)``: ``data`` after its length as a :func:`u32`."""
    return u32(len(data)) + data


def lps(text: str) -> bytes:
    """``str(text)``: the UTF-8 of ``text``, length-prefixed (:func:`lp`)."""
    return lp(text.encode("utf-8"))


def uvarint(n: int) -> bytes:
    """``n`` >= 0 as an unsigned LEB128 varint, shortest form (the HR-tree's deltas and the load
    report; the hot path's cell frames have their own table-driven one in
    ``protocols/fixed_layout.py``)."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# ---------------------------------------------------------------------------------- signed bytes


def record_signing_bytes(record: NodeRecord) -> bytes:
    """The canonical byte string a record's signature covers (see the module docstring).

    Raises:
        LocalProtocolError: a field out of its wire range (negative or too large integer,
            a string that is not encodable as UTF-8).
    """
    membership = record.membership
    try:
        domain = RECORD_DOMAIN if membership is None else ORG_RECORD_DOMAIN
        parts = [domain, lp(bytes(record.peer_id)), u32(len(record.addrs))]
        parts.extend(lp(bytes(a)) for a in record.addrs)
        roles = sorted(int(r) for r in record.roles)
        parts.append(u32(len(roles)))
        parts.extend(u32(r) for r in roles)
        parts += [
            lp(bytes(record.onion_key)),
            lps(record.model_id),
            lps(record.organization),
        ]
        if membership is not None:
            parts += [
                lp(bytes(membership.org_key)),
                u64(membership.expires_at_ms),
                lp(bytes(membership.signature)),
            ]
        parts += [
            u64(record.capacity),
            u64(record.issued_at_ms),
            u64(record.expires_at_ms),
        ]
    except (struct.error, UnicodeError, TypeError, AttributeError, ValueError) as exc:
        raise LocalProtocolError(f"node record field out of range: {exc}") from exc
    return b"".join(parts)


def membership_signing_bytes(org_key: bytes, organization: str, member: bytes,
                             expires_at_ms: int) -> bytes:
    """The canonical byte string an organization key signs to certify a member (module
    docstring; issue 16). No chain ID: like the record it goes in, the statement "this peer is
    a member of this organization until then" holds on any chain, and leaving the chain out lets
    every holder of a record check it without context.

    Args:
        org_key: the organization key's peer ID (38 bytes).
        organization: the organization's name as the member's record shows it.
        member: the member's peer ID.
        expires_at_ms: unix milliseconds.

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    try:
        return b"".join((MEMBERSHIP_DOMAIN, lp(bytes(org_key)), lps(organization),
                         lp(bytes(member)), u64(expires_at_ms)))
    except (struct.error, UnicodeError, TypeError, AttributeError, ValueError) as exc:
        raise LocalProtocolError(f"membership field out of range: {exc}") from exc


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
    if not 0 <= signed_at_ms < UINT64_BOUND:
        raise RemoteProtocolError(f"response time {signed_at_ms} out of range")
    return b"".join(
        (
            RESPONSE_DOMAIN,
            lp(bytes(request_id)),
            lp(bytes(req_hash)),
            lp(bytes(content_digest)),
            u64(signed_at_ms),
            lp(bytes(model_node)),
        )
    )


__all__ = [
    "uvarint",
    "clove_signing_bytes",
    "lp",
    "lps",
    "membership_signing_bytes",
    "record_signing_bytes",
    "response_signing_bytes",
    "u32",
    "u64",
]
