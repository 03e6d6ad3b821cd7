"""``planetserve.v1.InferenceRequest`` / ``InferenceResponse`` / ``ResponseSegment`` <->
:mod:`ps_p2p.inference` (service layer): the only place Q and the response meet protobuf."""

from __future__ import annotations

from ps_p2p.inference import (
    ChatMessage,
    InferenceQuery,
    InferenceReply,
    ReplyProxy,
    ResponseSegment,
    SamplingParams,
)
from ps_p2p.pb.planetserve.v1 import inference_pb2
from ps_p2p.protocols.wire import parse

#: Segments are padded to a multiple of this many bytes (docs/streaming.md).
SEGMENT_PAD_BYTES = 256


def encode_query(query: InferenceQuery) -> bytes:
    """Q's bytes (what the cloves carry and the response's request hash covers)."""
    return inference_pb2.InferenceRequest(
        request_id=query.request_id,
        model_id=query.model_id,
        prompt=query.prompt,
        params=inference_pb2.SamplingParams(
            max_tokens=query.params.max_tokens,
            temperature=query.params.temperature,
            top_p=query.params.top_p,
            seed=query.params.seed,
            stop=list(query.params.stop),
        ),
        reply_proxies=[
            inference_pb2.ReplyProxy(peer_id=p.peer_id, reply_tag=p.reply_tag)
            for p in query.reply_proxies
        ],
        preferred_model_node=query.preferred_model_node,
        stream=query.stream,
        messages=[inference_pb2.ChatMessage(role=m.role, content=m.content) for m in query.messages],
    ).SerializeToString()


def decode_query(data: bytes) -> InferenceQuery:
    """Raises RemoteProtocolError: not an ``InferenceRequest``."""
    m = parse(inference_pb2.InferenceRequest, data)
    return InferenceQuery(
        request_id=m.request_id,
        model_id=m.model_id,
        prompt=m.prompt,
        params=SamplingParams(
            max_tokens=m.params.max_tokens,
            temperature=m.params.temperature,
            top_p=m.params.top_p,
            seed=m.params.seed if m.params.HasField("seed") else None,
            stop=tuple(m.params.stop),
        ),
        reply_proxies=tuple(ReplyProxy(p.peer_id, p.reply_tag) for p in m.reply_proxies),
        preferred_model_node=m.preferred_model_node,
        stream=m.stream,
        messages=tuple(ChatMessage(x.role, x.content) for x in m.messages),
    )


def reply_to_pb(reply: InferenceReply) -> inference_pb2.InferenceResponse:
    """A reply as its ``InferenceResponse`` message."""
    return inference_pb2.InferenceResponse(
        request_id=reply.request_id,
        status=reply.status,
        text=reply.text,
        error=reply.error,
        model_id=reply.model_id,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
        request_hash=reply.request_hash,
        signed_at_ms=reply.signed_at_ms,
        model_node=reply.model_node,
        signature=reply.signature,
        finish_reason=reply.finish_reason,
        forwarded_by=reply.forwarded_by,
        forward_signature=reply.forward_signature,
    )


def reply_from_pb(m: inference_pb2.InferenceResponse) -> InferenceReply:
    """A reply from its ``InferenceResponse`` message (fields unchecked: the caller verifies
    the signature)."""
    return InferenceReply(
        request_id=m.request_id,
        status=m.status,
        text=m.text,
        error=m.error,
        model_id=m.model_id,
        prompt_tokens=m.prompt_tokens,
        completion_tokens=m.completion_tokens,
        request_hash=m.request_hash,
        signed_at_ms=m.signed_at_ms,
        model_node=m.model_node,
        signature=m.signature,
        finish_reason=m.finish_reason,
        forwarded_by=m.forwarded_by,
        forward_signature=m.forward_signature,
    )


def encode_reply(reply: InferenceReply) -> bytes:
    return reply_to_pb(reply).SerializeToString()


def decode_reply(data: bytes) -> InferenceReply:
    """Raises RemoteProtocolError: not an ``InferenceResponse``."""
    return reply_from_pb(parse(inference_pb2.InferenceResponse, data))


def encode_segment(segment: ResponseSegment, pad_to: int = SEGMENT_PAD_BYTES) -> bytes:
    """A segment's bytes, zero-padded (``padding`` field) to a multiple of ``pad_to`` bytes so
    a reply proxy learns the text's size only to that granularity."""
    m = inference_pb2.ResponseSegment(
        request_id=segment.request_id, seq=segment.seq, offset=segment.offset, text=segment.text
    )
    if segment.final is not None:
        m.final.CopyFrom(reply_to_pb(segment.final))
    size = m.ByteSize()
    if pad_to > 1:
        # field 6 costs a tag byte and a length varint (1 or 2 bytes here) before the zeros
        for header in (2, 3, 4):
            pad = -(size + header) % pad_to
            m.padding = bytes(pad)
            if m.ByteSize() % pad_to == 0:
                break
    return m.SerializeToString()


def decode_segment(data: bytes) -> ResponseSegment:
    """Raises RemoteProtocolError: not a ``ResponseSegment``."""
    m = parse(inference_pb2.ResponseSegment, data)
    return ResponseSegment(
        request_id=m.request_id,
        seq=m.seq,
        offset=m.offset,
        text=m.text,
        final=reply_from_pb(m.final) if m.HasField("final") else None,
    )


__all__ = [
    "SEGMENT_PAD_BYTES", "decode_query", "decode_reply", "decode_segment", "encode_query",
    "encode_reply", "encode_segment", "reply_from_pb", "reply_to_pb",
]
