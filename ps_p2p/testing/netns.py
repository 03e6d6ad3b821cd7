"""Many hosts on one Linux machine: network namespaces, veth pairs, a bridge, NAT routers.

A :class:`Testbed` (a context manager; root, ``ip``, ``nft`` and ``tc`` from Debian's
``iproute2`` and ``nftables``) builds, for one run:

* a *switch* namespace ``<prefix>-sw`` holding a bridge; nothing is created in the machine's
  own namespace (no link, address, route or rule), so traffic stays between the namespaces of
  the run;
* a namespace per public host, ``<prefix>-<name>``, with one veth pair to the bridge and its own
  address ``10.200.<i>.2/16`` (each host in its own /24, as separate sites are: the committee's
  admission caps count records per /24);
* for a NATed host, a home-router namespace ``<prefix>-<name>-gw`` on the bridge (its WAN
  address ``10.200.<i>.2``) and the host behind it on a LAN of its own (``10.201.<j>.2/24``,
  default route via the router): the router masquerades what the host sends out (nftables
  ``masquerade``) and forwards inbound only what belongs to a connection the host opened
  (``ct state established,related``), so the host can dial out and nobody can dial in;
* partitions (:meth:`Testbed.partition`, :meth:`Testbed.heal`): nftables rules in each host's
  namespace that drop traffic to and from the hosts of the other groups;
* bandwidth (:meth:`Testbed.set_bandwidth`): a ``tc`` token bucket (``tbf``) on both directions
  of the host's link (its own veth for upload, the bridge port for download);
* packet loss (:meth:`Testbed.set_loss`): an nftables rule in the host's namespace that drops
  each IP packet it sends out of ``eth0`` with probability ``p`` (``numgen random``), so every
  packet between two hosts crosses exactly one such draw: a real loss at the IP layer, which
  TCP repairs by retransmission;
* a NAT that changes its mapping (:meth:`Testbed.renumber_router`): the home router takes a new
  WAN address; the kernel drops the masquerade mappings of the old one, so the host's open
  connections die and it has to dial again.

This kernel has no ``netem``, so delay is not set here: a test-only delaying transport
(``ps_p2p.testing.faults``) does it inside the processes, and :func:`link_delays` gives it a
delay per pair of hosts for a named profile (:data:`PROFILES`).

Processes (:meth:`Testbed.popen`) run in a host's namespace through ``ip netns exec``, each in a
session of its own, with ``PR_SET_PDEATHSIG`` = SIGKILL so that they die with the process that
started them, even when it is SIGKILLed. :meth:`Testbed.connect` opens a TCP connection from
inside a namespace (``setns(2)`` in a worker thread), so the controller can reach a node's
local API on ``127.0.0.1`` of that namespace without any link into the machine's namespace.

Cleanup: :meth:`Testbed.close` (the ``with`` block's exit, also on an exception or Ctrl-C;
SIGTERM and SIGHUP are turned into ``KeyboardInterrupt`` while a testbed is open in the main
thread) kills every process started, then every process still inside a namespace of the run
(``ip netns pids``), then deletes the namespaces; deleting a namespace deletes its veth ends,
bridge, addresses, qdiscs and nftables rules with it. Every name starts with the run's prefix
``psnet<pid>x<hex>``; :func:`sweep` removes what a run whose process is gone left behind (a
SIGKILLed controller), and :func:`leftovers` lists a prefix's namespaces (tests assert none).

Source: ip-netns(8), ip-link(8) veth and bridge, nft(8) ``masquerade`` and ``ct state``,
tc-tbf(8); issue 20 section 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ps_p2p.errors import NetnsError

log = logging.getLogger(__name__)

#: Every namespace of every run starts with this; a run's prefix is ``psnet<pid>x<4 hex>``.
PREFIX_ROOT = "psnet"
#: Public hosts (and NAT routers' WAN side): host i is ``10.200.<i + 1>.2`` in this /16.
PUBLIC_NET = ipaddress.ip_network("10.200.0.0/16")
#: NAT LAN j: ``10.201.<j + 1>.0/24``, router ``.1``, host ``.2``.
LAN_BASE = ipaddress.ip_address("10.201.0.0")
#: Hosts a testbed holds at most (one /24 each in :data:`PUBLIC_NET`).
MAX_HOSTS = 250
#: Commands a testbed runs (Debian packages: iproute2 for ip and tc, nftables for nft).
TOOLS = ("ip", "nft", "tc")

#: WAN profiles, name -> (least, most one-way delay of a link in ms, loss rate): issue 20.
#: The delay is applied by the test-only delaying transport (no netem here), the loss by
#: :meth:`Testbed.set_loss` (nftables, per packet sent).
PROFILES: dict[str, tuple[float, float, float]] = {
    "lan": (0.0, 0.0, 0.0),
    "continental": (20.0, 60.0, 0.0),
    "intercontinental": (80.0, 200.0, 0.0),
    "lossy": (20.0, 60.0, 0.01),
}

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass
class Host:
    """One host of a testbed.

    Attributes:
        name: its name in the run (``v0``, ``u3``...).
        ns: its network namespace.
        ip: the address it listens on (its LAN address when NATed).
        public_ip: the address others see it at (its router's WAN address when NATed).
        nat: behind a home router: can dial out, cannot be dialled.
        router_ns: the router's namespace (NATed hosts), else None.
        port: index of its bridge port (``p<port>`` in the switch namespace).
    """

    name: str
    ns: str
    ip: str
    public_ip: str
    nat: bool = False
    router_ns: str | None = None
    port: int = 0


def new_prefix() -> str:
    """A fresh run prefix: ``psnet<pid>x<4 hex digits>`` (the pid lets :func:`sweep` tell a
    live run's namespaces from a dead one's)."""
    return f"{PREFIX_ROOT}{os.getpid()}x{secrets.token_hex(2)}"


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                              timeout=30, check=False)
    except FileNotFoundError as exc:
        raise NetnsError(f"{argv[0]} not found: install iproute2 and nftables") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(argv)} did not finish in 30 s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[:500]}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why no testbed can be built on this machine (not root, a tool missing, namespaces
    refused), or None when one can; creates and deletes one probe namespace."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"{', '.join(missing)} not found: apt-get install iproute2 nftables")
    probe = f"{new_prefix()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(NetnsError):
        _run(["ip", "netns", "del", probe])
    return None


def namespaces() -> list[str]:
    """Names of the machine's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def leftovers(prefix: str) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (after a run: should be none)."""
    return [ns for ns in namespaces() if ns.startswith(prefix)]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns``, then delete it (missing: nothing to do)."""
    pids = _run(["ip", "netns", "pids", ns], check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False)
    if done.returncode != 0 and ns in namespaces():
        raise NetnsError(f"cannot delete namespace {ns}: {done.stderr.strip()}")


def sweep(*, include_live: bool = False) -> list[str]:
    """Delete the namespaces (and kill their processes) that runs left behind: those of a
    prefix whose process is gone, or with ``include_live`` every ``psnet*`` namespace.

    Returns:
        the namespaces deleted.
    """
    gone: list[str] = []
    pattern = re.compile(rf"^{PREFIX_ROOT}(\d+)x[0-9a-f]+-")
    for ns in namespaces():
        m = pattern.match(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if include_live or not alive:
            _kill_namespace(ns)
            gone.append(ns)
    return gone


def link_delays(hosts: Sequence[str], profile: str, seed: int = 0) -> dict[tuple[str, str], float]:
    """One-way delay (ms) of each unordered pair of ``hosts`` for ``profile``: uniform in the
    profile's range, drawn by a ``random.Random(seed)`` in the order of ``hosts`` (the same
    seed and hosts give the same links). Keys are ``(a, b)`` with ``a < b``.

    Raises:
        NetnsError: an unknown profile.
    """
    if profile not in PROFILES:
        raise NetnsError(f"unknown profile {profile!r}: one of {', '.join(PROFILES)}")
    low, high, _loss = PROFILES[profile]
    rng = random.Random(seed)
    out: dict[tuple[str, str], float] = {}
    names = sorted(hosts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            out[(a, b)] = round(rng.uniform(low, high), 1) if high > 0 else 0.0
    return out


def _pdeathsig() -> None:  # in the child, before exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Testbed:
    """Namespaces, links, NAT routers and processes of one run (module docstring).

    Args:
        prefix: the run's name prefix (default :func:`new_prefix`).

    Raises (on ``__enter__`` / :meth:`open`):
        NetnsError: :func:`unavailable_reason` says why.
    """

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or new_prefix()
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._next_public = 0
        self._next_lan = 0
        self._partitioned: list[Host] = []
        self._shaped: list[tuple[str, str]] = []
        self._signals: dict[int, Any] = {}
        self._open = False

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> Testbed:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Check the machine and create the switch namespace and its bridge."""
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsError(reason)
        self._catch_signals()
        self._open = True
        try:
            self._add_namespace(self.switch)
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process of the run and delete every namespace of the run (idempotent;
        never raises for what is already gone)."""
        for proc in self._processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._processes.clear()
        errors = []
        for ns in {*self._namespaces, *leftovers(self.prefix + "-")}:
            try:
                _kill_namespace(ns)
            except NetnsError as exc:
                errors.append(str(exc))
        self._namespaces.clear()
        self._open = False
        self._restore_signals()
        if errors:
            raise NetnsError("; ".join(errors))

    def _catch_signals(self) -> None:
        """While open, SIGTERM and SIGHUP raise KeyboardInterrupt (so ``close`` runs), in the
        main thread only (elsewhere signals cannot be set)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._signals[sig] = signal.signal(sig, interrupt)

    def _restore_signals(self) -> None:
        for sig, previous in self._signals.items():
            signal.signal(sig, previous)
        self._signals.clear()

    # ------------------------------------------------------------------ building

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        self._ip(ns, "link", "set", "lo", "up")

    @staticmethod
    def _ip(ns: str, *args: str) -> str:
        return _run(["ip", "-n", ns, *args])

    def _plug(self, ns: str, index: int) -> str:
        """A veth pair from ``ns`` (``eth0``) to bridge port ``p<index>``; returns the address
        given to ``eth0`` (``10.200.<index + 1>.2/16``)."""
        port = f"p{index}"
        _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth",
              "peer", "name", port, "netns", self.switch])
        self._ip(self.switch, "link", "set", port, "master", "br0", "up")
        ip = str(PUBLIC_NET.network_address + ((index + 1) << 8) + 2)
        self._ip(ns, "addr", "add", f"{ip}/16", "dev", "eth0")
        self._ip(ns, "link", "set", "eth0", "up")
        return ip

    def add_host(self, name: str, *, nat: bool = False) -> Host:
        """A host named ``name`` (letters, digits, ``-``; unique in the run): public, or
        ``nat`` behind a home router of its own.

        Raises:
            NetnsError: a bad or taken name, more than :data:`MAX_HOSTS` hosts, or a
                command failed.
        """
        if not self._open:
            raise NetnsError("the testbed is not open")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,30}", name) or name in self.hosts \
                or name == "sw":
            raise NetnsError(f"bad or taken host name {name!r}")
        if self._next_public >= MAX_HOSTS:
            raise NetnsError(f"a testbed holds at most {MAX_HOSTS} hosts")
        ns = f"{self.prefix}-{name}"
        index = self._next_public
        self._next_public += 1
        if not nat:
            self._add_namespace(ns)
            ip = self._plug(ns, index)
            host = Host(name, ns, ip, ip, port=index)
        else:
            router = f"{ns}-gw"
            self._add_namespace(router)
            wan = self._plug(router, index)
            lan = self._next_lan
            self._next_lan += 1
            net = ipaddress.ip_address(int(LAN_BASE) + ((lan + 1) << 8))
            gw, ip = str(net + 1), str(net + 2)
            self._add_namespace(ns)
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                  "peer", "name", "lan0", "netns", router])
            self._ip(router, "addr", "add", f"{gw}/24", "dev", "lan0")
            self._ip(router, "link", "set", "lan0", "up")
            self._ip(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip(ns, "link", "set", "eth0", "up")
            self._ip(ns, "route", "add", "default", "via", gw)
            _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            self.nft(router, f"""
table ip {self.prefix}nat {{
  chain nat_post {{ type nat hook postrouting priority srcnat; oifname "eth0" masquerade; }}
}}
table inet {self.prefix}fw {{
  chain fw_forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan0" oifname "eth0" accept
  }}
  chain in {{
    type filter hook input priority filter; policy accept;
    iifname "eth0" ct state new drop
  }}
}}
""")
            host = Host(name, ns, ip, wan, nat=True, router_ns=router, port=index)
        self.hosts[name] = host
        return host

    def remove_host(self, host: Host) -> None:
        """Take ``host`` off the network as a machine that vanished: SIGKILL its processes and
        delete its namespace (and its router's); its address is not reused in the run."""
        for ns in (host.ns, host.router_ns):
            if ns is not None:
                _kill_namespace(ns)
                if ns in self._namespaces:
                    self._namespaces.remove(ns)
        self.hosts.pop(host.name, None)
        self._partitioned = [h for h in self._partitioned if h.name != host.name]

    def nft(self, ns: str, ruleset: str) -> None:
        """Load an nftables ruleset (``nft -f -``) in namespace ``ns``.

        Raises:
            NetnsError: nft refused it.
        """
        _run(["ip", "netns", "exec", ns, "nft", "-f", "-"], stdin=ruleset)

    # ------------------------------------------------------------------ perturbations

    def partition(self, *groups: Sequence[Host]) -> None:
        """Cut every host of a group off from the hosts of the other groups, both ways (hosts
        in no group keep talking to everyone); replaces an earlier partition.

        Raises:
            NetnsError: a host in two groups, or nft failed.
        """
        self.heal()
        seen: set[str] = set()
        for group in groups:
            for host in group:
                if host.name in seen:
                    raise NetnsError(f"{host.name} is in two groups")
                seen.add(host.name)
        for i, group in enumerate(groups):
            others = [h.public_ip for j, g in enumerate(groups) if j != i for h in g]
            if not others:
                continue
            addrs = ", ".join(others)
            for host in group:
                self.nft(host.ns, f"""
table inet {self.prefix}cut {{
  set far_hosts {{ type ipv4_addr; elements = {{ {addrs} }}; }}
  chain cut_output {{ type filter hook output priority filter; ip daddr @far_hosts drop; }}
  chain cut_input {{ type filter hook input priority filter; ip saddr @far_hosts drop; }}
}}
""")
                self._partitioned.append(host)

    def heal(self) -> None:
        """Remove the partition (every host talks to every host again; TCP connections that
        survived it carry on)."""
        for host in self._partitioned:
            _run(["ip", "netns", "exec", host.ns, "nft", "delete", "table", "inet",
                  f"{self.prefix}cut"], check=False)
        self._partitioned.clear()

    def set_bandwidth(self, host: Host, rate: str, *, burst: str = "64kb",
                      latency: str = "50ms") -> None:
        """Limit ``host``'s link to ``rate`` (tc syntax: ``"10mbit"``) each way with a ``tbf``
        token bucket (its veth for what it sends, the bridge port for what it receives; a
        NATed host's router link).

        Raises:
            NetnsError: tc refused it.
        """
        ns = host.router_ns or host.ns
        port = f"p{host.port}"
        for where, dev in ((ns, "eth0"), (self.switch, port)):
            _run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root",
                  "tbf", "rate", rate, "burst", burst, "latency", latency])
            self._shaped.append((where, dev))

    def set_loss(self, host: Host, rate: float) -> None:
        """Drop each IP packet ``host`` sends out of its link with probability ``rate``
        (0 <= rate < 1, resolution 1e-4): nftables ``numgen random mod 10000 < N drop`` on
        ``eth0``'s output in its own namespace (a NATed host: towards its router). Packets on
        ``lo`` (the controller's API calls) are never dropped. Replaces an earlier rate.

        Raises:
            NetnsError: a rate out of range, or nft refused it.
        """
        if not 0 <= rate < 1:
            raise NetnsError(f"loss rate {rate} not in [0, 1)")
        table = f"{self.prefix}loss"
        _run(["ip", "netns", "exec", host.ns, "nft", "delete", "table", "inet", table],
             check=False)
        below = round(rate * 10000)
        if below == 0:
            return
        self.nft(host.ns, f"""
table inet {table} {{
  chain loss_out {{
    type filter hook output priority filter;
    oifname "eth0" numgen random mod 10000 < {below} drop
  }}
}}
""")

    def renumber_router(self, host: Host) -> str:
        """Give a NATed ``host``'s home router a new WAN address (an ISP handing out a new IP):
        the kernel forgets the masquerade mappings of the old address, so the host's open
        connections die (their packets reach no one, or a peer answers a reset) and it has to
        dial again. Returns the new public address (``10.200.<i>.<k>``, k = 3, 4, ...).

        Raises:
            NetnsError: ``host`` is not NATed, or ip failed.
        """
        if not host.nat or host.router_ns is None:
            raise NetnsError(f"{host.name} is not behind a NAT")
        old = ipaddress.ip_address(host.public_ip)
        new = old + 1
        if int(new) & 0xFF >= 250:
            new = ipaddress.ip_address(int(old) & ~0xFF | 3)
        # delete first: deleting a primary address also deletes its secondaries
        self._ip(host.router_ns, "addr", "del", f"{old}/16", "dev", "eth0")
        self._ip(host.router_ns, "addr", "add", f"{new}/16", "dev", "eth0")
        host.public_ip = str(new)
        return host.public_ip

    # ------------------------------------------------------------------ processes

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host``'s namespace (its own session; killed by :meth:`close`,
        and by the kernel when the thread that started it dies: call it from the main thread,
        not from a worker thread that may exit); ``kwargs`` go to ``subprocess.Popen``."""
        if shutil.which("setpriv"):  # util-linux: no preexec_fn (unsafe beside threads)
            argv = ["setpriv", "--pdeathsig", "KILL", *argv]
            extra: dict[str, Any] = {}
        else:
            extra = {"preexec_fn": _pdeathsig}
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv],
                                start_new_session=True, **extra, **kwargs)
        self._processes.append(proc)
        return proc

    def connect(self, host: Host, ip: str, port: int, timeout: float = 10.0) -> socket.socket:
        """A TCP connection to ``ip:port`` opened from inside ``host``'s namespace (e.g. to a
        node's API on ``127.0.0.1`` there). Blocking: call it from a worker thread.

        Raises:
            OSError: setns(2) or the connection failed.
        """
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{host.ns}", os.O_RDONLY)
        try:
            if _libc.setns(target, _CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"setns into {host.ns}: {os.strerror(code)}")
            try:
                sock = socket.create_connection((ip, port), timeout=timeout)
            finally:
                if _libc.setns(own, _CLONE_NEWNET) != 0:  # this thread must not stay there
                    code = ctypes.get_errno() or errno.EPERM
                    log.critical("setns back to our own namespace failed: %s",
                                 os.strerror(code))
                    os._exit(70)
            return sock
        finally:
            os.close(own)
            os.close(target)


@contextlib.contextmanager
def testbed(prefix: str | None = None) -> Iterator[Testbed]:
    """``with testbed() as bed:`` — a :class:`Testbed`, closed at the end of the block."""
    bed = Testbed(prefix)
    bed.open()
    try:
        yield bed
    finally:
        bed.close()


__all__ = [
    "PREFIX_ROOT",
    "PROFILES",
    "Host",
    "Testbed",
    "leftovers",
    "link_delays",
    "namespaces",
    "new_prefix",
    "sweep",
    "testbed",
    "unavailable_reason",
]
