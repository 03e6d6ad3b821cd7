"""NATed nodes take part (issue 20 section 2): relay reservations bounded per peer, per network
and in total; circuits bounded per destination, per source and in total; a peer listed only by
``/p2p-circuit`` addresses is dialled through its relay; two py-libp2p 0.8.1 relay bugs fixed;
a path never has a hop as another hop's relay host."""

from __future__ import annotations

import hashlib
import random

import multiaddr
import pytest
import trio
import trio.testing
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service.context import background_trio_service

from ps_p2p.config import load_config
from ps_p2p.errors import ConfigError
from ps_p2p.keys import Identity
from ps_p2p.overlay.circuit_limits import (
    NO_RESERVATION,
    OVER_LIMIT,
    CircuitRelayConfig,
    ReservationBook,
    circuit_only_relays,
    circuit_relays,
    rank_relays,
)
from ps_p2p.overlay.paths import choose_relays
from ps_p2p.protocols.addresses import install_circuit_dialing, note_record_circuits
from ps_p2p.protocols.circuit_relay import (
    RelayServer,
    ReservationKeeper,
    StaleConnectionCloser,
    circuit_multiaddr,
    close_connection,
    is_relayed,
    ping,
    reserve,
)
from ps_p2p.protocols.host import listen_multiaddrs, open_host
from ps_p2p.records.multiaddrs import multiaddr_bytes
from ps_p2p.testing.waits import wait_until

LOOP = ["/ip4/127.0.0.1/tcp/0"]
ECHO = "/test/echo/1.0.0"


def _peer(i: int) -> bytes:
    return bytes([i]) * 4


# ---------------------------------------------------------------------- the pure core


def test_reservations_are_bounded_per_network_and_in_total_and_one_per_peer():
    book = ReservationBook(CircuitRelayConfig(max_reservations=3,
                                              max_reservations_per_network=2))
    assert book.reserve(_peer(1), "net-a", 0.0) is not None
    assert book.reserve(_peer(2), "net-a", 0.0) is not None
    assert book.reserve(_peer(3), "net-a", 0.0) is None  # a third from net-a
    assert book.reserve(_peer(1), "net-a", 1.0) is not None  # a renewal takes no new slot
    assert book.reserve(_peer(3), "net-b", 0.0) is not None
    assert book.reserve(_peer(4), "net-c", 0.0) is None  # 3 in all
    assert book.reservations() == 3
    book.release(_peer(2))
    assert book.reserve(_peer(4), "net-c", 0.0) is not None


def test_a_reservation_expires_after_its_ttl_unless_renewed():
    book = ReservationBook(CircuitRelayConfig(reservation_ttl=60, max_reservations=1))
    assert book.reserve(_peer(1), "n", 0.0) == 60.0
    assert book.reserve(_peer(1), "n", 50.0) == 110.0  # renewed
    assert book.has_reservation(_peer(1), 100.0)
    assert not book.has_reservation(_peer(1), 110.0)
    assert book.reserve(_peer(2), "n", 110.0) is not None  # its slot is free again


def test_circuits_need_a_reservation_and_are_bounded_per_destination_source_and_in_total():
    book = ReservationBook(CircuitRelayConfig(max_circuits=4, max_circuits_per_reservation=2,
                                              max_circuits_per_source=2))
    dst, other = _peer(1), _peer(2)
    assert book.open_circuit(_peer(9), dst, 0.0) == (None, NO_RESERVATION)
    book.reserve(dst, "a", 0.0)
    book.reserve(other, "b", 0.0)
    c1, _ = book.open_circuit(_peer(9), dst, 0.0)
    c2, _ = book.open_circuit(_peer(8), dst, 0.0)
    assert c1 is not None and c2 is not None
    assert book.open_circuit(_peer(7), dst, 0.0) == (None, OVER_LIMIT)  # 2 to one destination
    c3, _ = book.open_circuit(_peer(9), other, 0.0)
    assert c3 is not None
    assert book.open_circuit(_peer(9), other, 0.0) == (None, OVER_LIMIT)  # 2 from peer 9
    c4, _ = book.open_circuit(_peer(6), other, 0.0)
    assert c4 is not None
    assert book.open_circuit(_peer(5), dst, 0.0) == (None, OVER_LIMIT)  # 4 in all
    book.close_circuit(c1)
    book.close_circuit(c1)  # idempotent
    assert book.circuits() == 3
    c5, _ = book.open_circuit(_peer(9), dst, 0.0)  # peer 9 and the total have room again
    assert c5 is not None


