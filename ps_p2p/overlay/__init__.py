"""Pure cores of the anonymous overlay (PlanetServe sec. 3.2): events in, commands out, ``now``
passed in, no trio, libp2p or protobuf.

* :mod:`ps_p2p.overlay.relay` -- relay, proxy and path owner state machine (setup, cells, proxy
  payloads, reply tags, replies, teardown, expiry);
* :mod:`ps_p2p.overlay.relay_table` -- the relay table with bounded, indexed expiry;
* :mod:`ps_p2p.overlay.path_pool` -- a user's pool of paths (relay choice, probes, repair);
* :mod:`ps_p2p.overlay.requests` -- a user's requests (attempts, response cloves, audit);
* :mod:`ps_p2p.overlay.paths` -- relay choice; :mod:`ps_p2p.overlay.reassembly` -- clove
  reassembly; :mod:`ps_p2p.overlay.rtt` -- RFC 6298 timeouts.

Their services are in :mod:`ps_p2p.protocols` (wire) and :mod:`ps_p2p.roles` (assembly).
"""
