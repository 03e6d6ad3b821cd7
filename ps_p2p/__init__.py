"""ps_p2p: PlanetServe, a decentralized privacy-preserving overlay for serving LLMs, on py-libp2p.

Layers (imports only point down):

1. cores (pure, sans-I/O): :mod:`ps_p2p.crypto`, :mod:`ps_p2p.overlay`, :mod:`ps_p2p.records`,
   :mod:`ps_p2p.gossip.load`;
2. services (trio + libp2p adapters): :mod:`ps_p2p.protocols`;
3. node and CLI: :mod:`ps_p2p.node`, :mod:`ps_p2p.cli`.
"""

__version__ = "0.1.0"
