"""The consensus service (ps_p2p.protocols.consensus) among real py-libp2p hosts on loopback:
a committee commits transactions, a killed validator restarts from its store and catches up by
block sync, and bad input is refused and counted while the committee keeps committing."""

from __future__ import annotations

import hashlib

import pytest
import trio
from libp2p.peer.id import ID

from ps_p2p import registry as app
from ps_p2p.consensus.block import (
    block_id,
    decode_block,
    encode_block,
    make_block,
)
from ps_p2p.consensus.core import proposer_cycle
from ps_p2p.consensus.signing import sign_proposal, sign_vote, verify_commit
from ps_p2p.consensus.types import Proposal, Validator, Vote, VoteType
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.keys import Identity
from ps_p2p.protocols import consensus_codec as cc
from ps_p2p.protocols.blocksync import fetch_blocks
from ps_p2p.protocols.consensus import CONSENSUS_PROTOCOL_ID, ConsensusServiceConfig
from ps_p2p.protocols.framing import encode_frame
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.testing.committee import LocalCommittee

ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public


def register_tx(i: int) -> tuple[Identity, bytes]:
    """A REGISTER transaction of node ``i``'s record, signed by its own node key."""
    import time

    who = Identity.from_private_bytes(hashlib.sha256(b"node %d" % i).digest())
    now = time.time_ns() // 1_000_000
    record = sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.1.{i}.1/tcp/4001",), frozenset({Role.USER}), ONION,
        issued_at_ms=now - 1000, expires_at_ms=now + 3_600_000))
    return who, app.encode_tx(app.RegisterTx(record))


async def wait_listed(committee: LocalCommittee, peer_id: bytes) -> int:
    """Wait until every running member lists ``peer_id``; the highest height that took."""
    for m in committee.running():
        while peer_id not in m.service.validator.state.records:
            await m.service.wait_committed(m.service.validator.committed_height + 1)
    return max(m.service.validator.committed_height for m in committee.running())


def check_stores_agree(committee: LocalCommittee, upto: int) -> None:
    """Every running member stored the same block at each height <= ``upto``, with a commit
    that verifies, and reported the same app hash after it."""
    g = committee.genesis
    for h in range(1, upto + 1):
        blocks = {m.service.validator.store.block(h)[0] for m in committee.running()}
        assert len(blocks) == 1, f"members disagree at height {h}"
        block = decode_block(blocks.pop(), g.limits)
        for m in committee.running():
            commit = cc.decode_commit(m.service.validator.store.block(h)[1])
            verify_commit(g.chain_id, g.validators, h, block_id(block.header), commit)
    hashes: dict[int, set[bytes]] = {}
    for m in committee.members:
        for c in m.commits:
            hashes.setdefault(c.height, set()).add(c.result.app_hash)
    assert all(len(v) == 1 for v in hashes.values())


async def test_four_validators_commit_a_registration_and_agree(tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(empty_block_interval=5.0))
        with trio.fail_after(60):
            await committee.start_all()
            await committee.wait_committed(1)
            who, tx = register_tx(1)
            assert committee.members[0].service.submit_tx(tx)
            height = await wait_listed(committee, who.peer_id)
            await committee.wait_committed(height)
        check_stores_agree(committee, height)
        states = [m.service.validator.state for m in committee.running()]
        at = {s.height: s.app_hash for s in states}
        assert all(s.records.get(who.peer_id) is not None for s in states)
        # app hashes after the same height agree (also checked per commit above)
        assert len({s.app_hash for s in states if s.height == min(at)}) == 1
        for m in committee.running():
            assert m.service.refused.get("bad signature", 0) == 0
            assert m.service.validator.stats.double_sign_refused == 0
        nursery.cancel_scope.cancel()


async def test_a_killed_validator_restarts_from_its_store_syncs_and_signs_again(tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(empty_block_interval=0.1))
        victim = committee.members[3]
        with trio.fail_after(120):
            await committee.start_all()
            await committee.wait_committed(2)
            await committee.kill(victim)
            down_at = max(c.height for c in victim.commits)
            # the other three (2f+1) keep committing, transactions included
            who, tx = register_tx(2)
            committee.members[0].service.submit_tx(tx)
            await wait_listed(committee, who.peer_id)
            await committee.wait_committed(down_at + 5)
            await committee.start(victim)
            service = victim.service
            assert service.validator.committed_height >= down_at  # restored from its store
            target = max(m.service.validator.committed_height for m in committee.running()) + 2
            await committee.wait_committed(target)
            assert service.validator.stats.blocks_synced > 0
            assert who.peer_id in service.validator.state.records
            # it signs again: its precommits are in commits of later heights
            def signed_by_victim() -> list[int]:
                return [c.height for m in committee.running() for c in m.commits
                        if c.height > target - 2
                        and any(v.validator == victim.peer_id for v in c.commit)]
            while not signed_by_victim():
                await committee.wait_committed(
                    committee.members[0].service.validator.committed_height + 1)
        check_stores_agree(committee, target)
        assert service.validator.stats.double_sign_refused == 0
        nursery.cancel_scope.cancel()


