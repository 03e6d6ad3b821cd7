"""Peer IDs as node records use them: the Ed25519 identity multihash and its short log form, pure.

A record's peer ID is the libp2p identity multihash of a protobuf ``PublicKey{Type: Ed25519,
Data: 32 bytes}`` (libp2p peer-ids spec), 38 bytes::

    0x00 (identity) | 0x24 (length 36) | 0x08 0x01 (Type: Ed25519) | 0x12 0x20 (Data: 32) | key

so the raw Ed25519 key (RFC 8032) is read out of the peer ID with no lookup, and byte 6 is the
first byte of the key (the bucket of :mod:`ps_p2p.records.recordset`). Signatures (records,
responses, votes) are checked only under this kind of peer ID. :func:`short_peer_id` is what
logs and errors show of a peer: the last 8 base58 characters.
"""

from __future__ import annotations

from ps_p2p.errors import RemoteProtocolError

#: identity multihash (0x00), length 36, protobuf PublicKey{Type: Ed25519, Data: 32 bytes}.
ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
#: Length of an Ed25519 identity-multihash peer ID (38 bytes).
ED25519_PEER_ID_BYTES = len(ED25519_PEER_ID_PREFIX) + 32

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def public_key_from_peer_id(peer_id: bytes) -> bytes:
    """The raw Ed25519 public key inside an identity-multihash peer ID.

    Raises:
        RemoteProtocolError: not an Ed25519 identity-multihash peer ID (e.g. an RSA key's
            SHA-256 peer ID, or the wrong length).
    """
    if len(peer_id) != ED25519_PEER_ID_BYTES or not peer_id.startswith(ED25519_PEER_ID_PREFIX):
        raise RemoteProtocolError("not an Ed25519 identity-multihash peer ID")
    return bytes(peer_id[len(ED25519_PEER_ID_PREFIX):])


def short_peer_id(peer_id: bytes) -> str:
    """The last 8 base58 characters of a peer ID (what logs show of a peer)."""
    n = int.from_bytes(peer_id, "big")
    out = []
    for _ in range(8):
        n, digit = divmod(n, 58)
        out.append(_B58_ALPHABET[digit])
    return "".join(reversed(out))


def peer_label(peer_id: bytes) -> str:
    """``"peer …"`` and :func:`short_peer_id`: how error messages of this package name a peer."""
    return "peer …" + short_peer_id(peer_id)


__all__ = [
    "ED25519_PEER_ID_BYTES",
    "ED25519_PEER_ID_PREFIX",
    "peer_label",
    "public_key_from_peer_id",
    "short_peer_id",
]
