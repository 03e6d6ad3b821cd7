"""Issue 16, finding "full-directory requests amplify": one peer asks a verifier for the whole
committed directory again and again.

A verifier of 20,000 listed records (small user records, one per /24 so the admission caps
pass) serves ``/planetserve/directory/2.0.0`` from a real py-libp2p host (no consensus: the
blocks are executed by hand); one client host sends ``get since_height=0`` (a 17-byte frame)
N times on one stream, as fast as it can, and reads every answer. Printed:

* the verifier's CPU per answered request spent building the answer (``snapshot`` and the
  page frames, timed inside the service: what a cache can save) and the whole process's CPU per
  request (client, server, Noise, Yamux: what the bytes cost);
* the bytes per answered request, and the amplification (answer bytes / request bytes);
* how many requests were answered and how many refused, and what a refused one gets and costs;
* the same for ``--peers`` peers asking once each (the same full directory).

Run: ``python benchmarks/attacks/directory_amplify.py [--records 20000] [--requests 20] [--peers 5]``
(about 10 s to build the records, then a few seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import trio

from ps_p2p import registry as app
from ps_p2p.consensus.block import block_id, make_block
from ps_p2p.consensus.signing import sign_vote
from ps_p2p.consensus.types import Validator, Vote, VoteType
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import directory_pb2
from ps_p2p.protocols import committee_directory as cd
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.registry.directory import DirectoryHistory

CHAIN = "amplify"
T0 = 1_700_000_000_000
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public


def build_history(n: int) -> DirectoryHistory:
    genesis = app.Genesis(CHAIN, T0, tuple(Validator(k.peer_id) for k in KEYS),
                          app.AdmissionPolicy(max_registrations_per_block=1000))
    state = app.genesis_state(genesis)
    history = DirectoryHistory(state)
    txs = []
    for i in range(n):
        ident = Identity.from_private_bytes(hashlib.sha256(b"node %d" % i).digest())
        rec = sign_record(ident, NodeRecord(
            ident.peer_id, (f"/ip4/10.{i // 256 % 256}.{i % 256}.1/tcp/4001",),
            frozenset({Role.USER}), ONION, issued_at_ms=T0, expires_at_ms=T0 + 3_600_000))
        txs.append(app.encode_tx(app.RegisterTx(rec)))
    batches = [txs[i:i + 1000] for i in range(0, len(txs), 1000)] + [[]]
    for batch in batches:
        block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=state.time_ms + 1000,
                           prev_block_id=state.block_id, app_hash=state.app_hash,
                           proposer=KEYS[0].peer_id, txs=batch)
        new, result = app.execute_block(state, block)
        commit = [sign_vote(k, CHAIN, Vote(VoteType.PRECOMMIT, block.header.height, 0,
                                           block_id(block.header), b"")) for k in KEYS[:3]]
        history.add_block(block.header, commit, new, result)
        state = new
    return history


class TimedService(cd.CommitteeDirectoryService):
    """Adds up the CPU the service spends building answers (snapshot and page frames)."""

    build_cpu = 0.0

    def snapshot(self, since_height):  # type: ignore[no-untyped-def]
        t = time.process_time()
        header, commit, pages = super().snapshot(since_height)
        self.build_cpu += time.process_time() - t

        def timed():  # type: ignore[no-untyped-def]
            it = iter(pages)
            while True:
                t = time.process_time()
                try:
                    page = next(it)
                except StopIteration:
                    self.build_cpu += time.process_time() - t
                    return
                self.build_cpu += time.process_time() - t
                yield page

        return header, commit, timed()


REQUEST = encode_frame(directory_pb2.CommitteeDirectoryRequest(
    get=directory_pb2.GetCommittedDirectory(since_height=0)).SerializeToString())


async def ask(stream, requests: int) -> dict:  # type: ignore[no-untyped-def]
    """Send ``requests`` gets on ``stream``, read the answers; what came back."""
    out = {"answered": 0, "refused": 0, "bytes": 0, "cpu": 0.0, "refused_cpu": 0.0,
           "error": "", "reset": ""}
    for _ in range(requests):
        t = time.process_time()
        try:
            await stream.write(REQUEST)
            body = await read_frame(stream, cd.MAX_RESPONSE_BYTES)
        except Exception as exc:  # the verifier reset the stream
            out["reset"] = type(exc).__name__
            break
        size = len(body)
        response = directory_pb2.CommitteeDirectoryResponse.FromString(body)
        if response.WhichOneof("kind") == "error":
            out["refused"] += 1
            out["refused_cpu"] += time.process_time() - t
            out["error"] = f"error {response.error.code}: {response.error.message}"
            continue
        while True:
            body = await read_frame(stream, cd.MAX_RESPONSE_BYTES)
            size += len(body)
            page = directory_pb2.CommitteeDirectoryResponse.FromString(body).page
            if page[4]:  # the page's last flag (u32 index, u8 last)
                break
        out["answered"] += 1
        out["bytes"] += size
        out["cpu"] += time.process_time() - t
    return out


async def attack(history: DirectoryHistory, requests: int, peers: int) -> None:
    service = TimedService(lambda: history, lambda tx: None)
    server = Identity.from_private_bytes(b"\x51" * 32)
    print(f"records: {len(history.served.records)}; request: {len(REQUEST)} bytes")
    async with open_host(server, ["/ip4/127.0.0.1/tcp/0"]) as vhost:
        handlers = service.register_handlers(vhost)
        for phase, (n_peers, n_requests) in enumerate(((1, requests), (peers, 1))):
            service.build_cpu = 0.0
            total = {"answered": 0, "refused": 0, "bytes": 0, "cpu": 0.0, "refused_cpu": 0.0}
            last: dict = {}
            for i in range(n_peers):
                client = Identity.from_private_bytes(bytes([0x60 + phase, i]) * 16)
                async with open_host(client, ["/ip4/127.0.0.1/tcp/0"]) as chost:
                    await connect(chost, listen_multiaddrs(vhost)[0])
                    stream = await chost.new_stream(vhost.get_id(),
                                                    [cd.COMMITTEE_DIRECTORY_PROTOCOL_ID])
                    last = await ask(stream, n_requests)
                for key in total:
                    total[key] += last[key]
            n = max(total["answered"], 1)
            if phase == 0:
                print(f"\n1 peer, {requests} requests on one stream:")
            else:
                print(f"\n{peers} peers, 1 request each (the same answer):")
            print(f"  answered: {total['answered']}; refused: {total['refused']}"
                  + (f"; then the stream was reset ({last['reset']})" if last["reset"] else ""))
            print(f"  bytes per answered request: {total['bytes'] / n / 2**20:.2f} MiB "
                  f"(amplification x{total['bytes'] / n / len(REQUEST):,.0f})")
            print(f"  verifier CPU building answers: {service.build_cpu / n * 1000:.1f} ms per "
                  f"answered request ({service.build_cpu * 1000:.0f} ms in all)")
            print(f"  process CPU (client+server+transport): {total['cpu'] / n * 1000:.1f} ms "
                  f"per answered request, {total['cpu'] * 1000:.0f} ms in all")
            if total["refused"]:
                print(f"  a refused request gets {last['error']!r} and costs "
                      f"{total['refused_cpu'] / total['refused'] * 1000:.2f} ms of process CPU "
                      "(round trip)")
        await handlers.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--peers", type=int, default=5)
    args = parser.parse_args()
    t = time.monotonic()
    history = build_history(args.records)
    print(f"built {args.records} records in {time.monotonic() - t:.1f} s")
    trio.run(attack, history, args.requests, args.peers)


if __name__ == "__main__":
    main()
