"""Benchmark of the verifier committee: commit latency, committed transactions per second, and the
consensus simulator's speed.

* commit latency: one REGISTER transaction submitted to validator 0 of an idle committee of N
  validators (4, 7, 10, 16: ``--sizes``), each a real py-libp2p host on 127.0.0.1 in this one
  process (one CPU core carries all of them), until every validator has committed a block
  holding it; p50 / p99 over ``--rounds`` transactions, one at a time; with the process's CPU
  time per committed height (all N validators, and per validator), the milliseconds a
  validator spends in sqlite per height (on its event loop), and the consensus frames all
  validators' links wrote per height against the protocol's minimum: ``(N - 1) * (1 + 2N)``
  for consensus (a proposal to N - 1 peers, a prevote and a precommit from each validator to
  N - 1 peers; ``benchmarks/consensus_frames.py``) plus ``(N - 1) ** 2`` for the height's one
  transaction (every validator relays a new transaction once to each peer but the one it came
  from: ``RelayTx``);
* throughput: ``--txs`` REGISTER transactions submitted at once to validator 0 of 4; committed
  transactions per second until every validator committed all of them;
* simulator: schedules per second of ``ps_p2p.testing.consensus_sim.run_schedule`` (f = 1, 3
  heights, faults and Byzantine behaviours drawn per seed).

Usage: ``python benchmarks/bench_consensus.py [--quick] [--rounds 60] [--txs 2000]
[--sizes 4,7,10,16]``
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import pathlib
import statistics
import sys
import tempfile
import time

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_devnet import machine  # noqa: E402
from consensus_frames import DETAIL, counters_of, per_height  # noqa: E402
from ps_p2p import registry as app
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.keys import Identity
from ps_p2p.protocols.consensus import ConsensusServiceConfig
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.testing.committee import LocalCommittee
from ps_p2p.testing.consensus_sim import run_schedule

ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
POLICY = app.AdmissionPolicy(max_records_per_network=100_000, max_registrations_per_block=1000,
                             max_records_without_address=100_000)


def register_txs(count: int, salt: bytes) -> list[bytes]:
    now = time.time_ns() // 1_000_000
    out = []
    for i in range(count):
        who = Identity.from_private_bytes(hashlib.sha256(salt + b"%d" % i).digest())
        record = sign_record(who, NodeRecord(
            who.peer_id, (f"/ip4/10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}/tcp/4001",),
            frozenset({Role.USER}), ONION, issued_at_ms=now - 1000,
            expires_at_ms=now + 3_600_000))
        out.append(app.encode_tx(app.RegisterTx(record)))
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def minimum_frames(n: int, txs: int = 0) -> int:
    """Frames per height of the protocol alone: a proposal and two votes per validator, and
    ``txs`` transactions each relayed once by every validator to every peer but its sender."""
    return (n - 1) * (1 + 2 * n) + txs * (n - 1) ** 2


def frames_sent(committee: LocalCommittee) -> int:
    """Consensus frames written so far by every running validator's links."""
    total = 0
    for m in committee.members:
        stats = m.service.link_stats() if m.service is not None else None
        if stats is not None:
            total += stats.frames_sent
    return total


async def latency(n: int, rounds: int, warmup: int = 5
                  ) -> tuple[list[float], float, float, float]:
    """Seconds from submit to committed on every validator, per transaction; with the CPU
    seconds of the whole process (all n validators) per committed height, the milliseconds
    one validator spent in sqlite (its event loop's time) per height, and the consensus
    frames of all validators per height."""
    txs = register_txs(rounds + warmup, b"latency %d " % n)
    pending: dict[bytes, set[int]] = {}
    done = trio.Event()

    def on_commit(member, committed) -> None:  # type: ignore[no-untyped-def]
        nonlocal done
        for tx in committed.block.txs:
            left = pending.get(tx)
            if left is not None:
                left.discard(member.index)
                if not left:
                    done.set()

    samples = []
    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            committee = LocalCommittee(
                nursery, pathlib.Path(folder), n, policy=POLICY, on_commit=on_commit,
                config=ConsensusServiceConfig(empty_block_interval=60.0),
            )
            await committee.start_all()
            await committee.wait_committed(1)
            stores = [m.service.validator.store for m in committee.members]
            for store in stores:
                store.sqlite_seconds = 0.0
            h0 = committee.members[0].service.validator.committed_height
            frames0 = frames_sent(committee)
            counters0 = counters_of(committee)
            cpu0 = time.process_time()
            for i, tx in enumerate(txs):
                done = trio.Event()
                pending[tx] = set(range(n))
                start = time.perf_counter()
                committee.members[0].service.submit_tx(tx)
                with trio.fail_after(30):
                    await done.wait()
                if i >= warmup:
                    samples.append(time.perf_counter() - start)
            cpu = time.process_time() - cpu0
            heights = max(1, committee.members[0].service.validator.committed_height - h0)
            frames = (frames_sent(committee) - frames0) / heights
            counters = counters_of(committee)
            counters.subtract(counters0)
            DETAIL.append(per_height(counters, heights))
            sqlite_ms = sum(s.sqlite_seconds for s in stores) * 1000 / n / heights
            nursery.cancel_scope.cancel()
    return samples, cpu / heights, sqlite_ms, frames


