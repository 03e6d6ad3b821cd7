"""``/planetserve/clove/1.0.0``: cells on onion paths, and the end-to-end payloads inside them.

Links that many paths share carry :class:`~ps_p2p.pb.planetserve.v1.clove_pb2.CloveFrame`: a
cell (link-local path ID + layered payload of one size on every link) or a Destroy. A frame
that does not parse resets its stream (the direct neighbour broke the protocol); anything wrong
inside a well-formed cell concerns that cell's path only and is handled by
:class:`ps_p2p.overlay.relay.RelayCore` without touching the stream.

:class:`ProtobufPayloadCodec` is the wire form of what a user and its proxy say to each other
inside cells (``ForwardPayload`` / ``BackwardPayload``), injected into the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError as PbDecodeError

from ps_p2p.crypto import onion
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.overlay.relay import (
    BackwardMessage,
    DeliverClove,
    DeliveryFailed,
    ForwardMessage,
    Probe,
    SignedClove,
)
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols import fixed_layout
from ps_p2p.protocols.framing import encode_frame
from ps_p2p.protocols.wire import parse

CLOVE_PROTOCOL_ID = "/planetserve/clove/1.0.0"
#: Largest clove frame: the biggest cell plus protobuf overhead.
CLOVE_MAX_FRAME = onion.CELL_BUCKETS[-1] + 1024


@dataclass(frozen=True)
class CellFrame:
    path_id: bytes
    payload: bytes


@dataclass(frozen=True)
class DestroyFrame:
    path_id: bytes
    reason: str


def split_cell(data: bytes) -> tuple[bytes, bytes] | None:
    """``(path_id, payload)`` of a cell frame in the schema's canonical layout (both fields
    present), without protobuf objects (:mod:`~ps_p2p.protocols.fixed_layout`); None for any
    other frame (then :func:`decode` it)."""
    n = len(data)
    if n < 6 or data[0] != 0x0A:
        return None
    read = _read_uvarint(data, 1, n)
    if read is None or read[0] + read[1] != n or read[1] == n or data[read[1]] != 0x0A:
        return None
    read = _read_uvarint(data, read[1] + 1, n)
    if read is None or read[0] == 0:
        return None
    start, stop = read[1], read[1] + read[0]
    if stop >= n or data[stop] != 0x12:
        return None
    read = _read_uvarint(data, stop + 1, n)
    if read is None or read[0] == 0 or read[0] + read[1] != n:
        return None
    return data[start:stop], data[read[1]:]


_read_uvarint = fixed_layout.read_uvarint


def decode(data: bytes) -> CellFrame | DestroyFrame:
    """One clove frame (a cell in the canonical layout without protobuf objects).

    Raises:
        RemoteProtocolError: malformed or empty.
    """
    cell = split_cell(data)
    if cell is not None:
        return CellFrame(*cell)
    frame = parse(clove_pb2.CloveFrame, data)
    kind = frame.WhichOneof("kind")
    if kind == "cell":
        return CellFrame(frame.cell.path_id, frame.cell.payload)
    if kind == "destroy":
        return DestroyFrame(frame.destroy.path_id, frame.destroy.reason)
    raise RemoteProtocolError("empty clove frame")


def encode_cell(path_id: bytes, payload: bytes) -> bytes:
    """``CloveFrame{cell}`` as protobuf writes it, without protobuf objects."""
    return fixed_layout.oneof(1, path_id, payload)


def encode_cell_frame(path_id: bytes, payload: bytes) -> bytes:
    """:func:`encode_cell` with the link's length prefix (:func:`~ps_p2p.protocols.framing.
    encode_frame`), written in one join (the payload is copied once): what
    :meth:`~ps_p2p.protocols.links.LinkManager.send_frame` takes."""
    if not path_id or not payload:  # proto3 leaves an empty field out
        return encode_frame(encode_cell(path_id, payload))
    uvarint = fixed_layout.uvarint
    path_len, payload_len = uvarint(len(path_id)), uvarint(len(payload))
    inner = 2 + len(path_len) + len(path_id) + len(payload_len) + len(payload)
    inner_len = uvarint(inner)
    return b"".join((
        uvarint(1 + len(inner_len) + inner), b"\x0a", inner_len,
        b"\x0a", path_len, path_id, b"\x12", payload_len, payload,
    ))


def encode_destroy(path_id: bytes, reason: str) -> bytes:
    return clove_pb2.CloveFrame(
        destroy=clove_pb2.Destroy(path_id=path_id, reason=reason[:200])
    ).SerializeToString()


class ProtobufPayloadCodec:
    """:class:`ps_p2p.overlay.relay.PayloadCodec` over ``ForwardPayload`` / ``BackwardPayload``."""

    def encode_forward(self, message: ForwardMessage) -> bytes:
        return forward_to_pb(message).SerializeToString()

    def decode_forward(self, data: bytes) -> ForwardMessage:
        return forward_from_pb(parse(clove_pb2.ForwardPayload, data))

    def encode_backward(self, message: BackwardMessage) -> bytes:
        return backward_to_pb(message).SerializeToString()

    def decode_backward(self, data: bytes) -> BackwardMessage | None:
        payload = parse(clove_pb2.BackwardPayload, data)
        kind = payload.WhichOneof("kind")
        if kind == "probe_reply":
            return Probe(payload.probe_reply.nonce)
        if kind == "signed_clove":
            s = payload.signed_clove
            return SignedClove(s.clove, s.signature, s.reply_tag)
        if kind == "delivery_failed":
            return DeliveryFailed(payload.delivery_failed, payload.delivery_failed_tag)
        return None  # unsigned cloves are no longer sent; an empty payload says nothing

    def tamper_clove(self, clove: bytes) -> bytes:
        """TEST ONLY: corrupt a clove's fragment, keeping it parseable, so S-IDA's AEAD must
        catch it."""
        message = clove_pb2.Clove()
        try:
            message.ParseFromString(clove)
        except PbDecodeError:
            return _flip_byte(clove)
        message.fragment = _flip_byte(message.fragment)
        return message.SerializeToString()


def forward_to_pb(message: ForwardMessage) -> clove_pb2.ForwardPayload:
    if isinstance(message, Probe):
        return clove_pb2.ForwardPayload(probe=clove_pb2.Probe(nonce=message.nonce))
    return clove_pb2.ForwardPayload(
        deliver=clove_pb2.DeliverClove(
            destination=message.destination, clove=message.clove, reply_tag=message.reply_tag,
            max_replies=message.max_replies,
        )
    )


def forward_from_pb(payload: clove_pb2.ForwardPayload) -> ForwardMessage:
    """Raises RemoteProtocolError: an empty payload."""
    kind = payload.WhichOneof("kind")
    if kind == "probe":
        return Probe(payload.probe.nonce)
    if kind == "deliver":
        d = payload.deliver
        return DeliverClove(d.destination, d.clove, d.reply_tag, d.max_replies)
    raise RemoteProtocolError("empty forward payload")


def backward_to_pb(message: BackwardMessage) -> clove_pb2.BackwardPayload:
    if isinstance(message, Probe):
        return clove_pb2.BackwardPayload(probe_reply=clove_pb2.Probe(nonce=message.nonce))
    if isinstance(message, SignedClove):
        return clove_pb2.BackwardPayload(
            signed_clove=clove_pb2.SignedClove(
                clove=message.clove, signature=message.signature, reply_tag=message.reply_tag
            )
        )
    return clove_pb2.BackwardPayload(
        delivery_failed=message.reason[:200], delivery_failed_tag=message.reply_tag
    )


def _flip_byte(data: bytes) -> bytes:
    if not data:
        return data
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]


__all__ = [
    "CLOVE_MAX_FRAME", "CLOVE_PROTOCOL_ID", "CellFrame", "DestroyFrame", "ProtobufPayloadCodec",
    "backward_to_pb", "decode", "encode_cell", "encode_cell_frame", "encode_destroy",
    "forward_from_pb", "forward_to_pb", "split_cell",
]
