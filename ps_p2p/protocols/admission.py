"""Admission of inbound connections by remote address (pure core: no trio, no libp2p, no clock).

Identities are free, so a per-peer-ID bound stops nobody; addresses are not free. Every inbound
TCP connection of a host takes a :class:`Ticket` from :class:`InboundAdmission` as soon as it is
accepted (before any byte of its handshake) and gives it back when it ends, whichever way it ends.
A ticket is counted

* *pending* from the accept until its Noise + Yamux handshake has completed (the host closes
  a connection still pending :attr:`InboundLimits.handshake_timeout` seconds after the accept);
* *established* from then until the connection closes;

per remote IP (an IPv4 address, or the IPv6 /64 that one host or home network gets) and per
network (IPv4 /24, IPv6 /48: one site's usual allocation, the same grouping as the committee's
admission of node records, :mod:`ps_p2p.registry`). A connection over a cap is refused
at once: at the accept (pending caps) or right after its handshake (established caps).

Addresses in :attr:`InboundLimits.exempt` (CIDR networks) are counted by nobody: only an explicit
setting exempts anything. The in-process localnet and the devnet, where every node listens on
127.0.0.1, exempt loopback (:data:`LOOPBACK`); a real node should not, unless it runs behind a
proxy on the same machine.

Source: issue 16, finding H2 (3,000 idle sockets from one address made a relay refuse every new
connection; 250 abandoned connections from one address filled a node's inbound quota).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ps_p2p.errors import ConfigError
from ps_p2p.networks import host_key, network_key, parse_ip

#: Loopback networks, for :attr:`InboundLimits.exempt` on a localnet/devnet (all on 127.0.0.1).
LOOPBACK: tuple[str, ...] = ("127.0.0.0/8", "::1/128")

#: Key under which connections without a known remote IP are counted (one shared bucket).
UNKNOWN = "unknown"


@dataclass(frozen=True)
class InboundLimits:
    """Bounds on inbound connections by remote address (``[connections]`` of a node's config).

    Attributes:
        handshake_timeout: seconds from the TCP accept to a completed Noise + Yamux handshake;
            a connection still handshaking then is closed (py-libp2p's default is 10 s; a
            handshake is 3 round trips, ~7 ms on loopback, well under 2 s across continents).
        pending_per_ip: connections still handshaking from one IPv4 address / IPv6 /64.
        pending_per_network: connections still handshaking from one IPv4 /24 / IPv6 /48.
        established_per_ip: open connections from one IPv4 address / IPv6 /64 (a normal peer
            keeps one; a NAT or one machine may hold a few nodes).
        established_per_network: open connections from one IPv4 /24 / IPv6 /48.
        exempt: CIDR networks (``"127.0.0.0/8"``) whose connections are not counted; empty by
            default, :data:`LOOPBACK` on a localnet or devnet.
    """

    handshake_timeout: float = 5.0
    pending_per_ip: int = 8
    pending_per_network: int = 32
    established_per_ip: int = 32
    established_per_network: int = 128
    exempt: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.exempt, list):  # from TOML
            object.__setattr__(self, "exempt", tuple(self.exempt))
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError on a non-positive bound or a malformed network."""
        if not (isinstance(self.handshake_timeout, (int, float)) and 0 < self.handshake_timeout < 3600):
            raise ConfigError(
                f"handshake_timeout must be > 0 and < 3600 seconds, not {self.handshake_timeout!r}"
            )
        for name in ("pending_per_ip", "pending_per_network", "established_per_ip",
                     "established_per_network"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"{name} must be an integer >= 1, not {value!r}")
        if self.pending_per_ip > self.pending_per_network:
            raise ConfigError("pending_per_ip must be <= pending_per_network")
        if self.established_per_ip > self.established_per_network:
            raise ConfigError("established_per_ip must be <= established_per_network")
        _parse_networks(self.exempt)


def _parse_networks(
    texts: tuple[str, ...],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    if not isinstance(texts, tuple) or not all(isinstance(t, str) for t in texts):
        raise ConfigError(f"exempt must be a list of CIDR networks, not {texts!r}")
    try:
        return tuple(ipaddress.ip_network(t, strict=False) for t in texts)
    except ValueError as exc:
        raise ConfigError(f"exempt: {exc}") from exc


def address_keys(ip: str | None) -> tuple[str, str] | None:
    """(IP key, network key) that ``ip`` is counted under; None for an unparsable address.

    IPv4 (and IPv4-mapped IPv6): the address and its /24 (``"203.0.113.7"``,
    ``"ip4:203.0.113.0/24"``); IPv6: its /64 and its /48 (``"2001:db8:1:2::/64"``,
    ``"ip6:2001:db8:1::/48"``): :func:`ps_p2p.networks.host_key` and
    :func:`~ps_p2p.networks.network_key`.
    """
    addr = parse_ip(ip)
    if addr is None:
        return None
    return host_key(addr), network_key(addr)


class Ticket:
    """One inbound connection's place in :class:`InboundAdmission` (opaque to callers).

    Attributes:
        ip_key, network_key: what it is counted under (None: exempt, counted nowhere).
        state: ``"pending"``, ``"established"`` or ``"released"``.
    """

    __slots__ = ("ip_key", "network_key", "state")

    def __init__(self, ip_key: str | None, network_key: str | None) -> None:
        self.ip_key = ip_key
        self.network_key = network_key
        self.state = "pending"


class InboundAdmission:
    """Counts inbound connections per address and refuses those over :class:`InboundLimits`.

    Every counter a ticket takes is given back by :meth:`release` (idempotent), and a counter
    at zero is deleted: memory is bounded by the connections open.

    Args:
        limits: the caps; ``limits.exempt`` networks are admitted uncounted.
    """

    def __init__(self, limits: InboundLimits) -> None:
        self.limits = limits
        self._exempt = _parse_networks(limits.exempt)
        self._pending_ip: dict[str, int] = {}
        self._pending_net: dict[str, int] = {}
        self._established_ip: dict[str, int] = {}
        self._established_net: dict[str, int] = {}

    def _is_exempt(self, ip: str | None) -> bool:
        if not self._exempt:
            return False
        addr = parse_ip(ip)
        if addr is None:
            return False
        return any(addr.version == net.version and addr in net for net in self._exempt)

    def admit(self, ip: str | None) -> Ticket | str:
        """A new connection from ``ip`` (textual IPv4/IPv6, None if unknown) was accepted.

        Returns:
            its :class:`Ticket` (counted as pending), or the reason it is refused (a short
            phrase naming the cap, e.g. ``"8 handshakes in progress from 203.0.113.7"``).
        """
        if self._is_exempt(ip):
            return Ticket(None, None)
        keys = address_keys(ip) or (UNKNOWN, UNKNOWN)
        ip_key, net_key = keys
        lim = self.limits
        if self._pending_ip.get(ip_key, 0) >= lim.pending_per_ip:
            return f"{lim.pending_per_ip} handshakes in progress from {ip_key}"
        if self._pending_net.get(net_key, 0) >= lim.pending_per_network:
            return f"{lim.pending_per_network} handshakes in progress from {net_key}"
        _incr(self._pending_ip, ip_key)
        _incr(self._pending_net, net_key)
        return Ticket(ip_key, net_key)

    def establish(self, ticket: Ticket) -> str | None:
        """``ticket``'s handshake completed: count it as established.

        Returns:
            None, or the reason the connection must be closed (an established cap is full:
            the ticket is then released).
        """
        if ticket.state != "pending":
            return None
        if ticket.ip_key is None or ticket.network_key is None:
            ticket.state = "established"
            return None
        lim = self.limits
        reason = None
        if self._established_ip.get(ticket.ip_key, 0) >= lim.established_per_ip:
            reason = f"{lim.established_per_ip} connections open from {ticket.ip_key}"
        elif self._established_net.get(ticket.network_key, 0) >= lim.established_per_network:
            reason = f"{lim.established_per_network} connections open from {ticket.network_key}"
        if reason is not None:
            self.release(ticket)
            return reason
        _decr(self._pending_ip, ticket.ip_key)
        _decr(self._pending_net, ticket.network_key)
        _incr(self._established_ip, ticket.ip_key)
        _incr(self._established_net, ticket.network_key)
        ticket.state = "established"
        return None

    def release(self, ticket: Ticket) -> None:
        """``ticket``'s connection ended (or was refused): give back what it holds. Idempotent."""
        if ticket.state == "released":
            return
        if ticket.ip_key is not None and ticket.network_key is not None:
            if ticket.state == "pending":
                _decr(self._pending_ip, ticket.ip_key)
                _decr(self._pending_net, ticket.network_key)
            else:
                _decr(self._established_ip, ticket.ip_key)
                _decr(self._established_net, ticket.network_key)
        ticket.state = "released"

    def counts(self) -> dict[str, int]:
        """Connections counted now: ``pending``, ``established`` (all addresses) and
        ``addresses`` (distinct IP/network keys held; 0 when nothing is open)."""
        return {
            "pending": sum(self._pending_ip.values()),
            "established": sum(self._established_ip.values()),
            "addresses": len(self._pending_ip) + len(self._pending_net)
            + len(self._established_ip) + len(self._established_net),
        }


def _incr(counter: dict[str, int], key: str) -> None:
    counter[key] = counter.get(key, 0) + 1


def _decr(counter: dict[str, int], key: str) -> None:
    left = counter.get(key, 0) - 1
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)


__all__ = ["LOOPBACK", "InboundAdmission", "InboundLimits", "Ticket", "address_keys"]
