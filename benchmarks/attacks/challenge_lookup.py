"""Issue 16, HIGH 6: a model node recognises challenges by looking their prompts up.

The adversary is a model node M that wants to serve its users with a cheaper model and answer
only challenges honestly. Its classifier flags a request as a challenge when its prompt

(a) is in a public data set it knows, verbatim or nearly (word 5-gram Jaccard >= 0.5): the
    MT-Bench questions and half of the ShareGPT first turns of ../shared/data;
(b) appears in a report the chain published: M is listed, so blocksync serves it every block;
    it decodes each EPOCH_REPORT as any node can (and, in case that fails, searches the raw
    transaction bytes for the prompt's UTF-8 bytes);
(c) equals a prompt M was asked in an earlier request.

The run drives the verification cores the committee runs (:class:`EpochLedger`:
``maybe_start``, ``plan``, ``check_epoch_report``, ``apply_epoch_report``; challenge requests
and user requests both built by ``encode_query``, report transactions by ``encode_tx``), one
validator and ``--nodes`` model nodes with one challenge each per epoch; M also gets
``--users-per-epoch`` user requests per epoch. User prompts come from the other half of the
ShareGPT first turns, each asked once while they last: a held-out set, because in a real network users' prompts are not public
data (a devnet that replays public sets as "users" would make "not in a public set" a
challenge signal of its own).

Pools (``--pool``): ``public`` is what the testnet used before the fix (MT-Bench + ShareGPT,
minus the held-out half); ``private`` is ``--pool-size`` prompts sampled from stories260K under a
secret seed (``ps-node testnet --challenge-pool generate``).

The same script runs on the code before the fix (reports carry Q in clear; recent_epochs 16)
and after it (Q sealed for the committee; no prompt asked twice while the pool has unused
ones): it detects which by the presence of :mod:`ps_p2p.verification.sealing`::

    PYTHONPATH=/path/to/old/checkout python benchmarks/attacks/challenge_lookup.py --pool public
    python benchmarks/attacks/challenge_lookup.py --pool private

Prints flagged challenges / challenges and flagged users / users, per rule and in all.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import pathlib
import random
import re
import sys
import time

import trio

REPO = pathlib.Path(__file__).resolve().parents[2]
if "PYTHONPATH" not in os.environ:  # this checkout's ps_p2p (PYTHONPATH picks another one)
    sys.path.insert(0, str(REPO))

from ps_p2p import responses  # noqa: E402
from ps_p2p import registry as app  # noqa: E402
from ps_p2p.consensus.types import Validator  # noqa: E402
from ps_p2p.errors import PsError  # noqa: E402
from ps_p2p.inference import InferenceQuery, InferenceReply, ReplyProxy  # noqa: E402
from ps_p2p.inference import SamplingParams as QueryParams  # noqa: E402
from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.prompts import load_prompts  # noqa: E402
from ps_p2p.protocols.inference_codec import decode_query, encode_query  # noqa: E402
from ps_p2p.verification import epochs, ledger  # noqa: E402

try:  # after the fix
    from ps_p2p.verification import sealing
except ImportError:  # before: reports carry Q in clear
    sealing = None  # type: ignore[assignment]

SHARED = pathlib.Path(os.environ.get("PS_SHARED_DIR", REPO.parent / "shared"))
MTBENCH = SHARED / "data" / "mtbench" / "question.jsonl"
SHAREGPT = SHARED / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"
MODEL = SHARED / "models" / "stories260K"
CHAIN = "challenge-lookup"
SHINGLE = 5
JACCARD = 0.5


# ------------------------------------------------------------------------------- the attacker


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str) -> frozenset[tuple[str, ...]]:
    """Word 5-grams (the whole text when shorter)."""
    w = _words(text)
    if len(w) < SHINGLE:
        return frozenset([tuple(w)]) if w else frozenset()
    return frozenset(tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1))


class Classifier:
    """The model node's challenge detector (module docstring, rules a-c)."""

    def __init__(self, public: list[str]) -> None:
        self.public = {p.strip() for p in public}
        self._sets = [shingles(p) for p in public]
        self._index: dict[tuple[str, ...], list[int]] = {}
        for i, s in enumerate(self._sets):
            for g in s:
                self._index.setdefault(g, []).append(i)
        self.published: set[str] = set()  # prompts decoded from reports
        self.published_raw: list[bytes] = []  # the report transactions' bytes
        self.seen: set[str] = set()

    def in_public(self, prompt: str) -> bool:
        if prompt.strip() in self.public:
            return True
        s = shingles(prompt)
        candidates = {i for g in s for i in self._index.get(g, ())}
        return any(len(s & self._sets[i]) / len(s | self._sets[i]) >= JACCARD
                   for i in candidates)

    def in_chain(self, prompt: str) -> bool:
        if prompt in self.published:
            return True
        data = prompt.encode()
        return any(data in raw for raw in self.published_raw)

    def read_block_tx(self, raw: bytes) -> None:
        """What a listed node does with each committed transaction."""
        self.published_raw.append(raw)
        try:
            tx = app.decode_tx(raw, 1 << 30)
        except PsError:
            return
        for res in getattr(tx, "results", ()):
            if res.answer is None:
                continue
            q = getattr(res.answer, "request", None)  # before the fix: Q in clear
            if q is None:
                continue
            try:
                self.published.add(decode_query(q).prompt)
            except PsError:
                pass

    def classify(self, prompt: str) -> tuple[bool, bool, bool]:
        rules = (self.in_public(prompt), self.in_chain(prompt), prompt in self.seen)
        self.seen.add(prompt)
        return rules


