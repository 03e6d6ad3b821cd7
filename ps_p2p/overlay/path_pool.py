"""The path pool of one user node (pure core, sans-I/O).

PlanetServe sec. 3.2 with the fixes of DESIGN.md ("The anonymous overlay", "Security invariants"):

* relays: ``hops`` per path from the directory's user list (:func:`~ps_p2p.overlay.paths.choose_relays`),
  no relay on two paths when the list is large enough, each path's proxy the relay least used
  as a proxy (a request needs n distinct proxies);
* ``paths`` (N >= n) paths are kept, spares included; a missing one is rebuilt on the next
  maintenance (every ``maintenance_interval`` s, or at once after the pool changed), with at
  most ``max_setups`` setups in flight; a setup unanswered for ``setup_slot_time`` s (a frozen
  first hop answers never; a live one reports a dead hop behind it within the relays' 5 s
  per-hop timeout) frees its slot for another, at most ``2 * max_setups`` in flight in all;
* every path is probed ``probe_interval`` s after its last probe or reply, and also when a
  request clove goes out on it and nothing came back on it for ``probe_on_use`` s
  (:meth:`PathPool.clove_sent`): a frozen relay (SIGSTOP, a laptop closed: its TCP connections
  stay open, nothing says it is gone) is found by the clove's own probe, not ten seconds later;
  a path that keeps answering its probes and carries no request waits twice as long after each
  answer, up to ``probe_idle_factor`` times ``probe_interval`` and never more than
  :data:`IDLE_PROBE_CEILING` (relays drop a path unused for 120 s): an idle user's probes cost
  a quarter, and a request on an idle path is still covered by its clove's probe;
* each path has its own RFC 6298 timeout (:mod:`~ps_p2p.overlay.rtt`, floor ``probe_timeout``),
  started from the round trips of all paths and then fed by its own probes: a frozen relay's
  silence lengthens no other path's deadline;
* a path whose probe went unanswered for its timeout, or whose request clove stayed unanswered
  (:meth:`PathPool.path_silent`, reported by the request core), is *suspended* at once: it
  leaves the ready set (:class:`PathSuspended` tells the requests, which re-send its cloves on
  other paths), a replacement is built, and it is probed again with the timeout doubled (RFC 6298
  5.5-5.6). A late answer to any probe of the series restores it (retired when the pool is
  full by then); after ``probe_attempts`` unanswered probes in a row it is replaced and each of
  its relays made suspect: one slow moment of a loaded machine costs a path a few seconds of
  rest, not a path and three setups;
* a path is *confirmed*, and used for requests, only after its first probe reply: the setup
  acknowledgement only travels backwards, past a relay that corrupts forward cells;
* penalties: a relay on a path that failed setup (only the first hop when the first hop itself
  went down) or went silent is suspect, and skipped while clean relays are enough (for the hops
  and for n distinct proxies: ``max(hops, total)`` of them); a probe reply
  clears the relays *before the proxy* only (the proxy answers probes itself, which says nothing
  of what it does with cloves); a penalty is forgotten ``failed_relay_cooldown`` s after its
  last failure;
* this node's own address changed (:meth:`PathPool.address_changed`, found by the relay core:
  every connection died at once): the setups it abandoned blame nobody (``path_failed`` with
  ``blameless``), the relays that failed it since the first sign are forgiven, and every ready
  path is probed at once (one riding a dead connection is replaced a probe deadline later);
* a proxy convicted of altering a response clove (:meth:`PathPool.convict_proxy`) loses its
  paths and is no proxy for ``bad_proxy_cooldown`` s;
* rotation: a path older than ``rotate_period`` retires (no new requests) and is closed
  ``retire_grace`` s later, when the answers it carries are in;
* rebalancing: once the pool is full and confirmed, a path whose proxy repeats (while a
  candidate relay is nobody's proxy: a clean one, or the least suspected while the clean ones
  are too few for n distinct proxies), else a path sharing relays (while enough unused clean
  relays exist), retires and is replaced, one at a time.

Counters (:class:`PoolStats`, for logs and metrics): paths built, setups failed, paths lost by
reason, lost paths repaired, paths rotated out.

Inputs are method calls that take ``now`` (seconds, the driver's clock) and return a list of
commands; :meth:`PathPool.next_deadline` says when :meth:`PathPool.tick` is next due. Paths are
named by a local ``path_id`` (an int never reused), assigned when :class:`OpenPath` is emitted.
Randomness (relay choice, probe nonces) comes from the injected ``rng``; draws happen in
:meth:`PathPool.tick` only (relay choice, then nonces) and in :func:`choose_distinct_proxies`.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ps_p2p.errors import ConfigError, DirectoryError
from ps_p2p.overlay.paths import choose_relays, reuse_count
from ps_p2p.overlay.rtt import RttEstimator
from ps_p2p.records import short_peer_id as _short

log = logging.getLogger(__name__)

#: Seconds an idle path that answers its probes waits at most between them (unless
#: ``probe_interval`` itself is longer): well inside the relays' 120 s idle timeout
#: (:attr:`~ps_p2p.overlay.relay.RelayConfig.relay_idle_timeout`), which a probe refreshes.
IDLE_PROBE_CEILING = 40.0
#: Seconds a proxy caught altering a response clove is kept off this user's paths.
BAD_PROXY_COOLDOWN = 600.0
#: Weight of a convicted proxy in the proxy count of relay choice: never a proxy while flagged.
_BAD_PROXY_WEIGHT = 1_000


@dataclass(frozen=True)
class PoolConfig:
    """Path pool settings; times in seconds.

    Attributes:
        total: n, the distinct proxies one request needs (rebalancing aims at them).
        paths: N >= n paths kept (spares included).
        hops: relays per path (l); the last is the proxy.
        rotate_period: paths older than this retire (default 15 min).
        retire_grace: a retired path is closed this long after it retired (the request
            deadline: it still carries the answers of requests sent before).
        probe_interval: a probe goes out this long after the last probe or reply on a path.
            Default 10 s: at 2 s, probes were a fifth of a 100-user devnet's CPU; a path that
            turns bad between probes costs at most one resent request attempt.
        probe_timeout: floor (and initial value) of a path's probe deadline (RFC 6298 RTO).
            Default 1 s (RFC 6298 2.4's floor): a first unanswered probe only suspends a path
            (out of the ready set, probed again), so a short floor costs no path; it makes a
            frozen relay's path stop carrying cloves about a second after the clove's probe.
        probe_on_use: a clove sent on a path that has been silent this long also probes it
            (:meth:`PathPool.clove_sent`); a path answering its requests is never probed so.
        probe_idle_factor: a path whose probes are answered and that carries no request
            waits ``probe_interval`` s, then twice that after each answered probe, up to this
            many times ``probe_interval`` (at most :data:`IDLE_PROBE_CEILING` s); a request
            clove or a silence brings it back to ``probe_interval``. 1: every path every
            ``probe_interval``. Default 4 (10, 20, then every 40 s): at rest, probes were the
            larger share of a user's CPU (benchmarks/README.md, "CPU at rest"); a frozen relay
            of an idle path is found within 40 s and the probe deadline instead of 10 s, and a
            request sent on it meanwhile is covered by its clove's own probe (``probe_on_use``).
        probe_attempts: unanswered probes in a row (each waiting twice as long as the one
            before) that replace a path.
        failed_relay_cooldown: a relay's penalty is forgotten this long after its last failure.
        bad_proxy_cooldown: a convicted proxy is no proxy for this long.
        maintenance_interval: refill and rebalance at least this often (the directory may
            change without telling); None: min(0.5, probe_interval / 2).
        max_setups: path setups in flight at most. A starved network answers setups late;
            building every missing path at once then multiplies the load that made them late
            (a 64-user devnet on 2 cores failed 1,911 setups while keeping ~320 paths).
        setup_slot_time: a setup unanswered this long stops holding one of the ``max_setups``
            slots (it may still succeed); at most ``2 * max_setups`` setups are in flight.
    """

    total: int = 4
    paths: int = 5
    hops: int = 3
    rotate_period: float = 15 * 60.0
    retire_grace: float = 120.0
    probe_interval: float = 10.0
    probe_timeout: float = 1.0
    probe_on_use: float = 1.0
    probe_idle_factor: int = 4
    probe_attempts: int = 2
    failed_relay_cooldown: float = 30.0
    bad_proxy_cooldown: float = BAD_PROXY_COOLDOWN
    maintenance_interval: float | None = None
    max_setups: int = 2
    setup_slot_time: float = 5.0

    def __post_init__(self) -> None:
        if self.paths < self.total or self.hops < 1:
            raise ConfigError("need paths >= total and hops >= 1")
        if self.max_setups < 1:
            raise ConfigError("need max_setups >= 1")
        if self.probe_attempts < 1:
            raise ConfigError("need probe_attempts >= 1")
        if self.probe_idle_factor < 1:
            raise ConfigError("need probe_idle_factor >= 1")

    @property
    def probe_idle_max(self) -> float:
        """Seconds an idle path that answers its probes waits at most between them."""
        return max(self.probe_interval,
                   min(self.probe_interval * self.probe_idle_factor, IDLE_PROBE_CEILING))


#: Reasons a ready path is lost (:attr:`PoolStats.lost`): it died (a hop went away, a Destroy
#: came back), its probes went unanswered, or its proxy altered a response clove.
LOST_DOWN = "down"
LOST_PROBE_TIMEOUT = "probe_timeout"
LOST_BAD_PROXY = "bad_proxy"


@dataclass
class PoolStats:
    """Counters of a :class:`PathPool` (for logs and metrics); they only grow.

    Attributes:
        built: path setups acknowledged (a path joined the pool).
        setups_failed: path setups that failed (refused, timed out, a hop unreachable).
        setups_abandoned: path setups given up because this node's own address changed
            (:meth:`PathPool.path_failed` with ``blameless``); not in ``setups_failed``.
        lost: ready paths lost, by reason (:data:`LOST_DOWN`, :data:`LOST_PROBE_TIMEOUT`,
            :data:`LOST_BAD_PROXY`); rotation is no loss.
        repaired: paths built to replace a lost one that was not retiring (counted when the
            replacement is ready; a replacement whose setup fails leaves the repair owed).
            Replacements of rotated or rebalanced paths are not repairs.
        rotated: retired paths (rotation, rebalancing) closed at the end of their grace.
    """

    built: int = 0
    setups_failed: int = 0
    setups_abandoned: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    repaired: int = 0
    rotated: int = 0

    @property
    def lost_total(self) -> int:
        return sum(self.lost.values())


# ---------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class OpenPath:
    """Set up a path through ``relays`` (the last is the proxy); answer with
    :meth:`PathPool.path_ready` or :meth:`PathPool.path_failed`."""

    path_id: int
    relays: tuple[bytes, ...]


@dataclass(frozen=True)
class ClosePath:
    """Tear the path down (it is already forgotten by the pool)."""

    path_id: int
    reason: str


@dataclass(frozen=True)
class SendProbe:
    """Send a probe with ``nonce`` through the path; if it cannot be sent, call
    :meth:`PathPool.probe_not_sent`."""

    path_id: int
    nonce: int


@dataclass(frozen=True)
class PathLost:
    """A path that was ready is gone (closed, down or dropped): requests using it must react."""

    path_id: int


@dataclass(frozen=True)
class PoolChanged:
    """A path became ready or confirmed, or was lost: wake whoever waits on the pool."""


@dataclass(frozen=True)
class PathSuspended:
    """A ready path went silent (a probe or a request clove unanswered): it carries no new
    clove until it answers a probe; requests re-send the cloves it holds on other paths."""

    path_id: int


Command = OpenPath | ClosePath | SendProbe | PathLost | PathSuspended | PoolChanged


@dataclass
class PoolPath:
    """One ready path of the pool.

    Attributes:
        confirmed: a probe came back through the path: its forward cells reach the proxy
            intact. Only confirmed paths carry request cloves.
        retiring: rotated out (or replaced by rebalancing): carries no new request.
        probe_nonce: the outstanding probe's nonce, None when none is outstanding.
        lost_nonces: nonces of the probes of the outstanding series that went unanswered (the
            one out now waits ``2 ** len(lost_nonces)`` RTOs); a late answer to one still
            proves the path.
        suspended: a probe or a request clove went unanswered: out of the ready set until a
            probe answers.
        resumed_at: when a probe last brought it back from suspension (None: never
            suspended); while a replacement built for it is still under way, it is the path
            let go once that replacement is in.
        rtt: this path's probe round trips (RFC 6298; its RTO is the path's probe deadline).
    """

    path_id: int
    relays: tuple[bytes, ...]
    created_at: float
    retiring: bool = False
    retired_at: float = 0.0
    probe_nonce: int | None = None
    confirmed: bool = False
    probe_sent_at: float = 0.0
    last_reply_at: float = 0.0
    lost_nonces: tuple[int, ...] = ()
    suspended: bool = False
    resumed_at: float | None = None
    idle_probes: int = 0  # answered probes in a row with no request clove or silence between
    clove_sent_at: float = -1.0  # the last request clove sent on it
    rtt: RttEstimator = field(default_factory=RttEstimator)

    @property
    def proxy(self) -> bytes:
        return self.relays[-1]


class _HasProxy(Protocol):
    @property
    def proxy(self) -> bytes: ...


P = TypeVar("P", bound=_HasProxy)


def choose_distinct_proxies(ready: Sequence[P], count: int, rng: random.Random) -> list[P]:
    """``count`` of ``ready``, each with a different proxy where possible (random order).

    A proxy holding k cloves of one request could decode it, and a bad proxy on two paths spoils
    two cloves; so one clove per proxy (DESIGN.md: fewer than k compromised paths must never
    reveal content). With fewer distinct proxies than ``count``, paths repeating a proxy fill up
    (logged). Draws one ``rng.shuffle`` of ``ready``.
    """
    order = list(ready)
    rng.shuffle(order)
    chosen: list[P] = []
    proxies: set[bytes] = set()
    for path in order:
        if path.proxy not in proxies:
            chosen.append(path)
            proxies.add(path.proxy)
        if len(chosen) == count:
            return chosen
    rest = [p for p in order if not any(p is c for c in chosen)]
    log.warning("only %d distinct proxies among %d ready paths: one proxy carries two cloves of "
                "this request (a network of >= %d users avoids this)",
                len(proxies), len(ready), count + 1)
    return chosen + rest[: count - len(chosen)]


class PathPool:
    """The paths of one user: choice, probes, penalties, rotation, repair (sans-I/O).

    See the module docstring for the rules. Contract: every :class:`OpenPath` is answered once by
    :meth:`path_ready` or :meth:`path_failed`; a ready path that dies outside the pool's own
    :class:`ClosePath` is reported by :meth:`path_down`.

    Args:
        config: :class:`PoolConfig`.
        rng: relay choice and probe nonces (a seeded ``random.Random`` in tests).

    Attributes:
        stats: :class:`PoolStats`.
    """

    def __init__(self, config: PoolConfig, *, rng: random.Random) -> None:
        self.config = config
        self.stats = PoolStats()
        #: NATed relay -> its relay hosts (Circuit Relay v2), members of any path through it
        #: (:func:`~ps_p2p.overlay.paths.choose_relays`); set from the directory by the user
        self.relay_hosts: dict[bytes, frozenset[bytes]] = {}
        # lost paths not yet replaced, and the setups under way that replace one
        self._owed_repairs = 0
        self._repairs: set[int] = set()
        self._rng = rng
        self._ids = itertools.count(1)
        self._paths: dict[int, PoolPath] = {}
        self._opening: dict[int, tuple[bytes, ...]] = {}
        self._opened_at: dict[int, float] = {}
        self._slow_setups: set[int] = set()  # setups past setup_slot_time (first hop suspect)
        # relay -> (failures, time of the last one): paths through it that failed to set up or
        # went silent since a path through it last worked. A dead or cell-dropping relay keeps
        # its score; its honest neighbours are cleared by their other, working paths.
        self._penalty: dict[bytes, tuple[int, float]] = {}
        self._bad_proxies: dict[bytes, float] = {}  # proxy -> until when
        # probe round trips of all paths (a loaded machine slows every path alike): the
        # starting point of a new path's own estimator; never backed off (Karn's rule keeps
        # timed-out probes out of it), so one silent path lengthens no other's deadline
        self.probe_rtt = RttEstimator(
            initial_rto=config.probe_timeout, min_rto=config.probe_timeout, max_rto=60.0
        )
        interval = config.maintenance_interval
        self._interval = min(0.5, config.probe_interval / 2) if interval is None else interval
        self._next_maintenance: float | None = None  # None: at the next tick
        self._probe_retry: dict[int, float] = {}  # path -> earliest probe after a failed send
        self._reuse_logged = False

    # ------------------------------------------------------------------ queries

    def paths(self) -> list[PoolPath]:
        """Every ready path (retiring and unconfirmed ones included)."""
        return list(self._paths.values())

    def path(self, path_id: int) -> PoolPath | None:
        return self._paths.get(path_id)

    def ready_paths(self) -> list[PoolPath]:
        """Confirmed paths neither retiring nor suspended: what requests use."""
        return [
            p for p in self._paths.values() if p.confirmed and not p.retiring and not p.suspended
        ]

    def live_paths(self) -> list[PoolPath]:
        """Paths not retiring, confirmed or still waiting for their first probe reply."""
        return [p for p in self._paths.values() if not p.retiring]

    @property
    def setting_up(self) -> int:
        """Paths opened and not answered yet."""
        return len(self._opening)

    def setup_slots_held(self, now: float) -> int:
        """Setups holding one of the ``max_setups`` slots: those opened less than
        ``setup_slot_time`` s ago."""
        limit = now - self.config.setup_slot_time
        return sum(1 for at in self._opened_at.values() if at > limit)

    @property
    def bad_proxies(self) -> frozenset[bytes]:
        """Proxies convicted of altering a response clove, not yet forgiven."""
        return frozenset(self._bad_proxies)

    def penalty(self, relay: bytes) -> int:
        """Failures counted against ``relay`` (0: above suspicion)."""
        return self._penalty.get(relay, (0, 0.0))[0]

    # ------------------------------------------------------------------ inputs

    def path_ready(self, path_id: int, now: float) -> list[Command]:
        """The path's setup was acknowledged; a first probe goes out at once.

        Penalties are cleared by the first probe reply, not by the acknowledgement.
        """
        relays = self._opening.pop(path_id, None)
        self._opened_at.pop(path_id, None)
        self._slow_setups.discard(path_id)
        if relays is None:
            return [ClosePath(path_id, "not opened by the pool")]
        self.stats.built += 1
        if path_id in self._repairs:
            self._repairs.discard(path_id)
            self.stats.repaired += 1
        rtt = RttEstimator(initial_rto=self.probe_rtt.rto, min_rto=self.config.probe_timeout,
                           max_rto=self.probe_rtt.max_rto)
        path = PoolPath(path_id, relays, created_at=now, last_reply_at=now, probe_sent_at=now,
                        rtt=rtt)
        self._paths[path_id] = path
        log.info("path ready: %s (proxy %s)", " -> ".join(_short(r) for r in relays),
                 _short(relays[-1]))
        self._next_maintenance = None
        return [*self._probe(path, now), PoolChanged()]

    def path_failed(
        self, path_id: int, now: float, *, first_hop_down: bool = False, blameless: bool = False
    ) -> list[Command]:
        """The path's setup failed: its relays are suspect (only the first one when it is the
        first hop that went down; none when ``blameless``: this node abandoned it because its
        own address changed). The pool rebuilds at its next maintenance, not at once (no tight
        retry loop)."""
        relays = self._opening.pop(path_id, None)
        self._opened_at.pop(path_id, None)
        self._slow_setups.discard(path_id)
        if relays is not None:
            if blameless:
                self.stats.setups_abandoned += 1
            else:
                self.stats.setups_failed += 1
            if path_id in self._repairs:  # the repair is still owed
                self._repairs.discard(path_id)
                self._owed_repairs += 1
            if not blameless:
                self._penalize(relays[:1] if first_hop_down else relays, now)
        return []

    def address_changed(self, since: float, now: float) -> list[Command]:
        """This node's own address changed (``ps_p2p.overlay.relay.AddressChanged``): every
        connection it had died, so the relays that failed it since ``since`` (first hops
        "down", setups unanswered, paths silent) did nothing wrong; their penalties are
        forgotten, and the pool refills at its next tick instead of going around them. (A
        penalty also counts older failures; those go too: one change is rare, a relay that
        fails again is suspect again at once.) Every ready path with no probe out is probed
        now: one whose first hop's connection died with the others but has not yet failed
        (nothing was sent on it since) is suspended and replaced one probe deadline later
        (floor ``probe_timeout``), not at its next probe ``probe_interval`` s on.

        Returns:
            a :class:`SendProbe` per ready path probed.
        """
        forgiven = [peer for peer, (_, last) in self._penalty.items() if last >= since]
        for peer in forgiven:
            del self._penalty[peer]
        if forgiven:
            log.info("own address changed: %d relays' penalties forgiven", len(forgiven))
        self._next_maintenance = None
        commands: list[Command] = []
        for path in self._paths.values():
            if path.probe_nonce is None:
                commands += self._probe(path, now)
        return commands

    def path_down(self, path_id: int, now: float) -> list[Command]:
        """A ready path died (its first hop disconnected, a Destroy came back...)."""
        path = self._paths.pop(path_id, None)
        if path is None:
            return []
        log.warning("path via %s down", _short(path.relays[0]))
        self._count_loss(path, LOST_DOWN)
        self._next_maintenance = None
        return [PathLost(path_id), PoolChanged()]

    def heard_from(self, path_id: int, now: float) -> list[Command]:
        """Any backward payload came on the path: the next probe waits ``probe_interval``."""
        path = self._paths.get(path_id)
        if path is not None:
            path.last_reply_at = now
        return []

    def probe_reply(self, path_id: int, nonce: int, now: float) -> list[Command]:
        """A probe reply came back; only the outstanding nonce, or one of its unanswered
        predecessors of the same series, counts.

        Confirms the path, samples the probe RTT (only from a probe answered before its timeout:
        Karn's rule, RFC 6298 sec. 3), and clears the penalties of the relays before the proxy
        (every one of them forwarded cells intact); never the proxy's.
        """
        path = self._paths.get(path_id)
        if path is None:
            return []
        path.last_reply_at = now
        if path.probe_nonce is None or (
            nonce != path.probe_nonce and nonce not in path.lost_nonces
        ):
            return []
        if nonce == path.probe_nonce and not path.lost_nonces:
            self.probe_rtt.sample(now - path.probe_sent_at)
            path.rtt.sample(now - path.probe_sent_at)
        path.probe_nonce = None
        path.lost_nonces = ()
        for relay in path.relays[:-1]:
            self._penalty.pop(relay, None)
        if path.confirmed and not path.suspended and path.clove_sent_at < path.probe_sent_at:
            # an idle path that kept answering (not a clove's own probe): the next waits longer
            path.idle_probes = min(path.idle_probes + 1, 32)
        if path.suspended:
            path.suspended = False
            path.resumed_at = now
            self._next_maintenance = None
            if len(self.ready_paths()) > self.config.paths and not path.retiring:
                # its replacement is in: the path that went silent is the one to let go
                self._retire(path, now)
            return [PoolChanged()]
        if path.confirmed:
            return []
        path.confirmed = True
        self._next_maintenance = None
        ready = self.ready_paths()
        if len(ready) > self.config.paths:
            # a replacement came in after the path it replaced answered again: let the path
            # that went silent go (the latest back), not keep both until rotation
            back = [p for p in ready if p.resumed_at is not None and p is not path]
            if back:
                self._retire(max(back, key=lambda p: p.resumed_at or 0.0), now)
        return [PoolChanged()]

    def clove_sent(self, path_id: int, now: float) -> list[Command]:
        """A request clove went out on the path: probe it along when nothing came back on it
        for ``probe_on_use`` s and no probe is out (the clove's answer may take a model's
        generation time; the probe's answer takes one round trip)."""
        path = self._paths.get(path_id)
        if path is None:
            return []
        path.idle_probes = 0  # carrying requests: probed at probe_interval again once idle
        path.clove_sent_at = now
        if path.probe_nonce is not None:
            return []
        if now - max(path.last_reply_at, path.probe_sent_at) < self.config.probe_on_use:
            return []
        return self._probe(path, now)

    def path_silent(self, path_id: int, now: float) -> list[Command]:
        """A request clove sent on the path stayed unanswered (the request core gave up
        waiting for its attempt): suspend the path and probe it now (unless a probe is out)."""
        path = self._paths.get(path_id)
        if path is None or path.suspended:
            return []
        commands = self._suspend(path, now)
        if path.probe_nonce is None:
            commands += self._probe(path, now)
        return commands

    def probe_not_sent(self, path_id: int, nonce: int, now: float) -> list[Command]:
        """:class:`SendProbe` could not be sent (queue full, path dying): no probe is
        outstanding; the next try comes after ``maintenance_interval``."""
        path = self._paths.get(path_id)
        if path is not None and path.probe_nonce == nonce:
            path.probe_nonce = None
            self._probe_retry[path_id] = now + self._interval
        return []

    def convict_proxy(self, proxy: bytes, now: float) -> list[Command]:
        """``proxy`` altered a response clove: close its paths, keep it out of the proxy
        position for ``bad_proxy_cooldown`` s (it may still relay: cells are checked end to end)."""
        if proxy not in self._bad_proxies:
            log.warning("proxy %s altered a response clove: avoiding it for %.0f s",
                        _short(proxy), self.config.bad_proxy_cooldown)
        self._bad_proxies[proxy] = now + self.config.bad_proxy_cooldown
        commands: list[Command] = []
        for path in list(self._paths.values()):
            if path.proxy == proxy:
                commands += self._drop(path, "proxy altered a clove", lost=LOST_BAD_PROXY)
        return commands

    def rotate_all(self, now: float) -> None:
        """Retire every path now, as rotation would: they carry no new request, still carry
        the answers of requests already sent, close after ``retire_grace``, and the next
        :meth:`tick` builds their replacements (a verifier after it published its challenges'
        requests, which name its proxies: docs/verification.md)."""
        for path in self._paths.values():
            if not path.retiring:
                path.retiring = True
                path.retired_at = now
        self._next_maintenance = None

    def tick(self, now: float, relays: Sequence[bytes] | None) -> list[Command]:
        """Probe deadlines, probes, rotation; refill and rebalance when due.

        Args:
            now: seconds.
            relays: peer IDs of the directory's users that may relay (this user and records
                without a valid onion key excluded); None before the first directory.
        """
        cfg = self.config
        commands: list[Command] = []
        rotating: list[str] = []
        for path in list(self._paths.values()):
            if path.probe_nonce is not None and now >= self._probe_deadline(path):
                if len(path.lost_nonces) + 1 < cfg.probe_attempts:
                    log.info("probe via %s unanswered for %.1f s: probing again (path "
                             "suspended)", _short(path.relays[0]), now - path.probe_sent_at)
                    path.rtt.timed_out()
                    commands += self._suspend(path, now)
                    commands += self._probe(path, now, again=True)
                    continue
                log.warning("path via %s: %d probes unanswered: replacing it",
                            _short(path.relays[0]), len(path.lost_nonces) + 1)
                # one of its relays drops cells (dead, or tampering): suspect every relay of it
                self._penalize(path.relays, now)
                commands += self._drop(path, "probe timeout", lost=LOST_PROBE_TIMEOUT)
                continue
            if path.probe_nonce is None and now >= self._probe_due(path):
                commands += self._probe(path, now)
            if not path.retiring and now - path.created_at >= cfg.rotate_period:
                path.retiring = True
                path.retired_at = now
                self._next_maintenance = None
                rotating.append(f"{_short(path.relays[0])}..{_short(path.relays[-1])}")
            # a retired path still carries the answers of requests sent before it retired
            if path.retiring and now - path.retired_at >= cfg.retire_grace:
                self.stats.rotated += 1
                commands += self._drop(path, "rotated")
        if rotating:  # paths built together rotate together: one line, each path named once
            log.info("rotating %d path(s) older than %.0f s (first hop..proxy: %s); replacing "
                     "them, they close in %.0f s", len(rotating), cfg.rotate_period,
                     ", ".join(rotating), cfg.retire_grace)
        if self._next_maintenance is None or now >= self._next_maintenance:
            self._next_maintenance = now + self._interval
            self._forgive(now)
            self._suspect_slow_first_hops(now)
            live = self.live_paths()
            # a suspended path is replaced at once (it may come back: then the pool has one
            # path too many until it retires); an old unanswered setup holds no slot
            serving = [p for p in live if not p.suspended]
            missing = min(
                cfg.paths - len(serving) - len(self._opening),
                cfg.max_setups - self.setup_slots_held(now),
                2 * cfg.max_setups - len(self._opening),
            )
            if missing > 0:
                commands += self._build(missing, now, relays)
            elif not self._opening and all(p.confirmed for p in live):
                commands += self._rebalance(now, relays)
        return commands

    def next_deadline(self) -> float | None:
        """When :meth:`tick` is next due (seconds; may be in the past); None: at once."""
        if self._next_maintenance is None:
            return None
        deadline = self._next_maintenance
        for path in self._paths.values():
            if path.probe_nonce is not None:
                due = self._probe_deadline(path)
            else:
                due = self._probe_due(path)
            if path.retiring:
                due = min(due, path.retired_at + self.config.retire_grace)
            else:
                due = min(due, path.created_at + self.config.rotate_period)
            deadline = min(deadline, due)
        return deadline

    # ------------------------------------------------------------------ internals

    def _probe_due(self, path: PoolPath) -> float:
        retry = self._probe_retry.get(path.path_id)
        if retry is not None:
            return retry
        cfg = self.config
        wait = cfg.probe_interval
        if path.idle_probes:
            wait = min(cfg.probe_interval * 2.0 ** path.idle_probes, cfg.probe_idle_max)
        return max(path.probe_sent_at, path.last_reply_at) + wait

    def _probe_deadline(self, path: PoolPath) -> float:
        # the path's own RTO, backed off once per unanswered probe until a probe answered in
        # time gives a sample (RFC 6298 5.5 and 5.7, Karn): a loaded machine that slows every
        # probe past the RTO costs each path a suspension or two, not one per probe
        return path.probe_sent_at + path.rtt.rto

    def _suspect_slow_first_hops(self, now: float) -> None:
        """A setup unanswered for ``setup_slot_time`` s makes its first hop suspect (once): a
        live first hop reports a dead hop behind it within the relays' per-hop timeout, a frozen
        one says nothing, and the next setups should not go through it meanwhile. A first probe
        reply clears it again."""
        limit = now - self.config.setup_slot_time
        for path_id, opened_at in self._opened_at.items():
            if opened_at <= limit and path_id not in self._slow_setups:
                self._slow_setups.add(path_id)
                self._penalize(self._opening[path_id][:1], now)

    def _suspend(self, path: PoolPath, now: float) -> list[Command]:
        """Take a silent path out of the ready set (see the module docstring)."""
        path.idle_probes = 0
        if path.suspended:
            return []
        path.suspended = True
        self._next_maintenance = None
        log.info("path via %s silent: suspended", _short(path.relays[0]))
        # a retiring path still carries the cloves of requests sent before: they move too
        return [PathSuspended(path.path_id), PoolChanged()] if path.confirmed else []

    def _probe(self, path: PoolPath, now: float, *, again: bool = False) -> list[Command]:
        if again and path.probe_nonce is not None:
            path.lost_nonces = (*path.lost_nonces, path.probe_nonce)
        else:
            path.lost_nonces = ()
        nonce = self._rng.getrandbits(64)
        path.probe_nonce = nonce
        path.probe_sent_at = now
        self._probe_retry.pop(path.path_id, None)
        return [SendProbe(path.path_id, nonce)]

    def _forgive(self, now: float) -> None:
        """Forget penalties ``failed_relay_cooldown`` s after their last failure, and
        convictions past their term (at every maintenance: a full pool builds nothing, and
        rebalancing needs the forgiven relays)."""
        for peer, (_, last) in list(self._penalty.items()):
            if now - last >= self.config.failed_relay_cooldown:
                del self._penalty[peer]
        for peer, until in list(self._bad_proxies.items()):
            if until <= now:
                del self._bad_proxies[peer]

    def _penalize(self, relays: Sequence[bytes], now: float) -> None:
        for relay in relays:
            count, _ = self._penalty.get(relay, (0, now))
            self._penalty[relay] = (count + 1, now)

    def _count_loss(self, path: PoolPath, reason: str) -> None:
        """Count a lost path; one that was not retiring is owed a repair (a retiring path's
        replacement was built when it retired)."""
        self.stats.lost[reason] = self.stats.lost.get(reason, 0) + 1
        if not path.retiring:
            self._owed_repairs = min(self._owed_repairs + 1, self.config.paths)

    def _drop(self, path: PoolPath, reason: str, *, lost: str | None = None) -> list[Command]:
        self._paths.pop(path.path_id, None)
        self._probe_retry.pop(path.path_id, None)
        if lost is not None:
            self._count_loss(path, lost)
        self._next_maintenance = None
        return [ClosePath(path.path_id, reason), PathLost(path.path_id), PoolChanged()]

    def _usable(self, relays: Sequence[bytes] | None) -> list[bytes]:
        return list(dict.fromkeys(relays or ()))

    def _build(self, count: int, now: float, relays: Sequence[bytes] | None) -> list[Command]:
        cfg = self.config
        if relays is None:
            return []
        users = self._usable(relays)
        if len(users) < cfg.hops:
            log.debug("only %d other users known; need %d relays", len(users), cfg.hops)
            return []
        candidates = self._candidates(users)
        in_use: dict[bytes, int] = {}
        # a convicted proxy may still relay but is never a proxy again while flagged
        proxy_uses: dict[bytes, int] = {p: _BAD_PROXY_WEIGHT for p in self._bad_proxies}
        for opening in self._opening.values():  # paths still being set up
            proxy_uses[opening[-1]] = proxy_uses.get(opening[-1], 0) + 1
        for path in self.live_paths():
            for relay in path.relays:
                in_use[relay] = in_use.get(relay, 0) + 1
            proxy_uses[path.proxy] = proxy_uses.get(path.proxy, 0) + 1
        try:
            choices = choose_relays(
                candidates, count, cfg.hops, rng=self._rng, in_use=in_use, proxy_uses=proxy_uses,
                relay_hosts=self.relay_hosts,
            )
        except DirectoryError as exc:
            log.warning("cannot choose relays: %s", exc)
            return []
        reused = reuse_count(choices) + sum(1 for c in choices for r in c if r in in_use)
        if reused:
            self._report_reuse(len(candidates))
        commands: list[Command] = []
        for chosen in choices:
            path_id = next(self._ids)
            self._opening[path_id] = tuple(chosen)
            self._opened_at[path_id] = now
            if self._owed_repairs > 0:
                self._owed_repairs -= 1
                self._repairs.add(path_id)
            commands.append(OpenPath(path_id, tuple(chosen)))
        return commands

    def _candidates(self, users: list[bytes]) -> list[bytes]:
        """The relays new paths may use: the clean ones (no penalty) while they are enough
        for ``hops`` relays and n distinct proxies, else the least suspected ones fill up to
        that many. Enough means both: with clean relays for the hops only, a start's early
        setup failures (a relay that did not know the next hop's address yet) left a user of an
        8-user devnet with 3 distinct proxies for 30 s, and each of its requests waited out
        the request core's ``distinct_proxy_grace`` (1 s) before going out with a proxy
        carrying two cloves."""
        need = max(self.config.hops, self.config.total)
        clean = [r for r in users if r not in self._penalty]
        if len(clean) >= need:
            return clean
        return sorted(users, key=self.penalty)[:need]  # stable: the clean ones first

    def _report_reuse(self, candidates: int) -> None:
        """Log once, at INFO, that relays repeat across this user's paths.

        In a network of under ``paths * hops + 1`` users that is expected: each request still
        reaches n distinct proxies while there are n candidates, and rebalancing spreads the
        paths out once more users join. With fewer than n candidates (a network still filling
        up, or under n + 1 users) a request would put two cloves on one proxy; that is what
        weakens a request (DESIGN.md: one clove per proxy), and :func:`choose_distinct_proxies`
        warns when a request is actually sent so, not when paths are built.
        """
        if self._reuse_logged:
            return
        self._reuse_logged = True
        cfg = self.config
        log.info(
            "%d candidate relays for %d paths of %d hops: some relays serve two paths of this "
            "user (a network of >= %d users avoids this)",
            candidates, cfg.paths, cfg.hops, cfg.paths * cfg.hops + 1,
        )

    def _retire(self, victim: PoolPath, now: float) -> None:
        victim.retiring = True
        victim.retired_at = now

    def _rebalance(self, now: float, relays: Sequence[bytes] | None) -> list[Command]:
        """Retire one path that repeats a proxy or shares a relay while unused clean relays
        are available, and build its replacement (DESIGN.md: no relay on two paths of one user;
        a request needs n distinct proxies)."""
        if relays is None:
            return []
        ready = self.ready_paths()
        users = self._usable(relays)
        clean = [r for r in self._candidates(users) if r not in self._bad_proxies]
        # first: replace a path whose proxy repeats while a candidate relay (a clean one, or
        # while those are too few for n distinct proxies the least suspected) is nobody's proxy
        proxies: dict[bytes, list[PoolPath]] = {}
        for path in ready:
            proxies.setdefault(path.proxy, []).append(path)
        if len(proxies) < self.config.total and any(r not in proxies for r in clean):
            repeated = [ps for ps in proxies.values() if len(ps) > 1]
            if repeated:
                victim = repeated[0][-1]
                self._retire(victim, now)
                log.info("replacing path via %s: its proxy serves another path too",
                         _short(victim.relays[0]))
                return self._build(1, now, relays)
        uses: dict[bytes, int] = {}
        for path in ready:
            for relay in path.relays:
                uses[relay] = uses.get(relay, 0) + 1
        shared = [p for p in ready if any(uses[r] > 1 for r in p.relays)]
        if not shared:
            return []
        victim = max(shared, key=lambda p: sum(uses[r] for r in p.relays))
        # relays the replacement may use: clean ones no other ready path holds (the victim's
        # own count: 7 relays suffice for 2 disjoint paths of 3 even while 2 paths share one)
        kept = {r for p in ready if p is not victim for r in p.relays}
        free = [r for r in users if r not in kept and r not in self._penalty]
        if len(free) < self.config.hops or all(r in self._bad_proxies for r in free):
            return []
        self._retire(victim, now)
        log.info("replacing path via %s: it shares relays with another path",
                 _short(victim.relays[0]))
        return self._build(1, now, relays)


__all__ = [
    "BAD_PROXY_COOLDOWN",
    "LOST_BAD_PROXY",
    "LOST_DOWN",
    "LOST_PROBE_TIMEOUT",
    "ClosePath",
    "Command",
    "OpenPath",
    "PathLost",
    "PathPool",
    "PathSuspended",
    "PoolChanged",
    "PoolConfig",
    "PoolPath",
    "PoolStats",
    "SendProbe",
    "choose_distinct_proxies",
]
