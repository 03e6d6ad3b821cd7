"""Evidence with consequences (issue 17, finding 5): double proposals as evidence, committed
evidence excluding a validator from proposing and leading epochs, and validator-set changes by
a VALSET_UPDATE signed by more than 2/3 of the current power."""

from __future__ import annotations

import dataclasses

import pytest

from ps_p2p import registry as app
from ps_p2p.consensus.block import block_id, make_block
from ps_p2p.consensus.signing import sign_proposal, verify_commit
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Proposal, Validator
from ps_p2p.errors import InvalidCommitError, InvalidTransactionError
from ps_p2p.keys import Identity
from ps_p2p.protocols.consensus import WIRE
from ps_p2p.registry.validator import Validator as Validator_
from ps_p2p.testing.committee import MemoryCommittee
from ps_p2p.verification import ledger

CHAIN = "planetserve-evidence"
T0 = 1_700_000_000_000
SECOND = 1000
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 7)]
VALIDATORS = tuple(Validator(k.peer_id) for k in KEYS[:4])
GENESIS = app.Genesis(CHAIN, T0, VALIDATORS)
OUTSIDER = KEYS[5]


@pytest.fixture
def genesis():
    return app.genesis_state(GENESIS)


def run(state: app.AppState, txs, proposer: Identity = KEYS[0]):
    block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=state.time_ms + SECOND,
                       prev_block_id=state.block_id, app_hash=state.app_hash,
                       proposer=proposer.peer_id, txs=txs)
    return app.execute_block(state, block)


def errors(result) -> list[str | None]:
    return [None if r.ok else type(r.error).__name__ for r in result.tx_results]


# ---------------------------------------------------------------------------- proposal evidence


def proposal(key: Identity = KEYS[2], value: bytes = b"block A", *, height: int = 1,
             round_: int = 0, pol: int = -1) -> Proposal:
    return sign_proposal(key, CHAIN, Proposal(height, round_, value, pol, b""))


def double_proposal(key: Identity = KEYS[2], height: int = 1) -> app.ProposalEvidenceTx:
    return app.ProposalEvidenceTx.of(proposal(key, b"block A", height=height),
                                     proposal(key, b"block B", height=height))


def test_double_proposal_evidence_round_trips_and_is_recorded_once(genesis):
    evidence = double_proposal()
    tx = app.encode_tx(evidence)
    assert app.decode_tx(tx, 8192) == evidence
    assert evidence.first.value_hash < evidence.second.value_hash  # one encoding per pair
    state, result = run(genesis, [tx, tx])
    assert errors(result) == [None, "InvalidTransactionError"]
    assert list(state.evidence.values()) == [(KEYS[2].peer_id, 1)]
    assert state.excluded == {KEYS[2].peer_id}
    empty, _ = run(genesis, [])
    assert state.app_hash != empty.app_hash


def _swap(e: app.ProposalEvidenceTx) -> app.ProposalEvidenceTx:
    return app.ProposalEvidenceTx(e.second, e.first)


@pytest.mark.parametrize("make, match", [
    (lambda: _swap(double_proposal()), "not ascending"),
    (lambda: app.ProposalEvidenceTx(double_proposal().first, double_proposal().first),
     "not conflicting"),
    (lambda: app.ProposalEvidenceTx.of(proposal(KEYS[2], b"A"), proposal(KEYS[3], b"B")),
     "differs in proposer"),
    (lambda: app.ProposalEvidenceTx.of(proposal(value=b"A"), proposal(value=b"B", round_=1)),
     "differs in proposer, height or round"),
    (lambda: double_proposal(key=OUTSIDER), "not a validator"),
    (lambda: double_proposal(height=9), "future height"),
    (lambda: app.ProposalEvidenceTx(double_proposal().first, dataclasses.replace(
        double_proposal().second, signature=b"\x00" * 64)), "signature does not verify"),
    (lambda: app.ProposalEvidenceTx(double_proposal().first, dataclasses.replace(
        double_proposal().second, pol_round=0)), "POL round"),
])
def test_invalid_double_proposal_evidence_is_refused(make, match, genesis):
    with pytest.raises(InvalidTransactionError, match=match):
        app.check_tx(app.encode_tx(make()), genesis, T0)