# ------------------------------------------------------------------------------- the network


def query(prompt: str, model_id: str, rng: random.Random) -> bytes:
    """Q as a user client (or a verifier's user role) builds it."""
    return encode_query(InferenceQuery(
        request_id=rng.randbytes(16), model_id=model_id, prompt=prompt,
        params=QueryParams(max_tokens=64, temperature=0.0, top_p=1.0),
        reply_proxies=tuple(ReplyProxy(rng.randbytes(38), rng.randbytes(16)) for _ in range(4))))


def signed_answer(node: Identity, q: bytes, at_ms: int, key: bytes | None):
    content = responses.ResponseContent(0, "an answer", "", "stories260K", 7, 12, "stop")
    h = responses.request_hash(q)
    rid = decode_query(q).request_id
    sig = responses.sign_response(node, rid, h, content, at_ms)
    reply = InferenceReply(rid, 0, content.text, "", content.model_id, 7, 12, h, at_ms,
                           node.peer_id, sig, "stop")
    carried = q if key is None else sealing.seal_request(key, h, q)
    return ledger.SignedAnswer(carried, reply)


def load_data() -> tuple[list[str], list[str]]:
    """(public prompts the attacker knows, held-out user prompts)."""
    mt = [p.text for p in load_prompts(MTBENCH)]
    sg = [p.text for p in load_prompts(SHAREGPT)]
    rng = random.Random(16)
    rng.shuffle(sg)
    half = len(sg) // 2
    return mt + sg[:half], sg[half:]


