"""A Byzantine committee verifier (TEST ONLY ``ConsensusServiceConfig.byzantine`` /
``NodeConfig.byzantine``): it equivocates as proposer and as voter; the correct validators keep
committing, commit the evidence naming it, and nodes never accept what it signed alone.
"""

from __future__ import annotations

import pytest
import trio
from libp2p.peer.id import ID

from ps_p2p import registry as app
from ps_p2p.config import NodeConfig, load_config
from ps_p2p.consensus.block import block_id, make_block
from ps_p2p.consensus.signing import sign_vote
from ps_p2p.consensus.types import Proposal, Validator, Vote, VoteType
from ps_p2p.errors import ConfigError, InvalidCommitError
from ps_p2p.keys import Identity
from ps_p2p.protocols.consensus import ByzantineSender
from ps_p2p.registry.directory import (
    DirectoryHistory,
    directory_delta,
    verify_directory,
)
from ps_p2p.testing.committee import LocalCommittee
from ps_p2p.testing.localnet import open_localnet

CHAIN = "byzantine-test"
T0 = 1_700_000_000_000
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
GENESIS = app.Genesis(CHAIN, T0, tuple(Validator(k.peer_id) for k in KEYS))
BYZ = KEYS[3]


def evidence_against(service) -> set[bytes]:
    return {who for who, _ in service.validator.state.evidence.values()}


# ---------------------------------------------------------------------------- the equivocator


def test_the_byzantine_sender_signs_one_conflicting_message_per_step():
    peers = tuple(k.peer_id for k in KEYS[:3])
    byz = ByzantineSender(BYZ, GENESIS, peers)
    assert byz.targets == peers[:2]  # half of the others, rounded up
    vote = sign_vote(BYZ, CHAIN, Vote(VoteType.PREVOTE, 1, 0, b"\x01" * 32, b""))
    nil = byz.conflicting(vote)
    assert isinstance(nil, Vote) and nil.value_id is None
    assert (nil.type, nil.height, nil.round, nil.validator) == (
        vote.type, vote.height, vote.round, vote.validator)
    assert byz.conflicting(vote) is None  # once per (height, round, step)
    assert app.check_tx(app.encode_tx(app.EvidenceTx(vote, nil)),
                        app.genesis_state(GENESIS), T0) is not None
    nil_pc = sign_vote(BYZ, CHAIN, Vote(VoteType.PRECOMMIT, 1, 0, None, b""))
    other = byz.conflicting(nil_pc)
    assert isinstance(other, Vote) and other.value_id is not None
    block = make_block(chain_id=CHAIN, height=1, time_ms=T0 + 1, prev_block_id=b"\x00" * 32,
                       app_hash=app.genesis_state(GENESIS).app_hash, proposer=BYZ.peer_id)
    from ps_p2p.consensus.block import decode_block, encode_block
    from ps_p2p.consensus.signing import sign_proposal, verify_proposal

    proposal = sign_proposal(BYZ, CHAIN, Proposal(1, 0, encode_block(block), -1, b""))
    second = byz.conflicting(proposal)
    assert isinstance(second, Proposal) and second.value != proposal.value
    verify_proposal(CHAIN, second)
    assert decode_block(second.value, GENESIS.limits).header.time_ms == T0 + 2
    assert byz.sent == 3


async def test_a_committee_with_a_byzantine_validator_commits_and_records_its_evidence(tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4, byzantine=(3,))
        byz = committee.members[3]
        honest = committee.members[:3]
        with trio.fail_after(60):
            await committee.start_all()
            assert byz.service.byzantine is not None
            assert all(m.service.byzantine is None for m in honest)
            for m in honest:  # evidence naming the byzantine validator, committed everywhere
                while byz.peer_id not in evidence_against(m.service):
                    await m.service.wait_committed(m.service.validator.committed_height + 1)
            height = max(m.service.validator.committed_height for m in honest)
            await committee.wait_committed(height + 3)  # and the committee goes on
        assert byz.service.byzantine.sent > 0
        targets = set(byz.service.byzantine.targets)
        for m in honest:
            assert evidence_against(m.service) == {byz.peer_id}  # never a correct validator
            # those it sent conflicting votes to saw them; the third learnt it from a block
            assert (m.service.validator.stats.evidence_seen > 0) == (m.peer_id in targets)
            assert m.service.validator.stats.double_sign_refused == 0
        nursery.cancel_scope.cancel()
    for h in range(1, height + 4):  # agreement: one block per height on every member
        ids = {block_id(c.block.header) for m in committee.members for c in m.commits
               if c.height == h}
        assert len(ids) == 1, (h, ids)


