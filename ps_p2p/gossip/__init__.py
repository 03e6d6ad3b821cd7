"""Model-group state shared by gossip (PlanetServe sec. 3.3), pure cores: the load factor F_LB
and the group's load reports (:mod:`ps_p2p.gossip.load`); the HR-tree of the group's KV caches
with its keyed, chained chunk hashes and per-peer delta/snapshot replication
(:mod:`ps_p2p.gossip.hr_tree`); the Sentry that sets the chunk-length array L
(:mod:`ps_p2p.gossip.sentry`, Appendix A3); a node's own subtree kept from its engine's KV-cache
events (:mod:`ps_p2p.gossip.cache_view`); the forwarding decision, Algorithm 2
(:mod:`ps_p2p.gossip.forwarding`); and the budgets of what a member may make a node do per second
(:mod:`ps_p2p.gossip.budget`). The service that gossips them over GossipSub is
:mod:`ps_p2p.roles.forwarding` (wire: :mod:`ps_p2p.protocols.hrtree_gossip`)."""
