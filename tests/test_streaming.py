"""Streaming through the anonymous overlay (docs/streaming.md): segments, stop strings, chats.

Service tests run a whole local network of real py-libp2p hosts (ps_p2p.testing.localnet)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

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
