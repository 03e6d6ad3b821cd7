"""The registry's transactions: kinds, dataclasses, canonical encoding and decoding; pure.

Formats in :mod:`ps_p2p.registry` (the package docstring, "Transactions"). Here: every
transaction type (:data:`Tx`), :func:`encode_tx` / :func:`decode_tx` (strict: one encoding per
transaction, bounded by ``limits.max_tx_bytes``), :func:`tx_hash`, the signing bytes of a
DEREGISTER and of a VALSET_UPDATE, and :class:`ReputationEntry` (the committed fixed-point
reputation that a REPUTATION_UPDATE carries). Nothing here reads the state: the rules that do
are in :mod:`ps_p2p.registry.execution`. A new transaction type gets its kind, dataclass and
encoding here, its checks and effect there.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ps_p2p.consensus.encoding import Reader, lp, lps, u8, u32, u64
from ps_p2p.consensus.signing import (
    MAX_VALIDATORS,
    VALUE_ID_BYTES,
    check_chain_id,
    validator_set_hash,
)
from ps_p2p.consensus.types import Proposal, Validator, Vote, VoteType, value_id
from ps_p2p.errors import InvalidTransactionError, LocalProtocolError, RemoteProtocolError
from ps_p2p.records.canonical import record_signing_bytes
from ps_p2p.records.limits import (
    MAX_ADDR_BYTES,
    MAX_ADDRS,
    MAX_MODEL_ID_BYTES,
    MAX_ORGANIZATION_BYTES,
    ONION_KEY_BYTES,
    ORG_RECORD_DOMAIN,
    RECORD_DOMAIN,
    SIGNATURE_BYTES,
)
from ps_p2p.records.peer_ids import ED25519_PEER_ID_BYTES
from ps_p2p.records.types import Membership, NodeRecord, Role, Signer
from ps_p2p.verification.ledger import (
    MICRO,
    EpochReportTx,
    MissReportTx,
    MixReportTx,
    SeedCommitTx,
)
from ps_p2p.verification.reputation import (
    MAX_STRIKES,
    MAX_WINDOW,
    NODE_SUBJECT_PREFIX,
    ORG_SUBJECT_PREFIX,
    ReputationState,
    check_score,
)


TX_DOMAIN = b"planetserve/v1/registry-tx\x00"
DEREGISTER_DOMAIN = b"planetserve/v1/deregister\x00"
VALSET_UPDATE_DOMAIN = b"planetserve/v1/valset-update\x00"
#: Farthest effective height of a VALSET_UPDATE, in heights after the committed one (~28 h
#: of one-second blocks: room for operators to collect signatures, not an update parked for
#: months that nobody remembers).
MAX_VALSET_DELAY = 100_000
#: Most subjects one REPUTATION_UPDATE names (also bounded by ``limits.max_tx_bytes``).
MAX_REPUTATION_UPDATE_SUBJECTS = 1024
#: Longest canonical record bytes (4 addresses of 100 bytes, 64-byte strings, a membership
#: certificate: ~820 bytes).
MAX_RECORD_SIGNING_BYTES = 1024


class TxKind(enum.IntEnum):
    """The kind byte of a registry transaction (module docstring)."""

    REGISTER = 1
    DEREGISTER = 2
    SEED_COMMIT = 3
    EPOCH_REPORT = 4
    EVIDENCE = 5
    MISS_REPORT = 6
    PROPOSAL_EVIDENCE = 7
    VALSET_UPDATE = 8
    MIX_REPORT = 9


@dataclass(frozen=True)
class RegisterTx:
    """Register or renew ``record`` (signed by its own peer ID)."""

    record: NodeRecord

    @property
    def subject(self) -> bytes:
        return self.record.peer_id


@dataclass(frozen=True)
class DeregisterTx:
    """Remove ``peer_id``'s record; signed by ``peer_id`` at ``issued_at_ms`` (unix ms)."""

    peer_id: bytes
    issued_at_ms: int
    signature: bytes = b""

    @property
    def subject(self) -> bytes:
        return self.peer_id


@dataclass(frozen=True)
class EvidenceTx:
    """Two different signed votes of one validator for one (type, height, round)."""

    first: Vote
    second: Vote

    @property
    def subject(self) -> bytes:
        return self.first.validator


