"""Accuracy of the multi-host testnet's WAN profiles (issue 20): requested vs measured.

Two public hosts of a :class:`~ps_p2p.testing.netns.Testbed` (root, ip, nft, tc). For each
case, a TCP echo server in host ``b`` and a client in host ``a`` (separate processes, trio,
TCP_NODELAY), each end wrapping its connection in the test-only
:class:`~ps_p2p.testing.faults.DelayedConn` holding half the link's one-way delay, as
``ps-node multihost`` does through the nodes' faults files; the client sends 64 bytes and waits
for the echo, ``--count`` times (10 ms apart). Cases: the bare veth (no wrapper), the wrapper
at 0 ms, each profile's least and most one-way delay, and the lossy profile (its median delay
plus nftables' 1% per packet loss on both hosts, :meth:`~ps_p2p.testing.netns.Testbed.set_loss`).
Also the packet loss itself: UDP datagrams echoed between the two hosts (a round trip crosses
two 1% draws: 1.99% expected).

Prints per case: requested round trip (2 x one-way), measured median, p99 and max (ms).

    python benchmarks/bench_wan_profiles.py [--count 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from ps_p2p.testing import netns
from ps_p2p.testing.multihost import REPO

ECHO = r'''
import json, sys, time, trio
from ps_p2p.testing.faults import DelayedConn

class Stream:  # a trio stream as a py-libp2p ReadWriteCloser
    def __init__(self, s): self.s = s
    async def read(self, n=None): return await self.s.receive_some(n or 65536)
    async def write(self, d): await self.s.send_all(d)
    async def close(self): await self.s.aclose()

def wrap(stream, delay, nursery):
    return Stream(stream) if delay < 0 else DelayedConn(Stream(stream), lambda: delay, nursery)

async def main(mode, ip, delay, count):
    if mode == "server":
        async def handle(stream):
            async with trio.open_nursery() as nursery:
                conn = wrap(stream, delay, nursery)
                while (data := await conn.read(None)):
                    await conn.write(data)
                nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_tcp, handle, 7003)
            print("up", flush=True)
        return
    async with trio.open_nursery() as nursery:
        conn = wrap(await trio.open_tcp_stream(ip, 7003), delay, nursery)
        rtts = []
        for _ in range(count):
            t0 = time.perf_counter()
            await conn.write(b"x" * 64)
            got = 0
            while got < 64:
                got += len(await conn.read(None))
            rtts.append((time.perf_counter() - t0) * 1000)
            await trio.sleep(0.01)
        print(json.dumps(rtts), flush=True)
        nursery.cancel_scope.cancel()

trio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
'''

UDP = r'''
import socket, sys
mode, ip, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if mode == "server":
    s.bind(("0.0.0.0", 7004)); print("up", flush=True)
    while True:
        d, a = s.recvfrom(100)
        try: s.sendto(d, a)
        except OSError: pass  # dropped on the way out (nft: EPERM)
s.settimeout(0.05); got = 0
for i in range(count):
    try:
        s.sendto(str(i).encode(), (ip, 7004)); got += s.recvfrom(100)[0] == str(i).encode()
    except OSError: pass
print(got)
'''


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def echo_case(bed: netns.Testbed, a: netns.Host, b: netns.Host, one_way_ms: float | None,
              count: int) -> list[float]:
    """Round trips (ms); ``one_way_ms`` None: no DelayedConn at all."""
    half = -1.0 if one_way_ms is None else one_way_ms / 2000.0
    server = bed.popen(b, [sys.executable, "-c", ECHO, "server", "", str(half), "0"],
                       stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert server.stdout.readline().strip() == "up"
        client = bed.popen(a, [sys.executable, "-c", ECHO, "client", b.ip, str(half),
                               str(count)], stdout=subprocess.PIPE, text=True, env=_env())
        return json.loads(client.communicate(timeout=600)[0])
    finally:
        server.kill()
        server.wait()


def udp_loss(bed: netns.Testbed, a: netns.Host, b: netns.Host, count: int) -> float:
    server = bed.popen(b, [sys.executable, "-c", UDP, "server", "", "0"],
                       stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        client = bed.popen(a, [sys.executable, "-c", UDP, "client", b.ip, str(count)],
                           stdout=subprocess.PIPE, text=True)
        return 1 - int(client.communicate(timeout=600)[0]) / count
    finally:
        server.kill()
        server.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200, help="round trips per case")
    ap.add_argument("--udp", type=int, default=20000, help="UDP datagrams for the loss")
    args = ap.parse_args()
    reason = netns.unavailable_reason()
    if reason:
        print(f"no testbed here: {reason}")
        return 1
    print(f"load: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores")
    cases: list[tuple[str, float | None]] = [("veth, no wrapper", None), ("lan (0 ms)", 0.0)]
    for name in ("continental", "intercontinental"):
        low, high, _ = netns.PROFILES[name]
        cases += [(f"{name} {low:.0f} ms", low), (f"{name} {high:.0f} ms", high)]
    with netns.Testbed() as bed:
        a, b = bed.add_host("a"), bed.add_host("b")
        print(f"{'case':<28} {'asked RTT':>9} {'median':>8} {'p99':>8} {'max':>8}  (ms)")
        for label, ms in cases:
            rtts = sorted(echo_case(bed, a, b, ms, args.count))
            p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
            asked = "-" if ms is None else f"{2 * ms:.1f}"
            print(f"{label:<28} {asked:>9} {statistics.median(rtts):8.1f} {p99:8.1f} "
                  f"{rtts[-1]:8.1f}", flush=True)
        low, high, loss = netns.PROFILES["lossy"]
        for host in (a, b):
            bed.set_loss(host, loss)
        mid = (low + high) / 2
        rtts = sorted(echo_case(bed, a, b, mid, args.count))
        p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
        print(f"{f'lossy {mid:.0f} ms + {loss:.0%} loss':<28} {2 * mid:9.1f} "
              f"{statistics.median(rtts):8.1f} {p99:8.1f} {rtts[-1]:8.1f}  "
              f"({sum(r > 2 * mid + 100 for r in rtts)} of {len(rtts)} > asked + 100 ms)")
        measured = udp_loss(bed, a, b, args.udp)
        expected = 1 - (1 - loss) ** 2
        print(f"UDP round-trip loss: asked {expected:.2%} (two {loss:.0%} draws), measured "
              f"{measured:.2%} of {args.udp}")
    print(f"load after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
