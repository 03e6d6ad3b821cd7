"""Verification epochs on the chain: parameters, transactions, the epoch ledger; pure.

The committee's application (:mod:`ps_p2p.registry`) keeps an :class:`EpochLedger` next to
the registry and executes four transactions with it (PlanetServe sec. 3.4 and Algorithm 3; the
arithmetic is :mod:`ps_p2p.verification.epochs`, the rule :mod:`~ps_p2p.verification.
reputation`):

``SEED_COMMIT`` (kind 3)
    A validator commits ``c = seed_commitment(chain, e, validator, s)`` for an epoch e that has
    not started (the current epoch before its start, or the next one), signed by that validator.
    One per validator and epoch.

``EPOCH_REPORT`` (kind 4)
    The leader of (e, attempt) reveals its secret s, and lists every challenge of the plan
    that s determines, each with the signed answer it got through the overlay (SHA-256 of the
    request bytes Q, Q sealed for the committee (:mod:`~ps_p2p.verification.sealing`: blocks
    reach every listed node, and a published prompt is a recognisable challenge), and the
    model node's signed response) or none, and its score of the answer in micro
    units. Signed by the leader.

``MISS_REPORT`` (kind 6)
    A validator reports that a model node the leader of epoch e listed as unanswered did not
    answer its own confirmation challenge either. Signed by that validator.

``MIX_REPORT`` (kind 9)
    A validator publishes the histogram of request shapes its own local API saw
    (:mod:`~ps_p2p.verification.mix`: bucketed parameters, noised and suppressed below k, as
    shares), for the current epoch e; at most one per validator and epoch (a later epoch's
    replaces it). Signed by that validator. When an epoch's report executes, the latest
    report of each validator from the last :data:`MIX_REPORT_EPOCHS` epochs moves the
    committed mix (:attr:`EpochLedger.mix`, :func:`~ps_p2p.verification.mix.aggregate`):
    the next epoch's challenges are drawn from it.

The epoch clock is the chain itself (no local clock): epoch 1 is the current epoch from the
genesis on. Epoch e *starts* at the end of the first block after the report of e-1 (for e = 1:
after the genesis) in which validators holding more than 2/3 of the voting power have a seed
commitment for e, the registry lists at least one model node of ``params.model_id``, and at
least ``params.epoch_ms`` of block time passed since e-1 started. That
block's ID is the epoch's *anchor* h (the leader draw's input), its time the epoch's start, the
validators with a commitment for e its *eligible* leaders, and the model nodes of the model its
*challenged set* (with their reputation subject as of that block). A validator with committed
evidence against it (``excluded``) is never an eligible leader. The attempt at block time t
is ``(t - start) // params.attempt_ms``; the leader of attempt a is ``leader(e, h, eligible, a)``,
so a leader that does not report within an attempt is replaced by the next draw, and any
leader of an attempt so far may still report (the first report executed ends the epoch).

Checks of an EPOCH_REPORT (deterministic, here; every validator runs them on execution):

* epoch e is current and started; the attempt is not in the future; the leader is the draw's;
  the leader's signature; its secret opens its commitment (:func:`~ps_p2p.verification.epochs.
  check_reveal`);
* the challenges are exactly the plan :func:`~ps_p2p.verification.epochs.derive_plan` gives for
  the seed, the challenged set, the pool size, the recent prompts it excludes
  (:meth:`EpochLedger.excluded_prompts`) and the sampling menu (so a plan naming a node outside
  the registry, or any other plan, is refused: :func:`~ps_p2p.verification.epochs.verify_plan`);
* each answer: its signature by the node that served it (the challenged node, or a node of the
  challenged set it forwarded to, with the challenged node's voucher), over SHA-256(Q); status
  OK; signed within the epoch (start - skew .. block time + skew); an unanswered challenge
  scores 0.

What cannot be checked deterministically lives in the *value check* each verifier adds with its
reference model (:mod:`ps_p2p.verification.service`): the sealed Q opens under the committee
key and hashes to the signed request hash, Q asks the pool's prompt with the menu's
parameters, and every score is within ``params.tolerance`` of its own. A verifier whose check
fails prevotes nil, so a report with wrong scores never gets 2/3 of the prevotes (Tendermint's
``valid(v)``).

Effects of an executed report: each subject whose nodes answered gets one reputation step with C
= the mean of its answers' scores (micro units, rounded half up), capped by its lowest greedy
answer's score and by any answer scored 0 (:func:`subject_scores`); an answer counts for the
challenged node and, when it forwarded the challenge, for the node that served it as well;
unanswered challenges cost
nothing yet: they are listed as *open misses* of e, with the node's subject in e's challenged
set. A MISS_REPORT for an open miss of one of the last ``params.miss_epochs`` epochs is recorded;
the leader's report counts as the leader's own. Once validators with more than 1/3 of the power
reported a node for e (:class:`~ps_p2p.verification.epochs.MissTally`'s rule), that subject (not
the node's current one: a node that leaves or changes organization before the confirmation
cannot move the miss off its organization) gets one step at C = 0, once.

Contribution credits (sec. 3.4, "incentives"), per model node: challenges answered, answered
with a score of at least ``tau`` (the reputation rule's "normal"), and misses confirmed by > 1/3.
All three are proven by signatures (the node's own on its answers; the validators' on their miss
reports). Relay work is not credited: a relay can prove it *received* a clove (the model node
signs each one) but not that it forwarded it, and publishing which relays carried a leader's
challenges would name the leader's proxies on the chain while its paths still carry the next
challenges, letting a model node spot them (docs/verification.md).

Ledger bytes (hashed into the registry aux digest, so into the app hash)::

    ledger = LEDGER_DOMAIN || u64(epoch) || u64(start_ms) || u8(started) || [bytes(anchor)
             || u32(#eligible) || (bytes(address) || u64(power))* || u32(#challenged)
             || (bytes(node) || bytes(subject))*] || u32(#commit epochs) || (u64(e) || u32(#)
             || (bytes(validator) || bytes(commitment))*)* || u32(#recent) || (u64(e) || u32(#)
             || u32(prompt index)*)* || u32(#open) || (u64(e) || bytes(node) || bytes(subject)
             || u8(counted) || u32(#reporters) || bytes(validator)*)* || u32(#credits)
             || (bytes(node) || u64(answered) || u64(passed) || u64(missed))*
             [|| u8(mix committed) [|| histogram(mix)] || u32(#mix reports)
              || (bytes(validator) || u64(epoch) || histogram)*]

(the bracket only once a mix report was executed, so chains without any keep their hashes;
``histogram`` as in :mod:`~ps_p2p.verification.mix`)

(all maps ascending by key.) Bounds: commitments for two epochs (one per validator each), the
challenged set the registry's model nodes of the model (at most ``policy.max_records``; a plan
takes ``params.max_nodes`` of them), recent prompts for ``params.recent_epochs`` epochs and
at most the pool's size (older ones could not be excluded any more),
open misses for ``params.miss_epochs`` epochs, credits one per model node ever challenged, at
most ``MAX_CREDITS`` (the least-credited goes first), mix reports one per validator and at most
:data:`MIX_REPORT_EPOCHS` epochs old (each :data:`~ps_p2p.verification.mix.HISTOGRAM_BYTES`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ps_p2p.consensus.encoding import Reader, lp, lps, u8, u32, u64
from ps_p2p.consensus.signing import check_validators
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import (
    InvalidTransactionError,
    LocalProtocolError,
    RemoteProtocolError,
    VerificationError,
)
from ps_p2p.inference import InferenceReply
from ps_p2p.records import Signer, verify_signature
from ps_p2p.records.peer_ids import ED25519_PEER_ID_BYTES, peer_label
from ps_p2p.responses import verify_forward, verify_response
from ps_p2p.verification import epochs
from ps_p2p.verification.mix import ShapeHistogram, aggregate
from ps_p2p.verification.sealing import SEAL_OVERHEAD

SEED_COMMIT_DOMAIN = b"planetserve/v1/seed-commit-tx\x00"
EPOCH_REPORT_DOMAIN = b"planetserve/v1/epoch-report\x00"
MISS_REPORT_DOMAIN = b"planetserve/v1/miss-report\x00"
MIX_REPORT_DOMAIN = b"planetserve/v1/mix-report\x00"
LEDGER_DOMAIN = b"planetserve/v1/epoch-ledger\x00"

#: Fixed-point scale of committed reputations and credibilities (micro units: 10^6 = 1.0).
MICRO = 1_000_000
#: Most model nodes credited (the least-credited is dropped when full).
MAX_CREDITS = 100_000
#: Longest request Q or answer text carried in a report (bytes).
MAX_REQUEST_BYTES = 64 * 1024
MAX_TEXT_BYTES = 64 * 1024
MAX_STRING_BYTES = 256
SIGNATURE_BYTES = 64
RESPONSE_STATUS_OK = 0
#: ``recent_epochs`` that excludes every earlier epoch's prompts (never reuse one while the
#: pool has unused prompts).
NEVER_REUSE = 2**32 - 1
#: A validator's mix report counts in the committed mix for this many epochs (its latest).
MIX_REPORT_EPOCHS = 16


# -------------------------------------------------------------------------------- parameters


def _real(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)



@dataclass(frozen=True)
class SamplingOption:
    """One entry of the committed menu of ordinary sampling parameters a challenge may use.

    Attributes:
        max_tokens: tokens asked for, in [1, 4096].
        temperature: in [0, 2] (0: greedy; the API's range), scored at that temperature
            (:func:`~ps_p2p.verification.scoring.score_challenge`).
        top_p: in (0, 1].
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens <= 4096:
            raise LocalProtocolError(f"sampling max_tokens {self.max_tokens!r} not in [1, 4096]")
        if not _real(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise LocalProtocolError(f"sampling temperature {self.temperature!r} not in [0, 2]")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise LocalProtocolError(f"sampling top_p {self.top_p!r} not in (0, 1]")


@dataclass(frozen=True)
class VerificationParams:
    """The genesis file's ``verification`` section: what the epochs challenge and how.

    Attributes:
        model_id: the model the committee verifies (model nodes of other models are not
            challenged).
        pool_sha256: hex SHA-256 of the prompt pool (:func:`pool_digest`); every verifier loads
            the pool file and refuses to start on another digest.
        pool_size: prompts in the pool, >= 1.
        sampling: the menu of ordinary sampling parameters, 1 to 256 entries.
        challenges_per_node: distinct prompts per model node per epoch, in [1, 64].
        max_nodes: model nodes challenged per epoch (drawn by the seed when more), in [1, 1024];
            fewer when the pool cannot give each a distinct prompt (:attr:`plan_nodes`).
        attempt_ms: block-time milliseconds a leader has before the next one is drawn.
        recent_epochs: prompts of this many past epochs are not asked again, in
            [0, 2**32 - 1]; the default, :data:`NEVER_REUSE`, keeps every past epoch's, so no
            prompt is asked twice while the pool has unused ones (a model node that saw a
            prompt once could otherwise flag it when it comes back). When the pool would not
            leave enough prompts for the plan, the oldest epochs' prompts come back first
            (:meth:`EpochLedger.excluded_prompts`): a pool is then exhausted, and the service
            warns (:meth:`EpochLedger.fresh_prompts`).
        miss_epochs: epochs during which a miss can still be confirmed, in [1, 64].
        tolerance: largest |own - proposed| credibility a verifier accepts, in [0, 1].
        epoch_ms: block-time milliseconds from one epoch's start to the next one's at least
            (0: the next starts as soon as the previous report committed and > 2/3 committed
            seeds; a deployment sets minutes, the experiment 0).
        min_tokens_slack: a "length" answer is scored as at least ``max_tokens - slack``
            tokens (:func:`~ps_p2p.verification.scoring.credibility`'s ``min_tokens``).
        committee_key_sha256: hex :func:`~ps_p2p.verification.sealing.key_commitment` of the
            committee key that seals the challenges' requests in reports; a verifier refuses
            to run epochs without one or with another key ("" in a genesis: no verifier runs
            epochs).
    """

    model_id: str
    pool_sha256: str
    pool_size: int
    sampling: tuple[SamplingOption, ...] = (SamplingOption(),)
    challenges_per_node: int = 1
    max_nodes: int = 64
    attempt_ms: int = 60_000
    recent_epochs: int = NEVER_REUSE
    miss_epochs: int = 2
    tolerance: float = epochs.DEFAULT_TOLERANCE
    min_tokens_slack: int = 8
    epoch_ms: int = 0
    committee_key_sha256: str = ""

    def __post_init__(self) -> None:
        if not self.model_id or len(self.model_id.encode()) > MAX_STRING_BYTES:
            raise LocalProtocolError("verification model_id must be 1 to 256 UTF-8 bytes")
        try:
            if len(bytes.fromhex(self.pool_sha256)) != 32:
                raise ValueError
        except (ValueError, TypeError):
            raise LocalProtocolError("verification pool_sha256 must be 64 hex digits") from None
        if self.committee_key_sha256:
            try:
                if len(bytes.fromhex(self.committee_key_sha256)) != 32:
                    raise ValueError
            except (ValueError, TypeError):
                raise LocalProtocolError(
                    "verification committee_key_sha256 must be 64 hex digits") from None
        checks = (("pool_size", 1, epochs.MAX_POOL_SIZE),
                  ("challenges_per_node", 1, epochs.MAX_CHALLENGES_PER_NODE),
                  ("max_nodes", 1, 1024), ("attempt_ms", 1, 2**40),
                  ("recent_epochs", 0, NEVER_REUSE), ("miss_epochs", 1, 64),
                  ("min_tokens_slack", 0, 4096), ("epoch_ms", 0, 2**40))
        for name, lo, hi in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise LocalProtocolError(f"verification {name} {value!r} not in [{lo}, {hi}]")
        if self.challenges_per_node > self.pool_size:
            raise LocalProtocolError(
                f"verification: {self.challenges_per_node} challenges per node but a pool of "
                f"{self.pool_size} prompts")
        if not 1 <= len(self.sampling) <= epochs.MAX_SAMPLING_OPTIONS or not all(
                isinstance(s, SamplingOption) for s in self.sampling):
            raise LocalProtocolError("verification sampling: 1 to 256 sampling options")
        if not _real(self.tolerance) or not 0.0 <= self.tolerance <= 1.0:
            raise LocalProtocolError(f"verification tolerance {self.tolerance!r} not in [0, 1]")

    @property
    def plan_nodes(self) -> int:
        """Model nodes one plan challenges at most: ``max_nodes``, fewer when the pool (or
        :data:`~ps_p2p.verification.epochs.MAX_PLAN_CHALLENGES`) cannot give that many
        distinct prompts, so that no registry can make a plan impossible."""
        cap = min(self.pool_size, epochs.MAX_PLAN_CHALLENGES) // self.challenges_per_node
        return min(self.max_nodes, cap)

    def min_tokens(self, sampling: SamplingOption, finish_reason: str) -> int:
        """Tokens an answer that says ``finish_reason`` must have (0 unless "length")."""
        if finish_reason != "length":
            return 0
        return max(0, sampling.max_tokens - self.min_tokens_slack)


def pool_digest(prompts: Sequence[str]) -> str:
    """Hex SHA-256 over ``u32(#prompts) || str(prompt)*``: what ``pool_sha256`` commits to."""
    h = hashlib.sha256(b"planetserve/v1/prompt-pool\x00" + u32(len(prompts)))
    for p in prompts:
        h.update(lps(p))
    return h.hexdigest()


# ------------------------------------------------------------------------------ transactions


@dataclass(frozen=True)
class SignedAnswer:
    """A challenge's answer as the leader received it through the overlay.

    Attributes:
        sealed_request: Q's bytes exactly as sent, sealed for the committee
            (:func:`~ps_p2p.verification.sealing.seal_request`): blocks reach every listed
            node, and a prompt published there would mark that prompt as a challenge's.
        reply: the model node's signed response; its ``request_hash`` (SHA-256 of Q, which the
            signature covers) is carried in clear so every validator checks the signature
            without the key; the verifiers' value check opens the seal and checks that Q
            hashes to it.

    Encoding (the reply's fields in :class:`~ps_p2p.inference.InferenceReply` order, the
    request hash first)::

        bytes(request_hash) || bytes(sealed_request) || bytes(request_id) || u32(status)
        || str(text) || str(error) || str(model_id) || u32(prompt_tokens)
        || u32(completion_tokens) || str(finish_reason) || u64(signed_at_ms) || bytes(model_node)
        || bytes(signature) || bytes(forwarded_by) || bytes(forward_signature)
    """

    sealed_request: bytes
    reply: InferenceReply

    def encode(self) -> bytes:
        r = self.reply
        return b"".join((
            lp(r.request_hash), lp(self.sealed_request), lp(r.request_id), u32(r.status),
            lps(r.text), lps(r.error), lps(r.model_id), u32(r.prompt_tokens),
            u32(r.completion_tokens), lps(r.finish_reason), u64(r.signed_at_ms),
            lp(r.model_node), lp(r.signature), lp(r.forwarded_by), lp(r.forward_signature),
        ))

    @staticmethod
    def read(r: Reader) -> SignedAnswer:
        req_hash = r.lp("request hash", 32, exact=32)
        sealed = r.lp("sealed request", MAX_REQUEST_BYTES + SEAL_OVERHEAD)
        request_id = r.lp("request ID", 64)
        status = r.u32("status")
        text = r.lps("text", MAX_TEXT_BYTES)
        error = r.lps("error", MAX_STRING_BYTES)
        model_id = r.lps("model ID", MAX_STRING_BYTES)
        prompt_tokens, completion_tokens = r.u32("prompt tokens"), r.u32("completion tokens")
        finish_reason = r.lps("finish reason", 16)
        signed_at_ms = r.u64("signing time")
        model_node = r.lp("model node", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES)
        signature = r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES)
        forwarded_by = r.lp("forwarded by", ED25519_PEER_ID_BYTES)
        forward_signature = r.lp("forward signature", SIGNATURE_BYTES)
        return SignedAnswer(sealed, InferenceReply(
            request_id, status, text, error, model_id, prompt_tokens, completion_tokens,
            req_hash, signed_at_ms, model_node, signature, finish_reason,
            forwarded_by, forward_signature))

    def verify(self, challenged: bytes) -> bytes:
        """Check the signatures (:func:`~ps_p2p.responses.verify_response`,
        :func:`~ps_p2p.responses.verify_forward`); returns the node that served (signed) it.

        The request itself is sealed: that the reply is for it (SHA-256 of Q is the signed
        request hash) is the value check's (:func:`~ps_p2p.verification.sealing.
        open_request`).

        Raises:
            VerificationError: status not OK; not signed by its ``model_node``; served by
                another node than ``challenged`` without ``challenged``'s forward voucher.
        """
        r = self.reply
        if r.status != RESPONSE_STATUS_OK:
            raise VerificationError(f"answer of status {r.status}, not OK")
        try:
            verify_response(request_id=r.request_id, req_hash=r.request_hash,
                            content=r.content(), signed_at_ms=r.signed_at_ms,
                            model_node=r.model_node, signature=r.signature)
        except RemoteProtocolError:
            raise VerificationError(
                f"answer not signed by {peer_label(r.model_node)}, the node it names"
            ) from None
        if r.model_node == challenged:
            if r.forwarded_by or r.forward_signature:
                raise VerificationError("an answer served by the challenged node has a voucher")
            return r.model_node
        if r.forwarded_by != challenged:
            raise VerificationError(
                f"answer signed by {peer_label(r.model_node)}, not by the challenged "
                f"{peer_label(challenged)} nor forwarded by it"
            )
        try:
            verify_forward(challenged, r.request_id, r.request_hash, r.model_node,
                           r.forward_signature)
        except RemoteProtocolError:
            raise VerificationError(
                f"forward voucher of {peer_label(challenged)} does not verify") from None
        return r.model_node


@dataclass(frozen=True)
class ChallengeResult:
    """One planned challenge in a report: the leader's score, the answer (None: missed), and
    whether the request sent was greedy (temperature 0: its score caps the node's epoch score,
    :func:`subject_scores`). The request's parameters are drawn from the users' mix
    (:func:`~ps_p2p.verification.challenges.derive_request`), not from the plan's menu entry,
    and the request is sealed in the report: the chain cannot see its temperature, so the leader
    states it and every verifier checks it against the request it re-derives."""

    challenge: epochs.Challenge
    score: int
    answer: SignedAnswer | None = None
    greedy: bool = False


@dataclass(frozen=True)
class SeedCommitTx:
    """A validator's seed commitment for ``epoch`` (module docstring)."""

    validator: bytes
    epoch: int
    commitment: bytes
    signature: bytes = b""

    @property
    def subject(self) -> bytes:
        return self.validator

    def signing_bytes(self, chain_id: str) -> bytes:
        return (SEED_COMMIT_DOMAIN + lps(chain_id) + lp(self.validator) + u64(self.epoch)
                + lp(self.commitment))

    def body(self) -> bytes:
        return lp(self.validator) + u64(self.epoch) + lp(self.commitment) + lp(self.signature)

    @staticmethod
    def read(r: Reader) -> SeedCommitTx:
        return SeedCommitTx(
            r.lp("validator", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES),
            r.u64("epoch"), r.lp("commitment", 32, exact=32),
            r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES))


