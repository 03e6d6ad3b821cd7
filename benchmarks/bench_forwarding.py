"""Overlay forwarding among 8 model nodes: no forwarding, least load, a central radix router, ours.

A forwarding experiment anyone can run (PlanetServe sec. 5.4, Figs. 14-16; Appendix A6, Figs.
19-20), as a deterministic discrete-event simulation that drives the project's own cores
(:mod:`ps_p2p.testing.forwarding_sim`: prefix cache, cost model, CacheView, HR-tree deltas and
replicas, load book, forwarding policies). Simulated seconds; the machine only sets how long the
run takes.

Workload, ToolUse-like (paper sec. 5.1), from ``../shared/data/toolbench`` (StableToolBench test
queries: ``api_list`` of tool schemas and a ``query``):

* a *prefix* per distinct tool set: BOS, a fixed system prompt written here, then the tool set's
  ``api_list`` as JSON; a *suffix* per query: the user's query in a short chat frame. Each part is
  tokenized on its own with the Llama 3 tokenizer (``../shared/tokenizers/llama3``), so all
  prompts of one tool set share its prefix token for token;
* a request draws its tool set by Zipf-1.1 over the tool sets (ranked in a seeded random order:
  the paper samples ToolUse with Zipf-1.1) and its query uniformly from all queries (the data has
  about one query per tool set; drawing the query independently gives every tool set many
  queries, as in the paper's 210k-query workload);
* tool sets whose prompt would not fit the 8k context with the longest query and the output are
  left out; output: 100 tokens for every request (the paper caps ToolUse outputs at 100 tokens;
  the data has no answers);
* Poisson arrivals, entry node uniform at random; the same draws at every rate.

The group's chunk lengths L come from the Sentry (Appendix A3) run over the first 512 prompts.
Each node's KV cache holds ``--cache-blocks`` blocks of 16 tokens (default 2048, 32k tokens):
the paper's A6000 holds ~13,000 blocks for 7.2k-token ToolUse prompts (~29 prompts); ours are
~1.2k tokens, so the cache is scaled to hold a similar number of prompts and eviction matters as
much. Rates are fractions of the no-forwarding group's saturation rate, measured first by a flood
run (:func:`~ps_p2p.testing.forwarding_sim.saturation_rate`).

Run: ``python benchmarks/bench_forwarding.py [--quick] [--requests 4000] [--rates 0.3,0.6,0.9,1.1]
[--out results.json] [--plot docs/forwarding.png]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import pathlib
import random
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_devnet import machine

from ps_p2p.engines.sim_cost import SimParams
from ps_p2p.gossip.sentry import ChunkLengths, Sentry
from ps_p2p.testing import forwarding_sim as fs

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSTEM_PROMPT = (
    "You are an assistant that answers the user's request by calling the tools listed below. "
    "Each tool is described by its category, name, API name, description, and its required and "
    "optional parameters. Think about which tool fits the request, call it with arguments that "
    "match its parameters, read its response, and call further tools if needed. When you have "
    "the answer, reply with a short final answer for the user. If no tool can help, say so."
)
BOS_ID = 128000  # <|begin_of_text|> of the Llama 3 tokenizer
SENTRY_SAMPLE = 512


# ------------------------------------------------------------------------------------ workload


@dataclasses.dataclass
class Workload:
    prompts: list[tuple[int, ...]]
    prefix_of: list[int]
    tool_sets: int
    queries: int
    dropped_tool_sets: int
    prefix_tokens: list[int]


def load_toolbench(
    shared: pathlib.Path, count: int, *, seed: int, max_context: int, output_tokens: int,
    exponent: float = 1.1,
) -> Workload:
    """The ToolUse workload (module docstring): ``count`` prompts as Llama 3 token IDs.

    Raises:
        FileNotFoundError: the data or the tokenizer is absent.
    """
    from tokenizers import Tokenizer

    files = sorted(glob.glob(str(shared / "data" / "toolbench" / "*.json")))
    tokenizer_file = shared / "tokenizers" / "llama3" / "tokenizer.json"
    if not files or not tokenizer_file.is_file():
        raise FileNotFoundError(f"{shared} has no data/toolbench/*.json or tokenizers/llama3")
    entries = []
    for name in files:
        with open(name, encoding="utf-8") as fh:
            entries += json.load(fh)
    tool_sets = sorted({json.dumps(e["api_list"], sort_keys=True) for e in entries})
    queries = sorted({e["query"] for e in entries})
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    system = tokenizer.encode(SYSTEM_PROMPT + "\n\nTools:\n", add_special_tokens=False).ids
    schemas = tokenizer.encode_batch([json.dumps(json.loads(t), ensure_ascii=False)
                                      for t in tool_sets], add_special_tokens=False)
    suffixes = [tuple(e.ids) for e in tokenizer.encode_batch(
        [f"\n\nUser: {q}\nAssistant:" for q in queries], add_special_tokens=False)]
    longest_suffix = max(len(s) for s in suffixes)
    prefixes = [(BOS_ID, *system, *e.ids) for e in schemas]
    fits = [p for p in prefixes if len(p) + longest_suffix + output_tokens <= max_context]
    rng = random.Random(f"toolbench/{seed}")
    rng.shuffle(fits)  # popularity rank: a seeded order, not the files' order
    prompts, which = fs.zipf_prompts(fits, suffixes, count, rng, exponent=exponent)
    return Workload(prompts, which, len(fits), len(suffixes), len(prefixes) - len(fits),
                    [len(p) for p in fits])


def sentry_lengths(prompts: Sequence[Sequence[int]], sample: int) -> tuple[ChunkLengths, tuple]:
    """L from the Sentry over the first ``sample`` prompts (version 1), and the S it found."""
    sentry = Sentry(ChunkLengths(0), refresh_requests=sample, max_samples=sample)
    proposal = None
    for p in prompts[:sample]:
        proposal = sentry.observe(p) or proposal
    return (proposal or sentry.current), sentry.prefix_lengths()


# ------------------------------------------------------------------------------------- report

METRICS = (  # averaged over seeds (the paper averages three runs per point)
    ("hit_rate",), ("latency", "mean"), ("latency", "p50"), ("latency", "p99"), ("ttft", "mean"),
    ("ttft", "p99"), ("forwarded",), ("rate",), ("sim_seconds",), ("wall_seconds",),
    ("gossip", "delta_bytes"), ("gossip", "full_bytes"), ("gossip", "load_bytes"),
    ("gossip", "delta_floor_bytes"),
)


def _get(d: dict, path: tuple[str, ...]) -> float:
    for k in path:
        d = d[k]
    return d  # type: ignore[return-value]


def average(runs: list[dict]) -> list[dict]:
    """One row per (load, policy, threshold): the mean of each metric over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["load"], r["policy"], r["overload_threshold"]), []).append(r)
    out = []
    for (load, policy, thr), rs in groups.items():
        row: dict = {"load": load, "policy": policy, "overload_threshold": thr,
                     "seeds": [r["seed"] for r in rs], "latency": {}, "ttft": {}, "gossip": {}}
        for path in METRICS:
            value = sum(_get(r, path) for r in rs) / len(rs)
            (row[path[0]].__setitem__(path[1], value) if len(path) == 2
             else row.__setitem__(path[0], value))
        g = row["gossip"]
        g["delta_fraction"] = g["delta_bytes"] / g["full_bytes"] if g["full_bytes"] else None
        g["floor_fraction"] = (g["delta_floor_bytes"] / g["full_bytes"] if g["full_bytes"]
                               else None)
        out.append(row)
    return out


