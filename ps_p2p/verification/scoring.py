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

Challenge scores (issue 18; what the verifier service uses: :func:`score_challenge`). The
credibility above has two holes: after its first tokens an answer is conditioned on itself, so
any fluent text scores well whatever the prompt (a fixed story scored 0.757, honest 0.858),
and one scoring temperature cannot serve all asked temperatures (honest answers at T = 1
scored 0.199). A challenge score instead tests the hypothesis "this answer was sampled from
the reference model given THIS prompt at the ASKED temperature and top_p", with statistics
whose distribution under that hypothesis is known, whatever T is. With q_i the distribution
the engine samples from at answer position i (softmax(logits / T), then the top_p nucleus:
:func:`sampling_logprobs`), and f(t) = max(log q_i(t), floor)::

    z_fit = sum_i (f(t_i) - E_q_i[f]) / sqrt(sum_i Var_q_i[f] + v0)

Each term has mean 0 given the answer so far when t_i is drawn from q_i, so the sum is a
martingale and z_fit is about N(0, 1) for an honest answer at any temperature (measured on
stories260K, 40 prompts x 32 tokens per setting: honest z_fit within [-2.7, 2.3] at T = 0.3,
0.7, 1, 2 and top_p 1 or 0.9). A hotter sampler, another model, or an answer to another prompt
gives z_fit < 0 (the answer is less likely than what the model produces at T); a colder
sampler (greedy when T = 1 is asked) z_fit > 0; the test is two-sided. The prompt tie compares
each token's log-probability given the prompt with its mean given ``decoys`` other prompts of
the pool (only their last ``decoy_tokens`` tokens: a small model's next token depends mostly
on the recent context), x_i(t) = log p(t | prompt, t_<i) - mean_j log p(t | decoy_j, t_<i),
calibrated the same way under q_i::

    z_tie = sum_i (x_i(t_i) - E_q_i[x_i]) / sqrt(sum_i Var_q_i[x_i] + v0)

An honest answer has z_tie about N(0, 1); an answer written for another prompt (canned,
copied, cached) has E[x] about 0 where the honest expectation is positive, so z_tie < 0 in
proportion to how much the prompt shapes the answer. A greedy challenge has no distribution to
calibrate: the honest answer is the argmax path. The verifier makes its own greedy answer
first: the same text is honest. Otherwise (another platform's numerics may leave the path at a
near-tie) every token must be the reference's top choice within ``tie_nats``; a clear non-top
token is a *miss*. (Token by token alone, 8 of 489 honest greedy answers had 2 to 5 misses:
the signed text re-tokenises differently from the generated tokens.) The end: an answer
signed "length" must have at least max_tokens - slack tokens, one signed "stop" before that
must end where the model gives the end-of-sequence (or a stop string's tokens) probability at
least ``end_prob`` under q (greedy: the top choice); an honest node stops below that with
probability at most n * end_prob. The score (:func:`challenge_credibility`): 0 for an empty
answer or an implausible end; greedy: 1 - (misses - trim) / greedy_misses_bad; sampled: 1 for
|z_fit| and -z_tie up to z_ok, 0 from z_bad, linear between, the lower of the two. ``trim``
(default 1) leaves the most surprising token out of each statistic (and forgives one greedy
miss): the signed answer is text, and its re-tokenisation differed from the generated tokens
in 1 of 40 answers at T = 0.3.

Re-tokenisation: the signed answer is text, and the encoder may spell it with other tokens than
the model generated: it merged a generated "i", "g" into the one token "ig", which stories260K
gives e**-105 at T = 0.1, so z_fit was -6.3 and an honest answer scored 0 (1 in 1,000 honest
answers at T = 0.1-0.2 with top_p < 1; ``trim`` forgives one token, but the merge also changes
the next token's context). An answer with *implausible* tokens (sampled: probability below
exp(stat_floor) under the asked sampling distribution, so outside the top_p nucleus too;
greedy: not the top choice within ``tie_nats``), at most ``retokenise_max`` of them, is
re-spelt: each implausible token is replaced by a plausible token of the same text (a byte
fallback such as ``<0x65>`` for "e"), or split into two tokens spelling the same text whose
first the model finds plausible (the second ranked by the row after the old token), or merged
with the token before into one it finds plausible; the decoded text must stay the same. Where
the joint encoding merges the prompt's last characters with the answer's first (a prompt ending
"...js", an answer "een": "se"), the answer is spelt by the joint encoding's tokens after the
straddling one and one or two tokens for the rest of its text, not encoded on its own (which
adds a word boundary, "▁e", another text); :func:`_answer_ids`. These causes made the 3 honest
zeros of the bench's bank (T = 0.1 / top_p 0.9, T = 0.2 / 0.95: the boundary; T = 1.0 / 0.95:
tokens outside the nucleus). One more forward pass scores the new spelling, up to
``retokenise_rounds`` rounds, and the spelling with the fewest implausible tokens is scored. It
never changes the text, so an answer the model would not write stays implausible in every
spelling (a test). Cost: nothing for an answer without implausible tokens; at most
``retokenise_rounds`` more passes otherwise.

