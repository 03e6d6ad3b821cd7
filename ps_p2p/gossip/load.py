"""Load factor of a model node and the load its peers report (PlanetServe sec. 3.3), pure.

F_LB = L * (Q / C), where L is an exponentially weighted moving average of service latency
(alpha = 1/8, as TCP's SRTT estimator, RFC 6298), Q the requests *waiting* for a slot and C the
node's concurrent capacity (PlanetServe sec. 3.3, "Load balancing": "Q is the number of requests
waiting"). With Q waiting, F_LB is the expected queueing delay of one more request (Q requests
ahead, C slots freeing one every L / C seconds); a node with free slots has F_LB 0 whatever its
output lengths (issue 19: Q counted running requests too, so with 30 s outputs a node with 11
of its 32 slots busy already passed a fixed 10 s threshold). Running requests are kept apart
(``in_service``): the forwarding policy weighs them separately (:mod:`ps_p2p.gossip.forwarding`).
Three pieces:

* :class:`LoadTracker`: this node's own L, Q and C (admission, logs, metrics);
* :class:`LoadReport`: what a node gossips of its load to its model group ("each node
  periodically broadcasts its LB factor"), with a canonical byte form that is signed;
* :class:`LoadReporter`: when a node publishes its report (a meaningful change, else a heartbeat);
* :class:`LoadBook`: the latest report of each peer of the group, as one node sees it, plus the
  requests this node forwarded to a peer since that peer's last report (:class:`PeerLoad`);
* :class:`PeerLedger`: what this node itself observed of the peers it forwards to (answers that
  came back and how fast, forwards outstanding, failures) and the share of its requests each
  peer may take: a report is the reporter's word, and a member that gossips "idle and
  instantly fast" would otherwise be handed every request (issue 16).

Load report, byte layout (:func:`encode_report` / :func:`decode_report`; ``uv`` an unsigned
LEB128 varint in its shortest form, refused otherwise)::

    uv(seq)                    strictly increasing per reporter, < 2**64
    || uv(capacity)            C, 1..MAX_CAPACITY
    || uv(queued)              waiting, 0..MAX_QUEUED
    || uv(in_service)          running, 0..capacity
    || uv(latency_us + 1)      L in microseconds, 0..MAX_LATENCY_US; 0 before the first sample

At most :data:`MAX_REPORT_BYTES` (22) bytes, 10-20 in practice. The reporter and the group are
not in the body: the gossip envelope binds both (it is signed by the reporter's identity key for
the group's model ID, :mod:`ps_p2p.protocols.hrtree_gossip`; DESIGN.md "Wire": a signed
canonical byte string, never a re-serialized protobuf), and :func:`decode_report` takes them
from there. Issue 19: the first layout carried a 27-byte domain, the peer ID and the model ID
in every report (about 130 bytes), in an envelope that signs the same facts.

Staleness (DESIGN.md "Model nodes": a 5 s-old view of peers' load made every entry node pile
onto the same "idle" node): a peer whose latest report was received more than ``max_age``
seconds ago, or that never reported, has an *unknown* load, and unknown is never read as idle:
:meth:`LoadBook.fresh` answers None for it, and the forwarding policy
(:mod:`ps_p2p.gossip.forwarding`) excludes it from the candidates (a request is then served by a
node whose load is known, the receiving node itself at worst).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ps_p2p.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from ps_p2p.records.canonical import uvarint as _uvarint
from ps_p2p.records.limits import MAX_MODEL_ID_BYTES

__all__ = [
    "DEFAULT_CONTRADICTION",
    "DEFAULT_IDLE_LATENCY_DEADBAND",
    "DEFAULT_LATENCY_DEADBAND",
    "DEFAULT_MAX_AGE",
    "DEFAULT_MAX_PEERS",
    "DEFAULT_MAX_PENALTY",
    "DEFAULT_BUSY_BACKOFF",
    "DEFAULT_MAX_SHARE",
    "DEFAULT_PENALTY",
    "DEFAULT_SHARE_BURST",
    "DEFAULT_SHARE_FACTOR",
    "DEFAULT_SHARE_WINDOW",
    "DEFAULT_UNKNOWN_LATENCY",
    "EWMA_ALPHA",
    "MAX_CAPACITY",
    "MAX_LATENCY_US",
    "MAX_PEER_ID_BYTES",
    "MAX_QUEUED",
    "MAX_REPORT_BYTES",
    "MAX_SEQ",
    "LoadBook",
    "LoadReport",
    "LoadReporter",
    "LoadTracker",
    "ForwardOutcome",
    "PeerLedger",
    "PeerLoad",
    "ReportOutcome",
    "decode_report",
    "encode_report",
    "load_factor",
]

#: EWMA weight of a new latency sample (paper sec. 3.3).
EWMA_ALPHA = 1.0 / 8.0

MAX_PEER_ID_BYTES = 64
"""Longest reporter peer ID (an Ed25519 identity multihash is 38 bytes)."""
MAX_CAPACITY = 4096
"""Largest C a report may claim (vLLM's ``--max-num-seqs`` defaults to 256 to 1024)."""
MAX_QUEUED = 1 << 20
"""Most waiting requests a report may claim (a dispatcher's queue is bounded far below)."""
MAX_LATENCY_US = 3600 * 1_000_000
"""Largest L a report carries, 1 hour in microseconds (a longer EWMA is clamped to it)."""
MAX_SEQ = 2**64 - 1
"""Largest sequence number (u64)."""


def _uv_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


MAX_REPORT_BYTES = (_uv_len(MAX_SEQ) + _uv_len(MAX_CAPACITY) + _uv_len(MAX_QUEUED)
                    + _uv_len(MAX_CAPACITY) + _uv_len(MAX_LATENCY_US + 1))
"""Longest encoded report (22 bytes)."""

DEFAULT_MAX_AGE = 3.0
"""Seconds after which a peer's latest report no longer counts: three missed reports at the
publishing period of about one second (DESIGN.md "Model nodes")."""
DEFAULT_MAX_PEERS = 256
"""Peers whose reports a book keeps; GenTorrent splits a group above 50 model nodes (sec. 3.3)."""
DEFAULT_UNKNOWN_LATENCY = 1.0
"""L in seconds assumed for a node that has no latency sample yet (see :func:`load_factor`)."""


def load_factor(
    latency: float | None, requests: int, capacity: int, unknown_latency: float
) -> float:
    """F_LB = L * (Q / C) (PlanetServe sec. 3.3), for comparing nodes.

    Args:
        latency: L, the service latency EWMA in seconds; None before the node's first sample.
        requests: Q, requests queued or running (plus those forwarded to it since it reported).
        capacity: C, requests served concurrently (>= 1).
        unknown_latency: L assumed when ``latency`` is None. The paper's formula gives such a node
            F_LB = 0 whatever its queue, so a node that just started would attract every request
            until its first one finished; with a prior L its F_LB grows with Q like the others'.

    Returns:
        F_LB in seconds (0.0 for an empty queue).
    """
    l_value = unknown_latency if latency is None else latency
    return l_value * (requests / capacity)


# ---------------------------------------------------------------------------------- own load


@dataclass
class LoadTracker:
    """Tracks latency EWMA, queue length and capacity of one model node.

    Attributes:
        capacity: C, requests served concurrently (>= 1).
        max_queue: requests allowed to wait beyond ``capacity``; more are refused ("overloaded").
        latency_ewma: L in seconds; None until the first completion.
        in_service: requests being served now (<= capacity).
        queued: requests waiting for a slot (Q of F_LB).
        routing: requests admitted (they hold an admission place, so the queue bound counts
            them) whose forwarding decision is not made yet: not in Q, so the node routing a
            request never counts that request against itself (issue 19: an idle entry node
            that held the prefix forwarded to an equally idle peer). :meth:`routed_here` moves
            one into the queue, :meth:`cancel` drops one that was forwarded.
        taken_in: requests admitted straight into the queue, not routed by this node (on a
            node that routes its users' requests: those other nodes forwarded to it), ever.
    """

    capacity: int
    max_queue: int
    latency_ewma: float | None = None
    in_service: int = 0
    queued: int = 0
    served: int = 0
    refused: int = 0
    routing: int = 0
    taken_in: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ConfigError("capacity must be >= 1")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")

    @property
    def requests(self) -> int:
        """Requests queued or in service (not those still being routed)."""
        return self.queued + self.in_service

    def try_admit(self, routing: bool = False) -> bool:
        """Admit one request; False (and counted as refused) when full. ``routing``: it is
        still to be routed (:attr:`routing`), not queued yet."""
        if self.queued + self.routing >= self.max_queue + max(0, self.capacity - self.in_service):
            self.refused += 1
            return False
        if routing:
            self.routing += 1
        else:
            self.queued += 1
            self.taken_in += 1
        return True

    def routed_here(self) -> None:
        """A request being routed is served here: it joins the queue."""
        if self.routing > 0:
            self.routing -= 1
            self.queued += 1

    def cancel(self) -> None:
        """A request being routed (else a queued one) left without being served here
        (forwarded to another node)."""
        if self.routing > 0:
            self.routing -= 1
        elif self.queued > 0:
            self.queued -= 1

    def start(self) -> None:
        """A queued request got a service slot."""
        self.queued -= 1
        self.in_service += 1

    def finish(self, latency: float) -> None:
        """A request finished after ``latency`` seconds of service; updates the EWMA."""
        self.in_service -= 1
        self.served += 1
        if self.latency_ewma is None:
            self.latency_ewma = latency
        else:
            self.latency_ewma += EWMA_ALPHA * (latency - self.latency_ewma)

    def load_factor(self) -> float:
        """F_LB = L * (Q / C) with Q = requests waiting; 0.0 before the first sample."""
        if self.latency_ewma is None:
            return 0.0
        return self.latency_ewma * (self.queued / self.capacity)

    def report(self, peer_id: bytes, model_id: str, seq: int) -> LoadReport:
        """This node's load as a report to gossip (values beyond the wire limits are clamped).

        Args:
            peer_id: this node's peer ID.
            model_id: the model (group) it serves.
            seq: strictly greater than any ``seq`` this node reported before, restarts included
                (peers refuse a lower one): e.g. seeded from the unix time in milliseconds at
                start, then incremented.

        Raises:
            LocalProtocolError: ``peer_id``, ``model_id`` or ``seq`` out of the wire limits.
        """
        capacity = min(self.capacity, MAX_CAPACITY)
        if self.latency_ewma is None:
            latency_us = None
        else:
            latency_us = min(max(round(self.latency_ewma * 1_000_000), 0), MAX_LATENCY_US)
        return LoadReport(
            peer_id=peer_id,
            model_id=model_id,
            seq=seq,
            capacity=capacity,
            queued=min(max(self.queued, 0), MAX_QUEUED),
            in_service=min(max(self.in_service, 0), capacity),
            latency_us=latency_us,
        )


# ---------------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class LoadReport:
    """One node's load as it gossips it to its group (see the module docstring for the bytes).

    Attributes:
        peer_id: the reporter.
        model_id: the model of the group it reports to.
        seq: sequence number, strictly increasing per reporter (replays are refused).
        capacity: C.
        queued: requests waiting for a slot.
        in_service: requests running (<= capacity).
        latency_us: L in microseconds; None before the reporter's first finished request.

    Raises:
        LocalProtocolError: a field out of its wire limits (on construction).
    """

    peer_id: bytes
    model_id: str
    seq: int
    capacity: int
    queued: int
    in_service: int
    latency_us: int | None

    def __post_init__(self) -> None:
        problem = _report_problem(self)
        if problem is not None:
            raise LocalProtocolError(f"load report: {problem}")

    @property
    def requests(self) -> int:
        """Q: requests queued or in service."""
        return self.queued + self.in_service

    @property
    def latency(self) -> float | None:
        """L in seconds; None before the first sample."""
        return None if self.latency_us is None else self.latency_us / 1_000_000


def _report_problem(r: LoadReport) -> str | None:
    """Why ``r`` breaks the wire limits, or None."""
    if not isinstance(r.peer_id, bytes) or not 1 <= len(r.peer_id) <= MAX_PEER_ID_BYTES:
        return f"peer ID must be 1..{MAX_PEER_ID_BYTES} bytes"
    try:
        model_len = len(r.model_id.encode("utf-8"))
    except (UnicodeEncodeError, AttributeError):
        return "model ID is not encodable as UTF-8"
    if not 1 <= model_len <= MAX_MODEL_ID_BYTES:
        return f"model ID must be 1..{MAX_MODEL_ID_BYTES} bytes of UTF-8"
    if not 0 <= r.seq <= MAX_SEQ:
        return "seq out of u64"
    if not 1 <= r.capacity <= MAX_CAPACITY:
        return f"capacity must be 1..{MAX_CAPACITY}"
    if not 0 <= r.queued <= MAX_QUEUED:
        return f"queued must be 0..{MAX_QUEUED}"
    if not 0 <= r.in_service <= r.capacity:
        return "in_service must be 0..capacity"
    if r.latency_us is not None and not 0 <= r.latency_us <= MAX_LATENCY_US:
        return f"latency must be 0..{MAX_LATENCY_US} us"
    return None


def encode_report(report: LoadReport) -> bytes:
    """The canonical bytes of ``report`` (the module docstring's layout); the gossip envelope
    signs them for the reporter and the group."""
    latency = 0 if report.latency_us is None else report.latency_us + 1
    return b"".join(_uvarint(v) for v in (report.seq, report.capacity, report.queued,
                                          report.in_service, latency))


def decode_report(data: bytes, peer_id: bytes, model_id: str) -> LoadReport:
    """Parse the canonical bytes of a load report ``peer_id`` published to ``model_id``'s group
    (both from the envelope that carried it).

    Args:
        data: at most :data:`MAX_REPORT_BYTES` bytes.
        peer_id: the reporter (the envelope's signer).
        model_id: the group's model.

    Returns:
        The report; ``encode_report(decode_report(data, ...)) == data``.

    Raises:
        RemoteProtocolError: too long, truncated, trailing bytes, a varint not in its shortest
            form or over 64 bits, or a field out of its limits.
    """
    if len(data) > MAX_REPORT_BYTES:
        raise RemoteProtocolError(f"load report of {len(data)} bytes > {MAX_REPORT_BYTES}")
    data = bytes(data)
    values = []
    pos = 0
    for _ in range(5):
        n = shift = 0
        while True:
            if pos >= len(data):
                raise RemoteProtocolError("load report truncated")
            b = data[pos]
            pos += 1
            if shift == 63 and b > 1:
                raise RemoteProtocolError("load report: varint over 64 bits")
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                if b == 0 and shift:
                    raise RemoteProtocolError("load report: varint not in its shortest form")
                break
            shift += 7
        values.append(n)
    if pos != len(data):
        raise RemoteProtocolError(f"load report has {len(data) - pos} trailing bytes")
    seq, capacity, queued, in_service, latency = values
    try:
        return LoadReport(
            peer_id=bytes(peer_id),
            model_id=model_id,
            seq=seq,
            capacity=capacity,
            queued=queued,
            in_service=in_service,
            latency_us=None if latency == 0 else latency - 1,
        )
    except LocalProtocolError as exc:
        raise RemoteProtocolError(str(exc)) from exc


# ---------------------------------------------------------------------------------- when to send

DEFAULT_LATENCY_DEADBAND = 1.0 / 8.0
"""Relative change of L that makes a report due on a node with requests waiting or no free slot
(one EWMA step of a sample twice L)."""
DEFAULT_IDLE_LATENCY_DEADBAND = 1.0 / 2.0
"""The same on a node with a free slot and nothing waiting: its F_LB is 0 whatever L, and a
forwarder compares L only with twice what it measured itself
(:data:`DEFAULT_CONTRADICTION`)."""


class LoadReporter:
    """When a node publishes its load report: on a meaningful change, else on a heartbeat (pure).

    A node checks its load every ``load_interval`` (about 1 s) and asks :meth:`due` whether to
    publish what it would report now. A report is due when

    * none was sent yet, or ``heartbeat`` seconds passed since the last one (peers forget a
      report after ``load_max_age``: the heartbeat keeps a quiet node known);
    * it took in a request another node forwarded to it since its last report
      (:attr:`LoadTracker.taken_in`): every forwarder counts its forwards against it, as k
      requests each, until its next report (:class:`LoadBook`), and a report that does not come
      leaves them counted (without this rule, toolbench at 1.1 of saturation lost 2 points of
      hit rate and 2.6% of mean latency, 3 seeds);
    * its capacity C or its waiting requests Q changed (F_LB = L x Q / C is the policy's
      queueing delay; any change of Q moves it by L / C), or it went from having a free slot
      to having none or back (the policy counts a request waiting on a full node);
    * its running requests moved by ``deadband`` x C or more since the last report (the policy
      weighs running requests as ``busy_weight`` x prefill x running / C, so the error left is
      at most ``deadband`` of one prompt's prefill per full batch);
    * L moved by more than :data:`DEFAULT_LATENCY_DEADBAND` of its last reported value while
      requests wait or no slot is free (L then sets the wait F_LB), by more than
      :data:`DEFAULT_IDLE_LATENCY_DEADBAND` otherwise, or got its first sample.

    Otherwise nothing is sent: a node whose load is steady and that nobody forwards to stops
    paying ~80 bytes a second per peer for reports that say what the last one said.

    Args:
        heartbeat: seconds after which a report is sent whatever changed (> 0).
        deadband: fraction of C of running requests that is a meaningful change, in [0, 1]
            (0: every change).
        latency_deadband: relative change of L that is meaningful (>= 0).

    Raises:
        ConfigError: a bound out of range.
    """

    def __init__(self, *, heartbeat: float, deadband: float,
                 latency_deadband: float = DEFAULT_LATENCY_DEADBAND) -> None:
        if not 0 < heartbeat < math.inf or not 0 <= deadband <= 1 or not latency_deadband >= 0:
            raise ConfigError("heartbeat must be > 0 s, deadband in [0, 1], latency_deadband "
                              ">= 0")
        self.heartbeat = heartbeat
        self.deadband = deadband
        self.latency_deadband = latency_deadband
        self.last: LoadReport | None = None
        self.last_at = -math.inf
        self.last_taken_in = 0
        self.sent_count = 0
        self.skipped = 0

    def due(self, report: LoadReport, now: float, taken_in: int = 0) -> bool:
        """Whether ``report`` (what this node would report at ``now``; its ``seq`` is not
        looked at) is to be published (class docstring); ``taken_in``: the node's
        :attr:`LoadTracker.taken_in` now."""
        last = self.last
        if last is None or now - self.last_at >= self.heartbeat - 1e-9:  # float ticks
            return True
        if taken_in != self.last_taken_in:
            return True
        if report.capacity != last.capacity or report.queued != last.queued:
            return True
        if (report.in_service >= report.capacity) != (last.in_service >= last.capacity):
            return True
        step = max(1, math.ceil(self.deadband * report.capacity)) if self.deadband else 1
        if abs(report.in_service - last.in_service) >= step:
            return True
        if report.latency_us != last.latency_us:
            if report.latency_us is None or last.latency_us is None:
                return True
            # L enters the policy's cost only through the wait of a node with no free slot
            # or requests waiting; otherwise only the ledger reads it, against twice its value
            slack = (self.latency_deadband
                     if report.queued or report.in_service >= report.capacity
                     else DEFAULT_IDLE_LATENCY_DEADBAND)
            if abs(report.latency_us - last.latency_us) > slack * last.latency_us:
                return True
        return False

    def sent(self, report: LoadReport, now: float, taken_in: int = 0) -> None:
        """``report`` was published at ``now`` (``taken_in`` as in :meth:`due`)."""
        self.last = report
        self.last_at = now
        self.last_taken_in = taken_in
        self.sent_count += 1

    def check(self, report: LoadReport, now: float, taken_in: int = 0) -> bool:
        """:meth:`due`, and if so :meth:`sent` (the caller publishes it); else counted as
        skipped."""
        if self.due(report, now, taken_in):
            self.sent(report, now, taken_in)
            return True
        self.skipped += 1
        return False


# ---------------------------------------------------------------------------------- the book


class ReportOutcome(enum.Enum):
    """What :meth:`LoadBook.receive` did with a report (only ACCEPTED changes the book)."""

    ACCEPTED = "accepted"
    REPLAYED = "replayed"  # seq not above the peer's latest: a replay, duplicate or reordering
    NOT_MEMBER = "not_member"  # the reporter is not a (trusted) member of the group
    SELF = "self"  # our own report, come back over gossip
    WRONG_GROUP = "wrong_group"  # a report for another model
    FULL = "full"  # the book already holds max_peers peers


@dataclass(frozen=True)
class PeerLoad:
    """A peer's load as this node sees it: its latest report and what we sent it since.

    Attributes:
        peer_id: the peer.
        latency_ewma: L in seconds as reported; None before its first finished request.
        reported_requests: requests as reported, queued + in service.
        capacity: C as reported.
        received_at: local time (the ``now`` of :meth:`LoadBook.receive`) the report arrived;
            ages are measured on this node's clock, never the reporter's.
        seq: the report's sequence number.
        forwarded: requests this node forwarded to the peer since that report.
    """

    peer_id: bytes
    latency_ewma: float | None
    reported_requests: int
    capacity: int
    received_at: float
    seq: int
    forwarded: int = 0
    reported_queued: int = 0

    @property
    def requests(self) -> int:
        """Requests queued or running as this node estimates them: reported plus forwarded
        since the report."""
        return self.reported_requests + self.forwarded

    @property
    def running(self) -> int:
        """Requests in service as this node estimates it: what it reported running plus what we
        forwarded since, up to its capacity."""
        return min(self.capacity, self.requests - self.waiting) if self.capacity else 0

    @property
    def waiting(self) -> int:
        """Q: requests waiting for a slot as this node estimates it (the reported queue, plus
        the requests forwarded since the report beyond its free slots)."""
        in_service = self.reported_requests - self.reported_queued
        return self.reported_queued + max(0, in_service + self.forwarded - self.capacity)

    def age(self, now: float) -> float:
        """Seconds since the report arrived (0.0 if ``now`` is earlier)."""
        return max(0.0, now - self.received_at)

    def load_factor(self, unknown_latency: float = DEFAULT_UNKNOWN_LATENCY) -> float:
        """F_LB of the peer with :attr:`waiting` as Q (see :func:`load_factor`)."""
        return load_factor(self.latency_ewma, self.waiting, self.capacity, unknown_latency)


class LoadBook:
    """The latest load report of each peer of one model group, as one node sees it (pure).

    Contract:

    * a report is kept only from a member of the group (:meth:`set_members`: the trusted model
      nodes of this model per the verified directory), never from this node itself, only for
      this model, and only when its ``seq`` is above the peer's latest (a replay, duplicate or
      reordered older report changes nothing);
    * :meth:`note_forwarded` counts the requests this node forwarded to a peer; they add to the
      peer's Q until its next accepted report, which resets the count to 0. A report may miss
      requests still in flight when it was made; with reports about every second the error is
      at most one round trip's worth of our forwards, and it errs towards "idle" only then;
    * a report older than ``max_age`` seconds is stale: :meth:`fresh` answers None, as for a
      peer that never reported, and the forwarding policy never picks such a peer;
    * at most ``max_peers`` peers are kept; a member removed from the group is forgotten with
      its sequence number.

    Args:
        self_id: this node's peer ID.
        model_id: the model of the group.
        members: peer IDs of the group's trusted model nodes (this node may be among them).
        max_age: seconds after which a report is stale (> 0).
        max_peers: most peers kept (>= 1).
        unknown_latency: L in seconds assumed for a node with no latency sample (>= 0).

    Raises:
        ConfigError: a bound out of range.
    """

    def __init__(
        self,
        self_id: bytes,
        model_id: str,
        members: Iterable[bytes] = (),
        *,
        max_age: float = DEFAULT_MAX_AGE,
        max_peers: int = DEFAULT_MAX_PEERS,
        unknown_latency: float = DEFAULT_UNKNOWN_LATENCY,
    ) -> None:
        if not max_age > 0:
            raise ConfigError("max_age must be > 0 seconds")
        if max_peers < 1:
            raise ConfigError("max_peers must be >= 1")
        if not unknown_latency >= 0:
            raise ConfigError("unknown_latency must be >= 0 seconds")
        self.self_id = self_id
        self.model_id = model_id
        self.max_age = max_age
        self.max_peers = max_peers
        self.unknown_latency = unknown_latency
        self._members: frozenset[bytes] = frozenset()
        self._loads: dict[bytes, PeerLoad] = {}
        self.set_members(members)

    @property
    def members(self) -> frozenset[bytes]:
        """The group's trusted model nodes (this node included when the directory lists it)."""
        return self._members

    def set_members(self, members: Iterable[bytes]) -> None:
        """Replace the group (a new verified directory); forgets peers no longer in it."""
        self._members = frozenset(members)
        for peer_id in [p for p in self._loads if p not in self._members]:
            del self._loads[peer_id]

    def receive(self, report: LoadReport, now: float) -> ReportOutcome:
        """Take one peer's report (its signature already checked by the gossip service).

        Args:
            report: a decoded report (:func:`decode_report`).
            now: local time in seconds; the report's age is measured from it.

        Returns:
            ACCEPTED when it became the peer's latest (and reset its forwarded count); else why
            it was ignored (see :class:`ReportOutcome`).
        """
        peer_id = report.peer_id
        if peer_id == self.self_id:
            return ReportOutcome.SELF
        if report.model_id != self.model_id:
            return ReportOutcome.WRONG_GROUP
        if peer_id not in self._members:
            return ReportOutcome.NOT_MEMBER
        last = self._loads.get(peer_id)
        if last is None and len(self._loads) >= self.max_peers:
            return ReportOutcome.FULL
        if last is not None and report.seq <= last.seq:
            return ReportOutcome.REPLAYED
        self._loads[peer_id] = PeerLoad(
            peer_id=peer_id,
            latency_ewma=report.latency,
            reported_requests=report.requests,
            capacity=report.capacity,
            received_at=now,
            seq=report.seq,
            reported_queued=report.queued,
        )
        return ReportOutcome.ACCEPTED

    def note_forwarded(self, peer_id: bytes, count: int = 1) -> None:
        """This node forwarded ``count`` requests to ``peer_id``: they add to its Q until its
        next report. Ignored for a peer with no report (its load is unknown anyway).

        Raises:
            LocalProtocolError: ``count`` < 0.
        """
        if count < 0:
            raise LocalProtocolError("forwarded count must be >= 0")
        last = self._loads.get(peer_id)
        if last is not None:
            self._loads[peer_id] = replace(last, forwarded=last.forwarded + count)

    def get(self, peer_id: bytes) -> PeerLoad | None:
        """The peer's latest load however old, or None when it never reported (for logs)."""
        return self._loads.get(peer_id)

    def fresh(self, peer_id: bytes, now: float) -> PeerLoad | None:
        """The peer's latest load if at most ``max_age`` seconds old, else None (unknown)."""
        last = self._loads.get(peer_id)
        if last is None or last.age(now) > self.max_age:
            return None
        return last

    def fresh_loads(self, now: float) -> dict[bytes, PeerLoad]:
        """Every peer whose load is known (not stale) at ``now``, by peer ID."""
        return {
            p: load for p, load in self._loads.items() if load.age(now) <= self.max_age
        }

    def __len__(self) -> int:
        return len(self._loads)


# ---------------------------------------------------------------------------------- observed

DEFAULT_SHARE_WINDOW = 64
"""Routing decisions over which each peer's share is counted (this node's latest 64 requests:
long enough that one burst does not decide, short enough to follow a change of load)."""
DEFAULT_SHARE_FACTOR = 1.0
"""A peer may take at most this many fair shares (1/k of the requests, k nodes in the group,
this one included) of this node's routing decisions, so a liar takes about 1/k. In the
forwarding simulator's shared-prefix workload (4 and 8 nodes at 60-100% load) the cap cost
0.01-0.023 of KV-cache hit rate and lowered mean latency by 2-6% (a hot prefix's holder no
longer takes more than its share; others cache the prefix too); 1.5 fair shares cost under
0.005 of hit rate and let a liar take 1.5/k."""
DEFAULT_SHARE_BURST = 2
"""Decisions a peer may run ahead of its share (a quiet entry node's first requests, or a
session's prompt and its follow-up, still reach the node that holds their prefix)."""
DEFAULT_MAX_SHARE = 0.5
"""Largest share any one peer may take whatever the group's size and ``share_factor`` (an
operator who raises the factor for a cache-heavy workload still never hands one peer more
than half of this node's requests)."""
DEFAULT_PENALTY = 30.0
"""Seconds a peer is not forwarded to after a forward that failed (timed out, refused, broken,
an answer that did not verify); it doubles with each failure in a row, up to
:data:`DEFAULT_MAX_PENALTY`. 30 s is about three of a user's attempt deadlines: the next
attempts of the same requests go elsewhere."""
DEFAULT_BUSY_BACKOFF = 5.0
"""Seconds a peer that answered a forward OVERLOADED gets no forwards, without a strike: about
five of its load reports, which then say whether it has room again (an honest node is full at
times; a penalty that grows would shut a saturated group's forwarding down)."""
DEFAULT_MAX_PENALTY = 600.0
"""Longest penalty (10 minutes: a peer that keeps failing is tried about six times an hour)."""
DEFAULT_CONTRADICTION = 2.0
"""A peer whose answers came back more than this many times slower than the latency it reports
is judged by what this node measured (an honest peer's answers take its service time plus a
round trip and its queue, which F_LB counts in Q)."""


class ForwardOutcome(enum.Enum):
    """How one forward ended, as the forwarding node saw it (:meth:`PeerLedger.done`)."""

    ANSWERED = "answered"  # its signed answer came back, verified, OK: relayed with a voucher
    BUSY = "busy"  # it answered OVERLOADED (signed, for this request): no room now
    FAILED = "failed"  # timed out, refused, broke, or came back unverifiable or not OK


@dataclass
class _Observed:
    outstanding: int = 0  # forwards sent and not answered or failed yet
    latency: float | None = None  # EWMA of the seconds our forwards took to come back
    strikes: int = 0  # failures, less one per good answer since
    banned_until: float = -math.inf


class PeerLedger:
    """What this node observed of its peers as a forwarder, and what each may take (pure).

    A load report is the reporter's claim; a member that lies "idle, instantly fast" has the
    lowest F_LB and Algorithm 2 hands it every request (issue 16). The ledger holds the claim
    to what this node measured itself and bounds what any peer can take on its own word:

    * **observed load**: :meth:`judge` gives a peer's F_LB with L the latency this node measured
      of its forwards to the peer (EWMA, alpha 1/8, from send to verified answer) when that is
      over :data:`DEFAULT_CONTRADICTION` times the reported L (or L was not reported), Q at least
      the forwards outstanding there, and C at most the capacity the verified directory lists;
    * **penalty**: a forward that failed (timed out, refused, broke, came back unverifiable, not
      OK) bans the peer for ``penalty * 2**(strikes - 1)`` seconds (at most ``max_penalty``);
      a good answer takes one strike off. A peer with strikes left is on probation: one
      forward outstanding at a time. An OVERLOADED answer only pauses forwards to the peer for
      ``busy_backoff`` seconds (no strike);
    * **outstanding**: at most ``max_outstanding`` forwards outstanding per peer, and at most
      the capacity its directory record lists (what it admits from one forwarder:
      :class:`~ps_p2p.serving.dispatch.DispatchConfig`); a peer that holds forwards without
      answering stops getting more;
    * **fair share**: of this node's last ``window`` routing decisions (:meth:`record`, served
      here included; fewer while the window fills) a peer takes at most
      ``ceil(min(max_share, share_factor / k) * decisions) + burst`` (k nodes in the group,
      this one included): no liar takes more than about 1/k of this node's requests, and at
      most half, however idle it claims to be.

    Args:
        max_outstanding: forwards outstanding per peer at most (>= 1).
        window: routing decisions counted for the shares (>= 1).
        share_factor: fair shares (1/k) a peer may take (> 0).
        max_share: share cap whatever k, in (0, 1].
        burst: decisions a peer may run ahead of its share (>= 0).
        penalty: seconds of the first penalty (>= 0); max_penalty: the longest (>= penalty).
        busy_backoff: seconds without forwards after an OVERLOADED answer (>= 0).
        contradiction: factor beyond which the measured latency overrides the reported one (>= 1).
        max_peers: peers observed at most (the group's followed members).

    Raises:
        ConfigError: a bound out of range.
    """

    def __init__(
        self,
        *,
        max_outstanding: int,
        window: int = DEFAULT_SHARE_WINDOW,
        share_factor: float = DEFAULT_SHARE_FACTOR,
        max_share: float = DEFAULT_MAX_SHARE,
        burst: int = DEFAULT_SHARE_BURST,
        penalty: float = DEFAULT_PENALTY,
        max_penalty: float = DEFAULT_MAX_PENALTY,
        busy_backoff: float = DEFAULT_BUSY_BACKOFF,
        contradiction: float = DEFAULT_CONTRADICTION,
        max_peers: int = DEFAULT_MAX_PEERS,
    ) -> None:
        if max_outstanding < 1 or window < 1 or max_peers < 1:
            raise ConfigError("max_outstanding, window and max_peers must be >= 1")
        if not share_factor > 0 or not 0 < max_share <= 1 or burst < 0:
            raise ConfigError("share_factor must be > 0, max_share in (0, 1], burst >= 0")
        if not 0 <= penalty <= max_penalty < math.inf or not 0 <= busy_backoff < math.inf:
            raise ConfigError("penalties must satisfy 0 <= penalty <= max_penalty < inf and "
                              "0 <= busy_backoff < inf")
        if not contradiction >= 1:
            raise ConfigError("contradiction must be >= 1")
        self.max_outstanding = max_outstanding
        self.share_factor = share_factor
        self.max_share = max_share
        self.burst = burst
        self.penalty = penalty
        self.max_penalty = max_penalty
        self.busy_backoff = busy_backoff
        self.contradiction = contradiction
        self.max_peers = max_peers
        self._window: deque[bytes | None] = deque(maxlen=window)
        self._taken: dict[bytes, int] = {}  # peer -> decisions for it in the window
        self._peers: dict[bytes, _Observed] = {}
        self._capacity: dict[bytes, int] = {}  # listed capacity per member (0: not listed)

    # ------------------------------------------------------------------ membership

    def set_members(self, capacities: Mapping[bytes, int]) -> None:
        """The group's followed members with the capacity their directory record lists (0 or
        less: none); observations of others are forgotten."""
        self._capacity = {p: c for p, c in capacities.items()}
        for peer in [p for p in self._peers if p not in self._capacity]:
            del self._peers[peer]

    def _observed(self, peer: bytes) -> _Observed | None:
        obs = self._peers.get(peer)
        if obs is None and peer in self._capacity and len(self._peers) < self.max_peers:
            obs = self._peers[peer] = _Observed()
        return obs

    # ------------------------------------------------------------------ what we decided

    def share_limit(self, group_size: int) -> float:
        """The largest fraction of this node's decisions one peer may take in a group of
        ``group_size`` nodes (this one included, >= 1)."""
        return min(self.max_share, self.share_factor / max(1, group_size))

    def record(self, peer: bytes | None, now: float) -> None:
        """One routing decision of this node: forwarded to ``peer``, or None (served here)."""
        if len(self._window) == self._window.maxlen:
            old = self._window[0]
            if old is not None:
                left = self._taken.get(old, 0) - 1
                if left > 0:
                    self._taken[old] = left
                else:
                    self._taken.pop(old, None)
        self._window.append(peer)
        if peer is not None:
            self._taken[peer] = self._taken.get(peer, 0) + 1

    def taken(self, peer: bytes) -> int:
        """Decisions for ``peer`` among the last ``window``."""
        return self._taken.get(peer, 0)

    # ------------------------------------------------------------------ what came back

    def sent(self, peer: bytes, now: float) -> None:
        """A forward to ``peer`` left; it is outstanding until :meth:`answered` or
        :meth:`failed`."""
        obs = self._observed(peer)
        if obs is not None:
            obs.outstanding += 1

    def answered(self, peer: bytes, seconds: float, now: float) -> None:
        """A forward to ``peer`` came back verified after ``seconds`` (send to answer)."""
        obs = self._observed(peer)
        if obs is None:
            return
        obs.outstanding = max(0, obs.outstanding - 1)
        seconds = max(0.0, seconds)
        if obs.latency is None:
            obs.latency = seconds
        else:
            obs.latency += EWMA_ALPHA * (seconds - obs.latency)
        obs.strikes = max(0, obs.strikes - 1)

    def failed(self, peer: bytes, now: float) -> None:
        """A forward to ``peer`` failed (timed out, refused, broke, or its answer did not
        verify): a strike and a penalty (class docstring)."""
        obs = self._observed(peer)
        if obs is None:
            return
        obs.outstanding = max(0, obs.outstanding - 1)
        obs.strikes += 1
        ban = min(self.max_penalty, self.penalty * 2.0 ** min(obs.strikes - 1, 32))
        obs.banned_until = max(obs.banned_until, now + ban)

    def busy(self, peer: bytes, now: float) -> None:
        """A forward to ``peer`` was answered OVERLOADED: no forwards to it for
        ``busy_backoff`` seconds, no strike."""
        obs = self._observed(peer)
        if obs is None:
            return
        obs.outstanding = max(0, obs.outstanding - 1)
        obs.banned_until = max(obs.banned_until, now + self.busy_backoff)

    def done(self, peer: bytes, outcome: ForwardOutcome, seconds: float, now: float) -> None:
        """How a forward to ``peer`` ended, ``seconds`` after it was sent: :meth:`answered`,
        :meth:`busy` or :meth:`failed` by ``outcome``."""
        if outcome is ForwardOutcome.ANSWERED:
            self.answered(peer, seconds, now)
        elif outcome is ForwardOutcome.BUSY:
            self.busy(peer, now)
        else:
            self.failed(peer, now)

    def outstanding(self, peer: bytes) -> int:
        """Forwards to ``peer`` sent and not come back."""
        obs = self._peers.get(peer)
        return 0 if obs is None else obs.outstanding

    def measured_latency(self, peer: bytes) -> float | None:
        """EWMA of the seconds this node's forwards to ``peer`` took, or None."""
        obs = self._peers.get(peer)
        return None if obs is None else obs.latency

    # ------------------------------------------------------------------ verdicts

    def refusal(self, peer: bytes, now: float, group_size: int) -> str | None:
        """Why ``peer`` may not be forwarded to now (``"penalty"``, ``"outstanding"`` or
        ``"share"``), or None when it may."""
        obs = self._peers.get(peer)
        if obs is not None:
            if obs.banned_until > now:
                return "penalty"
            limit = 1 if obs.strikes else self.max_outstanding
            listed = self._capacity.get(peer, 0)
            if listed > 0:
                limit = min(limit, listed)
            if obs.outstanding >= limit:
                return "outstanding"
        decisions = min(len(self._window) + 1, self._window.maxlen or 1)  # this one included
        if self.taken(peer) >= math.ceil(self.share_limit(group_size) * decisions) + self.burst:
            return "share"
        return None

    def adjust(self, load: PeerLoad) -> PeerLoad:
        """``load`` as this node judges it (class docstring): L the measured latency when the
        reported one is contradicted, C at most the listed capacity, at least the forwards
        outstanding there as requests."""
        latency = load.latency_ewma
        capacity = load.capacity
        listed = self._capacity.get(load.peer_id, 0)
        if listed > 0:
            capacity = min(capacity, listed)
        forwarded = load.forwarded
        obs = self._peers.get(load.peer_id)
        if obs is not None:
            forwarded = max(forwarded, obs.outstanding - load.reported_requests)
            if obs.latency is not None and (
                    latency is None or obs.latency > self.contradiction * latency):
                latency = obs.latency
        if (latency, capacity, forwarded) == (load.latency_ewma, load.capacity, load.forwarded):
            return load
        return replace(load, latency_ewma=latency, capacity=capacity, forwarded=forwarded)

    def judge(self, load: PeerLoad, unknown_latency: float) -> float:
        """``load``'s F_LB in seconds with what this node observed (:meth:`adjust`)."""
        return self.adjust(load).load_factor(unknown_latency)