async def _send_frames(host, peer: bytes, frames: list[bytes]) -> None:
    """Write ``frames`` on one new consensus stream and wait until the peer resets it."""
    stream = await host.new_stream(ID(peer), [CONSENSUS_PROTOCOL_ID])
    await stream.write(b"".join(encode_frame(f) for f in frames))
    with trio.fail_after(10):
        try:
            while await stream.read(65536):
                pass
        except Exception:  # reset or EOF: the peer dropped the stream
            pass


async def test_bad_input_is_refused_counted_and_the_committee_keeps_committing(tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(empty_block_interval=60.0))
        target, sender = committee.members[0], committee.members[1]
        g = committee.genesis
        with trio.fail_after(60):
            await committee.start_all()
            await committee.wait_committed(1)
            service = target.service
            h = service.validator.height  # idle: waits for a transaction
            garbage = b"\xff" * 7  # not a protobuf message: resets the stream, after the rest

            # a vote whose signature does not verify
            vote = sign_vote(sender.identity, g.chain_id,
                             Vote(VoteType.PREVOTE, h, 0, None, sender.peer_id))
            bad = Vote(vote.type, vote.height, vote.round, vote.value_id, vote.validator,
                       bytes(64))
            await _send_frames(sender.host, target.peer_id, [cc.encode_message(bad)])
            assert service.refused["bad signature"] == 1

            # a vote signed by a key outside the committee
            outsider = Identity.from_private_bytes(b"\x05" * 32)
            foreign = sign_vote(outsider, g.chain_id,
                                Vote(VoteType.PREVOTE, h, 0, None, outsider.peer_id))
            await _send_frames(sender.host, target.peer_id, [cc.encode_message(foreign)])
            assert service.refused["signer not a validator"] == 1

            # a host outside the committee may not speak the protocol at all
            async with open_host(outsider, ["/ip4/127.0.0.1/tcp/0"]) as stranger:
                await connect(stranger, listen_multiaddrs(target.host)[0])
                await _send_frames(stranger, target.peer_id, [cc.encode_message(vote)])
            assert service.refused["peer not a validator"] == 1

            # a validly signed vote far in the future: dropped (no reset), block sync asked
            future = sign_vote(sender.identity, g.chain_id,
                               Vote(VoteType.PREVOTE, h + 50, 0, None, sender.peer_id))
            await _send_frames(sender.host, target.peer_id, [cc.encode_message(future), garbage])
            assert service.refused["future height"] == 1
            assert service.refused["malformed"] == 1

            # a proposal of the round's proposer whose block does not follow the chain
            cycle = proposer_cycle(g.validators)
            rnd = next(r for r in range(4) if cycle[(h + r) % len(cycle)] == sender.peer_id)
            state = service.validator.state
            block = make_block(chain_id=g.chain_id, height=h, time_ms=state.time_ms + 1,
                               prev_block_id=state.block_id, app_hash=bytes(32),  # wrong
                               proposer=sender.peer_id)
            proposal = sign_proposal(sender.identity, g.chain_id,
                                     Proposal(h, rnd, encode_block(block), -1, sender.peer_id))
            refused = service.validator.stats.values_refused
            await _send_frames(sender.host, target.peer_id,
                               [cc.encode_message(proposal), garbage])
            while service.validator.stats.values_refused == refused:
                await service.driver.wait_processed()
            assert "app hash" in service.validator.stats.last_refusal

            # the committee still commits
            who, tx = register_tx(3)
            target.service.submit_tx(tx)
            height = await wait_listed(committee, who.peer_id)
            await committee.wait_committed(height)
        check_stores_agree(committee, height)
        nursery.cancel_scope.cancel()


async def test_a_validators_useless_votes_skip_the_signature_check_and_outsiders_get_no_blocks(
        tmp_path):
    async with trio.open_nursery() as nursery:
        # two of four validators: no quorum, height 1 never ends (rounds move by timeouts)
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(min_sync_interval=3600.0))
        target, sender = committee.members[0], committee.members[1]
        g = committee.genesis
        with trio.fail_after(60):
            await committee.start(target)
            await committee.start(sender)
            service = target.service
            garbage = b"\xff" * 7  # resets the stream once the frames before it are handled

            def signed(round_: int, height: int = 1) -> Vote:
                return sign_vote(sender.identity, g.chain_id,
                                 Vote(VoteType.PREVOTE, height, round_, None, sender.peer_id))

            def forged(v: Vote) -> bytes:  # the same vote, its signature does not verify
                return cc.encode_message(
                    Vote(v.type, v.height, v.round, v.value_id, v.validator, bytes(64)))

            # the sender's two future rounds, and a far height (a block sync from it starts)
            await _send_frames(sender.host, target.peer_id, [
                cc.encode_message(signed(1000)), cc.encode_message(signed(1001)),
                cc.encode_message(signed(0, height=99)), garbage])
            keeper = service.validator.core.keeper
            while keeper.rounds()[-1] != 1001:
                await service.driver.wait_processed()
            assert service.refused["future height"] == 1

            # valid or not, these would change nothing: dropped before any signature check
            useless = [forged(signed(r)) for r in range(1002, 1010)] + [forged(signed(1000))]
            await _send_frames(sender.host, target.peer_id,
                               useless + [forged(signed(0, height=99)), garbage])
            assert service.refused["ignored"] == len(useless)
            assert service.refused["future height"] == 2
            assert service.refused["bad signature"] == 0
            await _send_frames(sender.host, target.peer_id, [forged(signed(0))])  # counts
            assert service.refused["bad signature"] == 1

            # block sync: a validator is served, a host listed nowhere is not
            served = service.blocksync.served
            blocks, latest = await fetch_blocks(
                sender.host, target.peer_id, 1, chain_id=g.chain_id,
                validators=g.validators, previous_block_id=None)
            assert (blocks, latest) == ([], 0)
            outsider = Identity.from_private_bytes(b"\x06" * 32)
            async with open_host(outsider, ["/ip4/127.0.0.1/tcp/0"]) as stranger:
                await connect(stranger, listen_multiaddrs(target.host)[0])
                with pytest.raises(Exception):
                    await fetch_blocks(stranger, target.peer_id, 1, chain_id=g.chain_id,
                                       validators=g.validators, previous_block_id=None)
            assert service.blocksync.not_allowed == 1
            assert service.blocksync.served == served + 1
        nursery.cancel_scope.cancel()