@dataclass(frozen=True)
class EpochReportTx:
    """The leader's report of epoch ``epoch``, attempt ``attempt`` (module docstring).

    Attributes:
        results: one per challenge of the plan, in plan order.
    """

    epoch: int
    attempt: int
    leader: bytes
    secret: bytes
    results: tuple[ChallengeResult, ...]
    signature: bytes = b""

    @property
    def subject(self) -> bytes:
        return b""

    @property
    def plan_challenges(self) -> tuple[epochs.Challenge, ...]:
        return tuple(r.challenge for r in self.results)

    def unsigned_body(self) -> bytes:
        parts = [u64(self.epoch), u32(self.attempt), lp(self.leader), lp(self.secret),
                 u32(len(self.results))]
        for res in self.results:
            c = res.challenge
            parts += [lp(c.model_node), u32(c.prompt_index), u32(c.sampling), u32(res.score)]
            if res.answer is None:  # 0: missed; 1: answered (sampled); 2: answered (greedy)
                parts.append(u8(0))
            else:
                parts += [u8(2 if res.greedy else 1), res.answer.encode()]
        return b"".join(parts)

    def signing_bytes(self, chain_id: str) -> bytes:
        return EPOCH_REPORT_DOMAIN + lps(chain_id) + self.unsigned_body()

    def body(self) -> bytes:
        return self.unsigned_body() + lp(self.signature)

    @staticmethod
    def read(r: Reader) -> EpochReportTx:
        epoch, attempt = r.u64("epoch"), r.u32("attempt")
        leader_ = r.lp("leader", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES)
        secret = r.lp("secret", epochs.SECRET_BYTES, exact=epochs.SECRET_BYTES)
        n = r.u32("challenge count")
        if n > epochs.MAX_PLAN_CHALLENGES:
            raise r.fail(f"{n} challenges (max {epochs.MAX_PLAN_CHALLENGES})")
        results = []
        for _ in range(n):
            node = r.lp("model node", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES)
            challenge = epochs.Challenge(node, r.u32("prompt index"), r.u32("sampling option"))
            score = r.u32("score")
            if score > MICRO:
                raise r.fail(f"score {score} micro units is outside [0, 1]")
            flag = r.u8("answered")
            if flag > 2:
                raise r.fail("answered flag not 0, 1 or 2")
            answer = SignedAnswer.read(r) if flag else None
            results.append(ChallengeResult(challenge, score, answer, greedy=flag == 2))
        signature = r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES)
        return EpochReportTx(epoch, attempt, leader_, secret, tuple(results), signature)


