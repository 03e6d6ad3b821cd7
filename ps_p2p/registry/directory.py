"""The committed directory: served as deltas plus a commit, verified by nodes; pure.

What a verifier serves (PlanetServe sec. 3.4, with a quorum certificate): the registry state
after height T = H - 1, the header of block H (which carries that state's app hash, as in
Tendermint) and the commit of block H (2f+1 precommits of its block ID). A node that holds the
view at height S asks for what changed since S and gets pages of one *delta stream*::

    stream = b"planetserve/v2/directory-delta\\x00" || str(chain_id) || u64(since) || u64(T)
             || u8(reset) || bytes(registry aux) || u64(reputation epoch) || entry* || rep*
    entry  = u8(1) || bytes(record_signing_bytes(record)) || bytes(signature)   added or renewed
           | u8(2) || bytes(peer_id)                                            removed
    rep    = u8(3) || bytes(subject) || reputation entry                        scored
           | u8(4) || bytes(subject)                                            forgotten
    page   = u32(index) || u8(last) || bytes(chunk of the stream)

(record entries by ascending peer ID, then reputation entries by ascending subject; a
reputation entry and the registry aux are as in :mod:`ps_p2p.registry`; version 2 added
the reputations.)

(``bytes``/``str``/``u*`` as in :mod:`ps_p2p.records.canonical`). The stream is cut into chunks,
so every encoded page is at most ``max_page_bytes`` whatever the number or size of the records
(a record larger than a page spans pages). ``reset``: the server no longer has the changes since
S (or S is 0 or unknown): the stream lists every record and the node starts from an empty set.

The node (:func:`verify_directory`) checks, cheapest first: the chain ID, the header's age
against ``max_age_ms`` and its time against the node's clock, that the height does not go below
the view it holds (no rollback), the commit (:func:`~ps_p2p.consensus.signing.verify_commit`:
more than 2/3 of the genesis validators' power), then applies the changes to its view (checking
each changed record's fields and signature once, and each reputation's form) and compares the
app hash (:func:`~ps_p2p.registry.app_state_hash`) of the result with the header's. The
registry's evidence and tombstones travel as a digest (the registry aux); the reputations
travel in full (their changes), and the node recomputes the reputation root from all it holds,
so the aux root it hashes covers every reputation it uses: a verifier that sends a wrong,
missing or extra reputation gets its answer refused like a tampered record. It verifies only
what changed: O(changes) record checks and O(changed buckets) hashing, plus 2f+1 signatures,
plus O(subjects) hashing when a reputation changed.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ps_p2p.consensus.block import Header, block_id
from ps_p2p.consensus.encoding import Reader, lp, lps, u8, u32, u64
from ps_p2p.consensus.signing import VALUE_ID_BYTES, verify_commit
from ps_p2p.consensus.types import Validator, Vote
from ps_p2p.errors import (
    DirectoryRollbackError,
    ExpiredError,
    InvalidDirectoryError,
    InvalidTransactionError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.records.canonical import record_signing_bytes
from ps_p2p.records.limits import (
    MAX_CLOCK_SKEW_MS,
    MAX_RECORDS,
    MAX_SUBJECT_BYTES,
    MINUTE_MS,
)
from ps_p2p.records.peer_ids import ED25519_PEER_ID_BYTES
from ps_p2p.records.recordset import RecordSet
from ps_p2p.records.types import NodeRecord
from ps_p2p.records.validation import VerifiedCache
from ps_p2p.registry import (
    AppState,
    BlockResult,
    ReputationEntry,
    app_state_hash,
    aux_root_of,
    check_subject,
    decode_record,
    reputation_root,
)

DELTA_DOMAIN = b"planetserve/v2/directory-delta\x00"
#: u32 index, u8 last, u32 chunk length.
PAGE_OVERHEAD = 9
#: Smallest page bound a server accepts.
MIN_PAGE_BYTES = 64
#: Default page bound (the directory protocol's response frame is 256 KiB).
MAX_PAGE_BYTES = 192 * 1024
#: Default bound of a whole delta stream a node accepts (a reset of 100,000 records of ~0.8 KB).
MAX_DELTA_BYTES = 128 * 1024 * 1024
#: Default age beyond which a node refuses a directory (the header's block time).
MAX_DIRECTORY_AGE_MS = 10 * MINUTE_MS
#: Most heights of changes a server keeps for deltas.
MAX_HISTORY_HEIGHTS = 4096
#: Answers (page lists) a server keeps built for the served height (:meth:`DirectoryHistory.
#: pages`): the full directory plus a few deltas (nodes that refresh ask from the last one or
#: two heights).
MAX_CACHED_ANSWERS = 4
#: Bytes of built pages kept for the served height beyond the answer being built (64 MiB: the
#: full directory of 100,000 small records is ~22 MiB).
MAX_CACHED_BYTES = 64 * 1024 * 1024

_PUT = 1
_REMOVE = 2
_REP_PUT = 3
_REP_FORGET = 4


@dataclass(frozen=True)
class DeltaPage:
    """One page of a delta stream (module docstring).

    Attributes:
        index: 0, 1, ... in order.
        last: the stream ends with this page.
        data: a chunk of the stream.
    """

    index: int
    last: bool
    data: bytes

    def encode(self) -> bytes:
        """The page's canonical bytes (``PAGE_OVERHEAD`` + ``len(data)``)."""
        return u32(self.index) + u8(1 if self.last else 0) + lp(self.data)

    @staticmethod
    def decode(data: bytes, max_page_bytes: int = MAX_PAGE_BYTES) -> DeltaPage:
        """Parse :meth:`encode`'s bytes.

        Raises:
            InvalidDirectoryError: over ``max_page_bytes`` or malformed.
        """
        if len(data) > max_page_bytes:
            raise InvalidDirectoryError(f"page of {len(data)} bytes (max {max_page_bytes})")
        r = Reader(data, InvalidDirectoryError, "directory page")
        index = r.u32("index")
        last = r.u8("last flag")
        if last not in (0, 1):
            raise r.fail(f"last flag {last}")
        chunk = r.lp("data", max_page_bytes)
        r.done()
        return DeltaPage(index, bool(last), chunk)


