"""Hosts as every role runs them (ps_p2p.protocols.host): Noise only (a plaintext dialer is
refused), Yamux, ping and identify, connection limits that are released when connections close,
and listen addresses that are never shared.
"""

from __future__ import annotations

import errno
import logging
import math
import re
import socket
from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL_ID
from libp2p.network.config import RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

from ps_p2p.keys import Identity
from ps_p2p.protocols.admission import LOOPBACK, InboundLimits
from ps_p2p.protocols.host import (
    build_host,
    connect,
    listen_multiaddrs,
    open_host,
    parse_multiaddr,
)
from ps_p2p.protocols.notifee import QuietNotifee


async def test_hosts_connect_over_noise_and_yamux_and_answer_ping():
    a_id, b_id = Identity.generate(), Identity.generate()
    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        (addr,) = listen_multiaddrs(b)
        assert addr.endswith(f"/p2p/{b_id.peer_id_str}")
        with trio.fail_after(10):
            peer = await connect(a, addr)
            assert peer == b_id.peer_id
            (conn,) = a.get_network().get_connections(ID(peer))
            stream = await a.new_stream(ID(peer), [PING_PROTOCOL_ID])
            rtt_ms = await perform_ping_roundtrip(stream)
        assert rtt_ms >= 0
        assert type(conn.muxed_conn).__name__ == "Yamux"  # never Mplex (5x slower for bulk data)
        await stream.close()


async def test_a_plaintext_only_host_cannot_connect_and_the_host_keeps_serving_noise_peers():
    server_id, plain_id, noise_id = Identity.generate(), Identity.generate(), Identity.generate()
    key_pair = plain_id.libp2p_key_pair()
    plain = new_host(key_pair=key_pair, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)})
    plain.get_network().retry_config = RetryConfig(max_retries=0)
    async with open_host(server_id, ["/ip4/127.0.0.1/tcp/0"]) as server, open_host(
        noise_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as noise:
        (addr,) = listen_multiaddrs(server)
        async with plain.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(10), pytest.raises(Exception, match="unable to connect"):
                await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
            assert not server.get_network().get_connections(ID(plain_id.peer_id))
        with trio.fail_after(10):
            await connect(noise, addr)
            stream = await noise.new_stream(ID(server_id.peer_id), [PING_PROTOCOL_ID])
            assert await perform_ping_roundtrip(stream) >= 0
        await stream.close()


async def test_identify_tells_the_peer_our_protocols():
    a_id, b_id = Identity.generate(), Identity.generate()
    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(TProtocol("/planetserve/test/1.0.0"), _close)
        with trio.fail_after(10):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [IDENTIFY_PROTOCOL_ID])
            data = await stream.read(65536)
        assert b"/planetserve/test/1.0.0" in data
        assert b"/ipfs/ping/1.0.0" in data


async def _close(stream) -> None:
    await stream.close()


# --- connection limits and listen addresses (DESIGN.md "py-libp2p 0.8.1: measured pitfalls") ---


class _ConnectionEvents(QuietNotifee):
    """The peer ID of each connection a host registers goes down ``connected``, and of each it
    has removed (closed, no longer counted) down ``disconnected``."""

    def __init__(self) -> None:
        self._connected, self.connected_peers = trio.open_memory_channel[ID](math.inf)
        self._disconnected, self.disconnected_peers = trio.open_memory_channel[ID](math.inf)

    async def connected(self, network, conn) -> None:
        self._connected.send_nowait(conn.muxed_conn.peer_id)

    async def disconnected(self, network, conn) -> None:
        self._disconnected.send_nowait(conn.muxed_conn.peer_id)


