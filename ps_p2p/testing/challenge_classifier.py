"""A model node's challenge detector: what a dishonest node would train to tell a verifier's
challenge from a user's request (issue 18, finding 1; PlanetServe sec. 3.4).

TEST ONLY: the adversary of ``benchmarks/bench_challenge_privacy.py`` and of the "honest only on
suspected challenges" node of ``benchmarks/bench_reputation.py``.

What it sees is what a model node has, nothing more:

* the request Q as the node decodes it (:class:`~ps_p2p.inference.InferenceQuery`, after S-IDA
  decoding): every field (chat messages or prompt, model ID, ``max_tokens``, ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``stream``, the reply proxies' count, the preferred model
  node), Q's length in bytes, and lengths/shape of the text;
* when it arrived: seconds since the epoch began (the epoch's first block time is on the
  chain), seconds since the node's previous request, and how many requests it had this epoch;
* the chain's published data (:class:`ChainView`): the genesis' sampling menu (a request whose
  parameters are exactly a menu entry), the prompts the node has been asked before, any
  prompt published in clear in an earlier report, and the committed mix of shapes that
  challenges are drawn from (the request's log-probability under it);
* public data sets (:class:`PublicIndex`): the prompt verbatim, its word 5-grams' Jaccard
  similarity to the nearest public prompt, and the share of its 5-grams found in any public
  prompt;
* its own model (``lm``: stories260K in the benchmark): the prompt's length in tokens and its
  mean negative log-likelihood (a generated pool reads like the model's own text);
* its memory of its traffic: a chat whose earlier user turn it was asked before (a user's
  follow-up after a turn this node served), and the reply proxies in Q: a client's requests
  share its few paths' proxies until they rotate, so the node counts this epoch's earlier
  requests from the same client, and whether the client sent a request a past report showed
  to be a challenge.

Labels come from the chain as well: an EPOCH_REPORT carries SHA-256(Q) of each challenge in
clear (the node's signature covers it), so after each epoch a node knows exactly which of its
past requests were challenges. A classifier trained on those labels is the realistic attacker;
cross-validated accuracy on a balanced set is the measure (0.5: indistinguishable).

Usage::

    clf = ChallengeClassifier(public_texts, chain=ChainView(menu=...))
    clf.fit(views, labels)            # views: list[RequestView]; labels: 1 challenge, 0 user
    p = clf.probability(view)         # in [0, 1]
    clf.is_challenge(view)            # p >= 0.5

The model is scikit-learn's ``HistGradientBoostingClassifier`` when scikit-learn is installed
(``pip install -e .[bench]``), else a small CART tree of this module (:class:`SmallTree`).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ps_p2p.inference import InferenceQuery

SHINGLE = 5
#: Reply proxies two requests must share to count as one client's (a request uses 4 of its
#: client's 5 paths, so two requests of one client share at least 3 while its paths live).
LINK_PROXIES = 2
#: Features, in the order :func:`features` returns them.
FEATURES: tuple[str, ...] = (
    # the request as decoded
    "chat", "messages", "has_system", "user_turns", "assistant_turns", "system_chars",
    "text_chars", "last_user_chars", "text_words", "text_lines", "question_mark",
    "non_ascii_fraction", "digit_fraction", "code_marks",
    "stream", "max_tokens", "temperature", "top_p", "seed_set", "seed_log10", "stops",
    "stop_chars", "reply_proxies", "preferred_node", "q_bytes",
    # arrival
    "epoch_offset_s", "epoch_fraction", "since_previous_s", "index_in_epoch",
    # the chain's published data and the node's own memory
    "in_menu", "seen_before", "published_before",
    # public data sets
    "public_verbatim", "public_jaccard",
    # the prompt under the node's own model (stories260K): tokens, mean negative log-likelihood
    "prompt_tokens", "lm_nll",
    # the node's memory of its traffic: a chat whose earlier user turn it was asked before;
    # the reply proxies' links to this epoch's earlier requests and to known past challenges
    "earlier_seen", "linked_epoch", "linked_challenge",
    # public data sets: share of the prompt's word 5-grams found in any public prompt
    "public_containment",
    # the chain's committed mix (MIX_REPORTs): log-probability that a challenge has this shape
    "mix_logp",
)
#: Feature groups (names of :data:`FEATURES`), for accuracies by what the node looks at.
GROUPS: dict[str, tuple[str, ...]] = {
    "fields": ("chat", "messages", "has_system", "user_turns", "assistant_turns",
               "system_chars", "text_chars", "last_user_chars", "stream", "max_tokens",
               "temperature", "top_p", "seed_set", "seed_log10", "stops", "stop_chars",
               "reply_proxies", "preferred_node", "q_bytes"),
    "content": ("text_words", "text_lines", "question_mark", "non_ascii_fraction",
                "digit_fraction", "code_marks"),
    "timing": ("epoch_offset_s", "epoch_fraction", "since_previous_s", "index_in_epoch"),
    "chain": ("in_menu", "seen_before", "published_before", "earlier_seen", "mix_logp"),
    "public": ("public_verbatim", "public_jaccard", "public_containment"),
    "model": ("prompt_tokens", "lm_nll"),
    "proxies": ("linked_epoch", "linked_challenge"),
}
_CODE = re.compile(r"[{};]|def |return |import |#include|=>|\(\)")


@dataclass(frozen=True)
class RequestView:
    """One request as a model node has it when it must decide how to answer.

    Attributes:
        query: Q as decoded.
        q_bytes: Q's encoded length (bytes).
        epoch_offset_s: seconds since the epoch's first block (>= 0).
        since_previous_s: seconds since this node's previous request (inf for the first).
        index_in_epoch: requests this node had earlier in the same epoch.
        linked_epoch: requests this node had earlier in the same epoch whose reply proxies
            share at least :data:`LINK_PROXIES` peers with this one's (same client: a client's
            requests go over the same few paths until they rotate).
        linked_challenge: this request's reply proxies share at least :data:`LINK_PROXIES`
            peers with a request of an earlier epoch that a report showed to be a challenge.
    """

    query: InferenceQuery
    q_bytes: int
    epoch_offset_s: float
    since_previous_s: float = math.inf
    index_in_epoch: int = 0
    linked_epoch: int = 0
    linked_challenge: bool = False


@dataclass
class ChainView:
    """What the chain told the node, and what it remembers of its own traffic.

    Attributes:
        menu: the genesis' sampling menu as (max_tokens, temperature, top_p) triples.
        epoch_s: the epoch's length in seconds (``epoch_ms`` / 1000; for ``epoch_fraction``).
        published: prompts read in clear from earlier reports (before issue 16's sealing).
        seen: prompts this node was asked before (updated by :meth:`ChallengeClassifier.
            observe`).
        mix: the committed mix of request shapes challenges are drawn from this epoch (a
            :class:`~ps_p2p.verification.mix.ShapeHistogram`, public in the ledger); None:
            ``mix_logp`` is 0.
    """

    menu: tuple[tuple[int, float, float], ...] = ()
    epoch_s: float = 300.0
    published: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)
    mix: Any = None


def mix_logp(query: InferenceQuery, histogram: Any) -> float:
    """Natural log of the probability that a challenge drawn from ``histogram`` (a
    :class:`~ps_p2p.verification.mix.ShapeHistogram`) has ``query``'s shape: the sum over its
    buckets (:meth:`~ps_p2p.verification.mix.RequestShape.buckets`) of log(share), a share of 0
    (a suppressed bucket: no challenge has it) counted as half a basis point."""
    from ps_p2p.verification import mix as learned

    p = query.params
    shape = learned.RequestShape.of_ask(
        query.prompt, query.messages, stream=query.stream, max_tokens=p.max_tokens,
        temperature=round(p.temperature, 4), top_p=round(p.top_p, 4), seed=p.seed,
        stop=p.stop)
    total = 0.0
    for dim, bucket in shape.buckets():
        row = histogram.shares[dim]
        if sum(row):
            total += math.log(max(row[bucket], 0.5) / learned.SCALE)
    return total


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str) -> frozenset[tuple[str, ...]]:
    """Word 5-grams of ``text`` (the whole word sequence when shorter)."""
    w = _words(text)
    if len(w) < SHINGLE:
        return frozenset([tuple(w)]) if w else frozenset()
    return frozenset(tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1))


class PublicIndex:
    """Public prompts (MT-Bench, ShareGPT, ...), looked up verbatim or by word 5-gram Jaccard
    similarity (an inverted index over the 5-grams; ~ms per look-up for thousands of texts)."""

    def __init__(self, texts: Iterable[str]) -> None:
        texts = [t for t in texts if t.strip()]
        self.verbatim = {t.strip() for t in texts}
        self._sets = [shingles(t) for t in texts]
        self._index: dict[tuple[str, ...], list[int]] = {}
        for i, s in enumerate(self._sets):
            for g in s:
                self._index.setdefault(g, []).append(i)

    def jaccard(self, text: str) -> float:
        """Largest Jaccard similarity of ``text``'s 5-grams to a public text's, in [0, 1]."""
        s = shingles(text)
        if not s:
            return 0.0
        best = 0.0
        for i in {i for g in s for i in self._index.get(g, ())}:
            other = self._sets[i]
            best = max(best, len(s & other) / len(s | other))
        return best

    def containment(self, text: str) -> float:
        """Share of ``text``'s 5-grams found in some public text, in [0, 1] (a prompt that
        copies part of a public one scores high even when its Jaccard similarity is low)."""
        s = shingles(text)
        if not s:
            return 0.0
        return sum(g in self._index for g in s) / len(s)

    def __contains__(self, text: str) -> bool:
        return text.strip() in self.verbatim


def request_text(query: InferenceQuery) -> str:
    """The text a request asks about: the prompt, or the last user message of a chat."""
    if not query.messages:
        return query.prompt
    users = [m.content for m in query.messages if m.role == "user"]
    return users[-1] if users else query.messages[-1].content


def earlier_user_turns(query: InferenceQuery) -> list[str]:
    """A chat's user messages before its last one (its earlier exchanges' user turns)."""
    users = [m.content for m in query.messages if m.role == "user"]
    return users[:-1]


def features(view: RequestView, chain: ChainView | None = None,
             public: PublicIndex | None = None,
             lm: Callable[[str], tuple[int, float]] | None = None) -> list[float]:
    """The feature vector of one request (:data:`FEATURES` order); pure when ``lm`` is.

    Args:
        lm: the node's own model as ``text -> (tokens, mean negative log-likelihood per
            token in nats)`` of the request's text (:func:`request_text`); None: both 0.
    """
    chain = chain or ChainView()
    q = view.query
    p = q.params
    messages = q.messages
    texts = [m.content for m in messages] if messages else [q.prompt]
    whole = "\n".join(texts)
    last = request_text(q)
    system = sum(len(m.content) for m in messages if m.role in ("system", "developer"))
    n = max(1, len(whole))
    menu_hit = any(p.max_tokens == mt and abs(p.temperature - t) < 1e-6
                   and abs(p.top_p - tp) < 1e-6 for mt, t, tp in chain.menu)
    vec = [
        float(bool(messages)), float(len(messages)), float(system > 0),
        float(sum(m.role == "user" for m in messages)),
        float(sum(m.role == "assistant" for m in messages)), float(system),
        float(len(whole)), float(len(last)), float(len(_words(whole))),
        float(whole.count("\n") + 1), float("?" in last),
        sum(ord(c) > 127 for c in whole) / n, sum(c.isdigit() for c in whole) / n,
        float(len(_CODE.findall(whole))),
        float(q.stream), float(p.max_tokens), float(p.temperature), float(p.top_p),
        float(p.seed is not None), math.log10((p.seed or 0) + 1), float(len(p.stop)),
        float(sum(len(s) for s in p.stop)), float(len(q.reply_proxies)),
        float(bool(q.preferred_model_node)), float(view.q_bytes),
        float(view.epoch_offset_s), float(view.epoch_offset_s / max(chain.epoch_s, 1e-9)),
        float(min(view.since_previous_s, 1e6)), float(view.index_in_epoch),
        float(menu_hit), float(last in chain.seen), float(last in chain.published),
        float(public is not None and last in public),
        public.jaccard(last) if public is not None else 0.0,
        *(map(float, lm(last)) if lm is not None else (0.0, 0.0)),
        float(any(t in chain.seen for t in earlier_user_turns(q))),
        float(view.linked_epoch), float(view.linked_challenge),
        public.containment(last) if public is not None else 0.0,
        mix_logp(q, chain.mix) if chain.mix is not None else 0.0,
    ]
    assert len(vec) == len(FEATURES)
    return vec


# ------------------------------------------------------------------------------ models


class SmallTree:
    """A CART classification tree (Gini, axis-aligned thresholds), for when scikit-learn is not
    installed; ``fit`` / ``predict_proba`` like scikit-learn's."""

    def __init__(self, max_depth: int = 8, min_leaf: int = 5) -> None:
        self.max_depth = max_depth
        self.min_leaf = min_leaf
        self._root: object = None

    def fit(self, x: Sequence[Sequence[float]], y: Sequence[int]) -> SmallTree:
        rows = [list(map(float, r)) for r in x]
        self._root = self._grow(rows, [int(v) for v in y], 0)
        return self

    def _grow(self, x: list[list[float]], y: list[int], depth: int) -> object:
        pos = sum(y)
        if depth >= self.max_depth or pos in (0, len(y)) or len(y) < 2 * self.min_leaf:
            return (pos + 1) / (len(y) + 2)
        best = None
        total_gini = _gini(pos, len(y))
        for f in range(len(x[0])):
            order = sorted(range(len(y)), key=lambda i: x[i][f])
            left_pos = 0
            for k in range(1, len(order)):
                left_pos += y[order[k - 1]]
                a, b = x[order[k - 1]][f], x[order[k]][f]
                if a == b or k < self.min_leaf or len(order) - k < self.min_leaf:
                    continue
                gain = total_gini - (k * _gini(left_pos, k) + (len(y) - k)
                                     * _gini(pos - left_pos, len(y) - k)) / len(y)
                if best is None or gain > best[0]:
                    best = (gain, f, (a + b) / 2)
        if best is None or best[0] <= 1e-12:
            return (pos + 1) / (len(y) + 2)
        _, f, t = best
        li = [i for i in range(len(y)) if x[i][f] <= t]
        ri = [i for i in range(len(y)) if x[i][f] > t]
        return (f, t, self._grow([x[i] for i in li], [y[i] for i in li], depth + 1),
                self._grow([x[i] for i in ri], [y[i] for i in ri], depth + 1))

    def predict_proba(self, x: Sequence[Sequence[float]]) -> list[list[float]]:
        out = []
        for row in x:
            node = self._root
            while isinstance(node, tuple):
                f, t, left, right = node
                node = left if row[f] <= t else right
            assert isinstance(node, float)
            out.append([1.0 - node, node])
        return out


