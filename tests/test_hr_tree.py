"""HR-tree core (ps_p2p.gossip.hr_tree): keyed chained chunk hashes, Algorithm 1 search against a
dict-of-prefixes model, names (last chunk hashes) resolved per peer, bounds, subtree replication
(coalesced deltas, snapshots) and its encodings."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.consensus.encoding import u32, u64
from ps_p2p.errors import (
    ConfigError,
    HRTreeFullError,
    LocalProtocolError,
    SubtreeSyncError,
)
from ps_p2p.gossip import hr_tree
from ps_p2p.gossip.hr_tree import (
    DELTA_DOMAIN,
    HASH_BYTES,
    MAX_DELTA_BYTES,
    MAX_DELTA_CHAIN_HASHES,
    MAX_DELTA_OPS,
    MAX_DEPTH,
    MAX_PENDING_OPS,
    MAX_SNAPSHOT_BYTES,
    MAX_SNAPSHOT_ENTRIES,
    ROOT_HASH,
    SNAPSHOT_DOMAIN,
    Applied,
    Delta,
    HRTree,
    Ignored,
    Insert,
    NeedSnapshot,
    Op,
    OpKind,
    Snapshot,
    SubtreePublisher,
    SubtreeReplica,
    chunk_hash,
    chunk_hashes,
)
from ps_p2p.gossip.sentry import ChunkLengths

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
L = ChunkLengths(3, (40, 4, 56, 4), 32)

# Small alphabets so that random chains share prefixes and collide on purpose.
HASHES = tuple(bytes([i]) * HASH_BYTES for i in (0x10, 0x20, 0x30))
PEERS = [b"peer-a", b"peer-b", b"peer-c"]
chains = st.lists(st.sampled_from(HASHES), max_size=4).map(tuple)
nonempty_chains = st.lists(st.sampled_from(HASHES), min_size=1, max_size=4).map(tuple)
peers = st.sampled_from(PEERS)


def chained(symbols) -> tuple[bytes, ...]:
    """Hashes chained like chunk hashes (each names its whole prefix) over small symbols, so
    that random chains share prefixes; the names deltas use are then unique, as with
    chunk_hashes."""
    out, h = [], ROOT_HASH
    for sym in symbols:
        h = hashlib.blake2b(h + bytes([sym]), digest_size=HASH_BYTES).digest()
        out.append(h)
    return tuple(out)


symbols = st.lists(st.integers(1, 3), max_size=4)
named_chains = symbols.map(chained)
nonempty_named_chains = st.lists(st.integers(1, 3), min_size=1, max_size=4).map(chained)


def held_by(tree: HRTree, peer: bytes) -> dict[bytes, list]:
    """Chunk hash -> the nodes above ``peer``'s nodes of that hash (tree internals)."""
    index = tree._bit_of.get(peer)
    out: dict[bytes, list] = {}
    if index is None:
        return out
    stack = [tree._root]
    while stack:
        node = stack.pop()
        for h, child in (node.children or {}).items():
            if child.mask >> index & 1:
                out.setdefault(h, []).append(node)
                stack.append(child)
    return out


def check_names(tree: HRTree, exact: bool) -> None:
    """Each peer's names point above nodes it holds; with unique names (``exact``), every node
    it holds is named."""
    for peer, index in tree._bit_of.items():
        named, held = tree._named[index], held_by(tree, peer)
        assert all(any(up is n for n in held.get(h, ())) for h, up in named.items())
        if exact:
            assert set(named) == set(held)


def reference_chunk_hash(parent: bytes | None, tokens: list[int], key: bytes) -> bytes:
    """The module docstring's formula, written out with hashlib directly."""
    data = (parent or bytes(6)) + struct.pack(">I", len(tokens)) + b"".join(
        struct.pack(">I", t) for t in tokens
    )
    return hashlib.blake2b(data, digest_size=6, key=key, person=b"ps-hrtree-chunk1").digest()


# ------------------------------------------------------------------------------ chunk hashes


def test_chunk_hashes_follow_the_documented_formula():
    tokens = list(range(500, 700))
    expected, parent, start = [], None, 0
    for end in (40, 44, 100, 104, 136, 168, 200):
        parent = reference_chunk_hash(parent, tokens[start:end], KEY)
        expected.append(parent)
        start = end
    assert chunk_hashes(tokens, L, KEY) == expected
    assert chunk_hash(None, tokens[:40], KEY) == expected[0]


def test_a_trailing_partial_chunk_is_not_hashed():
    tokens = list(range(130))  # chunks end at 40, 44, 100, 104; the next would end at 136
    assert len(chunk_hashes(tokens, L, KEY)) == 4
    assert chunk_hashes(tokens[:39], L, KEY) == []


@given(st.lists(st.integers(0, 2**32 - 1), min_size=40, max_size=300), st.integers(0, 300))
@settings(max_examples=50, deadline=None)
def test_same_prefix_gives_the_same_chain(tokens, cut):
    full = chunk_hashes(tokens, L, KEY)
    prefix = chunk_hashes(tokens[:cut], L, KEY)
    assert full[: len(prefix)] == prefix
    assert len(prefix) == L.chunk_count(min(cut, len(tokens)))