@dataclass(frozen=True)
class SignedProposalDigest:
    """A signed proposal without its value: what its signature covers (the value's SHA-256).

    Attributes:
        height, round, pol_round: the proposal's.
        value_hash: SHA-256 of the proposed value, 32 bytes.
        proposer: its signer's peer ID. signature: Ed25519, 64 bytes.
    """

    height: int
    round: int
    pol_round: int
    value_hash: bytes
    proposer: bytes
    signature: bytes

    @staticmethod
    def of(proposal: Proposal) -> SignedProposalDigest:
        """The digest of a signed proposal."""
        return SignedProposalDigest(proposal.height, proposal.round, proposal.pol_round,
                                    value_id(bytes(proposal.value)), proposal.proposer,
                                    proposal.signature)


@dataclass(frozen=True)
class ProposalEvidenceTx:
    """Two signed proposals of one proposer for one (height, round) with different values
    (``first.value_hash < second.value_hash``: one encoding per pair)."""

    first: SignedProposalDigest
    second: SignedProposalDigest

    @property
    def subject(self) -> bytes:
        return self.first.proposer

    @staticmethod
    def of(a: Proposal, b: Proposal) -> ProposalEvidenceTx:
        """The evidence of two conflicting signed proposals, in canonical order."""
        x, y = sorted((SignedProposalDigest.of(a), SignedProposalDigest.of(b)),
                      key=lambda d: d.value_hash)
        return ProposalEvidenceTx(x, y)


#: The mempool subject of every VALSET_UPDATE (so at most ``max_per_subject`` are pending).
VALSET_SUBJECT = b"valset-update"


@dataclass(frozen=True)
class ValsetUpdateTx:
    """Replace the validator set from ``effective_height`` on (module docstring).

    Attributes:
        validators: the new set, by strictly ascending address, as :func:`~ps_p2p.consensus.
            signing.check_validators` accepts it.
        effective_height: the first height the new set decides.
        signatures: (signer, signature) by strictly ascending signer: validators of the
            current set, each over :func:`valset_update_signing_bytes`.
    """

    validators: tuple[Validator, ...]
    effective_height: int
    signatures: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def subject(self) -> bytes:
        return VALSET_SUBJECT


def valset_update_signing_bytes(chain_id: str, current: Sequence[Validator],
                                new: Sequence[Validator], effective_height: int) -> bytes:
    """What a validator signs to approve a VALSET_UPDATE::

        b"planetserve/v1/valset-update\\x00" || str(chain_id) || bytes(current set hash)
        || u64(effective_height) || u32(#new) || (bytes(peer_id) || u64(power))*

    (the new set in the order given; :class:`ValsetUpdateTx` requires ascending addresses).

    Raises:
        LocalProtocolError: a bad chain ID or current set; struct.error for an out-of-range
            field (a caller's bug).
    """
    return (VALSET_UPDATE_DOMAIN + check_chain_id(chain_id) + lp(validator_set_hash(current))
            + u64(effective_height) + u32(len(new))
            + b"".join(lp(v.address) + u64(v.power) for v in new))


def sign_valset_update(identity: Signer, chain_id: str, current: Sequence[Validator],
                       new: Sequence[Validator], effective_height: int) -> tuple[bytes, bytes]:
    """One validator's approval of an update: ``(its peer ID, signature)``."""
    new = tuple(sorted(new, key=lambda v: v.address))
    return identity.peer_id, identity.sign(
        valset_update_signing_bytes(chain_id, current, new, effective_height))


def make_valset_update(new: Sequence[Validator], effective_height: int,
                       approvals: Iterable[tuple[bytes, bytes]]) -> ValsetUpdateTx:
    """A VALSET_UPDATE from the approvals of :func:`sign_valset_update` (sorted, deduplicated;
    whether they reach 2/3 is the execution's check)."""
    sigs = dict(approvals)
    return ValsetUpdateTx(tuple(sorted(new, key=lambda v: v.address)), effective_height,
                          tuple(sorted(sigs.items())))


