"""The verifiers' registry of node records: the server side of the directory, pure.

A verifier keeps the node records nodes register with it (the application state of the
committee, PlanetServe sec. 3.4) in a :class:`Registry`: at most one published record per peer ID
(:data:`~ps_p2p.records.limits.MAX_RECORDS` by default), each checked by
:func:`~ps_p2p.records.validation.check_record` on the way in. Every added, changed or removed
record takes the next *height*; the set's root (:mod:`ps_p2p.records.recordset`) is kept
incrementally, and the changes since any recent height are served as a delta (what
``/planetserve/directory/1.0.0`` pages out, see :mod:`ps_p2p.protocols.directory`).

Liveness is the verifiers' business, content the node's: a renewal that only moves a record's
issue and expiry times forward keeps the *published* record (same leaf, same height) and only
extends how long the registry keeps it; so a directory lists records whose own ``expires_at_ms``
may have passed while their node keeps renewing, and clients trust a record for as long as the
head that lists it is valid. A published record is replaced by its newest renewal once it is
:data:`~ps_p2p.records.limits.REPUBLISH_AFTER_MS` (12 h) old, so no listed record is much older
than that. Times are unix milliseconds passed in as ``now_ms``: no clock, no I/O.
"""

from __future__ import annotations

import bisect
import collections
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.records.limits import MAX_RECORDS, REPUBLISH_AFTER_MS
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.recordset import RecordSet, record_leaf
from ps_p2p.records.types import NodeRecord
from ps_p2p.records.validation import check_record


@dataclass
class _Entry:
    record: NodeRecord  # the published record (what the directory lists)
    leaf: bytes
    version: int  # the height at which it was published
    live_until_ms: int  # expiry of the newest record the node sent (a renewal moves it)
    latest_issued_ms: int
    latest_leaf: bytes


