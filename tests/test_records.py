"""Node records, directories and the registry (pure core)."""

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
from ps_p2p.records import (
    Directory,
    NodeRecord,
    Registry,
    Role,
    VerifierSignature,
    check_record,
    sign_directory,
    sign_record,
    verify_directory,
)

NOW = 1_700_000_000_000  # unix ms
MINUTE = 60_000
HOUR = 60 * MINUTE

ALICE = Identity.from_private_bytes(bytes(range(32)))
BOB = Identity.from_private_bytes(bytes(range(1, 33)))
CAROL = Identity.from_private_bytes(bytes(range(2, 34)))
V1 = Identity.from_private_bytes(b"\x01" * 32)
V2 = Identity.from_private_bytes(b"\x02" * 32)
V3 = Identity.from_private_bytes(b"\x03" * 32)
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public


def make_record(identity: Identity = ALICE, *, issued: int = NOW - 10 * MINUTE,
                lifetime: int = HOUR, **fields) -> NodeRecord:
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
    return sign_record(identity, NodeRecord(**base))


def make_directory(*recs: NodeRecord, signers=(V1,), height: int = 7,
                   issued: int = NOW - MINUTE, lifetime: int = 2 * MINUTE) -> Directory:
    directory = Directory(height, issued, issued + lifetime, tuple(recs))
    for signer in signers:
        directory = sign_directory(signer, directory)
    return directory


# ---------------------------------------------------------------------------------- records


def test_signed_record_verifies():
    check_record(make_record(), NOW)


def test_sign_record_sets_the_signers_peer_id():
    record = sign_record(BOB, dataclasses.replace(make_record(ALICE), signature=b""))
    assert record.peer_id == BOB.peer_id
    check_record(record, NOW)


def test_record_signing_bytes_are_domain_separated_and_length_prefixed():
    record = make_record()
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


# ---------------------------------------------------------------------------------- directory


def test_directory_signed_by_a_trusted_verifier_verifies():
    directory = make_directory(make_record(ALICE), make_record(BOB))
    got = verify_directory(
        directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW
    )
    assert got == directory


def test_directory_accessors():
    user = make_record(ALICE, roles=frozenset({Role.USER}), model_id="")
    model = make_record(BOB, roles=frozenset({Role.MODEL}))
    directory = make_directory(user, model)
    assert directory.users() == [user]
    assert directory.model_nodes() == [model]
    assert directory.record(BOB.peer_id) == model
    assert directory.record(CAROL.peer_id) is None


def test_directory_with_too_few_trusted_signatures_is_refused():
    directory = make_directory(make_record(), signers=(V1, V3))
    trusted = frozenset({V1.peer_id, V2.peer_id})
    with pytest.raises(InvalidSignatureError, match="1 valid signature"):
        verify_directory(directory, trusted_verifiers=trusted, quorum=2, now_ms=NOW)
    both = sign_directory(V2, directory)
    verify_directory(both, trusted_verifiers=trusted, quorum=2, now_ms=NOW)


def test_directory_signed_by_an_untrusted_verifier_is_refused():
    directory = make_directory(make_record(), signers=(V3,))
    with pytest.raises(InvalidSignatureError):
        verify_directory(
            directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW
        )


def test_repeated_signature_of_one_verifier_counts_once():
    directory = make_directory(make_record())
    doubled = dataclasses.replace(directory, signatures=directory.signatures * 2)
    with pytest.raises(InvalidSignatureError):
        verify_directory(
            doubled, trusted_verifiers=frozenset({V1.peer_id, V2.peer_id}), quorum=2, now_ms=NOW
        )


def test_sign_directory_replaces_the_verifiers_earlier_signature():
    directory = make_directory(make_record(), signers=(V1, V2, V1))
    assert [s.verifier_id for s in directory.signatures] == [V2.peer_id, V1.peer_id]


def test_verifier_signature_by_the_wrong_key_is_ignored():
    directory = make_directory(make_record(), signers=(V1,))
    stolen = VerifierSignature(V2.peer_id, directory.signatures[0].signature)
    with pytest.raises(InvalidSignatureError):
        verify_directory(
            dataclasses.replace(directory, signatures=(stolen,)),
            trusted_verifiers=frozenset({V2.peer_id}), quorum=1, now_ms=NOW,
        )


