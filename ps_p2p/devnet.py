"""``ps-node devnet``: a local PlanetServe network of OS processes on 127.0.0.1.

The devnet starts the verifiers, then the model nodes and users (bootstrapped from the verifiers),
waits until every user has its proxies, sends each prompt through a user node's local API (so it
crosses the anonymous overlay: S-IDA cloves over 3-hop onion paths), prints each answer with its
latency and serving model node, and stops every process (also on Ctrl-C and SIGTERM).

Processes. Each OS process is a *worker* (``python -m ps_p2p.devnet``) that runs
``nodes_per_process`` nodes, each its own :class:`~ps_p2p.node.Node` (its own libp2p host, keys and
port) in one ``trio.run``: about 97 MB of a node's ~100 MB RSS is imports, which the nodes of one
worker share. Verifiers, model nodes and users are packed into separate workers (in that order, at
most ``nodes_per_process`` each; by default the users by :func:`auto_nodes_per_process`, about
four workers per usable core, and the verifiers and model nodes one per process). The controller
talks to a worker over pipes, one JSON object a line, so it awaits readiness instead of polling
files:

* controller -> worker (stdin): first ``{"nodes": [spec, ...], "log_level": ..., ...}`` (a spec
  with ``"held": true`` waits), then ``{"start": [name, ...]}`` (start held nodes),
  ``{"kill": name}`` (stop that node at once, the others run on) or ``{"stop": true}``; EOF on stdin
  (the controller went away, however it died) stops every node of the worker.
* worker -> controller (its original stdout; fd 1 is pointed at the log): a status line per node
  whenever its directory or ready paths change: ``{"node", "state": "up"|"stopped"|"failed",
  "peer_id", "listen", "api", "directory": {"height", "users", "model_nodes"}, "ready_paths",
  "ready_proxies" (distinct proxies of the ready paths), "error"}``.

Work directory: ``keys/<node>.key``, ``logs/<node>.log`` (that node's log records),
``logs/worker<i>.log`` (everything else the worker process printed: tracebacks, libraries),
``status/<node>.json`` (the node's latest status line). Without ``workdir`` it is a new
``ps-devnet-*`` temporary directory, removed when the devnet stops, also after Ctrl-C.

Progress: :attr:`Devnet.progress` counts nodes up, nodes holding the full directory, users with
their paths and prompts answered and failed; ``ps-node devnet`` shows them live on a terminal
(``rich``) and as a plain line every 5 s of the start otherwise (:mod:`ps_p2p.devnet_progress`).

Admission waves: from 32 users on, the users start in up to 4 waves (:func:`admission_waves`); a
wave starts once 3/4 of the users started before it hold their paths, so the dials, handshakes and
path setups of a start come in bounded bursts instead of all users' at once. The verifiers and model
nodes start first, all at once.

Start deadline: one deadline for the whole start (verifiers listening, every node holding the full
directory, every user holding n ready paths over n distinct proxies: :func:`user_not_ready`); by
default 60 s + 1 s per node. When it passes, the error names every node that was not ready and
what it lacked.

Perturbations (each prompt must still be answered, since n > k):

* ``kill-relay``: after the first third of the prompts, one relay on one path of every user is
  killed while requests are in flight (a small hitting set of relays, so every user loses at least
  one path; prompts then go only through surviving users). A worker whose every running node is a
  victim is SIGKILLed; a victim sharing its worker with survivors is killed inside the worker: its
  host closes its listener and connections first (what peers see of a killed process: EOF on every
  link; merely cancelling its task would leave its sockets open, which peers take for a frozen
  node), then its tasks are cancelled; the other nodes of the worker run on.
* ``tamper-clove``: one user node runs with ``tamper`` and corrupts every cell and clove it relays;
  the proxies' end-to-end check and S-IDA's AEAD reject them and decoding uses other cloves.
* ``kill-verifier``: after the first third of the prompts, the last verifier is killed while
  requests are in flight; registrations and directory refreshes go to the others (with
  the 3f other validators keep committing blocks; needs at least 4 verifiers).
* ``byzantine-verifier`` (at least 4 verifiers): the last verifier runs from the
  start with the TEST ONLY ``byzantine`` flag: next to each own proposal and vote it signs and
  sends a conflicting one to half of the other validators. The others keep committing, turn its
  conflicting votes into equivocation evidence and commit it; the summary line says how much
  evidence a correct verifier's state holds (its status line's ``committee.evidence``).

Committee: the verifiers are the validators of a
genesis file written to ``<workdir>/genesis.json`` (chain ``devnet``; loopback timeouts; an
admission policy that lets one /24 hold every node), each listening on a port chosen before the
start and bootstrapped from the others, with its consensus store in ``<workdir>/homes/<name>``;
model nodes and users run with that genesis and trust only directories committed by more than
2/3 of them (docs/consensus.md, "Nodes and the committee"). One verifier is a committee of one.

Engines: ``transformers`` loads ``model`` in every model node; ``instant`` answers at once with
:class:`~ps_p2p.testing.fakes.InstantEngine` (no model load), to measure the overlay itself;
``sim`` spends a modelled GPU's time with a prefix cache (:mod:`ps_p2p.engines.sim_engine`,
default parameters), no model load either.

Use it from another trio program (``benchmarks/bench_devnet.py`` does)::

    async with open_devnet(DevnetOptions(engine="instant", users=32)) as net:
        print(net.ready_s, net.rss_bytes())
        results = await net.send_prompts(prompts, concurrency=16)
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from ps_p2p.devnet_progress import Display, PlainDisplay, Progress, choose_display
from ps_p2p.errors import ConfigError, PsError
from ps_p2p.prompts import Prompt, load_prompts

log = logging.getLogger(__name__)

#: Prompt files are capped: a devnet is for a look at the system, not a load test.
ENGINES = ("transformers", "instant", "sim")
PERTURBATIONS = ("none", "kill-relay", "tamper-clove", "kill-verifier", "byzantine-verifier")
#: ready paths a user needs before the network counts as ready (n, the cloves per request), with
#: as many distinct proxies (:func:`user_not_ready`)
READY_PATHS = 4
#: floor of a devnet user's probe deadline (``[user] probe_timeout``, 1 s by default, RFC
#: 6298's floor for a node with a machine of its own): a devnet shares a few cores among
#: dozens of nodes, where a 3-hop round trip crosses processes that each wait their turn for a
#: core, and 1 s suspended a path at every load spike (a 100-user start on 2 loaded cores:
#: 984 suspensions, users' ready paths going up and down instead of up)
PROBE_TIMEOUT_FLOOR = 3.0
#: seconds the workers get to stop after being told to, before SIGKILL
STOP_GRACE = 8.0
#: seconds a node killed inside its worker gets to close its connections
KILL_CLOSE_TIMEOUT = 3.0
_MAX_LINE = 1 << 20
#: the repository of an editable install (the folder above the ``ps_p2p`` package)
REPO = pathlib.Path(__file__).resolve().parent.parent
#: the devnet's default model and prompts, inside the shared folder (:func:`shared_dir`)
SHARED_MODEL = "models/stories260K"
SHARED_PROMPTS = "data/mtbench/question.jsonl"



def describe_exception(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, or of the errors inside an exception group (trio's
    nurseries wrap them), at most three, so a node's failure names its cause in one line."""
    leaves: list[BaseException] = []
    stack = [exc]
    while stack:
        current = stack.pop()
        if isinstance(current, BaseExceptionGroup):
            stack.extend(reversed(current.exceptions))
        else:
            leaves.append(current)
    text = "; ".join(f"{type(e).__name__}: {e}" for e in leaves[:3])
    return text + (f" (and {len(leaves) - 3} more)" if len(leaves) > 3 else "")

class DevnetError(PsError):
    """The devnet could not start (a deadline passed, a node failed) or lost a node it needed."""


