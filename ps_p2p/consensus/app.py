"""The registry as a replicated state machine: transactions, admission, execution, app hash; pure.

The committee's application (PlanetServe sec. 3.4): the set of node records every verifier keeps
identical by executing the same blocks (:mod:`ps_p2p.consensus.block`) in the same order. Nothing
here reads a clock: mempool admission takes the validator's ``now_ms`` (unix ms), execution uses
only the block's time (the proposer's timestamp, which every validator checked to be monotonic
and within its drift, :func:`~ps_p2p.consensus.block.validate_block`).

Transactions (canonical bytes; ``bytes``/``str``/``u*`` as in :mod:`ps_p2p.records.canonical`)::

    tx         = b"planetserve/v1/registry-tx\\x00" || u8(kind) || body
    REGISTER   (1): bytes(record_signing_bytes(record)) || bytes(record signature)
                    (v1 bytes, or v2 with an organization's membership certificate)
    DEREGISTER (2): bytes(peer_id) || u64(issued_at_ms) || bytes(signature over
                    b"planetserve/v1/deregister\\x00" || str(chain_id) || bytes(peer_id)
                    || u64(issued_at_ms))
    SEED_COMMIT (3), EPOCH_REPORT (4), MISS_REPORT (6): the verification epochs, bodies
                    and rules in :mod:`ps_p2p.verification.ledger` (refused when the genesis
                    has no ``verification`` section)
    EVIDENCE   (5): vote(first) || vote(second), two conflicting signed votes of one validator,
                    vote = u8(type) || u64(height) || u32(round) || u8(0) | u8(1) || bytes(id)
                    || bytes(validator) || bytes(signature)
    PROPOSAL_EVIDENCE (7): proposal(first) || proposal(second), two signed proposals of one
                    proposer for one (height, round) with different values, proposal =
                    u64(height) || u32(round) || u32(pol_round + 1) || bytes(SHA-256(value))
                    || bytes(proposer) || bytes(signature), value hashes strictly ascending
                    (the signature covers only the hash: :func:`~ps_p2p.consensus.signing.
                    proposal_digest_signing_bytes`)
    VALSET_UPDATE (8): u64(effective_height) || u32(#new) || (bytes(peer_id) || u64(power))*
                    || u32(#signatures) || (bytes(signer) || bytes(signature))*, new set and
                    signers by strictly ascending peer ID; each signature over
                    :func:`valset_update_signing_bytes`

A node may only register or deregister itself: the record (or the deregistration) is signed by
the peer ID it names, so anyone may relay it but nobody can forge it. A REGISTER of a peer
already listed is a renewal: it must be issued later than the listed record and replaces it. A
DEREGISTER must be issued no earlier than the listed record, so an old deregistration cannot be
replayed against a newer registration. Only members of the validator set may list
:attr:`~ps_p2p.records.Role.VERIFIER`. EVIDENCE (Algorithm 1's equivocation) is recorded once per
(validator, type, height, round), PROPOSAL_EVIDENCE once per (proposer, height, round).

Consequences of evidence (docs/consensus.md "Evidence and validator-set changes"): a validator
of the current set with committed evidence against it is *excluded* (:attr:`AppState.excluded`):
it still votes (its power still counts; removing it is the operator's decision), but the
proposer rotation skips it (:class:`~ps_p2p.consensus.types.StartHeight` ``excluded``) and it
is no eligible leader of an epoch that starts later (:func:`~ps_p2p.verification.ledger.
maybe_start`). It stays excluded until a VALSET_UPDATE removes it (the operator rotates the
verifier to a new key).

Validator-set changes (VALSET_UPDATE): validators holding more than 2/3 of the current set's
power sign (chain ID, current set hash, effective height, new set); the update is checked
against the current set (:attr:`AppState.validators`), waits in :attr:`AppState.pending_valset`
(one at a time) and takes effect after the block of height ``effective_height - 1``: block
``effective_height`` is decided, and its commit verified, by the new set, on every validator
alike. The effective height must be after the block that carries the update and at most
:data:`MAX_VALSET_DELAY` heights ahead; the signed set hash makes an executed update
unreplayable (the set it replaces is gone), and an update to the current set is refused.

Admission against sybils (:class:`AdmissionPolicy`, committed in the :class:`Genesis`). The
threat (paper sec. 4): identities are free, and every extra identity an adversary registers as a
user is one more relay that honest users may pick for their 3-hop paths, so the share of
malicious relays, and with it the chance that a path or k of a user's n paths are compromised,
grows with the number of sybils it can list. The registry cannot tell people apart, but it can
make identities cost what they really cost an adversary: addresses and organizations. A verifier
refuses (before its mempool, :func:`check_tx`, and again at execution):

* more than ``max_records_per_network`` records whose multiaddrs fall in one source network: an
  IPv4 /24 or an IPv6 /48 (the usual allocation to one site), or for DNS multiaddrs the last two
  labels of the name;
* more than ``max_records_without_address`` records listing no IP or DNS address at all;
* more than ``max_records_per_organization`` records of one organization (its organization
  key: a name is a label anyone may write);
* more than ``max_registrations_per_block`` new peers in one block (a burst of sybils must
  spread over time, so operators can see it coming), and more than ``max_records`` in all.

Organizations (issue 16). A record names an organization only with the membership certificate
of its organization key (:class:`~ps_p2p.records.Membership`, checked with the record's own
signature by :func:`~ps_p2p.records.check_record`), and the organization's reputation subject is
that key: a sybil that writes "acme" without acme's certificate is refused, and with its own key
it is another organization with its own reputation. Names are not unique (binding a name to the
first key that registers it would let anyone squat the name of an organization not listed yet
and lock it out); users tell organizations apart by key.

Known limits: addresses are claimed, not verified (a deterministic rule cannot dial), so an
adversary may list addresses in a victim's network to use up its slots; it pays one identity
that it must keep renewing per slot, and the caps are per-network, so it cannot exhaust the
network as a whole. Everything is deterministic: the same state and transaction give the same
answer on every verifier. What a sybil cannot claim, the address its connection comes from, is
limited outside consensus by each verifier (:mod:`ps_p2p.consensus.sources`), and the
:class:`Mempool` keeps new identities out of the room of listed peers' renewals.

Reputations (PlanetServe sec. 3.4; the rule is :mod:`ps_p2p.verification.reputation`). The
state keeps, per reputation subject (:func:`~ps_p2p.records.reputation_subject`: an
organization key, or a node without one), a :class:`ReputationEntry`, and the last epoch applied.
Everything committed is an integer: R and the window's credibilities are fixed-point *micro
units* (u32, 10^6 = 1.0), so the bytes hashed are the state itself on every platform. An update
(:func:`apply_reputation_update`) converts at the boundary: micro / 10^6 as a double, one step of
:func:`~ps_p2p.verification.reputation.update` (IEEE-754 double +, *, /: the same bits
everywhere), and back with ``round(x * 10^6)`` (round half to even). R is thus quantized to
10^-6 after each epoch (an error below 5e-7 per epoch, shrunk by alpha each epoch after). The
only write path is an EPOCH_REPORT that passed every check of :mod:`ps_p2p.verification.ledger`
(the epoch's leader, its revealed seed, the plan, the signed answers; the scores are checked by
each validator's reference model before it prevotes) or a miss confirmed by more than 1/3 of
the power; the changes are reported in :attr:`BlockResult.reputation_changes`. At most
``policy.max_records`` subjects are held; an update naming more new ones is refused whole.

The state's app hash (what block h+1 carries, and what a directory's commit covers)::

    app hash      = SHA-256(b"planetserve/v1/app-state\\x00" || str(chain_id) || u64(height)
                            || u32(#records) || bytes(records root) || bytes(aux root))
    records root  = :meth:`~ps_p2p.records.RecordSet.root` (two-level, 256 buckets)
    aux root      = SHA-256(b"planetserve/v2/app-aux-root\\x00" || bytes(registry aux)
                            || bytes(reputation root))
    registry aux  = SHA-256(b"planetserve/v1/app-aux\\x00" || u32(#evidence) || key*
                            || u32(#departed) || (bytes(peer_id) || u64(deregistered_at_ms))*
                            || SHA-256(epoch ledger bytes)   (:mod:`ps_p2p.verification.ledger`)
                            [|| bytes(validator set hash) || u64(pending effective height)
                             || bytes(pending set hash)])
                    (the bracket only once the set differs from the genesis' or an update is
                    pending, so chains that never change it keep their hashes; a set hash is
                    :func:`~ps_p2p.consensus.signing.validator_set_hash`, an absent pending
                    update 0 and b"")
    reputation root = SHA-256(b"planetserve/v1/reputation-root\\x00" || u64(last epoch)
                            || u32(#subjects) || (bytes(subject) || entry)*)
    entry         = u32(R micro) || u64(epochs) || u8(#window) || u32(credibility micro)*

(evidence keys, departed peer IDs and subjects ascending). The directory serves the registry
aux as a digest and the reputation entries themselves, so a node recomputes the reputation root
and no verifier can lie about a reputation (:mod:`ps_p2p.consensus.directory`). *Departed* peers are tombstones: a DEREGISTER
leaves (peer ID, its ``issued_at_ms``), and a REGISTER of that peer issued no later is refused,
so nobody can replay a node's older record (directories are public) to list it again after it
left (a newer record of the peer is still taken). A renewal that *shortens* the listed record
(expires before it: the short-lived record a node sends when a verifier refused its
deregistration) leaves the same tombstone at its own ``issued_at_ms``, or the longer record it
replaced would be taken again once the short one expired. A tombstone is dropped once no
record issued before it can still be valid (block time past ``issued_at_ms +
MAX_RECORD_LIFETIME_MS``, indexed by a heap); at most ``max_records`` are held, the oldest
going first. The aux root
re-hashes every tombstone when one changes (O(tombstones), bounded by ``max_records``). Cost
after a block of k changes: the k changed buckets (~1/256 of the
set each), 8 KiB of bucket digests, and the evidence keys when evidence changed (bounded by
``max_evidence``). :func:`execute_block` copies the state first (O(records) pointer copies,
~14 ms at 100,000 records) so the old state stays valid for the directory being served.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import heapq
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ps_p2p.consensus.block import (
    ZERO_ID,
    Block,
    BlockLimits,
    ChainTip,
    block_id,
    validate_block,
)
from ps_p2p.consensus.encoding import Reader, lp, lps, u8, u32, u64
from ps_p2p.consensus.core import proposer_cycle
from ps_p2p.consensus.signing import (
    MAX_VALIDATORS,
    PROPOSAL_TYPE,
    VALUE_ID_BYTES,
    check_chain_id,
    check_validators,
    has_quorum,
    proposal_digest_signing_bytes,
    validator_set_hash,
    verify_vote,
)
from ps_p2p.consensus.types import Proposal, Validator, Vote, VoteType, value_id
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
from ps_p2p.networks import network_key
from ps_p2p.records.canonical import record_signing_bytes
from ps_p2p.records.limits import (
    MAX_ADDR_BYTES,
    MAX_ADDRS,
    MAX_CLOCK_SKEW_MS,
    MAX_MODEL_ID_BYTES,
    MAX_ORGANIZATION_BYTES,
    MAX_RECORD_LIFETIME_MS,
    MAX_RECORDS,
    ONION_KEY_BYTES,
    ORG_RECORD_DOMAIN,
    RECORD_DOMAIN,
    SIGNATURE_BYTES,
)
from ps_p2p.records.multiaddrs import check_multiaddr
from ps_p2p.records.peer_ids import ED25519_PEER_ID_BYTES, peer_label
from ps_p2p.records.recordset import RecordSet
from ps_p2p.records.signatures import verify_signature
from ps_p2p.records.types import Membership, NodeRecord, Role, Signer, record_subject
from ps_p2p.records.validation import check_record
from ps_p2p.verification.ledger import (
    MICRO,
    EpochLedger,
    EpochReportTx,
    MissReportTx,
    SeedCommitTx,
    VerificationParams,
    apply_epoch_report,
    apply_miss_report,
    apply_seed_commit,
    check_epoch_report,
    check_miss_report,
    check_seed_commit,
    maybe_start,
    subject_scores,
)
from ps_p2p.verification.reputation import (
    MAX_WINDOW,
    NODE_SUBJECT_PREFIX,
    ORG_SUBJECT_PREFIX,
    ReputationParams,
    ReputationState,
    check_score,
)
from ps_p2p.verification.reputation import update as reputation_step

TX_DOMAIN = b"planetserve/v1/registry-tx\x00"
DEREGISTER_DOMAIN = b"planetserve/v1/deregister\x00"
APP_STATE_DOMAIN = b"planetserve/v1/app-state\x00"
APP_AUX_DOMAIN = b"planetserve/v1/app-aux\x00"
EVIDENCE_KEY_DOMAIN = b"planetserve/v1/evidence-key\x00"
APP_AUX_ROOT_DOMAIN = b"planetserve/v2/app-aux-root\x00"
REPUTATION_ROOT_DOMAIN = b"planetserve/v1/reputation-root\x00"
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


# ---------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class AdmissionPolicy:
    """Committed caps against sybils (module docstring: threat and rules).

    Attributes:
        max_records: records in the registry.
        max_records_per_network: records with an address in one IPv4 /24, IPv6 /48 or DNS
            domain (last two labels).
        max_records_without_address: records with no IP or DNS address.
        max_records_per_organization: records of one organization key (records without
            an organization are not counted).
        max_registrations_per_block: new peers (not renewals) in one block.
        max_evidence: equivocation evidence entries kept.
        ipv4_prefix_bits, ipv6_prefix_bits: the source network of an address.
    """

    max_records: int = MAX_RECORDS
    max_records_per_network: int = 32
    max_records_without_address: int = 256
    max_records_per_organization: int = 1024
    max_registrations_per_block: int = 64
    max_evidence: int = 10_000
    ipv4_prefix_bits: int = 24
    ipv6_prefix_bits: int = 48

    def __post_init__(self) -> None:
        for name in ("max_records", "max_records_per_network", "max_records_without_address",
                     "max_records_per_organization", "max_registrations_per_block",
                     "max_evidence"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise LocalProtocolError(f"admission policy {name} must be an integer >= 1")
        if not 8 <= self.ipv4_prefix_bits <= 32 or not 16 <= self.ipv6_prefix_bits <= 128:
            raise LocalProtocolError("network prefix bits out of range")


@dataclass(frozen=True)
class Genesis:
    """What every node of one chain starts from (the genesis file).

    Attributes:
        chain_id: non-empty, at most 64 UTF-8 bytes; part of every signature.
        time_ms: genesis time (unix ms); block 1 must be later.
        validators: the committee (N = 3f+1), Ed25519 peer IDs and voting powers.
        policy: the admission policy; limits: block bounds.
        reputation: the reputation rule's parameters (:class:`ReputationParams`).
        verification: the challenge epochs' parameters
            (:class:`~ps_p2p.verification.ledger.VerificationParams`); None: no epochs (their
            transactions are refused).
    """

    chain_id: str
    time_ms: int
    validators: tuple[Validator, ...]
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    limits: BlockLimits = field(default_factory=BlockLimits)
    reputation: ReputationParams = field(default_factory=ReputationParams)
    verification: VerificationParams | None = None

    def __post_init__(self) -> None:
        check_validators(self.validators)
        check_chain_id(self.chain_id)


# ---------------------------------------------------------------------------------- transactions


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
    """

    reputation: int
    window: tuple[int, ...] = ()
    epochs: int = 0

    @property
    def value(self) -> float:
        """R as a float in [0, 1]."""
        return self.reputation / MICRO

    def state(self) -> ReputationState:
        """The float state the reputation rule works on (micro / 10^6, exact per value)."""
        return ReputationState(self.reputation / MICRO, tuple(v / MICRO for v in self.window),
                               self.epochs)

    @staticmethod
    def from_state(state: ReputationState) -> ReputationEntry:
        """Quantize a state (each float to :func:`to_micro`).

        Raises:
            InvalidScoreError: a value not in [0, 1].
        """
        return ReputationEntry(to_micro(state.reputation),
                               tuple(to_micro(v) for v in state.window), state.epochs)

    def encode(self) -> bytes:
        """``u32(R) || u64(epochs) || u8(#window) || u32(value)*`` (module docstring)."""
        return (u32(self.reputation) + u64(self.epochs) + u8(len(self.window))
                + b"".join(u32(v) for v in self.window))

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
        return ReputationEntry(reputation, window, epochs)


