"""An in-process PlanetServe network for tests and benchmarks.

:func:`open_localnet` starts one verifier (or, with ``committee=N``, a committee of N verifiers
running consensus from a genesis file written to a temporary folder), model nodes and user
nodes as real py-libp2p hosts on 127.0.0.1 inside the calling trio run, waits until every user
has a full directory and its paths, and yields a :class:`LocalNet`. Each node runs in its own
cancel scope so a test can kill one (:meth:`LocalNet.kill`) the way a crash would: its host
closes and its connections drop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import random
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from ps_p2p import records
from ps_p2p import registry as app
from ps_p2p.config import NodeConfig, VerificationConfig, new_group_key
from ps_p2p.consensus.block import BlockLimits
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.types import Validator
from ps_p2p.engines.base import Engine
from ps_p2p.genesis import genesis_json
from ps_p2p.keys import Identity, NodeKeys, membership_to_json
from ps_p2p.node import Node
from ps_p2p.protocols.admission import LOOPBACK, InboundLimits
from ps_p2p.roles.user import UserConfig
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.verification.ledger import VerificationParams
from ps_p2p.verification.sealing import generate_committee_key, key_commitment

log = logging.getLogger(__name__)

#: seconds a verifier's challenge may take in a localnet (``[verification] challenge_timeout``);
#: a genesis whose leaders should not overlap gives each attempt at least this plus
#: :data:`~ps_p2p.verification.service.REPORT_MARGIN_S` (``attempt_ms``)
CHALLENGE_TIMEOUT_S = 30.0


@dataclass
class LocalNet:
    """Handles on the running nodes of :func:`open_localnet`."""

    verifier: Node
    models: list[Node]
    users: list[Node]
    scopes: dict[bytes, trio.CancelScope] = field(default_factory=dict)
    #: peer IDs of the nodes stopped by :meth:`crash`
    crashed: set[bytes] = field(default_factory=set)
    #: every verifier of the committee
    verifiers: list[Node] = field(default_factory=list)
    #: the genesis file of the committee
    genesis_path: pathlib.Path | None = None
    _start_user: Callable[[], Awaitable[Node]] | None = None

    async def start_user(self) -> Node:
        """Start one more user node, configured as the others (it registers and fetches the
        directory on its own; wait for it with ``wait_directory``)."""
        assert self._start_user is not None
        node = await self._start_user()
        self.users.append(node)
        return node

    def node(self, peer_id: bytes) -> Node:
        for n in [*(self.verifiers or [self.verifier]), *self.models, *self.users]:
            if n.peer_id == peer_id:
                return n
        raise KeyError(peer_id.hex())

    def kill(self, node: Node) -> None:
        """Stop ``node`` abruptly (its host closes; peers see the connection drop)."""
        self.scopes[node.peer_id].cancel()

    async def crash(self, node: Node, close_timeout: float = 3.0) -> None:
        """Stop ``node`` as a crashed process stops: every TCP socket and listener of its host
        is closed and its tasks are cancelled in one step, with no schedule point between
        (:func:`sever_sockets`), so peers read EOF on every link at once and the node does
        nothing after its first link drops; its listeners close after. Closing the connections one by one first (as
        ``Swarm.close`` does) let the dying node re-register its record while its peers
        already found it lost; cancelling alone can leave its sockets open, which peers take
        for a frozen node."""
        self.crashed.add(node.peer_id)  # what its dying host raises is not the test's
        if node.host is None:
            self.kill(node)
            return
        sever_sockets(node.host)
        self.kill(node)
        # the listeners' accept loops run in py-libp2p's system tasks, which must not see
        # their socket vanish: closed the library's way, once nothing of the node runs
        with trio.move_on_after(close_timeout):
            await node.host.get_network().close()


#: attributes :func:`sever_sockets` does not follow: they lead out of one connection
_SEVER_SKIP = frozenset({"swarm", "host", "peerstore", "peer_store", "network", "_swarm"})


def _socket_streams(root: object, depth: int = 8) -> list[trio.SocketStream]:
    """The trio socket streams under ``root`` (a py-libp2p connection or listener), found by
    following instance attributes, lists, tuples and dicts of py-libp2p and trio objects up to
    ``depth`` levels, never through :data:`_SEVER_SKIP` (so never into another connection)."""
    found: list[trio.SocketStream] = []
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(root, 0)]
    while stack:
        obj, level = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, trio.SocketStream):
            found.append(obj)
            continue
        if level >= depth:
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((item, level + 1) for item in obj)
            continue
        if isinstance(obj, dict):
            stack.extend((item, level + 1) for item in obj.values())
            continue
        module = type(obj).__module__ or ""
        if not module.startswith(("libp2p", "trio")):
            continue
        for name, value in getattr(obj, "__dict__", {}).items():
            if name not in _SEVER_SKIP:
                stack.append((value, level + 1))
    return found


def sever_sockets(host: object) -> int:
    """Close every TCP socket of ``host``'s connections at once, synchronously
    (as the kernel does for a process that dies): peers read EOF, and this host's tasks
    blocked on them raise ``ClosedResourceError``. Returns how many sockets were closed."""
    network = host.get_network()  # type: ignore[attr-defined]
    roots: list[object] = [conn for conns in list(network.connections.values())
                           for conn in list(conns)]
    closed = 0
    for root in roots:
        for stream in _socket_streams(root):
            stream.socket.close()
            closed += 1
    return closed


async def _run_node(node: Node, scope: trio.CancelScope, crashed: set[bytes], *,
                    task_status: trio.TaskStatus[Node]) -> None:
    """Run ``node`` in ``scope``; once it is in ``crashed`` (LocalNet.crash), what its dying host
    raises (e.g. py-libp2p reading the address of a listener just closed) is logged, not
    raised."""
    try:
        with scope:
            await node.run(task_status=task_status)
    except Exception as exc:
        if node.peer_id not in crashed:
            raise
        log.debug("crashed node %s raised while dying: %r", node.keys.identity.peer_id_str, exc)


@asynccontextmanager
async def open_localnet(
    *,
    users: int = 6,
    models: int = 1,
    engine_factory: Callable[[int], Engine] | None = None,
    user_config: UserConfig | None = None,
    tamper: tuple[int, ...] = (),
    model_capacity: int = 2,
    model_max_queue: int = 64,
    seed: int = 1,
    ready_timeout: float = 90.0,
    record_lifetime: float = 120.0,
    metrics: bool = False,
    committee: int = 1,
    block_interval: float = 0.25,
    consensus: ConsensusConfig | None = None,
    byzantine: tuple[int, ...] = (),
    verification: VerificationParams | None = None,
    pool: Sequence[str] = (),
    verifier_engine: Callable[[int], Engine] | None = None,
    model_organization: Callable[[int], str] | None = None,
    forwarding: bool = True,
    challenge_mix: object = None,
) -> AsyncIterator[LocalNet]:
    """Run a verifier, ``models`` model nodes and ``users`` user nodes in this trio run.

    Args:
        engine_factory: engine of model node i (default :class:`InstantEngine`).
        user_config: settings of every user (default: n=4, k=3, N=5 paths, fast probes).
        tamper: indices of users that corrupt what they relay.
        seed: seeds every node's relay and model choice.
        record_lifetime: seconds a node record stays valid (nodes re-register every
            ``min(2, record_lifetime / 3)`` seconds).
        metrics: every node serves ``/metrics`` on 127.0.0.1, a free port each
            (``node.metrics.url``).
        committee: N >= 1 verifiers (1: a committee of one; 4 for f = 1) in a genesis (chain
            ``localnet``, loopback timeouts of :data:`~ps_p2p.testing.committee.
            FAST_CONSENSUS`, an admission policy for one /24), each with its store in a
            temporary home, and every node with ``genesis`` set: users and model nodes trust
            only directories committed by 2f+1 of them.
        block_interval: committee: seconds an idle chain waits before an empty block.
        consensus: committee: the genesis' timeouts (default ``FAST_CONSENSUS``).
        byzantine: committee: indices of verifiers that equivocate (TEST ONLY
            ``NodeConfig.byzantine``).
        verification: the genesis' challenge epochs (None: none); then every verifier also
            has the user role, the prompt ``pool`` (its digest must be the params') and the
            reference engine ``verifier_engine(i)``, and the block limits take 1 MiB reports;
            a fresh committee key seals the reports (its commitment replaces an empty
            ``committee_key_sha256``).
        model_organization: the organization in model node i's record (default none): one
            organization key per name, made here, signs each member's certificate (30 days;
            ``NodeConfig.membership``).
        forwarding: model nodes forward within their group (``[forwarding] enabled``; all share
            one fresh ``group_key`` secret).
        challenge_mix: the verifiers' distribution of challenge shapes
            (:class:`~ps_p2p.verification.challenges.ChallengeMix`; None: the default), e.g.
            short answers to keep a test fast.
    """
    engine_factory = engine_factory or (lambda i: InstantEngine())
    ucfg = user_config or UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=5.0)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ps-localnet-") as tmp:
        async with _open_localnet(
            tmp=pathlib.Path(tmp), users=users, models=models, engine_factory=engine_factory,
            ucfg=ucfg, tamper=tamper, model_capacity=model_capacity,
            model_max_queue=model_max_queue, rng=rng, ready_timeout=ready_timeout,
            record_lifetime=record_lifetime, metrics=metrics, committee=committee,
            block_interval=block_interval, consensus=consensus, byzantine=byzantine,
            verification=verification, pool=pool, verifier_engine=verifier_engine,
            model_organization=model_organization, forwarding=forwarding,
            challenge_mix=challenge_mix,
        ) as net:
            yield net


def write_genesis(folder: pathlib.Path, keys: list[NodeKeys],
                  consensus: ConsensusConfig | None = None,
                  verification: VerificationParams | None = None) -> pathlib.Path:
    """Write a genesis file of ``keys`` as equal validators (chain ``localnet``) in ``folder``.

    Loopback settings: the timeouts of ``FAST_CONSENSUS`` (default), and an admission policy
    that lets one /24 hold 10,000 records (every node listens on 127.0.0.1).
    """
    from ps_p2p.testing.committee import FAST_CONSENSUS

    genesis = app.Genesis(
        "localnet", time.time_ns() // 1_000_000 - 1000,
        tuple(Validator(k.identity.peer_id) for k in keys),
        app.AdmissionPolicy(max_records_per_network=10_000),
        limits=BlockLimits(max_block_bytes=4 << 20, max_tx_bytes=1 << 20)
        if verification is not None else BlockLimits(),
        verification=verification,
    )
    path = folder / "genesis.json"
    path.write_text(genesis_json(genesis, consensus or FAST_CONSENSUS,
                                 [f"verifier{i}" for i in range(len(keys))]))
    return path


@asynccontextmanager
async def _open_localnet(
    *, tmp: pathlib.Path, users: int, models: int, engine_factory: Callable[[int], Engine],
    ucfg: UserConfig, tamper: tuple[int, ...], model_capacity: int, model_max_queue: int,
    rng: random.Random, ready_timeout: float, record_lifetime: float, metrics: bool,
    committee: int, block_interval: float, consensus: ConsensusConfig | None,
    byzantine: tuple[int, ...], verification: VerificationParams | None = None,
    pool: Sequence[str] = (), verifier_engine: Callable[[int], Engine] | None = None,
    model_organization: Callable[[int], str] | None = None, forwarding: bool = True,
    challenge_mix: object = None,
) -> AsyncIterator[LocalNet]:
    async with trio.open_nursery() as nursery:
        net_scopes: dict[bytes, trio.CancelScope] = {}
        crashed: set[bytes] = set()

        async def start(config: NodeConfig, engine: Engine | None = None,
                        keys: NodeKeys | None = None, challenge_mix: object = None) -> Node:
            node = Node(config, keys or NodeKeys.generate(), engine,
                        rng=random.Random(rng.random()))
            node.challenge_mix = challenge_mix
            scope = trio.CancelScope()
            net_scopes[node.peer_id] = scope
            return await nursery.start(_run_node, node, scope, crashed)

        fast = dict(
            directory_refresh=0.5,
            register_interval=min(2.0, record_lifetime / 3),
            record_lifetime=record_lifetime,
            metrics="127.0.0.1:0" if metrics else None,
            # every node on 127.0.0.1: per-address connection caps would group them all
            connections=InboundLimits(exempt=LOOPBACK),
        )
        if committee < 1:
            raise ValueError("a localnet needs a committee of at least one verifier")
        keys = [NodeKeys.generate() for _ in range(committee)]
        committee_key = generate_committee_key()
        if verification is not None and not verification.committee_key_sha256:
            verification = dataclasses.replace(
                verification, committee_key_sha256=key_commitment(committee_key))
        genesis_path = write_genesis(tmp, keys, consensus, verification)
        genesis: dict[str, object] = dict(genesis=str(genesis_path))
        epochs: dict[str, object] = {}
        if verification is not None:
            pool_path = tmp / "pool.jsonl"
            pool_path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in pool))
            epochs = dict(verification=VerificationConfig(pool=[str(pool_path)],
                                                          challenge_timeout=CHALLENGE_TIMEOUT_S,
                                                          committee_key=committee_key.hex()),
                          model="reference", user=dataclasses.replace(ucfg))
        verifiers: list[Node] = []
        for i, k in enumerate(keys):
            cfg = NodeConfig(
                roles=["verifier", "user"] if epochs else ["verifier"],
                home=str(tmp / f"verifier{i}"),
                bootstrap=[v.listen_addrs[0] for v in verifiers],
                block_interval=block_interval, byzantine=i in byzantine,
                **genesis, **fast, **epochs,  # type: ignore[arg-type]
            )
            reference = verifier_engine(i) if verifier_engine is not None and epochs else None
            verifiers.append(await start(cfg, reference, keys=k, challenge_mix=challenge_mix))
        await _mesh(verifiers)
        verifier = verifiers[0]
        boot = [v.listen_addrs[0] for v in verifiers]
        model_nodes = []
        org_keys: dict[str, Identity] = {}
        group_key = new_group_key()  # one secret: every model's group gets its own key from it
        for i in range(models):
            node_keys = NodeKeys.generate()
            name = model_organization(i) if model_organization else ""
            membership = None
            if name:
                org_key = org_keys.setdefault(name, Identity.generate())
                cert = records.sign_membership(org_key, name, node_keys.identity.peer_id,
                                               time.time_ns() // 1_000_000 + 30 * 86_400_000)
                path = tmp / f"model{i}.membership.json"
                path.write_text(membership_to_json(name, node_keys.identity.peer_id, cert))
                membership = str(path)
            cfg = NodeConfig(roles=["model"], bootstrap=boot, model="fake",
                             membership=membership,
                             **genesis, **fast)  # type: ignore[arg-type]
            cfg.forwarding.enabled = forwarding
            cfg.forwarding.group_key = group_key
            cfg.model_node.capacity = model_capacity
            cfg.model_node.max_queue = model_max_queue
            model_nodes.append(await start(cfg, engine_factory(i), keys=node_keys))
        user_nodes = []

        async def start_user(i: int = -1) -> Node:
            cfg = NodeConfig(
                roles=["user"], bootstrap=boot, tamper=i in tamper,
                user=dataclasses.replace(ucfg), **genesis, **fast,  # type: ignore[arg-type]
            )
            return await start(cfg)

        for i in range(users):
            user_nodes.append(await start_user(i))
        net = LocalNet(verifier, model_nodes, user_nodes, net_scopes, crashed=crashed,
                       verifiers=verifiers, genesis_path=genesis_path, _start_user=start_user)
        with trio.fail_after(ready_timeout):
            for node in user_nodes:
                await node.wait_directory(min_users=users, min_models=models, timeout=ready_timeout)
            for node in user_nodes:
                assert node.user is not None
                await node.user.wait_ready(ucfg.paths, timeout=ready_timeout)
        try:
            yield net
        finally:
            nursery.cancel_scope.cancel()


async def _mesh(nodes: list[Node]) -> None:
    """Tell every node every other node's address and connect them (a committee)."""
    import multiaddr
    from libp2p.peer.id import ID

    from ps_p2p.protocols.host import connect

    for a in nodes:
        assert a.host is not None
        store = a.host.get_peerstore()
        for b in nodes:
            if b is not a:
                addr = b.listen_addrs[0].rsplit("/p2p/", 1)[0]
                store.add_addrs(ID(b.peer_id), [multiaddr.Multiaddr(addr)], 0)
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            await connect(a.host, b.listen_addrs[0])  # type: ignore[arg-type]
