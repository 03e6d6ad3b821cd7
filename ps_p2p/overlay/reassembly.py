"""Clove reassembly: S-IDA cloves in, whole messages out (pure core, sans-I/O).

Source: PlanetServe sec. 3.2 (a model node rebuilds Q from any k request cloves; a user rebuilds the
response from any k response cloves); Krawczyk, "Secret sharing made short" (CRYPTO '93).

The assembler owns no clock: every call takes ``now`` (seconds, any monotonic clock, e.g. trio's).
Its caller calls :meth:`CloveAssembler.expire` from time to time (a timer tick) to drop sets that
never completed.

Cloves of one message ID are buffered per header group, i.e. per (total, threshold) pair, and each
group is decoded on its own. The AEAD binds n and k (see :mod:`ps_p2p.crypto.sida`), so a clove
whose header a relay forged can never decode with honest cloves; keeping it apart, instead of
letting the first clove fix the header, means one bad relay whose clove arrives first cannot make
the assembler reject every honest clove (S-IDA with n > k tolerates one bad relay; DESIGN.md
"S-IDA").
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from ps_p2p.crypto import sida
from ps_p2p.crypto.sida import Clove
from ps_p2p.errors import ConfigError, DecodeError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_GROUPS",
    "CloveAssembler",
    "Event",
    "MessageReassembled",
    "ReassemblyFailed",
]

DEFAULT_MAX_ATTEMPTS = 64
"""Decode attempts (k-subsets tried) per message, over all its header groups, before it is given up.

With n = 4, k = 3 at most C(4, 3) = 4 subsets exist; with one tampered clove and any n, k <= 16 at
most 1 + k are needed. The bound stops a sender of garbage with n = 16, k = 8 from making a node try
C(16, 8) = 12,870 subsets of a 4 MiB message.
"""

DEFAULT_MAX_DECODE_BYTES = 32 * 1024 * 1024
"""Fragment bytes fed to decode attempts per message, over all its groups, before it is given up.

Decoding costs about its input size (a 16-of-12 group of a 4 MiB message: ~230 ms a subset on
this machine), so a count of attempts alone let one garbage group hold the event loop for
seconds; with this budget a 4 MiB message gets about 8 attempts, a 30 KB prompt (n = 4, k = 3)
thousands (its 4 subsets are never short of budget).
"""

DEFAULT_MAX_GROUPS = 4
"""Header groups, i.e. distinct (total, threshold) pairs, buffered per message ID.

