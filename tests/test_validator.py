"""The validator glue (ps_p2p.registry.validator) without libp2p: 4 validators exchange their
actions in memory on a fake clock. Blocks, WAL refusal of a second value, restart from the store."""

from __future__ import annotations

import hashlib

import pytest

from ps_p2p import registry as app
from ps_p2p.consensus.block import block_id, decode_block
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.signing import verify_commit
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator as Member
from ps_p2p.consensus.types import Vote, VoteType
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import DoubleSignError, LocalProtocolError
from ps_p2p.keys import Identity
from ps_p2p.protocols.consensus import WIRE
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.registry.validator import SendMessage, Validator
from ps_p2p.testing.committee import MemoryCommittee

CHAIN = "validator-test"
T0 = 1_700_000_000_000
KEYS = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(4)]
GENESIS = app.Genesis(CHAIN, T0, tuple(Member(k.peer_id) for k in KEYS))
FAST = ConsensusConfig(timeout_propose=0.2, timeout_prevote=0.2, timeout_precommit=0.2,
                       timeout_propose_delta=0.1, timeout_prevote_delta=0.1,
                       timeout_precommit_delta=0.1)
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public


def register_tx(i: int, issued: int = T0) -> bytes:
    who = Identity.from_private_bytes(hashlib.sha256(b"node %d" % i).digest())
    record = sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.0.{i}.1/tcp/4001",), frozenset({Role.USER}), ONION,
        issued_at_ms=issued, expires_at_ms=issued + 3_600_000))
    return app.encode_tx(app.RegisterTx(record))


class Net(MemoryCommittee):
    """4 validators on a fake clock; every SendMessage/RelayTx reaches the others."""

    def __init__(self, stores=None, down=()):
        super().__init__(KEYS, GENESIS, consensus=FAST, stores=stores, down=down)

    def run_until(self, cond, limit: float = 30.0) -> bool:
        assert super().run_until(cond, limit), "no progress"
        return True


def test_four_validators_commit_a_transaction_and_agree():
    net = Net()
    tx = register_tx(1)
    net.route(0, net.vals[0].add_tx(tx, net.now))
    net.run_until(lambda: all(any(tx in c.block.txs for c in cs) for cs in net.committed))
    height = max(c.height for c in net.committed[0] if tx in c.block.txs)
    net.run_until(lambda: all(v.committed_height >= height for v in net.vals))
    hashes = {v.state.app_hash for v in net.vals if v.committed_height == height}
    assert len(hashes) == 1
    for v in net.vals:
        raw, commit = v.store.block(height)
        block = decode_block(raw, GENESIS.limits)
        verify_commit(CHAIN, GENESIS.validators, height, block_id(block.header),
                      WIRE.decode_commit(commit))
        assert len(v.state.records) == 1
        assert v.store.signed_at(v.height + 1) == []


def test_the_wal_refuses_a_second_value_at_one_height_round_and_step():
    store = ConsensusStore(":memory:")
    v = Validator(KEYS[0], GENESIS, store, WIRE, FAST)
    v.start(0.0)
    h = v.height
    first = Vote(VoteType.PREVOTE, h, 7, b"\x01" * 32, KEYS[0].peer_id)
    second = Vote(VoteType.PREVOTE, h, 7, b"\x02" * 32, KEYS[0].peer_id)
    from ps_p2p.consensus.signing import sign_vote
    from ps_p2p.consensus.types import BroadcastVote, Step
    queue, actions = [], []
    v._execute(BroadcastVote(first), 0.0, queue, actions)
    assert [type(a) for a in actions] == [SendMessage] and len(queue) == 1
    queue, actions = [], []
    v._execute(BroadcastVote(second), 0.0, queue, actions)
    assert actions == [] and queue == [] and v.stats.double_sign_refused == 1
    # the store itself refuses too
    signed = sign_vote(KEYS[0], CHAIN, second)
    with pytest.raises(DoubleSignError):
        store.record_signed(h, 7, int(Step.PREVOTE), second.value_id, WIRE.encode_message(signed))
    # the same value again is a retransmission: allowed, the same bytes
    queue, actions = [], []
    v._execute(BroadcastVote(first), 0.0, queue, actions)
    assert len(actions) == 1 and v.stats.double_sign_refused == 1


