"""``ps-node multihost``: a PlanetServe testnet of separate hosts on one Linux machine.

Every node is a ``ps-node run`` OS process in a network namespace of its own
(:mod:`ps_p2p.testing.netns`), with its own IP address on a bridge: verifiers (a committee from
a genesis written here), model nodes (``sim`` engine: a modelled GPU, no weights) and users.
Public users relay; NATed users (``nat_users``) sit behind a home router of their own that
masquerades their traffic, so they can dial out but nobody can dial in. They find that out
(AutoNAT: the verifiers cannot dial them back), reserve Circuit Relay v2 slots on public
verifiers and users, list ``/p2p-circuit`` addresses in their records, and so relay and serve
as proxies like public users (:mod:`ps_p2p.protocols.circuit_relay`; issue 20 section 2);
``nat_ask_only`` makes them ask-only instead (``relay = false``, ``register = false``), as
before Circuit Relay v2.

The controller (this process, in the machine's own namespace) waits until every user holds its
paths, sends prompts through the users' local APIs (``POST /v1/completions`` on ``127.0.0.1`` of
each user's namespace, reached with ``setns(2)``: :meth:`~ps_p2p.testing.netns.Testbed.connect`),
round robin over users, and prints one summary line::

    multihost (continental): answered 20/20, latency p50 0.94 s p99 1.60 s, path setups 40
    (failed 0), committee height 6, ready in 20.6 s, kill-model: recovered in 10.7 s

Perturbations (``perturb``: a comma-separated list, run one after the other): the prompts are
cut into ``len(list) + 1`` shares, the first sent before any perturbation and one share during
each (while it happens and until it recovered). Each gives its seconds to recover (None: not
within ``start_timeout``), measured from the end of the perturbation:

* ``restart-model``: model node ``m0`` is SIGKILLed, its host (namespace and address) removed,
  and it is started again with the same key on a new host (a new IP address); recovered when
  every user got an answer served by it, from its new start (the API cannot name a model node:
  a user asks again, 0.5 s after each miss, until the node it reached is ``m0``; these probes
  are not counted as prompts);
* ``kill-model``: ``m0`` SIGKILLed, started again on the same host :data:`KILL_SECONDS` later;
  recovered as above, from its start;
* ``freeze-model``: ``m0`` SIGSTOPped for :data:`FREEZE_SECONDS` (its TCP connections stay
  open), then SIGCONT; recovered as above, from SIGCONT;
* ``partition-model``: nftables rules cut ``m0`` off from every user (both ways) for
  :data:`PARTITION_SECONDS`, then heal; recovered as above, from the heal;
* ``nat-remap``: NATed user ``n0``'s home router takes a new public IP
  (:meth:`~ps_p2p.testing.netns.Testbed.renumber_router`: its masquerade mappings die, so do
  ``n0``'s connections); recovered when ``n0`` got an answer, from the change.

Every ``*-model`` perturbation needs two model nodes (the prompts sent while ``m0`` is away go
to the other one); ``nat-remap`` a NATed user.

WAN profiles (``profile``, :data:`~ps_p2p.testing.netns.PROFILES`): one one-way delay per pair
of nodes (:func:`~ps_p2p.testing.netns.link_delays`, by node name and ``seed``), applied by the
TEST ONLY delaying transport of :mod:`ps_p2p.testing.faults`: each node's config names a faults
file (``[testing] faults_file``) giving, per peer ID, half the link's delay (both ends hold the
bytes: one way ``d``, a round trip ``2 d``); ``lan`` uses no faults file at all. A profile's
loss is IP packet loss set with nftables in every host's namespace
(:meth:`~ps_p2p.testing.netns.Testbed.set_loss`); ``bandwidth`` a ``tc tbf`` on every link.
Accuracy: docs/network.md.

Everything the run creates is removed when it ends, also on Ctrl-C, SIGTERM or an error
(:class:`~ps_p2p.testing.netns.Testbed`); the work directory (configs, keys, logs, status
files) is a temporary one unless ``workdir`` is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import trio

from ps_p2p.errors import ConfigError, NetnsError
from ps_p2p.testing import netns

log = logging.getLogger(__name__)

REPO = pathlib.Path(__file__).resolve().parents[2]
#: Ports every node uses inside its own namespace (each namespace has its own ports).
P2P_PORT, API_PORT, METRICS_PORT = 4001, 8080, 9464
PERTURBATIONS = ("none", "restart-model", "partition-model", "kill-model", "freeze-model",
                 "nat-remap")
#: Seconds model node m0 stays cut off from the users in ``partition-model``.
PARTITION_SECONDS = 10.0
#: Seconds model node m0 stays SIGSTOPped in ``freeze-model`` (a powered-off laptop).
FREEZE_SECONDS = 20.0
#: Seconds model node m0 stays dead in ``kill-model`` before it starts again (same address).
KILL_SECONDS = 5.0


@dataclasses.dataclass
class MultihostOptions:
    """What ``ps-node multihost`` runs (its flags)."""

    verifiers: int = 4
    models: int = 2
    users: int = 6
    nat_users: int = 2
    nat_ask_only: bool = False
    prompts: int = 20
    concurrency: int = 4
    max_tokens: int = 16
    perturb: str = "none"
    profile: str = "lan"
    bandwidth: str | None = None
    directory_refresh: float = 1.0
    start_timeout: float = 120.0
    prompt_timeout: float = 60.0
    workdir: str | None = None
    log_level: str = "INFO"
    seed: int = 1

    def perturbations(self) -> list[str]:
        """The perturbations to run, in order (``perturb``: comma-separated; none: [])."""
        return [p.strip() for p in self.perturb.split(",") if p.strip() not in ("", "none")]

    def validate(self) -> None:
        """Raises: ConfigError: a count or option out of range."""
        from ps_p2p.config import UserConfig

        if self.verifiers < 1 or self.models < 1:
            raise ConfigError("need at least one verifier and one model node")
        ucfg = UserConfig()
        need = max(ucfg.total, ucfg.hops) + 1  # distinct proxies and relays other than oneself
        relays = self.users + (0 if self.nat_ask_only else self.nat_users)
        if relays < need:
            raise ConfigError(f"need at least {need} users that relay (public users, and "
                              f"NATed ones unless --nat-ask-only): relays and proxies of "
                              f"{ucfg.total} paths of {ucfg.hops} hops")
        if self.nat_users < 0 or self.prompts < 0 or self.concurrency < 1:
            raise ConfigError("--nat-users and --prompts must be >= 0, --concurrency >= 1")
        if self.verifiers + self.models + self.users + 2 * self.nat_users + 2 > netns.MAX_HOSTS:
            raise ConfigError(f"at most {netns.MAX_HOSTS} hosts (a NATed user takes two)")
        for p in self.perturbations():
            if p not in PERTURBATIONS:
                raise ConfigError(f"--perturb: a comma-separated list of "
                                  f"{', '.join(PERTURBATIONS)}, not {p!r}")
            if p.endswith("-model") and self.models < 2:
                raise ConfigError(f"--perturb {p} needs --models >= 2 (the prompts sent "
                                  "while m0 is away go to the others)")
            if p == "nat-remap" and self.nat_users < 1:
                raise ConfigError("--perturb nat-remap needs --nat-users >= 1")
        if self.profile not in netns.PROFILES:
            raise ConfigError(f"--profile: one of {', '.join(netns.PROFILES)}")


@dataclasses.dataclass
class NodeProc:
    """One ``ps-node run`` process of the testnet."""

    name: str
    role: str
    host: netns.Host
    home: pathlib.Path
    config: pathlib.Path
    status: pathlib.Path
    log: pathlib.Path
    process: Any = None
    nat: bool = False

    def read_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status.read_text())
        except (OSError, ValueError):
            return {}

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return f"--- {self.name} ({self.log}) ---\n" + self.log.read_text(
                errors="replace")[-chars:]
        except OSError:
            return f"--- {self.name}: no log ---"


@dataclasses.dataclass
class Result:
    """What a run measured (the summary line's numbers)."""

    sent: int = 0
    answered: int = 0
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    served_by: dict[str, int] = dataclasses.field(default_factory=dict)
    path_setups: int = 0
    setups_failed: int = 0
    committee_height: int = -1
    ready_s: float = 0.0
    recovered_s: float | None = None
    perturb: str = "none"
    #: (perturbation, seconds to recover or None) in the order run
    recoveries: list[tuple[str, float | None]] = dataclasses.field(default_factory=list)
    profile: str = "lan"
    leftovers: list[str] = dataclasses.field(default_factory=list)
    #: users' ready paths at the end, and those with a NATed relay (its incoming link relayed
    #: unless upgraded by DCUtR or its predecessor is its own relay)
    paths: int = 0
    paths_nat_relay: int = 0
    #: paths of NATed users (as their own paths), DCUtR hole punches tried / gave a direct link
    hole_punches: int = 0
    hole_punches_direct: int = 0
    #: of them, between two NATed users (through both NATs)
    nat_hole_punches: int = 0
    nat_hole_punches_direct: int = 0
    relayed_connections: int = 0
    #: cells NATed users relayed (or opened as proxy) and request cloves they proxied
    nat_cells_relayed: int = 0
    nat_cloves_proxied: int = 0

    def summary(self) -> str:
        lat = sorted(self.latencies_ms)
        p50 = statistics.median(lat) / 1000 if lat else float("nan")
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat) + 0.999999) - 1)] / 1000 if lat \
            else float("nan")
        line = (f"multihost ({self.profile}): answered {self.answered}/{self.sent}, latency p50 "
                f"{p50:.2f} s p99 {p99:.2f} s, path setups {self.path_setups} "
                f"(failed {self.setups_failed}), committee height {self.committee_height}, "
                f"ready in {self.ready_s:.1f} s")
        if self.paths:
            line += (f", paths with a NATed relay {self.paths_nat_relay}/{self.paths}, "
                     f"relayed connections {self.relayed_connections}, DCUtR upgrades "
                     f"{self.hole_punches_direct}/{self.hole_punches} direct (NAT to NAT "
                     f"{self.nat_hole_punches_direct}/{self.nat_hole_punches}), NATed users "
                     f"relayed {self.nat_cells_relayed} cells and proxied "
                     f"{self.nat_cloves_proxied} cloves")
        for name, seconds in self.recoveries:
            line += f", {name}: " + ("not recovered" if seconds is None
                                     else f"recovered in {seconds:.1f} s")
        return line


