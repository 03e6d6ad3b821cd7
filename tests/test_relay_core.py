"""The overlay's pure core (ps_p2p.overlay.relay.RelayCore) on injected time, no hosts."""

from __future__ import annotations

import os
import pickle

import pytest

from ps_p2p.crypto import onion
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.overlay import relay as r

ME, PREV, NEXT, MODEL, USER, STRANGER = (bytes([i]) * 38 for i in range(1, 7))


class FakeCodec:
    """Payloads as pickles (the core must not care about the wire form)."""

    def encode_forward(self, message):
        return pickle.dumps(message)

    def decode_forward(self, data):
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise RemoteProtocolError(f"bad payload: {exc}") from exc

    encode_backward = encode_forward
    decode_backward = decode_forward

    def tamper_clove(self, clove):
        return clove[::-1]


def _core(**config) -> tuple[r.RelayCore, onion.OnionKeyPair]:
    key = onion.OnionKeyPair.generate()
    core = r.RelayCore(
        ME, key, FakeCodec(), r.RelayConfig(**config),
        is_model_node=lambda peer: peer == MODEL,
        is_user=lambda peer: peer in (USER, PREV),
        verify_reply=lambda peer, clove, sig: sig == b"good",
    )
    return core, key


def _proxy_path(core_key, now=0.0, core=None):
    """A one-hop path whose proxy is the core; returns the user's path and the core's ack."""
    path, packet = onion.create_path([onion.HopSpec(ME, core_key.public)])
    out = core.receive_setup(PREV, path.first_path_id, packet, now)
    assert out == [r.SendSetupReply(PREV, path.first_path_id, True, ack=out[0].ack)]
    path.check_ack(out[0].ack)
    return path


def test_a_proxy_acknowledges_a_setup_at_once():
    core, key = _core()
    _proxy_path(key, core=core)
    assert core.stats.setups_relayed == 1 and len(core.table) == 1


def test_a_relay_forwards_the_setup_and_passes_the_reply_back():
    core, key = _core()
    nxt = onion.OnionKeyPair.generate()
    path, packet = onion.create_path(
        [onion.HopSpec(ME, key.public), onion.HopSpec(NEXT, nxt.public)]
    )
    (send,) = core.receive_setup(PREV, path.first_path_id, packet, now=0.0)
    assert isinstance(send, r.SendSetup) and send.peer == NEXT
    hop, _ = onion.process_setup(nxt, send.packet)
    (reply,) = core.receive_setup_reply(NEXT, send.path_id, True, hop.make_ack(), "", now=0.1)
    assert reply.peer == PREV and reply.ok
    path.check_ack(reply.ack)


@pytest.mark.parametrize("answered_at, expect_failure", [(None, True), (1.0, False)])
def test_a_setup_the_next_hop_never_answers_fails_at_its_deadline(answered_at, expect_failure):
    core, key = _core(setup_timeout=5.0)
    nxt = onion.OnionKeyPair.generate()
    path, packet = onion.create_path(
        [onion.HopSpec(ME, key.public), onion.HopSpec(NEXT, nxt.public)]
    )
    (send,) = core.receive_setup(PREV, path.first_path_id, packet, now=0.0)
    assert core.next_deadline() == 5.0
    if answered_at is not None:
        hop, _ = onion.process_setup(nxt, send.packet)
        core.receive_setup_reply(NEXT, send.path_id, True, hop.make_ack(), "", now=answered_at)
    out = core.tick(now=5.0)
    failures = [c for c in out if isinstance(c, r.SendSetupReply) and not c.ok]
    assert bool(failures) is expect_failure
    assert len(core.table) == (0 if expect_failure else 1)


def test_a_replayed_setup_is_refused_but_junk_is_never_remembered():
    core, key = _core()
    path, packet = onion.create_path([onion.HopSpec(ME, key.public)])
    junk = packet[:32] + bytes(len(packet) - 32)  # the same ephemeral key, a broken layer
    (refused,) = core.receive_setup(PREV, b"j" * 16, junk, now=0.0)
    assert not refused.ok and refused.error == "bad setup packet"
    (ok,) = core.receive_setup(PREV, path.first_path_id, packet, now=0.0)
    assert ok.ok  # junk with its ephemeral key did not block the real packet
    (replayed,) = core.receive_setup(PREV, b"k" * 16, packet, now=0.0)
    assert not replayed.ok and core.stats.setups_replayed == 1


