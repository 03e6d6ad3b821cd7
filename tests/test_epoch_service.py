"""A committee verifier's challenge epochs (ps_p2p.verification.service, PlanetServe sec. 3.4,
Algorithm 3): re-scoring reports for the validator's value check on the real stories260K model,
seed commitments and leading against the chain's ledger, confirming misses, the challenge's
request bytes against a user's, and a committee of four taking a dishonest model node out of
users' reach on a localnet."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pathlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from ps_p2p import registry as app
from ps_p2p.consensus.block import BlockLimits, make_block
from ps_p2p.consensus.types import Validator
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.engines.base import Engine
from ps_p2p.engines.base import SamplingParams as EngineParams
from ps_p2p.errors import (
    ConfigError,
    ModelNodeLostError,
    NoModelNodeError,
    NoPathError,
    OverloadedError,
    RequestTimeoutError,
)
from ps_p2p.inference import ChatMessage, InferenceQuery, InferenceReply, ReplyProxy
from ps_p2p.inference import SamplingParams as QueryParams
from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import inference_pb2
from ps_p2p.protocols.inference_codec import decode_query, encode_query
from ps_p2p.records import NodeRecord, Role, reputation_subject, sign_record
from ps_p2p.responses import ResponseContent, sign_response
from ps_p2p.roles.user import Answer
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.verification import epochs
from ps_p2p.verification.challenges import (
    ChallengeMix,
    ChallengeRequest,
    derive_request,
)
from ps_p2p.verification.ledger import (
    ChallengeResult,
    EpochLedger,
    EpochReportTx,
    MissReportTx,
    SamplingOption,
    SeedCommitTx,
    SignedAnswer,
    VerificationParams,
    check_miss_report,
    pool_digest,
    sign_epoch_report,
    sign_seed_commit,
)
from ps_p2p.verification.scoring import (
    DEFAULT_CHALLENGE_SCORING,
    decoy_indices,
    score_challenge,
)
from ps_p2p.verification.sealing import key_commitment, open_request, seal_request
from ps_p2p.verification.service import (
    MAX_PENDING_CHECKS,
    MAX_VERDICTS,
    NOT_YET,
    RESUBMIT_SECONDS,
    EpochService,
    master_key,
    overlay_ask,
)

MICRO = app.MICRO
CHAIN = "epoch-service-test"
T0 = 1_700_000_000_000  # genesis time, unix ms
HOUR = 3_600_000
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
VALIDATORS = tuple(Validator(k.peer_id) for k in KEYS)
ME = KEYS[0]
MODEL = Identity.from_private_bytes(hashlib.sha256(b"model node").digest())
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
RID = bytes(range(16))
POOL = ["Once upon a time, there was a little girl named Lily.",
        "Tom had a big red ball. One day,",
        "The sun was hot and the dog was tired.",
        "A little bird sat on a tree and sang."]
GREEDY = SamplingOption(max_tokens=24)
WARM = SamplingOption(max_tokens=16, temperature=0.7, top_p=0.9)  # float32 on the wire
ATTEMPT_MS = 8000


def fixed_mix(*, max_tokens: int = 24, temperature: float = 0.0, top_p: float | None = None,
              chat: float = 0.0, stream: float = 0.0, seed: object = None,
              stop: object = None) -> ChallengeMix:
    """A distribution of challenge shapes with one value per field (the default: GREEDY's
    completion request, the bytes ``query`` builds)."""
    return ChallengeMix(chat=chat, stream_chat=stream, stream_completion=stream, system=0.0,
                        multi_turn=0.0, temperature=((temperature, 1.0),),
                        top_p=((top_p, 1.0),), max_tokens=((max_tokens, 1.0),),
                        seed=((seed, 1.0),), stop=((stop, 1.0),))


GREEDY_MIX = fixed_mix()
WARM_MIX = fixed_mix(max_tokens=16, temperature=0.7, top_p=0.9)


COMMITTEE_KEY = hashlib.sha256(b"test committee key").digest()


def verification(model_id: str, sampling=(GREEDY, WARM)) -> VerificationParams:
    return VerificationParams(model_id=model_id, pool_sha256=pool_digest(POOL),
                              pool_size=len(POOL), sampling=sampling, attempt_ms=ATTEMPT_MS,
                              committee_key_sha256=key_commitment(COMMITTEE_KEY))


#: the block limits of a chain that runs epochs (the localnet's): 1 MiB reports
REPORT_LIMITS = BlockLimits(max_block_bytes=4 << 20, max_tx_bytes=1 << 20)


def genesis_state(params: VerificationParams,
                  limits: BlockLimits = REPORT_LIMITS) -> app.AppState:
    return app.genesis_state(app.Genesis(CHAIN, T0, VALIDATORS, app.AdmissionPolicy(),
                                         limits=limits, verification=params))


def secret(who: Identity, epoch: int) -> bytes:
    return epochs.derive_secret(master_key(who.private_bytes()), CHAIN, epoch)


class Stubs:
    """The service's world: the committed state (settable), the mempool (a list), the overlay
    (``answer`` for every ask), the wall clock (``now_ms``)."""

    def __init__(self, state: app.AppState, answer: Answer | None = None) -> None:
        self.state = state
        self.submitted: list[bytes] = []
        self.asked: list[tuple[ChallengeRequest, bytes, float]] = []
        self.answer = answer or unanswered(RequestTimeoutError("no answer in time"))
        #: model node -> its answer (default: ``answer``)
        self.answers: dict[bytes, Answer] = {}
        self.now_ms = T0

    def submit(self, raw: bytes) -> None:
        app.check_tx(raw, self.state, self.now_ms)  # what the real mempool does first
        self.submitted.append(raw)

    async def ask(self, request: ChallengeRequest, node: bytes, timeout: float) -> Answer:
        self.asked.append((request, node, timeout))
        return self.answers.get(node, self.answer)

    def raws(self, kind: type) -> list[bytes]:
        """The submitted transactions of ``kind``, encoded."""
        return [raw for raw in self.submitted if isinstance(app.decode_tx(raw, 1 << 30), kind)]

    def txs(self, kind: type) -> list:
        """The submitted transactions of ``kind``."""
        return [app.decode_tx(raw, 1 << 30) for raw in self.raws(kind)]


def service(stubs: Stubs, engine: Engine, params: VerificationParams,
            identity: Identity = ME, *, mix: ChallengeMix = GREEDY_MIX,
            spread: bool = False) -> EpochService:
    return EpochService(
        identity, params, state=lambda: stubs.state, txs=app, submit=stubs.submit, ask=stubs.ask,
        engine=engine, pool=POOL, master=master_key(identity.private_bytes()),
        committee_key=COMMITTEE_KEY, challenge_timeout=30.0, unix_ms=lambda: stubs.now_ms,
        rng=random.Random(1), spread=spread, mix=mix)


@asynccontextmanager
async def running(svc: EpochService) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(svc.run)
        yield
        nursery.cancel_scope.cancel()


def unanswered(error: Exception) -> Answer:
    return Answer(request_id=RID, ok=False, error=f"{type(error).__name__}: {error}",
                  exception=error)


# ------------------------------------------------------------------------ the real model

_loaded: dict[pathlib.Path, Engine] = {}
_completions: dict[tuple[str, SamplingOption], object] = {}


@pytest.fixture
def engine(shared: pathlib.Path) -> Engine:
    """TransformersEngine on ../shared/models/stories260K, loaded once (do not close)."""
    pytest.importorskip("transformers")
    path = shared / "models" / "stories260K"
    if path not in _loaded:
        from ps_p2p.engines.transformers_engine import TransformersEngine

        _loaded[path] = TransformersEngine.load(path)
    return _loaded[path]


def query(prompt: str, model_id: str, *, option: SamplingOption = GREEDY, request_id: bytes = RID,
          messages: tuple[ChatMessage, ...] = ()) -> bytes:
    """Q's bytes as a user client sends them (four reply proxies)."""
    return encode_query(InferenceQuery(
        request_id=request_id, model_id=model_id, prompt=prompt,
        params=QueryParams(max_tokens=option.max_tokens, temperature=option.temperature,
                           top_p=option.top_p),
        reply_proxies=tuple(ReplyProxy(bytes([i]) * 38, bytes([i]) * 16) for i in range(4)),
        messages=messages))