async def test_a_validator_snapshots_off_the_event_loop_and_restarts_from_the_snapshot(tmp_path):
    """Issue 17: the state snapshot is encoded in a worker thread and written on the loop; a
    restart loads it and executes only the blocks after it."""
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4, config=ConsensusServiceConfig(
            empty_block_interval=0.1, snapshot_every=3))
        victim = committee.members[3]
        with trio.fail_after(120):
            await committee.start_all()
            who, tx = register_tx(3)
            committee.members[0].service.submit_tx(tx)
            await wait_listed(committee, who.peer_id)
            await committee.wait_committed(8)
            while victim.service.snapshots_written < 2:
                await committee.wait_committed(
                    victim.service.validator.committed_height + 1, [victim])
            await committee.kill(victim)
            await committee.start(victim)
            v = victim.service.validator
            assert v.stats.snapshot_height >= 3 and v.stats.snapshot_height % 3 == 0
            assert who.peer_id in v.state.records
            await committee.wait_committed(v.committed_height + 2)
        nursery.cancel_scope.cancel()


async def test_an_own_vote_leaves_only_after_the_wal_fsync_that_runs_off_the_event_loop(
        tmp_path):
    """Issue 17: the WAL write is committed without its fsync, the fsync runs in a worker
    thread, and the signed vote is sent only once it returned (the invariant: durable before
    it leaves); messages behind it wait too, in order."""
    import threading

    from ps_p2p.consensus.store import ConsensusStore
    from ps_p2p.registry.validator import SendMessage
    from ps_p2p.protocols.consensus import ConsensusService

    key = Identity.from_private_bytes(b"\x01" * 32)
    other = Identity.from_private_bytes(b"\x02" * 32)  # the one peer the votes go to
    validators = sorted((Validator(key.peer_id), Validator(other.peer_id)),
                        key=lambda v: v.address)
    genesis = app.Genesis("fsync-test", 1_700_000_000_000, tuple(validators))

    class Host:
        def get_id(self):  # type: ignore[no-untyped-def]
            return ID(key.peer_id)

    both_sent = trio.Event()

    class Links:
        sent: list[bytes] = []

        def send(self, peer: bytes, data: bytes) -> bool:
            self.sent.append(data)
            if len(self.sent) == 2:
                both_sent.set()
            return True

    store = ConsensusStore(tmp_path / "c.sqlite")
    service = ConsensusService(Host(), key, genesis, store)  # type: ignore[arg-type]
    assert service.peers == (other.peer_id,)
    service._links = Links()  # type: ignore[assignment]
    gate, entered = threading.Event(), threading.Event()
    fsyncs: list[int] = []
    real = store.sync_target

    def gated():  # type: ignore[no-untyped-def]
        fsync = real()

        def run() -> None:
            entered.set()
            gate.wait(10)
            fsync()
            fsyncs.append(1)
        return run
    store.sync_target = gated  # type: ignore[method-assign]
    first = sign_vote(key, genesis.chain_id, Vote(VoteType.PREVOTE, 1, 0, None, key.peer_id))
    second = sign_vote(key, genesis.chain_id, Vote(VoteType.PRECOMMIT, 1, 0, None, key.peer_id))
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
        store.record_signed(1, 0, 1, None, cc.encode_message(first))
        assert store.needs_sync  # committed, not yet fsynced
        service._execute(SendMessage(first))
        await trio.to_thread.run_sync(entered.wait, 10)
        service._execute(SendMessage(second))  # durable already, but behind the first
        await trio.sleep(0)  # the event loop runs while the fsync is pending ...
        assert Links.sent == []  # ... and nothing left before it returned
        gate.set()
        with trio.fail_after(10):
            await both_sent.wait()
    assert fsyncs == [1] and service.fsyncs == 1
    assert Links.sent == [cc.encode_message(first), cc.encode_message(second)]
    store.close()
