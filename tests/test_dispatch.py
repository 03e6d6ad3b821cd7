"""The model node's dispatch core (ps_p2p.serving.dispatch.Dispatcher) on injected time."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

from ps_p2p.crypto import sida
from ps_p2p.inference import ChatMessage, InferenceQuery, ReplyProxy, ResponseStatus, SamplingParams
from ps_p2p.protocols.inference_codec import decode_query, encode_query
from ps_p2p.responses import ResponseContent
from ps_p2p.serving.dispatch import DispatchConfig, Dispatcher, SendAnswer, StartJob

PROXIES = [bytes([i]) * 38 for i in range(1, 5)]
OK = ResponseContent(ResponseStatus.OK, "answer", "", "m", 3, 5)


def _query(prompt="hello", request_id=None, tag=b"a", **params) -> InferenceQuery:
    return InferenceQuery(
        request_id=request_id or os.urandom(16),
        model_id="m",
        prompt=prompt,
        params=SamplingParams(max_tokens=16, **params),
        reply_proxies=tuple(ReplyProxy(p, tag * 16) for p in PROXIES),
    )


def _deliver(d: Dispatcher, query: InferenceQuery, now=0.0, senders=PROXIES):
    out = []
    for sender, clove in zip(senders, sida.encode(encode_query(query), total=4, threshold=3)):
        out += d.receive_clove(sender, clove, now)
    return out


def _dispatcher(**config) -> Dispatcher:
    return Dispatcher("m", decode_query, DispatchConfig(**config))


def test_a_request_becomes_one_job_and_every_sending_gets_its_answer():
    d = _dispatcher()
    q = _query()
    (start,) = _deliver(d, q)
    assert isinstance(start, StartJob) and start.query == q
    resend = dataclasses.replace(q, reply_proxies=tuple(ReplyProxy(p, b"b" * 16) for p in PROXIES))
    assert _deliver(d, resend, now=1.0) == []  # joins the job in service
    d.job_started(start.key, now=1.0)
    answers = d.job_finished(start.key, OK, now=2.0)
    assert [a.waiter.query for a in answers] == [q, resend]
    assert all(isinstance(a, SendAnswer) and a.content == OK for a in answers)
    third = dataclasses.replace(q, reply_proxies=tuple(ReplyProxy(p, b"c" * 16) for p in PROXIES))
    (cached,) = _deliver(d, third, now=3.0)  # from the answer cache: no second job
    assert isinstance(cached, SendAnswer) and cached.content == OK
    assert d.load.served == 1 and d.load.latency_ewma == pytest.approx(1.0)
    assert d.requests == {"admitted": 1, "joined": 1, "cached": 1}


def test_the_same_request_id_with_another_prompt_is_another_request():
    d = _dispatcher()
    q = _query("one")
    (start,) = _deliver(d, q)
    (other,) = _deliver(d, dataclasses.replace(_query("two"), request_id=q.request_id))
    assert isinstance(other, StartJob) and other.key != start.key


@pytest.mark.parametrize(
    "changes, status",
    [
        (dict(temperature=math.inf), ResponseStatus.BAD_REQUEST),
        (dict(temperature=math.nan), ResponseStatus.BAD_REQUEST),
        (dict(temperature=-1.0), ResponseStatus.BAD_REQUEST),
        (dict(top_p=1.5), ResponseStatus.BAD_REQUEST),
        (dict(max_tokens=100_000), ResponseStatus.BAD_REQUEST),
    ],
)
def test_bad_sampling_parameters_are_answered_at_once_without_a_job(changes, status):
    d = _dispatcher()
    q = _query()
    q = dataclasses.replace(q, params=dataclasses.replace(q.params, **changes))
    (answer,) = _deliver(d, q)
    assert isinstance(answer, SendAnswer) and answer.content.status == status
    assert d.load.queued == 0 and d.requests == {"invalid": 1}


def test_a_request_for_another_model_is_answered_wrong_model():
    d = _dispatcher()
    (answer,) = _deliver(d, dataclasses.replace(_query(), model_id="other"))
    assert answer.content.status == ResponseStatus.WRONG_MODEL


def test_past_capacity_and_queue_the_answer_is_overloaded():
    d = _dispatcher(capacity=1, max_queue=0)
    (first,) = _deliver(d, _query("one"))
    assert isinstance(first, StartJob)
    (second,) = _deliver(d, _query("two"))
    assert isinstance(second, SendAnswer) and second.content.status == ResponseStatus.OVERLOADED
    assert d.requests == {"admitted": 1, "overloaded": 1}


@pytest.mark.parametrize(
    "senders, threshold, decoded, dropped",
    [
        (PROXIES[:3], 3, True, {}),
        # one proxy, three cloves: only its first counts
        ([PROXIES[0]] * 3, 3, False, {"duplicate_proxy": 2}),
    ],
)
def test_a_proxy_counts_once_per_request(senders, threshold, decoded, dropped):
    d = _dispatcher()
    cloves = sida.encode(encode_query(_query()), total=4, threshold=threshold)
    out = []
    for sender, clove in zip(senders, cloves):
        out += d.receive_clove(sender, clove, 0.0)
    assert bool(out) is decoded
    assert d.dropped_by == dropped


def test_cloves_with_threshold_one_are_dropped():
    d = _dispatcher()
    (clove,) = sida.encode(encode_query(_query()), total=1, threshold=1)
    assert d.receive_clove(PROXIES[0], clove, 0.0) == [] and d.dropped_cloves == 1
    assert d.dropped_by == {"low_threshold": 1}


def test_one_proxy_cannot_pin_more_than_its_share_of_incomplete_requests():
    # Before: 54 sybil identities pinned 110,592 cloves with no byte cap.
    d = _dispatcher(max_cloves_per_proxy=16)
    sybil = b"\x77" * 38
    for i in range(16 + 5):
        (clove, *_) = sida.encode(b"never completes", total=4, threshold=3,
                                  message_id=i.to_bytes(16, "big"))
        d.receive_clove(sybil, clove, 0.0)
    assert d.per_proxy[sybil] == 16 and d.dropped_by == {"proxy_share": 5}
    assert d.assembler.pending == 16
    # honest proxies are unaffected
    assert isinstance(_deliver(d, _query())[0], StartJob)


def test_incomplete_requests_expire_at_the_announced_deadline_and_free_their_proxies():
    d = _dispatcher(reassembly_ttl=10.0)
    cloves = sida.encode(encode_query(_query()), total=4, threshold=3)
    d.receive_clove(PROXIES[0], cloves[0], now=1.0)
    assert d.per_proxy == {PROXIES[0]: 1}
    assert d.next_deadline() == 11.0
    d.tick(10.9)
    assert d.assembler.pending == 1
    d.tick(11.0)
    assert d.assembler.pending == 0 and d.per_proxy == {} and d.next_deadline() is None
    assert d.requests == {"expired": 1}


def test_cached_answers_expire_after_their_ttl():
    d = _dispatcher(cache_ttl=5.0)
    q = _query()
    (start,) = _deliver(d, q)
    d.job_started(start.key, 0.0)
    d.job_finished(start.key, OK, now=1.0)
    assert d.next_deadline() == 6.0
    d.tick(6.0)
    again = dataclasses.replace(q, reply_proxies=tuple(ReplyProxy(p, b"z" * 16) for p in PROXIES))
    assert isinstance(_deliver(d, again, now=7.0)[0], StartJob)


# ------------------------------------------------------------------ streamed answers


def _streamed(prompt="hello", tag=b"a", **params) -> InferenceQuery:
    return dataclasses.replace(_query(prompt, tag=tag, **params), stream=True)


def test_streamed_text_goes_out_as_numbered_segments_and_the_answer_follows_them():
    from ps_p2p.serving.dispatch import SendSegment

    d = _dispatcher()
    q = _streamed()
    (start,) = _deliver(d, q)
    (s0,) = d.job_progress(start.key, "Once", now=0.1)
    (s1,) = d.job_progress(start.key, " upon é", now=0.2)
    assert (s0.seq, s0.offset, s0.text) == (0, 0, "Once")
    assert isinstance(s1, SendSegment) and (s1.seq, s1.offset) == (1, 4)
    content = dataclasses.replace(OK, text="Once upon é")
    (last,) = d.job_finished(start.key, content, now=0.3)
    # the last segment continues after the UTF-8 bytes sent ("é" is two)
    assert (last.seq, last.offset) == (2, len("Once upon é".encode()))


def test_a_sending_that_joins_a_streamed_job_first_gets_the_text_so_far():
    d = _dispatcher()
    q = _streamed()
    (start,) = _deliver(d, q)
    d.job_progress(start.key, "Once", now=0.1)
    resend = dataclasses.replace(q, reply_proxies=tuple(ReplyProxy(p, b"b" * 16) for p in PROXIES))
    (catch_up,) = _deliver(d, resend, now=0.2)
    assert (catch_up.waiter.query, catch_up.seq, catch_up.offset, catch_up.text) == (
        resend, 0, 0, "Once"
    )
    both = d.job_progress(start.key, " upon", now=0.3)
    assert [(s.waiter.query, s.seq, s.offset) for s in both] == [(q, 1, 4), (resend, 1, 4)]


def test_a_streamed_and_an_unstreamed_sending_are_different_jobs():
    d = _dispatcher()
    (one,) = _deliver(d, _query())
    (two,) = _deliver(d, dataclasses.replace(_streamed(), request_id=one.query.request_id))
    assert isinstance(two, StartJob) and two.key != one.key


def test_segments_stop_at_the_budget_and_the_last_one_carries_the_rest():
    from ps_p2p.serving.dispatch import MAX_SEGMENTS

    d = _dispatcher()
    (start,) = _deliver(d, _streamed())
    sent = []
    for _ in range(MAX_SEGMENTS + 10):
        sent += d.job_progress(start.key, "ab", now=0.1)
    assert len(sent) == MAX_SEGMENTS - 1
    (last,) = d.job_finished(start.key, dataclasses.replace(OK, text="ab" * (MAX_SEGMENTS + 10)), 1.0)
    assert (last.seq, last.offset) == (MAX_SEGMENTS - 1, 2 * (MAX_SEGMENTS - 1))


def test_a_streamed_job_that_fails_after_text_signs_the_text_it_streamed():
    d = _dispatcher()
    (start,) = _deliver(d, _streamed())
    d.job_progress(start.key, "partial", now=0.1)
    error = d.error_content(ResponseStatus.ENGINE_ERROR, "GPU fell off")
    (last,) = d.job_finished(start.key, error, now=0.2)
    assert last.content.status == ResponseStatus.ENGINE_ERROR
    assert last.content.text == "partial" and (last.seq, last.offset) == (1, 7)


@pytest.mark.parametrize("changes, message", [
    (dict(prompt="", messages=()), "either a prompt or chat messages"),
    (dict(prompt="", messages=(ChatMessage("wizard", "hi"),)), "unknown chat role"),
    (dict(params=SamplingParams(max_tokens=16, stop=("a",) * 5)), "stop strings"),
    (dict(params=SamplingParams(max_tokens=16, stop=("",))), "stop strings"),
])
def test_bad_chats_and_stop_strings_are_answered_at_once(changes, message):
    d = _dispatcher()
    (answer,) = _deliver(d, dataclasses.replace(_query(), **changes))
    assert isinstance(answer, SendAnswer)
    assert answer.content.status == ResponseStatus.BAD_REQUEST and message in answer.content.error


# ------------------------------------------------------------------ forwarding (sec. 3.3)

PEER = b"\x07" * 38


def test_a_forwarded_job_gives_its_slot_back_and_the_peers_signed_answer_reaches_every_waiter():
    d = _dispatcher(capacity=1, max_queue=0)
    q = _query()
    (start,) = _deliver(d, q)
    assert not start.local and start.q_bytes == encode_query(q)
    assert d.load.queued == 1
    assert d.job_forwarded(start.key, PEER, now=0.1) == []
    assert d.load.queued == 0 and d.requests["forwarded"] == 1
    (other,) = _deliver(d, _query("another"), now=0.2)  # the slot is free again
    assert isinstance(other, StartJob)
    signed = object()  # the serving node's signed reply, opaque to the core
    (answer,) = d.job_finished(start.key, OK, now=1.0, signed=signed)
    assert answer.signed is signed and answer.content == OK
    assert d.load.served == 0  # served elsewhere: no latency sample of ours
    resend = dataclasses.replace(q, reply_proxies=tuple(ReplyProxy(p, b"z" * 16) for p in PROXIES))
    (cached,) = _deliver(d, resend, now=2.0)
    assert cached.signed is signed  # a resent request gets the same signed answer


def test_a_forward_that_fails_before_any_text_is_served_here():
    d = _dispatcher()
    q = _query()
    (start,) = _deliver(d, q)
    d.job_forwarded(start.key, PEER, now=0.0)
    (again,) = d.forward_failed(start.key, now=0.5)
    assert isinstance(again, StartJob) and again.local and again.key == start.key
    assert d.load.queued == 1
    assert d.forward_failed(start.key, now=0.6) == []  # not forwarded any more: no effect


def test_a_forward_that_fails_with_no_room_here_is_answered_overloaded():
    d = _dispatcher(capacity=1, max_queue=0)
    q = _query()
    (start,) = _deliver(d, q)
    d.job_forwarded(start.key, PEER, now=0.0)
    _deliver(d, _query("fills the only slot"), now=0.1)
    (answer,) = d.forward_failed(start.key, now=0.5)
    assert isinstance(answer, SendAnswer)
    assert answer.content.status == ResponseStatus.OVERLOADED and answer.signed is None


def test_a_streamed_forward_that_breaks_after_text_ends_with_an_error_signing_none_of_it():
    d = _dispatcher()
    q = _query(tag=b"s")
    q = dataclasses.replace(q, stream=True)
    (start,) = _deliver(d, q)
    d.job_forwarded(start.key, PEER, now=0.0)
    (segment,) = d.job_progress(start.key, "Once", now=0.1)
    (answer,) = d.forward_failed(start.key, now=0.2)
    # the other node's text was never verified: this node does not sign it as its own
    assert answer.content.status == ResponseStatus.ENGINE_ERROR and answer.content.text == ""


def test_a_request_forwarded_to_us_is_served_here_and_answered_on_its_channel():
    d = _dispatcher()
    q = _query()  # a forward carries Q as the forwarder decoded it, reply proxies included
    (start,) = d.receive_forwarded(5, encode_query(q), now=0.0, sender=PEER)
    assert isinstance(start, StartJob) and start.local  # one hop: never forwarded again
    d.job_started(start.key, now=0.0)
    (answer,) = d.job_finished(start.key, OK, now=1.0)
    assert answer.waiter.channel == 5 and answer.signed is None


def test_a_request_forwarded_to_us_past_capacity_is_answered_overloaded_on_its_channel():
    d = _dispatcher(capacity=1, max_queue=0)
    _deliver(d, _query("first"))
    (answer,) = d.receive_forwarded(9, encode_query(_query("second")), now=0.0)
    assert isinstance(answer, SendAnswer) and answer.waiter.channel == 9
    assert answer.content.status == ResponseStatus.OVERLOADED


def test_a_dropped_request_forwarded_to_us_closes_its_channel():
    from ps_p2p.serving.dispatch import DropChannel

    d = _dispatcher()
    assert d.receive_forwarded(3, b"not a request", now=0.0) == [DropChannel(3)]


def test_a_forward_to_us_is_not_answered_with_another_nodes_answer_we_relayed():
    from ps_p2p.serving.dispatch import DropChannel

    d = _dispatcher()
    q = _query()
    (start,) = _deliver(d, q)
    d.job_forwarded(start.key, PEER, now=0.0)
    forwarded_q = dataclasses.replace(q, reply_proxies=tuple(reversed(q.reply_proxies)))
    assert d.receive_forwarded(4, encode_query(forwarded_q), now=0.1) == [DropChannel(4)]
    d.job_finished(start.key, OK, now=1.0, signed=object())  # cached, signed by PEER
    assert d.receive_forwarded(5, encode_query(forwarded_q), now=2.0) == [DropChannel(5)]


def test_a_forward_whose_q_names_no_reply_proxies_is_nobodys_request_and_is_dropped():
    from ps_p2p.serving.dispatch import DropChannel

    d = _dispatcher()
    own = dataclasses.replace(_query(), reply_proxies=())  # a member's own query
    assert d.receive_forwarded(7, encode_query(own), now=0.0, sender=PEER) == [DropChannel(7)]
    one = dataclasses.replace(_query(), reply_proxies=_query().reply_proxies[:1])
    assert d.receive_forwarded(8, encode_query(one), now=0.0, sender=PEER) == [DropChannel(8)]
    assert d.in_service == 0


def test_one_forwarder_gets_at_most_its_share_and_the_users_keep_theirs():
    d = _dispatcher(capacity=2, max_queue=6)  # forwards: 4 in all, 2 per forwarding node
    other = b"\x77" * 38
    starts = [d.receive_forwarded(i, encode_query(_query(f"p{i}")), now=0.0, sender=PEER)
              for i in range(3)]
    assert [type(c) for (c,) in starts] == [StartJob, StartJob, SendAnswer]
    assert starts[2][0].content.status == ResponseStatus.OVERLOADED  # PEER's share is full
    for i in range(3, 6):
        (c,) = d.receive_forwarded(i, encode_query(_query(f"p{i}")), now=0.0, sender=other)
        assert isinstance(c, StartJob) == (i < 5)  # its own share, then all forwarders' share
    assert d.forwarded_jobs == 4
    for i in range(4):  # the users who asked this node still get the rest
        (c,) = _deliver(d, _query(f"user {i}"))
        assert isinstance(c, StartJob)
    (start,) = starts[0]
    d.job_started(start.key, now=0.0)
    d.job_finished(start.key, OK, now=1.0)  # a forwarded job done: its slot is PEER's again
    assert d.forwarded_in == {PEER: 1, other: 2}
    (again,) = d.receive_forwarded(9, encode_query(_query("p9")), now=1.0, sender=PEER)
    assert isinstance(again, StartJob)


def test_negative_forward_shares_are_config_errors():
    from ps_p2p.errors import ConfigError

    with pytest.raises(ConfigError):
        DispatchConfig(max_forwarded=-1)
    with pytest.raises(ConfigError):
        DispatchConfig(max_forwarded_per_peer=-1)
    assert DispatchConfig(capacity=4, max_queue=12).forwarded_limit == 8
    assert DispatchConfig(capacity=4, max_queue=12).forwarded_per_peer_limit == 4


def test_with_a_router_a_users_request_is_routed_before_it_joins_q():
    # issue 19 finding 3: the request being routed holds an admission place, not a place in Q
    d = _dispatcher(capacity=1, max_queue=1)
    d.routes = True
    (start,) = _deliver(d, _query("first"))
    assert (d.load.routing, d.load.queued) == (1, 0)
    (other,) = _deliver(d, _query("second"), now=0.1)
    assert (d.load.routing, d.load.queued) == (2, 0)
    (refused,) = _deliver(d, _query("third"), now=0.2)  # the bound still counts them
    assert refused.content.status == ResponseStatus.OVERLOADED
    d.job_routed_here(start.key, now=0.3)  # kept here: it joins Q
    d.job_forwarded(other.key, PEER, now=0.3)  # sent on: its place is free again
    assert (d.load.routing, d.load.queued) == (0, 1)
    d.job_started(start.key, now=0.4)
    assert (d.load.queued, d.load.in_service) == (0, 1)
