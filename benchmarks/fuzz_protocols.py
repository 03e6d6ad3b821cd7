"""Fuzz every protocol of a live localnet with random and mutated frames, then check it still serves.

Usage::

    python benchmarks/fuzz_protocols.py --inputs 100000 --seed 1
    python benchmarks/fuzz_protocols.py --inputs 2000 --duration 60 --json report.json

A run sends every one of ``--inputs``; only an explicit ``--duration`` stops it earlier, and then
the summary says "STOPPED ON TIME after X of N inputs" and the exit status is 1. While it runs, a
progress line goes to stderr every ``--progress-interval`` seconds (inputs so far, inputs/s,
crashes, hangs, inputs per protocol). At the end it prints the inputs sent per (role, protocol),
inputs/s, the time inputs took per protocol and the slowest input, liveness checks passed,
crashes, hangs, the RSS of the process before and after and the machine, then one line
``FUZZ-SUMMARY {json}`` (:meth:`~ps_p2p.testing.fuzz.FuzzReport.summary_record`: inputs per
protocol, crashes, hangs, the slowest input, ``ok``) for scripts. Exit status: 0 when every input
was sent and there was no crash, no hang and the last liveness round passed; 1 otherwise. See
:mod:`ps_p2p.testing.fuzz` for what is sent and what counts as a crash or a hang.
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
                   help="stop sending after this many seconds even if not all inputs are sent "
                        "(the run then counts as incomplete; default: no time limit)")
    p.add_argument("--hang-timeout", type=float, default=d.hang_timeout,
                   help="an input whose handling takes longer is a hang, seconds (default %(default)s)")
    p.add_argument("--max-open-streams", type=int, default=d.max_open_streams,
                   help="fuzz streams open at once (default %(default)s)")
    p.add_argument("--progress-interval", type=float, default=d.progress_interval,
                   help="seconds between progress lines on stderr; 0: none (default %(default)s)")
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
        "inputs_requested": report.config.inputs,
        "stopped_on_time": report.stopped_on_time,
        "inputs_by_protocol": dict(report.inputs_by_protocol),
        "inputs_by_role_protocol": dict(report.inputs_by_role_protocol),
        "input_seconds_by_protocol": {
            p: {"streams": int(n), "mean": t / n if n else 0.0, "max": m}
            for p, (n, t, m) in report.input_seconds.items()
        },
        "slowest_input_seconds": report.slowest_input_seconds,
        "slowest_input": report.slowest_input,
        "input_hangs_by_protocol": dict(report.input_hangs_by_protocol),
        "streams_left_open_by_protocol": dict(report.streams_left_open_by_protocol),
        "inputs_by_kind": dict(report.inputs_by_kind),
        "fuzz_seconds": report.fuzz_seconds,
        "inputs_per_second": report.inputs_per_second,
        "streams_opened": report.streams_opened,
        "liveness_rounds": len(report.checks),
        "liveness_rounds_passed": report.checks_passed,
        "liveness": [dataclasses.asdict(c) for c in report.checks],
        "crashes": report.crashes,
        "hangs": report.hangs,
        "hang_count": report.hang_count,
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
        include_libp2p=args.include_libp2p, hang_timeout=args.hang_timeout,
        max_open_streams=args.max_open_streams, progress_interval=args.progress_interval,
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
    record = report.summary_record()
    print("FUZZ-SUMMARY " + json.dumps(record, sort_keys=True), flush=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
