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
* missed polka (finding 2's halt, deterministic): at height 3 two validators lose frames of
  round 0 (X and Y lose Q's prevote, Y the proposal: what the equivocator's other vote and
  the slow link did in the issue), so the proposer P and Q lock on the value and X and Y do
  not; once every validator is past round 1 the links are healed; the seconds from then
  until all four committed height 3 (``--limit`` s at most: "stuck").

Usage: ``python benchmarks/consensus_frames.py [--sizes 4 7 10 16] [--heights 10] [--down 3]``
(about 30 s).
"""

from __future__ import annotations

import argparse
import collections
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


def counters_of(committee: LocalCommittee) -> collections.Counter[str]:
    """Counters summed over the validators: gossip frames planned by kind (``plan:own`` the
    re-sends of own messages, ``plan:relay``, ``plan:certificate``, ``plan:commit``; first
    sends of own messages are not planned), link events and refused frames by reason."""
    total: collections.Counter[str] = collections.Counter()
    for m in committee.members:
        service = m.service
        if service is None:
            continue
        for kind, count in service.gossip.planned.items():
            total[f"plan:{kind}"] += count
        for why, count in service.gossip.relays.items():
            total[f"relay-to-peers:{why}"] += count
        stats = service.link_stats()
        if stats is not None:
            total["links:failed"] += stats.links_failed
            total["links:opened"] += stats.links_opened
            total["frames:dropped"] += stats.frames_dropped
            total["frames:backed_off"] += stats.frames_backed_off
        for reason, count in service.refused.items():
            total[f"refused:{reason}"] += count
    return total


def per_height(counters: collections.Counter[str], heights: int) -> str:
    """``counters`` divided by ``heights``, as one line."""
    return ", ".join(f"{k} {v / heights:.1f}" for k, v in sorted(counters.items()) if v)


DETAIL: list[str] = []


async def frames_per_height(n: int, heights: int) -> tuple[float, float, float]:
    """(frames per height, seconds per height, CPU seconds of the process per height) over
    ``heights`` heights after height 2; the counters of :func:`_counters` per height go to
    :data:`DETAIL`."""
    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            committee = LocalCommittee(
                nursery, pathlib.Path(folder), n,
                config=ConsensusServiceConfig(empty_block_interval=0.1))
            await committee.start_all()
            with trio.fail_after(60):
                await committee.wait_committed(2)
            start_frames, start = _frames(committee), time.perf_counter()
            counters0 = counters_of(committee)
            cpu0 = time.process_time()
            first = committee.members[0].service.validator.committed_height
            with trio.fail_after(120):
                await committee.wait_committed(first + heights)
            frames, seconds = _frames(committee) - start_frames, time.perf_counter() - start
            cpu = time.process_time() - cpu0
            done = committee.members[0].service.validator.committed_height - first
            counters = counters_of(committee)
            counters.subtract(counters0)
            DETAIL.append(per_height(counters, done))
            nursery.cancel_scope.cancel()
    return frames / done, seconds / done, cpu / done


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


async def missed_polka(limit: float) -> float | None:
    """Seconds from healing the links to height 3 on every validator; None: stuck."""
    from ps_p2p.consensus.types import Proposal, Vote, VoteType
    from ps_p2p.protocols import consensus_codec as cc
    from ps_p2p.protocols.links import LinkManager

    roles: dict[str, bytes] = {}
    lossy = {"on": True}
    send = LinkManager.send

    def lose(self, peer_id: bytes, message: bytes) -> bool:  # type: ignore[no-untyped-def]
        if lossy["on"] and roles:
            m = cc.decode_message(message)
            if isinstance(m, (Vote, Proposal)) and m.height == 3 and m.round == 0:
                if (isinstance(m, Vote) and m.type == VoteType.PREVOTE
                        and m.validator == roles["Q"] and peer_id in (roles["X"], roles["Y"])):
                    return True
                if isinstance(m, Proposal) and peer_id == roles["Y"]:
                    return True
        return send(self, peer_id, message)

    LinkManager.send = lose  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as folder:
            async with trio.open_nursery() as nursery:
                committee = LocalCommittee(nursery, pathlib.Path(folder), 4,
                                           config=ConsensusServiceConfig(empty_block_interval=0.1))
                m = committee.members
                await committee.start_all()
                p = m[0].service.validator.core.proposer(3, 0)
                q, x, y = [z.peer_id for z in m if z.peer_id != p]
                roles.update(P=p, Q=q, X=x, Y=y)
                await committee.wait_committed(2)
                while not all(z.service.validator.committed_height >= 3
                              or z.service.validator.core.round >= 2 for z in m):
                    await trio.sleep(0.05)
                lossy["on"] = False
                start = time.perf_counter()
                result: float | None = None
                with trio.move_on_after(limit):
                    await committee.wait_committed(3)
                    result = time.perf_counter() - start
                nursery.cancel_scope.cancel()
    finally:
        LinkManager.send = send  # type: ignore[method-assign]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[4, 7, 10, 16])
    parser.add_argument("--heights", type=int, default=10)
    parser.add_argument("--down", type=float, default=3.0)
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=1,
                        help="kill-two-restart-one and missed-polka repetitions (0: none)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    for n in args.sizes:
        fph, sph, cph = trio.run(frames_per_height, n, args.heights)
        print(f"{n:3d} validators: {fph:8.1f} frames/height (minimum {minimum_frames(n)}, "
              f"{fph / minimum_frames(n):.2f}x), {sph * 1000:.0f} ms/height, "
              f"CPU {cph * 1000:.0f} ms/height (all {n} validators, one process)")
        print(f"    per height: {DETAIL[-1] or 'nothing'}")
    for i in range(args.runs):
        took = trio.run(kill_two_restart_one, args.down, args.limit)
        print("kill two, restart one: " + (
            f"new height {took:.1f} s after the restart" if took is not None
            else f"STUCK: no new height within {args.limit:.0f} s"))
    for i in range(args.runs):
        took = trio.run(missed_polka, args.limit)
        print("missed polka: " + (
            f"height 3 committed {took:.1f} s after the links healed" if took is not None
            else f"STUCK: no height 3 within {args.limit:.0f} s of healing the links"))


if __name__ == "__main__":
    main()
