"""Tests of the node's web page (ps_p2p.api.web): the network view and the user's chat.

Fast tests serve the page with hypercorn in the test's trio run, over
:class:`~ps_p2p.testing.fakes.FakeUserNode` (a directory with this user, six relays and one model
node; a user client with ready paths), on the user's API port and on ``--web``'s own port, and
read it with httpx. The browser test (slow) is in tests/test_web_browser.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from libp2p.peer.id import ID

from ps_p2p.api.openai_compat import serve_api
from ps_p2p.api.web import network_view, serve_web
from ps_p2p.config import load_config
from ps_p2p.errors import ConfigError
from ps_p2p.records import Directory
from ps_p2p.testing.fakes import FakeUserNode

XSS = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'


def b58(peer_id: bytes) -> str:
    return ID(peer_id).to_base58()


@asynccontextmanager
async def _serve(node: object, server: Any = serve_api) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(server, node, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client
        nursery.cancel_scope.cancel()


def _with_model_record(node: FakeUserNode, **fields: Any) -> None:
    """Replace the fake directory's model node record by one with ``fields`` changed (the page
    reads records as they are: signatures were checked when the directory was)."""
    d = node.directory
    assert d is not None
    changed = dataclasses.replace(node.model_record, **fields)
    node.directory = Directory(
        height=d.height, issued_at_ms=d.issued_at_ms, expires_at_ms=d.expires_at_ms,
        records=tuple(changed if r.peer_id == changed.peer_id else r for r in d.records))
    node.model_record = changed


# ------------------------------------------------------------------------------ network view


async def test_network_json_groups_the_model_nodes_by_model_with_trust_and_capacity():
    node = FakeUserNode()
    async with _serve(node) as client:
        r = await client.get("/web/network.json")

    assert r.status_code == 200
    view = r.json()
    assert view["node"]["peer_id"] == node.keys.identity.peer_id_str
    assert view["node"]["health"] == {"ok": True, "reasons": []}
    assert view["directory"]["height"] == 1
    assert [g["model_id"] for g in view["models"]] == ["fake-model"]
    assert view["models"][0]["nodes"] == [{
        "peer_id": b58(node.model_record.peer_id), "organization": "", "capacity": 2,
        "reputation": None, "trust": "trusted", "load": None, "lost": False, "self": False,
    }]
    assert view["users"] == {"listed": 7, "ready_paths": 5, "distinct_proxies": 5,
                             "paths_needed": node.config.user.total}


async def test_network_page_shows_the_model_group_its_node_and_this_users_paths():
    node = FakeUserNode()
    async with _serve(node) as client:
        r = await client.get("/web")

    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    assert '<h3 class="model-id"' in html and "fake-model" in html
    assert f'data-peer-id="{b58(node.model_record.peer_id)}"' in html
    assert '<span class="ok">trusted</span>' in html
    assert "7 users listed" in html
    assert '<span id="ready-paths">5</span> ready paths' in html


async def test_a_model_node_the_user_found_lost_is_shown_lost():
    node = FakeUserNode()
    assert node.user is not None
    node.user.lose(node.model_record.peer_id)
    async with _serve(node) as client:
        view = (await client.get("/web/network.json")).json()
        html = (await client.get("/web")).text

    assert view["models"][0]["nodes"][0]["lost"] is True
    assert '<span class="bad">lost</span>' in html


async def test_the_page_never_names_the_relays_of_this_users_paths():
    node = FakeUserNode()
    async with _serve(node) as client:
        html = (await client.get("/web")).text
        text = (await client.get("/web/network.json")).text

    for relay in node.relay_records:
        assert b58(relay.peer_id) not in html + text
        assert b58(relay.peer_id)[-8:] not in html + text


async def test_a_record_field_with_html_is_shown_escaped_never_as_markup():
    node = FakeUserNode(model_id=XSS)
    _with_model_record(node, organization=XSS)
    async with _serve(node) as client:
        page = (await client.get("/web")).text
        chat = (await client.get("/web/chat")).text
        view = (await client.get("/web/network.json")).json()

    escaped = "&lt;script&gt;alert(&#34;pwned&#34;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"
    for html in (page, chat):
        assert "<script>alert" not in html
        assert "<img src=x" not in html
        assert escaped in html
    assert page.count(escaped) == 2  # the model group and the organization
    assert view["models"][0]["model_id"] == XSS  # JSON carries it as data


async def test_the_committee_of_a_verifier_shows_validators_connections_and_evidence():
    node = FakeUserNode()
    a, b = (b58(r.peer_id) for r in node.relay_records[:2])

    def committee_status() -> dict[str, Any]:
        return {
            "chain_id": "chain-x", "height": 12, "round": 0, "step": "propose",
            "committed_height": 11, "last_commit_time_ms": 1_700_000_000_000,
            "validators": [
                {"peer_id": a, "power": 10, "excluded": False, "connected": True},
                {"peer_id": b, "power": 10, "excluded": True, "connected": False},
            ],
            "mempool": 3, "evidence": 1, "equivocators": [b],
        }

    node.committee_status = committee_status  # type: ignore[attr-defined]
    async with _serve(node) as client:
        view = (await client.get("/web/network.json")).json()
        html = (await client.get("/web")).text

    committee = view["committee"]
    assert committee["member"] is True
    assert (committee["committed_height"], committee["evidence"]) == (11, 1)
    assert [v["connected"] for v in committee["validators"]] == [True, False]
    assert "deciding height 12" in html and "evidence 1 against" in html
    assert "excluded (evidence)" in html
    assert html.count('<span class="bad">no</span>') == 1


async def test_a_non_validator_shows_the_validators_it_trusts_and_its_directory_commit():
    node = FakeUserNode()
    trusted = node.relay_records[0].peer_id
    node.trusted_verifiers = frozenset({trusted})  # type: ignore[attr-defined]

    view = network_view(node)

    assert view["committee"]["member"] is False
    assert view["committee"]["validators"] == [
        {"peer_id": b58(trusted), "power": None, "excluded": False, "connected": False}]
    assert view["committee"]["committed_height"] == 1
    assert view["committee"]["last_commit_time_ms"] == node.directory.issued_at_ms


async def test_before_a_directory_the_page_says_so_and_lists_no_model():
    node = FakeUserNode()
    node.directory = None
    async with _serve(node) as client:
        r = await client.get("/web")

    assert r.status_code == 200
    assert "no verified directory yet" in r.text
    assert "No model node listed." in r.text


# ------------------------------------------------------------------------------ routes


async def test_the_api_ports_root_redirects_to_the_page():
    async with _serve(FakeUserNode()) as client:
        r = await client.get("/")

    assert r.status_code == 307
    assert r.headers["location"] == "/web"


async def test_the_chat_page_on_the_api_port_posts_streamed_chats_to_the_local_api():
    async with _serve(FakeUserNode()) as client:
        r = await client.get("/web/chat")

    assert r.status_code == 200
    assert '<option value="fake-model">fake-model</option>' in r.text
    assert 'fetch("/v1/chat/completions"' in r.text
    assert "stream: true, stream_options: {include_usage: true}" in r.text
    assert ".innerHTML" not in r.text  # network text is written as textContent only


async def test_the_web_port_serves_the_page_but_not_the_chat_or_the_api():
    node = FakeUserNode()
    async with _serve(node, serve_web) as client:
        page = await client.get("/web")
        chat = await client.get("/web/chat")
        completions = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]})

    assert page.status_code == 200 and "fake-model" in page.text
    assert 'href="/web/chat"' not in page.text
    assert chat.status_code == 404
    assert completions.status_code == 404
    assert node.user is not None and node.user.calls == []


async def test_a_streamed_chat_ends_with_the_signer_and_its_verified_signature():
    """What the chat page reads: the last chunk's ``planetserve`` member."""
    import json

    node = FakeUserNode()
    async with _serve(node) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}})

    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    last = json.loads(events[-2])
    assert events[-1] == "[DONE]"
    assert last["planetserve"]["served_by"] == b58(node.model_record.peer_id)
    assert last["planetserve"]["signature_valid"] is True


