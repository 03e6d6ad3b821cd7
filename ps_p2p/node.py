"""One PlanetServe node: a py-libp2p host with the services of its roles.

:class:`Node` assembles, for the roles in its :class:`~ps_p2p.config.NodeConfig`:

* every role: the host (TCP + Noise + Yamux), the directory client
  (:class:`~ps_p2p.directory_client.CommitteeClient`: register the signed node record with the
  verifier committee every ``register_interval`` seconds, fetch the committed directory and
  verify its commit every ``directory_refresh`` seconds, feed the records' addresses to the
  peerstore);
* user: the overlay service as relay and proxy, and the :class:`~ps_p2p.roles.user.UserClient`;
* model: the overlay service (as clove destination) and the
  :class:`~ps_p2p.roles.model.ModelNodeService` with its engine;
* verifier: the committee's :class:`~ps_p2p.protocols.consensus.ConsensusService` and the
  :class:`~ps_p2p.protocols.committee_directory.CommitteeDirectoryService` (without a genesis
  file, a committee of one: ``<home>/genesis.json`` is written on the first run); with the
  user role, a reference engine (``engine``) and ``[verification] pool``, the challenge epochs
  (:class:`~ps_p2p.verification.service.EpochService`);
* observability: :class:`~ps_p2p.metrics.NodeMetrics` (its own Prometheus registry, served on
  ``config.metrics``) and a one-line status log every ``config.status_interval`` seconds.

Use it embedded in another trio program, on a host of its own::

    async with trio.open_nursery() as nursery:
        node = await nursery.start(Node(config, keys, engine).run)
        await node.wait_directory()
        answer = await node.user.ask("Once upon a time")

or on a py-libp2p host that another application built and owns (docs/embedding.md), beside
that application's own protocols; leaving the block removes our handlers, not the host::

    async with attach(app_host, NodeConfig(roles=["user"], bootstrap=[...])) as node:
        answer = await node.user.ask("Once upon a time")

Both paths run the same :meth:`Node._serve`; only where the host comes from differs.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from contextlib import AsyncExitStack, asynccontextmanager

import multiaddr
import trio
from libp2p.exceptions import BaseLibp2pError
from libp2p.abc import IHost, INetConn, INetwork, INotifee
from libp2p.peer.id import ID

from ps_p2p import records
from ps_p2p.config import NodeConfig
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.directory_client import CommitteeClient
from ps_p2p.engines.base import Engine
from ps_p2p.errors import ConfigError, PsError
from ps_p2p.genesis import (
    GenesisFile,
    genesis_hash,
    init_genesis,
    load_genesis,
    parse_genesis_text,
)
from ps_p2p.keys import NodeKeys, load_membership
from ps_p2p.metrics import NodeMetrics, status_message
from ps_p2p.protocols import committee_directory as committee_proto
from ps_p2p.protocols.addresses import (
    forget_dial_failures,
    forget_record_circuits,
    note_record_circuits,
    replace_peer_addrs,
)
from ps_p2p.protocols.circuit_relay import NatSupport
from ps_p2p.protocols.forward import FORWARD_PROTOCOL_ID
from ps_p2p.protocols.handlers import registered_protocols
from ps_p2p.protocols.host import (
    check_foreign_host,
    connect,
    host_identity,
    is_connected,
    listen_multiaddrs,
    open_host,
)
from ps_p2p.protocols.hrtree_gossip import (
    GOSSIPSUB_PROTOCOLS,
    HRTREE_SYNC_PROTOCOL_ID,
    running_pubsub,
)
from ps_p2p.protocols.notifee import QuietNotifee
from ps_p2p.protocols.overlay import (
    CLOVE_PROTOCOL_ID,
    DELIVER_PROTOCOL_ID,
    ONION_PROTOCOL_ID,
    OverlayConfig,
    OverlayService,
)
from ps_p2p.records import Directory, NodeRecord, Role
from ps_p2p.roles.forwarding import GroupForwarding
from ps_p2p.roles.model import ModelNodeService
from ps_p2p.roles.user import UserClient
from ps_p2p.serving.drain import DrainReport

log = logging.getLogger(__name__)

#: What a registration or directory fetch may fail with: our own errors (a bad reply, a refusal),
#: a deadline, py-libp2p's dial and stream errors, and the socket's.
_REMOTE_FAILURES = (PsError, trio.TooSlowError, BaseLibp2pError, OSError)
#: Longest wait (s) between registration attempts while no verifier takes the record.
REGISTER_BACKOFF_MAX = 30.0
#: Lifetime of the record a node registers to withdraw (:meth:`Node.withdraw`), ms.
WITHDRAW_LIFETIME_MS = 1000
#: Seconds a draining node allows for sending its last answers.
DRAIN_FLUSH_TIMEOUT = 5.0
#: Seconds a verifier that failed to answer is tried after the others.
VERIFIER_SUSPECT_SECONDS = 10.0
#: Directory rounds in a row with no verifier answering before a node given ``--genesis`` asks
#: its bootstrap peers outside that genesis which chain they serve (:meth:`Node._check_chain`).
CHAIN_CHECK_AFTER = 3
#: model nodes a user dials once it holds its paths (:meth:`Node._warm_model_links`)
WARM_MODEL_LINKS = 4
#: Most seconds between directory rounds while no verifier answers (then 30 s once the
#: bootstrap peers turned out to serve another chain).
REFRESH_BACKOFF_MAX = 4.0
#: Committee verifiers: the consensus store (WAL and blocks) in the node's home.
CONSENSUS_STORE_FILE = "consensus.sqlite"
#: A verifier's genesis when none is given: ``<home>/genesis.json`` (a committee of one).
GENESIS_FILE = "genesis.json"

_ROLE = {"user": Role.USER, "model": Role.MODEL, "verifier": Role.VERIFIER}


def _now_ms() -> int:
    return int(time.time() * 1000)


def directory_refresh_delay(
    *, configured: float, quiet_refreshes: int, has_peers: bool, head_ttl: float | None
) -> float:
    """Seconds until the next directory refresh.

    0.5 s until a directory with peers arrived; 1 s after a refresh that brought a change (a
    network that is changing, or starting up); then doubling with each refresh that brought
    nothing (1, 2, 4... s) up to ``configured``; never more than half the held directory's
    remaining validity ``head_ttl`` (seconds), nor less than 0.1 s.
    """
    if not has_peers:
        delay = min(0.5, configured)
    else:
        delay = min(configured, 1.0 * 2 ** max(0, quiet_refreshes - 1))
    if head_ttl is not None:
        delay = min(delay, head_ttl / 2)
    return max(0.1, delay)


def directory_news(old: Directory | None, new: Directory, changed: Sequence[NodeRecord]) -> bool:
    """Whether a directory refresh brought news, so the next one comes soon
    (:func:`directory_refresh_delay`): the first directory, another number of records, or a
    record in ``changed`` (the delta's records, or every record of a new list) that is new or
    says something else than the held one (addresses, roles, keys, model, capacity).

    No news: a higher height alone (an idle committee commits an empty block every
    ``block_interval``, 1 s in ``ps-node devnet``) or renewals (the same record with a later
    lifetime: a network of N nodes renews N/30 records a second, so past ~30 nodes every
    refresh brought one). Counting those kept every node refreshing every second, N fetches a
    second that each grow with N.
    """
    if old is None or len(old.records) != len(new.records):
        return True
    return any(_record_news(old.record(r.peer_id), r) for r in changed)


def _record_news(held: NodeRecord | None, record: NodeRecord) -> bool:
    """``record`` is new, or differs from ``held`` in more than its lifetime and signature."""
    return held is None or (held.addrs, held.roles, held.onion_key, held.model_id,
                            held.organization, held.capacity, held.membership) != (
        record.addrs, record.roles, record.onion_key, record.model_id, record.organization,
        record.capacity, record.membership)


class _DisconnectNotifee(QuietNotifee):
    """Tells the overlay when the last connection to a peer closed."""

    def __init__(self, on_disconnect: Callable[[bytes], None]) -> None:
        self._on_disconnect = on_disconnect

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        if not network.get_connections(peer):
            self._on_disconnect(peer.to_bytes())


def _remove_notifee(network: INetwork, notifee: INotifee) -> None:
    """Unregister ``notifee`` (py-libp2p 0.8.1: ``Swarm.remove_notifee``; else the list)."""
    remove = getattr(network, "remove_notifee", None)
    if remove is not None:
        remove(notifee)
    elif notifee in getattr(network, "notifees", []):
        network.notifees.remove(notifee)  # type: ignore[attr-defined]


class Node:
    """A PlanetServe node (see the module docstring).

    Args:
        config: validated :class:`NodeConfig`.
        keys: identity and onion keys (``ps_p2p.keys.load_or_create_keys``).
        engine: the inference engine; required with the model role.
        rng: randomness for relay/verifier/model choice (seed it in tests).

    Attributes:
        metrics: :class:`~ps_p2p.metrics.NodeMetrics` (its ``url`` once served).

    Raises:
        ConfigError: model role without an engine, or a bad trusted verifier ID.
    """

    def __init__(
        self,
        config: NodeConfig,
        keys: NodeKeys,
        engine: Engine | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        config.validate()
        if "model" in config.roles and engine is None:
            raise ConfigError("the model role needs an engine")
        self.config = config
        self.keys = keys
        self.engine = engine
        self.rng = rng or random.SystemRandom()
        self.peer_id = keys.identity.peer_id
        self.roles = frozenset(_ROLE[r] for r in config.roles)
        self.host: IHost | None = None
        self.overlay: OverlayService | None = None
        self.user: UserClient | None = None
        self.model: ModelNodeService | None = None
        #: model role with forwarding: the group's HR-tree, peers' load and gossip
        self.forwarding: GroupForwarding | None = None
        self.directory: Directory | None = None
        #: model role: whether the last installed directory trusts this node (None: none yet)
        self.trusted: bool | None = None
        self.listen_addrs: list[str] = []
        self._directory_ready = trio.Event()
        self._directory_changed_at = -1e9
        self._withdrawn = False
        self._last_issued_ms = 0
        self._notifee: _DisconnectNotifee | None = None
        #: Circuit Relay v2 for NATed nodes (:mod:`ps_p2p.protocols.circuit_relay`)
        self.nat: NatSupport | None = None
        self._own_host = False
        #: peer -> the record addresses last put in the peerstore (bounded by the directory)
        self._record_addrs: dict[bytes, tuple[bytes, ...]] = {}
        self._faults: Any = None  # TEST ONLY: a ps_p2p.testing.faults.FaultInjector
        self._verifier_failed: dict[bytes, float] = {}  # verifier -> suspect until (trio time)
        self._wrong_chain = False  # a bootstrap peer serves another chain (_check_chain)
        self._bootstrap: dict[bytes, str] = {}
        for addr in config.bootstrap:
            peer = ID.from_base58(addr.rsplit("/p2p/", 1)[1]).to_bytes()
            self._bootstrap[peer] = addr
        try:
            trusted = [ID.from_base58(v).to_bytes() for v in config.verifiers]
        except Exception as exc:
            raise ConfigError(f"bad --verifier peer ID: {exc}") from exc
        if not trusted:
            trusted = list(self._bootstrap)
        #: the genesis file of the committee: ``config.genesis``; for a verifier without one,
        #: ``<home>/genesis.json``, made on first run (a committee of one); None for other
        #: nodes without one (they learn it from a trusted verifier: ``directory_client``)
        self.genesis_file: GenesisFile | None = None
        #: verifiers: the consensus service and the committed directory's server
        self.consensus = None
        #: verifiers running challenge epochs (:mod:`ps_p2p.verification.service`)
        self.epochs = None
        #: a fixed distribution of challenge shapes (None: each epoch's committed mix, learned
        #: from the verifiers' MIX_REPORTs, ``verification.mix``); every verifier of a
        #: committee must use the same (tests set a cheaper one before ``run``)
        self.challenge_mix = None
        #: verifiers with the user role: the request shapes their local API sends, bucketed
        #: and published once per epoch, noised (``verification.mix.ShapeRecorder``)
        self.shape_recorder = None
        if Role.VERIFIER in self.roles and Role.USER in self.roles:
            from ps_p2p.verification.mix import ShapeRecorder

            self.shape_recorder = ShapeRecorder()
        self.committee_directory: committee_proto.CommitteeDirectoryService | None = None
        if config.genesis is not None:
            self.genesis_file = load_genesis(config.genesis)
        elif Role.VERIFIER in self.roles:
            if trusted and set(trusted) != {self.peer_id}:
                log.warning(
                    "verifier without --genesis: it runs a committee of one of its own and "
                    "does not sync with the other verifiers it was given; give every verifier "
                    "the same genesis (ps-node testnet) to run a committee")
            self.genesis_file = init_genesis(config.home_path / GENESIS_FILE, self.peer_id,
                                             now_ms=_now_ms())
        genesis = None if self.genesis_file is None else self.genesis_file.genesis
        self._client = CommitteeClient(genesis, frozenset(trusted))
        if (genesis is not None and Role.VERIFIER in self.roles
                and self.peer_id not in self._client.trusted_verifiers):
            where = config.genesis or config.home_path / GENESIS_FILE
            raise ConfigError(
                f"this verifier ({keys.identity.peer_id_str}) is not in the validator set "
                f"of genesis {where} (chain {genesis.chain_id!r}); use the key of one of its "
                "validators, or another genesis (or home)"
            )
        #: ``(organization name, Membership)`` of ``config.membership`` (issue 16), or None
        self.membership = (None if config.membership is None
                           else load_membership(config.membership, self.peer_id))
        self._membership_lapsed = False
        self.metrics = NodeMetrics(self)
        self._ran = False
        self._cancel_scope: trio.CancelScope | None = None
        self._finished = trio.Event()

    @classmethod
    def for_host(
        cls,
        host: IHost,
        config: NodeConfig,
        *,
        engine: Engine | None = None,
        onion_key: OnionKeyPair | None = None,
        rng: random.Random | None = None,
    ) -> "Node":
        """A node whose identity is ``host``'s key, to :meth:`serve` on that host.

        Args:
            host: a py-libp2p host another application built (its key must be Ed25519).
            onion_key: this node's X25519 onion key (published in its record); default a new
                one (an onion key need not outlive the process).

        Raises:
            ConfigError: the host's key is not Ed25519 (or missing), or as :class:`Node`.
        """
        identity = host_identity(host)
        keys = NodeKeys(identity, onion_key or OnionKeyPair.generate())
        return cls(config, keys, engine, rng=rng)

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus["Node"] = trio.TASK_STATUS_IGNORED) -> None:
        """Start a host of our own on ``config.listen`` and every service on it;
        ``task_status.started(self)`` once listening. Runs until cancelled or :meth:`stop`.

        Raises:
            OSError: the listen address or the metrics address cannot be bound (the message
                names it).
            RuntimeError: the node ran before (a node runs once).
        """
        await self._run(None, task_status)

    async def serve(
        self, host: IHost, *, task_status: trio.TaskStatus["Node"] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run every service of the node's roles on ``host``, which another application built,
        runs and owns (docs/embedding.md); ``task_status.started(self)`` once the handlers are
        registered. Runs until cancelled or :meth:`stop`, then removes our stream handlers and
        notifee and leaves the host running. ``config.listen`` is not used: the node's record
        lists the host's listen addresses.

        Args:
            host: a running py-libp2p host whose peer ID is this node's (see
                :meth:`for_host`).

        Raises:
            ConfigError: the host's peer ID is not this node's, it offers a security transport
                that does not authenticate peers (:func:`~ps_p2p.protocols.host.
                check_foreign_host`), or it already serves one of our protocols (a node is
                already attached) -- all before ``task_status.started``.
            OSError: the metrics address cannot be bound.
            RuntimeError: the node ran before (a node runs once).
        """
        await self._run(host, task_status)

    @property
    def protocol_ids(self) -> frozenset[str]:
        """The stream protocol IDs this node's roles serve (registered while it runs)."""
        ids: set[str] = set()
        if Role.VERIFIER in self.roles:
            from ps_p2p.protocols.blocksync import BLOCKSYNC_PROTOCOL_ID
            from ps_p2p.protocols.consensus import CONSENSUS_PROTOCOL_ID

            ids |= {str(committee_proto.COMMITTEE_DIRECTORY_PROTOCOL_ID),
                    str(CONSENSUS_PROTOCOL_ID), str(BLOCKSYNC_PROTOCOL_ID)}
        if self.roles & {Role.USER, Role.MODEL}:
            ids |= {ONION_PROTOCOL_ID, CLOVE_PROTOCOL_ID, DELIVER_PROTOCOL_ID}
        if Role.MODEL in self.roles and self.config.forwarding.active:
            ids |= {str(FORWARD_PROTOCOL_ID), str(HRTREE_SYNC_PROTOCOL_ID),
                    *map(str, GOSSIPSUB_PROTOCOLS)}
        return frozenset(ids)

    def check_host(self, host: IHost) -> None:
        """Whether :meth:`serve` can run on ``host`` (what it checks first).

        Raises:
            ConfigError: the host's peer ID is not this node's; it offers a security transport
                that does not authenticate peers (:func:`~ps_p2p.protocols.host.
                check_foreign_host`); or it already has a handler for one of
                :attr:`protocol_ids` (a node is already attached, or the application uses the
                ID).
        """
        if host.get_id().to_bytes() != self.peer_id:
            raise ConfigError(
                f"the host's peer ID {host.get_id()} is not this node's "
                f"({self.keys.identity.peer_id_str}); build the node with Node.for_host"
            )
        check_foreign_host(host)
        taken = sorted(self.protocol_ids & registered_protocols(host))
        if taken:
            raise ConfigError(
                f"the host already serves {', '.join(taken)} (is a ps_p2p node already "
                "attached to it?)"
            )

    async def stop(self) -> None:
        """Stop the node and wait until it has stopped: services cancelled, our stream
        handlers removed from the host (their open inbound streams reset), our outbound links
        closed; a host of our own (:meth:`run`) is closed, a host of another application
        (:meth:`serve`) keeps running. Returns at once for a node that never ran."""
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()
        if self._ran:
            await self._finished.wait()

    async def _run(self, host: IHost | None, task_status: trio.TaskStatus["Node"]) -> None:
        if self._ran:
            raise RuntimeError("a Node runs once; make a new one")
        self._ran = True
        try:
            if host is not None:
                self.check_host(host)
            self.metrics.bind(trio.lowlevel.current_trio_token())
            with trio.CancelScope() as self._cancel_scope:
                if self.config.metrics is not None:
                    self.metrics.serve(self.config.metrics)  # before the host: fail fast
                if host is None:
                    self._own_host = True  # Circuit Relay v2 hop, DCUtR only on our own host
                    async with open_host(self.keys.identity, [self.config.listen],
                                         inbound=self.config.connections) as own_host:
                        await self._serve(own_host, task_status)
                else:
                    await self._serve(host, task_status)
        finally:
            self.metrics.close()
            self._finished.set()

    async def _serve(self, host: IHost, task_status: trio.TaskStatus["Node"]) -> None:
        """The services of the node's roles on ``host`` (both :meth:`run` and :meth:`serve`)."""
        self.host = host
        self.listen_addrs = listen_multiaddrs(host)
        network = host.get_network()
        forwarding = Role.MODEL in self.roles and self.config.forwarding.active
        if Role.MODEL in self.roles and self.config.forwarding.enabled and not forwarding:
            log.warning("forwarding off: no [forwarding] group_key (the group's shared secret; "
                        "ps-node group-key makes one): every request is served here")
        try:
            async with AsyncExitStack() as stack:
                # GossipSub before any connection (an early pubsub stream crashes the host)
                pubsub = await stack.enter_async_context(running_pubsub(host)) \
                    if forwarding else None
                await self._serve_roles(host, pubsub, task_status)
        finally:
            if self._notifee is not None:
                _remove_notifee(network, self._notifee)

    async def _serve_roles(self, host: IHost, pubsub: Any,
                           task_status: trio.TaskStatus["Node"]) -> None:
        """The services of the node's roles (``pubsub``: running, for forwarding, or None)."""
        network = host.get_network()
        async with trio.open_nursery() as nursery:
            faults_file = self.config.testing.faults_file
            if faults_file is not None:  # TEST ONLY (ps_p2p/testing/faults.py)
                from ps_p2p.testing.faults import FaultInjector

                log.warning("!!! TEST ONLY: network faults and a clock offset from %s !!!",
                            faults_file)
                self._faults = FaultInjector()
                self._faults.install(host, nursery)
                await nursery.start(self._faults.watch, faults_file)
            self._learn_bootstrap_addrs(host)
            # on an application's host (attach) only the relay client side: no hop, AutoNAT
            # server or DCUtR protocols the application did not choose (NatSupport)
            self.nat = NatSupport(host, self.config.circuit_relay,
                                  directory=lambda: self.directory,
                                  verifiers=lambda: sorted(self.trusted_verifiers),
                                  verifier=Role.VERIFIER in self.roles,
                                  reserve=self.config.register, embedded=not self._own_host)
            await nursery.start(self.nat.run)
            if Role.VERIFIER in self.roles:
                await nursery.start(self._run_committee_member, host)
            if self.roles & {Role.USER, Role.MODEL}:
                self.overlay = OverlayService(
                    host,
                    self.keys.onion,
                    OverlayConfig(
                        relay=Role.USER in self.roles and self.config.relay,
                        tamper=self.config.tamper,
                    ),
                    directory=lambda: self.directory,
                )
                await nursery.start(self.overlay.run)
                # no relay answering a NATed node means its address changed: its setups in
                # flight are abandoned at once (the overlay also sees it from its links)
                self.nat.keeper.on_address_changed = self.overlay.address_changed
                self._notifee = _DisconnectNotifee(self.overlay.peer_disconnected)
                network.register_notifee(self._notifee)
            if Role.MODEL in self.roles:
                assert self.engine is not None and self.overlay is not None
                self.model = ModelNodeService(
                    self.keys.identity, self.engine, self.config.model_node
                )
                self.model.attach(self.overlay)
                if pubsub is not None:
                    self.forwarding = GroupForwarding(
                        self.keys.identity, self.engine, self.model.load,
                        self.config.forwarding)
                    self.forwarding.set_directory(self.directory)
                    self.model.enable_forwarding(host, self.forwarding.route,
                                                 self.forwarding.is_member,
                                                 self.forwarding.forward_done)
                    await nursery.start(self.forwarding.run, host, pubsub)
                serve_kv_events = getattr(self.engine, "serve_kv_events", None)
                if serve_kv_events is not None:  # vLLM: the server's KV-cache events
                    await nursery.start(serve_kv_events)
                await nursery.start(self.model.run)
            if Role.USER in self.roles:
                assert self.overlay is not None
                self.user = UserClient(
                    self.overlay, lambda: self.directory, self.config.user, rng=self.rng,
                    on_request_done=self.metrics.observe_request,
                    on_first_token=self.metrics.time_to_first_token.observe,
                )
                await nursery.start(self.user.run)
                nursery.start_soon(self._warm_model_links)
            if self.consensus is not None:
                await self._start_epochs(nursery)
            nursery.start_soon(self._directory_loop)
            if self.config.status_interval > 0:
                nursery.start_soon(self._status_loop, self.config.status_interval)
            if not self.listen_addrs and self._needs_inbound():
                log.warning(
                    "the host listens on no address: peers cannot dial this %s node",
                    "+".join(self.config.roles),
                )
            log.info(
                "node %s up: roles %s, listening on %s",
                self.keys.identity.peer_id_str,
                ",".join(self.config.roles),
                " ".join(self.listen_addrs) or "nothing",
            )
            task_status.started(self)

    async def _start_epochs(self, nursery: trio.Nursery) -> None:
        """Verifier: run the challenge epochs when everything they need is here; otherwise,
        if the chain runs epochs, refuse every epoch report (this validator cannot re-score
        them, so it must not vote for them)."""
        from ps_p2p.verification.service import (
            EpochService,
            load_pool,
            master_key,
            overlay_ask,
        )
        from ps_p2p import registry
        from ps_p2p.verification.sealing import load_committee_key

        assert self.consensus is not None and self.genesis_file is not None
        params = self.genesis_file.genesis.verification
        if params is None:
            return
        validator = self.consensus.validator
        vcfg = self.config.verification
        if not vcfg.pool or self.user is None or self.engine is None:
            log.warning("the chain runs challenge epochs but this verifier has no [verification]"
                        " pool, user role or reference model: it refuses every epoch report")
            validator.value_check = lambda tx: "this verifier has no reference model"
            return
        user = self.user
        ask = overlay_ask(user, params.model_id)
        pool = await trio.to_thread.run_sync(load_pool, vcfg.pool, vcfg.pool_limit or None)
        self.epochs = EpochService(
            self.keys.identity, params, state=lambda: validator.state, txs=registry,
            submit=self.consensus.submit_tx, ask=ask, engine=self.engine, pool=pool,
            master=master_key(self.keys.identity.private_bytes()),
            committee_key=load_committee_key(vcfg.committee_key),
            challenge_timeout=vcfg.challenge_timeout, unix_ms=validator.unix_ms,
            mix_source=None if self.shape_recorder is None
            else lambda: self.shape_recorder.take(random.SystemRandom()),
            **({} if self.challenge_mix is None else {"mix": self.challenge_mix}))
        validator.value_check = self.epochs.value_check
        self.epochs.on_verdict = self.consensus.revalidate
        self.epochs.rotate_paths = user.rotate_paths
        previous = self.consensus.on_commit
        epochs = self.epochs

        def on_commit(committed: Any) -> None:
            if previous is not None:
                previous(committed)
            epochs.notify()

        self.consensus.on_commit = on_commit
        await nursery.start(self.epochs.run)
        log.info("challenge epochs on: model %s, %d pooled prompts", params.model_id, len(pool))

    def _learn_bootstrap_addrs(self, host: IHost) -> None:
        """Put the bootstrap peers' addresses in the peerstore (validators dial each other by
        peer ID, and nodes fetch from any validator)."""
        store = host.get_peerstore()
        for peer, addr in self._bootstrap.items():
            if peer == self.peer_id:
                continue
            try:
                store.add_addrs(ID(peer), [multiaddr.Multiaddr(addr.rsplit("/p2p/", 1)[0])], 0)
            except Exception as exc:  # a malformed address was refused by validate()
                log.debug("bootstrap address %s not usable: %r", addr, exc)

    async def _run_committee_member(
        self, host: IHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Verifier role: the consensus service (store
        ``<home>/consensus.sqlite``) and the committed directory's server, until cancelled.

        Raises:
            ConfigError: the home cannot be created, or a protocol is already served.
            StoreError: the store cannot be opened or read, or failed while running (a
                validator must not sign from a state it does not know).
        """
        from ps_p2p.consensus.store import ConsensusStore
        from ps_p2p.protocols.consensus import ConsensusService, ConsensusServiceConfig

        assert self.genesis_file is not None
        home = self.config.home_path
        try:
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot use home directory {home}: {exc}") from exc
        from ps_p2p.registry.validator import unix_ms

        store = ConsensusStore(home / CONSENSUS_STORE_FILE)
        try:
            consensus = ConsensusService(
                host, self.keys.identity, self.genesis_file.genesis, store,
                self.genesis_file.consensus,
                ConsensusServiceConfig(empty_block_interval=self.config.block_interval,
                                       snapshot_every=self.config.snapshot_every,
                                       keep_blocks=self.config.keep_blocks,
                                       byzantine=(self.config.byzantine
                                                  or self.config.testing.byzantine)),
                unix_ms=unix_ms if self._faults is None else self._faults.unix_ms(unix_ms),
            )
            self.consensus = consensus
            self.committee_directory = committee_proto.CommitteeDirectoryService(
                lambda: consensus.validator.history, self._submit_tx,
                genesis_text=self.genesis_file.text,
            )

            async def run_consensus(*, task_status: trio.TaskStatus[None]) -> None:
                await consensus.run(task_status=task_status)
                if consensus.fatal is not None:
                    raise consensus.fatal

            async with trio.open_nursery() as nursery:
                await nursery.start(run_consensus)
                await nursery.start(self.committee_directory.serve, host)
                log.info(
                    "committee member of chain %r (%d validators, genesis %s), store %s",
                    self.genesis_file.genesis.chain_id, len(self.genesis_file.genesis.validators),
                    self.genesis_file.hash[:12], home / CONSENSUS_STORE_FILE,
                )
                task_status.started()
        finally:
            store.close()

    def _submit_tx(self, tx: Any) -> bool:
        """Verifiers: a node's own REGISTER or DEREGISTER transaction into the mempool.

        Raises:
            InvalidTransactionError, AdmissionError: refused by ``check_tx`` or a full mempool.
        """
        from ps_p2p.registry import encode_tx
        from ps_p2p.errors import InvalidTransactionError, LocalProtocolError

        assert self.consensus is not None
        try:
            raw = encode_tx(tx)
        except LocalProtocolError as exc:
            raise InvalidTransactionError(f"not a valid transaction: {exc}") from None
        return self.consensus.submit_tx(raw)

    def _submit_record(self, record: NodeRecord) -> bool:
        """Verifiers: this node's own record into the mempool (a REGISTER transaction)."""
        from ps_p2p.registry import RegisterTx

        return self._submit_tx(RegisterTx(record))

    def committee_status(self) -> dict[str, Any] | None:
        """A committee verifier's consensus at a glance (``ps-node status``), or None for
        other nodes: chain ID, height being decided and its round and step, last committed
        height and its block time (unix ms), the proposals and votes it signed since it started
        (``signed``) and the blocks it applied from block sync (``blocks_synced``), the
        validators of the current set (base58 peer ID, power, ``excluded``: committed evidence
        bars it from proposing and leading epochs, whether connected now), a committed
        validator-set update not in effect yet (``pending_validator_set``: effective height and
        set, or None), mempool size, the equivocation evidence committed (``evidence``: how
        many; ``equivocators``: base58 peer IDs of the validators it names), and the committed
        reputations (``reputations``: subjects scored; ``untrusted_subjects``: below the
        genesis threshold)."""
        if self.consensus is None:
            return None
        validator = self.consensus.validator
        state = validator.core.state()
        tip = validator.state.tip()
        excluded, pending = validator.state.excluded, validator.state.pending_valset
        return {
            "chain_id": validator.genesis.chain_id,
            "height": validator.height,
            "round": state.round,
            "step": state.step.name.lower(),
            "committed_height": validator.committed_height,
            "signed": validator.stats.proposals_signed + validator.stats.votes_signed,
            "blocks_synced": validator.stats.blocks_synced,
            "last_commit_time_ms": tip.time_ms if tip.height else None,
            "validators": [
                {"peer_id": ID(v.address).to_base58(), "power": v.power,
                 "excluded": v.address in excluded,
                 "connected": v.address == validator.address or (
                     self.host is not None and is_connected(self.host, v.address))}
                for v in validator.validators
            ],
            "pending_validator_set": None if pending is None else {
                "effective_height": pending[0],
                "validators": [{"peer_id": ID(v.address).to_base58(), "power": v.power}
                               for v in pending[1]]},
            "mempool": len(validator.mempool),
            "evidence": len(validator.state.evidence),
            "equivocators": sorted({ID(who).to_base58()
                                    for who, _ in validator.state.evidence.values()}),
            "reputations": len(validator.state.reputations),
            "untrusted_subjects": sum(
                1 for e in validator.state.reputations.values()
                if e.value < validator.genesis.reputation.untrusted_below),
            "epochs": self.epoch_status(),
        }

    #: Most model nodes whose contribution credits the status lists (most credited first).
    STATUS_CREDITS = 100

    def epoch_status(self) -> dict[str, Any] | None:
        """A verifier's challenge epochs (``ps-node status``), None when the chain runs none:
        the current epoch, whether it started and who leads its current attempt, this
        verifier's counters (``service``: None when it runs no epochs), and the committed
        contribution credits of the model nodes (``credits``: base58 peer ID -> [challenges
        answered, answered with a normal score, confirmed misses], the
        :data:`STATUS_CREDITS` most credited; paper sec. 3.4, "incentives")."""
        import dataclasses

        if self.consensus is None:
            return None
        validator = self.consensus.validator
        params = validator.genesis.verification
        if params is None:
            return None
        ledger = validator.state.ledger
        leader = None
        if ledger.started:
            attempt = ledger.attempt_at(validator.unix_ms(), params)
            leader = ID(ledger.leader(attempt)).to_base58()
        top = sorted(ledger.credits.items(), key=lambda kv: (-kv[1].passed, kv[0]))
        return {
            "epoch": ledger.epoch,
            "started": ledger.started,
            "leader": leader,
            "service": None if self.epochs is None else dataclasses.asdict(self.epochs.stats),
            "credits": {ID(n).to_base58(): [c.answered, c.passed, c.missed]
                        for n, c in top[:self.STATUS_CREDITS]},
        }

    def reputation_status(self) -> dict[str, Any] | None:
        """A model node's committed reputation (``ps-node status``), or None for other nodes:
        ``reputation`` (R in [0, 1], None when the committee never scored it or no directory
        yet), ``trusted`` (False: users no longer send to it, paper sec. 3.4) and
        ``untrusted_below`` (the genesis threshold, None before a directory), ``provisional``
        (never scored on a chain with challenge epochs: users send to it only when no trusted
        node serves the model)."""
        if Role.MODEL not in self.roles:
            return None
        d = self.directory
        if d is None:
            return {"reputation": None, "trusted": True, "untrusted_below": None,
                    "provisional": False}
        return {"reputation": d.reputation(self.peer_id), "trusted": d.trusted(self.peer_id),
                "untrusted_below": d.untrusted_below,
                "provisional": d.provisional(self.peer_id)}

    def _note_own_trust(self, directory: Directory) -> None:
        """Model nodes: log when the installed directory changes whether this node is trusted
        (a warning when it becomes untrusted, once per change)."""
        if Role.MODEL not in self.roles:
            return
        trusted = directory.trusted(self.peer_id)
        if trusted == self.trusted or (self.trusted is None and trusted):
            self.trusted = trusted
            return
        self.trusted = trusted
        reputation = directory.reputation(self.peer_id)
        if directory.provisional(self.peer_id):
            log.info("this model node is provisional at directory height %d: not scored yet; "
                     "users send to it only when no trusted node serves its model, until its "
                     "challenges score it", directory.height)
        elif not trusted:
            log.warning(
                "this model node is UNTRUSTED at directory height %d: committed reputation "
                "%.6f is below %.2f; users send it only hedged copies of a share of their "
                "requests until challenges raise it, after a conviction only once it has a "
                "clean record of challenges (probation, docs/verification.md)",
                directory.height, reputation if reputation is not None else float("nan"),
                directory.untrusted_below,
            )
        else:
            log.info("this model node is trusted again at directory height %d (reputation %s)",
                     directory.height, "not scored" if reputation is None else f"{reputation:.3f}")

    def _committed_directory(self) -> Directory | None:
        """Committee verifiers: the directory this verifier serves (its own committed state
        at H - 1, covered by block H's commit), or None before the first block."""
        assert self.consensus is not None and self._client.replica is not None
        history = self.consensus.validator.history
        served, header = history.served, history.header
        if served is None or header is None:
            return None
        old = self.directory
        if old is not None and old.height == served.height:
            return old
        params = served.genesis.reputation
        return Directory(served.height, header.time_ms,
                         header.time_ms + self._client.replica.max_age_ms,
                         served.records.records(),
                         {subject: e.value for subject, e in served.reputations.items()},
                         params.untrusted_below, params.initial,
                         served.genesis.verification is not None)

    def _needs_inbound(self) -> bool:
        """Whether other nodes must be able to dial this one (verifier, model node, relay)."""
        relays = Role.USER in self.roles and self.config.relay
        return relays or bool(self.roles & {Role.VERIFIER, Role.MODEL})

    async def _status_loop(self, interval: float) -> None:
        """Log :func:`~ps_p2p.metrics.status_message` every ``interval`` seconds (INFO)."""
        while True:
            await trio.sleep(interval)
            try:
                log.info("%s", status_message(self))
            except Exception:  # a status line must never stop the node
                log.exception("status line failed")

    async def unreachable_verifiers(self, timeout: float = 5.0) -> dict[str, str]:
        """Dial every ``--multiaddr`` (bootstrap) verifier at once, for a command that must say
        at once when none can be reached (``ps-node ask``) instead of waiting for a directory.

        Args:
            timeout: seconds allowed for each dial (they run in parallel).

        Returns:
            bootstrap multiaddr -> why it could not be reached (e.g. ``"connection refused"``,
            :func:`~ps_p2p.protocols.host.dial_failure_reason`), for each one that could not;
            empty when every one was reached.
        """
        from ps_p2p.protocols.host import connect, dial_failure_reason

        assert self.host is not None, "run() the node first"
        failures: dict[str, str] = {}

        async def dial(addr: str) -> None:
            try:
                await connect(self.host, addr, timeout=timeout)
            except (Exception, trio.TooSlowError) as exc:
                failures[addr] = dial_failure_reason(exc)

        async with trio.open_nursery() as nursery:
            for addr in self._bootstrap.values():
                nursery.start_soon(dial, addr)
        return failures

    async def wait_directory(self, min_users: int = 0, min_models: int = 0, timeout: float = 30.0) -> Directory:
        """Wait for a verified directory with at least the given numbers of users and model nodes.

        Raises:
            trio.TooSlowError: not within ``timeout`` seconds.
        """
        with trio.fail_after(timeout):
            while True:
                d = self.directory
                if d is not None and len(d.users()) >= min_users and len(d.model_nodes()) >= min_models:
                    return d
                await self._directory_ready.wait()

    async def wait_directory_update(self) -> None:
        """Wait until the next verified directory is installed (refreshes happen every
        ``directory_refresh`` seconds, faster while the network changes)."""
        await self._directory_ready.wait()

    # ------------------------------------------------------------------ directory client

    async def drain(self, grace: float | None = None) -> DrainReport | None:
        """Stop this node gently (SIGTERM): a model node stops taking new requests (answered
        OVERLOADED), withdraws its record from the verifiers (:meth:`withdraw`), waits up to
        ``grace`` seconds (default ``config.drain_timeout``) for the requests in service and
        sends their answers (at most 5 s more). The caller then cancels :meth:`run`.

        Returns:
            the model role's :class:`~ps_p2p.serving.drain.DrainReport`; None without it.
        """
        if self.model is None:
            return None
        grace = self.config.drain_timeout if grace is None else grace
        self.model.dispatcher.draining = True
        await self.withdraw()
        report = await self.model.drain(grace)
        if self.overlay is not None:
            with trio.move_on_after(DRAIN_FLUSH_TIMEOUT):
                await self.overlay.flush()
        return report

    async def withdraw(self, timeout: float = 5.0) -> int:
        """Deregister: stop renewing this node's record and give every trusted verifier a
        DEREGISTER transaction signed by this node, so the committee drops the record at its
        next block (about a second) and users' next directory refresh no longer lists it. A
        verifier that refuses it (e.g. the record is not committed yet) gets instead the same
        record valid for :data:`WITHDRAW_LIFETIME_MS` only, which drops the node within that
        time.

        Args:
            timeout: seconds for each verifier's exchange (they run in parallel).

        Returns:
            verifiers that took the deregistration (or the short-lived record).
        """
        from ps_p2p.registry import sign_deregister

        self._withdrawn = True
        if self.host is None:
            return 0
        if self.consensus is not None:
            assert self.genesis_file is not None
            tx = sign_deregister(self.keys.identity, self.genesis_file.genesis.chain_id,
                                 _now_ms())
            try:
                self._submit_tx(tx)
            except PsError as exc:
                log.info("own mempool refused the deregistration (%s); short-lived record", exc)
                try:
                    self._submit_record(self.own_record(_now_ms(),
                                                        lifetime_ms=WITHDRAW_LIFETIME_MS))
                except PsError as exc:
                    log.info("own mempool refused the withdrawal: %s", exc)
        taken = 0

        async def one(verifier: bytes) -> None:
            nonlocal taken
            label = ID(verifier).to_base58()[-8:]
            try:
                try:
                    await self._client.deregister(self.host, verifier, self.keys.identity,
                                                  timeout)
                except PsError as exc:
                    log.info("deregistration refused by %s (%s); short-lived record", label, exc)
                    record = self.own_record(_now_ms(), lifetime_ms=WITHDRAW_LIFETIME_MS)
                    await self._client.register(self.host, verifier, record, timeout)
                taken += 1
            except _REMOTE_FAILURES as exc:
                log.info("withdrawal from %s failed: %s", label, exc)

        async with trio.open_nursery() as nursery:
            for verifier in self._verifier_targets():
                nursery.start_soon(one, verifier)
        log.info("record withdrawn from %d verifier(s)", taken)
        return taken

    def own_record(self, now_ms: int, *, lifetime_ms: int | None = None) -> NodeRecord:
        """This node's signed record, valid ``record_lifetime`` seconds (or ``lifetime_ms``)
        from ``now_ms``.

        Lists the first :data:`~ps_p2p.records.MAX_ADDRS` listen addresses that fit a record
        (binary form of at most :data:`~ps_p2p.records.MAX_ADDR_BYTES` bytes). With a
        membership certificate (``config.membership``) it names the organization and expires
        no later than the certificate; once the certificate has expired the record names no
        organization (logged once: the node is then a subject of its own).
        """
        cfg = self.config
        # each record issued later than the last (a renewal must be newer than the listed one)
        now_ms = self._last_issued_ms = max(now_ms, self._last_issued_ms + 1)
        addrs: list[bytes] = []
        texts = self.listen_addrs if self.nat is None else self.nat.advertised(self.listen_addrs)
        own = f"/p2p/{self.keys.identity.peer_id_str}"
        for text in texts:
            try:  # without our own /p2p/ (a circuit address keeps its relay's)
                addr = records.multiaddr_bytes(text.removesuffix(own))
            except PsError:
                continue
            if len(addr) <= records.MAX_ADDR_BYTES and len(addrs) < records.MAX_ADDRS:
                addrs.append(addr)
        if len(addrs) < len(self.listen_addrs):
            log.debug(
                "own record lists %d of %d listen addresses", len(addrs), len(self.listen_addrs)
            )
        expires_ms = now_ms + (
            int(cfg.record_lifetime * 1000) if lifetime_ms is None else lifetime_ms)
        organization, membership = "", None
        if self.membership is not None:
            if now_ms < self.membership[1].expires_at_ms:
                organization, membership = self.membership
                expires_ms = min(expires_ms, membership.expires_at_ms)
            elif not self._membership_lapsed:
                self._membership_lapsed = True
                log.error("the membership certificate %s of organization %r expired; this "
                          "node's record names no organization until it gets a new one "
                          "(ps-node org sign)", cfg.membership, self.membership[0])
        record = NodeRecord(
            peer_id=self.peer_id,
            addrs=tuple(addrs),
            roles=self.roles,
            onion_key=self.keys.onion.public,
            model_id=self.engine.model_id if (self.engine is not None and Role.MODEL in self.roles) else "",
            organization=organization,
            capacity=cfg.model_node.capacity if Role.MODEL in self.roles else 0,
            issued_at_ms=now_ms,
            expires_at_ms=expires_ms,
            membership=membership,
        )
        return records.sign_record(self.keys.identity, record)

    @property
    def trusted_verifiers(self) -> frozenset[bytes]:
        """The verifiers this node registers with and fetches from: the genesis validators,
        or the configured verifiers until a genesis is learnt from one of them."""
        return self._client.trusted_verifiers

    def _verifier_targets(self) -> list[bytes]:
        """The verifiers to try, in random order, those that failed in the last
        :data:`VERIFIER_SUSPECT_SECONDS` last (a dead verifier costs a failed dial per round
        only once the others failed too)."""
        targets = [v for v in self.trusted_verifiers if v != self.peer_id]
        self.rng.shuffle(targets)
        now = trio.current_time()
        targets.sort(key=lambda v: self._verifier_failed.get(v, -math.inf) > now)
        return targets

    def _verifier_answered(self, verifier: bytes, ok: bool) -> None:
        if ok:
            self._verifier_failed.pop(verifier, None)
        else:  # keys: trusted verifiers only (bounded by the configuration)
            self._verifier_failed[verifier] = trio.current_time() + VERIFIER_SUSPECT_SECONDS

    async def _directory_loop(self) -> None:
        assert self.host is not None
        self._quiet_refreshes = 0
        next_register = 0.0
        register_failures = 0
        refresh_failures = 0
        while True:
            now = trio.current_time()
            # a host of another application may listen on more (or other) addresses by now
            self.listen_addrs = listen_multiaddrs(self.host)
            if self._withdrawn:
                next_register = math.inf  # deregistered: the record is left to expire
            targets = self._verifier_targets()
            if self.consensus is not None and now >= next_register:
                try:  # a committee member lists itself through its own mempool
                    self._submit_record(self.own_record(_now_ms()))
                    next_register = now + self.config.register_interval
                    targets = []
                except PsError as exc:
                    log.info("own mempool refused this verifier's record: %s", exc)
            if self.nat is not None and self.nat.take_changed():
                next_register = min(next_register, now)  # new circuit addresses: tell them
            if (now >= next_register and self.config.register
                    and (self.nat is None or self.nat.may_register())):
                ok = 0
                for verifier in targets:
                    ok += await self._register_with(verifier)
                    if ok >= self._client.registrations_needed:
                        break
                if ok or not targets:
                    next_register = now + self.config.register_interval
                    register_failures = 0
                else:
                    # no verifier took the record (unreachable, or not a verifier at all): back
                    # off with jitter instead of dialling it a few times a second
                    register_failures += 1
                    wait = min(REGISTER_BACKOFF_MAX, 2.0 ** (register_failures - 1))
                    next_register = now + wait * (0.5 + self.rng.random())
            delay = self._refresh_delay()
            if await self._refresh_directory(targets):
                refresh_failures = 0
            else:  # no verifier answered: back off, and after a few rounds ask which chain
                refresh_failures += 1
                if refresh_failures == CHAIN_CHECK_AFTER:
                    await self._check_chain()
                cap = REGISTER_BACKOFF_MAX if self._wrong_chain else REFRESH_BACKOFF_MAX
                wait = min(cap, 0.5 * 2.0 ** (refresh_failures - 1))
                delay = max(delay, wait * (0.5 + self.rng.random()))
            await trio.sleep(delay)

    async def _check_chain(self) -> None:
        """No verifier of this node's ``--genesis`` chain answered: ask each bootstrap peer
        outside its validators for the genesis it serves, and when one serves another chain say
        so once, at WARNING, naming both chains (the node then retries every 30 s at most)."""
        assert self.host is not None
        ours = self.genesis_file
        if ours is None or self.config.genesis is None:
            return
        for peer, addr in self._bootstrap.items():
            if peer in self.trusted_verifiers:
                continue
            try:
                with trio.fail_after(5):
                    await connect(self.host, addr)
                    text = await committee_proto.fetch_genesis(self.host, peer, timeout=5.0)
                theirs = parse_genesis_text(text, source=f"genesis of {addr}")
            except (Exception, trio.TooSlowError) as exc:
                log.debug("cannot ask %s for its genesis: %s", addr, exc)
                continue
            if theirs.genesis == ours.genesis:
                continue
            self._wrong_chain = True
            log.warning(
                "wrong chain: this node's genesis %s is chain %r (sha256 %s, %d validators), "
                "but the bootstrap verifier %s serves chain %r (sha256 %s), and no validator "
                "of %r answered; give the genesis file of the chain you join, or bootstrap "
                "from a validator of %r (retrying every 30 s)",
                self.config.genesis, ours.genesis.chain_id, genesis_hash(ours.text)[:16],
                len(ours.genesis.validators), addr, theirs.genesis.chain_id,
                genesis_hash(theirs.text)[:16], ours.genesis.chain_id, ours.genesis.chain_id)
            return

    def _refresh_delay(self) -> float:
        d = self.directory
        head_ttl = None if d is None else (d.expires_at_ms - _now_ms()) / 1000
        return directory_refresh_delay(
            configured=self.config.directory_refresh,
            quiet_refreshes=self._quiet_refreshes,
            has_peers=d is not None and len(d.records) > 1,
            head_ttl=head_ttl,
        )

    async def _warm_model_links(self) -> None:
        """User role: once this node holds its n paths, dial up to :data:`WARM_MODEL_LINKS`
        model nodes of the directory (at random, one at a time, those not connected yet), so
        the first clove it delivers as another user's proxy does not wait for a connection
        (TCP, Noise, Yamux and identify: several round trips), and open its delivery link to
        each (:meth:`OverlayService.warm_delivery_link`; the model node then opens its reply
        link back), so that it does not wait for two stream opens either. In a 100-user
        devnet on 2 loaded cores every user's first request took 450 ms (median) against 72 ms
        for later ones, the proxies' first deliveries dialling the model node. Once per node
        run."""
        assert self.host is not None and self.user is not None
        while True:
            try:
                await self.user.wait_ready(timeout=60.0)
                break
            except PsError:
                continue
        while self.directory is None or not self.directory.model_nodes():
            await self.wait_directory_update()
        models = [r.peer_id for r in self.directory.model_nodes()]
        network = self.host.get_network()
        for peer in self.rng.sample(models, min(WARM_MODEL_LINKS, len(models))):
            if not network.get_connections(ID(peer)):
                with trio.move_on_after(10.0):
                    try:
                        await network.dial_peer(ID(peer))
                    except Exception as exc:  # a cold link is only slower: the proxy dials later
                        log.debug("warming the link to model node %s: %s",
                                  ID(peer).to_base58()[-8:], exc)
                        continue
            # the delivery stream too (the model node opens its reply stream back when it
            # arrives): a first clove otherwise waits for two stream opens
            if network.get_connections(ID(peer)) and self.overlay is not None:
                self.overlay.warm_delivery_link(peer)

    async def _ensure_connected(self, peer: bytes) -> bool:
        assert self.host is not None
        if self.host.get_network().get_connections(ID(peer)):
            return True
        addr = self._bootstrap.get(peer)
        # this loop paces its own retries (back-off, suspects): a verifier that was not up a
        # moment ago must not stay blocked by py-libp2p's negative dial cache
        forget_dial_failures(self.host.get_network(), ID(peer))
        try:
            if addr is not None:
                with trio.fail_after(5):
                    await connect(self.host, addr)
                return True
        except (Exception, trio.TooSlowError) as exc:
            self._log_verifier_failure("cannot reach verifier %s: %s", peer, exc)
            return False
        return True  # known from the directory; new_stream dials it

    async def _register_with(self, verifier: bytes) -> int:
        assert self.host is not None
        if not await self._ensure_connected(verifier):
            self._verifier_answered(verifier, False)
            return 0
        try:
            await self._client.register(self.host, verifier, self.own_record(_now_ms()), 5.0)
        except _REMOTE_FAILURES as exc:
            self._log_verifier_failure("registration with %s failed: %s", verifier, exc)
            self._verifier_answered(verifier, False)
            return 0
        self._verifier_answered(verifier, True)
        return 1

    async def _refresh_directory(self, targets: list[bytes]) -> bool:
        """One directory round; False when no verifier answered (a committee member: True)."""
        assert self.host is not None
        if self.consensus is not None:  # a committee member serves its own committed state
            committed = self._committed_directory()
            if committed is not None:
                self._install(committed)
            return True
        source = self._client.preferred()
        suspect = self._verifier_failed.get(source or b"", -math.inf) > trio.current_time()
        if source in targets and not suspect:  # whose heights we hold: a delta, not everything
            targets = [source] + [v for v in targets if v != source]
        for verifier in targets:
            if not await self._ensure_connected(verifier):
                self._verifier_answered(verifier, False)
                continue
            try:
                directory, changed = await self._client.fetch(self.host, verifier, 5.0)
            except _REMOTE_FAILURES as exc:
                self._log_verifier_failure("directory from %s refused: %s", verifier, exc)
                self._verifier_answered(verifier, False)
                continue
            self._verifier_answered(verifier, True)
            self._install(directory, changed)
            return True
        return False

    def _log_verifier_failure(self, message: str, verifier: bytes, exc: BaseException) -> None:
        """INFO for a verifier's first failure since it last answered, DEBUG for the next ones
        (a verifier that stays away would otherwise log every round)."""
        level = logging.DEBUG if verifier in self._verifier_failed else logging.INFO
        log.log(level, message, ID(verifier).to_base58()[-8:], exc)

    def _install(self, directory: Directory, changed: tuple[NodeRecord, ...] | None = None) -> None:
        """Adopt a verified directory; the addresses of ``changed`` records (None: of every
        record, unless the record list is the one already held) replace the peers' addresses
        in the peerstore (:func:`~ps_p2p.protocols.addresses.replace_peer_addrs`)."""
        assert self.host is not None
        old = self.directory
        if old is not None and directory.height < old.height and directory.issued_at_ms <= old.issued_at_ms:
            return
        self.directory = directory
        self._note_own_trust(directory)
        if self.forwarding is not None:
            self.forwarding.set_directory(directory)
        if changed is None:
            unchanged = old is not None and directory.records is old.records
            changed = () if unchanged else directory.records
        for record in changed:
            if record.peer_id == self.peer_id:
                continue
            # the latest committed record's addresses replace the ones held (a node restarted
            # on another port or IP is dialled there at once); unchanged ones are left alone, so
            # what identify learnt since is not overwritten by an older copy of the same record
            if self._record_addrs.get(record.peer_id) != record.addrs:
                replace_peer_addrs(self.host, record.peer_id, record.addrs)
                note_record_circuits(self.host, record.peer_id, record.addrs)
                if record.peer_id in self._record_addrs and self.overlay is not None:
                    self.overlay.peer_moved(record.peer_id)  # old addresses' failures go
                self._record_addrs[record.peer_id] = record.addrs
        if len(self._record_addrs) > 2 * len(directory.records) + 64:  # departed nodes
            listed = {r.peer_id for r in directory.records}
            self._record_addrs = {p: a for p, a in self._record_addrs.items() if p in listed}
            forget_record_circuits(self.host, listed)
        if self.overlay is not None:
            self.overlay.directory_changed()  # reply links to users listed only now
        if directory_news(old, directory, changed):
            self._directory_changed_at = trio.current_time()
            self._quiet_refreshes = 0
        else:
            self._quiet_refreshes += 1
        if old is None or len(old.records) != len(directory.records):
            log.info(
                "directory height %d: %d users, %d model nodes",
                directory.height, len(directory.users()), len(directory.model_nodes()),
            )
        self._directory_ready.set()
        self._directory_ready = trio.Event()


@asynccontextmanager
async def attach(
    host: IHost,
    config: NodeConfig,
    *,
    engine: Engine | None = None,
    onion_key: OnionKeyPair | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[Node]:
    """Run the services of ``config.roles`` on ``host``, a py-libp2p host that another
    application built, runs and owns, for the duration of the block (docs/embedding.md).

    The node's identity (peer ID, record and response signatures) is the host's Ed25519 key;
    its background tasks run in a nursery of this block. Leaving the block (normally, by an
    exception or by cancellation) removes our stream handlers and notifee, resets the inbound
    streams they served and closes our outbound ones; the host keeps running with the
    application's protocols. For the caller's own nursery instead:
    ``node = await nursery.start(Node.for_host(host, config).serve, host)`` and
    ``await node.stop()``.

    Args:
        host: a running py-libp2p host (inside its ``host.run(...)``) with an Ed25519 key, offering
            only authenticating security transports (Noise, TLS), ideally listening on an address
            other nodes can dial (relays, model nodes and verifiers must be dialable).
        config: the node's settings; ``listen`` is not used (the host's addresses are).
        engine: the inference engine; required with the model role.
        onion_key: X25519 onion key; default a new one.
        rng: randomness for relay/verifier/model choice (seed it in tests).

    Yields:
        the running :class:`Node` (``node.user``, ``node.model``, ``node.directory``...).

    Raises:
        ConfigError: a key that is not Ed25519, an unauthenticated security transport, a
            protocol of ours the host already serves, or a bad config (before the block runs).
        OSError: ``config.metrics`` cannot be bound.
    """
    node = Node.for_host(host, config, engine=engine, onion_key=onion_key, rng=rng)
    node.check_host(host)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve, host)
            try:
                yield node
            finally:
                await node.stop()
    except BaseExceptionGroup as group:
        # one exception (the block's, or the node's start failure): raise it as it is, as if
        # no nursery stood between the block and the caller
        if len(group.exceptions) != 1:
            raise
        raise group.exceptions[0] from None
