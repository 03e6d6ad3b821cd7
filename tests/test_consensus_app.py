"""The registry application: transactions, admission caps, execution, app hash, mempool, and the
committed directory served as deltas (pure cores)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import strategies as st

from ps_p2p import registry as app
from ps_p2p.consensus.block import ZERO_ID, BlockLimits, block_id, make_block
from ps_p2p.consensus.encoding import u32, u64
from ps_p2p.consensus.signing import sign_vote
from ps_p2p.consensus.types import Validator, Vote, VoteType
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import (
    AdmissionError,
    DirectoryRollbackError,
    ExpiredError,
    InvalidBlockError,
    InvalidCommitError,
    InvalidDirectoryError,
    InvalidScoreError,
    InvalidTransactionError,
    LocalProtocolError,
)
from ps_p2p.keys import Identity
from ps_p2p.records import RECORD_DOMAIN, NodeRecord, Role, sign_membership, sign_record
from ps_p2p.registry import directory as cdir
from ps_p2p.verification import ledger
from ps_p2p.verification.reputation import ReputationState, is_trusted, subject_of
from ps_p2p.verification.reputation import update as reputation_step

CHAIN = "planetserve-test"
T0 = 1_700_000_000_000  # genesis time, unix ms
SECOND = 1000
HOUR = 3600 * SECOND
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
VALIDATORS = tuple(Validator(k.peer_id) for k in KEYS)
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
POLICY = app.AdmissionPolicy(max_records_per_network=2, max_records_per_organization=2,
                             max_registrations_per_block=2)
GENESIS = app.Genesis(CHAIN, T0, VALIDATORS, POLICY)


def node(i: int) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(b"node %d" % i).digest())


A, B, C, D = node(1), node(2), node(3), node(4)
#: organization keys: LAB's members name "Lab"; an organization key is its identity
ORG_KEYS = {name: Identity.from_private_bytes(hashlib.sha256(b"org " + name.encode()).digest())
            for name in ("Lab", "Other", "acme", "impostor")}


def record(who: Identity, *, net: int = 0, host: int = 1, addr: str | None = None,
           issued: int = T0, lifetime: int = HOUR, org: str = "", org_key: str | None = None,
           roles=frozenset({Role.USER})) -> NodeRecord:
    """A signed record; naming ``org``, it carries the membership certificate of
    ``ORG_KEYS[org_key or org]`` (valid a day after the record's expiry)."""
    addrs = (addr,) if addr else (f"/ip4/10.0.{net}.{host}/tcp/4001",)
    membership = None if not org else sign_membership(
        ORG_KEYS[org_key or org], org, who.peer_id, issued + lifetime + 24 * HOUR)
    return sign_record(who, NodeRecord(
        who.peer_id, addrs, roles, ONION, organization=org, issued_at_ms=issued,
        expires_at_ms=issued + lifetime, membership=membership))


def reg(rec: NodeRecord) -> bytes:
    return app.encode_tx(app.RegisterTx(rec))


def dereg(who: Identity, issued: int = T0 + SECOND) -> bytes:
    return app.encode_tx(app.sign_deregister(who, CHAIN, issued))


def run(state: app.AppState, txs, time_ms: int | None = None):
    time_ms = time_ms if time_ms is not None else state.time_ms + SECOND
    block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=time_ms,
                       prev_block_id=state.block_id, app_hash=state.app_hash,
                       proposer=KEYS[0].peer_id, txs=txs)
    new, result = app.execute_block(state, block)
    return new, result, block


def errors(result) -> list[str | None]:
    return [None if r.ok else type(r.error).__name__ for r in result.tx_results]


@pytest.fixture
def genesis():
    return app.genesis_state(GENESIS)


# ---------------------------------------------------------------------------------- transactions


@pytest.mark.parametrize("tx", [
    app.RegisterTx(record(A, org="Lab")),
    app.sign_deregister(A, CHAIN, T0),
    ledger.sign_seed_commit(A, CHAIN, 1, b"c" * 32),
    ledger.sign_miss_report(A, CHAIN, 3, B.peer_id),
])
def test_transactions_round_trip_through_their_canonical_bytes(tx):
    assert app.decode_tx(app.encode_tx(tx), 8192) == tx


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t + b"\x00", "trailing"),
    (lambda t: t[:-3], "truncated"),
    (lambda t: t[:len(app.TX_DOMAIN)] + b"\x0a" + t[len(app.TX_DOMAIN) + 1:], "unknown"),
    (lambda t: b"x" * 9000, "max 8192"),
])
def test_malformed_transactions_are_refused(mutate, match, genesis):
    with pytest.raises(InvalidTransactionError, match=match):
        app.check_tx(mutate(reg(record(A))), genesis, T0)


def test_a_node_registers_its_own_record(genesis):
    state, result, _ = run(genesis, [reg(record(A))])
    assert errors(result) == [None]
    assert state.records.get(A.peer_id) == record(A)
    assert result.changes == {A.peer_id: record(A)}


