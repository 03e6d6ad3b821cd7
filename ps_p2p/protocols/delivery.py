"""``/planetserve/deliver/1.0.0``: proxy <-> model node, wire form.

A proxy delivers request cloves to a model node (``Delivery``), and the model node sends each
signed response clove to its reply proxy under the request's reply tag (``Reply``), on links of
their own (:class:`~ps_p2p.pb.planetserve.v1.clove_pb2.DeliveryFrame`): a bad delivery can never
reset a relay link that other paths share. Refusals (a sender that is no directory user, a node
that serves no model) drop the delivery and keep the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_p2p import responses
from ps_p2p.crypto import onion
from ps_p2p.errors import PsError, RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols import fixed_layout
from ps_p2p.protocols.wire import parse

DELIVER_PROTOCOL_ID = "/planetserve/deliver/1.0.0"
#: Largest deliver frame: a clove (at most a cell's payload) plus a signature and overhead.
DELIVER_MAX_FRAME = onion.CELL_BUCKETS[-1] + 1024


@dataclass(frozen=True)
class DeliveryFrame:
    clove: bytes


@dataclass(frozen=True)
class ReplyFrame:
    reply_tag: bytes
    clove: bytes
    signature: bytes


def decode(data: bytes) -> DeliveryFrame | ReplyFrame:
    """One deliver frame (in the canonical layout without protobuf objects:
    :mod:`~ps_p2p.protocols.fixed_layout`).

    Raises:
        RemoteProtocolError: malformed or empty.
    """
    read = fixed_layout.read_oneof(data, 3)
    if read is not None:
        kind, (first, second, third) = read
        if kind == 1 and not second and not third:
            return DeliveryFrame(first)
        if kind == 2:
            return ReplyFrame(first, second, third)
    frame = parse(clove_pb2.DeliveryFrame, data)
    kind = frame.WhichOneof("kind")
    if kind == "delivery":
        return DeliveryFrame(frame.delivery.clove)
    if kind == "reply":
        r = frame.reply
        return ReplyFrame(r.reply_tag, r.clove, r.signature)
    raise RemoteProtocolError("empty deliver frame")


def encode_delivery(clove: bytes) -> bytes:
    """``DeliveryFrame{delivery}`` as protobuf writes it, without protobuf objects."""
    return fixed_layout.oneof(1, clove)


def encode_reply(reply_tag: bytes, clove: bytes, signature: bytes) -> bytes:
    """``DeliveryFrame{reply}`` as protobuf writes it, without protobuf objects."""
    return fixed_layout.oneof(2, reply_tag, clove, signature)


def verify_reply(model_node: bytes, clove: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``model_node``'s signature over the response clove ``clove``
    (:func:`ps_p2p.responses.sign_clove`)."""
    try:
        message_id = parse(clove_pb2.Clove, clove).message_id
        responses.verify_clove(model_node, message_id, clove, signature)
    except PsError:
        return False
    return True


__all__ = [
    "DELIVER_MAX_FRAME", "DELIVER_PROTOCOL_ID", "DeliveryFrame", "ReplyFrame", "decode",
    "encode_delivery", "encode_reply", "verify_reply",
]
