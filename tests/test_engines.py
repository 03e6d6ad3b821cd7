"""Inference engines: transformers on the real stories260K model, vLLM against the fake server.

The model is loaded once per module (a cached loader); the fake vLLM server is backed by that
same engine, so every vLLM answer can be compared with the engine's own.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import random
import socket

import httpx
import pytest
import trio
import trio.testing

from ps_p2p.engines import default_model_id, load_engine
from ps_p2p.engines.base import (
    ChatMessage,
    Engine,
    SamplingParams,
    StreamChunk,
    TokenScores,
    default_chat_prompt,
)
from ps_p2p.engines.vllm_engine import VLLMEngine
from ps_p2p.errors import ConfigError, EngineError, EngineParameterError, PromptTooLongError
from ps_p2p.testing.fake_vllm import open_fake_vllm
from ps_p2p.testing.fakes import InstantEngine

PROMPT = "Once upon a time"
GREEDY = SamplingParams(max_tokens=24)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234)

_loaded: dict[pathlib.Path, Engine] = {}


def _load(path: pathlib.Path) -> Engine:
    """Load a model once per test session (a few seconds on 2 cores)."""
    pytest.importorskip("transformers")
    if path not in _loaded:
        from ps_p2p.engines.transformers_engine import TransformersEngine

        _loaded[path] = TransformersEngine.load(path)
    return _loaded[path]


@pytest.fixture
def engine(shared: pathlib.Path) -> Engine:
    """TransformersEngine on ../shared/models/stories260K (shared by all tests: do not close)."""
    return _load(shared / "models" / "stories260K")


@pytest.fixture
async def vllm_url(engine: Engine):
    async with open_fake_vllm(engine) as url:
        yield url


@pytest.fixture
async def vllm(vllm_url: str, engine: Engine):
    client = VLLMEngine(vllm_url, engine.model_id)
    yield client
    await client.aclose()


def _reference_logprobs(engine, token_ids: list[int], start: int) -> list[float]:
    """log p(token i | tokens < i) by one separate forward pass per position."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(start, len(token_ids)):
            logits = engine.model(input_ids=torch.tensor([token_ids[:i]])).logits[0, -1]
            out.append(torch.log_softmax(logits.double(), dim=-1)[token_ids[i]].item())
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- base ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": -1},
        {"seed": 2**64},
    ],
)
def test_sampling_params_reject_values_out_of_range(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_perplexity_is_exp_of_minus_mean_logprob():
    scores = TokenScores([5, 6], [math.log(0.5), math.log(0.125)])
    assert scores.perplexity == pytest.approx(4.0)
    assert TokenScores([], []).perplexity == math.inf


async def test_default_stream_of_instant_engine_ends_with_a_finish_reason():
    chunks = [c async for c in InstantEngine().stream("hello", GREEDY)]
    assert "".join(c.text for c in chunks) == "olleh"
    assert chunks[-1].finish_reason == "stop"


# -- load_engine -------------------------------------------------------------------------


def test_load_engine_rejects_unknown_kind():
    with pytest.raises(ConfigError):
        load_engine("llama.cpp", model="x")


def test_load_engine_rejects_missing_model_path(tmp_path):
    with pytest.raises(ConfigError):
        load_engine("transformers", model=str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "model, expected",
    [
        ("../shared/models/stories260K", "stories260K"),
        ("../shared/models/stories260K/", "stories260K"),
        ("/m/stories260K.gguf", "stories260K"),
        ("meta-llama/Llama-3.1-8B", "Llama-3.1-8B"),
    ],
)
def test_default_model_id_is_the_last_path_component(model, expected):
    assert default_model_id(model) == expected


@pytest.mark.slow
def test_load_engine_names_a_folder_model_after_the_folder(shared):
    pytest.importorskip("transformers")
    engine = load_engine("transformers", model=str(shared / "models" / "stories260K"))
    assert engine.model_id == "stories260K"
    assert engine.max_context == 2048


async def test_load_engine_vllm_reads_max_model_len(engine, vllm_url):
    load = functools.partial(load_engine, "vllm", model=engine.model_id, base_url=vllm_url + "/v1")
    client = await trio.to_thread.run_sync(load)  # blocking start-up code
    try:
        assert client.max_context == engine.max_context
        assert client.model_id == engine.model_id
    finally:
        await client.aclose()


async def test_load_engine_vllm_rejects_a_model_the_server_does_not_serve(engine, vllm_url):
    load = functools.partial(load_engine, "vllm", model="other-model", base_url=vllm_url)
    with pytest.raises(ConfigError):
        await trio.to_thread.run_sync(load)


# -- transformers engine -----------------------------------------------------------------


async def test_greedy_completion_is_deterministic_and_nonempty(engine):
    first = await engine.complete(PROMPT, GREEDY)
    second = await engine.complete(PROMPT, GREEDY)
    assert first.text.strip()
    assert first == second
    assert first.prompt_tokens == len(await engine.tokenize(PROMPT))
    assert first.completion_tokens == GREEDY.max_tokens
    assert first.finish_reason == "length"


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
async def test_streamed_pieces_join_to_the_completion_text(engine, params):
    completion = await engine.complete(PROMPT, params)
    pieces = [piece async for piece in engine.generate(PROMPT, params)]
    assert len(pieces) > 1
    assert "".join(pieces) == completion.text


@pytest.mark.slow
async def test_seeded_sampling_repeats_and_other_seeds_differ(engine):
    texts = set()
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed)
        first = await engine.complete(PROMPT, params)
        assert (await engine.complete(PROMPT, params)).text == first.text
        texts.add(first.text)
    assert len(texts) > 1