def test_different_keys_give_different_hashes():
    tokens = list(range(300))
    mine, theirs = chunk_hashes(tokens, L, KEY), chunk_hashes(tokens, L, OTHER_KEY)
    assert len(mine) == len(theirs) == 10  # ends 40, 44, 100, 104, 136, ..., 296
    assert not set(mine) & set(theirs)


def test_equal_chunks_after_different_prefixes_hash_differently():
    lengths = ChunkLengths(0, (), 16)
    chunk = list(range(16))
    a = chunk_hashes([1] * 16 + chunk, lengths, KEY)
    b = chunk_hashes([2] * 16 + chunk, lengths, KEY)
    c = chunk_hashes(chunk + chunk, lengths, KEY)
    assert len({a[1], b[1], c[1], c[0]}) == 4


def test_long_prompts_are_cut_to_max_depth():
    assert len(chunk_hashes([7] * (MAX_DEPTH + 5), ChunkLengths(0, (), 1), KEY)) == MAX_DEPTH


@pytest.mark.parametrize("key", [b"", b"k" * 15, b"k" * 65])
def test_bad_key_lengths_are_refused(key):
    with pytest.raises(LocalProtocolError):
        chunk_hashes(list(range(64)), L, key)


@pytest.mark.parametrize("token", [-1, 2**32])
def test_token_ids_out_of_range_are_refused(token):
    with pytest.raises(LocalProtocolError):
        chunk_hashes([token] * 64, L, KEY)


# ------------------------------------------------------------------ tree against the model


class Model:
    """The HR-tree's meaning: per peer, a prefix-closed set of prefixes."""

    def __init__(self, per_peer: int, total: int, max_peers: int) -> None:
        self.held: dict[bytes, set[tuple]] = {}
        self.per_peer, self.total, self.max_peers = per_peer, total, max_peers

    def insert(self, peer, chain):
        new = {chain[:i] for i in range(1, len(chain) + 1)} - self.held.get(peer, set())
        if not new:
            return 0
        count = len(self.held.get(peer, ()))
        if (count + len(new) > self.per_peer
                or sum(map(len, self.held.values())) + len(new) > self.total
                or (peer not in self.held and len(self.held) >= self.max_peers)):
            return "full"
        self.held.setdefault(peer, set()).update(new)
        return len(new)

    def evict(self, peer, chain):
        mine = self.held.get(peer, set())
        if chain and chain not in mine:
            return 0
        gone = {p for p in mine if p[: len(chain)] == chain}
        mine -= gone
        if not mine:
            self.held.pop(peer, None)
        return len(gone)

    def search(self, chain, tau_c):
        union = set().union(*self.held.values()) if self.held else set()
        d = 0
        while d < len(chain) and chain[: d + 1] in union:
            d += 1
        if d < tau_c:
            return frozenset(), d
        return frozenset(p for p, s in self.held.items() if chain[:d] in s), d


operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), peers, nonempty_chains),
        st.tuples(st.just("evict"), peers, chains),
        st.tuples(st.just("remove"), peers, st.just(())),
        st.tuples(st.just("search"), st.integers(1, 3), chains),
    ),
    max_size=40,
)


@given(operations)
@settings(max_examples=300, deadline=None)
def test_tree_answers_like_the_dict_of_prefixes_model(ops):
    tree = HRTree(3, max_entries_per_peer=7, max_entries=12, max_peers=2)
    model = Model(7, 12, 2)
    for kind, arg, chain in ops:
        if kind == "insert":
            expected = model.insert(arg, chain)
            if expected == "full":
                before = {p: tree.prefixes(p) for p in PEERS}
                with pytest.raises(HRTreeFullError):
                    tree.insert(arg, chain)
                assert {p: tree.prefixes(p) for p in PEERS} == before
            else:
                assert tree.insert(arg, chain) == expected
        elif kind == "evict":
            assert tree.evict(arg, chain) == model.evict(arg, chain)
        elif kind == "remove":
            assert tree.remove_peer(arg) == model.evict(arg, ())
        else:
            result = tree.search(chain, arg)
            assert (result.peers, result.depth) == model.search(chain, arg)
        for p in PEERS:
            assert tree.prefixes(p) == frozenset(model.held.get(p, ()))
            assert tree.entries(p) == len(model.held.get(p, ()))
        assert tree.entries() == sum(map(len, model.held.values()))
        assert tree.peers() == frozenset(model.held)
        union = set().union(*model.held.values()) if model.held else set()
        assert tree.node_count == len(union)  # empty nodes are pruned
        check_names(tree, exact=False)


