"""A client's verified copy of a verifier's directory, brought up to date by deltas, pure.

The client side of the directory (PlanetServe sec. 3.4): a :class:`DirectoryReplica` asks one
verifier for what changed since the height it holds, takes the bounded pages
(:class:`~ps_p2p.records.types.DirectoryPage`) one by one in a :class:`ReplicaUpdate`, and adopts
the assembled set only when it has the record count and root (32 bytes,
:mod:`ps_p2p.records.recordset`) of the page's head and that head carries a quorum of trusted
verifier signatures (:func:`~ps_p2p.records.validation.verify_head`; Ed25519, RFC 8032). Each
distinct signed record is checked once (:class:`~ps_p2p.records.validation.VerifiedCache`); a
delta costs O(changes). Bounds: :data:`~ps_p2p.records.limits.MAX_RECORDS` records by default,
and at most twice that plus 4096 changes in one update. Times are unix milliseconds passed in
as ``now_ms``; the pages come from :mod:`ps_p2p.protocols.directory`, which does the I/O.
"""

from __future__ import annotations

from ps_p2p.errors import InvalidSignatureError, LocalProtocolError, RemoteProtocolError
from ps_p2p.records.limits import MAX_RECORDS
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.recordset import RecordSet
from ps_p2p.records.types import Directory, DirectoryHead, DirectoryPage, NodeRecord
from ps_p2p.records.validation import VerifiedCache, verify_head


class DirectoryReplica:
    """A client's verified copy of one verifier's directory, brought up to date by deltas.

    Pure: pages come in (:meth:`begin`, :meth:`ReplicaUpdate.receive`), a verified
    :class:`Directory` comes out (:meth:`ReplicaUpdate.commit`). Records are checked once per
    distinct signed record (:class:`VerifiedCache`); a delta costs O(changes), plus O(records)
    pointer copies to build the returned :class:`Directory` when something changed. Not
    thread-safe: one update at a time.

    Args:
        trusted_verifiers, quorum: as for :func:`verify_head`.
        max_records: most records a directory may have.
        cache: verified records (default: a new :class:`VerifiedCache`).

    Attributes:
        source: the verifier whose heights :attr:`head` counts (heights of different verifiers
            are unrelated until consensus lands).
        head, directory: the last verified ones (None before the first).
        last_changed: the records added or changed by the last commit (all after a reset).
        last_reset: whether the last commit started from an empty set.
    """

    def __init__(
        self,
        *,
        trusted_verifiers: frozenset[bytes],
        quorum: int,
        max_records: int = MAX_RECORDS,
        cache: VerifiedCache | None = None,
    ) -> None:
        if quorum < 1:
            raise LocalProtocolError(f"quorum must be >= 1, not {quorum}")
        self.trusted_verifiers = trusted_verifiers
        self.quorum = quorum
        self.max_records = max_records
        self.cache = cache if cache is not None else VerifiedCache()
        self.source: bytes | None = None
        self.head: DirectoryHead | None = None
        self.directory: Directory | None = None
        self.last_changed: tuple[NodeRecord, ...] = ()
        self.last_reset = False
        self._set = RecordSet()

    def since(self, source: bytes) -> int:
        """The height to ask ``source`` for changes since (0: everything)."""
        if self.head is None or source != self.source:
            return 0
        return self.head.height

    def begin(self, source: bytes, *, full: bool = False) -> ReplicaUpdate:
        """Start an update from ``source`` (a delta from :meth:`since`, or everything)."""
        return ReplicaUpdate(self, source, 0 if full else self.since(source))