def test_registering_someone_elses_record_is_refused(genesis):
    forged = dataclasses.replace(record(A), peer_id=B.peer_id)  # signed by A, names B
    with pytest.raises(InvalidTransactionError, match="may only register itself"):
        app.check_tx(reg(forged), genesis, T0)
    state, result, _ = run(genesis, [reg(forged)])
    assert errors(result) == ["InvalidTransactionError"] and len(state.records) == 0


def test_a_newer_record_renews_and_an_older_or_identical_one_is_refused(genesis):
    state, _, _ = run(genesis, [reg(record(A))])
    renewed = record(A, issued=T0 + SECOND, host=9)
    state, result, _ = run(state, [reg(renewed), reg(record(A)), reg(renewed)])
    assert errors(result) == [None, "InvalidTransactionError", "InvalidTransactionError"]
    assert state.records.get(A.peer_id) == renewed
    with pytest.raises(InvalidTransactionError, match="not newer"):
        app.check_tx(reg(record(A)), state, T0 + SECOND)


def test_a_node_deregisters_only_itself_and_not_with_an_old_deregistration(genesis):
    state, _, _ = run(genesis, [reg(record(A, issued=T0 + 5 * SECOND))], T0 + 6 * SECOND)
    with pytest.raises(InvalidTransactionError, match="older than its listed record"):
        app.check_tx(dereg(A, issued=T0 + SECOND), state, T0 + 7 * SECOND)
    forged = app.DeregisterTx(A.peer_id, T0 + 7 * SECOND, app.sign_deregister(
        B, CHAIN, T0 + 7 * SECOND).signature)
    with pytest.raises(InvalidTransactionError, match="not signed by that peer ID"):
        app.check_tx(app.encode_tx(forged), state, T0 + 7 * SECOND)
    with pytest.raises(InvalidTransactionError, match="not listed"):
        app.check_tx(dereg(B, issued=T0 + 7 * SECOND), state, T0 + 7 * SECOND)
    state, result, _ = run(state, [dereg(A, issued=T0 + 7 * SECOND)], T0 + 8 * SECOND)
    assert errors(result) == [None] and A.peer_id not in state.records
    assert result.changes == {A.peer_id: None}


def test_only_validators_may_list_the_verifier_role(genesis):
    with pytest.raises(InvalidTransactionError, match="not a validator"):
        app.check_tx(reg(record(A, roles=frozenset({Role.VERIFIER}))), genesis, T0)
    app.check_tx(reg(record(KEYS[1], roles=frozenset({Role.VERIFIER}))), genesis, T0)


@pytest.mark.parametrize("tx", [
    ledger.sign_seed_commit(KEYS[0], CHAIN, 1, b"c" * 32),
    ledger.sign_miss_report(KEYS[0], CHAIN, 1, A.peer_id),
])
def test_epoch_transactions_are_refused_without_a_verification_section(tx, genesis):
    with pytest.raises(InvalidTransactionError, match="no verification section"):
        app.check_tx(app.encode_tx(tx), genesis, T0)


# ---------------------------------------------------------------------------------- time


def test_records_expire_by_block_time(genesis):
    state, _, _ = run(genesis, [reg(record(A, lifetime=HOUR))])
    state, result, _ = run(state, [], T0 + HOUR - 1)
    assert A.peer_id in state.records and result.expired == ()
    state, result, _ = run(state, [], T0 + HOUR)
    assert A.peer_id not in state.records
    assert result.expired == (A.peer_id,) and result.changes == {A.peer_id: None}


def test_execution_uses_the_block_time_not_the_local_clock(genesis):
    tx = reg(record(A, lifetime=HOUR))
    # A validator whose clock is past the record's expiry refuses it into its mempool ...
    with pytest.raises(InvalidTransactionError, match="expired"):
        app.check_tx(tx, genesis, T0 + 2 * HOUR)
    # ... but a committed block decides by its own time: every validator lists it.
    state, result, _ = run(genesis, [tx], T0 + SECOND)
    assert errors(result) == [None] and A.peer_id in state.records
    # and a block time past the expiry refuses it, whatever the local clocks say
    _, late, _ = run(genesis, [tx], T0 + HOUR)
    assert errors(late) == ["InvalidTransactionError"]


def test_a_renewal_moves_the_expiry(genesis):
    state, _, _ = run(genesis, [reg(record(A, lifetime=HOUR))])
    state, _, _ = run(state, [reg(record(A, issued=T0 + HOUR - 10, lifetime=HOUR))],
                      T0 + HOUR - 5)
    state, result, _ = run(state, [], T0 + HOUR + 1)
    assert A.peer_id in state.records and result.expired == ()


# ---------------------------------------------------------------------------------- admission


def test_a_third_record_in_one_ipv4_slash_24_is_refused(genesis):
    state, result, _ = run(genesis, [reg(record(A, net=1, host=1)), reg(record(B, net=1, host=2))])
    assert errors(result) == [None, None]
    assert state.network_count("ip4:10.0.1.0/24") == 2
    with pytest.raises(AdmissionError, match="network ip4:10.0.1.0/24"):
        app.check_tx(reg(record(C, net=1, host=3)), state, T0 + 2 * SECOND)
    app.check_tx(reg(record(C, net=2, host=3)), state, T0 + 2 * SECOND)
    # a renewal in the same network does not count twice
    app.check_tx(reg(record(A, net=1, host=7, issued=T0 + SECOND)), state, T0 + 2 * SECOND)


