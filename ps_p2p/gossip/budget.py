"""Token buckets for what a peer may make a model node do per second, pure.

Issue 16 (HR-tree sync and gossip cost): a snapshot answer cost 49 ms of CPU at 32k entries and
every member could ask once a second; a large delta cost every member several ms, with no limit
per publisher. The services charge these buckets before doing the work:

* :class:`PeerBudget`: one :class:`TokenBucket` per peer plus one for all peers together (the
  snapshot requests a node answers, ``ps_p2p.protocols.hrtree_gossip.SnapshotServer``);
* :class:`PublisherBudget`: per publisher *and* in total, one bucket of messages and one of bytes
  (the gossip a node takes from the group's topic, ``hrtree_gossip.GossipAdmission``).

A charge that a bucket cannot cover is refused and costs nothing: no bucket is debited, so a
peer over its own budget cannot drain the total, and a refused message does not use up the
peer's bytes. Peers are bounded (``max_peers``): past it the least recently charged one is
forgotten (it starts again with a full bucket, which the total bucket bounds). Values and their
reasons: :data:`SNAPSHOT_PER_PEER`, :data:`SNAPSHOT_TOTAL`, :data:`GOSSIP_MESSAGES_PER_PUBLISHER`,
:data:`GOSSIP_BYTES_PER_PUBLISHER`, :data:`GOSSIP_MESSAGES_TOTAL`, :data:`GOSSIP_BYTES_TOTAL`.

This module is a pure core: the caller passes ``now`` (seconds, monotonic); no trio, libp2p,
clock or randomness.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ps_p2p.errors import ConfigError

__all__ = [
    "GOSSIP_BYTES_PER_PUBLISHER",
    "GOSSIP_BYTES_TOTAL",
    "GOSSIP_MESSAGES_PER_PUBLISHER",
    "GOSSIP_MESSAGES_TOTAL",
    "SNAPSHOT_PER_PEER",
    "SNAPSHOT_TOTAL",
    "PeerBudget",
    "PublisherBudget",
    "Rate",
    "TokenBucket",
]


@dataclass(frozen=True)
class Rate:
    """A budget: ``per_second`` units a second on average, at most ``burst`` at once.

    Raises:
        ConfigError: ``per_second`` <= 0 or ``burst`` < 1.
    """

    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_second > 0 and self.burst >= 1):
            raise ConfigError(f"a rate needs per_second > 0 and burst >= 1, not {self}")


SNAPSHOT_PER_PEER = Rate(per_second=1 / 10, burst=2)
"""Snapshot answers to one member: one per 10 s, as its sync loop asks at most (after a gap,
``roles.forwarding.SNAPSHOT_INTERVAL``), and 2 at once (a restarted member catching up)."""
SNAPSHOT_TOTAL = Rate(per_second=2, burst=8)
"""Snapshot answers to all members: 2 a second (a group of 64 members, each asking every 10 s,
needs 6.4 in the worst case but asks only after a gap), at most 2 MiB each on the wire; beyond,
askers retry later (their loop waits 20 s after a failure)."""
GOSSIP_MESSAGES_PER_PUBLISHER = Rate(per_second=4, burst=16)
"""Gossip messages from one publisher: its load report every second plus a delta every 2 s,
with room for the up to 8 deltas one take of a busy subtree gives (``MAX_PENDING_OPS`` /
``MAX_DELTA_OPS``)."""
GOSSIP_BYTES_PER_PUBLISHER = Rate(per_second=32 * 1024, burst=1024 * 1024)
"""Gossip bytes from one publisher: 32 KiB/s, over 5x what an engine prefilling 10k tokens a
second changes (~625 chunks of 16 tokens, ~9 bytes each, inserts plus evictions); a burst of 2
full deltas (a subtree rebuilt for a new L). Applying a delta costs ~0.35 ms of CPU per KiB
(``benchmarks/attacks/hrtree_sync_cost.py``), so one publisher costs each member at most
~11 ms/s after the burst. A publisher over it loses deltas: members then take its snapshot."""
GOSSIP_MESSAGES_TOTAL = Rate(per_second=256, burst=1024)
"""Gossip messages from all publishers: 64 members (``[forwarding] max_peers``) at their
per-publisher rate."""
GOSSIP_BYTES_TOTAL = Rate(per_second=256 * 1024, burst=4 * 1024 * 1024)
"""Gossip bytes from all publishers: 8 publishers at full rate, ~90 ms of CPU a second at most
(the per-publisher budget keeps one from taking it all)."""
DEFAULT_MAX_PEERS = 4096
"""Peers whose buckets are remembered (the least recently charged is forgotten beyond)."""


class TokenBucket:
    """``rate.burst`` tokens, refilled at ``rate.per_second``; starts full.

    Args:
        rate: the budget.
        now: seconds (monotonic) at creation.
    """

    __slots__ = ("_rate", "_tokens", "_at")

    def __init__(self, rate: Rate, now: float) -> None:
        self._rate = rate
        self._tokens = float(rate.burst)
        self._at = now

    def available(self, now: float) -> float:
        """Tokens there at ``now`` (time never runs backwards for a bucket)."""
        if now > self._at:
            self._tokens = min(self._rate.burst,
                               self._tokens + (now - self._at) * self._rate.per_second)
            self._at = now
        return self._tokens

    def take(self, amount: float) -> None:
        """Debit ``amount`` (the caller checked :meth:`available`)."""
        self._tokens -= amount


class _Buckets:
    """One bucket per key, at most ``max_keys`` (least recently charged forgotten first)."""

    def __init__(self, rate: Rate, max_keys: int) -> None:
        if max_keys < 1:
            raise ConfigError("max_peers must be >= 1")
        self.rate = rate
        self.max_keys = max_keys
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()

    def get(self, key: bytes, now: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, now)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def __len__(self) -> int:
        return len(self._buckets)


class PeerBudget:
    """Requests per peer and in total (e.g. snapshot answers).

    Args:
        per_peer: one peer's budget (requests).
        total: all peers' budget.
        max_peers: peers remembered.

    Attributes:
        refused: requests refused, all peers.
    """

    def __init__(self, per_peer: Rate = SNAPSHOT_PER_PEER, total: Rate = SNAPSHOT_TOTAL, *,
                 max_peers: int = DEFAULT_MAX_PEERS) -> None:
        self._peers = _Buckets(per_peer, max_peers)
        self._total_rate = total
        self._total: TokenBucket | None = None  # full at the first request
        self.refused = 0

    def admit(self, peer: bytes, now: float) -> bool:
        """Charge one request of ``peer`` at ``now``; False (nothing charged) when either the
        peer's or the total budget is spent."""
        if self._total is None:
            self._total = TokenBucket(self._total_rate, now)
        mine = self._peers.get(peer, now)
        if mine.available(now) < 1 or self._total.available(now) < 1:
            self.refused += 1
            return False
        mine.take(1)
        self._total.take(1)
        return True


