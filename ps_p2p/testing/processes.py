"""Verifier committees as real ``ps-node run`` OS processes on 127.0.0.1 (slow tests, scripts).

:func:`make_testnet` writes ``ps-node testnet --verifiers N`` homes under a folder;
:class:`VerifierProcess` starts one verifier from its home, kills it (SIGKILL: a crash fault),
pauses it (SIGSTOP/SIGCONT) and reads its committed height from the status file the process
rewrites every 0.5 s. :func:`block_hashes` reads a stopped-or-running verifier's sqlite store
read-only (block bytes per height: equal bytes, equal block ID; the encoding is deterministic).
Used by ``tests/test_committee_processes.py`` and ``scripts/committee_perturb.py`` (issue 17).

TEST ONLY faults (:mod:`ps_p2p.testing.faults`): with ``make_testnet(..., faults=True)`` every
verifier's config names a control file (``net/verifier<i>.faults.json``, absent: no fault) that
:meth:`VerifierProcess.set_faults` rewrites while the process runs (per-peer delay and
partition, clock offset); :meth:`VerifierProcess.configure` turns the ``byzantine`` test flag
on or off for the next start.
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
import tomllib

from ps_p2p.testing.faults import LinkRule, write_faults

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


def make_testnet(net: pathlib.Path, verifiers: int, *, faults: bool = False,
                 block_interval: float | None = None) -> list[VerifierProcess]:
    """Write a testnet of ``verifiers`` homes under ``net`` (``ps-node testnet``) and return
    one (not started) :class:`VerifierProcess` per home.

    Args:
        faults: give every verifier a TEST ONLY faults control file (:meth:`~VerifierProcess.
            set_faults`).
        block_interval: the verifiers' ``block_interval`` (seconds); None: the node default.
    """
    from ps_p2p import cli

    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["testnet", "--verifiers", str(verifiers), "--out", str(net),
                         "--base-port", str(free_base_port(verifiers))])
    if code != 0:
        raise RuntimeError(f"ps-node testnet failed ({code})")
    processes = [VerifierProcess(net, i) for i in range(verifiers)]
    by_port: dict[str, str] = {}
    for v in processes:  # every other verifier's bootstrap list names this one's peer ID
        for addr in tomllib.loads(v.config_path.read_text()).get("bootstrap", []):
            by_port[addr.split("/tcp/")[1].split("/")[0]] = addr.rsplit("/p2p/", 1)[1]
    for v in processes:
        config = tomllib.loads(v.config_path.read_text())
        v.peer_id = by_port[config["listen"].rsplit("/tcp/", 1)[1]]
        if block_interval is not None:  # a top-level key, before any table
            v.config_path.write_text(f"block_interval = {block_interval}\n"
                                     + v.config_path.read_text())
        v.faults = faults
        v.configure()
    return processes


class VerifierProcess:
    """One ``ps-node run`` verifier (home ``net/verifier<i>``, log ``net/verifier<i>.log``)."""

    def __init__(self, net: pathlib.Path, i: int) -> None:
        self.net = net
        self.name = f"verifier{i}"
        self.status_path = net / f"{self.name}.status.json"
        self.log_path = net / f"{self.name}.log"
        self.store_path = net / self.name / "consensus.sqlite"
        self.config_path = net / self.name / "config.toml"
        self.faults_path = net / f"{self.name}.faults.json"
        self.process: subprocess.Popen | None = None
        #: base58 peer ID (set by :func:`make_testnet`)
        self.peer_id = ""
        #: whether the config names the TEST ONLY faults control file
        self.faults = False

    def configure(self, *, byzantine: bool = False) -> None:
        """Rewrite the config's TEST ONLY ``[testing]`` table (the last table of the file):
        ``byzantine`` (an equivocating validator from its next start) and the faults file."""
        text = self.config_path.read_text().split("\n[testing]\n", 1)[0].rstrip("\n")
        lines = []
        if byzantine:
            lines.append("byzantine = true")
        if self.faults:
            lines.append(f"faults_file = {json.dumps(str(self.faults_path))}")
        if lines:
            text += "\n[testing]\n" + "\n".join(lines)
        self.config_path.write_text(text + "\n")

    def set_faults(self, peers: dict[str, LinkRule] | None = None,
                   clock_offset_s: float = 0.0) -> None:
        """Put TEST ONLY faults in force (the running process applies them within 0.2 s; a
        process started later reads them at start): ``peers`` maps other verifiers' peer IDs
        to a :class:`~ps_p2p.testing.faults.LinkRule`; no argument clears every fault."""
        assert self.faults, "make_testnet(..., faults=True)"
        write_faults(self.faults_path, peers=peers, clock_offset_s=clock_offset_s)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the process (its own session; children import this checkout's ps_p2p)."""
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "ps_p2p.cli", "run", "--config",
               str(self.config_path), "--status-file", str(self.status_path)]
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
