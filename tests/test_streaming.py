"""Streaming through the anonymous overlay (docs/streaming.md): segments, stop strings, chats.

Service tests run a whole local network of real py-libp2p hosts (ps_p2p.testing.localnet)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
import trio

from ps_p2p.engines.base import SamplingParams, StreamChunk, default_chat_prompt
from ps_p2p.inference import ChatMessage
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.testing.localnet import open_localnet


class SteppedEngine(InstantEngine):
    """Streams the pieces the test feeds it, one at a time, and ends when the feed closes."""

    def __init__(self) -> None:
        super().__init__()
        self.feed_in, self.feed_out = trio.open_memory_channel[str](math.inf)

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        count = 0
        async for piece in self.feed_out:
            count += 1
            yield StreamChunk(piece)
        yield StreamChunk("", finish_reason="stop", prompt_tokens=len(prompt), completion_tokens=count)


async def test_streamed_text_reaches_the_user_while_the_model_node_still_generates():
    with trio.fail_after(120):
        await _streamed_text()


async def _streamed_text() -> None:
    engine = SteppedEngine()
    async with open_localnet(users=6, engine_factory=lambda i: engine) as net:
        user = net.users[0].user
        got_in, got_out = trio.open_memory_channel[str](math.inf)
        answers = []

        async def ask() -> None:
            answers.append(await user.ask("Tell me a story", timeout=60, on_text=got_in.send_nowait))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            engine.feed_in.send_nowait("Once upon")
            # the first piece arrives while the engine waits for the test: streamed, not buffered
            assert await got_out.receive() == "Once upon"
            engine.feed_in.send_nowait(" a time")
            assert await got_out.receive() == " a time"
            engine.feed_in.send_nowait(" there was a fox.")
            engine.feed_in.close()
        answer = answers[0]
        assert answer.ok, answer.error
        assert answer.text == "Once upon a time there was a fox."
        assert answer.signature_valid
        assert answer.finish_reason == "stop"
        assert answer.completion_tokens == 3
        rest = []
        while True:
            try:
                rest.append(got_out.receive_nowait())
            except trio.WouldBlock:
                break
        assert "".join(rest) == " there was a fox."


async def test_stop_string_ends_the_answer_before_it_streamed_or_not():
    async with open_localnet(users=6) as net:
        user = net.users[0].user
        prompt = "Once upon a time there was a fox"  # InstantEngine answers it reversed
        answer = await user.ask(prompt, stop=["saw"], timeout=60)
        assert answer.ok, answer.error
        assert answer.text == "xof a "
        assert answer.finish_reason == "stop"
        pieces: list[str] = []
        answer = await user.ask(prompt, stop=["saw"], timeout=60, on_text=pieces.append)
        assert answer.ok, answer.error
        assert answer.text == "".join(pieces) == "xof a "


async def test_chat_is_rendered_by_the_model_node_with_the_default_template():
    async with open_localnet(users=6) as net:
        messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
        answer = await net.users[0].user.ask(messages=messages, timeout=60)
        assert answer.ok, answer.error
        rendered = default_chat_prompt(messages)
        assert answer.text == rendered[:64][::-1]
        assert answer.prompt_tokens == len(rendered)  # InstantEngine: a token per character


@pytest.mark.slow
async def test_real_model_behind_the_vllm_api_streams_a_chat_through_the_overlay(shared):
    """TinyStories in a TransformersEngine, served by the fake vLLM server, asked by the model
    node's VLLMEngine: the streamed chat answer is the model's own greedy answer to the chat
    prompt, signed, with the model's token counts."""
    from ps_p2p.engines.transformers_engine import TransformersEngine
    from ps_p2p.engines.vllm_engine import VLLMEngine
    from ps_p2p.testing.fake_vllm import open_fake_vllm

    model = TransformersEngine.load(shared / "models" / "stories260K")
    messages = [ChatMessage("user", "Tell me about a cat")]
    expected = await model.complete(await model.chat_prompt(messages), SamplingParams(max_tokens=40))
    with trio.fail_after(240):
        async with open_fake_vllm(model) as url, VLLMEngine(url, model.model_id) as vllm:
            async with open_localnet(users=6, engine_factory=lambda i: vllm) as net:
                pieces: list[str] = []
                answer = await net.users[0].user.ask(
                    messages=messages, max_tokens=40, timeout=120, on_text=pieces.append
                )
    assert answer.ok, answer.error
    assert answer.text == "".join(pieces) == expected.text
    assert len(pieces) >= 1
    assert (answer.prompt_tokens, answer.completion_tokens) == (
        expected.prompt_tokens, expected.completion_tokens
    )
    assert answer.finish_reason == expected.finish_reason
