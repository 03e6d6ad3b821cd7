"""A deterministic simulator of the verifier committee's consensus under faults.

It drives N = 3f+1 :class:`~ps_p2p.consensus.core.ConsensusCore` instances (equal power) through
a simulated network and application, with up to f Byzantine validators, and checks on every
schedule the properties of Algorithm 1 (Buchman, Kwon, Milosevic, arXiv 1807.04938):

* **agreement**: no two correct validators decide different values at one height;
* **validity**: every value a correct validator decides is valid, and that validator's
  application said so (``ValueValidated(valid=True)``) or proposed it itself;
* **no-double-sign**: a correct validator never emits two different votes (nor proposals) for
  one (type, height, round);
* **accountability**: equivocation evidence never names a correct validator;
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
  committee and nil to the rest, so that correct validators see different quorums.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ps_p2p.consensus.core import ConsensusConfig, ConsensusCore
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
    ScheduleTimeout,
    StartHeight,
    TimeoutFired,
    ValidateValue,
    Validator,
    ValueValidated,
    Vote,
    VoteReceived,
    value_id,
)

__all__ = [
    "BEHAVIOURS",
    "PROPERTIES",
    "SIM_CONFIG",
    "ScheduleResult",
    "SimParams",
    "draw_params",
    "run_schedule",
    "termination_rounds",
]

#: Byzantine behaviours (see the module docstring).
BEHAVIOURS = ("silent", "equivocate", "random", "invalid", "vote-all", "split")
#: The properties checked on every schedule.
PROPERTIES = ("agreement", "validity", "no-double-sign", "accountability", "termination")

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
    """Rounds a height may take after GST beyond the highest round reached at GST.

    After GST, rounds of correct validators align within one round (L55 and equal timeouts);
    the correct validator with the highest validRound has proposed within n rounds (round
    robin), and every correct validator accepts its value (L28-29: their lockedRound is at most
    their validRound, so at most its validRound). Two more rounds for the alignment.
    """
    return n + 2


def is_valid(value: bytes) -> bool:
    """The simulated application's ``valid(v)``."""
    return value[:1] == b"V"