Cost: one forward pass over prompt + answer and one per decoy
(batched in :meth:`Engine.logprob_rows`); on stories260K with 4 decoys, 32-token answers,
13.9 ms CPU per scored challenge against 6.5 ms for :func:`score_response` (2 shared cores,
load average ~6). :func:`challenge_stats_many` scores many answers with one ``logprob_rows``
call (the transformers engine batches it and runs a prompt shared by several answers once):
4-6 ms per challenge in ``bench_reputation.py``'s epochs (load average 30-50).

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

from ps_p2p.engines.base import Engine, SamplingParams, TokenScores
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




# ------------------------------------------------------------------ challenge scores (issue 18)
#
# Module docstring, "Challenge scores": a calibrated test of "this answer was sampled from the
# reference model, at the asked temperature and top_p, given THIS prompt".

#: Log-probability floor of the sampling-distribution statistics (a token outside the nucleus,
#: or of probability below 1e-6, counts as 1e-6): bounds one token's weight in a sum.
DEFAULT_STAT_FLOOR = math.log(1e-6)
#: |z| at or below which a calibrated statistic costs nothing, and at or above which the
#: score is 0 (linear between).
DEFAULT_Z_OK = 2.5
DEFAULT_Z_BAD = 4.5
#: Added to the variance of a sum of per-token terms: keeps z finite when the sampling
#: distribution is (nearly) deterministic, and makes one surprising token in an otherwise
#: certain answer cost at most |floor| / sqrt(1 + ...) standard deviations.
DEFAULT_VARIANCE_PRIOR = 1.0
#: A greedy answer's token counts as the model's top choice when its log-probability is within
#: this many nats of the top one (numerics: fp32 vs bf16, a KV-cached decode vs one pass).
DEFAULT_TIE_NATS = 0.05
#: Clear non-top tokens that make a greedy answer score 0 (linear from 1 at none).
DEFAULT_GREEDY_MISSES_BAD = 2
#: An answer that says "stop" before max_tokens must end where the model gives the end of the
#: sequence at least this probability under the asked sampling distribution (greedy: the end
#: must be the top choice, within DEFAULT_TIE_NATS). An honest node stops at a point below it
#: with probability at most n * DEFAULT_END_PROB over an n-token answer.
DEFAULT_END_PROB = 1e-4
#: Decoy prompts an answer's likelihood is compared against.
DEFAULT_DECOYS = 4
#: Tokens of a decoy prompt kept as the answer's context (its first, and its last ones): the
#: answer's likelihood depends mostly on the recent context, and a shorter one costs less.
DEFAULT_DECOY_TOKENS = 32
#: Most surprising tokens per answer left out of each statistic (re-tokenisation).
DEFAULT_TRIM = 1
#: Re-tokenisation repairs (module docstring, "Re-tokenisation"): rounds of one more forward
#: pass each, and the most implausible tokens an answer may have for a repair to be tried.
DEFAULT_RETOKENISE_ROUNDS = 2
DEFAULT_RETOKENISE_MAX = 8


