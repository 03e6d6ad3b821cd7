"""Attack (issue 16, HIGH 2): one lying member of a model group captures its entry node's traffic.

A model group of four: entry node A (the one users ask), honest members B and C, and a sybil
member L that gossips a signed load report "idle and instantly fast" (Q = 0, L = 0 s, C = 4096)
every second. A's forwarding runs as a node deploys it (:class:`ps_p2p.roles.forwarding.
GroupForwarding`, the real LoadBook and Algorithm 2, signed gossip envelopes opened by
``receive``), on an injected clock. Requests reach A every 1/6 s with distinct prompts (no
cache hits: Algorithm 2's least-loaded case); each node serves 2 at a time for 1 s, honest
members report their real load every second, and what A forwards to a peer comes back as that
peer's answer:

* ``garbage``: L answers at once (a signed answer of its own making; A cannot tell garbage from
  text, the verification committee scores it later);
* ``drop``: L never answers; A's forward to it times out after the model node's forward
  deadline (``ps_p2p.roles.model``), and the user's request with it.

Outcomes go back to A's forwarding through ``forward_done`` when the code has it (it is the fix:
before it, A learnt nothing from its forwards).

Run: ``python benchmarks/attacks/load_capture.py [--requests 30] [--mode garbage|drop|both]
[--trials 5]``; prints, per mode and trial (fixed identities per trial: peer IDs break
Algorithm 2's ties), how many of the N requests A sent to L, to B and C, and served itself.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import pathlib
import sys

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

from ps_p2p.config import ForwardingConfig  # noqa: E402
from ps_p2p.engines.sim_cost import SimParams  # noqa: E402
from ps_p2p.engines.sim_engine import SimEngine  # noqa: E402
from ps_p2p.gossip.load import LoadTracker  # noqa: E402
from ps_p2p.inference import InferenceQuery, SamplingParams  # noqa: E402
from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.records import Directory, NodeRecord, Role  # noqa: E402
from ps_p2p.roles import model as model_role  # noqa: E402
from ps_p2p.roles.forwarding import GroupForwarding  # noqa: E402

SERVICE = 1.0  # seconds a request takes on an honest node
CAPACITY = 2
GAP = 1.0 / 6.0  # seconds between two requests reaching A (75% of the group's capacity)
GARBAGE_AFTER = 0.01  # seconds the liar takes to answer
CONFIG = ForwardingConfig(group_key="22" * 32, chunk_default=4)


def _record(identity: Identity) -> NodeRecord:
    return NodeRecord(identity.peer_id, (), frozenset({Role.MODEL}), b"\x00" * 32,
                      model_id="sim", capacity=CAPACITY, issued_at_ms=0, expires_at_ms=10**13)


class _Honest:
    """A model node that serves CAPACITY requests at a time, SERVICE seconds each."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.tracker = LoadTracker(CAPACITY, 64)
        self.slots: list[float] = []  # finish times of requests in service
        self.waiting: list[float] = []  # arrival times

    def admit(self, now: float) -> None:
        self.tracker.try_admit()
        self.waiting.append(now)
        self._fill(now)

    def _fill(self, now: float) -> None:
        while self.waiting and len(self.slots) < CAPACITY:
            self.waiting.pop(0)
            self.tracker.start()
            heapq.heappush(self.slots, now + SERVICE)

    def advance(self, now: float) -> list[float]:
        """Finish what is due by ``now``; returns the finish times."""
        done = []
        while self.slots and self.slots[0] <= now:
            at = heapq.heappop(self.slots)
            self.tracker.finish(SERVICE)
            done.append(at)
            self._fill(at)
        return done


async def run(mode: str, requests: int, trial: int) -> dict[str, int]:
    now = 0.0
    # fixed identities per trial: peer IDs decide Algorithm 2's ties, so each trial orders
    # the liar differently among the honest nodes
    a, b, c, liar = (Identity.from_private_bytes(hashlib.sha256(
        b"load_capture %d %d" % (trial, i)).digest()) for i in range(4))
    fast = SimParams(prefill_tokens_per_s=1e9, step_time=1e-6)
    entry = GroupForwarding(a, SimEngine("sim", fast), LoadTracker(CAPACITY, 64), CONFIG,
                            clock=lambda: now)
    entry.set_directory(Directory(1, 0, 10**13, tuple(sorted(
        (_record(x) for x in (a, b, c, liar)), key=lambda r: r.peer_id))))
    me = _Honest(a)
    entry.load = me.tracker  # A's own F_LB comes from its real queue
    entry.policy.tracker = me.tracker
    honest = {b.peer_id: _Honest(b), c.peer_id: _Honest(c)}
    gossip = {p: GroupForwarding(h.identity, SimEngine("sim", fast), h.tracker, CONFIG)
              for p, h in honest.items()}
    lying_tracker = LoadTracker(4096, 0)
    lying_tracker.latency_ewma = 0.0  # "instantly fast", and never anything queued
    gossip[liar.peer_id] = GroupForwarding(liar, SimEngine("sim", fast), lying_tracker, CONFIG)
    done_hook = getattr(entry, "forward_done", None)
    timeout = getattr(model_role, "FORWARD_TIMEOUT", 300.0)
    pending: list[tuple[float, int, bytes, bool, float]] = []  # (at, n, peer, answered, sent)
    counts = {"liar": 0, "honest peers": 0, "served by A": 0}
    next_report = 0.0
    for n in range(requests):
        now = n * GAP
        while next_report <= now:  # every member gossips its load about every second
            for peer, node in gossip.items():
                entry.receive(peer, node.load_envelope())
            next_report += 1.0
        for h in [me, *honest.values()]:
            h.advance(now)
        while pending and pending[0][0] <= now:
            at, _, peer, answered, sent = heapq.heappop(pending)
            if done_hook is not None:  # how the model node reports it (ps_p2p.roles.model)
                from ps_p2p.gossip.load import ForwardOutcome

                outcome = ForwardOutcome.ANSWERED if answered else ForwardOutcome.FAILED
                done_hook(peer, outcome, at - sent)
        query = InferenceQuery(n.to_bytes(16, "big"), "sim", f"request {n}: a distinct prompt",
                               SamplingParams(max_tokens=2), ())
        peer = await entry.route(query)
        if peer is None:
            counts["served by A"] += 1
            me.admit(now)
        elif peer == liar.peer_id:
            counts["liar"] += 1
            if mode == "garbage":
                heapq.heappush(pending, (now + GARBAGE_AFTER, n, peer, True, now))
            else:
                heapq.heappush(pending, (now + timeout, n, peer, False, now))
        else:
            counts["honest peers"] += 1
            honest[peer].admit(now)
            # its answer comes back when it finishes (at most the queue's length later)
            q = len(honest[peer].slots) + len(honest[peer].waiting)
            heapq.heappush(pending, (now + SERVICE * (1 + (q - 1) // CAPACITY), n, peer, True, now))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--mode", choices=("garbage", "drop", "both"), default="both")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args(argv)
    for mode in ("garbage", "drop") if args.mode == "both" else (args.mode,):
        for trial in range(args.trials):
            counts = trio.run(run, mode, args.requests, trial)
            print(f"{mode:8s} trial {trial}, of {args.requests} requests: liar {counts['liar']}, "
                  f"honest peers {counts['honest peers']}, served by A {counts['served by A']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