@dataclass(frozen=True)
class SimParams:
    """One schedule's parameters (seconds for times).

    ``partitions``: (start, end, group) windows before GST in which messages between ``group``
    (a set of node indices) and the rest are lost. ``byzantine``: node index -> behaviour.
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
    max_time: float = 0.0  # 0: gst + 5 s per height + 10 s

    @property
    def n(self) -> int:
        return 3 * self.f + 1


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


@dataclass
class ScheduleResult:
    """What one schedule did: per height, the highest decision round among correct validators
    (``rounds``), and violations by property (messages)."""

    seed: int
    f: int
    n: int
    byzantine: dict[int, str]
    heights_decided: int
    rounds: list[int]
    violations: dict[str, list[str]] = field(default_factory=dict)
    deliveries: int = 0
    end_time: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations


# event kinds
_DELIVER, _TIMEOUT, _APP, _TICK = 0, 1, 2, 3


class _Node:
    def __init__(self, index: int, address: bytes, core: ConsensusCore, behaviour: str | None):
        self.index = index
        self.address = address
        self.core = core
        self.behaviour = behaviour  # None: correct
        # every distinct message heard (own ones included), per height, in arrival order
        self.heard: dict[int, dict[ProposalReceived | VoteReceived, None]] = {}
        self.proposals: dict[tuple[int, int, bytes], Proposal] = {}
        self.certs: dict[int, list[ProposalReceived | VoteReceived]] = {}
        self.decisions: dict[int, Decide] = {}
        self.validated: dict[bytes, bool] = {}
        self.own_values: set[bytes] = set()
        self.cert_sent: dict[tuple[int, int], float] = {}
        self.tick_height: int | None = None
        self.ticked = False
        self.done = False
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
        n = params.n
        self.validators = tuple(Validator(b"val-%02d" % i) for i in range(n))
        self.nodes = [
            _Node(i, v.address, core_factory(v.address, config), params.byzantine.get(i))
            for i, v in enumerate(self.validators)
        ]
        self.by_address = {nd.address: nd for nd in self.nodes}
        self.correct = [nd for nd in self.nodes if nd.behaviour is None]
        self.queue: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.deliveries = 0
        self.violations: dict[str, list[str]] = {}
        self.signed: dict[tuple[bytes, int, int, int], object] = {}  # correct validators only
        self.round_at_gst: dict[int, int] = {}
        self.max_time = params.max_time or params.gst + 5.0 * params.heights + 10.0

    # -------------------------------------------------------------- plumbing

    def push(self, at: float, kind: int, node: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (at, self.seq, kind, node, payload))

    def violate(self, prop: str, msg: str) -> None:
        self.violations.setdefault(prop, []).append(msg)

    def lost(self, src: int, dst: int) -> bool:
        t = self.now
        if t >= self.p.gst:
            return False
        for start, end, group in self.p.partitions:
            if start <= t < end and ((src in group) != (dst in group)):
                return True
        return self.rng.random() < self.p.drop

    def send(self, src: _Node, dst: int, msg: ProposalReceived | VoteReceived) -> None:
        if dst == src.index:
            self.push(self.now, _DELIVER, dst, (src.index, msg))
            return
        if self.lost(src.index, dst):
            return
        if self.now < self.p.gst:
            delay = self.rng.uniform(0.0, self.p.pre_gst_delay)
        else:
            delay = self.rng.uniform(0.001, self.p.delta)
        self.push(self.now + delay, _DELIVER, dst, (src.index, msg))

    def broadcast(self, src: _Node, msg: ProposalReceived | VoteReceived) -> None:
        for i in range(len(self.nodes)):
            self.send(src, i, msg)

    # -------------------------------------------------------------- running

    def run(self) -> None:
        for nd in self.nodes:
            if nd.behaviour != "silent":
                self.apply(nd, StartHeight(0, self.validators))
        for nd in self.correct:
            self.push(self.p.gst, _TICK, nd.index, None)
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
                self.deliveries += 1
                src, msg = payload  # type: ignore[misc]
                self.receive(nd, src, msg)
            elif kind == _TICK:
                self.tick(nd)
            else:
                self.apply(nd, payload)  # type: ignore[arg-type]
            if all(c.done for c in self.correct):
                break
        if not gst_seen:
            self.snapshot_gst()

    def snapshot_gst(self) -> None:
        for nd in self.correct:
            h = nd.core.height
            if h is not None and nd.core.decision is None:
                self.round_at_gst[h] = max(self.round_at_gst.get(h, 0), nd.core.round)

    def tick(self, nd: _Node) -> None:
        """Gossip stand-in: re-send our messages of a height that made no progress since the
        last tick (every message at the first tick, at GST)."""
        if nd.done:
            return
        h = nd.core.height
        if not nd.ticked or h == nd.tick_height:
            for msg in nd.heard.get(h, ()):  # type: ignore[arg-type]
                for i in range(len(self.nodes)):
                    if i != nd.index:
                        self.send(nd, i, msg)
        nd.ticked = True
        nd.tick_height = h
        self.push(self.now + self.p.resend_interval, _TICK, nd.index, None)

    def receive(self, nd: _Node, src: int, msg: ProposalReceived | VoteReceived) -> None:
        if nd.behaviour == "silent":
            return
        if isinstance(msg, ProposalReceived):
            p = msg.proposal
            nd.proposals[(p.height, p.round, p.value_id)] = p
            if nd.behaviour is not None:
                nd.seen_values.setdefault(p.height, []).append(p.value_id)
                nd.seen_round.setdefault((p.height, p.round), set()).add(p.value_id)
            height = p.height
        else:
            height = msg.vote.height
        if nd.behaviour is None:
            nd.heard.setdefault(height, {})[msg] = None
        if nd.behaviour is None and src != nd.index and height in nd.certs:
            last = nd.cert_sent.get((src, height))
            if last is None or self.now - last >= self.p.resend_interval:
                nd.cert_sent[(src, height)] = self.now
                for m in nd.certs[height]:
                    self.send(nd, src, m)
        self.apply(nd, msg)

    def apply(self, nd: _Node, inp: Input) -> None:
        for out in nd.core.handle(inp, self.now):
            self.execute(nd, out)

    # -------------------------------------------------------------- outputs

    def execute(self, nd: _Node, out: object) -> None:
        if isinstance(out, BroadcastProposal):
            if nd.behaviour is None:
                self.check_sign(
                    nd, ("proposal", out.proposal.height, out.proposal.round), out.proposal
                )
                self.broadcast(nd, ProposalReceived(out.proposal))
            else:
                self.byzantine_proposal(nd, out.proposal)
        elif isinstance(out, BroadcastVote):
            v = out.vote
            if nd.behaviour is None:
                self.check_sign(nd, (int(v.type), v.height, v.round), v)
                self.broadcast(nd, VoteReceived(v))
            else:
                self.byzantine_vote(nd, v)
        elif isinstance(out, ScheduleTimeout):
            self.push(
                self.now + out.duration,
                _TIMEOUT,
                nd.index,
                TimeoutFired(out.kind, out.height, out.round),
            )
        elif isinstance(out, GetValue):
            if nd.behaviour == "invalid":
                value = b"X" + self.rng.randbytes(15)
            else:
                value = b"V" + self.rng.randbytes(15)
            nd.own_values.add(value_id(value))
            self.push(
                self.now + self.p.app_delay,
                _APP,
                nd.index,
                ProposeValue(out.height, out.round, value),
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
                ValueValidated(out.height, out.round, value_id(out.value), ok),
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

    def on_decide(self, nd: _Node, d: Decide) -> None:
        if nd.behaviour is not None:
            nd.decisions[d.height] = d
            if d.height + 1 < self.p.heights:
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
        prop = nd.proposals.get((d.height, d.round, vid))
        cert: list[ProposalReceived | VoteReceived] = [VoteReceived(v) for v in d.commit]
        if prop is not None:
            cert.append(ProposalReceived(prop))
        nd.certs[d.height] = cert
        if d.height + 1 < self.p.heights:
            self.apply(nd, StartHeight(d.height + 1, self.validators))
        else:
            nd.done = True

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
            self.rng.shuffle(others)
            half = len(others) // 2
            for i in others[:half]:
                self.send(nd, i, ProposalReceived(p))
            for i in others[half:]:
                self.send(nd, i, ProposalReceived(alt))
        elif nd.behaviour == "invalid":
            bad = Proposal(
                p.height, p.round, b"X" + self.rng.randbytes(15), p.pol_round, p.proposer
            )
            nd.seen_values.setdefault(p.height, []).append(bad.value_id)
            for i in others:
                self.send(nd, i, ProposalReceived(bad))
        else:
            for i in others:
                self.send(nd, i, ProposalReceived(p))

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
        if nd.behaviour == "equivocate":
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
                bound = self.round_at_gst.get(h, 0) + termination_rounds(n)
                if top > bound:
                    self.violate("termination", f"height {h} decided in round {top} > {bound}")
            else:
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
        )


def run_schedule(
    seed: int,
    *,
    f: int | None = None,
    heights: int = 3,
    params: SimParams | None = None,
    core_factory: Callable[[bytes, ConsensusConfig], ConsensusCore] = ConsensusCore,
    config: ConsensusConfig = SIM_CONFIG,
) -> ScheduleResult:
    """Run one schedule and check its properties.

    Args:
        seed: the schedule (same seed, same run).
        f: faults tolerated (N = 3f+1); default ``1 + seed % 3``.
        heights: heights to decide.
        params: fixed parameters instead of drawn ones (``seed`` still drives the rest).
        core_factory: ``(address, config) -> core``, e.g. a deliberately broken variant.
        config: the cores' timeouts.

    Returns:
        The :class:`ScheduleResult`; ``violations`` is empty when every property held.
    """
    rng = random.Random(seed)
    if params is None:
        params = draw_params(rng, f if f is not None else 1 + seed % 3, heights)
    sim = _Sim(seed, params, core_factory, config)
    sim.run()
    return sim.result(seed)


def summarize(results: list[ScheduleResult]) -> dict[str, object]:
    """Counts over schedules: schedules, heights decided, rounds per height (decision round +
    1) distribution, violations by property, schedules failed."""
    rounds: Counter[int] = Counter()
    violations: Counter[str] = Counter()
    for r in results:
        rounds.update(x + 1 for x in r.rounds)
        for prop in r.violations:
            violations[prop] += 1
    return {
        "schedules": len(results),
        "heights_decided": sum(r.heights_decided for r in results),
        "rounds_per_height": dict(sorted(rounds.items())),
        "violations": {p: violations.get(p, 0) for p in PROPERTIES},
        "failed_schedules": sum(1 for r in results if not r.ok),
    }
