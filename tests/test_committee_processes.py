"""The verifier committee as 4 real ``ps-node run`` processes on 127.0.0.1 (issue 17).

Finding 1: kill two of four (SIGKILL: crash faults), restart one; the committee must commit
again within a bounded time. Before the fix it could stay stuck for good (a restarted validator
saw the round-0 proposal late and refused that value for the whole height, and never received
the 2f+1 prevotes behind a re-proposal's POL round).

Finding 2: one validator equivocating (the TEST ONLY ``byzantine`` flag, from its config) and
the link between two correct validators delayed 4.5 s each way (the TEST ONLY faults of
:mod:`ps_p2p.testing.faults`): all four are up, and the committee must keep committing."""

from __future__ import annotations

import time

import pytest

from ps_p2p.testing.faults import LinkRule
from ps_p2p.testing.processes import make_testnet, wait_committed

#: Seconds the committee has to commit again after the restart (target of issue 17: 20 s;
#: loopback, default CometBFT timeouts, a loaded 2-core machine: some slack).
RECOVERY_BOUND_S = 40.0


@pytest.mark.slow
def test_kill_two_of_four_verifier_processes_restart_one_and_the_committee_commits_again(
        tmp_path):
    verifiers = make_testnet(tmp_path / "net", 4)
    try:
        for v in verifiers:
            v.start()
        wait_committed(verifiers, 2, 60)
        verifiers[3].kill()
        verifiers[2].kill()
        survivors = verifiers[:2]
        stuck_at = max(v.committed() for v in survivors)
        time.sleep(12)  # the two survivors go through rounds without a quorum (locks possible)
        verifiers[2].start()
        running = verifiers[:3]
        took = wait_committed(running, stuck_at + 1, RECOVERY_BOUND_S)
        print(f"kill two, restart one: height {stuck_at + 1} committed {took:.1f} s after "
              "the restart")
    finally:
        for v in verifiers:
            v.stop()


def _wait_logged(v, text: str, timeout: float) -> None:
    start = time.monotonic()
    while text not in v.log_path.read_text(errors="replace"):
        assert time.monotonic() - start < timeout, v.log_tail()
        time.sleep(0.1)  # waiting on a file another process writes


@pytest.mark.slow
def test_one_equivocating_validator_and_one_delayed_link_the_committee_keeps_committing(
        tmp_path):
    verifiers = make_testnet(tmp_path / "net", 4, faults=True, block_interval=1.0)
    byzantine, left, right, _ = verifiers
    byzantine.configure(byzantine=True)
    try:
        for v in verifiers:
            v.start()
        wait_committed(verifiers, 2, 60)
        left.set_faults({right.peer_id: LinkRule(4.5)})  # 4.5 s each way, both correct
        _wait_logged(left, "delay 4.5 s", 10)  # in force (the node re-read its file)
        delayed_at = max(v.committed() for v in verifiers)
        took = wait_committed(verifiers[3:], delayed_at + 5, RECOVERY_BOUND_S)
        print(f"equivocator + 4.5 s link: 5 heights committed in {took:.1f} s")
        assert "BYZANTINE" in byzantine.log_path.read_text()  # it did equivocate
        left.set_faults()
        lifted_at = max(v.committed() for v in verifiers)
        took = wait_committed(verifiers, lifted_at + 1, RECOVERY_BOUND_S)
        print(f"delay lifted: all four at height {lifted_at + 1} {took:.1f} s later")
    finally:
        for v in verifiers:
            v.stop()
