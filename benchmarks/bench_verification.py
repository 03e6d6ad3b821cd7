"""Responses verified per minute: one-pass scoring against the paper's per-token loop.

PlanetServe sec. 3.4 / Algorithm 3 scores a challenge response with one engine call per output
token (``GetCompletionLogprobs(context, max_tokens=1)``: the paper reports 45 responses per minute
on a GH200). ``ps_p2p.verification.scoring.score_response`` scores the whole response in one
forward pass. Both run here on the same engine and model, on the same 128-token responses:

* workload: ``--responses`` prompts (MT-Bench first turns, then ShareGPT first human messages,
  from ``../shared/data``; ``PS_SHARED_DIR`` overrides ``../shared``), each answered greedily by
  the model itself with ``max_tokens=128`` (not timed);
* one-pass: ``score_response(engine, prompt, answer, temperature=0)`` (tokenize, one
  ``score_ids`` forward pass with the top-20 alternatives, tempered credibility);
* per-token: ``score_response_per_token`` with the same arguments (tokenize, then one
  ``score_ids`` forward pass per response token over the growing context);
* both at temperature 1 too (``Engine.score``, no alternatives), ``--t1``.

Each response is timed with both, alternately (so both see the same machine load), after a
warm-up. It prints the machine, median and p99 per response, responses per minute (60 s / the
median), the ratio of the medians, and the largest difference between the two scores (they must
agree). Model: ``../shared/models/stories260K`` on the CPU unless ``--device`` says otherwise.

Run: ``python benchmarks/bench_verification.py [--responses 30] [--tokens 128] [--device cpu]
[--t1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_devnet import machine

from ps_p2p.engines.base import SamplingParams
from ps_p2p.verification.scoring import (
    score_response,
    score_response_per_token,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = pathlib.Path(os.environ.get("PS_SHARED_DIR") or ROOT.parent / "shared")
MODEL = SHARED / "models" / "stories260K"
MTBENCH = SHARED / "data" / "mtbench" / "question.jsonl"
SHAREGPT = SHARED / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"


def load_prompts(count: int) -> tuple[list[str], str]:
    """Up to ``count`` real prompts, and where they came from."""
    prompts: list[str] = []
    sources = []
    if MTBENCH.is_file():
        with MTBENCH.open() as fh:
            prompts += [json.loads(line)["turns"][0] for line in fh if line.strip()]
        sources.append("MT-Bench")
    if len(prompts) < count and SHAREGPT.is_file():
        for conv in json.loads(SHAREGPT.read_text()):
            turns = [t["value"] for t in conv.get("conversations", []) if t.get("from") == "human"]
            if turns:
                prompts.append(turns[0][:1000])
        sources.append("ShareGPT")
    if not prompts:
        prompts = [f"Once upon a time, in story number {i}, a little fox found a lantern."
                   for i in range(count)]
        sources.append("synthetic")
    return prompts[:count], " + ".join(sources)


def stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


async def run(args: argparse.Namespace) -> int:
    from ps_p2p.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine.load(MODEL, device=args.device)
    prompts, source = load_prompts(args.responses)
    print(machine())
    print(f"model {engine.model_id} on {args.device}; {len(prompts)} prompts from {source}; "
          f"answers of {args.tokens} tokens (greedy, by the same model)")
    answers = []
    for p in prompts:
        done = await engine.complete(p, SamplingParams(max_tokens=args.tokens))
        answers.append(done.text)
    lengths = [len(await engine.encode(a, add_special_tokens=False)) for a in answers]
    print(f"scored tokens per answer: median {statistics.median(lengths):.0f}, "
          f"min {min(lengths)}, max {max(lengths)}")

    temperatures = [0.0, 1.0] if args.t1 else [0.0]
    for temperature in temperatures:
        one_t: list[float] = []
        loop_t: list[float] = []
        worst = 0.0
        # warm-up (first-call costs of torch and the worker thread)
        await score_response(engine, prompts[0], answers[0], temperature=temperature)
        await score_response_per_token(engine, prompts[0], answers[0], temperature=temperature)
        for p, a in zip(prompts, answers):
            t0 = time.perf_counter()
            one = await score_response(engine, p, a, temperature=temperature)
            t1 = time.perf_counter()
            loop = await score_response_per_token(engine, p, a, temperature=temperature)
            t2 = time.perf_counter()
            one_t.append((t1 - t0) * 1000)
            loop_t.append((t2 - t1) * 1000)
            worst = max(worst, abs(one - loop))
        (om, op), (lm, lp) = stats(one_t), stats(loop_t)
        label = "greedy challenge (scored at T'=0.25, top-20)" if temperature == 0 else \
            "temperature-1 challenge (Engine.score)"
        print(f"\n{label}, n={len(one_t)} responses")
        print(f"  one pass : median {om:9.2f} ms  p99 {op:9.2f} ms  -> {60_000 / om:9.0f} "
              "responses/min")
        print(f"  per token: median {lm:9.2f} ms  p99 {lp:9.2f} ms  -> {60_000 / lm:9.0f} "
              "responses/min")
        print(f"  ratio of the medians: {lm / om:.1f}x   largest |score difference|: {worst:.2e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--t1", action="store_true", help="also time temperature-1 scoring")
    args = parser.parse_args(argv)
    if not MODEL.is_dir():
        print(f"no model at {MODEL}: set PS_SHARED_DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