def test_a_restarted_validator_replays_its_wal_and_rebuilds_its_state(tmp_path):
    stores = [ConsensusStore(tmp_path / f"v{i}.sqlite") for i in range(4)]
    net = Net(stores)
    tx = register_tx(2)
    net.route(1, net.vals[1].add_tx(tx, net.now))
    net.run_until(lambda: all(v.committed_height >= 3 for v in net.vals))
    v0 = net.vals[0]
    # stop it once it has signed something at the height it is deciding
    net.run_until(lambda: len(v0.store.signed_at(v0.height)) >= 2)
    own = list(v0.own_messages(rounds=100))
    assert own
    h, app_hash = v0.committed_height, v0.state.app_hash
    # restart validator 0 from its store: the same state and the same own messages, resent
    stores[0].close()
    stores[0] = ConsensusStore(tmp_path / "v0.sqlite")
    net.stores = stores
    fresh = net.make(0)
    actions = fresh.start(net.now)
    assert fresh.committed_height == h and fresh.state.app_hash == app_hash
    assert len(fresh.state.records) == 1
    resent = [a.message for a in actions if isinstance(a, SendMessage)]
    assert set(own) <= set(resent)
    assert fresh.stats.wal_replayed == len(fresh.store.signed_at(h + 1))
    net.vals[0] = fresh
    net.route(0, actions)
    net.run_until(lambda: all(v.committed_height >= h + 3 for v in net.vals))
    # it caught up (by sync when the others had decided without it) and signs again
    assert fresh.stats.votes_signed > 0


def test_a_validator_outside_the_genesis_is_refused():
    with pytest.raises(LocalProtocolError, match="not a validator"):
        Validator(Identity.from_private_bytes(b"\x09" * 32), GENESIS, ConsensusStore(":memory:"),
                  WIRE)


def test_a_validator_restarted_after_locking_a_value_keeps_its_lock(tmp_path):
    """Algorithm 1 locks the value a validator precommits (L36-42); the lock must survive a
    crash, or the restarted validator could prevote another value later in the height."""
    from ps_p2p.consensus.types import Step

    stores = [ConsensusStore(tmp_path / f"v{i}.sqlite") for i in range(4)]
    net = Net(stores)
    v0 = net.vals[0]
    height = v0.height

    def precommitted() -> list:
        return [s for s in v0.store.signed_at(height)
                if s.step == Step.PRECOMMIT and s.value_id is not None]

    net.run_until(lambda: bool(precommitted()))  # stop right after its precommit is written
    (signed,) = precommitted()
    assert signed.locked is not None and v0.config.value_id(signed.locked) == signed.value_id
    assert v0.core.state().locked_round == signed.round
    stores[0].close()
    stores[0] = ConsensusStore(tmp_path / "v0.sqlite")
    net.stores = stores
    fresh = net.make(0)
    fresh.start(net.now)
    state = fresh.core.state()
    assert fresh.height == height and fresh.stats.locks_restored == 1
    assert (state.locked_value, state.locked_round) == (signed.locked, signed.round)
    assert (state.valid_value, state.valid_round) == (signed.locked, signed.round)


def test_a_restarted_locked_validator_keeps_the_polka_behind_its_lock_for_its_reproposal(
        tmp_path):
    """Issue 17 (simulator seeds 2268, 2529, 5802, 9265): the 2f+1 prevotes that made a
    validator lock (L36) are written with its precommit and replayed as received votes on a
    restart, so its re-proposal of the locked value (L16, validRound) carries them as its POL
    certificate (what the service sends with it) and the others can accept it (L28), even
    when one of those prevotes reached only this validator."""
    from ps_p2p.consensus.signing import has_quorum, verify_vote
    from ps_p2p.consensus.types import Proposal, Step

    stores = [ConsensusStore(tmp_path / f"v{i}.sqlite") for i in range(4)]
    net = Net(stores)
    v0 = net.vals[0]
    height = v0.height

    def precommitted() -> list:
        return [s for s in v0.store.signed_at(height)
                if s.step == Step.PRECOMMIT and s.value_id is not None]

    net.run_until(lambda: bool(precommitted()))
    (signed,) = precommitted()
    assert len(signed.certificate) >= 3
    stores[0].close()
    stores[0] = ConsensusStore(tmp_path / "v0.sqlite")
    net.stores = stores
    fresh = net.make(0)
    fresh.start(net.now)
    reproposal = Proposal(height, signed.round + 1, signed.locked, signed.round, fresh.address)
    certificate = fresh.pol_certificate(reproposal)
    assert {WIRE.encode_message(v) for v in certificate} == set(signed.certificate)
    others = {v.validator for v in certificate} - {fresh.address}
    assert len(others) >= 2  # not only its own replayed prevote
    for vote in certificate:
        assert (vote.type, vote.height, vote.round, vote.value_id) == (
            VoteType.PREVOTE, height, signed.round, signed.value_id)
        verify_vote(CHAIN, vote)
    assert has_quorum(len(certificate), len(KEYS))