# ---------------------------------------------------------------------------- nodes' side


def _history_with_blocks():
    state = app.genesis_state(GENESIS)
    history = DirectoryHistory(state)
    header = None
    for _ in range(2):
        block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=state.time_ms + 1000,
                           prev_block_id=state.block_id, app_hash=state.app_hash,
                           proposer=KEYS[0].peer_id)
        new, _ = app.execute_block(state, block)
        header = block.header
        commit = [sign_vote(k, CHAIN, Vote(VoteType.PRECOMMIT, header.height, 0,
                                           block_id(header), b"")) for k in KEYS[:3]]
        history.add_block(header, commit, new, _)
        state = new
    return history, header


def precommit(key: Identity, header, value_id: bytes | None = None) -> Vote:
    vid = block_id(header) if value_id is None else value_id
    return sign_vote(key, CHAIN, Vote(VoteType.PRECOMMIT, header.height, 0, vid, b""))


@pytest.mark.parametrize("case", ["alone", "counted twice", "conflicting twice"])
def test_a_node_refuses_a_directory_the_byzantine_verifier_signed_alone(case):
    history, header = _history_with_blocks()
    pages = list(directory_delta(history, 0, 1024))
    now = header.time_ms + 1000
    good = verify_directory(GENESIS.validators, CHAIN, header, history.commit, pages, None, now)
    assert good.height == header.height - 1
    mine = precommit(BYZ, header)
    if case == "alone":
        commit = [mine]
    elif case == "counted twice":  # its one vote listed three times: one signer, not 2f+1
        commit = [mine, mine, mine]
    else:  # its vote and a conflicting one of the same round, plus one correct validator
        other = sign_vote(BYZ, CHAIN, Vote(VoteType.PRECOMMIT, header.height, 0, None, b""))
        commit = [mine, other, precommit(KEYS[0], header)]
    with pytest.raises(InvalidCommitError):
        verify_directory(GENESIS.validators, CHAIN, header, commit, pages, None, now)
    # with one correct validator, the byzantine one's vote twice is still two signers of four
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        verify_directory(GENESIS.validators, CHAIN, header,
                         [mine, mine, precommit(KEYS[0], header)], pages, None, now)


# ---------------------------------------------------------------------------- a whole network


async def test_users_get_verified_directories_and_answers_beside_a_byzantine_verifier():
    async with open_localnet(users=6, committee=4, byzantine=(3,)) as net:
        byz = net.verifiers[3]
        honest = net.verifiers[:3]
        assert byz.consensus.byzantine is not None
        with trio.fail_after(30):
            for v in honest:  # evidence naming it, committed on every correct verifier
                while byz.peer_id not in evidence_against(v.consensus):
                    await v.consensus.wait_committed(v.consensus.validator.committed_height + 1)
        for v in honest:
            status = v.committee_status()  # what `ps-node status` prints
            assert status["evidence"] >= 1
            assert status["equivocators"] == [ID(byz.peer_id).to_base58()]
            # the consequence: it no longer proposes (docs/consensus.md, evidence)
            assert [e["peer_id"] for e in status["validators"] if e["excluded"]] == \
                [ID(byz.peer_id).to_base58()]
        user = net.users[0]
        assert user._client.replica.view.header is not None  # verified against a commit
        assert len(user.directory.users()) == 6 and len(user.directory.model_nodes()) == 1
        answer = await user.user.ask("Once upon a time there was a fox", timeout=30)
        assert answer.ok, answer.error
        assert answer.text == "xof a saw ereht emit a nopu ecnO"
        height = user.directory.height
        with trio.fail_after(10):  # the committee keeps committing, the users keep adopting
            while user.directory.height <= height + 2:
                await user.wait_directory_update()


def test_byzantine_is_for_verifiers_and_never_read_from_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="is for a verifier"):
        NodeConfig(roles=["user"], bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + KEYS[0].peer_id_str],
                   byzantine=True).validate()
    NodeConfig(roles=["verifier"], byzantine=True).validate()  # every verifier is in a committee
    path = tmp_path / "node.toml"
    path.write_text('roles = ["verifier"]\nbyzantine = true\n')
    with pytest.raises(ConfigError, match="unknown config key 'byzantine'"):
        load_config(str(path), {})
