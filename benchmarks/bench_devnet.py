"""``ps-node devnet`` at several sizes: start time, request latency, memory, throughput.

For each size (number of users; plus ``--models`` model nodes and ``--verifiers`` verifiers) the
script starts a devnet (:func:`ps_p2p.devnet.open_devnet`, real OS processes on 127.0.0.1, every
request an anonymous round trip: S-IDA cloves over 3-hop onion paths) and prints:

1. ready time: from the first process start until every user holds n ready paths, and the CPU
   of all node processes over 10 s at rest right after (probes, directory refreshes);
2. request latency, median and p99 (ms, as the user node measures it): first the first request
   of every user (round robin, 4 at a time: its proxies open their delivery links), then
   ``--latency-requests`` requests one at a time, round robin over the users;
3. total RSS of the node processes (sum of VmRSS from ``/proc/<pid>/status``), after the start
   and after the load;
4. requests/s (answered requests / wall time) at each concurrency of ``--concurrency`` (default
   1, 4, 16, 64), ``--requests-per-level`` requests each (default: 4 x concurrency, at least 32);
5. from the node logs: path setups that failed, paths replaced after unanswered probes, probes
   sent again, request attempts resent.

Run: ``python benchmarks/bench_devnet.py [--sizes 8,32,64,100] [--engine instant]
[--nodes-per-process N|auto]`` (default auto, as ``ps-node devnet``). The load generator (an httpx client in this process) shares the
machine's cores with every node, so on a small machine the numbers are a lower bound of what the
overlay does when spread over machines.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import trio

from ps_p2p.devnet import DevnetOptions, Prompt, latency_summary, open_devnet

LOG_PATTERNS = {
    "setup_failed": re.compile(r"path setup via \S+ failed"),
    # paths replaced after their probes went unanswered (before 2026-11-23 after one probe:
    # "unanswered for N s: replacing it"; since, after two: "N probes unanswered: replacing it")
    "probe_timeouts": re.compile(r"unanswered(?: for [\d.]+ s)?: replacing it"),
    "probes_resent": re.compile(r"unanswered for [\d.]+ s: probing again"),
    "resent": re.compile(r"no answer on attempt \d+; resending"),
}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.platform()}; {cpu}; {os.cpu_count()} cores; "
            f"Python {platform.python_version()}; load average at start {load}")


def prompts(count: int, start: int = 0) -> list[Prompt]:
    return [
        Prompt(str(i), f"Once upon a time, in story number {i}, a little fox found a lantern "
                       "in the forest and wondered who had left it there.")
        for i in range(start, start + count)
    ]


def cpu_seconds(net: Any) -> float:
    """User + system CPU seconds of every running worker (``/proc/<pid>/stat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for worker in net.workers:
        if worker.process.returncode is not None:
            continue
        try:
            fields = pathlib.Path(f"/proc/{worker.process.pid}/stat").read_text().rsplit(")", 1)[1]
        except OSError:
            continue
        utime, stime = fields.split()[11:13]
        total += int(utime) + int(stime)
    return total / tick


def count_log_events(logs: pathlib.Path) -> dict[str, int]:
    counts = dict.fromkeys(LOG_PATTERNS, 0)
    for path in logs.glob("*.log"):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for key, pattern in LOG_PATTERNS.items():
            counts[key] += len(pattern.findall(text))
    return counts


async def bench_size(users: int, args: argparse.Namespace) -> dict[str, Any]:
    keep = args.workdir is not None
    workdir = pathlib.Path(args.workdir) / f"users{users}" if keep else \
        pathlib.Path(tempfile.mkdtemp(prefix="bench-devnet-"))
    if keep and workdir.exists():
        shutil.rmtree(workdir)
    opts = DevnetOptions(
        model=args.model, engine=args.engine, users=users, models=args.models,
        verifiers=args.verifiers, nodes_per_process=args.nodes_per_process,
        start_timeout=args.start_timeout, workdir=str(workdir), log_level="INFO",
    )
    row: dict[str, Any] = {
        "users": users, "nodes": opts.nodes, "engine": args.engine,
        "nodes_per_process": opts.per_process,
    }
    print(f"--- {users} users, {args.models} model nodes, {args.verifiers} verifiers "
          f"({opts.nodes} nodes, {opts.per_process} per process); start deadline "
          f"{opts.start_deadline:g} s", flush=True)
    try:
        async with open_devnet(opts) as net:
            row["ready_s"] = round(net.ready_s or 0.0, 1)
            row["processes"] = len(net.workers)
            row["rss_ready_mib"] = round(net.rss_bytes() / 2**20)
            print(f"ready in {row['ready_s']} s; {row['processes']} processes, "
                  f"RSS {row['rss_ready_mib']} MiB", flush=True)
            # the network at rest (probes, directory refreshes, renewals): CPU of all nodes
            rest_s = 10.0
            cpu0 = cpu_seconds(net)
            await trio.sleep(rest_s)
            row["cpu_at_rest_pct"] = round((cpu_seconds(net) - cpu0) / rest_s * 100, 1)
            print(f"CPU at rest: {row['cpu_at_rest_pct']}% of one core (all processes, "
                  f"{rest_s:g} s)", flush=True)
            common = dict(max_tokens=48, timeout=args.request_timeout)
            # warm-up: every user asks once (round robin), so the latency below is that of users
            # whose proxies already hold their delivery links to the model nodes; the first
            # request of each user (new connections from its proxies) is reported apart
            first = await net.send_prompts(prompts(max(16, users)), concurrency=4, **common)
            ok_first = [r["latency_ms"] for r in first if r["ok"]]
            stats = latency_summary(ok_first)
            row["first_request"] = {"n": len(first), "answered": len(ok_first),
                                    **{k: round(v, 1) for k, v in stats.items()}}
            print(f"first request of each user (concurrency 4): median "
                  f"{stats.get('median', 0):.0f} ms, p99 {stats.get('p99', 0):.0f} ms, "
                  f"{len(ok_first)}/{len(first)} answered", flush=True)
            done = await net.send_prompts(
                prompts(args.latency_requests, 1000), concurrency=1, **common
            )
            ok = [r["latency_ms"] for r in done if r["ok"]]
            stats = latency_summary(ok)
            row["latency"] = {"n": len(done), "answered": len(ok),
                              **{k: round(v, 1) for k, v in stats.items()}}
            print(f"latency (concurrency 1): median {stats.get('median', 0):.0f} ms, "
                  f"p99 {stats.get('p99', 0):.0f} ms, {len(ok)}/{len(done)} answered", flush=True)
            row["throughput"] = []
            if args.engine == "instant":
                for level in args.concurrency:
                    count = args.requests_per_level or max(32, 4 * level)
                    t0 = time.monotonic()
                    done = await net.send_prompts(
                        prompts(count, 10_000 * (level + 1)), concurrency=level, **common
                    )
                    wall = time.monotonic() - t0
                    answered = [r["latency_ms"] for r in done if r["ok"]]
                    stats = latency_summary(answered)
                    entry = {
                        "concurrency": level, "requests": count, "answered": len(answered),
                        "req_per_s": round(len(answered) / wall, 1),
                        "median_ms": round(stats.get("median", 0), 1),
                        "p99_ms": round(stats.get("p99", 0), 1),
                    }
                    row["throughput"].append(entry)
                    print(f"concurrency {level:>3}: {entry['req_per_s']:6.1f} req/s, median "
                          f"{entry['median_ms']:.0f} ms, p99 {entry['p99_ms']:.0f} ms, "
                          f"{len(answered)}/{count} answered", flush=True)
            row["rss_loaded_mib"] = round(net.rss_bytes() / 2**20)
        row["log_events"] = count_log_events(workdir / "logs")
        print(f"RSS after load {row['rss_loaded_mib']} MiB; from the logs: {row['log_events']}",
              flush=True)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["log_events"] = count_log_events(workdir / "logs")
        print(f"FAILED: {row['error']}\n  from the logs: {row['log_events']}", flush=True)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    levels = sorted({t["concurrency"] for r in rows for t in r.get("throughput", [])})
    head = ["users", "nodes (processes)", "ready", "CPU at rest", "latency median", "p99", "RSS"]
    head += [f"req/s @{c}" for c in levels]
    head += ["setups failed / paths lost to probes / probes resent / requests resent"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r and "ready_s" not in r:
            lines.append(f"| {r['users']} | {r['nodes']} | not ready: {r['error'][:80]} |")
            continue
        lat = r.get("latency", {})
        cells = [
            str(r["users"]), f"{r['nodes']} ({r.get('processes', '?')})", f"{r['ready_s']} s",
            f"{r.get('cpu_at_rest_pct', '?')}%",
            f"{lat.get('median', 0):.0f} ms", f"{lat.get('p99', 0):.0f} ms",
            f"{r.get('rss_ready_mib', 0)} MiB",
        ]
        by_level = {t["concurrency"]: t for t in r.get("throughput", [])}
        for c in levels:
            t = by_level.get(c)
            cells.append("-" if t is None else
                         f"{t['req_per_s']} ({t['answered']}/{t['requests']})")
        ev = r.get("log_events", {})
        cells.append(f"{ev.get('setup_failed', 0)} / {ev.get('probe_timeouts', 0)} / "
                     f"{ev.get('probes_resent', 0)} / {ev.get('resent', 0)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for users in args.sizes:
        rows.append(await bench_size(users, args))
    return rows


def _nodes_per_process(text: str) -> int | None:
    return None if text == "auto" else int(text)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_ints, default=[8, 32, 64, 100],
                   help="user counts, comma-separated (default 8,32,64,100)")
    p.add_argument("--engine", choices=["instant", "transformers"], default="instant")
    p.add_argument("--model", help="model folder (engine transformers)")
    p.add_argument("--models", type=int, default=2, help="model nodes (default 2)")
    p.add_argument("--verifiers", type=int, default=4, help="verifiers (default 4)")
    p.add_argument("--nodes-per-process", type=_nodes_per_process, default=None,
                   help="a number, or auto (default: the devnet's automatic rule, "
                        "ceil(nodes / (4 x cores)))")
    p.add_argument("--start-timeout", type=float,
                   help="seconds until ready (default: the devnet's, 60 + 1 per node)")
    p.add_argument("--latency-requests", type=int, default=50,
                   help="requests one at a time for the latency (default 50)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64],
                   help="concurrency levels for requests/s (default 1,4,16,64)")
    p.add_argument("--requests-per-level", type=int,
                   help="requests per concurrency level (default 4 x concurrency, at least 32)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--workdir", help="keep each size's keys and logs under DIR/users<N>")
    p.add_argument("--json", dest="json_out", help="write the rows as JSON here")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    print(f"machine: {machine()}", flush=True)
    results = trio.run(main, arguments)
    print()
    print(table(results))
    if arguments.json_out:
        with open(arguments.json_out, "w") as fh:
            json.dump({"machine": machine(), "rows": results}, fh, indent=1)
    sys.exit(0 if all("error" not in r for r in results) else 1)
