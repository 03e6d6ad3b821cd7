"""The block-level prefix-cache index: chained hashes, LRU with descendants, and its KV-cache events."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.engines import prefix_cache
from ps_p2p.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from ps_p2p.engines.prefix_cache import PrefixCacheIndex, block_hash
from ps_p2p.errors import ConfigError, EngineParameterError

BS = 4  # tokens per block in these tests


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """A prompt of whole blocks, block ``b`` being ``BS`` copies of token ``b``; ``tail`` extra
    tokens make a partial last block."""
    return [b for b in blocks for _ in range(BS)] + [99] * tail


def apply(replica: dict[int, tuple[int | None, tuple[int, ...]]], events) -> None:
    """Rebuild the index's contents from its events, as a model node would."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            replica.clear()
        elif isinstance(event, BlockStored):
            assert event.block_size == BS
            assert len(event.token_ids) == BS * len(event.block_hashes)
            parent = event.parent_block_hash
            assert parent is None or parent in replica
            for i, h in enumerate(event.block_hashes):
                assert h not in replica
                replica[h] = (parent, tuple(event.token_ids[i * BS : (i + 1) * BS]))
                parent = h
        else:
            assert isinstance(event, BlockRemoved)
            for h in event.block_hashes:
                del replica[h]


def contents(index: PrefixCacheIndex) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    return {h: (parent, tokens) for h, parent, tokens in index.blocks()}


# -- hashes -----------------------------------------------------------------------------------


def test_block_hash_follows_the_documented_layout():
    root = hashlib.blake2b(b"\x00" + struct.pack("<3Q", 5, 2**64 - 1, 0), digest_size=8,
                           person=b"ps-kv-block-v1")
    h0 = int.from_bytes(root.digest(), "big")
    assert block_hash(None, [5, 2**64 - 1, 0]) == h0
    child = hashlib.blake2b(b"\x01" + h0.to_bytes(8, "big") + struct.pack("<1Q", 7),
                            digest_size=8, person=b"ps-kv-block-v1")
    assert block_hash(h0, [7]) == int.from_bytes(child.digest(), "big")


def test_a_block_hash_names_its_whole_prefix():
    ix = PrefixCacheIndex(8, BS)
    ix.store(prompt(1, 2), ["a", "b"])
    ix.store(prompt(3, 2), ["c", "d"])
    hashes = [h for h, _, _ in ix.blocks()]
    assert len(hashes) == len(set(hashes)) == 4  # block "2" after "1" differs from "2" after "3"
    assert ix.lookup(prompt(3, 2)).payloads == ("c", "d")


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "x"])
def test_token_ids_out_of_range_raise_parameter_errors(bad):
    with pytest.raises(EngineParameterError, match="token IDs"):
        block_hash(None, [1, bad])
    with pytest.raises(EngineParameterError):
        PrefixCacheIndex(8, 2).store([1, bad], ["a"])


# -- lookup and store -------------------------------------------------------------------------


def test_lookup_matches_the_longest_cached_prefix_in_whole_blocks():
    ix = PrefixCacheIndex(8, BS)
    assert ix.store(prompt(1, 2, 3, tail=2), ["a", "b", "c"]) == 3
    match = ix.lookup(prompt(1, 2, 7, 3, tail=3))
    assert (match.blocks, match.tokens, match.payloads) == (2, 2 * BS, ("a", "b"))
    assert ix.lookup(prompt(1, 2, 3, tail=1)).blocks == 3
    assert ix.lookup(prompt(1, 2, 3, tail=1), max_blocks=1).blocks == 1
    assert ix.lookup(prompt(2, 1)).blocks == 0
    assert ix.lookup(prompt(1)[:-1]).blocks == 0  # a partial block never matches
    assert (ix.queried_blocks, ix.hit_blocks) == (4 + 3 + 1 + 2 + 0, 2 + 3 + 1)


