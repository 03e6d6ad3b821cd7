"""Which consensus messages a validator sends again, and when (pure; no I/O, clock or randomness).

Why: Algorithm 1 of Buchman, Kwon, Milosevic (arXiv 1807.04938) assumes *gossip*: every message
a correct validator received is eventually received by every correct validator. What a driver
sends again decides whether that holds (issue 17, finding 2: re-sending only a validator's own
messages of its last two rounds lets an equivocator's vote reach one validator and never the
others). So the send policy is one small object that the simulator
(:mod:`ps_p2p.testing.consensus_sim`) and the service (:mod:`ps_p2p.protocols.consensus`) can
share, and a change of the service's policy is simulated before it runs.

Interface (:class:`GossipPolicy`), per validator:

* ``on_send(message, now)``: an own proposal or vote was signed (after the WAL write) and sent;
* ``on_receive(message, sender, now)``: a peer's message passed its signature check and was
  handed to the core (``sender``: the address of the peer it came from, which may differ from
  the signer when relayed);
* ``tick(now, height, round_) -> [(peer or None, message)]``: what to send now (``None``: every
  other validator); ``height``/``round_`` are the core's current ones; called at least at
  ``next_tick()``;
* ``next_tick() -> float``: when ``tick`` is next due (``now`` seconds).

Where the service plugs it in: ``ConsensusService._tick`` today calls
``Validator.own_messages()`` every ``rebroadcast_interval``; with this interface it calls
``policy.tick(now, core.height, core.round)`` and sends each returned message, calls
``policy.on_send`` where a :class:`~ps_p2p.consensus.validator.SendMessage` is carried out and
``policy.on_receive`` where a verified frame is handed to the validator, and takes
``policy.next_tick()`` into ``_next_deadline``. The simulator runs the same policy object per
validator (``SimParams.gossip``).

Policies here:

* :class:`OwnRecentRounds` — the service's behaviour today (issue 17): every ``interval``
  seconds, the own messages of the current height in the last two rounds, to everyone;
* :class:`RelayAll` — the simulator's idealised gossip: from its first tick, whenever the
  height did not change since the last tick, every message heard at the current height (own
  and relayed), to everyone.

Bounds: both keep messages of the current height only (older heights are dropped at the first
tick after the height moves); :class:`RelayAll` holds what the core accepted, so it is bounded
by the core's own bounds (:mod:`ps_p2p.consensus.votes`).
"""

from __future__ import annotations

from typing import Protocol

from ps_p2p.consensus.types import Proposal, Vote

__all__ = ["GossipPolicy", "Message", "OwnRecentRounds", "RelayAll", "Send"]

Message = Proposal | Vote
#: (peer address or None for every other validator, message)
Send = tuple[bytes | None, Message]


class GossipPolicy(Protocol):
    """A validator's re-send policy (see the module docstring)."""

    def on_send(self, message: Message, now: float) -> None: ...

    def on_receive(self, message: Message, sender: bytes, now: float) -> None: ...

    def tick(self, now: float, height: int | None, round_: int) -> list[Send]: ...

    def next_tick(self) -> float: ...


class OwnRecentRounds:
    """Today's service policy: every ``interval`` seconds, the own messages of the current
    height whose round is at least ``round_ - rounds + 1`` (``rounds`` = 2), to everyone.

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

    def on_send(self, message: Message, now: float) -> None:
        mine = self._own.setdefault(message.height, [])
        if message not in mine:
            mine.append(message)

    def on_receive(self, message: Message, sender: bytes, now: float) -> None:
        return None  # nothing relayed

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


class RelayAll:
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

    def on_send(self, message: Message, now: float) -> None:
        self._heard.setdefault(message.height, {})[message] = None

    def on_receive(self, message: Message, sender: bytes, now: float) -> None:
        self._heard.setdefault(message.height, {})[message] = None

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
