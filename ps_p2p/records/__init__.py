"""Node records, record sets and their validation (PlanetServe sec. 3.2, 3.4), pure.

A *node record* is what a node tells the network about itself: peer ID, multiaddrs, roles, the
X25519 onion key its relays use, model ID, organization, capacity and validity window, signed by
its identity key (Ed25519, RFC 8032). A *record set* holds one record per peer ID with an
incrementally kept root; the *directory* is the set the verifier committee committed at a
height. The committee (:mod:`ps_p2p.consensus`) is what commits it: a record is listed when a
block carrying its REGISTER transaction is decided, and a node trusts a directory only with a
commit of more than 2/3 of the genesis validators (a lone verifier is a committee of one).

One module per concern, imports pointing down only (each imports only those above it; the
two marked * name the types for annotations only)::

    limits       sizes (bytes), times (unix ms), bounds, domain-separation prefixes
    peer_ids     Ed25519 identity-multihash peer IDs: the key inside, the short log form
    multiaddrs   binary multiaddrs: text -> bytes, strict parse of a peer's bytes (memoized)
    canonical *  the canonical byte strings signatures cover (record, response, clove)
    recordset *  the record set and its incremental two-level root (256 buckets)
    types        Role, Membership, NodeRecord, Directory
    signatures   Ed25519 sign_record, sign_membership and their checks (libsodium via PyNaCl)
    validation   check_record*, VerifiedCache

Every public name is re-exported here, so ``from ps_p2p.records import NodeRecord`` and
``records.check_record`` work; import from a concern module where that reads clearer.

Nothing here does I/O, reads a clock or imports trio, libp2p or the generated protobuf modules:
times come in as ``now_ms`` (unix milliseconds). The wire form of a record is in
:mod:`ps_p2p.protocols.record_codec`.
"""

from ps_p2p.records.canonical import (
    clove_signing_bytes,
    membership_signing_bytes,
    record_signing_bytes,
    response_signing_bytes,
)
from ps_p2p.records.limits import (
    CLOVE_DOMAIN,
    HOUR_MS,
    MAX_ADDR_BYTES,
    MAX_ADDRS,
    MAX_CLOCK_SKEW_MS,
    MAX_MODEL_ID_BYTES,
    MAX_ORGANIZATION_BYTES,
    MAX_RECORD_LIFETIME_MS,
    MAX_RECORD_WIRE_BYTES,
    MAX_RECORDS,
    MEMBERSHIP_DOMAIN,
    MINUTE_MS,
    ONION_KEY_BYTES,
    ORG_RECORD_DOMAIN,
    RECORD_DOMAIN,
    RECORD_LEAF_DOMAIN,
    RECORD_SET_DOMAIN,
    RESPONSE_DOMAIN,
    ROOT_BUCKETS,
    SECOND_MS,
    SIGNATURE_BYTES,
    VERIFIED_CACHE_ENTRIES,
)
from ps_p2p.records.multiaddrs import check_multiaddr, multiaddr_bytes
from ps_p2p.records.peer_ids import public_key_from_peer_id, short_peer_id
from ps_p2p.records.recordset import RecordSet, record_leaf, record_set_root
from ps_p2p.records.signatures import (
    sign_membership,
    sign_record,
    verify_membership,
    verify_signature,
)
from ps_p2p.records.types import (
    Directory,
    Membership,
    NodeRecord,
    Role,
    Signer,
    record_subject,
    reputation_subject,
)
from ps_p2p.records.validation import VerifiedCache, check_record, check_record_fields

__all__ = [
    "CLOVE_DOMAIN",
    "HOUR_MS",
    "MAX_ADDRS",
    "MAX_ADDR_BYTES",
    "MAX_CLOCK_SKEW_MS",
    "MAX_MODEL_ID_BYTES",
    "MAX_ORGANIZATION_BYTES",
    "MAX_RECORDS",
    "MAX_RECORD_LIFETIME_MS",
    "MAX_RECORD_WIRE_BYTES",
    "MEMBERSHIP_DOMAIN",
    "MINUTE_MS",
    "ONION_KEY_BYTES",
    "ORG_RECORD_DOMAIN",
    "RECORD_DOMAIN",
    "RECORD_LEAF_DOMAIN",
    "RECORD_SET_DOMAIN",
    "RESPONSE_DOMAIN",
    "ROOT_BUCKETS",
    "SECOND_MS",
    "SIGNATURE_BYTES",
    "VERIFIED_CACHE_ENTRIES",
    "Directory",
    "Membership",
    "NodeRecord",
    "RecordSet",
    "Role",
    "Signer",
    "VerifiedCache",
    "check_multiaddr",
    "check_record",
    "check_record_fields",
    "clove_signing_bytes",
    "multiaddr_bytes",
    "public_key_from_peer_id",
    "membership_signing_bytes",
    "record_leaf",
    "record_set_root",
    "record_signing_bytes",
    "record_subject",
    "reputation_subject",
    "response_signing_bytes",
    "short_peer_id",
    "sign_membership",
    "sign_record",
    "verify_membership",
    "verify_signature",
]
