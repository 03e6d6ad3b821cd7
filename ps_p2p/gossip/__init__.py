"""Model-group state shared by gossip (PlanetServe sec. 3.3), pure cores: today the load factor
F_LB (:mod:`ps_p2p.gossip.load`); the issue "Overlay forwarding" adds the HR-tree, the Sentry and
their GossipSub delta sync."""