async def honest_answer(engine: Engine, prompt: str, option: SamplingOption, *,
                        request: bytes | None = None, request_id: bytes = RID) -> SignedAnswer:
    """The model node's signed answer to Q (``request``; default: ``prompt`` at ``option``),
    produced by the real engine as a model node does."""
    key = (prompt, option)
    if key not in _completions:
        _completions[key] = await engine.complete(prompt, EngineParams(
            max_tokens=option.max_tokens, temperature=option.temperature, top_p=option.top_p,
            seed=7))
    c = _completions[key]
    request = query(prompt, engine.model_id, option=option) if request is None else request
    content = ResponseContent(0, c.text, "", engine.model_id, c.prompt_tokens,
                              c.completion_tokens, c.finish_reason)
    signed_at = T0 + 5000
    signature = sign_response(MODEL, request_id, hashlib.sha256(request).digest(), content,
                              signed_at)
    sealed = seal_request(COMMITTEE_KEY, hashlib.sha256(request).digest(), request)
    return SignedAnswer(sealed, InferenceReply(
        request_id, 0, c.text, "", engine.model_id, c.prompt_tokens, c.completion_tokens,
        hashlib.sha256(request).digest(), signed_at, MODEL.peer_id, signature, c.finish_reason))


async def reference_score(engine: Engine, params: VerificationParams, prompt: str,
                          option: SamplingOption | ChallengeRequest, answer: SignedAnswer, *,
                          pool: list[str] = POOL, asked: int | None = None) -> int:
    """The score every verifier computes (the challenge scorer at ``option``'s sampling
    parameters and stops, decoys drawn from the signed request hash among ``pool``'s entries
    other than the one asked: ``asked``, default ``prompt``'s index; a chat's ``prompt`` is its
    rendered template, so its caller names the entry)."""
    reply = answer.reply
    asked = pool.index(prompt) if asked is None else asked
    decoys = [pool[i] for i in decoy_indices(reply.request_hash, len(pool), asked,
                                             DEFAULT_CHALLENGE_SCORING.decoys)]
    score = await score_challenge(
        engine, prompt, reply.text, temperature=option.temperature, top_p=option.top_p,
        max_tokens=option.max_tokens, finish_reason=reply.finish_reason,
        stop=tuple(getattr(option, "stop", ())), decoys=decoys)
    return round(score * MICRO)


def report(*results: ChallengeResult) -> bytes:
    """A leader's (KEYS[1]) EPOCH_REPORT of epoch 1, attempt 0."""
    return app.encode_tx(sign_epoch_report(KEYS[1], CHAIN, 1, 0, secret(KEYS[1], 1), results))


async def verdict(svc: EpochService, raw: bytes) -> str | None:
    """The service's verdict on ``raw``: "not re-scored yet" when first asked, then whatever the
    check worker found (awaited on the service's ``on_verdict`` hook)."""
    done = trio.Event()
    svc.on_verdict = done.set
    assert svc.value_check(raw) == NOT_YET
    while (answer := svc.value_check(raw)) == NOT_YET:
        await done.wait()
        done = trio.Event()
        svc.on_verdict = done.set
    return answer


@pytest.mark.needs_shared
@pytest.mark.parametrize("sampling", [0, 1], ids=["greedy", "temperature-0.7"])
async def test_an_honest_report_is_not_yet_rescored_then_agreed(engine, sampling, autojump_clock):
    params = verification(engine.model_id)
    option = params.sampling[sampling]
    svc = service(Stubs(genesis_state(params)), engine, params,
                  mix=(GREEDY_MIX, WARM_MIX)[sampling])
    answer = await honest_answer(engine, POOL[0], option)
    score = await reference_score(engine, params, POOL[0], option, answer)
    assert score > 0
    other = epochs.Challenge(KEYS[3].peer_id, 1, 0)  # an unanswered challenge scores 0
    raw = report(ChallengeResult(epochs.Challenge(MODEL.peer_id, 0, sampling), score, answer,
                                 greedy=sampling == 0),
                 ChallengeResult(other, 0, None))
    async with running(svc):
        assert await verdict(svc, raw) is None
        assert svc.value_check(raw) is None  # remembered, not re-scored again
    assert svc.stats.reports_agreed == 1 and svc.stats.answers_scored == 1


#: a user-shaped challenge the verifier used to refuse: a streamed chat (system prompt, an
#: earlier exchange) with a seed and stop strings, sampled at T = 0.7
CHAT_MIX = dataclasses.replace(
    fixed_mix(max_tokens=16, temperature=0.7, top_p=0.95, chat=1.0, stream=1.0, seed="random",
              stop="list"), system=1.0, multi_turn=1.0)


@pytest.mark.needs_shared
async def test_a_streamed_chat_challenge_with_a_seed_and_stops_is_rescored_and_agreed(
        engine, autojump_clock):
    from ps_p2p.verification.challenges import encode_entry

    pool = [encode_entry(POOL[0], ("Tell me a story.", "Once upon a time, a cat sat."))]
    params = dataclasses.replace(verification(engine.model_id), pool_sha256=pool_digest(pool),
                                 pool_size=1)
    challenge = epochs.Challenge(MODEL.peer_id, 0, 0)
    request = derive_request(secret(KEYS[1], 1), 1, 0, challenge, pool[0], CHAT_MIX)
    assert request.messages and request.stream and request.seed and request.stop
    # the model node's answer: the chat rendered by the model's template, cut at the stops
    rendered = await engine.chat_prompt(request.messages)
    c = await engine.complete(rendered, EngineParams(
        max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
        seed=request.seed))
    text = min((c.text.split(s)[0] for s in request.stop), key=len)
    q = encode_query(InferenceQuery(
        request_id=RID, model_id=engine.model_id, prompt="", params=request.params,
        reply_proxies=tuple(ReplyProxy(bytes([i]) * 38, bytes([i]) * 16) for i in range(4)),
        stream=True, messages=request.messages))
    finish = "stop" if text != c.text else c.finish_reason
    content = ResponseContent(0, text, "", engine.model_id, c.prompt_tokens, 5, finish)
    h = hashlib.sha256(q).digest()
    answer = SignedAnswer(seal_request(COMMITTEE_KEY, h, q), InferenceReply(
        RID, 0, text, "", engine.model_id, c.prompt_tokens, 5, h, T0 + 5000, MODEL.peer_id,
        sign_response(MODEL, RID, h, content, T0 + 5000), finish))
    score = await reference_score(engine, params, rendered, request, answer, pool=pool, asked=0)
    assert score > 0
    stubs = Stubs(genesis_state(params))
    svc = EpochService(
        ME, params, state=lambda: stubs.state, txs=app, submit=stubs.submit, ask=stubs.ask,
        engine=engine, pool=pool, master=master_key(ME.private_bytes()),
        committee_key=COMMITTEE_KEY, unix_ms=lambda: stubs.now_ms, mix=CHAT_MIX)
    async with running(svc):
        assert await verdict(svc, report(ChallengeResult(challenge, score, answer))) is None