def test_ipv6_records_are_capped_per_slash_48(genesis):
    v6 = [reg(record(w, addr=f"/ip6/2001:db8:1:{i}::1/tcp/1")) for i, w in enumerate((A, B))]
    state, _, _ = run(genesis, v6)
    with pytest.raises(AdmissionError, match="2001:db8:1::/48"):
        app.check_tx(reg(record(C, addr="/ip6/2001:db8:1:ff::9/tcp/1")), state, T0 + 2 * SECOND)
    app.check_tx(reg(record(C, addr="/ip6/2001:db8:2::9/tcp/1")), state, T0 + 2 * SECOND)


def test_records_are_capped_per_organization(genesis):
    state, _, _ = run(genesis, [reg(record(A, net=1, org="Lab")), reg(record(B, net=2, org="Lab"))])
    with pytest.raises(AdmissionError, match="organization 'Lab'"):
        app.check_tx(reg(record(C, net=3, org="Lab")), state, T0 + 2 * SECOND)
    app.check_tx(reg(record(C, net=3, org="Other")), state, T0 + 2 * SECOND)
    # the cap counts the organization key, not the name: a sybil naming "Lab" with its own
    # key neither uses up Lab's slots nor is stopped by them
    app.check_tx(reg(record(C, net=3, org="Lab", org_key="impostor")), state, T0 + 2 * SECOND)


def test_a_record_naming_an_organization_without_its_certificate_is_refused(genesis):
    free_text = sign_record(A, dataclasses.replace(record(A, org="acme"), membership=None))
    with pytest.raises(InvalidTransactionError, match="without a membership certificate"):
        app.check_tx(reg(free_text), genesis, T0)


def test_a_membership_certificate_of_another_key_or_member_is_refused(genesis):
    acme = record(A, net=1, org="acme")
    # B copies A's certificate (the directory is public) into its own record
    stolen = sign_record(B, dataclasses.replace(record(B, net=2), organization="acme",
                                                membership=acme.membership))
    # C signs a certificate with its own key and writes acme's key into it
    forged_m = dataclasses.replace(record(C, net=3, org="acme", org_key="impostor").membership,
                                   org_key=ORG_KEYS["acme"].peer_id)
    forged = sign_record(C, dataclasses.replace(record(C, net=3), organization="acme",
                                                membership=forged_m))
    for tx in (stolen, forged):
        with pytest.raises(InvalidTransactionError, match="membership certificate"):
            app.check_tx(reg(tx), genesis, T0)
        state, result, _ = run(genesis, [reg(tx)])
        assert errors(result) == ["InvalidTransactionError"] and not state.records
    app.check_tx(reg(acme), genesis, T0)


def test_a_registered_record_decodes_with_its_membership(genesis):
    rec = record(A, org="acme")
    decoded = app.decode_tx(reg(rec), genesis.genesis.limits.max_tx_bytes)
    assert decoded == app.RegisterTx(rec) and decoded.record.membership == rec.membership


def test_a_sybil_with_its_own_key_naming_an_organization_gets_its_own_reputation_subject():
    from ps_p2p.records import record_subject
    honest, sybil = record(A, org="acme"), record(B, org="acme", org_key="impostor")
    assert record_subject(honest) == b"orgkey\x00" + ORG_KEYS["acme"].peer_id
    assert record_subject(sybil) != record_subject(honest)


def test_new_registrations_are_capped_per_block(genesis):
    txs = [reg(record(w, net=i)) for i, w in enumerate((A, B, C))]
    state, result, _ = run(genesis, txs)
    assert errors(result) == [None, None, "AdmissionError"]
    state, result, _ = run(state, [txs[2]])
    assert errors(result) == [None] and len(state.records) == 3


def test_the_registry_is_capped_in_total():
    genesis = app.genesis_state(dataclasses.replace(
        GENESIS, policy=dataclasses.replace(POLICY, max_records=1)))
    state, _, _ = run(genesis, [reg(record(A, net=1))])
    with pytest.raises(AdmissionError, match="registry full"):
        app.check_tx(reg(record(B, net=2)), state, T0 + 2 * SECOND)


def test_source_networks_of_dns_and_ip_addresses():
    rec = NodeRecord(A.peer_id, ("/ip4/192.168.7.9/tcp/1", "/dns4/a.b.Example.com/tcp/1",
                                 "/ip6/2001:db8:5:6::1/udp/1/quic-v1"),
                     frozenset({Role.USER}), ONION)
    assert app.source_networks(rec, POLICY) == {
        "ip4:192.168.7.0/24", "dns:example.com", "ip6:2001:db8:5::/48"}


# ---------------------------------------------------------------------------------- evidence