def test_directory_with_a_record_swapped_after_signing_is_refused():
    directory = make_directory(make_record(ALICE), make_record(BOB))
    swapped = dataclasses.replace(directory, records=(make_record(ALICE), make_record(CAROL)))
    with pytest.raises(InvalidSignatureError):
        verify_directory(swapped, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_directory_with_a_record_dropped_after_signing_is_refused():
    directory = make_directory(make_record(ALICE), make_record(BOB))
    dropped = dataclasses.replace(directory, records=directory.records[:1])
    with pytest.raises(InvalidSignatureError):
        verify_directory(dropped, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_directory_with_a_forged_record_is_refused_even_if_the_verifier_signed_it():
    forged = dataclasses.replace(make_record(BOB), organization="evil")
    directory = make_directory(make_record(ALICE), forged)
    with pytest.raises(InvalidSignatureError, match="node record"):
        verify_directory(directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_directory_listing_a_peer_twice_is_refused():
    directory = make_directory(make_record(ALICE), make_record(ALICE, issued=NOW - MINUTE))
    with pytest.raises(RemoteProtocolError, match="twice"):
        verify_directory(directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_expired_directory_is_refused():
    directory = make_directory(make_record(), issued=NOW - 3 * MINUTE, lifetime=2 * MINUTE)
    with pytest.raises(ExpiredError):
        verify_directory(directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_directory_issued_far_in_the_future_is_refused():
    directory = make_directory(make_record(), issued=NOW + 6 * MINUTE)
    with pytest.raises(ExpiredError):
        verify_directory(directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_verify_directory_keeps_listed_records_past_their_own_expiry():
    # liveness is the verifiers' business: the node renewed, the directory still lists it
    live = make_record(ALICE)
    renewed_elsewhere = make_record(BOB, issued=NOW - HOUR, lifetime=HOUR - 1)
    directory = make_directory(live, renewed_elsewhere)
    got = verify_directory(
        directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW
    )
    assert got.records == (live, renewed_elsewhere)


def test_verify_directory_checks_each_signed_record_once_with_a_cache():
    cache = records.VerifiedCache()
    directory = make_directory(make_record(ALICE), make_record(BOB))
    trusted = frozenset({V1.peer_id})
    verify_directory(directory, trusted_verifiers=trusted, quorum=1, now_ms=NOW, cache=cache)
    verify_directory(directory, trusted_verifiers=trusted, quorum=1, now_ms=NOW, cache=cache)
    assert (cache.checks, cache.hits) == (2, 2)


def test_quorum_below_one_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        verify_directory(make_directory(), trusted_verifiers=frozenset(), quorum=0, now_ms=NOW)


# ---------------------------------------------------------------------------------- registry


def test_registry_register_returns_expiry_and_bumps_height():
    registry = Registry()
    record = make_record()
    assert registry.register(record, NOW) == record.expires_at_ms
    assert registry.height == 1
    assert registry.records(NOW) == (record,)


def test_registry_same_record_twice_changes_nothing():
    registry = Registry()
    record = make_record()
    registry.register(record, NOW)
    registry.register(record, NOW)
    assert registry.height == 1


def test_registry_keeps_the_newest_record_and_refuses_older():
    registry = Registry()
    old = make_record(issued=NOW - 2 * MINUTE)
    new = make_record(issued=NOW - MINUTE, capacity=9)
    registry.register(new, NOW)
    with pytest.raises(RemoteProtocolError, match="older"):
        registry.register(old, NOW)
    assert registry.height == 1
    assert registry.records(NOW) == (new,)
    newer = make_record(issued=NOW, capacity=10)
    registry.register(newer, NOW)
    assert registry.height == 2
    assert registry.records(NOW) == (newer,)


def test_registry_refuses_a_different_record_with_the_same_issue_time():
    registry = Registry()
    registry.register(make_record(capacity=1), NOW)
    with pytest.raises(RemoteProtocolError, match="same issue time"):
        registry.register(make_record(capacity=2), NOW)


def test_registry_refuses_invalid_and_expired_records():
    registry = Registry()
    with pytest.raises(InvalidSignatureError):
        registry.register(dataclasses.replace(make_record(), capacity=99), NOW)
    with pytest.raises(ExpiredError):
        registry.register(make_record(issued=NOW - HOUR, lifetime=HOUR), NOW)
    assert registry.height == 0
    assert len(registry) == 0


def test_registry_records_are_sorted_by_peer_id():
    registry = Registry()
    for identity in (CAROL, ALICE, BOB):
        registry.register(make_record(identity), NOW)
    peers = [r.peer_id for r in registry.records(NOW)]
    assert peers == sorted(peers)
    assert len(peers) == 3


def test_registry_expire_drops_records_and_bumps_height_only_on_change():
    registry = Registry()
    short = make_record(ALICE, issued=NOW, lifetime=MINUTE)
    long = make_record(BOB, issued=NOW, lifetime=HOUR)
    registry.register(short, NOW)
    registry.register(long, NOW)
    assert registry.height == 2
    assert registry.expire(NOW + MINUTE - 1) == 0
    assert registry.height == 2
    assert registry.records(NOW + MINUTE) == (long,)
    assert registry.height == 3


def test_registry_bound_is_enforced():
    registry = Registry(max_records=2)
    registry.register(make_record(ALICE), NOW)
    registry.register(make_record(BOB), NOW)
    with pytest.raises(RemoteProtocolError, match="registry full"):
        registry.register(make_record(CAROL), NOW)
    registry.register(make_record(ALICE, issued=NOW), NOW)  # a known peer may refresh


def test_full_registry_makes_room_by_expiring():
    registry = Registry(max_records=2)
    registry.register(make_record(ALICE, issued=NOW, lifetime=MINUTE), NOW)
    registry.register(make_record(BOB), NOW)
    registry.register(make_record(CAROL, issued=NOW), NOW + MINUTE)
    assert {r.peer_id for r in registry.records(NOW + MINUTE)} == {BOB.peer_id, CAROL.peer_id}


_PEERS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(10, 14)]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 2)), max_size=25))
@settings(max_examples=60, deadline=None)
def test_registry_publishes_content_changes_and_keeps_renewals_silent(ops):
    registry = Registry()
    published: dict[bytes, NodeRecord] = {}
    newest: dict[bytes, NodeRecord] = {}
    for peer, minute, capacity in ops:
        record = make_record(_PEERS[peer], issued=NOW - minute * MINUTE, capacity=capacity)
        height = registry.height
        held = published.get(record.peer_id)
        if record in (held, newest.get(record.peer_id)):  # taken already: nothing happens
            registry.register(record, NOW)
            assert registry.height == height
            continue
        if held is not None and record.issued_at_ms <= newest[record.peer_id].issued_at_ms:
            with pytest.raises(RemoteProtocolError):
                registry.register(record, NOW)
            assert registry.height == height
            continue
        registry.register(record, NOW)
        newest[record.peer_id] = record
        changed = held is None or held.capacity != record.capacity
        assert registry.height == height + changed
        if changed:
            published[record.peer_id] = record
    assert registry.records(NOW) == tuple(published[p] for p in sorted(published))


def test_renewal_without_change_does_not_bump_the_height():
    registry = Registry()
    first = make_record(issued=NOW, lifetime=MINUTE)
    registry.register(first, NOW)
    root = registry.root()
    renewal = make_record(issued=NOW + 30_000, lifetime=MINUTE)
    assert registry.register(renewal, NOW + 30_000) == NOW + 30_000 + MINUTE
    assert registry.height == 1 and registry.root() == root
    # the peer stays listed past the published record's own expiry, until the renewal's
    assert registry.records(NOW + MINUTE + 1) == (first,)
    assert registry.live_until(ALICE.peer_id) == NOW + 30_000 + MINUTE
    assert registry.records(NOW + 30_000 + MINUTE) == ()
    assert registry.height == 2


def test_renewal_republishes_once_the_published_record_is_old():
    registry = Registry()
    registry.register(make_record(issued=NOW), NOW)
    later = NOW + records.REPUBLISH_AFTER_MS
    renewal = make_record(issued=later)
    registry.register(renewal, later)
    assert registry.height == 2
    assert registry.get(ALICE.peer_id) == renewal


def test_registry_refuses_a_replayed_renewal_older_than_the_newest():
    registry = Registry()
    registry.register(make_record(issued=NOW - 2 * MINUTE), NOW)
    registry.register(make_record(issued=NOW), NOW)
    with pytest.raises(RemoteProtocolError, match="older"):
        registry.register(make_record(issued=NOW - MINUTE), NOW)


def test_registry_content_change_bumps_the_height_and_the_root():
    registry = Registry()
    registry.register(make_record(issued=NOW - MINUTE), NOW)
    root = registry.root()
    registry.register(make_record(issued=NOW, organization="Other Lab"), NOW)
    assert registry.height == 2 and registry.root() != root


def test_changes_since_returns_only_changed_records_and_removals():
    registry = Registry()
    a = make_record(ALICE, issued=NOW, lifetime=MINUTE)
    registry.register(a, NOW)
    registry.register(make_record(BOB, issued=NOW), NOW)
    registry.register(make_record(CAROL, issued=NOW), NOW)
    held = registry.height
    bob2 = make_record(BOB, issued=NOW + 1, capacity=7)
    registry.register(bob2, NOW + 1)
    registry.register(make_record(CAROL, issued=NOW + 1), NOW + 1)  # renewal: not a change
    registry.expire(NOW + MINUTE)  # ALICE leaves
    reset, changes = registry.changes_since(held)
    assert not reset
    assert [(p, r) for _, p, r in changes] == [(BOB.peer_id, bob2), (ALICE.peer_id, None)]
    assert list(registry.changes_since(registry.height)[1]) == []


@pytest.mark.parametrize("since", [0, 99])
def test_changes_since_zero_or_an_unknown_height_is_a_reset_without_removals(since):
    registry = Registry()
    registry.register(make_record(ALICE, issued=NOW, lifetime=MINUTE), NOW)
    registry.register(make_record(BOB, issued=NOW), NOW)
    registry.expire(NOW + MINUTE)
    reset, changes = registry.changes_since(since)
    assert reset
    assert [p for _, p, _ in changes] == [BOB.peer_id]


def test_forgotten_removals_make_old_heights_a_reset():
    registry = Registry(max_tombstones=1)
    for identity in (ALICE, BOB):
        registry.register(make_record(identity, issued=NOW, lifetime=MINUTE), NOW)
    registry.register(make_record(CAROL, issued=NOW), NOW)
    registry.expire(NOW + MINUTE)  # two removals, one remembered
    assert registry.floor == 4
    assert registry.changes_since(3)[0]
    reset, changes = registry.changes_since(4)
    assert not reset and [r for _, _, r in changes] == [None]


def test_renewals_keep_the_expiry_index_bounded():
    registry = Registry()
    for i in range(500):
        registry.register(make_record(issued=NOW + i), NOW + i)
    assert registry.height == 1
    assert len(registry._expiry) <= 2 * len(registry) + 64


# ---------------------------------------------------------------------------------- record set


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


# ---------------------------------------------------------------------------------- replica


def _serve(registry: Registry, since: int, *, now: int = NOW, page_size: int = 1000,
           signer: Identity = V1) -> records.DirectoryPage:
    """What a verifier answers, without the wire (the service pages by bytes)."""
    head = records.sign_head(signer, records.DirectoryHead(
        registry.height, now - MINUTE, now + MINUTE, len(registry), registry.root()))
    reset, changes = registry.changes_since(since)
    entries = []
    more = False
    for entry in changes:
        if len(entries) == page_size:
            more = True
            break
        entries.append(entry)
    return records.DirectoryPage(
        head=head, since_height=0 if reset else since, reset=reset,
        records=tuple(r for _, _, r in entries if r is not None),
        removed=tuple(p for _, p, r in entries if r is None),
        next_height=entries[-1][0] if more else head.height, more=more,
    )


def _sync(replica: records.DirectoryReplica, registry: Registry, *, full: bool = False,
          page_size: int = 1000) -> Directory:
    update = replica.begin(V1.peer_id, full=full)
    while not update.done:
        update.receive(_serve(registry, update.since, page_size=page_size))
    return update.commit(NOW)


def _replica() -> records.DirectoryReplica:
    return records.DirectoryReplica(trusted_verifiers=frozenset({V1.peer_id}), quorum=1)


def test_replica_assembles_the_directory_from_pages():
    registry = Registry()
    for identity in _PEERS + [ALICE, BOB, CAROL]:
        registry.register(make_record(identity), NOW)
    replica = _replica()
    directory = _sync(replica, registry, page_size=2)
    assert directory.records == registry.records(NOW)
    assert directory.height == registry.height
    verify_directory(directory, trusted_verifiers=frozenset({V1.peer_id}), quorum=1, now_ms=NOW)


def test_replica_delta_applies_only_the_changes_and_checks_only_new_records():
    registry = Registry()
    for identity in _PEERS:
        registry.register(make_record(identity), NOW)
    replica = _replica()
    _sync(replica, registry)
    checks = replica.cache.checks
    changed = make_record(_PEERS[0], issued=NOW + 1, capacity=9)
    registry.register(changed, NOW + 1)
    registry.register(make_record(ALICE), NOW)
    assert [r.peer_id for r in _serve(registry, replica.head.height).records] == [
        _PEERS[0].peer_id, ALICE.peer_id]
    directory = _sync(replica, registry)
    assert directory.records == registry.records(NOW)
    assert replica.cache.checks == checks + 2
    assert {r.peer_id for r in replica.last_changed} == {_PEERS[0].peer_id, ALICE.peer_id}


def test_replica_without_changes_keeps_its_record_list():
    registry = Registry()
    registry.register(make_record(ALICE), NOW)
    replica = _replica()
    first = _sync(replica, registry)
    assert first.record(ALICE.peer_id) is not None
    second = _sync(replica, registry)
    assert second.records is first.records and replica.last_changed == ()


def test_replica_refuses_a_page_with_a_record_swapped_and_keeps_its_copy():
    registry = Registry()
    registry.register(make_record(ALICE), NOW)
    replica = _replica()
    held = _sync(replica, registry)
    registry.register(make_record(BOB), NOW)
    page = _serve(registry, replica.head.height)
    swapped = dataclasses.replace(page, records=(make_record(CAROL),))
    update = replica.begin(V1.peer_id)
    update.receive(swapped)
    with pytest.raises(InvalidSignatureError, match="do not match"):
        update.commit(NOW)
    assert replica.directory is held and replica._set.root() == records.record_set_root([
        held.records[0]])


def test_replica_refuses_pages_that_do_not_follow_each_other():
    registry = Registry()
    for identity in _PEERS:
        registry.register(make_record(identity), NOW)
    update = _replica().begin(V1.peer_id)
    first = _serve(registry, 0, page_size=1)
    update.receive(first)
    with pytest.raises(RemoteProtocolError, match="asked for"):
        update.receive(dataclasses.replace(_serve(registry, first.next_height + 1, page_size=1),
                                           reset=False))
    stuck = dataclasses.replace(first, reset=False, since_height=update.since,
                                next_height=update.since)
    with pytest.raises(RemoteProtocolError, match="no progress"):
        update.receive(stuck)


def test_replica_refuses_an_older_head_from_the_same_verifier():
    registry = Registry()
    registry.register(make_record(ALICE), NOW)
    registry.register(make_record(BOB), NOW)
    replica = _replica()
    _sync(replica, registry)
    old = Registry()
    old.register(make_record(ALICE), NOW)
    update = replica.begin(V1.peer_id, full=True)
    update.receive(_serve(old, 0, now=NOW - 1))
    with pytest.raises(RemoteProtocolError, match="older"):
        update.commit(NOW)


def test_replica_head_needs_the_quorum():
    registry = Registry()
    registry.register(make_record(ALICE), NOW)
    replica = records.DirectoryReplica(trusted_verifiers=frozenset({V2.peer_id}), quorum=1)
    with pytest.raises(InvalidSignatureError, match="0 valid signature"):
        _sync(replica, registry)
    assert replica.directory is None
