"""Load reports and the LoadBook (ps_p2p.gossip.load): what peers gossip of their F_LB and how
a model node keeps it (PlanetServe sec. 3.3; DESIGN.md "Model nodes")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from ps_p2p.gossip.load import (
    MAX_CAPACITY,
    MAX_LATENCY_US,
    MAX_PEER_ID_BYTES,
    MAX_QUEUED,
    MAX_REPORT_BYTES,
    LoadBook,
    LoadReport,
    LoadReporter,
    LoadTracker,
    ReportOutcome,
    decode_report,
    encode_report,
    load_factor,
)

MODEL = "stories260K"
SELF = b"\x00" * 38
A = b"\x0a" * 38
B = b"\x0b" * 38
OUTSIDER = b"\x0f" * 38


def report(peer=A, seq=1, queued=0, in_service=0, capacity=2, latency_us=500_000, model=MODEL):
    return LoadReport(peer, model, seq, capacity, queued, in_service, latency_us)


def book(**kwargs) -> LoadBook:
    return LoadBook(SELF, MODEL, {SELF, A, B}, **kwargs)


# ---------------------------------------------------------------------------------- the book


def test_accepted_report_gives_the_peers_load_factor():
    b = book()
    assert b.receive(report(queued=2, in_service=1, capacity=2, latency_us=500_000), 10.0) \
        == ReportOutcome.ACCEPTED
    load = b.fresh(A, 10.0)
    assert (load.requests, load.capacity, load.seq, load.received_at) == (3, 2, 1, 10.0)
    assert load.load_factor() == pytest.approx(0.5 * 2 / 2)  # Q: the two waiting
    assert (load.waiting, load.running) == (2, 1)


@pytest.mark.parametrize("replayed_seq", [5, 4, 0])
def test_replayed_or_older_report_is_refused_and_changes_nothing(replayed_seq):
    b = book()
    b.receive(report(seq=5, queued=1), 1.0)
    assert b.receive(report(seq=replayed_seq, queued=9), 2.0) == ReportOutcome.REPLAYED
    assert (b.get(A).seq, b.get(A).requests, b.get(A).received_at) == (5, 1, 1.0)


def test_forwarded_requests_add_to_q_until_the_next_report():
    b = book()
    b.receive(report(seq=1, queued=1, capacity=1, latency_us=1_000_000), 0.0)
    b.note_forwarded(A)
    b.note_forwarded(A, 2)
    assert b.fresh(A, 0.5).requests == 1 + 3
    # its one slot takes one of them, the other two wait with the one it reported waiting
    assert (b.fresh(A, 0.5).running, b.fresh(A, 0.5).waiting) == (1, 3)
    assert b.fresh(A, 0.5).load_factor() == pytest.approx(3.0)
    b.receive(report(seq=2, queued=2, capacity=1, latency_us=1_000_000), 1.0)
    assert (b.fresh(A, 1.0).forwarded, b.fresh(A, 1.0).requests) == (0, 2)


def test_a_replayed_report_does_not_reset_the_forwarded_count():
    b = book()
    b.receive(report(seq=3), 0.0)
    b.note_forwarded(A, 2)
    b.receive(report(seq=3), 0.5)
    assert b.get(A).forwarded == 2


def test_forwarding_to_a_peer_without_report_is_not_recorded():
    b = book()
    b.note_forwarded(A)
    assert b.get(A) is None and len(b) == 0


def test_negative_forwarded_count_is_refused():
    b = book()
    b.receive(report(), 0.0)
    with pytest.raises(LocalProtocolError):
        b.note_forwarded(A, -1)


def test_report_is_stale_after_max_age_and_unknown_then():
    b = book(max_age=3.0)
    b.receive(report(queued=0), 10.0)
    assert b.fresh(A, 13.0) is not None  # exactly max_age old: still counts
    assert b.fresh(A, 13.001) is None
    assert A not in b.fresh_loads(13.001)
    assert b.get(A).received_at == 10.0  # kept for logs and for its seq
    assert b.receive(report(seq=1), 20.0) == ReportOutcome.REPLAYED
    assert b.receive(report(seq=2), 20.0) == ReportOutcome.ACCEPTED
    assert b.fresh(A, 20.0) is not None


@pytest.mark.parametrize(
    "r,outcome",
    [
        (report(peer=OUTSIDER), ReportOutcome.NOT_MEMBER),
        (report(peer=SELF), ReportOutcome.SELF),
        (report(model="another/model"), ReportOutcome.WRONG_GROUP),
    ],
    ids=["not a member", "own report", "another model"],
)
def test_reports_from_outside_the_group_are_refused(r, outcome):
    b = book()
    assert b.receive(r, 0.0) == outcome
    assert len(b) == 0


def test_a_peer_leaving_the_group_is_forgotten():
    b = book()
    b.receive(report(peer=A), 0.0)
    b.receive(report(peer=B), 0.0)
    b.set_members({SELF, B})
    assert (b.get(A), b.fresh(A, 0.0)) == (None, None)
    assert set(b.fresh_loads(0.0)) == {B}
    assert b.receive(report(peer=A, seq=2), 1.0) == ReportOutcome.NOT_MEMBER


def test_book_holds_at_most_max_peers():
    b = LoadBook(SELF, MODEL, {A, B}, max_peers=1)
    assert b.receive(report(peer=A), 0.0) == ReportOutcome.ACCEPTED
    assert b.receive(report(peer=B), 0.0) == ReportOutcome.FULL
    assert b.receive(report(peer=A, seq=2), 1.0) == ReportOutcome.ACCEPTED  # known peer: updates
    assert len(b) == 1


@pytest.mark.parametrize(
    "kwargs", [{"max_age": 0.0}, {"max_peers": 0}, {"unknown_latency": -1.0}]
)
def test_bad_book_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        book(**kwargs)


def test_unknown_latency_prior_makes_a_busy_new_node_look_busy():
    b = book(unknown_latency=2.0)
    b.receive(report(queued=3, in_service=1, capacity=2, latency_us=None), 0.0)
    assert b.fresh(A, 0.0).latency_ewma is None
    assert b.fresh(A, 0.0).load_factor(b.unknown_latency) == pytest.approx(2.0 * 3 / 2)
    assert load_factor(None, 0, 4, 2.0) == 0.0


# ---------------------------------------------------------------------------------- tracker


def test_tracker_report_carries_its_load():
    t = LoadTracker(capacity=2, max_queue=4)
    t.try_admit()
    t.start()
    t.finish(0.25)
    t.try_admit()
    t.try_admit()
    t.start()
    r = t.report(A, MODEL, seq=7)
    assert (r.queued, r.in_service, r.capacity, r.latency_us, r.seq) == (1, 1, 2, 250_000, 7)
    assert t.requests == r.requests == 2


def test_tracker_report_before_any_sample_has_no_latency():
    r = LoadTracker(capacity=1, max_queue=0).report(A, MODEL, seq=0)
    assert r.latency_us is None
    assert encode_report(r).endswith(b"\x00")  # uv(0): no sample
    assert decode_report(encode_report(r), A, MODEL).latency is None


def test_tracker_report_clamps_values_beyond_the_wire_limits():
    t = LoadTracker(capacity=MAX_CAPACITY + 10, max_queue=0, latency_ewma=10_000.0)
    r = t.report(A, MODEL, seq=1)
    assert (r.capacity, r.latency_us) == (MAX_CAPACITY, MAX_LATENCY_US)


# ---------------------------------------------------------------------------------- bytes


def uv(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def test_encoded_report_is_five_varints_and_roundtrips_with_its_envelope_facts():
    r = report(queued=4, in_service=2, capacity=8, latency_us=123_456, seq=2**40)
    data = encode_report(r)
    assert data == uv(2**40) + uv(8) + uv(4) + uv(2) + uv(123_457)
    assert len(data) == 6 + 1 + 1 + 1 + 3  # 12 bytes; the first layout took 126 for this one
    assert decode_report(data, A, MODEL) == r
    assert decode_report(data, B, "other").peer_id == B  # who and which group: the envelope's


def test_every_truncation_of_a_report_is_refused():
    data = encode_report(report(seq=2**40, latency_us=123_456))
    for cut in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode_report(data[:cut], A, MODEL)


def fields(seq=1, capacity=2, queued=0, in_service=0, latency=500_001) -> bytes:
    return uv(seq) + uv(capacity) + uv(queued) + uv(in_service) + uv(latency)


GOOD = fields()


@pytest.mark.parametrize(
    "data",
    [
        GOOD + b"\x00",
        b"x" * (MAX_REPORT_BYTES + 1),
        fields(capacity=0),
        fields(in_service=3),  # > capacity 2
        fields(queued=MAX_QUEUED + 1),
        fields(capacity=MAX_CAPACITY + 1),
        fields(latency=MAX_LATENCY_US + 2),  # latency + 1 over the limit
        b"\x81\x00" + GOOD[1:],  # seq 1 as two bytes: not the shortest form
        b"\xff" * 9 + b"\x02" + GOOD[1:],  # seq over 64 bits
    ],
    ids=["trailing byte", "oversized", "capacity 0", "in_service > capacity",
         "queued too large", "capacity too large", "latency too large", "varint not shortest",
         "varint over 64 bits"],
)
def test_malformed_report_is_refused(data):
    with pytest.raises(RemoteProtocolError):
        decode_report(data, A, MODEL)


def test_a_report_for_a_peer_or_model_out_of_limits_is_refused():
    with pytest.raises(RemoteProtocolError):
        decode_report(GOOD, b"", MODEL)
    with pytest.raises(RemoteProtocolError):
        decode_report(GOOD, A, "m" * 65)


@pytest.mark.parametrize(
    "fields",
    [
        {"peer_id": b""},
        {"peer_id": b"x" * (MAX_PEER_ID_BYTES + 1)},
        {"model": ""},
        {"model": "m" * 65},
        {"seq": -1},
        {"seq": 2**64},
        {"capacity": MAX_CAPACITY + 1},
        {"latency_us": -1},
    ],
)
def test_report_out_of_wire_limits_cannot_be_built(fields):
    kwargs = {"peer": A, "seq": 1, "capacity": 2, "latency_us": 1, "model": MODEL}
    kwargs.update({("peer" if k == "peer_id" else k): v for k, v in fields.items()})
    with pytest.raises(LocalProtocolError):
        report(**kwargs)


reports = st.builds(
    lambda peer, model, seq, capacity, queued, in_service, latency: LoadReport(
        peer, model, seq, capacity, queued, min(in_service, capacity), latency
    ),
    peer=st.binary(min_size=1, max_size=MAX_PEER_ID_BYTES),
    model=st.text(min_size=1, max_size=16),
    seq=st.integers(0, 2**64 - 1),
    capacity=st.integers(1, MAX_CAPACITY),
    queued=st.integers(0, MAX_QUEUED),
    in_service=st.integers(0, MAX_CAPACITY),
    latency=st.none() | st.integers(0, MAX_LATENCY_US),
)


@settings(max_examples=200, deadline=None)
@given(reports)
def test_any_report_roundtrips_through_its_bytes(r):
    data = encode_report(r)
    assert len(data) <= MAX_REPORT_BYTES
    assert decode_report(data, r.peer_id, r.model_id) == r


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=MAX_REPORT_BYTES + 8))
def test_arbitrary_bytes_decode_or_raise_remote_protocol_error(data):
    try:
        r = decode_report(data, A, MODEL)
    except RemoteProtocolError:
        return
    assert encode_report(r) == data


def test_the_longest_report_fits_max_report_bytes():
    r = report(seq=2**64 - 1, capacity=MAX_CAPACITY, queued=MAX_QUEUED,
               in_service=MAX_CAPACITY, latency_us=MAX_LATENCY_US)
    assert len(encode_report(r)) == MAX_REPORT_BYTES == 22


# ---------------------------------------------------------------------------------- when to send

C = 32
STEADY = report(capacity=C, queued=0, in_service=20, latency_us=4_000_000)


def sent_reporter(first=STEADY, heartbeat=2.0, deadband=0.125) -> LoadReporter:
    r = LoadReporter(heartbeat=heartbeat, deadband=deadband)
    assert r.check(first, 0.0)  # the first report is always sent
    return r


@pytest.mark.parametrize(
    ("change", "due"),
    [
        ({}, False),  # nothing changed
        ({"seq": 9}, False),  # seq is not looked at
        ({"in_service": 23}, False),  # 3 < 1/8 x 32 = 4 running slots
        ({"in_service": 17}, False),
        ({"in_service": 24}, True),  # 4 slots: the deadband
        ({"in_service": 16}, True),
        ({"in_service": 32}, True),  # no free slot any more
        ({"queued": 1}, True),  # any change of Q (F_LB's L x Q / C)
        ({"capacity": 40}, True),
        ({"latency_us": 6_000_000}, False),  # +50%: only the ledger reads L with a free slot
        ({"latency_us": 6_000_001}, True),  # more than half of it
        ({"latency_us": None}, True),
    ],
    ids=["same", "seq", "+3 running", "-3 running", "+4 running", "-4 running", "full",
         "one waiting", "capacity", "L +50% idle", "L past +50% idle", "L lost"],
)
def test_a_load_report_is_due_only_on_a_meaningful_change_inside_the_heartbeat(change, due):
    reporter = sent_reporter()
    now = replace_report(STEADY, **change)
    assert reporter.due(now, 1.0) is due


def replace_report(r: LoadReport, **change) -> LoadReport:
    fields = {"peer": r.peer_id, "seq": r.seq, "queued": r.queued, "in_service": r.in_service,
              "capacity": r.capacity, "latency_us": r.latency_us, "model": r.model_id}
    fields.update(change)
    return report(**fields)


def test_latency_moves_of_an_eighth_count_while_requests_wait():
    busy = replace_report(STEADY, queued=3)
    reporter = sent_reporter(busy)
    assert not reporter.due(replace_report(busy, latency_us=4_500_000), 1.0)  # +12.5%
    assert reporter.due(replace_report(busy, latency_us=4_500_001), 1.0)
    assert reporter.due(replace_report(busy, latency_us=3_499_999), 1.0)


def test_an_unchanged_load_is_sent_again_on_the_heartbeat_only():
    reporter = sent_reporter(heartbeat=2.0)
    assert not reporter.check(STEADY, 1.0)
    assert not reporter.check(STEADY, 1.999)
    assert reporter.check(STEADY, 2.0)  # heartbeat: 2 s after the last one sent
    assert not reporter.check(STEADY, 3.0)
    assert reporter.check(STEADY, 4.0)
    assert (reporter.sent_count, reporter.skipped) == (3, 3)


def test_a_change_sent_restarts_the_heartbeat_and_becomes_the_reference():
    reporter = sent_reporter()
    moved = replace_report(STEADY, in_service=26)
    assert reporter.check(moved, 1.0)
    assert not reporter.check(replace_report(STEADY, in_service=23), 2.0)  # 3 from 26
    assert not reporter.check(moved, 2.5)
    assert reporter.check(moved, 3.0)


def test_a_forwarded_request_taken_in_makes_the_next_report_due():
    # forwarders count their forwards against this node until its next report
    reporter = LoadReporter(heartbeat=2.0, deadband=0.125)
    assert reporter.check(STEADY, 0.0, taken_in=5)
    assert not reporter.due(STEADY, 1.0, taken_in=5)
    assert reporter.due(STEADY, 1.0, taken_in=6)
    assert reporter.check(STEADY, 1.0, taken_in=6)
    assert not reporter.due(STEADY, 2.0, taken_in=6)


def test_the_tracker_counts_requests_taken_in_not_those_it_routes():
    t = LoadTracker(capacity=2, max_queue=4)
    t.try_admit(routing=True)  # a user's request, routed by this node
    t.routed_here()
    assert t.taken_in == 0
    t.try_admit()  # another node's forward, straight into the queue
    assert t.taken_in == 1


def test_deadband_zero_sends_every_change():
    reporter = sent_reporter(deadband=0.0)
    assert reporter.due(replace_report(STEADY, in_service=21), 0.5)
    assert not reporter.due(STEADY, 0.5)


@pytest.mark.parametrize("kwargs", [{"heartbeat": 0.0, "deadband": 0.1},
                                    {"heartbeat": 1.0, "deadband": 1.5},
                                    {"heartbeat": 1.0, "deadband": -0.1}])
def test_a_reporter_out_of_range_is_refused(kwargs):
    with pytest.raises(ConfigError):
        LoadReporter(**kwargs)
