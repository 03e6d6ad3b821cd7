"""Message links: one outbound stream per (peer, protocol), fed by a bounded queue.

The overlay protocols (onion setup, clove relaying) are one-way message streams: a node writes its
frames to a peer on a stream it opened itself and reads the peer's frames from streams the peer
opened. A :class:`LinkManager` owns the outbound side for one protocol ID:

* :meth:`LinkManager.send` never blocks the caller: it puts an already-framed message on the
  peer's bounded queue (``queue_frames`` deep) and returns ``False`` when the queue is full, so one
  slow peer can never stall the task that owns the overlay core;
* a writer task per peer opens the stream lazily (dialing the peer from the peerstore's
  addresses if needed), coalesces queued frames into one ``write()`` and, when the stream fails,
  reports the peer through ``on_link_down`` and forgets the link (the next send opens a new one);
* :meth:`LinkManager.warm` opens a link ahead of its first message (a user's delivery links to
  the model nodes, and a model node's reply link back to each such user): the stream starts
  with an empty frame (:data:`OPENING_FRAME`) that :func:`make_frame_handler` skips, since an
  inbound stream without a first byte for 10 s is reset (:mod:`ps_p2p.protocols.handlers`);
* a peer whose stream could not be opened is not dialled again at once: sends to it are refused
  for an exponentially growing, jittered back-off (0.5 s doubling up to 30 s, times 0.5-1.5),
  cleared by the next link that opens;
* ``persistent`` links (a committee's validators: few peers that must stay linked) use a lower
  back-off cap and dial past py-libp2p's negative dial cache, which refuses every dial to a
  peer for 60 s after one failed (``Swarm._negative_peer_cache``): after a 2|2 partition healed,
  both sides were in it and the committee waited ~50 s to reconnect (issue 17). CometBFT
  likewise redials persistent peers every 5 s (``p2p/switch.go``, ``reconnectToPeer``).

The inbound side is :func:`make_frame_handler`: a guarded stream handler that reads size-limited
frames and hands each one to a synchronous callback; a callback that raises
:class:`~ps_p2p.errors.RemoteProtocolError` resets that one stream.

py-libp2p pitfalls handled here (DESIGN.md): a reader that stops reading for 5 s makes the Yamux writer
fail, so inbound streams are always drained; an exception escaping a handler kills the host, so
every handler is wrapped.
"""

from __future__ import annotations

import logging
import random as _random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF

from ps_p2p.protocols.addresses import forget_dial_failures
from ps_p2p.protocols.host import is_connected, last_heard
from libp2p.peer.id import ID

from ps_p2p.records import short_peer_id as _short
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.overlay.rtt import RttEstimator
from ps_p2p.protocols.framing import FrameReader, encode_frame

log = logging.getLogger(__name__)

#: Bytes coalesced into one stream write at most.
MAX_COALESCED_BYTES = 1 << 20
#: Bytes queued for one peer at most (a slow reader cannot make us buffer more).
MAX_QUEUED_BYTES = 16 << 20
#: Failed peers remembered in LinkStats.failed_peers.
MAX_FAILED_PEERS = 256
#: Dial back-off after a failed open: first wait and cap (seconds).
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
#: Peers whose back-off is remembered.
MAX_BACKOFF_PEERS = 4096
#: The frame a link warmed ahead of its first message opens with (:meth:`LinkManager.warm`):
#: empty; a frame handler skips it as the first frame of a stream (a later empty frame goes to
#: ``on_frame`` like any other: the overlay's decoders refuse it).
OPENING_FRAME = encode_frame(b"")
#: Seconds a stream's close (the FIN) may take, at the end of an outbound link or of an inbound
#: frame stream, before the stream is reset instead: a close waits behind the connection's
#: other writes, and py-libp2p's Yamux marks a cancelled close closed without sending the FIN.
CLOSE_TIMEOUT = 1.0


@dataclass
class _Link:
    peer_id: bytes
    send: trio.MemorySendChannel[bytes]
    receive: trio.MemoryReceiveChannel[bytes]
    dropped: int = 0
    sent: int = 0
    queued_bytes: int = 0
    closed: bool = False
    writing: bool = False  # a write() is in progress


@dataclass
class LinkStats:
    """Counters of a :class:`LinkManager` (for logs and metrics)."""

    frames_sent: int = 0
    frames_dropped: int = 0
    #: frames refused because their peer was in dial back-off
    frames_backed_off: int = 0
    links_opened: int = 0
    links_failed: int = 0
    #: the last MAX_FAILED_PEERS peers whose link failed, with the reason (oldest first)
    failed_peers: OrderedDict[bytes, str] = field(default_factory=OrderedDict)


