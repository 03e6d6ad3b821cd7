"""The onion overlay's state machine: relay, proxy and path owner of one node (pure core).

Source: PlanetServe sec. 3.2 (paths, relaying, proxies), with the fixes of DESIGN.md ("The
anonymous overlay", "Security invariants"). The crypto is :mod:`ps_p2p.crypto.onion`; the tables
are :mod:`ps_p2p.overlay.relay_table`; the wire is in :mod:`ps_p2p.protocols` (this module never
sees a protobuf message: an injected :class:`PayloadCodec` turns the end-to-end payloads between
a user and its proxy into bytes and back).

Inputs are the methods ``receive_*``, ``link_failed``, ``send_failed``, ``tick`` and the path owner's
``open_path`` / ``send_on_path`` / ``close_path``; every one takes ``now`` (seconds, any monotonic
clock) and returns a list of commands (the dataclasses below) for the driver to execute, in order.
Nothing here does I/O, reads a clock or draws global randomness (``random_bytes`` is injected);
it only logs.

Transitions, all in this class:

============================  ===================================================================
input                         effect
============================  ===================================================================
setup (from a peer)           refused unless relaying; unless the predecessor has room in the
                              table and a quota of the replay cache left (both checked before
                              any public-key work: a directory user within its share, anyone
                              else within the small unlisted pool, per peer and per source
                              network); unless the packet opens (its AEAD check) and its
                              ephemeral key is new (only then remembered, for twice the setup
                              window: junk cannot flush the replay cache); unless its issue time
                              is within ``setup_window`` of the wall clock (an older replay
                              fails by time). Then a relay entry is added; the proxy
                              acknowledges at once, a relay forwards the inner packet and waits
                              for its next hop until an RFC 6298 deadline
setup reply                   own path: the acknowledgement is checked (ready or failed); a
                              relay: passed back with its backward layer (or the failure)
cell                          own path: opened and decoded (``BackwardReceived``); a relay: one
                              layer on and passed on; a proxy: opened, its sequence number
                              checked against the path's replay window, decoded, then a probe
                              is answered or a clove delivered (only to directory model nodes,
                              registering its reply tag). An error about one cell costs that
                              cell (counted in ``cells_dropped_by``), never a stream
delivery (at a model node)    passed up (``DeliverToModel``) only from directory users
reply (at a proxy)            passed back under a live reply tag from its model node, after the
                              model node's clove signature verified (only then is the tag spent)
destroy                       own path failed, or the entry removed and the destroy passed on
link failed                   nothing while the connection lives (the next send opens a new
                              stream); otherwise every setup, entry and own path over the peer
                              goes, with destroys to the other side, and a model node with live
                              reply tags is checked (``CheckDestination``: redialled) before
                              they are told it is lost; when ``moved_links``
                              peers or more went so within ``moved_window`` s, and they were at
                              least ``moved_share`` of the peers connected, this node's own
                              address changed (below)
destination checked           a model node that could not be redialled is lost: its live reply
                              tags each answer ``DeliveryFailed``; one that could keeps them
address changed               (detected above, or told: ``address_changed``, e.g. no relay of
                              a NATed node's reservations answers) every own setup in flight is
                              abandoned at once, blaming nobody (``PathFailed.blameless``), the
                              first hops' back-off is forgotten, and own setups opened in the
                              next ``moved_settle`` s are abandoned ``setup_timeout`` s after
                              that settling time if still unanswered
send failed                   a setup whose next hop is unreachable fails at once; a delivery
                              the proxy could not queue answers ``DeliveryFailed``
tick                          expires setups past their deadline (heap-indexed), own paths past
                              their setup deadline, idle entries and spent tags (O(expired))
============================  ===================================================================
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from ps_p2p.crypto import onion
from ps_p2p.errors import CryptoError, RemoteProtocolError, ReplayError
from ps_p2p.overlay.relay_table import (
    DEFAULT_MAX_UNLISTED,
    DEFAULT_MAX_UNLISTED_PER_ORIGIN,
    DEFAULT_MAX_UNLISTED_PER_PEER,
    DEFAULT_MIN_SHARE,
    Direction,
    RelayEntry,
    RelayTable,
)
from ps_p2p.overlay.rtt import RttEstimator, RttTable
from ps_p2p.records import short_peer_id as _short

log = logging.getLogger(__name__)

#: Bytes of a reply tag.
REPLY_TAG_BYTES = 16
#: Response cloves a model node may send under one reply tag unless the user asks for more
#: (a user never sends the same request twice with the same tags).
REPLIES_PER_TAG = 1
#: Most response cloves a user may ask for under one tag: one per segment of a streamed answer
#: (the model node sends at most this many segments; see ps_p2p.serving.dispatch).
MAX_REPLIES_PER_TAG = 256
#: Setup packets remembered to refuse replays (their 32-byte ephemeral keys), at most; each for
#: twice the setup window (a replay after that fails the issue-time check). When it is full of
#: packets younger than that, setups are refused (failing closed: forgetting one would let its
#: replay through, issue 16).
MAX_REMEMBERED_SETUPS = 200_000
#: Setups one directory user may have remembered at once (over twice the setup window, 240 s by
#: default, i.e. ~2 setups/s): a relay of a network of a few thousand users forwards a few per
#: minute from one predecessor. Filling the cache then takes 200,000 / 512 = 391 listed
#: identities.
MAX_SETUPS_PER_PEER = 512
#: ... for a peer the directory does not list (a user keeps 5 paths and rebuilds the dead).
MAX_SETUPS_PER_UNLISTED_PEER = 64
#: ... for all such peers together.
MAX_SETUPS_UNLISTED = 8192
#: Seconds a setup's issue time may differ from a relay's wall clock (see RelayConfig).
SETUP_WINDOW = 120.0
#: Longest reason string put in a setup reply or destroy.
MAX_REASON_CHARS = 200
#: First hops whose own-setup back-off is remembered (least recently timed out forgotten first).
MAX_BACKOFF_PEERS = 4096


# ----------------------------------------------------------------------------- domain payloads


@dataclass(frozen=True)
class Probe:
    """User <-> proxy: a liveness probe (forward) or its answer (backward)."""

    nonce: int


@dataclass(frozen=True)
class DeliverClove:
    """User -> proxy: deliver ``clove`` to model node ``destination``; its answer comes back
    under ``reply_tag`` (16 fresh bytes per request and path; empty: no reply expected), in at
    most ``max_replies`` cloves (0 means 1; a streamed answer has one per segment; the proxy
    caps it at :data:`MAX_REPLIES_PER_TAG`)."""

    destination: bytes
    clove: bytes
    reply_tag: bytes = b""
    max_replies: int = 0


@dataclass(frozen=True)
class SignedClove:
    """Proxy -> user: a response clove with its model node's signature, and the reply tag it
    came under (the user checks the signature against that tag's model node)."""

    clove: bytes
    signature: bytes
    reply_tag: bytes


@dataclass(frozen=True)
class DeliveryFailed:
    """Proxy -> user: a clove could not be delivered, or (``reply_tag`` set) the model node
    that the clove registered under ``reply_tag`` went to was lost before it answered."""

    reason: str
    reply_tag: bytes = b""


ForwardMessage = Probe | DeliverClove
BackwardMessage = Probe | SignedClove | DeliveryFailed


class PayloadCodec(Protocol):
    """Wire form of the end-to-end payloads (implemented in :mod:`ps_p2p.protocols`)."""

    def encode_forward(self, message: ForwardMessage) -> bytes: ...

    def decode_forward(self, data: bytes) -> ForwardMessage:
        """Raises RemoteProtocolError: malformed or empty."""
        ...

    def encode_backward(self, message: BackwardMessage) -> bytes: ...

    def decode_backward(self, data: bytes) -> BackwardMessage | None:
        """None for a kind this node does not use; raises RemoteProtocolError: malformed."""
        ...

    def tamper_clove(self, clove: bytes) -> bytes:
        """TEST ONLY: corrupt a clove's fragment, keeping it parseable."""
        ...


# ----------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class SendSetup:
    peer: bytes
    path_id: bytes
    packet: bytes


@dataclass(frozen=True)
class SendSetupReply:
    peer: bytes
    path_id: bytes
    ok: bool
    ack: bytes = b""
    error: str = ""


@dataclass(frozen=True)
class SendCell:
    peer: bytes
    path_id: bytes
    payload: bytes


@dataclass(frozen=True)
class SendDestroy:
    peer: bytes
    path_id: bytes
    reason: str


@dataclass(frozen=True)
class SendDelivery:
    """Proxy -> model node ``peer``: one request clove. ``path_id`` and ``in_peer`` name the
    path it came on, and ``reply_tag`` the tag its answer would come under, for
    :meth:`RelayCore.send_failed`."""

    peer: bytes
    clove: bytes
    in_peer: bytes
    in_path_id: bytes
    reply_tag: bytes = b""


@dataclass(frozen=True)
class SendReply:
    """Model node -> proxy ``peer``: one signed response clove under ``reply_tag``."""

    peer: bytes
    reply_tag: bytes
    clove: bytes
    signature: bytes


@dataclass(frozen=True)
class DeliverToModel:
    """A request clove for this node's own model service, from proxy ``proxy``."""

    proxy: bytes
    clove: bytes


@dataclass(frozen=True)
class PathReady:
    token: Hashable


@dataclass(frozen=True)
class PathFailed:
    """An own path failed (``was_ready``: it had been ready, i.e. it died;
    ``first_hop_down``: the link to its first hop was lost, which names the culprit, while any
    other failure may be any hop's fault)."""

    token: Hashable
    reason: str
    was_ready: bool
    first_hop_down: bool = False
    #: abandoned by this node because its own address changed (:meth:`RelayCore.address_changed`):
    #: no hop of the path is to blame
    blameless: bool = False


@dataclass(frozen=True)
class AddressChanged:
    """This node's own address changed at ``at`` (seconds, the core's clock): every connection
    it had died at once. Failures of its paths' hops since ``since`` were its own, not theirs
    (the path pool forgives them: :meth:`~ps_p2p.overlay.path_pool.PathPool.address_changed`)."""

    at: float
    since: float


@dataclass(frozen=True)
class BackwardReceived:
    token: Hashable
    message: BackwardMessage


@dataclass(frozen=True)
class CheckDestination:
    """Proxy: the last connection to model node ``peer`` closed (``reason``) while reply tags
    wait for it. The driver dials it again (within a stream-open allowance) and reports with
    :meth:`RelayCore.destination_checked`: a connection that closes says nothing of the node
    being gone (both ends replacing a connection, a reset stream), and one it answers over a
    moment later must find its reply tags still there."""

    peer: bytes
    reason: str


Command = (
    SendSetup | SendSetupReply | SendCell | SendDestroy | SendDelivery | SendReply
    | DeliverToModel | PathReady | PathFailed | AddressChanged | BackwardReceived
    | CheckDestination
)


# ----------------------------------------------------------------------------- state


@dataclass
class RelayConfig:
    """Overlay settings; times in seconds.

    Attributes:
        relay: relay other users' paths (every user node does; model nodes may too).
        serves_model: this node accepts deliveries (model nodes).
        setup_timeout: floor of a hop's wait for its successor's reply (the wait itself is the
            RFC 6298 timeout of the setup round trips to that successor).
        relayed_hop_factor: a successor reached through a Circuit Relay v2 relay (its record
            lists only ``/p2p-circuit`` addresses) starts its RFC 6298 estimate at
            ``relayed_hop_factor * setup_timeout`` instead of ``setup_timeout``, and an own
            setup gets ``(relayed_hop_factor - 1) * setup_timeout`` more per such hop. The
            first contact with a hop is a dial, a secure channel, a multiplexer and a stream
            before the setup round trip: about ``h`` = 5 round trips of one link (TCP 1,
            multistream 1, Noise XX 1.5, Yamux and the onion stream 1, the setup 1). Through a
            relay it is a dial to the relay when not yet connected (up to ``h`` on the leg to
            the relay), the HOP CONNECT and STOP round trips (one on each leg), and then the
            other ``h - 1`` round trips over both legs: ``h + 2 + 2(h - 1) = 3h`` leg round
            trips against ``h``; with legs as long as a direct link, 3 times the direct first
            contact (the relay's own processing comes on top; samples then correct it). Samples take over as from any initial RTO (the floor
            stays ``setup_timeout``), so an established relayed link costs what it measures.
        relay_idle_timeout: relay entries with no traffic for this long are dropped (users probe
            their paths every few seconds, so live paths never idle this long).
        max_relay_entries, max_relay_entries_per_peer: paths relayed at most, in total and for
            one predecessor.
        min_relay_share: the least share of the table a directory user holds as predecessor
            (:meth:`~ps_p2p.overlay.relay_table.RelayTable.listed_share`).
        max_unlisted_entries, max_unlisted_per_peer, max_unlisted_per_origin: paths relayed at
            most for predecessors the directory does not list as users: in total, for one, and
            from one source network (:mod:`ps_p2p.overlay.relay_table`).
        max_reply_tags: live reply tags at most (the oldest is forgotten beyond it).
        reply_tag_ttl: seconds a proxy forwards replies under a request's reply tag.
        destination_check_timeout: seconds a proxy waits for the outcome of a
            :class:`CheckDestination` (its driver redials within the stream-open allowance,
            5 s or more); without one by then the model node is lost.
        setup_window: a setup's issue time (put in the packet by its user) may differ from this
            relay's wall clock by this much, in seconds (clock skew between volunteers' machines
            plus the setup's travel); the replay cache remembers a packet twice as long.
        max_remembered_setups: setups the replay cache holds at most; full, setups are refused.
        max_setups_per_peer, max_setups_per_unlisted_peer, max_setups_unlisted: setups the
            replay cache holds at most for one directory user, for one peer it does not list,
            and for all those together (a rate: entries leave after twice ``setup_window``).
        moved_links, moved_window, moved_share: this node's own address changed (its NAT took
            a new public IP, its uplink moved: every connection it had dies at once, and the
            replies to its setups in flight go to the old address, or onto a peer's old
            connection to it that the peer has not yet found dead) when the last connection to
            at least ``moved_links`` distinct peers closed within ``moved_window`` s and those
            peers were at least ``moved_share`` of the peers connected just before. One peer
            leaving, or a few of many, is no move.
        moved_settle: after an address change, own setups opened within this many seconds are
            abandoned (blaming nobody) when unanswered ``setup_timeout`` s after it: a peer
            that this node redialled from its new address closes its old connection, onto
            which it may write the setup's reply, within 5 s
            (:data:`ps_p2p.protocols.circuit_relay.REDIAL_STALE_AFTER`), so a setup still
            unanswered 5 s after that lost its reply, or is slow, and a new one costs less than
            the 20-50 s own setup deadline (issue 20, NAT remap).
        tamper: TEST ONLY (``--perturb tamper-clove``): corrupt the cells and cloves relayed.
    """

    relay: bool = True
    serves_model: bool = False
    setup_timeout: float = 5.0
    relayed_hop_factor: float = 3.0
    relay_idle_timeout: float = 120.0
    max_relay_entries: int = 10_000
    max_relay_entries_per_peer: int = 1_000
    min_relay_share: int = DEFAULT_MIN_SHARE
    max_unlisted_entries: int = DEFAULT_MAX_UNLISTED
    max_unlisted_per_peer: int = DEFAULT_MAX_UNLISTED_PER_PEER
    max_unlisted_per_origin: int = DEFAULT_MAX_UNLISTED_PER_ORIGIN
    max_reply_tags: int = 100_000
    reply_tag_ttl: float = 600.0
    destination_check_timeout: float = 15.0
    setup_window: float = SETUP_WINDOW
    max_remembered_setups: int = MAX_REMEMBERED_SETUPS
    max_setups_per_peer: int = MAX_SETUPS_PER_PEER
    max_setups_per_unlisted_peer: int = MAX_SETUPS_PER_UNLISTED_PEER
    max_setups_unlisted: int = MAX_SETUPS_UNLISTED
    moved_links: int = 3
    moved_window: float = 5.0
    moved_share: float = 0.5
    moved_settle: float = 5.0
    tamper: bool = False


#: Reasons a cell (or a reply clove at a proxy) is dropped (:attr:`RelayStats.cells_dropped_by`).
DROP_UNKNOWN_PATH = "unknown_path"  # no relay entry nor own path for the link's path ID
DROP_BAD_CELL = "bad_cell"  # a layer or the end-to-end payload did not open or parse
DROP_REPLAYED_CELL = "replayed_cell"  # proxy: an authentic cell seen before (or too old)
DROP_UNKNOWN_REPLY_TAG = "unknown_reply_tag"  # unknown, expired or spent tag, or its sender
DROP_BAD_REPLY_SIGNATURE = "bad_reply_signature"  # the model node's clove signature failed
#: Reasons a delivery is refused (:attr:`RelayStats.deliveries_refused_by`).
REFUSE_NO_MODEL_NODE = "no_model_node"  # proxy: the destination is no directory model node
REFUSE_NOT_SERVING = "not_serving"  # this node serves no model
REFUSE_NOT_USER = "not_user"  # model node: the proxy is no directory user


@dataclass
class RelayStats:
    """Counters (for logs and metrics); they only grow.

    Attributes:
        setups_relayed: setup packets accepted (a relay entry added), as relay or proxy.
        setups_failed: setups refused (bad packet, table full) or failed downstream.
        setups_replayed: replayed setup packets refused.
        setups_stale: authentic setups refused because their issue time is outside the setup
            window (a replay of an old packet, or a user's clock off by more than the window).
        setups_throttled: setups refused because the peer (or all unlisted peers) used their
            quota of the replay cache, or the cache is full.
        setups_over_share: setups refused because the table, the predecessor's share of it or
            the unlisted pool was full (also counted in ``setups_failed``).
        cells_relayed: cells passed on (forward or backward) or opened as proxy.
        cells_dropped_by: cells and reply cloves dropped, by reason (``DROP_*``).
        cloves_proxied: request cloves passed to a model node as proxy.
        deliveries: request cloves accepted from proxies (model nodes).
        deliveries_refused_by: deliveries refused, by reason (``REFUSE_*``).
        replies: response cloves sent to reply proxies (model nodes).
        tampered: cells and cloves corrupted on purpose (TEST ONLY ``tamper``).
        paths_lost_to_link_down: relay entries and own paths torn down because the connection
            to a peer was lost.
    """

    setups_relayed: int = 0
    setups_failed: int = 0
    setups_replayed: int = 0
    setups_over_share: int = 0
    setups_stale: int = 0
    setups_throttled: int = 0
    cells_relayed: int = 0
    cells_dropped_by: dict[str, int] = field(default_factory=dict)
    cloves_proxied: int = 0
    deliveries: int = 0
    deliveries_refused_by: dict[str, int] = field(default_factory=dict)
    replies: int = 0
    tampered: int = 0
    paths_lost_to_link_down: int = 0

    @property
    def cells_dropped(self) -> int:
        """Cells and reply cloves dropped, all reasons."""
        return sum(self.cells_dropped_by.values())

    @property
    def deliveries_refused(self) -> int:
        """Deliveries refused, all reasons."""
        return sum(self.deliveries_refused_by.values())

    def drop_cell(self, reason: str) -> None:
        self.cells_dropped_by[reason] = self.cells_dropped_by.get(reason, 0) + 1

    def refuse_delivery(self, reason: str) -> None:
        self.deliveries_refused_by[reason] = self.deliveries_refused_by.get(reason, 0) + 1


@dataclass
class OwnPath:
    """A path this node owns as a user (``token`` is the caller's handle on it)."""

    path: onion.UserPath
    token: Hashable
    created_at: float
    deadline: float
    ready: bool = False
    #: opened in the settling time after an address change (its deadline is short, and its
    #: timeout blames nobody)
    after_move: bool = False

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.path.first_hop, self.path.first_path_id)


