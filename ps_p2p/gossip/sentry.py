"""The Sentry: where prompts are cut into HR-tree chunks, pure (PlanetServe Appendix A3).

A prompt (token IDs) is cut into chunks of ``l_1, l_2, ...`` tokens, then ``default`` tokens each
once the array L is used up; each complete chunk becomes one level of the HR-tree
(:mod:`ps_p2p.gossip.hr_tree`). Every node of a model group must cut the same way, so L travels as
a versioned value, :class:`ChunkLengths`, with one canonical byte form.

The Sentry proposes L from the prompts a node serves (Appendix A3):

1. **Detect S**, the lengths of the distinct common prefixes (system prompts, tool schemas,
   shared documents) of a sample of prompts (:func:`common_prefix_lengths`). The sample is sorted
   (token-wise lexicographic order), so prompts that share a prefix are neighbours, and is walked
   as a compressed token trie: every trie node is a range of the sorted sample and the length s
   of the range's longest common prefix. s is a common prefix length when the range holds at
   least ``min_count`` prompts, s is at least ``min_prefix_tokens`` (a prefix shorter than one
   engine block, 16 tokens in vLLM, is never cached), and either the shared path *ends* at s (no
   ``min_count`` of the prompts go on with the same next token) or it *branches* there (at least
   ``min_count`` prompts do not go on with the most common next token: two tool schemas after
   one system prompt, or a system prompt that most prompts leave while some go on with a shared
   document). Looking at ends and branches rather than at every shared length is what makes a
   system prompt of 40 tokens count as 40 and not as every length from 1 to 40.
2. **Build L from S** and a small fixed separator length delta (:func:`lengths_from_prefixes`),
   Appendix A3, eqs. (1)-(3)::

       l_1 = s_1                              (1)
       l_2j = delta             for j = 1..n  (2)
       l_2j+1 = s_j+1 - s_j - delta           (3)   for j = 1..n-1

   so the chunk boundaries fall at s_1, s_1 + delta, s_2, s_2 + delta, ..., s_n, s_n + delta: each
   common prefix ends exactly on a chunk boundary, followed by one delta-token chunk, and the rest
   of a prompt is cut into ``default``-token chunks. The paper writes eq. (3) as
   ``l_2n+1 = s_n - s_n-1 - delta``; read literally for n = 1 it would need an s_0, so we read its
   index as the j of eq. (2) shifted by one, the only reading under which the boundaries land on
   the detected prefix lengths, which is what the paper says the structure is for ("each distinct
   system prompt corresponds to a specific path segment"). Eq. (3) needs s_j+1 - s_j - delta >= 1:
   a detected length closer than delta + 1 tokens to the previous kept one is dropped (ascending
   order, so the shorter prefix, shared by at least as many prompts along its path, wins).
3. **Refresh** every ``refresh_requests`` requests (10,000 in the paper's evaluation, sec. 4): the
   Sentry keeps a bounded sample (every k-th prompt, at most ``max_samples``, each cut to
   ``max_prefix_tokens``) and proposes a new :class:`ChunkLengths`, version + 1, when L changed.

A new L means new chunk hashes: the HR-tree is keyed by ``ChunkLengths.version`` (a tree, its
deltas and snapshots carry the version; a delta of another version is refused) and is rebuilt
from the engine's cache for the new version. Agreeing on one L for the whole group is the caller's
business (the Sentry only proposes).

This module is a pure core: no trio, libp2p, protobuf, clock or randomness.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ps_p2p.consensus.encoding import Reader, u32, u64
from ps_p2p.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "CHUNK_LENGTHS_DOMAIN",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_MAX_PREFIX_TOKENS",
    "DEFAULT_MAX_SAMPLES",
    "DEFAULT_MIN_FRACTION",
    "DEFAULT_MIN_PREFIX_TOKENS",
    "DEFAULT_REFRESH_REQUESTS",
    "DEFAULT_SEPARATOR_TOKENS",
    "MAX_CHUNK_LENGTHS",
    "MAX_CHUNK_TOKENS",
    "MAX_COMMON_PREFIXES",
    "ChunkLengths",
    "Sentry",
    "common_prefix_lengths",
    "lengths_from_prefixes",
]

DEFAULT_CHUNK_TOKENS = 32
"""Chunk length once L is used up: two vLLM blocks of 16 tokens. Routing needs "a long enough
match", not the exact match length, and a coarser cut keeps trees (and deltas) 2x smaller than one
level per block; a prompt shorter than its first chunk always misses (little prefill to save)."""
DEFAULT_SEPARATOR_TOKENS = 4
"""delta of Appendix A3: the small fixed chunk after each common prefix (e.g. the chat template's
end-of-turn and role header tokens)."""
DEFAULT_REFRESH_REQUESTS = 10_000
"""Requests between two proposals of L (paper sec. 4: "refreshed every 10,000 requests")."""
DEFAULT_MAX_SAMPLES = 512
"""Prompts the Sentry keeps (every ``refresh_requests // max_samples``-th one)."""
DEFAULT_MAX_PREFIX_TOKENS = 4096
"""Tokens kept of each sampled prompt; longer common prefixes are seen as this long. With
:data:`DEFAULT_MAX_SAMPLES` the sample is at most 8 MiB (4 bytes a token)."""
DEFAULT_MIN_FRACTION = 0.1
"""A common prefix must be shared by at least this fraction of the sample (and ``min_count``)."""
DEFAULT_MIN_PREFIX_TOKENS = 16
"""Shortest common prefix reported: one vLLM block; a shorter shared prefix is never cached."""
MAX_COMMON_PREFIXES = 16
"""At most this many detected lengths (the ones most prompts leave at): L gets 2 entries each."""
MAX_CHUNK_TOKENS = 1 << 16
"""Largest chunk length (and ``default``) a :class:`ChunkLengths` may hold."""
MAX_CHUNK_LENGTHS = 256
"""Largest number of explicit lengths in L (a peer-supplied value is refused beyond it)."""
CHUNK_LENGTHS_DOMAIN = b"planetserve/v1/chunk-lengths\x00"
"""Domain-separation prefix of :meth:`ChunkLengths.encode`."""

_UINT64_BOUND = 1 << 64
_MAX_ENCODED_BYTES = len(CHUNK_LENGTHS_DOMAIN) + 8 + 4 + 4 + 4 * MAX_CHUNK_LENGTHS


# ------------------------------------------------------------------------------- ChunkLengths


@dataclass(frozen=True)
class ChunkLengths:
    """The chunk-length array L of a model group, versioned (Appendix A3, Algorithm 1 line 3).

    Chunk i (0-based) is ``lengths[i]`` tokens long for ``i < len(lengths)``, then ``default``
    tokens. Only complete chunks are hashed (:func:`ps_p2p.gossip.hr_tree.chunk_hashes`). Frozen
    and hashable; equal values have equal :meth:`encode` bytes.

    Canonical bytes (big-endian)::

        b"planetserve/v1/chunk-lengths\\x00" || u64(version) || u32(default)
            || u32(#lengths) || u32(l_i)*

    Attributes:
        version: in [0, 2**64); a later L of the group has a higher version.
        lengths: at most :data:`MAX_CHUNK_LENGTHS` values, each in [1, MAX_CHUNK_TOKENS].
        default: in [1, MAX_CHUNK_TOKENS], tokens per chunk after ``lengths``.

    Raises:
        LocalProtocolError: a field out of the ranges above (constructing it locally).
    """

    version: int
    lengths: tuple[int, ...] = ()
    default: int = DEFAULT_CHUNK_TOKENS
    _ends: tuple[int, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lengths, tuple):
            object.__setattr__(self, "lengths", tuple(self.lengths))
        if not 0 <= self.version < _UINT64_BOUND:
            raise LocalProtocolError(f"chunk-lengths version {self.version} not in [0, 2**64)")
        if not 1 <= self.default <= MAX_CHUNK_TOKENS:
            raise LocalProtocolError(
                f"default chunk length {self.default} not in [1, {MAX_CHUNK_TOKENS}]"
            )
        if len(self.lengths) > MAX_CHUNK_LENGTHS:
            raise LocalProtocolError(
                f"{len(self.lengths)} chunk lengths (max {MAX_CHUNK_LENGTHS})"
            )
        ends = []
        total = 0
        for n in self.lengths:
            if not isinstance(n, int) or not 1 <= n <= MAX_CHUNK_TOKENS:
                raise LocalProtocolError(f"chunk length {n!r} not in [1, {MAX_CHUNK_TOKENS}]")
            total += n
            ends.append(total)
        object.__setattr__(self, "_ends", tuple(ends))

    def length(self, index: int) -> int:
        """Tokens in chunk ``index`` (0-based)."""
        return self.lengths[index] if index < len(self.lengths) else self.default

    def end(self, index: int) -> int:
        """Token position just after chunk ``index`` (0-based): chunk i is [end(i-1), end(i))."""
        if index < len(self._ends):
            return self._ends[index]
        base = self._ends[-1] if self._ends else 0
        return base + (index - len(self._ends) + 1) * self.default

    def chunk_count(self, n_tokens: int) -> int:
        """Complete chunks in a prompt of ``n_tokens`` tokens."""
        i = bisect.bisect_right(self._ends, n_tokens)
        if i < len(self._ends):
            return i
        base = self._ends[-1] if self._ends else 0
        return len(self._ends) + (n_tokens - base) // self.default

    def encode(self) -> bytes:
        """The canonical bytes (see the class docstring)."""
        return b"".join(
            [
                CHUNK_LENGTHS_DOMAIN,
                u64(self.version),
                u32(self.default),
                u32(len(self.lengths)),
                struct.pack(f">{len(self.lengths)}I", *self.lengths),
            ]
        )

    @classmethod
    def decode(cls, data: bytes) -> ChunkLengths:
        """Parse :meth:`encode`'s bytes strictly (a peer's value).

        Raises:
            RemoteProtocolError: wrong domain, truncated, trailing bytes, over
                :data:`MAX_CHUNK_LENGTHS`, or a length out of range.
        """
        if len(data) > _MAX_ENCODED_BYTES:
            raise RemoteProtocolError(
                f"chunk lengths of {len(data)} bytes (max {_MAX_ENCODED_BYTES})"
            )
        r = Reader(data, RemoteProtocolError, "chunk lengths")
        r.prefix(CHUNK_LENGTHS_DOMAIN, "domain")
        version = r.u64("version")
        default = r.u32("default")
        count = r.u32("count")
        if count > MAX_CHUNK_LENGTHS:
            raise r.fail(f"{count} lengths (max {MAX_CHUNK_LENGTHS})")
        lengths = tuple(r.u32("length") for _ in range(count))
        r.done()
        try:
            return cls(version, lengths, default)
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"malformed chunk lengths: {exc}") from None