def _gini(pos: int, n: int) -> float:
    if n == 0:
        return 0.0
    q = pos / n
    return 2 * q * (1 - q)


def make_model(kind: str = "auto", seed: int = 0) -> object:
    """A fresh classifier: ``"boosting"`` (scikit-learn's HistGradientBoostingClassifier),
    ``"tree"`` (scikit-learn's DecisionTreeClassifier, depth 8), ``"small"``
    (:class:`SmallTree`), or ``"auto"`` (boosting when scikit-learn is installed, else small).

    Raises:
        ImportError: ``boosting`` or ``tree`` without scikit-learn.
        ValueError: an unknown kind.
    """
    if kind == "auto":
        try:
            import sklearn  # noqa: F401
        except ImportError:
            return SmallTree()
        kind = "boosting"
    if kind == "boosting":
        from sklearn.ensemble import HistGradientBoostingClassifier

        return HistGradientBoostingClassifier(max_iter=200, learning_rate=0.1, random_state=seed)
    if kind == "tree":
        from sklearn.tree import DecisionTreeClassifier

        return DecisionTreeClassifier(max_depth=8, min_samples_leaf=5, random_state=seed)
    if kind == "small":
        return SmallTree()
    raise ValueError(f"unknown classifier kind {kind!r}")


class ChallengeClassifier:
    """The node's detector: features (:func:`features`) and a trained model.

    Args:
        public: the public data sets' prompts the node knows.
        chain: the chain's view (menu, epoch length; its ``seen`` grows with :meth:`observe`).
        kind: :func:`make_model`'s kind.
        seed: the model's random state.
        lm: the node's model as ``text -> (tokens, mean NLL)`` (:func:`features`); None: the
            ``model`` features are 0.
    """

    def __init__(self, public: Iterable[str] = (), *, chain: ChainView | None = None,
                 kind: str = "auto", seed: int = 0,
                 lm: Callable[[str], tuple[int, float]] | None = None) -> None:
        self.public = PublicIndex(public)
        self.chain = chain or ChainView()
        self.kind = kind
        self.seed = seed
        self.lm = lm
        self.model: object = None

    def vector(self, view: RequestView) -> list[float]:
        return features(view, self.chain, self.public, self.lm)

    def fit(self, views: Sequence[RequestView] | Sequence[Sequence[float]],
            labels: Sequence[int]) -> ChallengeClassifier:
        """Train on labelled requests (views, or vectors already made by :meth:`vector`)."""
        x = [self.vector(v) if isinstance(v, RequestView) else list(v) for v in views]
        self.model = make_model(self.kind, self.seed)
        self.model.fit(x, list(labels))  # type: ignore[attr-defined]
        return self

    def probability(self, view: RequestView | Sequence[float]) -> float:
        """P(challenge) of one request, in [0, 1].

        Raises:
            RuntimeError: not trained yet.
        """
        if self.model is None:
            raise RuntimeError("train the classifier first (fit)")
        x = self.vector(view) if isinstance(view, RequestView) else list(view)
        return float(self.model.predict_proba([x])[0][1])  # type: ignore[attr-defined]

    def is_challenge(self, view: RequestView, threshold: float = 0.5) -> bool:
        return self.probability(view) >= threshold

    def observe(self, view: RequestView) -> None:
        """Remember the request's prompt (the ``seen_before`` feature of later requests)."""
        self.chain.seen.add(request_text(view.query))


