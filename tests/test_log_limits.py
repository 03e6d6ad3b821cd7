"""Repeated identical warnings are rate-limited (ps_p2p.log_limits), with the count of those held
back, and ``ps-node``'s logging setup installs the limit."""

from __future__ import annotations

import io
import logging

import pytest

from ps_p2p.log_limits import RepeatFilter


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged():
    """A logger writing through a RepeatFilter (interval 60 s, fake clock) into a buffer."""
    clock = _Clock()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(RepeatFilter(60.0, clock=clock))
    logger = logging.getLogger("test.log_limits")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, clock, lambda: out.getvalue().splitlines()
    logger.handlers[:] = []


def test_a_repeated_warning_prints_once_per_interval_then_says_how_many_were_held(logged):
    logger, clock, lines = logged

    for i in range(241):  # e.g. one "cannot reach" warning every 0.5 s for two minutes
        logger.warning("cannot reach verifier %s: %s", f"v{i % 3}", "connection refused")
        clock.now += 0.5

    assert lines() == [
        "WARNING cannot reach verifier v0: connection refused",
        "WARNING cannot reach verifier v0: connection refused "
        "[119 similar message(s) suppressed in the last 60 s]",
        "WARNING cannot reach verifier v0: connection refused "
        "[119 similar message(s) suppressed in the last 60 s]",
    ]


def test_different_templates_levels_and_loggers_are_limited_apart(logged):
    logger, clock, lines = logged

    logger.warning("a %d", 1)
    logger.warning("b %d", 1)
    logger.error("a %d", 2)
    logging.getLogger("test.log_limits.child").warning("a %d", 3)  # propagates to the handler
    logger.warning("a %d", 4)  # the only repeat

    assert lines() == ["WARNING a 1", "WARNING b 1", "ERROR a 2", "WARNING a 3"]


def test_info_and_debug_lines_are_never_limited(logged):
    logger, clock, lines = logged

    for _ in range(3):
        logger.info("served %s", "x")

    assert lines() == ["INFO served x"] * 3


def test_a_warning_after_a_quiet_interval_prints_without_a_count(logged):
    logger, clock, lines = logged

    logger.warning("w")
    clock.now += 61
    logger.warning("w")

    assert lines() == ["WARNING w", "WARNING w"]


def test_ps_node_logging_setup_installs_the_limit(monkeypatch):
    from ps_p2p.log_limits import setup_logging as _setup_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    for name in ("libp2p", "libp2p.transport.tcp", "hypercorn.error", "httpx"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "level", logger.level)
        monkeypatch.setattr(logger, "propagate", logger.propagate)

    _setup_logging("INFO")

    (handler,) = root.handlers
    assert any(isinstance(f, RepeatFilter) for f in handler.filters)


# ------------------------------------------------------------------ py-libp2p's stream failures

_STREAM_FAILURE = (
    "Failed to open stream to peer 12D3KooWabc:\n"
    "  Error: protocol not supported\n"
    "  Protocols: ['/meshsub/1.1.0', '/meshsub/1.0.0']\n"
    "  Timeout: 5s\n"
    "  Connection: outbound\n"
    "  Connection State: established=True, handshake=True\n"
    "  Registry Stats: None"
)


def _record(message: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("libp2p.host.basic_host", level, __file__, 1, message, None, None)


def test_stream_failure_report_is_dropped_unless_verbose_then_one_debug_line():
    from ps_p2p.log_limits import StreamFailureFilter

    quiet, verbose = StreamFailureFilter(), StreamFailureFilter(verbose=True)
    record = _record(_STREAM_FAILURE)

    assert quiet.filter(_record(_STREAM_FAILURE)) is False
    assert verbose.filter(record) is True
    assert record.levelno == logging.DEBUG and "\n" not in record.getMessage()
    assert "/meshsub/1.1.0" in record.getMessage()
    other = _record("something else failed")
    assert quiet.filter(other) is True and other.levelno == logging.ERROR


@pytest.mark.usefixtures("restore_logging")
def test_a_node_logs_no_seven_line_error_for_a_peer_without_gossipsub():
    """Issue 21: a model node logged a 7-line ERROR per user or verifier (none speaks
    GossipSub); ``ps-node``'s logging setup now quiets it."""
    from ps_p2p.log_limits import setup_logging as _setup_logging

    _setup_logging("INFO")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)
    try:
        logging.getLogger("libp2p.host.basic_host").error(_STREAM_FAILURE)
        logging.getLogger("libp2p.host.basic_host").error("another error")
    finally:
        logging.getLogger().removeHandler(handler)

    assert out.getvalue() == "another error\n"