# ---------------------------------------------------------------------------- detection (S)


def _pack(tokens: Sequence[int], max_tokens: int) -> bytes:
    """Token IDs as big-endian u32s: bytes order is then token-wise lexicographic order."""
    cut = tokens[:max_tokens]
    try:
        return struct.pack(f">{len(cut)}I", *cut)
    except struct.error:
        raise LocalProtocolError("token IDs must be integers in [0, 2**32)") from None


def _lcp_tokens(a: bytes, b: bytes, known: int) -> int:
    """Tokens a and b share, knowing they share at least ``known`` (binary search, memcmp)."""
    lo, hi = known, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _detect(
    packed: list[bytes], min_count: int, min_prefix_tokens: int, max_prefixes: int,
    cut: int | None = None,
) -> tuple[int, ...]:
    """S from a sorted sample of packed prompts (see the module docstring, step 1). ``cut``:
    the tokens each prompt was cut to; a shared path that reaches it is not reported there
    (the prompts were cut, they did not end or branch: issue 19 finding 6)."""
    found: list[tuple[int, int]] = []  # (prompts off the most common branch, length)
    stack = [(0, len(packed), 0)] if len(packed) >= min_count else []
    while stack:
        lo, hi, known = stack.pop()
        # Sorted: the range's common prefix is that of its first and last prompt.
        depth = _lcp_tokens(packed[lo], packed[hi - 1], known)
        pos = 4 * depth
        k = lo
        while k < hi and len(packed[k]) == pos:  # prompts that end here sort first
            k += 1
        biggest = 0
        while k < hi:  # runs of prompts going on with the same token
            token = packed[k][pos:pos + 4]
            j = k + 1
            while j < hi and packed[j][pos:pos + 4] == token:
                j += 1
            biggest = max(biggest, j - k)
            if j - k >= min_count:
                stack.append((k, j, depth + 1))
            k = j
        leaving = (hi - lo) - biggest
        if depth >= min_prefix_tokens and (cut is None or depth < cut) and (
                biggest < min_count or leaving >= min_count):
            found.append((leaving, depth))  # the shared path ends or branches here
    found.sort(key=lambda item: (-item[0], item[1]))
    return tuple(sorted({length for _, length in found[:max_prefixes]}))


