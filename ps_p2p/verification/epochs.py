"""Verification epochs: leader, seed commit-reveal, challenge plan, miss tally, tolerance; pure.

Source: PlanetServe sec. 3.4 ("Verification is performed epoch-by-epoch ..."). In each epoch e
one verifier, the leader L_e, sends every planned model node a challenge prompt through the
anonymous overlay, collects the signed responses, scores them and proposes the reputation
update; every other verifier re-scores them and prevotes only when the scores agree
(:func:`within_tolerance`). This module decides *who* leads, *what* is challenged, *which*
missing responses count, and *when* scores agree. The paper prepares the plan for e in epoch
e-1 and has the committee agree on it before e starts; a plan on the chain is readable by the
model nodes it names, which could then answer exactly those prompts honestly. Here the plan is
bound in e-1 but stays secret until the answers are in (commit-reveal).

Protocol (the committee app and services carry it; this module is the arithmetic)::

    before epoch e-1 starts:  each validator i commits   c_i,e = SHA-256(SEED_COMMIT_DOMAIN
                              || str(chain_id) || u64(e) || bytes(address_i) || bytes(s_i,e))
                              for a fresh 32-byte secret s_i,e (or derive_secret(master, ...))
    end of epoch e-1:         h = block ID of e-1's last committed block (32 bytes)
    leader of e (attempt a):  L = leader(e, h, V_e, attempt=a), V_e = the validators holding a
                              commitment for e, weighted by voting power
    seed of e:                seed = SHA-256(SEED_DOMAIN || str(chain_id) || u64(e) || u32(a)
                              || bytes(h) || bytes(L) || bytes(s_L,e))
    plan of e:                derive_plan(seed, registry's model nodes at h, pool size, ...)
    epoch e:                  L (alone) knows s_L,e, so the plan; it sends the challenges
    after the answers:        L's proposal reveals s_L,e with the responses and scores; every
                              verifier checks check_reveal(c_L,e, ...), re-derives the plan
                              (verify_plan) and re-scores; a wrong reveal or plan: prevote nil
    leader fails:             attempt a+1 picks again (same h), with its own secret

Byte layouts (``str``/``bytes``/``u*`` as in :mod:`ps_p2p.records.canonical`; all hashes
SHA-256)::

    leader draw  = SHA-256(LEADER_DOMAIN || u64(e) || u32(a) || bytes(h)) as a big-endian
                   integer, mod the total power, walked over the validators in ascending
                   address order (bias of the reduction < 2**-196 for the total power <= 2**60;
                   no chain ID: the block ID h already covers it)
    plan draws   = SHA-256(PLAN_DRAW_DOMAIN || bytes(seed) || u64(k)) for k = 0, 1, ...: each
                   digest gives four u64 words used in order; a word w draws from [0, n) by
                   rejection (w < 2**64 - 2**64 mod n, then w mod n), so draws are exactly uniform
    plan bytes   = PLAN_DOMAIN || bytes(seed) || u32(#challenges) || (bytes(model node)
                   || u32(prompt index) || u32(sampling option))*, ascending by (node, index)
    plan hash    = SHA-256(plan bytes)

Plan derivation (:func:`derive_plan`), in draw order: if ``max_nodes`` is set and smaller than
the registry, the model nodes with the lowest SHA-256(NODE_RANK_DOMAIN || bytes(seed) ||
bytes(peer ID)) are kept; then, for the kept nodes in ascending peer-ID order and
``challenges_per_node`` slots each, a partial Fisher-Yates shuffle of the pool indices not in
``exclude`` gives each slot a distinct prompt, followed by one draw of a sampling option (an
index into the genesis's menu of ordinary sampling parameters) for each slot.

Threat analysis (who can learn or steer what; f < 1/3 of the voting power Byzantine):

* **Model nodes** see the chain (commitments, block IDs, the registry) and their own traffic.
  The seed needs s_L,e, which only L knows until the reveal, and SHA-256 hides it, so they
  cannot compute the plan, nor tell a challenge from a user request by its bytes (the service
  sends it as an ordinary request with ordinary sampling parameters: the menu). After the
  reveal the plan's indices are public and each challenged node knows its own prompt (the
  report carries the prompts sealed for the committee only, :mod:`~ps_p2p.verification.
  sealing`): pass the used indices in ``exclude`` so no prompt is asked twice. If the pool
  itself is public (MT-Bench, ShareGPT), a node recognises a prompt as "from the pool" and
  answers those honestly (issue 16): the pool must be private (the genesis commits its hash,
  verifiers hold the file; ``ps-node testnet --challenge-pool generate``).
* **The leader** learns the plan when its epoch starts; it must, to send the challenges. It
  cannot steer it: s_L,e was committed before h existed and a different secret does not open
  the commitment (:class:`InvalidRevealError`); h and the registry are fixed by consensus. Its
  only choice is to run the epoch or not: a leader that does not reveal is replaced (attempt
  a+1), so it can veto one plan at the price of its epoch, not pick one. A Byzantine leader can
  tip off a colluding model node for its own epochs (about f of them): sampling can only catch
  such a node in honest leaders' epochs.
* **Other validators** learn nothing before the reveal and cannot influence the seed; a
  validator without a commitment for e is not eligible to lead e.
* **The proposer of h** (the last block of e-1) can try several blocks (transaction sets,
  timestamps) to move h, and with it the leader and the seed, among the few candidates it can
  afford to compute; it does not know the leader's secret, so it can aim at "who leads", not
  at "what is challenged". The paper's VRF on the commit hash has the same exposure; a
  threshold random beacon would remove it.

Misses (paper: "Only when more than 1/3 of the committee reported invalid responses for the
same model node ... x's reputation will be reduced"): the leader lists a node with no valid
signed response as missed, which alone costs the node nothing, so a leader cannot hurt a node
by dropping its answer. Each other verifier then confirms on its own: it sends the node its own
challenge through the overlay (a prompt of its own choosing from the pool, hidden the same way)
and reports the node only when that also goes unanswered or arrives invalid. The reports of one
epoch go into a :class:`MissTally`; a node reported by more than 1/3 of the voting power counts
C = 0 for the epoch (below any tau: abnormal), otherwise it is not scored that epoch.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ps_p2p.consensus.encoding import Reader, lp, lps, u32, u64
from ps_p2p.consensus.signing import check_validators
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import InvalidPlanError, InvalidRevealError, VerificationError
from ps_p2p.records.limits import MAX_CLOCK_SKEW_MS
from ps_p2p.records.peer_ids import ED25519_PEER_ID_BYTES, peer_label
from ps_p2p.verification.reputation import check_score

LEADER_DOMAIN = b"planetserve/v1/epoch-leader\x00"
SEED_COMMIT_DOMAIN = b"planetserve/v1/epoch-seed-commit\x00"
SEED_DOMAIN = b"planetserve/v1/epoch-seed\x00"
SECRET_DERIVE_DOMAIN = b"planetserve/v1/epoch-secret\x00"
NODE_RANK_DOMAIN = b"planetserve/v1/epoch-node-rank\x00"
PLAN_DRAW_DOMAIN = b"planetserve/v1/epoch-plan-draw\x00"
PLAN_DOMAIN = b"planetserve/v1/epoch-plan\x00"

HASH_BYTES = 32
SECRET_BYTES = 32
#: Most challenges in one plan (one leader sends them all in one epoch).
MAX_PLAN_CHALLENGES = 10_000
#: Most challenges per model node per epoch.
MAX_CHALLENGES_PER_NODE = 64
#: Largest prompt pool (indices are u32).
MAX_POOL_SIZE = 2**32 - 1
#: Most entries of a sampling-parameter menu.
MAX_SAMPLING_OPTIONS = 256
#: Most retries of a failed epoch (attempts are u32; far more than the validators).
MAX_ATTEMPTS = 2**32 - 1
#: What a verifier's check of an EPOCH_REPORT answers while it still re-scores the report:
#: the validator (:mod:`ps_p2p.registry.validator`, its ``value_check``) then defers its
#: answer instead of refusing the value.
VALUE_CHECK_PENDING = "value check pending"
#: Largest epoch number (u64).
MAX_EPOCH = 2**64 - 1
#: Default |own - proposed| accepted per credibility score (docstring of within_tolerance).
DEFAULT_TOLERANCE = 0.02
#: Longest plan bytes: MAX_PLAN_CHALLENGES challenges of (4 + 38 + 4 + 4) bytes, plus header.
MAX_PLAN_BYTES = len(PLAN_DOMAIN) + 4 + HASH_BYTES + 4 + MAX_PLAN_CHALLENGES * (
    4 + ED25519_PEER_ID_BYTES + 8
)
_U64 = 2**64


# ------------------------------------------------------------------------------------ leader


def leader(
    epoch: int, prev_hash: bytes, validators: Sequence[Validator], *, attempt: int = 0
) -> bytes:
    """The leader of ``epoch`` (attempt ``attempt``), drawn by voting power; pure.

    Every verifier computes the same leader from committed data; each validator is picked with
    probability power / total power (module docstring, "leader draw").

    Args:
        epoch: the epoch e, in [0, 2**64).
        prev_hash: the block ID of epoch e-1's last committed block, 32 bytes.
        validators: the eligible validators (those holding a seed commitment for e), any
            order; Ed25519 peer IDs, powers >= 1.
        attempt: 0, then 1, 2, ... when the previous attempt's leader did not run the epoch.

    Returns:
        The leader's address (peer ID bytes).

    Raises:
        ValueError: ``epoch``, ``attempt`` or ``prev_hash`` out of range.
        LocalProtocolError: an invalid validator set (empty, duplicate, bad power).
    """
    _check_epoch(epoch)
    _check_attempt(attempt)
    _check_hash(prev_hash, "prev_hash")
    total = check_validators(validators)
    digest = hashlib.sha256(LEADER_DOMAIN + u64(epoch) + u32(attempt) + lp(bytes(prev_hash)))
    draw = int.from_bytes(digest.digest(), "big") % total
    for v in sorted(validators, key=lambda v: bytes(v.address)):
        if draw < v.power:
            return bytes(v.address)
        draw -= v.power
    raise AssertionError("unreachable: draw < total power")  # pragma: no cover


# ------------------------------------------------------------------------ seed commit-reveal


def derive_secret(master_key: bytes, chain_id: str, epoch: int) -> bytes:
    """A validator's secret for ``epoch``: HMAC-SHA256(master_key, SECRET_DERIVE_DOMAIN ||
    str(chain_id) || u64(epoch)).

    Deterministic, so a restarted validator reveals the secret it committed without storing it;
    ``master_key`` (>= 32 bytes, kept with the validator key, never sent) must stay secret:
    whoever holds it can compute every plan the validator would lead.

    Raises:
        ValueError: ``master_key`` shorter than 32 bytes, or ``epoch`` out of range.
    """
    if not isinstance(master_key, (bytes, bytearray)) or len(master_key) < SECRET_BYTES:
        raise ValueError(f"master_key must be at least {SECRET_BYTES} bytes")
    _check_epoch(epoch)
    message = SECRET_DERIVE_DOMAIN + lps(chain_id) + u64(epoch)
    return hmac.new(bytes(master_key), message, hashlib.sha256).digest()


def seed_commitment(chain_id: str, epoch: int, validator: bytes, secret: bytes) -> bytes:
    """c = SHA-256(SEED_COMMIT_DOMAIN || str(chain_id) || u64(epoch) || bytes(validator) ||
    bytes(secret)), what a validator commits for ``epoch`` (32 bytes).

    Raises:
        ValueError: ``secret`` not 32 bytes, ``epoch`` out of range.
    """
    _check_epoch(epoch)
    _check_secret(secret, ValueError)
    return hashlib.sha256(
        SEED_COMMIT_DOMAIN + lps(chain_id) + u64(epoch) + lp(bytes(validator)) + lp(bytes(secret))
    ).digest()


def check_reveal(
    commitment: bytes, chain_id: str, epoch: int, validator: bytes, secret: bytes
) -> None:
    """Check that ``secret`` opens ``validator``'s ``commitment`` for ``epoch``.

    Raises:
        InvalidRevealError: ``secret`` is not 32 bytes or does not open the commitment
            (constant-time comparison).
    """
    _check_secret(secret, InvalidRevealError)
    expected = seed_commitment(chain_id, epoch, validator, secret)
    if not hmac.compare_digest(expected, bytes(commitment)):
        raise InvalidRevealError(
            f"revealed secret of {peer_label(bytes(validator))} does not open its commitment "
            f"for epoch {epoch}"
        )


def epoch_seed(
    chain_id: str, epoch: int, prev_hash: bytes, leader_address: bytes, secret: bytes,
    *, attempt: int = 0,
) -> bytes:
    """The seed of the plan of ``epoch`` (module docstring), 32 bytes.

    Args:
        chain_id: the chain.
        epoch: e.
        prev_hash: block ID of e-1's last block (the leader's draw input too).
        leader_address: the leader of (e, ``attempt``).
        secret: the leader's revealed secret for e (checked with :func:`check_reveal`).

    Raises:
        ValueError: an argument out of range.
    """
    _check_epoch(epoch)
    _check_attempt(attempt)
    _check_hash(prev_hash, "prev_hash")
    _check_secret(secret, ValueError)
    return hashlib.sha256(
        SEED_DOMAIN + lps(chain_id) + u64(epoch) + u32(attempt) + lp(bytes(prev_hash))
        + lp(bytes(leader_address)) + lp(bytes(secret))
    ).digest()


# -------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, order=True)
class Challenge:
    """One planned challenge.

    Attributes:
        model_node: the challenged model node's peer ID.
        prompt_index: index into the committed prompt pool.
        sampling: index into the committed menu of ordinary sampling parameters.
    """

    model_node: bytes
    prompt_index: int
    sampling: int = 0


@dataclass(frozen=True)
class Plan:
    """The challenges of one epoch, ascending by (model node, prompt index).

    Attributes:
        seed: the epoch's seed (32 bytes) it was derived from.
        challenges: the challenges.
    """

    seed: bytes
    challenges: tuple[Challenge, ...]

    @property
    def model_nodes(self) -> tuple[bytes, ...]:
        """The challenged model nodes, ascending, each once."""
        return tuple(sorted({c.model_node for c in self.challenges}))

    def for_node(self, model_node: bytes) -> tuple[Challenge, ...]:
        """The challenges of ``model_node`` (empty when it is not in the plan)."""
        return tuple(c for c in self.challenges if c.model_node == model_node)

    def encode(self) -> bytes:
        """The canonical plan bytes (module docstring)."""
        parts = [PLAN_DOMAIN, lp(self.seed), u32(len(self.challenges))]
        for c in self.challenges:
            parts += [lp(c.model_node), u32(c.prompt_index), u32(c.sampling)]
        return b"".join(parts)

    def hash(self) -> bytes:
        """SHA-256 of :meth:`encode` (32 bytes)."""
        return hashlib.sha256(self.encode()).digest()


def derive_plan(
    seed: bytes,
    model_nodes: Iterable[bytes],
    pool_size: int,
    challenges_per_node: int = 1,
    *,
    max_nodes: int | None = None,
    exclude: Iterable[int] = (),
    sampling_options: int = 1,
) -> Plan:
    """The plan that ``seed`` and the registry determine (module docstring); pure.

    Args:
        seed: the epoch's seed (:func:`epoch_seed`), 32 bytes.
        model_nodes: the peer IDs of the model nodes to challenge (the registry's model nodes at
            the epoch's start, e.g. all of them or all trusted ones), distinct, any order.
        pool_size: prompts in the committed pool, in [1, 2**32).
        challenges_per_node: distinct prompts per model node, in [1, 64].
        max_nodes: challenge only this many nodes, drawn by the seed (None: all).
        exclude: pool indices never to use (e.g. prompts revealed in earlier epochs).
        sampling_options: entries in the committed menu of sampling parameters, in [1, 256].

    Returns:
        The plan; every prompt index is distinct, in [0, pool_size) and not excluded.

    Raises:
        ValueError: an argument out of range, a model node listed twice or not an Ed25519 peer
            ID, more than :data:`MAX_PLAN_CHALLENGES` challenges, or fewer usable prompts than
            challenges.
    """
    _check_hash(seed, "seed")
    nodes = _distinct_nodes(model_nodes)
    _check_int(pool_size, "pool_size", 1, MAX_POOL_SIZE)
    _check_int(challenges_per_node, "challenges_per_node", 1, MAX_CHALLENGES_PER_NODE)
    _check_int(sampling_options, "sampling_options", 1, MAX_SAMPLING_OPTIONS)
    if max_nodes is not None:
        _check_int(max_nodes, "max_nodes", 0, MAX_PLAN_CHALLENGES)
        if len(nodes) > max_nodes:
            ranked = sorted(nodes, key=lambda n: hashlib.sha256(
                NODE_RANK_DOMAIN + lp(seed) + lp(n)).digest())
            nodes = sorted(ranked[:max_nodes])
    slots = len(nodes) * challenges_per_node
    if slots > MAX_PLAN_CHALLENGES:
        raise ValueError(f"{slots} challenges (max {MAX_PLAN_CHALLENGES}): set max_nodes")
    # indices past the pool cannot be drawn anyway; a negative or non-integer one is a bug
    excluded = sorted({_check_int(i, "excluded index", 0, MAX_POOL_SIZE) for i in exclude})
    excluded = excluded[:bisect.bisect_left(excluded, pool_size)]
    available = pool_size - len(excluded)
    if slots > available:
        raise ValueError(f"{slots} challenges but only {available} usable prompts in the pool")
    draws = CounterDraws(PLAN_DRAW_DOMAIN + lp(bytes(seed)))
    swapped: dict[int, int] = {}  # sparse Fisher-Yates over positions [0, available)
    picks: list[int] = []
    for i in range(slots):
        j = i + draws.below(available - i)
        picks.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    prompts = [_nth_not_excluded(p, excluded) for p in picks]
    sampling = [draws.below(sampling_options) for _ in range(slots)]
    challenges = [
        Challenge(node, prompts[k * challenges_per_node + s], sampling[k * challenges_per_node + s])
        for k, node in enumerate(nodes) for s in range(challenges_per_node)
    ]
    return Plan(bytes(seed), tuple(sorted(challenges)))


def verify_plan(claimed: Plan, expected: Plan, registry: Iterable[bytes] = ()) -> None:
    """Check a leader's claimed plan against the one this verifier derived.

    Args:
        claimed: the plan the leader's proposal names (e.g. :func:`decode_plan`).
        expected: :func:`derive_plan` on the revealed seed and this verifier's registry.
        registry: the registry's model nodes, to name the fault when the claim lists a node
            that is not registered at all.

    Raises:
        InvalidPlanError: another seed; a node not in the registry; a prompt twice; or any
            other difference (the first one is named).
    """
    if claimed.seed != expected.seed:
        raise InvalidPlanError("plan derived from another seed than the revealed one")
    known = set(registry) | set(expected.model_nodes)
    for c in claimed.challenges:
        if c.model_node not in known:
            raise InvalidPlanError(
                f"plan names {peer_label(c.model_node)}, which is not a registered model node"
            )
    prompts = [c.prompt_index for c in claimed.challenges]
    if len(set(prompts)) != len(prompts):
        raise InvalidPlanError("plan asks one prompt twice")
    if claimed.challenges == expected.challenges:
        return
    for i, (a, b) in enumerate(zip(claimed.challenges, expected.challenges)):
        if a != b:
            raise InvalidPlanError(
                f"plan differs from the committed one at challenge {i}: {peer_label(a.model_node)}"
                f" prompt {a.prompt_index} instead of {peer_label(b.model_node)} prompt "
                f"{b.prompt_index}"
            )
    raise InvalidPlanError(
        f"plan has {len(claimed.challenges)} challenges, the committed one "
        f"{len(expected.challenges)}"
    )


def decode_plan(data: bytes) -> Plan:
    """Parse canonical plan bytes from a peer (strict: only :meth:`Plan.encode`'s output).

    Raises:
        InvalidPlanError: malformed, over :data:`MAX_PLAN_CHALLENGES`, not ascending (so not
            canonical), a node ID that is not 38 bytes, or a prompt index used twice.
    """
    if isinstance(data, (bytes, bytearray)) and len(data) > MAX_PLAN_BYTES:
        raise InvalidPlanError(f"plan of {len(data)} bytes (max {MAX_PLAN_BYTES})")
    r = Reader(data, InvalidPlanError, "plan")
    r.prefix(PLAN_DOMAIN, "plan domain")
    seed = r.lp("seed", HASH_BYTES, exact=HASH_BYTES)
    n = r.u32("challenge count")
    if n > MAX_PLAN_CHALLENGES:
        raise r.fail(f"{n} challenges (max {MAX_PLAN_CHALLENGES})")
    challenges = []
    for _ in range(n):
        node = r.lp("model node", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES)
        challenges.append(Challenge(node, r.u32("prompt index"), r.u32("sampling option")))
    r.done()
    if any(a >= b for a, b in itertools.pairwise(challenges)):
        raise r.fail("challenges not in ascending order")
    if len({c.prompt_index for c in challenges}) != n:
        raise InvalidPlanError("malformed plan: a prompt index used twice")
    return Plan(seed, tuple(challenges))


# ------------------------------------------------------------------------------------ misses


class MissTally:
    """Reports of missing or invalid responses in one epoch, by voting power (module docstring,
    "Misses"); pure.

    Args:
        validators: the committee (its powers count).
        model_nodes: the nodes of the epoch's plan (reports name only these).

    Raises:
        LocalProtocolError: an invalid validator set.
    """

    def __init__(self, validators: Sequence[Validator], model_nodes: Iterable[bytes]) -> None:
        self._total = check_validators(validators)
        self._power = {bytes(v.address): v.power for v in validators}
        self._reports: dict[bytes, set[bytes]] = {bytes(n): set() for n in model_nodes}

    @property
    def total_power(self) -> int:
        return self._total

    def report(self, validator: bytes, model_node: bytes) -> bool:
        """Count ``validator``'s report that ``model_node`` missed; duplicates count once.

        Returns:
            True when the report is new, False for a duplicate (ignored).

        Raises:
            VerificationError: ``validator`` not in the committee, or ``model_node`` not in the
                epoch's plan.
        """
        validator, model_node = bytes(validator), bytes(model_node)
        if validator not in self._power:
            raise VerificationError(f"miss report from {peer_label(validator)}, not a validator")
        reporters = self._reports.get(model_node)
        if reporters is None:
            raise VerificationError(
                f"miss report for {peer_label(model_node)}, which is not in the epoch's plan"
            )
        if validator in reporters:
            return False
        reporters.add(validator)
        return True

    def reported_power(self, model_node: bytes) -> int:
        """The voting power that reported ``model_node`` (0 for a node not in the plan)."""
        return sum(self._power[v] for v in self._reports.get(bytes(model_node), ()))

    def missed(self, model_node: bytes) -> bool:
        """More than 1/3 of the total power reported ``model_node`` (3 * reported > total)."""
        return 3 * self.reported_power(model_node) > self._total

    def missed_nodes(self) -> list[bytes]:
        """The nodes whose miss counts, ascending."""
        return [n for n in sorted(self._reports) if self.missed(n)]


# ---------------------------------------------------------------------------- scores, times


def within_tolerance(own: float, proposed: float, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """True when a leader's proposed credibility is close enough to this verifier's own.

    A verifier prevotes for a reputation update only if every proposed score passes
    (|own - proposed| <= ``tolerance``); the committed value is the leader's. The default 0.02
    is six times the largest difference measured between an fp32 and a bf16 verifier on the same
    greedy answer (0.003, stories260K at the default scoring temperature); one-pass and per-token
    scoring differ by ~1e-7. It bounds what a lying leader gains: 0.02 per score, 0.012 of
    reputation per epoch at beta = 0.6.

    Args:
        own: this verifier's score, in [0, 1].
        proposed: the leader's score, in [0, 1].
        tolerance: in [0, 1].

    Raises:
        InvalidScoreError: ``own`` or ``proposed`` not a number in [0, 1].
        ValueError: ``tolerance`` out of [0, 1].
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
            or not math.isfinite(tolerance) or not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"tolerance must be in [0, 1], not {tolerance!r}")
    return abs(check_score(own) - check_score(proposed, "proposed score")) <= tolerance


def check_scores(
    own: Mapping[bytes, float], proposed: Mapping[bytes, float],
    tolerance: float = DEFAULT_TOLERANCE,
) -> None:
    """Check every proposed score against this verifier's own (keyed alike, e.g. by model node).

    Raises:
        InvalidScoreError: a score not in [0, 1].
        VerificationError: the keys differ, or a score is off by more than ``tolerance``.
    """
    if set(own) != set(proposed):
        raise VerificationError("proposed scores are not for the challenges this verifier scored")
    for key in sorted(own):
        if not within_tolerance(own[key], proposed[key], tolerance):
            raise VerificationError(
                f"proposed score {proposed[key]!r} for {peer_label(key)} is off the verifier's "
                f"{own[key]!r} by more than {tolerance}"
            )


def check_response_time(
    signed_at_ms: int, epoch_start_ms: int, epoch_end_ms: int,
    max_skew_ms: int = MAX_CLOCK_SKEW_MS,
) -> None:
    """Check that a challenge response was signed within its epoch.

    A response signed before the epoch started (a replay of an old answer) or after it ended is
    refused; ``max_skew_ms`` allows for the model node's clock (block times are the
    proposers').

    Args:
        signed_at_ms: the response's signing time (unix ms, in the signed response bytes).
        epoch_start_ms, epoch_end_ms: block times of the epoch's first block and of the block
            that carries the proposal.
        max_skew_ms: >= 0.

    Raises:
        VerificationError: outside [start - skew, end + skew].
        ValueError: ``epoch_end_ms`` before ``epoch_start_ms`` or a negative skew.
    """
    if epoch_end_ms < epoch_start_ms or max_skew_ms < 0:
        raise ValueError("epoch end before its start, or a negative skew")
    if signed_at_ms < epoch_start_ms - max_skew_ms:
        raise VerificationError(
            f"response signed at {signed_at_ms} ms, before its epoch began ({epoch_start_ms} ms)"
        )
    if signed_at_ms > epoch_end_ms + max_skew_ms:
        raise VerificationError(
            f"response signed at {signed_at_ms} ms, after its epoch ended ({epoch_end_ms} ms)"
        )


# -------------------------------------------------------------------------------- internals


class CounterDraws:
    """Uniform draws from SHA-256 in counter mode: block k = SHA-256(``key`` || u64(k)), read as
    four big-endian 64-bit words, last first. Deterministic given ``key``: every verifier that
    knows it draws the same (the plan draws of the module docstring; the challenges' requests,
    :mod:`ps_p2p.verification.challenges`)."""

    def __init__(self, key: bytes) -> None:
        self._key = bytes(key)
        self._counter = 0
        self._words: list[int] = []

    def word(self) -> int:
        """The next uniform integer in [0, 2**64)."""
        if not self._words:
            block = hashlib.sha256(self._key + u64(self._counter)).digest()
            self._counter += 1
            self._words = [int.from_bytes(block[i:i + 8], "big") for i in range(24, -1, -8)]
        return self._words.pop()

    def below(self, n: int) -> int:
        """A uniform integer in [0, n), 1 <= n <= 2**64 (rejection sampling: no modulo bias)."""
        limit = _U64 - _U64 % n
        while True:
            w = self.word()
            if w < limit:
                return w % n


def _nth_not_excluded(n: int, excluded: list[int]) -> int:
    """The n-th (0-based) integer >= 0 that is not in the sorted list ``excluded``."""
    lo, hi = n, n + len(excluded)
    while lo < hi:  # smallest x with x + 1 - #(excluded <= x) > n
        mid = (lo + hi) // 2
        if mid + 1 - bisect.bisect_right(excluded, mid) > n:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _distinct_nodes(model_nodes: Iterable[bytes]) -> list[bytes]:
    nodes = [bytes(n) for n in model_nodes]
    if len(set(nodes)) != len(nodes):
        raise ValueError("a model node is listed twice")
    for n in nodes:
        if len(n) != ED25519_PEER_ID_BYTES:
            raise ValueError(f"model node ID of {len(n)} bytes is not an Ed25519 peer ID")
    return sorted(nodes)


def _check_int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], not {value!r}")
    return value


def _check_epoch(epoch: int) -> None:
    _check_int(epoch, "epoch", 0, MAX_EPOCH)


def _check_attempt(attempt: int) -> None:
    _check_int(attempt, "attempt", 0, MAX_ATTEMPTS)


def _check_hash(value: bytes, name: str) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != HASH_BYTES:
        raise ValueError(f"{name} must be {HASH_BYTES} bytes")


def _check_secret(secret: bytes, error: type[Exception]) -> None:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_BYTES:
        raise error(f"an epoch secret is {SECRET_BYTES} bytes")


__all__ = [
    "CounterDraws",
    "DEFAULT_TOLERANCE",
    "MAX_CHALLENGES_PER_NODE",
    "MAX_PLAN_CHALLENGES",
    "MAX_POOL_SIZE",
    "VALUE_CHECK_PENDING",
    "Challenge",
    "MissTally",
    "Plan",
    "check_response_time",
    "check_reveal",
    "check_scores",
    "decode_plan",
    "derive_plan",
    "derive_secret",
    "epoch_seed",
    "leader",
    "seed_commitment",
    "verify_plan",
    "within_tolerance",
]
