"""Consensus gossip: which signed proposals and votes to send to which peer (pure; no I/O,
clock or randomness: ``now`` is passed in).

Source: Algorithm 1 of Buchman, Kwon, Milosevic, "The latest gossip on BFT consensus" (arXiv
1807.04938) assumes *gossip communication*: a message a correct process receives reaches every
correct process (after GST, within Delta). Its rules need whole sets of other validators'
messages: 2f+1 prevotes of a POL round for a re-proposal (L28), of the current round (L36,
L44), 2f+1 precommits (L49), f+1 messages of a higher round (L55). Sending only one's own
messages is not enough (issue 17: a validator restarted after a polka never saw the prevotes
behind a re-proposal's POL round, so it prevoted nil there forever while the locked ones
prevoted nil too (L29); one equivocator plus one slow link left the same state with all four
up). CometBFT keeps a per-peer round state and sends a peer what it lacks; this module does the
same with what it can learn without a message of its own:

* **What a peer has** (:class:`PeerView`): every message it sent us, and every message we
  sent it (a link is reliable while up; when it goes down, :meth:`Gossip.link_down` forgets
  what we sent). Nothing is sent twice to a peer that has it: no re-broadcast storm. What we
  cannot see is forgotten too, at most once per ``forget_after`` seconds per peer: a peer that
  sends again one of its own messages it sent before (it restarted and replays its WAL, or
  lost its link to us), and a peer of our height that has not moved for ``forget_after``
  (a frame lost on a link that stayed up, a restart we did not notice; a crashed peer's
  stream to it may look healthy until the next write). That last one is a guess: while the
  peer stays put the guesses back off (``forget_after``, 2x, 4x, 8x), so a committee
  slowed by CPU load does not re-send every relay set every period.
* **Where a peer is**: the highest (height, round, step) among the messages it signed itself;
  when it last moved.
* **What it is sent** (:meth:`Gossip.plan`, called every gossip interval):

  - our own messages of the current height it lacks (after a lost link, a restart);
  - the *relay set* it lacks (the current round's and the previous round's proposals and votes,
    and the POL certificates of those proposals and of our valid round: L28, L36, L44, L55) when
    it has not moved for :meth:`Gossip.stall_after` seconds (``relay_after``, or our own
    smoothed time per height when longer: a lost frame, a slow link, not a slow committee);
    to a peer behind us in round that still moves, at once, the messages of the rounds above
    its own (L55; its own round's it has from their signers);
  - the last *commit* it lacks (the decided round's proposal and 2f+1 precommits: L49) when it
    is still at that height in a later round than the decided one (it missed the decision;
    block sync covers heights further behind).

* A proposal with a POL round travels with its POL certificate (the 2f+1 prevotes of that
  round, L28) to every peer that lacks them, at once (:meth:`Gossip.certificate_for`): a
  validator that was down or behind a slow link can prevote a re-proposal without waiting.
  A peer that prevotes against a re-proposal whose certificate we hold (nil or another value)
  may lack it after all (a frame lost with a peer's crash, or a certificate we never had in
  full): the proposal and certificate are sent to it again, once per (height, round)
  (:meth:`Gossip.resend`); it can then prevote the next re-proposal (L28).

Bounds: peers are the validators of the committed set (:meth:`Gossip.set_peers`); per peer at
most :data:`MAX_KNOWN_PER_PEER` messages remembered (beyond it the memory is cleared: at worst
messages are sent once more), all of the current height or the one below (:meth:`Gossip.
new_height` drops older ones). What one plan sends a peer is bounded by the relay set: two
rounds of proposals (two per round) and votes (each validator one per type, plus the
conflicting ones the vote keeper counts), plus one POL certificate per held proposal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from ps_p2p.consensus.types import Decide, Proposal, Vote, VoteType

if TYPE_CHECKING:
    from ps_p2p.consensus.core import ConsensusCore

__all__ = ["MAX_KNOWN_PER_PEER", "Gossip", "PeerView", "commit_of", "pol_certificate",
           "proposals_against", "relay_set"]

#: Messages remembered per peer (its own and relayed ones it has), at most.
MAX_KNOWN_PER_PEER = 4096

#: A stalled peer's guessed losses are forgotten at most every ``forget_after`` times this.
MAX_STALL_WAIT_FACTOR = 8

Message = Proposal | Vote


def signer(message: Message) -> bytes:
    """The validator that signed ``message``."""
    return message.proposer if isinstance(message, Proposal) else message.validator


def position(message: Message) -> tuple[int, int, int]:
    """(height, round, step) of a message (step: 0 proposal, 1 prevote, 2 precommit)."""
    step = 0 if isinstance(message, Proposal) else int(message.type)
    return (message.height, message.round, step)


def pol_certificate(core: ConsensusCore, proposal: Proposal) -> tuple[Vote, ...]:
    """The 2f+1 prevotes of ``proposal``'s POL round for its value that ``core`` holds (L28);
    () for a fresh proposal or another height than the core's."""
    keeper = core.keeper
    if proposal.pol_round < 0 or keeper is None or proposal.height != core.height:
        return ()
    return keeper.votes_for(proposal.pol_round, VoteType.PREVOTE,
                            core.config.value_id(proposal.value))


