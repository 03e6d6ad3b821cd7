"""Overlay benchmarks on loopback, all hosts in one process (one trio loop, one core).

Measures (median and p99, milliseconds unless said):

1. onion path setup through 3 hops with connections already up (open_path -> acknowledgement);
2. anonymous round trip (30 KB prompt, 2 KB answer, a model node that answers instantly) against a
   direct request to the same node over one reused stream, and the overhead between the two;
   with the process CPU time and the libp2p (Noise) messages per anonymous round trip;
3. relay throughput: cells per second one relay forwards (its frame handling + layer crypto,
   transport excluded), and cells per second through a whole 3-hop path over real streams.

Run: ``python benchmarks/bench_overlay.py [--quick]``. Every host shares one core, so the
numbers are an upper bound of what separate machines would see.

``--cpu [--rounds N]`` measures only the CPU per anonymous round trip, with a quiet background
(probes every 60 s, a block a second) measured in idle windows as long as the busy one before
and after it (their mean is subtracted), and prints per round trip and per libp2p (Noise)
message the trio scheduler steps (a trio instrument counting task steps during the round trips)
and, in a separate pass of 20 round trips, the Python calls (``sys.setprofile``, which slows
what it counts, so never in the CPU pass). ``PS_LIBP2P_PATCHES=none`` runs it without the
py-libp2p work-arounds (``ps_p2p.protocols.libp2p_patches``). ``--quiet`` also slows the
directory refresh (30 s), the registrations (40 s) and the empty blocks (30 s) once the network
is up: on a loaded machine a round trip takes long enough that the background subtracted over
its time outweighs it (negative results at load 45).

``--idle [--users N --window S --windows K --warmup W]`` measures CPU at rest: 4 verifiers, 2
model nodes and N users (default 8) in this process with the production intervals (the users'
``UserConfig()`` probes, directory refresh, registration, record lifetime and block interval of
``NodeConfig()``, set once the localnet is up), no requests; prints the process CPU per node per
minute (the median of K windows of S seconds after W seconds of warm-up) and the libp2p (Noise)
messages per node per minute. Compare trees alternating, with the machine's load noted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from ps_p2p.crypto import onion
from ps_p2p.engines.base import SamplingParams
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols import clove_relay
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.roles.user import UserConfig
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.testing.localnet import open_localnet

DIRECT_PROTOCOL = TProtocol("/planetserve/bench-direct/1.0.0")
#: n = 4 cloves, each over 4 links (user, 2 relays, proxy -> model node) and back.
CELL_TRANSFER_MINIMUM = 4 * 4 * 2
#: Noise transport messages written by every host of this process (each one is a Yamux frame
#: or a coalesced batch of them, encrypted).
NOISE_MESSAGES = [0]


def count_noise_messages() -> None:
    """Count every Noise message py-libp2p writes (wraps its packet writer)."""
    from libp2p.security.noise import io as noise_io

    original = noise_io.NoisePacketReadWriter.write_msg

    async def counting(self, msg: bytes) -> None:  # type: ignore[no-untyped-def]
        NOISE_MESSAGES[0] += 1
        await original(self, msg)

    noise_io.NoisePacketReadWriter.write_msg = counting  # type: ignore[method-assign]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{platform.platform()}; {cpu}; {os.cpu_count()} cores; "
            f"Python {platform.python_version()}")


def summary(name: str, samples: list[float], unit: str = "ms") -> str:
    s = sorted(samples)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return (f"{name:<48} median {statistics.median(s):8.2f} {unit}   p99 {p99:8.2f} {unit}   "
            f"(n={len(s)})")


async def bench(quick: bool) -> None:
    rounds = 30 if quick else 200
    print(machine())
    count_noise_messages()
    cfg = UserConfig(probe_interval=5.0, probe_timeout=10.0, request_timeout=30.0)
    engine = InstantEngine(reply_bytes=2048)
    async with open_localnet(users=7, engine_factory=lambda i: engine, user_config=cfg) as net:
        user = net.users[0]
        overlay = user.overlay
        directory = user.directory
        others = [r for r in directory.users() if r.peer_id != user.peer_id]

        # 1. path setup, connections up (the relays already carry this user's paths)
        setup = []
        failed: list[str] = []
        for i in range(rounds):
            relays = [others[(i + j) % len(others)] for j in range(3)]
            hops = [onion.HopSpec(r.peer_id, r.onion_key) for r in relays]
            t0 = time.perf_counter()
            handle = overlay.open_path(hops)
            await handle.ready.wait()
            if not handle.is_ready:  # e.g. a relay whose directory lags: counted, not timed
                failed.append(str(handle.error))
                continue
            setup.append((time.perf_counter() - t0) * 1000)
            overlay.close_path(handle)
        print(summary("onion path setup, 3 hops", setup)
              + (f"   {len(failed)} failed: {failed[0]}" if failed else ""))

        # 2. anonymous round trip vs direct request
        model = net.models[0]

        async def direct_handler(stream):  # the same engine, no overlay
            try:
                while True:
                    frame = await read_frame(stream, 1 << 20)
                    done = await engine.complete(frame.decode(), SamplingParams(max_tokens=16))
                    await stream.write(encode_frame(done.text.encode()))
            except Exception:
                await stream.reset()

        model.host.set_stream_handler(DIRECT_PROTOCOL, direct_handler)
        prompt = "p" * 30_000
        stream = await user.host.new_stream(ID(model.peer_id), [DIRECT_PROTOCOL])
        direct = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await stream.write(encode_frame(prompt.encode()))
            reply = await read_frame(stream, 1 << 20)
            direct.append((time.perf_counter() - t0) * 1000)
            assert len(reply) == 2048
        anonymous = []
        messages_before = NOISE_MESSAGES[0]
        cpu_before = time.process_time()
        for _ in range(rounds):
            t0 = time.perf_counter()
            answer = await user.user.ask(prompt, max_tokens=16, timeout=30)
            anonymous.append((time.perf_counter() - t0) * 1000)
            assert answer.ok and len(answer.text) == 2048, answer.error
        busy_cpu = time.process_time() - cpu_before
        busy_messages = NOISE_MESSAGES[0] - messages_before
        # the same time again with no request: what probes and directory refreshes cost
        idle_cpu, idle_messages = time.process_time(), NOISE_MESSAGES[0]
        await trio.sleep(sum(anonymous) / 1000)
        idle_cpu = time.process_time() - idle_cpu
        idle_messages = NOISE_MESSAGES[0] - idle_messages
        cpu = (busy_cpu - idle_cpu) / rounds * 1000
        messages = (busy_messages - idle_messages) / rounds
        print(summary("direct request 30 KB -> 2 KB", direct))
        print(summary("anonymous round trip 30 KB -> 2 KB", anonymous))
        print(f"{'overhead (median anonymous - median direct)':<48} "
              f"{statistics.median(anonymous) - statistics.median(direct):8.2f} ms")
        # Every host runs in this process: its CPU time is the whole network's (user, 3 relays
        # per path, proxies, model node); the background (probes, directory refreshes), measured
        # over as long again with no request, is subtracted.
        print(f"{'process CPU per anonymous round trip':<48} {cpu:8.2f} ms   "
              f"(background {idle_cpu / rounds * 1000:.2f} ms subtracted)")
        print(f"{'libp2p (Noise) messages per anonymous round trip':<48} {messages:8.1f}      "
              f"(background {idle_messages / rounds:.1f} subtracted; cell-transfer minimum "
              f"{CELL_TRANSFER_MINIMUM})")

        # 3a. relay CPU: frames through one middle relay's handler, links stubbed out
        relay = net.users[1].overlay
        path = user.user.ready_paths()[0]
        hops = [onion.HopSpec(r.peer_id, r.onion_key) for r in
                (directory.record(p) for p in path.relays)]
        user_path, packet = onion.create_path(hops)
        state, _ = onion.process_setup(net.node(hops[0].peer_id).keys.onion, packet)
        sent = 0
        entry = relay.table.add(b"bench-peer", b"\x07" * 16, state, trio.current_time())
        cells = [
            clove_pb2.CloveFrame(cell=clove_pb2.Cell(
                path_id=b"\x07" * 16, payload=user_path.seal_forward(b"z" * 900))
            ).SerializeToString()
            for _ in range(2000 if quick else 20000)
        ]
        now = trio.current_time()
        t0 = time.perf_counter()
        for frame in cells:  # what the stream handler and the driver do per cell, links aside
            # (the outgoing frame's encoding belongs to the link, as before the core existed)
            cell = clove_relay.decode(frame)
            sent += len(relay.core.receive_cell(b"bench-peer", cell.path_id, cell.payload, now))
        elapsed = time.perf_counter() - t0
        relay.table.remove(entry)
        assert sent == len(cells)
        print(f"{'relay CPU, 1 KiB cells (frame decode + core)':<48} {len(cells) / elapsed:10.0f} cells/s")

        # 3b. whole path over real streams: probes through 3 hops and back
        n = 300 if quick else 2000
        got = trio.Event()
        count = 0
        original = user.overlay.on_backward

        def on_backward(handle, message):
            nonlocal count
            if message.WhichOneof("kind") == "probe_reply" and message.probe_reply.nonce >= 1 << 40:
                count += 1
                if count == n:
                    got.set()
                return
            original(handle, message)

        user.overlay.on_backward = on_backward
        t0 = time.perf_counter()
        for i in range(n):
            user.overlay.send_on_path(
                path.handle, clove_pb2.ForwardPayload(probe=clove_pb2.Probe(nonce=(1 << 40) + i))
            )
        with trio.fail_after(60):
            await got.wait()
        elapsed = time.perf_counter() - t0
        user.overlay.on_backward = original
        print(f"{'3-hop path round trips, 1 KiB cells, pipelined':<48} {n / elapsed:10.0f} cells/s")


class _StepCounter(trio.abc.Instrument):
    """Counts trio task steps (one per pass of any task through the scheduler)."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


