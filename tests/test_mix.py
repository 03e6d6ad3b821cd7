"""The users' mix of request shapes (issue 18): what a verifier's API records and publishes
(:mod:`ps_p2p.verification.mix`), the MIX_REPORT transaction and the committed mix the next
epoch's challenges are drawn from (:mod:`ps_p2p.verification.ledger`, :mod:`ps_p2p.registry`);
pure table tests."""

from __future__ import annotations

import hashlib
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p import registry as app
from ps_p2p.consensus.encoding import lp, u8, u32, u64
from ps_p2p.errors import InvalidTransactionError, RemoteProtocolError
from ps_p2p.inference import ChatMessage
from ps_p2p.verification import ledger
from ps_p2p.verification.challenges import DEFAULT_MIX, derive_request
from ps_p2p.verification.epochs import Challenge
from ps_p2p.verification.mix import (
    DEFAULT_HISTOGRAM,
    DIMENSIONS,
    SCALE,
    RequestShape,
    ShapeHistogram,
    ShapeRecorder,
    aggregate,
    histogram_of,
    mix_of,
    normalize,
    read_histogram,
)
from tests.test_epoch_ledger import (
    CHAIN,
    KEYS,
    OUTSIDER,
    errors,
    next_epoch,
    run,
    start_epoch_1,
)

NODE = b"\x00\x24" + bytes(36)
DIM = {name: i for i, (name, _) in enumerate(DIMENSIONS)}


def bucket(name: str, value) -> int:
    return DIMENSIONS[DIM[name]][1].index(value)


def shifted() -> ShapeHistogram:
    """A users' mix far from DEFAULT_MIX: mostly completions, streamed, hot, short, seeded."""
    rows = [list(r) for r in DEFAULT_HISTOGRAM.shares]

    def only(name: str, shares: dict) -> None:
        row = [0] * len(DIMENSIONS[DIM[name]][1])
        for value, share in shares.items():
            row[bucket(name, value)] = share
        rows[DIM[name]] = row

    only("endpoint", {"chat": 3000, "completion": 7000})
    only("stream_completion", {False: 2000, True: 8000})
    only("temperature", {1.0: 6000, 0.0: 1000, ("range", 1.01, 2.0): 3000})
    only("max_tokens", {64: 5000, ("range", 129, 511): 5000})
    only("seed", {None: 4000, 0: 3000, "random": 3000})
    return ShapeHistogram(tuple(tuple(r) for r in rows))


def requests(mix, count: int = 3000):
    return [derive_request(hashlib.sha256(b"%d" % i).digest(), 1, 0, Challenge(NODE, i),
                           "What is a monad?", mix) for i in range(count)]


def shape_of(r) -> RequestShape:
    kwargs = r.ask_kwargs()
    return RequestShape.of_ask(kwargs.pop("prompt"), kwargs.pop("messages"), stream=r.stream,
                               **kwargs)


# ------------------------------------------------------------------------------ histograms


def test_the_default_mix_survives_its_histogram():
    DEFAULT_HISTOGRAM.check()
    assert histogram_of(mix_of(DEFAULT_HISTOGRAM)) == DEFAULT_HISTOGRAM
    assert mix_of(None) is DEFAULT_MIX  # the genesis mix: challenges as before any report


def test_challenges_drawn_from_a_learned_mix_follow_its_shares():
    h = shifted()
    rs = requests(mix_of(h))
    rec = ShapeRecorder(k=0, epsilon=math.inf, min_requests=1)
    for r in rs:
        rec.record(shape_of(r))
    got = rec.take(random.Random(0))
    assert got is not None
    for name in ("endpoint", "stream_completion", "temperature", "max_tokens", "seed"):
        want, seen = h.dimension(name), got.dimension(name)
        assert sum(abs(a - b) for a, b in zip(want, seen)) < 0.06 * SCALE, name
    hot = [r.temperature for r in rs if r.temperature > 1.0]
    assert hot and all(1.01 <= t <= 2.0 for t in hot) and len(set(hot)) > 20
    mid = [r.max_tokens for r in rs if r.max_tokens not in (64,)]
    assert mid and all(129 <= m <= 511 for m in mid) and len(set(mid)) > 50
    assert {r.seed for r in rs} >= {None, 0} and any(r.seed not in (None, 0) for r in rs)


