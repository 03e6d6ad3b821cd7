"""Model node: decode request cloves, serve with the engine, answer with signed response cloves.

Flow (PlanetServe sec. 3.2): proxies deliver request cloves; a :class:`CloveAssembler` rebuilds Q
from any k of them (trying other k-subsets when one was tampered with); Q names the n reply
proxies; the answer is signed (:mod:`ps_p2p.responses`), S-IDA-encoded with ``message_id =
request_id`` and one clove goes to each reply proxy, which sends it back along its path.

Admission: ``capacity`` requests are served at once, ``max_queue`` more wait; beyond that the
request gets a signed ``OVERLOADED`` answer at once instead of silence. A request ID seen again
(a user's retry over fresh paths) is answered from a short-lived cache, or joins the in-flight
request, without running inference twice.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ps_p2p import records, responses
from ps_p2p.crypto import sida
from ps_p2p.engines.base import Engine, SamplingParams
from ps_p2p.errors import EngineError, PromptTooLongError, PsError, RemoteProtocolError
from ps_p2p.gossip.load import LoadTracker
from ps_p2p.keys import Identity
from ps_p2p.overlay.reassembly import CloveAssembler, MessageReassembled, ReassemblyFailed
from ps_p2p.pb.planetserve.v1 import inference_pb2
from ps_p2p.protocols.clove_codec import clove_from_bytes, clove_to_bytes
from ps_p2p.protocols.overlay import OverlayService
from ps_p2p.records import short_peer_id as _short

log = logging.getLogger(__name__)

#: Most tokens a request may ask for.
MAX_TOKENS_LIMIT = 4096
#: Longest prompt accepted (characters) before tokenization.
MAX_PROMPT_CHARS = 512 * 1024
#: Reply proxies a request may name.
MAX_REPLY_PROXIES = sida.MAX_TOTAL
#: Smallest S-IDA threshold accepted (ps_p2p.roles.user.UserConfig requires the same).
MIN_THRESHOLD = 2
#: Requests being reassembled at most (oldest evicted): bounds what peers' cloves can pin,
#: at most this many times the largest clove (~256 KiB).
MAX_PENDING_REQUESTS = 2048
#: Bytes of request cloves buffered for reassembly at most, over all proxies (the oldest
#: incomplete requests are evicted beyond it).
MAX_REASSEMBLY_BYTES = 64 * 1024 * 1024
#: Request cloves of incomplete requests one proxy may have buffered here: an honest proxy
#: carries one clove of each request in flight through it, and a request completes within
#: milliseconds of its k-th clove; sybil proxies each get this share of MAX_REASSEMBLY_BYTES.
MAX_PENDING_CLOVES_PER_PROXY = 256
#: Message IDs whose delivering proxies are remembered (one clove per proxy and message).
MAX_TRACKED_MESSAGES = 20_000
#: Copies of one request (retries over fresh paths) answered from one inference.
MAX_WAITERS = 8
_RETRY_KEY_DOMAIN = b"planetserve/v1/retry-key\x00"


def _retry_key(request: inference_pb2.InferenceRequest) -> bytes:
    """What identifies a retry of the same request: everything in Q but the reply proxies."""
    q = inference_pb2.InferenceRequest()
    q.CopyFrom(request)
    del q.reply_proxies[:]
    return hashlib.sha256(_RETRY_KEY_DOMAIN + q.SerializeToString(deterministic=True)).digest()

Status = inference_pb2.ResponseStatus


@dataclass
class ModelNodeConfig:
    """Model node settings.

    Attributes:
        capacity: requests served concurrently (C of the load factor).
        max_queue: requests waiting beyond ``capacity`` before "overloaded" answers.
        default_max_tokens: used when a request asks for 0 tokens.
        cache_ttl: seconds an answer stays cached for retries of the same request ID.
    """

    capacity: int = 2
    max_queue: int = 64
    default_max_tokens: int = 128
    cache_ttl: float = 300.0
    reassembly_ttl: float = 60.0


@dataclass
class _Job:
    key: bytes  # _retry_key(request)
    request: inference_pb2.InferenceRequest
    # every (Q bytes, parsed Q, threshold) waiting for this request's answer
    waiters: list[tuple[bytes, inference_pb2.InferenceRequest, int]] = field(default_factory=list)


@dataclass
class _Cached:
    content: responses.ResponseContent
    expires_at: float


class ModelNodeService:
    """Serves anonymous requests arriving as cloves through ``overlay``.

    Args:
        identity: signs responses; its peer ID is the one in this node's record.
        engine: the inference engine (its ``model_id`` is what this node serves).
        overlay: the host's overlay service; construct it with ``on_delivery=self.on_delivery``.
        config: :class:`ModelNodeConfig`.
        clock: trio time (seconds); wall_clock_ms: unix milliseconds for signatures.
    """

    def __init__(
        self,
        identity: Identity,
        engine: Engine,
        config: ModelNodeConfig | None = None,
        *,
        clock: Callable[[], float] = trio.current_time,
        wall_clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.identity = identity
        self.engine = engine
        self.config = config or ModelNodeConfig()
        self.overlay: OverlayService | None = None
        self.load = LoadTracker(self.config.capacity, self.config.max_queue)
        self._clock = clock
        self._wall_ms = wall_clock_ms
        self._assembler = CloveAssembler(
            ttl=self.config.reassembly_ttl, max_messages=MAX_PENDING_REQUESTS,
            max_bytes=MAX_REASSEMBLY_BYTES,
        )
        # incomplete request -> proxies with a clove of it buffered; proxy -> such cloves
        self._buffered_by: dict[bytes, list[bytes]] = {}
        self._per_proxy: dict[bytes, int] = {}
        self._jobs: dict[bytes, _Job] = {}
        self._cache: OrderedDict[bytes, _Cached] = OrderedDict()
        self._senders: OrderedDict[bytes, set[bytes]] = OrderedDict()
        #: request cloves dropped (malformed, or a second one from the same proxy)
        self.dropped_cloves = 0
        self._send, self._receive = trio.open_memory_channel[_Job](
            self.config.capacity + self.config.max_queue + 1
        )

    def attach(self, overlay: OverlayService) -> None:
        """Bind to the overlay whose ``on_delivery`` is :meth:`on_delivery`."""
        self.overlay = overlay
        overlay.on_delivery = self.on_delivery

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run ``capacity`` workers and the expiry timer until cancelled."""
        async with trio.open_nursery() as nursery:
            for i in range(self.config.capacity):
                nursery.start_soon(self._worker, i)
            task_status.started()
            while True:
                await trio.sleep(1.0)  # timer tick for expiry, not a wait for a condition
                now = self._clock()
                for message_id in self._assembler.expire(now):
                    log.info("incomplete request %s expired", message_id.hex()[:8])
                    self._senders.pop(message_id, None)
                    self._release(message_id)
                while self._cache and next(iter(self._cache.values())).expires_at <= now:
                    self._cache.popitem(last=False)

    # ------------------------------------------------------------------ cloves in

    def on_delivery(self, proxy: bytes, clove_bytes: bytes) -> None:
        """Handle one request clove from a proxy (synchronous; never blocks, never raises).

        A malformed clove is dropped and logged: the proxy forwards user bytes unchanged, so
        resetting its stream would punish the other users whose cloves share it. A proxy counts
        once per message ID: honest cloves of one request come from n distinct proxies, so a
        proxy that sends k cloves of its own making under a message ID it saw cannot hijack it.
        """
        try:
            clove = clove_from_bytes(clove_bytes)
        except RemoteProtocolError as exc:
            self.dropped_cloves += 1
            log.warning("malformed clove from proxy %s dropped: %s", _short(proxy), exc)
            return
        senders = self._senders.get(clove.message_id)
        if senders is None:
            senders = self._senders[clove.message_id] = set()
            while len(self._senders) > MAX_TRACKED_MESSAGES:
                self._senders.popitem(last=False)
        if proxy in senders:
            self.dropped_cloves += 1
            log.warning("second clove of one request from proxy %s dropped", _short(proxy))
            return
        if clove.threshold < MIN_THRESHOLD:
            # with k = 1 one proxy's clove decodes alone: it could close the message ID to the
            # honest cloves (and no honest user sends k < 2)
            self.dropped_cloves += 1
            log.warning("clove with threshold %d from proxy %s dropped", clove.threshold, _short(proxy))
            return
        if self._assembler.is_completed(clove.message_id):
            return  # a late clove of a request already decoded
        if self._per_proxy.get(proxy, 0) >= MAX_PENDING_CLOVES_PER_PROXY:
            self.dropped_cloves += 1
            log.warning("proxy %s has %d cloves of incomplete requests buffered; clove dropped",
                        _short(proxy), MAX_PENDING_CLOVES_PER_PROXY)
            return
        senders.add(proxy)
        self._buffered_by.setdefault(clove.message_id, []).append(proxy)
        self._per_proxy[proxy] = self._per_proxy.get(proxy, 0) + 1
        for event in self._assembler.receive_clove(clove, self._clock()):
            self._release(event.message_id)
            if isinstance(event, ReassemblyFailed):
                log.warning("request %s: %s", event.message_id.hex()[:8], event.reason)
            elif isinstance(event, MessageReassembled):
                self._on_request(event.payload, event.threshold)  # k of the group that decoded

    def _release(self, message_id: bytes) -> None:
        """The request left the assembler: its proxies' buffered cloves no longer count."""
        for proxy in self._buffered_by.pop(message_id, ()):
            left = self._per_proxy.get(proxy, 1) - 1
            if left > 0:
                self._per_proxy[proxy] = left
            else:
                self._per_proxy.pop(proxy, None)

    def _on_request(self, q_bytes: bytes, threshold: int) -> None:
        request = inference_pb2.InferenceRequest()
        try:
            request.ParseFromString(q_bytes)
        except Exception:
            log.warning("undecodable request dropped")
            return
        n_proxies = len(request.reply_proxies)
        if n_proxies < threshold or n_proxies > MAX_REPLY_PROXIES:
            log.warning(
                "request %s names %d reply proxies for threshold %d; cannot answer",
                request.request_id.hex()[:8], n_proxies, threshold,
            )
            return
        rid = request.request_id
        # A retry is recognised by everything the user asked, never by the request ID alone:
        # reply proxies see response cloves, and a proxy that could replay a request ID with its
        # own reply proxies would receive the user's answer.
        key = _retry_key(request)
        cached = self._cache.get(key)
        if cached is not None:
            self._answer(q_bytes, request, threshold, cached.content)
            return
        job = self._jobs.get(key)
        if job is not None:
            if len(job.waiters) < MAX_WAITERS:
                job.waiters.append((q_bytes, request, threshold))
            return
        problem = self._validate(request)
        if problem is not None:
            status, message = problem
            self._answer(q_bytes, request, threshold, self._error_content(status, message))
            return
        if not self.load.try_admit():
            log.warning("overloaded: request %s refused", rid.hex()[:8])
            self._answer(
                q_bytes, request, threshold,
                self._error_content(Status.RESPONSE_STATUS_OVERLOADED, "model node overloaded; retry later"),
            )
            return
        job = _Job(key, request, [(q_bytes, request, threshold)])
        self._jobs[key] = job
        self._send.send_nowait(job)

    def _validate(self, request: inference_pb2.InferenceRequest) -> tuple[int, str] | None:
        if len(request.request_id) != 16:
            return Status.RESPONSE_STATUS_BAD_REQUEST, "request_id must be 16 bytes"
        if request.model_id and request.model_id != self.engine.model_id:
            return (
                Status.RESPONSE_STATUS_WRONG_MODEL,
                f"this node serves {self.engine.model_id!r}, not {request.model_id!r}",
            )
        if len(request.prompt) > MAX_PROMPT_CHARS:
            return Status.RESPONSE_STATUS_PROMPT_TOO_LONG, f"prompt over {MAX_PROMPT_CHARS} characters"
        if request.params.max_tokens > MAX_TOKENS_LIMIT:
            return Status.RESPONSE_STATUS_BAD_REQUEST, f"max_tokens over {MAX_TOKENS_LIMIT}"
        return None

    # ------------------------------------------------------------------ serving

    async def _worker(self, index: int) -> None:
        async for job in self._receive:
            self.load.start()
            started = self._clock()
            try:
                content = await self._serve(job.request)
            except Exception as exc:  # an engine bug must not kill the worker or strand waiters
                log.exception("serving %s failed", job.request.request_id.hex()[:8])
                content = self._error_content(
                    Status.RESPONSE_STATUS_ENGINE_ERROR, f"{type(exc).__name__}: {exc}"
                )
            finally:
                self.load.finish(self._clock() - started)
                self._jobs.pop(job.key, None)
            if content.status == Status.RESPONSE_STATUS_OK:
                self._cache[job.key] = _Cached(
                    content, self._clock() + self.config.cache_ttl
                )
                while len(self._cache) > 10_000:
                    self._cache.popitem(last=False)
            for q_bytes, request, threshold in job.waiters:
                self._answer(q_bytes, request, threshold, content)
            log.info(
                "served %s: %d+%d tokens in %.0f ms (load factor %.3f)",
                job.request.request_id.hex()[:8], content.prompt_tokens, content.completion_tokens,
                (self._clock() - started) * 1000, self.load.load_factor(),
            )

    async def _serve(self, request: inference_pb2.InferenceRequest) -> responses.ResponseContent:
        p = request.params
        try:
            params = SamplingParams(
                max_tokens=p.max_tokens or self.config.default_max_tokens,
                temperature=p.temperature,
                top_p=p.top_p or 1.0,
                seed=p.seed or None,
            )
            completion = await self.engine.complete(request.prompt, params)
        except PromptTooLongError as exc:
            return self._error_content(Status.RESPONSE_STATUS_PROMPT_TOO_LONG, str(exc))
        except (EngineError, PsError, ValueError) as exc:
            log.warning("engine failed on %s: %s", request.request_id.hex()[:8], exc)
            return self._error_content(Status.RESPONSE_STATUS_ENGINE_ERROR, str(exc))
        return responses.ResponseContent(
            status=Status.RESPONSE_STATUS_OK,
            text=completion.text,
            error="",
            model_id=self.engine.model_id,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
        )

    def _error_content(self, status: int, message: str) -> responses.ResponseContent:
        return responses.ResponseContent(status, "", message[:1000], self.engine.model_id, 0, 0)

    # ------------------------------------------------------------------ cloves out

    def _answer(self, *args: object) -> None:
        """Sign, encode and send one answer; a failure is logged and costs only this answer."""
        try:
            self._send_answer(*args)  # type: ignore[arg-type]
        except Exception:
            log.exception("could not send an answer")

    def _send_answer(
        self,
        q_bytes: bytes,
        request: inference_pb2.InferenceRequest,
        threshold: int,
        content: responses.ResponseContent,
    ) -> None:
        assert self.overlay is not None, "attach() the overlay first"
        req_hash = responses.request_hash(q_bytes)
        signed_at = self._wall_ms()
        me = self.identity.peer_id
        signature = self.identity.sign(
            responses.signing_bytes(request.request_id, req_hash, content, signed_at, me)
        )
        response = inference_pb2.InferenceResponse(
            request_id=request.request_id,
            status=content.status,
            text=content.text,
            error=content.error,
            model_id=content.model_id,
            prompt_tokens=content.prompt_tokens,
            completion_tokens=content.completion_tokens,
            request_hash=req_hash,
            signed_at_ms=signed_at,
            model_node=me,
            signature=signature,
        )
        proxies = list(request.reply_proxies)
        cloves = sida.encode(
            response.SerializeToString(),
            total=len(proxies),
            threshold=threshold,
            message_id=responses.response_message_id(request.request_id, req_hash),
        )
        for proxy, clove in zip(proxies, cloves):
            data = clove_to_bytes(clove)
            signature = self.identity.sign(records.clove_signing_bytes(clove.message_id, data))
            self.overlay.send_reply(proxy.peer_id, proxy.reply_tag, data, signature)
