"""Relay table and relay choice (ps_p2p.overlay.relay_table, ps_p2p.overlay.paths)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.crypto import onion
from ps_p2p.errors import DirectoryError, RemoteProtocolError
from ps_p2p.overlay.paths import choose_relays, reuse_count
from ps_p2p.overlay.relay_table import Direction, RelayTable

A, B, C = b"peer-a", b"peer-b", b"peer-c"


def _hop(next_peer=C, out=b"o" * 16, proxy=False):
    key = onion.OnionKeyPair.generate()
    if proxy:
        path, packet = onion.create_path([onion.HopSpec(b"x" * 38, key.public)])
    else:
        other = onion.OnionKeyPair.generate()
        path, packet = onion.create_path(
            [onion.HopSpec(b"x" * 38, key.public), onion.HopSpec(next_peer, other.public)]
        )
    hop, _ = onion.process_setup(key, packet)
    return hop


def test_cells_are_found_forward_by_predecessor_and_backward_by_successor():
    table = RelayTable()
    hop = _hop()
    entry = table.add(A, b"i" * 16, hop, now=0.0)
    assert table.lookup(A, b"i" * 16) == (entry, Direction.FORWARD)
    assert table.lookup(hop.next_peer_id, hop.out_path_id) == (entry, Direction.BACKWARD)
    assert table.lookup(B, b"i" * 16) is None  # the same ID on another link is another path
    assert table.lookup(A, b"j" * 16) is None


def test_a_reply_tag_leads_back_to_its_path_only_from_its_model_node():
    table = RelayTable()
    entry = table.add(A, b"i" * 16, _hop(proxy=True), now=0.0)
    assert table.add_reply_tag(b"t" * 16, entry, B, 0.0, ttl=10.0, replies=2)
    assert table.take_reply(b"t" * 16, C, 1.0) is None  # another peer: refused
    assert table.take_reply(b"u" * 16, B, 1.0) is None  # unknown tag
    assert table.take_reply(b"t" * 16, B, 1.0) is entry
    assert table.take_reply(b"t" * 16, B, 2.0) is entry
    assert table.take_reply(b"t" * 16, B, 3.0) is None  # budget spent


def test_reply_tags_expire_and_go_with_their_path():
    table = RelayTable()
    entry = table.add(A, b"i" * 16, _hop(proxy=True), now=0.0)
    table.add_reply_tag(b"t" * 16, entry, B, 0.0, ttl=10.0, replies=2)
    assert table.take_reply(b"t" * 16, B, 10.0) is None  # expired
    table.add_reply_tag(b"v" * 16, entry, B, 0.0, ttl=10.0, replies=2)
    table.remove(entry)
    assert table.take_reply(b"v" * 16, B, 1.0) is None
    assert not entry.tags


def test_reply_tags_are_bounded_per_path_oldest_first_and_never_reused():
    table = RelayTable()
    entry = table.add(A, b"i" * 16, _hop(proxy=True), now=0.0)
    assert table.add_reply_tag(b"1" * 16, entry, B, 0.0, ttl=10.0, replies=1, max_per_path=2)
    assert not table.add_reply_tag(b"1" * 16, entry, B, 0.0, ttl=10.0, replies=1, max_per_path=2)
    assert table.add_reply_tag(b"2" * 16, entry, B, 0.0, ttl=10.0, replies=1, max_per_path=2)
    assert table.add_reply_tag(b"3" * 16, entry, B, 0.0, ttl=10.0, replies=1, max_per_path=2)
    assert table.take_reply(b"1" * 16, B, 1.0) is None  # the oldest made room
    assert table.take_reply(b"3" * 16, B, 1.0) is entry
    assert list(entry.tags) == [b"2" * 16]  # a spent tag is forgotten at once


def test_duplicate_incoming_path_id_and_full_table_are_refused():
    table = RelayTable(max_entries=2)
    table.add(A, b"i" * 16, _hop(), now=0.0)
    with pytest.raises(RemoteProtocolError, match="in use"):
        table.add(A, b"i" * 16, _hop(), now=0.0)
    table.add(A, b"j" * 16, _hop(), now=0.0)
    with pytest.raises(RemoteProtocolError, match="full"):
        table.add(B, b"k" * 16, _hop(), now=0.0)


def test_remove_peer_drops_paths_on_both_sides_of_it():
    table = RelayTable()
    e1 = table.add(A, b"1" * 16, _hop(next_peer=C), now=0.0)
    e2 = table.add(B, b"2" * 16, _hop(next_peer=A), now=0.0)
    e3 = table.add(B, b"3" * 16, _hop(next_peer=C), now=0.0)
    gone = table.remove_peer(A)
    assert set(map(id, gone)) == {id(e1), id(e2)}
    assert table.lookup(B, b"3" * 16) == (e3, Direction.FORWARD)


def test_idle_entries_expire_and_touched_ones_stay():
    table = RelayTable()
    old = table.add(A, b"1" * 16, _hop(), now=0.0)
    fresh = table.add(A, b"2" * 16, _hop(), now=0.0)
    table.touch(fresh, 50.0)
    assert table.expire(now=100.0, idle_timeout=60.0) == [old]
    assert table.lookup(A, b"2" * 16) is not None


@given(users=st.integers(3, 40), count=st.integers(1, 6), seed=st.integers(0, 2**32))
@settings(max_examples=100, deadline=None)
def test_relays_are_distinct_per_path_and_disjoint_when_enough_users(users, count, seed):
    candidates = [bytes([i]) * 4 for i in range(users)]
    paths = choose_relays(candidates, count, 3, rng=random.Random(seed))
    assert len(paths) == count
    for path in paths:
        assert len(path) == 3 and len(set(path)) == 3
    if users >= 3 * count:
        assert reuse_count(paths) == 0
    else:
        # little reuse: every relay used at most once more than an even spread would
        # (distinct proxies come first)
        flat = [r for p in paths for r in p]
        most = max(flat.count(r) for r in set(flat))
        assert most <= -(-3 * count // users) + 1


def test_relays_already_in_use_are_avoided_while_others_remain():
    candidates = [bytes([i]) * 4 for i in range(7)]
    busy = {c: 1 for c in candidates[:4]}
    (path,) = choose_relays(candidates, 1, 3, rng=random.Random(1), in_use=busy)
    assert set(path) == set(candidates[4:])


def test_too_few_candidates_is_a_directory_error():
    with pytest.raises(DirectoryError):
        choose_relays([b"a", b"b"], 1, 3, rng=random.Random(0))


@given(users=st.integers(4, 30), count=st.integers(1, 6), seed=st.integers(0, 2**32))
@settings(max_examples=100, deadline=None)
def test_proxies_are_distinct_across_paths_while_relays_allow(users, count, seed):
    candidates = [bytes([i]) * 4 for i in range(users)]
    paths = choose_relays(candidates, count, 3, rng=random.Random(seed))
    proxies = [p[-1] for p in paths]
    if users >= count:
        assert len(set(proxies)) == len(proxies)


def test_one_predecessor_cannot_take_the_whole_table():
    table = RelayTable(max_entries=10, max_per_peer=2)
    first = table.add(A, b"1" * 16, _hop(), now=0.0)
    table.add(A, b"2" * 16, _hop(), now=0.0)
    with pytest.raises(RemoteProtocolError, match="one peer"):
        table.add(A, b"3" * 16, _hop(), now=0.0)
    table.add(B, b"3" * 16, _hop(), now=0.0)  # other peers still get in
    table.remove(first)
    table.add(A, b"4" * 16, _hop(), now=0.0)  # and a freed slot is usable again


def test_peers_outside_the_directory_share_a_small_pool_per_peer_per_network_and_in_total():
    table = RelayTable(max_entries=100, max_unlisted=5, max_unlisted_per_peer=2,
                       max_unlisted_per_origin=3)
    ids = iter(bytes([i]) * 16 for i in range(100))
    table.add(A, next(ids), _hop(), now=0.0, listed=False, origin="net-1")
    table.add(A, next(ids), _hop(), now=0.0, listed=False, origin="net-1")
    with pytest.raises(RemoteProtocolError, match="one peer outside the directory"):
        table.add(A, next(ids), _hop(), now=0.0, listed=False, origin="net-2")
    table.add(B, next(ids), _hop(), now=0.0, listed=False, origin="net-1")
    with pytest.raises(RemoteProtocolError, match="one network outside the directory"):
        table.add(b"peer-d", next(ids), _hop(), now=0.0, listed=False, origin="net-1")
    table.add(b"peer-d", next(ids), _hop(), now=0.0, listed=False, origin=None)
    last = table.add(b"peer-e", next(ids), _hop(), now=0.0, listed=False, origin="net-2")
    with pytest.raises(RemoteProtocolError, match="peers outside the directory"):
        table.add(b"peer-f", next(ids), _hop(), now=0.0, listed=False, origin="net-3")
    assert table.unlisted_count == 5
    table.add(C, next(ids), _hop(), now=0.0)  # a listed predecessor still gets in
    table.remove(last)
    table.add(b"peer-f", next(ids), _hop(), now=0.0, listed=False, origin="net-3")


@pytest.mark.parametrize("listed_peers, share", [(1, 50), (4, 25), (10, 10), (1000, 3)])
def test_a_listed_predecessor_holds_at_most_its_share_of_the_table(listed_peers, share):
    table = RelayTable(max_entries=100, max_per_peer=50, min_share=3)
    assert table.listed_share(listed_peers) == share
    for i in range(share):
        table.add(A, bytes([i]) * 16, _hop(), now=0.0, share=table.listed_share(listed_peers))
    with pytest.raises(RemoteProtocolError, match="one peer"):
        table.add(A, b"x" * 16, _hop(), now=0.0, share=table.listed_share(listed_peers))
