"""A deterministic simulator of the verifier committee's consensus under faults.

It drives N = 3f+1 :class:`~ps_p2p.consensus.core.ConsensusCore` instances (equal power in the
classic draws; see "Adversarial schedules" below for unequal powers, restarts and the rest)
through a simulated network and application, with up to f Byzantine validators, and checks on
every schedule the properties of Algorithm 1 (Buchman, Kwon, Milosevic, arXiv 1807.04938):

* **agreement**: no two correct validators decide different values at one height;
* **validity**: every value a correct validator decides is valid, and that validator's
  application said so (``ValueValidated(valid=True)``) or proposed it itself;
* **no-double-sign**: a correct validator never emits two different votes (nor proposals) for
  one (type, height, round);
* **accountability**: equivocation evidence never names a correct validator;
* **lock**: every prevote a correct validator signs is allowed by L22-23 or L28-29 (below);
* **termination**: after GST every height decides, each in at most
  ``termination_rounds(n)`` rounds more than the highest round a correct validator of that
  height had reached at GST (the one with the highest validRound proposes within n rounds,
  see :func:`termination_rounds`), and all heights within ``max_time``.

Everything random comes from one ``random.Random(seed)``: the same seed gives the same schedule,
on any machine (no clock, no global randomness). Time is simulated seconds.

Network (the driver's part, modelled here): before the global stabilization time (GST) a
message between two validators is lost with probability ``drop``, lost when a partition
separates them, or else delayed uniformly in ``[0, pre_gst_delay]`` (which reorders); from GST
on every message arrives within ``[0.001, delta]``. A validator's own messages loop back at
once (the core's contract). Lost messages are recovered as a gossip layer would: from GST on,
every ``resend_interval`` seconds a correct validator whose height did not change since its last
tick sends every message it heard at its current height again (its own and relayed ones, so a
Byzantine vote that one correct validator counted reaches all: the paper's gossip assumption),
and a correct validator that hears a
message of a height it has decided answers its sender with that height's proposal and commit
(block sync, at most once per sender, height and interval).

Application: a correct validator's :class:`GetValue` is answered with ``b"V"`` + 15 random
bytes after ``app_delay``; a value is valid iff it starts with ``b"V"``. The answer to
:class:`ValidateValue` also takes ``app_delay``.

Byzantine validators (each draws one behaviour per schedule) run a core to follow heights and
rounds, but send what their behaviour dictates, signed with their own address (they cannot
forge others' messages):

* ``silent``: sends nothing;
* ``equivocate``: proposes two values (one may be invalid) to two halves of the committee, and
  sends each validator a vote for its honest choice, nil, or another value of that round;
* ``random``: votes for a random value of the height (or nil, or an unknown ID), sometimes for
  a future round too;
* ``invalid``: proposes invalid values and votes for them;
* ``vote-all``: equivocates as a proposer, and whenever it votes, votes for every value proposed
  in that round and for nil, to everyone (it helps every quorum form: the strongest test of
  quorum intersection, since the core counts conflicting votes for proposed values);
* ``split``: per (height, round, type) shows its own core's vote to a random part of the
  committee and nil to the rest, so that correct validators see different quorums;
* ``fake-pol`` (adversarial schedules only): votes as its core does; as a proposer of a round
  r > 0 re-proposes the value of the oldest polka it saw with that old POL round (validators
  locked in a later round must prevote nil, L29), or, without one, claims POL round r - 1 for
  its value, which has no polka there (L28 must wait);
* ``twin``: the validator's key runs as two correct cores (its copy has index ``n + k``); before
  GST each copy talks only to its own part of the correct validators (``SimParams.twins``), from
  GST on both talk to everyone (the Twins approach of Bano et al., arXiv 2004.10617).

Adversarial schedules (``run_schedule(seed, mode="adversarial")``, :func:`draw_adversarial_params`;
issue 17: the classic draws above miss mutants that these catch):

* **unequal voting powers** (``SimParams.powers``; the Byzantine set holds less than 1/3 of
  the power; proposer rotation weighted, see :func:`ps_p2p.consensus.core.proposer_cycle`);
* **restarts with WAL replay** (``SimParams.restarts``: a correct validator crashes, loses its
  core and gossip state, and restarts before GST as :meth:`ps_p2p.consensus.validator.Validator.start`
  does: ``StartHeight`` of the height after its last decision, ``RestoreLock`` of its
  highest-round precommit of a value and the 2f+1 prevotes of the polka behind it (its POL
  certificate, kept with the lock and replayed as received votes), then its own WAL messages
  of that height re-sent and replayed). The simulated WAL refuses a second value for one
  (height, round, step), as
  :meth:`ps_p2p.consensus.store.ConsensusStore.record_signed` does (``ScheduleResult.wal_refused``);
* **delays around and above the timeouts**: after GST a message takes up to ``delta``, drawn up
  to 0.5 s against base timeouts of 0.2-0.3 s, in half of those schedules at least
  ``min_delay`` (60-95% of ``delta``), so only the growing timeouts of later rounds let a round
  succeed; the termination bound counts those rounds (:func:`rounds_to_cover`);
* **correlated drops**: directed link cuts (``SimParams.cuts``) besides partitions;
* **quorum split** (:func:`quorum_split_params`): the proposer of round 0 is correct, its votes
  reach no other correct validator before GST and its proposal reaches only f of them, and f
  ``vote-all`` Byzantines vote for everything: the proposer alone sees 2f+1 prevotes and f+1
  precommits for its value;
* **twins** (above);
* **one third** (:func:`one_third_params`): N = 3f with f Byzantine validators, exactly 1/3 of
  the power, and the correct ones cut in two halves before GST: quorums of more than 2/3 still
  intersect in a correct validator, so agreement must hold (termination is not checked).

Extra property ``lock`` (Algorithm 1 L22-23, L28-29): a correct validator signs a prevote for a
value only with the round's proposal of it in hand, and either its POL round is -1 and the
validator is not locked on another value, or it holds 2f+1 prevotes for the value in the POL
round and that round is at or above its lock round (or it is locked on that value). The lock is
that of its last signed precommit for a value, kept across restarts (the WAL is the record).

Gossip (``SimParams.gossip``): ``"relay"`` is the idealised gossip described above
(:class:`~ps_p2p.consensus.gossip_policy.RelayAll`); ``"service"`` is the service's gossip
(:class:`~ps_p2p.consensus.gossip_policy.ServiceGossip`: the same
:class:`~ps_p2p.consensus.gossip.Gossip` object and relay set / POL certificate / last commit
functions the service runs, every ``rebroadcast_interval`` seconds from time 0: each peer is
sent what it lacks); ``"before"`` is the service's re-broadcast before issue 17
(:class:`~ps_p2p.consensus.gossip_policy.OwnRecentRoundsBefore`: its own messages of its last
two rounds, nothing relayed). A message lost on a link (a drop, a partition, a cut, a crashed
receiver) is reported to the sender's policy as the service's link manager reports a failed
link (``on_link_down``): the service's links are reliable streams, so a frame is lost only with
its link.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ps_p2p.consensus.core import ConsensusConfig, ConsensusCore, proposer_cycle
from ps_p2p.consensus.gossip_policy import (
    GossipPolicy,
    OwnRecentRoundsBefore,
    RelayAll,
    ServiceGossip,
)
from ps_p2p.consensus.types import (
    BroadcastProposal,
    BroadcastVote,
    Decide,
    Equivocation,
    GetValue,
    Input,
    Proposal,
    ProposalReceived,
    ProposeValue,
    RestoreLock,
    ScheduleTimeout,
    StartHeight,
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

__all__ = [
    "ADVERSARIAL_BEHAVIOURS",
    "ADVERSARIES",
    "BEHAVIOURS",
    "GOSSIP_MODES",
    "PROPERTIES",
    "SIM_CONFIG",
    "ScheduleResult",
    "SimParams",
    "draw_adversarial_params",
    "draw_params",
    "features",
    "lock_race_params",
    "one_third_params",
    "quorum_split_params",
    "rounds_to_cover",
    "run_schedule",
    "termination_rounds",
]

#: Byzantine behaviours (see the module docstring).
BEHAVIOURS = ("silent", "equivocate", "random", "invalid", "vote-all", "split")
#: Behaviours of adversarial schedules: the classic ones and ``fake-pol``.
ADVERSARIAL_BEHAVIOURS = BEHAVIOURS + ("fake-pol",)
#: The properties checked on every schedule.
PROPERTIES = ("agreement", "validity", "no-double-sign", "accountability", "lock", "termination")
#: Gossip modes of ``SimParams.gossip``.
GOSSIP_MODES = ("relay", "service", "before")

#: Heights past the checked ones a validator may run (unchecked: no termination bound;
#: agreement, validity and the signing rules still hold). It goes on until every correct
#: validator has decided every checked height, the run ends (``max_time``) or termination
#: fails (``_Sim.past_bound``), as a service never stops at a last height: a validator that
#: was cut off while the others decided the last checked height learns it is behind from
#: their messages of a later height (block sync, ``_Sim.sync_from``); heights decided while
#: it was still cut off do not tell it (classic seed 8476). The bound only caps a run's cost.
UNCHECKED_HEIGHTS = 1000
#: Kinds of adversarial schedule drawn by :func:`draw_adversarial_params`.
ADVERSARIES = ("mixed", "quorum-split", "twins", "one-third", "lock-race")

#: Core timeouts in the simulation (seconds): a few times the post-GST delay bound.
SIM_CONFIG = ConsensusConfig(
    timeout_propose=0.3,
    timeout_propose_delta=0.1,
    timeout_prevote=0.2,
    timeout_prevote_delta=0.1,
    timeout_precommit=0.2,
    timeout_precommit_delta=0.1,
)


def termination_rounds(n: int) -> int:
    """Rounds a height may take after GST beyond the highest round reached at GST (and beyond
    :func:`rounds_to_cover`), for a proposer cycle of ``n`` slots (N with equal powers).

    After GST, rounds of correct validators align within one round (L55 and equal timeouts);
    the correct validator with the highest validRound has proposed within n rounds (round
    robin), and every correct validator accepts its value (L28-29: their lockedRound is at most
    their validRound, so at most its validRound). Two more rounds for the alignment.
    """
    return n + 2


def rounds_to_cover(delta: float, config: ConsensusConfig) -> int:
    """The first round whose timeouts are long enough for messages that take up to ``delta``
    seconds: propose >= 3 delta (the proposal, after rounds that started up to 2 delta apart),
    prevote and precommit >= 2 delta. 0 when the base timeouts already are."""
    need = (
        (config.timeout_propose, config.timeout_propose_delta, 3 * delta),
        (config.timeout_prevote, config.timeout_prevote_delta, 2 * delta),
        (config.timeout_precommit, config.timeout_precommit_delta, 2 * delta),
    )
    r = 0
    for base, step, want in need:
        if base < want:
            r = max(r, math.ceil((want - base) / step) if step > 0 else 10**6)
    return r


def is_valid(value: bytes) -> bool:
    """The simulated application's ``valid(v)``."""
    return value[:1] == b"V"