name_operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), peers, symbols, st.just([])),
        st.tuples(st.just("insert_under"), peers, symbols,
                  st.lists(st.integers(1, 3), min_size=1, max_size=3)),
        st.tuples(st.just("evict"), peers, symbols, st.just([])),
        st.tuples(st.just("evict_named"), peers, symbols, st.just([])),
    ),
    max_size=40,
)


@given(name_operations)
@settings(max_examples=300, deadline=None)
def test_names_resolve_like_the_model_among_the_peers_own_prefixes(ops):
    tree = HRTree(3, max_entries_per_peer=9, max_entries=16, max_peers=3)
    model = Model(9, 16, 3)
    for kind, peer, syms, extra in ops:
        chain = chained(syms)
        name = chain[-1] if chain else ROOT_HASH
        if kind == "insert_under":
            full = chained(syms + extra)
            before = {p: tree.prefixes(p) for p in PEERS}
            if chain and chain not in model.held.get(peer, ()):
                with pytest.raises(SubtreeSyncError):
                    tree.insert_under(peer, name, full[len(chain):])
                assert {p: tree.prefixes(p) for p in PEERS} == before
                continue
            expected = model.insert(peer, full)
            if expected == "full":
                with pytest.raises(HRTreeFullError):
                    tree.insert_under(peer, name, full[len(chain):])
                assert {p: tree.prefixes(p) for p in PEERS} == before
            else:
                assert tree.insert_under(peer, name, full[len(chain):]) == expected
        elif kind == "insert":
            expected = model.insert(peer, chain) if chain else 0
            if expected == "full":
                with pytest.raises(HRTreeFullError):
                    tree.insert(peer, chain)
            else:
                assert tree.insert(peer, chain) == expected
        elif kind == "evict":
            assert tree.evict(peer, chain) == model.evict(peer, chain)
        else:
            assert tree.evict_named(peer, name) == model.evict(peer, chain)
        for p in PEERS:
            assert tree.prefixes(p) == frozenset(model.held.get(p, ()))
        assert tree.entries() == sum(map(len, model.held.values()))
        check_names(tree, exact=True)


def test_a_name_resolves_only_among_the_peers_own_prefixes():
    tree = HRTree()
    mine = chained([1, 2, 3])
    planted = (b"\x77" * HASH_BYTES, mine[1])  # another peer's prefix ending in the same hash
    tree.insert(b"other", planted)
    with pytest.raises(SubtreeSyncError):
        tree.insert_under(b"me", mine[1], mine[2:])
    tree.insert(b"me", mine[:2])
    assert tree.insert_under(b"me", mine[1], mine[2:]) == 1
    assert tree.prefixes(b"me") == {mine[:1], mine[:2], mine}
    assert tree.evict_named(b"me", mine[1]) == 2
    assert tree.prefixes(b"me") == {mine[:1]}
    assert tree.prefixes(b"other") == {planted[:1], planted}
    assert tree.evict_named(b"me", planted[0]) == 0


def test_an_insert_under_a_name_keeps_to_max_depth():
    tree = HRTree()
    deep = tuple(i.to_bytes(HASH_BYTES, "big") for i in range(1, MAX_DEPTH + 1))
    tree.insert(b"p", deep[:-1])
    with pytest.raises(SubtreeSyncError):
        tree.insert_under(b"p", deep[-2], (deep[-1], b"\x01" * HASH_BYTES))
    assert tree.insert_under(b"p", deep[-2], deep[-1:]) == 1
    assert tree.entries(b"p") == MAX_DEPTH


def test_search_returns_the_peers_of_the_deepest_matched_prefix():
    tree = HRTree()
    a, b, c, x = HASHES[0], HASHES[1], HASHES[2], b"\x99" * HASH_BYTES
    tree.insert(b"long", (a, b, c))
    tree.insert(b"short", (a, b))
    assert tree.search((a, b, c, a), 2) == hr_tree.SearchResult(frozenset({b"long"}), 3)
    assert tree.search((a, b, x), 2) == hr_tree.SearchResult(frozenset({b"long", b"short"}), 2)


def test_a_match_shorter_than_tau_c_is_a_miss_however_the_walk_ends():
    tree = HRTree()
    tree.insert(b"p", tuple(HASHES[:2]))
    assert tree.search((HASHES[0], b"\x99" * HASH_BYTES), 2) == hr_tree.SearchResult(frozenset(), 1)
    assert tree.search((HASHES[0],), 2) == hr_tree.SearchResult(frozenset(), 1)
    assert not tree.search((HASHES[0],), 2).hit
    with pytest.raises(LocalProtocolError):
        tree.search((HASHES[0],), 0)


def test_a_prompt_finds_the_peer_that_cached_its_prefix():
    tree = HRTree(L.version)
    shared = list(range(1000, 1040))
    tree.insert(b"cached", chunk_hashes(shared + list(range(200)), L, KEY))
    result = tree.search(chunk_hashes(shared + list(range(120)) + [9] * 80, L, KEY), 3)
    assert result.peers == frozenset({b"cached"}) and result.depth == 5  # up to token 136
    assert not tree.search(chunk_hashes(shared + [9] * 160, L, KEY), 3).hit