@dataclass(frozen=True)
class ChallengeScoring:
    """Parameters of :func:`challenge_credibility` (module docstring, "Challenge scores"); a
    genesis parameter set, since verifiers must agree on them.

    Attributes:
        stat_floor: log-probability floor of the statistics, in [-100, 0).
        z_ok, z_bad: 0 <= z_ok < z_bad: |z| up to z_ok scores 1, from z_bad 0.
        variance_prior: > 0, added to a statistic's variance.
        tie_nats: >= 0, greedy near-tie allowance.
        greedy_misses_bad: >= 1 clear non-top tokens that score 0.
        end_prob: in (0, 1), the least probability of a claimed end.
        decoys: decoy prompts per challenge, in [0, 64] (0: no prompt tie).
        min_tokens_slack: tokens a "length" answer may lack (re-tokenisation), >= 0.
        trim: tokens per answer left out of each statistic (the most surprising ones; greedy:
            misses forgiven), in [0, 64]: a re-tokenised answer may differ from what the model
            generated in a token (measured: 1 of 40 answers at T = 0.3, top_p = 0.9).
        decoy_tokens: tokens of each decoy prompt used, >= 2 (its first and its last ones).
        retokenise_rounds: re-tokenisation rounds (one more forward pass each), in [0, 8].
        retokenise_max: most implausible tokens of an answer for which a re-tokenisation is
            tried (more: the answer is scored as encoded), >= 0.
    """

    stat_floor: float = DEFAULT_STAT_FLOOR
    z_ok: float = DEFAULT_Z_OK
    z_bad: float = DEFAULT_Z_BAD
    variance_prior: float = DEFAULT_VARIANCE_PRIOR
    tie_nats: float = DEFAULT_TIE_NATS
    greedy_misses_bad: int = DEFAULT_GREEDY_MISSES_BAD
    end_prob: float = DEFAULT_END_PROB
    decoys: int = DEFAULT_DECOYS
    min_tokens_slack: int = 8
    trim: int = DEFAULT_TRIM
    decoy_tokens: int = DEFAULT_DECOY_TOKENS
    retokenise_rounds: int = DEFAULT_RETOKENISE_ROUNDS
    retokenise_max: int = DEFAULT_RETOKENISE_MAX

    def __post_init__(self) -> None:
        _check_floor(self.stat_floor)
        if not (_is_real(self.z_ok) and _is_real(self.z_bad) and 0 <= self.z_ok < self.z_bad):
            raise ValueError("need 0 <= z_ok < z_bad")
        if not _is_real(self.variance_prior) or self.variance_prior <= 0:
            raise ValueError("variance_prior must be > 0")
        if not _is_real(self.tie_nats) or self.tie_nats < 0:
            raise ValueError("tie_nats must be >= 0")
        for name, lo, hi in (("greedy_misses_bad", 1, 1 << 20), ("decoys", 0, 64), ("trim", 0, 64),
                             ("decoy_tokens", 2, 1 << 20), ("retokenise_rounds", 0, 8),
                             ("retokenise_max", 0, 1 << 20),
                             ("min_tokens_slack", 0, 4096)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], not {v!r}")
        if not _is_real(self.end_prob) or not 0 < self.end_prob < 1:
            raise ValueError("end_prob must be in (0, 1)")


DEFAULT_CHALLENGE_SCORING = ChallengeScoring()


@dataclass(frozen=True)
class AnswerStats:
    """What :func:`answer_stats` measured on one answer (module docstring, "Challenge scores").

    Attributes:
        tokens: scored answer tokens n.
        greedy: the challenge was greedy (T = 0).
        z_fit: sampled: the calibrated log-likelihood statistic under the asked distribution
            (~N(0, 1) for an honest answer; < 0: less likely than the right model at that
            temperature produces, > 0: more likely, e.g. a lower temperature). 0 when greedy.
        z_tie: sampled: the calibrated prompt-versus-decoys statistic (~N(0, 1) honest; < 0:
            the answer fits the decoy prompts as well as its own). 0 without decoys.
        misses: greedy: tokens that are clearly not the model's top choice.
        end_ok: the claimed end (finish reason) is plausible.
    """

    tokens: int
    greedy: bool
    z_fit: float
    z_tie: float
    misses: int
    end_ok: bool


