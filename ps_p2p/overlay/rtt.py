"""Round-trip time estimates and retransmission timeouts (RFC 6298), per peer or path (pure).

A starved machine answers late, not never: fixed timeouts made a loaded 50-user devnet tear
down working paths and rebuild them, which costs more CPU and feeds on itself. Timeouts derived
from measured round trips grow with the load instead.

Source: RFC 6298 sec. 2 (SRTT, RTTVAR, RTO; alpha = 1/8, beta = 1/4, K = 4) and sec. 5 (back
the timer off by doubling after a timeout; Karn's rule: no sample from a round trip that was
retransmitted or timed out). Times are seconds; ``now`` never appears: samples are durations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

#: RFC 6298 gains and variance factor.
ALPHA = 1 / 8
BETA = 1 / 4
K = 4


@dataclass
class RttEstimator:
    """One RFC 6298 estimator.

    Args:
        initial_rto: RTO before any sample (RFC 6298 2.1 says 1 s; callers pass their old fixed
            timeout so nothing gets faster than it was before measurements exist).
        min_rto: floor of the RTO (RFC 6298 2.4 says 1 s for TCP; the overlay's floor is the
            caller's fixed timeout, so a fast network keeps its quick failure detection).
        max_rto: ceiling (RFC 6298 2.5: at least 60 s is allowed).
        granularity: G, the clock granularity (s).
    """

    initial_rto: float = 1.0
    min_rto: float = 1.0
    max_rto: float = 60.0
    granularity: float = 0.001
    srtt: float | None = None
    rttvar: float = 0.0
    backoff: int = 0  # doublings since the last good sample (RFC 6298 5.5)

    def sample(self, rtt: float) -> None:
        """Feed one measured round trip (seconds) of a request that was sent once (Karn)."""
        rtt = max(0.0, rtt)
        if self.srtt is None:  # 2.2
            self.srtt = rtt
            self.rttvar = rtt / 2
        else:  # 2.3: RTTVAR first, with the old SRTT
            self.rttvar = (1 - BETA) * self.rttvar + BETA * abs(self.srtt - rtt)
            self.srtt = (1 - ALPHA) * self.srtt + ALPHA * rtt
        self.backoff = 0

    def timed_out(self) -> None:
        """A round trip timed out: double the RTO until the next good sample (5.5)."""
        self.backoff = min(self.backoff + 1, 16)

    @property
    def rto(self) -> float:
        """The retransmission timeout (s), within [min_rto, max_rto]."""
        if self.srtt is None:
            base = self.initial_rto
        else:
            base = self.srtt + max(self.granularity, K * self.rttvar)  # 2.3
        return min(self.max_rto, max(self.min_rto, base) * (2 ** self.backoff))


class RttTable:
    """Estimators per key (peer ID, path key), bounded, least recently used forgotten first.

    Args:
        initial_rto, min_rto, max_rto: passed to each :class:`RttEstimator`.
        max_keys: estimators kept at most.
    """

    def __init__(
        self, *, initial_rto: float, min_rto: float, max_rto: float = 60.0, max_keys: int = 4096
    ) -> None:
        self._params = dict(initial_rto=initial_rto, min_rto=min_rto, max_rto=max_rto)
        self._max_keys = max_keys
        self._estimators: OrderedDict[Hashable, RttEstimator] = OrderedDict()

    def get(self, key: Hashable, *, initial_rto: float | None = None) -> RttEstimator:
        """The estimator of ``key`` (created on first use).

        ``initial_rto`` (s) replaces the table's initial RTO for this key until its first
        sample (a key known to be slower than the rest, e.g. a relayed peer); samples take over
        from it as from any initial RTO (RFC 6298 2.2)."""
        estimator = self._estimators.get(key)
        if estimator is None:
            params = dict(self._params)
            if initial_rto is not None:
                params["initial_rto"] = initial_rto
            estimator = self._estimators[key] = RttEstimator(**params)
            while len(self._estimators) > self._max_keys:
                self._estimators.popitem(last=False)
        else:
            if initial_rto is not None and estimator.srtt is None:
                estimator.initial_rto = initial_rto
            self._estimators.move_to_end(key)
        return estimator

    def rto(self, key: Hashable, *, initial_rto: float | None = None) -> float:
        """RTO of ``key`` (the initial RTO, or ``initial_rto`` as in :meth:`get`, for a key
        without samples; creates nothing)."""
        estimator = self._estimators.get(key)
        if estimator is None:
            params = dict(self._params)
            if initial_rto is not None:
                params["initial_rto"] = initial_rto
            return RttEstimator(**params).rto
        if initial_rto is not None and estimator.srtt is None:
            estimator.initial_rto = initial_rto
        return estimator.rto

    def forget(self, key: Hashable) -> None:
        self._estimators.pop(key, None)


__all__ = ["RttEstimator", "RttTable"]