def check_subject(subject: bytes, error: type[RemoteProtocolError] = InvalidTransactionError,
                  ) -> bytes:
    """``subject`` if it is a well-formed reputation subject
    (:func:`~ps_p2p.records.reputation_subject`): ``orgkey\\x00`` + an organization key's
    ``ED25519_PEER_ID_BYTES``-byte peer ID, or ``node\\x00`` + 1 to ``ED25519_PEER_ID_BYTES``
    bytes.

    Raises:
        error: anything else.
    """
    if not isinstance(subject, bytes):
        raise error(f"reputation subject is a {type(subject).__name__}, not bytes")
    if subject.startswith(ORG_SUBJECT_PREFIX):
        if len(subject) - len(ORG_SUBJECT_PREFIX) != ED25519_PEER_ID_BYTES:
            raise error("organization subject with a key of a wrong length")
        return subject
    if subject.startswith(NODE_SUBJECT_PREFIX):
        if not 1 <= len(subject) - len(NODE_SUBJECT_PREFIX) <= ED25519_PEER_ID_BYTES:
            raise error("node subject with a peer ID of a wrong length")
        return subject
    raise error("reputation subject is neither an organization's nor a node's")


def to_micro(value: float) -> int:
    """A value in [0, 1] as micro units: ``round(value * 10^6)`` (half to even).

    Raises:
        InvalidScoreError: not a finite number in [0, 1].
    """
    return round(check_score(value) * MICRO)


@dataclass(frozen=True)
class ReputationEntry:
    """One subject's committed reputation, in micro units (module docstring).

    Attributes:
        reputation: R, in [0, 10^6].
        window: the last (at most W) credibilities, oldest first, each in [0, 10^6].
        epochs: updates applied.
        strikes: convictions not yet forgiven (:mod:`~ps_p2p.verification.reputation`,
            "Probation"), at most 65535.
        clean: scored epochs in a row with C >= tau, a u32.
    """

    reputation: int
    window: tuple[int, ...] = ()
    epochs: int = 0
    strikes: int = 0
    clean: int = 0

    @property
    def value(self) -> float:
        """R as a float in [0, 1]."""
        return self.reputation / MICRO

    def state(self) -> ReputationState:
        """The float state the reputation rule works on (micro / 10^6, exact per value)."""
        return ReputationState(self.reputation / MICRO, tuple(v / MICRO for v in self.window),
                               self.epochs, self.strikes, self.clean)

    @staticmethod
    def from_state(state: ReputationState) -> ReputationEntry:
        """Quantize a state (each float to :func:`to_micro`).

        Raises:
            InvalidScoreError: a value not in [0, 1].
        """
        return ReputationEntry(to_micro(state.reputation),
                               tuple(to_micro(v) for v in state.window), state.epochs,
                               min(state.strikes, MAX_STRIKES), min(state.clean, 0xFFFFFFFF))

    def encode(self) -> bytes:
        """``u32(R) || u64(epochs) || u8(#window) || u32(value)* || u32(strikes) ||
        u32(clean)`` (module docstring)."""
        return (u32(self.reputation) + u64(self.epochs) + u8(len(self.window))
                + b"".join(u32(v) for v in self.window) + u32(self.strikes) + u32(self.clean))

    @staticmethod
    def read(r: Reader) -> ReputationEntry:
        """Read :meth:`encode`'s bytes strictly (values over 10^6 or a window over
        ``MAX_WINDOW`` refused with ``r``'s error)."""
        reputation = r.u32("reputation")
        epochs = r.u64("epochs")
        n = r.u8("window length")
        if n > MAX_WINDOW:
            raise r.fail(f"window of {n} values (max {MAX_WINDOW})")
        window = tuple(r.u32("window value") for _ in range(n))
        if reputation > MICRO or any(v > MICRO for v in window):
            raise r.fail("reputation value over 10^6 micro units")
        strikes = r.u32("strikes")
        if strikes > MAX_STRIKES:
            raise r.fail(f"{strikes} strikes (max {MAX_STRIKES})")
        clean = r.u32("clean epochs")
        return ReputationEntry(reputation, window, epochs, strikes, clean)


