"""The verifier committee's Tendermint-style consensus (Buchman, Kwon, Milosevic, "The latest
gossip on BFT consensus"; PlanetServe sec. 3.4). Not built yet: the issue "The verifier
committee" fills this package with a pure state machine, vote keeper and application, driven by
:class:`ps_p2p.protocols.driver.CoreDriver` like the overlay."""