def test_malformed_chains_are_refused():
    tree = HRTree()
    with pytest.raises(LocalProtocolError):
        tree.insert(b"p", (b"short",))
    with pytest.raises(LocalProtocolError):
        tree.insert(b"p", (HASHES[0],) * (MAX_DEPTH + 1))
    assert tree.entries() == 0


def test_limits_are_checked_at_construction():
    with pytest.raises(ConfigError):
        HRTree(max_entries=0)
    with pytest.raises(ConfigError):
        HRTree(max_entries_per_peer=MAX_SNAPSHOT_ENTRIES + 1)


def test_a_released_peer_slot_is_reused():
    tree = HRTree(max_peers=1)
    tree.insert(b"a", HASHES[:1])
    with pytest.raises(HRTreeFullError):
        tree.insert(b"b", HASHES[:1])
    tree.remove_peer(b"a")
    assert tree.insert(b"b", HASHES[:2]) == 2
    assert tree.search(HASHES[:2], 1).peers == frozenset({b"b"})


@given(st.lists(st.tuples(peers, nonempty_chains), max_size=20), peers)
@settings(max_examples=100, deadline=None)
def test_replace_peer_sets_exactly_the_snapshot(inserts, target):
    tree, other = HRTree(), HRTree()
    for peer, chain in inserts:
        tree.insert(peer, chain)
        if peer == target:
            other.insert(b"x", chain)
    before = {p: tree.prefixes(p) for p in PEERS if p != target}
    tree.replace_peer(target, other.leaves(b"x"))
    assert tree.prefixes(target) == other.prefixes(b"x")
    assert {p: tree.prefixes(p) for p in PEERS if p != target} == before


# ------------------------------------------------------------------------------ replication

subtree_ops = st.one_of(
    st.tuples(st.just(OpKind.INSERT), nonempty_named_chains),
    st.tuples(st.just(OpKind.EVICT), named_chains),
)
publisher_ops = st.lists(
    st.one_of(subtree_ops, st.tuples(st.just("take"), st.just(()))),
    max_size=30,
)


def run_publisher(ops, incarnation=5):
    """Drive a publisher; returns (deltas, snapshots, subtree by seq, publisher)."""
    pub = SubtreePublisher(HRTree(3), b"pub", incarnation)
    history = {0: frozenset()}
    deltas, snapshots = [], [pub.snapshot()]
    for kind, chain in ops:
        if kind == "take":
            deltas += pub.take_deltas()
            snapshots.append(pub.snapshot())
        else:
            pub.apply(Op(kind, chain))
            history[pub.seq] = pub.tree.prefixes(b"pub")
    deltas += pub.take_deltas()
    snapshots.append(pub.snapshot())
    return deltas, snapshots, history, pub


def check_replica(replica, history):
    if replica.seq is not None:
        assert replica.tree.prefixes(b"pub") == history[replica.seq]


@given(publisher_ops, st.data())
@settings(max_examples=200, deadline=None)
def test_deltas_in_any_order_with_duplicates_rebuild_the_subtree(ops, data):
    deltas, _, history, pub = run_publisher(ops)
    repeats = data.draw(st.lists(st.sampled_from(deltas), max_size=5)) if deltas else []
    arrivals = data.draw(st.permutations(deltas + repeats))
    replica = SubtreeReplica(HRTree(3), b"pub")
    for delta in arrivals:
        replica.apply_delta(delta)
        check_replica(replica, history)
    assert replica.seq == (pub.seq if deltas else None)
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")


@given(publisher_ops, st.data())
@settings(max_examples=100, deadline=None)
def test_gaps_ask_for_a_snapshot_and_the_snapshot_completes_the_replica(ops, data):
    deltas, snapshots, history, pub = run_publisher(ops)
    arrivals = data.draw(st.lists(st.sampled_from(deltas + snapshots)))
    replica = SubtreeReplica(HRTree(3), b"pub")
    for item in arrivals:
        if isinstance(item, Delta):
            outcome = replica.apply_delta(item)
            if isinstance(outcome, NeedSnapshot):
                assert item.seq_from > outcome.have_seq
        else:
            outcome = replica.apply_snapshot(item)  # then buffered deltas that follow
            assert outcome == Ignored(replica.seq) or outcome.seq >= item.seq
        check_replica(replica, history)
    replica.apply_snapshot(pub.snapshot())  # what a NeedSnapshot leads to
    assert replica.seq == pub.seq
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")


def test_a_gap_is_reported_then_filled_by_a_late_delta():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(HASHES[:2])
    first = pub.take_deltas()
    pub.insert(HASHES[1:3])
    second = pub.take_deltas()
    replica = SubtreeReplica(HRTree(), b"pub")
    assert replica.apply_delta(second[0]) == NeedSnapshot(0)
    assert replica.apply_delta(first[0]) == Applied(2)
    assert replica.apply_delta(first[0]) == Ignored(2)
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")


