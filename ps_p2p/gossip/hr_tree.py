"""Hash-Radix tree (HR-tree) of a model group and its per-peer replication, pure.

Source: PlanetServe sec. 3.3 ("Hash-Radix tree", "State synchronization"), Appendix Algorithm 1
(search), A6 (delta updates rather than full broadcasts).

**Chunk hashes.** A prompt (token IDs) is cut into chunks by the group's chunk-length array L
(:class:`~ps_p2p.gossip.sentry.ChunkLengths`, the Sentry's output); only complete chunks are
hashed, since a trailing partial chunk cannot name a cached block prefix. Chunk i's hash is::

    h_i = BLAKE2b-48(key = group key, person = b"ps-hrtree-chunk1",
                     h_{i-1} || u32(n) || u32(t_1) || ... || u32(t_n))        (h_0 = 6 zero bytes)

over its n tokens t (big-endian). It is *keyed* by a secret of the model group (derived from the
operators' ``[forwarding] group_key``, :meth:`ps_p2p.config.ForwardingConfig.key_bytes`), so a
node that watches the gossip cannot test guessed prompts against it, and *chained*, so it commits to the
whole prefix: equal chunks after different prefixes hash differently, and one hash names one
prefix. Prompts longer than :data:`MAX_DEPTH` chunks are represented by their first
:data:`MAX_DEPTH` chunks.

**False positives.** The paper uses 8-bit hashes and bounds a false match of d levels by 1/256^d
(sec. 3.3). We use w = :data:`HASH_BYTES` = 6 bytes (48 bits; 8 until issue 19: every delta
and snapshot carries one hash per entry, so 6 bytes send a quarter less). A lookup goes one
level too deep only if the query's next chunk hash equals one of the c children of the node
reached, probability at most c / 2^(8w) (the hashes of different prefixes are independent under
the key). So a lookup's result is wrong with probability at most ``sum_i c_i / 2^48 <= N /
2^48`` for a tree of N nodes (1e6 nodes: 3.6e-9; the error is a chunk or more of match
overstated, which costs a cache-hit guess, never what is served), and a prompt sharing nothing
with the tree falsely matches at depth tau_c with probability at most ``prod_{i < tau_c} c_i /
2^48`` (the paper's (c / 2^b)^d with b = 48). The bound that sets w is the names' (below): 4
bytes would make two names of one peer's 65,536 entries collide with probability about 1/2.

**Tree.** :class:`HRTree` is the union of the subtrees of all peers of a group: a tree node is a
prefix (a chain of chunk hashes) and holds the set of peers that cache that prefix (the paper's
modelNodeList). Each peer's set of prefixes is prefix-closed (a peer that caches a prefix caches
every shorter one), so a node's peers include those of all its children, and a node exists only
while some peer holds it. An *entry* is one (peer, prefix) pair; entries are bounded per peer
and in total, and so are the peers. The tree is keyed by one ``ChunkLengths.version``: a new L
gives new hashes, hence a new tree (built again from each node's cache, see
:mod:`ps_p2p.gossip.cache_view`), and deltas or snapshots of another version are refused.

**Replication.** Each model node publishes its own subtree (:class:`SubtreePublisher`) as
sequence-numbered operations (insert a prefix, evict a prefix and everything under it), taken
in batches as :class:`Delta` values, and answers a gap with a :class:`Snapshot` of the whole
subtree. A node applies each peer's deltas and snapshots to its tree through that peer's
:class:`SubtreeReplica`, which applies deltas in order, buffers a few that arrive early,
ignores duplicates and replays, and asks for a snapshot on a gap. ``incarnation`` (chosen by the
publisher at start, e.g. its start time in ms, increasing across restarts) tells a restarted
publisher's new sequence from the old one's.

**Deltas name prefixes by their last chunk hash.** The hashes being chained, the last hash of a
prefix names it (``h_0``, :data:`ROOT_HASH` = 8 zero bytes, names the empty prefix, the root).
A delta of ops ``seq_from + 1 .. seq_to`` carries their net effect, coalesced: first the
*evictions*, each the name of a prefix to drop with everything under it, only those no other
eviction of the batch covers, sorted (they commute); then the *inserts*, in the publisher's
order, each ``(parent, hashes)``: the publisher holds the prefix named ``parent`` extended by
``hashes``, where ``parent`` is the deepest prefix of the chain that the publisher held before
the op (so a new prompt under a cached system prompt sends only its own chunks); an insert whose
part a later eviction of the batch drops is cut or left out, and one that continues the chain of
an earlier insert of the batch is joined to it. Applied to the subtree at *any* sequence number
``s`` of ``seq_from <= s < seq_to`` this gives the subtree at ``seq_to`` (proof at
:meth:`SubtreePublisher.take_deltas`), so a replica that took a snapshot in the middle of a
batch applies the whole delta.

A replica finds a name in the peer's part of the tree through a per-peer index (chunk hash ->
the tree node above that peer's node of that hash), never through another peer's entries, so a
peer that holds (or invents) a prefix ending in the same hash cannot redirect another peer's
deltas. Consequences of the 48-bit names: if two prefixes one peer holds ended in the same hash
(probability about ``n^2 / 2^49`` for n entries: 7.6e-6 for 65,536, 6e-7 for 18,750), a name
would resolve to either of them, and a chunk hash equal to :data:`ROOT_HASH` (2^-48) would name
the root; the
replica's copy of that peer would then be wrong until its next snapshot, which costs cache-hit
guesses (where a request is sent), never the correctness of what is served: the chosen node
serves the prompt from its own cache or computes it. A name the peer does not hold in an
eviction is nothing to do; in an insert (which cannot happen when deltas are applied in order
from the publisher's state) the replica drops the peer's entries and asks for a snapshot
(:class:`NeedSnapshot`).

No signatures here: the service signs and checks the canonical bytes of :meth:`Delta.encode` and
:meth:`Snapshot.encode`::

    delta    = b"HRd3" || uv(version) || uv(incarnation)
               || uv(seq_from) || uv(seq_to - seq_from) || uv(#evictions) || name*
               || uv(#inserts) || insert*
    insert   = parent (6 bytes) || uv(#hashes) || hashes (6 bytes each)
    snapshot = b"planetserve/v1/hrtree-snapshot-w6\\x00" || u64(version) || u64(incarnation)
               || u64(seq) || u32(#leaves) || leaf*
    leaf     = u32(shared) || bytes(new hashes)

where ``uv`` is an unsigned LEB128 varint of at most 64 bits in its shortest form (canonical),
``u32``/``u64`` are big-endian, ``bytes(b) = u32(len(b)) || b``, names are strictly ascending
(:data:`ROOT_HASH` only alone), and a snapshot lists the subtree's leaves (its maximal
prefixes) in ascending order, each front-coded against the previous one: its first ``shared``
hashes are the previous leaf's, ``shared`` the longest common prefix, then the ``new`` ones; the
sum of the ``new`` counts is its number of entries. The first two delta encodings
(``hrtree-delta``, one whole chain per op; ``hrtree-delta-v2``, this layout after a 31-byte
domain) are no longer read: their prefix differs.

This module is a pure core: no trio, libp2p, protobuf, clock or randomness.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import heapq
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from ps_p2p.consensus.encoding import Reader, u32, u64
from ps_p2p.errors import (
    ConfigError,
    HRTreeFullError,
    LocalProtocolError,
    SubtreeSyncError,
)
from ps_p2p.gossip.sentry import ChunkLengths
from ps_p2p.records.canonical import uvarint as _uvarint

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_ENTRIES_PER_PEER",
    "DEFAULT_MAX_PEERS",
    "DELTA_DOMAIN",
    "HASH_BYTES",
    "MAX_DELTA_BYTES",
    "MAX_DELTA_CHAIN_HASHES",
    "MAX_DELTA_OPS",
    "MAX_DEPTH",
    "MAX_KEY_BYTES",
    "MAX_PENDING_DELTAS",
    "MAX_PENDING_OPS",
    "MAX_SNAPSHOT_BYTES",
    "MAX_SNAPSHOT_ENTRIES",
    "MIN_KEY_BYTES",
    "ROOT_HASH",
    "SNAPSHOT_DOMAIN",
    "Applied",
    "ChunkHasher",
    "Delta",
    "HRTree",
    "Ignored",
    "Insert",
    "NeedSnapshot",
    "Op",
    "OpKind",
    "SearchResult",
    "Snapshot",
    "SubtreePublisher",
    "SubtreeReplica",
    "SyncOutcome",
    "chunk_hash",
    "chunk_hashes",
    "pack_tokens",
]

HASH_BYTES = 6
"""w: bytes of a chunk hash (the paper's example uses 1 byte; see the module docstring)."""
MIN_KEY_BYTES = 16
"""Shortest group key accepted (128 bits)."""
MAX_KEY_BYTES = 64
"""Longest group key (BLAKE2b's limit)."""
MAX_DEPTH = 2048
"""Most chunks of one prefix (64k tokens at 32 a chunk); a longer prompt is cut to it."""
DEFAULT_MAX_ENTRIES_PER_PEER = 1 << 16
"""Entries (prefixes) one peer may hold in a tree: 65,536, > the ~30k vLLM blocks of an 8B model
on an 80 GB GPU; also the snapshot limit, so a tree cannot accept more than a snapshot carries."""
DEFAULT_MAX_ENTRIES = 1 << 20
"""Entries in a whole tree (all peers): 1,048,576, about 320 MiB at the measured 321 bytes an
entry (47 of them the name index) of a tree where every node is held by one peer
(``benchmarks/bench_hr_tree.py``)."""
DEFAULT_MAX_PEERS = 1024
"""Peers a tree tracks (one bit each in every node's peer mask)."""
MAX_DELTA_OPS = 1024
"""Evictions plus inserts in one delta; a publisher puts at most this many ops in one delta
(each gives at most one of them)."""
MAX_DELTA_CHAIN_HASHES = 1 << 16
"""New chunk hashes summed over a delta's inserts: bounds the work (tree steps) and memory a
delta costs."""
MAX_DELTA_BYTES = 512 * 1024
"""Encoded delta: under GossipSub's usual 1 MiB message limit with room for the signature."""
MAX_SNAPSHOT_ENTRIES = DEFAULT_MAX_ENTRIES_PER_PEER
"""Entries (distinct prefixes) in one snapshot."""
MAX_SNAPSHOT_BYTES = 2 * 1024 * 1024
"""Encoded snapshot: MAX_SNAPSHOT_ENTRIES entries that are all leaves take 12 bytes + 6 a hash,
1.1 MiB."""
MAX_PENDING_DELTAS = 16
"""Deltas a replica holds that arrived before the ones they follow."""
MAX_PENDING_OPS = 8 * MAX_DELTA_OPS
"""Operations a publisher holds between two :meth:`SubtreePublisher.take_deltas`; beyond, it
drops them (the sequence still advances, so replicas see a gap and take a snapshot)."""
DELTA_DOMAIN = b"HRd3"
"""Format tag that starts :meth:`Delta.encode` (the third delta encoding). Its signature's domain
separation is the gossip envelope's (``ps_p2p.protocols.hrtree_gossip``: a signed domain, group
and kind), so the tag only tells encodings apart: the second (``planetserve/v1/hrtree-delta-v2``,
prefixes named by their last chunk hash as here) spent 31 bytes of every delta on it."""
SNAPSHOT_DOMAIN = b"planetserve/v1/hrtree-snapshot-w6\x00"
"""Domain-separation prefix of :meth:`Snapshot.encode` (``-w6``: 6-byte hashes; a snapshot of
8-byte hashes, ``planetserve/v1/hrtree-snapshot``, is refused)."""

ROOT_HASH = bytes(HASH_BYTES)
"""h_0, the name of the empty prefix (the root) in a :class:`Delta`: an insert under it, or the
eviction of everything."""

_PERSON = b"ps-hrtree-chunk1"
_UINT64_BOUND = 1 << 64
_VARINT_MAX = 10  # bytes of a 64-bit LEB128 varint
_DELTA_HEADER_MAX = len(DELTA_DOMAIN) + 6 * _VARINT_MAX
_INSERT_OVERHEAD_MAX = HASH_BYTES + 2  # parent, count (MAX_DEPTH < 2**14: 2 varint bytes)

Chain = tuple[bytes, ...]
"""A prefix: the chunk hashes of its chunks, root first."""
FrontCoded = tuple[tuple[int, Chain], ...]
"""Sorted leaves, each as (hashes shared with the previous leaf, the remaining hashes)."""


# ------------------------------------------------------------------------------ chunk hashes


@functools.lru_cache(maxsize=16)
def _keyed(key: bytes) -> hashlib.blake2b:
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise LocalProtocolError(
            f"HR-tree key of {len(key)} bytes, need {MIN_KEY_BYTES}..{MAX_KEY_BYTES}"
        )
    return hashlib.blake2b(digest_size=HASH_BYTES, key=key, person=_PERSON)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token IDs as big-endian u32s, the form chunk hashes cover.

    Raises:
        LocalProtocolError: a token ID out of [0, 2**32).
    """
    try:
        return struct.pack(f">{len(tokens)}I", *tokens)
    except struct.error:
        raise LocalProtocolError("token IDs must be integers in [0, 2**32)") from None


class ChunkHasher:
    """Chunk hashes under one group key (module docstring), for incremental use.

    Args:
        key: the model group's key, :data:`MIN_KEY_BYTES` to :data:`MAX_KEY_BYTES` bytes.

    Raises:
        LocalProtocolError: a bad key length.
    """

    def __init__(self, key: bytes) -> None:
        self._base = _keyed(bytes(key))

    def hash_packed(self, parent: bytes | None, packed: bytes) -> bytes:
        """The hash of the chunk ``packed`` (:func:`pack_tokens`) after chunk hash ``parent``
        (None for the first chunk)."""
        h = self._base.copy()
        h.update(parent or ROOT_HASH)
        h.update(struct.pack(">I", len(packed) // 4))
        h.update(packed)
        return h.digest()


def chunk_hash(parent: bytes | None, tokens: Sequence[int], key: bytes) -> bytes:
    """The hash of one chunk after the prefix whose last chunk hash is ``parent``.

    Args:
        parent: the previous chunk's hash (:data:`HASH_BYTES` bytes), None for the first chunk.
        tokens: the chunk's token IDs, each in [0, 2**32).
        key: the model group's key, :data:`MIN_KEY_BYTES` to :data:`MAX_KEY_BYTES` bytes.

    Returns:
        :data:`HASH_BYTES` bytes (module docstring).

    Raises:
        LocalProtocolError: a bad key length, parent length or token ID.
    """
    if parent is not None and len(parent) != HASH_BYTES:
        raise LocalProtocolError(f"parent hash of {len(parent)} bytes, need {HASH_BYTES}")
    return ChunkHasher(key).hash_packed(parent, pack_tokens(tokens))


def chunk_hashes(token_ids: Sequence[int], lengths: ChunkLengths, key: bytes) -> list[bytes]:
    """Chained, keyed hashes of a prompt's complete chunks (Algorithm 1, lines 2-8).

    Args:
        token_ids: the prompt's token IDs, each in [0, 2**32).
        lengths: the group's L; chunk i covers ``[lengths.end(i-1), lengths.end(i))``.
        key: the model group's key (:func:`chunk_hash`).

    Returns:
        One hash per complete chunk, at most :data:`MAX_DEPTH`; a trailing partial chunk is
        not hashed (a prompt shorter than its first chunk gives []).

    Raises:
        LocalProtocolError: a bad key length or token ID.
    """
    hasher = ChunkHasher(key)
    n = min(lengths.chunk_count(len(token_ids)), MAX_DEPTH)
    if n == 0:
        return []
    packed = pack_tokens(token_ids[: lengths.end(n - 1)])
    out: list[bytes] = []
    parent = None
    start = 0
    for i in range(n):  # Alg.1 L5-8
        end = lengths.end(i)
        parent = hasher.hash_packed(parent, packed[4 * start: 4 * end])  # L6
        out.append(parent)
        start = end  # L7
    return out


# --------------------------------------------------------------------------------------- tree


class _Node:
    """A prefix: children by chunk hash (None when it has none), a bit per holding peer, and its
    depth (chunks), so an insert under a named prefix keeps to :data:`MAX_DEPTH`."""

    __slots__ = ("children", "depth", "mask")

    def __init__(self, depth: int) -> None:
        self.children: dict[bytes, _Node] | None = None
        self.depth = depth
        self.mask = 0


@dataclass(frozen=True)
class SearchResult:
    """What Algorithm 1 returns.

    Attributes:
        peers: the peers holding the deepest matched prefix; empty for a miss (depth < tau_c).
        depth: d, the chunks matched (reported for a miss too).
    """

    peers: frozenset[bytes]
    depth: int

    @property
    def hit(self) -> bool:
        """A match of at least tau_c chunks (Algorithm 2's "cache hit")."""
        return bool(self.peers)


def _check_chain(chain: Sequence[bytes]) -> Chain:
    chain = tuple(chain)
    if len(chain) > MAX_DEPTH:
        raise LocalProtocolError(f"prefix of {len(chain)} chunks (max {MAX_DEPTH})")
    for h in chain:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise LocalProtocolError(f"chunk hashes are {HASH_BYTES} bytes, got {h!r}")
    return chain


class HRTree:
    """The union of the subtrees of a model group's peers (sec. 3.3, Fig. 6).

    Args:
        version: the ``ChunkLengths.version`` its chunk hashes are computed with.
        max_entries_per_peer: entries one peer may hold, at most :data:`MAX_SNAPSHOT_ENTRIES`.
        max_entries: entries of all peers together.
        max_peers: peers holding at least one entry.

    Raises:
        ConfigError: a limit < 1, or ``max_entries_per_peer`` above the snapshot limit.
    """

    def __init__(
        self,
        version: int = 0,
        *,
        max_entries_per_peer: int = DEFAULT_MAX_ENTRIES_PER_PEER,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_peers: int = DEFAULT_MAX_PEERS,
    ) -> None:
        if min(max_entries_per_peer, max_entries, max_peers) < 1:
            raise ConfigError("HR-tree limits must be >= 1")
        if max_entries_per_peer > MAX_SNAPSHOT_ENTRIES:
            raise ConfigError(
                f"max_entries_per_peer {max_entries_per_peer} > snapshot limit "
                f"{MAX_SNAPSHOT_ENTRIES}"
            )
        self.version = version
        self.max_entries_per_peer = max_entries_per_peer
        self.max_entries = max_entries
        self.max_peers = max_peers
        self._root = _Node(0)
        self._bit_of: dict[bytes, int] = {}
        self._peer_at: list[bytes | None] = []
        # by bit index: chunk hash -> the node above the peer's node of that hash (names, module
        # docstring); one entry per entry of the peer (the first, if two of its prefixes ended
        # in the same hash)
        self._named: list[dict[bytes, _Node] | None] = []
        self._free: list[int] = []  # heap of released bit indices
        self._count: dict[bytes, int] = {}
        self._total = 0
        self._nodes = 0

    # ---- counts

    def entries(self, peer: bytes | None = None) -> int:
        """Entries of ``peer``, or of all peers when None."""
        return self._total if peer is None else self._count.get(peer, 0)

    @property
    def node_count(self) -> int:
        """Tree nodes (distinct prefixes held by anyone)."""
        return self._nodes

    def peers(self) -> frozenset[bytes]:
        """Peers holding at least one entry."""
        return frozenset(self._bit_of)

    def _peers_of(self, mask: int) -> frozenset[bytes]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self._peer_at[low.bit_length() - 1])
            mask ^= low
        return frozenset(out)  # type: ignore[arg-type]

    # ---- search

    def search(self, chain: Sequence[bytes], tau_c: int) -> SearchResult:
        """Algorithm 1: follow the prompt's chunk hashes from the root as far as they match.

        ``tau_c`` is the paper's match threshold: a match of fewer than ``tau_c`` chunks is a
        miss (sec. 3.3: "if d exceeds a threshold, we consider it a match"), so a forwarding
        decision is only steered by a prefix long enough to be worth the cache. Unlike the
        pseudocode's line 15, which returns the list of the node where matching stops without
        the threshold check, the check applies whichever way the walk ends: the text says a
        short match is a miss, and a depth-1 match must not beat load balancing.

        Args:
            chain: :func:`chunk_hashes` of the prompt (lines 2-8, done by the caller).
            tau_c: >= 1, chunks that must match for a hit.

        Returns:
            The peers holding the deepest matched prefix and its depth d; no peers when
            d < tau_c.

        Raises:
            LocalProtocolError: ``tau_c`` < 1.
        """
        if tau_c < 1:
            raise LocalProtocolError("tau_c must be >= 1 (matching nothing is never a hit)")
        d = 0  # L2
        node = self._root  # L9
        for h in chain:  # L10
            children = node.children
            child = children.get(h) if children else None
            if child is None:  # L11 (no child chunk_i): L14-15, with the threshold below
                break
            node = child  # L12
            d += 1  # L13
        if d < tau_c:  # L18
            return SearchResult(frozenset(), d)  # L19
        return SearchResult(self._peers_of(node.mask), d)  # L21

    def match_depths(self, chain: Sequence[bytes]) -> dict[bytes, int]:
        """How deep each peer holds the prompt: Algorithm 1's walk, every holder's depth.

        :meth:`search` answers only the holders of the deepest match; a cost-aware decision
        (:mod:`ps_p2p.gossip.forwarding`) weighs each node's matched length against its load,
        so it needs every node's. A peer that holds a prefix holds all its ancestors, so the
        holders along the walk only ever drop out: one pass, O(depth + peers).

        Args:
            chain: :func:`chunk_hashes` of the prompt.

        Returns:
            Chunks matched by peer, for every peer holding at least the first chunk.
        """
        depths: dict[bytes, int] = {}
        node = self._root
        previous = 0
        d = 0
        for h in chain:
            children = node.children
            child = children.get(h) if children else None
            if child is None:
                break
            gone = previous & ~child.mask
            if gone:
                for peer in self._peers_of(gone):
                    depths[peer] = d
            previous = child.mask
            node = child
            d += 1
        if previous:
            for peer in self._peers_of(previous):
                depths[peer] = d
        return depths

    # ---- updates

    def _register(self, peer: bytes) -> int:
        if self._free:
            index = heapq.heappop(self._free)
            self._peer_at[index] = peer
            self._named[index] = {}
        else:
            index = len(self._peer_at)
            self._peer_at.append(peer)
            self._named.append({})
        self._bit_of[peer] = index
        return index

    def _release(self, peer: bytes) -> None:
        index = self._bit_of.pop(peer)
        self._peer_at[index] = None
        self._named[index] = None
        heapq.heappush(self._free, index)
        self._count.pop(peer, None)

    def _reserve(self, peer: bytes, new: int, replacing: int = 0) -> None:
        count = self._count.get(peer, 0) - replacing
        if count + new > self.max_entries_per_peer:
            raise HRTreeFullError(
                f"peer would hold {count + new} HR-tree entries "
                f"(max {self.max_entries_per_peer})"
            )
        if self._total - replacing + new > self.max_entries:
            raise HRTreeFullError(
                f"HR-tree would hold {self._total - replacing + new} entries "
                f"(max {self.max_entries})"
            )
        if peer not in self._bit_of and len(self._bit_of) >= self.max_peers:
            raise HRTreeFullError(f"HR-tree already tracks {self.max_peers} peers")

    def insert(self, peer: bytes, chain: Sequence[bytes]) -> int:
        """``peer`` holds the prefix ``chain`` (and so every prefix of it).

        Args:
            peer: the peer ID.
            chain: at most :data:`MAX_DEPTH` chunk hashes of :data:`HASH_BYTES` bytes.

        Returns:
            Entries added (0 when ``peer`` already held ``chain``).

        Raises:
            HRTreeFullError: over ``max_entries_per_peer``, ``max_entries`` or ``max_peers``;
                the tree is unchanged.
            LocalProtocolError: a malformed chain.
        """
        return self._grow(peer, self._root, _check_chain(chain))

    def insert_under(self, peer: bytes, parent: bytes, hashes: Sequence[bytes]) -> int:
        """``peer`` holds its prefix named ``parent`` extended by ``hashes`` (a delta's insert).

        Args:
            peer: the peer ID.
            parent: the last chunk hash of a prefix ``peer`` holds, or :data:`ROOT_HASH`;
                looked up among ``peer``'s own entries only (module docstring).
            hashes: chunk hashes of :data:`HASH_BYTES` bytes, at most :data:`MAX_DEPTH`.

        Returns:
            Entries added.

        Raises:
            SubtreeSyncError: ``peer`` holds no prefix named ``parent``, or the prefix would be
                longer than :data:`MAX_DEPTH` chunks; the tree is unchanged.
            HRTreeFullError: over a limit (:meth:`insert`); the tree is unchanged.
            LocalProtocolError: a malformed hash.
        """
        hashes = _check_chain(hashes)
        if parent == ROOT_HASH:
            return self._grow(peer, self._root, hashes)
        index = self._bit_of.get(peer)
        up = self._named[index].get(parent) if index is not None else None  # type: ignore[union-attr]
        if up is None:
            raise SubtreeSyncError(f"insert under {parent.hex()}, a prefix the peer does not hold")
        node = up.children[parent]  # type: ignore[index]
        if node.depth + len(hashes) > MAX_DEPTH:
            raise SubtreeSyncError(
                f"insert of a prefix of {node.depth + len(hashes)} chunks (max {MAX_DEPTH})"
            )
        return self._grow(peer, node, hashes)

    def _grow(self, peer: bytes, node: _Node, chain: Chain) -> int:
        """``peer`` holds ``node`` (the root, or a node it holds) extended by ``chain``."""
        index = self._bit_of.get(peer)
        bit = 0 if index is None else 1 << index
        have = 0
        if bit:  # the prefixes peer holds already: a path from `node` (prefix-closed)
            for h in chain:
                children = node.children
                child = children.get(h) if children else None
                if child is None or not child.mask & bit:
                    break
                node = child
                have += 1
        new = len(chain) - have
        if new == 0:
            return 0
        self._reserve(peer, new)
        if index is None:
            index = self._register(peer)
            bit = 1 << index
        named = self._named[index]
        assert named is not None
        depth, created = node.depth, 0
        for h in chain[have:]:
            depth += 1
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(h)
            if child is None:
                child = children[h] = _Node(depth)
                created += 1
            child.mask |= bit
            if h not in named:
                named[h] = node
            node = child
        self._nodes += created
        self._count[peer] = self._count.get(peer, 0) + new
        self._total += new
        return new

    def evict(self, peer: bytes, chain: Sequence[bytes]) -> int:
        """``peer`` no longer holds ``chain``, nor any longer prefix that extends it.

        Nodes no peer holds any more are pruned. The empty chain evicts all of ``peer``.

        Returns:
            Entries removed (0 when ``peer`` did not hold ``chain``).
        """
        index = self._bit_of.get(peer)
        if index is None:
            return 0
        bit = 1 << index
        parent: _Node | None = None
        node = self._root
        for h in chain:
            children = node.children
            child = children.get(h) if children else None
            if child is None or not child.mask & bit:
                return 0
            parent, node = node, child
        return self._cut(peer, index, parent, node, chain[-1] if chain else None)

    def evict_named(self, peer: bytes, name: bytes) -> int:
        """``peer`` no longer holds its prefix named ``name`` nor anything under it (a delta's
        eviction; :data:`ROOT_HASH`: everything).

        Returns:
            Entries removed (0 when ``peer`` holds no prefix of that name).
        """
        index = self._bit_of.get(peer)
        if index is None:
            return 0
        if name == ROOT_HASH:
            return self.remove_peer(peer)
        parent = self._named[index].get(name)  # type: ignore[union-attr]
        if parent is None:
            return 0
        return self._cut(peer, index, parent, parent.children[name], name)  # type: ignore[index]

    def _cut(self, peer: bytes, index: int, parent: _Node | None, node: _Node,
             key: bytes | None) -> int:
        """Clear ``peer``'s bit from ``node`` (held, ``parent.children[key]``; the root when
        ``parent`` is None) and everything under it; prune and unname what goes."""
        bit = 1 << index
        # the whole peer goes when parent is None: its names go with it in _release
        named = self._named[index] if parent is not None else None
        removed = 0
        if parent is not None:
            node.mask ^= bit
            removed += 1
            if named.get(key) is parent:  # type: ignore[union-attr, arg-type]
                del named[key]  # type: ignore[union-attr, arg-type]
        stack = [node]
        while stack:  # every node holding the bit under `node` (a subtree from `node`)
            n = stack.pop()
            children = n.children
            if not children:
                continue
            dead = []
            for h, child in children.items():
                if child.mask & bit:
                    child.mask ^= bit
                    removed += 1
                    if named is not None and named.get(h) is n:
                        del named[h]
                    if not child.mask:
                        dead.append(h)
                        self._nodes -= 1
                    stack.append(child)
            for h in dead:
                del children[h]
            if not children:
                n.children = None
        if parent is not None and not node.mask:
            del parent.children[key]  # type: ignore[index, arg-type]
            self._nodes -= 1
            if not parent.children:
                parent.children = None
        self._total -= removed
        left = self._count[peer] - removed
        if left:
            self._count[peer] = left
        else:
            self._release(peer)
        return removed

    def remove_peer(self, peer: bytes) -> int:
        """Drop everything ``peer`` holds; returns the entries removed."""
        return self.evict(peer, ())

    # ---- a peer's subtree

    def leaves(self, peer: bytes) -> FrontCoded:
        """``peer``'s maximal prefixes, ascending, front-coded (:class:`Snapshot`'s form)."""
        index = self._bit_of.get(peer)
        if index is None:
            return ()
        bit = 1 << index

        def kids(node: _Node) -> list[tuple[bytes, _Node]]:
            if not node.children:
                return []
            return sorted(
                ((h, c) for h, c in node.children.items() if c.mask & bit), key=itemgetter(0)
            )

        out: list[tuple[int, Chain]] = []
        path: list[bytes] = []
        low = 0  # shortest the path got since the last leaf: the next leaf shares that much
        stack = [iter(kids(self._root))]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                if path:
                    path.pop()
                low = min(low, len(path))
                continue
            h, child = step
            path.append(h)
            below = kids(child)
            if below:
                stack.append(iter(below))
                continue
            out.append((low, tuple(path[low:])))
            path.pop()
            low = len(path)
        return tuple(out)

    def prefixes(self, peer: bytes) -> frozenset[Chain]:
        """Every prefix ``peer`` holds (tests, small trees: memory is the sum of the depths)."""
        return _expand(self.leaves(peer))

    def replace_peer(self, peer: bytes, leaves: FrontCoded) -> int:
        """``peer`` holds exactly the prefixes of ``leaves`` (a :class:`Snapshot`'s), atomically.

        Returns:
            Entries ``peer`` holds now.

        Raises:
            HRTreeFullError: the new subtree is over a limit; the tree is unchanged.
            LocalProtocolError: ``leaves`` not canonically front-coded.
        """
        new = _check_front_coded(leaves, LocalProtocolError)
        if not new:
            self.remove_peer(peer)
            return 0
        self._reserve(peer, new, replacing=self._count.get(peer, 0))
        self.remove_peer(peer)
        index = self._register(peer)
        bit = 1 << index
        named = self._named[index]
        assert named is not None
        path = [self._root]
        for shared, hashes in leaves:
            del path[shared + 1:]
            node = path[-1]
            for h in hashes:
                children = node.children
                if children is None:
                    children = node.children = {}
                child = children.get(h)
                if child is None:
                    child = children[h] = _Node(node.depth + 1)
                    self._nodes += 1
                child.mask |= bit
                named.setdefault(h, node)
                path.append(child)
                node = child
        self._count[peer] = new
        self._total += new
        return new


def _expand(leaves: FrontCoded) -> frozenset[Chain]:
    out: set[Chain] = set()
    path: list[bytes] = []
    for shared, hashes in leaves:
        del path[shared:]
        for h in hashes:
            path.append(h)
            out.add(tuple(path))
    return frozenset(out)


def _check_front_coded(leaves: FrontCoded, error: Callable[[str], Exception]) -> int:
    """Entries of canonical front-coded leaves (ascending, none a prefix of another)."""
    path: list[bytes] = []
    entries = 0
    for i, (shared, hashes) in enumerate(leaves):
        if not hashes:
            raise error(f"leaf {i} adds no chunk hash")
        if i == 0 and shared != 0:
            raise error("the first leaf shares hashes with no previous leaf")
        if i > 0 and not shared < len(path):
            raise error(f"leaf {i} extends the previous leaf (not a leaf)")
        if i > 0 and not hashes[0] > path[shared]:
            raise error(f"leaf {i} out of order or with a shared count not maximal")
        if shared + len(hashes) > MAX_DEPTH:
            raise error(f"leaf {i} of {shared + len(hashes)} chunks (max {MAX_DEPTH})")
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise error(f"chunk hashes are {HASH_BYTES} bytes")
        entries += len(hashes)
        del path[shared:]
        path.extend(hashes)
    return entries


# ---------------------------------------------------------------------------- replication


class OpKind(enum.IntEnum):
    """An operation on a subtree."""

    INSERT = 1
    """The publisher holds ``chain`` (and its prefixes)."""
    EVICT = 2
    """The publisher no longer holds ``chain`` nor anything under it; () = everything."""


@dataclass(frozen=True)
class Op:
    """One operation on a publisher's subtree (:meth:`SubtreePublisher.apply`, what
    :class:`~ps_p2p.gossip.cache_view.CacheView` gives); ``chain`` is a prefix
    (:data:`MAX_DEPTH` hashes at most)."""

    kind: OpKind
    chain: Chain


@dataclass(frozen=True)
class Insert:
    """An insert of a :class:`Delta`: the publisher holds the prefix named ``parent`` extended by
    ``hashes`` (and so every prefix of it).

    Attributes:
        parent: the last chunk hash of a prefix the publisher held before the op (or inserted
            earlier in the same delta), :data:`ROOT_HASH` for the root.
        hashes: 1 to :data:`MAX_DEPTH` new chunk hashes, root side first.
    """

    parent: bytes
    hashes: Chain


@dataclass(frozen=True)
class Delta:
    """The net effect of a publisher's ops ``seq_from + 1 .. seq_to`` (sec. 3.3, A6), coalesced.

    Applied to the publisher's subtree at any ``s`` with ``seq_from <= s < seq_to`` (first every
    eviction, then the inserts in order) it gives the subtree at ``seq_to`` (module docstring).
    1 to :data:`MAX_DELTA_OPS` evictions plus inserts, at most ``seq_to - seq_from`` (one per op
    at most), inserts summing to at most :data:`MAX_DELTA_CHAIN_HASHES` hashes, encoding at most
    :data:`MAX_DELTA_BYTES`.

    Attributes:
        version: the ``ChunkLengths.version`` of the chunk hashes.
        incarnation: the publisher's run (u64, higher for a later run).
        seq_from: the publisher's sequence number before the first op.
        seq_to: after the last op (> ``seq_from``).
        evicts: names (last chunk hashes) of the prefixes evicted with everything under them,
            strictly ascending; :data:`ROOT_HASH` (everything) only alone.
        inserts: the inserts, in the order they apply.
    """

    version: int
    incarnation: int
    seq_from: int
    seq_to: int
    evicts: tuple[bytes, ...] = ()
    inserts: tuple[Insert, ...] = ()

    def _check(self, error: Callable[[str], Exception]) -> None:
        """Every rule of the class docstring that :meth:`encode` / :meth:`decode` enforce."""
        for name in ("version", "incarnation", "seq_from", "seq_to"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < _UINT64_BOUND:
                raise error(f"delta {name} {value!r} not in [0, 2**64)")
        items = len(self.evicts) + len(self.inserts)
        if not 1 <= items <= MAX_DELTA_OPS:
            raise error(f"a delta has 1..{MAX_DELTA_OPS} evictions and inserts, not {items}")
        if not items <= self.seq_to - self.seq_from:
            raise error(f"{items} evictions and inserts for ops {self.seq_from}..{self.seq_to}")
        prev = b""
        for name in self.evicts:
            if not isinstance(name, bytes) or len(name) != HASH_BYTES:
                raise error(f"names are {HASH_BYTES}-byte chunk hashes")
            if not name > prev:
                raise error("evicted names not strictly ascending")
            prev = name
        if ROOT_HASH in self.evicts[:1] and len(self.evicts) > 1:
            raise error("the eviction of everything comes alone")
        total = 0
        for i, ins in enumerate(self.inserts):
            if not isinstance(ins.parent, bytes) or len(ins.parent) != HASH_BYTES:
                raise error(f"insert {i}: parents are {HASH_BYTES}-byte chunk hashes")
            if not 1 <= len(ins.hashes) <= MAX_DEPTH:
                raise error(f"insert {i} of {len(ins.hashes)} hashes (need 1..{MAX_DEPTH})")
            for h in ins.hashes:
                if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                    raise error(f"insert {i}: chunk hashes are {HASH_BYTES} bytes")
            total += len(ins.hashes)
        if total > MAX_DELTA_CHAIN_HASHES:
            raise error(f"inserts of {total} hashes (max {MAX_DELTA_CHAIN_HASHES})")

    def encode(self) -> bytes:
        """The canonical bytes (module docstring), which the service signs.

        Raises:
            LocalProtocolError: the delta breaks a rule or limit of the class docstring.
        """
        self._check(LocalProtocolError)
        parts = [
            DELTA_DOMAIN,
            _uvarint(self.version),
            _uvarint(self.incarnation),
            _uvarint(self.seq_from),
            _uvarint(self.seq_to - self.seq_from),
            _uvarint(len(self.evicts)),
            *self.evicts,
            _uvarint(len(self.inserts)),
        ]
        for ins in self.inserts:
            parts += [ins.parent, _uvarint(len(ins.hashes)), *ins.hashes]
        data = b"".join(parts)
        if len(data) > MAX_DELTA_BYTES:
            raise LocalProtocolError(f"delta of {len(data)} bytes (max {MAX_DELTA_BYTES})")
        return data

    @classmethod
    def decode(cls, data: bytes) -> Delta:
        """Parse a peer's delta strictly: one canonical form, every limit checked first.

        Raises:
            SubtreeSyncError: oversized, truncated, trailing bytes, wrong domain (the first
                delta encoding included), a varint not in its shortest form or over 64 bits,
                bad counts, names not strictly ascending or the root not alone, an insert of
                no hash or over :data:`MAX_DEPTH`, or inserts over
                :data:`MAX_DELTA_CHAIN_HASHES` hashes.
        """
        if len(data) > MAX_DELTA_BYTES:
            raise SubtreeSyncError(f"delta of {len(data)} bytes (max {MAX_DELTA_BYTES})")
        r = _Reader(data, SubtreeSyncError, "HR-tree delta")
        r.prefix(DELTA_DOMAIN, "domain")
        version, incarnation = _read_uvarint(r, "version"), _read_uvarint(r, "incarnation")
        seq_from, span = _read_uvarint(r, "seq_from"), _read_uvarint(r, "op count")
        if span < 1 or seq_from + span >= _UINT64_BOUND:
            raise r.fail(f"ops {seq_from} + {span} (need >= 1, below 2**64)")
        n_evicts = _read_uvarint(r, "eviction count")
        if n_evicts > min(MAX_DELTA_OPS, span):
            raise r.fail(f"{n_evicts} evictions for {span} ops (max {MAX_DELTA_OPS})")
        evicts = _split(r.take(HASH_BYTES * n_evicts, "names"), r)
        n_inserts = _read_uvarint(r, "insert count")
        if not 1 <= n_evicts + n_inserts <= min(MAX_DELTA_OPS, span):
            raise r.fail(f"{n_evicts} evictions + {n_inserts} inserts for {span} ops "
                         f"(need 1..{MAX_DELTA_OPS})")
        inserts = []
        total = 0
        for i in range(n_inserts):
            parent = r.take(HASH_BYTES, "parent")
            count = _read_uvarint(r, "hash count")
            if not 1 <= count <= MAX_DEPTH:
                raise r.fail(f"insert {i} of {count} hashes (need 1..{MAX_DEPTH})")
            total += count
            if total > MAX_DELTA_CHAIN_HASHES:
                raise r.fail(f"inserts over {MAX_DELTA_CHAIN_HASHES} hashes")
            inserts.append(Insert(parent, _split(r.take(HASH_BYTES * count, "hashes"), r)))
        r.done()
        delta = cls(version, incarnation, seq_from, seq_from + span, evicts, tuple(inserts))
        delta._check(r.fail)  # what is left: the order of the names
        return delta


class _Reader(Reader):
    def take(self, n: int, field: str) -> bytes:
        """``n`` bytes (``n`` bounded by the caller)."""
        return self._take(n, field)


def _read_uvarint(r: _Reader, field: str) -> int:
    """An unsigned LEB128 varint of at most 64 bits, refused unless in its shortest form."""
    n = shift = 0
    while True:
        b = r.u8(field)
        if shift == 63 and b > 1:
            raise r.fail(f"{field} over 64 bits")
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and shift:
                raise r.fail(f"{field} not in its shortest form")
            return n
        shift += 7


@dataclass(frozen=True)
class Snapshot:
    """A publisher's whole subtree at sequence number ``seq`` (sec. 3.3, "State
    synchronization").

    Attributes:
        version: the ``ChunkLengths.version`` of the hashes.
        incarnation: the publisher's run.
        seq: the subtree is the one after op ``seq``.
        leaves: the maximal prefixes, ascending, front-coded: (hashes shared with the previous
            leaf, the rest); at most :data:`MAX_SNAPSHOT_ENTRIES` entries. Front coding keeps
            memory at one reference per entry whatever the shape of the tree.
    """

    version: int
    incarnation: int
    seq: int
    leaves: FrontCoded

    @classmethod
    def from_prefixes(
        cls, version: int, incarnation: int, seq: int, prefixes: Iterable[Sequence[bytes]]
    ) -> Snapshot:
        """The snapshot of the prefix-closed set generated by ``prefixes`` (any order)."""
        chains = sorted({tuple(p) for p in prefixes if p})
        maximal = [c for i, c in enumerate(chains)
                   if i + 1 == len(chains) or chains[i + 1][: len(c)] != c]
        leaves = []
        prev: Chain = ()
        for c in maximal:
            shared = _common(prev, c)
            leaves.append((shared, c[shared:]))
            prev = c
        return cls(version, incarnation, seq, tuple(leaves))

    @property
    def entries(self) -> int:
        """Distinct prefixes in the subtree."""
        return sum(len(hashes) for _, hashes in self.leaves)

    def prefixes(self) -> frozenset[Chain]:
        """Every prefix of the subtree (tests, small trees)."""
        return _expand(self.leaves)

    def encode(self) -> bytes:
        """The canonical bytes (module docstring), which the service signs.

        Raises:
            LocalProtocolError: not canonical, or over :data:`MAX_SNAPSHOT_ENTRIES` /
                :data:`MAX_SNAPSHOT_BYTES`.
        """
        if _check_front_coded(self.leaves, LocalProtocolError) > MAX_SNAPSHOT_ENTRIES:
            raise LocalProtocolError(f"snapshot over {MAX_SNAPSHOT_ENTRIES} entries")
        parts = [
            SNAPSHOT_DOMAIN,
            u64(self.version),
            u64(self.incarnation),
            u64(self.seq),
            u32(len(self.leaves)),
        ]
        for shared, hashes in self.leaves:
            new = b"".join(hashes)
            parts += [u32(shared), u32(len(new)), new]
        data = b"".join(parts)
        if len(data) > MAX_SNAPSHOT_BYTES:
            raise LocalProtocolError(f"snapshot of {len(data)} bytes (max {MAX_SNAPSHOT_BYTES})")
        return data

    @classmethod
    def decode(cls, data: bytes) -> Snapshot:
        """Parse a peer's snapshot strictly.

        Raises:
            SubtreeSyncError: oversized, truncated, trailing bytes, wrong domain, leaves not
                ascending or not maximal, non-canonical front coding, a leaf over
                :data:`MAX_DEPTH`, or over :data:`MAX_SNAPSHOT_ENTRIES` entries.
        """
        if len(data) > MAX_SNAPSHOT_BYTES:
            raise SubtreeSyncError(f"snapshot of {len(data)} bytes (max {MAX_SNAPSHOT_BYTES})")
        r = Reader(data, SubtreeSyncError, "HR-tree snapshot")
        r.prefix(SNAPSHOT_DOMAIN, "domain")
        version, incarnation, seq = r.u64("version"), r.u64("incarnation"), r.u64("seq")
        count = r.u32("leaf count")
        if count > MAX_SNAPSHOT_ENTRIES:
            raise r.fail(f"{count} leaves (max {MAX_SNAPSHOT_ENTRIES})")
        leaves = []
        entries = 0
        for _ in range(count):
            shared = r.u32("shared")
            new = _split(r.lp("chunk hashes", MAX_DEPTH * HASH_BYTES), r)
            entries += len(new)
            if entries > MAX_SNAPSHOT_ENTRIES:
                raise r.fail(f"over {MAX_SNAPSHOT_ENTRIES} entries")
            leaves.append((shared, new))
        r.done()
        leaves_t = tuple(leaves)
        _check_front_coded(leaves_t, r.fail)
        return cls(version, incarnation, seq, leaves_t)


def _split(raw: bytes, r: Reader) -> Chain:
    if len(raw) % HASH_BYTES:
        raise r.fail(f"chunk hashes of {len(raw)} bytes, not a multiple of {HASH_BYTES}")
    return tuple(raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES))


def _common(a: Chain, b: Chain) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------- publisher


class SubtreePublisher:
    """A node's own subtree: applies its changes to ``tree`` and records them as deltas.

    ``tree`` may be the node's union tree (``peer`` = the node's own peer ID, so searches find
    the node itself) or a private one. Only operations that change the subtree get a sequence
    number. Sequence numbers start at 0 with an empty subtree in every incarnation.

    Args:
        tree: where the subtree lives; ``peer`` must hold nothing in it yet.
        peer: the node's peer ID.
        incarnation: this run (u64), higher than any earlier run of the node used.

    Raises:
        LocalProtocolError: ``peer`` already holds entries in ``tree``, or a bad incarnation.
    """

    def __init__(self, tree: HRTree, peer: bytes, incarnation: int) -> None:
        if tree.entries(peer):
            raise LocalProtocolError("a publisher starts from an empty subtree")
        if not 0 <= incarnation < _UINT64_BOUND:
            raise LocalProtocolError(f"incarnation {incarnation} not in [0, 2**64)")
        self.tree = tree
        self.peer = peer
        self.incarnation = incarnation
        self.seq = 0
        self.dropped_ops = 0
        # (kind, chain, chunks of the chain held before the op: inserts only)
        self._pending: list[tuple[OpKind, Chain, int]] = []
        self._pending_from = 0  # sequence number before the first pending op

    @property
    def version(self) -> int:
        return self.tree.version

    def _record(self, kind: OpKind, chain: Chain, held: int) -> None:
        self.seq += 1
        if len(self._pending) >= MAX_PENDING_OPS:
            self.dropped_ops += len(self._pending)
            self._pending.clear()
            self._pending_from = self.seq - 1
        self._pending.append((kind, chain, held))

    def insert(self, chain: Sequence[bytes]) -> bool:
        """Hold ``chain``; True when the subtree changed.

        Raises:
            HRTreeFullError: over the tree's limits (nothing recorded).
            LocalProtocolError: a malformed chain.
        """
        chain = _check_chain(chain)
        added = self.tree.insert(self.peer, chain)
        if not added:
            return False
        self._record(OpKind.INSERT, chain, len(chain) - added)
        return True

    def evict(self, chain: Sequence[bytes]) -> bool:
        """Drop ``chain`` and everything under it (() = everything); True when it changed."""
        chain = _check_chain(chain)
        if not self.tree.evict(self.peer, chain):
            return False
        self._record(OpKind.EVICT, chain, 0)
        return True

    def clear(self) -> bool:
        """Drop the whole subtree (the engine cleared its cache)."""
        return self.evict(())

    def apply(self, op: Op) -> bool:
        """:meth:`insert` or :meth:`evict` by ``op.kind``."""
        return self.insert(op.chain) if op.kind == OpKind.INSERT else self.evict(op.chain)

    def take_deltas(self) -> list[Delta]:
        """The operations not published yet, as deltas within every delta limit, in order.

        Each delta covers at most :data:`MAX_DELTA_OPS` consecutive ops (fewer when their
        chains could pass a byte or hash limit) and carries their net effect
        (:func:`_coalesce`).

        Why a delta may be applied whole to the subtree at any ``s`` of its range. Take ops
        ``o_1 .. o_n`` from subtree ``S``; an op *touches* a prefix x when it is an insert of a
        chain that extends x or an eviction of a prefix of x. Afterwards x is held iff the last
        op that touches it is an insert, or none does and x is in S. So the result is
        ``(S - E) | I`` with E what the evictions cover and I the prefixes whose last toucher is
        an insert, which are exactly the prefixes of the inserts' chains cut before the first
        later eviction on their path (what the delta's inserts hold). The subtree ``S_s`` after
        ``o_1 .. o_s`` has ``S_s - E`` within ``(S - E) | I`` (a prefix it holds that no
        eviction covers was held before, or last touched by an insert), so ``(S_s - E) | I`` is
        the same result. And an insert's parent y is there when the insert applies: y was held
        before its op and no later eviction covers it (it lies on the cut chain), so either an
        earlier insert of the delta touched it last (and holds it), or no op before did and y is
        in ``S - E``, within ``S_s - E``.
        """
        out: list[Delta] = []
        pending = self._pending
        i = 0
        while i < len(pending):
            size, hashes, j = _DELTA_HEADER_MAX, 0, i
            while j < len(pending) and j - i < MAX_DELTA_OPS:  # upper bounds before coalescing
                kind, chain, held = pending[j]
                new = len(chain) - held if kind == OpKind.INSERT else 0
                grow = _INSERT_OVERHEAD_MAX + HASH_BYTES * new if new else HASH_BYTES
                if j > i and (size + grow > MAX_DELTA_BYTES
                              or hashes + new > MAX_DELTA_CHAIN_HASHES):
                    break
                size += grow
                hashes += new
                j += 1
            evicts, inserts = _coalesce(pending[i:j])
            seq_from = self._pending_from + i
            out.append(Delta(self.version, self.incarnation, seq_from, seq_from + j - i,
                             evicts, inserts))
            i = j
        self._pending = []
        self._pending_from = self.seq
        return out

    def snapshot(self) -> Snapshot:
        """The whole subtree now, at ``seq``."""
        return Snapshot(self.version, self.incarnation, self.seq, self.tree.leaves(self.peer))


def _coalesce(
    ops: Sequence[tuple[OpKind, Chain, int]],
) -> tuple[tuple[bytes, ...], tuple[Insert, ...]]:
    """The net effect of ``ops`` (kind, chain, chunks held before an insert), in a delta's form.

    Evictions: the shortest (no other eviction of the batch covers them), named, sorted.
    Inserts, in op order: each chain cut before the first later eviction of a prefix of it
    (exact chain comparison: the publisher knows its chains), then expressed from the deepest
    prefix held before the op (the cut chain's, if shorter); left out if that adds nothing;
    joined to an earlier insert whose chain it continues (moving additions earlier keeps every
    parent in place: the section only adds).
    """
    later: dict[bytes, list[Chain]] = {}  # evictions after the current op, by last hash
    everything_later = False
    cut: list[tuple[Chain, int] | None] = [None] * len(ops)
    evicted: set[Chain] = set()
    for k in range(len(ops) - 1, -1, -1):
        kind, chain, held = ops[k]
        if kind == OpKind.EVICT:
            evicted.add(chain)
            if chain:
                later.setdefault(chain[-1], []).append(chain)
            else:
                everything_later = True
            continue
        if everything_later:
            continue
        end = len(chain)
        if later:
            for d, h in enumerate(chain):
                found = later.get(h)
                if found and any(len(e) == d + 1 and e == chain[:d + 1] for e in found):
                    end = d
                    break
        cut[k] = (chain[:end], min(held, end))
    if () in evicted:
        names: tuple[bytes, ...] = (ROOT_HASH,)
    else:
        shortest: list[Chain] = []
        for chain in sorted(evicted):  # a prefix sorts before what extends it
            if not shortest or chain[:len(shortest[-1])] != shortest[-1]:
                shortest.append(chain)
        names = tuple(sorted({chain[-1] for chain in shortest}))
    parents: list[bytes] = []
    grown: list[list[bytes]] = []
    ends: dict[bytes, tuple[int, Chain]] = {}  # last hash of an insert's chain -> (insert, chain)
    for item in cut:
        if item is None:
            continue
        chain, held = item
        if held == len(chain):
            continue
        joined = ends.pop(chain[held - 1], None) if held else None
        if joined is not None and joined[1] != chain[:held]:  # another prefix, same last hash
            ends[chain[held - 1]] = joined
            joined = None
        if joined is not None:
            index = joined[0]
            grown[index].extend(chain[held:])
        else:
            index = len(parents)
            parents.append(chain[held - 1] if held else ROOT_HASH)
            grown.append(list(chain[held:]))
        ends[chain[-1]] = (index, chain)
    return names, tuple(Insert(p, tuple(g)) for p, g in zip(parents, grown))


# ------------------------------------------------------------------------------------ replica


@dataclass(frozen=True)
class Applied:
    """The replica moved to ``seq`` (buffered deltas that followed were applied too)."""

    seq: int


@dataclass(frozen=True)
class Ignored:
    """Nothing to do: a duplicate, a replay, or a value of an older incarnation."""

    seq: int | None


@dataclass(frozen=True)
class NeedSnapshot:
    """A gap: the replica is at ``have_seq`` (None: unknown) and needs a snapshot of a later
    ``seq`` (the delta that showed the gap is buffered, up to :data:`MAX_PENDING_DELTAS`)."""

    have_seq: int | None


SyncOutcome = Applied | Ignored | NeedSnapshot


class SubtreeReplica:
    """One peer's subtree inside a node's ``tree``, fed with that peer's deltas and snapshots.

    The service checks the signature and that ``peer`` is a model node of the group before
    calling; this class owns ordering. Every incarnation of a publisher starts at seq 0 with an
    empty subtree, so a replica follows a new incarnation from its first delta without a
    snapshot.

    Args:
        tree: the node's union tree.
        peer: the publisher's peer ID.
    """

    def __init__(self, tree: HRTree, peer: bytes) -> None:
        self.tree = tree
        self.peer = peer
        self.incarnation: int | None = None
        self.seq: int | None = None
        self._pending: dict[int, Delta] = {}  # by seq_from

    def _check_version(self, version: int, what: str) -> None:
        if version != self.tree.version:
            raise SubtreeSyncError(
                f"{what} for chunk-lengths version {version}, the tree is version "
                f"{self.tree.version}"
            )

    def _reset(self, incarnation: int | None, seq: int | None) -> None:
        self.tree.remove_peer(self.peer)
        self.incarnation = incarnation
        self.seq = seq
        self._pending.clear()

    def drop(self) -> None:
        """Forget the peer (it left the group): its entries leave the tree."""
        self._reset(None, None)

    def apply_delta(self, delta: Delta) -> SyncOutcome:
        """Apply ``delta`` if it follows (or overlaps) the replica's state.

        A delta whose range holds the replica's ``seq`` applies whole (:class:`Delta`).

        Returns:
            :class:`Applied`; :class:`Ignored` for a duplicate, a replay or an older
            incarnation; :class:`NeedSnapshot` for a gap (the delta is kept for later), or
            ``NeedSnapshot(None)`` when an insert names a parent the peer does not hold here
            (module docstring): the replica dropped the peer's entries.

        Raises:
            SubtreeSyncError: ``delta.version`` is not the tree's, or it has no eviction or
                insert, or ``seq_to <= seq_from`` (a value :meth:`Delta.decode` would refuse).
            HRTreeFullError: the peer's subtree went over the tree's limits; the replica dropped
                the peer's entries and needs a snapshot.
        """
        self._check_version(delta.version, "delta")
        if not (delta.evicts or delta.inserts) or delta.seq_to <= delta.seq_from:
            raise SubtreeSyncError("a delta covers at least one op and changes something")
        if self.incarnation is None or delta.incarnation > self.incarnation:
            self._reset(delta.incarnation, 0)  # a new run starts empty at seq 0
        elif delta.incarnation < self.incarnation:
            return Ignored(self.seq)
        if self.seq is not None and delta.seq_to <= self.seq:
            return Ignored(self.seq)
        if self.seq is None or delta.seq_from > self.seq:
            self._buffer(delta)
            return NeedSnapshot(self.seq)
        self._apply_ops(delta)
        self._drain()
        return NeedSnapshot(None) if self.seq is None else Applied(self.seq)

    def apply_snapshot(self, snapshot: Snapshot) -> SyncOutcome:
        """Replace the peer's subtree by ``snapshot`` unless the replica is as new already.

        Returns:
            :class:`Applied`, or :class:`Ignored` for an older incarnation or a ``seq`` the
            replica has reached; ``NeedSnapshot(None)`` if a buffered delta that followed did
            not apply (:meth:`apply_delta`).

        Raises:
            SubtreeSyncError: ``snapshot.version`` is not the tree's, or it is not canonical.
            HRTreeFullError: over the tree's limits; the peer's entries are dropped.
        """
        self._check_version(snapshot.version, "snapshot")
        if self.incarnation is not None:
            if snapshot.incarnation < self.incarnation:
                return Ignored(self.seq)
            if (snapshot.incarnation == self.incarnation and self.seq is not None
                    and snapshot.seq <= self.seq):
                return Ignored(self.seq)
        if snapshot.incarnation != self.incarnation:
            self._pending.clear()
        try:
            self.tree.replace_peer(self.peer, snapshot.leaves)
        except HRTreeFullError:
            self._reset(snapshot.incarnation, None)
            raise
        except LocalProtocolError as exc:
            raise SubtreeSyncError(f"snapshot: {exc}") from None
        self.incarnation = snapshot.incarnation
        self.seq = snapshot.seq
        self._drain()
        return NeedSnapshot(None) if self.seq is None else Applied(self.seq)

    def _apply_ops(self, delta: Delta) -> bool:
        """Apply the whole of ``delta`` (``seq_from <= seq < seq_to``); False (and the peer's
        entries dropped, ``seq`` None) if an insert's parent is missing."""
        tree, peer = self.tree, self.peer
        try:
            for name in delta.evicts:
                tree.evict_named(peer, name)
            for ins in delta.inserts:
                tree.insert_under(peer, ins.parent, ins.hashes)
        except HRTreeFullError:
            self._reset(self.incarnation, None)
            raise
        except SubtreeSyncError:
            self._reset(self.incarnation, None)
            return False
        self.seq = delta.seq_to
        return True

    def _buffer(self, delta: Delta) -> None:
        self._pending[delta.seq_from] = delta
        if len(self._pending) > MAX_PENDING_DELTAS:
            del self._pending[max(self._pending)]

    def _drain(self) -> None:
        while self._pending and self.seq is not None:
            ready = [s for s in self._pending if s <= self.seq]
            if not ready:
                return
            for s in ready:
                delta = self._pending.pop(s)
                if delta.seq_to > self.seq and not self._apply_ops(delta):
                    return