async def test_stream_ends_with_finish_reason_and_token_counts(engine):
    chunks = [chunk async for chunk in engine.stream(PROMPT, GREEDY)]
    assert all(c.finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert (last.finish_reason, last.completion_tokens) == ("length", GREEDY.max_tokens)
    assert last.prompt_tokens == len(await engine.tokenize(PROMPT))


@pytest.mark.slow
async def test_concurrent_streams_give_the_same_text_as_one_at_a_time(engine):
    prompts = [PROMPT, "The little dog", "Lily and Ben"]
    expected = [(await engine.complete(p, GREEDY)).text for p in prompts]
    results: dict[int, str] = {}

    async def run(i: int) -> None:
        results[i] = "".join([piece async for piece in engine.generate(prompts[i], GREEDY)])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(run, i)
    assert [results[i] for i in range(len(prompts))] == expected


async def test_cancelled_completion_stops_its_thread_and_leaves_the_engine_usable(engine):
    expected = await engine.complete(PROMPT, GREEDY)
    long = SamplingParams(max_tokens=2000)  # greedy stories260K runs to the limit (no EOS)
    before = engine.tokens_generated
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.complete, PROMPT, long)
            await trio.testing.wait_all_tasks_blocked()  # the worker thread is generating
            scope.cancel()
    assert scope.cancelled_caught
    assert engine.tokens_generated - before < long.max_tokens  # stopped between tokens
    with trio.move_on_after(30):  # would hang if the lock were still held
        assert await engine.complete(PROMPT, GREEDY) == expected
        return
    pytest.fail("the engine stayed locked after a cancelled completion")


async def test_abandoned_stream_leaves_the_engine_usable(engine):
    expected = await engine.complete(PROMPT, GREEDY)
    async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=1500)):
        break
    assert await engine.complete(PROMPT, GREEDY) == expected


async def test_score_gives_one_nonpositive_logprob_per_continuation_token(engine):
    continuation = " there was a little girl named Lily."
    scores = await engine.score(PROMPT, continuation)
    assert scores.token_ids == await engine.encode(continuation, add_special_tokens=False)
    assert len(scores.logprobs) == len(scores.token_ids) > 0
    assert all(lp <= 0 for lp in scores.logprobs)
    assert all(rank >= 1 for rank in scores.ranks)


async def test_score_matches_a_token_by_token_reference(engine):
    completion = await engine.complete(PROMPT, GREEDY)
    prompt_ids = await engine.tokenize(PROMPT)
    assert prompt_ids[0] == engine.tokenizer.bos_token_id
    scores = await engine.score(PROMPT, completion.text)
    ids = prompt_ids + scores.token_ids
    reference = _reference_logprobs(engine, ids, len(prompt_ids))
    assert scores.logprobs == pytest.approx(reference, abs=1e-4)


async def test_score_ids_reports_ranks_and_top_alternatives(engine):
    ids = await engine.tokenize(PROMPT + " there was a girl")
    scores = await engine.score_ids(ids, 1, top_k=3)
    assert scores.token_ids == ids[1:]
    for logprob, rank, top in zip(scores.logprobs, scores.ranks, scores.top_logprobs):
        assert len(top) == 3
        assert rank > 3 or rank == 1 + sum(1 for v in top.values() if v > logprob)
        assert max(top.values()) >= logprob


async def test_likely_continuation_scores_higher_than_random_tokens(engine):
    likely = (await engine.complete(PROMPT, GREEDY)).text
    rng = random.Random(7)
    noise_ids = [rng.randrange(3, engine.vocab_size) for _ in range(GREEDY.max_tokens)]
    noise = await engine.decode(noise_ids)
    likely_scores = await engine.score(PROMPT, likely)
    noise_scores = await engine.score(PROMPT, noise)
    assert likely_scores.mean_logprob > noise_scores.mean_logprob + 1.0
    assert likely_scores.perplexity < noise_scores.perplexity


