"""Attack (issue 16, HIGH 5): peers outside the directory fill a relay's path table.

Ten identities that no directory lists send valid onion setups (the relay's onion key is public)
through one relay as fast as it takes them; then five listed users try to set up a path through
it. Drives the relay's pure core (:class:`ps_p2p.overlay.relay.RelayCore`, the object a node's
overlay service runs) with the node's default settings, so the numbers are the relay's own
admission logic without the network's noise.

    python benchmarks/attacks/path_table_fill.py [--outsiders 10] [--per-outsider 1200]

Prints: setups accepted from outsiders, the relay table's size, the memory the flood made the
relay hold (resident set growth), the setups per second it processed, how many of the honest
setups succeeded, and what a full table of 10,000 paths costs in memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import time

from ps_p2p.crypto import onion
from ps_p2p.overlay import relay as r


class _Codec:
    def encode_forward(self, message):  # pragma: no cover - unused by setups
        return pickle.dumps(message)

    decode_forward = encode_backward = decode_backward = tamper_clove = encode_forward


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outsiders", type=int, default=10)
    parser.add_argument("--per-outsider", type=int, default=1200)
    parser.add_argument("--listed-users", type=int, default=300,
                        help="users the relay's directory lists (honest ones among them)")
    args = parser.parse_args()

    me = b"R" * 38
    key = onion.OnionKeyPair.generate()
    listed = {bytes([1]) + i.to_bytes(4, "big") * 9 + b"u" for i in range(args.listed_users)}
    honest = sorted(listed)[:5]
    kwargs = dict(is_user=lambda peer: peer in listed)
    try:
        core = r.RelayCore(me, key, _Codec(), r.RelayConfig(),
                           user_count=lambda: len(listed), **kwargs)
    except TypeError:  # the code before the fix has no user_count
        core = r.RelayCore(me, key, _Codec(), r.RelayConfig(), **kwargs)

    outsiders = [bytes([2]) + i.to_bytes(4, "big") * 9 + b"o" for i in range(args.outsiders)]
    spec = [onion.HopSpec(me, key.public)]  # the relay as proxy: the entry is added at once
    packets = [(peer, os.urandom(16), onion.create_path(spec)[1])
               for _ in range(args.per_outsider) for peer in outsiders]

    gc.collect()
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    accepted = 0
    for i, (peer, path_id, packet) in enumerate(packets):
        out = core.receive_setup(peer, path_id, packet, now=i * 0.001)
        accepted += sum(1 for c in out if isinstance(c, r.SendSetupReply) and c.ok)
    elapsed = time.perf_counter() - t0
    gc.collect()
    rss1 = _rss_mb()

    ok = 0
    for user in honest:
        path, packet = onion.create_path(spec)
        out = core.receive_setup(user, path.first_path_id, packet, now=len(packets) * 0.001)
        ok += any(isinstance(c, r.SendSetupReply) and c.ok for c in out)

    print(f"outsider setups sent:        {len(packets)} from {args.outsiders} identities "
          f"({len(packets) / elapsed:.0f}/s processed)")
    print(f"accepted from outsiders:     {accepted}")
    print(f"relay table size:            {len(core.table)} of {core.config.max_relay_entries}")
    print(f"memory held by the flood:    +{rss1 - rss0:.0f} MB")
    print(f"honest setups that succeed:  {ok}/{len(honest)}")

    # What a full table costs (listed predecessors, which may fill it): memory per path.
    full = r.RelayCore(me, key, _Codec(), r.RelayConfig())
    size = full.config.max_relay_entries
    packets = [onion.create_path(spec)[1] for _ in range(size)]
    gc.collect()
    rss0 = _rss_mb()
    for i, packet in enumerate(packets):
        full.receive_setup(bytes([3]) + (i % 10).to_bytes(4, "big") * 9 + b"l", os.urandom(16),
                           packet, now=0.0)
    gc.collect()
    print(f"a full table ({len(full.table)} paths):   +{_rss_mb() - rss0:.0f} MB "
          f"({(_rss_mb() - rss0) * 1e6 / max(len(full.table), 1):.0f} B per path)")


if __name__ == "__main__":
    main()