HEADER = (" load  req/s  policy            hit%    mean     p50     p99  ttft  ttft99  fwd%"
          "  deltaMB   fullMB d/full floor%  loadMB   sim_s wall_s")


def row(r: dict) -> str:
    g = r["gossip"]

    def pct(x: float | None) -> str:
        return f"{100 * x:5.1f}%" if x is not None else "   -  "

    return (f"{r['load']:5.2f} {r['rate']:7.2f} {r['policy']:<14} {100 * r['hit_rate']:6.1f} "
            f"{r['latency']['mean']:7.2f} {r['latency']['p50']:7.2f} {r['latency']['p99']:7.2f} "
            f"{r['ttft']['mean']:6.2f} {r['ttft']['p99']:7.2f} {100 * r['forwarded']:5.1f} "
            f"{g['delta_bytes'] / 1e6:8.2f} {g['full_bytes'] / 1e6:8.2f} "
            f"{pct(g['delta_fraction'])} "
            f"{pct(g['delta_floor_bytes'] / g['full_bytes'] if g['full_bytes'] else None)} "
            f"{g['load_bytes'] / 1e6:7.2f} {r['sim_seconds']:7.1f} {r['wall_seconds']:6.1f}")


def plot(results: list[dict], sweep: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [(p, [r for r in results if r["policy"] == p], "-") for p in fs.POLICIES
             if any(r["policy"] == p for r in results)]
    for thr in sorted({r["overload_threshold"] for r in sweep}):
        lines.append((f"hr-tree, threshold {thr:g} s",
                      [r for r in sweep if r["policy"] == fs.HR_TREE
                       and r["overload_threshold"] == thr], "--"))
    fig, axes = plt.subplots(1, 5, figsize=(23, 4.4))
    panels = [("latency", "mean", "mean latency (s)"), ("latency", "p99", "p99 latency (s)"),
              ("ttft", "mean", "mean TTFT (s)"), (None, "hit_rate", "KV-cache hit rate (%)")]
    for ax, (group, key, label) in zip(axes, panels):
        for name, rs, style in lines:
            rs = sorted(rs, key=lambda r: r["load"])
            ys = [100 * r[key] if group is None else r[group][key] for r in rs]
            ax.plot([r["load"] for r in rs], ys, style, marker="o", markersize=4, label=name)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("arrival rate / no-forwarding saturation")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    # Appendix A6 (Figs. 19-20): HR-tree update traffic of the group, delta vs full broadcast
    ax = axes[4]
    ours = sorted((r for r in results if r["policy"] == fs.HR_TREE), key=lambda r: r["load"])
    xs = [r["load"] for r in ours]
    for key, label in (("full_bytes", "full broadcast of subtrees"), ("delta_bytes", "deltas"),
                       ("delta_floor_bytes", "8 B per changed entry"),
                       ("load_bytes", "load reports")):
        ax.plot(xs, [r["gossip"][key] / r["sim_seconds"] / 1e3 for r in ours], marker="o",
                markersize=4, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate / no-forwarding saturation")
    ax.set_ylabel("hr-tree gossip, all nodes (kB/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- main


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small run (a few seconds)")
    ap.add_argument("--seed", type=int, default=1, help="first seed")
    ap.add_argument("--seeds", type=int, default=None, help="runs per point, seeds seed.. (3)")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None, help="requests per run (5000)")
    ap.add_argument("--rates", default=None,
                    help="arrival rates as fractions of no-forwarding saturation "
                         "(0.3,0.6,0.9,1.1,1.25)")
    ap.add_argument("--policies", default=",".join(fs.POLICIES))
    ap.add_argument("--thresholds", default=None,
                    help="overload thresholds (s) to sweep for central-radix and hr-tree at the "
                         "three highest rates (default: 10,20 unless --quick)")
    ap.add_argument("--lengths", default="sentry",
                    help="chunk lengths L: 'sentry' (from the first 512 prompts) or a comma "
                         "list of lengths (then 32-token chunks)")
    ap.add_argument("--cache-blocks", type=int, default=2048)
    ap.add_argument("--delta-interval", type=float, default=2.0)
    ap.add_argument("--output-tokens", type=int, default=100)
    ap.add_argument("--parallel-prefill", action="store_true",
                    help="SimEngine's schedule: every slot prefills at full speed at once")
    ap.add_argument("--shared",
                    default=os.environ.get("PS_SHARED_DIR") or str(REPO.parent / "shared"))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (e.g. docs/forwarding.png)")
    args = ap.parse_args(argv)

    requests = args.requests or (600 if args.quick else 5000)
    seeds = list(range(args.seed, args.seed + (args.seeds or (1 if args.quick else 3))))
    rates = parse_floats(args.rates or ("0.5,1.1" if args.quick else "0.3,0.6,0.9,1.1,1.25"))
    thresholds = parse_floats(args.thresholds if args.thresholds is not None
                              else ("" if args.quick else "10,20"))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    started = time.perf_counter()
    print(f"# bench_forwarding  {time.strftime('%Y-%m-%d %H:%M')}  {machine()}")
    params = SimParams(cache_blocks=args.cache_blocks)

    runs: list[dict] = []
    sweep_runs: list[dict] = []
    seed_info = []
    for seed in seeds:
        try:
            work = load_toolbench(pathlib.Path(args.shared), requests, seed=seed,
                                  max_context=params.max_context,
                                  output_tokens=args.output_tokens)
        except FileNotFoundError as exc:
            print(f"skipped: {exc}")
            return 2
        if args.lengths == "sentry":
            lengths, found = sentry_lengths(work.prompts, min(SENTRY_SAMPLE, len(work.prompts)))
        else:
            lengths, found = ChunkLengths(1, tuple(int(x) for x in args.lengths.split(","))), ()
        config = fs.ClusterConfig(
            nodes=args.nodes, params=params, serial_prefill=not args.parallel_prefill,
            lengths=lengths, delta_interval=args.delta_interval, seed=seed)
        mean_prompt = sum(len(p) for p in work.prompts) / len(work.prompts)
        unit = fs.make_trace(work.prompts, 1.0, nodes=config.nodes,
                             output_tokens=args.output_tokens, seed=seed)
        prepared = fs.PreparedPrompts(unit.prompts, config)
        saturation = fs.saturation_rate(unit, config, prepared)
        depth = sum(1 for p in work.prompts if lengths.chunk_count(len(p)) > len(lengths.lengths))
        print(f"## seed {seed}: {len(work.prompts)} requests, {work.tool_sets} tool sets "
              f"(Zipf-1.1; {work.dropped_tool_sets} too long left out), {work.queries} queries; "
              f"prompt {mean_prompt:.0f} tokens on average, output {args.output_tokens}; L = "
              f"{lengths.lengths} then {lengths.default} (Sentry's S = {found}; "
              f"{100 * depth / len(work.prompts):.0f}% of prompts reach the default chunks); "
              f"no-forwarding saturation {saturation:.2f} req/s")
        seed_info.append({"seed": seed, "saturation_rate": saturation,
                          "mean_prompt_tokens": mean_prompt, "tool_sets": work.tool_sets,
                          "chunk_lengths": list(lengths.lengths), "sentry_prefixes": list(found)})
        top = sorted(rates)[-3:]
        plan = [(f, p, config) for f in rates for p in policies]
        plan += [(f, p, dataclasses.replace(config, overload_threshold=thr))
                 for thr in thresholds for f in top for p in (fs.CENTRAL_RADIX, fs.HR_TREE)]
        print(HEADER + "  thr")
        for fraction, policy, c in plan:
            trace = fs.make_trace(work.prompts, fraction * saturation, nodes=c.nodes,
                                  output_tokens=args.output_tokens, seed=seed)
            t0 = time.perf_counter()
            r = fs.simulate(trace, policy, c, prepared)
            out = {**r.as_dict(), "load": fraction, "seed": seed,
                   "wall_seconds": time.perf_counter() - t0,
                   "overload_threshold": c.overload_threshold}
            (runs if c is config else sweep_runs).append(out)
            print(row(out) + f"  {c.overload_threshold:g}", flush=True)

    results = average(runs)
    sweep = average(sweep_runs)
    config = fs.ClusterConfig(nodes=args.nodes, params=params,
                              serial_prefill=not args.parallel_prefill,
                              delta_interval=args.delta_interval)
    mean_sat = sum(s["saturation_rate"] for s in seed_info) / len(seed_info)
    print(f"# mean over seeds {seeds}; cluster: {config.nodes} nodes, {params.max_batch} slots, "
          f"cache {params.cache_blocks} blocks x {params.block_size}, prefill "
          f"{params.prefill_tokens_per_s:.0f} tok/s {'parallel' if args.parallel_prefill else 'serial'}, "
          f"step {params.step_time}s (+{params.batch_growth:.0%}/seq), load every "
          f"{config.load_interval}s, deltas every {config.delta_interval}s, gossip delay "
          f"{config.gossip_delay}s, hop {config.hop_delay}s, warm-up {config.warmup_fraction:.0%} "
          f"left out; no-forwarding saturation {mean_sat:.2f} req/s")
    if len(seeds) > 1:
        print(HEADER + "  thr")
        for r in results + sweep:
            print(row(r) + f"  {r['overload_threshold']:g}")
    total = time.perf_counter() - started
    print(f"# total wall time {total:.1f} s")
    report = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "seeds": seeds,
        "requests": requests, "rates": rates, "seed_info": seed_info,
        "config": {k: v for k, v in dataclasses.asdict(config).items()
                   if k not in ("key", "lengths", "seed")},
        "results": results, "threshold_sweep": sweep, "runs": runs + sweep_runs,
        "wall_seconds": total,
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    if args.plot:
        plot(results, sweep, pathlib.Path(args.plot),
             f"{config.nodes} model nodes (cost model), ToolUse from toolbench (Zipf-1.1), "
             f"{requests} requests per point, mean of {len(seeds)} seeds; no-forwarding "
             f"saturation {mean_sat:.1f} req/s (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
