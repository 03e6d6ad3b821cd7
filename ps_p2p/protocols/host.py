"""py-libp2p hosts the way every PlanetServe role runs them: TCP + Noise + Yamux, nothing else.

:func:`open_host` builds and runs a host (an async context manager) with

* only the Noise security transport (``/noise``): a dialer offering ``/plaintext/2.0.0``, secio or
  TLS cannot negotiate and is refused;
* only the Yamux stream muxer (Mplex is ~5x slower for bulk data);
* the default ping (``/ipfs/ping/1.0.0``) and identify handlers of ``BasicHost``;
* the 250 ms happy-eyeballs dial delay of py-libp2p 0.8.1 removed (a dial then takes ~7 ms on
  loopback), and the auto-connector limited so it does not dial every known peer;
* Yamux receive windows returned as go-yamux does, in one WINDOW_UPDATE once half the window is
  consumed, instead of one per read (``PY_YAMUX_RELEASE_ON_READ=0`` and
  :func:`_return_window_at_half`): a third fewer messages per anonymous round trip (60 -> 41) and
  almost half fewer at rest, when probes are the only traffic;
* connection limits that are released when a connection closes: at most
  ``max_connections_per_peer`` (default 8) connections per peer ID, over which the newest inbound
  connection is closed, and ``max_connections`` (default 1024) in all, over which py-libp2p refuses
  the newest connection, inbound or outbound (identities are free, so both bounds are needed);
* TCP listeners opened without ``SO_REUSEPORT``, and :func:`open_host` raising ``OSError`` when a
  listen address is already in use instead of sharing the port with whoever holds it;
* inbound connections bounded by remote address (:mod:`ps_p2p.protocols.admission`,
  :class:`~ps_p2p.protocols.admission.InboundLimits`): at most 8 handshakes in progress per IP and
  32 per /24, 32 open connections per IP and 128 per /24 (IPv6: per /64 and /48), a handshake
  closed 5 s after the accept (py-libp2p: 10 s), every count given back when the connection ends,
  however it ends (:class:`_InboundConnectionGuard`);
* py-libp2p's own connection tracker turned off (a hidden cap of 256 established inbound
  connections under ``max_connections``, with no per-address bound, so 256 abandoned connections
  shut a node to everybody; docs/upstream/py-libp2p-inbound-connection-limits.md): the limits
  above and ``max_connections`` replace it;
* a keepalive on every Yamux connection (:func:`_keepalive_loop`): a connection that has received
  nothing for :data:`KEEPALIVE_INTERVAL` seconds is pinged, and closed when it still has received
  nothing :data:`KEEPALIVE_TIMEOUT` seconds later, so a peer that vanished without a FIN (or
  stopped reading) gives its place back within about a minute instead of holding it for ever;
* py-libp2p's per-message costs trimmed (:mod:`ps_p2p.protocols.libp2p_patches`: no debug
  formatting unless DEBUG is on, one socket read per Noise message, uncontended locks without
  a schedule point but on every 32nd), each patch pinned to py-libp2p 0.8.1's source.

The module-level settings above (the dial delay, the Yamux window updates, RTT pings and keepalive,
the listener without ``SO_REUSEPORT``) are installed when this module is imported and hold for every
py-libp2p host of the process, an application's own included (they change no wire format); the
per-host ones are :func:`tune_host`'s.

Source: DESIGN.md "py-libp2p 0.8.1: measured pitfalls".

Upstream bug (py-libp2p 0.8.1; this module works around it, see :class:`_InboundConnectionGuard`)
--------------------------------------------------------------------------------------------------

*What.* A node accepts only ``max_connections - min_connections`` inbound connections (300 with
the defaults) in its whole lifetime; every later inbound connection is closed at once, before its
handshake, so the node is unreachable until it restarts, whoever dials it and however few
connections are open.

*Where.* ``libp2p/network/swarm.py``: ``Swarm._handle_inbound_connection`` takes a token of
``self._inbound_limiter`` (a ``trio.CapacityLimiter`` sized in ``_init_connection_management``)
with ``acquire_nowait()`` and returns it in a ``finally`` after ``_do_handle_inbound_connection``
returns. That method, once ``upgrade_inbound_raw_conn`` succeeded, waits on
``await self.manager.wait_finished()`` ("Intentional barrier: keep handler alive"), i.e. until the
swarm stops, not until the connection closes. So a token is held for the swarm's lifetime for
every inbound connection that ever completed its handshake (and its handler task, with its raw
connection, stays in memory as long).

*Reproduction.* Start a host with the default ``ConnectionConfig(min_connections=0)``; from a
second host, 300 times: connect, open a ping stream, disconnect. The 301st connect fails
(``SwarmDialAllFailedError``: "failed to negotiate the secure protocol", the listener closed the
socket) although the listener has 0 open connections;
``swarm._inbound_limiter.statistics().borrowed_tokens`` is 300.

*Proposed fix.* In ``_do_handle_inbound_connection``, wait for the connection's end instead of
the swarm's: ``await muxed_conn.event_closed.wait()`` (``upgrade_inbound_raw_conn`` returns the
muxed connection; the swarm's shutdown closes all connections, so the handler still ends then),
and the same for pre-multiplexed (QUIC) connections. A regression test: more than
``max_connections`` sequential connect-and-close dials, then one more connect must succeed.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, IMuxedConn
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network import swarm as _swarm
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.rcmgr.manager import ResourceLimits, ResourceManager
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux import yamux as _yamux_module
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.transport.tcp import tcp as _tcp

from ps_p2p.errors import AddressInUseError, ConfigError
from ps_p2p.keys import Identity
from ps_p2p.networks import network_key, parse_ip
from ps_p2p.protocols.addresses import ReidentifyNotifee, install_dial_fallback
from ps_p2p.protocols.admission import InboundAdmission, InboundLimits, Ticket
from ps_p2p.protocols.libp2p_patches import install as _install_libp2p_patches

log = logging.getLogger(__name__)

# py-libp2p waits 250 ms before every dial even when the first address works.
_swarm._HAPPY_EYEBALLS_DELAY = 0.0

# py-libp2p's Yamux sends a WINDOW_UPDATE after every read by default ("release on read"): one
# extra Noise message per cell on every link, ~30 of the ~65 messages of an anonymous round trip
# (32 cell transfers are the minimum). The variable is read at every read, so setting it here is
# enough; an operator's own setting wins.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")


async def _return_window_at_half(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """Give the peer back receive window the way go-yamux does (``sendWindowUpdate``): only once
    at least half of the target window has been consumed, in one WINDOW_UPDATE.

    py-libp2p 0.8.1's own version has a "partial slack" branch that, with release-on-read off,
    still answers almost every read with a WINDOW_UPDATE (and credits twice the bytes read):
    measured on a 9-host localnet at rest, 450 of its 990 Yamux frames a second were window
    updates. The Yamux spec (hashicorp/yamux spec.md, "Flow Control") leaves the moment to the
    receiver; half a window keeps the sender from ever stalling on a window that is not full.
    """
    del bytes_read  # what was read shows in the buffer: the window is recomputed from it
    increment = 0
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        missing = self.target_recv_window - (self.recv_window + buffered)
        # half the target (py-libp2p's _grow_threshold() reads an environment variable on
        # every call: 3% of a round trip's CPU)
        if missing > 0 and missing >= self.target_recv_window // 2:
            increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
    if increment > 0:
        await self.send_window_update(increment, skip_lock=True)


YamuxStream._auto_tune_and_send_window_update = _return_window_at_half  # type: ignore[method-assign]

# Every Yamux connection pings its peer every 30 s to measure the RTT that only the window
# auto-tuning reads (both ends do; py-libp2p 0.8.1 ``_measure_rtt_loop``, read per iteration). A
# user relays for dozens of peers, so at rest these pings were a quarter of all messages of a
# 32-host localnet (70 of 258 a second); every 2 minutes is enough for the window.
_yamux_module.RTT_MEASURE_INTERVAL = 120

KEEPALIVE_INTERVAL = 30.0
"""Seconds without a received Yamux frame after which a connection is pinged (go-yamux's
``KeepAliveInterval``); read at every iteration of :func:`_keepalive_loop`."""

KEEPALIVE_TIMEOUT = 30.0
"""Seconds a pinged connection may stay silent before it is closed (a busy peer on a starved
machine answers late, not never: twice go-yamux's 10 s write timeout, see DESIGN.md "a starved
machine must not tear down working paths")."""

_LAST_READ = "_ps_last_read"
"""Attribute stamped on a Yamux connection's secured connection at every frame read from it."""

_read_exactly = _yamux_module.read_exactly


async def _read_exactly_stamped(reader: Any, n: int, *args: Any, **kwargs: Any) -> bytes:
    """py-libp2p's ``read_exactly`` as Yamux calls it (on its secured connection), recording
    when the peer was last heard from (one clock read per frame)."""
    data = await _read_exactly(reader, n, *args, **kwargs)
    try:
        setattr(reader, _LAST_READ, trio.current_time())
    except AttributeError:  # pragma: no cover - a secured connection with __slots__
        pass
    return data


async def _keepalive_loop(self: Yamux) -> None:
    """Replacement for py-libp2p 0.8.1's ``Yamux._measure_rtt_loop`` (one task per connection).

    Pings when the RTT estimate is due (every ``RTT_MEASURE_INTERVAL``) or when nothing was
    received for :data:`KEEPALIVE_INTERVAL` seconds; if then nothing at all (no pong, no other
    frame) arrives within :data:`KEEPALIVE_TIMEOUT`, closes the secured connection, which makes
    Yamux's reader fail and run its usual teardown (streams reset, the swarm's connection
    removed, every count released). py-libp2p's loop waits 10 s for a pong and carries on: a
    peer that vanished without a FIN, or never reads, held its connection (and the listener's
    slot) until TCP gave up, which it never does while the peer's kernel acknowledges.
    """
    await trio.sleep(0.5)  # as py-libp2p's: let the connection settle
    secured = self.secured_conn
    started = trio.current_time()
    last_rtt = -math.inf
    while not self.event_shutting_down.is_set():
        now = trio.current_time()
        heard = getattr(secured, _LAST_READ, started)
        rtt_due = now - last_rtt >= _yamux_module.RTT_MEASURE_INTERVAL
        if rtt_due or now - heard >= KEEPALIVE_INTERVAL:
            try:
                self._ping_id += 1
                self._ping_event = trio.Event()
                header = _yamux_module.struct.pack(
                    _yamux_module.YAMUX_HEADER_FORMAT, 0, _yamux_module.TYPE_PING,
                    _yamux_module.FLAG_SYN, 0, self._ping_id,
                )
                sent = trio.current_time()
                written = False
                with trio.move_on_after(KEEPALIVE_TIMEOUT):
                    await self._write_frame(header)
                    written = True
                    self._ping_sent_time = trio.current_time()
                    last_rtt = self._ping_sent_time
                    await self._ping_event.wait()
            except Exception:
                return  # the connection is closing: its reader tears it down
            silent = getattr(secured, _LAST_READ, started) < sent and not self._ping_event.is_set()
            if silent or not written:  # not written: the peer reads nothing (a full window)
                log.debug(
                    "closing the connection to %s: silent for %.0f s after a ping",
                    self.peer_id, KEEPALIVE_TIMEOUT,
                )
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    try:
                        await secured.close()
                    except Exception as exc:
                        log.debug("closing a silent connection: %r", exc)
                return
            heard = getattr(secured, _LAST_READ, started)
        now = trio.current_time()
        wake = min(last_rtt + _yamux_module.RTT_MEASURE_INTERVAL, heard + KEEPALIVE_INTERVAL)
        with trio.move_on_at(max(wake, now + 0.05)):
            await self.event_shutting_down.wait()


if not (hasattr(Yamux, "_measure_rtt_loop") and hasattr(_yamux_module, "read_exactly")):
    raise ImportError("py-libp2p's Yamux changed: see host.py _keepalive_loop")  # pragma: no cover
Yamux._measure_rtt_loop = _keepalive_loop  # type: ignore[method-assign]
_yamux_module.read_exactly = _read_exactly_stamped

# py-libp2p 0.8.1's per-message schedule points, eager debug formatting and split reads
# (version-pinned, each refused with a warning on another py-libp2p; PS_LIBP2P_PATCHES selects)
_install_libp2p_patches()

DEFAULT_MAX_CONNECTIONS = 1024
"""Connections (inbound + outbound) a host keeps at most; a newer one over it is refused."""

DEFAULT_MAX_CONNECTIONS_PER_PEER = 8
"""Connections to one peer ID a host keeps at most; a newer inbound one over it is closed."""

_OVER_LIMIT_LOG_INTERVAL = 60.0
"""Seconds between two INFO lines about the same peer going over its connection limit."""

_OVER_LIMIT_LOG_PEERS = 4096
"""Peers whose last over-limit report is remembered (oldest forgotten first: sybils are free)."""


async def _open_exclusive_tcp_listeners(
    host: str | None, port: int
) -> list[trio.SocketListener]:
    """Replacement for py-libp2p's ``_open_reuseport_listeners``: no ``SO_REUSEPORT``.

    py-libp2p 0.8.1 sets ``SO_REUSEPORT`` on its listening sockets (for TCP hole punching, which
    we do not use), so a second process binds the same port without an error and the kernel
    splits the incoming connections between the two. ``trio.open_tcp_listeners`` sets only
    ``SO_REUSEADDR`` (a restart may reuse a port in TIME_WAIT) and raises ``OSError``
    (``EADDRINUSE``) when another socket listens on the port, whether or not that socket has
    ``SO_REUSEPORT``; and because ours lacks it, nobody can join our port later either.

    Installed for every py-libp2p host of the process (the module global that py-libp2p's
    ``TCPListener.listen`` calls); hole punching from the listen port (DCUtR) then falls back to
    an ephemeral source port, as py-libp2p does where ``SO_REUSEPORT`` is missing.
    """
    return await trio.open_tcp_listeners(port, host=host)


if not hasattr(_tcp, "_open_reuseport_listeners"):  # pragma: no cover - guards a version bump
    raise ImportError("libp2p.transport.tcp.tcp._open_reuseport_listeners is gone: see host.py")
_tcp._open_reuseport_listeners = _open_exclusive_tcp_listeners


def parse_multiaddr(text: str) -> multiaddr.Multiaddr:
    """Parse a multiaddr string.

    Raises:
        ConfigError: not a valid multiaddr.
    """
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:
        raise ConfigError(f"bad multiaddr {text!r}: {exc}") from exc


def _resource_manager() -> ResourceManager:
    """py-libp2p's resource manager with its connection accounting left out.

    Kept for its cap on streams (10,000 open in all). Left out, because the host's own bounds
    (``max_connections``, :class:`_InboundConnectionGuard`) replace them and they misbehave: the
    connection tracker (256 established inbound, an entry per connection that is not always
    removed: "Established inbound limit exceeded: 256 >= 256" on a node with few connections
    open), the per-peer-ID rate limiter (identities are free), the circuit breaker and the
    "graceful degradation" that lower limits under load, and per-peer metrics kept for ever.
    """
    return ResourceManager(
        limits=ResourceLimits(max_connections=2**31 - 1),  # max_connections is the swarm's
        enable_metrics=False,
        enable_connection_tracking=False,
        enable_memory_pooling=False,
        enable_circuit_breaker=False,
        enable_graceful_degradation=False,
        enable_rate_limiting=False,
    )


def build_host(
    identity: Identity,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER,
    inbound: InboundLimits | None = None,
) -> IHost:
    """A host for ``identity`` speaking TCP + Noise + Yamux only (not yet listening).

    Args:
        max_connections: connections (both directions) kept at most; py-libp2p closes the newest
            one over it (an outbound dial then fails with ``SwarmException``).
        max_connections_per_peer: connections to one peer ID kept at most; the newest inbound
            one over it is closed, with an INFO line at most once a minute per peer.
        inbound: bounds on inbound connections per remote address and the handshake deadline
            (default :class:`~ps_p2p.protocols.admission.InboundLimits`: nothing exempt).

    Raises:
        ConfigError: a limit below 1, or ``max_connections_per_peer > max_connections``.
    """
    if not 1 <= max_connections_per_peer <= max_connections:
        raise ConfigError(
            f"need 1 <= max_connections_per_peer ({max_connections_per_peer}) <= "
            f"max_connections ({max_connections})"
        )
    inbound = inbound if inbound is not None else InboundLimits()
    key_pair = identity.libp2p_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        connection_config=ConnectionConfig(
            min_connections=0,
            low_watermark=0,
            high_watermark=max_connections,  # the pruner never runs below the hard cap
            max_connections=max_connections,
            # py-libp2p's own per-peer trim spares connections younger than its 20 s grace
            # period, so it cannot stop a burst; _InboundConnectionGuard enforces the per-peer
            # limit at once, and this only caps what one dial_peer call returns.
            max_connections_per_peer=max_connections,
            inbound_upgrade_timeout=inbound.handshake_timeout,
        ),
        resource_manager=_resource_manager(),
        enable_mDNS=False,
    )
    tune_host(host, max_connections_per_peer=max_connections_per_peer, inbound=inbound)
    return host


