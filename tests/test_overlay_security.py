"""Regression tests of the overlay's security findings (issue "Harden the overlay", sec. 1).

Each test reproduces one attack against a live localnet of real py-libp2p hosts and asserts the
attack now costs only the attacker's own cell, delivery or request.
"""

from __future__ import annotations

import pytest

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from ps_p2p import records
from ps_p2p.crypto import sida
from ps_p2p.keys import NodeKeys
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols.clove_codec import clove_to_bytes
from ps_p2p.protocols.framing import encode_frame
from ps_p2p.protocols.host import connect, open_host
from ps_p2p.protocols.overlay import DELIVER_PROTOCOL_ID
from ps_p2p.roles import model as model_role
from ps_p2p.testing.localnet import open_localnet


def _count_backward(node, kind: str) -> list[int]:
    """Count BackwardPayloads of ``kind`` reaching ``node``'s own paths (wraps its callback)."""
    seen = [0]
    inner = node.overlay.on_backward

    def counting(handle, message):
        if message.WhichOneof("kind") == kind:
            seen[0] += 1
        inner(handle, message)

    node.overlay.on_backward = counting
    return seen


async def _until(condition, *nodes, timeout: float = 60.0) -> None:
    """Await ``condition()`` (a counter with no event of its own), re-checking it each time the
    overlay driver of one of ``nodes`` has handled inputs. The drivers' events are taken before
    each check: an input applied between the check and the wait (by a stream handler, the
    driver's shortcut) still wakes it (CoreDriver.processed)."""

    async def wake(event: trio.Event, scope: trio.CancelScope) -> None:
        await event.wait()
        scope.cancel()

    with trio.fail_after(timeout):
        while True:
            events = [node.overlay.driver.processed for node in nodes]
            if condition():
                return
            async with trio.open_nursery() as nursery:
                for event in events:
                    nursery.start_soon(wake, event, nursery.cancel_scope)


async def test_cells_naming_a_node_that_is_no_model_node_kill_no_path():
    # Before: the destination's error reset the proxy's shared clove stream to it and the proxy
    # dropped every path over that link (35 such cells killed 25 of 26 honest paths).
    async with open_localnet(users=6) as net:
        attacker = net.users[0]
        victims = [n for n in net.users if n is not attacker]
        failed = _count_backward(attacker, "delivery_failed")
        lost_before = sum(n.overlay.stats.paths_lost_to_link_down for n in net.users)
        paths = attacker.user.ready_paths()
        sent = 0
        for round_ in range(7):
            for path in paths:
                target = victims[(round_ + sent) % len(victims)].peer_id
                payload = clove_pb2.ForwardPayload(
                    deliver=clove_pb2.DeliverClove(
                        destination=target, clove=b"\x0a\x01x", reply_tag=bytes(16)
                    )
                )
                assert attacker.overlay.send_on_path(path.handle, payload)
                sent += 1
        await _until(lambda: failed[0] >= sent, attacker)
        assert sum(n.overlay.stats.paths_lost_to_link_down for n in net.users) == lost_before
        refused = sum(n.overlay.stats.deliveries_refused for n in net.users)
        assert refused >= sent
        for node in victims:
            answer = await node.user.ask("still served?", timeout=60)
            assert answer.ok, answer.error


@pytest.mark.slow
async def test_a_delivery_from_a_peer_outside_the_directory_is_dropped_and_the_stream_lives():
    async with open_localnet(users=6) as net:
        model = net.models[0]
        async with open_host(NodeKeys.generate().identity, ["/ip4/127.0.0.1/tcp/0"]) as outsider:
            await connect(outsider, model.listen_addrs[0])
            stream = await outsider.new_stream(ID(model.peer_id), [TProtocol(DELIVER_PROTOCOL_ID)])
            (clove,) = sida.encode(b"junk", total=1, threshold=1)
            frame = clove_pb2.DeliveryFrame(delivery=clove_pb2.Delivery(clove=clove_to_bytes(clove)))
            before = model.overlay.stats.deliveries_refused
            for _ in range(3):  # a reset stream would fail the later writes
                await stream.write(encode_frame(frame.SerializeToString()))
            await _until(lambda: model.overlay.stats.deliveries_refused >= before + 3, model)
            assert model.overlay.stats.deliveries == 0
            await stream.close()
        answer = await net.users[0].user.ask("still served?", timeout=60)
        assert answer.ok, answer.error


