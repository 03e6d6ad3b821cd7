"""The simulated engine: its cost model and tokenizer (pure), and the engine under trio's autojump
clock (virtual time: durations are exact, nothing sleeps for real)."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from ps_p2p.config import load_config
from ps_p2p.engines import load_engine, sim_cost
from ps_p2p.engines.base import SamplingParams
from ps_p2p.engines.kv_events import AllBlocksCleared, BlockStored
from ps_p2p.engines.sim_engine import SimCostModel, SimEngine, SimParams
from ps_p2p.errors import ConfigError, EngineError, EngineParameterError, PromptTooLongError

# round numbers so expected durations are easy to read
PARAMS = SimParams(prefill_tokens_per_s=1000.0, step_time=0.02, batch_growth=0.5, max_batch=4,
                   max_context=4096, block_size=16, cache_blocks=64)
COST = SimCostModel(PARAMS)


# -- cost model -------------------------------------------------------------------------------


@pytest.mark.parametrize("uncached, seconds", [(0, 0.0), (1, 0.001), (1000, 1.0), (2500, 2.5)])
def test_prefill_takes_uncached_tokens_over_the_prefill_rate(uncached, seconds):
    assert COST.prefill_seconds(uncached) == pytest.approx(seconds)


@pytest.mark.parametrize("batch, seconds", [(1, 0.02), (2, 0.03), (3, 0.04), (5, 0.06)])
def test_a_decode_step_grows_with_the_batch(batch, seconds):
    assert COST.step_seconds(batch) == pytest.approx(seconds)


def test_a_request_is_its_prefill_plus_its_decode_steps():
    timing = COST.request(cached_tokens=512, uncached_tokens=100, output_tokens=10, batch=2)
    assert timing.prefill == pytest.approx(0.1)
    assert timing.decode == pytest.approx(10 * 0.03)
    assert timing.total == pytest.approx(0.4)


@pytest.mark.parametrize("bad", [{"uncached_tokens": -1}, {"batch": 0}])
def test_the_cost_model_refuses_negative_counts(bad):
    with pytest.raises(ValueError):
        COST.request(**{"cached_tokens": 0, "uncached_tokens": 1, "output_tokens": 1, **bad})


@pytest.mark.parametrize(
    "bad",
    [{"prefill_tokens_per_s": 0}, {"step_time": math.inf}, {"batch_growth": -0.1},
     {"max_batch": 0}, {"max_context": 1}, {"block_size": 0}, {"cache_blocks": -1},
     {"max_batch": 2.0}, {"step_time": True}],
)
def test_params_out_of_range_raise_value_errors(bad):
    with pytest.raises(ValueError):
        SimParams(**bad)


# -- tokenizer and dummy text -----------------------------------------------------------------


@given(text=st.text())
def test_any_text_round_trips_through_the_tokenizer(text):
    ids = sim_cost.encode(text)
    assert ids[0] == sim_cost.BOS_ID
    assert len(ids) == 1 + math.ceil(len(text.encode("utf-8", "replace"))
                                     / sim_cost.BYTES_PER_TOKEN)
    assert sim_cost.decode(ids) == text.encode("utf-8", "replace").decode("utf-8")


def test_texts_sharing_whole_token_bytes_share_their_first_tokens():
    a = sim_cost.encode("You are a helpful assistant.. Question one")
    b = sim_cost.encode("You are a helpful assistant.. Another question")
    shared = len("You are a helpful assistant.. ") // sim_cost.BYTES_PER_TOKEN
    assert a[: 1 + shared] == b[: 1 + shared]
    assert a[1 + shared] != b[1 + shared]


@pytest.mark.parametrize("bad", [-1, 2**25, 600, 1.0])
def test_ids_outside_the_vocabulary_do_not_decode(bad):
    with pytest.raises(EngineError):
        sim_cost.decode([1, bad])


def test_dummy_text_is_one_token_a_piece_and_depends_on_prompt_and_seed():
    pieces = sim_cost.dummy_text([1, 300], 40)
    assert len(pieces) == 40
    assert len(sim_cost.encode("".join(pieces), add_special_tokens=False)) == 40
    assert sim_cost.dummy_text([1, 300], 40) == pieces
    others = {tuple(sim_cost.dummy_text([1, p], 3)) for p in range(300, 340)}
    assert len(others) > 1
    assert sim_cost.dummy_text([1, 300], 40, seed=1) != pieces or \
        sim_cost.dummy_text([1, 300], 40, seed=2) != pieces


# -- engine, in virtual time --------------------------------------------------------------------


def _prompt(n_tokens: int, start: str = "") -> str:
    """Text that encodes to exactly ``n_tokens`` tokens with BOS (3 bytes a token)."""
    text = (start + "abc" * n_tokens)[: 3 * (n_tokens - 1)]
    assert len(sim_cost.encode(text)) == n_tokens
    return text


async def _timed(engine: SimEngine, prompt: str, max_tokens: int):
    start = trio.current_time()
    completion = await engine.complete(prompt, SamplingParams(max_tokens=max_tokens))
    return completion, trio.current_time() - start


async def test_a_cold_request_takes_its_whole_prefill_and_its_steps(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    completion, took = await _timed(engine, _prompt(500), 10)
    assert took == pytest.approx(COST.prefill_seconds(500) + 10 * COST.step_seconds(1))
    assert (completion.prompt_tokens, completion.completion_tokens) == (500, 10)
    assert completion.finish_reason == "length"
    assert len(await engine.encode(completion.text, add_special_tokens=False)) == 10
    assert (engine.prompt_tokens_prefilled, engine.prompt_tokens_cached) == (500, 0)


async def test_a_cached_prefix_shortens_the_prefill(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    shared = _prompt(481)  # 30 blocks of 16 tokens + 1
    await engine.complete(shared, SamplingParams(max_tokens=1))
    _, took = await _timed(engine, shared + "and then a different question", 10)
    prompt_tokens = len(sim_cost.encode(shared + "and then a different question"))
    uncached = prompt_tokens - 480
    assert engine.prompt_tokens_cached == 480
    assert took == pytest.approx(COST.prefill_seconds(uncached) + 10 * COST.step_seconds(1))


async def test_a_fully_cached_prompt_still_computes_its_last_token(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    prompt = _prompt(32)  # two whole blocks
    await engine.complete(prompt, SamplingParams(max_tokens=1))
    _, took = await _timed(engine, prompt, 1)
    assert took == pytest.approx(COST.prefill_seconds(16) + COST.step_seconds(1))


async def test_concurrent_requests_decode_at_the_batch_step_time(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    took: list[float] = []

    async def one(text: str) -> None:
        took.append((await _timed(engine, text, 20))[1])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, _prompt(100, "x"))
        nursery.start_soon(one, _prompt(100, "y"))
    expected = COST.prefill_seconds(100) + 20 * COST.step_seconds(2)
    assert took == pytest.approx([expected, expected])


async def test_requests_beyond_max_batch_wait_for_a_slot(autojump_clock):
    engine = SimEngine("sim", SimParams(max_batch=1, prefill_tokens_per_s=1000.0,
                                        step_time=0.02, cache_blocks=0))
    took: list[float] = []

    async def one(text: str) -> None:
        took.append((await _timed(engine, text, 5))[1])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, _prompt(100, "x"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, _prompt(100, "y"))
        await trio.testing.wait_all_tasks_blocked()
        assert (engine.running, engine.waiting) == (1, 1)
    single = 0.1 + 5 * 0.02
    assert took == pytest.approx([single, 2 * single])


async def test_a_cancelled_request_frees_its_slot(autojump_clock):
    engine = SimEngine("sim", SimParams(max_batch=1))
    with trio.move_on_after(0.01):
        await engine.complete(_prompt(100), SamplingParams(max_tokens=100))
    assert (engine.running, engine.waiting) == (0, 0)
    completion = await engine.complete(_prompt(10), SamplingParams(max_tokens=2))
    assert completion.completion_tokens == 2


async def test_streamed_pieces_join_to_the_completion_and_end_with_counts(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    params = SamplingParams(max_tokens=7)
    chunks = [c async for c in engine.stream("Once upon a time", params)]
    assert [c.finish_reason for c in chunks] == [None] * 6 + ["length"]
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (7, 7)  # BOS + 16/3
    other = SimEngine("sim", PARAMS)
    assert "".join(c.text for c in chunks) == (await other.complete("Once upon a time", params)).text


async def test_the_prefix_cache_reports_stored_blocks(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    assert engine.kv_block_size == 16
    ids = sim_cost.encode(_prompt(40))
    await engine.complete(_prompt(40), SamplingParams(max_tokens=1))
    [stored] = engine.drain_kv_events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == tuple(ids[:32]) and len(stored.block_hashes) == 2
    await engine.aclose()
    assert engine.drain_kv_events() == [AllBlocksCleared()]


async def test_without_cache_blocks_there_is_no_cache_and_no_events(autojump_clock):
    engine = SimEngine("sim", SimParams(cache_blocks=0))
    await engine.complete(_prompt(40), SamplingParams(max_tokens=1))
    await engine.complete(_prompt(40), SamplingParams(max_tokens=1))
    assert engine.kv_block_size is None
    assert engine.drain_kv_events() == []
    assert engine.prompt_tokens_cached == 0


async def test_token_id_prompts_are_served_as_text_prompts(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    ids = sim_cost.encode("Once upon a time")
    chunks = [c async for c in engine.stream_ids(ids, SamplingParams(max_tokens=3))]
    text = (await SimEngine("sim", PARAMS).complete("Once upon a time",
                                                      SamplingParams(max_tokens=3))).text
    assert "".join(c.text for c in chunks) == text
    with pytest.raises(EngineError, match="out of the sim vocabulary"):
        [c async for c in engine.stream_ids([1, -5], SamplingParams(max_tokens=3))]


async def test_max_tokens_beyond_the_context_is_cut_to_the_room_left_as_vllm_does(autojump_clock):
    engine = SimEngine("sim", SimParams(max_context=64))

    cut = await engine.complete(_prompt(60), SamplingParams(max_tokens=50))

    assert (cut.completion_tokens, cut.finish_reason) == (4, "length")
    assert (await engine.complete(_prompt(60), SamplingParams(max_tokens=4))).completion_tokens == 4
    with pytest.raises(PromptTooLongError):
        await engine.complete(_prompt(64), SamplingParams(max_tokens=1))
    with pytest.raises(EngineParameterError):
        await engine.complete(_prompt(8), SamplingParams(max_tokens=65))


async def test_score_raises_and_a_closed_engine_refuses_requests(autojump_clock):
    engine = SimEngine("sim", PARAMS)
    with pytest.raises(EngineError, match="cannot score"):
        await engine.score("Once", " upon")
    await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        await engine.complete("Once", SamplingParams(max_tokens=1))


# -- registration -------------------------------------------------------------------------------


def test_load_engine_builds_a_sim_engine_with_the_given_params():
    engine = load_engine("sim", model="Llama-3-8B", sim=PARAMS)
    assert isinstance(engine, SimEngine)
    assert (engine.model_id, engine.params, engine.max_context) == ("Llama-3-8B", PARAMS, 4096)


def test_the_sim_table_of_a_config_file_sets_the_params(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('roles = ["model", "verifier"]\nmodel = "Llama-3-8B"\nengine = "sim"\n'
                    '[sim]\nstep_time = 0.05\nmax_batch = 8\n')
    config = load_config(path)
    assert config.sim == SimParams(step_time=0.05, max_batch=8)
    path.write_text('roles = ["verifier"]\n[sim]\nstep_time = -1\n')
    with pytest.raises(ConfigError, match=r"\[sim\]: step_time"):
        load_config(path)
    path.write_text('roles = ["verifier"]\n[sim]\nstep_tme = 1\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(path)


def test_ps_node_run_with_engine_sim_serves_the_named_model():
    from ps_p2p.cli import _run_config, build_parser, make_engine

    args = build_parser().parse_args(
        ["run", "--role", "model", "--role", "verifier", "--engine", "sim", "--model", "Llama-3-8B"]
    )
    engine = make_engine(_run_config(args))
    assert isinstance(engine, SimEngine)
    assert (engine.model_id, engine.params) == ("Llama-3-8B", SimParams())


async def test_a_devnet_with_engine_sim_needs_no_model():
    from ps_p2p.cli import build_parser
    from ps_p2p.devnet import DevnetOptions, _WorkerProcess

    assert build_parser().parse_args(["devnet", "--engine", "sim"]).engine == "sim"
    DevnetOptions(engine="sim", prompts="prompts.txt").validate()
    engine = await _WorkerProcess._engine({"engine": "sim", "model": None})
    assert isinstance(engine, SimEngine) and engine.model_id == "sim"
