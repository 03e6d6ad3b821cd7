"""Where a peer is now: peerstore addresses that follow a node to a new port or IP.

py-libp2p 0.8.1 keeps a peer's addresses in the order they were first added and
``Swarm.dial_peer`` dials only the first usable address of each transport class (at most one
TCP address), then blocks the peer for 60 s in its negative dial cache once that dial failed.
So a node restarted on a new port, whose new address was only *added* to the peerstore behind
the stale one, stays unreachable: every dial goes to the dead port (issue 20: 6 of 6 requests
failed over 180 s). This module gives the three remedies:

* :func:`replace_peer_addrs`: the addresses of a peer's latest committed record replace those
  held (not only added), and the negative dial cache forgets the peer, so the next dial goes to
  the new address at once;
* :func:`install_dial_fallback`: when ``dial_peer`` failed, the peer's other known TCP addresses
  are tried one at a time (at most :data:`MAX_FALLBACK_ADDRS`), and one that answers is moved to
  the front of the peerstore; a peer whose every address failed is blocked for
  :data:`NEGATIVE_CACHE_SECONDS` (py-libp2p: 60 s), and :func:`forget_dial_failures` lifts the
  block for a dial the caller paces itself (the directory client's verifier dials);
* :class:`ReidentifyNotifee`: once the last connection to a peer closes, the protocols cached
  for it are forgotten, so the next connection runs identify again; identify replaces the
  peer's addresses with the listen addresses it reports (py-libp2p's
  ``update_peerstore_from_identify``), which it otherwise skips for a peer it identified once,
  even when that peer restarted somewhere else.

Source: issue 20 section 3; libp2p identify spec (``listenAddrs``);
``libp2p/network/swarm.py`` ``dial_peer`` (py-libp2p 0.8.1).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetwork
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError

from ps_p2p.protocols.notifee import QuietNotifee

log = logging.getLogger(__name__)

#: Addresses of one peer tried after ``dial_peer`` failed (a record holds at most
#: ``records.MAX_ADDRS`` of them).
MAX_FALLBACK_ADDRS = 8
#: Seconds py-libp2p refuses to dial a peer again after every address of it failed (its
#: default, 60 s, keeps a node that restarted, or a verifier that started a moment later than
#: its peers, unreachable for a minute; the overlay and the directory client back off on their
#: own).
NEGATIVE_CACHE_SECONDS = 5.0


def _parse(addrs: Iterable[bytes | str | multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    out: list[multiaddr.Multiaddr] = []
    for a in addrs:
        try:
            m = a if isinstance(a, multiaddr.Multiaddr) else multiaddr.Multiaddr(a)
        except Exception:  # a record's address this multiaddr library cannot read
            continue
        if m not in out:
            out.append(m)
    return out


def forget_dial_failures(network: INetwork, peer: ID) -> None:
    """Let the next dial of ``peer`` happen now even when its last one failed (py-libp2p 0.8.1
    blocks a peer whose every address failed for 60 s: ``Swarm._negative_peer_cache``)."""
    cache = getattr(network, "_negative_peer_cache", None)
    if cache is not None:
        cache.evict(str(peer))


def replace_peer_addrs(host: IHost, peer: bytes,
                       addrs: Sequence[bytes | str | multiaddr.Multiaddr]) -> bool:
    """Make ``addrs`` (a record's, in its order) the addresses ``host`` dials ``peer`` at.

    Unparseable addresses are skipped; with none left nothing changes. When the peerstore
    already holds exactly these addresses in this order nothing changes either (the TTL of
    what identify added stays), else the old ones are dropped, these are added without expiry,
    and the peer's negative dial cache entry is evicted.

    Returns:
        True when the peerstore changed.
    """
    wanted = _parse(addrs)
    if not wanted:
        return False
    pid = ID(peer)
    store = host.get_peerstore()
    try:
        held = list(store.addrs(pid))
    except PeerStoreError:
        held = []
    if held == wanted:
        return False
    store.clear_addrs(pid)
    store.add_addrs(pid, wanted, 0)
    forget_dial_failures(host.get_network(), pid)
    return True


def _dialable(addr: multiaddr.Multiaddr) -> bool:
    names = {p.name for p in addr.protocols()}
    return "tcp" in names and "p2p-circuit" not in names


def install_dial_fallback(network: INetwork) -> None:
    """Make ``network.dial_peer`` try every known TCP address of a peer when py-libp2p's own
    dial (its first TCP address only) failed; the address that answers moves to the front of
    the peerstore, so later dials use it first; and shorten py-libp2p's block of a peer whose
    every address failed to :data:`NEGATIVE_CACHE_SECONDS`. Installed once per network
    (idempotent).

    Raises (from the wrapped ``dial_peer``): the original ``SwarmException`` when no other
    address answers either.
    """
    if getattr(network, "_ps_dial_fallback", False):
        return
    cache = getattr(network, "_negative_peer_cache", None)
    if cache is not None and hasattr(cache, "_ttl"):
        cache._ttl = min(cache._ttl, NEGATIVE_CACHE_SECONDS)
    original = network.dial_peer

    async def dial_peer(peer_id: ID) -> list[INetConn]:
        book = getattr(network, "_ps_circuits", None)
        if book and peer_id in book:  # a NATed peer: its record lists its relays only
            return await _dial_circuits(
                network, peer_id, SwarmException(f"no relay of {peer_id} answered"))
        try:
            return await original(peer_id)
        except SwarmException as exc:
            if "negative cache" in str(exc):
                raise  # every address failed within the last minute: no new dial
            failure = exc
        store = network.peerstore
        try:
            known = [a for a in store.addrs(peer_id) if _dialable(a)][:MAX_FALLBACK_ADDRS]
        except PeerStoreError:
            raise failure from None
        if not known:  # a NATed peer listed by its relays only
            return await _dial_circuits(network, peer_id, failure)
        for addr in known[1:]:  # py-libp2p dialled the first one
            try:
                conn = await network.dial_addr(addr, peer_id)  # type: ignore[attr-defined]
            except Exception as exc:
                log.debug("dial of %s at %s failed: %r", peer_id, addr, exc)
                continue
            rest = [a for a in store.addrs(peer_id) if a != addr]
            store.clear_addrs(peer_id)
            store.add_addrs(peer_id, [addr, *rest], 0)
            forget_dial_failures(network, peer_id)
            log.info("peer %s answered at %s, not at its first address", peer_id, addr)
            return [conn]
        return await _dial_circuits(network, peer_id, failure)

    network.dial_peer = dial_peer  # type: ignore[method-assign]
    network._ps_dial_fallback = True  # type: ignore[attr-defined]


async def _dial_circuits(network: INetwork, peer_id: ID, failure: SwarmException) -> list[INetConn]:
    """Last resort of the dial fallback: the peer's ``/p2p-circuit`` addresses (a NATed node's
    relays), one at a time, when :func:`install_circuit_dialing` enabled them; one dial at a
    time per peer (concurrent callers share its connection). Raises ``failure`` when none
    answers."""
    host = getattr(network, "_ps_circuit_host", None)
    if host is None:
        raise failure
    from ps_p2p.protocols.circuit_relay import (
        dial_circuit,  # import cycle: it uses host.py
    )

    locks: dict[ID, trio.Lock] = network._ps_circuit_locks  # type: ignore[attr-defined]
    lock = locks.setdefault(peer_id, trio.Lock())
    try:
        async with lock:
            conns = network.get_connections(peer_id)
            if conns:  # another caller's circuit came up meanwhile
                return list(conns)
            circuits = list(getattr(network, "_ps_circuits", {}).get(peer_id, ()))
            try:
                circuits += [a for a in network.peerstore.addrs(peer_id)
                             if "p2p-circuit" in str(a) and a not in circuits]
            except PeerStoreError:
                pass
            circuits = circuits[:MAX_FALLBACK_ADDRS]
            random.shuffle(circuits)  # the peer's relays share its incoming links
            for addr in circuits:
                try:
                    conn = await dial_circuit(host, addr, peer_id)
                except Exception as exc:
                    log.debug("circuit to %s via %s failed: %r", peer_id, addr, exc)
                    continue
                return [conn]
    finally:
        if not lock.locked() and not lock.statistics().tasks_waiting:
            locks.pop(peer_id, None)
    raise failure


def install_circuit_dialing(host: IHost) -> None:
    """Let the dial fallback (:func:`install_dial_fallback`, installed first) reach a peer
    through the relays its ``/p2p-circuit`` addresses name
    (:func:`ps_p2p.protocols.circuit_relay.dial_circuit`)."""
    network = host.get_network()
    network._ps_circuit_host = host  # type: ignore[attr-defined]
    network._ps_circuit_locks = {}  # type: ignore[attr-defined]
    network._ps_circuits = {}  # type: ignore[attr-defined]


def note_record_circuits(host: IHost, peer: bytes,
                         addrs: Sequence[bytes | str | multiaddr.Multiaddr]) -> bool:
    """Remember the ``/p2p-circuit`` addresses of ``peer``'s committed record when it lists
    no direct one (a NATed node): it is then always dialled through them, whatever identify
    reported since (a NATed node's listen addresses are on its home network, and py-libp2p's
    identify replaces the peerstore's addresses with them). Returns True when ``peer`` is such
    a node. Without :func:`install_circuit_dialing` nothing is kept."""
    book = getattr(host.get_network(), "_ps_circuits", None)
    if book is None:
        return False
    parsed = _parse(addrs)
    circuits = [a for a in parsed if "p2p-circuit" in str(a)]
    pid = ID(peer)
    if circuits and len(circuits) == len(parsed):
        book[pid] = circuits[:MAX_FALLBACK_ADDRS]
        return True
    book.pop(pid, None)
    return False


def forget_record_circuits(host: IHost, keep: Iterable[bytes]) -> None:
    """Forget the circuit addresses of every peer not in ``keep`` (departed nodes)."""
    book = getattr(host.get_network(), "_ps_circuits", None)
    if book:
        kept = {ID(p) for p in keep}
        for pid in [p for p in book if p not in kept]:
            del book[pid]


class ReidentifyNotifee(QuietNotifee):
    """Forgets the protocols cached for a peer once its last connection closed, so py-libp2p
    runs identify on the next connection and takes the listen addresses it reports (module
    docstring)."""

    def __init__(self, host: IHost) -> None:
        self._host = host

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = getattr(conn.muxed_conn, "peer_id", None)
        if peer is None or network.get_connections(peer):
            return
        try:
            self._host.get_peerstore().clear_protocol_data(peer)
        except Exception as exc:  # a peer the peerstore already dropped
            log.debug("forgetting the protocols of %s: %r", peer, exc)


__all__ = [
    "MAX_FALLBACK_ADDRS",
    "NEGATIVE_CACHE_SECONDS",
    "ReidentifyNotifee",
    "forget_dial_failures",
    "forget_record_circuits",
    "install_circuit_dialing",
    "install_dial_fallback",
    "note_record_circuits",
    "replace_peer_addrs",
]
