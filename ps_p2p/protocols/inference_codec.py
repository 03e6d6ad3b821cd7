"""``planetserve.v1.InferenceRequest`` / ``InferenceResponse`` <-> :mod:`ps_p2p.inference`
(service layer): the only place Q and the response meet protobuf."""

from __future__ import annotations

from ps_p2p.inference import InferenceQuery, InferenceReply, ReplyProxy, SamplingParams
from ps_p2p.pb.planetserve.v1 import inference_pb2
from ps_p2p.protocols.wire import parse


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
        ),
        reply_proxies=[
            inference_pb2.ReplyProxy(peer_id=p.peer_id, reply_tag=p.reply_tag)
            for p in query.reply_proxies
        ],
        preferred_model_node=query.preferred_model_node,
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
            seed=m.params.seed,
        ),
        reply_proxies=tuple(ReplyProxy(p.peer_id, p.reply_tag) for p in m.reply_proxies),
        preferred_model_node=m.preferred_model_node,
    )


def encode_reply(reply: InferenceReply) -> bytes:
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
    ).SerializeToString()


def decode_reply(data: bytes) -> InferenceReply:
    """Raises RemoteProtocolError: not an ``InferenceResponse``."""
    m = parse(inference_pb2.InferenceResponse, data)
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
    )


__all__ = ["decode_query", "decode_reply", "encode_query", "encode_reply"]
