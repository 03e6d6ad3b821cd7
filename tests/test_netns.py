"""The multi-host testbed (ps_p2p.testing.netns): hosts on a bridge reach each other, a NATed
host dials out but cannot be dialled, a partition cuts and heals, and every namespace and
process of a run is gone after it, also when the block raised. Needs root and ip/nft/tc;
skipped with the reason otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ps_p2p.errors import NetnsError
from ps_p2p.testing import netns

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.slow,  # ip, nft and tc processes
              pytest.mark.skipif(REASON is not None, reason=f"no testbed here: {REASON}")]

SERVER = ("import socket,sys\n"
          "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('0.0.0.0', 7000)); s.listen(8); print('up', flush=True)\n"
          "while True:\n"
          "    c, a = s.accept(); c.sendall(a[0].encode()); c.close()\n")


def _serve(bed: netns.Testbed, host: netns.Host) -> subprocess.Popen:
    proc = bed.popen(host, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"  # blocks until it listens
    return proc


def _ask(bed: netns.Testbed, src: netns.Host, ip: str, timeout: float = 5.0) -> str:
    """The address ``ip:7000`` saw the connection from."""
    with bed.connect(src, ip, 7000, timeout=timeout) as sock:
        return sock.recv(100).decode()


def test_public_hosts_reach_each_other_and_a_nated_host_only_dials_out():
    with netns.Testbed() as bed:
        a, b = bed.add_host("a"), bed.add_host("b")
        home = bed.add_host("home", nat=True)
        _serve(bed, a)
        _serve(bed, home)
        assert _ask(bed, b, a.ip) == b.ip
        # the NATed host dials out; the server sees its router's address (masquerade)
        assert _ask(bed, home, a.ip) == home.public_ip != home.ip
        # nobody dials in: no route to its LAN address, and the router drops new connections
        with pytest.raises(OSError):
            _ask(bed, b, home.ip, timeout=1.0)
        with pytest.raises(OSError):
            _ask(bed, b, home.public_ip, timeout=1.0)


def test_a_partition_cuts_both_ways_and_heals():
    with netns.Testbed() as bed:
        a, b, c = bed.add_host("a"), bed.add_host("b"), bed.add_host("c")
        for h in (a, b, c):
            _serve(bed, h)
        bed.partition([a], [b])
        with pytest.raises(OSError):
            _ask(bed, a, b.ip, timeout=1.0)
        with pytest.raises(OSError):
            _ask(bed, b, a.ip, timeout=1.0)
        assert _ask(bed, c, a.ip) == c.ip and _ask(bed, a, c.ip) == a.ip  # not in a group
        bed.heal()
        assert _ask(bed, a, b.ip) == a.ip


def test_bandwidth_is_set_on_both_directions_of_the_link():
    with netns.Testbed() as bed:
        a = bed.add_host("a")
        bed.set_bandwidth(a, "10mbit")
        out = subprocess.run(["ip", "netns", "exec", a.ns, "tc", "qdisc", "show", "dev", "eth0"],
                             capture_output=True, text=True, check=True).stdout
        assert "tbf" in out and "10Mbit" in out
        port = subprocess.run(["ip", "netns", "exec", bed.switch, "tc", "qdisc", "show", "dev",
                               "p0"], capture_output=True, text=True, check=True).stdout
        assert "tbf" in port


UDP_ECHO = ("import socket\n"
            "s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 7001))\n"
            "print('up', flush=True)\n"
            "while True:\n"
            "    d, a = s.recvfrom(100); s.sendto(d, a)\n")


TCP_ECHO = ("import socket,threading\n"
            "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 7002)); s.listen(8); print('up', flush=True)\n"
            "def echo(c):\n"
            "    while (d := c.recv(100)):\n        c.sendall(d)\n"
            "while True:\n"
            "    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()\n")


def _udp_round_trips(bed: netns.Testbed, src: netns.Host, ip: str, count: int) -> int:
    """Datagrams of ``count`` sent from ``src`` to the echo at ``ip`` that came back."""
    client = ("import socket,sys\n"
              "s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.05)\n"
              f"got=0\nfor i in range({count}):\n"
              "    try:\n"
              f"        s.sendto(str(i).encode(), ('{ip}', 7001))\n"
              "        got += s.recvfrom(100)[0] == str(i).encode()\n"
              "    except OSError:\n        pass\n"
              "print(got)\n")
    proc = bed.popen(src, [sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
    return int(proc.communicate(timeout=120)[0])


def test_loss_drops_the_share_of_packets_it_is_set_to_and_spares_loopback():
    with netns.Testbed() as bed:
        a, b = bed.add_host("a"), bed.add_host("b")
        echo = bed.popen(b, [sys.executable, "-c", UDP_ECHO], stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "up"
        assert _udp_round_trips(bed, a, b.ip, 200) == 200
        bed.set_loss(a, 0.2)  # a's packets out: one draw per round trip
        back = _udp_round_trips(bed, a, b.ip, 1000)
        assert 700 <= back <= 900  # 800 expected; binomial sd 12.6
        _serve(bed, a)
        assert _ask(bed, a, "127.0.0.1") == "127.0.0.1"  # lo is never dropped
        bed.set_loss(a, 0.0)
        assert _udp_round_trips(bed, a, b.ip, 200) == 200
        with pytest.raises(NetnsError):
            bed.set_loss(a, 1.0)


def test_a_renumbered_nat_router_breaks_open_connections_and_maps_new_ones_anew():
    with netns.Testbed() as bed:
        a = bed.add_host("a")
        home = bed.add_host("home", nat=True)
        echo = bed.popen(a, [sys.executable, "-c", TCP_ECHO], stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "up"
        _serve(bed, a)
        old = home.public_ip
        with bed.connect(home, a.ip, 7002, timeout=3.0) as sock:  # through the old mapping
            sock.sendall(b"x")
            assert sock.recv(10) == b"x"
            new = bed.renumber_router(home)
            assert new != old and home.public_ip == new
            sock.sendall(b"y")  # its mapping is gone: reset by a, or never answered
            try:
                got = sock.recv(10)
            except OSError:  # reset, or timed out
                got = None
            assert got != b"y"
        assert _ask(bed, home, a.ip) == new  # a new connection is masqueraded to the new IP
        with pytest.raises(NetnsError):
            bed.renumber_router(a)


def test_everything_of_a_run_is_removed_also_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Testbed() as bed:
            prefix = bed.prefix
            a = bed.add_host("a")
            bed.add_host("n", nat=True)
            proc = _serve(bed, a)
            assert len(netns.leftovers(prefix)) == 4  # switch, a, n and its router
            raise RuntimeError("boom")
    assert netns.leftovers(prefix) == []
    assert proc.poll() is not None  # its process was stopped


def test_sweep_removes_the_namespaces_of_a_run_whose_process_is_gone():
    dead = f"{netns.PREFIX_ROOT}999999999x0000"  # no such pid
    subprocess.run(["ip", "netns", "add", f"{dead}-x"], check=True)
    try:
        assert f"{dead}-x" in netns.sweep()
        assert netns.leftovers(dead) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"{dead}-x"], capture_output=True, check=False)


def test_a_bad_host_name_is_refused():
    with netns.Testbed() as bed:
        bed.add_host("a")
        with pytest.raises(NetnsError):
            bed.add_host("a")
        with pytest.raises(NetnsError):
            bed.add_host("no spaces")
