"""Which consensus messages a validator sends again, and when (pure; no I/O, clock or randomness).

Why: Algorithm 1 of Buchman, Kwon, Milosevic (arXiv 1807.04938) assumes *gossip*: every message
a correct validator received is eventually received by every correct validator. What a driver
sends again decides whether that holds (issue 17, finding 2: re-sending only a validator's own
messages of its last two rounds lets an equivocator's vote reach one validator and never the
others). So the send policy is one small object that the simulator
(:mod:`ps_p2p.testing.consensus_sim`) and the service (:mod:`ps_p2p.protocols.consensus`) can
share, and a change of the service's policy is simulated before it runs.

Interface (:class:`GossipPolicy`), per validator:

* ``on_send(message, now) -> [(peer, message)]``: an own proposal or vote was signed (after
  the WAL write) and sent to every peer; returns what else to send now (a re-proposal's POL
  certificate);
* ``on_receive(message, sender, now) -> [(peer, message)]``: a peer's message passed its
  signature check and was handed to the core (``sender``: the address of the peer it came
  from, which may differ from the signer when relayed); returns what to send now;
* ``on_link_down(peer, now)``: frames to ``peer`` were lost (its link failed);
* ``on_decide(decision, now)``: the core decided (before the next height starts);
* ``tick(now, height, round_) -> [(peer or None, message)]``: what to send now (``None``: every
  other validator); ``height``/``round_`` are the core's current ones; called at least at
  ``next_tick()``;
* ``next_tick() -> float``: when ``tick`` is next due (``now`` seconds).

Where the service plugs it in: :class:`~ps_p2p.protocols.consensus.ConsensusService` holds a
:class:`ServiceGossip` (``policy``; ``policy.gossip`` is its
:class:`~ps_p2p.consensus.gossip.Gossip`): ``_send_own`` calls ``on_send`` (and sends the own
message to the peers that lacked it), the verified-frame path ``on_receive``, the link
manager's ``on_link_down`` ``Gossip.link_down``, and ``_gossip`` (every
``rebroadcast_interval``) :meth:`ServiceGossip.plan`, with the validator's own messages and last
commit. The simulator runs the same class per validator (``SimParams.gossip = "service"``), so
the two cannot drift.

Policies here:

* :class:`ServiceGossip` — the service's gossip: the same
  :class:`~ps_p2p.consensus.gossip.Gossip` object :class:`~ps_p2p.protocols.consensus.
  ConsensusService` runs, fed the same inputs and the same relay set / POL certificate / last
  commit (:func:`~ps_p2p.consensus.gossip.relay_set`, :func:`~ps_p2p.consensus.gossip.
  pol_certificate`, :func:`~ps_p2p.consensus.gossip.commit_of`, which the service's validator
  calls too), so the simulator and the service cannot drift;
* :class:`OwnRecentRoundsBefore` — the service's behaviour *before* issue 17 (kept as the
  "before" model): every ``interval`` seconds, the own messages of the current height in the
  last two rounds, to everyone;
* :class:`RelayAll` — the simulator's idealised gossip: from its first tick, whenever the
  height did not change since the last tick, every message heard at the current height (own
  and relayed), to everyone.

Bounds: :class:`ServiceGossip` has :class:`~ps_p2p.consensus.gossip.Gossip`'s bounds plus its
own messages of the current height; the other two keep messages of the current height only
(older heights are dropped at the first tick after the height moves); :class:`RelayAll` holds
what the core accepted, so it is bounded by the core's own bounds
(:mod:`ps_p2p.consensus.votes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ps_p2p.consensus.gossip import (
    Gossip,
    commit_of,
    pol_certificate,
    proposals_against,
    relay_set,
)
from ps_p2p.consensus.types import Decide, Proposal, Vote, VoteType

if TYPE_CHECKING:
    from ps_p2p.consensus.core import ConsensusCore

__all__ = ["GossipPolicy", "Message", "OwnRecentRoundsBefore", "RelayAll", "Send",
           "ServiceGossip"]

Message = Proposal | Vote
#: (peer address or None for every other validator, message)
Send = tuple[bytes | None, Message]


class GossipPolicy(Protocol):
    """A validator's re-send policy (see the module docstring)."""

    def on_send(self, message: Message, now: float) -> list[Send]: ...

    def on_receive(self, message: Message, sender: bytes, now: float) -> list[Send]: ...

    def on_link_down(self, peer: bytes, now: float) -> None: ...

    def on_decide(self, decision: Decide, now: float) -> None: ...

    def tick(self, now: float, height: int | None, round_: int) -> list[Send]: ...

    def next_tick(self) -> float: ...


