"""Consensus gossip cost and crash recovery of an in-process committee (issue 17, findings 1, 2, 4).

* frames per height: N validators (real py-libp2p hosts on 127.0.0.1, this one process, the
  :data:`~ps_p2p.testing.committee.FAST_CONSENSUS` timeouts, an empty block every 0.1 s), the
  consensus frames every validator's links wrote (``LinkStats.frames_sent``) over ``--heights``
  heights, divided by the heights. The protocol's minimum is one proposal to N - 1 peers plus a
  prevote and a precommit from each of N validators to N - 1 peers: ``(N - 1) * (1 + 2N)``.
* kill two, restart one: a committee of 4 commits height 3, validators 2 and 3 are killed, the
  other two run on alone for ``--down`` seconds (rounds pass; no quorum), validator 2 is started
  again from its store; the seconds from that restart until all three running validators have
  committed a new height (``--limit`` s at most: "stuck").

Usage: ``python benchmarks/consensus_frames.py [--sizes 4 10] [--heights 10] [--down 3]``
(about 30 s).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import tempfile
import time

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ps_p2p.protocols.consensus import ConsensusServiceConfig  # noqa: E402
from ps_p2p.testing.committee import LocalCommittee  # noqa: E402


def minimum_frames(n: int) -> int:
    """Frames per height of the protocol alone: a proposal and two votes per validator."""
    return (n - 1) * (1 + 2 * n)


def _frames(committee: LocalCommittee) -> int:
    total = 0
    for m in committee.members:
        if m.service is not None and m.service.link_stats() is not None:
            total += m.service.link_stats().frames_sent
    return total


async def frames_per_height(n: int, heights: int) -> tuple[float, float]:
    """(frames per height, seconds per height) over ``heights`` heights after height 2."""
    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            committee = LocalCommittee(
                nursery, pathlib.Path(folder), n,
                config=ConsensusServiceConfig(empty_block_interval=0.1))
            await committee.start_all()
            with trio.fail_after(60):
                await committee.wait_committed(2)
            start_frames, start = _frames(committee), time.perf_counter()
            first = committee.members[0].service.validator.committed_height
            with trio.fail_after(120):
                await committee.wait_committed(first + heights)
            frames, seconds = _frames(committee) - start_frames, time.perf_counter() - start
            done = committee.members[0].service.validator.committed_height - first
            nursery.cancel_scope.cancel()
    return frames / done, seconds / done


async def kill_two_restart_one(down: float, limit: float) -> float | None:
    """Seconds from the restart to a new height on every running validator; None: stuck."""
    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            committee = LocalCommittee(nursery, pathlib.Path(folder), 4,
                                       config=ConsensusServiceConfig(empty_block_interval=0.1))
            await committee.start_all()
            with trio.fail_after(60):
                await committee.wait_committed(3)
            m = committee.members
            await committee.kill(m[3])
            await committee.kill(m[2])
            await trio.sleep(down)
            await committee.start(m[2])
            start = time.perf_counter()
            target = max(x.service.validator.committed_height for x in committee.running()) + 1
            result: float | None = None
            with trio.move_on_after(limit):
                await committee.wait_committed(target)
                result = time.perf_counter() - start
            nursery.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[4, 10])
    parser.add_argument("--heights", type=int, default=10)
    parser.add_argument("--down", type=float, default=3.0)
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=1, help="kill-two-restart-one repetitions")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    for n in args.sizes:
        fph, sph = trio.run(frames_per_height, n, args.heights)
        print(f"{n:3d} validators: {fph:8.1f} frames/height (minimum {minimum_frames(n)}, "
              f"{fph / minimum_frames(n):.2f}x), {sph * 1000:.0f} ms/height")
    for i in range(args.runs):
        took = trio.run(kill_two_restart_one, args.down, args.limit)
        print("kill two, restart one: " + (
            f"new height {took:.1f} s after the restart" if took is not None
            else f"STUCK: no new height within {args.limit:.0f} s"))


if __name__ == "__main__":
    main()
