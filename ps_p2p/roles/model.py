"""Model node: the adapter between the overlay, the dispatch core and the inference engine.

Flow (PlanetServe sec. 3.2): proxies deliver request cloves (``on_delivery``, called by the
overlay); :class:`~ps_p2p.serving.dispatch.Dispatcher` rebuilds Q from any k of them, admits it
(or answers OVERLOADED / an error at once, or joins a resent request to the job in service) and
asks for a job; ``capacity`` worker tasks run the engine; every answer is signed
(:func:`ps_p2p.responses.sign_response`), S-IDA-encoded with the response message ID
:func:`ps_p2p.responses.response_message_id` (a hash of the request ID and of Q, so reply proxies
never learn the request ID and two sendings' answers never mix), each clove signed on its own
(:func:`ps_p2p.responses.sign_clove`), and clove i goes to reply proxy i under its reply tag.

One :class:`~ps_p2p.protocols.driver.CoreDriver` task owns the dispatcher: deliveries and job
reports are submitted to it, and it executes the commands (queue a job, sign and send an answer).

Forwarding (sec. 3.3, :meth:`ModelNodeService.enable_forwarding`): a job the dispatcher admits
(as *being routed*: it holds an admission place but is not in this node's Q, so the router never
counts the request it routes against this node; issue 19) goes through the router first (an async ``route(query) -> peer or None``: the HR-tree search and
Algorithm 2, :mod:`ps_p2p.roles.forwarding`); a job routed to another model node of the group
is handed over ``/planetserve/forward/1.0.0`` (:mod:`ps_p2p.protocols.forward`), that node's
text and signed answer come back on the stream, and this node relays them to the reply proxies
with its forward voucher. A request forwarded to us is served here and answered on its stream.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable

import trio

from ps_p2p import responses
from ps_p2p.config import ModelNodeConfig
from ps_p2p.crypto import sida
from ps_p2p.engines.base import FINISH_STOP, Completion, Engine, SamplingParams, StreamChunk, stop_at
from ps_p2p.errors import (
    EngineError,
    EngineParameterError,
    PromptTooLongError,
    PsError,
    RemoteProtocolError,
)
from ps_p2p.gossip.load import ForwardOutcome
from ps_p2p.inference import InferenceQuery, InferenceReply, ResponseSegment, ResponseStatus
from ps_p2p.keys import Identity
from ps_p2p.protocols.clove_codec import clove_from_bytes, clove_to_bytes
from ps_p2p.protocols.driver import CoreDriver
from ps_p2p.protocols.forward import AnswerItem, ForwardService, forward_request
from ps_p2p.protocols.inference_codec import decode_query, encode_reply, encode_segment
from ps_p2p.records import short_peer_id as _short
from ps_p2p.serving import dispatch
from ps_p2p.serving.dispatch import Dispatcher, SendAnswer, SendSegment, StartJob
from ps_p2p.serving.drain import Drain, DrainReport

log = logging.getLogger(__name__)

#: Limits (see :mod:`ps_p2p.serving.dispatch`), kept here for callers.
MAX_TOKENS_LIMIT = dispatch.MAX_TOKENS_LIMIT
MAX_PROMPT_CHARS = dispatch.MAX_PROMPT_CHARS
MIN_THRESHOLD = dispatch.MIN_THRESHOLD
#: Seconds a forwarded request's whole answer may take before this node serves it itself.
FORWARD_TIMEOUT = 300.0
#: Bytes of text a forwarded request's answer may stream (the user's own bound).
MAX_STREAM_BYTES = sida.MAX_MESSAGE_BYTES




class _Flusher:
    """Coalesces streamed text: ``send`` gets the first piece at once, then what accumulated,
    at most once per ``interval`` seconds and at most ``interval`` after it was added.
    ``clock`` is the service's (trio's clock, or a test's), in seconds."""

    def __init__(
        self, send: Callable[[str], None], interval: float, clock: Callable[[], float]
    ) -> None:
        self._send = send
        self._interval = interval
        self._clock = clock
        self._pending: list[str] = []
        self._next_at = -math.inf
        self._wake = trio.Event()

    def add(self, text: str) -> None:
        if not text:
            return
        self._pending.append(text)
        if self._clock() >= self._next_at:
            self.flush()
        else:
            self._wake.set()

    def flush(self) -> None:
        if self._pending:
            text, self._pending = "".join(self._pending), []
            self._next_at = self._clock() + self._interval
            self._send(text)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(max(0.0, self._next_at - self._clock()))  # the coalescing timer
            self.flush()


