"""Node configuration: defaults, a TOML file, then command-line overrides.

Times are in seconds, sizes in bytes. A TOML file holds the same keys as :class:`NodeConfig`
(``[user]``, ``[model_node]`` and ``[sim]`` tables for the nested settings), e.g.::

    roles = ["user"]
    listen = "/ip4/0.0.0.0/tcp/4001"
    bootstrap = ["/ip4/10.0.0.5/tcp/4001/p2p/12D3KooW..."]
    name = "relay1"                    # home: <user data dir>/ps_p2p/relay1 (keys, status)

    [user]
    total = 4
    threshold = 3
    rotate_period = 900

Unknown keys are an error (a typo should not silently fall back to a default).
"""

from __future__ import annotations

import hashlib
import dataclasses
import functools
import math
import pathlib
import tomllib
from dataclasses import dataclass, field
from typing import Any

import multiaddr

from ps_p2p.crypto import onion, sida
from ps_p2p.engines.sim_cost import SimParams
from ps_p2p.errors import ConfigError, PsError
from ps_p2p.overlay.circuit_limits import CircuitRelayConfig
from ps_p2p.overlay.path_pool import PoolConfig
from ps_p2p.overlay.requests import RequestConfig
from ps_p2p.protocols.admission import InboundLimits
from ps_p2p.serving.dispatch import DispatchConfig


@dataclass
class ModelNodeConfig(DispatchConfig):
    """Model node settings: :class:`~ps_p2p.serving.dispatch.DispatchConfig` plus
    ``default_max_tokens`` (used when a request asks for 0 tokens) and ``stream_interval``
    (seconds: a streamed answer's text is sent as one segment per this interval at most, the
    first piece at once; docs/streaming.md)."""

    default_max_tokens: int = 128
    stream_interval: float = 0.05


_GROUP_KEY_PERSON = b"ps-hrtree-gkey-1"  # BLAKE2b personalization (16 bytes)


def new_group_key() -> str:
    """A fresh group secret for ``[forwarding] group_key``: 32 random bytes, hex (what
    ``ps-node group-key`` prints and the devnet, localnet and testnet hand their model nodes)."""
    import secrets

    return secrets.token_hex(32)


def group_key_toml(key: str) -> str:
    """``key`` as a ``[forwarding]`` table for a model node's config file."""
    return ("# for the config of every model node of one group (and nobody else)\n"
            f"[forwarding]\ngroup_key = \"{key}\"\n")


