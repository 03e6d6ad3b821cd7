"""Issue 16, finding "consensus floods": how much an outsider's and a validator's floods slow the
committee's commits.

Three validators of a committee of four run on loopback in this process (3 of 4 is more than
2/3: they commit; empty blocks every 50 ms). Scenarios, each measured for ``--seconds``: the
interval between two commits of validator 0 (p50, p90) and the commits made, with

* ``quiet``: nothing else;
* ``outsider``: a host that is no validator and listed nowhere sends block-sync requests (from
  height 1, 64 blocks) on one stream to each validator as fast as they answer, and opens
  consensus streams (one frame each) in a loop;
* ``validator``: a host holding the fourth validator's key sends valid signed prevotes that are
  useless: heights far in the future, and rounds far above the current one at the next heights
  (every frame distinct, so the verified-frame cache does not spare the signature checks).

The attackers run in the same process (their signing is done before the measurement, their
sending is not free): the numbers compare the code before and after a change, run on the same
machine. Run: ``python benchmarks/attacks/consensus_flood.py [--seconds 4]``.
"""

from __future__ import annotations

import argparse
import logging
import hashlib
import statistics
import tempfile
import time

import trio
from libp2p.peer.id import ID

from ps_p2p.consensus.signing import sign_vote
from ps_p2p.consensus.types import Vote, VoteType
from ps_p2p.keys import Identity
from ps_p2p.protocols import consensus as consensus_service
from ps_p2p.protocols import consensus_codec as cc
from ps_p2p.protocols.blocksync import BLOCKSYNC_PROTOCOL_ID
from ps_p2p.protocols.consensus import CONSENSUS_PROTOCOL_ID, ConsensusServiceConfig
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.testing.committee import LocalCommittee


async def outsider(targets: list, stop: trio.Event, sent: list[int]) -> None:
    me = Identity.from_private_bytes(hashlib.sha256(b"outsider").digest())
    request = encode_frame(cc.encode_sync_request(1, 64))
    junk = encode_frame(cc.encode_message(cc.Tx(b"x" * 100)))

    async def sync_flood(host, peer: ID) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set():
            try:
                stream = await host.new_stream(peer, [BLOCKSYNC_PROTOCOL_ID])
                while not stop.is_set():
                    await stream.write(request)
                    await read_frame(stream, 8 * 1024 * 1024)
                    sent[0] += 1
            except Exception:
                sent[1] += 1
                await trio.sleep(0)

    async def stream_flood(host, peer: ID) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set():
            try:
                stream = await host.new_stream(peer, [CONSENSUS_PROTOCOL_ID])
                await stream.write(junk)
                sent[2] += 1
                await stream.read(1)
            except Exception:
                await trio.sleep(0)

    async with open_host(me, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        for t in targets:
            await connect(host, listen_multiaddrs(t)[0])
            nursery.start_soon(sync_flood, host, t.get_id())
            nursery.start_soon(stream_flood, host, t.get_id())
        await stop.wait()
        nursery.cancel_scope.cancel()


async def validator(key: Identity, chain: str, height: int, targets: list, stop: trio.Event,
                    sent: list[int]) -> None:
    frames = []
    for h in range(height + 1, height + 60):  # rounds far above the current one, next heights
        for r in range(3, 60):
            frames.append(cc.encode_message(sign_vote(key, chain, Vote(
                VoteType.PREVOTE, h, r, hashlib.sha256(b"%d %d" % (h, r)).digest(), b""))))
    for h in range(10**6, 10**6 + 3000):  # far-future heights
        frames.append(cc.encode_message(sign_vote(key, chain, Vote(
            VoteType.PREVOTE, h, 0, None, b""))))
    frames = [encode_frame(f) for f in frames]

    async def flood(host, peer: ID) -> None:  # type: ignore[no-untyped-def]
        stream = await host.new_stream(peer, [CONSENSUS_PROTOCOL_ID])
        i = 0
        while not stop.is_set():
            try:
                await stream.write(b"".join(frames[i:i + 16]))
            except Exception:
                return
            sent[0] += 16
            i = (i + 16) % len(frames)

    async def drain(stream) -> None:  # type: ignore[no-untyped-def]
        try:
            while True:
                await stream.read(65536)
        except Exception:
            return

    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        host.set_stream_handler(CONSENSUS_PROTOCOL_ID, drain)  # the validators' links to it
        for t in targets:
            await connect(host, listen_multiaddrs(t)[0])
            nursery.start_soon(flood, host, t.get_id())
        await stop.wait()
        nursery.cancel_scope.cancel()


CHECKS = [0]


def _counting(verify):  # type: ignore[no-untyped-def]
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        CHECKS[0] += 1
        return verify(*args, **kwargs)
    return counted


# the signature checks the validators' consensus services make (all three)
consensus_service.verify_vote = _counting(consensus_service.verify_vote)
consensus_service.verify_proposal = _counting(consensus_service.verify_proposal)


async def main(seconds: float) -> None:
    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            times: list[float] = []

            def on_commit(member, committed) -> None:  # type: ignore[no-untyped-def]
                if member.index == 0:
                    times.append(trio.current_time())

            committee = LocalCommittee(nursery, folder, 4, on_commit=on_commit,
                                       config=ConsensusServiceConfig(empty_block_interval=0.05))
            for m in committee.members[:3]:
                await committee.start(m)
            await committee.members[0].service.wait_committed(3)
            targets = [m.host for m in committee.members[:3]]
            print(f"3 of 4 validators, empty blocks every 50 ms, {seconds:.0f} s per scenario")
            for name in ("quiet", "outsider", "validator", "quiet"):
                stop = trio.Event()
                sent = [0, 0, 0]
                v0 = committee.members[0].service.validator
                if name == "outsider":
                    nursery.start_soon(outsider, targets, stop, sent)
                elif name == "validator":
                    nursery.start_soon(validator, committee.members[3].identity,
                                       committee.genesis.chain_id, v0.height, targets, stop, sent)
                await trio.sleep(0.5)
                del times[:]
                checks, cpu = CHECKS[0], time.process_time()
                await trio.sleep(seconds)
                stop.set()
                checks, cpu = CHECKS[0] - checks, time.process_time() - cpu
                gaps = sorted(b - a for a, b in zip(times, times[1:]))
                p50 = statistics.median(gaps) * 1000 if gaps else float("nan")
                p90 = gaps[int(0.9 * (len(gaps) - 1))] * 1000 if gaps else float("nan")
                refused = dict(committee.members[0].service.refused)
                extra = ""
                if name == "outsider":
                    extra = (f"; sync answers {sent[0]}, sync streams failed {sent[1]}, "
                             f"consensus streams {sent[2]}")
                elif name == "validator":
                    extra = f"; votes sent {sent[0]}"
                print(f"{name:9s}: commit p50 {p50:6.1f} ms, p90 {p90:6.1f} ms, "
                      f"{len(times)} commits{extra}")
                print(f"           signature checks {checks / seconds:,.0f}/s (3 validators), "
                      f"process CPU {cpu / seconds * 100:.0f}%")
                if name != "quiet":
                    print(f"           validator 0 refused: {refused}")
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    trio.run(main, parser.parse_args().seconds)
