"""Model-group state shared by gossip (PlanetServe sec. 3.3), pure cores: the load factor F_LB
(:mod:`ps_p2p.gossip.load`); the HR-tree of the group's KV caches with its keyed, chained chunk
hashes and per-peer delta/snapshot replication (:mod:`ps_p2p.gossip.hr_tree`); the Sentry that
sets the chunk-length array L (:mod:`ps_p2p.gossip.sentry`, Appendix A3); and a node's own
subtree kept from its engine's KV-cache events (:mod:`ps_p2p.gossip.cache_view`). The GossipSub
service that carries deltas, snapshots and load comes with the issue "Overlay forwarding"."""
