"""Admission of inbound connections per remote address (ps_p2p.protocols.admission): a pure core,
so these are tables of (admit / establish / release) -> (ticket or refusal, counts)."""

from __future__ import annotations

import pytest

from ps_p2p.errors import ConfigError
from ps_p2p.protocols.admission import (
    LOOPBACK, InboundAdmission, InboundLimits, Ticket, address_keys,
)

SMALL = InboundLimits(pending_per_ip=2, pending_per_network=3, established_per_ip=2,
                      established_per_network=3)


def _admit(core: InboundAdmission, ip: str) -> Ticket:
    ticket = core.admit(ip)
    assert isinstance(ticket, Ticket), ticket
    return ticket


@pytest.mark.parametrize("ip, keys", [
    ("203.0.113.7", ("203.0.113.7", "ip4:203.0.113.0/24")),
    ("::ffff:203.0.113.7", ("203.0.113.7", "ip4:203.0.113.0/24")),  # IPv4-mapped: as IPv4
    ("2001:db8:1:2:3:4:5:6", ("2001:db8:1:2::/64", "ip6:2001:db8:1::/48")),
    ("fe80::1%eth0", ("fe80::/64", "ip6:fe80::/48")),
    ("not an ip", None),
    (None, None),
])
def test_an_address_is_counted_under_its_ip_and_network(ip, keys):
    assert address_keys(ip) == keys


def test_handshakes_over_the_per_ip_cap_are_refused_until_one_ends():
    core = InboundAdmission(SMALL)
    first, _ = _admit(core, "198.51.100.1"), _admit(core, "198.51.100.1")

    refused = core.admit("198.51.100.1")
    assert refused == "2 handshakes in progress from 198.51.100.1"

    core.release(first)
    _admit(core, "198.51.100.1")


def test_handshakes_over_the_per_network_cap_are_refused_from_every_ip_of_the_network():
    core = InboundAdmission(SMALL)
    for ip in ("198.51.100.1", "198.51.100.2", "198.51.100.3"):
        _admit(core, ip)

    assert core.admit("198.51.100.4") == "3 handshakes in progress from ip4:198.51.100.0/24"
    _admit(core, "198.51.101.4")  # another /24


def test_an_established_connection_frees_its_handshake_place_and_counts_as_open():
    core = InboundAdmission(SMALL)
    tickets = [_admit(core, "198.51.100.1") for _ in range(2)]
    assert core.establish(tickets[0]) is None

    assert core.counts() == {"pending": 1, "established": 1, "addresses": 4}
    _admit(core, "198.51.100.1")  # the handshake place was given back


def test_a_connection_over_the_open_cap_is_refused_after_its_handshake_and_holds_nothing():
    core = InboundAdmission(SMALL)
    for _ in range(2):
        assert core.establish(_admit(core, "198.51.100.1")) is None
    third = _admit(core, "198.51.100.1")

    assert core.establish(third) == "2 connections open from 198.51.100.1"
    assert third.state == "released"
    assert core.counts()["pending"] == 0 and core.counts()["established"] == 2


def test_open_connections_over_the_per_network_cap_are_refused():
    core = InboundAdmission(SMALL)
    for ip in ("198.51.100.1", "198.51.100.1", "198.51.100.2"):
        assert core.establish(_admit(core, ip)) is None

    assert core.establish(_admit(core, "198.51.100.3")) == (
        "3 connections open from ip4:198.51.100.0/24"
    )


def test_releasing_every_ticket_in_any_state_leaves_no_counter_behind():
    core = InboundAdmission(SMALL)
    pending = _admit(core, "2001:db8::1")
    established = _admit(core, "198.51.100.1")
    core.establish(established)

    for ticket in (pending, established, established, pending):  # twice: idempotent
        core.release(ticket)

    assert core.counts() == {"pending": 0, "established": 0, "addresses": 0}


def test_exempt_networks_are_never_counted_and_never_refused():
    core = InboundAdmission(InboundLimits(pending_per_ip=1, pending_per_network=1,
                                          established_per_ip=1, established_per_network=1,
                                          exempt=LOOPBACK))
    tickets = [_admit(core, ip) for ip in ("127.0.0.1", "127.0.0.1", "::1", "127.9.9.9")]
    assert all(core.establish(t) is None for t in tickets)

    assert core.counts() == {"pending": 0, "established": 0, "addresses": 0}
    _admit(core, "198.51.100.1")
    assert isinstance(core.admit("198.51.100.1"), str)  # others still are


def test_loopback_is_counted_like_any_address_unless_exempted():
    core = InboundAdmission(InboundLimits(pending_per_ip=1, pending_per_network=1))
    _admit(core, "127.0.0.1")

    assert isinstance(core.admit("127.0.0.1"), str)


def test_connections_without_a_known_address_share_one_bucket():
    core = InboundAdmission(SMALL)
    _admit(core, None)
    _admit(core, "garbage")

    assert core.admit(None) == "2 handshakes in progress from unknown"


@pytest.mark.parametrize("kwargs, message", [
    ({"handshake_timeout": 0}, "handshake_timeout"),
    ({"pending_per_ip": 0}, "pending_per_ip"),
    ({"established_per_network": 1.5}, "established_per_network"),
    ({"pending_per_ip": 9, "pending_per_network": 8}, "pending_per_ip must be <="),
    ({"exempt": ("10.0.0.0/33",)}, "exempt"),
    ({"exempt": "127.0.0.0/8"}, "exempt must be a list"),
])
def test_impossible_limits_are_a_config_error_naming_the_setting(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        InboundLimits(**kwargs)


def test_a_toml_list_of_exempt_networks_becomes_a_tuple():
    assert InboundLimits(exempt=["127.0.0.0/8"]).exempt == ("127.0.0.0/8",)
