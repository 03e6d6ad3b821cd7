"""A node's web page: the network as this node sees it, and a user's chat (node layer).

Served by any node with ``--web HOST:PORT`` (config key ``web``; off by default:
:func:`serve_web`), and on a user's local API port (:class:`~ps_p2p.api.openai_compat.UserAPI`)
under the same paths. Server-rendered Jinja2 templates (Starlette's ``Jinja2Templates``,
autoescaping on) with a few lines of plain JavaScript; no front-end build step.

Paths:

* ``GET /`` — a redirect to ``/web``.
* ``GET /web`` — the network view (HTML, refreshes itself every 10 s): the model groups (one per
  model ID) with their model nodes (organization, capacity, load, committed reputation, trusted /
  provisional / untrusted, lost), the committee (validators, connected or not, directory height,
  last commit time; for a verifier also its round, mempool and the equivocation evidence
  committed), the users listed and, on a user node, its ready paths.
* ``GET /web/network.json`` — the same data as JSON (:func:`network_view`).
* ``GET /web/chat`` — on a user's API port: a chat page that streams answers from the local
  ``POST /v1/chat/completions`` (``stream: true``, ``stream_options.include_usage``: the last
  chunk's ``planetserve`` member names the model node that signed the answer and whether its
  signature verified). Elsewhere 404: the chat needs the user's API, on its origin.

What is shown, and why it reveals nothing new (PlanetServe sec. 3.1-3.2: node records are public
to every node; the anonymity is that no node learns which user sent which prompt):

* model nodes and users come from the verified directory every node fetches (records signed
  by their nodes, committed by the committee with their reputations); of users only their
  number is shown, and no node's addresses;
* load comes from this node's own dispatcher (a model node) or its group's signed load reports
  (a model node with forwarding: gossip every group member receives); capacity is in the record;
* "lost" is this user's own observation (:meth:`~ps_p2p.roles.user.UserClient
  .reachable_model_nodes`); the committee's state is the verifier's own (``committee_status``)
  or, on other nodes, the genesis validators and whether this node is connected to them;
* a user's paths are shown as counts only (ready paths, distinct proxies): their relays would
  link this user's traffic to it for anyone who can reach the page, so they are never listed;
  no prompt, answer or request is ever kept or shown by the page itself.

The page is read-only and asks the network for nothing, but it is plain HTTP (hypercorn, no
limits of its own per client): bind ``--web`` to loopback, or put it behind a reverse proxy.

Every string from a peer's record (a model ID, an organization's name) is free text: the
templates autoescape it, JSON is embedded with ``tojson`` and the chat's script writes only
``textContent``, never HTML.
"""

from __future__ import annotations

import logging
import pathlib
import time
from typing import Any

import jinja2
import trio
from libp2p.peer.id import ID
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.templating import Jinja2Templates

log = logging.getLogger(__name__)

TEMPLATES = pathlib.Path(__file__).parent / "templates"
#: Seconds between the network page's own reloads.
REFRESH_S = 10

_templates = Jinja2Templates(env=jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True))


def _b58(peer: bytes) -> str:
    return ID(peer).to_base58()


def _load_of_self(node: Any) -> dict[str, Any] | None:
    model = getattr(node, "model", None)
    if model is None:
        return None
    load = model.load
    return {"in_service": load.in_service, "queued": load.queued, "capacity": load.capacity,
            "latency_ms": None if load.latency_ewma is None else round(load.latency_ewma * 1e3, 1),
            "source": "own"}


def _gossiped_loads(node: Any) -> dict[bytes, dict[str, Any]]:
    """The fresh signed load reports of this model node's group (empty for other nodes)."""
    forwarding = getattr(node, "forwarding", None)
    if forwarding is None:
        return {}
    out = {}
    for peer, load in forwarding.book.fresh_loads(trio.current_time()).items():
        out[peer] = {
            "in_service": load.reported_requests, "queued": None, "capacity": load.capacity,
            "latency_ms": None if load.latency_ewma is None else round(load.latency_ewma * 1e3, 1),
            "source": "gossip"}
    return out


def _trust(directory: Any, peer: bytes) -> str:
    if directory.trusted(peer):
        return "trusted"
    return "provisional" if directory.provisional(peer) else "untrusted"


def _committee(node: Any, directory: Any) -> dict[str, Any] | None:
    """The committee as this node knows it: a verifier's own consensus state, else the
    validators it trusts (the genesis's) and whether it is connected to them now."""
    status = node.committee_status() if hasattr(node, "committee_status") else None
    if status:
        return {
            "member": True, "chain_id": status["chain_id"], "height": status["height"],
            "round": status["round"], "step": status["step"],
            "committed_height": status["committed_height"],
            "last_commit_time_ms": status["last_commit_time_ms"],
            "validators": status["validators"], "mempool": status["mempool"],
            "evidence": status["evidence"], "equivocators": status["equivocators"],
        }
    trusted = getattr(node, "trusted_verifiers", None)
    if trusted is None:
        return None
    host = getattr(node, "host", None)
    validators = []
    for peer in sorted(trusted):
        connected = False
        if host is not None:
            from ps_p2p.protocols.host import is_connected

            connected = is_connected(host, peer)
        validators.append({"peer_id": _b58(peer), "power": None, "excluded": False,
                           "connected": connected})
    return {
        "member": False, "chain_id": None,
        "committed_height": None if directory is None else directory.height,
        "last_commit_time_ms": None if directory is None else directory.issued_at_ms,
        "validators": validators, "evidence": None, "equivocators": [],
    }