# ------------------------------------------------------------------ state snapshots (issue 17)


def _snapshot_net(tmp_path, **options):
    stores = [ConsensusStore(tmp_path / f"v{i}.sqlite") for i in range(4)]
    net = MemoryCommittee(KEYS, GENESIS, consensus=FAST, stores=stores,
                          validator_options=options)
    net.route(1, net.vals[1].add_tx(register_tx(3), net.now))
    assert net.run_until(lambda: all(v.committed_height >= 10 for v in net.vals), 60.0)
    return net, stores


def _restart(net, stores, tmp_path, i=0, **options):
    h, app_hash = net.vals[i].committed_height, net.vals[i].state.app_hash
    stores[i].close()
    stores[i] = ConsensusStore(tmp_path / f"v{i}.sqlite")
    fresh = Validator(KEYS[i], GENESIS, stores[i], WIRE, FAST, **options)
    fresh.start(net.now)
    assert fresh.committed_height == h and fresh.state.app_hash == app_hash
    assert len(fresh.state.records) == 1
    return fresh, h


def test_a_restart_loads_the_newest_snapshot_and_executes_only_the_later_blocks(tmp_path):
    net, stores = _snapshot_net(tmp_path, snapshot_every=4)
    kept = [h for h, _ in stores[0].snapshots()]
    assert len(kept) == 2 and all(h % 4 == 0 for h in kept)  # the newest two
    fresh, h = _restart(net, stores, tmp_path, snapshot_every=4)
    newest = max(s for s, _ in stores[0].snapshots() if s < h)
    assert fresh.stats.snapshot_height == newest  # not the genesis: h - newest blocks executed
    # the directory is served at once (one block executed after the snapshot)
    assert fresh.history.served is not None and fresh.history.header.height == h


def test_a_snapshot_that_does_not_give_its_app_hash_is_skipped(tmp_path):
    net, stores = _snapshot_net(tmp_path, snapshot_every=4)
    h = net.vals[0].committed_height
    newest = max(s for s, _ in stores[0].snapshots() if s < h)
    data = bytearray(stores[0].snapshot(newest))
    data[-1] ^= 1  # one bit of the epoch ledger's bytes
    stores[0]._db.execute("UPDATE snapshots SET state=? WHERE height=?", (bytes(data), newest))
    fresh, _ = _restart(net, stores, tmp_path, snapshot_every=4)
    assert fresh.stats.snapshot_height < newest  # the older one, or the genesis


def test_blocks_are_pruned_below_the_snapshots_and_a_restart_still_works(tmp_path):
    net, stores = _snapshot_net(tmp_path, snapshot_every=3, keep_blocks=2)
    first = stores[0].first_height()
    oldest = min(s for s, _ in stores[0].snapshots())
    assert first > 1 and first == oldest + 1  # nothing a restart needs is gone
    fresh, _ = _restart(net, stores, tmp_path, snapshot_every=3, keep_blocks=2)
    assert fresh.stats.snapshot_height >= oldest
    # block sync does not serve pruned heights (an empty answer, not later blocks)
    from ps_p2p.protocols import consensus_codec as cc
    from ps_p2p.protocols.blocksync import BlockSyncServer
    blocks, _ = cc.decode_sync_response(BlockSyncServer(stores[0], allow=lambda p: True)
                                        .response(1, 16))
    assert blocks == []


def test_a_store_pruned_without_a_usable_snapshot_is_refused(tmp_path):
    net, stores = _snapshot_net(tmp_path, snapshot_every=3, keep_blocks=2)
    stores[0]._db.execute("DELETE FROM snapshots")
    stores[0].close()
    stores[0] = ConsensusStore(tmp_path / "v0.sqlite")
    from ps_p2p.errors import StoreError
    with pytest.raises(StoreError, match="no state snapshot"):
        Validator(KEYS[0], GENESIS, stores[0], WIRE, FAST).start(0.0)


