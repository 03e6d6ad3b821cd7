#!/usr/bin/env python3
"""Run the consensus simulator over many seeded schedules and print what happened.

Usage: ``python scripts/consensus_sim.py --schedules 10000 [--heights 3] [--first-seed 0]
[--f 1|2|3] [--mode classic|adversarial] [--gossip relay|service|before] [--jobs N]``. Prints
schedules, heights decided, the distribution of rounds per height (decision round + 1),
violations by property (schedules in which each failed), schedules and failures per adversary
and feature (:func:`~ps_p2p.testing.consensus_sim.features`: restarts, unequal powers, slow
links, Byzantine behaviours, ...), the first failing seeds, and schedules per second (wall
clock; ``--jobs`` worker processes share the seeds, each schedule's result is the same). ``--mode adversarial`` draws restarts, unequal powers, slow links, quorum
splits and twins; ``--gossip service`` runs the service's own gossip object
(:class:`~ps_p2p.consensus.gossip_policy.ServiceGossip`), ``--gossip before`` the service's
re-broadcast before issue 17 (own messages of the last two rounds only; finding 2). Exit
status 1 if any property failed.
See :mod:`ps_p2p.testing.consensus_sim`.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
import time

from ps_p2p.testing.consensus_sim import (
    GOSSIP_MODES,
    ScheduleResult,
    run_schedule,
    summarize,
)


def _one(seed: int, *, f: int | None, heights: int, mode: str,
         gossip: str | None) -> ScheduleResult:
    return run_schedule(seed, f=f, heights=heights, mode=mode, gossip=gossip)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", type=int, default=1000)
    ap.add_argument("--heights", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--f", type=int, choices=(1, 2, 3), default=None, help="default: 1 + seed %% 3")
    ap.add_argument("--mode", choices=("classic", "adversarial"), default="classic")
    ap.add_argument("--gossip", choices=GOSSIP_MODES, default=None,
                    help="default: the drawn schedule's (relay)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    seeds = range(args.first_seed, args.first_seed + args.schedules)
    one = functools.partial(_one, f=args.f, heights=args.heights, mode=args.mode,
                            gossip=args.gossip)
    if args.jobs > 1:
        with multiprocessing.Pool(args.jobs) as pool:
            results = list(pool.imap(one, seeds, chunksize=50))
    else:
        results = [one(seed) for seed in seeds]
    elapsed = time.perf_counter() - start
    summary = summarize(results)
    summary["byzantine_validators"] = sum(len(r.byzantine) for r in results)
    summary["deliveries"] = sum(r.deliveries for r in results)
    summary["failing_seeds"] = [r.seed for r in results if not r.ok][:20]
    summary["first_failures"] = [(r.seed, r.adversary, {k: v[0] for k, v in r.violations.items()})
                                 for r in results if not r.ok][:5]
    summary["mode"], summary["gossip"] = args.mode, args.gossip or "relay"
    summary["wal_refused"] = sum(r.wal_refused for r in results)
    summary["jobs"] = args.jobs
    summary["seconds"] = round(elapsed, 1)
    summary["schedules_per_second"] = round(len(results) / elapsed, 1)
    print(json.dumps(summary, indent=2))
    return 1 if summary["failed_schedules"] else 0


if __name__ == "__main__":
    sys.exit(main())
