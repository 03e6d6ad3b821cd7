"""The verifier committee's Tendermint-style consensus (Buchman, Kwon, Milosevic, "The latest
gossip on BFT consensus"; PlanetServe sec. 3.4), pure cores driven by
:class:`ps_p2p.protocols.driver.CoreDriver` like the overlay. ``docs/consensus.md`` has the formats.

    types      messages, inputs and outputs of the consensus core
    encoding   strict reading of canonical byte strings
    signing    signing bytes of proposals and votes, sign/verify, verify_commit (quorum certificate)
    block      block header, canonical encoding, block ID, limits, validate_block
    app        the registry state machine: transactions, sybil admission policy, check_tx,
               execute_block (expiry by block time), app_hash, Mempool
    directory  the committed directory as paged deltas plus a commit; verify_directory (node side)
"""
