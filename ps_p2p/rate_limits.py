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
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["PeerBudgets", "TokenBucket"]


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
        TokenBucket(rate, burst)  # checks them
        self.rate, self.burst = rate, burst
        self.max_inflight_per_peer = max_inflight_per_peer
        self.max_inflight = max_inflight
        self.max_peers = max_peers
        self.total = TokenBucket(total_rate, total_burst)
        self._peers: collections.OrderedDict[bytes, TokenBucket] = collections.OrderedDict()
        self._inflight: collections.Counter[bytes] = collections.Counter()
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
        wait = self._bucket(peer, now).wait(now)
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
        self._bucket(peer, now).charge(amount, now)
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

    def _bucket(self, peer: bytes, now: float) -> TokenBucket:
        bucket = self._peers.get(peer)
        if bucket is not None:
            self._peers.move_to_end(peer)
            return bucket
        bucket = self._peers[peer] = TokenBucket(self.rate, self.burst, at=now, tokens=self.burst)
        if len(self._peers) > self.max_peers:
            for other in list(self._peers):
                if len(self._peers) <= self.max_peers:
                    break
                if other != peer and not self._inflight[other]:
                    del self._peers[other]
        return bucket
