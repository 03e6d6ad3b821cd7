"""Model-group state shared by gossip (PlanetServe sec. 3.3), pure cores: the load factor F_LB,
the load reports of the group's peers (:mod:`ps_p2p.gossip.load`) and the forwarding decision
that uses them (:mod:`ps_p2p.gossip.forwarding`); the issue "Overlay forwarding" adds the
HR-tree, the Sentry and their GossipSub delta sync."""