def test_a_proposal_signed_for_another_chain_is_no_evidence(genesis):
    other = sign_proposal(KEYS[2], "another-chain", Proposal(1, 0, b"block B", -1, b""))
    with pytest.raises(InvalidTransactionError, match="signature does not verify"):
        app.check_tx(app.encode_tx(app.ProposalEvidenceTx.of(proposal(), other)), genesis, T0)


def test_evidence_waits_in_the_listed_lane_of_the_mempool(genesis):
    pool = app.Mempool()
    assert pool.add(app.encode_tx(double_proposal()), genesis, T0)
    assert pool.lane_size(app.Lane.LISTED) == 1 and pool.lane_size(app.Lane.NEW) == 0


# ---------------------------------------------------------------------------- leaders


def test_an_excluded_validator_is_no_eligible_epoch_leader():
    params = ledger.VerificationParams(model_id="m", pool_sha256="0" * 64, pool_size=4)
    book = ledger.EpochLedger()
    book.commitments[1] = {v.address: b"c" * 32 for v in VALIDATORS}
    nodes = [(b"n" * 38, b"node\x00n")]
    assert ledger.maybe_start(book, VALIDATORS, nodes, params, b"h" * 32, T0,
                              excluded=frozenset({KEYS[1].peer_id}))
    assert KEYS[1].peer_id not in {v.address for v in book.eligible}
    assert len(book.eligible) == 3
    everyone = ledger.EpochLedger()
    everyone.commitments[1] = {KEYS[0].peer_id: b"c" * 32}
    assert not ledger.maybe_start(everyone, VALIDATORS, nodes, params, b"h" * 32, T0)


# ---------------------------------------------------------------------------- valset updates


NEW_SET = tuple(sorted(VALIDATORS[:3] + (Validator(KEYS[4].peer_id, 1),),
                       key=lambda v: v.address))


def update(signers=KEYS[:3], new=NEW_SET, effective: int = 3,
           current=VALIDATORS) -> app.ValsetUpdateTx:
    return app.make_valset_update(new, effective, [
        app.sign_valset_update(k, CHAIN, current, new, effective) for k in signers])


def test_a_valset_update_signed_by_more_than_two_thirds_switches_the_set_at_its_height(genesis):
    tx = app.encode_tx(update())
    assert app.decode_tx(tx, 8192) == update()
    s1, r1 = run(genesis, [tx])
    assert errors(r1) == [None]
    assert s1.validators == VALIDATORS and s1.pending_valset == (3, NEW_SET)
    assert s1.app_hash != run(genesis, [])[0].app_hash  # the pending update is in the hash
    s2, _ = run(s1, [])  # block 2: the last of the old set; block 3 is the new set's
    assert s2.validators == NEW_SET and s2.pending_valset is None
    assert s2.is_validator(KEYS[4].peer_id) and not s2.is_validator(KEYS[3].peer_id)
    with pytest.raises(InvalidTransactionError, match="to the current set"):
        app.check_tx(tx, s2, T0)  # executed: replaying it changes nothing, refused
    stale = update(new=VALIDATORS[:3], effective=6)  # signed over the genesis set
    with pytest.raises(InvalidTransactionError, match="bad signature"):
        app.check_tx(app.encode_tx(stale), s2, T0)  # the set it named is gone
    s3, _ = run(s2, [], proposer=KEYS[4])  # the new member may propose block 3
    assert s3.height == 3


def test_a_chain_that_never_changes_its_set_keeps_its_app_hash(genesis):
    state, _ = run(genesis, [])
    assert state.registry_aux() == app.AppState.registry_aux(state)
    plain = app.genesis_state(GENESIS)
    plain._set_validators(VALIDATORS)  # the same set: no extension of the aux digest
    assert plain.registry_aux() == genesis.registry_aux()


