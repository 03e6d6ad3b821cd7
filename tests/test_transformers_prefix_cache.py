"""The transformers engine's prefix cache on the real stories260K model: reusing cached blocks
gives the same logits and greedy tokens as a cold prefill, and the cache reports its blocks."""

from __future__ import annotations

import pathlib

import pytest
import trio

from ps_p2p.engines.base import SamplingParams
from ps_p2p.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

pytest.importorskip("transformers")

from ps_p2p.engines.transformers_engine import TransformersEngine, _Generation

SHARED = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
          "the park with her friends. One day, she saw a big red ball under a tree.")
SUFFIXES = (" She ran to get it.", " Her mom said no.", " It was very shiny and new.")
GREEDY = SamplingParams(max_tokens=32)

_models: dict[pathlib.Path, TransformersEngine] = {}


@pytest.fixture
def loaded(shared: pathlib.Path) -> TransformersEngine:
    """stories260K, loaded once for this module (its model and tokenizer are shared)."""
    path = shared / "models" / "stories260K"
    if path not in _models:
        _models[path] = TransformersEngine.load(path, prefix_cache_blocks=0)
    return _models[path]


def _engine(loaded: TransformersEngine, blocks: int, block_size: int = 16) -> TransformersEngine:
    """A fresh engine (its own cache) on the loaded model."""
    return TransformersEngine(
        loaded.model, loaded.tokenizer, model_id="stories260K", max_context=loaded.max_context,
        prefix_cache_blocks=blocks, block_size=block_size,
    )


def _ids(engine: TransformersEngine, text: str) -> list[int]:
    return engine._prompt_ids(text)


def _first_step(engine: TransformersEngine, ids: list[int]) -> _Generation:
    generation = _Generation(engine, ids, GREEDY)
    generation.step()
    return generation


def test_a_warm_prefill_gives_the_logits_of_a_cold_one(loaded):
    warm, cold = _engine(loaded, 64), _engine(loaded, 0)
    _first_step(warm, _ids(warm, SHARED))
    for suffix in SUFFIXES:
        ids = _ids(warm, SHARED + suffix)
        cached_before = warm.prompt_tokens_cached
        w, c = _first_step(warm, ids), _first_step(cold, ids)
        assert warm.prompt_tokens_cached - cached_before >= 32  # the cache was used
        assert w.last_logits is not None and c.last_logits is not None
        assert w.last_logits.allclose(c.last_logits, atol=1e-4, rtol=1e-4)
    assert cold.prompt_tokens_cached == 0


def test_a_prompt_whose_every_block_is_cached_recomputes_only_its_last_token(loaded):
    engine = _engine(loaded, 64, block_size=4)
    ids = _ids(engine, SHARED)[:32]  # 8 whole blocks of 4
    _first_step(engine, ids)
    prefilled = engine.prompt_tokens_prefilled
    again = _first_step(engine, ids)
    assert engine.prompt_tokens_prefilled - prefilled == 4  # the last block: (32 - 1) // 4 = 7 cached
    assert again.last_logits.allclose(_first_step(_engine(loaded, 0), ids).last_logits, atol=1e-4)


async def test_warm_greedy_completions_equal_cold_ones(loaded):
    warm, cold = _engine(loaded, 64), _engine(loaded, 0)
    await warm.complete(SHARED, GREEDY)
    for suffix in SUFFIXES:
        got = await warm.complete(SHARED + suffix, GREEDY)
        want = await cold.complete(SHARED + suffix, GREEDY)
        assert got == want
    assert warm.prompt_tokens_cached >= 3 * 32


async def test_interleaved_streams_sharing_a_prefix_give_the_cold_text(loaded):
    warm, cold = _engine(loaded, 64, block_size=8), _engine(loaded, 0)
    await warm.complete(SHARED, SamplingParams(max_tokens=1))
    texts: dict[str, str] = {}

    async def one(suffix: str) -> None:
        texts[suffix] = "".join([c.text async for c in warm.stream(SHARED + suffix, GREEDY)])

    async with trio.open_nursery() as nursery:
        for suffix in SUFFIXES:
            nursery.start_soon(one, suffix)
    for suffix in SUFFIXES:
        assert texts[suffix] == (await cold.complete(SHARED + suffix, GREEDY)).text


async def test_the_cache_reports_its_blocks_as_kv_events(loaded):
    engine = _engine(loaded, 64)
    assert engine.kv_block_size == 16
    first = _ids(engine, SHARED)
    await engine.complete(SHARED, SamplingParams(max_tokens=1))
    [stored] = engine.drain_kv_events()
    n = len(first) // 16
    assert stored == BlockStored(stored.block_hashes, None, tuple(first[: 16 * n]), 16)
    assert len(stored.block_hashes) == n
    longer = SHARED + SUFFIXES[2] * 4
    await engine.complete(longer, SamplingParams(max_tokens=1))
    [more] = engine.drain_kv_events()
    assert more.parent_block_hash == stored.block_hashes[-1]
    assert more.token_ids == tuple(_ids(engine, longer)[16 * n : 16 * (n + len(more.block_hashes))])
    engine.reset_prefix_cache()
    assert engine.drain_kv_events() == [AllBlocksCleared()]


async def test_a_full_cache_evicts_and_reports_the_removed_blocks(loaded):
    engine = _engine(loaded, 2, block_size=8)
    await engine.complete(SHARED, SamplingParams(max_tokens=1))
    await engine.complete("The dog barked at the cat and the cat ran up a tree.",
                          SamplingParams(max_tokens=1))
    events = engine.drain_kv_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert set(events[1].block_hashes) == set(events[0].block_hashes)


async def test_without_prefix_cache_blocks_there_are_no_events(loaded):
    engine = _engine(loaded, 0)
    await engine.complete(SHARED, SamplingParams(max_tokens=1))
    await engine.complete(SHARED, SamplingParams(max_tokens=1))
    assert engine.kv_block_size is None
    assert engine.drain_kv_events() == []
    assert engine.prompt_tokens_cached == 0