def test_store_keeps_the_payload_of_blocks_already_cached():
    ix = PrefixCacheIndex(8, BS)
    ix.store(prompt(1, 2), ["a", "b"])
    made = []
    assert ix.store(prompt(1, 2, 3), lambda i: made.append(i) or f"new{i}") == 1
    assert made == [2]
    assert ix.lookup(prompt(1, 2, 3)).payloads == ("a", "b", "new2")


def test_a_sequence_of_payloads_must_give_one_per_full_block():
    with pytest.raises(EngineParameterError, match="2 payloads for 3 full blocks"):
        PrefixCacheIndex(8, BS).store(prompt(1, 2, 3, tail=1), ["a", "b"])


def test_least_recently_used_prompt_is_evicted_first():
    ix = PrefixCacheIndex(3, BS)
    for b in (1, 2, 3):
        ix.store(prompt(b), [b])
    ix.lookup(prompt(1))
    ix.store(prompt(4), [4])
    assert {tokens[0] for _, _, tokens in ix.blocks()} == {1, 3, 4}


def test_eviction_trims_prompts_from_their_ends_and_keeps_a_shared_prefix():
    ix = PrefixCacheIndex(3, BS)
    ix.store(prompt(0, 1), ["s", "x"])
    ix.store(prompt(0, 2), ["s", "y"])
    ix.drain_events()
    ix.store(prompt(0, 3), ["s", "z"])  # the oldest leaf goes (x), not the system prompt (s)
    assert ix.lookup(prompt(0, 1)).payloads == ("s",)
    assert ix.lookup(prompt(0, 2)).payloads == ("s", "y")
    events = ix.drain_events()
    assert isinstance(events[0], BlockRemoved) and len(events[0].block_hashes) == 1
    assert isinstance(events[1], BlockStored) and events[1].token_ids == tuple(prompt(3))


def test_a_prompt_longer_than_the_capacity_keeps_its_first_blocks():
    ix = PrefixCacheIndex(2, BS)
    ix.store(prompt(9), ["old"])
    assert ix.store(prompt(1, 2, 3, 4), list("abcd")) == 2
    assert len(ix) == 2
    assert ix.lookup(prompt(1, 2, 3, 4)).payloads == ("a", "b")


def test_evicting_a_block_evicts_its_descendants():
    ix = PrefixCacheIndex(8, BS)
    ix.store(prompt(1, 2, 3), list("abc"))
    ix.store(prompt(1, 2, 4), list("abd"))
    ix.store(prompt(1, 5), list("ae"))
    ix.drain_events()
    middle = ix.lookup(prompt(1, 2)).block_hashes[1]
    removed = ix.evict(middle)
    assert len(removed) == 3 and removed[0] == middle
    assert ix.drain_events() == [BlockRemoved(tuple(removed))]
    assert ix.lookup(prompt(1, 2, 3)).payloads == ("a",)
    assert ix.lookup(prompt(1, 5)).payloads == ("a", "e")
    assert ix.evict(middle) == []


def test_zero_capacity_disables_the_cache():
    ix = PrefixCacheIndex(0, BS)
    assert ix.store(prompt(1, 2), ["a", "b"]) == 0
    assert ix.lookup(prompt(1, 2)).blocks == 0
    ix.clear()
    assert len(ix) == 0 and ix.drain_events() == []


def test_a_hash_collision_is_a_miss_not_a_wrong_cache(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 7)
    ix = PrefixCacheIndex(8, BS)
    ix.store(prompt(1), ["a"])
    ix.drain_events()
    assert ix.lookup(prompt(2)).blocks == 0
    assert ix.store(prompt(2), ["b"]) == 0
    assert ix.drain_events() == []
    assert ix.lookup(prompt(1)).payloads == ("a",)


@pytest.mark.parametrize(
    "kwargs", [{"capacity": -1}, {"capacity": 1.5}, {"block_size": 0}, {"block_size": 5000},
               {"max_pending_events": 0}],
)
def test_bad_settings_raise_config_errors(kwargs):
    with pytest.raises(ConfigError):
        PrefixCacheIndex(**{"capacity": 4, **kwargs})


