"""PlanetServe's registry: the committee's application, above the consensus engine; pure.

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
    SEED_COMMIT (3), EPOCH_REPORT (4), MISS_REPORT (6), MIX_REPORT (9): the verification
                    epochs and the users' mix of request shapes, bodies
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
limited outside consensus by each verifier (:mod:`ps_p2p.registry.sources`), and the
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
                    || u32(strikes) || u32(clean epochs)

(evidence keys, departed peer IDs and subjects ascending). The directory serves the registry
aux as a digest and the reputation entries themselves, so a node recomputes the reputation root
and no verifier can lie about a reputation (:mod:`ps_p2p.registry.directory`). *Departed* peers are tombstones: a DEREGISTER
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

Package layout (the engine, :mod:`ps_p2p.consensus`, knows nothing of this package: it orders
opaque transactions; this package gives them meaning)::

    tx         transaction kinds and dataclasses, canonical encode/decode, signing bytes
    state      Genesis, AdmissionPolicy, AppState, app hash, source networks
    execution  check_tx, admission, execute_block, validators_at, reputation updates
    mempool    Mempool: two lanes (listed peers, new identities), bounded
    sources    per-source-address admission outside consensus (verifier-local)
    snapshot   canonical bytes of a state (state sync)
    directory  the committed directory as paged deltas plus a commit; verify_directory
    replica    CommitteeReplica: a node's verified view of the directory
    validator  Validator: the engine's core joined with this application, its mempool,
               directory history and store (signing, WAL, timers, restart; no libp2p)

The public names of ``tx``, ``state``, ``execution`` and ``mempool`` are re-exported here.
"""

from __future__ import annotations

from ps_p2p.registry.execution import (
    BlockResult,
    TxResult,
    apply_reputation_update,
    check_tx,
    execute_block,
    validators_at,
    verification_model_nodes,
)
from ps_p2p.registry.mempool import (
    Lane,
    Mempool,
)
from ps_p2p.registry.state import (
    APP_AUX_DOMAIN,
    APP_AUX_ROOT_DOMAIN,
    APP_STATE_DOMAIN,
    REPUTATION_ROOT_DOMAIN,
    AdmissionPolicy,
    AppState,
    Genesis,
    app_hash,
    app_state_hash,
    aux_root_of,
    genesis_state,
    reputation_root,
    source_networks,
)
from ps_p2p.registry.tx import (
    DEREGISTER_DOMAIN,
    MAX_REPUTATION_UPDATE_SUBJECTS,
    MAX_VALSET_DELAY,
    TX_DOMAIN,
    VALSET_SUBJECT,
    VALSET_UPDATE_DOMAIN,
    DeregisterTx,
    EvidenceTx,
    ProposalEvidenceTx,
    RegisterTx,
    ReputationEntry,
    ReputationUpdateTx,
    SignedProposalDigest,
    Tx,
    TxKind,
    ValsetUpdateTx,
    check_subject,
    decode_record,
    decode_tx,
    deregister_signing_bytes,
    encode_tx,
    make_valset_update,
    sign_deregister,
    sign_valset_update,
    to_micro,
    tx_hash,
    valset_update_signing_bytes,
)
from ps_p2p.verification.ledger import MICRO

__all__ = [
    "APP_AUX_DOMAIN",
    "APP_AUX_ROOT_DOMAIN",
    "APP_STATE_DOMAIN",
    "AdmissionPolicy",
    "AppState",
    "BlockResult",
    "DEREGISTER_DOMAIN",
    "DeregisterTx",
    "EvidenceTx",
    "Genesis",
    "Lane",
    "MAX_REPUTATION_UPDATE_SUBJECTS",
    "MAX_VALSET_DELAY",
    "MICRO",
    "Mempool",
    "ProposalEvidenceTx",
    "REPUTATION_ROOT_DOMAIN",
    "RegisterTx",
    "ReputationEntry",
    "ReputationUpdateTx",
    "SignedProposalDigest",
    "TX_DOMAIN",
    "Tx",
    "TxKind",
    "TxResult",
    "VALSET_SUBJECT",
    "VALSET_UPDATE_DOMAIN",
    "ValsetUpdateTx",
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
    "reputation_root",
    "sign_deregister",
    "sign_valset_update",
    "source_networks",
    "to_micro",
    "tx_hash",
    "validators_at",
    "valset_update_signing_bytes",
    "verification_model_nodes",
]
