"""A node's home directory: its keys and state, one directory per node.

Layout (the directory is created with mode 0700)::

    <home>/node.key      identity + onion keys (ps_p2p.keys, mode 0600), created on first run
    <home>/status.json   the running node's status (peer ID, listen multiaddrs, API, ready paths)
    <home>/lock          held (flock) while a node runs from this home

The default home of a node named ``NAME`` is ``platformdirs.user_data_dir("ps_p2p")/NAME``
(``~/.local/share/ps_p2p/NAME`` on Linux, ``$XDG_DATA_HOME`` honoured), never the working
directory, so no key file lands in a repository by accident. A node's name defaults to its roles
(``user``, ``verifier``, ``model+user``); nodes sharing a machine and a role need their own
``--name`` or ``--home``: the lock refuses a second node on one home, which would otherwise run
with the first one's peer ID.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ps_p2p.errors import ConfigError

APP_NAME = "ps_p2p"
KEY_FILE = "node.key"
STATUS_FILE = "status.json"
LOCK_FILE = "lock"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}")


def node_name(roles: Sequence[str]) -> str:
    """The default name of a node: its roles, sorted, joined by ``+`` (``model+user``)."""
    return "+".join(sorted(set(roles)))


def check_name(name: str) -> str:
    """Return ``name`` if it can name a folder (1-64 of ``A-Za-z0-9_.+-``, no leading dot).

    Raises:
        ConfigError: anything else (a path, ``..``, an empty name).
    """
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"bad node name {name!r}: use 1-64 letters, digits, '_', '.', '+' or '-', "
            "not starting with '.' or '-'"
        )
    return name


def default_home(name: str) -> pathlib.Path:
    """``<user data dir>/ps_p2p/<name>``, e.g. ``~/.local/share/ps_p2p/user`` on Linux."""
    import platformdirs

    return pathlib.Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / check_name(name)


@contextmanager
def locked_home(home: pathlib.Path) -> Iterator[pathlib.Path]:
    """Create ``home`` (mode 0700) and hold its lock file for the duration of the block.

    The lock is an exclusive ``flock`` on ``<home>/lock``; it is released when the block exits
    or the process dies, however it dies. The file records the holder's PID for the error of the
    next node that tries.

    Raises:
        ConfigError: the home cannot be created, or another node runs from it.
    """
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot use home directory {home}: {exc}") from exc
    try:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            fcntl = None  # type: ignore[assignment]
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                raise ConfigError(
                    f"home directory {home} is in use by another node (pid {holder}); "
                    "give each node its own --name or --home"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield home
    finally:
        os.close(fd)  # releases the flock