# -- events -----------------------------------------------------------------------------------


def test_stored_blocks_name_their_parent_and_tokens():
    ix = PrefixCacheIndex(8, BS)
    ix.store(prompt(1), ["a"])
    ix.store(prompt(1, 2, 3, tail=1), ["a", "b", "c"])
    first, second = ix.drain_events()
    assert first == BlockStored(first.block_hashes, None, tuple(prompt(1)), BS)
    assert second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == tuple(prompt(2, 3))
    assert second.block_hashes == ix.lookup(prompt(1, 2, 3)).block_hashes[1:]


def test_clear_leaves_only_all_blocks_cleared_pending():
    ix = PrefixCacheIndex(8, BS)
    ix.store(prompt(1, 2), ["a", "b"])
    ix.clear()
    assert len(ix) == 0
    assert ix.drain_events() == [AllBlocksCleared()]
    assert ix.drain_events() == []


def test_an_overflowing_buffer_resyncs_with_the_whole_contents():
    ix = PrefixCacheIndex(16, BS, max_pending_events=3)
    replica: dict = {}
    ix.store(prompt(1, 2), ["a", "b"])
    apply(replica, ix.drain_events())
    ix.store(prompt(1, 3, 4), ["a", "c", "d"])
    ix.store(prompt(5, 6), ["e", "f"])  # 2 + 2 entries > 3: resync
    ix.evict(ix.lookup(prompt(5)).block_hashes[0])
    events = ix.drain_events()
    assert events[0] == AllBlocksCleared()
    assert all(isinstance(e, BlockStored) for e in events[1:])
    assert len(events) == 1 + 2  # the chains 1-2 and 3-4 (after 1), merged runs
    apply(replica, events)
    assert replica == contents(ix)
    ix.store(prompt(7), ["g"])  # buffering again
    assert [type(e) for e in ix.drain_events()] == [BlockStored]


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(st.integers(0, 2), max_size=5), st.integers(0, 3)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 2), max_size=5), st.integers(0, 3)),
        st.tuples(st.just("evict"), st.integers(0, 40)),
        st.tuples(st.just("drain")),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, capacity=st.integers(0, 6), max_pending=st.integers(1, 12))
def test_a_replica_built_from_events_equals_the_index(ops, capacity, max_pending):
    ix: PrefixCacheIndex[tuple[int, ...]] = PrefixCacheIndex(
        capacity, BS, max_pending_events=max_pending
    )
    replica: dict = {}
    for op in ops:
        if op[0] in ("store", "lookup"):
            tokens = prompt(*op[1], tail=op[2])
            if op[0] == "store":
                ix.store(tokens, lambda i, t=tokens: tuple(t[: (i + 1) * BS]))
            else:
                match = ix.lookup(tokens)
                # the payload of block i is its whole prefix: a match is the prompt's own prefix
                assert all(p == tuple(tokens[: (i + 1) * BS]) for i, p in enumerate(match.payloads))
                # and it is the longest one present
                present = {(parent, toks) for parent, toks in contents(ix).values()}
                parent = match.block_hashes[-1] if match.blocks else None
                nxt = tuple(tokens[match.tokens : match.tokens + BS])
                assert len(nxt) < BS or (parent, nxt) not in present
        elif op[0] == "evict":
            hashes = [h for h, _, _ in ix.blocks()]
            if hashes:
                ix.evict(hashes[op[1] % len(hashes)])
        elif op[0] == "drain":
            apply(replica, ix.drain_events())
            assert replica == contents(ix)
        else:
            ix.clear()
        assert len(ix) <= capacity
        assert all(parent is None or parent in ix for _, parent, _ in ix.blocks())
    apply(replica, ix.drain_events())
    assert replica == contents(ix)
