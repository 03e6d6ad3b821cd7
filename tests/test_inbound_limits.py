"""A host stays reachable while others exhaust its listener (issue 16, H2): per-address caps on
handshakes and open connections, the handshake deadline, the Yamux keepalive that ends abandoned
connections, and every count given back however a connection ends. In-process hosts, then the
real ``ps-node run`` process.

Attackers dial from their own addresses in 127.0.0.0/8 (:mod:`ps_p2p.testing.conn_attack`); the
honest dialer from 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import trio

from ps_p2p.keys import Identity
from ps_p2p.protocols import host as host_module
from ps_p2p.protocols.admission import InboundLimits
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.protocols.notifee import QuietNotifee
from ps_p2p.testing.conn_attack import (
    Held,
    honest_dials,
    negotiated_dials,
    raw_sockets,
    source_ips,
)
from ps_p2p.testing.waits import wait_until

REPO = pathlib.Path(__file__).resolve().parents[1]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NOTHING_OPEN = {"pending": 0, "established": 0, "addresses": 0}


def _admission(host):
    return host.get_network()._ps_inbound_guard.admission




class _Disconnections(QuietNotifee):
    """Counts the connections a host has removed (py-libp2p ``INotifee``)."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = trio.Event()

    async def disconnected(self, network, conn) -> None:
        self.count += 1
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while self.count < count:
            await self.changed.wait()


async def test_idle_sockets_from_one_network_cannot_keep_an_honest_peer_out():
    # 1,100 raw sockets that never send a byte: py-libp2p 0.8.1's listener took one of its
    # 1,024 inbound slots for each, for 10 s, and refused everybody else meanwhile.
    async with open_host(Identity.generate(), LOOPBACK) as target:
        (addr,) = listen_multiaddrs(target)
        held = Held()
        try:
            opened = await raw_sockets(addr, source_ips(2, 20), 1100, held)
            assert opened == 1100

            # within the 5 s deadline of the 32 the /24 may have handshaking
            assert await honest_dials(addr, 1, timeout=3.0) == [True]
            assert _admission(target).counts()["pending"] <= 32
            assert held.raw_closed_by_target() >= 1100 - 32
        finally:
            await held.aclose()


async def test_a_socket_that_never_starts_its_handshake_is_closed_at_the_deadline():
    limits = InboundLimits(handshake_timeout=0.5, pending_per_ip=1, pending_per_network=1)
    async with open_host(Identity.generate(), LOOPBACK, inbound=limits) as target:
        (addr,) = listen_multiaddrs(target)
        held = Held()
        try:
            await raw_sockets(addr, ["127.0.2.1"], 1, held)
            (sock,) = held.raw
            with trio.fail_after(10):
                while await sock.recv(4096):  # the target's multistream header, then its close
                    pass
            await wait_until(lambda: _admission(target).counts() == NOTHING_OPEN)

            # its place is back: the same address completes a handshake
            assert await negotiated_dials(addr, ["127.0.2.1"], 1, keep=None) == 1
        finally:
            await held.aclose()


async def test_connections_over_the_per_address_open_cap_are_closed_after_their_handshake():
    limits = InboundLimits(established_per_ip=2, established_per_network=3)
    async with open_host(Identity.generate(), LOOPBACK, inbound=limits) as target:
        (addr,) = listen_multiaddrs(target)
        held = Held()
        try:
            assert await negotiated_dials(addr, ["127.0.1.1"], 3, keep=held, concurrency=1) == 3
            await wait_until(lambda: held.secured_closed_by_target() == 1)
            assert await negotiated_dials(addr, ["127.0.1.2"], 2, keep=held, concurrency=1) == 2
            await wait_until(lambda: held.secured_closed_by_target() == 2)  # the /24 is full

            assert _admission(target).counts()["established"] == 3
            assert await honest_dials(addr, 1) == [True]  # 127.0.0.1: another network
        finally:
            await held.aclose()


