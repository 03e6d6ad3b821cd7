"""ps_p2p: PlanetServe, a decentralized privacy-preserving overlay for serving LLMs, on py-libp2p.

Layers (imports only point down):

1. cores (pure, sans-I/O): :mod:`ps_p2p.crypto`, :mod:`ps_p2p.overlay`, :mod:`ps_p2p.records`,
   :mod:`ps_p2p.gossip.load`;
2. services (trio + libp2p adapters): :mod:`ps_p2p.protocols`;
3. node and CLI: :mod:`ps_p2p.node`, :mod:`ps_p2p.cli`.

``ps_p2p.Node``, ``ps_p2p.NodeConfig`` and ``ps_p2p.attach`` (run a role on a py-libp2p host of
another application, docs/embedding.md) are imported on first use, so that importing a core
(``ps_p2p.crypto``...) never loads trio or py-libp2p.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {"Node": "ps_p2p.node", "attach": "ps_p2p.node", "NodeConfig": "ps_p2p.config"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ps_p2p' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["Node", "NodeConfig", "attach"]