def relay_set(core: ConsensusCore) -> list[Message]:
    """Signed proposals and votes of ``core``'s height to relay to a peer that lacks them
    (:meth:`Gossip.plan`): the proposals and votes held of its round and the one before (L36,
    L44, L49, and f+1 of a higher round for L55), with the POL certificates of those proposals
    and of its valid round (2f+1 prevotes, L28). Empty once decided. The service
    (:meth:`ps_p2p.registry.validator.Validator.relay_set`) and the simulator
    (:class:`ps_p2p.consensus.gossip_policy.ServiceGossip`) both call this."""
    keeper = core.keeper
    if core.height is None or keeper is None or core.decision is not None:
        return []
    out: list[Message] = []
    for r in (core.round - 1, core.round):
        if r < 0:
            continue
        for p in core.proposals(r):
            out.append(p)
            out.extend(pol_certificate(core, p))
        out.extend(keeper.votes_of(r))
    if core.valid_value is not None and core.valid_round >= 0:
        out.extend(keeper.votes_for(core.valid_round, VoteType.PREVOTE,
                                    core.config.value_id(core.valid_value)))
    return out


def commit_of(core: ConsensusCore, decision: Decide
              ) -> tuple[int, int, tuple[Message, ...]] | None:
    """(height, round, messages) of ``decision`` for :meth:`Gossip.plan`'s ``commit``: its
    precommits and the decided round's proposal as ``core`` holds it (call before the next
    height starts); None when the core does not hold that proposal."""
    proposal = core.proposal_for(decision.round, core.config.value_id(decision.value))
    if proposal is None:
        return None
    return (decision.height, decision.round, (*decision.commit, proposal))


def proposals_against(core: ConsensusCore, prevote: Vote) -> list[tuple[Proposal, tuple[
        Vote, ...]]]:
    """Re-proposals of ``prevote``'s round whose value it votes against and whose POL
    certificate ``core`` holds in full, each with that certificate: what
    :meth:`Gossip.resend` sends its signer again (it may lack the certificate, L28)."""
    keeper = core.keeper
    out = []
    for p in core.proposals(prevote.round):
        if p.pol_round < 0 or prevote.value_id == core.config.value_id(p.value):
            continue
        certificate = pol_certificate(core, p)
        if keeper is None or not keeper.is_quorum(
                sum(keeper.power_of(c.validator) for c in certificate)):
            continue  # we do not hold it in full either
        out.append((p, certificate))
    return out


@dataclass
class PeerView:
    """What we know of one peer: the messages it has, and where it is."""

    #: messages it sent us or we sent it (insertion order; bounded)
    known: dict[Message, None] = field(default_factory=dict)
    #: highest (height, round, step) of a message it signed; (-1, -1, -1) before any
    position: tuple[int, int, int] = (-1, -1, -1)
    #: ``now`` when ``position`` last grew
    moved_at: float = -math.inf
    #: ``now`` when what it has was last forgotten (a resend or a stall)
    forgot_at: float = -math.inf
    #: (height, round) whose proposal and certificate were sent again (:meth:`Gossip.resend`)
    resent: set[tuple[int, int]] = field(default_factory=set)
    #: seconds before the next *stall* forget (doubles per forget while it does not move)
    stall_wait: float = 0.0

    def has(self, message: Message) -> bool:
        return message in self.known

    def add(self, message: Message) -> None:
        if len(self.known) >= MAX_KNOWN_PER_PEER:
            self.known.clear()  # at worst some messages are sent once more
        self.known[message] = None