def tune_host(
    host: IHost,
    *,
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER,
    inbound: InboundLimits | None = None,
) -> None:
    """Apply to ``host`` what :func:`build_host` adds after py-libp2p's ``new_host``.

    Every host :func:`build_host` makes gets it; an application that embeds ps_p2p in a host of
    its own (docs/embedding.md) may call it on that host, before ``host.run``, to get the same
    behaviour; :func:`ps_p2p.node.attach` never calls it (these settings change how the
    application's own dials and connections behave):

    * a failed dial is retried once after 50 ms (py-libp2p: 3 times with back-off, ~0.7 s per
      unreachable peer);
    * the auto-connector never dials peers by itself (py-libp2p dials peerstore peers up to the
      midpoint of the connection watermarks; the directory puts every node's address there);
    * the inbound connection slot is released when the connection closes, and at most
      ``max_connections_per_peer`` connections per peer ID are kept
      (:class:`_InboundConnectionGuard`);
    * inbound connections are bounded per remote address by ``inbound`` (default
      :class:`~ps_p2p.protocols.admission.InboundLimits`), and a handshake not done
      ``inbound.handshake_timeout`` seconds after the accept is closed;
    * py-libp2p's connection tracker (a 256-inbound cap whose slots leak) is turned off;
    * a failed dial tries the peer's other known addresses, and a peer whose last connection
      closed is identified again on its next one (:mod:`ps_p2p.protocols.addresses`).

    Raises:
        ConfigError: ``max_connections_per_peer`` below 1.
    """
    if max_connections_per_peer < 1:
        raise ConfigError(f"max_connections_per_peer must be >= 1, not {max_connections_per_peer}")
    inbound = inbound if inbound is not None else InboundLimits()
    # A dead relay must be noticed in well under a second: one quick retry, not three with
    # exponential back-off (py-libp2p's default costs ~0.7 s per unreachable peer).
    network = host.get_network()
    network.retry_config = RetryConfig(max_retries=1, initial_delay=0.05)  # type: ignore[attr-defined]
    # The auto-connector dials every peer in the peerstore up to the midpoint of the watermarks
    # (150 by default) whatever ConnectionConfig says; the overlay dials the peers it needs.
    network.auto_connector.maybe_connect = _no_auto_connect  # type: ignore[attr-defined]
    network.connection_config.inbound_upgrade_timeout = inbound.handshake_timeout  # type: ignore[attr-defined]
    manager = getattr(network, "_resource_manager", None)
    if manager is not None:  # its tracker's slots leak (module docstring): the guard bounds
        manager.connection_lifecycle = None
        manager.connection_tracker = None
    _InboundConnectionGuard(network, max_connections_per_peer, inbound).install()  # type: ignore[arg-type]
    # a peer restarted elsewhere: try its other addresses, re-identify it on reconnection
    install_dial_fallback(network)
    network.register_notifee(ReidentifyNotifee(host))


