"""Circuit Relay v2 reservations and circuits a public node grants, and their bounds (pure core).

A user behind a NAT cannot be dialled, so it reserves a slot on a public node (libp2p Circuit
Relay v2, ``/libp2p/circuit/relay/0.2.0/hop``) and advertises ``<relay>/p2p/<R>/p2p-circuit``
in its record; a peer that wants a link to it asks the relay to CONNECT it, and the relay then
copies the bytes of that link both ways. Every one of these is a resource a peer makes the relay
hold, so each is bounded per peer AND in total (DESIGN.md, "Security invariants"):

* a reservation is per peer ID (a renewal refreshes it), at most ``max_reservations`` in all and
  ``max_reservations_per_network`` from one source network (the /24 or /48 of the connection
  that asked: identities are free, addresses are not);
* of them at most ``max_unlisted_reservations`` are held by peers the directory does not list
  (newcomers: a NATed node reserves before it can register, since its record lists its relays).
  A listed peer passed the committee's admission caps (per source network); an unlisted one
  passed nothing, so peers that are no members (sybils from a few /24s) can take the newcomer
  slots but never the rest, which the network's listed NATed nodes keep renewing;
* a circuit needs a live reservation of its destination; at most ``max_circuits`` in all,
  ``max_circuits_per_reservation`` to one destination and ``max_circuits_per_source`` from one
  source peer; each carries at most ``circuit_bytes`` (both directions together) before the
  relay cuts it (the two ends then dial a new one).

:class:`ReservationBook` keeps the counts and answers "may this happen now"; the service
(:mod:`ps_p2p.protocols.circuit_relay`) asks it before py-libp2p's own handlers run and gives
every circuit back when it ends. Expiry is indexed (a heap), never a scan of every reservation.

Source: libp2p specs, relay/circuit-v2.md (reservations, limits); issue 20 section 2.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import base58

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.records.multiaddrs import check_multiaddr

REACHABILITY = ("auto", "public", "private")


@dataclass(frozen=True)
class CircuitRelayConfig:
    """``[circuit_relay]``: who relays for NATed nodes and how much (times in seconds).

    Attributes:
        reachability: ``"auto"``: the node asks the verifiers to dial it back (AutoNAT) and
            is private when none could (a NAT: the address they see is not one it listens
            on); ``"public"`` / ``"private"``: as configured, no question asked.
        serve: a public node grants reservations (the bounds below); False: none.
        max_reservations: reservations granted at once, in all.
        max_reservations_per_network: of them from one source network (IPv4 /24, IPv6 /48).
        max_unlisted_reservations: of them held by peers the directory does not list
            (newcomers that reserve before they register; module docstring).
        reservation_ttl: seconds a reservation lasts unless renewed (a private node renews at
            half of it); it also ends when the node's connection to the relay closes.
        max_circuits: relayed links open at once, in all.
        max_circuits_per_reservation: of them to one destination (one NATed node).
        max_circuits_per_source: of them opened by one source peer.
        circuit_bytes: bytes one relayed link may carry, both directions together, before
            the relay closes it (the ends dial a new one); 0: no limit.
        reservations: a private node keeps this many reservations, on distinct relays.
        nat_hole_punch: a private node also tries DCUtR hole punches to other private nodes.
            Off by default: between two ps_p2p nodes they cannot succeed (their listeners
            refuse ``SO_REUSEPORT``, so the punch leaves from a port the peer was not told;
            docs/network.md, "Hole punching": 0 of 390 in the 40-node runs) and each failed
            attempt costs dials and a DCUtR exchange. Upgrades between a public and a private
            node are always tried.
    """

    reachability: str = "auto"
    serve: bool = True
    max_reservations: int = 16
    max_reservations_per_network: int = 4
    max_unlisted_reservations: int = 8
    reservation_ttl: float = 120.0
    max_circuits: int = 128
    max_circuits_per_reservation: int = 24
    max_circuits_per_source: int = 16
    circuit_bytes: int = 1 << 30
    reservations: int = 2
    nat_hole_punch: bool = False

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY:
            raise ValueError(f"reachability must be one of {', '.join(REACHABILITY)}, "
                             f"not {self.reachability!r}")
        for name in ("max_reservations", "max_reservations_per_network",
                     "max_unlisted_reservations", "max_circuits",
                     "max_circuits_per_reservation", "max_circuits_per_source", "reservations"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
        if not isinstance(self.circuit_bytes, int) or self.circuit_bytes < 0:
            raise ValueError(f"circuit_bytes must be an integer >= 0, not {self.circuit_bytes!r}")
        if not (isinstance(self.reservation_ttl, (int, float))
                and 10 <= self.reservation_ttl <= 86_400):
            raise ValueError(f"reservation_ttl must be 10 to 86400 seconds, not "
                             f"{self.reservation_ttl!r}")


#: Why a reservation or circuit was refused (the relay answers RESOURCE_LIMIT_EXCEEDED or
#: NO_RESERVATION, the Circuit Relay v2 status codes).
NO_RESERVATION = "no reservation"
OVER_LIMIT = "over limit"


@dataclass(frozen=True)
class Circuit:
    """One relayed link the book counts: ``source`` dialled ``destination`` through us."""

    ticket: int
    source: bytes
    destination: bytes


class ReservationBook:
    """The reservations and circuits of one relay, with the bounds of a
    :class:`CircuitRelayConfig` (module docstring). Peers are peer IDs (bytes), networks the
    source network keys of :func:`ps_p2p.networks.network_key` (or ``""`` when unknown);
    ``now`` is any monotonic clock in seconds."""

    def __init__(self, config: CircuitRelayConfig) -> None:
        self.config = config
        self._expires: dict[bytes, float] = {}
        self._unlisted: set[bytes] = set()  # holders the directory did not list when they asked
        self._network: dict[bytes, str] = {}
        self._per_network: dict[str, int] = {}
        self._heap: list[tuple[float, bytes]] = []
        self._circuits: dict[int, Circuit] = {}
        self._to: dict[bytes, int] = {}
        self._from: dict[bytes, int] = {}
        self._tickets = itertools.count(1)

    # reservations --------------------------------------------------------------------------

    def reserve(self, peer: bytes, network: str, now: float,
                listed: bool = True) -> float | None:
        """Grant or renew ``peer``'s reservation; returns its expiry (``now + ttl``), or None
        when a new one would pass ``max_reservations`` or the per-network bound, or when
        ``peer`` is not ``listed`` in the directory and the unlisted ones hold
        ``max_unlisted_reservations`` already (a listed holder whose record left the directory
        renews as an unlisted one)."""
        self.expire(now)
        cfg = self.config
        was_unlisted = peer in self._unlisted
        if not listed and not was_unlisted and len(self._unlisted) >= cfg.max_unlisted_reservations:
            return None
        if peer in self._expires:
            if self._network[peer] != network:  # renewed from elsewhere: count it there
                if self._per_network.get(network, 0) >= cfg.max_reservations_per_network:
                    return None
                self._uncount(peer)
                self._network[peer] = network
                self._per_network[network] = self._per_network.get(network, 0) + 1
        else:
            if len(self._expires) >= cfg.max_reservations:
                return None
            if self._per_network.get(network, 0) >= cfg.max_reservations_per_network:
                return None
            self._network[peer] = network
            self._per_network[network] = self._per_network.get(network, 0) + 1
        if listed:
            self._unlisted.discard(peer)
        else:
            self._unlisted.add(peer)
        expires = now + self.config.reservation_ttl
        self._expires[peer] = expires
        heapq.heappush(self._heap, (expires, peer))
        if len(self._heap) > 4 * self.config.max_reservations + 16:  # renewals left stale entries
            self._heap = [(t, p) for p, t in self._expires.items()]
            heapq.heapify(self._heap)
        return expires

    def release(self, peer: bytes) -> None:
        """End ``peer``'s reservation now (its connection to us closed)."""
        if peer in self._expires:
            self._uncount(peer)
            del self._expires[peer]
            del self._network[peer]
            self._unlisted.discard(peer)

    def has_reservation(self, peer: bytes, now: float) -> bool:
        self.expire(now)
        return peer in self._expires

    def reservations(self, now: float | None = None) -> int:
        """Reservations held (those expired by ``now`` dropped first, when given)."""
        if now is not None:
            self.expire(now)
        return len(self._expires)

    def unlisted_reservations(self, now: float | None = None) -> int:
        """Of :meth:`reservations`, those held by peers the directory did not list when they
        last asked."""
        if now is not None:
            self.expire(now)
        return len(self._unlisted)

    def holders(self) -> list[bytes]:
        """The peers holding a reservation (at most ``max_reservations``)."""
        return list(self._expires)

    def expire(self, now: float) -> None:
        """Drop the reservations whose time is up (heap order: O(log n) each)."""
        while self._heap and self._heap[0][0] <= now:
            expires, peer = heapq.heappop(self._heap)
            if self._expires.get(peer) == expires:
                self.release(peer)

    def _uncount(self, peer: bytes) -> None:
        net = self._network[peer]
        left = self._per_network[net] - 1
        if left:
            self._per_network[net] = left
        else:
            del self._per_network[net]

    # circuits ------------------------------------------------------------------------------

    def open_circuit(self, source: bytes, destination: bytes,
                     now: float) -> tuple[Circuit | None, str]:
        """Count a circuit from ``source`` to ``destination``, or say why not:
        ``(circuit, "")``, ``(None, NO_RESERVATION)`` or ``(None, OVER_LIMIT)``."""
        if not self.has_reservation(destination, now):
            return None, NO_RESERVATION
        cfg = self.config
        if (len(self._circuits) >= cfg.max_circuits
                or self._to.get(destination, 0) >= cfg.max_circuits_per_reservation
                or self._from.get(source, 0) >= cfg.max_circuits_per_source):
            return None, OVER_LIMIT
        circuit = Circuit(next(self._tickets), source, destination)
        self._circuits[circuit.ticket] = circuit
        self._to[destination] = self._to.get(destination, 0) + 1
        self._from[source] = self._from.get(source, 0) + 1
        return circuit, ""

    def close_circuit(self, circuit: Circuit) -> None:
        """Give a circuit back (idempotent)."""
        if self._circuits.pop(circuit.ticket, None) is None:
            return
        for counts, peer in ((self._to, circuit.destination), (self._from, circuit.source)):
            left = counts[peer] - 1
            if left:
                counts[peer] = left
            else:
                del counts[peer]

    def circuits(self) -> int:
        return len(self._circuits)


