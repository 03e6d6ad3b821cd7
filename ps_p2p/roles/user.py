"""User node: the service adapter of the path pool and request cores.

PlanetServe sec. 3.2 with the fixes of DESIGN.md. The rules live in two pure cores:

* :mod:`ps_p2p.overlay.path_pool` (:class:`~ps_p2p.overlay.path_pool.PathPool`): N >= n paths
  of l relays from the directory's user list, probes with the RFC 6298 deadline, penalties,
  rotation, repair, rebalancing, bad-proxy avoidance;
* :mod:`ps_p2p.overlay.requests` (:class:`~ps_p2p.overlay.requests.RequestCore`): attempts and
  resends, response cloves per reply tag, reassembly, verification, audit, conviction, and a
  typed outcome per request.

:class:`UserClient` runs both on the one generic driver of a pure core,
:class:`~ps_p2p.protocols.driver.CoreDriver` (DESIGN.md "Layers"), as the overlay relay and the
model node do: the overlay's callbacks (``on_backward``, ``on_path_down``), path setups and
:meth:`UserClient.ask` only decode and ``submit`` a bound input (never blocking); the driver task
calls it with the trio clock's ``now`` and executes the commands it returns (``open_path``,
``send_on_path``, ``close_path``, waking waiters; a command that feeds one core's output to the
other, a path lost or a proxy convicted, is fed at once). Its ``tick`` does both cores' timer work
(the pool's first, then the requests' with the ready paths it left) when the earlier of their
``next_deadline()`` passes, or at once after the ready paths changed: a request waiting for paths
learns of new ones only from a tick. Protobuf conversion of Q, the response, probes and cloves
happens here and nowhere in the cores.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import trio

from ps_p2p.config import UserConfig
from ps_p2p.crypto import onion, sida
from ps_p2p.errors import (
    ModelNodeError,
    ModelNodeLostError,
    NoModelNodeError,
    NoPathError,
    OverloadedError,
    PathError,
    PsError,
    RemoteProtocolError,
    RequestError,
    RequestRefusedError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from ps_p2p.inference import (
    ChatMessage,
    InferenceQuery,
    InferenceReply,
    ResponseSegment,
    SamplingParams,
)
from ps_p2p.overlay.circuit_limits import relay_hosts_of
from ps_p2p.overlay.path_pool import (
    ClosePath,
    OpenPath,
    PathLost,
    PathPool,
    PathSuspended,
    PoolChanged,
    PoolPath,
    SendProbe,
)
from ps_p2p.overlay.requests import (
    Audit,
    ConvictProxy,
    Outcome,
    PathSilent,
    RequestCore,
    RequestDone,
    RequestSpec,
    ResponseClove,
    SendClove,
    StreamText,
)
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols import inference_codec
from ps_p2p.protocols.clove_codec import clove_from_bytes, clove_to_bytes
from ps_p2p.protocols.driver import CoreDriver
from ps_p2p.protocols.overlay import OverlayService, PathHandle
from ps_p2p.records import Directory, NodeRecord, Role
from ps_p2p.records import short_peer_id as _short

log = logging.getLogger(__name__)

#: ForwardPayload bytes around a clove: the destination peer ID and protobuf tags and lengths.
_DELIVER_OVERHEAD = 64
#: Inputs (backward payloads above all) queued for the driver task at most; more are dropped
#: (counted in ``inbox_dropped``). A request's start and cancel and a path setup's outcome are
#: never dropped (with a full inbox they apply at once); a dropped path-down is caught by the
#: next tick, which finds the path's handle dead.
MAX_INBOX = 4096
#: Seconds without a tick after a tick that raised (a persistent bug must not spin the driver).
TICK_RETRY = 0.5
#: A user whose record was issued this long before the directory's own time (its block's) is
#: no relay candidate: nodes renew every 30 s, so it stopped renewing (froze, crashed, left
#: without deregistering) and would only cost a failed setup (issue 20: failed setups' first
#: hop was a frozen user still listed 16-113 s after it froze). Two renewal intervals.
RELAY_SILENT_MS = 60_000


def relay_candidates(directory: Directory, me: bytes,
                     silent_ms: int = RELAY_SILENT_MS) -> list[bytes]:
    """Peer IDs of the directory's users that may relay for ``me``: a valid onion key, not
    ``me``, and renewed within ``silent_ms`` of the directory's time (its committing block's,
    so no local clock is involved). When fewer than 4 renewed ones remain (a committee that
    took no renewal for a while), every listed user is a candidate, renewed ones first."""
    users = [r for r in directory.users() if r.peer_id != me and len(r.onion_key) == 32]
    limit = getattr(directory, "issued_at_ms", 0) - silent_ms  # 0: a directory without time
    fresh = [r.peer_id for r in users if getattr(r, "issued_at_ms", 0) > limit]
    if len(fresh) >= 4:
        return fresh
    return fresh + [r.peer_id for r in users if getattr(r, "issued_at_ms", 0) <= limit]


@dataclass
class Answer:
    """The outcome of one anonymous request.

    Attributes:
        ok: True when a valid, signed, status-OK response decoded.
        text: the generated text ('' on error).
        served_by: peer ID (bytes) of the model node that signed the response.
        forwarded_by: the model node asked, when it forwarded the request to ``served_by``
            (sec. 3.3; its voucher checked); b"" when the node asked served it.
        signature_valid: the response signature checked out (False when none decoded).
        cloves_received: response cloves that arrived before decoding finished.
        latency_ms: from sending to decoding.
        error: why it failed, for people ('' when ok); never parse it: use ``exception``.
        exception: the typed outcome when not ok, an error of the ``RequestError`` tree
            (``ps_p2p.errors``): e.g. ``RequestTimeoutError``, ``NoPathError``,
            ``NoModelNodeError``, ``OverloadedError`` or another ``ModelNodeError`` (a signed
            error status), ``RequestTooLargeError``; None when ok.
        status: the signed ``ResponseStatus`` value (0 also when no reply came).
        attempts: how many times the request was sent.
        model_id: the model that answered; prompt_tokens, completion_tokens: its token counts
            (the prompt as the model saw it: a chat after its template).
        finish_reason: ``"stop"`` or ``"length"`` as the model node signed it ("" on error).
        reply: the model node's verified signed response (None when none decoded): what a
            verifier carries to the committee as evidence.
        request: the bytes of the Q that ``reply`` answers (b"" without one).
    """

    request_id: bytes
    ok: bool
    text: str = ""
    served_by: bytes = b""
    forwarded_by: bytes = b""
    signature_valid: bool = False
    cloves_received: int = 0
    latency_ms: float = 0.0
    error: str = ""
    status: int = 0
    attempts: int = 0
    model_id: str = ""
    completion_tokens: int = 0
    exception: PsError | None = None
    prompt_tokens: int = 0
    finish_reason: str = ""
    reply: InferenceReply | None = field(default=None, repr=False)
    request: bytes = field(default=b"", repr=False)

    @property
    def error_type(self) -> type[PsError] | None:
        """The class of :attr:`exception` (None when ok)."""
        return None if self.exception is None else type(self.exception)


def describe(error: PsError) -> str:
    """A failed request's error for people: ``"<Class>: message"``, or for a signed error
    status of the model node ``"<STATUS>: message"`` (e.g. ``"OVERLOADED: ..."``)."""
    if isinstance(error, ModelNodeError):
        return str(error)
    return f"{type(error).__name__}: {error}"


#: Outcome labels of a request (:attr:`UserClient.outcomes`, the node's metrics), most specific
#: error class first; an error of none of these classes is "error", a cancelled ask "cancelled".
OUTCOME_LABELS: tuple[tuple[type[PsError], str], ...] = (
    (RequestTimeoutError, "timeout"),
    (NoPathError, "no_path"),
    (NoModelNodeError, "no_model_node"),
    (ModelNodeLostError, "model_node_lost"),
    (OverloadedError, "overloaded"),
    (RequestRefusedError, "refused"),
    (ModelNodeError, "model_error"),
    (RequestTooLargeError, "too_large"),
)


def outcome_label(answer: Answer) -> str:
    """``"ok"``, or the label of the answer's error class (:data:`OUTCOME_LABELS`)."""
    if answer.ok:
        return "ok"
    for cls, label in OUTCOME_LABELS:
        if isinstance(answer.exception, cls):
            return label
    return "error"


