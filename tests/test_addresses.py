"""Addresses that change (issue 20, section 3): a node restarted with the same key on another
port is dialled there by every peer within one directory refresh; a failed dial tries the
peer's other addresses; identify's listen addresses replace stale ones on reconnection."""

from __future__ import annotations

import socket

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError

from ps_p2p.keys import Identity, NodeKeys
from ps_p2p.node import Node
from ps_p2p.protocols.addresses import replace_peer_addrs
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.testing.localnet import open_localnet
from ps_p2p.testing.waits import wait_until

LOOP = ["/ip4/127.0.0.1/tcp/0"]


def _dead_tcp_addr() -> multiaddr.Multiaddr:
    """A loopback TCP address nobody listens on (a port just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")


def _bare(addr: str) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(addr.rsplit("/p2p/", 1)[0])


async def test_a_record_address_replaces_the_stale_one_and_the_peer_is_dialled_there():
    """py-libp2p dials only a peer's first TCP address: adding the new one behind the stale one
    (what node.py did) leaves the peer unreachable."""
    async with open_host(Identity.generate(), LOOP) as a, \
            open_host(Identity.generate(), LOOP) as b:
        peer = b.get_id()
        a.get_peerstore().add_addrs(peer, [_dead_tcp_addr()], 0)
        assert replace_peer_addrs(a, peer.to_bytes(), [_bare(listen_multiaddrs(b)[0])])
        assert a.get_peerstore().addrs(peer) == [_bare(listen_multiaddrs(b)[0])]
        with trio.fail_after(5):
            await a.get_network().dial_peer(peer)
        # the same addresses again change nothing
        assert not replace_peer_addrs(a, peer.to_bytes(), [_bare(listen_multiaddrs(b)[0])])


async def test_a_failed_dial_tries_the_peers_other_address_and_puts_it_first():
    async with open_host(Identity.generate(), LOOP) as a, \
            open_host(Identity.generate(), LOOP) as b:
        peer = b.get_id()
        live = _bare(listen_multiaddrs(b)[0])
        a.get_peerstore().add_addrs(peer, [_dead_tcp_addr(), live], 0)
        with trio.fail_after(10):
            await a.get_network().dial_peer(peer)
        assert a.get_network().get_connections(peer)
        assert a.get_peerstore().addrs(peer)[0] == live


async def test_a_peer_that_reconnects_from_a_new_address_is_identified_there_again():
    """py-libp2p skips identify for a peer whose protocols it cached, so a restarted peer's new
    listen address would never replace the stale one without ReidentifyNotifee."""
    key = Identity.generate()
    async with open_host(Identity.generate(), LOOP) as a:
        a_addr = listen_multiaddrs(a)[0]
        async with open_host(key, LOOP) as b:
            old = _bare(listen_multiaddrs(b)[0])
            await connect(b, a_addr)
            await wait_until(lambda: old in _addrs(a, b.get_id()))
            await b.get_network().close()  # as a crashed process's sockets close
        peer = ID(key.peer_id)
        await wait_until(lambda: not a.get_network().get_connections(peer))
        async with open_host(key, LOOP) as b2:
            new = _bare(listen_multiaddrs(b2)[0])
            assert new != old
            await connect(b2, a_addr)
            await wait_until(lambda: _addrs(a, peer) == [new])


def _addrs(host, peer: ID) -> list[multiaddr.Multiaddr]:
    """The peer's addresses in ``host``'s peerstore without ``/p2p/`` (identify adds it)."""
    try:
        return [_bare(str(a)) for a in host.get_peerstore().addrs(peer)]
    except PeerStoreError:  # not known (yet, or any more)
        return []


async def test_a_model_node_restarted_on_a_new_port_is_reachable_by_every_peer_within_one_refresh():
    async with open_localnet(users=5, models=1) as net, trio.open_nursery() as nursery:
        old = net.models[0]
        model_id = old.peer_id
        old_addrs = set(old.own_record(0).addrs)
        for node in net.users:  # every user has dialled the model node at its old address
            with trio.fail_after(5):
                await node.host.get_network().dial_peer(ID(model_id))
        await net.crash(old)
        keys: NodeKeys = old.keys
        new = await nursery.start(Node(old.config, keys, InstantEngine()).run)
        new_addrs = set(new.own_record(0).addrs)
        assert new_addrs and not new_addrs & old_addrs  # another port

        def listed_at_new_address(node: Node) -> bool:
            d = node.directory
            record = d.record(model_id) if d is not None else None
            return record is not None and set(record.addrs) == new_addrs

        await wait_until(lambda: listed_at_new_address(net.verifier), timeout=30)
        for node in net.users:
            await wait_until(lambda n=node: listed_at_new_address(n), timeout=30)
            # the record's addresses replaced the stale one (not only added behind it)
            assert set(_addrs(node.host, ID(model_id))) == {
                multiaddr.Multiaddr(a) for a in new.own_record(0).multiaddrs()}
            # one refresh later: dialled at the new address at once (no retry, no backoff)
            with trio.fail_after(5):
                await node.host.get_network().dial_peer(ID(model_id))
        for node in net.users:
            answer = await node.user.ask("Once upon a time", model_node=model_id, timeout=30)
            assert answer.ok, answer.error
            assert answer.served_by == model_id
        nursery.cancel_scope.cancel()


async def test_a_relay_restarted_on_a_new_port_is_reachable_by_every_other_user_within_one_refresh():
    """Users and relays take the same path as model nodes (Node._install, every record)."""
    async with open_localnet(users=6, models=1) as net, trio.open_nursery() as nursery:
        old = net.users[0]
        relay_id = old.peer_id
        await net.crash(old)
        new = await nursery.start(Node(old.config, old.keys).run)
        new_addrs = set(new.own_record(0).addrs)
        assert not new_addrs & set(old.own_record(0).addrs)

        def listed_at_new_address(node: Node) -> bool:
            record = node.directory.record(relay_id) if node.directory is not None else None
            return record is not None and set(record.addrs) == new_addrs

        for node in net.users[1:]:
            await wait_until(lambda n=node: listed_at_new_address(n), timeout=30)
            with trio.fail_after(5):
                await node.host.get_network().dial_peer(ID(relay_id))
        nursery.cancel_scope.cancel()


async def test_a_verifier_that_starts_after_the_node_is_reached_within_a_few_refreshes(tmp_path):
    """py-libp2p blocks a peer for 60 s once a dial of it failed; the directory client paces its
    own retries, so a verifier that was not listening yet is dialled again at the next refresh."""
    from ps_p2p.config import NodeConfig
    from ps_p2p.testing.localnet import write_genesis

    vkeys = NodeKeys.generate()
    genesis = write_genesis(tmp_path, [vkeys])
    port = int(str(_dead_tcp_addr()).rsplit("/", 1)[1])
    vaddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{vkeys.identity.peer_id_str}"
    user = Node(NodeConfig(roles=["user"], bootstrap=[vaddr], genesis=str(genesis),
                           directory_refresh=0.5, register_interval=1.0), NodeKeys.generate())
    verifier = Node(NodeConfig(roles=["verifier"], home=str(tmp_path / "v"),
                               genesis=str(genesis), listen=f"/ip4/127.0.0.1/tcp/{port}",
                               block_interval=0.25), vkeys)
    async with trio.open_nursery() as nursery:
        await nursery.start(user.run)
        # the user's first registration and fetch fail: nothing listens there yet
        await wait_until(lambda: bool(user._verifier_failed), timeout=10)
        await nursery.start(verifier.run)
        await user.wait_directory(timeout=15)  # py-libp2p alone: blocked for 60 s
        nursery.cancel_scope.cancel()


async def test_a_record_that_names_new_addresses_drops_the_links_dial_back_off():
    """A proxy whose dial to a model node's old address failed backs the node off; when the
    committed record names new addresses (the node restarted elsewhere) the back-off goes at
    once, so the next delivery dials the new address instead of failing until it runs out."""
    import dataclasses

    async with open_localnet(users=4, models=1) as net:
        user, model = net.users[0], net.models[0]
        links = user.overlay._deliver_links
        links._back_off(model.peer_id)  # as a failed dial to its old address leaves it
        record = user.directory.record(model.peer_id)
        moved = dataclasses.replace(record, addrs=(*record.addrs[1:], _dead_tcp_addr().to_bytes()))
        user._install(user.directory, changed=(moved,))
        assert model.peer_id not in links._backoff
        links._back_off(model.peer_id)
        user._install(user.directory, changed=(moved,))  # the same addresses again: kept
        assert model.peer_id in links._backoff
