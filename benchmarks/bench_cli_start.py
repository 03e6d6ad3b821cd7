"""Start-up time of ``ps-node`` subcommands that need no network (issue 21: ``ps-node status``
took 3-10 s on a loaded machine because every subcommand imported libp2p and torch).

Runs ``python -m ps_p2p.cli status --home DIR`` (a home with a fresh ``status.json``) and
``python -m ps_p2p.cli --version`` ``--runs`` times each, as separate processes, and prints the
median and the slowest wall time, and whether libp2p or torch got imported. ``--code DIR`` times
another checkout's ``ps_p2p`` (e.g. the commit before the change) with the same interpreter.

Usage:
    python benchmarks/bench_cli_start.py [--runs 10] [--code /path/to/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--code", default=str(REPO), help="checkout whose ps_p2p is timed")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=args.code)
    with tempfile.TemporaryDirectory() as home:
        (pathlib.Path(home) / "status.json").write_text(json.dumps(
            {"peer_id": "12D3KooWx", "roles": ["user"], "listen": [], "directory": None,
             "ready_paths": 0, "written_at_ms": int(time.time() * 1000)}))
        probe = ("import sys; sys.argv = ['ps-node', 'status', '--home', %r]; "
                 "from ps_p2p.cli import main; main(sys.argv[1:]); "
                 "print(sorted(m for m in ('libp2p', 'torch') if m in sys.modules), "
                 "file=sys.stderr)" % home)
        # cwd: the home, so that the checkout timed is the one on PYTHONPATH (-c and -m put the
        # working directory first on sys.path)
        imported = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                  text=True, check=False, cwd=home).stderr.strip().splitlines()[-1]
        for name, argv in (("status", ["status", "--home", home]), ("--version", ["--version"])):
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "ps_p2p.cli", *argv], env=env,
                               capture_output=True, check=False, cwd=home)
                times.append(time.perf_counter() - start)
            print(f"ps-node {name:9s}: median {statistics.median(times):.2f} s, "
                  f"slowest {max(times):.2f} s ({args.runs} runs)")
    print(f"modules imported by status: {imported}")
    print(f"load average: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
