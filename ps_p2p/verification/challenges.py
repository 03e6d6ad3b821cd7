"""What a planned challenge sends: a request shaped like users' requests, at a time like theirs;
pure (issue 18; PlanetServe sec. 3.4, "challenge prompts that look exactly like user requests").

A plan (:mod:`~ps_p2p.verification.epochs`) names, per challenge, a model node and a pool
entry. This module turns that into the request the leader sends through its user role, with
every field a user's request has: the endpoint's shape (chat ``messages`` with or without a
system prompt and an earlier exchange, or a plain ``prompt``), ``stream``, ``max_tokens``,
``temperature`` (up to 2, as the API allows), ``top_p``, ``seed``, ``stop``, and the moment in
the epoch it is sent. Each field is drawn from :data:`DEFAULT_MIX`, the documented
distribution of what OpenAI-API clients send (its docstring gives the shares), so a challenge
is a sample of user traffic, not a fixed menu entry.

The draws are deterministic::

    key_k  = SHA-256(SHAPE_DOMAIN || bytes(secret) || u64(epoch) || u32(attempt)
                     || bytes(model node) || u32(prompt index) || u64(k)),  k = 0, 1, ...

each digest giving four u64 words used in order (``below(n)`` by rejection, as the plan's
draws; ``unit()`` = the top 53 bits / 2**53). ``secret`` is the leader's epoch secret: only
the leader knows it until its report reveals it, so no model node can compute a challenge's
shape before it is sent (nor tell it from a user's request by re-deriving it), and after the
reveal every verifier re-derives the very request from the report alone
(:func:`request_problem`) and scores under its parameters: the leader chooses nothing.

Pool entries (:func:`encode_entry`, :func:`decode_entry`) are a prompt, or a JSON object
``{"prompt": ..., "earlier": [user turn, assistant turn, user turn, ...]}`` for a conversation
with earlier exchanges (any number of them), so chat challenges carry multi-turn history as
deep as users' chats do: a challenge that never had more than one earlier exchange was told
apart by its message count alone wherever users chat in sessions (issue 18). How often a chat
challenge carries its entry's history is the mix's share of chats with one, divided by the
pool's share of entries that have one (:func:`for_pool`): the pool decides the depths, the mix
the share.

Send times: ``send_fraction`` is uniform in [0, 1); the leader sends the challenge at that
fraction of its sending window (:func:`send_times`), so the challenges of an epoch arrive as
the points of a Poisson process conditioned on their number: what homogeneous user traffic
looks like over one epoch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ps_p2p.consensus.encoding import lp, u32, u64
from ps_p2p.inference import ChatMessage, InferenceQuery, SamplingParams
from ps_p2p.verification.epochs import Challenge, CounterDraws

SHAPE_DOMAIN = b"planetserve/v1/challenge-shape\x00"
#: The API's default max_tokens (``ps_p2p.api.openai_compat.DEFAULT_MAX_TOKENS``).
API_DEFAULT_MAX_TOKENS = 128
#: Largest temperature the API accepts (OpenAI's range).
MAX_TEMPERATURE = 2.0
#: protobuf carries temperature and top_p as float32.
FLOAT32_SLACK = 1e-6


@dataclass(frozen=True)
class ChallengeMix:
    """A distribution of request shapes: each table lists (value, weight) pairs; the value
    ``None`` means "the client leaves the field out" (the API's default applies: T 0, top_p 1,
    max_tokens 128, no seed, no stop), ``"uniform"`` a temperature uniform in [0, 2] to two
    decimals, ``"random"`` a seed uniform in [0, 2**31), ``("range", lo, hi)`` (a learned
    mix's bucket, :mod:`~ps_p2p.verification.mix`) a temperature or top_p uniform in [lo, hi]
    to two decimals, or a max_tokens uniform among the integers of [lo, hi].

    :data:`DEFAULT_MIX` is this project's model of OpenAI-compatible clients (chat SDK
    examples, chat front-ends, LangChain and LlamaIndex agents, evaluation harnesses): 85% chat
    completions, half of them streamed, 20% of completions streamed; half of the chats with a
    system prompt, 40% of those with an earlier exchange carrying it; temperature left out by
    30%, 0.7 (LangChain's default) by 22%, 0 by 15%, 1.0 by 10%, above 1 by 5%; max_tokens left
    out by 35%, else 64 to 2048; a seed in 12%, stop strings in 10%. The shares are the same as
    the benchmark's user model (``ps_p2p.testing.api_traffic.USER_MIX``); a network whose
    users differ learns its own (:mod:`~ps_p2p.verification.mix`: each epoch's committed mix,
    starting from this one; docs/verification.md).
    """

    chat: float = 0.85
    stream_chat: float = 0.5
    stream_completion: float = 0.2
    system: float = 0.5
    #: share of chats carrying earlier exchanges; :func:`derive_request` reads it as the
    #: chance that a chat carries its entry's history (:func:`for_pool` converts one to the
    #: other for a pool where not every entry has history)
    multi_turn: float = 0.4
    temperature: tuple[tuple[Any, float], ...] = (
        (None, 0.30), (0.0, 0.15), (0.1, 0.03), (0.2, 0.04), (0.5, 0.05), (0.7, 0.22),
        (0.8, 0.04), (1.0, 0.10), (1.2, 0.02), (1.5, 0.02), (2.0, 0.01), ("uniform", 0.02),
    )
    top_p: tuple[tuple[Any, float], ...] = ((None, 0.85), (0.9, 0.05), (0.95, 0.05), (1.0, 0.05))
    max_tokens: tuple[tuple[Any, float], ...] = (
        (None, 0.35), (64, 0.05), (100, 0.05), (128, 0.05), (256, 0.15), (512, 0.15),
        (1000, 0.05), (1024, 0.10), (2048, 0.05),
    )
    seed: tuple[tuple[Any, float], ...] = ((None, 0.90), (42, 0.03), ("random", 0.07))
    stop: tuple[tuple[Any, float], ...] = ((None, 0.90), ("one", 0.06), ("list", 0.04))
    system_prompts: tuple[str, ...] = (
        "You are a helpful assistant.",
        "You are a helpful, respectful and honest assistant.",
        "You are ChatGPT, a large language model. Answer as concisely as possible.",
        "You are an expert software engineer. Answer with code when useful.",
        "You are a friendly assistant that writes short stories for children.",
        "Answer the user's question using the context provided.",
    )
    stops: tuple[str, ...] = ("\n\n", "###", "</s>", "User:", "\nHuman:", "<|im_end|>",
                              "Observation:")


DEFAULT_MIX = ChallengeMix()


@dataclass(frozen=True)
class ChallengeRequest:
    """The request one challenge sends (module docstring), and so what its answer is scored
    under: ``params`` (temperature, top_p, max_tokens, seed, stop) are the sampling parameters
    the model node was asked for (also as properties ``temperature``, ``top_p``,
    ``max_tokens``, ``seed``, ``stop``: a :class:`~ps_p2p.verification.ledger.SamplingOption`'s
    names, which scoring reads).

    Attributes:
        prompt: the prompt of a completion ("" for a chat).
        messages: the chat ( () for a completion); its last message is the user's.
        params: the sampling parameters sent.
        stream: the answer is streamed (the verifier asks with ``on_text``).
        send_fraction: when to send, as a fraction in [0, 1) of the leader's sending window.
    """

    prompt: str
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    stream: bool
    send_fraction: float

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def top_p(self) -> float:
        return self.params.top_p

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.params.stop)

    @property
    def text(self) -> str:
        """The prompt text the entry gave: the prompt, or the chat's last user message."""
        return self.messages[-1].content if self.messages else self.prompt

    def ask_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`~ps_p2p.roles.user.UserClient.ask` (without
        ``on_text``: a streamed request passes one)."""
        p = self.params
        return {"prompt": self.prompt, "messages": self.messages, "max_tokens": p.max_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
                "stop": p.stop}


def _is_history(earlier: object) -> bool:
    return (isinstance(earlier, (list, tuple)) and len(earlier) >= 2 and len(earlier) % 2 == 0
            and all(isinstance(t, str) and t.strip() for t in earlier))


def encode_entry(prompt: str, earlier: Sequence[str] | None = None) -> str:
    """A pool entry: ``prompt`` alone, or with the conversation before it: ``earlier`` =
    (user turn, assistant turn, user turn, assistant turn, ...), one or more exchanges.

    Raises:
        ValueError: a blank prompt, or ``earlier`` not an even number (>= 2) of non-blank
            strings.
    """
    if not prompt.strip():
        raise ValueError("a pool entry needs a non-blank prompt")
    if earlier is None:
        return prompt
    if not _is_history(earlier):
        raise ValueError("earlier must be (user turn, assistant turn) pairs, at least one")
    return json.dumps({"prompt": prompt, "earlier": list(earlier)}, ensure_ascii=False)


def decode_entry(entry: str) -> tuple[str, tuple[str, ...] | None]:
    """(prompt, earlier exchanges as (user, assistant, user, ...) or None) of a pool entry
    (:func:`encode_entry`); an entry that is not such a JSON object is a prompt."""
    if entry.startswith("{"):
        try:
            data = json.loads(entry)
        except ValueError:
            return entry, None
        if isinstance(data, dict) and isinstance(data.get("prompt"), str):
            earlier = data.get("earlier")
            if _is_history(earlier):
                return data["prompt"], tuple(earlier)
            return data["prompt"], None
    return entry, None


def history_share(pool: Sequence[str]) -> float:
    """Share of ``pool``'s entries that carry earlier exchanges, in [0, 1] (0 for an empty
    pool)."""
    if not pool:
        return 0.0
    return sum(decode_entry(e)[1] is not None for e in pool) / len(pool)


def for_pool(mix: ChallengeMix, share: float) -> ChallengeMix:
    """``mix`` for a pool whose entries carry history in ``share`` of cases: a chat carries
    its entry's history with probability ``mix.multi_turn / share`` (at most 1), so that
    ``mix.multi_turn`` of chat challenges carry one, as that share of users' chats do (as far
    as the pool allows); ``mix`` itself when ``share`` is 0 or 1."""
    if share <= 0.0 or share >= 1.0:
        return mix
    return dataclasses.replace(mix, multi_turn=min(1.0, mix.multi_turn / share))


class _Draws(CounterDraws):
    """The challenges' draws (module docstring): :class:`~ps_p2p.verification.epochs.CounterDraws`
    with floats and weighted picks."""

    def unit(self) -> float:
        return (self.word() >> 11) / 2**53

    def chance(self, p: float) -> bool:
        return self.unit() < p

    def pick(self, table: Sequence[tuple[Any, float]]) -> Any:
        r = self.unit() * sum(w for _, w in table)
        for value, w in table:
            r -= w
            if r < 0:
                return value
        return table[-1][0]


def derive_request(secret: bytes, epoch: int, attempt: int, challenge: Challenge, entry: str,
                   mix: ChallengeMix = DEFAULT_MIX) -> ChallengeRequest:
    """The request of ``challenge`` (module docstring); pure and deterministic.

    Args:
        secret: the leader's epoch secret (32 bytes; revealed in its report).
        epoch, attempt: the epoch and the leader's attempt.
        challenge: the planned challenge.
        entry: its pool entry (:func:`decode_entry`).
        mix: the distribution of shapes.

    Returns:
        The request; its prompt text (the chat's last user message, or the prompt) is the
        entry's prompt.
    """
    key = (SHAPE_DOMAIN + lp(bytes(secret)) + u64(epoch) + u32(attempt)
           + lp(bytes(challenge.model_node)) + u32(challenge.prompt_index))
    d = _Draws(key)
    prompt, earlier = decode_entry(entry)
    chat = d.chance(mix.chat)
    system = d.chance(mix.system)
    system_text = mix.system_prompts[d.below(len(mix.system_prompts))]
    multi = d.chance(mix.multi_turn)
    stream = d.chance(mix.stream_chat if chat else mix.stream_completion)
    t = d.pick(mix.temperature)
    u = d.unit()
    temperature = 0.0 if t is None or isinstance(t, tuple) \
        else round(u * MAX_TEMPERATURE, 2) if t == "uniform" else float(t)
    tp = d.pick(mix.top_p)
    mt = d.pick(mix.max_tokens)
    s = d.pick(mix.seed)
    seed_draw = d.below(2**31)
    # None: unseeded, as the API; an int: that seed; "random": the draw
    seed = None if s is None else s if isinstance(s, int) else seed_draw
    st = d.pick(mix.stop)
    stop_one = mix.stops[d.below(len(mix.stops))]
    count = 2 + d.below(3)
    order = list(mix.stops)
    for i in range(len(order) - 1):  # Fisher-Yates from the draws
        j = i + d.below(len(order) - i)
        order[i], order[j] = order[j], order[i]
    stop: tuple[str, ...] = () if st is None else (stop_one,) if st == "one" \
        else tuple(order[:count])
    send_fraction = d.unit()
    # drawn last, so a mix without range buckets derives what it did before they existed
    u_top, u_max = d.unit(), d.unit()
    if isinstance(t, tuple):  # ("range", lo, hi): a learned mix's bucket (verification.mix)
        temperature = round(t[1] + u * (t[2] - t[1]), 2)
    top_p = 1.0 if tp is None else round(tp[1] + u_top * (tp[2] - tp[1]), 2) \
        if isinstance(tp, tuple) else float(tp)
    max_tokens = API_DEFAULT_MAX_TOKENS if mt is None \
        else mt[1] + min(int(u_max * (mt[2] - mt[1] + 1)), mt[2] - mt[1]) \
        if isinstance(mt, tuple) else int(mt)
    messages: tuple[ChatMessage, ...] = ()
    if chat:
        turns = [ChatMessage("system", system_text)] if system else []
        if multi and earlier is not None:
            turns += [ChatMessage("user" if i % 2 == 0 else "assistant", text)
                      for i, text in enumerate(earlier)]
        messages = (*turns, ChatMessage("user", prompt))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop=stop)
    return ChallengeRequest("" if chat else prompt, messages, params, stream, send_fraction)


def request_problem(query: InferenceQuery, expected: ChallengeRequest, model_id: str) -> str | None:
    """Why the request a report carries is not the derived one (None when it is): the verifier's
    check that the leader sent exactly the planned request, whatever its shape."""
    if query.prompt != expected.prompt or tuple(query.messages) != tuple(expected.messages):
        return "the request does not ask the planned prompt"
    if query.model_id != model_id:
        return f"the request asks model {query.model_id!r}"
    p, e = query.params, expected.params
    if (p.max_tokens != e.max_tokens or p.seed != e.seed or tuple(p.stop) != tuple(e.stop)
            or abs(p.temperature - e.temperature) > FLOAT32_SLACK
            or abs(p.top_p - e.top_p) > FLOAT32_SLACK):
        return "the request's sampling parameters are not the planned ones"
    if bool(query.stream) != expected.stream:
        return "the request is not streamed as planned"
    return None


def send_times(fractions: Sequence[float], window_s: float) -> list[float]:
    """Seconds after the epoch's start at which to send challenges with these
    ``send_fraction`` values, in a window of ``window_s`` (>= 0) seconds."""
    return [max(0.0, window_s) * f for f in fractions]


__all__ = [
    "DEFAULT_MIX",
    "SHAPE_DOMAIN",
    "ChallengeMix",
    "ChallengeRequest",
    "decode_entry",
    "derive_request",
    "encode_entry",
    "for_pool",
    "history_share",
    "request_problem",
    "send_times",
]
