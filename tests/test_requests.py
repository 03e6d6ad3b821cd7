"""The request core (ps_p2p.overlay.requests): attempts, response cloves, conviction and typed
outcomes, on injected time, with a pickle codec and injected signature checks."""

from __future__ import annotations

import dataclasses
import pickle
import random
from dataclasses import dataclass

import pytest

from ps_p2p import responses
from ps_p2p.crypto import sida
from ps_p2p.errors import (
    ContextLengthError,
    InvalidSignatureError,
    ModelNodeError,
    NoPathError,
    OverloadedError,
    PromptTooLongError,
    RemoteProtocolError,
    RequestRefusedError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from ps_p2p.inference import (
    InferenceReply,
    ResponseSegment,
    ResponseStatus,
    SamplingParams,
    status_error,
)
from ps_p2p.overlay.requests import (
    MAX_SEGMENTS,
    ConvictProxy,
    RequestConfig,
    RequestCore,
    RequestDone,
    RequestSpec,
    ResponseClove,
    SendClove,
    StreamText,
)

MODEL = b"model-node-M"
OTHER_MODEL = b"model-node-N"
THIRD = b"model-node-T"  # a model node of another model


@dataclass(frozen=True)
class Path:
    path_id: int
    proxy: bytes


READY = [Path(i, b"proxy-%d" % i) for i in range(1, 6)]


class PickleCodec:
    def encode_request(self, query):
        return pickle.dumps(query)

    def decode_response(self, payload):
        try:
            return pickle.loads(payload)
        except Exception as exc:
            raise RemoteProtocolError(str(exc)) from exc

    def clove_size(self, clove):
        return len(clove.fragment) + len(clove.key_share) + 64


def _verify_clove(model_node, message_id, raw, signature):
    return signature == b"signed by " + model_node


def _verify_reply(reply):
    if reply.signature != b"good":
        raise InvalidSignatureError("bad response signature")
    if (reply.forwarded_by or reply.forward_signature) and \
            reply.forward_signature != b"vouched by " + reply.forwarded_by:
        raise InvalidSignatureError("bad forward voucher")


def _core(**overrides) -> RequestCore:
    fields = dict(total=4, threshold=3, attempt_timeout=8.0, token_time=0.05)
    fields.update(overrides)
    return RequestCore(
        RequestConfig(**fields), PickleCodec(), lambda peer: peer in (MODEL, OTHER_MODEL, THIRD),
        rng=random.Random(3), random_bytes=random.Random(5).randbytes,
        verify_clove=_verify_clove, verify_reply=_verify_reply,
        model_nodes=lambda model_id: (MODEL, OTHER_MODEL) if model_id == "fake-model" else (),
    )


def _spec(request_id=b"r" * 16, *, max_tokens=100, timeout=120.0, prompt="tell me a story"):
    return RequestSpec(request_id, MODEL, "fake-model", prompt,
                       SamplingParams(max_tokens=max_tokens), timeout)


def _of(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def _serve(sent: list[SendClove], *, status=ResponseStatus.OK, text="yrots a", signer=MODEL,
           signature=b"good", model_id="fake-model", forwarded_by=b"",
           forward_signature=b"") -> list[ResponseClove]:
    """What the model node asked sends back for one attempt (one clove per path, each clove
    signed by it); the reply inside may claim another ``signer``."""
    q_bytes = sida.decode_subset([c.clove for c in sent[:3]])
    query = pickle.loads(q_bytes)
    req_hash = responses.request_hash(q_bytes)
    reply = InferenceReply(
        request_id=query.request_id, status=status, text=text, error="" if status == 0 else "why",
        model_id=model_id, prompt_tokens=4, completion_tokens=7, request_hash=req_hash,
        signed_at_ms=1, model_node=signer, signature=signature, forwarded_by=forwarded_by,
        forward_signature=forward_signature,
    )
    cloves = sida.encode(pickle.dumps(reply), total=len(sent), threshold=3,
                         message_id=responses.response_message_id(query.request_id, req_hash))
    return [
        ResponseClove(s.path_id, clove, b"raw-%d" % i, b"signed by " + MODEL, s.reply_tag)
        for i, (s, clove) in enumerate(zip(sent, cloves))
    ]


def _feed(core, cloves, now):
    commands = []
    for clove in cloves:
        commands += core.response_clove(clove, now)
    return commands


def _done(commands):
    (done,) = _of(commands, RequestDone)
    return done.outcome


# ------------------------------------------------------------------ attempts


def test_a_request_waits_for_n_ready_paths_then_sends_one_clove_per_distinct_proxy():
    core = _core()
    assert core.start(_spec(), 0.0, READY[:3]) == []
    sent = _of(core.tick(0.5, READY), SendClove)
    assert len(sent) == 4
    assert len({s.path_id for s in sent}) == 4
    assert len({READY[s.path_id - 1].proxy for s in sent}) == 4
    assert len({s.reply_tag for s in sent}) == 4 and all(len(s.reply_tag) == 16 for s in sent)
    assert {s.destination for s in sent} == {MODEL}


def test_with_too_few_distinct_proxies_a_request_waits_the_grace_then_goes():
    shared = [Path(1, b"a"), Path(2, b"a"), Path(3, b"b"), Path(4, b"c")]
    core = _core()
    assert core.start(_spec(), 0.0, shared) == []
    assert core.next_deadline() == pytest.approx(1.0)
    assert core.tick(0.9, shared) == []
    assert len(_of(core.tick(1.0, shared), SendClove)) == 4


def test_with_fewer_distinct_proxies_than_k_a_request_waits_past_the_grace_for_more():
    two = [Path(1, b"a"), Path(2, b"a"), Path(3, b"b"), Path(4, b"b"), Path(5, b"b")]
    three = [*two[:4], Path(6, b"c")]
    core = _core()
    assert core.start(_spec(timeout=30.0), 0.0, two) == []
    assert core.next_deadline() == pytest.approx(30.0)  # no grace: such an attempt never decodes
    assert core.tick(5.0, two) == []
    assert core.tick(6.0, three) == []  # k distinct proxies: the grace for n starts now
    sent = _of(core.tick(7.0, three), SendClove)
    proxy_of = {p.path_id: p.proxy for p in three}
    assert len(sent) == 4 and {proxy_of[s.path_id] for s in sent} == {b"a", b"b", b"c"}


def test_too_few_distinct_proxies_until_the_deadline_is_a_no_path_error_saying_so():
    two = [Path(1, b"a"), Path(2, b"a"), Path(3, b"b"), Path(4, b"b")]
    core = _core()
    core.start(_spec(timeout=4.0), 0.0, two)
    outcome = _done(core.tick(4.0, two))
    assert isinstance(outcome.error, NoPathError)
    assert "only 2 distinct proxies among 4 ready paths after 4 s; a request needs 3" in str(
        outcome.error
    )


@pytest.mark.parametrize(
    "max_tokens, first_wait",
    [(0, 8.0), (100, 18.0)],  # attempt_timeout + max_tokens * max(token_time, 2 * measured)
)
def test_an_unanswered_attempt_is_resent_after_the_attempt_wait_which_then_doubles(
    max_tokens, first_wait
):
    core = _core()
    first = _of(core.start(_spec(max_tokens=max_tokens), 0.0, READY), SendClove)
    assert core.next_deadline() == pytest.approx(first_wait)
    assert core.tick(first_wait - 0.1, READY) == []
    second = _of(core.tick(first_wait, READY), SendClove)
    assert len(second) == 4
    assert not {s.reply_tag for s in second} & {s.reply_tag for s in first}  # fresh tags
    assert core.attempts(b"r" * 16) == 2
    assert core.next_deadline() == pytest.approx(first_wait + 2 * first_wait)


def test_a_lost_path_has_its_clove_resent_on_a_spare_path():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    lost = sent[0]
    ready = [p for p in READY if p.path_id != lost.path_id]
    (resent,) = core.path_lost(lost.path_id, 1.0, ready)
    (spare,) = [p for p in READY if p.path_id not in {s.path_id for s in sent}]
    assert (resent.path_id, resent.clove, resent.reply_tag) == (spare.path_id, lost.clove, b"")
    assert core.tick(1.0, ready) == []  # k paths are left: no new attempt


def test_fewer_than_k_paths_left_sends_another_attempt_at_once():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    ready = list(READY)
    for lost in sent[:2]:
        ready = [p for p in ready if p.path_id != lost.path_id]
        core.path_lost(lost.path_id, 1.0, ready)
    fresh = [Path(10 + i, b"fresh-%d" % i) for i in range(4)]
    again = _of(core.tick(1.0, fresh), SendClove)
    assert {s.path_id for s in again} == {p.path_id for p in fresh}


# ------------------------------------------------------------------ outcomes


def test_a_verified_answer_ends_the_request_with_the_reply():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    outcome = _done(_feed(core, _serve(sent)[:3], 2.0))
    assert outcome.ok and outcome.error is None
    assert outcome.reply.text == "yrots a" and outcome.reply.model_node == MODEL
    assert (outcome.cloves_received, outcome.attempts, outcome.latency) == (3, 1, 2.0)
    assert b"r" * 16 not in core and core.next_deadline() is None


@pytest.mark.parametrize(
    "status, error_class",
    [
        (ResponseStatus.OVERLOADED, OverloadedError),
        (ResponseStatus.PROMPT_TOO_LONG, ContextLengthError),
        (ResponseStatus.BAD_REQUEST, RequestRefusedError),
        (ResponseStatus.WRONG_MODEL, RequestRefusedError),
        (ResponseStatus.ENGINE_ERROR, ModelNodeError),
        (42, ModelNodeError),
    ],
)
def test_a_signed_error_status_ends_the_request_with_its_error_class(status, error_class):
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    outcome = _done(_feed(core, _serve(sent, status=status, text=""), 1.0)[:1])
    assert type(outcome.error) is error_class
    assert outcome.error.status == status
    assert outcome.reply is not None and outcome.reply.status == status
    name = ResponseStatus(status).name if status in ResponseStatus.__members__.values() else "STATUS_42"
    assert str(outcome.error) == f"{name}: why"


def test_a_prompt_too_long_answer_is_also_a_prompt_too_long_error():
    assert issubclass(ContextLengthError, PromptTooLongError)
    assert issubclass(ContextLengthError, RequestRefusedError)


def test_no_answer_by_the_deadline_is_a_request_timeout():
    core = _core()
    core.start(_spec(timeout=4.0), 0.0, READY)
    assert core.next_deadline() == pytest.approx(4.0)
    outcome = _done(core.tick(4.0, READY))
    assert isinstance(outcome.error, RequestTimeoutError)
    assert outcome.attempts == 1 and outcome.reply is None


def test_too_few_paths_until_the_deadline_is_a_no_path_error():
    core = _core()
    core.start(_spec(timeout=4.0), 0.0, READY[:2])
    outcome = _done(core.tick(4.0, READY[:2]))
    assert isinstance(outcome.error, NoPathError)
    assert "only 2 of 4 paths" in str(outcome.error)
    assert outcome.attempts == 0


def test_a_request_whose_cloves_do_not_fit_a_cell_fails_as_too_large():
    core = _core(max_clove_bytes=500)
    outcome = _done(core.start(_spec(prompt="x" * 2000), 0.0, READY))
    assert isinstance(outcome.error, RequestTooLargeError)


def test_a_cancelled_request_is_forgotten_without_an_outcome():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    assert core.cancel(b"r" * 16) == []
    assert len(core) == 0 and core.next_deadline() is None
    assert _of(_feed(core, _serve(sent), 1.0), RequestDone) == []


# ------------------------------------------------------------------ response checks


@pytest.mark.parametrize(
    "serve, reason",
    [
        (dict(signature=b"forged"), "bad response signature"),
        (dict(signer=OTHER_MODEL), "another model node"),
        (dict(signer=b"not-a-model-node"), "no model node"),
        (dict(model_id="other-model"), "response from model"),
        # forwarded: only by the node asked, with its voucher, to a node of the same model
        (dict(signer=OTHER_MODEL, forwarded_by=OTHER_MODEL,
              forward_signature=b"vouched by " + OTHER_MODEL), "another node than the one asked"),
        (dict(signer=OTHER_MODEL, forwarded_by=MODEL, forward_signature=b"forged"),
         "bad forward voucher"),
        (dict(signer=MODEL, forwarded_by=MODEL, forward_signature=b"vouched by " + MODEL),
         "its own signer"),
        (dict(signer=THIRD, forwarded_by=MODEL, forward_signature=b"vouched by " + MODEL),
         "does not list for"),
        (dict(signer=OTHER_MODEL, forward_signature=b"vouched by "), "another node than"),
    ],
)
def test_a_reply_that_fails_its_checks_is_rejected_and_the_request_goes_on(serve, reason, caplog):
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    cloves = _serve(sent, **serve)
    assert _of(_feed(core, cloves, 1.0), RequestDone) == []
    assert reason in caplog.text
    assert b"r" * 16 in core


def test_an_answer_forwarded_by_the_node_asked_with_its_voucher_is_accepted():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    cloves = _serve(sent, signer=OTHER_MODEL, forwarded_by=MODEL,
                    forward_signature=b"vouched by " + MODEL)
    outcome = _done(_feed(core, cloves, 1.0))
    assert outcome.ok and outcome.reply.model_node == OTHER_MODEL
    assert outcome.reply.forwarded_by == MODEL


def test_the_forward_voucher_signs_request_and_server_and_nothing_else_verifies():
    from ps_p2p.keys import Identity

    asked, server = Identity.generate(), Identity.generate()
    voucher = responses.sign_forward(asked, b"r" * 16, b"h" * 32, server.peer_id)
    responses.verify_forward(asked.peer_id, b"r" * 16, b"h" * 32, server.peer_id, voucher)
    for args in [(server.peer_id, b"r" * 16, b"h" * 32, server.peer_id),  # another signer
                 (asked.peer_id, b"x" * 16, b"h" * 32, server.peer_id),  # another request
                 (asked.peer_id, b"r" * 16, b"h" * 31 + b"!", server.peer_id),
                 (asked.peer_id, b"r" * 16, b"h" * 32, asked.peer_id)]:  # another server
        with pytest.raises(InvalidSignatureError):
            responses.verify_forward(*args, voucher)


# ------------------------------------------------------------------ conviction


def test_a_badly_signed_clove_under_a_registered_tag_convicts_that_paths_proxy():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    clove = _serve(sent)[1]
    altered = ResponseClove(clove.path_id, clove.clove, clove.raw, b"garbage", clove.reply_tag)
    assert core.response_clove(altered, 1.0) == [ConvictProxy(READY[clove.path_id - 1].proxy)]


def test_a_clove_under_an_unknown_tag_convicts_nobody():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    clove = _serve(sent)[0]
    unknown = ResponseClove(clove.path_id, clove.clove, clove.raw, b"garbage", b"\x00" * 16)
    assert core.response_clove(unknown, 1.0) == []
    assert core.misrouted_cloves == 1


def test_a_clove_under_a_tag_registered_on_another_path_convicts_nobody():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    clove = _serve(sent)[0]
    moved = ResponseClove(sent[1].path_id, clove.clove, clove.raw, b"garbage", clove.reply_tag)
    assert core.response_clove(moved, 1.0) == []
    assert core.misrouted_cloves == 1


def test_a_well_signed_clove_that_does_not_fit_its_tag_is_the_model_nodes_doing():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    first, second = _serve(sent)[:2]
    swapped = ResponseClove(first.path_id, second.clove, first.raw, first.signature, first.reply_tag)
    assert core.response_clove(swapped, 1.0) == []
    assert core.misrouted_cloves == 1


def test_an_unsigned_clove_is_dropped_without_blame():
    core = _core()
    assert core.unsigned_clove() == []
    assert core.misrouted_cloves == 1


# ------------------------------------------------------------------ audit


def test_the_verified_answer_is_kept_to_audit_late_cloves():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    cloves = _serve(sent)
    _done(_feed(core, cloves[:3], 1.0))
    (response_id,) = list(core.audits)
    assert response_id == cloves[0].clove.message_id
    assert core.response_clove(cloves[3], 1.5) == []  # a late, consistent clove: nothing to do
    assert core.misrouted_cloves == 0


def test_the_measured_time_per_token_stretches_the_next_attempt_wait():
    core = _core()
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    _feed(core, _serve(sent)[:3], 7.0)  # 7 tokens in 7 s: 1 s per token
    assert core.token_time == pytest.approx(0.05 + (1.0 - 0.05) / 8)
    assert core.attempt_wait(10) == pytest.approx(8.0 + 10 * 2 * core.token_time)



# ------------------------------------------------------------------ the outcome in upper layers


@pytest.mark.parametrize(
    "error, http, text",
    [
        (None, 502, ""),
        (RequestTimeoutError("no answer within 4 s"), 504, "RequestTimeoutError: no answer"),
        (NoPathError("only 2 of 4 paths ready after 4 s"), 503, "NoPathError: only 2"),
        (status_error(ResponseStatus.OVERLOADED, "busy"), 503, "OVERLOADED: busy"),
        (status_error(ResponseStatus.PROMPT_TOO_LONG, "long"), 400, "PROMPT_TOO_LONG: long"),
        (status_error(ResponseStatus.WRONG_MODEL, "no"), 400, "WRONG_MODEL: no"),
        (status_error(ResponseStatus.ENGINE_ERROR, "oom"), 502, "ENGINE_ERROR: oom"),
        (RequestTooLargeError("big"), 400, "RequestTooLargeError: big"),
    ],
)
def test_the_typed_outcome_gives_the_answer_text_and_the_http_status(error, http, text):
    from ps_p2p.api.openai_compat import http_status
    from ps_p2p.roles.user import answer_from_outcome
    from ps_p2p.overlay.requests import Outcome

    answer = answer_from_outcome(Outcome(b"r" * 16, None, error, 0, 1, 4.0))
    assert answer.ok is (error is None)
    assert answer.exception is error and answer.error_type is (type(error) if error else None)
    assert answer.error.startswith(text)
    if error is not None:
        assert http_status(answer.exception) == http


def test_no_model_node_in_the_directory_is_a_503():
    from ps_p2p.api.openai_compat import http_status
    from ps_p2p.errors import DirectoryError, NoModelNodeError, RequestError

    error = NoModelNodeError("no model node serving 'x' in the directory")
    assert isinstance(error, DirectoryError) and isinstance(error, RequestError)
    assert http_status(error) == 503


# ------------------------------------------------------------------ streamed answers


class SegmentCodec(PickleCodec):
    def decode_segment(self, payload):
        return self.decode_response(payload)


def _stream_core() -> RequestCore:
    core = _core()
    core._codec = SegmentCodec()
    return core


def _stream_spec(request_id=b"s" * 16):
    return dataclasses.replace(_spec(request_id), stream=True)


def _segments(sent, texts, *, final_text=None, signature=b"good", seqs=None):
    """The model node's segments for one attempt: ``texts`` one per segment, then the last
    segment with the reply signed over ``final_text`` (default: all texts joined). Returns
    per segment the ResponseCloves (one per path)."""
    q_bytes = sida.decode_subset([c.clove for c in sent[:3]])
    query = pickle.loads(q_bytes)
    req_hash = responses.request_hash(q_bytes)
    response_id = responses.response_message_id(query.request_id, req_hash)
    full = "".join(texts) if final_text is None else final_text
    reply = InferenceReply(
        request_id=query.request_id, status=ResponseStatus.OK, text="", error="",
        model_id="fake-model", prompt_tokens=4, completion_tokens=len(texts), request_hash=req_hash,
        signed_at_ms=1, model_node=MODEL, signature=signature if full == "".join(texts) else b"x",
        finish_reason="stop",
    )
    out, offset = [], 0
    items = [(t, None) for t in texts] + [("", reply)]
    for seq, (text, final) in enumerate(items):
        place = seq if seqs is None else seqs[seq]
        segment = ResponseSegment(query.request_id, place, offset, text, final)
        offset += len(text.encode())
        cloves = sida.encode(pickle.dumps(segment), total=len(sent), threshold=3,
                             message_id=responses.segment_message_id(response_id, seq))
        out.append([ResponseClove(s.path_id, c, b"raw", b"signed by " + MODEL, s.reply_tag)
                    for s, c in zip(sent, cloves)])
    return out


def _texts(commands):
    return [c.text for c in commands if isinstance(c, StreamText)]


def test_streamed_segments_are_released_in_order_whatever_order_they_decode_in():
    core = _stream_core()
    sent = _of(core.start(_stream_spec(), 0.0, READY), SendClove)
    assert {s.max_replies for s in sent} == {MAX_SEGMENTS}
    seg0, seg1, seg2, last = _segments(sent, ["Once", " upon", " a time"])
    assert _texts(_feed(core, seg1, 0.1)) == []  # segment 1 waits for segment 0
    assert _texts(_feed(core, seg0, 0.2)) == ["Once", " upon"]
    assert _texts(_feed(core, seg2, 0.3)) == [" a time"]
    outcome = _done(_feed(core, last, 0.4))
    assert outcome.ok and outcome.reply.text == "Once upon a time"
    assert outcome.reply.finish_reason == "stop"
    assert _feed(core, seg1, 0.5) == []  # a late segment: dropped without blame
    assert core.misrouted_cloves == 0


def test_a_segment_under_another_place_in_the_stream_is_dropped():
    core = _stream_core()
    sent = _of(core.start(_stream_spec(), 0.0, READY), SendClove)
    # the model node numbered segment 0 as 1: the message ID and the content disagree
    seg0, last = _segments(sent, ["Once"], seqs=[1, 1])
    assert _texts(_feed(core, seg0, 0.1)) == []
    assert _of(_feed(core, last, 0.2), RequestDone) == []


def test_a_proxy_that_alters_a_segment_clove_is_convicted_and_the_text_still_comes():
    core = _stream_core()
    sent = _of(core.start(_stream_spec(), 0.0, READY), SendClove)
    seg0, last = _segments(sent, ["Once"])
    forged = dataclasses.replace(seg0[0], signature=b"forged")
    commands = _feed(core, [forged, *seg0[1:]], 0.1)
    assert _of(commands, ConvictProxy) == [ConvictProxy(READY[sent[0].path_id - 1].proxy)]
    assert _texts(commands) == ["Once"]
    assert _done(_feed(core, last, 0.2)).ok


def test_a_signed_answer_that_differs_from_the_streamed_text_ends_nothing():
    core = _stream_core()
    sent = _of(core.start(_stream_spec(), 0.0, READY), SendClove)
    seg0, last = _segments(sent, ["Once"], final_text="Twice")
    assert _texts(_feed(core, seg0, 0.1)) == ["Once"]
    assert _of(_feed(core, last, 0.2), RequestDone) == []  # the signature does not verify


def test_text_streamed_by_an_earlier_attempt_is_not_released_twice():
    core = _stream_core()
    first = _of(core.start(_stream_spec(), 0.0, READY), SendClove)
    seg0, _ = _segments(first, ["Once"])
    assert _texts(_feed(core, seg0, 0.1)) == ["Once"]
    # no more for a long while: another attempt goes out; its catch-up segment repeats "Once"
    second = _of(core.tick(100.0, READY), SendClove)
    assert second and {s.reply_tag for s in second}.isdisjoint({s.reply_tag for s in first})
    catch_up, more, last = _segments(second, ["Once", " upon"])
    assert _texts(_feed(core, catch_up, 100.1)) == []
    assert _texts(_feed(core, more, 100.2)) == [" upon"]
    assert _done(_feed(core, last, 100.3)).reply.text == "Once upon"