async def test_max_tokens_beyond_the_context_is_cut_to_the_room_left_as_vllm_does(engine):
    """Issue 21: one behaviour for both engines, vLLM's (>= 0.32): the answer uses the room the
    prompt leaves and ends with "length"; only a prompt that leaves no room, or a max_tokens
    above the whole context, is refused."""
    room = 5
    prompt = " a" * (engine.max_context - room)
    prompt_tokens = len(await engine.tokenize(prompt))
    prompt = " a" * (engine.max_context - room - (prompt_tokens - (engine.max_context - room)))
    prompt_tokens = len(await engine.tokenize(prompt))
    assert engine.max_context - prompt_tokens == room
    over = SamplingParams(max_tokens=100)

    completion = await engine.complete(prompt, over)
    chunks = [chunk async for chunk in engine.stream(prompt, over)]

    assert (completion.completion_tokens, completion.finish_reason) == (room, "length")
    assert (chunks[-1].completion_tokens, chunks[-1].finish_reason) == (room, "length")


async def test_a_prompt_leaving_no_room_or_max_tokens_above_the_context_is_refused(engine):
    with pytest.raises(PromptTooLongError):
        await engine.complete(" a" * engine.max_context, SamplingParams(max_tokens=1))
    with pytest.raises(EngineParameterError):
        await engine.complete(PROMPT, SamplingParams(max_tokens=engine.max_context + 1))
    with pytest.raises(PromptTooLongError):
        async for _ in engine.generate(" a" * engine.max_context, SamplingParams(max_tokens=1)):
            pass
    with pytest.raises(PromptTooLongError):
        await engine.score(PROMPT, " a" * engine.max_context)


async def test_loading_shows_no_progress_bar_and_generating_no_future_warning(shared, capsys):
    """Issue 21: a transformers tqdm bar and a FutureWarning (``past_key_values``) in every
    model node's log."""
    import warnings

    pytest.importorskip("transformers")
    from ps_p2p.engines.transformers_engine import TransformersEngine

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = TransformersEngine.load(shared / "models" / "stories260K")
        try:
            await engine.complete(PROMPT, SamplingParams(max_tokens=4))
        finally:
            await engine.aclose()

    err = capsys.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []


@pytest.mark.parametrize("device", ["no-such-device", "cuda:99"])
def test_unavailable_device_raises_engine_error(shared, device):
    pytest.importorskip("transformers")
    from ps_p2p.engines.transformers_engine import TransformersEngine

    with pytest.raises(EngineError):
        TransformersEngine.load(shared / "models" / "stories260K", device=device)


async def test_closed_engine_raises_engine_error(shared):
    pytest.importorskip("transformers")
    from ps_p2p.engines.transformers_engine import TransformersEngine

    own = TransformersEngine.load(shared / "models" / "stories260K", model_id="own")
    await own.aclose()
    with pytest.raises(EngineError):
        await own.complete(PROMPT, GREEDY)


async def test_gguf_gives_the_same_greedy_text_as_the_folder(engine, shared):
    gguf = load_engine("transformers", model=str(shared / "models" / "stories260K.gguf"))
    try:
        assert gguf.model_id == "stories260K"
        text = PROMPT + ", Lily's dog"
        assert await gguf.tokenize(text) == await engine.tokenize(text)
        assert (await gguf.complete(PROMPT, GREEDY)) == (await engine.complete(PROMPT, GREEDY))
    finally:
        await gguf.aclose()


# -- vLLM engine against the fake server ---------------------------------------------------


async def test_vllm_completion_matches_the_backing_engine(engine, vllm):
    for params in (GREEDY, SAMPLED):
        assert await vllm.complete(PROMPT, params) == await engine.complete(PROMPT, params)


async def test_vllm_stream_matches_the_completion(engine, vllm):
    expected = await engine.complete(PROMPT, GREEDY)
    chunks = [chunk async for chunk in vllm.stream(PROMPT, GREEDY)]
    assert "".join(c.text for c in chunks) == expected.text
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
        expected.finish_reason, expected.prompt_tokens, expected.completion_tokens,
    )
    assert "".join([p async for p in vllm.generate(PROMPT, GREEDY)]) == expected.text


async def test_vllm_score_matches_the_backing_engine(engine, vllm):
    continuation = (await engine.complete(PROMPT, GREEDY)).text
    remote = await vllm.score(PROMPT, continuation)
    local = await engine.score(PROMPT, continuation)
    assert remote.token_ids == local.token_ids
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-9)
    assert remote.ranks == local.ranks


async def test_vllm_tokenize_and_decode_match_the_backing_engine(engine, vllm):
    text = PROMPT + ", there was a dog."
    assert await vllm.tokenize(text) == await engine.tokenize(text)
    ids = await vllm.encode(text, add_special_tokens=False)
    assert ids == await engine.encode(text, add_special_tokens=False)
    assert await vllm.decode(ids) == await engine.decode(ids)


async def test_vllm_refresh_reads_max_model_len(engine, vllm):
    assert vllm.max_context == 0
    await vllm.refresh()
    assert vllm.max_context == engine.max_context


