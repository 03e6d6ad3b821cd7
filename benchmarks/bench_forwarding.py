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
import ast
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

from ps_p2p.config import ForwardingConfig
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
CODE_PROMPTS = {  # one instruction per data set, as an evaluation harness sends them
    "HumanEval": "You are an expert Python programmer. Complete the following function. Reply "
                 "with the function body only, in one Python code block, without tests.\n\n",
    "Mbpp": "You are an expert Python programmer. Write a Python function that solves the task "
            "described in its docstring. Reply with one Python code block.\n\n",
    "CodeContests": "You are a competitive programmer. Read the problem statement below and "
                    "write a complete Python 3 program that reads the input from stdin and "
                    "prints the answer. Reply with one Python code block.\n\n",
}
DOC_PROMPT = ("You are a careful reader. Answer the question about the document below using "
              "only the document. Be concise.\n\nDocument:\n")
CHAT_PROMPT = ("You are a helpful, honest and harmless assistant. Answer the user's message "
               "clearly.\n\n")
BOS_ID = 128000  # <|begin_of_text|> of the Llama 3 tokenizer
SENTRY_SAMPLE = 512
WORKLOADS = ("toolbench", "loogle", "code", "sharegpt", "mixed")
MIX = (("toolbench", 3), ("code", 6), ("loogle", 1))  # the paper's tool : code : long docs


# ------------------------------------------------------------------------------------ workload


@dataclasses.dataclass
class Workload:
    """``count`` requests: prompts (Llama 3 token IDs) and output lengths, in arrival order."""

    prompts: list[tuple[int, ...]]
    outputs: list[int]
    description: str


