"""Anonymous requests of one user node (pure core, sans-I/O).

PlanetServe sec. 3.2 ("Request", "Response") with the fixes of DESIGN.md:

* a request waits until n paths with at least k distinct proxies are ready (then up to
  ``distinct_proxy_grace`` s more for n distinct proxies), and is sent as one *attempt*: Q (with a fresh reply tag per path) is
  S-IDA-encoded into n cloves, clove i over path i to the model node;
* an attempt unanswered for ``attempt_wait(max_tokens) * 2**(attempt - 1)`` s, or left with
  fewer than k of its paths, is followed by another (same request ID, fresh paths and tags);
  the paths of the unanswered attempt that brought nothing back are reported
  (:class:`PathSilent`: the pool suspends and probes them) and the next attempt avoids them;
  when one of its paths dies while k or more are left, that path's clove is re-sent on a spare;
* response cloves come back through the reply proxies, each under the reply tag registered with
  that path's proxy; the answer decodes from any k, and is accepted only when the model node
  asked signed it (over Q's hash) and the directory lists it as a model node;
* conviction only on evidence the accused alone could have produced: a clove under a tag this
  user registered on that very path, whose signature fails under the tag's model node, convicts
  that path's proxy (it forwards a reply under the tag only once that signature verified);
  a clove under an unknown tag, on another path, or validly signed but not fitting its tag
  convicts nobody;
* the cloves that arrived are audited against the verified answer, which is kept a while to
  check late cloves too;
* a streamed request (``RequestSpec.stream``; docs/streaming.md) is answered in segments, each
  its own S-IDA message under :func:`~ps_p2p.responses.segment_message_id` (so its signed
  cloves name their place): text is released (:class:`StreamText`) in order and only once,
  across attempts too; the last segment carries the reply signed over the whole text, which
  must extend what was released;
* every request ends once, with an :class:`Outcome`: a verified reply, or an error of the
  ``RequestError`` tree (:mod:`ps_p2p.errors`).

Inputs are method calls that take ``now`` (seconds) and, where paths are needed, the ready paths
(objects with ``path_id`` and ``proxy``, e.g. :class:`~ps_p2p.overlay.path_pool.PoolPath`); they
return commands. :meth:`RequestCore.next_deadline` says when :meth:`RequestCore.tick` is due.
Wire encoding is injected (:class:`WireCodec`); randomness is the injected ``rng`` (proxy choice:
one shuffle per attempt; spare choice) and ``random_bytes`` (reply tags, then S-IDA keys).
Signature checks default to :mod:`ps_p2p.records` / :mod:`ps_p2p.responses` and may be injected.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ps_p2p import records, responses
from ps_p2p.crypto import onion, sida
from ps_p2p.errors import (
    LocalProtocolError,
    DecodeError,
    ModelNodeLostError,
    InvalidSignatureError,
    NoPathError,
    PsError,
    RemoteProtocolError,
    RequestError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from ps_p2p.inference import (
    ChatMessage,
    InferenceQuery,
    InferenceReply,
    ReplyProxy,
    ResponseSegment,
    ResponseStatus,
    SamplingParams,
    status_error,
)
from ps_p2p.overlay.path_pool import choose_distinct_proxies
from ps_p2p.overlay.reassembly import CloveAssembler, MessageReassembled, ReassemblyFailed
from ps_p2p.records import short_peer_id as _short

log = logging.getLogger(__name__)

#: Response cloves of one request kept for the audit.
MAX_RECEIVED_CLOVES = 64
#: Decoded responses kept to check late cloves against.
MAX_AUDITS = 256
#: Reply tags remembered (for late cloves too): a few thousand requests' worth.
MAX_REPLY_TAGS = MAX_AUDITS * sida.MAX_TOTAL
#: Segments of a streamed answer at most (what a model node sends: ps_p2p.serving.dispatch).
MAX_SEGMENTS = 128
#: Text of one streamed answer at most (UTF-8 bytes), all segments of one attempt together.
MAX_STREAM_BYTES = sida.MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class RequestConfig:
    """Request settings; times in seconds.

    Attributes:
        total, threshold: n cloves per message, k to decode.
        attempt_timeout: base of the wait before another attempt (see :meth:`RequestCore.attempt_wait`).
        token_time: seconds allowed per requested token before the time per token is measured;
            afterwards twice the measured time (EWMA, 1/8) when that is longer.
        distinct_proxy_grace: once n paths are ready, wait this long for n distinct proxies.
        max_clove_bytes: a clove (with its delivery header) must fit one cell's payload.
    """

    total: int = sida.DEFAULT_TOTAL
    threshold: int = sida.DEFAULT_THRESHOLD
    attempt_timeout: float = 8.0
    token_time: float = 0.05
    distinct_proxy_grace: float = 1.0
    max_clove_bytes: int = onion.MAX_CELL_PAYLOAD


class WireCodec(Protocol):
    """Wire conversions the service layer provides (protobuf there, anything in tests)."""

    def encode_request(self, query: InferenceQuery) -> bytes:
        """Q's bytes as the model node will decode and hash them."""

    def decode_response(self, payload: bytes) -> InferenceReply:
        """Parse a reassembled response. Raises RemoteProtocolError when malformed."""

    def clove_size(self, clove: sida.Clove) -> int:
        """Bytes the clove takes in a cell's payload, delivery header included."""

    def decode_segment(self, payload: bytes) -> ResponseSegment:
        """Parse a reassembled segment of a streamed answer. Raises RemoteProtocolError."""


