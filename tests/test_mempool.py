"""The committee's mempool under a flood of new identities (issue 16, HIGH 1): its two lanes,
the per-network cap on pending registrations, renewals first, and a re-check without
signatures; and the per-source admission of new identities on the directory's submission path."""

from __future__ import annotations

import hashlib

import pytest

from ps_p2p.consensus import app
from ps_p2p.consensus.block import BlockLimits, make_block
from ps_p2p.consensus.types import Validator
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import AdmissionError
from ps_p2p.keys import Identity
from ps_p2p.records import NodeRecord, Role, sign_record

CHAIN = "mempool-test"
T0 = 1_700_000_000_000
SECOND = 1000
HOUR = 3600 * SECOND
VALIDATOR = Identity.from_private_bytes(b"\x01" * 32)
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
POLICY = app.AdmissionPolicy(max_records_per_network=2, max_registrations_per_block=2)
GENESIS = app.Genesis(CHAIN, T0, (Validator(VALIDATOR.peer_id),), POLICY)


def node(i: int) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(b"mempool node %d" % i).digest())


def reg(who: Identity, *, net: int, issued: int = T0, lifetime: int = HOUR) -> bytes:
    rec = sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.{1 + net // 256}.{net % 256}.1/tcp/4001",), frozenset({Role.USER}), ONION,
        issued_at_ms=issued, expires_at_ms=issued + lifetime))
    return app.encode_tx(app.RegisterTx(rec))


def run(state: app.AppState, txs) -> app.AppState:
    block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=state.time_ms + SECOND,
                       prev_block_id=state.block_id, app_hash=state.app_hash,
                       proposer=VALIDATOR.peer_id, txs=txs)
    new, result = app.execute_block(state, block)
    assert all(r.ok for r in result.tx_results), result.tx_results
    return new


@pytest.fixture
def listed():
    """A state listing node 0 (network 100)."""
    return run(app.genesis_state(GENESIS), [reg(node(0), net=100)])


def test_a_full_new_registration_lane_never_refuses_a_renewal(listed):
    pool = app.Mempool(max_new=3)
    for i in range(1, 4):
        pool.add(reg(node(i), net=i), listed, T0)
    with pytest.raises(AdmissionError, match="full for new registrations"):
        pool.add(reg(node(9), net=9), listed, T0)
    assert pool.add(reg(node(0), net=100, issued=T0 + SECOND), listed, T0 + SECOND)
    assert pool.lane_size(app.Lane.LISTED) == 1 and pool.lane_size(app.Lane.NEW) == 3


def test_the_default_mempool_keeps_room_for_renewals_beyond_any_number_of_sybils(listed):
    pool = app.Mempool()
    for i in range(1, pool.max_new + 1):
        pool.add(reg(node(1000 + i), net=i), listed, T0)
    with pytest.raises(AdmissionError):
        pool.add(reg(node(5), net=3000), listed, T0)
    assert pool.add(reg(node(0), net=100, issued=T0 + SECOND), listed, T0 + SECOND)
    assert pool.max_txs > 2 * app.AdmissionPolicy().max_records  # a slot per listed peer


def test_pending_registrations_count_against_their_claimed_networks_cap(listed):
    pool = app.Mempool()
    pool.add(reg(node(1), net=7), listed, T0)
    pool.add(reg(node(2), net=7), listed, T0)
    with pytest.raises(AdmissionError, match="listed or pending in network ip4:10.1.7.0/24"):
        pool.add(reg(node(3), net=7), listed, T0)
    assert pool.pending_in_network("ip4:10.1.7.0/24") == 2
    pool.add(reg(node(4), net=100), listed, T0)  # one listed + one pending: the cap
    with pytest.raises(AdmissionError, match="network ip4:10.1.100.0/24"):
        pool.add(reg(node(5), net=100), listed, T0)


def test_reap_takes_renewals_and_deregistrations_before_new_registrations(listed):
    pool = app.Mempool()
    pool.add(reg(node(1), net=1), listed, T0)
    pool.add(reg(node(2), net=2), listed, T0)
    renewal = reg(node(0), net=100, issued=T0 + SECOND)
    pool.add(renewal, listed, T0 + SECOND)
    assert pool.reap(listed, BlockLimits(max_txs=1)) == [renewal]
    assert pool.txs()[0] == renewal


def test_a_newer_record_of_a_peer_takes_the_place_of_its_pending_one(listed):
    pool = app.Mempool()
    first = reg(node(0), net=100, issued=T0 + SECOND)
    newer = reg(node(0), net=100, issued=T0 + 2 * SECOND)
    pool.add(first, listed, T0 + 2 * SECOND)
    assert pool.add(newer, listed, T0 + 2 * SECOND)
    assert pool.txs() == [newer]
    with pytest.raises(AdmissionError, match="as new or newer is already pending"):
        pool.add(reg(node(0), net=100, issued=T0 + 1500), listed, T0 + 2 * SECOND)
    assert len(pool) == 1


def test_update_rechecks_without_verifying_signatures_again(listed, monkeypatch):
    pool = app.Mempool()
    for i in range(1, 5):
        pool.add(reg(node(i), net=i), listed, T0)

    def no_signature_checks(*args, **kwargs):
        raise AssertionError("signature checked again")

    monkeypatch.setattr(app, "check_record", no_signature_checks)
    monkeypatch.setattr(app, "verify_signature", no_signature_checks)
    assert pool.update(run(listed, []), [], T0 + 2 * SECOND) == 0
    assert len(pool) == 4


def test_update_moves_a_registration_to_the_lane_its_peer_now_belongs_in(listed):
    pool = app.Mempool()
    first, second = reg(node(1), net=1), reg(node(1), net=1, issued=T0 + SECOND)
    pool.add(first, listed, T0 + SECOND)
    state = run(listed, [first])
    pool.add(second, listed, T0 + SECOND)  # still NEW against the older state
    assert pool.lane_size(app.Lane.NEW) == 1
    pool.update(state, [first], T0 + 2 * SECOND)
    assert pool.lane_size(app.Lane.LISTED) == 1 and pool.lane_size(app.Lane.NEW) == 0
    assert pool.pending_in_network("ip4:10.1.1.0/24") == 0