async def test_vllm_overflowing_max_tokens_is_cut_to_the_room_left(engine):
    prompt_tokens = len(await engine.tokenize(PROMPT))
    room = 6
    expected = await engine.complete(PROMPT, SamplingParams(max_tokens=room))
    assert expected.finish_reason == "length"  # the model does not stop within 6 tokens
    overflowing = SamplingParams(max_tokens=prompt_tokens + room)  # = max_model_len: accepted
    async with open_fake_vllm(engine, max_model_len=prompt_tokens + room) as url:
        async with VLLMEngine(url, engine.model_id) as client:
            completion = await client.complete(PROMPT, overflowing)
            chunks = [c async for c in client.stream(PROMPT, overflowing)]
    assert completion == expected
    assert "".join(c.text for c in chunks) == expected.text
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (
        "length", prompt_tokens, room,
    )


@pytest.mark.parametrize("short_by", [1, 0], ids=["prompt-over-context", "prompt-equals-context"])
async def test_vllm_prompt_that_leaves_no_room_raises_prompt_too_long(engine, short_by):
    prompt_tokens = len(await engine.tokenize(PROMPT))
    async with open_fake_vllm(engine, max_model_len=prompt_tokens - short_by) as url:
        async with VLLMEngine(url, engine.model_id) as client:
            with pytest.raises(PromptTooLongError):
                await client.complete(PROMPT, SamplingParams(max_tokens=1))
            with pytest.raises(PromptTooLongError):
                async for _ in client.stream(PROMPT, SamplingParams(max_tokens=1)):
                    pass
            with pytest.raises(PromptTooLongError):
                await client.score(PROMPT, " there")


async def test_vllm_max_tokens_above_max_model_len_is_a_parameter_error(engine):
    window = len(await engine.tokenize(PROMPT)) + 4
    async with open_fake_vllm(engine, max_model_len=window) as url:
        async with VLLMEngine(url, engine.model_id) as client:
            too_many = SamplingParams(max_tokens=window + 1)
            with pytest.raises(EngineParameterError, match="cannot be greater than") as info:
                await client.complete(PROMPT, too_many)
            assert not isinstance(info.value, PromptTooLongError)
            assert isinstance(info.value, ValueError)
            with pytest.raises(EngineParameterError):
                async for _ in client.generate(PROMPT, too_many):
                    pass
            # max_tokens equal to the window is accepted (and cut): only "greater than" is not
            cut = await client.complete(PROMPT, SamplingParams(max_tokens=window))
    assert (cut.completion_tokens, cut.finish_reason) == (4, "length")


async def test_vllm_score_of_a_continuation_past_the_context_raises_prompt_too_long(engine, vllm):
    with pytest.raises(PromptTooLongError):
        await vllm.score(PROMPT, " a" * engine.max_context)


async def test_vllm_server_down_raises_engine_error():
    client = VLLMEngine(f"http://127.0.0.1:{_closed_port()}", "m", connect_timeout=5)
    try:
        for call in (client.complete(PROMPT, GREEDY), client.tokenize(PROMPT), client.refresh()):
            with pytest.raises(EngineError, match="cannot connect"):
                await call
        with pytest.raises(EngineError):
            async for _ in client.generate(PROMPT, GREEDY):
                pass
    finally:
        await client.aclose()


async def test_vllm_unknown_model_raises_engine_error(vllm_url):
    async with VLLMEngine(vllm_url, "no-such-model") as client:
        with pytest.raises(EngineError, match="does not exist") as info:
            await client.complete(PROMPT, GREEDY)
        assert not isinstance(info.value, PromptTooLongError)
        with pytest.raises(EngineError):
            await client.score(PROMPT, " there")
        with pytest.raises(EngineError, match="serves"):
            await client.refresh()


async def test_fake_vllm_answers_vllm_error_objects(engine, vllm_url):
    async with httpx.AsyncClient(base_url=vllm_url) as http:
        too_many = await http.post("/v1/completions", json={
            "model": engine.model_id, "prompt": PROMPT, "max_tokens": engine.max_context + 1,
        })
        assert too_many.status_code == 400
        assert too_many.json() == {"error": {
            "message": "max_tokens=2049 cannot be greater than max_model_len=2048. "
                       "Please request fewer output tokens.",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }}

        unknown = await http.post("/v1/completions", json={"model": "x", "prompt": PROMPT})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == "The model `x` does not exist."
        assert unknown.json()["error"]["type"] == "NotFoundError"

        for bad in ({"prompt": PROMPT, "temperature": -1}, {"prompt": PROMPT, "max_tokens": 0},
                    {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}, {"max_tokens": 4}):
            response = await http.post("/v1/completions", json=bad)
            assert response.status_code == 400, bad
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get("/v1/completions")).status_code == 405
        assert (await http.get("/v1/chat")).status_code == 404


