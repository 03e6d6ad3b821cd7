"""Reproduction of issue 16 HIGH 1: sybil REGISTERs flood the committee's mempool, honest
renewals are refused, and the directory empties.

What runs (one validator's view, in process, on a fake clock; seconds of wall time): the
validator's real submission path (:class:`~ps_p2p.protocols.committee_directory.
CommitteeDirectoryService`'s ``register``: the path a REGISTER takes from a node's connection),
its real :class:`~ps_p2p.registry.Mempool` and a block every second (the default
``block_interval``) built as :class:`~ps_p2p.registry.validator.Validator` builds it (``reap``,
``execute_block``, ``Mempool.update``). The genesis policy is the default
:class:`~ps_p2p.registry.AdmissionPolicy`; the nodes' record lifetime and renewal interval
are the defaults of :class:`~ps_p2p.config.NodeConfig`.

* ``--honest`` nodes (default 7) are listed at t = 0, each connected from its own /24, and
  renew every ``register_interval`` seconds (staggered);
* from t = 1 s the attacker tries ``--rate`` (default 600) REGISTERs a second, each from a
  fresh identity claiming a fresh /24 (``10.a.b.1``), sent over connections from ``--sources``
  (default 4) /24 networks it really holds (the address the validator observes);
* the run lasts one record lifetime plus 30 s.

Printed: renewals accepted / refused (and why), honest nodes listed at the end, sybils
admitted to the mempool and listed, the mempool's size, and the wall time a block costs the
validator (execution + mempool re-check), median and max; then what the attacker needs to fill
the registry at the measured listing rate.

Usage: ``python benchmarks/attacks/mempool_flood.py [--honest 7] [--rate 600] [--sources 4]``

Measured (2 shared cores; docs/threat-model/mempool.md), default arguments:

=========================  =====================  ==============================
                           before (c1cd361)       after (fix/mempool)
=========================  =====================  ==============================
honest renewals            1 taken, 33 refused    76 taken, 0 refused
                           ("mempool full")
honest listed at the end   0 of 7                 7 of 7
sybils listed              9,600 (64 a block)     72 (8 + 2/min per source /24)
block cost, median / max   709 / 2,959 ms         0.1 / 6.8 ms
=========================  =====================  ==============================

With ``--sources 65536`` (the limiter never binds, the lanes alone): 76 renewals taken, 7 of 7
listed, sybils listed at the chain's cap (64 a block), block cost 19.6 / 117 ms.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import inspect
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

from ps_p2p import registry as app  # noqa: E402
from ps_p2p.config import NodeConfig  # noqa: E402
from ps_p2p.consensus.block import make_block  # noqa: E402
from ps_p2p.consensus.types import Validator as Member  # noqa: E402
from ps_p2p.crypto.onion import OnionKeyPair  # noqa: E402
from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.pb.planetserve.v1 import directory_pb2  # noqa: E402
from ps_p2p.protocols.committee_directory import CommitteeDirectoryService  # noqa: E402
from ps_p2p.records import NodeRecord, Role, sign_record  # noqa: E402
from ps_p2p.registry.directory import DirectoryHistory  # noqa: E402

ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
GENESIS_MS = 1_795_000_000_000


def ident(tag: bytes) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(tag).digest())


def record(who: Identity, addr: str, now_ms: int, lifetime_ms: int,
           roles=(Role.USER,)) -> NodeRecord:
    return sign_record(who, NodeRecord(
        who.peer_id, (addr,), frozenset(roles), ONION,
        model_id="m" if Role.MODEL in roles else "",
        issued_at_ms=now_ms, expires_at_ms=now_ms + lifetime_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--honest", type=int, default=7)
    parser.add_argument("--rate", type=int, default=600, help="sybil REGISTERs tried a second")
    parser.add_argument("--sources", type=int, default=4,
                        help="/24 networks the attacker really sends from (at most 65536)")
    args = parser.parse_args()

    cfg = NodeConfig()
    lifetime_ms = int(cfg.record_lifetime * 1000)
    interval = cfg.register_interval
    verifier = ident(b"verifier")
    genesis = app.Genesis("flood", GENESIS_MS, (Member(verifier.peer_id),))
    state = app.genesis_state(genesis)
    history = DirectoryHistory(state)
    mempool = app.Mempool()
    now = [0.0]

    def now_ms() -> int:
        return GENESIS_MS + 1000 + int(now[0] * 1000)

    def submit(tx: object) -> bool:
        return mempool.add(app.encode_tx(tx), history.latest, now_ms())

    service = CommitteeDirectoryService(lambda: history, submit)
    params = inspect.signature(service.register).parameters
    kwargs = {"clock": lambda: now[0]} if "clock" in inspect.signature(
        CommitteeDirectoryService).parameters else {}
    if kwargs:
        service = CommitteeDirectoryService(lambda: history, submit, **kwargs)

    def register(rec: NodeRecord, source: str) -> str:
        """'' when taken, else the refusal."""
        extra = {"source": (source, 4001)} if "source" in params else {}
        frame = service.register(rec, rec.peer_id, **extra)
        response = directory_pb2.CommitteeDirectoryResponse()
        skip = 1
        while frame[skip - 1] & 0x80:  # the unsigned-varint length prefix
            skip += 1
        response.ParseFromString(frame[skip:])
        return "" if response.WhichOneof("kind") == "ack" else response.error.message

    height = 0
    block_seconds: list[float] = []
    ever_listed: set[bytes] = set()

    def block() -> None:
        nonlocal state, height
        height += 1
        started = time.perf_counter()
        txs = mempool.reap(history.latest)
        b = make_block(chain_id=genesis.chain_id, height=height, time_ms=now_ms(),
                       prev_block_id=history.latest.block_id, app_hash=history.latest.app_hash,
                       proposer=verifier.peer_id, txs=txs)
        new, result = app.execute_block(history.latest, b)
        history.add_block(b.header, (), new, result)
        ever_listed.update(p for p, r in result.changes.items() if r is not None)
        mempool.update(new, b.txs, now_ms())
        block_seconds.append(time.perf_counter() - started)

    honest = [ident(b"honest %d" % i) for i in range(args.honest)]
    honest_addr = [f"/ip4/198.51.{100 + i}.7/tcp/4001" for i in range(args.honest)]
    for i, who in enumerate(honest):
        err = register(record(who, honest_addr[i], now_ms(), lifetime_ms, (Role.USER, Role.MODEL)),
                       f"198.51.{100 + i}.7")
        assert not err, err
    block()
    assert all(h.peer_id in history.latest.records for h in honest)

    renewals: collections.Counter[str] = collections.Counter()
    sybil_taken = 0
    sybil_refused: collections.Counter[str] = collections.Counter()
    sybil_ids: set[bytes] = set()
    n = 0
    end = cfg.record_lifetime + 30
    next_renew = [1 + interval * (i + 1) / len(honest) for i in range(len(honest))]
    wall = time.perf_counter()
    while now[0] < end:
        now[0] += 1.0
        for _ in range(args.rate):  # the flood first: it keeps the pool full
            who = ident(b"sybil %d" % n)
            net = n
            n += 1
            rec = record(who, f"/ip4/10.{net // 256 % 256}.{net % 256}.1/tcp/4001", now_ms(),
                         lifetime_ms)
            src = n % args.sources
            err = register(rec, f"100.{src // 256 % 256}.{src % 256}.9")
            if err:
                sybil_refused[err.split(":", 1)[-1].strip().split(" (")[0][:60]] += 1
            else:
                sybil_taken += 1
                sybil_ids.add(who.peer_id)
        for i, who in enumerate(honest):
            if now[0] >= next_renew[i]:
                next_renew[i] += interval
                err = register(record(who, honest_addr[i], now_ms(), lifetime_ms,
                                      (Role.USER, Role.MODEL)), f"198.51.{100 + i}.7")
                renewals["accepted" if not err else "refused: " + err[:70]] += 1
        block()
    wall = time.perf_counter() - wall

    listed = history.latest.records
    honest_listed = sum(1 for h in honest if h.peer_id in listed)
    sybils_listed = sum(1 for p in sybil_ids if p in listed)
    sybils_ever = len(sybil_ids & ever_listed)
    print(f"record lifetime {cfg.record_lifetime:.0f} s, renewals every {interval:.0f} s, "
          f"{end:.0f} s simulated ({height} blocks, {wall:.1f} s wall)")
    print(f"honest renewals: {dict(renewals)}")
    print(f"honest nodes listed after one record lifetime: {honest_listed} of {len(honest)}")
    print(f"sybil REGISTERs tried {n}, taken into the mempool {sybil_taken}, listed during the "
          f"run {sybils_ever}, listed at the end {sybils_listed}")
    for reason, count in sybil_refused.most_common(4):
        print(f"  sybils refused: {count} x {reason}")
    print(f"mempool at the end: {len(mempool)} transactions")
    print(f"validator wall time per block (execute + mempool re-check): median "
          f"{statistics.median(block_seconds) * 1000:.1f} ms, "
          f"max {max(block_seconds) * 1000:.1f} ms")
    rate = sybils_ever / end
    if rate:
        hours = app.AdmissionPolicy().max_records / rate / 3600
        print(f"sybils listed {rate:.2f}/s ({args.sources} source /24s, one verifier): the "
              f"100k registry fills in {hours:.1f} h at this rate")


if __name__ == "__main__":
    main()
