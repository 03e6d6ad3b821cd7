"""The verification epochs of one committee verifier: commit, lead, re-score, confirm (trio).

PlanetServe sec. 3.4 and Algorithm 3, on the chain rules of :mod:`ps_p2p.verification.ledger`.
One :class:`EpochService` runs beside the verifier's consensus service and its user role (a
verifier reaches model nodes the way users do: through the anonymous overlay). After each
committed block (:meth:`EpochService.notify`) and at each attempt boundary it:

1. **commits** its seed for the current epoch (before it starts) and for the next one: a
   SEED_COMMIT of ``seed_commitment(chain, e, me, derive_secret(master, chain, e))``, the
   master key derived from the validator's identity key (a restarted verifier reveals the
   secret it committed without storing it);
2. **leads** when the ledger's draw names it for the attempt under way (block time from its own
   clock): derives the plan from its secret and each challenge's request from it
   (:func:`~ps_p2p.verification.challenges.derive_request`: a user-shaped request, chat or
   prompt, streamed or not, with parameters drawn from users' distribution), sends each one at
   its own time spread over the epoch (:meth:`EpochService.send_window`) with
   :meth:`~ps_p2p.roles.user.UserClient.ask` (the same call, so the same bytes, as a user's
   request of that shape) over paths that carried no other challenge to that node
   (:class:`ChallengePaths`: Q names its reply proxies), checks and scores each signed answer with its reference engine
   under the request's own parameters, and submits the EPOCH_REPORT with each Q sealed under
   the committee key (:mod:`~ps_p2p.verification.sealing`: blocks reach every listed node);
3. **re-scores** every EPOCH_REPORT that reaches its mempool, off the consensus task: each
   sealed Q opens under the committee key to the signed request hash, Q decodes, is exactly
   the request derived from the revealed secret (prompt or chat, parameters, stream), under
   the committee's model, and each score is within ``params.tolerance`` of its own; the verdict is what :meth:`value_check` answers
   the validator (until it is known: "not re-scored yet", so the validator neither proposes nor
   prevotes for that report);
4. **publishes** its users' mix of request shapes once per epoch, when ``mix_source`` (the
   node's local API's :class:`~ps_p2p.verification.mix.ShapeRecorder`) has a publishable
   window: a MIX_REPORT, from which the committed mix of the next epochs is learned
   (:mod:`~ps_p2p.verification.mix`); every challenge is drawn from the committed mix of its
   epoch (:attr:`~ps_p2p.verification.ledger.EpochLedger.mix`), as is every re-derivation;
5. **confirms** each open miss of an epoch it did not lead: one challenge of its own (a pool
   prompt it draws itself, among those no remembered epoch nor its own earlier confirmation
   asked, in a user-shaped request drawn under a secret of its own) to the node; a MISS_REPORT
   only when that goes unanswered too.

An answer whose signed fields do not fit a report (a text, model ID or finish reason over the
ledger's bounds) is no evidence: the leader lists it as unanswered (a report carrying it would
be refused whole and the epoch would not end) and a confirmation counts it as a miss. When the
answers together make the report longer than the genesis' ``max_tx_bytes``, the longest are
listed as unanswered until it fits.

A verifier needs the committee's model (``engine``), the prompt pool (its digest must be the
genesis' ``pool_sha256``) and the committee key (its commitment must be the genesis'
``committee_key_sha256``); without them its node runs no epochs and its validator checks no
reports (so it prevotes nil on them: a committee needs 2f+1 verifiers with the model).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ps_p2p.consensus.encoding import Reader
from ps_p2p.engines.base import Engine
from ps_p2p.errors import (
    ConfigError,
    InvalidTransactionError,
    ModelNodeLostError,
    PsError,
    RemoteProtocolError,
    RequestTimeoutError,
    VerificationError,
)
from ps_p2p.inference import InferenceReply
from ps_p2p.protocols.inference_codec import decode_query
from ps_p2p.records import Signer
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.responses import request_hash
from ps_p2p.verification import epochs
from ps_p2p.verification.challenges import (
    ChallengeMix,
    ChallengeRequest,
    derive_request,
    for_pool,
    history_share,
    request_problem,
)
from ps_p2p.verification.epochs import VALUE_CHECK_PENDING
from ps_p2p.verification.ledger import (
    MAX_REQUEST_BYTES,
    MICRO,
    ChallengeResult,
    EpochLedger,
    EpochReportTx,
    SamplingOption,
    SignedAnswer,
    VerificationParams,
    pool_digest,
    sign_epoch_report,
    sign_miss_report,
    sign_mix_report,
    sign_seed_commit,
)
from ps_p2p.verification.mix import ShapeHistogram, mix_of
from ps_p2p.verification.scoring import (
    DEFAULT_CHALLENGE_SCORING,
    decoy_indices,
    score_challenge,
)
from ps_p2p.verification.sealing import (
    SEAL_OVERHEAD,
    check_committee_key,
    open_request,
    seal_request,
)

log = logging.getLogger(__name__)

MASTER_DOMAIN = b"planetserve/v1/epoch-master\x00"
#: Seconds between two submissions of the same seed commitment while it is not committed.
RESUBMIT_SECONDS = 5.0
#: Reports whose verdict is kept (the mempool holds a few at a time).
MAX_VERDICTS = 256
#: Reports queued for re-scoring at once; more are refused ("busy") until one is done.
MAX_PENDING_CHECKS = 8
#: Warn when the pool has fewer unused prompts than this many epochs' plans.
POOL_WARN_EPOCHS = 16
#: Challenges of one epoch sent at once.
MAX_PARALLEL_CHALLENGES = 8
NOT_YET = VALUE_CHECK_PENDING  # the validator defers its answer until the verdict
#: The outcomes of a confirmation challenge that count as the node's miss: sent over ready
#: paths, and no valid answer came (any other failure may be the verifier's own).
MISS_ERRORS = (RequestTimeoutError, ModelNodeLostError)
#: Seconds of its attempt a leader keeps after its last challenge's deadline (to score and
#: submit its report).
REPORT_MARGIN_S = 5.0

Ask = Callable[[ChallengeRequest, bytes, float], Awaitable[object]]
"""``ask(request, model_node, timeout) -> Answer``: one request through the overlay
(:meth:`~ps_p2p.roles.user.UserClient.ask` with ``include_untrusted=True``)."""


class TxCodec(Protocol):
    """The application's transaction codec, which the service encodes its transactions with
    and decodes the reports it re-scores with. The node passes the registry package
    (:mod:`ps_p2p.registry`: ``encode_tx``, ``decode_tx``): the registry executes these
    transactions, so it imports :mod:`ps_p2p.verification` and not the other way round (issue
    17: no import cycle between the two)."""

    def encode_tx(self, tx: Any) -> bytes: ...

    def decode_tx(self, data: bytes, max_tx_bytes: int) -> Any: ...


def _tx_key(raw: bytes) -> bytes:
    """The key of an encoded transaction in the verdict cache: SHA-256, 32 bytes."""
    return hashlib.sha256(raw).digest()


def _discard(text: str) -> None:
    """A streamed challenge's ``on_text``: the verifier reads the whole answer at the end."""


