"""The relay table: which path a cell belongs to and where it goes next (sans-I/O).

Every relay (and proxy) keeps one :class:`RelayEntry` per path through it, indexed three ways:

* forward: ``(predecessor peer ID, incoming path ID)`` -> entry (cells towards the proxy);
* backward: ``(successor peer ID, outgoing path ID)`` -> entry (cells back to the user);
* exit: ``exit path ID`` -> entry, for proxies: a model node's response clove names the path by
  the exit path ID the user put in its request.

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
        hop: this node's layer of the path (successor, outgoing/exit path ID, cell keys).
        created_at, last_used: seconds (the caller's clock).
    """

    in_peer: bytes
    in_path_id: bytes
    hop: RelayHop
    created_at: float
    last_used: float
    #: proxies: model nodes this path delivered cloves to (only they may send replies on it)
    destinations: set[bytes] = field(default_factory=set)


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
        self._exit: dict[bytes, RelayEntry] = {}

    def __len__(self) -> int:
        return len(self._forward)

    def add(self, in_peer: bytes, in_path_id: bytes, hop: RelayHop, now: float) -> RelayEntry:
        """Record a path set up through this node.

        Raises:
            RemoteProtocolError: the incoming or outgoing path ID is already in use on that link,
                the exit path ID is taken, or the table is full.
        """
        if len(self._forward) >= self.max_entries:
            raise RemoteProtocolError(f"relay table full ({self.max_entries} paths)")
        if self._per_peer.get(in_peer, 0) >= self.max_per_peer:
            raise RemoteProtocolError(f"too many paths from one peer ({self.max_per_peer})")
        key = (in_peer, in_path_id)
        if key in self._forward:
            raise RemoteProtocolError("incoming path ID already in use on this link")
        if hop.is_proxy:
            if hop.out_path_id in self._exit:
                raise RemoteProtocolError("exit path ID already in use")
        else:
            assert hop.next_peer_id is not None
            if (hop.next_peer_id, hop.out_path_id) in self._backward:
                raise RemoteProtocolError("outgoing path ID already in use on the next link")
        entry = RelayEntry(in_peer, in_path_id, hop, now, now)
        self._forward[key] = entry
        self._per_peer[in_peer] = self._per_peer.get(in_peer, 0) + 1
        if hop.is_proxy:
            self._exit[hop.out_path_id] = entry
        else:
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

    def lookup_exit(self, exit_path_id: bytes) -> RelayEntry | None:
        """Proxies: the path whose exit path ID a model node named."""
        return self._exit.get(exit_path_id)

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
        hop = entry.hop
        if hop.is_proxy:
            if self._exit.get(hop.out_path_id) is entry:
                del self._exit[hop.out_path_id]
        elif hop.next_peer_id is not None:
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
        """Remove and return entries unused for ``idle_timeout`` seconds."""
        gone = [e for e in self._forward.values() if now - e.last_used >= idle_timeout]
        for entry in gone:
            self.remove(entry)
        return gone


__all__ = ["Direction", "RelayEntry", "RelayTable"]
