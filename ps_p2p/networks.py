"""The source network of an IP address: the one place that groups addresses by site (pure).

Identities are free, addresses are not, so several bounds count per *source network*, the block
one site usually holds: an IPv4 /24 or an IPv6 /48 by default. They all name a network the same
way, ``"ip4:203.0.113.0/24"`` or ``"ip6:2001:db8:1::/48"`` (:func:`network_key`):

* the committee's admission caps on the networks a node record claims
  (:func:`ps_p2p.registry.source_networks`; those keys are committed state);
* the verifier's rate of new identities per observed source network
  (:class:`ps_p2p.registry.sources.NewIdentityLimiter`);
* a relay's pool of paths for predecessors outside the directory
  (:func:`ps_p2p.protocols.host.peer_network` -> :class:`ps_p2p.overlay.relay_table.RelayTable`);
* inbound connections and streams per address and per network
  (:func:`ps_p2p.protocols.admission.address_keys`), which also count per *host*
  (:func:`host_key`: the IPv4 address, or the IPv6 /64 one host or home network gets).

The text of a remote address is read by :func:`parse_ip`: an IPv6 zone (``%eth0``) is dropped
and an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``, what a dual-stack listener reports for an
IPv4 peer) counts as its IPv4 address, so it falls in its own /24 rather than in one /48 shared by
every IPv4 peer. Loopback is for each caller to decide (it is ``ip.is_loopback`` of the parsed
address): only a process on the same machine connects from it (a devnet, a localnet, a test).

Pure: only :mod:`ipaddress`; no I/O, no clock.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Default prefix of a source network: IPv4 /24, IPv6 /48 (one site's usual allocation).
IPV4_NETWORK_BITS = 24
IPV6_NETWORK_BITS = 48

#: Prefix of one host's IPv6 addresses (:func:`host_key`): the /64 a host or home network gets.
IPV6_HOST_BITS = 64


def parse_ip(text: str | None) -> IPAddress | None:
    """The IP address in ``text`` (a connection's remote host), or None when it is None or not an
    IP address. An IPv6 zone is dropped; an IPv4-mapped IPv6 address gives its IPv4 address."""
    if text is None:
        return None
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def network_key(ip: IPAddress, ipv4_prefix_bits: int = IPV4_NETWORK_BITS,
                ipv6_prefix_bits: int = IPV6_NETWORK_BITS) -> str:
    """The network ``ip`` falls in, as text: ``"ip4:203.0.113.0/24"``, ``"ip6:2001:db8:1::/48"``.

    The address is taken as given (an IPv4-mapped IPv6 address stays IPv6: :func:`parse_ip`
    maps it). Prefix bits: 0 to 32 (IPv4), 0 to 128 (IPv6).

    Raises:
        ValueError: prefix bits out of range.
    """
    if isinstance(ip, ipaddress.IPv4Address):
        return f"ip4:{_prefix(ip, ipv4_prefix_bits)}"
    return f"ip6:{_prefix(ip, ipv6_prefix_bits)}"


def host_key(ip: IPAddress) -> str:
    """What one host is counted under: an IPv4 address as text (``"203.0.113.7"``), an IPv6
    address's /64 (``"2001:db8:1:2::/64"``)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return str(ip)
    return str(_prefix(ip, IPV6_HOST_BITS))


def _prefix(ip: IPAddress, bits: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    width = ip.max_prefixlen
    if not 0 <= bits <= width:
        raise ValueError(f"prefix of {bits} bits for an IPv{ip.version} address")
    shift = width - bits
    if isinstance(ip, ipaddress.IPv4Address):
        return ipaddress.IPv4Network((int(ip) >> shift << shift, bits))
    return ipaddress.IPv6Network((int(ip) >> shift << shift, bits))


__all__ = ["IPV4_NETWORK_BITS", "IPV6_HOST_BITS", "IPV6_NETWORK_BITS", "IPAddress",
           "host_key", "network_key", "parse_ip"]
