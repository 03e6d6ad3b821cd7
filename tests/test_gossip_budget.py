"""What a member may make a model node do per second (issue 16, HR-tree sync and gossip cost):
the budgets (ps_p2p.gossip.budget), the snapshot server's cache and budget, and the topic
validator's per-publisher budget (ps_p2p.protocols.hrtree_gossip)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from ps_p2p.errors import ConfigError
from ps_p2p.gossip.budget import PeerBudget, PublisherBudget, Rate
from ps_p2p.keys import Identity
from ps_p2p.protocols import hrtree_gossip as wire

A, B, C = b"peer-a", b"peer-b", b"peer-c"


def test_a_peer_over_its_budget_is_refused_without_draining_the_total():
    budget = PeerBudget(Rate(per_second=0.1, burst=2), Rate(per_second=1, burst=3))
    assert [budget.admit(A, 0.0) for _ in range(4)] == [True, True, False, False]
    assert budget.admit(B, 0.0)  # A's refusals took nothing from the total
    assert not budget.admit(C, 0.0)  # the total (3) is spent
    assert budget.refused == 3
    assert not budget.admit(A, 9.9) and budget.admit(A, 10.0)  # one per 10 s again


def test_a_publishers_messages_and_bytes_are_bounded_and_refill_with_time():
    budget = PublisherBudget(Rate(4, 16), Rate(1000, 4000), Rate(100, 100), Rate(1e6, 1e6))
    assert budget.admit(A, 4000, 0.0)  # the whole bytes burst
    assert not budget.admit(A, 1, 0.0)  # nothing left
    assert budget.admit(A, 500, 0.5)  # 0.5 s refills 500 bytes
    assert not budget.admit(A, 4001, 100.0)  # larger than the burst: never
    assert budget.refused == {A: 2}
    assert all(budget.admit(B, 1, 0.0) for _ in range(16)) and not budget.admit(B, 1, 0.0)
    assert budget.admit(B, 1, 0.25)  # 4 messages a second


def test_the_total_gossip_budget_bounds_many_publishers_together():
    budget = PublisherBudget(Rate(4, 16), Rate(1000, 4000), Rate(100, 1000), Rate(1e4, 10_000))
    senders = [bytes([i]) for i in range(10)]
    assert all(budget.admit(p, 1000, 0.0) for p in senders)  # 10,000 bytes: the total
    assert not budget.admit(b"new", 1, 0.0)
    assert budget.refused == {b"new": 1}


def test_budgets_remember_a_bounded_number_of_peers():
    budget = PublisherBudget(max_peers=3)
    for i in range(10):
        budget.admit(bytes([i]), 10, 0.0)
    assert len(budget._messages) == 3 and len(budget._data) == 3
    with pytest.raises(ConfigError):
        Rate(per_second=0, burst=1)


def test_a_snapshot_is_built_once_per_subtree_state_and_rebuilt_at_most_every_second():
    now = [0.0]
    state = [1]
    builds = []

    def snapshot() -> bytes:
        builds.append(state[0])
        return b"snapshot of state %d" % state[0]

    server = wire.SnapshotServer(snapshot, lambda peer: True, state=lambda: state[0],
                                 min_rebuild=1.0, clock=lambda: now[0])
    assert server.answer() == server.answer() == b"snapshot of state 1"
    now[0] = 50.0
    assert server.answer() == b"snapshot of state 1"  # unchanged: no rebuild, however late
    state[0] = 2
    assert server.answer() == b"snapshot of state 2"
    state[0] = 3
    now[0] = 50.5
    assert server.answer() == b"snapshot of state 2"  # changed again, too soon: the last one
    now[0] = 51.0
    assert server.answer() == b"snapshot of state 3"
    assert builds == [1, 2, 3] and server.built == 3


async def test_the_snapshot_protocol_answers_members_within_their_budget_only():
    from libp2p.exceptions import BaseLibp2pError

    from ps_p2p.errors import RemoteProtocolError
    from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host

    server_id, member, outsider = Identity.generate(), Identity.generate(), Identity.generate()
    sealed = wire.seal(server_id, wire.KIND_SNAPSHOT, b"subtree", wire.group_of("sim"))
    built = []
    server = wire.SnapshotServer(lambda: built.append(1) or sealed,
                                 lambda peer: peer == member.peer_id, state=lambda: "same")
    async with open_host(server_id, ["/ip4/127.0.0.1/tcp/0"]) as s_host, \
            open_host(member, ["/ip4/127.0.0.1/tcp/0"]) as m_host, \
            open_host(outsider, ["/ip4/127.0.0.1/tcp/0"]) as o_host, \
            trio.open_nursery() as nursery:
        await nursery.start(server.serve, s_host)
        for host in (m_host, o_host):
            await connect(host, listen_multiaddrs(s_host)[0])
        refused = (RemoteProtocolError, BaseLibp2pError, trio.TooSlowError)
        with pytest.raises(refused):
            await wire.fetch_snapshot(o_host, server_id.peer_id, timeout=5)
        # a member: 2 answers at once (its burst), then one per 10 s
        for _ in range(2):
            assert await wire.fetch_snapshot(m_host, server_id.peer_id, timeout=5) == sealed
        with pytest.raises(refused):
            await wire.fetch_snapshot(m_host, server_id.peer_id, timeout=5)
        assert (server.served, server.refused, len(built)) == (2, 2, 1)
        nursery.cancel_scope.cancel()


def test_the_topic_validator_takes_members_gossip_within_each_publishers_budget():
    now = [0.0]
    drops: list[str] = []
    admission = wire.GossipAdmission(
        b"me", lambda peer: peer in (A, B),
        budget=PublisherBudget(Rate(4, 16), Rate(1000, 2000), Rate(100, 100), Rate(1e6, 1e6)),
        clock=lambda: now[0], on_drop=drops.append)

    def message(publisher: bytes, size: int):  # what py-libp2p hands a validator
        return SimpleNamespace(from_id=publisher, data=b"x" * size)

    assert admission(None, message(b"me", 10**6))  # our own: always
    assert not admission(None, message(C, 1))  # not a member
    assert admission(None, message(A, 2000))  # A's whole burst
    assert not admission(None, message(A, 2000))  # A floods: dropped
    assert admission(None, message(B, 2000))  # B is not affected
    now[0] = 2.0
    assert admission(None, message(A, 2000))  # refilled
    assert drops == ["not_member", "over_budget"]