def overlay_ask(user: Any, model_id: str) -> Ask:
    """The :data:`Ask` of a verifier's user role: waits (up to half the timeout) for a ready
    path, then one :meth:`~ps_p2p.roles.user.UserClient.ask` naming the model node, with the
    request's shape (prompt or chat messages, streamed when the request is) and parameters
    (max_tokens, temperature, top_p, seed, stop); ``include_untrusted`` so an untrusted node is
    measured again. The request is built by the same code as any user's
    (``tests/test_epoch_service.py`` compares the bytes)."""

    async def ask(request: ChallengeRequest, node: bytes, timeout: float) -> Any:
        with trio.move_on_after(timeout / 2):  # paths first: a challenge needs the overlay
            await user.wait_ready(1, timeout=timeout / 2)
        return await user.ask(**request.ask_kwargs(), model_node=node, model_id=model_id,
                              timeout=timeout, include_untrusted=True,
                              on_text=_discard if request.stream else None)

    return ask


class ChallengePaths:
    """Which model nodes the current generation of this verifier's paths carried a challenge
    to; pure (issue 18).

    A model node sees the reply proxies of every request (they are in Q), and a client's
    requests go over the same few paths (4 of ``PoolConfig.paths`` = 5) until they rotate: two
    requests sharing proxies come from one client. A leader that sent a node its several
    challenges of an epoch over one generation of paths made them the node's most linked
    requests (``bench_challenge_privacy.py``: the count of this epoch's earlier requests
    sharing >= 2 proxies alone had an AUC of 0.81). So no generation carries two challenges to
    one node: :meth:`before` says when to rotate first (:meth:`~ps_p2p.roles.user.UserClient.
    rotate_paths`), and every rotation is told (:meth:`rotated`).

    Attributes:
        generation: rotations counted so far.
    """

    def __init__(self) -> None:
        self.generation = 0
        self._nodes: set[bytes] = set()

    def before(self, node: bytes) -> bool:
        """Call before sending a challenge to ``node``; True: this generation already carried
        one to it, rotate the paths first (counted here as done)."""
        rotate = node in self._nodes
        if rotate:
            self.rotated()
        self._nodes.add(bytes(node))
        return rotate

    def rotated(self) -> None:
        """The paths were rotated (a new generation carried nothing yet)."""
        self.generation += 1
        self._nodes.clear()


