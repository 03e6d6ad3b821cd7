"""Service tests: a whole network of real py-libp2p hosts in one process (ps_p2p.testing.localnet).

The policies behind them are tested on the cores (tests/test_relay_core.py, test_path_pool.py,
test_requests.py, test_dispatch.py); three smoke tests run by default, the rest are marked slow and
run in CI.
"""

from __future__ import annotations

import dataclasses

import pytest

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from ps_p2p.crypto import onion
from ps_p2p.errors import ModelNodeLostError
from ps_p2p.pb.planetserve.v1 import clove_pb2, onion_pb2
from ps_p2p.protocols.framing import encode_frame, encode_varint
from ps_p2p.protocols.overlay import CLOVE_MAX_FRAME, CLOVE_PROTOCOL_ID, ONION_PROTOCOL_ID
from ps_p2p.roles.user import UserConfig
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.testing.localnet import open_localnet


async def test_prompt_crosses_the_overlay_and_signed_answer_returns():
    async with open_localnet(users=6) as net:
        user = net.users[0]
        answer = await user.user.ask("Once upon a time there was a fox", timeout=60)
        assert answer.ok, answer.error
        assert answer.text == "xof a saw ereht emit a nopu ecnO"
        assert answer.signature_valid
        assert answer.served_by == net.models[0].peer_id
        assert answer.cloves_received >= 3
        model = net.models[0]
        # the model node received cloves only from proxies, never from the asking user itself
        assert model.overlay.stats.deliveries >= 3


@pytest.mark.slow
async def test_every_path_has_three_distinct_relays_and_excludes_the_user():
    async with open_localnet(users=6) as net:
        for node in net.users:
            for path in node.user.ready_paths():
                assert len(path.relays) == 3
                assert len(set(path.relays)) == 3
                assert node.peer_id not in path.relays


@pytest.mark.slow
async def test_paths_become_disjoint_when_the_network_is_large_enough():
    # Paths built while the directory was still filling may share relays; the pool replaces
    # them until no relay serves two paths of one user.
    cfg = UserConfig(total=2, threshold=2, paths=2, probe_interval=0.5, probe_timeout=2.0)
    async with open_localnet(users=8, user_config=cfg) as net:
        for node in net.users:
            with trio.fail_after(60):
                while True:
                    ready = node.user.ready_paths()
                    relays = [r for p in ready for r in p.relays]
                    if len(ready) >= cfg.paths and len(relays) == len(set(relays)):
                        break
                    await node.user.wait_changed()


@pytest.mark.slow
async def test_tampering_relay_cannot_stop_or_alter_answers():
    async with open_localnet(users=6, tamper=(5,)) as net:
        tamperer = net.users[5]
        for i, node in enumerate(net.users[:5]):
            answer = await node.user.ask(f"prompt number {i} about a cat", timeout=60)
            assert answer.ok, answer.error
            assert answer.text == f"prompt number {i} about a cat"[::-1]
            assert answer.signature_valid
        assert tamperer.overlay.stats.tampered > 0


async def test_request_survives_a_relay_killed_mid_request():
    gate = trio.Event()
    engine = InstantEngine(gate=gate)
    async with open_localnet(users=7, engine_factory=lambda i: engine) as net:
        asker = net.users[0]
        victim_id = asker.user.ready_paths()[0].relays[1]
        victim = net.node(victim_id)
        result = {}

        async def ask():
            result["answer"] = await asker.user.ask("the relay dies while I wait", timeout=60)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await engine.entered.wait()  # the request has reached the engine
            net.kill(victim)
            gate.set()
        answer = result["answer"]
        assert answer.ok, answer.error
        assert answer.text == "the relay dies while I wait"[::-1]
        # the pool repairs itself: the asker gets back to N ready paths, none through the victim
        with trio.fail_after(60):
            while not (
                len(asker.user.ready_paths()) >= asker.config.user.paths
                and all(victim_id not in p.relays for p in asker.user.ready_paths())
            ):
                await asker.user.wait_changed()


@pytest.mark.slow
async def test_model_node_down_gives_an_error_before_the_deadline():
    async with open_localnet(users=6) as net:
        # a process that died: its connections close. (``kill`` leaves its sockets open, which
        # is a frozen host, and users already hold links to model nodes: Node._warm_model_links)
        await net.crash(net.models[0])
        with trio.fail_after(60):
            answer = await net.users[0].user.ask("anyone there?", timeout=30)
        assert not answer.ok
        # the proxies cannot deliver to it and say so: the user learns it long before 30 s
        assert answer.error_type is ModelNodeLostError, answer.error
        assert answer.latency_ms < 10_000


@pytest.mark.slow
async def test_full_queue_answers_overloaded_instead_of_silence():
    gate = trio.Event()
    engine = InstantEngine(gate=gate)
    async with open_localnet(
        users=6,
        engine_factory=lambda i: engine,
        model_capacity=1,
        model_max_queue=0,
    ) as net:
        results = []

        async def ask(node, text):
            results.append(await node.user.ask(text, timeout=60))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, net.users[0], "first")
            await engine.entered.wait()
            second = await net.users[1].user.ask("second", timeout=60)
            gate.set()
        assert not second.ok
        assert second.error.startswith("OVERLOADED")
        assert second.signature_valid
        assert results[0].ok


@pytest.mark.slow
async def test_prompt_too_long_for_the_model_is_reported():
    async with open_localnet(users=6, engine_factory=lambda i: InstantEngine(max_context=100)) as net:
        answer = await net.users[0].user.ask("y" * 500, max_tokens=10, timeout=60)
        assert not answer.ok
        assert answer.error.startswith("PROMPT_TOO_LONG")
        assert answer.signature_valid


