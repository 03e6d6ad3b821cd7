"""The round state machine of one validator (pure; no I/O, clock or randomness).

Source: Algorithm 1 of Buchman, Kwon, Milosevic, "The latest gossip on BFT consensus"
(arXiv 1807.04938, v3). Comments ``# Lnn`` cite its line numbers: 11-21 ``StartRound``, 22-27
a proposal with ``validRound = -1``, 28-33 a proposal with ``validRound >= 0`` and its polka,
34-35 the prevote timeout, 36-43 lock / valid value, 44-46 a nil polka, 47-48 the precommit
timeout, 49-54 decide, 55-56 round skipping, 57-67 ``OnTimeoutPropose/Prevote/Precommit``.

Use: ``outputs = core.handle(input, now)`` for every input of
:mod:`ps_p2p.consensus.types`; the driver carries out the outputs. The core keeps the state of
Algorithm 1 (height, round, step, lockedValue/lockedRound, validValue/validRound) and, per
height, a :class:`~ps_p2p.consensus.votes.VoteKeeper` and the proposals received.

Contract with the driver:

* **Own messages loop back.** The core never counts its own proposal or vote when it emits
  it: the driver writes it to the WAL, signs it, sends it to the other validators and hands it
  back to this core as :class:`ProposalReceived` / :class:`VoteReceived`, which then counts
  exactly like a peer's. Hence nothing the core has counted can be lost in a crash before the
  WAL write, and a restarted validator that replays its WAL rebuilds the same counts.
* **Decide, then StartHeight.** :class:`Decide` ends the height (L49-51); the core then ignores
  everything of that height. The driver persists the decision, applies the value and sends
  ``StartHeight(h + 1, validators)``, which does L52-54 (reset, ``StartRound(0)``).
* **Validity is the application's.** Every proposed value is sent out once per height as
  :class:`ValidateValue`; the rules that need ``valid(v)`` (L22, L28, L36, L49) wait for the
  :class:`ValueValidated` answer. A value the application gave us (:class:`ProposeValue`) is
  valid without asking. ``valid(v)`` is a property of the value and is cached for the height;
  whether a *fresh* proposal was timely (proposer-based timestamps) is a property of that
  proposal's arrival: the driver decides it once, when the proposal arrives
  (:attr:`ProposalReceived.timely`), and only L22 reads it. It never enters ``valid(v)``, so a
  value refused as late in its round is still valid when re-proposed with a POL round (L28),
  when its polka forms (L36) and when its commit arrives (L49).
* **Timeouts** are asked for with :class:`ScheduleTimeout`; a stale :class:`TimeoutFired` (other
  height, round or step) does nothing (L58, L62, L66).

Proposer rotation: deterministic and weighted by power, by smooth weighted round robin (as in
nginx's upstream balancing): over the validators sorted by address, each step adds every
validator's power to its credit, picks the highest credit (ties: lowest address) and takes the
total power from the winner. One cycle has ``total_power / gcd(powers)`` slots, in which each
validator proposes ``power / gcd`` times, spread out rather than in runs; with equal powers it is
plain round robin by address. ``proposer(h, r) = cycle[(h + r) % len(cycle)]``. The cycle runs
over the validators not in ``StartHeight.excluded`` (committed evidence against them; all of
them when every one is excluded); they still vote. A second value signed by the round's
proposer is reported once per round (:class:`~ps_p2p.consensus.types.ProposalEquivocation`).

Deviations from the paper, each harmless to safety:

* L18: ``getValue()`` is asynchronous here (:class:`GetValue`), and the application may never
  answer, so the proposer schedules the propose timeout too while it waits (L57 then prevotes
  nil as every other validator would).
* A proposal whose ``pol_round`` is not in ``[-1, round)`` is malformed and dropped: no rule can
  prevote for it (L22 needs -1, L28 needs ``vr < round``).
* One proposal per round is kept from the proposer, plus one other value of the same round if
  2f+1 prevotes or precommits of that round are already held for it (a Byzantine proposer may
  send different proposals; the one the committee voted for is needed by L36 and L49). The
  values of the first :data:`MAX_WANTED_PER_ROUND` proposals of a round, kept or not, are
  *wanted* by the vote keeper (their conflicting votes count, see
  :mod:`ps_p2p.consensus.votes`), so a validator that first saw another value can still count
  the committee's commit when it is sent again (simulation seed 5012 got stuck without it).
  Limitation: a Byzantine proposer that sends a validator more than that many values of one
  round first can keep it from counting an equivocator's vote for the committee's value; a
  commit-certificate input (block sync) would close this.

Bounds (what faulty validators can make us hold): votes as in
:mod:`ps_p2p.consensus.votes` (rounds up to ours, plus two future rounds per validator);
proposals at most two per tracked round (wanted values four; a proposal of a round the vote
keeper refuses for its proposer is dropped before its value is wanted, so a Byzantine proposer
cannot grow the wanted sets with rounds far ahead); validation requests one per kept
proposal; messages of
the next height (``h + 1``) are buffered, at most
:attr:`ConsensusConfig.next_height_buffer` per validator of the current set, and replayed by
``StartHeight(h + 1)``: a validator that decides a little later than the others would otherwise
miss the next height's proposal. Messages of heights above ``h + 1`` are dropped (block sync and
gossip re-sending are the driver's: a validator that far behind needs the commits, not votes).
:meth:`ConsensusCore.ignores` tells the driver, without changing anything, which messages would
be dropped whatever their signature, so it can skip their signature check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ps_p2p.consensus.types import (
    NIL_ROUND,
    BroadcastProposal,
    BroadcastVote,
    Decide,
    GetValue,
    Input,
    Output,
    Proposal,
    ProposalEquivocation,
    ProposalReceived,
    ProposeValue,
    RestoreLock,
    ScheduleTimeout,
    StartHeight,
    Step,
    TimeoutFired,
    TimeoutKind,
    ValidateValue,
    Validator,
    ValueValidated,
    Vote,
    VoteReceived,
    VoteType,
    value_id,
)
from ps_p2p.consensus.votes import MAX_ROUND, VoteKeeper
from ps_p2p.errors import LocalProtocolError

__all__ = [
    "MAX_PROPOSER_CYCLE",
    "ConsensusConfig",
    "ConsensusCore",
    "RoundState",
    "proposer_cycle",
]

#: Values of one round's proposer whose conflicting votes the vote keeper counts (its
#: ``want``), at most: one honest value, and room for a Byzantine proposer's equivocation.
MAX_WANTED_PER_ROUND = 4

#: Slots of one proposer cycle at most (``total_power / gcd(powers)``); larger sets are refused.
MAX_PROPOSER_CYCLE = 1 << 16


@dataclass(frozen=True)
class ConsensusConfig:
    """Timeouts (seconds) and bounds of :class:`ConsensusCore`.

    The timeout of round r is ``base + r * delta`` (Algorithm 1's ``timeoutPropose(r)`` etc.
    grow with r so that, after GST, some round lasts long enough for correct validators to
    hear each other). Defaults are CometBFT's.
    """

    timeout_propose: float = 3.0
    timeout_propose_delta: float = 0.5
    timeout_prevote: float = 1.0
    timeout_prevote_delta: float = 0.5
    timeout_precommit: float = 1.0
    timeout_precommit_delta: float = 0.5
    #: messages of height h + 1 buffered per validator of the current set
    next_height_buffer: int = 16
    #: the ID votes carry for a value (``id(v)`` of Algorithm 1): SHA-256 of the value by
    #: default; the registry passes ps_p2p.consensus.block.consensus_value_id (the block ID,
    #: a hash of the header only, so a node checks a commit from the header alone). It must be
    #: deterministic, collision-resistant and total (never raise: an undecodable value still
    #: gets an ID, and fails validation).
    value_id: Callable[[bytes], bytes] = value_id

    def timeout(self, kind: TimeoutKind, round_: int) -> float:
        """Duration (seconds) of the ``kind`` timeout in round ``round_`` (>= 0)."""
        if kind == TimeoutKind.PROPOSE:
            return self.timeout_propose + round_ * self.timeout_propose_delta
        if kind == TimeoutKind.PREVOTE:
            return self.timeout_prevote + round_ * self.timeout_prevote_delta
        return self.timeout_precommit + round_ * self.timeout_precommit_delta


@dataclass(frozen=True)
class RoundState:
    """A snapshot of Algorithm 1's variables (for tests, logs and metrics).

    ``height`` is None before the first :class:`StartHeight`; ``decided`` is the decided value
    of ``height`` (None while undecided).
    """

    height: int | None
    round: int
    step: Step
    locked_value: bytes | None
    locked_round: int
    valid_value: bytes | None
    valid_round: int
    decided: bytes | None


def proposer_cycle(validators: tuple[Validator, ...] | list[Validator]) -> tuple[bytes, ...]:
    """One cycle of the proposer rotation (smooth weighted round robin; see the module
    docstring), as validator addresses.

    Raises:
        ValueError: empty set, or more than :data:`MAX_PROPOSER_CYCLE` slots.
    """
    if not validators:
        raise ValueError("empty validator set")
    ordered = sorted(validators, key=lambda v: v.address)
    g = 0
    for v in ordered:
        g = math.gcd(g, v.power)
    weights = [v.power // g for v in ordered]
    total = sum(weights)
    if total > MAX_PROPOSER_CYCLE:
        raise ValueError(f"proposer cycle of {total} slots exceeds {MAX_PROPOSER_CYCLE}")
    credit = [0] * len(ordered)
    cycle = []
    for _ in range(total):
        for i, w in enumerate(weights):
            credit[i] += w
        best = max(range(len(ordered)), key=lambda i: (credit[i], -i))
        credit[best] -= total
        cycle.append(ordered[best].address)
    return tuple(cycle)


class ConsensusCore:
    """Algorithm 1 for one validator (see the module docstring for the driver contract).

    Args:
        address: our validator address (peer ID bytes), as in :class:`Validator`.
        config: timeouts and bounds.
    """

    def __init__(self, address: bytes, config: ConsensusConfig | None = None) -> None:
        self.address = address
        self.config = config or ConsensusConfig()
        self.height: int | None = None
        self.round = 0
        self.step = Step.PROPOSE
        self.locked_value: bytes | None = None
        self.locked_round = NIL_ROUND
        self.valid_value: bytes | None = None
        self.valid_round = NIL_ROUND
        self.decision: Decide | None = None
        self.validators: tuple[Validator, ...] = ()
        self._cycle: tuple[bytes, ...] = ()
        self._keeper: VoteKeeper | None = None
        # round -> value ID -> proposal (at most two per round, see the module docstring)
        self._proposals: dict[int, dict[bytes, Proposal]] = {}
        # round -> value IDs of the proposer's proposals whose conflicting votes count
        self._wanted: dict[int, set[bytes]] = {}
        self._proposal_evidence: set[int] = set()  # rounds whose double proposal was reported
        self._validity: dict[bytes, bool] = {}  # value ID -> valid(v)
        # (round, value ID) -> timely, of the fresh proposals kept (L22 only)
        self._timely: dict[tuple[int, bytes], bool] = {}
        self._validating: set[bytes] = set()  # ValidateValue sent, no answer yet
        self._awaiting_value: tuple[int, int] | None = None  # GetValue sent for (h, r)
        # "for the first time" rules of the current round
        self._l34_done = False
        self._l36_done = False
        self._l47_done = False
        # messages of height + 1, and how many each sender has there
        self._next: list[ProposalReceived | VoteReceived] = []
        self._next_seen: set[ProposalReceived | VoteReceived] = set()
        self._next_count: dict[bytes, int] = {}

    # ------------------------------------------------------------------ views

    def state(self) -> RoundState:
        """The current values of Algorithm 1's variables."""
        return RoundState(
            height=self.height,
            round=self.round,
            step=self.step,
            locked_value=self.locked_value,
            locked_round=self.locked_round,
            valid_value=self.valid_value,
            valid_round=self.valid_round,
            decided=None if self.decision is None else self.decision.value,
        )

    @property
    def keeper(self) -> VoteKeeper | None:
        """The vote keeper of the current height (None before the first StartHeight)."""
        return self._keeper

    def proposer(self, height: int, round_: int) -> bytes:
        """``proposer(h, r)`` of Algorithm 1 for the current validator set (module docstring).

        Raises:
            LocalProtocolError: no validator set yet (before the first StartHeight).
        """
        if not self._cycle:
            raise LocalProtocolError("no validator set: StartHeight first")
        return self._cycle[(height + round_) % len(self._cycle)]

    def ignores(self, message: Proposal | Vote) -> bool:
        """Whether :meth:`handle` would drop this peer's proposal or vote without any change
        or output whatever its signature (a stale or far height, a full next-height buffer,
        a round the vote keeper refuses, a vote already held or a conflicting one that adds
        nothing (:meth:`~ps_p2p.consensus.votes.VoteKeeper.adds_nothing`), a proposal from
        another than the round's proposer); pure. A driver may drop such a message before checking its
        signature (issue 16: a validator's flood of valid but useless votes cost one
        signature check and one pass of the rules each)."""
        if self.height is None or self._keeper is None:
            return False
        sender = message.proposer if isinstance(message, Proposal) else message.validator
        if message.height == self.height + 1:
            if all(v.address != sender for v in self.validators):
                return True
            return self._next_count.get(sender, 0) >= self.config.next_height_buffer
        if message.height != self.height or self.decision is not None:
            return True
        if isinstance(message, Vote):
            if not self._keeper.power_of(message.validator):
                return True
            return (self._keeper.round_refused(message.validator, message.round)
                    or self._keeper.adds_nothing(message))
        p = message
        if not (0 <= p.round <= MAX_ROUND and NIL_ROUND <= p.pol_round < p.round):
            return True
        if p.proposer != self.proposer(p.height, p.round):
            return True
        return self._keeper.round_refused(p.proposer, p.round)

    def proposals(self, round_: int) -> tuple[Proposal, ...]:
        """The proposals of ``round_`` kept at the current height (at most two; signed, as
        received): what a validator relays to a peer that lacks them."""
        return tuple(self._proposals.get(round_, {}).values())

    def proposal_for(self, round_: int, value_id: bytes) -> Proposal | None:
        """The kept proposal of ``round_`` whose value has ID ``value_id``, or None."""
        return self._proposals.get(round_, {}).get(value_id)

    # ------------------------------------------------------------------ input

    def handle(self, inp: Input, now: float) -> list[Output]:
        """Apply one input; return the outputs to carry out, in order.

        Args:
            inp: one of the inputs of :mod:`ps_p2p.consensus.types`; peers' messages with their
                signatures already checked by the driver.
            now: seconds (any monotonic clock); the core keeps no clock and needs no time:
                timeouts are durations in :class:`ScheduleTimeout`.

        Returns:
            Outputs (see :mod:`ps_p2p.consensus.types`); [] for anything stale, duplicate or
            refused.

        Raises:
            LocalProtocolError: ``StartHeight`` for a height not above the current one, or an
                invalid validator set.
        """
        del now  # timeouts are relative; the core needs no clock
        out: list[Output] = []
        if isinstance(inp, StartHeight):
            self._start_height(inp, out)
        elif self.height is None:
            return out
        elif isinstance(inp, ProposalReceived):
            self._on_proposal(inp, out)
        elif isinstance(inp, VoteReceived):
            self._on_vote(inp, out)
        elif isinstance(inp, TimeoutFired):
            self._on_timeout(inp, out)
        elif isinstance(inp, ProposeValue):
            self._on_propose_value(inp, out)
        elif isinstance(inp, ValueValidated):
            self._on_validated(inp)
        elif isinstance(inp, RestoreLock):
            self._on_restore_lock(inp)
        else:
            raise LocalProtocolError(f"not a consensus input: {inp!r}")
        while self.decision is None and self.height is not None and self._apply_rule(out):
            pass
        return out

    # ------------------------------------------------------------------ heights and rounds

    def _start_height(self, inp: StartHeight, out: list[Output]) -> None:
        if self.height is not None and inp.height <= self.height:
            raise LocalProtocolError(f"StartHeight({inp.height}) after height {self.height}")
        try:
            keeper = VoteKeeper(inp.height, inp.validators)
            # evidence excludes a validator from proposing (StartHeight.excluded), never all
            eligible = [v for v in inp.validators if v.address not in inp.excluded]
            cycle = proposer_cycle(eligible or inp.validators)
        except ValueError as exc:
            raise LocalProtocolError(f"bad validator set: {exc}") from exc
        buffered = self._next if self.height is not None and inp.height == self.height + 1 else []
        # L52-53: next height; reset lockedRound, lockedValue, validRound, validValue; empty log
        self.height = inp.height
        self.validators = tuple(inp.validators)
        self._cycle = cycle
        self._keeper = keeper
        self.locked_value, self.locked_round = None, NIL_ROUND
        self.valid_value, self.valid_round = None, NIL_ROUND
        self.decision = None
        self._proposals = {}
        self._wanted = {}
        self._proposal_evidence = set()
        self._validity = {}
        self._timely = {}
        self._validating = set()
        self._awaiting_value = None
        self._next, self._next_seen, self._next_count = [], set(), {}
        self._start_round(0, out)  # L10 (upon start) / L54
        for msg in buffered:
            if isinstance(msg, ProposalReceived):
                self._on_proposal(msg, out)
            else:
                self._on_vote(msg, out)

    def _start_round(self, round_: int, out: list[Output]) -> None:
        """L11-21: StartRound(round)."""
        assert self.height is not None and self._keeper is not None
        self.round = round_  # L12
        self.step = Step.PROPOSE  # L13
        self._keeper.set_round(round_)
        self._l34_done = self._l36_done = self._l47_done = False
        self._awaiting_value = None
        h = self.height
        if self.proposer(h, round_) == self.address:  # L14
            if self.valid_value is not None:  # L15
                proposal = Proposal(
                    h, round_, self.valid_value, self.valid_round, self.address
                )  # L16
                out.append(BroadcastProposal(proposal))  # L19
            else:  # L17-18: getValue(), answered by ProposeValue
                self._awaiting_value = (h, round_)
                out.append(GetValue(h, round_))
                # L18 deviation: the application may never answer (module docstring)
                out.append(self._schedule(TimeoutKind.PROPOSE))
        else:  # L20-21
            out.append(self._schedule(TimeoutKind.PROPOSE))

    def _schedule(self, kind: TimeoutKind) -> ScheduleTimeout:
        assert self.height is not None
        return ScheduleTimeout(kind, self.height, self.round, self.config.timeout(kind, self.round))

    # ------------------------------------------------------------------ messages

    def _buffer_next(self, msg: ProposalReceived | VoteReceived, sender: bytes) -> None:
        """Keep a message of height + 1 for StartHeight(h + 1) (bounded, module docstring)."""
        if all(v.address != sender for v in self.validators):
            return
        count = self._next_count.get(sender, 0)
        if count >= self.config.next_height_buffer or msg in self._next_seen:
            return
        self._next_count[sender] = count + 1
        self._next_seen.add(msg)
        self._next.append(msg)

    def _on_proposal(self, inp: ProposalReceived, out: list[Output]) -> None:
        p = inp.proposal
        assert self.height is not None and self._keeper is not None
        if p.height == self.height + 1:
            self._buffer_next(inp, p.proposer)
            return
        if p.height != self.height or self.decision is not None:
            return
        if not (0 <= p.round <= MAX_ROUND and NIL_ROUND <= p.pol_round < p.round):
            return  # malformed (module docstring)
        if p.proposer != self.proposer(p.height, p.round):
            return  # L22, L28, L36, L49: only "from proposer(h_p, r)" counts
        if self._keeper.round_refused(p.proposer, p.round):
            return  # a round the keeper does not track yet: nothing of it is held either
        vid = self.config.value_id(p.value)
        wanted = self._wanted.setdefault(p.round, set())
        if vid not in wanted and len(wanted) < MAX_WANTED_PER_ROUND:
            # conflicting votes for it count from now on, even if this proposal is not kept:
            # a lagging validator that holds another value of a Byzantine proposer can then
            # still count the commit of the committee's value when it is sent again
            wanted.add(vid)
            self._keeper.want(vid)
        held = self._proposals.get(p.round)
        if held is not None and vid not in held and p.round not in self._proposal_evidence:
            # two signed values of the round's proposer: evidence (app.ProposalEvidenceTx)
            self._proposal_evidence.add(p.round)
            out.append(ProposalEquivocation(next(iter(held.values())), p))
        if held is not None:
            if vid in held or len(held) >= 2:
                return
            # a second value of the proposer: kept only if the committee voted for it
            k = self._keeper
            if not (
                k.has_quorum(p.round, VoteType.PREVOTE, vid)
                or k.has_quorum(p.round, VoteType.PRECOMMIT, vid)
            ):
                return
        if not self._keeper.add_proposal(p.round, p.proposer):  # L55 counts it
            return
        self._proposals.setdefault(p.round, {})[vid] = p
        self._timely[(p.round, vid)] = inp.timely
        if vid not in self._validity and vid not in self._validating:
            self._validating.add(vid)
            out.append(ValidateValue(p.height, p.round, p.value))

    def _on_vote(self, inp: VoteReceived, out: list[Output]) -> None:
        v = inp.vote
        assert self.height is not None and self._keeper is not None
        if v.height == self.height + 1:
            self._buffer_next(inp, v.validator)
            return
        if v.height != self.height or self.decision is not None:
            return
        _, evidence = self._keeper.add_vote(v)
        if evidence is not None:
            out.append(evidence)

    def _on_propose_value(self, inp: ProposeValue, out: list[Output]) -> None:
        """L18-19: the application's value; broadcast it as our proposal."""
        if self._awaiting_value != (inp.height, inp.round) or self.decision is not None:
            return
        self._awaiting_value = None
        self._validity[self.config.value_id(inp.value)] = True
        proposal = Proposal(inp.height, inp.round, inp.value, self.valid_round, self.address)
        out.append(BroadcastProposal(proposal))  # L19

    def _on_restore_lock(self, inp: RestoreLock) -> None:
        """A precommit for ``inp.value`` in ``inp.round`` from before a restart: the state
        L38-42 set then (a later round's lock wins; the value was valid when we locked it)."""
        if inp.height != self.height or self.decision is not None:
            return
        if inp.round > self.locked_round:
            self.locked_value, self.locked_round = inp.value, inp.round  # L38-39
        if inp.round > self.valid_round:
            self.valid_value, self.valid_round = inp.value, inp.round  # L42-43
        self._validity[self.config.value_id(inp.value)] = True

    def _on_validated(self, inp: ValueValidated) -> None:
        if inp.height == self.height and inp.value_id in self._validating:
            self._validating.discard(inp.value_id)
            self._validity[inp.value_id] = inp.valid

    def _on_timeout(self, inp: TimeoutFired, out: list[Output]) -> None:
        if inp.height != self.height or inp.round != self.round or self.decision is not None:
            return  # L58, L62, L66: stale
        if inp.kind == TimeoutKind.PROPOSE:
            if self.step == Step.PROPOSE:  # L57-58
                self._vote(VoteType.PREVOTE, None, out)  # L59
                self.step = Step.PREVOTE  # L60
        elif inp.kind == TimeoutKind.PREVOTE:
            if self.step == Step.PREVOTE:  # L61-62
                self._vote(VoteType.PRECOMMIT, None, out)  # L63
                self.step = Step.PRECOMMIT  # L64
        else:  # L65-66
            self._start_round(self.round + 1, out)  # L67

    def _vote(self, vote_type: VoteType, vid: bytes | None, out: list[Output]) -> None:
        assert self.height is not None
        out.append(BroadcastVote(Vote(vote_type, self.height, self.round, vid, self.address)))

    # ------------------------------------------------------------------ the upon rules

    def _precommit_quorums(self) -> list[tuple[int, bytes]]:
        """(round, value ID) pairs with 2f+1 precommits for a value (not nil): L49."""
        k = self._keeper
        assert k is not None
        found = []
        for r in k.rounds_with_quorum(VoteType.PRECOMMIT):
            _, vid = k.quorum_value(r, VoteType.PRECOMMIT)
            if vid is not None:
                found.append((r, vid))
        return found

    def _apply_rule(self, out: list[Output]) -> bool:
        """Fire the first enabled rule; True if one fired (the caller loops until none does).

        Order: decide (L49), skip round (L55), then the current round's rules (L22, L28, L36,
        L44, L34, L47). Any order is an execution of Algorithm 1; this one prefers progress to
        scheduling timeouts that would be stale at once.
        """
        k = self._keeper
        assert self.height is not None and k is not None
        h, r = self.height, self.round
        # L49: <PROPOSAL, h, r', v, *> from proposer(h, r') and 2f+1 <PRECOMMIT, h, r', id(v)>
        for r2, vid in self._precommit_quorums():
            p = self._proposals.get(r2, {}).get(vid)
            if p is not None and self._validity.get(vid):  # L50: valid(v)
                commit = k.votes_for(r2, VoteType.PRECOMMIT, vid)
                self.decision = Decide(h, r2, p.value, commit)  # L51
                out.append(self.decision)  # L52-54 on StartHeight(h + 1)
                return True
        # L55: f+1 <*, h, round, *, *> with round > round_p
        skip = k.skip_round(r)
        if skip is not None:
            self._start_round(skip, out)  # L56
            return True
        proposals = self._proposals.get(r, {})
        if self.step == Step.PROPOSE:
            for vid, p in proposals.items():
                valid = self._validity.get(vid)
                if valid is None:
                    continue  # valid(v) not known yet
                if p.pol_round == NIL_ROUND:  # L22
                    # L23; "timely" is the arrival check of this fresh proposal, not valid(v)
                    ok = valid and self._timely.get((r, vid), True) and (
                        self.locked_round == NIL_ROUND or self.locked_value == p.value
                    )
                    self._vote(VoteType.PREVOTE, vid if ok else None, out)  # L24 / L26
                    self.step = Step.PREVOTE  # L27
                    return True
                if k.has_quorum(p.pol_round, VoteType.PREVOTE, vid):  # L28 (0 <= vr < r)
                    ok = valid and (
                        self.locked_round <= p.pol_round or self.locked_value == p.value
                    )  # L29
                    self._vote(VoteType.PREVOTE, vid if ok else None, out)  # L30 / L32
                    self.step = Step.PREVOTE  # L33
                    return True
        if self.step >= Step.PREVOTE and not self._l36_done:  # L36
            found, vid = k.quorum_value(r, VoteType.PREVOTE)
            if found and vid is not None and vid in proposals and self._validity.get(vid):
                value = proposals[vid].value
                self._l36_done = True
                if self.step == Step.PREVOTE:  # L37
                    self.locked_value, self.locked_round = value, r  # L38-39
                    self._vote(VoteType.PRECOMMIT, vid, out)  # L40
                    self.step = Step.PRECOMMIT  # L41
                self.valid_value, self.valid_round = value, r  # L42-43
                return True
        if self.step == Step.PREVOTE:
            if k.has_quorum(r, VoteType.PREVOTE, None):  # L44
                self._vote(VoteType.PRECOMMIT, None, out)  # L45
                self.step = Step.PRECOMMIT  # L46
                return True
            if not self._l34_done and k.has_quorum_any(r, VoteType.PREVOTE):  # L34
                self._l34_done = True
                out.append(self._schedule(TimeoutKind.PREVOTE))  # L35
                return True
        if not self._l47_done and k.has_quorum_any(r, VoteType.PRECOMMIT):  # L47
            self._l47_done = True
            out.append(self._schedule(TimeoutKind.PRECOMMIT))  # L48
            return True
        return False