def sampling_logprobs(rows, temperature: float, top_p: float = 1.0):  # type: ignore[no-untyped-def]
    """log q: the distribution an engine samples from at ``temperature`` and ``top_p``, per row.

    The same transformation as the engine's sampler: softmax(logits / T), then the smallest
    set of most likely tokens whose mass reaches ``top_p`` (the first always kept; the others
    kept while the mass before them is below top_p), renormalised.

    Args:
        rows: float array (positions, vocab) of natural-log probabilities (log-softmax).
        temperature: > 0.
        top_p: in (0, 1].

    Returns:
        Array of the same shape, -inf outside the nucleus.
    """
    import numpy as np

    z = np.asarray(rows, dtype=np.float64) / float(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    if top_p < 1.0:
        order = np.argsort(-logq, axis=-1, kind="stable")
        sorted_q = np.exp(np.take_along_axis(logq, order, axis=-1))
        before = np.cumsum(sorted_q, axis=-1) - sorted_q
        keep_sorted = before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        mass = np.where(keep, np.exp(logq), 0.0).sum(axis=-1, keepdims=True)
        logq = np.where(keep, logq - np.log(mass), -np.inf)
    return logq


def _calibrated(values, weights, observed, trim: int = 0):  # type: ignore[no-untyped-def]
    """(sum of observed - E) and sum of Var of per-row values under the row weights q, leaving
    out the ``trim`` rows whose observed value falls furthest below its mean."""
    import numpy as np

    mean = (weights * values).sum(axis=-1)
    var = np.maximum((weights * values * values).sum(axis=-1) - mean * mean, 0.0)
    dev = observed - mean
    if trim and len(dev) > trim:
        keep = np.argsort(dev, kind="stable")[trim:]
        dev, var = dev[keep], var[keep]
    return float(dev.sum()), float(var.sum())


def answer_stats(
    rows, tokens: Sequence[int], *, temperature: float, top_p: float = 1.0,
    decoy_rows: Sequence[object] = (), finish_reason: str = "", max_tokens: int = 0,
    end_ids: frozenset[int] | set[int] = frozenset(),
    params: ChallengeScoring = DEFAULT_CHALLENGE_SCORING,
) -> AnswerStats:
    """The statistics of one answer, from the reference model's distributions; pure.

    Args:
        rows: (n + 1, vocab) log-softmax rows given the asked prompt (:meth:`Engine.
            logprob_rows`): row i predicts token i of the answer, row n what follows it.
        tokens: the n answer tokens.
        temperature: the asked temperature, >= 0 (0: greedy).
        top_p: the asked top_p, in (0, 1].
        decoy_rows: for each decoy prompt, the (n + 1, vocab) rows of the same answer after it.
        finish_reason: the signed finish reason ("stop", "length").
        max_tokens: the asked max_tokens (0: unknown, no end check).
        end_ids: tokens that end a generation here (end-of-sequence, a stop string's).

    Raises:
        ValueError: shapes that do not fit, a temperature or top_p out of range.
    """
    import numpy as np

    if not _is_real(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature!r}")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {top_p!r}")
    r = np.asarray(rows, dtype=np.float64)
    n = len(tokens)
    if r.ndim != 2 or r.shape[0] != n + 1:
        raise ValueError(f"rows of shape {r.shape} for {n} tokens (need ({n + 1}, vocab))")
    idx = np.asarray(list(tokens), dtype=np.int64)
    pos = np.arange(n)
    greedy = temperature == 0
    ends = sorted(int(t) for t in end_ids if 0 <= int(t) < r.shape[1])
    reached = max_tokens > 0 and n >= max_tokens - params.min_tokens_slack
    if greedy:
        body = r[:n]
        gaps = body.max(axis=-1) - body[pos, idx] if n else np.zeros(0)
        misses = int((gaps > params.tie_nats).sum())
        last = r[n]
        end_gap = last.max() - max((last[e] for e in ends), default=-np.inf)
        plausible_end = bool(end_gap <= params.tie_nats)
        z_fit = z_tie = 0.0
    else:
        logq = sampling_logprobs(r, temperature, top_p)
        q = np.exp(logq)
        # a token just outside the verifier's nucleus (numerics at its edge, a re-tokenised
        # answer) counts at its tempered probability before the nucleus, never -inf
        f = np.maximum(np.maximum(logq, sampling_logprobs(r, temperature)), params.stat_floor) \
            if top_p < 1.0 else np.maximum(logq, params.stat_floor)
        s, v = _calibrated(f[:n], q[:n], f[pos, idx], params.trim) if n else (0.0, 0.0)
        z_fit = s / math.sqrt(v + params.variance_prior)
        misses = 0
        plausible_end = bool(sum(q[n][e] for e in ends) >= params.end_prob) if ends else False
        z_tie = 0.0
        if decoy_rows and n:
            d = np.mean([np.maximum(np.asarray(x, dtype=np.float64)[:n], params.stat_floor)
                         for x in decoy_rows], axis=0)
            x = np.maximum(r[:n], params.stat_floor) - d
            s, v = _calibrated(x, q[:n], x[pos, idx], params.trim)
            z_tie = s / math.sqrt(v + params.variance_prior)
    if max_tokens <= 0:
        end_ok = True
    elif finish_reason == "length":
        end_ok = reached
    else:  # "stop" (or anything else): the model must have wanted to end there
        end_ok = reached or plausible_end
    return AnswerStats(n, greedy, float(z_fit), float(z_tie), misses, end_ok)


