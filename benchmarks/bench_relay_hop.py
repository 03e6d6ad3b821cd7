"""What a Circuit Relay v2 hop costs (issue 20 section 2): a round trip direct vs relayed.

Three OS processes on 127.0.0.1, each a py-libp2p host as ps_p2p builds them (TCP + Noise +
Yamux, :func:`ps_p2p.protocols.host.open_host`): a *relay* (:class:`RelayServer`), a *target*
that reserves a slot on it and echoes, and a *client*. The client opens one echo stream to the
target, first over a direct connection, then over a circuit through the relay (the target's
``/p2p-circuit`` address only), and times ``--count`` round trips of each size (64 B; 1 KiB, the
overlay's smallest cell; 16 KiB), one at a time. CPU: user + system seconds of each process
(``/proc/<pid>/stat``) over each measured phase, divided by the round trips.

Prints per mode and size: latency median and p99 (ms), and CPU per round trip (us) of client,
relay, target and all three; and per mode the time to open the connection and its first stream
(direct: TCP dial; relayed: the relay already connected, a HOP CONNECT and the STOP at the
target, then both: Noise, Yamux, the stream's protocol).

    PYTHONPATH=. python benchmarks/bench_relay_hop.py [--count 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROLE = r'''
import json, sys, time, trio, multiaddr
from libp2p.peer.id import ID
from libp2p.tools.anyio_service.context import background_trio_service
from ps_p2p.keys import Identity
from ps_p2p.overlay.circuit_limits import CircuitRelayConfig
from ps_p2p.protocols.addresses import install_circuit_dialing, note_record_circuits
from ps_p2p.protocols.circuit_relay import RelayServer, circuit_multiaddr, is_relayed, reserve
from ps_p2p.protocols.host import listen_multiaddrs, open_host
from ps_p2p.records.multiaddrs import multiaddr_bytes

ECHO = "/bench/echo/1.0.0"
role, work, count = sys.argv[1], sys.argv[2], int(sys.argv[3])

def say(**kw):
    print(json.dumps(kw), flush=True)

async def echo(stream):
    try:
        while True:
            data = await stream.read(65536)
            if not data:
                break
            await stream.write(data)
    except Exception:
        pass

def bare(a):
    return multiaddr.Multiaddr(a.rsplit("/p2p/", 1)[0])

async def wait_file(name):
    path = f"{work}/{name}"
    while True:
        try:
            return json.loads(open(path).read())
        except (OSError, ValueError):
            await trio.sleep(0.05)

async def main():
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        async with background_trio_service(RelayServer(host, CircuitRelayConfig(serve=role == "relay"))):
            addr = listen_multiaddrs(host)[0]
            if role == "relay":
                open(f"{work}/relay.tmp", "w").write(json.dumps({"addr": addr}))
                import os; os.replace(f"{work}/relay.tmp", f"{work}/relay")
                await trio.sleep_forever()
            if role == "target":
                host.set_stream_handler(ECHO, echo)
                r = await wait_file("relay")
                rid = ID.from_base58(r["addr"].rsplit("/p2p/", 1)[1])
                host.get_peerstore().add_addrs(rid, [bare(r["addr"])], 0)
                await reserve(host, rid)
                out = {"addr": addr, "circuit": circuit_multiaddr(r["addr"], rid)}
                open(f"{work}/target.tmp", "w").write(json.dumps(out))
                import os; os.replace(f"{work}/target.tmp", f"{work}/target")
                await trio.sleep_forever()
            t = await wait_file("target")
            tid = ID.from_base58(t["addr"].rsplit("/p2p/", 1)[1])
            install_circuit_dialing(host)
            for mode in ("direct", "relayed"):
                if mode == "direct":
                    host.get_peerstore().add_addrs(tid, [bare(t["addr"])], 0)
                else:
                    for c in list(host.get_network().get_connections(tid)):
                        await c.close()
                    host.get_peerstore().clear_addrs(tid)
                    note_record_circuits(host, tid.to_bytes(), [multiaddr_bytes(t["circuit"])])
                t_open = time.perf_counter()
                stream = await host.new_stream(tid, [ECHO])
                say(phase="open", mode=mode, ms=(time.perf_counter() - t_open) * 1e3)
                relayed = all(is_relayed(c) for c in host.get_network().get_connections(tid))
                for size in (64, 1024, 16384):
                    data = b"x" * size
                    for _ in range(50):  # warm up
                        await stream.write(data)
                        got = 0
                        while got < size:
                            got += len(await stream.read(65536))
                    say(phase="begin", mode=mode, size=size)
                    await trio.to_thread.run_sync(sys.stdin.readline)
                    times = []
                    for _ in range(count):
                        t0 = time.perf_counter()
                        await stream.write(data)
                        got = 0
                        while got < size:
                            got += len(await stream.read(65536))
                        times.append(time.perf_counter() - t0)
                    say(phase="end", mode=mode, size=size, relayed=relayed, times=times)
                    await trio.to_thread.run_sync(sys.stdin.readline)
                await stream.close()

trio.run(main)
'''


def _cpu(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=2000, help="round trips per case")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as work:
        procs = {role: subprocess.Popen(
            [sys.executable, "-c", ROLE, role, work, str(args.count)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for role in ("relay", "target", "client")}
        client = procs["client"]
        rows = []
        opens: list[tuple[str, float]] = []
        try:
            while True:
                line = client.stdout.readline()
                if not line:
                    break
                msg = json.loads(line)
                if msg["phase"] == "open":
                    opens.append((msg["mode"], msg["ms"]))
                    continue
                if msg["phase"] == "begin":
                    before = {r: _cpu(p.pid) for r, p in procs.items()}
                    client.stdin.write("go\n")
                    client.stdin.flush()
                    continue
                after = {r: _cpu(p.pid) for r, p in procs.items()}
                times = sorted(msg["times"])
                n = len(times)
                cpu = {r: (after[r] - before[r]) / n * 1e6 for r in procs}
                rows.append((msg["mode"] + ("" if msg["relayed"] == (msg["mode"] == "relayed")
                                            else "?"), msg["size"], times[n // 2] * 1e3,
                             times[min(n - 1, int(0.99 * n))] * 1e3, cpu))
                client.stdin.write("go\n")
                client.stdin.flush()
        finally:
            for p in procs.values():
                p.kill()
                p.wait()
    print(f"{'mode':8} {'bytes':>6} {'median ms':>10} {'p99 ms':>8} | CPU us/round trip: "
          f"{'client':>7} {'relay':>7} {'target':>7} {'all':>7}")
    for mode, size, med, p99, cpu in rows:
        print(f"{mode:8} {size:>6} {med:>10.3f} {p99:>8.3f} |                    "
              f"{cpu['client']:>7.0f} {cpu['relay']:>7.0f} {cpu['target']:>7.0f} "
              f"{sum(cpu.values()):>7.0f}")
    for mode, ms in opens:
        print(f"{mode}: a new connection and its first stream (dial, Noise, Yamux, identify, "
              f"protocol) took {ms:.1f} ms")
    print(f"({args.count} round trips per row, one at a time; load average "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