def reputation_root(reputations: dict[bytes, ReputationEntry], epoch: int) -> bytes:
    """The reputation root (module docstring), 32 bytes; O(subjects)."""
    h = hashlib.sha256(REPUTATION_ROOT_DOMAIN + u64(epoch) + u32(len(reputations)))
    for subject in sorted(reputations):
        h.update(lp(subject) + reputations[subject].encode())
    return h.digest()


def aux_root_of(registry_aux: bytes, reputations_root: bytes) -> bytes:
    """The aux root from the registry aux digest and the reputation root (module docstring)."""
    return hashlib.sha256(APP_AUX_ROOT_DOMAIN + lp(registry_aux) + lp(reputations_root)).digest()


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
      | ProposalEvidenceTx | ValsetUpdateTx)


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
                TxKind.MISS_REPORT: MissReportTx}.get(kind)
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


# ---------------------------------------------------------------------------------- networks


def source_networks(record: NodeRecord, policy: AdmissionPolicy) -> frozenset[str]:
    """The source networks a record's multiaddrs fall in (module docstring).

    ``"ip4:a.b.c.0/24"``, ``"ip6:2001:db8::/48"``, ``"dns:example.com"``; an address of another
    kind (e.g. a circuit relay) counts in none. The empty set means "no address".

    Raises:
        RemoteProtocolError: an address that is not a canonical multiaddr.
    """
    out = set()
    for addr in record.addrs:
        parts = check_multiaddr(addr).split("/")
        if len(parts) < 3:
            continue
        proto, value = parts[1], parts[2]
        if proto == "ip4":
            out.add(network_key(ipaddress.IPv4Address(value), policy.ipv4_prefix_bits))
        elif proto == "ip6":  # an IPv4-mapped address stays IPv6 here: these keys are committed
            out.add(network_key(ipaddress.IPv6Address(value),
                                ipv6_prefix_bits=policy.ipv6_prefix_bits))
        elif proto in ("dns", "dns4", "dns6", "dnsaddr"):
            labels = value.lower().rstrip(".").split(".")
            out.add("dns:" + ".".join(labels[-2:]))
    return frozenset(out)