class LinkManager:
    """Outbound message links of one protocol to many peers.

    Args:
        host: a running py-libp2p host.
        nursery: where writer tasks run (one per peer with traffic).
        protocol_id: e.g. ``/planetserve/clove/1.0.0``.
        on_link_down: called (synchronously, in the writer task) with the peer ID bytes and a reason
            when a stream to that peer could not be opened or failed while writing.
        queue_frames: frames queued per peer before :meth:`send` starts refusing (default 4096).
        open_timeout: the floor of the time allowed to dial and negotiate a stream (default
            5 s); the allowance itself is the RFC 6298 timeout of the measured stream opens,
            doubled by each open that runs out of it (up to 60 s, until one succeeds), so
            a machine too busy to finish handshakes in 5 s does not fail every link it opens
            (which made a 100-user devnet tear down working paths and dial again, at once).
        clock: seconds (trio's clock); random: uniform [0, 1) draws for the back-off jitter.
        backoff_max: the back-off's cap, seconds (default :data:`BACKOFF_MAX`).
        persistent: dial past py-libp2p's negative dial cache (the back-off here replaces it).
    """

    def __init__(
        self,
        host: IHost,
        nursery: trio.Nursery,
        protocol_id: str,
        *,
        on_link_down: Callable[[bytes, str], None] | None = None,
        queue_frames: int = 4096,
        open_timeout: float = 5.0,
        clock: Callable[[], float] = trio.current_time,
        random: Callable[[], float] = _random.random,
        backoff_max: float = BACKOFF_MAX,
        persistent: bool = False,
    ) -> None:
        self._host = host
        self._backoff_max = backoff_max
        self._persistent = persistent
        self._nursery = nursery
        self._protocol_id = TProtocol(protocol_id)
        self._on_link_down = on_link_down
        self._queue_frames = queue_frames
        self._open_timeout = open_timeout
        self._links: dict[bytes, _Link] = {}
        self._open_rtt = RttEstimator(initial_rto=open_timeout, min_rto=open_timeout, max_rto=60.0)
        self._clock = clock
        self._random = random
        # peer -> (failed opens in a row, no dial before this time)
        self._backoff: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self.stats = LinkStats()
        self._wrote = trio.Event()  # set after every write and every link's end (flush)

    @property
    def open_allowance(self) -> float:
        """Seconds a stream open (with its dial) may take before it counts as failed: the
        RFC 6298 RTO of the opens measured so far, at least ``open_timeout``."""
        return self._open_rtt.rto

    def send(self, peer_id: bytes, message: bytes) -> bool:
        """Queue one message (the frame prefix is added here) for ``peer_id``; never blocks.

        Returns:
            True when queued; False when the peer's queue is full (the message is dropped and
            counted) or the link just failed.
        """
        return self.send_frame(peer_id, encode_frame(message))

    def send_frame(self, peer_id: bytes, frame: bytes) -> bool:
        """:meth:`send` for a message already framed (``encode_frame(message)``, e.g.
        :func:`~ps_p2p.protocols.clove_relay.encode_cell_frame`, which writes the prefix and
        the message in one join)."""
        link = self._links.get(peer_id)
        if link is None or link.closed:
            backoff = self._backoff.get(peer_id)
            if backoff is not None and self._clock() < backoff[1]:
                # the back-off spares dials that fail; with a connection up (the peer dialled
                # us since), a stream opens without one: a setup reply to a user whose
                # address was unknown a moment ago must not be lost
                if not is_connected(self._host, peer_id):
                    self.stats.frames_backed_off += 1
                    return False
                del self._backoff[peer_id]
            link = self._open(peer_id)
        try:
            if link.queued_bytes + len(frame) > MAX_QUEUED_BYTES:
                raise trio.WouldBlock
            link.send.send_nowait(frame)
            link.queued_bytes += len(frame)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            link.dropped += 1
            self.stats.frames_dropped += 1
            if link.dropped in (1, 100, 10_000):
                log.warning(
                    "%s: queue to %s full, dropped %d frame(s)",
                    self._protocol_id, _short(peer_id), link.dropped,
                )
            return False
        return True

    def warm(self, peer_id: bytes) -> bool:
        """Open the link to ``peer_id`` now, before any message, so that the first :meth:`send`
        finds its stream open (a stream open is a Yamux SYN and a multistream-select round
        trip: on a loaded machine tens of ms, paid by the first request otherwise). The stream
        starts with :data:`OPENING_FRAME`, which :func:`make_frame_handler` skips: an inbound
        stream that sends nothing for 10 s is reset (:mod:`ps_p2p.protocols.handlers`).

        Returns:
            True when the link exists or is opening; False when the peer is in dial back-off
            and not connected (nothing is done).
        """
        link = self._links.get(peer_id)
        if link is not None and not link.closed:
            return True
        backoff = self._backoff.get(peer_id)
        if backoff is not None and self._clock() < backoff[1]:
            if not is_connected(self._host, peer_id):
                return False
            del self._backoff[peer_id]
        link = self._open(peer_id)
        link.send.send_nowait(OPENING_FRAME)
        link.queued_bytes += len(OPENING_FRAME)
        return True

    def has_link(self, peer_id: bytes) -> bool:
        """Whether a link to ``peer_id`` is open or opening."""
        link = self._links.get(peer_id)
        return link is not None and not link.closed

    async def flush(self) -> None:
        """Wait until every frame queued so far is written or its link has failed (a node
        that stops sends its last answers first). Wrap it in a deadline: a link still
        dialling waits up to its open allowance (5 s or more)."""
        while any(link.queued_bytes > 0 or link.writing for link in self._links.values()):
            self._wrote = trio.Event()
            await self._wrote.wait()

    def close(self, peer_id: bytes) -> None:
        """Finish the link to ``peer_id`` after its queued frames are written."""
        link = self._links.pop(peer_id, None)
        if link is not None:
            link.closed = True
            link.send.close()

    def close_all(self) -> None:
        """Finish every link (queued frames are still written)."""
        for peer_id in list(self._links):
            self.close(peer_id)

    def _open(self, peer_id: bytes) -> _Link:
        send, receive = trio.open_memory_channel[bytes](self._queue_frames)
        link = _Link(peer_id, send, receive)
        self._links[peer_id] = link
        self._nursery.start_soon(self._run_link, link)
        return link

    async def _run_link(self, link: _Link) -> None:
        stream: INetStream | None = None
        reason = "closed"
        allowance = self._open_rtt.rto
        try:
            started = self._clock()
            opened_at = trio.current_time()  # last_heard's clock
            if self._persistent:
                forget_failed_dial(self._host, link.peer_id)
            with trio.fail_after(allowance):
                stream = await self._host.new_stream(ID(link.peer_id), [self._protocol_id])
            self._open_rtt.sample(self._clock() - started)
            self.stats.links_opened += 1
            self._backoff.pop(link.peer_id, None)
            async with link.receive:
                async for frame in link.receive:
                    parts = [frame]
                    size = len(frame)
                    while size < MAX_COALESCED_BYTES:
                        try:
                            more = link.receive.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        parts.append(more)
                        size += len(more)
                    link.writing = True
                    link.queued_bytes -= size
                    await stream.write(parts[0] if len(parts) == 1 else b"".join(parts))
                    link.writing = False
                    self._wrote.set()
                    link.sent += len(parts)
                    self.stats.frames_sent += len(parts)
        except trio.TooSlowError:
            reason = f"could not open a {self._protocol_id} stream in {allowance:.0f} s"
            self._back_off(link.peer_id)
            self._close_silent_connections(link.peer_id, opened_at)
            # RFC 6298 5.5: the next open gets twice the time (until one succeeds). Only
            # successes are sampled, so on a machine too busy to finish a handshake within the
            # allowance every open was cancelled at it and its work wasted, nothing sampled: a
            # 100-user devnet on 2 cores at load 20-28 cancelled 1,155 opens at 5 s in 166 s
            self._open_rtt.timed_out()
        except trio.Cancelled:
            raise
        except Exception as exc:  # a dial or stream failure of any kind ends this link only
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if stream is None:  # the dial or the protocol negotiation failed
                self._back_off(link.peer_id)
        finally:
            link.closed = True
            link.writing = False
            if self._links.get(link.peer_id) is link:
                del self._links[link.peer_id]
            self._wrote.set()
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT) as closing:
                    try:
                        await stream.close()
                    except Exception:
                        pass
                if closing.cancelled_caught:
                    # the FIN may not have gone out (see make_frame_handler): the peer's handler
                    # would wait on the stream for the connection's life. Reset it once the
                    # connection can write, without holding this task.
                    self._nursery.start_soon(_quietly, stream.reset)
        if reason != "closed":
            self.stats.links_failed += 1
            self.stats.failed_peers.pop(link.peer_id, None)
            self.stats.failed_peers[link.peer_id] = reason
            while len(self.stats.failed_peers) > MAX_FAILED_PEERS:
                self.stats.failed_peers.popitem(last=False)
            log.info("%s link to %s down: %s", self._protocol_id, _short(link.peer_id), reason)
            if self._on_link_down is not None:
                self._on_link_down(link.peer_id, reason)


    def _close_silent_connections(self, peer_id: bytes, since: float) -> None:
        """After a stream open to ``peer_id`` timed out: close the peer's connections that read
        nothing since it began (trio time ``since``). A live peer answers a new stream (Yamux,
        then multistream-select) within a round trip, and the allowance is at least
        ``open_timeout``; a connection silent all along is dead (the peer's NAT took a new
        address, it crashed behind a relay) or its peer is frozen, and py-libp2p would open the
        next stream on it again (``Swarm._select_connection``: the one with the most streams),
        until the keepalive closed it up to a minute later. Closed, the next open dials anew.
        (The 40-node NAT remap run: the remapped user's stream opens to four first hops timed
        out at 12 s each, "connection alive, paths kept".)"""
        from ps_p2p.protocols.circuit_relay import close_connection

        try:
            conns = list(self._host.get_network().get_connections(ID(peer_id)))
        except Exception:  # a malformed peer ID: no connection to close
            return
        for conn in conns:
            heard = last_heard(conn)
            if heard is not None and heard < since:
                log.info("connection to %s silent for %.0f s through a stream open: closed",
                         _short(peer_id), trio.current_time() - heard)
                self._nursery.start_soon(close_connection, conn)

    def forget_backoff(self, peer_id: bytes) -> bool:
        """Drop ``peer_id``'s dial back-off: its record now names other addresses, so the
        failures at the old ones say nothing of the new (a model node restarted on a new IP
        would otherwise be refused at once until the back-off ran out). Returns True when
        there was one."""
        return self._backoff.pop(peer_id, None) is not None

    def _back_off(self, peer_id: bytes) -> None:
        failures = self._backoff.pop(peer_id, (0, 0.0))[0] + 1
        wait = min(self._backoff_max, BACKOFF_INITIAL * 2 ** (failures - 1))
        wait *= 0.5 + self._random()
        self._backoff[peer_id] = (failures, self._clock() + wait)
        while len(self._backoff) > MAX_BACKOFF_PEERS:
            self._backoff.popitem(last=False)


