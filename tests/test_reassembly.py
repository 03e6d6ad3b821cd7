"""Clove reassembly (ps_p2p.overlay.reassembly): order, duplicates, tampering, expiry, bounds."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.crypto import sida
from ps_p2p.errors import PsError, RemoteProtocolError
from ps_p2p.overlay import reassembly
from ps_p2p.overlay.reassembly import CloveAssembler, MessageReassembled, ReassemblyFailed

MESSAGE = b"prompt: tell me a story about a dragon who learned to share. " * 20


def message_id(i: int) -> bytes:
    return i.to_bytes(16, "big")


def tamper(clove: sida.Clove, field: str = "fragment") -> sida.Clove:
    data = getattr(clove, field)
    return dataclasses.replace(clove, **{field: bytes((data[0] ^ 0xFF,)) + data[1:]})


def feed(assembler: CloveAssembler, cloves, now: float = 0.0) -> list:
    events = []
    for clove in cloves:
        events.extend(assembler.receive_clove(clove, now))
    return events


# ---------------------------------------------------------------------------------------- order


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 6), data=st.data(), size=st.integers(0, 5000))
def test_message_reassembles_at_the_kth_distinct_clove_in_any_order(n, data, size):
    k = data.draw(st.integers(1, n), label="k")
    order = data.draw(st.permutations(range(n)), label="order")
    payload = random.Random(size).randbytes(size)
    cloves = sida.encode(payload, n, k, message_id=message_id(1))
    assembler = CloveAssembler()

    results = [assembler.receive_clove(cloves[i], now=float(t)) for t, i in enumerate(order)]

    assert results[k - 1] == [MessageReassembled(message_id(1), payload, n, k)]
    assert all(r == [] for t, r in enumerate(results) if t != k - 1)
    assert assembler.pending == 0
    assert assembler.ignored == n - k


@settings(max_examples=50, deadline=None)
@given(messages=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_interleaved_messages_each_give_exactly_one_event(messages, seed):
    rng = random.Random(seed)
    payloads = {message_id(i): rng.randbytes(rng.randrange(0, 300)) for i in range(messages)}
    cloves = [c for mid, p in payloads.items() for c in sida.encode(p, 4, 3, message_id=mid)]
    cloves += rng.sample(cloves, len(cloves) // 2)  # retransmitted duplicates
    rng.shuffle(cloves)
    assembler = CloveAssembler()

    events = feed(assembler, cloves)

    assert sorted(events, key=lambda e: e.message_id) == [
        MessageReassembled(mid, payloads[mid], 4, 3) for mid in sorted(payloads)
    ]
    assert len(assembler) == 0


# -------------------------------------------------------------------------------------- duplicates


def test_duplicate_index_is_dropped_and_counted_without_event():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    assert feed(assembler, [cloves[0], cloves[0], cloves[1], cloves[1]]) == []
    assert assembler.duplicates == 2
    assert assembler.pending == 1
    assert feed(assembler, [cloves[2]]) == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]


def test_a_different_clove_with_a_buffered_index_is_dropped():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    assert feed(assembler, [cloves[0], tamper(cloves[0]), cloves[1]]) == []
    assert assembler.duplicates == 1
    assert feed(assembler, [cloves[2]]) == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]


def test_cloves_after_success_are_ignored_until_ttl():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler(ttl=10.0)
    feed(assembler, cloves[:3], now=0.0)

    assert assembler.receive_clove(cloves[3], now=9.0) == []
    assert assembler.receive_clove(cloves[0], now=9.0) == []
    assert assembler.pending == 0
    assert assembler.is_completed(message_id(1))

    assert assembler.expire(now=10.0) == []  # completed IDs are not reported as expired
    assert not assembler.is_completed(message_id(1))
    assert assembler.receive_clove(cloves[3], now=10.0) == []
    assert assembler.pending == 1  # forgotten: a late clove starts a new set


# ---------------------------------------------------------------------------------------- tampering


@pytest.mark.parametrize("field", ["fragment", "key_share"])
def test_tampered_clove_then_good_clove_reassembles(field):
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    assert feed(assembler, [tamper(cloves[0], field), cloves[1], cloves[2]]) == []
    assert assembler.pending == 1
    assert feed(assembler, [cloves[3]]) == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]


def test_all_cloves_in_but_none_decodes_fails_once_and_forgets():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    cloves = [tamper(cloves[0]), cloves[1], tamper(cloves[2], "key_share"), cloves[3]]
    assembler = CloveAssembler()

    events = [assembler.receive_clove(c, now=0.0) for c in cloves]

    assert events[:3] == [[], [], []]
    assert len(events[3]) == 1
    assert isinstance(events[3][0], ReassemblyFailed)
    assert events[3][0].message_id == message_id(1)
    assert events[3][0].reason
    assert assembler.pending == 0
    assert not assembler.is_completed(message_id(1))


def test_fragment_length_mismatch_counts_as_a_failed_subset():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    long = dataclasses.replace(cloves[1], fragment=cloves[1].fragment + b"\x00")
    assembler = CloveAssembler()

    assert feed(assembler, [cloves[0], long, cloves[2]]) == []
    assert feed(assembler, [cloves[3]]) == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]


def test_each_subset_is_tried_once_and_contains_the_newest_clove(monkeypatch):
    tried = []
    real = sida.decode_subset

    def recording(subset):
        tried.append(tuple(sorted(c.index for c in subset)))
        return real(subset)

    monkeypatch.setattr(reassembly.sida, "decode_subset", recording)
    cloves = sida.encode(MESSAGE, 5, 3, message_id=message_id(1))
    cloves[0], cloves[1] = tamper(cloves[0]), tamper(cloves[1])
    assembler = CloveAssembler()

    assert feed(assembler, cloves[:4]) == []
    assert tried == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert feed(assembler, [cloves[4]]) == [MessageReassembled(message_id(1), MESSAGE, 5, 3)]
    assert len(tried) == len(set(tried))
    assert all(4 in subset for subset in tried[4:])
    assert tried[-1] == (2, 3, 4)


def test_attempt_budget_spent_fails_the_message():
    cloves = sida.encode(MESSAGE, 6, 2, message_id=message_id(1))
    sequence = [tamper(cloves[0]), tamper(cloves[1]), tamper(cloves[2]), cloves[3], cloves[4]]
    assembler = CloveAssembler(max_attempts=3)

    assert feed(assembler, sequence[:2]) == []  # attempt 1: (0, 1)
    events = assembler.receive_clove(sequence[2], now=0.0)  # attempts 2, 3: (0, 2), (1, 2)

    assert [type(e) for e in events] == [ReassemblyFailed]
    assert "3 attempts" in events[0].reason
    assert assembler.pending == 0
    assert feed(CloveAssembler(), sequence) == [MessageReassembled(message_id(1), MESSAGE, 6, 2)]


# -------------------------------------------------------------------------------------- bad cloves


def test_out_of_range_clove_raises_and_is_not_buffered():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    with pytest.raises(RemoteProtocolError):
        assembler.receive_clove(dataclasses.replace(cloves[0], index=4), now=0.0)
    with pytest.raises(RemoteProtocolError):
        assembler.receive_clove(dataclasses.replace(cloves[0], key_share=b"short"), now=0.0)
    assert assembler.pending == 0


# ---------------------------------------------------------------------------- forged headers

FORGED_HEADERS = [
    {"total": 5},
    {"threshold": 2},
    {"total": 1, "threshold": 1},
    {"total": 16, "threshold": 16},
]


def forge(clove: sida.Clove, **header: int) -> sida.Clove:
    return dataclasses.replace(clove, **header)


@pytest.mark.parametrize("header", FORGED_HEADERS)
def test_forged_header_first_then_k_honest_cloves_still_decodes(header):
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    early = assembler.receive_clove(forge(cloves[0], **header), now=0.0)
    events = feed(assembler, cloves[1:])

    assert all(isinstance(e, ReassemblyFailed) for e in early)  # 1-of-1 fails alone, at once
    assert events == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]
    assert assembler.is_completed(message_id(1))


@pytest.mark.parametrize("header", [h for h in FORGED_HEADERS if h != {"total": 1, "threshold": 1}])
def test_forged_header_first_neither_raises_nor_fails_the_message(header):
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    events = feed(assembler, [forge(cloves[0], **header), *cloves[:3]])

    assert events == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]


def test_forged_header_after_honest_cloves_is_buffered_apart():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    forged = [forge(cloves[1], threshold=2), forge(cloves[2], threshold=2)]
    assembler = CloveAssembler()

    assert feed(assembler, [cloves[0], *forged]) == []
    events = feed(assembler, [cloves[1], cloves[2]])

    assert events == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]
    assert assembler.duplicates == 0


def test_cloves_disagreeing_with_the_first_header_are_counted_as_conflicts():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    feed(assembler, [forge(cloves[0], total=5), cloves[1], cloves[2], forge(cloves[0], total=5)])

    assert assembler.conflicts == 2  # cloves[1], cloves[2]; the repeated forgery is a duplicate
    assert assembler.duplicates == 1
    assert assembler.overflows == 0


def test_honest_header_first_counts_the_forged_clove_as_the_conflict():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()

    feed(assembler, [cloves[0], forge(cloves[1], threshold=2), cloves[1], cloves[2]])

    assert assembler.conflicts == 1


@pytest.mark.parametrize("n, k", [(4, 3), (5, 2), (6, 6)])
def test_reassembled_event_carries_the_honest_groups_total_and_threshold(n, k):
    cloves = sida.encode(MESSAGE, n, k, message_id=message_id(1))
    forged = [forge(cloves[0], total=16, threshold=1), forge(cloves[1], threshold=max(k - 1, 1))]
    assembler = CloveAssembler()

    events = feed(assembler, [*forged, *cloves[:k]])
    decoded = [e for e in events if isinstance(e, MessageReassembled)]

    assert len(decoded) == 1
    assert (decoded[0].total, decoded[0].threshold) == (n, k)
    assert decoded[0].payload == MESSAGE


def test_one_event_per_message_id_then_every_group_is_ignored():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    assembler = CloveAssembler()
    feed(assembler, [forge(cloves[0], threshold=2), *cloves[:3]])

    late = [forge(cloves[1], threshold=2), forge(cloves[2], total=6), cloves[3]]

    assert feed(assembler, late) == []
    assert assembler.ignored == 3
    assert assembler.pending == 0


def test_groups_beyond_max_groups_are_dropped_and_counted():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    forged = [forge(cloves[0], total=t) for t in (5, 6, 7)]
    assembler = CloveAssembler(max_groups=3)

    assert feed(assembler, forged) == []
    assert feed(assembler, cloves[:3]) == []  # a fourth header: no room, no exception

    assert assembler.overflows == 3
    assert assembler.conflicts == 5  # totals 6 and 7, and the three honest cloves
    assert assembler.pending == 1
    assert not assembler.is_completed(message_id(1))


def test_honest_group_within_max_groups_decodes_beside_forged_ones():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    forged = [forge(cloves[0], total=t) for t in (5, 6, 7)]
    assembler = CloveAssembler()  # DEFAULT_MAX_GROUPS = 4

    events = feed(assembler, [*forged, *cloves[:3]])

    assert events == [MessageReassembled(message_id(1), MESSAGE, 4, 3)]
    assert assembler.overflows == 0
    assert reassembly.DEFAULT_MAX_GROUPS == 4


def test_message_fails_only_when_every_group_is_exhausted():
    cloves = sida.encode(MESSAGE, 2, 2, message_id=message_id(1))
    bad = [tamper(cloves[0]), cloves[1]]
    forged = [forge(c, total=2, threshold=1) for c in cloves]  # 1-of-2: AEAD binds n, k
    assembler = CloveAssembler()

    assert feed(assembler, forged[:1]) == []  # the 1-of-2 group: index 0 tried, index 1 to come
    assert feed(assembler, bad) == []  # the 2-of-2 group is exhausted; the message stays
    assert assembler.pending == 1
    events = feed(assembler, forged[1:])

    assert [type(e) for e in events] == [ReassemblyFailed]
    assert "2-of-2" in events[0].reason and "1-of-2" in events[0].reason
    assert assembler.pending == 0


def test_exhausted_group_drops_later_cloves_as_duplicates():
    cloves = sida.encode(MESSAGE, 2, 2, message_id=message_id(1))
    assembler = CloveAssembler()
    feed(assembler, [forge(cloves[0], threshold=1), tamper(cloves[0]), cloves[1]])

    assert assembler.pending == 1
    assert feed(assembler, [cloves[0]]) == []
    assert assembler.duplicates == 1


def test_attempt_budget_is_shared_by_all_groups():
    cloves = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    forged = [forge(c, threshold=1) for c in cloves[:2]]  # one attempt each
    assembler = CloveAssembler(max_attempts=3)

    assert feed(assembler, [*forged, cloves[0], cloves[1]]) == []
    events = feed(assembler, [tamper(cloves[2])])  # attempt 3 spends the budget

    assert [type(e) for e in events] == [ReassemblyFailed]
    assert "3 attempts" in events[0].reason
    assert assembler.pending == 0


# ------------------------------------------------------------------------------- expiry and bounds


def test_incomplete_message_expires_ttl_after_its_first_clove():
    first = sida.encode(MESSAGE, 4, 3, message_id=message_id(1))
    second = sida.encode(MESSAGE, 4, 3, message_id=message_id(2))
    assembler = CloveAssembler(ttl=30.0)
    assembler.receive_clove(first[0], now=100.0)
    assembler.receive_clove(second[0], now=110.0)
    assembler.receive_clove(first[1], now=125.0)  # later cloves do not extend the deadline

    assert assembler.expire(now=129.9) == []
    assert assembler.expire(now=130.0) == [message_id(1)]
    assert assembler.pending == 1
    assert assembler.expire(now=140.0) == [message_id(2)]
    assert assembler.pending == 0

    assert assembler.receive_clove(first[2], now=141.0) == []  # a fresh set, with one clove
    assert assembler.pending == 1


def test_over_max_messages_the_oldest_is_evicted_with_an_event():
    assembler = CloveAssembler(max_messages=3)
    sets = {i: sida.encode(MESSAGE, 4, 3, message_id=message_id(i)) for i in range(5)}
    for i in range(3):
        assert assembler.receive_clove(sets[i][0], now=float(i)) == []

    events = assembler.receive_clove(sets[3][0], now=3.0)

    assert [type(e) for e in events] == [ReassemblyFailed]
    assert events[0].message_id == message_id(0)
    assert len(assembler) == 3
    assert assembler.receive_clove(sets[1][1], now=4.0) == []  # a known message evicts nothing
    assert len(assembler) == 3
    assert feed(assembler, [sets[3][1], sets[3][2]]) == [
        MessageReassembled(message_id(3), MESSAGE, 4, 3)
    ]
    assert len(assembler) == 2
    assert assembler.expire(now=1000.0) == [message_id(1), message_id(2)]


def test_completed_ids_remembered_are_bounded_by_max_messages():
    assembler = CloveAssembler(max_messages=2)
    sets = [sida.encode(b"m", 1, 1, message_id=message_id(i)) for i in range(3)]
    for cloves in sets:
        assert len(feed(assembler, cloves)) == 1

    assert not assembler.is_completed(message_id(0))
    assert assembler.is_completed(message_id(1)) and assembler.is_completed(message_id(2))


@pytest.mark.parametrize(
    "kwargs", [{"ttl": 0}, {"max_messages": 0}, {"max_attempts": 0}, {"max_groups": 0}]
)
def test_bad_limits_are_rejected(kwargs):
    with pytest.raises(PsError):
        CloveAssembler(**kwargs)


def test_buffered_bytes_are_bounded_by_evicting_the_oldest_incomplete_messages():
    assembler = CloveAssembler(max_bytes=10_000)
    ids = [bytes([i]) * 16 for i in range(8)]
    events = []
    for message_id in ids:
        cloves = sida.encode(b"x" * 9000, total=4, threshold=3, message_id=message_id)
        events += assembler.receive_clove(cloves[0], now=0.0)  # one clove: never completes
        assert assembler.buffered_bytes <= 10_000
    evicted = [e.message_id for e in events if isinstance(e, ReassemblyFailed)]
    assert evicted == ids[: len(evicted)] and evicted  # oldest first
    assert ids[0] not in {m for m in assembler._pending}
    assert ids[-1] in assembler._pending


def test_buffered_bytes_return_to_zero_when_messages_complete_or_expire():
    assembler = CloveAssembler(ttl=5.0, max_bytes=1 << 20)
    done = sida.encode(b"payload", total=4, threshold=3, message_id=b"d" * 16)
    for clove in done[:3]:
        assembler.receive_clove(clove, now=0.0)
    assert assembler.buffered_bytes == 0
    stale = sida.encode(b"payload", total=4, threshold=3, message_id=b"s" * 16)
    assembler.receive_clove(stale[0], now=0.0)
    assert assembler.buffered_bytes > 0
    assembler.expire(now=5.0)
    assert assembler.buffered_bytes == 0


def test_garbage_groups_of_large_messages_stop_at_the_decode_byte_budget():
    # 16-of-12 groups of a 4 MiB message once cost 234 ms a subset, 64 subsets per message
    assembler = CloveAssembler(max_decode_bytes=3 * 1_000_000)
    message_id = b"g" * 16
    cloves = sida.encode(b"\x01" * 2_000_000, total=6, threshold=3, message_id=message_id)
    garbage = [dataclasses.replace(c, fragment=bytes(len(c.fragment))) for c in cloves]
    failed_at = None
    for i, clove in enumerate(garbage):
        if any(isinstance(e, ReassemblyFailed) for e in assembler.receive_clove(clove, now=0.0)):
            failed_at = i
            break
    # each attempt feeds k fragments of ~667 KB: the budget allows 2 subsets, spent by the 4th
    # clove, long before all C(6, 3) = 20 subsets of the 6 cloves were tried
    assert failed_at == 3


def test_a_small_message_with_a_tampered_clove_still_decodes_within_the_budget():
    assembler = CloveAssembler()
    cloves = sida.encode(b"q" * 30_000, total=4, threshold=3)
    bad = dataclasses.replace(cloves[0], fragment=bytes(len(cloves[0].fragment)))
    events = []
    for clove in [bad, *cloves[1:]]:
        events += assembler.receive_clove(clove, now=0.0)
    assert [e.payload for e in events if isinstance(e, MessageReassembled)] == [b"q" * 30_000]