def test_a_state_snapshot_round_trips_and_refuses_a_changed_byte(tmp_path):
    from ps_p2p.registry.snapshot import decode_state, encode_state
    from ps_p2p.errors import RemoteProtocolError
    net, _ = _snapshot_net(tmp_path, snapshot_every=0)
    state = net.vals[0].state
    data = encode_state(state)
    back = decode_state(data, app.genesis_state(GENESIS))
    assert back.app_hash == state.app_hash and back.height == state.height
    assert encode_state(back) == data
    for i in (len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(RemoteProtocolError):
            decode_state(bytes(bad), app.genesis_state(GENESIS))


# ------------------------------------------------------------------ empty blocks (issue 17)


def _record_tx(i: int, expires: int) -> bytes:
    who = Identity.from_private_bytes(hashlib.sha256(b"expiring %d" % i).digest())
    record = sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.1.{i}.1/tcp/4001",), frozenset({Role.USER}), ONION,
        issued_at_ms=T0, expires_at_ms=expires))
    return app.encode_tx(app.RegisterTx(record))


def test_an_idle_chain_waits_the_interval_and_a_transaction_makes_a_block_at_once():
    net = MemoryCommittee(KEYS, GENESIS, consensus=FAST, empty_block_interval=30.0)
    assert net.run_until(lambda: all(v.committed_height >= 1 for v in net.vals), 5.0)
    assert not net.run_until(lambda: any(v.committed_height >= 2 for v in net.vals), 25.0)
    before = net.now
    tx = register_tx(5)
    net.route(2, net.vals[2].add_tx(tx, net.now))
    assert net.run_until(lambda: all(len(v.state.records) == 1 for v in net.vals), before + 3.0)


def test_an_idle_chain_makes_a_block_when_a_listed_record_expires():
    """Block time is the chain's only clock: an expired record leaves at the next block, so an
    idle proposer does not wait its whole interval past an expiry."""
    net = MemoryCommittee(KEYS, GENESIS, consensus=FAST, empty_block_interval=30.0,
                          genesis_offset_ms=1000)
    expires = T0 + 1000 + 8_000  # the validators' clock at now = 8 s
    net.route(0, net.vals[0].add_tx(_record_tx(1, expires), net.now))
    assert net.run_until(lambda: all(len(v.state.records) == 1 for v in net.vals), 5.0)
    assert net.run_until(lambda: all(len(v.state.records) == 0 for v in net.vals), 12.0)


def test_the_default_interval_keeps_an_idle_directory_fresh():
    from ps_p2p.config import NodeConfig
    from ps_p2p.registry.directory import MAX_DIRECTORY_AGE_MS
    from ps_p2p.registry.validator import EMPTY_BLOCK_INTERVAL
    assert NodeConfig().block_interval == EMPTY_BLOCK_INTERVAL >= 10  # not a block a second
    # the newest header of an idle chain is at most one interval (plus a commit and a
    # refresh) old: a node accepts it with a wide margin
    assert EMPTY_BLOCK_INTERVAL * 1000 * 10 <= MAX_DIRECTORY_AGE_MS


def test_a_block_that_changes_the_state_is_followed_soon_by_the_one_that_commits_its_hash():
    """The directory serves state h - 1 with header h: after a registration's block the next
    block must not wait the idle interval, or the node stays unlisted that long."""
    net = MemoryCommittee(KEYS, GENESIS, consensus=FAST, empty_block_interval=30.0)
    assert net.run_until(lambda: all(v.committed_height >= 1 for v in net.vals), 5.0)
    net.route(0, net.vals[0].add_tx(register_tx(6), net.now))
    assert net.run_until(lambda: all(len(v.state.records) == 1 for v in net.vals), 5.0)
    h = net.vals[0].committed_height
    assert net.run_until(lambda: all(v.committed_height >= h + 1 for v in net.vals),
                         net.now + 3.0)
    assert all(v.history.served is not None and len(v.history.served.records) == 1
               for v in net.vals)


def test_an_idle_validator_waits_no_longer_than_the_epochs_next_attempt():
    """The epochs' leader attempts run on block time (ledger.py): an idle chain must make a
    block at the next attempt's start, not an interval later; never sooner than 1 s."""
    from ps_p2p.verification.ledger import EpochLedger, VerificationParams
    params = VerificationParams(model_id="m", pool_sha256="00" * 32, pool_size=4,
                                attempt_ms=10_000)
    genesis = app.Genesis(CHAIN, T0, GENESIS.validators, verification=params)
    clock = {"ms": T0 + 1000}
    v = Validator(KEYS[0], genesis, ConsensusStore(":memory:"), WIRE, FAST,
                  empty_block_interval=30.0, unix_ms=lambda: clock["ms"])
    assert v.idle_delay() == 30.0  # epoch not started: nothing due
    state = v.state.copy()
    state.time_ms = T0 + 1000
    state.ledger = EpochLedger(anchor=b"\x01" * 32, start_ms=T0, eligible=GENESIS.validators)
    v.state = state
    assert v.idle_delay() == pytest.approx(9.001)  # attempt 1 starts at T0 + 10 s
    clock["ms"] = T0 + 9_900
    assert v.idle_delay() == 1.0  # due in 0.1 s, but at least MIN_IDLE_DELAY


