"""Connection exhaustion of a real ``ps-node run`` verifier (issue 16, finding H2).

Starts one verifier process (``--repo``'s code: default this checkout), then from source
addresses of their own on 127.0.0.0/8 (:mod:`ps_p2p.testing.conn_attack`):

1. ``--close`` connect-close dials (TCP + Noise + Yamux, then closed), from 127.0.3.0/24;
2. ``--abandon`` abandoned dials (negotiated, then never read, never closed), from 10 IPs of
   127.0.1.0/24, kept open;
3. ``--raw`` raw TCP sockets that never send a byte, from 30 IPs of 127.0.2.0/24, kept open;

then, with all of that still held, ``--honest`` honest dials from 127.0.0.1 one a second (connect
and a ping within 5 s each), and prints how many got in, how many of the held connections the
node had closed, and the node's log lines about refusals.

    python benchmarks/attacks/conn_exhaust.py                       # this checkout
    python benchmarks/attacks/conn_exhaust.py --repo /work/main     # another checkout's node

The attacking and honest dialers always run this checkout's code (client side only).
Takes ~30-60 s. Linux only (dials from several 127.x addresses).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import trio

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ps_p2p.testing.conn_attack import (  # noqa: E402
    Held, honest_dials, negotiated_dials, raw_sockets, source_ips,
)


def start_node(
    repo: pathlib.Path, workdir: pathlib.Path, config: str | None
) -> tuple[subprocess.Popen, str]:
    """Start a ``ps-node run`` verifier of ``repo``'s code; returns it and its multiaddr."""
    status = workdir / "verifier.status.json"
    cmd = [sys.executable, "-m", "ps_p2p.cli", "run", "--role", "verifier",
           "--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(workdir / "verifier.key"),
           "--home", str(workdir / "home"), "--status-file", str(status)]
    if config:
        cmd += ["--config", config]
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    log = open(workdir / "verifier.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=str(repo), start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"node exited: {(workdir / 'verifier.log').read_text()[-2000:]}")
        try:
            listen = json.loads(status.read_text()).get("listen")
        except (OSError, ValueError):
            listen = None
        if listen:
            return proc, listen[0]
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("node not listening within 60 s")


async def attack(target: str, args: argparse.Namespace) -> dict:
    held = Held()
    out: dict = {}
    try:
        t = trio.current_time()
        out["close_ok"] = await negotiated_dials(
            target, source_ips(3, 10), args.close, keep=None)
        out["close_s"] = round(trio.current_time() - t, 1)
        t = trio.current_time()
        out["abandon_ok"] = await negotiated_dials(
            target, source_ips(1, 10), args.abandon, keep=held)
        out["abandon_s"] = round(trio.current_time() - t, 1)
        t = trio.current_time()
        out["raw_open"] = await raw_sockets(target, source_ips(2, 30), args.raw, held)
        out["raw_s"] = round(trio.current_time() - t, 1)
        results = await honest_dials(target, args.honest, spacing=1.0)
        out["honest_ok"] = sum(results)
        out["honest_pattern"] = "".join("+" if r else "." for r in results)
        out["abandoned_closed_by_node"] = held.secured_closed_by_target()
        out["raw_closed_by_node"] = held.raw_closed_by_target()
        out["abandoned_held"] = len(held.secured)
        out["raw_held"] = len(held.raw)
    finally:
        await held.aclose()
    after = await honest_dials(target, 1)
    out["honest_after_release"] = sum(after)
    return out


def main() -> None:
    import logging

    # py-libp2p logs every refused or abandoned handshake of the attack at ERROR
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=pathlib.Path, default=REPO,
                        help="checkout whose ps_p2p the node runs (default: this one)")
    parser.add_argument("--config", help="a TOML config for the node (e.g. [connections])")
    parser.add_argument("--close", type=int, default=300)
    parser.add_argument("--abandon", type=int, default=300)
    parser.add_argument("--raw", type=int, default=3000)
    parser.add_argument("--honest", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        proc, target = start_node(args.repo.resolve(), workdir, args.config)
        try:
            out = trio.run(attack, target, args)
        finally:
            proc.send_signal(2)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        log = (workdir / "verifier.log").read_text(errors="replace").splitlines()
    print(f"node: {args.repo}")
    print(f"connect-close dials: {out['close_ok']}/{args.close} negotiated ({out['close_s']} s)")
    print(f"abandoned dials:     {out['abandon_ok']}/{args.abandon} negotiated "
          f"({out['abandon_s']} s), {out['abandoned_closed_by_node']} of those closed by the node")
    print(f"raw idle sockets:    {out['raw_open']}/{args.raw} connected ({out['raw_s']} s), "
          f"{out['raw_closed_by_node']} closed by the node")
    print(f"honest dials while held: {out['honest_ok']}/{args.honest} got in "
          f"[{out['honest_pattern']}]")
    print(f"honest dial after the attacker let go: {out['honest_after_release']}/1")
    keys = ("limit", "refus", "exceeded", "denied")
    notes = [line for line in log if any(k in line.lower() for k in keys)]
    print(f"node log lines about limits: {len(notes)}")
    for line in notes[:5]:
        print("   ", line[:200])


if __name__ == "__main__":
    main()