def equivocation(key: Identity = KEYS[2], height: int = 1) -> app.EvidenceTx:
    first = sign_vote(key, CHAIN, Vote(VoteType.PREVOTE, height, 0, b"\x01" * 32, b""))
    second = sign_vote(key, CHAIN, Vote(VoteType.PREVOTE, height, 0, b"\x02" * 32, b""))
    return app.EvidenceTx(first, second)


def test_equivocation_evidence_is_recorded_once_and_changes_the_app_hash(genesis):
    tx = app.encode_tx(equivocation())
    assert app.decode_tx(tx, 8192) == equivocation()
    state, result, _ = run(genesis, [tx, tx])
    assert errors(result) == [None, "InvalidTransactionError"]
    assert list(state.evidence.values()) == [(KEYS[2].peer_id, 1)]
    empty, _, _ = run(genesis, [])
    assert state.app_hash != empty.app_hash


def test_evidence_against_a_validator_already_excluded_is_refused_and_other_evidence_is_not(
        genesis):
    """A Byzantine validator equivocating at every height must not fill the evidence store
    (evidence against another one would then be refused) nor make a block of every height."""
    state, result, _ = run(genesis, [app.encode_tx(equivocation())])
    assert errors(result) == [None] and KEYS[2].peer_id in state.excluded
    again = app.EvidenceTx(*(sign_vote(KEYS[2], CHAIN, Vote(
        VoteType.PRECOMMIT, 1, 1, value, b"")) for value in (b"\x03" * 32, b"\x04" * 32)))
    with pytest.raises(InvalidTransactionError, match="already excluded"):
        app.check_tx(app.encode_tx(again), state, T0 + 2 * SECOND)
    state, result, _ = run(state, [app.encode_tx(again), app.encode_tx(equivocation(KEYS[1]))])
    assert errors(result) == ["InvalidTransactionError", None]
    assert sorted(state.evidence.values()) == sorted([(KEYS[2].peer_id, 1),
                                                      (KEYS[1].peer_id, 1)])


@pytest.mark.parametrize("make, match", [
    (lambda: app.EvidenceTx(equivocation().first, equivocation().first), "not conflicting"),
    (lambda: equivocation(key=A), "not a validator"),
    (lambda: equivocation(height=9), "future height"),
    (lambda: app.EvidenceTx(equivocation().first, dataclasses.replace(
        equivocation().second, signature=b"\x00" * 64)), "invalid signature"),
])
def test_invalid_evidence_is_refused(make, match, genesis):
    with pytest.raises(InvalidTransactionError, match=match):
        app.check_tx(app.encode_tx(make()), genesis, T0)


# ---------------------------------------------------------------------------------- app hash


def test_app_hash_is_deterministic_and_execution_leaves_the_old_state_unchanged(genesis):
    txs = [reg(record(A, net=1)), reg(record(B, net=2))]
    s1, r1, _ = run(genesis, txs)
    s2, _r2, _ = run(genesis, txs)
    assert s1.app_hash == s2.app_hash == r1.app_hash == app.app_hash(s1)
    assert len(genesis.records) == 0 and genesis.app_hash == app.genesis_state(GENESIS).app_hash


def test_a_record_older_than_the_deregistration_cannot_list_the_node_again(genesis):
    old = record(A)
    first, _, _ = run(genesis, [reg(old)])
    left, r, _ = run(first, [dereg(A, issued=T0 + 2 * SECOND)], T0 + 3 * SECOND)
    assert errors(r) == [None] and A.peer_id not in left.records
    assert left.departed == {A.peer_id: T0 + 2 * SECOND}
    with pytest.raises(InvalidTransactionError, match="not newer than its deregistration"):
        app.check_tx(reg(old), left, T0 + 4 * SECOND)
    replayed, r, _ = run(left, [reg(old)], T0 + 4 * SECOND)
    assert errors(r) == ["InvalidTransactionError"] and A.peer_id not in replayed.records
    # a newer record lists the node again; the tombstone stays (it expires by time only), so
    # the old record is still refused once the node leaves again
    back, r, _ = run(left, [reg(record(A, issued=T0 + 3 * SECOND))], T0 + 4 * SECOND)
    assert errors(r) == [None] and A.peer_id in back.records
    assert back.departed == {A.peer_id: T0 + 2 * SECOND}
    assert len({left.app_hash, back.app_hash, first.app_hash}) == 3
    again, r, _ = run(back, [dereg(A, issued=T0 + 5 * SECOND), reg(old)], T0 + 6 * SECOND)
    assert errors(r) == [None, "InvalidTransactionError"] and A.peer_id not in again.records


def test_at_most_max_records_tombstones_are_held_the_oldest_going_first():
    small = app.genesis_state(dataclasses.replace(
        GENESIS, policy=dataclasses.replace(GENESIS.policy, max_records=2)))
    state, _, _ = run(small, [reg(record(A, net=1)), reg(record(B, net=2))])
    state, _, _ = run(state, [dereg(A, issued=T0 + 2 * SECOND)], T0 + 3 * SECOND)
    state, _, _ = run(state, [dereg(B, issued=T0 + 3 * SECOND), reg(record(C, net=3))],
                      T0 + 4 * SECOND)
    state, r, _ = run(state, [dereg(C, issued=T0 + 5 * SECOND)], T0 + 6 * SECOND)
    assert errors(r) == [None]  # never refused for lack of room
    assert state.departed == {B.peer_id: T0 + 3 * SECOND, C.peer_id: T0 + 5 * SECOND}


