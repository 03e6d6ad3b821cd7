"""``/planetserve/forward/1.0.0``: a model node hands a request to another of its group (sec. 3.3).

The model node a user asked (A) decodes Q from the cloves; its router may pick another model
node of the same model group (B) that holds Q's prefix in its KV cache or is less loaded
(:mod:`ps_p2p.gossip.forwarding`). A opens one stream to B and writes one ``ForwardRequest``
frame (Q's bytes exactly as A decoded them); B serves Q itself (one hop: a forwarded request is
never forwarded again) and answers on the same stream: zero or more ``text`` frames (a streamed
request's text as it is generated), then one ``reply`` frame, its response signed by B over the
hash of those Q bytes, and closes.

A relays B's answer to the user through the request's reply proxies itself, adding its forward
voucher (:func:`ps_p2p.responses.sign_forward`): the proxies accept cloves only from the node
they delivered to, so they need no change, and the user sees who served and who forwarded
(:mod:`ps_p2p.overlay.requests`).

Threats, and what bounds them:

* B learns Q (prompt, reply proxies and tags) and A learns the answer: both are model nodes of
  the group, which see prompts and answers anyway; neither learns who the user is.
* A cannot alter B's answer (B's signature covers it, and the user checks it) nor claim B served
  what it did not; B cannot answer for A (the user takes B's answer only with A's voucher).
* A malicious A could forward everything (its own node idle): the user and the verifiers see
  ``forwarded_by``, so answers are credited to B, who did the work.
* B accepts a forward only from a model node of its own model listed in its verified directory
  (the service's ``accept`` callback); anything else resets the stream. One member's forward
  streams are bounded (``max_streams_per_peer``) apart from all members' (``max_streams``), and
  so are the jobs forwarded to B (:class:`~ps_p2p.serving.dispatch.DispatchConfig`: one
  member's, all members' together), so a member cannot use forwarding as a free inference
  service that crowds out the users who asked B (issue 16). Every frame is bounded
  (:data:`MAX_REQUEST_BYTES`, :data:`MAX_FRAME_BYTES`) and so are the text frames of one answer
  (:data:`MAX_TEXT_FRAMES`); a malformed frame resets that stream only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamError

from ps_p2p.errors import RemoteProtocolError
from ps_p2p.inference import InferenceReply
from ps_p2p.pb.planetserve.v1 import forward_pb2
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.handlers import exchange, reset_quietly, serve_handlers
from ps_p2p.protocols.inference_codec import reply_from_pb, reply_to_pb
from ps_p2p.protocols.wire import parse
from ps_p2p.records.peer_ids import peer_label

log = logging.getLogger(__name__)

FORWARD_PROTOCOL_ID = TProtocol("/planetserve/forward/1.0.0")
#: Largest ForwardRequest frame (a prompt of 512 Ki characters is at most 2 MiB of UTF-8).
MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: Largest answer frame (a text piece, or the signed response with the whole text).
MAX_FRAME_BYTES = 1024 * 1024
#: Text frames of one answer at most (the dispatch core sends at most 127 segments per answer).
MAX_TEXT_FRAMES = 4096

#: Seconds a forwarding node has to send its request frame once the stream is open.
REQUEST_READ_TIMEOUT = 10.0

#: What the serving side hands the handler for one forwarded request: text pieces, then the
#: signed reply (last). The send side closed without a reply: the request was dropped.
AnswerItem = str | InferenceReply
#: ``accept(sender, q_bytes) -> (items, release)``: starts serving and returns where the
#: answer's items arrive, and what the handler calls when it is done with them (whatever
#: happened); raises RemoteProtocolError to refuse.
Accept = Callable[[bytes, bytes],
                  Awaitable[tuple[trio.MemoryReceiveChannel[AnswerItem], Callable[[], None]]]]


def _text_frame(text: str) -> bytes:
    return encode_frame(forward_pb2.ForwardFrame(text=text).SerializeToString())


def _reply_frame(reply: InferenceReply) -> bytes:
    return encode_frame(forward_pb2.ForwardFrame(reply=reply_to_pb(reply)).SerializeToString())


class ForwardService:
    """The serving side of :data:`FORWARD_PROTOCOL_ID` (handlers only decode and hand over).

    Args:
        accept: see :data:`Accept`.
        may_forward: whether a peer may forward to us at all (checked before anything is read:
            a trusted model node of our group).
        answer_timeout: seconds the answer may take in all before the stream is reset.
        max_streams: forward streams served at once (more are reset at once).
        max_streams_per_peer: of those, from one peer at most (more are reset at once).

    Attributes:
        served: forwarded requests answered; refused: streams reset for bad input or a sender
            that may not forward to us.
    """

    def __init__(self, accept: Accept, may_forward: Callable[[bytes], bool] = lambda p: True, *,
                 answer_timeout: float = 600.0, max_streams: int = 256,
                 max_streams_per_peer: int = 16) -> None:
        self._accept = accept
        self._may_forward = may_forward
        self.answer_timeout = answer_timeout
        self.max_streams = max_streams
        self.max_streams_per_peer = max_streams_per_peer
        self.open = 0
        self._open_by: dict[bytes, int] = {}  # streams open, by peer
        self.served = 0
        self.refused = 0

    async def serve(
        self, host: IHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve on ``host`` until cancelled, then remove the handler."""
        await serve_handlers(host, {FORWARD_PROTOCOL_ID: self._handle_stream},
                             task_status=task_status)

    async def _handle_stream(self, stream: INetStream) -> None:
        # guarded: an exception escaping a handler kills the py-libp2p host
        sender = stream.muxed_conn.peer_id.to_bytes()
        release: Callable[[], None] | None = None
        self.open += 1
        self._open_by[sender] = self._open_by.get(sender, 0) + 1
        try:
            if not self._may_forward(sender):
                raise RemoteProtocolError("not a trusted model node of this model group")
            if self.open > self.max_streams:
                raise RemoteProtocolError(f"over {self.max_streams} forwards in service")
            if self._open_by[sender] > self.max_streams_per_peer:
                raise RemoteProtocolError(
                    f"over {self.max_streams_per_peer} forwards of that node in service")
            with trio.fail_after(REQUEST_READ_TIMEOUT):
                frame = await read_frame(stream, MAX_REQUEST_BYTES)
            request = parse(forward_pb2.ForwardRequest, frame)
            items, release = await self._accept(sender, bytes(request.query))
            replied = False
            with trio.fail_after(self.answer_timeout):
                async with items:
                    async for item in items:
                        if isinstance(item, InferenceReply):
                            await stream.write(_reply_frame(item))
                            replied = True
                            break
                        await stream.write(_text_frame(item))
            if not replied:
                raise RemoteProtocolError("the request was dropped (undecodable or a duplicate)")
            await stream.close()
            self.served += 1
        except RemoteProtocolError as exc:
            self.refused += 1
            log.warning("forward from %s refused: %s", peer_label(sender), exc)
            await reset_quietly(stream)
        except (StreamError, trio.TooSlowError) as exc:
            log.info("forward stream from %s failed: %r", peer_label(sender), exc)
            await reset_quietly(stream)
        except Exception:
            log.exception("forward stream from %s: unexpected error", peer_label(sender))
            await reset_quietly(stream)
        finally:
            self.open -= 1
            left = self._open_by.get(sender, 1) - 1
            if left > 0:
                self._open_by[sender] = left
            else:
                self._open_by.pop(sender, None)
            if release is not None:
                release()


