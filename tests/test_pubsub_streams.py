"""GossipSub streams a peer opens to a node (ps_p2p.protocols.hrtree_gossip.running_pubsub) end
when the peer ends them: the node does not hold them half-open for the connection's life."""

from __future__ import annotations

import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID

from ps_p2p.keys import Identity
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.protocols import hrtree_gossip
from ps_p2p.protocols.hrtree_gossip import GOSSIPSUB_PROTOCOLS, running_pubsub


async def _ended_by_the_node(stream) -> bool:
    """Read until the node ends or resets ``stream`` (True), or it sends data (False)."""
    try:
        return await stream.read(1024) == b""
    except (StreamEOF, StreamReset):
        return True


def _streams_of(host, peer: ID) -> int:
    """Yamux streams ``host`` holds on its connections to ``peer``."""
    conns = host.get_network().get_connections(peer)
    return sum(len(conn.muxed_conn.streams) for conn in conns)


async def test_a_gossipsub_stream_the_peer_closed_is_ended_by_the_node_and_not_held():
    # found by benchmarks/fuzz_protocols.py: py-libp2p's pubsub read loop returns at the peer's
    # EOF without ending its side, so every opened-and-closed stream stayed in the node's Yamux
    # table until the connection closed (a peer could make a node hold any number of them)
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as node, \
            running_pubsub(node) as pubsub, \
            open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as peer:
        gate = getattr(hrtree_gossip, "member_gate", None)
        if gate is not None:  # where meshsub streams are gated to group members: admit the peer
            gate(pubsub).admit(lambda peer_id: True)
        await connect(peer, listen_multiaddrs(node)[0])
        streams = []
        for i in range(20):
            stream = await peer.new_stream(node.get_id(), [TProtocol(GOSSIPSUB_PROTOCOLS[i % 2])])
            await stream.close()
            streams.append(stream)
        # the node ends each stream (our read sees its end); 30 s only bounds a failure
        with trio.fail_after(30):
            for stream in streams:
                assert await _ended_by_the_node(stream)
        assert _streams_of(node, peer.get_id()) == 0
