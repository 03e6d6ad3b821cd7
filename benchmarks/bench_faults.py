"""Accuracy of the TEST ONLY link delay (ps_p2p.testing.faults, issue 17): ping round trips
between two py-libp2p hosts on 127.0.0.1, without the injector, with it at delay 0 and at
delay D (a round trip should gain 2 x D). Prints median and p99 per case, in ms.

    python benchmarks/bench_faults.py [--pings 200] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import trio
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.peer.id import ID

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ps_p2p.keys import Identity
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.testing.faults import FaultInjector, Faults, LinkRule


async def _case(pings: int, delay: float | None) -> list[float]:
    a_id, b_id = Identity.generate(), Identity.generate()
    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
            b_id, ["/ip4/127.0.0.1/tcp/0"]) as b, trio.open_nursery() as nursery:
        if delay is not None:
            faults = FaultInjector(Faults({b_id.peer_id: LinkRule(delay)}))
            faults.install(a, nursery)
        await connect(a, listen_multiaddrs(b)[0])
        stream = await a.new_stream(ID(b_id.peer_id), [PING_PROTOCOL_ID])
        times = []
        for _ in range(pings):
            start = trio.current_time()
            await perform_ping_roundtrip(stream)
            times.append((trio.current_time() - start) * 1000)
        nursery.cancel_scope.cancel()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args()
    print(f"{'case':<22}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'expected ms':>13}")
    for name, delay in (("no injector", None), ("injector, delay 0", 0.0),
                        (f"delay {args.delay} s", args.delay)):
        pings = args.pings if not delay else max(20, args.pings // 10)
        times = sorted(trio.run(_case, pings, delay))
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        expected = "" if delay is None else f">= {2000 * delay:.0f}"
        print(f"{name:<22}{statistics.median(times):>9.2f}{p99:>9.2f}{times[-1]:>9.2f}"
              f"{expected:>13}")


if __name__ == "__main__":
    main()
