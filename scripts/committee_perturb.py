"""CometBFT-e2e-style perturbations of a 4-verifier committee of real ``ps-node run`` processes
(issue 17, first Target, reduced form).

Each perturbation runs ``--repeat`` times on one ``ps-node testnet --verifiers 4``; after each
we measure the seconds from the perturbation's END until the committee commits a new height
(first status file showing max-committed-at-the-end + 1), then wait until all four are up and
hold a newer height ("all4": seconds from the end until then; the paused or restarted verifier
has caught up). At the end every pair of stores must agree on the block of every height both hold.

- ``kill1``: SIGKILL one verifier, ``--down-seconds`` later restart it (end: the restart);
- ``kill2``: SIGKILL two, restart one ``--down-seconds`` later (end: that restart), then the other;
- ``stop1``: SIGSTOP one for ``--stop-seconds`` then SIGCONT (end: the SIGCONT);
- ``partition``: 2|2, each side refusing the other's connections (open ones cut) for
  ``--partition-seconds`` (end: the heal);
- ``equivocate_delay``: one verifier restarted as the TEST ONLY byzantine validator (setup, not
  measured), then the link between two correct ones delayed ``--delay-seconds`` (4.5) each way
  for ``--phase-seconds`` (end: the delay lifted); the commits DURING the phase are reported
  too (all four are up: issue 17's finding 2 was a halt there);
- ``clocklag`` / ``clocklead``: SIGKILL one, restart it ``--down-seconds`` later with its wall
  clock ``--clock-offset`` (28) s behind / ahead (end: the restart); the clock is set right
  once all four hold a newer height.

Partition, delay and clock offset are the TEST ONLY faults of :mod:`ps_p2p.testing.faults`
(a control file per verifier, rewritten here; the verifiers' configs name it only when one of
these perturbations is selected).

    python scripts/committee_perturb.py --repeat 3 --stop-seconds 20 [--load] [--out r.json]
    python scripts/committee_perturb.py --repeat 1 --only partition,equivocate_delay
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ps_p2p.testing.faults import LinkRule  # noqa: E402
from ps_p2p.testing.processes import (  # noqa: E402
    VerifierProcess,
    block_hashes,
    forks,
    make_testnet,
)

#: Issue 17's target: a new commit within this many seconds of the perturbation's end.
TARGET_S = 20.0


def _top(verifiers: list[VerifierProcess]) -> int:
    return max(v.committed() for v in verifiers)


def _first_new_commit(verifiers: list[VerifierProcess], timeout: float) -> float | None:
    """Seconds until any verifier's status shows a height above the current maximum."""
    start = time.monotonic()
    height = _top(verifiers) + 1
    while time.monotonic() - start < timeout:
        if _top(verifiers) >= height:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _level(verifiers: list[VerifierProcess], timeout: float) -> float | None:
    """Seconds until all verifiers run and hold a height above the current maximum (None:
    not within ``timeout``)."""
    start = time.monotonic()
    goal = _top(verifiers) + 1
    while time.monotonic() - start < timeout:
        heights = [v.committed() for v in verifiers]
        if all(v.running() for v in verifiers) and min(heights) >= goal:
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def _sleep_sampling(vs: list[VerifierProcess], seconds: float) -> dict:
    """Sleep ``seconds`` while sampling the committee's top height every 0.1 s: how many new
    heights were committed meanwhile and the longest stretch without one (s)."""
    start = last = time.monotonic()
    top = _top(vs)
    first = top
    gap = 0.0
    while (now := time.monotonic()) - start < seconds:
        height = _top(vs)
        if height > top:
            gap = max(gap, now - last)
            top, last = height, now
        time.sleep(0.1)
    gap = max(gap, time.monotonic() - last)
    return {"commits": top - first, "max_gap_s": round(gap, 2)}


