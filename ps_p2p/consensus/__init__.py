"""The verifier committee's Tendermint-style consensus (Buchman, Kwon, Milosevic, "The latest
gossip on BFT consensus", arXiv 1807.04938; PlanetServe sec. 3.4). ``docs/consensus.md`` has the
formats and the design.

Pure cores (no I/O, clock or randomness; DESIGN.md "Layers"):

    types      proposals, votes, the core's inputs and outputs
    votes      VoteKeeper: votes of one height counted by voting power into the thresholds of
               Algorithm 1 (2f+1 for a value, 2f+1 of anything, f+1 of a higher round) and
               equivocation evidence
    core       ConsensusCore: Algorithm 1's round state machine of one validator
               (``handle(input, now) -> outputs``); ``# Lnn`` comments cite the paper's lines
               (11-21 StartRound, 22-54 the upon rules, 55-56 round skipping, 57-67 timeouts)
    encoding   strict reading of canonical byte strings
    signing    signing bytes of proposals and votes, sign/verify, verify_commit (quorum certificate)
    block      block header, canonical encoding, block ID, limits, validate_block,
               check_timely (a fresh proposal's time on arrival; L22 only)
    gossip     Gossip: per-peer views (what a peer has, where it is) and what to send it:
               own messages once, relays, POL certificates, the last commit

Durable state: ``store`` (sqlite3: the write-ahead log of own signed messages, the block store).
The engine knows nothing of PlanetServe: it orders opaque values (blocks of transactions) and
never imports the application. The registry application (transactions, state, execution,
mempool, the directory and a node's replica of it) and ``Validator``, the glue that joins this
engine's core with it, live above, in :mod:`ps_p2p.registry`.
Wire: ``ps_p2p.protocols.consensus_codec`` and ``ps_p2p.protocols.blocksync``; the service that
runs a validator among real hosts is ``ps_p2p.protocols.consensus``; nodes register and fetch
the committed directory over ``ps_p2p.protocols.committee_directory``
(``/planetserve/directory/2.0.0``), through ``ps_p2p.directory_client``.
:mod:`ps_p2p.testing.consensus_sim` drives N = 3f+1 cores through a seeded faulty network with
Byzantine validators and checks agreement, validity, no double-signing and termination;
:mod:`ps_p2p.testing.committee` runs a committee of services on loopback.
"""