@dataclass(frozen=True)
class ReputationUpdateTx:
    """One epoch's credibilities by subject, as an executed EPOCH_REPORT (or a confirmed miss)
    gives them to :func:`apply_reputation_update` (not a transaction of its own).

    Attributes:
        epoch: the epoch number, >= 1; each update's must exceed the last applied.
        scores: (subject, C(T) in micro units) by strictly ascending subject, 1 to
            ``MAX_REPUTATION_UPDATE_SUBJECTS`` of them.
    """

    epoch: int
    scores: tuple[tuple[bytes, int], ...]

    @property
    def subject(self) -> bytes:
        return b""

    def check(self, error: type[RemoteProtocolError] = InvalidTransactionError) -> None:
        """The field rules above.

        Raises:
            error: a rule broken.
        """
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) \
                or not 1 <= self.epoch < 2**64:
            raise error(f"reputation update epoch {self.epoch!r} out of range")
        if not 1 <= len(self.scores) <= MAX_REPUTATION_UPDATE_SUBJECTS:
            raise error(f"reputation update of {len(self.scores)} subjects (1 to "
                        f"{MAX_REPUTATION_UPDATE_SUBJECTS})")
        last = b""
        for subject, micro in self.scores:
            check_subject(subject, error)
            if subject <= last:
                raise error("reputation update subjects not strictly ascending")
            last = subject
            if isinstance(micro, bool) or not isinstance(micro, int) or not 0 <= micro <= MICRO:
                raise error(f"credibility {micro!r} micro units not in [0, {MICRO}]")


Tx = (RegisterTx | DeregisterTx | EvidenceTx | SeedCommitTx | EpochReportTx | MissReportTx
      | ProposalEvidenceTx | ValsetUpdateTx | MixReportTx)


def deregister_signing_bytes(chain_id: str, peer_id: bytes, issued_at_ms: int) -> bytes:
    """What a node signs to leave the registry (module docstring)."""
    return DEREGISTER_DOMAIN + lps(chain_id) + lp(peer_id) + u64(issued_at_ms)


def sign_deregister(identity: Signer, chain_id: str, issued_at_ms: int) -> DeregisterTx:
    """A deregistration of ``identity``'s own record."""
    data = deregister_signing_bytes(chain_id, identity.peer_id, issued_at_ms)
    return DeregisterTx(identity.peer_id, issued_at_ms, identity.sign(data))


def _vote_bytes(vote: Vote) -> bytes:
    target = u8(0) if vote.value_id is None else u8(1) + lp(vote.value_id)
    return (u8(int(vote.type)) + u64(vote.height) + u32(vote.round) + target
            + lp(vote.validator) + lp(vote.signature))


def _proposal_digest_bytes(d: SignedProposalDigest) -> bytes:
    return (u64(d.height) + u32(d.round) + u32(d.pol_round + 1) + lp(d.value_hash)
            + lp(d.proposer) + lp(d.signature))


def _read_proposal_digest(r: Reader) -> SignedProposalDigest:
    height = r.u64("height")
    round_ = r.u32("round")
    pol = r.u32("POL round") - 1
    value_hash = r.lp("value hash", VALUE_ID_BYTES, exact=VALUE_ID_BYTES)
    proposer = r.lp("proposer", ED25519_PEER_ID_BYTES)
    signature = r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES)
    return SignedProposalDigest(height, round_, pol, value_hash, proposer, signature)


def _valset_body(tx: ValsetUpdateTx) -> bytes:
    return (u64(tx.effective_height) + u32(len(tx.validators))
            + b"".join(lp(v.address) + u64(v.power) for v in tx.validators)
            + u32(len(tx.signatures))
            + b"".join(lp(who) + lp(sig) for who, sig in tx.signatures))


def _read_valset(r: Reader) -> ValsetUpdateTx:
    effective = r.u64("effective height")
    n = r.u32("validator count")
    if not 1 <= n <= MAX_VALIDATORS:
        raise r.fail(f"{n} validators (1 to {MAX_VALIDATORS})")
    validators = tuple(Validator(r.lp("validator", ED25519_PEER_ID_BYTES), r.u64("power"))
                       for _ in range(n))
    m = r.u32("signature count")
    if m > MAX_VALIDATORS:
        raise r.fail(f"{m} signatures (max {MAX_VALIDATORS})")
    signatures = tuple((r.lp("signer", ED25519_PEER_ID_BYTES),
                        r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES))
                       for _ in range(m))
    return ValsetUpdateTx(validators, effective, signatures)