@pytest.mark.parametrize("make, match", [
    (lambda: update(signers=KEYS[:2]), "power 2 of 4: more than 2/3"),
    (lambda: update(signers=KEYS[:2] + [OUTSIDER]), "not a validator"),
    (lambda: dataclasses.replace(update(), signatures=tuple(reversed(update().signatures))),
     "signers not ascending"),
    (lambda: dataclasses.replace(update(), signatures=(
        (KEYS[0].peer_id, b"\x00" * 64),) + update().signatures[1:]), "bad signature"),
    (lambda: update(effective=1), "must be in"),  # block 1 carries it: 2 at the earliest
    (lambda: update(effective=app.MAX_VALSET_DELAY + 1), "must be in"),
    (lambda: update(new=VALIDATORS), "to the current set"),
    (lambda: update(new=(NEW_SET[0], NEW_SET[0])), "listed twice"),
    (lambda: update(new=(Validator(KEYS[0].peer_id, 0),)), "power"),
    (lambda: dataclasses.replace(update(), validators=tuple(reversed(NEW_SET))),
     "not ascending"),
    (lambda: update(current=NEW_SET), "bad signature"),  # signed over another set
])
def test_invalid_valset_updates_are_refused(make, match, genesis):
    with pytest.raises(InvalidTransactionError, match=match):
        app.check_tx(app.encode_tx(make()), genesis, T0)


def test_a_second_valset_update_waits_for_the_pending_one(genesis):
    state, _ = run(genesis, [app.encode_tx(update())])
    other = update(new=VALIDATORS[:3], effective=5)
    with pytest.raises(InvalidTransactionError, match="already pending"):
        app.check_tx(app.encode_tx(other), state, T0)


def test_valset_updates_wait_in_the_listed_lane_at_most_max_per_subject():
    pool = app.Mempool(max_per_subject=1)
    state = app.genesis_state(GENESIS)
    assert pool.add(app.encode_tx(update()), state, T0)
    assert pool.lane_size(app.Lane.LISTED) == 1
    with pytest.raises(Exception, match="already pending"):
        pool.add(app.encode_tx(update(effective=4)), state, T0)


# ---------------------------------------------------------------------------- committees


def proposers_after(net: MemoryCommittee, i: int, height: int) -> list[bytes]:
    return [c.block.header.proposer for c in net.committed[i] if c.height > height]


def test_an_equivocating_proposer_is_excluded_from_proposing_once_its_evidence_commits():
    net = MemoryCommittee(KEYS[:4], GENESIS)
    assert net.run_until(lambda: all(v.committed_height >= 2 for v in net.vals))
    assert net.run_until(lambda: all(v.core.height == v.height and v.core.decision is None
                                     for v in net.vals))
    # the round's proposer signs two blocks; another validator, `seer`, receives both
    core = net.vals[0].core
    liar = next(i for i, k in enumerate(KEYS[:4])
                if k.peer_id == core.proposer(core.height, core.round))
    seer = (liar + 1) % 4
    h, r = net.vals[seer].core.height, net.vals[seer].core.round
    assert net.vals[seer].core.proposer(h, r) == KEYS[liar].peer_id
    for value in (b"first value", b"second value"):
        p = sign_proposal(KEYS[liar], CHAIN, Proposal(h, r, value, -1, b""))
        net.route(seer, net.vals[seer].receive(p, net.now))
    assert net.vals[seer].stats.evidence_seen == 1
    accused = KEYS[liar].peer_id
    assert net.run_until(lambda: all(accused in v.state.excluded for v in net.vals))
    at = max(v.committed_height for v in net.vals)
    assert net.run_until(lambda: all(v.committed_height >= at + 12 for v in net.vals))
    for i in range(4):
        later = proposers_after(net, i, at)
        assert len(later) >= 12 and accused not in later
        assert set(later) == {k.peer_id for k in KEYS[:4]} - {accused}
    assert net.vals[0].validators == VALIDATORS  # it still votes: removal is the operator's


