"""NATed nodes on the overlay: Circuit Relay v2 and AutoNAT of py-libp2p 0.8.1, bounded.

A node behind a NAT (a home router doing masquerade) can dial out but nobody can dial it, so on
its own it can only ask. With this module it takes every role of a user (issue 20 section 2):

* **Is this node private?** (:class:`Reachability`) ``[circuit_relay] reachability = "auto"``
  asks the verifiers it is connected to, with py-libp2p's AutoNAT v1 client
  (``libp2p.host.autonat``), to dial it back. An AutoNAT server dials only addresses on the IP
  it observes the request from, and a NATed node listens on none of them (the router's public
  address is not its own), so the servers answer ``E_DIAL_REFUSED``: once a majority of the
  (at most 3) servers asked refused, the node is private. Public nodes serve AutoNAT
  (:class:`AutoNATServer`: at most :data:`AUTONAT_CONCURRENCY` requests at once, one per peer).
* **Relays** (:class:`RelayServer`, a public node): py-libp2p's ``CircuitV2Protocol`` with hop
  enabled, behind the bounds of :class:`~ps_p2p.overlay.circuit_limits.ReservationBook` (per
  peer, per source network, in total, and for peers the directory does not list; circuits per
  destination, per source, in total) and two fixes of py-libp2p 0.8.1 (below).
* **Reservations** (:class:`ReservationKeeper`, a private node): it keeps
  ``[circuit_relay] reservations`` (2) reservations on distinct relays, chosen among the
  directory's verifiers and public users (never model nodes: a model node that also carried a
  user's first link could match the cells it relays with the cloves it receives as the
  destination), renews each at half its lifetime, replaces one whose connection closed, and
  pings the relays every 10 s: one silent for :data:`HOP_TIMEOUT` has its connection closed
  (and when every relay is silent, this node's address changed, e.g. a NAT remap: every
  connection silent since is closed, :meth:`ReservationKeeper.check_alive`); its
  record then lists ``<relay address>/p2p/<relay>/p2p-circuit`` for each instead of its
  listen addresses (:meth:`ReservationKeeper.advertised`).
* **Dialling a NATed peer** (:func:`dial_circuit`, installed as the last resort of
  :func:`ps_p2p.protocols.addresses.install_dial_fallback`): py-libp2p's swarm skips
  ``/p2p-circuit`` addresses ("no relay transport"), so a peer listed only by them is dialled
  here: a HOP CONNECT on a stream to its relay, and the stream, as a relayed raw connection, is
  secured (Noise, end to end: the relay sees ciphertext only) and multiplexed (Yamux) like a TCP
  one. The NATed end accepts it in py-libp2p's STOP handler.

Fixes of py-libp2p 0.8.1 (``libp2p/relay/circuit_v2/protocol.py``, pinned to 0.8.1, see
:data:`PINNED_LIBP2P`):

1. ``_handle_reserve`` grants the reservation to the peer ID the RESERVE message names
   (``msg.peer``), not to the peer on the connection, so one peer could fill every slot with
   made-up IDs; :class:`RelayServer` clears the field, so the reservation is the caller's.
2. ``_relay_data`` closes, when one circuit ends, the streams filed in ``_active_relays`` under
   the circuit's destination peer, which belong to the *latest* circuit to that peer: a NATed
   relay with links from several users lost a working link each time another one closed.
   :class:`RelayServer` copies the bytes itself and closes only its own circuit's streams.

Source: libp2p specs relay/circuit-v2.md, autonat/README.md (v1); issue 20 section 2.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from ps_p2p.overlay.circuit_limits import (
    NO_RESERVATION,
    CircuitRelayConfig,
    ReservationBook,
    rank_relays,
)
from ps_p2p.protocols.host import is_connected, last_heard, peer_network
from ps_p2p.protocols.notifee import QuietNotifee

log = logging.getLogger(__name__)

#: The py-libp2p release whose relay code the fixes above were written against.
PINNED_LIBP2P = "0.8.1"
#: Seconds a HOP RESERVE or CONNECT may take, stream open to status read.
HOP_TIMEOUT = 10.0
#: Bytes read from one side of a circuit at a time.
_READ_SIZE = 64 * 1024
#: Seconds between checks whether a relayed connection replaced by a direct one (DCUtR) still
#: carries streams; it is closed once it carries none.
RELAY_IDLE_CHECK = 10.0
#: AutoNAT requests a public node serves at once (each may cost one dial back).
#: Seconds between a private node's liveness pings of its reservations' relays
#: (:meth:`ReservationKeeper.check_alive`); each may take :data:`HOP_TIMEOUT`.
RESERVATION_CHECK_INTERVAL = 10.0
#: libp2p's ping protocol (served by every py-libp2p ``BasicHost``) and its payload size.
PING_PROTOCOL_ID = "/ipfs/ping/1.0.0"
PING_BYTES = 32
AUTONAT_CONCURRENCY = 4


class _QuietHopEnd(logging.Filter):
    """py-libp2p 0.8.1's hop handler reads a next message after every RESERVE and after every
    circuit's end, and logs the normal close or reset of that stream (and its failed attempt to
    answer on it) as ERRORs; those lines say nothing and are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Error reading from hop stream",
                                               "Timeout reading from hop stream",
                                               "Unexpected error handling hop stream",
                                               "Error sending status message"))


