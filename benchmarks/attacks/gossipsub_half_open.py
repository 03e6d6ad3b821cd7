"""Finding (issue 16, LOW, found by benchmarks/fuzz_protocols.py): GossipSub streams held half-open.

A node running GossipSub (:func:`ps_p2p.protocols.hrtree_gossip.running_pubsub`, as every model
node with forwarding does) on a real in-process py-libp2p host; an outsider (a fresh identity,
in no directory) connects and, ``--streams`` times, opens a ``/meshsub/1.1.0`` (or ``1.0.0``)
stream and closes it at once. py-libp2p's pubsub read loop returns at the outsider's end of the
stream without ending its own side, so the node keeps each stream in its Yamux table for as long
as the connection lives. Printed: the streams the node still holds on that connection
``--wait`` seconds after the last close.

    python benchmarks/attacks/gossipsub_half_open.py [--streams 500] [--wait 2]

Measured (2 shared cores, defaults): before the fix the node holds 500 of 500 (and the fuzzer's
100,000-input runs stopped at their time limit: every such stream cost a worker a 10 s wait).
After: 0 of 500.
"""

from __future__ import annotations

import argparse
import sys

import trio

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from libp2p.custom_types import TProtocol  # noqa: E402

from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host  # noqa: E402
from ps_p2p.protocols.hrtree_gossip import GOSSIPSUB_PROTOCOLS, running_pubsub  # noqa: E402


async def main(streams: int, wait: float) -> None:
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as node, \
            running_pubsub(node), \
            open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as outsider:
        await connect(outsider, listen_multiaddrs(node)[0])
        opened = []
        for i in range(streams):
            stream = await outsider.new_stream(node.get_id(),
                                               [TProtocol(GOSSIPSUB_PROTOCOLS[i % 2])])
            await stream.close()
            opened.append(stream)
        await trio.sleep(wait)  # time for the node to handle the closes
        conns = node.get_network().get_connections(outsider.get_id())
        held = sum(len(conn.muxed_conn.streams) for conn in conns)
        print(f"outsider opened and closed {streams} GossipSub streams; {wait:g} s later the node "
              f"holds {held} of them on the connection ({streams - held} ended)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--wait", type=float, default=2.0)
    args = p.parse_args()
    trio.run(main, args.streams, args.wait)
