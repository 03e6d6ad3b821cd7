"""Load factor of a model node (PlanetServe sec. 3.3, Algorithm 2), pure.

F_LB = L * (Q / C), where L is an exponentially weighted moving average of service latency
(alpha = 1/8, as TCP's SRTT estimator, RFC 6298), Q the requests queued or running and C the
node's concurrent capacity. The HR-tree forwarding of a later issue compares peers by F_LB; this
issue's model node uses the same tracker for admission and for its logs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_p2p.errors import ConfigError

#: EWMA weight of a new latency sample (paper sec. 3.3).
EWMA_ALPHA = 1.0 / 8.0


@dataclass
class LoadTracker:
    """Tracks latency EWMA, queue length and capacity of one model node.

    Attributes:
        capacity: C, requests served concurrently (>= 1).
        max_queue: requests allowed to wait beyond ``capacity``; more are refused ("overloaded").
        latency_ewma: L in seconds; None until the first completion.
        in_service: requests being served now (<= capacity).
        queued: requests waiting for a slot.
    """

    capacity: int
    max_queue: int
    latency_ewma: float | None = None
    in_service: int = 0
    queued: int = 0
    served: int = 0
    refused: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ConfigError("capacity must be >= 1")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")

    def try_admit(self) -> bool:
        """Admit one request into the queue; False (and counted as refused) when full."""
        if self.queued >= self.max_queue + max(0, self.capacity - self.in_service):
            self.refused += 1
            return False
        self.queued += 1
        return True

    def start(self) -> None:
        """A queued request got a service slot."""
        self.queued -= 1
        self.in_service += 1

    def finish(self, latency: float) -> None:
        """A request finished after ``latency`` seconds of service; updates the EWMA."""
        self.in_service -= 1
        self.served += 1
        if self.latency_ewma is None:
            self.latency_ewma = latency
        else:
            self.latency_ewma += EWMA_ALPHA * (latency - self.latency_ewma)

    def load_factor(self) -> float:
        """F_LB = L * (Q / C) with Q = queued + in service; 0.0 before the first sample."""
        if self.latency_ewma is None:
            return 0.0
        return self.latency_ewma * ((self.queued + self.in_service) / self.capacity)