def kill1(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> None:
    v = vs[rep % 4]
    v.kill()
    time.sleep(args.down_seconds)
    v.start()


def kill2(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> None:
    a, b = vs[rep % 4], vs[(rep + 1) % 4]
    a.kill()
    b.kill()
    time.sleep(args.down_seconds)
    a.start()


def kill2_after(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> None:
    vs[(rep + 1) % 4].start()


def stop1(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> None:
    v = vs[rep % 4]
    v.pause(True)
    time.sleep(args.stop_seconds)
    v.pause(False)


def partition(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> dict:
    """2|2: {rep, rep+1} | {rep+2, rep+3} (mod 4), both sides refusing the other's
    connections, for ``--partition-seconds``; the end is the heal (every rule lifted)."""
    sides = ([vs[rep % 4], vs[(rep + 1) % 4]], [vs[(rep + 2) % 4], vs[(rep + 3) % 4]])
    cut = LinkRule(partitioned=True)
    for mine, theirs in (sides, sides[::-1]):
        for v in mine:
            v.set_faults({o.peer_id: cut for o in theirs})
    during = _sleep_sampling(vs, args.partition_seconds)
    for v in vs:
        v.set_faults()
    return during


def equivocate_delay_setup(vs: list[VerifierProcess], rep: int,
                           args: argparse.Namespace) -> None:
    """Restart verifier ``rep`` (mod 4) as the TEST ONLY byzantine (equivocating) validator."""
    byz = vs[rep % 4]
    byz.stop()
    byz.configure(byzantine=True)
    byz.start()


def equivocate_delay(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> dict:
    """With verifier ``rep`` equivocating, the link between two correct ones (``rep+1`` and
    ``rep+2``) delayed ``--delay-seconds`` each way for ``--phase-seconds``; the end is the
    delay lifted. Returns the commits during the phase (all four are up: a halt here is
    issue 17's finding 2)."""
    y, z = vs[(rep + 1) % 4], vs[(rep + 2) % 4]
    y.set_faults({z.peer_id: LinkRule(args.delay_seconds)})
    during = _sleep_sampling(vs, args.phase_seconds)
    y.set_faults()
    return during


def equivocate_delay_cleanup(vs: list[VerifierProcess], rep: int,
                             args: argparse.Namespace) -> None:
    byz = vs[rep % 4]
    byz.stop()
    byz.configure(byzantine=False)
    byz.start()


def _clock(offset: float) -> Callable[..., None]:
    def perturb(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> None:
        """Kill verifier ``rep`` (mod 4); restart it ``--down-seconds`` later with its wall
        clock ``offset`` s off (TEST ONLY clock offset); the end is the restart."""
        v = vs[rep % 4]
        v.kill()
        time.sleep(args.down_seconds)
        v.set_faults(clock_offset_s=offset * args.clock_offset)
        v.start()
    return perturb


def clock_cleanup(vs: list[VerifierProcess], rep: int, args: argparse.Namespace) -> None:
    vs[rep % 4].set_faults()  # the clock back in time, without a restart


@dataclass(frozen=True)
class Perturbation:
    """``perturb`` runs up to the perturbation's end (a dict it returns: what happened
    during it); ``setup`` before (not measured), ``after`` right after the end (before the
    all-four wait), ``cleanup`` once all four hold a newer height (then the committee is
    waited for again, not measured)."""

    perturb: Callable[..., dict | None]
    setup: Callable[..., None] | None = None
    after: Callable[..., None] | None = None
    cleanup: Callable[..., None] | None = None
    faults: bool = False  # needs the TEST ONLY faults control files


PERTURBATIONS = {
    "kill1": Perturbation(kill1),
    "kill2": Perturbation(kill2, after=kill2_after),
    "stop1": Perturbation(stop1),
    "partition": Perturbation(partition, faults=True),
    "equivocate_delay": Perturbation(equivocate_delay, setup=equivocate_delay_setup,
                                     cleanup=equivocate_delay_cleanup, faults=True),
    "clocklag": Perturbation(_clock(-1.0), cleanup=clock_cleanup, faults=True),
    "clocklead": Perturbation(_clock(+1.0), cleanup=clock_cleanup, faults=True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", default=",".join(PERTURBATIONS),
                        help="comma-separated perturbations (default: all, in this order)")
    parser.add_argument("--stop-seconds", type=float, default=60.0)
    parser.add_argument("--down-seconds", type=float, default=10.0,
                        help="seconds a killed verifier stays down")
    parser.add_argument("--partition-seconds", type=float, default=20.0)
    parser.add_argument("--delay-seconds", type=float, default=4.5,
                        help="equivocate_delay: the delayed link's delay, each way")
    parser.add_argument("--phase-seconds", type=float, default=20.0,
                        help="equivocate_delay: how long the link stays delayed")
    parser.add_argument("--clock-offset", type=float, default=28.0,
                        help="clocklag / clocklead: seconds behind / ahead after the restart")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for a new commit before calling it a halt")
    parser.add_argument("--block-interval", type=float, default=1.0,
                        help="the verifiers' config block_interval: seconds an idle chain waits "
                        "before an empty block (default 1, so a new height is due every second; "
                        "the node's default of 30 s would hide recovery behind idling)")
    parser.add_argument("--load", action="store_true", help="run 2 CPU-burning processes")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(PERTURBATIONS)
    if unknown:
        parser.error(f"unknown perturbation(s) {', '.join(sorted(unknown))}; "
                     f"choose from {', '.join(PERTURBATIONS)}")

    burners: list[subprocess.Popen] = []
    results: dict[str, list[float | None]] = {name: [] for name in names}
    all4: dict[str, list[float | None]] = {name: [] for name in names}
    during: dict[str, list[dict]] = {name: [] for name in names}
    halts: list[dict] = []
    slow: list[dict] = []  # all four back at a newer height only after TARGET_S
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="perturb-") as folder:
        vs = make_testnet(pathlib.Path(folder) / "net", 4,
                          faults=any(PERTURBATIONS[n].faults for n in names),
                          block_interval=args.block_interval)
        try:
            if args.load:
                burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           for _ in range(2)]
            for v in vs:
                v.start()
            if _level(vs, 90) is None:
                raise SystemExit("the committee did not start")
            for rep in range(args.repeat):
                for name in names:
                    p = PERTURBATIONS[name]
                    if p.setup is not None:
                        p.setup(vs, rep, args)
                        if _level(vs, args.timeout) is None:
                            print(f"{name} rep {rep}: setup did not level", file=sys.stderr)
                    seen = p.perturb(vs, rep, args)
                    took = _first_new_commit(vs, args.timeout)
                    results[name].append(took)
                    if seen is not None:
                        during[name].append(seen)
                    if p.after is not None:
                        p.after(vs, rep, args)
                    level = _level(vs, args.timeout)
                    all4[name].append(None if level is None or took is None else took + level)
                    if took is None or level is None:
                        halts.append({"perturbation": name, "rep": rep,
                                      "heights": [v.committed() for v in vs],
                                      "logs": [v.log_tail(6000) for v in vs]})
                        print(f"HALT? {name} rep {rep}: heights {halts[-1]['heights']}",
                              file=sys.stderr)
                    elif took + level > TARGET_S:  # recovered, but one verifier lagged: why
                        slow.append({"perturbation": name, "rep": rep,
                                     "all4_s": round(took + level, 1),
                                     "logs": [v.log_tail(6000) for v in vs]})
                    if p.cleanup is not None:
                        p.cleanup(vs, rep, args)
                        _level(vs, args.timeout)
                    print(f"{name} rep {rep}: {took} {seen or ''}", file=sys.stderr, flush=True)
        finally:
            for v in vs:
                v.stop()
            for b in burners:
                b.kill()
                b.wait()
        forked = forks([v.store_path for v in vs])
        compared = min(len(block_hashes(v.store_path)) for v in vs)

    rows = []
    print(f"{'perturbation':<18}{'runs':>6}{'<=20s':>7}{'p50 s':>8}{'max s':>8}{'forks':>7}"
          f"{'all4 max s':>12}")
    for name, times in results.items():
        ok = [t for t in times if t is not None]
        row = {"perturbation": name, "runs": len(times),
               "recovered_within_20s": sum(t <= TARGET_S for t in ok),
               "p50_s": round(statistics.median(ok), 2) if ok else None,
               "max_s": round(max(ok), 2) if len(ok) == len(times) and ok else None,  # None: a halt
               "forks": len(forked), "seconds": times, "all4_seconds": all4[name]}
        if during[name]:
            row["during"] = during[name]
        rows.append(row)
        fmt = lambda x: "halt" if x is None else f"{x:.1f}"  # noqa: E731
        level = None if None in all4[name] or not all4[name] else max(all4[name])
        print(f"{name:<18}{row['runs']:>6}{row['recovered_within_20s']:>7}"
              f"{fmt(row['p50_s']):>8}{fmt(row['max_s']):>8}{row['forks']:>7}{fmt(level):>12}")
    for name, seen in during.items():
        if seen:
            print(f"during {name}: heights committed per run {[d['commits'] for d in seen]}, "
                  f"longest stretch without a commit {max(d['max_gap_s'] for d in seen):.1f} s")
    print(f"fork check: every height in 2+ of the 4 stores ({compared}+ heights each), "
          f"{len(forked)} with different blocks")
    if args.out:
        args.out.write_text(json.dumps({
            "load": args.load, "args": {k: str(v) for k, v in vars(args).items()},
            "started_unix": started, "ended_unix": time.time(), "rows": rows,
            "fork_heights": forked, "halts": halts, "slow_all4": slow}, indent=1))
    return 1 if forked or halts else 0


if __name__ == "__main__":
    sys.exit(main())
