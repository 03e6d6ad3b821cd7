"""Fakes for tests and benchmarks: an engine that answers at once, or when released; a user
node that answers requests at once, or fails them with a chosen typed error, with no network."""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import trio

from ps_p2p.config import NodeConfig
from ps_p2p.crypto import sida
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.engines.base import (
    ChatMessage,
    Completion,
    Engine,
    SamplingParams,
    TokenScores,
    default_chat_prompt,
)
from ps_p2p.errors import (
    ModelNodeError,
    NoModelNodeError,
    NoPathError,
    PromptTooLongError,
    PsError,
    RequestTooLargeError,
)
from ps_p2p.keys import Identity, NodeKeys
from ps_p2p.protocols.overlay import PathHandle
from ps_p2p.records import Directory, NodeRecord, Role, sign_record
from ps_p2p.roles.user import Answer, UserPath, describe, trusted_model_nodes


class InstantEngine(Engine):
    """A deterministic engine: the answer is ``reply_bytes`` characters derived from the prompt.

    Tokens are characters (so ``max_context`` counts characters). With ``gate`` set, every call
    waits until the gate event is set (to hold requests in service for overload tests).

    Args:
        model_id: announced model ID.
        reply_bytes: length of every answer (0 = echo the prompt's first 64 characters reversed).
        max_context: prompt + max_tokens limit in characters.
    """

    def __init__(
        self,
        model_id: str = "fake-model",
        *,
        reply_bytes: int = 0,
        max_context: int = 1 << 20,
        gate: trio.Event | None = None,
    ) -> None:
        self.model_id = model_id
        self.max_context = max_context
        self.reply_bytes = reply_bytes
        self.gate = gate
        self.calls = 0
        #: set when a call starts waiting at ``gate`` (a request is in service)
        self.entered = trio.Event()

    def answer_for(self, prompt: str, max_tokens: int) -> str:
        """The text this engine answers to ``prompt``."""
        if self.reply_bytes:
            return ("x" * self.reply_bytes)[: max(self.reply_bytes, 0)]
        return prompt[:64][::-1][:max_tokens]

    def _check(self, prompt: str, params: SamplingParams) -> None:
        if len(prompt) + params.max_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} "
                f"exceeds the context of {self.max_context}"
            )

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[str]:
        self._check(prompt, params)
        self.calls += 1
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        text = self.answer_for(prompt, params.max_tokens)
        for i in range(0, len(text), 16):
            yield text[i : i + 16]

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        self._check(prompt, params)
        self.calls += 1
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        text = self.answer_for(prompt, params.max_tokens)
        return Completion(
            text=text,
            prompt_tokens=len(prompt),
            completion_tokens=len(text),
            finish_reason="length",
        )

    async def score(self, prompt: str, continuation: str) -> TokenScores:
        return TokenScores(token_ids=[ord(c) for c in continuation], logprobs=[-1.0] * len(continuation))

    async def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    async def logprob_rows(self, sequences):  # type: ignore[no-untyped-def]
        """Uniform next-token distributions over the characters (code points) up to the
        largest one seen (at least 128): every answer is as likely as any other."""
        import numpy as np

        vocab = max([128] + [max(ids, default=0) + 1 for ids, _ in sequences])
        return [np.full((len(ids) - start + 1, vocab), -math.log(vocab))
                for ids, start in sequences]

    async def aclose(self) -> None:
        return None


# ------------------------------------------------------------------------------ user node


def reversed_prompt(prompt: str, max_tokens: int) -> str:
    """:class:`InstantEngine`'s default answer: the prompt's first 64 characters reversed,
    cut to ``max_tokens`` characters."""
    return prompt[:64][::-1][:max_tokens]


@dataclass(frozen=True)
class AskCall:
    """One :meth:`FakeUserClient.ask` as it was called (the keyword arguments of
    :meth:`ps_p2p.roles.user.UserClient.ask`)."""

    prompt: str
    model_id: str | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    model_node: bytes | None
    timeout: float | None
    messages: tuple[ChatMessage, ...] = ()
    stop: tuple[str, ...] = ()
    stream: bool = False


