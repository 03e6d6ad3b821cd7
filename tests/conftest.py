"""Shared fixtures."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

from ps_p2p import devnet

REPO = pathlib.Path(__file__).resolve().parent.parent


def shared_dir() -> pathlib.Path:
    """``../shared`` next to the repository (``PS_SHARED_DIR`` overrides); the folder where
    ``ps-node devnet`` finds its default model and prompts."""
    return devnet.shared_dir(os.environ, REPO)


@pytest.fixture(autouse=True)
def _user_data_dir(tmp_path_factory):
    """Point the user data directory (``XDG_DATA_HOME``, where ``ps-node run`` keeps node homes
    by default) at a temporary folder of each test: no test writes into the real one, and no
    test sees another's node homes (a verifier's ``genesis.json``). Subprocesses inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
        yield


@pytest.fixture
def shared() -> pathlib.Path:
    """The shared model/data folder; skips the test with a reason when it is absent."""
    path = shared_dir()
    if not (path / "models" / "stories260K").is_dir():
        pytest.skip(f"{path} has no models/stories260K (the shared model and data are absent)")
    return path


@pytest.fixture
def restore_logging():
    """``ps_p2p.cli.main()`` configures logging for a process; undo that for the rest of the
    test session."""
    names = ["", "libp2p", "libp2p.transport.tcp", "libp2p.host.basic_host", "hypercorn.error",
             "httpx"]
    saved = [(logging.getLogger(n), logging.getLogger(n).level, logging.getLogger(n).propagate,
              list(logging.getLogger(n).handlers), list(logging.getLogger(n).filters))
             for n in names]
    yield
    for logger, level, propagate, handlers, filters in saved:
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers
        logger.filters[:] = filters
