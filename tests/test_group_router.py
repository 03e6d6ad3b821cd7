"""The routing core a model node and the simulator share (ps_p2p.gossip.router): how its own
forwards count against a peer's stale load report (issue 19, third session)."""

from __future__ import annotations

import pytest

from ps_p2p.config import ForwardingConfig
from ps_p2p.gossip.load import LoadReport, LoadTracker
from ps_p2p.gossip.router import GroupRouter

MODEL = "sim"
KEY = b"k" * 32
ME, B, C = b"\x01" * 38, b"\x02" * 38, b"\x03" * 38
SETTINGS = ForwardingConfig(group_key="11" * 32, chunk_default=4, load_max_age=1e9)


def _router(members: tuple[bytes, ...]) -> GroupRouter:
    tracker = LoadTracker(capacity=4, max_queue=64)
    for _ in range(4):  # this node's slots are busy: a miss goes to a peer with a free one
        tracker.try_admit()
        tracker.start()
    router = GroupRouter(ME, MODEL, KEY, tracker, SETTINGS, incarnation=1, choose=None)
    router.set_members({p: 32 for p in (ME, *members)})
    return router


def _report(peer: bytes, seq: int, running: int, waiting: int = 0) -> LoadReport:
    return LoadReport(peer, MODEL, seq, capacity=8, queued=waiting, in_service=running,
                      latency_us=200_000)


@pytest.mark.parametrize(
    ("members", "running", "waiting", "forwards", "expected_running", "expected_waiting"),
    [
        # one forward is one request more at the peer, whatever the group's size: the other
        # entry nodes' sends since the report are not guessed (they replace what it finished)
        ((B,), 0, 0, 1, 1, 0),
        ((B, C), 5, 0, 1, 6, 0),
        ((B, C), 5, 0, 3, 8, 0),
        ((B, C), 7, 0, 3, 8, 2),  # beyond its free slots they wait
        ((B, C), 8, 4, 2, 8, 6),
    ],
)
def test_a_forward_counts_once_against_its_peer_until_the_peers_next_report(
        members, running, waiting, forwards, expected_running, expected_waiting):
    router = _router(members)
    router.receive_load(_report(B, 1, running, waiting), 0.0)
    for other in members[1:]:  # a peer busier than B: the misses go to B
        router.receive_load(_report(other, 1, 8, 8), 0.0)
    for i in range(forwards):
        assert router.route_chain([], 100, 0.1 * (i + 1)).forward_to == B
    seen = router.book.get(B)
    assert (seen.running, seen.waiting) == (expected_running, expected_waiting)
    router.receive_load(_report(B, 2, running, waiting), 1.0)  # the newer report reconciles
    assert router.book.get(B).forwarded == 0


def test_an_entry_node_keeps_sending_a_prefix_to_its_holder_while_the_holder_has_free_slots():
    """With each forward counted k times (k nodes in the group), one forward made a 3-node
    group's holder of 2 free slots look full and the next request with its prefix went to a
    node without it."""
    router = _router((B, C))
    router.receive_load(LoadReport(B, MODEL, 1, capacity=2, queued=0, in_service=0,
                                   latency_us=200_000), 0.0)
    router.receive_load(_report(C, 1, 0), 0.0)
    prompt = list(range(64))
    chain = router.chain(prompt)
    router.recent.add(B, chain, 0.0)  # B holds the whole prompt (as its delta would say)
    first = router.route_chain(chain, len(prompt), 0.1)
    second = router.route_chain(chain, len(prompt), 0.2)
    assert (first.forward_to, second.forward_to) == (B, B)
    assert second.reason.value == "cache_hit"
