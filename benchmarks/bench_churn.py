"""Churn: frozen (SIGSTOP) or killed users while a client sends an open-loop stream of requests.

Issue 20 sec. 4 ("Frozen hosts cost what dead ones cost"). A devnet of real OS processes on
127.0.0.1 (:func:`ps_p2p.devnet.open_devnet`, one node per process, engine ``instant`` by
default so the overlay itself is measured): ``--verifiers`` verifiers, ``--models`` model nodes,
``--users`` relay users and one more user, the *client* (``user0``), which is never touched.

Once the network is ready, for ``--seconds`` s:

* requests: Poisson arrivals at ``--rate`` per second (open loop: a request is sent when it is
  due, whatever is still in flight), each a ``POST /v1/completions`` to the client's local API
  (S-IDA cloves over 3-hop onion paths), ``--max-tokens`` tokens, ``--request-timeout`` s;
* departures: Poisson at ``--freeze-rate`` percent of ``--users`` per minute (the paper's churn
  rate is 6.4 %/min); each picks a random running relay user and SIGSTOPs its process (a frozen
  host: a closed laptop, its TCP connections stay open), or SIGKILLs it with ``--kill``; a fresh
  user (new key) starts at once in its place, so the population stays at ``--users``.

Prints answered / sent, latency p50 / p95 / max of the answered requests (the HTTP round trip the
client's caller sees), failures by error type (``NoPathError``, ``RequestTimeoutError``...), the
client's ready paths over time (a line every 10 s and the seconds spent with fewer than n = 4),
departures and replacements that got listed, and from the node logs: path setups that failed,
paths suspended and replaced after unanswered probes. ``--json`` writes it all.

Run: ``python benchmarks/bench_churn.py [--seconds 180] [--freeze-rate 50] [--kill]
[--seed 1]``. To measure another checkout's code (e.g. main before a change), run from a
directory outside any checkout with ``PYTHONPATH=<checkout>``: the worker processes import
``ps_p2p`` from there (the header prints which). It uses the devnet controller's internals
(``Devnet.workers``, ``_specs``, ``_spawn_worker``) to freeze one worker and add users.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import trio

import ps_p2p
from ps_p2p.devnet import Devnet, DevnetNode, DevnetOptions, open_devnet

#: n: paths a request needs (the default UserConfig.total).
PATHS_NEEDED = 4

LOG_PATTERNS = {
    "setups_failed": re.compile(r"path setup via \S+ failed"),
    "paths_suspended": re.compile(r"silent: suspended|probing again"),
    "paths_replaced_probe_timeout": re.compile(r"probes unanswered: replacing it"),
    "paths_down": re.compile(r"path via \S+ down"),
    "attempts_resent": re.compile(r"no answer on attempt \d+; resending"),
}


def machine() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.platform()}; {os.cpu_count()} cores; Python "
            f"{platform.python_version()}; load average {load}")


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (``values`` non-empty)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q * len(ordered) + 0.5)) - 1))
    return ordered[rank]


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


class Churn:
    """Departures and replacements of relay users of one devnet."""

    def __init__(self, net: Devnet, rng: random.Random, kill: bool) -> None:
        self.net = net
        self.rng = rng
        self.kill = kill
        self.client = net.users[0]
        self.departed: list[tuple[float, str]] = []
        self.frozen: list[DevnetNode] = []
        self.added: list[DevnetNode] = []
        self._next = len(net.users)

    def candidates(self) -> list[DevnetNode]:
        gone = {name for _, name in self.departed}
        return [n for n in self.net.users
                if n is not self.client and n.running and n.name not in gone and n.peer_id]

    async def depart(self, at: float) -> str | None:
        choices = self.candidates()
        if not choices:
            return None
        victim = self.rng.choice(choices)
        self.departed.append((at, victim.name))
        if self.kill:
            await self.net.kill([victim])
        else:
            os.kill(victim.worker.process.pid, signal.SIGSTOP)
            self.frozen.append(victim)
        await self.replace(victim)
        return victim.name

    async def replace(self, gone: DevnetNode) -> None:
        """A fresh user (new key) joins in ``gone``'s place."""
        name = f"user{self._next}"
        self._next += 1
        template = self.net._specs[self.client.name]
        spec = {**template, "name": name, "api": False,
                "key_file": str(self.net.workdir / "keys" / f"{name}.key"),
                "log_file": str(self.net.workdir / "logs" / f"{name}.log")}
        self.net._specs[name] = spec
        (fresh,) = await self.net._spawn_worker([spec])
        self.net.users.append(fresh)
        self.added.append(fresh)

    def listed_replacements(self) -> int:
        """Replacements the client's directory could list: those whose own directory shows
        at least as many users as the client's (they registered and see the committee)."""
        return sum(1 for n in self.added if n.state == "up" and n.status.get("directory"))

    def thaw_and_kill(self) -> None:
        """SIGKILL the frozen processes (a stopped process would sit out the stop grace)."""
        for node in self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.worker.process.pid, signal.SIGKILL)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    keep = args.workdir is not None
    workdir = pathlib.Path(args.workdir) if keep else \
        pathlib.Path(tempfile.mkdtemp(prefix="bench-churn-"))
    if keep and workdir.exists():
        shutil.rmtree(workdir)
    opts = DevnetOptions(
        engine=args.engine, model=args.model, users=args.users + 1, models=args.models,
        verifiers=args.verifiers, nodes_per_process=1, start_timeout=args.start_timeout,
        workdir=str(workdir), log_level="INFO",
    )
    rng = random.Random(args.seed)
    mode = "SIGKILL" if args.kill else "SIGSTOP"
    print(f"churn: {args.users} relay users + 1 client, {args.models} model node(s), "
          f"{args.verifiers} verifier(s); {args.seconds:g} s, Poisson {args.rate:g} req/s, "
          f"departures {args.freeze_rate:g} %/min ({mode}), seed {args.seed}", flush=True)
    print(f"code: {pathlib.Path(ps_p2p.__file__).parent}; {machine()}", flush=True)
    result: dict[str, Any] = {"args": vars(args), "code": str(pathlib.Path(ps_p2p.__file__).parent),
                              "machine": machine()}
    records: list[dict[str, Any]] = []
    ready_samples: list[tuple[float, int]] = []
    try:
        async with open_devnet(opts) as net:
            churn = Churn(net, rng, args.kill)
            client = churn.client
            api = client.api
            print(f"ready in {net.ready_s:.1f} s", flush=True)
            import httpx

            start = trio.current_time()
            end = start + args.seconds
            departure_rate = args.freeze_rate / 100 * args.users / 60.0  # per second

            async def one(http: Any, index: int) -> None:
                t0 = time.monotonic()
                rec: dict[str, Any] = {"i": index, "sent_s": round(trio.current_time() - start, 2),
                                       "ok": False, "error_type": None}
                try:
                    r = await http.post(f"{api}/v1/completions", json={
                        "prompt": f"Once upon a time, in story {index}, a fox found a lantern.",
                        "max_tokens": args.max_tokens, "timeout": args.request_timeout})
                    body = r.json()
                    meta = body.get("planetserve") or {}
                    if isinstance(meta, list):
                        meta = meta[0] if meta else {}
                    rec["attempts"] = meta.get("attempts")
                    if r.status_code == 200:
                        rec["ok"] = True
                    else:
                        rec["error_type"] = meta.get("error_type") or f"HTTP {r.status_code}"
                except Exception as exc:
                    rec["error_type"] = type(exc).__name__
                rec["latency_s"] = round(time.monotonic() - t0, 3)
                records.append(rec)

            async def requests(http: Any, nursery: trio.Nursery) -> None:
                arrivals = random.Random(args.seed * 7919 + 1)
                index = 0
                at = start
                while True:
                    at += arrivals.expovariate(args.rate)
                    if at >= end:
                        return
                    await trio.sleep_until(at)
                    nursery.start_soon(one, http, index)
                    index += 1

            async def departures() -> None:
                at = start
                while departure_rate > 0:
                    at += rng.expovariate(departure_rate)
                    if at >= end:
                        return
                    await trio.sleep_until(at)
                    name = await churn.depart(round(at - start, 1))
                    print(f"  t={at - start:5.1f} s: {name} {'killed' if args.kill else 'frozen'}",
                          flush=True)

            async def sample_paths() -> None:
                while trio.current_time() < end:
                    ready_samples.append((round(trio.current_time() - start, 1),
                                          int(client.status.get("ready_paths", 0))))
                    await trio.sleep(1.0)

            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=args.request_timeout + 30, limits=limits) as http:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(requests, http, nursery)
                    nursery.start_soon(departures)
                    nursery.start_soon(sample_paths)
            result["listed_replacements"] = churn.listed_replacements()
            result["replacements"] = len(churn.added)
            result["departures"] = len(churn.departed)
            churn.thaw_and_kill()
            result["log_events"] = count_log_events(workdir / "logs")
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    sent = len(records)
    ok = [r for r in records if r["ok"]]
    errors: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            errors[r["error_type"]] = errors.get(r["error_type"], 0) + 1
    lat = [r["latency_s"] for r in ok]
    result.update(
        sent=sent, answered=len(ok), answered_share=round(len(ok) / sent, 4) if sent else None,
        latency_s={"p50": quantile(lat, 0.5), "p95": quantile(lat, 0.95), "max": max(lat)}
        if lat else None,
        errors=errors,
        seconds_below_n_paths=sum(1 for _, n in ready_samples if n < PATHS_NEEDED),
        ready_paths=ready_samples,
        requests=records,
    )
    return result