class _Quiet:
    """No-op hooks of the policies that react to nothing but ticks."""

    def on_link_down(self, peer: bytes, now: float) -> None:
        return None

    def on_decide(self, decision: Decide, now: float) -> None:
        return None


class OwnRecentRoundsBefore(_Quiet):
    """The service's policy before issue 17 (the "before" model): every ``interval`` seconds,
    the own messages of the current height whose round is at least ``round_ - rounds + 1``
    (``rounds`` = 2), to everyone.

    Args:
        interval: seconds between re-sends (the service's ``rebroadcast_interval``, default the
            core's ``timeout_prevote``).
        start: the first re-send time.
        rounds: how many of the latest rounds are re-sent.
    """

    def __init__(self, interval: float, start: float = 0.0, rounds: int = 2) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.interval = interval
        self.rounds = rounds
        self._next = start
        self._own: dict[int, list[Message]] = {}

    def on_send(self, message: Message, now: float) -> list[Send]:
        mine = self._own.setdefault(message.height, [])
        if message not in mine:
            mine.append(message)
        return []

    def on_receive(self, message: Message, sender: bytes, now: float) -> list[Send]:
        return []  # nothing relayed

    def tick(self, now: float, height: int | None, round_: int) -> list[Send]:
        if now < self._next:
            return []
        self._next = now + self.interval
        if height is None:
            return []
        for h in [h for h in self._own if h < height]:
            del self._own[h]
        low = round_ - self.rounds + 1
        return [(None, m) for m in self._own.get(height, ()) if m.round >= low]

    def next_tick(self) -> float:
        return self._next


class RelayAll(_Quiet):
    """Idealised gossip: every ``interval`` seconds from ``start``, if the height did not
    change since the previous tick (or at the first tick), every message heard at the current
    height (own ones and peers'), in arrival order, to everyone.

    Args:
        interval: seconds between ticks.
        start: the first tick (the simulator uses GST).
    """

    def __init__(self, interval: float, start: float = 0.0) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.interval = interval
        self._next = start
        self._heard: dict[int, dict[Message, None]] = {}
        self._ticked = False
        self._tick_height: int | None = None

    def on_send(self, message: Message, now: float) -> list[Send]:
        self._heard.setdefault(message.height, {})[message] = None
        return []

    def on_receive(self, message: Message, sender: bytes, now: float) -> list[Send]:
        self._heard.setdefault(message.height, {})[message] = None
        return []

    def tick(self, now: float, height: int | None, round_: int) -> list[Send]:
        if now < self._next:
            return []
        self._next = now + self.interval
        out: list[Send] = []
        if height is not None and (not self._ticked or height == self._tick_height):
            out = [(None, m) for m in self._heard.get(height, ())]
        for h in [h for h in self._heard if height is not None and h < height]:
            del self._heard[h]
        self._ticked = True
        self._tick_height = height
        return out

    def next_tick(self) -> float:
        return self._next