class PathRef(Protocol):
    """A ready path as the request core sees it."""

    @property
    def path_id(self) -> int: ...

    @property
    def proxy(self) -> bytes: ...


CloveVerifier = Callable[[bytes, bytes, bytes, bytes], bool]
"""``(model_node, message_id, clove_bytes, signature) -> bool``: the model node signed the clove."""
ReplyVerifier = Callable[[InferenceReply], None]
"""Raises InvalidSignatureError (or RemoteProtocolError) unless the reply's signature verifies."""


def verify_clove_signature(model_node: bytes, message_id: bytes, raw: bytes, signature: bytes) -> bool:
    """The default :data:`CloveVerifier` (Ed25519 over ``records.clove_signing_bytes``)."""
    try:
        records.verify_signature(model_node, records.clove_signing_bytes(message_id, raw), signature)
    except (InvalidSignatureError, RemoteProtocolError):
        return False
    return True


def verify_reply_signature(reply: InferenceReply) -> None:
    """The default :data:`ReplyVerifier` (:func:`ps_p2p.responses.verify_response`, and
    :func:`ps_p2p.responses.verify_forward` for a forwarded reply)."""
    responses.verify_response(
        request_id=reply.request_id,
        req_hash=reply.request_hash,
        content=reply.content(),
        signed_at_ms=reply.signed_at_ms,
        model_node=reply.model_node,
        signature=reply.signature,
    )
    if reply.forwarded_by or reply.forward_signature:
        responses.verify_forward(reply.forwarded_by, reply.request_id, reply.request_hash,
                                 reply.model_node, reply.forward_signature)


# ---------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class RequestSpec:
    """One request as the application asks it.

    Attributes:
        destination: peer ID of the model node asked.
        prompt: the prompt; "" for a chat (``messages``).
        timeout: seconds from :meth:`RequestCore.start` until the request fails.
        stream: have the answer streamed (:class:`StreamText` commands as it comes).
        messages: a chat, rendered by the model node with its model's chat template.
        switch_model_node: when the model node is lost mid-request
            (:meth:`RequestCore.delivery_failed`), ask another of the model instead of failing.
    """

    request_id: bytes
    destination: bytes
    model_id: str
    prompt: str
    params: SamplingParams
    timeout: float
    stream: bool = False
    messages: tuple[ChatMessage, ...] = ()
    switch_model_node: bool = True


@dataclass(frozen=True)
class ResponseClove:
    """A signed response clove that came back on path ``path_id``.

    Attributes:
        clove: parsed and checked (``Clove.check``) by the service layer.
        raw: its bytes as received (what the signature covers).
    """

    path_id: int
    clove: sida.Clove
    raw: bytes
    signature: bytes
    reply_tag: bytes


# ---------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class SendClove:
    """Send ``clove`` over the path to ``destination`` (registering ``reply_tag`` at its proxy
    for ``max_replies`` response cloves, 0 meaning 1; empty for a clove re-sent on a spare
    path)."""

    path_id: int
    destination: bytes
    clove: sida.Clove
    reply_tag: bytes
    max_replies: int = 0


@dataclass(frozen=True)
class StreamText:
    """The next piece of a streamed request's answer, in order (never text sent before)."""

    request_id: bytes
    text: str


@dataclass(frozen=True)
class ConvictProxy:
    """``proxy`` altered a response clove (see the module docstring): avoid it."""

    proxy: bytes


@dataclass(frozen=True)
class Outcome:
    """How a request ended.

    Attributes:
        reply: the verified reply (status OK or a signed error status); None when none came.
        error: None for a verified status-OK reply; else the ``RequestError`` it ended with
            (e.g. :class:`~ps_p2p.errors.OverloadedError` for a signed OVERLOADED reply,
            :class:`~ps_p2p.errors.RequestTimeoutError`, :class:`~ps_p2p.errors.NoPathError`).
        cloves_received: response cloves fed to the request's reassembly.
        attempts: attempts sent.
        latency: seconds from start to the end.
        request: the bytes of the Q that ``reply`` answers (its request hash is their
            SHA-256); b"" without a reply.
    """

    request_id: bytes
    reply: InferenceReply | None
    error: PsError | None
    cloves_received: int
    attempts: int
    latency: float
    request: bytes = b""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RequestDone:
    """The request ended; it is forgotten (apart from the audit of its answer)."""

    outcome: Outcome