async def throughput(n: int, count: int) -> tuple[float, int, float]:
    """(transactions per second, blocks, seconds) for ``count`` transactions at once."""
    txs = register_txs(count, b"throughput ")
    wanted = set(txs)
    seen: dict[int, int] = {}
    blocks: set[int] = set()
    done = trio.Event()

    def on_commit(member, committed) -> None:  # type: ignore[no-untyped-def]
        got = sum(1 for tx in committed.block.txs if tx in wanted)
        if got:
            blocks.add(committed.height)
        seen[member.index] = seen.get(member.index, 0) + got
        if len(seen) == n and all(v >= count for v in seen.values()):
            done.set()

    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            committee = LocalCommittee(
                nursery, pathlib.Path(folder), n, policy=POLICY, on_commit=on_commit,
                config=ConsensusServiceConfig(empty_block_interval=60.0),
            )
            await committee.start_all()
            await committee.wait_committed(1)
            service = committee.members[0].service
            start = time.perf_counter()
            for tx in txs:
                service.submit_tx(tx)
            with trio.fail_after(300):
                await done.wait()
            elapsed = time.perf_counter() - start
            nursery.cancel_scope.cancel()
    return count / elapsed, len(blocks), elapsed


def simulator(seconds: float) -> tuple[float, int]:
    start = time.perf_counter()
    seed = 0
    while time.perf_counter() - start < seconds:
        result = run_schedule(seed, f=1, heights=3)
        assert result.ok, result.violations
        seed += 1
    return seed / (time.perf_counter() - start), seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--txs", type=int, default=2000)
    parser.add_argument("--sizes", default="4,7,10,16")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.txs = 15, 300
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    print(f"machine: {machine()}")
    print("consensus timeouts 0.2 s (+0.1 s a round); loopback, all validators in one process")
    for n in (int(s) for s in args.sizes.split(",")):
        samples, cpu, sqlite_ms, frames = trio.run(latency, n, args.rounds)
        print(f"commit latency, {n:2d} validators: p50 {pct(samples, 50) * 1000:6.1f} ms  "
              f"p99 {pct(samples, 99) * 1000:6.1f} ms  mean "
              f"{statistics.mean(samples) * 1000:6.1f} ms  ({len(samples)} transactions); "
              f"CPU per height {cpu * 1000:6.1f} ms (all {n}, {cpu * 1000 / n:5.1f} ms each); "
              f"sqlite per height and validator {sqlite_ms:5.2f} ms; frames per height "
              f"{frames:6.1f} (minimum {minimum_frames(n, 1)} with its transaction, "
              f"{frames / minimum_frames(n, 1):.2f}x)")
        print(f"    per height: {DETAIL[-1] or 'nothing'}")
    tps, blocks, elapsed = trio.run(throughput, 4, args.txs)
    print(f"throughput, 4 validators: {tps:7.1f} committed transactions/s "
          f"({args.txs} transactions in {blocks} blocks, {elapsed:.2f} s)")
    rate, count = simulator(3.0 if args.quick else 10.0)
    print(f"simulator: {rate:7.1f} schedules/s (f = 1, 3 heights; {count} schedules)")


if __name__ == "__main__":
    main()