#: worker processes per CPU core that the automatic rule aims at (:func:`auto_nodes_per_process`)
PROCESSES_PER_CORE = 4


def auto_nodes_per_process(nodes: int, cpus: int | None) -> int:
    """Nodes per worker process when ``--nodes-per-process`` is not given (the devnet applies it
    to the users; verifiers and model nodes run one per process, :meth:`DevnetOptions.
    role_per_process`): the nodes spread over about :data:`PROCESSES_PER_CORE` processes per
    core, ``ceil(nodes / (4 * cpus))``, at least 1.

    Why: a worker is one Python thread, so fewer processes than cores leave cores idle, and
    each process beyond that costs its imports again (~2.5 s of CPU and ~97 MB of a node's
    ~100 MB RSS) without adding CPU. Measured on 2 cores (benchmarks/README.md, "Devnet scale"):
    100 users one node per process spent their first ~130 s importing 106 processes. Four
    per core rather than one: the roles' loads differ (the verifiers' process is the busiest
    while nodes register, the model nodes' while prompts run), so the OS needs a few runnable
    processes per core to keep every core busy, and each process's trio loop serves fewer
    nodes in turn.

    Args:
        nodes: nodes to pack (the devnet's users).
        cpus: usable CPU cores (:func:`usable_cpus`); None or < 1 counts as 1.
    """
    processes = PROCESSES_PER_CORE * max(1, cpus or 1)
    return max(1, -(-nodes // processes))


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under ``taskset``), else
    :func:`os.cpu_count`, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: users of the first admission wave at least (a 3-hop path with distinct relays and proxies
#: needs a dozen users to choose from; below this many users all start at once)
ADMIT_MIN_WAVE = 16
#: admission waves of users at most (:func:`admission_waves`)
ADMIT_WAVES = 4
#: share of the admitted users that must hold their paths before the next wave starts
ADMIT_READY_SHARE = 0.75


def admission_waves(users: int) -> list[list[int]]:
    """The user indices of each admission wave: the users start in waves (a wave joins when
    :data:`ADMIT_READY_SHARE` of the users already started hold their paths), so the connection
    and path-setup burst of a start is bounded instead of every user dialling at once.

    ``users // ADMIT_MIN_WAVE`` waves (so each has at least 16 users), at least 1 and at most
    :data:`ADMIT_WAVES`; user ``i`` is in wave ``i % waves``, so each worker process (which holds
    consecutive users) has users in every wave and the work of a wave spreads over all
    processes. One wave (all at once) below 32 users.
    """
    waves = max(1, min(ADMIT_WAVES, users // ADMIT_MIN_WAVE))
    return [list(range(w, users, waves)) for w in range(waves)]


def user_not_ready(status: Mapping[str, Any], users: int) -> str | None:
    """What a user's status line (``ready_paths``, ``ready_proxies``) lacks before the user can
    send a request at once, or None: :data:`READY_PATHS` ready paths whose proxies are
    distinct (at most ``users - 1``, the other users). A request waits up to 1 s
    (``distinct_proxy_grace``) for n distinct proxies; a user counted ready with 4 paths over 3
    proxies paid that second on every request of an 8-user devnet. ``users``: the users
    started so far (the held users of later admission waves are in no
    directory yet, so no proxies).
    """
    paths = status.get("ready_paths", 0)
    proxies = status.get("ready_proxies", 0)
    if paths < READY_PATHS:
        return f"{paths}/{READY_PATHS} ready paths"
    distinct = min(READY_PATHS, users - 1)
    if proxies < distinct:
        return f"{READY_PATHS} ready paths over {proxies}/{distinct} distinct proxies"
    return None


def default_start_timeout(nodes: int) -> float:
    """Seconds the whole network may take to become ready: 60 s + 1 s per node."""
    return 60.0 + 1.0 * nodes


def shared_dir(
    environ: Mapping[str, str] = os.environ, repo: pathlib.Path = REPO
) -> pathlib.Path:
    """The shared model and data folder: ``$PS_SHARED_DIR``, else ``shared`` beside the
    repository (``../shared`` from its root), as the tests locate it."""
    return pathlib.Path(environ.get("PS_SHARED_DIR") or repo.parent / "shared")


def shared_defaults(
    model: str | None,
    prompts: str | None,
    *,
    engine: str,
    shared: pathlib.Path,
    exists: Callable[[pathlib.Path], bool] = pathlib.Path.exists,
) -> tuple[str | None, str | None]:
    """The devnet's ``(model, prompts)``: each one given wins; a missing one is the shared
    TinyStories model (:data:`SHARED_MODEL`, engine ``transformers`` only: ``instant`` loads
    none) or the MT-Bench questions (:data:`SHARED_PROMPTS`) when that path ``exists``, else
    None (:meth:`DevnetOptions.validate` then names the flag to give)."""
    if model is None and engine == "transformers" and exists(shared / SHARED_MODEL):
        model = str(shared / SHARED_MODEL)
    if prompts is None and exists(shared / SHARED_PROMPTS):
        prompts = str(shared / SHARED_PROMPTS)
    return model, prompts


@dataclass
class DevnetOptions:
    """Options of :func:`run_devnet` and :func:`open_devnet` (the ``ps-node devnet`` flags).

    Attributes:
        model: model folder or ``.gguf`` of the model nodes (engine ``transformers`` only).
        prompts: prompt file (see :func:`load_prompts`); :func:`run_devnet` only.
        engine: ``transformers``, ``instant`` (fake engine, answers at once) or ``sim``
            (modelled latencies, :mod:`ps_p2p.engines.sim_engine`).
        nodes_per_process: nodes per worker process (>= 1); None: the automatic rule, the
            users by :func:`auto_nodes_per_process` of the user count and :func:`usable_cpus`,
            verifiers and model nodes one per process (:meth:`role_per_process`). Model nodes
            of the ``transformers`` engine always run one per process (each loads its model
            and generates on the process's one thread).
        shared_prefix: characters of a shared prefix put before every prompt (0: none): the
            prompt set's first prompt repeated up to that length, like a long system prompt or
            document every request shares, so model nodes forward requests to the node that
            holds its KV cache (sec. 3.3; the JSON report's ``served_by`` / ``forwarded_by``).
        start_timeout: seconds until the network must be ready; None:
            :func:`default_start_timeout`.
        timeout: seconds per prompt.
        workdir: keep keys, logs and status files here; None = a temporary directory, removed
            at the end.
    """

    model: str | None = None
    prompts: str | None = None
    users: int = 8
    models: int = 2
    verifiers: int = 4
    json_out: str | None = None
    perturb: str = "none"
    limit: int | None = None
    max_tokens: int = 48
    concurrency: int = 4
    timeout: float = 120.0
    workdir: str | None = None
    show: int = 300
    log_level: str = "INFO"
    start_timeout: float | None = None
    engine: str = "transformers"
    nodes_per_process: int | None = None
    shared_prefix: int = 0

    @property
    def nodes(self) -> int:
        return self.verifiers + self.models + self.users

    @property
    def per_process(self) -> int:
        """Users per worker process: ``nodes_per_process``, or the automatic rule's choice for
        the users (verifiers and model nodes then run one per process:
        :meth:`role_per_process`)."""
        if self.nodes_per_process is not None:
            return self.nodes_per_process
        return auto_nodes_per_process(self.users, usable_cpus())

    def role_per_process(self, role: str) -> int:
        """Nodes of ``role`` per worker process. Given ``nodes_per_process``, that for every
        role (but one per process for ``transformers`` model nodes); automatic: the users
        packed by :func:`auto_nodes_per_process`, verifiers and model nodes one per process.
        They are few and each serves every other node (registrations, directories, consensus;
        requests): packed four to a process, the verifiers of a 100-user start shared one
        core's turn, stopped answering registrations and held the last users back."""
        if role == "model" and self.engine == "transformers":
            return 1
        if self.nodes_per_process is None and role != "user":
            return 1
        return self.per_process

    @property
    def start_deadline(self) -> float:
        """Seconds allowed for the start (``start_timeout`` or its default)."""
        if self.start_timeout is not None:
            return self.start_timeout
        return default_start_timeout(self.nodes)

    def validate(self) -> None:
        """Raise ConfigError on an impossible combination."""
        if self.users < 4 or self.models < 1 or self.verifiers < 1:
            raise ConfigError("a devnet needs --users >= 4, --models >= 1, --verifiers >= 1")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        if self.perturb not in PERTURBATIONS:
            raise ConfigError(f"unknown perturbation {self.perturb!r}")
        if self.nodes_per_process is not None and self.nodes_per_process < 1:
            raise ConfigError("--nodes-per-process must be >= 1")
        if self.perturb in ("kill-verifier", "byzantine-verifier") and self.verifiers < 4:
            raise ConfigError(f"--perturb {self.perturb} needs --verifiers >= 4 (a committee "
                              "of 3f+1 with f >= 1 commits without one of them)")
        if self.start_timeout is not None and self.start_timeout <= 0:
            raise ConfigError("--start-timeout must be > 0")
        if self.concurrency < 1:
            raise ConfigError("--concurrency must be >= 1")
        if not 0 <= self.shared_prefix <= 100_000:
            raise ConfigError("--shared-prefix must be in 0..100000 characters")
        if self.engine == "transformers":
            if not self.model:
                raise ConfigError(
                    "--engine transformers needs --model PATH (or use --engine instant)"
                )
            if not pathlib.Path(self.model).expanduser().exists():
                raise ConfigError(f"model {self.model} not found")


# ---------------------------------------------------------------------- prompts


def with_shared_prefix(prompts: list[Prompt], chars: int) -> list[Prompt]:
    """``prompts`` each preceded by the same ``chars`` characters: the first prompt's text
    repeated up to that length, then a blank line (``--shared-prefix``)."""
    seed = prompts[0].text.strip() + " "
    prefix = (seed * (chars // len(seed) + 1))[:chars]
    return [Prompt(p.prompt_id, f"{prefix}\n\n{p.text}") for p in prompts]


# ---------------------------------------------------------------------- controller side


@dataclass
class DevnetNode:
    """One node of the devnet as the controller sees it (from its worker's status lines)."""

    name: str
    role: str
    worker: _Worker
    status: dict[str, Any] = field(default_factory=dict)
    killed: bool = False

    @property
    def state(self) -> str:
        """``starting``, ``up``, ``stopped`` or ``failed``."""
        return self.status.get("state", "starting")

    @property
    def running(self) -> bool:
        return self.state in ("starting", "up") and not self.worker.exited

    @property
    def api(self) -> str | None:
        return self.status.get("api")

    @property
    def peer_id(self) -> str | None:
        return self.status.get("peer_id")


@dataclass
class _Worker:
    index: int
    process: trio.Process
    log_path: pathlib.Path
    nodes: list[DevnetNode] = field(default_factory=list)
    exited: bool = False
    killed: bool = False

    async def send(self, message: dict[str, Any]) -> None:
        """Write one control line; a worker that is gone is ignored."""
        stdin = self.process.stdin
        if stdin is None or self.exited:
            return
        try:
            await stdin.send_all(json.dumps(message).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError,
                OSError):
            pass


class Devnet:
    """A running devnet (see the module docstring); made by :func:`open_devnet`.

    Attributes:
        verifiers, models, users: the nodes by role, in start order.
        ready_s: seconds from the first process start until every user had its paths.
        workdir: keys, logs and status files (a temporary directory removed at the end unless
            ``options.workdir`` was given).
    """

    def __init__(self, opts: DevnetOptions, workdir: pathlib.Path, nursery: trio.Nursery) -> None:
        self.opts = opts
        self.workdir = workdir
        self._nursery = nursery
        self.workers: list[_Worker] = []
        self.verifiers: list[DevnetNode] = []
        self.models: list[DevnetNode] = []
        self.users: list[DevnetNode] = []
        self.ready_s: float | None = None
        #: the users' admission waves (:func:`admission_waves`): ``users`` (names),
        #: ``started_s`` (seconds after the start), ``admitted_with_paths`` of ``admitted``
        #: (users started before it, and how many of them held their paths then)
        self.waves: list[dict[str, Any]] = []
        #: users started so far (the first admission wave, then each wave as it joins)
        self.users_started = 0
        #: the committee's genesis file (written at the start)
        self.genesis_path: pathlib.Path | None = None
        self._verifier_addrs: list[str] = []
        self._specs: dict[str, dict[str, Any]] = {}  # by node name: to restart a node
        # the model group's secret ([forwarding] group_key), handed to the model nodes only
        from ps_p2p.config import new_group_key

        self._group_key = new_group_key()
        self.progress = Progress(nodes=opts.nodes, users=opts.users,
                                 directory_nodes=opts.models + opts.users)
        self._changed = trio.Event()
        self._stopping = False

    @property
    def nodes(self) -> list[DevnetNode]:
        return [*self.verifiers, *self.models, *self.users]

    # ------------------------------------------------------------------ start

    async def _start(self) -> None:
        opts = self.opts
        started = self.progress.started_at = trio.current_time()
        deadline = started + opts.start_deadline
        what = f"(--start-timeout {opts.start_deadline:g} s)"
        self.genesis_path = self._write_genesis()
        self.verifiers = await self._spawn_group("verifier", opts.verifiers, [])
        await self._wait(
            self.verifiers, lambda n: None if n.status.get("listen") else "not listening",
            "verifiers listening", deadline, what,
        )
        boot = [n.status["listen"][0] for n in self.verifiers]
        self.models = await self._spawn_group("model", opts.models, boot)
        waves = admission_waves(opts.users)
        self.waves = [{"users": [f"user{i}" for i in waves[0]], "started_s": 0.0,
                       "admitted_with_paths": 0, "admitted": 0}]
        self.users = await self._spawn_group("user", opts.users, boot,
                                             held=set().union(*waves[1:]))
        self.users_started = len(waves[0])
        print(f"  {len(self.workers)} processes started; waiting for the directory and the "
              "onion paths" + (f" (users join in {len(waves)} waves of ~{len(waves[0])})"
                               if len(waves) > 1 else "") + "...", flush=True)
        for number in range(1, len(waves)):
            # the next wave joins once most users already admitted hold their paths
            admitted = [self.users[i] for wave in waves[:number] for i in wave]
            await self._wait(
                admitted, lambda n, k=len(admitted): user_not_ready(n.status, k),
                f"wave {number} of {len(waves)} of the users to get their paths", deadline, what,
                enough=max(1, math.ceil(ADMIT_READY_SHARE * len(admitted))),
            )
            self.waves.append({
                "users": [self.users[i].name for i in waves[number]],
                "started_s": round(trio.current_time() - started, 1),
                "admitted_with_paths": sum(
                    1 for n in admitted if user_not_ready(n.status, len(admitted)) is None),
                "admitted": len(admitted),
            })
            for worker in self.workers:
                names = [self.users[i].name for i in waves[number]
                         if self.users[i].worker is worker]
                if names:
                    await worker.send({"start": names})
            self.users_started += len(waves[number])

        def directory_lacks(node: DevnetNode) -> str | None:
            d = node.status.get("directory")
            if d is None:
                return "no directory"
            if d["users"] < opts.users or d["model_nodes"] < opts.models:
                return (f"directory of {d['users']}/{opts.users} users, "
                        f"{d['model_nodes']}/{opts.models} model nodes")
            return None

        await self._wait([*self.models, *self.users], directory_lacks, "the full directory",
                         deadline, what)

        await self._wait(self.users, lambda n: user_not_ready(n.status, opts.users),
                         "user paths", deadline, what)
        self.ready_s = trio.current_time() - started
        self.progress.ready = True
        self.progress.phase = "ready"

    def _write_genesis(self) -> pathlib.Path:
        """Committee: the verifiers' keys, ports and genesis file, before any starts."""
        from ps_p2p.registry import AdmissionPolicy, Genesis
        from ps_p2p.consensus.types import Validator
        from ps_p2p.genesis import genesis_json
        from ps_p2p.keys import load_or_create_keys

        names = [f"verifier{i}" for i in range(self.opts.verifiers)]
        keys = [load_or_create_keys(self.workdir / "keys" / f"{n}.key") for n in names]
        ports = _free_ports(len(names))
        self._verifier_addrs = [
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{k.identity.peer_id_str}"
            for port, k in zip(ports, keys)
        ]
        genesis = Genesis(
            "devnet", int(time.time() * 1000) - 1000,
            tuple(Validator(k.identity.peer_id) for k in keys),
            AdmissionPolicy(max_records_per_network=max(32, 2 * self.opts.nodes)),
        )
        path = self.workdir / "genesis.json"
        path.write_text(genesis_json(genesis, _devnet_consensus(), names))
        return path

    async def _spawn_group(
        self, role: str, count: int, boot: list[str], held: Collection[int] = ()
    ) -> list[DevnetNode]:
        """Start the workers of ``count`` nodes of ``role``; nodes whose index is in ``held``
        wait in their worker for a ``{"start": [names]}`` line (admission waves)."""
        opts = self.opts
        nodes: list[DevnetNode] = []
        specs: list[dict[str, Any]] = []
        for i in range(count):
            name = f"{role}{i}"
            spec: dict[str, Any] = {
                "name": name,
                "role": role,
                "key_file": str(self.workdir / "keys" / f"{name}.key"),
                "log_file": str(self.workdir / "logs" / f"{name}.log"),
                "bootstrap": boot,
                "api": role == "user",
                "tamper": role == "user" and opts.perturb == "tamper-clove" and i == count - 1,
                "byzantine": (role == "verifier" and opts.perturb == "byzantine-verifier"
                              and i == count - 1),
                "held": i in held,
            }
            if role == "model":
                spec["group_key"] = self._group_key
            if self.genesis_path is not None:
                spec["genesis"] = str(self.genesis_path)
                if role == "verifier":
                    addr = self._verifier_addrs[i]
                    spec["listen"] = addr.rsplit("/p2p/", 1)[0]
                    spec["bootstrap"] = [a for a in self._verifier_addrs if a != addr]
                    spec["home"] = str(self.workdir / "homes" / name)
            specs.append(spec)
            self._specs[name] = spec
        per = opts.role_per_process(role)
        for first in range(0, count, per):
            nodes += await self._spawn_worker(specs[first:first + per])
        return nodes

    async def _spawn_worker(self, specs: list[dict[str, Any]]) -> list[DevnetNode]:
        index = len(self.workers)
        log_path = self.workdir / "logs" / f"worker{index}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(log_path, "ab") as logfile:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "ps_p2p.devnet"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logfile, env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the controller only
            )
        worker = _Worker(index, process, log_path)
        worker.nodes = [DevnetNode(s["name"], s["role"], worker) for s in specs]
        self.workers.append(worker)
        await worker.send({
            "nodes": specs,
            "log_level": self.opts.log_level,
            "engine": self.opts.engine,
            "model": self.opts.model,
        })
        self._nursery.start_soon(self._read_worker, worker)
        return worker.nodes

    async def _read_worker(self, worker: _Worker) -> None:
        """Apply the worker's status lines until it exits."""
        by_name = {n.name: n for n in worker.nodes}
        assert worker.process.stdout is not None
        try:
            async for line in _lines(worker.process.stdout):
                try:
                    status = json.loads(line)
                    node = by_name[status["node"]]
                except (ValueError, KeyError, TypeError):
                    log.warning("worker%d: bad status line %r", worker.index, line[:200])
                    continue
                node.status = status
                self._write_status(node)
                self._notify()
        finally:
            with trio.CancelScope(shield=True):
                await worker.process.wait()
            worker.exited = True
            self._notify()

    def _write_status(self, node: DevnetNode) -> None:
        path = self.workdir / "status" / f"{node.name}.json"
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(node.status))
            tmp.replace(path)
        except OSError:
            pass  # the work directory is being removed at the end

    def _notify(self) -> None:
        self._count()
        self._changed.set()
        self._changed = trio.Event()

    def _count(self) -> None:
        """Recount :attr:`progress` from the nodes' latest status lines (not while stopping:
        the last view keeps the counts of the run, not of its shutdown)."""
        opts, p = self.opts, self.progress
        if self._stopping:
            return
        p.nodes_up = sum(1 for n in self.nodes if n.state == "up" and n.running and not n.killed)
        p.nodes_down = sum(1 for n in self.nodes if n.killed or not n.running)
        p.with_directory = sum(
            1 for n in [*self.models, *self.users]
            if (d := n.status.get("directory")) is not None
            and d["users"] >= opts.users and d["model_nodes"] >= opts.models
        )
        p.users_ready = sum(1 for n in self.users
                            if user_not_ready(n.status, self.users_started) is None)

    async def _wait(
        self,
        nodes: Sequence[DevnetNode],
        lacks: Callable[[DevnetNode], str | None],
        what: str,
        deadline: float,
        hint: str,
        *,
        enough: int | None = None,
    ) -> None:
        """Wait until ``lacks(node)`` is None for every node, or for ``enough`` of them (status
        lines wake it up).

        Raises:
            DevnetError: a node failed or its worker exited, or ``deadline`` (trio time) passed;
                the message names every node not ready and what it lacked.
        """
        self.progress.phase = f"waiting for {what}"
        while True:
            for node in nodes:
                if node.state == "failed" or node.worker.exited:
                    raise DevnetError(self._failure(node))
            pending = [(n, lacks(n)) for n in nodes]
            pending = [(n, why) for n, why in pending if why is not None]
            if len(nodes) - len(pending) >= (len(nodes) if enough is None else enough):
                return
            now = trio.current_time()
            if now >= deadline:
                listed = "; ".join(f"{n.name}: {why}" for n, why in pending[:20])
                more = f"; and {len(pending) - 20} more" if len(pending) > 20 else ""
                raise DevnetError(
                    f"network not ready {hint}: waiting for {what}, {len(pending)} of "
                    f"{len(nodes)} nodes not ready: {listed}{more}"
                    + ("" if self.opts.workdir else "; run with --workdir DIR to keep the logs")
                )
            with trio.move_on_at(deadline):
                await self._changed.wait()

    def _failure(self, node: DevnetNode) -> str:
        if node.state == "failed":
            why = f"{node.name} failed: {node.status.get('error')}"
        else:
            why = f"{node.name}'s process exited with status {node.worker.process.returncode}"
        tail = _tail(node.worker.log_path, 8)
        if tail:
            why += "\n  last lines of its log:\n    " + "\n    ".join(tail)
        return why

    # ------------------------------------------------------------------ perturbation

    async def kill(self, victims: Sequence[DevnetNode]) -> list[str]:
        """Kill nodes; returns how each was killed (for a message).

        A worker whose every running node is a victim is SIGKILLed; other victims are stopped
        inside their worker (connections and listener closed, then tasks cancelled).
        """
        how: list[str] = []
        doomed = {id(v) for v in victims}
        for worker in self.workers:
            mine = [n for n in worker.nodes if id(n) in doomed and n.running and not n.killed]
            if not mine:
                continue
            survivors = [n for n in worker.nodes
                         if n.running and not n.killed and id(n) not in doomed]
            for node in mine:
                node.killed = True
            if not survivors:
                worker.killed = True
                if worker.process.returncode is None:
                    worker.process.kill()
                how += [f"{n.name} (SIGKILL of its process)" for n in mine]
            else:
                for node in mine:
                    await worker.send({"kill": node.name})
                how += [f"{n.name} (stopped inside its process; {len(survivors)} other node(s) "
                        "run on)" for n in mine]
        return how

    async def restart(self, node: DevnetNode, timeout: float = 60.0) -> DevnetNode:
        """Start a killed node again in a new worker process with the same keys, home and
        listen address (a verifier resumes from its consensus store and WAL); waits until it
        is up. Returns its new handle (it replaces ``node`` in the node lists).

        Raises:
            RuntimeError: ``node`` was not killed.
            trio.TooSlowError: not up within ``timeout`` seconds.
        """
        if not node.killed:
            raise RuntimeError(f"{node.name} is running; kill it first")
        spec = self._specs[node.name]
        if spec.get("listen"):  # a node stopped inside a worker may hold its port a moment
            await _wait_port_free(spec["listen"], timeout)
        (fresh,) = await self._spawn_worker([spec])
        for group in (self.verifiers, self.models, self.users):
            for i, n in enumerate(group):
                if n is node:
                    group[i] = fresh
        with trio.fail_after(timeout):
            while fresh.state != "up":
                if not fresh.running:
                    raise RuntimeError(f"{fresh.name} failed to start again (see its log)")
                await self.wait_changed()
        return fresh

    async def wait_changed(self) -> None:
        """Wait for the next status line of any node (or a worker's exit)."""
        await self._changed.wait()

    # ------------------------------------------------------------------ measurements

    def rss_bytes(self) -> int:
        """Sum of VmRSS (from ``/proc/<pid>/status``) of every running worker process."""
        total = 0
        for worker in self.workers:
            if worker.process.returncode is not None:
                continue
            try:
                text = pathlib.Path(f"/proc/{worker.process.pid}/status").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    async def send_prompts(
        self,
        prompts: Sequence[Prompt],
        *,
        concurrency: int,
        askers: Sequence[DevnetNode] | None = None,
        max_tokens: int = 48,
        timeout: float = 120.0,
        offset: int = 0,
        on_result: Callable[[dict[str, Any]], None] | None = None,
        on_first_dispatch: Callable[[], Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Send prompts through users' local APIs, ``concurrency`` at a time, round robin.

        Returns:
            one record per prompt (in completion order): ``prompt_id``, ``ok``, ``response``,
            ``served_by``, ``forwarded_by``, ``signature_valid``, ``cloves_received``,
            ``latency_ms`` (the user's measure, else the HTTP round trip), ``error``, ``user``,
            ``_index``.
        """
        import httpx

        askers = list(askers or self.users)
        limiter = trio.CapacityLimiter(max(1, concurrency))
        progress = self.progress
        progress.phase = "sending prompts"
        progress.prompts += len(prompts)
        dispatched = trio.Event()
        results: list[dict[str, Any]] = []

        async def one(http: Any, index: int, prompt: Prompt) -> None:
            async with limiter:
                progress.in_flight += 1
                user = askers[index % len(askers)]
                t0 = time.monotonic()
                record: dict[str, Any] = {
                    "prompt_id": prompt.prompt_id, "ok": False, "response": None,
                    "served_by": None, "forwarded_by": None, "signature_valid": False, "cloves_received": 0,
                    "latency_ms": None, "error": None, "user": user.name, "_index": index,
                }
                try:
                    request = http.post(f"{user.api}/v1/completions", json={
                        "prompt": prompt.text, "max_tokens": max_tokens, "timeout": timeout,
                    })
                    dispatched.set()
                    r = await request
                    body = r.json()
                    meta = body.get("planetserve", {})
                    record.update(
                        served_by=meta.get("served_by") or None,
                        forwarded_by=meta.get("forwarded_by") or None,
                        signature_valid=bool(meta.get("signature_valid")),
                        cloves_received=int(meta.get("cloves_received", 0)),
                        latency_ms=meta.get("latency_ms"),
                        attempts=meta.get("attempts"),
                    )
                    if r.status_code == 200:
                        record.update(ok=True, response=body["choices"][0]["text"])
                    else:
                        error = body.get("error", {})
                        record["error"] = error.get("message", f"HTTP {r.status_code}")
                except Exception as exc:
                    record["error"] = f"{type(exc).__name__}: {exc}"
                record["http_ms"] = round((time.monotonic() - t0) * 1000, 1)
                if record["latency_ms"] is None:
                    record["latency_ms"] = record["http_ms"]
                results.append(record)
                progress.in_flight -= 1
                if record["ok"]:
                    progress.answered += 1
                else:
                    progress.failed += 1
                if on_result is not None:
                    on_result(record)

        async def perturb() -> None:
            await dispatched.wait()
            # The request is on its way into the overlay; let it get there before the kill.
            await trio.sleep(0.2)
            assert on_first_dispatch is not None
            await on_first_dispatch()

        limits = httpx.Limits(max_connections=max(100, 2 * concurrency))
        async with httpx.AsyncClient(timeout=timeout + 30, limits=limits) as http:
            async with trio.open_nursery() as nursery:
                if on_first_dispatch is not None and prompts:
                    nursery.start_soon(perturb)
                for i, prompt in enumerate(prompts):
                    nursery.start_soon(one, http, offset + i, prompt)
        return results

    async def user_paths(self) -> dict[str, list[list[str]]]:
        """Relays (peer IDs) of every running user's ready paths, from its ``GET /status``."""
        import httpx

        paths_of: dict[str, list[list[str]]] = {}
        async with httpx.AsyncClient(timeout=30) as http:
            for user in self.users:
                if not user.running or user.api is None:
                    continue
                try:
                    r = await http.get(user.api + "/status")
                    paths_of[user.name] = [p["relays"] for p in r.json()["ready_paths"]]
                except Exception as exc:
                    print(f"  could not read {user.name}'s paths: {exc}", flush=True)
        return paths_of

    # ------------------------------------------------------------------ stop

    async def stop(self) -> None:
        """Stop every worker: ask, wait up to STOP_GRACE s, then SIGKILL. Shielded."""
        self._stopping = True
        self.progress.phase = "stopping"
        with trio.CancelScope(shield=True):
            for worker in self.workers:
                if worker.process.stdin is not None:
                    await worker.send({"stop": True})
                    with trio.move_on_after(1):
                        await worker.process.stdin.aclose()
            with trio.move_on_after(STOP_GRACE):
                for worker in self.workers:
                    await worker.process.wait()
            for worker in self.workers:
                if worker.process.returncode is None:
                    worker.process.kill()
                    await worker.process.wait()
        self.progress.phase = "stopped"


@asynccontextmanager
async def open_devnet(
    opts: DevnetOptions, *, display: Display | None = None
) -> AsyncIterator[Devnet]:
    """Start a devnet and wait until it is ready; stop it (and remove a temporary work directory)
    when the block exits, however it exits.

    ``display`` shows :attr:`Devnet.progress` while the devnet runs (default
    :class:`~ps_p2p.devnet_progress.PlainDisplay`: a line every 5 s while it starts).

    Raises:
        ConfigError: bad options.
        DevnetError: not ready within ``opts.start_deadline`` seconds, or a node failed while
            starting (the message names the nodes and what they lacked).
    """
    opts.validate()
    with work_directory(opts.workdir) as workdir:
        try:
            async with trio.open_nursery() as nursery:
                net = Devnet(opts, workdir, nursery)
                nursery.start_soon((display or PlainDisplay()).run, net.progress)
                try:
                    await net._start()
                    yield net
                finally:
                    await net.stop()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if len(leaves) == 1:  # the caller sees the DevnetError itself, not a group of one
                raise leaves[0] from None
            raise


@contextmanager
def work_directory(workdir: str | os.PathLike[str] | None) -> Iterator[pathlib.Path]:
    """The devnet's work directory, with its ``keys``, ``logs`` and ``status`` folders.

    ``workdir`` is created if needed and kept (its old status files removed); None makes a new
    ``ps-devnet-*`` directory under :func:`tempfile.gettempdir` that is removed when the block
    exits, however it exits (an error, Ctrl-C, or SIGTERM and SIGHUP, which the devnet turns into
    a cancellation). Only SIGKILL of the controller leaves it behind.
    """
    temporary = workdir is None
    path = pathlib.Path(tempfile.mkdtemp(prefix="ps-devnet-") if workdir is None else workdir)
    try:
        for sub in ("status", "logs", "keys"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        for stale in (path / "status").glob("*.json"):
            stale.unlink()
        yield path
    finally:
        if temporary:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- the command


def _choose_victims(users: list[DevnetNode], paths_of: dict[str, list[list[str]]]) -> list[str]:
    """Relays (peer IDs) to kill so that every user loses a relay on at least one path.

    Greedy hitting set: repeatedly take the relay on the paths of the most users not yet hit.
    """
    remaining = {u.name for u in users if paths_of.get(u.name)}
    relays_of = {
        u.name: {r for path in paths_of.get(u.name, []) for r in path} for u in users
    }
    victims: list[str] = []
    while remaining:
        counts: dict[str, int] = {}
        for name in remaining:
            for relay in relays_of[name]:
                counts[relay] = counts.get(relay, 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda r: counts[r])
        victims.append(best)
        remaining = {n for n in remaining if best not in relays_of[n]}
    return victims


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """``median``, ``p95``, ``p99`` and ``max`` of latencies in ms.

    The median is :func:`statistics.median`; the percentiles are nearest-rank (the smallest
    latency with at least q of the prompts at or below it), which :mod:`statistics` does not
    offer (its ``quantiles`` interpolates between samples): with the devnet's few dozen prompts
    an interpolated p99 is a latency no prompt had, the nearest rank is one that a prompt had.
    """
    lat = sorted(latencies_ms)
    if not lat:
        return {}

    def rank(q: float) -> float:
        return lat[min(len(lat) - 1, max(0, int(q * len(lat) + 0.999999) - 1))]

    return {"median": statistics.median(lat), "p95": rank(0.95), "p99": rank(0.99), "max": lat[-1]}


async def _devnet(opts: DevnetOptions) -> int:
    assert opts.prompts is not None
    prompts = load_prompts(opts.prompts, opts.limit)
    opts.validate()
    if opts.shared_prefix:
        prompts = with_shared_prefix(prompts, opts.shared_prefix)
    engine = opts.engine + (f" engine, model {opts.model}" if opts.engine == "transformers"
                            else " engine")
    print(f"devnet: a committee of {opts.verifiers} verifier(s), "
          f"{opts.models} model nodes ({engine}), "
          f"{opts.users} users, {opts.per_process} node(s) per process"
          f"{'' if opts.nodes_per_process else ' (auto: users; the others 1)'}; "
          f"{len(prompts)} prompts from {opts.prompts}; "
          f"work dir {opts.workdir or 'temporary (removed at exit)'}", flush=True)
    results: list[dict[str, Any]] = []
    started = time.monotonic()

    def show(record: dict[str, Any]) -> None:
        text = (record["response"] or "").replace("\n", " ")
        if len(text) > opts.show:
            text = text[: opts.show] + "..."
        state = "ok " if record["ok"] else "ERR"
        by = (record["served_by"] or "-")[-8:]
        print(f"[{len(results) + 1}/{len(prompts)}] {state} prompt {record['prompt_id']} via "
              f"{record['user']} served by ...{by} in {record['latency_ms']:.0f} ms "
              f"({record['cloves_received']} cloves, signature "
              f"{'valid' if record['signature_valid'] else 'INVALID'})", flush=True)
        if record["ok"]:
            print(f"      Q: {prompts[record['_index']].text[:100]!r}\n      A: {text}", flush=True)
        else:
            print(f"      error: {record['error']}", flush=True)
        results.append(record)

    async with open_devnet(opts, display=choose_display()) as net:
        print(f"network ready in {net.ready_s:.1f} s; {len(net.workers)} processes, "
              f"RSS {net.rss_bytes() / 2**20:.0f} MiB in all; logs in {net.workdir / 'logs'}",
              flush=True)
        users = net.users
        if opts.perturb == "tamper-clove":
            print(f"  perturbation: {users[-1].name} ({users[-1].peer_id}) tampers with "
                  "every cell and clove it relays", flush=True)
        if opts.perturb == "byzantine-verifier":
            byz = net.verifiers[-1]
            print(f"  perturbation: {byz.name} ({byz.peer_id}) is a byzantine validator: it "
                  "equivocates as proposer and as voter", flush=True)
        askers = [u for u in users if not (opts.perturb == "tamper-clove" and u is users[-1])]
        killing = opts.perturb in ("kill-relay", "kill-verifier")
        split = len(prompts) if not killing else max(1, len(prompts) // 3)
        common = dict(concurrency=opts.concurrency, max_tokens=opts.max_tokens,
                      timeout=opts.timeout, on_result=show)
        first = 0
        if opts.shared_prefix and len(prompts) > 1 and split > 1:
            # one model node caches the shared prefix first; once the group has its HR-tree
            # delta (gossiped every 2 s), prompts entering elsewhere are forwarded to it
            await net.send_prompts(prompts[:1], askers=askers, **common)  # type: ignore[arg-type]
            print("  shared prefix cached by one model node; waiting for the group's HR-tree "
                  "gossip", flush=True)
            await _until_prefix_gossiped(net)
            first = 1
        await net.send_prompts(prompts[first:split], askers=askers, offset=first,
                               **common)  # type: ignore[arg-type]
        restarted = ""
        if killing:
            # kill-verifier: killed during the second third, restarted from its home during
            # the last one (it must catch up by block sync and sign again)
            end = len(prompts) if opts.perturb == "kill-relay" else \
                max(split + 1, 2 * len(prompts) // 3)
            if opts.perturb == "kill-relay":
                victims, askers = await _plan_kill(net, askers)
            else:
                victims = [net.verifiers[-1]]
                print(f"  perturbation: will kill {victims[0].name} "
                      "(a committee validator) once "
                      "the next prompts are in flight", flush=True)

            async def kill() -> None:
                how = await net.kill(victims)
                print(f"  perturbation: killed {', '.join(how)}", flush=True)

            await net.send_prompts(prompts[split:end], askers=askers, offset=split,
                                   on_first_dispatch=kill, **common)  # type: ignore[arg-type]
            if opts.perturb == "kill-verifier" and end < len(prompts):
                state: dict[str, Any] = {}

                async def restart() -> None:
                    state["at"] = max(_heights(net.verifiers, skip=victims[0]))
                    state["node"] = await net.restart(victims[0])
                    print(f"  perturbation: restarted {victims[0].name} from its home "
                          f"(the others at height {state['at']})", flush=True)

                await net.send_prompts(prompts[end:], askers=askers, offset=end,
                                       on_first_dispatch=restart, **common)  # type: ignore[arg-type]
                restarted = await _caught_up(net, state.get("node"))
        evidence = _evidence_summary(net) + restarted
    if opts.json_out:
        with open(opts.json_out, "w", encoding="utf-8") as fh:
            for r in sorted(results, key=lambda r: r["_index"]):
                fh.write(json.dumps({k: v for k, v in r.items()
                                     if not k.startswith("_") and k != "http_ms"}) + "\n")
    ok = [r for r in results if r["ok"]]
    summary = f"answered {len(ok)}/{len(prompts)} prompts"
    stats = latency_summary([r["latency_ms"] for r in ok])
    if stats:
        summary += (f"; latency median {stats['median']:.0f} ms, p95 {stats['p95']:.0f} ms, "
                    f"p99 {stats['p99']:.0f} ms")
    valid = sum(1 for r in ok if r["signature_valid"])
    forwarded = sum(1 for r in ok if r.get("forwarded_by"))
    summary += (f"; {valid} valid signatures; {forwarded} forwarded within the model group"
                f"{evidence}; total {time.monotonic() - started:.1f} s")
    print(summary, flush=True)
    if opts.json_out:
        print(f"results written to {opts.json_out}")
    return 0 if len(ok) == len(prompts) and "NOT catch up" not in evidence else 1


async def _until_prefix_gossiped(net: Devnet, timeout: float = 30.0) -> None:
    """Wait until every model node but one (the one that served the first prompt) reports a
    peer's prefixes in its HR-tree (status ``forwarding.peer_entries``), at most ``timeout``
    seconds."""
    def knowing() -> int:
        return sum(1 for m in net.models
                   if (m.status.get("forwarding") or {}).get("peer_entries", 0) > 0)

    with trio.move_on_after(timeout):
        while knowing() < len(net.models) - 1:
            await net.wait_changed()
        return
    print(f"  (only {knowing()} model node(s) heard of the prefix within {timeout:.0f} s)",
          flush=True)


async def _wait_port_free(listen: str, timeout: float) -> None:
    """Wait until the TCP port of multiaddr ``listen`` can be bound on 127.0.0.1 (checked every
    0.1 s; the process that held it is closing its listener)."""
    import socket

    port = int(listen.rsplit("/tcp/", 1)[1].split("/")[0])
    with trio.move_on_after(timeout):
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                    return
                except OSError:
                    pass
            await trio.sleep(0.1)


def _heights(verifiers: Sequence[DevnetNode], skip: DevnetNode | None = None) -> list[int]:
    """The committed heights the verifiers' latest status lines report (0 when unknown)."""
    return [int((v.status.get("committee") or {}).get("committed_height", 0))
            for v in verifiers if v is not skip] or [0]


async def _caught_up(net: Devnet, node: DevnetNode | None, timeout: float = 60.0) -> str:
    """``"; NAME restarted: caught up ..."`` once the restarted verifier reports the others'
    height and has signed again (at most ``timeout`` seconds), for the summary line."""
    if node is None:
        return "; the killed verifier was not restarted"
    with trio.move_on_after(timeout):
        while True:
            mine = (node.status.get("committee") or {})
            target = max(_heights(net.verifiers, skip=node))
            if mine.get("committed_height", 0) >= target and mine.get("signed", 0) > 0:
                return (f"; {node.name} restarted from its home caught up to height "
                        f"{mine['committed_height']} ({mine.get('blocks_synced', 0)} blocks by "
                        f"block sync) and signed {mine['signed']} proposals/votes again")
            await net.wait_changed()
    mine = node.status.get("committee") or {}
    return (f"; {node.name} restarted but did NOT catch up within {timeout:.0f} s (height "
            f"{mine.get('committed_height', '?')}, signed {mine.get('signed', '?')})")


def _evidence_summary(net: Devnet) -> str:
    """``"; N equivocation evidence committed (against NAMES)"`` from the correct verifiers'
    latest status lines (the most any holds), for the summary line."""
    byzantine = net.opts.perturb == "byzantine-verifier"
    honest = [v for v in net.verifiers if not (byzantine and v is net.verifiers[-1])]
    views = [v.status["committee"] for v in honest if v.status.get("committee")]
    if not views:
        return "; evidence committed: unknown (no verifier status)"
    best = max(views, key=lambda c: c["evidence"])
    names = {v.peer_id: v.name for v in net.verifiers}
    against = ", ".join(names.get(p, p) for p in best["equivocators"])
    return f"; {best['evidence']} equivocation evidence committed" + (
        f" (against {against})" if against else "")


def _devnet_consensus():  # type: ignore[no-untyped-def]
    """Committee timeouts of a devnet on loopback (seconds; CometBFT's defaults are for WANs)."""
    from ps_p2p.consensus.core import ConsensusConfig

    return ConsensusConfig(
        timeout_propose=1.0, timeout_propose_delta=0.5, timeout_prevote=0.5,
        timeout_prevote_delta=0.25, timeout_precommit=0.5, timeout_precommit_delta=0.25,
    )


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (bound together, then released; a
    committee's verifiers must know each other's addresses before they start)."""
    import socket

    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


async def _plan_kill(
    net: Devnet, askers: list[DevnetNode]
) -> tuple[list[DevnetNode], list[DevnetNode]]:
    """Pick the relays to kill; returns (victims, users that keep asking)."""
    paths_of = await net.user_paths()
    victims = _choose_victims(net.users, paths_of)
    by_peer = {u.peer_id: u for u in net.users}
    nodes = [by_peer[p] for p in victims if p in by_peer]
    hit = sum(
        1 for u in net.users
        if any(v in {r for p in paths_of.get(u.name, []) for r in p} for v in victims)
    )
    print(f"  perturbation: will kill relay(s) {', '.join(n.name for n in nodes)} (on a path of "
          f"{hit} of {len(net.users)} users) once the next prompts are in flight", flush=True)
    survivors = [u for u in askers if u not in nodes]
    if not survivors:
        raise DevnetError("every user would be killed; use more --users")
    return nodes, survivors


async def _devnet_until_signal(opts: DevnetOptions) -> int:
    """:func:`_devnet`, stopped by SIGTERM or SIGHUP (its terminal closed) as by Ctrl-C
    (returns 128 + the signal number: 143, 129)."""
    status = 0
    async with trio.open_nursery() as nursery:

        async def main() -> None:
            nonlocal status
            status = await _devnet(opts)
            nursery.cancel_scope.cancel()

        async def on_sigterm() -> None:
            nonlocal status
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    print(f"{name}: stopping the devnet", file=sys.stderr, flush=True)
                    status = 128 + signum
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(on_sigterm)
        nursery.start_soon(main)
    return status


def run_devnet(opts: DevnetOptions) -> int:
    """Run the devnet to completion; returns 0 when every prompt was answered, 1 when not or
    when the network did not start, 130 after Ctrl-C, 143 after SIGTERM, 129 after SIGHUP.

    Raises:
        ConfigError: bad options or prompt file.
    """
    from ps_p2p.errors import is_keyboard_interrupt

    # Started in the background of a non-interactive shell, a process inherits SIGINT ignored;
    # Ctrl-C (or kill -INT) must still stop the devnet and remove its temporary directory.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return trio.run(_devnet_until_signal, opts)
    except BaseException as exc:
        errors = _leaves(exc)
        if errors and all(isinstance(e, ConfigError) for e in errors):
            raise errors[0] from None
        if errors and all(isinstance(e, DevnetError) for e in errors):
            for e in errors:
                print(f"devnet failed: {e}", file=sys.stderr)
            return 1
        if not is_keyboard_interrupt(exc):
            raise
        print("interrupted; every devnet process was stopped", file=sys.stderr)
        return 130


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _tail(path: pathlib.Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[bytes]:
    """Lines of ``stream`` (without the newline) until EOF; a line over 1 MiB ends it."""
    buffer = bytearray()
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if not chunk:
            return
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if line.strip():
                yield line
        if len(buffer) > _MAX_LINE:
            log.warning("status line over %d bytes; ignoring that worker's status", _MAX_LINE)
            return


# ---------------------------------------------------------------------- worker side

#: name of the node whose task is running (set in each node's task; trio tasks inherit it)
_NODE_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ps_devnet_node", default=None
)


class _NodeFilter(logging.Filter):
    """Passes the records logged inside one node's tasks (``node=None``: outside every node)."""

    def __init__(self, node: str | None) -> None:
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        return _NODE_NAME.get() == self.node


class _WorkerProcess:
    """The worker process: runs its nodes until told to stop (see the module docstring)."""

    def __init__(self, control: trio.abc.ReceiveStream, out: trio.abc.SendStream) -> None:
        self._control = control
        self._out = out
        self._scopes: dict[str, trio.CancelScope] = {}
        self._nodes: dict[str, Any] = {}
        self._send_status, self._statuses = trio.open_memory_channel[dict[str, Any]](10_000)

    async def run(self) -> None:
        lines = _lines(self._control).__aiter__()
        try:
            setup = json.loads(await lines.__anext__())
        except StopAsyncIteration:
            return
        self._setup_logging(setup)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_statuses)
            nursery.start_soon(self._stop_on_sigterm, nursery.cancel_scope)
            held: dict[str, dict[str, Any]] = {}
            for spec in setup["nodes"]:
                self._scopes[spec["name"]] = trio.CancelScope()
                if spec.get("held"):  # started by a later {"start": name} (admission waves)
                    held[spec["name"]] = spec
                else:
                    nursery.start_soon(self._run_node, spec, setup)
            async for line in lines:
                try:
                    command = json.loads(line)
                except ValueError:
                    log.warning("bad control line %r", line[:200])
                    continue
                if command.get("stop"):
                    break
                for name in command.get("start", ()):
                    if name in held:
                        nursery.start_soon(self._run_node, held.pop(name), setup)
                if command.get("kill") in self._scopes:
                    nursery.start_soon(self._kill, command["kill"])
            nursery.cancel_scope.cancel()  # stop, or EOF: the controller is gone

    async def _kill(self, name: str) -> None:
        """Stop one node as its peers would see a killed process: its connections and listener
        close now (a cancelled host leaves its sockets open, which peers take for a frozen
        node), then its tasks are cancelled."""
        log.info("devnet: killing %s", name)
        node = self._nodes.get(name)
        if node is not None and node.host is not None:
            with trio.move_on_after(KILL_CLOSE_TIMEOUT):
                try:
                    await node.host.get_network().close()
                except Exception:
                    log.exception("closing %s's connections", name)
        self._scopes[name].cancel()

    @staticmethod
    def _setup_logging(setup: dict[str, Any]) -> None:
        from ps_p2p.log_limits import setup_logging

        setup_logging(setup.get("log_level", "INFO"))
        root = logging.getLogger()
        for handler in root.handlers:
            handler.addFilter(_NodeFilter(None))
        fmt = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        for spec in setup["nodes"]:
            handler = logging.FileHandler(spec["log_file"])
            handler.setFormatter(fmt)
            handler.addFilter(_NodeFilter(spec["name"]))
            root.addHandler(handler)

    async def _stop_on_sigterm(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                scope.cancel()
                return

    async def _write_statuses(self) -> None:
        async for status in self._statuses:
            try:
                await self._out.send_all(json.dumps(status).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    def _emit(self, status: dict[str, Any]) -> None:
        try:
            self._send_status.send_nowait(status)
        except trio.WouldBlock:
            log.warning("status channel full; dropping a status of %s", status.get("node"))

    async def _run_node(self, spec: dict[str, Any], setup: dict[str, Any]) -> None:
        from ps_p2p.config import NodeConfig
        from ps_p2p.protocols.admission import LOOPBACK, InboundLimits
        from ps_p2p.keys import load_or_create_keys
        from ps_p2p.node import Node

        name = spec["name"]
        _NODE_NAME.set(name)
        scope = self._scopes[name]
        base = {"node": name, "pid": os.getpid()}
        try:
            with scope:
                keys = load_or_create_keys(pathlib.Path(spec["key_file"]))
                engine = None
                model = None
                if spec["role"] == "model":
                    engine = await self._engine(setup)
                    model = setup.get("model") or setup.get("engine") or "instant"
                config = NodeConfig(
                    roles=[spec["role"]], bootstrap=spec["bootstrap"], key_file=spec["key_file"],
                    model=model, tamper=bool(spec.get("tamper")), genesis=spec.get("genesis"),
                    byzantine=bool(spec.get("byzantine")),
                    home=spec.get("home"),
                    listen=spec.get("listen", NodeConfig.listen),
                    # every node on 127.0.0.1: per-address caps would group them all
                    connections=InboundLimits(exempt=LOOPBACK),
                    # a test network: a block a second when idle (the default is 30 s)
                    block_interval=1.0,
                )
                config.forwarding.group_key = spec.get("group_key", "")
                config.user.probe_timeout = PROBE_TIMEOUT_FLOOR
                async with trio.open_nursery() as nursery:
                    node = await nursery.start(Node(config, keys, engine).run)
                    self._nodes[name] = node
                    api_url = None
                    if spec.get("api"):
                        from ps_p2p.api.openai_compat import serve_api

                        api_url = await nursery.start(serve_api, node, "127.0.0.1:0")
                    nursery.start_soon(self._report, node, {**base, "api": api_url})
        except Exception as exc:
            log.exception("%s failed", name)
            self._emit({**base, "state": "failed", "error": describe_exception(exc)})
            return
        self._emit({**base, "state": "stopped"})

    @staticmethod
    async def _engine(setup: dict[str, Any]) -> Any:
        if setup.get("engine") == "instant":
            from ps_p2p.testing.fakes import InstantEngine

            return InstantEngine("instant")
        if setup.get("engine") == "sim":
            from ps_p2p.engines.sim_engine import SimEngine

            return SimEngine("sim")
        from ps_p2p.engines import load_engine

        return await trio.to_thread.run_sync(
            lambda: load_engine("transformers", model=setup["model"])
        )

    async def _report(self, node: Any, base: dict[str, Any]) -> None:
        """Emit the node's status now and whenever its directory or path pool changes (the
        directory's height alone, which an idle committee raises every second, is sent with
        the next line that has news, not on its own: 100 nodes would send 100 lines a second)."""
        last = None
        while True:
            d = node.directory
            ready = node.user.ready_paths() if node.user else []
            status = {
                **base,
                "state": "up",
                "peer_id": node.keys.identity.peer_id_str,
                "listen": node.listen_addrs,
                "directory": None if d is None else {
                    "height": d.height, "users": len(d.users()),
                    "model_nodes": len(d.model_nodes()),
                },
                "ready_paths": len(ready),
                "ready_proxies": len({p.relays[-1] for p in ready}),
            }
            committee = node.committee_status()
            if committee is not None:  # a committee verifier: its height, signatures, evidence
                status["committee"] = {k: committee[k] for k in (
                    "evidence", "equivocators", "committed_height", "signed", "blocks_synced")}
            if node.forwarding is not None:  # a model node: the peers' prefixes it knows of
                tree = node.forwarding.tree
                status["forwarding"] = {"peer_entries": sum(
                    tree.entries(p) for p in tree.peers() if p != node.peer_id)}
            if _without_height(status) != last:
                self._emit(status)
                last = _without_height(status)
            waits = [node.wait_directory_update]
            if node.user is not None:
                waits.append(node.user.wait_changed)
            if node.forwarding is not None:
                waits.append(node.forwarding.wait_changed)
            async with trio.open_nursery() as race:
                for wait in waits:
                    race.start_soon(_then_cancel, wait, race.cancel_scope)


def _without_height(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` without its directory's height (what decides whether a line is news)."""
    if not status.get("directory"):
        return status
    return {**status, "directory": {k: v for k, v in status["directory"].items()
                                    if k != "height"}}


async def _then_cancel(fn: Callable[[], Any], scope: trio.CancelScope) -> None:
    await fn()
    scope.cancel()


def worker_main() -> int:
    """Entry point of a worker process (``python -m ps_p2p.devnet``): stdin carries the control
    lines, the original stdout the status lines; fd 1 then points at stderr (the worker log), so
    nothing a library prints can garble the status lines."""
    out_fd = os.dup(1)
    os.dup2(2, 1)
    control = trio.lowlevel.FdStream(os.dup(0))
    out = trio.lowlevel.FdStream(out_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller stops workers, not a terminal
    trio.run(_WorkerProcess(control, out).run)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
