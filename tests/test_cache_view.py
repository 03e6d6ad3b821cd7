"""A node's own HR-subtree from KV-cache events (ps_p2p.gossip.cache_view): hand-made vLLM-shaped
events, and a fake engine's random event streams against chunk_hashes of every cached prefix."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from ps_p2p.errors import EngineError
from ps_p2p.gossip.cache_view import CacheView
from ps_p2p.gossip.hr_tree import (
    HRTree,
    Op,
    OpKind,
    SubtreePublisher,
    SubtreeReplica,
    chunk_hashes,
)
from ps_p2p.gossip.sentry import ChunkLengths

KEY = b"group-key-for-the-cache-view-test"
L = ChunkLengths(1, (40,), 32)  # chunks end at 40, 72, 104, ...
BLOCK = 16


def block_hash(parent: int | None, tokens) -> int:
    """Chained like vLLM's: the hash names the whole prefix."""
    data = repr((parent, tuple(tokens))).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def store(parent: int | None, tokens: list[int], size: int = BLOCK) -> BlockStored:
    hashes, p = [], parent
    for i in range(0, len(tokens), size):
        p = block_hash(p, tokens[i:i + size])
        hashes.append(p)
    return BlockStored(tuple(hashes), parent, tuple(tokens), size)


def closure(chain) -> set[tuple]:
    return {tuple(chain[:i]) for i in range(1, len(chain) + 1)}


SYSTEM = list(range(1000, 1040))
A = SYSTEM + list(range(2000, 2040))  # 80 tokens, 5 blocks
B = SYSTEM + list(range(3000, 3040))


def test_a_stored_prompt_inserts_its_complete_chunks():
    view = CacheView(L, KEY)
    ev = store(None, A[:48])
    assert view.apply(ev) == [Op(OpKind.INSERT, tuple(chunk_hashes(A[:48], L, KEY)))]
    ev2 = store(ev.block_hashes[-1], A[48:64])  # up to 64: chunk [40, 72) not complete
    assert view.apply(ev2) == []
    ev3 = store(ev2.block_hashes[-1], A[64:80])
    (op,) = view.apply(ev3)
    assert op == Op(OpKind.INSERT, tuple(chunk_hashes(A, L, KEY))) and len(op.chain) == 2
    assert view.prefix_tokens(ev3.block_hashes[-1]) == tuple(A)
    assert view.chain(ev3.block_hashes[-1]) == op.chain


def test_a_chunk_that_ends_inside_sibling_blocks_stays_while_one_of_them_does():
    view = CacheView(L, KEY)
    ea, eb = store(None, A), store(None, B)
    assert ea.block_hashes[:2] == eb.block_hashes[:2] and ea.block_hashes[2] != eb.block_hashes[2]
    chain_a, chain_b = tuple(chunk_hashes(A, L, KEY)), tuple(chunk_hashes(B, L, KEY))
    assert chain_a[0] == chain_b[0]  # [0, 40) completes in both blocks [32, 48)
    view.apply(ea)
    assert view.apply(eb) == [Op(OpKind.INSERT, chain_b)]
    assert view.apply(BlockRemoved((ea.block_hashes[2],))) == [Op(OpKind.EVICT, chain_a)]
    assert len(view) == 5  # A's blocks 2-4 left with block 2
    assert view.apply(BlockRemoved((eb.block_hashes[2],))) == [Op(OpKind.EVICT, chain_b[:1])]
    assert len(view) == 2


def test_removing_a_block_evicts_from_the_first_chunk_it_held_up():
    view = CacheView(L, KEY)
    ev = store(None, A)
    view.apply(ev)
    ops = view.apply(BlockRemoved((ev.block_hashes[1],)))  # tokens [16, 32)
    assert ops == [Op(OpKind.EVICT, tuple(chunk_hashes(A, L, KEY))[:1])]
    assert len(view) == 1
    assert view.apply(BlockRemoved(ev.block_hashes[2:])) == []  # descendants: gone already


def test_many_prompts_after_one_system_prompt_come_and_go():
    view = CacheView(L, KEY)
    prompts = [SYSTEM + list(range(5000 + 100 * i, 5040 + 100 * i)) for i in range(20)]
    events = [store(None, p) for p in prompts]
    for ev in events:
        view.apply(ev)
    assert len(view) == 2 + 20 * 3  # blocks [0, 16) and [16, 32) are shared
    for i, ev in enumerate(events):
        ops = view.apply(BlockRemoved((ev.block_hashes[2],)))
        chain = tuple(chunk_hashes(prompts[i], L, KEY))
        assert ops == [Op(OpKind.EVICT, chain if i < 19 else chain[:1])]
    assert len(view) == 2


def test_an_lru_that_removes_a_prompt_leaf_first_gives_one_eviction():
    view = CacheView(L, KEY)
    long_prompt = SYSTEM + list(range(6000, 6200))  # 240 tokens, 15 blocks, chunks 40, 72, ...
    ev = store(None, long_prompt)
    view.apply(ev)
    view.apply(store(None, B))  # shares blocks 0-1 and the first chunk
    chain = tuple(chunk_hashes(long_prompt, L, KEY))
    assert len(chain) == 7
    ops = view.apply(BlockRemoved(tuple(reversed(ev.block_hashes[2:]))))  # leaf first
    assert ops == [Op(OpKind.EVICT, chain[:2])]  # not one per chunk: [0, 72) held up first