@dataclass
class ForwardingConfig:
    """Forwarding settings of a model node (``[forwarding]`` in the config file); seconds.

    Attributes:
        enabled: route requests within the model group (off: serve every request here).
        group_key: the model group's secret, hex (16-64 bytes), the same on every model node
            of the group and known to nobody else (its operators share it; ``ps-node
            group-key`` makes one); the HR-tree key of a model is derived from it
            (:meth:`key_bytes`). "" (the default): forwarding stays off (:attr:`active`), since
            a key anyone can derive would let every observer of the gossip test guessed
            prompts against the group's chunk hashes (issue 16).
        chunk_lengths, chunk_default, chunk_version: the group's L (Appendix A3; the Sentry's
            output, ``ps_p2p.gossip.sentry``): the first chunks' lengths in tokens, the length
            of every later chunk, and L's version (all nodes of a group must agree).
        tau_c: chunks a node must hold of a prompt for its match to count (Algorithm 2's
            threshold; a match then weighs the prefill it saves, ``ps_p2p.gossip.forwarding``).
        prefill_tokens_per_s: the engine's prefill throughput estimate (tokens/s): converts
            matched tokens into seconds saved, weighed against queueing delay (issue 19).
        hop_seconds: what a forward costs (seconds); a smaller gain is served here.
        busy_weight: weight of a node's occupancy, in prefills of the prompt per full batch
            (``ps_p2p.gossip.forwarding``: 1 lets an idle node take a request a busier holder
            would save less than its extra occupancy on, so hot prefixes replicate).
        cache_blocks: the engine's KV-cache blocks, sizing each peer's HR-tree share
            (``ps_p2p.gossip.router.tree_limits``); 0: the engine's own count when it has one,
            else 32,768.
        load_interval: seconds between load reports (about 1 s: stale load is the enemy).
        delta_interval: seconds between subtree deltas (the paper syncs every 5 s).
        load_max_age: a peer's load report older than this is unknown (not idle).
        load_heartbeat: a node checks its load every ``load_interval`` but publishes a report
            only when it changed meaningfully (``load_deadband``) or this many seconds passed
            since its last one (``ps_p2p.gossip.load.LoadReporter``); in
            [``load_interval``, ``load_max_age``).
        load_deadband: change of running requests, as a fraction of the capacity, that makes a
            report due before the heartbeat (a change of waiting requests or of capacity, a
            forwarded request taken in, or a latency change of more than 1/8 always does), in
            [0, 1]; 0 (the default): every change (1/8 cost 1-1.5% of mean latency at 1.1 of
            saturation on toolbench for 3.5% fewer reports, issue 19).
        max_peers: group members connected and followed at most.
    """

    enabled: bool = True
    group_key: str = ""
    chunk_lengths: list[int] = field(default_factory=list)
    chunk_default: int = 16
    chunk_version: int = 0
    tau_c: int = 1
    prefill_tokens_per_s: float = 4000.0
    hop_seconds: float = 0.05
    busy_weight: float = 1.0
    cache_blocks: int = 0
    load_interval: float = 1.0
    delta_interval: float = 2.0
    load_max_age: float = 3.0
    load_heartbeat: float = 2.0
    load_deadband: float = 0.0
    max_peers: int = 64

    @property
    def active(self) -> bool:
        """Whether a model node forwards and gossips: ``enabled`` and a ``group_key`` given."""
        return self.enabled and bool(self.group_key)

    def validate(self) -> None:
        """Raise ConfigError on a bad key, chunk lengths or interval (no key is allowed:
        forwarding then stays off, :attr:`active`)."""
        if self.group_key:
            self.key_bytes("")
        self.lengths()
        for name in ("load_interval", "delta_interval", "load_max_age", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"forwarding.{name} must be > 0, not {value!r}")
        if not (isinstance(self.load_heartbeat, (int, float))
                and self.load_interval <= self.load_heartbeat < self.load_max_age):
            raise ConfigError("forwarding.load_heartbeat must be in [load_interval, "
                              f"load_max_age), not {self.load_heartbeat!r}")
        if not (isinstance(self.load_deadband, (int, float)) and 0 <= self.load_deadband <= 1):
            raise ConfigError(f"forwarding.load_deadband must be in [0, 1], not "
                              f"{self.load_deadband!r}")
        for name in ("hop_seconds", "busy_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ConfigError(f"forwarding.{name} must be >= 0, not {value!r}")
        if self.tau_c < 1 or self.max_peers < 1 or self.cache_blocks < 0:
            raise ConfigError("forwarding.tau_c and forwarding.max_peers must be >= 1, "
                              "forwarding.cache_blocks >= 0")

    def key_bytes(self, model_id: str) -> bytes:
        """The HR-tree key of ``model_id``'s group: 32 bytes, BLAKE2b-256 keyed with the
        ``group_key`` secret (personalization ``ps-hrtree-gkey-1``) over the model ID's UTF-8
        bytes, so one secret may serve the groups of several models with unrelated keys.

        Raises:
            ConfigError: no ``group_key``, or it is not hex of 16-64 bytes.
        """
        from ps_p2p.gossip import hr_tree

        if not self.group_key:
            raise ConfigError("forwarding needs [forwarding] group_key, the group's shared "
                              "secret (ps-node group-key makes one)")
        try:
            key = bytes.fromhex(self.group_key)
        except ValueError:
            raise ConfigError("forwarding.group_key must be hex") from None
        if not hr_tree.MIN_KEY_BYTES <= len(key) <= hr_tree.MAX_KEY_BYTES:
            raise ConfigError(f"forwarding.group_key must be {hr_tree.MIN_KEY_BYTES}-"
                              f"{hr_tree.MAX_KEY_BYTES} bytes")
        return hashlib.blake2b(model_id.encode(), key=key, person=_GROUP_KEY_PERSON,
                               digest_size=32).digest()

    def lengths(self):  # type: ignore[no-untyped-def]
        """The group's L (:class:`~ps_p2p.gossip.sentry.ChunkLengths`). Raises ConfigError on
        values out of range."""
        from ps_p2p.gossip.sentry import ChunkLengths

        try:
            return ChunkLengths(self.chunk_version, tuple(self.chunk_lengths), self.chunk_default)
        except PsError as exc:
            raise ConfigError(f"forwarding chunk lengths: {exc}") from None


@dataclass
class UserConfig:
    """User node settings; times in seconds.

    Attributes:
        total: n, cloves per message (and reply proxies per request).
        threshold: k, cloves needed to decode.
        paths: N >= n paths kept (spares included).
        hops: relays per path (l).
        rotate_period: paths older than this are replaced (default 15 min).
        probe_interval, probe_timeout: liveness probes through each path (every 10 s on an
            idle path by default).
        request_timeout: deadline of one request, all attempts included.
        attempt_timeout: a request with no answer this long, plus ``max_tokens`` times the
            time per token (below), is sent again on fresh paths; the wait doubles with every
            attempt. Resending is cheap for the model node, which joins a repeated request to
            the one in service instead of running inference again.
        token_time: seconds allowed per requested token before the first answer is measured;
            afterwards twice the measured time per token (EWMA, 1/8) when that is longer, so a
            36 s answer is not resent while it is being generated.
        probe_timeout: the floor of a path's probe deadline; the deadline itself is the RFC
            6298 retransmission timeout of that path's measured probe round trips (it grows when
            the machine or the network is loaded). A first unanswered probe only suspends the
            path (docs/network.md, "Frozen hosts"), so the 1 s floor costs no working path.
        max_setups: path setups in flight at most (more are built as these finish).
        probe_attempts: unanswered probes in a row, each waiting twice as long as the one
            before, that replace a path.
        probation_share: probability in [0, 1] that a request is also sent, as a hedge, to a
            model node on probation (untrusted, or provisional beside proven nodes) of the same
            model; the user gets the trusted node's answer, the hedge's is dropped (issue 18,
            docs/verification.md "Probation traffic"). 0 turns hedging off.
        probation_in_flight: hedges in flight at most; a hedge beyond it is skipped.
    """

    total: int = sida.DEFAULT_TOTAL
    threshold: int = sida.DEFAULT_THRESHOLD
    paths: int = sida.DEFAULT_TOTAL + 1
    hops: int = 3
    rotate_period: float = 15 * 60.0
    probe_interval: float = 10.0
    probe_timeout: float = 1.0
    probe_attempts: int = 2
    request_timeout: float = 120.0
    attempt_timeout: float = 8.0
    token_time: float = 0.05
    failed_relay_cooldown: float = 30.0
    max_setups: int = 2
    probation_share: float = 0.05
    probation_in_flight: int = 4

    def __post_init__(self) -> None:
        if not (math.isfinite(self.probation_share) and 0.0 <= self.probation_share <= 1.0):
            raise ValueError("probation_share must be in [0, 1]")
        if self.probation_in_flight < 0:
            raise ValueError("probation_in_flight must be >= 0")
        if not 2 <= self.threshold <= self.total <= sida.MAX_TOTAL:
            # k = 1 would let every proxy read the prompt
            raise ValueError("need 2 <= threshold <= total <= %d" % sida.MAX_TOTAL)
        if self.paths < self.total:
            raise ValueError("paths (N) must be >= total (n)")
        if not 1 <= self.hops <= onion.MAX_HOPS:
            raise ValueError(f"hops must be in 1..{onion.MAX_HOPS}")

    def pool_config(self) -> PoolConfig:
        """The path pool core's settings."""
        return PoolConfig(
            total=self.total,
            paths=self.paths,
            hops=self.hops,
            rotate_period=self.rotate_period,
            retire_grace=self.request_timeout,
            probe_interval=self.probe_interval,
            probe_timeout=self.probe_timeout,
            probe_attempts=self.probe_attempts,
            failed_relay_cooldown=self.failed_relay_cooldown,
            max_setups=self.max_setups,
        )

    def request_config(self) -> RequestConfig:
        """The request core's settings."""
        return RequestConfig(
            total=self.total,
            threshold=self.threshold,
            attempt_timeout=self.attempt_timeout,
            token_time=self.token_time,
        )


ROLES = ("user", "model", "verifier")
ENGINES = ("transformers", "vllm", "sim")
SECONDS = 1.0
MINUTES = 60 * SECONDS


#: Keys of earlier versions, with what replaced them.
_REMOVED = {
    "quorum": "every directory is committed by a committee; its genesis sets the quorum (2f+1)",
    "directory_lifetime": "a directory's age is its commit's block time",
    "organization": "an organization is its organization key: set membership = PATH to the "
                    "certificate it signed for this node (ps-node org sign; docs/organizations.md)",
    "forwarding.overload_threshold": "a node is passed over when it costs more than another "
                    "(queueing, prefill left and a hop in seconds; issue 19): set "
                    "prefill_tokens_per_s, hop_seconds or busy_weight instead (docs/forwarding.md)",
}


@dataclass
class VerificationConfig:
    """A committee verifier's challenge epochs (``[verification]``; paper sec. 3.4).

    They run when the genesis has a ``verification`` section, ``pool`` is set, the node also
    has the user role (challenges travel through the overlay like any user's request) and
    ``--model`` names the committee's model (the verifier's reference copy,
    :mod:`ps_p2p.verification.service`).

    Attributes:
        pool: prompt files (:func:`ps_p2p.prompts.load_prompts` shapes), read in order; the
            prompts' digest must be the genesis' ``pool_sha256``.
        pool_limit: keep only the first this many prompts (0: all).
        challenge_timeout: seconds one challenge may take.
        committee_key: the committee key that seals the challenges' requests in reports
            (:mod:`ps_p2p.verification.sealing`): 64 hex digits, or the path of a file holding
            them (``ps-node testnet`` writes ``committee.key`` into each verifier's home); its
            commitment must be the genesis' ``committee_key_sha256``. Secret: a model node
            holding it reads every past challenge's request.
    """

    pool: list[str] = field(default_factory=list)
    pool_limit: int = 0
    challenge_timeout: float = 60.0
    committee_key: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.pool_limit, int) or self.pool_limit < 0:
            raise ValueError("pool_limit must be an integer >= 0")
        if not (isinstance(self.challenge_timeout, (int, float)) and self.challenge_timeout > 0):
            raise ValueError("challenge_timeout must be > 0 seconds")