async def test_fake_vllm_accepts_overflow_and_refuses_a_prompt_alone_too_long(engine):
    ids = await engine.tokenize(PROMPT)
    async with open_fake_vllm(engine, max_model_len=len(ids) + 3) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            request = {"prompt": PROMPT, "max_tokens": len(ids) + 3, "temperature": 0}
            accepted = await http.post("/v1/completions", json=request)
            too_long = await http.post("/v1/completions", json={
                **request, "prompt": PROMPT + " there was a little girl",
            })
    assert accepted.status_code == 200
    assert accepted.json()["choices"][0]["finish_reason"] == "length"
    assert accepted.json()["usage"]["completion_tokens"] == 3
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["param"] == "input_tokens" and error["code"] == 400
    assert error["message"].startswith(
        f"This model's maximum context length is {len(ids) + 3} tokens. However, your prompt "
        f"contains {len(await engine.tokenize(PROMPT + ' there was a little girl'))} input "
        "tokens, which exceeds this limit even without any output tokens."
    )


async def test_fake_vllm_completion_and_stream_have_vllm_shapes(engine, vllm_url):
    request = {"model": engine.model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=vllm_url) as http:
        answer = (await http.post("/v1/completions", json=request)).json()
        assert answer["id"].startswith("cmpl-") and answer["object"] == "text_completion"
        assert answer["model"] == engine.model_id
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + 8

        stream = {**request, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=stream) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(e["id"] == events[0]["id"] and e["id"].startswith("cmpl-") for e in events)
    text_events, usage_event = events[:-1], events[-1]
    for event in text_events:
        assert set(event) == {"id", "object", "created", "model", "choices"}
        assert event["object"] == "text_completion" and event["model"] == engine.model_id
        [choice] = event["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        assert choice["index"] == 0 and choice["logprobs"] is None
    assert [e["choices"][0]["finish_reason"] for e in text_events] == (
        [None] * (len(text_events) - 1) + ["length"]
    )
    assert "".join(e["choices"][0]["text"] for e in text_events) == answer["choices"][0]["text"]
    assert set(usage_event) == {"id", "object", "created", "model", "choices", "usage"}
    assert usage_event["object"] == "text_completion" and usage_event["choices"] == []
    assert usage_event["usage"] == {
        k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"
    }


async def test_fake_vllm_prompt_logprobs_align_with_prompt_tokens(engine, vllm_url):
    ids = await engine.tokenize(PROMPT + " there was")
    request = {"model": engine.model_id, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    async with httpx.AsyncClient(base_url=vllm_url) as http:
        answer = (await http.post("/v1/completions", json=request)).json()
    entries = answer["choices"][0]["prompt_logprobs"]
    assert answer["usage"]["prompt_tokens"] == len(ids) == len(entries)
    assert entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert {v["rank"] for v in entry.values()} >= {1, 2}


async def test_fake_vllm_prompt_logprobs_put_the_prompt_token_first_with_its_true_rank(engine):
    ids = await engine.tokenize(PROMPT + " there was")
    local = await engine.score_ids(ids, 1, top_k=3)
    async with open_fake_vllm(engine) as url, httpx.AsyncClient(base_url=url) as http:
        answer = (await http.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 1, "prompt_logprobs": 3,
        })).json()
    entries = answer["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    for token_id, rank, top, entry in zip(ids[1:], local.ranks, local.top_logprobs, entries[1:]):
        keys = list(entry)
        assert keys[0] == str(token_id) and entry[keys[0]]["rank"] == rank
        alternatives = {int(k): v for k, v in entry.items() if k != str(token_id) or rank <= 3}
        assert set(alternatives) == set(top)
        assert sorted(v["rank"] for v in alternatives.values()) == [1, 2, 3]


@pytest.mark.parametrize("k", [21, -1])
async def test_fake_vllm_refuses_prompt_logprobs_above_max_logprobs(engine, vllm_url, k):
    async with httpx.AsyncClient(base_url=vllm_url) as http:
        response = await http.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": k,
        })
    assert response.status_code == 400
    error = response.json()["error"]
    wanted = k if k > 0 else engine.vocab_size
    assert error["message"] == (
        f"Requested prompt logprobs of {wanted}, which is greater than max allowed: 20"
    )
    assert error["param"] == "prompt_logprobs"


async def test_fake_vllm_without_a_logprobs_limit_gives_the_whole_vocabulary(engine):
    ids = await engine.tokenize(PROMPT)
    async with open_fake_vllm(engine, max_logprobs=-1) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            answer = (await http.post("/v1/completions", json={
                "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1,
            })).json()
    entries = answer["choices"][0]["prompt_logprobs"]
    assert all(len(entry) == engine.vocab_size for entry in entries[1:])


async def test_vllm_score_ids_above_max_logprobs_is_a_parameter_error(engine, vllm):
    ids = await engine.tokenize(PROMPT)
    assert len((await vllm.score_ids(ids, 1, top_k=20)).top_logprobs[0]) == 20
    with pytest.raises(EngineParameterError, match="max allowed: 20"):
        await vllm.score_ids(ids, 1, top_k=21)


