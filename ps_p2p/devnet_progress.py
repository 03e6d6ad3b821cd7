"""The devnet's progress display: live counts on a terminal, plain lines elsewhere.

:class:`Progress` holds the counts (the :class:`~ps_p2p.devnet.Devnet` updates them from its
workers' status lines and from the prompts it sends); a display task shows them:

* :class:`LiveDisplay` (stdout is a terminal): a ``rich`` live region under the devnet's own
  lines, redrawn 4 times a second: the phase, nodes up, nodes holding the full directory, users
  with their paths, then a bar of the prompts answered and failed;
* :class:`PlainDisplay` (a pipe, a file, CI): while the network starts, one line every 5 s when
  the counts changed, e.g. ``waiting for user paths: 14/14 nodes up, 10/10 directories
  complete, 6/8 users have their paths (21 s)``; afterwards nothing (each prompt prints its own
  line). A directory is complete when it lists every user and model node of the devnet; a user
  has its paths as soon as its directory lists enough relays, often before it is complete, so
  the two counts are independent.

:func:`progress_line` and :func:`progress_table` are pure: counts and the time in, text out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import IO, Any, Protocol

import trio

#: seconds between plain progress lines
PLAIN_EVERY = 5.0
#: seconds between redraws of the live region
LIVE_EVERY = 0.25


@dataclass
class Progress:
    """Counts of one devnet run; times are trio clock seconds.

    Attributes:
        nodes, users: nodes and users the devnet starts.
        nodes_up: nodes running with their host listening.
        directory_nodes: model nodes and users, which must each hold the full directory.
        with_directory: those of them holding it.
        users_ready: users holding n ready paths.
        nodes_down: nodes stopped, failed or killed.
        phase: what the devnet does now (``starting``, ``waiting for user paths``, ``sending
            prompts``).
        ready: the start is over (every user had its paths).
        prompts: prompts handed to :meth:`~ps_p2p.devnet.Devnet.send_prompts` so far.
        answered, failed: prompts with an answer, with an error.
        in_flight: prompts sent and not yet answered (at most the concurrency).
        started_at: trio time of the first process start.
    """

    nodes: int
    users: int
    directory_nodes: int
    nodes_up: int = 0
    with_directory: int = 0
    users_ready: int = 0
    nodes_down: int = 0
    phase: str = "starting"
    ready: bool = False
    prompts: int = 0
    answered: int = 0
    failed: int = 0
    in_flight: int = 0
    started_at: float = 0.0


def progress_line(p: Progress, now: float) -> str:
    """One plain line of ``p`` at trio time ``now``."""
    line = (f"{p.phase}: {p.nodes_up}/{p.nodes} nodes up, {p.with_directory}/{p.directory_nodes} "
            f"directories complete, {p.users_ready}/{p.users} users have their paths")
    if p.nodes_down:
        line += f", {p.nodes_down} down"
    if p.prompts:
        line += f"; prompts {p.answered} answered, {p.failed} failed, {p.in_flight} in flight"
    return line + f" ({now - p.started_at:.0f} s)"


def progress_table(p: Progress, now: float) -> Any:
    """The live region of ``p`` at trio time ``now``: a ``rich`` renderable of two lines (the
    phase and node counts; once prompts are sent, a bar of them)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    def count(done: int, total: int, what: str) -> Text:
        style = "green" if done >= total else "yellow"
        return Text.assemble((f"{done}/{total}", style), f" {what}")

    sep = Text(" · ", style="dim")
    parts = [Text(p.phase, style="bold"), count(p.nodes_up, p.nodes, "nodes up"),
             count(p.with_directory, p.directory_nodes, "directories complete"),
             count(p.users_ready, p.users, "users have their paths")]
    if p.nodes_down:
        parts.append(Text(f"{p.nodes_down} down", style="red"))
    parts.append(Text(f"{now - p.started_at:.0f} s", style="dim"))
    lines: list[Any] = [sep.join(parts)]
    if p.prompts:
        row = Table.grid(padding=(0, 1))
        failed = Text(f"{p.failed} failed", style="red" if p.failed else "dim")
        row.add_row(
            Text("prompts"),
            ProgressBar(total=p.prompts, completed=p.answered + p.failed, width=30),
            sep.join([count(p.answered, p.prompts, "answered"), failed,
                      Text(f"{p.in_flight} in flight")]),
        )
        lines.append(row)
    return Group(*lines)


class Display(Protocol):
    async def run(self, progress: Progress) -> None:
        """Show ``progress`` until cancelled (a last view on the way out)."""
        ...


class PlainDisplay:
    """Plain lines while the network starts, every ``every`` seconds when the counts changed."""

    def __init__(self, file: IO[str] | None = None, every: float = PLAIN_EVERY) -> None:
        self._file = file
        self._every = every

    async def run(self, progress: Progress) -> None:
        last = None
        while True:
            await trio.sleep(self._every)  # a report period, not a wait for another task
            if progress.ready:
                continue
            counts = progress_line(progress, progress.started_at)  # the counts without the time
            if counts != last:
                last = counts
                line = progress_line(progress, trio.current_time())
                print(f"  {line}", file=self._file or sys.stdout, flush=True)


class LiveDisplay:
    """A ``rich`` live region on a terminal; what the program prints goes above it."""

    def __init__(self, file: IO[str] | None = None, every: float = LIVE_EVERY) -> None:
        self._file = file
        self._every = every

    async def run(self, progress: Progress) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self._file or sys.stdout)
        live = Live(console=console, auto_refresh=False, redirect_stderr=False)
        with live:
            try:
                while True:
                    live.update(progress_table(progress, trio.current_time()), refresh=True)
                    await trio.sleep(self._every)  # the redraw period
            finally:
                live.update(progress_table(progress, trio.current_time()), refresh=True)


def choose_display(file: IO[str] | None = None) -> Display:
    """:class:`LiveDisplay` when ``file`` (default stdout) is a terminal (and ``TERM`` is not
    ``dumb``), else :class:`PlainDisplay`."""
    import os

    stream = file or sys.stdout
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if terminal and os.environ.get("TERM", "") != "dumb":
        return LiveDisplay(file)
    return PlainDisplay(file)