def _ramp(x: float, ok: float, bad: float) -> float:
    return 1.0 if x <= ok else 0.0 if x >= bad else (bad - x) / (bad - ok)


def challenge_credibility(
    stats: AnswerStats, params: ChallengeScoring = DEFAULT_CHALLENGE_SCORING
) -> float:
    """C in [0, 1] of one challenge answer from its :class:`AnswerStats`; pure.

    Greedy: 1 - misses / greedy_misses_bad (clipped). Sampled: the lower of the two calibrated
    statistics' scores, each 1 for |z| <= z_ok (z_tie: only its negative side counts), 0 from
    z_bad, linear between. 0 for an empty answer or an implausible end.
    """
    if stats.tokens == 0 or not stats.end_ok:
        return 0.0
    if stats.greedy:
        misses = max(0, stats.misses - params.trim)
        return max(0.0, 1.0 - misses / params.greedy_misses_bad)
    fit = _ramp(abs(stats.z_fit), params.z_ok, params.z_bad)
    tie = _ramp(-stats.z_tie, params.z_ok, params.z_bad)
    return min(fit, tie)


async def challenge_stats(
    engine: Engine,
    prompt: str,
    response: str,
    *,
    temperature: float,
    top_p: float = 1.0,
    max_tokens: int = 0,
    finish_reason: str = "",
    stop: Sequence[str] = (),
    decoys: Sequence[str] = (),
    params: ChallengeScoring = DEFAULT_CHALLENGE_SCORING,
) -> AnswerStats:
    """:func:`answer_stats` of ``response`` to ``prompt`` under ``engine``'s model.

    Greedy (``temperature`` 0, ``max_tokens`` given): first the reference's own greedy answer
    (one :meth:`Engine.complete`); the same text scores as honest at once. Otherwise one
    :meth:`Engine.logprob_rows` call: the answer's tokens (module docstring, "Token
    alignment") after the prompt and after each decoy prompt (a decoy that would not fit the
    context with the answer is left out). End tokens: the engine's end-of-sequence tokens, and
    for each ``stop`` string every token whose text contains its first character.

    Raises:
        ValueError: a parameter out of range.
        PromptTooLongError: prompt + response exceed the engine's context.
        EngineError: the engine failed or has no ``logprob_rows``.
    """
    return (await challenge_stats_many(engine, [{
        "prompt": prompt, "response": response, "temperature": temperature, "top_p": top_p,
        "max_tokens": max_tokens, "finish_reason": finish_reason, "stop": stop,
        "decoys": decoys, "params": params}]))[0]