# ---------------------------------------------------------------------------------- server


class DirectoryHistory:
    """A verifier's committed states and recent changes, for serving deltas (bounded).

    Holds the latest executed state (height H), the state it serves (height H - 1, covered by
    the header and commit of block H), and the changes of the last ``max_heights`` blocks, at
    most ``max_changes`` entries in all (oldest heights dropped first; a node asking from
    before them gets a reset).

    Args:
        state: the state to start from (the genesis state, or one restored at startup).
        max_heights: default :data:`MAX_HISTORY_HEIGHTS`.
        max_changes: default ``2 * MAX_RECORDS``.
        max_answers, max_cached_bytes: bounds of the built answers kept (:meth:`pages`).
    """

    def __init__(self, state: AppState, *, max_heights: int = MAX_HISTORY_HEIGHTS,
                 max_changes: int = 2 * MAX_RECORDS, max_answers: int = MAX_CACHED_ANSWERS,
                 max_cached_bytes: int = MAX_CACHED_BYTES) -> None:
        if max_heights < 1 or max_changes < 1:
            raise LocalProtocolError("history bounds must be >= 1")
        self.latest = state
        self.served: AppState | None = None
        self.header: Header | None = None
        self.commit: tuple[Vote, ...] = ()
        self.max_heights = max_heights
        self.max_changes = max_changes
        self.max_answers = max_answers
        self.max_cached_bytes = max_cached_bytes
        self._log: collections.deque[tuple[int, dict[bytes, NodeRecord | None],
                                           dict[bytes, ReputationEntry | None]]] = \
            collections.deque()
        self._logged = 0
        #: The lowest ``since`` still answered by a delta (the state before the oldest
        #: logged block).
        self.floor = state.height
        # (since, page bytes) -> the pages of that answer at the served height, least recently
        # used first; emptied by add_block (see pages())
        self._answers: collections.OrderedDict[tuple[int, int], _SharedPages] = \
            collections.OrderedDict()
        #: Answers built (cache misses) and answers served from built pages (hits).
        self.answers_built = 0
        self.answers_reused = 0

    def add_block(self, header: Header, commit: Sequence[Vote], new_state: AppState,
                  result: BlockResult) -> None:
        """Record a decided block: ``new_state`` (from :func:`~ps_p2p.registry.execution.execute_block` on
        :attr:`latest`) becomes the latest; the state before it is served with ``header`` and
        ``commit`` (checked by the caller: they came out of consensus).

        Raises:
            LocalProtocolError: heights that do not follow.
        """
        if not header.height == new_state.height == self.latest.height + 1 == result.height:
            raise LocalProtocolError(
                f"block {header.height} does not follow history at height {self.latest.height}"
            )
        self.served, self.latest = self.latest, new_state
        self.header, self.commit = header, tuple(commit)
        self._answers.clear()  # readers in flight keep their pages: a snapshot each
        reputations = dict(result.reputation_changes)
        self._log.append((header.height, dict(result.changes), reputations))
        self._logged += len(result.changes) + len(reputations)
        while self._log and (len(self._log) > self.max_heights or self._logged > self.max_changes):
            height, changes, reputations = self._log.popleft()
            self._logged -= len(changes) + len(reputations)
            self.floor = height

    def changes_since(self, since: int) -> tuple[bool, list[tuple[bytes, NodeRecord | None]]]:
        """What changed from height ``since`` to the served state, by ascending peer ID.

        Returns:
            ``(reset, changes)``; with ``reset`` every record of the served state and no
            removals. A removal may name a peer the client never had (added and removed
            after ``since``); the client ignores it.

        Raises:
            LocalProtocolError: nothing is served yet (no block decided).
        """
        served = self.served
        if served is None:
            raise LocalProtocolError("no block decided yet: no directory to serve")
        top = served.height
        if since <= 0 or since > top or since < self.floor:
            return True, [(r.peer_id, r) for r in served.records.records()]
        merged: dict[bytes, NodeRecord | None] = {}
        for height, changes, _ in self._log:
            if since < height <= top:
                merged.update(changes)
        return False, sorted(merged.items(), key=lambda item: item[0])

    def reputation_changes_since(
        self, since: int,
    ) -> tuple[bool, list[tuple[bytes, ReputationEntry | None]]]:
        """Like :meth:`changes_since`, for the reputations: ``(reset, changes)`` by ascending
        subject (with ``reset``, every subject of the served state).

        Raises:
            LocalProtocolError: nothing is served yet (no block decided).
        """
        served = self.served
        if served is None:
            raise LocalProtocolError("no block decided yet: no directory to serve")
        top = served.height
        if since <= 0 or since > top or since < self.floor:
            return True, sorted(served.reputations.items(), key=lambda item: item[0])
        merged: dict[bytes, ReputationEntry | None] = {}
        for height, _, reputations in self._log:
            if since < height <= top:
                merged.update(reputations)
        return False, sorted(merged.items(), key=lambda item: item[0])

    def pages(self, since_height: int, max_page_bytes: int = MAX_PAGE_BYTES) -> Iterator[DeltaPage]:
        """The pages of :func:`iter_delta_pages`, each built once per served height.

        Identical requests (the same ``since_height``, or any that gets a reset, and the same
        ``max_page_bytes``) share one list of pages, built as the first reader needs them:
        N readers of the full directory cost one encoding (issue 16: 20,000 records cost
        ~110 ms to encode, the request 3 bytes). At most ``max_answers`` answers are kept
        (:data:`MAX_CACHED_ANSWERS`), least recently asked dropped first, and their built pages
        at most ``max_cached_bytes`` (:data:`MAX_CACHED_BYTES`) beyond the answer being built;
        :meth:`add_block` drops them all. The returned iterator is a snapshot: a block decided
        while it is read changes nothing in it.

        Raises:
            LocalProtocolError: ``max_page_bytes`` below :data:`MIN_PAGE_BYTES`, or nothing
                served (raised here, not at the first ``next``).
        """
        served = self.served
        if served is None:
            raise LocalProtocolError("no block decided yet: no directory to serve")
        if max_page_bytes < MIN_PAGE_BYTES:
            raise LocalProtocolError(f"max_page_bytes must be >= {MIN_PAGE_BYTES}")
        reset = since_height <= 0 or since_height > served.height or since_height < self.floor
        key = (0 if reset else since_height, max_page_bytes)
        answer = self._answers.get(key)
        if answer is None:
            self.answers_built += 1
            answer = _SharedPages(iter_delta_pages(self, key[0], max_page_bytes), self._trim)
            answer.fill(1)  # fixes the snapshot now
            self._answers[key] = answer
            self._trim(answer)
        else:
            self.answers_reused += 1
            self._answers.move_to_end(key)
        return answer.reader()

    def _trim(self, building: _SharedPages) -> None:
        """Drop the least recently asked answers over the count and byte bounds (never
        ``building``, the one that grew)."""
        answers = self._answers
        others = sum(a.bytes for a in answers.values() if a is not building)
        for key in list(answers):
            if len(answers) <= self.max_answers and others <= self.max_cached_bytes:
                break
            if answers[key] is not building:
                others -= answers.pop(key).bytes


