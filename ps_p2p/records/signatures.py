"""Ed25519 signing of node records and checking of any signature by a peer ID (RFC 8032), pure.

A node signs its own :class:`~ps_p2p.records.types.NodeRecord` (PlanetServe sec. 3.2);
:func:`verify_signature` also checks responses, response cloves and the committee's votes and
transactions (:mod:`ps_p2p.consensus.signing`, :mod:`ps_p2p.consensus.app`). Signatures are 64
bytes, public keys 32 bytes read out of the signer's peer ID
(:func:`~ps_p2p.records.peer_ids.public_key_from_peer_id`).

Verification uses libsodium through PyNaCl (a dependency of py-libp2p; ~55 us per check against
~105 us with ``cryptography`` on the 2-core dev machine) and falls back to ``cryptography`` when
PyNaCl is absent. Signing goes through a :class:`~ps_p2p.records.types.Signer`
(``ps_p2p.keys.Identity``); this module holds no keys.
"""

from __future__ import annotations

from dataclasses import replace

from ps_p2p.errors import InvalidSignatureError
from ps_p2p.records.canonical import record_signing_bytes
from ps_p2p.records.limits import SIGNATURE_BYTES
from ps_p2p.records.peer_ids import public_key_from_peer_id
from ps_p2p.records.types import NodeRecord, Signer

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


def sign_record(identity: Signer, record: NodeRecord) -> NodeRecord:
    """``record`` with ``peer_id`` set to the identity's and signed by it.

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    record = replace(record, peer_id=identity.peer_id, signature=b"")
    return replace(record, signature=identity.sign(record_signing_bytes(record)))


__all__ = ["sign_record", "verify_signature"]
