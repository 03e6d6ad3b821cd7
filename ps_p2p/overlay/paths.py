"""Relay choice for onion paths (sans-I/O).

PlanetServe sec. 3.2 has each user pick l relays per path from the user list. DESIGN.md adds:
no relay on two paths of the same user when the user list is large enough (n*l + 1 users or
more, so fewer than k compromised paths can never reveal content); in a smaller network, reuse
as few relays as possible. Relays already carrying this user's live paths (``in_use``) count as
reuse too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ps_p2p.errors import DirectoryError


def choose_relays(
    candidates: Sequence[bytes],
    count: int,
    hops: int,
    *,
    rng: random.Random,
    in_use: dict[bytes, int] | None = None,
    proxy_uses: dict[bytes, int] | None = None,
) -> list[list[bytes]]:
    """Choose ``count`` paths of ``hops`` distinct relays each.

    Each path's proxy is the candidate least used as a proxy (then least used at all); the other
    relays are drawn least-used first (``in_use`` plus the paths chosen so far); ties are broken
    at random. Relays thus repeat across paths only when there are fewer than
    ``hops * (count + live paths)`` candidates, and proxies only when fewer than the paths.

    Args:
        candidates: relay peer IDs (the user itself excluded by the caller).
        count: paths to choose.
        hops: relays per path (the last is the proxy).
        rng: randomness (a seeded ``random.Random`` in tests).
        in_use: relay -> number of this user's live paths through it.
        proxy_uses: relay -> live paths of this user it is the proxy of; each path's proxy is
            its relay least used as a proxy, so a request's cloves reach distinct proxies.

    Returns:
        ``count`` lists of ``hops`` distinct peer IDs.

    Raises:
        DirectoryError: fewer than ``hops`` distinct candidates.
    """
    unique = list(dict.fromkeys(candidates))
    if len(unique) < hops:
        raise DirectoryError(f"{len(unique)} candidate relays; a path needs {hops}")
    uses = {c: (in_use or {}).get(c, 0) for c in unique}
    as_proxy = {c: (proxy_uses or {}).get(c, 0) for c in unique}
    paths: list[list[bytes]] = []
    for _ in range(count):
        order = list(unique)
        rng.shuffle(order)
        # the proxy first: least used as a proxy, then least used at all (sorts are stable, so
        # ties stay in random order)
        proxy = min(order, key=lambda c: (as_proxy[c], uses[c]))
        order.remove(proxy)
        order.sort(key=lambda c: uses[c])
        path = order[: hops - 1]
        rng.shuffle(path)
        path.append(proxy)
        as_proxy[proxy] += 1
        for relay in path:
            uses[relay] += 1
        paths.append(path)
    return paths


def reuse_count(paths: Sequence[Sequence[bytes]]) -> int:
    """How many relay slots in ``paths`` repeat a relay already used on an earlier path."""
    seen: set[bytes] = set()
    repeats = 0
    for path in paths:
        for relay in path:
            if relay in seen:
                repeats += 1
        seen.update(path)
    return repeats


__all__ = ["choose_relays", "reuse_count"]