class _SharedPages:
    """The pages of one answer, built on demand from ``source`` and shared by its readers."""

    def __init__(self, source: Iterator[DeltaPage],
                 on_grow: Callable[[_SharedPages], None]) -> None:
        self._source: Iterator[DeltaPage] | None = source
        self._on_grow = on_grow
        self.pages: list[DeltaPage] = []
        self.bytes = 0

    def fill(self, count: int) -> None:
        """Build pages until ``count`` exist or the answer is complete."""
        grew = False
        while len(self.pages) < count and self._source is not None:
            page = next(self._source)
            self.pages.append(page)
            self.bytes += len(page.data) + PAGE_OVERHEAD
            grew = True
            if page.last:
                self._source = None
        if grew:
            self._on_grow(self)

    def reader(self) -> Iterator[DeltaPage]:
        """The pages from the first, building the ones no reader needed yet."""
        i = 0
        while True:
            if i >= len(self.pages):
                self.fill(i + 1)
                if i >= len(self.pages):
                    return
            yield self.pages[i]
            i += 1


def iter_delta_pages(history: DirectoryHistory, since_height: int,
                     max_page_bytes: int = MAX_PAGE_BYTES) -> Iterator[DeltaPage]:
    """The pages of the delta from ``since_height`` to the served state (module docstring).

    Each page encodes (:meth:`DeltaPage.encode`) to at most ``max_page_bytes`` bytes; memory
    is one page at a time beyond the sorted change list.

    Raises:
        LocalProtocolError: ``max_page_bytes`` below :data:`MIN_PAGE_BYTES`, or nothing served.
    """
    if max_page_bytes < MIN_PAGE_BYTES:
        raise LocalProtocolError(f"max_page_bytes must be >= {MIN_PAGE_BYTES}")
    reset, changes = history.changes_since(since_height)
    _, reputations = history.reputation_changes_since(since_height)  # the same reset rule
    served = history.served
    assert served is not None  # changes_since raised otherwise
    chunk = max_page_bytes - PAGE_OVERHEAD
    buf = bytearray(
        DELTA_DOMAIN + lps(served.chain_id) + u64(0 if reset else since_height)
        + u64(served.height) + u8(1 if reset else 0) + lp(served.registry_aux())
        + u64(served.reputation_epoch)
    )
    index = 0

    def entries() -> Iterator[bytes]:
        for peer, record in changes:
            if record is None:
                yield u8(_REMOVE) + lp(peer)
            else:
                yield u8(_PUT) + lp(record_signing_bytes(record)) + lp(record.signature)
        for subject, entry in reputations:
            if entry is None:
                yield u8(_REP_FORGET) + lp(subject)
            else:
                yield u8(_REP_PUT) + lp(subject) + entry.encode()

    for data in entries():
        buf += data
        while len(buf) > chunk:
            yield DeltaPage(index, False, bytes(buf[:chunk]))
            del buf[:chunk]
            index += 1
    yield DeltaPage(index, True, bytes(buf))


