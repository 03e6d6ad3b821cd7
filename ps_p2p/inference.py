"""The request Q and the signed response as plain domain objects (pure; no protobuf).

PlanetServe sec. 3.2, "Request" and "Response". The wire forms are ``InferenceRequest`` and
``InferenceResponse`` of ``protos/planetserve/v1/inference.proto``; the service layer converts
(``ps_p2p.roles.user``), the cores (``ps_p2p.overlay.requests``) see only these classes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ps_p2p import responses
from ps_p2p.errors import ContextLengthError, ModelNodeError, OverloadedError, RequestRefusedError


class ResponseStatus(enum.IntEnum):
    """``planetserve.v1.ResponseStatus`` (same values)."""

    OK = 0
    OVERLOADED = 1
    PROMPT_TOO_LONG = 2
    ENGINE_ERROR = 3
    BAD_REQUEST = 4
    WRONG_MODEL = 5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters; ``temperature`` 0 is greedy; generation ends before the first of
    the ``stop`` strings (OpenAI's ``stop``)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: unseeded
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat (OpenAI's chat completions API, text content only).

    Attributes:
        role: ``system``, ``user``, ``assistant``, ``developer`` or ``tool``.
        content: the message text.
    """

    role: str
    content: str


@dataclass(frozen=True)
class ReplyProxy:
    """A proxy the answer goes back through, and the fresh reply tag registered with it."""

    peer_id: bytes
    reply_tag: bytes


@dataclass(frozen=True)
class InferenceQuery:
    """Q: what a model node is asked. Nothing in it identifies the user.

    Attributes:
        request_id: 16 random bytes, the same for every sending of one request.
        prompt: the prompt; "" when ``messages`` is a chat.
        reply_proxies: one per clove, in clove order.
        stream: answer in segments as the text is generated (docs/streaming.md).
        messages: a chat, rendered by the model node with its model's chat template.
        preferred_model_node: session affinity (sec. 3.3): the model node that served the
            previous prompt of this conversation (the model node asked forwards there unless
            that node is overloaded); empty: none.
    """

    request_id: bytes
    model_id: str
    prompt: str
    params: SamplingParams
    reply_proxies: tuple[ReplyProxy, ...]
    preferred_model_node: bytes = b""
    stream: bool = False
    messages: tuple[ChatMessage, ...] = ()


@dataclass(frozen=True)
class InferenceReply:
    """A model node's signed response (see :mod:`ps_p2p.responses` for what the signature covers).

    Attributes:
        status: a :class:`ResponseStatus` value (other values may come from newer nodes).
        request_hash: SHA-256 of Q's bytes as the model node decoded them.
        signed_at_ms: signing time (Unix ms).
        model_node: peer ID of the signer (the node that served).
        forwarded_by: the model node the user asked, when it forwarded the request to
            ``model_node`` (sec. 3.3); empty otherwise.
        forward_signature: ``forwarded_by``'s voucher (:func:`~ps_p2p.responses.sign_forward`).
    """

    request_id: bytes
    status: int
    text: str
    error: str
    model_id: str
    prompt_tokens: int
    completion_tokens: int
    request_hash: bytes
    signed_at_ms: int
    model_node: bytes
    signature: bytes
    finish_reason: str = ""
    forwarded_by: bytes = b""
    forward_signature: bytes = b""

    def content(self) -> responses.ResponseContent:
        """The part of the reply the signature's response hash covers."""
        return responses.ResponseContent(
            status=self.status,
            text=self.text,
            error=self.error,
            model_id=self.model_id,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason,
        )


@dataclass(frozen=True)
class ResponseSegment:
    """One segment of a streamed answer (``planetserve.v1.ResponseSegment``; docs/streaming.md).

    Attributes:
        seq: 0, 1, 2...; bound in the segment's S-IDA message ID
            (:func:`ps_p2p.responses.segment_message_id`).
        offset: UTF-8 byte offset of ``text`` in the whole answer.
        text: the segment's text.
        final: on the last segment only, the signed reply; its ``text`` is "" on the wire and
            the concatenation of every segment's text is what its signature covers.
    """

    request_id: bytes
    seq: int
    offset: int
    text: str
    final: InferenceReply | None = None


_STATUS_ERRORS: dict[int, type[ModelNodeError]] = {
    ResponseStatus.OVERLOADED: OverloadedError,
    ResponseStatus.PROMPT_TOO_LONG: ContextLengthError,
    ResponseStatus.BAD_REQUEST: RequestRefusedError,
    ResponseStatus.WRONG_MODEL: RequestRefusedError,
}


def status_error(status: int, message: str) -> ModelNodeError:
    """The error for a reply with a non-OK ``status``; its text is ``"<STATUS NAME>: message"``.

    ENGINE_ERROR and unknown statuses give a plain :class:`ModelNodeError`.
    """
    try:
        name = ResponseStatus(status).name
    except ValueError:
        name = f"STATUS_{status}"
    cls = _STATUS_ERRORS.get(status, ModelNodeError)
    return cls(f"{name}: {message}", status=status)


__all__ = [
    "ChatMessage",
    "InferenceQuery",
    "InferenceReply",
    "ReplyProxy",
    "ResponseSegment",
    "ResponseStatus",
    "SamplingParams",
    "status_error",
]