async def challenge_stats_many(
    engine: Engine, answers: Sequence[Mapping[str, object]]
) -> list[AnswerStats]:
    """:func:`challenge_stats` of several answers (each a mapping of its keyword arguments,
    ``prompt`` and ``response`` included), with ONE :meth:`Engine.logprob_rows` call for all
    of them (an engine may batch its forward passes), one more for each re-tokenisation round
    that some answer needs (module docstring, "Re-tokenisation"; at most
    ``params.retokenise_rounds``), and one reference greedy answer per (prompt, max_tokens).
    The same statistics as one call each, up to the float rounding of batched forward passes.

    Raises:
        as :func:`challenge_stats` (for any of the answers).
    """
    import numpy as np

    own: dict[tuple[str, int], str] = {}
    done: list[AnswerStats | None] = []
    jobs: list[_Job] = []
    for a in answers:
        prompt, response = str(a["prompt"]), str(a["response"])
        temperature = a["temperature"]
        max_tokens = int(a.get("max_tokens", 0))  # type: ignore[call-overload]
        params = a.get("params", DEFAULT_CHALLENGE_SCORING)
        assert isinstance(params, ChallengeScoring)
        if temperature == 0 and max_tokens > 0 and response:
            # greedy is deterministic: the reference's own answer, text for text, is the
            # honest one (its re-tokenisation may differ from the generated tokens: 8 of 489
            # honest greedy answers had 2 to 5 "misses" at the token level for that reason)
            key = (prompt, max_tokens)
            if key not in own:
                own[key] = (await engine.complete(
                    prompt, SamplingParams(max_tokens=max_tokens))).text
            if own[key] == response:
                n = len(await engine.encode(response, add_special_tokens=False))
                done.append(AnswerStats(n, True, 0.0, 0.0, 0, True))
                continue
        ids, start = await _answer_ids(engine, prompt, response)
        decoys: list[list[int]] = []
        if start < len(ids) and temperature > 0:  # type: ignore[operator]
            for decoy in list(a.get("decoys", ()))[: params.decoys]:  # type: ignore[call-overload]
                d = list(await engine.tokenize(decoy))
                if len(d) > params.decoy_tokens:  # its first token (BOS) and its last ones
                    d = d[:1] + d[len(d) - params.decoy_tokens + 1:]
                decoys.append(d)
        jobs.append(_Job(len(done), a, params, list(ids[:start]), list(ids[start:]), decoys))
        done.append(None)
    todo = jobs
    for round_ in range(1 + max((j.params.retokenise_rounds for j in jobs), default=0)):
        sequences: list[tuple[Sequence[int], int]] = []
        spans = []
        for job in todo:
            first = len(sequences)
            sequences += job.sequences(engine.max_context)
            spans.append((job, first, len(sequences)))
        rows = await engine.logprob_rows(sequences) if sequences else []
        again: list[_Job] = []
        for job, first, end in spans:
            r = np.asarray(rows[first], dtype=np.float64)
            bad = _implausible(r, job.answer, job.temperature, job.params, job.top_p)
            if job.best is None or len(bad) < job.best[0]:
                job.best = (len(bad), list(job.answer), r, list(rows[first + 1:end]))
            if bad and round_ < job.params.retokenise_rounds:
                repaired = await _retokenised(engine, job, r, bad)
                if repaired is not None:
                    job.answer = repaired
                    again.append(job)
        todo = again
        if not todo:
            break
    for job in jobs:
        a, params = job.answer_kwargs, job.params
        assert job.best is not None
        _, answer, r, decoy_rows = job.best
        ends = set(engine.end_token_ids)
        for s in a.get("stop", ()):  # type: ignore[attr-defined]
            if s:
                ends |= await _tokens_containing(engine, s[0])
        done[job.at] = answer_stats(
            r, answer, temperature=job.temperature,
            top_p=a.get("top_p", 1.0), decoy_rows=decoy_rows,  # type: ignore[arg-type]
            finish_reason=str(a.get("finish_reason", "")),
            max_tokens=int(a.get("max_tokens", 0)),  # type: ignore[call-overload]
            end_ids=ends, params=params)
    return [x for x in done if x is not None]


class _Job:
    """One answer of :func:`challenge_stats_many` that needs the reference's rows: its
    prompt's and decoys' tokens, its current tokenisation, the best one scored so far
    (fewest implausible tokens: the count, the tokens, their rows, the decoys' rows)."""

    def __init__(self, at: int, answer_kwargs: Mapping[str, object], params: ChallengeScoring,
                 prompt: list[int], answer: list[int], decoys: list[list[int]]) -> None:
        self.at, self.answer_kwargs, self.params = at, answer_kwargs, params
        self.temperature = float(answer_kwargs["temperature"])  # type: ignore[arg-type]
        self.top_p = float(answer_kwargs.get("top_p", 1.0))  # type: ignore[arg-type]
        self.prompt, self.answer, self.decoys = prompt, answer, decoys
        self.best: tuple[int, list[int], object, list[object]] | None = None

    def sequences(self, max_context: int) -> list[tuple[list[int], int]]:
        out = [(self.prompt + self.answer, len(self.prompt))]
        if self.answer:  # a decoy that would not fit the context with the answer is left out
            out += [(d + self.answer, len(d)) for d in self.decoys
                    if d and len(d) + len(self.answer) <= max_context]
        return out


def _implausible(rows, tokens: Sequence[int], temperature: float,  # type: ignore[no-untyped-def]
                 params: ChallengeScoring, top_p: float = 1.0) -> list[int]:
    """Positions whose token an honest sampler practically never emits: greedy, not the top
    choice within ``tie_nats``; sampled, a probability below exp(stat_floor) under the
    asked sampling distribution (outside the top_p nucleus included)."""
    import numpy as np

    if not len(tokens):
        return []
    idx = np.asarray(list(tokens), dtype=np.int64)
    body = rows[: len(tokens)]
    pos = np.arange(len(tokens))
    if temperature == 0:
        bad = body.max(axis=-1) - body[pos, idx] > params.tie_nats
    else:
        bad = sampling_logprobs(body, temperature, top_p)[pos, idx] < params.stat_floor
    return [int(i) for i in np.flatnonzero(bad)]