class _ImpossibleTokens(InstantEngine):
    """Characters as tokens; every token has probability 0 (logprob -inf), rank 1."""

    async def encode(self, text, *, add_special_tokens=True):
        return [ord(c) for c in text]

    async def decode(self, token_ids):
        return "".join(map(chr, token_ids))

    async def score_ids(self, token_ids, start, *, top_k=0):
        scored = list(token_ids[start:])
        return TokenScores(
            scored, [-math.inf] * len(scored), ranks=[1] * len(scored),
            top_logprobs=[{t: -math.inf} for t in scored] if top_k else None,
        )


async def test_minus_infinity_travels_as_minus_9999_and_reads_back_as_minus_infinity():
    engine = _ImpossibleTokens(max_context=64)
    async with open_fake_vllm(engine) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/completions", json={
                "prompt": [104, 105], "max_tokens": 1, "prompt_logprobs": 1,
            })
        async with VLLMEngine(url, engine.model_id) as client:
            scores = await client.score_ids([104, 105, 106], 1, top_k=1)
    assert b"Infinity" not in response.content
    assert response.json()["choices"][0]["prompt_logprobs"][1]["105"]["logprob"] == -9999.0
    assert scores.logprobs == [-math.inf, -math.inf]
    assert scores.top_logprobs == [{105: -math.inf}, {106: -math.inf}]


class _FailsMidStream(InstantEngine):
    """Streams one piece, then fails as a crashed engine would."""

    async def stream(self, prompt, params):
        yield StreamChunk("Once")
        raise EngineError("CUDA error: an illegal memory access was encountered")


async def test_fake_vllm_reports_a_failure_inside_the_stream_before_done():
    engine = _FailsMidStream()
    async with open_fake_vllm(engine) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            request = {"prompt": "hi", "max_tokens": 4, "stream": True}
            async with http.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line]
        async with VLLMEngine(url, engine.model_id) as client:
            pieces = []
            with pytest.raises(EngineError, match="illegal memory access") as info:
                async for chunk in client.stream("hi", SamplingParams(max_tokens=4)):
                    pieces.append(chunk.text)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: ")) == {"error": {
        "message": "CUDA error: an illegal memory access was encountered",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }}
    assert pieces == ["Once"]
    assert not isinstance(info.value, EngineParameterError)


# -- VLLMEngine's reading of server answers (canned answers, no server) -----------------------


