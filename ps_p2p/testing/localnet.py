"""An in-process PlanetServe network for tests and benchmarks.

:func:`open_localnet` starts one verifier, model nodes and user nodes as real py-libp2p hosts on
127.0.0.1 inside the calling trio run, waits until every user has a full directory and its paths,
and yields a :class:`LocalNet`. Each node runs in its own cancel scope so a test can kill one
(:meth:`LocalNet.kill`) the way a crash would: its host closes and its connections drop.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from ps_p2p.config import NodeConfig
from ps_p2p.engines.base import Engine
from ps_p2p.keys import NodeKeys
from ps_p2p.node import Node
from ps_p2p.roles.user import UserConfig
from ps_p2p.testing.fakes import InstantEngine


@dataclass
class LocalNet:
    """Handles on the running nodes of :func:`open_localnet`."""

    verifier: Node
    models: list[Node]
    users: list[Node]
    scopes: dict[bytes, trio.CancelScope] = field(default_factory=dict)

    def node(self, peer_id: bytes) -> Node:
        for n in [self.verifier, *self.models, *self.users]:
            if n.peer_id == peer_id:
                return n
        raise KeyError(peer_id.hex())

    def kill(self, node: Node) -> None:
        """Stop ``node`` abruptly (its host closes; peers see the connection drop)."""
        self.scopes[node.peer_id].cancel()

    async def crash(self, node: Node, close_timeout: float = 3.0) -> None:
        """Stop ``node`` as a crashed process stops: its connections and listener close first
        (peers read EOF on every link at once; a cancelled task alone can leave its sockets
        open, which peers take for a frozen node), then its tasks are cancelled.

        Args:
            close_timeout: seconds allowed for closing the connections.
        """
        if node.host is not None:
            with trio.move_on_after(close_timeout):
                await node.host.get_network().close()
        self.kill(node)


async def _run_node(node: Node, scope: trio.CancelScope, *, task_status: trio.TaskStatus[Node]) -> None:
    with scope:
        await node.run(task_status=task_status)


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
    """
    engine_factory = engine_factory or (lambda i: InstantEngine())
    ucfg = user_config or UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=5.0)
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        net_scopes: dict[bytes, trio.CancelScope] = {}

        async def start(config: NodeConfig, engine: Engine | None = None) -> Node:
            node = Node(config, NodeKeys.generate(), engine, rng=random.Random(rng.random()))
            scope = trio.CancelScope()
            net_scopes[node.peer_id] = scope
            return await nursery.start(_run_node, node, scope)

        fast = dict(
            directory_refresh=0.5,
            register_interval=min(2.0, record_lifetime / 3),
            record_lifetime=record_lifetime,
            metrics="127.0.0.1:0" if metrics else None,
        )
        verifier = await start(NodeConfig(roles=["verifier"], **fast))
        boot = [verifier.listen_addrs[0]]
        model_nodes = []
        for i in range(models):
            cfg = NodeConfig(roles=["model"], bootstrap=boot, model="fake", **fast)
            cfg.model_node.capacity = model_capacity
            cfg.model_node.max_queue = model_max_queue
            model_nodes.append(await start(cfg, engine_factory(i)))
        user_nodes = []
        for i in range(users):
            cfg = NodeConfig(
                roles=["user"], bootstrap=boot, tamper=i in tamper,
                user=dataclasses.replace(ucfg), **fast,
            )
            user_nodes.append(await start(cfg))
        net = LocalNet(verifier, model_nodes, user_nodes, net_scopes)
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
