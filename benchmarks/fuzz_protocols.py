"""Fuzz every protocol of a live localnet with random and mutated frames, then check it still serves.

Usage::

    python benchmarks/fuzz_protocols.py --inputs 100000 --seed 1
    python benchmarks/fuzz_protocols.py --inputs 2000 --duration 60 --json report.json

Prints the inputs sent per protocol, inputs/s, liveness checks passed, crashes, hangs, the RSS of
the process before and after and the machine. Exit status: 0 when there was no crash, no hang and
the last liveness round passed; 1 otherwise. See :mod:`ps_p2p.testing.fuzz` for what is sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import trio

from ps_p2p.testing.fuzz import FuzzConfig, FuzzReport, iter_report_lines, run_fuzz


def _parser() -> argparse.ArgumentParser:
    d = FuzzConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=d.seed, help="RNG seed (default %(default)s)")
    p.add_argument("--inputs", type=int, default=100_000, help="frames to send in total (default %(default)s)")
    p.add_argument("--duration", type=float, default=d.duration,
                   help="stop sending after this many seconds (default %(default)s)")
    p.add_argument("--users", type=int, default=d.users, help="user nodes (default %(default)s)")
    p.add_argument("--models", type=int, default=d.models, help="model nodes (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="attack tasks at once (default %(default)s)")
    p.add_argument("--sybils", type=int, default=d.sybils,
                   help="insider attacker user nodes (default %(default)s)")
    p.add_argument("--check-interval", type=float, default=d.check_interval,
                   help="seconds between liveness checks while fuzzing; 0: only at the end "
                        "(default %(default)s)")
    p.add_argument("--liveness-timeout", type=float, default=d.liveness_timeout,
                   help="deadline of one liveness check, seconds (default %(default)s)")
    p.add_argument("--include-libp2p", action="store_true",
                   help="also fuzz libp2p's own protocols (ping, identify)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    return p


def _as_json(report: FuzzReport, wall: float) -> dict[str, object]:
    return {
        "config": dataclasses.asdict(report.config),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "protocols": report.protocols,
        "inputs": report.inputs,
        "inputs_by_protocol": dict(report.inputs_by_protocol),
        "inputs_by_kind": dict(report.inputs_by_kind),
        "fuzz_seconds": report.fuzz_seconds,
        "inputs_per_second": report.inputs_per_second,
        "streams_opened": report.streams_opened,
        "liveness_rounds": len(report.checks),
        "liveness_rounds_passed": report.checks_passed,
        "liveness": [dataclasses.asdict(c) for c in report.checks],
        "crashes": report.crashes,
        "hangs": report.hangs,
        "liveness_failures": report.liveness_failures,
        "rss_before_kib": report.rss_before_kib,
        "rss_after_kib": report.rss_after_kib,
        "rss_peak_kib": report.rss_peak_kib,
        "tables_before": report.tables_before,
        "tables_after": report.tables_after,
        "node_log": dict(report.node_log),
        "logged_tracebacks": report.logged_tracebacks,
        "last_inputs": report.last_inputs,
        "wall_seconds": wall,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = FuzzConfig(
        seed=args.seed, inputs=args.inputs, duration=args.duration, users=args.users,
        models=args.models, concurrency=args.concurrency, sybils=args.sybils,
        check_interval=args.check_interval, liveness_timeout=args.liveness_timeout,
        include_libp2p=args.include_libp2p,
    )
    started = time.monotonic()
    report = trio.run(lambda: run_fuzz(config, progress=lambda text: print(text, file=sys.stderr, flush=True)))
    wall = time.monotonic() - started
    for line in iter_report_lines(report):
        print(line)
    print(f"wall time: {wall:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(_as_json(report, wall), f, indent=2)
    ok = not report.crashes and not report.hangs and report.final_check_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