def common_prefix_lengths(
    prompts: Iterable[Sequence[int]],
    *,
    min_count: int,
    min_prefix_tokens: int = DEFAULT_MIN_PREFIX_TOKENS,
    max_prefixes: int = MAX_COMMON_PREFIXES,
    max_prefix_tokens: int = DEFAULT_MAX_PREFIX_TOKENS,
) -> tuple[int, ...]:
    """S: the distinct common prefix lengths of a sample of prompts, ascending (Appendix A3).

    A length s is reported when at least ``min_count`` prompts share a prefix of length s and
    their shared path ends or branches at s (module docstring, step 1). When more than
    ``max_prefixes`` qualify, the ones the most prompts leave at (those that do not go on with
    the most common next token) are kept, ties to the shorter.

    Args:
        prompts: token-ID sequences (each ID in [0, 2**32)); each is cut to
            ``max_prefix_tokens`` first.
        min_count: >= 2, prompts that must share a prefix (and leave it, at a branch).
        min_prefix_tokens: shortest s reported (>= 1).
        max_prefixes: most lengths reported.
        max_prefix_tokens: tokens kept of each prompt.

    Returns:
        Distinct lengths, ascending; () when nothing is common.

    Raises:
        LocalProtocolError: a token ID out of range, or ``min_count`` < 2.
    """
    if min_count < 2:
        raise LocalProtocolError("min_count must be >= 2 (a prefix of one prompt is not common)")
    packed = sorted(_pack(p, max_prefix_tokens) for p in prompts)
    return _detect(packed, min_count, max(1, min_prefix_tokens), max_prefixes,
                   max_prefix_tokens)


