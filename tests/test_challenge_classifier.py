"""The challenge detector of issue 18 and its user-traffic model (ps_p2p/testing)."""

from __future__ import annotations

import random

import pytest

from ps_p2p.errors import RequestTooLargeError
from ps_p2p.inference import InferenceQuery, SamplingParams
from ps_p2p.testing.api_traffic import Conversation, api_asks, query_of_ask, user_body
from ps_p2p.testing.challenge_classifier import (
    FEATURES,
    GROUPS,
    ChainView,
    ChallengeClassifier,
    PublicIndex,
    RequestView,
    SmallTree,
    columns,
    cross_validate,
    features,
)


def _view(prompt: str, *, max_tokens: int = 128, at: float = 10.0) -> RequestView:
    q = InferenceQuery(b"r" * 16, "m", prompt, SamplingParams(max_tokens=max_tokens), ())
    return RequestView(q, 100, at)


def test_groups_cover_every_feature_once():
    names = [n for g in GROUPS.values() for n in g]
    assert sorted(names) == sorted(FEATURES)
    assert len(columns([list(range(len(FEATURES)))], ["timing"])[0]) == len(GROUPS["timing"])


def test_features_flag_menu_entries_public_prompts_and_reuse():
    public = PublicIndex(["Write a poem about the deep blue sea and its many fish"])
    chain = ChainView(menu=((64, 0.0, 1.0),), seen={"asked before"})
    v = dict(zip(FEATURES, features(_view("write a poem about the deep blue sea and its fish",
                                            max_tokens=64), chain, public)))
    assert v["in_menu"] == 1.0 and v["public_verbatim"] == 0.0 and v["public_jaccard"] > 0.5
    v = dict(zip(FEATURES, features(_view("asked before"), chain, public)))
    assert v["in_menu"] == 0.0 and v["seen_before"] == 1.0 and v["public_jaccard"] == 0.0


def test_small_tree_learns_a_threshold():
    x = [[i, 0.0] for i in range(100)]
    y = [int(i >= 37) for i in range(100)]
    proba = SmallTree().fit(x, y).predict_proba([[10, 0.0], [80, 0.0]])
    assert proba[0][1] < 0.2 and proba[1][1] > 0.8


def test_classifier_separates_challenges_sent_at_the_epoch_start():
    rng = random.Random(1)
    views = [_view("tell me a story", at=rng.uniform(0, 2)) for _ in range(60)]
    views += [_view("tell me a story", at=rng.uniform(0, 300)) for _ in range(60)]
    labels = [1] * 60 + [0] * 60
    clf = ChallengeClassifier(kind="small").fit(views, labels)
    assert clf.is_challenge(_view("x", at=0.5)) and not clf.is_challenge(_view("x", at=200))
    vectors = [clf.vector(v) for v in views]
    assert min(cross_validate(vectors, labels, kind="small")) >= 0.9


def test_classifier_is_at_chance_on_identical_traffic():
    views = [_view("tell me a story", at=10.0) for _ in range(100)]
    labels = [i % 2 for i in range(100)]
    clf = ChallengeClassifier(kind="small")
    accs = cross_validate([clf.vector(v) for v in views], labels, kind="small")
    assert sum(accs) / len(accs) <= 0.6


def test_api_bodies_reach_the_model_node_as_the_api_sends_them():
    rng = random.Random(4)
    item = Conversation("Why is the sky blue?", ("hi", "hello"))
    bodies = [user_body(rng, item) for _ in range(40)]
    asks = api_asks(bodies)
    assert all(len(a) == body.get("n", 1) for (_, body), a in zip(bodies, asks))
    for (path, body), (ask, *_) in zip(bodies, asks):
        q, raw = query_of_ask(ask, rng)
        assert q.stream == bool(body.get("stream"))
        assert bool(q.messages) == path.endswith("/chat/completions")
        expected_max = body.get("max_completion_tokens") or body.get("max_tokens") or 128
        assert q.params.max_tokens == expected_max
        assert q.params.seed == body.get("seed")  # None: unseeded (null or left out)
        assert abs(q.params.temperature - body.get("temperature", 0.0)) < 1e-6
        assert len(raw) > 0


def test_a_request_over_a_cell_is_refused_like_the_client_does():
    with pytest.raises(RequestTooLargeError):
        query_of_ask({"prompt": "x" * (4 * 1024 * 1024 + 1)}, random.Random(1))


def test_features_see_follow_ups_proxy_links_and_the_committed_mix():
    from ps_p2p.inference import ChatMessage
    from ps_p2p.verification.challenges import DEFAULT_MIX
    from ps_p2p.verification.mix import histogram_of

    chat = (ChatMessage("user", "first turn"), ChatMessage("assistant", "an answer"),
            ChatMessage("user", "a follow-up"))
    q = InferenceQuery(b"r" * 16, "m", "", SamplingParams(), (), messages=chat)
    chain = ChainView(seen={"first turn"}, mix=histogram_of(DEFAULT_MIX))
    v = dict(zip(FEATURES, features(RequestView(q, 100, 5.0, linked_epoch=2,
                                                linked_challenge=True), chain)))
    assert v["earlier_seen"] == 1.0 and v["assistant_turns"] == 1.0
    assert v["linked_epoch"] == 2.0 and v["linked_challenge"] == 1.0
    # a shape DEFAULT_MIX never draws (top_p 0.5 is no bucket of it) is less likely
    odd = InferenceQuery(b"r" * 16, "m", "", SamplingParams(top_p=0.5), (), messages=chat)
    w = dict(zip(FEATURES, features(RequestView(odd, 100, 5.0), chain)))
    assert w["mix_logp"] < v["mix_logp"] < 0.0
    public = PublicIndex(["one two three four five six seven"])
    assert public.containment("one two three four five six eight nine") == pytest.approx(2 / 4)


def test_the_single_feature_scan_ranks_the_leaking_feature_first():
    from ps_p2p.testing.challenge_classifier import auc, univariate_scan

    assert auc([1, 2, 3, 4], [0, 0, 1, 1]) == 1.0 and auc([1, 1, 1, 1], [0, 1, 0, 1]) == 0.5
    rng = random.Random(3)
    vectors = [[0.0] * len(FEATURES) for _ in range(200)]
    labels = [i % 2 for i in range(200)]
    leak = FEATURES.index("linked_epoch")
    for v, y in zip(vectors, labels):
        v[leak] = rng.random() + (0.8 if y else 0.0)
        v[0] = rng.random()
    assert univariate_scan(vectors, labels)[0][0] == "linked_epoch"


def test_folds_by_epoch_never_train_on_the_epochs_they_test():
    # each epoch's requests share a value and a label (a session): shuffled folds learn the
    # value from the same epoch's other requests, folds by epoch cannot
    rng = random.Random(5)
    marks = [(rng.random(), rng.randrange(2)) for _ in range(20)]
    x = [[marks[e][0]] for e in range(20) for _ in range(10)]
    y = [marks[e][1] for e in range(20) for _ in range(10)]
    blocks = [e for e in range(20) for _ in range(10)]
    shuffled = sum(cross_validate(x, y, folds=5, kind="small")) / 5
    by_epoch = sum(cross_validate(x, y, folds=5, kind="small", blocks=blocks)) / 5
    assert shuffled > 0.9 and by_epoch < 0.7
