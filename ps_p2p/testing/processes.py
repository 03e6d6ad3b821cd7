"""Verifier committees as real ``ps-node run`` OS processes on 127.0.0.1 (slow tests, scripts).

:func:`make_testnet` writes ``ps-node testnet --verifiers N`` homes under a folder;
:class:`VerifierProcess` starts one verifier from its home, kills it (SIGKILL: a crash fault),
pauses it (SIGSTOP/SIGCONT) and reads its committed height from the status file the process
rewrites every 0.5 s. :func:`block_hashes` reads a stopped-or-running verifier's sqlite store
read-only (block bytes per height: equal bytes, equal block ID; the encoding is deterministic).
Used by ``tests/test_committee_processes.py`` and ``scripts/committee_perturb.py`` (issue 17).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pathlib
import signal
import socket
import sqlite3
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def free_base_port(count: int) -> int:
    """First port of ``count`` consecutive free TCP ports on 127.0.0.1 (31000-60000).

    Raises:
        RuntimeError: none found.
    """
    for base in range(31000, 60000, 97):
        socks = []
        try:
            for i in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def make_testnet(net: pathlib.Path, verifiers: int) -> list[VerifierProcess]:
    """Write a testnet of ``verifiers`` homes under ``net`` (``ps-node testnet``) and return
    one (not started) :class:`VerifierProcess` per home."""
    from ps_p2p import cli

    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["testnet", "--verifiers", str(verifiers), "--out", str(net),
                         "--base-port", str(free_base_port(verifiers))])
    if code != 0:
        raise RuntimeError(f"ps-node testnet failed ({code})")
    return [VerifierProcess(net, i) for i in range(verifiers)]


class VerifierProcess:
    """One ``ps-node run`` verifier (home ``net/verifier<i>``, log ``net/verifier<i>.log``)."""

    def __init__(self, net: pathlib.Path, i: int) -> None:
        self.net = net
        self.name = f"verifier{i}"
        self.status_path = net / f"{self.name}.status.json"
        self.log_path = net / f"{self.name}.log"
        self.store_path = net / self.name / "consensus.sqlite"
        self.process: subprocess.Popen | None = None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the process (its own session; children import this checkout's ps_p2p)."""
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "ps_p2p.cli", "run", "--config",
               str(self.net / self.name / "config.toml"), "--status-file", str(self.status_path)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, cwd=REPO,
                                            start_new_session=True)

    def kill(self) -> None:
        """SIGKILL (a crash: nothing flushed beyond what the store already holds)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.status_path.unlink(missing_ok=True)

    def pause(self, paused: bool) -> None:
        """SIGSTOP (``paused``) or SIGCONT the process."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGCONT then SIGINT, then SIGKILL after ``timeout`` seconds; no-op if not running."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def committed(self) -> int:
        """Committed height in the status file, -1 while there is none."""
        try:
            status = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return -1
        return int((status.get("committee") or {}).get("committed_height", -1))

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return f"--- {self.name} ---\n" + self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def wait_committed(verifiers: list[VerifierProcess], height: int, timeout: float) -> float:
    """Seconds until every verifier's status shows ``height`` committed.

    Raises:
        AssertionError: a process exited, or ``timeout`` seconds passed (message: heights and
            log tails).
    """
    start = time.monotonic()
    while True:
        for v in verifiers:
            assert v.running(), v.log_tail()
        if all(v.committed() >= height for v in verifiers):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(
                f"no height {height} within {timeout:.0f} s: "
                f"{[v.committed() for v in verifiers]}\n"
                + "\n".join(v.log_tail() for v in verifiers))
        time.sleep(0.1)  # waiting on files other processes write


def block_hashes(store: pathlib.Path) -> dict[int, bytes]:
    """SHA-256 of each stored block's bytes by height, read from a consensus store read-only."""
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=10)
    try:
        return {h: hashlib.sha256(b).digest()
                for h, b in db.execute("SELECT height, block FROM blocks")}
    finally:
        db.close()


def forks(stores: list[pathlib.Path]) -> list[int]:
    """Heights at which two stores hold different blocks (empty: no fork)."""
    seen: dict[int, bytes] = {}
    bad: set[int] = set()
    for path in stores:
        for h, digest in block_hashes(path).items():
            if seen.setdefault(h, digest) != digest:
                bad.add(h)
    return sorted(bad)
