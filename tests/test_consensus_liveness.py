"""Liveness of the committee under crashes and equivocation (issue 17, findings 1 and 2), on
real py-libp2p hosts in one process (:class:`~ps_p2p.testing.committee.LocalCommittee`).

* validators that missed a round-0 polka (the issue's equivocator and slow link did this):
  before the gossip carried a re-proposal's POL certificate, the locked validators prevoted
  nil on every other value (L29) and the others nil on every re-proposal (L28 never fired);
* lost precommits, then two crash and one restarts: the survivors must notice what the
  restarted one lost;
* kill two of four, restart one: the restarted validator must reach the others' round (L55)
  and prevote their re-proposal (L28) although it saw its first proposal late (timeliness is
  read by L22 only).
"""

from __future__ import annotations


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
    """The issue's perturbation as such (one validator equivocates, the link between two
    correct ones delays every frame by 1.5 s): four more heights, one block each. On loopback
    with the fast timeouts this did not halt the old gossip either (it needs the polka to be
    missed for good: see the missed-polka test below); it guards the new one."""
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
        nursery.cancel_scope.cancel()
    for h in range(1, start + 5):  # and no fork
        ids = {c.block.header for m in committee.members for c in m.commits if c.height == h}
        assert len(ids) == 1, h


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


# ------------------------------------------------------------------ the service's gossip wiring