@pytest.mark.parametrize("kwargs, name, value", [
    ({"temperature": 0.7}, "temperature", 0.7),
    ({"temperature": 0.73}, "temperature", ("range", 0.01, 0.99)),
    ({"temperature": None}, "temperature", 0.0),
    ({"temperature": 1.3}, "temperature", ("range", 1.01, 2.0)),
    ({"top_p": 0.92}, "top_p", ("range", 0.01, 0.99)),
    ({"max_tokens": None}, "max_tokens", 128),
    ({"max_tokens": 300}, "max_tokens", 300),
    ({"max_tokens": 301}, "max_tokens", ("range", 129, 511)),
    ({"max_tokens": 9000}, "max_tokens", ("range", 2049, 4095)),
    ({"seed": 7}, "seed", "random"),
    ({"seed": 0}, "seed", 0),
    ({"stop": ("a", "b", "c")}, "stop", "list"),
])
def test_a_request_is_kept_only_as_its_buckets(kwargs, name, value):
    shape = RequestShape.of_ask("a secret prompt", **kwargs)
    assert (DIM[name], bucket(name, value)) in shape.buckets()
    assert "secret" not in repr(shape)


def test_a_chats_system_prompt_and_earlier_exchange_are_counted_not_their_text():
    msgs = (ChatMessage("system", "s"), ChatMessage("user", "a"),
            ChatMessage("assistant", "b"), ChatMessage("user", "c"))
    b = RequestShape.of_ask(messages=msgs, stream=True).buckets()
    assert {(DIM["endpoint"], 0), (DIM["stream_chat"], 1), (DIM["system"], 1),
            (DIM["earlier"], 1)} <= set(b)
    assert all(d != DIM["stream_completion"] for d, _ in b)


def test_a_window_is_published_only_with_enough_requests_and_then_forgotten():
    rec = ShapeRecorder(k=0, epsilon=math.inf, min_requests=10)
    for _ in range(9):
        rec.record(RequestShape.of_ask("p"))
    assert rec.take(random.Random(0)) is None and rec.requests == 9  # kept for later
    rec.record(RequestShape.of_ask("p"))
    assert rec.take(random.Random(0)) is not None
    assert rec.requests == 0 and rec.take(random.Random(0)) is None


def test_a_bucket_below_k_is_suppressed():
    rec = ShapeRecorder(k=10, epsilon=math.inf, min_requests=1)
    for i in range(50):
        rec.record(RequestShape.of_ask("p", temperature=1.5 if i < 9 else 0.7))
    got = rec.take(random.Random(0))
    assert got is not None
    assert got.dimension("temperature")[bucket("temperature", 1.5)] == 0
    assert got.dimension("temperature")[bucket("temperature", 0.7)] == SCALE


def test_published_counts_are_noised():
    def publish(seed: int) -> ShapeHistogram:
        rec = ShapeRecorder(k=0, epsilon=1.0, min_requests=1)
        for i in range(400):
            rec.record(RequestShape.of_ask("p", temperature=(0.0, 0.7, 1.0)[i % 3]))
        out = rec.take(random.Random(seed))
        assert out is not None
        return out

    rows = {publish(s).dimension("temperature") for s in range(20)}
    assert len(rows) > 10  # noise, not the exact thirds
    exact = normalize([134, 133, 133])
    for row in rows:
        for value, share in zip((0.0, 0.7, 1.0), exact):
            assert abs(row[bucket("temperature", value)] - share) < 0.2 * SCALE


# ------------------------------------------------------------------------------ aggregation


def test_the_committed_mix_moves_a_quarter_of_the_way_and_converges():
    target = shifted()
    h = None
    distances = []
    for _ in range(40):
        h = aggregate(h, [(1, target)] * 3, 4)
        distances.append(sum(abs(a - b) for x, y in zip(h.shares, target.shares)
                             for a, b in zip(x, y)))
    first = aggregate(None, [(1, target)] * 3, 4).dimension("endpoint")
    assert first == normalize([3 * d + t for d, t in zip(DEFAULT_HISTOGRAM.dimension("endpoint"),
                                                          target.dimension("endpoint"))])
    assert all(b <= a for a, b in itertools.pairwise(distances))
    assert distances[-1] <= 0.01 * SCALE * len(DIMENSIONS)


def test_without_two_thirds_of_the_power_reporting_the_mix_stays():
    assert aggregate(None, [(1, shifted())] * 2, 3) == DEFAULT_HISTOGRAM  # 2 of 3: not > 2/3
    assert aggregate(None, [(1, shifted())] * 3, 4) != DEFAULT_HISTOGRAM


@settings(max_examples=60, deadline=None)
@given(byzantine=st.lists(st.lists(st.integers(0, SCALE), min_size=2, max_size=2), max_size=3),
       honest=st.integers(1, SCALE - 1), count=st.integers(3, 7))