def answer_from_outcome(outcome: Outcome) -> Answer:
    """The :class:`Answer` of a request core outcome."""
    reply = outcome.reply
    answer = Answer(
        request_id=outcome.request_id,
        ok=outcome.ok,
        cloves_received=outcome.cloves_received,
        latency_ms=outcome.latency * 1000,
        attempts=outcome.attempts,
        exception=outcome.error,
        error="" if outcome.error is None else describe(outcome.error),
    )
    if reply is not None:
        answer.reply = reply
        answer.request = outcome.request
        answer.served_by = reply.model_node
        answer.forwarded_by = reply.forwarded_by
        answer.signature_valid = True
        answer.status = reply.status
        answer.model_id = reply.model_id
        answer.completion_tokens = reply.completion_tokens
        answer.prompt_tokens = reply.prompt_tokens
        if outcome.ok:
            answer.text = reply.text
            answer.finish_reason = reply.finish_reason
    return answer


@dataclass(frozen=True)
class UserPath:
    """A ready path as :meth:`UserClient.ready_paths` shows it.

    Attributes:
        relays: peer IDs, first hop first; the last is the proxy.
        created_at: trio clock seconds when its setup was acknowledged.
    """

    path_id: int
    handle: PathHandle
    relays: tuple[bytes, ...]
    created_at: float

    @property
    def proxy(self) -> bytes:
        return self.relays[-1]


class ProtobufCodec:
    """:class:`~ps_p2p.overlay.requests.WireCodec` over ``planetserve.v1.inference``."""

    def encode_request(self, query: InferenceQuery) -> bytes:
        return inference_codec.encode_query(query)

    def decode_response(self, payload: bytes) -> InferenceReply:
        return inference_codec.decode_reply(payload)

    def clove_size(self, clove: sida.Clove) -> int:
        return len(clove_to_bytes(clove)) + _DELIVER_OVERHEAD

    def decode_segment(self, payload: bytes) -> ResponseSegment:
        return inference_codec.decode_segment(payload)