def test_a_delta_whose_range_holds_the_replica_applies_whole():
    a, b = chained([1, 2]), chained([2])
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(a)
    middle = pub.snapshot()  # at seq 1, in the middle of the next delta
    pub.insert(b)
    pub.evict(a[:1])
    (whole,) = pub.take_deltas()
    assert (whole.seq_from, whole.seq_to) == (0, 3)
    replica = SubtreeReplica(HRTree(), b"pub")
    assert replica.apply_snapshot(middle) == Applied(1)
    assert replica.apply_delta(whole) == Applied(3)
    assert replica.tree.prefixes(b"pub") == frozenset({b})


@given(st.lists(subtree_ops, max_size=12), st.lists(subtree_ops, min_size=1, max_size=20),
       st.lists(nonempty_named_chains, max_size=4))
@settings(max_examples=300, deadline=None)
def test_a_coalesced_delta_applied_anywhere_in_its_range_gives_the_subtree_after_its_ops(
        before, batch, others):
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    for kind, chain in before:
        pub.apply(Op(kind, chain))
    pub.take_deltas()
    states = [pub.tree.prefixes(b"pub")]
    added = evictions = 0
    for kind, chain in batch:
        entries = pub.tree.entries(b"pub")
        if pub.apply(Op(kind, chain)):
            states.append(pub.tree.prefixes(b"pub"))
            added += max(0, pub.tree.entries(b"pub") - entries)
            evictions += kind == OpKind.EVICT
    deltas = pub.take_deltas()
    if len(states) == 1:
        assert deltas == []
        return
    (delta,) = deltas
    assert Delta.decode(delta.encode()) == delta
    assert delta.seq_to - delta.seq_from == len(states) - 1
    # never more than the ops: a name per eviction at most, each added entry's hash at most once
    assert len(delta.evicts) <= evictions
    assert sum(len(i.hashes) for i in delta.inserts) <= added
    for k, state in enumerate(states[:-1]):
        tree = HRTree()
        for chain in others:  # another peer holding the same names: never resolved for pub
            tree.insert(b"other", chain)
        replica = SubtreeReplica(tree, b"pub")
        replica.apply_snapshot(Snapshot.from_prefixes(0, 1, delta.seq_from + k, state))
        assert replica.apply_delta(delta) == Applied(delta.seq_to)
        assert tree.prefixes(b"pub") == states[-1]
        assert tree.prefixes(b"other") == frozenset(p[:i] for p in others
                                                    for i in range(1, len(p) + 1))


def test_a_new_prompt_under_a_held_prefix_sends_only_its_own_chunks():
    system, prompt = chained([1, 1]), chained([1, 1, 2, 3, 2])
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(system)
    pub.take_deltas()
    pub.insert(prompt)
    pub.insert(prompt + chained([1, 1, 2, 3, 2, 1])[-1:])  # the same prompt grew: joined
    (delta,) = pub.take_deltas()
    assert delta.evicts == ()
    assert delta.inserts == (Insert(system[-1], chained([1, 1, 2, 3, 2, 1])[2:]),)


def test_evictions_covered_by_a_shorter_one_of_the_batch_are_left_out():
    prompt = chained([1, 2, 3, 1])
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(prompt)
    pub.insert(chained([3]))
    pub.take_deltas()
    for depth in (4, 3, 2):  # an LRU: the leaf chunk first
        pub.evict(prompt[:depth])
    pub.evict(chained([3]))
    (delta,) = pub.take_deltas()
    assert delta.evicts == tuple(sorted((prompt[1], chained([3])[0])))
    assert delta.inserts == () and delta.seq_to - delta.seq_from == 4


def test_an_insert_that_a_later_eviction_of_the_batch_drops_is_cut():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(chained([1, 2, 3]))
    pub.evict(chained([1, 2]))
    pub.insert(chained([2]))
    pub.clear()
    pub.insert(chained([3, 3]))
    (delta,) = pub.take_deltas()
    assert delta.evicts == (ROOT_HASH,)
    assert delta.inserts == (Insert(ROOT_HASH, chained([3, 3])),)


def test_an_insert_under_a_parent_the_replica_lacks_drops_the_peer_and_asks_for_a_snapshot():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(chained([1, 2]))
    replica = SubtreeReplica(HRTree(), b"pub")
    replica.apply_delta(pub.take_deltas()[0])
    pub.insert(chained([1, 2, 3]))
    (good,) = pub.take_deltas()
    lost = Insert(chained([3])[0], good.inserts[0].hashes)  # a parent pub never held
    assert replica.apply_delta(Delta(0, 1, 1, 2, (), (lost,))) == NeedSnapshot(None)
    assert replica.tree.entries(b"pub") == 0 and replica.seq is None
    assert replica.apply_delta(good) == NeedSnapshot(None)  # buffered until a snapshot
    assert replica.apply_snapshot(pub.snapshot()) == Applied(2)
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")