One honest group plus room for a few forged headers; with at most 16 cloves a group, a message ID
holds at most 64 cloves.
"""

_Header = tuple[int, int]  # (total, threshold), i.e. (n, k)


@dataclass(frozen=True)
class MessageReassembled:
    """A message decoded from ``threshold`` cloves; emitted at most once per message ID.

    ``total`` and ``threshold`` are the header (n, k) of the group that decoded: the k the sender
    used (the AEAD binds them, so they are authentic whenever the payload is).
    """

    message_id: bytes
    payload: bytes
    total: int
    threshold: int


@dataclass(frozen=True)
class ReassemblyFailed:
    """A message given up: no k-subset of any header group decodes, or it was evicted."""

    message_id: bytes
    reason: str


Event = MessageReassembled | ReassemblyFailed


@dataclass
class _Group:
    """Cloves buffered for one (total, threshold) header of one message ID."""

    cloves: dict[int, Clove] = field(default_factory=dict)  # index -> first clove of that index
    exhausted: bool = False  # all ``total`` indices arrived, no k-subset decoded; cloves dropped


@dataclass
class _Pending:
    """Cloves buffered for one message ID, by header group."""

    first_seen: float
    first_header: _Header
    groups: dict[_Header, _Group] = field(default_factory=dict)  # in order of first clove
    attempts: int = 0  # k-subsets tried, over all groups
    decoded_bytes: int = 0  # fragment bytes fed to those attempts
    size: int = 0  # fragment and key share bytes buffered, over all groups


class CloveAssembler:
    """Reassembles S-IDA messages from cloves (sans-I/O).

    Contract (like CometBFT's ``VoteSet.AddVote``):

    * a clove that fails :meth:`~ps_p2p.crypto.sida.Clove.check` raises
      :class:`RemoteProtocolError` and changes nothing;
    * cloves are buffered per header group (message ID, total, threshold); a clove whose
      total/threshold disagree with the first clove of its message ID is counted in
      :attr:`conflicts` and buffered in its own group; a clove that would open more than
      ``max_groups`` groups for its message ID is dropped (counted in :attr:`overflows`);
    * a second clove with an index already buffered in its group is dropped (counted in
      :attr:`duplicates`), even if its bytes differ;
    * each new index, once ``threshold`` indices are buffered in its group, triggers decoding of
      the group's k-subsets that contain it (older subsets were tried already); a subset whose
      fragment lengths disagree counts as not decoding; a group with all ``total`` indices and no
      decodable subset is exhausted;
    * a message is reported once: :class:`MessageReassembled` on success in any group (its ID is
      then remembered for ``ttl`` seconds and later cloves of it, of any group, are ignored), or
      :class:`ReassemblyFailed` when every group of it is exhausted, or ``max_attempts`` subsets
      were tried over all its groups, without success (then the message is forgotten).

    Source: PlanetServe sec. 3.2; Krawczyk, "Secret sharing made short" (CRYPTO '93).

    Args:
        ttl: seconds an incomplete message waits for cloves (from its first clove, of any group),
            and a completed message ID is remembered.
        max_messages: incomplete messages held at most; the oldest is evicted beyond that (with a
            :class:`ReassemblyFailed` event). The completed IDs remembered are bounded alike.
        max_attempts: k-subsets tried per message, over all its groups, before giving up (see
            DEFAULT_MAX_ATTEMPTS).
        max_decode_bytes: fragment bytes fed to those attempts before giving up (see
            DEFAULT_MAX_DECODE_BYTES).
        max_groups: header groups buffered per message ID (see DEFAULT_MAX_GROUPS).
        max_bytes: fragment and key share bytes buffered at most, over all incomplete messages;
            beyond it the oldest incomplete messages are evicted (with :class:`ReassemblyFailed`)
            until the new clove fits. None: no byte bound beyond ``max_messages``.

    Attributes:
        duplicates: cloves dropped because their index was already buffered in their group.
        ignored: cloves dropped because their message was already reassembled.
        conflicts: cloves whose total/threshold disagree with the first clove of their message ID
            (buffered in a group of their own, or counted in ``overflows`` too).
        overflows: cloves dropped because their message ID already had ``max_groups`` groups.
    """

    def __init__(
        self,
        ttl: float = 60.0,
        max_messages: int = 10_000,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
        max_groups: int = DEFAULT_MAX_GROUPS,
        max_bytes: int | None = None,
    ) -> None:
        if ttl <= 0:
            raise ConfigError(f"ttl must be positive, got {ttl}")
        if max_messages < 1:
            raise ConfigError(f"max_messages must be >= 1, got {max_messages}")
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
        if max_groups < 1:
            raise ConfigError(f"max_groups must be >= 1, got {max_groups}")
        self.ttl = ttl
        self.max_messages = max_messages
        self.max_attempts = max_attempts
        self.max_decode_bytes = max_decode_bytes
        self.max_groups = max_groups
        self.max_bytes = max_bytes
        self._bytes = 0
        self.duplicates = 0
        self.ignored = 0
        self.conflicts = 0
        self.overflows = 0
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()  # in order of first clove
        self._completed: OrderedDict[bytes, float] = OrderedDict()  # message ID -> time decoded

    @property
    def pending(self) -> int:
        """Number of incomplete messages buffered."""
        return len(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def buffered_bytes(self) -> int:
        """Fragment and key share bytes buffered for incomplete messages."""
        return self._bytes

    def _forget(self, message_id: bytes) -> None:
        entry = self._pending.pop(message_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def is_completed(self, message_id: bytes) -> bool:
        """Whether ``message_id`` was reassembled and not yet forgotten by :meth:`expire`."""
        return message_id in self._completed

    def receive_clove(self, clove: Clove, now: float) -> list[Event]:
        """Buffer one clove in its header group; emit the message once a group decodes.

        Args:
            clove: ``index`` in [0, total); fragment at most sida.MAX_FRAGMENT_BYTES.
            now: seconds (monotonic); an incomplete set expires ``ttl`` s after its first clove.

        Returns:
            ``[]``, ``[MessageReassembled(message_id, payload, total, threshold)]`` (at most once
            per message ID), or ``[ReassemblyFailed(message_id, reason)]`` for this message (every
            group exhausted, or the attempt budget spent) or for the oldest pending message when
            this clove's new message evicted it.

        Raises:
            RemoteProtocolError: the clove fails ``Clove.check`` (index out of range, bad sizes).
                A total/threshold that disagree with earlier cloves do not raise (see
                :attr:`conflicts`).
        """
        clove.check()
        message_id = clove.message_id
        if message_id in self._completed:
            self.ignored += 1
            return []
        events: list[Event] = []
        header = (clove.total, clove.threshold)
        entry = self._pending.get(message_id)
        if entry is None:
            if len(self._pending) >= self.max_messages:
                evicted = next(iter(self._pending))
                self._forget(evicted)
                events.append(
                    ReassemblyFailed(evicted, f"evicted: over {self.max_messages} pending messages")
                )
            entry = self._pending[message_id] = _Pending(now, header)
        elif header != entry.first_header:
            self.conflicts += 1
        group = entry.groups.get(header)
        if group is None:
            if len(entry.groups) >= self.max_groups:
                self.overflows += 1
                return events
            group = entry.groups[header] = _Group()
        if group.exhausted or clove.index in group.cloves:
            self.duplicates += 1  # an exhausted group holds every index of [0, total)
            return events
        size = len(clove.fragment) + len(clove.key_share)
        if self.max_bytes is not None:
            while self._bytes + size > self.max_bytes:
                oldest = next((m for m in self._pending if m != message_id), None)
                if oldest is None:
                    break
                self._forget(oldest)
                events.append(
                    ReassemblyFailed(oldest, f"evicted: over {self.max_bytes} bytes buffered")
                )
        group.cloves[clove.index] = clove
        entry.size += size
        self._bytes += size
        total, k = header
        if len(group.cloves) < k:
            return events

        others = [group.cloves[i] for i in sorted(group.cloves) if i != clove.index]
        for rest in itertools.combinations(others, k - 1):
            if entry.attempts >= self.max_attempts or entry.decoded_bytes >= self.max_decode_bytes:
                break
            entry.attempts += 1
            entry.decoded_bytes += len(clove.fragment) * k
            try:
                payload = sida.decode_subset((*rest, clove))
            except (DecodeError, RemoteProtocolError):
                continue  # tampered clove, or fragment lengths disagree: try the next subset
            self._forget(message_id)
            self._remember_completed(message_id, now)
            events.append(MessageReassembled(message_id, payload, total, k))
            return events

        if entry.attempts >= self.max_attempts or entry.decoded_bytes >= self.max_decode_bytes:
            reason = (
                f"no subset of any header group decoded within {entry.attempts} attempts "
                f"({entry.decoded_bytes} bytes)"
            )
        elif len(group.cloves) == total:
            group.exhausted = True
            freed = sum(len(c.fragment) + len(c.key_share) for c in group.cloves.values())
            entry.size -= freed
            self._bytes -= freed
            group.cloves.clear()
            if not all(g.exhausted for g in entry.groups.values()):
                return events
            reason = "; ".join(
                f"all {n} cloves of {t}-of-{n} arrived but no {t}-subset decodes"
                for n, t in entry.groups
            )
        else:
            return events
        self._forget(message_id)
        events.append(ReassemblyFailed(message_id, reason))
        return events

    def next_expiry(self) -> float | None:
        """When :meth:`expire` next has work (the oldest incomplete message or completed ID
        reaches ``ttl``), or None; O(1)."""
        times = []
        if self._pending:
            times.append(next(iter(self._pending.values())).first_seen + self.ttl)
        if self._completed:
            times.append(next(iter(self._completed.values())) + self.ttl)
        return min(times) if times else None

    def expire(self, now: float) -> list[bytes]:
        """Drop incomplete messages whose first clove is ``ttl`` or more seconds old.

        Also forgets completed message IDs reassembled ``ttl`` or more seconds ago (their late
        cloves then start a new, never-completing set that expires in turn).

        Args:
            now: seconds, the same clock as :meth:`receive_clove`'s ``now``.

        Returns:
            The message IDs of the dropped incomplete messages (all their groups), oldest first.
        """
        expired = []
        while self._pending:
            message_id, entry = next(iter(self._pending.items()))
            if now - entry.first_seen < self.ttl:
                break
            self._forget(message_id)
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