def test_a_tombstone_is_dropped_once_no_older_record_can_still_be_valid(genesis):
    from ps_p2p.records.limits import MAX_RECORD_LIFETIME_MS

    first, _, _ = run(genesis, [reg(record(A))])
    left, _, _ = run(first, [dereg(A, issued=T0 + 2 * SECOND)], T0 + 3 * SECOND)
    kept, _, _ = run(left, [], T0 + 2 * SECOND + MAX_RECORD_LIFETIME_MS)
    assert kept.departed == {A.peer_id: T0 + 2 * SECOND}
    gone, _, _ = run(kept, [], T0 + 2 * SECOND + MAX_RECORD_LIFETIME_MS + 1)
    assert gone.departed == {} and gone.app_hash != kept.app_hash


def test_app_hash_is_sensitive_to_transaction_order(genesis):
    first, _, _ = run(genesis, [reg(record(A))])
    a, ra, _ = run(first, [dereg(A), reg(record(A, issued=T0 + 2 * SECOND))], T0 + 3 * SECOND)
    b, rb, _ = run(first, [reg(record(A, issued=T0 + 2 * SECOND)), dereg(A)], T0 + 3 * SECOND)
    assert errors(ra) == [None, None] and A.peer_id in a.records
    assert errors(rb) == [None, "InvalidTransactionError"] and A.peer_id in b.records
    c, _, _ = run(first, [dereg(A, issued=T0 + 2 * SECOND),
                          reg(record(A, issued=T0 + 2 * SECOND + 1))], T0 + 3 * SECOND)
    d, _, _ = run(first, [reg(record(A, issued=T0 + 2 * SECOND)),
                          dereg(A, issued=T0 + 2 * SECOND)], T0 + 3 * SECOND)
    assert A.peer_id in c.records and A.peer_id not in d.records
    assert c.app_hash != d.app_hash


def test_app_hash_covers_height_and_chain(genesis):
    s1, _, _ = run(genesis, [])
    assert s1.app_hash != genesis.app_hash
    other = app.genesis_state(dataclasses.replace(GENESIS, chain_id="other"))
    assert other.app_hash != genesis.app_hash


def test_execute_block_refuses_a_block_that_does_not_follow(genesis):
    state, _, block = run(genesis, [])
    with pytest.raises(InvalidBlockError, match="expected 2"):
        app.execute_block(state, block)
    bad = make_block(chain_id=CHAIN, height=2, time_ms=state.time_ms + 1, prev_block_id=ZERO_ID,
                     app_hash=state.app_hash, proposer=KEYS[0].peer_id)
    with pytest.raises(InvalidBlockError, match="does not follow"):
        app.execute_block(state, bad)
    stranger = make_block(chain_id=CHAIN, height=2, time_ms=state.time_ms + 1,
                          prev_block_id=state.block_id, app_hash=state.app_hash,
                          proposer=A.peer_id)
    with pytest.raises(InvalidBlockError, match="non-validator"):
        app.execute_block(state, stranger)


# ---------------------------------------------------------------------------------- mempool


def test_mempool_deduplicates(genesis):
    pool = app.Mempool()
    assert pool.add(reg(record(A)), genesis, T0) is True
    assert pool.add(reg(record(A)), genesis, T0) is False
    assert len(pool) == 1


def test_mempool_is_bounded_in_count_bytes_and_per_subject(genesis):
    by_count = app.Mempool(max_new=2)
    by_count.add(reg(record(A, net=1)), genesis, T0)
    by_count.add(reg(record(B, net=2)), genesis, T0)
    with pytest.raises(AdmissionError, match="mempool full"):
        by_count.add(reg(record(C, net=3)), genesis, T0)
    tx = reg(record(A))
    by_bytes = app.Mempool(max_new_bytes=len(tx) + 10)
    by_bytes.add(tx, genesis, T0)
    with pytest.raises(AdmissionError, match="mempool full"):
        by_bytes.add(reg(record(B)), genesis, T0)
    assert by_bytes.bytes == len(tx)


def test_mempool_refuses_what_check_tx_refuses(genesis):
    pool = app.Mempool()
    with pytest.raises(InvalidTransactionError):
        pool.add(reg(dataclasses.replace(record(A), peer_id=B.peer_id)), genesis, T0)
    assert len(pool) == 0


def test_mempool_reap_respects_the_block_limits_and_the_registration_cap(genesis):
    pool = app.Mempool()
    for i, who in enumerate((A, B, C, D)):
        pool.add(reg(record(who, net=i)), genesis, T0)
    assert len(pool.reap(genesis)) == 2  # max_registrations_per_block
    assert len(pool.reap(genesis, BlockLimits(max_txs=1))) == 1


