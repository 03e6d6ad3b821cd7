"""Token buckets for what a peer may make a model node do per second, pure.

Issue 16 (HR-tree sync and gossip cost): a snapshot answer cost 49 ms of CPU at 32k entries and
every member could ask once a second; a large delta cost every member several ms, with no limit
per publisher. The services charge these buckets before doing the work:

* :class:`PeerBudget`: one token bucket per peer plus one for all peers together (the
  snapshot requests a node answers, ``ps_p2p.protocols.hrtree_gossip.SnapshotServer``);
* :class:`PublisherBudget`: per publisher *and* in total, one bucket of messages and one of bytes
  (the gossip a node takes from the group's topic, ``hrtree_gossip.GossipAdmission``).

A charge that a bucket cannot cover is refused and costs nothing: no bucket is debited, so a
peer over its own budget cannot drain the total, and a refused message does not use up the
peer's bytes. Peers are bounded (``max_peers``): past it the least recently charged one is
forgotten (it starts again with a full bucket, which the total bucket bounds). Values and their
reasons: :data:`SNAPSHOT_PER_PEER`, :data:`SNAPSHOT_TOTAL`, :data:`GOSSIP_MESSAGES_PER_PUBLISHER`,
:data:`GOSSIP_BYTES_PER_PUBLISHER`, :data:`GOSSIP_MESSAGES_TOTAL`, :data:`GOSSIP_BYTES_TOTAL`.

The buckets are :class:`ps_p2p.rate_limits.TokenBucket` and
:class:`~ps_p2p.rate_limits.TokenBuckets` (the project's one implementation). This module is a
pure core: the caller passes ``now`` (seconds, monotonic); no trio, libp2p,
clock or randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_p2p.errors import ConfigError
from ps_p2p.rate_limits import TokenBucket, TokenBuckets

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


def _table(rate: Rate, max_keys: int) -> TokenBuckets[bytes]:
    """One bucket of ``rate`` per key, at most ``max_keys`` (least recently charged forgotten
    first)."""
    if max_keys < 1:
        raise ConfigError("max_peers must be >= 1")
    return TokenBuckets(rate.per_second, rate.burst, max_keys)


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
        self._peers = _table(per_peer, max_peers)
        self._total = TokenBucket(total.per_second, total.burst)  # full at the first request
        self.refused = 0

    def admit(self, peer: bytes, now: float) -> bool:
        """Charge one request of ``peer`` at ``now``; False (nothing charged) when either the
        peer's or the total budget is spent."""
        mine = self._peers.get(peer, now)
        if mine.refill(now) < 1 or self._total.refill(now) < 1:
            self.refused += 1
            return False
        mine.charge(1, now)
        self._total.charge(1, now)
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
        self._messages = _table(messages, max_peers)
        self._data = _table(data, max_peers)
        # full at the first message
        self._totals = (TokenBucket(total_messages.per_second, total_messages.burst),
                        TokenBucket(total_data.per_second, total_data.burst))
        self.max_peers = max_peers
        self.refused: dict[bytes, int] = {}

    def admit(self, publisher: bytes, size: int, now: float) -> bool:
        """Charge one message of ``size`` bytes from ``publisher`` at ``now``; False (nothing
        charged, the refusal counted) when one of the four budgets cannot cover it. A message
        larger than a bytes burst is always refused."""
        total_messages, total_data = self._totals
        messages = self._messages.get(publisher, now)
        data = self._data.get(publisher, now)
        if (messages.refill(now) < 1 or data.refill(now) < size
                or total_messages.refill(now) < 1 or total_data.refill(now) < size):
            if publisher in self.refused or len(self.refused) < self.max_peers:
                self.refused[publisher] = self.refused.get(publisher, 0) + 1
            return False
        messages.charge(1, now)
        data.charge(size, now)
        total_messages.charge(1, now)
        total_data.charge(size, now)
        return True