@dataclass(frozen=True)
class MissReportTx:
    """A validator's confirmation that ``model_node`` missed its challenge of ``epoch``."""

    validator: bytes
    epoch: int
    model_node: bytes
    signature: bytes = b""

    @property
    def subject(self) -> bytes:
        return self.validator

    def signing_bytes(self, chain_id: str) -> bytes:
        return (MISS_REPORT_DOMAIN + lps(chain_id) + lp(self.validator) + u64(self.epoch)
                + lp(self.model_node))

    def body(self) -> bytes:
        return lp(self.validator) + u64(self.epoch) + lp(self.model_node) + lp(self.signature)

    @staticmethod
    def read(r: Reader) -> MissReportTx:
        return MissReportTx(
            r.lp("validator", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES),
            r.u64("epoch"),
            r.lp("model node", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES),
            r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES))


@dataclass(frozen=True)
class MixReportTx:
    """A validator's histogram of its users' request shapes in ``epoch`` (module docstring).

    Encoding: ``bytes(validator) || u64(epoch) || histogram || bytes(signature)``, the
    signature over ``MIX_REPORT_DOMAIN || str(chain_id) || bytes(validator) || u64(epoch)
    || histogram``.
    """

    validator: bytes
    epoch: int
    histogram: ShapeHistogram
    signature: bytes = b""

    @property
    def subject(self) -> bytes:
        return self.validator

    def signing_bytes(self, chain_id: str) -> bytes:
        return (MIX_REPORT_DOMAIN + lps(chain_id) + lp(self.validator) + u64(self.epoch)
                + self.histogram.encode())

    def body(self) -> bytes:
        return (lp(self.validator) + u64(self.epoch) + self.histogram.encode()
                + lp(self.signature))

    @staticmethod
    def read(r: Reader) -> MixReportTx:
        """Layout only (dimension and bucket counts); the shares are checked by
        :func:`check_mix_report`."""
        return MixReportTx(
            r.lp("validator", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES),
            r.u64("epoch"), ShapeHistogram.read(r),
            r.lp("signature", SIGNATURE_BYTES, exact=SIGNATURE_BYTES))