@pytest.mark.slow
async def test_a_host_stays_reachable_after_more_connect_and_close_dials_than_its_cap():
    # py-libp2p 0.8.1 kept an inbound slot per accepted connection until the swarm stopped:
    # with max_connections=300 (its default) the 301st inbound connection ever was refused.
    dials, dialers = 400, 10
    target_id = Identity.generate()
    # (10 dialers on one address: more handshakes at once than the per-address default allows)
    loopback_exempt = InboundLimits(exempt=LOOPBACK)
    async with open_host(
        target_id, ["/ip4/127.0.0.1/tcp/0"], max_connections=300, inbound=loopback_exempt
    ) as target:
        (addr,) = listen_multiaddrs(target)
        events = _ConnectionEvents()
        target.get_network().register_notifee(events)
        registered: dict[ID, trio.Event] = {}

        async def route_registrations() -> None:
            async for peer in events.connected_peers:
                registered.pop(peer).set()

        async def connect_and_close(times: int) -> None:
            # TCP + Noise + Yamux negotiated by the dialer's own upgrader, then closed: the
            # target runs a whole connection; the dialer spares its swarm's bookkeeping.
            dialer = build_host(Identity.generate()).get_network()
            maddr, peer = parse_multiaddr(addr), ID(target_id.peer_id)
            transport = dialer.transport_manager.transport_for_dialing(maddr)
            for _ in range(times):
                registered[dialer.get_peer_id()] = event = trio.Event()
                raw = await transport.dial(maddr)
                secured = await dialer.upgrader.upgrade_security(raw, True, peer)
                await dialer.upgrader.upgrade_connection(secured, peer)
                await event.wait()  # the target registered it: without the fix, a slot is gone
                await secured.close()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(route_registrations)
                async with trio.open_nursery() as dialing:
                    for _ in range(dialers):
                        dialing.start_soon(connect_and_close, dials // dialers)
                nursery.cancel_scope.cancel()

        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as fresh:
            with trio.fail_after(10):
                await connect(fresh, addr)
                stream = await fresh.new_stream(ID(target_id.peer_id), [PING_PROTOCOL_ID])
                assert await perform_ping_roundtrip(stream) >= 0
                await stream.close()


async def test_newest_inbound_connections_over_the_per_peer_limit_are_closed_until_others_close(
    caplog,
):
    caplog.set_level(logging.INFO, logger="ps_p2p.protocols.host")
    target_id, dialer_id = Identity.generate(), Identity.generate()
    async with open_host(
        target_id, ["/ip4/127.0.0.1/tcp/0"], max_connections_per_peer=2
    ) as target, open_host(dialer_id, ["/ip4/127.0.0.1/tcp/0"]) as dialer:
        maddr = parse_multiaddr(listen_multiaddrs(target)[0])
        peer = ID(target_id.peer_id)
        network = dialer.get_network()
        with trio.fail_after(20):
            first = [await network.dial_addr(maddr, peer) for _ in range(2)]
            for _ in range(2):
                extra = await network.dial_addr(maddr, peer)
                await extra.event_closed.wait()  # the target closed the newest one
            assert not any(conn.is_closed for conn in first)

            # Closing the two accepted connections gives their places back.
            on_target = target.get_network().get_connections(ID(dialer_id.peer_id))
            for conn in first:
                await conn.close()
            for conn in on_target:
                await conn.event_closed.wait()
            second = [await network.dial_addr(maddr, peer) for _ in range(2)]
            extra = await network.dial_addr(maddr, peer)
            await extra.event_closed.wait()  # two are counted again: the two new ones
            assert not any(conn.is_closed for conn in second)
            stream = await dialer.new_stream(peer, [PING_PROTOCOL_ID])
            assert await perform_ping_roundtrip(stream) >= 0

    reports = [r for r in caplog.records if "connections per peer" in r.getMessage()]
    assert len(reports) == 1  # three connections closed, one INFO line per peer per minute
    assert reports[0].levelno == logging.INFO
    assert dialer_id.peer_id_str in reports[0].getMessage()


async def test_the_total_connection_cap_refuses_a_new_peer_until_a_connection_closes():
    target_id = Identity.generate()
    async with AsyncExitStack() as stack:
        target = await stack.enter_async_context(
            open_host(
                target_id,
                ["/ip4/127.0.0.1/tcp/0"],
                max_connections=2,
                max_connections_per_peer=1,
            )
        )
        (addr,) = listen_multiaddrs(target)
        events = _ConnectionEvents()
        target.get_network().register_notifee(events)
        first, second, third, fourth = [
            await stack.enter_async_context(
                open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"])
            )
            for _ in range(4)
        ]
        with trio.fail_after(15):
            await connect(first, addr)
            await connect(second, addr)
            for _ in range(2):
                await events.connected_peers.receive()
            with pytest.raises(SwarmException):
                await connect(third, addr)

            # (third would not redial for 60 s: py-libp2p's negative cache of failed peers.)
            await first.disconnect(ID(target_id.peer_id))
            assert await events.disconnected_peers.receive() == first.get_id()
            await connect(fourth, addr)
            stream = await fourth.new_stream(ID(target_id.peer_id), [PING_PROTOCOL_ID])
            assert await perform_ping_roundtrip(stream) >= 0


async def test_open_host_refuses_a_listen_address_another_host_holds():
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as first:
        (addr,) = (str(a) for a in first.get_transport_addrs())
        with pytest.raises(OSError, match=re.escape(addr)) as raised:
            async with open_host(Identity.generate(), [addr]):
                pass  # pragma: no cover
        assert raised.value.errno == errno.EADDRINUSE


async def test_open_host_refuses_a_port_a_reuseport_listener_holds():
    # What an unpatched py-libp2p process (or any SO_REUSEPORT server) leaves on a port.
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        addr = f"/ip4/127.0.0.1/tcp/{holder.getsockname()[1]}"
        with pytest.raises(OSError, match=re.escape(addr)) as raised:
            async with open_host(Identity.generate(), [addr]):
                pass  # pragma: no cover
        assert raised.value.errno == errno.EADDRINUSE


async def test_a_reuseport_socket_cannot_join_a_hosts_listen_port():
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        port = int(host.get_transport_addrs()[0].value_for_protocol("tcp"))
        with socket.socket() as thief:
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError) as raised:
                thief.bind(("127.0.0.1", port))
            assert raised.value.errno == errno.EADDRINUSE


