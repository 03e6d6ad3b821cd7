"""vLLM KV-cache events: the pure decoder and seq tracker, and the ZMQ subscriber against the
fake publisher (DESIGN.md "vLLM 0.33", KV-cache events)."""

from __future__ import annotations

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from ps_p2p.engines.vllm_engine import KVEventSubscriber, VLLMEngine
from ps_p2p.engines.vllm_kv_events import (
    END_SEQ,
    EventBuffer,
    EventsDecoded,
    KVEventLimits,
    KVEventStream,
    MessageRejected,
    ReplayEnd,
    ReplayRequested,
    Resynced,
    decode_batch,
    encode_seq,
    endpoint_for_rank,
    parse_replay_message,
)
from ps_p2p.errors import ConfigError, KVEventDecodeError
from ps_p2p.testing.fake_kv_publisher import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    open_fake_kv_publisher,
    open_fake_kv_publishers,
)

BIG = 2**64 - 1  # a uint64 block hash above int64's range
TOPIC = b"kv"


def payload(events, *, ts=1.5, rank=0):
    batch = [ts, events] if rank is None else [ts, events, rank]
    return msgpack.packb(batch)


def live(seq, events, *, topic=TOPIC):
    return [topic, encode_seq(seq), payload(events)]


def replayed(seq, events):
    return [b"", TOPIC, encode_seq(seq), payload(events)]


REPLAY_END = [b"", b"", encode_seq(END_SEQ), b""]


def removed(seq):
    """A one-event batch that names its seq (BlockRemoved of hash seq)."""
    return [block_removed([seq])]


def applied(outputs):
    """The seqs of the batches applied, None for a reset's AllBlocksCleared."""
    return [o.seq for o in outputs if isinstance(o, EventsDecoded)]


# -- decoding ----------------------------------------------------------------------------------


def test_block_stored_is_read_by_field_name_and_unknown_fields_are_ignored():
    event = {
        "token_ids": [5, 6, 7, 8],
        "future_field": {"nested": [1, 2]},
        "medium": "GPU",
        "block_size": 2,
        "extra_keys": [["mm-hash", 3], None],
        "group_idx": 0,
        "parent_block_hash": 41,
        "lora_name": None,
        "type": "BlockStored",
        "lora_id": None,
        "block_hashes": [42, 43],
    }
    batch = decode_batch(payload([event], ts=12.25, rank=3))
    assert batch.events == (BlockStored((42, 43), 41, (5, 6, 7, 8), 2),)
    assert (batch.ts, batch.data_parallel_rank, batch.skipped_types) == (12.25, 3, ())


def test_block_hashes_above_int64_decode_as_unsigned():
    events = [block_stored([2**63, BIG], 2**63 + 5, [1, 2, 3, 4], 2), block_removed([BIG])]
    decoded = decode_batch(payload(events)).events
    assert decoded == (BlockStored((2**63, BIG), 2**63 + 5, (1, 2, 3, 4), 2), BlockRemoved((BIG,)))


def test_a_missing_or_nil_parent_hash_reads_as_the_prompt_start():
    without = block_stored([7], None, [1, 2], 2)
    del without["parent_block_hash"]
    decoded = decode_batch(payload([without, block_stored([8], None, [3, 4], 2)])).events
    assert [e.parent_block_hash for e in decoded] == [None, None]


def test_removed_and_cleared_events_decode_in_order():
    events = [block_removed([1, 2], group_idx=1), all_blocks_cleared(), block_removed([3])]
    assert decode_batch(payload(events)).events == (
        BlockRemoved((1, 2)), AllBlocksCleared(), BlockRemoved((3,)),
    )


def test_unknown_event_types_are_skipped_and_named():
    events = [{"type": "BlockPinned", "block_hashes": [1]}, block_removed([2])]
    batch = decode_batch(payload(events))
    assert batch.events == (BlockRemoved((2,)),)
    assert batch.skipped_types == ("BlockPinned",)


