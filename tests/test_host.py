"""Hosts as every role runs them (ps_p2p.protocols.host): Yamux, ping and identify.

(That a plaintext dialer is refused is in tests/test_directory.py.)
"""

from __future__ import annotations

import trio
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL_ID
from libp2p.peer.id import ID

from ps_p2p.keys import Identity
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host


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
