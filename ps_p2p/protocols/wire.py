"""Protobuf parsing shared by the protocol modules (service layer)."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError as PbDecodeError
from google.protobuf.message import Message

from ps_p2p.errors import RemoteProtocolError

M = TypeVar("M", bound=Message)


def parse(cls: type[M], data: bytes) -> M:
    """Parse ``data`` as a ``cls`` protobuf message.

    Raises:
        RemoteProtocolError: not a valid encoding of ``cls``.
    """
    message = cls()
    try:
        message.ParseFromString(data)
    except (PbDecodeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed {cls.__name__}: {exc}") from exc
    return message


__all__ = ["parse"]
