"""Benchmark: time a validator spends in sqlite per height (on the service, the event loop's
time), with every write fsynced (as before issue 17) and with grouped writes (only own signed
messages fsynced; a block, a snapshot and pruning ride on the next fsync: ``store.py``).

Four validators (:class:`~ps_p2p.testing.committee.MemoryCommittee`, in memory, fake clock)
on sqlite files in a temporary folder decide ``--heights`` empty heights; per validator and
height: milliseconds in sqlite calls and fsynced transactions.

Usage: ``python benchmarks/bench_store_writes.py [--heights 200]``
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ps_p2p import registry as app
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator as Member
from ps_p2p.keys import Identity
from ps_p2p.testing.committee import MemoryCommittee

KEYS = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(4)]
GENESIS = app.Genesis("bench-store", 1_700_000_000_000, tuple(Member(k.peer_id) for k in KEYS))


def run(heights: int, grouped: bool) -> tuple[float, float]:
    """(ms in sqlite per validator and height, fsynced transactions per validator and height)"""
    original = ConsensusStore._transaction
    if not grouped:  # every write fsynced, as before
        @contextlib.contextmanager
        def always_durable(self, *, durable: bool = True):  # type: ignore[no-untyped-def]
            with original(self, durable=True) as db:
                yield db
        ConsensusStore._transaction = always_durable  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as folder:
            stores = [ConsensusStore(pathlib.Path(folder) / f"v{i}.sqlite") for i in range(4)]
            net = MemoryCommittee(KEYS, GENESIS, stores=stores, empty_block_interval=0.01,
                                  validator_options={"snapshot_every": 0})
            for s in stores:
                s.sqlite_seconds, s.synced_writes = 0.0, 0
            start = min(v.committed_height for v in net.vals)
            assert net.run_until(
                lambda: all(v.committed_height >= start + heights for v in net.vals), 1e9)
            done = min(v.committed_height for v in net.vals) - start
            ms = sum(s.sqlite_seconds for s in stores) * 1000 / 4 / done
            syncs = sum(s.synced_writes for s in stores) / 4 / done
            for s in stores:
                s.close()
            return ms, syncs
    finally:
        ConsensusStore._transaction = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heights", type=int, default=200)
    args = parser.parse_args()
    print(f"{'writes':>22} {'ms in sqlite/height':>20} {'fsyncs/height':>14}")
    for grouped in (False, True):
        ms, syncs = run(args.heights, grouped)
        name = "grouped (issue 17)" if grouped else "every one fsynced"
        print(f"{name:>22} {ms:>20.3f} {syncs:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