def test_mempool_update_drops_committed_and_no_longer_valid_transactions(genesis):
    pool = app.Mempool()
    tx_a, tx_b = reg(record(A, net=1, host=1)), reg(record(B, net=2, host=2))
    tx_c = reg(record(C, net=3, lifetime=2 * SECOND))
    for tx in (tx_a, tx_b, tx_c):
        pool.add(tx, genesis, T0)
    state, _, _ = run(genesis, [tx_a, tx_b])
    dropped = pool.update(state, [tx_a, tx_b], T0 + 2 * SECOND)
    assert dropped == 1 and len(pool) == 0 and pool.bytes == 0  # C expired meanwhile


# ---------------------------------------------------------------------------------- directory


def commit_for(header, signers=KEYS[:3]) -> list[Vote]:
    return [sign_vote(k, CHAIN, Vote(VoteType.PRECOMMIT, header.height, 0, block_id(header), b""))
            for k in signers]


class Chain:
    """A genesis, its blocks and a verifier's history."""

    def __init__(self, genesis_state: app.AppState) -> None:
        self.state = genesis_state
        self.history = cdir.DirectoryHistory(genesis_state)
        self.headers = []

    def block(self, txs, time_ms=None):
        new, result, block = run(self.state, txs, time_ms)
        self.history.add_block(block.header, commit_for(block.header), new, result)
        self.state = new
        self.headers.append(block.header)
        return block.header


def fetch(chain: Chain, view, now=None, *, max_age=cdir.MAX_DIRECTORY_AGE_MS, pages=None,
          commit=None, header=None):
    header = header or chain.history.header
    since = view.height if view is not None else 0
    pages = pages if pages is not None else cdir.directory_delta(chain.history, since, 4096)
    return cdir.verify_directory(
        VALIDATORS, CHAIN, header, commit if commit is not None else chain.history.commit,
        pages, view, now if now is not None else header.time_ms + SECOND, max_age)


@pytest.fixture
def chain(genesis):
    c = Chain(genesis)
    c.block([reg(record(A, net=1)), reg(record(B, net=2))])
    c.block([reg(record(C, net=3)), dereg(A)])
    c.block([reg(record(B, net=2, issued=T0 + SECOND))])
    return c


def test_a_good_directory_is_accepted_from_scratch(chain):
    view = fetch(chain, None)
    assert view.height == 2 and view.header == chain.headers[-1]
    assert view.records() == chain.history.served.records.records()
    assert {r.peer_id for r in view.records()} == {B.peer_id, C.peer_id}


def test_a_node_applies_only_what_changed_since_its_view(genesis):
    c = Chain(genesis)
    c.block([reg(record(A, net=1)), reg(record(B, net=2))])
    c.block([])
    old = fetch(c, None)  # height 1: A and B
    assert old.height == 1 and len(old) == 2
    c.block([reg(record(C, net=3)), dereg(A)])
    c.block([])
    reset, changes = c.history.changes_since(1)
    assert not reset and {p for p, _ in changes} == {A.peer_id, C.peer_id}
    new = fetch(c, old)
    assert new.height == 3 and {r.peer_id for r in new.records()} == {B.peer_id, C.peer_id}
    with pytest.raises(LocalProtocolError, match="superseded"):
        old.records()


def test_an_under_signed_directory_is_refused(chain):
    header = chain.history.header
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        fetch(chain, None, commit=commit_for(header, KEYS[:2]))


def test_a_forged_directory_is_refused(chain):
    outsiders = [Identity.from_private_bytes(bytes([0x50 + i]) * 32) for i in range(3)]
    header = chain.history.header
    with pytest.raises(InvalidCommitError, match="not a validator"):
        fetch(chain, None, commit=commit_for(header, outsiders))
    forged_header = dataclasses.replace(header, app_hash=b"\x66" * 32)
    with pytest.raises(InvalidCommitError, match="another block"):
        fetch(chain, None, header=forged_header)


def test_a_rollback_is_refused(chain):
    view = fetch(chain, None)  # height 2
    older = chain.headers[-2]  # covers height 1
    with pytest.raises(DirectoryRollbackError, match="older than the one held"):
        fetch(chain, view, header=older, commit=commit_for(older), pages=[])


def test_a_too_old_directory_is_refused(chain):
    header = chain.history.header
    with pytest.raises(ExpiredError, match="old"):
        fetch(chain, None, now=header.time_ms + 60 * SECOND, max_age=30 * SECOND)


def test_a_tampered_delta_is_refused_and_the_view_is_kept(genesis):
    c = Chain(genesis)
    c.block([reg(record(A, net=1))])
    c.block([])
    view = fetch(c, None)
    c.block([reg(record(B, net=2)), reg(record(C, net=3))])
    c.block([])
    pages = cdir.directory_delta(c.history, view.height, 4096)
    stream = b"".join(p.data for p in pages)
    first_entry = min(stream.index(B.peer_id), stream.index(C.peer_id))
    # put entry = u8(1) || u32(len) || RECORD_DOMAIN || u32(len(peer ID)) || peer ID ...
    cut = first_entry - 4 - len(RECORD_DOMAIN) - 4 - 1
    assert stream[cut] == 1
    with pytest.raises(InvalidDirectoryError, match="app hash"):  # B and C left out
        fetch(c, view, pages=[cdir.DeltaPage(0, True, stream[:cut])])
    with pytest.raises(InvalidDirectoryError, match="record refused"):  # a signature flipped
        fetch(c, view, pages=[cdir.DeltaPage(0, True, stream[:-1] + bytes([stream[-1] ^ 1]))])
    assert {r.peer_id for r in view.records()} == {A.peer_id}  # unchanged, still usable
    assert fetch(c, view).height == 3