def test_a_memory_committee_replaces_a_validator_and_keeps_committing():
    joiner = KEYS[4]
    net = MemoryCommittee(KEYS[:5], GENESIS, down=[])
    assert net.run_until(lambda: all(v.committed_height >= 2 for v in net.vals[:4]))
    effective = net.vals[0].committed_height + 4
    tx = app.encode_tx(update(effective=effective))
    net.route(0, net.vals[0].add_tx(tx, net.now))
    assert net.run_until(lambda: all(v.committed_height >= effective for v in net.vals))
    for v in net.vals:
        assert v.validators == NEW_SET
    # the removed validator 3 and the old member 0 go away: only the new set's quorum remains
    # (1, 2 and the joiner: 3 of 4 of the new set; 2 of 4 of the old set would halt)
    net.down.update({0, 3})
    target = effective + 8
    assert net.run_until(lambda: all(net.vals[i].committed_height >= target
                                     for i in (1, 2, 4)), limit=120.0)
    last = next(c for c in net.committed[1] if c.height == target)
    info = verify_commit(CHAIN, NEW_SET, target, block_id(last.block.header), last.commit)
    assert info.total_power == 4 and set(info.signers) <= {v.address for v in NEW_SET}
    with pytest.raises(InvalidCommitError):  # 1 and 2 only hold 2 of the old set's 4
        verify_commit(CHAIN, VALIDATORS, target, block_id(last.block.header), last.commit)
    assert joiner.peer_id in info.signers
    # block sync across the change: each commit is checked against the set of its height
    fresh = Validator_(KEYS[1], GENESIS, ConsensusStore(":memory:"), WIRE)
    rows = net.stores[1].blocks_from(1, target)
    fresh.apply_synced([(h, b, WIRE.decode_commit(c)) for h, b, c in rows], 0.0)
    assert fresh.committed_height >= target and fresh.validators == NEW_SET
    # a node without the chain follows the set from the genesis by the executed updates
    updates = net.vals[1].state.valset_updates
    assert app.validators_at(VALIDATORS, CHAIN, updates, target) == NEW_SET
    assert app.validators_at(VALIDATORS, CHAIN, updates, effective - 1) == VALIDATORS


def test_a_validator_set_chain_must_be_signed_by_each_previous_set():
    first = update(effective=3)
    back = update(signers=[KEYS[0], KEYS[1], KEYS[4]], new=VALIDATORS, effective=7,
                  current=NEW_SET)
    assert app.validators_at(VALIDATORS, CHAIN, [first, back], 6) == NEW_SET
    assert set(app.validators_at(VALIDATORS, CHAIN, [first, back], 7)) == set(VALIDATORS)
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        app.validators_at(VALIDATORS, CHAIN, [update(signers=KEYS[:2])], 5)
    with pytest.raises(InvalidCommitError, match="not a validator|bad signature"):  # skips one
        app.validators_at(VALIDATORS, CHAIN, [back], 9)
    early = update(signers=[KEYS[0], KEYS[1], KEYS[4]], new=VALIDATORS, effective=3,
                   current=NEW_SET)
    with pytest.raises(InvalidCommitError, match="not increasing"):
        app.validators_at(VALIDATORS, CHAIN, [first, early], 9)


def test_ps_node_valset_sign_and_make_build_an_update_the_chain_takes(tmp_path):
    import json

    from libp2p.peer.id import ID

    from ps_p2p.cli import main
    from ps_p2p.keys import NodeKeys

    keys = [NodeKeys.generate() for _ in range(5)]
    current = tuple(Validator(k.identity.peer_id) for k in keys[:4])
    new = current[:3] + (Validator(keys[4].identity.peer_id, 2),)

    def write_set(name, validators):
        path = tmp_path / name
        path.write_text(json.dumps([{"peer_id": ID(v.address).to_base58(), "power": v.power}
                                    for v in validators]))
        return str(path)

    cur, nxt = write_set("current.json", current), write_set("new.json", new)
    approvals = []
    for i, k in enumerate(keys[:3]):
        key_file = tmp_path / f"node{i}.key"
        key_file.write_text(k.to_json())
        approvals += ["--approval", str(tmp_path / f"approval{i}.json")]
        assert main(["valset", "sign", "--key-file", str(key_file), "--chain-id", CHAIN,
                     "--current", cur, "--new", nxt, "--effective-height", "5",
                     "--out", approvals[-1]]) == 0
    out = tmp_path / "update.hex"
    assert main(["valset", "make", "--new", nxt, "--effective-height", "5", *approvals,
                 "--out", str(out)]) == 0
    state = app.genesis_state(app.Genesis(CHAIN, T0, current))
    tx = app.check_tx(bytes.fromhex(out.read_text().strip()), state, T0)
    assert isinstance(tx, app.ValsetUpdateTx) and set(tx.validators) == set(new)
    outsider = tmp_path / "outsider.key"
    outsider.write_text(keys[4].to_json())
    assert main(["valset", "sign", "--key-file", str(outsider), "--chain-id", CHAIN,
                 "--current", cur, "--new", nxt, "--effective-height", "5",
                 "--out", str(tmp_path / "x.json")]) == 2  # not in the current set
    not_an_update = tmp_path / "other.hex"
    not_an_update.write_text(app.encode_tx(double_proposal()).hex())
    assert main(["valset", "submit", "--tx", str(not_an_update),
                 "--verifier", "/ip4/127.0.0.1/tcp/1/p2p/" + ID(keys[0].identity.peer_id)
                 .to_base58()]) == 2  # refused before any dial


