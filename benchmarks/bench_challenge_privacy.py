"""Issue 18, finding 1: can a model node tell a verifier's challenge from a user's request?

The adversary is a model node that learns from the chain which of its past requests were
challenges (each EPOCH_REPORT carries SHA-256(Q) in clear) and trains a classifier on
everything it sees (:mod:`ps_p2p.testing.challenge_classifier`): every field of Q as it decodes
it, Q's length, the arrival time in the epoch and since its previous request, the chain's
published data (the genesis' sampling menu, prompts it was asked before) and the prompt's
presence in public data sets (verbatim or word 5-gram Jaccard).

Traffic, one attacked model node among ``--nodes``, ``--epochs`` epochs of ``--epoch-s``:

* users: Poisson arrivals (``--user-rate`` per second), bodies drawn from
  :data:`~ps_p2p.testing.api_traffic.USER_MIX` (what OpenAI-API clients send) and run through
  the real local API and user client code (:func:`~ps_p2p.testing.api_traffic.api_asks`,
  :func:`~ps_p2p.testing.api_traffic.query_of_ask`); prompts from ../shared/data (ShareGPT
  first turns, ToolBench queries, HumanEval/MBPP/CodeContests): a users' 40% of each set,
  their union each prompt once, a chat's earlier exchange from the same set;
* challenges: built by the verifier's own code. With today's service (``overlay_ask`` taking a
  sampling option): the plan's pool prompt at the genesis menu's parameters, all sent when the
  epoch starts (8 at a time, the node's slot drawn among the challenged nodes). With
  :mod:`ps_p2p.verification.challenges` present: the request that module derives from the
  plan (shape, parameters and send time), sent through ``overlay_ask`` as the service does;
* the attacker knows MT-Bench and a public 20% of each data set. ``--pool`` picks the
  committee's pool: ``generated`` (``ps-node testnet --challenge-pool generate``: stories260K
  samples), ``public`` (MT-Bench + the public 20%), ``private`` (the other 40% of the same
  sets: the committee's unpublished prompts, shaped like users').

Prints the cross-validated accuracy (stratified 5 folds x ``--seeds`` seeds) of a gradient
boosting classifier and of a depth-8 tree on a balanced set (as many user requests, drawn at
random, as challenges), mean and spread, and the features the tree uses most::

    python benchmarks/bench_challenge_privacy.py --pool generated     # today's testnet
    python benchmarks/bench_challenge_privacy.py --pool private

Needs scikit-learn for the boosting model (``pip install -e .[bench]``); without it only the
small tree of :mod:`~ps_p2p.testing.challenge_classifier` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import pathlib
import random
import statistics
import sys
import time

import trio

REPO = pathlib.Path(__file__).resolve().parents[1]
if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(REPO))

from ps_p2p.errors import PsError
from ps_p2p.prompts import load_prompts
from ps_p2p.testing.api_traffic import (
    SHIFTED_MIX,
    USER_MIX,
    Conversation,
    RecordingUser,
    api_asks,
    poisson_times,
    query_of_ask,
    user_body,
)
from ps_p2p.testing.challenge_classifier import (
    FEATURES,
    GROUPS,
    ChainView,
    PublicIndex,
    RequestView,
    columns,
    cross_validate,
    features,
    importances,
)
from ps_p2p.verification import epochs, service
from ps_p2p.verification.ledger import SamplingOption

try:
    from ps_p2p.verification import challenges as challenge_shapes
except ImportError:  # today's code: challenges are the pool prompt at a menu entry
    challenge_shapes = None  # type: ignore[assignment]
try:
    from ps_p2p.verification import mix as learned_mix
except ImportError:  # before the committee learned the users' mix
    learned_mix = None  # type: ignore[assignment]
POPULATIONS = {"default": USER_MIX, "shifted": SHIFTED_MIX}

SHARED = pathlib.Path(os.environ.get("PS_SHARED_DIR", REPO.parent / "shared"))
DATA = SHARED / "data"
MODEL = SHARED / "models" / "stories260K"
SETS = {  # corpus -> files; users' prompts (and the private pool) draw from their union
    "sharegpt": ["sharegpt/ShareGPT_V3_filtered_500.json"],
    "toolbench": ["toolbench/G1_instruction.json", "toolbench/G1_category.json",
                  "toolbench/G1_tool.json", "toolbench/G2_instruction.json",
                  "toolbench/G2_category.json"],
    "code": ["code/HumanEval_for_code_generation.jsonl",
             "code/mbpp_sanitized_for_code_generation.jsonl",
             "code/CodeContests_zeroshot_for_test_case_generation.jsonl"],
}
MAX_PROMPT_CHARS = 1500
EARLIER_CHARS = 300


# ---------------------------------------------------------------------------- data


def load_parts(seed: int = 18) -> tuple[list[str], dict[str, list[list[str]]]]:
    """(public prompts, corpus -> [public part (20%), users' part (40%), private part (40%)])."""
    rng = random.Random(seed)
    public = [p.text for p in load_prompts(DATA / "mtbench" / "question.jsonl")]
    thirds: dict[str, list[list[str]]] = {}
    for name, files in SETS.items():
        texts = sorted({p.text.strip() for f in files for p in load_prompts(DATA / f)
                        if 0 < len(p.text.strip()) <= MAX_PROMPT_CHARS})
        rng.shuffle(texts)
        a, b = len(texts) // 5, 3 * len(texts) // 5
        thirds[name] = [texts[:a], texts[a:b], texts[b:]]
        public += thirds[name][0]
    return public, thirds


def conversations(thirds: dict[str, list[list[str]]], part: int, rng: random.Random,
                  count: int) -> list[Conversation]:
    """``count`` conversations from part ``part``: each prompt of the part's union once, in a
    random order, before any comes back (so corpora in proportion to their sizes); each with
    an earlier exchange from the same corpus and part."""
    union = [(name, text) for name, parts in thirds.items() for text in parts[part]]
    left: list[tuple[str, str]] = []
    out = []
    for _ in range(count):
        if not left:
            left = rng.sample(union, len(union))
        name, text = left.pop()
        a, b = rng.sample(thirds[name][part], 2)
        out.append(Conversation(text, (a[:EARLIER_CHARS], b[:EARLIER_CHARS])))
    return out


def generated_pool(size: int, seed: int) -> list[str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ps_p2p.engines.transformers_engine import TransformersEngine
    from ps_p2p.prompts import generate_prompts

    engine = TransformersEngine.load(MODEL)
    key = hashlib.sha256(b"bench pool %d" % seed).digest()
    return [p.text for p in trio.run(generate_prompts, engine, size, key)]


# ---------------------------------------------------------------------------- challenges


def challenge_asks(plan: epochs.Plan, node: bytes, pool: list[str], menu, rng: random.Random,
                   *, epoch: int, epoch_s: float, seed: bytes,
                   mix=None) -> list[tuple[float, dict]]:
    """(send time in the epoch, the ``ask`` call) of each of ``node``'s challenges, as the
    verifier's service makes them."""
    user = RecordingUser()
    out = []
    for c in plan.for_node(node):
        if challenge_shapes is not None:
            # the leader's request and send time (service.EpochService._lead; a deployment's
            # attempt_ms >= epoch_ms + timeout + margin spreads them over the whole epoch)
            req = challenge_shapes.derive_request(seed, epoch, 0, c, pool[c.prompt_index],
                                                  mix or challenge_shapes.DEFAULT_MIX)
            ask = service.overlay_ask(user, "stories260K")
            trio.run(ask, req, node, 60.0)
            at = challenge_shapes.send_times([req.send_fraction], epoch_s)[0]
            out.append((at + rng.uniform(0.05, 0.5), user.asks[-1]))
        else:
            option = menu[c.sampling]
            ask = service.overlay_ask(user, "stories260K")
            trio.run(ask, pool[c.prompt_index], node, option, 60.0)
            # the leader starts on the epoch's first block, 8 challenges at a time, each
            # answered in 1-4 s; the node's slot among the challenged nodes is random
            slot = plan.model_nodes.index(node)
            wave = slot // service.MAX_PARALLEL_CHALLENGES
            at = rng.uniform(0.1, 0.5) + sum(rng.uniform(1.0, 4.0) for _ in range(wave))
            out.append((at, user.asks[-1]))
    return out


# ---------------------------------------------------------------------------- the mix


class MixLearning:
    """The committee learning its users' mix (:mod:`ps_p2p.verification.mix`): ``verifiers``
    verifiers of power 1, each with its own local API whose users draw from ``population``;
    once per epoch each publishes its window of ``per_window`` requests (noised, suppressed
    below k) and the committee aggregates them into the committed mix, as the ledger does at
    each epoch's end (:func:`~ps_p2p.verification.ledger.update_mix`).

    The users' requests are run once through the real local API (:func:`api_asks`, 4,000
    bodies); each window samples its requests from those (with replacement).
    """

    def __init__(self, population, rng: random.Random, *, verifiers: int, per_window: int):
        bodies = [user_body(rng, Conversation("q", ("a", "b")), mix=population)
                  for _ in range(4000)]
        self.shapes = [learned_mix.RequestShape.of_ask(
            a["prompt"], a.get("messages", ()), stream=a["streamed"],
            **{k: a.get(k) for k in ("max_tokens", "temperature", "top_p", "seed", "stop")})
            for asks in api_asks(bodies) for a in asks]
        self.recorders = [learned_mix.ShapeRecorder() for _ in range(verifiers)]
        self.per_window = per_window
        self.rng = rng
        self.committed = None
        self.reports = 0

    def epoch(self) -> None:
        reports = []
        for rec in self.recorders:
            for shape in self.rng.choices(self.shapes, k=self.per_window):
                rec.record(shape)
            h = rec.take(self.rng)
            if h is not None:
                reports.append((1, h))
        self.reports += len(reports)
        self.committed = learned_mix.aggregate(self.committed, reports, len(self.recorders))

    def mix(self):
        return learned_mix.mix_of(self.committed)

    def distance(self, histogram=None) -> float:
        """Half the L1 distance between ``histogram`` (default: the committed mix) and the
        users' own (their histogram, no noise), averaged over the dimensions: 0 = equal,
        1 = disjoint."""
        rec = learned_mix.ShapeRecorder(k=0, epsilon=math.inf, min_requests=1)
        for shape in self.shapes:
            rec.record(shape)
        truth = rec.take(self.rng)
        got = histogram or self.committed or learned_mix.DEFAULT_HISTOGRAM
        return statistics.mean(sum(abs(a - b) for a, b in zip(x, y)) / 2 / learned_mix.SCALE
                               for x, y in zip(got.shares, truth.shares) if sum(y))


# ---------------------------------------------------------------------------- the run


def learning_curve(args: argparse.Namespace) -> None:
    """How fast the committed mix approaches the users' (no classifier): the distance every 5
    epochs over ``--warmup-epochs``, for windows of ``--min-requests`` and suppression ``--k``."""
    learning = MixLearning(POPULATIONS[args.users], random.Random(args.seed + 3),
                           verifiers=args.verifiers, per_window=args.verifier_requests)
    learning.recorders = [learned_mix.ShapeRecorder(k=args.k, min_requests=args.min_requests)
                          for _ in learning.recorders]
    distances = []
    for _ in range(args.warmup_epochs):
        learning.epoch()
        distances.append(learning.distance())
    print(f"users {args.users}, {args.verifiers} verifiers x {args.verifier_requests} requests "
          f"per epoch, k {args.k}, windows of >= {args.min_requests}: DEFAULT_MIX "
          f"{learning.distance(learned_mix.DEFAULT_HISTOGRAM):.3f}, every 5 epochs "
          + " ".join(f"{d:.3f}" for d in distances[4::5]))


def run(args: argparse.Namespace) -> None:
    started = time.time()
    rng = random.Random(args.seed)
    public, thirds = load_parts()
    if args.pool == "generated":
        pool = generated_pool(args.pool_size, args.seed)
    elif args.pool == "public":
        pool = list(public)
    else:  # the committee's unpublished prompts, shaped like users' (each used once)
        size = min(args.pool_size, sum(len(t[2]) for t in thirds.values()))
        items = conversations(thirds, 2, rng, size)
        if challenge_shapes is not None:  # entries carry an earlier exchange for chats
            pool = [challenge_shapes.encode_entry(c.prompt, c.earlier) for c in items]
        else:
            pool = [c.prompt for c in items]
        pool = list(dict.fromkeys(pool))
    menu = (SamplingOption(),)  # the testnet's genesis menu
    population = POPULATIONS[args.users]
    learning = None
    if args.mix == "learned":
        if learned_mix is None:
            raise SystemExit("--mix learned needs ps_p2p.verification.mix")
        learning = MixLearning(population, random.Random(args.seed + 3),
                               verifiers=args.verifiers, per_window=args.verifier_requests)
        for _ in range(args.warmup_epochs):
            learning.epoch()
        print(f"mix learned over {args.warmup_epochs} epochs before the first measured one: "
              f"{learning.reports} reports, distance to the users' mix "
              f"{learning.distance():.3f} (DEFAULT_MIX: "
              f"{learning.distance(learned_mix.DEFAULT_HISTOGRAM):.3f})")
    nodes = [b"\x00\x24" + hashlib.sha256(b"n%d" % i).digest() + bytes(4)
             for i in range(args.nodes)]
    attacked = nodes[0]
    per_node = args.challenges_per_node
    chain = ChainView(menu=tuple((o.max_tokens, o.temperature, o.top_p) for o in menu),
                      epoch_s=args.epoch_s)
    index = PublicIndex(public)
    users = conversations(thirds, 1, rng, int(args.epochs * args.user_rate * args.epoch_s * 2)
                          + 100)
    user_iter = iter(users)
    used: set[int] = set()
    traffic: list[tuple[int, float, dict, int]] = []  # (epoch, time, ask, label)
    for e in range(args.epochs):
        seed = rng.randbytes(32)
        available = len(pool) - len(used)
        if available < len(nodes) * per_node:
            used.clear()  # the pool is exhausted: prompts come back
        plan = epochs.derive_plan(seed, nodes, len(pool), per_node, exclude=used,
                                  sampling_options=len(menu))
        used |= {c.prompt_index for c in plan.challenges}
        for at, ask in challenge_asks(plan, attacked, pool, menu, rng, epoch=e,
                                      epoch_s=args.epoch_s, seed=seed,
                                      mix=learning.mix() if learning else None):
            traffic.append((e, at, ask, 1))
        if learning is not None:  # the committee keeps learning, one step per epoch
            learning.epoch()
        times = poisson_times(rng, args.user_rate, args.epoch_s)
        bodies = [user_body(rng, next(user_iter), mix=population) for _ in times]
        for at, asks in zip(times, api_asks(bodies)):
            for ask in asks:  # n > 1: n requests at once
                traffic.append((e, at, ask, 0))
    traffic.sort(key=lambda t: (t[0], t[1]))
    vectors: list[list[float]] = []
    labels: list[int] = []
    last_epoch, last_at, count = -1, 0.0, 0
    qrng = random.Random(args.seed + 1)
    for e, at, ask, label in traffic:
        try:
            query, raw = query_of_ask(ask, qrng)
        except (PsError, ValueError):  # too long for a cell: the client refuses it, for both
            continue
        if e != last_epoch:
            since = float("inf") if e == 0 else at + args.epoch_s - last_at
            last_epoch, count = e, 0
        else:
            since = at - last_at
        view = RequestView(query, len(raw), at, since, count)
        vectors.append(features(view, chain, index))
        labels.append(label)
        chain.seen.add(query.prompt or (query.messages[-1].content if query.messages else ""))
        last_at, count = at, count + 1
    pos = [i for i, y in enumerate(labels) if y == 1]
    neg = [i for i, y in enumerate(labels) if y == 0]
    brng = random.Random(args.seed + 2)
    neg = brng.sample(neg, min(len(neg), len(pos)))
    pos = pos[:len(neg)]
    chosen = sorted(pos + neg)
    x = [vectors[i] for i in chosen]
    y = [labels[i] for i in chosen]
    code = ("challenges derived by ps_p2p.verification.challenges" if challenge_shapes
            else "today's challenges (pool prompt at the menu's parameters, at the epoch start)")
    print(f"code: {code}")
    print(f"pool: {args.pool} ({len(pool)} prompts); {args.epochs} epochs of {args.epoch_s:.0f} s,"
          f" {args.nodes} nodes, {per_node} challenge(s) per node; users {args.user_rate}/s")
    print(f"users: {args.users} population; challenges' mix: "
          + ("DEFAULT_MIX (constant)" if learning is None else
             f"learned by {args.verifiers} verifiers ({args.verifier_requests} requests per "
             f"window), distance to the users' at the end {learning.distance():.3f}"))
    print(f"balanced set: {len(pos)} challenges + {len(neg)} user requests "
          f"({len(FEATURES)} features)")
    views = [("everything", tuple(GROUPS))] + [(g, (g,)) for g in GROUPS] + [
        ("fields+content", ("fields", "content"))]
    if args.views:
        views = [v for v in views if v[0] in args.views.split(",")]
    for label, groups in views:
        cols = columns(x, groups)
        for kind in args.models.split(","):
            accs = []
            for s in range(args.seeds):
                accs += cross_validate(cols, y, folds=5, seed=s, kind=kind)
            spread = statistics.pstdev(accs)
            print(f"  {label:15s} {kind:9s} accuracy {statistics.mean(accs):.3f} +- "
                  f"{spread:.3f} (min {min(accs):.3f}, max {max(accs):.3f}; {len(accs)} folds)")
    top = importances(x, y)[:8]
    if top:
        print("  tree's top features: " + ", ".join(f"{n} {v:.2f}" for n, v in top))
    print(f"  ({time.time() - started:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", choices=["generated", "public", "private"], default="private")
    p.add_argument("--pool-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--epoch-s", type=float, default=300.0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--challenges-per-node", type=int, default=None,
                   help="default: 1 for today's code, 4 with the challenges module")
    p.add_argument("--user-rate", type=float, default=0.025, help="requests/s to the node")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--models", default="boosting,tree")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--views", default="",
                   help="comma-separated feature views to cross-validate (default: all), e.g. "
                        "everything,fields")
    p.add_argument("--users", choices=sorted(POPULATIONS), default="default",
                   help="the users' population: USER_MIX, or SHIFTED_MIX (differs from "
                        "DEFAULT_MIX in every field)")
    p.add_argument("--mix", choices=["constant", "learned"], default="constant",
                   help="challenges from DEFAULT_MIX, or from the mix the committee learns from "
                        "its verifiers' MIX_REPORTs")
    p.add_argument("--verifiers", type=int, default=4)
    p.add_argument("--verifier-requests", type=int, default=600,
                   help="requests each verifier's API sees per epoch")
    p.add_argument("--warmup-epochs", type=int, default=30,
                   help="epochs of learning before the first measured one (--mix learned)")
    p.add_argument("--learning-curve", action="store_true",
                   help="only print how fast the learned mix approaches the users'")
    p.add_argument("--k", type=int, default=learned_mix.DEFAULT_K if learned_mix else 30)
    p.add_argument("--min-requests", type=int,
                   default=learned_mix.MIN_REQUESTS if learned_mix else 1000)
    args = p.parse_args(argv)
    if args.learning_curve:
        learning_curve(args)
        return 0
    if args.challenges_per_node is None:
        args.challenges_per_node = 4 if challenge_shapes is not None else 1
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
