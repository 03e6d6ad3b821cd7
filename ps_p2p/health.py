"""Whether a node can serve its roles now, and if not why (node layer; DESIGN.md "Layers").

One answer for every place that reports it: ``GET /health`` on a user's API port (200 or 503,
as vLLM's ``/health``: what load balancers and container probes expect), the node's
``status.json`` and so ``ps-node status``. It reads only what the node already holds (its
verified directory, its path pool, its dispatcher, its consensus), nothing it would have to ask
the network for.

A node is healthy when, for each of its roles:

* any role: it holds a verified directory;
* user: a trusted model node it has not found lost is listed
  (:meth:`~ps_p2p.roles.user.UserClient.reachable_model_nodes`), and its ready paths reach n
  distinct proxies (a request's n cloves go to n distinct proxies: PlanetServe sec. 3.2), so a
  request goes out at once;
* model node: it is not draining, and the directory lists its record (users can find it);
* verifier of a committee: at least 2f+1 of its N = 3f+1 validators are connected (itself
  included), the quorum a block needs (Tendermint; docs/consensus.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Health:
    """A node's health now.

    Attributes:
        ok: every role can serve.
        reasons: for each role that cannot, one sentence for an operator; empty when ok.
    """

    ok: bool
    reasons: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        """``{"ok": bool, "reasons": [str, ...]}`` (``/health``'s body, ``status.json``)."""
        return {"ok": self.ok, "reasons": list(self.reasons)}


def node_health(node: Any) -> Health:
    """The health of ``node`` (a :class:`~ps_p2p.node.Node`, or anything with its
    ``directory``, ``user``, ``config``, and optionally ``model``, ``peer_id`` and
    ``committee_status()``). Call it on the node's trio thread."""
    reasons: list[str] = []
    directory = node.directory
    if directory is None:
        reasons.append("no verified directory yet")
    user = node.user
    if user is not None and directory is not None:
        if not user.reachable_model_nodes():
            reasons.append("no reachable model node in the directory")
        proxies = {p.relays[-1] for p in user.ready_paths()}
        need = node.config.user.total
        if len(proxies) < need:
            reasons.append(f"ready paths reach {len(proxies)} distinct proxies; a request "
                           f"needs {need}")
    model = getattr(node, "model", None)
    if model is not None:
        if model.dispatcher.draining:
            reasons.append("draining: new requests are refused")
        elif directory is not None and directory.record(node.peer_id) is None:
            reasons.append("this model node is not in the verified directory yet")
    committee = node.committee_status() if hasattr(node, "committee_status") else None
    if committee:
        n = len(committee["validators"])
        up = sum(1 for v in committee["validators"] if v["connected"])
        quorum = n - (n - 1) // 3  # 2f+1 of 3f+1
        if up < quorum:
            reasons.append(f"{up} of {n} validators connected; a block needs {quorum}")
    return Health(not reasons, tuple(reasons))


__all__ = ["Health", "node_health"]