class DecoyRecorder(InstantEngine):
    """:class:`InstantEngine` that records the texts it tokenizes (the scorer tokenizes each
    decoy prompt)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenized: list[str] = []

    async def tokenize(self, text: str) -> list[int]:
        self.tokenized.append(text)
        return await super().tokenize(text)


async def test_a_chat_challenge_is_never_scored_against_its_own_pool_entry_as_a_decoy(
        autojump_clock):
    # a chat is scored after its rendered template, which is no pool entry: the verifier names
    # the entry asked, so its decoys are the pool's other entries
    from ps_p2p.verification.challenges import encode_entry

    pool = [encode_entry(POOL[0], ("Tell me a story.", "Once upon a time, a cat sat.")), POOL[1]]
    params = dataclasses.replace(verification("fake-model"), pool_sha256=pool_digest(pool),
                                 pool_size=len(pool))
    challenge = epochs.Challenge(MODEL.peer_id, 0, 0)
    request = derive_request(secret(KEYS[1], 1), 1, 0, challenge, pool[0], CHAT_MIX)
    assert request.messages and request.temperature > 0  # sampled: scored against decoys
    engine = DecoyRecorder()
    rendered = await engine.chat_prompt(request.messages)
    text = engine.answer_for(rendered, request.max_tokens)
    q = encode_query(InferenceQuery(
        request_id=RID, model_id="fake-model", prompt="", params=request.params,
        reply_proxies=tuple(ReplyProxy(bytes([i]) * 38, bytes([i]) * 16) for i in range(4)),
        stream=request.stream, messages=request.messages))
    content = ResponseContent(0, text, "", "fake-model", len(rendered), len(text), "length")
    h = hashlib.sha256(q).digest()
    answer = SignedAnswer(seal_request(COMMITTEE_KEY, h, q), InferenceReply(
        RID, 0, text, "", "fake-model", len(rendered), len(text), h, T0 + 5000, MODEL.peer_id,
        sign_response(MODEL, RID, h, content, T0 + 5000), "length"))
    score = await reference_score(InstantEngine(), params, rendered, request, answer, pool=pool,
                                  asked=0)
    stubs = Stubs(genesis_state(params))
    svc = EpochService(
        ME, params, state=lambda: stubs.state, txs=app, submit=stubs.submit, ask=stubs.ask,
        engine=engine, pool=pool, master=master_key(ME.private_bytes()),
        committee_key=COMMITTEE_KEY, unix_ms=lambda: stubs.now_ms, mix=CHAT_MIX)
    async with running(svc):
        assert await verdict(svc, report(ChallengeResult(challenge, score, answer))) is None
    assert pool[1] in engine.tokenized and pool[0] not in engine.tokenized


@pytest.mark.needs_shared
async def test_a_score_within_the_tolerance_is_agreed_and_one_beyond_it_refused_naming_it(
        engine, autojump_clock):
    params = verification(engine.model_id)
    answer = await honest_answer(engine, POOL[0], GREEDY)
    honest = await reference_score(engine, params, POOL[0], GREEDY, answer)
    slack = round(params.tolerance * MICRO)
    sign = -1 if honest + slack + 1 > MICRO else 1
    near, lie = honest + sign * (slack // 2), honest + sign * (slack + 1)
    challenge = epochs.Challenge(MODEL.peer_id, 0, 0)
    svc = service(Stubs(genesis_state(params)), engine, params)
    async with running(svc):
        ok = report(ChallengeResult(challenge, near, answer, greedy=True))
        assert await verdict(svc, ok) is None
        reason = await verdict(svc, report(ChallengeResult(challenge, lie, answer, greedy=True)))
    assert reason is not None and f"score {lie / MICRO:.4f}" in reason
    assert f"{honest / MICRO:.4f}" in reason
    assert svc.stats.reports_refused == 1 and svc.stats.last_refusal == reason


@pytest.mark.needs_shared
async def test_a_greedy_answer_reported_as_sampled_is_refused(engine, autojump_clock):
    """Only greedy scores cap a node's epoch score (ledger.subject_scores): a leader hiding a
    greedy answer's low score among the sampled ones (or the reverse) is refused."""
    params = verification(engine.model_id)
    answer = await honest_answer(engine, POOL[0], GREEDY)
    score = await reference_score(engine, params, POOL[0], GREEDY, answer)
    challenge = epochs.Challenge(MODEL.peer_id, 0, 0)
    svc = service(Stubs(genesis_state(params)), engine, params)  # GREEDY_MIX: T = 0 sent
    async with running(svc):
        reason = await verdict(svc, report(ChallengeResult(challenge, score, answer)))
    assert reason is not None and "marked sampled" in reason and "temperature 0.0" in reason


def _other_prompt(model_id: str) -> tuple[bytes, bytes]:
    return query(POOL[1], model_id), RID


def _chat(model_id: str) -> tuple[bytes, bytes]:
    return query("", model_id, messages=(ChatMessage("user", POOL[0]),)), RID


def _more_tokens(model_id: str) -> tuple[bytes, bytes]:
    return query(POOL[0], model_id, option=dataclasses.replace(GREEDY, max_tokens=25)), RID


def _warmer(model_id: str) -> tuple[bytes, bytes]:
    return query(POOL[0], model_id, option=dataclasses.replace(GREEDY, temperature=0.5)), RID


def _top_p(model_id: str) -> tuple[bytes, bytes]:
    return query(POOL[0], model_id, option=dataclasses.replace(GREEDY, top_p=0.9)), RID


def _seeded(model_id: str) -> tuple[bytes, bytes]:
    return encode_query(dataclasses.replace(decode_query(query(POOL[0], model_id)), params=(
        QueryParams(max_tokens=24, seed=7)))), RID


def _stopped(model_id: str) -> tuple[bytes, bytes]:
    return encode_query(dataclasses.replace(decode_query(query(POOL[0], model_id)), params=(
        QueryParams(max_tokens=24, stop=("\n",))))), RID


def _streamed(model_id: str) -> tuple[bytes, bytes]:
    return encode_query(dataclasses.replace(decode_query(query(POOL[0], model_id)),
                                            stream=True)), RID


