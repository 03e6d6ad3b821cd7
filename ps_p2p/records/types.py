"""The data types of node records and the directory (PlanetServe sec. 3.2, 3.4), pure.

A *node record* (:class:`NodeRecord`) is what a node tells the network about itself: peer ID,
multiaddrs, roles, the X25519 onion key its relays use, model ID, organization, capacity and
validity window, signed by its identity key (Ed25519, RFC 8032). The *directory*
(:class:`Directory`) is the set of live records at a registry height. Verifiers sign only its
*head* (:class:`DirectoryHead`: height, validity window, record count and the root of the whole
set); the records travel in bounded pages and deltas (:class:`DirectoryPage`), and a client
checks that the set it assembled has the signed root. Once consensus lands a head carries 2f+1
:class:`VerifierSignature` (a quorum certificate).

Field sizes (bytes) and times (unix milliseconds) are bounded by :mod:`ps_p2p.records.limits`;
the bytes each signature covers are in :mod:`ps_p2p.records.canonical`. Frozen dataclasses only:
checking is :mod:`ps_p2p.records.validation`'s business.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Protocol

from multiaddr import transforms as _ma

from ps_p2p.records.multiaddrs import multiaddr_bytes
from ps_p2p.records.recordset import record_set_root


class Role(enum.IntEnum):
    """A node's roles; the numbers are those of ``planetserve.v1.Role``."""

    USER = 1
    MODEL = 2
    VERIFIER = 3


class Signer(Protocol):
    """What signs records and directories (``ps_p2p.keys.Identity``)."""

    @property
    def peer_id(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


@dataclass(frozen=True)
class NodeRecord:
    """One node's self-signed description (PlanetServe sec. 3.2 "node record").

    Attributes:
        peer_id: libp2p peer ID bytes (an Ed25519 identity multihash, 38 bytes).
        addrs: multiaddrs in binary form, without ``/p2p/`` (at most :data:`MAX_ADDRS` of at
            most :data:`MAX_ADDR_BYTES` bytes). Text multiaddrs given to the constructor are
            converted (:func:`multiaddr_bytes`); :meth:`multiaddrs` renders them as text.
        roles: non-empty.
        onion_key: X25519 public key, 32 bytes.
        model_id: the served model (model nodes only; required with :attr:`Role.MODEL`), at
            most :data:`MAX_MODEL_ID_BYTES` UTF-8 bytes.
        organization: free text, shown to users, at most :data:`MAX_ORGANIZATION_BYTES` bytes.
        capacity: concurrent requests (model nodes), < 2**32.
        issued_at_ms, expires_at_ms: unix milliseconds; the lifetime is at most 24 h.
        signature: Ed25519 by ``peer_id``'s key over :func:`record_signing_bytes`.

    Raises:
        LocalProtocolError: (constructor) a text address that is not a multiaddr.
    """

    peer_id: bytes
    addrs: tuple[bytes, ...]
    roles: frozenset[Role]
    onion_key: bytes
    model_id: str = ""
    organization: str = ""
    capacity: int = 0
    issued_at_ms: int = 0
    expires_at_ms: int = 0
    signature: bytes = b""

    def __post_init__(self) -> None:
        if any(isinstance(a, str) for a in self.addrs):
            converted = tuple(multiaddr_bytes(a) if isinstance(a, str) else a for a in self.addrs)
            object.__setattr__(self, "addrs", converted)

    def multiaddrs(self) -> list[str]:
        """The addresses as text multiaddrs (those that do not parse are left out)."""
        out = []
        for addr in self.addrs:
            try:
                out.append(_ma.bytes_to_string(bytes(addr)))
            except Exception:
                continue
        return out

    def content(self) -> tuple:
        """Everything a client uses: the record without its times and signature."""
        return (
            self.peer_id, self.addrs, self.roles, self.onion_key, self.model_id,
            self.organization, self.capacity,
        )


@dataclass(frozen=True)
class VerifierSignature:
    """A verifier's signature over :func:`head_signing_bytes`."""

    verifier_id: bytes
    signature: bytes


@dataclass(frozen=True)
class DirectoryHead:
    """What verifiers sign: a record set's height, validity window, size and root.

    Attributes:
        height: increases with every change of the record set (a record added, removed or
            its content changed); renewals that only move times do not count.
        issued_at_ms, expires_at_ms: unix milliseconds; the records it lists are live until
            ``expires_at_ms``.
        record_count: number of records in the set.
        root: :func:`record_set_root` of the set (32 bytes).
        signatures: one per verifier (2f+1 of a committee once consensus lands).
    """

    height: int
    issued_at_ms: int
    expires_at_ms: int
    record_count: int
    root: bytes
    signatures: tuple[VerifierSignature, ...] = ()


@dataclass(frozen=True)
class Directory:
    """The signed set of live node records at a registry height.

    Attributes:
        height: increases with every change of the record set.
        issued_at_ms, expires_at_ms: unix milliseconds (the head's).
        records: sorted by peer ID when built by a :class:`Registry` or a
            :class:`DirectoryReplica`.
        signatures: the head's; they cover :func:`directory_signing_bytes`.
    """

    height: int
    issued_at_ms: int
    expires_at_ms: int
    records: tuple[NodeRecord, ...]
    signatures: tuple[VerifierSignature, ...] = ()

    def users(self) -> list[NodeRecord]:
        """Records with :attr:`Role.USER`, in directory order."""
        return [r for r in self.records if Role.USER in r.roles]

    def model_nodes(self) -> list[NodeRecord]:
        """Records with :attr:`Role.MODEL`, in directory order."""
        return [r for r in self.records if Role.MODEL in r.roles]

    def record(self, peer_id: bytes) -> NodeRecord | None:
        """The record of ``peer_id``, or None (dict lookup, index built on first use)."""
        return self._index.get(peer_id)

    def head(self) -> DirectoryHead:
        """The head these records make (root computed here: O(records))."""
        return DirectoryHead(
            self.height, self.issued_at_ms, self.expires_at_ms, len(self.records),
            record_set_root(self.records), self.signatures,
        )

    @functools.cached_property
    def _index(self) -> dict[bytes, NodeRecord]:
        return {r.peer_id: r for r in self.records}


@dataclass(frozen=True)
class DirectoryPage:
    """One answer to "what changed since height ``since_height``" (a bounded page).

    Attributes:
        head: the signed head of the verifier's current set.
        since_height: the height the page starts from (0 when ``reset``).
        reset: the asked height could not be served as a delta (too old, or unknown): the
            client starts from an empty set.
        records: records added or changed after ``since_height`` (newest content each).
        removed: peer IDs removed after ``since_height``.
        next_height: the height this page brings the client to; equals ``head.height`` when
            not ``more``.
        more: ask again with ``since_height = next_height``.
    """

    head: DirectoryHead
    since_height: int
    reset: bool
    records: tuple[NodeRecord, ...]
    removed: tuple[bytes, ...]
    next_height: int
    more: bool


__all__ = [
    "Directory",
    "DirectoryHead",
    "DirectoryPage",
    "NodeRecord",
    "Role",
    "Signer",
    "VerifierSignature",
]
