"""Model node service (ps_p2p.roles.model) driven directly, with a recording stand-in overlay."""

from __future__ import annotations

import os

import trio

from ps_p2p import records, responses
from ps_p2p.crypto import sida
from ps_p2p.keys import Identity
from ps_p2p.overlay.reassembly import CloveAssembler, MessageReassembled
from ps_p2p.pb.planetserve.v1 import inference_pb2
from ps_p2p.protocols.clove_codec import clove_from_bytes, clove_to_bytes
from ps_p2p.roles.model import ModelNodeConfig, ModelNodeService
from ps_p2p.testing.fakes import InstantEngine

PROXIES = [bytes([i]) * 38 for i in range(1, 5)]


class RecordingOverlay:
    """Collects the response cloves a model node sends, per (proxy, exit path ID)."""

    def __init__(self) -> None:
        self.on_delivery = None
        self.replies: list[tuple[bytes, bytes, bytes]] = []
        self.changed = trio.Event()

    def send_reply(self, proxy: bytes, reply_tag: bytes, clove: bytes, signature: bytes) -> bool:
        records.verify_signature(
            self.identity.peer_id, records.clove_signing_bytes(clove_from_bytes(clove).message_id, clove),
            signature,
        )
        self.replies.append((proxy, reply_tag, clove))
        self.changed.set()
        self.changed = trio.Event()
        return True

    async def wait_replies(self, count: int) -> None:
        with trio.fail_after(5):
            while len(self.replies) < count:
                await self.changed.wait()


def _request(prompt: str, request_id: bytes, path_tag: bytes) -> bytes:
    return inference_pb2.InferenceRequest(
        request_id=request_id,
        prompt=prompt,
        params=inference_pb2.SamplingParams(max_tokens=64),
        reply_proxies=[
            inference_pb2.ReplyProxy(peer_id=p, reply_tag=path_tag + bytes([i]) * 15)
            for i, p in enumerate(PROXIES)
        ],
    ).SerializeToString()


def _deliver(service: ModelNodeService, q: bytes, senders=PROXIES) -> None:
    for sender, clove in zip(senders, sida.encode(q, total=4, threshold=3)):
        service.on_delivery(sender, clove_to_bytes(clove))


def _decode(replies, path_tag: bytes) -> inference_pb2.InferenceResponse:
    assembler = CloveAssembler()
    for _, reply_tag, clove in replies:
        if reply_tag.startswith(path_tag):
            for event in assembler.receive_clove(clove_from_bytes(clove), 0.0):
                if isinstance(event, MessageReassembled):
                    response = inference_pb2.InferenceResponse()
                    response.ParseFromString(event.payload)
                    return response
    raise AssertionError("no response decoded")


async def _running_service(nursery):
    engine = InstantEngine()
    service = ModelNodeService(Identity.generate(), engine, ModelNodeConfig(capacity=1))
    overlay = RecordingOverlay()
    overlay.identity = service.identity
    service.attach(overlay)
    await nursery.start(service.run)
    return service, overlay, engine


async def test_answer_is_signed_and_its_clove_ids_hide_the_request_id():
    async with trio.open_nursery() as nursery:
        service, overlay, _ = await _running_service(nursery)
        rid = os.urandom(16)
        q = _request("a secret question", rid, b"A")
        _deliver(service, q)
        await overlay.wait_replies(4)
        assert {proxy for proxy, _, _ in overlay.replies} == set(PROXIES)
        expected = responses.response_message_id(rid, responses.request_hash(q))
        for _, _, clove in overlay.replies:
            assert clove_from_bytes(clove).message_id == expected
            assert rid not in clove
        response = _decode(overlay.replies, b"A")
        assert response.text == "a secret question"[::-1]
        assert response.model_node == service.identity.peer_id
        nursery.cancel_scope.cancel()


async def test_a_replayed_request_id_with_another_prompt_never_gets_the_cached_answer():
    async with trio.open_nursery() as nursery:
        service, overlay, engine = await _running_service(nursery)
        rid = os.urandom(16)
        _deliver(service, _request("my private medical question", rid, b"A"))
        await overlay.wait_replies(4)
        # a reply proxy that learnt the request ID replays it with its own prompt and proxies
        _deliver(service, _request("anything", rid, b"B"))
        await overlay.wait_replies(8)
        stolen = _decode(overlay.replies[4:], b"B")
        assert "private" not in stolen.text[::-1]
        assert stolen.text == "anything"[::-1]
        assert engine.calls == 2
        nursery.cancel_scope.cancel()


async def test_a_true_retry_is_answered_from_the_cache_without_new_inference():
    async with trio.open_nursery() as nursery:
        service, overlay, engine = await _running_service(nursery)
        rid = os.urandom(16)
        _deliver(service, _request("the same question", rid, b"A"))
        await overlay.wait_replies(4)
        retry = inference_pb2.InferenceRequest()
        retry.ParseFromString(_request("the same question", rid, b"C"))
        _deliver(service, retry.SerializeToString())
        await overlay.wait_replies(8)
        assert _decode(overlay.replies[4:], b"C").text == "the same question"[::-1]
        assert engine.calls == 1
        nursery.cancel_scope.cancel()


async def test_a_malformed_clove_is_dropped_without_raising():
    async with trio.open_nursery() as nursery:
        service, overlay, _ = await _running_service(nursery)
        service.on_delivery(PROXIES[0], b"\xff\x00 not a clove")
        assert service.dropped_cloves == 1
        nursery.cancel_scope.cancel()


async def test_a_refused_request_is_logged_as_refused_with_its_status_not_as_served(caplog):
    """Issue 21: a prompt too long for the model was logged "served ...: 0+0 tokens"."""
    import logging

    caplog.set_level(logging.INFO, logger="ps_p2p.roles.model")
    async with trio.open_nursery() as nursery:
        engine = InstantEngine(max_context=16)
        service = ModelNodeService(Identity.generate(), engine, ModelNodeConfig(capacity=1))
        overlay = RecordingOverlay()
        overlay.identity = service.identity
        service.attach(overlay)
        await nursery.start(service.run)
        rid = os.urandom(16)
        _deliver(service, _request("a prompt far longer than the sixteen of the context", rid, b"A"))
        await overlay.wait_replies(4)
        nursery.cancel_scope.cancel()

    lines = [r.getMessage() for r in caplog.records if rid.hex()[:8] in r.getMessage()]
    assert lines and not any(line.startswith("served") for line in lines), lines
    assert any(line.startswith(f"refused {rid.hex()[:8]}: PROMPT_TOO_LONG: ") for line in lines)
