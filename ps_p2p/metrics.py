"""Prometheus metrics and the status log line of one node (DESIGN.md "Layers": node and CLI).

Every :class:`~ps_p2p.node.Node` has its own :class:`NodeMetrics`, with its own
``CollectorRegistry``: several nodes may run in one process (``ps-node devnet
--nodes-per-process``), so prometheus-client's global default registry is never used. The
registry holds

* a :class:`NodeCollector`, which reads, at scrape time, the counters the node's cores and
  services keep anyway (``RelayStats``, ``LinkStats``, ``PoolStats``, the dispatcher's, the
  drivers'...). They belong to the node's trio thread, while a scrape arrives on a thread of the
  HTTP server; so the collector takes its whole reading on the trio thread
  (``trio.from_thread.run_sync``): one consistent reading, and nothing of the node is touched
  from another thread;
* the user's request histograms, observed on the trio thread when ``UserClient.ask`` ends
  (:meth:`NodeMetrics.observe_request`): prometheus-client's histograms lock for the scraping
  thread themselves.

:meth:`NodeMetrics.serve` serves the registry with prometheus-client's own HTTP server helper
(``start_http_server``: a daemon thread; ``GET /metrics``, the text exposition format).

Metrics (counters only grow from the node's start; gauges are read at scrape time; a metric of a
role the node does not have is absent):

==========================================================  ======================================
name {labels}                                               meaning
==========================================================  ======================================
every node
``planetserve_node_info{peer_id, roles}``                   1; who this is
``planetserve_directory_height``                            height of the verified directory held
``planetserve_directory_records``                           records in it
``planetserve_directory_nodes{role}``                       its records by role (a record may
                                                            have several roles)
``planetserve_directory_expiry_timestamp_seconds``          unix time the held directory expires
user and model nodes (the overlay)
``planetserve_relay_paths``                                 paths this node relays or proxies
                                                            now (relay table entries)
``planetserve_reply_tags``                                  live reply tags (as proxy)
``planetserve_relay_setups_total{outcome}``                 setups as relay or proxy: accepted,
                                                            failed, replayed
``planetserve_cells_relayed_total``                         cells passed on or opened as proxy
``planetserve_cells_dropped_total{reason}``                 unknown_path, bad_cell,
                                                            unknown_reply_tag, bad_reply_signature
``planetserve_cloves_proxied_total``                        request cloves passed to a model node
``planetserve_deliveries_total``                            request cloves accepted from proxies
``planetserve_deliveries_refused_total{reason}``            no_model_node, not_serving, not_user
``planetserve_response_cloves_sent_total``                  response cloves sent (model node)
``planetserve_paths_lost_to_link_down_total``               relayed and own paths torn down with
                                                            a lost connection
``planetserve_link_frames_sent_total{protocol}``            frames written (onion, clove, deliver)
``planetserve_link_frames_dropped_total{protocol,reason}``  queue_full, backoff (peer in dial
                                                            back-off)
``planetserve_links_opened_total{protocol}``                outbound streams opened
``planetserve_links_failed_total{protocol}``                outbound streams that failed
``planetserve_driver_inputs_dropped_total{driver}``         inputs dropped on a full inbox
                                                            (overlay, user, model)
``planetserve_driver_inputs_failed_total{driver}``          inputs or commands that raised
user nodes
``planetserve_paths{state}``                                own paths: ready (confirmed, in use),
                                                            unconfirmed, retiring, setting_up
``planetserve_paths_target``                                paths kept (N)
``planetserve_paths_built_total``                           path setups acknowledged
``planetserve_path_setups_failed_total``                    path setups that failed
``planetserve_paths_lost_total{reason}``                    ready paths lost: down,
                                                            probe_timeout, bad_proxy
``planetserve_paths_repaired_total``                        lost paths replaced by a ready one
``planetserve_paths_rotated_total``                         paths closed after rotation
``planetserve_probe_timeout_seconds``                       current probe deadline (RFC 6298 RTO)
``planetserve_proxies_avoided``                             proxies convicted, still avoided
``planetserve_requests_total{outcome}``                     asks ended: ok, timeout, no_path,
                                                            no_model_node, model_node_lost,
                                                            overloaded, refused, model_error,
                                                            too_large, error, cancelled
``planetserve_requests_in_flight``                          requests the request core holds
``planetserve_request_duration_seconds{outcome}``           histogram: time an ask took
``planetserve_time_to_first_token_seconds``                 histogram, ok asks: see below
``planetserve_response_cloves_misrouted_total``             response cloves dropped unblamed
model nodes
``planetserve_engine_queue_depth``                          requests admitted, waiting for a slot
``planetserve_engine_requests_running``                     requests on the engine now
``planetserve_engine_capacity``                             requests served at once (C)
``planetserve_engine_jobs_total``                           engine jobs finished
``planetserve_engine_latency_ewma_seconds``                 service time EWMA (L of F_LB)
``planetserve_load_factor``                                 F_LB = L * (Q / C)
``planetserve_model_requests_total{outcome}``               requests decoded: admitted, cached,
                                                            joined, overloaded, invalid, dropped;
                                                            expired (never complete)
``planetserve_request_cloves_dropped_total{reason}``        malformed, low_threshold,
                                                            duplicate_proxy, proxy_share
``planetserve_answers_sent_total{status}``                  signed answers sent, by status (ok,
                                                            overloaded, engine_error...)
verifiers (committee members)
``planetserve_consensus_height``                            last committed height
``planetserve_consensus_round``                             round of the height being decided
``planetserve_consensus_validators``                        validators in the genesis
``planetserve_consensus_validators_connected``              other validators connected now
``planetserve_registry_records``                            records in the committed registry
``planetserve_mempool_txs``                                 transactions waiting for a block
``planetserve_consensus_evidence``                          equivocation evidence committed
``planetserve_consensus_heights_total``                     heights committed by this validator
``planetserve_consensus_blocks_synced_total``               blocks applied from block sync
``planetserve_consensus_signed_total{kind}``                proposals and votes signed
``planetserve_consensus_double_sign_refused_total``         signatures refused (double sign)
``planetserve_consensus_values_refused_total``              proposed values refused as invalid
``planetserve_consensus_messages_refused_total{reason}``    peers' messages refused, by reason
==========================================================  ======================================

Time to first token: ``planetserve_time_to_first_token_seconds`` observes, per answered request,
the time to its first piece of text when it was streamed through the overlay, else the time to
the whole (verified) answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from ps_p2p.config import parse_host_port
from ps_p2p.protocols.host import is_connected
from ps_p2p.records import Role
from ps_p2p.records import short_peer_id as _short

if TYPE_CHECKING:
    from ps_p2p.node import Node

log = logging.getLogger(__name__)

#: Histogram buckets of request latencies (seconds): an answer through an idle loopback
#: overlay takes ~10 ms, a long generation up to the 120 s request deadline.
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"),
)
#: Outcome labels every user node exports from the start (0 until one happens), so that
#: ``rate()`` and alerts see the series before the first failure.
BASE_OUTCOMES = ("ok", "timeout", "no_path")
#: Protocol labels of the overlay's link managers.
_LINKS = ("onion", "clove", "deliver")


class NodeCollector:
    """Reads one node's counters at scrape time (see the module docstring).

    Args:
        node: the node (any object with the attributes of :class:`~ps_p2p.node.Node`).
        trio_token: returns the token of the node's trio run (None while it is not running:
            the reading is then taken on the calling thread).
    """

    def __init__(self, node: Node, trio_token: Any) -> None:
        self._node = node
        self._trio_token = trio_token

    def collect(self) -> Iterable[Metric]:
        """The node's metric families, read on its trio thread."""
        token = self._trio_token()
        if token is None or _on_trio_thread(token):
            return self.read()
        try:
            return trio.from_thread.run_sync(self.read, trio_token=token)
        except trio.RunFinishedError:  # the node stopped: nothing else touches it now
            return self.read()

    def describe(self) -> Iterable[Metric]:
        """Nothing: the families depend on the roles (the registry skips the name check)."""
        return []

    # ------------------------------------------------------------------ the reading

    def read(self) -> list[Metric]:
        """Build every family from the node's counters now (on the trio thread)."""
        node = self._node
        out: list[Metric] = []
        info = InfoMetricFamily("planetserve_node", "This node: peer ID and roles.")
        info.add_metric([], {
            "peer_id": node.keys.identity.peer_id_str,
            "roles": ",".join(node.config.roles),
        })
        out.append(info)
        out += _directory_families(node.directory)
        if node.overlay is not None:
            out += _overlay_families(node.overlay)
        drivers = [
            (name, service.driver)
            for name, service in (("overlay", node.overlay), ("user", node.user),
                                  ("model", node.model))
            if service is not None
        ]
        if drivers:
            out.append(_counter("planetserve_driver_inputs_dropped",
                                "Inputs a core's driver dropped on a full inbox.",
                                ["driver"], {(n,): d.dropped for n, d in drivers}))
            out.append(_counter("planetserve_driver_inputs_failed",
                                "Inputs or commands of a core's driver that raised (logged).",
                                ["driver"], {(n,): d.failed for n, d in drivers}))
        if node.user is not None:
            out += _user_families(node.user)
        if node.model is not None:
            out += _model_families(node.model)
        consensus = getattr(node, "consensus", None)
        if consensus is not None:
            out += _committee_families(node, consensus)
        return out


