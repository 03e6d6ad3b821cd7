"""Embedding: a ps_p2p role on a py-libp2p host that another application built and owns
(ps_p2p.node.attach, Node.serve; docs/embedding.md)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair as ed25519_key_pair
from libp2p.crypto.secp256k1 import create_new_key_pair as secp256k1_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

import ps_p2p
from ps_p2p.config import NodeConfig
from ps_p2p.errors import ConfigError
from ps_p2p.node import Node, attach
from ps_p2p.protocols.committee_directory import COMMITTEE_DIRECTORY_PROTOCOL_ID
from ps_p2p.protocols.handlers import registered_protocols
from ps_p2p.protocols.overlay import CLOVE_PROTOCOL_ID, DELIVER_PROTOCOL_ID, ONION_PROTOCOL_ID
from ps_p2p.roles.user import UserConfig
from ps_p2p.testing.localnet import open_localnet

REPO = pathlib.Path(__file__).resolve().parent.parent


def _example():  # type: ignore[no-untyped-def]
    """docs/examples/embed_user.py as a module: the tests build the application's host and
    its echo protocol the way the documented example does."""
    spec = importlib.util.spec_from_file_location("embed_user", REPO / "docs/examples/embed_user.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()
app_host = EXAMPLE.build_app_host
echo = EXAMPLE.echo
ECHO_PROTOCOL_ID = EXAMPLE.ECHO
echo_round_trip = EXAMPLE.call_echo  # connect (if needed), send, read the echo back
OVERLAY_PROTOCOL_IDS = {ONION_PROTOCOL_ID, CLOVE_PROTOCOL_ID, DELIVER_PROTOCOL_ID}




def user_config(boot: str) -> NodeConfig:
    return NodeConfig(
        roles=["user"],
        bootstrap=[boot],
        directory_refresh=0.5,
        register_interval=2.0,
        user=UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=5.0),
    )


def lonely_user_config() -> NodeConfig:
    """A user whose bootstrap verifier does not exist (nothing listens on port 1)."""
    nobody = ID.from_pubkey(ed25519_key_pair().public_key).to_base58()
    return NodeConfig(
        roles=["user"], bootstrap=[f"/ip4/127.0.0.1/tcp/1/p2p/{nobody}"], register=False,
        status_interval=0,
    )


async def test_an_attached_user_is_answered_beside_the_app_protocol_and_detaches_cleanly():
    async with open_localnet(users=6) as net:
        host = app_host()
        host.set_stream_handler(ECHO_PROTOCOL_ID, echo)
        neighbour = net.users[0].host
        assert neighbour is not None
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            async with attach(host, user_config(net.verifier.listen_addrs[0])) as node:
                assert node.peer_id == host.get_id().to_bytes()
                assert OVERLAY_PROTOCOL_IDS <= registered_protocols(host)

                await node.wait_directory(min_models=1)
                assert node.user is not None
                await node.user.wait_ready(timeout=60)
                answer = await node.user.ask("Once upon a time there was a fox", timeout=60)
                assert answer.ok, answer.error
                assert answer.text == "xof a saw ereht emit a nopu ecnO"
                assert answer.signature_valid

                # the application's protocol works beside ours, from a peer of the network
                await neighbour.connect(PeerInfo(host.get_id(), host.get_addrs()))
                assert await echo_round_trip(neighbour, host, b"hello app") == b"hello app"
                # a stream of ours that is open when we detach
                open_clove = await neighbour.new_stream(host.get_id(), [TProtocol(CLOVE_PROTOCOL_ID)])

            # detached: our protocols are gone, the inbound stream they served was reset, and
            # the host runs on with the application's protocol
            assert not OVERLAY_PROTOCOL_IDS & registered_protocols(host)
            assert str(ECHO_PROTOCOL_ID) in registered_protocols(host)
            with pytest.raises(StreamError):  # a reset stream reads as EOF (py-libp2p 0.8.1)
                await open_clove.read(1)
            with pytest.raises(StreamFailure):  # multistream-select answered "na"
                await neighbour.new_stream(host.get_id(), [TProtocol(CLOVE_PROTOCOL_ID)])
            assert await echo_round_trip(neighbour, host, b"still here") == b"still here"
            assert host.get_network().get_connections(ID(net.users[0].peer_id))
            assert host.get_transport_addrs()


async def test_an_attached_natted_user_reserves_relay_slots_and_is_listed_by_its_circuits():
    """Issue 20 (b): a node attached to an application's host ran no relay client, so a NATed
    embedded user could neither reserve nor advertise circuit addresses (nobody could reach it
    to relay or proxy). Now the client side runs on the application's host, and only it: no
    hop (the application's host relays nobody's circuits), and the STOP handler leaves with
    the node."""
    from dataclasses import replace

    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
    from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID

    from ps_p2p.overlay.circuit_limits import CircuitRelayConfig, circuit_only_relays

    async with open_localnet(users=6) as net:
        host = app_host()
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            config = replace(user_config(net.verifier.listen_addrs[0]),
                             circuit_relay=CircuitRelayConfig(reachability="private"))
            async with attach(host, config) as node:
                with trio.fail_after(60):
                    while True:
                        record = node.directory.record(node.peer_id) if node.directory else None
                        if record is not None and circuit_only_relays(record.addrs):
                            break
                        await node.wait_directory_update()
                relays = circuit_only_relays(record.addrs)
                assert len(relays) == 2 and node.peer_id not in relays
                assert str(STOP_PROTOCOL_ID) in registered_protocols(host)
                assert str(HOP_PROTOCOL_ID) not in registered_protocols(host)
                # the relays now count it among the listed peers (issue 20 c)
                verifier_nat = net.verifier.nat
                assert verifier_nat is not None
                listed = verifier_nat.server.listed
                assert listed is not None
                with trio.fail_after(60):
                    while not listed(node.peer_id):
                        await net.verifier.wait_directory_update()
                assert not listed(ID.from_pubkey(ed25519_key_pair().public_key).to_bytes())
            assert str(STOP_PROTOCOL_ID) not in registered_protocols(host)


async def test_a_verifier_attached_in_the_callers_nursery_stops_with_node_stop():
    host = app_host()
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        node = Node.for_host(host, NodeConfig(roles=["verifier"], status_interval=0))
        async with trio.open_nursery() as nursery:
            started = await nursery.start(node.serve, host)
            assert started is node
            assert str(COMMITTEE_DIRECTORY_PROTOCOL_ID) in registered_protocols(host)
            with trio.fail_after(30):  # a committee of one commits its own record
                while (node.directory is None
                       or node.directory.record(node.peer_id) is None):
                    await node.wait_directory_update()
            await node.stop()
        assert str(COMMITTEE_DIRECTORY_PROTOCOL_ID) not in registered_protocols(host)
        assert host.get_transport_addrs()  # the application's host still listens


async def test_a_host_key_that_is_not_ed25519_is_refused_naming_its_type():
    host = app_host(secp256k1_key_pair())
    with pytest.raises(ConfigError, match="Secp256k1.*Ed25519"):
        async with attach(host, lonely_user_config()):
            pass  # pragma: no cover - never reached


async def test_a_host_offering_plaintext_is_refused():
    host = new_host(key_pair=ed25519_key_pair(), enable_mDNS=False)  # py-libp2p's defaults
    with pytest.raises(ConfigError, match="/plaintext/2.0.0"):
        async with attach(host, lonely_user_config()):
            pass  # pragma: no cover - never reached


async def test_a_second_node_on_the_same_host_is_refused_and_the_first_keeps_its_handlers():
    host = app_host()
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        config = lonely_user_config()
        async with attach(host, config):
            with pytest.raises(ConfigError, match="already serves"):
                async with attach(host, config):
                    pass  # pragma: no cover - never reached
            assert OVERLAY_PROTOCOL_IDS <= registered_protocols(host)
        assert not OVERLAY_PROTOCOL_IDS & registered_protocols(host)


async def test_an_error_in_the_attached_block_propagates_as_itself():
    host = app_host()
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        config = lonely_user_config()
        with pytest.raises(KeyError, match="app failure"):
            async with attach(host, config):
                raise KeyError("app failure")
        assert not OVERLAY_PROTOCOL_IDS & registered_protocols(host)


def test_attach_is_exported_by_the_package():
    assert ps_p2p.attach is attach


@pytest.mark.slow
def test_the_embedding_example_runs_and_prints_the_answer():
    script = REPO / "docs" / "examples" / "embed_user.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "answer: xof a saw ereht emit a nopu ecnO  (signed by the model node: True)" in lines
    assert "echo: b'hello from the app'" in lines
    attached = next(line for line in lines if line.startswith("attached: "))
    assert "/planetserve/onion/1.0.0" in attached and "/myapp/echo/1.0.0" in attached
    detached = next(line for line in lines if line.startswith("after detach: "))
    assert "/planetserve/" not in detached and "/myapp/echo/1.0.0" in detached
