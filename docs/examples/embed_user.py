"""Embed a PlanetServe user in a py-libp2p application (docs/embedding.md).

The application owns a host with a protocol of its own (``/myapp/echo/1.0.0``); it attaches a
ps_p2p user to that host, asks a prompt through the anonymous overlay of a small local network
(one verifier, one model node with the instant test engine, six users, all in this process:
``ps_p2p.testing.localnet``), uses its own protocol beside ours, and detaches: the host keeps
running with the application's protocol only.

Run from the repository root::

    python docs/examples/embed_user.py      # with ps_p2p installed (pip install -e .)

Prints (the peer ID differs; ``/ipfs/id`` and ``/ipfs/ping`` are py-libp2p's own)::

    app host 12D3KooW... serves ['/ipfs/id/1.0.0', '/ipfs/id/push/1.0.0', '/ipfs/ping/1.0.0', '/myapp/echo/1.0.0']
    attached: ['/ipfs/id/1.0.0', ..., '/myapp/echo/1.0.0', '/planetserve/clove/1.0.0', '/planetserve/deliver/1.0.0', '/planetserve/onion/1.0.0']
    answer: xof a saw ereht emit a nopu ecnO  (signed by the model node: True)
    echo: b'hello from the app'
    after detach: ['/ipfs/id/1.0.0', '/ipfs/id/push/1.0.0', '/ipfs/ping/1.0.0', '/myapp/echo/1.0.0']

(The instant test engine answers with the prompt reversed.)
"""

from __future__ import annotations

import logging

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

import ps_p2p
from ps_p2p.protocols.handlers import registered_protocols
from ps_p2p.testing.localnet import open_localnet

ECHO = TProtocol("/myapp/echo/1.0.0")


def build_app_host(key_pair=None) -> IHost:  # type: ignore[no-untyped-def]
    """The application's host: its own key (Ed25519 unless given), Noise only, Yamux; not yet
    running."""
    key_pair = key_pair or create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        enable_mDNS=False,
    )


async def echo(stream: INetStream) -> None:
    """The application's own protocol: send back every byte until EOF."""
    try:
        while True:
            await stream.write(await stream.read(1024))
    except StreamEOF:
        await stream.close()
    except Exception:
        await stream.reset()


async def call_echo(client: IHost, server: IHost, message: bytes) -> bytes:
    await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
    stream = await client.new_stream(server.get_id(), [ECHO])
    await stream.write(message)
    received = b""
    while len(received) < len(message):
        received += await stream.read(len(message) - len(received))
    await stream.close()
    return received


async def main() -> None:
    async with open_localnet(users=6) as net:  # stands in for a real network
        bootstrap = net.verifier.listen_addrs[0]  # /ip4/.../tcp/.../p2p/<verifier peer ID>

        host = build_app_host()
        host.set_stream_handler(ECHO, echo)
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            print(f"app host {host.get_id()} serves {sorted(registered_protocols(host))}")

            config = ps_p2p.NodeConfig(roles=["user"], bootstrap=[bootstrap], status_interval=0)
            async with ps_p2p.attach(host, config) as node:
                print(f"attached: {sorted(registered_protocols(host))}")
                await node.wait_directory(min_models=1)
                assert node.user is not None
                await node.user.wait_ready(timeout=60)
                answer = await node.user.ask("Once upon a time there was a fox", timeout=60)
                print(f"answer: {answer.text}  (signed by the model node: {answer.signature_valid})")

                peer = net.users[0].host  # any other libp2p host
                assert peer is not None
                print(f"echo: {await call_echo(peer, host, b'hello from the app')!r}")

            print(f"after detach: {sorted(registered_protocols(host))}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    trio.run(main)