@dataclass
class TestingConfig:
    """TEST ONLY (``[testing]``; no command-line flag, never set by users): faults a test
    injects into a real ``ps-node run`` process; the node logs a warning when one is on.

    Attributes:
        byzantine: a committee verifier that equivocates (as ``NodeConfig.byzantine``; this
            table makes it reachable from a config file, e.g. a process testnet's).
        faults_file: a JSON control file of network faults (per-peer delay, partition) and a
            wall-clock offset for the verifier, re-read when it changes
            (:mod:`ps_p2p.testing.faults`); None: none.
    """

    byzantine: bool = False
    faults_file: str | None = None


@dataclass
class NodeConfig:
    """Everything one ``ps-node run`` needs.

    Attributes:
        roles: any of "user", "model", "verifier".
        listen: listen multiaddr (port 0 picks a free port).
        bootstrap: multiaddrs (with /p2p/<peer ID>) dialled at start.
        verifiers: trusted verifier peer IDs (base58); empty = the bootstrap peers. Without
            ``genesis``, a node follows the genesis one of them serves only when every
            validator it names is one of these (:mod:`ps_p2p.directory_client`).
        genesis: path of the committee's genesis file (:mod:`ps_p2p.genesis`). Every node
            trusts a directory only with a commit of more than 2/3 of the genesis validators;
            a verifier must be one of those validators: it runs the consensus (store
            ``<home>/consensus.sqlite``) and serves the committed directory
            (docs/consensus.md, "Nodes and the committee"). None: a verifier runs a committee
            of one from ``<home>/genesis.json`` (made on first run); other nodes learn the
            genesis from ``verifiers``.
        block_interval: committee verifiers: seconds an idle chain waits before an empty
            block (keeps the directory's commit fresh: nodes refuse one older than 10 min;
            default 30; a transaction makes a block at once).
        snapshot_every: committee verifiers: heights between two state snapshots (a restart
            executes only the blocks after the newest one; 0: none; default 1,000).
        keep_blocks: committee verifiers: prune blocks older than the last ``keep_blocks``
            heights and the oldest snapshot; None (default): keep every block (block sync
            from the genesis for a validator that lost its store).
        name: the node's name, its default home's folder (default: the roles, ``user``).
        home: keys and state (:mod:`ps_p2p.home`); default ``<user data dir>/ps_p2p/<name>``.
        key_file: identity + onion key file, created on first run; default ``<home>/node.key``.
        membership: path of this node's organization membership certificate (``ps-node org
            sign``, :func:`ps_p2p.keys.load_membership`); the record then names that
            organization and shares its reputation. None: no organization.
        model: model path (HF folder or .gguf) or, with engine "vllm", the served model name;
            with engine "sim", only a name (no weights are loaded).
        engine, vllm_url, device, model_id: inference engine settings (model role).
        kv_events_endpoint, kv_events_replay_endpoint: vLLM engine: the server's KV-cache event
            publisher and replay endpoints (ZMQ, e.g. ``tcp://127.0.0.1:5557`` / ``:5558``), so
            the node's HR-subtree follows the server's prefix cache (forwarding, sec. 3.3).
        sim: the parameters of engine "sim" (table ``[sim]``: cost model, batch, prefix cache;
            :class:`~ps_p2p.engines.sim_cost.SimParams`).
        register_interval: seconds between re-registrations with the verifiers.
        record_lifetime: seconds a node record stays valid (default 5 minutes, renewed every
            ``register_interval``: ten tries per lifetime, so a committee that takes no
            renewal for minutes, e.g. stalled or flooded, does not empty the directory; was 2
            minutes, issue 16. The price: a node that stops without deregistering stays
            listed up to this long, and users skip it as a dead relay meanwhile).
        directory_refresh: seconds between directory fetches.
        relay: user nodes relay other users' paths (``ps-node ask`` turns it off).
        register: register this node's record with the verifiers (off for a one-shot ``ask``).
        tamper: TEST ONLY: corrupt relayed cells and cloves (``devnet --perturb tamper-clove``).
        byzantine: TEST ONLY, never set by users (no flag): a committee verifier that
            equivocates, sending conflicting proposals and votes to half of the other
            validators (``devnet --perturb byzantine-verifier``).
        metrics: ``"HOST:PORT"`` (``[HOST]:PORT`` for IPv6; port 0 picks a free one) where this
            node serves Prometheus ``/metrics`` (:mod:`ps_p2p.metrics`); None: not served.
        web: ``"HOST:PORT"`` where this node serves its web page (the network as it sees it:
            :mod:`ps_p2p.api.web`); None: not served (a user's ``--api`` port serves it too).
        status_interval: seconds between the node's one-line status logs (INFO); 0: none.
        drain_timeout: model role: seconds a node stopped by SIGTERM waits for the requests in
            service (:mod:`ps_p2p.serving.drain`); new ones are refused meanwhile.
        forwarding: model role: :class:`ForwardingConfig` (``[forwarding]``): HR-tree
            forwarding within the model group (:mod:`ps_p2p.roles.forwarding`).
        verification: verifier role: :class:`VerificationConfig` (``[verification]``).
        testing: TEST ONLY faults (``[testing]``: :class:`TestingConfig`); never set by users.
        circuit_relay: NATed nodes (``[circuit_relay]``:
            :class:`~ps_p2p.overlay.circuit_limits.CircuitRelayConfig`): whether this node is
            private (AutoNAT or as configured), the relay reservations a public node grants and
            a private one keeps (docs/network.md, "NATed users").
        connections: inbound connections per remote IP and /24, and the handshake deadline
            (``[connections]``: :class:`~ps_p2p.protocols.admission.InboundLimits`; e.g.
            ``exempt = ["127.0.0.0/8", "::1/128"]`` where every node runs on one machine).
    """

    roles: list[str] = field(default_factory=lambda: ["user"])
    listen: str = "/ip4/127.0.0.1/tcp/0"
    bootstrap: list[str] = field(default_factory=list)
    verifiers: list[str] = field(default_factory=list)
    genesis: str | None = None
    block_interval: float = 30 * SECONDS
    snapshot_every: int = 1000
    keep_blocks: int | None = None
    name: str | None = None
    home: str | None = None
    key_file: str | None = None
    membership: str | None = None
    model: str | None = None
    engine: str = "transformers"
    vllm_url: str = "http://127.0.0.1:8000"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    device: str = "cpu"
    model_id: str | None = None
    register_interval: float = 30 * SECONDS
    record_lifetime: float = 5 * MINUTES
    directory_refresh: float = 5 * SECONDS
    relay: bool = True
    register: bool = True
    tamper: bool = False
    byzantine: bool = False
    metrics: str | None = None
    web: str | None = None
    status_interval: float = 1 * MINUTES
    drain_timeout: float = 30 * SECONDS
    user: UserConfig = field(default_factory=UserConfig)
    model_node: ModelNodeConfig = field(default_factory=ModelNodeConfig)
    sim: SimParams = field(default_factory=SimParams)
    forwarding: ForwardingConfig = field(default_factory=ForwardingConfig)
    verification: VerificationConfig = field(default_factory=VerificationConfig)
    connections: InboundLimits = field(default_factory=InboundLimits)
    testing: TestingConfig = field(default_factory=TestingConfig)
    circuit_relay: CircuitRelayConfig = field(default_factory=CircuitRelayConfig)

    def validate(self) -> None:
        """Raise ConfigError on an impossible combination."""
        if not self.roles:
            raise ConfigError("at least one --role is needed")
        for role in self.roles:
            if role not in ROLES:
                raise ConfigError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        if "model" in self.roles and not self.model:
            raise ConfigError("the model role needs --model PATH (or the served name with "
                              "--engine vllm, any name with --engine sim)")
        if not (isinstance(self.block_interval, (int, float))
                and 0 < self.block_interval < math.inf):
            raise ConfigError(f"block_interval must be > 0 seconds, not {self.block_interval!r}")
        if not isinstance(self.snapshot_every, int) or self.snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be an integer >= 0, not "
                              f"{self.snapshot_every!r}")
        if self.keep_blocks is not None and (not isinstance(self.keep_blocks, int)
                                             or self.keep_blocks < 1):
            raise ConfigError(f"keep_blocks must be an integer >= 1, not {self.keep_blocks!r}")
        if self.name is not None:
            from ps_p2p.home import check_name

            check_name(self.name)
        if "verifier" not in self.roles and not self.bootstrap:
            raise ConfigError("a node without the verifier role needs --multiaddr of a verifier")
        check_multiaddr(self.listen, "--listen", peer_id=False)
        for addr in self.bootstrap:
            check_multiaddr(addr, "--multiaddr", peer_id=True)
        for peer in self.verifiers:
            check_peer_id(peer, "--verifier")
        if self.verification.pool:
            if "verifier" not in self.roles:
                raise ConfigError("[verification] pool is for a verifier")
            if "user" not in self.roles or not self.model:
                raise ConfigError(
                    "a verifier running challenge epochs ([verification] pool) also needs the "
                    "user role (challenges go through the overlay) and --model (its reference "
                    "copy of the committee's model)")
            if not self.verification.committee_key:
                raise ConfigError(
                    "a verifier running challenge epochs ([verification] pool) needs the "
                    "committee key ([verification] committee_key) to seal its reports")
        if (self.byzantine or self.testing.byzantine) and "verifier" not in self.roles:
            raise ConfigError("byzantine (test only) is for a verifier")
        if self.testing.faults_file is not None and not isinstance(self.testing.faults_file, str):
            raise ConfigError("[testing] faults_file must be a path")
        if self.metrics is not None:
            parse_host_port(self.metrics, "--metrics")
        if self.web is not None:
            parse_host_port(self.web, "--web")
        if not self.status_interval >= 0:
            raise ConfigError("status_interval must be >= 0 seconds")
        if not (isinstance(self.drain_timeout, (int, float)) and 0 <= self.drain_timeout < math.inf):
            raise ConfigError(f"--drain-timeout must be >= 0 seconds, not {self.drain_timeout!r}")
        if "model" in self.roles and self.forwarding.enabled:
            self.forwarding.validate()

    @property
    def home_path(self) -> pathlib.Path:
        """``home``, else :func:`ps_p2p.home.default_home` of ``name`` (default: the roles)."""
        from ps_p2p import home

        if self.home:
            return pathlib.Path(self.home).expanduser()
        return home.default_home(self.name or home.node_name(self.roles))

    @property
    def key_path(self) -> pathlib.Path:
        """``key_file``, else ``<home>/node.key``."""
        from ps_p2p import home

        if self.key_file:
            return pathlib.Path(self.key_file).expanduser()
        return self.home_path / home.KEY_FILE


