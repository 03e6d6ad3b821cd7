"""Reputation of model nodes from their per-epoch credibility, pure.

Source: PlanetServe sec. 3.4 ("The reputation score of a model node at time epoch T"). Each epoch
the committee commits C(T), the mean credibility of a subject's challenge responses in that
epoch (:mod:`ps_p2p.verification.scoring`), and every verifier updates the subject's reputation
R identically::

    window(T) = the last W values of C, C(T) included (oldest dropped)
    c         = #{v in window(T) : v < tau}                 ("abnormal" values)
    R(T)      = alpha * R(T-1) + beta * C(T)                 if c / W <= gamma
    R(T)      = alpha * R(T-1) + (W + 1) / (W + c/gamma + 2) * C(T)   if c / W > gamma
    untrusted   <=> R(T) < untrusted_below

with the paper's alpha = 0.4, beta = 0.6, W = 5, gamma = 1/5 and threshold 0.4. In the punished
case the paper keeps alpha on R(T-1) and only shrinks the weight on C(T); since c/gamma > W there,
that weight is below (W+1)/(2W+2) = 1/2 < beta, and the weights sum to less than 1, so R
decays even when C(T) is high: "the reputation decreases excessively when detecting abnormal
values", and a steady cheater with C = 0.3 sinks to about 0.09 (the paper's fig. 11c: "below
0.1 within the first 5 periods"). Choices the paper leaves open, fixed here:

* C(T) enters the window before c is counted, so one abnormal epoch after four normal ones
  (c/W = 1/5, not above gamma) is not punished, and two within five epochs are.
* ``c/W > gamma`` is decided exactly (rational arithmetic on the float gamma), so 1/5 > 0.2 is
  false on every machine; the weights are IEEE-754 double arithmetic (+, *, /), which is
  deterministic, so every verifier computes the same bits.
* tau is not given in the paper; the default 0.5 fits the credibility scale of
  :mod:`~ps_p2p.verification.scoring` for greedy challenges on stories260K, measured over 30
  prompts (12 MT-Bench, 12 ShareGPT, 6 TinyStories-like; 128 tokens): the right model 0.52-0.91
  (median 0.75); a copy with 10% weight noise 0.06-0.42; the right model sampling at
  temperature 0.7 instead of greedy 0.10-0.44, at 1.0 0.02-0.21; an answer cut to 64 tokens
  0.01. A copy with 5% weight noise (0.30-0.85) overlaps the honest range: a mild degradation
  is caught only if it is often below tau. tau is a genesis parameter to calibrate per model.
* A subject starts at ``initial`` (0.5: over the threshold, but one bad epoch below it). The
  rule starts every subject there; users, though, treat a subject that has no committed score
  yet as *provisional* on a chain with epochs (:meth:`~ps_p2p.records.Directory.trusted`,
  issue 16): its first epoch decides. A subject is trusted again once R climbs back over the
  threshold: it must be challenged to do so (the plan decides whether untrusted nodes are
  challenged), and, once it has been convicted, keep a clean record first (below).

Probation (issue 18; not in the paper). The paper's rule lets a node that was caught come
back as soon as the window has forgotten its abnormal values: R climbs over the threshold
after about four clean epochs. An untrusted node gets little user traffic, so the strategy
"honest while untrusted, cheap while trusted" stayed trusted in 37-43% of epochs while
serving cheap answers to every user. So each subject also carries ``strikes`` (convictions
not yet forgiven) and ``clean`` (scored epochs in a row with C >= tau)::

    conviction   <=> trusted before the epoch and, after it, R(T) < untrusted_below, or
                     strikes > 0 and C(T) < tau          (then strikes += 1, clean = 0)
    required(k)  =  0 if k = 0, else min(max_probation, probation * 2^(k-1))
    on probation <=> clean < required(strikes): R(T) is capped just below the threshold
                     (the largest multiple of 10^-6 below it), so the subject is untrusted
    forgiven     <=> not on probation, R(T) >= untrusted_below and clean >= required(strikes)
                     + forgive: strikes -= 1 and clean = required(strikes)

A subject never convicted follows the paper's rule exactly. After a conviction it needs
``probation`` clean epochs (8), twice as many after each further one, and while it has strikes
one abnormal epoch convicts it again (parole: the window's tolerance of one abnormal value in
five is for subjects with a clean history). A cheater that is honest only while untrusted is
then trusted in one epoch per cycle of 8, 16, 32, ... (3 of 99 epochs after its first
conviction). ``forgive`` clean epochs in a row while trusted (100) take one strike away, so an
honest node that once failed (an outage's confirmed misses) is not on parole for ever.
``probation = 0`` is the paper's rule. Strikes and clean counts are integers and the cap is a
fixed micro unit, so every validator computes the same state.

Subjects. Reputation is per organization when the node record carries an organization's
membership certificate, else per node: ``subject_of(record)`` is ``b"orgkey\\x00" || org_key``
(the organization key's peer ID, :class:`~ps_p2p.records.Membership`) or ``b"node\\x00" ||
peer_id``, so an organization's fresh identities inherit its reputation (the paper: "model nodes
from the same organization share the same reputation score", sec. 3.1) and the two kinds never
collide. The subject is the organization's *key*, never its name: a name is free text, and a
sybil naming "acme" once pulled acme's shared reputation from 0.71 to 0.28 in 4 epochs (issue
16); only acme's key can make a node a member now. An organization with several nodes
challenged in one epoch gets one update, with C(T) the mean of all their scores
(:meth:`ReputationBook.apply_epoch`). A dishonest operator may still leave an organization (or
make a new organization key) and register a fresh identity: that subject has no committed
reputation, and on a chain with challenge epochs a user treats it as *provisional*, below every
proven node, until its own challenges score it (:meth:`~ps_p2p.records.Directory.trusted`), so a
fresh start buys no trust; the admission caps of :mod:`ps_p2p.registry` bound how many
such identities it can hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from ps_p2p.errors import InvalidScoreError, LocalProtocolError, ReputationBookFullError
from ps_p2p.records.limits import MAX_RECORDS, NODE_SUBJECT_PREFIX, ORG_SUBJECT_PREFIX
from ps_p2p.records.types import reputation_subject

#: Longest sliding window accepted in a genesis file.
MAX_WINDOW = 64
#: Largest ``probation`` / ``max_probation`` / ``forgive`` accepted (epochs; the chain encodes
#: ``clean`` as a u32 and ``strikes`` as a u16).
MAX_PROBATION = 1_000_000
MAX_STRIKES = 0xFFFF
#: Reputations are committed in micro units (:data:`ps_p2p.verification.ledger.MICRO`); the
#: probation cap is the largest of them below the threshold.
_MICRO = 1_000_000


@dataclass(frozen=True)
class ReputationParams:
    """The reputation rule's parameters (module docstring), committed in the genesis file.

    Attributes:
        alpha: weight on R(T-1), in [0, 1).
        beta: weight on C(T) when not punished, in (0, 1]; alpha + beta <= 1 keeps R in [0, 1].
        window: W, the sliding window of C values, in [1, 64].
        tau: C values below it are abnormal, in [0, 1].
        gamma: punishment applies when c/W > gamma, in (0, 1].
        untrusted_below: R below it is untrusted, in [0, 1].
        initial: R(0) of a subject never scored, in [0, 1].
        probation: clean epochs (C >= tau, in a row) a subject needs after its first
            conviction before it is trusted again, doubled after each further one (module
            docstring, "Probation"); 0: the paper's rule, no probation. In [0, 10^6].
        max_probation: the longest probation, in epochs, in [probation, 10^6].
        forgive: clean epochs in a row, beyond its probation, while trusted, that take one
            strike away; 0: never. In [0, 10^6].

    Raises:
        LocalProtocolError: a value out of its range or of the wrong type (the genesis loader
            reports it naming the field).
    """

    alpha: float = 0.4
    beta: float = 0.6
    window: int = 5
    tau: float = 0.5
    gamma: float = 0.2
    untrusted_below: float = 0.4
    initial: float = 0.5
    probation: int = 8
    max_probation: int = 1024
    forgive: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise LocalProtocolError(f"reputation window must be an integer, not {self.window!r}")
        if not 1 <= self.window <= MAX_WINDOW:
            raise LocalProtocolError(f"reputation window must be in [1, {MAX_WINDOW}]")
        for name in ("alpha", "beta", "tau", "gamma", "untrusted_below", "initial"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise LocalProtocolError(f"reputation {name} must be a number, not {value!r}")
            if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise LocalProtocolError(f"reputation {name} must be in [0, 1], not {value!r}")
        if self.alpha >= 1.0:
            raise LocalProtocolError("reputation alpha must be below 1")
        if self.beta <= 0.0 or self.gamma <= 0.0:
            raise LocalProtocolError("reputation beta and gamma must be above 0")
        if Fraction(self.alpha) + Fraction(self.beta) > 1:
            raise LocalProtocolError("reputation alpha + beta must be at most 1")
        for name in ("probation", "max_probation", "forgive"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not 0 <= value <= MAX_PROBATION:
                raise LocalProtocolError(
                    f"reputation {name} must be an integer in [0, {MAX_PROBATION}], "
                    f"not {value!r}")
        if self.max_probation < self.probation:
            raise LocalProtocolError("reputation max_probation must be at least probation")

    def required_clean(self, strikes: int) -> int:
        """Clean epochs a subject with ``strikes`` convictions needs before it is trusted:
        0 without strikes, else ``min(max_probation, probation * 2^(strikes - 1))``."""
        if strikes <= 0 or self.probation == 0:
            return 0
        return min(self.max_probation, self.probation << min(strikes - 1, 40))

    @property
    def probation_cap(self) -> float:
        """R of a subject on probation is at most this: the largest multiple of 10^-6 below
        ``untrusted_below`` (0 when the threshold is 0), so it stays untrusted once committed
        in micro units."""
        return max(0, math.ceil(self.untrusted_below * _MICRO) - 1) / _MICRO

    def punished(self, abnormal: int) -> bool:
        """True when ``abnormal`` values in the window trigger the punishment (c/W > gamma)."""
        return Fraction(abnormal, self.window) > Fraction(self.gamma)

    def weight(self, abnormal: int) -> float:
        """The weight on C(T) with ``abnormal`` values in the window: beta, or
        (W + 1) / (W + c/gamma + 2) when punished."""
        if not self.punished(abnormal):
            return float(self.beta)
        w = self.window
        return (w + 1) / (w + abnormal / self.gamma + 2)


DEFAULT_REPUTATION = ReputationParams()


@dataclass(frozen=True)
class ReputationState:
    """One subject's reputation after some epochs.

    Attributes:
        reputation: R, in [0, 1].
        window: the last (at most W) C values, oldest first.
        epochs: how many updates it has had.
        strikes: convictions not yet forgiven (module docstring, "Probation"), in [0, 65535].
        clean: scored epochs in a row with C >= tau (reset by a conviction; lowered by a
            forgiveness), >= 0.
    """

    reputation: float
    window: tuple[float, ...] = ()
    epochs: int = 0
    strikes: int = 0
    clean: int = 0

    @classmethod
    def fresh(cls, params: ReputationParams = DEFAULT_REPUTATION) -> ReputationState:
        """R(0) = ``params.initial``, empty window."""
        return cls(float(params.initial))


def check_score(value: float, what: str = "credibility") -> float:
    """``value`` as a float if it is a finite number in [0, 1].

    Raises:
        InvalidScoreError: not a number (bools refused), NaN, infinite or outside [0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidScoreError(f"{what} {value!r} is not a number")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise InvalidScoreError(f"{what} {value!r} is not in [0, 1]")
    return float(value)


def update(
    state: ReputationState, credibility: float, params: ReputationParams = DEFAULT_REPUTATION
) -> ReputationState:
    """One epoch of the reputation rule with probation (module docstring); pure.

    Args:
        state: the subject's state after epoch T-1.
        credibility: C(T), the epoch's mean credibility, in [0, 1].
        params: the committed parameters.

    Returns:
        The state after epoch T.

    Raises:
        InvalidScoreError: ``credibility`` (or ``state.reputation``) not in [0, 1].
    """
    c_t = check_score(credibility)
    previous = check_score(state.reputation, "reputation")
    window = (state.window + (c_t,))[-params.window:]
    abnormal = sum(1 for v in window if v < params.tau)
    r = min(1.0, max(0.0, params.alpha * previous + params.weight(abnormal) * c_t))
    strikes, clean = state.strikes, 0 if c_t < params.tau else state.clean + 1
    probation_now = clean < params.required_clean(strikes)
    if previous >= params.untrusted_below and (r < params.untrusted_below or probation_now):
        strikes, clean = min(MAX_STRIKES, strikes + 1), 0  # a conviction
        probation_now = params.probation > 0
    if probation_now:
        r = min(r, params.probation_cap)
    elif (strikes and params.forgive and r >= params.untrusted_below
          and clean >= params.required_clean(strikes) + params.forgive):
        strikes -= 1
        clean = params.required_clean(strikes)
    return ReputationState(r, window, state.epochs + 1, strikes, clean)


def on_probation(state: ReputationState, params: ReputationParams = DEFAULT_REPUTATION) -> bool:
    """The subject's clean record is shorter than its strikes require (module docstring,
    "Probation"): it is untrusted whatever its R would be."""
    return state.clean < params.required_clean(state.strikes)


def is_trusted(state: ReputationState, params: ReputationParams = DEFAULT_REPUTATION) -> bool:
    """R >= ``params.untrusted_below`` (paper: "below a critical level (like 0.4)", untrusted)."""
    return state.reputation >= params.untrusted_below


def subject_of(peer_id: bytes, org_key: bytes = b"") -> bytes:
    """The reputation subject of a model node (module docstring, "Subjects"); the same function
    as :func:`ps_p2p.records.reputation_subject`, which the directory uses.

    Args:
        peer_id: the node's peer ID bytes.
        org_key: its record's membership's organization key (b"" for none).
    """
    return reputation_subject(peer_id, org_key)


@dataclass
class ReputationBook:
    """Reputations of all subjects (the committee's state), bounded; pure.

    Args:
        params: the committed reputation parameters.
        max_subjects: most subjects held (default: the registry's record limit, since every
            subject needs a listed record); one more is refused, never evicted (evicting would
            let a bad subject start over).
    """

    params: ReputationParams = DEFAULT_REPUTATION
    max_subjects: int = MAX_RECORDS
    _states: dict[bytes, ReputationState] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_subjects, bool) or not isinstance(self.max_subjects, int) \
                or self.max_subjects < 1:
            raise LocalProtocolError(
                f"max_subjects must be an integer >= 1, not {self.max_subjects!r}"
            )

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, subject: object) -> bool:
        return subject in self._states

    def __iter__(self) -> Iterator[bytes]:
        return iter(sorted(self._states))

    def get(self, subject: bytes) -> ReputationState:
        """The subject's state; a fresh one (R = initial) when it was never scored."""
        return self._states.get(subject) or ReputationState.fresh(self.params)

    def reputation(self, subject: bytes) -> float:
        """R of ``subject`` (``params.initial`` when never scored)."""
        return self.get(subject).reputation

    def trusted(self, subject: bytes) -> bool:
        """:func:`is_trusted` for ``subject``."""
        return is_trusted(self.get(subject), self.params)

    def record(self, subject: bytes, credibility: float) -> ReputationState:
        """Apply one epoch's C(T) to ``subject``; returns its new state.

        Raises:
            InvalidScoreError: ``credibility`` not in [0, 1] (the book unchanged).
            ReputationBookFullError: a new subject while ``max_subjects`` are held.
        """
        self._check_room([subject])
        new = update(self.get(subject), credibility, self.params)
        self._states[subject] = new
        return new

    def apply_epoch(
        self, scores: Mapping[bytes, Sequence[float]]
    ) -> dict[bytes, ReputationState]:
        """Apply one epoch: each subject's C(T) is the mean of its challenge scores.

        All-or-nothing: every score is checked and room is made sure of before any state
        changes. Subjects are updated in ascending byte order (the result does not depend on
        it, but a replica's log reads the same everywhere).

        Args:
            scores: subject -> the credibility of each of its challenges this epoch (a
                confirmed miss counts as 0). A subject with no scores is left unchanged.

        Returns:
            subject -> new state, for every subject updated.

        Raises:
            InvalidScoreError: a score not in [0, 1].
            ReputationBookFullError: more new subjects than room.
        """
        means: dict[bytes, float] = {}
        for subject in sorted(scores):
            values = [check_score(v) for v in scores[subject]]
            if values:
                means[subject] = min(1.0, math.fsum(values) / len(values))
        self._check_room(list(means))
        out = {}
        for subject, c_t in means.items():
            out[subject] = self._states[subject] = update(self.get(subject), c_t, self.params)
        return out

    def forget(self, subject: bytes) -> None:
        """Drop ``subject`` (no error when absent). The caller decides when a subject may go
        (e.g. no record of it listed for a long time); an untrusted one that comes back starts
        over at ``initial``."""
        self._states.pop(subject, None)

    def untrusted(self) -> list[bytes]:
        """Subjects below the threshold, ascending."""
        return [s for s in sorted(self._states) if not is_trusted(self._states[s], self.params)]

    def _check_room(self, subjects: Sequence[bytes]) -> None:
        new = len({s for s in subjects if s not in self._states})
        if len(self._states) + new > self.max_subjects:
            raise ReputationBookFullError(
                f"{new} new reputation subject(s) with {len(self._states)} of "
                f"{self.max_subjects} held"
            )


__all__ = [
    "DEFAULT_REPUTATION",
    "MAX_PROBATION",
    "MAX_STRIKES",
    "MAX_WINDOW",
    "NODE_SUBJECT_PREFIX",
    "ORG_SUBJECT_PREFIX",
    "ReputationBook",
    "ReputationParams",
    "ReputationState",
    "check_score",
    "is_trusted",
    "on_probation",
    "subject_of",
    "update",
]