def lengths_from_prefixes(prefixes: Iterable[int], separator_tokens: int) -> tuple[int, ...]:
    """L from S and delta by Appendix A3, eqs. (1)-(3): (s_1, delta, s_2 - s_1 - delta, delta, ...).

    Lengths are taken in ascending order; one closer than ``separator_tokens + 1`` to the
    previous kept length is dropped (eq. (3) would give a chunk of 0 tokens or fewer).

    Args:
        prefixes: S, common prefix lengths (>= 1; any order, repeats ignored).
        separator_tokens: delta, >= 1.

    Returns:
        L, 2 entries per kept length (ending with delta), () for an empty S.

    Raises:
        LocalProtocolError: delta < 1, or a length < 1.
    """
    if separator_tokens < 1:
        raise LocalProtocolError("the separator length delta must be >= 1")
    kept: list[int] = []
    for s in sorted(set(prefixes)):
        if s < 1:
            raise LocalProtocolError(f"common prefix length {s} < 1")
        if not kept or s - kept[-1] - separator_tokens >= 1:
            kept.append(s)
    out: list[int] = []
    for j, s in enumerate(kept):
        out.append(s if j == 0 else s - kept[j - 1] - separator_tokens)  # eq. (1), eq. (3)
        out.append(separator_tokens)  # eq. (2)
    return tuple(out)


# ---------------------------------------------------------------------------------- Sentry