#: Protocols a listen or dial multiaddr may start with (the host speaks TCP only).
_ADDRESS_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


def check_multiaddr(text: str, flag: str, *, peer_id: bool) -> multiaddr.Multiaddr:
    """Parse one multiaddr of the command line or the config file, strictly.

    A TCP multiaddr is ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>``, with ``/p2p/<peer ID>``
    at the end when ``peer_id`` (a bootstrap peer) and without it otherwise (a listen
    address). The peer ID must be an Ed25519 identity peer ID (the only kind node records and
    signatures accept, :mod:`ps_p2p.records.peer_ids`).

    Args:
        text: e.g. ``/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...``.
        flag: the flag (or config key) it came from, named in the error.
        peer_id: whether ``/p2p/<peer ID>`` is required (True) or refused (False).

    Returns:
        the parsed multiaddr.

    Raises:
        ConfigError: one line naming ``flag`` and ``text``: not a multiaddr (bad IP, port out
            of 0..65535, bad peer ID...), not TCP, or ``/p2p/`` missing or where it has no place.
    """
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{flag} needs a multiaddr, got {text!r}")
    try:
        addr = multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises ValueError subclasses, and others on odd input
        reason = getattr(exc, "message", None) or str(exc)
        raise ConfigError(f"{flag} {text}: not a valid multiaddr: {reason}") from None
    names = [p.name for p in addr.protocols()]
    if len(names) < 2 or names[0] not in _ADDRESS_PROTOCOLS or names[1] != "tcp":
        raise ConfigError(
            f"{flag} {text}: expected /ip4|ip6|dns4|dns6/<host>/tcp/<port>"
            + ("/p2p/<peer ID>" if peer_id else "")
        )
    if not peer_id:
        if len(names) != 2:
            raise ConfigError(f"{flag} {text}: expected /ip4|ip6/<host>/tcp/<port> and nothing more")
        return addr
    if names[2:] != ["p2p"]:
        raise ConfigError(f"{flag} {text}: lacks /p2p/<peer ID> at its end")
    check_peer_id(addr.value_for_protocol("p2p"), flag, shown=text)
    return addr