def master_key(identity_private: bytes) -> bytes:
    """The epoch master key of a validator: SHA-256(MASTER_DOMAIN || its identity key's 32
    private bytes); secret as the identity key is."""
    return hashlib.sha256(MASTER_DOMAIN + bytes(identity_private)).digest()


@dataclass
class EpochStats:
    """Counters of one verifier's epochs (``ps-node status``, logs, tests)."""

    commits: int = 0
    epochs_led: int = 0
    challenges_sent: int = 0
    answers_scored: int = 0
    reports_agreed: int = 0
    reports_refused: int = 0
    confirmations: int = 0
    misses_reported: int = 0
    mix_reports: int = 0
    last_refusal: str = ""


class EpochService:
    """The epochs of one verifier (module docstring).

    Args:
        identity: the validator's identity (signs its transactions).
        params: the genesis' verification parameters.
        state: the validator's committed state now (``lambda: validator.state``, a
            :class:`ps_p2p.registry.AppState`).
        txs: the application's transaction codec (:class:`TxCodec`; the node passes
            :mod:`ps_p2p.registry`).
        submit: a transaction into the validator's mempool (raises InvalidTransactionError).
        ask: :data:`Ask`.
        engine: the reference engine of ``params.model_id``.
        pool: the prompt pool; its :func:`~ps_p2p.verification.ledger.pool_digest` must be
            ``params.pool_sha256``.
        master: the epoch master key (:func:`master_key`), >= 32 bytes.
        committee_key: the committee key (32 bytes) that seals the requests in reports; its
            :func:`~ps_p2p.verification.sealing.key_commitment` must be
            ``params.committee_key_sha256``.
        challenge_timeout: seconds a challenge may take.
        unix_ms: wall clock (the block times' clock), injected in tests.
        spread: send each challenge at its own time in the epoch (:meth:`send_window`); False
            sends them all at once (tests of everything else).
        mix: a fixed distribution of challenge shapes instead of the committed one (None, the
            default: each epoch's committed mix, :attr:`~ps_p2p.verification.ledger.
            EpochLedger.mix`, learned from the verifiers' MIX_REPORTs); every verifier of a
            committee must use the same one, as each re-derives the leader's requests from it
            (tests and benchmarks set a cheaper one).
        mix_source: the histogram of request shapes this verifier's local API saw, when it
            has a publishable window (:meth:`~ps_p2p.verification.mix.ShapeRecorder.take`);
            None: it publishes none.
        rng: the draws of confirmation challenges.

    Raises:
        ConfigError: the pool or the committee key is not the committed one.
    """

    def __init__(
        self, identity: Signer, params: VerificationParams, *,
        state: Callable[[], Any], txs: TxCodec, submit: Callable[[bytes], object], ask: Ask,
        engine: Engine, pool: Sequence[str], master: bytes, committee_key: bytes,
        challenge_timeout: float = 60.0, unix_ms: Callable[[], int],
        rng: random.Random | None = None, spread: bool = True,
        mix: ChallengeMix | None = None,
        mix_source: Callable[[], ShapeHistogram | None] | None = None,
    ) -> None:
        check_committee_key(committee_key, params.committee_key_sha256)
        digest = pool_digest(pool)
        if digest != params.pool_sha256 or len(pool) != params.pool_size:
            raise ConfigError(
                f"the prompt pool ({len(pool)} prompts, digest {digest[:12]}) is not the one "
                f"the genesis commits ({params.pool_size} prompts, {params.pool_sha256[:12]})")
        self.identity = identity
        self.address = identity.peer_id
        self.params = params
        self._state = state
        self._txs = txs
        self._submit = submit
        self._ask = ask
        self.engine = engine
        self.pool = list(pool)
        self._pool_index = {p: i for i, p in reversed(list(enumerate(self.pool)))}
        self._history_share = history_share(self.pool)
        #: how answers are scored (a genesis parameter set in a later version; the defaults)
        self.challenge_scoring = DEFAULT_CHALLENGE_SCORING
        self._master = bytes(master)
        self._committee_key = bytes(committee_key)
        self.challenge_timeout = challenge_timeout
        self.spread = spread
        self.mix = mix
        self._mix_source = mix_source
        self._mix_sent_epoch = 0
        self._unix_ms = unix_ms
        self._rng = rng or random.SystemRandom()
        self.stats = EpochStats()
        self._wake = trio.Event()
        self._verdicts: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        self._checks_send, self._checks_receive = trio.open_memory_channel[bytes](
            MAX_PENDING_CHECKS)
        self._checking: set[bytes] = set()
        self._commit_sent: dict[int, float] = {}
        self._led: set[tuple[int, int]] = set()
        self._confirming: set[tuple[int, bytes]] = set()
        self._confirm_prompts: set[int] = set()  # at most the pool
        self._nursery: trio.Nursery | None = None
        #: called after each verdict (the node: ``ConsensusService.revalidate``)
        self.on_verdict: Callable[[], None] | None = None
        #: called once this verifier submitted a report
        self.on_reported: Callable[[], None] | None = None
        #: retires every path of this verifier's user role and builds new ones (the node:
        #: ``UserClient.rotate_paths``): after each report (which names its reply proxies,
        #: sealed for the committee) and before a challenge to a node the current paths
        #: already carried one to (:class:`ChallengePaths`); None: never
        self.rotate_paths: Callable[[], None] | None = None
        self._paths = ChallengePaths()

    # ------------------------------------------------------------------ hooks (sync)

    def notify(self) -> None:
        """A block was committed: look again (called from the consensus task)."""
        self._wake.set()

    def value_check(self, tx: bytes) -> str | None:
        """The validator's own check of an EPOCH_REPORT (module docstring, 3): None when this
        verifier's scores agree; else why not (also while it is still re-scoring)."""
        key = _tx_key(tx)
        if key in self._verdicts:
            return self._verdicts[key]
        if key not in self._checking:
            try:
                self._checks_send.send_nowait(bytes(tx))
                self._checking.add(key)
            except trio.WouldBlock:
                return "busy re-scoring other reports"
        return NOT_YET

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (module docstring)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._check_worker)
            task_status.started()
            while True:
                self._wake = trio.Event()
                delay = self._step()
                with trio.move_on_after(delay):
                    await self._wake.wait()

    def _step(self) -> float:
        """Start what is due now; returns seconds until the next attempt boundary (or 5)."""
        state = self._state()
        ledger = state.ledger
        now = trio.current_time()
        for e in (ledger.epoch + 1,) if ledger.started else (ledger.epoch, ledger.epoch + 1):
            if self.address not in ledger.commitments.get(e, {}) \
                    and now - self._commit_sent.get(e, -math.inf) >= RESUBMIT_SECONDS:
                self._commit(state, e)
                self._commit_sent[e] = now
        for e in [e for e in self._commit_sent if e < ledger.epoch]:
            del self._commit_sent[e]
        self._publish_mix(state)
        delay = RESUBMIT_SECONDS
        if ledger.started:
            now_ms = self._unix_ms()
            attempt = ledger.attempt_at(now_ms, self.params)
            key = (ledger.epoch, attempt)
            if key not in self._led and ledger.leader(attempt) == self.address \
                    and not any(e == ledger.epoch for e, _ in self._led):
                self._led.add(key)
                assert self._nursery is not None
                self._nursery.start_soon(self._lead, state, attempt)
            boundary = ledger.start_ms + (attempt + 1) * self.params.attempt_ms
            delay = min(delay, max(0.05, (boundary - now_ms) / 1000))
        for key in ledger.open_misses():
            if key not in self._confirming and self.address not in ledger.misses[key]:
                self._confirming.add(key)
                assert self._nursery is not None
                self._nursery.start_soon(self._confirm, state, *key)
        self._confirming &= set(ledger.misses)
        self._led = {k for k in self._led if k[0] >= ledger.epoch}
        return delay

    def _commit(self, state: Any, epoch: int) -> None:
        secret = epochs.derive_secret(self._master, state.chain_id, epoch)
        commitment = epochs.seed_commitment(state.chain_id, epoch, self.address, secret)
        tx = sign_seed_commit(self.identity, state.chain_id, epoch, commitment)
        if self._try_submit(self._txs.encode_tx(tx), f"seed commitment for epoch {epoch}"):
            self.stats.commits += 1

    def mix_for(self, ledger: EpochLedger) -> ChallengeMix:
        """The mix the challenges of ``ledger``'s current epoch are drawn from: ``mix`` when
        set, else the committed one, for this pool's share of entries with history
        (:func:`~ps_p2p.verification.challenges.for_pool`)."""
        mix = self.mix if self.mix is not None else mix_of(ledger.mix)
        return for_pool(mix, self._history_share)

    def _publish_mix(self, state: Any) -> None:
        """One MIX_REPORT per epoch, once the API's window is publishable."""
        ledger = state.ledger
        if self._mix_source is None or self._mix_sent_epoch >= ledger.epoch:
            return
        held = ledger.mix_reports.get(self.address)
        if held is not None and held[0] >= ledger.epoch:
            self._mix_sent_epoch = ledger.epoch
            return
        histogram = self._mix_source()
        if histogram is None:
            return
        self._mix_sent_epoch = ledger.epoch
        tx = sign_mix_report(self.identity, state.chain_id, ledger.epoch, histogram)
        if self._try_submit(self._txs.encode_tx(tx), f"mix report for epoch {ledger.epoch}"):
            self.stats.mix_reports += 1

    def _try_submit(self, raw: bytes, what: str) -> bool:
        try:
            self._submit(raw)
        except PsError as exc:
            log.info("own %s not taken: %s", what, exc)
            return False
        return True

    # ------------------------------------------------------------------ leading

    async def _lead(self, state: Any, attempt: int) -> None:
        ledger, chain = state.ledger, state.chain_id
        epoch = ledger.epoch
        secret = epochs.derive_secret(self._master, chain, epoch)
        plan = ledger.plan(chain, self.params, attempt, secret)
        log.info("leading epoch %d (attempt %d): %d challenge(s) to %d model node(s)", epoch,
                 attempt, len(plan.challenges), len(plan.model_nodes))
        fresh = ledger.fresh_prompts(self.params) - len(plan.challenges)
        if fresh < POOL_WARN_EPOCHS * len(plan.challenges):
            log.warning("the challenge pool is %s: %d unused prompt(s) left, %d per epoch; "
                        "then earlier prompts come back (a model node that saw one can flag "
                        "it): give the committee a new private pool",
                        "exhausted" if fresh <= 0 else "nearly exhausted", max(fresh, 0),
                        len(plan.challenges))
        self.stats.epochs_led += 1
        results: dict[epochs.Challenge, ChallengeResult] = {}
        limiter = trio.CapacityLimiter(MAX_PARALLEL_CHALLENGES)
        window_ms = self.send_window() * 1000
        # when each is due: block time of the attempt's start + its fraction of the window
        begin_ms = ledger.start_ms + attempt * self.params.attempt_ms
        mix = self.mix_for(ledger)
        due_ms = {c: begin_ms + round(self._request(secret, epoch, attempt, c, mix).send_fraction
                                      * window_ms)
                  for c in plan.challenges}

        async def one(challenge: epochs.Challenge) -> None:
            wait_s = (due_ms[challenge] - self._unix_ms()) / 1000
            if wait_s > 0:
                await trio.sleep(wait_s)
            async with limiter:
                results[challenge] = await self._challenge(
                    ledger, challenge, self._request(secret, epoch, attempt, challenge, mix))

        async with trio.open_nursery() as nursery:
            for challenge in plan.challenges:
                nursery.start_soon(one, challenge)
        ordered = [results[c] for c in plan.challenges]
        tx = sign_epoch_report(self.identity, chain, epoch, attempt, secret, ordered)
        raw = self._txs.encode_tx(tx)
        limit = state.genesis.limits.max_tx_bytes
        if len(raw) > limit:  # a model node signs its text's length: the longest answers go
            ordered = _fit_report(ordered, len(raw) - limit, epoch)
            tx = sign_epoch_report(self.identity, chain, epoch, attempt, secret, ordered)
            raw = self._txs.encode_tx(tx)
        if len(raw) > limit:
            log.error("epoch %d report of %d bytes is over the genesis' max_tx_bytes (%d): "
                      "raise block_limits.max_tx_bytes or lower verification.max_nodes",
                      epoch, len(raw), limit)
            return
        self._remember(_tx_key(raw), None)  # its own scores
        answered = sum(r.answer is not None for r in ordered)
        if self._try_submit(raw, f"epoch {epoch} report"):
            self._rotate()
            if self.on_reported is not None:
                self.on_reported()
            log.info("epoch %d report submitted: %d of %d answered, scores %s", epoch, answered,
                     len(ordered), " ".join(f"{peer_label(r.challenge.model_node)}="
                                            f"{r.score / MICRO:.3f}" for r in ordered))

    def send_window(self) -> float:
        """Seconds after its attempt's start over which a leader spreads its challenges: the
        epoch (``epoch_ms``; ``attempt_ms`` when 0), cut so that the last challenge's deadline
        and :data:`REPORT_MARGIN_S` still fall within the attempt (``attempt_ms`` >=
        ``epoch_ms`` + timeout + margin spreads them over the whole epoch); 0 when not
        ``spread``. Users' requests reach a node all through the epoch: challenges sent at its
        start would stand out by their time alone (docs/verification.md)."""
        if not self.spread:
            return 0.0
        epoch_ms = self.params.epoch_ms or self.params.attempt_ms
        usable_ms = self.params.attempt_ms - (self.challenge_timeout + REPORT_MARGIN_S) * 1000
        return max(0.0, min(epoch_ms, usable_ms) / 1000)

    def _request(self, secret: bytes, epoch: int, attempt: int,
                 challenge: epochs.Challenge, mix: ChallengeMix) -> ChallengeRequest:
        return derive_request(secret, epoch, attempt, challenge,
                              self.pool[challenge.prompt_index], mix)

    async def _scored_prompt(self, request: ChallengeRequest) -> str:
        """The text the model node generated after: the prompt, or the chat rendered by the
        model's chat template (as the model node renders it)."""
        if request.messages:
            return await self.engine.chat_prompt(request.messages)
        return request.prompt

    def _rotate(self) -> None:
        if self.rotate_paths is not None:
            self.rotate_paths()
            self._paths.rotated()

    async def _send(self, request: ChallengeRequest, node: bytes) -> Any:
        """Ask ``node`` over paths that carried no other challenge to it (:class:`ChallengePaths`)."""
        if self.rotate_paths is not None and self._paths.before(node):
            self.rotate_paths()
        return await self._ask(request, node, self.challenge_timeout)

    async def _challenge(self, ledger: EpochLedger, challenge: epochs.Challenge,
                         request: ChallengeRequest) -> ChallengeResult:
        self.stats.challenges_sent += 1
        started = trio.current_time()
        answer = await self._send(request, challenge.model_node)
        log.debug("challenge to %s took %.2f s", peer_label(challenge.model_node),
                  trio.current_time() - started)
        signed = self._signed_answer(answer, ledger, challenge.model_node)
        if signed is None:
            return ChallengeResult(challenge, 0, None)
        try:
            score = await self._score(await self._scored_prompt(request), request, signed,
                                      challenge.prompt_index)
        except (PsError, ValueError) as exc:  # e.g. a prompt the reference cannot take, a
            # temperature its scoring does not cover: no verdict
            log.warning("cannot score the answer of %s: %s", peer_label(challenge.model_node),
                        exc)
            return ChallengeResult(challenge, 0, None)
        return ChallengeResult(challenge, score, signed, greedy=request.temperature == 0)

    def _signed_answer(self, answer: object, ledger: EpochLedger,
                       challenged: bytes) -> SignedAnswer | None:
        """The evidence of an answer, or None when it would not pass the chain's checks."""
        reply = getattr(answer, "reply", None)
        request = getattr(answer, "request", b"")
        if not getattr(answer, "ok", False) or reply is None or not request:
            log.info("challenge to %s unanswered: %s", peer_label(challenged),
                     getattr(answer, "error", "") or "no reply")
            return None
        try:
            if reply.request_hash != request_hash(request):
                raise VerificationError("the answer signs another request than the one sent")
            signed = self._seal(request, reply)
            problem = _unfit(signed)
            if problem is not None:  # a report carrying it would be refused: no evidence
                raise VerificationError(f"a report cannot carry it ({problem})")
            server = signed.verify(challenged)
            if ledger.subject_of(server) is None:
                raise VerificationError(f"served by {peer_label(server)}, not challenged")
            epochs.check_response_time(reply.signed_at_ms, ledger.start_ms, self._unix_ms())
        except VerificationError as exc:
            log.warning("answer of %s is no evidence: %s", peer_label(challenged), exc)
            return None
        return signed

    def _seal(self, request: bytes, reply: InferenceReply) -> SignedAnswer:
        """The answer as a report carries it: Q sealed for the committee."""
        return SignedAnswer(seal_request(self._committee_key, reply.request_hash, request), reply)

    async def _score(self, prompt: str, option: SamplingOption, answer: SignedAnswer,
                     pool_index: int | None = None) -> int:
        """The challenge score (:func:`~ps_p2p.verification.scoring.score_challenge`): the
        answer against the asked sampling parameters, its claimed end, and decoy prompts of the
        pool drawn from the signed request hash (the same ones on every verifier)."""
        reply = answer.reply
        # the pool entry asked is never one of its own decoys (a chat's scored prompt is its
        # rendered template, not the entry: the caller names the entry)
        asked = self._pool_index.get(prompt, -1) if pool_index is None else pool_index
        decoys = [self.pool[i] for i in decoy_indices(
            reply.request_hash, len(self.pool), asked,
            self.challenge_scoring.decoys)]
        score = await score_challenge(
            self.engine, prompt, reply.text, temperature=option.temperature,
            top_p=option.top_p, max_tokens=option.max_tokens, finish_reason=reply.finish_reason,
            stop=tuple(getattr(option, "stop", ()) or ()), decoys=decoys,
            params=self.challenge_scoring)
        self.stats.answers_scored += 1
        return round(score * MICRO)

    # ------------------------------------------------------------------ re-scoring

    async def _check_worker(self) -> None:
        async for raw in self._checks_receive:
            key = _tx_key(raw)
            try:
                reason = await self._check_report(raw)
            except PsError as exc:
                reason = str(exc)
            except Exception as exc:  # a bug here must not take the verifier down
                log.exception("re-scoring an epoch report failed")
                reason = f"re-scoring failed: {exc}"
            self._checking.discard(key)
            self._remember(key, reason)
            if reason is None:
                self.stats.reports_agreed += 1
            else:
                self.stats.reports_refused += 1
                self.stats.last_refusal = reason
                log.warning("epoch report %s refused by this verifier: %s", key.hex()[:12],
                            reason)
            if self.on_verdict is not None:
                self.on_verdict()
            self._wake.set()

    async def _check_report(self, raw: bytes) -> str | None:
        """This verifier's check of one report: None (agreed) or the reason."""
        try:
            tx = self._txs.decode_tx(raw, 1 << 30)
        except InvalidTransactionError as exc:
            return str(exc)
        if not isinstance(tx, EpochReportTx):
            return None
        # the report is pending: the committed mix is still its epoch's (it changes only when
        # an epoch's report executes)
        mix = self.mix_for(self._state().ledger)
        for res in tx.results:
            if res.answer is None:
                continue
            c = res.challenge
            if c.sampling >= len(self.params.sampling) or c.prompt_index >= len(self.pool):
                return f"challenge {c} is outside the pool or the sampling menu"
            request = derive_request(tx.secret, tx.epoch, tx.attempt, c,
                                     self.pool[c.prompt_index], mix)
            problem = self._request_problem(res.answer, request)
            if problem is None and res.greedy != (request.temperature == 0):
                problem = (f"marked {'greedy' if res.greedy else 'sampled'}, but its request "
                           f"asks temperature {request.temperature}")
            if problem is not None:
                return f"challenge of {peer_label(c.model_node)}: {problem}"
            own = await self._score(await self._scored_prompt(request), request, res.answer,
                                    c.prompt_index)
            if abs(own - res.score) > self.params.tolerance * MICRO:
                return (f"score {res.score / MICRO:.4f} for {peer_label(c.model_node)} is off "
                        f"this verifier's {own / MICRO:.4f} by more than "
                        f"{self.params.tolerance}")
        return None

    def _request_problem(self, answer: SignedAnswer, expected: ChallengeRequest) -> str | None:
        try:
            request = open_request(self._committee_key, answer.reply.request_hash,
                                   answer.sealed_request)
        except VerificationError as exc:
            return str(exc)
        try:
            q = decode_query(request)
        except PsError as exc:
            return f"the request is not a request: {exc}"
        if q.request_id != answer.reply.request_id:
            return "the answer is for another request ID than the request's"
        return request_problem(q, expected, self.params.model_id)

    def _remember(self, key: bytes, verdict: str | None) -> None:
        self._verdicts[key] = verdict
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)

    # ------------------------------------------------------------------ misses

    async def _confirm(self, state: Any, epoch: int, node: bytes) -> None:
        """Challenge an open miss ourselves (a prompt and option of our own drawing); report it
        only when that fails too."""
        self.stats.confirmations += 1
        used = state.ledger.excluded_prompts() | self._confirm_prompts
        unused = [i for i in range(len(self.pool)) if i not in used]
        index = self._rng.choice(unused) if unused else self._rng.randrange(len(self.pool))
        self._confirm_prompts.add(index)  # not on the chain: plans may still draw it
        # a user-shaped request under a secret of its own (no report ever carries it)
        request = derive_request(self._rng.randbytes(epochs.SECRET_BYTES), epoch, 0,
                                 epochs.Challenge(node, index), self.pool[index],
                                 self.mix_for(state.ledger))
        answer = await self._send(request, node)
        reply = getattr(answer, "reply", None)
        request = getattr(answer, "request", b"")
        problem = None
        if getattr(answer, "ok", False) and reply is not None:
            # an answer no report could carry is no answer (as for the leader), unless the
            # oversized part is our own request
            # (the user client checked that the reply signs our request; sealing keeps length)
            problem = _unfit(SignedAnswer(bytes(len(request) + SEAL_OVERHEAD), reply))
            if problem is None or len(request) > MAX_REQUEST_BYTES:
                log.info("%s answered this verifier's confirmation of its epoch-%d miss",
                         peer_label(node), epoch)
                return
            log.info("%s answered this verifier's confirmation of its epoch-%d miss with no "
                     "evidence: %s", peer_label(node), epoch, problem)
        error = getattr(answer, "exception", None)
        if problem is None and not isinstance(error, MISS_ERRORS):
            # our side failed (no path, the node not in our directory yet, overloaded: a
            # signed answer): no evidence against the node
            log.info("confirmation of %s's epoch-%d miss inconclusive: %s", peer_label(node),
                     epoch, getattr(answer, "error", "") or "no answer")
            return
        tx = sign_miss_report(self.identity, state.chain_id, epoch, node)
        if self._try_submit(self._txs.encode_tx(tx), f"miss report of {peer_label(node)}"):
            self.stats.misses_reported += 1
            log.info("reported %s: no answer to its epoch-%d challenge nor to ours (%s)",
                     peer_label(node), epoch, problem or getattr(answer, "error", ""))


