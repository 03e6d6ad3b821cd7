"""A deterministic discrete-event simulation of overlay forwarding in one model group.

It drives the project's own cores, not re-implementations of them: every model node has a
:class:`~ps_p2p.engines.prefix_cache.PrefixCacheIndex` as its KV cache (LRU over 16-token blocks,
with its KV-cache events), the cost model of :mod:`ps_p2p.engines.sim_cost` for service times, a
:class:`~ps_p2p.gossip.load.LoadTracker` for its own F_LB, and, for the policies that gossip, a
:class:`~ps_p2p.gossip.cache_view.CacheView` that turns its cache's events into subtree
operations for a :class:`~ps_p2p.gossip.hr_tree.SubtreePublisher`, an
:class:`~ps_p2p.gossip.hr_tree.HRTree` with one :class:`~ps_p2p.gossip.hr_tree.SubtreeReplica` per
peer, a :class:`~ps_p2p.gossip.load.LoadBook`, and the forwarding policies of
:mod:`ps_p2p.gossip.forwarding`. Source: PlanetServe sec. 3.3 (forwarding), sec. 5.4 and
Appendix A6 (its evaluation: latency, TTFT, KV-cache hit rate, delta vs full-broadcast updates).

**Policies** (:data:`POLICIES`), compared on the same trace:

* ``no-forwarding``: every request is served by the node it entered
  (:class:`~ps_p2p.gossip.forwarding.NoForwarding`);
* ``least-load``: the entry node forwards to the lowest F_LB of its gossiped view
  (:class:`~ps_p2p.gossip.forwarding.LeastLoad`), no cache awareness;
* ``central-radix``: the upper anchor, an SGLang-like central router that sees every node's actual
  cache (exact longest cached prefix, in blocks, read from each node's index without touching its
  LRU) and exact current load (F_LB of the node's tracker, counting requests routed to it and
  still on their way): among the nodes holding the longest cached prefix, the lowest F_LB,
  unless that F_LB reaches the overload threshold or nothing is cached, then the lowest F_LB of
  all (Algorithm 2 with perfect information);
* ``hr-tree``: PlanetServe (:class:`~ps_p2p.gossip.forwarding.HRTreeForwarding`): the entry node
  searches its gossiped HR-tree (Algorithm 1) and runs Algorithm 2 on its gossiped load view,
  counting the requests it forwarded to a peer until that peer's next report; one hop;
* ``hr-tree-stale``: the same with load reported only with the deltas (every
  ``stale_load_interval`` seconds, 5 s: the paper's sync period) and no counting of one's own
  forwards, the design DESIGN.md "Model nodes" warns against.

Ties of F_LB (every idle node has F_LB 0) are broken by a seeded draw per node
(``choose``), so entry nodes do not all pick the same idle peer.

The gossiping policies run with the forwarder's :class:`~ps_p2p.gossip.load.PeerLedger` as a
deployed node does (``ledger``: peers' reports held to the answers' measured latency and the
forwards outstanding, each peer capped to its share of an entry node's decisions; issue 16).
On the synthetic shared-prefix workload of ``tests/test_bench_forwarding.py`` (4 and 8 nodes,
60-100% load) it lowers ``hr-tree``'s hit rate by 0.01-0.023 and its mean latency by 2-6%.

**A node** (cost model of :mod:`ps_p2p.engines.sim_cost`). Requests wait in a FIFO queue for one
of ``max_batch`` slots (the capacity C). A request with a slot prefills its prompt tokens that
its node's cache misses (looked up with at most ``(len - 1) // block_size`` blocks, as vLLM and
:class:`~ps_p2p.engines.sim_engine.SimEngine` do), stores its prompt's full blocks in the cache,
then decodes ``output_tokens`` tokens, one step each, a step taking
``step_time * (1 + batch_growth * (batch - 1))`` seconds with ``batch`` the slots held at the
time (as in SimEngine). Prefill: with ``serial_prefill`` (the default) a node computes one
prefill at a time, at ``prefill_tokens_per_s`` (the cost model's estimate is the throughput of the
whole GPU, so two prompts cannot both get it); a prompt looks its prefix up when its prefill
starts, so it reuses what the prefill before it stored. The prefill shares the engine's steps
with the decodes (``step_tokens``, the default): vLLM V1 always runs chunked prefill, and each
step holds every decoding request's next token and then as much of a waiting prompt as its
``max_num_batched_tokens`` budget leaves (2048 for its OpenAI server on a GPU under 70 GiB such
as the A6000: ``EngineArgs.get_batch_defaults`` in ``vllm/engine/arg_utils.py``; "smaller
values achieve better inter-token latency because there are fewer prefills slowing down
decodes", vLLM's docs/configuration/optimization.md, "Chunked Prefill"). A step's time is then
the decode step plus the chunk's compute (the additive step-time model of Sarathi-Serve,
arXiv 2403.02310, which those docs cite): a prompt of U uncached tokens takes
``n = ceil(U / (budget - decoding))`` steps, ``U / R + n * step_seconds(batch)`` seconds, and
the node's decodes advance n tokens meanwhile. So a cache hit frees GPU time for every request
of its node, as on vLLM. With ``step_tokens=None`` the decode steps go on at full speed during
a prefill (the model before issue 19's second session: cache hits then cannot raise a decode-bound
node's capacity). Without ``serial_prefill``, every slot prefills at full speed at once, exactly as
SimEngine schedules (prefill is then nearly free of contention and the cache matters much less).
Decode is simulated as a fluid: every decoding request of a node advances at
``1 / step`` tokens a second, ``step`` recomputed whenever the batch or the prefill changes, so
a run costs a few events per request, not one per token. TTFT is the prefill's end plus one decode
step at the batch size of that moment. Latency is from the arrival at the entry node to the last
token; a forwarded request pays ``hop_delay`` on its way.

**Gossip** (only the policies that use it). Each node, every ``load_interval`` seconds (phases
spread over the nodes): turns its cache's new events into subtree operations (CacheView ->
SubtreePublisher on its own union tree, as ``ps_p2p.roles.forwarding`` does) and publishes its
load report (:func:`~ps_p2p.gossip.load.encode_report`); every ``delta_interval`` seconds its
subtree deltas (:meth:`~ps_p2p.gossip.hr_tree.Delta.encode`). Every message reaches every other
node ``gossip_delay`` seconds later, decoded from its bytes once and applied through the
receiver's :class:`~ps_p2p.gossip.load.LoadBook` or the publisher's
:class:`~ps_p2p.gossip.hr_tree.SubtreeReplica`, so peers see a stale view, as on a network. Bytes
counted: the encoded body plus :data:`ENVELOPE_OVERHEAD_BYTES` (the signed gossip envelope of
:mod:`ps_p2p.protocols.hrtree_gossip`: kind, Ed25519 signature), times the
receivers (N - 1: a broadcast; GossipSub's own framing and mesh duplicates are not counted, for
either design). *Full broadcast* (Appendix A6, Figs. 19-20: the design that delta updates
replace) is every node sending its whole subtree, :meth:`~ps_p2p.gossip.hr_tree.Snapshot.encode`
plus the envelope, to every other node every ``delta_interval``; it is counted, not sent.
Counted over the whole run (from cold caches, when the subtrees full broadcast would send are
still small) and over a *warm window* (from the arrival of the trace's middle request to that
of its last). Two more reference designs are counted for comparison (:class:`GossipBytes`):
every cached prompt's whole chain, and every KV-cache event, each broadcast as it happens.

**Metrics** are taken over the requests after the first ``warmup_fraction`` of arrivals (cold
caches): token-level KV-cache hit rate (cached prompt tokens / prompt tokens), mean / p50 / p99
latency and TTFT (nearest rank), the fraction of requests forwarded, decisions by reason.

Everything random comes from ``random.Random`` seeded from :attr:`ClusterConfig.seed` and the
trace's seed: the same inputs give the same results (no clock reads; the caller times the run).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ps_p2p.config import ForwardingConfig
from ps_p2p.engines.kv_events import BlockStored
from ps_p2p.engines.prefix_cache import PrefixCacheIndex, block_hash
from ps_p2p.engines.sim_cost import SimCostModel, SimParams
from ps_p2p.errors import ConfigError
from ps_p2p.gossip.forwarding import (
    ForwardingConfig as PolicyConfig,
)
from ps_p2p.gossip.forwarding import (
    NodeLoad,
    RequestContext,
    load_balance,
)
from ps_p2p.gossip.hr_tree import HASH_BYTES, Delta, NeedSnapshot, chunk_hashes
from ps_p2p.gossip.load import (
    DEFAULT_UNKNOWN_LATENCY,
    ForwardOutcome,
    LoadReport,
    LoadTracker,
    decode_report,
    encode_report,
    load_factor,
)
from ps_p2p.gossip.router import GroupRouter
from ps_p2p.gossip.sentry import ChunkLengths

__all__ = [
    "CENTRAL_LPM",
    "CENTRAL_RADIX",
    "ENVELOPE_OVERHEAD_BYTES",
    "HR_TREE",
    "HR_TREE_STALE",
    "LEAST_LOAD",
    "NO_FORWARDING",
    "POLICIES",
    "ClusterConfig",
    "GossipBytes",
    "PreparedPrompts",
    "Request",
    "RunResult",
    "Trace",
    "flood_trace",
    "make_trace",
    "percentile",
    "saturation_rate",
    "simulate",
    "zipf_prompts",
]

NO_FORWARDING = "no-forwarding"
LEAST_LOAD = "least-load"
CENTRAL_RADIX = "central-radix"
CENTRAL_LPM = "central-lpm"
HR_TREE = "hr-tree"
HR_TREE_STALE = "hr-tree-stale"
POLICIES = (NO_FORWARDING, LEAST_LOAD, CENTRAL_RADIX, CENTRAL_LPM, HR_TREE, HR_TREE_STALE)

ENVELOPE_OVERHEAD_BYTES = 1 + 64
"""Bytes a signed gossip envelope adds to its body: kind (1), Ed25519 signature (64); its domain
and group are signed, not sent (:func:`ps_p2p.protocols.hrtree_gossip.seal`; kept as a number
here so this module does not import the trio/libp2p service; a test checks it)."""

_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"  # an Ed25519 libp2p peer ID (ps_p2p.keys)
_MODEL_ID = "meta-llama/Meta-Llama-3-8B-Instruct"
_FLOAT_EPS = 1e-9


# ------------------------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
        arrival: seconds from the trace's start at which it reaches its entry node.
        entry: index of the node it enters, in [0, nodes).
        prompt: index of its prompt in :attr:`Trace.prompts`.
        output_tokens: tokens it generates (>= 1).
    """

    arrival: float
    entry: int
    prompt: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    """Prompts (token IDs) and the requests that use them, in arrival order.

    Attributes:
        prompts: token-ID tuples; each ID in [0, 2**32) (chunk hashes pack them as u32).
        requests: sorted by arrival.
        nodes: entry nodes are in [0, nodes).
        rate: mean arrivals per second (0.0 for a flood).
    """

    prompts: tuple[tuple[int, ...], ...]
    requests: tuple[Request, ...]
    nodes: int
    rate: float


