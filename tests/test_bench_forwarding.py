"""The forwarding simulator (ps_p2p.testing.forwarding_sim) and its benchmark's quick run.

The simulator drives the real cores; these tests check its node model against hand-computed
times and against SimEngine under trio's virtual clock, and the properties the benchmark
reports on a small synthetic shared-prefix workload (no shared data needed)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import sys

import pytest
import trio
import trio.testing

from ps_p2p.config import ForwardingConfig
from ps_p2p.devnet import shared_dir
from ps_p2p.engines.base import SamplingParams
from ps_p2p.engines.sim_engine import SimEngine, SimParams
from ps_p2p.errors import ConfigError
from ps_p2p.testing import forwarding_sim as fs

# round numbers, as in test_sim_engine.py
PARAMS = SimParams(prefill_tokens_per_s=1000.0, step_time=0.02, batch_growth=0.5, max_batch=4,
                   max_context=4096, block_size=16, cache_blocks=64)
PROMPT = tuple(range(1000, 1160))  # 160 tokens: 10 blocks, 9 reusable


def one_node_trace(arrivals: list[float], prompts: list[tuple[int, ...]], out: int = 10
                   ) -> fs.Trace:
    reqs = tuple(fs.Request(t, 0, i, out) for i, t in enumerate(arrivals))
    return fs.Trace(tuple(prompts), reqs, 1, 1.0)


def one_node(serial: bool, step_tokens: int | None = None) -> fs.ClusterConfig:
    """One node; ``step_tokens`` None: prefill does not slow decode (the hand-computed times
    below), else vLLM's shared steps."""
    return fs.ClusterConfig(nodes=1, params=PARAMS, serial_prefill=serial, warmup_fraction=0.0,
                            step_tokens=step_tokens)


# -- the node model -------------------------------------------------------------------------


def test_serial_prefill_reuses_the_prefix_the_previous_prefill_stored():
    # r1 at 0: prefill 160 tokens (0.16 s), decode 10 steps at batch 2 (0.03 s each): done 0.46.
    # r2 at 0.05 holds a slot (batch 2) but prefills after r1 (0.16 s), reusing 9 blocks: 16
    # tokens, 0.016 s; it decodes from 0.176 at 0.03 s a step until r1 leaves at 0.46, then at
    # 0.02 s a step: 9.4667 tokens done by 0.46, the rest takes 0.010667 s.
    r = fs.simulate(one_node_trace([0.0, 0.05], [PROMPT, PROMPT]), fs.NO_FORWARDING,
                    one_node(serial=True))
    lat1, lat2 = 0.46, 0.176 + (0.46 - 0.176) + (10 - (0.46 - 0.176) / 0.03) * 0.02 - 0.05
    assert r.latency["mean"] == pytest.approx((lat1 + lat2) / 2)
    assert r.latency["p99"] == pytest.approx(lat1)
    assert r.ttft["mean"] == pytest.approx(((0.16 + 0.03) + (0.176 + 0.03 - 0.05)) / 2)
    assert r.cached_tokens == 144 and r.prompt_tokens == 320
    assert r.hit_rate == pytest.approx(0.45)


def test_a_prefill_shares_the_steps_of_the_decodes_it_overlaps():
    # vLLM V1 chunked prefill, budget 100 tokens a step. r1 at 0 prefills 160 tokens alone:
    # 2 steps of 80 (0.08 s of compute each) + 0.02 s (batch 1) = 0.2 s; it then decodes.
    # r2 at 0.25 (batch 2: 0.03 s a step) prefills 16 uncached tokens (9 blocks reused) in one
    # step of 0.03 + 0.016 s; r1 decodes one token in that step instead of 1.533.
    r = fs.simulate(one_node_trace([0.0, 0.25], [PROMPT, PROMPT]), fs.NO_FORWARDING,
                    one_node(serial=True, step_tokens=100))
    r1_first = 0.2 + 0.02  # prefill end + one step at batch 1
    assert r.ttft["p99"] == pytest.approx(r1_first)
    # r1: 0.2 -> 0.25 at 0.02 s a token (2.5 tokens), one token in the shared 0.046 s step,
    # then 6.5 tokens at batch 2 (0.03 s each) while r2 decodes too
    lat1 = 0.296 + 6.5 * 0.03
    lat2 = 0.046 + 6.5 * 0.03 + (10 - 6.5) * 0.02
    assert r.latency["mean"] == pytest.approx((lat1 + lat2) / 2)
    assert r.cached_tokens == 144
    # without sharing, r2's prefill costs r1 nothing
    free = fs.simulate(one_node_trace([0.0, 0.25], [PROMPT, PROMPT]), fs.NO_FORWARDING,
                       one_node(serial=True))
    assert free.latency["mean"] < r.latency["mean"]


