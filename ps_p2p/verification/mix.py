"""The users' mix of request shapes, learned without revealing any user; pure (issue 18).

A challenge is a sample of what users send (:mod:`~ps_p2p.verification.challenges`): its shape
(chat or prompt, stream, system prompt, earlier exchange) and parameters (temperature,
``top_p``, ``max_tokens``, seed, stop) are drawn from a mix that every verifier must hold
identically, since each re-derives the leader's requests. A constant mix
(:data:`~ps_p2p.verification.challenges.DEFAULT_MIX`) is recognisable wherever the real users
send something else. This module lets the committee learn the users' mix:

1. **Observe** (:class:`ShapeRecorder`, in a verifier's own local API): each request its users
   send is reduced to one bucket per dimension (:data:`DIMENSIONS`: fixed, coarse buckets of
   the parameters; never the prompt, the messages' text, the stop strings or the seed's value
   beyond a few common ones) and counted.
2. **Publish** (:meth:`ShapeRecorder.take`) once per epoch, and only when the window holds at
   least :data:`MIN_REQUESTS` requests: every count gets two-sided geometric (discrete Laplace)
   noise of scale ``sensitivity / epsilon`` (one request moves at most
   :data:`SENSITIVITY` counts by one), a noisy count below ``k`` is suppressed, and each
   dimension is sent as shares of :data:`SCALE` (not counts: the volume of the verifier's API
   stays private). Each request is counted in exactly one published window, so the whole
   sequence of histograms is ``epsilon``-differentially private for any one request
   (docs/verification.md, "A mix learned from users").
3. **Submit** it in a MIX_REPORT transaction (:mod:`~ps_p2p.verification.ledger`): one per
   validator per epoch, validated (:meth:`ShapeHistogram.check`).
4. **Commit** (:func:`aggregate`): when an epoch's report executes, with the latest report of
   each validator from the last ``MIX_REPORT_EPOCHS`` epochs (so a verifier whose API needs
   several epochs to fill a window still counts), each dimension reported by validators
   holding more than 2/3 of the power gets, per bucket, the power-weighted median of the
   reported shares, renormalized; the committed mix moves :data:`STEP_NUM` /
   :data:`STEP_DEN` of the way towards it (the previous mix, initially ``DEFAULT_MIX``, is the
   prior). Validators holding at most 1/3 of the power are less than half of the reporting
   power, so the median of every bucket lies between two honest reports: a Byzantine minority
   cannot move any bucket outside the honest range, and nobody moves it by more than the step
   per epoch.
5. **Use** (:func:`mix_of`): the committed histogram is a
   :class:`~ps_p2p.verification.challenges.ChallengeMix` whose tables are the buckets; a range
   bucket is drawn uniformly within its range.

Histogram bytes (in a MIX_REPORT and in the ledger)::

    histogram = u8(#dimensions) || (u8(#buckets) || u32(share)*)*     (:data:`DIMENSIONS` order)

A dimension's shares sum to :data:`SCALE` or are all 0 (no data for it). Everything is integer
arithmetic, so every validator computes the same committed bytes.

Limits: dimensions are learned as marginals (stream given the endpoint, everything else
independent), not as their joint distribution; the stop strings and system prompts are the
mix's fixed lists (learning them would publish users' text).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ps_p2p.consensus.encoding import Reader, u8, u32
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.verification.challenges import (
    API_DEFAULT_MAX_TOKENS,
    DEFAULT_MIX,
    MAX_TEMPERATURE,
    ChallengeMix,
)

#: Shares of one dimension sum to this (basis points: 0.01% resolution).
SCALE = 10_000
#: The committed mix moves STEP_NUM / STEP_DEN of the way to an epoch's aggregate.
STEP_NUM, STEP_DEN = 1, 4
#: Fewest requests in a window before a verifier publishes it.
MIN_REQUESTS = 1000
#: Default suppression threshold: a bucket is published only with a noisy count of at least k.
DEFAULT_K = 30
#: Default privacy budget of one published window (each request is in one window only).
DEFAULT_EPSILON = 1.0
#: Counts one request increments (endpoint, its stream, system, earlier exchange, temperature,
#: top_p, max_tokens, seed, stop): the L1 sensitivity of a window's counts.
SENSITIVITY = 9

# A bucket is an exact value, or ("range", lo, hi) for the values in between that no exact
# bucket takes (drawn uniformly in [lo, hi] by a challenge).
_T_EXACT = (0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0)
_P_EXACT = (1.0, 0.95, 0.9, 0.8, 0.5)
_M_EXACT = (16, 32, 50, 64, 100, 128, 150, 200, 256, 300, 500, 512, 1000, 1024, 2000, 2048,
            4096)
_M_RANGES = (("range", 1, 127), ("range", 129, 511), ("range", 513, 2047),
             ("range", 2049, 4095))
_SEEDS = (None, 0, 1, 42, 1234, "random")

#: (name, buckets) of every dimension, in the histogram's order.
DIMENSIONS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("endpoint", ("chat", "completion")),
    ("stream_chat", (False, True)),
    ("stream_completion", (False, True)),
    ("system", (False, True)),
    ("earlier", (False, True)),
    ("temperature", _T_EXACT + (("range", 0.01, 0.99), ("range", 1.01, MAX_TEMPERATURE))),
    ("top_p", _P_EXACT + (("range", 0.01, 0.99),)),
    ("max_tokens", _M_EXACT + _M_RANGES),
    ("seed", _SEEDS),
    ("stop", (None, "one", "list")),
)
_INDEX = {name: i for i, (name, _) in enumerate(DIMENSIONS)}
#: Bytes of an encoded histogram.
HISTOGRAM_BYTES = 1 + sum(1 + 4 * len(b) for _, b in DIMENSIONS)


@dataclass(frozen=True)
class RequestShape:
    """What the histogram keeps of one request (nothing of its text).

    Attributes:
        chat: chat ``messages`` (else a ``prompt``).
        stream: streamed.
        system: a chat with a system (or developer) message.
        earlier: a chat with an earlier exchange (an assistant turn before the last user one).
        temperature, top_p, max_tokens: as sent (the API's defaults applied: 0, 1, 128).
        seed: None when unseeded.
        stops: how many stop strings.
    """

    chat: bool
    stream: bool
    system: bool
    earlier: bool
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    stops: int

    @staticmethod
    def of_ask(prompt: str = "", messages: Sequence[Any] = (), *, stream: bool = False,
               max_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] = (), **_: Any) -> RequestShape:
        """The shape of one :meth:`~ps_p2p.roles.user.UserClient.ask` call's arguments."""
        roles = [getattr(m, "role", "") for m in messages]
        return RequestShape(
            chat=bool(messages), stream=bool(stream),
            system=any(r in ("system", "developer") for r in roles),
            earlier="assistant" in roles,
            temperature=float(temperature or 0.0),
            top_p=1.0 if top_p is None else float(top_p),
            max_tokens=int(max_tokens or API_DEFAULT_MAX_TOKENS), seed=seed,
            stops=len(tuple(stop or ())))

    def buckets(self) -> list[tuple[int, int]]:
        """(dimension index, bucket index) of every count this request increments."""
        out = [(0, 0 if self.chat else 1)]
        out.append((1, int(self.stream)) if self.chat else (2, int(self.stream)))
        if self.chat:
            out += [(3, int(self.system)), (4, int(self.earlier))]
        out.append((5, _bucket(5, self.temperature)))
        out.append((6, _bucket(6, self.top_p)))
        out.append((7, _bucket(7, self.max_tokens)))
        seeds = DIMENSIONS[8][1]
        out.append((8, seeds.index(self.seed) if self.seed in seeds[:-1] else len(seeds) - 1))
        out.append((9, 0 if self.stops == 0 else 1 if self.stops == 1 else 2))
        return out


def _bucket(dim: int, value: float) -> int:
    """The bucket of a numeric value: an exact value within 0.005, else the range holding it
    (clamped into the outermost)."""
    buckets = DIMENSIONS[dim][1]
    ranges = []
    for i, b in enumerate(buckets):
        if isinstance(b, tuple):
            ranges.append(i)
        elif abs(float(b) - value) <= 0.005:
            return i
    for i in ranges:
        if value <= buckets[i][2]:
            return i
    return ranges[-1]


def _range_bucket(dim: int, value: tuple[Any, ...]) -> int:
    """The bucket of a ("range", lo, hi) table value: itself, or the range of its midpoint."""
    buckets = DIMENSIONS[dim][1]
    if value in buckets:
        return buckets.index(value)
    mid = (value[1] + value[2]) / 2
    return next((i for i, b in enumerate(buckets) if isinstance(b, tuple) and b[1] <= mid <= b[2]),
                _bucket(dim, mid))


# ----------------------------------------------------------------------------- histograms


@dataclass(frozen=True)
class ShapeHistogram:
    """Shares of each bucket, per dimension (:data:`DIMENSIONS` order; module docstring).

    Attributes:
        shares: one tuple per dimension, one share per bucket, each in [0, SCALE], summing to
            SCALE (or all 0: no data for that dimension).
    """

    shares: tuple[tuple[int, ...], ...]

    def check(self, error: type[Exception] = ValueError) -> None:
        """Raises ``error`` with the reason: wrong dimension or bucket counts, a share out of
        [0, SCALE], a dimension summing to neither SCALE nor 0, or no dimension with data."""
        if len(self.shares) != len(DIMENSIONS):
            raise error(f"mix histogram of {len(self.shares)} dimensions, "
                        f"expected {len(DIMENSIONS)}")
        for (name, buckets), row in zip(DIMENSIONS, self.shares):
            if len(row) != len(buckets):
                raise error(f"mix histogram {name}: {len(row)} buckets, "
                            f"expected {len(buckets)}")
            for s in row:
                if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= SCALE:
                    raise error(f"mix histogram {name}: share {s!r} not in [0, {SCALE}]")
            if sum(row) not in (0, SCALE):
                raise error(f"mix histogram {name}: shares sum to {sum(row)}, "
                            f"not {SCALE} (or 0: no data)")
        if not any(sum(row) for row in self.shares):
            raise error("mix histogram without data")

    def encode(self) -> bytes:
        """The histogram bytes (module docstring)."""
        parts = [u8(len(self.shares))]
        for row in self.shares:
            parts.append(u8(len(row)) + b"".join(u32(s) for s in row))
        return b"".join(parts)

    @staticmethod
    def read(r: Reader) -> ShapeHistogram:
        """Read the bytes :meth:`encode` writes; only the layout is checked here (counts of
        dimensions and buckets: a reader never takes more than :data:`HISTOGRAM_BYTES`); the
        values are :meth:`check`'s.

        Raises:
            the reader's error: a dimension or bucket count other than :data:`DIMENSIONS`'.
        """
        n = r.u8("mix dimensions")
        if n != len(DIMENSIONS):
            raise r.fail(f"mix histogram of {n} dimensions, expected {len(DIMENSIONS)}")
        rows = []
        for name, buckets in DIMENSIONS:
            m = r.u8(f"mix {name} buckets")
            if m != len(buckets):
                raise r.fail(f"mix histogram {name}: {m} buckets, expected {len(buckets)}")
            rows.append(tuple(r.u32(f"mix {name} share") for _ in range(m)))
        return ShapeHistogram(tuple(rows))

    def dimension(self, name: str) -> tuple[int, ...]:
        return self.shares[_INDEX[name]]


def normalize(weights: Sequence[int | Fraction]) -> tuple[int, ...]:
    """Non-negative weights as integer shares summing to SCALE (largest remainder, ties to the
    lower index); all zeros stay zeros."""
    total = sum(weights)
    if total <= 0:
        return tuple(0 for _ in weights)
    exact = [Fraction(w) * SCALE / total for w in weights]
    floors = [math.floor(x) for x in exact]
    left = SCALE - sum(floors)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return tuple(floors)


def histogram_of(mix: ChallengeMix) -> ShapeHistogram:
    """The buckets' shares of a mix's distribution (on the wire: a left-out temperature is 0,
    a left-out top_p 1, a left-out max_tokens 128; "uniform" temperatures split evenly between
    the two ranges)."""
    rows: list[list[Fraction]] = [[Fraction(0)] * len(b) for _, b in DIMENSIONS]

    def two(dim: int, p: float) -> None:
        rows[dim][0] += 1 - Fraction(p)
        rows[dim][1] += Fraction(p)

    rows[0][0] += Fraction(mix.chat)
    rows[0][1] += 1 - Fraction(mix.chat)
    two(1, mix.stream_chat)
    two(2, mix.stream_completion)
    two(3, mix.system)
    two(4, mix.multi_turn)
    lo_range, hi_range = len(_T_EXACT), len(_T_EXACT) + 1
    for value, w in mix.temperature:
        if value == "uniform":
            rows[5][lo_range] += Fraction(w) / 2
            rows[5][hi_range] += Fraction(w) / 2
        elif isinstance(value, tuple):
            rows[5][_range_bucket(5, value)] += Fraction(w)
        else:
            rows[5][_bucket(5, 0.0 if value is None else float(value))] += Fraction(w)
    for dim, table, default in ((6, mix.top_p, 1.0), (7, mix.max_tokens, API_DEFAULT_MAX_TOKENS)):
        for value, w in table:
            i = _range_bucket(dim, value) if isinstance(value, tuple) \
                else _bucket(dim, default if value is None else value)
            rows[dim][i] += Fraction(w)
    seeds = DIMENSIONS[8][1]
    for value, w in mix.seed:
        rows[8][seeds.index(value) if value in seeds else len(seeds) - 1] += Fraction(w)
    stops = DIMENSIONS[9][1]
    for value, w in mix.stop:
        rows[9][stops.index(value)] += Fraction(w)
    return ShapeHistogram(tuple(normalize(r) for r in rows))


#: The committed mix before any epoch updated it.
DEFAULT_HISTOGRAM = histogram_of(DEFAULT_MIX)


def mix_of(histogram: ShapeHistogram | None, base: ChallengeMix = DEFAULT_MIX) -> ChallengeMix:
    """The :class:`~ps_p2p.verification.challenges.ChallengeMix` a committed histogram stands
    for (None: ``base`` itself, the genesis mix); the system prompts and stop strings are
    ``base``'s."""
    if histogram is None:
        return base
    h = histogram.shares

    def share(dim: int, i: int) -> float:
        return h[dim][i] / SCALE

    def table(dim: int) -> tuple[tuple[Any, float], ...]:
        out = tuple((b, share(dim, i)) for i, b in enumerate(DIMENSIONS[dim][1]) if h[dim][i])
        return out or ((DIMENSIONS[dim][1][0], 1.0),)

    return dataclasses.replace(
        base, chat=share(0, 0), stream_chat=share(1, 1), stream_completion=share(2, 1),
        system=share(3, 1), multi_turn=share(4, 1), temperature=table(5), top_p=table(6),
        max_tokens=table(7), seed=table(8), stop=table(9))


def _weighted_median(values: Sequence[tuple[int, int]]) -> int:
    """The lower power-weighted median of (value, power) pairs (power > 0)."""
    total = sum(p for _, p in values)
    acc = 0
    for v, p in sorted(values):
        acc += p
        if 2 * acc >= total:
            return v
    raise AssertionError("empty")  # pragma: no cover


def aggregate(previous: ShapeHistogram | None, reports: Sequence[tuple[int, ShapeHistogram]],
              total_power: int) -> ShapeHistogram:
    """The committed mix after an epoch (module docstring, 4); pure, integer arithmetic.

    Args:
        previous: the committed histogram (None: :data:`DEFAULT_HISTOGRAM`).
        reports: (voting power, checked histogram) of each validator that reported this epoch.
        total_power: the validator set's power.

    Returns:
        Per dimension: the previous shares when validators with more than 2/3 of
        ``total_power`` did not report it; else ``normalize((STEP_DEN - STEP_NUM) x previous
        + STEP_NUM x normalize(per-bucket power-weighted lower median))``.
    """
    prev = previous or DEFAULT_HISTOGRAM
    rows = []
    for d, (_, buckets) in enumerate(DIMENSIONS):
        with_data = [(p, h.shares[d]) for p, h in reports if p > 0 and sum(h.shares[d])]
        if 3 * sum(p for p, _ in with_data) <= 2 * total_power:
            rows.append(prev.shares[d])
            continue
        median = normalize([_weighted_median([(row[i], p) for p, row in with_data])
                            for i in range(len(buckets))])
        if not sum(median):
            rows.append(prev.shares[d])
            continue
        rows.append(normalize([(STEP_DEN - STEP_NUM) * a + STEP_NUM * b
                               for a, b in zip(prev.shares[d], median)]))
    return ShapeHistogram(tuple(rows))


def read_histogram(data: bytes) -> ShapeHistogram:
    """A histogram from its bytes alone (checked).

    Raises:
        RemoteProtocolError: malformed or out of range.
    """
    r = Reader(data, RemoteProtocolError, "mix histogram")
    h = ShapeHistogram.read(r)
    r.done()
    h.check(RemoteProtocolError)
    return h


# ------------------------------------------------------------------------------ recording


def _geometric_noise(rng: random.Random, alpha: float) -> int:
    """Two-sided geometric noise: P(k) proportional to alpha^|k| (the discrete Laplace
    mechanism, Ghosh, Roughgarden, Sundararajan, STOC 2009)."""
    if alpha <= 0.0:
        return 0
    log_a = math.log(alpha)

    def one() -> int:
        return math.floor(math.log(1.0 - rng.random()) / log_a)

    return one() - one()


class ShapeRecorder:
    """Counts the shapes of the requests a node's own local API sends (module docstring, 1-2).

    Only a :class:`RequestShape`'s buckets are kept, as counts of the current window; a window
    is published once (:meth:`take`) and then forgotten. Memory: one counter per bucket.

    Args:
        k: suppression threshold (noisy counts below it are published as 0).
        epsilon: privacy budget of one window (> 0; ``math.inf``: no noise, tests).
        min_requests: fewest requests in a window before it is published.
    """

    def __init__(self, *, k: int = DEFAULT_K, epsilon: float = DEFAULT_EPSILON,
                 min_requests: int = MIN_REQUESTS) -> None:
        if k < 0 or not epsilon > 0 or min_requests < 1:
            raise ValueError("k >= 0, epsilon > 0 and min_requests >= 1")
        self.k = k
        self.epsilon = epsilon
        self.min_requests = min_requests
        self._counts = [[0] * len(b) for _, b in DIMENSIONS]
        self.requests = 0

    def record(self, shape: RequestShape) -> None:
        """Count one request."""
        for d, i in shape.buckets():
            self._counts[d][i] += 1
        self.requests += 1

    def take(self, rng: random.Random) -> ShapeHistogram | None:
        """The window as a publishable histogram, and a new window; None (and the window kept)
        while it has fewer than ``min_requests`` requests or nothing survives suppression.

        Args:
            rng: the noise's randomness (a system RNG in a node; seeded in tests).
        """
        if self.requests < self.min_requests:
            return None
        alpha = 0.0 if math.isinf(self.epsilon) else math.exp(-self.epsilon / SENSITIVITY)
        rows = []
        for counts in self._counts:
            noisy = [c + _geometric_noise(rng, alpha) for c in counts]
            kept = [c if c >= max(self.k, 1) else 0 for c in noisy]
            rows.append(normalize(kept))
        self._counts = [[0] * len(b) for _, b in DIMENSIONS]
        self.requests = 0
        h = ShapeHistogram(tuple(rows))
        return h if any(sum(r) for r in rows) else None

    def counts(self) -> Mapping[str, tuple[int, ...]]:
        """The window's true counts by dimension (for ``ps-node status`` of its own node)."""
        return {name: tuple(c) for (name, _), c in zip(DIMENSIONS, self._counts)}


__all__ = [
    "DEFAULT_EPSILON",
    "DEFAULT_HISTOGRAM",
    "DEFAULT_K",
    "DIMENSIONS",
    "HISTOGRAM_BYTES",
    "MIN_REQUESTS",
    "SCALE",
    "RequestShape",
    "ShapeHistogram",
    "ShapeRecorder",
    "aggregate",
    "histogram_of",
    "mix_of",
    "normalize",
    "read_histogram",
]