class Gossip:
    """Per-peer views and the send plan of one validator (see the module docstring).

    Args:
        address: our validator address.
        peers: the other validators' addresses.
        relay_after: seconds a peer may stay at one (height, round, step) before it is sent
            the relay set it lacks (default 1.0: above a healthy height's decision time, so a
            committee that decides at once relays nothing).
        forget_after: at most this often per peer, what it has is forgotten (module
            docstring); default twice ``relay_after``.
    """

    def __init__(self, address: bytes, peers: Sequence[bytes], *, relay_after: float = 1.0,
                 forget_after: float | None = None) -> None:
        self.address = address
        self.relay_after = relay_after
        self.forget_after = 2 * relay_after if forget_after is None else forget_after
        self.views: dict[bytes, PeerView] = {p: PeerView() for p in peers if p != address}
        #: smoothed seconds per height of our own (EWMA, weight 1/4; None before a sample)
        self.height_seconds: float | None = None
        self._height: int | None = None  # the height of the last plan, and when it began
        self._height_at = 0.0
        #: frames planned, by kind (own, relay, certificate, commit)
        self.planned: dict[str, int] = {"own": 0, "relay": 0, "certificate": 0, "commit": 0}
        #: relay plans to a peer, by why: behind us in round, or stalled (``stall_after``)
        self.relays: dict[str, int] = {"behind": 0, "stalled": 0}

    def heard(self, peer: bytes, message: Message, now: float) -> None:
        """``peer`` sent us ``message`` (decoded; whether or not we use it): it has it; if it
        signed it, it is at least at that (height, round, step). A signed message *below*
        the peer's position is a resend after its link went down or it restarted: it may
        lack what we sent it, so that is forgotten."""
        view = self.views.get(peer)
        if view is None:
            return
        if signer(message) == peer:
            pos = position(message)
            if pos > view.position:
                view.position, view.moved_at = pos, now
                view.stall_wait = self.forget_after  # it moves: stall guesses start afresh
            elif message in view.known:  # it sends again what it sent: restart, lost link
                self._forget(view, now, self.forget_after)
        view.add(message)

    def _forget(self, view: PeerView, now: float, wait: float) -> bool:
        """Forget what ``view``'s peer has, unless it was forgotten less than ``wait`` ago."""
        if now - view.forgot_at < wait:
            return False
        view.forgot_at = now
        view.known.clear()
        return True

    def _forget_stalled(self, view: PeerView, now: float) -> None:
        """A peer of our height has not moved for a while: it *may* have lost frames on a
        link that stayed up (a guess, unlike a resend or a failed link). Each guess forgets
        what it has, so it is sent the whole relay set again; the guesses back off
        exponentially while it stays put (forget_after, then 2x, 4x, ... up to
        :data:`MAX_STALL_WAIT_FACTOR` x), and start afresh when it moves. Under CPU overload
        every peer looks stalled (a height takes longer than ``forget_after``), and a fixed
        period re-sent every relay set to every peer each period: N (N-1) x |relay set|
        frames a period whose decoding slowed the height further (issue 17: 83,550 frames
        per height at 16 validators)."""
        wait = view.stall_wait or self.forget_after
        if self._forget(view, now, wait):
            view.stall_wait = min(2 * wait, MAX_STALL_WAIT_FACTOR * self.forget_after)

    def link_down(self, peer: bytes) -> None:
        """Our link to ``peer`` failed: frames may have been lost; forget what we sent."""
        view = self.views.get(peer)
        if view is not None:
            view.known.clear()

    def sent(self, peer: bytes, message: Message) -> None:
        """``message`` was queued on the link to ``peer``."""
        view = self.views.get(peer)
        if view is not None:
            view.add(message)

    def unsent(self, peer: bytes, message: Message) -> None:
        """``message`` could not be queued to ``peer`` (link queue full, dial back-off)."""
        view = self.views.get(peer)
        if view is not None:
            view.known.pop(message, None)

    def set_peers(self, peers: Sequence[bytes]) -> None:
        """Follow the validator set (a committed VALSET_UPDATE): a new peer gets an empty view
        (it lacks everything), a removed one's view is dropped; O(peers), nothing when equal."""
        wanted = [p for p in peers if p != self.address]
        if len(wanted) == len(self.views) and all(p in self.views for p in wanted):
            return
        self.views = {p: self.views.get(p) or PeerView() for p in wanted}

    def new_height(self, height: int) -> None:
        """Our height is now ``height``: forget messages below ``height - 1``."""
        for view in self.views.values():
            view.resent = {k for k in view.resent if k[0] >= height}
            if any(m.height < height - 1 for m in view.known):
                view.known = {m: None for m in view.known if m.height >= height - 1}

    def lacks(self, peer: bytes, message: Message) -> bool:
        """Whether ``peer`` may lack ``message`` (never its own messages)."""
        view = self.views.get(peer)
        return view is not None and signer(message) != peer and not view.has(message)

    def certificate_for(self, peer: bytes, certificate: Iterable[Message]) -> list[Message]:
        """The messages of a proposal's POL certificate ``peer`` lacks (marked sent)."""
        out = [m for m in certificate if self.lacks(peer, m)]
        self._mark(peer, out, "certificate")
        return out

    def resend(self, peer: bytes, key: tuple[int, int], messages: Sequence[Message]
               ) -> list[Message]:
        """``peer`` prevoted against the proposal of ``key`` = (height, round) whose POL
        certificate we hold: the proposal and certificate ``messages`` it may lack after all,
        once per ``key`` (marked sent); [] after the first time."""
        view = self.views.get(peer)
        if view is None or key in view.resent:
            return []
        if len(view.resent) >= 64:
            view.resent.clear()
        view.resent.add(key)
        for m in messages:
            view.known.pop(m, None)
        return self.certificate_for(peer, messages)

    def plan(
        self,
        now: float,
        *,
        height: int,
        round_: int,
        own: Sequence[Message],
        relay: Sequence[Message],
        commit: tuple[int, int, Sequence[Message]] | None = None,
    ) -> list[tuple[bytes, Message]]:
        """What to send now: (peer, message) pairs, each marked sent (module docstring).

        Args:
            height, round_: ours (the height being decided, our round in it).
            own: our own signed messages of ``height`` (recent rounds).
            relay: the relay set of ``height`` (proposals and votes we hold).
            commit: (height, round, messages) of the last decision: the proposal and the
                precommits of its commit; None before one.
        """
        out: list[tuple[bytes, Message]] = []
        self._time_height(height, now)
        stall_after = self.stall_after()
        forget_after = max(self.forget_after, 2 * stall_after)
        for peer, view in self.views.items():
            ph, pr, _ = view.position
            stalled = now - view.moved_at >= stall_after
            if ph == height and relay and now - view.moved_at >= forget_after:
                self._forget_stalled(view, now)  # it may have lost what we sent
            todo = [("own", m) for m in own if self.lacks(peer, m)]
            if ph == height and stalled:
                todo += [("relay", m) for m in relay if self.lacks(peer, m)]
                self.relays["stalled"] += 1
            elif ph == height and pr < round_:
                # behind in round and moving: the messages of rounds above its own (f+1 of
                # them take it to ours, L55; the rest let it act there). Those of its own
                # round or below it most likely has, from their signers (a slow peer, not a
                # lossy one: 16 validators under load relayed them as duplicates); it gets
                # them too once it stalls
                todo += [("relay", m) for m in relay if m.round > pr and self.lacks(peer, m)]
                self.relays["behind"] += 1
            if commit is not None and ph == commit[0] and (
                    pr > commit[1] or self._lost_own(peer, commit[2])):
                todo += [("commit", m) for m in commit[2] if self.lacks(peer, m)]
            seen: set[Message] = set()
            for kind, m in todo:
                if m in seen:
                    continue
                seen.add(m)
                self._mark(peer, [m], kind)
                out.append((peer, m))
        return out

    def _time_height(self, height: int, now: float) -> None:
        """Sample how long our heights take (from one plan's height to the next)."""
        if height == self._height:
            return
        if self._height is not None and height == self._height + 1:
            took = now - self._height_at
            avg = self.height_seconds
            self.height_seconds = took if avg is None else 0.75 * avg + 0.25 * took
        self._height, self._height_at = height, now

    def stall_after(self) -> float:
        """Seconds a peer of our height may stay put before it counts as stalled (relayed
        what it lacks; twice that: what it has is guessed lost): ``relay_after``, or our own
        smoothed time per height when longer, at most :data:`MAX_STALL_WAIT_FACTOR` / 2 times
        ``relay_after``. A peer that has not moved for a whole height has lost something; one
        that has not moved for part of a height that takes the committee 0.8 s of CPU is only
        slow, and relaying it every vote it may lack doubled and tripled the frames at 16
        validators under load (issue 17: 1,408 and 1,779 frames per height, most of them
        relayed votes the receiver already had)."""
        cap = MAX_STALL_WAIT_FACTOR / 2 * self.relay_after
        return min(cap, max(self.relay_after, self.height_seconds or 0.0))

    def _lost_own(self, peer: bytes, messages: Sequence[Message]) -> bool:
        """Whether ``peer`` may lack one of *our own* ``messages`` (we sent it, then its link
        failed, or it re-sent its own or stalled, so what we sent it was forgotten)."""
        return any(signer(m) == self.address and self.lacks(peer, m) for m in messages)

    def _mark(self, peer: bytes, messages: Sequence[Message], kind: str) -> None:
        view = self.views[peer]
        for m in messages:
            view.add(m)
        self.planned[kind] += len(messages)