def _canned(status: int, payload: dict, *, stream: bool = False) -> httpx.MockTransport:
    """A transport answering every request with ``payload`` (as an SSE error event when
    ``stream``, the way vLLM reports a failure after the stream started)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if stream:
            body = b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(status, json=payload)

    return httpx.MockTransport(answer)


def _nested(message: str, param: str | None = None, code: int = 400) -> dict:
    kind = {400: "BadRequestError", 500: "InternalServerError"}.get(code, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _flat(message: str, code: int = 400) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None,
            "code": code}


_ERROR_CASES = [
    ("max-tokens-0.33", 400, _nested(
        "max_tokens=4097 cannot be greater than max_model_len=4096. Please request fewer "
        "output tokens.", "max_tokens"), EngineParameterError),
    ("max-tokens-total-tokens", 400, _nested(
        "max_tokens=8888 cannot be greater than max_model_len=max_total_tokens=3072."),
        EngineParameterError),
    ("max-tokens-flat", 400, _flat(
        "max_tokens=4097 cannot be greater than max_model_len=4096"), EngineParameterError),
    ("prompt-alone-too-long", 400, _nested(
        "This model's maximum context length is 4096 tokens. However, your prompt contains "
        "5000 input tokens, which exceeds this limit even without any output tokens.",
        "input_tokens"), PromptTooLongError),
    ("old-overflow", 400, _flat(
        "This model's maximum context length is 2048 tokens. However, you requested 2060 "
        "tokens (12 in the messages, 2048 in the completion)."), PromptTooLongError),
    ("prompt-logprobs", 400, _nested(
        "Requested prompt logprobs of 21, which is greater than max allowed: 20",
        "prompt_logprobs"), EngineParameterError),
    ("server-error", 500, _nested("EngineCore died", code=500), EngineError),
    ("unknown-model", 404, _nested("The model `m` does not exist.", "model", 404), EngineError),
]


@pytest.mark.parametrize(
    "status, payload, expected", [c[1:] for c in _ERROR_CASES], ids=[c[0] for c in _ERROR_CASES]
)
async def test_vllm_maps_server_errors_to_engine_errors(status, payload, expected):
    for stream in (False, True):
        if stream and status == 404:
            continue  # a 404 comes before any stream
        transport = _canned(status, payload, stream=stream)
        async with VLLMEngine("http://vllm.invalid", "m", transport=transport) as client:
            with pytest.raises(EngineError) as info:
                if stream:
                    async for _ in client.stream("hi", GREEDY):
                        pass
                else:
                    await client.complete("hi", GREEDY)
        assert type(info.value) is expected, stream


async def test_vllm_stream_asks_for_usage_and_puts_it_on_the_last_chunk():
    bodies = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
        events = [
            {**chunk, "choices": [{"index": 0, "text": "Once", "logprobs": None,
                                   "finish_reason": None, "stop_reason": None}]},
            {**chunk, "choices": [{"index": 0, "text": " upon", "logprobs": None,
                                   "finish_reason": "length", "stop_reason": None}]},
            {**chunk, "choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}},
        ]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return httpx.Response(200, content=body + b"data: [DONE]\n\n")

    transport = httpx.MockTransport(answer)
    async with VLLMEngine("http://vllm.invalid", "m", transport=transport) as client:
        chunks = [c async for c in client.stream("hi", GREEDY)]
        completion = await Engine.complete(client, "hi", GREEDY)  # the default: from stream()
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
    assert [c.text for c in chunks] == ["Once", " upon"]
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (
        "length", 7, 2,
    )
    assert completion.finish_reason == "length" and completion.completion_tokens == 2


async def test_vllm_aborted_request_raises_engine_error():
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": "Once", "logprobs": None,
                           "finish_reason": "abort", "stop_reason": None}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    async with VLLMEngine("http://vllm.invalid", "m", transport=_canned(200, answer)) as client:
        with pytest.raises(EngineError, match="aborted"):
            await client.complete("hi", GREEDY)


# -- chat prompts ------------------------------------------------------------------------------

CHAT = [
    ChatMessage("system", "You tell short stories."),
    ChatMessage("user", "Tell me about a dog."),
]
#: a small template in the usual shape: BOS first, one line per message, generation prompt
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TEMPLATED = "<system> You tell short stories.\n<user> Tell me about a dog.\n<assistant>"


def _with_template(engine, template: str):
    """A second engine over the same model, with its own tokenizer holding ``template``."""
    from transformers import AutoTokenizer

    from ps_p2p.engines.transformers_engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer.name_or_path)
    tokenizer.chat_template = template
    return TransformersEngine(
        engine.model, tokenizer, model_id=engine.model_id, max_context=engine.max_context
    )


async def test_instant_engine_uses_the_default_chat_prompt():
    assert await InstantEngine().chat_prompt(CHAT) == (
        "System: You tell short stories.\nUser: Tell me about a dog.\nAssistant:"
    )
    assert InstantEngine().chat_template is None


@pytest.mark.parametrize("messages", [[], [ChatMessage("narrator", "x")]], ids=["none", "role"])
async def test_chat_prompt_refuses_no_messages_and_unknown_roles(engine, messages):
    for chat_engine in (engine, InstantEngine()):
        with pytest.raises(ValueError):
            await chat_engine.chat_prompt(messages)


async def test_stories260k_has_no_chat_template_and_gets_the_default_prompt(engine):
    assert engine.tokenizer.chat_template is None and engine.chat_template is None
    assert await engine.chat_prompt(CHAT) == default_chat_prompt(CHAT)


async def test_transformers_chat_prompt_renders_the_template_with_one_bos(engine):
    templated = _with_template(engine, TEMPLATE)
    text = await templated.chat_prompt(CHAT)
    assert text == TEMPLATED  # the template's BOS is left to the tokenizer
    ids = await templated.tokenize(text)
    assert ids[0] == engine.tokenizer.bos_token_id
    assert ids.count(engine.tokenizer.bos_token_id) == 1


@pytest.mark.parametrize(
    "template", ["{{ raise_exception('roles must alternate') }}", "{% for %}"],
    ids=["raise_exception", "syntax-error"],
)
async def test_transformers_chat_template_failure_raises_engine_error(engine, template):
    with pytest.raises(EngineError, match="chat template of stories260K failed"):
        await _with_template(engine, template).chat_prompt(CHAT)


async def test_vllm_chat_prompt_matches_the_backing_engine_template(engine):
    templated = _with_template(engine, TEMPLATE)
    async with open_fake_vllm(templated) as url:
        async with VLLMEngine(url, engine.model_id) as client:
            assert await client.chat_prompt(CHAT) == TEMPLATED
            assert await client.chat_prompt(CHAT[1:]) == await templated.chat_prompt(CHAT[1:])


async def test_fake_vllm_tokenizes_chat_messages_with_the_engine_template(engine):
    templated = _with_template(engine, TEMPLATE)
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    async with open_fake_vllm(templated) as url, httpx.AsyncClient(base_url=url) as http:
        plain = (await http.post("/tokenize", json={"messages": messages})).json()
        special = (await http.post("/tokenize", json={
            "messages": messages, "add_special_tokens": True,
        })).json()
        parts = (await http.post("/tokenize", json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                         {"type": "text", "text": "about a dog."}]},
        ]})).json()
    assert plain["tokens"] == await templated.encode(TEMPLATED, add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"])
    assert special["tokens"] == await templated.tokenize(TEMPLATED)
    assert parts["tokens"] == await templated.encode(
        "<user> Tell me\nabout a dog.\n<assistant>", add_special_tokens=False
    )


async def test_vllm_server_without_a_chat_template_gives_the_default_prompt(engine, vllm):
    async with httpx.AsyncClient(base_url=vllm.base_url) as http:
        refused = await http.post("/tokenize", json={
            "messages": [{"role": "user", "content": "hi"}],
        })
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "As of transformers v4.44, default chat template is no longer allowed, so you must "
        "provide a chat template if the tokenizer does not define one."
    )
    assert await vllm.chat_prompt(CHAT) == await engine.chat_prompt(CHAT) == (
        default_chat_prompt(CHAT)
    )


async def test_vllm_chat_template_failure_raises_engine_error(engine):
    failing = _with_template(engine, "{{ raise_exception('roles must alternate') }}")
    async with open_fake_vllm(failing) as url:
        async with VLLMEngine(url, engine.model_id) as client:
            with pytest.raises(EngineError, match="roles must alternate"):
                await client.chat_prompt(CHAT)
            with pytest.raises(ValueError):
                await client.chat_prompt([])


async def test_vllm_chat_prompt_drops_the_template_bos_that_completions_add_again():
    """A real server's template renders BOS as a token; the text sent back must not hold it,
    or /v1/completions would add a second BOS."""
    requests = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append((request.url.path, body))
        if request.url.path == "/tokenize" and "messages" in body:
            return httpx.Response(200, json={"count": 4, "max_model_len": 64,
                                             "tokens": [1, 40, 41, 42], "token_strs": None})
        if request.url.path == "/tokenize":  # the empty prompt with special tokens: [BOS]
            return httpx.Response(200, json={"count": 1, "max_model_len": 64, "tokens": [1],
                                             "token_strs": None})
        return httpx.Response(200, json={"prompt": f"text of {body['tokens']}"})

    transport = httpx.MockTransport(answer)
    async with VLLMEngine("http://vllm.invalid", "m", transport=transport) as client:
        assert await client.chat_prompt(CHAT) == "text of [40, 41, 42]"
        assert await client.chat_prompt(CHAT) == "text of [40, 41, 42]"
    chat_request = requests[0][1]
    assert chat_request["add_generation_prompt"] is True
    assert chat_request["add_special_tokens"] is False
    assert chat_request["messages"][1] == {"role": "user", "content": "Tell me about a dog."}
    assert [path for path, _ in requests] == [  # the BOS prefix is asked once
        "/tokenize", "/tokenize", "/detokenize", "/tokenize", "/detokenize",
    ]


# -- batches (the verification benchmark's generation and the scorer's rows) ----------------

LONG = ("Lily and Ben went to the park. They saw a big tree and a red ball. Ben wanted to play "
        "with the ball but Lily said")
BATCH_PROMPTS = (PROMPT, "The little dog", LONG, "Tom")


async def test_a_batch_of_completions_gives_the_same_answers_as_one_at_a_time(engine, monkeypatch):
    requests = [(p, params) for p in BATCH_PROMPTS for params in (
        GREEDY, SAMPLED, SamplingParams(max_tokens=7, temperature=0.5, seed=9))]
    expected = [await engine.complete(p, params) for p, params in requests]
    forwards = []
    inner = engine.model.forward

    def counted(*args, **kwargs):
        forwards.append(kwargs["input_ids"].shape[0])
        return inner(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", counted)
    got = await engine.complete_batch(requests)
    assert got == expected
    # one prefill per distinct prompt, then one pass per token for all rows together
    assert len(forwards) == len(BATCH_PROMPTS) + GREEDY.max_tokens - 1
    assert max(forwards) == len(requests)


async def test_batched_logprob_rows_equal_each_sequence_alone(engine, monkeypatch):
    sequences = []
    for p in BATCH_PROMPTS + ("Once upon a time there was a cat", "One day"):
        ids = await engine.tokenize(p + " there was a little girl named Lily.")
        sequences.append((ids, max(1, len(ids) - 9)))
    prompt = await engine.tokenize(LONG)  # answers to one prompt: its tokens run once
    for answer in (" She said no.", " He ran away and", " The ball was red and big", ""):
        ids = prompt + await engine.encode(answer, add_special_tokens=False)
        sequences.append((ids, len(prompt)))
    alone = [(await engine.logprob_rows([s]))[0] for s in sequences]
    forwards = []
    inner = engine.model.forward

    def counted(*args, **kwargs):
        forwards.append(kwargs["input_ids"].shape[0])
        return inner(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", counted)
    together = await engine.logprob_rows(sequences)
    assert len(forwards) < len(sequences)  # sequences of similar lengths share a pass
    for a, b in zip(alone, together):
        assert a.shape == b.shape
        assert abs(a - b).max() < 1e-4