def test_a_node_follows_the_directory_across_a_validator_set_change():
    from ps_p2p.registry.directory import directory_delta
    from ps_p2p.registry.replica import CommitteeReplica

    net = MemoryCommittee(KEYS[:5], GENESIS)
    assert net.run_until(lambda: all(v.committed_height >= 2 for v in net.vals[:4]))
    effective = net.vals[0].committed_height + 3
    net.route(0, net.vals[0].add_tx(app.encode_tx(update(effective=effective)), net.now))
    assert net.run_until(lambda: all(v.committed_height >= effective for v in net.vals))
    net.down.update({0, 3})  # from here only the new set's quorum signs
    target = effective + 3
    assert net.run_until(lambda: all(net.vals[i].committed_height >= target
                                     for i in (1, 2, 4)), limit=120.0)
    history = net.vals[1].history
    header, commit = history.header, history.commit
    assert header is not None and header.height > effective
    pages = list(directory_delta(history, 0, 64 * 1024))
    updates = history.latest.valset_updates
    now = header.time_ms + 1000
    with pytest.raises(InvalidCommitError):  # the genesis set alone no longer signs it
        CommitteeReplica(GENESIS).apply(header, commit, pages, now)
    replica = CommitteeReplica(GENESIS)
    directory = replica.apply(header, commit, pages, now, valset_updates=updates)
    assert directory.height == header.height - 1
    with pytest.raises(InvalidCommitError, match="does not extend"):  # hiding the update
        replica.apply(header, commit, pages, now)
    forged = [dataclasses.replace(updates[0], signatures=updates[0].signatures[:2])]
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        CommitteeReplica(GENESIS).apply(header, commit, pages, now, valset_updates=forged)


def test_a_verifier_takes_a_valset_update_from_anyone_over_the_directory_protocol(genesis):
    from ps_p2p.registry.directory import DirectoryHistory
    from ps_p2p.protocols.committee_directory import ERROR_REFUSED, CommitteeDirectoryService
    from libp2p.utils import encode_varint_prefixed

    from ps_p2p.pb.planetserve.v1 import directory_pb2

    def answer(frame: bytes) -> directory_pb2.CommitteeDirectoryResponse:
        for skip in range(1, 4):  # the unsigned-varint length prefix
            if encode_varint_prefixed(frame[skip:]) == frame:
                return directory_pb2.CommitteeDirectoryResponse.FromString(frame[skip:])
        raise AssertionError("not a frame")

    pool = app.Mempool()
    service = CommitteeDirectoryService(
        lambda: DirectoryHistory(genesis),
        lambda tx: pool.add(app.encode_tx(tx), genesis, T0))
    ok = answer(service.submit_valset_update(app.encode_tx(update())))
    assert ok.WhichOneof("kind") == "ack" and len(pool) == 1
    forged = answer(service.submit_valset_update(app.encode_tx(update(signers=KEYS[:2]))))
    assert forged.error.code == ERROR_REFUSED and "more than 2/3" in forged.error.message
    other = answer(service.submit_valset_update(app.encode_tx(double_proposal())))
    assert other.error.code == ERROR_REFUSED and "not a VALSET_UPDATE" in other.error.message
    assert len(pool) == 1