def test_a_restarted_publisher_replaces_the_old_run():
    old = SubtreePublisher(HRTree(), b"pub", 1)
    old.insert(HASHES[:3])
    old_deltas = old.take_deltas()
    new = SubtreePublisher(HRTree(), b"pub", 2)
    new.insert(HASHES[1:2])
    replica = SubtreeReplica(HRTree(), b"pub")
    replica.apply_delta(old_deltas[0])
    assert replica.apply_delta(new.take_deltas()[0]) == Applied(1)
    assert replica.tree.prefixes(b"pub") == frozenset({HASHES[1:2]})
    assert replica.apply_delta(old_deltas[0]) == Ignored(1)  # a replay of the old run
    assert replica.apply_snapshot(old.snapshot()) == Ignored(1)


def test_deltas_and_snapshots_of_another_chunk_lengths_version_are_refused():
    pub = SubtreePublisher(HRTree(version=4), b"pub", 1)
    pub.insert(HASHES[:1])
    replica = SubtreeReplica(HRTree(version=5), b"pub")
    with pytest.raises(SubtreeSyncError):
        replica.apply_delta(pub.take_deltas()[0])
    with pytest.raises(SubtreeSyncError):
        replica.apply_snapshot(pub.snapshot())
    assert replica.tree.entries() == 0


def test_only_changes_get_a_sequence_number():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    assert pub.insert(HASHES[:2]) and pub.seq == 1
    assert not pub.insert(HASHES[:1]) and pub.seq == 1
    assert not pub.evict(HASHES[2:3]) and pub.seq == 1
    assert pub.clear() and pub.seq == 2
    assert not pub.clear() and pub.seq == 2


def test_take_deltas_splits_into_limited_batches_with_contiguous_seqs():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    chains_ = [tuple(i.to_bytes(HASH_BYTES, "big") for i in (n, n + 1)) for n in range(0, 5000, 2)]
    for c in chains_:
        pub.insert(c)
    deltas = pub.take_deltas()
    assert [d.seq_from for d in deltas] == [0, 1024, 2048]
    assert deltas[-1].seq_to == pub.seq == 2500
    assert all(len(d.inserts) <= MAX_DELTA_OPS and len(d.encode()) <= MAX_DELTA_BYTES
               for d in deltas)
    assert pub.take_deltas() == []


def test_take_deltas_keeps_each_delta_under_the_hash_and_byte_limits():
    pub = SubtreePublisher(HRTree(max_entries_per_peer=MAX_SNAPSHOT_ENTRIES), b"pub", 1)
    chains = [tuple((n * MAX_DEPTH + i + 1).to_bytes(HASH_BYTES, "big") for i in range(MAX_DEPTH))
              for n in range(MAX_DELTA_CHAIN_HASHES // MAX_DEPTH + 1)]  # 33 of 2,048 hashes
    for chain in chains[:-1]:
        pub.insert(chain)
    pub.evict(chains[0][:1])  # room for the last one in the subtree, not in one delta
    pub.insert(chains[-1])
    deltas = pub.take_deltas()
    assert [(d.seq_from, d.seq_to) for d in deltas] == [(0, 33), (33, 34)]
    assert all(len(d.encode()) <= MAX_DELTA_BYTES for d in deltas)
    replica = SubtreeReplica(HRTree(max_entries_per_peer=MAX_SNAPSHOT_ENTRIES), b"pub")
    for d in deltas:
        replica.apply_delta(d)
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")


def test_a_publisher_over_its_pending_limit_drops_ops_and_replicas_resync():
    pub = SubtreePublisher(HRTree(max_entries_per_peer=MAX_SNAPSHOT_ENTRIES), b"pub", 1)
    for n in range(MAX_PENDING_OPS + 10):
        pub.insert((n.to_bytes(HASH_BYTES, "big"),))
    deltas = pub.take_deltas()
    assert pub.dropped_ops == MAX_PENDING_OPS
    assert deltas[0].seq_from == MAX_PENDING_OPS and deltas[-1].seq_to == pub.seq
    replica = SubtreeReplica(HRTree(max_entries_per_peer=MAX_SNAPSHOT_ENTRIES), b"pub")
    assert replica.apply_delta(deltas[0]) == NeedSnapshot(0)
    assert replica.apply_snapshot(pub.snapshot()) == Applied(pub.seq)
    assert replica.tree.entries(b"pub") == MAX_PENDING_OPS + 10


def test_a_replica_over_the_tree_limits_drops_the_peer_and_needs_a_snapshot():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(HASHES[:3])
    (delta,) = pub.take_deltas()
    tree = HRTree(max_entries_per_peer=2)
    replica = SubtreeReplica(tree, b"pub")
    with pytest.raises(HRTreeFullError):
        replica.apply_delta(delta)
    assert tree.entries() == 0 and replica.seq is None
    with pytest.raises(HRTreeFullError):
        replica.apply_snapshot(pub.snapshot())
    assert tree.entries() == 0
    pub.insert(HASHES[1:2])
    assert replica.apply_delta(pub.take_deltas()[0]) == NeedSnapshot(None)


# -------------------------------------------------------------------------------- encodings

names = st.one_of(
    st.lists(st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES).filter(lambda h: h != ROOT_HASH),
             max_size=4, unique=True).map(lambda hs: tuple(sorted(hs))),
    st.just((ROOT_HASH,)),
)
inserts = st.lists(
    st.builds(Insert, st.one_of(st.just(ROOT_HASH), st.sampled_from(HASHES)), nonempty_chains),
    max_size=4,
).map(tuple)
deltas = st.builds(
    lambda version, inc, start, extra, evicts, ins: Delta(
        version, inc, start, start + len(evicts) + len(ins) + extra, evicts, ins),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**63),
    st.integers(0, 3),
    names,
    inserts,
).filter(lambda d: d.evicts or d.inserts)