async def _no_auto_connect(*args: object, **kwargs: object) -> None:
    return None


@asynccontextmanager
async def open_host(
    identity: Identity,
    listen: Sequence[str],
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER,
    inbound: InboundLimits | None = None,
) -> AsyncIterator[IHost]:
    """Run a host listening on ``listen`` (multiaddr strings; ``tcp/0`` picks a free port).

    Args:
        identity: the host's key pair and peer ID.
        listen: multiaddrs to listen on; every one must be bound, or nothing runs.
        max_connections: see :func:`build_host` (default 1024).
        max_connections_per_peer: see :func:`build_host` (default 8).
        inbound: see :func:`build_host` (default ``InboundLimits()``: nothing exempt).

    Yields:
        the running host; it stops (connections closed) when the block exits.

    Raises:
        ConfigError: a bad listen multiaddr, or bad limits.
        AddressInUseError: (an ``OSError``, ``errno`` ``EADDRINUSE``) another socket (of any
            process, ``SO_REUSEPORT`` or not) already listens on a listen address; the message
            is ``listen address <multiaddr> is already in use``.
        OSError: a listen address cannot be bound for another reason; the message names it.
    """
    addrs = [parse_multiaddr(a) for a in listen]
    host = build_host(
        identity,
        max_connections=max_connections,
        max_connections_per_peer=max_connections_per_peer,
        inbound=inbound,
    )
    unbound: list[multiaddr.Multiaddr] = []
    async with host.run(listen_addrs=addrs):
        # Swarm.listen logs a failed bind at DEBUG and carries on; check every address.
        listeners = host.get_network().listeners  # type: ignore[attr-defined]
        unbound = [addr for addr in addrs if str(addr) not in listeners]
        if not unbound:
            log.debug("host %s listening on %s", identity.peer_id_str, listen_multiaddrs(host))
            yield host
    if unbound:
        raise _listen_error(unbound[0])