def encode_tx(tx: Tx) -> bytes:
    """The canonical bytes of a transaction (module docstring).

    Raises:
        LocalProtocolError: a field out of its range.
    """
    try:
        if isinstance(tx, RegisterTx):
            body = lp(record_signing_bytes(tx.record)) + lp(tx.record.signature)
            kind = TxKind.REGISTER
        elif isinstance(tx, DeregisterTx):
            body = lp(tx.peer_id) + u64(tx.issued_at_ms) + lp(tx.signature)
            kind = TxKind.DEREGISTER
        elif isinstance(tx, EvidenceTx):
            body = _vote_bytes(tx.first) + _vote_bytes(tx.second)
            kind = TxKind.EVIDENCE
        elif isinstance(tx, ProposalEvidenceTx):
            body = _proposal_digest_bytes(tx.first) + _proposal_digest_bytes(tx.second)
            kind = TxKind.PROPOSAL_EVIDENCE
        elif isinstance(tx, ValsetUpdateTx):
            body, kind = _valset_body(tx), TxKind.VALSET_UPDATE
        elif isinstance(tx, SeedCommitTx):
            body, kind = tx.body(), TxKind.SEED_COMMIT
        elif isinstance(tx, EpochReportTx):
            body, kind = tx.body(), TxKind.EPOCH_REPORT
        elif isinstance(tx, MissReportTx):
            body, kind = tx.body(), TxKind.MISS_REPORT
        elif isinstance(tx, MixReportTx):
            body, kind = tx.body(), TxKind.MIX_REPORT
        else:
            raise LocalProtocolError(f"not a transaction: {type(tx).__name__}")
        return TX_DOMAIN + u8(int(kind)) + body
    except LocalProtocolError:
        raise
    except Exception as exc:  # struct.error, TypeError
        raise LocalProtocolError(f"transaction field out of range: {exc}") from exc


def decode_record(signing_bytes: bytes, signature: bytes) -> NodeRecord:
    """Parse :func:`~ps_p2p.records.record_signing_bytes` back into a record, strictly.

    Checks the layout and the byte bounds of every field (the semantic checks and the
    signature are :func:`~ps_p2p.records.check_record`'s). Roles must be ascending and known.

    Raises:
        InvalidTransactionError: malformed, a field over its bound, or non-canonical.
    """
    r = Reader(signing_bytes, InvalidTransactionError, "node record")
    with_org = signing_bytes.startswith(ORG_RECORD_DOMAIN)
    r.prefix(ORG_RECORD_DOMAIN if with_org else RECORD_DOMAIN, "record domain")
    peer_id = r.lp("peer ID", ED25519_PEER_ID_BYTES)
    n_addrs = r.u32("address count")
    if n_addrs > MAX_ADDRS:
        raise r.fail(f"{n_addrs} addresses (max {MAX_ADDRS})")
    addrs = tuple(r.lp("address", MAX_ADDR_BYTES) for _ in range(n_addrs))
    n_roles = r.u32("role count")
    if n_roles > len(Role):
        raise r.fail(f"{n_roles} roles (max {len(Role)})")
    raw_roles = [r.u32("role") for _ in range(n_roles)]
    if raw_roles != sorted(set(raw_roles)):
        raise r.fail("roles not strictly ascending")
    try:
        roles = frozenset(Role(x) for x in raw_roles)
    except ValueError:
        raise r.fail(f"unknown role in {raw_roles}") from None
    onion_key = r.lp("onion key", ONION_KEY_BYTES)
    model_id = r.lps("model ID", MAX_MODEL_ID_BYTES)
    organization = r.lps("organization", MAX_ORGANIZATION_BYTES)
    membership = None
    if with_org:  # v2: the organization's certificate (an organization is never "" here)
        membership = Membership(r.lp("organization key", ED25519_PEER_ID_BYTES,
                                     exact=ED25519_PEER_ID_BYTES),
                                r.u64("membership expiry"),
                                r.lp("membership signature", SIGNATURE_BYTES,
                                     exact=SIGNATURE_BYTES))
    if organization and not with_org:
        raise r.fail(f"names organization {organization!r} without a membership certificate "
                     "of its organization key")
    if with_org and not organization:
        raise r.fail("carries a membership certificate but no organization")
    capacity = r.u64("capacity")
    issued = r.u64("issue time")
    expires = r.u64("expiry time")
    r.done()
    if len(signature) != SIGNATURE_BYTES:
        raise InvalidTransactionError(f"record signature of {len(signature)} bytes")
    return NodeRecord(peer_id, addrs, roles, onion_key, model_id, organization, capacity,
                      issued, expires, bytes(signature), membership)