def zipf_prompts(
    prefixes: Sequence[Sequence[int]],
    suffixes: Sequence[Sequence[int]],
    count: int,
    rng: random.Random,
    *,
    exponent: float = 1.1,
) -> tuple[list[tuple[int, ...]], list[int]]:
    """``count`` prompts, each a shared prefix drawn by a Zipf law then a suffix drawn uniformly.

    The prefix of rank r (its index in ``prefixes``, 0 the most popular) is drawn with
    probability proportional to ``(r + 1) ** -exponent`` (the paper samples ToolUse with
    Zipf-1.1, sec. 5.1). Draw order: per prompt, the prefix, then the suffix.

    Args:
        prefixes: shared prefixes (system prompt + tool schemas), most popular first.
        suffixes: per-request suffixes (the user's query).
        count: prompts to draw (>= 0).
        rng: the source of randomness.
        exponent: Zipf exponent (> 0).

    Returns:
        (prompts as token tuples, the prefix index of each).

    Raises:
        ConfigError: no prefixes or suffixes, or a bad exponent.
    """
    if not prefixes or not suffixes or not exponent > 0:
        raise ConfigError("zipf_prompts needs prefixes, suffixes and an exponent > 0")
    cum = list(itertools.accumulate((r + 1) ** -exponent for r in range(len(prefixes))))
    prompts: list[tuple[int, ...]] = []
    which: list[int] = []
    for _ in range(count):
        p = min(bisect.bisect_left(cum, rng.random() * cum[-1]), len(prefixes) - 1)
        s = rng.randrange(len(suffixes))
        prompts.append(tuple(prefixes[p]) + tuple(suffixes[s]))
        which.append(p)
    return prompts, which