# ---------------------------------------------------------------------------------- state


def app_state_hash(
    chain_id: str, height: int, record_count: int, records_root: bytes, aux_root: bytes,
) -> bytes:
    """The app hash (module docstring) from its parts, 32 bytes; what a directory view
    recomputes from the records it holds."""
    return hashlib.sha256(
        APP_STATE_DOMAIN + lps(chain_id) + u64(height) + u32(record_count)
        + lp(records_root) + lp(aux_root)
    ).digest()


def _evidence_key(vote: Vote | SignedProposalDigest) -> bytes:
    """One key per (validator, message type, height, round); a proposal's type byte is
    :data:`~ps_p2p.consensus.signing.PROPOSAL_TYPE` (never a vote type)."""
    if isinstance(vote, SignedProposalDigest):
        who, kind = vote.proposer, PROPOSAL_TYPE
    else:
        who, kind = vote.validator, int(vote.type)
    return hashlib.sha256(
        EVIDENCE_KEY_DOMAIN + lp(who) + u8(kind) + u64(vote.height) + u32(vote.round)
    ).digest()


class AppState:
    """The registry state after a height (use :func:`genesis_state`, :func:`execute_block`).

    Attributes:
        genesis: the chain's genesis (chain ID, validators, policy, limits).
        height: the last executed height (0: genesis).
        block_id: that block's ID (:data:`ZERO_ID` at genesis).
        time_ms: that block's time (the genesis time at height 0), unix ms.
        app_hash: :func:`app_hash` of this state (block ``height + 1`` carries it).
        records: the listed records (a :class:`RecordSet`, one per peer ID).
        evidence: evidence key -> (validator, height) of recorded equivocations (votes and
            proposals).
        validators: the validator set that decides height ``height + 1`` (the genesis' until
            a VALSET_UPDATE takes effect).
        pending_valset: (effective height, new set) of an executed VALSET_UPDATE not yet in
            effect, or None.
        valset_updates: every executed VALSET_UPDATE, in order (what :func:`validators_at`
            needs to follow the set from the genesis; a few KiB each, and only more than 2/3
            of the power can add one).
        departed: peer ID -> ``issued_at_ms`` of its deregistration (tombstones, module
            docstring).
        reputations: reputation subject -> :class:`ReputationEntry` (module docstring).
        reputation_epoch: the last epoch whose reputation update was applied (0: none).

    Not thread-safe; never mutate a state another holder uses: :func:`execute_block` returns a
    new one.
    """

    def __init__(self, genesis: Genesis) -> None:
        self.genesis = genesis
        self.height = 0
        self.block_id = ZERO_ID
        self.time_ms = genesis.time_ms
        self.records = RecordSet()
        self.evidence: dict[bytes, tuple[bytes, int]] = {}
        self.departed: dict[bytes, int] = {}
        self._departed_heap: list[tuple[int, bytes]] = []  # (issued_at_ms, peer), lazy
        self.validators: tuple[Validator, ...] = tuple(genesis.validators)
        self.pending_valset: tuple[int, tuple[Validator, ...]] | None = None
        self.valset_updates: tuple[ValsetUpdateTx, ...] = ()
        # the current set's addresses: replaced, never mutated (states share it)
        self._validators = frozenset(v.address for v in genesis.validators)
        self._expiry: list[tuple[int, bytes]] = []  # heap of (expires_at_ms, peer ID), lazy
        self._networks: collections.Counter[str] = collections.Counter()
        self._orgs: collections.Counter[bytes] = collections.Counter()  # by organization key
        self.reputations: dict[bytes, ReputationEntry] = {}
        self.reputation_epoch = 0
        #: the verification epochs (:class:`~ps_p2p.verification.ledger.EpochLedger`): shared
        #: with the state it was copied from, so replaced, never mutated
        self.ledger = EpochLedger()
        self._registry_aux: bytes | None = None
        self._reputation_root: bytes | None = None
        self.app_hash = b""

    @property
    def chain_id(self) -> str:
        return self.genesis.chain_id

    @property
    def policy(self) -> AdmissionPolicy:
        return self.genesis.policy

    def tip(self) -> ChainTip:
        """What the next block must follow."""
        return ChainTip(self.chain_id, self.height, self.block_id, self.time_ms, self.app_hash)

    def is_validator(self, peer_id: bytes) -> bool:
        """Whether ``peer_id`` is in the current set (:attr:`validators`)."""
        return peer_id in self._validators

    @property
    def excluded(self) -> frozenset[bytes]:
        """Validators of the current set with committed evidence against them: never
        proposer, never an epoch's leader (module docstring); O(evidence)."""
        return frozenset(who for who, _ in self.evidence.values() if who in self._validators)

    def _set_validators(self, validators: tuple[Validator, ...]) -> None:
        self.validators = validators
        self._validators = frozenset(v.address for v in validators)
        self._registry_aux = None

    def network_count(self, network: str) -> int:
        """Records listed with an address in ``network`` (a :func:`source_networks` key;
        ``""``: records without address)."""
        return self._networks[network]

    def organization_count(self, org_key: bytes) -> int:
        """Records listed with a membership of the organization key ``org_key``."""
        return self._orgs[org_key]

    def next_expiry_ms(self) -> int | None:
        """A lower bound of the block time at which the next listed record expires (None: no
        record); the bound is exact unless that record was renewed or removed since (then the
        next block past it drops the stale entry). For a proposer that waits for a block on an
        idle chain (issue 17), so an expired record leaves at once, not an interval later."""
        return self._expiry[0][0] if self._expiry else None

    def aux_root(self) -> bytes:
        """The aux root (module docstring): :func:`aux_root_of` the registry aux and the
        reputation root."""
        return aux_root_of(self.registry_aux(), self.reputation_root())

    def reputation_root(self) -> bytes:
        """:func:`reputation_root` of this state, cached until a reputation changes."""
        if self._reputation_root is None:
            self._reputation_root = reputation_root(self.reputations, self.reputation_epoch)
        return self._reputation_root

    def reputation(self, subject: bytes) -> ReputationEntry | None:
        """The committed entry of ``subject``, or None when never scored."""
        return self.reputations.get(subject)

    def registry_aux(self) -> bytes:
        """The registry aux digest (module docstring), cached until evidence or tombstones
        change."""
        if self._registry_aux is None:
            keys = sorted(self.evidence)
            departed = b"".join(lp(peer) + u64(self.departed[peer])
                                for peer in sorted(self.departed))
            valset = b""
            if self.validators != tuple(self.genesis.validators) or self.pending_valset:
                at, pending = self.pending_valset or (0, ())
                valset = (lp(validator_set_hash(self.validators)) + u64(at)
                          + lp(validator_set_hash(pending) if pending else b""))
            self._registry_aux = hashlib.sha256(
                APP_AUX_DOMAIN + u32(len(keys)) + b"".join(keys)
                + u32(len(self.departed)) + departed + self.ledger.digest() + valset
            ).digest()
        return self._registry_aux

    def copy(self) -> AppState:
        """A copy sharing the (immutable) records: O(records) pointer copies."""
        new = AppState.__new__(AppState)
        new.__dict__.update(self.__dict__)
        new.records = self.records.copy()
        new.evidence = dict(self.evidence)
        new.departed = dict(self.departed)
        new.reputations = dict(self.reputations)
        new._departed_heap = list(self._departed_heap)
        new._expiry = list(self._expiry)
        new._networks = collections.Counter(self._networks)
        new._orgs = collections.Counter(self._orgs)
        return new

    # ---- mutation (execution only)

    def _networks_of(self, record: NodeRecord) -> frozenset[str]:
        nets = source_networks(record, self.policy)
        return nets if nets else frozenset({""})

    def _put(self, record: NodeRecord) -> NodeRecord | None:
        old = self.records.put(record)
        if old is not None:
            self._uncount(old)
        self._networks.update(self._networks_of(record))
        if record.membership is not None:
            self._orgs[record.membership.org_key] += 1
        heapq.heappush(self._expiry, (record.expires_at_ms, record.peer_id))
        if len(self._expiry) > 2 * len(self.records) + 64:
            self._expiry = [(r.expires_at_ms, r.peer_id) for r in self.records.records()]
            heapq.heapify(self._expiry)
        return old

    def _remove(self, peer_id: bytes) -> NodeRecord | None:
        old = self.records.remove(peer_id)
        if old is not None:
            self._uncount(old)
        return old

    def _uncount(self, record: NodeRecord) -> None:
        for net in self._networks_of(record):
            self._networks[net] -= 1
            if not self._networks[net]:
                del self._networks[net]
        if record.membership is not None:
            org = record.membership.org_key
            self._orgs[org] -= 1
            if not self._orgs[org]:
                del self._orgs[org]

    def _depart(self, peer: bytes, issued_at_ms: int) -> None:
        """Leave a tombstone; at ``max_records`` tombstones the oldest goes first (a sybil
        that deregisters many identities cannot block honest deregistrations)."""
        self.departed[peer] = issued_at_ms
        heapq.heappush(self._departed_heap, (issued_at_ms, peer))
        while len(self.departed) > self.policy.max_records:
            issued, old = heapq.heappop(self._departed_heap)
            if self.departed.get(old) == issued:
                del self.departed[old]
        if len(self._departed_heap) > 2 * len(self.departed) + 64:
            self._departed_heap = [(t, p) for p, t in self.departed.items()]
            heapq.heapify(self._departed_heap)
        self._registry_aux = None

    def _expire(self, time_ms: int) -> list[bytes]:
        """Remove records with ``expires_at_ms <= time_ms``, and tombstones no record issued
        before them can outlive; amortized O(expired log n) (+ O(tombstones) when some are
        held)."""
        heap = self._departed_heap
        while heap and heap[0][0] + MAX_RECORD_LIFETIME_MS < time_ms:
            issued, peer = heapq.heappop(heap)
            if self.departed.get(peer) == issued:  # else superseded: a stale heap entry
                del self.departed[peer]
                self._registry_aux = None
        removed = []
        heap = self._expiry
        while heap and heap[0][0] <= time_ms:
            until, peer = heapq.heappop(heap)
            record = self.records.get(peer)
            if record is None or record.expires_at_ms != until:
                continue  # renewed or removed since: a stale heap entry
            self._remove(peer)
            removed.append(peer)
        return removed


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


