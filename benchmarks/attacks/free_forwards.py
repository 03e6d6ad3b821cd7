"""Attack (issue 16, MEDIUM): a member of a model group uses forwarding as a free inference service.

The forward protocol (``/planetserve/forward/1.0.0``) lets a model node hand a user's request to
another node of its group. A member M can instead forward queries of its own (no user sent them,
no reply proxy will ever see the answer): the receiving node serves them and signs the answers
for M. This script runs an honest model node as a node deploys it (:class:`ps_p2p.roles.model.
ModelNodeService`: dispatch core, driver, workers, the simulated engine with its default GPU
cost model; capacity 2, queue 64) on trio's mock clock, and hands it M's forwards exactly as
the forward protocol's handler does once it has read the request frame (``_accept_forward``,
after the membership check); then 10 users' requests arrive as cloves from their proxies.

Two variants of M's forwards: Q with no reply proxy at all (as M's own query), and Q naming
four made-up reply proxies (to look like a user's request).

Run: ``python benchmarks/attacks/free_forwards.py [--forwards 66] [--users 10]``; prints, per
variant, how many of M's forwards the node took into service, and how many of the honest users
were answered OVERLOADED.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

import trio
import trio.testing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

from ps_p2p.crypto import sida  # noqa: E402
from ps_p2p.engines.sim_engine import SimEngine  # noqa: E402
from ps_p2p.inference import InferenceQuery, ReplyProxy, SamplingParams  # noqa: E402
from ps_p2p.keys import Identity  # noqa: E402
from ps_p2p.protocols.clove_codec import clove_to_bytes  # noqa: E402
from ps_p2p.protocols.inference_codec import encode_query  # noqa: E402
from ps_p2p.roles.model import ModelNodeConfig, ModelNodeService  # noqa: E402

PROXIES = [bytes([i]) * 38 for i in range(1, 5)]


class _Overlay:
    on_delivery = None

    def send_reply(self, *args: object) -> bool:
        return True


def _query(prompt: str, proxies: bool) -> bytes:
    reply = tuple(ReplyProxy(p, os.urandom(16)) for p in PROXIES) if proxies else ()
    return encode_query(InferenceQuery(os.urandom(16), "sim", prompt,
                                       SamplingParams(max_tokens=128), reply))


async def run(forwards: int, users: int, proxies: bool) -> tuple[int, int]:
    member = Identity.generate().peer_id
    service = ModelNodeService(Identity.generate(), SimEngine("sim"), ModelNodeConfig())
    service.attach(_Overlay())

    async def route(query: InferenceQuery) -> None:
        return None

    async def no_server(host: object, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    service.enable_forwarding(None, route, lambda peer: peer == member)
    service.forward_service.serve = no_server
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        for i in range(forwards):  # M's own queries, handed over as forwards
            try:
                await service._accept_forward(member, _query(f"member's own query {i}", proxies))
            except Exception:  # refused before service (the fix's admission check)
                pass
        await service.driver.wait_processed()
        taken = service.dispatcher.requests.get("admitted", 0)
        before = service.answers.get("overloaded", 0)
        for i in range(users):  # then honest users' requests, as cloves from their proxies
            q = _query(f"an honest user's question {i}", True)
            for proxy, clove in zip(PROXIES, sida.encode(q, total=4, threshold=3)):
                service.on_delivery(proxy, clove_to_bytes(clove))
        while service.dispatcher.requests.get("admitted", 0) \
                + service.answers.get("overloaded", 0) - before < taken + users:
            await service.driver.wait_processed()
        overloaded = service.answers.get("overloaded", 0) - before
        nursery.cancel_scope.cancel()
    return taken, overloaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=66)
    parser.add_argument("--users", type=int, default=10)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # one warning per refusal otherwise
    for proxies in (False, True):
        taken, overloaded = trio.run(run, args.forwards, args.users, proxies,
                                     clock=trio.testing.MockClock(autojump_threshold=0))
        variant = "made-up reply proxies" if proxies else "no reply proxy"
        print(f"forwards with {variant:22s}: {taken} of {args.forwards} taken into service; "
              f"honest users answered OVERLOADED: {overloaded} of {args.users}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