def network_view(node: Any) -> dict[str, Any]:
    """What ``node`` knows of the network now, as JSON-ready data (``/web/network.json``).

    Args:
        node: a running :class:`~ps_p2p.node.Node` (or anything with its ``keys``, ``config``,
            ``directory``, ``user`` and optionally ``model``, ``forwarding``,
            ``committee_status()``, ``trusted_verifiers``, ``host``). Call on its trio thread.

    Returns:
        ``{"node": {peer_id, roles, health}, "directory": None | {height, issued_at_ms,
        expires_at_ms, verified, untrusted_below}, "models": [{"model_id", "nodes": [{"peer_id",
        "organization", "capacity", "reputation" (None: never scored), "trust" ("trusted",
        "provisional" or "untrusted"), "load" (None or {in_service, queued, capacity,
        latency_ms, source: "own" | "gossip"}), "lost", "self"}]}], "committee": None | {...},
        "users": {"listed", "ready_paths", "distinct_proxies", "paths_needed"}}``; times are
        unix milliseconds. See the module docstring for why none of it is new to anyone.
    """
    from ps_p2p.health import node_health

    directory = node.directory
    user = node.user
    me = node.keys.identity.peer_id
    loads = _gossiped_loads(node)
    own_load = _load_of_self(node)
    if own_load is not None:
        loads[me] = own_load
    lost: set[bytes] = set()
    if user is not None and directory is not None:  # listed for this user, found lost by it
        reachable = {r.peer_id for r in user.reachable_model_nodes()}
        lost = {r.peer_id for r in user.model_nodes()} - reachable
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in directory.model_nodes() if directory is not None else ():
        trust = _trust(directory, record.peer_id)
        groups.setdefault(record.model_id, []).append({
            "peer_id": _b58(record.peer_id),
            "organization": record.organization,
            "capacity": record.capacity,
            "reputation": directory.reputation(record.peer_id),
            "trust": trust,
            "load": loads.get(record.peer_id),
            "lost": record.peer_id in lost,
            "self": record.peer_id == me,
        })
    paths = user.ready_paths() if user is not None else None
    return {
        "node": {"peer_id": node.keys.identity.peer_id_str, "roles": list(node.config.roles),
                 "health": node_health(node).as_json()},
        "directory": None if directory is None else {
            "height": directory.height, "issued_at_ms": directory.issued_at_ms,
            "expires_at_ms": directory.expires_at_ms, "verified": directory.verified,
            "untrusted_below": directory.untrusted_below},
        "models": [{"model_id": m, "nodes": nodes} for m, nodes in sorted(groups.items())],
        "committee": _committee(node, directory),
        "users": {
            "listed": None if directory is None else len(directory.users()),
            "ready_paths": None if paths is None else len(paths),
            "distinct_proxies": None if paths is None else len({p.relays[-1] for p in paths}),
            "paths_needed": None if user is None else node.config.user.total,
        },
    }


def _ms_to_text(ms: int | None) -> str:
    if not ms:
        return "—"
    ago = time.time() - ms / 1000
    stamp = time.strftime("%H:%M:%S", time.gmtime(ms / 1000))
    return f"{stamp} UTC ({ago:.0f} s ago)" if ago >= 0 else f"{stamp} UTC"


_templates.env.filters["when"] = _ms_to_text
_templates.env.filters["short"] = lambda peer_id: "…" + str(peer_id)[-8:]


def web_routes(node: Any, *, chat: bool) -> list[BaseRoute]:
    """The page's routes over ``node`` (see the module docstring); ``chat``: serve
    ``/web/chat`` (only where ``POST /v1/chat/completions`` is on the same origin)."""

    async def index(request: Request) -> Response:
        return RedirectResponse("/web", status_code=307)

    async def network_page(request: Request) -> Response:
        view = network_view(node)
        return _templates.TemplateResponse(request, "network.html", {
            "view": view, "refresh_s": REFRESH_S, "chat": chat and node.user is not None})

    async def network_json(request: Request) -> Response:
        return JSONResponse(network_view(node))

    async def chat_page(request: Request) -> Response:
        if not chat or node.user is None:
            return Response("the chat is served on a user node's API port (--api)\n",
                            status_code=404, media_type="text/plain")
        models = sorted({r.model_id for r in node.user.reachable_model_nodes()})
        return _templates.TemplateResponse(request, "chat.html", {
            "models": models, "peer_id": node.keys.identity.peer_id_str})

    return [
        Route("/", index, methods=["GET"]),
        Route("/web", network_page, methods=["GET"]),
        Route("/web/network.json", network_json, methods=["GET"]),
        Route("/web/chat", chat_page, methods=["GET"]),
    ]


def web_app(node: Any) -> Starlette:
    """The page alone (no API), as ``--web`` serves it."""
    return Starlette(routes=web_routes(node, chat=False))


async def serve_web(
    node: Any, bind: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve :func:`web_app` on ``bind`` ("127.0.0.1:0" picks a port) until cancelled;
    ``task_status.started(url)`` with the base URL bound.

    Raises:
        ConfigError: ``bind`` is not HOST:PORT.
        AddressInUseError: ``"--web <bind> is already in use"``.
    """
    from ps_p2p.api.asgi import serve_asgi

    await serve_asgi(web_app(node), bind, "--web", "web page on %s/web", task_status=task_status)


__all__ = ["network_view", "serve_web", "web_app", "web_routes"]