def test_the_evictions_of_one_event_come_sorted():
    view = CacheView(L, KEY)
    ea, eb = store(None, A), store(None, B)
    view.apply(ea)
    view.apply(eb)
    ops = view.apply(BlockRemoved((eb.block_hashes[4], ea.block_hashes[3], eb.block_hashes[3])))
    chains = sorted([tuple(chunk_hashes(A, L, KEY)), tuple(chunk_hashes(B, L, KEY))])
    assert ops == [Op(OpKind.EVICT, c) for c in chains]


def test_a_block_whose_parent_is_unknown_is_dropped():
    view = CacheView(L, KEY)
    ev = store(None, A)
    assert view.apply(store(ev.block_hashes[2], A[48:])) == []
    assert view.dropped_blocks == 2 and len(view) == 0


def test_the_view_holds_at_most_max_blocks():
    view = CacheView(L, KEY, max_blocks=3)
    (op,) = view.apply(store(None, A))
    assert len(view) == 3 and view.dropped_blocks == 2
    assert op.chain == tuple(chunk_hashes(A[:48], L, KEY))


def test_all_blocks_cleared_evicts_everything():
    view = CacheView(L, KEY)
    assert view.apply(AllBlocksCleared()) == []
    view.apply(store(None, A))
    assert view.apply(AllBlocksCleared()) == [Op(OpKind.EVICT, ())]
    assert len(view) == 0


def test_a_partial_last_block_counts_its_tokens():
    view = CacheView(L, KEY)
    (op,) = view.apply(store(None, A[:40]))  # blocks of 16, 16, 8
    assert op.chain == tuple(chunk_hashes(A[:40], L, KEY))


@pytest.mark.parametrize("tokens", [A[:15], A[:33]])
def test_tokens_that_do_not_fill_the_blocks_are_an_engine_error(tokens):
    with pytest.raises(EngineError):
        CacheView(L, KEY).apply(BlockStored((1, 2), None, tuple(tokens), BLOCK))


def test_unknown_blocks_raise_key_error():
    with pytest.raises(KeyError):
        CacheView(L, KEY).prefix_tokens(12345)


# ----------------------------------------------------------------- fake engine, properties

SMALL = ChunkLengths(1, (3,), 2)  # chunks end at 3, 5, 7, ...: most end inside a block
OTHER = ChunkLengths(2, (), 3)
SMALL_BLOCK = 2


class FakeEngine:
    """Blocks of 2 tokens from {1, 2}: siblings often share the chunk that ends inside them."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def tokens(self, h: int | None) -> list[int]:
        out: list[int] = []
        while h is not None:
            parent, toks = self.blocks[h]
            out[:0] = toks
            h = parent
        return out

    def store(self, parent: int | None, tokens: list[int]) -> BlockStored:
        ev = store(parent, tokens, SMALL_BLOCK)
        p = parent
        for i, h in enumerate(ev.block_hashes):
            self.blocks.setdefault(h, (p, tuple(tokens[2 * i:2 * i + 2])))
            p = h
        return ev

    def remove(self, h: int, every: bool) -> BlockRemoved:
        """``h`` and its descendants; the event lists ``h`` alone, or (``every``) all of them
        leaf first, as an LRU evicts."""
        gone = [h]
        i = 0
        while i < len(gone):
            gone += [b for b, (p, _) in self.blocks.items() if p == gone[i]]
            i += 1
        for b in gone:
            self.blocks.pop(b, None)
        return BlockRemoved(tuple(reversed(gone)) if every else (h,))

    def subtree(self, lengths: ChunkLengths) -> frozenset[tuple]:
        out: set[tuple] = set()
        for h in self.blocks:
            out |= closure(chunk_hashes(self.tokens(h), lengths, KEY))
        return frozenset(out)


events = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 10**6),
                  st.lists(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]), min_size=1,
                           max_size=4).map(lambda blocks: [t for b in blocks for t in b])),
        st.tuples(st.just("remove"), st.integers(0, 10**6), st.booleans()),
        st.tuples(st.just("clear"), st.just(0), st.just(None)),
    ),
    max_size=25,
)


@given(events)
@settings(max_examples=150, deadline=None)
def test_the_subtree_is_the_chunks_of_every_cached_prefix(script):
    engine, view = FakeEngine(), CacheView(SMALL, KEY)
    publisher = SubtreePublisher(HRTree(SMALL.version), b"me", 1)
    replica = SubtreeReplica(HRTree(SMALL.version), b"me")  # through deltas, each event's ops
    for kind, pick, tokens in script:
        known = sorted(engine.blocks)
        if kind == "store":
            parent = known[pick % (len(known) + 1) - 1] if known and pick % 3 else None
            ev = engine.store(parent, tokens)
        elif kind == "remove":
            if not known:
                continue
            ev = engine.remove(known[pick % len(known)], tokens)
        else:
            engine.blocks.clear()
            ev = AllBlocksCleared()
        for op in view.apply(ev):
            publisher.apply(op)
        assert publisher.tree.prefixes(b"me") == engine.subtree(SMALL)
        for delta in publisher.take_deltas():
            replica.apply_delta(delta)
        assert replica.tree.prefixes(b"me") == engine.subtree(SMALL)
        assert len(view) == len(engine.blocks)
        for h in engine.blocks:
            assert list(view.prefix_tokens(h)) == engine.tokens(h)
            assert list(view.chain(h)) == chunk_hashes(engine.tokens(h), SMALL, KEY)
    fresh = SubtreePublisher(HRTree(OTHER.version), b"me", 2)
    for op in view.rechunk(OTHER):
        fresh.apply(op)
    assert fresh.tree.prefixes(b"me") == engine.subtree(OTHER)
