"""HR-tree benchmarks: memory per entry, insert / search / delta apply times, chunk hashing.

The tree is the union of 8 peers' subtrees, 100,000 entries in all (``--entries``): each peer
holds prompts that start with one of 4 system prompts (2 chunks each, shared by every peer that
holds them) and go on for 30 chunks of their own (random chunk hashes of HASH_BYTES, so the tree's shape
is that of real prompts but hashing is not part of the tree timings). Measures:

1. memory per entry and per tree node (``tracemalloc``: traced bytes after building the tree
   minus before, divided by entries and by nodes), and the part of it that is the per-peer name
   index deltas resolve parents with (``sys.getsizeof`` of its dicts: their keys and values are
   the tree's own hash and node objects);
2. ``HRTree.insert`` of one 32-chunk prompt chain into the full tree;
3. ``HRTree.search`` of a prompt that matches 32 chunks (a hit) and of one that matches only
   its system prompt (tau_c = 3: a miss), and ``chunk_hashes`` of 1k- and 8k-token prompts
   (the part of a lookup that costs);
4. ``SubtreeReplica.apply_delta`` into the full tree of the delta of 64 ops of a cache in
   steady state (32 inserts of 32-chunk chains under a held system prompt, 32 evictions of the
   oldest), its ``Delta.decode``, and a whole peer's snapshot (12.5k entries): encode, decode,
   apply;
5. ``CacheView.apply`` of a ``BlockStored`` of one 16-token block after a 4k-token prefix (one
   decode step) and of a 1k-token prompt (64 blocks), and the view's memory per block.

Run: ``python benchmarks/bench_hr_tree.py [--quick] [--entries 100000]``. Single-threaded;
times with ``time.perf_counter_ns``; median and p99 per call.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_devnet import machine

from ps_p2p.engines.kv_events import BlockStored
from ps_p2p.gossip.cache_view import CacheView
from ps_p2p.gossip.hr_tree import (
    HASH_BYTES,
    Delta,
    HRTree,
    Snapshot,
    SubtreePublisher,
    SubtreeReplica,
    chunk_hashes,
)
from ps_p2p.gossip.sentry import ChunkLengths

PEERS = [f"peer-{i}".encode() for i in range(8)]
SYSTEM_CHUNKS, OWN_CHUNKS = 2, 30
KEY = b"benchmark-model-group-key-0123456"
LENGTHS = ChunkLengths(1, (40, 4), 32)


def sample(fn: Callable[[], object], iterations: int, warmup: int = 20) -> list[float]:
    """Per-call times in microseconds."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    out = []
    for _ in range(iterations):
        start = clock()
        fn()
        out.append((clock() - start) / 1000.0)
    return out


def summary(name: str, samples: list[float]) -> str:
    s = sorted(samples)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return f"{name:<52} median {statistics.median(s):9.1f} us   p99 {p99:9.1f} us   (n={len(s)})"


