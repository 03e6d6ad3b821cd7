"""User node: keeps onion paths to N >= n proxies and sends prompts as S-IDA cloves.

PlanetServe sec. 3.2 with the fixes of DESIGN.md:

* paths: l relays each, chosen from the directory's user list, no relay on two paths when there are
  at least n*l + 1 users (fewer: as little reuse as possible, with a warning); ``paths`` >= n of them
  are kept (the extra ones are spares); each is probed every ``probe_interval`` seconds and a path
  whose probe is unanswered for ``probe_timeout`` seconds, whose first hop disconnects or that is
  destroyed is replaced at once; paths are rotated every ``rotate_period`` seconds (15 min).
* requests: Q = {request ID, model ID, prompt, sampling parameters, n reply proxies} is S-IDA-encoded
  into n cloves sent over n different paths to one model node; the answer comes back as cloves through
  the reply proxies and decodes from any k; its signature is checked against the model node's key,
  the hash of Q and the directory. When a path of an in-flight request dies, its clove is re-sent on
  a spare path; when fewer than k of its reply paths are left, or nothing came back after
  ``attempt_timeout``, the request is sent again (same request ID, fresh paths); every request has a
  deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ps_p2p import records, responses
from ps_p2p.crypto import onion, sida
from ps_p2p.records import short_peer_id as _short
from ps_p2p.errors import (
    DecodeError,
    DirectoryError,
    InvalidSignatureError,
    PathError,
    PsError,
    RemoteProtocolError,
    RequestError,
    RequestTimeoutError,
)
from ps_p2p.overlay.paths import choose_relays, reuse_count
from ps_p2p.overlay.reassembly import CloveAssembler, MessageReassembled, ReassemblyFailed
from ps_p2p.overlay.rtt import RttEstimator
from ps_p2p.pb.planetserve.v1 import clove_pb2, inference_pb2
from ps_p2p.protocols.clove_codec import clove_from_bytes, clove_to_bytes
from ps_p2p.protocols.overlay import OverlayService, PathHandle
from ps_p2p.records import Directory, NodeRecord, Role

log = logging.getLogger(__name__)

Status = inference_pb2.ResponseStatus

#: ForwardPayload bytes around a clove: the destination peer ID and protobuf tags and lengths.
_DELIVER_OVERHEAD = 64


@dataclass
class UserConfig:
    """User node settings; times in seconds.

    Attributes:
        total: n, cloves per message (and reply proxies per request).
        threshold: k, cloves needed to decode.
        paths: N >= n paths kept (spares included).
        hops: relays per path (l).
        rotate_period: paths older than this are replaced (default 15 min).
        probe_interval, probe_timeout: liveness probes through each path.
        request_timeout: deadline of one request, all attempts included.
        attempt_timeout: a request with no answer this long, plus ``max_tokens`` times the
            time per token (below), is sent again on fresh paths; the wait doubles with every
            attempt. Resending is cheap for the model node, which joins a repeated request to
            the one in service instead of running inference again.
        token_time: seconds allowed per requested token before the first answer is measured;
            afterwards twice the measured time per token (EWMA, 1/8) when that is longer, so a
            36 s answer is not resent while it is being generated.
        probe_timeout: the floor of the probe deadline; the deadline itself is the RFC 6298
            retransmission timeout of the measured probe round trips (it grows when the
            machine or the network is loaded instead of tearing working paths down).
    """

    total: int = sida.DEFAULT_TOTAL
    threshold: int = sida.DEFAULT_THRESHOLD
    paths: int = sida.DEFAULT_TOTAL + 1
    hops: int = 3
    rotate_period: float = 15 * 60.0
    probe_interval: float = 2.0
    probe_timeout: float = 4.0
    request_timeout: float = 120.0
    attempt_timeout: float = 8.0
    token_time: float = 0.05
    failed_relay_cooldown: float = 30.0

    def __post_init__(self) -> None:
        if not 2 <= self.threshold <= self.total <= sida.MAX_TOTAL:
            # k = 1 would let every proxy read the prompt
            raise ValueError("need 2 <= threshold <= total <= %d" % sida.MAX_TOTAL)
        if self.paths < self.total:
            raise ValueError("paths (N) must be >= total (n)")
        if not 1 <= self.hops <= onion.MAX_HOPS:
            raise ValueError(f"hops must be in 1..{onion.MAX_HOPS}")


@dataclass
class Answer:
    """The outcome of one anonymous request.

    Attributes:
        ok: True when a valid, signed, status-OK response decoded.
        text: the generated text ('' on error).
        served_by: peer ID (bytes) of the model node that signed the response.
        signature_valid: the response signature checked out (False when none decoded).
        cloves_received: response cloves that arrived before decoding finished.
        latency_ms: from sending to decoding.
        error: why it failed ('' when ok).
        attempts: how many times the request was sent.
    """

    request_id: bytes
    ok: bool
    text: str = ""
    served_by: bytes = b""
    signature_valid: bool = False
    cloves_received: int = 0
    latency_ms: float = 0.0
    error: str = ""
    status: int = 0
    attempts: int = 0
    model_id: str = ""
    completion_tokens: int = 0


@dataclass
class _Path:
    handle: PathHandle
    relays: list[bytes]
    created_at: float
    retiring: bool = False
    retired_at: float = 0.0
    probe_nonce: int | None = None
    #: a probe came back through the path: its forward cells reach the proxy intact. The setup
    #: acknowledgement crosses every hop only backwards, so a relay that corrupts forward cells
    #: passes setup; such a path never carries a request clove.
    confirmed: bool = False
    probe_sent_at: float = 0.0
    last_reply_at: float = 0.0


@dataclass
class _Attempt:
    q_bytes: bytes
    req_hash: bytes
    cloves: list[sida.Clove]
    paths: list[_Path]  # clove i (and response clove i) goes over paths[i]
    sent_at: float
    response_id: bytes  # S-IDA message ID of the answer to this sending
    reply_tags: list[bytes]  # reply tag i registered with the proxy of paths[i]


@dataclass
class _Pending:
    request_id: bytes
    destination: bytes
    model_id: str
    started_at: float
    attempts: list[_Attempt] = field(default_factory=list)
    assembler: CloveAssembler = field(default_factory=CloveAssembler)
    cloves_received: int = 0
    received: list[tuple[sida.Clove, PathHandle]] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    answer: Answer | None = None
    retry: trio.Event = field(default_factory=trio.Event)


@dataclass(frozen=True)
class _ReplyTag:
    """What this user registered a reply tag for: the model node asked, the path whose proxy
    holds the tag, and which response clove may come back under it."""

    destination: bytes
    handle: PathHandle
    response_id: bytes
    index: int
    total: int


@dataclass
class _Audit:
    """A decoded response, kept a while to check the cloves that arrive after it."""

    good: list[sida.Clove]
    payload: bytes
    destination: bytes = b""  # the model node that signed the answer


#: Seconds a proxy caught altering a response clove is kept off this user's paths.
BAD_PROXY_COOLDOWN = 600.0
#: Response cloves of one request kept for the audit.
MAX_RECEIVED_CLOVES = 64
#: Decoded responses kept to check late cloves against.
MAX_AUDITS = 256
#: Reply tags remembered (for late cloves too): a few thousand requests' worth.
MAX_REPLY_TAGS = MAX_AUDITS * sida.MAX_TOTAL


class UserClient:
    """Path pool and anonymous requests of one user node.

    Args:
        overlay: the host's overlay service (its ``on_backward`` and ``on_path_down`` are bound
            to this client by :meth:`attach`).
        directory: returns the current verified directory, or None before the first one.
        config: :class:`UserConfig`.
        rng: for relay and model node choice (a seeded ``random.Random`` in tests).
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
    ) -> None:
        self.overlay = overlay
        self.config = config or UserConfig()
        self._directory = directory
        self._rng = rng or random.SystemRandom()
        self._clock = clock
        self._random_bytes = random_bytes
        self._paths: dict[tuple[bytes, bytes], _Path] = {}
        self._setting_up: int = 0
        self._proxies_setting_up: dict[bytes, int] = {}
        self._pending: dict[bytes, _Pending] = {}
        # response message ID (one per sending of a request) -> the request and that sending
        self._by_response_id: dict[bytes, tuple[_Pending, _Attempt]] = {}
        self._audits: OrderedDict[bytes, _Audit] = OrderedDict()
        # reply tag -> what it was registered for (oldest first, bounded)
        self._reply_tags: OrderedDict[bytes, _ReplyTag] = OrderedDict()
        # proxy -> until when: caught altering the content of a response clove
        self._bad_proxies: dict[bytes, float] = {}
        #: response cloves dropped because they came on a path other than their index's
        self.misrouted_cloves = 0
        # relay -> (failures, time of the last one): paths through it that failed to set up or
        # went silent since a path through it last worked. A dead or cell-dropping relay keeps
        # its score; its honest neighbours are cleared by their other, working paths. Scores
        # are forgotten ``failed_relay_cooldown`` seconds after the last failure.
        self._penalty: dict[bytes, tuple[int, float]] = {}
        # probe round trips of all paths (a loaded machine slows every path alike)
        self._probe_rtt = RttEstimator(
            initial_rto=self.config.probe_timeout, min_rto=self.config.probe_timeout, max_rto=60.0
        )
        self._token_time = self.config.token_time  # EWMA of measured seconds per token
        self._wake = trio.Event()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._warned_reuse = False
        overlay.on_backward = self._on_backward
        overlay.on_path_down = self._on_path_down
        self.me = overlay.peer_id

    # ------------------------------------------------------------------ path pool

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the path pool full, probe and rotate paths, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                self._maintain()
                with trio.move_on_after(min(0.5, self.config.probe_interval / 2)):
                    await self._wake.wait()
                self._wake = trio.Event()

    @property
    def avoided_proxies(self) -> frozenset[bytes]:
        """Peers caught altering a response clove, kept out of the proxy position for now."""
        return frozenset(self._bad_proxies)

    def ready_paths(self) -> list[_Path]:
        """Alive paths, confirmed by a probe, not being rotated out: what requests use."""
        return [
            p for p in self._paths.values() if p.handle.alive and not p.retiring and p.confirmed
        ]

    def _live_paths(self) -> list[_Path]:
        """Alive paths not being rotated out, confirmed or still waiting for their first probe."""
        return [p for p in self._paths.values() if p.handle.alive and not p.retiring]

    async def wait_ready(self, count: int | None = None, timeout: float = 30.0) -> None:
        """Wait until at least ``count`` (default n) paths are ready.

        Raises:
            PathError: not enough paths after ``timeout`` seconds.
        """
        count = self.config.total if count is None else count
        with trio.move_on_after(timeout):
            while len(self.ready_paths()) < count:
                await self._changed_event().wait()
            return
        raise PathError(
            f"only {len(self.ready_paths())} of {count} paths ready after {timeout:.0f} s"
        )

    async def _wait_distinct_proxies(self, count: int, grace: float) -> None:
        """Wait up to ``grace`` seconds for ``count`` ready paths with distinct proxies (the pool
        may be rebuilding after a loss); never raises: after the grace, go with what is there."""
        with trio.move_on_after(grace):
            while len({p.relays[-1] for p in self.ready_paths()}) < count:
                await self._changed_event().wait()

    def _changed_event(self) -> trio.Event:
        return self._changed

    async def wait_changed(self) -> None:
        """Wait until the path pool changes (a path became ready or was lost)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self._wake.set()

    def _maintain(self) -> None:
        now = self._clock()
        cfg = self.config
        for path in list(self._paths.values()):
            if not path.handle.alive:  # died without a path-down callback reaching us
                self._paths.pop(path.handle.key, None)
                self._after_path_loss(path)
                continue
            if path.probe_nonce is not None and now - path.probe_sent_at > self._probe_rtt.rto:
                log.warning(
                    "path via %s unanswered for %.1f s: replacing it",
                    _short(path.relays[0]), now - path.probe_sent_at,
                )
                # one of its relays drops cells (dead, or tampering): suspect every relay of it
                self._penalize(path.relays, now)
                self._drop_path(path, "probe timeout")
                continue
            if path.probe_nonce is None and now - max(path.probe_sent_at, path.last_reply_at) >= cfg.probe_interval:
                self._send_probe(path, now)
            if not path.retiring and now - path.created_at >= cfg.rotate_period:
                path.retiring = True
                path.retired_at = now
                log.info("rotating path via %s", _short(path.relays[0]))
            # a retired path still carries the answers of requests sent before it retired
            if path.retiring and now - path.retired_at >= cfg.request_timeout:
                self._drop_path(path, "rotated")
        live = self._live_paths()
        missing = cfg.paths - len(live) - self._setting_up
        if missing > 0:
            self._build_paths(missing)
        elif not self._setting_up and all(p.confirmed for p in live):
            self._rebalance(now)

    def _rebalance(self, now: float) -> None:
        """Retire one path that shares a relay with another while unused relays are available.

        Paths built while the network was starting (or while relays were under suspicion) may
        share relays; once enough relays are known and clean, they are replaced one at a time so
        the pool converges to disjoint paths (DESIGN.md: no relay on two paths of one user).
        """
        ready = self.ready_paths()
        directory = self._directory()
        if directory is None:
            return
        clean = [
            r.peer_id for r in directory.users()
            if r.peer_id != self.me and r.peer_id not in self._penalty
            and r.peer_id not in self._bad_proxies and len(r.onion_key) == 32
        ]
        # first: a request needs n distinct proxies; replace a path whose proxy repeats while a
        # clean relay is nobody's proxy
        proxies: dict[bytes, list[_Path]] = {}
        for path in ready:
            proxies.setdefault(path.relays[-1], []).append(path)
        if len(proxies) < self.config.total and any(r not in proxies for r in clean):
            repeated = [ps for ps in proxies.values() if len(ps) > 1]
            if repeated:
                victim = repeated[0][-1]
                victim.retiring = True
                victim.retired_at = now
                log.info("replacing path via %s: its proxy serves another path too",
                         _short(victim.relays[0]))
                self._build_paths(1)
                return
        uses: dict[bytes, int] = {}
        for path in ready:
            for relay in path.relays:
                uses[relay] = uses.get(relay, 0) + 1
        shared = [p for p in ready if any(uses[r] > 1 for r in p.relays)]
        if not shared:
            return
        free = [
            r.peer_id for r in directory.users()
            if r.peer_id != self.me and r.peer_id not in uses and r.peer_id not in self._penalty
            and len(r.onion_key) == 32
        ]
        if len(free) < self.config.hops:
            return
        victim = max(shared, key=lambda p: sum(uses[r] for r in p.relays))
        victim.retiring = True
        victim.retired_at = now
        log.info("replacing path via %s: it shares relays with another path", _short(victim.relays[0]))
        self._build_paths(1)

    def _build_paths(self, count: int) -> None:
        directory = self._directory()
        if directory is None:
            return
        now = self._clock()
        for peer, (_, last) in list(self._penalty.items()):
            if now - last >= self.config.failed_relay_cooldown:
                del self._penalty[peer]
        users = [r for r in directory.users() if r.peer_id != self.me and len(r.onion_key) == 32]
        if len(users) < self.config.hops:
            log.debug("only %d other users known; need %d relays", len(users), self.config.hops)
            return
        for peer, until in list(self._bad_proxies.items()):
            if until <= now:
                del self._bad_proxies[peer]
        clean = [r.peer_id for r in users if r.peer_id not in self._penalty]
        if len(clean) >= self.config.hops:
            candidates = clean
        else:  # too few relays above suspicion: the least suspected ones fill up
            ranked = sorted(users, key=lambda r: self._penalty.get(r.peer_id, (0, 0.0))[0])
            candidates = [r.peer_id for r in ranked[: self.config.hops]]
        in_use: dict[bytes, int] = {}
        # a proxy caught altering a clove may still relay (cells are checked end to end) but is
        # never a proxy again while flagged: it counts as a proxy many times over
        proxy_uses: dict[bytes, int] = {p: 1_000 for p in self._bad_proxies}
        for proxy, count in self._proxies_setting_up.items():  # paths still being set up
            proxy_uses[proxy] = proxy_uses.get(proxy, 0) + count
        for path in self._live_paths():
            for relay in path.relays:
                in_use[relay] = in_use.get(relay, 0) + 1
            proxy_uses[path.relays[-1]] = proxy_uses.get(path.relays[-1], 0) + 1
        try:
            choices = choose_relays(
                candidates, count, self.config.hops, rng=self._rng, in_use=in_use,
                proxy_uses=proxy_uses,
            )
        except DirectoryError as exc:
            log.warning("cannot choose relays: %s", exc)
            return
        reused = reuse_count(choices) + sum(1 for c in choices for r in c if r in in_use)
        if reused and not self._warned_reuse:
            self._warned_reuse = True
            log.warning(
                "only %d candidate relays for %d paths of %d hops: some relays serve two paths "
                "of this user (a network of >= %d users avoids this)",
                len(candidates), self.config.paths, self.config.hops,
                self.config.total * self.config.hops + 1,
            )
        by_id = {r.peer_id: r for r in users}
        assert self._nursery is not None
        for relays in choices:
            hops = [onion.HopSpec(peer_id=p, onion_key=by_id[p].onion_key) for p in relays]
            self._setting_up += 1
            proxy = relays[-1]
            self._proxies_setting_up[proxy] = self._proxies_setting_up.get(proxy, 0) + 1
            self._nursery.start_soon(self._setup_path, hops)

    async def _setup_path(self, hops: list[onion.HopSpec]) -> None:
        relays = [h.peer_id for h in hops]
        try:
            try:
                handle = self.overlay.open_path(hops)
            except PsError as exc:  # e.g. an onion key no secret can be derived with
                log.warning("cannot build a path via %s: %s", _short(relays[0]), exc)
                self._penalize(relays, self._clock())
                return
            await handle.ready.wait()
        finally:
            self._setting_up -= 1
            left = self._proxies_setting_up.get(relays[-1], 1) - 1
            if left:
                self._proxies_setting_up[relays[-1]] = left
            else:
                self._proxies_setting_up.pop(relays[-1], None)
        now = self._clock()
        if not handle.alive:
            error = handle.error or ""
            # "first hop down" names the culprit; otherwise any hop of the path may be at fault
            self._penalize(relays[:1] if error.startswith("first hop") else relays, now)
            log.info("path setup via %s failed: %s", _short(relays[0]), error)
            return  # the pool loop rebuilds on its next tick (<= 0.5 s): no tight retry loop
        # penalties are cleared by the first probe reply, not by the acknowledgement: the
        # acknowledgement only travels backwards, past a relay that corrupts forward cells
        path = _Path(handle, relays, created_at=now, last_reply_at=now, probe_sent_at=now)
        self._paths[handle.key] = path
        self._send_probe(path, now)  # confirms the forward direction before any request uses it
        log.info(
            "path ready: %s (proxy %s)", " -> ".join(_short(r) for r in relays), _short(relays[-1])
        )
        self._notify()

    def _send_probe(self, path: _Path, now: float) -> None:
        nonce = int.from_bytes(self._random_bytes(8), "big")
        probe = clove_pb2.ForwardPayload(probe=clove_pb2.Probe(nonce=nonce))
        if self.overlay.send_on_path(path.handle, probe):
            path.probe_nonce = nonce
            path.probe_sent_at = now

    def _penalize(self, relays: list[bytes], now: float) -> None:
        for relay in relays:
            count, _ = self._penalty.get(relay, (0, now))
            self._penalty[relay] = (count + 1, now)

    def _drop_path(self, path: _Path, reason: str) -> None:
        self._paths.pop(path.handle.key, None)
        self.overlay.close_path(path.handle, reason)
        self._after_path_loss(path)

    def _on_path_down(self, handle: PathHandle) -> None:
        path = self._paths.pop(handle.key, None)
        if path is not None:
            log.warning("path via %s down: %s", _short(path.relays[0]), handle.error)
            self._after_path_loss(path)

    def _after_path_loss(self, path: _Path) -> None:
        for pending in self._pending.values():
            if pending.done.is_set() or not pending.attempts:
                continue
            attempt = pending.attempts[-1]
            if path not in attempt.paths:
                continue
            alive = [p for p in attempt.paths if p.handle.alive]
            if len(alive) < self.config.threshold:
                pending.retry.set()
                continue
            # re-send the lost path's clove on a spare path (duplicates are dropped downstream)
            index = attempt.paths.index(path)
            spares = [p for p in self.ready_paths() if p not in attempt.paths]
            if spares:
                spare = self._rng.choice(spares)
                self._send_clove(spare, pending.destination, attempt.cloves[index])
        self._notify()

    # ------------------------------------------------------------------ requests

    def model_nodes(self, model_id: str | None = None) -> list[NodeRecord]:
        """Model node records of the current directory (optionally serving ``model_id``)."""
        directory = self._directory()
        if directory is None:
            return []
        return [
            r for r in directory.model_nodes()
            if model_id is None or r.model_id == model_id
        ]

    async def ask(
        self,
        prompt: str,
        *,
        model_id: str | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        model_node: bytes | None = None,
        timeout: float | None = None,
    ) -> Answer:
        """Send one prompt anonymously and wait for the signed answer.

        Never raises for network trouble: failures come back as ``Answer(ok=False, error=...)``
        once the deadline (``timeout`` or ``config.request_timeout`` seconds) passes.
        """
        timeout = self.config.request_timeout if timeout is None else timeout
        request_id = self._random_bytes(16)
        started = self._clock()
        try:
            candidates = [
                r for r in self.model_nodes(model_id)
                if model_node is None or r.peer_id == model_node
            ]
            if not candidates:
                raise DirectoryError(
                    f"no model node serving {model_id!r} in the directory"
                    if model_id else "no model node in the directory"
                )
            target = self._rng.choice(candidates)
            pending = _Pending(request_id, target.peer_id, target.model_id, started)
            self._pending[request_id] = pending
            params = inference_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
            with trio.fail_after(timeout):
                while True:
                    await self.wait_ready(self.config.total, timeout=timeout)
                    await self._wait_distinct_proxies(self.config.total, grace=1.0)
                    if len(self.ready_paths()) < self.config.total:
                        continue  # a path died during the grace: wait for the pool again
                    self._send_attempt(pending, target, prompt, params)
                    pending.retry = trio.Event()
                    wait = self._attempt_wait(max_tokens) * 2 ** (len(pending.attempts) - 1)
                    with trio.move_on_after(wait):
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(_set_when, pending.retry, pending.done)
                            await pending.retry.wait()
                            nursery.cancel_scope.cancel()
                    if pending.done.is_set():
                        break
                    log.warning(
                        "request %s: no answer on attempt %d; resending on fresh paths",
                        request_id.hex()[:8], len(pending.attempts),
                    )
            assert pending.answer is not None
            return pending.answer
        except trio.TooSlowError:
            return self._failed(request_id, started, f"no answer within {timeout:.0f} s", RequestTimeoutError)
        except PsError as exc:
            return self._failed(request_id, started, str(exc), type(exc))
        finally:
            done = self._pending.pop(request_id, None)
            for attempt in done.attempts if done is not None else ():
                self._by_response_id.pop(attempt.response_id, None)

    def _attempt_wait(self, max_tokens: int) -> float:
        """Seconds to wait for an answer before the first resend (see UserConfig)."""
        per_token = max(self.config.token_time, 2 * self._token_time)
        return self.config.attempt_timeout + max_tokens * per_token

    def _failed(self, request_id: bytes, started: float, error: str, kind: type) -> Answer:
        pending = self._pending.get(request_id)
        return Answer(
            request_id=request_id,
            ok=False,
            error=f"{kind.__name__}: {error}",
            latency_ms=(self._clock() - started) * 1000,
            cloves_received=pending.cloves_received if pending else 0,
            attempts=len(pending.attempts) if pending else 0,
        )

    def _send_attempt(
        self,
        pending: _Pending,
        target: NodeRecord,
        prompt: str,
        params: inference_pb2.SamplingParams,
    ) -> None:
        cfg = self.config
        ready = self.ready_paths()
        if len(ready) < cfg.total:
            raise PathError(f"only {len(ready)} paths ready, need {cfg.total}")
        chosen = self._distinct_proxies(ready, cfg.total)
        # A fresh reply tag per request and path: the model node answers proxy i under tag i,
        # so no lasting path ID links this user's requests; fresh tags also make every sending's
        # Q (and so its response ID) differ from the earlier ones.
        tags = [self._random_bytes(16) for _ in chosen]
        request = inference_pb2.InferenceRequest(
            request_id=pending.request_id,
            model_id=target.model_id,
            prompt=prompt,
            params=params,
            reply_proxies=[
                inference_pb2.ReplyProxy(peer_id=p.handle.path.proxy, reply_tag=tag)
                for p, tag in zip(chosen, tags)
            ],
        )
        q_bytes = request.SerializeToString()
        if len(q_bytes) > sida.MAX_MESSAGE_BYTES:
            raise RequestError(
                f"request of {len(q_bytes)} bytes is over the {sida.MAX_MESSAGE_BYTES}-byte limit"
            )
        cloves = sida.encode(
            q_bytes, total=cfg.total, threshold=cfg.threshold, random_bytes=self._random_bytes
        )
        clove_bytes = len(clove_to_bytes(cloves[0])) + _DELIVER_OVERHEAD
        if clove_bytes > onion.MAX_CELL_PAYLOAD:
            raise RequestError(
                f"request of {len(q_bytes)} bytes gives cloves of {clove_bytes} bytes, over the "
                f"{onion.MAX_CELL_PAYLOAD}-byte cell limit; shorten the prompt"
            )
        req_hash = responses.request_hash(q_bytes)
        attempt = _Attempt(
            q_bytes, req_hash, cloves, chosen, self._clock(),
            responses.response_message_id(pending.request_id, req_hash), tags,
        )
        pending.attempts.append(attempt)
        self._by_response_id[attempt.response_id] = (pending, attempt)
        for index, (path, clove, tag) in enumerate(zip(chosen, cloves, tags)):
            self._reply_tags[tag] = _ReplyTag(
                target.peer_id, path.handle, attempt.response_id, index, len(chosen)
            )
            while len(self._reply_tags) > MAX_REPLY_TAGS:
                self._reply_tags.popitem(last=False)
            self._send_clove(path, target.peer_id, clove, tag)

    def _distinct_proxies(self, ready: list[_Path], count: int) -> list[_Path]:
        """``count`` paths, each with a different proxy where possible.

        A proxy holding k cloves of one request could decode it, and a bad proxy on two paths
        spoils two cloves; so one clove per proxy (DESIGN.md: fewer than k compromised paths must
        never reveal content).
        """
        order = list(ready)
        self._rng.shuffle(order)
        chosen: list[_Path] = []
        proxies: set[bytes] = set()
        for path in order:
            if path.relays[-1] not in proxies:
                chosen.append(path)
                proxies.add(path.relays[-1])
            if len(chosen) == count:
                return chosen
        rest = [p for p in order if p not in chosen]
        log.warning("only %d distinct proxies among %d ready paths; one proxy carries two cloves",
                    len(proxies), len(ready))
        return chosen + rest[: count - len(chosen)]

    def _send_clove(
        self, path: _Path, destination: bytes, clove: sida.Clove, reply_tag: bytes = b""
    ) -> None:
        payload = clove_pb2.ForwardPayload(
            deliver=clove_pb2.DeliverClove(
                destination=destination, clove=clove_to_bytes(clove), reply_tag=reply_tag
            )
        )
        if not self.overlay.send_on_path(path.handle, payload):
            log.warning("could not send a clove on the path via %s", _short(path.relays[0]))

    # ------------------------------------------------------------------ backward traffic

    def _on_backward(self, handle: PathHandle, message: clove_pb2.BackwardPayload) -> None:
        try:
            self._handle_backward(handle, message)
        except Exception:  # never let one bad payload reset the first hop's shared stream
            log.exception("backward payload on the path via %s dropped", _short(handle.path.first_hop))

    def _handle_backward(self, handle: PathHandle, message: clove_pb2.BackwardPayload) -> None:
        path = self._paths.get(handle.key)
        now = self._clock()
        if path is not None:
            path.last_reply_at = now
        kind = message.WhichOneof("kind")
        if kind == "probe_reply":
            if path is not None and path.probe_nonce == message.probe_reply.nonce:
                path.probe_nonce = None
                self._probe_rtt.sample(now - path.probe_sent_at)
                if not path.confirmed:
                    path.confirmed = True
                    self._notify()
                # a probe came back: every relay before the proxy forwards cells intact. The
                # proxy is not cleared: it opens the probe itself, and answering probes says
                # nothing of what it does with cloves (a relay that tampers as a middle hop and
                # proxies probes faithfully once had its penalty cleared by every such path)
                for relay in path.relays[:-1]:
                    self._penalty.pop(relay, None)
        elif kind == "delivery_failed":
            log.warning("proxy could not deliver a clove: %s", message.delivery_failed)
        elif kind == "signed_clove":
            raw = message.signed_clove.clove
            try:
                clove = clove_from_bytes(raw)
            except RemoteProtocolError as exc:
                log.warning("malformed response clove dropped: %s", exc)
                return
            self._on_response_clove(
                clove, raw, message.signed_clove.signature, message.signed_clove.reply_tag,
                handle, now,
            )
        elif kind == "clove":
            self.misrouted_cloves += 1
            log.warning("unsigned response clove dropped")

    def _on_response_clove(
        self, clove: sida.Clove, raw: bytes, signature: bytes, reply_tag: bytes,
        handle: PathHandle, now: float,
    ) -> None:
        """Check one response clove and feed it to its request.

        Conviction uses only evidence the proxy alone could have produced: the clove came under
        a reply tag this user registered with this path's proxy for model node M, and the proxy
        forwards a reply under that tag only when M's signature on it verifies; so a signature
        that fails under M convicts the proxy. A clove under an unknown tag or on another path
        (nothing the proxy vouched for) is dropped without blame, and a validly signed clove that
        does not fit its tag (wrong message, index or header) is the model node's own doing.
        """
        registered = self._reply_tags.get(reply_tag)
        if registered is None or registered.handle is not handle:
            self.misrouted_cloves += 1
            log.warning("response clove under a reply tag not registered on its path; dropped")
            return
        if not self._signed_by(registered.destination, clove, raw, signature, handle, now):
            return
        if (
            clove.message_id != registered.response_id
            or clove.index != registered.index
            or (clove.total, clove.threshold) != (registered.total, self.config.threshold)
        ):
            self.misrouted_cloves += 1
            log.warning("model node %s signed a clove that does not fit its reply tag; dropped",
                        _short(registered.destination))
            return
        found = self._by_response_id.get(clove.message_id)
        if found is None or found[0].done.is_set():
            audit = self._audits.get(clove.message_id)
            if audit is not None and not _consistent(audit, clove):
                log.warning("model node %s signed a clove that is not part of its answer",
                            _short(audit.destination))
            return
        pending, attempt = found
        pending.cloves_received += 1
        if len(pending.received) < MAX_RECEIVED_CLOVES:
            pending.received.append((clove, handle))
        try:
            events = pending.assembler.receive_clove(clove, now)
        except RemoteProtocolError as exc:
            log.warning("inconsistent response clove dropped: %s", exc)
            return
        for event in events:
            if isinstance(event, ReassemblyFailed):
                log.warning("response %s did not decode: %s", clove.message_id.hex()[:8], event.reason)
                pending.assembler = CloveAssembler()
            elif isinstance(event, MessageReassembled):
                self._on_response(pending, event.payload, now, event.message_id)

    def _on_response(
        self, pending: _Pending, payload: bytes, now: float, message_id: bytes
    ) -> None:
        response = inference_pb2.InferenceResponse()
        try:
            response.ParseFromString(payload)
        except Exception:
            log.warning("undecodable response dropped")
            return
        answer = Answer(
            request_id=pending.request_id,
            ok=False,
            served_by=response.model_node,
            cloves_received=pending.cloves_received,
            latency_ms=(now - pending.started_at) * 1000,
            status=response.status,
            attempts=len(pending.attempts),
            model_id=response.model_id,
            completion_tokens=response.completion_tokens,
        )
        try:
            self._check_response(pending, response)
            answer.signature_valid = True
        except (InvalidSignatureError, RemoteProtocolError) as exc:
            log.warning("response to %s rejected: %s", pending.request_id.hex()[:8], exc)
            answer.error = f"{type(exc).__name__}: {exc}"
            return
        if response.status == Status.RESPONSE_STATUS_OK:
            answer.ok = True
            answer.text = response.text
            if response.completion_tokens and len(pending.attempts) == 1:  # Karn: one sending
                measured = (now - pending.started_at) / response.completion_tokens
                self._token_time += (measured - self._token_time) / 8
        else:
            try:
                name = Status.Name(response.status).removeprefix("RESPONSE_STATUS_")
            except ValueError:
                name = f"STATUS_{response.status}"
            answer.error = f"{name}: {response.error}"
        pending.answer = answer
        pending.done.set()
        try:
            self._audit(pending, message_id, payload, now)
        except Exception:  # the answer stands whatever the audit hits
            log.exception("audit of the response to %s failed", pending.request_id.hex()[:8])

    def _audit(self, pending: _Pending, message_id: bytes, payload: bytes, now: float) -> None:
        """Check the response cloves against the verified answer, and keep the answer a while to
        check late cloves (their signatures convict an altering proxy; signed cloves that do not
        fit the answer are the model node's own doing and are logged)."""
        received = [(c, h) for c, h in pending.received if c.message_id == message_id]
        distinct: dict[int, sida.Clove] = {}
        for clove, _ in received:
            distinct.setdefault(clove.index, clove)
        good: list[sida.Clove] | None = None
        cloves = list(distinct.values())
        k = self.config.threshold
        for subset in itertools.combinations(cloves, k):
            try:
                if sida.decode_subset(list(subset)) == payload:
                    good = list(subset)
                    break
            except (DecodeError, RemoteProtocolError):
                continue
        if good is None:
            return
        audit = _Audit(good, payload, pending.destination)
        if any(not _consistent(audit, clove) for clove, _ in received):
            # every clove here carries the model node's valid signature: its own doing
            log.warning("model node %s signed cloves that are not part of its answer",
                        _short(pending.destination))
        self._audits[message_id] = audit
        while len(self._audits) > MAX_AUDITS:
            self._audits.popitem(last=False)

    def _signed_by(
        self, model_node: bytes, clove: sida.Clove, raw: bytes, signature: bytes,
        handle: PathHandle, now: float,
    ) -> bool:
        """Check the model node's signature on a response clove; a bad one convicts the proxy.

        Call only for a clove that came under a reply tag registered for ``model_node`` on this
        path: only the proxy sees a clove in the clear (relays are held off by the end-to-end
        layer), and it forwards a reply under that tag only when ``model_node``'s signature on it
        verifies."""
        try:
            records.verify_signature(
                model_node, records.clove_signing_bytes(clove.message_id, raw), signature
            )
        except (InvalidSignatureError, RemoteProtocolError):
            self._flag_proxy(handle, now)
            return False
        return True

    def _flag_proxy(self, handle: PathHandle, now: float) -> None:
        proxy = handle.path.proxy
        if proxy not in self._bad_proxies:
            log.warning(
                "proxy %s altered a response clove: avoiding it for %.0f s",
                _short(proxy), BAD_PROXY_COOLDOWN,
            )
        self._bad_proxies[proxy] = now + BAD_PROXY_COOLDOWN
        for path in list(self._paths.values()):
            if path.relays[-1] == proxy:
                self._drop_path(path, "proxy altered a clove")

    def _check_response(
        self, pending: _Pending, response: inference_pb2.InferenceResponse
    ) -> None:
        if response.request_id != pending.request_id:
            raise RemoteProtocolError("response for another request")
        if not any(a.req_hash == response.request_hash for a in pending.attempts):
            raise RemoteProtocolError("response signs a request we did not send")
        directory = self._directory()
        record = directory.record(response.model_node) if directory is not None else None
        if record is None or Role.MODEL not in record.roles:
            raise InvalidSignatureError("response signed by a node that is no model node of the directory")
        if response.model_node != pending.destination:
            raise RemoteProtocolError("response signed by another model node than the one asked")
        if response.status == Status.RESPONSE_STATUS_OK and response.model_id != pending.model_id:
            raise RemoteProtocolError(
                f"response from model {response.model_id!r}, asked {pending.model_id!r}"
            )
        content = responses.ResponseContent(
            status=response.status,
            text=response.text,
            error=response.error,
            model_id=response.model_id,
            prompt_tokens=response.prompt_tokens,
            completion_tokens=response.completion_tokens,
        )
        responses.verify_response(
            request_id=response.request_id,
            req_hash=response.request_hash,
            content=content,
            signed_at_ms=response.signed_at_ms,
            model_node=response.model_node,
            signature=response.signature,
        )


def _consistent(audit: _Audit, clove: sida.Clove) -> bool:
    """Whether ``clove`` belongs to the same S-IDA encoding as the audit's verified answer."""
    for good in audit.good:
        if good.index == clove.index:
            return good == clove
    try:
        return sida.decode_subset([*audit.good[1:], clove]) == audit.payload
    except (DecodeError, RemoteProtocolError):
        return False


async def _set_when(target: trio.Event, source: trio.Event) -> None:
    await source.wait()
    target.set()



__all__ = ["Answer", "UserClient", "UserConfig"]
