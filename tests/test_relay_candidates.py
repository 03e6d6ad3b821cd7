"""Relay candidates skip users that stopped renewing their record (issue 20 sec. 4): a frozen
or crashed user stays listed until its record expires (5 min), but is no relay once it missed
two renewals, judged by the directory's own time (no local clock)."""

from __future__ import annotations

import pytest

from ps_p2p.records import Directory, NodeRecord, Role
from ps_p2p.roles.user import RELAY_SILENT_MS, relay_candidates

NOW = 1_700_000_000_000
ME = b"me".ljust(38, b"\0")


def _user(i: int, age_ms: int, onion: bytes = b"k" * 32) -> NodeRecord:
    return NodeRecord(bytes([i]) * 38, (), frozenset({Role.USER}), onion,
                      issued_at_ms=NOW - age_ms, expires_at_ms=NOW - age_ms + 300_000)


def _directory(*records: NodeRecord) -> Directory:
    return Directory(7, NOW, NOW + 60_000, tuple(records))


@pytest.mark.parametrize(
    "age_ms, candidate",
    [(0, True), (29_000, True), (RELAY_SILENT_MS - 1, True), (RELAY_SILENT_MS, False),
     (200_000, False)],
)
def test_a_user_that_stopped_renewing_is_no_relay(age_ms, candidate):
    live = [_user(i, 1_000) for i in range(1, 6)]
    subject = _user(9, age_ms)
    relays = relay_candidates(_directory(*live, subject, _user(10, 0, onion=b"")), ME)
    assert (subject.peer_id in relays) is candidate
    assert all(r.peer_id in relays for r in live)
    assert bytes([10]) * 38 not in relays  # no valid onion key


def test_with_too_few_renewed_users_every_listed_user_is_a_candidate_renewed_first():
    stale = [_user(i, 120_000) for i in range(1, 6)]
    fresh = [_user(8, 0), _user(9, 0)]
    relays = relay_candidates(_directory(*stale, *fresh), ME)
    assert relays[:2] == [r.peer_id for r in fresh]
    assert set(relays) == {r.peer_id for r in stale + fresh}
