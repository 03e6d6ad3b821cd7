"""The transformers engine's prefix cache: prefill of a long shared prefix, cold vs warm.

Workload (the paper's Long-Doc QA shape, PlanetServe sec. 5): one long document as a shared
prefix (the first LooGLE document of ``../shared/data/loogle/shortdep_qa.jsonl``, cut to
``--prefix-tokens`` tokens; a synthetic story when the data is absent) followed by a short
question (its QA pairs' questions, each made unique by its round number). Each round times
``engine.complete(prompt, max_tokens=1)`` (tokenize, prefill, one token: the time to first
token) on two engines sharing one loaded model, alternately:

* cold: ``prefix_cache_blocks=0``, the whole prompt is prefilled;
* warm: a prefix cache (16-token blocks) primed with the document once; only the question (and
  the document's last partial block) is prefilled.

It prints median and p99 of both, the speedup of the medians, and checks that both engines pick
the same first token. It also times the prefill alone: the first decoding step in this thread
(the engine's ``_Generation.step``: cache lookup and key/value join, forward pass, storing the
new blocks, picking the token), without tokenizing, the worker thread and the trio lock. Model: ``../shared/models/stories260K`` (``PS_SHARED_DIR`` overrides
``../shared``), on this machine's CPU unless ``--device`` says otherwise.

Run: ``python benchmarks/bench_prefix_cache.py [--rounds 200] [--prefix-tokens 1500]
[--device cpu]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import statistics
import sys
import time

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_devnet import machine  # noqa: E402
from bench_overlay import summary  # noqa: E402

from ps_p2p.engines.base import SamplingParams  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = pathlib.Path(os.environ.get("PS_SHARED_DIR") or ROOT.parent / "shared")
MODEL = SHARED / "models" / "stories260K"
LOOGLE = SHARED / "data" / "loogle" / "shortdep_qa.jsonl"
ONE_TOKEN = SamplingParams(max_tokens=1)


def workload() -> tuple[str, list[str], str]:
    """(document, questions, where they come from)."""
    if LOOGLE.is_file():
        with LOOGLE.open() as fh:
            record = json.loads(fh.readline())
        pairs = record["qa_pairs"]
        if isinstance(pairs, str):
            pairs = ast.literal_eval(pairs)
        return record["input"], [p["Q"] for p in pairs], f"{LOOGLE} (first document)"
    story = ("Once upon a time, a little fox found a lantern in the forest and wondered who had "
             "left it there. ")
    return story * 200, ["Who left the lantern?", "What did the fox do?"], "synthetic story"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--prefix-tokens", type=int, default=1500,
                        help="tokens of the shared document (stories260K's context is 2048)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if not MODEL.is_dir():
        print(f"no model at {MODEL}: set PS_SHARED_DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ps_p2p.engines.transformers_engine import TransformersEngine, _Generation

    cold = TransformersEngine.load(MODEL, device=args.device, prefix_cache_blocks=0)
    warm = TransformersEngine(
        cold.model, cold.tokenizer, model_id=cold.model_id, max_context=cold.max_context,
        prefix_cache_blocks=512,
    )
    document, questions, source = workload()
    ids = cold._encode(document, add_special_tokens=False)[: args.prefix_tokens]
    prefix = cold.tokenizer.decode(ids)

    def prompt(i: int) -> str:
        return f"{prefix}\nQuestion {i}: {questions[i % len(questions)]}\nAnswer:"

    async def run() -> tuple[list[float], list[float], int, int]:
        await warm.complete(prefix, ONE_TOKEN)  # prime the cache with the document
        for i in range(3):  # warm-up of both paths
            await cold.complete(prompt(-1 - i), ONE_TOKEN)
            await warm.complete(prompt(-1 - i), ONE_TOKEN)
        times: dict[str, list[float]] = {"cold": [], "warm": []}
        prompt_tokens = 0
        cached_before = warm.prompt_tokens_cached
        for i in range(args.rounds):
            text = prompt(i)
            order = [("cold", cold), ("warm", warm)]
            first: dict[str, str] = {}
            for name, engine in order if i % 2 else order[::-1]:
                start = time.perf_counter()
                completion = await engine.complete(text, ONE_TOKEN)
                times[name].append((time.perf_counter() - start) * 1000.0)
                first[name] = completion.text
            prompt_tokens += completion.prompt_tokens
            if first["cold"] != first["warm"]:
                raise SystemExit(f"round {i}: the first tokens differ: {first}")
        cached = (warm.prompt_tokens_cached - cached_before) // args.rounds
        return times["cold"], times["warm"], prompt_tokens // args.rounds, cached

    cold_ms, warm_ms, tokens, cached = trio.run(run)

    def step_ms(engine: TransformersEngine, i: int) -> float:
        ids = engine._prompt_ids(prompt(10_000 + i))
        generation = _Generation(engine, ids, ONE_TOKEN)
        start = time.perf_counter()
        generation.step()
        return (time.perf_counter() - start) * 1000.0

    cold_step = [step_ms(cold, i) for i in range(args.rounds)]
    warm_step = [step_ms(warm, i) for i in range(args.rounds)]
    print(f"# bench_prefix_cache  {time.strftime('%Y-%m-%d %H:%M')}  {machine()}")
    print(f"model {MODEL.name} on {args.device}; document: {source}; {args.rounds} rounds")
    print(f"prompt: {tokens} tokens on average, {cached} of them from the prefix cache when warm")
    print(summary("cold: complete(max_tokens=1), whole prefill", cold_ms))
    print(summary("warm: complete(max_tokens=1), cached prefix", warm_ms))
    print(summary("cold: prefill step alone", cold_step))
    print(summary("warm: prefill step alone", warm_step))
    for what, a, b in (("complete", cold_ms, warm_ms), ("prefill step", cold_step, warm_step)):
        print(f"speedup of the median, {what}: {statistics.median(a) / statistics.median(b):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
