"""Credibility of a model node's response: its normalised perplexity under the verifier's model.

Source: PlanetServe sec. 3.4 ("Model verification", the PPL formula) and Algorithm 3
(``CHECKCREDIBILITY``). A verifier rates a model node's response ``r = (t_1, ..., t_n)`` to a
challenge prompt by how likely its own reference copy of the model finds each token given the
prompt and the tokens before it. Algorithm 3 asks the engine once per output token; here the
whole response is scored in **one forward pass** (:meth:`Engine.score`,
:meth:`Engine.score_ids`; vLLM: ``prompt_logprobs``), which gives the same per-token
log-probabilities because a causal model's prediction at position i only sees positions < i.
:func:`score_response_per_token` keeps the paper's loop as the reference implementation (the
benchmark and the equality test use it).

Definition (all logs natural)::

    T'      = scoring temperature: the challenge's requested temperature T when 0 < T <= 1,
              ScoringParams.greedy_temperature when T = 0 (greedy)
    l_i     = log p_T'(t_i | prompt, t_<i)                 (tempered_logprobs; = the engine's
                                                            log-probability when T' = 1)
    l_i'    = max(l_i, floor)                              (floor = log(epsilon), Algorithm 3 l.11)
    m       = max(n, min_tokens)                           (missing tokens count as the floor)
    C       = exp((sum_i l_i' + (m - n) * floor) / m)      = 1/PPL of the clipped sequence
    C       = 0 for an empty response

so C is in [exp(floor), 1] (about [1e-4, 1] by default) for a non-empty response and 0 for an
empty one; 1 means the reference model was certain of every token. This is the paper's
"normalized perplexity 1/PPL" with three documented choices:

* **Floor.** Algorithm 3 substitutes a small constant epsilon for a token absent from the
  engine's top log-probabilities. One forward pass gives every token's exact log-probability,
  so the floor applies to the probability itself: a token the reference gives less than
  epsilon = 1e-4 counts as 1e-4. It keeps C defined for tokens of probability 0 (``-inf``,
  vLLM's -9999) and bounds what one token can move the mean (by ``|floor| / n``), so two
  verifiers whose numerics differ on a near-impossible token still agree within the tolerance.
* **Temperature.** An honest node asked for temperature T samples from p_T (the model's
  distribution with logits divided by T); the verifier scores under that same distribution, so
  the score measures "is this what the right model at the requested temperature produces".
  Under the untempered p_1 an honest answer's expected score is exp(-cross-entropy), which for a
  small model is low even for greedy answers (stories260K: ~0.54 for greedy, ~0.21 at T = 1,
  measured over 7 prompts). A greedy challenge (T = 0, the default of ``SamplingParams`` and
  so the ordinary user request) is scored under p_{0.25}: the argmax token scores near 1, any
  other token is penalised sharply. Scores at T' < 1 need the normaliser
  ``sum_j p_j^(1/T')`` over the vocabulary; the engine returns the ``top_k`` most likely tokens
  (vLLM's ``prompt_logprobs``, at most 20 by default) and the scored token's own, and the mass
  m outside them (known: 1 minus their sum) is counted as if every other token had the
  smallest top-k probability p_min (none can have more), i.e. ``m * p_min^(1/T' - 1)``. That
  is exact at T' = 1 and an upper bound on the normaliser for T' < 1, so a tempered score is
  never *over*-estimated: truncating the vocabulary can only cost a node credibility, never
  give a cheater any (a Hypothesis property in ``tests/test_scoring.py``). Challenges above
  T = 1 are refused (the bound flips there, and no ordinary request needs them). A node that
  answers with a *lower* temperature than asked scores higher: it serves the right model, and
  diversity is not checked.
* **Length.** The paper's PPL averages over the tokens received, so an answer cut short keeps a
  good score. A challenge asks for ``max_tokens``; the caller passes ``min_tokens`` (that
  number, less a small slack for re-tokenisation, or 0 when the model may have stopped) and the
  missing tokens count as the floor. Limit: a legitimate early stop cannot be told from a
  truncation without scoring the end-of-sequence token, which :meth:`Engine.score` does not do.

Token alignment: the signed answer is text, so the verifier re-tokenises it. The scored tokens
are those of ``engine.tokenize(prompt + response)`` after the prompt's own tokens (BOS
included), when the joint encoding starts with them; else ``engine.tokenize(prompt)`` followed
by ``engine.encode(response, add_special_tokens=False)`` (what :meth:`Engine.score` scores). The
joint encoding is what the model generated: a SentencePiece tokenizer encodes a text on its own
with a leading word boundary (``"`` becomes ``▁"``), and that one different first token changes
the context of every later one. Measured on 60 MT-Bench prompts, greedy 32-token answers of
stories260K scored by the same model: 22 of 60 below 0.5 (minimum 0.11) encoding the response
alone; with the joint encoding see :mod:`~ps_p2p.verification.reputation`.

Measured (stories260K, CPU, greedy challenges, 128-token answers, 30 prompts): see
:mod:`~ps_p2p.verification.reputation` (tau) for honest and dishonest scores. Scoring at
T' = 0.1 instead of 0.25 separates a noised model slightly better but lowers honest scores where
the answering node's numerics pick another of two near-tied tokens (a KV-cached decode vs the
verifier's one pass already does): honest minimum 0.47 at 0.1 vs 0.52 at 0.25. An fp32 and a
bf16 verifier differ by at most 0.003 on one answer at 0.25 (0.01 at 0.1): see
:data:`~ps_p2p.verification.epochs.DEFAULT_TOLERANCE`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ps_p2p.engines.base import Engine, TokenScores
from ps_p2p.errors import EngineError

#: Algorithm 3's epsilon as a log-probability: a token the reference model gives less than 1e-4
#: counts as 1e-4.
DEFAULT_FLOOR_LOGPROB = math.log(1e-4)
#: The temperature a greedy (T = 0) challenge is scored at.
DEFAULT_GREEDY_TEMPERATURE = 0.25
#: Most likely alternatives per position for the tempered normaliser (vLLM's default
#: ``max_logprobs`` is 20).
DEFAULT_TOP_K = 20
#: Highest challenge temperature that can be scored (module docstring, "Temperature").
MAX_CHALLENGE_TEMPERATURE = 1.0
#: Most log-probabilities one score takes: far above any context window (2**20 tokens).
MAX_SCORED_TOKENS = 1 << 20
#: Lowest floor accepted (a probability of e**-100 is already "impossible").
MIN_FLOOR_LOGPROB = -100.0


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_floor(floor: float) -> None:
    if not _is_real(floor) or not MIN_FLOOR_LOGPROB <= floor < 0.0:
        raise ValueError(
            f"floor log-probability must be in [{MIN_FLOOR_LOGPROB}, 0), not {floor!r}"
        )


@dataclass(frozen=True)
class ScoringParams:
    """How verifiers turn log-probabilities into a credibility (module docstring); committed
    in the genesis file, because verifiers must agree on it to agree on scores.

    Attributes:
        floor_logprob: log(epsilon) of Algorithm 3, in [-100, 0).
        greedy_temperature: the scoring temperature of a greedy challenge, in (0, 1].
        top_k: alternatives per position for the tempered normaliser, in [1, 1000].

    Raises:
        ValueError: a value out of its range.
    """

    floor_logprob: float = DEFAULT_FLOOR_LOGPROB
    greedy_temperature: float = DEFAULT_GREEDY_TEMPERATURE
    top_k: int = DEFAULT_TOP_K

    def __post_init__(self) -> None:
        _check_floor(self.floor_logprob)
        t = self.greedy_temperature
        if not _is_real(t) or not 0.0 < t <= MAX_CHALLENGE_TEMPERATURE:
            raise ValueError(f"greedy_temperature must be in (0, 1], not {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1000:
            raise ValueError(f"top_k must be an int in [1, 1000], not {self.top_k!r}")


DEFAULT_SCORING = ScoringParams()


def scoring_temperature(requested: float, params: ScoringParams = DEFAULT_SCORING) -> float:
    """The temperature a response is scored at, given the challenge's requested temperature.

    Args:
        requested: the challenge's ``SamplingParams.temperature``, in [0, 1].

    Returns:
        ``params.greedy_temperature`` for 0 (greedy), else ``requested``.

    Raises:
        ValueError: ``requested`` not a finite number in [0, 1] (module docstring: why not > 1).
    """
    if not _is_real(requested) or not 0.0 <= requested <= MAX_CHALLENGE_TEMPERATURE:
        raise ValueError(
            f"challenge temperature must be in [0, {MAX_CHALLENGE_TEMPERATURE}], not {requested!r}"
        )
    return params.greedy_temperature if requested == 0 else float(requested)


def tempered_logprobs(scores: TokenScores, temperature: float) -> list[float]:
    """Per-token log-probabilities under the tempered distribution p_T (module docstring).

    ``log p_T(t) = log p(t) / T - log Z`` with ``Z`` summed over ``top_logprobs`` plus the
    scored token, and the remaining mass bounded as if every other token had the smallest
    listed probability (exact at T = 1, an over-estimate of Z below, so never a higher score).

    Args:
        scores: the engine's scores; ``top_logprobs`` needed unless ``temperature`` is 1.
        temperature: in (0, 1].

    Returns:
        One value per scored token, each <= 0 (``-inf`` stays ``-inf``). At T = 1 the engine's
        log-probabilities themselves.

    Raises:
        ValueError: temperature out of (0, 1]; ``top_logprobs`` missing or not one per token; a
            log-probability that is NaN.
    """
    if not _is_real(temperature) or not 0.0 < temperature <= MAX_CHALLENGE_TEMPERATURE:
        raise ValueError(f"temperature must be in (0, 1], not {temperature!r}")
    logprobs = _checked_logprobs(scores.logprobs)
    if temperature == 1.0:
        return logprobs
    top = scores.top_logprobs
    if top is None or len(top) != len(logprobs):
        raise ValueError(
            "tempered scores need top_logprobs for every token (score_ids with top_k >= 1)"
        )
    inv = 1.0 / temperature
    out: list[float] = []
    for token, lp, alternatives in zip(scores.token_ids, logprobs, top):
        out.append(_tempered_one(token, lp, alternatives, inv))
    return out


def credibility(
    logprobs: Sequence[float], *, floor: float = DEFAULT_FLOOR_LOGPROB, min_tokens: int = 0
) -> float:
    """The credibility C (normalised perplexity 1/PPL) of one response; pure.

    Args:
        logprobs: natural-log probability of each response token under the reference model
            (already tempered when the challenge was not at T = 1: :func:`tempered_logprobs`);
            ``-inf`` allowed; small positive rounding errors count as 0. At most
            :data:`MAX_SCORED_TOKENS`.
        floor: log(epsilon), in [-100, 0): lower values are raised to it (Algorithm 3 l.11).
        min_tokens: responses shorter than this count their missing tokens at ``floor``
            (truncation, module docstring "Length"); >= 0.

    Returns:
        C in [0, 1]: ``exp(mean of the clipped log-probabilities)``, 0 for no tokens.

    Raises:
        ValueError: a NaN or non-number log-probability, more than :data:`MAX_SCORED_TOKENS`,
            a floor or ``min_tokens`` out of range.
    """
    _check_floor(floor)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) \
            or not 0 <= min_tokens <= MAX_SCORED_TOKENS:
        raise ValueError(
            f"min_tokens must be an int in [0, {MAX_SCORED_TOKENS}], not {min_tokens!r}"
        )
    values = _checked_logprobs(logprobs)
    if not values:
        return 0.0
    missing = max(0, min_tokens - len(values))
    total = math.fsum(max(v, floor) for v in values) + missing * floor
    c = math.exp(total / (len(values) + missing))
    return min(1.0, max(0.0, c))


def mean_credibility(values: Sequence[float]) -> float:
    """C(T) of an epoch: the mean of one node's (or organization's) challenge scores (paper sec.
    3.4, "by evaluating multiple challenges ... an average score C(T)").

    Raises:
        ValueError: no values, or a value that is not a finite number in [0, 1].
    """
    if not values:
        raise ValueError("no credibility values to average")
    for v in values:
        if not _is_real(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"credibility {v!r} is not a number in [0, 1]")
    return min(1.0, math.fsum(values) / len(values))


async def score_response(
    engine: Engine,
    prompt: str,
    response: str,
    *,
    temperature: float = 0.0,
    params: ScoringParams = DEFAULT_SCORING,
    min_tokens: int = 0,
) -> float:
    """Credibility of ``response`` to ``prompt`` under ``engine``'s model, in one forward pass.

    One :meth:`Engine.score_ids` (with ``top_k`` below T = 1) over the aligned tokens (module
    docstring, "Token alignment"); at T = 1 an engine without the token-level API is scored
    with :meth:`Engine.score` instead.

    Args:
        engine: the verifier's reference engine (same model as the challenged node claims).
        prompt: the prompt text the model node continued (after any chat template).
        response: the response text it signed.
        temperature: the challenge's requested temperature in [0, 1] (0: greedy).
        params: the committed scoring parameters.
        min_tokens: see :func:`credibility`.

    Returns:
        C in [0, 1].

    Raises:
        ValueError: temperature out of [0, 1], or ``min_tokens`` out of range.
        PromptTooLongError: prompt + response exceed the engine's context.
        EngineError: the engine failed, or lacks the token-level API for T < 1.
    """
    t = scoring_temperature(temperature, params)
    try:
        ids, start = await _token_ids(engine, prompt, response)
        if start == len(ids):
            return 0.0
        scores = await engine.score_ids(ids, start, top_k=0 if t == 1.0 else params.top_k)
    except EngineError:
        if t != 1.0:
            raise
        scores = await engine.score(prompt, response)  # an engine with text-level scoring only
    return credibility(
        tempered_logprobs(scores, t), floor=params.floor_logprob, min_tokens=min_tokens
    )


async def score_response_per_token(
    engine: Engine,
    prompt: str,
    response: str,
    *,
    temperature: float = 0.0,
    params: ScoringParams = DEFAULT_SCORING,
    min_tokens: int = 0,
) -> float:
    """The paper's Algorithm 3: one engine call (forward pass) per response token.

    The reference implementation of :func:`score_response` (same arguments, same result up to
    float rounding). Each call scores the next token given the prompt and the response so far
    (Algorithm 3 l.6-7, ``GetCompletionLogprobs(context, max_tokens=1)``), re-reading the whole
    context: n forward passes over growing contexts instead of one. Unlike the paper, which
    looks the token up among the engine's top log-probabilities and uses epsilon when it is
    absent, the engine here returns the token's exact log-probability, which is then floored.

    Raises:
        as :func:`score_response`; also EngineError for an engine without the token-level API.
    """
    t = scoring_temperature(temperature, params)
    ids, start = await _token_ids(engine, prompt, response)
    if start == len(ids):
        return 0.0
    top_k = 0 if t == 1.0 else params.top_k
    tokens: list[int] = []
    logprobs: list[float] = []
    top: list[dict[int, float]] = []
    for i in range(start, len(ids)):  # Algorithm 3 l.4: one call per output token
        one = await engine.score_ids(ids[: i + 1], i, top_k=top_k)
        tokens.extend(one.token_ids)
        logprobs.extend(one.logprobs)
        if top_k:
            top.extend(one.top_logprobs or [])
    scores = TokenScores(tokens, logprobs, top_logprobs=top if top_k else None)
    return credibility(
        tempered_logprobs(scores, t), floor=params.floor_logprob, min_tokens=min_tokens
    )


# ---------------------------------------------------------------------------------- internals


def _checked_logprobs(logprobs: Sequence[float]) -> list[float]:
    if len(logprobs) > MAX_SCORED_TOKENS:
        raise ValueError(f"{len(logprobs)} log-probabilities (max {MAX_SCORED_TOKENS})")
    out: list[float] = []
    for v in logprobs:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError(f"log-probability {v!r} is not a number")
        out.append(min(float(v), 0.0))
    return out


def _tempered_one(token: int, lp: float, alternatives: Mapping[int, float], inv: float) -> float:
    """log p_T(token) from its log-probability and the listed alternatives (1/T = ``inv``)."""
    if lp == -math.inf:
        return -math.inf
    listed = {int(k): min(float(v), 0.0) for k, v in alternatives.items() if not math.isnan(v)}
    # Every unlisted token is at most as likely as the least likely listed alternative (the
    # engine lists the top k); the scored token itself may be far below them, so it is not
    # part of that bound. No alternatives: only p <= 1 is known.
    p_min = min(listed.values(), default=0.0)
    listed[int(token)] = lp
    finite = [v for v in listed.values() if v > -math.inf]
    tail = max(0.0, 1.0 - math.fsum(math.exp(v) for v in finite))
    terms = [v * inv for v in finite]
    if tail > 0.0:
        terms.append(math.log(tail) + (inv - 1.0) * p_min)
    top = max(terms)
    log_z = top + math.log(math.fsum(math.exp(x - top) for x in terms))
    return min(0.0, lp * inv - log_z)


async def _token_ids(engine: Engine, prompt: str, response: str) -> tuple[list[int], int]:
    """The scored sequence (prompt tokens with BOS, then the response's) and where it starts
    (module docstring, "Token alignment")."""
    prompt_ids = list(await engine.tokenize(prompt))
    if not response:
        return prompt_ids, len(prompt_ids)
    joint = list(await engine.tokenize(prompt + response))
    if len(joint) > len(prompt_ids) and joint[:len(prompt_ids)] == prompt_ids:
        return joint, len(prompt_ids)
    response_ids = list(await engine.encode(response, add_special_tokens=False))
    return prompt_ids + response_ids, len(prompt_ids)


__all__ = [
    "DEFAULT_FLOOR_LOGPROB",
    "DEFAULT_GREEDY_TEMPERATURE",
    "DEFAULT_SCORING",
    "DEFAULT_TOP_K",
    "MAX_CHALLENGE_TEMPERATURE",
    "MAX_SCORED_TOKENS",
    "ScoringParams",
    "credibility",
    "mean_credibility",
    "score_response",
    "score_response_per_token",
    "scoring_temperature",
    "tempered_logprobs",
]