async def test_abandoned_connections_are_ended_by_the_keepalive_and_give_their_places_back(
    monkeypatch,
):
    monkeypatch.setattr(host_module, "KEEPALIVE_INTERVAL", 0.2)
    monkeypatch.setattr(host_module, "KEEPALIVE_TIMEOUT", 0.3)
    limits = InboundLimits(established_per_ip=2, established_per_network=2)
    async with open_host(Identity.generate(), LOOPBACK, inbound=limits) as target, \
            open_host(Identity.generate(), LOOPBACK) as honest:
        (addr,) = listen_multiaddrs(target)
        gone = _Disconnections()
        target.get_network().register_notifee(gone)
        await connect(honest, addr)  # answers the keepalive: must survive it
        held = Held()
        try:
            # never read, never closed: the peer vanished (its kernel still acknowledges)
            assert await negotiated_dials(addr, ["127.0.1.1"], 2, keep=held, concurrency=1) == 2
            with trio.fail_after(20):
                await gone.wait_for(2)
            await wait_until(lambda: held.secured_closed_by_target() == 2)
            await wait_until(lambda: _admission(target).counts()["established"] == 1)  # honest

            assert await negotiated_dials(addr, ["127.0.1.1"], 2, keep=held, concurrency=1) == 2
            await wait_until(lambda: _admission(target).counts()["established"] == 3)
            assert target.get_network().get_connections(honest.get_id())
            assert honest.get_network().get_connections(target.get_id())
        finally:
            await held.aclose()


async def test_every_count_is_given_back_however_connections_end():
    limits = InboundLimits(handshake_timeout=1.0, pending_per_ip=16, pending_per_network=16,
                           established_per_ip=8, established_per_network=8)
    async with open_host(Identity.generate(), LOOPBACK, inbound=limits) as target:
        (addr,) = listen_multiaddrs(target)
        held = Held()
        try:
            # many more than the caps, in each way a connection can end
            assert await negotiated_dials(addr, source_ips(3, 4), 40, keep=None,
                                          concurrency=4) == 40
            await negotiated_dials(addr, source_ips(3, 4), 8, keep=held, concurrency=4)
            for conn in held.secured:  # reset from the dialer's side
                await conn.close()
            held.secured.clear()

            async def not_libp2p() -> None:  # no multistream handshake: closed at the deadline
                with trio.socket.socket() as sock:
                    await sock.bind(("127.0.3.1", 0))
                    await sock.connect(("127.0.0.1", int(addr.split("/")[4])))
                    await sock.send(b"GET / HTTP/1.0\r\n\r\n")
                    with trio.fail_after(10):
                        while await sock.recv(4096):
                            pass

            async with trio.open_nursery() as nursery:
                for _ in range(12):
                    nursery.start_soon(not_libp2p)
            await wait_until(lambda: _admission(target).counts() == NOTHING_OPEN)

            # every place is back: the /24's whole open cap, from one address
            assert await negotiated_dials(addr, ["127.0.3.1"], 8, keep=held, concurrency=1) == 8
            await wait_until(lambda: _admission(target).counts()["established"] == 8)
            assert held.secured_closed_by_target() == 0
        finally:
            await held.aclose()


# ---------------------------------------------------------------------- system: an OS process


def _start_verifier(workdir: pathlib.Path) -> tuple[subprocess.Popen, str]:
    status = workdir / "verifier.status.json"
    cmd = [sys.executable, "-m", "ps_p2p.cli", "run", "--role", "verifier",
           "--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(workdir / "verifier.key"),
           "--home", str(workdir / "home"), "--status-file", str(status)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    with open(workdir / "verifier.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=REPO,
                                start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, (workdir / "verifier.log").read_text()[-3000:]
        try:
            listen = json.loads(status.read_text()).get("listen")
        except (OSError, ValueError):
            listen = None
        if listen:
            return proc, listen[0]
        time.sleep(0.2)  # waiting on a file another process writes
    proc.kill()
    raise AssertionError("the verifier did not listen within 90 s")


@pytest.mark.slow
async def test_a_ps_node_process_stays_reachable_through_close_abandon_and_idle_socket_floods(
    tmp_path,
):
    # Measured on py-libp2p 0.8.1's defaults: 0 of 12 honest dials got in (its connection
    # tracker's 256-inbound cap, slots never given back, and 1,024 inbound slots held by
    # idle sockets for 10 s each).
    proc, addr = _start_verifier(tmp_path)
    held = Held()
    try:
        with trio.fail_after(120):
            assert await negotiated_dials(addr, source_ips(3, 10), 300, keep=None) == 300
            await negotiated_dials(addr, source_ips(1, 10), 200, keep=held)
            await raw_sockets(addr, source_ips(2, 30), 1200, held)

            results = await honest_dials(addr, 3, spacing=0.5, timeout=5.0)
            open_abandoned = len(held.secured) - held.secured_closed_by_target()

            # the attacker lets go: every place comes back (the same /24 fills its cap again)
            await held.aclose()
            await negotiated_dials(addr, source_ips(1, 10), 200, keep=held)
            await wait_until(lambda: len(held.secured) - held.secured_closed_by_target() <= 128)
            reopened = len(held.secured) - held.secured_closed_by_target()

        assert results == [True, True, True]
        assert open_abandoned == 128  # the /24's cap of open connections
        assert reopened == 128
    finally:
        await held.aclose()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
