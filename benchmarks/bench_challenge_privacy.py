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

Senders: every request comes from a client whose paths' proxies the node sees in Q
(:class:`Clients`: ``--clients`` users and ``--verifiers`` verifiers, 5 paths each, proxies
among ``--relays`` relays, rebuilt every 15 minutes); the leader's paths rotate as the service
rotates them (:class:`~ps_p2p.verification.service.ChallengePaths`; ``--leader-paths shared``:
one generation per epoch, as before that fix). ``--users sessions``: users chat in sessions
(:func:`session_requests`; the pool then holds every turn of private conversations,
:func:`session_pool`). ``--lm`` adds the prompt's tokens and NLL under stories260K.

Prints the cross-validated accuracy (``--folds shuffled``: stratified 5 folds x ``--seeds``
seeds; ``--folds epochs``: 5 contiguous runs of epochs) of a gradient boosting classifier and
of a depth-8 tree on a balanced set (as many user requests, drawn at random, as challenges),
mean and spread, each feature's AUC alone (best first), and the features the tree uses
most::

    python benchmarks/bench_challenge_privacy.py --pool generated     # today's testnet
    python benchmarks/bench_challenge_privacy.py --pool private
    python benchmarks/bench_challenge_privacy.py --users sessions --mix learned --lm

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
from ps_p2p.overlay.path_pool import PoolConfig
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
    LINK_PROXIES,
    ChainView,
    PublicIndex,
    RequestView,
    columns,
    cross_validate,
    features,
    importances,
    univariate_scan,
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
POPULATIONS = {"default": USER_MIX, "shifted": SHIFTED_MIX, "sessions": USER_MIX}
POOL = PoolConfig()

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


# ---------------------------------------------------------------------------- clients