def directory_delta(history: DirectoryHistory, since_height: int,
                    max_page_bytes: int = MAX_PAGE_BYTES) -> list[DeltaPage]:
    """All pages of :func:`iter_delta_pages` (each at most ``max_page_bytes`` encoded)."""
    return list(iter_delta_pages(history, since_height, max_page_bytes))


# ---------------------------------------------------------------------------------- node


class DirectoryView:
    """A node's verified copy of the registry's records at a committed height.

    Attributes:
        chain_id: the chain.
        height: the state's height (the covering header's height - 1; 0: empty genesis).
        header: the header whose commit covered it (None for the empty start).
        app_hash: the state's app hash (the header's ``app_hash``).
        aux_root: the state's aux root (the registry aux and the reputation root).
        reputation_epoch: the last epoch of the committed reputations.
        reputations: reputation subject -> committed entry (take it as read-only).

    Superseded by the view :func:`verify_directory` returns from it (which takes over its
    record set without copying): do not use a view passed as ``previous_view`` after a
    success.
    """

    def __init__(self, chain_id: str, height: int = 0, header: Header | None = None,
                 app_hash: bytes = b"", aux_root: bytes = b"",
                 records: RecordSet | None = None,
                 reputations: dict[bytes, ReputationEntry] | None = None,
                 reputation_epoch: int = 0, reputation_root: bytes | None = None) -> None:
        self.chain_id = chain_id
        self.height = height
        self.header = header
        self.app_hash = app_hash
        self.aux_root = aux_root
        self._records = records if records is not None else RecordSet()
        self.reputations: dict[bytes, ReputationEntry] = \
            reputations if reputations is not None else {}
        self.reputation_epoch = reputation_epoch
        self._reputation_root = reputation_root
        self._superseded = False

    def reputation_root(self) -> bytes:
        """:func:`~ps_p2p.registry.reputation_root` of the held reputations (cached)."""
        if self._reputation_root is None:
            self._reputation_root = reputation_root(self.reputations, self.reputation_epoch)
        return self._reputation_root

    def __len__(self) -> int:
        return len(self._records)

    def get(self, peer_id: bytes) -> NodeRecord | None:
        """The record of ``peer_id``, or None."""
        self._check_live()
        return self._records.get(peer_id)

    def records(self) -> tuple[NodeRecord, ...]:
        """All records, ascending peer ID."""
        self._check_live()
        return self._records.records()

    def _check_live(self) -> None:
        if self._superseded:
            raise LocalProtocolError("this directory view was superseded by a newer one")


