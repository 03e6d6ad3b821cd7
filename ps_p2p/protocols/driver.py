"""The one generic driver of a pure core: an inbox, a timer and command execution (DESIGN.md
"Layers").

Every protocol core (the overlay's :class:`~ps_p2p.overlay.relay.RelayCore`, the model node's
dispatch, and later consensus and gossip) has the same shape: inputs are method calls that take
``now`` and return a list of commands, ``tick(now)`` does the timer work and ``next_deadline()``
says when it is next due. :class:`CoreDriver` runs such a core in one task:

* stream handlers decode a frame and :meth:`CoreDriver.submit` a bound input (e.g.
  ``functools.partial(core.receive_cell, peer, path_id, payload)``) under the peer it came from;
  ``submit`` never blocks: a full inbox drops the input (counted), as a congested router drops a
  packet;
* the inbox is shared fairly among the peers with inputs queued (issue 16: one peer's junk
  setups filled the single 8,192-input inbox and honest setups waited behind them, p50 678 ->
  1,663 ms): each peer has its own queue, kept in arrival order; the task takes one input per
  peer in turn (round robin, like fair queueing on a router), so an honest input waits for one
  input of each other busy peer, never for a flooder's backlog; a peer may hold at most its
  share of the inbox (``inbox`` over the peers with inputs queued), and when the inbox is full an
  input under its share pushes out the oldest input of the longest peer queue (longest queue
  drop), so a flood of any number of peers cannot keep another peer's inputs out;
* the task calls each input with the current time and hands every command to ``execute``
  (which must not block either: link queues, events); it takes every input already queued (up
  to :data:`MAX_BATCH`) before it yields, so link writers coalesce the frames of a burst into
  few writes;
* when ``next_deadline()`` passes (or every ``tick_interval`` seconds, if given) it calls
  ``tick(now)``;
* an input or command that raises is logged and costs only itself; the driver never dies of it.

Code that runs on the same trio thread (the node's own calls, e.g. opening a path) may call the
core directly and execute the commands itself, then :meth:`CoreDriver.wake` the driver so it
re-reads ``next_deadline()``: trio never switches tasks inside a synchronous call, so every input
still applies atomically.

The handler-to-core shortcut (``submit(..., direct=True)``, issue 22): a stream handler that
submits an input while the inbox is empty applies it itself, on its own task, instead of waking
the driver task for it (two scheduler passes and a task switch per cell on every relay). It is
taken only when nothing can be overtaken or nested:

* the inbox is empty (no input of any peer waits: arrival order and the round robin hold);
* no input or command of this driver is being applied (``submit`` called from inside one, e.g.
  a command's callback, queues: the core is never re-entered);
* the submitting task has not already applied an input directly in this scheduler step (one
  ``read`` that brought a burst of frames applies the first and queues the rest, so a flooder's
  burst still waits its turn in the round robin and an honest peer's input stays behind one
  input of each busy peer, as before);
* the driver is running.

The core is still owned by one logical actor: every input is applied synchronously on the trio
thread, never two at once, whichever task runs it. After a direct input the driver is woken only
if the core's next deadline moved before the one it sleeps until.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

import trio

from ps_p2p.errors import PsError

log = logging.getLogger(__name__)

C = TypeVar("C")

#: Inputs queued at most (over all peers) before :meth:`CoreDriver.submit` drops them.
DEFAULT_INBOX = 8192
#: The queue of inputs submitted without a peer (the node's own calls): never pushed out.
LOCAL = None
#: Inputs taken in one go before the driver yields to other tasks.
MAX_BATCH = 512

Input = Callable[[float], Iterable[C]]


class CoreDriver(Generic[C]):
    """Runs one core (see the module docstring).

    Args:
        name: for logs.
        execute: carries out one command; must not block.
        tick: ``tick(now) -> commands``, the core's timer work.
        next_deadline: ``() -> float | None``, when ``tick`` is next due (trio clock seconds).
        tick_interval: also tick at least this often (seconds); None: only at deadlines.
        inbox: inputs queued at most, over all peers (each peer holds at most its share).
        clock: trio's clock (``trio.current_time``), injectable for tests.

    Attributes:
        dropped: inputs refused because the inbox (or the peer's share of it) was full, or
            pushed out by another peer's input.
        failed: inputs or commands that raised (logged).
        direct: inputs applied by their submitter (``direct=True``, see the module docstring).
    """

    def __init__(
        self,
        name: str,
        *,
        execute: Callable[[C], None],
        tick: Callable[[float], Iterable[C]],
        next_deadline: Callable[[], float | None],
        tick_interval: float | None = None,
        inbox: int = DEFAULT_INBOX,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.name = name
        self._execute = execute
        self._tick = tick
        self._next_deadline = next_deadline
        self._tick_interval = tick_interval
        self._clock = clock
        self._inbox = inbox
        # peer -> its queued inputs in arrival order; the dict's order is the round robin's
        self._queues: OrderedDict[Hashable, deque[Input[C]]] = OrderedDict()
        self._queued = 0
        self._woken = False
        self._closed = False
        self._wakeup = trio.Event()
        self._next_tick = -math.inf
        self._processed = trio.Event()
        self._running = False
        self._applying = False
        self._sleep_until = -math.inf  # the deadline the driver task sleeps until, if it sleeps
        self._direct_step: tuple[object, int] | None = None  # (task, step) of the last direct
        self.dropped = 0
        self.failed = 0
        self.direct = 0

    def submit(
        self,
        event: Input[C],
        *,
        peer: Hashable = LOCAL,
        essential: bool = False,
        direct: bool = False,
    ) -> bool:
        """Queue one input for the driver task; never blocks.

        Args:
            peer: the remote the input came from (its peer ID), for its share of the inbox;
                ``LOCAL`` (None) for the node's own inputs.
            essential: an input that must not be lost (a caller waits on its outcome, or the
                core would keep state for an answer that never comes): when the inbox is full
                it is applied at once on the caller's task instead of dropped (and not
                counted), as a direct call would be (see the module docstring). Only for code
                on the driver's trio thread that is not itself inside a core's command
                execution (e.g. another service's callback).
            direct: the caller is a stream handler at the top of its task (not inside any
                core's input or command): apply the input at once when the inbox is empty
                (the handler-to-core shortcut of the module docstring); otherwise queued.

        Returns:
            False when the input was dropped (counted): the inbox is full (and the input not
            essential), the peer holds its share of it, or the driver has stopped.
        """
        if self._closed:
            self._count_drop()
            return False
        if direct and self._may_apply_now():
            self._apply_now(event)
            return True
        queue = self._queues.get(peer)
        held = len(queue) if queue is not None else 0
        peers = len(self._queues) + (queue is None)
        share = max(1, self._inbox // peers)
        if held >= share or (self._queued >= self._inbox and not self._push_out(peer)):
            if essential:
                self._apply(event, self._clock())
                self.wake()
                return True
            self._count_drop()
            return False
        if queue is None:
            queue = self._queues[peer] = deque()
        queue.append(event)
        self._queued += 1
        self._wakeup.set()
        return True

    def _may_apply_now(self) -> bool:
        """Whether the shortcut may apply an input now (see the module docstring)."""
        if self._queued or self._applying or not self._running:
            return False
        task = trio.lowlevel.current_task()
        # trio counts each task's passes through the scheduler: the same count means the same
        # step (private attribute; without it the shortcut is never taken)
        step = getattr(task, "_schedule_points", None)
        if step is None:
            return False
        mark = (task, step)
        if self._direct_step == mark:
            return False
        self._direct_step = mark
        return True

    def _apply_now(self, event: Input[C]) -> None:
        self._applying = True
        try:
            self._apply(event, self._clock())
        finally:
            self._applying = False
        self.direct += 1
        if self._deadline() < self._sleep_until:
            self._wakeup.set()  # the core is due earlier than the driver sleeps
        self._notify()

    def _push_out(self, newcomer: Hashable) -> bool:
        """Make room for ``newcomer``'s input (under its share) by dropping the oldest input of
        the longest other peer queue (never a local one); False when there is none. O(peers
        with inputs queued), and only when the inbox is full and the input is under its share
        (a flooder over its share is refused in O(1))."""
        longest: deque[Input[C]] | None = None
        longest_peer: Hashable = LOCAL
        for peer, queue in self._queues.items():
            if peer is not LOCAL and peer != newcomer and (longest is None or len(queue) > len(longest)):
                longest, longest_peer = queue, peer
        if longest is None:
            return False
        longest.popleft()
        self._queued -= 1
        if not longest:
            del self._queues[longest_peer]
        self._count_drop()
        return True

    def queued(self, peer: Hashable = LOCAL) -> int:
        """Inputs of ``peer`` waiting in the inbox."""
        queue = self._queues.get(peer)
        return len(queue) if queue is not None else 0

    def _count_drop(self) -> None:
        self.dropped += 1
        if self.dropped in (1, 100, 10_000, 1_000_000):
            log.warning("%s: inbox full, %d input(s) dropped", self.name, self.dropped)

    async def wait_processed(self) -> None:
        """Wait until the driver next finishes a batch of inputs or a tick (for code that waits
        on a condition of the core, e.g. a counter, instead of polling it). Call it in the same
        step as the check of the condition; a task that waits for several drivers takes
        :attr:`processed` before its check instead."""
        await self._processed.wait()

    @property
    def processed(self) -> trio.Event:
        """The event set when the driver next finishes a batch of inputs, a direct input or a
        tick (a new one after each). Taken *before* checking a condition of the core and
        awaited after, it misses nothing applied in between; :meth:`wait_processed` called from
        a task started after the check can (the input that made the condition true may be
        applied before that task first runs, and nothing may follow it)."""
        return self._processed

    def _notify(self) -> None:
        self._processed.set()
        self._processed = trio.Event()

    def wake(self) -> None:
        """Make the driver re-read ``next_deadline()`` (after a direct call to the core)."""
        self._woken = True
        self._wakeup.set()

    def run_commands(self, commands: Iterable[C]) -> None:
        """Execute ``commands`` now, each guarded (for direct calls to the core)."""
        for command in commands:
            try:
                self._execute(command)
            except Exception:  # one command's failure must not stop the others
                self.failed += 1
                log.exception("%s: command %s failed", self.name, type(command).__name__)

    def _deadline(self) -> float:
        deadline = self._next_deadline()
        at = math.inf if deadline is None else deadline
        if self._tick_interval is not None:
            at = min(at, self._next_tick)
        return at

    def _do_tick(self, now: float) -> None:
        if self._tick_interval is not None:
            self._next_tick = now + self._tick_interval
        try:
            commands = list(self._tick(now))
        except Exception:
            self.failed += 1
            log.exception("%s: tick failed", self.name)
            return
        self.run_commands(commands)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve inputs and timers until cancelled."""
        self._next_tick = self._clock() + (self._tick_interval or 0.0)
        self._running = True
        task_status.started()
        try:
            while True:
                if self._queued or self._woken:
                    await trio.lowlevel.checkpoint()  # let the other tasks run between batches
                else:
                    self._sleep_until = self._deadline()
                    with trio.move_on_at(self._sleep_until):
                        await self._wakeup.wait()
                    self._sleep_until = -math.inf
                self._wakeup = trio.Event()
                self._woken = False
                now = self._clock()
                # Take what else is queued before yielding: the link writers then find many
                # frames per peer and coalesce them into one write (one Noise and Yamux
                # message instead of one per cell). One input per peer in turn.
                for _ in range(MAX_BATCH):
                    if not self._queues:
                        break
                    peer, queue = next(iter(self._queues.items()))
                    event = queue.popleft()
                    self._queued -= 1
                    if queue:
                        self._queues.move_to_end(peer)
                    else:
                        del self._queues[peer]
                    self._applying = True
                    try:
                        self._apply(event, now)
                    finally:
                        self._applying = False
                if now >= self._deadline():
                    self._do_tick(now)
                self._notify()
        finally:
            self._running = False
            self._sleep_until = -math.inf
            self._closed = True
            self._queues.clear()
            self._queued = 0

    def _apply(self, event: Input[C], now: float) -> None:
        try:
            commands = list(event(now))
        except PsError as exc:
            self.failed += 1
            log.warning("%s: input refused: %s", self.name, exc)
            return
        except Exception:
            self.failed += 1
            log.exception("%s: input failed", self.name)
            return
        self.run_commands(commands)


__all__ = ["DEFAULT_INBOX", "LOCAL", "CoreDriver"]