def _fit_report(results: list[ChallengeResult], excess: int,
                epoch: int) -> list[ChallengeResult]:
    """``results`` with the longest answers listed as unanswered until the report is at least
    ``excess`` bytes shorter (or none is left)."""
    results = list(results)
    answered = sorted((i for i, r in enumerate(results) if r.answer is not None),
                      key=lambda i: -len(results[i].answer.encode()))  # type: ignore[union-attr]
    for i in answered:
        if excess <= 0:
            break
        res = results[i]
        assert res.answer is not None
        size = len(res.answer.encode())
        log.warning("epoch %d report: leaving out the %d-byte answer of %s (the report is over "
                    "the genesis' max_tx_bytes)", epoch, size, peer_label(res.challenge.model_node))
        results[i] = ChallengeResult(res.challenge, 0, None)
        excess -= size
    return results


def _unfit(answer: SignedAnswer) -> str | None:
    """Why a report cannot carry ``answer`` (a field over the ledger's bounds: a model node
    signs its text, model ID and finish reason itself), or None. A report carrying it would be
    refused whole, and the epoch would not end."""
    try:
        SignedAnswer.read(Reader(answer.encode(), RemoteProtocolError, "answer"))
    except RemoteProtocolError as exc:
        return str(exc)
    return None


def load_pool(paths: Sequence[str], limit: int | None = None) -> list[str]:
    """The prompt pool from prompt files (:func:`ps_p2p.prompts.load_prompts`), in order.

    Raises:
        ConfigError: a file cannot be read or holds no prompt.
    """
    from ps_p2p.prompts import load_prompts

    pool: list[str] = []
    for path in paths:
        pool += [p.text for p in load_prompts(path)]
    return pool[:limit] if limit else pool


__all__ = ["ChallengePaths", "EpochService", "EpochStats", "TxCodec", "load_pool", "master_key", "overlay_ask"]
