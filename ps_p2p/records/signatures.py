"""Ed25519 signing of node records and checking of any signature by a peer ID (RFC 8032), pure.

A node signs its own :class:`~ps_p2p.records.types.NodeRecord` (PlanetServe sec. 3.2);
:func:`verify_signature` also checks responses, response cloves and the committee's votes and
transactions (:mod:`ps_p2p.consensus.signing`, :mod:`ps_p2p.registry`). Signatures are 64
bytes, public keys 32 bytes read out of the signer's peer ID
(:func:`~ps_p2p.records.peer_ids.public_key_from_peer_id`).

Verification uses libsodium through PyNaCl (a dependency of py-libp2p; ~55 us per check against
~105 us with ``cryptography`` on the 2-core dev machine) and falls back to ``cryptography`` when
PyNaCl is absent. Signing goes through a :class:`~ps_p2p.records.types.Signer`
(``ps_p2p.keys.Identity``); this module holds no keys.
"""

from __future__ import annotations

from dataclasses import replace

from ps_p2p.errors import InvalidSignatureError, LocalProtocolError, RemoteProtocolError
from ps_p2p.records.canonical import membership_signing_bytes, record_signing_bytes
from ps_p2p.records.limits import SIGNATURE_BYTES
from ps_p2p.records.peer_ids import public_key_from_peer_id
from ps_p2p.records.types import Membership, NodeRecord, Signer

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


def sign_membership(organization_key: Signer, organization: str, member: bytes,
                    expires_at_ms: int) -> Membership:
    """The organization key's certificate that ``member`` belongs to ``organization`` until
    ``expires_at_ms`` (unix ms), for the member's record (issue 16; ``ps-node org sign``).

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    org_key = organization_key.peer_id
    data = membership_signing_bytes(org_key, organization, member, expires_at_ms)
    return Membership(org_key, expires_at_ms, organization_key.sign(data))


def verify_membership(record: NodeRecord) -> None:
    """Check the membership certificate of ``record`` (if any) under its organization key.

    Raises:
        RemoteProtocolError: the organization key is not an Ed25519 peer ID, or a field is out
            of its wire range.
        InvalidSignatureError: the certificate does not verify for this record's peer ID and
            organization name.
    """
    membership = record.membership
    if membership is None:
        return
    try:
        data = membership_signing_bytes(membership.org_key, record.organization,
                                        record.peer_id, membership.expires_at_ms)
    except LocalProtocolError as exc:  # a peer's field out of its wire range
        raise RemoteProtocolError(f"membership certificate: {exc}") from None
    verify_signature(membership.org_key, data, membership.signature)


__all__ = ["sign_membership", "sign_record", "verify_membership", "verify_signature"]
