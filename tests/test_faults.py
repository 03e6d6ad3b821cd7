"""TEST ONLY fault injection (ps_p2p.testing.faults, issue 17): a link's bytes held ``delay_s``
in each direction and in order, a partition that cuts open connections and refuses new ones,
a control file re-read when it changes, and the verifier's clock offset."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID

from ps_p2p.config import load_config
from ps_p2p.errors import ConfigError
from ps_p2p.keys import Identity
from ps_p2p.protocols.consensus import VALIDATOR_REDIAL_MAX
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.protocols.links import LinkManager
from ps_p2p.testing.faults import (
    DelayedConn,
    FaultInjector,
    Faults,
    LinkCut,
    LinkRule,
    load_faults,
    parse_faults,
    write_faults,
)
from ps_p2p.testing.waits import wait_until

PEER = b"\x00\x24\x08\x01\x12\x20" + bytes(32)  # any peer ID bytes


class _Pipe:
    """A trio memory stream as py-libp2p's ReadWriteCloser (read/write/close)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.closed = False

    async def read(self, n=None) -> bytes:
        return await self.stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def close(self) -> None:
        self.closed = True
        await self.stream.aclose()


def _pair():
    a, b = trio.testing.memory_stream_pair()
    return _Pipe(a), _Pipe(b)


async def test_a_delayed_link_holds_bytes_the_delay_in_each_direction(autojump_clock):
    near, far = _pair()
    async with trio.open_nursery() as nursery:
        conn = DelayedConn(near, lambda: 2.0, nursery)
        start = trio.current_time()
        await conn.write(b"ping")
        assert await far.read(100) == b"ping"
        assert trio.current_time() - start == pytest.approx(2.0)
        await far.write(b"pong")
        assert await conn.read(100) == b"pong"
        assert trio.current_time() - start == pytest.approx(4.0)  # a round trip: 2 x delay
        await conn.close()


async def test_bytes_keep_their_order_when_the_delay_shrinks(autojump_clock):
    near, far = _pair()
    delay = [5.0]
    async with trio.open_nursery() as nursery:
        conn = DelayedConn(near, lambda: delay[0], nursery)
        start = trio.current_time()
        await conn.write(b"first ")
        delay[0] = 0.0
        await conn.write(b"second")
        got = b""
        while len(got) < 12:
            got += await far.read(100)
        assert got == b"first second"
        assert trio.current_time() - start == pytest.approx(5.0)
        await far.write(b"a")
        await far.write(b"b")
        assert await conn.read(1) == b"a"  # a read of n returns at most n
        assert await conn.read(None) == b"b"
        await conn.close()


async def test_a_close_writes_the_bytes_held_first(autojump_clock):
    near, far = _pair()
    async with trio.open_nursery() as nursery:
        conn = DelayedConn(near, lambda: 0.5, nursery)
        await conn.write(b"goodbye")
        await conn.close()
        assert await far.read(100) == b"goodbye"
        assert near.closed


async def test_the_inner_end_of_stream_reaches_the_reader_after_the_bytes_before_it(
        autojump_clock):
    near, far = _pair()
    async with trio.open_nursery() as nursery:
        conn = DelayedConn(near, lambda: 1.0, nursery)
        await far.write(b"last words")
        await far.close()
        assert await conn.read(None) == b"last words"
        assert await conn.read(None) == b""
        await conn.close()


async def test_a_partition_cuts_open_connections_and_refuses_new_ones(autojump_clock):
    faults = FaultInjector()
    async with trio.open_nursery() as nursery:
        near, far = _pair()
        conn = faults.wrap(near, PEER, nursery)
        await conn.write(b"before")
        assert await far.read(100) == b"before"
        faults.set(Faults({PEER: LinkRule(partitioned=True)}))
        with pytest.raises(LinkCut):
            await conn.read(None)
        with pytest.raises(LinkCut):
            await conn.write(b"after")
        await wait_until(lambda: near.closed)
        assert faults.cut == 1
        with pytest.raises(LinkCut):
            faults.wrap(_pair()[0], PEER, nursery)
        assert faults.refused == 1
        other = faults.wrap(_pair()[0], b"another peer", nursery)  # other peers unaffected
        faults.set(Faults())  # healed
        again = faults.wrap(_pair()[0], PEER, nursery)
        await other.close()
        await again.close()


def test_the_control_file_shape_is_checked(tmp_path):
    peer = Identity.generate().peer_id_str
    faults = parse_faults({"clock_offset_s": -28, "default": {"delay_s": 0.05},
                           "peers": {peer: {"delay_s": 4.5}}})
    assert faults.clock_offset_s == -28.0
    assert faults.rule(Identity.generate().peer_id) == LinkRule(0.05)
    for bad in ({"peers": {peer: {"delay_s": -1}}}, {"peers": {peer: {"lag": 1}}},
                {"peers": {"0OIl": {}}}, {"clock_offset_s": "soon"}, {"typo": 1}, []):
        with pytest.raises(ConfigError):
            parse_faults(bad)
    assert load_faults(tmp_path / "absent.json") == Faults()
    path = tmp_path / "faults.json"
    write_faults(path, peers={peer: LinkRule(partitioned=True)}, clock_offset_s=3.0)
    loaded = load_faults(path)
    assert loaded.clock_offset_s == 3.0
    assert list(loaded.peers.values()) == [LinkRule(partitioned=True)]
    path.write_text("{not json")
    with pytest.raises(ConfigError):
        load_faults(path)


