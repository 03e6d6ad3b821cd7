"""The data types of node records and the directory (PlanetServe sec. 3.2, 3.4), pure.

A *node record* (:class:`NodeRecord`) is what a node tells the network about itself: peer ID,
multiaddrs, roles, the X25519 onion key its relays use, model ID, organization, capacity and
validity window, signed by its identity key (Ed25519, RFC 8032). An organization is not free
text: it is an Ed25519 *organization key*, and a record that names one carries that key's
certificate that the node is a member (:class:`Membership`), so only the organization decides who
shares its reputation (issue 16: a sybil naming "acme" pulled acme's shared reputation below the
trust threshold). The *directory*
(:class:`Directory`) is the set of records the verifier committee committed at a height
(:mod:`ps_p2p.consensus`), as a node's verified view holds it
(:class:`~ps_p2p.registry.replica.CommitteeReplica`).

Field sizes (bytes) and times (unix milliseconds) are bounded by :mod:`ps_p2p.records.limits`;
the bytes each signature covers are in :mod:`ps_p2p.records.canonical`. Frozen dataclasses only:
checking is :mod:`ps_p2p.records.validation`'s business.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from multiaddr import transforms as _ma

from ps_p2p.records.limits import NODE_SUBJECT_PREFIX, ORG_SUBJECT_PREFIX
from ps_p2p.records.multiaddrs import multiaddr_bytes

_NO_REPUTATIONS: Mapping[bytes, float] = MappingProxyType({})


class Role(enum.IntEnum):
    """A node's roles; the numbers are those of ``planetserve.v1.Role``."""

    USER = 1
    MODEL = 2
    VERIFIER = 3


class Signer(Protocol):
    """What signs records, deregistrations and votes (``ps_p2p.keys.Identity``)."""

    @property
    def peer_id(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


@dataclass(frozen=True)
class Membership:
    """An organization's certificate that a node is one of its members (issue 16).

    The organization key signs :func:`~ps_p2p.records.canonical.membership_signing_bytes`
    (its key, the organization's name, the member's peer ID, the expiry); the record that
    carries it is signed by the member as a whole. ``ps-node org sign`` makes one
    (:func:`~ps_p2p.records.signatures.sign_membership`).

    Attributes:
        org_key: the organization key's Ed25519 peer ID (38 bytes): the organization's identity
            and its reputation subject (:func:`reputation_subject`).
        expires_at_ms: unix milliseconds; a record carrying the certificate must expire no
            later (the organization revokes a member by not renewing its certificate).
        signature: Ed25519 by ``org_key``, 64 bytes.
    """

    org_key: bytes
    expires_at_ms: int
    signature: bytes


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
        organization: the organization's name, shown to users, at most
            :data:`MAX_ORGANIZATION_BYTES` bytes; non-empty exactly when ``membership`` is set
            (names are labels, not unique: the organization is its key).
        capacity: concurrent requests (model nodes), < 2**32.
        issued_at_ms, expires_at_ms: unix milliseconds; the lifetime is at most 24 h.
        signature: Ed25519 by ``peer_id``'s key over :func:`record_signing_bytes`.
        membership: the organization's certificate (:class:`Membership`), or None.

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
    membership: Membership | None = None

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
            self.organization, self.capacity, self.membership,
        )


def reputation_subject(peer_id: bytes, org_key: bytes = b"") -> bytes:
    """Whose reputation a model node carries (PlanetServe sec. 3.1: "model nodes from the same
    organization share the same reputation score"): ``b"orgkey\\x00" || org_key`` when its
    record carries an organization's certificate (:class:`Membership`), else
    ``b"node\\x00" || peer_id``. The organization's *key*, never its name: a name is free text
    that anyone may write (issue 16).

    Args:
        peer_id: the node's peer ID bytes.
        org_key: the organization key's peer ID of its record's membership (b"" for none).

    Raises:
        TypeError: ``org_key`` not bytes (e.g. an organization's name).
    """
    if not isinstance(org_key, (bytes, bytearray)):
        raise TypeError(f"org_key must be an organization key's peer ID, not {org_key!r}")
    if org_key:
        return ORG_SUBJECT_PREFIX + bytes(org_key)
    return NODE_SUBJECT_PREFIX + bytes(peer_id)


def record_subject(record: NodeRecord) -> bytes:
    """:func:`reputation_subject` of a record: its organization key's, or its own."""
    membership = record.membership
    return reputation_subject(record.peer_id, membership.org_key if membership else b"")


