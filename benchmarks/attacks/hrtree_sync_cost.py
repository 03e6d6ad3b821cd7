"""Finding (issue 16, MEDIUM): HR-tree sync and gossip cost.

Two model nodes of group ``sim`` on real in-process hosts (py-libp2p, trio), each running its
forwarding service (:class:`ps_p2p.roles.forwarding.GroupForwarding`) as a node does; the
*server* holds ``--entries`` (32k) prefixes in its own subtree. The other one is a member
turned attacker:

1. **snapshot requests**: for ``--seconds`` it asks the server for its snapshot as fast as the
   server answers (a new ``/planetserve/hrtree-sync/1.0.0`` stream each time). Printed: answers
   it got, the server's CPU spent building and signing snapshots, per second of attack.
2. **delta flood**: it publishes ``--deltas`` large valid deltas (each a clear and ~25k new
   hashes, ~200 KiB) on the group's topic, spread over ``--seconds`` (~400 KiB/s). Printed:
   how many reached the server's gossip handler, and the server's CPU in that handler (decode
   + apply), in total and per second of flood (plus 2 s for delivery).

    python benchmarks/attacks/hrtree_sync_cost.py [--seconds 10] [--entries 32768]

CPU is ``time.process_time`` around the server's own functions (the attacker runs in the same
process; its cost is not counted).

Measured (2 shared cores, defaults): before the fix (issue 16) 10 answers in 10 s, 41.8 ms of
CPU a second; 20 of 20 deltas handled, 1,435 ms (119 ms/s). After: 2 answers, one build,
3.8 ms/s; 6 of 20 deltas handled (the 1 MiB burst, then 32 KiB/s), 14 dropped over budget,
360 ms (30 ms/s over the run; ~11 ms/s once the burst is spent).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import trio

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from ps_p2p.config import ForwardingConfig  # noqa: E402
from ps_p2p.engines.sim_engine import SimEngine  # noqa: E402
from ps_p2p.gossip.hr_tree import HASH_BYTES  # noqa: E402
from ps_p2p.gossip.load import LoadTracker  # noqa: E402
from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.protocols import hrtree_gossip as wire  # noqa: E402
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host  # noqa: E402
from ps_p2p.records import Directory, NodeRecord, Role  # noqa: E402
from ps_p2p.roles.forwarding import GroupForwarding  # noqa: E402

KEY = "5a" * 32
CONFIG = ForwardingConfig(group_key=KEY, max_peers=15)  # 65,536 entries a peer may hold


def _record(identity: Identity) -> NodeRecord:
    return NodeRecord(identity.peer_id, (), frozenset({Role.MODEL}), b"\x00" * 32,
                      model_id="sim", capacity=2, issued_at_ms=0, expires_at_ms=10**13)


class Timed:
    """Wraps a function, summing the CPU seconds spent in it."""

    def __init__(self, fn):  # type: ignore[no-untyped-def]
        self.fn, self.cpu, self.calls, self.deltas = fn, 0.0, 0, 0

    def __call__(self, *args):  # type: ignore[no-untyped-def]
        data = args[-1] if args else b""
        if isinstance(data, bytes) and data[:1] == bytes([wire.KIND_DELTA]):
            self.deltas += 1
        start = time.process_time()
        try:
            return self.fn(*args)
        finally:
            self.cpu += time.process_time() - start
            self.calls += 1


def _fill(fwd: GroupForwarding, entries: int, salt: bytes, depth: int = 8) -> None:
    """``entries`` prefixes in ``fwd``'s own subtree: chains of ``depth`` fresh hashes."""
    for i in range(entries // depth):
        fwd.publisher.insert([os.urandom(HASH_BYTES) for _ in range(depth)])


async def main(seconds: float, entries: int, deltas: int) -> dict[str, object]:
    server_id, attacker_id = Identity.generate(), Identity.generate()
    directory = Directory(1, 0, 10**13, tuple(sorted((_record(server_id), _record(attacker_id)),
                                                     key=lambda r: r.peer_id)))
    out: dict[str, object] = {}
    async with open_host(server_id, ["/ip4/127.0.0.1/tcp/0"]) as s_host, \
            open_host(attacker_id, ["/ip4/127.0.0.1/tcp/0"]) as a_host, \
            wire.running_pubsub(s_host) as s_pubsub, wire.running_pubsub(a_host) as a_pubsub:
        server = GroupForwarding(server_id, SimEngine("sim"), LoadTracker(2, 8), CONFIG)
        attacker = GroupForwarding(attacker_id, SimEngine("sim"), LoadTracker(2, 8), CONFIG)
        server.snapshot_envelope = Timed(server.snapshot_envelope)  # type: ignore[method-assign]
        server.receive = Timed(server.receive)  # type: ignore[method-assign]
        _fill(server, entries, b"s")
        server.delta_envelopes()  # published already: the attack is about snapshots
        for fwd in (server, attacker):
            fwd.set_directory(directory)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, s_host, s_pubsub)
            await nursery.start(attacker.run, a_host, a_pubsub)
            await connect(a_host, listen_multiaddrs(s_host)[0])

            # 1. snapshot requests, as fast as answered
            answers = refused = 0
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                try:
                    await wire.fetch_snapshot(a_host, server_id.peer_id, timeout=5)
                    answers += 1
                except Exception:
                    refused += 1
                    await trio.sleep(0.05)
            cpu = server.snapshot_envelope.cpu  # type: ignore[attr-defined]
            out.update(snapshot_answers=answers, snapshot_refused=refused,
                       snapshot_cpu_ms_per_s=round(1000 * cpu / seconds, 1))

            # 2. a delta flood from one publisher (pre-built, then published back to back)
            await trio.sleep(2.0)  # GossipSub meshes (heartbeat 1 s)
            envelopes = []
            for _ in range(deltas):
                attacker.publisher.clear()
                _fill(attacker, 25_600, b"a", depth=64)
                envelopes += attacker.delta_envelopes()
            size = sum(map(len, envelopes))
            base_calls, base_cpu = server.receive.deltas, server.receive.cpu  # type: ignore
            start = time.monotonic()
            for i, envelope in enumerate(envelopes):  # spread over `seconds`
                await a_pubsub.publish(wire.topic_for("sim"), envelope)
                await trio.sleep_until(trio.current_time() + seconds / len(envelopes))
            await trio.sleep(2.0)  # delivery
            flood = time.monotonic() - start
            cpu = server.receive.cpu - base_cpu  # type: ignore[attr-defined]
            delivered = server.receive.deltas - base_calls  # type: ignore[attr-defined]
            out.update(flood_deltas=len(envelopes), flood_mib=round(size / 2**20, 1),
                       flood_seconds=round(flood, 1),
                       deltas_to_handler=delivered,
                       handler_cpu_ms=round(1000 * cpu, 1),
                       handler_cpu_ms_per_s=round(1000 * cpu / flood, 1),
                       handler_cpu_ms_per_delta=round(1000 * cpu / max(1, delivered), 1),
                       dropped=dict(server.dropped))
            nursery.cancel_scope.cancel()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--entries", type=int, default=32_768)
    parser.add_argument("--deltas", type=int, default=20)
    args = parser.parse_args()
    result = trio.run(main, args.seconds, args.entries, args.deltas)
    print(" ".join(f"{k}={v}" for k, v in result.items()))