class Clients:
    """Who sends each request, as the model node sees it: the proxies of the sender's paths.

    Each client (``verifiers`` verifiers' user roles first, then ``users`` users) keeps
    :class:`~ps_p2p.overlay.path_pool.PoolConfig`'s ``paths`` paths, each ending at a proxy
    drawn among ``relays`` relays, and rebuilds them every ``rotate_period`` (15 min), each
    client at its own phase; a request goes over ``total`` (4) of them with distinct proxies
    (the real request core picks them, :func:`~ps_p2p.testing.api_traffic.query_of_ask`).
    """

    def __init__(self, seed: int, *, relays: int, verifiers: int, users: int) -> None:
        rng = random.Random(seed)
        self.seed = seed
        self.relays = [b"\x00\x24" + rng.randbytes(36) for _ in range(relays)]
        self.verifiers = verifiers
        self.users = users
        self.phase = [rng.uniform(0, POOL.rotate_period) for _ in range(verifiers + users)]

    def proxies(self, client: int | tuple[int, int], t: float) -> list[bytes]:
        """The proxies of ``client``'s paths at time ``t`` (s); a verifier's client is
        (verifier, rotations its service made: :class:`~ps_p2p.verification.service.
        ChallengePaths`), its paths also rotating every 15 minutes as anyone's."""
        client, made = client if isinstance(client, tuple) else (client, 0)
        generation = int((t + self.phase[client]) // POOL.rotate_period)
        rng = random.Random(f"{self.seed}/{client}/{made}/{generation}")
        return [rng.choice(self.relays) for _ in range(POOL.paths)]

    def user(self, rng: random.Random) -> int:
        return self.verifiers + rng.randrange(self.users)


def _fresh(thirds: dict[str, list[list[str]]], part: int, rng: random.Random):
    """``name -> a prompt of that corpus's part``: each once, in a random order, before any
    comes back."""
    left: dict[str, list[str]] = {}

    def draw(name: str) -> str:
        if not left.get(name):
            left[name] = rng.sample(thirds[name][part], len(thirds[name][part]))
        return left[name].pop()

    return draw


def session_requests(thirds: dict[str, list[list[str]]], part: int, rng: random.Random, *,
                     start: float, length: float, rate: float, nodes: int, mean_turns: float,
                     gap_s: float, population) -> list[tuple[float, tuple[str, dict], int]]:
    """Users in chat sessions (``--users sessions``): (time, (path, body), session) of each
    request that reaches the attacked node in [start, start + length).

    Sessions start as a Poisson process (rate ``rate x nodes / mean_turns``, so the node gets
    ``rate`` requests per second); a session has a geometric number of turns (mean
    ``mean_turns``), exponential gaps (mean ``gap_s``), one client app's shape for all its turns
    (one :func:`user_body` draw), each turn sent to a random one of ``nodes`` model nodes and
    carrying the whole conversation so far (prompts of one corpus and part; each earlier answer
    a stand-in text of the same corpus). A completion session has one turn.
    """
    out = []
    fresh = _fresh(thirds, part, rng)
    for t0 in poisson_times(rng, rate * nodes / mean_turns, length):
        name = rng.choices(list(thirds), weights=[len(v[part]) for v in thirds.values()])[0]
        texts = thirds[name][part]
        turns = 1
        while rng.random() > 1 / mean_turns:
            turns += 1
        shape_seed = rng.random()
        history: list[dict] = []
        at = start + t0
        sid = rng.randrange(2**62)
        for k in range(turns):
            mine = rng.randrange(nodes) == 0
            # the node's own requests each prompt once (a small data set must not make users
            # repeat themselves); turns elsewhere reach it only as history
            prompt = fresh(name) if mine else rng.choice(texts)
            path, body = user_body(random.Random(shape_seed), Conversation(prompt),
                                   mix=population)
            if "messages" in body:
                system = [m for m in body["messages"] if m["role"] == "system"]
                body["messages"] = system + history + [{"role": "user", "content": prompt}]
            if at < start + length and mine:
                out.append((at, (path, body), sid))
            if "messages" not in body:
                break
            history += [{"role": "user", "content": prompt[:EARLIER_CHARS]},
                        {"role": "assistant", "content": rng.choice(texts)[:EARLIER_CHARS]}]
            at += rng.expovariate(1 / gap_s)
    return out


def session_pool(thirds: dict[str, list[list[str]]], rng: random.Random, size: int,
                 mean_turns: float) -> list[str]:
    """The committee's private pool when its users chat in sessions: every turn of private
    conversations made as :func:`session_requests` makes users' (so entries have the users'
    depths), each with its whole earlier history when :func:`~ps_p2p.verification.challenges.
    encode_entry` takes one, else its last exchange."""
    out: list[str] = []
    fresh = _fresh(thirds, 2, rng)
    while len(out) < size:
        name = rng.choices(list(thirds), weights=[len(v[2]) for v in thirds.values()])[0]
        texts = thirds[name][2]
        turns = 1
        while rng.random() > 1 / mean_turns:
            turns += 1
        history: list[str] = []
        for _ in range(turns):
            prompt = fresh(name)
            if not history:
                out.append(challenge_shapes.encode_entry(prompt))
            else:
                try:
                    out.append(challenge_shapes.encode_entry(prompt, history))
                except ValueError:  # entries of one earlier exchange only
                    out.append(challenge_shapes.encode_entry(prompt, history[-2:]))
            history += [prompt[:EARLIER_CHARS], rng.choice(texts)[:EARLIER_CHARS]]
    return list(dict.fromkeys(out))[:size]


def model_lm():
    """(tokens, mean NLL in nats) of a text under stories260K, cached: the node's own model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    cache: dict[str, tuple[int, float]] = {}

    def lm(text: str) -> tuple[int, float]:
        if text not in cache:
            ids = tok(text, return_tensors="pt").input_ids[:, :256]
            if ids.shape[1] < 2:
                cache[text] = (int(ids.shape[1]), 0.0)
            else:
                with torch.no_grad():
                    loss = model(ids, labels=ids).loss
                cache[text] = (len(tok(text).input_ids), float(loss))
        return cache[text]

    return lm


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


def leader_paths(plan: epochs.Plan, pool: list[str], tracker, node: bytes, *, seed: bytes,
                 epoch: int, mix, rotate: bool) -> list[int]:
    """The generation of the leader's paths (``tracker.generation``) that carries each of
    ``node``'s challenges, in send order, as the service rotates them: before a challenge to
    a node the paths already carried one to (``rotate``; the service since issue 18's proxy
    fix) and after the report (always)."""
    order = sorted(plan.challenges, key=lambda c: challenge_shapes.derive_request(
        seed, epoch, 0, c, pool[c.prompt_index], mix or challenge_shapes.DEFAULT_MIX)
        .send_fraction)
    out = []
    for c in order:
        if rotate:
            tracker.before(c.model_node)
        if c.model_node == node:
            out.append(tracker.generation)
    tracker.rotated()  # after the report
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

    def __init__(self, population, rng: random.Random, *, verifiers: int, per_window: int,
                 bodies: list[tuple[str, dict]] | None = None):
        bodies = bodies or [user_body(rng, Conversation("q", ("a", "b")), mix=population)
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
    elif args.users == "sessions":  # every turn of private conversations, like users'
        pool = session_pool(thirds, rng, args.pool_size, args.mean_turns)
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
        bodies = None
        if args.users == "sessions":  # the verifiers' API users chat in sessions too
            lrng = random.Random(args.seed + 4)
            bodies = [b for _, b, _ in session_requests(
                thirds, 1, lrng, start=0.0, length=4000 / args.user_rate, rate=args.user_rate,
                nodes=1, mean_turns=args.mean_turns, gap_s=args.turn_gap_s,
                population=population)][:4000]
        learning = MixLearning(population, random.Random(args.seed + 3),
                               verifiers=args.verifiers, per_window=args.verifier_requests,
                               bodies=bodies)
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
    clients = Clients(args.seed + 5, relays=args.relays, verifiers=args.verifiers,
                      users=args.clients)
    crng = random.Random(args.seed + 6)
    trackers = [service.ChallengePaths() for _ in range(args.verifiers)]
    mixes: list = []
    session_client: dict[int, int] = {}
    # (epoch, time, ask, label, client)
    traffic: list[tuple[int, float, dict, int, int]] = []
    for e in range(args.epochs):
        leader = crng.randrange(args.verifiers)
        seed = rng.randbytes(32)
        available = len(pool) - len(used)
        if available < len(nodes) * per_node:
            used.clear()  # the pool is exhausted: prompts come back
        plan = epochs.derive_plan(seed, nodes, len(pool), per_node, exclude=used,
                                  sampling_options=len(menu))
        used |= {c.prompt_index for c in plan.challenges}
        mix_now = learning.mix() if learning else challenge_shapes.DEFAULT_MIX
        if hasattr(challenge_shapes, "for_pool"):  # as the service: the pool's history share
            mix_now = challenge_shapes.for_pool(mix_now, challenge_shapes.history_share(pool))
        made = leader_paths(plan, pool, trackers[leader], attacked, seed=seed, epoch=e,
                            mix=mix_now, rotate=args.leader_paths == "rotate")
        for (at, ask), gen in zip(sorted(challenge_asks(plan, attacked, pool, menu, rng, epoch=e,
                                                        epoch_s=args.epoch_s, seed=seed,
                                                        mix=mix_now),
                                         key=lambda a: a[0]), made):
            traffic.append((e, at, ask, 1, (leader, gen)))
        # the committed mix this epoch's challenges were drawn from: public in the ledger
        mixes.append(learning.committed if learning and learning.committed
                     else learned_mix.DEFAULT_HISTOGRAM if learned_mix else None)
        if learning is not None:  # the committee keeps learning, one step per epoch
            learning.epoch()
        if args.users == "sessions":
            if e == 0:
                every = session_requests(thirds, 1, rng, start=0.0,
                                         length=args.epochs * args.epoch_s, rate=args.user_rate,
                                         nodes=args.nodes, mean_turns=args.mean_turns,
                                         gap_s=args.turn_gap_s, population=population)
            reqs = [r for r in every if int(r[0] // args.epoch_s) == e]
            times = [t - e * args.epoch_s for t, _, _ in reqs]
            bodies = [b for _, b, _ in reqs]
            senders = [session_client.setdefault(sid, clients.user(crng)) for _, _, sid in reqs]
        else:
            times = poisson_times(rng, args.user_rate, args.epoch_s)
            bodies = [user_body(rng, next(user_iter), mix=population) for _ in times]
            senders = [clients.user(crng) for _ in times]
        for at, asks, who in zip(times, api_asks(bodies), senders):
            for ask in asks:  # n > 1: n requests at once
                traffic.append((e, at, ask, 0, who))
    # sessions started in an earlier epoch may have turns here: order by time overall
    traffic.sort(key=lambda t: (t[0], t[1]))
    lm = model_lm() if args.lm else None
    vectors: list[list[float]] = []
    labels: list[int] = []
    epochs_of: list[int] = []
    last_epoch, last_at, count = -1, 0.0, 0
    qrng = random.Random(args.seed + 1)
    past: list[tuple[int, frozenset[bytes], int]] = []  # (epoch, proxies, label) at the node
    known_challenge_proxies: list[frozenset[bytes]] = []
    for e, at, ask, label, who in traffic:
        try:
            query, raw = query_of_ask(ask, qrng, proxies=clients.proxies(
                who, e * args.epoch_s + at))
        except (PsError, ValueError):  # too long for a cell: the client refuses it, for both
            continue
        while past and past[0][0] < e:  # reports of earlier epochs: their labels are public
            _, proxies, was = past.pop(0)
            if was:
                known_challenge_proxies.append(proxies)
        chain.mix = mixes[e]
        mine = frozenset(p.peer_id for p in query.reply_proxies)
        linked_epoch = sum(len(mine & p) >= LINK_PROXIES for _, p, _ in past)
        linked_challenge = any(len(mine & p) >= LINK_PROXIES for p in known_challenge_proxies)
        if e != last_epoch:
            since = float("inf") if e == 0 else at + args.epoch_s - last_at
            last_epoch, count = e, 0
        else:
            since = at - last_at
        view = RequestView(query, len(raw), at, since, count, linked_epoch, linked_challenge)
        vectors.append(features(view, chain, index, lm))
        labels.append(label)
        epochs_of.append(e)
        past.append((e, mine, label))
        text = query.prompt or (query.messages[-1].content if query.messages else "")
        # the node remembers what it was asked; history carries the first EARLIER_CHARS of a
        # turn (a real node would match the whole turn), so it remembers that prefix too
        chain.seen |= {text, text[:EARLIER_CHARS]}
        last_at, count = at, count + 1
    pos = [i for i, y in enumerate(labels) if y == 1]
    neg = [i for i, y in enumerate(labels) if y == 0]
    brng = random.Random(args.seed + 2)
    neg = brng.sample(neg, min(len(neg), len(pos)))
    pos = pos[:len(neg)]
    chosen = sorted(pos + neg)
    x = [vectors[i] for i in chosen]
    y = [labels[i] for i in chosen]
    blocks = [epochs_of[i] for i in chosen] if args.folds == "epochs" else None
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
          f"({len(FEATURES)} features; folds {args.folds})")
    views = [("everything", tuple(GROUPS))] + [(g, (g,)) for g in GROUPS] + [
        ("fields+content", ("fields", "content"))]
    if args.views:
        views = [v for v in views if v[0] in args.views.split(",")]
    for label, groups in views:
        cols = columns(x, groups)
        for kind in args.models.split(","):
            accs = []
            for s in range(args.seeds):
                accs += cross_validate(cols, y, folds=5, seed=s, kind=kind, blocks=blocks)
            spread = statistics.pstdev(accs)
            print(f"  {label:15s} {kind:9s} accuracy {statistics.mean(accs):.3f} +- "
                  f"{spread:.3f} (min {min(accs):.3f}, max {max(accs):.3f}; {len(accs)} folds)")
    if args.dump:  # the balanced set, for other classifiers
        import json

        pathlib.Path(args.dump).write_text(json.dumps({"features": FEATURES, "x": x, "y": y}))
    scan = univariate_scan(x, y)[:10]
    print("  single features (AUC): " + ", ".join(f"{n} {a:.3f}" for n, a in scan))
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
    p.add_argument("--verifiers", type=int, default=4,
                   help="verifiers: the mix's reporters and the leaders' clients")
    p.add_argument("--clients", type=int, default=200,
                   help="users' clients (each with its own paths) whose requests reach the node")
    p.add_argument("--relays", type=int, default=50, help="relays that proxies are drawn from")
    p.add_argument("--mean-turns", type=float, default=3.0,
                   help="--users sessions: mean turns of a chat session")
    p.add_argument("--turn-gap-s", type=float, default=60.0,
                   help="--users sessions: mean seconds between a session's turns")
    p.add_argument("--leader-paths", choices=["rotate", "shared"], default="rotate",
                   help="rotate: the leader's paths rotate before a second challenge to one "
                        "node (the service); shared: one generation for the whole epoch (before "
                        "the fix)")
    p.add_argument("--folds", choices=["shuffled", "epochs"], default="shuffled",
                   help="shuffled: stratified folds; epochs: 5 contiguous runs of epochs (no "
                        "fold trains on the epochs it tests, as a node labelled after each "
                        "epoch)")
    p.add_argument("--dump", default="", help="write the balanced set's vectors (JSON) here")
    p.add_argument("--lm", action="store_true",
                   help="also the prompt's tokens and mean NLL under stories260K (the node's "
                        "model)")
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
