"""Attack (issue 16, LOW): replayed onion setups and cells.

1. A relay's predecessor captures an honest user's setup packet. Flooders (listed users: the
   relay's onion key is public, so anyone can make valid setups) then send valid setups, each
   torn down at once with a Destroy (so the path table never fills), until the relay's replay
   cache (200,000 packets) would have been flushed; then the captured setup is replayed.
2. The same predecessor captures one of the user's probe cells on a live path and replays it
   three times: does the proxy answer each replay?

Drives the relay's pure core (:class:`ps_p2p.overlay.relay.RelayCore`) with the node's
default settings (and, after the fix, a wall clock 1 ms per setup, so the whole flood falls
inside one setup window).

    python benchmarks/attacks/setup_replay.py [--flooders 10]

Prints the flood's setups accepted and refused, whether the captured setup was accepted again,
and how many replayed cells the proxy answered.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time

from ps_p2p.crypto import onion
from ps_p2p.overlay import relay as r

ME, USER = b"R" * 38, b"U" * 38
UNIX0 = 1_790_000_000


class _Codec:
    def encode_forward(self, message):
        return pickle.dumps(message)

    def decode_forward(self, data):
        return pickle.loads(data)

    encode_backward, decode_backward = encode_forward, decode_forward

    def tamper_clove(self, clove):  # pragma: no cover
        return clove


def _create(spec, issued_at):
    try:
        return onion.create_path(spec, issued_at=issued_at)
    except TypeError:  # the code before the fix: no issue time
        return onion.create_path(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flooders", type=int, default=10)
    args = parser.parse_args()
    key = onion.OnionKeyPair.generate()
    try:
        core = r.RelayCore(ME, key, _Codec(), r.RelayConfig(),
                           wall_clock=lambda now: UNIX0 + now)
    except TypeError:  # the code before the fix has no wall clock
        core = r.RelayCore(ME, key, _Codec(), r.RelayConfig())
    spec = [onion.HopSpec(ME, key.public)]

    # the honest path, whose setup and one probe cell the predecessor captures
    path, captured = _create(spec, UNIX0)
    assert core.receive_setup(USER, path.first_path_id, captured, 0.0)[0].ok
    probe = path.seal_forward(pickle.dumps(r.Probe(1)))
    assert len(core.receive_cell(USER, path.first_path_id, probe, 0.0)) == 1

    flooders = [bytes([7]) + i.to_bytes(4, "big") * 9 + b"f" for i in range(args.flooders)]
    target = r.MAX_REMEMBERED_SETUPS + 1
    accepted = refused = 0
    refused_in_a_row = {peer: 0 for peer in flooders}
    t0 = time.perf_counter()
    i = 0
    while accepted < target and min(refused_in_a_row.values()) < 100:
        peer = flooders[i % len(flooders)]
        now = i * 0.001
        _, packet = _create(spec, UNIX0 + int(now))
        path_id = os.urandom(16)
        (reply,) = core.receive_setup(peer, path_id, packet, now)
        if reply.ok:
            accepted += 1
            refused_in_a_row[peer] = 0
            core.receive_destroy(peer, path_id, "churn", now)
        else:
            refused += 1
            refused_in_a_row[peer] += 1
        i += 1
    elapsed = time.perf_counter() - t0
    now = i * 0.001
    (replay,) = core.receive_setup(USER, os.urandom(16), captured, now)

    answered = sum(
        any(isinstance(c, r.SendCell) for c in core.receive_cell(USER, path.first_path_id, probe, now))
        for _ in range(3)
    )
    print(f"flood: {accepted} valid setups accepted, {refused} refused, from "
          f"{args.flooders} identities in {elapsed:.1f} s")
    print(f"captured setup replayed after the flood: {'ACCEPTED' if replay.ok else 'refused'}"
          f"{'' if replay.ok else f' ({replay.error})'}")
    print(f"replayed probe cell answered: {answered} of 3")


if __name__ == "__main__":
    main()
