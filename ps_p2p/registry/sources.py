"""How fast one source network may bring new identities to a verifier; pure (local policy).

Why (issue 16, HIGH 1): identities are free, and the networks a record *claims* are not
checked (a deterministic rule cannot dial), so the committed per-network caps
(:class:`~ps_p2p.registry.AdmissionPolicy`) cost a sybil nothing: each fresh identity
claimed a fresh /24, and 200 of 200 sybils were listed. What a verifier does know is the
address a registration *came from*: a node registers over its own libp2p connection
(``/planetserve/directory/2.0.0``, :mod:`ps_p2p.protocols.committee_directory`), whose remote
IP completed a TCP and Noise handshake, so it cannot be claimed. This module rate-limits the
registrations of peers the registry does not list (new identities) per *observed* source
network, an IPv4 /24 or an IPv6 /48 (what one site usually holds): a token bucket of
``burst`` tokens refilled at ``per_minute`` a minute (:class:`ps_p2p.rate_limits.TokenBuckets`;
the network as :func:`ps_p2p.networks.network_key` names it). Renewals of listed peers and
deregistrations are never limited here (they cost the adversary a listed identity, which this
limit already paid for).

It is admission policy of one verifier, not a consensus rule: transactions relayed by other
validators were limited by the verifier that took them, so with N verifiers a source gets at
most N times the rate. Loopback sources (``127.0.0.0/8``, ``::1``) are exempt: only a process on
the verifier's own machine can connect from them (a devnet, a localnet, a test), never a remote
adversary. A connection without an IP address (e.g. a relayed circuit) counts in one shared
network, ``"other"``.

What a sybil pays, with the defaults (2 a minute, burst 8, per verifier): listing X new
identities within T minutes takes about ``X / (2 * T * N)`` /24 networks it really sends from
(plus the registry's committed caps); the 100,000-record registry of a 4-verifier committee
fills in a day only from ~9 /24s, in an hour only from ~200. An honest site behind one address
registers 8 nodes at once, then 2 a minute (the committed cap lets one /24 list only
``max_records_per_network``, 32 by default, anyway).

Bounds: at most ``max_networks`` networks are remembered (least recently charged forgotten
first: a forgotten network starts with a full bucket again, so the table is only a memory
bound; forgetting needs that many other real networks).
"""

from __future__ import annotations

from ps_p2p.errors import AdmissionError, LocalProtocolError
from ps_p2p.networks import network_key, parse_ip
from ps_p2p.rate_limits import TokenBuckets

#: Network key of a connection without an IP address.
OTHER_NETWORK = "other"


class NewIdentityLimiter:
    """Token bucket per observed source network for registrations of unlisted peers.

    Args:
        per_minute: tokens a network gets back a minute (default 2).
        burst: tokens a network starts with and holds at most (default 8).
        max_networks: networks remembered (default 16,384).
        ipv4_prefix_bits, ipv6_prefix_bits: a source network (defaults 24 and 48).

    Attributes:
        refused: registrations refused so far.
    """

    def __init__(self, *, per_minute: float = 2.0, burst: int = 8, max_networks: int = 16_384,
                 ipv4_prefix_bits: int = 24, ipv6_prefix_bits: int = 48) -> None:
        if not per_minute > 0 or burst < 1 or max_networks < 1:
            raise LocalProtocolError("new identity limits must be > 0")
        if not 8 <= ipv4_prefix_bits <= 32 or not 16 <= ipv6_prefix_bits <= 128:
            raise LocalProtocolError("network prefix bits out of range")
        self.per_second = per_minute / 60.0
        self.burst = burst
        self.max_networks = max_networks
        self.ipv4_prefix_bits = ipv4_prefix_bits
        self.ipv6_prefix_bits = ipv6_prefix_bits
        # least recently charged first; a network is added by its first charge only
        self._buckets: TokenBuckets[str] = TokenBuckets(self.per_second, float(burst), max_networks)
        self.refused = 0

    def network_of(self, host: str | None) -> str | None:
        """The source network of a connection's remote IP (``"ip4:a.b.c.0/24"``,
        ``"ip6:2001:db8::/48"``); None for loopback (exempt); :data:`OTHER_NETWORK` when
        ``host`` is None or not an IP address."""
        ip = parse_ip(host)
        if ip is None:
            return OTHER_NETWORK
        if ip.is_loopback:
            return None
        return network_key(ip, self.ipv4_prefix_bits, self.ipv6_prefix_bits)

    def tokens(self, network: str, now: float) -> float:
        """Tokens ``network`` holds at ``now`` (seconds, monotonic)."""
        bucket = self._buckets.peek(network)
        return float(self.burst) if bucket is None else bucket.refill(now)

    def check(self, network: str | None, now: float) -> None:
        """Refuse a new identity from ``network`` (:meth:`network_of`) at ``now`` when its
        bucket is empty; None (loopback) always passes.

        Raises:
            AdmissionError: no token left; says when the next one comes.
        """
        if network is None:
            return
        tokens = self.tokens(network, now)
        if tokens < 1.0:
            self.refused += 1
            wait = (1.0 - tokens) / self.per_second
            raise AdmissionError(
                f"too many new identities from {network} (at most {self.burst} at once, then "
                f"{self.per_second * 60:g} a minute); next in {wait:.0f} s"
            )

    def charge(self, network: str | None, now: float) -> None:
        """Take one token of ``network`` (after :meth:`check` passed and the registration was
        taken); None (loopback) costs nothing."""
        if network is None:
            return
        self._buckets.get(network, now).charge(1.0, now)

    def __len__(self) -> int:
        return len(self._buckets)


__all__ = ["OTHER_NETWORK", "NewIdentityLimiter"]