def _other_model(model_id: str) -> tuple[bytes, bytes]:
    return query(POOL[0], "other-model"), RID


def _other_request_id(model_id: str) -> tuple[bytes, bytes]:
    return query(POOL[0], model_id), bytes(16)  # the answer names another request


def _not_a_request(model_id: str) -> tuple[bytes, bytes]:
    return b"\xff\xff\xff", RID


@pytest.mark.needs_shared
@pytest.mark.parametrize("make, reason", [
    (_other_prompt, "does not ask the planned prompt"),
    (_chat, "does not ask the planned prompt"),
    (_more_tokens, "sampling parameters are not the planned ones"),
    (_warmer, "sampling parameters are not the planned ones"),
    (_top_p, "sampling parameters are not the planned ones"),
    (_seeded, "sampling parameters are not the planned ones"),
    (_stopped, "sampling parameters are not the planned ones"),
    (_streamed, "not streamed as planned"),
    (_other_model, "asks model 'other-model'"),
    (_other_request_id, "another request ID"),
    (_not_a_request, "the request is not a request"),
], ids=lambda x: getattr(x, "__name__", "")[1:])
async def test_a_report_whose_request_is_not_the_planned_challenge_is_refused(
        engine, make, reason, autojump_clock):
    params = verification(engine.model_id)
    request, request_id = make(engine.model_id)
    answer = await honest_answer(engine, POOL[0], GREEDY, request=request, request_id=request_id)
    score = await reference_score(engine, params, POOL[0], GREEDY, answer)  # the right score
    svc = service(Stubs(genesis_state(params)), engine, params)
    async with running(svc):
        got = await verdict(svc, report(
            ChallengeResult(epochs.Challenge(MODEL.peer_id, 0, 0), score, answer, greedy=True)))
    assert got is not None and reason in got
    assert svc.stats.answers_scored == 0  # refused before any forward pass


def _resealed(answer: SignedAnswer, key: bytes) -> SignedAnswer:
    """``answer`` with its request opened and sealed again under ``key``."""
    request = open_request(COMMITTEE_KEY, answer.reply.request_hash, answer.sealed_request)
    return SignedAnswer(seal_request(key, answer.reply.request_hash, request), answer.reply)


@pytest.mark.needs_shared
@pytest.mark.parametrize("tamper", [
    lambda a: _resealed(a, bytes(32)),
    lambda a: SignedAnswer(a.sealed_request[:-1] + bytes([a.sealed_request[-1] ^ 1]), a.reply),
    lambda a: SignedAnswer(query(POOL[0], "m"), a.reply),  # Q in clear
], ids=["another-key", "altered", "in-clear"])
async def test_a_report_whose_request_is_not_sealed_under_the_committee_key_is_refused(
        engine, tamper, autojump_clock):
    params = verification(engine.model_id)
    answer = await honest_answer(engine, POOL[0], GREEDY)
    score = await reference_score(engine, params, POOL[0], GREEDY, answer)
    svc = service(Stubs(genesis_state(params)), engine, params)
    challenge = epochs.Challenge(MODEL.peer_id, 0, 0)
    async with running(svc):
        assert await verdict(svc, report(ChallengeResult(challenge, score, answer, greedy=True))) is None
        got = await verdict(svc, report(ChallengeResult(challenge, score, tamper(answer), greedy=True)))
    assert got is not None and "does not open under the committee key" in got


@pytest.mark.parametrize("key, commitment, match", [
    (bytes(32), key_commitment(COMMITTEE_KEY), "not the one the genesis commits"),
    (COMMITTEE_KEY, "", "the genesis commits no committee key"),
    (COMMITTEE_KEY[:16], key_commitment(COMMITTEE_KEY), "a committee key is 32 bytes"),
], ids=["another-key", "none-committed", "short"])
def test_a_verifier_without_the_committed_committee_key_refuses_to_start(key, commitment, match):
    params = dataclasses.replace(verification("fake-model"), committee_key_sha256=commitment)
    stubs = Stubs(genesis_state(params))
    with pytest.raises(ConfigError, match=match):
        EpochService(ME, params, state=lambda: stubs.state, txs=app, submit=stubs.submit,
                     ask=stubs.ask,
                     engine=InstantEngine(), pool=POOL, master=master_key(ME.private_bytes()),
                     committee_key=key, unix_ms=lambda: stubs.now_ms)


@pytest.mark.needs_shared
@pytest.mark.parametrize("challenge", [
    epochs.Challenge(MODEL.peer_id, len(POOL), 0), epochs.Challenge(MODEL.peer_id, 0, 2)])
