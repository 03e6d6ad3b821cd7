"""The anonymous overlay service: onion path setup and clove relaying (PlanetServe sec. 3.2).

Protocols:

* ``/planetserve/onion/1.0.0`` — :class:`~ps_p2p.pb.planetserve.v1.onion_pb2.OnionFrame`: a
  fixed-size setup packet travels hop by hop (:func:`ps_p2p.crypto.onion.process_setup`); the
  acknowledgement returns along the path, each hop adding its backward layer.
* ``/planetserve/clove/1.0.0`` — :class:`~ps_p2p.pb.planetserve.v1.clove_pb2.CloveFrame`: cells
  (link-local path ID + layered payload) and Destroy, on links that many paths share.
* ``/planetserve/deliver/1.0.0`` — :class:`~ps_p2p.pb.planetserve.v1.clove_pb2.DeliveryFrame`:
  Delivery (proxy -> model node) and Reply (model node -> proxy), on links of their own, so that
  a bad delivery (e.g. to a node that is no model node) can never reset a relay link.

Failure containment (DESIGN.md "Security invariants"): an error about one path, cell or delivery
costs that cell or delivery only (logged and counted), never a stream other paths share. Only a
frame that is itself malformed (the direct neighbour broke the protocol) resets its stream, and a
broken stream tears paths down only when the connection to that peer is gone: a stream that fails
while the connection lives is reopened by the next send. A proxy delivers only to model nodes of
the directory (and registers reply tags only for them); a model node accepts deliveries only
from users of the directory (proxies are users).

One :class:`OverlayService` per host plays every overlay part the node has: relay and proxy (every
user node relays), path owner (user nodes), and clove sink/source for model nodes (through the
``on_delivery`` callback and :meth:`OverlayService.send_reply`).

Concurrency: frames are handled synchronously right after they are decoded; a handler never awaits
between reading the relay table and updating it, so under trio's cooperative scheduling every
frame is applied atomically, in arrival order per stream. Cells carry their own per-hop IVs
(:mod:`ps_p2p.crypto.onion`), so no counter has to stay in step across hops. Outgoing frames go
to :class:`~ps_p2p.protocols.links.LinkManager` queues, which never block. Timers (setup
deadlines, idle expiry) run in one task that calls :meth:`OverlayService.tick`; expiry is
indexed (O(expired) per tick).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from google.protobuf.message import DecodeError as PbDecodeError
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from ps_p2p.crypto import onion
from ps_p2p import records
from ps_p2p.records import short_peer_id as _short
from ps_p2p.errors import CryptoError, PsError, RemoteProtocolError
from ps_p2p.overlay.relay_table import Direction, RelayEntry, RelayTable
from ps_p2p.overlay.rtt import RttTable
from ps_p2p.pb.planetserve.v1 import clove_pb2, onion_pb2
from ps_p2p.protocols.links import LinkManager, make_frame_handler

log = logging.getLogger(__name__)

ONION_PROTOCOL_ID = "/planetserve/onion/1.0.0"
CLOVE_PROTOCOL_ID = "/planetserve/clove/1.0.0"
DELIVER_PROTOCOL_ID = "/planetserve/deliver/1.0.0"

#: Bytes of a reply tag (ps_p2p.overlay.relay_table).
REPLY_TAG_BYTES = 16
#: Response cloves a model node may send under one reply tag: one (a user never sends the same
#: request twice with the same tags).
REPLIES_PER_TAG = 1
#: Setup packets remembered to refuse replays (32 bytes each; oldest forgotten first).
MAX_REMEMBERED_SETUPS = 200_000
#: Largest onion frame: a setup packet plus a reply (fixed sizes) and protobuf overhead.
ONION_MAX_FRAME = 4 * 1024
#: Largest clove frame: the biggest cell bucket plus protobuf overhead.
CLOVE_MAX_FRAME = onion.CELL_BUCKETS[-1] + 1024
#: Largest deliver frame: a clove (at most a cell's payload) plus a signature and overhead.
DELIVER_MAX_FRAME = onion.CELL_BUCKETS[-1] + 1024


@dataclass
class OverlayConfig:
    """Overlay settings; times in seconds.

    Attributes:
        relay: relay other users' paths (every user node does; model nodes may too).
        setup_timeout: a hop waits this long for its successor's reply before failing the setup.
        relay_idle_timeout: relay entries with no traffic for this long are dropped (users probe
            their paths every few seconds, so live paths never idle this long).
        max_relay_entries: paths relayed at most (a peer-controlled count).
        reply_tag_ttl: seconds a proxy forwards replies under a request's reply tag.
        tamper: TEST ONLY (``--perturb tamper-clove``): corrupt the cells and cloves this node relays.
    """

    relay: bool = True
    setup_timeout: float = 5.0
    relay_idle_timeout: float = 120.0
    max_relay_entries: int = 10_000
    reply_tag_ttl: float = 600.0
    tamper: bool = False


@dataclass
class PathHandle:
    """A path owned by this node as a user.

    ``ready`` is set when the acknowledgement from the proxy checked out; ``done`` when the path
    failed or died (``error`` says why). ``on_backward`` receives each opened backward payload.
    """

    path: onion.UserPath
    created_at: float
    deadline: float
    ready: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    error: str | None = None
    is_ready: bool = False
    cells_sent: int = 0
    cells_received: int = 0

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.path.first_hop, self.path.first_path_id)

    @property
    def alive(self) -> bool:
        return self.is_ready and not self.done.is_set()


@dataclass
class _PendingSetup:
    entry: RelayEntry
    deadline: float
    sent_at: float


@dataclass
class OverlayStats:
    """Counters for logs and metrics."""

    setups_relayed: int = 0
    setups_failed: int = 0
    setups_replayed: int = 0
    cells_relayed: int = 0
    cells_dropped: int = 0
    deliveries: int = 0
    deliveries_refused: int = 0
    #: relay entries and own paths torn down because the connection to a peer was lost
    paths_lost_to_link_down: int = 0
    replies: int = 0
    tampered: int = 0


class OverlayService:
    """Relay, proxy and path owner for one host.

    Args:
        host: a running py-libp2p host.
        onion_key: this node's X25519 onion key pair (its public half is in its node record).
        config: :class:`OverlayConfig`.
        on_delivery: model nodes: ``on_delivery(proxy_peer_id, clove_bytes)`` for each request
            clove a proxy delivers; None elsewhere (deliveries are then refused).
        on_backward: users: ``on_backward(handle, payload)`` with each BackwardPayload (parsed)
            arriving on one of this node's paths.
        on_path_down: users: ``on_path_down(handle)`` when a ready path dies.
        directory: returns the current verified directory (or None): a proxy delivers only to
            its model nodes, a model node accepts deliveries only from its users. None (tests
            only) trusts every peer.
        clock: returns trio's current time (seconds); injectable for tests.
        random_bytes: randomness for path IDs and padding.
    """

    def __init__(
        self,
        host: IHost,
        onion_key: onion.OnionKeyPair,
        config: OverlayConfig | None = None,
        *,
        on_delivery: Callable[[bytes, bytes], None] | None = None,
        on_backward: Callable[[PathHandle, clove_pb2.BackwardPayload], None] | None = None,
        on_path_down: Callable[[PathHandle], None] | None = None,
        directory: Callable[[], records.Directory | None] | None = None,
        clock: Callable[[], float] = trio.current_time,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.host = host
        self.peer_id = host.get_id().to_bytes()
        self.onion_key = onion_key
        self.config = config or OverlayConfig()
        self.on_delivery = on_delivery
        self.on_backward = on_backward
        self.on_path_down = on_path_down
        self._directory = directory
        self._clock = clock
        self._random_bytes = random_bytes
        self.table = RelayTable(max_entries=self.config.max_relay_entries)
        self.stats = OverlayStats()
        self._paths: dict[tuple[bytes, bytes], PathHandle] = {}
        self._seen_ephemeral: OrderedDict[bytes, None] = OrderedDict()
        # setups waiting for the next hop's reply, and their deadlines as a heap (indexed expiry)
        self._pending: dict[tuple[bytes, bytes], _PendingSetup] = {}
        self._deadlines: list[tuple[float, int, tuple[bytes, bytes]]] = []
        self._seq = itertools.count()
        # setup round trips to each next hop (RFC 6298): a loaded hop gets more time
        self._setup_rtt = RttTable(
            initial_rto=self.config.setup_timeout, min_rto=self.config.setup_timeout
        )
        self._onion_links: LinkManager | None = None
        self._clove_links: LinkManager | None = None
        self._deliver_links: LinkManager | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register the stream handlers and serve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._onion_links = LinkManager(
                self.host, nursery, ONION_PROTOCOL_ID, on_link_down=self._link_down
            )
            self._clove_links = LinkManager(
                self.host, nursery, CLOVE_PROTOCOL_ID, on_link_down=self._link_down
            )
            # a delivery link that fails costs the deliveries queued on it, never a path
            self._deliver_links = LinkManager(self.host, nursery, DELIVER_PROTOCOL_ID)
            self.host.set_stream_handler(
                TProtocol(ONION_PROTOCOL_ID),
                make_frame_handler(ONION_PROTOCOL_ID, ONION_MAX_FRAME, self._on_onion_frame),
            )
            self.host.set_stream_handler(
                TProtocol(CLOVE_PROTOCOL_ID),
                make_frame_handler(CLOVE_PROTOCOL_ID, CLOVE_MAX_FRAME, self._on_clove_frame),
            )
            self.host.set_stream_handler(
                TProtocol(DELIVER_PROTOCOL_ID),
                make_frame_handler(DELIVER_PROTOCOL_ID, DELIVER_MAX_FRAME, self._on_deliver_frame),
            )
            task_status.started()
            try:
                while True:
                    await trio.sleep(0.5)  # a timer tick, not a wait for a condition
                    self.tick(self._clock())
            finally:
                self._onion_links.close_all()
                self._clove_links.close_all()
                self._deliver_links.close_all()

    def tick(self, now: float) -> None:
        """Expire setups past their deadline and idle relay entries (O(expired))."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, key = heapq.heappop(self._deadlines)
            pending = self._pending.get(key)
            if pending is None or pending.deadline != deadline:
                continue  # answered, or replaced by a newer setup
            del self._pending[key]
            self._setup_rtt.get(key[0]).timed_out()
            self._fail_relay_setup(pending.entry, "timeout waiting for the next hop")
        for handle in list(self._paths.values()):
            if not handle.is_ready and not handle.done.is_set() and now >= handle.deadline:
                self._path_failed(handle, "setup timed out")
        for entry in self.table.expire(now, self.config.relay_idle_timeout):
            log.debug("relay entry from %s idle, dropped", _short(entry.in_peer))

    # ------------------------------------------------------------------ user API

    def open_path(self, hops: list[onion.HopSpec]) -> PathHandle:
        """Start setting up a path through ``hops`` (the last is the proxy); returns at once.

        Await ``handle.ready`` (or ``handle.done`` for failure); the setup deadline is
        ``config.setup_timeout`` per hop.
        """
        path, packet = onion.create_path(hops, random_bytes=self._random_bytes)
        now = self._clock()
        handle = PathHandle(
            path=path,
            created_at=now,
            deadline=now + self.config.setup_timeout * (len(hops) + 1),
        )
        self._paths[handle.key] = handle
        frame = onion_pb2.OnionFrame(
            setup=onion_pb2.OnionSetup(path_id=path.first_path_id, packet=packet)
        )
        assert self._onion_links is not None, "OverlayService.run() has not started"
        if not self._onion_links.send(path.first_hop, frame.SerializeToString()):
            self._path_failed(handle, "first hop queue full")
        return handle

    def send_on_path(self, handle: PathHandle, payload: clove_pb2.ForwardPayload) -> bool:
        """Seal ``payload`` for the proxy and send it as one cell on ``handle``'s path.

        Returns False when the path is not alive or the first hop's queue is full.
        """
        if not handle.alive:
            return False
        cell = handle.path.seal_forward(payload.SerializeToString())
        handle.cells_sent += 1
        return self._send_cell(handle.path.first_hop, handle.path.first_path_id, cell)

    def close_path(self, handle: PathHandle, reason: str = "closed by user") -> None:
        """Tear ``handle``'s path down (Destroy to the first hop) and forget it."""
        if self._paths.pop(handle.key, None) is None:
            return
        if not handle.done.is_set():
            handle.error = reason
            handle.done.set()
        self._send_destroy(handle.path.first_hop, handle.path.first_path_id, reason)

    def paths(self) -> list[PathHandle]:
        """This node's own paths (any state)."""
        return list(self._paths.values())

    # ------------------------------------------------------------------ model node API

    def send_reply(
        self, proxy: bytes, reply_tag: bytes, clove: bytes, signature: bytes = b""
    ) -> bool:
        """Model nodes: send one signed response clove to a reply proxy, under the request's
        reply tag for that proxy."""
        frame = clove_pb2.DeliveryFrame(
            reply=clove_pb2.Reply(reply_tag=reply_tag, clove=clove, signature=signature)
        )
        self.stats.replies += 1
        assert self._deliver_links is not None
        return self._deliver_links.send(proxy, frame.SerializeToString())

    # ------------------------------------------------------------------ onion frames

    def _on_onion_frame(self, peer: bytes, data: bytes) -> None:
        frame = _parse(onion_pb2.OnionFrame, data)
        kind = frame.WhichOneof("kind")
        if kind == "setup":
            self._on_setup(peer, frame.setup)
        elif kind == "reply":
            self._on_setup_reply(peer, frame.reply)
        else:
            raise RemoteProtocolError("empty onion frame")

    def _on_setup(self, peer: bytes, setup: onion_pb2.OnionSetup) -> None:
        if len(setup.path_id) != onion.PATH_ID_BYTES:
            raise RemoteProtocolError(f"path ID of {len(setup.path_id)} bytes")
        if not self.config.relay:
            self._reply_setup(peer, setup.path_id, ok=False, error="not relaying")
            return
        # A replayed packet would rebuild the same hop keys: refuse every ephemeral key twice.
        # Only packets that passed the layer's AEAD check are remembered, so junk cannot flush
        # the cache.
        ephemeral = bytes(setup.packet[:32])
        if ephemeral in self._seen_ephemeral:
            self.stats.setups_replayed += 1
            log.warning("replayed onion setup from %s refused", _short(peer))
            self._reply_setup(peer, setup.path_id, ok=False, error="replayed setup packet")
            return
        try:
            hop, next_packet = onion.process_setup(
                self.onion_key, setup.packet, random_bytes=self._random_bytes
            )
        except (CryptoError, RemoteProtocolError) as exc:
            self.stats.setups_failed += 1
            log.info("onion setup from %s refused: %s", _short(peer), exc)
            self._reply_setup(peer, setup.path_id, ok=False, error="bad setup packet")
            return
        self._seen_ephemeral[ephemeral] = None
        while len(self._seen_ephemeral) > MAX_REMEMBERED_SETUPS:
            self._seen_ephemeral.popitem(last=False)
        now = self._clock()
        try:
            entry = self.table.add(peer, setup.path_id, hop, now)
        except RemoteProtocolError as exc:
            self.stats.setups_failed += 1
            self._reply_setup(peer, setup.path_id, ok=False, error=str(exc))
            return
        self.stats.setups_relayed += 1
        if hop.is_proxy:
            self._reply_setup(peer, setup.path_id, ok=True, ack=hop.make_ack())
            return
        assert hop.next_peer_id is not None and next_packet is not None
        if hop.next_peer_id in (peer, self.peer_id):
            self.table.remove(entry)
            self._reply_setup(peer, setup.path_id, ok=False, error="loop in path")
            return
        key = (hop.next_peer_id, hop.out_path_id)
        deadline = now + self._setup_rtt.rto(hop.next_peer_id)
        self._pending[key] = _PendingSetup(entry, deadline, now)
        heapq.heappush(self._deadlines, (deadline, next(self._seq), key))
        if len(self._deadlines) > 4 * len(self._pending) + 1024:  # answered setups pile up
            self._deadlines = [
                (p.deadline, next(self._seq), k) for k, p in self._pending.items()
            ]
            heapq.heapify(self._deadlines)
        frame = onion_pb2.OnionFrame(
            setup=onion_pb2.OnionSetup(path_id=hop.out_path_id, packet=next_packet)
        )
        assert self._onion_links is not None
        if not self._onion_links.send(hop.next_peer_id, frame.SerializeToString()):
            # queue full, or the next hop could not be dialled a moment ago (back-off)
            self._pending.pop(key, None)
            self._fail_relay_setup(entry, "next hop unreachable")

    def _on_setup_reply(self, peer: bytes, reply: onion_pb2.OnionSetupReply) -> None:
        key = (peer, reply.path_id)
        handle = self._paths.get(key)
        if handle is not None and not handle.is_ready:
            if not reply.ok:
                self._path_failed(handle, f"setup refused: {reply.error or 'no reason'}")
                return
            try:
                handle.path.check_ack(reply.ack)
            except (CryptoError, RemoteProtocolError) as exc:
                self._path_failed(handle, f"bad acknowledgement: {exc}")
                return
            handle.is_ready = True
            handle.ready.set()
            return
        pending = self._pending.pop(key, None)
        if pending is None:
            log.debug("setup reply for unknown path from %s", _short(peer))
            return
        entry = pending.entry
        self._setup_rtt.get(peer).sample(self._clock() - pending.sent_at)
        if not reply.ok:
            self._fail_relay_setup(entry, reply.error or "refused downstream")
            return
        try:
            ack = entry.hop.relay_backward(reply.ack)
        except (CryptoError, RemoteProtocolError) as exc:
            self._fail_relay_setup(entry, f"bad acknowledgement size: {exc}")
            return
        self._reply_setup(entry.in_peer, entry.in_path_id, ok=True, ack=ack)

    def _fail_relay_setup(self, entry: RelayEntry, error: str) -> None:
        self.stats.setups_failed += 1
        self.table.remove(entry)
        self._reply_setup(entry.in_peer, entry.in_path_id, ok=False, error=error)

    def _reply_setup(
        self, peer: bytes, path_id: bytes, *, ok: bool, ack: bytes = b"", error: str = ""
    ) -> None:
        frame = onion_pb2.OnionFrame(
            reply=onion_pb2.OnionSetupReply(path_id=path_id, ok=ok, ack=ack, error=error[:200])
        )
        assert self._onion_links is not None
        self._onion_links.send(peer, frame.SerializeToString())

    # ------------------------------------------------------------------ clove frames

    def _on_clove_frame(self, peer: bytes, data: bytes) -> None:
        frame = _parse(clove_pb2.CloveFrame, data)
        kind = frame.WhichOneof("kind")
        if kind == "cell":
            self._on_cell(peer, frame.cell.path_id, frame.cell.payload)
        elif kind == "destroy":
            self._on_destroy(peer, frame.destroy.path_id, frame.destroy.reason)
        else:
            raise RemoteProtocolError("empty clove frame")

    def _on_deliver_frame(self, peer: bytes, data: bytes) -> None:
        frame = _parse(clove_pb2.DeliveryFrame, data)
        kind = frame.WhichOneof("kind")
        if kind == "delivery":
            self._on_delivery(peer, frame.delivery.clove)
        elif kind == "reply":
            self._on_reply(peer, frame.reply.reply_tag, frame.reply.clove, frame.reply.signature)
        else:
            raise RemoteProtocolError("empty deliver frame")

    def _on_cell(self, peer: bytes, path_id: bytes, payload: bytes) -> None:
        now = self._clock()
        handle = self._paths.get((peer, path_id))
        if handle is not None:
            self._on_own_backward(handle, payload)
            return
        found = self.table.lookup(peer, path_id)
        if found is None:
            self.stats.cells_dropped += 1
            log.debug("cell for unknown path ID from %s dropped", _short(peer))
            return
        entry, direction = found
        self.table.touch(entry, now)
        hop = entry.hop
        try:
            if direction is Direction.BACKWARD:
                out = hop.relay_backward(payload)
                self._send_cell(entry.in_peer, entry.in_path_id, out)
            elif hop.is_proxy:
                plaintext = hop.open_forward(payload)
                # what the path owner asks of its proxy concerns that path alone
                self._on_proxy_payload(entry, plaintext)
            else:
                out = hop.relay_forward(payload)
                if self.config.tamper:
                    out = _flip_byte(out)
                    self.stats.tampered += 1
                assert hop.next_peer_id is not None
                self._send_cell(hop.next_peer_id, hop.out_path_id, out)
            self.stats.cells_relayed += 1
        except (CryptoError, RemoteProtocolError) as exc:
            self.stats.cells_dropped += 1
            log.warning("cell on a path from %s dropped: %s", _short(entry.in_peer), exc)

    def _on_proxy_payload(self, entry: RelayEntry, plaintext: bytes) -> None:
        payload = _parse(clove_pb2.ForwardPayload, plaintext)
        kind = payload.WhichOneof("kind")
        if kind == "probe":
            back = clove_pb2.BackwardPayload(probe_reply=payload.probe)
            self._send_backward(entry, back)
        elif kind == "deliver":
            destination = payload.deliver.destination
            clove = payload.deliver.clove
            tag = payload.deliver.reply_tag
            if not self._is_model_node(destination):
                self.stats.deliveries_refused += 1
                log.info("clove for %s refused: no model node of the directory", _short(destination))
                self._send_backward(
                    entry, clove_pb2.BackwardPayload(delivery_failed="destination is no model node")
                )
                return
            if len(tag) == REPLY_TAG_BYTES:
                self.table.add_reply_tag(
                    tag, entry, destination, self._clock(),
                    ttl=self.config.reply_tag_ttl, replies=REPLIES_PER_TAG,
                )
            if self.config.tamper:
                clove = _tamper_clove(clove)
                self.stats.tampered += 1
            if destination == self.peer_id:
                self._on_delivery(self.peer_id, clove)
                return
            frame = clove_pb2.DeliveryFrame(delivery=clove_pb2.Delivery(clove=clove))
            assert self._deliver_links is not None
            if not self._deliver_links.send(destination, frame.SerializeToString()):
                self._send_backward(
                    entry, clove_pb2.BackwardPayload(delivery_failed="proxy queue full")
                )
        else:
            raise RemoteProtocolError("empty forward payload")

    def _send_backward(self, entry: RelayEntry, payload: clove_pb2.BackwardPayload) -> None:
        cell = entry.hop.seal_backward(payload.SerializeToString())
        self._send_cell(entry.in_peer, entry.in_path_id, cell)

    def _on_own_backward(self, handle: PathHandle, payload: bytes) -> None:
        try:
            plaintext = handle.path.open_backward(payload)
            message = _parse(clove_pb2.BackwardPayload, plaintext)
        except (CryptoError, RemoteProtocolError) as exc:
            log.warning("backward cell on own path dropped: %s", exc)
            return
        handle.cells_received += 1
        if self.on_backward is not None:
            self.on_backward(handle, message)

    def _on_delivery(self, peer: bytes, clove: bytes) -> None:
        # A refused delivery is dropped, never answered by a reset: the proxy's deliver stream
        # carries other users' cloves.
        if self.on_delivery is None:
            self.stats.deliveries_refused += 1
            log.info("delivery from %s refused: this node serves no model", _short(peer))
            return
        if peer != self.peer_id and not self._is_user(peer):
            self.stats.deliveries_refused += 1
            log.info("delivery from %s refused: no user of the directory", _short(peer))
            return
        self.stats.deliveries += 1
        self.on_delivery(peer, clove)

    def _is_model_node(self, peer: bytes) -> bool:
        return self._has_role(peer, records.Role.MODEL)

    def _is_user(self, peer: bytes) -> bool:
        return self._has_role(peer, records.Role.USER)

    def _has_role(self, peer: bytes, role: records.Role) -> bool:
        if self._directory is None:
            return True
        directory = self._directory()
        record = directory.record(peer) if directory is not None else None
        return record is not None and role in record.roles

    def _on_reply(self, peer: bytes, reply_tag: bytes, clove: bytes, signature: bytes) -> None:
        entry = self.table.find_reply(reply_tag, peer, self._clock())
        if entry is None:
            # unknown, expired or spent tag, or a model node this path never delivered it to
            self.stats.cells_dropped += 1
            log.info("reply from %s under an unknown or spent reply tag dropped", _short(peer))
            return
        try:  # a badly signed clove is the model node's fault: never pass it on to be pinned on us
            message_id = _parse(clove_pb2.Clove, clove).message_id
            records.verify_signature(peer, records.clove_signing_bytes(message_id, clove), signature)
        except PsError as exc:
            self.stats.cells_dropped += 1
            log.warning("reply from %s with a bad clove signature dropped: %s", _short(peer), exc)
            return
        self.table.spend_reply(reply_tag)  # only a validly signed reply spends the tag
        self.table.touch(entry, self._clock())
        if self.config.tamper:
            clove = _tamper_clove(clove)
            self.stats.tampered += 1
        signed = clove_pb2.SignedClove(clove=clove, signature=signature, reply_tag=reply_tag)
        self._send_backward(entry, clove_pb2.BackwardPayload(signed_clove=signed))

    def _on_destroy(self, peer: bytes, path_id: bytes, reason: str) -> None:
        handle = self._paths.get((peer, path_id))
        if handle is not None:
            self._path_failed(handle, f"destroyed by the path: {reason or 'no reason'}")
            return
        found = self.table.lookup(peer, path_id)
        if found is None:
            return
        entry, direction = found
        self.table.remove(entry)
        if direction is Direction.FORWARD:
            if entry.hop.next_peer_id is not None:
                self._send_destroy(entry.hop.next_peer_id, entry.hop.out_path_id, reason)
        else:
            self._send_destroy(entry.in_peer, entry.in_path_id, reason)

    # ------------------------------------------------------------------ failures

    def _link_down(self, peer: bytes, reason: str) -> None:
        if self._connected(peer):
            # the stream failed (e.g. the peer reset it) but the connection lives: the next send
            # opens a new stream; the paths over it are not lost
            log.info("stream to %s failed (%s); connection alive, paths kept", _short(peer), reason)
            return
        self._peer_gone(peer, reason)

    def _connected(self, peer: bytes) -> bool:
        try:
            return bool(self.host.get_network().get_connections(ID(peer)))
        except Exception:  # a malformed peer ID, or a network without the call
            return False

    def _peer_gone(self, peer: bytes, reason: str) -> None:
        for key, pending in list(self._pending.items()):
            if key[0] == peer:
                del self._pending[key]
                self._fail_relay_setup(pending.entry, f"next hop unreachable: {reason}")
        for entry in self.table.remove_peer(peer):
            self.stats.paths_lost_to_link_down += 1
            if entry.in_peer == peer:
                if entry.hop.next_peer_id is not None:
                    self._send_destroy(entry.hop.next_peer_id, entry.hop.out_path_id, "hop down")
            else:
                self._send_destroy(entry.in_peer, entry.in_path_id, "next hop down")
        for handle in list(self._paths.values()):
            if handle.path.first_hop == peer:
                self.stats.paths_lost_to_link_down += 1
                self._path_failed(handle, f"first hop down: {reason}")

    def peer_disconnected(self, peer: bytes) -> None:
        """Call when the connection to ``peer`` closed: its paths are torn down at once."""
        if not self._connected(peer):  # another connection to it may still be open
            self._peer_gone(peer, "disconnected")

    def _path_failed(self, handle: PathHandle, reason: str) -> None:
        was_ready = handle.is_ready
        self._paths.pop(handle.key, None)
        if handle.done.is_set():
            return
        handle.error = reason
        handle.done.set()
        if not handle.ready.is_set():
            handle.ready.set()  # wake waiters; they check handle.is_ready
        log.info("path via %s failed: %s", _short(handle.path.first_hop), reason)
        if was_ready and self.on_path_down is not None:
            self.on_path_down(handle)

    # ------------------------------------------------------------------ helpers

    def _send_cell(self, peer: bytes, path_id: bytes, payload: bytes) -> bool:
        frame = clove_pb2.CloveFrame(cell=clove_pb2.Cell(path_id=path_id, payload=payload))
        assert self._clove_links is not None
        return self._clove_links.send(peer, frame.SerializeToString())

    def _send_destroy(self, peer: bytes, path_id: bytes, reason: str) -> None:
        frame = clove_pb2.CloveFrame(
            destroy=clove_pb2.Destroy(path_id=path_id, reason=reason[:200])
        )
        assert self._clove_links is not None
        self._clove_links.send(peer, frame.SerializeToString())


def _parse(cls, data: bytes):  # type: ignore[no-untyped-def]
    message = cls()
    try:
        message.ParseFromString(data)
    except (PbDecodeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed {cls.__name__}: {exc}") from exc
    return message


def _flip_byte(data: bytes) -> bytes:
    if not data:
        return data
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]


def _tamper_clove(clove_bytes: bytes) -> bytes:
    """Corrupt a clove's fragment (keeping it parseable) so S-IDA's AEAD check must catch it."""
    try:
        clove = clove_pb2.Clove()
        clove.ParseFromString(clove_bytes)
    except PbDecodeError:
        return _flip_byte(clove_bytes)
    clove.fragment = _flip_byte(clove.fragment)
    return clove.SerializeToString()



__all__ = [
    "CLOVE_MAX_FRAME",
    "CLOVE_PROTOCOL_ID",
    "DELIVER_MAX_FRAME",
    "DELIVER_PROTOCOL_ID",
    "ONION_MAX_FRAME",
    "ONION_PROTOCOL_ID",
    "OverlayConfig",
    "OverlayService",
    "PathHandle",
    "PsError",
]
