"""Consensus signing bytes, commit verification and block validation (pure cores)."""

from __future__ import annotations

import dataclasses

import pytest

from ps_p2p.consensus import block as blk
from ps_p2p.consensus.signing import (
    proposal_signing_bytes,
    sign_proposal,
    sign_vote,
    verify_commit,
    verify_proposal,
    verify_vote,
    vote_signing_bytes,
)
from ps_p2p.consensus.types import NIL_ROUND, Proposal, Validator, Vote, VoteType
from ps_p2p.errors import (
    InvalidBlockError,
    InvalidCommitError,
    InvalidSignatureError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.keys import Identity
from ps_p2p.records.signatures import verify_signature

CHAIN = "planetserve-test"
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]  # N = 4, f = 1
VALIDATORS = tuple(Validator(k.peer_id) for k in KEYS)
OUTSIDER = Identity.from_private_bytes(b"\x63" * 32)
BLOCK_ID = b"\xab" * 32
OTHER_ID = b"\xcd" * 32


def precommit(key: Identity, *, height: int = 5, round_: int = 0, target: bytes | None = BLOCK_ID,
              vote_type: VoteType = VoteType.PRECOMMIT, chain: str = CHAIN) -> Vote:
    return sign_vote(key, chain, Vote(vote_type, height, round_, target, b""))


# ---------------------------------------------------------------------------------- signing bytes

BASE_VOTE = Vote(VoteType.PREVOTE, 7, 2, BLOCK_ID, KEYS[0].peer_id)
BASE_PROPOSAL = Proposal(7, 2, b"block bytes", 1, KEYS[0].peer_id)


@pytest.mark.parametrize("change", [
    {"type": VoteType.PRECOMMIT},
    {"height": 8},
    {"round": 3},
    {"value_id": OTHER_ID},
    {"value_id": None},
])
def test_changing_any_vote_field_changes_the_signing_bytes(change):
    changed = dataclasses.replace(BASE_VOTE, **change)
    assert vote_signing_bytes(CHAIN, changed) != vote_signing_bytes(CHAIN, BASE_VOTE)


@pytest.mark.parametrize("change", [
    {"height": 8}, {"round": 3}, {"value": b"other block"}, {"pol_round": NIL_ROUND},
])
def test_changing_any_proposal_field_changes_the_signing_bytes(change):
    changed = dataclasses.replace(BASE_PROPOSAL, **change)
    assert proposal_signing_bytes(CHAIN, changed) != proposal_signing_bytes(CHAIN, BASE_PROPOSAL)


def test_chain_id_changes_the_signing_bytes_of_votes_and_proposals():
    assert vote_signing_bytes("a", BASE_VOTE) != vote_signing_bytes("b", BASE_VOTE)
    assert proposal_signing_bytes("a", BASE_PROPOSAL) != proposal_signing_bytes("b", BASE_PROPOSAL)


def test_a_vote_signature_never_verifies_as_a_proposal_signature():
    vote = sign_vote(KEYS[0], CHAIN, BASE_VOTE)
    proposal = dataclasses.replace(BASE_PROPOSAL, signature=vote.signature)
    with pytest.raises(InvalidSignatureError):
        verify_proposal(CHAIN, proposal)
    assert not vote_signing_bytes(CHAIN, BASE_VOTE).startswith(b"planetserve/v1/consensus-proposal")


def test_a_prevote_signature_does_not_verify_as_a_precommit():
    prevote = sign_vote(KEYS[0], CHAIN, BASE_VOTE)
    forged = dataclasses.replace(prevote, type=VoteType.PRECOMMIT)
    with pytest.raises(InvalidSignatureError):
        verify_vote(CHAIN, forged)


def test_signed_vote_and_proposal_verify_under_the_signers_peer_id():
    vote = sign_vote(KEYS[1], CHAIN, BASE_VOTE)
    proposal = sign_proposal(KEYS[1], CHAIN, BASE_PROPOSAL)
    assert vote.validator == proposal.proposer == KEYS[1].peer_id
    verify_vote(CHAIN, vote)
    verify_proposal(CHAIN, proposal)
    verify_signature(KEYS[1].peer_id, vote_signing_bytes(CHAIN, vote), vote.signature)


def test_vote_signed_on_another_chain_does_not_verify():
    vote = sign_vote(KEYS[0], "other-chain", BASE_VOTE)
    with pytest.raises(InvalidSignatureError):
        verify_vote(CHAIN, vote)