def make_trace(
    prompts: Sequence[Sequence[int]],
    rate: float,
    *,
    nodes: int,
    output_tokens: int | Sequence[int],
    seed: int,
) -> Trace:
    """Poisson arrivals at ``rate`` per second, one per prompt in order, entry nodes uniform.

    ``output_tokens``: tokens every request generates, or one count per prompt.

    The same ``seed`` gives the same unit-rate gaps and entry nodes at every rate (the gaps are
    divided by ``rate``), so runs at different rates differ only in time scale. Draw order: per
    request, ``expovariate(1)``, then ``randrange(nodes)``.

    Raises:
        ConfigError: ``rate`` <= 0, ``nodes`` < 1 or ``output_tokens`` < 1.
    """
    outputs = ([output_tokens] * len(prompts) if isinstance(output_tokens, int)
               else list(output_tokens))
    if not rate > 0 or nodes < 1 or len(outputs) != len(prompts) or min(outputs, default=1) < 1:
        raise ConfigError("make_trace needs rate > 0, nodes >= 1 and output_tokens >= 1 (one "
                          "per prompt when a sequence)")
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(len(prompts)):
        t += rng.expovariate(1.0) / rate
        requests.append(Request(t, rng.randrange(nodes), i, outputs[i]))
    return Trace(tuple(tuple(p) for p in prompts), tuple(requests), nodes, rate)


def flood_trace(trace: Trace) -> Trace:
    """The same requests, all arriving at time 0 (for :func:`saturation_rate`)."""
    return replace(
        trace, requests=tuple(replace(r, arrival=0.0) for r in trace.requests), rate=0.0
    )


# ------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated group and its forwarding settings (module docstring); seconds.

    Attributes:
        nodes: model nodes (>= 1).
        params: the cost model and the cache (``cache_blocks`` per node, ``max_batch`` = C).
        serial_prefill: one prefill at a time per node (module docstring).
        step_tokens: with ``serial_prefill``, the tokens one engine step computes (vLLM's
            ``max_num_batched_tokens``: 2048 for its OpenAI server on a GPU under 70 GiB, such
            as the A6000): prefill shares the GPU with decode (module docstring); None: prefill
            does not slow decode (the model before issue 19's second session).
        forwarding: the nodes' ``[forwarding]`` settings, :class:`ps_p2p.config.ForwardingConfig`
            (its defaults unless a run says otherwise: the policy a node deploys). Its L
            (``lengths()``), tau_c, cost-model parameters, ``load_interval``,
            ``delta_interval``, ``load_max_age`` and ``max_peers`` are used as a node uses them.
        key: the group's HR-tree key (16..64 bytes).
        stale_load_interval: load period of ``hr-tree-stale``.
        gossip_delay: network delay of a gossip message.
        hop_delay: network delay of a forwarded request.
        warmup_fraction: leading fraction of arrivals left out of the metrics, in [0, 1).
        seed: tie-break draws.
        ledger: gossiping policies hold peers' reports to what the forwarder observed and cap
            each peer's share (:class:`~ps_p2p.gossip.load.PeerLedger`, as a deployed node
            does: ``ps_p2p.roles.forwarding``); False: reports taken at their word.
        lpm_threshold: F_LB (Q queued + running) from which ``central-lpm`` passes a holder over.
    """

    nodes: int = 8
    params: SimParams = field(default_factory=lambda: SimParams(cache_blocks=2048))
    serial_prefill: bool = True
    step_tokens: int | None = 2048
    forwarding: ForwardingConfig = field(default_factory=ForwardingConfig)
    key: bytes = b"ps-forwarding-sim-group-key-0001"
    stale_load_interval: float = 5.0
    gossip_delay: float = 0.05
    hop_delay: float = 0.02
    warmup_fraction: float = 0.1
    seed: int = 0
    ledger: bool = True
    lpm_threshold: float = 5.0

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError("nodes must be >= 1")
        self.forwarding.validate()
        if not self.stale_load_interval > 0:
            raise ConfigError("stale_load_interval must be > 0 seconds")
        if self.gossip_delay < 0 or self.hop_delay < 0:
            raise ConfigError("delays must be >= 0 seconds")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError("warmup_fraction must be in [0, 1)")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ConfigError("step_tokens must be >= 1 (or None)")

    @property
    def lengths(self) -> ChunkLengths:
        """The group's chunk lengths L."""
        return self.forwarding.lengths()