def report(result: dict[str, Any]) -> None:
    print("--- client's ready paths (every 10 s): " + " ".join(
        f"{t:.0f}s:{n}" for t, n in result["ready_paths"][::10]))
    lat = result["latency_s"]
    lat_text = "no answer" if lat is None else \
        f"p50 {lat['p50']:.2f} s, p95 {lat['p95']:.2f} s, max {lat['max']:.2f} s"
    print(f"answered {result['answered']}/{result['sent']} = {result['answered_share']}; "
          f"latency {lat_text}")
    print(f"failures: {result['errors'] or 'none'}")
    print(f"departures {result['departures']}, replacements {result['replacements']} "
          f"({result['listed_replacements']} up with a directory); client below "
          f"{PATHS_NEEDED} ready paths for {result['seconds_below_n_paths']} of "
          f"{len(result['ready_paths'])} s")
    print(f"node logs: {result['log_events']}")
    print(f"machine: {result['machine']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--freeze-rate", type=float, default=50.0,
                        help="departures, percent of the relay users per minute")
    parser.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGSTOP")
    parser.add_argument("--users", type=int, default=20, help="relay users (plus the client)")
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--verifiers", type=int, default=1)
    parser.add_argument("--engine", default="instant")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--start-timeout", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default=None, help="keep keys and logs here")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    result = trio.run(run, args)
    report(result)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
