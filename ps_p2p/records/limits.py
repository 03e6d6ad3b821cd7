"""Limits, units and domain-separation prefixes of node records and the directory, pure.

Record field limits are in bytes (DESIGN.md "Security invariants"); the largest signed record,
with a membership certificate, is about 820 bytes as a protobuf (:data:`MAX_RECORD_WIRE_BYTES`
bounds it at 1 KiB)::

    peer ID 38 | multiaddrs 4 x <= 100 (binary) | roles <= 3 | onion key 32 | model ID <= 64
    | organization <= 64 | capacity, issue and expiry times | signature 64
    | membership (organization key 38, expiry, signature 64; with an organization only)

Times are unix milliseconds (``*_MS``); the lifetime and clock-skew bounds are those of the
registry of PlanetServe sec. 3.4 (:mod:`ps_p2p.registry` applies them). Every signature covers a byte string that starts with one
of the ``*_DOMAIN`` prefixes (DESIGN.md "Wire"; the layouts are in
:mod:`ps_p2p.records.canonical` and :mod:`ps_p2p.records.recordset`), so a signature made for one
kind of message never verifies as another. Integers on the wire are u32 or u64, big-endian:
:data:`UINT32_BOUND` and :data:`UINT64_BOUND` are their exclusive upper bounds.

Constants only: this module imports nothing.
"""

# ---------------------------------------------------------------------------------- limits

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS

#: Most multiaddrs a record may list (a node listens on a few interfaces and transports).
MAX_ADDRS = 4
#: Longest multiaddr in its binary form (``/dns4/<63-byte label>/tcp/<port>`` is 70 bytes;
#: ``/ip6/.../udp/<port>/quic-v1`` 23).
MAX_ADDR_BYTES = 100
#: Longest model ID (UTF-8 bytes; a Hugging Face ``org/name`` fits).
MAX_MODEL_ID_BYTES = 64
#: Longest organization (UTF-8 bytes).
MAX_ORGANIZATION_BYTES = 64
#: Bound of a whole signed record as a protobuf (the largest legal one is ~820 bytes).
MAX_RECORD_WIRE_BYTES = 1024
#: An X25519 public key.
ONION_KEY_BYTES = 32
#: An Ed25519 signature.
SIGNATURE_BYTES = 64
#: Longest validity window of a record (expires_at_ms - issued_at_ms).
MAX_RECORD_LIFETIME_MS = 24 * HOUR_MS
#: How far in the future a record or directory may be issued (clock skew allowance).
MAX_CLOCK_SKEW_MS = 5 * MINUTE_MS
#: Default bound of the committee's registry (``AdmissionPolicy.max_records``) and of what a
#: node takes from a verifier.
MAX_RECORDS = 100_000
#: Default bound of a :class:`~ps_p2p.records.VerifiedCache` (a node's verified records, ~150
#: bytes each).
VERIFIED_CACHE_ENTRIES = 2 * MAX_RECORDS
#: Number of buckets of the record-set root.
ROOT_BUCKETS = 256

#: Exclusive upper bound of a u32 wire integer.
UINT32_BOUND = 2**32
#: Exclusive upper bound of a u64 wire integer.
UINT64_BOUND = 2**64

# ---------------------------------------------------------------------------------- domains

RECORD_DOMAIN = b"planetserve/v1/node-record\x00"
#: A record that names an organization (it carries the organization's membership certificate).
ORG_RECORD_DOMAIN = b"planetserve/v2/node-record\x00"
#: What an organization key signs to certify a member (:mod:`ps_p2p.records.canonical`).
MEMBERSHIP_DOMAIN = b"planetserve/v1/org-membership\x00"
RECORD_LEAF_DOMAIN = b"planetserve/v1/record-leaf\x00"
RECORD_SET_DOMAIN = b"planetserve/v1/record-set\x00"
RESPONSE_DOMAIN = b"planetserve/v1/response\x00"
CLOVE_DOMAIN = b"planetserve/v1/response-clove\x00"
#: Reputation subjects (:func:`~ps_p2p.records.types.reputation_subject`): an organization's
#: (followed by its organization key, an Ed25519 peer ID) and a lone node's (followed by its peer
#: ID); the two kinds never collide.
ORG_SUBJECT_PREFIX = b"orgkey\x00"
NODE_SUBJECT_PREFIX = b"node\x00"
#: Longest reputation subject (a prefix and a peer ID, with room).
MAX_SUBJECT_BYTES = 5 + max(MAX_ORGANIZATION_BYTES, 64)

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
    "MAX_SUBJECT_BYTES",
    "MEMBERSHIP_DOMAIN",
    "MINUTE_MS",
    "NODE_SUBJECT_PREFIX",
    "ONION_KEY_BYTES",
    "ORG_RECORD_DOMAIN",
    "ORG_SUBJECT_PREFIX",
    "RECORD_DOMAIN",
    "RECORD_LEAF_DOMAIN",
    "RECORD_SET_DOMAIN",
    "RESPONSE_DOMAIN",
    "ROOT_BUCKETS",
    "SECOND_MS",
    "SIGNATURE_BYTES",
    "UINT32_BOUND",
    "UINT64_BOUND",
    "VERIFIED_CACHE_ENTRIES",
]
