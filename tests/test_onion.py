"""Onion path crypto (ps_p2p.crypto.onion): setup packets, acknowledgements, layered cells."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.crypto import onion
from ps_p2p.errors import CryptoError, LocalProtocolError, RemoteProtocolError


def _keys(n):
    return [onion.OnionKeyPair.generate() for _ in range(n)]


def _peer(i: int) -> bytes:
    return b"\x00\x24\x08\x01\x12\x20" + bytes([i]) * 32


def _setup(keys):
    hops = [onion.HopSpec(_peer(i), k.public) for i, k in enumerate(keys)]
    path, packet = onion.create_path(hops)
    relays, packets = [], [packet]
    for key in keys:
        hop, packet = onion.process_setup(key, packet)
        relays.append(hop)
        if packet is not None:
            packets.append(packet)
    return path, relays, packets


@pytest.mark.parametrize("length", range(1, onion.MAX_HOPS + 1))
def test_each_hop_learns_only_its_successor_and_link_path_ids(length):
    keys = _keys(length)
    path, relays, packets = _setup(keys)
    assert [len(p) for p in packets] == [onion.SETUP_PACKET_BYTES] * length
    for i, hop in enumerate(relays[:-1]):
        assert not hop.is_proxy
        assert hop.next_peer_id == _peer(i + 1)
        assert hop.out_path_id == path.path_ids[i + 1]
    assert relays[-1].is_proxy and relays[-1].next_peer_id is None
    assert relays[-1].out_path_id == path.exit_path_id
    ids = [path.exit_path_id, *path.path_ids]
    assert len(set(ids)) == len(ids)


def test_setup_packet_bytes_differ_on_every_link():
    _, _, packets = _setup(_keys(3))
    for a in range(len(packets)):
        for b in range(a + 1, len(packets)):
            # no 16-byte window of one link's packet reappears on another link
            windows = {packets[a][i : i + 16] for i in range(0, len(packets[a]) - 16)}
            assert not any(packets[b][i : i + 16] in windows for i in range(len(packets[b]) - 16))


def test_setup_slot_opens_only_with_the_right_onion_key():
    keys = _keys(3)
    hops = [onion.HopSpec(_peer(i), k.public) for i, k in enumerate(keys)]
    _, packet = onion.create_path(hops)
    with pytest.raises(CryptoError):
        onion.process_setup(keys[1], packet)
    with pytest.raises(CryptoError):
        onion.process_setup(onion.OnionKeyPair.generate(), packet)


def test_wrong_size_setup_packet_is_a_remote_error():
    with pytest.raises(RemoteProtocolError):
        onion.process_setup(onion.OnionKeyPair.generate(), b"\x00" * 100)


@given(flip=st.integers(0, onion.SLOT_BYTES - 1))
@settings(max_examples=50, deadline=None)
def test_tampered_setup_slot_is_refused(flip):
    key = onion.OnionKeyPair.generate()
    _, packet = onion.create_path([onion.HopSpec(_peer(1), key.public)])
    bad = bytearray(packet)
    bad[flip] ^= 0x01
    with pytest.raises(CryptoError):
        onion.process_setup(key, bytes(bad))


def test_acknowledgement_checks_out_only_along_the_real_path():
    path, relays, _ = _setup(_keys(3))
    ack = relays[2].make_ack()
    ack = relays[1].relay_backward(ack)
    ack = relays[0].relay_backward(ack)
    path.check_ack(ack)
    other_path, other_relays, _ = _setup(_keys(3))
    forged = other_relays[2].make_ack()
    forged = other_relays[1].relay_backward(forged)
    forged = other_relays[0].relay_backward(forged)
    with pytest.raises(CryptoError):
        path.check_ack(forged)


@given(payloads=st.lists(st.binary(max_size=5000), min_size=1, max_size=5))
@settings(max_examples=30, deadline=None)
def test_layers_peel_in_both_directions_and_cell_bytes_differ_per_link(payloads):
    path, relays, _ = _setup(_keys(3))
    for payload in payloads:
        cell = path.seal_forward(payload)
        seen = [cell]
        for hop in relays[:-1]:
            cell = hop.relay_forward(cell)
            seen.append(cell)
        assert relays[-1].open_forward(cell) == payload
        assert len({bytes(c[:32]) for c in seen}) == len(seen)
        back = relays[-1].seal_backward(payload)
        for hop in reversed(relays[:-1]):
            back = hop.relay_backward(back)
        assert path.open_backward(back) == payload


def test_the_payload_opens_only_after_every_relay_layer_in_order():
    path, relays, _ = _setup(_keys(3))
    cell = path.seal_forward(b"secret clove")
    with pytest.raises(CryptoError):
        relays[2].open_forward(cell)  # the proxy cannot skip the relays' layers
    skipped = relays[1].relay_forward(cell)  # the second relay before the first: garbage
    with pytest.raises(CryptoError):
        relays[2].open_forward(relays[0].relay_forward(skipped))


@given(link=st.integers(0, 1), position=st.integers(0, 16 + 1024 + 15))
@settings(max_examples=60, deadline=None)
def test_a_cell_altered_by_a_relay_fails_at_the_proxy_and_later_cells_pass(link, position):
    path, relays, _ = _setup(_keys(3))
    cell = path.seal_forward(b"first")
    for i, hop in enumerate(relays[:-1]):
        cell = hop.relay_forward(cell)
        if i == link:
            altered = bytearray(cell)
            altered[position] ^= 0x01
            cell = bytes(altered)
    with pytest.raises(CryptoError):
        relays[-1].open_forward(cell)
    cell = path.seal_forward(b"second")
    for hop in relays[:-1]:
        cell = hop.relay_forward(cell)
    assert relays[-1].open_forward(cell) == b"second"


def test_a_backward_cell_altered_by_a_relay_fails_at_the_user():
    path, relays, _ = _setup(_keys(3))
    back = relays[1].relay_backward(relays[2].seal_backward(b"answer clove"))
    altered = bytearray(back)
    altered[40] ^= 0x80
    with pytest.raises(CryptoError):
        path.open_backward(relays[0].relay_backward(bytes(altered)))


def test_a_lost_cell_costs_that_cell_not_the_path():
    path, relays, _ = _setup(_keys(3))
    path.seal_forward(b"lost on the first link")
    cell = path.seal_forward(b"arrives")
    for hop in relays[:-1]:
        cell = hop.relay_forward(cell)
    assert relays[-1].open_forward(cell) == b"arrives"


def test_cells_have_one_size_on_every_link_so_no_relay_learns_its_position():
    path, relays, _ = _setup(_keys(3))
    forward = [path.seal_forward(b"x" * 900)]
    for hop in relays[:-1]:
        forward.append(hop.relay_forward(forward[-1]))
    backward = [relays[2].seal_backward(b"y" * 900)]
    for hop in reversed(relays[:-1]):
        backward.append(hop.relay_backward(backward[-1]))
    ack = relays[2].make_ack()
    acks = [ack, relays[1].relay_backward(ack)]
    sizes = {len(c) for c in forward + backward + acks}
    assert sizes == {onion.CELL_IV_BYTES + onion.CELL_BUCKETS[0] + 16}


def test_cells_of_wrong_size_are_refused_by_relays():
    _, relays, _ = _setup(_keys(3))
    with pytest.raises(RemoteProtocolError):
        relays[0].relay_forward(b"\x00" * 1000)
    with pytest.raises(RemoteProtocolError):
        relays[0].relay_backward(b"\x00" * (onion.MAX_CELL_BYTES + 1))


@given(size=st.integers(0, onion.MAX_CELL_PAYLOAD))
@settings(max_examples=30, deadline=None)
def test_padding_hides_the_length_inside_a_bucket(size):
    padded = onion.pad_payload(b"x" * size)
    assert len(padded) in onion.CELL_BUCKETS
    assert onion.unpad_payload(padded) == b"x" * size


def test_oversized_payload_and_bad_padding_are_errors():
    with pytest.raises(LocalProtocolError):
        onion.pad_payload(b"x" * (onion.MAX_CELL_PAYLOAD + 1))
    with pytest.raises(RemoteProtocolError):
        onion.unpad_payload(b"\x00" * 100)
    with pytest.raises(RemoteProtocolError):
        onion.unpad_payload(b"\xff\xff\xff\xff" + b"\x00" * (onion.CELL_BUCKETS[0] - 4))


def test_path_length_and_onion_keys_are_checked():
    with pytest.raises(LocalProtocolError):
        onion.create_path([])
    key = onion.OnionKeyPair.generate()
    with pytest.raises(LocalProtocolError):
        onion.create_path([onion.HopSpec(_peer(i), key.public) for i in range(onion.MAX_HOPS + 1)])
    with pytest.raises(LocalProtocolError):
        onion.create_path([onion.HopSpec(_peer(1), b"short")])


def test_filler_slots_look_like_keystream_bytes_not_like_keys():
    # A real slot 1+ is XORed with keystreams (uniform bits); filler must be uniform too, or a
    # relay could count the filler slots and learn how many hops follow it.
    key = onion.OnionKeyPair.generate()
    top_bits = set()
    for _ in range(64):
        _, packet = onion.create_path([onion.HopSpec(_peer(1), key.public)])
        top_bits.add(packet[onion.SLOT_BYTES * 4 + 31] >> 7)
    assert top_bits == {0, 1}


def test_a_hop_builds_only_the_cipher_objects_of_its_role():
    """Issue 16: a relay table of 10,000 hops cost 161 MB with four AES-GCM objects per hop."""
    key, other = onion.OnionKeyPair.generate(), onion.OnionKeyPair.generate()
    _, packet = onion.create_path([onion.HopSpec(b"a" * 38, key.public),
                                   onion.HopSpec(b"b" * 38, other.public)])
    relay_hop, inner = onion.process_setup(key, packet)
    proxy_hop, _ = onion.process_setup(other, inner)
    assert relay_hop._end_forward is None and relay_hop._end_backward is None
    assert proxy_hop._forward is None and proxy_hop._backward is None
    with pytest.raises(LocalProtocolError):
        proxy_hop.relay_forward(bytes(onion.CELL_IV_BYTES + 1024 + 16))
    with pytest.raises(LocalProtocolError):
        relay_hop.seal_backward(b"x")


def _to_proxy(relays, cell):
    for hop in relays[:-1]:
        cell = hop.relay_forward(cell)
    return cell


def test_the_proxy_refuses_a_replayed_cell_and_one_older_than_its_window():
    """Issue 16: a replayed cell was answered 3 of 3 times (RFC 4303 sec. 3.4.3 window)."""
    from ps_p2p.errors import ReplayError

    path, relays, _ = _setup(_keys(3))
    proxy = relays[-1]
    cells = [_to_proxy(relays, path.seal_forward(b"cell %d" % i))
             for i in range(onion.REPLAY_WINDOW + 2)]
    assert proxy.open_forward(cells[1]) == b"cell 1"
    assert proxy.open_forward(cells[0]) == b"cell 0"  # late, inside the window: accepted
    for replayed in (cells[1], cells[0]):
        with pytest.raises(ReplayError):
            proxy.open_forward(replayed)
    assert proxy.open_forward(cells[-1]) == b"cell %d" % (onion.REPLAY_WINDOW + 1)
    with pytest.raises(ReplayError, match="outside the replay window"):
        proxy.open_forward(cells[1])  # never opened twice, and now too old
    assert proxy.open_forward(cells[2]) == b"cell 2"  # the oldest inside the window
    with pytest.raises(ReplayError):
        proxy.open_forward(cells[-1])


def test_every_hop_learns_the_path_s_issue_time():
    keys = _keys(3)
    hops = [onion.HopSpec(_peer(i), k.public) for i, k in enumerate(keys)]
    _, packet = onion.create_path(hops, issued_at=1_790_000_000)
    for key in keys:
        hop, packet = onion.process_setup(key, packet)
        assert hop.issued_at == 1_790_000_000
