"""Who may speak GossipSub with a model node (ps_p2p.protocols.hrtree_gossip.MemberGate):
only the model nodes of its group in its verified directory (issue 16: an outsider subscribed
to the group's topic and read every load report and delta). Real py-libp2p hosts."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from ps_p2p.config import ForwardingConfig
from ps_p2p.engines.sim_engine import SimEngine
from ps_p2p.gossip.load import LoadTracker
from ps_p2p.keys import Identity
from ps_p2p.protocols import hrtree_gossip as wire
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.records import Directory, NodeRecord, Role
from ps_p2p.testing.waits import wait_until

CONFIG = ForwardingConfig(group_key="22" * 32, load_interval=0.2, delta_interval=0.2)
TOPIC = wire.topic_for("sim")


def _record(identity: Identity) -> NodeRecord:
    return NodeRecord(identity.peer_id, (), frozenset({Role.MODEL}), b"\x00" * 32,
                      model_id="sim", capacity=2, issued_at_ms=0, expires_at_ms=10**13)


def _directory(*ids: Identity) -> Directory:
    return Directory(1, 0, 10**13, tuple(sorted((_record(i) for i in ids),
                                                key=lambda r: r.peer_id)))




async def _host(stack: AsyncExitStack, identity: Identity):  # type: ignore[no-untyped-def]
    host = await stack.enter_async_context(open_host(identity, ["/ip4/127.0.0.1/tcp/0"]))
    return host, await stack.enter_async_context(wire.running_pubsub(host))


async def _start(nursery: trio.Nursery, identity: Identity, host, pubsub,  # type: ignore
                 directory: Directory):
    from ps_p2p.roles.forwarding import GroupForwarding

    fwd = GroupForwarding(identity, SimEngine("sim"), LoadTracker(2, 8), CONFIG)
    fwd.set_directory(directory)
    await nursery.start(fwd.run, host, pubsub)
    return fwd


async def test_an_outsider_subscribing_to_the_groups_topic_is_refused_and_reads_nothing():
    from libp2p.pubsub.gossipsub import GossipSub
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.tools.anyio_service.context import background_trio_service

    a, b, outsider = Identity.generate(), Identity.generate(), Identity.generate()
    directory = _directory(a, b)
    async with AsyncExitStack() as stack:
        a_host, a_pubsub = await _host(stack, a)
        b_host, b_pubsub = await _host(stack, b)
        # the outsider: a plain GossipSub peer (as a js-libp2p one), subscribed to the topic
        o_host = await stack.enter_async_context(
            open_host(outsider, ["/ip4/127.0.0.1/tcp/0"]))
        router = GossipSub(protocols=list(wire.GOSSIPSUB_PROTOCOLS), degree=6, degree_low=4,
                           degree_high=12, heartbeat_interval=1)
        o_pubsub = Pubsub(o_host, router, strict_signing=True)
        await stack.enter_async_context(background_trio_service(o_pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await o_pubsub.wait_until_ready()
        subscription = await o_pubsub.subscribe(TOPIC)
        nursery = await stack.enter_async_context(trio.open_nursery())
        fa = await _start(nursery, a, a_host, a_pubsub, directory)
        await _start(nursery, b, b_host, b_pubsub, directory)
        await connect(o_host, listen_multiaddrs(a_host)[0])
        gate = wire.member_gate(a_pubsub)
        # its subscription reaches A's topic peers (no gate), or its stream is refused (gate)
        await wait_until(lambda: gate.refused >= 1
                     or outsider.peer_id in {p.to_bytes()
                                             for p in a_pubsub.peer_topics.get(TOPIC, ())})
        await connect(b_host, listen_multiaddrs(a_host)[0])
        # members still gossip: B's load reports reach A
        await wait_until(lambda: fa.book.get(b.peer_id) is not None)
        assert outsider.peer_id not in {p.to_bytes() for p in a_pubsub.peer_topics.get(TOPIC, ())}
        assert outsider.peer_id not in {p.to_bytes() for p in a_pubsub.router.mesh.get(TOPIC, ())}
        assert a_pubsub.peers.get(ID_of(outsider)) is None  # nothing of ours goes to it
        got = []
        while True:
            with trio.move_on_after(0):
                got.append(await subscription.get())
                continue
            break
        assert got == [] and fa.dropped.get("not_member", 0) == 0
        nursery.cancel_scope.cancel()


def ID_of(identity: Identity):  # type: ignore[no-untyped-def]
    from libp2p.peer.id import ID

    return ID(identity.peer_id)


async def test_a_member_that_leaves_the_directory_is_dropped_from_the_topic():
    a, b = Identity.generate(), Identity.generate()
    both = _directory(a, b)
    async with AsyncExitStack() as stack:
        a_host, a_pubsub = await _host(stack, a)
        b_host, b_pubsub = await _host(stack, b)
        nursery = await stack.enter_async_context(trio.open_nursery())
        fa = await _start(nursery, a, a_host, a_pubsub, both)
        await _start(nursery, b, b_host, b_pubsub, both)
        await connect(b_host, listen_multiaddrs(a_host)[0])
        b_id = ID_of(b)
        await wait_until(lambda: b_id in a_pubsub.peer_topics.get(TOPIC, ())
                     and b_id in a_pubsub.peers)
        fa.set_directory(_directory(a))  # B is no model node of the group any more
        await wait_until(lambda: b_id not in a_pubsub.peers
                     and b_id not in a_pubsub.peer_topics.get(TOPIC, ())
                     and b_id not in a_pubsub.router.mesh.get(TOPIC, ()))
        assert wire.member_gate(a_pubsub).evicted == 1
        fa.set_directory(both)  # and back: admitted again, over the same connection
        await wait_until(lambda: b_id in a_pubsub.peers
                     and b_id in a_pubsub.peer_topics.get(TOPIC, ()))
        nursery.cancel_scope.cancel()