class _Links:
    """A LinkManager stand-in that records what would be queued to whom."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send(self, peer: bytes, data: bytes) -> bool:
        from ps_p2p.protocols import consensus_codec as cc
        self.sent.append((peer, cc.decode_message(data)))
        return True


def _service():
    from libp2p.peer.id import ID

    from ps_p2p.consensus.store import ConsensusStore
    from ps_p2p.protocols.consensus import ConsensusService
    from ps_p2p.testing.committee import LocalCommittee as LC

    async def build(tmp):
        async with trio.open_nursery() as nursery:
            return LC(nursery, tmp, 4)

    import tempfile
    committee = trio.run(build, tempfile.mkdtemp())
    me = committee.members[0].identity

    class Host:
        def get_id(self):
            return ID(me.peer_id)

    service = ConsensusService(Host(), me, committee.genesis, ConsensusStore(":memory:"),
                               committee.consensus)
    service._links = _Links()
    service.validator.start(0.0)
    return service, committee


def test_a_re_proposal_goes_out_with_its_pol_certificate_to_peers_that_lack_it():
    """L28 at a validator that missed round 0 (down, or behind a slow link while an
    equivocator sent it its other vote) needs the 2f+1 prevotes of the POL round: the
    proposer sends them with the proposal, to each peer that lacks them."""
    from ps_p2p.consensus.block import encode_block, make_block
    from ps_p2p.consensus.types import Proposal, Vote, VoteType
    from ps_p2p.registry.validator import SendMessage

    service, committee = _service()
    v = service.validator
    block = make_block(chain_id=v.genesis.chain_id, height=1, time_ms=v.genesis.time_ms + 5,
                       prev_block_id=v.state.block_id, app_hash=v.state.app_hash,
                       proposer=v.address)
    raw = encode_block(block)
    vid = v.config.value_id(raw)
    prevotes = [Vote(VoteType.PREVOTE, 1, 0, vid, m.peer_id, b"s" * 64) for m in committee.members]
    for pv in prevotes:
        v.receive(pv, 0.0)
    peer_b = committee.members[1].peer_id
    service.gossip.heard(peer_b, prevotes[2], 0.0)  # B relayed C's prevote to us: B has it
    service._execute(SendMessage(Proposal(1, 1, raw, 0, v.address, b"s" * 64)))
    to_b = [m for p, m in service._links.sent if p == peer_b]
    assert isinstance(to_b[0], Proposal)
    assert set(to_b[1:]) == {prevotes[0], prevotes[3]}  # not its own, not C's (it has it)
    for other in committee.members[2:]:
        got = {m for p, m in service._links.sent if p == other.peer_id}
        assert set(prevotes) - {pv for pv in prevotes if pv.validator == other.peer_id} <= got


def test_own_messages_are_not_sent_again_every_interval_to_peers_that_have_them():
    """Issue 17 finding 4: every 0.2 s each validator re-sent its last two rounds' messages
    to every peer (1,287 frames a height at 10 validators where ~270 suffice)."""
    from ps_p2p.consensus.types import Vote, VoteType
    from ps_p2p.registry.validator import SendMessage

    service, committee = _service()
    v = service.validator
    service._gossip(0.0)  # what start() signed (a proposal, if ours) goes out once
    mine = Vote(VoteType.PREVOTE, 1, 0, None, v.address, b"s" * 64)
    v._remember_own(mine)
    service._execute(SendMessage(mine))
    sent = len(service._links.sent)
    assert [m for _, m in service._links.sent].count(mine) == 3
    for k in range(1, 6):  # the periodic gossip (the service's tick, timers aside)
        service._gossip(k * service.rebroadcast_interval)
    assert len(service._links.sent) == sent
    service.gossip.link_down(committee.members[2].peer_id)  # frames may be lost: send again
    service._gossip(10 * service.rebroadcast_interval)
    assert (committee.members[2].peer_id, mine) in service._links.sent[sent:]


async def test_lost_precommits_then_two_crash_and_one_restarts_the_committee_commits_again(
        tmp_path, monkeypatch):
    """All four lock on height 3's value and precommit it, but every precommit is lost on
    the way (silently: the links stay up), so nobody decides and nobody leaves round 0 (L47
    needs 2f+1 precommits); two crash, one restarts and replays its WAL. The survivors learn
    from the replay (messages it sent before) that it lost what they sent it, and from its
    standing still that frames may be lost: they send it again what it lacks, at most once
    per ``forget_after``. (The first version of the per-peer gossip believed every frame
    queued on a live link arrived and stayed stuck here for good.)"""
    from ps_p2p.consensus.types import Vote, VoteType
    from ps_p2p.protocols import consensus_codec as cc
    from ps_p2p.protocols.links import LinkManager

    lossy = {"on": True}
    send = LinkManager.send

    def lose_precommits(self, peer_id: bytes, message: bytes) -> bool:
        if lossy["on"]:
            m = cc.decode_message(message)
            if isinstance(m, Vote) and m.type == VoteType.PRECOMMIT and m.height >= 3:
                return True  # lost on the way
        return send(self, peer_id, message)

    monkeypatch.setattr(LinkManager, "send", lose_precommits)
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(empty_block_interval=0.1))
        m = committee.members
        with trio.fail_after(20):
            await committee.start_all()
            await committee.wait_committed(2)
            # everyone locked on height 3's value (L36-L40), nobody decided (L49)
            while not all(x.service.validator.core.height == 3
                          and x.service.validator.core.locked_round >= 0 for x in m):
                await trio.sleep(0.05)  # polling other tasks' state: no event to await
        await committee.kill(m[3])
        await committee.kill(m[2])
        lossy["on"] = False
        await committee.start(m[2])
        with trio.fail_after(30):
            await committee.wait_committed(3)
        assert m[2].service.validator.stats.locks_restored == 1
        nursery.cancel_scope.cancel()
    ids = {c.block.header for x in m[:3] for c in x.commits if c.height == 3}
    assert len(ids) == 1


async def test_validators_that_missed_the_polka_prevote_the_locked_validators_re_proposal(
        tmp_path, monkeypatch):
    """Issue 17 finding 2's halt, made deterministic: at height 3 two validators lose frames of
    round 0 (the equivocator's other vote and a slow link did this in the issue): X and Y lose
    Q's prevote, Y the proposal too. P (the proposer) and Q see the polka and lock on the value
    (L36-L40); X and Y do not. With own-messages-only re-broadcast of the last two rounds the
    POL of round 0 was never sent again: X and Y prevoted nil on every re-proposal (L28 never
    fires), P and Q nil on every other value (L29): no decision, ever. Now the POL certificate
    goes with each re-proposal (and again to a validator that prevotes against it)."""
    from ps_p2p.consensus.types import Proposal, Vote, VoteType
    from ps_p2p.protocols import consensus_codec as cc
    from ps_p2p.protocols.links import LinkManager

    roles: dict[str, bytes] = {}
    lossy = {"on": True}
    send = LinkManager.send

    def lose(self, peer_id: bytes, message: bytes) -> bool:
        if lossy["on"] and roles:
            m = cc.decode_message(message)
            if isinstance(m, (Vote, Proposal)) and m.height == 3 and m.round == 0:
                if (isinstance(m, Vote) and m.type == VoteType.PREVOTE
                        and m.validator == roles["Q"] and peer_id in (roles["X"], roles["Y"])):
                    return True  # lost on the way
                if isinstance(m, Proposal) and peer_id == roles["Y"]:
                    return True
        return send(self, peer_id, message)

    monkeypatch.setattr(LinkManager, "send", lose)
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4,
                                   config=ConsensusServiceConfig(empty_block_interval=0.1))
        m = committee.members
        locked: list[bytes] = []
        with trio.fail_after(20):
            await committee.start_all()
            p = m[0].service.validator.core.proposer(3, 0)
            q, x, y = [z.peer_id for z in m if z.peer_id != p]
            roles.update(P=p, Q=q, X=x, Y=y)
            await committee.wait_committed(2)
            # every validator past round 1 at height 3 (the old re-broadcast's window)
            while not all(z.service.validator.committed_height >= 3
                          or z.service.validator.core.round >= 2 for z in m):
                await trio.sleep(0.05)  # polling other tasks' state: no event to await
            locked = [z.peer_id for z in m if z.service.validator.core.locked_round == 0]
        lossy["on"] = False
        with trio.fail_after(30):
            await committee.wait_committed(3)
        nursery.cancel_scope.cancel()
    assert len({c.block.header for z in m for c in z.commits if c.height == 3}) == 1
    assert set(locked) <= {p, q}


def test_the_service_runs_the_gossip_policy_the_simulator_runs():
    """Issue 17: one gossip implementation for the service and the simulator's
    ``gossip="service"`` (:class:`~ps_p2p.consensus.gossip_policy.ServiceGossip`)."""
    import dataclasses
    import random

    from ps_p2p.consensus.core import ConsensusCore
    from ps_p2p.consensus.gossip_policy import ServiceGossip
    from ps_p2p.testing.consensus_sim import SIM_CONFIG, _Sim, draw_params

    service, _ = _service()
    assert type(service.policy) is ServiceGossip and service.gossip is service.policy.gossip
    params = dataclasses.replace(draw_params(random.Random(0), 1, 1), gossip="service")
    assert type(_Sim(0, params, ConsensusCore, SIM_CONFIG).new_policy(0)) is ServiceGossip
