"""``/planetserve/directory/2.0.0``: registration and the committee's directory (sec. 3.4).

Every directory is committed by the verifier committee (a lone verifier is a committee of one;
``/planetserve/directory/1.0.0``, where each verifier signed its own directory, is gone). Served
by every verifier of the genesis validator set; one stream carries up to
:data:`MAX_REQUESTS_PER_STREAM` requests (``CommitteeDirectoryRequest`` frames, at most
:data:`MAX_REQUEST_BYTES` each):

* ``register``: the node's own signed record. The server checks that the record names the
  peer ID of the connection (a node registers only itself; the record's signature proves the
  rest); a record of a peer the registry does not list (a new identity) must also find a
  token in the bucket of the connection's observed source network (its remote IP's /24 or
  /48: :class:`~ps_p2p.registry.sources.NewIdentityLimiter`, loopback exempt; renewals are
  never limited). Then it turns it into a REGISTER transaction and gives it to its consensus
  service
  (:meth:`~ps_p2p.protocols.consensus.ConsensusService.submit_tx`: ``check_tx``, mempool,
  relayed to the other validators). Answer: one frame, ``ack`` (the record's expiry, unix ms:
  the transaction is in the mempool; it is listed once a block commits it) or ``error``.
* ``get`` (``since_height`` S): what the verifier serves (:class:`~ps_p2p.registry.directory.
  DirectoryHistory`): the header of the last decided block H and its commit in one ``head``
  frame, then the delta pages from S to the state at H - 1
  (:func:`~ps_p2p.registry.directory.iter_delta_pages`) one ``page`` frame each, the last one
  flagged in the page itself. Every frame is at most :data:`MAX_RESPONSE_BYTES` (pages of at
  most :data:`PAGE_BYTES`) whatever the directory's size. The pages come from one snapshot
  taken before the first frame is written, so a block decided while they are sent changes
  nothing in them; they are built once per height and shared by every request that asks the
  same (:meth:`~ps_p2p.registry.directory.DirectoryHistory.pages`). ``error`` with code
  ``ERROR_UNAVAILABLE`` before the first block, and for a peer over its rate (below).
* ``deregister``: a DEREGISTER transaction (:mod:`ps_p2p.registry` canonical bytes) of
  the node on the other end of the connection, signed by it (a draining model node leaves the
  directory at the next block instead of when its record expires). Answer: ``ack`` (expiry 0)
  or ``error``.
* ``valset_update``: a VALSET_UPDATE transaction (canonical bytes): anyone may relay one, as
  its approvals (more than 2/3 of the current power) are its authority (``ps-node valset
  submit``). Answer: ``ack`` (expiry 0) or ``error``. It must fit one request frame
  (:data:`MAX_REQUEST_BYTES`: a committee of about 25 validators at most).
* ``genesis``: the chain's genesis file (JSON, :mod:`ps_p2p.genesis`) in one ``genesis`` frame.
  A node started without a genesis file asks one of the verifiers it was configured with
  (:func:`fetch_genesis`) and accepts the answer only when every validator it names is one of
  those verifiers (:class:`~ps_p2p.directory_client.CommitteeClient`): it then trusts exactly
  whom it was told to trust.

Rates (issue 16: a 3-byte ``get`` made a verifier of 20,000 records encode and send 4.5 MiB,
1,024 times per stream): the bytes of ``get`` and ``genesis`` answers are charged to a token
bucket of the asking peer (:data:`PEER_ANSWER_RATE`, :data:`PEER_ANSWER_BURST`) and to one of all
peers (:data:`TOTAL_ANSWER_RATE`, :data:`TOTAL_ANSWER_BURST`), by peer ID (so loopback devnets
are unaffected) (:class:`~ps_p2p.rate_limits.PeerBudgets`). A request is answered while
neither bucket is in debt, one at a time per peer and at most :data:`MAX_CONCURRENT_ANSWERS`
at once; otherwise it gets ``ERROR_UNAVAILABLE`` saying how long to wait (costs a frame read
and a ~100-byte write); one more after :data:`MAX_REFUSALS_PER_STREAM` such refusals resets the
stream. A stream serves at most :data:`MAX_REQUESTS_PER_STREAM` requests, and is closed after
:data:`STREAM_IDLE_TIMEOUT` s without one.

A node refreshing its directory (every 5 s by default) sends its ``get`` requests on one
stream kept open per verifier (:class:`DirectoryStreams`), not a new stream each time: a new
stream costs a Yamux SYN, a multistream-select negotiation each way and a close, ~2 ms of CPU
per refresh on both ends together against ~1 ms for the request alone (benchmarks/README.md,
"CPU at rest").

An ``error`` reply carries one of the ``ERROR_*`` codes (``ErrorReply.code``) and a message for
people. The record itself travels as ``planetserve.v1.NodeRecord``
(:mod:`ps_p2p.protocols.record_codec`).

The client (:func:`fetch_committed_directory`) trusts nothing it reads: it bounds every frame
and the whole delta, and :class:`~ps_p2p.registry.replica.CommitteeReplica` verifies the
commit (2f+1 of the genesis validators), the app hash, freshness and monotonic height before
anything is used. A frame that is too large or malformed resets that stream only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamError

from ps_p2p.consensus.block import Header, decode_header, header_bytes
from ps_p2p.consensus.types import Vote
from ps_p2p.errors import LocalProtocolError, PsError, RemoteProtocolError
from ps_p2p.pb.planetserve.v1 import directory_pb2
from ps_p2p.protocols import consensus_codec as cc
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.handlers import StreamHandlers, exchange, reset_quietly, serve_handlers
from ps_p2p.protocols.record_codec import record_from_pb, record_to_pb
from ps_p2p.protocols.wire import parse
from ps_p2p.rate_limits import PeerBudgets
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.types import Directory, NodeRecord
from ps_p2p.registry import DeregisterTx, RegisterTx, ValsetUpdateTx, decode_tx, encode_tx
from ps_p2p.registry.directory import (
    MAX_PAGE_BYTES,
    DeltaPage,
    DirectoryHistory,
)
from ps_p2p.registry.replica import CommitteeReplica
from ps_p2p.registry.sources import NewIdentityLimiter

log = logging.getLogger(__name__)

COMMITTEE_DIRECTORY_PROTOCOL_ID = TProtocol("/planetserve/directory/2.0.0")
#: Largest request frame (a signed record is under 1 KiB).
MAX_REQUEST_BYTES = 4 * 1024
#: Largest response frame: one page plus its framing, or a head (header <= 512 B, commit of at
#: most 128 precommits of ~180 B).
MAX_RESPONSE_BYTES = 256 * 1024
#: Bound of one encoded page the server sends.
PAGE_BYTES = MAX_PAGE_BYTES
#: Requests served on one stream before the server closes it (a node keeps one stream to the
#: verifier it refreshes from: :class:`DirectoryStreams`).
MAX_REQUESTS_PER_STREAM = 64
#: Seconds the server waits for the next request on a stream before it closes it (a node
#: refreshing every 5 s keeps its stream; an idle one holds no handler for ever).
STREAM_IDLE_TIMEOUT = 60.0
#: Seconds a client reuses a stream after its last answer (well inside
#: :data:`STREAM_IDLE_TIMEOUT`, so it rarely finds it closed).
CLIENT_REUSE_SECONDS = 30.0
#: Directory and genesis requests refused for their rate on one stream with an error frame;
#: the next one resets the stream.
MAX_REFUSALS_PER_STREAM = 8
#: Bytes a second of directory and genesis answers one peer is given, and the most it saves
#: up (a node refreshing by deltas sends a few KiB a second at most; a full directory of 20,000
#: records, 4.5 MiB, goes through at once when the peer was quiet, and then the peer waits
#: ~18 s).
PEER_ANSWER_RATE = 256 * 1024
PEER_ANSWER_BURST = 1024 * 1024
#: Bytes a second of such answers to all peers together, and the most saved up (8 MiB/s is
#: ~5-10% of a core in Noise and Yamux; a node refused for it asks another verifier).
TOTAL_ANSWER_RATE = 8 * 1024 * 1024
TOTAL_ANSWER_BURST = 32 * 1024 * 1024
#: Directory answers being sent at once, in all (one per peer).
MAX_CONCURRENT_ANSWERS = 32
#: Largest genesis answer (bytes): a genesis of 128 validators with names is ~20 KiB.
MAX_GENESIS_FRAME_BYTES = MAX_RESPONSE_BYTES - 1024
#: A delta larger than this (bytes) is verified in a worker thread.
THREAD_VERIFY_BYTES = 64 * 1024

# ErrorReply codes (2 and 3 were directory/1.0.0's bad signature and expired record; a
# refused transaction is ERROR_REFUSED whatever the reason, which its message gives).
#: An empty request (no ``kind`` set).
ERROR_BAD_REQUEST = 1
#: Well-formed but not taken: not the sender's own record or deregistration, or refused by the
#: committee's ``check_tx`` (bad signature, expired, older than the listed record, a cap...).
ERROR_REFUSED = 4
#: The verifier cannot answer now: no block committed yet, it serves no genesis, or the peer
#: (or all peers together) is over its rate; the message says when to retry.
ERROR_UNAVAILABLE = 5

#: What a directory snapshot is: block H's header, its commit, and the pages of the state at
#: H - 1 (a generator whose first page fixes the snapshot).
Snapshot = tuple[Header, tuple[Vote, ...], Iterator[DeltaPage]]


def _response(**kind: object) -> bytes:
    return encode_frame(directory_pb2.CommitteeDirectoryResponse(**kind).SerializeToString())


def _error(code: int, message: str) -> bytes:
    return _response(error=directory_pb2.ErrorReply(code=code, message=message))


# ---------------------------------------------------------------------------------- server


class CommitteeDirectoryService:
    """A committee verifier's handler of :data:`COMMITTEE_DIRECTORY_PROTOCOL_ID`.

    Args:
        history: returns the validator's :class:`DirectoryHistory` (read at each request).
        submit_tx: takes a node's own REGISTER or DEREGISTER transaction into the committee's
            mempool; raises
            :class:`~ps_p2p.errors.InvalidTransactionError` / ``AdmissionError`` (a
            ``RemoteProtocolError``) to refuse it.
        page_bytes: bound of one encoded page (default :data:`PAGE_BYTES`).
        genesis_text: the genesis file served to ``genesis`` requests (UTF-8 JSON, at most
            :data:`MAX_GENESIS_FRAME_BYTES`); empty: such requests get ``ERROR_UNAVAILABLE``.
        new_identities: how fast one observed source network may register unlisted peers
            (default :class:`~ps_p2p.registry.sources.NewIdentityLimiter` ``()``).
        budgets: the rates of answers (module docstring); default the ``*_ANSWER_*`` bounds.
        clock: seconds, monotonic (trio's by default), for ``new_identities`` and ``budgets``.

    Attributes:
        served: directory answers sent; registered: records taken; refused: registrations
            refused; reset: streams reset for bad input; rate_limited: directory and genesis
            requests refused for their rate.
    """

    def __init__(
        self,
        history: Callable[[], DirectoryHistory],
        submit_tx: Callable[[RegisterTx | DeregisterTx], object],
        *,
        page_bytes: int = PAGE_BYTES,
        genesis_text: bytes = b"",
        new_identities: NewIdentityLimiter | None = None,
        budgets: PeerBudgets | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if not 64 <= page_bytes <= MAX_RESPONSE_BYTES - 1024:
            raise LocalProtocolError(f"page_bytes must be in 64..{MAX_RESPONSE_BYTES - 1024}")
        if len(genesis_text) > MAX_GENESIS_FRAME_BYTES:
            raise LocalProtocolError(f"genesis over {MAX_GENESIS_FRAME_BYTES} bytes")
        self.genesis_text = genesis_text
        self._history = history
        self._submit_tx = submit_tx
        self.new_identities = NewIdentityLimiter() if new_identities is None else new_identities
        self._clock = clock
        self.page_bytes = page_bytes
        self.served = 0
        self.registered = 0
        self.refused = 0
        self.reset = 0
        self.rate_limited = 0
        self.budgets = budgets if budgets is not None else PeerBudgets(
            rate=PEER_ANSWER_RATE, burst=PEER_ANSWER_BURST, total_rate=TOTAL_ANSWER_RATE,
            total_burst=TOTAL_ANSWER_BURST, max_inflight=MAX_CONCURRENT_ANSWERS)
        self._clock = clock

    def register_handlers(self, host: IHost) -> StreamHandlers:
        """Serve the protocol on ``host`` until the returned handlers' ``aclose()``.

        Raises:
            ConfigError: the host already serves it.
        """
        handlers = StreamHandlers(host)
        handlers.add(COMMITTEE_DIRECTORY_PROTOCOL_ID, self._handle_stream)
        return handlers

    async def serve(
        self, host: IHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve on ``host`` until cancelled, then remove the handler."""
        await serve_handlers(host, {COMMITTEE_DIRECTORY_PROTOCOL_ID: self._handle_stream},
                             task_status=task_status)

    def snapshot(self, since_height: int) -> Snapshot:
        """The header, commit and pages served now for "changed since ``since_height``".

        Raises:
            LocalProtocolError: no block decided yet.
        """
        history = self._history()
        header, commit = history.header, history.commit
        if header is None:
            raise LocalProtocolError("no block committed yet")
        # built once per height for every request that asks the same; fixed before any await
        return header, commit, history.pages(since_height, self.page_bytes)

    def register(self, record: NodeRecord, sender: bytes | None,
                 source: tuple[str, int] | None = None) -> bytes:
        """Answer a registration that came over a connection from ``source`` (remote IP and
        port; None: no IP address): the encoded response frame (``ack`` or ``error``)."""
        try:
            if sender is not None and record.peer_id != sender:
                raise RemoteProtocolError("a node may register only its own record")
            network: str | None = None
            if record.peer_id not in self._history().latest.records:
                network = self.new_identities.network_of(source[0] if source else None)
                self.new_identities.check(network, self._clock())
            if self._submit_tx(RegisterTx(record)) is not False:
                self.new_identities.charge(network, self._clock())
        except RemoteProtocolError as exc:
            self.refused += 1
            return _error(ERROR_REFUSED, f"registration refused: {exc}")
        self.registered += 1
        return _response(ack=directory_pb2.RegisterAck(expires_at_ms=record.expires_at_ms))

    def deregister(self, raw: bytes, sender: bytes | None) -> bytes:
        """Answer a deregistration (canonical DEREGISTER transaction bytes): the encoded
        response frame (``ack`` with expiry 0, or ``error``)."""
        try:
            tx = decode_tx(raw, MAX_REQUEST_BYTES)
            if not isinstance(tx, DeregisterTx):
                raise RemoteProtocolError("not a DEREGISTER transaction")
            if sender is not None and tx.peer_id != sender:
                raise RemoteProtocolError("a node may deregister only itself")
            self._submit_tx(tx)
        except RemoteProtocolError as exc:
            self.refused += 1
            return _error(ERROR_REFUSED, f"deregistration refused: {exc}")
        self.registered += 1
        return _response(ack=directory_pb2.RegisterAck(expires_at_ms=0))

    def submit_valset_update(self, raw: bytes) -> bytes:
        """Answer a ``valset_update`` request (a VALSET_UPDATE transaction's canonical bytes):
        the encoded response frame (``ack`` with expiry 0, or ``error``). Cost of a forged
        one: its decoding and at most one signature check (signers are checked to be
        validators first, and the first bad signature ends the check)."""
        try:
            tx = decode_tx(raw, MAX_REQUEST_BYTES)
            if not isinstance(tx, ValsetUpdateTx):
                raise RemoteProtocolError("not a VALSET_UPDATE transaction")
            self._submit_tx(tx)
        except RemoteProtocolError as exc:
            self.refused += 1
            return _error(ERROR_REFUSED, f"validator-set update refused: {exc}")
        return _response(ack=directory_pb2.RegisterAck(expires_at_ms=0))

    async def _answer_get(self, stream: INetStream, since_height: int, sender: bytes) -> None:
        try:
            header, commit, pages = self.snapshot(since_height)
        except LocalProtocolError as exc:
            await stream.write(_error(ERROR_UNAVAILABLE, str(exc)))
            return
        # the executed validator-set updates (none on most chains): the node follows the set
        # from the genesis to the header's height (app.validators_at)
        updates = [encode_tx(u) for u in self._history().latest.valset_updates]
        frame = _response(head=directory_pb2.CommittedHead(
            header=header_bytes(header), commit=cc.commit_to_pb(commit),
            valset_updates=updates))
        await self._write_charged(stream, frame, sender)
        for page in pages:
            await self._write_charged(stream, _response(page=page.encode()), sender)
        self.served += 1

    async def _write_charged(self, stream: INetStream, frame: bytes, sender: bytes) -> None:
        self.budgets.charge(sender, len(frame), self._clock())  # before: a failed write counts
        await stream.write(frame)

    def _over_rate(self, sender: bytes, kind: str, reason: str) -> bytes:
        self.rate_limited += 1
        if self.rate_limited in (1, 10, 100, 1000) or self.rate_limited % 10_000 == 0:
            log.warning("directory/2: %s request from %s refused: %s (%d refused so far)",
                        kind, peer_label(sender), reason, self.rate_limited)
        return _error(ERROR_UNAVAILABLE, f"{kind} refused: {reason}")

    async def _answer_read(self, stream: INetStream, request: object, kind: str,
                           sender: bytes, refusals: int) -> bool:
        """A ``get`` or ``genesis`` request within the sender's budget; False: refused (an
        error frame), or RemoteProtocolError when the stream had ``refusals`` already."""
        reason = self.budgets.admit(sender, self._clock())
        if reason is not None:
            if refusals >= MAX_REFUSALS_PER_STREAM:
                raise RemoteProtocolError(
                    f"{refusals + 1} {kind} requests over the peer's rate on one stream")
            await stream.write(self._over_rate(sender, kind, reason))
            return False
        try:
            if kind == "get":
                await self._answer_get(stream, request.get.since_height, sender)  # type: ignore[attr-defined]
            elif self.genesis_text:
                await self._write_charged(stream, _response(genesis=self.genesis_text), sender)
            else:
                await stream.write(_error(ERROR_UNAVAILABLE, "this verifier serves no genesis"))
        finally:
            self.budgets.release(sender)
        return True

    async def _handle_stream(self, stream: INetStream) -> None:
        # guarded: an exception escaping a handler kills the py-libp2p host
        sender = stream.muxed_conn.peer_id.to_bytes()
        refusals = 0
        try:
            for _ in range(MAX_REQUESTS_PER_STREAM):
                frame = None
                with trio.move_on_after(STREAM_IDLE_TIMEOUT):
                    try:
                        frame = await read_frame(stream, MAX_REQUEST_BYTES)
                    except StreamEOF:
                        break
                if frame is None:  # idle: the client opens another when it needs one
                    break
                request = parse(directory_pb2.CommitteeDirectoryRequest, frame)
                kind = request.WhichOneof("kind")
                if kind in ("get", "genesis"):
                    if not await self._answer_read(stream, request, kind, sender, refusals):
                        refusals += 1
                elif kind == "register":
                    try:
                        record = record_from_pb(request.register)
                    except RemoteProtocolError as exc:  # a field over its limit: say which
                        self.refused += 1
                        await stream.write(_error(ERROR_REFUSED, f"registration refused: {exc}"))
                        continue
                    await stream.write(self.register(record, sender,
                                                     stream.get_remote_address()))
                elif kind == "deregister":
                    await stream.write(self.deregister(request.deregister, sender))
                elif kind == "valset_update":
                    await stream.write(self.submit_valset_update(request.valset_update))
                else:
                    await stream.write(_error(ERROR_BAD_REQUEST, "empty request"))
            await stream.close()
        except RemoteProtocolError as exc:
            self.reset += 1
            log.warning("directory/2 stream from %s reset: %s", peer_label(sender), exc)
            await reset_quietly(stream)
        except StreamError as exc:
            log.info("directory/2 stream from %s failed: %r", peer_label(sender), exc)
            await reset_quietly(stream)
        except Exception:
            log.exception("directory/2 stream from %s: unexpected error", peer_label(sender))
            await reset_quietly(stream)


# ---------------------------------------------------------------------------------- client


async def _read_response(
    stream: INetStream, timeout: float
) -> directory_pb2.CommitteeDirectoryResponse:
    with trio.fail_after(timeout):
        try:
            body = await read_frame(stream, MAX_RESPONSE_BYTES)
        except StreamError as exc:
            raise RemoteProtocolError(
                f"verifier closed the directory stream without answering ({exc!r})"
            ) from exc
    return parse(directory_pb2.CommitteeDirectoryResponse, body)


def _refusal(verifier: bytes, response: directory_pb2.CommitteeDirectoryResponse) -> PsError:
    err = response.error
    return RemoteProtocolError(
        f"verifier {peer_label(verifier)} answered error {err.code}: {err.message}"
    )


async def _exchange(host: IHost, verifier: bytes, timeout: float, body: Callable) -> object:  # type: ignore[type-arg]
    return await exchange(host, verifier, COMMITTEE_DIRECTORY_PROTOCOL_ID, body, timeout=timeout)


def _stream_gone(exc: BaseException) -> bool:
    """``exc`` says the stream itself ended (closed, reset, its connection gone), not that the
    verifier refused or answered badly."""
    return isinstance(exc, StreamError) or isinstance(exc.__cause__, StreamError)


class DirectoryStreams:
    """A client's open ``/planetserve/directory/2.0.0`` streams, one per verifier, for its
    repeated requests (a node's directory refreshes).

    :meth:`exchange` runs a request on the stream held for the verifier when there is one that
    served fewer than :data:`MAX_REQUESTS_PER_STREAM` requests and was last used less than
    :data:`CLIENT_REUSE_SECONDS` ago, else on a new stream; the stream is held again only after
    a complete answer. A held stream that turns out to be gone (the server closed it, the
    connection dropped: a stream error, or the end of the stream before the answer) is reset
    and the request sent once more on a new stream; any other failure resets it and is raised.
    Concurrent requests to one verifier each get a stream (the held one goes to one of them).
    Holds at most one stream per verifier asked (the node's trusted verifiers).
    """

    def __init__(self) -> None:
        self._held: dict[bytes, tuple[INetStream, int, float]] = {}  # stream, requests, last
        self.opened = 0  # streams opened, for tests and metrics

    async def exchange(self, host: IHost, verifier: bytes, timeout: float,
                       body: Callable) -> object:  # type: ignore[type-arg]
        """``body(stream)``'s result (see the class docstring).

        Raises:
            trio.TooSlowError: no new stream within ``timeout``; what ``body`` raises;
                py-libp2p's dial and negotiation errors.
        """
        held = self._held.pop(verifier, None)
        if held is not None:
            stream, used, last = held
            if used < MAX_REQUESTS_PER_STREAM and trio.current_time() - last < CLIENT_REUSE_SECONDS:
                try:
                    result = await body(stream)
                except BaseException as exc:
                    with trio.CancelScope(shield=True):
                        await reset_quietly(stream)
                    if not (isinstance(exc, Exception) and _stream_gone(exc)):
                        raise
                    log.debug("directory stream to %s gone (%r): a new one", peer_label(verifier),
                              exc)
                else:
                    self._held[verifier] = (stream, used + 1, trio.current_time())
                    return result
            else:
                await _close_quietly(stream)
        from libp2p.peer.id import ID

        with trio.fail_after(timeout):
            stream = await host.new_stream(ID(verifier), [COMMITTEE_DIRECTORY_PROTOCOL_ID])
        self.opened += 1
        try:
            result = await body(stream)
        except BaseException:
            with trio.CancelScope(shield=True):
                await reset_quietly(stream)
            raise
        self._held[verifier] = (stream, 1, trio.current_time())
        return result

    async def aclose(self) -> None:
        """Close every held stream."""
        held, self._held = self._held, {}
        for stream, _, _ in held.values():
            await _close_quietly(stream)


async def _close_quietly(stream: INetStream) -> None:
    try:
        await stream.close()
    except Exception as exc:  # the stream or its connection is already gone
        log.debug("closing a directory stream: %r", exc)


async def register_with_committee(
    host: IHost, verifier: bytes, record: NodeRecord, *, timeout: float = 5.0
) -> int:
    """Give a committee verifier this node's own signed record (a REGISTER transaction).

    Returns:
        the record's expiry (unix ms) once the verifier took it into the committee's mempool
        (it is listed once a block commits it, typically within a second or two).

    Raises:
        RemoteProtocolError: refused (the verifier's reason is included) or a malformed answer.
        trio.TooSlowError: no answer within ``timeout`` seconds (dial, then answer).
        Exception: py-libp2p's dial and negotiation errors.
    """
    async def body(stream: INetStream) -> int:
        with trio.fail_after(timeout):
            await stream.write(encode_frame(directory_pb2.CommitteeDirectoryRequest(
                register=record_to_pb(record)).SerializeToString()))
        response = await _read_response(stream, timeout)
        kind = response.WhichOneof("kind")
        if kind == "ack":
            return response.ack.expires_at_ms
        if kind == "error":
            raise _refusal(verifier, response)
        raise RemoteProtocolError(f"verifier answered a registration with {kind!r}")

    return await _exchange(host, verifier, timeout, body)  # type: ignore[return-value]


async def deregister_from_committee(
    host: IHost, verifier: bytes, tx: DeregisterTx, *, timeout: float = 5.0
) -> None:
    """Give a committee verifier this node's own signed DEREGISTER transaction
    (:func:`~ps_p2p.registry.sign_deregister`); returns once it is in the mempool (the
    node leaves the directory when a block commits it).

    Raises:
        RemoteProtocolError: refused (the verifier's reason is included) or a malformed answer.
        trio.TooSlowError: no answer within ``timeout`` seconds (dial, then answer).
        Exception: py-libp2p's dial and negotiation errors.
    """
    async def body(stream: INetStream) -> None:
        with trio.fail_after(timeout):
            await stream.write(encode_frame(directory_pb2.CommitteeDirectoryRequest(
                deregister=encode_tx(tx)).SerializeToString()))
        response = await _read_response(stream, timeout)
        kind = response.WhichOneof("kind")
        if kind == "error":
            raise _refusal(verifier, response)
        if kind != "ack":
            raise RemoteProtocolError(f"verifier answered a deregistration with {kind!r}")

    await _exchange(host, verifier, timeout, body)


async def submit_valset_update(
    host: IHost, verifier: bytes, tx: ValsetUpdateTx, *, timeout: float = 5.0
) -> None:
    """Give a committee verifier a VALSET_UPDATE (``ps-node valset submit``); returns once it
    is in the verifier's mempool (relayed to the others; executed by the next block).

    Raises:
        RemoteProtocolError: refused (the verifier's reason is included) or a malformed answer.
        LocalProtocolError: the transaction is over :data:`MAX_REQUEST_BYTES`.
        trio.TooSlowError: no answer within ``timeout`` seconds (dial, then answer).
        Exception: py-libp2p's dial and negotiation errors.
    """
    frame = directory_pb2.CommitteeDirectoryRequest(valset_update=encode_tx(tx))
    data = encode_frame(frame.SerializeToString())
    if len(data) > MAX_REQUEST_BYTES:
        raise LocalProtocolError(
            f"validator-set update of {len(data)} bytes over a request frame's "
            f"{MAX_REQUEST_BYTES}")

    async def body(stream: INetStream) -> None:
        with trio.fail_after(timeout):
            await stream.write(data)
        response = await _read_response(stream, timeout)
        kind = response.WhichOneof("kind")
        if kind == "error":
            raise _refusal(verifier, response)
        if kind != "ack":
            raise RemoteProtocolError(f"verifier answered a validator-set update with {kind!r}")

    await _exchange(host, verifier, timeout, body)


async def fetch_genesis(host: IHost, verifier: bytes, *, timeout: float = 5.0) -> bytes:
    """Ask a verifier for its chain's genesis file.

    Returns:
        the genesis file's text (UTF-8 JSON, at most :data:`MAX_GENESIS_FRAME_BYTES`), not yet
        parsed or trusted: :func:`ps_p2p.genesis.parse_genesis_text` parses it, and the caller
        decides whether to trust its validators.

    Raises:
        RemoteProtocolError: an error reply, a malformed frame or an unexpected answer.
        trio.TooSlowError: no answer within ``timeout`` seconds (dial, then answer).
        Exception: py-libp2p's dial and negotiation errors.
    """
    async def body(stream: INetStream) -> bytes:
        with trio.fail_after(timeout):
            await stream.write(encode_frame(directory_pb2.CommitteeDirectoryRequest(
                genesis=directory_pb2.GetGenesis()).SerializeToString()))
        response = await _read_response(stream, timeout)
        kind = response.WhichOneof("kind")
        if kind == "error":
            raise _refusal(verifier, response)
        if kind != "genesis":
            raise RemoteProtocolError(f"verifier answered a genesis request with {kind!r}")
        return response.genesis

    return await _exchange(host, verifier, timeout, body)  # type: ignore[return-value]


async def fetch_committed_directory(
    host: IHost,
    verifier: bytes,
    replica: CommitteeReplica,
    *,
    now_ms: Callable[[], int],
    timeout: float = 5.0,
    streams: DirectoryStreams | None = None,
) -> Directory:
    """Bring ``replica`` up to date from one verifier and return the verified directory.

    Asks for the changes since the replica's height (everything the first time), reads the
    head frame and the page frames (each within ``timeout`` seconds, the whole delta within
    ``replica.max_delta_bytes``), then :meth:`CommitteeReplica.apply` (in a worker thread
    beyond :data:`THREAD_VERIFY_BYTES`).

    Args:
        now_ms: the node's clock (unix ms), read when the answer is verified.
        streams: the caller's open streams to reuse (None: a new stream, closed after).

    Raises:
        InvalidCommitError: the commit is not signed by more than 2/3 of the genesis power.
        InvalidDirectoryError: the pages do not give the committed app hash, or are malformed.
        DirectoryRollbackError: an older state than the replica holds (a lagging verifier).
        ExpiredError: the header is older than ``replica.max_age_ms`` (or in the future).
        RemoteProtocolError: an error reply, a malformed frame or an unexpected answer.
        trio.TooSlowError: a frame did not come within ``timeout``.
        Exception: py-libp2p's dial and negotiation errors.
    """
    async def body(stream: INetStream) -> tuple[Header, tuple[Vote, ...], list[DeltaPage],
                                                list[ValsetUpdateTx]]:
        with trio.fail_after(timeout):
            await stream.write(encode_frame(directory_pb2.CommitteeDirectoryRequest(
                get=directory_pb2.GetCommittedDirectory(since_height=replica.since())
            ).SerializeToString()))
        response = await _read_response(stream, timeout)
        kind = response.WhichOneof("kind")
        if kind == "error":
            raise _refusal(verifier, response)
        if kind != "head":
            raise RemoteProtocolError(f"verifier answered a directory request with {kind!r}")
        header = decode_header(response.head.header)
        commit = cc.commit_from_pb(response.head.commit)
        updates = []
        for raw in response.head.valset_updates:  # the frame's size bounds them
            update = decode_tx(raw, MAX_RESPONSE_BYTES)
            if not isinstance(update, ValsetUpdateTx):
                raise RemoteProtocolError("directory head lists a transaction that is no "
                                          "VALSET_UPDATE")
            updates.append(update)
        pages: list[DeltaPage] = []
        total = 0
        while not pages or not pages[-1].last:
            response = await _read_response(stream, timeout)
            if response.WhichOneof("kind") != "page":
                raise RemoteProtocolError("directory answer: a frame that is no page")
            page = DeltaPage.decode(response.page, MAX_RESPONSE_BYTES)
            total += len(page.data)
            if total > replica.max_delta_bytes:
                raise RemoteProtocolError(f"directory delta over {replica.max_delta_bytes} bytes")
            pages.append(page)
        return header, commit, pages, updates

    if streams is None:
        exchanged = await _exchange(host, verifier, timeout, body)
    else:
        exchanged = await streams.exchange(host, verifier, timeout, body)
    header, commit, pages, updates = exchanged  # type: ignore[misc]
    if sum(len(p.data) for p in pages) > THREAD_VERIFY_BYTES:
        return await trio.to_thread.run_sync(
            lambda: replica.apply(header, commit, pages, now_ms(), verifier,
                                  valset_updates=updates))
    return replica.apply(header, commit, pages, now_ms(), verifier, valset_updates=updates)


__all__ = [
    "DirectoryStreams",
    "COMMITTEE_DIRECTORY_PROTOCOL_ID",
    "MAX_CONCURRENT_ANSWERS",
    "MAX_REFUSALS_PER_STREAM",
    "MAX_REQUESTS_PER_STREAM",
    "PEER_ANSWER_BURST",
    "PEER_ANSWER_RATE",
    "TOTAL_ANSWER_BURST",
    "TOTAL_ANSWER_RATE",
    "ERROR_BAD_REQUEST",
    "ERROR_REFUSED",
    "ERROR_UNAVAILABLE",
    "MAX_GENESIS_FRAME_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "PAGE_BYTES",
    "CommitteeDirectoryService",
    "deregister_from_committee",
    "submit_valset_update",
    "Snapshot",
    "fetch_committed_directory",
    "fetch_genesis",
    "register_with_committee",
]