async def test_a_report_with_a_challenge_outside_the_pool_or_the_menu_is_refused(
        engine, challenge, autojump_clock):
    params = verification(engine.model_id)
    answer = await honest_answer(engine, POOL[0], GREEDY)
    svc = service(Stubs(genesis_state(params)), engine, params)
    async with running(svc):
        got = await verdict(svc, report(ChallengeResult(challenge, MICRO // 2, answer)))
    assert got is not None and "outside the pool or the sampling menu" in got


@pytest.mark.needs_shared
async def test_a_malformed_transaction_gets_a_reason(engine, autojump_clock):
    params = verification(engine.model_id)
    answer = await honest_answer(engine, POOL[0], GREEDY)
    good = report(ChallengeResult(epochs.Challenge(MODEL.peer_id, 0, 0), MICRO // 2, answer))
    svc = service(Stubs(genesis_state(params)), engine, params)
    async with running(svc):
        for raw in (b"garbage", good[:-7], good + b"\x00"):
            got = await verdict(svc, raw)
            assert got is not None and got != NOT_YET
    assert svc.stats.reports_refused == 3 and svc.stats.answers_scored == 0


async def test_the_verdict_cache_is_bounded_the_oldest_verdict_going_first(autojump_clock):
    params = verification("fake-model")
    svc = service(Stubs(genesis_state(params)), InstantEngine(), params)
    raws = [b"not a transaction %d" % i for i in range(MAX_VERDICTS + 1)]
    async with running(svc):
        for raw in raws:
            await verdict(svc, raw)
        assert len(svc._verdicts) == MAX_VERDICTS
        assert svc.value_check(raws[-1]) not in (None, NOT_YET)  # still known
        assert svc.value_check(raws[0]) == NOT_YET  # forgotten: checked again


async def test_more_reports_than_the_check_queue_holds_are_refused_busy_until_room(
        autojump_clock):
    params = verification("fake-model")
    svc = service(Stubs(genesis_state(params)), InstantEngine(), params)
    raws = [b"not a transaction %d" % i for i in range(MAX_PENDING_CHECKS + 2)]
    async with running(svc):
        first = [svc.value_check(raw) for raw in raws]  # no checkpoint: the worker waits
        assert first[0] == NOT_YET and first[-1] == "busy re-scoring other reports"
        await trio.testing.wait_all_tasks_blocked()
        assert await verdict(svc, raws[-1]) not in (None, NOT_YET)  # queued once there is room


# --------------------------------------------------------------- commitments and leading


def model_record(model_id: str, who: Identity = MODEL) -> bytes:
    host = who.peer_id[-1]
    return app.encode_tx(app.RegisterTx(sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.0.{host}.1/tcp/4001",), frozenset({Role.MODEL}), ONION,
        model_id=model_id, issued_at_ms=T0, expires_at_ms=T0 + HOUR))))


def execute(state: app.AppState, txs: list[bytes], time_ms: int) -> app.AppState:
    block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=time_ms,
                       prev_block_id=state.block_id, app_hash=state.app_hash,
                       proposer=KEYS[0].peer_id, txs=txs)
    new, result = app.execute_block(state, block)
    assert [r.error for r in result.tx_results] == [None] * len(txs)
    return new


def commit(who: Identity, epoch: int) -> bytes:
    c = epochs.seed_commitment(CHAIN, epoch, who.peer_id, secret(who, epoch))
    return app.encode_tx(sign_seed_commit(who, CHAIN, epoch, c))


async def settle(svc: EpochService | None = None) -> None:
    """Let every task run until all wait (after a committed block's notification)."""
    if svc is not None:
        svc.notify()
    await trio.testing.wait_all_tasks_blocked()


async def test_seed_commitments_the_ledger_lacks_are_submitted_and_not_resubmitted_too_soon(
        mock_clock):
    params = verification("fake-model")
    stubs = Stubs(genesis_state(params))
    svc = service(stubs, InstantEngine(), params)

    def committed_epochs() -> list[int]:
        return [c.epoch for c in stubs.txs(SeedCommitTx)]

    async with running(svc):
        await settle()
        commits = stubs.txs(SeedCommitTx)
        # before epoch 1 starts: a commitment for it and for epoch 2, each opening to this
        # verifier's derived secret (a restarted verifier commits the same)
        assert [(c.validator, c.epoch) for c in commits] == [(ME.peer_id, 1), (ME.peer_id, 2)]
        for c in commits:
            epochs.check_reveal(c.commitment, CHAIN, c.epoch, ME.peer_id, secret(ME, c.epoch))
        await settle(svc)  # a block committed without them: not again so soon
        mock_clock.jump(RESUBMIT_SECONDS - 0.1)
        await settle(svc)
        assert committed_epochs() == [1, 2]
        mock_clock.jump(0.1)
        await settle(svc)
        assert committed_epochs() == [1, 2, 1, 2]
        # epoch 1 starts with this verifier's commitment for it (and two others'), none for 2
        stubs.state = execute(stubs.state, [model_record("fake-model"), commit(ME, 1),
                                            commit(KEYS[1], 1), commit(KEYS[2], 1)], T0 + 1000)
        assert stubs.state.ledger.started
        await settle(svc)
        assert committed_epochs() == [1, 2, 1, 2]  # epoch 2's went out just now
        mock_clock.jump(RESUBMIT_SECONDS)
        await settle(svc)
        assert committed_epochs() == [1, 2, 1, 2, 2]  # not epoch 1's: it started
        stubs.state = execute(stubs.state, stubs.raws(SeedCommitTx)[-1:], T0 + 2000)
        mock_clock.jump(RESUBMIT_SECONDS)
        await settle(svc)
        assert committed_epochs() == [1, 2, 1, 2, 2]  # the ledger holds both: nothing more
    assert svc.stats.commits == 5


def started_epoch(params: VerificationParams, models: tuple[Identity, ...] = (MODEL,),
                  **limits: int) -> tuple[app.AppState, int, int]:
    """A state whose epoch 1 started with ME, KEYS[1], KEYS[2] eligible and ``models``
    challenged, the anchor chosen so that ME does not lead attempt 0; (state, an attempt ME
    leads, one before it that another validator leads). ``limits``: the genesis' block limits
    (default 1 MiB transactions)."""
    state = genesis_state(params, BlockLimits(**limits)) if limits else genesis_state(params)
    state = execute(state, [commit(k, 1) for k in KEYS[:3]] + [commit(ME, 2)], T0 + 1000)
    for t in range(T0 + 2000, T0 + 3000):
        started = execute(state, [model_record(params.model_id, m) for m in models], t)
        assert started.ledger.started
        leaders = [started.ledger.leader(a) for a in range(16)]
        if leaders[0] != ME.peer_id and ME.peer_id in leaders:
            mine = leaders.index(ME.peer_id)
            return started, mine, mine - 1
    raise AssertionError("no anchor found")  # pragma: no cover


async def test_it_leads_exactly_the_attempts_the_ledger_draws_it_for(mock_clock):
    params = verification("fake-model", sampling=(GREEDY,))
    state, mine, other = started_epoch(params)
    ledger = state.ledger
    assert ledger.leader(other) != ME.peer_id
    stubs = Stubs(state)
    svc = service(stubs, InstantEngine(), params)
    async with running(svc):
        for attempt in (0, other):
            stubs.now_ms = ledger.start_ms + attempt * ATTEMPT_MS + 1
            await settle(svc)
            assert not stubs.asked and not stubs.txs(EpochReportTx)
        stubs.now_ms = ledger.start_ms + mine * ATTEMPT_MS + 1
        await settle(svc)
        plan = ledger.plan(CHAIN, params, mine, secret(ME, 1))
        assert sorted((r.prompt, n, r.max_tokens) for r, n, _ in stubs.asked) == sorted(
            (POOL[c.prompt_index], c.model_node, 24) for c in plan.challenges)
        assert {t for *_, t in stubs.asked} == {svc.challenge_timeout}
        [tx] = stubs.txs(EpochReportTx)
        assert (tx.epoch, tx.attempt, tx.leader) == (1, mine, ME.peer_id)
        assert tx.plan_challenges == plan.challenges
        assert all(r.answer is None and r.score == 0 for r in tx.results)
        [raw] = stubs.raws(EpochReportTx)
        assert svc.value_check(raw) is None  # its own scores
        asked = len(stubs.asked)
        await settle(svc)  # once per attempt
        stubs.now_ms += ATTEMPT_MS
        await settle(svc)  # and once per epoch
        assert len(stubs.asked) == asked and len(stubs.txs(EpochReportTx)) == 1
        # the committee executes the report: epoch 2, its misses this leader's own
        stubs.state = execute(stubs.state, [raw], stubs.now_ms)
        assert stubs.state.ledger.epoch == 2
        assert stubs.state.ledger.misses == {(1, MODEL.peer_id): frozenset({ME.peer_id})}
        await settle(svc)
        assert len(stubs.asked) == asked  # not confirming its own report's misses
    assert svc.stats.epochs_led == 1


async def test_a_leader_spreads_its_challenges_over_the_epoch_at_their_derived_times(
        autojump_clock):
    # users' requests reach a node all through an epoch: challenges all sent at its start
    # would be told apart by their arrival time alone (issue 18)
    params = dataclasses.replace(verification("fake-model", sampling=(GREEDY,)),
                                 challenges_per_node=4, epoch_ms=60_000, attempt_ms=120_000)
    state, mine, _ = started_epoch(params)
    ledger = state.ledger
    stubs = Stubs(state)
    begin_ms = ledger.start_ms + mine * params.attempt_ms
    start = trio.current_time()
    clock_ms = lambda: begin_ms + round((trio.current_time() - start) * 1000)
    svc = EpochService(
        ME, params, state=lambda: stubs.state, txs=app, submit=stubs.submit, ask=stubs.ask,
        engine=InstantEngine(), pool=POOL, master=master_key(ME.private_bytes()),
        committee_key=COMMITTEE_KEY, challenge_timeout=30.0, unix_ms=clock_ms, mix=GREEDY_MIX)
    assert svc.send_window() == 60.0  # the epoch: 120 s - (30 s + margin) leaves room for it
    sent: list[tuple[float, bytes]] = []
    ask = stubs.ask

    async def timed_ask(request: ChallengeRequest, node: bytes, timeout: float) -> Answer:
        sent.append((trio.current_time() - start, request.prompt))
        return await ask(request, node, timeout)

    svc._ask = timed_ask
    stubs.now_ms = begin_ms + 90_000  # the mempool's clock when the report comes
    with trio.fail_after(params.attempt_ms / 1000):
        async with running(svc):
            while not stubs.txs(EpochReportTx):
                await trio.sleep(1)
    plan = ledger.plan(CHAIN, params, mine, secret(ME, 1))
    due = sorted(derive_request(secret(ME, 1), 1, mine, c, POOL[c.prompt_index], GREEDY_MIX)
                 .send_fraction * 60 for c in plan.challenges)
    times = sorted(t for t, _ in sent)
    assert len(times) == 4 and times == pytest.approx(due, abs=1.0)
    assert times[-1] - times[0] > 5.0  # not a burst at the start


async def test_a_leader_never_sends_two_challenges_to_one_node_over_the_same_paths(mock_clock):
    # a model node sees the reply proxies in Q: a node's challenges of an epoch over one
    # generation of the leader's paths were its most linked requests (issue 18)
    params = dataclasses.replace(verification("fake-model", sampling=(GREEDY,)),
                                 challenges_per_node=3)
    state, mine, _ = started_epoch(params)
    stubs = Stubs(state)
    svc = service(stubs, InstantEngine(), params)
    events: list[bytes | None] = []  # a node asked, or None: the paths rotated
    svc.rotate_paths = lambda: events.append(None)
    ask = svc._ask

    async def recorded(request: ChallengeRequest, node: bytes, timeout: float) -> Answer:
        events.append(node)
        return await ask(request, node, timeout)

    svc._ask = recorded
    stubs.now_ms = state.ledger.start_ms + mine * ATTEMPT_MS + 1
    async with running(svc):
        await settle(svc)
    assert stubs.txs(EpochReportTx)
    asked = [n for n in events if n is not None]
    assert asked == [MODEL.peer_id] * 3
    generation: list[bytes] = []
    for node in events:
        if node is None:
            generation = []
        else:
            assert node not in generation, "two challenges to one node over the same paths"
            generation.append(node)
    assert events[-1] is None  # and after the report, which names the proxies


def signed_reply(stubs: Stubs, request: bytes, model_id: str = "fake-model", *,
                 text: str = "an answer", finish_reason: str = "stop",
                 model: Identity = MODEL) -> Answer:
    """An answer ``model`` signed over ``request`` (now, by the stub clock), as a user client
    returns it."""
    content = ResponseContent(0, text, "", model_id, 3, 2, finish_reason)
    req_hash = hashlib.sha256(request).digest()
    signature = sign_response(model, RID, req_hash, content, stubs.now_ms)
    reply = InferenceReply(request_id=RID, status=0, text=text, error="", model_id=model_id,
                           prompt_tokens=3, completion_tokens=2, request_hash=req_hash,
                           signed_at_ms=stubs.now_ms, model_node=model.peer_id,
                           signature=signature, finish_reason=finish_reason)
    return Answer(request_id=RID, ok=True, text=text, served_by=model.peer_id,
                  signature_valid=True, model_id=model_id, finish_reason=finish_reason,
                  reply=reply, request=request)


#: Signed answers whose fields the ledger's encoding cannot hold (a model node controls them).
UNFIT = {"finish-reason": {"finish_reason": "x" * 17}, "model-id": {"model_id": "m" * 257},
         "text": {"text": "a" * (64 * 1024 + 1)}}


@pytest.mark.parametrize("fields", [{}, *UNFIT.values()], ids=["fit", *UNFIT])
async def test_a_leader_carries_only_answers_a_report_can_hold_so_its_report_stays_valid(
        fields, mock_clock):
    # temperature 1: the fake engine's text-level score is enough
    params = verification("fake-model", sampling=(SamplingOption(24, temperature=1.0),))
    state, mine, _ = started_epoch(params)
    stubs = Stubs(state)
    stubs.now_ms = state.ledger.start_ms + mine * ATTEMPT_MS + 1
    [c] = state.ledger.plan(CHAIN, params, mine, secret(ME, 1)).challenges
    stubs.answer = signed_reply(stubs, query(POOL[c.prompt_index], "fake-model",
                                             option=params.sampling[0]), **fields)
    svc = service(stubs, InstantEngine(), params, mix=fixed_mix(temperature=1.0))
    async with running(svc):
        await settle(svc)
    assert len(stubs.asked) == 1
    [tx] = stubs.txs(EpochReportTx)  # passed the mempool's check_tx (Stubs.submit)
    [result] = tx.results
    if fields:  # no evidence: listed as unanswered, a miss for the others to confirm
        assert result.answer is None and result.score == 0
    else:
        assert result.answer is not None and result.answer.reply.text == "an answer"
        # the chain carries Q sealed for the committee: no prompt in clear (issue 16)
        [raw] = stubs.raws(EpochReportTx)
        assert all(p.encode() not in raw for p in POOL)
        assert open_request(COMMITTEE_KEY, result.answer.reply.request_hash,
                            result.answer.sealed_request) == stubs.answer.request
    execute(stubs.state, stubs.raws(EpochReportTx), stubs.now_ms)  # the committee takes it


@pytest.mark.parametrize("used, warned", [(0, "nearly exhausted"), (3, "exhausted")])
async def test_a_leader_warns_when_the_pool_runs_out_of_unused_prompts(used, warned, caplog,
                                                                      mock_clock):
    # 4 prompts, one challenge an epoch: fewer than POOL_WARN_EPOCHS epochs of unused prompts
    params = verification("fake-model", sampling=(GREEDY,))
    state, mine, _ = started_epoch(params)
    if used:
        state.ledger.recent = {0: tuple(range(used))}
    stubs = Stubs(state)
    stubs.now_ms = state.ledger.start_ms + mine * ATTEMPT_MS + 1
    svc = service(stubs, InstantEngine(), params)
    with caplog.at_level(logging.WARNING, logger="ps_p2p.verification.service"):
        async with running(svc):
            await settle(svc)
    [message] = [r.getMessage() for r in caplog.records if "challenge pool" in r.getMessage()]
    assert f"the challenge pool is {warned}: {len(POOL) - used - 1} unused" in message


async def test_the_longest_answers_are_left_out_until_the_report_fits_the_block_limits(
        mock_clock):
    # a model node signs its text's length: one answer alone can pass the genesis' default
    # 8 KiB per transaction
    params = verification("fake-model", sampling=(SamplingOption(24, temperature=1.0),))
    terse = Identity.from_private_bytes(hashlib.sha256(b"terse model node").digest())
    state, mine, _ = started_epoch(params, (MODEL, terse), max_tx_bytes=8 * 1024)
    stubs = Stubs(state)
    stubs.now_ms = state.ledger.start_ms + mine * ATTEMPT_MS + 1
    plan = state.ledger.plan(CHAIN, params, mine, secret(ME, 1))
    for c in plan.challenges:
        long = c.model_node == MODEL.peer_id
        stubs.answers[c.model_node] = signed_reply(
            stubs, query(POOL[c.prompt_index], "fake-model", option=params.sampling[0]),
            text="a" * (9000 if long else 40), model=MODEL if long else terse)
    svc = service(stubs, InstantEngine(), params, mix=fixed_mix(temperature=1.0))
    async with running(svc):
        await settle(svc)
    [raw] = stubs.raws(EpochReportTx)
    assert len(raw) <= 8 * 1024
    [tx] = stubs.txs(EpochReportTx)
    carried = {r.challenge.model_node: r.answer is not None for r in tx.results}
    assert carried == {MODEL.peer_id: False, terse.peer_id: True}
    execute(stubs.state, [raw], stubs.now_ms)


# ------------------------------------------------------------------------------ misses


def answered(text: str = "an answer", finish_reason: str = "stop") -> Answer:
    """A confirmation's answer as the user client returns it (signature checked there)."""
    reply = InferenceReply(request_id=RID, status=0, text=text, error="",
                           model_id="fake-model", prompt_tokens=3, completion_tokens=2,
                           request_hash=bytes(32), signed_at_ms=T0, model_node=MODEL.peer_id,
                           signature=bytes(64), finish_reason=finish_reason)
    return Answer(request_id=RID, ok=True, text=text, served_by=MODEL.peer_id,
                  signature_valid=True, reply=reply, request=query(POOL[0], "fake-model"))


@pytest.mark.parametrize("answer, reported", [
    (answered(), False),
    (answered(finish_reason="x" * 17), True),
    (answered(text="a" * (64 * 1024 + 1)), True),
    (unanswered(RequestTimeoutError("no answer in time")), True),
    (unanswered(ModelNodeLostError("the model node went away")), True),
    (unanswered(NoPathError("no ready path")), False),
    (unanswered(NoModelNodeError("not in the directory")), False),
    (unanswered(OverloadedError("OVERLOADED: queue full")), False),
], ids=["answered", "unfit-finish-reason", "unfit-text", "timeout", "lost", "no-path",
        "no-model-node", "overloaded"])
async def test_an_open_miss_is_confirmed_and_reported_only_when_the_node_misses_again(
        answer, reported, mock_clock):
    params = verification("fake-model")
    state = genesis_state(params)
    # another leader's report of epoch 1 left MODEL unanswered
    state.ledger = EpochLedger(epoch=2, misses={(1, MODEL.peer_id): frozenset({KEYS[1].peer_id})})
    stubs = Stubs(state, answer)
    svc = service(stubs, InstantEngine(), params)
    async with running(svc):
        await settle()
        await settle(svc)  # asked once, whatever the number of blocks
    [(request, node, timeout)] = stubs.asked
    assert node == MODEL.peer_id and request.text in POOL
    assert timeout == svc.challenge_timeout
    misses = stubs.txs(MissReportTx)
    assert svc.stats.confirmations == 1 and svc.stats.misses_reported == len(misses)
    if not reported:
        assert misses == []
        return
    [tx] = misses
    assert (tx.validator, tx.epoch, tx.model_node) == (ME.peer_id, 1, MODEL.peer_id)
    check_miss_report(tx, state.ledger, CHAIN, VALIDATORS)  # signed by this verifier


async def test_a_confirmation_asks_a_prompt_no_remembered_epoch_asked(mock_clock):
    # a model node that saw a prompt in an earlier challenge could flag it when it came back
    params = verification("fake-model")
    state = genesis_state(params)
    fresh = len(POOL) - 1
    state.ledger = EpochLedger(epoch=2, recent={1: tuple(range(fresh))},
                               misses={(1, MODEL.peer_id): frozenset({KEYS[1].peer_id})})
    stubs = Stubs(state)
    svc = service(stubs, InstantEngine(), params)
    async with running(svc):
        await settle(svc)
    [(request, *_)] = stubs.asked
    assert request.text == POOL[fresh]


async def test_a_counted_miss_or_one_already_reported_is_not_confirmed(mock_clock):
    params = verification("fake-model")
    state = genesis_state(params)
    other = Identity.from_private_bytes(b"\x09" * 32).peer_id
    state.ledger = EpochLedger(epoch=2, misses={
        (1, MODEL.peer_id): frozenset({KEYS[1].peer_id, KEYS[2].peer_id}),
        (1, other): frozenset({ME.peer_id})}, counted={(1, MODEL.peer_id)})
    stubs = Stubs(state)
    svc = service(stubs, InstantEngine(), params)
    async with running(svc):
        await settle(svc)
    assert stubs.asked == [] and svc.stats.confirmations == 0


# ------------------------------------------------------------------- the challenge's bytes


def _fields(message) -> list[tuple[int, str]]:
    """(field number, name) of the fields present in a parsed message."""
    return sorted((f.number, f.name) for f, _ in message.ListFields())


#: challenge shapes a user sends too: a plain prompt at the API's defaults, and a streamed chat
#: with a system prompt, an earlier exchange, a seed and stop strings at T = 1.5
SHAPES = [fixed_mix(max_tokens=128),
          dataclasses.replace(fixed_mix(max_tokens=32, temperature=1.5, top_p=0.95, chat=1.0,
                                        stream=1.0, seed="random", stop="list"),
                              system=1.0, multi_turn=1.0)]


@pytest.mark.parametrize("mix", SHAPES, ids=["prompt-defaults", "streamed-chat"])
async def test_a_challenge_request_is_shaped_like_any_users_request(mix):
    from ps_p2p.testing.localnet import open_localnet
    from ps_p2p.verification.challenges import encode_entry

    entry = encode_entry("Once upon a time there was a fox", ("Hi!", "Hello, how can I help?"))
    async with open_localnet(users=6) as net:
        verifier, user = net.users[0].user, net.users[1].user
        assert verifier is not None and user is not None
        target = net.users[0].directory.model_nodes()[0]
        request = derive_request(bytes(32), 1, 0, epochs.Challenge(target.peer_id, 0), entry,
                                 mix)
        pieces: list[str] = []
        with trio.fail_after(60):
            # what a verifier's EpochService sends (Node._start_epochs uses overlay_ask)
            challenge = await overlay_ask(verifier, target.model_id)(
                request, target.peer_id, 30.0)
            ordinary = await user.ask(**request.ask_kwargs(),
                                      on_text=pieces.append if request.stream else None)
    assert challenge.ok and ordinary.ok, (challenge.error, ordinary.error)
    assert challenge.served_by == ordinary.served_by == target.peer_id
    q_challenge, q_user = decode_query(challenge.request), decode_query(ordinary.request)
    assert q_challenge.stream == request.stream and bool(q_challenge.messages) == (mix.chat == 1)
    assert q_challenge.request_id != q_user.request_id  # random per request
    assert len(q_challenge.reply_proxies) == len(q_user.reply_proxies)
    blank = {"request_id": b"", "reply_proxies": ()}
    assert dataclasses.replace(q_challenge, **blank) == dataclasses.replace(q_user, **blank)
    pb_challenge = inference_pb2.InferenceRequest.FromString(challenge.request)
    pb_user = inference_pb2.InferenceRequest.FromString(ordinary.request)
    assert _fields(pb_challenge) == _fields(pb_user)
    assert _fields(pb_challenge.params) == _fields(pb_user.params)


# --------------------------------------------------------------------- the whole committee


#: user-shaped challenges (chat or prompt, streamed or not, seeds, stops) with short greedy
#: answers: a test's budget (the default mix asks up to 2048 tokens and T up to 2, as users do)
SHORT_MIX = dataclasses.replace(
    ChallengeMix(), max_tokens=((24, 1.0),), temperature=((None, 0.6), (0.0, 0.4)))


@pytest.mark.slow
@pytest.mark.needs_shared
async def test_a_committee_takes_a_dishonest_model_node_out_of_users_reach(shared, engine):
    from ps_p2p.engines.transformers_engine import TransformersEngine
    from ps_p2p.prompts import load_prompts
    from ps_p2p.testing.dishonest import DishonestEngine
    from ps_p2p.testing.localnet import CHALLENGE_TIMEOUT_S, open_localnet
    from ps_p2p.verification.reputation import is_trusted
    from ps_p2p.verification.service import REPORT_MARGIN_S

    pool = [p.text for p in load_prompts(shared / "data" / "mtbench" / "question.jsonl")][:40]
    # an attempt as long as its leader may need (its challenges' timeout and the margin to
    # score and submit): a shorter one drew the next attempt's leader while the first was still
    # challenging on a loaded machine, and every extra leader's challenges, scores and
    # re-scores by the 3 others slowed the epoch further (8 s attempts: 2-3 leaders per epoch
    # at load 20, a timeout at load 21); a dead leader is not part of this test
    attempt_ms = round((CHALLENGE_TIMEOUT_S + REPORT_MARGIN_S) * 1000)
    params = VerificationParams(
        model_id=engine.model_id, pool_sha256=pool_digest(pool), pool_size=len(pool),
        sampling=(SamplingOption(max_tokens=24),), attempt_ms=attempt_ms)

    def model_engine(i: int) -> Engine:
        own = TransformersEngine.load(shared / "models" / "stories260K")
        return own if i == 0 else DishonestEngine(own, temperature=2.0)

    with trio.fail_after(120):
        async with open_localnet(committee=4, models=2, users=3, engine_factory=model_engine,
                                 verification=params, pool=pool,
                                 verifier_engine=lambda i: engine, forwarding=False,
                                 challenge_mix=SHORT_MIX) as net:
            honest, dishonest = (m.peer_id for m in net.models)
            consensus = net.verifiers[0].consensus
            assert consensus is not None
            while True:
                state = consensus.validator.state
                rules = state.genesis.reputation
                good, bad = (state.reputation(reputation_subject(p)) for p in (honest, dishonest))
                if good is not None:
                    assert is_trusted(good.state(), rules), good  # stays trusted throughout
                if bad is not None and not is_trusted(bad.state(), rules) and good is not None:
                    break
                await consensus.wait_committed(state.height + 1)
            assert bad.value < rules.untrusted_below
            assert bad.epochs <= 3  # untrusted within 3 epochs of its first score
            # the committed blocks, which blocksync serves every listed node, carry the
            # challenges' requests sealed: no pool prompt in clear (issue 16)
            blocks = consensus.validator.store.blocks_from(1, 100_000)
            assert blocks and not any(p.encode() in block for _, block, _ in blocks for p in pool)
            user = net.users[0]
            assert user.user is not None
            while dishonest in [r.peer_id for r in user.user.model_nodes()]:
                await user.wait_directory_update()
            assert honest in [r.peer_id for r in user.user.model_nodes()]
            for prompt in pool[:5]:
                answer = await user.user.ask(prompt, max_tokens=24, timeout=30)
                assert answer.ok, answer.error
                assert answer.served_by == honest


# ------------------------------------------------------------------ the users' mix (issue 18)


async def test_a_leader_without_a_fixed_mix_draws_its_challenges_from_the_committed_mix(
        mock_clock):
    from ps_p2p.verification.mix import histogram_of, mix_of

    params = verification("fake-model", sampling=(GREEDY,))
    state, mine, _ = started_epoch(params)
    learned = histogram_of(fixed_mix(max_tokens=64, seed=42))  # what the committee learned
    state.ledger = state.ledger.copy()
    state.ledger.mix = learned
    stubs = Stubs(state)
    svc = service(stubs, InstantEngine(), params, mix=None)
    assert svc.mix_for(state.ledger) == mix_of(learned)
    stubs.now_ms = state.ledger.start_ms + mine * ATTEMPT_MS + 1
    async with running(svc):
        await settle(svc)
    plan = state.ledger.plan(CHAIN, params, mine, secret(ME, 1))
    expected = [derive_request(secret(ME, 1), 1, mine, c, POOL[c.prompt_index], mix_of(learned))
                for c in plan.challenges]
    assert sorted(r.params for r, *_ in stubs.asked) == sorted(e.params for e in expected)
    assert {(r.max_tokens, r.seed) for r, *_ in stubs.asked} == {(64, 42)}


async def test_a_verifier_publishes_its_users_mix_once_per_epoch_when_it_has_one(mock_clock):
    from ps_p2p.verification.ledger import MixReportTx
    from ps_p2p.verification.mix import DEFAULT_HISTOGRAM, histogram_of

    params = verification("fake-model")
    stubs = Stubs(genesis_state(params))
    other = histogram_of(fixed_mix(max_tokens=64))
    windows = [None, DEFAULT_HISTOGRAM, other]
    svc = EpochService(
        ME, params, state=lambda: stubs.state, txs=app, submit=stubs.submit, ask=stubs.ask,
        engine=InstantEngine(), pool=POOL, master=master_key(ME.private_bytes()),
        committee_key=COMMITTEE_KEY, unix_ms=lambda: stubs.now_ms,
        mix_source=lambda: windows.pop(0))
    async with running(svc):  # its first step: the API has no publishable window yet
        assert stubs.txs(MixReportTx) == [] and len(windows) == 2
        await settle(svc)
        [tx] = stubs.txs(MixReportTx)
        assert (tx.validator, tx.epoch, tx.histogram) == (ME.peer_id, 1, DEFAULT_HISTOGRAM)
        await settle(svc)
        assert len(stubs.txs(MixReportTx)) == 1 and len(windows) == 1  # not asked again
        later = stubs.state.copy()
        later.ledger = stubs.state.ledger.copy()
        later.ledger.epoch = 2
        stubs.state = later
        await settle(svc)
        assert [(t.epoch, t.histogram) for t in stubs.txs(MixReportTx)] == [
            (1, DEFAULT_HISTOGRAM), (2, other)]
    assert svc.stats.mix_reports == 2