def columns(vectors: Sequence[Sequence[float]], groups: Iterable[str]) -> list[list[float]]:
    """``vectors`` restricted to the features of ``groups`` (keys of :data:`GROUPS`)."""
    names = {n for g in groups for n in GROUPS[g]}
    keep = [i for i, n in enumerate(FEATURES) if n in names]
    return [[v[i] for i in keep] for v in vectors]


def cross_validate(vectors: Sequence[Sequence[float]], labels: Sequence[int], *, folds: int = 5,
                   seed: int = 0, kind: str = "auto",
                   blocks: Sequence[int] | None = None) -> list[float]:
    """Accuracy of each fold of a stratified ``folds``-fold cross-validation (shuffled by
    ``seed``); a fresh model per fold.

    ``blocks`` (e.g. each request's epoch, non-decreasing): folds are ``folds`` contiguous runs
    of blocks instead, so no fold trains on requests of the same epochs as it tests (a user's
    session spans a few minutes: shuffled folds let the model learn a session's later turns
    from its earlier ones, which a node, labelled only after each epoch, cannot)."""
    rng = random.Random(seed)
    fold_of = [0] * len(labels)
    if blocks is not None:
        first, last = min(blocks), max(blocks)
        span = last - first + 1
        fold_of = [min(folds - 1, (b - first) * folds // span) for b in blocks]
    else:
        by_class: dict[int, list[int]] = {}
        for i, y in enumerate(labels):
            by_class.setdefault(int(y), []).append(i)
        for idx in by_class.values():
            rng.shuffle(idx)
            for k, i in enumerate(idx):
                fold_of[i] = k % folds
    accuracies = []
    for f in range(folds):
        train = [i for i in range(len(labels)) if fold_of[i] != f]
        test = [i for i in range(len(labels)) if fold_of[i] == f]
        model = make_model(kind, seed)
        model.fit([vectors[i] for i in train], [labels[i] for i in train])  # type: ignore[attr-defined]
        proba = model.predict_proba([vectors[i] for i in test])  # type: ignore[attr-defined]
        hits = sum((p[1] >= 0.5) == bool(labels[i]) for p, i in zip(proba, test))
        accuracies.append(hits / len(test))
    return accuracies


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """The area under the ROC curve of ``scores`` for ``labels`` (1 positive), ties counted
    half (the Mann-Whitney U statistic over n1 x n0); 0.5 when a class is empty."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return 0.5
    return (sum(r for r, y in zip(ranks, labels) if y) - pos * (pos + 1) / 2) / (pos * neg)


def univariate_scan(vectors: Sequence[Sequence[float]],
                    labels: Sequence[int]) -> list[tuple[str, float]]:
    """Each feature alone: (name, AUC) of its raw value as a challenge score, the ones
    farthest from 0.5 first (an AUC of 0.3 separates as well as 0.7). The best single feature
    usually names the leak."""
    out = [(name, auc([v[i] for v in vectors], labels)) for i, name in enumerate(FEATURES)]
    return sorted(out, key=lambda kv: -abs(kv[1] - 0.5))


def importances(vectors: Sequence[Sequence[float]], labels: Sequence[int],
                kind: str = "tree", seed: int = 0) -> list[tuple[str, float]]:
    """The features a depth-8 tree splits on most (scikit-learn's impurity importances), the
    top ones first; empty without scikit-learn."""
    try:
        model = make_model(kind, seed)
    except ImportError:
        return []
    model.fit(list(vectors), list(labels))  # type: ignore[attr-defined]
    values = getattr(model, "feature_importances_", None)
    if values is None:
        return []
    ranked = sorted(zip(FEATURES, map(float, values)), key=lambda kv: -kv[1])
    return [kv for kv in ranked if kv[1] > 0]


__all__ = [
    "FEATURES",
    "GROUPS",
    "ChainView",
    "ChallengeClassifier",
    "PublicIndex",
    "RequestView",
    "SmallTree",
    "auc",
    "columns",
    "cross_validate",
    "features",
    "importances",
    "make_model",
    "mix_logp",
    "request_text",
    "shingles",
    "univariate_scan",
]
