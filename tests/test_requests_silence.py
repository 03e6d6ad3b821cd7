"""The request core tells the path pool which paths stayed silent (issue 20 sec. 4), and its
resend goes on other paths. Pure core, injected time (helpers of tests/test_requests.py)."""

from __future__ import annotations

import pytest

from ps_p2p.overlay.requests import PathSilent, SendClove
from tests.test_requests import READY, Path, _core, _of, _serve, _spec


@pytest.mark.parametrize(
    "answered",  # which cloves of the first attempt brought a response clove back
    [(), (0,), (0, 1)],
    ids=["none", "one", "two"],
)
def test_an_unanswered_attempt_reports_the_paths_that_brought_nothing_back(answered):
    ready = [*READY, Path(6, b"proxy-6"), Path(7, b"proxy-7"), Path(8, b"proxy-8"),
             Path(9, b"proxy-9")]
    core = _core()
    first = _of(core.start(_spec(max_tokens=0), 0.0, ready), SendClove)
    responses = _serve(first)
    for i in answered:  # fewer than k: the answer cannot decode
        core.response_clove(responses[i], 1.0)
    commands = core.tick(8.0, ready)
    silent = {c.path_id for c in _of(commands, PathSilent)}
    assert silent == {s.path_id for i, s in enumerate(first) if i not in answered}
    second = _of(commands, SendClove)
    assert len(second) == 4
    assert not {c.path_id for c in second} & silent  # the resend goes on other paths


def test_with_too_few_other_paths_the_resend_goes_at_once_on_the_silent_ones():
    core = _core()
    first = _of(core.start(_spec(max_tokens=0), 0.0, READY), SendClove)
    commands = core.tick(8.0, READY)
    assert {c.path_id for c in _of(commands, PathSilent)} == {s.path_id for s in first}
    assert len(_of(commands, SendClove)) == 4


def test_an_answered_request_reports_no_path():
    core = _core()
    first = _of(core.start(_spec(max_tokens=0), 0.0, READY), SendClove)
    commands = []
    for clove in _serve(first):
        commands += core.response_clove(clove, 1.0)
    commands += core.tick(9.0, READY)
    assert _of(commands, PathSilent) == []