class _Waiter:
    """One :meth:`UserClient.ask` waiting for its outcome (and, streamed, for its text)."""

    def __init__(self, on_text: Callable[[str], None] | None = None) -> None:
        self.done = trio.Event()
        self.outcome: Outcome | None = None
        self.on_text = on_text


def trusted_model_nodes(directory: Directory, model_id: str | None = None) -> list[NodeRecord]:
    """The directory's model nodes a user may send to (PlanetServe sec. 3.4: "nodes below a
    threshold are no longer trusted"); pure.

    Provisional nodes (never scored on a chain with challenge epochs:
    :meth:`Directory.provisional`) come in only when no trusted node serves the model: a fresh
    identity, or a fresh organization key, gets no user traffic while proven nodes exist, so
    escaping a bad reputation by starting over does not pay (issue 16); a network that has
    just started, or runs no epochs (every node is then trusted), still works.

    Args:
        directory: the verified directory (its committed reputations and threshold).
        model_id: only nodes serving it (None: any model).

    Returns:
        :meth:`Directory.serving`: the model nodes :meth:`Directory.trusted` accepts, and the
        provisional ones of a model that has no trusted node; highest committed reputation first
        (:meth:`Directory.reputation_or_initial`); equal reputations keep the directory's
        order.
    """
    nodes = directory.serving(model_id)
    nodes.sort(key=lambda r: -directory.reputation_or_initial(r.peer_id))
    return nodes


def probation_model_nodes(directory: Directory, model_id: str) -> list[NodeRecord]:
    """The directory's model nodes of ``model_id`` that a user does not send to
    (:func:`trusted_model_nodes` leaves them out): the untrusted ones, and the provisional ones
    while a proven node serves the model. They get a probation share of users' requests as
    hedges (:func:`choose_probation_node`); pure. Directory order."""
    serving = {r.peer_id for r in directory.serving(model_id)}
    return [r for r in directory.model_nodes()
            if r.model_id == model_id and r.peer_id not in serving]


def choose_probation_node(peers: Sequence[bytes], share: float,
                          rng: random.Random) -> bytes | None:
    """Whether a user's request is also sent, as a hedge, to a node on probation, and to
    which; pure given ``rng`` (docs/verification.md, "Probation traffic"; issue 18).

    With probability ``share`` one of ``peers`` (the :func:`probation_model_nodes` the user can
    reach), drawn uniformly: reputation does not weigh here, every untrusted node must see
    real requests. The user still gets the answer of the trusted node the request went to;
    the hedge's answer is discarded. Without the hedges an untrusted node would receive only
    verifiers' challenges, so it would know every request it gets is one.

    Args:
        peers: candidate nodes (empty: no hedge, and no draw from ``rng``).
        share: probability in [0, 1] (``UserConfig.probation_share``).

    Returns:
        The node to hedge to, or None.
    """
    if not peers or share <= 0.0:
        return None
    if rng.random() >= share:
        return None
    return rng.choice(list(peers))


def reachable_model_nodes(
    records: Sequence[NodeRecord], lost: dict[bytes, int]
) -> list[NodeRecord]:
    """``records`` without the model nodes found lost: ``lost`` maps a peer ID to the
    ``issued_at_ms`` of its record when it was lost, and the node stays left out while the
    directory still lists that record. A live node renews its record every
    ``register_interval`` and so comes back within one; a dead one stays out until its record
    expires and leaves the directory. Entries of renewed records are removed from ``lost``.
    Order kept."""
    kept = []
    for r in records:
        lost_under = lost.get(r.peer_id)
        if lost_under is not None and r.issued_at_ms <= lost_under:
            continue
        lost.pop(r.peer_id, None)
        kept.append(r)
    return kept


def choose_model_node(peers: Sequence[bytes], directory: Directory,
                      rng: random.Random) -> bytes:
    """One of ``peers`` (model nodes equal in what the user asked for: same model), preferring
    higher reputation: drawn with probability proportional to each one's committed reputation
    (:meth:`Directory.reputation_or_initial`); pure given ``rng``.

    Proportional, not "always the best": honest nodes have similar reputations (their mean
    credibility), so the load still spreads over all of them, while a node at 0.9 gets twice
    the requests of one at 0.45. Untrusted nodes are left out before (:func:`trusted_model_nodes`).

    Raises:
        ValueError: ``peers`` empty.
    """
    if not peers:
        raise ValueError("no model node to choose from")
    weights = [directory.reputation_or_initial(p) for p in peers]
    if not math.fsum(weights) > 0.0:
        return rng.choice(list(peers))
    return rng.choices(list(peers), weights=weights)[0]


