"""The verification experiment (PlanetServe sec. 5, figs. 10-11): honest and dishonest model
nodes under challenge epochs, on the real TinyStories model, in one command.

    python benchmarks/bench_reputation.py                       # 100 epochs, ~3 min
    python benchmarks/bench_reputation.py --epochs 20 --plot ''  # a quick look

A localnet (:func:`ps_p2p.testing.localnet.open_localnet`: every node its own py-libp2p host
on loopback, one trio process) with a committee of 4 verifiers running the challenge epochs of
:mod:`ps_p2p.verification.service` (each verifier a user too, with its own reference copy of
the model), users, and model nodes that each serve ../shared/models/stories260K:

* ``honest-i``: the model itself;
* ``substituted``: a degraded copy made at run time (every weight plus Gaussian noise of 0.1 of
  its tensor's standard deviation: :func:`ps_p2p.testing.dishonest.degraded_copy`);
* ``truncating``: answers cut to a quarter of the tokens asked, still saying "length";
* ``hot``: the right model sampled at temperature 2 whatever the request asks.

Epochs are short: each ends when its leader's report commits (about a second here), a leader
that fails is replaced after ``--attempt-ms``. The pool is MT-Bench and ShareGPT first turns
that fit the model's 512-token context with the answer. After every epoch a user sends one
ordinary request (no model node named), to see whom users choose.

Reported: the epochs each dishonest node needs to become untrusted (R < 0.4; goal <= 3), the
honest nodes ever untrusted over the run (goal 0), the requests users sent to a node after it
was untrusted in their directory (goal 0), and the reputation of every node after every epoch
(``--json``), plotted to ``--plot`` (default docs/verification.png).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import time

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_devnet import machine

from ps_p2p.prompts import load_prompts
from ps_p2p.records import reputation_subject
from ps_p2p.verification.ledger import (
    SamplingOption,
    VerificationParams,
    pool_digest,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = pathlib.Path(os.environ.get("PS_SHARED_DIR") or ROOT.parent / "shared")
MODEL = SHARED / "models" / "stories260K"
MTBENCH = SHARED / "data" / "mtbench" / "question.jsonl"
SHAREGPT = SHARED / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"
#: Longest pooled prompt (characters): with the answer it stays in stories260K's 512 tokens.
MAX_PROMPT_CHARS = 600


def load_pool() -> list[str]:
    """MT-Bench then ShareGPT first turns of at most MAX_PROMPT_CHARS characters."""
    pool: list[str] = []
    for path in (MTBENCH, SHAREGPT):
        if path.is_file():
            pool += [p.text for p in load_prompts(path) if len(p.text) <= MAX_PROMPT_CHARS]
    if not pool:
        raise SystemExit(f"no prompts under {SHARED / 'data'} (set PS_SHARED_DIR)")
    return pool


def model_engines(honest: int, seed: int) -> tuple[list[str], list[object]]:
    """The kinds and engines of the model nodes, honest ones first."""
    from ps_p2p.engines.transformers_engine import TransformersEngine
    from ps_p2p.testing.dishonest import DishonestEngine, degraded_copy

    kinds = [f"honest-{i}" for i in range(honest)] + ["substituted", "truncating", "hot"]
    engines: list[object] = [TransformersEngine.load(MODEL) for _ in range(honest)]
    engines.append(degraded_copy(MODEL, noise=0.1, seed=seed))
    engines.append(DishonestEngine(TransformersEngine.load(MODEL), keep_fraction=0.25))
    engines.append(DishonestEngine(TransformersEngine.load(MODEL), temperature=2.0))
    return kinds, engines


async def run(args: argparse.Namespace) -> int:
    from ps_p2p.engines.transformers_engine import TransformersEngine
    from ps_p2p.testing.localnet import open_localnet

    pool = load_pool()
    reference = TransformersEngine.load(MODEL)
    params = VerificationParams(
        model_id=reference.model_id, pool_sha256=pool_digest(pool), pool_size=len(pool),
        sampling=(SamplingOption(max_tokens=args.max_tokens),), attempt_ms=args.attempt_ms)
    kinds, engines = model_engines(args.honest, args.seed)
    print(machine())
    print(f"model {reference.model_id}; {len(kinds)} model nodes ({', '.join(kinds)}); "
          f"committee of {args.committee}; {args.users} users; pool of {len(pool)} prompts; "
          f"greedy challenges of {args.max_tokens} tokens; {args.epochs} epochs")
    started = time.monotonic()
    async with open_localnet(
        users=args.users, models=len(kinds), committee=args.committee,
        engine_factory=lambda i: engines[i], verification=params, pool=pool,
        verifier_engine=lambda i: reference, forwarding=False, seed=args.seed,
        ready_timeout=120.0,
    ) as net:
        kind_of = {m.peer_id: kinds[i] for i, m in enumerate(net.models)}
        subject_kind = {reputation_subject(p): k for p, k in kind_of.items()}
        verifier = net.verifiers[0]
        assert verifier.consensus is not None
        params_rep = verifier.consensus.validator.genesis.reputation
        history: list[dict[str, object]] = []
        became_untrusted: dict[str, int] = {}
        served_after_untrusted: dict[str, int] = {k: 0 for k in kinds}
        served: dict[str, int] = {k: 0 for k in kinds}
        asker = net.users[0]
        assert asker.user is not None
        seen_epoch = verifier.consensus.validator.state.ledger.epoch
        deadline = args.epochs * args.attempt_ms / 1000 * 4 + 120
        with trio.fail_after(deadline):
            while len(history) < args.epochs:
                await verifier.consensus.wait_committed(
                    verifier.consensus.validator.committed_height + 1)
                state = verifier.consensus.validator.state
                if state.ledger.epoch == seen_epoch:
                    continue
                seen_epoch = state.ledger.epoch
                row: dict[str, object] = {"epoch": seen_epoch - 1,
                                          "t": round(time.monotonic() - started, 2)}
                for subject, kind in subject_kind.items():
                    entry = state.reputation(subject)
                    value = entry.value if entry is not None else params_rep.initial
                    row[kind] = round(value, 4)
                    row[f"{kind}:scored"] = entry.epochs if entry is not None else 0
                    if value < params_rep.untrusted_below and kind not in became_untrusted:
                        became_untrusted[kind] = entry.epochs if entry is not None else 0
                history.append(row)
                directory = asker.directory
                answer = await asker.user.ask(
                    pool[len(history) % len(pool)], max_tokens=args.max_tokens, timeout=30.0)
                if answer.ok and answer.served_by in kind_of:
                    kind = kind_of[answer.served_by]
                    served[kind] += 1
                    if directory is not None and not directory.trusted(answer.served_by):
                        served_after_untrusted[kind] += 1
                if len(history) % 10 == 0 or len(history) == args.epochs:
                    print(f"epoch {len(history):3d} ({row['t']:.0f} s): " + "  ".join(
                        f"{k}={row[k]:.3f}" for k in kinds), flush=True)
        credits = dict(state.ledger.credits)
        stats = [v.epochs.stats for v in net.verifiers if v.epochs is not None]
    elapsed = time.monotonic() - started
    honest = [k for k in kinds if k.startswith("honest")]
    dishonest = [k for k in kinds if not k.startswith("honest")]
    print(f"\n{len(history)} epochs in {elapsed:.0f} s ({elapsed / len(history):.2f} s/epoch)")
    for kind in dishonest:
        n = became_untrusted.get(kind)
        verdict = "never" if n is None else f"after {n} scored epoch(s)"
        rows = [r for r in history if int(r[f"{kind}:scored"]) >= (n or 0)]  # type: ignore
        back = sum(1 for r in rows if float(r[kind]) >= params_rep.untrusted_below)  # type: ignore
        print(f"  {kind:12s} untrusted {verdict}  (goal <= 3); trusted again in {back} later "
              f"epoch(s); final R = {history[-1][kind]:.3f}")
    ever = [k for k in honest if k in became_untrusted]
    lowest = min(min(float(r[k]) for r in history) for k in honest)
    print(f"  honest nodes ever untrusted: {len(ever)} of {len(honest)} (goal 0); lowest honest "
          f"R {lowest:.3f}")
    print(f"  user requests: {served}; served by a node its directory had untrusted: "
          f"{sum(served_after_untrusted.values())} (goal 0)")
    by_kind = {kind_of[n]: c for n, c in credits.items() if n in kind_of}
    print("  credits (answered / passed / missed): " + "  ".join(
        f"{k}={c.answered}/{c.passed}/{c.missed}" for k, c in sorted(by_kind.items())))
    print(f"  verifiers: led {sum(s.epochs_led for s in stats)} epochs, scored "
          f"{sum(s.answers_scored for s in stats)} answers, agreed with "
          f"{sum(s.reports_agreed for s in stats)} reports, refused "
          f"{sum(s.reports_refused for s in stats)}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(history, indent=1))
    if args.plot:
        plot(history, kinds, params_rep.untrusted_below, pathlib.Path(args.plot))
        print(f"plot: {args.plot}")
    ok = (all(k in became_untrusted and became_untrusted[k] <= 3 for k in dishonest)
          and not ever and not sum(served_after_untrusted.values()))
    return 0 if ok else 1


def plot(history: list[dict[str, object]], kinds: list[str], threshold: float,
         path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    epochs = [int(r["epoch"]) for r in history]  # type: ignore[call-overload]
    for kind in kinds:
        style = "-" if kind.startswith("honest") else "--"
        ax.plot(epochs, [r[kind] for r in history], style, label=kind, linewidth=1.6)
    ax.axhline(threshold, color="grey", linestyle=":", label=f"untrusted below {threshold}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("committed reputation R")
    ax.set_ylim(0, 1)
    ax.set_title("Reputation over challenge epochs (stories260K, committee of 4)")
    ax.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--honest", type=int, default=3, help="honest model nodes")
    ap.add_argument("--committee", type=int, default=4)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens a challenge asks for")
    ap.add_argument("--attempt-ms", type=int, default=8000,
                    help="block-time ms a leader has before the next one is drawn")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="", help="write the per-epoch reputations here")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "verification.png"),
                    help="PNG of reputation over epochs ('' for none)")
    ap.add_argument("--log", default="WARNING", help="log level of ps_p2p")
    args = ap.parse_args()
    if not MODEL.is_dir():
        print(f"the model is not at {MODEL} (set PS_SHARED_DIR)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7d %(name)s %(message)s")
    logging.getLogger("ps_p2p").setLevel(args.log.upper())
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
