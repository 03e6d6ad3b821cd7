"""Node records, record sets, the verified-record cache and the directory type (pure core)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p import records
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import (
    ExpiredError,
    InvalidSignatureError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.keys import Identity
from ps_p2p.records import Directory, NodeRecord, Role, check_record, sign_record

NOW = 1_700_000_000_000  # unix ms
MINUTE = 60_000
HOUR = 60 * MINUTE

ALICE = Identity.from_private_bytes(bytes(range(32)))
BOB = Identity.from_private_bytes(bytes(range(1, 33)))
CAROL = Identity.from_private_bytes(bytes(range(2, 34)))
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
LAB = Identity.from_private_bytes(bytes(range(3, 35)))  # an organization key
DAY = 24 * HOUR


def make_record(identity: Identity = ALICE, *, issued: int = NOW - 10 * MINUTE,
                lifetime: int = HOUR, org_key: Identity = LAB, **fields) -> NodeRecord:
    """A signed record; one naming an organization carries ``org_key``'s membership
    certificate for it (valid 30 days) unless ``membership`` is given."""
    base = dict(
        peer_id=identity.peer_id,
        addrs=("/ip4/127.0.0.1/tcp/4001", "/ip4/10.0.0.1/tcp/4001"),
        roles=frozenset({Role.USER, Role.MODEL}),
        onion_key=ONION,
        model_id="stories260K",
        organization="Example Lab",
        capacity=4,
        issued_at_ms=issued,
        expires_at_ms=issued + lifetime,
    )
    base.update(fields)
    if base["organization"] and "membership" not in fields:
        base["membership"] = records.sign_membership(org_key, base["organization"],
                                                     identity.peer_id, issued + 30 * DAY)
    return sign_record(identity, NodeRecord(**base))


# ---------------------------------------------------------------------------------- records


def test_signed_record_verifies():
    check_record(make_record(), NOW)


def test_sign_record_sets_the_signers_peer_id():
    record = sign_record(BOB, dataclasses.replace(make_record(ALICE, organization=""),
                                                  signature=b""))
    assert record.peer_id == BOB.peer_id
    check_record(record, NOW)


def test_record_signing_bytes_are_domain_separated_and_length_prefixed():
    record = make_record(organization="")
    data = records.record_signing_bytes(record)
    assert data.startswith(b"planetserve/v1/node-record\x00")
    split_a = dataclasses.replace(record, addrs=(b"\x04\x01\x02\x03\x04", b"\x06\x00\x01"))
    split_b = dataclasses.replace(record, addrs=(b"\x04\x01\x02\x03\x04\x06\x00\x01",))
    assert records.record_signing_bytes(split_a) != records.record_signing_bytes(split_b)


def test_record_signing_bytes_do_not_depend_on_role_order():
    a = make_record(roles=frozenset([Role.USER, Role.VERIFIER]))
    b = dataclasses.replace(a, roles=frozenset([Role.VERIFIER, Role.USER]))
    assert records.record_signing_bytes(a) == records.record_signing_bytes(b)


def _flip_str(text: str, pos: int) -> str:
    pos %= len(text)
    return text[:pos] + chr(ord(text[pos]) ^ 1) + text[pos + 1:]


def _flip_bytes(data: bytes, pos: int) -> bytes:
    pos %= len(data)
    return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]


@st.composite
def tampered_records(draw):
    record = make_record()
    fld = draw(st.sampled_from([
        "peer_id", "addrs", "roles", "onion_key", "model_id", "organization", "capacity",
        "issued_at_ms", "expires_at_ms", "signature",
    ]))
    pos = draw(st.integers(0, 1000))
    bit = draw(st.integers(0, 15))
    if fld == "peer_id":  # the key part; the multihash prefix is a field-limit error
        value = record.peer_id[:6] + _flip_bytes(record.peer_id[6:], pos)
    elif fld == "addrs":  # the port's low byte: still a valid multiaddr
        i = pos % len(record.addrs)
        value = record.addrs[:i] + (_flip_bytes(record.addrs[i], -1),) + record.addrs[i + 1:]
    elif fld == "roles":
        value = record.roles ^ {draw(st.sampled_from([Role.USER, Role.VERIFIER]))}
    elif fld in ("onion_key", "signature"):
        value = _flip_bytes(getattr(record, fld), pos)
    elif fld in ("model_id", "organization"):
        value = _flip_str(getattr(record, fld), pos)
    else:
        value = getattr(record, fld) ^ (1 << bit)
    return dataclasses.replace(record, **{fld: value})


@given(record=tampered_records())
@settings(max_examples=200, deadline=None)
def test_any_flipped_byte_in_a_signed_field_invalidates_the_record(record):
    with pytest.raises(InvalidSignatureError):
        check_record(record, NOW)


def test_record_by_another_key_is_invalid():
    forged = dataclasses.replace(make_record(BOB), peer_id=ALICE.peer_id)
    with pytest.raises(InvalidSignatureError):
        check_record(forged, NOW)


def test_expired_record_is_refused():
    record = make_record(issued=NOW - HOUR, lifetime=HOUR)
    with pytest.raises(ExpiredError):
        check_record(record, NOW)
    check_record(record, NOW - 1)


def test_record_issued_within_clock_skew_is_accepted():
    check_record(make_record(issued=NOW + 5 * MINUTE), NOW)


def _resign(record: NodeRecord, change: dict) -> NodeRecord:
    if "peer_id" in change or "signature" in change:
        return record
    try:
        return sign_record(ALICE, record)
    except LocalProtocolError:  # a field with no wire encoding: keep the old signature
        return record


_DNS_100 = "/dns4/" + "a" * 63 + "." + "b" * 31 + "/tcp/1"  # 100 bytes in binary form


@pytest.mark.parametrize(
    "change",
    [
        dict(peer_id=b"\x12\x20" + bytes(32)),  # a SHA-256 multihash (RSA-style) peer ID
        dict(peer_id=ALICE.peer_id[:-1]),
        dict(addrs=tuple(f"/ip4/10.0.0.{i}/tcp/1" for i in range(5))),
        dict(addrs=(_DNS_100.replace("/tcp/1", "b/tcp/1"),)),  # 101 bytes
        dict(addrs=(b"\xff\xff\x00",)),  # no such protocol
        dict(addrs=(records.multiaddr_bytes("/ip4/1.2.3.4/tcp/1") + b"\x00",)),  # trailing byte
        dict(addrs=(b"\x04\x7f\x00",)),  # cut short (the parser reads "/ip4/0.0.127.0")
        dict(addrs=(b"",)),
        dict(addrs=(bytearray(b"\x04\x01\x02\x03\x04"),)),  # not bytes
        dict(roles=frozenset()),
        dict(roles=frozenset({Role.USER, 9})),
        dict(onion_key=bytes(31)),
        dict(onion_key=bytes(33)),
        dict(onion_key=bytes(32)),  # low-order X25519 points: no shared secret (RFC 7748)
        dict(onion_key=b"\x01" + bytes(31)),
        dict(onion_key=bytes.fromhex(
            "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")),
        dict(model_id=""),  # a model node without a model ID
        dict(model_id="m" * 65),
        dict(model_id="ø" * 33),  # 33 characters, 66 bytes
        dict(organization="o" * 65),
        dict(organization="😀" * 17),  # 17 characters, 68 bytes
        dict(capacity=2**32),
        dict(capacity=-1),
        dict(issued_at_ms=NOW, expires_at_ms=NOW),  # no lifetime
        dict(issued_at_ms=NOW - 1, expires_at_ms=NOW + 24 * HOUR),  # over 24 h
        dict(issued_at_ms=NOW + 6 * MINUTE, expires_at_ms=NOW + 7 * MINUTE),  # future
        dict(signature=b"\x00" * 63),
    ],
)
def test_field_beyond_its_limit_is_a_protocol_error(change):
    record = _resign(dataclasses.replace(make_record(), **change), change)
    with pytest.raises(RemoteProtocolError) as info:
        check_record(record, NOW)
    assert type(info.value) is RemoteProtocolError  # not a signature failure


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(addrs=(b"\xff\xff\x00",)), "record address is not a multiaddr"),
        (dict(addrs=(bytes(101),)), "record address of 101 bytes"),
        (dict(model_id="ø" * 33), "model ID of 66 UTF-8 bytes"),
        (dict(organization="o" * 65), "organization of 65 UTF-8 bytes"),
        (dict(addrs=tuple(f"/ip4/10.0.0.{i}/tcp/1" for i in range(5))), "5 addresses"),
    ],
)
def test_oversized_or_non_multiaddr_field_is_refused_with_a_clear_error(change, message):
    record = _resign(dataclasses.replace(make_record(), **change), change)
    with pytest.raises(RemoteProtocolError, match=message):
        check_record(record, NOW)


def test_text_address_that_is_not_a_multiaddr_is_a_local_error():
    with pytest.raises(LocalProtocolError, match="not a multiaddr"):
        make_record(addrs=("hello",))


def test_text_addresses_are_stored_in_binary_form():
    record = make_record(addrs=("/ip4/127.0.0.1/tcp/4001",))
    assert record.addrs == (bytes.fromhex("047f000001060fa1"),)
    assert record.multiaddrs() == ["/ip4/127.0.0.1/tcp/4001"]


def test_field_limits_are_inclusive():
    assert len(records.multiaddr_bytes(_DNS_100)) == records.MAX_ADDR_BYTES
    check_record(make_record(
        addrs=(_DNS_100,) * records.MAX_ADDRS,
        model_id="m" * 64,
        organization="ø" * 32,
        capacity=2**32 - 1,
        issued=NOW - HOUR,
        lifetime=24 * HOUR,
    ), NOW)


def test_verify_signature_rejects_non_ed25519_peer_id():
    with pytest.raises(RemoteProtocolError):
        records.verify_signature(b"\x12\x20" + bytes(32), b"x", bytes(64))


def test_public_key_from_peer_id_returns_the_raw_key():
    assert records.public_key_from_peer_id(ALICE.peer_id) == ALICE.public_key


def test_response_signing_bytes_are_domain_separated():
    data = records.response_signing_bytes(b"id", bytes(32), bytes(32), NOW, ALICE.peer_id)
    assert data.startswith(b"planetserve/v1/response\x00")
    other = records.response_signing_bytes(b"i", b"d" + bytes(32), bytes(32), NOW, ALICE.peer_id)
    assert data != other


# ---------------------------------------------------------------------------------- organizations


def test_a_record_naming_an_organization_carries_its_certificate_in_the_v2_signed_bytes():
    record = make_record()
    data = records.record_signing_bytes(record)
    assert data.startswith(b"planetserve/v2/node-record\x00")
    assert record.membership.org_key in data and record.membership.signature in data
    check_record(record, NOW)


def test_a_record_naming_an_organization_without_its_keys_certificate_is_refused():
    record = sign_record(ALICE, dataclasses.replace(make_record(), membership=None))
    with pytest.raises(RemoteProtocolError, match="without a membership certificate") as info:
        check_record(record, NOW)
    assert type(info.value) is RemoteProtocolError


def test_a_membership_certificate_without_an_organization_is_refused():
    record = sign_record(ALICE, dataclasses.replace(make_record(), organization=""))
    with pytest.raises(RemoteProtocolError, match="no organization"):
        check_record(record, NOW)


@pytest.mark.parametrize("change", [
    dict(organization="Other Lab"),  # the certificate names "Example Lab"
    dict(peer_id=BOB.peer_id),  # a member's certificate copied into another node's record
    dict(membership_expires=1),  # a longer validity than the organization signed
    dict(org_key=CAROL),  # a certificate another key signed, claiming LAB
])
def test_a_membership_certificate_the_organization_key_did_not_sign_is_invalid(change):
    good = make_record()
    m = good.membership
    if "organization" in change:
        record = dataclasses.replace(good, organization=change["organization"])
    elif "peer_id" in change:
        record = dataclasses.replace(make_record(BOB, organization=""),
                                     organization=good.organization, membership=m)
        record = sign_record(BOB, record)
    elif "membership_expires" in change:
        record = dataclasses.replace(good, membership=dataclasses.replace(
            m, expires_at_ms=m.expires_at_ms + 1))
    else:
        forged = records.sign_membership(change["org_key"], good.organization, ALICE.peer_id,
                                         m.expires_at_ms)
        record = dataclasses.replace(good, membership=dataclasses.replace(
            forged, org_key=LAB.peer_id))
    record = sign_record(record_owner(record), record)
    with pytest.raises(InvalidSignatureError, match="membership certificate"):
        check_record(record, NOW)


def record_owner(record: NodeRecord) -> Identity:
    return {i.peer_id: i for i in (ALICE, BOB, CAROL)}[record.peer_id]


def test_a_record_may_not_outlive_its_membership_certificate():
    expires = NOW + 30 * MINUTE
    m = records.sign_membership(LAB, "Example Lab", ALICE.peer_id, expires)
    check_record(make_record(membership=m, issued=NOW, lifetime=30 * MINUTE), NOW)
    with pytest.raises(RemoteProtocolError, match="after its membership certificate"):
        check_record(make_record(membership=m, issued=NOW, lifetime=30 * MINUTE + 1), NOW)


def test_the_reputation_subject_is_the_organization_key_not_its_name():
    acme = make_record(ALICE, organization="acme")
    colleague = make_record(BOB, organization="acme")
    sybil = make_record(CAROL, organization="acme", org_key=CAROL)  # its own key, same name
    lone = make_record(CAROL, organization="")
    assert records.record_subject(acme) == records.record_subject(colleague) \
        == b"orgkey\x00" + LAB.peer_id
    assert records.record_subject(sybil) != records.record_subject(acme)
    assert records.record_subject(lone) == b"node\x00" + CAROL.peer_id
    with pytest.raises(TypeError):
        records.reputation_subject(ALICE.peer_id, "acme")


def _scored(verified: bool, reputations: dict[bytes, float]) -> Directory:
    nodes = (make_record(ALICE, organization=""), make_record(BOB, organization=""))
    return Directory(7, NOW - MINUTE, NOW + MINUTE, nodes, reputations, verified=verified)


def test_a_never_scored_node_is_provisional_not_trusted_on_a_chain_with_challenge_epochs():
    d = _scored(True, {b"node\x00" + BOB.peer_id: 0.8})
    assert d.provisional(ALICE.peer_id) and not d.trusted(ALICE.peer_id)
    assert d.trusted(BOB.peer_id) and not d.provisional(BOB.peer_id)
    assert not d.provisional(CAROL.peer_id)  # not listed


def test_without_challenge_epochs_a_never_scored_node_is_trusted():
    d = _scored(False, {})
    assert d.trusted(ALICE.peer_id) and not d.provisional(ALICE.peer_id)


# ---------------------------------------------------------------------------------- directory


def test_directory_accessors():
    user = make_record(ALICE, roles=frozenset({Role.USER}), model_id="")
    model = make_record(BOB, roles=frozenset({Role.MODEL}))
    directory = Directory(7, NOW - MINUTE, NOW + MINUTE, (user, model))
    assert directory.users() == [user]
    assert directory.model_nodes() == [model]
    assert directory.record(BOB.peer_id) == model
    assert directory.record(CAROL.peer_id) is None


# ---------------------------------------------------------------------------------- record set


_PEERS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(10, 14)]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=30))
@settings(max_examples=60, deadline=None)
def test_incremental_root_equals_the_root_of_the_final_set(ops):
    rset = records.RecordSet()
    model: dict[bytes, NodeRecord] = {}
    for peer, capacity in ops:
        identity = _PEERS[peer]
        if capacity == 0:
            rset.remove(identity.peer_id)
            model.pop(identity.peer_id, None)
        else:
            record = make_record(identity, capacity=capacity)
            rset.put(record)
            model[identity.peer_id] = record
        rset.root()
    assert rset.root() == records.record_set_root(model.values())
    assert rset.records() == tuple(model[p] for p in sorted(model))


def test_root_depends_on_every_record():
    base = [make_record(ALICE), make_record(BOB)]
    roots = {
        records.record_set_root(base),
        records.record_set_root(base[:1]),
        records.record_set_root([base[0], make_record(BOB, capacity=5)]),
        records.record_set_root(base + [make_record(CAROL)]),
    }
    assert len(roots) == 4


def test_verified_cache_is_bounded_and_forgets_the_least_recently_used():
    cache = records.VerifiedCache(max_entries=2)
    a, b, c = make_record(ALICE), make_record(BOB), make_record(CAROL)
    for record in (a, b, a, c, a):
        cache.check(record)
    assert len(cache) == 2
    assert (cache.checks, cache.hits) == (3, 2)  # b was forgotten, a never
    cache.check(b)
    assert cache.checks == 4


def test_verified_cache_does_not_remember_a_bad_record():
    cache = records.VerifiedCache()
    forged = dataclasses.replace(make_record(), capacity=99)
    for _ in range(2):
        with pytest.raises(InvalidSignatureError):
            cache.check(forged)
    assert len(cache) == 0