def test_an_update_signed_by_exactly_two_thirds_of_unequal_powers_is_refused():
    weighted = tuple(Validator(k.peer_id, p) for k, p in zip(KEYS[:4], (2, 1, 1, 2)))
    state = app.genesis_state(app.Genesis(CHAIN, T0, weighted))
    new = tuple(sorted(weighted[:3], key=lambda v: v.address))

    def signed_by(keys):
        return app.encode_tx(app.make_valset_update(new, 3, [
            app.sign_valset_update(k, CHAIN, weighted, new, 3) for k in keys]))

    with pytest.raises(InvalidTransactionError, match="power 4 of 6: more than 2/3"):
        app.check_tx(signed_by([KEYS[0], KEYS[1], KEYS[2]]), state, T0)  # 2+1+1 = 4 = 2/3
    assert app.check_tx(signed_by([KEYS[0], KEYS[1], KEYS[3]]), state, T0)  # 2+1+2 = 5


def test_exclusion_and_the_new_set_survive_a_restart_from_the_store():
    net = MemoryCommittee(KEYS[:5], GENESIS)
    assert net.run_until(lambda: all(v.committed_height >= 2 for v in net.vals[:4]))
    effective = net.vals[0].committed_height + 3
    evidence = double_proposal(KEYS[2], height=net.vals[0].height)
    net.route(0, net.vals[0].add_tx(app.encode_tx(evidence), net.now))
    net.route(0, net.vals[0].add_tx(app.encode_tx(update(effective=effective)), net.now))
    assert net.run_until(lambda: all(v.committed_height >= effective + 1 for v in net.vals))
    before = net.vals[1]
    restarted = net.make(1)  # a new process on the same store
    restarted.start(net.now)
    assert restarted.state.app_hash == before.state.app_hash
    assert restarted.validators == NEW_SET == before.validators
    assert restarted.state.excluded == {KEYS[2].peer_id} == before.state.excluded
    core = restarted.core
    assert all(core.proposer(core.height, r) != KEYS[2].peer_id for r in range(8))


async def test_a_local_committee_of_processes_replaces_a_validator_and_keeps_committing(
        tmp_path):
    import trio

    from ps_p2p.testing.committee import LocalCommittee

    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4, joining=1)
        members = committee.members
        with trio.fail_after(60):
            await committee.start_all()
            await committee.wait_committed(2, members[:4])
            v0 = members[0].service.validator
            current = v0.validators
            new = tuple(sorted(current[1:] + (Validator(members[4].peer_id),),
                               key=lambda v: v.address))  # member 0 leaves, 4 joins
            effective = v0.committed_height + 4
            tx = app.make_valset_update(new, effective, [
                app.sign_valset_update(m.identity, committee.genesis.chain_id, current, new,
                                       effective) for m in members[:3]])
            members[1].service.submit_tx(app.encode_tx(tx))
            # the removed member 0 stops at the change: it is no validator any more
            await committee.wait_committed(effective + 1, members[1:])
            assert all(m.service.validator.validators == new for m in members[1:])
            await committee.kill(members[0])  # the old set without 0: 3 of 4 still; the new
            await committee.kill(members[3])  # set without 3: 1, 2 and 4, 3 of 4
            await committee.wait_committed(effective + 6, [members[1], members[2], members[4]])
        last = members[1].commits[-1]
        info = verify_commit(committee.genesis.chain_id, new, last.height,
                             block_id(last.block.header), last.commit)
        assert members[4].peer_id in info.signers
        nursery.cancel_scope.cancel()


def test_a_state_snapshot_keeps_the_validator_set_its_pending_update_and_the_executed_ones(
        genesis):
    from ps_p2p.registry.snapshot import decode_state, encode_state

    tx = app.encode_tx(update())
    s1, _ = run(genesis, [tx])  # pending: block 3 is the new set's
    pending = decode_state(encode_state(s1), genesis)
    assert pending.pending_valset == (3, NEW_SET) and pending.app_hash == s1.app_hash
    s2, _ = run(s1, [])  # executed
    switched = decode_state(encode_state(s2), genesis)
    assert switched.validators == NEW_SET and switched.pending_valset is None
    assert switched.valset_updates == (update(),)
    assert switched.is_validator(KEYS[4].peer_id) and not switched.is_validator(KEYS[3].peer_id)
    assert switched.app_hash == s2.app_hash
