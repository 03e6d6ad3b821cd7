"""``/planetserve/directory/1.0.0``: node registration and directory download in pages (sec. 3.4).

Request/response over one stream: the client writes one ``DirectoryRequest`` frame and reads one
``DirectoryResponse`` frame; the server answers requests on a stream until the client closes it.

* ``register``: a signed :class:`~ps_p2p.records.NodeRecord`; answered by ``RegisterAck``
  (until when the record is listed) or ``ErrorReply`` (bad signature, expired, older than the
  held record, a field beyond its byte limit...).
* ``get`` (``since_height`` H): answered by one ``DirectoryPage``: the verifier's current signed
  :class:`~ps_p2p.records.DirectoryHead` and the records changed (and peer IDs removed) after
  height H, oldest change first, as many as fit in :data:`MAX_RESPONSE_BYTES`. The client asks
  again from ``next_height`` while ``more`` is set, then checks that the set it assembled has the
  signed count and root (:class:`~ps_p2p.records.DirectoryReplica`). H = 0, or a height the
  verifier no longer has deltas for, gets every record (``reset``). A page stays under its frame
  limit whatever the directory's size, so a large directory costs more pages, never a failed
  fetch; a client that holds height H pays for what changed since H only.

Frame limits: requests 4 KiB (a signed record is under 1 KiB), responses 256 KiB. A frame that
is too large or not a protobuf resets its stream (logged as a warning); the service goes on. The
registry and the head cache are only touched on the trio thread between awaits, so no lock is
needed.

This is the single-verifier mode (no genesis file): each verifier signs its own registry's
head; a user asks one verifier and checks the signatures against its trusted verifiers and
quorum (:func:`fetch_directory`). Heights of different verifiers are unrelated, so a replica
restarts from 0 when it changes verifier. With a genesis file, nodes use the committee's
``/planetserve/directory/2.0.0`` (:mod:`ps_p2p.protocols.committee_directory`) instead.
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
from ps_p2p.protocols.framing import encode_frame, encode_varint, read_frame
from ps_p2p.protocols.handlers import StreamHandlers, reset_quietly
from ps_p2p.records import (
    Directory,
    DirectoryHead,
    DirectoryPage,
    DirectoryReplica,
    NodeRecord,
    Registry,
    Role,
    VerifierSignature,
)

log = logging.getLogger(__name__)

DIRECTORY_PROTOCOL_ID = TProtocol("/planetserve/directory/1.0.0")

#: Largest ``DirectoryRequest`` frame (a signed record is under 1 KiB).
MAX_REQUEST_BYTES = 4 * 1024
#: Largest ``DirectoryResponse`` frame: one page (~350 records of the largest size).
MAX_RESPONSE_BYTES = 256 * 1024
#: Most verifier signatures a head may carry on the wire (a committee of 3f+1 <= 128).
MAX_DIRECTORY_SIGNATURES = 128
#: Most records plus removed peer IDs in one page.
MAX_PAGE_ENTRIES = 4096
#: Longest removed peer ID in a page (an Ed25519 peer ID is 38 bytes).
MAX_PEER_ID_BYTES = 64
#: Pages with more records are checked in a worker thread (~80 us a new record, a cache hit
#: ~2 us), so a large download does not stall the node's other tasks.
THREAD_VERIFY_RECORDS = 64

# ErrorReply codes.
ERROR_BAD_REQUEST = 1
ERROR_INVALID_SIGNATURE = 2
ERROR_EXPIRED = 3
ERROR_REFUSED = 4  # well-formed but not accepted: older record, registry full, ...
ERROR_UNAVAILABLE = 5  # the verifier cannot answer now

# Room left in a response frame besides the head and the page entries: the response's and the
# page's tags and lengths (<= 2 x 6 bytes) and since/reset/next/more (<= 4 x 11 bytes).
_PAGE_OVERHEAD = 64


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


def record_from_pb(pb: records_pb2.NodeRecord, *, check: bool = True) -> NodeRecord:
    """A :class:`NodeRecord` from its protobuf message.

    Args:
        check: check every field limit (:func:`ps_p2p.records.check_record_fields`); without
            it only the counts are bounded, for callers that check (or find in a
            :class:`~ps_p2p.records.VerifiedCache`) the record themselves.

    Raises:
        RemoteProtocolError: an unknown or unspecified role, more than ``MAX_ADDRS``
            addresses or more roles than exist, or (with ``check``) a field beyond its limit.
            The signature is not checked here.
    """
    if len(pb.addrs) > records.MAX_ADDRS:
        raise RemoteProtocolError(
            f"record lists {len(pb.addrs)} addresses (max {records.MAX_ADDRS})"
        )
    if len(pb.roles) > len(Role):
        raise RemoteProtocolError(f"record lists {len(pb.roles)} roles")
    roles = set()
    for value in pb.roles:
        try:
            roles.add(Role(value))
        except ValueError:
            raise RemoteProtocolError(f"record has an unknown role {value}") from None
    record = NodeRecord(
        peer_id=bytes(pb.peer_id),
        addrs=tuple(bytes(a) for a in pb.addrs),
        roles=frozenset(roles),
        onion_key=bytes(pb.onion_key),
        model_id=pb.model_id,
        organization=pb.organization,
        capacity=pb.capacity,
        issued_at_ms=pb.issued_at_ms,
        expires_at_ms=pb.expires_at_ms,
        signature=bytes(pb.signature),
    )
    if check:
        records.check_record_fields(record)
    return record


def head_to_pb(head: DirectoryHead) -> records_pb2.DirectoryHead:
    """A :class:`DirectoryHead` as its protobuf message."""
    return records_pb2.DirectoryHead(
        height=head.height,
        issued_at_ms=head.issued_at_ms,
        expires_at_ms=head.expires_at_ms,
        record_count=head.record_count,
        root=head.root,
        signatures=[
            records_pb2.VerifierSignature(verifier_id=s.verifier_id, signature=s.signature)
            for s in head.signatures
        ],
    )


def head_from_pb(pb: records_pb2.DirectoryHead) -> DirectoryHead:
    """A :class:`DirectoryHead` from its protobuf message (signatures not yet checked).

    Raises:
        RemoteProtocolError: more than :data:`MAX_DIRECTORY_SIGNATURES` signatures, or a root
            that is not 32 bytes.
    """
    if len(pb.signatures) > MAX_DIRECTORY_SIGNATURES:
        raise RemoteProtocolError(f"directory head with {len(pb.signatures)} signatures")
    if len(pb.root) != 32:
        raise RemoteProtocolError(f"directory root of {len(pb.root)} bytes")
    return DirectoryHead(
        height=pb.height,
        issued_at_ms=pb.issued_at_ms,
        expires_at_ms=pb.expires_at_ms,
        record_count=pb.record_count,
        root=bytes(pb.root),
        signatures=tuple(
            VerifierSignature(bytes(s.verifier_id), bytes(s.signature)) for s in pb.signatures
        ),
    )


def page_from_pb(pb: directory_pb2.DirectoryPage) -> DirectoryPage:
    """A :class:`DirectoryPage` from its protobuf message; records' fields and signatures are
    left to :meth:`ps_p2p.records.ReplicaUpdate.receive`.

    Raises:
        RemoteProtocolError: no head, more than :data:`MAX_PAGE_ENTRIES` entries, a removed
            peer ID over :data:`MAX_PEER_ID_BYTES`, or a head or record rejected by
            :func:`head_from_pb` / :func:`record_from_pb`.
    """
    if not pb.HasField("head"):
        raise RemoteProtocolError("directory page without a head")
    if len(pb.records) + len(pb.removed) > MAX_PAGE_ENTRIES:
        raise RemoteProtocolError(
            f"directory page of {len(pb.records) + len(pb.removed)} entries"
        )
    for peer in pb.removed:
        if len(peer) > MAX_PEER_ID_BYTES:
            raise RemoteProtocolError(f"removed peer ID of {len(peer)} bytes")
    return DirectoryPage(
        head=head_from_pb(pb.head),
        since_height=pb.since_height,
        reset=pb.reset,
        records=tuple(record_from_pb(r, check=False) for r in pb.records),
        removed=tuple(bytes(p) for p in pb.removed),
        next_height=pb.next_height,
        more=pb.more,
    )


def _field(number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2): tag, length, bytes."""
    return encode_varint((number << 3) | 2) + encode_varint(len(data)) + data


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
        identity: the verifier's identity key; it signs the directory head.
        directory_lifetime_ms: validity of each signed head (default 2 minutes); it is
            re-signed after half of it, or as soon as the registry height changed.
        clock_ms: unix time in milliseconds (inject a fake in tests).
        max_response_bytes: frame limit of a page (default :data:`MAX_RESPONSE_BYTES`; tests
            lower it to see many pages).

    Attributes:
        registry: the records this verifier holds.
        heads_signed: heads signed so far (one per height change or half lifetime).
    """

    def __init__(
        self,
        identity: records.Signer,
        *,
        directory_lifetime_ms: int = 120_000,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if directory_lifetime_ms <= 0:
            raise LocalProtocolError("directory_lifetime_ms must be positive")
        if max_response_bytes < 4 * records.MAX_RECORD_WIRE_BYTES + 16 * 1024:
            raise LocalProtocolError("max_response_bytes too small for a page")
        self.identity = identity
        self.directory_lifetime_ms = directory_lifetime_ms
        self.max_response_bytes = max_response_bytes
        self.registry = Registry()
        self.heads_signed = 0
        self._clock_ms = clock_ms
        self._head: DirectoryHead | None = None
        self._head_field: bytes = b""  # field 1 of a DirectoryPage: the encoded head
        self._encoded: dict[bytes, tuple[NodeRecord, bytes]] = {}  # peer -> (record, field 4)

    def register_handlers(self, host: IHost) -> StreamHandlers:
        """Serve :data:`DIRECTORY_PROTOCOL_ID` on ``host`` until the returned handlers'
        ``aclose()``.

        Raises:
            ConfigError: the host already serves :data:`DIRECTORY_PROTOCOL_ID`.
        """
        handlers = StreamHandlers(host)
        handlers.add(DIRECTORY_PROTOCOL_ID, self._handle_stream)
        return handlers

    async def serve(
        self, host: IHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve :data:`DIRECTORY_PROTOCOL_ID` on ``host`` until cancelled, then remove the
        handler (resetting the streams it still serves).

        Raises:
            ConfigError: the host already serves the protocol (before ``task_status.started()``).
        """
        handlers = self.register_handlers(host)
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            await handlers.aclose()

    def signed_head(self, now_ms: int) -> DirectoryHead:
        """The registry's current head, signed by this verifier.

        Expired records are dropped first (O(expired)). Cached: a new head is signed when the
        height changed, half the lifetime has passed, or the clock went backwards; signing
        costs the changed buckets of the root and one Ed25519 signature, never a rebuild.
        """
        registry = self.registry
        registry.expire(now_ms)
        cached = self._head
        if (
            cached is None
            or cached.height != registry.height
            or now_ms < cached.issued_at_ms
            or now_ms >= cached.issued_at_ms + self.directory_lifetime_ms // 2
        ):
            head = DirectoryHead(
                height=registry.height,
                issued_at_ms=now_ms,
                expires_at_ms=now_ms + self.directory_lifetime_ms,
                record_count=len(registry),
                root=registry.root(),
            )
            self._head = records.sign_head(self.identity, head)
            self._head_field = _field(1, head_to_pb(self._head).SerializeToString())
            self.heads_signed += 1
        assert self._head is not None
        return self._head

    def signed_directory(self, now_ms: int) -> Directory:
        """The whole signed directory (for in-process callers; O(records) after a change).

        Its signatures are the head's and verify over it (:func:`records.verify_directory`).
        """
        head = self.signed_head(now_ms)
        return Directory(
            head.height, head.issued_at_ms, head.expires_at_ms,
            self.registry.records(now_ms), head.signatures,
        )

    def page(self, since_height: int, now_ms: int) -> bytes:
        """The encoded ``DirectoryResponse`` frame answering "changed since ``since_height``".

        O(entries in the page): the changes come from the registry's log, each record is
        encoded once per version and kept. The frame is at most ``max_response_bytes``.
        """
        head = self.signed_head(now_ms)
        reset, changes = self.registry.changes_since(since_height)
        budget = self.max_response_bytes - len(self._head_field) - _PAGE_OVERHEAD
        parts: list[bytes] = []
        used = 0
        last = 0 if reset else since_height
        more = False
        for version, peer, record in changes:
            if record is None:
                item = _field(5, peer)
                self._encoded.pop(peer, None)
            else:
                item = self._record_field(record)
            if used + len(item) > budget or len(parts) >= MAX_PAGE_ENTRIES:
                more = True
                break
            parts.append(item)
            used += len(item)
            last = version
        if more and not parts:  # cannot happen with the enforced minimum frame size
            body = _error(ERROR_UNAVAILABLE, "directory page does not fit").SerializeToString()
            return encode_frame(body)
        tail = directory_pb2.DirectoryPage(
            since_height=0 if reset else since_height,
            reset=reset,
            next_height=last if more else head.height,
            more=more,
        ).SerializeToString()
        body = _field(4, self._head_field + b"".join(parts) + tail)
        if len(self._encoded) > 2 * len(self.registry) + 1024:
            self._encoded = {
                p: e for p, e in self._encoded.items() if self.registry.get(p) is e[0]
            }
        return encode_frame(body)

    def _record_field(self, record: NodeRecord) -> bytes:
        held = self._encoded.get(record.peer_id)
        if held is not None and held[0] is record:
            return held[1]
        item = _field(4, record_to_pb(record).SerializeToString())
        self._encoded[record.peer_id] = (record, item)
        return item

    def handle_request(
        self, request: directory_pb2.DirectoryRequest, now_ms: int, sender: bytes | None = None
    ) -> bytes:
        """Answer one decoded request; returns the encoded response frame.

        Args:
            sender: the peer ID of the connection it came on; a node may register only its own
                record (None: not checked, for in-process callers).

        A refused registration becomes an ``ErrorReply`` (codes ``ERROR_*``), never an exception;
        it costs the checks that refused it and nothing else (no height change, no new head).
        """
        kind = request.WhichOneof("kind")
        if kind == "get":
            return self.page(request.get.since_height, now_ms)
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
            await reset_quietly(stream)
            return
        except StreamError as exc:
            log.info("directory stream from %s failed: %r", peer, exc)
            await reset_quietly(stream)
            return
        except Exception:
            log.exception("directory stream from %s: unexpected error", peer)
            await reset_quietly(stream)
            return
        try:
            await stream.close()
        except Exception as exc:
            log.debug("closing directory stream from %s: %r", peer, exc)