def test_the_circuit_relay_table_is_checked_when_the_config_is_loaded(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('roles = ["verifier"]\n[circuit_relay]\nreachability = "private"\n'
                    'max_reservations = 8\nreservations = 1\n')
    cfg = load_config(path)
    assert cfg.circuit_relay.reachability == "private"
    assert cfg.circuit_relay.max_reservations == 8
    for bad in ('reachability = "maybe"', "max_reservations = 0", "reservation_ttl = 1",
                "circuit_bytes = -1"):
        path.write_text(f'roles = ["verifier"]\n[circuit_relay]\n{bad}\n')
        with pytest.raises(ConfigError):
            load_config(path)


def test_the_relays_of_a_records_circuit_addresses_are_read_from_it():
    relay = Identity.generate()
    circuit = multiaddr_bytes(f"/ip4/10.0.0.1/tcp/4001/p2p/{relay.peer_id_str}/p2p-circuit")
    direct = multiaddr_bytes("/ip4/10.0.0.2/tcp/4001")
    assert circuit_relays([circuit, direct]) == {relay.peer_id}
    assert circuit_relays([direct]) == frozenset()


def test_only_a_record_without_a_direct_address_is_reached_through_its_relays():
    """What the overlay's setup deadlines count as a relayed hop (``RelayConfig``)."""
    relay = Identity.generate()
    circuit = multiaddr_bytes(f"/ip4/10.0.0.1/tcp/4001/p2p/{relay.peer_id_str}/p2p-circuit")
    direct = multiaddr_bytes("/ip4/10.0.0.2/tcp/4001")
    assert circuit_only_relays([circuit]) == {relay.peer_id}
    assert circuit_only_relays([circuit, direct]) == frozenset()
    assert circuit_only_relays([]) == frozenset()


def test_a_path_never_has_a_hop_as_another_hops_relay_host():
    """Users 0..5; NATed 10 and 11 are reached through relay hosts 0 and 1. Without the rule,
    paths of 3 from these often hold a NATed hop together with its relay host."""
    users = [_peer(i) for i in range(6)] + [_peer(10), _peer(11)]
    hosts = {_peer(10): frozenset({_peer(0)}), _peer(11): frozenset({_peer(1)})}
    for seed in range(200):
        for path in choose_relays(users, 2, 3, rng=random.Random(seed), relay_hosts=hosts):
            for nat, relays in hosts.items():
                if nat in path:
                    assert not relays & set(path), (seed, path)


# ---------------------------------------------------------------------- real hosts


async def _echo(stream) -> None:  # type: ignore[no-untyped-def]
    try:
        while True:
            data = await stream.read(65536)
            if not data:
                break
            await stream.write(data)
    except Exception:
        pass


async def _roundtrip(stream, data: bytes) -> bytes:  # type: ignore[no-untyped-def]
    await stream.write(data)
    got = b""
    while len(got) < len(data):
        got += await stream.read(65536)
    return got


def _bare(addr: str) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(addr.rsplit("/p2p/", 1)[0])


async def test_a_peer_listed_only_by_its_circuit_address_is_dialled_through_its_relay():
    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as nat, \
            open_host(Identity.generate(), LOOP) as dialer:
        async with background_trio_service(RelayServer(relay, CircuitRelayConfig())), \
                background_trio_service(RelayServer(nat, CircuitRelayConfig(serve=False))):
            nat.set_stream_handler(ECHO, _echo)
            nat.get_peerstore().add_addrs(relay.get_id(), [_bare(listen_multiaddrs(relay)[0])], 0)
            with trio.fail_after(10):
                await reserve(nat, relay.get_id())
            circuit = circuit_multiaddr(listen_multiaddrs(relay)[0], relay.get_id())
            install_circuit_dialing(dialer)
            # as the node installs a NATed peer's record: its relays only
            assert note_record_circuits(dialer, nat.get_id().to_bytes(),
                                        [multiaddr_bytes(circuit)])
            with trio.fail_after(10):
                stream = await dialer.new_stream(nat.get_id(), [ECHO])
                assert await _roundtrip(stream, b"hello") == b"hello"
            conns = dialer.get_network().get_connections(nat.get_id())
            assert conns and all(is_relayed(c) for c in conns)


async def test_a_reservation_is_the_callers_whatever_peer_the_message_names():
    """py-libp2p 0.8.1 reserves for ``msg.peer``: one peer could fill every slot."""
    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as caller:
        server = RelayServer(relay, CircuitRelayConfig())
        async with background_trio_service(server):
            caller.get_peerstore().add_addrs(relay.get_id(),
                                             [_bare(listen_multiaddrs(relay)[0])], 0)
            someone_else = ID(Identity.generate().peer_id)
            with trio.fail_after(10):
                stream = await caller.new_stream(relay.get_id(), [HOP])
                await write_delimited_msg(stream, HopMessage(
                    type=HopMessage.RESERVE, peer=CircuitPeerId(id=someone_else.to_bytes())))
                await read_delimited_msg(stream, HopMessage)
                await stream.close()
            reserved = set(server.resource_manager._reservations)
            assert reserved == {caller.get_id()}


async def test_closing_one_circuit_to_a_peer_leaves_its_other_circuits_open():
    """py-libp2p 0.8.1 closes, when one circuit ends, the streams of the latest circuit to the
    same destination: a NATed relay lost a live link each time another one closed."""
    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as nat, \
            open_host(Identity.generate(), LOOP) as first, \
            open_host(Identity.generate(), LOOP) as second:
        server = RelayServer(relay, CircuitRelayConfig())
        async with background_trio_service(server), \
                background_trio_service(RelayServer(nat, CircuitRelayConfig(serve=False))):
            nat.set_stream_handler(ECHO, _echo)
            nat.get_peerstore().add_addrs(relay.get_id(), [_bare(listen_multiaddrs(relay)[0])], 0)
            with trio.fail_after(10):
                await reserve(nat, relay.get_id())
            circuit = multiaddr_bytes(circuit_multiaddr(listen_multiaddrs(relay)[0],
                                                        relay.get_id()))
            streams = []
            for host in (first, second):
                install_circuit_dialing(host)
                note_record_circuits(host, nat.get_id().to_bytes(), [circuit])
                with trio.fail_after(10):
                    streams.append(await host.new_stream(nat.get_id(), [ECHO]))
                    assert await _roundtrip(streams[-1], b"up") == b"up"
            assert server.book.circuits() == 2
            for conn in list(first.get_network().get_connections(nat.get_id())):
                await conn.close()
            with trio.fail_after(10):
                await wait_until(lambda: server.book.circuits() == 1)  # the first one ended
            with trio.fail_after(10):
                assert await _roundtrip(streams[1], b"still here") == b"still here"



async def test_a_full_relay_gives_the_slot_of_a_holder_that_left_to_a_newcomer():
    """A reservation lives with its holder's connection: a NATed node that left must not hold
    one of the relay's few slots until its reservation expires (10 minutes)."""
    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as gone, \
            open_host(Identity.generate(), LOOP) as newcomer:
        server = RelayServer(relay, CircuitRelayConfig(max_reservations=1))
        async with background_trio_service(server):
            for host in (gone, newcomer):
                host.get_peerstore().add_addrs(relay.get_id(),
                                               [_bare(listen_multiaddrs(relay)[0])], 0)
            with trio.fail_after(10):
                await reserve(gone, relay.get_id())
                with pytest.raises(ConnectionError):  # full while its holder is there
                    await reserve(newcomer, relay.get_id())
                for conn in list(gone.get_network().get_connections(relay.get_id())):
                    await conn.close()
                await wait_until(lambda: not relay.get_network().get_connections(gone.get_id()))
                await reserve(newcomer, relay.get_id())
            assert server.book.holders() == [newcomer.get_id().to_bytes()]


async def test_after_a_direct_upgrade_a_relayed_connection_is_closed_only_once_idle():
    """py-libp2p 0.8.1 closes a peer's relayed connections 60 s after DCUtR found a direct one,
    whatever streams they carry: every overlay link on them, and each path through it, died."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    from ps_p2p.protocols.circuit_relay import NatSupport

    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as nat, \
            open_host(Identity.generate(), LOOP) as client:
        async with background_trio_service(RelayServer(relay, CircuitRelayConfig())), \
                background_trio_service(RelayServer(nat, CircuitRelayConfig(serve=False))):
            nat.set_stream_handler(ECHO, _echo)
            nat.get_peerstore().add_addrs(relay.get_id(), [_bare(listen_multiaddrs(relay)[0])], 0)
            with trio.fail_after(10):
                await reserve(nat, relay.get_id())
            circuit = multiaddr_bytes(circuit_multiaddr(listen_multiaddrs(relay)[0],
                                                        relay.get_id()))
            support = NatSupport(client, CircuitRelayConfig(reachability="public"),
                                 directory=lambda: None, verifiers=list, verifier=False)
            dcutr = DCUtRProtocol(client)
            support._count_punches(dcutr)
            install_circuit_dialing(client)
            note_record_circuits(client, nat.get_id().to_bytes(), [circuit])
            network = client.get_network()
            with trio.fail_after(10):
                link = await client.new_stream(nat.get_id(), [ECHO])  # over the circuit
                await network.dial_addr(_bare(listen_multiaddrs(nat)[0]), nat.get_id())
            relayed = [c for c in network.get_connections(nat.get_id()) if is_relayed(c)]
            assert len(relayed) == 1 and len(network.get_connections(nat.get_id())) == 2
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dcutr._close_relayed_conns_after_grace, nat.get_id(), 0.05)
                await trio.sleep(0.5)  # ten checks: the link is still in use
                assert relayed[0] in network.get_connections(nat.get_id())
                with trio.fail_after(10):
                    assert await _roundtrip(link, b"alive") == b"alive"
                await link.close()
                with trio.fail_after(10):
                    await wait_until(lambda: relayed[0] not in network.get_connections(
                        nat.get_id()))


def test_private_nodes_spread_their_reservations_over_the_public_ones():
    """Rendezvous ranking: 24 NATed nodes x 2 reservations over 12 relays stay near 4 each
    (all on the first relays seen, they filled the verifiers' 128 circuits and links failed),
    and a 13th relay takes over few of them."""
    nats = [hashlib.sha256(b"nat %d" % i).digest() for i in range(24)]
    relays = [hashlib.sha256(b"relay %d" % i).digest() for i in range(12)]
    load = {r: 0 for r in relays}
    for me in nats:
        for r in rank_relays(me, relays)[:2]:
            load[r] += 1
    assert max(load.values()) <= 10 and sum(load.values()) == 48
    newcomer = hashlib.sha256(b"relay 12").digest()
    moved = sum(set(rank_relays(me, relays)[:2]) != set(rank_relays(me, [*relays, newcomer])[:2])
                for me in nats)
    assert moved <= 12


async def test_the_test_only_link_delay_holds_a_relayed_connection_only_in_its_two_legs():
    """multihost delays each link at its ends (ps_p2p/testing/faults.py); a relayed connection
    runs inside the two delayed legs to and from the relay, so delaying it as a link of its
    own too counted a third link's delay on every relayed hop."""
    from ps_p2p.testing.faults import DelayedConn, FaultInjector, Faults, LinkRule

    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as nat, \
            open_host(Identity.generate(), LOOP) as dialer, trio.open_nursery() as nursery:
        async with background_trio_service(RelayServer(relay, CircuitRelayConfig())), \
                background_trio_service(RelayServer(nat, CircuitRelayConfig(serve=False))):
            faults = FaultInjector()
            faults.install(dialer, nursery)
            faults.set(Faults({nat.get_id().to_bytes(): LinkRule(0.001),
                               relay.get_id().to_bytes(): LinkRule(0.001)}))
            nat.get_peerstore().add_addrs(relay.get_id(), [_bare(listen_multiaddrs(relay)[0])], 0)
            with trio.fail_after(10):
                await reserve(nat, relay.get_id())
            install_circuit_dialing(dialer)
            note_record_circuits(dialer, nat.get_id().to_bytes(), [multiaddr_bytes(
                circuit_multiaddr(listen_multiaddrs(relay)[0], relay.get_id()))])
            with trio.fail_after(10):
                await dialer.get_network().dial_peer(nat.get_id())
            network = dialer.get_network()
            (relayed,) = network.get_connections(nat.get_id())
            (leg,) = network.get_connections(relay.get_id())
            assert is_relayed(relayed)
            assert isinstance(leg.muxed_conn.secured_conn, DelayedConn)  # the leg: delayed
            assert not isinstance(relayed.muxed_conn.secured_conn, DelayedConn)
            nursery.cancel_scope.cancel()


async def test_no_hole_punch_is_tried_between_two_natted_nodes_unless_configured():
    """Between two ps_p2p nodes behind NATs a DCUtR punch cannot succeed (0 of 290 in the
    40-node runs, docs/network.md): it is not tried unless ``nat_hole_punch`` is on;
    an upgrade between a public and a NATed node still is."""
    from ps_p2p.protocols.circuit_relay import NatSupport

    class FakeDCUtR:
        def __init__(self) -> None:
            self.tried: list[ID] = []

        async def _have_direct_connection(self, peer_id: ID) -> bool:
            return False

        async def initiate_hole_punch(self, peer_id: ID) -> bool:
            self.tried.append(peer_id)
            return False

    async with open_host(Identity.generate(), LOOP) as host:
        natted, public = ID(Identity.generate().peer_id), ID(Identity.generate().peer_id)
        install_circuit_dialing(host)
        host.get_network()._ps_circuits[natted] = []
        for punch, expected in ((False, [public]), (True, [natted, public])):
            support = NatSupport(host, CircuitRelayConfig(reachability="private",
                                                          nat_hole_punch=punch),
                                 directory=lambda: None, verifiers=list, verifier=False)
            dcutr = FakeDCUtR()
            support._count_punches(dcutr)
            await dcutr.initiate_hole_punch(natted)
            await dcutr.initiate_hole_punch(public)
            assert dcutr.tried == expected


class _EchoStream:
    """A ping stream whose relay answers (echoes) or never answers (its connection died)."""

    def __init__(self, answers: bool) -> None:
        self.answers, self.data = answers, b""

    async def write(self, data: bytes) -> None:
        self.data += data

    async def read(self, n: int) -> bytes:
        if not self.answers:
            await trio.sleep_forever()
        out, self.data = self.data[:n], self.data[n:]
        return out

    async def close(self) -> None:
        pass


class _Conn:
    def __init__(self, heard: float) -> None:
        self.closed = False
        self.muxed_conn = type("Muxed", (), {})()
        self.muxed_conn.secured_conn = type("Secured", (), {})()
        self.muxed_conn.secured_conn._ps_last_read = heard

    async def close(self) -> None:
        self.closed = True


class _Network:
    def __init__(self, conns: dict[ID, list[_Conn]]) -> None:
        self.conns = conns

    def get_connections(self, peer: ID) -> list[_Conn]:
        return [c for c in self.conns.get(peer, []) if not c.closed]

    def get_connections_map(self) -> dict[ID, list[_Conn]]:
        return {p: self.get_connections(p) for p in self.conns}


class _PingHost:
    def __init__(self, answering: set[ID], conns: dict[ID, list[_Conn]]) -> None:
        self.answering, self.network = answering, _Network(conns)

    def get_network(self) -> _Network:
        return self.network

    def get_id(self) -> ID:
        return _pid(99)

    async def new_stream(self, peer: ID, protocols: list[str]) -> _EchoStream:
        assert protocols == ["/ipfs/ping/1.0.0"]
        return _EchoStream(peer in self.answering)


def _pid(i: int) -> ID:
    return ID(b"\x00\x24\x08\x01\x12\x20" + bytes([i]) * 32)


@pytest.mark.parametrize("answering, closed", [
    ({1, 2}, set()),  # both relays answer: nothing closed
    ({1}, {2}),  # relay 2's connection died: only it is closed, its reservation dropped
    (set(), {1, 2, 3}),  # none answers: this node's address changed; every silent one closed
])
async def test_a_private_node_closes_the_connections_its_relays_no_longer_answer_on(
        answering, closed, autojump_clock):
    """Issue 20: after a NAT remap (a new public IP) every connection of the NATed node is
    dead but open for up to 60 s (keepalive), and it kept renewing reservations, opening
    streams and setting up paths on them; the 40-node run had 0 of 4 paths 120 s later."""
    conns = {_pid(i): [_Conn(heard=-1.0)] for i in (1, 2, 3)}  # heard before the pings
    later = _Conn(heard=1e9)  # a connection that is heard from during the pings: alive
    conns[_pid(4)] = [later]
    host = _PingHost({_pid(i) for i in answering}, conns)
    keeper = ReservationKeeper(host, CircuitRelayConfig(), candidates=list)
    moves: list[bool] = []
    keeper.on_address_changed = lambda: moves.append(True)
    keeper._held = {_pid(1).to_bytes(): (1e9, "/ip4/10.0.0.1/tcp/1"),
                    _pid(2).to_bytes(): (1e9, "/ip4/10.0.0.2/tcp/1")}
    silent = await keeper.check_alive()
    assert {ID(p) for p in silent} == {_pid(i) for i in closed} - {_pid(3)}
    assert {i for i in (1, 2, 3) if conns[_pid(i)][0].closed} == closed
    assert not later.closed
    assert set(keeper._held) == {_pid(i).to_bytes() for i in (1, 2) if i not in closed}
    # the overlay hears of the change only when no relay answered (it abandons its setups)
    assert moves == ([True] if not answering else [])


async def test_a_live_relay_answers_the_keepers_ping():
    """The liveness ping is one every ps_p2p host serves (else every relay would look dead)."""
    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as nat:
        nat.get_peerstore().add_addrs(relay.get_id(), [_bare(listen_multiaddrs(relay)[0])], 0)
        assert await ping(nat, relay.get_id())


class _PeerConn(_Conn):
    def __init__(self, peer: ID, heard: float | None, relayed: bool = False) -> None:
        super().__init__(heard if heard is not None else 0.0)
        if heard is None:
            del self.muxed_conn.secured_conn._ps_last_read
        self.muxed_conn.peer_id = peer
        self.relayed = relayed

    def get_transport_addresses(self) -> list[str]:
        return ["/ip4/10.0.0.9/tcp/1/p2p/QmRelay/p2p-circuit"] if self.relayed else ["/ip4/10.0.0.9/tcp/1"]


@pytest.mark.parametrize("old_heard, old_relayed, new_relayed, closed", [
    (-10.0, False, False, True),  # silent 10 s, the peer dialled anew: dead (its NAT remapped)
    (-1.0, False, False, True),  # heard 1 s ago (the peer redialled at once), then silent
    (-10.0, True, False, False),  # a relayed one a DCUtR upgrade replaces: closed once idle
    (-10.0, False, True, False),  # a new relayed connection proves nothing about a direct one
    (-10.0, True, True, True),  # two NATed nodes: the peer redialled through a relay
])
async def test_a_peer_that_connects_anew_has_its_silent_old_connection_closed(
        old_heard, old_relayed, new_relayed, closed, autojump_clock):
    """Issue 20: a NATed node that redials after its NAT remap got its new streams opened on
    the dead old connection (py-libp2p picks the one with the most streams) until the
    keepalive closed it, up to 60 s later."""
    peer = _pid(7)
    old = _PeerConn(peer, old_heard, old_relayed)
    new = _PeerConn(peer, 0.0, new_relayed)
    network = _Network({peer: [old, new]})
    async with trio.open_nursery() as nursery:
        await StaleConnectionCloser(nursery).connected(network, new)
    assert old.closed is closed and not new.closed


class _PingedConn(_PeerConn):
    """An older connection heard 0.5 s before the redial; its Yamux answers a PING after
    ``answer_after`` s (None: never, the connection is dead)."""

    def __init__(self, peer: ID, nursery: trio.Nursery, answer_after: float | None) -> None:
        super().__init__(peer, trio.current_time() - 0.5)
        self.pings: list[bytes] = []

        async def answer() -> None:
            await trio.sleep(answer_after)
            self.muxed_conn.secured_conn._ps_last_read = trio.current_time()

        async def write_frame(header: bytes) -> None:
            self.pings.append(header)
            if answer_after is not None:
                nursery.start_soon(answer)

        self.muxed_conn._write_frame = write_frame

    async def close(self) -> None:
        self.closed_at = trio.current_time()
        await super().close()


@pytest.mark.parametrize("answer_after, closed", [
    (0.3, False),  # both ends dialled at once: the old connection answers, it is kept
    (None, True),  # its peer's NAT remapped a moment ago: no answer, closed within ~1 s
])
async def test_a_redialled_peers_old_connection_is_pinged_and_closed_when_it_does_not_answer(
        answer_after, closed, autojump_clock):
    """Issue 20 (NAT remap): the old connection of a peer that redialled right after its
    address changed was heard a moment before, and was closed only once silent for 5 s;
    meanwhile replies to the peer (a first hop's setup reply) went onto it and were lost, and
    the peer's setups waited out their 20-50 s deadlines. It is now pinged at once and closed
    after about 3 round trips (floor 1 s) without an answer."""
    from ps_p2p.protocols.circuit_relay import REDIAL_PING_FLOOR, REDIAL_STALE_AFTER

    peer = _pid(7)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        old = _PingedConn(peer, nursery, answer_after)
        new = _PeerConn(peer, 0.0)
        await StaleConnectionCloser(nursery).connected(_Network({peer: [old, new]}), new)
    assert len(old.pings) == 1 and old.pings[0][1] == 2  # one Yamux PING (type 2)
    assert old.closed is closed and not new.closed
    if closed:
        # no RTT measured on it: the floor (the old rule waited until silent for 5 s)
        assert REDIAL_PING_FLOOR <= old.closed_at - start < 2 * REDIAL_PING_FLOOR
        assert 2 * REDIAL_PING_FLOOR < REDIAL_STALE_AFTER


def _socket(conn):  # type: ignore[no-untyped-def]
    """The trio socket under a py-libp2p TCP connection (SecureSession -> Noise -> raw)."""
    return conn.muxed_conn.secured_conn.conn.conn.stream.stream.socket


async def test_a_dead_connection_with_a_stuck_writer_is_closed_and_leaves_the_swarm():
    """Issue 20 (40-node NAT remap): a connection found dead (a redial after a NAT remap, a
    silent relay) was closed through py-libp2p's graceful close, which first writes a Yamux
    GO_AWAY behind the connection's write lock; a writer stuck on the dead socket's full send
    buffer holds that lock, the 5 s bound cancelled the close half done and left the
    connection in the swarm, marked closed but never cleaned up (its streams open, replies and
    cells to the peer still written into it) until the keepalive, up to a minute later."""
    import socket as socketlib

    async with open_host(Identity.generate(), LOOP) as a, \
            open_host(Identity.generate(), LOOP) as b:
        b.set_stream_handler(ECHO, _echo)
        a.get_peerstore().add_addrs(b.get_id(), [_bare(listen_multiaddrs(b)[0])], 0)
        with trio.fail_after(10):
            stream = await a.new_stream(b.get_id(), [ECHO])
            assert await _roundtrip(stream, b"hi") == b"hi"
        (conn,) = a.get_network().get_connections(b.get_id())
        (b_conn,) = b.get_network().get_connections(a.get_id())
        # the peer stops reading (gone: its kernel no longer acknowledges), small buffers
        _socket(conn).setsockopt(socketlib.SOL_SOCKET, socketlib.SO_SNDBUF, 4096)
        _socket(b_conn).setsockopt(socketlib.SOL_SOCKET, socketlib.SO_RCVBUF, 4096)

        async def never(*args: object) -> bytes:
            await trio.sleep_forever()
            return b""

        b_conn.muxed_conn.secured_conn.read = never
        failed = trio.Event()

        async def writer() -> None:  # fills the socket and blocks in its send
            try:
                await stream.write(b"x" * 200_000)
            except Exception:
                failed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            with trio.fail_after(10):  # every task waits: the writer in its send, on a full socket
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert conn.muxed_conn._write_lock.locked()  # the writer is stuck in the send
            await close_connection(conn)
            await wait_until(lambda: not a.get_network().get_connections(b.get_id()),
                             timeout=10)
            with trio.fail_after(10):
                await failed.wait()
            nursery.cancel_scope.cancel()


def test_peers_the_directory_does_not_list_hold_at_most_the_newcomer_reservations():
    """Issue 20 (c): a relay granted every slot to any peer, listed or not, so peers that are
    no members (from a few /24s) could take every reservation of every relay and lock the
    network's NATed users out; unlisted peers (newcomers registering) now hold at most
    ``max_unlisted_reservations``, and the listed ones keep the rest."""
    book = ReservationBook(CircuitRelayConfig(max_reservations=6,
                                              max_reservations_per_network=6,
                                              max_unlisted_reservations=2))
    assert book.reserve(_peer(1), "a", 0.0, listed=False) is not None
    assert book.reserve(_peer(2), "b", 0.0, listed=False) is not None
    assert book.reserve(_peer(3), "c", 0.0, listed=False) is None  # newcomer slots full
    assert book.reserve(_peer(1), "a", 1.0, listed=False) is not None  # its renewal is kept
    for i in (4, 5, 6, 7):
        assert book.reserve(_peer(i), "d", 0.0, listed=True) is not None  # members: the rest
    assert book.reserve(_peer(8), "d", 0.0, listed=True) is None  # the total still holds
    assert book.unlisted_reservations() == 2
    # a newcomer that got listed renews as a member, and frees its newcomer slot
    assert book.reserve(_peer(2), "b", 2.0, listed=True) is not None
    assert book.unlisted_reservations() == 1
    book.release(_peer(4))
    assert book.reserve(_peer(3), "c", 3.0, listed=False) is not None
    assert book.unlisted_reservations() == 2
    # counted as held only until they expire (the status file read stale counts)
    ttl = book.config.reservation_ttl
    assert book.reserve(_peer(1), "a", 10.0, listed=False) is not None
    assert book.unlisted_reservations(now=3.0 + ttl + 0.5) == 1  # peer 3's expired, 1's not
    assert book.reservations(now=3.0 + ttl + 0.5) == 1


async def test_a_relay_refuses_an_unlisted_peer_once_the_newcomer_slots_are_taken():
    """The relay asks its directory whether the caller is listed (RelayServer's ``listed``)."""
    async with open_host(Identity.generate(), LOOP) as relay, \
            open_host(Identity.generate(), LOOP) as member, \
            open_host(Identity.generate(), LOOP) as newcomer, \
            open_host(Identity.generate(), LOOP) as stranger:
        listed = {member.get_id().to_bytes()}
        server = RelayServer(relay, CircuitRelayConfig(max_unlisted_reservations=1),
                             listed=listed.__contains__)
        async with background_trio_service(server):
            for host in (member, newcomer, stranger):
                host.get_peerstore().add_addrs(relay.get_id(),
                                               [_bare(listen_multiaddrs(relay)[0])], 0)
            with trio.fail_after(10):
                assert await reserve(newcomer, relay.get_id()) > 0
                with pytest.raises(ConnectionError):
                    await reserve(stranger, relay.get_id())
                assert await reserve(member, relay.get_id()) > 0
            assert server.book.reservations() == 2
            assert server.book.unlisted_reservations() == 1


@pytest.mark.parametrize("reserve", [True, False])
async def test_a_private_node_that_registers_no_record_takes_no_reservation(reserve):
    """Issue 20 (c): an ask-only NATed node (``register = false``) is never dialled and never
    listed; its reservations would hold relays' newcomer slots for as long as it runs."""
    import trio.testing

    from ps_p2p.protocols.circuit_relay import NatSupport

    async with open_host(Identity.generate(), LOOP) as host:
        nat = NatSupport(host, CircuitRelayConfig(reachability="private"),
                         directory=lambda: None, verifiers=list, verifier=False,
                         reserve=reserve)
        steps = []

        async def step() -> None:
            steps.append(trio.current_time())

        nat.keeper.step = step
        async with trio.open_nursery() as nursery:
            await nursery.start(nat.run)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert bool(steps) is reserve
