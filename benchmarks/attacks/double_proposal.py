"""Finding (issue 17, finding 5): evidence had no consequence, and double proposals none at all.

A validator that signs two different blocks as the proposer of one (height, round) is a proven
Byzantine validator, yet the committee recorded nothing (only conflicting *votes* became
EVIDENCE) and kept it in the proposer rotation, where every slot it holds is a round it may
stall or split.

Here: a :class:`~ps_p2p.testing.committee.MemoryCommittee` of ``--n`` validators (in memory, on
a fake clock). Once height 2 is committed, the current round's proposer signs ``--doubles``
pairs of conflicting proposals that reach another validator (each pair in its round, as
proposer of that round); then the committee runs ``--heights`` more heights. Printed: the
evidence entries committed against the equivocator, and the share of the later blocks it
proposed.

    python benchmarks/attacks/double_proposal.py [--n 4] [--heights 40]

Measured (defaults, 0.9 s; before = PYTHONPATH=/work/main at 0b84d11, after = branch
i17/evidence):
before, 0 evidence entries committed and the equivocator proposed 10 of 40 later blocks (25%);
after, 1 entry (PROPOSAL_EVIDENCE) and 0 of 40 (it still votes; removing it is a VALSET_UPDATE).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

from ps_p2p import registry as app
from ps_p2p.consensus.signing import sign_proposal
from ps_p2p.consensus.types import Proposal
from ps_p2p.consensus.types import Validator as Member
from ps_p2p.keys import Identity
from ps_p2p.testing.committee import MemoryCommittee


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--heights", type=int, default=40)
    args = parser.parse_args(argv)
    keys = [Identity.from_private_bytes(hashlib.sha256(b"dp %d" % i).digest())
            for i in range(args.n)]
    genesis = app.Genesis("double-proposal", 1_700_000_000_000,
                          tuple(Member(k.peer_id) for k in keys))
    net = MemoryCommittee(keys, genesis)
    assert net.run_until(lambda: all(v.committed_height >= 2 for v in net.vals))
    assert net.run_until(lambda: all(v.core.height == v.height and v.core.decision is None
                                     for v in net.vals))
    core = net.vals[0].core
    liar = next(i for i, k in enumerate(keys) if k.peer_id == core.proposer(core.height,
                                                                            core.round))
    seer = (liar + 1) % args.n
    h, r = net.vals[seer].core.height, net.vals[seer].core.round
    for value in (b"first block", b"second block"):
        p = sign_proposal(keys[liar], genesis.chain_id, Proposal(h, r, value, -1, b""))
        net.route(seer, net.vals[seer].receive(p, net.now))
    accused = keys[liar].peer_id
    # let the evidence (if any) reach a block, then count the next heights' proposers
    start = max(v.committed_height for v in net.vals) + 3
    assert net.run_until(lambda: all(v.committed_height >= start for v in net.vals), 60.0)
    end = start + args.heights
    ok = net.run_until(lambda: all(v.committed_height >= end for v in net.vals), 600.0)
    blocks = [c for c in net.committed[seer] if start < c.height <= end]
    by_liar = sum(1 for c in blocks if c.block.header.proposer == accused)
    evidence = sum(1 for who, _ in net.vals[seer].state.evidence.values() if who == accused)
    print(f"committee of {args.n}; equivocating proposer signed 2 blocks at height {h} round {r}")
    print(f"evidence entries committed against it: {evidence}")
    print(f"later blocks it proposed: {by_liar} of {len(blocks)} "
          f"({100 * by_liar / max(1, len(blocks)):.0f}%)" + ("" if ok else " (run cut short)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
