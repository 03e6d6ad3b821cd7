"""The verifier committee as 4 real ``ps-node run`` processes on 127.0.0.1 (issue 17, finding
1): kill two of four (SIGKILL: crash faults), restart one; the committee must commit again
within a bounded time. Before the fix it could stay stuck for good (a restarted validator saw
the round-0 proposal late and refused that value for the whole height, and never received the
2f+1 prevotes behind a re-proposal's POL round)."""

from __future__ import annotations

import time

import pytest

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