def _decode_vote(r: Reader) -> Vote:
    raw_type = r.u8("vote type")
    try:
        vote_type = VoteType(raw_type)
    except ValueError:
        raise r.fail(f"unknown vote type {raw_type}") from None
    height = r.u64("height")
    round_ = r.u32("round")
    flag = r.u8("nil flag")
    if flag not in (0, 1):
        raise r.fail(f"nil flag {flag}")
    target = r.lp("value ID", VALUE_ID_BYTES, exact=VALUE_ID_BYTES) if flag else None
    validator = r.lp("validator", ED25519_PEER_ID_BYTES)
    signature = r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES)
    return Vote(vote_type, height, round_, target, validator, signature)


def decode_tx(data: bytes, max_tx_bytes: int) -> Tx:
    """Parse a transaction strictly (no signature or state check).

    Raises:
        InvalidTransactionError: over ``max_tx_bytes``, an unknown kind, or malformed.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise InvalidTransactionError("transaction is not bytes")
    if len(data) > max_tx_bytes:
        raise InvalidTransactionError(f"transaction of {len(data)} bytes (max {max_tx_bytes})")
    r = Reader(bytes(data), InvalidTransactionError, "transaction")
    r.prefix(TX_DOMAIN, "transaction domain")
    raw_kind = r.u8("kind")
    try:
        kind = TxKind(raw_kind)
    except ValueError:
        raise InvalidTransactionError(f"unknown transaction kind {raw_kind}") from None
    epoch_tx = {TxKind.SEED_COMMIT: SeedCommitTx, TxKind.EPOCH_REPORT: EpochReportTx,
                TxKind.MISS_REPORT: MissReportTx, TxKind.MIX_REPORT: MixReportTx}.get(kind)
    if epoch_tx is not None:
        decoded = epoch_tx.read(r)
        r.done()
        return decoded
    if kind == TxKind.REGISTER:
        record_bytes = r.lp("record", MAX_RECORD_SIGNING_BYTES)
        signature = r.lp("signature", SIGNATURE_BYTES)
        r.done()
        return RegisterTx(decode_record(record_bytes, signature))
    if kind == TxKind.DEREGISTER:
        peer_id = r.lp("peer ID", ED25519_PEER_ID_BYTES)
        issued = r.u64("issue time")
        signature = r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES)
        r.done()
        return DeregisterTx(peer_id, issued, signature)
    if kind == TxKind.PROPOSAL_EVIDENCE:
        a = _read_proposal_digest(r)
        b = _read_proposal_digest(r)
        r.done()
        return ProposalEvidenceTx(a, b)
    if kind == TxKind.VALSET_UPDATE:
        update = _read_valset(r)
        r.done()
        return update
    first = _decode_vote(r)
    second = _decode_vote(r)
    r.done()
    return EvidenceTx(first, second)


def tx_hash(tx: bytes) -> bytes:
    """SHA-256 of an encoded transaction (the mempool's dedup key), 32 bytes."""
    return hashlib.sha256(tx).digest()


__all__ = [
    "DEREGISTER_DOMAIN",
    "DeregisterTx",
    "EvidenceTx",
    "MAX_REPUTATION_UPDATE_SUBJECTS",
    "MAX_VALSET_DELAY",
    "ProposalEvidenceTx",
    "RegisterTx",
    "ReputationEntry",
    "ReputationUpdateTx",
    "SignedProposalDigest",
    "TX_DOMAIN",
    "Tx",
    "TxKind",
    "VALSET_SUBJECT",
    "VALSET_UPDATE_DOMAIN",
    "ValsetUpdateTx",
    "check_subject",
    "decode_record",
    "decode_tx",
    "deregister_signing_bytes",
    "encode_tx",
    "make_valset_update",
    "sign_deregister",
    "sign_valset_update",
    "to_micro",
    "tx_hash",
    "valset_update_signing_bytes",
]