async def _retokenised(engine: Engine, job: _Job, rows,  # type: ignore[no-untyped-def]
                       bad: Sequence[int]) -> list[int] | None:
    """Another tokenisation of the same answer text, where each implausible token (at most
    ``retokenise_max`` of them) is replaced by a plausible token of the same text (a byte
    fallback), or split in two whose first part the model finds plausible, or merged with
    the token before into one it finds plausible (module docstring,
    "Re-tokenisation"); None when no repair applies."""
    params = job.params
    if len(bad) > params.retokenise_max:
        return None
    texts = await _vocab_texts(engine)
    by_text = _vocab_index(engine, texts)
    logq = rows if job.temperature == 0 else sampling_logprobs(rows, job.temperature, job.top_p)
    ok = (lambda k, t: rows[k].max() - rows[k, t] <= params.tie_nats) if job.temperature == 0 \
        else (lambda k, t: logq[k, t] >= params.stat_floor)
    old = job.answer
    new = list(old)
    limit = len(old)  # positions from here on were changed
    for k in sorted(bad, reverse=True):  # right to left: earlier positions keep their index
        if k >= limit:
            continue
        t = old[k]
        text = texts[t] if 0 <= t < len(texts) else ""
        # (rank, replacement, first position replaced, tokens replaced)
        best: tuple[float, list[int], int, int] | None = None
        for a in by_text.get(text, ()):  # another token of the same text (a byte fallback)
            if a != t and ok(k, a) and (best is None or logq[k, a] > best[0]):
                trial = new[:k] + [a] + new[k + 1:]
                if await _same_text(engine, job.prompt, trial, new):
                    best = (float(logq[k, a]) + 1e9, [a], k, 1)
        for cut in range(1, len(text)):
            for a in by_text.get(text[:cut], ()):
                if not ok(k, a):
                    continue
                for b in by_text.get(text[cut:], ()):
                    # b's own row is not known before the next pass: the row after t ranks
                    # the candidates (a byte-fallback spelling is never likely there)
                    value = float(logq[k, a] + rows[k + 1, b])
                    if best is None or value > best[0]:
                        trial = new[:k] + [a, b] + new[k + 1:]
                        if await _same_text(engine, job.prompt, trial, new):
                            best = (value, [a, b], k, 1)
        if best is None and k > 0 and 0 <= old[k - 1] < len(texts):
            for m in by_text.get(texts[old[k - 1]] + text, ()):
                if ok(k - 1, m) and (best is None or logq[k - 1, m] > best[0]):
                    trial = new[:k - 1] + [m] + new[k + 1:]
                    if await _same_text(engine, job.prompt, trial, new):
                        best = (float(logq[k - 1, m]), [m], k - 1, 2)
        if best is not None:
            _, repl, at, width = best
            new = new[:at] + repl + new[at + width:]
            limit = at
    return new if limit < len(old) else None


async def _answer_ids(engine: Engine, prompt: str, response: str) -> tuple[list[int], int]:
    """:func:`_token_ids`, except where the joint encoding merges the prompt's last characters
    with the answer's first (a prompt ending "...js" and an answer "een ..." encode "se"):
    there the answer is not encoded on its own (that adds a word boundary, "▁e", so another
    text), but spelt as the joint encoding's tokens after the straddling one, preceded by at
    most two tokens that spell the rest of the straddling text; the decoded text must be the
    joint one (module docstring, "Re-tokenisation"). Falls back to :func:`_token_ids`."""
    prompt_ids = list(await engine.tokenize(prompt))
    if not response:
        return prompt_ids, len(prompt_ids)
    joint = list(await engine.tokenize(prompt + response))
    if len(joint) > len(prompt_ids) and joint[:len(prompt_ids)] == prompt_ids:
        return joint, len(prompt_ids)
    common = 0
    while common < min(len(joint), len(prompt_ids)) and joint[common] == prompt_ids[common]:
        common += 1
    whole = await engine.decode(joint)
    before = await engine.decode(prompt_ids)
    texts = await _vocab_texts(engine)
    by_text = _vocab_index(engine, texts)
    for m in range(common + 1, min(len(joint), common + 4)):
        head = await engine.decode(joint[:m])
        if not head.startswith(before) or len(head) == len(before):
            continue
        piece = head[len(before):]
        spellings = [[b] for b in by_text.get(piece, ())]
        for cut in range(1, len(piece)):
            spellings += [[a, b] for a in by_text.get(piece[:cut], ())
                          for b in by_text.get(piece[cut:], ())]
        for spelt in spellings:
            if await engine.decode(prompt_ids + spelt + joint[m:]) == whole:
                return prompt_ids + spelt + joint[m:], len(prompt_ids)
        break
    return await _token_ids(engine, prompt, response)