def test_a_payload_without_its_default_rank_decodes():
    batch = decode_batch(payload([all_blocks_cleared()], rank=None))
    assert (batch.events, batch.data_parallel_rank) == ((AllBlocksCleared(),), None)


SMALL = KVEventLimits(
    max_payload_bytes=4096, max_events_per_batch=2, max_block_hashes_per_event=2,
    max_token_ids_per_event=4, max_block_size=4,
)


def stored(**changes):
    event = block_stored([1, 2], None, [1, 2, 3, 4], 2)
    event.update(changes)
    return event


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"\xc1", id="not-msgpack"),
        pytest.param(payload([]) + b"\x00", id="trailing-bytes"),
        pytest.param(msgpack.packb({"ts": 1, "events": []}), id="batch-not-an-array"),
        pytest.param(msgpack.packb([1.0]), id="batch-too-short"),
        pytest.param(msgpack.packb(["now", []]), id="ts-not-a-number"),
        pytest.param(msgpack.packb([1.0, [], -1]), id="negative-rank"),
        pytest.param(msgpack.packb([1.0, {"a": 1}]), id="events-not-an-array"),
        pytest.param(payload([["BlockRemoved", [1], "GPU"]]), id="array-event-before-0.24"),
        pytest.param(payload([{"block_hashes": [1]}]), id="no-type"),
        pytest.param(payload([{"type": "BlockRemoved"}]), id="no-block-hashes"),
        pytest.param(payload([block_removed([-1])]), id="negative-hash"),
        pytest.param(payload([block_removed([1.5])]), id="float-hash"),
        pytest.param(payload([block_removed([True])]), id="bool-hash"),
        pytest.param(payload([block_removed([b"\x00" * 8])]), id="bytes-hash"),
        pytest.param(payload([stored(parent_block_hash="x")]), id="string-parent"),
        pytest.param(payload([stored(token_ids="abcd")]), id="token-ids-not-an-array"),
        pytest.param(payload([stored(token_ids=[1, 2, 3, -4])]), id="negative-token"),
        pytest.param(payload([stored(block_size=0)]), id="block-size-zero"),
        pytest.param(payload([stored(block_size=8)]), id="block-size-over-limit"),
        pytest.param(payload([stored(token_ids=[1, 2])]), id="tokens-fill-one-of-two-blocks"),
        pytest.param(payload([stored(block_hashes=[1, 2, 3])]), id="too-many-hashes"),
        pytest.param(payload([stored(token_ids=[1] * 5)]), id="too-many-token-ids"),
        pytest.param(payload([all_blocks_cleared()] * 3), id="too-many-events"),
        pytest.param(payload([block_removed([1], pad="x" * 5000)]), id="oversize-payload"),
        pytest.param(msgpack.packb([1.0, [{1: "int key"}]]), id="int-map-key"),
    ],
)
def test_a_malformed_payload_raises_a_decode_error(raw):
    with pytest.raises(KVEventDecodeError):
        decode_batch(raw, SMALL)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids",
                                       "block_size", "medium"]), children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=json_like, junk=st.binary(max_size=40))
def test_any_value_or_bytes_decode_or_raise_a_decode_error_only(value, junk):
    for raw in (msgpack.packb([0.0, [value]]), msgpack.packb(value), junk):
        try:
            decode_batch(raw, SMALL)
        except KVEventDecodeError:
            pass


# -- frames and endpoints ---------------------------------------------------------------------


def test_replay_messages_are_read_with_or_without_the_topic_frame():
    body = payload(removed(4))
    assert parse_replay_message([b"", TOPIC, encode_seq(4), body], topic=TOPIC) == (4, body)
    assert parse_replay_message([b"", encode_seq(4), body], topic=TOPIC) == (4, body)
    assert parse_replay_message(REPLAY_END, topic=TOPIC) == ReplayEnd()
    assert parse_replay_message([b"", encode_seq(END_SEQ), b""], topic=TOPIC) == ReplayEnd()
    with pytest.raises(KVEventDecodeError):
        parse_replay_message([b"x", TOPIC, encode_seq(4), body], topic=TOPIC)