logging.getLogger("libp2p.relay.circuit_v2.protocol").addFilter(_QuietHopEnd())


def _libp2p_version() -> str:
    try:
        return importlib.metadata.version("libp2p")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def circuit_multiaddr(relay_addr: str, relay: ID) -> str:
    """``<relay_addr>/p2p/<relay>/p2p-circuit`` (what a NATed node's record lists; a record
    leaves out the node's own ``/p2p/``)."""
    base = relay_addr.rsplit("/p2p/", 1)[0]
    return f"{base}/p2p/{relay.to_base58()}/p2p-circuit"


def parse_circuit(addr: multiaddr.Multiaddr) -> tuple[multiaddr.Multiaddr, ID] | None:
    """``(relay's own address, relay peer ID)`` of a ``.../p2p/<R>/p2p-circuit[/p2p/<N>]``
    address, or None for any other."""
    text = str(addr)
    if "/p2p-circuit" not in text:
        return None
    head = text.split("/p2p-circuit", 1)[0]
    if "/p2p/" not in head:
        return None
    base, relay = head.rsplit("/p2p/", 1)
    try:
        return multiaddr.Multiaddr(base), ID.from_base58(relay)
    except Exception:
        return None


class RelayServer(CircuitV2Protocol):
    """py-libp2p's Circuit Relay v2 hop (and stop) handlers with the bounds of ``config``
    (:class:`~ps_p2p.overlay.circuit_limits.ReservationBook`) and the two fixes of the module
    docstring. Run it as py-libp2p's service: ``background_trio_service(RelayServer(...))``."""

    def __init__(self, host: IHost, config: CircuitRelayConfig,
                 listed: Callable[[bytes], bool] | None = None) -> None:
        limits = RelayLimits(
            duration=0,  # no cap on a link's life: the overlay keeps links for hours
            data=config.circuit_bytes,
            max_circuit_conns=config.max_circuits_per_reservation,
            max_reservations=config.max_reservations,
            reservation_ttl=int(config.reservation_ttl),
        )
        super().__init__(host, limits, allow_hop=config.serve)
        self.book = ReservationBook(config)
        #: peer ID -> whether the directory lists it (None: every peer counts as listed)
        self.listed = listed
        self.refused = 0
        if _libp2p_version() != PINNED_LIBP2P:
            log.warning("circuit relay fixes were written for py-libp2p %s, this is %s: check "
                        "ps_p2p/protocols/circuit_relay.py", PINNED_LIBP2P, _libp2p_version())

    def _network_of(self, peer: ID) -> str:
        # loopback (a devnet on one machine): every peer a network of its own
        return peer_network(self.host, peer.to_bytes()) or f"peer:{peer.to_bytes().hex()}"

    async def _refuse(self, stream: INetStream, code: StatusCode) -> None:
        self.refused += 1
        try:
            with trio.fail_after(HOP_TIMEOUT):
                await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS,
                                                             status=to_proto_status(code)))
                await stream.close()
        except Exception:
            await stream.reset()

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        peer = stream.muxed_conn.peer_id
        msg.ClearField("peer")  # fix 1: the reservation is the caller's, whatever msg.peer says
        now = trio.current_time()
        listed = self.listed is None or self.listed(peer.to_bytes())
        if self.book.reserve(peer.to_bytes(), self._network_of(peer), now, listed) is None:
            # full: a reservation lives with its holder's connection; give back those of
            # holders gone (at most max_reservations looked at, only when full)
            for holder in self.book.holders():
                if not is_connected(self.host, holder):
                    self.book.release(holder)
                    # py-libp2p's own table (0.8.1: ``_reservations``) counts it too
                    self.resource_manager._reservations.pop(ID(holder), None)
        if self.book.reserve(peer.to_bytes(), self._network_of(peer), now, listed) is None:
            log.debug("reservation of %s (%s) refused: over the limits", peer,
                      "listed" if listed else "not listed")
            await self._refuse(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        source = stream.muxed_conn.peer_id
        try:
            destination = ID(msg.peer.id)
        except Exception:
            await self._refuse(stream, StatusCode.MALFORMED_MESSAGE)
            return
        if not is_connected(self.host, destination.to_bytes()):
            self.book.release(destination.to_bytes())  # a reservation lives with its connection
        circuit, why = self.book.open_circuit(source.to_bytes(), destination.to_bytes(),
                                              trio.current_time())
        if circuit is None:
            await self._refuse(stream, StatusCode.NO_RESERVATION if why == NO_RESERVATION
                               else StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        try:
            await super()._handle_connect(stream, msg)
        finally:
            self.book.close_circuit(circuit)

    async def _relay_data(self, src_stream: INetStream, dst_stream: INetStream, peer_id: ID,
                          deadline: float | None = None,
                          circuit_data_limit: list[int] | None = None) -> None:
        """Copy ``src_stream`` to ``dst_stream`` until either ends or the circuit's byte budget
        (shared by both directions) is spent; then reset both: this circuit's streams only
        (fix 2 of the module docstring)."""
        try:
            while True:
                data = await src_stream.read(_READ_SIZE)
                if not data:
                    break
                if circuit_data_limit is not None:
                    circuit_data_limit[0] -= len(data)
                    if circuit_data_limit[0] < 0:
                        log.info("relayed link to %s cut after its %d bytes", peer_id,
                                 self.limits.data)
                        break
                with trio.fail_after(self.write_timeout):
                    await dst_stream.write(data)
        except Exception as exc:  # a reset or closed side: the circuit ends
            log.debug("relayed link to %s ended: %r", peer_id, exc)
        finally:
            for stream in (src_stream, dst_stream):
                try:
                    await stream.reset()
                except Exception:
                    pass


async def reserve(host: IHost, relay: ID, timeout: float = HOP_TIMEOUT) -> int:
    """Ask ``relay`` (connected or dialable) for a reservation; returns its expiry (unix
    seconds, the relay's clock).

    Raises:
        ConnectionError: the relay refused (its status code in the message) or answered
            nonsense; trio.TooSlowError: no answer within ``timeout``; py-libp2p's dial and
            stream errors.
    """
    with trio.fail_after(timeout):
        stream = await host.new_stream(relay, [HOP_PROTOCOL_ID])
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            resp = await read_delimited_msg(stream, HopMessage)
        finally:
            try:
                await stream.close()
            except Exception:
                pass
    if resp.type != HopMessage.STATUS or resp.status != StatusCode.OK:
        raise ConnectionError(f"relay {relay} refused the reservation (status {resp.status})")
    if not resp.HasField("reservation"):
        raise ConnectionError(f"relay {relay} granted no reservation")
    return int(resp.reservation.expire)


async def dial_circuit(host: IHost, addr: multiaddr.Multiaddr, peer: ID,
                       timeout: float = HOP_TIMEOUT) -> INetConn:
    """A connection to ``peer`` through the relay named in ``addr``
    (``<relay address>/p2p/<R>/p2p-circuit``), secured and multiplexed end to end, and added to
    the host's swarm like a direct one.

    Raises:
        ConnectionError: not a circuit address, or the relay refused (status in the message);
        trio.TooSlowError: no circuit within ``timeout``; py-libp2p's dial and upgrade errors.
    """
    parsed = parse_circuit(addr)
    if parsed is None:
        raise ConnectionError(f"{addr} is not a circuit address")
    relay_addr, relay = parsed
    if relay == host.get_id() or relay == peer:
        raise ConnectionError(f"{addr} names no other relay")
    store = host.get_peerstore()
    try:
        known = store.addrs(relay)
    except Exception:
        known = []
    if not known:
        store.add_addrs(relay, [relay_addr], 600)
    ma = multiaddr.Multiaddr(f"/p2p/{relay.to_base58()}/p2p-circuit/p2p/{peer.to_base58()}")
    with trio.fail_after(timeout):
        stream = await host.new_stream(relay, [HOP_PROTOCOL_ID])
        try:
            await write_delimited_msg(stream, HopMessage(
                type=HopMessage.CONNECT, peer=CircuitPeerId(id=peer.to_bytes())))
            resp = await read_delimited_msg(stream, HopMessage)
            if resp.type != HopMessage.STATUS or resp.status != StatusCode.OK:
                raise ConnectionError(f"relay {relay} refused a circuit to {peer} "
                                      f"(status {resp.status})")
            raw = RawConnection(stream=stream, initiator=True,
                                connection_type=ConnectionType.RELAYED, addresses=[ma])
            conn = await host.upgrade_outbound_connection(raw, peer)
        except BaseException:
            await stream.reset()
            raise
    try:
        conn.set_transport_info([ma], ConnectionType.RELAYED)  # type: ignore[attr-defined]
    except Exception:
        pass
    return conn


async def ping(host: IHost, peer: ID, timeout: float = HOP_TIMEOUT) -> bool:
    """One libp2p ping (``/ipfs/ping/1.0.0``: ``PING_BYTES`` random bytes echoed) to ``peer``
    within ``timeout`` seconds; False on no answer, a wrong echo or any stream error."""
    payload = os.urandom(PING_BYTES)
    try:
        with trio.fail_after(timeout):
            stream = await host.new_stream(peer, [PING_PROTOCOL_ID])
            try:
                await stream.write(payload)
                echo = b""
                while len(echo) < PING_BYTES:
                    chunk = await stream.read(PING_BYTES - len(echo))
                    if not chunk:
                        return False
                    echo += chunk
            finally:
                with trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception:
                        pass
    except Exception:
        return False
    return echo == payload


async def _close_peer(host: IHost, peer: ID) -> None:
    """Close every connection of ``host`` to ``peer`` (:func:`close_connection`)."""
    for conn in list(host.get_network().get_connections(peer)):
        await close_connection(conn)


#: Seconds of silence after which a direct connection is taken for dead when its peer connects
#: to us anew (:class:`StaleConnectionCloser`): the overlay's stream-open timeout, within which
#: a live peer answers.
REDIAL_STALE_AFTER = 5.0


class StaleConnectionCloser(QuietNotifee):
    """Closes a peer's older connections of the same kind (direct, or relayed) when it
    connects to us anew, unless they prove alive (:func:`_close_if_silent`: silent for
    :data:`REDIAL_STALE_AFTER` s, or no answer to a ping on that connection within about 3
    round trips).

    A peer dials while connected only when its end of the old connection is gone: a NATed
    node whose router took a new public IP (the old connection is dead but open here until the
    keepalive closes it, up to 60 s), or a restarted node. py-libp2p 0.8.1 opens new streams on
    the connection with the most streams (``Swarm._select_connection``, "best"): the dead old
    one, so replies and cells to the peer went nowhere until then; two NATed nodes redial each
    other through a relay, so relayed connections are replaced alike. A relayed one is left
    alone when the new one is direct (a DCUtR upgrade, on purpose; :class:`NatSupport` closes
    the relayed one once idle), and so is one that answers (both ends dialling at once).

    Args:
        nursery: where the closes run (the notification itself must not wait for them).
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    async def connected(self, network: Any, conn: Any) -> None:
        peer = getattr(getattr(conn, "muxed_conn", None), "peer_id", None)
        if peer is None:
            return
        relayed = is_relayed(conn)
        for old in list(network.get_connections(peer)):
            if old is conn or is_relayed(old) != relayed or last_heard(old) is None:
                continue
            try:
                self._nursery.start_soon(_close_if_silent, peer, old)
            except RuntimeError:  # the node is stopping: its connections close anyway
                return


#: Floor of the wait for an answer to the ping sent on a redialled peer's older connection
#: (:func:`_close_if_silent`; RFC 6298's 1 s floor); otherwise 3 x the connection's RTT.
REDIAL_PING_FLOOR = 1.0
_REDIAL_PING_VALUE = 0x70730001  # any value: the peer echoes it in its ACK


async def _ping_connection(conn: Any) -> None:
    """Send one Yamux PING on ``conn`` itself (best effort, at most 1 s): a live peer's Yamux
    answers it at once, and the answer is a frame read (:func:`last_heard`)."""
    from libp2p.stream_muxer.yamux import yamux as yamux_module

    muxed = getattr(conn, "muxed_conn", None)
    write = getattr(muxed, "_write_frame", None)
    if write is None:
        return
    # py-libp2p takes the ACK for an RTT sample since its last ping: make it one since ours
    # (Yamux sizes its receive window by that RTT)
    try:
        muxed._ping_sent_time = trio.current_time()
    except AttributeError:
        pass
    header = yamux_module.struct.pack(yamux_module.YAMUX_HEADER_FORMAT, 0,
                                      yamux_module.TYPE_PING, yamux_module.FLAG_SYN, 0,
                                      _REDIAL_PING_VALUE)
    with trio.move_on_after(1.0):
        try:
            await write(header)
        except Exception as exc:
            log.debug("pinging an older connection: %r", exc)


async def _close_if_silent(peer: Any, old: Any) -> None:
    """Close ``old`` unless it proves alive: at once when it has read nothing for
    :data:`REDIAL_STALE_AFTER` s; otherwise (a redial right after the peer's address changed
    finds its old connection heard from a moment ago) it is pinged on that very connection
    and closed when nothing arrives within ``max(REDIAL_PING_FLOOR, 3 x its RTT)`` (at most
    :data:`REDIAL_STALE_AFTER`). Waiting the full 5 s, as before, lost what was written to the
    peer meanwhile: a first hop's setup reply to a NATed user that had just redialled went
    onto the old, dead connection, and the user's setup waited out its 20-50 s deadline (the
    9-host lossy remap run: every setup sent in the first seconds after the remap, 33 s)."""
    heard = last_heard(old)
    if heard is None or getattr(old, "closed", False) is True:
        return
    now = trio.current_time()
    if now - heard < REDIAL_STALE_AFTER:
        rtt = getattr(getattr(old, "muxed_conn", None), "_rtt", 0.0)
        rtt = rtt if isinstance(rtt, float) and rtt > 0 else 0.0
        window = min(REDIAL_STALE_AFTER, max(REDIAL_PING_FLOOR, 3 * rtt))
        await _ping_connection(old)
        await trio.sleep_until(now + window)
        after = last_heard(old)
        if after is None or after >= now or getattr(old, "closed", False) is True:
            return  # it read something since the redial (the pong, or any frame): alive
    log.info("%s connected anew; its older connection, silent for %.1f s, closed", peer,
             trio.current_time() - heard)
    await close_connection(old)


async def close_connection(conn: Any) -> None:
    """Close a swarm connection found dead (its peer redialled, its relay went silent, a NAT
    remap), at once and completely: first its transport (the socket, or the relayed stream),
    which wakes every task blocked on it and makes Yamux's reader fail and tear the connection
    down (streams reset, removed from the swarm, peers notified), then py-libp2p's close for
    what is left (at most 5 s).

    py-libp2p 0.8.1's ``SwarmConn.close`` marks the connection closed and then writes a Yamux
    GO_AWAY behind the connection's write lock; a writer stuck on a dead peer's full send
    buffer holds that lock, so a bounded close was cancelled half done and left the connection
    in the swarm, marked closed (a later close does nothing) and never cleaned up, until the
    keepalive closed its socket up to a minute later (the 40-node NAT remap run: the
    remapped user's setups and cells went into such connections for minutes)."""
    secured = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
    if secured is not None:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await secured.close()
            except Exception as exc:
                log.debug("closing a dead connection's transport: %r", exc)
    with trio.move_on_after(5):
        try:
            await conn.close()
        except Exception as exc:
            log.debug("closing a dead connection: %r", exc)


def is_relayed(conn: Any) -> bool:
    """Whether a swarm connection runs through a relay (``/p2p-circuit``)."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs or ())


class AutoNATServer:
    """py-libp2p's AutoNAT v1 server on a public node, bounded: at most
    :data:`AUTONAT_CONCURRENCY` requests served at once and one per peer (each may cost a dial
    back); the others are reset."""

    def __init__(self, host: IHost) -> None:
        from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID, AutoNATService

        self._service = AutoNATService(host, serve=False)  # type: ignore[arg-type]
        self._limit = trio.CapacityLimiter(AUTONAT_CONCURRENCY)
        self._busy: set[ID] = set()
        host.set_stream_handler(AUTONAT_PROTOCOL_ID, self._handle)

    async def _handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        if peer in self._busy:
            await stream.reset()
            return
        try:
            self._limit.acquire_nowait()
        except trio.WouldBlock:
            await stream.reset()
            return
        self._busy.add(peer)
        try:
            with trio.move_on_after(HOP_TIMEOUT):
                await self._service.handle_stream(stream)
        finally:
            self._busy.discard(peer)
            self._limit.release()


class Reachability:
    """Whether this node can be dialled: ``"public"``, ``"private"`` or ``"unknown"``
    (module docstring: AutoNAT v1 asked of up to 3 verifiers, majority of those that
    answered; or as configured)."""

    def __init__(self, host: IHost, mode: str) -> None:
        self.host = host
        self.mode = mode
        self.status = mode if mode in ("public", "private") else "unknown"

    async def check(self, servers: Sequence[bytes]) -> str:
        """Ask up to 3 of ``servers`` (peer IDs, connected) and update :attr:`status`."""
        if self.mode != "auto":
            return self.status
        from libp2p.host.autonat.autonat import AutoNATService
        from libp2p.host.autonat.pb.autonat_pb2 import Message

        client = AutoNATService(self.host, serve=False)  # type: ignore[arg-type]
        yes = no = 0
        addrs = [a.to_bytes() for a in self.host.get_addrs()]
        for server in list(servers)[:3]:
            try:
                status, _ = await client.query_server(ID(server), addrs, timeout=HOP_TIMEOUT)
            except Exception as exc:
                log.debug("AutoNAT query to %s failed: %r", ID(server), exc)
                continue
            if status == int(Message.OK):
                yes += 1
            else:
                no += 1
        if yes > no:
            self.status = "public"
        elif no > yes:
            self.status = "private"
        if yes or no:
            log.info("reachability %s (%d verifiers dialled back, %d could not)",
                     self.status, yes, no)
        return self.status


class ReservationKeeper:
    """A private node's reservations on public relays (module docstring).

    Args:
        host: the node's host.
        config: ``[circuit_relay]``.
        candidates: () -> [(peer ID, its record's addresses as text multiaddrs)] of the public
            nodes that may be asked (verifiers and public users of the directory).

    Attributes:
        on_address_changed: () -> None, called when no relay answered (this node's address
            changed): the node's overlay abandons its setups in flight
            (:meth:`ps_p2p.protocols.overlay.OverlayService.address_changed`); None: nobody.
    """

    def __init__(self, host: IHost, config: CircuitRelayConfig,
                 candidates: Callable[[], list[tuple[bytes, list[str]]]],
                 ) -> None:
        self.host = host
        self.config = config
        self.candidates = candidates
        self._held: dict[bytes, tuple[float, str]] = {}  # relay -> (renew at, relay address)
        self._failed: dict[bytes, float] = {}  # relay -> retry not before
        self._checked = -math.inf  # when the relays were last pinged
        self.on_address_changed: Callable[[], None] | None = None

    def advertised(self) -> list[str]:
        """The circuit addresses this node's record lists (one per reservation held)."""
        return [circuit_multiaddr(addr, ID(relay)) for relay, (_, addr) in sorted(self._held.items())]

    async def step(self) -> None:
        """Drop reservations whose relay connection closed, renew those due, and hold
        ``config.reservations`` on the best-ranked candidates that grant one
        (:func:`~ps_p2p.overlay.circuit_limits.rank_relays`): a better-ranked candidate that
        appeared (the directory fills after a node starts) replaces the worst held one, so the
        private nodes do not all stay on the first public nodes they saw."""
        now = trio.current_time()
        if now - self._checked >= RESERVATION_CHECK_INTERVAL:
            self._checked = now
            await self.check_alive()
        for relay in list(self._held):
            if not is_connected(self.host, relay):
                log.info("reservation on %s lost (connection closed)", ID(relay))
                del self._held[relay]
        for relay, (renew_at, addr) in list(self._held.items()):
            if now >= renew_at and not await self._reserve(relay, addr):
                self._held.pop(relay, None)
        me = self.host.get_id().to_bytes()
        addrs_of = {p: a for p, a in self.candidates() if a and p != me}
        ranked = rank_relays(me, addrs_of)
        rank = {r: i for i, r in enumerate(ranked)}
        want = self.config.reservations
        usable = [r for r in ranked if r in self._held or self._failed.get(r, 0.0) <= now]
        for peer in usable[:want]:
            if peer in self._held:
                continue
            addrs = addrs_of[peer]
            store = self.host.get_peerstore()
            try:
                known = store.addrs(ID(peer))
            except Exception:
                known = []
            if not known:
                store.add_addrs(ID(peer), [multiaddr.Multiaddr(a) for a in addrs], 600)
            await self._reserve(peer, addrs[0])
        held = sorted(self._held, key=lambda r: rank.get(r, len(rank)))
        for worse in held[want:]:  # no longer advertised; its slot there expires or is reused
            log.info("reservation on %s given up for a better-ranked relay", ID(worse))
            del self._held[worse]
        for relay in [r for r, t in self._failed.items() if t <= now]:
            del self._failed[relay]

    async def check_alive(self) -> list[bytes]:
        """Ping every held reservation's relay (libp2p ping, :data:`HOP_TIMEOUT` each, at once);
        close the connections of those that do not answer, so their reservations are dropped
        and taken again on a fresh dial. When none answers, this node's own address changed
        (its NAT took a new public IP or mapping: every connection it had died at once, and TCP
        says nothing to either end) or its uplink failed: every connection that read nothing
        while the pings were out is closed too, so the overlay rebuilds its paths and links on
        fresh dials from the new address at once instead of after the keepalive (up to
        ``KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT`` = 60 s of silence, :mod:`ps_p2p.protocols.host`).
        A relay that is slow but alive answers within :data:`HOP_TIMEOUT`, the bound every
        relay exchange here already has. Returns the relays found silent."""
        held = list(self._held)
        if not held:
            return []
        sent = trio.current_time()
        alive: dict[bytes, bool] = {}

        async def check(relay: bytes) -> None:
            alive[relay] = await ping(self.host, ID(relay))

        async with trio.open_nursery() as nursery:
            for relay in held:
                nursery.start_soon(check, relay)
        silent = [r for r in held if not alive.get(r)]
        if not silent:
            return []
        for relay in silent:
            log.info("reservation on %s: relay silent for %.0f s, its connection closed",
                     ID(relay), HOP_TIMEOUT)
            self._held.pop(relay, None)
            await _close_peer(self.host, ID(relay))
        if len(silent) == len(held):
            stale = []
            for peer, conns in list(self.host.get_network().get_connections_map().items()):
                for conn in conns:
                    heard = last_heard(conn)
                    if heard is None or heard < sent:
                        stale.append((peer, conn))
            log.warning("no relay of this node's %d reservations answered: its address changed "
                        "or its uplink failed; %d silent connections closed", len(held),
                        len(stale))
            for _, conn in stale:
                await close_connection(conn)
            if self.on_address_changed is not None:
                self.on_address_changed()
        return silent

    async def _reserve(self, relay: bytes, addr: str) -> bool:
        now = trio.current_time()
        try:
            await reserve(self.host, ID(relay))
        except Exception as exc:
            log.info("reservation on %s failed: %r", ID(relay), exc)
            self._failed[relay] = now + 30.0
            return False
        self._held[relay] = (now + self.config.reservation_ttl / 2, addr)
        log.info("reservation on relay %s (%d held)", ID(relay), len(self._held))
        return True


#: Seconds a node in ``reachability = "auto"`` waits for AutoNAT verdicts before it registers
#: its listen addresses anyway (no verifier answered: it is taken for public meanwhile).
AUTONAT_GRACE = 15.0


def _is_loopback_only(host: IHost) -> bool:
    import ipaddress

    ips = []
    for addr in host.get_transport_addrs():
        for proto in ("ip4", "ip6"):
            try:
                ips.append(ipaddress.ip_address(addr.value_for_protocol(proto)))
            except Exception:
                continue
    return bool(ips) and all(ip.is_loopback for ip in ips)


def relay_candidates(directory: Any, me: bytes) -> list[tuple[bytes, list[str]]]:
    """The public nodes of ``directory`` a private node may reserve on: verifiers and users
    with a direct (non-circuit) address, never model nodes (module docstring), not ``me``;
    each with its direct addresses as text multiaddrs."""
    from ps_p2p.records import Role

    out = []
    for record in getattr(directory, "records", ()):
        if record.peer_id == me or Role.MODEL in record.roles:
            continue
        if not record.roles & {Role.VERIFIER, Role.USER}:
            continue
        direct = []
        for raw in record.addrs:
            try:
                text = str(multiaddr.Multiaddr(raw))
            except Exception:
                continue
            if "p2p-circuit" not in text:
                direct.append(text)
        if direct:
            out.append((record.peer_id, direct))
    return out


class NatSupport:
    """What a node runs for NATed nodes (module docstring), whatever its own reachability:
    the relay server (hop for others when ``config.serve``, stop for circuits to itself),
    circuit dialing, the AutoNAT server on verifiers, and, once found private, the
    reservations and the circuit addresses its record lists.

    Args:
        host: the node's host.
        config: ``[circuit_relay]``.
        directory: () -> the node's current directory (or None).
        verifiers: () -> the verifiers' peer IDs (AutoNAT servers).
        verifier: this node is a verifier (serves AutoNAT; always public).
        reserve: take reservations once private (False for a node that registers no record:
            nobody dials it, and its reservations would hold the relays' newcomer slots,
            :class:`~ps_p2p.overlay.circuit_limits.CircuitRelayConfig`, for ever).
        embedded: the host is another application's (``ps_p2p.attach``): only the client
            side runs (AutoNAT client, reservations, circuit addresses, circuit dialing, the
            stale-connection closer, and the circuit STOP handler unless the application
            serves it already); no hop (this host relays nobody's circuits), no AutoNAT
            server, no DCUtR, since they would add protocols the application did not choose.
    """

    def __init__(self, host: IHost, config: CircuitRelayConfig, *,
                 directory: Callable[[], Any], verifiers: Callable[[], Sequence[bytes]],
                 verifier: bool, reserve: bool = True, embedded: bool = False) -> None:
        if embedded:
            config = dataclasses.replace(config, serve=False)
        self.host = host
        self.config = config
        self.directory = directory
        self.verifiers = verifiers
        self.verifier = verifier
        self.reserve = reserve
        self.embedded = embedded
        mode = "public" if verifier else config.reachability
        if mode == "auto" and _is_loopback_only(host):
            mode = "public"  # every node on one machine (a devnet): nothing to ask
        self.reachability = Reachability(host, mode)
        self.server = RelayServer(host, config, listed=self._listed)
        me = host.get_id().to_bytes()
        self.keeper = ReservationKeeper(host, config,
                                        lambda: relay_candidates(self.directory(), me))
        self._started = 0.0
        self._changed = False
        #: DCUtR hole punches this node started (py-libp2p's auto-drive) and those that gave
        #: a direct connection
        self.punches = 0
        self.punched = 0
        #: of them, those between two NATed nodes (a real hole punch through both NATs)
        self.nat_punches = 0
        self.nat_punched = 0
        self.dcutr: Any = None

    def _listed(self, peer: bytes) -> bool:
        """Whether the node's current directory lists ``peer`` (in any role)."""
        directory = self.directory()
        return directory is not None and directory.record(peer) is not None

    @property
    def private(self) -> bool:
        return self.reachability.status == "private"

    def advertised(self, listen_addrs: Sequence[str]) -> list[str]:
        """The addresses this node's record lists: its circuit addresses when private, else
        ``listen_addrs``."""
        return self.keeper.advertised() if self.private else list(listen_addrs)

    def may_register(self) -> bool:
        """Whether the record is worth registering now: public, private with a reservation,
        or no verdict after :data:`AUTONAT_GRACE` seconds."""
        status = self.reachability.status
        if status == "private":
            return bool(self.keeper.advertised())
        return status == "public" or trio.current_time() - self._started >= AUTONAT_GRACE

    def status(self) -> dict[str, Any]:
        """For the status file: reachability, reservations held (private) and granted
        (relay), relayed connections open now, and the DCUtR upgrades this node started (all,
        and those to another NATed node: real hole punches), tried and direct."""
        conns = self.host.get_network().get_connections()
        return {
            "reachability": self.reachability.status,
            "circuit_addrs": self.keeper.advertised() if self.private else [],
            "reservations_granted": self.server.book.reservations(trio.current_time()),
            "reservations_unlisted": self.server.book.unlisted_reservations(),
            "circuits_relayed": self.server.book.circuits(),
            "relayed_connections": sum(1 for c in conns if is_relayed(c)),
            "hole_punches": self.punches,
            "hole_punches_direct": self.punched,
            "nat_hole_punches": self.nat_punches,
            "nat_hole_punches_direct": self.nat_punched,
        }

    def _count_punches(self, dcutr: Any) -> None:
        original = dcutr.initiate_hole_punch

        async def initiate_hole_punch(peer_id: ID) -> bool:
            if await dcutr._have_direct_connection(peer_id):
                return True  # py-libp2p's auto-drive asks again for upgraded peers: no attempt
            # both ends NATed (a real hole punch), or one public (then the NATed end dials
            # out: a connection reversal)
            both = self.private and peer_id in getattr(self.host.get_network(),
                                                       "_ps_circuits", {})
            if both and not self.config.nat_hole_punch:
                return False  # cannot succeed between two ps_p2p nodes (CircuitRelayConfig)
            self.punches += 1
            self.nat_punches += both
            ok = bool(await original(peer_id))
            self.punched += ok
            self.nat_punched += ok and both
            log.info("DCUtR %s to %s: %s", "hole punch" if both else "upgrade", peer_id,
                     "direct" if ok else "failed")
            return ok

        dcutr.initiate_hole_punch = initiate_hole_punch

        async def close_relayed_when_idle(peer_id: ID, grace: float = RELAY_IDLE_CHECK) -> None:
            # py-libp2p closes the relayed connections 60 s after an upgrade, whatever they
            # carry: every overlay link on them (and each path through it) died then. New
            # streams prefer the direct connection (py-libp2p's connection choice), so a
            # relayed one is closed here once it carries no stream; while the direct one lasts.
            network = self.host.get_network()
            while True:
                await trio.sleep(grace)
                if not await dcutr._verify_direct_connection(peer_id):
                    return
                relayed = [c for c in network.get_connections(peer_id) if is_relayed(c)]
                if not relayed:
                    return
                for conn in relayed:
                    if not conn.get_streams():
                        log.debug("closing the idle relayed connection to %s", peer_id)
                        await conn.close()

        dcutr._close_relayed_conns_after_grace = close_relayed_when_idle

    def take_changed(self) -> bool:
        """True once after the advertised addresses changed (register again now)."""
        changed, self._changed = self._changed, False
        return changed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: the relay server (stop only when ``embedded``), circuit dialing,
        the stale-connection closer, AutoNAT (server on a verifier, client until the verdict)
        and, once private, the reservations. Leaves the host as it found it, but for the
        circuit dialing (:func:`~ps_p2p.protocols.addresses.install_dial_fallback`, which
        only acts for peers listed by ``/p2p-circuit`` addresses or on a failed dial)."""
        from contextlib import AsyncExitStack

        from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
        from libp2p.tools.anyio_service.context import background_trio_service

        from ps_p2p.protocols.addresses import (
            install_circuit_dialing,
            install_dial_fallback,
        )
        from ps_p2p.protocols.handlers import registered_protocols

        self._started = trio.current_time()
        network = self.host.get_network()
        install_dial_fallback(network)  # our own hosts have it from open_host already
        install_circuit_dialing(self.host)
        async with trio.open_nursery() as closers, AsyncExitStack() as stack:
            if not (self.embedded and str(STOP_PROTOCOL_ID) in registered_protocols(self.host)):
                # (an application that runs its own relay client accepts circuits for us)
                await stack.enter_async_context(background_trio_service(self.server))
            if not self.embedded:
                if self.verifier:
                    AutoNATServer(self.host)
                from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

                self.dcutr = DCUtRProtocol(self.host)
                self._count_punches(self.dcutr)
                await stack.enter_async_context(background_trio_service(self.dcutr))
            closer = StaleConnectionCloser(closers)
            network.register_notifee(closer)
            stack.callback(_unregister_notifee, network, closer)
            task_status.started()
            await self._reach_and_reserve()

    async def _reach_and_reserve(self) -> None:
        wait = 1.0
        while self.reachability.status == "unknown":
            servers = [v for v in self.verifiers() if v != self.host.get_id().to_bytes()]
            if servers:
                await self.reachability.check(servers)
            if self.reachability.status != "unknown":
                break
            await trio.sleep(wait)
            wait = min(wait * 2, 30.0)
        if self.private and not self.reserve:
            log.info("this node is behind a NAT and registers no record: no reservations")
        elif self.private:
            self._changed = True
            log.info("this node is behind a NAT: it reserves slots on %d relays",
                     self.config.reservations)
            while True:
                before = self.keeper.advertised()
                await self.keeper.step()
                if self.keeper.advertised() != before:
                    self._changed = True
                held = len(self.keeper.advertised())
                await trio.sleep(1.0 if held < self.config.reservations else 5.0)
        await trio.sleep_forever()


def _unregister_notifee(network: Any, notifee: Any) -> None:
    """Unregister ``notifee`` (py-libp2p 0.8.1: ``Swarm.remove_notifee``; else the list)."""
    remove = getattr(network, "remove_notifee", None)
    if remove is not None:
        remove(notifee)
    elif notifee in getattr(network, "notifees", []):
        network.notifees.remove(notifee)


__all__ = [
    "AUTONAT_CONCURRENCY",
    "AUTONAT_GRACE",
    "HOP_TIMEOUT",
    "PINNED_LIBP2P",
    "REDIAL_PING_FLOOR",
    "REDIAL_STALE_AFTER",
    "RESERVATION_CHECK_INTERVAL",
    "AutoNATServer",
    "NatSupport",
    "Reachability",
    "RelayServer",
    "ReservationKeeper",
    "StaleConnectionCloser",
    "circuit_multiaddr",
    "close_connection",
    "dial_circuit",
    "is_relayed",
    "parse_circuit",
    "ping",
    "relay_candidates",
    "reserve",
]
