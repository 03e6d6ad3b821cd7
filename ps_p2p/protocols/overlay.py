"""The anonymous overlay service of one host: relay, proxy, path owner and clove sink/source
(PlanetServe sec. 3.2), as a thin adapter around :class:`ps_p2p.overlay.relay.RelayCore`.

Three protocols, each its own module and its own links (DESIGN.md "Wire"):

* ``/planetserve/onion/1.0.0`` (:mod:`ps_p2p.protocols.onion_setup`): path setup;
* ``/planetserve/clove/1.0.0`` (:mod:`ps_p2p.protocols.clove_relay`): cells and Destroy on links
  that many paths share;
* ``/planetserve/deliver/1.0.0`` (:mod:`ps_p2p.protocols.delivery`): proxy -> model node
  deliveries and model node -> proxy replies, kept off the relay links so that a bad delivery can
  never reset a stream other paths share.

Shape (DESIGN.md "Layers"): stream handlers only decode a frame (a frame that does not parse
resets that stream) and submit the bound core input to one :class:`~ps_p2p.protocols.driver.
CoreDriver` task, which owns the core, runs its timers at ``next_deadline()`` and executes its
commands: frames into :class:`~ps_p2p.protocols.links.LinkManager` queues (never blocking), path
events into :class:`PathHandle` events, deliveries to the model node's callback. The path owner's
calls (:meth:`OverlayService.open_path` ...) call the core directly on the same trio thread and
run its commands at once.

Failure containment (DESIGN.md "Security invariants"): an error about one path, cell or delivery
costs that cell or delivery only; a stream that fails tears paths down only when the connection
to that peer is gone (a stream that fails while the connection lives is reopened by the next
send). A proxy delivers only to model nodes of the directory (and registers reply tags only for
them); a model node accepts deliveries only from users of the directory (proxies are users).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from ps_p2p import records
from ps_p2p.crypto import onion
from ps_p2p.errors import PsError
from ps_p2p.overlay import relay as core
from ps_p2p.overlay.circuit_limits import circuit_only_relays
from ps_p2p.overlay.relay import RelayConfig, RelayCore, RelayStats
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols import clove_relay, delivery, onion_setup
from ps_p2p.protocols.clove_relay import CLOVE_MAX_FRAME, CLOVE_PROTOCOL_ID
from ps_p2p.protocols.delivery import DELIVER_MAX_FRAME, DELIVER_PROTOCOL_ID
from ps_p2p.protocols.driver import CoreDriver
from ps_p2p.protocols.handlers import StreamHandlers
from ps_p2p.protocols.host import is_connected, peer_network
from ps_p2p.protocols.links import (
    LinkManager,
    LinkStats,
    forget_failed_dial,
    make_frame_handler,
)
from ps_p2p.protocols.onion_setup import ONION_MAX_FRAME, ONION_PROTOCOL_ID

log = logging.getLogger(__name__)

#: Peers whose relayed-or-not answer is memoized per directory (a setup names any next hop).
MAX_RELAYED_MEMO = 4096
#: peers remembered for a reply link to warm once the directory lists them (a peer that is
#: never listed costs one entry, the oldest dropped first)
MAX_WARM_PENDING = 1024

#: Bytes of a reply tag.
REPLY_TAG_BYTES = core.REPLY_TAG_BYTES

#: Settings of the overlay (see :class:`ps_p2p.overlay.relay.RelayConfig`).
OverlayConfig = RelayConfig
#: Counters of the overlay (see :class:`ps_p2p.overlay.relay.RelayStats`).
OverlayStats = RelayStats


@dataclass(eq=False)
class PathHandle:
    """A path owned by this node as a user.

    ``ready`` is set when the acknowledgement from the proxy checked out (or the setup failed:
    check ``is_ready``); ``done`` when the path failed or died (``error`` says why).
    """

    own: core.OwnPath | None = None
    ready: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    error: str | None = None
    #: the path failed because the link to its first hop was lost (the first hop is to blame)
    first_hop_down: bool = False
    #: abandoned because this node's own address changed (nobody is to blame)
    blameless: bool = False
    is_ready: bool = False
    cells_sent: int = 0
    cells_received: int = 0

    @property
    def path(self) -> onion.UserPath:
        assert self.own is not None
        return self.own.path

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.path.first_hop, self.path.first_path_id)

    @property
    def alive(self) -> bool:
        return self.is_ready and not self.done.is_set()


class OverlayService:
    """Relay, proxy and path owner for one host (see the module docstring).

    Args:
        host: a running py-libp2p host.
        onion_key: this node's X25519 onion key pair (its public half is in its node record).
        config: :class:`OverlayConfig`.
        on_delivery: model nodes: ``on_delivery(proxy_peer_id, clove_bytes)`` for each request
            clove a proxy delivers; None elsewhere (deliveries are then refused). Assigning the
            attribute later (``ModelNodeService.attach``) works too.
        on_backward: users: ``on_backward(handle, payload)`` with each BackwardPayload (parsed)
            arriving on one of this node's paths.
        on_path_down: users: ``on_path_down(handle)`` when a ready path dies.
        on_address_changed: users: ``on_address_changed(since)`` when this node's own address
            changed (:class:`~ps_p2p.overlay.relay.AddressChanged`; ``since`` on the core's
            clock); assigning the attribute later works too.
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
        on_address_changed: Callable[[float], None] | None = None,
        directory: Callable[[], records.Directory | None] | None = None,
        clock: Callable[[], float] = trio.current_time,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.host = host
        self.peer_id = host.get_id().to_bytes()
        self.onion_key = onion_key
        self.config = config or OverlayConfig()
        self.on_backward = on_backward
        self.on_path_down = on_path_down
        self.on_address_changed = on_address_changed
        self._directory = directory
        self._clock = clock
        self.core = RelayCore(
            self.peer_id,
            onion_key,
            clove_relay.ProtobufPayloadCodec(),
            self.config,
            is_model_node=functools.partial(self._has_role, records.Role.MODEL),
            is_user=functools.partial(self._has_role, records.Role.USER),
            user_count=self._user_count,
            verify_reply=delivery.verify_reply,
            random_bytes=random_bytes,
            # unix seconds at the core's ``now``: setups carry and check their issue time
            wall_clock=lambda now: now + (time.time() - self._clock()),
            is_relayed=self._is_relayed,
            connected_peers=self._connected_peers,
        )
        self.on_delivery = on_delivery
        self.driver: CoreDriver[core.Command] = CoreDriver(
            "overlay",
            execute=self._execute,
            tick=self.core.tick,
            next_deadline=self.core.next_deadline,
            clock=clock,
        )
        self._users_counted: tuple[records.Directory | None, int] = (None, 0)
        self._relays_of: tuple[records.Directory | None, dict[bytes, frozenset[bytes]]] = (
            None, {})
        self._onion_links: LinkManager | None = None
        self._clove_links: LinkManager | None = None
        self._deliver_links: LinkManager | None = None
        self._nursery: trio.Nursery | None = None
        #: peers whose delivery stream came before the directory listed them (oldest first,
        #: at most MAX_WARM_PENDING): their reply link is warmed once it does
        self._warm_pending: OrderedDict[bytes, None] = OrderedDict()

    @property
    def on_delivery(self) -> Callable[[bytes, bytes], None] | None:
        return self._on_delivery

    @on_delivery.setter
    def on_delivery(self, callback: Callable[[bytes, bytes], None] | None) -> None:
        self._on_delivery = callback
        self.config.serves_model = callback is not None

    @property
    def stats(self) -> RelayStats:
        return self.core.stats

    @property
    def table(self):  # type: ignore[no-untyped-def]
        """The core's :class:`~ps_p2p.overlay.relay_table.RelayTable` (for tests and metrics)."""
        return self.core.table

    def link_stats(self, protocol: str) -> LinkStats | None:
        """Counters of the outbound links of ``protocol`` (``"onion"``, ``"clove"`` or
        ``"deliver"``); None before :meth:`run` started them."""
        links = {
            "onion": self._onion_links, "clove": self._clove_links, "deliver": self._deliver_links,
        }.get(protocol)
        return None if links is None else links.stats

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register the stream handlers and serve until cancelled; then remove the handlers
        (resetting the inbound streams they still serve) and finish the outbound links.

        Raises:
            ConfigError: the host already serves one of the three protocols (before
                ``task_status.started()``).
        """
        handlers = StreamHandlers(self.host)
        try:
            for protocol_id, limit, handler, on_open in (
                (ONION_PROTOCOL_ID, ONION_MAX_FRAME, self._on_onion_frame, None),
                (CLOVE_PROTOCOL_ID, CLOVE_MAX_FRAME, self._on_clove_frame, None),
                (DELIVER_PROTOCOL_ID, DELIVER_MAX_FRAME, self._on_deliver_frame,
                 self._on_deliver_stream),
            ):
                handlers.add(protocol_id,
                             make_frame_handler(protocol_id, limit, handler, on_open=on_open))
            await self._serve(task_status)
        finally:
            await handlers.aclose()

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._onion_links = LinkManager(
                self.host, nursery, ONION_PROTOCOL_ID, on_link_down=self._link_down
            )
            self._clove_links = LinkManager(
                self.host, nursery, CLOVE_PROTOCOL_ID, on_link_down=self._link_down
            )
            # a delivery link that fails while the connection lives costs the deliveries
            # queued on it, never a path; a lost connection to a model node is told to the
            # users whose reply tags wait for it (RelayCore.destination_lost)
            self._deliver_links = LinkManager(
                self.host, nursery, DELIVER_PROTOCOL_ID, on_link_down=self._link_down
            )
            await nursery.start(self.driver.run)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._onion_links.close_all()
                self._clove_links.close_all()
                self._deliver_links.close_all()

    # ------------------------------------------------------------------ inbound frames

    def _on_onion_frame(self, peer: bytes, data: bytes) -> None:
        frame = onion_setup.decode(data)  # RemoteProtocolError resets this stream
        if isinstance(frame, onion_setup.SetupFrame):
            event = functools.partial(
                self.core.receive_setup, peer, frame.path_id, frame.packet,
                origin=peer_network(self.host, peer),
            )
        else:
            event = functools.partial(
                self.core.receive_setup_reply, peer, frame.path_id, frame.ok, frame.ack, frame.error
            )
        # setups (onion decryption, the costly input a flooder sends: issue 16) always wait
        # their turn in the driver's round robin; cells and deliveries take the handler-to-core
        # shortcut (CoreDriver, ``direct``)
        self.driver.submit(event, peer=peer)

    def _on_clove_frame(self, peer: bytes, data: bytes) -> None:
        cell = clove_relay.split_cell(data)  # the hot path: no protobuf or frame objects
        if cell is not None:
            self.driver.submit(
                functools.partial(self.core.receive_cell, peer, cell[0], cell[1]),
                peer=peer, direct=True,
            )
            return
        frame = clove_relay.decode(data)
        if isinstance(frame, clove_relay.CellFrame):
            event = functools.partial(self.core.receive_cell, peer, frame.path_id, frame.payload)
        else:
            event = functools.partial(self.core.receive_destroy, peer, frame.path_id, frame.reason)
        self.driver.submit(event, peer=peer, direct=True)

    def _on_deliver_frame(self, peer: bytes, data: bytes) -> None:
        frame = delivery.decode(data)
        if isinstance(frame, delivery.DeliveryFrame):
            event = functools.partial(self.core.receive_delivery, peer, frame.clove)
        else:
            event = functools.partial(
                self.core.receive_reply, peer, frame.reply_tag, frame.clove, frame.signature
            )
        self.driver.submit(event, peer=peer, direct=True)

    def _on_deliver_stream(self, peer: bytes) -> None:
        """A delivery stream arrived: a model node opens its reply link back to that proxy
        now (when the peer is a directory user), so that the first response clove does not
        wait for a stream to open (:meth:`warm_delivery_link` is the proxy's half)."""
        if self._on_delivery is None:
            return
        if self._has_role(records.Role.USER, peer):
            self.warm_delivery_link(peer)
            return
        # a user this node's directory does not list yet (it refreshes every few seconds;
        # users start in waves): warmed by directory_changed once it does
        self._warm_pending.pop(peer, None)
        self._warm_pending[peer] = None
        while len(self._warm_pending) > MAX_WARM_PENDING:
            self._warm_pending.popitem(last=False)

    def directory_changed(self) -> None:
        """Call after the node adopted a new directory: reply links are warmed to the peers
        whose delivery stream arrived before the directory listed them as users."""
        for peer in list(self._warm_pending):
            if self._has_role(records.Role.USER, peer):
                del self._warm_pending[peer]
                self.warm_delivery_link(peer)

    def warm_delivery_link(self, peer: bytes) -> bool:
        """Open the ``/planetserve/deliver`` link to ``peer`` (a model node, or for a model
        node a proxy) ahead of the first clove, without sending anything: a stream open is a
        multistream-select round trip through two busy processes, and a proxy's first delivery
        and a model node's first reply to a proxy otherwise each wait for one (in a 100-user
        devnet on 2 cores every prompt was its user's first request, and these waits were most
        of its latency). Returns False before :meth:`run` or while the peer is backed off."""
        if self._deliver_links is None:
            return False
        return self._deliver_links.warm(peer)

    def _link_down(self, peer: bytes, reason: str) -> None:
        self.driver.submit(
            functools.partial(self.core.link_failed, peer, reason, self._connected(peer))
        )

    async def _check_destination(self, peer: bytes, reason: str) -> None:
        """Open a delivery stream to model node ``peer`` again (``CheckDestination``), within
        the delivery links' open allowance, and tell the core whether it opened: a node that
        is gone fails at once or times out, one whose connection was only replaced answers.
        A stream of the protocol, not a connection only: a host that is stopping may still
        finish a handshake and then drop the connection."""
        assert self._deliver_links is not None
        forget_failed_dial(self.host, peer)  # a dial that failed before says nothing now
        allowance = self._deliver_links.open_allowance
        reachable, outcome = False, f"no stream within {allowance:.0f} s"
        with trio.move_on_after(allowance):
            try:
                stream = await self.host.new_stream(ID(peer), [DELIVER_PROTOCOL_ID])
                reachable = True
                await stream.close()
            except Exception as exc:  # any dial or stream failure: not reachable
                outcome = type(exc).__name__
        self.driver.submit(
            functools.partial(self.core.destination_checked, peer, reachable,
                              f"{reason}; redial: {outcome}"),
            essential=True,
        )

    def peer_moved(self, peer: bytes) -> None:
        """Call when ``peer``'s committed record names other addresses than before (a node
        restarted on a new port or IP): the links' dial back-off from failures at its old
        addresses is dropped, so cells and deliveries for it dial the new ones at once
        instead of being refused until the back-off runs out."""
        for links in (self._onion_links, self._clove_links, self._deliver_links):
            if links is not None:
                links.forget_backoff(peer)

    def peer_disconnected(self, peer: bytes) -> None:
        """Call when a connection to ``peer`` closed: its paths are torn down at once, unless
        another connection to it is still open."""
        self.driver.submit(
            functools.partial(self.core.link_failed, peer, "disconnected", self._connected(peer))
        )

    def address_changed(self) -> None:
        """Call when this node's own address changed (e.g. no relay of a NATed node's
        reservations answers any more: ``ReservationKeeper.on_address_changed``): its own
        setups in flight are abandoned and new ones sent
        (:meth:`~ps_p2p.overlay.relay.RelayCore.address_changed`). Never blocks."""
        self.driver.submit(self.core.address_changed, essential=True)

    # ------------------------------------------------------------------ user API

    def open_path(self, hops: list[onion.HopSpec]) -> PathHandle:
        """Start setting up a path through ``hops`` (the last is the proxy); returns at once.

        Await ``handle.ready`` (then check ``handle.is_ready``) or ``handle.done``.

        Raises:
            CryptoError: an onion key no shared secret can be derived with.
        """
        handle = PathHandle()
        handle.own, commands = self.core.open_path(hops, handle, self._clock())
        self._run(commands)
        return handle

    def send_on_path(self, handle: PathHandle, payload: clove_pb2.ForwardPayload) -> bool:
        """Seal ``payload`` for the proxy and send it as one cell on ``handle``'s path.

        Returns False when the path is not alive or the first hop's queue is full.
        """
        if not handle.alive or handle.own is None:
            return False
        commands = self.core.send_on_path(
            handle.own, clove_relay.forward_from_pb(payload), self._clock()
        )
        if not commands:
            return False
        handle.cells_sent += 1
        return all(self._execute(c) is not False for c in commands)

    def close_path(self, handle: PathHandle, reason: str = "closed by user") -> None:
        """Tear ``handle``'s path down (Destroy to the first hop) and forget it."""
        if handle.own is None:
            return
        commands = self.core.close_path(handle.own, reason, self._clock())
        if not handle.done.is_set():
            handle.error = reason
            handle.done.set()
            handle.ready.set()
        self._run(commands)

    def paths(self) -> list[PathHandle]:
        """This node's own paths (any state)."""
        return [p.token for p in self.core.own_paths()]  # type: ignore[misc]

    # ------------------------------------------------------------------ model node API

    def send_reply(
        self, proxy: bytes, reply_tag: bytes, clove: bytes, signature: bytes = b""
    ) -> bool:
        """Model nodes: send one signed response clove to a reply proxy, under the request's
        reply tag for that proxy. Returns False when the proxy's queue is full."""
        return all(
            self._execute(c) is not False
            for c in self.core.send_reply(proxy, reply_tag, clove, signature)
        )

    async def flush(self) -> None:
        """Wait until the frames queued so far (answers to reply proxies, cells) are written
        or their links failed; for a node that stops. Wrap it in a deadline."""
        for links in (self._deliver_links, self._clove_links, self._onion_links):
            if links is not None:
                await links.flush()

    # ------------------------------------------------------------------ commands

    def _run(self, commands: Iterable[core.Command]) -> None:
        self.driver.run_commands(commands)
        self.driver.wake()

    def _execute(self, command: core.Command) -> bool | None:
        """Carry out one command of the core; returns False when a frame could not be queued
        (the core hears of it through ``send_failed``)."""
        assert self._clove_links is not None and self._onion_links is not None
        assert self._deliver_links is not None
        match command:
            case core.SendCell(peer, path_id, payload):
                return self._clove_links.send_frame(
                    peer, clove_relay.encode_cell_frame(path_id, payload)
                )
            case core.SendSetup(peer, path_id, packet):
                if not self._onion_links.send(peer, onion_setup.encode_setup(path_id, packet)):
                    self._run(self.core.send_failed(command, self._clock()))
                    return False
            case core.SendSetupReply(peer, path_id, ok, ack, error):
                return self._onion_links.send(peer, onion_setup.encode_reply(path_id, ok, ack, error))
            case core.SendDestroy(peer, path_id, reason):
                return self._clove_links.send(peer, clove_relay.encode_destroy(path_id, reason))
            case core.SendDelivery(peer, clove, _, _):
                if not self._deliver_links.send(peer, delivery.encode_delivery(clove)):
                    self._run(self.core.send_failed(command, self._clock()))
                    return False
            case core.SendReply(peer, reply_tag, clove, signature):
                return self._deliver_links.send(
                    peer, delivery.encode_reply(reply_tag, clove, signature)
                )
            case core.DeliverToModel(proxy, clove):
                if self._on_delivery is not None:
                    self._on_delivery(proxy, clove)
            case core.CheckDestination(peer, reason):
                if self._nursery is not None:
                    self._nursery.start_soon(self._check_destination, peer, reason)
            case core.PathReady(token):
                handle: PathHandle = token  # type: ignore[assignment]
                handle.is_ready = True
                handle.ready.set()
            case core.PathFailed(token, reason, was_ready, first_hop_down, blameless):
                handle = token  # type: ignore[assignment]
                if not handle.done.is_set():
                    handle.error = reason
                    handle.first_hop_down = first_hop_down
                    handle.blameless = blameless
                    handle.done.set()
                    handle.ready.set()  # wake waiters; they check handle.is_ready
                    if was_ready and self.on_path_down is not None:
                        self.on_path_down(handle)
            case core.AddressChanged(_, since):
                if self.on_address_changed is not None:
                    self.on_address_changed(since)
            case core.BackwardReceived(token, message):
                handle = token  # type: ignore[assignment]
                handle.cells_received += 1
                if self.on_backward is not None:
                    self.on_backward(handle, clove_relay.backward_to_pb(message))
        return None

    # ------------------------------------------------------------------ directory and network

    def _has_role(self, role: records.Role, peer: bytes) -> bool:
        if self._directory is None:
            return True
        directory = self._directory()
        record = directory.record(peer) if directory is not None else None
        return record is not None and role in record.roles

    def _is_relayed(self, peer: bytes) -> bool:
        """Whether this node reaches ``peer`` through a Circuit Relay v2 relay: the current
        directory lists it by ``/p2p-circuit`` addresses only and this node is none of its
        relays (a relay host reaches it over its reservation connection). Memoized per
        directory object and peer."""
        directory = self._directory() if self._directory is not None else None
        if directory is None:
            return False
        cached, relays_of = self._relays_of
        if directory is not cached:
            relays_of = {}
            self._relays_of = (directory, relays_of)
        relays = relays_of.get(peer)
        if relays is None:
            record = directory.record(peer)
            relays = circuit_only_relays(record.addrs) if record is not None else frozenset()
            if len(relays_of) < MAX_RELAYED_MEMO:  # next hops come from setup packets
                relays_of[peer] = relays
        return bool(relays) and self.peer_id not in relays

    def _user_count(self) -> int:
        """Users the current directory lists (counted once per directory object)."""
        directory = self._directory() if self._directory is not None else None
        counted, count = self._users_counted
        if directory is not counted:
            count = len(directory.users()) if directory is not None else 0
            self._users_counted = (directory, count)
        return count

    def _connected(self, peer: bytes) -> bool:
        return is_connected(self.host, peer)

    def _connected_peers(self) -> int:
        try:
            return len(self.host.get_network().get_connections_map())
        except AttributeError:  # a network without the call
            return 0


__all__ = [
    "CLOVE_MAX_FRAME",
    "CLOVE_PROTOCOL_ID",
    "DELIVER_MAX_FRAME",
    "DELIVER_PROTOCOL_ID",
    "ONION_MAX_FRAME",
    "ONION_PROTOCOL_ID",
    "OverlayConfig",
    "OverlayService",
    "OverlayStats",
    "PathHandle",
    "PsError",
]