def _join_pages(pages: Sequence[DeltaPage], max_delta_bytes: int) -> bytes:
    if not pages:
        raise InvalidDirectoryError("no directory pages")
    total = 0
    for i, page in enumerate(pages):
        if page.index != i:
            raise InvalidDirectoryError(f"directory page {page.index} where {i} was expected")
        if page.last != (i == len(pages) - 1):
            raise InvalidDirectoryError("directory pages do not end with exactly one last page")
        total += len(page.data)
        if total > max_delta_bytes:
            raise InvalidDirectoryError(f"directory delta over {max_delta_bytes} bytes")
    return b"".join(page.data for page in pages)


def verify_directory(
    genesis_validators: Sequence[Validator],
    chain_id: str,
    header: Header,
    commit: Sequence[Vote],
    pages: Sequence[DeltaPage],
    previous_view: DirectoryView | None,
    now_ms: int,
    max_age_ms: int = MAX_DIRECTORY_AGE_MS,
    *,
    max_delta_bytes: int = MAX_DELTA_BYTES,
    max_records: int = MAX_RECORDS,
    cache: VerifiedCache | None = None,
) -> DirectoryView:
    """Check a served directory and return the node's new view (module docstring).

    Args:
        genesis_validators: the validator set of the genesis file.
        header, commit: block H and its commit; they cover the state at H - 1.
        pages: the delta pages since ``previous_view.height`` (or a reset), in order.
        previous_view: the view held (None: none yet). Left unchanged when an error is
            raised; superseded on success (:class:`DirectoryView`).
        now_ms: the node's clock (unix ms).
        max_age_ms: refuse a header whose block time is older than this.
        max_delta_bytes, max_records: bounds of what a server can make the node hold.
        cache: verified records and commits (skips re-checking a record, or a commit whose
            votes and validator set are identical, already seen).

    Returns:
        the view at height ``header.height - 1``.

    Raises:
        ExpiredError: the header is older than ``max_age_ms``, or more than 5 minutes in the
            future.
        DirectoryRollbackError: a lower height than ``previous_view``'s.
        InvalidCommitError: the commit does not carry more than 2/3 of the genesis power of
            valid precommits for this header's block ID (under-signed, forged, wrong block).
        InvalidDirectoryError: another chain ID; pages missing, out of order or malformed;
            a delta from another height than the view's; a record that fails its checks;
            or a result whose app hash is not the header's (tampered delta).
        LocalProtocolError: ``previous_view`` already superseded or of another chain.
    """
    if previous_view is not None:
        previous_view._check_live()
        if previous_view.chain_id != chain_id:
            raise LocalProtocolError("previous view is of another chain")
    if header.chain_id != chain_id:
        raise InvalidDirectoryError(f"directory of chain {header.chain_id!r}, not {chain_id!r}")
    if header.time_ms > now_ms + MAX_CLOCK_SKEW_MS:
        raise ExpiredError(f"directory header {header.time_ms - now_ms} ms in the future")
    if now_ms - header.time_ms > max_age_ms:
        raise ExpiredError(
            f"directory header of height {header.height} is {now_ms - header.time_ms} ms old "
            f"(max {max_age_ms} ms)"
        )
    height = header.height - 1
    if previous_view is not None and height < previous_view.height:
        raise DirectoryRollbackError(
            f"directory at height {height} is older than the one held ({previous_view.height})"
        )
    header_id = block_id(header)
    # the same commit again (a refresh with no new block): its signatures were checked; the
    # key holds every vote whole and the set it was checked against, so other bytes miss
    commit_key = (chain_id, tuple(genesis_validators), header.height, header_id, tuple(commit))
    if cache is None or not cache.commit_checked(commit_key):
        verify_commit(chain_id, genesis_validators, header.height, header_id, commit)
        if cache is not None:
            cache.remember_commit(commit_key)

    r = Reader(_join_pages(pages, max_delta_bytes), InvalidDirectoryError, "directory delta")
    r.prefix(DELTA_DOMAIN, "delta domain")
    if r.lps("chain ID", 64) != chain_id:
        raise InvalidDirectoryError("directory delta of another chain")
    since = r.u64("since height")
    if r.u64("height") != height:
        raise InvalidDirectoryError(f"directory delta does not reach height {height}")
    reset = r.u8("reset flag")
    if reset not in (0, 1):
        raise r.fail(f"reset flag {reset}")
    registry_aux = r.lp("registry aux", VALUE_ID_BYTES, exact=VALUE_ID_BYTES)
    reputation_epoch = r.u64("reputation epoch")
    held = previous_view.height if previous_view is not None else 0
    if not reset and since != held:
        raise InvalidDirectoryError(
            f"directory delta from height {since}, but the view is at height {held}"
        )
    if reset or previous_view is None:
        records = RecordSet()
        reputations: dict[bytes, ReputationEntry] = {}
    else:
        records = previous_view._records
        reputations = previous_view.reputations
    cache = cache if cache is not None else VerifiedCache(0)
    undo: list[tuple[bytes, NodeRecord | None]] = []
    rep_undo: list[tuple[bytes, ReputationEntry | None]] = []
    try:
        last_peer = b""
        last_subject = b""
        while r.remaining:
            op = r.u8("entry kind")
            if op in (_REP_PUT, _REP_FORGET):
                subject = check_subject(r.lp("subject", MAX_SUBJECT_BYTES), InvalidDirectoryError)
                if subject <= last_subject:
                    raise InvalidDirectoryError(
                        "directory reputations not by ascending subject"
                    )
                last_subject = subject
                if op == _REP_PUT:
                    entry = ReputationEntry.read(r)
                    if subject not in reputations and len(reputations) >= max_records:
                        raise InvalidDirectoryError(f"directory over {max_records} reputations")
                    rep_undo.append((subject, reputations.get(subject)))
                    reputations[subject] = entry
                elif subject in reputations:
                    rep_undo.append((subject, reputations.pop(subject)))
                continue
            if last_subject:
                raise InvalidDirectoryError("directory record entry after the reputations")
            if op == _PUT:
                try:
                    record = decode_record(r.lp("record", 1024), r.lp("signature", 64))
                except InvalidTransactionError as exc:
                    raise InvalidDirectoryError(str(exc)) from None
                peer = record.peer_id
            elif op == _REMOVE:
                peer = r.lp("peer ID", ED25519_PEER_ID_BYTES)
                record = None
            else:
                raise r.fail(f"entry kind {op}")
            if peer <= last_peer:
                raise InvalidDirectoryError("directory delta entries not by ascending peer ID")
            last_peer = peer
            if record is not None:
                try:
                    cache.check(record)
                except RemoteProtocolError as exc:
                    raise InvalidDirectoryError(f"directory record refused: {exc}") from None
                if peer not in records and len(records) >= max_records:
                    raise InvalidDirectoryError(f"directory over {max_records} records")
                undo.append((peer, records.put(record)))
            elif peer in records:
                undo.append((peer, records.remove(peer)))
        if (not rep_undo and not reset and previous_view is not None
                and previous_view.reputation_epoch == reputation_epoch):
            rep_root = previous_view.reputation_root()  # unchanged: cached
        else:
            rep_root = reputation_root(reputations, reputation_epoch)
        aux_root = aux_root_of(registry_aux, rep_root)
        computed = app_state_hash(chain_id, height, len(records), records.root(), aux_root)
        if computed != header.app_hash:
            raise InvalidDirectoryError(
                f"directory at height {height} does not have the committed app hash "
                "(tampered or incomplete delta)"
            )
    except BaseException:
        for peer, old in reversed(undo):  # previous_view unchanged
            if old is None:
                records.remove(peer)
            else:
                records.put(old)
        for subject, old_entry in reversed(rep_undo):
            if old_entry is None:
                reputations.pop(subject, None)
            else:
                reputations[subject] = old_entry
        raise
    if previous_view is not None and records is previous_view._records:
        previous_view._superseded = True
    return DirectoryView(chain_id, height, header, header.app_hash, aux_root, records,
                         reputations, reputation_epoch, rep_root)


__all__ = [
    "DELTA_DOMAIN",
    "MAX_CACHED_ANSWERS",
    "MAX_CACHED_BYTES",
    "MAX_DELTA_BYTES",
    "MAX_DIRECTORY_AGE_MS",
    "MAX_HISTORY_HEIGHTS",
    "MAX_PAGE_BYTES",
    "MIN_PAGE_BYTES",
    "PAGE_OVERHEAD",
    "DeltaPage",
    "DirectoryHistory",
    "DirectoryView",
    "directory_delta",
    "iter_delta_pages",
    "verify_directory",
]
