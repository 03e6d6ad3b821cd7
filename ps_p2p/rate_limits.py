"""Budgets of what peers may make a server send: token buckets per peer and in total (pure).

A server that answers with much more than it is asked (a verifier's full directory: 4.5 MiB for
a 3-byte request at 20,000 records, issue 16) spends its CPU and bandwidth on whoever asks
most. :class:`PeerBudgets` gives each peer a token bucket of ``rate`` units a second (bytes
sent, for example) holding at most ``burst``, and all peers together one of ``total_rate`` /
``total_burst`` (identities are free: sybils share the total). A request is admitted while
both of its buckets are not in debt, and charged what it really cost once known, which may
put them in debt (an answer's size is known only once it is built): so one answer of any
size always goes through when the peer has been quiet, and the peer then waits until its
debt is repaid. At most ``max_inflight_per_peer`` admitted requests of one peer, and
``max_inflight`` in all, run at once, so concurrent requests cannot all pass the check
before the first is charged.

The core is sans-I/O: times are ``now`` in seconds (any monotonic clock, trio's in the
services) and it never reads a clock. Memory: at most ``max_peers`` peers' buckets; the one
used least recently (with nothing in flight) is forgotten first, which forgives its debt, so
a sybil set larger than ``max_peers`` is held only by the total bucket.

This module holds the project's one token bucket (:class:`TokenBucket`) and its one bounded
table of buckets by key (:class:`TokenBuckets`); the other budgets are built on them:
:class:`ps_p2p.gossip.budget.PeerBudget` and :class:`~ps_p2p.gossip.budget.PublisherBudget`
(HR-tree snapshots and gossip; refused charges cost nothing there) and
:class:`ps_p2p.registry.sources.NewIdentityLimiter` (new identities per source network).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["PeerBudgets", "TokenBucket", "TokenBuckets"]

K = TypeVar("K", bound=Hashable)


@dataclass
class TokenBucket:
    """``tokens`` grow by ``rate`` a second up to ``burst``; a charge may leave them negative.

    Args:
        rate: units per second (> 0).
        burst: the most tokens held (> 0); a new bucket is full.
        tokens: the tokens now (None: ``burst``).
        at: the time (seconds) ``tokens`` were last brought up to date (None: not yet).

    Raises:
        ValueError: ``rate`` or ``burst`` not above 0.
    """

    rate: float
    burst: float
    tokens: float | None = None
    at: float | None = None

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst > 0):
            raise ValueError(f"token bucket rate and burst must be > 0, not {self.rate}, "
                             f"{self.burst}")
        if self.tokens is None:
            self.tokens = self.burst

    def refill(self, now: float) -> float:
        """Bring the tokens up to ``now`` (a clock going back adds nothing) and return them."""
        assert self.tokens is not None
        if self.at is not None and now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        if self.at is None or now > self.at:
            self.at = now
        return self.tokens

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` tokens (debt allowed)."""
        self.tokens = self.refill(now) - amount

    def wait(self, now: float) -> float:
        """Seconds until the bucket is out of debt (0.0: it is now)."""
        tokens = self.refill(now)
        return 0.0 if tokens >= 0 else -tokens / self.rate