def chain(rng: random.Random, system: tuple[bytes, ...]) -> tuple[bytes, ...]:
    return system + tuple(rng.randbytes(HASH_BYTES) for _ in range(OWN_CHUNKS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--entries", type=int, default=100_000, help="entries in the tree")
    args = parser.parse_args(argv)
    iterations = 300 if args.quick else 3000
    rng = random.Random(1)
    systems = [tuple(rng.randbytes(HASH_BYTES) for _ in range(SYSTEM_CHUNKS)) for _ in range(4)]
    print(f"machine: {machine()}")

    # ---- 1. build, memory
    prompts = {p: [] for p in PEERS}
    tree = HRTree(1, max_entries=max(args.entries * 2, 1 << 20))
    chains = [(PEERS[i % 8], chain(rng, systems[i % 4])) for i in range(args.entries // OWN_CHUNKS)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for peer, c in chains:
        tree.insert(peer, c)
        prompts[peer].append(c)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"tree: {tree.entries():,} entries, {tree.node_count:,} nodes, {len(PEERS)} peers")
    print(f"memory: {used / 2**20:.1f} MiB traced; {used / tree.entries():.0f} B per entry, "
          f"{used / tree.node_count:.0f} B per node")
    names = sum(sys.getsizeof(d) for d in tree._named if d is not None)  # the name index
    print(f"of which the name index: {names / 2**20:.1f} MiB, {names / tree.entries():.0f} B "
          f"per entry")

    # ---- 2. insert
    extra = [(PEERS[i % 8], chain(rng, systems[i % 4])) for i in range(iterations + 20)]
    it = iter(extra)
    print(summary("insert, 32-chunk chain (30 new entries)",
                  sample(lambda: tree.insert(*next(it)), iterations)))

    # ---- 3. search, hashing
    hit = prompts[PEERS[3]][7]
    miss = systems[1] + tuple(rng.randbytes(HASH_BYTES) for _ in range(OWN_CHUNKS))
    assert tree.search(hit, 3).depth == 32 and tree.search(hit, 3).peers == {PEERS[3]}
    assert not tree.search(miss, 3).hit
    print(summary("search, 32-chunk hit", sample(lambda: tree.search(hit, 3), iterations)))
    print(summary("search, miss after the 2-chunk system prompt",
                  sample(lambda: tree.search(miss, 3), iterations)))
    for n in (1024, 8192):
        tokens = [rng.randrange(128_000) for _ in range(n)]
        print(summary(f"chunk_hashes, {n}-token prompt ({LENGTHS.chunk_count(n)} chunks)",
                      sample(lambda t=tokens: chunk_hashes(t, LENGTHS, KEY), iterations // 3)))

    # ---- 4. deltas, snapshots
    # A cache in steady state: each delta inserts 32 new prompts and evicts the 32 oldest.
    pub = SubtreePublisher(HRTree(1), b"pub", 1)
    live: list[tuple[bytes, ...]] = []
    for _ in range(320):
        live.append(chain(rng, systems[0]))
        pub.insert(live[-1])
    replica = SubtreeReplica(tree, b"pub")
    for d in pub.take_deltas():
        replica.apply_delta(d)
    deltas: list[Delta] = []
    for _ in range(2 * (iterations + 20)):
        for _ in range(32):
            live.append(chain(rng, systems[0]))
            pub.insert(live[-1])
            pub.evict(live.pop(0)[:SYSTEM_CHUNKS + 1])
        deltas.extend(pub.take_deltas())
    encoded = [d.encode() for d in deltas]
    dit = iter(deltas)
    print(f"delta of 32 inserts + 32 evictions: {len(encoded[0]):,} bytes encoded "
          f"({len(deltas[0].inserts)} inserts of {len(deltas[0].inserts[0].hashes)} hashes, "
          f"{len(deltas[0].evicts)} names)")
    print(summary("Delta.decode, 64 ops", sample(lambda: Delta.decode(encoded[0]), iterations)))
    print(summary("apply_delta, 32 inserts + 32 evictions (full tree)",
                  sample(lambda: replica.apply_delta(next(dit)), iterations, warmup=20)))
    # The same with the tree's objects out of the cyclic collector's reach (the tail above is
    # the collector walking them: a delta frees its evicted nodes before it allocates its
    # inserts', so young objects pile up as they would not in a mixed sequence).
    gc.collect()
    gc.freeze()
    print(summary("apply_delta, same, after gc.freeze()",
                  sample(lambda: replica.apply_delta(next(dit)), iterations, warmup=0)))
    gc.unfreeze()
    for d in dit:
        replica.apply_delta(d)
    assert replica.tree.prefixes(b"pub") == pub.tree.prefixes(b"pub")
    snap = Snapshot.from_prefixes(1, 1, 1, prompts[PEERS[5]])
    data = snap.encode()
    other = HRTree(1)
    print(f"snapshot of one peer: {snap.entries:,} entries, {len(data):,} bytes")
    n = max(5, iterations // 100)
    print(summary("Snapshot.encode", sample(snap.encode, n, warmup=2)))
    print(summary("Snapshot.decode", sample(lambda: Snapshot.decode(data), n, warmup=2)))
    print(summary("replace_peer (apply the snapshot)",
                  sample(lambda: other.replace_peer(b"x", snap.leaves), n, warmup=2)))

    # ---- 5. cache view
    view = CacheView(LENGTHS, KEY)
    tokens = [rng.randrange(128_000) for _ in range(4096 + 16 * (iterations + 40))]
    hashes = list(range(1, len(tokens) // 16 + 1))
    view.apply(BlockStored(tuple(hashes[:256]), None, tuple(tokens[:4096]), 16))
    pos = [256]

    def one_block() -> None:
        i = pos[0]
        view.apply(BlockStored((hashes[i],), hashes[i - 1], tuple(tokens[16 * i:16 * i + 16]),
                               16))
        pos[0] += 1

    print(summary("CacheView, 1 block after a 4k+ token prefix", sample(one_block, iterations)))
    prompt_events = [
        BlockStored(tuple(range(10**6 * (k + 1), 10**6 * (k + 1) + 64)), None,
                    tuple(rng.randrange(128_000) for _ in range(1024)), 16)
        for k in range(iterations // 3 + 20)
    ]
    pit = iter(prompt_events)
    print(summary("CacheView, a 1k-token prompt (64 blocks)",
                  sample(lambda: view.apply(next(pit)), iterations // 3)))
    fresh = CacheView(LENGTHS, KEY)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for ev in prompt_events:
        fresh.apply(ev)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"CacheView memory: {used / len(fresh):.0f} B per 16-token block "
          f"({len(fresh):,} blocks of 1k-token prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
