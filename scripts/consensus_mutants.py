#!/usr/bin/env python3
"""Mutation check of the consensus core: is each deliberate one-line bug caught?

Usage::

    python scripts/consensus_mutants.py [--only NAME ...] [--schedules 300] [--ref REV]
        [--no-tests] [--no-sim] [--json] [--gossip relay|service|before]

Each mutant (:data:`MUTANTS`: one line of ``ps_p2p/consensus/core.py`` or ``votes.py`` changed,
named after the line of Algorithm 1 it breaks; arXiv 1807.04938) is applied to a temporary copy
of the package (the real files are never edited), and then:

* the consensus tests (``tests/test_consensus_core.py``, ``tests/test_consensus_sim.py``) run
  against the copy (pytest ``-x``; the first failing test is the catch);
* the simulator (:mod:`ps_p2p.testing.consensus_sim`) runs ``--schedules`` classic schedules
  (seeds 0.., 3 heights) and as many adversarial ones (seeds 0.., 2 heights), with the
  schedules' relay gossip or, with ``--gossip service``, the service's own gossip object; the
  first seed with a violation is the catch.

It prints a table (mutant, caught by test / simulator seed / not caught) and the totals, and
first checks that the unmutated copy passes the same runs (else the table means nothing).
``--ref REV`` takes the tests and the simulator from git revision REV (e.g. the commit before
issue 17's work) and runs classic schedules only: the "before" column of docs/consensus.
Exit status 1 when a mutant is not caught.

Takes ~1 s per caught mutant and up to ``--budget`` seconds per surviving one; run long
campaigns with ``nice -n 10``. The short form runs in CI as
``tests/test_consensus_sim.py::test_mutation_check_short_form`` (slow).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS = ("tests/test_consensus_core.py", "tests/test_consensus_sim.py")
SIM_MODULE = "ps_p2p/testing/consensus_sim.py"
CORE = "ps_p2p/consensus/core.py"
VOTES = "ps_p2p/consensus/votes.py"


@dataclass(frozen=True)
class Mutant:
    """One single-line bug: the ``occurrence``-th line of ``path`` that contains ``old`` (a
    unique part of it) gets ``old`` replaced by ``new``."""

    name: str
    path: str
    old: str
    new: str
    occurrence: int = 1


MUTANTS: tuple[Mutant, ...] = (
    Mutant("L61 precommit the proposal on timeoutPrevote", CORE,
           "self._vote(VoteType.PRECOMMIT, None, out)  # L63",
           "self._vote(VoteType.PRECOMMIT, next(iter(self._proposals.get(self.round, {})), None),"
           " out)  # L63"),
    Mutant("quorum read as >= 2/3", VOTES,
           "return 3 * power > 2 * self.total_power",
           "return 3 * power >= 2 * self.total_power"),
    Mutant("L49 decide on f+1 precommits", VOTES,
           "if self.is_quorum(value_power):",
           "if (self.is_one_third if vote.type == VoteType.PRECOMMIT else self.is_quorum)"
           "(value_power):"),
    Mutant("L29 ignore the lock", CORE,
           "self.locked_round <= p.pol_round or self.locked_value == p.value",
           "True"),
    Mutant("accept a POL round >= round", CORE,
           "NIL_ROUND <= p.pol_round < p.round):", "NIL_ROUND <= p.pol_round <= p.round + 1):",
           occurrence=2),
    Mutant("timeouts that do not grow", CORE,
           "self.config.timeout(kind, self.round))", "self.config.timeout(kind, 0))"),
    Mutant("no lock restore on restart", CORE,
           "if inp.round > self.locked_round:", "if False:"),
    Mutant("L23 ignore the lock", CORE,
           "self.locked_round == NIL_ROUND or self.locked_value == p.value", "True"),
    Mutant("L28 re-proposal without its POL", CORE,
           "if k.has_quorum(p.pol_round, VoteType.PREVOTE, vid):  # L28",
           "if True:  # L28"),
    Mutant("L34 no prevote timeout", CORE,
           "if not self._l34_done and k.has_quorum_any(r, VoteType.PREVOTE):  # L34",
           "if False:  # L34"),
    Mutant("L37 precommit in any step", CORE,
           "if self.step == Step.PREVOTE:  # L37", "if True:  # L37"),
    Mutant("L42 validValue never set", CORE,
           "self.valid_value, self.valid_round = value, r  # L42-43", "pass  # L42-43"),
    Mutant("L44 precommit nil on any 2f+1 prevotes", CORE,
           "if k.has_quorum(r, VoteType.PREVOTE, None):  # L44",
           "if k.has_quorum_any(r, VoteType.PREVOTE):  # L44"),
    Mutant("L47 precommit timeout only on a nil quorum", CORE,
           "if not self._l47_done and k.has_quorum_any(r, VoteType.PRECOMMIT):  # L47",
           "if not self._l47_done and k.has_quorum(r, VoteType.PRECOMMIT, None):  # L47"),
    Mutant("L49 decide only in the current round", CORE,
           "for r2, vid in self._precommit_quorums():",
           "for r2, vid in [q for q in self._precommit_quorums() if q[0] == self.round]:"),
    Mutant("L55 round skip on one sender", VOTES,
           "return 3 * power > self.total_power", "return power > 0"),
    Mutant("L57 timeoutPropose ignores the step", CORE,
           "if self.step == Step.PROPOSE:  # L57-58", "if True:  # L57-58"),
    Mutant("L65 stale timeouts act", CORE,
           "if inp.height != self.height or inp.round != self.round or self.decision is not None:",
           "if inp.height != self.height or self.decision is not None:"),
    Mutant("a duplicate vote counted twice", VOTES,
           "if held.value_id == vote.value_id:\n                return AddVoteResult.DUPLICATE, None",
           "if False:\n                return AddVoteResult.DUPLICATE, None"),
    Mutant("votes counted by heads, not power", VOTES,
           "tally.power += self._power[vote.validator]", "tally.power += 1"),
)


def apply(root: pathlib.Path, m: Mutant) -> None:
    """Apply ``m`` to the copy under ``root``.

    Raises:
        ValueError: ``old`` does not occur ``occurrence`` times (the source moved on: update
            the mutant).
    """
    path = root / m.path
    text = path.read_text()
    at = -1
    for _ in range(m.occurrence):
        at = text.find(m.old, at + 1)
        if at < 0:
            raise ValueError(f"mutant {m.name!r}: {m.old!r} not found in {m.path}")
    path.write_text(text[:at] + m.new + text[at + len(m.old):])


def prepare(dest: pathlib.Path, ref: str | None) -> None:
    """A copy of the package and the consensus tests under ``dest`` (tests and simulator from
    git ``ref`` if given)."""
    shutil.copytree(REPO / "ps_p2p", dest / "ps_p2p",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "tests").mkdir()
    for name in ("tests/conftest.py", "pyproject.toml", *TESTS):
        shutil.copy(REPO / name, dest / name)
    if ref is not None:
        for name in (*TESTS, SIM_MODULE):
            text = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
            (dest / name).write_text(text)


def run_tests(root: pathlib.Path, budget: float) -> str | None:
    """The first failing consensus test under ``root`` (None: all pass)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider",
           "-m", "not slow", *TESTS]
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        return "(tests timed out)"
    if proc.returncode == 0:
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0]
    return f"(pytest exit {proc.returncode})"


