"""A node's verified copy of the committee's directory, brought up to date by deltas; pure.

How every user and model node follows the directory (PlanetServe sec. 3.4): it holds the
registry state at some height S, asks any verifier
for what changed since S, and adopts the answer only when
:func:`~ps_p2p.consensus.directory.verify_directory` accepts it against the *genesis*
validator set: a commit of more than 2/3 of the genesis voting power (2f+1 of N = 3f+1 equal
validators) over block H's header, whose app hash is that of the state at H - 1 that the pages
describe (the Tendermint convention: header H+1 carries the app hash after block H). What the
node then uses is a plain :class:`~ps_p2p.records.Directory`, so path and model choice know
nothing of commits.

A lying verifier can only make the node refuse its answer (:class:`InvalidCommitError` for
fewer than 2f+1 signatures or a forged commit, :class:`InvalidDirectoryError` for pages that do
not give the committed app hash, :class:`DirectoryRollbackError` for a state older than the one
held, :class:`ExpiredError` for a header older than ``max_age_ms``); the view held is then
unchanged and the node asks another verifier.

Times are unix milliseconds passed in as ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from ps_p2p.consensus.app import Genesis
from ps_p2p.consensus.block import Header
from ps_p2p.consensus.directory import (
    MAX_DELTA_BYTES,
    MAX_DIRECTORY_AGE_MS,
    DeltaPage,
    DirectoryView,
    verify_directory,
)
from ps_p2p.consensus.types import Vote
from ps_p2p.records.limits import MAX_RECORDS
from ps_p2p.records.types import Directory, NodeRecord
from ps_p2p.records.validation import VerifiedCache


class CommitteeReplica:
    """A node's verified view of the committee's registry (module docstring).

    Args:
        genesis: the chain's genesis (chain ID and the validator set that signs commits).
        max_age_ms: refuse a directory whose header (block time) is older than this
            (default 10 minutes); also the validity given to the :class:`Directory` built.
        max_delta_bytes, max_records: what a verifier can make the node hold.
        cache: verified records (default: a new :class:`VerifiedCache`).

    Attributes:
        view: the last verified :class:`DirectoryView` (None before the first).
        directory: the same records as a :class:`Directory` (height = the state's height,
            ``issued_at_ms`` = the covering header's block time, ``expires_at_ms`` =
            that + ``max_age_ms``; the commit over that header was checked here), with the
            committed reputations (subject -> R) and the genesis' untrusted threshold, so
            :meth:`Directory.trusted` answers from what the commit covers.
        last_changed: records added or changed by the last :meth:`apply` (all after a reset).
        source: the verifier of the last accepted answer (any verifier serves the same chain,
            so it is only a preference for the next fetch).
    """

    def __init__(
        self,
        genesis: Genesis,
        *,
        max_age_ms: int = MAX_DIRECTORY_AGE_MS,
        max_delta_bytes: int = MAX_DELTA_BYTES,
        max_records: int = MAX_RECORDS,
        cache: VerifiedCache | None = None,
    ) -> None:
        self.genesis = genesis
        self.max_age_ms = max_age_ms
        self.max_delta_bytes = max_delta_bytes
        self.max_records = max_records
        self.cache = cache if cache is not None else VerifiedCache()
        self.view: DirectoryView | None = None
        self.directory: Directory | None = None
        self.last_changed: tuple[NodeRecord, ...] = ()
        self.source: bytes | None = None
        self._reputation_root: bytes | None = None

    def since(self) -> int:
        """The height to ask for changes since (0: everything)."""
        return 0 if self.view is None else self.view.height

    def apply(
        self,
        header: Header,
        commit: Sequence[Vote],
        pages: Sequence[DeltaPage],
        now_ms: int,
        source: bytes | None = None,
    ) -> Directory:
        """Verify a served directory (header of block H, its commit, the delta pages of the
        state at H - 1 since :meth:`since`) and adopt it.

        Returns:
            the new :class:`Directory` (records ascending by peer ID).

        Raises:
            ExpiredError, DirectoryRollbackError, InvalidCommitError, InvalidDirectoryError:
                as :func:`~ps_p2p.consensus.directory.verify_directory`; the replica is left
                as it was.
        """
        view = verify_directory(
            self.genesis.validators, self.genesis.chain_id, header, commit, pages, self.view,
            now_ms, self.max_age_ms, max_delta_bytes=self.max_delta_bytes,
            max_records=self.max_records, cache=self.cache,
        )
        old = self.directory
        records = view.records()  # the same tuple object while the set is unchanged
        if old is not None and records is old.records:
            changed: tuple[NodeRecord, ...] = ()
        elif old is None:
            changed = records
        else:
            changed = tuple(r for r in records if old.record(r.peer_id) is not r)
        root = view.reputation_root()
        if old is not None and self._reputation_root == root:
            reputations = old.reputations
        else:
            reputations = MappingProxyType(
                {subject: entry.value for subject, entry in view.reputations.items()}
            )
        directory = Directory(
            view.height, header.time_ms, header.time_ms + self.max_age_ms, records,
            reputations, self.genesis.reputation.untrusted_below,
            self.genesis.reputation.initial, self.genesis.verification is not None,
        )
        self._reputation_root = root
        if old is not None and records is old.records and "_index" in old.__dict__:
            directory.__dict__["_index"] = old.__dict__["_index"]  # O(1) when unchanged
        self.view = view
        self.directory = directory
        self.last_changed = changed
        self.source = source
        return directory


__all__ = ["CommitteeReplica"]