@dataclass(frozen=True)
class Directory:
    """The node records the verifier committee committed at a height.

    Attributes:
        height: the committed state's height (it grows with every block).
        issued_at_ms, expires_at_ms: unix milliseconds: the time of the block header that
            commits the state, and until when a node uses it without a fresher one.
        records: sorted by peer ID when built by a
            :class:`~ps_p2p.registry.replica.CommitteeReplica`.
        reputations: reputation subject (:func:`reputation_subject`) -> committed reputation
            R in [0, 1] (verified against the app hash like the records; empty when the
            committee scored nobody). Not compared by ``==``.
        untrusted_below: the genesis threshold: R below it is untrusted.
        initial_reputation: the genesis R(0) of a subject never scored.
        verified: the chain runs challenge epochs (its genesis has a ``verification``
            section). Then a subject never scored is *provisional*, not trusted: a fresh
            identity (or a fresh organization key) must pass challenges before users prefer
            it (issue 16: escaping a bad reputation by a new identity must not pay). Without
            epochs nobody is ever scored and every listed node is trusted.
    """

    height: int
    issued_at_ms: int
    expires_at_ms: int
    records: tuple[NodeRecord, ...]
    reputations: Mapping[bytes, float] = field(default_factory=lambda: _NO_REPUTATIONS,
                                               compare=False)
    untrusted_below: float = 0.4
    initial_reputation: float = 0.5
    verified: bool = False

    def reputation(self, peer_id: bytes) -> float | None:
        """The committed reputation R in [0, 1] of ``peer_id``'s subject (its organization's,
        or its own: :func:`record_subject`), or None when the committee never scored it
        (or it is not listed)."""
        record = self.record(peer_id)
        if record is None:
            return None
        return self.reputations.get(record_subject(record))

    def reputation_or_initial(self, peer_id: bytes) -> float:
        """:meth:`reputation`, or ``initial_reputation`` for a node never scored."""
        reputation = self.reputation(peer_id)
        return self.initial_reputation if reputation is None else reputation

    def trusted(self, peer_id: bytes) -> bool:
        """Whether ``peer_id``'s subject has proven itself: scored, with a committed
        reputation at least ``untrusted_below`` (paper sec. 3.4). A node never scored is
        trusted only on a chain without challenge epochs (``verified`` False); on one with
        them it is :meth:`provisional`."""
        reputation = self.reputation(peer_id)
        if reputation is None:
            return not self.verified
        return reputation >= self.untrusted_below

    def provisional(self, peer_id: bytes) -> bool:
        """True for a listed node whose subject was never scored on a chain with challenge
        epochs: users send to it only when no trusted node serves the model
        (:func:`~ps_p2p.roles.user.trusted_model_nodes`), and it earns trust by its
        challenges."""
        return self.verified and self.record(peer_id) is not None \
            and self.reputation(peer_id) is None

    def serving(self, model_id: str | None = None) -> list[NodeRecord]:
        """The model nodes a request may go to (optionally serving ``model_id``), in directory
        order: the :meth:`trusted` ones, and the :meth:`provisional` ones of a model that has
        no trusted node (a new network, or a model nobody has proven yet, still works, while a
        fresh identity gets nothing beside proven nodes: issue 16). Users choose among them
        (:func:`~ps_p2p.roles.user.trusted_model_nodes`), and a model group forwards among
        them (:mod:`ps_p2p.roles.forwarding`)."""
        nodes = [r for r in self.model_nodes() if model_id is None or r.model_id == model_id]
        proven = {r.model_id for r in nodes if self.trusted(r.peer_id)}
        return [r for r in nodes if self.trusted(r.peer_id)
                or (r.model_id not in proven and self.provisional(r.peer_id))]

    def users(self) -> list[NodeRecord]:
        """Records with :attr:`Role.USER`, in directory order."""
        return [r for r in self.records if Role.USER in r.roles]

    def model_nodes(self) -> list[NodeRecord]:
        """Records with :attr:`Role.MODEL`, in directory order."""
        return [r for r in self.records if Role.MODEL in r.roles]

    def record(self, peer_id: bytes) -> NodeRecord | None:
        """The record of ``peer_id``, or None (dict lookup, index built on first use)."""
        return self._index.get(peer_id)

    @functools.cached_property
    def _index(self) -> dict[bytes, NodeRecord]:
        return {r.peer_id: r for r in self.records}


__all__ = [
    "Directory",
    "Membership",
    "NodeRecord",
    "Role",
    "Signer",
    "record_subject",
    "reputation_subject",
]
