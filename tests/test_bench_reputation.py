"""bench_reputation's own checks (issue 18): what its ``--localnet`` run counts as a request
served by a node the user had untrusted."""

from __future__ import annotations

import pathlib
import sys

from test_user_reputation import A, B, C, directory

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_reputation


def test_only_a_scored_node_below_the_threshold_counts_as_served_while_untrusted():
    d = directory(A, B, C, verified=True, A=0.39, B=0.4)
    assert bench_reputation.scored_untrusted(d, A.peer_id)
    assert not bench_reputation.scored_untrusted(d, B.peer_id)
    # C was never scored on a chain with challenge epochs: provisional, not untrusted
    assert d.provisional(C.peer_id) and not d.trusted(C.peer_id)
    assert not bench_reputation.scored_untrusted(d, C.peer_id)