@dataclass
class _PendingSetup:
    entry: RelayEntry
    deadline: float
    sent_at: float


class RelayCore:
    """Relay, proxy and path owner of one node (see the module docstring).

    Args:
        peer_id: this node's peer ID (bytes).
        onion_key: this node's X25519 onion key pair.
        codec: the end-to-end payloads' wire form.
        config: :class:`RelayConfig`.
        is_model_node, is_user: whether a peer is listed in that role by the current directory
            (a proxy delivers only to model nodes; a model node accepts only from users; a
            relay gives directory users their share of the table and anyone else the small
            unlisted pool).
        user_count: how many users the current directory lists (sets a listed
            predecessor's share of the table); the default 0 gives every listed predecessor
            ``max_relay_entries_per_peer``.
        verify_reply: ``verify_reply(model_node, clove, signature) -> bool``: the model node's
            signature on a response clove (a proxy never passes on a reply it could be blamed
            for).
        random_bytes: randomness for path IDs and padding.
        connected_peers: () -> how many peers this node has a connection to now (the
            address-change rule of :class:`RelayConfig`); the default 0 makes
            ``moved_links`` losses in ``moved_window`` s a move.
        is_relayed: whether this node reaches a peer only through a Circuit Relay v2 relay (the
            directory lists it by ``/p2p-circuit`` addresses only, and this node is none of its
            relays); such a next hop's setup deadline starts ``relayed_hop_factor`` times
            longer (:class:`RelayConfig`).
        wall_clock: ``wall_clock(now) -> unix seconds`` for the core's ``now``: own setups carry
            it as their issue time, and a relay refuses setups issued more than
            ``setup_window`` away from it. None (tests only): setups carry 0 and no issue time
            is checked.

    Attributes:
        stats: :class:`RelayStats`; table: the :class:`RelayTable`.
    """

    def __init__(
        self,
        peer_id: bytes,
        onion_key: onion.OnionKeyPair,
        codec: PayloadCodec,
        config: RelayConfig | None = None,
        *,
        is_model_node: Callable[[bytes], bool] = lambda peer: True,
        is_user: Callable[[bytes], bool] = lambda peer: True,
        user_count: Callable[[], int] = lambda: 0,
        verify_reply: Callable[[bytes, bytes, bytes], bool] = lambda peer, clove, sig: True,
        random_bytes: Callable[[int], bytes] = os.urandom,
        wall_clock: Callable[[float], float] | None = None,
        is_relayed: Callable[[bytes], bool] = lambda peer: False,
        connected_peers: Callable[[], int] = lambda: 0,
    ) -> None:
        self.peer_id = peer_id
        self._connected_peers = connected_peers
        # peers whose last connection closed, in closing order: (when, peer), within
        # ``moved_window`` (at most one entry per peer and window: bounded by the peers)
        self._losses: OrderedDict[bytes, float] = OrderedDict()
        #: when this node's own address last changed (-inf: never)
        self.moved_at = -float("inf")
        self.moves = 0
        self._is_relayed = is_relayed
        self._wall_clock = wall_clock
        self.onion_key = onion_key
        self.codec = codec
        self.config = config or RelayConfig()
        self._is_model_node = is_model_node
        self._is_user = is_user
        self._user_count = user_count
        self._verify_reply = verify_reply
        self._random_bytes = random_bytes
        self.table = RelayTable(
            self.config.max_relay_entries, self.config.max_relay_entries_per_peer,
            max_tags=self.config.max_reply_tags,
            min_share=self.config.min_relay_share,
            max_unlisted=self.config.max_unlisted_entries,
            max_unlisted_per_peer=self.config.max_unlisted_per_peer,
            max_unlisted_per_origin=self.config.max_unlisted_per_origin,
        )
        self.stats = RelayStats()
        # model nodes being redialled (CheckDestination) after their last connection closed ->
        # (lost at this time without an outcome, the reason); one per destination with reply
        # tags (bounded by max_reply_tags)
        self._checking: dict[bytes, tuple[float, str]] = {}
        self._paths: dict[tuple[bytes, bytes], OwnPath] = {}
        self._path_deadlines: list[tuple[float, int, tuple[bytes, bytes]]] = []
        # setup packets that opened: ephemeral key -> (forget at, predecessor, listed), in
        # arrival order (= expiry order); counts per predecessor and of unlisted ones
        self._seen_setups: OrderedDict[bytes, tuple[float, bytes, bool]] = OrderedDict()
        self._setups_by_peer: dict[bytes, int] = {}
        self._setups_unlisted = 0
        self._pending: dict[tuple[bytes, bytes], _PendingSetup] = {}
        self._deadlines: list[tuple[float, int, tuple[bytes, bytes]]] = []
        self._seq = itertools.count()
        self._setup_rtt = RttTable(
            initial_rto=self.config.setup_timeout, min_rto=self.config.setup_timeout
        )
        # this node's own setups (every hop there and back): a loaded network gets more time
        # than the floor of ``setup_timeout`` per hop plus one (RFC 6298 on measured setups).
        # The estimate is shared (a loaded machine slows every setup alike) but never backed
        # off; a timeout doubles the deadline of later setups through the same first hop only
        # (RFC 6298 keeps its timer per destination): a frozen first hop lengthened every
        # setup's deadline to 100 s before (issue 20)
        self._own_setup_rtt = RttEstimator(
            initial_rto=0.0, min_rto=0.0, max_rto=self.config.setup_timeout * 4 * onion.MAX_HOPS
        )
        self._own_setup_backoff: OrderedDict[bytes, int] = OrderedDict()  # first hop -> doublings

    # ------------------------------------------------------------------ introspection

    def own_paths(self) -> list[OwnPath]:
        """This node's own paths (setting up or ready)."""
        return list(self._paths.values())

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has work (setup deadlines, idle entries, tag expiry), or None;
        O(1) (stale heap tops only make a tick come early)."""
        times = [d[0] for d in (self._deadlines[:1] + self._path_deadlines[:1])]
        times += [deadline for deadline, _ in self._checking.values()]
        expiry = self.table.next_expiry(self.config.relay_idle_timeout)
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    # ------------------------------------------------------------------ path owner

    def open_path(
        self, hops: list[onion.HopSpec], token: Hashable, now: float
    ) -> tuple[OwnPath, list[Command]]:
        """Start setting up a path through ``hops`` (the last is the proxy).

        Returns:
            the path and its commands; :class:`PathReady` or :class:`PathFailed` (with
            ``token``) follows from a later input.

        Raises:
            CryptoError: an onion key no shared secret can be derived with (low order).
        """
        issued_at = int(self._wall_clock(now)) if self._wall_clock is not None else 0
        path, packet = onion.create_path(
            hops, random_bytes=self._random_bytes, issued_at=issued_at
        )
        relayed = sum(1 for hop in hops if self._is_relayed(hop.peer_id))
        deadline = now + self.own_setup_timeout(hops[0].peer_id, len(hops), relayed)
        settled = self.moved_at + self.config.moved_settle
        after_move = now < settled
        if after_move:  # its reply may go onto a peer's old connection: retried soon
            deadline = min(deadline, settled + self.config.setup_timeout)
        own = OwnPath(path, token, now, deadline, after_move=after_move)
        self._paths[own.key] = own
        heapq.heappush(self._path_deadlines, (deadline, next(self._seq), own.key))
        return own, [SendSetup(path.first_hop, path.first_path_id, packet)]

    def own_setup_timeout(self, first_hop: bytes, hops: int, relayed: int = 0) -> float:
        """Seconds an own setup of ``hops`` hops through ``first_hop`` may take: the larger of
        ``setup_timeout * (hops + 1)``, plus ``(relayed_hop_factor - 1) * setup_timeout`` for
        each of its ``relayed`` hops reached through a relay (:class:`RelayConfig`), and the
        RTO of measured own setups, doubled once per setup through this first hop that timed
        out since one through it succeeded."""
        cfg = self.config
        floor = cfg.setup_timeout * (hops + 1 + (cfg.relayed_hop_factor - 1) * relayed)
        base = max(floor, self._own_setup_rtt.rto)
        doublings = self._own_setup_backoff.get(first_hop, 0)
        return min(self._own_setup_rtt.max_rto, base * 2 ** doublings) if doublings else base

    def send_on_path(self, own: OwnPath, message: ForwardMessage, now: float) -> list[Command]:
        """Seal ``message`` for the proxy as one cell on ``own`` ([] when it is not ready)."""
        if not own.ready or self._paths.get(own.key) is not own:
            return []
        cell = own.path.seal_forward(self.codec.encode_forward(message))
        return [SendCell(own.path.first_hop, own.path.first_path_id, cell)]

    def close_path(self, own: OwnPath, reason: str, now: float) -> list[Command]:
        """Tear ``own`` down (a Destroy to its first hop) and forget it."""
        if self._paths.get(own.key) is not own:
            return []
        del self._paths[own.key]
        return [SendDestroy(own.path.first_hop, own.path.first_path_id, reason[:MAX_REASON_CHARS])]

    def _path_failed(
        self, own: OwnPath, reason: str, *, first_hop_down: bool = False, blameless: bool = False
    ) -> list[Command]:
        if self._paths.get(own.key) is not own:
            return []
        del self._paths[own.key]
        log.info("path via %s failed: %s", _short(own.path.first_hop), reason)
        return [PathFailed(own.token, reason, own.ready, first_hop_down, blameless)]

    def address_changed(self, now: float, since: float | None = None) -> list[Command]:
        """This node's own address changed (its NAT took a new public IP; see
        :class:`RelayConfig`): its own setups in flight are abandoned at once (their replies
        go to the old address or onto a peer's old connection) with destroys to their first
        hops, blaming nobody; the first hops' own-setup back-off is forgotten (their timeouts
        were this node's); setups opened in the next ``moved_settle`` s get a short deadline.

        Args:
            now: when the change was found.
            since: when its first signs came (default ``now - moved_window``).

        Returns:
            :class:`AddressChanged`, then a ``SendDestroy`` and a blameless
            :class:`PathFailed` per abandoned setup.
        """
        since = now - self.config.moved_window if since is None else since
        self.moved_at = now
        self.moves += 1
        self._losses.clear()
        self._own_setup_backoff.clear()
        out: list[Command] = [AddressChanged(now, since)]
        pending = [own for own in self._paths.values() if not own.ready]
        log.warning("own address changed: %d own setups in flight abandoned", len(pending))
        for own in pending:
            out.append(SendDestroy(own.path.first_hop, own.path.first_path_id, "abandoned"))
            out += self._path_failed(own, "abandoned: own address changed", blameless=True)
        return out

    def _peer_lost(self, peer: bytes, now: float) -> list[Command]:
        """The last connection to ``peer`` closed: an address change when enough went at once
        (:class:`RelayConfig`)."""
        cfg = self.config
        self._losses.pop(peer, None)
        self._losses[peer] = now
        while self._losses and next(iter(self._losses.values())) < now - cfg.moved_window:
            self._losses.popitem(last=False)
        lost = len(self._losses)
        if lost < cfg.moved_links or now - self.moved_at < cfg.moved_window:
            return []
        if lost < cfg.moved_share * (lost + self._connected_peers()):
            return []
        return self.address_changed(now, since=next(iter(self._losses.values())))

    # ------------------------------------------------------------------ setup

    def receive_setup(
        self, peer: bytes, path_id: bytes, packet: bytes, now: float,
        origin: Hashable | None = None,
    ) -> list[Command]:
        """A setup packet from ``peer`` for the path ``path_id`` on that link.

        Args:
            origin: ``peer``'s source network (an IPv4 /24 or IPv6 /48 label from the service;
                None for loopback or unknown), counted when ``peer`` is no directory user.

        Raises:
            RemoteProtocolError: a path ID that is not 16 bytes (the frame itself is bad).
        """
        if len(path_id) != onion.PATH_ID_BYTES:
            raise RemoteProtocolError(f"path ID of {len(path_id)} bytes")
        if not self.config.relay:
            return [SendSetupReply(peer, path_id, False, error="not relaying")]
        listed = self._is_user(peer)
        share = self.table.listed_share(self._user_count()) if listed else None
        refusal = self.table.refusal(peer, listed=listed, origin=origin, share=share)
        if refusal is not None:  # before any public-key work
            self.stats.setups_failed += 1
            self.stats.setups_over_share += 1
            log.info("onion setup from %s refused: %s", _short(peer), refusal)
            return [SendSetupReply(peer, path_id, False, error=refusal[:MAX_REASON_CHARS])]
        self._forget_setups(now)
        ephemeral = bytes(packet[:32])
        if ephemeral in self._seen_setups:
            self.stats.setups_replayed += 1
            log.warning("replayed onion setup from %s refused", _short(peer))
            return [SendSetupReply(peer, path_id, False, error="replayed setup packet")]
        throttle = self._setup_quota_refusal(peer, listed)
        if throttle is not None:  # before the X25519 too
            self.stats.setups_failed += 1
            self.stats.setups_throttled += 1
            log.info("onion setup from %s refused: %s", _short(peer), throttle)
            return [SendSetupReply(peer, path_id, False, error=throttle)]
        try:
            hop, next_packet = onion.process_setup(
                self.onion_key, packet, random_bytes=self._random_bytes
            )
        except (CryptoError, RemoteProtocolError) as exc:
            self.stats.setups_failed += 1
            log.info("onion setup from %s refused: %s", _short(peer), exc)
            return [SendSetupReply(peer, path_id, False, error="bad setup packet")]
        # only a packet that opened is remembered: junk cannot flush the cache
        self._remember_setup(ephemeral, peer, listed, now)
        if self._wall_clock is not None:
            skew = hop.issued_at - self._wall_clock(now)
            if abs(skew) > self.config.setup_window:
                self.stats.setups_failed += 1
                self.stats.setups_stale += 1
                log.info("onion setup from %s refused: issued %.0f s %s", _short(peer),
                         abs(skew), "ahead" if skew > 0 else "ago")
                return [SendSetupReply(peer, path_id, False, error="setup issued outside the window")]
        try:
            entry = self.table.add(
                peer, path_id, hop, now, listed=listed, origin=origin, share=share
            )
        except RemoteProtocolError as exc:
            self.stats.setups_failed += 1
            return [SendSetupReply(peer, path_id, False, error=str(exc)[:MAX_REASON_CHARS])]
        self.stats.setups_relayed += 1
        if hop.is_proxy:
            return [SendSetupReply(peer, path_id, True, ack=hop.make_ack())]
        assert hop.next_peer_id is not None and next_packet is not None
        if hop.next_peer_id in (peer, self.peer_id):
            self.table.remove(entry)
            return [SendSetupReply(peer, path_id, False, error="loop in path")]
        key = (hop.next_peer_id, hop.out_path_id)
        deadline = now + self.next_hop_timeout(hop.next_peer_id)
        self._pending[key] = _PendingSetup(entry, deadline, now)
        heapq.heappush(self._deadlines, (deadline, next(self._seq), key))
        if len(self._deadlines) > 4 * len(self._pending) + 1024:  # answered setups pile up
            self._deadlines = [(p.deadline, next(self._seq), k) for k, p in self._pending.items()]
            heapq.heapify(self._deadlines)
        return [SendSetup(hop.next_peer_id, hop.out_path_id, next_packet)]

    def next_hop_timeout(self, peer: bytes) -> float:
        """Seconds a relayed setup waits for the reply of its successor ``peer``: the RFC 6298
        RTO of the setup round trips to ``peer``, started at ``setup_timeout``, or at
        ``relayed_hop_factor * setup_timeout`` when ``peer`` is reached through a relay, until
        the first sample (:class:`RelayConfig`)."""
        return self._setup_rtt.rto(peer, initial_rto=self._hop_initial_rto(peer))

    def _hop_initial_rto(self, peer: bytes) -> float:
        cfg = self.config
        return cfg.setup_timeout * (cfg.relayed_hop_factor if self._is_relayed(peer) else 1.0)

    def _hop_rtt(self, peer: bytes) -> RttEstimator:
        return self._setup_rtt.get(peer, initial_rto=self._hop_initial_rto(peer))

    def _setup_quota_refusal(self, peer: bytes, listed: bool) -> str | None:
        """Why the replay cache may not take one more setup of ``peer``, or None."""
        cfg = self.config
        if len(self._seen_setups) >= cfg.max_remembered_setups:
            return "relay busy (replay cache full)"
        held = self._setups_by_peer.get(peer, 0)
        if listed and held >= cfg.max_setups_per_peer:
            return f"too many setups from one peer ({cfg.max_setups_per_peer} in {self._retention():.0f} s)"
        if not listed:
            if held >= cfg.max_setups_per_unlisted_peer:
                return (f"too many setups from one peer outside the directory "
                        f"({cfg.max_setups_per_unlisted_peer} in {self._retention():.0f} s)")
            if self._setups_unlisted >= cfg.max_setups_unlisted:
                return "too many setups from peers outside the directory"
        return None

    def _retention(self) -> float:
        return 2 * self.config.setup_window

    def _remember_setup(self, ephemeral: bytes, peer: bytes, listed: bool, now: float) -> None:
        self._seen_setups[ephemeral] = (now + self._retention(), peer, listed)
        self._setups_by_peer[peer] = self._setups_by_peer.get(peer, 0) + 1
        self._setups_unlisted += not listed

    def _forget_setups(self, now: float) -> None:
        """Forget setups remembered for twice the setup window (O(forgotten))."""
        seen = self._seen_setups
        while seen:
            ephemeral, (until, peer, listed) = next(iter(seen.items()))
            if now < until:
                break
            del seen[ephemeral]
            left = self._setups_by_peer[peer] - 1
            if left:
                self._setups_by_peer[peer] = left
            else:
                del self._setups_by_peer[peer]
            self._setups_unlisted -= not listed

    def receive_setup_reply(
        self, peer: bytes, path_id: bytes, ok: bool, ack: bytes, error: str, now: float
    ) -> list[Command]:
        """The reply to a setup this node sent to ``peer`` (as path owner or as relay)."""
        key = (peer, path_id)
        own = self._paths.get(key)
        if own is not None and not own.ready:
            if not ok:
                return self._path_failed(own, f"setup refused: {error or 'no reason'}")
            try:
                own.path.check_ack(ack)
            except (CryptoError, RemoteProtocolError) as exc:
                return self._path_failed(own, f"bad acknowledgement: {exc}")
            own.ready = True
            self._own_setup_backoff.pop(own.path.first_hop, None)
            self._own_setup_rtt.sample(now - own.created_at)
            return [PathReady(own.token)]
        pending = self._pending.pop(key, None)
        if pending is None:
            return []
        self._hop_rtt(peer).sample(now - pending.sent_at)
        entry = pending.entry
        if not ok:
            return self._fail_relay_setup(entry, error or "refused downstream")
        try:
            back = entry.hop.relay_backward(ack)
        except (CryptoError, RemoteProtocolError) as exc:
            return self._fail_relay_setup(entry, f"bad acknowledgement size: {exc}")
        return [SendSetupReply(entry.in_peer, entry.in_path_id, True, ack=back)]

    def _fail_relay_setup(self, entry: RelayEntry, error: str) -> list[Command]:
        self.stats.setups_failed += 1
        self.table.remove(entry)
        return [SendSetupReply(entry.in_peer, entry.in_path_id, False, error=error[:MAX_REASON_CHARS])]

    # ------------------------------------------------------------------ cells

    def receive_cell(self, peer: bytes, path_id: bytes, payload: bytes, now: float) -> list[Command]:
        """A cell from ``peer`` on the path ``path_id`` of that link. Never raises: whatever is
        wrong with a cell concerns that cell's path alone."""
        own = self._paths.get((peer, path_id))
        if own is not None:
            return self._own_backward(own, payload)
        found = self.table.lookup(peer, path_id)
        if found is None:
            self.stats.drop_cell(DROP_UNKNOWN_PATH)
            return []
        entry, direction = found
        self.table.touch(entry, now)
        hop = entry.hop
        try:
            if direction is Direction.BACKWARD:
                out: list[Command] = [
                    SendCell(entry.in_peer, entry.in_path_id, hop.relay_backward(payload))
                ]
            elif hop.is_proxy:
                message = self.codec.decode_forward(hop.open_forward(payload))
                out = self._proxy(entry, message, now)
            else:
                cell = hop.relay_forward(payload)
                if self.config.tamper:
                    cell = _flip_byte(cell)
                    self.stats.tampered += 1
                assert hop.next_peer_id is not None
                out = [SendCell(hop.next_peer_id, hop.out_path_id, cell)]
        except ReplayError as exc:
            self.stats.drop_cell(DROP_REPLAYED_CELL)
            log.info("cell on a path from %s dropped: %s", _short(entry.in_peer), exc)
            return []
        except (CryptoError, RemoteProtocolError) as exc:
            self.stats.drop_cell(DROP_BAD_CELL)
            log.warning("cell on a path from %s dropped: %s", _short(entry.in_peer), exc)
            return []
        self.stats.cells_relayed += 1
        return out

    def _proxy(self, entry: RelayEntry, message: ForwardMessage, now: float) -> list[Command]:
        if isinstance(message, Probe):
            return [self._backward(entry, message)]
        destination, clove, tag = message.destination, message.clove, message.reply_tag
        if not self._is_model_node(destination):
            self.stats.refuse_delivery(REFUSE_NO_MODEL_NODE)
            log.info("clove for %s refused: no model node of the directory", _short(destination))
            return [self._backward(entry, DeliveryFailed("destination is no model node"))]
        if len(tag) == REPLY_TAG_BYTES:
            self.table.add_reply_tag(
                tag, entry, destination, now, ttl=self.config.reply_tag_ttl,
                replies=min(max(message.max_replies, REPLIES_PER_TAG), MAX_REPLIES_PER_TAG),
            )
        if self.config.tamper:
            clove = self.codec.tamper_clove(clove)
            self.stats.tampered += 1
        self.stats.cloves_proxied += 1
        if destination == self.peer_id:
            return self.receive_delivery(self.peer_id, clove, now)
        return [SendDelivery(destination, clove, entry.in_peer, entry.in_path_id, tag)]

    def _backward(self, entry: RelayEntry, message: BackwardMessage) -> SendCell:
        cell = entry.hop.seal_backward(self.codec.encode_backward(message))
        return SendCell(entry.in_peer, entry.in_path_id, cell)

    def _own_backward(self, own: OwnPath, payload: bytes) -> list[Command]:
        try:
            message = self.codec.decode_backward(own.path.open_backward(payload))
        except (CryptoError, RemoteProtocolError) as exc:
            self.stats.drop_cell(DROP_BAD_CELL)
            log.warning("backward cell on own path dropped: %s", exc)
            return []
        return [] if message is None else [BackwardReceived(own.token, message)]

    # ------------------------------------------------------------------ deliveries and replies

    def receive_delivery(self, peer: bytes, clove: bytes, now: float) -> list[Command]:
        """A request clove from proxy ``peer``; refused deliveries are dropped, never answered
        by a reset (the proxy's stream carries other users' cloves)."""
        if not self.config.serves_model:
            self.stats.refuse_delivery(REFUSE_NOT_SERVING)
            log.info("delivery from %s refused: this node serves no model", _short(peer))
            return []
        if peer != self.peer_id and not self._is_user(peer):
            self.stats.refuse_delivery(REFUSE_NOT_USER)
            log.info("delivery from %s refused: no user of the directory", _short(peer))
            return []
        self.stats.deliveries += 1
        return [DeliverToModel(peer, clove)]

    def send_reply(self, proxy: bytes, reply_tag: bytes, clove: bytes, signature: bytes) -> list[Command]:
        """Model nodes: one signed response clove to a reply proxy under the request's tag."""
        self.stats.replies += 1
        return [SendReply(proxy, reply_tag, clove, signature)]

    def receive_reply(
        self, peer: bytes, reply_tag: bytes, clove: bytes, signature: bytes, now: float
    ) -> list[Command]:
        """A response clove from model node ``peer`` under ``reply_tag``."""
        entry = self.table.find_reply(reply_tag, peer, now)
        if entry is None:  # unknown, expired or spent tag, or not the tag's model node
            self.stats.drop_cell(DROP_UNKNOWN_REPLY_TAG)
            log.info("reply from %s under an unknown or spent reply tag dropped", _short(peer))
            return []
        if not self._verify_reply(peer, clove, signature):
            # the model node's fault: never pass on a clove that would be pinned on this proxy
            self.stats.drop_cell(DROP_BAD_REPLY_SIGNATURE)
            log.warning("reply from %s with a bad clove signature dropped", _short(peer))
            return []
        self.table.spend_reply(reply_tag)
        self.table.touch(entry, now)
        if self.config.tamper:
            clove = self.codec.tamper_clove(clove)
            self.stats.tampered += 1
        return [self._backward(entry, SignedClove(clove, signature, reply_tag))]

    # ------------------------------------------------------------------ teardown

    def receive_destroy(self, peer: bytes, path_id: bytes, reason: str, now: float) -> list[Command]:
        """A Destroy from ``peer`` for the path ``path_id`` of that link."""
        own = self._paths.get((peer, path_id))
        if own is not None:
            return self._path_failed(own, f"destroyed by the path: {reason or 'no reason'}")
        found = self.table.lookup(peer, path_id)
        if found is None:
            return []
        entry, direction = found
        self.table.remove(entry)
        reason = reason[:MAX_REASON_CHARS]
        if direction is Direction.FORWARD:
            if entry.hop.next_peer_id is not None:
                return [SendDestroy(entry.hop.next_peer_id, entry.hop.out_path_id, reason)]
            return []
        return [SendDestroy(entry.in_peer, entry.in_path_id, reason)]

    def link_failed(self, peer: bytes, reason: str, connected: bool, now: float) -> list[Command]:
        """A stream to ``peer`` failed, or its connection closed (``connected``: a connection
        to it is still open, so the paths over it live on and the next send reopens a stream)."""
        if connected:
            log.info("stream to %s failed (%s); connection alive, paths kept", _short(peer), reason)
            return []
        out: list[Command] = self._peer_lost(peer, now)
        if self.table.has_tags_for(peer) and peer not in self._checking:
            # not lost yet: a model node whose connection was replaced (or that redials us to
            # answer) is still there; destination_checked tells the users if it is not
            self._checking[peer] = (now + self.config.destination_check_timeout, reason)
            out.append(CheckDestination(peer, reason))
        for key, pending in list(self._pending.items()):
            if key[0] == peer:
                del self._pending[key]
                out += self._fail_relay_setup(pending.entry, f"next hop unreachable: {reason}")
        for entry in self.table.remove_peer(peer):
            self.stats.paths_lost_to_link_down += 1
            if entry.in_peer == peer:
                if entry.hop.next_peer_id is not None:
                    out.append(SendDestroy(entry.hop.next_peer_id, entry.hop.out_path_id, "hop down"))
            else:
                out.append(SendDestroy(entry.in_peer, entry.in_path_id, "next hop down"))
        for own in list(self._paths.values()):
            if own.path.first_hop == peer:
                self.stats.paths_lost_to_link_down += 1
                out += self._path_failed(own, f"first hop down: {reason}", first_hop_down=True)
        return out

    def destination_checked(self, peer: bytes, reachable: bool, reason: str,
                            now: float) -> list[Command]:
        """The outcome of a :class:`CheckDestination` for model node ``peer``: ``reachable``
        (a connection to it is open again) keeps its reply tags, so an answer it sends still
        goes back; otherwise it is lost (:meth:`destination_lost`, with ``reason``)."""
        if self._checking.pop(peer, None) is None:
            return []  # already decided (tick: no outcome in time)
        if reachable:
            log.info("model node %s reachable again after its connection closed", _short(peer))
            return []
        return self.destination_lost(peer, reason, now)

    def destination_lost(self, peer: bytes, reason: str, now: float) -> list[Command]:
        """Proxies: the connection to model node ``peer`` is gone (it died or left). Every
        user with a live reply tag for it hears so at once, one ``DeliveryFailed`` carrying
        that tag back on the tag's path, instead of waiting out its request's deadline; the
        tags are forgotten (a reply under them could no longer come from this connection).

        Returns:
            one ``SendCell`` per live reply tag registered for ``peer``; [] when none.
        """
        out: list[Command] = []
        for tag, entry in self.table.take_tags_for(peer, now):
            message = DeliveryFailed(f"model node lost: {reason}"[:MAX_REASON_CHARS], tag)
            out.append(self._backward(entry, message))
        if out:
            log.info("model node %s lost (%s): told %d reply tag(s)", _short(peer), reason, len(out))
        return out

    def send_failed(self, command: Command, now: float) -> list[Command]:
        """The driver could not queue ``command`` (queue full, or its peer is in dial back-off)."""
        if isinstance(command, SendSetup):
            pending = self._pending.pop((command.peer, command.path_id), None)
            if pending is not None:
                return self._fail_relay_setup(pending.entry, "next hop unreachable")
            own = self._paths.get((command.peer, command.path_id))
            if own is not None:
                return self._path_failed(own, "first hop unreachable", first_hop_down=True)
        elif isinstance(command, SendDelivery):
            found = self.table.lookup(command.in_peer, command.in_path_id)
            if found is not None:
                # with the tag, the user counts it against this attempt (RequestCore.delivery_failed)
                return [self._backward(found[0], DeliveryFailed(
                    "proxy could not reach the model node", command.reply_tag
                ))]
        return []

    # ------------------------------------------------------------------ timers

    def tick(self, now: float) -> list[Command]:
        """Expire setups past their deadline, idle entries and spent tags (O(expired)), and
        lose the model nodes whose :class:`CheckDestination` had no outcome in time."""
        out: list[Command] = []
        for peer, (deadline, reason) in list(self._checking.items()):
            if deadline <= now:
                del self._checking[peer]
                out += self.destination_lost(peer, f"{reason}; no redial in time", now)
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, key = heapq.heappop(self._deadlines)
            pending = self._pending.get(key)
            if pending is None or pending.deadline != deadline:
                continue  # answered, or replaced by a newer setup
            del self._pending[key]
            self._hop_rtt(key[0]).timed_out()
            out += self._fail_relay_setup(pending.entry, "timeout waiting for the next hop")
        while self._path_deadlines and self._path_deadlines[0][0] <= now:
            _, _, key = heapq.heappop(self._path_deadlines)
            own = self._paths.get(key)
            if own is not None and not own.ready and now >= own.deadline and own.after_move:
                out.append(SendDestroy(own.path.first_hop, own.path.first_path_id, "abandoned"))
                out += self._path_failed(own, "abandoned: unanswered after the address change",
                                         blameless=True)
            elif own is not None and not own.ready and now >= own.deadline:
                first = own.path.first_hop
                self._own_setup_backoff[first] = min(self._own_setup_backoff.get(first, 0) + 1, 8)
                self._own_setup_backoff.move_to_end(first)
                while len(self._own_setup_backoff) > MAX_BACKOFF_PEERS:
                    self._own_setup_backoff.popitem(last=False)
                out += self._path_failed(own, "setup timed out")
        for entry in self.table.expire(now, self.config.relay_idle_timeout):
            log.debug("relay entry from %s idle, dropped", _short(entry.in_peer))
        return out


def _flip_byte(data: bytes) -> bytes:
    if not data:
        return data
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]


__all__ = [
    "DROP_BAD_CELL",
    "DROP_BAD_REPLY_SIGNATURE",
    "DROP_REPLAYED_CELL",
    "DROP_UNKNOWN_PATH",
    "DROP_UNKNOWN_REPLY_TAG",
    "REFUSE_NOT_SERVING",
    "REFUSE_NOT_USER",
    "REFUSE_NO_MODEL_NODE",
    "REPLY_TAG_BYTES",
    "AddressChanged",
    "BackwardMessage",
    "BackwardReceived",
    "CheckDestination",
    "Command",
    "DeliverClove",
    "DeliverToModel",
    "DeliveryFailed",
    "ForwardMessage",
    "OwnPath",
    "PathFailed",
    "PathReady",
    "PayloadCodec",
    "Probe",
    "RelayConfig",
    "RelayCore",
    "RelayStats",
    "SendCell",
    "SendDelivery",
    "SendDestroy",
    "SendReply",
    "SendSetup",
    "SendSetupReply",
    "SignedClove",
]