async def test_yamux_returns_receive_window_once_per_half_window_not_per_read(monkeypatch):
    """py-libp2p 0.8.1 answers almost every read with a WINDOW_UPDATE; ours waits until half the
    window is consumed (go-yamux), and a transfer of many windows still never stalls."""
    import struct

    from libp2p.stream_muxer.yamux import yamux

    sent_updates: list[int] = []
    original = yamux.Yamux._write_frame

    async def counting(self, data: bytes) -> None:
        _, typ, flags, _, length = struct.unpack(yamux.YAMUX_HEADER_FORMAT, data[:12])
        if typ == yamux.TYPE_WINDOW_UPDATE and flags == 0:
            sent_updates.append(length)
        await original(self, data)

    monkeypatch.setattr(yamux.Yamux, "_write_frame", counting)
    a_id, b_id = Identity.generate(), Identity.generate()
    protocol = TProtocol("/planetserve/test-window/1.0.0")
    received = 0
    done = trio.Event()
    message, count = b"x" * 1000, 2000  # 2 MB: eight default windows of 256 KiB

    async def reader(stream) -> None:
        nonlocal received
        while received < len(message) * count:
            data = await stream.read(65536)
            if not data:
                break
            received += len(data)
        done.set()

    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
        b_id, ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        b.set_stream_handler(protocol, reader)
        with trio.fail_after(30):
            await connect(a, listen_multiaddrs(b)[0])
            stream = await a.new_stream(ID(b_id.peer_id), [protocol])
            for _ in range(count):
                await stream.write(message)
            await done.wait()
    assert received == len(message) * count
    # every update returns at least half a window; one per read would be ~2000 updates
    window = yamux.DEFAULT_WINDOW_SIZE
    assert sent_updates, "the sender would have stalled without any window update"
    assert all(n >= window // 2 for n in sent_updates), sent_updates[:10]
    assert len(sent_updates) <= 2 * len(message) * count // window + 2


@pytest.mark.parametrize("remote, expected", [
    (("203.0.113.7", 4001), "ip4:203.0.113.0/24"),
    (("2001:db8:1:2::5", 4001), "ip6:2001:db8:1::/48"),
    (("::ffff:203.0.113.7", 4001), "ip4:203.0.113.0/24"),  # dual-stack listener: its own /24
    (("::ffff:127.0.0.1", 4001), None),
    (("127.0.0.1", 4001), None),  # loopback: every devnet node shares it, so not counted
    (None, None),
])
def test_peer_network_names_the_source_network_of_a_peer_s_connection(remote, expected):
    from types import SimpleNamespace

    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    from ps_p2p.protocols.host import peer_network

    peer = ID.from_pubkey(create_new_key_pair().public_key)
    conn = SimpleNamespace(muxed_conn=SimpleNamespace(get_remote_address=lambda: remote))
    network = SimpleNamespace(get_connections=lambda p: [conn] if p == peer else [])
    host = SimpleNamespace(get_network=lambda: network)
    assert peer_network(host, peer.to_bytes()) == expected
    assert peer_network(host, b"\x00junk") is None
