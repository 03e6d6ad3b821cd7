"""``/planetserve/onion/1.0.0``: onion path setup (PlanetServe sec. 3.2), wire form.

One-way message links (:mod:`ps_p2p.protocols.links`) carry
:class:`~ps_p2p.pb.planetserve.v1.onion_pb2.OnionFrame`: a fixed-size setup packet travels hop by
hop (:func:`ps_p2p.crypto.onion.process_setup`), and its acknowledgement (or refusal) returns
along the path, each hop adding its backward layer. The state machine is
:class:`ps_p2p.overlay.relay.RelayCore`; this module only converts frames.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_p2p.crypto import onion
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import onion_pb2
from ps_p2p.protocols.wire import parse

ONION_PROTOCOL_ID = "/planetserve/onion/1.0.0"
#: Largest onion frame: a setup packet plus a reply (fixed sizes) and protobuf overhead.
ONION_MAX_FRAME = 4 * 1024


@dataclass(frozen=True)
class SetupFrame:
    path_id: bytes
    packet: bytes


@dataclass(frozen=True)
class SetupReplyFrame:
    path_id: bytes
    ok: bool
    ack: bytes
    error: str


def decode(data: bytes) -> SetupFrame | SetupReplyFrame:
    """One onion frame.

    Raises:
        RemoteProtocolError: malformed, empty, or a path ID that is not 16 bytes.
    """
    frame = parse(onion_pb2.OnionFrame, data)
    kind = frame.WhichOneof("kind")
    if kind == "setup":
        result: SetupFrame | SetupReplyFrame = SetupFrame(frame.setup.path_id, frame.setup.packet)
    elif kind == "reply":
        r = frame.reply
        result = SetupReplyFrame(r.path_id, r.ok, r.ack, r.error)
    else:
        raise RemoteProtocolError("empty onion frame")
    if len(result.path_id) != onion.PATH_ID_BYTES:
        raise RemoteProtocolError(f"path ID of {len(result.path_id)} bytes")
    return result


def encode_setup(path_id: bytes, packet: bytes) -> bytes:
    return onion_pb2.OnionFrame(
        setup=onion_pb2.OnionSetup(path_id=path_id, packet=packet)
    ).SerializeToString()


def encode_reply(path_id: bytes, ok: bool, ack: bytes, error: str) -> bytes:
    return onion_pb2.OnionFrame(
        reply=onion_pb2.OnionSetupReply(path_id=path_id, ok=ok, ack=ack, error=error[:200])
    ).SerializeToString()


__all__ = [
    "ONION_MAX_FRAME", "ONION_PROTOCOL_ID", "SetupFrame", "SetupReplyFrame", "decode",
    "encode_reply", "encode_setup",
]
