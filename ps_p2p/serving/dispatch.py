"""The model node's dispatch: request cloves in, jobs and answers out (pure core).

Source: PlanetServe sec. 3.2 (a model node rebuilds Q from any k cloves and answers through the
n reply proxies Q names) and sec. 3.3 (admission by load; the forwarding decision of a later
issue goes here, between a decoded request and its job). No I/O, clock or protobuf: ``now`` comes
in, Q arrives already decoded by the injected ``decode_query``, and the commands go to the
driver (:mod:`ps_p2p.roles.model`), which runs the engine, signs and sends.

=============================  ==================================================================
input                          effect
=============================  ==================================================================
clove from proxy P             dropped unless its threshold is >= 2, it is P's first clove of
                               that message, and P has fewer than ``max_cloves_per_proxy``
                               cloves of incomplete requests buffered; else reassembled (bytes
                               bounded in total, the oldest incomplete request evicted)
request decoded                a resent request (same Q but its reply proxies) is answered from
                               the answer cache, or joins the job in service (at most
                               ``max_waiters``); a bad request (bad ID, wrong model, sizes,
                               sampling parameters out of range) is answered with its error at
                               once; past ``capacity + max_queue`` the answer is OVERLOADED;
                               otherwise ``StartJob``
job progress (streamed Q)      the new text goes to every waiter as a segment (a waiter that
                               joins later first gets the text so far); at most
                               ``MAX_SEGMENTS - 1`` such segments per waiter, the rest rides on
                               the last one
job started / finished         load tracking (F_LB); the answer goes to every waiter (the last
                               segment of a streamed Q), an OK one is cached ``cache_ttl`` s
job routed here                (sec. 3.3; with ``routes`` set, a user's request is admitted as
                               *being routed*: it holds an admission place but is not in Q
                               until the router keeps it here, so the router never counts the
                               request it routes against this node; issue 19) it joins Q
job forwarded to peer P        (sec. 3.3; the model node's router chose P) the job's admission
                               slot is given back (P's load counts it); its progress and its
                               answer come from P, signed by P (``signed``), and go to the
                               waiters as usual
forward failed                 nothing was streamed yet: the job is admitted again here and
                               served locally (``StartJob(local=True)``); else it ends with
                               ENGINE_ERROR over the text streamed so far
request forwarded to us        (``receive_forwarded``) Q from another model node of the group:
                               dropped unless Q names its reply proxies as a user's request
                               does; answered OVERLOADED past the forwarders' share of this
                               node (``max_forwarded`` jobs from all of them, at most
                               ``max_forwarded_per_peer`` from one); else validated and
                               admitted like a request from proxies, served here (one hop
                               only), answered to ``channel`` instead of proxies
tick                           expiry of incomplete requests and cached answers (both in order)
=============================  ==================================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ps_p2p.crypto import sida
from ps_p2p.errors import ConfigError, RemoteProtocolError
from ps_p2p.gossip.load import LoadTracker
from ps_p2p.inference import InferenceQuery, ResponseStatus
from ps_p2p.overlay.reassembly import CloveAssembler, MessageReassembled, ReassemblyFailed
from ps_p2p.records import short_peer_id as _short
from ps_p2p.responses import ResponseContent

log = logging.getLogger(__name__)

#: Most tokens a request may ask for.
MAX_TOKENS_LIMIT = 4096
#: Longest prompt accepted (characters) before tokenization.
MAX_PROMPT_CHARS = 512 * 1024
#: Reply proxies a request may name.
MAX_REPLY_PROXIES = sida.MAX_TOTAL
#: Smallest S-IDA threshold accepted (k = 1 would let one proxy's clove decode alone and close
#: the message ID to the honest cloves; no honest user sends it).
MIN_THRESHOLD = 2
#: Largest sampling temperature accepted.
MAX_TEMPERATURE = 100.0
#: Stop strings a request may name, and their longest length (characters; OpenAI allows 4).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
#: Messages a chat may have.
MAX_CHAT_MESSAGES = 256
#: Chat roles accepted (OpenAI's chat completions API).
CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
#: Segments of one streamed answer at most, the last one included (each is one clove per reply
#: proxy, so it must not exceed what a proxy forwards under one tag:
#: ps_p2p.overlay.relay.MAX_REPLIES_PER_TAG).
MAX_SEGMENTS = 128
_RETRY_KEY_DOMAIN = b"planetserve/v1/retry-key\x00"

#: Reasons a request clove is dropped (:attr:`Dispatcher.dropped_by`).
DROP_LOW_THRESHOLD = "low_threshold"  # threshold below MIN_THRESHOLD
DROP_DUPLICATE_PROXY = "duplicate_proxy"  # a second clove of one request from one proxy
DROP_PROXY_SHARE = "proxy_share"  # the proxy has its share of incomplete requests buffered
#: What became of a request (:attr:`Dispatcher.requests`): a job started, answered from the
#: answer cache, joined the job in service, answered OVERLOADED, answered with its error at once
#: (bad parameters, another model), dropped (undecodable, too few reply proxies, too many copies
#: of one request), or expired incomplete (fewer than k cloves within ``reassembly_ttl``).
REQUEST_ADMITTED = "admitted"
REQUEST_CACHED = "cached"
REQUEST_JOINED = "joined"
REQUEST_OVERLOADED = "overloaded"
REQUEST_INVALID = "invalid"
REQUEST_DROPPED = "dropped"
REQUEST_EXPIRED = "expired"
REQUEST_FORWARDED = "forwarded"  # handed to another model node of the group (sec. 3.3)


@dataclass
class DispatchConfig:
    """Limits of a model node's dispatch; times in seconds.

    Attributes:
        capacity: requests served concurrently (C of the load factor).
        max_queue: requests waiting beyond ``capacity`` before OVERLOADED answers.
        cache_ttl: an OK answer stays cached this long for resent requests.
        max_cached: answers cached at most.
        reassembly_ttl: an incomplete request waits this long for its cloves.
        max_pending_requests: incomplete requests held at most (oldest evicted).
        max_reassembly_bytes: clove bytes buffered at most, over all proxies (oldest evicted).
        max_cloves_per_proxy: cloves of incomplete requests one proxy may have buffered: an
            honest proxy carries one clove of each request in flight through it, and a request
            completes within milliseconds of its k-th clove.
        max_tracked_messages: message IDs whose delivering proxies are remembered.
        max_waiters: copies of one request (resent over fresh paths) answered from one job.
        max_forwarded: jobs forwarded to us by other model nodes, all together, queued or
            running at most; 0: half of ``capacity + max_queue`` (issue 16: 66 forwards of a
            member's own queries filled a node and its users were all answered OVERLOADED;
            the users who asked this node keep at least the other half).
        max_forwarded_per_peer: of those, from one forwarding node at most; 0: ``capacity``
            (a forwarder keeps at most its own capacity outstanding at one peer,
            :class:`~ps_p2p.gossip.load.PeerLedger`, so an honest one of a group of equal
            nodes never meets it).
    """

    capacity: int = 2
    max_queue: int = 64
    cache_ttl: float = 300.0
    max_cached: int = 10_000
    reassembly_ttl: float = 60.0
    max_pending_requests: int = 2048
    max_reassembly_bytes: int = 64 * 1024 * 1024
    max_cloves_per_proxy: int = 256
    max_tracked_messages: int = 20_000
    max_waiters: int = 8
    max_forwarded: int = 0
    max_forwarded_per_peer: int = 0

    def __post_init__(self) -> None:
        if self.max_forwarded < 0 or self.max_forwarded_per_peer < 0:
            raise ConfigError("max_forwarded and max_forwarded_per_peer must be >= 0 (0: auto)")

    @property
    def forwarded_limit(self) -> int:
        """Jobs forwarded to us, all forwarders together, at most (``max_forwarded``)."""
        return self.max_forwarded or max(1, (self.capacity + self.max_queue) // 2)

    @property
    def forwarded_per_peer_limit(self) -> int:
        """Jobs forwarded to us by one node at most (``max_forwarded_per_peer``)."""
        return self.max_forwarded_per_peer or max(1, self.capacity)


@dataclass(frozen=True)
class Waiter:
    """One sending of a request, to be answered: its Q bytes (the answer signs their hash), Q
    and the threshold k its cloves used (the answer uses the same). ``channel``: a request
    another model node forwarded to us (sec. 3.3) is answered on that node's forward stream
    (the service's handle of it), not through reply proxies."""

    q_bytes: bytes
    query: InferenceQuery
    threshold: int
    channel: int | None = None


@dataclass(frozen=True)
class StartJob:
    """Run ``query`` on the engine; report with :meth:`Dispatcher.job_started` and
    :meth:`Dispatcher.job_finished` under ``key``."""

    key: bytes
    query: InferenceQuery
    #: serve it here whatever the router says (forwarded to us, or its forward failed)
    local: bool = False
    #: Q's bytes (what a forward hands on; the answer signs their hash)
    q_bytes: bytes = b""


@dataclass(frozen=True)
class SendAnswer:
    """Sign ``content`` for ``waiter`` and send it through its reply proxies; for a streamed Q,
    as its last segment: number ``seq``, carrying ``content.text`` from UTF-8 byte ``offset``
    on (what earlier segments to this waiter did not carry)."""

    waiter: Waiter
    content: ResponseContent
    seq: int = 0
    offset: int = 0
    #: the response as the model node that served it signed it (forwarded jobs): sent as it is
    #: (the service adds its forward voucher) instead of signing ``content``
    signed: object | None = None


@dataclass(frozen=True)
class SendSegment:
    """Send segment ``seq`` of a streamed answer, ``text`` at UTF-8 byte ``offset``, to
    ``waiter`` through its reply proxies."""

    waiter: Waiter
    seq: int
    offset: int
    text: str


@dataclass(frozen=True)
class DropChannel:
    """A request forwarded to us on ``channel`` was dropped (undecodable, or one sending too
    many of a request in service): its stream ends without a reply."""

    channel: int


Command = StartJob | SendAnswer | SendSegment | DropChannel


@dataclass
class _Job:
    query: InferenceQuery
    waiters: list[Waiter] = field(default_factory=list)
    started_at: float | None = None
    pieces: list[str] = field(default_factory=list)  # text streamed so far
    # per waiter (same order): next segment number, UTF-8 bytes sent in segments
    sent: list[list[int]] = field(default_factory=list)
    forwarded_to: bytes | None = None  # the model node serving it for us
    forwarded_by: bytes | None = None  # the model node that forwarded it to us


@dataclass
class _Cached:
    content: ResponseContent
    expires_at: float
    signed: object | None = None


def retry_key(query: InferenceQuery) -> bytes:
    """What identifies a resent request: everything in Q but the reply proxies.

    Never the request ID alone: a reply proxy sees response cloves, and one that could replay a
    request ID with its own reply proxies would receive the user's answer.
    """
    p = query.params

    def lp(data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + data

    return hashlib.sha256(
        _RETRY_KEY_DOMAIN
        + lp(query.request_id)
        + lp(query.model_id.encode())
        + lp(query.prompt.encode("utf-8", "surrogatepass"))
        + struct.pack(">Idd?Q", p.max_tokens, p.temperature, p.top_p, p.seed is not None,
                      p.seed or 0)
        + lp(query.preferred_model_node)
        + struct.pack(">?II", query.stream, len(p.stop), len(query.messages))
        + b"".join(lp(s.encode("utf-8", "surrogatepass")) for s in p.stop)
        + b"".join(
            lp(m.role.encode("utf-8", "surrogatepass")) + lp(m.content.encode("utf-8", "surrogatepass"))
            for m in query.messages
        )
    ).digest()


class Dispatcher:
    """Model node dispatch (see the module docstring).

    Args:
        model_id: the model this node serves.
        decode_query: Q's bytes -> :class:`InferenceQuery`; raises RemoteProtocolError.
        config: :class:`DispatchConfig`.

    Attributes:
        load: the :class:`~ps_p2p.gossip.load.LoadTracker` (F_LB).
        dropped_by: request cloves refused, by reason (``DROP_*``).
        requests: requests reassembled (or expired incomplete), by what became of them
            (``REQUEST_*``); a resent request counts once per sending.
    """

    def __init__(
        self,
        model_id: str,
        decode_query: Callable[[bytes], InferenceQuery],
        config: DispatchConfig | None = None,
    ) -> None:
        self.model_id = model_id
        self.config = config or DispatchConfig()
        self._decode_query = decode_query
        self.load = LoadTracker(self.config.capacity, self.config.max_queue)
        self.assembler = CloveAssembler(
            ttl=self.config.reassembly_ttl,
            max_messages=self.config.max_pending_requests,
            max_bytes=self.config.max_reassembly_bytes,
        )
        self._jobs: dict[bytes, _Job] = {}
        self._cache: OrderedDict[bytes, _Cached] = OrderedDict()
        self._senders: OrderedDict[bytes, set[bytes]] = OrderedDict()
        # incomplete request -> proxies with a clove of it buffered; proxy -> such cloves
        self._buffered_by: dict[bytes, list[bytes]] = {}
        self.per_proxy: dict[bytes, int] = {}
        #: jobs forwarded to us and not finished, by the node that forwarded them
        self.forwarded_in: dict[bytes, int] = {}
        self.dropped_by: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        #: set when the node stops (:mod:`ps_p2p.serving.drain`): new requests are answered
        #: OVERLOADED; resent copies still join their job, cached answers are still sent
        self.draining = False
        #: a router decides where users' requests are served (the model node sets it when it
        #: forwards): they are admitted as being routed, and :meth:`job_routed_here` or
        #: :meth:`job_forwarded` follows each one
        self.routes = False

    @property
    def in_service(self) -> int:
        """Jobs admitted and not finished (queued or running)."""
        return len(self._jobs)

    @property
    def dropped_cloves(self) -> int:
        """Request cloves refused, all reasons."""
        return sum(self.dropped_by.values())

    def _drop(self, reason: str) -> None:
        self.dropped_by[reason] = self.dropped_by.get(reason, 0) + 1

    def _count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    # ------------------------------------------------------------------ cloves

    def receive_clove(self, proxy: bytes, clove: sida.Clove, now: float) -> list[Command]:
        """One request clove delivered by ``proxy`` (already checked by ``Clove.check``)."""
        if clove.threshold < MIN_THRESHOLD:
            self._drop(DROP_LOW_THRESHOLD)
            log.warning("clove with threshold %d from proxy %s dropped", clove.threshold, _short(proxy))
            return []
        senders = self._senders.get(clove.message_id)
        if senders is None:
            senders = self._senders[clove.message_id] = set()
            while len(self._senders) > self.config.max_tracked_messages:
                self._senders.popitem(last=False)
        if proxy in senders:
            # honest cloves of one request come from n distinct proxies: a proxy that sends k
            # cloves of its own making under a message ID it saw cannot hijack it
            self._drop(DROP_DUPLICATE_PROXY)
            log.warning("second clove of one request from proxy %s dropped", _short(proxy))
            return []
        if self.assembler.is_completed(clove.message_id):
            return []  # a late clove of a request already decoded
        if self.per_proxy.get(proxy, 0) >= self.config.max_cloves_per_proxy:
            self._drop(DROP_PROXY_SHARE)
            log.warning("proxy %s has %d cloves of incomplete requests buffered; clove dropped",
                        _short(proxy), self.config.max_cloves_per_proxy)
            return []
        senders.add(proxy)
        self._buffered_by.setdefault(clove.message_id, []).append(proxy)
        self.per_proxy[proxy] = self.per_proxy.get(proxy, 0) + 1
        out: list[Command] = []
        for event in self.assembler.receive_clove(clove, now):
            self._release(event.message_id)
            if isinstance(event, ReassemblyFailed):
                self._count(REQUEST_DROPPED)
                log.warning("request %s: %s", event.message_id.hex()[:8], event.reason)
            elif isinstance(event, MessageReassembled):
                out += self._on_request(event.payload, event.threshold, now)
        return out

    def _release(self, message_id: bytes) -> None:
        for proxy in self._buffered_by.pop(message_id, ()):
            left = self.per_proxy.get(proxy, 1) - 1
            if left > 0:
                self.per_proxy[proxy] = left
            else:
                self.per_proxy.pop(proxy, None)

    # ------------------------------------------------------------------ requests

    def _on_request(self, q_bytes: bytes, threshold: int, now: float,
                    channel: int | None = None, sender: bytes = b"") -> list[Command]:
        dropped: list[Command] = [] if channel is None else [DropChannel(channel)]
        try:
            query = self._decode_query(q_bytes)
        except RemoteProtocolError as exc:
            self._count(REQUEST_DROPPED)
            log.warning("undecodable request dropped: %s", exc)
            return dropped
        n_proxies = len(query.reply_proxies)
        if n_proxies < threshold or n_proxies > MAX_REPLY_PROXIES:
            # a forward carries Q as the forwarder decoded it from a user's cloves: a Q that
            # names no reply proxies for its threshold is nobody's request (issue 16)
            self._count(REQUEST_DROPPED)
            log.warning("request %s names %d reply proxies for threshold %d; cannot answer",
                        query.request_id.hex()[:8], n_proxies, threshold)
            return dropped
        waiter = Waiter(q_bytes, query, threshold, channel)
        key = retry_key(query)
        cached = self._cache.get(key)
        if channel is not None and (cached is not None and cached.signed is not None or
                                    key in self._jobs and self._jobs[key].forwarded_to):
            # a node that forwarded to us is answered only with our own work: not with another
            # node's answer we relayed (it would refuse it and serve the request itself)
            self._count(REQUEST_DROPPED)
            return dropped
        if cached is not None and cached.expires_at > now:
            self._count(REQUEST_CACHED)
            return [SendAnswer(waiter, cached.content, signed=cached.signed)]
        job = self._jobs.get(key)
        if job is not None:
            if len(job.waiters) < self.config.max_waiters:
                job.waiters.append(waiter)
                job.sent.append([0, 0])
                self._count(REQUEST_JOINED)
                if query.stream and job.pieces:  # the text so far, then what comes
                    return self._segment(job, len(job.waiters) - 1, "".join(job.pieces))
            else:
                self._count(REQUEST_DROPPED)
                return dropped
            return []
        problem = self.validate(query)
        if problem is not None:
            self._count(REQUEST_INVALID)
            return [SendAnswer(waiter, self.error_content(*problem))]
        if self.draining:
            self._count(REQUEST_OVERLOADED)
            return [SendAnswer(waiter, self.error_content(
                ResponseStatus.OVERLOADED, "model node shutting down; ask another"
            ))]
        if channel is not None:
            share = self._forward_share_problem(sender)
            if share is not None:
                self._count(REQUEST_OVERLOADED)
                log.warning("forward of %s from %s refused: %s",  # rate-limited by template
                            query.request_id.hex()[:8], _short(sender), share)
                return [SendAnswer(waiter, self.error_content(
                    ResponseStatus.OVERLOADED, f"model node overloaded ({share}); retry later"
                ))]
        if not self.load.try_admit(routing=self.routes and channel is None):
            self._count(REQUEST_OVERLOADED)
            log.warning("overloaded: request %s refused", query.request_id.hex()[:8])
            return [SendAnswer(waiter, self.error_content(
                ResponseStatus.OVERLOADED, "model node overloaded; retry later"
            ))]
        self._count(REQUEST_ADMITTED)
        job = self._jobs[key] = _Job(query, [waiter], sent=[[0, 0]])
        if channel is not None:
            job.forwarded_by = sender
            self.forwarded_in[sender] = self.forwarded_in.get(sender, 0) + 1
        return [StartJob(key, query, local=waiter.channel is not None, q_bytes=q_bytes)]

    @property
    def forwarded_jobs(self) -> int:
        """Jobs forwarded to us, queued or running."""
        return sum(self.forwarded_in.values())

    def _forward_share_problem(self, sender: bytes) -> str | None:
        """Why one more job forwarded by ``sender`` would exceed the forwarders' share."""
        if self.forwarded_in.get(sender, 0) >= self.config.forwarded_per_peer_limit:
            return f"{self.config.forwarded_per_peer_limit} forwards of that node in service"
        if self.forwarded_jobs >= self.config.forwarded_limit:
            return f"{self.config.forwarded_limit} forwarded requests in service"
        return None

    def receive_forwarded(self, channel: int, q_bytes: bytes, now: float,
                          sender: bytes = b"") -> list[Command]:
        """Q forwarded to us by model node ``sender`` of the group (the service checked it is
        one), to be answered on its forward stream ``channel`` (sec. 3.3). Served here: a
        forwarded request is never forwarded again (one hop). Threshold 2 stands for the S-IDA
        threshold (no cloves are sent for it): Q must name at least that many reply proxies,
        as every user's request does. A new job counts against ``sender``'s share
        (``max_forwarded_per_peer``) and the forwarders' (``max_forwarded``) until it finishes;
        past either the answer is OVERLOADED."""
        return self._on_request(q_bytes, MIN_THRESHOLD, now, channel=channel, sender=sender)

    def validate(self, query: InferenceQuery) -> tuple[int, str] | None:
        """(status, message) when ``query`` cannot be served, else None."""
        p = query.params
        if len(query.request_id) != 16:
            return ResponseStatus.BAD_REQUEST, "request_id must be 16 bytes"
        if query.model_id and query.model_id != self.model_id:
            return (ResponseStatus.WRONG_MODEL,
                    f"this node serves {self.model_id!r}, not {query.model_id!r}")
        if bool(query.prompt) == bool(query.messages):
            return ResponseStatus.BAD_REQUEST, "a request has either a prompt or chat messages"
        if len(query.messages) > MAX_CHAT_MESSAGES:
            return ResponseStatus.BAD_REQUEST, f"over {MAX_CHAT_MESSAGES} chat messages"
        for m in query.messages:
            if m.role not in CHAT_ROLES:
                return ResponseStatus.BAD_REQUEST, f"unknown chat role {m.role[:40]!r}"
        size = len(query.prompt) + sum(len(m.content) for m in query.messages)
        if size > MAX_PROMPT_CHARS:
            return ResponseStatus.PROMPT_TOO_LONG, f"prompt over {MAX_PROMPT_CHARS} characters"
        if len(p.stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in p.stop):
            return (ResponseStatus.BAD_REQUEST,
                    f"at most {MAX_STOP_STRINGS} stop strings of 1..{MAX_STOP_CHARS} characters")
        if p.max_tokens > MAX_TOKENS_LIMIT:
            return ResponseStatus.BAD_REQUEST, f"max_tokens over {MAX_TOKENS_LIMIT}"
        if not (math.isfinite(p.temperature) and 0.0 <= p.temperature <= MAX_TEMPERATURE):
            return ResponseStatus.BAD_REQUEST, f"temperature must be in [0, {MAX_TEMPERATURE:g}]"
        if not (math.isfinite(p.top_p) and 0.0 <= p.top_p <= 1.0):  # 0 means "not set": 1.0
            return ResponseStatus.BAD_REQUEST, "top_p must be in (0, 1]"
        return None

    def error_content(self, status: int, message: str) -> ResponseContent:
        """An error answer of this node."""
        return ResponseContent(int(status), "", message[:1000], self.model_id, 0, 0)

    # ------------------------------------------------------------------ jobs

    def job_started(self, key: bytes, now: float) -> list[Command]:
        """A worker took the job ``key``."""
        job = self._jobs.get(key)
        if job is not None and job.started_at is None:
            job.started_at = now
            self.load.start()
        return []

    def job_progress(self, key: bytes, text: str, now: float) -> list[Command]:
        """The streamed job ``key`` generated ``text`` (the next piece, in order): a segment to
        each waiter that has segments left (:data:`MAX_SEGMENTS`)."""
        job = self._jobs.get(key)
        if job is None or not text or not job.query.stream:
            return []
        job.pieces.append(text)
        out: list[Command] = []
        for index in range(len(job.waiters)):
            out += self._segment(job, index, text)
        return out

    def _segment(self, job: _Job, index: int, text: str) -> list[Command]:
        sent = job.sent[index]
        if sent[0] >= MAX_SEGMENTS - 1:
            return []  # the last segment carries the rest
        seq, offset = sent
        sent[0] += 1
        sent[1] += len(text.encode("utf-8", "surrogatepass"))
        return [SendSegment(job.waiters[index], seq, offset, text)]

    def job_routed_here(self, key: bytes, now: float) -> list[Command]:
        """The router keeps job ``key`` here: it joins this node's queue (Q)."""
        job = self._jobs.get(key)
        if job is not None and job.forwarded_to is None and job.started_at is None:
            self.load.routed_here()
        return []

    def job_forwarded(self, key: bytes, peer: bytes, now: float) -> list[Command]:
        """The router handed the job ``key`` to model node ``peer`` (sec. 3.3): its admission
        slot here is given back; its progress and answer come from ``peer``."""
        job = self._jobs.get(key)
        if job is not None and job.forwarded_to is None and job.started_at is None:
            job.forwarded_to = peer
            self.load.cancel()
            self._count(REQUEST_FORWARDED)
        return []

    def forward_failed(self, key: bytes, now: float) -> list[Command]:
        """The forward of job ``key`` failed (unreachable peer, refused, broken stream, an
        answer that did not verify, or OVERLOADED): served here when nothing was streamed yet
        and there is room; else it ends with an error (over the text streamed so far)."""
        job = self._jobs.get(key)
        if job is None or job.forwarded_to is None:
            return []
        job.forwarded_to = None
        if not job.pieces and self.load.try_admit():
            return [StartJob(key, job.query, local=True, q_bytes=job.waiters[0].q_bytes)]
        status = ResponseStatus.ENGINE_ERROR if job.pieces else ResponseStatus.OVERLOADED
        job.pieces.clear()  # never sign the other node's unverified text as ours
        return self.job_finished(key, self.error_content(
            status, "the model node this request was forwarded to failed"), now)

    def job_finished(self, key: bytes, content: ResponseContent, now: float,
                     signed: object | None = None) -> list[Command]:
        """The job ``key`` ended with ``content``: every waiter gets it; OK answers are cached.

        For a streamed Q whose job failed after streaming text, the answer signs the text
        streamed so far (what the user already holds). ``signed``: the response as the model
        node a forwarded job went to signed it (sent as it is)."""
        job = self._jobs.pop(key, None)
        if job is None:
            return []
        if job.forwarded_by is not None:
            left = self.forwarded_in.get(job.forwarded_by, 1) - 1
            if left > 0:
                self.forwarded_in[job.forwarded_by] = left
            else:
                self.forwarded_in.pop(job.forwarded_by, None)
        if job.started_at is not None:
            self.load.finish(now - job.started_at)
        if content.status == ResponseStatus.OK:
            self._cache.pop(key, None)
            self._cache[key] = _Cached(content, now + self.config.cache_ttl, signed)
            while len(self._cache) > self.config.max_cached:
                self._cache.popitem(last=False)
        elif job.pieces and signed is None:
            content = dataclasses.replace(content, text="".join(job.pieces))
        return [SendAnswer(w, content, *job.sent[i], signed=signed)
                for i, w in enumerate(job.waiters)]

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has work, or None."""
        times = []
        expiry = self.assembler.next_expiry()
        if expiry is not None:
            times.append(expiry)
        if self._cache:
            times.append(next(iter(self._cache.values())).expires_at)
        return min(times) if times else None

    def tick(self, now: float) -> list[Command]:
        """Expire incomplete requests and cached answers (O(expired))."""
        for message_id in self.assembler.expire(now):
            self._count(REQUEST_EXPIRED)
            log.info("incomplete request %s expired", message_id.hex()[:8])
            self._senders.pop(message_id, None)
            self._release(message_id)
        while self._cache and next(iter(self._cache.values())).expires_at <= now:
            self._cache.popitem(last=False)
        return []


__all__ = [
    "Command", "DROP_DUPLICATE_PROXY", "DROP_LOW_THRESHOLD", "DROP_PROXY_SHARE",
    "DispatchConfig", "Dispatcher", "REQUEST_ADMITTED", "REQUEST_CACHED", "REQUEST_DROPPED",
    "MAX_SEGMENTS", "REQUEST_EXPIRED", "REQUEST_FORWARDED", "REQUEST_INVALID", "REQUEST_JOINED", "REQUEST_OVERLOADED",
    "SendAnswer", "SendSegment",
    "DropChannel", "StartJob", "Waiter", "retry_key",
]
