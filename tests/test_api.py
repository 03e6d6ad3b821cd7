"""Service tests of the local OpenAI-compatible API (ps_p2p.api.openai_compat).

Each test runs a whole in-process network (ps_p2p.testing.localnet: real py-libp2p hosts, the
fake InstantEngine) and serves user 0's API with hypercorn on 127.0.0.1 in the same trio run;
requests go through httpx as an application's would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import trio

from ps_p2p.api.openai_compat import serve_api
from ps_p2p.testing.localnet import LocalNet, open_localnet

PROMPT = "Once upon a time there was a fox"


@dataclass
class Api:
    net: LocalNet
    client: httpx.AsyncClient


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    """A 6-user local network and an HTTP client on user 0's API."""
    async with open_localnet(users=6) as net:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_api, net.users[0], "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                yield Api(net, client)
            nursery.cancel_scope.cancel()


def _assert_openai_error(body: dict) -> None:
    assert set(body["error"]) == {"message", "type", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]


async def test_completion_returns_the_model_answer_as_a_text_completion(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64})

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert [c["text"] for c in body["choices"]] == [PROMPT[::-1]]
    assert body["usage"]["completion_tokens"] == len(PROMPT)


async def test_completion_carries_planetserve_metadata_of_the_signing_model_node(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT})

    assert r.status_code == 200, r.text
    meta = r.json()["planetserve"]
    assert meta["served_by"] == api.net.models[0].keys.identity.peer_id_str
    assert meta["served_by"].startswith("12D3KooW")
    assert meta["signature_valid"] is True
    assert meta["cloves_received"] >= 3
    assert meta["attempts"] >= 1
    assert meta["latency_ms"] > 0


async def test_models_lists_the_model_id_of_the_model_node(api):
    r = await api.client.get("/v1/models")

    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]


async def test_status_lists_the_ready_paths_with_three_relays_each(api):
    user = api.net.users[0]

    r = await api.client.get("/status")

    assert r.status_code == 200
    body = r.json()
    assert body["peer_id"] == user.keys.identity.peer_id_str
    assert body["directory"]["users"] == 6
    assert body["directory"]["model_nodes"] == 1
    paths = body["ready_paths"]
    assert len(paths) == len(user.user.ready_paths()) >= 4
    for path in paths:
        assert len(path["relays"]) == 3
        assert all(relay.startswith("12D3KooW") for relay in path["relays"])
        assert user.keys.identity.peer_id_str not in path["relays"]
        assert path["proxy"] == path["relays"][-1]


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
        (b'{"prompt": "hi", "max_tokens": "many"}', "bad parameter"),
        (b'{"prompt": "hi", "timeout": "soon"}', "bad parameter"),
        (b'{"prompt": "hi", "timeout": -1}', "timeout"),
        (b'{"prompt": "hi", "timeout": "nan"}', "timeout"),
    ],
    ids=["not-json", "not-object", "no-prompt", "empty-prompt", "prompt-not-string",
         "max-tokens-0", "max-tokens-too-big", "max-tokens-not-int", "timeout-not-number",
         "timeout-negative", "timeout-nan"],
)
async def test_bad_completion_body_gets_400_with_an_openai_error(api, content, reason):
    r = await api.client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )

    assert r.status_code == 400
    body = r.json()
    _assert_openai_error(body)
    assert body["error"]["type"] == "invalid_request_error"
    assert reason in body["error"]["message"]


async def test_completion_for_an_unknown_model_id_gets_503_with_an_openai_error(api):
    r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "model": "no-such-model"})

    assert r.status_code == 503
    body = r.json()
    _assert_openai_error(body)
    assert "no-such-model" in body["error"]["message"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/chat"), ("GET", "/v1/completions"),
                                          ("POST", "/status")])
async def test_unknown_route_gets_404_with_an_openai_error(api, method, path):
    r = await api.client.request(method, path)

    assert r.status_code == 404
    _assert_openai_error(r.json())


async def test_request_to_a_dead_model_node_gets_504_within_its_timeout(api):
    api.net.kill(api.net.models[0])

    with trio.fail_after(15):
        r = await api.client.post("/v1/completions", json={"prompt": PROMPT, "timeout": 3})

    assert r.status_code == 504
    body = r.json()
    _assert_openai_error(body)
    assert "RequestTimeoutError" in body["error"]["message"]
    assert body["planetserve"]["signature_valid"] is False
    assert body["planetserve"]["served_by"] == ""