@pytest.mark.parametrize("bad", [
    {"value_id": b"short"}, {"height": 0}, {"round": -1}, {"type": 9},
])
def test_vote_fields_out_of_range_are_remote_errors(bad):
    with pytest.raises(RemoteProtocolError):
        vote_signing_bytes(CHAIN, dataclasses.replace(BASE_VOTE, **bad))


def test_proposal_pol_round_must_be_below_its_round():
    with pytest.raises(RemoteProtocolError, match="POL round"):
        proposal_signing_bytes(CHAIN, dataclasses.replace(BASE_PROPOSAL, pol_round=2))


def test_empty_chain_id_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        vote_signing_bytes("", BASE_VOTE)


# ---------------------------------------------------------------------------------- commits


def test_commit_of_exactly_2f_plus_1_validators_verifies():
    info = verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, [precommit(k) for k in KEYS[:3]])
    assert info.signed_power == 3 and info.total_power == 4 and info.duplicates == ()


def test_commit_of_2f_validators_is_refused():
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, [precommit(k) for k in KEYS[:2]])


def test_duplicate_signers_are_counted_once_and_reported():
    votes = [precommit(KEYS[0]), precommit(KEYS[1]), precommit(KEYS[0])]
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, votes)
    info = verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, votes + [precommit(KEYS[2])])
    assert info.signed_power == 3
    assert info.duplicates == (KEYS[0].peer_id,)


def test_voting_power_not_head_count_decides_the_quorum():
    weighted = (Validator(KEYS[0].peer_id, 5),) + VALIDATORS[1:]  # total 8: > 16/3 needed
    verify_commit(CHAIN, weighted, 5, BLOCK_ID, [precommit(KEYS[0]), precommit(KEYS[1])])
    with pytest.raises(InvalidCommitError):
        verify_commit(CHAIN, weighted, 5, BLOCK_ID, [precommit(k) for k in KEYS[1:]])


@pytest.mark.parametrize("name, bad_vote, match", [
    ("non-validator", lambda: precommit(OUTSIDER), "not a validator"),
    ("bad signature", lambda: dataclasses.replace(precommit(KEYS[2]), signature=b"\x00" * 64),
     "invalid signature"),
    ("wrong height", lambda: precommit(KEYS[2], height=6), "height 6"),
    ("wrong block", lambda: precommit(KEYS[2], target=OTHER_ID), "another block"),
    ("nil", lambda: precommit(KEYS[2], target=None), "another block"),
    ("prevote", lambda: precommit(KEYS[2], vote_type=VoteType.PREVOTE), "non-precommit"),
    ("mixed rounds", lambda: precommit(KEYS[2], round_=1), "mixes precommits of rounds"),
    ("other chain", lambda: precommit(KEYS[2], chain="other"), "invalid signature"),
])
def test_commit_with_a_bad_precommit_is_refused(name, bad_vote, match):
    votes = [precommit(KEYS[0]), precommit(KEYS[1]), bad_vote(), precommit(KEYS[3])]
    with pytest.raises(InvalidCommitError, match=match):
        verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, votes)


def test_commit_with_two_different_votes_of_one_validator_is_refused():
    votes = [precommit(KEYS[0]), precommit(KEYS[1]), precommit(KEYS[2]),
             dataclasses.replace(precommit(KEYS[2]), signature=precommit(KEYS[3]).signature)]
    with pytest.raises(InvalidCommitError, match="two different"):
        verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, votes)


def test_empty_and_oversized_commits_are_refused():
    with pytest.raises(InvalidCommitError, match="empty"):
        verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, [])
    with pytest.raises(InvalidCommitError, match="at most 8"):
        verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, [precommit(KEYS[0])] * 9)


def test_commit_in_a_later_round_verifies():
    verify_commit(CHAIN, VALIDATORS, 5, BLOCK_ID, [precommit(k, round_=3) for k in KEYS])


# ---------------------------------------------------------------------------------- blocks

GENESIS_TIME = 1_700_000_000_000
TIP = blk.ChainTip(CHAIN, 4, b"\x11" * 32, GENESIS_TIME, b"\x22" * 32)
LIMITS = blk.BlockLimits(max_block_bytes=4096, max_txs=3, max_tx_bytes=1024)
NOW = GENESIS_TIME + 2_000


def next_block(**change) -> blk.Block:
    fields = {"chain_id": CHAIN, "height": 5, "time_ms": GENESIS_TIME + 1_000,
                  "prev_block_id": TIP.block_id, "app_hash": TIP.app_hash, "proposer": KEYS[0].peer_id,
                  "txs": [b"tx-1", b"tx-2"]}
    fields.update(change)
    return blk.make_block(**fields)