def _listen_error(addr: multiaddr.Multiaddr) -> OSError:
    """Why ``addr`` could not be bound (py-libp2p drops the reason): try a plain bind of it."""
    try:
        names = {protocol.name for protocol in addr.protocols()}
        ip = addr.value_for_protocol("ip6" if "ip6" in names else "ip4")
        port = int(addr.value_for_protocol("tcp"))
    except Exception:
        return OSError(f"cannot listen on {addr}: py-libp2p has no listener for it")
    family = socket.AF_INET6 if ":" in str(ip) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as exc:
            code = exc.errno or errno.EADDRINUSE
            if code == errno.EADDRINUSE:
                return AddressInUseError(f"listen address {addr} is already in use")
            return OSError(code, f"cannot listen on {addr}: {exc.strerror}")
    return OSError(f"cannot listen on {addr}: py-libp2p's TCP listener failed (see its log)")


class _InboundConnectionClosed(Exception):
    """Ends a swarm's inbound-connection handler once its connection has closed."""


class _InboundConnectionGuard:
    """Per-swarm work-around of the lifetime inbound slot (module docstring), per-peer limit and
    per-address admission (:class:`~ps_p2p.protocols.admission.InboundAdmission`).

    Wraps two methods of one ``Swarm`` instance (py-libp2p itself is not modified):

    * ``_handle_inbound_connection`` (the listener's per-socket handler, which holds one
      ``_inbound_limiter`` token while it runs) first asks the admission for a ticket for the
      socket's remote IP (none: the socket is closed at once, before py-libp2p sees it), then
      runs with the ticket recorded under its task, and releases the ticket when it returns,
      whichever way it returns (handshake failed or timed out, connection refused or closed);
    * ``upgrade_inbound_raw_conn``, when that task calls it, counts the upgraded connection as
      established (over an established cap: closed), checks the per-peer limit on it, then
      waits until the connection closes and raises :class:`_InboundConnectionClosed`.
      ``_do_handle_inbound_connection`` logs that at DEBUG and returns, so the handler never
      reaches its wait-for-swarm-stop barrier: the token, the ticket and the task are released
      when the connection closes. A swarm that stops cancels the wait.

    Other callers of ``upgrade_inbound_raw_conn`` (hole punching's ``dial_addr_as_responder``,
    run from other tasks) are passed through unchanged.
    """

    def __init__(
        self, swarm: Swarm, max_connections_per_peer: int, inbound: InboundLimits | None = None
    ) -> None:
        self._swarm = swarm
        self._max_per_peer = max_connections_per_peer
        self.admission = InboundAdmission(inbound if inbound is not None else InboundLimits())
        self._tickets: dict[trio.lowlevel.Task, Ticket] = {}
        # peer ID -> (last INFO line at, inbound connections closed since); oldest first.
        self._over_limit: OrderedDict[ID, tuple[float, int]] = OrderedDict()
        self._refused_since_report = 0
        self._refused_reported_at = -math.inf

    def install(self) -> None:
        swarm = self._swarm
        handle: Callable[..., Awaitable[None]] = swarm._handle_inbound_connection
        upgrade: Callable[..., Awaitable[IMuxedConn]] = swarm.upgrade_inbound_raw_conn
        swarm._ps_inbound_guard = self  # type: ignore[attr-defined]  # for tests and metrics

        async def handle_inbound_connection(read_write_closer: Any, *args: Any, **kwargs: Any) -> None:
            ticket = self.admission.admit(_remote_ip(read_write_closer))
            if isinstance(ticket, str):
                self._log_refused(ticket)
                with trio.CancelScope(shield=True):
                    try:
                        await read_write_closer.close()
                    except Exception as exc:
                        log.debug("closing a refused inbound socket: %r", exc)
                return
            task = trio.lowlevel.current_task()
            self._tickets[task] = ticket
            try:
                await handle(read_write_closer, *args, **kwargs)
            finally:
                self._tickets.pop(task, None)
                self.admission.release(ticket)

        async def upgrade_inbound_raw_conn(*args: object, **kwargs: object) -> IMuxedConn:
            muxed_conn = await upgrade(*args, **kwargs)
            ticket = self._tickets.get(trio.lowlevel.current_task())
            if ticket is None:
                return muxed_conn
            refused = self.admission.establish(ticket)
            if refused is not None:
                self._log_refused(refused)
                await _close_connection(swarm, muxed_conn)
            elif self._over_peer_limit(muxed_conn):
                self._log_over_limit(muxed_conn.peer_id)
                await _close_connection(swarm, muxed_conn)
            closed = getattr(muxed_conn, "event_closed", None)  # a trio.Event on Yamux
            if closed is None:  # pragma: no cover - only Yamux is configured
                return muxed_conn
            await closed.wait()
            raise _InboundConnectionClosed(f"connection from {muxed_conn.peer_id} closed")

        swarm._handle_inbound_connection = handle_inbound_connection  # type: ignore[method-assign]
        swarm.upgrade_inbound_raw_conn = upgrade_inbound_raw_conn  # type: ignore[method-assign]

    def _log_refused(self, reason: str) -> None:
        """WARNING at most once per ``_OVER_LIMIT_LOG_INTERVAL``; the rest are counted."""
        self._refused_since_report += 1
        now = trio.current_time()
        if now - self._refused_reported_at < _OVER_LIMIT_LOG_INTERVAL:
            return
        log.warning(
            "refusing inbound connections over the per-address limits: %s (%d refused since"
            " the last report)",
            reason,
            self._refused_since_report - 1,
        )
        self._refused_reported_at = now
        self._refused_since_report = 0

    def _over_peer_limit(self, muxed_conn: IMuxedConn) -> bool:
        """Whether ``max_connections_per_peer`` open connections of the peer are older.

        Counting only the older ones (the swarm's list is in registration order) makes the
        newest connections the ones closed, whichever order the handlers run their checks in.
        """
        older_open = 0
        for conn in self._swarm.get_connections(muxed_conn.peer_id):
            if conn.muxed_conn is muxed_conn:
                return older_open >= self._max_per_peer
            if not (conn.is_closed or conn.muxed_conn.is_closed):
                older_open += 1
        return False  # no longer registered: already closed

    def _log_over_limit(self, peer_id: ID) -> None:
        """INFO at most once per ``_OVER_LIMIT_LOG_INTERVAL`` per peer; the rest are counted."""
        now = trio.current_time()
        entry = self._over_limit.get(peer_id)
        if entry is not None and now - entry[0] < _OVER_LIMIT_LOG_INTERVAL:
            self._over_limit[peer_id] = (entry[0], entry[1] + 1)  # keeps its place: by log time
            return
        self._over_limit.pop(peer_id, None)
        log.info(
            "closing an inbound connection from %s: over %d connections per peer"
            " (%d more closed since the last report)",
            peer_id,
            self._max_per_peer,
            entry[1] if entry is not None else 0,
        )
        self._over_limit[peer_id] = (now, 0)
        while len(self._over_limit) > _OVER_LIMIT_LOG_PEERS:
            self._over_limit.popitem(last=False)  # the peer reported longest ago


