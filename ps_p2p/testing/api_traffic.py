"""A model of what OpenAI-API clients send, and the bytes a model node decodes from it (issue 18).

TEST ONLY: the user side of ``benchmarks/bench_challenge_privacy.py``.

* :func:`user_body` draws one request body of ``POST /v1/chat/completions`` or
  ``POST /v1/completions`` as clients send them (:data:`USER_MIX`, documented there);
* :func:`api_asks` runs bodies through the real local API (:class:`~ps_p2p.api.openai_compat.
  UserAPI`'s validation, defaults and ``n`` handling) and records the
  :meth:`~ps_p2p.roles.user.UserClient.ask` calls it makes;
* :func:`query_of_ask` turns one ``ask`` call into Q the way the user client does
  (``UserClient._ask``'s :class:`~ps_p2p.overlay.requests.RequestSpec`, then the real
  :class:`~ps_p2p.overlay.requests.RequestCore` with the protobuf codec and S-IDA), and decodes
  it from the cloves as the model node does: the exact bytes and fields a model node sees.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ps_p2p.crypto import sida
from ps_p2p.errors import RequestError, RequestTooLargeError
from ps_p2p.inference import InferenceQuery, SamplingParams
from ps_p2p.overlay.requests import (
    Outcome,
    RequestConfig,
    RequestCore,
    RequestSpec,
    SendClove,
)
from ps_p2p.protocols.inference_codec import decode_query

#: System prompts clients commonly send (SDK examples, chat front-ends, agent frameworks).
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful, respectful and honest assistant.",
    "You are ChatGPT, a large language model. Answer as concisely as possible.",
    "You are an expert software engineer. Answer with code when useful.",
    "You are a friendly assistant that writes short stories for children.",
    "Answer the user's question using the context provided.",
)
#: Stop sequences clients commonly send.
STOPS = ("\n\n", "###", "</s>", "User:", "\nHuman:", "<|im_end|>", "Observation:")


def _pick(rng: random.Random, table: Sequence[tuple[Any, float]]) -> Any:
    r = rng.random() * sum(w for _, w in table)
    for value, w in table:
        r -= w
        if r < 0:
            return value
    return table[-1][0]


@dataclass(frozen=True)
class TrafficMix:
    """Shares of request shapes (each a probability or a weighted table; ``None`` in a table:
    the field is left out of the body, so the API's default applies; ``"null"``: sent as JSON
    null).

    The default, :data:`USER_MIX`, is this project's model of OpenAI-compatible clients: chat
    completions dominate (SDK examples, chat front-ends, LangChain/LlamaIndex agents), half of
    them streamed by chat UIs; about half set a system prompt; a fifth carry an earlier turn;
    temperature is most often left out or set to 0.7 (LangChain's default) or 0 (tools,
    evaluation), rarely above 1 (up to 2, the API's maximum); max_tokens is left out by a third
    (the API's default 128 applies) and otherwise a power of two; seeds and stops are rare.
    """

    chat: float = 0.85
    stream_chat: float = 0.5
    stream_completion: float = 0.2
    system: float = 0.5
    multi_turn: float = 0.2
    temperature: tuple[tuple[Any, float], ...] = (
        (None, 0.30), (0.0, 0.15), (0.1, 0.03), (0.2, 0.04), (0.5, 0.05), (0.7, 0.22),
        (0.8, 0.04), (1.0, 0.10), (1.2, 0.02), (1.5, 0.02), (2.0, 0.01), ("uniform", 0.02),
    )
    top_p: tuple[tuple[Any, float], ...] = ((None, 0.85), (0.9, 0.05), (0.95, 0.05), (1.0, 0.05))
    max_tokens: tuple[tuple[Any, float], ...] = (
        (None, 0.33), ("null", 0.02), (64, 0.05), (100, 0.05), (128, 0.05), (256, 0.15),
        (512, 0.15), (1000, 0.05), (1024, 0.10), (2048, 0.05),
    )
    seed: tuple[tuple[Any, float], ...] = ((None, 0.88), ("null", 0.02), (42, 0.03),
                                           ("random", 0.07))
    stop: tuple[tuple[Any, float], ...] = ((None, 0.86), ("null", 0.04), ("one", 0.06),
                                           ("list", 0.04))
    n: tuple[tuple[int, float], ...] = ((1, 0.97), (2, 0.02), (3, 0.01))
    include_usage: float = 0.3


USER_MIX = TrafficMix()

#: Another population (issue 18's "users who differ from DEFAULT_MIX"): a coding-assistant
#: deployment whose IDE plugins stream chats with a system prompt and history, ask low
#: temperatures, long answers, fixed seeds and stop lists. Every field's distribution differs
#: from :data:`USER_MIX` (and from the challenges' ``DEFAULT_MIX``).
SHIFTED_MIX = TrafficMix(
    chat=0.6, stream_chat=0.9, stream_completion=0.6, system=0.9, multi_turn=0.35,
    temperature=((None, 0.10), (0.0, 0.25), (0.2, 0.30), (0.3, 0.10), (1.0, 0.15),
                 ("uniform", 0.10)),
    top_p=((None, 0.6), (0.95, 0.3), (0.8, 0.1)),
    max_tokens=((None, 0.1), (300, 0.1), (512, 0.2), (1024, 0.3), (2000, 0.1), (4096, 0.2)),
    seed=((None, 0.6), (1234, 0.2), ("random", 0.2)),
    stop=((None, 0.6), ("one", 0.1), ("list", 0.3)),
    n=((1, 0.9), (2, 0.1)), include_usage=0.8)


@dataclass(frozen=True)
class Conversation:
    """What a user asks about: a prompt, and optionally an earlier exchange of the chat."""

    prompt: str
    earlier: tuple[str, str] | None = None  # (earlier user turn, assistant's answer)


def user_body(rng: random.Random, item: Conversation, *, model: str | None = None,
              mix: TrafficMix = USER_MIX) -> tuple[str, dict[str, Any]]:
    """One request body as a client sends it: (endpoint path, JSON body)."""
    chat = rng.random() < mix.chat
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if chat:
        messages = []
        if rng.random() < mix.system:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if item.earlier is not None and rng.random() < mix.multi_turn * 2:
            messages += [{"role": "user", "content": item.earlier[0]},
                         {"role": "assistant", "content": item.earlier[1]}]
        messages.append({"role": "user", "content": item.prompt})
        body["messages"] = messages
        stream = rng.random() < mix.stream_chat
    else:
        body["prompt"] = item.prompt
        stream = rng.random() < mix.stream_completion
    t = _pick(rng, mix.temperature)
    if t == "uniform":
        t = round(rng.uniform(0.0, 2.0), 2)
    if t is not None:
        body["temperature"] = t
    tp = _pick(rng, mix.top_p)
    if tp is not None:
        body["top_p"] = tp
    mt = _pick(rng, mix.max_tokens)
    if mt is not None:
        key = "max_completion_tokens" if chat and rng.random() < 0.3 else "max_tokens"
        body[key] = None if mt == "null" else mt
    seed = _pick(rng, mix.seed)
    if seed is not None:
        body["seed"] = None if seed == "null" else rng.randrange(2**31) if seed == "random" \
            else seed
    stop = _pick(rng, mix.stop)
    if stop is not None:
        body["stop"] = (None if stop == "null" else rng.choice(STOPS) if stop == "one"
                        else rng.sample(STOPS, rng.randint(2, 4)))
    n = 1 if stream else _pick(rng, mix.n)
    if n != 1:
        body["n"] = n
    if stream:
        body["stream"] = True
        if rng.random() < mix.include_usage:
            body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


# ---------------------------------------------------------------------- through the real API


class _Record:
    model_id = "stories260K"


class RecordingUser:
    """A stand-in for :class:`~ps_p2p.roles.user.UserClient` that records each ``ask`` call
    (keyword arguments, ``streamed`` True when ``on_text`` was given) and answers it with a
    failure (so nothing is generated)."""

    def __init__(self, model_id: str = "stories260K") -> None:
        self.model_id = model_id
        self.asks: list[dict[str, Any]] = []

    def model_nodes(self, model_id: str | None = None) -> list[Any]:
        record = _Record()
        record.model_id = self.model_id
        return [record]

    async def wait_ready(self, count: int = 1, timeout: float | None = None) -> None:
        return None

    async def ask(self, prompt: str = "", **kwargs: Any) -> Any:
        from ps_p2p.roles.user import answer_from_outcome

        on_text = kwargs.pop("on_text", None)
        self.asks.append({"prompt": prompt, **kwargs, "streamed": on_text is not None})
        return answer_from_outcome(Outcome(b"\0" * 16, None, RequestError("recorded"), 0, 0, 0.0))


class _Node:
    def __init__(self, user: RecordingUser) -> None:
        self.user = user


def api_asks(requests: Sequence[tuple[str, dict[str, Any]]],
             model_id: str = "stories260K") -> list[list[dict[str, Any]]]:
    """The ``ask`` calls the local API makes for each (path, body): one per choice (``n``);
    an empty list for a body the API refuses."""
    from pydantic import ValidationError

    from ps_p2p.api.openai_compat import ApiError, ChatBody, CompletionBody, UserAPI

    user = RecordingUser(model_id)
    api = UserAPI(_Node(user))
    out: list[list[dict[str, Any]]] = []

    async def one(path: str, body: dict[str, Any]) -> None:
        before = len(user.asks)
        try:
            if path.endswith("/chat/completions"):
                b = ChatBody.model_validate(body)
                resp = await api._generate(b, messages=b.chat(), chat=True,
                                           max_tokens=b.max_completion_tokens or b.max_tokens)
            else:
                b = CompletionBody.model_validate(body)
                resp = await api._generate(b, prompt=b.prompt_text(), chat=False,
                                           max_tokens=b.max_tokens)
            stream_ask = getattr(resp, "ask", None)
            if stream_ask is not None:  # a stream asks once its response is sent
                await stream_ask.one(0, on_text=lambda text: None)
        except (ApiError, ValidationError):  # the API answers 400: nothing is asked
            pass
        out.append(user.asks[before:])

    async def main() -> None:
        for path, body in requests:
            await one(path, body)

    trio.run(main)
    return out


def query_of_ask(ask: dict[str, Any], rng: random.Random,
                 model_id: str = "stories260K",
                 proxies: Sequence[bytes] | None = None) -> tuple[InferenceQuery, bytes]:
    """Q as the model node decodes it from the cloves of one ``ask`` call (module docstring).

    ``ask`` holds :meth:`~ps_p2p.roles.user.UserClient.ask`'s keyword arguments (and
    ``streamed``); ``proxies``: the proxies of the client's ready paths (the request core picks
    distinct ones among them, as a client does), else four fresh random ones.

    Raises:
        RequestTooLargeError: Q does not fit a cell (the user client refuses it).
    """
    from ps_p2p.roles.user import ProtobufCodec

    destination = rng.randbytes(38)
    spec = RequestSpec(
        request_id=rng.randbytes(16), destination=destination,
        model_id=ask.get("model_id") or model_id, prompt=ask.get("prompt", ""),
        params=SamplingParams(
            max_tokens=ask.get("max_tokens", 128), temperature=ask.get("temperature", 0.0),
            top_p=ask.get("top_p", 1.0), seed=ask.get("seed"),
            stop=tuple(ask.get("stop", ()))),
        timeout=60.0, stream=bool(ask.get("streamed")),
        messages=tuple(ask.get("messages", ())),
        switch_model_node=ask.get("model_node") is None,
    )
    core = RequestCore(RequestConfig(), ProtobufCodec(), lambda peer: peer == destination,
                       rng=random.Random(rng.random()), random_bytes=rng.randbytes)

    @dataclass(frozen=True)
    class _Path:
        path_id: int
        proxy: bytes

    paths = ([_Path(i, p) for i, p in enumerate(proxies)] if proxies is not None
             else [_Path(i, rng.randbytes(38)) for i in range(RequestConfig().total)])
    commands = core.start(spec, 0.0, paths)
    cloves = [c.clove for c in commands if isinstance(c, SendClove)]
    if not cloves:  # the request core refused it (over a cell): the API answers an error
        raise RequestTooLargeError("the request core sent nothing for this request")
    q_bytes = sida.decode(cloves)
    return decode_query(q_bytes), q_bytes


def poisson_times(rng: random.Random, rate_per_s: float, length_s: float) -> list[float]:
    """Arrival times of a Poisson process of ``rate_per_s`` over [0, ``length_s``), sorted."""
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s) if rate_per_s > 0 else math.inf
        if t >= length_s:
            return times
        times.append(t)


__all__ = [
    "SHIFTED_MIX",
    "USER_MIX",
    "Conversation",
    "RecordingUser",
    "TrafficMix",
    "api_asks",
    "poisson_times",
    "query_of_ask",
    "user_body",
]