def check_peer_id(text: str, flag: str, *, shown: str | None = None) -> bytes:
    """Parse a base58 peer ID (``12D3KooW...``) that must be an Ed25519 identity peer ID.

    Returns:
        the peer ID bytes (38).

    Raises:
        ConfigError: naming ``flag`` and ``shown`` (default ``text``): not base58, or not an
            Ed25519 identity-multihash peer ID (e.g. an RSA key's ``Qm...`` ID).
    """
    import base58

    from ps_p2p.errors import RemoteProtocolError
    from ps_p2p.records.peer_ids import public_key_from_peer_id

    shown = text if shown is None else shown
    try:
        raw = base58.b58decode(text)
        public_key_from_peer_id(raw)
    except (ValueError, RemoteProtocolError):
        raise ConfigError(
            f"{flag} {shown}: {text!r} is not an Ed25519 peer ID (12D3KooW...)"
        ) from None
    return raw


def parse_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` or ``"[IPv6]:PORT"`` -> (host, port).

    Raises:
        ConfigError: no host, or a port that is not an integer in 0..65535.
    """
    host, sep, port = str(text).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:9100), not {text!r}")
    return host, int(port)


_NESTED = {"user": UserConfig, "model_node": ModelNodeConfig, "sim": SimParams,
           "connections": InboundLimits, "testing": TestingConfig,
           "forwarding": ForwardingConfig, "verification": VerificationConfig,
           "circuit_relay": CircuitRelayConfig}


@functools.cache
def _node_config_adapter() -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(NodeConfig)


def check_types(data: dict[str, Any]) -> None:
    """Check every key of a config (the TOML file's tables merged with the flags) against the
    type of its :class:`NodeConfig` field, nested tables included, and the range checks of the
    nested dataclasses (their ``__post_init__``), with pydantic (``TypeAdapter`` over the
    dataclasses themselves: one set of types, no second schema to keep in step). Values pydantic
    converts losslessly pass (an integer for seconds, a list for a tuple).

    Raises:
        ConfigError: every error found, one line each, naming its key (``user.paths``) and
            the value given: ``directory_refresh = 'fast': Input should be a valid number``.
    """
    from pydantic import ValidationError

    try:
        _node_config_adapter().validate_python(data)
    except ValidationError as exc:
        lines = []
        for error in exc.errors(include_url=False):
            key = ".".join(str(part) for part in error["loc"]) or "config"
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "value_error":  # a nested table's own range check
                lines.append(f"[{key}]: {message}")
            else:
                lines.append(f"{key} = {error['input']!r}: {message}")
        raise ConfigError("bad configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | pathlib.Path | None, overrides: dict[str, Any] | None = None) -> NodeConfig:
    """Build a :class:`NodeConfig` from defaults, the TOML file at ``path`` and ``overrides``.

    ``overrides`` (from the command line) win over the file; None values are ignored.

    Raises:
        ConfigError: unreadable file, bad TOML, unknown key or a wrong type.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(pathlib.Path(path).expanduser(), "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"bad TOML in {path}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    known = {f.name for f in dataclasses.fields(NodeConfig)} - {"byzantine"}  # test only
    kwargs: dict[str, Any] = {}
    for key in data:
        if key in _REMOVED:
            raise ConfigError(f"config key {key!r} was removed: {_REMOVED[key]}")
        if key not in known:
            raise ConfigError(f"unknown config key {key!r}")
    check_types(data)
    for key, value in data.items():
        if key in _NESTED:
            cls = _NESTED[key]
            if isinstance(value, cls):
                kwargs[key] = value
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            sub_known = {f.name for f in dataclasses.fields(cls)}
            for sub in value:
                if f"{key}.{sub}" in _REMOVED:
                    raise ConfigError(
                        f"config key [{key}] {sub!r} was removed: {_REMOVED[f'{key}.{sub}']}")
            unknown = set(value) - sub_known
            if unknown:
                raise ConfigError(f"unknown key(s) in [{key}]: {', '.join(sorted(unknown))}")
            try:
                kwargs[key] = cls(**value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"[{key}]: {exc}") from exc
        else:
            kwargs[key] = value
    try:
        config = NodeConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
    config.validate()
    return config
