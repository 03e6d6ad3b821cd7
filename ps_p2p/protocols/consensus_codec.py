"""``planetserve.v1`` consensus messages <-> :mod:`ps_p2p.consensus.types` (service layer).

Wire: ``protos/planetserve/v1/consensus.proto``. Decoding checks shapes and bounds only (sizes,
ranges, enum values, ID lengths); signatures are checked by the driver with
:mod:`ps_p2p.consensus.signing` before anything reaches the core, and blocks by the application.
Every decode error is a :class:`~ps_p2p.errors.RemoteProtocolError` naming the field: the
stream it came on is reset, nothing else is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ps_p2p.consensus.signing import MAX_VALIDATORS, VALUE_ID_BYTES
from ps_p2p.consensus.types import NIL_ROUND, Proposal, Vote, VoteType
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import consensus_pb2
from ps_p2p.protocols.wire import parse

#: Largest value (an encoded block) a proposal may carry: the committed block limit's default
#: (ps_p2p.consensus.block.BlockLimits) plus room for the header.
MAX_VALUE_BYTES = 1024 * 1024 + 4096
#: Largest transaction relayed among mempools.
MAX_TX_BYTES = 64 * 1024
#: Longest peer ID (an identity multihash of an Ed25519 key is 38 bytes; RSA ones are longer,
#: and refused later).
MAX_PEER_ID_BYTES = 64
#: Largest Ed25519 signature.
SIGNATURE_BYTES = 64
#: Blocks one block-sync response may carry.
MAX_SYNC_BLOCKS = 64
#: Largest round accepted on the wire (a validator past it is broken or lying).
MAX_ROUND = 2**31 - 2


@dataclass(frozen=True)
class Tx:
    """A registry transaction relayed among validators (``ConsensusTx``)."""

    tx: bytes


ConsensusMessage = Proposal | Vote | Tx


@dataclass(frozen=True)
class SyncedBlock:
    """One committed block with its commit, from block sync."""

    height: int
    block: bytes
    commit: tuple[Vote, ...]


def _check_common(height: int, round_: int, peer: bytes, signature: bytes, what: str) -> None:
    if height < 1:
        raise RemoteProtocolError(f"{what}: height must be >= 1")
    if round_ > MAX_ROUND:
        raise RemoteProtocolError(f"{what}: round {round_} out of range")
    if not 0 < len(peer) <= MAX_PEER_ID_BYTES:
        raise RemoteProtocolError(f"{what}: peer ID of {len(peer)} bytes")
    if len(signature) != SIGNATURE_BYTES:
        raise RemoteProtocolError(f"{what}: signature of {len(signature)} bytes, not 64")


def proposal_to_pb(p: Proposal) -> consensus_pb2.ConsensusProposal:
    return consensus_pb2.ConsensusProposal(
        height=p.height, round=p.round, value=p.value, pol_round=p.pol_round,
        proposer=p.proposer, signature=p.signature,
    )


def proposal_from_pb(m: consensus_pb2.ConsensusProposal) -> Proposal:
    """Raises RemoteProtocolError: a field out of its bounds."""
    _check_common(m.height, m.round, m.proposer, m.signature, "proposal")
    if len(m.value) > MAX_VALUE_BYTES:
        raise RemoteProtocolError(f"proposal: value of {len(m.value)} bytes over {MAX_VALUE_BYTES}")
    if not (m.pol_round == NIL_ROUND or 0 <= m.pol_round < m.round):
        raise RemoteProtocolError(f"proposal: pol_round {m.pol_round} not -1 or below its round")
    return Proposal(m.height, m.round, m.value, m.pol_round, m.proposer, m.signature)


def vote_to_pb(v: Vote) -> consensus_pb2.ConsensusVote:
    return consensus_pb2.ConsensusVote(
        type=int(v.type), height=v.height, round=v.round, value_id=v.value_id or b"",
        validator=v.validator, signature=v.signature,
    )


def vote_from_pb(m: consensus_pb2.ConsensusVote) -> Vote:
    """Raises RemoteProtocolError: an unknown type or a field out of its bounds."""
    if m.type not in (VoteType.PREVOTE, VoteType.PRECOMMIT):
        raise RemoteProtocolError(f"vote: unknown type {m.type}")
    _check_common(m.height, m.round, m.validator, m.signature, "vote")
    if len(m.value_id) not in (0, VALUE_ID_BYTES):
        raise RemoteProtocolError(f"vote: value ID of {len(m.value_id)} bytes, not 0 or 32")
    return Vote(VoteType(m.type), m.height, m.round, m.value_id or None, m.validator, m.signature)


def encode_message(message: ConsensusMessage) -> bytes:
    """One ``ConsensusMessage`` (the frame payload of ``/planetserve/consensus/1.0.0``)."""
    if isinstance(message, Proposal):
        pb = consensus_pb2.ConsensusMessage(proposal=proposal_to_pb(message))
    elif isinstance(message, Vote):
        pb = consensus_pb2.ConsensusMessage(vote=vote_to_pb(message))
    else:
        pb = consensus_pb2.ConsensusMessage(tx=consensus_pb2.ConsensusTx(tx=message.tx))
    return pb.SerializeToString()


def decode_message(data: bytes) -> ConsensusMessage:
    """Raises RemoteProtocolError: malformed, empty, or a field out of its bounds."""
    m = parse(consensus_pb2.ConsensusMessage, data)
    kind = m.WhichOneof("kind")
    if kind == "proposal":
        return proposal_from_pb(m.proposal)
    if kind == "vote":
        return vote_from_pb(m.vote)
    if kind == "tx":
        if not 0 < len(m.tx.tx) <= MAX_TX_BYTES:
            raise RemoteProtocolError(f"tx of {len(m.tx.tx)} bytes (1..{MAX_TX_BYTES})")
        return Tx(m.tx.tx)
    raise RemoteProtocolError("empty consensus message")


def encode_commit(precommits: Sequence[Vote]) -> bytes:
    """A commit's precommits as a ``Commit`` message (what the block store keeps)."""
    return consensus_pb2.Commit(precommits=[vote_to_pb(v) for v in precommits]).SerializeToString()