def forget_failed_dial(host: IHost, peer_id: bytes) -> None:
    """Drop ``peer_id`` from py-libp2p 0.8.1's negative dial cache
    (:func:`~ps_p2p.protocols.addresses.forget_dial_failures`)."""
    forget_dial_failures(host.get_network(), ID(peer_id))


def make_frame_handler(
    protocol_id: str,
    max_frame_bytes: int,
    on_frame: Callable[[bytes, bytes], None],
    on_open: Callable[[bytes], None] | None = None,
) -> Callable[[INetStream], object]:
    """Build a stream handler that reads frames until EOF and hands them to ``on_frame``
    (all but an empty first frame, :data:`OPENING_FRAME`).

    Args:
        protocol_id: for logs.
        max_frame_bytes: frames above this reset the stream (FrameTooLargeError).
        on_frame: ``on_frame(peer_id_bytes, frame)``, synchronous. It may raise
            RemoteProtocolError to reset this stream; any other exception is logged and also only
            resets this stream.
        on_open: ``on_open(peer_id_bytes)``, synchronous, called once when a stream arrives,
            before its first frame (e.g. to open the link back to that peer ahead of the first
            answer); an exception it raises is logged and the stream served all the same.

    Returns:
        an ``async def handler(stream)`` for ``host.set_stream_handler`` that never raises.
    """

    async def handler(stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        peer_bytes = peer.to_bytes()
        reader = FrameReader(stream, max_frame_bytes)
        if on_open is not None:
            try:
                on_open(peer_bytes)
            except Exception:
                log.exception("%s: on_open for %s failed", protocol_id, peer)
        try:
            frame = await reader.read_frame()
            if not frame:  # OPENING_FRAME: a link opened ahead of its first message
                frame = await reader.read_frame()
            while True:
                on_frame(peer_bytes, frame)
                frame = await reader.read_frame()
        except StreamEOF:
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                await _quietly(stream.close)
            if scope.cancelled_caught:
                # py-libp2p's Yamux marks a stream whose close was cancelled as closed without
                # sending the FIN: the peer would wait on it, and this node keep it, for the
                # connection's life (found by the fuzzer). A reset ends it on both sides.
                log.warning("%s: close of the stream from %s did not finish in %g s; resetting it",
                            protocol_id, peer, CLOSE_TIMEOUT)
                await _quietly(stream.reset)
        except trio.Cancelled:
            raise
        except RemoteProtocolError as exc:
            log.warning("%s: resetting stream from %s: %s", protocol_id, peer, exc)
            await _quietly(stream.reset)
        except Exception as exc:
            log.warning(
                "%s: stream from %s failed: %s: %s", protocol_id, peer, type(exc).__name__, exc
            )
            await _quietly(stream.reset)

    return handler


async def _quietly(call: Callable[[], object]) -> None:
    try:
        await call()  # type: ignore[misc]
    except Exception:
        pass

