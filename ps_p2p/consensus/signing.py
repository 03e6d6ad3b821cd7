"""Canonical signing bytes of proposals and votes, their Ed25519 signatures, and commits, pure.

Every consensus signature covers a domain-separated canonical byte string (DESIGN.md "Wire"; the
same style as :mod:`ps_p2p.records.canonical`), never a serialized protobuf::

    proposal = b"planetserve/v1/consensus-proposal\\x00" || str(chain_id) || u8(0x20)
               || u64(height) || u32(round) || u32(pol_round + 1) || bytes(SHA-256(value))
    vote     = b"planetserve/v1/consensus-vote\\x00" || str(chain_id) || u8(type)
               || u64(height) || u32(round) || u8(0) (nil) | u8(1) || bytes(value ID)

with ``u8(type)`` the :class:`~ps_p2p.consensus.types.VoteType` (1 prevote, 2 precommit), so a
prevote never verifies as a precommit, a vote never as a proposal (distinct prefixes and type
bytes), and a signature made for one chain never verifies on another (the chain ID). Integers are
big-endian; ``pol_round`` is -1 (``NIL_ROUND``) or a round, stored plus one. A proposal signs the
SHA-256 of its whole value, so it commits to the whole block; a vote signs the ID it votes for,
which for the registry application is the block ID (:func:`ps_p2p.consensus.block.block_id`).

Keys are the validators' libp2p identities: a validator's address is its Ed25519
identity-multihash peer ID (38 bytes) and signatures are checked by
:func:`ps_p2p.records.signatures.verify_signature` (RFC 8032, libsodium, ~55 us each).

A *commit* (the quorum certificate of a block, Algorithm 1's ``2f+1 <PRECOMMIT, h, r, id(v)>``
of Buchman, Kwon, Milosevic) is checked by :func:`verify_commit`: valid precommits for exactly
one height, round and block ID, signed by distinct validators holding more than 2/3 of the
voting power.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ps_p2p.consensus.encoding import lp, lps, u8, u32, u64
from ps_p2p.consensus.types import (
    NIL_ROUND,
    Proposal,
    Validator,
    Vote,
    VoteType,
    value_id,
)
from ps_p2p.errors import (
    InvalidCommitError,
    InvalidSignatureError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.records.limits import UINT32_BOUND, UINT64_BOUND
from ps_p2p.records.peer_ids import peer_label, public_key_from_peer_id
from ps_p2p.records.signatures import verify_signature
from ps_p2p.records.types import Signer

PROPOSAL_DOMAIN = b"planetserve/v1/consensus-proposal\x00"
VOTE_DOMAIN = b"planetserve/v1/consensus-vote\x00"
VALIDATOR_SET_DOMAIN = b"planetserve/v1/validator-set\x00"
#: The type byte of a proposal (distinct from every VoteType).
PROPOSAL_TYPE = 0x20
#: Longest chain ID (UTF-8 bytes).
MAX_CHAIN_ID_BYTES = 64
#: A value ID / block ID: SHA-256.
VALUE_ID_BYTES = 32
#: Largest committee (3f+1 <= 128: f <= 42).
MAX_VALIDATORS = 128
#: Largest total voting power (sums stay far from overflow in every language).
MAX_TOTAL_POWER = 2**60


def check_chain_id(chain_id: str) -> bytes:
    """``str(chain_id)`` (length-prefixed UTF-8).

    Raises:
        LocalProtocolError: empty, not a string, or over :data:`MAX_CHAIN_ID_BYTES`.
    """
    if not isinstance(chain_id, str) or not chain_id:
        raise LocalProtocolError("chain ID must be a non-empty string")
    encoded = lps(chain_id)
    if len(encoded) - 4 > MAX_CHAIN_ID_BYTES:
        raise LocalProtocolError(f"chain ID over {MAX_CHAIN_ID_BYTES} UTF-8 bytes")
    return encoded


def _check_position(height: int, round_: int) -> None:
    if not isinstance(height, int) or not 0 < height < UINT64_BOUND:
        raise RemoteProtocolError(f"height {height!r} out of range [1, 2**64)")
    if not isinstance(round_, int) or not 0 <= round_ < UINT32_BOUND - 1:
        raise RemoteProtocolError(f"round {round_!r} out of range [0, 2**32 - 1)")


def proposal_signing_bytes(chain_id: str, proposal: Proposal) -> bytes:
    """The canonical byte string a proposal's signature covers (module docstring).

    Raises:
        LocalProtocolError: an empty or over-long chain ID.
        RemoteProtocolError: height, round or POL round out of range (POL round must be -1
            or in [0, round)).
    """
    if not isinstance(proposal.value, (bytes, bytearray)):
        raise RemoteProtocolError("proposal value is not bytes")
    return proposal_digest_signing_bytes(chain_id, proposal.height, proposal.round,
                                         proposal.pol_round, value_id(bytes(proposal.value)))


def proposal_digest_signing_bytes(chain_id: str, height: int, round_: int, pol_round: int,
                                  value_hash: bytes) -> bytes:
    """:func:`proposal_signing_bytes` from the SHA-256 of the value (32 bytes) instead of the
    value: what evidence of a double proposal carries (a proposal's signature covers only
    the hash, so two conflicting blocks need not be carried whole).

    Raises:
        LocalProtocolError: an empty or over-long chain ID.
        RemoteProtocolError: height, round or POL round out of range, a hash not 32 bytes.
    """
    chain = check_chain_id(chain_id)
    _check_position(height, round_)
    if not isinstance(pol_round, int) or not NIL_ROUND <= pol_round < round_:
        raise RemoteProtocolError(
            f"proposal POL round {pol_round!r} not in [-1, round {round_})"
        )
    if not isinstance(value_hash, bytes) or len(value_hash) != VALUE_ID_BYTES:
        raise RemoteProtocolError("proposal value hash is not 32 bytes")
    return b"".join((
        PROPOSAL_DOMAIN, chain, u8(PROPOSAL_TYPE), u64(height), u32(round_),
        u32(pol_round + 1), lp(value_hash),
    ))


def vote_signing_bytes(chain_id: str, vote: Vote) -> bytes:
    """The canonical byte string a vote's signature covers (module docstring).

    Raises:
        LocalProtocolError: an empty or over-long chain ID.
        RemoteProtocolError: an unknown vote type, height or round out of range, or a value
            ID that is neither None (nil) nor 32 bytes.
    """
    chain = check_chain_id(chain_id)
    try:
        vote_type = VoteType(vote.type)
    except ValueError:
        raise RemoteProtocolError(f"unknown vote type {vote.type!r}") from None
    _check_position(vote.height, vote.round)
    if vote.value_id is None:
        target = u8(0)
    else:
        if not isinstance(vote.value_id, bytes) or len(vote.value_id) != VALUE_ID_BYTES:
            raise RemoteProtocolError("vote value ID is not 32 bytes")
        target = u8(1) + lp(vote.value_id)
    return b"".join((
        VOTE_DOMAIN, chain, u8(int(vote_type)), u64(vote.height), u32(vote.round), target,
    ))


def sign_proposal(identity: Signer, chain_id: str, proposal: Proposal) -> Proposal:
    """``proposal`` with ``proposer`` set to the identity's peer ID and signed by it.

    Raises:
        LocalProtocolError: bad chain ID, or a field out of range (our own bug).
    """
    proposal = replace(proposal, proposer=identity.peer_id, signature=b"")
    try:
        data = proposal_signing_bytes(chain_id, proposal)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(str(exc)) from exc
    return replace(proposal, signature=identity.sign(data))


def sign_vote(identity: Signer, chain_id: str, vote: Vote) -> Vote:
    """``vote`` with ``validator`` set to the identity's peer ID and signed by it.

    Raises:
        LocalProtocolError: bad chain ID, or a field out of range (our own bug).
    """
    vote = replace(vote, validator=identity.peer_id, signature=b"")
    try:
        data = vote_signing_bytes(chain_id, vote)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(str(exc)) from exc
    return replace(vote, signature=identity.sign(data))


def verify_proposal(chain_id: str, proposal: Proposal) -> None:
    """Check a proposal's signature by its ``proposer`` (not whether it is the round's proposer).

    Raises:
        RemoteProtocolError: a field out of range or a non-Ed25519 proposer.
        InvalidSignatureError: the signature does not verify.
    """
    data = proposal_signing_bytes(chain_id, proposal)
    try:
        verify_signature(proposal.proposer, data, proposal.signature)
    except InvalidSignatureError:
        raise InvalidSignatureError(
            f"proposal (height {proposal.height}, round {proposal.round}) of "
            f"{peer_label(proposal.proposer)} has an invalid signature"
        ) from None


def verify_vote(chain_id: str, vote: Vote) -> None:
    """Check a vote's signature by its ``validator`` (not whether it is in the validator set).

    Raises:
        RemoteProtocolError: a field out of range or a non-Ed25519 validator.
        InvalidSignatureError: the signature does not verify.
    """
    data = vote_signing_bytes(chain_id, vote)
    try:
        verify_signature(vote.validator, data, vote.signature)
    except InvalidSignatureError:
        raise InvalidSignatureError(
            f"{VoteType(vote.type).name.lower()} (height {vote.height}, round {vote.round}) "
            f"of {peer_label(vote.validator)} has an invalid signature"
        ) from None


# ---------------------------------------------------------------------------------- validators


def check_validators(validators: Sequence[Validator]) -> int:
    """Check a validator set (from the genesis file); returns its total voting power.

    Raises:
        LocalProtocolError: empty, more than :data:`MAX_VALIDATORS`, an address that is not an
            Ed25519 peer ID, a power < 1, an address listed twice, or a total power over
            :data:`MAX_TOTAL_POWER` (the set is configuration, not a peer's input).
    """
    if not validators:
        raise LocalProtocolError("empty validator set")
    if len(validators) > MAX_VALIDATORS:
        raise LocalProtocolError(f"{len(validators)} validators (max {MAX_VALIDATORS})")
    seen: set[bytes] = set()
    total = 0
    for v in validators:
        try:
            public_key_from_peer_id(v.address)
        except RemoteProtocolError as exc:
            raise LocalProtocolError(f"validator address: {exc}") from None
        if not isinstance(v.power, int) or v.power < 1:
            raise LocalProtocolError(f"validator {peer_label(v.address)} has power {v.power!r}")
        if v.address in seen:
            raise LocalProtocolError(f"validator {peer_label(v.address)} listed twice")
        seen.add(v.address)
        total += v.power
    if total > MAX_TOTAL_POWER:
        raise LocalProtocolError(f"total voting power {total} over {MAX_TOTAL_POWER}")
    return total


def validator_set_hash(validators: Sequence[Validator]) -> bytes:
    """SHA-256 of a validator set, in address order (what a validator-set update signs as the
    set it replaces)::

        b"planetserve/v1/validator-set\\x00" || u32(n) || (bytes(address) || u64(power))*

    Raises:
        LocalProtocolError: a bad set (:func:`check_validators`).
    """
    check_validators(validators)
    ordered = sorted(validators, key=lambda v: v.address)
    return hashlib.sha256(VALIDATOR_SET_DOMAIN + u32(len(ordered)) + b"".join(
        lp(v.address) + u64(v.power) for v in ordered)).digest()


def has_quorum(signed_power: int, total_power: int) -> bool:
    """More than 2/3 of ``total_power`` (Algorithm 1's 2f+1 when every power is 1)."""
    return 3 * signed_power > 2 * total_power


@dataclass(frozen=True)
class CommitInfo:
    """What :func:`verify_commit` found in a valid commit.

    Attributes:
        round: the round all its precommits share.
        signers: the distinct validators whose precommits count, in commit order.
        signed_power: their voting power; ``3 * signed_power > 2 * total_power``.
        total_power: the validator set's.
        duplicates: validators that appeared more than once (counted once).
    """

    round: int
    signers: tuple[bytes, ...]
    signed_power: int
    total_power: int
    duplicates: tuple[bytes, ...]


def verify_commit(
    chain_id: str,
    validators: Sequence[Validator],
    height: int,
    block_id: bytes,
    commit_votes: Sequence[Vote],
) -> CommitInfo:
    """Check that ``commit_votes`` is a quorum certificate of ``block_id`` at ``height``.

    Every vote must be a PRECOMMIT for exactly ``height`` and ``block_id`` (not nil), all of
    one round, by a member of ``validators``, with a valid signature
    (:func:`vote_signing_bytes`); a validator listed twice with the same signed vote counts
    once (reported in :attr:`CommitInfo.duplicates`), twice with different votes is refused.
    The distinct signers must hold more than 2/3 of the total voting power. Cost: one Ed25519
    check per distinct vote (~55 us), at most ``2 * len(validators)`` entries read.

    Returns:
        a :class:`CommitInfo` (round, signers, power, duplicates).

    Raises:
        LocalProtocolError: a bad validator set (:func:`check_validators`) or chain ID.
        InvalidCommitError: empty or more than ``2 * len(validators)`` entries; a vote that is
            not a precommit, for another height or block ID, or nil; precommits of different
            rounds; a signer outside the validator set; a bad signature; or not more than 2/3
            of the voting power.
    """
    total = check_validators(validators)
    power = {v.address: v.power for v in validators}
    if not isinstance(block_id, bytes) or len(block_id) != VALUE_ID_BYTES:
        raise LocalProtocolError("block ID must be 32 bytes")
    if not commit_votes:
        raise InvalidCommitError(f"empty commit for height {height}")
    if len(commit_votes) > 2 * len(validators):
        raise InvalidCommitError(
            f"commit of {len(commit_votes)} votes (at most {2 * len(validators)} read)"
        )
    round_ = commit_votes[0].round
    seen: dict[bytes, Vote] = {}
    duplicates: list[bytes] = []
    signed = 0
    for vote in commit_votes:
        who = peer_label(vote.validator) if isinstance(vote.validator, bytes) else "?"
        if vote.type != VoteType.PRECOMMIT:
            raise InvalidCommitError(f"commit holds a non-precommit vote by {who}")
        if vote.height != height:
            raise InvalidCommitError(
                f"commit for height {height} holds a precommit for height {vote.height} by {who}"
            )
        if vote.value_id != block_id:
            raise InvalidCommitError(
                f"commit holds a precommit by {who} for another block ID or nil"
            )
        if vote.round != round_:
            raise InvalidCommitError(
                f"commit mixes precommits of rounds {round_} and {vote.round}"
            )
        if vote.validator not in power:
            raise InvalidCommitError(f"commit holds a precommit by {who}, not a validator")
        earlier = seen.get(vote.validator)
        if earlier is not None:
            if earlier != vote:
                raise InvalidCommitError(f"commit holds two different precommits by {who}")
            duplicates.append(vote.validator)
            continue
        try:
            verify_vote(chain_id, vote)
        except RemoteProtocolError as exc:  # InvalidSignatureError included
            raise InvalidCommitError(f"commit precommit: {exc}") from None
        seen[vote.validator] = vote
        signed += power[vote.validator]
    if not has_quorum(signed, total):
        raise InvalidCommitError(
            f"commit for height {height} signed by {len(seen)} validator(s) with power "
            f"{signed} of {total}: more than 2/3 needed"
        )
    return CommitInfo(round_, tuple(seen), signed, total, tuple(duplicates))


__all__ = [
    "MAX_CHAIN_ID_BYTES",
    "MAX_TOTAL_POWER",
    "MAX_VALIDATORS",
    "PROPOSAL_DOMAIN",
    "PROPOSAL_TYPE",
    "VALUE_ID_BYTES",
    "VALIDATOR_SET_DOMAIN",
    "VOTE_DOMAIN",
    "CommitInfo",
    "check_chain_id",
    "check_validators",
    "has_quorum",
    "proposal_digest_signing_bytes",
    "proposal_signing_bytes",
    "sign_proposal",
    "sign_vote",
    "verify_commit",
    "verify_proposal",
    "validator_set_hash",
    "verify_vote",
    "vote_signing_bytes",
]