def test_pages_must_come_in_order_and_end_once(chain):
    pages = cdir.directory_delta(chain.history, 0, 256)
    assert len(pages) > 2
    for bad in (pages[1:], pages[:-1], [pages[1], pages[0]] + pages[2:]):
        with pytest.raises(InvalidDirectoryError):
            fetch(chain, None, pages=bad)


def big_state(n: int, org_bytes: int) -> app.AppState:
    """A state at height 1 holding ``n`` records of ~``org_bytes`` each (inserted directly:
    the paging must not depend on the record limits)."""
    state = app.genesis_state(GENESIS).copy()
    for i in range(n):
        who = node(100 + i)
        state._put(sign_record(who, NodeRecord(
            who.peer_id, (), frozenset({Role.USER}), ONION, organization="x" * org_bytes,
            issued_at_ms=T0, expires_at_ms=T0 + HOUR)))
    state.height, state.time_ms = 1, T0 + SECOND
    state.app_hash = app.app_hash(state)
    return state


@pytest.mark.parametrize("records, record_bytes, max_page", [
    (40, 17_600, 4096),   # records larger than a page
    (40, 17_600, 64),     # the smallest page
    (300, 10, 1024),      # many small records
    (3, 10, 192 * 1024),  # everything in one page
])
def test_a_page_never_exceeds_its_bound(records, record_bytes, max_page):
    served = big_state(records, record_bytes)
    history = cdir.DirectoryHistory(served)
    nxt, result, block = run(served, [])
    history.add_block(block.header, commit_for(block.header), nxt, result)
    pages = cdir.directory_delta(history, 0, max_page)
    assert all(len(p.encode()) <= max_page for p in pages)
    assert [p.index for p in pages] == list(range(len(pages)))
    assert [p.last for p in pages] == [False] * (len(pages) - 1) + [True]
    assert all(cdir.DeltaPage.decode(p.encode(), max_page) == p for p in pages)
    stream = b"".join(p.data for p in pages)
    assert stream.count(b"x" * record_bytes) == records


def test_history_is_bounded_and_old_heights_get_a_reset(genesis):
    c = Chain(genesis)
    c.history.max_heights = 2
    for i in range(5):
        c.block([reg(record(node(10 + i), net=10 + i))])
    assert c.history.changes_since(1)[0] is True   # before the floor: reset
    assert c.history.changes_since(3)[0] is False


# ---------------------------------------------------------------------------------- reputations

ORG = subject_of(b"", ORG_KEYS["acme"].peer_id)
LONE = subject_of(A.peer_id)


def rep_update(epoch: int, *scores: tuple[bytes, float]) -> app.ReputationUpdateTx:
    return app.ReputationUpdateTx(epoch, tuple(sorted((s, app.to_micro(c)) for s, c in scores)))


subjects = st.one_of(
    st.binary(min_size=1, max_size=38).map(lambda b: b"node\x00" + b),
    st.binary(min_size=38, max_size=38).map(lambda b: b"orgkey\x00" + b),
)


@pytest.mark.parametrize("epoch, scores, reason", [
    (1, [], "0 subjects"),
    (0, [(LONE, 1)], "epoch"),
    (1, [(LONE, app.MICRO + 1)], "not in"),
    (1, [(ORG, 1), (LONE, 1)], "ascending"),   # b"org" > b"node"
    (1, [(LONE, 1), (LONE, 2)], "ascending"),  # duplicate
    (1, [(b"who\x00x", 1)], "neither"),
    (1, [(b"org\x00acme", 1)], "neither"),  # a name: subjects are organization keys
    (1, [(b"orgkey\x00" + bytes(37), 1)], "wrong length"),
    (1, [(b"node\x00", 1)], "wrong length"),
])
def test_a_malformed_reputation_update_is_refused_naming_the_fault(epoch, scores, reason):
    with pytest.raises(InvalidTransactionError, match=reason):
        app.ReputationUpdateTx(epoch, tuple(scores)).check()