def test_block_encoding_round_trips_and_the_id_is_the_header_hash():
    block = next_block()
    data = blk.encode_block(block)
    assert blk.decode_block(data, LIMITS) == block
    assert blk.value_block_id(data, LIMITS) == blk.block_id(block.header)
    assert blk.decode_header(blk.header_bytes(block.header)) == block.header


@pytest.mark.parametrize("field", ["height", "time_ms", "prev_block_id", "app_hash", "proposer",
                                   "txs_hash", "chain_id"])
def test_changing_any_header_field_changes_the_block_id(field):
    header = next_block().header
    value = getattr(header, field)
    if isinstance(value, int):
        new = value + 1
    elif isinstance(value, str):
        new = value + "x"
    elif field == "proposer":
        new = KEYS[1].peer_id
    else:
        new = bytes(32)
    assert blk.block_id(dataclasses.replace(header, **{field: new})) != blk.block_id(header)


def test_a_valid_next_block_passes_validation():
    blk.validate_block(next_block(), TIP, limits=LIMITS, now_ms=NOW, proposer=KEYS[0].peer_id)


@pytest.mark.parametrize("name, block, match", [
    ("bad height", lambda: next_block(height=6), "expected 5"),
    ("bad previous ID", lambda: next_block(prev_block_id=b"\x33" * 32), "does not follow"),
    ("bad app hash", lambda: next_block(app_hash=b"\x44" * 32), "app hash"),
    ("other chain", lambda: next_block(chain_id="other"), "chain"),
    ("time going back", lambda: next_block(time_ms=GENESIS_TIME - 1), "not after"),
    ("time equal", lambda: next_block(time_ms=GENESIS_TIME), "not after"),
    ("time beyond drift", lambda: next_block(time_ms=NOW + blk.MAX_CLOCK_DRIFT_MS + 1), "ahead"),
    ("too many txs", lambda: next_block(txs=[b"a", b"b", b"c", b"d"]), "4 transactions"),
    ("oversized tx", lambda: next_block(txs=[b"x" * 1025]), "1025 bytes"),
    ("oversized block", lambda: next_block(txs=[b"x" * 1000] * 3 + []), None),
])
def test_invalid_blocks_are_refused(name, block, match):
    b = block()
    if name == "oversized block":
        limits = blk.BlockLimits(max_block_bytes=2048, max_txs=3, max_tx_bytes=1024)
        with pytest.raises(InvalidBlockError, match="max 2048"):
            blk.validate_block(b, TIP, limits=limits, now_ms=NOW)
        return
    with pytest.raises(InvalidBlockError, match=match):
        blk.validate_block(b, TIP, limits=LIMITS, now_ms=NOW)


def test_stale_time_is_refused_for_a_fresh_proposal_but_not_a_reproposal():
    later = NOW + blk.MAX_CLOCK_DRIFT_MS + 5_000
    with pytest.raises(InvalidBlockError, match="behind"):
        blk.validate_block(next_block(), TIP, limits=LIMITS, now_ms=later)
    blk.validate_block(next_block(), TIP, limits=LIMITS, now_ms=later, timely=False)


def test_another_proposer_than_the_rounds_is_refused():
    with pytest.raises(InvalidBlockError, match="proposer"):
        blk.validate_block(next_block(), TIP, limits=LIMITS, now_ms=NOW, proposer=KEYS[1].peer_id)


def test_header_whose_tx_hash_disagrees_with_the_txs_is_refused():
    block = next_block()
    tampered = dataclasses.replace(block, txs=(b"tx-1", b"tx-X"))
    with pytest.raises(InvalidBlockError, match="hash"):
        blk.validate_block(tampered, TIP, limits=LIMITS, now_ms=NOW)


@pytest.mark.parametrize("mutate", [
    lambda d: d + b"\x00",                # trailing byte
    lambda d: d[:-1],                     # truncated
    lambda d: b"X" + d[1:],               # wrong domain
])
def test_malformed_encoded_blocks_are_refused(mutate):
    with pytest.raises(InvalidBlockError, match="malformed"):
        blk.decode_block(mutate(blk.encode_block(next_block())), LIMITS)


def test_decode_refuses_a_block_over_the_byte_limit_before_parsing():
    with pytest.raises(InvalidBlockError, match="max 4096"):
        blk.decode_block(b"\x00" * 4097, LIMITS)
