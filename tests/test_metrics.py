"""Prometheus metrics of a node (ps_p2p.metrics): ``/metrics`` scraped over HTTP from nodes of a
local network after a request, one registry per node, a metrics address in use refused at start,
and the periodic status line."""

from __future__ import annotations

import errno
import logging
import re
import socket

import httpx
import prometheus_client
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from ps_p2p.config import NodeConfig
from ps_p2p.keys import NodeKeys
from ps_p2p.metrics import status_line
from ps_p2p.node import Node
from ps_p2p.testing.localnet import open_localnet

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def _scrape(url: str | None) -> Samples:
    """GET ``url`` (a node's /metrics) and parse the text exposition format."""
    assert url is not None, "the node serves no metrics"
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return _parse(response.text)


def _parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_a_request_shows_on_the_user_relay_and_model_node_metrics():
    async with open_localnet(users=6, metrics=True) as net:
        user = net.users[0]
        before = await _scrape(user.metrics.url)
        assert _value(before, "planetserve_requests_total", outcome="ok") == 0

        answer = await user.user.ask("Once upon a time", timeout=60)
        assert answer.ok, answer.error

        after = await _scrape(user.metrics.url)
        assert _value(after, "planetserve_requests_total", outcome="ok") == 1
        assert _value(after, "planetserve_request_duration_seconds_count", outcome="ok") == 1
        assert _value(after, "planetserve_time_to_first_token_seconds_count") == 1
        assert _value(after, "planetserve_paths", state="ready") == 5
        assert _value(after, "planetserve_paths_target") == 5
        assert _value(after, "planetserve_paths_built_total") >= 5
        assert _value(after, "planetserve_directory_records") == 8
        assert _value(after, "planetserve_directory_nodes", role="user") == 6
        assert _value(after, "planetserve_directory_height") >= 8

        relay = net.node(user.user.ready_paths()[0].relays[0])
        relayed = await _scrape(relay.metrics.url)
        assert _value(relayed, "planetserve_cells_relayed_total") > 0
        assert _value(relayed, "planetserve_relay_paths") >= 1
        assert _value(relayed, "planetserve_link_frames_sent_total", protocol="clove") > 0

        model = await _scrape(net.models[0].metrics.url)
        assert _value(model, "planetserve_deliveries_total") >= 3  # k cloves decode
        assert _value(model, "planetserve_model_requests_total", outcome="admitted") == 1
        assert _value(model, "planetserve_answers_sent_total", status="ok") == 1
        assert _value(model, "planetserve_engine_jobs_total") == 1
        assert _value(model, "planetserve_engine_queue_depth") == 0
        assert _value(model, "planetserve_requests_total", outcome="ok") is None  # no user
        assert _value(model, "planetserve_time_to_first_token_seconds_count") is None

        assert re.fullmatch(
            r"engine queue 0, 0/2 running, 1 served, 0 overloaded, "
            r"directory height \d+ \(8 records\)",
            status_line(net.models[0]),
        ), status_line(net.models[0])

        verifier = await _scrape(net.verifier.metrics.url)
        assert _value(verifier, "planetserve_registry_records") == 8

        assert re.fullmatch(
            r"5/5 paths ready, 1 requests ok / 0 failed, relaying \d+ paths, "
            r"directory height \d+ \(8 records\)",
            status_line(user),
        ), status_line(user)


async def test_two_nodes_in_one_process_have_independent_registries():
    async with open_localnet(users=6, metrics=True) as net:
        asker, other = net.users[0], net.users[1]
        assert (await asker.user.ask("hello", timeout=60)).ok

        asked, idle = await _scrape(asker.metrics.url), await _scrape(other.metrics.url)

        assert asker.metrics.registry is not other.metrics.registry
        assert asker.metrics.url != other.metrics.url
        assert _value(asked, "planetserve_requests_total", outcome="ok") == 1
        assert _value(idle, "planetserve_requests_total", outcome="ok") == 0
        assert _value(idle, "planetserve_request_duration_seconds_count", outcome="ok") == 0
        infos = [
            {labels for (name, labels) in samples if name == "planetserve_node_info"}
            for samples in (asked, idle)
        ]
        assert infos[0] != infos[1]
        # read on the node's own trio thread too (no HTTP server thread in between)
        local = _parse(prometheus_client.generate_latest(asker.metrics.registry).decode())
        assert _value(local, "planetserve_requests_total", outcome="ok") == 1
        # prometheus-client's global default registry holds nothing of ours
        assert not [
            m.name for m in prometheus_client.REGISTRY.collect()
            if m.name.startswith("planetserve")
        ]


async def test_a_metrics_address_in_use_fails_the_node_start_naming_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        node = Node(NodeConfig(roles=["verifier"], metrics=address), NodeKeys.generate())

        with pytest.raises(OSError) as raised:
            await node.run()

    assert raised.value.errno == errno.EADDRINUSE
    assert f"cannot serve metrics on {address}" in str(raised.value)
    assert node.host is None  # refused before the host started


async def test_the_status_line_is_logged_every_status_interval(caplog):
    logged = trio.Event()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("status of "):
                logged.set()

    handler = Signal()
    logging.getLogger("ps_p2p.node").addHandler(handler)
    caplog.set_level(logging.INFO, logger="ps_p2p.node")
    try:
        node = Node(NodeConfig(roles=["verifier"], status_interval=0.05), NodeKeys.generate())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            with trio.fail_after(10):
                await logged.wait()
            nursery.cancel_scope.cancel()
    finally:
        logging.getLogger("ps_p2p.node").removeHandler(handler)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("status of ")]
    line = lines[0]
    assert re.fullmatch(
        r"status of \S+: committed height \d+ \(\d+ records, mempool \d+\), "
        r"(no directory yet|directory height \d+ \(\d+ records\))",
        line,
    ), line
