"""The registry's rules: checking transactions, admission, executing blocks; pure.

:func:`check_tx` (the mempool's gate: decode, verify against the state at ``now_ms``, admit),
:func:`execute_block` (a committed block on a state: expiry by block time, every transaction
checked again, results, the next validator set), :func:`validators_at` (a validator set
replayed from the genesis for a node), :func:`apply_reputation_update`. Rules and their
reasons are in :mod:`ps_p2p.registry` (the package docstring); transactions in
:mod:`ps_p2p.registry.tx`, the state in :mod:`ps_p2p.registry.state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ps_p2p.consensus.block import Block, block_id, validate_block
from ps_p2p.consensus.core import proposer_cycle
from ps_p2p.consensus.signing import (
    check_validators,
    has_quorum,
    proposal_digest_signing_bytes,
    validator_set_hash,
    verify_vote,
)
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import (
    AdmissionError,
    ExpiredError,
    InvalidBlockError,
    InvalidCommitError,
    InvalidMembershipError,
    InvalidSignatureError,
    InvalidTransactionError,
    LocalProtocolError,
    RemoteProtocolError,
    VerificationError,
)
from ps_p2p.records.limits import MAX_CLOCK_SKEW_MS
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.signatures import verify_signature
from ps_p2p.records.types import NodeRecord, Role, record_subject
from ps_p2p.records.validation import check_record
from ps_p2p.registry.state import AppState, _evidence_key, app_hash
from ps_p2p.registry.tx import (
    MAX_VALSET_DELAY,
    DeregisterTx,
    EvidenceTx,
    ProposalEvidenceTx,
    RegisterTx,
    ReputationEntry,
    ReputationUpdateTx,
    Tx,
    ValsetUpdateTx,
    decode_tx,
    deregister_signing_bytes,
    to_micro,
    tx_hash,
    valset_update_signing_bytes,
)
from ps_p2p.verification.ledger import (
    MICRO,
    EpochReportTx,
    MissReportTx,
    MixReportTx,
    SeedCommitTx,
    apply_epoch_report,
    apply_miss_report,
    apply_mix_report,
    apply_seed_commit,
    check_epoch_report,
    check_miss_report,
    check_mix_report,
    check_seed_commit,
    maybe_start,
    subject_scores,
)
from ps_p2p.verification.reputation import ReputationState, update as reputation_step


def validators_at(genesis_validators: Sequence[Validator], chain_id: str,
                  updates: Sequence[ValsetUpdateTx], height: int) -> tuple[Validator, ...]:
    """The validator set that decides ``height``, from the genesis set and the executed
    VALSET_UPDATEs in order (:attr:`AppState.valset_updates`): what a node needs to check a
    commit of a later height (a directory's, a synced block's) without the chain.

    Each update must be signed by more than 2/3 of the power of the set before it, over that
    set's hash (:func:`valset_update_signing_bytes`), and take effect after the one before;
    updates effective after ``height`` are checked too (a chain must hold as a whole). Trust:
    as the commits themselves, more than 2/3 of each set's power; validators sign at most one
    update per set (docs/consensus.md), else a server could show one never executed. Cost:
    one Ed25519 check per signature (~55 us), O(updates x validators).

    Raises:
        InvalidCommitError: an update not signed by more than 2/3 of the set before it, a
            malformed one, or effective heights not increasing.
    """
    current = tuple(genesis_validators)
    at, last_effective = current, 0
    for update in updates:
        state = _ChainStub(chain_id, current)
        try:
            _check_valset_signatures(update, state)
            check_validators(update.validators)
        except (InvalidTransactionError, LocalProtocolError) as exc:
            raise InvalidCommitError(f"validator-set chain: {exc}") from None
        if update.effective_height <= last_effective:
            raise InvalidCommitError("validator-set chain: effective heights not increasing")
        last_effective = update.effective_height
        current = tuple(update.validators)
        if update.effective_height <= height:
            at = current
    return at


@dataclass(frozen=True)
class _ChainStub:
    """What :func:`_check_valset_signatures` reads of a state."""

    chain_id: str
    validators: tuple[Validator, ...]


def apply_reputation_update(state: AppState, update: ReputationUpdateTx,
                            ) -> dict[bytes, ReputationEntry]:
    """Apply one epoch's validated credibilities to ``state`` in place (module docstring).

    For the epoch service, once the committee has validated the update; it mutates the state
    being executed (a copy, as in :func:`execute_block`), whose app hash the caller then
    recomputes. All-or-nothing: every check passes before anything changes. Each subject gets
    one step of :func:`~ps_p2p.verification.reputation.update` with the genesis parameters
    from its entry (or ``initial`` when never scored), quantized back to micro units.

    Returns:
        subject -> its new entry, for every subject of ``update``.

    Raises:
        InvalidTransactionError: a malformed update (:meth:`ReputationUpdateTx.check`) or an
            epoch not after ``state.reputation_epoch``.
        AdmissionError: more new subjects than ``policy.max_records`` leaves room for.
    """
    update.check(InvalidTransactionError)
    if update.epoch <= state.reputation_epoch:
        raise InvalidTransactionError(
            f"reputation update of epoch {update.epoch}, not after {state.reputation_epoch}"
        )
    new_subjects = sum(1 for subject, _ in update.scores if subject not in state.reputations)
    if len(state.reputations) + new_subjects > state.policy.max_records:
        raise AdmissionError(
            f"{new_subjects} new reputation subject(s) with {len(state.reputations)} of "
            f"{state.policy.max_records} held"
        )
    params = state.genesis.reputation
    changes: dict[bytes, ReputationEntry] = {}
    for subject, micro in update.scores:
        held = state.reputations.get(subject)
        before = held.state() if held is not None else ReputationState.fresh(params)
        changes[subject] = ReputationEntry.from_state(
            reputation_step(before, micro / MICRO, params)
        )
    state.reputations.update(changes)
    state.reputation_epoch = update.epoch
    state._reputation_root = None
    return changes


def _verify_tx(tx: Tx, state: AppState, now_ms: int) -> object:
    """Signature, field and time checks that need no admission decision; returns what
    :func:`_apply` needs of them (an EPOCH_REPORT's scores by serving node)."""
    if isinstance(tx, (SeedCommitTx, EpochReportTx, MissReportTx, MixReportTx)):
        return _verify_epoch_tx(tx, state, now_ms)
    if isinstance(tx, RegisterTx):
        record = tx.record
        try:
            check_record(record, now_ms)
        except InvalidMembershipError as exc:
            raise InvalidTransactionError(str(exc)) from None
        except InvalidSignatureError:
            raise InvalidTransactionError(
                f"record of {peer_label(record.peer_id)} is not signed by that peer ID "
                "(a node may only register itself)"
            ) from None
        except ExpiredError as exc:
            raise InvalidTransactionError(str(exc)) from None
        except RemoteProtocolError as exc:
            raise InvalidTransactionError(f"record refused: {exc}") from None
        if Role.VERIFIER in record.roles and not state.is_validator(record.peer_id):
            raise InvalidTransactionError(
                f"{peer_label(record.peer_id)} is not a validator and cannot list the verifier role"
            )
        return
    if isinstance(tx, DeregisterTx):
        try:
            verify_signature(
                tx.peer_id,
                deregister_signing_bytes(state.chain_id, tx.peer_id, tx.issued_at_ms),
                tx.signature,
            )
        except RemoteProtocolError:
            raise InvalidTransactionError(
                f"deregistration of {peer_label(tx.peer_id)} is not signed by that peer ID"
            ) from None
        if tx.issued_at_ms > now_ms + MAX_CLOCK_SKEW_MS:
            raise InvalidTransactionError("deregistration issued in the future")
        return
    if isinstance(tx, ProposalEvidenceTx):
        _verify_proposal_evidence(tx, state)
        return
    if isinstance(tx, ValsetUpdateTx):
        _verify_valset_update(tx, state)
        return
    a, b = tx.first, tx.second
    if (a.validator != b.validator or a.type != b.type or a.height != b.height
            or a.round != b.round):
        raise InvalidTransactionError(
            "evidence votes differ in validator, type, height or round"
        )
    if a.value_id == b.value_id:
        raise InvalidTransactionError("evidence votes are not conflicting (same value ID)")
    if not state.is_validator(a.validator):
        raise InvalidTransactionError(f"evidence against {peer_label(a.validator)}, not a validator")
    if a.height > state.height + 1:
        raise InvalidTransactionError(f"evidence for future height {a.height}")
    for vote in (a, b):
        try:
            verify_vote(state.chain_id, vote)
        except RemoteProtocolError as exc:
            raise InvalidTransactionError(f"evidence vote: {exc}") from None


def _verify_proposal_evidence(tx: ProposalEvidenceTx, state: AppState) -> None:
    a, b = tx.first, tx.second
    if a.proposer != b.proposer or a.height != b.height or a.round != b.round:
        raise InvalidTransactionError(
            "proposal evidence differs in proposer, height or round")
    if not a.value_hash < b.value_hash:
        raise InvalidTransactionError(
            "proposal evidence not conflicting, or its value hashes not ascending")
    if not state.is_validator(a.proposer):
        raise InvalidTransactionError(
            f"proposal evidence against {peer_label(a.proposer)}, not a validator")
    if a.height > state.height + 1:
        raise InvalidTransactionError(f"proposal evidence for future height {a.height}")
    for d in (a, b):
        try:
            data = proposal_digest_signing_bytes(state.chain_id, d.height, d.round,
                                                 d.pol_round, d.value_hash)
            verify_signature(d.proposer, data, d.signature)
        except RemoteProtocolError as exc:  # InvalidSignatureError included
            raise InvalidTransactionError(f"evidence proposal: {exc}") from None


def _verify_valset_update(tx: ValsetUpdateTx, state: AppState) -> None:
    new = tx.validators
    try:
        check_validators(new)
        proposer_cycle(new)  # the core must be able to rotate over it
    except (LocalProtocolError, ValueError) as exc:
        raise InvalidTransactionError(f"validator-set update: {exc}") from None
    if any(x.address >= y.address for x, y in zip(new, new[1:])):
        raise InvalidTransactionError("validator-set update: addresses not ascending")
    if validator_set_hash(new) == validator_set_hash(state.validators):
        raise InvalidTransactionError("validator-set update to the current set")
    if not state.height + 1 < tx.effective_height <= state.height + MAX_VALSET_DELAY:
        raise InvalidTransactionError(
            f"validator-set update effective at {tx.effective_height}: must be in "
            f"({state.height + 1}, {state.height + MAX_VALSET_DELAY}]")
    _check_valset_signatures(tx, state)


def _check_valset_signatures(tx: ValsetUpdateTx, state: AppState | _ChainStub) -> None:
    """More than 2/3 of ``state.validators``' power signed ``tx`` (ascending signers)."""
    power = {v.address: v.power for v in state.validators}
    data = valset_update_signing_bytes(state.chain_id, state.validators, tx.validators,
                                       tx.effective_height)
    signed, last = 0, b""
    for who, signature in tx.signatures:
        if who <= last:
            raise InvalidTransactionError("validator-set update signers not ascending")
        last = who
        if who not in power:
            raise InvalidTransactionError(
                f"validator-set update signed by {peer_label(who)}, not a validator")
        try:
            verify_signature(who, data, signature)
        except RemoteProtocolError:
            raise InvalidTransactionError(
                f"validator-set update: bad signature of {peer_label(who)}") from None
        signed += power[who]
    total = sum(power.values())
    if not has_quorum(signed, total):
        raise InvalidTransactionError(
            f"validator-set update signed by power {signed} of {total}: more than 2/3 needed")


def _verify_epoch_tx(tx: SeedCommitTx | EpochReportTx | MissReportTx | MixReportTx,
                     state: AppState, now_ms: int) -> object:
    params = state.genesis.verification
    if params is None:
        raise InvalidTransactionError(
            f"{type(tx).__name__}: this chain's genesis has no verification section")
    validators = state.validators
    if isinstance(tx, SeedCommitTx):
        check_seed_commit(tx, state.ledger, state.chain_id, validators)
        return None
    if isinstance(tx, MissReportTx):
        check_miss_report(tx, state.ledger, state.chain_id, validators)
        return None
    if isinstance(tx, MixReportTx):
        check_mix_report(tx, state.ledger, state.chain_id, validators)
        return None
    registry = [r.peer_id for r in state.records.records() if Role.MODEL in r.roles]
    try:
        return check_epoch_report(tx, state.ledger, state.chain_id, params, now_ms, registry)
    except (ValueError, VerificationError) as exc:  # a peer's report never raises past here
        raise InvalidTransactionError(f"epoch report refused: {exc}") from None


def verification_model_nodes(state: AppState) -> list[tuple[bytes, bytes]]:
    """(peer ID, reputation subject) of the listed model nodes of the verified model."""
    params = state.genesis.verification
    if params is None:
        return []
    return [(r.peer_id, record_subject(r))
            for r in state.records.records()
            if Role.MODEL in r.roles and r.model_id == params.model_id]


def _admit(tx: Tx, state: AppState, new_in_block: int | None) -> None:
    """The state-dependent rules and the admission caps (module docstring)."""
    policy = state.policy
    if isinstance(tx, RegisterTx):
        record = tx.record
        held = state.records.get(record.peer_id)
        left_at = state.departed.get(record.peer_id)
        if left_at is not None and record.issued_at_ms <= left_at:
            raise InvalidTransactionError(
                f"record of {peer_label(record.peer_id)} issued at {record.issued_at_ms} is not "
                f"newer than its deregistration ({left_at})"
            )
        if held is not None:
            if held == record:
                raise InvalidTransactionError(
                    f"record of {peer_label(record.peer_id)} already listed"
                )
            if record.issued_at_ms <= held.issued_at_ms:
                raise InvalidTransactionError(
                    f"record of {peer_label(record.peer_id)} issued at {record.issued_at_ms} "
                    f"is not newer than the listed one ({held.issued_at_ms})"
                )
        else:
            if len(state.records) >= policy.max_records:
                raise AdmissionError(f"registry full ({policy.max_records} records)")
            if new_in_block is not None and new_in_block >= policy.max_registrations_per_block:
                raise AdmissionError(
                    f"{policy.max_registrations_per_block} new registrations already in this "
                    "block (admission cap)"
                )
        # a silent record counts in no cap: its renewal is a newcomer there (issue 20)
        old_nets = state._networks_of(held) if held is not None and not state.is_silent(held) \
            else frozenset()
        for net in state._networks_of(record) - old_nets:
            cap = policy.max_records_without_address if net == "" else \
                policy.max_records_per_network
            if state.live_network_count(net) >= cap:
                where = "without address" if net == "" else f"in network {net}"
                raise AdmissionError(f"{cap} records already listed {where} (admission cap)")
        org = record.membership.org_key if record.membership is not None else b""
        held_org = held.membership.org_key if held is not None and held.membership else b""
        new_org = org and held_org != org
        if new_org and state.organization_count(org) >= policy.max_records_per_organization:
            raise AdmissionError(
                f"{policy.max_records_per_organization} records already listed for "
                f"organization {record.organization!r} ({peer_label(org)}) (admission cap)"
            )
    elif isinstance(tx, DeregisterTx):
        held = state.records.get(tx.peer_id)
        if held is None:
            raise InvalidTransactionError(f"{peer_label(tx.peer_id)} is not listed")
        if tx.issued_at_ms < held.issued_at_ms:
            raise InvalidTransactionError(
                f"deregistration of {peer_label(tx.peer_id)} is older than its listed record"
            )

    elif isinstance(tx, ValsetUpdateTx):
        if state.pending_valset is not None:
            raise InvalidTransactionError(
                f"a validator-set update is already pending (effective at "
                f"{state.pending_valset[0]})")
    elif isinstance(tx, (EvidenceTx, ProposalEvidenceTx)):
        if _evidence_key(tx.first) in state.evidence:
            raise InvalidTransactionError("evidence already recorded")
        offender = tx.first.validator if isinstance(tx, EvidenceTx) else tx.first.proposer
        if offender in state.excluded:
            # a Byzantine validator that equivocates at every height would otherwise fill the
            # evidence store (then evidence against another one is refused) and, since a
            # pending transaction makes a block at once, run the chain flat out
            raise InvalidTransactionError(
                f"{peer_label(offender)} is already excluded by committed evidence; more "
                "changes nothing until a VALSET_UPDATE rotates it")
        if len(state.evidence) >= policy.max_evidence:
            raise AdmissionError(f"evidence store full ({policy.max_evidence})")


def check_tx(tx: bytes, state: AppState, now_ms: int) -> Tx:
    """Mempool admission: would ``tx`` apply to ``state`` at ``now_ms`` (unix ms)?

    Cheapest first: size and layout, then signatures and fields, then the state rules and the
    admission caps (module docstring). The per-block cap on new registrations is applied when
    a block is built and executed. The same checks run again at execution with the block's
    time.

    Returns:
        the decoded transaction.

    Raises:
        InvalidTransactionError: malformed, over ``limits.max_tx_bytes``, a reserved or unknown
            kind, a bad signature (a record or deregistration not signed by the peer ID it
            names), an expired or future record, a record not newer than the listed one, an
            unlisted peer to deregister, evidence that is not a valid equivocation.
        AdmissionError: a cap of the admission policy is reached.
    """
    decoded = decode_tx(tx, state.genesis.limits.max_tx_bytes)
    _verify_tx(decoded, state, now_ms)
    _admit(decoded, state, None)
    return decoded


@dataclass(frozen=True)
class TxResult:
    """The outcome of one transaction of a block: ``error`` None when applied."""

    tx_hash: bytes
    error: InvalidTransactionError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class BlockResult:
    """What executing a block did.

    Attributes:
        height: the block's.
        tx_results: one per transaction, in block order.
        changes: peer ID -> its record after the block (None: removed), for every peer whose
            record was added, renewed, expired or removed by this block (not in a
            deterministic order: sort by peer ID).
        expired: peer IDs removed because their record expired by the block's time.
        app_hash: of the state after the block.
        reputation_changes: subject -> its entry after the block (None: forgotten), for
            every subject whose reputation changed (empty until the epoch service applies
            updates, :func:`apply_reputation_update`).
    """

    height: int
    tx_results: tuple[TxResult, ...]
    changes: dict[bytes, NodeRecord | None]
    expired: tuple[bytes, ...]
    app_hash: bytes
    reputation_changes: dict[bytes, ReputationEntry | None] = field(default_factory=dict)


def _apply(tx: Tx, state: AppState, checked: object,
           reputation_changes: dict[bytes, ReputationEntry | None]) -> None:
    if isinstance(tx, RegisterTx):
        old = state._put(tx.record)
        if old is not None and tx.record.expires_at_ms < old.expires_at_ms:
            # a shortened record (a node's withdrawal, ps_p2p.node.Node.withdraw) must not
            # let the longer one it replaced be replayed once it expires: a tombstone
            state._depart(tx.record.peer_id, tx.record.issued_at_ms)
    elif isinstance(tx, (SeedCommitTx, EpochReportTx, MissReportTx, MixReportTx)):
        _apply_epoch_tx(tx, state, checked, reputation_changes)

    elif isinstance(tx, DeregisterTx):
        state._remove(tx.peer_id)
        state._depart(tx.peer_id, tx.issued_at_ms)
    elif isinstance(tx, EvidenceTx):
        state.evidence[_evidence_key(tx.first)] = (tx.first.validator, tx.first.height)
        state._registry_aux = None
    elif isinstance(tx, ProposalEvidenceTx):
        state.evidence[_evidence_key(tx.first)] = (tx.first.proposer, tx.first.height)
        state._registry_aux = None
    elif isinstance(tx, ValsetUpdateTx):
        state.pending_valset = (tx.effective_height, tx.validators)
        state.valset_updates = state.valset_updates + (tx,)
        state._registry_aux = None


def _apply_epoch_tx(tx: SeedCommitTx | EpochReportTx | MissReportTx | MixReportTx,
                    state: AppState, checked: object,
                    reputation_changes: dict[bytes, ReputationEntry | None]) -> None:
    """All or nothing: the ledger is changed on a copy, kept only when nothing failed (the
    state's ledger is never mutated in place: states share it after :meth:`AppState.copy`)."""
    params = state.genesis.verification
    assert params is not None
    ledger = state.ledger.copy()
    scores: dict[bytes, int] = {}
    if isinstance(tx, SeedCommitTx):
        apply_seed_commit(tx, ledger)
    elif isinstance(tx, MixReportTx):
        apply_mix_report(tx, ledger)
    elif isinstance(tx, EpochReportTx):
        assert isinstance(checked, dict)
        scores = subject_scores(checked, ledger)
        apply_epoch_report(tx, ledger, params, checked, to_micro(state.genesis.reputation.tau),
                           state.validators)
    elif apply_miss_report(tx, ledger, state.validators):
        scores = {ledger.missed_subjects[(tx.epoch, tx.model_node)]: 0}
    if scores:  # may raise (no room for a new subject): then nothing changed
        changes = apply_reputation_update(state, ReputationUpdateTx(
            max(state.reputation_epoch + 1, getattr(tx, "epoch", 0)),
            tuple(sorted(scores.items()))))
        reputation_changes.update(changes)
    state.ledger = ledger
    state._registry_aux = None


def execute_block(state: AppState, block: Block) -> tuple[AppState, BlockResult]:
    """Execute a committed block on a copy of ``state``; ``state`` is left unchanged.

    First records with ``expires_at_ms <= block time`` are removed (by block time, never a
    local clock), then each transaction is checked again (:func:`check_tx` with
    ``now_ms = block time``, plus the per-block cap on new registrations) and applied, or
    recorded as failed (a failed transaction does not invalidate the block; every validator
    fails it the same way). Cost: O(records) pointer copies + O(expired + transactions).

    Returns:
        ``(new_state, result)``: the state at ``block.header.height`` with its app hash.

    Raises:
        InvalidBlockError: the header does not follow ``state`` (chain ID, height, previous
            block ID, app hash, time not after the previous block) or the block is over the
            genesis limits.
    """
    h = block.header
    validate_block(block, state.tip(), limits=state.genesis.limits, now_ms=h.time_ms,
                   timely=False)
    if not state.is_validator(h.proposer):
        raise InvalidBlockError(f"block {h.height} proposed by a non-validator")
    new = state.copy()
    changes: dict[bytes, NodeRecord | None] = {}
    expired = new._expire(h.time_ms)
    for peer in expired:
        changes[peer] = None
    results = []
    new_peers = 0
    reputation_changes: dict[bytes, ReputationEntry | None] = {}
    for raw in block.txs:
        try:
            tx = decode_tx(raw, state.genesis.limits.max_tx_bytes)
            checked = _verify_tx(tx, new, h.time_ms)
            _admit(tx, new, new_peers)
            if isinstance(tx, RegisterTx) and tx.record.peer_id not in new.records:
                new_peers += 1
            _apply(tx, new, checked, reputation_changes)
        except InvalidTransactionError as exc:
            results.append(TxResult(tx_hash(raw), exc))
            continue
        if isinstance(tx, (RegisterTx, DeregisterTx)):
            changes[tx.subject] = new.records.get(tx.subject)
        results.append(TxResult(tx_hash(raw)))
    new.height = h.height
    new.block_id = block_id(h)
    new.time_ms = h.time_ms
    params = state.genesis.verification
    if params is not None and not new.ledger.started:
        nodes = verification_model_nodes(new)
        if nodes:
            ledger = new.ledger.copy()
            if maybe_start(ledger, new.validators, nodes, params, new.block_id,
                           h.time_ms, excluded=new.excluded):
                new.ledger, new._registry_aux = ledger, None
    if new.pending_valset is not None and new.pending_valset[0] == h.height + 1:
        new._set_validators(new.pending_valset[1])  # block h + 1 is the new set's
        new.pending_valset = None
    new.app_hash = app_hash(new)
    return new, BlockResult(h.height, tuple(results), changes, tuple(expired), new.app_hash,
                            reputation_changes)


__all__ = [
    "BlockResult",
    "TxResult",
    "apply_reputation_update",
    "check_tx",
    "execute_block",
    "validators_at",
    "verification_model_nodes",
]