class ReplicaUpdate:
    """One update of a :class:`DirectoryReplica`: pages in, then :meth:`commit`.

    Attributes:
        since: the height to ask for next (``GetDirectory.since_height``).
        done: the last page came (``more`` was false): call :meth:`commit`.
        pages: pages received.
    """

    def __init__(self, replica: DirectoryReplica, source: bytes, since: int) -> None:
        self.replica = replica
        self.source = source
        self.since = since
        self.done = False
        self.pages = 0
        self._reset = since == 0
        self._pending: dict[bytes, tuple[NodeRecord, bytes] | None] = {}
        self._head: DirectoryHead | None = None
        self._entries = 0
        # a fetch may see the set change while it pages: allow that much churn, then give up
        self._max_entries = 2 * replica.max_records + 4096

    @property
    def staged(self) -> int:
        """Changes received and not yet committed."""
        return len(self._pending)

    def receive(self, page: DirectoryPage) -> None:
        """Check one page and stage its changes (records checked here, cached by leaf).

        Raises:
            RemoteProtocolError: a page that does not continue the previous one (wrong
                ``since_height``, no progress, ``next_height`` beyond the head, an empty page
                with ``more``), a peer listed twice, more entries than the replica's bound
                allows, or a record field beyond its limit.
            InvalidSignatureError: a record whose signature does not verify.
            LocalProtocolError: the update is already done.
        """
        if self.done:
            raise LocalProtocolError("page received after the last one")
        head = page.head
        if page.reset:
            if page.since_height != 0:
                raise RemoteProtocolError("a reset page must start from height 0")
            self._reset = True
            self._pending.clear()
        elif page.since_height != self.since:
            raise RemoteProtocolError(
                f"page starts at height {page.since_height}, asked for {self.since}"
            )
        if page.next_height > head.height:
            raise RemoteProtocolError(
                f"page reaches height {page.next_height} beyond its head's {head.height}"
            )
        if page.more:
            if page.next_height <= page.since_height or not (page.records or page.removed):
                raise RemoteProtocolError("a page with more to come made no progress")
        elif page.next_height != head.height:
            raise RemoteProtocolError("the last page does not reach its head's height")
        if head.record_count > self.replica.max_records:
            raise RemoteProtocolError(f"directory of {head.record_count} records")
        self._entries += len(page.records) + len(page.removed)
        if self._entries > self._max_entries:
            raise RemoteProtocolError(f"over {self._max_entries} changes in one update")
        seen: set[bytes] = set()
        staged = []
        for record in page.records:
            if record.peer_id in seen:
                raise RemoteProtocolError(f"page lists {peer_label(record.peer_id)} twice")
            seen.add(record.peer_id)
            staged.append((record, self.replica.cache.check(record)))
        for peer in page.removed:
            if peer in seen:
                raise RemoteProtocolError(f"page lists {peer_label(bytes(peer))} twice")
            seen.add(peer)
        pending = self._pending
        for record, leaf in staged:
            pending[record.peer_id] = (record, leaf)
        for peer in page.removed:
            if self._reset:
                pending.pop(peer, None)
            else:
                pending[bytes(peer)] = None
        if self._reset and len(pending) > self.replica.max_records:
            raise RemoteProtocolError(f"over {self.replica.max_records} records")
        self._head = head
        self.since = page.next_height
        self.pages += 1
        self.done = not page.more

    def commit(self, now_ms: int) -> Directory:
        """Verify the assembled set against the last page's signed head and adopt it.

        On any error the replica is left as it was.

        Returns:
            the new verified directory (records sorted by peer ID).

        Raises:
            ExpiredError: the head is expired (or issued too far in the future).
            InvalidSignatureError: too few trusted signatures on the head, or the assembled
                records do not have the signed count and root (the client's base was not the
                verifier's, or the verifier sent a wrong set: retry with ``full=True``).
            RemoteProtocolError: the head is older than the one held from the same verifier.
            LocalProtocolError: the update is not done.
        """
        replica = self.replica
        if not self.done or self._head is None:
            raise LocalProtocolError("commit before the last page")
        head = verify_head(
            self._head,
            trusted_verifiers=replica.trusted_verifiers, quorum=replica.quorum, now_ms=now_ms,
        )
        held = replica.head
        if (
            held is not None
            and self.source == replica.source
            and head.height < held.height
            and head.issued_at_ms <= held.issued_at_ms
        ):
            raise RemoteProtocolError(
                f"directory at height {head.height} is older than the one held ({held.height})"
            )
        mismatch = InvalidSignatureError(
            f"the records received do not match the signed directory at height {head.height}"
        )
        if self._reset:
            fresh = RecordSet()
            for staged in self._pending.values():
                if staged is not None:
                    fresh.put(*staged)
            if len(fresh) != head.record_count or fresh.root() != head.root:
                raise mismatch
            replica._set = fresh
            changed = fresh.records()
        else:
            rset = replica._set
            undo: list[tuple[bytes, tuple[NodeRecord, bytes] | None]] = []
            changed_list = []
            for peer, staged in self._pending.items():
                old = rset._records.get(peer)
                if staged is None:
                    if old is not None:
                        undo.append((peer, old))
                        rset.remove(peer)
                elif old is None or old[1] != staged[1]:
                    undo.append((peer, old))
                    rset.put(*staged)
                    changed_list.append(staged[0])
            if len(rset) != head.record_count or rset.root() != head.root:
                for peer, old in reversed(undo):
                    if old is None:
                        rset.remove(peer)
                    else:
                        rset.put(*old)
                raise mismatch
            changed = tuple(changed_list)
            if not undo and replica.directory is not None and self.source == replica.source:
                old_dir = replica.directory
                directory = Directory(
                    head.height, head.issued_at_ms, head.expires_at_ms, old_dir.records,
                    head.signatures,
                )
                if "_index" in old_dir.__dict__:  # keep the lookup index: O(1) when unchanged
                    directory.__dict__["_index"] = old_dir.__dict__["_index"]
                return self._adopt(head, directory, (), False)
        directory = Directory(
            head.height, head.issued_at_ms, head.expires_at_ms, replica._set.records(),
            head.signatures,
        )
        return self._adopt(head, directory, changed, self._reset)

    def _adopt(
        self, head: DirectoryHead, directory: Directory, changed: tuple[NodeRecord, ...],
        reset: bool,
    ) -> Directory:
        replica = self.replica
        replica.source = self.source
        replica.head = head
        replica.directory = directory
        replica.last_changed = changed
        replica.last_reset = reset
        return directory


__all__ = ["DirectoryReplica", "ReplicaUpdate"]