@dataclass(frozen=True)
class PathSilent:
    """A clove of an attempt that went unanswered was sent on this path and nothing came back
    on it for that attempt: the path pool should suspend and probe it
    (:meth:`~ps_p2p.overlay.path_pool.PathPool.path_silent`)."""

    path_id: int


Command = SendClove | ConvictProxy | StreamText | RequestDone | PathSilent


# ---------------------------------------------------------------------------------- state


@dataclass
class _Attempt:
    q_bytes: bytes
    req_hash: bytes
    cloves: list[sida.Clove]
    path_ids: list[int]  # clove i (and response clove i) goes over path_ids[i]
    sent_at: float
    response_id: bytes  # S-IDA message ID of the answer to this attempt
    lost: set[int] = field(default_factory=set)
    # streamed: segment message ID -> seq; decoded segments not yet in order; the text so far
    segment_ids: dict[bytes, int] = field(default_factory=dict)
    segments: dict[int, ResponseSegment] = field(default_factory=dict)
    next_seq: int = 0
    text: bytearray = field(default_factory=bytearray)
    # indices of cloves whose proxy lost the model node (delivery_failed)
    undeliverable: set[int] = field(default_factory=set)
    # paths something came back on for this attempt (a response clove, a delivery notice)
    heard: set[int] = field(default_factory=set)


@dataclass
class _Request:
    spec: RequestSpec
    started_at: float
    deadline: float
    waiting: bool = True  # for paths; False: an attempt is out
    ready_since: float | None = None
    retry_at: float = 0.0
    retry_now: bool = False
    attempts: list[_Attempt] = field(default_factory=list)
    assembler: CloveAssembler = field(default_factory=CloveAssembler)
    cloves_received: int = 0
    received: list[tuple[sida.Clove, int]] = field(default_factory=list)
    released: bytearray = field(default_factory=bytearray)  # streamed text given out so far
    lost_model_nodes: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class ReplyTag:
    """What this user registered a reply tag for: the model node asked, the path whose proxy
    holds the tag, and which response clove may come back under it."""

    destination: bytes
    path_id: int
    proxy: bytes
    response_id: bytes
    index: int
    total: int
    stream: bool = False


@dataclass
class Audit:
    """A decoded response, kept a while to check the cloves that arrive after it."""

    good: list[sida.Clove]
    payload: bytes
    destination: bytes = b""  # the model node that signed the answer


def consistent(audit: Audit, clove: sida.Clove) -> bool:
    """Whether ``clove`` belongs to the same S-IDA encoding as the audit's verified answer."""
    for good in audit.good:
        if good.index == clove.index:
            return good == clove
    try:
        return sida.decode_subset([*audit.good[1:], clove]) == audit.payload
    except (DecodeError, RemoteProtocolError):
        return False