def test_each_data_parallel_rank_has_its_own_port():
    assert endpoint_for_rank("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert endpoint_for_rank("tcp://10.0.0.2:5557", 3) == "tcp://10.0.0.2:5560"
    assert endpoint_for_rank("tcp://[::1]:5558", 1) == "tcp://[::1]:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"


@pytest.mark.parametrize(
    "endpoint, rank",
    [("tcp://*:5557", 0), ("tcp://127.0.0.1", 0), ("http://127.0.0.1:5557", 0),
     ("tcp://127.0.0.1:65535", 1), ("ipc:///tmp/kv", 1)],
)
def test_an_endpoint_that_cannot_be_connected_to_is_a_config_error(endpoint, rank):
    with pytest.raises(ConfigError):
        endpoint_for_rank(endpoint, rank)


# -- the seq tracker --------------------------------------------------------------------------


def test_batches_in_order_are_applied_in_order():
    stream = KVEventStream(topic=TOPIC, replay=True)
    outputs = [o for seq in range(3) for o in stream.receive_live(live(seq, removed(seq)))]
    assert [o.events for o in outputs] == [(BlockRemoved((s,)),) for s in range(3)]
    assert stream.next_seq == 3 and not stream.replaying


def test_a_gap_requests_a_replay_that_fills_it_and_duplicates_are_dropped():
    stream = KVEventStream(topic=TOPIC, replay=True)
    stream.receive_live(live(0, removed(0)))
    assert stream.receive_live(live(3, removed(3))) == [ReplayRequested(1)]
    assert stream.replaying
    assert stream.receive_live(live(4, removed(4))) == []  # held while replaying
    out = []
    for seq in (0, 1, 2, 3):  # 0: already applied; 3: also held
        out += stream.receive_replay(replayed(seq, removed(seq)))
    out += stream.receive_replay(REPLAY_END)
    assert applied(out) == [1, 2, 3, 4]
    assert [o.events for o in out] == [(BlockRemoved((s,)),) for s in (1, 2, 3, 4)]
    assert (stream.stats.gaps, stream.stats.duplicates, stream.stats.resnapshots) == (1, 2, 0)
    assert not stream.replaying


def test_a_replay_that_starts_late_resets_the_view_and_rebuilds():
    stream = KVEventStream(topic=TOPIC, replay=True)
    stream.receive_live(live(0, removed(0)))
    stream.receive_live(live(5, removed(5)))
    out = stream.receive_replay(replayed(3, removed(3)))  # the publisher dropped 1 and 2
    assert isinstance(out[0], Resynced) and out[0].reason == "gap"
    assert out[1] == EventsDecoded(None, (AllBlocksCleared(),))
    assert applied(out) == [None, 3]
    out = stream.receive_replay(replayed(4, removed(4))) + stream.receive_replay(REPLAY_END)
    assert applied(out) == [4, 5]
    assert stream.stats.resnapshots == 1


def test_a_failed_replay_resets_the_view_then_applies_the_held_batches():
    stream = KVEventStream(topic=TOPIC, replay=True)
    stream.receive_live(live(0, removed(0)))
    stream.receive_live(live(2, removed(2)))
    out = stream.receive_replay(replayed(1, removed(1))) + stream.replay_failed("timeout")
    assert applied(out) == [1, None, 2]
    assert (stream.stats.replay_failures, stream.stats.resnapshots) == (1, 1)
    assert stream.receive_replay(replayed(3, removed(3))) == []  # no replay runs any more


def test_a_replay_that_ends_short_of_a_held_batch_resets_the_view():
    stream = KVEventStream(topic=TOPIC, replay=True)
    stream.receive_live(live(0, removed(0)))
    stream.receive_live(live(3, removed(3)))
    out = stream.receive_replay(replayed(1, removed(1))) + stream.receive_replay(REPLAY_END)
    assert applied(out) == [1, None, 3]


def test_without_a_replay_endpoint_a_gap_resets_the_view_at_once():
    stream = KVEventStream(topic=TOPIC, replay=False)
    assert stream.start() == []
    stream.receive_live(live(0, removed(0)))
    out = stream.receive_live(live(2, removed(2)))
    assert applied(out) == [None, 2]
    assert (stream.stats.gaps, stream.stats.resnapshots, stream.stats.replays) == (1, 1, 0)


def test_a_seq_going_back_is_a_publisher_restart_that_clears_the_view():
    stream = KVEventStream(topic=TOPIC, replay=False)
    for seq in range(3):
        stream.receive_live(live(seq, removed(seq)))
    out = stream.receive_live(live(0, removed(0)))
    assert isinstance(out[0], Resynced) and out[0].reason == "restart"
    assert applied(out) == [None, 0]
    assert stream.stats.restarts == 1 and stream.next_seq == 1


def test_live_batches_a_replay_already_brought_are_duplicates_not_a_restart():
    stream = KVEventStream(topic=TOPIC, replay=True)
    stream.start()
    for seq in (0, 1):
        stream.receive_replay(replayed(seq, removed(seq)))
    stream.receive_replay(REPLAY_END)
    out = [o for seq in (0, 1, 2) for o in stream.receive_live(live(seq, removed(seq)))]
    assert applied(out) == [2]
    assert (stream.stats.duplicates, stream.stats.restarts) == (2, 0)


def test_start_asks_for_everything_the_publisher_still_holds():
    stream = KVEventStream(topic=TOPIC, replay=True)
    assert stream.start() == [ReplayRequested(0)]
    out = stream.receive_replay(replayed(7, removed(7))) + stream.receive_replay(REPLAY_END)
    assert applied(out) == [None, 7]  # seqs 0-6 are gone: the view starts from a reset


def test_too_many_held_batches_abandon_the_replay():
    limits = KVEventLimits(max_pending_batches=2)
    stream = KVEventStream(topic=TOPIC, replay=True, limits=limits)
    stream.receive_live(live(0, removed(0)))
    stream.receive_live(live(2, removed(2)))
    stream.receive_live(live(3, removed(3)))
    out = stream.receive_live(live(4, removed(4)))
    assert applied(out) == [None, 2, 3, 4]
    assert not stream.replaying and stream.stats.replay_failures == 1


def test_a_replay_longer_than_its_limit_fails():
    stream = KVEventStream(topic=TOPIC, replay=True, limits=KVEventLimits(max_replay_batches=2))
    stream.start()
    out = [o for seq in range(3) for o in stream.receive_replay(replayed(seq, removed(seq)))]
    assert applied(out) == [0, 1, None]
    assert not stream.replaying and stream.stats.replay_failures == 1


def test_a_malformed_message_is_dropped_alone():
    stream = KVEventStream(topic=TOPIC, rank=0, replay=True)
    out = stream.receive_live(live(0, removed(0)))
    out += stream.receive_live([TOPIC, encode_seq(1), b"\xc1"])  # not msgpack
    out += stream.receive_live([b"other", encode_seq(2), payload(removed(2))])  # another topic
    out += stream.receive_live([TOPIC, encode_seq(2)])  # two frames
    out += stream.receive_live([TOPIC, encode_seq(2), msgpack.packb([0.0, removed(2), 1])])
    out += stream.receive_live(live(3, removed(3)))
    rejected = [o for o in out if isinstance(o, MessageRejected)]
    assert [r.seq for r in rejected] == [1, None, None, 2]
    assert all(isinstance(r.error, KVEventDecodeError) for r in rejected)
    assert applied(out) == [0, 3]
    assert (stream.stats.rejected, stream.stats.resnapshots, stream.stats.gaps) == (4, 0, 0)


def test_the_block_size_comes_from_the_last_stored_blocks():
    stream = KVEventStream(topic=TOPIC)
    assert stream.block_size is None
    stream.receive_live(live(0, [block_stored([1], None, list(range(16)), 16)]))
    assert stream.block_size == 16


def test_an_overflowing_buffer_is_replaced_by_a_reset():
    buffer = EventBuffer(max_weight=6)
    buffer.extend([BlockRemoved((1, 2)), BlockRemoved((3,))])  # weight 3 + 2
    buffer.extend([BlockRemoved((4, 5))])  # 3 more: over
    assert buffer.drain() == [AllBlocksCleared(), BlockRemoved((4, 5))]
    assert buffer.overflows == 1 and buffer.drain() == []


# -- the subscriber against the fake publisher -----------------------------------------------


async def wait_until(subscriber, condition):
    with trio.move_on_after(10):
        while not condition():
            await subscriber.wait_changed()
        return
    raise AssertionError(f"not reached; {subscriber.stats}")


async def test_subscriber_catches_up_by_replay_then_follows_live_batches_and_gaps():
    async with open_fake_kv_publisher(topic="kv") as pub, trio.open_nursery() as nursery:
        first = block_stored([2**63 + 1, BIG], None, [1, 2, 3, 4], 2)
        pub.publish([first])  # before anyone subscribed: only the replay has it
        subscriber = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                       topic="kv")
        await nursery.start(subscriber.serve)
        await pub.wait_subscribed()
        await wait_until(subscriber, lambda: subscriber.stats.batches == 1)
        pub.publish([block_removed([BIG])])
        pub.publish([block_removed([2**63 + 1])], deliver=False)  # lost on the live socket
        pub.publish([all_blocks_cleared()])
        await wait_until(subscriber, lambda: subscriber.stats.batches == 4
                         and subscriber.stats.duplicates == 1)
        assert subscriber.drain() == [
            BlockStored((2**63 + 1, BIG), None, (1, 2, 3, 4), 2),
            BlockRemoved((BIG,)),
            BlockRemoved((2**63 + 1,)),
            AllBlocksCleared(),
        ]
        assert pub.replay_requests == [0, 2]
        assert subscriber.block_size == 2
        assert (subscriber.stats.gaps, subscriber.stats.resnapshots) == (1, 0)
        nursery.cancel_scope.cancel()