def genesis_state(genesis: Genesis) -> AppState:
    """The state at height 0: no records, app hash computed."""
    state = AppState(genesis)
    state.app_hash = app_hash(state)
    return state


def app_hash(state: AppState) -> bytes:
    """The app hash of ``state`` (module docstring): 32 bytes, O(changed buckets)."""
    return app_state_hash(state.chain_id, state.height, len(state.records),
                          state.records.root(), state.aux_root())


# ---------------------------------------------------------------------------------- checking


def _verify_tx(tx: Tx, state: AppState, now_ms: int) -> object:
    """Signature, field and time checks that need no admission decision; returns what
    :func:`_apply` needs of them (an EPOCH_REPORT's scores by serving node)."""
    if isinstance(tx, (SeedCommitTx, EpochReportTx, MissReportTx)):
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


def _verify_epoch_tx(tx: SeedCommitTx | EpochReportTx | MissReportTx, state: AppState,
                     now_ms: int) -> object:
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
        old_nets = state._networks_of(held) if held is not None else frozenset()
        for net in state._networks_of(record) - old_nets:
            cap = policy.max_records_without_address if net == "" else \
                policy.max_records_per_network
            if state.network_count(net) >= cap:
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


# ---------------------------------------------------------------------------------- execution


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
    elif isinstance(tx, (SeedCommitTx, EpochReportTx, MissReportTx)):
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


