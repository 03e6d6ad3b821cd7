"""The verification experiment (PlanetServe sec. 5, figs. 10-11; issue 18): honest and
dishonest model nodes under challenge epochs, on the real TinyStories model, in one command.

    python benchmarks/bench_reputation.py                        # 100 epochs, every adversary
    python benchmarks/bench_reputation.py --epochs 20 --plot ''   # a quick look
    python benchmarks/bench_reputation.py --localnet             # the network run (below)
    python benchmarks/bench_reputation.py --epochs 0              # the honest simulation alone

Default: the scoring simulation. The pure cores of an epoch without the network: every model
node answers ``--challenges`` challenges per epoch with its engine (a prompt of the pool, the
sampling parameters drawn from the user-traffic menu ``MENU``: greedy 45%, temperatures 0.1 to
2, top_p 0.9/0.95/1), the verifier scores each answer with
:func:`~ps_p2p.verification.scoring.score_challenge` (decoy prompts drawn from the pool as the
service does), the epoch's C per node is the ledger's (:func:`~ps_p2p.verification.ledger.
subject_scores`: the mean, capped by the lowest greedy score and by any answer scored 0; a
forwarded challenge counts for the forwarder), and the reputation rule of :mod:`ps_p2p.verification.reputation` runs on it.
The model nodes (``KINDS``):

* ``honest-i``: the model itself;
* ``noise5``: every weight plus N(0, 0.05 x the tensor's std)
  (:func:`~ps_p2p.testing.dishonest.degraded_copy`);
* ``int4``: every matrix rounded to 4 bits per group of 32 (:func:`~ps_p2p.testing.dishonest.
  quantized_copy`);
* ``substitute``: a 3-layer, 32-wide Llama (67K parameters) distilled from the model on the
  shared text (:mod:`ps_p2p.testing.substitute`; trained once, cached in the temp folder);
* ``fixed``: one story for every prompt; ``fixed-best``: the candidate answer that scored best
  on public prompts (the attacker's own tuning with the verifier's scorer);
* ``other-prompt``: the model's answer to the previous request's prompt;
* ``nearest``: the model's cached answer to the most similar public prompt;
* ``cut-stop`` / ``cut-length``: answers cut to a quarter, signed "stop" / "length";
* ``hotter``: the model at 1.5 x the asked temperature (0.5 when greedy is asked);
* ``selective``: the model on requests its detector takes for challenges, the substitute on
  the rest; ``forwarder``: forwards what its detector takes for challenges to an honest peer
  and answers the rest with the fixed story. The detector is the project's own best:
  :mod:`ps_p2p.testing.challenge_classifier` (gradient boosting with scikit-learn, its small
  tree without), trained as ``bench_challenge_privacy.py`` trains it on ``--detector-epochs``
  epochs of users' API traffic and challenges derived by :mod:`ps_p2p.verification.challenges`
  (``--challenges`` per node), then its verdicts on the challenges of later epochs decide, in
  order, which simulated challenges these two nodes answer honestly (its held-out accuracy is
  printed).
* ``trust-aware``: honest only while untrusted (:class:`~ps_p2p.testing.dishonest.
  TrustAwareEngine`): the model on every request while its reputation is below the threshold,
  the substitute on every request while it is trusted. It needs no classifier: its reputation
  is public. Users hedge a share of their requests to untrusted nodes
  (``UserConfig.probation_share``), so its requests while untrusted are not all challenges,
  but its rule does not look at requests: only the reputation rule's probation
  (:mod:`ps_p2p.verification.reputation`) decides how often it is trusted.

Cost: every node gets the same challenges in an epoch; before the nodes answer, the answers
their models will be asked for are made in batches (:meth:`~ps_p2p.engines.
transformers_engine.TransformersEngine.complete_batch`, the same answers as one at a time;
greedy ones are kept across epochs), and the epoch's distinct answers are scored together
(:func:`~ps_p2p.verification.scoring.challenge_stats_many`: one batched ``logprob_rows``,
the same scores as one at a time).

Reported: per node the epochs until untrusted (R < 0.4; goal <= 3 scored epochs) and the share
of later epochs it stayed untrusted (goal >= 95%), its mean challenge score; the CPU time per
scored challenge. ``--honest-epochs`` (default 1000) then simulates honest nodes for that many
epochs by drawing from a bank of honest scores measured for every (temperature, top_p) of the
menu (``--bank`` answers each): no honest node may be untrusted, for the menu's mix and for a
menu of each single temperature.

``--localnet``: the network run of issue 9 (a localnet with a committee of 4 verifiers running
the challenge epochs of :mod:`ps_p2p.verification.service`, 3 honest nodes, a 10%-noise copy, a
truncating node and a T = 2 node; each epoch ends when its leader's report commits).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from ps_p2p.verification.reputation import DEFAULT_REPUTATION

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


def scored_untrusted(directory, peer_id: bytes) -> bool:  # type: ignore[no-untyped-def]
    """Whether the user's ``directory`` had ``peer_id`` untrusted: scored by the committee
    with a reputation below the threshold. A provisional node (never scored yet, which users
    may use while their model has no proven node) is not untrusted."""
    return not directory.trusted(peer_id) and not directory.provisional(peer_id)


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
          f"challenges shaped by challenges.DEFAULT_MIX (users' shapes and parameters; the "
          f"menu, greedy {args.max_tokens} tokens, only draws the plan); {args.epochs} epochs")
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
                    if directory is not None and scored_untrusted(directory, answer.served_by):
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


# ------------------------------------------------------------------------ scoring simulation

#: The challenge menu: (temperature, weight) and (top_p, weight) of a user-traffic model
#: (issue 18's OpenAI-client mix: temperature left out, so the API's 0, or 0 in 45% of
#: requests, 0.7 in 22%, rarely above 1, up to 2; top_p left out in 90%).
MENU_T = ((0.0, 0.45), (0.1, 0.03), (0.2, 0.04), (0.5, 0.05), (0.7, 0.22), (0.8, 0.04),
          (1.0, 0.12), (1.2, 0.02), (1.5, 0.02), (2.0, 0.01))
MENU_TOP_P = ((1.0, 0.90), (0.9, 0.05), (0.95, 0.05))
#: Requests per ``complete_batch`` and answers per ``challenge_stats_many`` call.
GENERATE_BATCH = 128
SCORE_BATCH = 256
KINDS = ("noise5", "int4", "substitute", "fixed", "fixed-best", "other-prompt", "nearest",
         "cut-stop", "cut-length", "hotter", "selective", "forwarder", "trust-aware")
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the sun. One day, she saw a big")


def _draw(rng, table):  # type: ignore[no-untyped-def]
    x = rng.random() * sum(w for _, w in table)
    for value, w in table:
        x -= w
        if x < 0:
            return value
    return table[-1][0]


def _scored(pool, prompt, answer, t, top_p, max_tokens, key):  # type: ignore[no-untyped-def]
    """The keyword arguments of one answer for :func:`~ps_p2p.verification.scoring.
    challenge_stats_many`, with the decoy prompts the service draws for ``key``."""
    from ps_p2p.verification.scoring import DEFAULT_CHALLENGE_SCORING, decoy_indices

    decoys = [pool[i] for i in decoy_indices(key, len(pool), pool.index(prompt),
                                             DEFAULT_CHALLENGE_SCORING.decoys)]
    return {"prompt": prompt, "response": answer.text, "temperature": t, "top_p": top_p,
            "max_tokens": max_tokens, "finish_reason": answer.finish_reason, "decoys": decoys}


async def _challenge_scores(reference, answers):  # type: ignore[no-untyped-def]
    """C of each answer (:func:`_scored` mappings), scored together (one batched
    ``logprob_rows``; the same scores as one at a time: tests/test_challenge_scores.py)."""
    from ps_p2p.verification.scoring import challenge_credibility, challenge_stats_many

    out: list[float] = []
    for lo in range(0, len(answers), SCORE_BATCH):
        stats = await challenge_stats_many(reference, answers[lo:lo + SCORE_BATCH])
        out += [challenge_credibility(x) for x in stats]
    return out


def _memo(inner):  # type: ignore[no-untyped-def]
    """``inner`` with its answers remembered by (prompt, sampling parameters): nodes that run
    the same model on the same challenge (same seed) get the same answer without a second
    generation (the simulation asks every node the same challenges in an epoch). Greedy
    answers (which ignore seed and top_p) are kept across epochs, the others until
    ``.clear()``. ``await .prefetch(requests)`` makes the missing ones in one
    :meth:`~ps_p2p.engines.transformers_engine.TransformersEngine.complete_batch` (the same
    answers as one at a time: tests/test_engines.py)."""
    import dataclasses

    from ps_p2p.engines.base import Engine, StreamChunk

    def key_of(prompt, params):  # type: ignore[no-untyped-def]
        if params.greedy:
            params = dataclasses.replace(params, seed=None, top_p=1.0)
        return prompt, params

    class Memo(Engine):
        def __init__(self) -> None:
            self.inner, self.model_id, self.max_context = inner, inner.model_id, inner.max_context
            self.cache: dict[object, list[object]] = {}
            self.made = self.hits = 0
            self._tokens: dict[tuple[str, bool], list[int]] = {}

        def clear(self) -> None:
            self.cache = {k: v for k, v in self.cache.items() if k[1].greedy}
            if len(self._tokens) > 100_000:
                self._tokens.clear()

        async def prefetch(self, requests) -> None:  # type: ignore[no-untyped-def]
            wanted = list(dict.fromkeys(key_of(p, q) for p, q in requests))
            wanted = [k for k in wanted if k not in self.cache]
            for lo in range(0, len(wanted), GENERATE_BATCH):
                part = wanted[lo:lo + GENERATE_BATCH]
                for k, done in zip(part, await self.inner.complete_batch(part)):
                    self.cache[k] = [StreamChunk(
                        done.text, finish_reason=done.finish_reason,
                        prompt_tokens=done.prompt_tokens,
                        completion_tokens=done.completion_tokens)]
                    self.made += 1

        async def generate(self, prompt, params):  # type: ignore[no-untyped-def]
            async for chunk in self.stream(prompt, params):
                if chunk.text:
                    yield chunk.text

        async def stream(self, prompt, params):  # type: ignore[no-untyped-def]
            key = key_of(prompt, params)
            if key not in self.cache:
                self.cache[key] = [c async for c in self.inner.stream(prompt, params)]
                self.made += 1
            else:
                self.hits += 1
            for chunk in self.cache[key]:
                yield chunk

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(self.inner, name)

        async def score(self, prompt, continuation):  # type: ignore[no-untyped-def]
            return await self.inner.score(prompt, continuation)

        async def tokenize(self, text):  # type: ignore[no-untyped-def]
            if (text, True) not in self._tokens:
                self._tokens[(text, True)] = await self.inner.tokenize(text)
            return list(self._tokens[(text, True)])

        async def encode(self, text, *, add_special_tokens=True):  # type: ignore
            k = (text, add_special_tokens)
            if k not in self._tokens:
                self._tokens[k] = await self.inner.encode(
                    text, add_special_tokens=add_special_tokens)
            return list(self._tokens[k])

        async def decode(self, token_ids):  # type: ignore[no-untyped-def]
            return await self.inner.decode(token_ids)

        async def score_ids(self, token_ids, start, *, top_k=0):  # type: ignore
            return await self.inner.score_ids(token_ids, start, top_k=top_k)

        async def logprob_rows(self, sequences):  # type: ignore[no-untyped-def]
            return await self.inner.logprob_rows(sequences)

        @property
        def end_token_ids(self):  # type: ignore[no-untyped-def]
            return self.inner.end_token_ids

        async def aclose(self) -> None:
            return None

    return Memo()


def _detector_flags(args) -> tuple[list[bool], str]:  # type: ignore[no-untyped-def]
    """What a dishonest node's own best challenge detector says about the challenges it gets:
    the classifier of :mod:`ps_p2p.testing.challenge_classifier` (gradient boosting with
    scikit-learn, else its small tree), trained as ``bench_challenge_privacy.py`` trains it
    (labels from the chain's reports; every field the node decodes, arrival times, the
    chain's data, the public data sets), on ``--detector-epochs`` epochs of that benchmark's
    traffic (users' API requests and the verifiers' challenges as
    :mod:`ps_p2p.verification.challenges` derives them, ``--challenges`` per node, the
    private pool), then applied to the challenges of as many later epochs.

    Returns:
        (its verdict on each later challenge, in order: True = "a challenge, answer
        honestly"; a line describing its held-out accuracy).
    """
    import hashlib
    import random

    import bench_challenge_privacy as bcp

    from ps_p2p.errors import PsError
    from ps_p2p.testing.api_traffic import (
        api_asks,
        poisson_times,
        query_of_ask,
        user_body,
    )
    from ps_p2p.testing.challenge_classifier import (
        ChainView,
        PublicIndex,
        RequestView,
        features,
        make_model,
    )
    from ps_p2p.verification import epochs as epoch_plans
    from ps_p2p.verification.ledger import SamplingOption

    rng = random.Random(args.seed + 18)
    public, thirds = bcp.load_parts()
    size = min(1000, sum(len(t[2]) for t in thirds.values()))
    items = bcp.conversations(thirds, 2, rng, size)
    if bcp.challenge_shapes is not None:
        pool = [bcp.challenge_shapes.encode_entry(c.prompt, c.earlier) for c in items]
    else:
        pool = [c.prompt for c in items]
    pool = list(dict.fromkeys(pool))
    menu = (SamplingOption(),)
    nodes = [b"\x00\x24" + hashlib.sha256(b"n%d" % i).digest() + bytes(4) for i in range(2)]
    epoch_s, user_rate = 300.0, 0.025
    train_epochs = args.detector_epochs
    total = train_epochs + max(10, args.epochs // 2)  # later verdicts: cycled when short
    chain = ChainView(menu=tuple((o.max_tokens, o.temperature, o.top_p) for o in menu),
                      epoch_s=epoch_s)
    index = PublicIndex(public)
    users = iter(bcp.conversations(thirds, 1, rng, int(total * user_rate * epoch_s * 2) + 100))
    used: set[int] = set()
    traffic = []
    for e in range(total):
        seed = rng.randbytes(32)
        if len(pool) - len(used) < len(nodes) * args.challenges:
            used.clear()
        plan = epoch_plans.derive_plan(seed, nodes, len(pool), args.challenges, exclude=used,
                                       sampling_options=len(menu))
        used |= {c.prompt_index for c in plan.challenges}
        for at, ask in bcp.challenge_asks(plan, nodes[0], pool, menu, rng, epoch=e,
                                          epoch_s=epoch_s, seed=seed):
            traffic.append((e, at, ask, 1))
        times = poisson_times(rng, user_rate, epoch_s)
        for at, asks in zip(times, api_asks([user_body(rng, next(users)) for _ in times])):
            traffic += [(e, at, ask, 0) for ask in asks]
    traffic.sort(key=lambda t: (t[0], t[1]))
    rows: list[tuple[int, list[float], int]] = []
    last_epoch, last_at, count = -1, 0.0, 0
    qrng = random.Random(args.seed + 19)
    for e, at, ask, label in traffic:
        try:
            query, raw = query_of_ask(ask, qrng)
        except (PsError, ValueError):
            continue
        if e != last_epoch:
            since = float("inf") if e == 0 else at + epoch_s - last_at
            last_epoch, count = e, 0
        else:
            since = at - last_at
        rows.append((e, features(RequestView(query, len(raw), at, since, count), chain, index),
                     label))
        chain.seen.add(query.prompt or (query.messages[-1].content if query.messages else ""))
        last_at, count = at, count + 1
    train = [(x, y) for e, x, y in rows if e < train_epochs]
    pos = [r for r in train if r[1]]
    neg = random.Random(args.seed + 20).sample([r for r in train if not r[1]],
                                               min(len(pos), len(train) - len(pos)))
    model = make_model("auto", args.seed)
    model.fit([x for x, _ in pos + neg], [y for _, y in pos + neg])  # type: ignore[attr-defined]
    later = [(x, y) for e, x, y in rows if e >= train_epochs]
    said = [p[1] >= 0.5 for p in model.predict_proba([x for x, _ in later])]  # type: ignore
    flags = [f for f, (_, y) in zip(said, later) if y]
    on_users = [f for f, (_, y) in zip(said, later) if not y]
    tpr = sum(flags) / max(1, len(flags))
    fpr = sum(on_users) / max(1, len(on_users))
    kind = type(model).__name__
    line = (f"the selective nodes' detector ({kind}, trained on {len(pos)} challenges + "
            f"{len(neg)} user requests of {train_epochs} epochs): on {len(flags)} later "
            f"challenges and {len(on_users)} user requests it flags {tpr:.1%} and {fpr:.1%} "
            f"(balanced accuracy {(tpr + 1 - fpr) / 2:.3f})")
    return flags, line


async def _engines(args, pool, public):  # type: ignore[no-untyped-def]
    """kind -> engine of every model node, and the forwarder's honest peer's kind."""

    from ps_p2p.engines.transformers_engine import TransformersEngine
    from ps_p2p.testing.dishonest import (
        DishonestEngine,
        FixedAnswerEngine,
        NearestPromptEngine,
        OtherPromptEngine,
        SelectiveEngine,
        TrustAwareEngine,
        degraded_copy,
        quantized_copy,
        substitute_model,
    )

    model = _memo(TransformersEngine.load(MODEL, prefix_cache_blocks=0))
    honest = [model] * args.honest  # the same model and seed: the same answers, made once
    engines: dict[str, object] = {f"honest-{i}": e for i, e in enumerate(honest)}
    flags, line = args.detector or ([], "")
    if line:
        print(line, flush=True)
    own_flags = {"selective": iter(flags[0::2] * 8), "forwarder": iter(flags[1::2] * 8)}
    started = time.monotonic()
    sub = _memo(substitute_model(MODEL, seed=args.seed))
    print(f"substitute model ready ({time.monotonic() - started:.0f} s, "
          f"{sum(p.numel() for p in sub.model.parameters())} parameters)", flush=True)
    best = await _best_fixed_answer(model, public, args)
    for kind in KINDS:
        if kind not in args.kinds:
            continue
        engines[kind] = {
            "noise5": lambda: _memo(degraded_copy(MODEL, noise=0.05, seed=args.seed)),
            "int4": lambda: _memo(quantized_copy(MODEL, bits=4)),
            "substitute": lambda: sub,
            "fixed": lambda: FixedAnswerEngine(model, STORY),
            "fixed-best": lambda: FixedAnswerEngine(model, best),
            "other-prompt": lambda: OtherPromptEngine(model),
            "nearest": lambda: NearestPromptEngine(model, public),
            "cut-stop": lambda: DishonestEngine(model, keep_fraction=0.25,
                                                finish_reason="stop"),
            "cut-length": lambda: DishonestEngine(model, keep_fraction=0.25),
            "hotter": lambda: DishonestEngine(model, temperature_scale=1.5),
            "selective": lambda: SelectiveEngine(
                model, sub, lambda p, q: next(own_flags["selective"])),
            "forwarder": lambda: SelectiveEngine(
                honest[0], FixedAnswerEngine(model, STORY),
                lambda p, q: next(own_flags["forwarder"])),
            "trust-aware": lambda: TrustAwareEngine(model, sub),
        }[kind]()
    memos = (model, sub) + tuple(e for e in engines.values() if hasattr(e, "prefetch")
                                 and e is not model and e is not sub)
    return engines, memos


async def _best_fixed_answer(reference, public, args):  # type: ignore[no-untyped-def]
    """The attacker's tuning: of the model's greedy answers to 12 public prompts (and STORY),
    the one with the best mean score over 12 other public prompts, at greedy and T = 0.7."""
    import hashlib

    from ps_p2p.engines.base import SamplingParams

    greedy = SamplingParams(max_tokens=args.max_tokens)
    await reference.prefetch([(p, greedy) for p in public[:12]])
    candidates = [STORY] + [(await reference.complete(p, greedy)).text for p in public[:12]]
    tuning = public[12:24]

    class _Answer:
        def __init__(self, text: str) -> None:
            self.text, self.finish_reason = text, "stop"

    await reference.prefetch([(p, greedy) for p in tuning])
    answers = [_scored(public, p, _Answer(text), t, 1.0, args.max_tokens,
                       hashlib.sha256(f"{p}{t}".encode()).digest())
               for text in candidates for p in tuning for t in (0.0, 0.7)]
    scores = await _challenge_scores(reference, answers)
    per = 2 * len(tuning)
    totals = [sum(scores[i * per:(i + 1) * per]) for i in range(len(candidates))]
    best_score = max(totals)
    best = candidates[totals.index(best_score)]
    print(f"fixed-best: mean score {best_score / (2 * len(tuning)):.3f} on the tuning prompts: "
          f"{best[:60]!r}...", flush=True)
    return best


async def _prefetch(engines, reference, requests) -> None:  # type: ignore[no-untyped-def]
    """Make, in batches, the answers the nodes' engines will ask their models for
    ``requests`` (the epoch's challenges, in order) and the verifier's own greedy answers:
    each memoised model gets them in one ``complete_batch`` (a request missed here is made
    one at a time when asked: the results are the same, only slower)."""
    from ps_p2p.engines.base import SamplingParams
    from ps_p2p.testing.dishonest import (
        DishonestEngine,
        NearestPromptEngine,
        OtherPromptEngine,
        SelectiveEngine,
    )

    wanted: dict[int, tuple[object, list[tuple[str, object]]]] = {}

    def want(engine, prompt, params) -> None:  # type: ignore[no-untyped-def]
        if hasattr(engine, "prefetch"):
            wanted.setdefault(id(engine), (engine, []))[1].append((prompt, params))

    for engine in engines.values():
        for i, (prompt, params) in enumerate(requests):
            for e in ((engine.honest, engine.cheap) if isinstance(engine, SelectiveEngine)
                      else (engine,)):
                if isinstance(e, DishonestEngine):
                    want(e.inner, prompt, e._params(params))
                elif isinstance(e, OtherPromptEngine):
                    other = e.other if e.other is not None else (
                        requests[i - 1][0] if i else e._previous)
                    want(e.tok, other, params)
                elif isinstance(e, NearestPromptEngine):
                    want(e.tok, e.prompts[e.nearest(prompt)], params)
                else:
                    want(e, prompt, params)
    for prompt, params in requests:
        if params.greedy:
            want(reference, prompt, SamplingParams(max_tokens=params.max_tokens))
    for engine, items in wanted.values():
        await engine.prefetch(items)


async def simulate(args: argparse.Namespace) -> int:
    import hashlib
    import random
    import resource

    from ps_p2p.engines.base import SamplingParams
    from ps_p2p.verification.ledger import MICRO
    from ps_p2p.verification.reputation import (
        DEFAULT_REPUTATION,
        ReputationState,
        is_trusted,
        update,
    )

    rng = random.Random(args.seed)
    data = load_pool()
    rng.shuffle(data)
    public = data[: len(data) // 3]  # what attackers know (fixed-best tuning, nearest's cache)
    pool = data[len(data) // 3:]  # the committee's challenge prompts
    print(machine())
    if args.epochs == 0:  # the honest-score simulation alone
        from ps_p2p.engines.transformers_engine import TransformersEngine

        reference = _memo(TransformersEngine.load(MODEL, prefix_cache_blocks=0))
        return 0 if await honest_simulation(args, reference, pool, rng) else 1
    engines, memo = await _engines(args, pool, public)
    # the verifier's reference: the same weights; its own greedy answers (scoring regenerates
    # them) come from the epoch's memo when a node already asked the same
    reference = memo[0]
    score_memo: dict[object, float] = {}
    kinds = list(engines)
    print(f"model {reference.model_id}; {len(kinds)} model nodes ({', '.join(kinds)}); pool of "
          f"{len(pool)} prompts (public: {len(public)}); {args.challenges} challenges per node "
          f"per epoch of {args.max_tokens} tokens; {args.epochs} epochs", flush=True)
    params = dataclasses.replace(DEFAULT_REPUTATION, probation=args.probation)
    states = {k: ReputationState.fresh(params) for k in kinds}
    history: list[dict[str, object]] = []
    untrusted_at: dict[str, int] = {}
    scores: dict[str, list[float]] = {k: [] for k in kinds}
    score_cpu = 0.0
    scored = 0
    started = time.monotonic()
    cpu_start = time.process_time()
    for epoch in range(1, args.epochs + 1):
        served: dict[str, list[float]] = {k: [] for k in kinds}
        binding: dict[str, list[float]] = {k: [] for k in kinds}
        for m in memo:
            m.clear()
        score_memo.clear()
        for kind in kinds:  # what a node reads of its own committed reputation
            if hasattr(engines[kind], "trusted"):
                engines[kind].trusted = is_trusted(states[kind], params)
        # every node gets the same challenges in an epoch (module docstring)
        asked = [(rng.choice(pool), _draw(rng, MENU_T), _draw(rng, MENU_TOP_P),
                  rng.randrange(2**32)) for _ in range(args.challenges)]
        requests = [(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=t,
                                            top_p=top_p, seed=seed))
                    for prompt, t, top_p, seed in asked]
        await _prefetch(engines, reference, requests)
        answers: dict[str, list[tuple[object, object]]] = {}
        routes: dict[str, list[str]] = {}
        for kind in kinds:
            for prompt, sampling in requests:
                answer = await engines[kind].complete(prompt, sampling)
                answers.setdefault(kind, []).append((answer, sampling))
                routes.setdefault(kind, []).append(getattr(engines[kind], "last_route", ""))
        todo: dict[object, dict[str, object]] = {}
        for kind in kinds:
            for (prompt, t, top_p, seed), (answer, _) in zip(asked, answers[kind]):
                memo_key = (prompt, t, top_p, answer.text, answer.finish_reason)
                if memo_key not in score_memo and memo_key not in todo:
                    key = hashlib.sha256(f"{epoch}/{seed}".encode()).digest()
                    todo[memo_key] = _scored(pool, prompt, answer, t, top_p, args.max_tokens,
                                             key)
        cpu = time.process_time()
        score_memo.update(zip(todo, await _challenge_scores(reference, list(todo.values()))))
        score_cpu += time.process_time() - cpu
        scored += len(todo)
        for kind in kinds:
            for (prompt, t, top_p, seed), (answer, _), route in zip(
                    asked, answers[kind], routes[kind]):
                c = score_memo[(prompt, t, top_p, answer.text, answer.finish_reason)]
                scores[kind].append(c)
                micro = round(c * MICRO) / MICRO
                # the forwarder's forwarded answers count for it and for its honest peer
                for who in (kind, "honest-0") if (
                        kind == "forwarder" and route == "honest") else (kind,):
                    served[who].append(micro)
                    if t == 0 or micro == 0:  # the ledger's binding scores
                        binding[who].append(micro)
        row: dict[str, object] = {"epoch": epoch, "t": round(time.monotonic() - started, 2),
                                  "cpu": round(time.process_time() - cpu_start, 2)}
        for kind in kinds:
            v = served[kind]
            c_t = min([sum(v) / len(v)] + binding[kind])
            states[kind] = update(states[kind], c_t, params)
            row[kind] = round(states[kind].reputation, 6)  # 0.399999: on probation
            if not is_trusted(states[kind], params) and kind not in untrusted_at:
                untrusted_at[kind] = epoch
        history.append(row)
        if args.json and (epoch % 10 == 0 or epoch == args.epochs):
            pathlib.Path(args.json).write_text(json.dumps(history, indent=1))
        if epoch % 10 == 0 or epoch == args.epochs:
            print(f"epoch {epoch:3d} ({row['t']:.0f} s): " + " ".join(
                f"{k}={row[k]:.2f}" for k in kinds), flush=True)
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu_start
    print(f"\n{args.epochs} epochs in {elapsed:.0f} s ({elapsed / args.epochs:.2f} s/epoch; CPU "
          f"{cpu:.0f} s, {cpu / args.epochs:.2f} s/epoch); "
          f"CPU per scored challenge {score_cpu / scored * 1000:.1f} ms ({scored} distinct "
          f"answers scored); "
          f"process CPU {resource.getrusage(resource.RUSAGE_SELF).ru_utime:.0f} s; answers "
          f"generated {sum(m.made for m in memo)}, reused {sum(m.hits for m in memo)}")
    ok = True
    print(f"{'node':14s} {'untrusted after':>16s} {'later epochs untrusted':>23s} "
          f"{'mean score':>10s} {'final R':>8s}")
    for kind in kinds:
        at = untrusted_at.get(kind)
        later = [r for r in history if at is not None and int(r["epoch"]) > at]  # type: ignore
        share = (sum(1 for r in later if float(r[kind]) < params.untrusted_below)  # type: ignore
                 / len(later)) if later else float("nan")
        mean = sum(scores[kind]) / len(scores[kind])
        if kind.startswith("honest"):
            good = at is None
            verdict = "never" if at is None else f"epoch {at}"
            print(f"{kind:14s} {verdict:>16s} {'':>23s} {mean:10.3f} "
                  f"{float(history[-1][kind]):8.3f}")  # type: ignore[arg-type]
        else:
            good = at is not None and at <= 3 and (not later or share >= 0.95)
            verdict = "never" if at is None else f"{at} epoch(s)"
            print(f"{kind:14s} {verdict:>16s} {share:23.1%} {mean:10.3f} "
                  f"{float(history[-1][kind]):8.3f}{'' if good else '   <- goal missed'}")
        ok &= good
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(history, indent=1))
    if args.plot:
        plot(history, kinds, params.untrusted_below, pathlib.Path(args.plot),
             title=f"Reputation over challenge epochs (stories260K, {args.challenges} "
                   f"challenges per node per epoch)")
        print(f"plot: {args.plot}")
    if args.honest_epochs:
        ok &= await honest_simulation(args, reference, pool, rng)
    return 0 if ok else 1


async def honest_simulation(args, reference, pool, rng) -> bool:  # type: ignore[no-untyped-def]
    """``args.honest_epochs`` epochs of honest nodes from a bank of honest challenge scores:
    ``args.bank`` answers of the right model for every (temperature, top_p) of the menu."""
    import hashlib

    from ps_p2p.engines.base import SamplingParams
    from ps_p2p.verification.reputation import (
        DEFAULT_REPUTATION,
        ReputationState,
        update,
    )

    params = dataclasses.replace(DEFAULT_REPUTATION, probation=args.probation)
    bank: dict[tuple[float, float], list[float]] = {}
    started = time.monotonic()
    drawn = []  # (T, top_p, i, prompt), drawn in the order of the one-at-a-time loop
    for t, _ in MENU_T:
        for top_p, _ in MENU_TOP_P:
            bank.setdefault((t, top_p), [])
            for i in range(args.bank if t > 0 or top_p == 1.0 else 0):
                drawn.append((t, top_p, i, rng.choice(pool)))
    requests = [(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=t,
                                        top_p=top_p, seed=i)) for t, top_p, i, prompt in drawn]
    await reference.prefetch(requests + [(prompt, SamplingParams(max_tokens=args.max_tokens))
                                         for t, _, _, prompt in drawn if t == 0])
    answers = []
    for (t, top_p, i, prompt), (_, sampling) in zip(drawn, requests):
        answer = await reference.complete(prompt, sampling)
        key = hashlib.sha256(f"bank/{t}/{top_p}/{i}".encode()).digest()
        answers.append(_scored(pool, prompt, answer, t, top_p, args.max_tokens, key))
    for (t, top_p, _, _), c in zip(drawn, await _challenge_scores(reference, answers)):
        bank[(t, top_p)].append(c)
    bank = {k: v for k, v in bank.items() if v}
    print(f"\nhonest bank: {sum(map(len, bank.values()))} answers in "
          f"{time.monotonic() - started:.0f} s; per (T, top_p): min / mean / share below 0.5")
    for (t, top_p), v in sorted(bank.items()):
        print(f"  T={t:<4} top_p={top_p:<5} {min(v):.3f} / {sum(v) / len(v):.3f} / "
              f"{sum(1 for x in v if x < 0.5) / len(v):.1%}")
    menus = {"menu mix": None} | {f"T={t} only": t for t, _ in MENU_T}
    # an honest node once convicted (an outage's misses), its probation served: on parole
    menus["menu mix, on parole"] = None
    ok = True
    for name, only in menus.items():
        state = ReputationState.fresh(params) if "parole" not in name else ReputationState(
            0.7, (), 0, strikes=1, clean=params.required_clean(1))
        lowest, untrusted = 1.0, 0
        for _ in range(args.honest_epochs):
            vals, caps = [], []
            for _ in range(args.challenges):
                t = only if only is not None else _draw(rng, MENU_T)
                top_p = _draw(rng, MENU_TOP_P) if t > 0 else 1.0
                c = rng.choice(bank[(t, top_p)])
                vals.append(c)
                if t == 0 or round(c * 1_000_000) == 0:  # the ledger's binding scores
                    caps.append(c)
            state = update(state, min([sum(vals) / len(vals)] + caps), params)
            lowest = min(lowest, state.reputation)
            untrusted += state.reputation < params.untrusted_below
        ok &= untrusted == 0
        print(f"  {name:12s}: {args.honest_epochs} honest epochs, untrusted in {untrusted}, "
              f"lowest R {lowest:.3f}; strikes left {state.strikes}")
    return ok


def plot(history: list[dict[str, object]], kinds: list[str], threshold: float,
         path: pathlib.Path,
         title: str = "Reputation over challenge epochs (stories260K, committee of 4)") -> None:
    try:
        import matplotlib
    except ImportError:  # the plot is optional: the numbers are printed either way
        print(f"no plot written to {path}: matplotlib is missing (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    epochs = [int(r["epoch"]) for r in history]  # type: ignore[call-overload]
    colors = plt.get_cmap("tab20")
    for i, kind in enumerate(kinds):
        style = "-" if kind.startswith("honest") else "--"
        ax.plot(epochs, [r[kind] for r in history], style, label=kind, linewidth=1.6,
                color=colors(i % 20))
    ax.axhline(threshold, color="grey", linestyle=":", label=f"untrusted below {threshold}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("committed reputation R")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="center right", fontsize=7, ncol=2 if len(kinds) > 8 else 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def replot(json_path: str, plot_path: str, title: str) -> None:
    """Plot a ``--json`` history again (e.g. with another title) without re-running."""
    history = json.loads(pathlib.Path(json_path).read_text())
    kinds = [k for k in history[0] if k not in ("epoch", "t", "cpu")]
    plot(history, kinds, 0.4, pathlib.Path(plot_path), title=title)


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
    ap.add_argument("--localnet", action="store_true",
                    help="the network run (committee of 4, three dishonest kinds)")
    ap.add_argument("--challenges", type=int, default=12, help="challenges per node per epoch")
    ap.add_argument("--kinds", default=",".join(KINDS), help="dishonest kinds to simulate")
    ap.add_argument("--detector-epochs", type=int, default=60,
                    help="epochs of traffic the selective nodes' detector is trained on")
    ap.add_argument("--honest-epochs", type=int, default=1000,
                    help="epochs of the honest-score simulation (0: none)")
    ap.add_argument("--bank", type=int, default=30,
                    help="honest answers per (temperature, top_p) of the menu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--probation", type=int, default=DEFAULT_REPUTATION.probation,
                    help="clean epochs after a first conviction (reputation.py; 0: the paper's "
                         "rule alone)")
    args = ap.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not MODEL.is_dir():
        print(f"the model is not at {MODEL} (set PS_SHARED_DIR)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7d %(name)s %(message)s")
    logging.getLogger("ps_p2p").setLevel(args.log.upper())
    import torch

    torch.set_num_threads(args.threads)
    args.detector = None
    if not args.localnet and args.epochs and {"selective", "forwarder"} & set(args.kinds):
        args.detector = _detector_flags(args)  # before trio.run: it runs trio itself
    return trio.run(run if args.localnet else simulate, args)


if __name__ == "__main__":
    sys.exit(main())