class Registry:
    """The node records a verifier keeps (the application state of the committee, sec. 3.4).

    Pure: no clock, no I/O. At most one published record per peer ID. A renewal (a newer
    record with the same :meth:`NodeRecord.content`) only extends how long the peer stays
    listed; a content change, an addition or a removal publishes a new version (height + 1).
    Expiry is indexed by a heap (O(expired) per call, never a scan of every record); the root of
    the set is kept incrementally (:class:`RecordSet`); the changes since any recent height are
    found by bisection in a log ordered by version (O(changes)).

    Attributes:
        height: the version of the newest change; each added, changed or removed record takes
            the next height, so versions are unique.
        floor: deltas from a height below it cannot be served (their removals were forgotten):
            :meth:`changes_since` then answers with a reset.
        max_records: bound on distinct peers (expired records are dropped before refusing).
        max_tombstones: removals remembered for deltas (oldest forgotten first).
    """

    def __init__(
        self, *, max_records: int = MAX_RECORDS, max_tombstones: int | None = None
    ) -> None:
        self.max_records = max_records
        self.max_tombstones = max_records if max_tombstones is None else max_tombstones
        self.height = 0
        self.floor = 0
        self._set = RecordSet()
        self._entries: dict[bytes, _Entry] = {}
        self._tombstones: dict[bytes, int] = {}
        self._tomb_order: collections.deque[tuple[int, bytes]] = collections.deque()
        self._log: list[tuple[int, bytes]] = []  # (version, peer ID), ascending version
        self._expiry: list[tuple[int, bytes]] = []  # heap of (live_until_ms, peer ID), lazy

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, record: NodeRecord, now_ms: int) -> int:
        """Check ``record`` and publish it, or take it as a renewal of the published one.

        A newer record with the same content as the published one (only its times differ)
        is a renewal: the peer stays listed until the renewal's ``expires_at_ms`` and the height
        does not move, unless the published record is :data:`REPUBLISH_AFTER_MS` older than
        the renewal, which is then published. Registering a record already taken changes
        nothing.

        Returns:
            the record's ``expires_at_ms`` (until when the peer stays listed).

        Raises:
            RemoteProtocolError: bad fields (:func:`check_record`), a record older than the
                newest one taken from that peer, a different record with the same
                ``issued_at_ms``, or "registry full".
            InvalidSignatureError: bad signature.
            ExpiredError: already expired at ``now_ms``.
        """
        check_record(record, now_ms)
        leaf = record_leaf(record)
        peer = record.peer_id
        held = self._entries.get(peer)
        if held is not None:
            if leaf == held.latest_leaf or leaf == held.leaf:
                return record.expires_at_ms
            if record.issued_at_ms < held.latest_issued_ms:
                raise RemoteProtocolError(
                    f"record of {peer_label(peer)} issued at {record.issued_at_ms} is older "
                    f"than the one held (issued at {held.latest_issued_ms})"
                )
            if record.issued_at_ms == held.latest_issued_ms:
                raise RemoteProtocolError(
                    f"a different record of {peer_label(peer)} with the same issue time "
                    "is already held"
                )
            held.latest_issued_ms = record.issued_at_ms
            held.latest_leaf = leaf
            if (
                record.content() == held.record.content()
                and record.issued_at_ms - held.record.issued_at_ms < REPUBLISH_AFTER_MS
            ):
                self._set_live_until(held, record.expires_at_ms)
                return record.expires_at_ms
        elif len(self._entries) >= self.max_records:
            self.expire(now_ms)
            if len(self._entries) >= self.max_records:
                raise RemoteProtocolError(f"registry full ({self.max_records} records)")
        self._publish(record, leaf)
        return record.expires_at_ms

    def expire(self, now_ms: int) -> int:
        """Drop the peers whose newest record expired at ``now_ms``; returns how many.

        O(expired + stale heap entries), amortized O(expired).
        """
        dropped = 0
        heap = self._expiry
        while heap and heap[0][0] <= now_ms:
            until, peer = heapq.heappop(heap)
            entry = self._entries.get(peer)
            if entry is None or entry.live_until_ms != until:
                continue  # renewed or removed since: a stale heap entry
            self._remove(peer)
            dropped += 1
        return dropped

    def records(self, now_ms: int) -> tuple[NodeRecord, ...]:
        """The live records at ``now_ms`` (expired ones are dropped first), sorted by peer ID.

        O(n) after a change (cached until the next one); prefer :meth:`changes_since`.
        """
        self.expire(now_ms)
        return self._set.records()

    def root(self) -> bytes:
        """:func:`record_set_root` of the published records (O(changed buckets))."""
        return self._set.root()

    def get(self, peer_id: bytes) -> NodeRecord | None:
        """The published record of ``peer_id`` (possibly past its own expiry), or None."""
        entry = self._entries.get(peer_id)
        return entry.record if entry is not None else None

    def live_until(self, peer_id: bytes) -> int | None:
        """Until when ``peer_id`` stays listed (unix ms), or None."""
        entry = self._entries.get(peer_id)
        return entry.live_until_ms if entry is not None else None

    def changes_since(
        self, since: int
    ) -> tuple[bool, Iterator[tuple[int, bytes, NodeRecord | None]]]:
        """What changed after height ``since``, oldest change first.

        Returns:
            ``(reset, changes)``: ``changes`` yields ``(version, peer ID, record)`` for each
            peer whose newest change is after ``since``, ``record`` None for a removal. With
            ``reset`` (``since`` is 0, above :attr:`height` or below :attr:`floor`) it yields
            every published record and no removals: the client starts from an empty set. The
            iterator reads the live registry: consume it before the next change.
        """
        reset = since <= 0 or since > self.height or since < self.floor
        start = 0 if reset else bisect.bisect_right(self._log, since, key=lambda e: e[0])
        return reset, self._iter_log(start, reset)

    def _iter_log(self, start: int, reset: bool) -> Iterator[tuple[int, bytes, NodeRecord | None]]:
        log = self._log
        for i in range(start, len(log)):
            version, peer = log[i]
            entry = self._entries.get(peer)
            if entry is not None:
                if entry.version == version:
                    yield version, peer, entry.record
            elif not reset and self._tombstones.get(peer) == version:
                yield version, peer, None

    # ---- internals

    def _set_live_until(self, entry: _Entry, until: int) -> None:
        entry.live_until_ms = until
        heapq.heappush(self._expiry, (until, entry.record.peer_id))
        if len(self._expiry) > 2 * len(self._entries) + 64:
            self._expiry = [(e.live_until_ms, p) for p, e in self._entries.items()]
            heapq.heapify(self._expiry)

    def _publish(self, record: NodeRecord, leaf: bytes) -> None:
        self.height += 1
        peer = record.peer_id
        self._set.put(record, leaf)
        self._tombstones.pop(peer, None)
        entry = _Entry(record, leaf, self.height, 0, record.issued_at_ms, leaf)
        self._entries[peer] = entry
        self._set_live_until(entry, record.expires_at_ms)
        self._append_log(peer)

    def _remove(self, peer: bytes) -> None:
        self.height += 1
        self._set.remove(peer)
        del self._entries[peer]
        self._tombstones[peer] = self.height
        self._tomb_order.append((self.height, peer))
        while len(self._tombstones) > self.max_tombstones:
            version, old = self._tomb_order.popleft()
            if self._tombstones.get(old) == version:
                del self._tombstones[old]
                self.floor = max(self.floor, version)
        self._append_log(peer)

    def _append_log(self, peer: bytes) -> None:
        self._log.append((self.height, peer))
        live = len(self._entries) + len(self._tombstones)
        if len(self._log) > 2 * live + 64:  # amortized O(1) a change
            self._log = sorted(
                [(e.version, p) for p, e in self._entries.items()]
                + [(v, p) for p, v in self._tombstones.items()]
            )
        if len(self._tomb_order) > 2 * len(self._tombstones) + 64:
            self._tomb_order = collections.deque(
                sorted((v, p) for p, v in self._tombstones.items())
            )


__all__ = ["Registry"]
