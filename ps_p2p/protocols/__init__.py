"""Services: trio + py-libp2p adapters, one module per protocol (DESIGN.md "Layers", "Wire").

* :mod:`~ps_p2p.protocols.host` -- hosts (TCP + Noise + Yamux only, connection limits);
* :mod:`~ps_p2p.protocols.framing`, :mod:`~ps_p2p.protocols.links` -- varint frames, one-way
  message links with bounded queues, guarded stream handlers;
* :mod:`~ps_p2p.protocols.handlers` -- a service's stream handlers, registered and removed
  together (so a service can leave a host that another application owns);
* :mod:`~ps_p2p.protocols.driver` -- the one generic driver that owns a pure core;
* :mod:`~ps_p2p.protocols.onion_setup`, :mod:`~ps_p2p.protocols.clove_relay`,
  :mod:`~ps_p2p.protocols.delivery` -- the overlay's three protocols, composed by
  :mod:`~ps_p2p.protocols.overlay`;
* :mod:`~ps_p2p.protocols.committee_directory` -- registration with the verifier committee and
  its committed directory in pages;
* :mod:`~ps_p2p.protocols.consensus` -- a verifier's consensus among the committee (with
  :mod:`~ps_p2p.protocols.consensus_codec` and :mod:`~ps_p2p.protocols.blocksync`);
* :mod:`~ps_p2p.protocols.inference_codec`, :mod:`~ps_p2p.protocols.clove_codec`,
  :mod:`~ps_p2p.protocols.record_codec` -- protobuf conversion of Q, the response, cloves and
  node records.

A stream handler only decodes a frame (a frame that does not parse resets that one stream) and
hands the input to the task that owns the core; nothing a peer sends can stop a node.
"""
