"""The devnet's progress display (ps_p2p.devnet_progress): pure renderings of the counts, and the
two displays on a mock clock."""

from __future__ import annotations

import io

import pytest
import trio

from ps_p2p.devnet_progress import (
    LiveDisplay,
    PlainDisplay,
    Progress,
    choose_display,
    progress_line,
    progress_table,
)


def _progress(**counts) -> Progress:
    return Progress(nodes=14, users=8, directory_nodes=10, **counts)


@pytest.mark.parametrize(
    "counts, now, expected",
    [
        ({}, 0.0, "starting: 0/14 nodes up, 0/10 directories complete, 0/8 users have their "
                  "paths (0 s)"),
        ({"phase": "waiting for user paths", "nodes_up": 14, "with_directory": 10,
          "users_ready": 6, "started_at": 100.0}, 121.2,
         "waiting for user paths: 14/14 nodes up, 10/10 directories complete, 6/8 users have "
         "their paths (21 s)"),
        ({"phase": "sending prompts", "nodes_up": 13, "with_directory": 10, "users_ready": 8,
          "nodes_down": 1, "prompts": 80, "answered": 23, "failed": 1, "in_flight": 4}, 60.0,
         "sending prompts: 13/14 nodes up, 10/10 directories complete, 8/8 users have their paths, 1 down; prompts 23 "
         "answered, 1 failed, 4 in flight (60 s)"),
    ],
    ids=["nothing-yet", "waiting-for-paths", "prompts-with-a-node-down"],
)
def test_progress_line_states_every_count(counts, now, expected):
    assert progress_line(_progress(**counts), now) == expected


def test_progress_table_shows_the_counts_and_the_prompt_bar():
    from rich.console import Console

    out = io.StringIO()
    progress = _progress(phase="prompts", nodes_up=14, users_ready=8, prompts=80, answered=23,
                         in_flight=4)

    Console(file=out, width=160).print(progress_table(progress, 30.0))

    text = out.getvalue()
    assert "14/14 nodes up" in text and "8/8 users have their paths" in text
    assert "23/80 answered" in text and "4 in flight" in text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "file, term, kind",
    [(io.StringIO(), "xterm", PlainDisplay), (_Terminal(), "xterm", LiveDisplay),
     (_Terminal(), "dumb", PlainDisplay)],
    ids=["pipe", "terminal", "dumb-terminal"],
)
def test_a_live_display_only_on_a_terminal(monkeypatch, file, term, kind):
    monkeypatch.setenv("TERM", term)

    assert isinstance(choose_display(file), kind)


async def test_plain_display_prints_a_line_when_the_counts_changed_until_the_network_is_ready(
    autojump_clock,
):
    out = io.StringIO()
    progress = _progress(phase="waiting for user paths")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(PlainDisplay(out, every=5.0).run, progress)
        await trio.sleep(5.5)  # one line
        await trio.sleep(5.0)  # unchanged: no line
        progress.users_ready = 3
        await trio.sleep(5.0)  # changed: a line
        progress.ready = True
        progress.users_ready = 8
        await trio.sleep(10.0)  # ready: no more lines
        nursery.cancel_scope.cancel()

    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "  waiting for user paths: 0/14 nodes up, 0/10 directories complete, 0/8 users have their paths",
        "  waiting for user paths: 0/14 nodes up, 0/10 directories complete, 3/8 users have their paths",
    ]


async def test_live_display_shows_the_last_counts_when_it_stops(autojump_clock):
    out = io.StringIO()
    progress = _progress(phase="prompts", prompts=2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(LiveDisplay(out, every=0.25).run, progress)
        await trio.sleep(1.0)
        progress.answered = 2
        nursery.cancel_scope.cancel()

    assert "2/2 answered" in out.getvalue()
