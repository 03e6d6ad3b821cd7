"""A node's health (ps_p2p.health): the answer of ``GET /health`` on the API port and of
``ps-node status`` — 200 when every role can serve, else 503 naming why."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import trio

from ps_p2p.api.openai_compat import serve_api
from ps_p2p.config import NodeConfig
from ps_p2p.health import node_health
from ps_p2p.testing.fakes import FakeUserNode


async def test_a_user_with_a_model_node_and_n_distinct_proxies_is_healthy():
    assert node_health(FakeUserNode()).as_json() == {"ok": True, "reasons": []}


async def test_a_user_whose_only_model_node_is_lost_is_unhealthy_naming_it():
    node = FakeUserNode()
    node.user.lose(node.model_record.peer_id)

    health = node_health(node)

    assert not health.ok and health.reasons == ("no reachable model node in the directory",)


async def test_a_user_with_too_few_distinct_proxies_is_unhealthy_naming_the_counts():
    node = FakeUserNode(paths=2)  # n = 4 proxies needed

    assert node_health(node).reasons == ("ready paths reach 2 distinct proxies; a request needs 4",)


async def test_a_node_without_a_directory_is_unhealthy():
    node = FakeUserNode()
    node.directory = None

    assert node_health(node).reasons == ("no verified directory yet",)


def _model_node(*, draining: bool, listed: bool) -> SimpleNamespace:
    directory = FakeUserNode().directory
    peer = directory.model_nodes()[0].peer_id if listed else b"\x00" * 38
    return SimpleNamespace(
        directory=directory, user=None, peer_id=peer, config=NodeConfig(roles=["model"]),
        model=SimpleNamespace(dispatcher=SimpleNamespace(draining=draining)))


async def test_a_model_node_is_unhealthy_while_draining_or_before_the_directory_lists_it():
    assert node_health(_model_node(draining=False, listed=True)).ok
    assert node_health(_model_node(draining=True, listed=True)).reasons == (
        "draining: new requests are refused",)
    assert node_health(_model_node(draining=False, listed=False)).reasons == (
        "this model node is not in the verified directory yet",)


def _verifier(connected: int, n: int = 4) -> SimpleNamespace:
    validators = [{"connected": i < connected} for i in range(n)]
    return SimpleNamespace(directory=FakeUserNode().directory, user=None,
                           committee_status=lambda: {"validators": validators})


async def test_a_verifier_is_healthy_with_a_quorum_of_validators_connected():
    assert node_health(_verifier(3)).ok  # 2f+1 = 3 of 4
    assert node_health(_verifier(2)).reasons == ("2 of 4 validators connected; a block needs 3",)
    assert node_health(_verifier(1, n=1)).ok  # a committee of one


# ------------------------------------------------------------------ on the API port


async def _get(node: object, path: str) -> httpx.Response:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_api, node, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.get(path)
        nursery.cancel_scope.cancel()
    return response


async def test_health_on_the_api_port_is_200_when_ready_and_503_with_reasons_when_not():
    node = FakeUserNode()
    ok = await _get(node, "/health")
    node.user.lose(node.model_record.peer_id)
    down = await _get(node, "/health")

    assert (ok.status_code, ok.json()) == (200, {"ok": True, "reasons": []})
    assert (down.status_code, down.json()) == (
        503, {"ok": False, "reasons": ["no reachable model node in the directory"]})


async def test_metrics_on_the_api_port_serve_the_node_registry_in_prometheus_text():
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("planetserve_test_things", "Things.", registry=registry).inc(3)
    node = FakeUserNode()
    node.metrics = SimpleNamespace(registry=registry)

    r = await _get(node, "/metrics")

    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    assert "planetserve_test_things_total 3.0" in r.text


async def test_metrics_of_a_node_that_keeps_none_get_404():
    r = await _get(FakeUserNode(), "/metrics")

    assert r.status_code == 404 and r.json()["error"]["message"] == "this node keeps no metrics"