class ServiceGossip:
    """The service's gossip (:mod:`ps_p2p.consensus.gossip`) as a policy: one
    :class:`~ps_p2p.consensus.gossip.Gossip` fed what
    :class:`~ps_p2p.protocols.consensus.ConsensusService` feeds it, where it feeds it:

    * ``on_send`` = ``_send_own``: the own message is marked sent to every peer; a proposal
      with a POL round goes with its POL certificate to each peer that lacks it (L28);
    * ``on_receive`` = the verified-frame path: ``Gossip.heard`` (messages of the core's
      height or the one below), and for a prevote of its own signer at the core's height,
      ``_resend_pol`` (the re-proposals it votes against and their certificates, once);
    * ``on_link_down`` = the link manager's ``on_link_down``: ``Gossip.link_down``;
    * ``on_decide`` = the validator's ``last_commit``; ``tick`` = ``_gossip`` every
      ``interval`` (the service's ``rebroadcast_interval``), with ``Gossip.new_height`` when
      the height moved (the service's ``Committed``), the own messages of the last two rounds
      (``Validator.own_messages``) and :func:`~ps_p2p.consensus.gossip.relay_set` of the core.

    The service holds one too (``ConsensusService.policy``; ``.gossip`` is its ``Gossip``), with
    ``own`` and ``commit`` read from its validator, and calls :meth:`plan` on its own schedule.

    Args:
        address: this validator's address; ``peers``: every validator's (own one skipped).
        core: returns the validator's current core (read at each call, never kept).
        interval: seconds between plans; ``start``: the first plan's time.
        relay_after: ``Gossip``'s; default ``2 * interval`` (the service's default).
        own: returns the own signed messages of the current height in its last two rounds
            (the service: ``Validator.own_messages``); None: those recorded by ``on_send``.
        commit: returns the last decision's (height, round, messages) (the service:
            ``Validator.last_commit``); None: the one recorded by ``on_decide``.
    """

    def __init__(self, address: bytes, peers: Sequence[bytes],
                 core: Callable[[], ConsensusCore], interval: float, start: float = 0.0,
                 relay_after: float | None = None,
                 own: Callable[[], Sequence[Message]] | None = None,
                 commit: Callable[[], tuple[int, int, tuple[Message, ...]] | None] | None = None,
                 ) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.gossip = Gossip(address, peers, relay_after=relay_after or 2 * interval)
        self.interval = interval
        self._core = core
        self._own_of = own
        self._commit_of = commit
        self._next = start
        self._own: dict[int, list[Message]] = {}
        self._height: int | None = None
        self._commit: tuple[int, int, tuple[Message, ...]] | None = None

    def on_send(self, message: Message, now: float = 0.0) -> list[Send]:
        """Own ``message`` goes to every peer that lacks it (the caller sends it: marked sent
        here); returns its POL certificate for each peer that lacks it (marked sent).
        ``now`` is not used (the service calls this without a clock)."""
        if self._own_of is None:
            mine = self._own.setdefault(message.height, [])
            if message not in mine:
                mine.append(message)
        out: list[Send] = []
        for peer in self.gossip.views:
            if self.gossip.lacks(peer, message):
                self.gossip.sent(peer, message)
        if isinstance(message, Proposal) and message.pol_round >= 0:
            certificate = pol_certificate(self._core(), message)
            for peer in self.gossip.views:
                out += [(peer, v) for v in self.gossip.certificate_for(peer, certificate)]
        return out

    def on_receive(self, message: Message, sender: bytes, now: float) -> list[Send]:
        core = self._core()
        height = core.height
        if height is not None and message.height < height - 1:
            return []
        self.gossip.heard(sender, message, now)
        out: list[Send] = []
        if (isinstance(message, Vote) and message.type == VoteType.PREVOTE
                and message.validator == sender and message.height == height):
            for p, certificate in proposals_against(core, message):
                out += [(sender, m) for m in self.gossip.resend(
                    sender, (p.height, p.round), (p, *certificate))]
        return out

    def on_link_down(self, peer: bytes, now: float) -> None:
        self.gossip.link_down(peer)

    def on_decide(self, decision: Decide, now: float) -> None:
        commit = commit_of(self._core(), decision)
        if commit is not None:
            self._commit = commit

    def tick(self, now: float, height: int | None, round_: int) -> list[Send]:
        if now < self._next:
            return []
        self._next = now + self.interval
        return self.plan(now, height, round_)

    def plan(self, now: float, height: int | None, round_: int) -> list[Send]:
        """What each peer lacks now (:meth:`~ps_p2p.consensus.gossip.Gossip.plan`), whatever
        the interval (the service's ``_gossip`` calls this on its own schedule)."""
        if height is None:
            return []
        if height != self._height:
            self._height = height
            self.gossip.new_height(height)
            for h in [h for h in self._own if h < height]:
                del self._own[h]
        if self._own_of is not None:
            own: Sequence[Message] = self._own_of()
        else:
            own = [m for m in self._own.get(height, ()) if m.round >= round_ - 1]
        commit = self._commit_of() if self._commit_of is not None else self._commit
        plan = self.gossip.plan(now, height=height, round_=round_, own=own,
                                relay=relay_set(self._core()), commit=commit)
        return list(plan)

    def next_tick(self) -> float:
        return self._next