def test_validators_with_a_third_of_the_power_cannot_move_the_mix(byzantine, honest, count):
    # count honest validators of power 1 report the same endpoint share; the others, holding
    # less than a third of the power in all, report anything
    byzantine = byzantine[:(count - 1) // 2]
    total = count + len(byzantine)
    if 3 * len(byzantine) >= total:
        return

    def report(row) -> ShapeHistogram:
        rows = [list(r) for r in DEFAULT_HISTOGRAM.shares]
        rows[DIM["endpoint"]] = list(normalize(row)) if sum(row) else [0, 0]
        if not sum(row):
            rows[DIM["temperature"]] = list(DEFAULT_HISTOGRAM.dimension("temperature"))
        return ShapeHistogram(tuple(tuple(r) for r in rows))

    honest_h = report([honest, SCALE - honest])
    alone = aggregate(None, [(1, honest_h)] * count, total)
    with_byzantine = aggregate(None, [(1, honest_h)] * count
                               + [(1, report(b)) for b in byzantine], total)
    assert with_byzantine.dimension("endpoint") == alone.dimension("endpoint")


# ------------------------------------------------------------------------------ the chain


def mix_tx(key, epoch: int, h: ShapeHistogram, chain: str = CHAIN) -> bytes:
    return app.encode_tx(ledger.sign_mix_report(key, chain, epoch, h))


def raw_mix_tx(key, epoch: int, hist_bytes: bytes) -> bytes:
    """A MIX_REPORT with any histogram bytes, signed over them."""
    data = (ledger.MIX_REPORT_DOMAIN + lp(CHAIN.encode()) + lp(key.peer_id) + u64(epoch)
            + hist_bytes)
    body = lp(key.peer_id) + u64(epoch) + hist_bytes + lp(key.sign(data))
    return app.TX_DOMAIN + u8(app.TxKind.MIX_REPORT) + body


@pytest.fixture(scope="module")
def epoch1() -> app.AppState:
    return start_epoch_1()


def test_mix_reports_are_committed_and_move_the_next_epochs_mix(epoch1):
    assert epoch1.ledger.mix is None and epoch1.ledger.encode() == epoch1.ledger.encode(mix=False)
    h = shifted()
    state, result, _ = run(epoch1, [mix_tx(k, 1, h) for k in KEYS[:3]])
    assert errors(result) == [None] * 3
    assert state.ledger.mix is None  # this epoch's challenges keep the mix they started with
    assert state.app_hash != run(epoch1, [])[0].app_hash
    assert set(state.ledger.mix_reports) == {k.peer_id for k in KEYS[:3]}
    state, _ = next_epoch(state)
    assert state.ledger.mix == aggregate(None, [(1, h)] * 3, 4)
    # the reports keep counting (their latest) until MIX_REPORT_EPOCHS old
    later, _ = next_epoch(state)
    assert later.ledger.mix == aggregate(state.ledger.mix, [(1, h)] * 3, 4)


def test_a_validators_report_of_a_later_epoch_replaces_its_earlier_one(epoch1):
    state, result, _ = run(epoch1, [mix_tx(KEYS[0], 1, DEFAULT_HISTOGRAM)])
    state, _ = next_epoch(state)
    state, result, _ = run(state, [mix_tx(KEYS[0], 2, shifted())])
    assert errors(result) == [None]
    assert state.ledger.mix_reports == {KEYS[0].peer_id: (2, shifted())}


def _bad(shares_change) -> bytes:
    rows = [list(r) for r in DEFAULT_HISTOGRAM.shares]
    shares_change(rows)
    return ShapeHistogram(tuple(tuple(r) for r in rows)).encode()


def _over(rows):
    rows[0] = [SCALE + 1, 0]


def _short(rows):
    rows[0] = [SCALE - 1, 0]


def _empty(rows):
    for r in rows:
        r[:] = [0] * len(r)


def _extra_bucket(rows):
    rows[5].append(0)


def _extra_dimension(rows):
    rows.append([SCALE])


@pytest.mark.parametrize("build, match", [
    (lambda s: mix_tx(OUTSIDER, 1, DEFAULT_HISTOGRAM), "not a validator"),
    (lambda s: raw_mix_tx(KEYS[0], 1, DEFAULT_HISTOGRAM.encode())[:-64] + bytes(64),
     "not signed by"),
    (lambda s: mix_tx(KEYS[0], 2, DEFAULT_HISTOGRAM), "current epoch is 1"),
    (lambda s: mix_tx(KEYS[0], 1, DEFAULT_HISTOGRAM, chain="another chain"), "not signed by"),
    (lambda s: raw_mix_tx(KEYS[0], 1, _bad(_over)), r"share 10001 not in \[0, 10000\]"),
    (lambda s: raw_mix_tx(KEYS[0], 1, _bad(_short)), "shares sum to 9999"),
    (lambda s: raw_mix_tx(KEYS[0], 1, _bad(_empty)), "without data"),
    (lambda s: raw_mix_tx(KEYS[0], 1, _bad(_extra_bucket)), "16 buckets, expected 15"),
    (lambda s: raw_mix_tx(KEYS[0], 1, _bad(_extra_dimension)), "11 dimensions, expected 10"),
    (lambda s: raw_mix_tx(KEYS[0], 1, DEFAULT_HISTOGRAM.encode()[:-3]),
     "malformed transaction"),
    (lambda s: mix_tx(KEYS[0], 1, DEFAULT_HISTOGRAM) + b"\0", "trailing bytes"),
    (lambda s: raw_mix_tx(KEYS[0], 1, u8(10) + u8(250) + bytes(4_000)),
     "endpoint: 250 buckets, expected 2"),
    (lambda s: raw_mix_tx(KEYS[0], 1, bytes(s.genesis.limits.max_tx_bytes)), "bytes \\(max"),
], ids=["outsider", "signature", "future epoch", "other chain", "share over scale",
        "sum not scale", "no data", "extra bucket", "extra dimension", "truncated", "trailing",
        "oversized bucket count", "over max_tx_bytes"])
def test_a_malformed_or_out_of_range_mix_report_is_refused_and_changes_nothing(build, match,
                                                                               epoch1):
    tx = build(epoch1)
    with pytest.raises(InvalidTransactionError, match=match):
        app.check_tx(tx, epoch1, epoch1.time_ms + 1000)
    if len(tx) > epoch1.genesis.limits.max_tx_bytes:
        return  # no block can carry it (consensus.block.validate_block)
    new, result, _ = run(epoch1, [tx])
    assert not result.tx_results[0].ok
    assert new.ledger.encode() == epoch1.ledger.encode()
    assert new.app_hash == run(epoch1, [])[0].app_hash


def test_a_second_mix_report_in_one_epoch_is_refused(epoch1):
    state, result, _ = run(epoch1, [mix_tx(KEYS[0], 1, DEFAULT_HISTOGRAM)])
    assert errors(result) == [None]
    tx = mix_tx(KEYS[0], 1, shifted())
    with pytest.raises(InvalidTransactionError, match="already reported a mix in epoch 1"):
        app.check_tx(tx, state, state.time_ms + 1000)
    new, result, _ = run(state, [tx])
    assert not result.tx_results[0].ok and new.ledger.encode() == state.ledger.encode()


def test_a_histogram_from_bytes_is_checked():
    assert read_histogram(DEFAULT_HISTOGRAM.encode()) == DEFAULT_HISTOGRAM
    with pytest.raises(RemoteProtocolError, match="shares sum"):
        read_histogram(_bad(_short))
    with pytest.raises(RemoteProtocolError, match="trailing"):
        read_histogram(DEFAULT_HISTOGRAM.encode() + u32(0))


def test_a_snapshot_carries_the_committed_mix_and_the_app_hash_covers_it(epoch1):
    from ps_p2p.registry.snapshot import decode_state, encode_state

    state, _, _ = run(epoch1, [mix_tx(k, 1, shifted()) for k in KEYS[:3]])
    state, _ = next_epoch(state)
    assert state.ledger.mix is not None
    back = decode_state(encode_state(state), app.genesis_state(state.genesis))
    assert back.app_hash == state.app_hash and back.ledger.encode() == state.ledger.encode()
    variant = state.copy()
    variant.ledger = state.ledger.copy()
    variant.ledger.mix = DEFAULT_HISTOGRAM
    variant._registry_aux = None
    assert app.app_hash(variant) != state.app_hash
    plain = decode_state(encode_state(epoch1), app.genesis_state(epoch1.genesis))
    assert plain.app_hash == epoch1.app_hash and plain.ledger.mix is None


def test_the_local_api_records_each_requests_shape_for_its_verifier():
    import trio

    from ps_p2p.api.openai_compat import ApiError, ChatBody, UserAPI
    from ps_p2p.testing.api_traffic import RecordingUser

    class Node:
        user = RecordingUser()
        shape_recorder = ShapeRecorder(k=0, epsilon=math.inf, min_requests=1)

    api = UserAPI(Node())
    body = ChatBody.model_validate({
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "my private question"}],
        "temperature": 1.3, "max_tokens": 300, "n": 2})

    async def ask() -> None:
        with pytest.raises(ApiError):  # the recording user answers nothing
            await api._generate(body, messages=body.chat(), chat=True,
                                max_tokens=body.max_tokens)

    trio.run(ask)
    rec = Node.shape_recorder
    assert rec.requests == 2  # n = 2: two requests reach model nodes
    counts = rec.counts()
    assert counts["temperature"][bucket("temperature", ("range", 1.01, 2.0))] == 2
    assert counts["max_tokens"][bucket("max_tokens", 300)] == 2
    assert counts["system"][1] == 2 and counts["endpoint"][0] == 2
    assert "private" not in repr(vars(rec))