async def test_subscriber_drops_a_malformed_batch_and_keeps_the_next():
    async with open_fake_kv_publisher(topic="kv") as pub, trio.open_nursery() as nursery:
        subscriber = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                       topic="kv")
        await nursery.start(subscriber.serve)
        await pub.wait_subscribed()
        pub.publish_payload(b"\xc1\xc1")
        pub.publish([{"type": "BlockPinned"}, block_removed([9])])
        await wait_until(subscriber, lambda: subscriber.stats.batches == 1)
        assert subscriber.drain() == [BlockRemoved((9,))]
        assert (subscriber.stats.rejected, subscriber.stats.skipped_events) == (1, 1)
        nursery.cancel_scope.cancel()


async def test_subscriber_resets_the_view_when_the_publisher_restarts():
    async with open_fake_kv_publisher(topic="kv", replay_with_topic=False) as pub, \
            trio.open_nursery() as nursery:
        subscriber = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        await nursery.start(subscriber.serve)
        await pub.wait_subscribed()
        pub.publish([block_removed([1])])
        pub.publish([block_removed([2])])
        await wait_until(subscriber, lambda: subscriber.stats.batches == 2)
        pub.restart()
        pub.publish([block_removed([3])])
        await wait_until(subscriber, lambda: subscriber.stats.restarts == 1
                         and subscriber.stats.batches == 3)
        assert subscriber.drain() == [
            BlockRemoved((1,)), BlockRemoved((2,)), AllBlocksCleared(), BlockRemoved((3,)),
        ]
        nursery.cancel_scope.cancel()