def test_outsiders_cannot_fill_the_table_a_listed_user_needs():
    """Issue 16 (HIGH 5): ten identities outside the directory filled a relay's table."""
    listed = {USER, PREV}
    key = onion.OnionKeyPair.generate()
    core = r.RelayCore(
        ME, key, FakeCodec(),
        r.RelayConfig(max_relay_entries=100, max_relay_entries_per_peer=50,
                      max_unlisted_entries=20, max_unlisted_per_peer=4),
        is_user=lambda peer: peer in listed, user_count=lambda: len(listed),
    )
    spec = [onion.HopSpec(ME, key.public)]
    accepted = 0
    for i in range(200):
        outsider = bytes([100 + i % 10]) * 38
        path, packet = onion.create_path(spec)
        (reply,) = core.receive_setup(outsider, path.first_path_id, packet, now=0.0)
        accepted += reply.ok
    assert accepted == 20 and core.table.unlisted_count == 20
    assert core.stats.setups_over_share == 180
    for _ in range(5):
        path, packet = onion.create_path(spec)
        (reply,) = core.receive_setup(USER, path.first_path_id, packet, now=0.0)
        assert reply.ok


def test_a_setup_over_its_share_is_refused_before_the_packet_is_opened():
    core, key = _core(max_unlisted_per_peer=1)
    _proxy_path(key, core=core)  # PREV is listed
    path, packet = onion.create_path([onion.HopSpec(ME, key.public)])
    (first,) = core.receive_setup(STRANGER, path.first_path_id, packet, now=0.0)
    assert first.ok
    junk = bytes(onion.SETUP_PACKET_BYTES)  # would fail as "bad setup packet" if opened
    (second,) = core.receive_setup(STRANGER, b"n" * 16, junk, now=0.0)
    assert not second.ok and "outside the directory" in second.error
    assert core.stats.setups_over_share == 1


def _timed_core(**config):
    key = onion.OnionKeyPair.generate()
    core = r.RelayCore(ME, key, FakeCodec(), r.RelayConfig(**config),
                       is_user=lambda peer: peer in (USER, PREV),
                       wall_clock=lambda now: 1_790_000_000 + now)
    return core, key


@pytest.mark.parametrize("issued_at, ok", [
    (1_790_000_000, True), (1_790_000_000 - 119, True), (1_790_000_000 + 119, True),
    (1_790_000_000 - 121, False), (1_790_000_000 + 121, False), (0, False),
])
def test_a_setup_issued_outside_the_window_is_refused(issued_at, ok):
    core, key = _timed_core(setup_window=120.0)
    _, packet = onion.create_path([onion.HopSpec(ME, key.public)], issued_at=issued_at)
    (reply,) = core.receive_setup(PREV, b"p" * 16, packet, now=0.0)
    assert reply.ok is ok and core.stats.setups_stale == (not ok)


