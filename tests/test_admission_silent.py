"""Departed nodes stop locking their network out (issue 20 sec. 4): a listed record that was
not renewed for ``silent_after_ms`` no longer counts toward the per-network cap, and its own
renewal must fit the cap again (so renewing records never exceed it: the issue-16 bound)."""

from __future__ import annotations

import pytest

from ps_p2p import registry as app
from ps_p2p.errors import AdmissionError
from tests.test_consensus_app import GENESIS, SECOND, T0, A, B, C, D, record, reg, run

NET = "ip4:10.0.1.0/24"
SILENT = GENESIS.policy.silent_after_ms


@pytest.fixture
def full():
    """A and B listed in 10.0.1.0/24 (the cap is 2), both issued at T0."""
    state, result, _ = run(app.genesis_state(GENESIS),
                           [reg(record(A, net=1, host=1)), reg(record(B, net=1, host=2))])
    assert [r.ok for r in result.tx_results] == [True, True]
    return state


@pytest.mark.parametrize(
    "b_renewed_at, c_admitted",
    [
        (None, True),  # B departed without a word: silent once SILENT passed
        (T0 + SILENT // 2, False),  # B renews: it still counts, the network is full
    ],
    ids=["departed", "renewing"],
)
def test_a_silent_record_stops_counting_toward_the_network_cap(full, b_renewed_at, c_admitted):
    state = full
    a_renewed = T0 + SILENT // 2
    txs = [reg(record(A, net=1, host=1, issued=a_renewed))]
    if b_renewed_at is not None:
        txs.append(reg(record(B, net=1, host=2, issued=b_renewed_at)))
    state, _, _ = run(state, txs, a_renewed + SECOND)
    state, _, _ = run(state, [], T0 + SILENT + SECOND)  # A renewed at SILENT/2: still live
    late = T0 + SILENT + 2 * SECOND
    newcomer = reg(record(C, net=1, host=3, issued=late))
    if c_admitted:
        app.check_tx(newcomer, state, late)
        state, result, _ = run(state, [newcomer], late + SECOND)
        assert result.tx_results[0].ok and C.peer_id in state.records
        assert B.peer_id in state.records  # listed until it expires, only no longer counted
    else:
        with pytest.raises(AdmissionError, match="admission cap"):
            app.check_tx(newcomer, state, late)


def test_a_silent_records_renewal_must_fit_the_cap_again(full):
    state, _, _ = run(full, [reg(record(A, net=1, host=1, issued=T0 + SILENT // 2))],
                      T0 + SILENT // 2 + SECOND)
    state, _, _ = run(state, [], T0 + SILENT + SECOND)  # rules see the last block's time
    late = T0 + SILENT + 2 * SECOND
    state, result, _ = run(state, [reg(record(C, net=1, host=3, issued=late))], late)
    assert result.tx_results[0].ok  # B is silent: C took its place
    # B wakes up (a thawed laptop): A and C renew, so the network is full for it
    with pytest.raises(AdmissionError, match="admission cap"):
        app.check_tx(reg(record(B, net=1, host=2, issued=late + SECOND)), state, late + SECOND)
    # another network is fine: the cap is per network
    app.check_tx(reg(record(B, net=2, host=2, issued=late + SECOND)), state, late + SECOND)


def test_the_mempool_room_check_counts_only_live_records(full):
    state, _, _ = run(full, [reg(record(A, net=1, host=1, issued=T0 + SILENT // 2))],
                      T0 + SILENT // 2 + SECOND)
    state, _, _ = run(state, [], T0 + SILENT + SECOND)
    pool = app.Mempool()
    late = T0 + SILENT + 2 * SECOND
    pool.add(reg(record(C, net=1, host=3, issued=late)), state, late)
    with pytest.raises(AdmissionError, match="admission cap"):  # C pending takes B's place
        pool.add(reg(record(D, net=1, host=4, issued=late)), state, late)
