"""The committee's mempool under a flood of new identities (issue 16, HIGH 1): its two lanes,
the per-network cap on pending registrations, renewals first, and a re-check without
signatures; and the per-source admission of new identities on the directory's submission path."""

from __future__ import annotations

import hashlib

import pytest
import trio

from ps_p2p import registry as app
from ps_p2p.consensus.block import BlockLimits, make_block
from ps_p2p.consensus.types import Validator
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import AdmissionError, InvalidTransactionError
from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import directory_pb2
from ps_p2p.protocols.committee_directory import (
    ERROR_REFUSED,
    CommitteeDirectoryService,
    register_with_committee,
)
from ps_p2p.protocols.framing import encode_varint
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.registry import execution
from ps_p2p.registry.directory import DirectoryHistory
from ps_p2p.registry.sources import OTHER_NETWORK, NewIdentityLimiter
from ps_p2p.testing.committee import MemoryCommittee

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


def rec(who: Identity, *, net: int, issued: int = T0, lifetime: int = HOUR) -> NodeRecord:
    """A record of ``who`` claiming an address in the /24 numbered ``net``."""
    return sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.{1 + net // 256}.{net % 256}.1/tcp/4001",),
        frozenset({Role.USER}), ONION, issued_at_ms=issued, expires_at_ms=issued + lifetime))


def reg(who: Identity, **kwargs) -> bytes:
    return app.encode_tx(app.RegisterTx(rec(who, **kwargs)))


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

    monkeypatch.setattr(execution, "check_record", no_signature_checks)
    monkeypatch.setattr(execution, "verify_signature", no_signature_checks)
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


# ---------------------------------------------------------------------------------- sources


def test_new_identities_from_one_observed_network_get_a_burst_then_a_rate():
    limiter = NewIdentityLimiter(per_minute=2, burst=3)
    net = limiter.network_of("203.0.113.9")
    assert net == "ip4:203.0.113.0/24" == limiter.network_of("203.0.113.200")
    for _ in range(3):
        limiter.check(net, 0.0)
        limiter.charge(net, 0.0)
    with pytest.raises(AdmissionError, match="too many new identities from ip4:203.0.113.0/24"):
        limiter.check(net, 10.0)
    limiter.check(limiter.network_of("203.0.114.9"), 10.0)  # another /24 has its own bucket
    limiter.check(net, 30.0)  # one token back after 30 s at 2 a minute
    assert limiter.refused == 1


def test_loopback_sources_are_exempt_and_sources_without_ip_share_one_network():
    limiter = NewIdentityLimiter(burst=1)
    for host in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"):
        assert limiter.network_of(host) is None
    for _ in range(5):
        limiter.check(None, 0.0)
        limiter.charge(None, 0.0)
    assert len(limiter) == 0
    assert limiter.network_of(None) == limiter.network_of("not-an-ip") == OTHER_NETWORK
    assert limiter.network_of("2001:db8:1:2::5") == "ip6:2001:db8:1::/48"
    assert limiter.network_of("::ffff:198.51.100.4") == "ip4:198.51.100.0/24"


def test_the_limiter_remembers_a_bounded_number_of_networks():
    limiter = NewIdentityLimiter(burst=1, max_networks=2)
    for i in range(5):
        limiter.charge(limiter.network_of(f"198.51.{i}.1"), 0.0)
    assert len(limiter) == 2


def answer(frame: bytes) -> directory_pb2.CommitteeDirectoryResponse:
    for skip in range(1, 4):  # the unsigned-varint length prefix
        if encode_varint(len(frame) - skip) == frame[:skip]:
            return directory_pb2.CommitteeDirectoryResponse.FromString(frame[skip:])
    raise AssertionError("not a frame")


def test_the_directory_limits_new_identities_by_the_connections_network_not_the_claimed_one(
        listed):
    taken = []
    now = [0.0]
    service = CommitteeDirectoryService(lambda: DirectoryHistory(listed), taken.append,
                                        new_identities=NewIdentityLimiter(burst=4),
                                        clock=lambda: now[0])
    source = ("203.0.113.9", 4001)
    for i in range(1, 5):  # each claims a fresh /24: the committed caps never see them
        record = rec(node(i), net=i)
        assert answer(service.register(record, record.peer_id, source)).WhichOneof("kind") == "ack"
    record = rec(node(5), net=5)
    refused = answer(service.register(record, record.peer_id, source))
    assert refused.error.code == ERROR_REFUSED
    assert "too many new identities from ip4:203.0.113.0/24" in refused.error.message
    renewal = rec(node(0), net=100, issued=T0 + SECOND)  # a listed peer: never limited
    assert answer(service.register(renewal, renewal.peer_id, source)).WhichOneof("kind") == "ack"
    assert answer(service.register(record, record.peer_id, ("198.51.100.1", 1))).WhichOneof(
        "kind") == "ack"
    now[0] = 30.0
    assert answer(service.register(record, record.peer_id, source)).WhichOneof("kind") == "ack"
    assert len(taken) == 7


