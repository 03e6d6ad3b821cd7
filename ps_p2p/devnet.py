"""``ps-node devnet``: a local PlanetServe network of separate OS processes on 127.0.0.1.

Every node is its own ``python -m ps_p2p.cli run`` process (a real libp2p host) with its own key
file, log file and JSON status file in the work directory. The devnet starts the verifiers, then the
model nodes and users (bootstrapped from the verifiers), waits until every user has its proxies,
sends each prompt through a user node's local API (so it crosses the anonymous overlay: S-IDA
cloves over 3-hop onion paths), prints each answer with its latency and serving model node, and
stops every process (also on Ctrl-C).

Perturbations (each prompt must still be answered, since n > k):

* ``kill-relay``: after the first third of the prompts, one relay on one path of every user is
  killed (SIGKILL) while requests are in flight (a small hitting set of relays, so every user loses
  at least one path; prompts then go only through surviving users);
* ``tamper-clove``: one user node runs with ``--tamper`` and corrupts every cell and clove it
  relays; the proxies' end-to-end check and S-IDA's AEAD reject them and decoding uses other cloves.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger(__name__)

#: Prompt files are capped: a devnet is for a look at the system, not a load test.
MAX_PROMPTS = 10_000


@dataclass
class DevnetOptions:
    """Options of :func:`run_devnet` (the ``ps-node devnet`` flags)."""

    model: str
    prompts: str
    users: int = 8
    models: int = 2
    verifiers: int = 4
    json_out: str | None = None
    perturb: str = "none"
    limit: int | None = None
    max_tokens: int = 48
    concurrency: int = 4
    timeout: float = 120.0
    workdir: str | None = None
    show: int = 300
    log_level: str = "INFO"
    start_timeout: float = 180.0


@dataclass
class Prompt:
    prompt_id: str
    text: str


@dataclass
class _Proc:
    name: str
    role: str
    process: trio.Process
    status_path: pathlib.Path
    log_path: pathlib.Path
    status: dict[str, Any] = field(default_factory=dict)
    killed: bool = False


# ---------------------------------------------------------------------- prompts


def load_prompts(path: str | os.PathLike[str], limit: int | None = None) -> list[Prompt]:
    """Read prompts from a text file (one per line) or a ../shared/data JSON/JSONL file.

    Understood shapes: MT-Bench (``question_id``, ``turns``: first turn), ShareGPT (``id``,
    ``conversations``: first human turn), ToolBench (``query_id``, ``query``), code sets and other
    JSONL with ``prompt``/``query``/``question``/``input``/``text``.

    Raises:
        ConfigError: missing file, unknown shape, or no prompt in it.
    """
    from ps_p2p.errors import ConfigError

    p = pathlib.Path(path).expanduser()
    try:
        raw = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read prompts from {p}: {exc}") from exc
    items: list[Any]
    if p.suffix == ".jsonl":
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    elif p.suffix == ".json":
        data = json.loads(raw)
        items = data if isinstance(data, list) else [data]
    else:
        items = [line for line in raw.splitlines() if line.strip()]
    prompts: list[Prompt] = []
    for i, item in enumerate(items):
        prompt = _extract_prompt(item, i)
        if prompt is not None and prompt.text.strip():
            prompts.append(prompt)
        if len(prompts) >= min(limit or MAX_PROMPTS, MAX_PROMPTS):
            break
    if not prompts:
        raise ConfigError(f"no prompts found in {p}")
    return prompts


def _extract_prompt(item: Any, i: int) -> Prompt | None:
    if isinstance(item, str):
        return Prompt(str(i + 1), item.strip())
    if not isinstance(item, dict):
        return None
    pid = str(item.get("question_id") or item.get("query_id") or item.get("id")
              or item.get("task_id") or i + 1)
    if isinstance(item.get("turns"), list) and item["turns"]:
        return Prompt(pid, str(item["turns"][0]))
    if isinstance(item.get("conversations"), list):
        for turn in item["conversations"]:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                return Prompt(pid, str(turn.get("value", "")))
        return None
    for key in ("query", "prompt", "question", "text"):
        if isinstance(item.get(key), str):
            return Prompt(pid, item[key])
    if isinstance(item.get("qa_pairs"), str):
        try:
            pairs = ast.literal_eval(item["qa_pairs"])
            return Prompt(pid, str(pairs[0]["Q"]))
        except (ValueError, SyntaxError, LookupError, TypeError):
            return None
    return None


# ---------------------------------------------------------------------- processes


async def _start(workdir: pathlib.Path, name: str, role: str, args: list[str], log_level: str) -> _Proc:
    status_path = workdir / "status" / f"{name}.json"
    log_path = workdir / "logs" / f"{name}.log"
    key_path = workdir / "keys" / f"{name}.key"
    cmd = [
        sys.executable, "-m", "ps_p2p.cli", "--log-level", log_level, "run",
        "--role", role, "--listen", "/ip4/127.0.0.1/tcp/0",
        "--key-file", str(key_path), "--status-file", str(status_path), *args,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    logfile = open(log_path, "ab")
    process = await trio.lowlevel.open_process(
        cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True,
    )
    logfile.close()
    return _Proc(name, role, process, status_path, log_path)


def _read_status(proc: _Proc) -> dict[str, Any] | None:
    try:
        proc.status = json.loads(proc.status_path.read_text())
    except (OSError, ValueError):
        return None
    return proc.status


async def _wait_all(procs: list[_Proc], ready, what: str, timeout: float) -> None:  # type: ignore[no-untyped-def]
    """Poll status files until ``ready(status)`` holds for every process."""
    deadline = trio.current_time() + timeout
    last_report = 0.0
    while True:
        pending = []
        for proc in procs:
            if proc.process.returncode is not None:
                raise RuntimeError(
                    f"{proc.name} exited with status {proc.process.returncode}; see {proc.log_path}"
                )
            status = _read_status(proc)
            if status is None or not ready(status):
                pending.append(proc.name)
        if not pending:
            return
        now = trio.current_time()
        if now > deadline:
            raise RuntimeError(f"timed out waiting for {what}: {', '.join(pending)}")
        if now - last_report > 5:
            print(f"  waiting for {what}: {len(procs) - len(pending)}/{len(procs)} ready", flush=True)
            last_report = now
        await trio.sleep(0.2)  # polling files written by other processes


async def _stop_all(procs: list[_Proc]) -> None:
    with trio.CancelScope(shield=True):
        for proc in procs:
            if proc.process.returncode is None:
                try:
                    proc.process.send_signal(signal.SIGTERM)  # handled like Ctrl-C
                except ProcessLookupError:
                    pass
        with trio.move_on_after(8):
            for proc in procs:
                await proc.process.wait()
        for proc in procs:
            if proc.process.returncode is None:
                proc.process.kill()
                await proc.process.wait()


# ---------------------------------------------------------------------- prompts through the overlay


def _choose_victims(users: list[_Proc], paths_of: dict[str, list[list[str]]]) -> list[str]:
    """Relays (peer IDs) to kill so that every user loses a relay on at least one path.

    Greedy hitting set: repeatedly take the relay on the paths of the most users not yet hit.
    """
    remaining = {u.name for u in users if paths_of.get(u.name)}
    relays_of = {
        u.name: {r for path in paths_of.get(u.name, []) for r in path} for u in users
    }
    victims: list[str] = []
    while remaining:
        counts: dict[str, int] = {}
        for name in remaining:
            for relay in relays_of[name]:
                counts[relay] = counts.get(relay, 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda r: counts[r])
        victims.append(best)
        remaining = {n for n in remaining if best not in relays_of[n]}
    return victims


async def _devnet(opts: DevnetOptions) -> int:
    import httpx

    from ps_p2p.errors import ConfigError

    prompts = load_prompts(opts.prompts, opts.limit)
    if opts.users < 4 or opts.models < 1 or opts.verifiers < 1:
        raise ConfigError("a devnet needs --users >= 4, --models >= 1, --verifiers >= 1")
    if not pathlib.Path(opts.model).expanduser().exists():
        raise ConfigError(f"model {opts.model} not found")
    workdir = pathlib.Path(opts.workdir or tempfile.mkdtemp(prefix="ps-devnet-"))
    for sub in ("status", "logs", "keys"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    for stale in (workdir / "status").glob("*.json"):
        stale.unlink()
    print(f"devnet: {opts.verifiers} verifiers, {opts.models} model nodes, {opts.users} users; "
          f"{len(prompts)} prompts; work dir {workdir}", flush=True)
    procs: list[_Proc] = []
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for i in range(opts.verifiers):
            procs.append(await _start(workdir, f"verifier{i}", "verifier", [], opts.log_level))
        verifiers = list(procs)
        await _wait_all(verifiers, lambda s: bool(s.get("listen")), "verifiers", opts.start_timeout)
        boot: list[str] = []
        for v in verifiers:
            boot += ["--multiaddr", v.status["listen"][0]]
        for i in range(opts.models):
            procs.append(await _start(
                workdir, f"model{i}", "model", ["--model", opts.model, *boot], opts.log_level
            ))
        users: list[_Proc] = []
        for i in range(opts.users):
            extra = ["--api", "127.0.0.1:0", *boot]
            if opts.perturb == "tamper-clove" and i == opts.users - 1:
                extra.append("--tamper")
            user = await _start(workdir, f"user{i}", "user", extra, opts.log_level)
            users.append(user)
            procs.append(user)
        print("  processes started; waiting for the directory and the onion paths...", flush=True)
        await _wait_all(
            procs[opts.verifiers:],
            lambda s: s.get("directory") is not None
            and s["directory"]["users"] >= opts.users
            and s["directory"]["model_nodes"] >= opts.models,
            "the full directory", opts.start_timeout,
        )
        await _wait_all(users, lambda s: s.get("ready_paths", 0) >= 4, "user paths", opts.start_timeout)
        print(f"network ready in {time.monotonic() - started:.1f} s", flush=True)
        if opts.perturb == "tamper-clove":
            print(f"  perturbation: {users[-1].name} ({users[-1].status['peer_id']}) tampers with "
                  "every cell and clove it relays", flush=True)
        askers = [u for u in users if not (opts.perturb == "tamper-clove" and u is users[-1])]
        phase_split = len(prompts) if opts.perturb != "kill-relay" else max(1, len(prompts) // 3)
        async with httpx.AsyncClient(timeout=opts.timeout + 30) as client:
            await _send_prompts(client, prompts[:phase_split], askers, opts, results, len(prompts))
            if opts.perturb == "kill-relay":
                victims, askers = await _plan_kill(client, users, askers)
                await _send_prompts(client, prompts[phase_split:], askers, opts, results,
                                    len(prompts), offset=phase_split,
                                    on_first_dispatch=lambda: _kill(victims))
    finally:
        await _stop_all(procs)
    if opts.json_out:
        with open(opts.json_out, "w", encoding="utf-8") as fh:
            for r in sorted(results, key=lambda r: r["_index"]):
                fh.write(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n")
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency_ms"] for r in ok)
    summary = f"answered {len(ok)}/{len(prompts)} prompts"
    if lat:
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        summary += f"; latency median {statistics.median(lat):.0f} ms, p95 {p95:.0f} ms"
    valid = sum(1 for r in ok if r["signature_valid"])
    summary += f"; {valid} valid signatures; total {time.monotonic() - started:.1f} s"
    print(summary, flush=True)
    if opts.json_out:
        print(f"results written to {opts.json_out}")
    return 0 if len(ok) == len(prompts) else 1


async def _plan_kill(client, users: list[_Proc], askers: list[_Proc]):  # type: ignore[no-untyped-def]
    """Pick the relays to kill; returns (victim processes, users that keep asking)."""
    paths_of: dict[str, list[list[str]]] = {}
    for user in users:
        try:
            r = await client.get(user.status["api"] + "/status")
            paths_of[user.name] = [p["relays"] for p in r.json()["ready_paths"]]
        except Exception as exc:
            print(f"  could not read {user.name}'s paths: {exc}", flush=True)
    victims = _choose_victims(users, paths_of)
    by_peer = {u.status["peer_id"]: u for u in users}
    procs = [by_peer[p] for p in victims if p in by_peer]
    hit = sum(
        1 for u in users
        if any(v in {r for p in paths_of.get(u.name, []) for r in p} for v in victims)
    )
    print(f"  perturbation: will kill relay(s) {', '.join(p.name for p in procs)} (on a path of "
          f"{hit} of {len(users)} users) once the next prompts are in flight", flush=True)
    survivors = [u for u in askers if u not in procs]
    if not survivors:
        raise RuntimeError("every user would be killed; use more --users")
    return procs, survivors


def _kill(victims: list[_Proc]) -> None:
    for proc in victims:
        if proc.process.returncode is None:
            proc.process.kill()
            proc.killed = True
    print(f"  perturbation: killed {', '.join(p.name for p in victims)} (SIGKILL)", flush=True)


async def _send_prompts(  # type: ignore[no-untyped-def]
    client, prompts: list[Prompt], askers: list[_Proc], opts: DevnetOptions,
    results: list[dict[str, Any]], total: int, offset: int = 0, on_first_dispatch=None,
) -> None:
    limiter = trio.CapacityLimiter(max(1, opts.concurrency))
    dispatched = trio.Event()

    async def one(index: int, prompt: Prompt) -> None:
        async with limiter:
            user = askers[index % len(askers)]
            t0 = time.monotonic()
            record: dict[str, Any] = {
                "prompt_id": prompt.prompt_id, "ok": False, "response": None, "served_by": None,
                "signature_valid": False, "cloves_received": 0, "latency_ms": None, "error": None,
                "user": user.name, "_index": index,
            }
            try:
                request = client.post(user.status["api"] + "/v1/completions", json={
                    "prompt": prompt.text, "max_tokens": opts.max_tokens, "timeout": opts.timeout,
                })
                dispatched.set()
                r = await request
                body = r.json()
                meta = body.get("planetserve", {})
                record.update(
                    served_by=meta.get("served_by") or None,
                    signature_valid=bool(meta.get("signature_valid")),
                    cloves_received=int(meta.get("cloves_received", 0)),
                    latency_ms=meta.get("latency_ms"),
                    attempts=meta.get("attempts"),
                )
                if r.status_code == 200:
                    record.update(ok=True, response=body["choices"][0]["text"])
                else:
                    record["error"] = body.get("error", {}).get("message", f"HTTP {r.status_code}")
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
            if record["latency_ms"] is None:
                record["latency_ms"] = round((time.monotonic() - t0) * 1000, 1)
            results.append(record)
            text = (record["response"] or "").replace("\n", " ")
            if len(text) > opts.show:
                text = text[: opts.show] + "..."
            state = "ok " if record["ok"] else "ERR"
            by = (record["served_by"] or "-")[-8:]
            print(f"[{len(results)}/{total}] {state} prompt {prompt.prompt_id} via {user.name} "
                  f"served by ...{by} in {record['latency_ms']:.0f} ms "
                  f"({record['cloves_received']} cloves, signature "
                  f"{'valid' if record['signature_valid'] else 'INVALID'})", flush=True)
            if record["ok"]:
                print(f"      Q: {prompt.text[:100]!r}\n      A: {text}", flush=True)
            else:
                print(f"      error: {record['error']}", flush=True)

    async def perturb() -> None:
        await dispatched.wait()
        # The request is on its way into the overlay; let it get there before the kill.
        await trio.sleep(0.2)
        on_first_dispatch()

    async with trio.open_nursery() as nursery:
        if on_first_dispatch is not None and prompts:
            nursery.start_soon(perturb)
        for i, prompt in enumerate(prompts):
            nursery.start_soon(one, offset + i, prompt)


def run_devnet(opts: DevnetOptions) -> int:
    """Run the devnet to completion; returns 0 when every prompt was answered, else 1."""
    from ps_p2p.errors import is_keyboard_interrupt

    try:
        return trio.run(_devnet, opts)
    except BaseException as exc:
        if not is_keyboard_interrupt(exc):
            if isinstance(exc, RuntimeError):
                print(f"devnet failed: {exc}", file=sys.stderr)
                return 1
            raise
        print("interrupted; every devnet process was stopped", file=sys.stderr)
        return 130
