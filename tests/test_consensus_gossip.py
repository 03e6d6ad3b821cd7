"""The consensus gossip plan (ps_p2p.consensus.gossip, pure): a peer is sent what it lacks,
once; other validators' messages are relayed to a peer behind or stalled; a re-proposal's POL
certificate and the last commit reach the peers that lack them (issue 17)."""

from __future__ import annotations

from ps_p2p.consensus.gossip import MAX_KNOWN_PER_PEER, Gossip
from ps_p2p.consensus.types import Proposal, Vote, VoteType

A, B, C, D = b"val-a", b"val-b", b"val-c", b"val-d"
PV, PC = VoteType.PREVOTE, VoteType.PRECOMMIT


def vote(t: VoteType, r: int, who: bytes, vid: bytes | None = b"v", h: int = 1) -> Vote:
    return Vote(t, h, r, vid, who, b"sig")


def gossip() -> Gossip:
    return Gossip(A, (B, C, D), relay_after=1.0)


def plan(g: Gossip, now: float, *, round_: int = 0, own=(), relay=(), commit=None):
    return g.plan(now, height=1, round_=round_, own=list(own), relay=list(relay),
                  commit=commit)


def test_own_messages_are_sent_once_to_each_peer_not_every_interval():
    g = gossip()
    mine = vote(PV, 0, A)
    first = plan(g, 0.0, own=[mine])
    assert sorted(p for p, _ in first) == [B, C, D]
    for t in (0.2, 0.4, 5.0):
        assert plan(g, t, own=[mine]) == []  # no re-broadcast storm


def test_a_peer_whose_link_went_down_gets_our_messages_again():
    g = gossip()
    mine = vote(PV, 0, A)
    plan(g, 0.0, own=[mine])
    g.link_down(C)
    assert plan(g, 0.2, own=[mine]) == [(C, mine)]


def test_a_message_that_could_not_be_queued_is_planned_again():
    g = gossip()
    mine = vote(PV, 0, A)
    plan(g, 0.0, own=[mine])
    g.unsent(B, mine)
    assert plan(g, 0.2, own=[mine]) == [(B, mine)]


def test_a_peer_is_never_sent_what_it_sent_us_nor_its_own_messages():
    g = gossip()
    theirs = vote(PV, 0, C)
    g.heard(B, theirs, 0.0)  # B relayed C's vote to us: B has it
    relay = [theirs, vote(PV, 0, D)]
    for peer in (B, C, D):
        g.heard(peer, vote(PV, 0, peer), 0.0)
    out = plan(g, 1.5, relay=relay)  # all stalled: relay what each lacks
    assert set(out) == {(B, relay[1]), (C, relay[1]), (D, theirs)}


def test_other_validators_votes_are_relayed_to_a_peer_behind_in_round_at_once():
    """A restarted validator at round 0 gets f+1 messages of our round (L55) and the polka."""
    g = gossip()
    g.heard(B, vote(PV, 0, B), 0.0)  # B is at round 0
    g.heard(C, vote(PV, 3, C), 0.0)
    g.heard(D, vote(PV, 3, D), 0.0)
    relay = [vote(PV, 3, C), vote(PV, 3, D)]
    out = plan(g, 0.1, round_=3, relay=relay)
    assert set(out) == {(B, relay[0]), (B, relay[1])}  # C, D are in our round and moving


def test_a_healthy_peer_that_keeps_moving_is_relayed_nothing():
    g = gossip()
    relay = [vote(PV, 0, C)]
    for t, step in ((0.0, PV), (0.5, PC)):
        g.heard(B, vote(step, 0, B), t)
    assert all(p != B for p, _ in plan(g, 0.9, relay=relay))
    assert (B, relay[0]) in plan(g, 1.6, relay=relay)  # stalled for relay_after: relayed


def test_a_re_proposals_pol_certificate_goes_to_each_peer_that_lacks_it():
    g = gossip()
    cert = [vote(PV, 0, x) for x in (A, C, D)]
    g.heard(C, cert[2], 0.0)  # C has D's prevote
    assert g.certificate_for(B, cert) == cert
    assert g.certificate_for(C, cert) == [cert[0]]  # not its own, not what it sent
    assert g.certificate_for(B, cert) == []  # sent once
    assert g.planned["certificate"] == 4


