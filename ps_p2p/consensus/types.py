"""Messages, inputs and outputs of the consensus core (pure; no I/O, clock or randomness).

Source: Algorithm 1 of Buchman, Kwon, Milosevic, "The latest gossip on BFT consensus"
(arXiv 1807.04938), the state machine of one validator: heights, rounds, and the steps propose,
prevote, precommit. A *value* is an opaque byte string (a block, for the registry application);
it is identified by its *value ID* (``value_id``: SHA-256 of the value, 32 bytes). ``None`` as a
value ID is nil.

The core (:mod:`ps_p2p.consensus.core`) takes inputs and returns outputs; the driver signs and
writes to the write-ahead log what the core asks to broadcast, delivers messages from peers
after checking their signatures, runs timeouts, and asks the application for values and their
validity. ``now`` is passed in with every input.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

#: Round number that means "no round" (validRound / lockedRound / a proposal's POL round).
NIL_ROUND = -1


class Step(enum.IntEnum):
    """The step of a round (Algorithm 1's ``step_p``)."""

    PROPOSE = 0
    PREVOTE = 1
    PRECOMMIT = 2


class VoteType(enum.IntEnum):
    """A vote's kind (Algorithm 1's PREVOTE and PRECOMMIT messages)."""

    PREVOTE = 1
    PRECOMMIT = 2


class TimeoutKind(enum.IntEnum):
    """The three timeouts of Algorithm 1 (``OnTimeoutPropose`` etc.)."""

    PROPOSE = 0
    PREVOTE = 1
    PRECOMMIT = 2


def value_id(value: bytes) -> bytes:
    """The ID of a value: SHA-256 of its bytes (32 bytes)."""
    return hashlib.sha256(value).digest()


@dataclass(frozen=True)
class Validator:
    """One member of the committee: its peer ID (Ed25519, as in ps_p2p.records) and its
    voting power (>= 1)."""

    address: bytes
    power: int = 1


@dataclass(frozen=True)
class Proposal:
    """``<PROPOSAL, h, r, v, validRound>`` of Algorithm 1, signed by ``proposer``.

    ``signature`` is b"" when the core emits it (the driver signs it, see
    :mod:`ps_p2p.consensus.signing`)."""

    height: int
    round: int
    value: bytes
    pol_round: int  # validRound of the proposer, or NIL_ROUND
    proposer: bytes
    signature: bytes = b""

    @property
    def value_id(self) -> bytes:
        return value_id(self.value)


@dataclass(frozen=True)
class Vote:
    """``<PREVOTE|PRECOMMIT, h, r, id(v) or nil>`` of Algorithm 1, signed by ``validator``.

    ``signature`` is b"" when the core emits it (the driver signs it)."""

    type: VoteType
    height: int
    round: int
    value_id: bytes | None  # None: nil
    validator: bytes
    signature: bytes = b""


# --------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class StartHeight:
    """Begin height ``height`` with ``validators`` (Algorithm 1's ``StartRound(0)``).

    ``excluded``: addresses of validators that vote but never propose (committed evidence
    against them, :attr:`ps_p2p.registry.AppState.excluded`); the proposer rotation runs
    over the others (all of them when every validator is excluded). Both come from the
    committed state of height ``height - 1``, so every validator rotates alike."""

    height: int
    validators: tuple[Validator, ...]
    excluded: frozenset[bytes] = frozenset()


@dataclass(frozen=True)
class ProposalReceived:
    """A proposal from a peer (or our own, looped back), its signature already checked.

    ``timely``: for a fresh proposal (``pol_round`` -1), whether the driver found it timely
    when it arrived (its block time near the driver's clock, its block naming the round's
    proposer: proposer-based timestamps). Only L22 reads it; it is a property of this
    proposal's arrival, never part of ``valid(v)`` (issue 17: a validator that restarted 28 s
    late refused the value of a round-0 proposal for the whole height, re-proposals included).
    Ignored for a re-proposal (``pol_round >= 0``: L28 asks for its POL, not its time).
    """

    proposal: Proposal
    timely: bool = True


@dataclass(frozen=True)
class VoteReceived:
    """A vote from a peer (or our own, looped back), its signature already checked."""

    vote: Vote


@dataclass(frozen=True)
class TimeoutFired:
    """A timeout scheduled by :class:`ScheduleTimeout` expired."""

    kind: TimeoutKind
    height: int
    round: int


@dataclass(frozen=True)
class ProposeValue:
    """The application's answer to :class:`GetValue`: the value to propose."""

    height: int
    round: int
    value: bytes


@dataclass(frozen=True)
class ValueValidated:
    """The application's answer to :class:`ValidateValue`: Algorithm 1's ``valid(v)``."""

    height: int
    round: int
    value_id: bytes
    valid: bool


@dataclass(frozen=True)
class RestoreLock:
    """After a restart: this validator precommitted ``value`` in ``round`` of ``height`` before
    it stopped (its write-ahead log says so), so Algorithm 1 had set ``lockedValue`` and
    ``validValue`` to ``value`` and ``lockedRound`` and ``validRound`` to ``round`` (L38-42).
    Restoring them keeps a restarted validator from prevoting for another value later in the
    height, which a fresh state would allow."""

    height: int
    round: int
    value: bytes


Input = (StartHeight | ProposalReceived | VoteReceived | TimeoutFired | ProposeValue
         | ValueValidated | RestoreLock)


# --------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class BroadcastProposal:
    """Sign (after the WAL write) and send ``proposal`` to every validator, ourselves
    included."""

    proposal: Proposal


@dataclass(frozen=True)
class BroadcastVote:
    """Sign (after the WAL write) and send ``vote`` to every validator, ourselves included."""

    vote: Vote


@dataclass(frozen=True)
class ScheduleTimeout:
    """Fire :class:`TimeoutFired` (kind, height, round) after ``duration`` seconds."""

    kind: TimeoutKind
    height: int
    round: int
    duration: float


@dataclass(frozen=True)
class GetValue:
    """We propose at (height, round) and have no valid value: ask the application for one
    (answer: :class:`ProposeValue`)."""

    height: int
    round: int


@dataclass(frozen=True)
class ValidateValue:
    """Check ``value`` (answer: :class:`ValueValidated`)."""

    height: int
    round: int
    value: bytes


@dataclass(frozen=True)
class Decide:
    """Height ``height`` decided ``value`` in ``round``; ``commit`` holds the 2f+1 (by power)
    precommits for it (the quorum certificate). The driver persists it, applies the value and
    starts the next height."""

    height: int
    round: int
    value: bytes
    commit: tuple[Vote, ...]


@dataclass(frozen=True)
class Equivocation:
    """Evidence: ``first`` and ``second`` are two different signed votes of one validator for
    one (type, height, round)."""

    first: Vote
    second: Vote


@dataclass(frozen=True)
class ProposalEquivocation:
    """Evidence: ``first`` and ``second`` are two signed proposals of one proposer for one
    (height, round) with different values."""

    first: Proposal
    second: Proposal


Output = (BroadcastProposal | BroadcastVote | ScheduleTimeout | GetValue | ValidateValue | Decide
          | Equivocation | ProposalEquivocation)