@dataclass(frozen=True)
class SimParams:
    """One schedule's parameters (seconds for times).

    ``partitions``: (start, end, group) windows before GST in which messages between ``group``
    (a set of node indices) and the rest are lost. ``byzantine``: node index -> behaviour.
    ``powers``: voting power per validator (empty: N = 3f+1 of power 1). ``restarts``:
    (crash time, restart time, node) of correct validators, both before GST. ``cuts``: (src,
    dst, "vote" | "prevote" | "precommit" | "proposal" | "all", until[, start]): messages of
    that kind from src to dst are lost from ``start`` (default 0) to ``until`` (and before GST). ``twins``: (Byzantine node, the correct nodes its copy
    talks to before GST). ``gossip``: one of :data:`GOSSIP_MODES`; ``rebroadcast_interval``
    the service mode's period (0: the core's ``timeout_prevote``, the service's default).
    ``termination``: False where the correct validators hold no more than 2/3 of the power
    (safety only is checked then). ``split``: the nodes an equivocating Byzantine proposer
    shows its first value (the others get a second, valid one); empty: random halves.
    ``min_delay``: after GST a message takes at least this long (slow links: every message
    late, not just some).
    """

    f: int
    heights: int
    gst: float
    drop: float
    pre_gst_delay: float
    delta: float
    app_delay: float
    partitions: tuple[tuple[float, float, frozenset[int]], ...]
    byzantine: dict[int, str]
    resend_interval: float = 0.5
    max_time: float = 0.0  # 0: derived from gst, heights, delta and the timeouts
    powers: tuple[int, ...] = ()
    restarts: tuple[tuple[float, float, int], ...] = ()
    cuts: tuple[tuple, ...] = ()  # (src, dst, kind, until[, start])
    twins: tuple[tuple[int, frozenset[int]], ...] = ()
    gossip: str = "relay"
    rebroadcast_interval: float = 0.0
    adversary: str = ""
    termination: bool = True
    split: frozenset[int] = frozenset()
    min_delay: float = 0.0

    @property
    def n(self) -> int:
        return len(self.powers) if self.powers else 3 * self.f + 1


def draw_params(rng: random.Random, f: int, heights: int) -> SimParams:
    """Draw a schedule's parameters (GST in [0, 3] s, drops up to 40%, delays up to 0.6 s
    before GST and 0.05 s after, 0-2 partitions, 0..f Byzantine validators)."""
    n = 3 * f + 1
    gst = rng.uniform(0.0, 3.0)
    partitions = []
    for _ in range(rng.randint(0, 2)):
        start = rng.uniform(0, gst)
        end = rng.uniform(start, gst)
        group = frozenset(rng.sample(range(n), rng.randint(1, n - 1)))
        partitions.append((start, end, group))
    n_byz = rng.randint(0, f)
    byz = {i: rng.choice(BEHAVIOURS) for i in rng.sample(range(n), n_byz)}
    return SimParams(
        f=f,
        heights=heights,
        gst=gst,
        drop=rng.uniform(0.0, 0.4),
        pre_gst_delay=rng.uniform(0.01, 0.6),
        delta=0.05,
        app_delay=rng.uniform(0.0, 0.02),
        partitions=tuple(partitions),
        byzantine=byz,
    )


