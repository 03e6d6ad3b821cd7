"""Attack (issue 16, LOW): one peer's junk setups delay every other peer's inputs.

A relay's overlay runs one :class:`~ps_p2p.protocols.driver.CoreDriver` (one inbox, one task)
over its :class:`~ps_p2p.overlay.relay.RelayCore`. A flooder submits junk setup packets (each
costs the relay an X25519 before it fails) as fast as the inbox takes them, while an honest
listed user submits one valid setup every 20 ms; the script measures the honest setups' time
from submission to the relay's acknowledgement (real trio clock, one process, no network).

    python benchmarks/attacks/inbox_share.py [--seconds 3]

Prints the honest setups' latency (p50, p90, max), how many were acknowledged, and the junk
inputs processed and dropped.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import trio

from ps_p2p.crypto import onion
from ps_p2p.overlay import relay as r
from ps_p2p.protocols.driver import CoreDriver

ME, HONEST, FLOODER = b"R" * 38, b"H" * 38, b"F" * 38


class _Codec:
    def encode_forward(self, message):  # pragma: no cover - unused by setups
        raise NotImplementedError

    decode_forward = encode_backward = decode_backward = tamper_clove = encode_forward


def _submit(driver: CoreDriver, event, peer: bytes) -> bool:
    try:
        return driver.submit(event, peer=peer)
    except TypeError:  # the driver before the fix has one inbox for every peer
        return driver.submit(event)


async def run(seconds: float) -> None:
    key = onion.OnionKeyPair.generate()
    core = r.RelayCore(ME, key, _Codec(), r.RelayConfig(max_relay_entries_per_peer=100_000,
                                                        max_relay_entries=100_000))
    sent_at: dict[bytes, float] = {}
    latencies: list[float] = []

    def execute(command) -> None:
        if isinstance(command, r.SendSetupReply) and command.peer == HONEST and command.ok:
            latencies.append(time.perf_counter() - sent_at.pop(command.path_id))

    driver = CoreDriver("overlay", execute=execute, tick=core.tick,
                        next_deadline=core.next_deadline)
    spec = [onion.HopSpec(ME, key.public)]
    honest = [onion.create_path(spec) for _ in range(int(seconds / 0.02) + 1)]
    junk = os.urandom(onion.SETUP_PACKET_BYTES)
    junk_sent = 0

    async def flood() -> None:
        nonlocal junk_sent
        while True:
            for _ in range(1000):
                path_id = os.urandom(16)
                _submit(driver, functools.partial(core.receive_setup, FLOODER, path_id,
                                                  os.urandom(32) + junk[32:]), FLOODER)
                junk_sent += 1
            await trio.sleep(0)

    async def user() -> None:
        for path, packet in honest:
            sent_at[path.first_path_id] = time.perf_counter()
            _submit(driver, functools.partial(core.receive_setup, HONEST, path.first_path_id,
                                              packet), HONEST)
            await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        nursery.start_soon(flood)
        await user()
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()

    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [float("nan")] * 9
    print(f"honest setups acknowledged:  {len(ms)}/{len(honest)}")
    print(f"honest setup latency (ms):   p50 {statistics.median(ms):.1f}  p90 {q[8]:.1f}  "
          f"max {ms[-1]:.1f}" if ms else "honest setup latency: none acknowledged")
    print(f"junk inputs:                 {junk_sent} submitted, {core.stats.setups_failed} "
          f"processed, {driver.dropped} dropped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    trio.run(run, parser.parse_args().seconds)


if __name__ == "__main__":
    main()