async def _same_text(engine: Engine, prompt: Sequence[int], a: Sequence[int],
                     b: Sequence[int]) -> bool:
    """Whether two answer tokenisations decode to the same text after the prompt's last token
    (so a leading word boundary counts)."""
    ctx = list(prompt[-1:])
    return await engine.decode(ctx + list(a)) == await engine.decode(ctx + list(b))


async def score_challenge(engine: Engine, prompt: str, response: str, **kwargs: object) -> float:
    """C in [0, 1]: :func:`challenge_credibility` of :func:`challenge_stats` (same arguments).

    Raises:
        as :func:`challenge_stats`.
    """
    params = kwargs.get("params", DEFAULT_CHALLENGE_SCORING)
    stats = await challenge_stats(engine, prompt, response, **kwargs)  # type: ignore[arg-type]
    return challenge_credibility(stats, params)  # type: ignore[arg-type]


_VOCAB_TEXT: dict[int, list[str]] = {}
_VOCAB_INDEX: dict[int, dict[str, list[int]]] = {}


async def _vocab_texts(engine: Engine) -> list[str]:
    """Each token ID's decoded text (cached per engine object)."""
    key = id(engine)
    texts = _VOCAB_TEXT.get(key)
    if texts is None:
        size = int(getattr(engine, "vocab_size", 0) or 0)
        texts = [await engine.decode([i]) for i in range(size)]
        _VOCAB_TEXT[key] = texts
    return texts


def _vocab_index(engine: Engine, texts: Sequence[str]) -> dict[str, list[int]]:
    """Decoded text -> the token IDs with that text (non-empty texts; cached per engine)."""
    index = _VOCAB_INDEX.get(id(engine))
    if index is None:
        index = {}
        for i, t in enumerate(texts):
            if t:
                index.setdefault(t, []).append(i)
        _VOCAB_INDEX[id(engine)] = index
    return index


async def _tokens_containing(engine: Engine, char: str) -> set[int]:
    """Token IDs whose decoded text contains ``char`` (cached per engine object)."""
    return {i for i, t in enumerate(await _vocab_texts(engine)) if char in t}


DECOY_DOMAIN = b"planetserve/v1/challenge-decoys\x00"


def decoy_indices(key: bytes, pool_size: int, asked: int, count: int) -> list[int]:
    """The pool indices of a challenge's decoy prompts: ``count`` distinct indices other than
    ``asked``, drawn from SHA-256(DECOY_DOMAIN || key || u32(i)) (every verifier draws the same
    ones for the same ``key``, e.g. the signed request hash); fewer when the pool is small.

    Raises:
        ValueError: ``pool_size`` < 1 or ``count`` < 0.
    """
    import hashlib

    if pool_size < 1 or count < 0:
        raise ValueError("pool_size must be >= 1 and count >= 0")
    want = min(count, pool_size - (1 if 0 <= asked < pool_size else 0))
    out: list[int] = []
    i = 0
    while len(out) < want:
        digest = hashlib.sha256(DECOY_DOMAIN + bytes(key) + i.to_bytes(4, "big")).digest()
        j = int.from_bytes(digest[:8], "big") % pool_size
        i += 1
        if j != asked and j not in out:
            out.append(j)
    return out


__all__ = [
    "DEFAULT_CHALLENGE_SCORING",
    "DEFAULT_FLOOR_LOGPROB",
    "DEFAULT_GREEDY_TEMPERATURE",
    "DEFAULT_SCORING",
    "DEFAULT_TOP_K",
    "MAX_CHALLENGE_TEMPERATURE",
    "MAX_SCORED_TOKENS",
    "AnswerStats",
    "ChallengeScoring",
    "ScoringParams",
    "answer_stats",
    "challenge_credibility",
    "challenge_stats",
    "challenge_stats_many",
    "credibility",
    "decoy_indices",
    "mean_credibility",
    "sampling_logprobs",
    "score_challenge",
    "score_response",
    "score_response_per_token",
    "scoring_temperature",
    "tempered_logprobs",
]
