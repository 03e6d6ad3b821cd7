"""One grouping of addresses by source network (ps_p2p.networks), shared by the committee's
admission caps, the new-identity limiter, the relay's unlisted pool and inbound admission."""

from __future__ import annotations

import ipaddress

import pytest

from ps_p2p.networks import host_key, network_key, parse_ip


@pytest.mark.parametrize("text, expected", [
    ("203.0.113.7", ipaddress.IPv4Address("203.0.113.7")),
    ("::ffff:203.0.113.7", ipaddress.IPv4Address("203.0.113.7")),  # IPv4-mapped: as IPv4
    ("fe80::1%eth0", ipaddress.IPv6Address("fe80::1")),  # zone dropped
    ("not an ip", None),
    (None, None),
])
def test_parse_ip_reads_a_remote_host_as_the_address_it_stands_for(text, expected):
    assert parse_ip(text) == expected


@pytest.mark.parametrize("ip, bits, key", [
    ("203.0.113.7", {}, "ip4:203.0.113.0/24"),
    ("203.0.113.7", {"ipv4_prefix_bits": 16}, "ip4:203.0.0.0/16"),
    ("2001:db8:1:2::5", {}, "ip6:2001:db8:1::/48"),
    ("2001:db8:1:2::5", {"ipv6_prefix_bits": 32}, "ip6:2001:db8::/32"),
    ("::ffff:203.0.113.7", {}, "ip6:::/48"),  # taken as given: parse_ip maps it, not this
])
def test_network_key_names_the_network_an_address_falls_in(ip, bits, key):
    assert network_key(ipaddress.ip_address(ip), **bits) == key


def test_network_key_refuses_prefix_bits_out_of_range():
    with pytest.raises(ValueError):
        network_key(ipaddress.IPv4Address("203.0.113.7"), 33)


def test_host_key_is_the_ipv4_address_or_the_ipv6_slash_64():
    assert host_key(ipaddress.IPv4Address("203.0.113.7")) == "203.0.113.7"
    assert host_key(ipaddress.IPv6Address("2001:db8:1:2:3:4:5:6")) == "2001:db8:1:2::/64"