class UserClient:
    """Path pool and anonymous requests of one user node: both cores on one
    :class:`~ps_p2p.protocols.driver.CoreDriver` (see the module docstring).

    Args:
        overlay: the host's overlay service; its ``on_backward`` and ``on_path_down`` are set
            to this client's hand-over callbacks.
        directory: returns the current verified directory, or None before the first one.
        config: :class:`UserConfig`.
        rng: relay, proxy and model node choice and probe nonces (a seeded ``random.Random``
            in tests).
        clock: seconds (trio's clock).
        random_bytes: request IDs, reply tags, S-IDA keys.
        on_request_done: ``on_request_done(outcome, seconds)`` once per :meth:`ask`, when it
            returns or is cancelled, on the caller's task: the outcome label
            (:func:`outcome_label`, ``"cancelled"``, or ``"error"`` for an ask that raised) and
            the seconds it took (e.g. the node's metrics observe their histograms here). An
            exception it raises is logged, never passed to the caller.
        on_first_token: ``on_first_token(seconds)`` once per answered :meth:`ask`: the time
            to its first piece of text (streamed asks), or to the whole answer.

    Attributes:
        driver: the :class:`~ps_p2p.protocols.driver.CoreDriver` of both cores.
        inbox_dropped: inputs (backward payloads, path-downs) dropped because the driver's
            inbox was full.
        outcomes: finished asks by outcome label (see ``on_request_done``).
        probation: hedges to nodes on probation (``config.probation_share``; issue 18):
            ``sent``, ``skipped`` (``config.probation_in_flight`` already in flight), and the
            finished ones by outcome label. Hedges are not in :attr:`outcomes`.
    """

    def __init__(
        self,
        overlay: OverlayService,
        directory: Callable[[], Directory | None],
        config: UserConfig | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = trio.current_time,
        random_bytes: Callable[[int], bytes] = os.urandom,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        on_request_done: Callable[[str, float], None] | None = None,
        on_first_token: Callable[[float], None] | None = None,
    ) -> None:
        self.overlay = overlay
        self.config = config or UserConfig()
        self.outcomes: dict[str, int] = {}
        self.probation: dict[str, int] = {}
        self._hedges_in_flight = 0
        self._on_request_done = on_request_done
        self._on_first_token = on_first_token
        self._directory = directory
        self._rng = rng or random.SystemRandom()
        self._clock = clock
        self._random_bytes = random_bytes
        self._wall_ms = wall_ms
        self.me = overlay.peer_id
        self._pool = PathPool(self.config.pool_config(), rng=self._rng)
        self._requests = RequestCore(
            self.config.request_config(),
            ProtobufCodec(),
            self._is_model_node,
            rng=self._rng,
            random_bytes=random_bytes,
            model_nodes=lambda model_id: [r.peer_id for r in self.model_nodes(model_id)],
            choose_model_node=self._choose_model_node,
        )
        self._handles: dict[int, PathHandle] = {}
        self._path_ids: dict[tuple[bytes, bytes], int] = {}
        #: model nodes found lost -> the newer of the issue time of the record they were lost
        #: under and our wall clock then (ms): only a record issued after both is a renewal
        self._lost_model_nodes: dict[bytes, int] = {}
        self._waiters: dict[bytes, _Waiter] = {}
        self._changed = trio.Event()
        # the ready paths changed (or a request lost a path) since the last tick: the request
        # core's next_deadline() does not know, so the next tick is due at once
        self._tick_due = True
        self._tick_retry_at = -math.inf  # no tick before this (the last one raised)
        self._nursery: trio.Nursery | None = None
        self.driver: CoreDriver[object] = CoreDriver(
            "user",
            execute=self._execute_command,
            tick=self._tick,
            next_deadline=self._next_deadline,
            inbox=MAX_INBOX,
            clock=clock,
        )
        self._relay_cache: tuple[Directory | None, int, list[bytes] | None] = (None, -1, None)
        overlay.on_backward = self._on_backward
        overlay.on_path_down = self._on_path_down
        overlay.on_address_changed = self._on_address_changed

    # ------------------------------------------------------------------ public face

    @property
    def inbox_dropped(self) -> int:
        """Inputs (backward payloads, path-downs) dropped because the inbox was full."""
        return self.driver.dropped

    @property
    def pool(self) -> PathPool:
        """The path pool core (read it for counts and :attr:`PathPool.stats`; never call its
        inputs from outside the driver)."""
        return self._pool

    @property
    def requests(self) -> RequestCore:
        """The request core (read it for counts, e.g. ``len()`` of requests in flight and
        ``misrouted_cloves``; never call its inputs from outside the driver)."""
        return self._requests

    @property
    def avoided_proxies(self) -> frozenset[bytes]:
        """Peers caught altering a response clove, kept out of the proxy position for now."""
        return self._pool.bad_proxies

    @property
    def misrouted_cloves(self) -> int:
        """Response cloves dropped without blame (unknown tag, wrong path, unsigned...)."""
        return self._requests.misrouted_cloves

    @property
    def _audits(self) -> OrderedDict[bytes, Audit]:
        # kept for tests that look up the response ID of a verified answer
        return self._requests.audits

    def ready_paths(self) -> list[UserPath]:
        """Alive paths, confirmed by a probe, not being rotated out: what requests use."""
        return [
            UserPath(p.path_id, handle, p.relays, p.created_at)
            for p, handle in self._ready_with_handles()
        ]

    async def wait_ready(self, count: int | None = None, timeout: float = 30.0) -> None:
        """Wait until at least ``count`` (default n) paths are ready.

        Raises:
            PathError: not enough paths after ``timeout`` seconds.
        """
        count = self.config.total if count is None else count
        with trio.move_on_after(timeout):
            while len(self.ready_paths()) < count:
                await self._changed.wait()
            return
        raise PathError(
            f"only {len(self.ready_paths())} of {count} paths ready after {timeout:.0f} s"
        )

    async def wait_changed(self) -> None:
        """Wait until the path pool changes (a path became ready or was lost)."""
        await self._changed.wait()

    async def wait_processed(self) -> None:
        """Wait until the driver task next finishes a batch of inputs or a tick (for tests that
        watch a counter such as :attr:`misrouted_cloves`, instead of polling: wait in a loop on
        the condition, as a tick may come before the input queued meanwhile)."""
        await self.driver.wait_processed()

    def rotate_paths(self) -> None:
        """Retire every path now and build new ones (:meth:`PathPool.rotate_all`)."""
        def rotate(now: float) -> Sequence[object]:
            self._pool.rotate_all(now)
            return self._pool.tick(now, self._relays())

        self.driver.submit(rotate, essential=True)

    def model_nodes(self, model_id: str | None = None) -> list[NodeRecord]:
        """The model nodes of the current directory this user may send to (optionally serving
        ``model_id``): :func:`trusted_model_nodes`, the untrusted ones left out, highest
        committed reputation first. A request (and its replacement when its model node is
        lost) goes only to one of them, and a forwarded answer only counts from one of them."""
        directory = self._directory()
        if directory is None:
            return []
        return trusted_model_nodes(directory, model_id)

    def reachable_model_nodes(self, model_id: str | None = None) -> list[NodeRecord]:
        """:meth:`model_nodes` without those found lost (:func:`reachable_model_nodes`): what
        a new request is sent to, and what the local API lists and calls ready."""
        return reachable_model_nodes(self.model_nodes(model_id), self._lost_model_nodes)

    def _note_lost_model_nodes(self) -> None:
        directory = self._directory()
        for peer in self._requests.take_lost_model_nodes():
            record = directory.record(peer) if directory is not None else None
            if record is None or peer in self._lost_model_nodes:
                continue
            # our directory may lag the node's last renewal before it died: a record issued
            # before we found it lost says nothing of it being alive now (within clock skew)
            self._lost_model_nodes[peer] = max(record.issued_at_ms, self._wall_ms())
            log.warning("model node %s stopped answering: no new request goes to it until it "
                        "renews its record", describe(peer))

    def _choose_model_node(self, peers: Sequence[bytes]) -> bytes:
        directory = self._directory()
        if directory is None:
            return self._rng.choice(list(peers))
        return choose_model_node(peers, directory, self._rng)

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
        include_untrusted: bool = False,
    ) -> Answer:
        """Send one prompt (or chat: ``messages``) anonymously and wait for the signed answer.

        With ``on_text``, the answer is streamed through the overlay (docs/streaming.md):
        ``on_text(piece)`` is called with each new piece of text, in order, as the model node
        generates it (from the driver task: it must not block); the pieces add up to
        ``Answer.text``. Generation ends before the first of the ``stop`` strings.

        ``include_untrusted`` (verifiers' challenges, :mod:`ps_p2p.verification.service`) also
        lets ``model_node`` be a node the directory lists as untrusted, so that its reputation
        can be measured again; the request itself is the same.

        Never raises for network trouble: a failure comes back as ``Answer(ok=False)`` with a
        typed ``exception`` (see :class:`Answer`) once known, at the latest when the deadline
        (``timeout`` or ``config.request_timeout`` seconds) passes. Needs :meth:`run`. Counted
        in :attr:`outcomes` and reported to ``on_request_done`` when it ends.

        Raises:
            ValueError: neither a non-blank prompt nor messages, or both.
        """
        if bool(prompt) == bool(messages) or (prompt and not prompt.strip()):
            raise ValueError("ask needs a non-blank prompt or chat messages (not both)")
        started = self._clock()
        first_token_at: list[float] = []
        if on_text is not None:
            caller_on_text = on_text

            def on_text(text: str) -> None:
                if not first_token_at:
                    first_token_at.append(self._clock())
                caller_on_text(text)

        try:
            answer = await self._ask(
                prompt, messages=tuple(messages), model_id=model_id, max_tokens=max_tokens,
                temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop),
                model_node=model_node, timeout=timeout, on_text=on_text,
                include_untrusted=include_untrusted,
            )
        except trio.Cancelled:
            self._request_done("cancelled", started)
            raise
        except BaseException:
            self._request_done("error", started)
            raise
        self._request_done(outcome_label(answer), started)
        if answer.ok and self._on_first_token is not None:
            try:
                self._on_first_token((first_token_at or [self._clock()])[0] - started)
            except Exception:
                log.exception("on_first_token failed")
        return answer

    def _request_done(self, outcome: str, started: float) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if self._on_request_done is not None:
            try:
                self._on_request_done(outcome, self._clock() - started)
            except Exception:  # an observer's bug must not cost the caller its answer
                log.exception("on_request_done failed")

    async def _ask(
        self,
        prompt: str,
        *,
        messages: tuple[ChatMessage, ...],
        model_id: str | None,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: tuple[str, ...],
        model_node: bytes | None,
        timeout: float | None,
        on_text: Callable[[str], None] | None,
        include_untrusted: bool = False,
    ) -> Answer:
        timeout = self.config.request_timeout if timeout is None else timeout
        request_id = self._random_bytes(16)
        started = self._clock()
        directory = self._directory()
        if include_untrusted and directory is not None:
            listed = [r for r in directory.model_nodes() if model_id in (None, r.model_id)]
        elif model_node is None:  # not to a model node found lost (until it renews its record)
            listed = self.reachable_model_nodes(model_id)
        else:
            listed = self.model_nodes(model_id)
        candidates = [r for r in listed if model_node is None or r.peer_id == model_node]
        if not candidates:
            error = NoModelNodeError(
                f"no model node serving {model_id!r} in the directory"
                if model_id else "no model node in the directory"
            )
            return answer_from_outcome(Outcome(request_id, None, error, 0, 0, 0.0))
        chosen = self._choose_model_node([r.peer_id for r in candidates])
        target = next(r for r in candidates if r.peer_id == chosen)
        if model_node is None and not include_untrusted and directory is not None:
            self._maybe_hedge(directory, target.model_id, {
                "prompt": prompt, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "seed": seed, "stop": stop,
                "timeout": timeout, "stream": on_text is not None})
        spec = RequestSpec(
            request_id=request_id,
            destination=target.peer_id,
            model_id=target.model_id,
            prompt=prompt,
            params=SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                stop=stop,
            ),
            timeout=max(0.0, timeout - (self._clock() - started)),
            stream=on_text is not None,
            messages=messages,
            switch_model_node=model_node is None,  # a node asked by name is not replaced
        )
        waiter = self._waiters[request_id] = _Waiter(on_text)
        # essential: a start lost to a full inbox would leave the caller waiting forever
        self.driver.submit(partial(self._start_request, spec), essential=True)
        try:
            await waiter.done.wait()
        finally:
            if waiter.outcome is None:  # cancelled: the core forgets the request
                self._waiters.pop(request_id, None)
                self.driver.submit(partial(self._cancel_request, request_id), essential=True)
        assert waiter.outcome is not None
        return answer_from_outcome(waiter.outcome)

    def _maybe_hedge(self, directory: Directory, model_id: str,
                     request: dict[str, object]) -> None:
        """Send the same request to a node on probation too, with probability
        ``config.probation_share`` (:func:`choose_probation_node`), as a task of :meth:`run`'s
        nursery whose answer is counted in :attr:`probation` and dropped. The same request
        core, paths and shape (streamed when the user's is), so that nothing in it differs
        from the user's request but its destination and request ID."""
        peers = [r.peer_id for r in reachable_model_nodes(
            probation_model_nodes(directory, model_id), self._lost_model_nodes)]
        peer = choose_probation_node(peers, self.config.probation_share, self._rng)
        if peer is None or self._nursery is None:
            return
        if self._hedges_in_flight >= self.config.probation_in_flight:
            self.probation["skipped"] = self.probation.get("skipped", 0) + 1
            return
        self._hedges_in_flight += 1
        self.probation["sent"] = self.probation.get("sent", 0) + 1
        self._nursery.start_soon(self._hedge, peer, model_id, request)

    async def _hedge(self, peer: bytes, model_id: str, request: dict[str, object]) -> None:
        try:
            stream = request.pop("stream")
            answer = await self._ask(
                **request, model_id=model_id, model_node=peer, include_untrusted=True,
                on_text=(lambda text: None) if stream else None)
            label = outcome_label(answer)
        except Exception:  # a bug must not take the client's nursery down
            log.exception("probation hedge to %s failed", _short(peer))
            label = "error"
        finally:
            self._hedges_in_flight -= 1
        self.probation[label] = self.probation.get(label, 0) + 1

    # ------------------------------------------------------------------ driver

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drive both cores until cancelled (the driver task, and the path setups it starts)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.driver.run)
            task_status.started()

    def _start_request(self, spec: RequestSpec, now: float) -> Sequence[object]:
        try:
            return self._requests.start(spec, now, self._ready_refs())
        except Exception as exc:  # a bug: the caller gets an error, not a hang
            log.exception("request %s could not start", spec.request_id.hex()[:8])
            error = RequestError(f"internal error: {exc}")
            return [RequestDone(Outcome(spec.request_id, None, error, 0, 0, 0.0))]

    def _cancel_request(self, request_id: bytes, now: float) -> Sequence[object]:
        return self._requests.cancel(request_id)

    def _tick(self, now: float) -> Sequence[object]:
        """Both cores' timer work: paths that died without a path-down reaching us, the pool,
        then the requests with the ready paths the pool left (their commands are returned)."""
        self._tick_retry_at = now + TICK_RETRY  # cleared below unless this tick raises
        for path in self._pool.paths():  # died without a path-down callback reaching us
            handle = self._handles.get(path.path_id)
            if handle is None or not handle.alive:
                self._execute(self._pool.path_down(path.path_id, now), now)
        self._execute(self._pool.tick(now, self._relays()), now)
        commands = self._requests.tick(now, self._ready_refs())
        # the requests saw the ready paths as they are now (changes made by the pool's
        # commands above included)
        self._tick_due = False
        self._tick_retry_at = -math.inf
        return commands

    def _next_deadline(self) -> float:
        """The earlier of the cores' deadlines; at once when the pool says None (it has work
        now: it changed, or has not ticked yet) or the ready paths changed since the last tick.

        Never in the past after a tick that did not raise: the pool's tick does all its due
        work and always sets its next maintenance (at most ``maintenance_interval`` ahead), the
        request core's tick sends, resends or ends every request that is due; after a tick
        that raised, no tick for :data:`TICK_RETRY` s (the driver must not spin)."""
        pool = self._pool.next_deadline()
        if pool is None or self._tick_due:
            return self._tick_retry_at
        requests = self._requests.next_deadline()
        at = pool if requests is None else min(pool, requests)
        return max(at, self._tick_retry_at)

    def _execute_command(self, command: object) -> None:
        """The driver's ``execute``: one command at the current time."""
        self._execute((command,), self._clock())

    def _execute(self, commands: Sequence[object], now: float) -> None:
        """Carry out core commands (never blocks); commands that feed one core's output to
        the other (a path lost, a proxy convicted) recurse. A command that raises is logged
        and costs only itself (an unopened path is reported failed to the pool)."""
        for command in commands:
            try:
                self._execute_one(command, now)
            except Exception:
                log.exception("user client command %r failed", command)
                if isinstance(command, OpenPath):
                    self._execute(self._pool.path_failed(command.path_id, now), now)

    def _execute_one(self, command: object, now: float) -> None:
        if isinstance(command, SendClove):
            self._send_clove(command)
            # a clove on a path silent for a while probes it along (a frozen relay is found
            # within one probe deadline, and the clove re-sent: PathSuspended below)
            self._execute(self._pool.clove_sent(command.path_id, now), now)
        elif isinstance(command, PathSilent):
            self._execute(self._pool.path_silent(command.path_id, now), now)
        elif isinstance(command, SendProbe):
            handle = self._handles.get(command.path_id)
            probe = clove_pb2.ForwardPayload(probe=clove_pb2.Probe(nonce=command.nonce))
            if handle is None or not self.overlay.send_on_path(handle, probe):
                self._execute(
                    self._pool.probe_not_sent(command.path_id, command.nonce, now), now
                )
        elif isinstance(command, OpenPath):
            self._open_path(command, now)
        elif isinstance(command, ClosePath):
            handle = self._forget_handle(command.path_id)
            if handle is not None:
                self.overlay.close_path(handle, command.reason)
        elif isinstance(command, PathLost):
            self._forget_handle(command.path_id)
            self._tick_due = True  # a request left with fewer than k paths resends on a tick
            self._execute(
                self._requests.path_lost(command.path_id, now, self._ready_refs()), now
            )
        elif isinstance(command, PathSuspended):
            # the path stays open (a probe may bring it back), but its cloves move now
            self._tick_due = True
            self._execute(
                self._requests.path_lost(command.path_id, now, self._ready_refs()), now
            )
        elif isinstance(command, PoolChanged):
            self._tick_due = True  # requests waiting for paths look again on the next tick
            self._changed.set()
            self._changed = trio.Event()
        elif isinstance(command, ConvictProxy):
            self._execute(self._pool.convict_proxy(command.proxy, now), now)
        elif isinstance(command, StreamText):
            waiter = self._waiters.get(command.request_id)
            if waiter is not None and waiter.on_text is not None:
                try:
                    waiter.on_text(command.text)
                except Exception:  # the caller's bug must not stop the driver
                    log.exception("on_text failed")
        elif isinstance(command, RequestDone):
            waiter = self._waiters.pop(command.outcome.request_id, None)
            if waiter is not None:
                waiter.outcome = command.outcome
                waiter.done.set()
        else:
            raise TypeError(f"unknown command {command!r}")

    # ------------------------------------------------------------------ paths

    def _ready_with_handles(self) -> list[tuple[PoolPath, PathHandle]]:
        out = []
        for path in self._pool.ready_paths():
            handle = self._handles.get(path.path_id)
            if handle is not None and handle.alive:
                out.append((path, handle))
        return out

    def _ready_refs(self) -> list[PoolPath]:
        return [p for p, _ in self._ready_with_handles()]

    def _relays(self) -> list[bytes] | None:
        """The directory's users that may relay (cached per directory and height)."""
        directory = self._directory()
        if directory is None:
            return None
        cached, height, relays = self._relay_cache
        if cached is not directory or height != directory.height or relays is None:
            relays = relay_candidates(directory, self.me)
            self._relay_cache = (directory, directory.height, relays)
            self._pool.relay_hosts = relay_hosts_of(directory.users())
        return relays

    def _is_model_node(self, peer_id: bytes) -> bool:
        directory = self._directory()
        record = directory.record(peer_id) if directory is not None else None
        return record is not None and Role.MODEL in record.roles

    def _open_path(self, command: OpenPath, now: float) -> None:
        directory = self._directory()
        hops = []
        for peer in command.relays:
            record = directory.record(peer) if directory is not None else None
            if record is None:  # left the directory since the choice
                self._execute(self._pool.path_failed(command.path_id, now), now)
                return
            hops.append(onion.HopSpec(peer_id=peer, onion_key=record.onion_key))
        try:
            handle = self.overlay.open_path(hops)
        except PsError as exc:  # e.g. an onion key no secret can be derived with
            log.warning("cannot build a path via %s: %s", _short(command.relays[0]), exc)
            self._execute(self._pool.path_failed(command.path_id, now), now)
            return
        self._handles[command.path_id] = handle
        self._path_ids[handle.key] = command.path_id
        assert self._nursery is not None, "UserClient.run() has not started"
        self._nursery.start_soon(self._await_setup, command.path_id, handle)

    async def _await_setup(self, path_id: int, handle: PathHandle) -> None:
        await handle.ready.wait()
        # essential: the pool answers every OpenPath once; a lost answer would leave the path
        # "setting up" forever, and the pool would never replace it
        self.driver.submit(partial(self._setup_done, path_id, handle), essential=True)

    def _setup_done(self, path_id: int, handle: PathHandle, now: float) -> Sequence[object]:
        if handle.alive:
            return self._pool.path_ready(path_id, now)
        error = handle.error or ""
        log.info("path setup via %s failed: %s", _short(handle.path.first_hop), error)
        self._forget_handle(path_id)
        # a lost first hop names the culprit; otherwise any hop of the path may be at fault
        return self._pool.path_failed(path_id, now, first_hop_down=handle.first_hop_down,
                                      blameless=handle.blameless)

    def _forget_handle(self, path_id: int) -> PathHandle | None:
        handle = self._handles.pop(path_id, None)
        if handle is not None:
            self._path_ids.pop(handle.key, None)
        return handle

    def _send_clove(self, command: SendClove) -> None:
        handle = self._handles.get(command.path_id)
        payload = clove_pb2.ForwardPayload(
            deliver=clove_pb2.DeliverClove(
                destination=command.destination,
                clove=clove_to_bytes(command.clove),
                reply_tag=command.reply_tag,
                max_replies=command.max_replies,
            )
        )
        if handle is None or not self.overlay.send_on_path(handle, payload):
            log.warning("could not send a clove on path %d", command.path_id)

    # ------------------------------------------------------------------ overlay callbacks

    def _on_path_down(self, handle: PathHandle) -> None:
        path_id = self._path_ids.get(handle.key)
        if path_id is not None:
            log.warning("path via %s down: %s", _short(handle.path.first_hop), handle.error)
            # not essential (this runs inside the overlay's command execution): if the inbox
            # is full, the next tick finds the handle dead and reports the path down itself
            self.driver.submit(partial(self._pool.path_down, path_id))

    def _on_address_changed(self, since: float) -> None:
        # the overlay abandons this node's setups in flight; the pool forgives the relays that
        # failed it since (their connections died because of this node's move); not essential
        # (this runs inside the overlay's command execution), a lost one only costs detours
        self.driver.submit(partial(self._pool.address_changed, since))

    def _on_backward(self, handle: PathHandle, message: clove_pb2.BackwardPayload) -> None:
        """Decode one backward payload and submit it to the driver; never raises (one bad
        payload must not reset the first hop's shared stream)."""
        try:
            self._decode_backward(handle, message)
        except Exception:
            log.exception("backward payload on the path via %s dropped",
                          _short(handle.path.first_hop))

    def _decode_backward(self, handle: PathHandle, message: clove_pb2.BackwardPayload) -> None:
        path_id = self._path_ids.get(handle.key)
        if path_id is None:
            return  # a path the pool no longer holds
        kind = message.WhichOneof("kind")
        if kind == "probe_reply":
            self.driver.submit(
                partial(self._pool.probe_reply, path_id, message.probe_reply.nonce)
            )
        elif kind == "signed_clove":
            signed = message.signed_clove
            try:
                clove = clove_from_bytes(signed.clove)
            except RemoteProtocolError as exc:
                log.warning("malformed response clove dropped: %s", exc)
                self.driver.submit(partial(self._pool.heard_from, path_id))
                return
            event = ResponseClove(path_id, clove, signed.clove, signed.signature, signed.reply_tag)
            self.driver.submit(partial(self._response_clove, event))
        elif kind == "clove":
            self.driver.submit(partial(self._unsigned_clove, path_id))
        elif kind == "delivery_failed" and message.delivery_failed_tag:
            self.driver.submit(
                partial(self._delivery_failed, path_id, message.delivery_failed_tag)
            )
        else:
            if kind == "delivery_failed":
                log.warning("proxy could not deliver a clove: %s", message.delivery_failed)
            self.driver.submit(partial(self._pool.heard_from, path_id))

    def _response_clove(self, event: ResponseClove, now: float) -> Sequence[object]:
        return [
            *self._pool.heard_from(event.path_id, now),
            *self._requests.response_clove(event, now),
        ]

    def _delivery_failed(self, path_id: int, reply_tag: bytes, now: float) -> Sequence[object]:
        """A proxy lost the model node of one of our reply tags; a request that moves to
        another model node sends its next attempt on the next tick, at once."""
        self._tick_due = True
        commands = [
            *self._pool.heard_from(path_id, now),
            *self._requests.delivery_failed(reply_tag, path_id, now),
        ]
        self._note_lost_model_nodes()
        return commands

    def _unsigned_clove(self, path_id: int, now: float) -> Sequence[object]:
        return [*self._pool.heard_from(path_id, now), *self._requests.unsigned_clove()]


__all__ = [
    "OUTCOME_LABELS",
    "Answer",
    "UserClient",
    "UserConfig",
    "UserPath",
    "answer_from_outcome",
    "choose_model_node",
    "choose_probation_node",
    "describe",
    "outcome_label",
    "probation_model_nodes",
    "reachable_model_nodes",
    "relay_candidates",
    "trusted_model_nodes",
]