# ---------------------------------------------------------------------------------- client


async def _request(
    stream: INetStream, request: directory_pb2.DirectoryRequest, timeout: float
) -> directory_pb2.DirectoryResponse:
    with trio.fail_after(timeout):
        await stream.write(encode_frame(request.SerializeToString()))
        try:
            body = await read_frame(stream, MAX_RESPONSE_BYTES)
        except StreamError as exc:
            raise RemoteProtocolError(
                f"verifier closed the directory stream without answering ({exc!r})"
            ) from exc
    try:
        return directory_pb2.DirectoryResponse.FromString(body)
    except ProtobufDecodeError as exc:
        raise RemoteProtocolError(f"malformed DirectoryResponse: {exc}") from exc


class _Session:
    """One directory stream to a verifier, closed (or reset on error) on exit."""

    def __init__(self, host: IHost, verifier: bytes, timeout: float) -> None:
        self._host = host
        self._verifier = verifier
        self._timeout = timeout
        self.stream: INetStream | None = None

    async def __aenter__(self) -> _Session:
        with trio.fail_after(self._timeout):
            self.stream = await self._host.new_stream(ID(self._verifier), [DIRECTORY_PROTOCOL_ID])
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        assert self.stream is not None
        if exc_type is not None:
            with trio.CancelScope(shield=True):
                await reset_quietly(self.stream)
            return
        try:
            await self.stream.close()
        except Exception as close_exc:
            log.debug("closing directory stream: %r", close_exc)

    async def request(
        self, request: directory_pb2.DirectoryRequest
    ) -> directory_pb2.DirectoryResponse:
        assert self.stream is not None
        return await _request(self.stream, request, self._timeout)


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
        until when the verifier lists the record (unix ms, its ``expires_at_ms``).

    Raises:
        RemoteProtocolError: the verifier refused the record (its message is included), or
            answered something malformed or unexpected.
        trio.TooSlowError: no answer within ``timeout``.
        Exception: py-libp2p's dial and negotiation errors (SwarmException and friends).
    """
    request = directory_pb2.DirectoryRequest(register=record_to_pb(record))
    with trio.fail_after(timeout):
        async with _Session(host, verifier, timeout) as session:
            response = await session.request(request)
    kind = response.WhichOneof("kind")
    if kind == "ack":
        return response.ack.expires_at_ms
    if kind == "error":
        _raise_error_reply(verifier, response)
    raise RemoteProtocolError(f"verifier answered a registration with {kind!r}")


async def _run_update(
    session: _Session, verifier: bytes, update: records.ReplicaUpdate, now_ms: int
) -> Directory:
    while not update.done:
        request = directory_pb2.DirectoryRequest(
            get=directory_pb2.GetDirectory(since_height=update.since)
        )
        response = await session.request(request)
        kind = response.WhichOneof("kind")
        if kind == "error":
            _raise_error_reply(verifier, response)
        if kind != "page":
            raise RemoteProtocolError(f"verifier answered a directory request with {kind!r}")
        page = page_from_pb(response.page)
        if len(page.records) > THREAD_VERIFY_RECORDS:
            await trio.to_thread.run_sync(update.receive, page)
        else:
            update.receive(page)
    if update.staged > THREAD_VERIFY_RECORDS:
        return await trio.to_thread.run_sync(update.commit, now_ms)
    return update.commit(now_ms)


async def fetch_directory(
    host: IHost,
    verifier: bytes,
    *,
    trusted_verifiers: frozenset[bytes],
    quorum: int,
    now_ms: int,
    timeout: float = 5.0,
    replica: DirectoryReplica | None = None,
) -> Directory:
    """Bring a verified copy of a verifier's directory up to date and return it.

    With a ``replica`` that holds this verifier's directory at height H, only the changes
    since H are fetched (a few hundred bytes when little changed); otherwise every record,
    in as many pages as needed. Each page is one request on one stream. If the assembled set
    does not match the signed head after a delta, everything is fetched once more.

    Args:
        verifier: peer ID to ask (it need not be one of the signers).
        trusted_verifiers, quorum, now_ms: as for :func:`ps_p2p.records.verify_head` (a given
            ``replica`` uses its own).
        timeout: seconds for the dial and for each page.
        replica: the caller's copy, updated in place (None: a fresh one).

    Returns:
        the verified directory (records sorted by peer ID).

    Raises:
        InvalidSignatureError: too few valid signatures by trusted verifiers, a forged record,
            or records that do not match the signed head.
        ExpiredError: the head is expired (or issued too far in the future).
        RemoteProtocolError: an ErrorReply, a malformed or unexpected answer, or pages that do
            not follow each other.
        trio.TooSlowError: no answer within ``timeout``.
        Exception: py-libp2p's dial and negotiation errors.
    """
    if replica is None:
        replica = DirectoryReplica(trusted_verifiers=trusted_verifiers, quorum=quorum)
    async with _Session(host, verifier, timeout) as session:
        delta = replica.since(verifier) > 0
        try:
            return await _run_update(session, verifier, replica.begin(verifier), now_ms)
        except InvalidSignatureError as exc:
            if not delta:
                raise
            log.info(
                "delta from %s did not match its head (%s); fetching everything",
                ID(verifier).to_base58()[-8:], exc,
            )
        return await _run_update(session, verifier, replica.begin(verifier, full=True), now_ms)


__all__ = [
    "DIRECTORY_PROTOCOL_ID",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "DirectoryService",
    "fetch_directory",
    "head_from_pb",
    "head_to_pb",
    "page_from_pb",
    "record_from_pb",
    "record_to_pb",
    "register",
]
