"""Finding (issue 16, MEDIUM): anyone can read a model group's HR-tree gossip.

An in-process localnet (one verifier, two model nodes of model ``sim``, four users) runs; an
outsider host (a fresh identity, listed in no directory) connects to model node 0, runs a plain
py-libp2p GossipSub (as a js-libp2p peer would) and subscribes to the group's topic
``/planetserve/hrtree/1/sim``. A user sends a few prompts so that the model nodes publish subtree
deltas. The script prints what the outsider received in ``--seconds`` (load reports, deltas), and
whether it could test a guessed prompt: the chunk hashes of the prompt under the key it can
derive (the model ID's, the old default) against the deltas it read.

    python benchmarks/attacks/gossip_eavesdrop.py [--seconds 10]

Before the fix (issue 16): 24 load reports and 1 delta in 10 s, the guessed prompt's 7 chunk
hashes all in them, and the group's key derivable from the model ID. After: nothing received
(the outsider's pubsub streams are refused) and the key is the group's secret.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import trio

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from ps_p2p.engines.sim_cost import SimParams  # noqa: E402
from ps_p2p.engines.sim_engine import SimEngine  # noqa: E402
from ps_p2p.gossip import hr_tree  # noqa: E402
from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.protocols import hrtree_gossip as wire  # noqa: E402
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host  # noqa: E402
from ps_p2p.testing.localnet import open_localnet  # noqa: E402

FAST = SimParams(prefill_tokens_per_s=1e6, step_time=0.001)
PREFIX = "You are a tool-using assistant. Tools: " + "search(query), calc(expr); " * 12
PUBLIC_KEY_DOMAIN = b"planetserve/v1/hrtree-group-key\x00"  # the old default's derivation


async def main(seconds: float) -> dict[str, object]:
    from libp2p.pubsub.gossipsub import GossipSub
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.tools.anyio_service.context import background_trio_service

    received: dict[int, int] = {}
    hashes_seen: set[bytes] = set()
    async with open_localnet(users=5, models=2,
                             engine_factory=lambda i: SimEngine("sim", FAST)) as net:
        target = net.models[0]
        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as outsider:
            router = GossipSub(protocols=list(wire.GOSSIPSUB_PROTOCOLS), degree=6, degree_low=4,
                               degree_high=12, heartbeat_interval=1,
                               spam_protection_enabled=False)
            pubsub = Pubsub(outsider, router, strict_signing=True)
            async with background_trio_service(pubsub), background_trio_service(router):
                await pubsub.wait_until_ready()
                subscription = await pubsub.subscribe(wire.topic_for("sim"))
                await connect(outsider, listen_multiaddrs(target.host)[0])
                start = time.monotonic()

                async def listen() -> None:
                    async for message in subscription:
                        try:
                            kind, body = wire.open_envelope(bytes(message.data),
                                                            bytes(message.from_id),
                                                            wire.group_of("sim"))
                        except Exception:
                            continue
                        received[kind] = received.get(kind, 0) + 1
                        if kind == wire.KIND_DELTA:
                            delta = hr_tree.Delta.decode(body)
                            for insert in delta.inserts:
                                hashes_seen.update(insert.hashes)

                async def ask() -> None:
                    user = net.users[0].user
                    for i in range(3):
                        await user.ask(PREFIX + f"What is {i}+{i}?", model_node=target.peer_id,
                                       max_tokens=4, timeout=30)

                with trio.move_on_after(seconds):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(listen)
                        nursery.start_soon(ask)
                elapsed = time.monotonic() - start
        # the outsider's guess: the prompt's chunks under the key it can derive from the model ID
        guessed_key = hashlib.sha256(PUBLIC_KEY_DOMAIN + b"sim").digest()
        fa = target.forwarding
        ids = await target.engine.encode(PREFIX + "What is 0+0?")
        guess = hr_tree.chunk_hashes(ids, fa.lengths, guessed_key)
        confirmed = sum(1 for h in guess if h in hashes_seen)
        # and whether it would work on any copy of the gossip (a member's leak, a capture)
        guessable = guess == hr_tree.chunk_hashes(ids, fa.lengths, fa._key)
    return {
        "seconds": round(elapsed, 1),
        "load_reports": received.get(wire.KIND_LOAD, 0),
        "deltas": received.get(wire.KIND_DELTA, 0),
        "guessed_prompt_chunks_confirmed": f"{confirmed}/{len(guess)}",
        "key_derivable_from_model_id": guessable,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    out = trio.run(main, args.seconds)
    print(" ".join(f"{k}={v}" for k, v in out.items()))
