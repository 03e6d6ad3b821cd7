"""The record set of a directory and its root, kept up to date incrementally, pure.

The committee's app hash commits to the whole set of node records (PlanetServe sec. 3.4;
:mod:`ps_p2p.registry`) through its *root*, a two-level hash (a Merkle tree of fixed shape,
so one change costs one bucket, not the whole set)::

    leaf(r)   = SHA-256(b"planetserve/v1/record-leaf\\x00" || bytes(record(r)) || bytes(sig(r)))
    bucket(b) = SHA-256(leaf(r) for the records r with peer_id[6] == b, ascending peer ID)
    root      = SHA-256(b"planetserve/v1/record-set\\x00" || u32(#records) || bucket(0..255))

where ``record(r)`` is :func:`~ps_p2p.records.canonical.record_signing_bytes` and ``bytes`` and
``u32`` are as in :mod:`ps_p2p.records.canonical`. ``peer_id[6]`` is the first byte of the
Ed25519 key of an identity-multihash peer ID (the only kind a record may have,
:mod:`ps_p2p.records.peer_ids`), so the :data:`~ps_p2p.records.limits.ROOT_BUCKETS` (256)
buckets are consecutive ranges of peer IDs. Leaves and digests are 32 bytes; a root recomputation
after k changes hashes the k changed buckets (~1/256 of the set each) and 8 KiB of bucket
digests.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ps_p2p.records.canonical import lp, record_signing_bytes, u32
from ps_p2p.records.limits import RECORD_LEAF_DOMAIN, RECORD_SET_DOMAIN, ROOT_BUCKETS
from ps_p2p.records.peer_ids import ED25519_PEER_ID_PREFIX

if TYPE_CHECKING:  # annotations only: types comes after this module (records/__init__.py)
    from ps_p2p.records.types import NodeRecord

#: The byte of a peer ID that picks its bucket: the first byte of its Ed25519 key.
BUCKET_BYTE = len(ED25519_PEER_ID_PREFIX)

_EMPTY_BUCKET = hashlib.sha256(b"").digest()


def record_leaf(record: NodeRecord) -> bytes:
    """The record's leaf of the set root (module docstring): SHA-256, 32 bytes.

    Two records have the same leaf only if they are the same signed record, so the leaf also
    keys the cache of verified records.

    Raises:
        LocalProtocolError: a field out of its wire range.
    """
    return hashlib.sha256(
        RECORD_LEAF_DOMAIN
        + lp(record_signing_bytes(record))
        + lp(bytes(record.signature))
    ).digest()


def _bucket_of(peer_id: bytes) -> int:
    return peer_id[BUCKET_BYTE] if len(peer_id) > BUCKET_BYTE else 0


class RecordSet:
    """A set of records, one per peer ID, with its root kept up to date incrementally.

    A change marks one bucket; :meth:`root` rehashes only the marked buckets (each ~1/256 of
    the set) and the 256 bucket digests (8 KiB): O(changes), never the whole set.
    """

    def __init__(self, records: Iterable[NodeRecord] = ()) -> None:
        self._records: dict[bytes, tuple[NodeRecord, bytes]] = {}
        self._buckets: list[list[bytes]] = [[] for _ in range(ROOT_BUCKETS)]
        self._digests: list[bytes | None] = [_EMPTY_BUCKET] * ROOT_BUCKETS
        self._root: bytes | None = None
        self._sorted: tuple[NodeRecord, ...] | None = ()
        for record in records:
            self.put(record)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, peer_id: bytes) -> bool:
        return peer_id in self._records

    def get(self, peer_id: bytes) -> NodeRecord | None:
        """The record of ``peer_id``, or None."""
        held = self._records.get(peer_id)
        return held[0] if held is not None else None

    def leaf(self, peer_id: bytes) -> bytes | None:
        """The leaf of ``peer_id``'s record, or None."""
        held = self._records.get(peer_id)
        return held[1] if held is not None else None

    def put(self, record: NodeRecord, leaf: bytes | None = None) -> NodeRecord | None:
        """Add or replace the record of ``record.peer_id``; returns the one it replaced.

        Args:
            leaf: :func:`record_leaf` of ``record`` when the caller has it.
        """
        if leaf is None:
            leaf = record_leaf(record)
        peer = record.peer_id
        old = self._records.get(peer)
        self._records[peer] = (record, leaf)
        bucket = _bucket_of(peer)
        if old is None:
            bisect.insort(self._buckets[bucket], peer)
        self._digests[bucket] = None
        self._root = None
        self._sorted = None
        return old[0] if old is not None else None

    def remove(self, peer_id: bytes) -> NodeRecord | None:
        """Remove ``peer_id``'s record; returns it (None when absent)."""
        old = self._records.pop(peer_id, None)
        if old is None:
            return None
        bucket = _bucket_of(peer_id)
        peers = self._buckets[bucket]
        del peers[bisect.bisect_left(peers, peer_id)]
        self._digests[bucket] = None
        self._root = None
        self._sorted = None
        return old[0]

    def copy(self) -> RecordSet:
        """An independent copy sharing the (immutable) records: O(records) pointer copies,
        no hashing (the bucket digests and root are copied)."""
        new = RecordSet.__new__(RecordSet)
        new._records = dict(self._records)
        new._buckets = [list(b) for b in self._buckets]
        new._digests = list(self._digests)
        new._root = self._root
        new._sorted = self._sorted
        return new

    def root(self) -> bytes:
        """:func:`record_set_root` of the set (32 bytes), rehashing only changed buckets."""
        if self._root is None:
            for b, digest in enumerate(self._digests):
                if digest is None:
                    records = self._records
                    self._digests[b] = hashlib.sha256(
                        b"".join(records[p][1] for p in self._buckets[b])
                    ).digest()
            digests: list[bytes] = self._digests  # type: ignore[assignment]  # none left None
            self._root = hashlib.sha256(
                RECORD_SET_DOMAIN + u32(len(self._records)) + b"".join(digests)
            ).digest()
        return self._root

    def records(self) -> tuple[NodeRecord, ...]:
        """All records, ascending peer ID (cached until the next change)."""
        if self._sorted is None:
            records = self._records
            self._sorted = tuple(records[p][0] for bucket in self._buckets for p in bucket)
        return self._sorted


def record_set_root(records: Iterable[NodeRecord]) -> bytes:
    """The root of a list of records (module docstring); O(records).

    A list naming one peer ID twice has the root of the set that keeps the last of them (a
    caller that takes a list from a peer refuses duplicates first).
    """
    return RecordSet(records).root()


__all__ = ["BUCKET_BYTE", "RecordSet", "record_leaf", "record_set_root"]