class PreparedPrompts:
    """Per-prompt hashes, computed once and shared by the runs over one trace's prompts.

    Args:
        prompts: the trace's prompts.
        config: gives L, the key and the block size.
    """

    def __init__(self, prompts: Sequence[tuple[int, ...]], config: ClusterConfig) -> None:
        self.prompts = prompts
        self.lengths = config.lengths
        self.key = config.key
        self.block_size = config.params.block_size
        self._chunks: dict[int, list[bytes]] = {}
        self._blocks: dict[int, list[int]] = {}

    def compatible(self, config: ClusterConfig) -> bool:
        return (self.lengths, self.key, self.block_size) == (
            config.lengths, config.key, config.params.block_size)

    def chunk_chain(self, i: int) -> list[bytes]:
        """HR-tree chunk hashes of prompt ``i`` (Algorithm 1, lines 2-8)."""
        chain = self._chunks.get(i)
        if chain is None:
            chain = self._chunks[i] = chunk_hashes(self.prompts[i], self.lengths, self.key)
        return chain

    def block_chain(self, i: int) -> list[int]:
        """Block hashes of prompt ``i``'s cacheable blocks (``(len - 1) // block_size``)."""
        chain = self._blocks.get(i)
        if chain is None:
            tokens = self.prompts[i]
            bs = self.block_size
            chain = []
            parent = None
            for b in range((len(tokens) - 1) // bs):
                parent = block_hash(parent, tokens[b * bs:(b + 1) * bs])
                chain.append(parent)
            self._blocks[i] = chain
        return chain


# ------------------------------------------------------------------------------------- results


@dataclass
class GossipBytes:
    """Gossip sent by all nodes in a run: bytes summed over receivers (module docstring).

    Attributes:
        delta_bytes, delta_messages: subtree deltas (messages counted once, bytes per receiver).
        delta_entries: subtree entries (prefixes) the publishers' ops added or removed. Sending
            each changed entry's chunk hash costs ``HASH_BYTES`` bytes per changed entry and
            receiver (the benchmark's "floor"); a delta can send less, as an eviction names a whole subtree
            with one hash and a batch's coalescing drops entries added and removed within it.
        full_bytes, full_messages: what full broadcast of whole subtrees would have sent.
        load_bytes, load_messages: load reports.
        snapshot_syncs: snapshots a replica needed after a gap (0 on this lossless network).
        warm_delta_bytes, warm_load_bytes, warm_full_bytes: the same, counted only over the
            *warm window* (module docstring, "Gossip"): from the arrival of the middle request
            of the trace to the arrival of its last, when the caches have been filling for half
            the run and requests still arrive (the run's drain is left out).
        prompt_bytes: a reference design that broadcasts each prompt's whole chunk chain
            (``HASH_BYTES`` a hash, one envelope) to every peer when a node caches it.
        event_bytes: a reference design that broadcasts every KV-cache event (8 bytes a block
            hash, a stored event's parent too, one envelope) to every peer.
    """

    delta_bytes: int = 0
    delta_messages: int = 0
    delta_entries: int = 0
    full_bytes: int = 0
    full_messages: int = 0
    load_bytes: int = 0
    load_messages: int = 0
    snapshot_syncs: int = 0
    warm_delta_bytes: int = 0
    warm_load_bytes: int = 0
    warm_full_bytes: int = 0
    prompt_bytes: int = 0
    event_bytes: int = 0

    @property
    def delta_fraction(self) -> float | None:
        """Delta bytes / full-broadcast bytes (HR-tree updates only, Appendix A6)."""
        return self.delta_bytes / self.full_bytes if self.full_bytes else None

    @property
    def gossip_fraction(self) -> float | None:
        """(Deltas + load reports) / full broadcast, over the whole run (cold caches too)."""
        return (self.delta_bytes + self.load_bytes) / self.full_bytes if self.full_bytes else None

    @property
    def warm_fraction(self) -> float | None:
        """(Deltas + load reports) / full broadcast over the warm window."""
        return ((self.warm_delta_bytes + self.warm_load_bytes) / self.warm_full_bytes
                if self.warm_full_bytes else None)

    def delta_floor_bytes(self, receivers: int) -> int:
        """``HASH_BYTES`` per changed entry per receiver (one chunk hash each)."""
        return HASH_BYTES * self.delta_entries * receivers


@dataclass
class RunResult:
    """Metrics of one (policy, trace) run (module docstring); seconds.

    Attributes:
        policy, rate, nodes: what ran.
        requests: requests measured (after the warm-up).
        prompt_tokens, cached_tokens: over the measured requests; ``hit_rate`` their ratio.
        latency, ttft: mean, p50, p99 (nearest rank) by name.
        forwarded: fraction of measured requests served by another node than their entry.
        decisions: forwarding decisions by reason (all requests).
        served: requests served by each node (all requests).
        sim_seconds: simulated time until the last request finished.
        gossip: bytes of gossip (zeros for policies that do not gossip).
        finish_times: per node, when its last request finished (0.0: it served none).
    """

    policy: str
    rate: float
    nodes: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    latency: dict[str, float]
    ttft: dict[str, float]
    forwarded: float
    decisions: dict[str, int]
    served: list[int]
    sim_seconds: float
    gossip: GossipBytes
    finish_times: list[float] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        """JSON-ready summary (without the per-node finish times)."""
        g = self.gossip
        return {
            "policy": self.policy, "rate": self.rate, "nodes": self.nodes,
            "requests": self.requests, "hit_rate": self.hit_rate,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "latency": self.latency, "ttft": self.ttft, "forwarded": self.forwarded,
            "decisions": dict(sorted(self.decisions.items())), "served": self.served,
            "sim_seconds": self.sim_seconds,
            "gossip": {
                "delta_bytes": g.delta_bytes, "delta_messages": g.delta_messages,
                "full_bytes": g.full_bytes, "full_messages": g.full_messages,
                "load_bytes": g.load_bytes, "load_messages": g.load_messages,
                "snapshot_syncs": g.snapshot_syncs, "delta_fraction": g.delta_fraction,
                "delta_entries": g.delta_entries,
                "delta_floor_bytes": g.delta_floor_bytes(self.nodes - 1),
                "warm_delta_bytes": g.warm_delta_bytes, "warm_load_bytes": g.warm_load_bytes,
                "warm_full_bytes": g.warm_full_bytes, "prompt_bytes": g.prompt_bytes,
                "event_bytes": g.event_bytes, "gossip_fraction": g.gossip_fraction,
                "warm_fraction": g.warm_fraction,
            },
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (nan when empty)."""
    if not values:
        return math.nan
    s = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(s)))
    return s[min(rank, len(s)) - 1]


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p99": percentile(values, 99)}


# --------------------------------------------------------------------------------- simulation

# event kinds (heap entries: (time, seq, kind, a, b))
_ARRIVE, _DELIVER, _PREFILL_DONE, _DECODE_DONE, _LOAD_TICK, _DELTA_TICK, _GOT_LOAD, _GOT_DELTA = (
    range(8))


class _Job:
    __slots__ = ("cached", "done", "entry", "first_token", "index", "node", "prompt",
                 "req", "started", "tokens")

    def __init__(self, index: int, req: Request, tokens: tuple[int, ...]) -> None:
        self.index = index
        self.req = req
        self.prompt = req.prompt
        self.tokens = tokens
        self.entry = req.entry
        self.node = req.entry
        self.cached = 0
        self.started = 0.0
        self.first_token = 0.0
        self.done = 0.0


class _Node:
    """One model node: engine state, own load, and (when gossiping) its router."""

    def __init__(self, index: int, peer_id: bytes, config: ClusterConfig) -> None:
        p = config.params
        self.index = index
        self.peer_id = peer_id
        self.cache: PrefixCacheIndex[None] = PrefixCacheIndex(p.cache_blocks, p.block_size)
        self.tracker = LoadTracker(capacity=p.max_batch, max_queue=1 << 30)
        self.queue: deque[_Job] = deque()
        self.running = 0  # slots held (SimEngine's `running`: prefilling and decoding)
        self.prefill_queue: deque[_Job] = deque()
        self.prefilling = False
        self.decoding: list[tuple[float, int, _Job]] = []  # (virtual finish, seq, job)
        self.progress = 0.0  # decode tokens done by every decoding request since t = 0
        self.chunk_seconds = 0.0  # what the prefill chunk adds to each step, while prefilling
        self.updated = 0.0
        self.version = 0
        self.inbound = 0  # requests routed here, on their way (the central router counts them)
        self.served = 0
        self.last_finish = 0.0
        #: the node's routing state (gossiping policies): the object a deployed node runs
        self.router: GroupRouter | None = None
        self.load_seq = 0
        self.snapshot_state: tuple[int, int] | None = None  # (incarnation, seq) measured
        self.snapshot_bytes = 0


def _peer_id(i: int) -> bytes:
    return _PEER_ID_PREFIX + hashlib.blake2b(i.to_bytes(4, "big"), digest_size=32).digest()


class _Sim:
    def __init__(self, trace: Trace, policy: str, config: ClusterConfig,
                 prepared: PreparedPrompts) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
        if trace.nodes != config.nodes:
            raise ConfigError(f"trace for {trace.nodes} nodes, config for {config.nodes}")
        self.trace = trace
        self.policy = policy
        self.config = config
        self.fwd = config.forwarding
        self.prepared = prepared
        self.cost = SimCostModel(config.params)
        self.params = config.params
        self.rng = random.Random(f"forwarding-sim/{config.seed}/{policy}")
        self.events: list[tuple[float, int, int, object, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.gossip = GossipBytes()
        self.decisions: dict[str, int] = {}
        self.jobs = [_Job(i, r, trace.prompts[r.prompt]) for i, r in enumerate(trace.requests)]
        self.remaining = len(self.jobs)
        arrivals = [r.arrival for r in trace.requests]
        self.warm_from = arrivals[len(arrivals) // 2] if arrivals else 0.0
        self.warm_to = arrivals[-1] if arrivals else 0.0
        self.nodes = [_Node(i, _peer_id(i), config) for i in range(config.nodes)]
        self.index_of = {n.peer_id: n.index for n in self.nodes}
        self.gossiping = policy in (LEAST_LOAD, HR_TREE, HR_TREE_STALE)
        self.trees = policy in (HR_TREE, HR_TREE_STALE)
        self.stale = policy == HR_TREE_STALE
        self.policy_config = PolicyConfig(
            tau_c=self.fwd.tau_c, prefill_tokens_per_s=self.fwd.prefill_tokens_per_s,
            hop_seconds=self.fwd.hop_seconds, busy_weight=self.fwd.busy_weight)
        self._setup_nodes()

    # ---- setup

    def _setup_nodes(self) -> None:
        c = self.config
        ids = [n.peer_id for n in self.nodes]
        load_interval = c.stale_load_interval if self.stale else self.fwd.load_interval
        fwd = self.fwd
        if self.stale:  # the stale variant: a report stays valid over its longer period
            fwd = dataclasses.replace(fwd, load_max_age=max(fwd.load_max_age, 3 * load_interval))
        if not self.gossiping:
            return
        for node in self.nodes:
            draw = random.Random(f"{c.seed}/{self.policy}/choose/{node.index}").randrange
            node.router = GroupRouter(  # as ps_p2p.roles.forwarding.GroupForwarding builds it
                node.peer_id, _MODEL_ID, c.key, node.tracker, fwd, incarnation=1,
                choose=draw, cache_blocks=c.params.cache_blocks,
                block_size=c.params.block_size, least_load=self.policy == LEAST_LOAD,
                count_forwards=not self.stale, ledger=c.ledger)
            node.router.set_members({p: node.tracker.capacity for p in ids})
        n = c.nodes
        for node in self.nodes:
            self._push(node.index * load_interval / n, _LOAD_TICK, node.index, None)
            if self.trees and not self.stale:  # stale: deltas go with the load reports
                self._push(node.index * fwd.delta_interval / n, _DELTA_TICK, node.index, None)

    # ---- event loop

    def _push(self, at: float, kind: int, a: object, b: object) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, a, b))

    def run(self) -> None:
        for job in self.jobs:
            self._push(job.req.arrival, _ARRIVE, job, None)
        handlers = {
            _ARRIVE: self._arrive, _DELIVER: self._deliver, _PREFILL_DONE: self._prefill_done,
            _DECODE_DONE: self._decode_done, _LOAD_TICK: self._load_tick,
            _DELTA_TICK: self._delta_tick, _GOT_LOAD: self._got_load, _GOT_DELTA: self._got_delta,
        }
        events = self.events
        while events and self.remaining:
            at, _, kind, a, b = heapq.heappop(events)
            self.now = at
            handlers[kind](a, b)

    # ---- routing

    def _arrive(self, job: _Job, _: object) -> None:
        entry = self.nodes[job.entry]
        # admitted as being routed, then queued only if routed here: the order of the model
        # node's dispatcher and router (issue 19 finding 3), for every policy
        if not entry.tracker.try_admit(routing=True):  # max_queue is unbounded here
            raise AssertionError("the simulated queue refused a request")
        target = self._route(job)
        job.node = target
        if target == job.entry:
            entry.tracker.routed_here()
            entry.queue.append(job)
            self._fill_slots(entry)
        else:
            entry.tracker.cancel()
            self.nodes[target].inbound += 1
            self._push(self.now + self.config.hop_delay, _DELIVER, job, None)

    def _deliver(self, job: _Job, _: object) -> None:
        node = self.nodes[job.node]
        node.inbound -= 1
        if node.router is not None:  # the receiving node runs the policy too: it stays here
            decision = node.router.policy.decide(RequestContext(forwarded=True), self.now)
            assert decision.serve_locally
        self._admit(node, job)

    def _count(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1

    def _route(self, job: _Job) -> int:
        entry = self.nodes[job.entry]
        if self.policy == NO_FORWARDING:
            self._count("no_forwarding")
            return entry.index
        if self.policy == CENTRAL_RADIX:
            return self._central(job)
        if self.policy == CENTRAL_LPM:
            return self._central_lpm(job)
        router = entry.router
        assert router is not None
        chain = self.prepared.chunk_chain(job.prompt) if self.trees else []
        decision = router.route_chain(chain, len(job.tokens), self.now)
        self._count(decision.reason.value)
        if decision.forward_to is None:
            return entry.index
        return self.index_of[decision.forward_to]

    def _exact_load(self, node: _Node) -> NodeLoad:
        """The node's load now, with the requests on their way to it as if arrived."""
        t = node.tracker
        latency = DEFAULT_UNKNOWN_LATENCY if t.latency_ewma is None else t.latency_ewma
        over = max(0, t.in_service + node.inbound - t.capacity)
        return NodeLoad(latency, t.queued + over, min(t.capacity, t.in_service + node.inbound),
                        t.capacity)

    def _cached_tokens(self, job: _Job) -> list[int]:
        """Per node, the tokens of the prompt its cache holds now (exact, LRU untouched)."""
        chain = self.prepared.block_chain(job.prompt)
        out = []
        for node in self.nodes:
            cache = node.cache
            m = 0
            for h in chain:
                if h not in cache:
                    break
                m += 1
            out.append(m * self.params.block_size)
        return out

    def _central(self, job: _Job) -> int:
        """Central router with exact state, the same cost rule (module docstring)."""
        cached = self._cached_tokens(job)
        entry = self.nodes[job.entry]
        loads = {n.peer_id: self._exact_load(n) for n in self.nodes}
        self_load = loads.pop(entry.peer_id)
        request = RequestContext({n.peer_id: m for n, m in zip(self.nodes, cached) if m},
                                 len(job.tokens))
        decision = load_balance(entry.peer_id, self_load, loads, request, self.policy_config,
                                self.rng.randrange)
        self._count(decision.reason.value)
        return entry.index if decision.forward_to is None else self.index_of[decision.forward_to]

    def _least(self, candidates: list[int], loads: list[float]) -> int:
        best = min(loads[i] for i in candidates)
        tied = [i for i in candidates if loads[i] == best]
        return tied[0] if len(tied) == 1 else tied[self.rng.randrange(len(tied))]

    def _central_lpm(self, job: _Job) -> int:
        """Longest-prefix-match central router with exact state (module docstring)."""
        matches = self._cached_tokens(job)
        loads = []
        for n in self.nodes:
            t = n.tracker
            loads.append(load_factor(t.latency_ewma, t.requests + n.inbound, t.capacity,
                                     DEFAULT_UNKNOWN_LATENCY))
        everyone = list(range(len(self.nodes)))
        best = max(matches)
        if best > 0:
            holder = self._least([i for i in everyone if matches[i] == best], loads)
            if loads[holder] < self.config.lpm_threshold:
                self._count("cache_hit")
                return holder
            self._count("overloaded_fallback")
        else:
            self._count("least_loaded")
        return self._least(everyone, loads)

    # ---- serving

    def _admit(self, node: _Node, job: _Job) -> None:
        if not node.tracker.try_admit():  # max_queue is unbounded here
            raise AssertionError("the simulated queue refused a request")
        node.queue.append(job)
        self._fill_slots(node)

    def _fill_slots(self, node: _Node) -> None:
        started = False
        while node.queue and node.running < self.params.max_batch:
            job = node.queue.popleft()
            node.tracker.start()
            job.started = self.now
            if not started:
                self._advance(node)
                started = True
            node.running += 1
            if self.config.serial_prefill:
                node.prefill_queue.append(job)
            else:
                self._start_prefill(node, job)
        if started:
            self._kick_prefill(node)
            self._schedule_decode(node)

    def _kick_prefill(self, node: _Node) -> None:
        if self.config.serial_prefill and not node.prefilling and node.prefill_queue:
            node.prefilling = True
            self._start_prefill(node, node.prefill_queue.popleft())

    def _start_prefill(self, node: _Node, job: _Job) -> None:
        bs = self.params.block_size
        match = node.cache.lookup(job.tokens, max_blocks=(len(job.tokens) - 1) // bs)
        job.cached = match.tokens
        uncached = len(job.tokens) - match.tokens
        seconds = self.cost.prefill_seconds(uncached)
        budget = self.config.step_tokens
        if self.config.serial_prefill and budget is not None:
            # vLLM V1 (chunked prefill): each step computes every decoding request's token and
            # a chunk of this prompt within the step's token budget; the chunk's compute adds
            # to the step, so the prompt takes its chunks' steps and the decodes slow down
            self._advance(node)
            chunk = max(1, budget - len(node.decoding))
            steps = max(1, math.ceil(uncached / chunk))
            node.chunk_seconds = seconds / steps
            seconds = steps * self._step_seconds(node)
            self._schedule_decode(node)
        self._push(self.now + seconds, _PREFILL_DONE, node, job)

    def _prefill_done(self, node: _Node, job: _Job) -> None:
        self._advance(node)
        node.chunk_seconds = 0.0
        node.cache.store(job.tokens, _no_payload)
        if self.trees:  # the reference design that broadcasts every cached prompt's chain
            chain = self.prepared.chunk_chain(job.prompt)
            self.gossip.prompt_bytes += ((HASH_BYTES * len(chain) + ENVELOPE_OVERHEAD_BYTES)
                                         * (len(self.nodes) - 1))
        if self.config.serial_prefill:
            node.prefilling = False
            self._kick_prefill(node)
        heapq.heappush(node.decoding,
                       (node.progress + job.req.output_tokens, job.index, job))
        job.first_token = self.now + self._step_seconds(node)
        self._schedule_decode(node)

    def _step_seconds(self, node: _Node) -> float:
        """One step of the node now: its decode batch, plus the prefill chunk it carries."""
        return self.cost.step_seconds(node.running) + node.chunk_seconds

    def _advance(self, node: _Node) -> None:
        """Move the node's decode progress to now (the step was constant since the update)."""
        if node.decoding:
            node.progress += (self.now - node.updated) / self._step_seconds(node)
        node.updated = self.now

    def _schedule_decode(self, node: _Node) -> None:
        node.version += 1
        if node.decoding:
            left = node.decoding[0][0] - node.progress
            at = self.now + max(0.0, left) * self._step_seconds(node)
            self._push(at, _DECODE_DONE, node, node.version)

    def _decode_done(self, node: _Node, version: object) -> None:
        if version != node.version:
            return  # the batch changed since: rescheduled
        self._advance(node)
        finished = 0
        while node.decoding and node.decoding[0][0] <= node.progress + _FLOAT_EPS:
            _, _, job = heapq.heappop(node.decoding)
            job.done = self.now
            node.tracker.finish(self.now - job.started)
            router = self.nodes[job.entry].router
            if job.entry != node.index and router is not None:  # its answer goes back
                router.forward_done(node.peer_id, ForwardOutcome.ANSWERED,
                                    self.now + self.config.hop_delay - job.req.arrival, self.now)
            node.served += 1
            node.last_finish = self.now
            finished += 1
            self.remaining -= 1
        node.running -= finished
        self._fill_slots(node)
        self._schedule_decode(node)

    # ---- gossip

    def _absorb(self, node: _Node) -> None:
        router = node.router
        assert router is not None
        peer = router.me
        entries = router.tree.entries(peer)
        receivers = len(self.nodes) - 1
        for event in node.cache.drain_events():
            if isinstance(event, BlockStored):
                hashes = len(event.block_hashes) + (event.parent_block_hash is not None)
            else:
                hashes = len(getattr(event, "block_hashes", ()))
            self.gossip.event_bytes += (8 * hashes + ENVELOPE_OVERHEAD_BYTES) * receivers
            router.absorb((event,))
            now_entries = router.tree.entries(peer)
            self.gossip.delta_entries += abs(now_entries - entries)
            entries = now_entries

    def _warm(self) -> bool:
        return self.warm_from <= self.now <= self.warm_to

    def _load_tick(self, node_index: object, _: object) -> None:
        node = self.nodes[node_index]  # type: ignore[index]
        assert node.router is not None
        receivers = len(self.nodes) - 1
        if self.trees:
            self._absorb(node)
        report = node.router.load_report_due(node.load_seq + 1, self.now)
        if report is not None:  # a meaningful change or the heartbeat, as a node decides
            node.load_seq += 1
            data = encode_report(report)
            self.gossip.load_messages += 1
            sent = (len(data) + ENVELOPE_OVERHEAD_BYTES) * receivers
            self.gossip.load_bytes += sent
            if self._warm():
                self.gossip.warm_load_bytes += sent
            self._push(self.now + self.config.gossip_delay, _GOT_LOAD, node.index,
                       decode_report(data, node.peer_id, _MODEL_ID))
        if self.stale:
            self._publish_deltas(node)
            self._push(self.now + self.config.stale_load_interval, _LOAD_TICK, node.index, None)
        else:
            self._push(self.now + self.fwd.load_interval, _LOAD_TICK, node.index, None)

    def _delta_tick(self, node_index: object, _: object) -> None:
        node = self.nodes[node_index]  # type: ignore[index]
        self._absorb(node)
        self._publish_deltas(node)
        self._push(self.now + self.fwd.delta_interval, _DELTA_TICK, node.index, None)

    def _publish_deltas(self, node: _Node) -> None:
        """Send the node's new deltas; count what a full broadcast of its subtree would cost."""
        assert node.router is not None
        receivers = len(self.nodes) - 1
        for delta in node.router.take_deltas():
            data = delta.encode()
            self.gossip.delta_messages += 1
            sent = (len(data) + ENVELOPE_OVERHEAD_BYTES) * receivers
            self.gossip.delta_bytes += sent
            if self._warm():
                self.gossip.warm_delta_bytes += sent
            self._push(self.now + self.config.gossip_delay, _GOT_DELTA, node.index,
                       Delta.decode(data))
        publisher = node.router.publisher
        state = (publisher.incarnation, publisher.seq)
        if node.snapshot_state != state:  # the subtree changed: measure its snapshot again
            node.snapshot_state = state
            node.snapshot_bytes = len(node.router.snapshot().encode())
        self.gossip.full_messages += 1
        sent = (node.snapshot_bytes + ENVELOPE_OVERHEAD_BYTES) * receivers
        self.gossip.full_bytes += sent
        if self._warm():
            self.gossip.warm_full_bytes += sent

    def _got_load(self, sender: object, report: object) -> None:
        assert isinstance(report, LoadReport)
        for node in self.nodes:
            if node.index != sender:
                assert node.router is not None
                node.router.receive_load(report, self.now)

    def _got_delta(self, sender: object, delta: object) -> None:
        assert isinstance(delta, Delta)
        src = self.nodes[sender]  # type: ignore[index]
        assert src.router is not None
        for node in self.nodes:
            if node.index == sender:
                continue
            assert node.router is not None
            if isinstance(node.router.apply_delta(src.peer_id, delta), NeedSnapshot):
                self.gossip.snapshot_syncs += 1
                node.router.apply_snapshot(src.peer_id, src.router.snapshot())

    # ---- results

    def result(self) -> RunResult:
        skip = int(len(self.jobs) * self.config.warmup_fraction)
        measured = self.jobs[skip:]
        latency = [j.done - j.req.arrival for j in measured]
        ttft = [j.first_token - j.req.arrival for j in measured]
        forwarded = sum(1 for j in measured if j.node != j.entry)
        return RunResult(
            policy=self.policy,
            rate=self.trace.rate,
            nodes=len(self.nodes),
            requests=len(measured),
            prompt_tokens=sum(len(j.tokens) for j in measured),
            cached_tokens=sum(j.cached for j in measured),
            latency=_stats(latency),
            ttft=_stats(ttft),
            forwarded=forwarded / len(measured) if measured else 0.0,
            decisions=dict(self.decisions),
            served=[n.served for n in self.nodes],
            sim_seconds=max((j.done for j in self.jobs), default=0.0),
            gossip=self.gossip,
            finish_times=[n.last_finish for n in self.nodes],
        )


def _no_payload(_block: int) -> None:
    return None


def simulate(
    trace: Trace,
    policy: str,
    config: ClusterConfig,
    prepared: PreparedPrompts | None = None,
) -> RunResult:
    """Run ``trace`` under ``policy`` until every request finished.

    Args:
        trace: the requests (:func:`make_trace`), for ``config.nodes`` nodes.
        policy: one of :data:`POLICIES`.
        config: the group.
        prepared: the prompts' hashes, reused across runs over the same prompts (built here if
            None or built for another L, key or block size).

    Returns:
        The run's metrics; equal inputs give equal results.

    Raises:
        ConfigError: an unknown policy or a trace for another number of nodes.
    """
    if prepared is None or prepared.prompts != trace.prompts or not prepared.compatible(config):
        prepared = PreparedPrompts(trace.prompts, config)
    sim = _Sim(trace, policy, config, prepared)
    sim.run()
    return sim.result()


def saturation_rate(
    trace: Trace, config: ClusterConfig, prepared: PreparedPrompts | None = None
) -> float:
    """Requests per second the group serves without forwarding when every node is always busy.

    Every request of ``trace`` arrives at once at its entry node (:func:`flood_trace`); each
    node's service rate is the requests it served over the time its last one finished, and the
    group's is their sum: the arrival rate past which the no-forwarding baseline's queues grow
    without bound (each node sees its share of a Poisson stream with uniform entry nodes).

    Raises:
        ConfigError: as :func:`simulate`.
    """
    result = simulate(flood_trace(trace), NO_FORWARDING, config, prepared)
    return sum(s / t for s, t in zip(result.served, result.finish_times) if t > 0)
