"""The official ``openai`` Python client, unchanged, against a user node's local API.

Behind the API stands :class:`~ps_p2p.testing.fakes.FakeUserNode` (answers at once: the prompt
reversed, streamed in pieces of four characters; or the typed error a test queues); the slow
tests at the end serve a real user node of an in-process network, where the text is streamed
through the anonymous overlay. The client is synchronous and runs in a worker thread, as an
application would run it beside the node.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
import trio

from ps_p2p.api.openai_compat import serve_api
from ps_p2p.engines.base import default_chat_prompt
from ps_p2p.errors import NoPathError, RequestTimeoutError
from ps_p2p.inference import ChatMessage
from ps_p2p.testing.fakes import FakeUserNode
from ps_p2p.testing.localnet import open_localnet

PROMPT = "Once upon a time there was a fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
CHAT_PROMPT = default_chat_prompt([ChatMessage(m["role"], m["content"]) for m in MESSAGES])


@asynccontextmanager
async def _client(node: Any) -> AsyncIterator[Callable[..., Any]]:
    """``call(fn, *args, **kwargs)`` runs ``fn(client, ...)`` in a thread, with an OpenAI
    client (no retries) on the node's API."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_api, node, "127.0.0.1:0")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return await trio.to_thread.run_sync(functools.partial(fn, client, *args, **kwargs))

        try:
            yield call
        finally:
            client.close()
            nursery.cancel_scope.cancel()


@pytest.fixture
async def fake():
    node = FakeUserNode()
    async with _client(node) as call:
        yield node, call


def _stream_text(stream: Any) -> tuple[list[str], list[Any]]:
    pieces, chunks = [], []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            text = getattr(choice, "text", None)
            if text is None and getattr(choice, "delta", None) is not None:
                text = choice.delta.content
            if text:
                pieces.append(text)
    return pieces, chunks


# ------------------------------------------------------------------------------ models


async def test_models_list_and_retrieve(fake):
    node, call = fake
    models = await call(lambda c: list(c.models.list()))
    assert [m.id for m in models] == ["fake-model"]
    model = await call(lambda c: c.models.retrieve("fake-model"))
    assert model.id == "fake-model" and model.object == "model"


async def test_retrieve_of_an_unknown_model_is_404(fake):
    node, call = fake
    with pytest.raises(openai.NotFoundError):
        await call(lambda c: c.models.retrieve("no-such-model"))


# ------------------------------------------------------------------------------ completions


async def test_completion_has_text_finish_reason_and_usage(fake):
    node, call = fake
    r = await call(lambda c: c.completions.create(model="fake-model", prompt=PROMPT, max_tokens=64))
    assert r.choices[0].text == PROMPT[::-1]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(PROMPT), len(PROMPT), 2 * len(PROMPT)
    )


async def test_streamed_completion_arrives_in_chunks_then_usage(fake):
    node, call = fake
    stream = await call(lambda c: c.completions.create(
        model="fake-model", prompt=PROMPT, stream=True, stream_options={"include_usage": True}
    ))
    pieces, chunks = await trio.to_thread.run_sync(_stream_text, stream)
    assert "".join(pieces) == PROMPT[::-1]
    assert len(pieces) == len(range(0, len(PROMPT), 4))  # the pieces as they came
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(PROMPT)
    assert node.user.calls[0].stream is True


async def test_stop_and_n_and_seed_are_honoured(fake):
    node, call = fake
    r = await call(lambda c: c.completions.create(
        model="fake-model", prompt=PROMPT, stop=["saw"], n=2, seed=7
    ))
    assert [c.text for c in r.choices] == ["xof a ", "xof a "]
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    assert sorted(c.seed for c in node.user.calls) == [7, 8]  # n seeded requests differ
    assert all(c.stop == ("saw",) for c in node.user.calls)


# ------------------------------------------------------------------------------ chat


async def test_chat_completion_answers_as_the_assistant(fake):
    node, call = fake
    r = await call(lambda c: c.chat.completions.create(model="fake-model", messages=MESSAGES))
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == CHAT_PROMPT[:64][::-1]
    assert r.usage.prompt_tokens == len(CHAT_PROMPT)
    assert node.user.calls[0].messages == tuple(ChatMessage(m["role"], m["content"]) for m in MESSAGES)


async def test_streamed_chat_sends_role_then_deltas(fake):
    node, call = fake
    stream = await call(lambda c: c.chat.completions.create(
        model="fake-model", messages=MESSAGES, stream=True
    ))
    pieces, chunks = await trio.to_thread.run_sync(_stream_text, stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(pieces) == CHAT_PROMPT[:64][::-1]
    assert chunks[-1].choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 9}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"n": 2, "stream": True}, "n"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
])
async def test_bad_parameters_get_a_local_400_naming_the_field(fake, kwargs, param):
    node, call = fake
    with pytest.raises(openai.BadRequestError) as info:
        await call(lambda c: c.completions.create(model="fake-model", prompt=PROMPT, **kwargs))
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert node.user.calls == []  # refused before anything travelled


async def test_unknown_model_is_404_and_nothing_is_sent(fake):
    node, call = fake
    for create in (
        lambda c: c.completions.create(model="no-such-model", prompt=PROMPT),
        lambda c: c.chat.completions.create(model="no-such-model", messages=MESSAGES),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            await call(create)
        assert info.value.body["code"] == "model_not_found"
    assert node.user.calls == []


@pytest.mark.parametrize("error, status", [
    (NoPathError("only 2 of 4 paths ready"), 503),
    (RequestTimeoutError("no answer within 3 s"), 504),
])
async def test_network_failures_get_503_or_504_streamed_or_not(fake, error, status):
    node, call = fake
    for stream in (False, True):
        node.user.fail_next(error)
        with pytest.raises(openai.APIStatusError) as info:
            await call(lambda c: c.completions.create(model="fake-model", prompt=PROMPT,
                                                      stream=stream))
        assert info.value.status_code == status
        assert info.value.body["code"] == type(error).__name__


# ------------------------------------------------------------------ real network (slow)


@pytest.mark.slow
async def test_openai_client_through_a_real_local_network_streams_and_chats():
    async with open_localnet(users=6) as net, _client(net.users[0]) as call:
        r = await call(lambda c: c.completions.create(model="fake-model", prompt=PROMPT))
        assert r.choices[0].text == PROMPT[::-1]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 0
        stream = await call(lambda c: c.completions.create(
            model="fake-model", prompt=PROMPT, stream=True, stream_options={"include_usage": True}
        ))
        pieces, chunks = await trio.to_thread.run_sync(_stream_text, stream)
        assert "".join(pieces) == PROMPT[::-1]
        assert chunks[-1].usage.completion_tokens == len(PROMPT)
        chat = await call(lambda c: c.chat.completions.create(
            model="fake-model", messages=MESSAGES, stream=True
        ))
        pieces, _ = await trio.to_thread.run_sync(_stream_text, chat)
        assert "".join(pieces) == CHAT_PROMPT[:64][::-1]