class Sentry:
    """Collects a node's prompts and proposes L every ``refresh_requests`` (Appendix A3).

    Memory: at most ``max_samples`` prompts of at most ``max_prefix_tokens`` tokens, 4 bytes a
    token. One prompt in every ``max(1, refresh_requests // max_samples)`` is sampled, so the
    sample spans the whole refresh window (no randomness).

    Args:
        current: the group's L now.
        separator_tokens: delta (eq. (2)).
        refresh_requests: requests between proposals (>= 1).
        max_samples: prompts kept (>= 2).
        max_prefix_tokens: tokens kept of each prompt (>= 1).
        min_fraction: ``min_count`` of :func:`common_prefix_lengths` is this fraction of the
            sample ...
        min_count: ... or this many prompts, whichever is more (>= 2).
        min_prefix_tokens: shortest common prefix reported.
        max_prefixes: most common prefix lengths in S.

    Raises:
        LocalProtocolError: an argument out of range.
    """

    def __init__(
        self,
        current: ChunkLengths,
        *,
        separator_tokens: int = DEFAULT_SEPARATOR_TOKENS,
        refresh_requests: int = DEFAULT_REFRESH_REQUESTS,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        max_prefix_tokens: int = DEFAULT_MAX_PREFIX_TOKENS,
        min_fraction: float = DEFAULT_MIN_FRACTION,
        min_count: int = 2,
        min_prefix_tokens: int = DEFAULT_MIN_PREFIX_TOKENS,
        max_prefixes: int = MAX_COMMON_PREFIXES,
    ) -> None:
        if separator_tokens < 1 or refresh_requests < 1 or max_samples < 2:
            raise LocalProtocolError(
                "need separator_tokens >= 1, refresh_requests >= 1, max_samples >= 2"
            )
        if max_prefix_tokens < 1 or min_count < 2 or not 0.0 <= min_fraction <= 1.0:
            raise LocalProtocolError(
                "need max_prefix_tokens >= 1, min_count >= 2, 0 <= min_fraction <= 1"
            )
        self.current = current
        self.separator_tokens = separator_tokens
        self.refresh_requests = refresh_requests
        self.max_prefix_tokens = max_prefix_tokens
        self.min_fraction = min_fraction
        self.min_count = min_count
        self.min_prefix_tokens = min_prefix_tokens
        self.max_prefixes = max_prefixes
        self._stride = max(1, refresh_requests // max_samples)
        self._samples: deque[bytes] = deque(maxlen=max_samples)
        self.requests = 0

    @property
    def sample_size(self) -> int:
        """Prompts in the sample now."""
        return len(self._samples)

    def observe(self, token_ids: Sequence[int]) -> ChunkLengths | None:
        """Count one request's prompt (sampled one in ``stride``).

        Returns:
            Every ``refresh_requests``-th call, :meth:`propose`'s value when it differs from
            ``current``; otherwise None.

        Raises:
            LocalProtocolError: a token ID out of [0, 2**32).
        """
        if self.requests % self._stride == 0:
            self._samples.append(_pack(token_ids, self.max_prefix_tokens))
        self.requests += 1
        if self.requests % self.refresh_requests:
            return None
        proposal = self.propose()
        return None if proposal == self.current else proposal

    def prefix_lengths(self) -> tuple[int, ...]:
        """S of the current sample (:func:`common_prefix_lengths` with this Sentry's limits)."""
        need = max(self.min_count, math.ceil(self.min_fraction * len(self._samples)))
        return _detect(
            sorted(self._samples), need, max(1, self.min_prefix_tokens), self.max_prefixes,
            self.max_prefix_tokens,
        )

    def propose(self) -> ChunkLengths:
        """L from the current sample: ``current`` if unchanged, else version + 1."""
        lengths = lengths_from_prefixes(self.prefix_lengths(), self.separator_tokens)
        if lengths == self.current.lengths:
            return self.current
        return ChunkLengths(self.current.version + 1, lengths, self.current.default)

    def adopt(self, lengths: ChunkLengths) -> None:
        """The group moved to ``lengths``; later proposals build on its version.

        Raises:
            LocalProtocolError: ``lengths.version`` is lower than ``current.version``.
        """
        if lengths.version < self.current.version:
            raise LocalProtocolError(
                f"chunk lengths version {lengths.version} < current {self.current.version}"
            )
        self.current = lengths