def _remote_ip(read_write_closer: Any) -> str | None:
    """The remote IP of an accepted socket (py-libp2p's ``TrioTCPStream``), None if unknown."""
    try:
        remote = read_write_closer.get_remote_address()
    except Exception:
        return None
    if not remote:
        return None
    return str(remote[0])


async def _close_connection(swarm: Swarm, muxed_conn: IMuxedConn) -> None:
    """Close the swarm's connection over ``muxed_conn`` (removed, peers notified)."""
    for conn in swarm.get_connections(muxed_conn.peer_id):
        if conn.muxed_conn is muxed_conn:
            await conn.close()
            return
    await muxed_conn.close()


#: Security transports a foreign host may offer (:func:`check_foreign_host`): their handshakes
#: prove that the remote holds the key of its peer ID. ``/plaintext/2.0.0`` (in py-libp2p's
#: default ``new_host``) lets a dialer claim any peer ID, and secio is deprecated by the libp2p
#: specs; a host offering either is refused.
AUTHENTICATED_SECURITY_PROTOCOLS = frozenset({str(NOISE_PROTOCOL_ID), "/tls/1.0.0"})


def host_identity(host: IHost) -> Identity:
    """The Ed25519 identity of a host that another application built (its peer ID's key).

    ps_p2p signs node records and responses with the identity key and names nodes by Ed25519
    peer IDs, so the host's key must be Ed25519 (py-libp2p's ``new_host()`` default, or
    ``key_pair=libp2p.crypto.ed25519.create_new_key_pair()``).

    Raises:
        ConfigError: the host's peerstore has no private key for its own peer ID, or the key
            is not Ed25519 (the message names its type).
    """
    from libp2p.crypto.keys import KeyType

    try:
        private = host.get_private_key()
    except Exception as exc:  # py-libp2p raises PeerStoreError when the key is missing
        raise ConfigError(f"the host has no private key for its own peer ID: {exc}") from exc
    if private is None:
        raise ConfigError("the host has no private key for its own peer ID")
    key_type = private.get_type()
    if key_type != KeyType.Ed25519:
        raise ConfigError(
            f"the host's identity key is {getattr(key_type, 'name', key_type)}; ps_p2p needs an "
            "Ed25519 identity (build the host with "
            "key_pair=libp2p.crypto.ed25519.create_new_key_pair())"
        )
    identity = Identity.from_private_bytes(private.to_bytes())
    if identity.peer_id != host.get_id().to_bytes():
        raise ConfigError("the host's private key does not match its peer ID")
    return identity


