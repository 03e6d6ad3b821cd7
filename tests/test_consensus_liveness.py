"""Liveness of the committee under crashes and equivocation (issue 17, findings 1 and 2), on
real py-libp2p hosts in one process (:class:`~ps_p2p.testing.committee.LocalCommittee`).

* one equivocating validator plus one slow link between two correct ones: before the gossip
  relayed other validators' votes and carried a re-proposal's POL certificate, the proposer
  stayed locked on its round-0 value while the others, who never saw its polka (the
  equivocator sent them its other vote), prevoted nil on every re-proposal (L28-L32);
* kill two of four, restart one: the restarted validator must reach the others' round (L55)
  and prevote their re-proposal (L28) although it saw its first proposal late (timeliness is
  read by L22 only).
"""

from __future__ import annotations

import time

import trio

from ps_p2p.protocols.consensus import ConsensusServiceConfig
from ps_p2p.testing.committee import LocalCommittee


def delay_link(nursery: trio.Nursery, sender, receiver, seconds: float) -> None:
    """Every consensus frame ``sender`` queues for ``receiver`` is queued ``seconds`` later
    (a slow link: nothing lost, everything late)."""
    links = sender.service._links
    send = links.send

    def delayed(peer: bytes, data: bytes) -> bool:
        if peer != receiver.peer_id:
            return send(peer, data)

        async def later() -> None:
            await trio.sleep(seconds)
            send(peer, data)

        nursery.start_soon(later)
        return True

    links.send = delayed


def heights(committee: LocalCommittee) -> list[int]:
    return [m.service.validator.committed_height for m in committee.running()]


async def test_an_equivocator_and_one_slow_link_do_not_halt_the_committee(tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4, byzantine=(3,),
                                   config=ConsensusServiceConfig(empty_block_interval=0.1))
        with trio.fail_after(20):
            await committee.start_all()
            await committee.wait_committed(2)
        a, b = committee.members[0], committee.members[1]
        delay_link(nursery, a, b, 1.5)
        delay_link(nursery, b, a, 1.5)
        start = max(heights(committee))
        with trio.fail_after(45):
            await committee.wait_committed(start + 4, committee.members[:3])
        relayed = sum(m.service.gossip.planned["relay"] + m.service.gossip.planned["certificate"]
                      for m in committee.members[:3])
        nursery.cancel_scope.cancel()
    for h in range(1, start + 5):  # and no fork
        ids = {c.block.header for m in committee.members for c in m.commits if c.height == h}
        assert len(ids) == 1, h
    assert relayed >= 0


async def test_kill_two_restart_one_commits_again(tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(empty_block_interval=0.1))
        with trio.fail_after(20):
            await committee.start_all()
            await committee.wait_committed(3)
        m = committee.members
        await committee.kill(m[3])
        await committee.kill(m[2])
        with trio.move_on_after(3):  # the other two go through rounds without a quorum
            await committee.wait_committed(10_000, m[:2])
        await committee.start(m[2])
        target = max(heights(committee)) + 2
        with trio.fail_after(30):
            await committee.wait_committed(target)
        nursery.cancel_scope.cancel()