def _apply_epoch_tx(tx: SeedCommitTx | EpochReportTx | MissReportTx, state: AppState,
                    checked: object,
                    reputation_changes: dict[bytes, ReputationEntry | None]) -> None:
    """All or nothing: the ledger is changed on a copy, kept only when nothing failed (the
    state's ledger is never mutated in place: states share it after :meth:`AppState.copy`)."""
    params = state.genesis.verification
    assert params is not None
    ledger = state.ledger.copy()
    scores: dict[bytes, int] = {}
    if isinstance(tx, SeedCommitTx):
        apply_seed_commit(tx, ledger)
    elif isinstance(tx, EpochReportTx):
        assert isinstance(checked, dict)
        scores = subject_scores(checked, ledger)
        apply_epoch_report(tx, ledger, params, checked, to_micro(state.genesis.reputation.tau))
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


# ---------------------------------------------------------------------------------- mempool


class Lane(enum.IntEnum):
    """The two parts of the :class:`Mempool`: what a new identity may take, and what it may not."""

    #: renewals and deregistrations of listed peers, evidence, the epochs' transactions
    LISTED = 0
    #: REGISTER of a peer the state does not list (a new identity)
    NEW = 1


@dataclass
class _Pending:
    tx: bytes
    decoded: Tx
    lane: Lane
    #: the claimed source networks of a NEW registration (:func:`source_networks`; ``""``:
    #: none), counted against the per-network caps with the listed records
    nets: frozenset[str] = frozenset()