def check_foreign_host(host: IHost) -> None:
    """Refuse a host, built by another application, that our services cannot run on safely.

    Checks (py-libp2p 0.8.1's ``Swarm``; a host without these attributes is refused too):
    every security transport the host offers is in
    :data:`AUTHENTICATED_SECURITY_PROTOCOLS`, so a peer ID on a stream is the key holder's (the
    overlay refuses deliveries from, and delivers only to, peer IDs of the directory). A host
    without Yamux is accepted with a warning (Mplex is ~5x slower for bulk data).

    Raises:
        ConfigError: an unauthenticated or unknown security transport (named), or a host whose
            transports cannot be inspected.
    """
    try:
        upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
        security = [str(p) for p in upgrader.security_multistream.transports]
        muxers = [str(p) for p in upgrader.muxer_multistream.transports]
    except AttributeError as exc:
        raise ConfigError(
            f"cannot inspect the host's security transports ({exc}); ps_p2p embeds in "
            "py-libp2p BasicHost/Swarm hosts"
        ) from exc
    refused = [p for p in security if p not in AUTHENTICATED_SECURITY_PROTOCOLS]
    if refused or not security:
        raise ConfigError(
            f"the host offers security transports {refused or security} that do not "
            "authenticate peer IDs; build it with only Noise, e.g. "
            "sec_opt={NOISE_PROTOCOL_ID: noise.Transport(key_pair, noise_privkey=...)} "
            "(docs/embedding.md)"
        )
    if str(YAMUX_PROTOCOL_ID) not in muxers:
        log.warning("the host offers no Yamux (only %s): the overlay will be slow", muxers)


