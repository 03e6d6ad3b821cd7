"""The relay table: which path a cell belongs to and where it goes next (sans-I/O).

Every relay (and proxy) keeps one :class:`RelayEntry` per path through it, indexed three ways:

* forward: ``(predecessor peer ID, incoming path ID)`` -> entry (cells towards the proxy);
* backward: ``(successor peer ID, outgoing path ID)`` -> entry (cells back to the user);
* reply tag -> entry, for proxies: each request clove a user sends through its proxy registers a
  fresh 16-byte reply tag, and the request names the proxy by that tag. The model node's response
  clove comes back under it, only from the model node the clove went to, at most
  ``replies`` times and within ``ttl`` seconds. A tag names one request, never the path, so
  model nodes cannot link one user's requests through a lasting path ID.

Path IDs are link-local (DESIGN.md): the same path has a different ID on every link, so nothing
in the table lets a relay link two links of one path except its own entry. Sizes a peer controls
are bounded (``max_entries``); idle entries expire. Source: PlanetServe sec. 3.2 (path tables).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ps_p2p.crypto.onion import RelayHop
from ps_p2p.errors import RemoteProtocolError


class Direction(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class RelayEntry:
    """One path through this node.

    Attributes:
        in_peer, in_path_id: the predecessor and the path ID on that link.
        hop: this node's layer of the path (successor, outgoing path ID, cell keys).
        created_at, last_used: seconds (the caller's clock).
    """

    in_peer: bytes
    in_path_id: bytes
    hop: RelayHop
    created_at: float
    last_used: float
    #: proxies: reply tags registered on this path, oldest first
    tags: dict[bytes, None] = field(default_factory=dict)


@dataclass(eq=False)
class ReplyTag:
    """A reply tag registered at a proxy (see the module docstring)."""

    entry: RelayEntry
    destination: bytes
    expires_at: float
    replies_left: int


class RelayTable:
    """Entries of every path relayed by this node.

    Args:
        max_entries: paths relayed at most; a setup beyond it is refused.
        max_per_peer: paths relayed at most for one predecessor, so one peer cannot take the
            whole table.
    """

    def __init__(self, max_entries: int = 100_000, max_per_peer: int = 20_000) -> None:
        self.max_entries = max_entries
        self.max_per_peer = max_per_peer
        self._per_peer: dict[bytes, int] = {}
        self._forward: dict[tuple[bytes, bytes], RelayEntry] = {}
        self._backward: dict[tuple[bytes, bytes], RelayEntry] = {}
        self._tags: dict[bytes, ReplyTag] = {}

    def __len__(self) -> int:
        return len(self._forward)

    def add(self, in_peer: bytes, in_path_id: bytes, hop: RelayHop, now: float) -> RelayEntry:
        """Record a path set up through this node.

        Raises:
            RemoteProtocolError: the incoming or outgoing path ID is already in use on that link,
                or the table (or this predecessor's share of it) is full.
        """
        if len(self._forward) >= self.max_entries:
            raise RemoteProtocolError(f"relay table full ({self.max_entries} paths)")
        if self._per_peer.get(in_peer, 0) >= self.max_per_peer:
            raise RemoteProtocolError(f"too many paths from one peer ({self.max_per_peer})")
        key = (in_peer, in_path_id)
        if key in self._forward:
            raise RemoteProtocolError("incoming path ID already in use on this link")
        if not hop.is_proxy:
            assert hop.next_peer_id is not None
            if (hop.next_peer_id, hop.out_path_id) in self._backward:
                raise RemoteProtocolError("outgoing path ID already in use on the next link")
        entry = RelayEntry(in_peer, in_path_id, hop, now, now)
        self._forward[key] = entry
        self._per_peer[in_peer] = self._per_peer.get(in_peer, 0) + 1
        if not hop.is_proxy:
            assert hop.next_peer_id is not None
            self._backward[(hop.next_peer_id, hop.out_path_id)] = entry
        return entry

    def lookup(self, peer: bytes, path_id: bytes) -> tuple[RelayEntry, Direction] | None:
        """The entry a cell from ``peer`` with ``path_id`` belongs to, and its direction."""
        entry = self._forward.get((peer, path_id))
        if entry is not None:
            return entry, Direction.FORWARD
        entry = self._backward.get((peer, path_id))
        if entry is not None:
            return entry, Direction.BACKWARD
        return None

    def add_reply_tag(
        self, tag: bytes, entry: RelayEntry, destination: bytes, now: float, *,
        ttl: float, replies: int, max_per_path: int = 64,
    ) -> bool:
        """Register ``tag`` for replies to ``entry``'s path from ``destination``.

        Returns:
            False (nothing registered) when the tag is in use. A path holding ``max_per_path``
            live tags forgets its oldest one.
        """
        if tag in self._tags:
            return False
        while len(entry.tags) >= max_per_path:
            self._drop_tag(next(iter(entry.tags)))
        self._tags[tag] = ReplyTag(entry, destination, now + ttl, replies)
        entry.tags[tag] = None
        return True

    def take_reply(self, tag: bytes, sender: bytes, now: float) -> RelayEntry | None:
        """The path a reply under ``tag`` from ``sender`` goes back on, spending one reply; None
        when the tag is unknown, expired, spent, or registered for another model node."""
        registered = self._tags.get(tag)
        if registered is None or registered.destination != sender:
            return None
        if now >= registered.expires_at:
            self._drop_tag(tag)
            return None
        registered.replies_left -= 1
        if registered.replies_left <= 0:
            self._drop_tag(tag)
        return registered.entry

    def _drop_tag(self, tag: bytes) -> None:
        registered = self._tags.pop(tag, None)
        if registered is not None:
            registered.entry.tags.pop(tag, None)

    def touch(self, entry: RelayEntry, now: float) -> None:
        entry.last_used = now

    def remove(self, entry: RelayEntry) -> None:
        """Forget ``entry`` (no error when it is already gone)."""
        if self._forward.get((entry.in_peer, entry.in_path_id)) is entry:
            del self._forward[(entry.in_peer, entry.in_path_id)]
            left = self._per_peer[entry.in_peer] - 1
            if left:
                self._per_peer[entry.in_peer] = left
            else:
                del self._per_peer[entry.in_peer]
        for tag in list(entry.tags):
            self._drop_tag(tag)
        hop = entry.hop
        if not hop.is_proxy and hop.next_peer_id is not None:
            key = (hop.next_peer_id, hop.out_path_id)
            if self._backward.get(key) is entry:
                del self._backward[key]

    def remove_peer(self, peer: bytes) -> list[RelayEntry]:
        """Remove and return every entry whose predecessor or successor is ``peer``."""
        gone = [
            e for e in self._forward.values()
            if e.in_peer == peer or e.hop.next_peer_id == peer
        ]
        for entry in gone:
            self.remove(entry)
        return gone

    def expire(self, now: float, idle_timeout: float) -> list[RelayEntry]:
        """Remove and return entries unused for ``idle_timeout`` seconds; forget expired tags."""
        for tag in [t for t, r in self._tags.items() if now >= r.expires_at]:
            self._drop_tag(tag)
        gone = [e for e in self._forward.values() if now - e.last_used >= idle_timeout]
        for entry in gone:
            self.remove(entry)
        return gone


__all__ = ["Direction", "RelayEntry", "RelayTable", "ReplyTag"]
