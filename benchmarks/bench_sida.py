"""S-IDA benchmarks: encode and decode of one message (n = 4, k = 3), microseconds.

Measures, for 1, 8, 30 and 60 KB messages, the median and p99 of:

1. ``sida.encode`` (AES-256-GCM seal, zfec parity, Shamir split of the key, 4 clove objects);
2. ``sida.decode`` of the three data cloves 0, 1, 2 (no erasure decoding needed);
3. ``sida.decode`` of cloves 1, 2, 3 (one data fragment rebuilt from parity);
4. ``sida.decode`` of all four cloves with clove 0 tampered: the worst case, since the three
   subsets holding clove 0 are tried (and fail the AEAD check) before {1, 2, 3} decodes.

Paper (PlanetServe sec. 5): clove preparation 0.273 ms mean, clove decryption 0.302 ms mean.

Run: ``python benchmarks/bench_sida.py [--quick]``. Single-threaded; each sample times one call
with ``time.perf_counter_ns`` after a warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

from ps_p2p.crypto import sida

SIZES_KB = (1, 8, 30, 60)
TOTAL, THRESHOLD = 4, 3


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{platform.platform()}; {cpu}; {os.cpu_count()} cores; "
        f"Python {platform.python_version()} ({platform.python_implementation()})"
    )


def sample(fn: Callable[[], object], iterations: int, warmup: int) -> list[float]:
    """Per-call times in microseconds."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    out = []
    for _ in range(iterations):
        start = clock()
        fn()
        out.append((clock() - start) / 1000.0)
    return out


def summary(name: str, samples: list[float]) -> str:
    s = sorted(samples)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return f"{name:<34} median {statistics.median(s):8.1f} us   p99 {p99:8.1f} us   (n={len(s)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = parser.parse_args(argv)
    iterations, warmup = (300, 50) if args.quick else (5000, 500)

    print(f"machine: {machine()}")
    print(f"S-IDA n={TOTAL} k={THRESHOLD}, {iterations} iterations after {warmup} warm-up calls")
    for kb in SIZES_KB:
        message = os.urandom(kb * 1024)
        cloves = sida.encode(message, TOTAL, THRESHOLD)
        first = cloves[0]
        bad = dataclasses.replace(
            first, fragment=bytes((first.fragment[0] ^ 1,)) + first.fragment[1:]
        )
        tampered = [bad, *cloves[1:]]
        data_only, with_parity = cloves[:3], cloves[1:]
        assert sida.decode(data_only) == message
        assert sida.decode(with_parity) == message
        assert sida.decode(tampered) == message

        print(f"--- {kb} KB message ({len(first.fragment)} B fragments)")
        print(summary("encode", sample(lambda: sida.encode(message, TOTAL, THRESHOLD),
                                       iterations, warmup)))
        print(summary("decode cloves 0,1,2 (data)", sample(lambda: sida.decode(data_only),
                                                          iterations, warmup)))
        print(summary("decode cloves 1,2,3 (parity)", sample(lambda: sida.decode(with_parity),
                                                            iterations, warmup)))
        print(summary("decode 4, clove 0 tampered", sample(lambda: sida.decode(tampered),
                                                          iterations, warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