async def bench_cpu(rounds: int, quiet: bool = False) -> None:
    """CPU, scheduler steps and Python calls per anonymous round trip (see the docstring);
    ``quiet``: a background ~10x lower still (see ``--quiet``)."""
    try:
        from ps_p2p.protocols.libp2p_patches import installed
    except ImportError:  # a tree from before issue 22 (paired runs against it)
        def installed() -> tuple[str, ...]:
            return ()

    print(machine())
    print(f"py-libp2p work-arounds installed: {', '.join(installed()) or 'none'}")
    count_noise_messages()
    cfg = UserConfig(probe_interval=60.0, probe_timeout=10.0, request_timeout=30.0)
    engine = InstantEngine(reply_bytes=2048)
    prompt = "p" * 30_000
    async with open_localnet(users=7, engine_factory=lambda i: engine, user_config=cfg,
                             block_interval=30.0 if quiet else 1.0) as net:
        user = net.users[0].user
        if quiet:  # the nodes read these at each refresh and registration
            for node in [*(net.verifiers or [net.verifier]), *net.models, *net.users]:
                node.config.directory_refresh = 30.0
                node.config.register_interval = 40.0  # under the localnet's 120 s records

        async def ask_many(n: int) -> None:
            for _ in range(n):
                answer = await user.ask(prompt, max_tokens=16, timeout=30)
                assert answer.ok and len(answer.text) == 2048, answer.error

        await ask_many(10)  # warm-up: paths, links, caches

        async def idle(seconds: float) -> tuple[float, int]:
            cpu, msgs = time.process_time(), NOISE_MESSAGES[0]
            await trio.sleep(seconds)
            return time.process_time() - cpu, NOISE_MESSAGES[0] - msgs

        steps = _StepCounter()
        wall, cpu, msgs = time.perf_counter(), time.process_time(), NOISE_MESSAGES[0]
        trio.lowlevel.add_instrument(steps)
        await ask_many(rounds)
        trio.lowlevel.remove_instrument(steps)
        busy_wall = time.perf_counter() - wall
        busy_cpu, busy_msgs = time.process_time() - cpu, NOISE_MESSAGES[0] - msgs
        window = max(busy_wall, 5.0)
        idle_cpu, idle_msgs = zip(*[await idle(window) for _ in range(2)])
        background_scale = busy_wall / window
        # the background's rate over the idle windows, for as long as the round trips took
        background_cpu = statistics.mean(idle_cpu) * background_scale
        background_msgs = statistics.mean(idle_msgs) * background_scale
        per_rt_cpu = (busy_cpu - background_cpu) / rounds * 1000
        per_rt_msgs = (busy_msgs - background_msgs) / rounds
        print(f"{'CPU per anonymous round trip':<48} {per_rt_cpu:8.2f} ms   (busy "
              f"{busy_cpu / rounds * 1000:.2f} ms, background {background_cpu / rounds * 1000:.2f}"
              f" ms subtracted; busy {busy_wall:.1f} s, idle windows {window:.1f} s each, CPU "
              f"{idle_cpu[0] * 1000:.0f} / {idle_cpu[1] * 1000:.0f} ms)")
        print(f"{'libp2p (Noise) messages per round trip':<48} {per_rt_msgs:8.1f}      "
              f"(background {background_msgs / rounds:.1f} subtracted; minimum "
              f"{CELL_TRANSFER_MINIMUM})")
        # the instrument also counts background steps (small: probes every 60 s)
        messages = max(busy_msgs, 1)
        print(f"{'trio scheduler steps per round trip':<48} {steps.steps / rounds:8.1f}      "
              f"({steps.steps / messages:.1f} per Noise message)")

        calls = [0]

        def profile(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
            if event == "call" or event == "c_call":
                calls[0] += 1

        profiled = 20
        msgs = NOISE_MESSAGES[0]
        sys.setprofile(profile)
        try:
            await ask_many(profiled)
        finally:
            sys.setprofile(None)
        messages = max(NOISE_MESSAGES[0] - msgs, 1)
        print(f"{'Python calls per round trip (incl. C calls)':<48} {calls[0] / profiled:8.0f}      "
              f"({calls[0] / messages:.0f} per Noise message; separate pass of {profiled})")


async def bench_idle(users: int, models: int, committee: int, window: float, windows: int,
                     warmup: float) -> None:
    """CPU at rest per node (see ``--idle``): production intervals, no requests."""
    from ps_p2p.config import NodeConfig

    try:
        from ps_p2p.protocols.libp2p_patches import installed
    except ImportError:  # a tree from before issue 22
        def installed() -> tuple[str, ...]:
            return ()

    print(machine())
    print(f"py-libp2p work-arounds installed: {', '.join(installed()) or 'none'}")
    count_noise_messages()
    production = NodeConfig()
    async with open_localnet(users=users, models=models, committee=committee,
                             user_config=UserConfig(), block_interval=production.block_interval,
                             record_lifetime=production.record_lifetime) as net:
        nodes = [*(net.verifiers or [net.verifier]), *net.models, *net.users]
        for node in nodes:  # the localnet's fast start-up intervals, back to production
            node.config.directory_refresh = production.directory_refresh
            node.config.register_interval = production.register_interval
        for node in net.users:
            await node.user.wait_ready(timeout=120.0)
        await trio.sleep(warmup)  # refresh back-off, first probes, registrations settle
        per_minute = 60.0 / window / len(nodes)
        cpu_ms, msgs = [], []
        for _ in range(windows):
            cpu, sent = time.process_time(), NOISE_MESSAGES[0]
            await trio.sleep(window)
            cpu_ms.append((time.process_time() - cpu) * 1000 * per_minute)
            msgs.append((NOISE_MESSAGES[0] - sent) * per_minute)
        print(f"nodes: {committee} verifiers, {models} model nodes, {users} users; windows "
              f"{windows} x {window:.0f} s after {warmup:.0f} s of warm-up")
        print(f"{'CPU at rest per node per minute':<48} {statistics.median(cpu_ms):8.1f} ms   "
              f"(windows: {' / '.join(f'{c:.1f}' for c in cpu_ms)})")
        print(f"{'libp2p (Noise) messages per node per minute':<48} "
              f"{statistics.median(msgs):8.1f}")
        print("load average (1, 5, 15 min) at the end: "
              + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--cpu", action="store_true",
                        help="only CPU, scheduler steps and Python calls per round trip")
    parser.add_argument("--rounds", type=int, default=100, help="round trips of --cpu")
    parser.add_argument("--quiet", action="store_true",
                        help="--cpu: directory refresh every 30 s, registration every 40 s, "
                             "blocks every 30 s once the network is up (for a loaded machine, "
                             "where slow round trips make the subtracted background dominate)")
    parser.add_argument("--idle", action="store_true",
                        help="CPU at rest per node: production intervals, no requests")
    parser.add_argument("--users", type=int, default=8, help="--idle: user nodes")
    parser.add_argument("--window", type=float, default=60.0, help="--idle: seconds a window")
    parser.add_argument("--windows", type=int, default=3, help="--idle: windows (median)")
    parser.add_argument("--warmup", type=float, default=30.0, help="--idle: seconds before")
    args = parser.parse_args()
    if args.idle:
        trio.run(bench_idle, args.users, 2, 4, args.window, args.windows, args.warmup)
    elif args.cpu:
        trio.run(bench_cpu, args.rounds, args.quiet)
    else:
        trio.run(bench, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