class Mempool:
    """Transactions waiting for a block, in two lanes, deduplicated, bounded (sans-I/O).

    Why two lanes (issue 16): identities are free, so REGISTERs of fresh peers can arrive
    faster than blocks take them (``max_registrations_per_block``). In one FIFO pool they
    kept it full, every honest renewal was refused as "mempool full", and after one record
    lifetime the directory listed no honest node. Now:

    * lane :attr:`Lane.NEW`, REGISTERs of peers the state does not list: at most ``max_new``
      transactions and ``max_new_bytes`` bytes, and per claimed source network (an IPv4 /24,
      IPv6 /48 or DNS domain of the record's addresses, :func:`source_networks`; records
      without address count as one network) no more pending than the committed cap still
      leaves room for (``max_records_per_network`` or ``max_records_without_address`` minus
      the records listed there): a pending registration that could never be listed is refused
      at once instead of holding room.
    * lane :attr:`Lane.LISTED`, everything else: renewals and deregistrations of listed peers,
      EVIDENCE, SEED_COMMIT, EPOCH_REPORT, MISS_REPORT. A new identity never takes room here:
      a full NEW lane refuses only new registrations. At most one REGISTER and one DEREGISTER
      per peer are pending (a newer one, by ``issued_at_ms``, takes the older one's place; an
      older or equal one is refused), and ``max_per_subject`` of any other kind about one
      subject (the accused validator, the reporting validator). So this lane holds at most
      two transactions per listed peer plus the committee's own, and its bounds ``max_txs``
      / ``max_bytes`` are sized to the registry (``MAX_RECORDS``), not to a flood.

    :meth:`reap` takes the LISTED lane first (oldest first), then the NEW lane within
    ``max_registrations_per_block``. Each transaction passes :func:`check_tx` before it
    enters; after each block :meth:`update` drops the committed ones and re-checks the rest
    against the new state without their signatures (checked on entry; the bytes cannot have
    changed): expiry and the state rules, moving a REGISTER to the lane its peer now belongs
    in.

    Args:
        max_txs: LISTED lane, default ``2 * MAX_RECORDS + 4096``. max_bytes: LISTED lane,
            default 256 MiB (~1.2 KiB per REGISTER at most).
        max_per_subject: default 4. max_new: NEW lane, default 1024 (16 blocks of the default
            ``max_registrations_per_block``). max_new_bytes: NEW lane, default 2 MiB.
    """

    def __init__(self, *, max_txs: int = 2 * MAX_RECORDS + 4096,
                 max_bytes: int = 256 * 1024 * 1024, max_per_subject: int = 4,
                 max_new: int = 1024, max_new_bytes: int = 2 * 1024 * 1024) -> None:
        if min(max_txs, max_bytes, max_per_subject, max_new, max_new_bytes) < 1:
            raise LocalProtocolError("mempool bounds must be >= 1")
        self.max_txs = max_txs
        self.max_bytes = max_bytes
        self.max_per_subject = max_per_subject
        self.max_new = max_new
        self.max_new_bytes = max_new_bytes
        self._lanes: tuple[collections.OrderedDict[bytes, _Pending], ...] = (
            collections.OrderedDict(), collections.OrderedDict())
        self._lane_bytes = [0, 0]
        self._subjects: collections.Counter[bytes] = collections.Counter()
        #: (kind, peer ID) -> key of its pending REGISTER / DEREGISTER (one each)
        self._slots: dict[tuple[int, bytes], bytes] = {}
        #: claimed source network -> pending NEW registrations listing it
        self._new_nets: collections.Counter[str] = collections.Counter()

    @property
    def bytes(self) -> int:
        """Bytes pending in both lanes."""
        return sum(self._lane_bytes)

    def __len__(self) -> int:
        return len(self._lanes[Lane.LISTED]) + len(self._lanes[Lane.NEW])

    def __contains__(self, tx_hash_: bytes) -> bool:
        return any(tx_hash_ in lane for lane in self._lanes)

    def lane_size(self, lane: Lane) -> int:
        """Transactions pending in ``lane``."""
        return len(self._lanes[lane])

    def pending_in_network(self, network: str) -> int:
        """NEW registrations pending whose record claims an address in ``network`` (a
        :func:`source_networks` key; ``""``: records without address)."""
        return self._new_nets[network]

    def txs(self) -> list[bytes]:
        """The pending transactions: the LISTED lane, then the NEW lane, oldest first."""
        return [p.tx for lane in self._lanes for p in lane.values()]

    @staticmethod
    def lane_of(tx: Tx, state: AppState) -> Lane:
        """:attr:`Lane.NEW` for a REGISTER of a peer ``state`` does not list, else LISTED."""
        if isinstance(tx, RegisterTx) and tx.record.peer_id not in state.records:
            return Lane.NEW
        return Lane.LISTED

    def add(self, tx: bytes, state: AppState, now_ms: int) -> bool:
        """Check ``tx`` (:func:`check_tx`) and queue it in its lane (class docstring).

        Cheapest first: decoding, the lane's room and the per-peer slot, then the signature
        and the state rules.

        Returns:
            True if added (possibly in place of an older REGISTER / DEREGISTER of the same
            peer), False if the same transaction is already pending.

        Raises:
            InvalidTransactionError: as :func:`check_tx`.
            AdmissionError: as :func:`check_tx`; its lane is full (count or bytes); a record
                or deregistration of the peer as new or newer is already pending;
                ``max_per_subject`` reached; the claimed network's cap is taken by listed and
                pending registrations (NEW lane).
        """
        raw = bytes(tx)
        key = tx_hash(raw)
        if key in self:
            return False
        decoded = decode_tx(raw, state.genesis.limits.max_tx_bytes)
        lane = self.lane_of(decoded, state)
        replaced = self._slot_check(decoded)
        old = self._find(replaced) if replaced is not None else None
        nets = self._room_check(decoded, lane, len(raw), state, old)
        _verify_tx(decoded, state, now_ms)
        _admit(decoded, state, None)
        if replaced is not None:
            self._drop(replaced)
        self._insert(key, _Pending(raw, decoded, lane, nets))
        return True

    def _slot_check(self, decoded: Tx) -> bytes | None:
        """The key of the pending transaction ``decoded`` replaces, if any."""
        subject = decoded.subject
        if isinstance(decoded, (RegisterTx, DeregisterTx)):
            kind = TxKind.REGISTER if isinstance(decoded, RegisterTx) else TxKind.DEREGISTER
            held = self._slots.get((kind, subject))
            if held is None:
                return None
            held_tx = self._find(held).decoded
            assert isinstance(held_tx, (RegisterTx, DeregisterTx))
            if _issued_at(decoded) <= _issued_at(held_tx):
                raise AdmissionError(
                    f"a {kind.name} of {peer_label(subject)} as new or newer is already pending"
                )
            return held
        if self._subjects[subject] >= self.max_per_subject:
            raise AdmissionError(
                f"{self.max_per_subject} transactions about {peer_label(subject)} already pending"
            )
        return None

    def _room_check(self, decoded: Tx, lane: Lane, size: int, state: AppState,
                    old: _Pending | None) -> frozenset[str]:
        """Refuse when ``lane`` has no room (``old`` leaves it); the NEW entry's networks."""
        freed, freed_bytes = (1, len(old.tx)) if old is not None and old.lane == lane else (0, 0)
        count = len(self._lanes[lane]) - freed
        used = self._lane_bytes[lane] - freed_bytes
        if lane == Lane.LISTED:
            if count >= self.max_txs or used + size > self.max_bytes:
                raise AdmissionError(f"mempool full ({count} transactions, {used} bytes)")
            return frozenset()
        if count >= self.max_new or used + size > self.max_new_bytes:
            raise AdmissionError(
                f"mempool full for new registrations ({count} pending, {used} bytes; renewals "
                "of listed peers still get in)"
            )
        assert isinstance(decoded, RegisterTx)
        try:
            nets = state._networks_of(decoded.record)
        except RemoteProtocolError as exc:
            raise InvalidTransactionError(f"record refused: {exc}") from None
        policy = state.policy
        held = old.nets if old is not None and old.lane == Lane.NEW else frozenset()
        for net in nets - held:
            cap = policy.max_records_without_address if net == "" else \
                policy.max_records_per_network
            if state.network_count(net) + self._new_nets[net] >= cap:
                where = "without address" if net == "" else f"in network {net}"
                raise AdmissionError(
                    f"{cap} records already listed or pending {where} (admission cap)")
        return nets

    def _find(self, key: bytes) -> _Pending:
        for lane in self._lanes:
            if key in lane:
                return lane[key]
        raise KeyError(key)

    def _insert(self, key: bytes, p: _Pending) -> None:
        self._lanes[p.lane][key] = p
        self._lane_bytes[p.lane] += len(p.tx)
        d = p.decoded
        if isinstance(d, (RegisterTx, DeregisterTx)):
            kind = TxKind.REGISTER if isinstance(d, RegisterTx) else TxKind.DEREGISTER
            self._slots[(kind, d.subject)] = key
        else:
            self._subjects[d.subject] += 1
        self._new_nets.update(p.nets)

    def _drop(self, key: bytes) -> _Pending:
        for lane in self._lanes:
            p = lane.pop(key, None)
            if p is not None:
                break
        else:
            raise KeyError(key)
        self._lane_bytes[p.lane] -= len(p.tx)
        d = p.decoded
        if isinstance(d, (RegisterTx, DeregisterTx)):
            kind = TxKind.REGISTER if isinstance(d, RegisterTx) else TxKind.DEREGISTER
            del self._slots[(kind, d.subject)]
        else:
            self._subjects[d.subject] -= 1
            if not self._subjects[d.subject]:
                del self._subjects[d.subject]
        for net in p.nets:
            self._new_nets[net] -= 1
            if not self._new_nets[net]:
                del self._new_nets[net]
        return p

    def reap(self, state: AppState, limits: BlockLimits | None = None) -> list[bytes]:
        """The pending transactions that fit one block on ``state`` (a proposer's choice):
        the LISTED lane first, then the NEW lane, oldest first in each; within ``limits``
        (default: the genesis') in count and bytes, and at most
        ``max_registrations_per_block`` registrations of new peers."""
        limits = limits or state.genesis.limits
        budget = limits.max_block_bytes - 1024  # the header and framing
        out: list[bytes] = []
        new_peers: set[bytes] = set()
        for lane in self._lanes:
            for p in lane.values():
                if len(out) >= limits.max_txs:
                    return out
                tx = p.tx
                if len(tx) + 4 > budget:
                    continue
                subject = p.decoded.subject
                if isinstance(p.decoded, RegisterTx) and subject not in state.records:
                    if subject not in new_peers and \
                            len(new_peers) >= state.policy.max_registrations_per_block:
                        continue
                    new_peers.add(subject)
                out.append(tx)
                budget -= len(tx) + 4
        return out

    def update(self, state: AppState, committed: Iterable[bytes], now_ms: int) -> int:
        """After a block: drop ``committed`` transactions, re-check the rest on ``state``
        (expiry and state rules; signatures were checked on entry), and move a REGISTER whose
        peer was listed or removed meanwhile to its lane (dropped when that lane has no room).
        Cost: O(pending), no signature check but an evidence's or an epoch transaction's.

        Returns:
            how many were dropped by the re-check (no longer valid, over a cap or no room).
        """
        for tx in committed:
            key = tx_hash(bytes(tx))
            if key in self:
                self._drop(key)
        dropped = 0
        for lane in self._lanes:
            for key, p in list(lane.items()):
                try:
                    _recheck(p.decoded, state, now_ms)
                    want = self.lane_of(p.decoded, state)
                    if want != p.lane:
                        self._drop(key)
                        nets = self._room_check(p.decoded, want, len(p.tx), state, None)
                        self._insert(key, _Pending(p.tx, p.decoded, want, nets))
                except InvalidTransactionError:
                    if key in self:
                        self._drop(key)
                    dropped += 1
        return dropped


