"""The registry's state: genesis, admission policy, AppState and its app hash; pure.

:class:`Genesis` (chain ID, validators, :class:`AdmissionPolicy`, limits, optional verification
parameters), :class:`AppState` (records, evidence, departed peers, epoch ledger, reputations,
validator set and its pending update) with the app hash that a block and a directory commit
cover (formats in :mod:`ps_p2p.registry`, "The state's app hash"), and
:func:`source_networks`, the claimed networks that the per-network admission caps count.
Transactions change a state only through :mod:`ps_p2p.registry.execution`.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import ipaddress
from dataclasses import dataclass, field

from ps_p2p.consensus.block import ZERO_ID, BlockLimits, ChainTip
from ps_p2p.consensus.encoding import lp, lps, u8, u32, u64
from ps_p2p.consensus.signing import (
    PROPOSAL_TYPE,
    check_chain_id,
    check_validators,
    validator_set_hash,
)
from ps_p2p.consensus.types import Validator, Vote
from ps_p2p.errors import LocalProtocolError
from ps_p2p.networks import network_key
from ps_p2p.records.limits import MAX_RECORD_LIFETIME_MS, MAX_RECORDS
from ps_p2p.records.multiaddrs import check_multiaddr
from ps_p2p.records.recordset import RecordSet
from ps_p2p.records.types import NodeRecord
from ps_p2p.registry.tx import ReputationEntry, SignedProposalDigest, ValsetUpdateTx
from ps_p2p.verification.ledger import EpochLedger, VerificationParams
from ps_p2p.verification.reputation import ReputationParams


APP_STATE_DOMAIN = b"planetserve/v1/app-state\x00"
APP_AUX_DOMAIN = b"planetserve/v1/app-aux\x00"
EVIDENCE_KEY_DOMAIN = b"planetserve/v1/evidence-key\x00"
APP_AUX_ROOT_DOMAIN = b"planetserve/v2/app-aux-root\x00"
REPUTATION_ROOT_DOMAIN = b"planetserve/v1/reputation-root\x00"


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
        silent_after_ms: a listed record issued this long before the state's time (not
            renewed: nodes renew every 30 s) no longer counts toward the per-network caps, so a
            node that froze or died without deregistering stops locking its /24 out (issue
            20); its own renewal then counts as a new record and must fit the cap again, so the
            records a network keeps renewing never exceed the cap. Default 90 s: three
            renewal intervals.
    """

    max_records: int = MAX_RECORDS
    max_records_per_network: int = 32
    max_records_without_address: int = 256
    max_records_per_organization: int = 1024
    max_registrations_per_block: int = 64
    max_evidence: int = 10_000
    ipv4_prefix_bits: int = 24
    ipv6_prefix_bits: int = 48
    silent_after_ms: int = 90_000

    def __post_init__(self) -> None:
        for name in ("max_records", "max_records_per_network", "max_records_without_address",
                     "max_records_per_organization", "max_registrations_per_block",
                     "max_evidence", "silent_after_ms"):
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


def reputation_root(reputations: dict[bytes, ReputationEntry], epoch: int) -> bytes:
    """The reputation root (module docstring), 32 bytes; O(subjects)."""
    h = hashlib.sha256(REPUTATION_ROOT_DOMAIN + u64(epoch) + u32(len(reputations)))
    for subject in sorted(reputations):
        h.update(lp(subject) + reputations[subject].encode())
    return h.digest()


def aux_root_of(registry_aux: bytes, reputations_root: bytes) -> bytes:
    """The aux root from the registry aux digest and the reputation root (module docstring)."""
    return hashlib.sha256(APP_AUX_ROOT_DOMAIN + lp(registry_aux) + lp(reputations_root)).digest()


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
        # network -> peers listed in it (each set replaced, never mutated: states share them)
        self._net_members: dict[str, frozenset[bytes]] = {}
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

    def is_silent(self, record: NodeRecord) -> bool:
        """Whether ``record`` was issued ``policy.silent_after_ms`` or more before this
        state's time (its node stopped renewing it)."""
        return record.issued_at_ms <= self.time_ms - self.policy.silent_after_ms

    def live_network_count(self, network: str) -> int:
        """Records listed in ``network`` that are not silent (:meth:`is_silent`): what the
        per-network caps count. O(1) below the cap, else O(records listed in the network)."""
        total = self._networks[network]
        cap = self.policy.max_records_without_address if network == "" else \
            self.policy.max_records_per_network
        if total < cap:
            return total
        live = 0
        for peer in self._net_members.get(network, ()):
            record = self.records.get(peer)
            if record is not None and not self.is_silent(record):
                live += 1
        return live

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
        new._net_members = dict(self._net_members)
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
        nets = self._networks_of(record)
        self._networks.update(nets)
        for net in nets:
            self._net_members[net] = self._net_members.get(net, frozenset()) | {record.peer_id}
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
            members = self._net_members.get(net, frozenset()) - {record.peer_id}
            if members:
                self._net_members[net] = members
            else:
                self._net_members.pop(net, None)
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


def genesis_state(genesis: Genesis) -> AppState:
    """The state at height 0: no records, app hash computed."""
    state = AppState(genesis)
    state.app_hash = app_hash(state)
    return state


def app_hash(state: AppState) -> bytes:
    """The app hash of ``state`` (module docstring): 32 bytes, O(changed buckets)."""
    return app_state_hash(state.chain_id, state.height, len(state.records),
                          state.records.root(), state.aux_root())


def sorted_changes(changes: dict[bytes, NodeRecord | None]) -> list[tuple[bytes, NodeRecord | None]]:
    """``changes`` by ascending peer ID (the canonical order of deltas)."""
    return sorted(changes.items(), key=lambda item: item[0])


__all__ = [
    "APP_AUX_DOMAIN",
    "APP_AUX_ROOT_DOMAIN",
    "APP_STATE_DOMAIN",
    "AdmissionPolicy",
    "AppState",
    "Genesis",
    "REPUTATION_ROOT_DOMAIN",
    "app_hash",
    "app_state_hash",
    "aux_root_of",
    "genesis_state",
    "reputation_root",
    "source_networks",
]
