"""Block-level prefix-cache index of an engine: which prompt prefixes it holds KV caches for (pure).

An engine's prefix cache keeps the KV cache of prompts it has seen, cut into blocks of
``block_size`` tokens (16 by default, vLLM's default), so a later prompt that starts with the
same tokens reuses them and prefills only the rest (PlanetServe sec. 3.3: overlay forwarding
sends a request to the model node that holds its prefix; vLLM's automatic prefix caching is the
same scheme inside one engine). This module is the index only: it maps blocks to an opaque
payload per block (the transformers engine stores the layers' key/value tensors of the block's
positions; the cost-model engine stores nothing) and reports every change as the KV-cache events
of :mod:`ps_p2p.engines.kv_events`, for the model node's HR-tree.

Blocks and hashes. Only full blocks are cached (the last ``len(token_ids) % block_size`` tokens
of a prompt never are). Block ``i`` of a prompt is named by a chained hash, so one hash names
the whole prefix ``token_ids[: (i + 1) * block_size]``::

    block_hash(parent, tokens) = uint64 of the first 8 bytes (big-endian) of
        BLAKE2b(digest_size=8, person=b"ps-kv-block-v1")(
            b"\\x00"                                  if parent is None (the prompt's first block)
            b"\\x01" + parent.to_bytes(8, "big")      otherwise
            + tokens, each as an unsigned 64-bit little-endian integer)

The tag byte keeps a root block apart from every child; hashes are at most :data:`MAX_BLOCK_HASH`
(:mod:`~ps_p2p.engines.kv_events`). Every cached block also keeps its parent hash and its tokens,
and a lookup or store compares them: a 64-bit collision (about 2**-64 per pair of blocks) is
taken as a miss, never as a wrong cache.

Eviction. The index holds at most ``capacity`` blocks (0 disables it: nothing is stored, no
events). It evicts the least recently used block first. A block without its parent is useless (its
KV cache was computed after the parent's tokens and cannot be reached by a lookup), so removing a
block removes all its descendants too (:meth:`PrefixCacheIndex.evict`), and every block present
has its parent present. Lookups and stores touch a matched prefix from its last block to its
first, so a parent is always more recently used than its children and the LRU victim is always a
leaf: eviction trims prompts from their ends, and a shared prefix (a system prompt) goes last.

Events. Each change appends events to a buffer that the consumer empties with
:meth:`PrefixCacheIndex.drain_events`; applying the drained events in order to a replica (store
``BlockStored`` blocks with their parents and tokens, delete ``BlockRemoved`` hashes, empty it on
``AllBlocksCleared``) gives exactly the index's blocks. The buffer is bounded by
``max_pending_events`` block entries (every hash in an event counts one, ``AllBlocksCleared`` one),
because a node whose consumer stalls or never drains must not grow without limit. When a change
would pass the bound, the buffer is dropped and the index goes into resync: it stops buffering, and
the next drain returns ``AllBlocksCleared`` followed by ``BlockStored`` events of its whole current
contents (parents first), so a consumer never keeps a view that the index has left behind. That
snapshot has at most ``capacity`` blocks. A :meth:`~PrefixCacheIndex.clear` likewise drops the
buffer: only ``AllBlocksCleared`` and what follows it matter.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ps_p2p.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from ps_p2p.errors import ConfigError, EngineParameterError

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_PENDING_EVENTS",
    "MAX_TOKEN_ID",
    "PrefixCacheIndex",
    "PrefixMatch",
    "block_hash",
]

P = TypeVar("P")

#: tokens per block (vLLM's default ``--block-size`` on GPUs)
DEFAULT_BLOCK_SIZE = 16
#: pending block entries before the event buffer gives up and the index resyncs (module docstring)
DEFAULT_MAX_PENDING_EVENTS = 4096
#: token IDs are hashed as unsigned 64-bit integers
MAX_TOKEN_ID = 2**64 - 1
#: most tokens per block: a block is hashed and compared whole
MAX_BLOCK_SIZE = 4096

_PERSON = b"ps-kv-block-v1"


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of one block (layout in the module docstring).

    Args:
        parent: hash of the block before it, None for a prompt's first block.
        tokens: the block's token IDs, each in [0, MAX_TOKEN_ID].

    Returns:
        an unsigned 64-bit integer.

    Raises:
        EngineParameterError: a token ID that is not an int in [0, MAX_TOKEN_ID].
    """
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "big"))
    try:
        h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
    except struct.error as exc:
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t <= MAX_TOKEN_ID]
        raise EngineParameterError(
            f"token IDs must be ints in [0, 2**64), not {bad[:5]}"
        ) from exc
    return int.from_bytes(h.digest(), "big")


