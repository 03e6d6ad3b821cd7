"""Clove <-> ``planetserve.v1.Clove`` protobuf conversion (service layer)."""

from __future__ import annotations

from ps_p2p.crypto import sida
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import clove_pb2


def clove_to_bytes(clove: sida.Clove) -> bytes:
    """Serialize a clove as the ``Clove`` protobuf message."""
    return clove_pb2.Clove(
        message_id=clove.message_id,
        index=clove.index,
        total=clove.total,
        threshold=clove.threshold,
        fragment=clove.fragment,
        key_share=clove.key_share,
    ).SerializeToString()


def clove_from_bytes(data: bytes) -> sida.Clove:
    """Parse and check a ``Clove`` message.

    Raises:
        RemoteProtocolError: malformed message, or fields out of range (``Clove.check``).
    """
    message = clove_pb2.Clove()
    try:
        message.ParseFromString(data)
    except Exception as exc:
        raise RemoteProtocolError(f"malformed clove: {exc}") from exc
    clove = sida.Clove(
        message_id=message.message_id,
        index=message.index,
        total=message.total,
        threshold=message.threshold,
        fragment=message.fragment,
        key_share=message.key_share,
    )
    clove.check()
    return clove
