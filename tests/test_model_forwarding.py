"""A model node's side of forwarding (ps_p2p.roles.model) with a scripted serving node B:
A relays B's answer only when it is exactly what the user will accept, and serves the request
itself otherwise; its forwards in flight are bounded."""

from __future__ import annotations

import dataclasses
import os

import pytest
import trio
import trio.testing

from ps_p2p import responses
from ps_p2p.crypto import sida
from ps_p2p.gossip.load import ForwardOutcome
from ps_p2p.inference import InferenceReply, ResponseStatus
from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import inference_pb2
from ps_p2p.protocols.clove_codec import clove_to_bytes
from ps_p2p.protocols.inference_codec import decode_reply, decode_segment
from ps_p2p.roles import model as model_mod
from ps_p2p.roles.model import ModelNodeConfig, ModelNodeService
from ps_p2p.testing.fakes import InstantEngine

PROXIES = [bytes([i]) * 38 for i in range(1, 5)]
B = Identity.generate()


class _Overlay:
    on_delivery = None

    def send_reply(self, *args) -> bool:
        return True


def _q(prompt: str, stream: bool = False) -> tuple[bytes, bytes]:
    rid = os.urandom(16)
    q = inference_pb2.InferenceRequest(
        request_id=rid, model_id="fake-model", prompt=prompt, stream=stream,
        params=inference_pb2.SamplingParams(max_tokens=16),
        reply_proxies=[inference_pb2.ReplyProxy(peer_id=p, reply_tag=bytes([i]) * 16)
                       for i, p in enumerate(PROXIES)]).SerializeToString()
    return q, rid


def _deliver(service: ModelNodeService, q: bytes) -> None:
    for sender, clove in zip(PROXIES, sida.encode(q, total=4, threshold=3)):
        service.on_delivery(sender, clove_to_bytes(clove))


def _signed_by_b(q: bytes, rid: bytes, text: str, model_id: str = "fake-model",
                 status: int = ResponseStatus.OK) -> InferenceReply:
    content = responses.ResponseContent(status, text, "", model_id, 1, 1, "stop")
    h = responses.request_hash(q)
    return InferenceReply(rid, status, text, "", model_id, 1, 1, h, 1, B.peer_id,
                          responses.sign_response(B, rid, h, content, 1), "stop")


