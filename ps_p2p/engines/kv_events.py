"""KV-cache events of an engine: which prompt-prefix blocks it holds, pure.

An engine with a prefix cache reports each change of its cache as events, in the shape of vLLM's
KV-cache events (``vllm/distributed/kv_events.py``, vLLM >= 0.24: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). A model node turns them into its own subtree of the
HR-tree (PlanetServe sec. 3.3), which it gossips to the other model nodes of its group.

Block hashes are opaque unsigned 64-bit integers chosen by the engine (vLLM's may exceed
int64); a block's hash names the whole prefix up to and including the block (chained hashes), so
one hash identifies one token prefix within one engine. ``token_ids`` are the tokens of the
stored blocks only, ``block_size`` tokens per block (the last block of a batch may be shorter in
engines that cache partial blocks; vLLM does not).

Producers: :class:`~ps_p2p.engines.transformers_engine.TransformersEngine`'s prefix cache, the
cost-model engine, and the vLLM engine's subscriber to the server's ZMQ publisher.
"""

from __future__ import annotations

from dataclasses import dataclass

#: block hashes are unsigned 64-bit integers
MAX_BLOCK_HASH = 2**64 - 1


@dataclass(frozen=True)
class BlockStored:
    """Blocks added to the cache, in prefix order.

    Attributes:
        block_hashes: one hash per stored block, the first one's parent is ``parent_block_hash``.
        parent_block_hash: hash of the block that precedes the first stored one, None when the
            first stored block starts the prompt.
        token_ids: the tokens of the stored blocks, concatenated.
        block_size: tokens per block.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the cache (a removed block's descendants are removed too, by their
    own events)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (a restart, a reset of the prefix cache)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
