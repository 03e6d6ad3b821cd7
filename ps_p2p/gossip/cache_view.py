"""A model node's own HR-subtree, kept from its engine's KV-cache events, pure.

Source: PlanetServe sec. 3.3 (each node's subtree of the HR-tree names the prefixes of its local
KV cache); the events are vLLM's (:mod:`ps_p2p.engines.kv_events`).

:class:`CacheView` mirrors the engine's block tree: block hash -> (parent, tokens). From it, a
prompt prefix is in the node's subtree exactly up to the chunks (:class:`ChunkLengths`) that
cached tokens fully cover. A chunk *completes* in the block holding its last token; the view
counts, for each chunk hash (which names one prefix, the hashes being chained), the cached blocks
it completes in, so:

- ``BlockStored`` that completes a chunk no cached block completed before gives one
  ``Op(INSERT, chain)`` for the deepest stored block (an insert brings every shorter prefix);
- ``BlockRemoved`` drops its blocks *and their descendants* from the view (a prefix match cannot
  reach past a missing block; an engine that recomputes them reports them stored again, as vLLM
  does), and gives one ``Op(EVICT, chain)`` for each shortest chunk chain no remaining block
  completes: evicting a prefix evicts what is under it, and the evictions of one event commute,
  so an LRU that removes a prompt's blocks leaf first (one event, many blocks) gives one op for
  the prompt, not one per chunk. They come sorted. A chunk that ends inside a block can complete
  in several sibling blocks (two prompts that share the system prompt but not the next block):
  it stays while any of them does;
- ``AllBlocksCleared`` gives ``Op(EVICT, ())``.

The ops go to the node's :class:`~ps_p2p.gossip.hr_tree.SubtreePublisher`. When the group adopts
a new L, :meth:`CacheView.rechunk` recomputes every chunk and returns the inserts that build the
subtree of the new version from scratch.

Bounded: at most ``max_blocks`` blocks (about 360 bytes each for 16-token blocks, chunk
bookkeeping included, measured with tracemalloc over 1k-token prompts); a ``BlockStored`` beyond,
or one whose parent the view does not hold (events missed), is dropped and counted in
``dropped_blocks``: the subtree then lacks those prefixes, which costs cache hits, never
correctness. Block tokens are kept as big-endian u32 bytes, the form chunk hashes cover.

This module is a pure core: no trio, libp2p, protobuf, clock or randomness.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ps_p2p.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from ps_p2p.errors import ConfigError, EngineError
from ps_p2p.gossip.hr_tree import MAX_DEPTH, Chain, ChunkHasher, Op, OpKind, pack_tokens
from ps_p2p.gossip.sentry import ChunkLengths

__all__ = ["DEFAULT_MAX_BLOCKS", "CacheView"]

DEFAULT_MAX_BLOCKS = 1 << 17
"""Blocks a view holds: 131,072 (2M tokens at 16 a block, beyond the KV cache of one 80 GB GPU
serving a 1B model, ~120k blocks), about 45 MiB at the measured ~360 bytes a block."""
_FEW_CHILDREN = 8


class _Block:
    __slots__ = ("children", "chunks", "end", "hashes", "last", "packed", "parent")

    def __init__(self, parent: int | None, packed: bytes, end: int) -> None:
        self.parent = parent
        self.packed = packed  # this block's tokens, big-endian u32
        self.end = end  # token position just after the block
        # Most blocks have 0 or 1 child: a tuple is 4x smaller than a set; a set past
        # _FEW_CHILDREN (the last block of a system prompt may have thousands).
        self.children: tuple[int, ...] | set[int] = ()
        self.chunks = 0  # complete chunks in the prefix up to `end`
        self.hashes: tuple[bytes, ...] = ()  # hashes of the chunks that complete in this block
        self.last: bytes | None = None  # last complete chunk's hash up to `end`


class CacheView:
    """The engine's cached blocks and the HR-subtree they cover (module docstring).

    Args:
        lengths: the group's L.
        key: the model group's key (:class:`~ps_p2p.gossip.hr_tree.ChunkHasher`).
        max_blocks: blocks held at most (>= 1).

    Raises:
        ConfigError: ``max_blocks`` < 1.
        LocalProtocolError: a bad key length.
    """

    def __init__(
        self, lengths: ChunkLengths, key: bytes, *, max_blocks: int = DEFAULT_MAX_BLOCKS
    ) -> None:
        if max_blocks < 1:
            raise ConfigError("max_blocks must be >= 1")
        self.lengths = lengths
        self.max_blocks = max_blocks
        self.dropped_blocks = 0
        self._hasher = ChunkHasher(key)
        self._blocks: dict[int, _Block] = {}
        self._roots: set[int] = set()
        self._anchors: dict[bytes, int] = {}  # chunk hash -> cached blocks it completes in

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    # ---- queries

    def prefix_tokens(self, block_hash: int) -> tuple[int, ...]:
        """The token prefix up to and including block ``block_hash``.

        Raises:
            KeyError: the view does not hold that block.
        """
        parts = []
        b: int | None = block_hash
        while b is not None:
            block = self._blocks[b]
            parts.append(block.packed)
            b = block.parent
        packed = b"".join(reversed(parts))
        return struct.unpack(f">{len(packed) // 4}I", packed)

    def chain(self, block_hash: int) -> Chain:
        """The chunk hashes of the chunks cached tokens cover up to block ``block_hash``
        (equal to ``chunk_hashes(prefix_tokens(block_hash), lengths, key)``).

        Raises:
            KeyError: the view does not hold that block.
        """
        parts = []
        b: int | None = block_hash
        while b is not None:
            block = self._blocks[b]
            if block.hashes:
                parts.append(block.hashes)
            b = block.parent
        return tuple(h for hashes in reversed(parts) for h in hashes)

    # ---- events

    def apply(self, event: KVCacheEvent) -> list[Op]:
        """Update the view; returns the subtree operations (module docstring), in order.

        Raises:
            EngineError: a ``BlockStored`` whose tokens do not fill its blocks (all but the
                last full, ``block_size`` >= 1).
        """
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            gone: list[Chain] = []
            for h in event.block_hashes:
                if h in self._blocks:
                    self._remove(h, gone)
            shortest: list[Chain] = []
            for chain in sorted(gone):  # a prefix sorts before what extends it
                if not shortest or chain[:len(shortest[-1])] != shortest[-1]:
                    shortest.append(chain)
            return [Op(OpKind.EVICT, chain) for chain in shortest]
        if isinstance(event, AllBlocksCleared):
            had = bool(self._anchors)
            self._blocks.clear()
            self._roots.clear()
            self._anchors.clear()
            return [Op(OpKind.EVICT, ())] if had else []
        raise TypeError(f"not a KV-cache event: {event!r}")

    def _stored(self, event: BlockStored) -> list[Op]:
        n, size, tokens = len(event.block_hashes), event.block_size, event.token_ids
        if n == 0:
            return []
        if size < 1 or not (n - 1) * size < len(tokens) <= n * size:
            raise EngineError(
                f"BlockStored of {n} blocks of {size} tokens carries {len(tokens)} tokens"
            )
        parent = event.parent_block_hash
        if parent is not None and parent not in self._blocks:
            self.dropped_blocks += n  # its prefix is unknown: events were missed
            return []
        grew = False
        for i, h in enumerate(event.block_hashes):
            known = self._blocks.get(h)
            if known is not None:
                if known.parent != parent:  # one hash, two prefixes: keep the first
                    self.dropped_blocks += n - i
                    break
                parent = h
                continue
            if len(self._blocks) >= self.max_blocks:
                self.dropped_blocks += n - i
                break
            block = self._add(h, parent, pack_tokens(tokens[i * size:(i + 1) * size]))
            for c in block.hashes:
                count = self._anchors.get(c, 0)
                self._anchors[c] = count + 1
                grew = grew or count == 0
            parent = h
        if grew and parent is not None:
            return [Op(OpKind.INSERT, self.chain(parent))]
        return []

    def _add(self, h: int, parent: int | None, packed: bytes) -> _Block:
        up = self._blocks[parent] if parent is not None else None
        block = _Block(parent, packed, (up.end if up else 0) + len(packed) // 4)
        self._chunk(block, up)
        self._blocks[h] = block
        if up is None:
            self._roots.add(h)
        elif isinstance(up.children, set):
            up.children.add(h)
        elif len(up.children) < _FEW_CHILDREN:
            up.children += (h,)
        else:
            up.children = {*up.children, h}
        return block

    def _chunk(self, block: _Block, up: _Block | None) -> None:
        """The chunks that complete in ``block`` (its parent's chunking done)."""
        lengths = self.lengths
        chunks = up.chunks if up else 0
        last = up.last if up else None
        block.chunks, block.last, block.hashes = chunks, last, ()
        if chunks >= MAX_DEPTH or lengths.end(chunks) > block.end:
            return
        # Tokens from the start of the first incomplete chunk to the block's end.
        start = lengths.end(chunks - 1) if chunks else 0
        parts = [block.packed]
        offset = block.end - len(block.packed) // 4
        q = up
        while offset > start:
            assert q is not None  # a root block starts at 0
            parts.append(q.packed)
            offset -= len(q.packed) // 4
            q = self._blocks[q.parent] if q.parent is not None else None
        buf = b"".join(reversed(parts))
        hashes = []
        while chunks < MAX_DEPTH and lengths.end(chunks) <= block.end:
            a = (lengths.end(chunks - 1) if chunks else 0) - offset
            b = lengths.end(chunks) - offset
            last = self._hasher.hash_packed(last, buf[4 * a:4 * b])
            hashes.append(last)
            chunks += 1
        block.chunks, block.last, block.hashes = chunks, last, tuple(hashes)

    def _remove(self, h: int, gone: list[Chain]) -> None:
        """Drop block ``h`` and its descendants; add to ``gone`` the shortest chains of the
        chunks no block completes now."""
        order = [h]  # pre-order: a block before its descendants
        i = 0
        while i < len(order):
            children = self._blocks[order[i]].children
            if children:
                order.extend(children)
            i += 1
        for b in order:
            block = self._blocks[b]
            prev = self._blocks[block.parent].last if block.parent is not None else None
            for k, c in enumerate(block.hashes):
                left = self._anchors[c] - 1
                if left:
                    self._anchors[c] = left
                else:
                    del self._anchors[c]
                    # Gone. Evict it unless its parent chunk is gone too (already evicted,
                    # and with it everything under it).
                    if prev is None or prev in self._anchors:
                        chain = self.chain(block.parent) if block.parent is not None else ()
                        gone.append(chain + block.hashes[:k + 1])
                prev = c
        top = self._blocks[h]
        if top.parent is None:
            self._roots.discard(h)
        else:
            up = self._blocks[top.parent]
            if isinstance(up.children, set):
                up.children.discard(h)
            else:
                up.children = tuple(c for c in up.children if c != h)
        for b in order:
            del self._blocks[b]

    # ---- a new L

    def rechunk(self, lengths: ChunkLengths) -> list[Op]:
        """Cut every cached prefix by ``lengths`` (a new L version).

        Returns:
            Inserts that build the node's subtree for ``lengths`` from an empty one: one per
            cached leaf block that covers at least one chunk.
        """
        self.lengths = lengths
        self._anchors.clear()
        ops = []
        frontier: Sequence[int] = sorted(self._roots)
        while frontier:
            nxt: list[int] = []
            for b in frontier:
                block = self._blocks[b]
                self._chunk(block, self._blocks[block.parent] if block.parent is not None
                            else None)
                for c in block.hashes:
                    self._anchors[c] = self._anchors.get(c, 0) + 1
                if block.children:
                    nxt.extend(sorted(block.children))
                elif block.chunks:
                    ops.append(Op(OpKind.INSERT, self.chain(b)))
            frontier = nxt
        return ops