def is_connected(host: IHost, peer: bytes) -> bool:
    """Whether ``host`` has a connection open to ``peer`` (peer ID bytes); False for a
    malformed peer ID."""
    try:
        return bool(host.get_network().get_connections(ID(peer)))
    except Exception:  # a malformed peer ID, or a network without the call
        return False


def last_heard(conn: Any) -> float | None:
    """trio time of the last Yamux frame read on a swarm connection (or muxed connection)
    ``conn`` (:func:`_keepalive_loop`'s stamp), None when nothing was stamped on it."""
    muxed = getattr(conn, "muxed_conn", conn)
    heard = getattr(getattr(muxed, "secured_conn", None), _LAST_READ, None)
    return heard if isinstance(heard, float) else None


def peer_network(host: IHost, peer: bytes) -> str | None:
    """The source network of ``host``'s connection to ``peer``: ``"ip4:a.b.c.0/24"`` or
    ``"ip6:<prefix>/48"`` (:func:`ps_p2p.networks.network_key`: the site one operator usually
    holds, as the committee's admission caps count it), or None for loopback (every node of a
    devnet shares it), no connection, or an address that is not IP. Costs one look-up of the
    peer's connections."""
    try:
        conns = host.get_network().get_connections(ID(peer))
        remote = conns[0].muxed_conn.get_remote_address() if conns else None  # type: ignore[attr-defined]
    except Exception:  # a malformed peer ID, a transport without an IP address
        return None
    ip = parse_ip(str(remote[0])) if remote else None
    if ip is None or ip.is_loopback:
        return None
    return network_key(ip)