def test_a_captured_setup_stays_refused_after_a_flood_of_valid_setups():
    """Issue 16: 200k valid setups flushed the replay cache, then a captured setup passed."""
    core, key = _timed_core(setup_window=120.0, max_relay_entries_per_peer=100_000,
                            max_relay_entries=100_000)
    spec = [onion.HopSpec(ME, key.public)]
    _, captured = onion.create_path(spec, issued_at=1_790_000_000)
    assert core.receive_setup(PREV, b"c" * 16, captured, now=0.0)[0].ok
    accepted = 0
    for i in range(r.MAX_SETUPS_PER_PEER + 10):  # the flooder's quota runs out, not the cache
        _, packet = onion.create_path(spec, issued_at=1_790_000_000)
        accepted += core.receive_setup(USER, bytes([i % 256, i // 256]) * 8, packet, 1.0)[0].ok
    assert accepted == r.MAX_SETUPS_PER_PEER and core.stats.setups_throttled == 10
    (again,) = core.receive_setup(STRANGER, b"d" * 16, captured, now=2.0)
    assert not again.ok and core.stats.setups_replayed == 1
    # forgotten after twice the window, when the issue time refuses it instead
    (late,) = core.receive_setup(STRANGER, b"e" * 16, captured, now=241.0)
    assert not late.ok and core.stats.setups_stale == 1
    _, fresh = onion.create_path(spec, issued_at=1_790_000_241)
    assert core.receive_setup(USER, b"f" * 16, fresh, now=241.0)[0].ok  # quota back


@pytest.mark.parametrize("peers, config, accepted", [
    ([USER, PREV, USER, PREV], dict(max_remembered_setups=3), 3),  # full: refuse, never forget
    ([STRANGER] * 4, dict(max_setups_per_unlisted_peer=2), 2),
    ([STRANGER, bytes([9]) * 38, bytes([10]) * 38], dict(max_setups_unlisted=2), 2),
])
def test_the_replay_cache_refuses_setups_beyond_its_quotas_instead_of_forgetting(
    peers, config, accepted
):
    core, key = _timed_core(**config)
    spec = [onion.HopSpec(ME, key.public)]
    packets = [onion.create_path(spec, issued_at=1_790_000_000)[1] for _ in peers]
    oks = [core.receive_setup(peer, bytes([i]) * 16, packet, now=0.0)[0].ok
           for i, (peer, packet) in enumerate(zip(peers, packets))]
    assert oks.count(True) == accepted and core.stats.setups_throttled == len(peers) - accepted
    (replay,) = core.receive_setup(USER, b"r" * 16, packets[0], now=1.0)
    assert not replay.ok and core.stats.setups_replayed == 1


def test_a_proxy_drops_a_replayed_cell_without_answering():
    core, key = _core()
    path = _proxy_path(key, core=core)
    cell = path.seal_forward(pickle.dumps(r.Probe(7)))
    assert len(core.receive_cell(PREV, path.first_path_id, cell, 1.0)) == 1
    for _ in range(3):
        assert core.receive_cell(PREV, path.first_path_id, cell, 2.0) == []
    assert core.stats.cells_dropped_by == {r.DROP_REPLAYED_CELL: 3}


def test_own_setups_carry_the_wall_clock_as_issue_time():
    core, _ = _timed_core()
    relay_key = onion.OnionKeyPair.generate()
    _, (send,) = core.open_path([onion.HopSpec(NEXT, relay_key.public)], "t", now=5.0)
    hop, _ = onion.process_setup(relay_key, send.packet)
    assert hop.issued_at == 1_790_000_005


def test_a_bad_path_id_is_a_protocol_error_of_the_frame():
    core, _ = _core()
    with pytest.raises(RemoteProtocolError):
        core.receive_setup(PREV, b"short", bytes(onion.SETUP_PACKET_BYTES), now=0.0)


@pytest.mark.parametrize(
    "message, expected",
    [
        (r.Probe(7), r.Probe(7)),
        (r.DeliverClove(STRANGER, b"clove", b"t" * 16), r.DeliveryFailed("destination is no model node")),
        (r.DeliverClove(USER, b"clove", b"t" * 16), r.DeliveryFailed("destination is no model node")),
    ],
)
def test_a_proxy_answers_probes_and_refuses_deliveries_to_non_model_nodes(message, expected):
    core, key = _core()
    path = _proxy_path(key, core=core)
    (back,) = core.receive_cell(PREV, path.first_path_id, path.seal_forward(pickle.dumps(message)), 1.0)
    assert isinstance(back, r.SendCell) and back.peer == PREV
    assert pickle.loads(path.open_backward(back.payload)) == expected
    assert core.table.tag_count == 0  # no tag registered for a node that is no model node
    refused = {} if isinstance(message, r.Probe) else {r.REFUSE_NO_MODEL_NODE: 1}
    assert core.stats.deliveries_refused_by == refused and core.stats.cloves_proxied == 0


def test_a_delivery_to_a_model_node_registers_its_reply_tag():
    core, key = _core()
    path = _proxy_path(key, core=core)
    deliver = r.DeliverClove(MODEL, b"clove", b"t" * 16)
    (out,) = core.receive_cell(PREV, path.first_path_id, path.seal_forward(pickle.dumps(deliver)), 1.0)
    assert out == r.SendDelivery(MODEL, b"clove", PREV, path.first_path_id, b"t" * 16)
    assert core.table.tag_count == 1 and core.stats.cloves_proxied == 1
    # the model node could not be reached: the user hears of it
    (failed,) = core.send_failed(out, 1.0)
    assert pickle.loads(path.open_backward(failed.payload)) == r.DeliveryFailed(
        "proxy could not reach the model node", b"t" * 16
    )


def test_a_malformed_payload_costs_that_cell_only():
    core, key = _core()
    path = _proxy_path(key, core=core)
    assert core.receive_cell(PREV, path.first_path_id, path.seal_forward(b"not a pickle"), 1.0) == []
    assert core.receive_cell(PREV, path.first_path_id, b"\x00" * 100, 1.0) == []  # fails the AEAD
    assert core.stats.cells_dropped_by == {r.DROP_BAD_CELL: 2} and len(core.table) == 1
    assert core.stats.cells_dropped == 2


def test_a_cell_on_an_unknown_path_is_dropped_and_counted_by_its_reason():
    core, _ = _core()
    assert core.receive_cell(PREV, b"p" * 16, b"\x00" * 100, 1.0) == []
    assert core.stats.cells_dropped_by == {r.DROP_UNKNOWN_PATH: 1}


@pytest.mark.parametrize(
    "sender, tag, signature, passes, dropped",
    [
        (MODEL, b"t" * 16, b"good", True, None),
        (MODEL, b"t" * 16, b"bad", False, r.DROP_BAD_REPLY_SIGNATURE),  # the model node's own
        (STRANGER, b"t" * 16, b"good", False, r.DROP_UNKNOWN_REPLY_TAG),  # another peer
        (MODEL, b"u" * 16, b"good", False, r.DROP_UNKNOWN_REPLY_TAG),  # an unknown tag
    ],
)
def test_replies_pass_only_under_a_live_tag_from_its_model_node_with_its_signature(
    sender, tag, signature, passes, dropped
):
    core, key = _core()
    path = _proxy_path(key, core=core)
    deliver = r.DeliverClove(MODEL, b"clove", b"t" * 16)
    core.receive_cell(PREV, path.first_path_id, path.seal_forward(pickle.dumps(deliver)), 1.0)
    out = core.receive_reply(sender, tag, b"answer", signature, now=2.0)
    assert bool(out) is passes
    if passes:
        assert pickle.loads(path.open_backward(out[0].payload)) == r.SignedClove(
            b"answer", b"good", b"t" * 16
        )
        assert core.receive_reply(MODEL, tag, b"answer", b"good", now=3.0) == []  # spent
    else:
        assert core.table.tag_count == 1  # a refused reply spends nothing
        assert core.stats.cells_dropped_by == {dropped: 1}


@pytest.mark.parametrize(
    "serves_model, sender, refused",
    [(True, USER, None), (True, STRANGER, r.REFUSE_NOT_USER), (False, USER, r.REFUSE_NOT_SERVING)],
)
def test_model_nodes_accept_deliveries_only_from_directory_users(serves_model, sender, refused):
    core, _ = _core(serves_model=serves_model)
    out = core.receive_delivery(sender, b"clove", now=0.0)
    assert out == ([] if refused else [r.DeliverToModel(sender, b"clove")])
    assert core.stats.deliveries_refused_by == ({refused: 1} if refused else {})
    assert core.stats.deliveries == (0 if refused else 1)


@pytest.mark.parametrize("connected, lost", [(True, 0), (False, 1)])
def test_a_failed_stream_drops_paths_only_when_the_connection_is_gone(connected, lost):
    core, key = _core()
    _proxy_path(key, core=core)
    core.link_failed(PREV, "reset", connected, now=1.0)
    assert len(core.table) == 1 - lost
    assert core.stats.paths_lost_to_link_down == lost


def test_own_path_ready_then_cells_both_ways():
    core, _ = _core()
    proxy_key = onion.OnionKeyPair.generate()
    own, (setup,) = core.open_path([onion.HopSpec(NEXT, proxy_key.public)], "token", now=0.0)
    hop, _ = onion.process_setup(proxy_key, setup.packet)
    assert core.receive_setup_reply(NEXT, setup.path_id, True, hop.make_ack(), "", 0.1) == [
        r.PathReady("token")
    ]
    (cell,) = core.send_on_path(own, r.Probe(1), now=0.2)
    assert pickle.loads(hop.open_forward(cell.payload)) == r.Probe(1)
    back = hop.seal_backward(pickle.dumps(r.Probe(1)))
    assert core.receive_cell(NEXT, setup.path_id, back, 0.3) == [r.BackwardReceived("token", r.Probe(1))]


def test_own_path_setup_times_out():
    core, _ = _core(setup_timeout=2.0)
    proxy_key = onion.OnionKeyPair.generate()
    core.open_path([onion.HopSpec(NEXT, proxy_key.public)], "token", now=0.0)
    assert core.tick(now=3.9) == []
    assert core.tick(now=4.0) == [r.PathFailed("token", "setup timed out", False)]


def test_idle_entries_and_tags_expire_at_the_deadline_the_core_announces():
    core, key = _core(relay_idle_timeout=10.0, reply_tag_ttl=4.0)
    path = _proxy_path(key, core=core)
    deliver = r.DeliverClove(MODEL, b"clove", b"t" * 16)
    core.receive_cell(PREV, path.first_path_id, path.seal_forward(pickle.dumps(deliver)), 1.0)
    assert core.next_deadline() == 5.0  # the tag
    core.tick(5.0)
    assert core.table.tag_count == 0 and core.next_deadline() == 11.0  # the idle entry
    core.tick(11.0)
    assert len(core.table) == 0 and core.next_deadline() is None


def test_own_setup_deadlines_grow_when_measured_setups_are_slow():
    core, _ = _core(setup_timeout=1.0)
    proxy_key = onion.OnionKeyPair.generate()
    for i in range(4):  # every setup takes 1.8 s, close to the 2 s floor of a 1-hop path
        own, (setup,) = core.open_path([onion.HopSpec(NEXT, proxy_key.public)], i, now=10.0 * i)
        hop, _ = onion.process_setup(proxy_key, setup.packet)
        core.receive_setup_reply(NEXT, setup.path_id, True, hop.make_ack(), "", 10.0 * i + 1.8)
    own, _ = core.open_path([onion.HopSpec(NEXT, proxy_key.public)], "slow", now=100.0)
    assert own.deadline - 100.0 > 2.0  # more than the floor: SRTT + 4 RTTVAR of the samples
    fresh, _ = _core(setup_timeout=1.0)
    own, _ = fresh.open_path([onion.HopSpec(NEXT, proxy_key.public)], "t", now=0.0)
    assert own.deadline == 2.0  # no samples yet: the floor


def test_a_dead_first_hops_setup_timeouts_lengthen_no_other_first_hops_deadline():
    """Issue 20: one shared own-setup timer doubled on every timeout (20, 20, 20, 26, 52,
    100 s), whoever caused it; RFC 6298 keeps the back-off per destination."""
    core, _ = _core(setup_timeout=5.0)
    key = onion.OnionKeyPair.generate()
    dead, alive = b"dead-first-hop", b"live-first-hop"
    for i in range(4):
        own, _ = core.open_path([onion.HopSpec(dead, key.public)] * 3, i, now=100.0 * i)
        core.tick(now=own.deadline)  # the frozen first hop never answers
    own, _ = core.open_path([onion.HopSpec(alive, key.public)] * 3, "other", now=1000.0)
    assert own.deadline - 1000.0 == 20.0  # the floor: setup_timeout * (hops + 1)
    again, _ = core.open_path([onion.HopSpec(dead, key.public)] * 3, "again", now=2000.0)
    assert again.deadline - 2000.0 > 20.0  # the dead first hop's own setups back off
    assert core.own_setup_timeout(alive, 3) == 20.0


def _relayed_core(relayed: set[bytes], **config) -> tuple[r.RelayCore, onion.OnionKeyPair]:
    key = onion.OnionKeyPair.generate()
    core = r.RelayCore(
        ME, key, FakeCodec(), r.RelayConfig(**config),
        is_user=lambda peer: peer in (USER, PREV), is_relayed=lambda peer: peer in relayed,
    )
    return core, key


def _forward_setup(core, key, now):
    """``core`` relays a two-hop setup from PREV to NEXT; returns the SendSetup and NEXT's key."""
    nxt = onion.OnionKeyPair.generate()
    _, packet = onion.create_path([onion.HopSpec(ME, key.public), onion.HopSpec(NEXT, nxt.public)])
    (send,) = core.receive_setup(PREV, os.urandom(16), packet, now)
    assert isinstance(send, r.SendSetup)
    return send, nxt


@pytest.mark.parametrize(
    "relayed, samples, expected",
    [
        ((), (), 5.0),  # direct successor: the floor
        ((NEXT,), (), 15.0),  # through a relay: relayed_hop_factor (3) times the floor
        ((NEXT,), (0.5,), 5.0),  # one fast measured setup: the floor again (RFC 6298 2.2)
        ((NEXT,), (4.0,), 12.0),  # a slow one: SRTT + 4 RTTVAR = 4 + 8
        ((), (4.0,), 12.0),  # measurements rule alike for a direct successor
    ],
)
def test_a_relayed_next_hops_setup_deadline_starts_at_three_times_the_floor(
        relayed, samples, expected):
    """Issue 20: the first contact with a NATed next hop is a circuit through its relay and
    then Noise, Yamux and multistream over two legs; the 5 s floor failed most such setups."""
    core, key = _relayed_core(set(relayed), setup_timeout=5.0)
    now = 0.0
    for rtt in samples:  # answered setups to NEXT measure it
        send, nxt = _forward_setup(core, key, now)
        hop, _ = onion.process_setup(nxt, send.packet)
        core.receive_setup_reply(NEXT, send.path_id, True, hop.make_ack(), "", now + rtt)
        now += 100.0
    core.tick(now)  # clears the answered setups' heap entries
    assert core.next_hop_timeout(NEXT) == expected
    send, _ = _forward_setup(core, key, now)
    assert core.next_deadline() == now + expected
    failed = [c for c in core.tick(now + expected - 0.01) if isinstance(c, r.SendSetupReply)]
    assert failed == []  # still waiting just before the deadline
    failed = [c for c in core.tick(now + expected) if isinstance(c, r.SendSetupReply)]
    assert [c.ok for c in failed] == [False]


def test_a_relayed_next_hops_timeout_backs_off_from_its_own_start():
    core, key = _relayed_core({NEXT}, setup_timeout=5.0)
    _forward_setup(core, key, 0.0)
    core.tick(15.0)  # unanswered: RFC 6298 5.5 doubles the relayed start, not the floor
    assert core.next_hop_timeout(NEXT) == 30.0
    assert core.next_hop_timeout(b"direct-peer") == 5.0


@pytest.mark.parametrize(
    "relayed_hops, expected",
    [(0, 20.0), (1, 30.0), (2, 40.0), (3, 50.0)],  # 5 * (3 + 1) + 10 per relayed hop
)
def test_an_own_setup_gets_more_time_per_hop_reached_through_a_relay(relayed_hops, expected):
    hops = [b"hop-a" * 4, b"hop-b" * 4, b"hop-c" * 4]
    core, _ = _relayed_core(set(hops[:relayed_hops]), setup_timeout=5.0)
    key = onion.OnionKeyPair.generate()
    own, _ = core.open_path([onion.HopSpec(h, key.public) for h in hops], "t", now=100.0)
    assert own.deadline - 100.0 == expected
    assert core.own_setup_timeout(hops[0], 3, relayed_hops) == expected


# ------------------------------------------------------------------ own address changed

A_HOP, B_HOP, C_HOP = (bytes([0x40 + i]) * 38 for i in range(3))
X, Y, Z = (bytes([0x50 + i]) * 38 for i in range(3))


def _moving_core(connected: int, **config) -> r.RelayCore:
    key = onion.OnionKeyPair.generate()
    return r.RelayCore(ME, key, FakeCodec(), r.RelayConfig(setup_timeout=5.0, **config),
                       connected_peers=lambda: connected)


def _open(core, token, now, first=A_HOP):
    key = onion.OnionKeyPair.generate()
    hops = [onion.HopSpec(h, key.public) for h in (first, B_HOP, C_HOP)]
    own, _ = core.open_path(hops, token, now)
    return own


def _failed(commands):
    return [c for c in commands if isinstance(c, r.PathFailed)]


def test_a_node_whose_links_all_died_at_once_abandons_its_setups_in_flight():
    # its NAT took a new public IP: the links to X, Y, Z (all it had) closed within 2 s; the
    # replies of the setups it sent before go to its old address: they are given up at once
    # and blamed on nobody, not waited for until their 20 s deadlines
    core = _moving_core(connected=0)
    first, second = _open(core, "one", 0.0), _open(core, "two", 0.5, first=B_HOP)
    assert core.link_failed(X, "reset", False, now=1.0) == []
    assert core.link_failed(Y, "reset", False, now=2.0) == []
    out = core.link_failed(Z, "reset", False, now=3.0)
    assert out[0] == r.AddressChanged(3.0, since=1.0)
    abandoned = "abandoned: own address changed"
    assert _failed(out) == [r.PathFailed("one", abandoned, False, False, True),
                            r.PathFailed("two", abandoned, False, False, True)]
    assert r.SendDestroy(first.path.first_hop, first.path.first_path_id, "abandoned") in out
    assert r.SendDestroy(second.path.first_hop, second.path.first_path_id, "abandoned") in out
    assert core.own_paths() == [] and core.moves == 1


@pytest.mark.parametrize(
    "connected, losses",
    [(10, 3), (0, 2)],
    ids=["three-of-thirteen-peers-lost", "two-peers-lost"],
)
def test_a_few_lost_links_are_no_address_change(connected, losses):
    core = _moving_core(connected=connected)
    _open(core, "one", 0.0)
    for i, peer in enumerate((X, Y, Z)[:losses]):
        assert core.link_failed(peer, "reset", False, now=1.0 + i) == []
    assert len(core.own_paths()) == 1 and core.moves == 0


def test_links_lost_further_apart_than_the_window_are_no_address_change():
    core = _moving_core(connected=0, moved_window=5.0)
    _open(core, "one", 0.0)
    for now, peer in ((1.0, X), (4.0, Y), (9.5, Z)):  # X left the window before Z went
        assert core.link_failed(peer, "reset", False, now=now) == []
    assert core.moves == 0


def test_a_setup_opened_right_after_an_address_change_is_abandoned_soon_blaming_nobody():
    # a peer closes the old connection of a node that redialled it within 5 s; a reply written
    # before went onto it and is lost: a setup still unanswered 5 s after that is sent anew
    core = _moving_core(connected=0, moved_settle=5.0)
    core.address_changed(now=10.0)
    early = _open(core, "early", 11.0)
    late = _open(core, "late", 15.5, first=B_HOP)
    assert early.deadline == 20.0  # moved + settle + setup_timeout, not 11 + 20
    assert late.deadline == 15.5 + 20.0  # after the settling time: the normal deadline
    out = core.tick(20.0)
    assert _failed(out) == [
        r.PathFailed("early", "abandoned: unanswered after the address change", False, False, True)
    ]
    assert r.SendDestroy(A_HOP, early.path.first_path_id, "abandoned") in out
    assert core.own_setup_timeout(A_HOP, 3) == 20.0  # its first hop's deadline not backed off


def test_an_address_change_forgets_the_first_hops_setup_backoff():
    core = _moving_core(connected=0)
    _open(core, "one", 0.0)
    assert _failed(core.tick(20.0)) == [r.PathFailed("one", "setup timed out", False)]
    assert core.own_setup_timeout(A_HOP, 3) == 40.0  # doubled: A's setup timed out
    core.address_changed(now=30.0)
    assert core.own_setup_timeout(A_HOP, 3) == 20.0
