"""HR-tree core (ps_p2p.gossip.hr_tree): keyed chained chunk hashes, Algorithm 1 search against a
dict-of-prefixes model, bounds, subtree replication (deltas, snapshots) and its encodings."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.consensus.encoding import u8, u32, u64
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
    SNAPSHOT_DOMAIN,
    Applied,
    Delta,
    HRTree,
    Ignored,
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


def reference_chunk_hash(parent: bytes | None, tokens: list[int], key: bytes) -> bytes:
    """The module docstring's formula, written out with hashlib directly."""
    data = (parent or bytes(8)) + struct.pack(">I", len(tokens)) + b"".join(
        struct.pack(">I", t) for t in tokens
    )
    return hashlib.blake2b(data, digest_size=8, key=key, person=b"ps-hrtree-chunk1").digest()


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


def test_search_returns_the_peers_of_the_deepest_matched_prefix():
    tree = HRTree()
    a, b, c, x = HASHES[0], HASHES[1], HASHES[2], b"\x99" * 8
    tree.insert(b"long", (a, b, c))
    tree.insert(b"short", (a, b))
    assert tree.search((a, b, c, a), 2) == hr_tree.SearchResult(frozenset({b"long"}), 3)
    assert tree.search((a, b, x), 2) == hr_tree.SearchResult(frozenset({b"long", b"short"}), 2)


def test_a_match_shorter_than_tau_c_is_a_miss_however_the_walk_ends():
    tree = HRTree()
    tree.insert(b"p", tuple(HASHES[:2]))
    assert tree.search((HASHES[0], b"\x99" * 8), 2) == hr_tree.SearchResult(frozenset(), 1)
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

publisher_ops = st.lists(
    st.one_of(
        st.tuples(st.just(OpKind.INSERT), nonempty_chains),
        st.tuples(st.just(OpKind.EVICT), chains),
        st.tuples(st.just("take"), st.just(())),
    ),
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


def test_an_overlapping_delta_applies_only_its_new_ops():
    pub = SubtreePublisher(HRTree(), b"pub", 1)
    pub.insert(HASHES[:1])
    pub.insert(HASHES[1:2])
    pub.evict(HASHES[:1])
    (whole,) = pub.take_deltas()
    replica = SubtreeReplica(HRTree(), b"pub")
    replica.apply_delta(Delta(0, 1, 0, 1, whole.ops[:1]))
    assert replica.apply_delta(whole) == Applied(3)
    assert replica.tree.prefixes(b"pub") == frozenset({HASHES[1:2]})


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
    chains_ = [tuple(i.to_bytes(8, "big") for i in (n, n + 1)) for n in range(0, 5000, 2)]
    for c in chains_:
        pub.insert(c)
    deltas = pub.take_deltas()
    assert [d.seq_from for d in deltas] == [0, 1024, 2048]
    assert deltas[-1].seq_to == pub.seq == 2500
    assert all(len(d.ops) <= MAX_DELTA_OPS and len(d.encode()) <= MAX_DELTA_BYTES for d in deltas)
    assert pub.take_deltas() == []


def test_a_publisher_over_its_pending_limit_drops_ops_and_replicas_resync():
    pub = SubtreePublisher(HRTree(max_entries_per_peer=MAX_SNAPSHOT_ENTRIES), b"pub", 1)
    for n in range(MAX_PENDING_OPS + 10):
        pub.insert((n.to_bytes(8, "big"),))
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

deltas = st.builds(
    lambda version, inc, start, ops: Delta(version, inc, start, start + len(ops), tuple(ops)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**63),
    st.lists(
        st.one_of(
            st.builds(Op, st.just(OpKind.INSERT), nonempty_chains),
            st.builds(Op, st.just(OpKind.EVICT), chains),
        ),
        min_size=1,
        max_size=8,
    ),
)


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
    return Delta(1, 2, 3, 5, (Op(OpKind.INSERT, tuple(HASHES[:2])),
                              Op(OpKind.EVICT, (HASHES[0], HASHES[2]))))


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


def delta_bytes(ops_bytes: list[bytes], seq_from=0, seq_to=None, domain=DELTA_DOMAIN) -> bytes:
    n = len(ops_bytes)
    return (domain + u64(0) + u64(1) + u64(seq_from) + u64(n if seq_to is None else seq_to)
            + u32(n) + b"".join(ops_bytes))


def op_bytes(kind: int, shared: int, hashes) -> bytes:
    new = b"".join(hashes)
    return u8(kind) + u32(shared) + u32(len(new)) + new


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(delta_bytes([op_bytes(1, 0, HASHES[:1])], domain=SNAPSHOT_DOMAIN),
                     id="wrong domain"),
        pytest.param(delta_bytes([]), id="no ops"),
        pytest.param(delta_bytes([op_bytes(1, 0, HASHES[:1])], seq_to=2), id="seq mismatch"),
        pytest.param(delta_bytes([op_bytes(3, 0, HASHES[:1])]), id="unknown kind"),
        pytest.param(delta_bytes([op_bytes(1, 0, ())]), id="insert of nothing"),
        pytest.param(delta_bytes([op_bytes(1, 1, HASHES[:1])]), id="first op shares"),
        pytest.param(delta_bytes([op_bytes(1, 0, HASHES[:2]), op_bytes(1, 0, HASHES[:1])]),
                     id="shared count not maximal"),
        pytest.param(delta_bytes([op_bytes(1, 0, HASHES[:1]), op_bytes(2, 2, ())]),
                     id="shares more than the previous chain"),
        pytest.param(delta_bytes([u8(1) + u32(0) + u32(5) + b"12345"]), id="hash width"),
        pytest.param(delta_bytes([op_bytes(1, 0, HASHES[:1] * (MAX_DEPTH + 1))]),
                     id="chain over max depth"),
        pytest.param(
            delta_bytes([op_bytes(1, 0, HASHES[:1] * MAX_DEPTH)]
                        + [op_bytes(2, MAX_DEPTH, ())] * (MAX_DELTA_CHAIN_HASHES // MAX_DEPTH)),
            id="chains over the work limit"),
        pytest.param(delta_bytes([op_bytes(2, 0, ())] * (MAX_DELTA_OPS + 1)), id="too many ops"),
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
            snapshot_bytes([leaf_bytes(0, [i.to_bytes(8, "big")] * MAX_DEPTH)
                            for i in range(MAX_SNAPSHOT_ENTRIES // MAX_DEPTH + 1)]),
            id="over the entry limit"),
        pytest.param(b"\x00" * (MAX_SNAPSHOT_BYTES + 1), id="oversized"),
    ],
)
def test_malformed_snapshots_are_refused(data):
    with pytest.raises(SubtreeSyncError):
        Snapshot.decode(data)


def test_encoders_refuse_values_over_the_limits():
    with pytest.raises(LocalProtocolError):
        Delta(0, 0, 0, 2, (Op(OpKind.EVICT, ()),)).encode()
    with pytest.raises(LocalProtocolError):
        Delta(0, 0, 0, 1, (Op(OpKind.INSERT, ()),)).encode()
    with pytest.raises(LocalProtocolError):
        Snapshot(0, 0, 0, ((0, HASHES[1:2]), (0, HASHES[:1]))).encode()