def test_parallel_prefill_looks_up_when_the_slot_is_taken():
    # r2 takes its slot at 0.05, before r1 stored its blocks: no reuse, its own 0.16 s prefill.
    r = fs.simulate(one_node_trace([0.0, 0.05], [PROMPT, PROMPT]), fs.NO_FORWARDING,
                    one_node(serial=False))
    assert r.cached_tokens == 0
    # r1: 0.16 + 10 steps at batch 2 = 0.46; r2 decodes from 0.21, at 0.03 s a step until 0.46
    lat2 = 0.21 + 0.25 + (10 - 0.25 / 0.03) * 0.02 - 0.05
    assert r.latency["mean"] == pytest.approx((0.46 + lat2) / 2)


def test_requests_beyond_the_slots_wait_in_fifo_order():
    prompts = [tuple(range(5000 * i, 5000 * i + 32)) for i in range(6)]
    r = fs.simulate(one_node_trace([0.0] * 6, prompts, out=1), fs.NO_FORWARDING,
                    one_node(serial=False))
    # 4 slots: the first four prefill 32 tokens (0.032 s) and decode one step at batch 4
    # (0.05 s); the last two start at 0.082 and take 0.032 + 0.03 (batch 2).
    assert sorted(r.finish_times) == [pytest.approx(0.082 + 0.062)]
    assert r.latency["p99"] == pytest.approx(0.144)
    assert r.served == [6]


