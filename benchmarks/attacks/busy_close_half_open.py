"""Finding (issue 16, LOW, found by benchmarks/fuzz_protocols.py): frame streams left half-open
when the node's connection is busy at their close.

Every frame protocol of the overlay (onion, clove, deliver) is served by
:func:`ps_p2p.protocols.links.make_frame_handler`: at the peer's end of a stream the handler
closes its side, giving the close 1 s. py-libp2p's Yamux marks a stream whose close was
cancelled as closed without having sent the FIN, so when the node's connection is busy for more
than 1 s (its writes wait behind one another: a large reply, a slow reader, a loaded machine),
the peer never sees the stream end and the node keeps it for the connection's life. An attacker
who keeps the connection busy (or just a loaded machine, as in the fuzzer's run) makes every
stream closed meanwhile such a stream.

Here: a node serving a frame protocol with that handler on a real in-process py-libp2p host; a
peer opens ``--streams`` streams, sends a frame on each, then, while the node's connection is
busy writing (its Yamux write lock held ``--busy`` seconds), closes them all. Printed: the
streams whose end the peer saw within 5 s after the connection was free again, and the streams
the node still holds.

    python benchmarks/attacks/busy_close_half_open.py [--streams 50] [--busy 2]

Measured (2 shared cores, defaults): before the fix the peer saw 0 of 50 streams end and the
node held 50; after: 50 of 50 ended, the node holds 0.
"""

from __future__ import annotations

import argparse
import sys

import trio

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from libp2p.custom_types import TProtocol  # noqa: E402
from libp2p.network.stream.exceptions import StreamEOF, StreamReset  # noqa: E402

from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host  # noqa: E402
from ps_p2p.protocols.links import make_frame_handler  # noqa: E402

PROTOCOL = TProtocol("/attack/frames/1.0.0")


async def main(streams: int, busy: float) -> None:
    received = 0
    all_in = trio.Event()

    def on_frame(peer: bytes, frame: bytes) -> None:
        nonlocal received
        received += 1
        if received == streams:
            all_in.set()

    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as node, \
            open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as peer:
        node.set_stream_handler(PROTOCOL, make_frame_handler(str(PROTOCOL), 1024, on_frame))
        await connect(peer, listen_multiaddrs(node)[0])
        opened = []
        for _ in range(streams):
            stream = await peer.new_stream(node.get_id(), [PROTOCOL])
            await stream.write(b"\x01x")
            opened.append(stream)
        await all_in.wait()
        conn = node.get_network().get_connections(peer.get_id())[0].muxed_conn
        async with conn._write_lock:  # the node's connection is busy writing
            for stream in opened:
                await stream.close()
            await trio.sleep(busy)
        ended = 0

        async def watch(stream) -> None:  # type: ignore[no-untyped-def]
            nonlocal ended
            try:
                await stream.read(100)
            except (StreamEOF, StreamReset):
                pass
            ended += 1

        with trio.move_on_after(5):
            async with trio.open_nursery() as nursery:
                for stream in opened:
                    nursery.start_soon(watch, stream)
        print(f"{streams} streams closed while the node's connection was busy {busy:g} s: the peer "
              f"saw {ended} of them end; the node holds {len(conn.streams)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--busy", type=float, default=2.0)
    args = p.parse_args()
    trio.run(main, args.streams, args.busy)