async def test_the_control_file_is_applied_when_it_changes(tmp_path, autojump_clock):
    path = tmp_path / "faults.json"
    faults = FaultInjector()
    peer = Identity.generate().peer_id_str
    async with trio.open_nursery() as nursery:
        await nursery.start(faults.watch, path)
        assert faults.faults == Faults()
        write_faults(path, peers={peer: LinkRule(4.5)})
        await wait_until(lambda: faults.faults.peers)
        assert list(faults.faults.peers.values()) == [LinkRule(4.5)]
        path.write_text(json.dumps({"peers": {peer: {"delay_s": "x"}}}))  # bad: kept
        await trio.sleep(1)
        assert list(faults.faults.peers.values()) == [LinkRule(4.5)]
        write_faults(path)
        await wait_until(lambda: not faults.faults.peers)
        nursery.cancel_scope.cancel()


def test_the_clock_offset_shifts_the_verifiers_wall_clock():
    faults = FaultInjector(Faults(clock_offset_s=-28.0))
    clock = faults.unix_ms(lambda: 1_000_000)
    assert clock() == 1_000_000 - 28_000
    faults.set(Faults(clock_offset_s=1.5))  # read at each call
    assert clock() == 1_001_500


def test_the_testing_table_is_reachable_from_a_config_file_and_checked(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('roles = ["verifier"]\n[testing]\nbyzantine = true\n'
                      'faults_file = "/tmp/f.json"\n')
    loaded = load_config(config)
    assert loaded.testing.byzantine and loaded.testing.faults_file == "/tmp/f.json"
    config.write_text('roles = ["user"]\nbootstrap = []\n[testing]\nbyzantine = true\n')
    with pytest.raises(ConfigError):
        load_config(config)
    config.write_text('roles = ["verifier"]\n[testing]\nlag = 1\n')
    with pytest.raises(ConfigError, match="lag"):
        load_config(config)


async def test_real_hosts_see_the_delay_and_the_partition_on_every_protocol():
    """Two py-libp2p hosts; the injector on one: a ping round trip gains 2 x delay; a
    partition closes the connection and refuses a new one; the heal lets it connect."""
    a_id, b_id = Identity.generate(), Identity.generate()
    faults = FaultInjector()
    delay = 0.1
    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
            b_id, ["/ip4/127.0.0.1/tcp/0"]) as b, trio.open_nursery() as nursery:
        faults.install(a, nursery)
        faults.set(Faults({b_id.peer_id: LinkRule(delay)}))
        (addr,) = listen_multiaddrs(b)
        with trio.fail_after(20):
            await connect(a, addr)
            stream = await a.new_stream(ID(b_id.peer_id), [PING_PROTOCOL_ID])
            rtt_ms = await perform_ping_roundtrip(stream)
            assert rtt_ms >= 2 * delay * 1000
            faults.set(Faults({b_id.peer_id: LinkRule(partitioned=True)}))
            await wait_until(lambda: not a.get_network().get_connections(ID(b_id.peer_id)))
            await wait_until(lambda: not b.get_network().get_connections(ID(a_id.peer_id)))
            with pytest.raises(SwarmException):
                await connect(b, listen_multiaddrs(a)[0])  # inbound refused too
            assert faults.refused >= 1
            faults.set(Faults())
            a.get_network()._negative_peer_cache.clear()
            await connect(a, addr)
            stream = await a.new_stream(ID(b_id.peer_id), [PING_PROTOCOL_ID])
            assert await perform_ping_roundtrip(stream) >= 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("persistent", [True, False])
async def test_a_persistent_link_redials_soon_after_a_partition_heals(persistent,
                                                                     autojump_clock):
    """Validators' links (``persistent``): once a partition heals, the next send after the
    (short) back-off opens the link, although py-libp2p's negative dial cache still holds
    the peer for 60 s after the refused dial (a 2|2 partition took ~50 s to heal, issue 17).
    The overlay's links keep both (``persistent=False``: the dial is refused)."""
    a_id, b_id = Identity.generate(), Identity.generate()
    faults = FaultInjector(Faults({b_id.peer_id: LinkRule(partitioned=True)}))
    async with open_host(a_id, ["/ip4/127.0.0.1/tcp/0"]) as a, open_host(
            b_id, ["/ip4/127.0.0.1/tcp/0"]) as b, trio.open_nursery() as nursery:
        got = trio.Event()

        async def handler(stream) -> None:
            await stream.read(100)
            got.set()

        b.set_stream_handler("/test/1.0.0", handler)
        faults.install(a, nursery)
        a.get_peerstore().add_addrs(ID(b_id.peer_id), [b.get_addrs()[0].decapsulate(
            f"/p2p/{b_id.peer_id_str}")], 3600)
        down = []
        links = LinkManager(a, nursery, "/test/1.0.0", on_link_down=lambda p, r: down.append(r),
                            backoff_max=VALIDATOR_REDIAL_MAX, persistent=persistent,
                            random=lambda: 1.0)
        assert links.send(b_id.peer_id, b"frame")
        await wait_until(lambda: down)
        assert faults.refused >= 1  # refused, not unreachable
        faults.set(Faults())  # healed
        await trio.sleep(VALIDATOR_REDIAL_MAX * 1.5)  # the link's back-off, at most
        assert links.send(b_id.peer_id, b"frame")
        await wait_until(lambda: got.is_set() or len(down) > 1)
        assert got.is_set() == persistent
        nursery.cancel_scope.cancel()
