"""One validator of the verifier committee: the consensus core, the registry application, the
mempool, the directory history and the store, glued together (no libp2p, no trio).

:class:`Validator` turns the outputs of :class:`~ps_p2p.consensus.core.ConsensusCore` into the
application's answers and into *actions* for the service (:mod:`ps_p2p.protocols.consensus`),
which only moves bytes:

* ``GetValue`` -> a block built from the mempool (height, time ``max(now_ms, previous block
  time + 1)``, previous block ID, app hash after the previous block, this validator as
  proposer, the transactions :meth:`~ps_p2p.registry.Mempool.reap` gives that execute
  without error) -> ``ProposeValue``. After a restart, a proposal already signed at that
  (height, round) in the write-ahead log is proposed again instead.
* A peer's fresh proposal (POL round -1) is checked for timeliness once, when it arrives
  (:func:`~ps_p2p.consensus.block.check_timely`: block time within the clock drift of ours, the
  round's proposer named) and handed to the core with the answer
  (:attr:`~ps_p2p.consensus.types.ProposalReceived.timely`, read by L22 only).
* ``ValidateValue`` -> decode, :func:`~ps_p2p.consensus.block.validate_block` against the chain
  tip, with no clock bound (``valid(v)`` is cached per value for the height, so it must not
  depend on when it is asked: issue 17, a validator restarted 28 s late refused the round-0
  value for the whole height), a proposer of the validator set, every transaction applies
  (:func:`~ps_p2p.registry.execute_block` reports no failed one), and every EPOCH_REPORT
  passes this validator's own ``value_check`` (its reference model re-scores the answers:
  :mod:`ps_p2p.verification.service`) -> ``ValueValidated``. A proposer leaves out of its block
  the reports its own check does not pass (yet). While the check is still running
  (:data:`VALUE_CHECK_PENDING`) the answer is deferred, not "invalid": :meth:`Validator.
  revalidate` gives it once the check is done (the core waits for ``ValueValidated``, up to its
  propose timeout), so a report costs no extra round.
* ``BroadcastProposal`` / ``BroadcastVote`` -> signed with the identity key, written to the WAL
  (:meth:`~ps_p2p.consensus.store.ConsensusStore.record_signed`, durable before anything is
  sent), then :class:`SendMessage` (to every other validator) and looped back into the core. A
  :class:`~ps_p2p.errors.DoubleSignError` stops that message: nothing is sent or looped back,
  it is logged at ERROR and counted (``stats.double_sign_refused``).
* ``ScheduleTimeout`` -> a timer heap on the caller's clock (seconds); :meth:`tick` fires the
  due ones as ``TimeoutFired``.
* ``Decide`` -> the commit is verified (:func:`~ps_p2p.consensus.signing.verify_commit`), the
  block executed, block and commit saved, the directory history and mempool updated, the WAL
  below the next height pruned (every :data:`PRUNE_EVERY` heights), then :class:`Committed` and the next height (below).
* ``Equivocation`` / ``ProposalEquivocation`` -> an EVIDENCE / PROPOSAL_EVIDENCE transaction
  into the mempool (relayed).

Each height starts with the validator set and the excluded proposers of the committed state
(:attr:`~ps_p2p.registry.AppState.validators`, :attr:`~ps_p2p.registry.AppState.
excluded`), and its commit (decided or synced) is verified against that set: a VALSET_UPDATE
takes effect at the same height on every validator.

The next height starts (``StartHeight(h + 1)``) at once when transactions are pending (ones
this validator would propose: not an EPOCH_REPORT its own check refuses or still runs on) or a
message of that height already came from another validator; after :data:`PROOF_BLOCK_DELAY`
(1 s) when the block just decided changed the state (its app hash is only committed by the
next header, which the directory needs to serve the change); otherwise after
``empty_block_interval`` seconds (default 30: an idle chain still makes a block that often, so
that the directory's commit stays fresh: nodes refuse one older than 10 minutes), or as soon as
a transaction or such a message arrives (CometBFT's ``create_empty_blocks_interval``), or
when the state has something due by block time sooner (:meth:`Validator.idle_delay`: a
record's expiry, the verification epoch's next attempt or start; block time is the chain's only
clock, so these need a block past them). A transaction then waits one consensus instance, not
an empty block's.

Snapshots: every ``snapshot_every`` heights (default 1,000) the committed state is kept in the
store (:mod:`ps_p2p.registry.snapshot`, the newest two), and with ``keep_blocks`` the blocks
older than both the oldest snapshot and the last ``keep_blocks`` heights are pruned.

Restart (:meth:`start`): the state is rebuilt from the newest snapshot below the stored height
whose app hash the next stored block's header carries (else from the genesis), executing only
the blocks after it (cost O(snapshot_every) blocks, not O(chain age): 0.04 s at 100,000 heights
against 4.8 s from the genesis, ``benchmarks/bench_restart.py``), the core starts at the
stored height + 1, and the own messages of that height found in the WAL are sent again and
looped back, in (round, step) order, so a restarted validator counts what it signed and never
signs a different value there (the WAL refuses it anyway). Before that, the
value of its highest-round own precommit (stored with it) is restored as its lock
(:class:`~ps_p2p.consensus.types.RestoreLock`, Algorithm 1 L38-42), and the 2f+1 prevotes of
the polka behind that lock (stored with the precommit, signed by others and verified when
they arrived) are replayed as received votes: the vote keeper holds the polka again, so the
validator's re-proposal of its locked value (L16, validRound) goes out with its POL
certificate (:meth:`Validator.pol_certificate`) and the others can accept it (L28). Without
them a polka that counted a vote only this validator received died with its crash, and the
height could halt (simulator seeds 2268, 2529, 5802, 9265 of 10,000 adversarial schedules).

Time: every method takes ``now`` (seconds, the caller's monotonic clock: trio's in the
service) for timers; block times use ``unix_ms()`` (injected; wall-clock milliseconds).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ps_p2p.consensus import gossip
from ps_p2p.consensus.block import (
    Block,
    block_id,
    check_timely,
    consensus_value_id,
    decode_block,
    encode_block,
    make_block,
    validate_block,
)
from ps_p2p.consensus.core import ConsensusConfig, ConsensusCore
from ps_p2p.consensus.signing import sign_proposal, sign_vote, verify_commit
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator as CommitteeMember
from ps_p2p.consensus.types import (
    NIL_ROUND,
    BroadcastProposal,
    BroadcastVote,
    Decide,
    Equivocation,
    GetValue,
    Input,
    Proposal,
    ProposalEquivocation,
    ProposalReceived,
    ProposeValue,
    RestoreLock,
    ScheduleTimeout,
    StartHeight,
    Step,
    TimeoutFired,
    ValidateValue,
    ValueValidated,
    Vote,
    VoteReceived,
    VoteType,
)
from ps_p2p.errors import (
    DoubleSignError,
    InvalidBlockError,
    LocalProtocolError,
    PsError,
    RemoteProtocolError,
    StoreError,
)
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.types import Signer
from ps_p2p.registry import (
    TX_DOMAIN,
    AppState,
    BlockResult,
    EvidenceTx,
    Genesis,
    ProposalEvidenceTx,
    Mempool,
    TxKind,
    encode_tx,
    execute_block,
    genesis_state,
)
from ps_p2p.registry.directory import DirectoryHistory
from ps_p2p.registry.snapshot import decode_state, encode_state
from ps_p2p.verification.epochs import MAX_ATTEMPTS, VALUE_CHECK_PENDING

log = logging.getLogger(__name__)

# VALUE_CHECK_PENDING (imported above, re-exported): what ``value_check`` answers while its
# check is still running (module docstring); the verification layer defines it (it sits below
# the registry: issue 17, no import cycle).
#: Deferred validations kept (this height's proposals waiting for a value check).
MAX_DEFERRED = 8

#: Default seconds an idle chain waits before an empty block (CometBFT's
#: ``create_empty_blocks_interval``). A node refuses a directory whose header is older than
#: :data:`~ps_p2p.registry.directory.MAX_DIRECTORY_AGE_MS` (10 min): an idle chain's newest
#: header is at most this interval plus one commit and one refresh old, a 20x margin; a
#: transaction, a record's expiry or an epoch's deadline makes a block sooner
#: (:meth:`Validator.idle_delay`). It was 1 s: 86,400 blocks (~66 MB, ~22 s of restart) a day.
EMPTY_BLOCK_INTERVAL = 30.0
#: Shortest wait for a block that the state has due (:meth:`Validator.idle_delay`).
MIN_IDLE_DELAY = 1.0
#: Seconds before the block after one that changed the state (its "proof block": only the
#: next header commits the new app hash the directory serves). Not 0: a transaction that
#: arrives meanwhile makes that block itself, instead of waiting behind an empty one (a
#: stream of transactions then makes no empty blocks); 1 s is the directory's lag of before.
PROOF_BLOCK_DELAY = 1.0
#: Default heights between two state snapshots: a restart executes at most this many blocks
#: (~0.25 s for empty ones); one snapshot is O(records) (~0.1 s and ~10 MB at 100,000 records),
#: so 1,000 keeps its cost under a millisecond a height on average.
SNAPSHOT_EVERY = 1000
#: Executed candidate blocks kept per height (proposed or validated, reused at Decide).
MAX_EXECUTED = 8
#: The WAL is pruned of decided heights every this many heights (one write less per height;
#: a restart replays only the height after the last stored block).
PRUNE_EVERY = 16


def unix_ms() -> int:
    """Wall-clock time in unix milliseconds (the default ``unix_ms`` of :class:`Validator`)."""
    return time.time_ns() // 1_000_000


# ------------------------------------------------------------------------------------ actions


@dataclass(frozen=True)
class SendMessage:
    """Send ``message`` (signed, already in the WAL) to every other validator."""

    message: Proposal | Vote


@dataclass(frozen=True)
class RelayTx:
    """Send transaction ``tx`` to every other validator but ``exclude`` (its sender)."""

    tx: bytes
    exclude: bytes | None = None


@dataclass(frozen=True)
class Committed:
    """Height ``height`` was committed (decided here, or fetched by block sync)."""

    height: int
    block: Block
    commit: tuple[Vote, ...]
    result: BlockResult
    synced: bool = False


Action = SendMessage | RelayTx | Committed


@dataclass(frozen=True)
class WireCodec:
    """How own messages and commits are stored (the service's wire form, injected so that this
    module needs no protobuf): ``encode_message``/``decode_message`` for the WAL (a decode error
    is a RemoteProtocolError), ``encode_commit`` for the block store."""

    encode_message: Callable[[Proposal | Vote], bytes]
    decode_message: Callable[[bytes], object]
    encode_commit: Callable[[Sequence[Vote]], bytes]
    decode_commit: Callable[[bytes], tuple[Vote, ...]]


@dataclass
class ValidatorStats:
    """Counters of one validator (for logs, metrics and tests)."""

    heights_committed: int = 0
    blocks_synced: int = 0
    proposals_signed: int = 0
    votes_signed: int = 0
    double_sign_refused: int = 0
    values_refused: int = 0
    wal_replayed: int = 0
    #: restarts that restored a lock from the write-ahead log
    locks_restored: int = 0
    evidence_seen: int = 0
    #: state snapshots written; the height of the one the last start loaded (0: none)
    snapshots_taken: int = 0
    snapshot_height: int = 0
    #: fresh proposals found late (or early, or naming another proposer) on arrival
    untimely: int = 0
    #: last reason a proposed value was refused
    last_refusal: str = ""


@dataclass(order=True)
class _Timer:
    at: float
    seq: int
    inp: object = field(compare=False)  # TimeoutFired, or an int: the height to start


class Validator:
    """The consensus core plus the registry application of one validator (module docstring).

    Args:
        identity: the validator's Ed25519 identity (its peer ID is its address).
        genesis: the chain's genesis (validators, chain ID, policy, block limits).
        store: the validator's own :class:`ConsensusStore` (WAL and blocks).
        wire: how messages and commits are encoded in the store (:class:`WireCodec`).
        config: the core's timeouts; its ``value_id`` is replaced by the block ID
            (:func:`~ps_p2p.consensus.block.consensus_value_id`).
        mempool: default ``Mempool()``.
        empty_block_interval: seconds an idle chain waits before an empty block.
        unix_ms: wall clock in unix milliseconds (block times, mempool checks).
        snapshot_every: a state snapshot every this many heights (0: never); a restart
            executes only the blocks after the newest one (default :data:`SNAPSHOT_EVERY`).
        keep_blocks: with snapshots, prune the blocks older than both the last
            ``keep_blocks`` heights and the oldest snapshot kept; None (default): keep every
            block (a validator whose store is lost can then sync from the genesis).
        snapshot_writer: ``writer(state)`` takes over a due snapshot (the service encodes it
            in a worker thread: O(records), ~0.5 s at 100,000 records, then calls
            :meth:`keep_snapshot`); None: encoded and written at once.
        joining: ``identity`` need not be a genesis validator (one a VALSET_UPDATE adds: it
            follows the chain and votes once the committed set lists it).

    Raises:
        LocalProtocolError: ``identity`` is not a validator of ``genesis`` (and not joining).
    """

    def __init__(
        self,
        identity: Signer,
        genesis: Genesis,
        store: ConsensusStore,
        wire: WireCodec,
        config: ConsensusConfig | None = None,
        *,
        mempool: Mempool | None = None,
        empty_block_interval: float = EMPTY_BLOCK_INTERVAL,
        unix_ms: Callable[[], int] = unix_ms,
        value_check: Callable[[bytes], str | None] | None = None,
        snapshot_every: int = SNAPSHOT_EVERY,
        keep_blocks: int | None = None,
        snapshot_writer: Callable[[AppState], None] | None = None,
        joining: bool = False,
    ) -> None:
        if snapshot_every < 0 or (keep_blocks is not None and keep_blocks < 1):
            raise LocalProtocolError("snapshot_every must be >= 0 and keep_blocks >= 1")
        if not joining and all(v.address != identity.peer_id for v in genesis.validators):
            raise LocalProtocolError(
                f"{peer_label(identity.peer_id)} is not a validator of chain {genesis.chain_id!r}"
            )
        self.identity = identity
        self.address = identity.peer_id
        self.genesis = genesis
        self.store = store
        self.wire = wire
        config = config or ConsensusConfig()
        self.config = dataclasses.replace(config, value_id=consensus_value_id(genesis.limits))
        self.core = ConsensusCore(self.address, self.config)
        self.mempool = mempool or Mempool()
        self.empty_block_interval = empty_block_interval
        self.unix_ms = unix_ms
        self.snapshot_every = snapshot_every
        self.keep_blocks = keep_blocks
        self.snapshot_writer = snapshot_writer
        #: ``value_check(tx) -> None | reason``: this validator's own check of an EPOCH_REPORT
        #: (None: agreed); called on mempool admission (to start the work) and before proposing
        #: or prevoting a block that holds one. None: no check (nothing to score with).
        self.value_check = value_check
        self.state: AppState = genesis_state(genesis)
        self.history = DirectoryHistory(self.state)
        self.stats = ValidatorStats()
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._pending_start: int | None = None  # decided; this height starts on a trigger
        self._seen_next = False  # a message of core.height + 1 came in
        self._own: list[Proposal | Vote] = []  # own signed messages of the current height
        self._executed: dict[bytes, tuple[AppState, BlockResult]] = {}
        # value ID -> value, of the values of this height validated or proposed by us: a
        # precommit for one stores the value with it (the lock, restored after a restart)
        self._values: dict[bytes, bytes] = {}
        self._deferred: dict[tuple[int, int, bytes], ValidateValue] = {}
        self._started = False
        #: (height, round, messages) of the last decision taken here: the decided round's
        #: proposal and the precommits of its commit (L49), relayed to a peer that missed it
        self.last_commit: tuple[int, int, tuple[Proposal | Vote, ...]] | None = None

    # ------------------------------------------------------------------ views

    @property
    def height(self) -> int:
        """The height being decided (the committed height + 1 while it runs)."""
        return self.state.height + 1

    @property
    def committed_height(self) -> int:
        return self.state.height

    @property
    def validators(self) -> tuple[CommitteeMember, ...]:
        """The set deciding the current height (the committed state's)."""
        return self.state.validators

    def _start_input(self, height: int) -> StartHeight:
        """StartHeight from the committed state: its set and excluded proposers."""
        return StartHeight(height, self.state.validators, self.state.excluded)

    def is_validator(self, peer_id: bytes) -> bool:
        return self.state.is_validator(peer_id)

    def own_messages(self, rounds: int = 2) -> list[Proposal | Vote]:
        """Own signed messages of the current height in the last ``rounds`` rounds the core
        reached (what a periodic re-broadcast sends again)."""
        low = self.core.round - rounds + 1
        return [m for m in self._own if m.round >= low]

    def relay_set(self) -> list[Proposal | Vote]:
        """Signed proposals and votes of the current height to relay to a peer that lacks them:
        :func:`ps_p2p.consensus.gossip.relay_set` of the core (one implementation, shared with
        the simulator's service gossip)."""
        return gossip.relay_set(self.core)

    def pol_certificate(self, proposal: Proposal) -> tuple[Vote, ...]:
        """The 2f+1 prevotes of ``proposal``'s POL round for its value that we hold (L28); ()
        for a fresh proposal or another height (:func:`ps_p2p.consensus.gossip.pol_certificate`)."""
        return gossip.pol_certificate(self.core, proposal)

    def ignores(self, message: Proposal | Vote) -> bool:
        """Whether :meth:`receive` would drop this message without any change or action,
        whatever its signature (:meth:`~ps_p2p.consensus.core.ConsensusCore.ignores`): the
        caller may then skip its signature check."""
        return self.core.ignores(message)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` is next due (``now`` seconds), or None."""
        return self._timers[0].at if self._timers else None

    # ------------------------------------------------------------------ inputs

    def start(self, now: float) -> list[Action]:
        """Rebuild the state from the store, start the next height, replay the WAL there.

        Raises:
            StoreError: the store cannot be read, or a stored block does not execute on the
                state before it (the store does not belong to this chain, or is corrupt).
            LocalProtocolError: called twice.
        """
        if self._started:
            raise LocalProtocolError("validator already started")
        self._started = True
        latest = self.store.latest_height()
        height = self._restore_snapshot(latest) + 1
        first = height
        while height <= latest:
            rows = self.store.blocks_from(height, 64)
            if not rows or rows[0][0] != height:
                raise StoreError(f"the store lacks block {height} (latest {latest})")
            for h, raw, commit_raw in rows:
                try:
                    block = decode_block(raw, self.genesis.limits)
                    commit = self.wire.decode_commit(commit_raw)
                    new, result = execute_block(self.state, block)
                except (PsError, ValueError) as exc:
                    raise StoreError(f"stored block {h} does not apply: {exc}") from exc
                if h != height:
                    raise StoreError(f"the store lacks block {height} (latest {latest})")
                self.history.add_block(block.header, commit, new, result)
                self.state = new
                height = h + 1
        if latest:
            log.info("validator %s restored height %d from its store (%d block(s) executed)",
                     peer_label(self.address), latest, latest - first + 1)
        actions: list[Action] = []
        self._run([self._start_input(self.height)], now, actions)
        replay: list[Input] = []
        own = self.store.signed_at(self.height)
        locks = [s for s in own if s.step == Step.PRECOMMIT and s.locked is not None]
        if locks:  # the lock of the highest round we precommitted a value in (L38-42)
            last = max(locks, key=lambda s: s.round)
            self._remember_value(last.locked)
            replay.append(RestoreLock(last.height, last.round, last.locked))
            self.stats.locks_restored += 1
            # the polka behind the lock (signed by others, verified when they arrived),
            # replayed as received votes: the keeper holds it again, so our re-proposal of
            # the locked value (L16, validRound) carries its POL certificate
            # (pol_certificate) and L28 can fire at the others
            for raw in last.certificate:
                try:
                    vote = self.wire.decode_message(raw)
                except RemoteProtocolError as exc:
                    raise StoreError(f"lock certificate at height {last.height} "
                                     f"unreadable: {exc}")
                if not isinstance(vote, Vote):
                    raise StoreError(f"lock certificate holds a {type(vote).__name__}")
                replay.append(VoteReceived(vote))
        for signed in own:
            try:
                message = self.wire.decode_message(signed.message)
            except RemoteProtocolError as exc:
                raise StoreError(f"WAL message at height {signed.height} unreadable: {exc}")
            if not isinstance(message, (Proposal, Vote)):
                raise StoreError(f"WAL holds a {type(message).__name__} at {signed.height}")
            self._remember_own(message)
            actions.append(SendMessage(message))
            replay.append(ProposalReceived(message) if isinstance(message, Proposal)
                          else VoteReceived(message))
            self.stats.wal_replayed += 1
        self._run(replay, now, actions)
        return actions

    def _restore_snapshot(self, latest: int) -> int:
        """Load the newest usable state snapshot below ``latest`` (module docstring); returns
        its height (0: none, the state stays the genesis one).

        A snapshot is used when it decodes, gives the app hash it claims, and that hash is the
        one the next stored block's header carries (a block with its commit); others are
        skipped (logged). At least one block is executed after it, so the directory has a
        served state with its header and commit at once.

        Raises:
            StoreError: blocks were pruned and no snapshot covers them.
        """
        for height, claimed in self.store.snapshots():
            if height >= latest:
                continue
            try:
                nxt = self.store.block(height + 1)
                header_hash = (None if nxt is None
                               else decode_block(nxt[0], self.genesis.limits).header.app_hash)
                data = self.store.snapshot(height)
                if data is None or header_hash != claimed:
                    raise RemoteProtocolError("its app hash is not the next block's")
                state = decode_state(data, self.state)
            except (PsError, ValueError) as exc:
                log.warning("state snapshot at height %d not used: %s", height, exc)
                continue
            self.state = state
            self.history = DirectoryHistory(state)
            self.stats.snapshot_height = height
            return height
        first = self.store.first_height()
        if first > 1:
            raise StoreError(f"the store's blocks start at {first} and no state snapshot "
                             "covers the ones before")
        return 0

    def _snapshot(self, state: AppState) -> None:
        """Every ``snapshot_every`` heights: a state snapshot, written here
        (:meth:`keep_snapshot`) or handed to ``snapshot_writer``."""
        if not self.snapshot_every or state.height % self.snapshot_every:
            return
        if self.snapshot_writer is not None:
            self.snapshot_writer(state)
        else:
            self.keep_snapshot(state.height, state.app_hash, encode_state(state))

    def keep_snapshot(self, height: int, app_hash: bytes, data: bytes) -> None:
        """Keep the snapshot ``data`` (:func:`~ps_p2p.registry.snapshot.encode_state` of the
        committed state at ``height``), then prune the blocks no restart needs beyond the last
        ``keep_blocks`` (None: keep every block).

        Raises:
            StoreError: the write failed.
        """
        self.store.save_snapshot(height, app_hash, data)
        self.stats.snapshots_taken += 1
        if self.keep_blocks is not None:
            kept = self.store.snapshots()
            below = min(kept[-1][0] + 1, height - self.keep_blocks + 1)
            if below > 1:
                self.store.prune_blocks(below)

    def receive(self, message: Proposal | Vote, now: float) -> list[Action]:
        """A peer's proposal or vote, its signer a validator and its signature checked by the
        caller (:func:`~ps_p2p.consensus.signing.verify_proposal` / ``verify_vote``)."""
        actions: list[Action] = []
        if self.core.height is not None and message.height == self.core.height + 1:
            self._seen_next = True
            if self._pending_start is not None:
                self._start_next(now, actions)
        inp: Input
        if isinstance(message, Proposal):
            ignored = self.core.ignores(message)
            inp = ProposalReceived(message, ignored or self._timely(message))
        else:
            inp = VoteReceived(message)
        self._run([inp], now, actions)
        return actions

    def add_tx(self, tx: bytes, now: float, sender: bytes | None = None) -> list[Action]:
        """Check ``tx`` against the state (:meth:`Mempool.add`) and queue it; a new one is
        relayed (:class:`RelayTx`) to the validators other than ``sender``.

        Raises:
            InvalidTransactionError, AdmissionError: as :func:`~ps_p2p.registry.check_tx`,
                or the mempool is full.
        """
        actions: list[Action] = []
        if self.mempool.add(tx, self.state, self.unix_ms()):
            actions.append(RelayTx(bytes(tx), sender))
            # own_check also starts the re-scoring while the tx waits for a block
            if self._own_check(tx) is None and self._pending_start is not None:
                self._start_next(now, actions)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Fire the timers due at ``now``."""
        actions: list[Action] = []
        while self._timers and self._timers[0].at <= now:
            timer = heapq.heappop(self._timers)
            if isinstance(timer.inp, int):
                if self._pending_start == timer.inp:
                    self._start_next(now, actions)
            else:
                self._run([timer.inp], now, actions)  # type: ignore[list-item]
        return actions

    def apply_synced(
        self, blocks: Sequence[tuple[int, bytes, Sequence[Vote]]], now: float
    ) -> list[Action]:
        """Commit blocks fetched by block sync: (height, encoded block, commit) in height order.

        Blocks at or below the committed height are skipped; each other one must carry a
        commit of the validator set of its height (checked here again) and follow the state
        (checked by execution). Then the core jumps to the height after the last one.

        Raises:
            ConsensusError (InvalidCommitError, InvalidBlockError): the first block that fails;
                the blocks before it stay committed.
        """
        actions: list[Action] = []
        applied = False
        committed_txs: list[bytes] = []
        try:
            for height, raw, commit in blocks:
                if height <= self.state.height:
                    continue
                block = decode_block(raw, self.genesis.limits)
                if block.header.height != height:
                    raise InvalidBlockError(f"synced block {height} says {block.header.height}")
                verify_commit(self.genesis.chain_id, self.state.validators, height,
                              block_id(block.header), commit)
                new, result = execute_block(self.state, block)
                self._commit(block, raw, tuple(commit), new, result, actions, synced=True)
                committed_txs.extend(block.txs)
                applied = True
        finally:
            if applied:
                self.mempool.update(self.state, committed_txs, self.unix_ms())
                self.store.prune_signed(self.height)
                if self.core.height is None or self.core.height < self.height:
                    self._pending_start = None
                    self._timers = [t for t in self._timers if not isinstance(t.inp, int)]
                    heapq.heapify(self._timers)
                    self._run([self._start_input(self.height)], now, actions)
        return actions

    # ------------------------------------------------------------------ the core's outputs

    def _run(self, inputs: list[Input], now: float, actions: list[Action]) -> None:
        queue = list(inputs)
        while queue:
            inp = queue.pop(0)
            if isinstance(inp, StartHeight):
                self._own = []
                self._executed = {}
                self._values = {}
                self._deferred = {}
                self._seen_next = False
                self._pending_start = None
            for out in self.core.handle(inp, now):
                self._execute(out, now, queue, actions)

    def _execute(self, out: object, now: float, queue: list[Input], actions: list[Action]) -> None:
        if isinstance(out, BroadcastProposal):
            proposal = sign_proposal(self.identity, self.genesis.chain_id, out.proposal)
            sent = self._record(proposal, Step.PROPOSE, self.config.value_id(proposal.value))
            if isinstance(sent, Proposal):
                self.stats.proposals_signed += 1
                actions.append(SendMessage(sent))
                queue.append(ProposalReceived(sent))
        elif isinstance(out, BroadcastVote):
            vote = sign_vote(self.identity, self.genesis.chain_id, out.vote)
            locked = None
            certificate: tuple[Vote, ...] = ()
            if vote.type == VoteType.PRECOMMIT and vote.value_id is not None:
                locked = self._values.get(vote.value_id)  # L36-42: precommit = lock
                if locked is not None and self.core.keeper is not None:
                    # the polka behind the lock (L36), kept with it for a restart
                    certificate = self.core.keeper.votes_for(vote.round, VoteType.PREVOTE,
                                                             vote.value_id)
            sent = self._record(vote, Step(int(vote.type)), vote.value_id, locked,
                                certificate)
            if isinstance(sent, Vote):
                self.stats.votes_signed += 1
                actions.append(SendMessage(sent))
                queue.append(VoteReceived(sent))
        elif isinstance(out, ScheduleTimeout):
            inp = TimeoutFired(out.kind, out.height, out.round)
            heapq.heappush(self._timers, _Timer(now + out.duration, next(self._seq), inp))
        elif isinstance(out, GetValue):
            value = self._get_value(out)
            self._remember_value(value)
            queue.append(ProposeValue(out.height, out.round, value))
        elif isinstance(out, ValidateValue):
            vid = self._remember_value(out.value)
            valid = self._validate(out, vid)
            if valid is None and len(self._deferred) < MAX_DEFERRED:
                self._deferred[(out.height, out.round, vid)] = out  # revalidate() answers
            else:
                queue.append(ValueValidated(out.height, out.round, vid, bool(valid)))
        elif isinstance(out, Decide):
            self._decide(out, now, actions)
        elif isinstance(out, (Equivocation, ProposalEquivocation)):
            self.stats.evidence_seen += 1
            if isinstance(out, Equivocation):
                who, evidence = out.first.validator, EvidenceTx(out.first, out.second)
            else:
                who, evidence = out.first.proposer, ProposalEvidenceTx.of(out.first, out.second)
            kind = "proposals" if isinstance(out, ProposalEquivocation) else "votes"
            if who in self.state.excluded:  # its first committed evidence did all evidence can
                log.debug("validator %s, already excluded, equivocated (%s) again at height %d",
                          peer_label(who), kind, out.first.height)
            else:
                log.warning("validator %s equivocated (%s) at height %d round %d",
                            peer_label(who), kind, out.first.height, out.first.round)
                try:
                    tx = encode_tx(evidence)
                    if self.mempool.add(tx, self.state, self.unix_ms()):
                        actions.append(RelayTx(tx))
                except PsError as exc:
                    log.info("equivocation evidence not queued: %s", exc)

    def _remember_value(self, value: bytes) -> bytes:
        vid = self.config.value_id(value)
        if vid not in self._values and len(self._values) < MAX_EXECUTED * 4:
            self._values[vid] = value
        return vid

    def _record(self, signed: Proposal | Vote, step: Step, vid: bytes | None,
                locked: bytes | None = None,
                certificate: tuple[Vote, ...] = ()) -> Proposal | Vote | None:
        """Write an own message to the WAL; returns the message to send (the one stored
        earlier for the same value, after a restart), or None (logged, counted) when it would
        double-sign. ``certificate``: with ``locked``, the prevotes of the polka behind the
        lock, written with it (restored by :meth:`start`)."""
        encoded = self.wire.encode_message(signed)
        try:
            stored = self.store.record_signed(
                signed.height, signed.round, int(step), vid, encoded, locked=locked,
                certificate=[self.wire.encode_message(v) for v in certificate],
            )
        except DoubleSignError as exc:
            self.stats.double_sign_refused += 1
            log.error("REFUSED TO DOUBLE-SIGN (nothing sent): %s", exc)
            return None
        if stored != encoded:  # signed before a restart: send the bytes sent then
            message = self.wire.decode_message(stored)
            if isinstance(message, type(signed)):
                signed = message
        self._remember_own(signed)
        return signed

    def _remember_own(self, message: Proposal | Vote) -> None:
        if message not in self._own:
            self._own.append(message)

    def _timely(self, p: Proposal) -> bool:
        """Whether a peer's proposal is timely on arrival (only a fresh one can be late)."""
        if p.pol_round != NIL_ROUND:
            return True
        try:
            header = decode_block(p.value, self.genesis.limits).header
            check_timely(header, now_ms=self.unix_ms(),
                         proposer=self.core.proposer(p.height, p.round))
        except PsError as exc:
            self.stats.untimely += 1
            log.info("fresh proposal at height %d round %d not timely (L22 prevotes nil): %s",
                     p.height, p.round, exc)
            return False
        return True

    # ------------------------------------------------------------------ the application

    def _get_value(self, out: GetValue) -> bytes:
        for signed in self.store.signed_at(out.height):
            if signed.round == out.round and signed.step == Step.PROPOSE:
                message = self.wire.decode_message(signed.message)
                if isinstance(message, Proposal):
                    return message.value  # signed before a restart: never a second value
        state = self.state
        txs = [tx for tx in self.mempool.reap(state) if self._own_check(tx) is None]
        for _ in range(2):  # drop what would fail (e.g. expired by the block's time), once
            block = make_block(
                chain_id=state.chain_id, height=out.height,
                time_ms=max(self.unix_ms(), state.time_ms + 1),
                prev_block_id=state.block_id, app_hash=state.app_hash, proposer=self.address,
                txs=txs,
            )
            new, result = execute_block(state, block)
            if all(r.ok for r in result.tx_results):
                break
            txs = [tx for tx, r in zip(txs, result.tx_results) if r.ok]
        self._keep_executed(block_id(block.header), new, result)
        return encode_block(block)

    def revalidate(self, now: float) -> list[Action]:
        """Answer the validations deferred for a pending value check whose check is done
        (call when ``value_check`` may have changed its mind)."""
        actions: list[Action] = []
        for key, out in list(self._deferred.items()):
            if out.height != self.height:
                del self._deferred[key]
                continue
            valid = self._validate(out, key[2])
            if valid is not None:
                del self._deferred[key]
                self._run([ValueValidated(out.height, out.round, key[2], valid)], now, actions)
        if self._pending_start is not None and self._proposable():
            self._start_next(now, actions)
        return actions

    def _validate(self, out: ValidateValue, vid: bytes) -> bool | None:
        """True/False; None while an EPOCH_REPORT's value check is pending."""
        if out.height != self.height:
            return False
        try:
            block = decode_block(out.value, self.genesis.limits)
            # valid(v) without clock bounds: timeliness is checked on arrival (_timely)
            validate_block(block, self.state.tip(), limits=self.genesis.limits, now_ms=None,
                           timely=False)
            new, result = execute_block(self.state, block)
            failed = [r for r in result.tx_results if not r.ok]
            if failed:
                raise InvalidBlockError(
                    f"block {out.height} holds {len(failed)} failing transaction(s): "
                    f"{failed[0].error}"
                )
            for tx in block.txs:
                reason = self._own_check(tx)
                if reason == VALUE_CHECK_PENDING:
                    return None
                if reason is not None:
                    raise InvalidBlockError(f"block {out.height}: {reason}")
        except PsError as exc:
            self.stats.values_refused += 1
            self.stats.last_refusal = str(exc)
            log.warning("refused the value proposed at height %d round %d: %s",
                        out.height, out.round, exc)
            return False
        self._keep_executed(vid, new, result)
        return True

    def _proposable(self) -> bool:
        """Whether the mempool holds a transaction this validator would propose (one its own
        check refuses, or still runs on, must not make it start heights back to back)."""
        return any(self._own_check(tx) is None for tx in self.mempool.txs())

    def _own_check(self, tx: bytes) -> str | None:
        """``value_check`` for an EPOCH_REPORT (None for any other transaction)."""
        if self.value_check is None or len(tx) <= len(TX_DOMAIN) \
                or tx[len(TX_DOMAIN)] != TxKind.EPOCH_REPORT:
            return None
        try:
            return self.value_check(bytes(tx))
        except Exception as exc:  # a bug in the check must not stop consensus: refuse
            log.exception("value check failed")
            return f"value check failed: {exc}"

    def _keep_executed(self, vid: bytes, new: AppState, result: BlockResult) -> None:
        if len(self._executed) >= MAX_EXECUTED:
            self._executed.pop(next(iter(self._executed)))
        self._executed[vid] = (new, result)

    def _decide(self, d: Decide, now: float, actions: list[Action]) -> None:
        block = decode_block(d.value, self.genesis.limits)  # valid: it was validated
        bid = block_id(block.header)
        verify_commit(self.genesis.chain_id, self.state.validators, d.height, bid, d.commit)
        executed = self._executed.get(bid)
        commit = gossip.commit_of(self.core, d)
        if commit is not None:
            self.last_commit = commit
        new, result = executed if executed is not None else execute_block(self.state, block)
        self._commit(block, d.value, d.commit, new, result, actions, synced=False)
        self.mempool.update(self.state, block.txs, self.unix_ms())
        if d.height % PRUNE_EVERY == 0:
            self.store.prune_signed(self.height)
        self._pending_start = self.height
        if self._proposable() or self._seen_next:
            self._start_next(now, actions)
        else:
            # a block that changed the state needs the next one soon: only the next header
            # carries its app hash, so only then can the directory serve the change
            # (CometBFT's "proof block" when empty blocks are off)
            changed = bool(block.txs or result.changes or result.reputation_changes)
            delay = min(self.empty_block_interval, PROOF_BLOCK_DELAY) if changed \
                else self.idle_delay()
            heapq.heappush(self._timers, _Timer(now + delay, next(self._seq), self.height))

    def idle_delay(self) -> float:
        """Seconds an idle chain waits before its next (empty) block: ``empty_block_interval``,
        or less when the state has something due by block time before that (module
        docstring): a listed record's expiry, the verification epoch's next leader attempt
        (``attempt_ms``), or the next epoch's earliest start (``epoch_ms``); never less than
        :data:`MIN_IDLE_DELAY` (a proposer whose clock is behind would otherwise make empty
        blocks back to back until its block time passes the deadline)."""
        state = self.state
        due = [state.next_expiry_ms()]
        params = state.genesis.verification
        if params is not None:
            ledger = state.ledger
            if ledger.started:
                attempt = ledger.attempt_at(state.time_ms, params)
                if attempt < MAX_ATTEMPTS:
                    due.append(ledger.start_ms + (attempt + 1) * params.attempt_ms)
            elif ledger.epoch > 1 and params.epoch_ms:
                due.append(ledger.start_ms + params.epoch_ms)
        upcoming = [d for d in due if d is not None and d > state.time_ms]
        delay = self.empty_block_interval
        if upcoming:
            wait = (min(upcoming) - self.unix_ms()) / 1000 + 0.001
            delay = min(delay, max(MIN_IDLE_DELAY, wait))
        return delay

    def _commit(self, block: Block, raw: bytes, commit: tuple[Vote, ...], new: AppState,
                result: BlockResult, actions: list[Action], *, synced: bool) -> None:
        h = block.header.height
        self.store.save_block(h, raw, self.wire.encode_commit(commit))
        self.history.add_block(block.header, commit, new, result)
        self.state = new
        self._snapshot(new)
        if synced:
            self.stats.blocks_synced += 1
        else:
            self.stats.heights_committed += 1
        actions.append(Committed(h, block, commit, result, synced))

    def _start_next(self, now: float, actions: list[Action]) -> None:
        if self._pending_start is None:
            return
        self._run([self._start_input(self._pending_start)], now, actions)


__all__ = [
    "EMPTY_BLOCK_INTERVAL",
    "MIN_IDLE_DELAY",
    "PROOF_BLOCK_DELAY",
    "SNAPSHOT_EVERY",
    "VALUE_CHECK_PENDING",
    "Action",
    "Committed",
    "RelayTx",
    "SendMessage",
    "Validator",
    "ValidatorStats",
    "WireCodec",
    "unix_ms",
]