async def test_subscriber_without_replay_resets_the_view_on_a_gap():
    async with open_fake_kv_publisher(topic="kv") as pub, trio.open_nursery() as nursery:
        subscriber = KVEventSubscriber(pub.endpoint, topic="kv")
        await nursery.start(subscriber.serve)
        await pub.wait_subscribed()
        pub.publish([block_removed([1])])
        pub.publish([block_removed([2])], deliver=False)
        pub.publish([block_removed([3])])
        await wait_until(subscriber, lambda: subscriber.stats.batches == 2)
        assert subscriber.drain() == [BlockRemoved((1,)), AllBlocksCleared(), BlockRemoved((3,))]
        assert pub.replay_requests == []
        nursery.cancel_scope.cancel()


async def test_a_replay_endpoint_that_never_answers_counts_as_a_failed_replay():
    async with open_fake_kv_publisher(topic="kv") as pub, \
            open_fake_kv_publisher() as silent, trio.open_nursery() as nursery:
        # the live socket of another publisher: a ROUTER-less endpoint that never answers
        subscriber = KVEventSubscriber(pub.endpoint, replay_endpoint=silent.endpoint,
                                       topic="kv", replay_timeout=0.2)
        await nursery.start(subscriber.serve)
        await wait_until(subscriber, lambda: subscriber.stats.replay_failures == 1)
        await pub.wait_subscribed()
        pub.publish([block_removed([1])])
        await wait_until(subscriber, lambda: subscriber.stats.batches == 1)
        assert subscriber.drain() == [AllBlocksCleared(), BlockRemoved((1,))]
        nursery.cancel_scope.cancel()