class ModelNodeService:
    """Serves anonymous requests arriving as cloves through the overlay.

    Args:
        identity: signs responses; its peer ID is the one in this node's record.
        engine: the inference engine (its ``model_id`` is what this node serves).
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
        self.overlay = None
        self._clock = clock
        self._wall_ms = wall_clock_ms
        self.dispatcher = Dispatcher(engine.model_id, decode_query, self.config)
        self.driver: CoreDriver[dispatch.Command] = CoreDriver(
            "model",
            execute=self._execute,
            tick=self.dispatcher.tick,
            next_deadline=self.dispatcher.next_deadline,
            clock=clock,
        )
        # admission guarantees at most capacity + max_queue jobs are queued or running
        self._jobs_in, self._jobs_out = trio.open_memory_channel[StartJob](
            self.config.capacity + self.config.max_queue + 1
        )
        #: request cloves that did not parse
        self.malformed_cloves = 0
        #: answers sent (one per sending of a request), by status name in lower case
        #: (``ok``, ``overloaded``, ``engine_error``...)
        self.answers: dict[str, int] = {}
        # forwarding (enable_forwarding): router, forward streams served, forwards sent
        self._route: Callable[[InferenceQuery], Awaitable[bytes | None]] | None = None
        self._may_forward_to_us: Callable[[bytes], bool] = lambda peer: False
        self._forward_done: Callable[[bytes, ForwardOutcome, float], None] | None = None
        self._host = None
        self._route_in, self._route_out = trio.open_memory_channel[StartJob](
            self.config.capacity + self.config.max_queue + 1
        )
        self._channels: dict[int, trio.MemorySendChannel[AnswerItem]] = {}
        self._next_channel = 0
        self._nursery: trio.Nursery | None = None
        self.forward_service = ForwardService(
            self._accept_forward, lambda peer: self._may_forward_to_us(peer),
            max_streams=self.config.capacity + self.config.max_queue,
            # its share of jobs, and as many streams being answered or refused (refusals close
            # at once; an honest forwarder holds at most its capacity at one peer)
            max_streams_per_peer=2 * self.config.forwarded_per_peer_limit)
        self._forwarding_now = 0  # our forwards in flight
        #: forwards: ``sent`` (handed to a peer), ``answered`` (its verified answer relayed),
        #: ``failed`` (served here or refused instead), ``received`` (served for a peer)
        self.forwards: dict[str, int] = {"sent": 0, "answered": 0, "failed": 0, "received": 0}

    @property
    def load(self):  # type: ignore[no-untyped-def]
        """The dispatcher's :class:`~ps_p2p.gossip.load.LoadTracker`."""
        return self.dispatcher.load

    @property
    def dropped_cloves(self) -> int:
        """Request cloves dropped (malformed, a second one from one proxy, over a proxy's share)."""
        return self.malformed_cloves + self.dispatcher.dropped_cloves

    def attach(self, overlay) -> None:  # type: ignore[no-untyped-def]
        """Bind to the overlay (its ``on_delivery`` becomes :meth:`on_delivery`)."""
        self.overlay = overlay
        overlay.on_delivery = self.on_delivery

    def enable_forwarding(
        self,
        host,  # type: ignore[no-untyped-def]
        route: Callable[[InferenceQuery], Awaitable[bytes | None]],
        may_forward_to_us: Callable[[bytes], bool],
        forward_done: Callable[[bytes, ForwardOutcome, float], None] | None = None,
    ) -> None:
        """Turn on forwarding (sec. 3.3), before :meth:`run`.

        Args:
            host: the node's py-libp2p host (forwards are sent from it; :meth:`run` serves
                ``/planetserve/forward/1.0.0`` on it).
            route: ``await route(query)``: the model node to hand the query to, or None to serve
                it here; must not raise for a bad query (serve it here instead). Called only
                when a forward can be sent: every peer it answers is forwarded to.
            may_forward_to_us: whether a peer is a trusted model node of our model group in the
                verified directory (others' forwards are refused).
            forward_done: ``forward_done(peer, outcome, seconds)``, once per forward sent: how
                it ended (:class:`~ps_p2p.gossip.load.ForwardOutcome`: its answer came back
                verified and was relayed, it answered OVERLOADED, or it failed) and after how
                long (:meth:`ps_p2p.roles.forwarding.GroupForwarding.forward_done`: the
                router's ledger of what each peer really did).
        """
        self._host = host
        self._route = route
        self.dispatcher.routes = True  # users' requests are routed before they join our Q
        self._may_forward_to_us = may_forward_to_us
        self._forward_done = forward_done

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the dispatch driver and ``capacity`` workers (and, with forwarding, the router
        and the forward protocol's handler) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.driver.run)
            for i in range(self.config.capacity):
                nursery.start_soon(self._worker, i)
            if self._route is not None:
                nursery.start_soon(self._router)
                await nursery.start(self.forward_service.serve, self._host)
            task_status.started()

    async def drain(self, grace: float) -> DrainReport:
        """Stop taking new requests (answered OVERLOADED) and wait until the requests in
        service are answered, at most ``grace`` seconds (:mod:`ps_p2p.serving.drain`).

        The answers are queued to their reply proxies when this returns; the caller keeps the
        overlay running a moment to send them (``OverlayService.flush``).

        Raises:
            ValueError: ``grace`` negative or not finite.
        """
        self.dispatcher.draining = True  # on the driver's trio thread: applies atomically
        drain = Drain(grace, self._clock(), self.dispatcher.in_service)
        log.info("draining: %d request(s) in service, up to %.0f s", self.dispatcher.in_service,
                 grace)
        while not drain.done:
            deadline = drain.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self.driver.wait_processed()  # a job finished (or another input)
            drain.update(self.dispatcher.in_service, self._clock())
        assert drain.report is not None
        return drain.report

    # ------------------------------------------------------------------ cloves in

    def on_delivery(self, proxy: bytes, clove_bytes: bytes) -> None:
        """Hand one request clove from a proxy to the dispatcher; never blocks, never raises.

        A malformed clove is dropped and logged: the proxy forwards user bytes unchanged, so
        resetting its stream would punish the other users whose cloves share it.
        """
        try:
            clove = clove_from_bytes(clove_bytes)
        except RemoteProtocolError as exc:
            self.malformed_cloves += 1
            log.warning("malformed clove from proxy %s dropped: %s", _short(proxy), exc)
            return
        self.driver.submit(functools.partial(self.dispatcher.receive_clove, proxy, clove), peer=proxy)

    # ------------------------------------------------------------------ commands

    def _execute(self, command: dispatch.Command) -> None:
        if isinstance(command, dispatch.DropChannel):
            send = self._channels.pop(command.channel, None)
            if send is not None:
                send.close()  # its stream ends without a reply: the forwarder serves it itself
            return
        if isinstance(command, StartJob):
            if command.local or self._route is None:
                self._jobs_in.send_nowait(command)
            else:
                self._route_in.send_nowait(command)
        elif isinstance(command, SendAnswer):
            self._send_answer(command)
        elif isinstance(command, SendSegment):
            self._send_segment(command)

    async def _worker(self, index: int) -> None:
        async for job in self._jobs_out:
            self.driver.submit(functools.partial(self.dispatcher.job_started, job.key))
            started = self._clock()
            try:
                content = await self._serve(job.key, job.query)
            except Exception as exc:  # an engine bug must not kill the worker or strand waiters
                log.exception("serving %s failed", job.query.request_id.hex()[:8])
                content = self.dispatcher.error_content(
                    ResponseStatus.ENGINE_ERROR, f"{type(exc).__name__}: {exc}"
                )
            self.driver.submit(functools.partial(self.dispatcher.job_finished, job.key, content))
            if content.status == ResponseStatus.OK:
                log.info(
                    "served %s: %d+%d tokens in %.0f ms (load factor %.3f)",
                    job.query.request_id.hex()[:8], content.prompt_tokens,
                    content.completion_tokens, (self._clock() - started) * 1000,
                    self.load.load_factor(),
                )
            else:  # refused or failed: say so, with the status the user receives signed
                log.info("refused %s: %s: %s", job.query.request_id.hex()[:8],
                         ResponseStatus(content.status).name, content.error)

    async def _serve(self, key: bytes, query: InferenceQuery) -> responses.ResponseContent:
        p = query.params
        try:
            params = SamplingParams(
                max_tokens=p.max_tokens or self.config.default_max_tokens,
                temperature=p.temperature,
                top_p=p.top_p or 1.0,
                seed=p.seed,
            )
            if query.messages:
                prompt = await self.engine.chat_prompt(query.messages)
            else:
                prompt = query.prompt
            if query.stream or p.stop:
                completion = await self._stream(key, prompt, params, query)
            else:
                completion = await self.engine.complete(prompt, params)
        except PromptTooLongError as exc:
            return self.dispatcher.error_content(ResponseStatus.PROMPT_TOO_LONG, str(exc))
        except EngineParameterError as exc:  # the request's parameters, not the engine
            return self.dispatcher.error_content(ResponseStatus.BAD_REQUEST, str(exc))
        except (EngineError, PsError, ValueError) as exc:  # ValueError: SamplingParams' checks
            log.warning("engine failed on %s: %s", query.request_id.hex()[:8], exc)
            return self.dispatcher.error_content(ResponseStatus.ENGINE_ERROR, str(exc))
        return responses.ResponseContent(
            status=ResponseStatus.OK,
            text=completion.text,
            error="",
            model_id=self.engine.model_id,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            finish_reason=completion.finish_reason,
        )

    async def _stream(
        self, key: bytes, prompt: str, params: SamplingParams, query: InferenceQuery
    ) -> Completion:
        """Run the engine's stream, cut at the stop strings; for a streamed Q, hand the text to
        the dispatcher as it comes: the first piece at once, then what accumulated, at most one
        segment per ``stream_interval`` seconds and never later than that after it was
        generated."""
        pieces: list[str] = []
        last = StreamChunk("")
        flusher = _Flusher(
            lambda text: self.driver.submit(
                functools.partial(self.dispatcher.job_progress, key, text)
            ),
            self.config.stream_interval,
            self._clock,
        )
        async with trio.open_nursery() as nursery:
            if query.stream:
                nursery.start_soon(flusher.run)
            async for chunk in stop_at(self.engine.stream(prompt, params), query.params.stop):
                pieces.append(chunk.text)
                last = chunk
                if query.stream and chunk.finish_reason is None:
                    flusher.add(chunk.text)
            flusher.flush()  # before the answer: its segment must follow the text's
            nursery.cancel_scope.cancel()
        text = "".join(pieces)
        prompt_tokens = last.prompt_tokens
        if prompt_tokens is None:
            prompt_tokens = len(await self.engine.tokenize(prompt))
        completion_tokens = last.completion_tokens
        if completion_tokens is None:
            completion_tokens = len(await self.engine.tokenize(text)) if text else 0
        return Completion(text, prompt_tokens, completion_tokens, last.finish_reason or FINISH_STOP)

    # ------------------------------------------------------------------ cloves out

    # ------------------------------------------------------------------ forwarding

    async def _router(self) -> None:
        """Route each admitted job: here (a worker) or to another model node (a forward)."""
        assert self._route is not None and self._nursery is not None
        async for job in self._route_out:
            # forwards in flight are bounded like local jobs: past that, serve here (asked
            # before routing: the router counts every peer it answers as forwarded to)
            if self._forwarding_now >= self.config.capacity + self.config.max_queue:
                self._keep(job)
                continue
            try:
                peer = await self._route(job.query)
            except Exception:  # a router bug must not strand the job
                log.exception("routing %s failed; served here", job.query.request_id.hex()[:8])
                peer = None
            if peer is None or peer == self.identity.peer_id:
                self._keep(job)
                continue
            self._forwarding_now += 1
            self.driver.submit(functools.partial(self.dispatcher.job_forwarded, job.key, peer),
                               essential=True)
            self._nursery.start_soon(self._forward, job, peer)

    def _keep(self, job: StartJob) -> None:
        """Serve a routed job here: it joins the dispatcher's queue (Q), then a worker's."""
        self.driver.submit(functools.partial(self.dispatcher.job_routed_here, job.key),
                           essential=True)
        self._jobs_in.send_nowait(job)

    async def _forward(self, job: StartJob, peer: bytes) -> None:
        """Hand ``job`` to ``peer`` and relay its text and verified answer (module docstring);
        any failure goes back to the dispatcher (served here if nothing was streamed yet)."""
        self.forwards["sent"] += 1
        started = self._clock()
        rid = job.query.request_id.hex()[:8]
        req_hash = responses.request_hash(job.q_bytes)
        streamed = bytearray()
        outcome = ForwardOutcome.FAILED

        def on_text(text: str) -> None:
            streamed.extend(text.encode("utf-8", "surrogatepass"))
            if len(streamed) > MAX_STREAM_BYTES:
                raise RemoteProtocolError(f"streamed over {MAX_STREAM_BYTES} bytes")
            self.driver.submit(functools.partial(self.dispatcher.job_progress, job.key, text),
                               essential=True)

        try:
            reply = await forward_request(self._host, peer, job.q_bytes, on_text,
                                          timeout=FORWARD_TIMEOUT)
            if reply.model_node != peer or reply.request_hash != req_hash \
                    or reply.request_id != job.query.request_id:
                raise RemoteProtocolError("answer for another request or from another node")
            responses.verify_response(
                request_id=reply.request_id, req_hash=reply.request_hash,
                content=reply.content(), signed_at_ms=reply.signed_at_ms,
                model_node=reply.model_node, signature=reply.signature)
            # relay only an answer the user will take: OK, our model, and the very text streamed
            if reply.status == ResponseStatus.OVERLOADED:  # signed by it, for this request
                outcome = ForwardOutcome.BUSY
            if reply.status != ResponseStatus.OK:
                raise RemoteProtocolError(f"it answered status {reply.status}")
            if reply.model_id != self.engine.model_id:
                raise RemoteProtocolError(f"it answered for model {reply.model_id!r}")
            if not reply.text.encode("utf-8", "surrogatepass").startswith(bytes(streamed)):
                raise RemoteProtocolError("its signed text is not the text it streamed")
        except (PsError, trio.TooSlowError, Exception) as exc:
            self.forwards["failed"] += 1
            self._report_forward(peer, outcome, self._clock() - started)
            log.info("forward of %s to %s failed (%s); serving it here", rid, _short(peer), exc)
            self.driver.submit(functools.partial(self.dispatcher.forward_failed, job.key),
                               essential=True)
            return
        finally:
            self._forwarding_now -= 1
        self.forwards["answered"] += 1
        self._report_forward(peer, ForwardOutcome.ANSWERED, self._clock() - started)
        vouched = dataclasses.replace(
            reply, forwarded_by=self.identity.peer_id,
            forward_signature=responses.sign_forward(
                self.identity, reply.request_id, reply.request_hash, peer))
        log.info("forwarded %s served by %s in %.0f ms", rid, _short(peer),
                 (self._clock() - started) * 1000)
        self.driver.submit(functools.partial(
            self.dispatcher.job_finished, job.key, reply.content(), signed=vouched),
            essential=True)

    def _report_forward(self, peer: bytes, outcome: ForwardOutcome, seconds: float) -> None:
        if self._forward_done is None:
            return
        try:
            self._forward_done(peer, outcome, seconds)
        except Exception:  # the router's bookkeeping must not strand the job
            log.exception("forward outcome of %s not recorded", _short(peer))

    async def _accept_forward(
        self, sender: bytes, q_bytes: bytes
    ) -> tuple[trio.MemoryReceiveChannel[AnswerItem], Callable[[], None]]:
        """A forward from ``sender`` (:data:`~ps_p2p.protocols.forward.Accept`).

        Raises:
            RemoteProtocolError: ``sender`` is no trusted model node of our group.
        """
        if not self._may_forward_to_us(sender):
            raise RemoteProtocolError("not a trusted model node of this model group")
        self.forwards["received"] += 1
        channel = self._next_channel
        self._next_channel += 1
        # a streamed answer is at most MAX_SEGMENTS segments, then the reply
        send, receive = trio.open_memory_channel[AnswerItem](dispatch.MAX_SEGMENTS + 1)
        self._channels[channel] = send

        def release() -> None:  # the stream is done, whatever happened
            gone = self._channels.pop(channel, None)
            if gone is not None:
                gone.close()

        self.driver.submit(functools.partial(self.dispatcher.receive_forwarded, channel, q_bytes,
                                             sender=sender), essential=True)
        return receive, release

    def _to_channel(self, channel: int, item: AnswerItem) -> None:
        send = self._channels.get(channel)
        if send is None:
            return
        try:
            send.send_nowait(item)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning("forward stream %d cannot take more; dropped", channel)
            self._channels.pop(channel, None)
            send.close()
            return
        if isinstance(item, InferenceReply):
            self._channels.pop(channel, None)
            send.close()

    # ------------------------------------------------------------------ cloves out

    def _send_answer(self, command: SendAnswer) -> None:
        """Sign, encode and send one answer through the waiter's reply proxies (for a streamed
        Q, as its last segment); a forwarded job's answer is the serving node's, vouched for;
        a request forwarded to us is answered on its stream."""
        assert self.overlay is not None, "attach() the overlay first"
        waiter, content = command.waiter, command.content
        try:
            status = ResponseStatus(content.status).name.lower()
        except ValueError:
            status = "unknown"
        self.answers[status] = self.answers.get(status, 0) + 1
        query = waiter.query
        req_hash = responses.request_hash(waiter.q_bytes)
        if isinstance(command.signed, InferenceReply):
            reply = command.signed
        else:
            signed_at = self._wall_ms()
            reply = InferenceReply(
                request_id=query.request_id,
                status=content.status,
                text=content.text,
                error=content.error,
                model_id=content.model_id,
                prompt_tokens=content.prompt_tokens,
                completion_tokens=content.completion_tokens,
                request_hash=req_hash,
                signed_at_ms=signed_at,
                model_node=self.identity.peer_id,
                signature=responses.sign_response(
                    self.identity, query.request_id, req_hash, content, signed_at
                ),
                finish_reason=content.finish_reason,
            )
        if waiter.channel is not None:
            self._to_channel(waiter.channel, reply)
            return
        if not query.stream:
            self._send_message(waiter, encode_reply(reply), responses.response_message_id(
                query.request_id, req_hash
            ))
            return
        rest = content.text.encode("utf-8", "surrogatepass")[command.offset:]
        segment = ResponseSegment(
            query.request_id, command.seq, command.offset,
            rest.decode("utf-8", "surrogatepass"), dataclasses.replace(reply, text=""),
        )
        self._send_message(waiter, encode_segment(segment), responses.segment_message_id(
            responses.response_message_id(query.request_id, req_hash), command.seq
        ))

    def _send_segment(self, command: SendSegment) -> None:
        """Send one text segment of a streamed answer through the waiter's reply proxies (or on
        the forward stream of a request forwarded to us)."""
        if command.waiter.channel is not None:
            self._to_channel(command.waiter.channel, command.text)
            return
        query = command.waiter.query
        req_hash = responses.request_hash(command.waiter.q_bytes)
        segment = ResponseSegment(query.request_id, command.seq, command.offset, command.text)
        self._send_message(command.waiter, encode_segment(segment), responses.segment_message_id(
            responses.response_message_id(query.request_id, req_hash), command.seq
        ))

    def _send_message(self, waiter: dispatch.Waiter, payload: bytes, message_id: bytes) -> None:
        """S-IDA-encode ``payload`` under ``message_id``; clove i, signed, to reply proxy i."""
        assert self.overlay is not None, "attach() the overlay first"
        proxies = waiter.query.reply_proxies
        cloves = sida.encode(
            payload, total=len(proxies), threshold=waiter.threshold, message_id=message_id
        )
        for proxy, clove in zip(proxies, cloves):
            data = clove_to_bytes(clove)
            signature = responses.sign_clove(self.identity, clove.message_id, data)
            self.overlay.send_reply(proxy.peer_id, proxy.reply_tag, data, signature)


__all__ = ["MAX_PROMPT_CHARS", "MAX_TOKENS_LIMIT", "ModelNodeConfig", "ModelNodeService"]
