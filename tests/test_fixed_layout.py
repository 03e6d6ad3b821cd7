"""The overlay's hot frames without protobuf objects (ps_p2p.protocols.fixed_layout) write the
bytes the schema's generated classes write, and read every input as the schema's parser does."""

from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols import clove_relay, delivery, fixed_layout
from ps_p2p.protocols.framing import encode_frame, encode_varint

#: lengths around the varint boundaries (1, 2 and 3 bytes) and the cell sizes
LENGTHS = [0, 1, 15, 16, 17, 127, 128, 129, 300, 16383, 16384, 16385, 65536]


def _bytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 255, 16383, 16384, 2**21, 2**35, 2**63 - 1])
def test_uvarint_is_the_minimal_varint_and_reads_back(n):
    encoded = fixed_layout.uvarint(n)
    assert encoded == encode_varint(n)
    assert fixed_layout.read_uvarint(encoded + b"\xff", 0, len(encoded)) == (n, len(encoded))


def test_read_uvarint_refuses_non_minimal_truncated_and_overlong():
    assert fixed_layout.read_uvarint(b"\x80\x00", 0, 2) is None  # 0 in two bytes
    assert fixed_layout.read_uvarint(b"\x81\x80\x00", 0, 3) is None
    assert fixed_layout.read_uvarint(b"\x80", 0, 1) is None
    assert fixed_layout.read_uvarint(b"\x80\x80", 0, 2) is None
    assert fixed_layout.read_uvarint(b"\xff" * 9 + b"\x01", 0, 10) is None


def test_cell_encoding_matches_the_generated_classes_byte_for_byte():
    rng = random.Random(1)
    for path_len in (0, 1, 16, 200):
        for payload_len in LENGTHS:
            path_id, payload = _bytes(rng, path_len), _bytes(rng, payload_len)
            expected = clove_pb2.CloveFrame(
                cell=clove_pb2.Cell(path_id=path_id, payload=payload)
            ).SerializeToString()
            assert clove_relay.encode_cell(path_id, payload) == expected
            assert clove_relay.encode_cell_frame(path_id, payload) == encode_frame(expected)


def test_delivery_encodings_match_the_generated_classes_byte_for_byte():
    rng = random.Random(2)
    for clove_len in LENGTHS:
        clove = _bytes(rng, clove_len)
        assert delivery.encode_delivery(clove) == clove_pb2.DeliveryFrame(
            delivery=clove_pb2.Delivery(clove=clove)
        ).SerializeToString()
        for tag_len, sig_len in ((0, 0), (16, 64), (16, 0), (0, 64), (200, 1)):
            tag, sig = _bytes(rng, tag_len), _bytes(rng, sig_len)
            assert delivery.encode_reply(tag, clove, sig) == clove_pb2.DeliveryFrame(
                reply=clove_pb2.Reply(reply_tag=tag, clove=clove, signature=sig)
            ).SerializeToString()


def test_cell_fast_path_takes_the_canonical_layout_and_nothing_else():
    path_id, payload = b"p" * 16, b"x" * 1000
    assert clove_relay.split_cell(clove_relay.encode_cell(path_id, payload)) == (path_id, payload)
    # the same cell with the fields swapped is valid protobuf, but not the canonical layout
    swapped = clove_pb2.Cell(payload=payload).SerializeToString() + clove_pb2.Cell(
        path_id=path_id).SerializeToString()
    frame = b"\x0a" + encode_varint(len(swapped)) + swapped
    assert clove_relay.split_cell(frame) is None
    assert clove_relay.decode(frame) == clove_relay.CellFrame(path_id, payload)


def _schema_clove_frame(data: bytes) -> object:
    """What the generated classes make of ``data`` (the reference)."""
    try:
        frame = clove_pb2.CloveFrame.FromString(data)
    except (DecodeError, ValueError):
        return "refused"
    kind = frame.WhichOneof("kind")
    if kind == "cell":
        return clove_relay.CellFrame(frame.cell.path_id, frame.cell.payload)
    if kind == "destroy":
        return clove_relay.DestroyFrame(frame.destroy.path_id, frame.destroy.reason)
    return "refused"


def _schema_delivery_frame(data: bytes) -> object:
    try:
        frame = clove_pb2.DeliveryFrame.FromString(data)
    except (DecodeError, ValueError):
        return "refused"
    kind = frame.WhichOneof("kind")
    if kind == "delivery":
        return delivery.DeliveryFrame(frame.delivery.clove)
    if kind == "reply":
        r = frame.reply
        return delivery.ReplyFrame(r.reply_tag, r.clove, r.signature)
    return "refused"


def _ours(decode, data: bytes) -> object:
    try:
        return decode(data)
    except RemoteProtocolError:
        return "refused"


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.55 and data:
            del data[rng.randrange(len(data)):]
        elif choice < 0.7:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        elif choice < 0.85 and data:
            i = rng.randrange(len(data))
            del data[i : i + rng.randint(1, 3)]
        else:
            data += rng.randbytes(rng.randint(1, 20))
    return bytes(data)


def _seeds(rng: random.Random) -> list[bytes]:
    seeds = []
    for path_len, payload_len in ((16, 1), (16, 200), (16, 300), (0, 5), (16, 0), (3, 130)):
        seeds.append(clove_relay.encode_cell(rng.randbytes(path_len), rng.randbytes(payload_len)))
    seeds.append(clove_relay.encode_destroy(b"p" * 16, "gone"))
    seeds.append(delivery.encode_delivery(rng.randbytes(150)))
    seeds.append(delivery.encode_reply(rng.randbytes(16), rng.randbytes(140), rng.randbytes(64)))
    seeds.append(delivery.encode_reply(b"", rng.randbytes(3), b""))
    return seeds


def test_decoders_agree_with_the_schema_on_mutated_and_random_frames():
    """Decode-fuzz equivalence: 20,000 mutated encodings and random strings, each decoded as
    the generated classes decode it, or refused where they refuse it."""
    rng = random.Random(22)
    seeds = _seeds(rng)
    fast_cells = 0
    for i in range(20_000):
        if i % 5 == 0:
            data = rng.randbytes(rng.randint(0, 40))
        else:
            data = _mutate(rng, rng.choice(seeds))
        assert _ours(clove_relay.decode, data) == _schema_clove_frame(data), data.hex()
        assert _ours(delivery.decode, data) == _schema_delivery_frame(data), data.hex()
        fast_cells += clove_relay.split_cell(data) is not None
    assert fast_cells > 500  # the fast path was exercised, not only the fallback
