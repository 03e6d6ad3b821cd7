"""Consensus wire messages (ps_p2p.protocols.consensus_codec): round trips of signed messages,
and every malformed or out-of-bounds field refused with a RemoteProtocolError naming it."""

from __future__ import annotations

import os

import pytest

from ps_p2p.consensus import signing
from ps_p2p.consensus.types import NIL_ROUND, Proposal, Vote, VoteType, value_id
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.keys import NodeKeys
from ps_p2p.pb.planetserve.v1 import consensus_pb2
from ps_p2p.protocols import consensus_codec as cc

CHAIN = "test-chain"
KEYS = [NodeKeys.generate().identity for _ in range(4)]
BLOCK = b"an encoded block"


def _vote(key, type_=VoteType.PRECOMMIT, height=3, round_=1, vid=value_id(BLOCK)):
    return signing.sign_vote(key, CHAIN, Vote(type_, height, round_, vid, key.peer_id))


def test_signed_proposal_vote_and_tx_round_trip_and_still_verify():
    proposal = signing.sign_proposal(KEYS[0], CHAIN, Proposal(3, 1, BLOCK, 0, KEYS[0].peer_id))
    nil = _vote(KEYS[1], VoteType.PREVOTE, vid=None)
    for message in (proposal, _vote(KEYS[1]), nil, cc.Tx(b"tx bytes")):
        decoded = cc.decode_message(cc.encode_message(message))
        assert decoded == message
    signing.verify_proposal(CHAIN, cc.decode_message(cc.encode_message(proposal)))
    signing.verify_vote(CHAIN, cc.decode_message(cc.encode_message(nil)))
    assert cc.decode_message(cc.encode_message(nil)).value_id is None


def test_a_commit_and_block_sync_round_trip():
    commit = tuple(_vote(k) for k in KEYS[:3])
    assert cc.decode_commit(cc.encode_commit(commit)) == commit
    blocks = [cc.SyncedBlock(3, BLOCK, commit), cc.SyncedBlock(4, b"next", tuple(
        _vote(k, height=4) for k in KEYS[:3]))]
    assert cc.decode_sync_response(cc.encode_sync_response(blocks, 9)) == (blocks, 9)
    assert cc.decode_sync_request(cc.encode_sync_request(5, 1000)) == (5, cc.MAX_SYNC_BLOCKS)


def _vote_pb(**changes):
    m = cc.vote_to_pb(_vote(KEYS[0]))
    for k, v in changes.items():
        setattr(m, k, v)
    return consensus_pb2.ConsensusMessage(vote=m).SerializeToString()


def _proposal_pb(**changes):
    m = cc.proposal_to_pb(signing.sign_proposal(KEYS[0], CHAIN, Proposal(3, 2, BLOCK, NIL_ROUND, KEYS[0].peer_id)))
    for k, v in changes.items():
        setattr(m, k, v)
    return consensus_pb2.ConsensusMessage(proposal=m).SerializeToString()


@pytest.mark.parametrize("data, field", [
    (b"\xff\xff\xff", "malformed"),
    (b"", "empty consensus message"),
    (_vote_pb(type=0), "unknown type"),
    (_vote_pb(type=7), "unknown type"),
    (_vote_pb(height=0), "height"),
    (_vote_pb(round=2**31), "round"),
    (_vote_pb(value_id=b"short"), "value ID"),
    (_vote_pb(validator=b""), "peer ID"),
    (_vote_pb(validator=b"x" * 65), "peer ID"),
    (_vote_pb(signature=b"s" * 63), "signature"),
    (_proposal_pb(pol_round=2), "pol_round"),
    (_proposal_pb(pol_round=-2), "pol_round"),
    (_proposal_pb(value=b"v" * (cc.MAX_VALUE_BYTES + 1)), "value of"),
    (consensus_pb2.ConsensusMessage(tx=consensus_pb2.ConsensusTx(tx=b"")).SerializeToString(), "tx of"),
    (consensus_pb2.ConsensusMessage(tx=consensus_pb2.ConsensusTx(
        tx=os.urandom(cc.MAX_TX_BYTES + 1))).SerializeToString(), "tx of"),
], ids=["garbage", "empty", "type-0", "type-7", "height-0", "round-huge", "short-id", "no-peer",
        "long-peer", "short-sig", "pol-not-below", "pol-minus-2", "big-value", "empty-tx",
        "big-tx"])
def test_malformed_messages_are_refused_naming_the_field(data, field):
    with pytest.raises(RemoteProtocolError, match=field):
        cc.decode_message(data)


def test_bad_commits_and_sync_responses_are_refused():
    prevote = _vote(KEYS[0], VoteType.PREVOTE)
    with pytest.raises(RemoteProtocolError, match="no precommit"):
        cc.decode_commit(cc.encode_commit([prevote]))
    too_many = consensus_pb2.Commit(precommits=[cc.vote_to_pb(_vote(KEYS[0]))] * 129)
    with pytest.raises(RemoteProtocolError, match="over"):
        cc.decode_commit(too_many.SerializeToString())
    commit = tuple(_vote(k) for k in KEYS[:3])
    gap = [cc.SyncedBlock(3, BLOCK, commit), cc.SyncedBlock(5, BLOCK, commit)]
    with pytest.raises(RemoteProtocolError, match="consecutive"):
        cc.decode_sync_response(cc.encode_sync_response(gap, 9))
    with pytest.raises(RemoteProtocolError, match="another height"):
        cc.decode_sync_response(cc.encode_sync_response([cc.SyncedBlock(4, BLOCK, commit)], 9))
    with pytest.raises(RemoteProtocolError, match="latest height"):
        cc.decode_sync_response(cc.encode_sync_response([cc.SyncedBlock(3, BLOCK, commit)], 2))
    with pytest.raises(RemoteProtocolError, match="height 0"):
        cc.decode_sync_request(cc.encode_sync_request(0, 5))