_SIM_RUNNER = r"""
import inspect, sys, time
from ps_p2p.testing import consensus_sim as cs
n, budget, gossip = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
params = inspect.signature(cs.run_schedule).parameters
modes = [("classic", 3)]
if "mode" in params:
    modes.append(("adversarial", 2))
end = time.monotonic() + budget
for seed in range(n):
    for mode, heights in modes:
        kw = {"mode": mode} if mode != "classic" else {}
        if gossip and "gossip" in params:
            kw["gossip"] = gossip
        r = cs.run_schedule(seed, heights=heights, **kw)
        if r.violations:
            print(f"{mode} seed {seed}: {sorted(r.violations)[0]}")
            sys.exit(0)
        if time.monotonic() > end:
            print(f"(budget: {seed + 1} seeds)")
            sys.exit(0)
print("")
"""


def run_sim(root: pathlib.Path, schedules: int, budget: float, gossip: str = "") -> str | None:
    """The first schedule with a violation under ``root`` (None: none in ``schedules`` seeds
    per mode, or in the budget: then the answer starts with "(budget"). ``gossip``: the
    simulator's gossip mode ("" for each schedule's own: relay)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _SIM_RUNNER, str(schedules), str(budget),
                               gossip],
                              cwd=root, capture_output=True, text=True, timeout=budget + 120)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return f"(simulator crashed: {proc.stderr.strip().splitlines()[-1:]})"
    line = proc.stdout.strip()
    if not line or line.startswith("(budget"):
        return None
    return line


def check(mutants: tuple[Mutant, ...], *, ref: str | None, schedules: int, tests: bool,
          sim: bool, budget: float, baseline: bool = True, gossip: str = ""
          ) -> list[dict[str, object]]:
    """Run every mutant; returns one row per mutant (name, test, sim, caught, seconds).

    Raises:
        RuntimeError: the unmutated copy fails the tests or the simulator.
    """
    rows = []
    with tempfile.TemporaryDirectory(prefix="consensus-mutants-") as tmp:
        base = pathlib.Path(tmp) / "base"
        prepare(base, ref)
        if baseline:
            if tests and (failed := run_tests(base, budget * 4)) is not None:
                raise RuntimeError(f"the unmutated copy fails {failed}")
            if sim and (seed := run_sim(base, schedules, budget * 4, gossip)) is not None:
                raise RuntimeError(f"the unmutated copy fails the simulator: {seed}")
        for i, m in enumerate(mutants):
            root = pathlib.Path(tmp) / f"m{i}"
            shutil.copytree(base, root)
            apply(root, m)
            start = time.perf_counter()
            test = run_tests(root, budget) if tests else None
            seed = run_sim(root, schedules, budget, gossip) if sim else None
            rows.append({
                "mutant": m.name, "test": test, "sim": seed,
                "caught": test is not None or seed is not None,
                "seconds": round(time.perf_counter() - start, 1),
            })
            shutil.rmtree(root)
            print(f"  {m.name}: test={test} sim={seed}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names (substrings) to run")
    ap.add_argument("--schedules", type=int, default=300, help="seeds per simulator mode")
    ap.add_argument("--budget", type=float, default=90.0, help="seconds per mutant and check")
    ap.add_argument("--ref", help="take the tests and simulator from this git revision")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--gossip", default="", choices=("", "relay", "service", "before"),
                    help="the simulator's gossip (default: relay, the schedules' own)")
    args = ap.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        mutants = tuple(m for m in MUTANTS if any(o in m.name for o in args.only))
    start = time.perf_counter()
    rows = check(mutants, ref=args.ref, schedules=args.schedules, tests=not args.no_tests,
                 sim=not args.no_sim, budget=args.budget, gossip=args.gossip)
    caught = sum(1 for r in rows if r["caught"])
    by_tests = sum(1 for r in rows if r["test"])
    by_sim = sum(1 for r in rows if r["sim"])
    if args.json:
        print(json.dumps({"rows": rows, "caught": caught, "by_tests": by_tests,
                          "by_sim": by_sim, "mutants": len(rows)}, indent=2))
    else:
        width = max(len(r["mutant"]) for r in rows)
        print(f"{'mutant':<{width}}  {'caught by test':<70}  simulator")
        for r in rows:
            print(f"{r['mutant']:<{width}}  {str(r['test'] or '-'):<70}  {r['sim'] or '-'}")
        print(f"caught {caught}/{len(rows)} (tests {by_tests}, simulator {by_sim}) in "
              f"{time.perf_counter() - start:.0f} s"
              + (f"; tests and simulator of {args.ref}" if args.ref else "")
              + (f"; simulator gossip {args.gossip}" if args.gossip else ""))
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
