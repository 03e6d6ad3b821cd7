"""Relay choice for onion paths (sans-I/O).

PlanetServe sec. 3.2 has each user pick l relays per path from the user list. DESIGN.md adds:
no relay on two paths of the same user when the user list is large enough (n*l + 1 users or
more, so fewer than k compromised paths can never reveal content); in a smaller network, reuse
as few relays as possible. Relays already carrying this user's live paths (``in_use``) count as
reuse too.

A NATed relay is reached through a relay host of its own (Circuit Relay v2), which sees both
ends of the link it carries; such a host counts as a member of the path (``relay_hosts``): a
path never has one hop as another hop's relay host, so no relay learns, from a link it only
carries, a second hop of a path it is on (e.g. a proxy that also carried the link from the first
hop to the second would know the first hop, one step from the user).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ps_p2p.errors import DirectoryError


def choose_relays(
    candidates: Sequence[bytes],
    count: int,
    hops: int,
    *,
    rng: random.Random,
    in_use: dict[bytes, int] | None = None,
    proxy_uses: dict[bytes, int] | None = None,
    relay_hosts: Mapping[bytes, frozenset[bytes]] | None = None,
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
        relay_hosts: NATed relay -> the relay hosts that carry links to it (module
            docstring); a candidate whose relay host is already on the path, or that is the
            relay host of one on it, is skipped while others are left (else taken anyway).

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
        if relay_hosts:
            path = _disjoint_from_relay_hosts(order, hops - 1, proxy, relay_hosts)
        else:
            path = order[: hops - 1]
        rng.shuffle(path)
        path.append(proxy)
        as_proxy[proxy] += 1
        for relay in path:
            uses[relay] += 1
        paths.append(path)
    return paths


def _disjoint_from_relay_hosts(order: Sequence[bytes], count: int, proxy: bytes,
                               relay_hosts: Mapping[bytes, frozenset[bytes]]) -> list[bytes]:
    """The first ``count`` of ``order`` such that no member (``proxy`` included) is another's
    relay host; when too few such remain, the rest of ``order`` fills up in order."""
    def clash(a: bytes, b: bytes) -> bool:
        return b in relay_hosts.get(a, ()) or a in relay_hosts.get(b, ())

    path: list[bytes] = []
    for c in order:
        if len(path) == count:
            return path
        if not any(clash(c, m) for m in (*path, proxy)):
            path.append(c)
    for c in order:  # too few: reuse as little as possible, like the rest of the choice
        if len(path) == count:
            break
        if c not in path:
            path.append(c)
    return path


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