async def _service(nursery, monkeypatch, forward, *, capacity=2, max_queue=8, outcomes=None):
    service = ModelNodeService(Identity.generate(), InstantEngine(),
                               ModelNodeConfig(capacity=capacity, max_queue=max_queue))
    service.attach(_Overlay())
    sent: list[bytes] = []
    service._send_message = lambda waiter, payload, message_id: sent.append(payload)

    async def route(query):
        return B.peer_id

    async def no_server(host, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        await trio.sleep_forever()

    service.enable_forwarding(
        None, route, lambda peer: True,
        None if outcomes is None else lambda peer, outcome, s: outcomes.append((peer, outcome)))
    service.forward_service.serve = no_server
    monkeypatch.setattr(model_mod, "forward_request", forward)
    await nursery.start(service.run)
    return service, sent


def _final(payload: bytes) -> InferenceReply:
    try:
        return decode_reply(payload)
    except Exception:
        return decode_segment(payload).final


async def _until(service: ModelNodeService, condition) -> None:
    with trio.fail_after(10):
        while not condition():
            await service.driver.wait_processed()


@pytest.mark.parametrize("lie", ["streams other text", "another model", "error status"])
async def test_an_answer_the_user_would_refuse_is_not_relayed_and_a_serves_it_itself(
        monkeypatch, lie, autojump_clock):
    async def forward(host, peer, q, on_text, **kwargs):
        rid = inference_pb2.InferenceRequest.FromString(q).request_id
        if lie == "streams other text":
            on_text("EVIL ")
            return _signed_by_b(q, rid, "honest answer")
        if lie == "another model":
            return _signed_by_b(q, rid, "an answer", model_id="some-other-model")
        return _signed_by_b(q, rid, "", status=ResponseStatus.ENGINE_ERROR)

    async with trio.open_nursery() as nursery:
        service, sent = await _service(nursery, monkeypatch, forward)
        q, rid = _q("hello there", stream=(lie == "streams other text"))
        _deliver(service, q)
        await _until(service, lambda: any(_final_or_none(p) for p in sent))
        assert service.forwards["failed"] == 1 and service.forwards["answered"] == 0
        finals = [r for r in map(_final_or_none, sent) if r is not None]
        if lie == "streams other text":  # text already streamed: an error that signs none of it
            assert finals[-1].status == ResponseStatus.ENGINE_ERROR and finals[-1].text == ""
        else:  # nothing streamed: served here, by this node
            assert finals[-1].status == ResponseStatus.OK
        assert all(r.model_node == service.identity.peer_id and not r.forwarded_by
                   for r in finals)
        nursery.cancel_scope.cancel()


def _final_or_none(payload: bytes) -> InferenceReply | None:
    try:
        reply = _final(payload)
    except Exception:
        return None
    return reply if reply is not None and reply.signature else None


async def test_forwards_in_flight_are_bounded_like_local_jobs(monkeypatch, autojump_clock):
    started = []

    async def forward(host, peer, q, on_text, **kwargs):
        started.append(q)
        await trio.sleep_forever()  # a serving node that never answers

    async with trio.open_nursery() as nursery:
        service, sent = await _service(nursery, monkeypatch, forward, capacity=1, max_queue=2)
        for i in range(3):  # each forward gives its admission slot back...
            _deliver(service, _q(f"prompt {i}")[0])
            await _until(service, lambda: len(started) == i + 1)
        assert service.dispatcher.load.requests == 0
        for i in range(3, 6):  # ...but forwards in flight stay bounded: these are served here
            _deliver(service, _q(f"prompt {i}")[0])
            await _until(service, lambda: len(sent) == i - 2)
        assert len(started) == 3 and service.answers == {"ok": 3}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("answer,outcome", [
    ("verified", ForwardOutcome.ANSWERED), ("another node's", ForwardOutcome.FAILED),
    ("never", ForwardOutcome.FAILED), ("overloaded", ForwardOutcome.BUSY),
    ("unsigned overloaded", ForwardOutcome.FAILED)])
async def test_every_forward_sent_is_reported_to_the_router_once_with_its_outcome(
        monkeypatch, answer, outcome, autojump_clock):
    async def forward(host, peer, q, on_text, **kwargs):
        rid = inference_pb2.InferenceRequest.FromString(q).request_id
        if answer == "never":
            raise trio.TooSlowError  # the forward deadline passed
        if answer.endswith("overloaded"):
            reply = _signed_by_b(q, rid, "", status=ResponseStatus.OVERLOADED)
            if answer == "unsigned overloaded":
                reply = dataclasses.replace(reply, signature=b"\x00" * 64)
            return reply
        reply = _signed_by_b(q, rid, "an answer")
        if answer == "another node's":
            return dataclasses.replace(reply, model_node=PROXIES[0])
        return reply

    outcomes: list[tuple[bytes, bool]] = []
    async with trio.open_nursery() as nursery:
        service, sent = await _service(nursery, monkeypatch, forward, outcomes=outcomes)
        _deliver(service, _q("hello there")[0])
        await _until(service, lambda: any(_final_or_none(p) for p in sent))
        assert outcomes == [(B.peer_id, outcome)]
        nursery.cancel_scope.cancel()


class _SilentStream:
    """A forward stream from ``peer`` whose request frame never comes."""

    def __init__(self, peer: bytes) -> None:
        from libp2p.peer.id import ID

        self.muxed_conn = type("Conn", (), {"peer_id": ID(peer)})()
        self.was_reset = False

    async def read(self, n: int) -> bytes:
        await trio.sleep_forever()

    async def reset(self) -> None:
        self.was_reset = True


async def test_one_member_cannot_hold_more_than_its_share_of_forward_streams(autojump_clock):
    from ps_p2p.protocols.forward import ForwardService

    async def accept(sender, q):
        raise AssertionError("no request frame was sent")

    service = ForwardService(accept, max_streams=8, max_streams_per_peer=2)
    greedy, other = Identity.generate().peer_id, Identity.generate().peer_id
    streams = [_SilentStream(greedy) for _ in range(3)] + [_SilentStream(other)]
    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(service._handle_stream, stream)
        await trio.testing.wait_all_tasks_blocked()  # inside the 10 s request-read deadline
        assert sum(s.was_reset for s in streams[:3]) == 1 and not streams[3].was_reset
        assert service.refused == 1 and service.open == 3
        nursery.cancel_scope.cancel()


# -- routing before admission (issue 19 finding 3) ---------------------------------------------


async def test_an_idle_entry_that_holds_the_prefix_serves_it_itself(monkeypatch, autojump_clock):
    # the dispatcher admits a user's request as being routed: the router (the real
    # GroupForwarding on the real cores) must not count it in this node's own Q, or an idle
    # entry holding the prefix forwards it to an equally idle peer that holds it too
    from test_group_forwarding import CONFIG, FAST, _directory, _forwarding, _node

    from ps_p2p.engines.base import SamplingParams as EngineParams
    from ps_p2p.engines.sim_engine import SimEngine

    forwarded = []

    async def forward(host, peer, q, on_text, **kwargs):
        forwarded.append(peer)
        raise AssertionError("forwarded")

    me = Identity.generate()
    service = ModelNodeService(me, InstantEngine(), ModelNodeConfig(capacity=2, max_queue=8))
    service.attach(_Overlay())
    sent: list[bytes] = []
    service._send_message = lambda waiter, payload, message_id: sent.append(payload)
    engine = SimEngine("sim", FAST)
    from ps_p2p.roles.forwarding import GroupForwarding

    router = GroupForwarding(me, engine, service.load, CONFIG, clock=trio.current_time)
    peer, peer_engine = _forwarding(B, clock=trio.current_time)
    directory = _directory(_node(me), _node(B))
    router.set_directory(directory)
    peer.set_directory(directory)
    prompt = "a long shared tool schema that both nodes hold, " * 6 + "and the question"
    for e, f in ((engine, router), (peer_engine, peer)):
        await e.complete(prompt, EngineParams(max_tokens=1))
        assert f.absorb_engine_events() > 0
    for envelope in [peer.load_envelope(), *peer.delta_envelopes()]:
        router.receive(B.peer_id, envelope)

    async def no_server(host, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        await trio.sleep_forever()

    service.enable_forwarding(None, router.route, lambda p: True, router.forward_done)
    service.forward_service.serve = no_server
    monkeypatch.setattr(model_mod, "forward_request", forward)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        q, _ = _q(prompt)
        _deliver(service, q)
        await _until(service, lambda: any(_final_or_none(p) for p in sent))
        assert forwarded == [] and service.forwards["sent"] == 0
        assert router.decisions == {"cache_hit": 1}
        final = next(r for r in map(_final_or_none, sent) if r is not None)
        assert final.status == ResponseStatus.OK and final.model_node == me.peer_id
        assert (service.load.routing, service.load.queued) == (0, 0)
        nursery.cancel_scope.cancel()