def _toml(values: dict[str, Any]) -> str:
    lines = []
    tables = {k: v for k, v in values.items() if isinstance(v, dict)}
    for key, value in values.items():
        if key not in tables:
            lines.append(f"{key} = {json.dumps(value)}")
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"


class Multihost:
    """A running testnet on a :class:`~ps_p2p.testing.netns.Testbed` (see the module)."""

    def __init__(self, opts: MultihostOptions, bed: netns.Testbed, workdir: pathlib.Path,
                 say: Callable[[str], None] = lambda s: None) -> None:
        self.opts = opts
        self.bed = bed
        self.work = workdir
        self.say = say
        self.nodes: dict[str, NodeProc] = {}
        self.genesis = workdir / "genesis.json"
        self.boot: list[str] = []
        self._restarts = 0
        #: base58 peer ID by base node name (``m0`` for ``m0-r1`` too: same key)
        self.peer_ids: dict[str, str] = {}
        #: one-way delay (ms) of each link, by (base name, base name), a < b
        self.link_delays: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------------ start

    def _write_genesis(self, names: list[str]) -> list[str]:
        """Genesis of the verifiers ``names``; returns their bootstrap multiaddrs."""
        from ps_p2p import registry as app
        from ps_p2p.consensus.types import Validator
        from ps_p2p.genesis import genesis_json
        from ps_p2p.keys import load_or_create_keys
        from ps_p2p.testing.committee import FAST_CONSENSUS

        keys = [load_or_create_keys(self.work / "homes" / n / "node.key") for n in names]
        genesis = app.Genesis("multihost", int(time.time() * 1000) - 1000,
                              tuple(Validator(k.identity.peer_id) for k in keys))
        self.genesis.write_text(genesis_json(genesis, FAST_CONSENSUS, names))
        return [f"/ip4/{self.bed.hosts[n].ip}/tcp/{P2P_PORT}/p2p/{k.identity.peer_id_str}"
                for n, k in zip(names, keys)]

    def _peer_id(self, base: str) -> str:
        """The peer ID of node ``base`` (its key is created in its home on first use)."""
        from ps_p2p.keys import load_or_create_keys

        if base not in self.peer_ids:
            keys = load_or_create_keys(self.work / "homes" / base / "node.key")
            self.peer_ids[base] = keys.identity.peer_id_str
        return self.peer_ids[base]

    def _faults_path(self, base: str) -> pathlib.Path:
        return self.work / "faults" / f"{base}.json"

    def _write_faults(self) -> None:
        """The WAN profile's delays: one faults file per node, holding half of each link's
        one-way delay (the other end holds the other half: a byte from A to B waits
        ``d/2`` in A's writer and ``d/2`` in B's reader, a round trip ``2 d``)."""
        from ps_p2p.testing.faults import LinkRule, write_faults

        bases = sorted({n.name.split("-r")[0] for n in self.nodes.values()})
        self.link_delays = netns.link_delays(bases, self.opts.profile, self.opts.seed)
        for base in bases:
            peers: dict[str, LinkRule] = {}
            for (a, b), ms in self.link_delays.items():
                if base in (a, b):
                    peers[self._peer_id(b if a == base else a)] = LinkRule(ms / 2000.0)
            path = self._faults_path(base)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_faults(path, peers=peers)

    def _add_host(self, name: str, *, nat: bool = False) -> netns.Host:
        """A host of the run with the profile's loss and the run's bandwidth limit."""
        host = self.bed.add_host(name, nat=nat)
        loss = netns.PROFILES[self.opts.profile][2]
        if loss > 0:
            self.bed.set_loss(host, loss)
        if self.opts.bandwidth:
            self.bed.set_bandwidth(host, self.opts.bandwidth)
        return host

    def node(self, base: str) -> NodeProc:
        """The current process of node ``base`` (``m0``: ``m0`` or its latest ``m0-rN``)."""
        for node in self.nodes.values():
            if node.name.split("-r")[0] == base:
                return node
        raise KeyError(base)

    def _node(self, name: str, role: str, host: netns.Host) -> NodeProc:
        home = self.work / "homes" / name.split("-r")[0]
        home.mkdir(parents=True, exist_ok=True)
        node = NodeProc(name, role, host, home, self.work / "configs" / f"{name}.toml",
                        self.work / "status" / f"{name}.json", self.work / "logs" / f"{name}.log",
                        nat=host.nat)
        cfg: dict[str, Any] = {
            "roles": [role],
            "home": str(home),
            "listen": f"/ip4/{host.ip}/tcp/{P2P_PORT}",
            "genesis": str(self.genesis),
            "bootstrap": [b for b in self.boot if f"/{host.ip}/" not in b],
            "directory_refresh": self.opts.directory_refresh,
        }
        if self.opts.profile != "lan":  # TEST ONLY delaying transport (ps_p2p.testing.faults)
            cfg["testing"] = {"faults_file": str(self._faults_path(name.split("-r")[0]))}
        if role == "model":  # one model: a request to a lost node moves to another one
            cfg.update(engine="sim", model="sim-model")
        if role == "user":
            cfg["metrics"] = f"127.0.0.1:{METRICS_PORT}"
            if host.nat and self.opts.nat_ask_only:  # ask only (module docstring)
                cfg.update(relay=False, register=False)
        node.config.parent.mkdir(parents=True, exist_ok=True)
        node.config.write_text(_toml(cfg))
        self.nodes[name] = node
        return node

    def _start(self, node: NodeProc) -> None:
        for d in (node.status.parent, node.log.parent):
            d.mkdir(parents=True, exist_ok=True)
        node.status.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "ps_p2p.cli", "--log-level", self.opts.log_level, "run",
                "--config", str(node.config), "--status-file", str(node.status)]
        if node.role == "user":
            argv += ["--api", f"127.0.0.1:{API_PORT}"]
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(node.log, "ab") as out:
            node.process = self.bed.popen(node.host, argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=str(REPO))

    async def start(self) -> float:
        """Build the hosts, start every node and wait until every user holds its paths;
        returns the seconds it took.

        Raises:
            NetnsError: a node did not get ready within ``start_timeout`` (with log tails),
                or a process exited.
        """
        o = self.opts
        t0 = time.monotonic()
        vnames = [f"v{i}" for i in range(o.verifiers)]
        for n in vnames:
            self._add_host(n)
        self.boot = self._write_genesis(vnames)
        for n in vnames:
            self._node(n, "verifier", self.bed.hosts[n])
        for i in range(o.models):
            self._node(f"m{i}", "model", self._add_host(f"m{i}"))
        for i in range(o.users):
            self._node(f"u{i}", "user", self._add_host(f"u{i}"))
        for i in range(o.nat_users):
            self._node(f"n{i}", "user", self._add_host(f"n{i}", nat=True))
        if o.profile != "lan":
            self._write_faults()
            ms = sorted(self.link_delays.values())
            self.say(f"profile {o.profile}: {len(ms)} links, one-way delay "
                     f"{ms[0]:.0f}-{ms[-1]:.0f} ms (median {statistics.median(ms):.0f}), loss "
                     f"{netns.PROFILES[o.profile][2]:.0%} per packet")
        self.say(f"{len(self.bed.hosts)} hosts on {self.bed.prefix}-*: "
                 + ", ".join(f"{h.name} {h.ip}" + (f" (NAT {h.public_ip})" if h.nat else "")
                             for h in self.bed.hosts.values()))
        for node in self.nodes.values():
            self._start(node)
        await self.wait_ready(o.start_timeout)
        return time.monotonic() - t0

    def _users(self) -> list[NodeProc]:
        return [n for n in self.nodes.values() if n.role == "user" and n.running()]

    def _listed_users(self) -> int:
        o = self.opts
        return o.users + (0 if o.nat_ask_only else o.nat_users)

    def _not_ready(self) -> list[str]:
        from ps_p2p.config import UserConfig

        total = UserConfig().total
        lacking = []
        for node in self.nodes.values():
            if node.process is None:
                continue
            if not node.running():
                raise NetnsError(f"{node.name} exited ({node.process.returncode})\n"
                                 + node.log_tail())
            s = node.read_status()
            d = s.get("directory") or {}
            if not s:
                lacking.append(f"{node.name}: not up")
            elif node.role != "verifier" and (d.get("users", 0) < self._listed_users()
                                             or d.get("model_nodes", 0) < self.opts.models):
                lacking.append(f"{node.name}: directory {d or None}")
            elif node.role == "user" and s.get("ready_paths", 0) < total:
                lacking.append(f"{node.name}: {s.get('ready_paths', 0)}/{total} paths")
        return lacking

    async def wait_ready(self, timeout: float) -> None:
        deadline = trio.current_time() + timeout
        shown = 0.0
        while True:
            lacking = self._not_ready()
            if not lacking:
                return
            now = trio.current_time()
            if now > deadline:
                raise NetnsError(f"not ready within {timeout:.0f} s: {'; '.join(lacking)}\n"
                                 + "\n".join(self.nodes[x.split(':')[0]].log_tail()
                                             for x in lacking[:3]))
            if now - shown > 5:
                shown = now
                self.say(f"waiting: {len(lacking)} nodes not ready ({lacking[0]})")
            await trio.sleep(0.2)  # status files other processes rewrite every 0.5 s

    # ------------------------------------------------------------------ prompts

    def _http(self, user: NodeProc, method: str, path: str, body: dict[str, Any] | None,
              port: int, timeout: float) -> tuple[int, bytes]:
        """One HTTP request to 127.0.0.1:``port`` of ``user``'s namespace (worker thread)."""
        bed = self.bed

        class _Conn(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = bed.connect(user.host, "127.0.0.1", port, timeout=timeout)

        conn = _Conn("127.0.0.1", port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    async def ask(self, user: NodeProc, text: str, model: str | None = None
                  ) -> tuple[bool, dict[str, Any], str]:
        """One prompt through ``user``'s API: (answered, its ``planetserve`` metadata, error)."""
        timeout = self.opts.prompt_timeout
        body: dict[str, Any] = {"prompt": text, "max_tokens": self.opts.max_tokens,
                                "timeout": timeout}
        if model is not None:
            body["model"] = model
        try:
            status, raw = await trio.to_thread.run_sync(
                self._http, user, "POST", "/v1/completions", body, API_PORT, timeout + 30)
            answer = json.loads(raw or b"{}")
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return False, {}, f"{type(exc).__name__}: {exc}"
        meta = answer.get("planetserve") or {}
        if status == 200:
            return True, meta, ""
        return False, meta, (answer.get("error") or {}).get("message", f"HTTP {status}")

    async def until_every_user_reaches(self, peer_id: str, timeout: float) -> float:
        """Ask from every running user until each got an answer served by ``peer_id`` (the
        API cannot name a model node, so a user asks again, after 0.5 s, until the model node
        it picks is that one); returns the seconds it took.

        Raises:
            NetnsError: some user got none within ``timeout`` seconds.
        """
        t0 = time.monotonic()
        waiting = {u.name for u in self._users()}

        async def reach(user: NodeProc) -> None:
            while True:
                ok, meta, _error = await self.ask(user, "Once upon a time")
                if ok and meta.get("served_by") == peer_id:
                    waiting.discard(user.name)
                    return
                await trio.sleep(0.5)  # the next try of a person who got an error

        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for user in self._users():
                    nursery.start_soon(reach, user)
        if waiting:
            raise NetnsError(f"{sorted(waiting)} got no answer from {peer_id[-8:]} within "
                             f"{timeout:.0f} s")
        return time.monotonic() - t0

    async def send_prompts(self, prompts: list[str], result: Result,
                           on_answer: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Send ``prompts`` through the running users' APIs, ``concurrency`` at a time, round
        robin; counts go into ``result``."""
        users = self._users()
        limiter = trio.CapacityLimiter(self.opts.concurrency)

        async def one(i: int, text: str) -> None:
            user = users[(result.sent + i) % len(users)]
            async with limiter:
                t0 = time.monotonic()
                ok, meta, error = await self.ask(user, text)
            if ok:
                result.answered += 1
                result.latencies_ms.append(float(meta.get("latency_ms")
                                                 or (time.monotonic() - t0) * 1000))
                by = str(meta.get("served_by") or "?")
                result.served_by[by] = result.served_by.get(by, 0) + 1
                if on_answer is not None:
                    on_answer(meta)
            else:
                result.errors.append(f"{user.name}: {error}")

        async with trio.open_nursery() as nursery:
            for i, text in enumerate(prompts):
                nursery.start_soon(one, i, text)
        result.sent += len(prompts)

    async def collect(self, result: Result) -> None:
        """Path setups and failures (users' /metrics) and the committee height."""
        for user in self._users():
            try:
                _status, raw = await trio.to_thread.run_sync(
                    self._http, user, "GET", "/metrics", None, METRICS_PORT, 10.0)
            except (OSError, http.client.HTTPException):
                continue
            for line in raw.decode(errors="replace").splitlines():
                if line.startswith("planetserve_paths_built_total"):
                    result.path_setups += int(float(line.split()[-1]))
                elif line.startswith("planetserve_path_setups_failed_total"):
                    result.setups_failed += int(float(line.split()[-1]))
                elif user.nat and line.startswith("planetserve_cells_relayed_total"):
                    result.nat_cells_relayed += int(float(line.split()[-1]))
                elif user.nat and line.startswith("planetserve_cloves_proxied_total"):
                    result.nat_cloves_proxied += int(float(line.split()[-1]))
        nat_ids = {self._peer_id(n.name.split("-r")[0]) for n in self.nodes.values() if n.nat}
        for user in self._users():
            try:
                _status, raw = await trio.to_thread.run_sync(
                    self._http, user, "GET", "/status", None, API_PORT, 10.0)
                ready = json.loads(raw).get("ready_paths") or []
            except (OSError, ValueError, http.client.HTTPException):
                continue
            for path in ready:
                result.paths += 1
                result.paths_nat_relay += any(r in nat_ids for r in path.get("relays", ()))
        for node in self.nodes.values():
            nat = node.read_status().get("nat") if node.running() else None
            if nat:
                result.hole_punches += int(nat.get("hole_punches", 0))
                result.hole_punches_direct += int(nat.get("hole_punches_direct", 0))
                result.nat_hole_punches += int(nat.get("nat_hole_punches", 0))
                result.nat_hole_punches_direct += int(nat.get("nat_hole_punches_direct", 0))
                result.relayed_connections += int(nat.get("relayed_connections", 0))
        heights = [int((n.read_status().get("committee") or {}).get("committed_height", -1))
                   for n in self.nodes.values() if n.role == "verifier" and n.running()]
        result.committee_height = max(heights, default=-1)

    # ------------------------------------------------------------------ perturbations

    async def restart_on_new_host(self, name: str) -> NodeProc:
        """SIGKILL node ``name``, remove its host, and start it again (same key and home) on
        a new host with a new IP address; returns the new node once its status is written."""
        old = self.nodes[name]
        if old.process is not None and old.running():
            old.process.kill()
            old.process.wait()
        self.bed.remove_host(old.host)
        self._restarts += 1
        base = name.split("-r")[0]
        new_name = f"{base}-r{self._restarts}"
        node = self._node(new_name, old.role, self._add_host(new_name))
        del self.nodes[name]
        self._start(node)
        await self._wait_listening(node)
        self.say(f"{name} restarted as {new_name} at {node.host.ip}")
        return node

    async def _wait_listening(self, node: NodeProc) -> None:
        with trio.fail_after(self.opts.start_timeout):
            while not node.read_status().get("listen"):
                if not node.running():
                    raise NetnsError(f"{node.name} exited\n{node.log_tail()}")
                await trio.sleep(0.2)  # its status file, written every 0.5 s

    async def until_answered(self, user: NodeProc, timeout: float) -> float:
        """Ask from ``user`` (again 0.5 s after each failure) until it gets an answer;
        returns the seconds it took.

        Raises:
            NetnsError: no answer within ``timeout`` seconds.
        """
        t0 = time.monotonic()
        with trio.move_on_after(timeout):
            while True:
                ok, _meta, _error = await self.ask(user, "Once upon a time")
                if ok:
                    return time.monotonic() - t0
                await trio.sleep(0.5)  # the next try of a person who got an error
        raise NetnsError(f"{user.name} got no answer within {timeout:.0f} s")

    async def perturb(self, name: str) -> float | None:
        """Run perturbation ``name`` (module docstring) and wait for the network to recover;
        returns the seconds from the perturbation's end (restart, SIGCONT, heal, new address)
        until it did, or None when it did not within ``start_timeout``."""
        timeout = self.opts.start_timeout
        m0_id = self._peer_id("m0")
        try:
            if name == "restart-model":
                await self.restart_on_new_host(self.node("m0").name)
                return await self.until_every_user_reaches(m0_id, timeout)
            if name == "kill-model":
                m0 = self.node("m0")
                m0.process.kill()
                m0.process.wait()
                self.say(f"m0 killed; starting again on {m0.host.ip} in {KILL_SECONDS:.0f} s")
                await trio.sleep(KILL_SECONDS)  # the perturbation's length, not a wait
                self._start(m0)
                await self._wait_listening(m0)
                return await self.until_every_user_reaches(m0_id, timeout)
            if name == "freeze-model":
                m0 = self.node("m0")
                os.killpg(m0.process.pid, signal.SIGSTOP)
                self.say(f"m0 frozen (SIGSTOP) for {FREEZE_SECONDS:.0f} s")
                try:
                    await trio.sleep(FREEZE_SECONDS)  # the perturbation's length
                finally:
                    os.killpg(m0.process.pid, signal.SIGCONT)
                return await self.until_every_user_reaches(m0_id, timeout)
            if name == "partition-model":
                m0 = self.node("m0")
                users = [n.host for n in self.nodes.values() if n.role == "user"]
                self.bed.partition([m0.host], users)
                self.say(f"m0 cut off from the users for {PARTITION_SECONDS:.0f} s")
                try:
                    await trio.sleep(PARTITION_SECONDS)  # the perturbation's length
                finally:
                    self.bed.heal()
                return await self.until_every_user_reaches(m0_id, timeout)
            if name == "nat-remap":
                n0 = self.node("n0")
                old = n0.host.public_ip
                new = self.bed.renumber_router(n0.host)
                self.say(f"n0's NAT router moved from {old} to {new} (mappings lost)")
                return await self.until_answered(n0, timeout)
        except NetnsError as exc:
            self.say(f"{name}: {exc}")
            return None
        raise ConfigError(f"unknown perturbation {name!r}")


def default_prompts(count: int) -> list[str]:
    """``count`` short story prompts (the sim engine answers any text)."""
    starts = ["Once upon a time", "The little dog", "In a small town", "A girl named Lily",
              "The sun was bright", "Tom found a box"]
    return [f"{starts[i % len(starts)]} ({i})" for i in range(count)]


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[pathlib.Path]:
    if path is not None:
        p = pathlib.Path(path).expanduser().resolve()
        if p.exists() and any(p.iterdir()):  # old stores and keys would not fit a new genesis
            raise ConfigError(f"--workdir {p} is not empty; give a new or empty folder")
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="ps-multihost-") as tmp:
        yield pathlib.Path(tmp)


async def run_multihost(opts: MultihostOptions, bed: netns.Testbed, workdir: pathlib.Path,
                        say: Callable[[str], None] = print) -> Result:
    """Start the testnet on ``bed``, send the prompts (with the perturbation), collect the
    numbers; the caller owns ``bed`` (and removes everything with it).

    Raises:
        NetnsError: the testnet did not start (log tails in the message).
    """
    opts.validate()
    net = Multihost(opts, bed, workdir, say)
    result = Result(perturb=opts.perturb, profile=opts.profile)
    result.ready_s = await net.start()
    say(f"ready in {result.ready_s:.1f} s")
    prompts = default_prompts(opts.prompts)
    perturbs = opts.perturbations()
    parts = len(perturbs) + 1  # prompts before the first perturbation, then during each
    chunks = [prompts[len(prompts) * i // parts: len(prompts) * (i + 1) // parts]
              for i in range(parts)]
    await net.send_prompts(chunks[0], result)
    for name, chunk in zip(perturbs, chunks[1:]):
        async with trio.open_nursery() as nursery:  # prompts go on during the perturbation
            nursery.start_soon(net.send_prompts, chunk, result)
            seconds = await net.perturb(name)
        result.recoveries.append((name, seconds))
        say(f"{name}: " + ("not recovered" if seconds is None
                           else f"recovered in {seconds:.1f} s"))
    if result.recoveries:
        result.recovered_s = result.recoveries[0][1]
    await net.collect(result)
    return result


def main(opts: MultihostOptions) -> int:
    """``ps-node multihost``: run, print the summary line; 0 when every prompt was answered.

    Raises:
        ConfigError: bad options. NetnsError: no testbed here, or the testnet did not start.
    """
    opts.validate()
    with _workdir(opts.workdir) as work, netns.Testbed() as bed:
        prefix = bed.prefix
        try:
            result = trio.run(run_multihost, opts, bed, work)
        except KeyboardInterrupt:
            print("multihost: interrupted; removing everything", file=sys.stderr)
            raise
    result.leftovers = netns.leftovers(prefix)
    print(result.summary())
    for error in result.errors[:10]:
        print(f"  failed: {error}")
    if result.leftovers:
        print(f"multihost: namespaces left behind: {result.leftovers}", file=sys.stderr)
    return 0 if result.answered == result.sent and not result.leftovers else 1


__all__ = ["Multihost", "MultihostOptions", "Result", "default_prompts", "main", "run_multihost"]