class FakeUserClient:
    """The face of :class:`~ps_p2p.roles.user.UserClient` that the local API uses, with no network.

    :meth:`ask` returns at once a real :class:`~ps_p2p.roles.user.Answer`, shaped as the real
    client shapes it:

    * no model node in the directory serves ``model_id``: not ok, ``NoModelNodeError``, no
      attempt (checked first, as the real client does);
    * else, when :meth:`fail_next` queued an error: not ok with that error as ``exception``; a
      ``ModelNodeError`` (a signed error status) comes signed by the chosen model node with
      ``status`` = the error's ``status``, any other error with no reply (``served_by`` b"",
      ``signature_valid`` False); ``attempts`` is 0 for the outcomes of requests never sent
      (``NoPathError``, ``NoModelNodeError``, ``RequestTooLargeError``), else 1;
    * else ok: ``reply(prompt, max_tokens)`` signed by the first model node serving
      ``model_id``, ``threshold`` cloves, one attempt, ``completion_tokens`` = characters.

    Request IDs count up from 1 (16 bytes, big-endian). Every call is kept in :attr:`calls`
    and every answer in :attr:`answers`.

    Args:
        directory: returns the directory (as the real client's ``directory`` argument).
        paths: the ready paths' relays, first hop first (the last is the proxy).
        reply: the answer text as a function of (prompt, max_tokens).
        threshold: cloves received per decoded answer (k).
        latency_ms: every answer's latency (milliseconds).
        clock: seconds (trio's clock); the paths were set up when the client was made.
    """

    def __init__(
        self,
        directory: Callable[[], Directory | None],
        paths: Sequence[Sequence[bytes]],
        *,
        reply: Callable[[str, int], str] = reversed_prompt,
        threshold: int = sida.DEFAULT_THRESHOLD,
        latency_ms: float = 25.0,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._directory = directory
        self.reply = reply
        self.threshold = threshold
        self.latency_ms = latency_ms
        created_at = clock()
        self._paths = [
            UserPath(path_id, PathHandle(), tuple(relays), created_at)
            for path_id, relays in enumerate(paths, start=1)
        ]
        self._failures: deque[PsError] = deque()
        #: characters per piece given to ``on_text``
        self.stream_piece = 4
        self.calls: list[AskCall] = []
        self.answers: list[Answer] = []
        #: model nodes found lost (:meth:`lose`)
        self.lost: set[bytes] = set()

    def fail_next(self, *errors: PsError) -> None:
        """Make the next ``len(errors)`` requests fail with these errors, in order."""
        self._failures.extend(errors)

    def ready_paths(self) -> list[UserPath]:
        """The paths given to the constructor, all ready."""
        return list(self._paths)

    def model_nodes(self, model_id: str | None = None) -> list[NodeRecord]:
        """The trusted model nodes of the directory, highest reputation first (optionally
        serving ``model_id``), as the real one (:func:`~ps_p2p.roles.user.trusted_model_nodes`);
        :meth:`ask` sends to the first (the real one draws weighted by reputation)."""
        directory = self._directory()
        if directory is None:
            return []
        return trusted_model_nodes(directory, model_id)

    def lose(self, peer_id: bytes) -> None:
        """Find the model node ``peer_id`` lost (as the real client does when more than n - k
        proxies lost it): :meth:`reachable_model_nodes` and :meth:`ask` leave it out."""
        self.lost.add(peer_id)

    def reachable_model_nodes(self, model_id: str | None = None) -> list[NodeRecord]:
        """:meth:`model_nodes` without those :meth:`lose` named."""
        return [r for r in self.model_nodes(model_id) if r.peer_id not in self.lost]

    async def ask(
        self,
        prompt: str = "",
        *,
        messages: Sequence[ChatMessage] = (),
        model_id: str | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        model_node: bytes | None = None,
        timeout: float | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        """Answer at once (see the class docstring); never raises for network trouble, like
        the real one. A chat is answered as if its prompt were :func:`default_chat_prompt`;
        the answer is cut before the first ``stop`` string (``finish_reason`` "stop", else
        "length"); with ``on_text`` the text is given to it first, in pieces of
        :attr:`stream_piece` characters.

        Raises:
            ValueError: neither a non-blank prompt nor messages, or both (as the real one).
        """
        if bool(prompt) == bool(messages) or (prompt and not prompt.strip()):
            raise ValueError("ask needs a non-blank prompt or chat messages (not both)")
        self.calls.append(AskCall(
            prompt, model_id, max_tokens, temperature, top_p, seed, model_node, timeout,
            tuple(messages), tuple(stop), on_text is not None,
        ))
        if messages:
            prompt = default_chat_prompt(messages)
        request_id = len(self.calls).to_bytes(16, "big")
        candidates = [
            r for r in self.reachable_model_nodes(model_id)
            if model_node is None or r.peer_id == model_node
        ]
        if not candidates:
            error: PsError = NoModelNodeError(
                f"no model node serving {model_id!r} in the directory"
                if model_id else "no model node in the directory"
            )
            answer = Answer(request_id, ok=False, error=describe(error), exception=error)
        elif self._failures:
            answer = self._failed(request_id, candidates[0], self._failures.popleft())
        else:
            target = candidates[0]
            text = self.reply(prompt, max_tokens)
            finish = "length"
            cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
            if cuts:
                text, finish = text[: min(cuts)], "stop"
            if on_text is not None:
                for i in range(0, len(text), self.stream_piece):
                    on_text(text[i : i + self.stream_piece])
            answer = Answer(
                request_id,
                ok=True,
                text=text,
                served_by=target.peer_id,
                signature_valid=True,
                cloves_received=self.threshold,
                latency_ms=self.latency_ms,
                attempts=1,
                model_id=target.model_id,
                completion_tokens=len(text),
                prompt_tokens=len(prompt),
                finish_reason=finish,
            )
        self.answers.append(answer)
        return answer

    def _failed(self, request_id: bytes, target: NodeRecord, error: PsError) -> Answer:
        answer = Answer(
            request_id,
            ok=False,
            latency_ms=self.latency_ms,
            attempts=0 if isinstance(error, _NEVER_SENT) else 1,
            error=describe(error),
            exception=error,
        )
        if isinstance(error, ModelNodeError):  # a signed error status came back
            answer.served_by = target.peer_id
            answer.signature_valid = True
            answer.status = error.status
            answer.model_id = target.model_id
            answer.cloves_received = self.threshold
        return answer


#: Outcomes of requests that were never sent (no attempt).
_NEVER_SENT = (NoPathError, NoModelNodeError, RequestTooLargeError)


def _fake_identity(name: str) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(b"ps_p2p fake " + name.encode()).digest())


class FakeUserNode:
    """What the local API (:class:`~ps_p2p.api.openai_compat.UserAPI`) reads of a running
    :class:`~ps_p2p.node.Node` with the user role, with no host and no network.

    Its directory (height 1) holds this user, ``relays`` other users and one model node serving
    ``model_id``, each record signed by its own key (keys derived from fixed seeds, so peer IDs
    are the same in every run; the directory itself carries no verifier signature). ``user`` is
    a :class:`FakeUserClient` with ``paths`` ready paths of ``hops`` distinct relays each (path
    i starts at relay i), or None with ``user_role=False``.

    Needs a running trio loop (the paths' ``created_at`` is trio's clock).

    Attributes:
        model_record: the model node's record (``served_by`` of the answers).
        relay_records: the other users' records.
    """

    def __init__(
        self,
        *,
        model_id: str = "fake-model",
        relays: int = 6,
        paths: int = sida.DEFAULT_TOTAL + 1,
        hops: int = 3,
        reply: Callable[[str, int], str] = reversed_prompt,
        user_role: bool = True,
    ) -> None:
        if not 1 <= hops <= relays:
            raise ValueError("need 1 <= hops <= relays (a path's relays are distinct)")
        self.keys = NodeKeys(_fake_identity("user"), OnionKeyPair.generate())
        self.peer_id = self.keys.identity.peer_id
        self.config = NodeConfig(roles=["user"])
        self.listen_addrs = [f"/ip4/127.0.0.1/tcp/4001/p2p/{self.keys.identity.peer_id_str}"]
        me = self._record(self.keys.identity, 4001, Role.USER)
        self.relay_records = [
            self._record(_fake_identity(f"relay {i}"), 4002 + i, Role.USER) for i in range(relays)
        ]
        self.model_record = self._record(
            _fake_identity("model"), 5001, Role.MODEL, model_id=model_id, capacity=2
        )
        self.directory: Directory | None = Directory(
            height=1,
            issued_at_ms=_FAKE_EPOCH_MS,
            expires_at_ms=_FAKE_EPOCH_MS + 120_000,
            records=tuple(
                sorted([me, *self.relay_records, self.model_record], key=lambda r: r.peer_id)
            ),
        )
        relay_ids = [r.peer_id for r in self.relay_records]
        self.user: FakeUserClient | None = None
        if user_role:
            self.user = FakeUserClient(
                lambda: self.directory,
                [[relay_ids[(i + j) % relays] for j in range(hops)] for i in range(paths)],
                reply=reply,
            )

    @staticmethod
    def _record(
        identity: Identity, port: int, role: Role, *, model_id: str = "", capacity: int = 0
    ) -> NodeRecord:
        record = NodeRecord(
            peer_id=identity.peer_id,
            addrs=(f"/ip4/127.0.0.1/tcp/{port}",),  # type: ignore[arg-type]  # converted
            roles=frozenset({role}),
            onion_key=OnionKeyPair.generate().public,
            model_id=model_id,
            capacity=capacity,
            issued_at_ms=_FAKE_EPOCH_MS,
            expires_at_ms=_FAKE_EPOCH_MS + 120_000,
        )
        return sign_record(identity, record)


#: issued_at_ms of the fake directory and records (2024-01-01T00:00:00Z).
_FAKE_EPOCH_MS = 1_704_067_200_000
