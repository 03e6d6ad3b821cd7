"""The vote keeper: votes of one height in, thresholds out (pure; no I/O, clock or randomness).

Source: Algorithm 1 of Buchman, Kwon, Milosevic, "The latest gossip on BFT consensus"
(arXiv 1807.04938). Line numbers ``Lnn`` are those of Algorithm 1 in that paper (lines 11-21
StartRound, 22-54 the ``upon`` rules, 55-56 round skipping, 57-67 the timeouts). The keeper
answers the counting questions of its ``upon`` rules:

* ``2f+1 <PREVOTE|PRECOMMIT, h, r, id(v)>`` (L28, L36, L44, L49): more than 2/3 of the total
  voting power voted for one value ID (or nil) in round r: :meth:`VoteKeeper.has_quorum`;
* ``2f+1 <PREVOTE|PRECOMMIT, h, r, *>`` (L34, L47): more than 2/3 of the power voted anything
  in round r: :meth:`VoteKeeper.has_quorum_any`;
* ``f+1 <*, h, round, *, *>`` with ``round > round_p`` (L55): validators holding more than 1/3
  of the power sent a proposal or a vote of that round, each counted once however many messages
  it sent: :meth:`VoteKeeper.skip_round`.

"2f+1" and "f+1" are read by power (the paper's N = 3f+1 validators of power 1 is the special
case): ``3 * power > 2 * total`` and ``3 * power > total``.

Contract of :meth:`VoteKeeper.add_vote` (like CometBFT's ``VoteSet.AddVote``):

* a vote of another height, or of an address outside the validator set, is refused
  (``NOT_VALIDATOR``): identities are free, so a vote only counts for the power its signer holds
  in the set, and storing votes of non-members would let anyone fill our memory;
* a second copy of a vote already held (same type, round, value ID and validator) is refused as
  ``DUPLICATE``: a vote is counted once, so re-sent messages (gossip, our own loop-back) are
  harmless;
* a vote that conflicts with the one held (same validator, type, height and round, another value
  ID) is ``CONFLICT``. The first conflict of a validator for a (type, round) is returned as
  :class:`~ps_p2p.consensus.types.Equivocation` evidence (held vote first); later ones give no
  new evidence (one pair proves the fault). The first vote alone counts for the "any" totals
  (L34, L47) and for L55. A conflicting vote is also counted for its own value ID, once per
  validator and value, if that value is *wanted* (:meth:`VoteKeeper.want`: nil, or the value of
  one of the first proposals the core received per round at this height), and dropped
  otherwise. This is the paper's
  counting (every message counts; quorum intersection keeps it safe: two 2f+1 sets for two
  values of one round share a correct validator, who never votes twice), bounded to the values
  the rules can ask about. Counting only the first vote is not live: an equivocator that sends
  ``id(v)`` to p and nil to q lets p lock on a polka that q can never see, so q never accepts
  p's proposal of v (L28) and no other value gets 2f+1 while p stays locked (CometBFT avoids
  this with its peers' ``VoteSetMaj23`` claims, which we do not have);
* a vote of a round the keeper will not track (see bounds) is ``ROUND_REFUSED``.

Bounds (votes a Byzantine validator can make us hold): rounds at or below the current round
(:meth:`VoteKeeper.set_round`) are always tracked; the current round grows only through timeouts
or through L55, which needs a correct validator in the higher round, so these rounds grow with
time, not with what faulty validators send. Each validator may open at most
:data:`MAX_FUTURE_ROUNDS_PER_VALIDATOR` rounds above the current one (CometBFT's
"catch-up rounds"); messages of a third such round are refused until our round catches up. Rounds
above :data:`MAX_ROUND` are refused. Hence at most ``(round + 1) + 2 * N`` rounds, each
holding per validator and type one vote plus at most one conflicting vote per wanted value
(wanted values: nil and at most four per tracked round, see
:data:`ps_p2p.consensus.core.MAX_WANTED_PER_ROUND`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ps_p2p.consensus.types import Equivocation, Validator, Vote, VoteType

__all__ = [
    "MAX_FUTURE_ROUNDS_PER_VALIDATOR",
    "MAX_ROUND",
    "AddVoteResult",
    "VoteKeeper",
]

#: Rounds above the current round one validator may make us track (see the module docstring).
MAX_FUTURE_ROUNDS_PER_VALIDATOR = 2
#: Rounds above this are refused outright (a height never gets near it: timeouts grow per round).
MAX_ROUND = 2**31 - 1


class AddVoteResult(enum.Enum):
    """What :meth:`VoteKeeper.add_vote` did with a vote."""

    ADDED = "added"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"
    NOT_VALIDATOR = "not_validator"
    ROUND_REFUSED = "round_refused"


@dataclass
class _Tally:
    """Votes of one type in one round."""

    by_validator: dict[bytes, Vote] = field(default_factory=dict)
    power_by_value: dict[bytes | None, int] = field(default_factory=dict)
    power: int = 0
    accused: set[bytes] = field(default_factory=set)  # validators with evidence already given
    # validator -> value IDs counted from its conflicting votes (wanted values only)
    extra: dict[bytes, dict[bytes | None, Vote]] = field(default_factory=dict)


@dataclass
class _Round:
    prevotes: _Tally = field(default_factory=_Tally)
    precommits: _Tally = field(default_factory=_Tally)
    senders: set[bytes] = field(default_factory=set)  # L55: proposals and votes, once each
    sender_power: int = 0

    def tally(self, vote_type: VoteType) -> _Tally:
        return self.prevotes if vote_type == VoteType.PREVOTE else self.precommits


class VoteKeeper:
    """Counts the votes of one height by voting power (see the module docstring).

    Args:
        height: the height whose votes this keeper takes.
        validators: the validator set (addresses unique, power >= 1).

    Raises:
        ValueError: empty set, duplicate address or power below 1.
    """

    def __init__(self, height: int, validators: tuple[Validator, ...] | list[Validator]) -> None:
        if not validators:
            raise ValueError("empty validator set")
        power: dict[bytes, int] = {}
        for v in validators:
            if v.power < 1:
                raise ValueError(f"validator power must be >= 1, got {v.power}")
            if v.address in power:
                raise ValueError("duplicate validator address")
            power[v.address] = v.power
        self.height = height
        self._power = power
        self.total_power = sum(power.values())
        self._rounds: dict[int, _Round] = {}
        self._rounds_of: dict[bytes, set[int]] = {a: set() for a in power}
        self._current_round = 0
        # (round, type) -> the value ID (None: nil) that reached 2f+1 there, set when it does.
        self._quorums: dict[tuple[int, VoteType], bytes | None] = {}
        # rounds whose senders reached more than 1/3 of the power (L55 candidates)
        self._one_third_rounds: set[int] = set()
        self._wanted: set[bytes | None] = {None}

    # ------------------------------------------------------------------ thresholds (by power)

    def is_quorum(self, power: int) -> bool:
        """2f+1: more than 2/3 of the total power."""
        return 3 * power > 2 * self.total_power

    def is_one_third(self, power: int) -> bool:
        """f+1: more than 1/3 of the total power."""
        return 3 * power > self.total_power

    def power_of(self, address: bytes) -> int:
        """Voting power of ``address`` (0 outside the set)."""
        return self._power.get(address, 0)

    # ------------------------------------------------------------------ input

    def set_round(self, round_: int) -> None:
        """Our current round (the future-round bound is relative to it); never decreases."""
        self._current_round = max(self._current_round, round_)

    def round_refused(self, address: bytes, round_: int) -> bool:
        """Whether a vote or proposal of ``address`` in ``round_`` would be refused for its
        round (``ROUND_REFUSED``, see bounds); changes nothing. Lets the caller drop it
        before checking its signature."""
        if round_ in self._rounds_of.get(address, ()):
            return False
        if round_ < 0 or round_ > MAX_ROUND:
            return True
        if round_ <= self._current_round or address not in self._rounds_of:
            return False
        future = sum(1 for r in self._rounds_of[address] if r > self._current_round)
        return future >= MAX_FUTURE_ROUNDS_PER_VALIDATOR

    def adds_nothing(self, vote: Vote) -> bool:
        """Whether :meth:`add_vote` would change nothing and give no evidence for ``vote``,
        whatever its signature: a copy of a vote held (``DUPLICATE``), or a further conflicting
        vote of a validator already accused in that (type, round) for a value already counted
        or not wanted (``CONFLICT``, dropped). Changes nothing."""
        rnd = self._rounds.get(vote.round)
        if vote.height != self.height or rnd is None:
            return False
        tally = rnd.tally(vote.type)
        held = tally.by_validator.get(vote.validator)
        if held is None:
            return False
        if held.value_id == vote.value_id:
            return True
        return vote.validator in tally.accused and (
            vote.value_id in tally.extra.get(vote.validator, {})
            or vote.value_id not in self._wanted)

    def _round_for(self, address: bytes, round_: int) -> _Round | None:
        """The round's record, opening it if the bounds allow; None: refused."""
        rnd = self._rounds.get(round_)
        mine = self._rounds_of[address]
        if round_ in mine:
            return rnd
        if round_ < 0 or round_ > MAX_ROUND:
            return None
        if round_ > self._current_round:
            future = sum(1 for r in mine if r > self._current_round)
            if future >= MAX_FUTURE_ROUNDS_PER_VALIDATOR:
                return None
        if rnd is None:
            rnd = self._rounds[round_] = _Round()
        mine.add(round_)
        return rnd

    def _count_sender(self, rnd: _Round, round_: int, address: bytes) -> None:
        if address not in rnd.senders:
            rnd.senders.add(address)
            rnd.sender_power += self._power[address]
            if self.is_one_third(rnd.sender_power):
                self._one_third_rounds.add(round_)

    def add_proposal(self, round_: int, proposer: bytes) -> bool:
        """Count a proposal of ``round_`` for L55 (its sender once per round).

        The caller has checked that ``proposer`` is the round's proposer.

        Returns:
            False if the sender is no validator or the round is refused (see bounds).
        """
        if proposer not in self._power:
            return False
        rnd = self._round_for(proposer, round_)
        if rnd is None:
            return False
        self._count_sender(rnd, round_, proposer)
        return True

    def add_vote(self, vote: Vote) -> tuple[AddVoteResult, Equivocation | None]:
        """Add one (signature-checked) vote.

        Returns:
            (result, evidence): evidence is an :class:`Equivocation` (held vote first) only with
            the first ``CONFLICT`` of a validator for a (type, round); None otherwise.
        """
        if vote.height != self.height or vote.validator not in self._power:
            return AddVoteResult.NOT_VALIDATOR, None
        rnd = self._round_for(vote.validator, vote.round)
        if rnd is None:
            return AddVoteResult.ROUND_REFUSED, None
        tally = rnd.tally(vote.type)
        held = tally.by_validator.get(vote.validator)
        if held is not None:
            if held.value_id == vote.value_id:
                return AddVoteResult.DUPLICATE, None
            evidence = None
            if vote.validator not in tally.accused:
                tally.accused.add(vote.validator)
                evidence = Equivocation(first=held, second=vote)
            extra = tally.extra.setdefault(vote.validator, {})
            if vote.value_id in extra:
                return AddVoteResult.DUPLICATE, evidence
            if vote.value_id in self._wanted:
                extra[vote.value_id] = vote
                self._count_value(tally, vote)
            return AddVoteResult.CONFLICT, evidence
        tally.by_validator[vote.validator] = vote
        tally.power += self._power[vote.validator]
        self._count_value(tally, vote)
        self._count_sender(rnd, vote.round, vote.validator)
        return AddVoteResult.ADDED, None

    def _count_value(self, tally: _Tally, vote: Vote) -> None:
        value_power = tally.power_by_value.get(vote.value_id, 0) + self._power[vote.validator]
        tally.power_by_value[vote.value_id] = value_power
        if self.is_quorum(value_power):
            self._quorums[(vote.round, vote.type)] = vote.value_id

    def want(self, value_id: bytes) -> None:
        """Count conflicting votes for ``value_id`` from now on (the core calls it for the
        value of every proposal it holds; nil is always wanted). See the module docstring."""
        self._wanted.add(value_id)

    # ------------------------------------------------------------------ queries

    def power_for(self, round_: int, vote_type: VoteType, value_id: bytes | None) -> int:
        """Power that voted ``value_id`` (None: nil) with ``vote_type`` in ``round_``."""
        rnd = self._rounds.get(round_)
        return 0 if rnd is None else rnd.tally(vote_type).power_by_value.get(value_id, 0)

    def powers(self, round_: int, vote_type: VoteType) -> dict[bytes | None, int]:
        """Power per value ID (None: nil) that voted ``vote_type`` in ``round_`` (a copy)."""
        rnd = self._rounds.get(round_)
        return {} if rnd is None else dict(rnd.tally(vote_type).power_by_value)

    def has_quorum(self, round_: int, vote_type: VoteType, value_id: bytes | None) -> bool:
        """2f+1 ``<vote_type, h, round_, value_id>`` (None: nil): L28, L36, L44, L49."""
        return self.is_quorum(self.power_for(round_, vote_type, value_id))

    def has_quorum_any(self, round_: int, vote_type: VoteType) -> bool:
        """2f+1 ``<vote_type, h, round_, *>``: L34, L47."""
        rnd = self._rounds.get(round_)
        return rnd is not None and self.is_quorum(rnd.tally(vote_type).power)

    def quorum_value(self, round_: int, vote_type: VoteType) -> tuple[bool, bytes | None]:
        """(True, value ID or None for nil) if one value has 2f+1 in the round, else (False, None).

        At most one value can: two quorums of more than 2/3 share more than 1/3 of the power,
        and the keeper counts one vote per validator, type and round.
        """
        key = (round_, vote_type)
        if key in self._quorums:
            return True, self._quorums[key]
        return False, None

    def skip_round(self, above: int) -> int | None:
        """L55: the highest round above ``above`` from which validators of more than 1/3 of
        the power sent a proposal or vote (each once); None if there is none."""
        higher = [r for r in self._one_third_rounds if r > above]
        return max(higher) if higher else None

    def votes_for(
        self, round_: int, vote_type: VoteType, value_id: bytes | None
    ) -> tuple[Vote, ...]:
        """The votes counted for ``value_id`` in ``round_``, one per validator, sorted by
        address (e.g. the commit of a decision: the precommits for the decided value)."""
        rnd = self._rounds.get(round_)
        if rnd is None:
            return ()
        tally = rnd.tally(vote_type)
        votes = []
        for addr, v in tally.by_validator.items():
            if v.value_id == value_id:
                votes.append(v)
            elif value_id in tally.extra.get(addr, {}):
                votes.append(tally.extra[addr][value_id])
        return tuple(sorted(votes, key=lambda v: v.validator))

    def votes_of(self, round_: int) -> tuple[Vote, ...]:
        """Every vote held of ``round_`` (both types; conflicting ones the keeper counts
        too): what a validator relays to a peer that lacks them (gossip)."""
        rnd = self._rounds.get(round_)
        if rnd is None:
            return ()
        out: list[Vote] = []
        for vote_type in (VoteType.PREVOTE, VoteType.PRECOMMIT):
            tally = rnd.tally(vote_type)
            out.extend(tally.by_validator.values())
            for extra in tally.extra.values():
                out.extend(extra.values())
        return tuple(out)

    def rounds(self) -> list[int]:
        """The rounds tracked, ascending."""
        return sorted(self._rounds)

    def rounds_with_quorum(self, vote_type: VoteType) -> list[int]:
        """The rounds in which some value (or nil) has 2f+1 of ``vote_type``, ascending."""
        return sorted(r for (r, t) in self._quorums if t == vote_type)
