"""Graceful stop of a model node on SIGTERM (pure core, injected time).

A model node that is told to stop (systemd, docker, Kubernetes send SIGTERM and wait a grace
period before SIGKILL) should not cut off the users whose answers it is generating:

1. stop taking new requests: they are answered OVERLOADED, which makes the user ask another
   model node at once (:attr:`ps_p2p.serving.dispatch.Dispatcher.draining`), and withdraw the
   node record from the verifiers so users stop choosing it (``Node.withdraw``);
2. let the requests in service finish, for at most ``grace`` seconds;
3. stop; exit status 0 whether or not the grace period ran out (what was still in service is
   counted as abandoned and logged).

:class:`Drain` holds the deadline and decides when the drain is over; the adapter
(``ModelNodeService.drain``) tells it how many jobs are in service after every change and waits
until :meth:`Drain.next_deadline` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Default seconds a draining model node waits for its requests in service (``--drain-timeout``).
DEFAULT_DRAIN_TIMEOUT = 30.0


@dataclass(frozen=True)
class DrainReport:
    """How a drain ended.

    Attributes:
        finished: requests in service at the start that finished within the grace period.
        abandoned: requests still in service when the grace period ran out (0 when drained).
        seconds: from the start of the drain to its end.
    """

    finished: int
    abandoned: int
    seconds: float

    @property
    def complete(self) -> bool:
        """Every request in service finished."""
        return self.abandoned == 0


class Drain:
    """When a model node's drain ends (see the module docstring).

    Args:
        grace: seconds the requests in service get (>= 0; 0 stops at once).
        now: seconds (any monotonic clock) when the drain starts.
        in_service: jobs admitted and not finished at ``now``.

    Raises:
        ValueError: ``grace`` negative or not finite.
    """

    def __init__(self, grace: float, now: float, in_service: int) -> None:
        if not (math.isfinite(grace) and grace >= 0):
            raise ValueError(f"grace must be >= 0 seconds, not {grace!r}")
        self.started_at = now
        self.deadline = now + grace
        self._initial = in_service
        self.report: DrainReport | None = None
        self.update(in_service, now)

    @property
    def done(self) -> bool:
        return self.report is not None

    def update(self, in_service: int, now: float) -> DrainReport | None:
        """The jobs in service now (after a job finished, or at a deadline).

        Resent copies may still join a job, but no new job starts while draining, so the count
        only falls. Returns the report once the drain is over (every job finished, or
        ``now`` reached the deadline), then keeps returning it.
        """
        if self.report is not None:
            return self.report
        if in_service <= 0 or now >= self.deadline:
            left = max(0, in_service)
            self.report = DrainReport(
                finished=max(0, self._initial - left), abandoned=left,
                seconds=now - self.started_at,
            )
        return self.report

    def next_deadline(self) -> float | None:
        """When the grace period runs out (None once over)."""
        return None if self.report is not None else self.deadline


__all__ = ["DEFAULT_DRAIN_TIMEOUT", "Drain", "DrainReport"]