async def test_a_registration_over_a_real_connection_is_charged_to_its_remote_address(listed):
    seen = []

    class Spy(CommitteeDirectoryService):
        def register(self, record, sender, source=None):
            seen.append(source)
            return super().register(record, sender, source)

    verifier = Identity.from_private_bytes(b"\x51" * 32)
    me = node(7)
    service = Spy(lambda: DirectoryHistory(listed), lambda tx: True)
    async with open_host(verifier, ["/ip4/127.0.0.1/tcp/0"]) as server, \
            open_host(me, ["/ip4/127.0.0.1/tcp/0"]) as client, trio.open_nursery() as nursery:
        await nursery.start(service.serve, server)
        await connect(client, listen_multiaddrs(server)[0])
        with trio.fail_after(10):
            await register_with_committee(client, verifier.peer_id, rec(me, net=7))
        nursery.cancel_scope.cancel()
    assert seen and seen[0] is not None and seen[0][0] == "127.0.0.1"
    assert len(service.new_identities) == 0  # loopback: exempt


# ---------------------------------------------------------------------------------- lifetimes


def test_the_default_record_outlives_ten_renewal_intervals():
    from ps_p2p.config import NodeConfig

    config = NodeConfig()
    assert config.record_lifetime >= 10 * config.register_interval


def test_an_older_record_is_refused_after_the_short_withdrawal_record_that_replaced_it_expired():
    old = reg(node(0), net=100)  # public: every directory served it
    state = run(app.genesis_state(GENESIS), [old])
    withdrawal = reg(node(0), net=100, issued=T0 + SECOND, lifetime=2 * SECOND)
    state = run(state, [withdrawal])
    assert state.departed == {node(0).peer_id: T0 + SECOND}
    state = run(state, [])  # the short record expired
    state = run(state, [])
    assert node(0).peer_id not in state.records
    with pytest.raises(InvalidTransactionError, match="not newer than its deregistration"):
        app.check_tx(old, state, state.time_ms)
    newer = reg(node(0), net=100, issued=state.time_ms)  # the node itself may come back
    assert app.check_tx(newer, state, state.time_ms)


def test_a_renewal_that_does_not_shorten_the_record_leaves_no_tombstone(listed):
    state = run(listed, [reg(node(0), net=100, issued=T0 + SECOND)])
    assert state.departed == {}


# ---------------------------------------------------------------------------------- committee


def test_a_committee_flooded_with_new_identities_still_takes_and_commits_a_renewal():
    keys = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(4)]
    genesis = app.Genesis(CHAIN, T0, tuple(Validator(k.peer_id) for k in keys))  # default policy
    net = MemoryCommittee(keys, genesis)
    honest = node(0)
    net.route(0, net.vals[0].add_tx(reg(honest, net=3000), net.now))
    assert net.run_until(lambda: all(honest.peer_id in v.state.records for v in net.vals))
    flood = app.Mempool().max_new + 64
    refused = 0
    for i in range(flood):  # fresh identities, each claiming a fresh /24
        try:
            net.route(0, net.vals[0].add_tx(reg(node(10_000 + i), net=i), net.now))
        except AdmissionError:
            refused += 1
    assert refused > 0  # the NEW lane is full...
    renewal = rec(honest, net=3000, issued=T0 + 5 * SECOND)
    renewal_tx = app.encode_tx(app.RegisterTx(renewal))
    net.route(0, net.vals[0].add_tx(renewal_tx, net.now))  # ...the LISTED lane is not
    assert net.run_until(lambda: all(v.state.records.get(honest.peer_id) == renewal
                                     for v in net.vals))
    assert net.vals[0].mempool.lane_size(app.Lane.NEW) > 0  # committed ahead of the sybils
