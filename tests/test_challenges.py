"""User-shaped challenge requests (ps_p2p.verification.challenges, issue 18)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from ps_p2p.inference import ChatMessage, InferenceQuery, ReplyProxy
from ps_p2p.inference import SamplingParams as QueryParams
from ps_p2p.protocols.inference_codec import decode_query, encode_query
from ps_p2p.verification.challenges import (
    API_DEFAULT_MAX_TOKENS,
    DEFAULT_MIX,
    ChallengeRequest,
    decode_entry,
    derive_request,
    encode_entry,
    for_pool,
    history_share,
    request_problem,
    send_times,
)
from ps_p2p.verification.epochs import Challenge

NODE = b"\x00\x24" + bytes(36)
SECRET = hashlib.sha256(b"epoch secret").digest()
ENTRY = encode_entry("Why is the sky blue?", ("Hi there.", "Hello! How can I help?"))


def _requests(n: int) -> list[ChallengeRequest]:
    return [derive_request(hashlib.sha256(b"%d" % i).digest(), 7, 0, Challenge(NODE, i), ENTRY)
            for i in range(n)]


def _wire(request: ChallengeRequest, model_id: str = "m") -> InferenceQuery:
    """Q as a model node decodes it (through protobuf: float32 temperature and top_p)."""
    return decode_query(encode_query(InferenceQuery(
        b"r" * 16, model_id, request.prompt, request.params,
        tuple(ReplyProxy(bytes([i]) * 38, bytes(16)) for i in range(4)),
        stream=request.stream, messages=request.messages)))


def test_a_request_is_a_function_of_the_secret_and_the_challenge():
    secret = bytes(32)
    a = derive_request(secret, 1, 0, Challenge(NODE, 3), ENTRY)
    assert a == derive_request(secret, 1, 0, Challenge(NODE, 3), ENTRY)
    others = [derive_request(hashlib.sha256(b"%d" % i).digest(), 1, 0, Challenge(NODE, 3), ENTRY)
              for i in range(20)]
    assert len({(r.stream, r.params, r.messages, r.send_fraction) for r in others}) == 20


def test_requests_follow_the_users_mix_with_every_shape_and_temperature_up_to_two():
    rs = _requests(4000)
    chats = [r for r in rs if r.messages]
    share = len(chats) / len(rs)
    assert abs(share - DEFAULT_MIX.chat) < 0.03
    assert abs(sum(r.stream for r in chats) / len(chats) - DEFAULT_MIX.stream_chat) < 0.04
    assert abs(sum(r.messages[0].role == "system" for r in chats) / len(chats)
               - DEFAULT_MIX.system) < 0.04
    assert any(r.stream for r in rs if not r.messages)
    temps = [r.temperature for r in rs]
    assert max(temps) <= 2.0 and 0.03 < sum(t > 1 for t in temps) / len(temps) < 0.08
    assert 0.25 < sum(t == 0 for t in temps) / len(temps) < 0.55  # left out (API default) or 0
    assert abs(sum(r.max_tokens == API_DEFAULT_MAX_TOKENS for r in rs) / len(rs) - 0.40) < 0.04
    assert 0.07 < sum(r.seed is not None for r in rs) / len(rs) < 0.13
    assert 0.07 < sum(bool(r.stop) for r in rs) / len(rs) < 0.13
    fractions = sorted(r.send_fraction for r in rs)
    assert all(0 <= f < 1 for f in fractions) and 0.45 < fractions[len(rs) // 2] < 0.55


def test_every_request_asks_the_entrys_prompt_and_chats_may_carry_its_earlier_exchange():
    rs = _requests(300)
    assert {r.text for r in rs} == {"Why is the sky blue?"}
    assert all(r.prompt == "" for r in rs if r.messages)
    multi = [r for r in rs if any(m.role == "assistant" for m in r.messages)]
    assert multi and all(m.messages[-3:-1] == (ChatMessage("user", "Hi there."), ChatMessage(
        "assistant", "Hello! How can I help?")) for m in multi)
    plain = derive_request(bytes(32), 1, 0, Challenge(NODE, 0), "Tell me a joke.")
    assert plain.text == "Tell me a joke."


@pytest.mark.parametrize("change, reason", [
    (lambda q: dataclasses.replace(q, prompt=q.prompt + "!", messages=q.messages[:-1] + (
        ChatMessage("user", "Other?"),) if q.messages else ()), "planned prompt"),
    (lambda q: dataclasses.replace(q, model_id="other"), "asks model 'other'"),
    (lambda q: dataclasses.replace(q, params=dataclasses.replace(
        q.params, max_tokens=q.params.max_tokens + 1)), "sampling parameters"),
    (lambda q: dataclasses.replace(q, params=dataclasses.replace(
        q.params, temperature=q.params.temperature + 0.1)), "sampling parameters"),
    (lambda q: dataclasses.replace(q, params=dataclasses.replace(
        q.params, seed=(q.params.seed or 0) + 1)), "sampling parameters"),
    (lambda q: dataclasses.replace(q, params=dataclasses.replace(
        q.params, stop=(*q.params.stop, "END"))), "sampling parameters"),
    (lambda q: dataclasses.replace(q, stream=not q.stream), "not streamed as planned"),
], ids=["prompt", "model", "max-tokens", "temperature", "seed", "stop", "stream"])
def test_a_request_that_is_not_the_derived_one_is_named(change, reason):
    for r in _requests(40):
        q = _wire(r)
        assert request_problem(q, r, "m") is None  # float32 on the wire passes
        got = request_problem(change(q), r, "m")
        assert got is not None and reason in got


def test_pool_entries_round_trip_and_other_text_is_a_prompt():
    assert decode_entry(ENTRY) == ("Why is the sky blue?", ("Hi there.", "Hello! How can I help?"))
    assert decode_entry(encode_entry("Just this")) == ("Just this", None)
    assert decode_entry('{"not": "an entry"}') == ('{"not": "an entry"}', None)
    with pytest.raises(ValueError):
        encode_entry("  ")
    with pytest.raises(ValueError):
        encode_entry("x", ("only one",))


def test_a_request_sent_with_seed_0_is_not_the_derived_unseeded_one():
    # seed 0 is a seed (issue 21): a leader that sends it where the derivation left the seed
    # out sends another request than planned, and the reverse
    for r in _requests(40):
        q = _wire(r)
        other = 0 if r.seed is None else None
        got = request_problem(dataclasses.replace(q, params=dataclasses.replace(
            q.params, seed=other)), r, "m")
        assert got is not None and "sampling parameters" in got


def test_send_times_spread_the_fractions_over_the_window():
    assert send_times([0.0, 0.5, 0.99], 100.0) == [0.0, 50.0, 99.0]
    assert send_times([0.5], -3.0) == [0.0]


def test_the_request_keeps_the_api_defaults_a_client_leaves_out():
    r = next(r for r in _requests(400) if r.max_tokens == API_DEFAULT_MAX_TOKENS
             and r.top_p == 1.0 and r.seed is None and not r.stop)
    assert r.params == QueryParams(max_tokens=API_DEFAULT_MAX_TOKENS,
                                   temperature=r.temperature)


def test_a_pool_entry_carries_a_conversation_of_any_depth_into_its_chat_challenge():
    # users chat in sessions: a challenge never deeper than one earlier exchange was told apart
    # by its message count alone (issue 18, bench_challenge_privacy --users sessions)
    history = ("first question", "first answer", "second question", "second answer")
    entry = encode_entry("third question", history)
    assert decode_entry(entry) == ("third question", history)
    always = dataclasses.replace(DEFAULT_MIX, chat=1.0, multi_turn=1.0, system=0.0)
    req = derive_request(SECRET, 1, 0, Challenge(NODE, 0), entry, always)
    assert [(m.role, m.content) for m in req.messages] == [
        ("user", "first question"), ("assistant", "first answer"),
        ("user", "second question"), ("assistant", "second answer"),
        ("user", "third question")]
    with pytest.raises(ValueError):
        encode_entry("q", ("a user turn", "an answer", "a user turn without its answer"))


def test_chat_challenges_carry_history_as_often_as_the_mix_says_whatever_the_pool_share():
    # a pool where a third of the entries have history: for_pool scales the chance so that the
    # mix's share of chats with history is what challenges get
    pool = [encode_entry(f"q{i}", ("u", "a")) if i % 3 == 0 else f"q{i}" for i in range(300)]
    assert history_share(pool) == pytest.approx(1 / 3)
    mix = for_pool(dataclasses.replace(DEFAULT_MIX, chat=1.0, multi_turn=0.3), 1 / 3)
    with_history = sum(
        len(derive_request(SECRET, 1, 0, Challenge(NODE, i), entry, mix).messages) > 2
        for i, entry in enumerate(pool))
    assert with_history / len(pool) == pytest.approx(0.3, abs=0.07)
    assert for_pool(DEFAULT_MIX, 1.0) is DEFAULT_MIX