async def private_pool(size: int, seed: bytes) -> list[str]:
    """``size`` prompts sampled from stories260K under ``seed`` (testnet's generated pool)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ps_p2p.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine.load(MODEL)
    try:
        from ps_p2p.prompts import generate_prompts
    except ImportError:  # before the fix: the same draws, written here
        from ps_p2p.engines.base import SamplingParams

        texts: dict[str, None] = {}
        k = 0
        while len(texts) < size:
            d = hmac.new(seed, b"planetserve/v1/generated-prompt\x00" + k.to_bytes(4, "big"),
                         hashlib.sha256).digest()
            c = await engine.complete("", SamplingParams(max_tokens=32, temperature=1.0,
                                                         seed=int.from_bytes(d[:8], "big")))
            t = c.text.strip()
            t = t.rsplit(" ", 1)[0].rstrip() if c.finish_reason == "length" and " " in t else t
            if t:
                texts[t] = None
            k += 1
        return list(texts)
    return [p.text for p in await generate_prompts(engine, size, seed)]


def run(pool: list[str], public: list[str], users: list[str], *, epochs_n: int, nodes_n: int,
        users_per_epoch: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    validator = Identity.from_private_bytes(hashlib.sha256(b"validator").digest())
    nodes = [Identity.from_private_bytes(hashlib.sha256(b"node %d" % i).digest())
             for i in range(nodes_n)]
    attacker = nodes[0]
    key = hashlib.sha256(b"committee key %d" % seed).digest() if sealing else None
    extra = {"committee_key_sha256": sealing.key_commitment(key)} if sealing else {}
    params = ledger.VerificationParams(
        model_id="stories260K", pool_sha256=ledger.pool_digest(pool), pool_size=len(pool),
        max_nodes=nodes_n, attempt_ms=60_000, **extra)
    validators = (Validator(validator.peer_id),)
    led = ledger.EpochLedger()
    master = hashlib.sha256(b"master").digest()
    clf = Classifier(public)
    challenges = {"a": 0, "b": 0, "c": 0, "any": 0, "n": 0}
    flagged_users = {"a": 0, "b": 0, "c": 0, "any": 0, "n": 0}
    asked: list[int] = []
    now = 1_800_000_000_000
    user_prompts = iter(rng.sample(users, len(users)) * (1 + epochs_n * users_per_epoch
                                                        // len(users)))
    for _ in range(epochs_n):
        e = led.epoch
        secret = epochs.derive_secret(master, CHAIN, e)
        led.commitments.setdefault(e, {})[validator.peer_id] = epochs.seed_commitment(
            CHAIN, e, validator.peer_id, secret)
        now += 600_000
        members = [(n.peer_id, n.peer_id) for n in nodes]
        assert ledger.maybe_start(led, validators, members, params, rng.randbytes(32), now)
        plan = led.plan(CHAIN, params, 0, secret)
        # M's traffic this epoch: its challenge(s) and its users' requests, in random order
        traffic = [(True, pool[c.prompt_index]) for c in plan.challenges
                   if c.model_node == attacker.peer_id]
        traffic += [(False, next(user_prompts)) for _ in range(users_per_epoch)]
        rng.shuffle(traffic)
        for is_challenge, prompt in traffic:
            a, b, c = clf.classify(prompt)
            tally = challenges if is_challenge else flagged_users
            tally["n"] += 1
            for name, hit in (("a", a), ("b", b), ("c", c), ("any", a or b or c)):
                tally[name] += hit
        asked += [c.prompt_index for c in plan.challenges]
        by_id = {n.peer_id: n for n in nodes}
        results = [ledger.ChallengeResult(c, 900_000, signed_answer(
            by_id[c.model_node], query(pool[c.prompt_index], "stories260K", rng), now + 1000, key))
            for c in plan.challenges]
        tx = ledger.sign_epoch_report(validator, CHAIN, e, 0, secret, results)
        raw = app.encode_tx(tx)
        served = ledger.check_epoch_report(tx, led, CHAIN, params, now + 5000)
        ledger.apply_epoch_report(tx, led, params, served, 500_000)
        clf.read_block_tx(raw)  # committed: blocksync serves it to every listed node
    reused = len(asked) - len(set(asked))
    return {"challenges": challenges, "users": flagged_users, "asked": len(asked),
            "reused": reused, "sealed": sealing is not None,
            "recent_epochs": params.recent_epochs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", choices=["public", "private"], default="private")
    p.add_argument("--pool-size", type=int, default=400, help="private pool's prompts")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--nodes", type=int, default=8, help="model nodes (one challenge each)")
    p.add_argument("--users-per-epoch", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    public, users = load_data()
    started = time.time()
    if args.pool == "public":
        pool = public
    else:
        pool = trio.run(private_pool, args.pool_size, hashlib.sha256(b"pool %d" % args.seed)
                        .digest())
    r = run(pool, public, users, epochs_n=args.epochs, nodes_n=args.nodes,
            users_per_epoch=args.users_per_epoch, seed=args.seed)
    ch, us = r["challenges"], r["users"]
    code = "after the fix (Q sealed)" if r["sealed"] else "before the fix (Q in clear)"
    print(f"code: {code}; pool: {args.pool} ({len(pool)} prompts); recent_epochs "
          f"{r['recent_epochs']}; {args.epochs} epochs x {args.nodes} nodes; "
          f"{r['reused']} of {r['asked']} challenges reused a prompt")
    for name, label in (("a", "(a) public data sets"), ("b", "(b) published reports"),
                        ("c", "(c) seen before"), ("any", "any rule")):
        print(f"  {label:24s} flagged challenges {ch[name]:3d}/{ch['n']:<3d}   "
              f"flagged users {us[name]:3d}/{us['n']}")
    print(f"  ({time.time() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