def listen_multiaddrs(host: IHost) -> list[str]:
    """The host's listen addresses with ``/p2p/<peer ID>`` appended (what ``--multiaddr`` takes)."""
    peer = host.get_id().to_base58()
    out = []
    for addr in host.get_transport_addrs():
        text = str(addr)
        out.append(text if "/p2p/" in text else f"{text}/p2p/{peer}")
    return out


async def connect(host: IHost, address: str, timeout: float = 5.0) -> bytes:
    """Dial ``address`` (a multiaddr with ``/p2p/<peer ID>``); returns the peer ID bytes.

    Raises:
        ConfigError: the multiaddr is malformed or lacks ``/p2p/``.
        trio.TooSlowError: no connection within ``timeout`` seconds.
        Exception: py-libp2p's dial errors (SwarmException and friends).
    """
    maddr = parse_multiaddr(address)
    try:
        info = info_from_p2p_addr(maddr)
    except Exception as exc:
        raise ConfigError(f"multiaddr {address!r} lacks a valid /p2p/<peer ID>: {exc}") from exc
    with trio.fail_after(timeout):
        await host.connect(info)
    return info.peer_id.to_bytes()


def dial_failure_reason(exc: BaseException) -> str:
    """Why a dial failed, in a few words (for one line of a command's output).

    py-libp2p wraps the socket's error five levels deep (``SwarmDialAllFailedError`` ->
    ``MultiError`` -> ``SwarmException`` -> ``OpenConnectionError`` -> ``OSError`` ->
    ``ExceptionGroup`` -> e.g. ``ConnectionRefusedError``); this returns the innermost socket
    error's text in lower case (``"connection refused"``, ``"no route to host"``), else
    ``"no connection within the deadline"`` for ``trio.TooSlowError``, else the innermost
    message of the chain (e.g. ``"failed to negotiate the secure protocol"``).
    """
    if isinstance(exc, trio.TooSlowError):
        return "no connection within the deadline"
    socket_error: OSError | None = None
    innermost: BaseException = exc
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            socket_error = current
        innermost = current if str(current) else innermost
        children = list(getattr(current, "exceptions", None) or getattr(current, "errors", None) or [])
        cause = current.__cause__ or current.__context__
        stack.extend(children + ([cause] if cause is not None else []))
    if socket_error is not None:
        code = socket_error.errno
        return (os.strerror(code) if code else str(socket_error.strerror)).lower()
    text = str(innermost).splitlines()[0] if str(innermost) else type(innermost).__name__
    return text[:200]


__all__ = [
    "AUTHENTICATED_SECURITY_PROTOCOLS",
    "build_host",
    "check_foreign_host",
    "connect",
    "host_identity",
    "is_connected",
    "last_heard",
    "listen_multiaddrs",
    "open_host",
    "parse_multiaddr",
    "peer_network",
    "tune_host",
    "dial_failure_reason",
]