def test_the_last_commit_goes_to_a_peer_in_a_later_round_of_the_decided_height():
    g = gossip()
    proposal = Proposal(1, 0, b"block", -1, B, b"sig")
    commit = (1, 0, (vote(PC, 0, A), vote(PC, 0, C), vote(PC, 0, D), proposal))
    for peer in (B, C, D):
        g.sent(peer, commit[2][0])  # our precommit went out to everyone (on_send)
    g.heard(B, vote(PC, 0, B), 0.0)  # B decided with us: nothing to send
    g.heard(C, vote(PV, 2, C), 0.0)  # C went on to round 2: it missed the decision
    out = g.plan(0.1, height=2, round_=0, own=[], relay=[], commit=commit)
    assert {p for p, _ in out} == {C}
    assert {m for _, m in out} == {commit[2][2], proposal}  # not C's own, nor ours it has


def test_the_last_commit_goes_to_a_peer_in_the_decided_round_that_lost_our_precommit():
    """Simulator seed 9984 (service gossip, lock race): B and C precommitted in the decided
    round, our precommit to them was lost and the fourth validator never precommitted: they
    hold two precommits, too few for L49 and for L47 (no timeout, no later round). We moved
    on to the next height, so our precommit is no longer among our own messages: the commit
    must reach them (Algorithm 1's gossip assumption), and only them."""
    g = gossip()
    proposal = Proposal(1, 0, b"block", -1, D, b"sig")
    ours = vote(PC, 0, A)
    commit = (1, 0, (ours, vote(PC, 0, B), vote(PC, 0, C), proposal))
    for peer in (B, C, D):
        g.sent(peer, ours)
        g.heard(peer, vote(PC, 0, peer) if peer != D else vote(PV, 0, D), 0.0)
    g.link_down(B)  # our frames to B were lost
    g.link_down(C)
    g.heard(B, vote(PC, 0, B), 0.0)
    g.heard(C, vote(PC, 0, C), 0.0)
    out = g.plan(0.1, height=2, round_=0, own=[], relay=[], commit=commit)
    assert {p for p, _ in out} == {B, C}  # D has our precommit: nothing to send it
    assert {m for p, m in out if p == B} == {ours, commit[2][2], proposal}
    assert g.plan(0.2, height=2, round_=0, own=[], relay=[], commit=commit) == []  # once


def test_a_peer_resending_its_own_message_lost_what_we_sent_it_forgotten_once_a_period():
    """After a restart a peer replays its WAL (messages it sent before): we send ours again;
    a peer that re-sends often costs one resend per ``forget_after``, not a storm."""
    g = gossip()
    mine = vote(PV, 2, A)
    replayed = vote(PV, 2, B)
    g.heard(B, replayed, 0.0)
    plan(g, 0.0, round_=2, own=[mine])
    g.heard(B, replayed, 0.1)
    assert plan(g, 0.2, round_=2, own=[mine]) == [(B, mine)]
    g.heard(B, replayed, 0.3)
    assert plan(g, 0.4, round_=2, own=[mine]) == []  # within forget_after of the last
    g.heard(B, replayed, 2.5)
    assert plan(g, 2.6, round_=2, own=[mine]) == [(B, mine)]


def test_a_peer_stalled_at_our_height_is_sent_what_it_may_have_lost_once_a_period():
    g = gossip()
    mine = vote(PV, 0, A)
    g.heard(B, vote(PV, 0, B), 0.0)
    plan(g, 0.0, own=[mine], relay=[mine])
    assert [m for p, m in plan(g, 1.5, own=[mine], relay=[mine]) if p == B] == []
    assert [m for p, m in plan(g, 2.0, own=[mine], relay=[mine]) if p == B] == [mine]
    assert [m for p, m in plan(g, 2.5, own=[mine], relay=[mine]) if p == B] == []


def test_what_is_remembered_per_peer_is_bounded_and_pruned_by_height():
    g = gossip()
    for i in range(MAX_KNOWN_PER_PEER + 10):
        g.heard(B, vote(PV, i, C), 0.0)
    assert len(g.views[B].known) <= MAX_KNOWN_PER_PEER
    g.heard(C, vote(PV, 0, D, h=1), 0.0)
    g.heard(C, vote(PV, 0, D, h=3), 0.0)
    g.new_height(3)
    assert [m.height for m in g.views[C].known] == [3]


