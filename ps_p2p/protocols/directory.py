"""``/planetserve/directory/1.0.0``: node registration and directory download (sec. 3.4).

Request/response over one stream: the client writes one ``DirectoryRequest`` frame and reads one
``DirectoryResponse`` frame; the server answers requests on a stream until the client closes it.

* ``register``: a signed :class:`~ps_p2p.records.NodeRecord`; answered by ``RegisterAck``
  (the record's expiry) or ``ErrorReply`` (bad signature, expired, older than the held record...).
* ``get``: answered by the verifier's signed :class:`~ps_p2p.records.Directory` (its current one,
  whatever ``min_height`` asks; the client compares heights).

Frame limits: requests 64 KiB, responses 16 MiB. A frame that is too large or not a protobuf
resets its stream (logged as a warning); the service goes on. The registry and the directory
cache are only touched on the trio thread between awaits, so no lock is needed.

Until consensus lands each verifier signs its own registry's directory; a user asks one verifier
and checks the signatures against its trusted verifiers and quorum (:func:`fetch_directory`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
from google.protobuf.message import DecodeError as ProtobufDecodeError
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID

from ps_p2p import records
from ps_p2p.errors import (
    ExpiredError,
    InvalidSignatureError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.pb.planetserve.v1 import directory_pb2, records_pb2
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.records import Directory, NodeRecord, Registry, Role, VerifierSignature

log = logging.getLogger(__name__)

DIRECTORY_PROTOCOL_ID = TProtocol("/planetserve/directory/1.0.0")

#: Largest ``DirectoryRequest`` frame (a node record is well under 10 KiB).
MAX_REQUEST_BYTES = 64 * 1024
#: Largest ``DirectoryResponse`` frame (~88,000 records of ~190 bytes each).
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
#: Most verifier signatures a directory may carry on the wire.
MAX_DIRECTORY_SIGNATURES = 1024
#: Directories with more records are decoded and verified in a worker thread (~80 us a record),
#: so a large download does not stall the node's other tasks.
THREAD_VERIFY_RECORDS = 256

# ErrorReply codes.
ERROR_BAD_REQUEST = 1
ERROR_INVALID_SIGNATURE = 2
ERROR_EXPIRED = 3
ERROR_REFUSED = 4  # well-formed but not accepted: older record, registry full, ...
ERROR_UNAVAILABLE = 5  # the directory does not fit in a response frame


# ---------------------------------------------------------------------------------- conversion


def record_to_pb(record: NodeRecord) -> records_pb2.NodeRecord:
    """A :class:`NodeRecord` as its protobuf message (roles in ascending order)."""
    return records_pb2.NodeRecord(
        peer_id=record.peer_id,
        addrs=list(record.addrs),
        roles=sorted(int(r) for r in record.roles),
        onion_key=record.onion_key,
        model_id=record.model_id,
        organization=record.organization,
        capacity=record.capacity,
        issued_at_ms=record.issued_at_ms,
        expires_at_ms=record.expires_at_ms,
        signature=record.signature,
    )


def record_from_pb(pb: records_pb2.NodeRecord) -> NodeRecord:
    """A :class:`NodeRecord` from its protobuf message, with every field limit checked.

    Raises:
        RemoteProtocolError: an unknown or unspecified role, or a field beyond its limit
            (:func:`ps_p2p.records.check_record_fields`). The signature is not checked here.
    """
    if len(pb.addrs) > records.MAX_ADDRS:
        raise RemoteProtocolError(
            f"record lists {len(pb.addrs)} addresses (max {records.MAX_ADDRS})"
        )
    roles = set()
    for value in pb.roles:
        try:
            roles.add(Role(value))
        except ValueError:
            raise RemoteProtocolError(f"record has an unknown role {value}") from None
    record = NodeRecord(
        peer_id=bytes(pb.peer_id),
        addrs=tuple(pb.addrs),
        roles=frozenset(roles),
        onion_key=bytes(pb.onion_key),
        model_id=pb.model_id,
        organization=pb.organization,
        capacity=pb.capacity,
        issued_at_ms=pb.issued_at_ms,
        expires_at_ms=pb.expires_at_ms,
        signature=bytes(pb.signature),
    )
    records.check_record_fields(record)
    return record


def directory_to_pb(directory: Directory) -> records_pb2.Directory:
    """A :class:`Directory` as its protobuf message."""
    return records_pb2.Directory(
        height=directory.height,
        issued_at_ms=directory.issued_at_ms,
        expires_at_ms=directory.expires_at_ms,
        records=[record_to_pb(r) for r in directory.records],
        signatures=[
            records_pb2.VerifierSignature(verifier_id=s.verifier_id, signature=s.signature)
            for s in directory.signatures
        ],
    )


def directory_from_pb(pb: records_pb2.Directory) -> Directory:
    """A :class:`Directory` from its protobuf message (signatures not yet checked).

    Raises:
        RemoteProtocolError: more than :data:`~ps_p2p.records.MAX_RECORDS` records or
            :data:`MAX_DIRECTORY_SIGNATURES` signatures, or a record rejected by
            :func:`record_from_pb`.
    """
    if len(pb.records) > records.MAX_RECORDS:
        raise RemoteProtocolError(f"directory of {len(pb.records)} records")
    if len(pb.signatures) > MAX_DIRECTORY_SIGNATURES:
        raise RemoteProtocolError(f"directory with {len(pb.signatures)} signatures")
    return Directory(
        height=pb.height,
        issued_at_ms=pb.issued_at_ms,
        expires_at_ms=pb.expires_at_ms,
        records=tuple(record_from_pb(r) for r in pb.records),
        signatures=tuple(
            VerifierSignature(bytes(s.verifier_id), bytes(s.signature)) for s in pb.signatures
        ),
    )


def _error(code: int, message: str) -> directory_pb2.DirectoryResponse:
    return directory_pb2.DirectoryResponse(
        error=directory_pb2.ErrorReply(code=code, message=message)
    )


def _peer_label(stream: INetStream) -> str:
    try:
        return stream.muxed_conn.peer_id.to_base58()[-8:]
    except Exception:
        return "?"


# ---------------------------------------------------------------------------------- server


class DirectoryService:
    """A verifier's registry and the handler of ``/planetserve/directory/1.0.0``.

    Args:
        identity: the verifier's identity key; it signs the directory.
        directory_lifetime_ms: validity of each signed directory (default 2 minutes); it is
            re-signed after half of it, or as soon as the registry height changed.
        clock_ms: unix time in milliseconds (inject a fake in tests).

    Attributes:
        registry: the records this verifier holds.
    """

    def __init__(
        self,
        identity: records.Signer,
        *,
        directory_lifetime_ms: int = 120_000,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        if directory_lifetime_ms <= 0:
            raise LocalProtocolError("directory_lifetime_ms must be positive")
        self.identity = identity
        self.directory_lifetime_ms = directory_lifetime_ms
        self.registry = Registry()
        self._clock_ms = clock_ms
        self._directory: Directory | None = None
        self._response: bytes | None = None  # the encoded frame of ``_directory``

    def register_handlers(self, host: IHost) -> None:
        """Serve :data:`DIRECTORY_PROTOCOL_ID` on ``host``."""
        host.set_stream_handler(DIRECTORY_PROTOCOL_ID, self._handle_stream)

    def signed_directory(self, now_ms: int) -> Directory:
        """The registry's live records, signed by this verifier.

        Cached: a new directory is signed when the registry height changed (records added,
        replaced or expired), half the lifetime has passed, or the clock went backwards.
        """
        records_now = self.registry.records(now_ms)  # drops expired records (height may change)
        cached = self._directory
        if (
            cached is None
            or cached.height != self.registry.height
            or now_ms < cached.issued_at_ms
            or now_ms >= cached.issued_at_ms + self.directory_lifetime_ms // 2
        ):
            unsigned = Directory(
                height=self.registry.height,
                issued_at_ms=now_ms,
                expires_at_ms=now_ms + self.directory_lifetime_ms,
                records=records_now,
            )
            self._directory = records.sign_directory(self.identity, unsigned)
            self._response = None
        assert self._directory is not None
        return self._directory

    def _directory_frame(self, now_ms: int) -> bytes:
        directory = self.signed_directory(now_ms)
        if self._response is None:
            response = directory_pb2.DirectoryResponse(directory=directory_to_pb(directory))
            body = response.SerializeToString()
            if len(body) > MAX_RESPONSE_BYTES:
                log.error(
                    "directory of %d records is %d bytes, over the %d-byte response limit",
                    len(directory.records), len(body), MAX_RESPONSE_BYTES,
                )
                body = _error(
                    ERROR_UNAVAILABLE, "directory too large for one frame"
                ).SerializeToString()
            self._response = encode_frame(body)
        return self._response

    def handle_request(
        self, request: directory_pb2.DirectoryRequest, now_ms: int, sender: bytes | None = None
    ) -> bytes:
        """Answer one decoded request; returns the encoded response frame.

        Args:
            sender: the peer ID of the connection it came on; a node may register only its own
                record (None: not checked, for in-process callers).

        A refused registration becomes an ``ErrorReply`` (codes ``ERROR_*``), never an exception.
        """
        kind = request.WhichOneof("kind")
        if kind == "get":
            return self._directory_frame(now_ms)
        if kind == "register":
            try:
                record = record_from_pb(request.register)
                if sender is not None and record.peer_id != sender:
                    raise RemoteProtocolError("a node may register only its own record")
                expires = self.registry.register(record, now_ms)
            except InvalidSignatureError as exc:
                response = _error(ERROR_INVALID_SIGNATURE, f"registration refused: {exc}")
            except ExpiredError as exc:
                response = _error(ERROR_EXPIRED, f"registration refused: {exc}")
            except RemoteProtocolError as exc:
                response = _error(ERROR_REFUSED, f"registration refused: {exc}")
            else:
                response = directory_pb2.DirectoryResponse(
                    ack=directory_pb2.RegisterAck(expires_at_ms=expires)
                )
            return encode_frame(response.SerializeToString())
        return encode_frame(_error(ERROR_BAD_REQUEST, "empty DirectoryRequest").SerializeToString())

    async def _handle_stream(self, stream: INetStream) -> None:
        # Guarded: an exception escaping a handler kills the py-libp2p host (DESIGN.md pitfalls).
        peer = _peer_label(stream)
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            while True:
                try:
                    frame = await read_frame(stream, MAX_REQUEST_BYTES)
                except StreamEOF:
                    break
                try:
                    request = directory_pb2.DirectoryRequest.FromString(frame)
                except ProtobufDecodeError as exc:
                    raise RemoteProtocolError(f"malformed DirectoryRequest: {exc}") from exc
                await stream.write(self.handle_request(request, self._clock_ms(), sender))
        except RemoteProtocolError as exc:
            log.warning("directory stream from %s reset: %s", peer, exc)
            await _reset_quietly(stream)
            return
        except StreamError as exc:
            log.info("directory stream from %s failed: %r", peer, exc)
            await _reset_quietly(stream)
            return
        except Exception:
            log.exception("directory stream from %s: unexpected error", peer)
            await _reset_quietly(stream)
            return
        try:
            await stream.close()
        except Exception as exc:
            log.debug("closing directory stream from %s: %r", peer, exc)


async def _reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception as exc:
        log.debug("stream reset failed: %r", exc)


# ---------------------------------------------------------------------------------- client


async def _exchange(
    host: IHost, verifier: bytes, request: directory_pb2.DirectoryRequest, timeout: float
) -> directory_pb2.DirectoryResponse:
    with trio.fail_after(timeout):
        stream = await host.new_stream(ID(verifier), [DIRECTORY_PROTOCOL_ID])
        try:
            await stream.write(encode_frame(request.SerializeToString()))
            try:
                body = await read_frame(stream, MAX_RESPONSE_BYTES)
            except StreamError as exc:
                raise RemoteProtocolError(
                    f"verifier closed the directory stream without answering ({exc!r})"
                ) from exc
        except BaseException:
            with trio.CancelScope(shield=True):
                await _reset_quietly(stream)
            raise
        try:
            await stream.close()
        except Exception as exc:
            log.debug("closing directory stream: %r", exc)
    try:
        return directory_pb2.DirectoryResponse.FromString(body)
    except ProtobufDecodeError as exc:
        raise RemoteProtocolError(f"malformed DirectoryResponse: {exc}") from exc


def _raise_error_reply(verifier: bytes, response: directory_pb2.DirectoryResponse) -> None:
    err = response.error
    raise RemoteProtocolError(
        f"verifier {ID(verifier).to_base58()[-8:]} answered error {err.code}: {err.message}"
    )


async def register(
    host: IHost, verifier: bytes, record: NodeRecord, *, timeout: float = 5.0
) -> int:
    """Register a signed node record with a verifier.

    Args:
        verifier: the verifier's peer ID (its address must be in the peerstore or connected).
        record: signed with :func:`ps_p2p.records.sign_record`.
        timeout: seconds for the whole exchange, dial included.

    Returns:
        the record's ``expires_at_ms`` as acknowledged by the verifier.

    Raises:
        RemoteProtocolError: the verifier refused the record (its message is included), or
            answered something malformed or unexpected.
        trio.TooSlowError: no answer within ``timeout``.
        Exception: py-libp2p's dial and negotiation errors (SwarmException and friends).
    """
    request = directory_pb2.DirectoryRequest(register=record_to_pb(record))
    response = await _exchange(host, verifier, request, timeout)
    kind = response.WhichOneof("kind")
    if kind == "ack":
        return response.ack.expires_at_ms
    if kind == "error":
        _raise_error_reply(verifier, response)
    raise RemoteProtocolError(f"verifier answered a registration with {kind!r}")


async def fetch_directory(
    host: IHost,
    verifier: bytes,
    *,
    trusted_verifiers: frozenset[bytes],
    quorum: int,
    now_ms: int,
    timeout: float = 5.0,
) -> Directory:
    """Download a verifier's directory and verify it.

    Args:
        verifier: peer ID to ask (it need not be one of the signers).
        trusted_verifiers, quorum, now_ms: as for :func:`ps_p2p.records.verify_directory`.
        timeout: seconds for the whole exchange, dial included.

    Returns:
        the verified directory without expired records.

    Raises:
        InvalidSignatureError: too few valid signatures by trusted verifiers, or a forged record.
        ExpiredError: the directory is expired (or issued too far in the future).
        RemoteProtocolError: an ErrorReply, or a malformed or unexpected answer.
        trio.TooSlowError: no answer within ``timeout``.
        Exception: py-libp2p's dial and negotiation errors.
    """
    request = directory_pb2.DirectoryRequest(get=directory_pb2.GetDirectory())
    response = await _exchange(host, verifier, request, timeout)
    kind = response.WhichOneof("kind")
    if kind == "error":
        _raise_error_reply(verifier, response)
    if kind != "directory":
        raise RemoteProtocolError(f"verifier answered a directory request with {kind!r}")

    def check() -> Directory:
        directory = directory_from_pb(response.directory)
        return records.verify_directory(
            directory, trusted_verifiers=trusted_verifiers, quorum=quorum, now_ms=now_ms
        )

    if len(response.directory.records) > THREAD_VERIFY_RECORDS:
        return await trio.to_thread.run_sync(check)
    return check()


__all__ = [
    "DIRECTORY_PROTOCOL_ID",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "DirectoryService",
    "directory_from_pb",
    "directory_to_pb",
    "fetch_directory",
    "record_from_pb",
    "record_to_pb",
    "register",
]
