"""Service tests of the local OpenAI-compatible API (ps_p2p.api.openai_compat).

The API is served by hypercorn on 127.0.0.1 in the test's trio run and spoken to with httpx as
an application would. Behind it stands :class:`~ps_p2p.testing.fakes.FakeUserNode`: a directory
with one model node, five ready paths of three relays, and a user client that answers at once
(the prompt reversed, as the fake engine does) or fails with the typed error a test queues.
One slow test serves a real user node of an in-process network (ps_p2p.testing.localnet).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import trio
from libp2p.peer.id import ID

from ps_p2p.api.openai_compat import MAX_BODY_BYTES, serve_api
from ps_p2p.errors import (
    ContextLengthError,
    DecodeError,
    ModelNodeError,
    ModelNodeLostError,
    NoModelNodeError,
    NoPathError,
    OverloadedError,
    RequestError,
    RequestRefusedError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from ps_p2p.inference import ResponseStatus
from ps_p2p.testing.fakes import AskCall, FakeUserClient, FakeUserNode
from ps_p2p.testing.localnet import open_localnet

PROMPT = "Once upon a time there was a fox"


def b58(peer_id: bytes) -> str:
    return ID(peer_id).to_base58()


@dataclass
class Api:
    node: FakeUserNode
    client: httpx.AsyncClient

    @property
    def user(self) -> FakeUserClient:
        assert self.node.user is not None
        return self.node.user


@asynccontextmanager
async def _serve(node: object) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_api, node, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client
        nursery.cancel_scope.cancel()


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    """The API of a fake user node, and an HTTP client on it."""
    node = FakeUserNode()
    async with _serve(node) as client:
        yield Api(node, client)


def _assert_openai_error(body: dict) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]


# ------------------------------------------------------------------------------ completions


async def test_completion_returns_the_model_answer_as_a_text_completion(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64})

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"] == "cmpl-" + api.user.answers[0].request_id.hex()
    assert isinstance(body["created"], int)
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": PROMPT[::-1], "finish_reason": "length",
                                "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": len(PROMPT),
                             "total_tokens": 2 * len(PROMPT)}


async def test_completion_carries_planetserve_metadata_of_the_signing_model_node(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT})

    assert r.status_code == 200, r.text
    answer = api.user.answers[0]
    assert r.json()["planetserve"] == {
        "request_id": answer.request_id.hex(),
        "served_by": b58(api.node.model_record.peer_id),
        "forwarded_by": None,
        "signature_valid": True,
        "cloves_received": 3,
        "latency_ms": 25.0,
        "attempts": 1,
    }
    assert r.json()["planetserve"]["served_by"].startswith("12D3KooW")


async def test_completion_passes_the_body_parameters_to_the_user_client(api):
    r = await api.client.post("/v1/completions", json={
        "prompt": PROMPT, "model": "fake-model", "max_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "seed": 42, "timeout": 3,
    })

    assert r.status_code == 200, r.text
    assert api.user.calls == [AskCall(
        prompt=PROMPT, model_id="fake-model", max_tokens=7, temperature=0.5, top_p=0.9, seed=42,
        model_node=None, timeout=3.0,
    )]
    assert r.json()["choices"][0]["text"] == PROMPT[::-1][:7]


async def test_completion_without_parameters_asks_with_the_defaults(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT})

    assert r.status_code == 200, r.text
    assert api.user.calls == [AskCall(
        prompt=PROMPT, model_id=None, max_tokens=128, temperature=0.0, top_p=1.0, seed=None,
        model_node=None, timeout=None,
    )]


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"this is not JSON", "not JSON"),
        (b'["a", "list"]', "JSON object"),
        (b'{"max_tokens": 8}', "prompt"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": 42}', "prompt"),
        (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 5000}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": "hi", "timeout": "soon"}', "timeout"),
        (b'{"prompt": "hi", "timeout": -1}', "timeout"),
        (b'{"prompt": "hi", "timeout": "nan"}', "timeout"),
        (b'{"prompt": "hi", "timeout": 3601}', "timeout"),
    ],
    ids=["not-json", "not-object", "no-prompt", "empty-prompt", "prompt-not-string",
         "max-tokens-0", "max-tokens-too-big", "max-tokens-not-int", "timeout-not-number",
         "timeout-negative", "timeout-nan", "timeout-over-an-hour"],
)
async def test_bad_completion_body_gets_400_with_an_openai_error_and_asks_nothing(
    api, content, reason
):
    r = await api.client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )

    assert r.status_code == 400
    body = r.json()
    _assert_openai_error(body)
    assert body["error"]["type"] == "invalid_request_error"
    assert reason in body["error"]["message"]
    assert api.user.calls == []


async def test_completion_body_over_the_limit_gets_400(api):
    content = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'

    r = await api.client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )

    assert r.status_code == 400
    assert "body over" in r.json()["error"]["message"]
    assert api.user.calls == []


async def test_completion_for_an_unknown_model_id_gets_404_model_not_found(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "model": "no-such-model"})

    assert r.status_code == 404
    body = r.json()
    _assert_openai_error(body)
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"
    assert "no-such-model" in body["error"]["message"]
    assert api.user.calls == []


# ------------------------------------------------------------- typed failures -> HTTP status


@pytest.mark.parametrize(
    "error, status",
    [
        (RequestTimeoutError("no answer within 3 s"), 504),
        (NoPathError("only 2 of 4 paths ready"), 503),
        (NoModelNodeError("no model node in the directory"), 503),
        (ModelNodeLostError("model node 12D3KooWabc stopped answering"), 503),
        (OverloadedError("OVERLOADED: queue full", status=ResponseStatus.OVERLOADED), 503),
        (RequestRefusedError("BAD_REQUEST: top_p", status=ResponseStatus.BAD_REQUEST), 400),
        (RequestRefusedError("WRONG_MODEL: other", status=ResponseStatus.WRONG_MODEL), 400),
        (ContextLengthError("PROMPT_TOO_LONG: 9000", status=ResponseStatus.PROMPT_TOO_LONG), 400),
        (RequestTooLargeError("request of 70000 bytes"), 400),
        (ModelNodeError("ENGINE_ERROR: CUDA", status=ResponseStatus.ENGINE_ERROR), 502),
        (RequestError("something else"), 502),
        (DecodeError("no 3-subset decodes"), 502),
    ],
    ids=["timeout-504", "no-path-503", "no-model-node-503", "model-node-lost-503",
         "overloaded-503",
         "bad-request-400", "wrong-model-400", "prompt-too-long-400", "too-large-400",
         "engine-error-502", "other-request-error-502", "decode-error-502"],
)
async def test_failed_request_gets_the_http_status_of_its_error_class(api, error, status):
    api.user.fail_next(error)

    r = await api.client.post("/v1/completions", json={"prompt": PROMPT})

    assert r.status_code == status
    body = r.json()
    _assert_openai_error(body)
    assert body["error"]["type"] == ("invalid_request_error" if status == 400 else "planetserve_error")
    assert body["error"]["code"] == type(error).__name__
    assert body["error"]["message"] == api.user.answers[0].error
    assert body["planetserve"]["error_type"] == type(error).__name__
    assert body["planetserve"]["request_id"] == api.user.answers[0].request_id.hex()
    assert body["planetserve"]["attempts"] == api.user.answers[0].attempts


async def test_timed_out_request_gets_504_with_no_signer(api):
    api.user.fail_next(RequestTimeoutError("no answer within 3 s"))

    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "timeout": 3})

    assert r.status_code == 504
    meta = r.json()["planetserve"]
    assert meta["error_type"] == "RequestTimeoutError"
    assert meta["signature_valid"] is False
    assert meta["served_by"] == ""
    assert api.user.calls[0].timeout == 3.0


async def test_signed_error_status_names_the_model_node_that_signed_it(api):
    api.user.fail_next(OverloadedError("OVERLOADED: queue full", status=ResponseStatus.OVERLOADED))

    r = await api.client.post("/v1/completions", json={"prompt": PROMPT})

    assert r.status_code == 503
    meta = r.json()["planetserve"]
    assert meta["error_type"] == "OverloadedError"
    assert meta["signature_valid"] is True
    assert meta["served_by"] == b58(api.node.model_record.peer_id)


async def test_a_failure_costs_one_request_and_the_next_is_answered(api):
    api.user.fail_next(OverloadedError("OVERLOADED", status=ResponseStatus.OVERLOADED))

    first = await api.client.post("/v1/completions", json={"prompt": PROMPT})
    second = await api.client.post("/v1/completions", json={"prompt": PROMPT})

    assert (first.status_code, second.status_code) == (503, 200)
    assert second.json()["choices"][0]["text"] == PROMPT[::-1]


async def test_completion_on_a_node_without_the_user_role_gets_503():
    async with _serve(FakeUserNode(user_role=False)) as client:
        r = await client.post("/v1/completions", json={"prompt": PROMPT})

    assert r.status_code == 503
    body = r.json()
    _assert_openai_error(body)
    assert body["error"]["code"] == "no_user_role"


# ------------------------------------------------------------------------- models, status


async def test_models_lists_the_model_id_of_the_model_node(api):
    r = await api.client.get("/v1/models")

    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert body["data"] == [{"id": "fake-model", "object": "model", "created": 0,
                             "owned_by": "planetserve"}]


async def test_status_lists_the_ready_paths_with_three_relays_each(api):
    node = api.node

    r = await api.client.get("/status")

    assert r.status_code == 200
    body = r.json()
    assert body["peer_id"] == node.keys.identity.peer_id_str
    assert body["roles"] == ["user"]
    assert body["listen"] == node.listen_addrs
    assert body["directory"] == {"height": 1, "users": 7, "model_nodes": 1}
    paths = body["ready_paths"]
    assert [p["relays"] for p in paths] == [
        [b58(r) for r in p.relays] for p in api.user.ready_paths()
    ]
    assert len(paths) == 5
    relay_ids = {b58(r.peer_id) for r in node.relay_records}
    for path in paths:
        assert len(path["relays"]) == 3
        assert set(path["relays"]) <= relay_ids
        assert node.keys.identity.peer_id_str not in path["relays"]
        assert path["proxy"] == path["relays"][-1]
        assert path["age_s"] >= 0


async def test_status_of_a_node_without_a_directory_says_so():
    node = FakeUserNode()
    node.directory = None

    async with _serve(node) as client:
        r = await client.get("/status")

    assert r.status_code == 200
    assert r.json()["directory"] is None


@pytest.mark.parametrize(
    "relays, directory, ready",
    [(6, True, True), (3, True, False), (6, False, False)],
    ids=["n-distinct-proxies", "3-proxies-for-n-4", "no-directory"],
)
async def test_status_is_ready_with_a_model_node_and_n_distinct_proxies(relays, directory, ready):
    node = FakeUserNode(relays=relays)
    if not directory:
        node.directory = None

    async with _serve(node) as client:
        r = await client.get("/status")

    assert r.json()["ready"] is ready


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/chat", 404), ("GET", "/v1/completions", 405), ("POST", "/status", 405),
])
async def test_unknown_route_or_method_gets_an_openai_error(api, method, path, status):
    r = await api.client.request(method, path)

    assert r.status_code == status
    body = r.json()
    _assert_openai_error(body)
    assert body["error"]["code"] == ("not_found" if status == 404 else "method_not_allowed")


# ----------------------------------------------------------------------- real network (slow)


@pytest.mark.slow
async def test_completion_through_a_real_local_network_is_answered_and_signed():
    async with open_localnet(users=6) as net:
        user = net.users[0]
        async with _serve(user) as client:
            models = await client.get("/v1/models")
            status = await client.get("/status")
            r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64})
            health = await client.get("/health")
            metrics = await client.get("/metrics")

    assert (health.status_code, health.json()) == (200, {"ok": True, "reasons": []})
    assert metrics.status_code == 200
    assert 'planetserve_requests_total{outcome="ok"} 1.0' in metrics.text
    assert [m["id"] for m in models.json()["data"]] == ["fake-model"]
    assert status.json()["directory"]["users"] == 6
    assert all(len(p["relays"]) == 3 for p in status.json()["ready_paths"])
    assert len(status.json()["ready_paths"]) >= 4
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == PROMPT[::-1]
    assert body["planetserve"]["served_by"] == net.models[0].keys.identity.peer_id_str
    assert body["planetserve"]["signature_valid"] is True
    assert body["planetserve"]["cloves_received"] >= 3


# ------------------------------------------------------------------------------ first-day defects
# (issue 21): seed 0, null parameters, the model of streamed chunks, image parts


async def test_seed_zero_is_asked_as_seed_zero_and_no_seed_as_unseeded(api):
    await api.client.post("/v1/completions", json={"prompt": PROMPT, "seed": 0,
                                                   "temperature": 1.0})
    await api.client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 1.0})

    assert [c.seed for c in api.user.calls] == [0, None]


async def test_seed_zero_with_n_gives_each_choice_its_own_seed(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "seed": 0, "n": 3})

    assert r.status_code == 200, r.text
    assert sorted(c.seed for c in api.user.calls) == [0, 1, 2]


def test_seed_zero_survives_the_wire_and_absent_stays_unseeded():
    from ps_p2p.inference import InferenceQuery, SamplingParams
    from ps_p2p.protocols.inference_codec import decode_query, encode_query

    def roundtrip(seed: int | None) -> int | None:
        q = InferenceQuery(request_id=b"r" * 16, model_id="m", prompt="p",
                           params=SamplingParams(seed=seed), reply_proxies=())
        return decode_query(encode_query(q)).params.seed

    assert [roundtrip(0), roundtrip(None), roundtrip(7)] == [0, None, 7]


@pytest.mark.parametrize("param", ["temperature", "top_p", "n", "stream", "max_tokens", "seed",
                                   "stop", "stream_options", "model"])
async def test_null_for_an_optional_parameter_means_its_default(api, param):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, param: None})

    assert r.status_code == 200, r.text
    call = api.user.calls[0]
    assert (call.temperature, call.top_p, call.max_tokens, call.seed, call.stop) == (
        0.0, 1.0, 128, None, ())
    assert r.json()["object"] == "text_completion"  # stream null: not streamed


async def test_null_parameters_of_a_chat_mean_their_defaults(api):
    r = await api.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": None, "top_p": None,
        "n": None, "stream": None, "max_completion_tokens": None})

    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
async def test_every_streamed_chunk_names_the_model_when_the_request_names_none(api, path, body):
    async with api.client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]

    import json
    chunks = [json.loads(line[len("data: "):]) for line in lines]
    assert len(chunks) >= 3
    assert {c["model"] for c in chunks} == {"fake-model"}


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
async def test_a_chat_with_a_non_text_part_is_refused_as_only_text_supported(api, part):
    r = await api.client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]})

    assert r.status_code == 400
    error = r.json()["error"]
    assert "only text content is supported" in error["message"]
    assert error["param"] == "messages"
    assert len(error["message"]) < 200
    assert api.user.calls == []


async def test_after_the_only_model_node_is_lost_no_model_is_listed_and_nothing_is_ready(api):
    assert (await api.client.get("/status")).json()["ready"] is True
    api.user.lose(api.node.model_record.peer_id)

    assert (await api.client.get("/v1/models")).json()["data"] == []
    assert (await api.client.get("/status")).json()["ready"] is False


@pytest.mark.parametrize("model", [None, "fake-model"])
async def test_after_the_only_model_node_is_lost_requests_get_503_no_model_node(api, model):
    await api.client.get("/v1/models")  # the model was listed once
    api.user.lose(api.node.model_record.peer_id)

    body = {"prompt": PROMPT} if model is None else {"prompt": PROMPT, "model": model}
    r = await api.client.post("/v1/completions", json=body)

    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "NoModelNodeError"


async def test_a_model_seen_before_whose_node_left_the_directory_gets_503_not_404(api):
    from ps_p2p.records import Directory

    await api.client.get("/v1/models")
    d = api.node.directory
    api.node.directory = Directory(
        height=2, issued_at_ms=d.issued_at_ms, expires_at_ms=d.expires_at_ms,
        records=tuple(r for r in d.records if r.peer_id != api.node.model_record.peer_id))

    seen = await api.client.post("/v1/completions", json={"prompt": PROMPT, "model": "fake-model"})
    never = await api.client.post("/v1/completions", json={"prompt": PROMPT, "model": "other"})

    assert (seen.status_code, seen.json()["error"]["code"]) == (503, "NoModelNodeError")
    assert (never.status_code, never.json()["error"]["code"]) == (404, "model_not_found")


async def test_a_client_that_leaves_mid_stream_cancels_its_request():
    """The stream is written by Starlette's StreamingResponse, which notices the disconnect;
    the request through the overlay is then cancelled, not left running."""
    node = FakeUserNode()
    cancelled = trio.Event()
    started = trio.Event()

    async def ask_forever(*args, on_text=None, **kwargs):
        on_text("Once")
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    node.user.ask = ask_forever
    async with _serve(node) as client:
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": PROMPT, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # the first chunk came: leave
        with trio.fail_after(10):
            await cancelled.wait()
    assert started.is_set()