@given(deltas)
@settings(max_examples=200, deadline=None)
def test_deltas_round_trip_through_their_canonical_bytes(delta):
    data = delta.encode()
    assert Delta.decode(data) == delta
    assert data.startswith(DELTA_DOMAIN)


@given(st.lists(nonempty_chains, max_size=10), st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_snapshots_round_trip_through_their_canonical_bytes(prefixes, seq):
    snap = Snapshot.from_prefixes(1, 2, seq, prefixes)
    assert Snapshot.decode(snap.encode()) == snap
    closed = {p[:i] for p in prefixes for i in range(1, len(p) + 1)}
    assert snap.prefixes() == closed and snap.entries == len(closed)


def small_delta() -> Delta:
    return Delta(1, 2**40, 300, 305, (HASHES[0], HASHES[2]),
                 (Insert(ROOT_HASH, HASHES[:2]), Insert(HASHES[1], HASHES[2:])))


def test_a_delta_encodes_as_documented():
    assert small_delta().encode() == (
        DELTA_DOMAIN + b"\x01" + b"\x80\x80\x80\x80\x80\x20" + b"\xac\x02" + b"\x05"
        + b"\x02" + HASHES[0] + HASHES[2]
        + b"\x02" + ROOT_HASH + b"\x02" + HASHES[0] + HASHES[1] + HASHES[1] + b"\x01" + HASHES[2])


def test_every_truncation_or_extension_of_a_delta_is_refused():
    data = small_delta().encode()
    for cut in range(len(data)):
        with pytest.raises(SubtreeSyncError):
            Delta.decode(data[:cut])
    with pytest.raises(SubtreeSyncError):
        Delta.decode(data + b"\x00")


def test_every_truncation_of_a_snapshot_is_refused():
    data = Snapshot.from_prefixes(1, 2, 3, [HASHES[:2], HASHES[1:]]).encode()
    for cut in range(len(data)):
        with pytest.raises(SubtreeSyncError):
            Snapshot.decode(data[:cut])
    with pytest.raises(SubtreeSyncError):
        Snapshot.decode(data + b"\x00")


def uv(n: int) -> bytes:
    """Unsigned LEB128, shortest form."""
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n >= 0x80 else 0))
        n >>= 7
        if not n:
            return bytes(out)


def delta_bytes(evicts=(), inserts=(), *, seq_from=0, span=None, domain=DELTA_DOMAIN,
                header=None) -> bytes:
    items = len(evicts) + len(inserts)
    head = header if header is not None else uv(0) + uv(1) + uv(seq_from)
    return (domain + head + uv(items if span is None else span) + uv(len(evicts))
            + b"".join(evicts) + uv(len(inserts)) + b"".join(inserts))


def insert_bytes(parent: bytes, hashes, count=None) -> bytes:
    return parent + uv(len(hashes) if count is None else count) + b"".join(hashes)


ONE = insert_bytes(ROOT_HASH, HASHES[:1])
NAMES = [i.to_bytes(HASH_BYTES, "big") for i in range(1, MAX_DELTA_OPS + 2)]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(delta_bytes(inserts=[ONE], domain=SNAPSHOT_DOMAIN), id="wrong domain"),
        pytest.param(delta_bytes(inserts=[ONE], domain=b"planetserve/v1/hrtree-delta\x00"),
                     id="the first delta encoding"),
        pytest.param(delta_bytes(inserts=[ONE], domain=b"planetserve/v1/hrtree-delta-v2\x00"),
                     id="the second delta encoding"),
        pytest.param(delta_bytes(), id="no evictions or inserts"),
        pytest.param(delta_bytes(inserts=[ONE], span=0), id="no op"),
        pytest.param(delta_bytes([HASHES[0]], [ONE], span=1), id="more items than ops"),
        pytest.param(delta_bytes(inserts=[ONE], seq_from=2**64 - 1), id="seq past 2**64"),
        pytest.param(delta_bytes(inserts=[ONE], header=b"\x80\x00" + uv(1) + uv(0)),
                     id="varint not in its shortest form"),
        pytest.param(delta_bytes(inserts=[ONE], header=uv(0) + b"\xff" * 9 + b"\x02" + uv(0)),
                     id="varint over 64 bits"),
        pytest.param(delta_bytes([HASHES[1], HASHES[0]]), id="names descending"),
        pytest.param(delta_bytes([HASHES[1], HASHES[1]]), id="a name twice"),
        pytest.param(delta_bytes([ROOT_HASH, HASHES[0]]), id="everything, not alone"),
        pytest.param(delta_bytes(inserts=[insert_bytes(ROOT_HASH, (), 0)]), id="insert of nothing"),
        pytest.param(delta_bytes(inserts=[insert_bytes(ROOT_HASH, HASHES[:1] * (MAX_DEPTH + 1))]),
                     id="insert over max depth"),
        pytest.param(delta_bytes(NAMES), id="too many items"),
        pytest.param(b"\x00" * (MAX_DELTA_BYTES + 1), id="oversized"),
    ],
)
def test_malformed_deltas_are_refused(data):
    with pytest.raises(SubtreeSyncError):
        Delta.decode(data)