def _signed_block_proposal(v: Validator, round_: int, time_ms: int, pol_round: int = -1):
    """A proposal of (v.height, round_) by that round's proposer, holding an empty block."""
    from ps_p2p.consensus.block import encode_block, make_block
    from ps_p2p.consensus.signing import sign_proposal
    from ps_p2p.consensus.types import Proposal
    proposer = v.core.proposer(v.height, round_)
    key = next(k for k in KEYS if k.peer_id == proposer)
    s = v.state
    block = make_block(chain_id=CHAIN, height=v.height, time_ms=time_ms,
                       prev_block_id=s.block_id, app_hash=s.app_hash, proposer=proposer)
    raw = encode_block(block)
    return sign_proposal(key, CHAIN, Proposal(v.height, round_, raw, pol_round, proposer)), raw


def _signed_vote(who: Identity, t: VoteType, h: int, r: int, vid):
    from ps_p2p.consensus.signing import sign_vote
    return sign_vote(who, CHAIN, Vote(t, h, r, vid, who.peer_id))


def _sent_votes(actions, t: VoteType, r: int):
    return [a.message.value_id for a in actions if isinstance(a, SendMessage)
            and isinstance(a.message, Vote) and a.message.type == t and a.message.round == r]


def test_a_late_fresh_proposal_is_refused_only_at_l22_not_when_re_proposed_with_its_pol():
    """Issue 17 finding 1: a validator restarted 28 s late saw the round-0 proposal "28438 ms
    behind our clock" and refused that value for the whole height, so it prevoted nil on every
    re-proposal (L28-L32) while the locked validators prevoted nil (L29): halt. Timeliness is
    the arrival check of a fresh proposal (L22), never valid(v)."""
    clock = {"ms": T0 + 1000 + 28_438}
    h = 1
    probe = Validator(KEYS[0], GENESIS, ConsensusStore(":memory:"), WIRE, FAST)
    probe.start(0.0)
    p0, p1 = probe.core.proposer(h, 0), probe.core.proposer(h, 1)
    me = next(k for k in KEYS if k.peer_id not in (p0, p1))
    others = [k for k in KEYS if k is not me]
    v = Validator(me, GENESIS, ConsensusStore(":memory:"), WIRE, FAST,
                  unix_ms=lambda: clock["ms"])
    v.start(0.0)
    fresh, raw = _signed_block_proposal(v, 0, T0 + 1000)
    vid = v.config.value_id(raw)
    actions = v.receive(fresh, 0.0)
    assert _sent_votes(actions, VoteType.PREVOTE, 0) == [None]  # L22-L26: late, prevote nil
    # round 1: the proposer re-proposes the value with POL round 0 (L16), then the polka
    again = dataclasses_replace_proposal(v, raw, 1, 0)
    actions = v.receive(again, 0.1)
    p1_key = next(k for k in KEYS if k.peer_id == p1)
    third = next(k for k in others if k is not p1_key)
    actions += v.receive(_signed_vote(third, VoteType.PREVOTE, h, 1, vid), 0.1)  # L55: f+1
    for k in others:
        actions += v.receive(_signed_vote(k, VoteType.PREVOTE, h, 0, vid), 0.2)
    assert v.core.round == 1
    assert _sent_votes(actions, VoteType.PREVOTE, 1) == [vid]  # L28-L30
    assert v.stats.untimely == 1 and v.stats.values_refused == 0


def dataclasses_replace_proposal(v: Validator, raw: bytes, round_: int, pol_round: int):
    from ps_p2p.consensus.signing import sign_proposal
    from ps_p2p.consensus.types import Proposal
    proposer = v.core.proposer(v.height, round_)
    key = next(k for k in KEYS if k.peer_id == proposer)
    return sign_proposal(key, CHAIN, Proposal(v.height, round_, raw, pol_round, proposer))