@dataclass(frozen=True)
class PrefixMatch(Generic[P]):
    """The longest cached block prefix of a prompt.

    Attributes:
        block_hashes: hashes of the matched blocks, in prompt order.
        payloads: their payloads, in the same order.
        block_size: tokens per block.
    """

    block_hashes: tuple[int, ...]
    payloads: tuple[P, ...]
    block_size: int

    @property
    def blocks(self) -> int:
        """Matched blocks."""
        return len(self.block_hashes)

    @property
    def tokens(self) -> int:
        """Matched tokens: ``blocks * block_size``."""
        return len(self.block_hashes) * self.block_size


@dataclass
class _Block(Generic[P]):
    parent: int | None
    tokens: tuple[int, ...]
    payload: P
    children: set[int] = field(default_factory=set)


class PrefixCacheIndex(Generic[P]):
    """Cached prompt-prefix blocks with LRU eviction and KV-cache events. See the module docstring.

    Not thread-safe: an engine that uses it from several threads holds one lock around every call.

    Args:
        capacity: most blocks held, >= 0 (0: disabled).
        block_size: tokens per block, in [1, MAX_BLOCK_SIZE].
        max_pending_events: block entries buffered for :meth:`drain_events` before the index
            resyncs instead, >= 1.

    Attributes:
        capacity, block_size: as given.
        queried_blocks: full blocks of every looked-up prompt (at most ``max_blocks`` each).
        hit_blocks: blocks found by lookups (``hit_blocks / queried_blocks``: the hit rate).

    Raises:
        ConfigError: an argument out of its range.
    """

    def __init__(
        self,
        capacity: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"prefix cache capacity must be an int >= 0 blocks, not {capacity!r}")
        if (isinstance(block_size, bool) or not isinstance(block_size, int)
                or not 1 <= block_size <= MAX_BLOCK_SIZE):
            raise ConfigError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], not {block_size!r}")
        if max_pending_events < 1:
            raise ConfigError(f"max_pending_events must be >= 1, not {max_pending_events}")
        self.capacity = capacity
        self.block_size = block_size
        self.max_pending_events = max_pending_events
        self.queried_blocks = 0
        self.hit_blocks = 0
        # least recently used first; a parent is always after (more recent than) its children
        self._blocks: OrderedDict[int, _Block[P]] = OrderedDict()
        self._events: list[KVCacheEvent] = []
        self._pending = 0  # block entries in _events
        self._resync = False

    # -- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def full_blocks(self, n_tokens: int) -> int:
        """Full blocks in a prompt of ``n_tokens`` tokens."""
        return n_tokens // self.block_size

    def blocks(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """Every cached block as ``(block_hash, parent_block_hash, token_ids)``, each parent
        before its children (depth first)."""
        out: list[tuple[int, int | None, tuple[int, ...]]] = []
        stack = [h for h, b in self._blocks.items() if b.parent is None]
        while stack:
            h = stack.pop()
            b = self._blocks[h]
            out.append((h, b.parent, b.tokens))
            stack.extend(sorted(b.children, reverse=True))
        return out

    # -- lookup and store --------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], *, max_blocks: int | None = None) -> PrefixMatch[P]:
        """The longest cached prefix of ``token_ids`` in whole blocks; marks it recently used.

        Work is bounded by ``capacity`` + 1 block hashes whatever the prompt's length.

        Args:
            token_ids: the prompt.
            max_blocks: match at most this many blocks (an engine that must compute the logits
                of the last prompt token passes ``(len(token_ids) - 1) // block_size``).

        Raises:
            EngineParameterError: a token ID in a hashed block is not an int in [0, 2**64).
        """
        n = self.full_blocks(len(token_ids))
        if max_blocks is not None:
            n = min(n, max(0, max_blocks))
        if self.capacity == 0:
            return PrefixMatch((), (), self.block_size)
        self.queried_blocks += n
        hashes: list[int] = []
        payloads: list[P] = []
        parent: int | None = None
        for i in range(min(n, self.capacity)):
            block = self._find(parent, token_ids, i)
            if block is None:
                break
            parent = block[0]
            hashes.append(block[0])
            payloads.append(block[1].payload)
        self._touch(hashes)
        self.hit_blocks += len(hashes)
        return PrefixMatch(tuple(hashes), tuple(payloads), self.block_size)

    def store(
        self, token_ids: Sequence[int], payloads: Sequence[P] | Callable[[int], P]
    ) -> int:
        """Cache the full blocks of ``token_ids``; returns how many blocks were new.

        Blocks already cached keep their payload and are marked recently used. Only the first
        ``capacity`` blocks of a longer prompt are stored. Least recently used blocks (never one
        of this prompt's) are evicted to make room. Emits ``BlockRemoved`` for the evicted
        blocks, then one ``BlockStored`` for the new ones.

        Args:
            token_ids: the prompt.
            payloads: one payload per full block of ``token_ids`` (a sequence), or a function
                of the block's index that gives it (called only for blocks not cached yet).

        Raises:
            EngineParameterError: a sequence of payloads whose length is not the number of full
                blocks, or a token ID that is not an int in [0, 2**64).
        """
        total = self.full_blocks(len(token_ids))
        if not callable(payloads) and len(payloads) != total:
            raise EngineParameterError(
                f"{len(payloads)} payloads for {total} full blocks of {self.block_size} tokens"
            )
        n = min(total, self.capacity)
        if n == 0:
            return 0
        existing: list[int] = []
        parent: int | None = None
        for i in range(n):
            block = self._find(parent, token_ids, i)
            if block is None:
                break
            parent = block[0]
            existing.append(block[0])
        # the hashes of the new blocks; a collision with a different cached block ends the chain
        new: list[int] = []
        for i in range(len(existing), n):
            h = block_hash(parent, self._tokens(token_ids, i))
            if h in self._blocks:
                break  # a cached block with this hash and other tokens or parent (2**-64)
            new.append(h)
            parent = h
        self._touch(existing)
        removed: list[int] = []
        while len(self._blocks) + len(new) > self.capacity:
            victim = next(iter(self._blocks))  # a leaf (module docstring); never in `existing`
            removed.extend(self._remove(victim))
        if removed:
            self._emit(BlockRemoved(tuple(removed)), len(removed))
        if not new:
            return 0
        parent = existing[-1] if existing else None
        first = len(existing)
        stored_tokens: list[int] = []
        for offset, h in enumerate(new):
            i = first + offset
            tokens = self._tokens(token_ids, i)
            payload = payloads(i) if callable(payloads) else payloads[i]
            self._blocks[h] = _Block(parent, tokens, payload)
            if parent is not None:
                self._blocks[parent].children.add(h)
            stored_tokens.extend(tokens)
            parent = h
        self._touch(existing + new)
        self._emit(
            BlockStored(
                block_hashes=tuple(new),
                parent_block_hash=existing[-1] if existing else None,
                token_ids=tuple(stored_tokens),
                block_size=self.block_size,
            ),
            len(new),
        )
        return len(new)

    def evict(self, block_hash: int) -> list[int]:
        """Remove one block and all its descendants; returns their hashes ([] if not cached).

        Emits one ``BlockRemoved`` with every removed hash.
        """
        if block_hash not in self._blocks:
            return []
        removed = self._remove(block_hash)
        self._emit(BlockRemoved(tuple(removed)), len(removed))
        return removed

    def clear(self) -> None:
        """Remove every block; the pending events become a single ``AllBlocksCleared``."""
        self._blocks.clear()
        if self.capacity == 0:
            return
        self._events = [AllBlocksCleared()]
        self._pending = 1
        self._resync = False

    def drain_events(self) -> list[KVCacheEvent]:
        """The events since the last drain, oldest first (module docstring: after an overflow,
        ``AllBlocksCleared`` and the whole contents instead)."""
        if self._resync:
            self._resync = False
            return [AllBlocksCleared(), *self._snapshot_events()]
        events, self._events, self._pending = self._events, [], 0
        return events

    # -- internals ---------------------------------------------------------------------------

    def _tokens(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _find(
        self, parent: int | None, token_ids: Sequence[int], i: int
    ) -> tuple[int, _Block[P]] | None:
        """Block ``i`` of ``token_ids`` (after ``parent``) when cached with these very tokens."""
        tokens = self._tokens(token_ids, i)
        h = block_hash(parent, tokens)
        block = self._blocks.get(h)
        if block is None or block.parent != parent or block.tokens != tokens:
            return None
        return h, block

    def _touch(self, chain: list[int]) -> None:
        """Mark a chain (first block first) recently used, its first block most recently."""
        for h in reversed(chain):
            self._blocks.move_to_end(h)

    def _remove(self, root: int) -> list[int]:
        """Drop ``root`` and its descendants; returns their hashes (root first)."""
        parent = self._blocks[root].parent
        if parent is not None:
            self._blocks[parent].children.discard(root)
        removed: list[int] = []
        stack = [root]
        while stack:
            h = stack.pop()
            removed.append(h)
            stack.extend(self._blocks.pop(h).children)
        return removed

    def _emit(self, event: KVCacheEvent, entries: int) -> None:
        if self._resync:
            return  # the next drain sends the whole contents
        if self._pending + entries > self.max_pending_events:
            self._events, self._pending, self._resync = [], 0, True
            return
        self._events.append(event)
        self._pending += entries

    def _snapshot_events(self) -> list[KVCacheEvent]:
        """``BlockStored`` events of the whole contents, parents first, runs of one chain merged."""
        events: list[KVCacheEvent] = []
        run: list[tuple[int, int | None, tuple[int, ...]]] = []

        def flush() -> None:
            if run:
                events.append(BlockStored(
                    block_hashes=tuple(h for h, _, _ in run),
                    parent_block_hash=run[0][1],
                    token_ids=tuple(t for _, _, tokens in run for t in tokens),
                    block_size=self.block_size,
                ))
                run.clear()

        for h, parent, tokens in self.blocks():
            if run and parent != run[-1][0]:
                flush()
            run.append((h, parent, tokens))
        flush()
        return events
