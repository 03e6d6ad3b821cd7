"""Benchmark: a validator's restart time against the age of its chain (issue 17, finding 4).

Builds a store of N empty blocks quickly, a block a second (each with a commit of 3 precommits'
size; a restart does not verify stored commits, they were verified when stored), then times
:meth:`~ps_p2p.registry.validator.Validator.start` on it, once with the blocks alone (what a
restart cost before state snapshots: every block executed from the genesis) and once with
state snapshots every ``--snapshot-every`` heights (the newest one loaded, only the later
blocks executed). Also prints the store's size per block.

Usage: ``python benchmarks/bench_restart.py [--heights 10000 100000] [--snapshot-every 1000]``
(100,000 heights take ~1 min to build.)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ps_p2p import registry as app
from ps_p2p.consensus.block import block_id, encode_block, make_block
from ps_p2p.consensus.signing import sign_vote
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator as Member
from ps_p2p.consensus.types import Vote, VoteType
from ps_p2p.keys import Identity
from ps_p2p.protocols.consensus import WIRE
from ps_p2p.registry.snapshot import encode_state
from ps_p2p.registry.validator import Validator

KEYS = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(4)]
T0 = 1_700_000_000_000
GENESIS = app.Genesis("bench-restart", T0, tuple(Member(k.peer_id) for k in KEYS))


def build(path: pathlib.Path, heights: int, snapshot_every: int) -> None:
    """A store of ``heights`` empty blocks, one a second (snapshots as a validator keeps
    them: the newest two)."""
    store = ConsensusStore(path)
    state = app.genesis_state(GENESIS)
    # a commit of the size a real one has (3 of 4 precommits); the same bytes for every block:
    # a restart does not verify stored commits (they were verified when stored)
    commit = WIRE.encode_commit(tuple(
        sign_vote(k, GENESIS.chain_id, Vote(VoteType.PRECOMMIT, 1, 0, b"\x01" * 32, k.peer_id))
        for k in KEYS[:3]))
    db = store._db
    db.execute("PRAGMA synchronous=OFF")
    db.execute("BEGIN")
    for h in range(1, heights + 1):
        block = make_block(chain_id=GENESIS.chain_id, height=h, time_ms=T0 + 1000 * h,
                           prev_block_id=state.block_id, app_hash=state.app_hash,
                           proposer=KEYS[h % 4].peer_id, txs=())
        state, _ = app.execute_block(state, block)
        assert state.block_id == block_id(block.header)
        db.execute("INSERT INTO blocks VALUES (?, ?, ?)", (h, encode_block(block), commit))
        if snapshot_every and h % snapshot_every == 0 and h > heights - 2 * snapshot_every:
            db.execute("INSERT INTO snapshots VALUES (?, ?, ?)",
                       (h, state.app_hash, encode_state(state)))
    db.execute("COMMIT")
    store.close()


def restart(path: pathlib.Path) -> tuple[float, Validator]:
    store = ConsensusStore(path)
    v = Validator(KEYS[0], GENESIS, store, WIRE)
    start = time.perf_counter()
    v.start(0.0)
    took = time.perf_counter() - start
    store.close()
    return took, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heights", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--snapshot-every", type=int, default=1000)
    args = parser.parse_args()
    print(f"{'heights':>8} {'snapshots':>10} {'restart s':>10} {'blocks executed':>16} "
          f"{'store B/block':>14}")
    for n in args.heights:
        for every in (0, args.snapshot_every):
            with tempfile.TemporaryDirectory() as folder:
                path = pathlib.Path(folder) / "consensus.sqlite"
                build(path, n, every)
                took, v = restart(path)
                assert v.committed_height == n
                executed = n - v.stats.snapshot_height
                size = path.stat().st_size
                print(f"{n:>8} {('every %d' % every) if every else 'none':>10} {took:>10.3f} "
                      f"{executed:>16} {size / n:>14.0f}", flush=True)


if __name__ == "__main__":
    main()