async def _sim_engine_times(arrivals: list[float], prompts: list[tuple[int, ...]], out: int
                            ) -> list[tuple[float, float]]:
    engine = SimEngine("sim", PARAMS)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(arrivals)

    async def one(i: int) -> None:
        await trio.sleep(arrivals[i])
        first = None
        async for _ in engine.stream_ids(prompts[i], SamplingParams(max_tokens=out)):
            first = trio.current_time() if first is None else first
        times[i] = (first - arrivals[i], trio.current_time() - arrivals[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(arrivals)):
            nursery.start_soon(one, i)
    return times


def test_parallel_prefill_matches_sim_engine_within_one_decode_step():
    rng = random.Random(3)
    base = [rng.randrange(10_000, 20_000) for _ in range(64)]
    prompts = [tuple(base[: rng.choice((16, 48, 64))] + [rng.randrange(30_000, 40_000)
                                                          for _ in range(rng.randrange(1, 40))])
               for _ in range(9)]
    arrivals = sorted(rng.uniform(0, 0.6) for _ in prompts)
    expected = trio.run(_sim_engine_times, arrivals, prompts, 12,
                        clock=trio.testing.MockClock(autojump_threshold=0))
    got = fs.simulate(one_node_trace(arrivals, prompts, out=12), fs.NO_FORWARDING,
                      one_node(serial=False))
    latencies = [t for _, t in expected]
    ttfts = [t for t, _ in expected]
    # the fluid decode changes speed mid-step, SimEngine only between steps
    step = PARAMS.step_time * (1 + PARAMS.batch_growth * (PARAMS.max_batch - 1))
    assert got.latency["mean"] == pytest.approx(sum(latencies) / len(latencies), abs=step)
    assert got.latency["p99"] == pytest.approx(max(latencies), abs=step)
    assert got.ttft["mean"] == pytest.approx(sum(ttfts) / len(ttfts), abs=step)
    assert got.cached_tokens > 0


# -- the policies on a shared-prefix workload --------------------------------------------------


def synthetic(nodes: int = 4, requests: int = 500, seed: int = 7, cache_blocks: int = 384,
              rate_fraction: float = 0.8) -> tuple[fs.Trace, fs.ClusterConfig]:
    """A 40-token system prompt, 24 tool-schema-like prefixes (Zipf-1.1), short suffixes."""
    rng = random.Random(seed)
    system = [1] + [rng.randrange(100, 50_000) for _ in range(39)]
    prefixes = [system + [rng.randrange(100, 50_000) for _ in range(rng.randrange(200, 600))]
                for _ in range(24)]
    suffixes = [[rng.randrange(100, 50_000) for _ in range(rng.randrange(8, 40))]
                for _ in range(60)]
    prompts, _ = fs.zipf_prompts(prefixes, suffixes, requests, rng)
    params = SimParams(prefill_tokens_per_s=4000.0, step_time=0.025, batch_growth=0.03,
                       max_batch=8, block_size=16, cache_blocks=cache_blocks)
    forwarding = ForwardingConfig(chunk_lengths=[40, 4], chunk_default=16, chunk_version=1)
    config = fs.ClusterConfig(nodes=nodes, params=params, forwarding=forwarding, seed=seed)
    unit = fs.make_trace(prompts, 1.0, nodes=nodes, output_tokens=20, seed=seed)
    rate = rate_fraction * fs.saturation_rate(unit, config)
    return fs.make_trace(prompts, rate, nodes=nodes, output_tokens=20, seed=seed), config


@pytest.fixture(scope="module")
def runs() -> dict[str, fs.RunResult]:
    trace, config = synthetic()
    prepared = fs.PreparedPrompts(trace.prompts, config)
    return {p: fs.simulate(trace, p, config, prepared) for p in fs.POLICIES}


def test_the_forwarders_ledger_keeps_what_forwarding_gains_in_an_honest_group():
    # the share cap and observed loads (PeerLedger, on by default as in a deployed node) must
    # not undo what forwarding gains when every member reports the truth
    trace, config = synthetic()
    prepared = fs.PreparedPrompts(trace.prompts, config)
    trusting = fs.simulate(trace, fs.HR_TREE, dataclasses.replace(config, ledger=False), prepared)
    observed = fs.simulate(trace, fs.HR_TREE, config, prepared)
    alone = fs.simulate(trace, fs.NO_FORWARDING, config, prepared)
    assert config.ledger
    assert observed.hit_rate >= trusting.hit_rate - 0.03 > alone.hit_rate
    assert observed.latency["mean"] <= 1.02 * trusting.latency["mean"]


def test_every_policy_serves_every_request(runs):
    for r in runs.values():
        assert sum(r.served) == 500
        assert r.requests == 450  # the first 10% are warm-up


def test_no_forwarding_serves_at_the_entry_node(runs):
    assert runs[fs.NO_FORWARDING].forwarded == 0.0
    assert runs[fs.NO_FORWARDING].gossip == fs.GossipBytes()


def test_hr_tree_forwarding_raises_the_hit_rate_over_no_forwarding(runs):
    assert runs[fs.HR_TREE].hit_rate > runs[fs.NO_FORWARDING].hit_rate + 0.05
    assert runs[fs.HR_TREE].decisions.get("cache_hit", 0) > 0


def test_least_load_ignores_the_cache(runs):
    assert runs[fs.LEAST_LOAD].hit_rate < runs[fs.HR_TREE].hit_rate
    assert runs[fs.LEAST_LOAD].gossip.delta_messages == 0
    assert runs[fs.LEAST_LOAD].gossip.load_messages > 0


def test_the_central_router_hits_at_least_as_often_as_the_gossiped_tree(runs):
    assert runs[fs.CENTRAL_RADIX].hit_rate >= runs[fs.HR_TREE].hit_rate - 0.02


def test_deltas_cost_less_than_broadcasting_whole_subtrees(runs):
    g = runs[fs.HR_TREE].gossip
    assert g.delta_messages > 0 and g.full_messages > 0
    assert 0 < g.delta_bytes < g.full_bytes
    # 8 bytes a changed entry, within a factor 2 either way: headers and envelopes add to it,
    # an eviction names a whole subtree with one hash and a batch cancels what it undoes
    assert g.delta_floor_bytes(3) / 2 < g.delta_bytes < 2 * g.delta_floor_bytes(3)
    assert g.snapshot_syncs == 0  # lossless, in-order gossip never leaves a gap


def test_stale_load_sends_fewer_load_reports(runs):
    fresh, stale = runs[fs.HR_TREE].gossip, runs[fs.HR_TREE_STALE].gossip
    assert stale.load_messages < fresh.load_messages / 3


def test_the_same_seed_gives_the_same_run():
    trace, config = synthetic(requests=200)
    a = fs.simulate(trace, fs.HR_TREE, config).as_dict()
    b = fs.simulate(trace, fs.HR_TREE, config).as_dict()
    assert a == b


def test_make_trace_scales_the_same_draws_by_the_rate():
    prompts = [(1, 2, 3)] * 50
    slow = fs.make_trace(prompts, 1.0, nodes=8, output_tokens=5, seed=4)
    fast = fs.make_trace(prompts, 4.0, nodes=8, output_tokens=5, seed=4)
    assert [r.entry for r in slow.requests] == [r.entry for r in fast.requests]
    assert [r.arrival / 4 for r in slow.requests] == pytest.approx(
        [r.arrival for r in fast.requests])
    assert {r.entry for r in slow.requests} <= set(range(8))


def test_zipf_prompts_favour_the_first_prefixes():
    prompts, which = fs.zipf_prompts([[i] for i in range(50)], [[7]], 4000, random.Random(1))
    counts = [which.count(i) for i in range(50)]
    assert counts[0] > counts[1] > counts[10] and counts[0] > 4000 / 50 * 5
    assert all(p == (w, 7) for p, w in zip(prompts, which))


def test_bad_inputs_are_refused():
    trace, config = synthetic(requests=20)
    with pytest.raises(ConfigError):
        fs.simulate(trace, "random", config)
    with pytest.raises(ConfigError):
        fs.simulate(trace, fs.HR_TREE, dataclasses.replace(config, nodes=3))
    with pytest.raises(ConfigError):
        fs.ClusterConfig(warmup_fraction=1.0)
    with pytest.raises(ConfigError):
        fs.make_trace([(1,)], 0.0, nodes=2, output_tokens=1, seed=0)


def test_envelope_overhead_is_what_seal_adds():
    from ps_p2p.keys import Identity
    from ps_p2p.protocols.hrtree_gossip import KIND_DELTA, seal

    body = b"x" * 123
    assert len(seal(Identity.generate(), KIND_DELTA, body, b"model")) - len(body) == (
        fs.ENVELOPE_OVERHEAD_BYTES)


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert fs.percentile(values, 99) == 99
    assert fs.percentile(values, 50) == 50
    assert fs.percentile([3.0], 99) == 3.0


# -- the benchmark -----------------------------------------------------------------------------


def test_bench_quick_run_writes_its_results(tmp_path):
    shared = shared_dir()
    if not (shared / "data" / "toolbench").is_dir() or not (
            shared / "tokenizers" / "llama3" / "tokenizer.json").is_file():
        pytest.skip(f"{shared} has no data/toolbench or tokenizers/llama3 (shared data absent)")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_forwarding

    out = tmp_path / "fwd.json"
    assert bench_forwarding.main(["--quick", "--requests", "300", "--loads", "0.8",
                                  "--policies", ",".join(fs.POLICIES),
                                  "--shared", str(shared), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    policies = {r["policy"] for r in report["results"]}
    assert policies == set(fs.POLICIES)
    assert all(r["latency"]["p99"] >= r["latency"]["p50"] > 0 for r in report["results"])


# -- one routing path (issue 19 finding 5) -----------------------------------------------------


def test_the_simulator_runs_the_deployed_forwarding_defaults():
    # the benchmark builds its group with ForwardingConfig() unchanged: the policy a node runs
    assert fs.ClusterConfig().forwarding == ForwardingConfig()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_forwarding

    seen = []
    real = fs.ClusterConfig

    def spy(**kwargs):
        config = real(**kwargs)
        seen.append(config)
        return config

    shared = shared_dir()
    if not (shared / "data" / "toolbench").is_dir():
        pytest.skip(f"{shared} has no data/toolbench (shared data absent)")
    fs.ClusterConfig = spy  # type: ignore[misc]
    try:
        assert bench_forwarding.main(["--quick", "--requests", "120", "--loads", "0.5",
                                      "--policies", fs.NO_FORWARDING,
                                      "--shared", str(shared)]) == 0
    finally:
        fs.ClusterConfig = real  # type: ignore[misc]
    assert seen and all(c.forwarding == ForwardingConfig() for c in seen)


def test_every_simulated_node_routes_through_the_deployed_router_object():
    from ps_p2p.gossip.router import GroupRouter

    trace, config = synthetic(requests=60)
    sim = fs._Sim(trace, fs.HR_TREE, config, fs.PreparedPrompts(trace.prompts, config))
    assert all(isinstance(n.router, GroupRouter) for n in sim.nodes)
    assert all(n.router.settings == config.forwarding for n in sim.nodes)


def test_the_simulated_entry_node_routes_before_it_queues_the_request():
    # as the model node's dispatcher (routing=True) and router: while routed, the request is
    # not in the entry node's Q, so an idle entry holding the prefix keeps it
    trace, config = synthetic(requests=60)
    sim = fs._Sim(trace, fs.HR_TREE, config, fs.PreparedPrompts(trace.prompts, config))
    seen = []
    real = sim._route

    def route(job):
        entry = sim.nodes[job.entry].tracker
        seen.append((entry.routing, entry.queued))
        return real(job)

    sim._route = route
    sim.run()
    assert seen and all(routing == 1 for routing, _ in seen)