class TokenBuckets(Generic[K]):
    """One :class:`TokenBucket` per key, at most ``max_keys`` of them (a pure memory bound).

    A key's bucket is made full (``burst``) when :meth:`get` first asks for it. Past
    ``max_keys``, the key used least recently by :meth:`get` is forgotten first (it starts full
    again: whoever uses this table also needs a total bound), except keys ``pinned`` says to
    keep (e.g. a peer with a request in flight) and the key just asked for. Costs O(1) per
    :meth:`get` plus the pinned keys passed over.

    Args:
        rate, burst: each key's bucket (units a second, units; > 0).
        max_keys: buckets kept (>= 1).
        pinned: ``pinned(key)`` is true for a key that must not be forgotten now (default none).

    Raises:
        ValueError: ``max_keys`` below 1, or ``rate`` or ``burst`` not above 0.
    """

    def __init__(self, rate: float, burst: float, max_keys: int, *,
                 pinned: Callable[[K], bool] | None = None) -> None:
        if max_keys < 1:
            raise ValueError(f"a table of token buckets needs max_keys >= 1, not {max_keys}")
        TokenBucket(rate, burst)  # checks them
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._pinned = pinned
        self._buckets: collections.OrderedDict[K, TokenBucket] = collections.OrderedDict()

    def get(self, key: K, now: float) -> TokenBucket:
        """``key``'s bucket (made full at ``now`` if absent), now the most recently used."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, at=now)
        excess = len(self._buckets) - self.max_keys
        if excess > 0:
            victims = []
            for other in self._buckets:
                if len(victims) >= excess:
                    break
                if other != key and not (self._pinned is not None and self._pinned(other)):
                    victims.append(other)
            for other in victims:
                del self._buckets[other]
        return bucket

    def peek(self, key: K) -> TokenBucket | None:
        """``key``'s bucket if kept; makes nothing and leaves the order of use as it is."""
        return self._buckets.get(key)

    def __len__(self) -> int:
        """Buckets kept."""
        return len(self._buckets)

    def __contains__(self, key: object) -> bool:
        return key in self._buckets


class PeerBudgets:
    """Per-peer and total token buckets with in-flight caps (module docstring).

    Args:
        rate, burst: each peer's bucket (units a second, units).
        total_rate, total_burst: the bucket all peers share.
        max_inflight_per_peer, max_inflight: admitted requests running at once.
        max_peers: peers whose buckets are kept.

    Attributes:
        admitted, refused: requests admitted and refused so far.

    Raises:
        ValueError: a bound below 1 or a rate or burst not above 0.
    """

    def __init__(self, *, rate: float, burst: float, total_rate: float, total_burst: float,
                 max_inflight_per_peer: int = 1, max_inflight: int = 32,
                 max_peers: int = 4096) -> None:
        if min(max_inflight_per_peer, max_inflight, max_peers) < 1:
            raise ValueError("in-flight and peer bounds must be >= 1")
        self.rate, self.burst = rate, burst
        self.max_inflight_per_peer = max_inflight_per_peer
        self.max_inflight = max_inflight
        self.max_peers = max_peers
        self.total = TokenBucket(total_rate, total_burst)
        self._inflight: collections.Counter[bytes] = collections.Counter()
        self._peers: TokenBuckets[bytes] = TokenBuckets(
            rate, burst, max_peers, pinned=lambda peer: self._inflight.get(peer, 0) > 0)
        self.inflight = 0
        self.admitted = 0
        self.refused = 0

    def __len__(self) -> int:
        """Peers whose buckets are kept."""
        return len(self._peers)

    def admit(self, peer: bytes, now: float) -> str | None:
        """Admit one request of ``peer`` at ``now``: None, and the caller must :meth:`release`
        it when done (and :meth:`charge` what it cost); or why it is refused (for the peer: it
        says how long to wait), and nothing is held."""
        if self._inflight[peer] >= self.max_inflight_per_peer:
            return self._refuse(f"{self.max_inflight_per_peer} request(s) of this peer already "
                                "being answered")
        if self.inflight >= self.max_inflight:
            return self._refuse(f"{self.max_inflight} requests already being answered: "
                                "retry in a moment")
        wait = self._peers.get(peer, now).wait(now)
        if wait > 0:
            return self._refuse(f"over this peer's rate: retry in {wait:.1f} s")
        wait = self.total.wait(now)
        if wait > 0:
            return self._refuse(f"over this server's total rate: retry in {wait:.1f} s")
        self._inflight[peer] += 1
        self.inflight += 1
        self.admitted += 1
        return None

    def charge(self, peer: bytes, amount: float, now: float) -> None:
        """``peer`` cost ``amount`` units at ``now`` (both buckets; debt allowed)."""
        self._peers.get(peer, now).charge(amount, now)
        self.total.charge(amount, now)

    def release(self, peer: bytes) -> None:
        """An admitted request of ``peer`` is done."""
        if self._inflight[peer] <= 1:
            self._inflight.pop(peer, None)
        else:
            self._inflight[peer] -= 1
        self.inflight = max(0, self.inflight - 1)

    def _refuse(self, reason: str) -> str:
        self.refused += 1
        return reason