def rank_relays(me: bytes, candidates: Iterable[bytes]) -> list[bytes]:
    """``candidates`` in the order a private node ``me`` prefers them as relays: rendezvous
    (highest random weight) hashing, ``sha256(me || relay)``. Every node has its own order, so
    the private nodes' reservations spread evenly over the public ones, and a new candidate
    takes over only the nodes for which it ranks first (about ``k / candidates`` of them, for
    ``k`` reservations each), so reservations move little while the directory fills.

    Source: Thaler and Ravishankar, "Using name-based mappings to increase hit rates" (1998).
    """
    return sorted(set(candidates), key=lambda c: hashlib.sha256(me + c).digest())


def circuit_relays(addrs: Iterable[bytes]) -> frozenset[bytes]:
    """The relays (peer ID bytes) a record's binary multiaddrs reach it through: the
    ``/p2p/<R>`` before each ``/p2p-circuit``; empty for a node listed by direct addresses
    only. Addresses that do not parse are skipped (a record's were validated already)."""
    out = set()
    for addr in addrs:
        try:
            text = check_multiaddr(addr)
        except RemoteProtocolError:
            continue
        head, sep, _ = text.partition("/p2p-circuit")
        if not sep or "/p2p/" not in head:
            continue
        try:
            out.add(bytes(base58.b58decode(head.rsplit("/p2p/", 1)[1])))
        except ValueError:
            continue
    return frozenset(out)


def circuit_only_relays(addrs: Iterable[bytes]) -> frozenset[bytes]:
    """The relays of a record listed by ``/p2p-circuit`` addresses only (a NATed node, reached
    through one of them: :func:`circuit_relays`); empty when the record has a direct address
    too, or none that parses."""
    texts = []
    for addr in addrs:
        try:
            texts.append(check_multiaddr(addr))
        except RemoteProtocolError:
            continue
    if not texts or any("/p2p-circuit" not in t for t in texts):
        return frozenset()
    return circuit_relays(addrs)


def relay_hosts_of(records: Iterable[object]) -> dict[bytes, frozenset[bytes]]:
    """peer ID -> the relays of its circuit addresses, for the directory's NATed nodes only
    (:func:`circuit_relays` of each record's ``addrs``)."""
    out = {}
    for record in records:
        relays = circuit_relays(getattr(record, "addrs", ()))
        if relays:
            out[record.peer_id] = relays  # type: ignore[attr-defined]
    return out


__all__ = ["NO_RESERVATION", "OVER_LIMIT", "REACHABILITY", "Circuit", "CircuitRelayConfig",
           "ReservationBook", "circuit_only_relays", "circuit_relays", "rank_relays", "relay_hosts_of"]
