"""The verifier committee's Tendermint-style consensus (Buchman, Kwon, Milosevic, "The latest
gossip on BFT consensus", arXiv 1807.04938; PlanetServe sec. 3.4).

Pure cores (no I/O, clock or randomness; DESIGN.md "Layers"):

* :mod:`ps_p2p.consensus.types`: proposals, votes, the core's inputs and outputs;
* :mod:`ps_p2p.consensus.votes`: :class:`~ps_p2p.consensus.votes.VoteKeeper`, votes of one
  height counted by voting power into the thresholds of Algorithm 1 (2f+1 for a value, 2f+1
  of anything, f+1 of a higher round) and equivocation evidence;
* :mod:`ps_p2p.consensus.core`: :class:`~ps_p2p.consensus.core.ConsensusCore`, Algorithm 1's
  round state machine of one validator (``handle(input, now) -> outputs``); comments ``# Lnn``
  cite the line numbers of Algorithm 1 in the paper (11-21 StartRound, 22-54 the upon rules,
  55-56 round skipping, 57-67 the timeouts).

:mod:`ps_p2p.testing.consensus_sim` drives N = 3f+1 cores through a seeded faulty network with
Byzantine validators and checks agreement, validity, no double-signing and termination. The
driver that runs a core over libp2p (signing, WAL, timers) is
:class:`ps_p2p.protocols.driver.CoreDriver`'s job, as for the overlay.
"""