def sign_mix_report(identity: Signer, chain_id: str, epoch: int,
                    histogram: ShapeHistogram) -> MixReportTx:
    tx = MixReportTx(identity.peer_id, epoch, histogram)
    return MixReportTx(tx.validator, epoch, histogram, identity.sign(tx.signing_bytes(chain_id)))


def sign_seed_commit(identity: Signer, chain_id: str, epoch: int,
                     commitment: bytes) -> SeedCommitTx:
    tx = SeedCommitTx(identity.peer_id, epoch, commitment)
    return SeedCommitTx(tx.validator, epoch, commitment, identity.sign(tx.signing_bytes(chain_id)))


def sign_epoch_report(identity: Signer, chain_id: str, epoch: int, attempt: int, secret: bytes,
                      results: Sequence[ChallengeResult]) -> EpochReportTx:
    tx = EpochReportTx(epoch, attempt, identity.peer_id, secret, tuple(results))
    return EpochReportTx(epoch, attempt, identity.peer_id, secret, tuple(results),
                         identity.sign(tx.signing_bytes(chain_id)))


def sign_miss_report(identity: Signer, chain_id: str, epoch: int,
                     model_node: bytes) -> MissReportTx:
    tx = MissReportTx(identity.peer_id, epoch, model_node)
    return MissReportTx(tx.validator, epoch, model_node, identity.sign(tx.signing_bytes(chain_id)))