def _tokenizer(shared: pathlib.Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    path = shared / "tokenizers" / "llama3" / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{shared} has no tokenizers/llama3/tokenizer.json")
    return Tokenizer.from_file(str(path))


def _encode(tok, texts: Sequence[str]) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    return [tuple(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def _files(shared: pathlib.Path, pattern: str) -> list[str]:
    files = sorted(glob.glob(str(shared / "data" / pattern)))
    if not files:
        raise FileNotFoundError(f"{shared} has no data/{pattern}")
    return files


def _rank(items: list, rng: random.Random) -> list:
    items = list(items)
    rng.shuffle(items)  # popularity rank: a seeded order, not the files' order
    return items


def load_toolbench(shared: pathlib.Path, count: int, *, seed: int, max_context: int,
                   exponent: float = 1.1) -> Workload:
    """ToolUse (paper sec. 5.1): BOS, a system prompt, a tool set's ``api_list`` as JSON (Zipf-1.1
    over the tool sets), then a query drawn uniformly from all queries; 100 output tokens (the
    paper caps ToolUse outputs at 100). Every tool set is kept (one longer than the context is
    cut to it, as a client would)."""
    entries = []
    for name in _files(shared, "toolbench/*.json"):
        with open(name, encoding="utf-8") as fh:
            entries += json.load(fh)
    tool_sets = sorted({json.dumps(e["api_list"], sort_keys=True) for e in entries})
    queries = sorted({e["query"] for e in entries})
    tok = _tokenizer(shared)
    system = tok.encode(SYSTEM_PROMPT + "\n\nTools:\n", add_special_tokens=False).ids
    schemas = _encode(tok, [json.dumps(json.loads(t), ensure_ascii=False) for t in tool_sets])
    suffixes = _encode(tok, [f"\n\nUser: {q}\nAssistant:" for q in queries])
    rng = random.Random(f"toolbench/{seed}")
    room = max_context - max(len(x) for x in suffixes) - 100
    prefixes = _rank([(BOS_ID, *system, *e)[:room] for e in schemas], rng)
    prompts, _ = fs.zipf_prompts(prefixes, suffixes, count, rng, exponent=exponent)
    return Workload(prompts, [100] * count,
                    f"toolbench: {len(prefixes)} tool sets (Zipf-{exponent}), {len(queries)} "
                    "queries, 100 output tokens")


def load_code(shared: pathlib.Path, count: int, *, seed: int, max_context: int) -> Workload:
    """Coding: every prompt of HumanEval, MBPP and CodeContests after its data set's instruction,
    drawn uniformly; output: the canonical solution's tokens (32..512), else 256."""
    tok = _tokenizer(shared)
    items = []
    for name in _files(shared, "code/*.jsonl"):
        with open(name, encoding="utf-8") as fh:
            for line in fh:
                e = json.loads(line)
                kind = next(k for k in CODE_PROMPTS if e["task_id"].startswith(k))
                items.append((kind, e["prompt"], e.get("canonical_solution") or ""))
    heads = {k: (BOS_ID, *tok.encode(v, add_special_tokens=False).ids)
             for k, v in CODE_PROMPTS.items()}
    bodies = _encode(tok, [p for _, p, _ in items])
    solutions = _encode(tok, [s for _, _, s in items])
    prompts_all = [(heads[k] + b)[:max_context - 512] for (k, _, _), b in zip(items, bodies)]
    outs_all = [min(512, max(32, len(s))) if s else 256 for s in solutions]
    rng = random.Random(f"code/{seed}")
    picks = [rng.randrange(len(items)) for _ in range(count)]
    return Workload([prompts_all[i] for i in picks], [outs_all[i] for i in picks],
                    f"code: {len(items)} prompts (HumanEval, MBPP, CodeContests), uniform")


def load_loogle(shared: pathlib.Path, count: int, *, seed: int, max_context: int,
                exponent: float = 1.1) -> Workload:
    """Long documents (LooGLE): a document (Zipf-1.1 over the documents) and one of its questions
    (uniform); summarization documents get a summary request. Documents are kept whole up to the
    context (``max_context`` minus the question and the answer). Output: the reference answer's
    tokens (16..256), 256 for a summary."""
    tok = _tokenizer(shared)
    docs: list[tuple[str, list[tuple[str, str]]]] = []
    for name in _files(shared, "loogle/*.jsonl"):
        with open(name, encoding="utf-8") as fh:
            for line in fh:
                e = json.loads(line)
                qa = e.get("qa_pairs")
                pairs = []
                if isinstance(qa, str) and qa.strip() not in ("", "none"):
                    try:
                        pairs = [(p["Q"], p["A"]) for p in ast.literal_eval(qa)]
                    except (ValueError, SyntaxError, KeyError, TypeError):
                        pairs = []
                if not pairs:
                    pairs = [("Summarize the document in a few paragraphs.", "")]
                docs.append((e["input"], pairs))
    head = (BOS_ID, *tok.encode(DOC_PROMPT, add_special_tokens=False).ids)
    bodies = _encode(tok, [d for d, _ in docs])
    questions = [_encode(tok, [f"\n\nQuestion: {q}\nAnswer:" for q, _ in pairs])
                 for _, pairs in docs]
    answers = [[len(a) // 4 for _, a in pairs] for _, pairs in docs]
    rng = random.Random(f"loogle/{seed}")
    order = _rank(list(range(len(docs))), rng)
    room = max_context - 256 - max(len(q) for qs in questions for q in qs)
    prefixes = [head + bodies[i][:room - len(head)] for i in order]
    prompts, outs = [], []
    _, which = fs.zipf_prompts([[i] for i in range(len(order))], [[0]], count, rng,
                               exponent=exponent)
    for w in which:
        d = order[w]
        q = rng.randrange(len(questions[d]))
        prompts.append(prefixes[w] + questions[d][q])
        outs.append(min(256, max(16, answers[d][q])) if answers[d][q] else 256)
    mean_doc = sum(len(p) for p in prefixes) / len(prefixes)
    return Workload(prompts, outs, f"loogle: {len(docs)} documents (Zipf-{exponent}, "
                    f"{mean_doc:.0f} tokens on average), their questions")


def load_sharegpt(shared: pathlib.Path, count: int, *, seed: int, max_context: int) -> Workload:
    """Chat: ShareGPT first turns and MT-Bench conversations after one system prompt, uniform;
    an MT-Bench second turn follows its first (the first turn, a stand-in answer of its output
    length, then the second question) 1-20 requests later. Output: 64..512 tokens (seeded)."""
    tok = _tokenizer(shared)
    with open(_files(shared, "sharegpt/*.json")[0], encoding="utf-8") as fh:
        share = [c["conversations"][0]["value"] for c in json.load(fh) if c["conversations"]]
    with open(_files(shared, "mtbench/*.jsonl")[0], encoding="utf-8") as fh:
        mt = [json.loads(line)["turns"] for line in fh]
    head = (BOS_ID, *tok.encode(CHAT_PROMPT, add_special_tokens=False).ids)
    singles = [(head + p)[:max_context - 512]
               for p in _encode(tok, [f"User: {t}\nAssistant:" for t in share])]
    firsts = [head + p for p in _encode(tok, [f"User: {t[0]}\nAssistant:" for t in mt])]
    seconds = _encode(tok, [f"\nUser: {t[1]}\nAssistant:" for t in mt])
    rng = random.Random(f"sharegpt/{seed}")
    prompts: list[tuple[int, ...]] = []
    outs: list[int] = []
    pending: dict[int, tuple[tuple[int, ...], int]] = {}
    total = len(singles) + len(mt)
    while len(prompts) < count:
        if len(prompts) in pending:
            p, o = pending.pop(len(prompts))
        else:
            i = rng.randrange(total)
            o = rng.randint(64, 512)
            if i < len(singles):
                p = singles[i]
            else:
                j = i - len(singles)
                p = firsts[j]
                answer = tuple(rng.randrange(1000, 100_000) for _ in range(o))
                at = len(prompts) + rng.randint(1, 20)
                while at in pending:
                    at += 1
                pending[at] = ((p + answer + seconds[j])[:max_context - 512],
                               rng.randint(64, 512))
        prompts.append(p)
        outs.append(o)
    return Workload(prompts, outs, f"sharegpt: {len(singles)} ShareGPT first turns and {len(mt)} "
                    "MT-Bench two-turn conversations, 64-512 output tokens")


LOADERS = {"toolbench": load_toolbench, "loogle": load_loogle, "code": load_code,
           "sharegpt": load_sharegpt}


def load_workload(name: str, shared: pathlib.Path, count: int, *, seed: int,
                  max_context: int) -> Workload:
    """One of :data:`WORKLOADS`; ``mixed``: tool use : code : long documents 3:6:1 (the paper's
    mix), each request's kind drawn with those weights.

    Raises:
        FileNotFoundError: the data or the tokenizer is absent.
    """
    if name != "mixed":
        return LOADERS[name](shared, count, seed=seed, max_context=max_context)
    rng = random.Random(f"mixed/{seed}")
    kinds = rng.choices([k for k, _ in MIX], [w for _, w in MIX], k=count)
    parts = {k: LOADERS[k](shared, kinds.count(k), seed=seed, max_context=max_context)
             for k, _ in MIX}
    taken = dict.fromkeys(parts, 0)
    prompts, outs = [], []
    for k in kinds:
        prompts.append(parts[k].prompts[taken[k]])
        outs.append(parts[k].outputs[taken[k]])
        taken[k] += 1
    described = "; ".join(parts[k].description for k, _ in MIX)
    return Workload(prompts, outs, f"mixed 3:6:1 of {described}")


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
    ("min_share",), ("gossip", "delta_bytes"), ("gossip", "full_bytes"), ("gossip", "load_bytes"),
    ("gossip", "delta_floor_bytes"), ("gossip", "warm_delta_bytes"), ("gossip", "warm_load_bytes"),
    ("gossip", "warm_full_bytes"), ("gossip", "prompt_bytes"), ("gossip", "event_bytes"),
)


def _get(d: dict, path: tuple[str, ...]) -> float:
    for k in path:
        d = d[k]
    return d  # type: ignore[return-value]


def average(runs: list[dict]) -> list[dict]:
    """One row per (load, policy): the mean of each metric over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["load"], r["policy"]), []).append(r)
    out = []
    for (load, policy), rs in groups.items():
        row: dict = {"load": load, "policy": policy, "seeds": [r["seed"] for r in rs],
                     "latency": {}, "ttft": {}, "gossip": {}}
        for path in METRICS:
            value = sum(_get(r, path) for r in rs) / len(rs)
            (row[path[0]].__setitem__(path[1], value) if len(path) == 2
             else row.__setitem__(path[0], value))
        g = row["gossip"]
        g["delta_fraction"] = g["delta_bytes"] / g["full_bytes"] if g["full_bytes"] else None
        g["gossip_fraction"] = ((g["delta_bytes"] + g["load_bytes"]) / g["full_bytes"]
                                if g["full_bytes"] else None)
        g["warm_fraction"] = ((g["warm_delta_bytes"] + g["warm_load_bytes"])
                              / g["warm_full_bytes"] if g["warm_full_bytes"] else None)
        g["load_fraction"] = g["load_bytes"] / g["full_bytes"] if g["full_bytes"] else None
        g["vs_prompt_broadcast"] = ((g["delta_bytes"] + g["load_bytes"]) / g["prompt_bytes"]
                                    if g["prompt_bytes"] else None)
        g["vs_event_broadcast"] = ((g["delta_bytes"] + g["load_bytes"]) / g["event_bytes"]
                                   if g["event_bytes"] else None)
        g["floor_fraction"] = (g["delta_floor_bytes"] / g["full_bytes"]
                               if g["full_bytes"] else None)
        out.append(row)
    return out


def targets(results: list[dict]) -> list[dict]:
    """Issue 19's targets per load: hr-tree against central-radix and no-forwarding."""
    by = {(r["load"], r["policy"]): r for r in results}
    out = []
    for load in sorted({r["load"] for r in results}):
        ours, radix, none = (by.get((load, p)) for p in
                             (fs.HR_TREE, fs.CENTRAL_RADIX, fs.NO_FORWARDING))
        if ours is None:
            continue
        t: dict = {"load": load, "hit": ours["hit_rate"], "mean": ours["latency"]["mean"],
                   "min_share": ours["min_share"],
                   "gossip_fraction": ours["gossip"]["gossip_fraction"],
                   "warm_fraction": ours["gossip"]["warm_fraction"],
                   "load_fraction": ours["gossip"]["load_fraction"],
                   "floor_fraction": ours["gossip"]["floor_fraction"]}
        if radix is not None:
            t["hit_gap_points"] = 100 * (radix["hit_rate"] - ours["hit_rate"])
            t["latency_vs_radix"] = ours["latency"]["mean"] / radix["latency"]["mean"] - 1
        if none is not None:
            t["gain_vs_none"] = 1 - ours["latency"]["mean"] / none["latency"]["mean"]
        out.append(t)
    return out


def target_line(t: dict) -> str:
    def f(key: str, fmt: str) -> str:
        return format(t[key], fmt) if t.get(key) is not None else "-"

    return (f"  load {t['load']:.2f}: hit gap to radix {f('hit_gap_points', '+.2f')} points, "
            f"mean latency vs radix {f('latency_vs_radix', '+.1%')}, vs no-forwarding "
            f"{f('gain_vs_none', '.1%')} lower, smallest node share {f('min_share', '.1%')}, "
            f"gossip {f('gossip_fraction', '.2%')} of full broadcast (warm "
            f"{f('warm_fraction', '.2%')}; load reports {f('load_fraction', '.2%')}; the deltas'"
            f" floor, one hash a changed entry, {f('floor_fraction', '.2%')})")


HEADER = (" load  req/s  policy            hit%    mean     p50     p99  ttft  ttft99  fwd%"
          " minshr  deltaMB   fullMB  loadMB gsp/full   sim_s wall_s")


def row(r: dict) -> str:
    g = r["gossip"]
    full = g["full_bytes"]
    frac = f"{100 * (g['delta_bytes'] + g['load_bytes']) / full:7.2f}%" if full else "     -  "
    return (f"{r['load']:5.2f} {r['rate']:7.2f} {r['policy']:<14} {100 * r['hit_rate']:6.1f} "
            f"{r['latency']['mean']:7.2f} {r['latency']['p50']:7.2f} {r['latency']['p99']:7.2f} "
            f"{r['ttft']['mean']:6.2f} {r['ttft']['p99']:7.2f} {100 * r['forwarded']:5.1f} "
            f"{100 * r['min_share']:5.1f}% {g['delta_bytes'] / 1e6:8.2f} {full / 1e6:8.2f} "
            f"{g['load_bytes'] / 1e6:7.2f} {frac} {r['sim_seconds']:7.1f} "
            f"{r['wall_seconds']:6.1f}")


# ---------------------------------------------------------------------------------------- main


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="toolbench")
    ap.add_argument("--quick", action="store_true", help="one small run (a few seconds)")
    ap.add_argument("--seed", type=int, default=1, help="first seed")
    ap.add_argument("--seeds", type=int, default=None, help="runs per point, seeds seed.. (3)")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None, help="requests per run (4000)")
    ap.add_argument("--loads", "--rates", dest="loads", default=None,
                    help="arrival rates as fractions of no-forwarding saturation (0.5,0.9,1.1)")
    ap.add_argument("--policies", default=",".join((fs.NO_FORWARDING, fs.CENTRAL_RADIX,
                                                    fs.HR_TREE)))
    ap.add_argument("--lengths", default="config",
                    help="chunk lengths L: 'config' (ForwardingConfig's, as a node deploys it), "
                         "'sentry' (the Sentry over the first 512 prompts) or a comma list")
    ap.add_argument("--cache-tokens", type=int, default=13_000 * 16,
                    help="each node's KV cache in tokens (default 208,000: 13,000 blocks, the "
                         "paper's A6000; cache pressure: e.g. 32768)")
    ap.add_argument("--max-context", type=int, default=32_768,
                    help="longest prompt + output; longer documents are cut to it")
    ap.add_argument("--busy-weight", type=float, default=None,
                    help="override ForwardingConfig.busy_weight (a sweep; default: the config's)")
    ap.add_argument("--parallel-prefill", action="store_true",
                    help="SimEngine's schedule: every slot prefills at full speed at once")
    ap.add_argument("--shared",
                    default=os.environ.get("PS_SHARED_DIR") or str(REPO.parent / "shared"))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    requests = args.requests or (600 if args.quick else 4000)
    seeds = list(range(args.seed, args.seed + (args.seeds or (1 if args.quick else 3))))
    loads = parse_floats(args.loads or ("0.5,1.1" if args.quick else "0.5,0.9,1.1"))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    started = time.perf_counter()
    print(f"# bench_forwarding --workload {args.workload}  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{machine()}")
    blocks = max(1, args.cache_tokens // 16)
    params = SimParams(cache_blocks=blocks, max_context=args.max_context)
    forwarding = ForwardingConfig()  # the deployed defaults
    if args.busy_weight is not None:
        forwarding = dataclasses.replace(forwarding, busy_weight=args.busy_weight)

    runs: list[dict] = []
    seed_info = []
    for seed in seeds:
        try:
            work = load_workload(args.workload, pathlib.Path(args.shared), requests, seed=seed,
                                 max_context=args.max_context)
        except FileNotFoundError as exc:
            print(f"skipped: {exc}")
            return 2
        fwd, found = forwarding, ()
        if args.lengths == "sentry":
            lengths, found = sentry_lengths(work.prompts, min(SENTRY_SAMPLE, len(work.prompts)))
            fwd = dataclasses.replace(fwd, chunk_lengths=list(lengths.lengths),
                                      chunk_version=lengths.version)
        elif args.lengths != "config":
            fwd = dataclasses.replace(fwd, chunk_lengths=[int(x) for x in args.lengths.split(",")],
                                      chunk_version=1)
        config = fs.ClusterConfig(nodes=args.nodes, params=params, forwarding=fwd,
                                  serial_prefill=not args.parallel_prefill, seed=seed)
        lengths = config.lengths
        mean_prompt = sum(len(p) for p in work.prompts) / len(work.prompts)
        mean_out = sum(work.outputs) / len(work.outputs)
        unit = fs.make_trace(work.prompts, 1.0, nodes=config.nodes, output_tokens=work.outputs,
                             seed=seed)
        prepared = fs.PreparedPrompts(unit.prompts, config)
        saturation = fs.saturation_rate(unit, config, prepared)
        print(f"## seed {seed}: {len(work.prompts)} requests; {work.description}; prompt "
              f"{mean_prompt:.0f} tokens, output {mean_out:.0f} on average; L = "
              f"{lengths.lengths} then {lengths.default} (Sentry's S = {found}); no-forwarding "
              f"saturation {saturation:.2f} req/s")
        seed_info.append({"seed": seed, "saturation_rate": saturation,
                          "mean_prompt_tokens": mean_prompt, "mean_output_tokens": mean_out,
                          "chunk_lengths": list(lengths.lengths), "sentry_prefixes": list(found)})
        print(HEADER)
        for fraction in loads:
            trace = fs.make_trace(work.prompts, fraction * saturation, nodes=config.nodes,
                                  output_tokens=work.outputs, seed=seed)
            for policy in policies:
                t0 = time.perf_counter()
                r = fs.simulate(trace, policy, config, prepared)
                out = {**r.as_dict(), "load": fraction, "seed": seed,
                       "wall_seconds": time.perf_counter() - t0,
                       "min_share": min(r.served) / sum(r.served)}
                runs.append(out)
                print(row(out), flush=True)

    results = average(runs)
    mean_sat = sum(s["saturation_rate"] for s in seed_info) / len(seed_info)
    print(f"# {args.workload}: mean over seeds {seeds}; {args.nodes} nodes, {params.max_batch} "
          f"slots, cache {params.cache_blocks} blocks x {params.block_size} "
          f"({args.cache_tokens} tokens), prefill {params.prefill_tokens_per_s:.0f} tok/s "
          f"{'parallel' if args.parallel_prefill else 'serial'}, step {params.step_time}s "
          f"(+{params.batch_growth:.0%}/seq); forwarding: ForwardingConfig() "
          f"{'defaults' if fwd == ForwardingConfig() else dataclasses.asdict(fwd)}; gossip delay "
          f"{config.gossip_delay}s, hop {config.hop_delay}s, warm-up "
          f"{config.warmup_fraction:.0%} left out; no-forwarding saturation {mean_sat:.2f} req/s")
    print(HEADER)
    for r in sorted(results, key=lambda r: (r["load"], policies.index(r["policy"]))):
        print(row(r))
    checks = targets(results)
    print("# targets (hr-tree):")
    for t in checks:
        print(target_line(t))
    total = time.perf_counter() - started
    print(f"# total wall time {total:.1f} s; load average at end {os.getloadavg()}")
    report = {
        "workload": args.workload, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "seeds": seeds, "requests": requests, "loads": loads, "cache_tokens": args.cache_tokens,
        "seed_info": seed_info, "results": results, "targets": checks, "runs": runs,
        "wall_seconds": total,
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