class RequestCore:
    """Attempts, response cloves, verification, audit and outcomes of a user's requests.

    Args:
        config: :class:`RequestConfig`.
        codec: :class:`WireCodec`.
        is_model_node: whether the current directory lists a peer as a model node.
        rng: proxy and spare choice.
        random_bytes: reply tags and S-IDA keys.
        verify_clove, verify_reply: signature checks (defaults: Ed25519 via ps_p2p.records).
        model_nodes: ``model_nodes(model_id) -> peer IDs`` of the directory's model nodes of
            that model: where a request goes when its model node is lost
            (:meth:`delivery_failed`). Default: none (the request then fails).
        choose_model_node: picks the replacement among those peer IDs (non-empty); default
            ``rng.choice`` (a user passes its reputation-weighted choice).

    Attributes:
        misrouted_cloves: response cloves dropped without blame (unknown tag, wrong path,
            not fitting their tag, unsigned).
        audits: response message ID -> :class:`Audit`, oldest first (at most MAX_AUDITS).
        token_time: measured seconds per token (EWMA, 1/8; Karn: single-attempt answers only).
    """

    def __init__(
        self,
        config: RequestConfig,
        codec: WireCodec,
        is_model_node: Callable[[bytes], bool],
        *,
        rng: random.Random,
        random_bytes: Callable[[int], bytes] = os.urandom,
        verify_clove: CloveVerifier = verify_clove_signature,
        verify_reply: ReplyVerifier = verify_reply_signature,
        model_nodes: Callable[[str], Sequence[bytes]] = lambda model_id: (),
        choose_model_node: Callable[[Sequence[bytes]], bytes] | None = None,
    ) -> None:
        self.config = config
        self._model_nodes = model_nodes
        self._choose_model_node = choose_model_node
        self._codec = codec
        self._is_model_node = is_model_node
        self._rng = rng
        self._random_bytes = random_bytes
        self._verify_clove = verify_clove
        self._verify_reply = verify_reply
        self._requests: dict[bytes, _Request] = {}
        # response message ID (one per attempt; one per segment of a streamed attempt) -> its
        # request and attempt
        self._by_response_id: dict[bytes, _Request] = {}
        self._by_segment_id: dict[bytes, tuple[_Request, _Attempt]] = {}
        self._reply_tags: OrderedDict[bytes, ReplyTag] = OrderedDict()
        self.audits: OrderedDict[bytes, Audit] = OrderedDict()
        self.misrouted_cloves = 0
        #: model nodes found lost (more than n - k proxies of a request lost them), oldest
        #: first, until :meth:`take_lost_model_nodes`
        self._lost_model_nodes: list[bytes] = []
        self.token_time = config.token_time

    # ------------------------------------------------------------------ queries

    def __contains__(self, request_id: bytes) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def attempts(self, request_id: bytes) -> int:
        request = self._requests.get(request_id)
        return len(request.attempts) if request is not None else 0

    def attempt_wait(self, max_tokens: int) -> float:
        """Seconds to wait for an answer before the first resend: ``attempt_timeout`` plus
        ``max_tokens`` times the larger of ``token_time`` and twice the measured time per
        token (so a 36 s answer is not resent while it is being generated); it doubles with
        every attempt. Resending is cheap: the model node joins a repeated request to the one
        in service."""
        per_token = max(self.config.token_time, 2 * self.token_time)
        return self.config.attempt_timeout + max_tokens * per_token

    def next_deadline(self) -> float | None:
        """When :meth:`tick` is next due (seconds); None: nothing pending."""
        deadlines = []
        for request in self._requests.values():
            deadlines.append(request.deadline)
            if not request.waiting:
                deadlines.append(request.retry_at)
            elif request.ready_since is not None:
                deadlines.append(request.ready_since + self.config.distinct_proxy_grace)
        return min(deadlines, default=None)

    # ------------------------------------------------------------------ inputs

    def start(self, spec: RequestSpec, now: float, ready: Sequence[PathRef]) -> list[Command]:
        """Take a request; its first attempt goes out as soon as paths allow (maybe now)."""
        if spec.request_id in self._requests:
            raise LocalProtocolError("request ID already pending")
        self._requests[spec.request_id] = _Request(spec, now, now + spec.timeout)
        return self.tick(now, ready)

    def cancel(self, request_id: bytes) -> list[Command]:
        """Forget a request without an outcome (its caller is gone)."""
        request = self._requests.get(request_id)
        if request is not None:
            self._forget(request)
        return []

    def tick(self, now: float, ready: Sequence[PathRef]) -> list[Command]:
        """Deadlines, resends, and attempts of requests waiting for paths."""
        commands: list[Command] = []
        for request in list(self._requests.values()):
            if now >= request.deadline:
                commands += self._finish(request, None, self._deadline_error(request, ready), now)
                continue
            usable = ready
            if not request.waiting and (request.retry_now or now >= request.retry_at):
                log.warning("request %s: no answer on attempt %d; resending on fresh paths",
                            request.spec.request_id.hex()[:8], len(request.attempts))
                request.waiting = True
                request.ready_since = None
                attempt = request.attempts[-1]
                silent = [p for p in attempt.path_ids
                          if p not in attempt.heard and p not in attempt.lost]
                commands += [PathSilent(p) for p in silent]
                # the pool takes them out of its ready set (this tick already has its list): the
                # resend goes on other paths where enough are ready, else at once on these (a
                # model node that was only slow: their probes clear them a round trip later)
                others = [p for p in ready if p.path_id not in silent]
                if (len(others) >= self.config.total
                        and len({p.proxy for p in others}) >= self.config.threshold):
                    usable = others
            if request.waiting:
                commands += self._maybe_send(request, now, usable)
        return commands

    def path_lost(self, path_id: int, now: float, ready: Sequence[PathRef]) -> list[Command]:
        """A path died: each request whose last attempt used it re-sends that clove on a spare
        path, or makes another attempt when fewer than k of its paths are left."""
        commands: list[Command] = []
        for request in self._requests.values():
            if not request.attempts:
                continue
            attempt = request.attempts[-1]
            if path_id not in attempt.path_ids or path_id in attempt.lost:
                continue
            attempt.lost.add(path_id)
            if len(attempt.path_ids) - len(attempt.lost) < self.config.threshold:
                request.retry_now = True
                continue
            # re-send the lost path's clove on a spare path (duplicates are dropped downstream)
            index = attempt.path_ids.index(path_id)
            spares = [p for p in ready if p.path_id not in attempt.path_ids]
            if spares:
                spare = self._rng.choice(spares)
                commands.append(
                    SendClove(spare.path_id, request.spec.destination, attempt.cloves[index], b"")
                )
        return commands

    def delivery_failed(self, reply_tag: bytes, path_id: int, now: float) -> list[Command]:
        """A proxy lost the model node that a clove of this user's went to, before it answered
        (``DeliveryFailed`` with ``reply_tag`` on path ``path_id``).

        Once more than n - k proxies of a request's last attempt said so, k response cloves
        can no longer come: the request asks another model node of the same model at once
        (fresh paths and tags, on the next tick), or, with none left (or
        ``switch_model_node`` off), ends with :class:`~ps_p2p.errors.ModelNodeLostError`.
        A notice counts only under a tag this user registered on that very path (only that
        path's proxy can send on it), once per clove; so it takes more than n - k lying
        proxies to move a request, which could make it fail anyway.

        Returns:
            [] or ``[RequestDone]`` (the request failed).
        """
        registered = self._reply_tags.get(reply_tag)
        if registered is None or registered.path_id != path_id:
            self.misrouted_cloves += 1
            log.warning("delivery failure under a reply tag not registered on its path; dropped")
            return []
        self._heard(registered)
        request = self._by_response_id.get(registered.response_id)
        if request is None or request.attempts[-1].response_id != registered.response_id:
            return []  # ended, or an earlier attempt's
        if registered.destination != request.spec.destination:
            return []  # about the model node the request already left (a late notice)
        attempt = request.attempts[-1]
        attempt.undeliverable.add(registered.index)
        if len(attempt.undeliverable) <= self.config.total - self.config.threshold:
            return []
        lost = request.spec.destination
        request.lost_model_nodes.add(lost)
        self._lost_model_nodes.append(lost)
        others = [
            peer for peer in self._model_nodes(request.spec.model_id)
            if peer not in request.lost_model_nodes
        ] if request.spec.switch_model_node else []
        if not others:
            error = ModelNodeLostError(
                f"model node {_short(lost)} stopped answering ({len(attempt.undeliverable)} of "
                f"{len(attempt.path_ids)} proxies lost it)"
            )
            return self._finish(request, None, error, now)
        target = (self._choose_model_node(others) if self._choose_model_node is not None
                  else self._rng.choice(others))
        log.warning("request %s: model node %s stopped answering; asking %s",
                    request.spec.request_id.hex()[:8], _short(lost), _short(target))
        request.spec = dataclasses.replace(request.spec, destination=target)
        request.waiting = True  # a fresh attempt as soon as paths allow
        request.ready_since = None
        return []

    def take_lost_model_nodes(self) -> list[bytes]:
        """The model nodes :meth:`delivery_failed` found lost since the last call (peer IDs,
        in the order found; a node lost by two requests is named twice)."""
        lost, self._lost_model_nodes = self._lost_model_nodes, []
        return lost

    def unsigned_clove(self) -> list[Command]:
        """An unsigned response clove came back (nothing any proxy vouched for): dropped."""
        self.misrouted_cloves += 1
        log.warning("unsigned response clove dropped")
        return []

    def response_clove(self, event: ResponseClove, now: float) -> list[Command]:
        """Check one response clove and feed it to its request (see the module docstring)."""
        clove = event.clove
        registered = self._reply_tags.get(event.reply_tag)
        if registered is None or registered.path_id != event.path_id:
            self.misrouted_cloves += 1
            log.warning("response clove under a reply tag not registered on its path; dropped")
            return []
        if not self._verify_clove(registered.destination, clove.message_id, event.raw, event.signature):
            # only the proxy sees a clove in the clear (relays are held off by the end-to-end
            # layer), and it forwards a reply under this tag only once the signature verified
            return [ConvictProxy(registered.proxy)]
        self._heard(registered)
        if registered.stream:
            streamed = self._by_segment_id.get(clove.message_id)
            if streamed is None:
                return []  # a late segment of a request that ended (or a stray one): no blame
            if streamed[1].response_id != registered.response_id:
                self.misrouted_cloves += 1
                log.warning("model node %s signed a segment of another answer under a tag; "
                            "dropped", _short(registered.destination))
                return []
            return self._segment_clove(streamed[0], streamed[1], event, now)
        if (
            clove.message_id != registered.response_id
            or clove.index != registered.index
            or (clove.total, clove.threshold) != (registered.total, self.config.threshold)
        ):
            self.misrouted_cloves += 1
            log.warning("model node %s signed a clove that does not fit its reply tag; dropped",
                        _short(registered.destination))
            return []
        request = self._by_response_id.get(clove.message_id)
        if request is None:
            audit = self.audits.get(clove.message_id)
            if audit is not None and not consistent(audit, clove):
                log.warning("model node %s signed a clove that is not part of its answer",
                            _short(audit.destination))
            return []
        request.cloves_received += 1
        if len(request.received) < MAX_RECEIVED_CLOVES:
            request.received.append((clove, event.path_id))
        try:
            events = request.assembler.receive_clove(clove, now)
        except RemoteProtocolError as exc:
            log.warning("inconsistent response clove dropped: %s", exc)
            return []
        commands: list[Command] = []
        for reassembly in events:
            if isinstance(reassembly, ReassemblyFailed):
                log.warning("response %s did not decode: %s",
                            clove.message_id.hex()[:8], reassembly.reason)
                request.assembler = CloveAssembler()
            elif isinstance(reassembly, MessageReassembled):
                commands += self._on_response(request, reassembly.payload, reassembly.message_id, now)
        return commands

    def _segment_clove(
        self, request: _Request, attempt: _Attempt, event: ResponseClove, now: float
    ) -> list[Command]:
        """A signed clove of a segment of a streamed attempt (tag and signature checked)."""
        clove = event.clove
        registered = self._reply_tags[event.reply_tag]
        if clove.index != registered.index or (clove.total, clove.threshold) != (
            registered.total, self.config.threshold
        ):
            self.misrouted_cloves += 1
            log.warning("model node %s signed a segment clove that does not fit its reply tag; "
                        "dropped", _short(registered.destination))
            return []
        request.cloves_received += 1
        try:
            events = request.assembler.receive_clove(clove, now)
        except RemoteProtocolError as exc:
            log.warning("inconsistent segment clove dropped: %s", exc)
            return []
        commands: list[Command] = []
        for reassembly in events:
            if isinstance(reassembly, ReassemblyFailed):
                log.warning("segment %s did not decode: %s",
                            reassembly.message_id.hex()[:8], reassembly.reason)
            elif isinstance(reassembly, MessageReassembled):
                commands += self._on_segment(request, attempt, reassembly.message_id,
                                             reassembly.payload, now)
            if request.spec.request_id not in self._requests:
                break
        return commands

    def _on_segment(
        self, request: _Request, attempt: _Attempt, message_id: bytes, payload: bytes, now: float
    ) -> list[Command]:
        seq = attempt.segment_ids.get(message_id)
        if seq is None or seq < attempt.next_seq or seq in attempt.segments:
            return []
        try:
            segment = self._codec.decode_segment(payload)
        except RemoteProtocolError as exc:
            log.warning("undecodable segment dropped: %s", exc)
            return []
        if segment.request_id != request.spec.request_id or segment.seq != seq:
            log.warning("segment %d of %s names another place; dropped",
                        seq, request.spec.request_id.hex()[:8])
            return []
        attempt.segments[seq] = segment
        # a stream that moves is not resent
        request.retry_at = max(request.retry_at, now + self.config.attempt_timeout)
        commands: list[Command] = []
        while attempt.next_seq in attempt.segments:
            segment = attempt.segments.pop(attempt.next_seq)
            attempt.next_seq += 1
            data = segment.text.encode("utf-8", "surrogatepass")
            if segment.offset != len(attempt.text) or len(attempt.text) + len(data) > MAX_STREAM_BYTES:
                log.warning("segment %d of %s does not follow the text before it; attempt "
                            "abandoned", segment.seq, request.spec.request_id.hex()[:8])
                self._drop_segments(attempt)
                request.retry_now = True
                return commands
            attempt.text += data
            if segment.final is None:
                commands += self._release(request, bytes(attempt.text))
                continue
            reply = dataclasses.replace(
                segment.final, text=attempt.text.decode("utf-8", "surrogatepass")
            )
            if not attempt.text.startswith(request.released):
                # the model node signed other text than it streamed: only it could have
                log.warning("model node %s streamed text its signed answer does not have",
                            _short(request.spec.destination))
                self._drop_segments(attempt)
                return commands
            commands += self._release(request, bytes(attempt.text))
            return commands + self._on_reply(request, reply, now)
        return commands

    def _release(self, request: _Request, text: bytes) -> list[Command]:
        """Give out the part of ``text`` (an attempt's text so far) not given out yet."""
        if len(text) <= len(request.released) or not text.startswith(request.released):
            return []
        new = text[len(request.released):]
        request.released += new
        return [StreamText(request.spec.request_id, new.decode("utf-8", "surrogatepass"))]

    def _drop_segments(self, attempt: _Attempt) -> None:
        for message_id in attempt.segment_ids:
            self._by_segment_id.pop(message_id, None)
        attempt.segments.clear()

    # ------------------------------------------------------------------ internals

    def _heard(self, registered: ReplyTag) -> None:
        """Something signed came back under ``registered`` on its path: the path answers."""
        request = self._by_response_id.get(registered.response_id)
        if request is None:
            return
        for attempt in request.attempts:
            if attempt.response_id == registered.response_id:
                attempt.heard.add(registered.path_id)

    def _deadline_error(self, request: _Request, ready: Sequence[PathRef]) -> RequestError:
        timeout = request.spec.timeout
        if request.attempts:
            return RequestTimeoutError(f"no answer within {timeout:.0f} s")
        if len(ready) >= self.config.total:
            distinct = len({p.proxy for p in ready})
            return NoPathError(
                f"only {distinct} distinct proxies among {len(ready)} ready paths after "
                f"{timeout:.0f} s; a request needs {self.config.threshold}"
            )
        return NoPathError(
            f"only {len(ready)} of {self.config.total} paths ready after {timeout:.0f} s"
        )

    def _maybe_send(self, request: _Request, now: float, ready: Sequence[PathRef]) -> list[Command]:
        n = self.config.total
        distinct = len({p.proxy for p in ready})
        if len(ready) < n or distinct < self.config.threshold:
            # a model node counts one clove per proxy and request: with fewer than k distinct
            # proxies an attempt could never decode (a pool still rebalancing after its start)
            request.ready_since = None
            return []
        if request.ready_since is None:
            request.ready_since = now
        if distinct < n and now - request.ready_since < self.config.distinct_proxy_grace:
            return []  # the pool may be rebuilding after a loss
        try:
            return self._send_attempt(request, now, ready)
        except RequestError as exc:
            return self._finish(request, None, exc, now)

    def _send_attempt(self, request: _Request, now: float, ready: Sequence[PathRef]) -> list[Command]:
        cfg = self.config
        spec = request.spec
        chosen = choose_distinct_proxies(ready, cfg.total, self._rng)
        # A fresh reply tag per request and path: the model node answers proxy i under tag i,
        # so no lasting path ID links this user's requests; fresh tags also make every
        # attempt's Q (and so its response ID) differ from the earlier ones.
        tags = [self._random_bytes(16) for _ in chosen]
        query = InferenceQuery(
            request_id=spec.request_id,
            model_id=spec.model_id,
            prompt=spec.prompt,
            params=spec.params,
            reply_proxies=tuple(ReplyProxy(p.proxy, tag) for p, tag in zip(chosen, tags)),
            stream=spec.stream,
            messages=spec.messages,
        )
        q_bytes = self._codec.encode_request(query)
        if len(q_bytes) > sida.MAX_MESSAGE_BYTES:
            raise RequestTooLargeError(
                f"request of {len(q_bytes)} bytes is over the {sida.MAX_MESSAGE_BYTES}-byte limit"
            )
        cloves = sida.encode(
            q_bytes, total=cfg.total, threshold=cfg.threshold, random_bytes=self._random_bytes
        )
        clove_bytes = self._codec.clove_size(cloves[0])
        if clove_bytes > cfg.max_clove_bytes:
            raise RequestTooLargeError(
                f"request of {len(q_bytes)} bytes gives cloves of {clove_bytes} bytes, over the "
                f"{cfg.max_clove_bytes}-byte cell limit; shorten the prompt"
            )
        req_hash = responses.request_hash(q_bytes)
        attempt = _Attempt(
            q_bytes, req_hash, cloves, [p.path_id for p in chosen], now,
            responses.response_message_id(spec.request_id, req_hash),
        )
        request.attempts.append(attempt)
        request.waiting = False
        request.retry_now = False
        request.retry_at = now + self.attempt_wait(spec.params.max_tokens) * 2 ** (
            len(request.attempts) - 1
        )
        self._by_response_id[attempt.response_id] = request
        if spec.stream:
            for seq in range(MAX_SEGMENTS):
                segment_id = responses.segment_message_id(attempt.response_id, seq)
                attempt.segment_ids[segment_id] = seq
                self._by_segment_id[segment_id] = (request, attempt)
        commands: list[Command] = []
        for index, (path, clove, tag) in enumerate(zip(chosen, cloves, tags)):
            self._reply_tags[tag] = ReplyTag(
                spec.destination, path.path_id, path.proxy, attempt.response_id, index,
                len(chosen), spec.stream,
            )
            while len(self._reply_tags) > MAX_REPLY_TAGS:
                self._reply_tags.popitem(last=False)
            commands.append(SendClove(
                path.path_id, spec.destination, clove, tag, MAX_SEGMENTS if spec.stream else 0
            ))
        return commands

    def _on_response(
        self, request: _Request, payload: bytes, message_id: bytes, now: float
    ) -> list[Command]:
        try:
            reply = self._codec.decode_response(payload)
        except RemoteProtocolError as exc:
            log.warning("undecodable response dropped: %s", exc)
            return []
        commands = self._on_reply(request, reply, now)
        if commands:
            try:
                self._audit(request, message_id, payload)
            except Exception:  # the answer stands whatever the audit hits
                log.exception("audit of the response to %s failed",
                              request.spec.request_id.hex()[:8])
        return commands

    def _on_reply(self, request: _Request, reply: InferenceReply, now: float) -> list[Command]:
        """A decoded reply (of a whole answer, or the last segment of a streamed one): checked,
        then the request ends with it; nothing when it is rejected."""
        try:
            self._check_reply(request, reply)
        except (InvalidSignatureError, RemoteProtocolError) as exc:
            # the request goes on: another attempt may bring a good answer
            log.warning("response to %s rejected: %s: %s",
                        request.spec.request_id.hex()[:8], type(exc).__name__, exc)
            return []
        error: RequestError | None = None
        if reply.status == ResponseStatus.OK:
            if reply.completion_tokens and len(request.attempts) == 1:  # Karn: one attempt
                measured = (now - request.started_at) / reply.completion_tokens
                self.token_time += (measured - self.token_time) / 8
        else:
            error = status_error(reply.status, reply.error)
        return self._finish(request, reply, error, now)

    def _check_reply(self, request: _Request, reply: InferenceReply) -> None:
        spec = request.spec
        if reply.request_id != spec.request_id:
            raise RemoteProtocolError("response for another request")
        if not any(a.req_hash == reply.request_hash for a in request.attempts):
            raise RemoteProtocolError("response signs a request we did not send")
        if not self._is_model_node(reply.model_node):
            raise InvalidSignatureError(
                "response signed by a node that is no model node of the directory"
            )
        if reply.forwarded_by or reply.forward_signature:
            # forwarded (sec. 3.3): served by another model node of the group, vouched for by
            # the one asked (which relays the cloves: their signatures are its own)
            if reply.forwarded_by != spec.destination:
                raise RemoteProtocolError("response forwarded by another node than the one asked")
            if reply.model_node == reply.forwarded_by:
                raise RemoteProtocolError("response forwarded by its own signer")
            if reply.model_node not in self._model_nodes(spec.model_id):
                raise RemoteProtocolError(
                    f"response served by a node the directory does not list for {spec.model_id!r}"
                )  # the voucher's signature: self._verify_reply
        elif reply.model_node != spec.destination:
            raise RemoteProtocolError("response signed by another model node than the one asked")
        if reply.status == ResponseStatus.OK and reply.model_id != spec.model_id:
            raise RemoteProtocolError(
                f"response from model {reply.model_id!r}, asked {spec.model_id!r}"
            )
        self._verify_reply(reply)

    def _finish(
        self, request: _Request, reply: InferenceReply | None, error: PsError | None, now: float
    ) -> list[Command]:
        self._forget(request)
        answered = b"" if reply is None else next(
            (a.q_bytes for a in request.attempts if a.req_hash == reply.request_hash), b"")
        outcome = Outcome(
            request_id=request.spec.request_id,
            reply=reply,
            error=error,
            cloves_received=request.cloves_received,
            attempts=len(request.attempts),
            latency=now - request.started_at,
            request=answered,
        )
        return [RequestDone(outcome)]

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.spec.request_id, None)
        for attempt in request.attempts:
            self._by_response_id.pop(attempt.response_id, None)
            self._drop_segments(attempt)

    def _audit(self, request: _Request, message_id: bytes, payload: bytes) -> None:
        """Check the response cloves against the verified answer, and keep the answer a while
        to check late cloves (their signatures convict an altering proxy; signed cloves that do
        not fit the answer are the model node's own doing and are logged)."""
        received = [c for c, _ in request.received if c.message_id == message_id]
        distinct: dict[int, sida.Clove] = {}
        for clove in received:
            distinct.setdefault(clove.index, clove)
        good: list[sida.Clove] | None = None
        for subset in itertools.combinations(list(distinct.values()), self.config.threshold):
            try:
                if sida.decode_subset(list(subset)) == payload:
                    good = list(subset)
                    break
            except (DecodeError, RemoteProtocolError):
                continue
        if good is None:
            return
        audit = Audit(good, payload, request.spec.destination)
        if any(not consistent(audit, clove) for clove in received):
            # every clove here carries the model node's valid signature: its own doing
            log.warning("model node %s signed cloves that are not part of its answer",
                        _short(request.spec.destination))
        self.audits[message_id] = audit
        while len(self.audits) > MAX_AUDITS:
            self.audits.popitem(last=False)


__all__ = [
    "Audit",
    "Command",
    "ConvictProxy",
    "Outcome",
    "PathSilent",
    "ReplyTag",
    "RequestConfig",
    "RequestCore",
    "RequestDone",
    "RequestSpec",
    "ResponseClove",
    "SendClove",
    "StreamText",
    "WireCodec",
    "consistent",
    "verify_clove_signature",
    "verify_reply_signature",
]