async def test_malformed_and_oversized_frames_reset_one_stream_and_the_node_serves_on():
    async with open_localnet(users=6) as net:
        target = net.users[1]
        sender = net.users[0]
        host = sender.host
        for protocol, frame in [
            (CLOVE_PROTOCOL_ID, encode_frame(b"\xff\xff\xff not protobuf")),
            (ONION_PROTOCOL_ID, encode_frame(b"\x0a\x05garbage-setup")),
            (CLOVE_PROTOCOL_ID, encode_varint(CLOVE_MAX_FRAME + 10) + b"x" * 100),
        ]:
            stream = await host.new_stream(ID(target.peer_id), [TProtocol(protocol)])
            await stream.write(frame)
            with trio.fail_after(60):
                try:
                    while await stream.read(1024):
                        pass
                except Exception:
                    pass  # reset or EOF: the remote dropped this stream
        answer = await sender.user.ask("still alive?", timeout=60)
        assert answer.ok, answer.error


@pytest.mark.slow
async def test_cell_with_unknown_path_id_is_dropped_and_counted():
    async with open_localnet(users=6) as net:
        target = net.users[2]
        before = target.overlay.stats.cells_dropped
        frame = clove_pb2.CloveFrame(cell=clove_pb2.Cell(path_id=b"\x01" * 16, payload=b"\x00" * 1024))
        stream = await net.users[0].host.new_stream(ID(target.peer_id), [TProtocol(CLOVE_PROTOCOL_ID)])
        await stream.write(encode_frame(frame.SerializeToString()))
        with trio.fail_after(60):
            while target.overlay.stats.cells_dropped == before:
                await target.overlay.driver.wait_processed()
        await stream.close()



@pytest.mark.slow
async def test_paths_are_rotated_after_the_rotation_period_and_the_pool_refills():
    cfg = UserConfig(probe_interval=0.5, probe_timeout=2.0, rotate_period=3.0, request_timeout=1.0)
    async with open_localnet(users=6, user_config=cfg) as net:
        client = net.users[0].user
        first = {p.handle.key for p in client.ready_paths()}
        with trio.fail_after(60):
            while not (
                len(client.ready_paths()) >= cfg.paths
                and not first & {p.handle.key for p in client.ready_paths()}
            ):
                await client.wait_changed()
        answer = await client.ask("after rotation", timeout=60)
        assert answer.ok, answer.error


@pytest.mark.slow
async def test_a_dead_node_leaves_the_directory_when_its_record_expires():
    async with open_localnet(users=6, record_lifetime=3.0) as net:
        victim = net.users[5]
        observer = net.users[0]
        assert observer.directory.record(victim.peer_id) is not None
        net.kill(victim)
        with trio.fail_after(60):
            while observer.directory.record(victim.peer_id) is not None:
                await observer.wait_directory_update()
        # the live nodes keep re-registering: their records outlive many lifetimes
        assert len(observer.directory.users()) == 5


@pytest.mark.slow
async def test_a_replayed_setup_packet_is_refused():
    async with open_localnet(users=6) as net:
        sender, target = net.users[0], net.users[1]
        record = sender.directory.record(target.peer_id)
        _, packet = onion.create_path([onion.HopSpec(target.peer_id, record.onion_key)])
        stream = await sender.host.new_stream(ID(target.peer_id), [TProtocol(ONION_PROTOCOL_ID)])
        for path_id in (b"\x01" * 16, b"\x02" * 16):
            frame = onion_pb2.OnionFrame(setup=onion_pb2.OnionSetup(path_id=path_id, packet=packet))
            await stream.write(encode_frame(frame.SerializeToString()))
        with trio.fail_after(60):
            while target.overlay.stats.setups_replayed < 1:
                await target.overlay.driver.wait_processed()
        assert target.overlay.stats.setups_replayed == 1
        await stream.close()


@pytest.mark.slow
async def test_a_long_run_of_requests_over_the_same_paths_is_all_answered():
    # each request registers a reply tag at each of its proxies; tags must not pile up on a
    # path until answers are refused (the benchmark's 200 requests once hit such a limit)
    async with open_localnet(users=6) as net:
        client = net.users[0].user
        for i in range(90):
            answer = await client.ask(f"request {i}", timeout=60)
            assert answer.ok, (i, answer.error)


@pytest.mark.slow
async def test_a_proxy_that_alters_response_cloves_is_caught_and_avoided():
    async with open_localnet(users=6) as net:
        # the tamperer: a proxy of some user's ready path (which users are proxies depends on
        # the random peer IDs), turned bad once the paths are built
        client_node, tamperer = next(
            (n, m) for n in net.users for m in net.users
            if m is not n and any(p.relays[-1] == m.peer_id for p in n.user.ready_paths()))
        tamperer.overlay.core.config = dataclasses.replace(tamperer.overlay.core.config,
                                                           tamper=True)
        client = client_node.user
        for i in range(12):
            answer = await client.ask(f"question {i}", timeout=60)
            assert answer.ok, answer.error
            if tamperer.peer_id in client.avoided_proxies:
                break
        assert tamperer.peer_id in client.avoided_proxies
        assert all(p.relays[-1] != tamperer.peer_id for p in client.ready_paths())
        honest = {n.peer_id for n in net.users if n is not tamperer}
        assert not client.avoided_proxies & honest