def test_a_peer_stalled_for_long_is_sent_the_relay_set_again_at_growing_intervals():
    """Issue 17, 16 validators under CPU load: a height took longer than ``forget_after``,
    every peer looked stalled, and each was sent the whole relay set again every
    ``forget_after`` (83,550 frames per height). The guesses back off while the peer stays
    put (2 s, then 4, 8, 16: capped at 8x) and start afresh once it moves."""
    g = gossip()  # relay_after 1.0, forget_after 2.0
    relay = [vote(PV, 0, C), vote(PV, 0, D)]
    g.heard(B, vote(PV, 0, B), 0.0)
    resent_at = []
    for i in range(1, 301):  # 30 s of 0.1 s gossip ticks; B never moves
        t = i / 10
        if any(p == B for p, _ in plan(g, t, relay=relay)):
            resent_at.append(t)
    assert resent_at[0] == 1.0  # stalled for relay_after: relayed at once
    # then waits of 2, 4, 8, 16 (the cap) s: 4 resends in 30 s, not 15 (one every 2 s)
    assert resent_at[1:] == [2.0, 6.0, 14.0, 30.0]
    g.heard(B, vote(PC, 0, B), 30.0)  # it moves: a later stall is guessed again soon
    assert not any(p == B for p, _ in plan(g, 31.0, relay=relay))
    assert any(p == B for p, _ in plan(g, 32.1, relay=relay))


def test_a_peer_is_stalled_only_after_a_whole_height_of_ours_when_heights_are_slow():
    """Issue 17, 16 validators under CPU load: heights took 0.75-1.2 s, so a peer that had
    not moved for ``relay_after`` (0.4 s) was only slow, yet it was relayed every vote it
    might lack (1,779 frames per height, most of them votes it had). Once our own heights
    take longer than ``relay_after``, a peer stalls after our smoothed time per height."""
    g = Gossip(A, (B, C, D), relay_after=0.5)
    relay = [vote(PV, 0, C, h=4)]
    for h, t in ((1, 0.0), (2, 2.0), (3, 4.0), (4, 6.0)):  # our heights take 2 s each
        g.plan(t, height=h, round_=0, own=[], relay=[])
    assert g.stall_after() == 2.0
    g.heard(B, vote(PV, 0, B, h=4), 6.0)
    assert g.plan(7.0, height=4, round_=0, own=[], relay=relay) == []  # slow, not stalled
    assert g.plan(8.1, height=4, round_=0, own=[], relay=relay) == [(B, relay[0])]


def test_a_stalled_peer_is_relayed_after_relay_after_when_heights_are_fast():
    g = Gossip(A, (B, C, D), relay_after=0.5)
    for h, t in ((1, 0.0), (2, 0.2), (3, 0.4)):  # heights faster than relay_after
        g.plan(t, height=h, round_=0, own=[], relay=[])
    assert g.stall_after() == 0.5
    relay = [vote(PV, 0, C, h=3)]
    g.heard(B, vote(PV, 0, B, h=3), 0.4)
    assert g.plan(0.95, height=3, round_=0, own=[], relay=relay) == [(B, relay[0])]


def test_a_moving_peer_behind_in_round_gets_the_rounds_above_its_own_at_once():
    """Issue 17, 16 validators with a round past 0: the peers still in the round before ours
    were relayed that round's votes, which they had from their signers (1.51x the minimum
    frames; 1.03x without). Rounds above the peer's own go at once (L55, then acting in
    ours); its own round's only once it stalls."""
    g = gossip()  # relay_after 1.0
    g.heard(B, vote(PC, 2, B), 0.0)  # B precommitted in round 2; we are in round 3
    g.heard(C, vote(PV, 3, C), 0.0)
    g.heard(D, vote(PV, 3, D), 0.0)
    relay = [vote(PC, 2, C), vote(PC, 2, D), vote(PV, 3, C), vote(PV, 3, D)]
    out = plan(g, 0.1, round_=3, relay=relay)
    assert {m for p, m in out if p == B} == set(relay[2:])
    later = plan(g, 1.1, round_=3, relay=relay)
    assert {m for p, m in later if p == B} == set(relay[:2])  # stalled: the rest it may lack
