"""A user node dials a few model nodes once it holds its paths (Node._warm_model_links) and opens
its delivery links to them (the model node opens its reply link back), so the first clove it
delivers as a proxy waits neither for a connection nor for a stream."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID

from ps_p2p import node as node_module
from ps_p2p.keys import Identity
from ps_p2p.records import Directory, NodeRecord, Role


def _record(i: int, role: Role) -> NodeRecord:
    ident = Identity.from_private_bytes(bytes([i]) * 32)
    return NodeRecord(ident.peer_id, (f"/ip4/10.0.0.{i}/tcp/4001",), frozenset({role}),
                      b"\x01" * 32, model_id="m" if role is Role.MODEL else "")


class _Network:
    def __init__(self, connected: set[bytes]) -> None:
        self.connected = connected
        self.dialled: list[bytes] = []

    def get_connections(self, peer: ID) -> list[object]:
        return [object()] if peer.to_bytes() in self.connected else []

    async def dial_peer(self, peer: ID) -> object:
        self.dialled.append(peer.to_bytes())
        self.connected.add(peer.to_bytes())
        return object()


class _User:
    def __init__(self) -> None:
        self.ready = trio.Event()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await self.ready.wait()


async def test_a_user_dials_a_few_model_nodes_once_it_holds_its_paths():
    models = [_record(i, Role.MODEL) for i in range(1, 7)]
    users = [_record(i, Role.USER) for i in range(10, 13)]
    network = _Network(connected={models[0].peer_id})
    user = _User()
    warmed: list[bytes] = []
    fake = SimpleNamespace(
        host=SimpleNamespace(get_network=lambda: network), user=user,
        overlay=SimpleNamespace(warm_delivery_link=warmed.append),
        directory=Directory(5, 0, 10**13, tuple(models + users)), rng=random.Random(1),
    )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(node_module.Node._warm_model_links, fake)
        await trio.testing.wait_all_tasks_blocked()
        assert network.dialled == []  # not before the user holds its paths
        user.ready.set()

    model_ids = {r.peer_id for r in models}
    assert 1 <= len(network.dialled) <= node_module.WARM_MODEL_LINKS
    assert set(network.dialled) <= model_ids - {models[0].peer_id}  # never a user, nor twice
    assert len(set(network.dialled)) == len(network.dialled)
    # and its delivery link to each model node it chose, connected before or dialled now
    assert set(network.dialled) <= set(warmed) <= model_ids
    assert len(warmed) == min(node_module.WARM_MODEL_LINKS, len(models))


@pytest.mark.slow
async def test_a_first_request_finds_every_delivery_stream_open_both_ways():
    """Once the users hold their paths they open their delivery links to the model node, and
    the model node opens its reply link back to each: a user's first request (every request
    of a devnet with more users than prompts) opens no stream between proxy and model node."""
    from ps_p2p.testing.localnet import open_localnet
    from ps_p2p.testing.waits import wait_until

    async with open_localnet(users=6) as net:
        model = net.models[0]

        def opened(node) -> int:  # /planetserve/deliver streams the node opened
            return node.overlay.link_stats("deliver").links_opened

        def warm() -> bool:  # each user's link to the model node and the one back, open
            return (opened(model) >= len(net.users) and all(opened(u) >= 1 for u in net.users)
                    and all(u.overlay._deliver_links.has_link(model.peer_id)
                            and model.overlay._deliver_links.has_link(u.peer_id)
                            for u in net.users))

        await wait_until(warm, timeout=30)
        # (a loaded machine may have opened a link twice on the way: count from here)
        before = [opened(model), *(opened(u) for u in net.users)]
        answer = await net.users[0].user.ask("Once upon a time there was a fox", timeout=60)
        assert answer.ok, answer.error
        assert [opened(model), *(opened(u) for u in net.users)] == before  # none opened for it