async def test_subscriber_reads_every_data_parallel_rank():
    async with open_fake_kv_publishers(2, topic="kv") as (rank0, rank1), \
            trio.open_nursery() as nursery:
        subscriber = KVEventSubscriber(rank0.endpoint, replay_endpoint=rank0.replay_endpoint,
                                       topic="kv", data_parallel_size=2)
        assert subscriber.endpoints == [rank0.endpoint, rank1.endpoint]
        await nursery.start(subscriber.serve)
        await rank0.wait_subscribed()
        await rank1.wait_subscribed()
        rank0.publish([block_removed([10])])
        rank1.publish([block_removed([11])])
        await wait_until(subscriber, lambda: subscriber.stats.batches == 2)
        assert sorted(e.block_hashes for e in subscriber.drain()) == [(10,), (11,)]
        assert rank1.replay_requests == [0] and subscriber.stats.rejected == 0
        nursery.cancel_scope.cancel()


# -- the engine --------------------------------------------------------------------------------


async def test_engine_exposes_the_kv_events_of_its_server():
    async with open_fake_kv_publisher(topic="kv") as pub:
        engine = VLLMEngine(
            "http://127.0.0.1:1", "m", kv_events_endpoint=pub.endpoint,
            kv_events_replay_endpoint=pub.replay_endpoint, kv_events_topic="kv",
        )
        async with engine, trio.open_nursery() as nursery:
            assert engine.kv_block_size is None and engine.drain_kv_events() == []
            pub.publish([block_stored([1, 2], None, list(range(32)), 16)])
            await nursery.start(engine.serve_kv_events)
            assert engine.kv_events is not None
            await wait_until(engine.kv_events, lambda: engine.kv_events.stats.batches == 1)
            assert engine.drain_kv_events() == [
                BlockStored((1, 2), None, tuple(range(32)), 16)
            ]
            assert engine.drain_kv_events() == []
            assert engine.kv_block_size == 16
            nursery.cancel_scope.cancel()


async def test_engine_without_an_endpoint_has_no_kv_events():
    async with VLLMEngine("http://127.0.0.1:1", "m") as engine:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.serve_kv_events)  # returns at once
        assert engine.drain_kv_events() == [] and engine.kv_block_size is None


@pytest.mark.parametrize(
    "options",
    [{"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"},
     {"kv_events_endpoint": "tcp://*:5557"},
     {"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_data_parallel_size": 0}],
)
def test_engine_refuses_unusable_kv_event_options(options):
    with pytest.raises(ConfigError):
        VLLMEngine("http://127.0.0.1:1", "m", **options)
