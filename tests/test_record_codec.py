"""The protobuf form of node records (ps_p2p.protocols.record_codec): round trip and limits."""

from __future__ import annotations

import pytest

from ps_p2p import records
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import records_pb2
from ps_p2p.protocols.record_codec import record_from_pb, record_to_pb
from ps_p2p.records import NodeRecord, Role

NOW = 1_700_000_000_000  # unix ms
MINUTE = 60_000
ALICE = Identity.from_private_bytes(bytes(range(32)))
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
_DNS_100 = "/dns4/" + "a" * 63 + "." + "b" * 31 + "/tcp/1"  # 100 bytes in binary form


LAB = Identity.from_private_bytes(bytes(range(3, 35)))  # an organization key


def make_record(**fields) -> NodeRecord:
    """Signed by ALICE; naming an organization, with LAB's membership certificate."""
    base = {
        "peer_id": ALICE.peer_id, "addrs": ("/ip4/127.0.0.1/tcp/4001",),
        "roles": frozenset({Role.USER}), "onion_key": ONION, "issued_at_ms": NOW,
        "expires_at_ms": NOW + 10 * MINUTE,
    }
    if fields.get("organization"):
        base["membership"] = records.sign_membership(LAB, fields["organization"],
                                                     ALICE.peer_id, NOW + 60 * MINUTE)
    return records.sign_record(ALICE, NodeRecord(**(base | fields)))


def wire(pb: records_pb2.NodeRecord) -> records_pb2.NodeRecord:
    """``pb`` as a peer's bytes parse."""
    return records_pb2.NodeRecord.FromString(pb.SerializeToString())


def test_a_record_round_trips_through_its_protobuf():
    record = make_record(roles=frozenset({Role.MODEL, Role.USER}), model_id="m",
                         organization="o", capacity=3)
    pb = wire(record_to_pb(record))
    assert list(pb.roles) == [Role.USER, Role.MODEL]  # ascending
    assert record_from_pb(pb) == record and record.membership is not None
    records.check_record(record_from_pb(pb), NOW)  # the signature still covers it


def test_a_record_without_an_organization_has_no_membership_on_the_wire():
    pb = wire(record_to_pb(make_record()))
    assert not pb.HasField("membership")
    assert record_from_pb(pb).membership is None


def test_an_organization_without_its_membership_certificate_is_refused_at_decode():
    pb = record_to_pb(make_record(organization="acme"))
    pb.ClearField("membership")
    with pytest.raises(RemoteProtocolError, match="without a membership certificate"):
        record_from_pb(wire(pb))


def test_the_largest_record_is_under_1_kib_on_the_wire():
    record = make_record(
        addrs=tuple(_DNS_100.replace("/tcp/1", f"/tcp/{i + 1}") for i in range(records.MAX_ADDRS)),
        roles=frozenset(Role), model_id="m" * records.MAX_MODEL_ID_BYTES,
        organization="o" * records.MAX_ORGANIZATION_BYTES, capacity=2**32 - 1,
    )
    records.check_record(record, NOW)
    size = len(record_to_pb(record).SerializeToString())
    assert 600 < size <= records.MAX_RECORD_WIRE_BYTES


@pytest.mark.parametrize("role", [0, 7])
def test_an_unknown_or_unspecified_role_is_refused(role):
    pb = record_to_pb(make_record())
    pb.roles.append(role)
    with pytest.raises(RemoteProtocolError, match=f"unknown role {role}"):
        record_from_pb(wire(pb))


def test_more_roles_than_exist_are_refused_before_they_are_read():
    pb = record_to_pb(make_record())
    pb.roles.extend([Role.USER] * len(Role))
    with pytest.raises(RemoteProtocolError, match="roles"):
        record_from_pb(wire(pb))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda pb: setattr(pb, "onion_key", bytes(64)), "onion key of 64 bytes"),
        (lambda pb: pb.addrs.extend([records.multiaddr_bytes("/ip4/1.1.1.1/tcp/1")] * 4),
         "5 addresses"),
        (lambda pb: pb.addrs.__setitem__(0, b"\x04\x7f\x00"), "multiaddr"),
        (lambda pb: pb.addrs.__setitem__(0, records.multiaddr_bytes(_DNS_100) + b"\x00"),
         "101 bytes"),
        (lambda pb: setattr(pb, "organization", "o" * 65), "organization of 65 UTF-8 bytes"),
        (lambda pb: setattr(pb, "model_id", "ø" * 33), "model ID of 66 UTF-8 bytes"),
        (lambda pb: setattr(pb, "signature", bytes(63)), "signature of 63 bytes"),
        (lambda pb: pb.membership.CopyFrom(records_pb2.OrgMembership(
            org_key=bytes(38), expires_at_ms=NOW, signature=bytes(64))),
         "certificate but no organization"),
    ],
)
def test_a_field_beyond_its_limit_is_refused_with_a_clear_error(change, message):
    pb = record_to_pb(make_record())
    change(pb)
    with pytest.raises(RemoteProtocolError, match=message):
        record_from_pb(wire(pb))