def quorum_split_params(rng: random.Random, f: int, heights: int = 2,
                        gossip: str = "relay") -> SimParams:
    """The quorum-split adversary (module docstring): node 0 (the proposer of height 0, round
    0) is correct; before GST its votes reach no other correct node and its proposal only nodes
    1..f; nodes 2f+1..3f are ``vote-all`` Byzantines. Delays, GST and app delays are drawn."""
    n = 3 * f + 1
    gst = rng.uniform(1.5, 3.0)
    cuts = []
    for dst in range(1, 2 * f + 1):
        cuts.append((0, dst, "vote", gst))
        if dst > f:
            cuts.append((0, dst, "proposal", gst))
    return SimParams(
        f=f,
        heights=heights,
        gst=gst,
        drop=0.0,
        pre_gst_delay=rng.uniform(0.005, 0.05),
        delta=rng.choice((0.05, rng.uniform(0.05, 0.3))),
        app_delay=rng.uniform(0.0, 0.01),
        partitions=(),
        byzantine={i: "vote-all" for i in range(2 * f + 1, n)},
        cuts=tuple(cuts),
        gossip=gossip,
        adversary="quorum-split",
    )


def one_third_params(rng: random.Random, f: int, heights: int = 2,
                     gossip: str = "relay") -> SimParams:
    """Byzantine validators holding exactly 1/3 of the power (N = 3f, f of them): quorums of
    more than 2/3 still intersect in a correct validator, so safety must hold (termination is
    not checked: the correct ones hold only 2/3). Before GST the correct validators are split
    in two halves; the Byzantine ones (``vote-all``) talk to both and vote for everything. A
    core reading 2f+1 as ">= 2/3" decides two values here."""
    n = 3 * f
    gst = rng.uniform(1.0, 3.0)
    correct = list(range(f, n))
    rng.shuffle(correct)
    half = frozenset(correct[: len(correct) // 2])
    behaviours = ("vote-all",)
    return SimParams(
        f=f,
        heights=heights,
        gst=gst,
        drop=rng.uniform(0.0, 0.1),
        pre_gst_delay=rng.uniform(0.01, 0.2),
        delta=0.05,
        app_delay=rng.uniform(0.0, 0.01),
        partitions=(),
        byzantine={i: rng.choice(behaviours) for i in range(f)},
        powers=(1,) * n,
        cuts=tuple((a, b, "all", gst) for a in correct for b in correct
                   if (a in half) != (b in half)),
        gossip=gossip,
        adversary="one-third",
        split=half,
        termination=False,
        max_time=gst + 5.0 * heights,
    )


def lock_race_params(rng: random.Random, heights: int = 1, gossip: str = "relay") -> SimParams:
    """A scripted race for the lock (L29), N = 4: nodes 0-2 correct, node 3 ``lock-race``.

    Round 0 (proposer 0, value v'): prevotes between 0 and 1 are cut, node 3 shows node 2 a
    prevote for v' and the others nil, so only node 2 sees the polka and locks v' (round 0).
    Round 1 (proposer 1, value v): node 0's prevotes to node 2 are cut and node 3 prevotes v to
    0 and 1 only, so 0 and 1 lock v (round 1); node 0's precommits to node 1 are cut and node 3
    precommits v to node 0 only, so node 0 decides v and node 1 does not. Round 2: node 2
    re-proposes v' with POL round 0 and node 3 sends node 1 a round-0 prevote for v', which
    completes that polka: node 1, locked in round 1, must prevote nil (L29); a core that
    ignores the lock prevotes v' (``lock``) and v' may be decided (``agreement``). Node 0's
    messages reach the others again at GST (its commit of v then ends the height). Timing is
    the classic timeouts' with delays of at most 5 ms before GST (2 s)."""
    t1 = 0.3  # after the round-0 prevotes, before round 1 (starts about 0.4 s)
    gst = 2.0
    return SimParams(
        f=1,
        heights=heights,
        gst=gst,
        drop=0.0,
        pre_gst_delay=rng.uniform(0.001, 0.005),
        delta=0.05,
        app_delay=0.0,
        partitions=(),
        byzantine={3: "lock-race"},
        cuts=((0, 1, "prevote", t1), (1, 0, "prevote", t1), (0, 1, "precommit", gst),
              (0, 2, "prevote", gst, t1),
              # node 0 decides at about 0.7 s: its commit reaches the others only after GST
              (0, 1, "all", gst, 0.5), (0, 2, "all", gst, 0.5)),
        gossip=gossip,
        adversary="lock-race",
    )


def _draw_powers(rng: random.Random, n: int, f: int) -> tuple[tuple[int, ...], list[int]]:
    """Powers 1..3 per validator, and up to f Byzantine nodes holding less than 1/3 of them."""
    powers = tuple(rng.randint(1, 3) for _ in range(n))
    total = sum(powers)
    byz = rng.sample(range(n), rng.randint(0, f))
    while byz and 3 * sum(powers[i] for i in byz) >= total:
        byz.pop()
    return powers, byz


def draw_adversarial_params(rng: random.Random, f: int, heights: int,
                            gossip: str = "relay") -> SimParams:
    """Draw an adversarial schedule (module docstring): one of :data:`ADVERSARIES`
    (weights 5:2:2:1:1). ``mixed`` combines unequal powers (half the schedules), restarts of up
    to two correct validators, post-GST delays up to 0.5 s (half the schedules), partitions
    and link cuts, drops up to 30%, and Byzantine behaviours."""
    kind = rng.choices(ADVERSARIES, weights=(5, 2, 2, 1, 1))[0]
    if kind == "lock-race":
        return lock_race_params(rng, heights, gossip)
    if kind == "quorum-split":
        return quorum_split_params(rng, f, heights, gossip)
    if kind == "one-third":
        return one_third_params(rng, f, heights, gossip)
    n = 3 * f + 1
    gst = rng.uniform(0.5, 3.0)
    delta = 0.05 if rng.random() < 0.5 else rng.uniform(0.1, 0.5)
    if kind == "twins":
        twin = rng.randrange(n)
        rest = [i for i in range(n) if i != twin]
        group = frozenset(rng.sample(rest, len(rest) // 2))
        others = rng.sample(rest, rng.randint(0, f - 1))
        byz = {i: rng.choice(ADVERSARIAL_BEHAVIOURS) for i in others}
        byz[twin] = "twin"
        return SimParams(
            f=f, heights=heights, gst=gst, drop=rng.uniform(0.0, 0.1),
            pre_gst_delay=rng.uniform(0.01, 0.3), delta=delta,
            app_delay=rng.uniform(0.0, 0.02), partitions=(), byzantine=byz,
            twins=((twin, group),), gossip=gossip, adversary="twins",
        )
    if rng.random() < 0.5:
        powers, byz_nodes = _draw_powers(rng, n, f)
    else:
        powers, byz_nodes = (), rng.sample(range(n), rng.randint(0, f))
    byz = {i: rng.choice(ADVERSARIAL_BEHAVIOURS) for i in byz_nodes}
    correct = [i for i in range(n) if i not in byz]
    restarts = []
    for i in rng.sample(correct, min(len(correct), rng.randint(0, 2))):
        crash = rng.uniform(0.0, gst)
        restarts.append((crash, rng.uniform(crash, gst), i))
    partitions = []
    for _ in range(rng.randint(0, 2)):
        start = rng.uniform(0, gst)
        group = frozenset(rng.sample(range(n), rng.randint(1, n - 1)))
        partitions.append((start, rng.uniform(start, gst), group))
    cuts = []
    for _ in range(rng.randint(0, 3)):
        src, dst = rng.sample(range(n), 2)
        cuts.append((src, dst, rng.choice(("vote", "proposal", "all")), rng.uniform(0, gst)))
    # slow links: every message late, so only the grown timeouts of later rounds let one succeed
    min_delay = rng.uniform(0.6, 0.95) * delta if delta > 0.05 and rng.random() < 0.5 else 0.0
    return SimParams(
        f=f,
        heights=heights,
        gst=gst,
        drop=rng.uniform(0.0, 0.3),
        pre_gst_delay=rng.uniform(0.01, 1.0),
        delta=delta,
        app_delay=rng.uniform(0.0, 0.02),
        partitions=tuple(partitions),
        byzantine=byz,
        powers=powers,
        restarts=tuple(restarts),
        cuts=tuple(cuts),
        gossip=gossip,
        adversary="mixed",
        min_delay=min_delay,
    )


@dataclass
class ScheduleResult:
    """What one schedule did: per height, the highest decision round among correct validators
    (``rounds``), violations by property (messages), deliveries, the simulated end time, and
    how many own messages the simulated WAL refused to sign twice (after restarts)."""

    seed: int
    f: int
    n: int
    byzantine: dict[int, str]
    heights_decided: int
    rounds: list[int]
    violations: dict[str, list[str]] = field(default_factory=dict)
    deliveries: int = 0
    end_time: float = 0.0
    wal_refused: int = 0
    adversary: str = ""
    #: what the schedule exercised (:func:`features`)
    features: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.violations


def features(p: SimParams) -> tuple[str, ...]:
    """What a schedule exercises, for campaign counts: its adversary kind (``classic`` for
    :func:`draw_params`), then ``restarts`` (WAL replay), ``unequal-powers``, ``slow-links``
    (every post-GST message at least ``min_delay``), ``delay-above-timeouts`` (``delta``
    beyond the base timeouts' cover), ``link-cuts``, ``partitions``, ``drops`` and each
    Byzantine behaviour present (``byz:<behaviour>``, ``byz:twin`` in the twins adversary)."""
    out = [p.adversary or "classic"]
    if p.restarts:
        out.append("restarts")
    if p.powers and len(set(p.powers)) > 1:
        out.append("unequal-powers")
    if p.min_delay > 0:
        out.append("slow-links")
    if rounds_to_cover(p.delta, SIM_CONFIG) > 0:
        out.append("delay-above-timeouts")
    if p.cuts:
        out.append("link-cuts")
    if p.partitions:
        out.append("partitions")
    if p.drop > 0:
        out.append("drops")
    out.extend(sorted({f"byz:{b}" for b in p.byzantine.values()}))
    return tuple(out)


# event kinds
_DELIVER, _TIMEOUT, _APP, _TICK, _CRASH, _RESTART = 0, 1, 2, 3, 4, 5


class _Node:
    def __init__(self, index: int, address: bytes, core: ConsensusCore, behaviour: str | None,
                 base: int):
        self.index = index
        self.base = base  # the validator index (a twin copy's original)
        self.address = address
        self.core = core
        self.behaviour = behaviour  # None: correct
        self.policy: GossipPolicy | None = None
        self.proposals: dict[tuple[int, int, bytes], Proposal] = {}
        self.pols: dict[tuple[int, int, bytes], set[int]] = {}
        self.values: dict[bytes, bytes] = {}
        self.certs: dict[int, list[ProposalReceived | VoteReceived]] = {}
        self.decisions: dict[int, Decide] = {}
        self.validated: dict[bytes, bool] = {}
        self.own_values: set[bytes] = set()
        self.cert_sent: dict[tuple[int, int], float] = {}
        self.done = False
        self.down = False
        self.epoch = 0
        # the WAL: (height, round, step) -> (message, locked value or None, epoch written in),
        # in signing order
        self.wal: dict[tuple[int, int, int], tuple[Proposal | Vote, bytes | None, int]] = {}
        # with a lock: (height, round) -> the 2f+1 prevotes of its polka (the POL certificate,
        # kept as ConsensusStore.record_signed keeps it with a precommit of a value)
        self.wal_cert: dict[tuple[int, int], tuple[Vote, ...]] = {}
        self.lock: dict[int, tuple[int, bytes]] = {}  # checker: height -> (round, value ID)
        self.seen_values: dict[int, list[bytes]] = {}  # Byzantine: value IDs per height
        self.seen_round: dict[tuple[int, int], set[bytes]] = {}  # and per (height, round)


class _Sim:
    def __init__(
        self,
        seed: int,
        params: SimParams,
        core_factory: Callable[[bytes, ConsensusConfig], ConsensusCore],
        config: ConsensusConfig,
    ) -> None:
        self.rng = random.Random(seed ^ 0x5EED)
        self.p = params
        self.config = config
        self.core_factory = core_factory
        n = params.n
        powers = params.powers or (1,) * n
        self.validators = tuple(Validator(b"val-%02d" % i, powers[i]) for i in range(n))
        # Byzantine nodes of adversarial schedules follow heights and rounds with the reference
        # core: a broken core under test must not also weaken the adversary
        byz_factory = ConsensusCore if params.adversary else core_factory
        self.nodes = [
            _Node(i, v.address,
                  (core_factory if i not in params.byzantine else byz_factory)(v.address, config),
                  params.byzantine.get(i), i)
            for i, v in enumerate(self.validators)
        ]
        # twins: the copy of node i talks to ``group`` before GST, node i to the others
        self.twin_group: dict[int, tuple[frozenset[int], bool]] = {}
        for i, group in params.twins:
            copy = _Node(len(self.nodes), self.validators[i].address,
                         byz_factory(self.validators[i].address, config), "twin", i)
            self.nodes.append(copy)
            self.twin_group[i] = (group, False)
            self.twin_group[copy.index] = (group, True)
        if params.adversary:  # Byzantine validators collude: they share what they saw
            seen_values: dict[int, list[bytes]] = {}
            seen_round: dict[tuple[int, int], set[bytes]] = {}
            for nd in self.nodes:
                if nd.behaviour is not None:
                    nd.seen_values, nd.seen_round = seen_values, seen_round
        self.by_address = {nd.address: nd for nd in self.nodes[:n]}
        self.correct = [nd for nd in self.nodes if nd.behaviour is None]
        self.queue: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.deliveries = 0
        self.wal_refused = 0
        self.violations: dict[str, list[str]] = {}
        self.signed: dict[tuple[bytes, int, int, int], object] = {}  # correct validators only
        self.round_at_gst: dict[int, int] = {}
        self.cover = rounds_to_cover(params.delta, config)
        self.proposers = proposer_cycle(self.validators)
        self.cycle = len(self.proposers)
        self.max_time = params.max_time or self._default_max_time()

    def _default_max_time(self) -> float:
        p = self.p
        if self.cover == 0 and not p.powers and p.gossip == "relay":
            return p.gst + 5.0 * p.heights + 10.0
        rounds = self.cover + termination_rounds(self.cycle) + 2
        per_height = sum(
            sum(self.config.timeout(k, r) for k in TimeoutKind) + 3 * p.delta
            for r in range(rounds)
        )
        return p.gst + max(5.0, per_height) * p.heights + 10.0

    def new_policy(self, index: int) -> GossipPolicy:
        interval = self.p.rebroadcast_interval or self.config.timeout_prevote
        if self.p.gossip == "service":
            nd = self.nodes[index]
            return ServiceGossip(nd.address, [v.address for v in self.validators],
                                 lambda: nd.core, interval, start=self.now)
        if self.p.gossip == "before":
            return OwnRecentRoundsBefore(interval, start=self.now)
        if self.p.gossip != "relay":
            raise ValueError(f"unknown gossip mode {self.p.gossip!r}")
        return RelayAll(self.p.resend_interval, start=max(self.now, self.p.gst))

    # -------------------------------------------------------------- plumbing

    def push(self, at: float, kind: int, node: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (at, self.seq, kind, node, payload))

    def violate(self, prop: str, msg: str) -> None:
        self.violations.setdefault(prop, []).append(msg)

    def _twin_blocks(self, x: int, y: int) -> bool:
        """Before GST: whether the twin endpoint x may not talk to correct node y."""
        group, is_copy = self.twin_group[x]
        other = self.nodes[y]
        if other.behaviour is not None:
            return False
        return (other.base in group) != is_copy

    def lost(self, src: int, dst: int, msg: ProposalReceived | VoteReceived) -> bool:
        t = self.now
        if t >= self.p.gst:
            return False
        if self.p.cuts:
            if isinstance(msg, ProposalReceived):
                kinds: tuple[str, ...] = ("all", "proposal")
            else:
                step = "prevote" if msg.vote.type == VoteType.PREVOTE else "precommit"
                kinds = ("all", "vote", step)
            for s, d, what, until, *start in self.p.cuts:
                if (s == src and d == dst and t < until and what in kinds
                        and t >= (start[0] if start else 0.0)):
                    return True
        if self.twin_group:
            if src in self.twin_group and self._twin_blocks(src, dst):
                return True
            if dst in self.twin_group and self._twin_blocks(dst, src):
                return True
        for start, end, group in self.p.partitions:
            if start <= t < end and ((src in group) != (dst in group)):
                return True
        return self.rng.random() < self.p.drop

    def send(self, src: _Node, dst: int, msg: ProposalReceived | VoteReceived) -> None:
        if dst == src.index:
            self.push(self.now, _DELIVER, dst, (src.index, msg))
            return
        if self.nodes[dst].base == src.base:
            return  # a twin's copies share a key: never each other's peers
        if self.lost(src.index, dst, msg):
            if src.policy is not None:  # the service's link manager reports the failure
                src.policy.on_link_down(self.nodes[dst].address, self.now)
            return
        if self.now < self.p.gst:
            delay = self.rng.uniform(0.0, self.p.pre_gst_delay)
        else:
            delay = self.rng.uniform(max(0.001, self.p.min_delay), self.p.delta)
        self.push(self.now + delay, _DELIVER, dst, (src.index, msg))

    def broadcast(self, src: _Node, msg: ProposalReceived | VoteReceived) -> None:
        planned: list[tuple[bytes | None, Proposal | Vote]] = []
        if src.policy is not None:  # an own message: the policy marks it sent first
            m = msg.proposal if isinstance(msg, ProposalReceived) else msg.vote
            planned = src.policy.on_send(m, self.now)
        for i in range(len(self.nodes)):
            self.send(src, i, msg)
        self.send_planned(src, planned)

    # -------------------------------------------------------------- running

    def run(self) -> None:
        for nd in self.nodes:
            if nd.behaviour != "silent":
                self.apply(nd, StartHeight(0, self.validators))
        for nd in self.correct:
            nd.policy = self.new_policy(nd.index)
            self.push(nd.policy.next_tick(), _TICK, nd.index, None)
        for crash, restart, i in self.p.restarts:
            self.push(crash, _CRASH, i, None)
            self.push(max(crash, restart), _RESTART, i, None)
        gst_seen = False
        while self.queue:
            at, _, kind, idx, payload = heapq.heappop(self.queue)
            if at > self.max_time:
                break
            if not gst_seen and at >= self.p.gst:
                gst_seen = True
                self.snapshot_gst()
            self.now = at
            nd = self.nodes[idx]
            if kind == _DELIVER:
                if nd.down:  # the sender's link to it fails (the service's on_link_down)
                    sender = self.nodes[payload[0]]  # type: ignore[index]
                    if sender.policy is not None and sender is not nd:
                        sender.policy.on_link_down(nd.address, at)
                    continue
                self.deliveries += 1
                src, msg = payload  # type: ignore[misc]
                self.receive(nd, src, msg)
            elif kind == _TICK:
                self.tick(nd)
            elif kind == _CRASH:
                nd.down = True
                nd.epoch += 1
            elif kind == _RESTART:
                self.restart(nd)
            else:
                epoch, inp = payload  # type: ignore[misc]
                if epoch == nd.epoch and not nd.down:
                    self.apply(nd, inp)
            if all(c.done for c in self.correct):
                break
            if gst_seen and self.past_bound(nd):
                break  # termination already failed: no need to run to max_time
        if not gst_seen:
            self.snapshot_gst()

    def bound(self, height: int) -> int:
        """The highest round in which ``height`` may be decided (module docstring)."""
        start = max(self.round_at_gst.get(height, 0), self.cover)
        return start + termination_rounds(self.cycle)

    def past_bound(self, nd: _Node) -> bool:
        """Whether correct ``nd`` went four rounds past its height's bound undecided (then the
        height is not decided within the bound: messages take less than a round by then, so a
        commit of a round within the bound would have reached it; recorded)."""
        h = nd.core.height
        if (nd.behaviour is not None or not self.p.termination or h is None
                or h >= self.p.heights  # an unchecked height (``on_decide``)
                or nd.core.decision is not None or nd.core.round <= self.bound(h) + 3):
            return False
        self.violate("termination", f"height {h}: {nd.address!r} reached round "
                     f"{nd.core.round} > bound {self.bound(h)} at {self.now:.1f} s")
        return True

    def snapshot_gst(self) -> None:
        for nd in self.correct:
            h = nd.core.height
            if h is not None and nd.core.decision is None:
                self.round_at_gst[h] = max(self.round_at_gst.get(h, 0), nd.core.round)

    def tick(self, nd: _Node) -> None:
        """Gossip: send what the node's policy says (:mod:`ps_p2p.consensus.gossip_policy`).

        Nodes run unchecked heights past the checked ones (``on_decide``,
        :data:`UNCHECKED_HEIGHTS`); a node that decided the last of those keeps gossiping, as
        the service does (it never stops at a last height): as a node at the next height,
        where it has nothing of its own to say, so its policy can still send the last commit
        to peers that lack it
        (Algorithm 1's gossip assumption; a silent decider left seed 9984 undecided)."""
        assert nd.policy is not None
        if not nd.down:
            height, round_ = nd.core.height, nd.core.round
            if nd.core.decision is not None and height is not None:
                height, round_ = height + 1, 0
            self.send_planned(nd, nd.policy.tick(self.now, height, round_))
        self.push(max(nd.policy.next_tick(), self.now + 1e-3), _TICK, nd.index, None)

    def send_planned(self, nd: _Node, plan: list[tuple[bytes | None, Proposal | Vote]]) -> None:
        """Send what a policy returned: (peer address or None for every other node, message)."""
        for peer, m in plan:
            msg = ProposalReceived(m) if isinstance(m, Proposal) else VoteReceived(m)
            targets = (range(len(self.nodes)) if peer is None
                       else [self.by_address[peer].index])
            for i in targets:
                if i != nd.index:
                    self.send(nd, i, msg)

    def restart(self, nd: _Node) -> None:
        """Restart from the store and WAL, as Validator.start does (module docstring)."""
        nd.down = False
        nd.epoch += 1
        nd.core = self.core_factory(nd.address, self.config)
        nd.policy = self.new_policy(nd.index)
        height = max(nd.decisions) + 1 if nd.decisions else 0
        if height >= self.p.heights + UNCHECKED_HEIGHTS:
            return
        self.apply(nd, StartHeight(height, self.validators))
        own = [(key, entry) for key, entry in nd.wal.items() if key[0] == height]
        locks = [(key[1], entry[1]) for key, entry in own if entry[1] is not None]
        if locks:
            r, locked = max(locks, key=lambda x: x[0])
            self.apply(nd, RestoreLock(height, r, locked))
            # the polka behind the lock, replayed as received votes (signed by others), so a
            # re-proposal of the locked value (L16, validRound) carries its POL certificate
            # and L28 can fire at the others
            for v in nd.wal_cert.get((height, r), ()):
                if nd.policy is not None:
                    nd.policy.on_receive(v, v.validator, self.now)
                self.apply(nd, VoteReceived(v))
        for _, (m, _, _) in own:
            msg = ProposalReceived(m) if isinstance(m, Proposal) else VoteReceived(m)
            planned = nd.policy.on_send(m, self.now)
            for i in range(len(self.nodes)):
                if i != nd.index:
                    self.send(nd, i, msg)
            self.send_planned(nd, planned)
            self.apply(nd, msg)

    def receive(self, nd: _Node, src: int, msg: ProposalReceived | VoteReceived) -> None:
        if nd.behaviour == "silent":
            return
        if isinstance(msg, ProposalReceived):
            p = msg.proposal
            nd.proposals[(p.height, p.round, p.value_id)] = p
            nd.values.setdefault(p.value_id, p.value)
            if p.proposer == self.proposers[(p.height + p.round) % len(self.proposers)]:
                nd.pols.setdefault((p.height, p.round, p.value_id), set()).add(p.pol_round)
            if nd.behaviour is not None:
                nd.seen_values.setdefault(p.height, []).append(p.value_id)
                nd.seen_round.setdefault((p.height, p.round), set()).add(p.value_id)
            height = p.height
            m: Proposal | Vote = p
        else:
            height = msg.vote.height
            m = msg.vote
        if nd.policy is not None and src != nd.index:  # own ones: on_send in broadcast
            self.send_planned(nd, nd.policy.on_receive(m, self.nodes[src].address, self.now))
        if (self.p.gossip == "service" and nd.behaviour is None and src != nd.index
                and nd.core.height is not None and height > nd.core.height):
            self.sync_from(self.nodes[src], nd, nd.core.height)
        if nd.behaviour is None and src != nd.index and height in nd.certs:
            last = nd.cert_sent.get((src, height))
            if last is None or self.now - last >= self.p.resend_interval:
                nd.cert_sent[(src, height)] = self.now
                for c in nd.certs[height]:
                    self.send(nd, src, c)
        self.apply(nd, msg)

    def sync_from(self, peer: _Node, nd: _Node, height: int) -> None:
        """The service's block sync (``ConsensusService._ahead``): ``nd`` heard ``peer`` at a
        higher height, so it fetches ``height``'s proposal and commit from it, at most once
        per ``resend_interval`` (the service waits ``sync_after`` first; here at once). Its
        gossip sends a commit only to a peer in a later round of the decided height, and
        nothing of a height it left: a validator that missed precommits of the decided round
        catches up by block sync in the service, and must here too."""
        if peer.behaviour is not None or height not in peer.certs:
            return
        last = peer.cert_sent.get((nd.index, height))
        if last is not None and self.now - last < self.p.resend_interval:
            return
        peer.cert_sent[(nd.index, height)] = self.now
        for c in peer.certs[height]:
            self.send(peer, nd.index, c)

    def apply(self, nd: _Node, inp: Input) -> None:
        for out in nd.core.handle(inp, self.now):
            self.execute(nd, out)

    # -------------------------------------------------------------- outputs

    def wal_write(self, nd: _Node, key: tuple[int, int, int], signed: Proposal | Vote,
                  locked: bytes | None) -> Proposal | Vote | None:
        """The store's record_signed: the message to send, or None (a second value refused).

        A second value signed before a restart is refused and counted (the core does not know
        its step after a restart); one the core asks for in the same run of the validator is
        its own double sign (``no-double-sign``), refused as well."""
        held = nd.wal.get(key)
        if held is None:
            nd.wal[key] = (signed, locked, nd.epoch)
            return signed
        if held[0] == signed:
            return held[0]
        if held[2] == nd.epoch:
            self.violate("no-double-sign", f"{nd.address!r} asked to sign {held[0]} and {signed}")
        else:
            self.wal_refused += 1
        return None

    def execute(self, nd: _Node, out: object) -> None:
        if isinstance(out, BroadcastProposal):
            p = out.proposal
            if nd.behaviour is None:
                if self.wal_write(nd, (p.height, p.round, 0), p, None) is None:
                    return
                nd.values.setdefault(p.value_id, p.value)
                self.check_sign(nd, ("proposal", p.height, p.round), p)
                self.broadcast(nd, ProposalReceived(p))
            elif nd.behaviour == "twin":
                self.broadcast(nd, ProposalReceived(p))
            else:
                self.byzantine_proposal(nd, p)
        elif isinstance(out, BroadcastVote):
            v = out.vote
            if nd.behaviour is None:
                locked = None
                if v.type == VoteType.PRECOMMIT and v.value_id is not None:
                    locked = nd.values.get(v.value_id)
                if self.wal_write(nd, (v.height, v.round, int(v.type)), v, locked) is None:
                    return
                if locked is not None and nd.core.keeper is not None:
                    nd.wal_cert.setdefault((v.height, v.round), tuple(nd.core.keeper.votes_for(
                        v.round, VoteType.PREVOTE, v.value_id)))
                self.check_sign(nd, (int(v.type), v.height, v.round), v)
                self.check_lock(nd, v)
                self.broadcast(nd, VoteReceived(v))
            elif nd.behaviour == "twin":
                self.broadcast(nd, VoteReceived(v))
            else:
                self.byzantine_vote(nd, v)
        elif isinstance(out, ScheduleTimeout):
            self.push(
                self.now + out.duration,
                _TIMEOUT,
                nd.index,
                (nd.epoch, TimeoutFired(out.kind, out.height, out.round)),
            )
        elif isinstance(out, GetValue):
            if nd.behaviour == "invalid":
                value = b"X" + self.rng.randbytes(15)
            else:
                value = b"V" + self.rng.randbytes(15)
            nd.own_values.add(value_id(value))
            nd.values.setdefault(value_id(value), value)
            self.push(
                self.now + self.p.app_delay,
                _APP,
                nd.index,
                (nd.epoch, ProposeValue(out.height, out.round, value)),
            )
        elif isinstance(out, ValidateValue):
            ok = is_valid(out.value)
            if nd.behaviour == "invalid":
                ok = True  # it votes for anything
            nd.validated[value_id(out.value)] = ok
            self.push(
                self.now + self.p.app_delay,
                _APP,
                nd.index,
                (nd.epoch, ValueValidated(out.height, out.round, value_id(out.value), ok)),
            )
        elif isinstance(out, Decide):
            self.on_decide(nd, out)
        elif isinstance(out, Equivocation):
            accused = out.first.validator
            if accused != out.second.validator:
                self.violate("accountability", f"evidence pairs two validators at {self.now:.3f}")
            elif self.by_address[accused].behaviour is None:
                self.violate("accountability", f"{nd.address!r} accused correct {accused!r}")

    def check_sign(self, nd: _Node, key: tuple, signed: Proposal | Vote) -> None:
        full = (nd.address,) + key
        held = self.signed.get(full)  # type: ignore[arg-type]
        if held is None:
            self.signed[full] = signed  # type: ignore[index]
        elif held != signed:
            self.violate("no-double-sign", f"{nd.address!r} signed {held} and {signed}")

    def check_lock(self, nd: _Node, v: Vote) -> None:
        """The ``lock`` property (module docstring) on a vote about to be signed: a prevote
        for a value needs its proposal in that round with POL round -1 and no lock on another
        value (L22-23), or with a POL round vr >= 0 whose 2f+1 prevotes the validator holds
        and vr at or above its lock round, or its lock on that value (L28-29)."""
        if v.value_id is None:
            return
        held = nd.lock.get(v.height)
        if v.type == VoteType.PRECOMMIT:
            if held is None or v.round > held[0]:
                nd.lock[v.height] = (v.round, v.value_id)
            return
        free = held is None or held[1] == v.value_id
        keeper = nd.core.keeper
        for vr in nd.pols.get((v.height, v.round, v.value_id), ()):
            if vr == -1 and free:
                return
            if (vr >= 0 and keeper is not None
                    and keeper.has_quorum(vr, VoteType.PREVOTE, v.value_id)
                    and (free or vr >= held[0])):  # type: ignore[index]
                return
        pols = sorted(nd.pols.get((v.height, v.round, v.value_id), ()))
        self.violate(
            "lock",
            f"{nd.address!r} (lock {held}) prevoted a value in round {v.round} of height "
            f"{v.height} without L22/L28 (POL rounds {pols})",
        )

    def on_decide(self, nd: _Node, d: Decide) -> None:
        if nd.behaviour is not None:
            nd.decisions[d.height] = d
            if d.height + 1 < self.p.heights + UNCHECKED_HEIGHTS:
                self.apply(nd, StartHeight(d.height + 1, self.validators))
            return
        vid = value_id(d.value)
        if d.height in nd.decisions:
            self.violate("agreement", f"{nd.address!r} decided height {d.height} twice")
        nd.decisions[d.height] = d
        for other in self.correct:
            od = other.decisions.get(d.height)
            if od is not None and od.value != d.value:
                self.violate(
                    "agreement",
                    f"height {d.height}: {nd.address!r} decided {d.value.hex()[:8]}, "
                    f"{other.address!r} {od.value.hex()[:8]}",
                )
                break
        if not is_valid(d.value) or not (nd.validated.get(vid) or vid in nd.own_values):
            self.violate("validity", f"{nd.address!r} decided unvalidated {d.value.hex()[:8]}")
        if nd.policy is not None:
            nd.policy.on_decide(d, self.now)
        prop = nd.proposals.get((d.height, d.round, vid))
        cert: list[ProposalReceived | VoteReceived] = [VoteReceived(v) for v in d.commit]
        if prop is not None:
            cert.append(ProposalReceived(prop))
        nd.certs[d.height] = cert
        # every checked height decided: the run may end (``run``); until it does, the node
        # goes on into unchecked heights as a service would, so a validator still behind hears
        # a higher height and block-syncs (``sync_from``; classic seed 8476: one cut off until
        # the others had decided the last checked height never learnt it was behind)
        nd.done = all(h in nd.decisions for h in range(self.p.heights))
        if d.height + 1 < self.p.heights + UNCHECKED_HEIGHTS:
            self.apply(nd, StartHeight(d.height + 1, self.validators))

    # -------------------------------------------------------------- Byzantine behaviour

    def byzantine_proposal(self, nd: _Node, p: Proposal) -> None:
        if nd.behaviour == "silent":
            return
        self.send(nd, nd.index, ProposalReceived(p))  # its own core follows its first value
        others = [i for i in range(len(self.nodes)) if i != nd.index]
        if nd.behaviour in ("equivocate", "vote-all"):
            prefix = b"V" if self.rng.random() < 0.5 else b"X"
            alt = Proposal(
                p.height, p.round, prefix + self.rng.randbytes(15), p.pol_round, p.proposer
            )
            if self.p.split:
                alt = Proposal(p.height, p.round, b"V" + alt.value[1:], p.pol_round, p.proposer)
                first = [i for i in others if i in self.p.split]
                second = [i for i in others if i not in self.p.split]
            else:
                self.rng.shuffle(others)
                half = len(others) // 2
                first, second = others[:half], others[half:]
            if self.p.adversary:  # it knows its own second value: vote-all votes for it too
                nd.seen_values.setdefault(p.height, []).append(alt.value_id)
                nd.seen_round.setdefault((p.height, p.round), set()).add(alt.value_id)
            for i in first:
                self.send(nd, i, ProposalReceived(p))
            for i in second:
                self.send(nd, i, ProposalReceived(alt))
        elif nd.behaviour == "invalid":
            bad = Proposal(
                p.height, p.round, b"X" + self.rng.randbytes(15), p.pol_round, p.proposer
            )
            nd.seen_values.setdefault(p.height, []).append(bad.value_id)
            for i in others:
                self.send(nd, i, ProposalReceived(bad))
        elif nd.behaviour == "fake-pol" and p.round > 0:
            fake = Proposal(p.height, p.round, p.value, p.round - 1, p.proposer)
            k = nd.core.keeper
            for vr in range(p.round if k is not None else 0):  # the oldest real polka
                found, vid = k.quorum_value(vr, VoteType.PREVOTE)  # type: ignore[union-attr]
                old = nd.proposals.get((p.height, vr, vid)) if found and vid else None
                if old is not None and vid != p.value_id:
                    fake = Proposal(p.height, p.round, old.value, vr, p.proposer)
                    break
            for i in others:
                self.send(nd, i, ProposalReceived(fake))
        else:
            for i in others:
                self.send(nd, i, ProposalReceived(p))

    def lock_race_vote(self, nd: _Node, v: Vote, others: list[int]) -> None:
        """The ``lock-race`` script (:func:`lock_race_params`) at height 0; honest after."""
        def vote(vid: bytes | None, to: list[int], r: int = v.round) -> None:
            for i in to:
                self.send(nd, i, VoteReceived(Vote(v.type, v.height, r, vid, v.validator)))

        proposed = sorted(nd.seen_round.get((v.height, v.round), ()))
        value = proposed[0] if proposed else None
        if v.height != 0 or v.round > 2:
            vote(v.value_id, others)
        elif v.round == 0:
            if v.type == VoteType.PREVOTE:
                vote(value, [2])
                vote(None, [0, 1])
            else:
                vote(None, others)
        elif v.round == 1:
            vote(value, [0] if v.type == VoteType.PRECOMMIT else [0, 1])
            vote(None, [1, 2] if v.type == VoteType.PRECOMMIT else [2])
        else:
            if v.type == VoteType.PREVOTE:
                first = sorted(nd.seen_round.get((0, 0), ()))
                if first:  # completes node 1's round-0 polka for v'
                    self.send(nd, 1, VoteReceived(
                        Vote(VoteType.PREVOTE, 0, 0, first[0], v.validator)))
            vote(value, others)

    def _some_value(self, nd: _Node, height: int) -> bytes | None:
        seen = nd.seen_values.get(height)
        x = self.rng.random()
        if seen and x < 0.7:
            return self.rng.choice(seen)
        if x < 0.85:
            return None
        return self.rng.randbytes(32)

    def byzantine_vote(self, nd: _Node, v: Vote) -> None:
        if nd.behaviour == "silent":
            return
        self.send(nd, nd.index, VoteReceived(v))
        others = [i for i in range(len(self.nodes)) if i != nd.index]
        if nd.behaviour == "lock-race":
            self.lock_race_vote(nd, v, others)
        elif nd.behaviour == "fake-pol":
            for i in others:
                self.send(nd, i, VoteReceived(v))
        elif nd.behaviour == "equivocate":
            for i in others:
                choice = self.rng.random()
                vid = v.value_id if choice < 0.4 else self._some_value(nd, v.height)
                self.send(nd, i, VoteReceived(Vote(v.type, v.height, v.round, vid, v.validator)))
        elif nd.behaviour == "random":
            vid = self._some_value(nd, v.height)
            fake = VoteReceived(Vote(v.type, v.height, v.round, vid, v.validator))
            for i in others:
                self.send(nd, i, fake)
            if self.rng.random() < 0.2:
                future = Vote(v.type, v.height, v.round + self.rng.randint(1, 5), vid, v.validator)
                for i in others:
                    self.send(nd, i, VoteReceived(future))
        elif nd.behaviour == "split":
            nil = VoteReceived(Vote(v.type, v.height, v.round, None, v.validator))
            for i in others:
                self.send(nd, i, VoteReceived(v) if self.rng.random() < 0.5 else nil)
        elif nd.behaviour == "vote-all":
            values = sorted(nd.seen_round.get((v.height, v.round), ())) + [None]
            self.rng.shuffle(values)
            for vid in values:
                for i in others:
                    self.send(
                        nd, i, VoteReceived(Vote(v.type, v.height, v.round, vid, v.validator))
                    )
        elif nd.behaviour == "invalid":
            seen = nd.seen_values.get(v.height)
            vid = seen[-1] if seen and v.value_id is not None else v.value_id
            for i in others:
                self.send(nd, i, VoteReceived(Vote(v.type, v.height, v.round, vid, v.validator)))

    # -------------------------------------------------------------- result

    def result(self, seed: int) -> ScheduleResult:
        rounds = []
        decided = 0
        n = self.p.n
        for h in range(self.p.heights):
            ds = [nd.decisions.get(h) for nd in self.correct]
            if all(d is not None for d in ds):
                decided += 1
                top = max(d.round for d in ds if d is not None)
                rounds.append(top)
                bound = self.bound(h)
                if top > bound and self.p.termination:
                    self.violate("termination", f"height {h} decided in round {top} > {bound}")
            else:
                if not self.p.termination:
                    break
                missing = [nd.address for nd, d in zip(self.correct, ds) if d is None]
                self.violate(
                    "termination", f"height {h} undecided by {missing} at {self.max_time:.1f} s"
                )
                break
        return ScheduleResult(
            seed=seed,
            f=self.p.f,
            n=n,
            byzantine=dict(self.p.byzantine),
            heights_decided=decided,
            rounds=rounds,
            violations=self.violations,
            deliveries=self.deliveries,
            end_time=self.now,
            wal_refused=self.wal_refused,
            adversary=self.p.adversary,
            features=features(self.p),
        )


def run_schedule(
    seed: int,
    *,
    f: int | None = None,
    heights: int = 3,
    params: SimParams | None = None,
    core_factory: Callable[[bytes, ConsensusConfig], ConsensusCore] = ConsensusCore,
    config: ConsensusConfig = SIM_CONFIG,
    mode: str = "classic",
    gossip: str | None = None,
) -> ScheduleResult:
    """Run one schedule and check its properties.

    Args:
        seed: the schedule (same seed, same run).
        f: faults tolerated (N = 3f+1); default ``1 + seed % 3``.
        heights: heights to decide.
        params: fixed parameters instead of drawn ones (``seed`` still drives the rest).
        core_factory: ``(address, config) -> core``, e.g. a deliberately broken variant.
        config: the cores' timeouts.
        mode: ``"classic"`` (:func:`draw_params`) or ``"adversarial"``
            (:func:`draw_adversarial_params`); ignored with ``params``.
        gossip: one of :data:`GOSSIP_MODES` to override the drawn (or given) parameters'.

    Returns:
        The :class:`ScheduleResult`; ``violations`` is empty when every property held.

    Raises:
        ValueError: an unknown mode or gossip mode.
    """
    rng = random.Random(seed)
    if params is None:
        ff = f if f is not None else 1 + seed % 3
        if mode == "classic":
            params = draw_params(rng, ff, heights)
        elif mode == "adversarial":
            params = draw_adversarial_params(rng, ff, heights)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    if gossip is not None:
        if gossip not in GOSSIP_MODES:
            raise ValueError(f"unknown gossip mode {gossip!r}")
        params = dataclasses.replace(params, gossip=gossip)
    sim = _Sim(seed, params, core_factory, config)
    sim.run()
    return sim.result(seed)


def summarize(results: list[ScheduleResult]) -> dict[str, object]:
    """Counts over schedules: schedules, heights decided, rounds per height (decision round +
    1) distribution, violations by property, schedules failed."""
    rounds: Counter[int] = Counter()
    violations: Counter[str] = Counter()
    by_feature: Counter[str] = Counter()
    failed_by_feature: Counter[str] = Counter()
    for r in results:
        rounds.update(x + 1 for x in r.rounds)
        for prop in r.violations:
            violations[prop] += 1
        by_feature.update(r.features)
        if not r.ok:
            failed_by_feature.update(r.features)
    return {
        "schedules": len(results),
        "heights_decided": sum(r.heights_decided for r in results),
        "rounds_per_height": dict(sorted(rounds.items())),
        "violations": {p: violations.get(p, 0) for p in PROPERTIES},
        "failed_schedules": sum(1 for r in results if not r.ok),
        "schedules_by_feature": dict(sorted(by_feature.items())),
        "failed_by_feature": dict(sorted(failed_by_feature.items())),
    }
