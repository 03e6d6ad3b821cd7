"""Inbound streams our handlers serve are bounded per peer, per address and in all, and one that
never sends a byte is reset (ps_p2p.protocols.handlers; issue 16: 195 silent streams held for
ever)."""

from __future__ import annotations

import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.keys import Identity
from ps_p2p.protocols import handlers as handlers_module
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.handlers import StreamBudget, serve_handlers
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.testing.waits import wait_until

PROTOCOL = "/planetserve/test-echo/1.0.0"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]




class _Echo:
    """A handler that reads frames until EOF and echoes them; records how each stream ended."""

    def __init__(self) -> None:
        self.started = 0
        self.endings: list[str] = []

    async def __call__(self, stream) -> None:
        self.started += 1
        try:
            while True:
                frame = await read_frame(stream, 1024)
                await stream.write(encode_frame(frame))
        except StreamEOF:
            self.endings.append("eof")
        except RemoteProtocolError as exc:
            self.endings.append(str(exc))
            await stream.reset()


async def test_a_stream_that_never_sends_a_byte_is_reset_and_gives_its_place_back(monkeypatch):
    monkeypatch.setattr(handlers_module, "FIRST_BYTE_TIMEOUT", 0.3)
    echo = _Echo()
    async with open_host(Identity.generate(), LOOPBACK) as server, \
            open_host(Identity.generate(), LOOPBACK) as client, trio.open_nursery() as nursery:
        await nursery.start(serve_handlers, server, {PROTOCOL: echo})
        await connect(client, listen_multiaddrs(server)[0])
        budget = StreamBudget.of(server)

        silent = await client.new_stream(server.get_id(), [TProtocol(PROTOCOL)])
        talking = await client.new_stream(server.get_id(), [TProtocol(PROTOCOL)])
        await talking.write(encode_frame(b"hello"))
        assert await read_frame(talking, 1024) == b"hello"
        await wait_until(lambda: echo.endings != [])

        assert echo.endings == ["no data 0.3 s after the stream was opened"]
        await wait_until(lambda: budget.open == 1)  # the talking one: quiet between frames is fine
        await talking.close()
        await wait_until(lambda: budget.open == 0)
        del silent
        nursery.cancel_scope.cancel()


async def test_streams_over_the_per_peer_bound_are_reset_before_their_handler_runs():
    echo = _Echo()
    async with open_host(Identity.generate(), LOOPBACK) as server, \
            open_host(Identity.generate(), LOOPBACK) as client, \
            open_host(Identity.generate(), LOOPBACK) as other, trio.open_nursery() as nursery:
        await nursery.start(serve_handlers, server, {PROTOCOL: echo})
        budget = StreamBudget.of(server)
        budget.per_peer = 2
        (addr,) = listen_multiaddrs(server)
        await connect(client, addr)
        await connect(other, addr)

        streams = []
        for _ in range(2):
            stream = await client.new_stream(server.get_id(), [TProtocol(PROTOCOL)])
            await stream.write(encode_frame(b"x"))
            streams.append(stream)
        await wait_until(lambda: echo.started == 2 and budget.open == 2)
        with trio.fail_after(10):
            try:  # the server resets it, during or after the protocol negotiation
                third = await client.new_stream(server.get_id(), [TProtocol(PROTOCOL)])
                await third.write(encode_frame(b"x"))
                answer = await third.read(1024)
            except Exception:
                answer = b""
        assert answer == b""
        assert echo.started == 2

        # another peer still gets served; closing one of the first two gives a place back
        stream = await other.new_stream(server.get_id(), [TProtocol(PROTOCOL)])
        await stream.write(encode_frame(b"y"))
        assert await read_frame(stream, 1024) == b"y"
        await streams[0].close()
        await wait_until(lambda: budget.open == 2)
        again = await client.new_stream(server.get_id(), [TProtocol(PROTOCOL)])
        await again.write(encode_frame(b"z"))
        assert await read_frame(again, 1024) == b"z"
        nursery.cancel_scope.cancel()


def test_the_budget_refuses_over_each_bound_and_forgets_what_ended():
    budget = StreamBudget(per_peer=2, per_address=3, total=4)
    assert budget.take(b"a", "10.0.0.1") is None
    assert budget.take(b"a", "10.0.0.1") is None
    assert budget.take(b"a", "10.0.0.1") == "2 inbound streams open from this peer"
    assert budget.take(b"b", "10.0.0.1") is None
    assert budget.take(b"c", "10.0.0.1") == "3 inbound streams open from 10.0.0.1"
    assert budget.take(b"c", "10.0.0.2") is None
    assert budget.take(b"d", "10.0.0.3") == "4 inbound streams open in all"

    for peer, address in [(b"a", "10.0.0.1"), (b"a", "10.0.0.1"), (b"b", "10.0.0.1"),
                          (b"c", "10.0.0.2")]:
        budget.give_back(peer, address)
    assert budget.open == 0 and budget._peers == {} and budget._addresses == {}


class _RemovingCommunicator:
    """A peer's side of a multistream negotiation of ``protocol`` whose reply write is the
    moment ``removal`` runs (the handler removed while the negotiation is in flight)."""

    def __init__(self, protocol: str, removal) -> None:
        self._reads = ["/multistream/1.0.0", protocol]
        self._protocol = protocol
        self._removal = removal

    async def read(self) -> str:
        return self._reads.pop(0)

    async def write(self, message: str) -> None:
        if message == self._protocol:
            await self._removal()


async def test_a_handler_removed_while_its_protocol_is_negotiated_resets_the_stream_not_the_host():
    from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID

    from ps_p2p.protocols.handlers import StreamHandlers, reset_removed

    assert MULTISELECT_PROTOCOL_ID == "/multistream/1.0.0"
    protocol = "/test/removed/1.0.0"
    served = []

    async def handler(stream) -> None:
        served.append(stream)

    async with open_host(Identity.generate(), LOOPBACK) as host:
        registered = StreamHandlers(host)
        registered.add(protocol, handler)
        communicator = _RemovingCommunicator(protocol, registered.aclose)
        # py-libp2p checks the protocol is served, writes its echo (the handler goes), then
        # looks the handler up: a KeyError there escaped into the host's nursery
        chosen, chosen_handler = await host.get_mux().negotiate(communicator, 5)
        assert chosen == protocol
        assert chosen_handler is reset_removed
        assert protocol not in handlers_module.registered_protocols(host)
        assert not served
