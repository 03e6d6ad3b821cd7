"""The local OpenAI-compatible API through the anonymous overlay, against the engine called directly.

For each engine (the instant test engine, and the TinyStories model in
``../shared/models/stories260K`` on this machine's CPU) it measures, median and p99:

1. the engine alone, in this process: time to its first piece of text (TTFT) and to the whole
   answer (``Engine.stream``);
2. through a user node's API and the overlay (a local network in this process: a verifier, one
   model node with that engine, 6 user nodes; paths of 3 relays, n = 4, k = 3), with an httpx
   client as an application would use: ``stream: false`` (total latency) and ``stream: true``
   (TTFT = first server-sent event with text; total = ``[DONE]``);
3. requests per second through the API with ``--concurrency`` requests in flight
   (``stream: false``).

Expected: streamed TTFT through the overlay ~= the engine's TTFT + one anonymous round trip
(the instant engine's unstreamed latency is that round trip).

Run: ``python benchmarks/bench_api.py [--rounds 40] [--concurrency 8] [--seconds 10]
[--engines instant,tinystories]``. Every host, the engine and the client share this machine's
cores (one trio loop), so the numbers are an upper bound of what separate machines would see.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_devnet import machine  # noqa: E402
from bench_overlay import summary  # noqa: E402

from ps_p2p.api.openai_compat import serve_api  # noqa: E402
from ps_p2p.engines.base import Engine, SamplingParams  # noqa: E402
from ps_p2p.testing.fakes import InstantEngine  # noqa: E402
from ps_p2p.testing.localnet import open_localnet  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = pathlib.Path(os.environ.get("PS_SHARED_DIR") or ROOT.parent / "shared") / "models" / "stories260K"
PROMPT = ("Once upon a time, a little fox found a lantern in the forest and wondered who had left "
          "it there.")
MAX_TOKENS = 64


def load_engine(name: str) -> Engine:
    if name == "instant":
        return InstantEngine(model_id="instant", reply_bytes=256)
    if name == "tinystories":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from ps_p2p.engines.transformers_engine import TransformersEngine

        return TransformersEngine.load(MODEL, model_id="stories260K")
    raise SystemExit(f"unknown engine {name!r} (instant, tinystories)")


async def engine_direct(engine: Engine, rounds: int) -> tuple[list[float], list[float]]:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ttft, total = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        first = None
        async for chunk in engine.stream(PROMPT, params):
            if first is None and chunk.text:
                first = time.perf_counter() - start
        end = time.perf_counter() - start
        ttft.append((first if first is not None else end) * 1000)
        total.append(end * 1000)
    return ttft, total


def body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}


async def unstreamed(client: httpx.AsyncClient, model: str, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        r = await client.post("/v1/completions", json=body(model, False))
        r.raise_for_status()
        out.append((time.perf_counter() - start) * 1000)
    return out


async def streamed(client: httpx.AsyncClient, model: str, rounds: int) -> tuple[list[float], list[float], list[int]]:
    ttft, total, events = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        first = None
        count = 0
        async with client.stream("POST", "/v1/completions", json=body(model, True)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    count += 1
                    if first is None:
                        first = time.perf_counter() - start
        end = time.perf_counter() - start
        ttft.append((first if first is not None else end) * 1000)
        total.append(end * 1000)
        events.append(count)
    return ttft, total, events


async def throughput(client: httpx.AsyncClient, model: str, concurrency: int, seconds: float) -> tuple[float, int]:
    done = [0, 0]
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            r = await client.post("/v1/completions", json=body(model, False))
            done[0 if r.status_code == 200 else 1] += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return done[0] / (time.perf_counter() - start), done[1]


async def bench_engine(name: str, args: argparse.Namespace, out: Callable[[str], None]) -> None:
    engine = load_engine(name)
    out(f"\n## engine: {name} ({engine.model_id}), max_tokens {MAX_TOKENS}")
    await engine_direct(engine, 3)  # warm-up
    ttft, total = await engine_direct(engine, args.rounds)
    out(summary("engine direct: TTFT", ttft))
    out(summary("engine direct: whole answer", total))
    async with open_localnet(users=6, engine_factory=lambda i: engine, model_capacity=4) as net:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_api, net.users[0], "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                await unstreamed(client, engine.model_id, 3)  # warm-up: paths and links up
                plain = await unstreamed(client, engine.model_id, args.rounds)
                s_ttft, s_total, events = await streamed(client, engine.model_id, args.rounds)
                rps, failed = await throughput(client, engine.model_id, args.concurrency, args.seconds)
            nursery.cancel_scope.cancel()
    out(summary("API + overlay, stream=false: whole answer", plain))
    out(summary("API + overlay, stream=true: TTFT", s_ttft))
    out(summary("API + overlay, stream=true: whole answer", s_total))
    out(f"{'text events per streamed answer':<48} median {sorted(events)[len(events) // 2]}")
    out(f"{'streamed TTFT - engine TTFT (medians)':<48} "
        f"{sorted(s_ttft)[len(s_ttft) // 2] - sorted(ttft)[len(ttft) // 2]:8.2f} ms")
    out(f"{'requests/s through the API':<48} {rps:8.1f} at concurrency {args.concurrency} "
        f"for {args.seconds:.0f} s ({failed} failed)")
    await engine.aclose()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the throughput run")
    parser.add_argument("--engines", default="instant,tinystories")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"# bench_api  {time.strftime('%Y-%m-%d %H:%M')}  {machine()}")

    async def run() -> None:
        for name in args.engines.split(","):
            await bench_engine(name.strip(), args, print)

    trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
