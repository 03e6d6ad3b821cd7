"""py-libp2p hosts the way every PlanetServe role runs them: TCP + Noise + Yamux, nothing else.

:func:`open_host` builds and runs a host (an async context manager) with

* only the Noise security transport (``/noise``): a dialer offering ``/plaintext/2.0.0``, secio or
  TLS cannot negotiate and is refused;
* only the Yamux stream muxer (Mplex is ~5x slower for bulk data);
* the default ping (``/ipfs/ping/1.0.0``) and identify handlers of ``BasicHost``;
* the 250 ms happy-eyeballs dial delay of py-libp2p 0.8.1 removed (a dial then takes ~7 ms on
  loopback), and the auto-connector limited so it does not dial every known peer.

Source: DESIGN.md "py-libp2p 0.8.1: measured pitfalls".
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network import swarm as _swarm
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from ps_p2p.errors import ConfigError
from ps_p2p.keys import Identity

log = logging.getLogger(__name__)

# py-libp2p waits 250 ms before every dial even when the first address works.
_swarm._HAPPY_EYEBALLS_DELAY = 0.0


def parse_multiaddr(text: str) -> multiaddr.Multiaddr:
    """Parse a multiaddr string.

    Raises:
        ConfigError: not a valid multiaddr.
    """
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:
        raise ConfigError(f"bad multiaddr {text!r}: {exc}") from exc


def build_host(identity: Identity) -> IHost:
    """A host for ``identity`` speaking TCP + Noise + Yamux only (not yet listening)."""
    key_pair = identity.libp2p_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        connection_config=ConnectionConfig(min_connections=0, low_watermark=0),
        enable_mDNS=False,
    )
    # A dead relay must be noticed in well under a second: one quick retry, not three with
    # exponential back-off (py-libp2p's default costs ~0.7 s per unreachable peer).
    network = host.get_network()
    network.retry_config = RetryConfig(max_retries=1, initial_delay=0.05)  # type: ignore[attr-defined]
    # The auto-connector dials every peer in the peerstore up to the midpoint of the watermarks
    # (150 by default) whatever ConnectionConfig says; the overlay dials the peers it needs.
    network.auto_connector.maybe_connect = _no_auto_connect  # type: ignore[attr-defined]
    return host


async def _no_auto_connect(*args: object, **kwargs: object) -> None:
    return None


@asynccontextmanager
async def open_host(identity: Identity, listen: Sequence[str]) -> AsyncIterator[IHost]:
    """Run a host listening on ``listen`` (multiaddr strings; ``tcp/0`` picks a free port).

    Yields:
        the running host; it stops (connections closed) when the block exits.

    Raises:
        ConfigError: a bad listen multiaddr.
        OSError: the address cannot be bound.
    """
    addrs = [parse_multiaddr(a) for a in listen]
    host = build_host(identity)
    async with host.run(listen_addrs=addrs):
        log.debug("host %s listening on %s", identity.peer_id_str, listen_multiaddrs(host))
        yield host


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


__all__ = ["build_host", "connect", "listen_multiaddrs", "open_host", "parse_multiaddr"]
