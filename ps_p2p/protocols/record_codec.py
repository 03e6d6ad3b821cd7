"""Protobuf conversion of node records (``planetserve.v1.NodeRecord``, records.proto).

A signed :class:`~ps_p2p.records.NodeRecord` travels as this message wherever a node hands its
record over: a REGISTER request of ``/planetserve/directory/2.0.0``
(:mod:`ps_p2p.protocols.committee_directory`). The signature covers the record's canonical bytes
(:func:`~ps_p2p.records.record_signing_bytes`), never this serialization, so the field order and
unknown fields of a peer's message do not matter. A signed record of the largest legal size
(with a membership certificate) is about 820 bytes here
(:data:`~ps_p2p.records.MAX_RECORD_WIRE_BYTES` bounds it at 1 KiB); the frame that carries it
is bounded by its protocol.

Decoding (:func:`record_from_pb`) bounds the repeated fields first, then checks every field
limit (:func:`~ps_p2p.records.check_record_fields`); the signature and the times are the
receiver's to check (:func:`~ps_p2p.records.check_record`, or the committee's ``check_tx``).
"""

from __future__ import annotations

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import records_pb2
from ps_p2p.records import MAX_ADDRS, Membership, NodeRecord, Role, check_record_fields


def record_to_pb(record: NodeRecord) -> records_pb2.NodeRecord:
    """A :class:`NodeRecord` as its protobuf message (roles in ascending order)."""
    membership = record.membership
    extra = {} if membership is None else {"membership": records_pb2.OrgMembership(
        org_key=membership.org_key, expires_at_ms=membership.expires_at_ms,
        signature=membership.signature)}
    return records_pb2.NodeRecord(
        peer_id=record.peer_id,
        addrs=list(record.addrs),
        roles=sorted(int(r) for r in record.roles),
        onion_key=record.onion_key,
        model_id=record.model_id,
        organization=record.organization,
        capacity=record.capacity,
        issued_at_ms=record.issued_at_ms,
        expires_at_ms=record.expires_at_ms,
        signature=record.signature,
        **extra,
    )


def record_from_pb(pb: records_pb2.NodeRecord) -> NodeRecord:
    """A :class:`NodeRecord` from its protobuf message, every field within its limit.

    Raises:
        RemoteProtocolError: an unknown or unspecified role, more than ``MAX_ADDRS`` (4)
            addresses or more roles than exist, or a field beyond its limit
            (:func:`ps_p2p.records.check_record_fields`: sizes, multiaddrs, the onion key, an
            organization without its membership certificate...). The signatures (the
            record's and the certificate's) and the times are not checked here.
    """
    if len(pb.addrs) > MAX_ADDRS:
        raise RemoteProtocolError(f"record lists {len(pb.addrs)} addresses (max {MAX_ADDRS})")
    if len(pb.roles) > len(Role):
        raise RemoteProtocolError(f"record lists {len(pb.roles)} roles")
    roles = set()
    for value in pb.roles:
        try:
            roles.add(Role(value))
        except ValueError:
            raise RemoteProtocolError(f"record has an unknown role {value}") from None
    record = NodeRecord(
        peer_id=bytes(pb.peer_id),
        addrs=tuple(bytes(a) for a in pb.addrs),
        roles=frozenset(roles),
        onion_key=bytes(pb.onion_key),
        model_id=pb.model_id,
        organization=pb.organization,
        capacity=pb.capacity,
        issued_at_ms=pb.issued_at_ms,
        expires_at_ms=pb.expires_at_ms,
        signature=bytes(pb.signature),
        membership=Membership(bytes(pb.membership.org_key), pb.membership.expires_at_ms,
                              bytes(pb.membership.signature))
        if pb.HasField("membership") else None,
    )
    check_record_fields(record)
    return record


__all__ = ["record_from_pb", "record_to_pb"]
