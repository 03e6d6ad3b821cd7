"""Clove reassembly: S-IDA cloves in, whole messages out (pure core, sans-I/O).

Source: PlanetServe sec. 3.2 (a model node rebuilds Q from any k request cloves; a user rebuilds the
response from any k response cloves); Krawczyk, "Secret sharing made short" (CRYPTO '93).

The assembler owns no clock: every call takes ``now`` (seconds, any monotonic clock, e.g. trio's).
Its caller calls :meth:`CloveAssembler.expire` from time to time (a timer tick) to drop sets that
never completed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from ps_p2p.crypto import sida
from ps_p2p.crypto.sida import Clove
from ps_p2p.errors import DecodeError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "CloveAssembler",
    "Event",
    "MessageReassembled",
    "ReassemblyFailed",
]

DEFAULT_MAX_ATTEMPTS = 64
"""Decode attempts (k-subsets tried) per message before it is given up.

With n = 4, k = 3 at most C(4, 3) = 4 subsets exist; with one tampered clove and any n, k <= 16 at
most 1 + k are needed. The bound stops a sender of garbage with n = 16, k = 8 from making a node try
C(16, 8) = 12,870 subsets of a 4 MiB message.
"""


@dataclass(frozen=True)
class MessageReassembled:
    """A message decoded from ``threshold`` cloves; emitted at most once per message ID."""

    message_id: bytes
    payload: bytes


@dataclass(frozen=True)
class ReassemblyFailed:
    """A message given up: no k-subset decodes, or it was evicted (too many pending messages)."""

    message_id: bytes
    reason: str


Event = MessageReassembled | ReassemblyFailed


@dataclass
class _Pending:
    """Cloves buffered for one message ID."""

    first_seen: float
    total: int
    threshold: int
    cloves: dict[int, Clove] = field(default_factory=dict)  # index -> first clove of that index
    attempts: int = 0


class CloveAssembler:
    """Reassembles S-IDA messages from cloves (sans-I/O).

    Contract (like CometBFT's ``VoteSet.AddVote``):

    * a clove that fails :meth:`~ps_p2p.crypto.sida.Clove.check`, or whose total/threshold disagree
      with the first clove buffered for its message ID, raises :class:`RemoteProtocolError` and
      changes nothing;
    * a second clove with an index already buffered is dropped (counted in :attr:`duplicates`),
      even if its bytes differ;
    * each new index, once ``threshold`` indices are buffered, triggers decoding of the k-subsets
      that contain it (older subsets were tried already); a subset whose fragment lengths disagree
      counts as not decoding;
    * a message is reported once: :class:`MessageReassembled` on success (its ID is then remembered
      for ``ttl`` seconds and later cloves of it are ignored), or :class:`ReassemblyFailed` when all
      ``total`` indices arrived, or ``max_attempts`` subsets were tried, without success (then the
      message is forgotten).

    Source: PlanetServe sec. 3.2; Krawczyk, "Secret sharing made short" (CRYPTO '93).

    Args:
        ttl: seconds an incomplete message waits for cloves (from its first clove), and a completed
            message ID is remembered.
        max_messages: incomplete messages held at most; the oldest is evicted beyond that (with a
            :class:`ReassemblyFailed` event). The completed IDs remembered are bounded alike.
        max_attempts: k-subsets tried per message before giving up (see DEFAULT_MAX_ATTEMPTS).

    Attributes:
        duplicates: cloves dropped because their index was already buffered.
        ignored: cloves dropped because their message was already reassembled.
    """

    def __init__(
        self,
        ttl: float = 60.0,
        max_messages: int = 10_000,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.ttl = ttl
        self.max_messages = max_messages
        self.max_attempts = max_attempts
        self.duplicates = 0
        self.ignored = 0
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()  # in order of first clove
        self._completed: OrderedDict[bytes, float] = OrderedDict()  # message ID -> time decoded

    @property
    def pending(self) -> int:
        """Number of incomplete messages buffered."""
        return len(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def is_completed(self, message_id: bytes) -> bool:
        """Whether ``message_id`` was reassembled and not yet forgotten by :meth:`expire`."""
        return message_id in self._completed

    def receive_clove(self, clove: Clove, now: float) -> list[Event]:
        """Buffer one clove; emit the message once ``threshold`` valid cloves arrived.

        Args:
            clove: ``index`` in [0, total); fragment at most sida.MAX_FRAGMENT_BYTES.
            now: seconds (monotonic); an incomplete set expires ``ttl`` s after its first clove.

        Returns:
            ``[]``, ``[MessageReassembled(message_id, payload)]`` (at most once per message ID),
            or ``[ReassemblyFailed(message_id, reason)]`` for this message (all indices in, or the
            attempt budget spent) or for the oldest pending message when this clove's new message
            evicted it.

        Raises:
            RemoteProtocolError: the clove fails ``Clove.check`` (index out of range, bad sizes), or
                its total/threshold disagree with earlier cloves of the same message ID.
        """
        clove.check()
        message_id = clove.message_id
        if message_id in self._completed:
            self.ignored += 1
            return []
        events: list[Event] = []
        entry = self._pending.get(message_id)
        if entry is None:
            if len(self._pending) >= self.max_messages:
                evicted, _ = self._pending.popitem(last=False)
                events.append(
                    ReassemblyFailed(evicted, f"evicted: over {self.max_messages} pending messages")
                )
            entry = self._pending[message_id] = _Pending(now, clove.total, clove.threshold)
        elif clove.total != entry.total or clove.threshold != entry.threshold:
            raise RemoteProtocolError(
                f"clove of {message_id.hex()[:8]} says {clove.threshold}-of-{clove.total}, "
                f"earlier cloves said {entry.threshold}-of-{entry.total}"
            )
        if clove.index in entry.cloves:
            self.duplicates += 1
            return events
        entry.cloves[clove.index] = clove
        k = entry.threshold
        if len(entry.cloves) < k:
            return events

        others = [entry.cloves[i] for i in sorted(entry.cloves) if i != clove.index]
        for rest in itertools.combinations(others, k - 1):
            if entry.attempts >= self.max_attempts:
                break
            entry.attempts += 1
            try:
                payload = sida.decode_subset((*rest, clove))
            except (DecodeError, RemoteProtocolError):
                continue  # tampered clove, or fragment lengths disagree: try the next subset
            del self._pending[message_id]
            self._remember_completed(message_id, now)
            events.append(MessageReassembled(message_id, payload))
            return events

        if entry.attempts >= self.max_attempts:
            reason = f"no {k}-subset decoded within {self.max_attempts} attempts"
        elif len(entry.cloves) == entry.total:
            reason = f"all {entry.total} cloves arrived but no {k}-subset decodes"
        else:
            return events
        del self._pending[message_id]
        events.append(ReassemblyFailed(message_id, reason))
        return events

    def expire(self, now: float) -> list[bytes]:
        """Drop incomplete messages whose first clove is ``ttl`` or more seconds old.

        Also forgets completed message IDs reassembled ``ttl`` or more seconds ago (their late
        cloves then start a new, never-completing set that expires in turn).

        Args:
            now: seconds, the same clock as :meth:`receive_clove`'s ``now``.

        Returns:
            The message IDs of the dropped incomplete messages, oldest first.
        """
        expired = []
        while self._pending:
            message_id, entry = next(iter(self._pending.items()))
            if now - entry.first_seen < self.ttl:
                break
            del self._pending[message_id]
            expired.append(message_id)
        while self._completed:
            message_id, done_at = next(iter(self._completed.items()))
            if now - done_at < self.ttl:
                break
            del self._completed[message_id]
        return expired

    def _remember_completed(self, message_id: bytes, now: float) -> None:
        self._completed[message_id] = now
        while len(self._completed) > self.max_messages:
            self._completed.popitem(last=False)