class NodeMetrics:
    """The metrics of one node: its registry, collector and request histograms, and the HTTP
    server of ``/metrics`` when served.

    Args:
        node: the node (its attributes are read at scrape time).

    Attributes:
        registry: this node's ``CollectorRegistry`` (serve it elsewhere if you embed the node).
        url: ``http://HOST:PORT/metrics`` once :meth:`serve` bound it, else None.

    A scrape waits for the node's trio thread to take the reading: never scrape the node with
    a blocking call *on* that thread (it would wait for itself); ``generate_latest(registry)``
    there is fine (it reads directly).
    """

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._trio_token: Any = None
        self.registry.register(NodeCollector(node, lambda: self._trio_token))
        # only a user node asks: the request histograms are registered with that role only
        registry = self.registry if "user" in node.config.roles else None
        self.request_duration = Histogram(
            "planetserve_request_duration_seconds",
            "Time an anonymous request (UserClient.ask) took, by outcome.",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.time_to_first_token = Histogram(
            "planetserve_time_to_first_token_seconds",
            "Time to the first text of an answered request (streamed), else to the whole answer.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        for outcome in BASE_OUTCOMES:
            self.request_duration.labels(outcome)
        self._server: Any = None
        self.url: str | None = None

    def bind(self, trio_token: Any) -> None:
        """Scrapes read the node on the trio run of ``trio_token`` (None: on their own thread,
        for a node that is not running)."""
        self._trio_token = trio_token

    def observe_request(self, outcome: str, seconds: float) -> None:
        """One ask ended (``UserClient``'s ``on_request_done``; on the trio thread)."""
        self.request_duration.labels(outcome).observe(seconds)

    def serve(self, address: str) -> str:
        """Serve ``/metrics`` on ``address`` (``HOST:PORT``; port 0 picks one) in a daemon
        thread; returns the URL.

        Raises:
            ConfigError: ``address`` is not HOST:PORT.
            OSError: the address cannot be bound (``errno`` EADDRINUSE when in use); the
                message names the address.
        """
        host, port = parse_host_port(address, "--metrics")
        try:
            server, _thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"cannot serve metrics on {address}: {reason}") from None
        self._server = server
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{server.server_port}/metrics"
        log.info("metrics on %s", self.url)
        return self.url

    def close(self) -> None:
        """Stop serving (the port is released within about 0.5 s; never blocks)."""
        server, self._server = self._server, None
        if server is not None:
            threading.Thread(target=_stop_server, args=(server,), name="metrics-stop",
                             daemon=True).start()


def status_line(node: Node) -> str:
    """One line on the node's state for the periodic status log, e.g. ``"5/5 paths ready,
    12 requests ok / 0 failed, relaying 37 paths, directory height 108 (106 records)"``."""
    parts: list[str] = []
    user = node.user
    if user is not None:
        ready = len(user.ready_paths())
        text = f"{ready}/{user.config.paths} paths ready"
        if user.pool.setting_up:
            text += f" ({user.pool.setting_up} setting up)"
        parts.append(text)
        outcomes = user.outcomes
        ok = outcomes.get("ok", 0)
        cancelled = outcomes.get("cancelled", 0)
        failed = sum(outcomes.values()) - ok - cancelled
        text = f"{ok} requests ok / {failed} failed"
        if cancelled:
            text += f" / {cancelled} cancelled"
        parts.append(text)
    if node.overlay is not None and node.overlay.config.relay:
        parts.append(f"relaying {len(node.overlay.table)} paths")
    model = node.model
    if model is not None:
        load = model.load
        parts.append(
            f"engine queue {load.queued}, {load.in_service}/{load.capacity} running, "
            f"{load.served} served, {model.dispatcher.requests.get('overloaded', 0)} overloaded"
        )
    consensus = getattr(node, "consensus", None)
    if consensus is not None:
        v = consensus.validator
        parts.append(f"committed height {v.committed_height} ({len(v.state.records)} records, "
                     f"mempool {len(v.mempool)})")
    d = node.directory
    if d is None:
        parts.append("no directory yet")
    else:
        parts.append(f"directory height {d.height} ({len(d.records)} records)")
    return ", ".join(parts)


def status_message(node: Node) -> str:
    """The status log line with the node's short peer ID: ``"status of <id>: ..."``."""
    return f"status of {_short(node.peer_id)}: {status_line(node)}"


# ---------------------------------------------------------------------- families


def _directory_families(directory: Any) -> list[Metric]:
    if directory is None:
        return []
    by_role = {role: 0 for role in Role}
    for record in directory.records:
        for role in record.roles:
            by_role[role] += 1
    nodes = GaugeMetricFamily("planetserve_directory_nodes",
                              "Records of the held directory by role.", labels=["role"])
    for role, count in by_role.items():
        nodes.add_metric([role.name.lower()], count)
    return [
        _gauge("planetserve_directory_height", "Height of the verified directory held.",
               directory.height),
        _gauge("planetserve_directory_records", "Records in the verified directory held.",
               len(directory.records)),
        nodes,
        _gauge("planetserve_directory_expiry_timestamp_seconds",
               "Unix time the held directory expires.", directory.expires_at_ms / 1000),
    ]


def _overlay_families(overlay: Any) -> list[Metric]:
    stats = overlay.stats
    out = [
        _gauge("planetserve_relay_paths",
               "Paths this node relays or proxies now (relay table entries).", len(overlay.table)),
        _gauge("planetserve_reply_tags", "Live reply tags this node holds as proxy.",
               overlay.table.tag_count),
        _counter("planetserve_relay_setups", "Path setups handled as relay or proxy.",
                 ["outcome"], {("accepted",): stats.setups_relayed,
                               ("failed",): stats.setups_failed,
                               ("replayed",): stats.setups_replayed}),
        _counter("planetserve_cells_relayed", "Cells passed on, or opened as proxy.",
                 value=stats.cells_relayed),
        _counter("planetserve_cells_dropped", "Cells and reply cloves dropped, by reason.",
                 ["reason"], {(k,): v for k, v in stats.cells_dropped_by.items()}),
        _counter("planetserve_cloves_proxied",
                 "Request cloves this node passed to a model node as proxy.",
                 value=stats.cloves_proxied),
        _counter("planetserve_deliveries", "Request cloves accepted from proxies.",
                 value=stats.deliveries),
        _counter("planetserve_deliveries_refused", "Deliveries refused, by reason.",
                 ["reason"], {(k,): v for k, v in stats.deliveries_refused_by.items()}),
        _counter("planetserve_response_cloves_sent",
                 "Signed response cloves sent to reply proxies.", value=stats.replies),
        _counter("planetserve_paths_lost_to_link_down",
                 "Relayed and own paths torn down because a connection was lost.",
                 value=stats.paths_lost_to_link_down),
    ]
    links = [(name, overlay.link_stats(name)) for name in _LINKS]
    links = [(name, s) for name, s in links if s is not None]
    out += [
        _counter("planetserve_link_frames_sent", "Frames written to outbound links.",
                 ["protocol"], {(n,): s.frames_sent for n, s in links}),
        _counter("planetserve_link_frames_dropped",
                 "Frames not queued: the peer's queue was full, or the peer in dial back-off.",
                 ["protocol", "reason"],
                 {**{(n, "queue_full"): s.frames_dropped for n, s in links},
                  **{(n, "backoff"): s.frames_backed_off for n, s in links}}),
        _counter("planetserve_links_opened", "Outbound streams opened.",
                 ["protocol"], {(n,): s.links_opened for n, s in links}),
        _counter("planetserve_links_failed", "Outbound streams that could not open or failed.",
                 ["protocol"], {(n,): s.links_failed for n, s in links}),
    ]
    return out


def _user_families(user: Any) -> list[Metric]:
    pool = user.pool
    stats = pool.stats
    ready = len(user.ready_paths())
    live = pool.live_paths()
    paths = GaugeMetricFamily("planetserve_paths", "Own paths by state.", labels=["state"])
    paths.add_metric(["ready"], ready)
    paths.add_metric(["unconfirmed"], sum(1 for p in live if not p.confirmed))
    paths.add_metric(["retiring"], sum(1 for p in pool.paths() if p.retiring))
    paths.add_metric(["setting_up"], pool.setting_up)
    outcomes = {outcome: 0 for outcome in BASE_OUTCOMES}
    outcomes.update(user.outcomes)
    return [
        paths,
        _gauge("planetserve_paths_target", "Paths kept (N, spares included).", user.config.paths),
        _counter("planetserve_paths_built", "Path setups acknowledged.", value=stats.built),
        _counter("planetserve_path_setups_failed", "Path setups that failed.",
                 value=stats.setups_failed),
        _counter("planetserve_paths_lost", "Ready paths lost, by reason.", ["reason"],
                 {(k,): v for k, v in stats.lost.items()}),
        _counter("planetserve_paths_repaired", "Lost paths replaced by a new ready path.",
                 value=stats.repaired),
        _counter("planetserve_paths_rotated", "Paths closed after rotation or rebalancing.",
                 value=stats.rotated),
        _gauge("planetserve_probe_timeout_seconds",
               "Current probe deadline (RFC 6298 RTO of the probe round trips).",
               pool.probe_rtt.rto),
        _gauge("planetserve_proxies_avoided",
               "Proxies convicted of altering a response clove, still avoided.",
               len(pool.bad_proxies)),
        _counter("planetserve_requests", "Anonymous requests (asks) ended, by outcome.",
                 ["outcome"], {(k,): v for k, v in outcomes.items()}),
        _gauge("planetserve_requests_in_flight", "Requests the request core holds now.",
               len(user.requests)),
        _counter("planetserve_response_cloves_misrouted",
                 "Response cloves dropped without blame (unknown tag, wrong path, unsigned).",
                 value=user.misrouted_cloves),
    ]


def _model_families(model: Any) -> list[Metric]:
    load = model.load
    dispatcher = model.dispatcher
    dropped = dict(dispatcher.dropped_by)
    dropped["malformed"] = model.malformed_cloves
    out = [
        _gauge("planetserve_engine_queue_depth", "Requests admitted, waiting for a slot.",
               load.queued),
        _gauge("planetserve_engine_requests_running", "Requests on the engine now.",
               load.in_service),
        _gauge("planetserve_engine_capacity", "Requests served at once (C).", load.capacity),
        _counter("planetserve_engine_jobs", "Engine jobs finished.", value=load.served),
        _gauge("planetserve_load_factor", "F_LB = L * (Q / C) (PlanetServe sec. 3.3).",
               load.load_factor()),
        _counter("planetserve_model_requests",
                 "Requests decoded at this model node (or expired incomplete), by outcome.",
                 ["outcome"], {(k,): v for k, v in dispatcher.requests.items()}),
        _counter("planetserve_request_cloves_dropped", "Request cloves dropped, by reason.",
                 ["reason"], {(k,): v for k, v in dropped.items()}),
        _counter("planetserve_answers_sent", "Signed answers sent, by status.",
                 ["status"], {(k,): v for k, v in model.answers.items()}),
    ]
    if load.latency_ewma is not None:
        out.append(_gauge("planetserve_engine_latency_ewma_seconds",
                          "Service time EWMA (L of F_LB, alpha 1/8).", load.latency_ewma))
    return out


def _committee_families(node: Any, consensus: Any) -> list[Metric]:
    """A verifier's consensus: heights, round, registry, mempool, evidence, peers, refusals."""
    v = consensus.validator
    stats = v.stats
    connected = sum(1 for peer in consensus.peers
                    if node.host is not None and is_connected(node.host, peer))
    return [
        _gauge("planetserve_consensus_height", "Last committed height.", v.committed_height),
        _gauge("planetserve_consensus_round", "Round of the height being decided.",
               v.core.round),
        _gauge("planetserve_consensus_validators", "Validators in the genesis.",
               len(v.validators)),
        _gauge("planetserve_consensus_validators_connected",
               "Other validators this one is connected to.", connected),
        _gauge("planetserve_registry_records", "Records in the committed registry.",
               len(v.state.records)),
        _gauge("planetserve_mempool_txs", "Transactions waiting for a block.", len(v.mempool)),
        _gauge("planetserve_consensus_evidence", "Equivocation evidence committed.",
               len(v.state.evidence)),
        _counter("planetserve_consensus_heights", "Heights this validator committed.",
                 value=stats.heights_committed),
        _counter("planetserve_consensus_blocks_synced", "Blocks applied from block sync.",
                 value=stats.blocks_synced),
        _counter("planetserve_consensus_signed", "Proposals and votes this validator signed.",
                 ["kind"], {("proposal",): stats.proposals_signed,
                            ("vote",): stats.votes_signed}),
        _counter("planetserve_consensus_double_sign_refused",
                 "Signatures refused because they would sign a second value.",
                 value=stats.double_sign_refused),
        _counter("planetserve_consensus_values_refused", "Proposed values refused as invalid.",
                 value=stats.values_refused),
        _counter("planetserve_consensus_messages_refused",
                 "Consensus messages from peers refused, by reason.", ["reason"],
                 {(reason,): n for reason, n in consensus.refused.items()}),
    ]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(
    name: str,
    documentation: str,
    labels: list[str] | None = None,
    samples: Mapping[tuple[str, ...], float] | None = None,
    *,
    value: float | None = None,
) -> CounterMetricFamily:
    """A counter family: one unlabelled ``value``, or ``samples`` by label values."""
    if value is not None:
        return CounterMetricFamily(name, documentation, value=value)
    family = CounterMetricFamily(name, documentation, labels=labels or [])
    for label_values, count in sorted((samples or {}).items()):
        family.add_metric(list(label_values), count)
    return family


def _on_trio_thread(token: Any) -> bool:
    try:
        return trio.lowlevel.current_trio_token() is token
    except RuntimeError:
        return False


def _stop_server(server: Any) -> None:
    try:
        server.shutdown()
        server.server_close()
    except Exception:  # a server that never started, or already closed
        log.debug("metrics server did not stop cleanly", exc_info=True)


__all__ = [
    "BASE_OUTCOMES", "LATENCY_BUCKETS", "NodeCollector", "NodeMetrics", "status_line",
    "status_message",
]