# ------------------------------------------------------------------------------------ ledger


@dataclass(frozen=True)
class Credit:
    """A model node's contribution credits (module docstring)."""

    answered: int = 0
    passed: int = 0
    missed: int = 0


@dataclass
class EpochLedger:
    """The epoch part of the application state (module docstring); copy before mutating.

    Attributes:
        epoch: the current epoch (1 from the genesis on).
        anchor: its anchor block ID once started, else None.
        start_ms: its start (block time) once started; before, the previous epoch's (0 for
            epoch 1).
        eligible: the validators that may lead it (with a commitment at the start).
        challenged: (model node, reputation subject) of the model nodes it challenges.
        commitments: epoch -> validator -> commitment (the current and the next epoch).
        recent: epoch -> prompt indices used (the last ``recent_epochs``; of those, only the
            newest that a plan could still exclude: about the pool's size at most).
        misses: (epoch, node) -> reporting validators, for open misses.
        missed_subjects: (epoch, node) -> the node's subject in that epoch, for open misses.
        counted: the (epoch, node) misses already applied.
        credits: model node -> :class:`Credit`.
        mix: the committed mix of request shapes the current epoch's challenges are drawn
            from (:func:`~ps_p2p.verification.mix.mix_of`); None: the genesis mix
            (:data:`~ps_p2p.verification.challenges.DEFAULT_MIX`), until a report moves it.
        mix_reports: validator -> (epoch, histogram) of its latest MIX_REPORT.
    """

    epoch: int = 1
    anchor: bytes | None = None
    start_ms: int = 0
    eligible: tuple[Validator, ...] = ()
    challenged: tuple[tuple[bytes, bytes], ...] = ()
    commitments: dict[int, dict[bytes, bytes]] = field(default_factory=dict)
    recent: dict[int, tuple[int, ...]] = field(default_factory=dict)
    misses: dict[tuple[int, bytes], frozenset[bytes]] = field(default_factory=dict)
    missed_subjects: dict[tuple[int, bytes], bytes] = field(default_factory=dict)
    counted: set[tuple[int, bytes]] = field(default_factory=set)
    credits: dict[bytes, Credit] = field(default_factory=dict)
    mix: ShapeHistogram | None = None
    mix_reports: dict[bytes, tuple[int, ShapeHistogram]] = field(default_factory=dict)
    #: a mix report was ever executed (the ledger bytes then carry the mix section)
    mix_section: bool = False

    @property
    def started(self) -> bool:
        return self.anchor is not None

    def copy(self) -> EpochLedger:
        return EpochLedger(
            self.epoch, self.anchor, self.start_ms, self.eligible, self.challenged,
            {e: dict(c) for e, c in self.commitments.items()}, dict(self.recent),
            dict(self.misses), dict(self.missed_subjects), set(self.counted),
            dict(self.credits), self.mix, dict(self.mix_reports), self.mix_section)

    def encode(self, *, mix: bool = True) -> bytes:
        """The ledger bytes (module docstring); ``mix=False`` leaves out the mix section
        (a state snapshot carries it apart: :meth:`encode_mix`)."""
        parts = [LEDGER_DOMAIN, u64(self.epoch), u64(self.start_ms), u8(self.started)]
        if self.anchor is not None:
            parts += [lp(self.anchor), u32(len(self.eligible))]
            parts += [lp(v.address) + u64(v.power) for v in self.eligible]
            parts.append(u32(len(self.challenged)))
            parts += [lp(n) + lp(s) for n, s in self.challenged]
        parts.append(u32(len(self.commitments)))
        for e in sorted(self.commitments):
            c = self.commitments[e]
            parts += [u64(e), u32(len(c))] + [lp(v) + lp(c[v]) for v in sorted(c)]
        parts.append(u32(len(self.recent)))
        for e in sorted(self.recent):
            parts += [u64(e), u32(len(self.recent[e]))] + [u32(i) for i in self.recent[e]]
        parts.append(u32(len(self.misses)))
        for key in sorted(self.misses):
            reporters = sorted(self.misses[key])
            parts += [u64(key[0]), lp(key[1]), lp(self.missed_subjects[key]),
                      u8(key in self.counted), u32(len(reporters))]
            parts += [lp(v) for v in reporters]
        parts.append(u32(len(self.credits)))
        for node in sorted(self.credits):
            c = self.credits[node]
            parts += [lp(node), u64(c.answered), u64(c.passed), u64(c.missed)]
        if mix and self.mix_section:
            parts.append(self.encode_mix())
        return b"".join(parts)

    def encode_mix(self) -> bytes:
        """The mix section of the ledger bytes (module docstring's bracket); b"" when no mix
        report was ever executed."""
        if not self.mix_section:
            return b""
        parts = [u8(self.mix is not None)]
        if self.mix is not None:
            parts.append(self.mix.encode())
        parts.append(u32(len(self.mix_reports)))
        for v in sorted(self.mix_reports):
            e, h = self.mix_reports[v]
            parts += [lp(v), u64(e), h.encode()]
        return b"".join(parts)

    def read_mix(self, r: Reader) -> None:
        """Read :meth:`encode_mix`'s bytes (not empty) into this ledger."""
        self.mix_section = True
        if r.u8("mix committed"):
            self.mix = ShapeHistogram.read(r)
        n = r.u32("mix reports")
        if n > 4096:
            raise r.fail(f"{n} mix reports")
        for _ in range(n):
            v = r.lp("mix reporter", ED25519_PEER_ID_BYTES)
            self.mix_reports[v] = (r.u64("mix report epoch"), ShapeHistogram.read(r))

    def digest(self) -> bytes:
        return hashlib.sha256(self.encode()).digest()

    def attempt_at(self, time_ms: int, params: VerificationParams) -> int:
        """The attempt under way at block time ``time_ms`` (0 before the start)."""
        if not self.started or time_ms <= self.start_ms:
            return 0
        return min((time_ms - self.start_ms) // params.attempt_ms, epochs.MAX_ATTEMPTS)

    def leader(self, attempt: int) -> bytes:
        """The leader of the current epoch's ``attempt`` (started epochs only)."""
        assert self.anchor is not None, "epoch not started"
        return epochs.leader(self.epoch, self.anchor, self.eligible, attempt=attempt)

    def excluded_prompts(self, params: VerificationParams | None = None) -> set[int]:
        """The prompts the current epoch's plan does not ask: those of the recent epochs.

        With ``params``, only those of the newest recent epochs that leave the pool enough
        prompts for the plan of the challenged set (so a small pool makes old prompts come back
        sooner, never a plan impossible); without, all of them.
        """
        if params is None:
            return {i for used in self.recent.values() for i in used}
        need = min(len(self.challenged), params.plan_nodes) * params.challenges_per_node
        out: set[int] = set()
        for e in sorted(self.recent, reverse=True):
            more = out.union(self.recent[e])
            if params.pool_size - len(more) < need:
                break
            out = more
        return out

    def fresh_prompts(self, params: VerificationParams) -> int:
        """Prompts of the pool that no remembered epoch asked: until the pool is exhausted,
        those never asked; after, about one plan's worth (the oldest epochs' prompts, which
        plans then ask again, oldest first)."""
        return params.pool_size - len(self.excluded_prompts())

    def plan(self, chain_id: str, params: VerificationParams, attempt: int,
             secret: bytes) -> epochs.Plan:
        """The plan of the current epoch's ``attempt`` for the leader's ``secret``."""
        assert self.anchor is not None, "epoch not started"
        seed = epochs.epoch_seed(chain_id, self.epoch, self.anchor, self.leader(attempt), secret,
                                 attempt=attempt)
        return epochs.derive_plan(
            seed, [n for n, _ in self.challenged], params.pool_size, params.challenges_per_node,
            max_nodes=params.plan_nodes, exclude=self.excluded_prompts(params),
            sampling_options=len(params.sampling))

    def subject_of(self, node: bytes) -> bytes | None:
        for n, s in self.challenged:
            if n == node:
                return s
        return None

    def open_misses(self) -> list[tuple[int, bytes]]:
        """(epoch, node) of the misses that can still be confirmed and are not counted."""
        return sorted(k for k in self.misses if k not in self.counted)


# ---------------------------------------------------------------------------------- checking


def _tx_error(exc: Exception) -> InvalidTransactionError:
    return InvalidTransactionError(str(exc))


def _check_signed(peer: bytes, data: bytes, signature: bytes, what: str) -> None:
    try:
        verify_signature(peer, data, signature)
    except RemoteProtocolError:
        raise InvalidTransactionError(f"{what} is not signed by {peer_label(peer)}") from None


def check_seed_commit(tx: SeedCommitTx, ledger: EpochLedger, chain_id: str,
                      validators: Sequence[Validator]) -> None:
    """Raises InvalidTransactionError: not a validator, bad signature, an epoch that started or
    is more than one ahead, or a second commitment."""
    if all(v.address != tx.validator for v in validators):
        raise InvalidTransactionError(f"seed commitment from {peer_label(tx.validator)}, "
                                      "not a validator")
    _check_signed(tx.validator, tx.signing_bytes(chain_id), tx.signature, "seed commitment")
    allowed = (ledger.epoch + 1,) if ledger.started else (ledger.epoch, ledger.epoch + 1)
    if tx.epoch not in allowed:
        raise InvalidTransactionError(
            f"seed commitment for epoch {tx.epoch}; epoch {ledger.epoch} is "
            f"{'started' if ledger.started else 'not started'} (accepted: {allowed})")
    if tx.validator in ledger.commitments.get(tx.epoch, {}):
        raise InvalidTransactionError(
            f"{peer_label(tx.validator)} already committed a seed for epoch {tx.epoch}")


def apply_seed_commit(tx: SeedCommitTx, ledger: EpochLedger) -> None:
    ledger.commitments.setdefault(tx.epoch, {})[tx.validator] = tx.commitment


def check_epoch_report(tx: EpochReportTx, ledger: EpochLedger, chain_id: str,
                       params: VerificationParams, time_ms: int,
                       registry: Sequence[bytes] = ()) -> dict[bytes, list[int]]:
    """The deterministic checks of a report (module docstring) at block time ``time_ms``.

    Args:
        registry: the model nodes listed now (names the fault of a plan naming another node).

    Returns:
        model node -> the scores of its answers (:class:`ServedScores`): each answer counts for
        the challenged node and, when another node served it through a forward voucher, for
        that node too.

    Raises:
        InvalidTransactionError: any check failed (the reason named).
    """
    if not ledger.started or tx.epoch != ledger.epoch:
        raise InvalidTransactionError(
            f"report for epoch {tx.epoch}; the current epoch is {ledger.epoch}"
            f"{'' if ledger.started else ' (not started)'}")
    attempt = ledger.attempt_at(time_ms, params)
    if tx.attempt > attempt:
        raise InvalidTransactionError(f"report for attempt {tx.attempt}; at most {attempt} now")
    expected_leader = ledger.leader(tx.attempt)
    if tx.leader != expected_leader:
        raise InvalidTransactionError(
            f"report by {peer_label(tx.leader)}, but {peer_label(expected_leader)} leads "
            f"epoch {tx.epoch} attempt {tx.attempt}")
    _check_signed(tx.leader, tx.signing_bytes(chain_id), tx.signature, "epoch report")
    commitment = ledger.commitments.get(tx.epoch, {}).get(tx.leader)
    if commitment is None:  # pragma: no cover - eligible leaders hold one
        raise InvalidTransactionError("the leader has no seed commitment")
    try:
        epochs.check_reveal(commitment, chain_id, tx.epoch, tx.leader, tx.secret)
        expected = ledger.plan(chain_id, params, tx.attempt, tx.secret)
        claimed = epochs.Plan(expected.seed, tx.plan_challenges)
        epochs.verify_plan(claimed, expected, registry)
    except VerificationError as exc:
        raise _tx_error(exc) from None
    served: dict[bytes, ServedScores] = {}
    members = {n for n, _ in ledger.challenged}
    for res in tx.results:
        c = res.challenge
        if c.sampling >= len(params.sampling):  # pragma: no cover - the plan check covers it
            raise InvalidTransactionError("sampling option outside the menu")
        if res.answer is None:
            if res.score != 0:
                raise InvalidTransactionError("an unanswered challenge must score 0")
            continue
        try:
            server = res.answer.verify(c.model_node)
            if server not in members:
                raise VerificationError(
                    f"answer served by {peer_label(server)}, not a challenged model node")
            # a mempool's clock may be behind the block time that started the epoch
            epochs.check_response_time(res.answer.reply.signed_at_ms, ledger.start_ms,
                                       max(time_ms, ledger.start_ms))
        except VerificationError as exc:
            raise InvalidTransactionError(
                f"challenge of {peer_label(c.model_node)} prompt {c.prompt_index}: {exc}"
            ) from None
        # greedy (checked by every verifier against the re-derived request), or an answer
        # whose calibrated statistics are decisive (score 0: beyond z_bad, an honest sampler's
        # Gaussian tail of about 1e-5; or an empty or cut answer): both cap C(T)
        binding = res.greedy or res.score == 0
        # the challenged node answers for what it forwards (it chose the peer); the node that
        # served it is scored too (issue 18, "accountability through forwarding")
        for node in dict.fromkeys((c.model_node, server)):
            entry = served.setdefault(node, ServedScores())
            entry.append(res.score)
            if binding:
                entry.binding.append(res.score)
    return served


class ServedScores(list):  # type: ignore[type-arg]
    """A node's answer scores in one report (micro units), and among them (``binding``) those
    of greedy challenges and those scored 0, which cap the node's C(T) (:func:`subject_scores`)."""

    def __init__(self, scores: Sequence[int] = (), binding: Sequence[int] = ()) -> None:
        super().__init__(scores)
        self.binding: list[int] = list(binding)


def subject_scores(served: Mapping[bytes, Sequence[int]],
                   ledger: EpochLedger) -> dict[bytes, int]:
    """Subject -> C(T) in micro units: the mean of its nodes' answer scores, rounded half up,
    capped by its lowest binding score (greedy answers, and any answer scored 0).

    A greedy answer is deterministic: the right model gives every token as its top choice, so
    a low greedy score is no bad luck, and averaging it with sampled answers (whose tests see
    little of a near-equivalent model) would hide it (docs/verification.md, "Epoch score").
    A sampled answer scored 0 is as decisive: its calibrated statistic is beyond z_bad (4.5
    standard deviations), which an honest sampler reaches with probability about 1e-5; averaged,
    one such answer among 8 still left C at 0.875 (a node that cheats on what it takes for user
    requests hid its cheap sampled answers that way).
    """
    by_subject: dict[bytes, list[int]] = {}
    caps: dict[bytes, int] = {}
    for node, scores in served.items():
        subject = ledger.subject_of(node)
        assert subject is not None
        by_subject.setdefault(subject, []).extend(scores)
        for b in getattr(scores, "binding", ()):
            caps[subject] = min(caps.get(subject, b), b)
    return {s: min((2 * sum(v) + len(v)) // (2 * len(v)), caps.get(s, MICRO))
            for s, v in by_subject.items()}


def apply_epoch_report(tx: EpochReportTx, ledger: EpochLedger, params: VerificationParams,
                       served: Mapping[bytes, Sequence[int]], tau_micro: int,
                       validators: Sequence[Validator] = ()) -> None:
    """Record a checked report: credits, open misses (the leader's own report counted), the
    used prompts, the next epoch's mix (:func:`update_mix`, with ``validators``' power); then
    the epoch ends (the next one starts with :func:`maybe_start`)."""
    for node, scores in served.items():
        old = ledger.credits.get(node, Credit())
        ledger.credits[node] = Credit(old.answered + len(scores),
                                      old.passed + sum(1 for s in scores if s >= tau_micro),
                                      old.missed)
    for res in tx.results:
        if res.answer is None:
            key = (tx.epoch, res.challenge.model_node)
            ledger.misses[key] = ledger.misses.get(key, frozenset()) | {tx.leader}
            subject = ledger.subject_of(key[1])
            assert subject is not None  # the plan's nodes are the challenged set's
            ledger.missed_subjects[key] = subject
    ledger.recent[tx.epoch] = tuple(sorted(r.challenge.prompt_index for r in tx.results))
    for e in [e for e in ledger.recent if e <= tx.epoch - params.recent_epochs]:
        del ledger.recent[e]
    _forget_unexcludable(ledger, params)
    ledger.commitments.pop(tx.epoch, None)
    if ledger.mix_reports:
        update_mix(ledger, validators, tx.epoch)
    ledger.epoch += 1
    ledger.anchor, ledger.eligible, ledger.challenged = None, (), ()  # start_ms: the last one's
    for key in [k for k in ledger.misses if k[0] <= tx.epoch - params.miss_epochs]:
        del ledger.misses[key]
        del ledger.missed_subjects[key]
        ledger.counted.discard(key)
    _bound_credits(ledger)


def check_miss_report(tx: MissReportTx, ledger: EpochLedger, chain_id: str,
                      validators: Sequence[Validator]) -> None:
    """Raises InvalidTransactionError: not a validator, bad signature, not an open miss, a
    repeated report."""
    if all(v.address != tx.validator for v in validators):
        raise InvalidTransactionError(f"miss report from {peer_label(tx.validator)}, "
                                      "not a validator")
    _check_signed(tx.validator, tx.signing_bytes(chain_id), tx.signature, "miss report")
    reporters = ledger.misses.get((tx.epoch, tx.model_node))
    if reporters is None:
        raise InvalidTransactionError(
            f"{peer_label(tx.model_node)} has no open miss in epoch {tx.epoch}")
    if tx.validator in reporters:
        raise InvalidTransactionError(f"{peer_label(tx.validator)} already reported it")


def apply_miss_report(tx: MissReportTx, ledger: EpochLedger,
                      validators: Sequence[Validator]) -> bool:
    """Record a checked report; True when the miss now counts (reported by > 1/3 of the power
    for the first time): the caller steps the node's subject at C = 0."""
    key = (tx.epoch, tx.model_node)
    ledger.misses[key] = ledger.misses[key] | {tx.validator}
    if key in ledger.counted:
        return False
    tally = epochs.MissTally(validators, [tx.model_node])
    for v in ledger.misses[key]:
        tally.report(v, tx.model_node)
    if not tally.missed(tx.model_node):
        return False
    ledger.counted.add(key)
    old = ledger.credits.get(tx.model_node, Credit())
    ledger.credits[tx.model_node] = Credit(old.answered, old.passed, old.missed + 1)
    _bound_credits(ledger)
    return True


def check_mix_report(tx: MixReportTx, ledger: EpochLedger, chain_id: str,
                     validators: Sequence[Validator]) -> None:
    """Raises InvalidTransactionError: not a validator, bad signature, another epoch than the
    current one, a second report of this validator in the epoch, or a histogram out of range
    (:meth:`~ps_p2p.verification.mix.ShapeHistogram.check`: shares outside [0, SCALE], a
    dimension summing to neither SCALE nor 0, no data)."""
    if all(v.address != tx.validator for v in validators):
        raise InvalidTransactionError(f"mix report from {peer_label(tx.validator)}, "
                                      "not a validator")
    tx.histogram.check(InvalidTransactionError)
    _check_signed(tx.validator, tx.signing_bytes(chain_id), tx.signature, "mix report")
    if tx.epoch != ledger.epoch:
        raise InvalidTransactionError(
            f"mix report for epoch {tx.epoch}; the current epoch is {ledger.epoch}")
    held = ledger.mix_reports.get(tx.validator)
    if held is not None and held[0] >= tx.epoch:
        raise InvalidTransactionError(
            f"{peer_label(tx.validator)} already reported a mix in epoch {tx.epoch}")


def apply_mix_report(tx: MixReportTx, ledger: EpochLedger) -> None:
    ledger.mix_reports[tx.validator] = (tx.epoch, tx.histogram)
    ledger.mix_section = True


def update_mix(ledger: EpochLedger, validators: Sequence[Validator], ended: int) -> None:
    """At the end of epoch ``ended``: forget mix reports older than :data:`MIX_REPORT_EPOCHS`
    or of non-validators, and move the committed mix with the others
    (:func:`~ps_p2p.verification.mix.aggregate`, weighted by voting power)."""
    power = {v.address: v.power for v in validators}
    for v in [v for v, (e, _) in ledger.mix_reports.items()
              if v not in power or e <= ended - MIX_REPORT_EPOCHS]:
        del ledger.mix_reports[v]
    if ledger.mix_reports:
        reports = [(power[v], h) for v, (_, h) in sorted(ledger.mix_reports.items())]
        ledger.mix = aggregate(ledger.mix, reports, sum(power.values()))


def maybe_start(ledger: EpochLedger, validators: Sequence[Validator],
                model_nodes: Sequence[tuple[bytes, bytes]], params: VerificationParams,
                block_id: bytes, time_ms: int, *,
                excluded: frozenset[bytes] = frozenset()) -> bool:
    """Start the current epoch at the end of this block if due (module docstring).

    Args:
        validators: the current validator set.
        model_nodes: (peer ID, subject) of the listed model nodes of ``params.model_id``.
        block_id, time_ms: the block just executed.
        excluded: validators with committed evidence against them
            (:attr:`ps_p2p.registry.AppState.excluded`): their commitments count for the
            2/3 but they are no eligible leaders; the epoch waits while no one else committed.

    Returns:
        True when the epoch started here.
    """
    if ledger.started or not model_nodes:
        return False
    if ledger.epoch > 1 and time_ms < ledger.start_ms + params.epoch_ms:
        return False
    committed = ledger.commitments.get(ledger.epoch, {})
    holders = tuple(v for v in validators if v.address in committed)
    if 3 * sum(v.power for v in holders) <= 2 * check_validators(validators):
        return False
    eligible = tuple(v for v in holders if v.address not in excluded)
    if not eligible:
        return False
    ledger.anchor, ledger.start_ms = bytes(block_id), time_ms
    ledger.eligible = eligible
    ledger.challenged = tuple(sorted((bytes(n), bytes(s)) for n, s in model_nodes))
    return True


def _forget_unexcludable(ledger: EpochLedger, params: VerificationParams) -> None:
    """Drop the epochs whose prompts no plan can exclude any more: from the newest, once the
    union leaves fewer than one node's challenges (:meth:`EpochLedger.excluded_prompts` stops
    there), so the ledger holds at most about ``pool_size`` indices."""
    seen: set[int] = set()
    limit = params.pool_size - params.challenges_per_node
    for e in sorted(ledger.recent, reverse=True):
        seen.update(ledger.recent[e])
        if len(seen) > limit:
            for old in [o for o in ledger.recent if o <= e]:
                del ledger.recent[old]
            return


def _bound_credits(ledger: EpochLedger) -> None:
    while len(ledger.credits) > MAX_CREDITS:
        worst = min(ledger.credits, key=lambda n: (ledger.credits[n].passed, n))
        del ledger.credits[worst]


__all__ = [
    "ChallengeResult",
    "Credit",
    "EpochLedger",
    "EpochReportTx",
    "MissReportTx",
    "MixReportTx",
    "SamplingOption",
    "SeedCommitTx",
    "ServedScores",
    "SignedAnswer",
    "VerificationParams",
    "apply_epoch_report",
    "apply_miss_report",
    "apply_mix_report",
    "apply_seed_commit",
    "check_epoch_report",
    "check_miss_report",
    "check_mix_report",
    "check_seed_commit",
    "maybe_start",
    "pool_digest",
    "sign_epoch_report",
    "sign_miss_report",
    "sign_mix_report",
    "sign_seed_commit",
    "subject_scores",
    "update_mix",
]
