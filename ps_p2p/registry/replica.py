"""A node's verified copy of the committee's directory, brought up to date by deltas; pure.

How every user and model node follows the directory (PlanetServe sec. 3.4): it holds the
registry state at some height S, asks any verifier
for what changed since S, and adopts the answer only when
:func:`~ps_p2p.registry.directory.verify_directory` accepts it against the *genesis*
validator set, or the set the executed VALSET_UPDATEs made of it (each signed by more than 2/3
of the set before it; the verifier serves them with the head): a commit of more than 2/3 of
that set's voting power (2f+1 of N = 3f+1 equal validators) over block H's header, whose app hash is that of the state at H - 1 that the pages
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

from ps_p2p.consensus.block import Header
from ps_p2p.consensus.types import Validator, Vote
from ps_p2p.errors import InvalidCommitError
from ps_p2p.records.limits import MAX_RECORDS
from ps_p2p.records.types import Directory, NodeRecord
from ps_p2p.records.validation import VerifiedCache
from ps_p2p.registry import Genesis, ValsetUpdateTx, validators_at
from ps_p2p.registry.directory import (
    MAX_DELTA_BYTES,
    MAX_DIRECTORY_AGE_MS,
    DeltaPage,
    DirectoryView,
    verify_directory,
)


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
        self._valset_chain: tuple[ValsetUpdateTx, ...] = ()  # the last chain checked whole

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
        *,
        valset_updates: Sequence[ValsetUpdateTx] = (),
    ) -> Directory:
        """Verify a served directory (header of block H, its commit, the delta pages of the
        state at H - 1 since :meth:`since`) and adopt it.

        The commit is checked against the validator set of height H: the genesis set, changed
        by ``valset_updates`` (the executed VALSET_UPDATEs the verifier serves, in order, each
        signed by more than 2/3 of the set before it: :func:`~ps_p2p.registry.
        validators_at`; the last chain checked is remembered, so an unchanged one costs no
        signature check).

        Returns:
            the new :class:`Directory` (records ascending by peer ID).

        Raises:
            ExpiredError, DirectoryRollbackError, InvalidCommitError, InvalidDirectoryError:
                as :func:`~ps_p2p.registry.directory.verify_directory` (InvalidCommitError
                too for a validator-set chain that does not hold); the replica is left as it
                was.
        """
        updates = tuple(valset_updates)
        if updates != self._valset_chain:
            if updates[:len(self._valset_chain)] != self._valset_chain:
                # a verifier may not hide an update the node already follows (removed
                # validators' keys must not sign for a set the node knows is gone)
                raise InvalidCommitError("validator-set chain does not extend the one held")
            validators_at(self.genesis.validators, self.genesis.chain_id, updates, 0)
        validators = _set_at(self.genesis.validators, updates, header.height)
        view = verify_directory(
            validators, self.genesis.chain_id, header, commit, pages, self.view,
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
        self._valset_chain = updates  # checked whole
        self.directory = directory
        self.last_changed = changed
        self.source = source
        return directory


def _set_at(genesis_validators: Sequence[Validator], updates: Sequence[ValsetUpdateTx],
            height: int) -> tuple[Validator, ...]:
    """The set deciding ``height`` along an already checked chain of updates."""
    current = tuple(genesis_validators)
    for update in updates:
        if update.effective_height > height:
            break
        current = tuple(update.validators)
    return current


__all__ = ["CommitteeReplica"]