def snapshot_bytes(leaves: list[bytes]) -> bytes:
    return SNAPSHOT_DOMAIN + u64(0) + u64(1) + u64(2) + u32(len(leaves)) + b"".join(leaves)


def leaf_bytes(shared: int, hashes) -> bytes:
    new = b"".join(hashes)
    return u32(shared) + u32(len(new)) + new


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(snapshot_bytes([leaf_bytes(0, HASHES[1:2]), leaf_bytes(0, HASHES[:1])]),
                     id="descending"),
        pytest.param(snapshot_bytes([leaf_bytes(0, HASHES[:1]), leaf_bytes(1, HASHES[1:2])]),
                     id="a leaf that extends the previous one"),
        pytest.param(snapshot_bytes([leaf_bytes(0, HASHES[:2]),
                                     leaf_bytes(0, (HASHES[0], HASHES[2]))]),
                     id="shared count not maximal"),
        pytest.param(snapshot_bytes([leaf_bytes(0, HASHES[:2]), leaf_bytes(1, ())]),
                     id="an empty leaf"),
        pytest.param(snapshot_bytes([leaf_bytes(3, HASHES[:1])]), id="first leaf shares"),
        pytest.param(snapshot_bytes([leaf_bytes(0, HASHES[:1] * (MAX_DEPTH + 1))]),
                     id="leaf over max depth"),
        pytest.param(
            snapshot_bytes([leaf_bytes(0, [i.to_bytes(HASH_BYTES, "big")] * MAX_DEPTH)
                            for i in range(MAX_SNAPSHOT_ENTRIES // MAX_DEPTH + 1)]),
            id="over the entry limit"),
        pytest.param(b"\x00" * (MAX_SNAPSHOT_BYTES + 1), id="oversized"),
    ],
)
def test_malformed_snapshots_are_refused(data):
    with pytest.raises(SubtreeSyncError):
        Snapshot.decode(data)


@pytest.mark.parametrize(
    "delta",
    [
        pytest.param(Delta(0, 0, 0, 2), id="no evictions or inserts"),
        pytest.param(Delta(0, 0, 0, 1, HASHES[:2]), id="more items than ops"),
        pytest.param(Delta(0, 0, 0, 2, (HASHES[1], HASHES[0])), id="names descending"),
        pytest.param(Delta(0, 0, 0, 2, (ROOT_HASH, HASHES[0])), id="everything, not alone"),
        pytest.param(Delta(0, 0, 0, 1, (), (Insert(ROOT_HASH, ()),)), id="insert of nothing"),
        pytest.param(Delta(0, 0, 0, 1, (), (Insert(b"short", HASHES[:1]),)), id="parent width"),
        pytest.param(Delta(0, 0, 0, 40, (), tuple(Insert(ROOT_HASH, HASHES[:1] * MAX_DEPTH)
                                                  for _ in range(MAX_DELTA_CHAIN_HASHES
                                                                 // MAX_DEPTH + 1))),
                     id="inserts over the work limit"),
        pytest.param(Delta(0, 2**64, 0, 1, HASHES[:1]), id="incarnation past u64"),
    ],
)
def test_encoders_refuse_deltas_that_break_a_rule(delta):
    with pytest.raises(LocalProtocolError):
        delta.encode()


def test_encoders_refuse_values_over_the_limits():
    with pytest.raises(LocalProtocolError):
        Snapshot(0, 0, 0, ((0, HASHES[1:2]), (0, HASHES[:1]))).encode()


def test_inserts_are_joined_only_onto_the_same_prefix():
    # Hashes that repeat at different depths (not chained): joining compares whole chains.
    a, b, c = HASHES
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert((b,))
    pub.insert((a, b))
    pub.insert((b, c))
    (delta,) = pub.take_deltas()
    assert delta.inserts == (Insert(ROOT_HASH, (b,)), Insert(ROOT_HASH, (a, b)), Insert(b, (c,)))
    replica = SubtreeReplica(HRTree(), b"pub")
    replica.apply_delta(delta)
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")