async def forward_request(
    host: IHost,
    peer: bytes,
    q_bytes: bytes,
    on_text: Callable[[str], None],
    *,
    connect_timeout: float = 5.0,
    idle_timeout: float = 120.0,
    timeout: float = 600.0,
) -> InferenceReply:
    """Hand Q to model node ``peer`` and wait for its signed answer.

    Args:
        q_bytes: Q as this node decoded it (the answer signs their hash).
        on_text: called with each text piece of a streamed answer, in order.
        connect_timeout: seconds for the dial, negotiation and the request's write.
        idle_timeout: seconds allowed between two frames of the answer.
        timeout: seconds allowed for the whole answer (a slow-drip peer cannot hold it longer).

    Returns:
        the reply frame as ``peer`` sent it; the caller checks its signature and request hash.

    Raises:
        RemoteProtocolError: a malformed or oversized frame, too many text frames, or the
            stream ended before the reply.
        trio.TooSlowError: the dial, a frame or the whole answer took too long.
        Exception: py-libp2p's dial and negotiation errors.
    """
    async def body(stream: INetStream) -> InferenceReply:
        with trio.fail_after(connect_timeout):
            await stream.write(encode_frame(
                forward_pb2.ForwardRequest(query=q_bytes).SerializeToString()))
        for _ in range(MAX_TEXT_FRAMES + 1):
            with trio.fail_after(idle_timeout):
                try:
                    data = await read_frame(stream, MAX_FRAME_BYTES)
                except StreamEOF:
                    raise RemoteProtocolError("forward stream ended before the reply") from None
            frame = parse(forward_pb2.ForwardFrame, data)
            kind = frame.WhichOneof("kind")
            if kind == "reply":
                return reply_from_pb(frame.reply)
            if kind != "text":
                raise RemoteProtocolError(f"forward answer frame of kind {kind!r}")
            on_text(frame.text)
        raise RemoteProtocolError(f"more than {MAX_TEXT_FRAMES} text frames")

    with trio.fail_after(timeout):
        return await exchange(host, peer, FORWARD_PROTOCOL_ID, body, timeout=connect_timeout)


__all__ = [
    "FORWARD_PROTOCOL_ID",
    "MAX_FRAME_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_TEXT_FRAMES",
    "ForwardService",
    "forward_request",
]