# ------------------------------------------------------------------------------ ps-node run --web


async def test_ps_node_run_with_web_serves_the_page_of_a_verifier(tmp_path, caplog):
    import logging
    import re

    from ps_p2p.cli import _run_config, _run_node_at_home, build_parser

    caplog.set_level(logging.INFO)
    config = _run_config(build_parser().parse_args(
        ["run", "--role", "verifier", "--home", str(tmp_path / "v"), "--web", "127.0.0.1:0"]))
    async with trio.open_nursery() as nursery:
        node = await nursery.start(_run_node_at_home, config, None, None)
        (url,) = re.findall(r"web page on (http://\S+)/web", caplog.text)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            view = (await client.get("/web/network.json")).json()
            page = await client.get("/web")
        nursery.cancel_scope.cancel()

    assert view["node"]["peer_id"] == node.keys.identity.peer_id_str
    committee = view["committee"]
    assert committee["member"] is True
    assert [v["peer_id"] for v in committee["validators"]] == [view["node"]["peer_id"]]
    assert committee["validators"][0]["connected"] is True
    assert page.status_code == 200 and "deciding height" in page.text


def test_ps_node_run_with_a_web_address_in_use_exits_1_naming_it(tmp_path, capsys):
    import socket

    from ps_p2p.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"

        status = main(["run", "--role", "verifier", "--key-file", str(tmp_path / "node.key"),
                       "--web", address])

    assert status == 1
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ps-node: ")]
    assert f"--web {address}" in line and "in use" in line


# ------------------------------------------------------------------------------ config


def test_web_is_off_by_default_and_a_config_key_or_flag_sets_it():
    verifier = {"roles": ["verifier"]}
    assert load_config(None, verifier).web is None
    assert load_config(None, {**verifier, "web": "127.0.0.1:8080"}).web == "127.0.0.1:8080"


def test_a_web_address_that_is_not_host_port_is_refused():
    with pytest.raises(ConfigError, match="--web"):
        load_config(None, {"roles": ["verifier"], "web": "8080"})
