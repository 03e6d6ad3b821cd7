"""Signed inference responses (PlanetServe sec. 3.2, "Response"), pure.

A model node signs (request ID, SHA-256 of the decoded request Q, SHA-256 of the response
content, signing time, its peer ID) with its identity key, over the domain-separated byte string
of :func:`ps_p2p.records.response_signing_bytes`. The response content digest here is a canonical
encoding of the fields a user relies on, never a re-serialized protobuf.

Forwarding (sec. 3.3): a model node A that hands a request to another model node B of its group
(``/planetserve/forward/1.0.0``) relays B's signed response to the reply proxies itself (they
accept cloves only from the node they delivered to) and adds a *forward voucher*: A's signature
over ``b"planetserve/v1/forward\x00" || bytes(request_id) || bytes(request hash) ||
bytes(B's peer ID)`` (``bytes`` = u32 length || data). The user then sees who served (B, whose
signature covers the answer) and who forwarded (A, the node it asked), and accepts B's answer
only with A's voucher (:func:`verify_forward`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from ps_p2p import records

_CONTENT_PREFIX = b"planetserve/v1/response-content\x00"
FORWARD_DOMAIN = b"planetserve/v1/forward\x00"


@dataclass(frozen=True)
class ResponseContent:
    """What a model node answers; the part covered by ``response_hash``.

    Attributes:
        status: an ``InferenceResponse`` status value (0 = ok).
        text: generated text (UTF-8).
        error: a human-readable error when status != 0.
        model_id: the model that produced ``text``.
        prompt_tokens, completion_tokens: token counts under the model's tokenizer.
        finish_reason: why generation ended, ``"stop"`` or ``"length"`` (OpenAI's terms); ""
            for an error answer.
    """

    status: int
    text: str
    error: str
    model_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = ""

    def digest(self) -> bytes:
        """SHA-256 over a length-prefixed canonical encoding (32 bytes)."""
        h = hashlib.sha256(_CONTENT_PREFIX)
        h.update(struct.pack(">III", self.status, self.prompt_tokens, self.completion_tokens))
        for part in (self.text, self.error, self.model_id, self.finish_reason):
            data = part.encode("utf-8")
            h.update(struct.pack(">I", len(data)))
            h.update(data)
        return h.digest()


_RESPONSE_ID_PREFIX = b"planetserve/v1/response-id\x00"


def response_message_id(request_id: bytes, req_hash: bytes) -> bytes:
    """The S-IDA message ID of the response to one sending of a request (16 bytes).

    A hash of the request ID and of the request's hash (each resend names other reply proxies,
    so each gets its own response ID): reply proxies, who see response cloves, never learn the
    request ID, and cloves of two answers to two sendings never mix.
    """
    return hashlib.sha256(_RESPONSE_ID_PREFIX + request_id + req_hash).digest()[:16]


_SEGMENT_ID_PREFIX = b"planetserve/v1/segment-id\x00"


def segment_message_id(response_id: bytes, seq: int) -> bytes:
    """The S-IDA message ID of segment ``seq`` of a streamed answer (16 bytes): a hash of the
    answer's :func:`response_message_id` and ``seq``, so each segment's cloves (signed over
    their message ID) name their place in the stream and a proxy cannot reorder them."""
    return hashlib.sha256(_SEGMENT_ID_PREFIX + response_id + struct.pack(">I", seq)).digest()[:16]


def request_hash(request_bytes: bytes) -> bytes:
    """SHA-256 of the request Q exactly as decoded from the cloves (32 bytes)."""
    return hashlib.sha256(request_bytes).digest()


def signing_bytes(
    request_id: bytes, req_hash: bytes, content: ResponseContent, signed_at_ms: int, model_node: bytes
) -> bytes:
    """The byte string a model node signs for one response."""
    return records.response_signing_bytes(
        request_id, req_hash, content.digest(), signed_at_ms, model_node
    )


def verify_response(
    *,
    request_id: bytes,
    req_hash: bytes,
    content: ResponseContent,
    signed_at_ms: int,
    model_node: bytes,
    signature: bytes,
) -> None:
    """Check a model node's response signature.

    Raises:
        InvalidSignatureError: the signature does not verify under ``model_node``'s key.
        RemoteProtocolError: ``model_node`` is not an Ed25519 peer ID.
    """
    data = signing_bytes(request_id, req_hash, content, signed_at_ms, model_node)
    records.verify_signature(model_node, data, signature)


def sign_response(
    signer: records.Signer, request_id: bytes, req_hash: bytes, content: ResponseContent,
    signed_at_ms: int,
) -> bytes:
    """A model node's signature over one response (:func:`signing_bytes`, its own peer ID)."""
    return signer.sign(signing_bytes(request_id, req_hash, content, signed_at_ms, signer.peer_id))


def forward_signing_bytes(request_id: bytes, req_hash: bytes, served_by: bytes) -> bytes:
    """What a forwarding model node signs (module docstring)."""
    def lp(data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + data

    return FORWARD_DOMAIN + lp(request_id) + lp(req_hash) + lp(served_by)


def sign_forward(signer: records.Signer, request_id: bytes, req_hash: bytes,
                 served_by: bytes) -> bytes:
    """The forward voucher of ``signer`` (the node the user asked) for ``served_by``."""
    return signer.sign(forward_signing_bytes(request_id, req_hash, served_by))


def verify_forward(forwarded_by: bytes, request_id: bytes, req_hash: bytes, served_by: bytes,
                   signature: bytes) -> None:
    """Check a forward voucher.

    Raises:
        InvalidSignatureError: it does not verify under ``forwarded_by``'s key.
        RemoteProtocolError: ``forwarded_by`` is not an Ed25519 peer ID.
    """
    records.verify_signature(forwarded_by, forward_signing_bytes(request_id, req_hash, served_by),
                             signature)


def sign_clove(signer: records.Signer, message_id: bytes, clove: bytes) -> bytes:
    """A model node's signature over one serialized response clove
    (:func:`ps_p2p.records.clove_signing_bytes`): proxies and users check it per clove."""
    return signer.sign(records.clove_signing_bytes(message_id, clove))


def verify_clove(model_node: bytes, message_id: bytes, clove: bytes, signature: bytes) -> None:
    """Check :func:`sign_clove`'s signature.

    Raises:
        InvalidSignatureError: it does not verify under ``model_node``'s key.
        RemoteProtocolError: ``model_node`` is not an Ed25519 peer ID.
    """
    records.verify_signature(model_node, records.clove_signing_bytes(message_id, clove), signature)
