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
  parameters are exactly a menu entry), the prompts the node has been asked before, and any
  prompt published in clear in an earlier report;
* public data sets (:class:`PublicIndex`): the prompt verbatim, or its word 5-grams' Jaccard
  similarity to the nearest public prompt.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ps_p2p.inference import InferenceQuery

SHINGLE = 5
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
    "chain": ("in_menu", "seen_before", "published_before"),
    "public": ("public_verbatim", "public_jaccard"),
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
    """

    query: InferenceQuery
    q_bytes: int
    epoch_offset_s: float
    since_previous_s: float = math.inf
    index_in_epoch: int = 0


@dataclass
class ChainView:
    """What the chain told the node, and what it remembers of its own traffic.

    Attributes:
        menu: the genesis' sampling menu as (max_tokens, temperature, top_p) triples.
        epoch_s: the epoch's length in seconds (``epoch_ms`` / 1000; for ``epoch_fraction``).
        published: prompts read in clear from earlier reports (before issue 16's sealing).
        seen: prompts this node was asked before (updated by :meth:`ChallengeClassifier.
            observe`).
    """

    menu: tuple[tuple[int, float, float], ...] = ()
    epoch_s: float = 300.0
    published: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)


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

    def __contains__(self, text: str) -> bool:
        return text.strip() in self.verbatim


def request_text(query: InferenceQuery) -> str:
    """The text a request asks about: the prompt, or the last user message of a chat."""
    if not query.messages:
        return query.prompt
    users = [m.content for m in query.messages if m.role == "user"]
    return users[-1] if users else query.messages[-1].content


def features(view: RequestView, chain: ChainView | None = None,
             public: PublicIndex | None = None) -> list[float]:
    """The feature vector of one request (:data:`FEATURES` order); pure."""
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
    """

    def __init__(self, public: Iterable[str] = (), *, chain: ChainView | None = None,
                 kind: str = "auto", seed: int = 0) -> None:
        self.public = PublicIndex(public)
        self.chain = chain or ChainView()
        self.kind = kind
        self.seed = seed
        self.model: object = None

    def vector(self, view: RequestView) -> list[float]:
        return features(view, self.chain, self.public)

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
                   seed: int = 0, kind: str = "auto") -> list[float]:
    """Accuracy of each fold of a stratified ``folds``-fold cross-validation (shuffled by
    ``seed``); a fresh model per fold."""
    rng = random.Random(seed)
    by_class: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        by_class.setdefault(int(y), []).append(i)
    fold_of = [0] * len(labels)
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
    "columns",
    "cross_validate",
    "features",
    "importances",
    "make_model",
    "request_text",
    "shingles",
]