class PublisherBudget:
    """Gossip messages and bytes per publisher and in total.

    Args:
        messages, data: one publisher's budgets (messages; bytes).
        total_messages, total_data: all publishers' budgets.
        max_peers: publishers remembered.

    Attributes:
        refused: messages refused, by publisher (at most ``max_peers`` publishers kept).
    """

    def __init__(self, messages: Rate = GOSSIP_MESSAGES_PER_PUBLISHER,
                 data: Rate = GOSSIP_BYTES_PER_PUBLISHER,
                 total_messages: Rate = GOSSIP_MESSAGES_TOTAL,
                 total_data: Rate = GOSSIP_BYTES_TOTAL, *,
                 max_peers: int = DEFAULT_MAX_PEERS) -> None:
        self._messages = _Buckets(messages, max_peers)
        self._data = _Buckets(data, max_peers)
        self._total_rates = (total_messages, total_data)
        self._totals: tuple[TokenBucket, TokenBucket] | None = None
        self.max_peers = max_peers
        self.refused: dict[bytes, int] = {}

    def admit(self, publisher: bytes, size: int, now: float) -> bool:
        """Charge one message of ``size`` bytes from ``publisher`` at ``now``; False (nothing
        charged, the refusal counted) when one of the four budgets cannot cover it. A message
        larger than a bytes burst is always refused."""
        if self._totals is None:
            self._totals = (TokenBucket(self._total_rates[0], now),
                            TokenBucket(self._total_rates[1], now))
        total_messages, total_data = self._totals
        messages = self._messages.get(publisher, now)
        data = self._data.get(publisher, now)
        if (messages.available(now) < 1 or data.available(now) < size
                or total_messages.available(now) < 1 or total_data.available(now) < size):
            if publisher in self.refused or len(self.refused) < self.max_peers:
                self.refused[publisher] = self.refused.get(publisher, 0) + 1
            return False
        messages.take(1)
        data.take(size)
        total_messages.take(1)
        total_data.take(size)
        return True