def commit_to_pb(precommits: Sequence[Vote]) -> consensus_pb2.Commit:
    """A commit's precommits as a ``Commit`` message."""
    return consensus_pb2.Commit(precommits=[vote_to_pb(v) for v in precommits])


def commit_from_pb(m: consensus_pb2.Commit) -> tuple[Vote, ...]:
    """A decoded ``Commit`` message's votes (as :func:`decode_commit`).

    Raises:
        RemoteProtocolError: too many votes, a field out of bounds, or a vote that is no
            precommit.
    """
    return _commit_from_pb(m)


def _commit_from_pb(m: consensus_pb2.Commit) -> tuple[Vote, ...]:
    if len(m.precommits) > MAX_VALIDATORS:
        raise RemoteProtocolError(f"commit of {len(m.precommits)} votes, over {MAX_VALIDATORS}")
    votes = tuple(vote_from_pb(v) for v in m.precommits)
    if any(v.type != VoteType.PRECOMMIT for v in votes):
        raise RemoteProtocolError("commit holds a vote that is no precommit")
    return votes


def decode_commit(data: bytes) -> tuple[Vote, ...]:
    """Raises RemoteProtocolError: malformed, too many votes, or a vote that is no precommit
    (whether they form a quorum is :func:`ps_p2p.consensus.signing.verify_commit`'s job)."""
    return _commit_from_pb(parse(consensus_pb2.Commit, data))


def encode_sync_request(from_height: int, max_blocks: int) -> bytes:
    return consensus_pb2.BlockSyncRequest(
        from_height=from_height, max_blocks=max_blocks
    ).SerializeToString()


def decode_sync_request(data: bytes) -> tuple[int, int]:
    """(from height, blocks wanted, capped at :data:`MAX_SYNC_BLOCKS`).

    Raises:
        RemoteProtocolError: malformed, or a height below 1.
    """
    m = parse(consensus_pb2.BlockSyncRequest, data)
    if m.from_height < 1:
        raise RemoteProtocolError("block sync from height 0")
    return m.from_height, max(1, min(m.max_blocks, MAX_SYNC_BLOCKS))


def encode_sync_response(blocks: Sequence[SyncedBlock], latest_height: int) -> bytes:
    return consensus_pb2.BlockSyncResponse(
        blocks=[
            consensus_pb2.SyncedBlock(
                height=b.height, block=b.block,
                commit=consensus_pb2.Commit(precommits=[vote_to_pb(v) for v in b.commit]),
            )
            for b in blocks
        ],
        latest_height=latest_height,
    ).SerializeToString()


def decode_sync_response(data: bytes) -> tuple[list[SyncedBlock], int]:
    """(blocks in height order, the server's latest height).

    Raises:
        RemoteProtocolError: malformed, too many or oversized blocks, heights not consecutive,
            or a commit that is not made of precommits for its height.
    """
    m = parse(consensus_pb2.BlockSyncResponse, data)
    if len(m.blocks) > MAX_SYNC_BLOCKS:
        raise RemoteProtocolError(f"{len(m.blocks)} blocks in one sync response, over {MAX_SYNC_BLOCKS}")
    out: list[SyncedBlock] = []
    for b in m.blocks:
        if len(b.block) > MAX_VALUE_BYTES:
            raise RemoteProtocolError(f"synced block of {len(b.block)} bytes")
        if out and b.height != out[-1].height + 1:
            raise RemoteProtocolError("synced blocks are not consecutive")
        commit = _commit_from_pb(b.commit)
        if any(v.height != b.height for v in commit):
            raise RemoteProtocolError(f"the commit of block {b.height} has votes of another height")
        out.append(SyncedBlock(b.height, b.block, commit))
    if out and m.latest_height < out[-1].height:
        raise RemoteProtocolError("latest height below the blocks sent")
    return out, m.latest_height


__all__ = [
    "ConsensusMessage", "MAX_SYNC_BLOCKS", "MAX_TX_BYTES", "MAX_VALUE_BYTES", "SyncedBlock", "Tx",
    "commit_from_pb", "commit_to_pb", "decode_commit", "decode_message", "decode_sync_request", "decode_sync_response",
    "encode_commit", "encode_message", "encode_sync_request", "encode_sync_response",
]