def test_applied_reputations_follow_the_rule_in_micro_units_and_move_the_app_hash(genesis):
    state = genesis.copy()
    before = app.app_hash(state)
    expected = {ORG: ReputationState.fresh(), LONE: ReputationState.fresh()}
    for epoch, (c_org, c_lone) in enumerate([(0.9, 0.3), (0.8, 0.2), (0.85, 0.25)], 1):
        changes = app.apply_reputation_update(state, rep_update(epoch, (LONE, c_lone),
                                                                (ORG, c_org)))
        expected = {ORG: reputation_step(expected[ORG], c_org),
                    LONE: reputation_step(expected[LONE], c_lone)}
        for subject, want in expected.items():
            got = state.reputation(subject)
            assert changes[subject] == got
            assert got.value == pytest.approx(want.reputation, abs=2e-6)
            assert got.window == tuple(round(v * app.MICRO) for v in want.window)
            assert got.epochs == epoch
    assert state.reputation_epoch == 3
    assert is_trusted(state.reputation(ORG).state())
    assert not is_trusted(state.reputation(LONE).state())  # 0.3, 0.2, 0.25: punished
    assert app.app_hash(state) != before
    assert genesis.reputations == {} and app.app_hash(genesis) == before  # a copy was changed

    other = genesis.copy()  # another replica applying the same updates: the same bits
    for epoch, (c_org, c_lone) in enumerate([(0.9, 0.3), (0.8, 0.2), (0.85, 0.25)], 1):
        app.apply_reputation_update(other, rep_update(epoch, (ORG, c_org), (LONE, c_lone)))
    assert app.app_hash(other) == app.app_hash(state)


def test_the_app_hash_commits_every_reputation_field(genesis):
    base = genesis.copy()
    app.apply_reputation_update(base, rep_update(1, (LONE, 0.5)))
    entry = base.reputation(LONE)
    variants = [
        dataclasses.replace(entry, reputation=entry.reputation + 1),
        dataclasses.replace(entry, window=entry.window + (0,)),
        dataclasses.replace(entry, epochs=entry.epochs + 1),
        dataclasses.replace(entry, strikes=entry.strikes + 1),
        dataclasses.replace(entry, clean=entry.clean + 1),
    ]
    hashes = {app.app_hash(base)}
    for variant in variants:
        state = base.copy()
        state.reputations[LONE] = variant
        state._reputation_root = None
        hashes.add(app.app_hash(state))
    epoch = base.copy()
    epoch.reputation_epoch = 2
    epoch._reputation_root = None
    hashes.add(app.app_hash(epoch))
    assert len(hashes) == 7


def test_a_convicted_subject_stays_untrusted_on_chain_for_its_probation(genesis):
    # issue 18: the chain carries strikes and clean epochs; R is committed just below 0.4
    state = genesis.copy()
    app.apply_reputation_update(state, rep_update(1, (LONE, 0.1)))  # from 0.5 to 0.26
    assert (state.reputation(LONE).strikes, state.reputation(LONE).clean) == (1, 0)
    for epoch in range(2, 9):  # 7 clean epochs of 8: R would be 0.7, it is held at 0.399999
        app.apply_reputation_update(state, rep_update(epoch, (LONE, 0.9)))
        entry = state.reputation(LONE)
        assert (entry.reputation, entry.strikes, entry.clean) == (399_999, 1, epoch - 1)
        assert not is_trusted(entry.state())
    app.apply_reputation_update(state, rep_update(9, (LONE, 0.9)))
    assert is_trusted(state.reputation(LONE).state()) and state.reputation(LONE).clean == 8


def test_a_reputation_update_is_refused_whole_for_an_old_epoch_or_a_full_table():
    small = app.genesis_state(dataclasses.replace(
        GENESIS, policy=dataclasses.replace(POLICY, max_records=2)))
    app.apply_reputation_update(small, rep_update(5, (LONE, 0.5)))
    held = dict(small.reputations)
    with pytest.raises(InvalidTransactionError, match="epoch 5, not after 5"):
        app.apply_reputation_update(small, rep_update(5, (LONE, 0.9)))
    third = subject_of(B.peer_id)
    with pytest.raises(AdmissionError, match="2 new reputation subject"):
        app.apply_reputation_update(small, rep_update(6, (LONE, 0.9), (ORG, 0.9), (third, 0.9)))
    assert small.reputations == held and small.reputation_epoch == 5
    with pytest.raises(InvalidTransactionError, match="credibility"):
        app.apply_reputation_update(small, app.ReputationUpdateTx(6, ((LONE, -1),)))
    with pytest.raises(InvalidScoreError):
        app.to_micro(1.5)


def test_a_reputation_entry_decodes_strictly():
    from ps_p2p.consensus.encoding import Reader
    good = app.ReputationEntry(400_000, (1, 2, 3), 7, strikes=2, clean=5)
    r = Reader(good.encode(), InvalidTransactionError, "entry")
    assert app.ReputationEntry.read(r) == good
    r.done()
    assert good.state().strikes == 2 and good.state().clean == 5
    assert app.ReputationEntry.from_state(good.state()) == good
    many = u32(0) + u64(0) + bytes([0]) + u32(0x10000) + u32(0)
    with pytest.raises(InvalidTransactionError, match="strikes"):
        app.ReputationEntry.read(Reader(many, InvalidTransactionError, "entry"))
    over = u32(app.MICRO + 1) + u64(0) + bytes([0])
    with pytest.raises(InvalidTransactionError, match="over"):
        app.ReputationEntry.read(Reader(over, InvalidTransactionError, "entry"))
    long = u32(0) + u64(0) + bytes([65])
    with pytest.raises(InvalidTransactionError, match="window of 65"):
        app.ReputationEntry.read(Reader(long, InvalidTransactionError, "entry"))