def _issued_at(tx: RegisterTx | DeregisterTx) -> int:
    return tx.record.issued_at_ms if isinstance(tx, RegisterTx) else tx.issued_at_ms


def _recheck(tx: Tx, state: AppState, now_ms: int) -> None:
    """What may have changed for a pending transaction since :func:`check_tx` took it: the
    state and the time. REGISTER and DEREGISTER skip their signature (checked on entry);
    evidence and the epoch transactions are checked whole (their rules read the state).

    Raises:
        InvalidTransactionError, AdmissionError: as :func:`check_tx`.
    """
    if isinstance(tx, RegisterTx):
        if now_ms >= tx.record.expires_at_ms:
            raise InvalidTransactionError(f"record of {peer_label(tx.subject)} expired")
    elif not isinstance(tx, DeregisterTx):
        _verify_tx(tx, state, now_ms)
    _admit(tx, state, None)


def sorted_changes(changes: dict[bytes, NodeRecord | None]) -> list[tuple[bytes, NodeRecord | None]]:
    """``changes`` by ascending peer ID (the canonical order of deltas)."""
    return sorted(changes.items(), key=lambda item: item[0])


__all__ = [
    "APP_AUX_DOMAIN",
    "APP_AUX_ROOT_DOMAIN",
    "APP_STATE_DOMAIN",
    "DEREGISTER_DOMAIN",
    "MAX_REPUTATION_UPDATE_SUBJECTS",
    "MICRO",
    "REPUTATION_ROOT_DOMAIN",
    "TX_DOMAIN",
    "AdmissionPolicy",
    "AppState",
    "BlockResult",
    "DeregisterTx",
    "EvidenceTx",
    "MAX_VALSET_DELAY",
    "ProposalEvidenceTx",
    "SignedProposalDigest",
    "VALSET_SUBJECT",
    "VALSET_UPDATE_DOMAIN",
    "ValsetUpdateTx",
    "Genesis",
    "Lane",
    "Mempool",
    "RegisterTx",
    "ReputationEntry",
    "ReputationUpdateTx",
    "Tx",
    "TxKind",
    "TxResult",
    "app_hash",
    "app_state_hash",
    "apply_reputation_update",
    "aux_root_of",
    "check_subject",
    "check_tx",
    "decode_record",
    "decode_tx",
    "deregister_signing_bytes",
    "encode_tx",
    "execute_block",
    "genesis_state",
    "make_valset_update",
    "sign_valset_update",
    "validators_at",
    "valset_update_signing_bytes",
    "reputation_root",
    "sign_deregister",
    "source_networks",
    "to_micro",
    "tx_hash",
    "verification_model_nodes",
]