@pytest.mark.slow
async def test_replies_pass_only_under_a_live_reply_tag_from_its_model_node():
    async with open_localnet(users=6) as net:
        owner, model = net.users[0], net.models[0]
        path = owner.user.ready_paths()[0]
        proxy = net.node(path.relays[-1])
        (entry,) = [
            e for e in proxy.overlay.table._forward.values()
            if e.hop.is_proxy and e.hop.out_path_id == path.handle.path.exit_path_id
        ]
        tag = b"\x42" * 16  # as a request clove would register it for the model node
        assert proxy.overlay.table.add_reply_tag(
            tag, entry, model.peer_id, trio.current_time(), ttl=60.0, replies=1
        )
        signed = _count_backward(owner, "signed_clove")
        intruder = next(n for n in net.users if n.peer_id not in (owner.peer_id, proxy.peer_id))
        (clove,) = sida.encode(b"junk", total=1, threshold=1)
        raw = clove_to_bytes(clove)
        good = model.keys.identity.sign(records.clove_signing_bytes(clove.message_id, raw))
        # refused: an intruder under the live tag, then the model node with a bad signature
        for sender, signature in [(intruder, good), (model, b"\x00" * 64)]:
            before = proxy.overlay.stats.cells_dropped
            sender.overlay.send_reply(proxy.peer_id, tag, raw, signature)
            await _until(lambda: proxy.overlay.stats.cells_dropped > before, proxy)
        # passes: the model node with its signature, once
        model.overlay.send_reply(proxy.peer_id, tag, raw, good)
        await _until(lambda: signed[0] == 1, owner)
        before = proxy.overlay.stats.cells_dropped
        model.overlay.send_reply(proxy.peer_id, tag, raw, good)  # the tag is spent
        await _until(lambda: proxy.overlay.stats.cells_dropped > before, proxy)
        assert signed[0] == 1


@pytest.mark.slow
async def test_a_model_node_cannot_get_honest_proxies_convicted(monkeypatch):
    # Before: M2, told the response ID of an answer from M1, sent cloves under that ID through the
    # proxies of a request to M2; the user checked them against M1 and avoided 4 of 4 honest
    # proxies for 10 minutes.
    async with open_localnet(users=6, models=2) as net:
        client = net.users[0].user
        m1, m2 = net.models
        first = await client.ask("to M1", model_node=m1.peer_id, timeout=60)
        assert first.ok, first.error
        (response_id,) = list(client._audits)  # the answer M2 is told about

        def forged_answer(self, command):
            waiter = command.waiter
            proxies = waiter.query.reply_proxies
            cloves = sida.encode(b"forged", total=len(proxies), threshold=waiter.threshold,
                                 message_id=response_id)
            for proxy, clove in zip(proxies, cloves):
                raw = clove_to_bytes(clove)
                sig = self.identity.sign(records.clove_signing_bytes(clove.message_id, raw))
                self.overlay.send_reply(proxy.peer_id, proxy.reply_tag, raw, sig)

        monkeypatch.setattr(model_role.ModelNodeService, "_send_answer", forged_answer)
        before = client.misrouted_cloves
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: client.ask("to M2", model_node=m2.peer_id, timeout=60))
            await _until(lambda: client.misrouted_cloves >= before + 3, net.users[0])
            nursery.cancel_scope.cancel()
        assert client.avoided_proxies == frozenset()


async def test_a_peer_outside_the_directory_holds_only_its_small_share_of_a_relay_s_table():
    # Issue 16 (HIGH 5): ten identities outside the directory filled a relay's 10,000 paths in
    # 11 s, after which honest setups through it failed 0/5.
    import time

    from ps_p2p.crypto import onion
    from ps_p2p.protocols import onion_setup

    async with open_localnet(users=4) as net:
        relay = net.users[0]
        table = relay.overlay.table
        async with open_host(NodeKeys.generate().identity, ["/ip4/127.0.0.1/tcp/0"]) as outsider:
            await connect(outsider, relay.listen_addrs[0])
            stream = await outsider.new_stream(
                ID(relay.peer_id), [TProtocol(onion_setup.ONION_PROTOCOL_ID)]
            )
            spec = [onion.HopSpec(relay.peer_id, relay.keys.onion.public)]
            before = relay.overlay.stats.setups_over_share
            sent = table.max_unlisted_per_peer + 20
            for _ in range(sent):
                path, packet = onion.create_path(spec, issued_at=int(time.time()))
                frame = onion_setup.encode_setup(path.first_path_id, packet)
                await stream.write(encode_frame(frame))
            await _until(lambda: relay.overlay.stats.setups_over_share >= before + 20, relay)
            assert table.paths_from(outsider.get_id().to_bytes()) == table.max_unlisted_per_peer
            await stream.close()
        answer = await net.users[1].user.ask("still served?", timeout=60)
        assert answer.ok, answer.error
