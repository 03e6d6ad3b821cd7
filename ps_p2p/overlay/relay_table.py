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
are bounded per peer and in total; idle entries and spent tags expire in O(expired). Source: PlanetServe sec. 3.2 (path tables).

Who may hold how many entries (issue 16: ten identities outside the directory filled a relay's
10,000 paths in 11 s, after which no honest setup got through):

* a predecessor the directory lists as a user (every honest relay, and every registered user
  building its paths) holds at most its *share*, ``max_entries`` over the number of listed users,
  clamped to [``min_share``, ``max_per_peer``] (:meth:`RelayTable.listed_share`), so the listed
  users together fit in the table; to fill it, a sybil set needs ``max_entries / min_share``
  listed identities, which the committee's admission caps make expensive (per /24 network, per
  block);
* any other predecessor (a one-shot ``ps-node ask``, or a new user whose record has not
  committed yet) draws on a small pool of its own: ``max_unlisted`` entries in all,
  ``max_unlisted_per_peer`` each and ``max_unlisted_per_origin`` per source network (an IPv4
  /24 or IPv6 /48, given by the service; loopback has none, so a devnet is not limited by it),
  so outsiders can never take more than that pool from listed users.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable
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
        listed: the predecessor was a directory user when the path was set up (else the entry
            counts against the unlisted pool).
        origin: the predecessor's source network (unlisted entries; None: not counted).
    """

    in_peer: bytes
    in_path_id: bytes
    hop: RelayHop
    created_at: float
    last_used: float
    listed: bool = True
    origin: Hashable | None = None
    #: proxies: reply tags registered on this path, oldest first
    tags: dict[bytes, None] = field(default_factory=dict)


@dataclass(eq=False)
class ReplyTag:
    """A reply tag registered at a proxy (see the module docstring)."""

    entry: RelayEntry
    destination: bytes
    expires_at: float
    replies_left: int


#: Paths relayed at most, over all predecessors. A relay entry holds a hop's keys and the two
#: cipher objects of its role (~5 KB measured with 10,000 entries,
#: benchmarks/attacks/path_table_fill.py), so this bounds a relay's table at ~52 MB; a relay
#: in a network of a few thousand users carries ~15 paths on average.
DEFAULT_MAX_ENTRIES = 10_000
#: Paths relayed at most for one predecessor (a busy middle relay forwards many users' paths).
DEFAULT_MAX_PER_PEER = 1_000
#: Share of a listed predecessor at least, however many users the directory lists: a relay of a
#: network of a few thousand users carries ~15 paths in all, and a user keeps 5 (spares
#: included), so 32 leaves room for bursts of replacements. A listed sybil set needs
#: 10,000 / 32 = 313 registered identities to fill a default table.
DEFAULT_MIN_SHARE = 32
#: Paths relayed at most for predecessors the directory does not list, in total (5% of the
#: default table): one-shot clients and users whose record has not committed yet.
DEFAULT_MAX_UNLISTED = 512
#: ... for one such predecessor: a user keeps 5 paths, and replaces some in parallel.
DEFAULT_MAX_UNLISTED_PER_PEER = 16
#: ... from one source network (IPv4 /24, IPv6 /48): a site of unlisted identities takes at most
#: an eighth of the unlisted pool.
DEFAULT_MAX_UNLISTED_PER_ORIGIN = 64
#: Live reply tags at most, over all paths (~200 bytes each); the oldest is forgotten beyond it.
DEFAULT_MAX_TAGS = 100_000
#: Live reply tags at most on one path; the path's oldest is forgotten beyond it.
DEFAULT_MAX_TAGS_PER_PATH = 64


class RelayTable:
    """Entries of every path relayed by this node.

    Every count a peer controls is bounded per peer and in total (identities are free), and
    expiry is indexed: entries are kept in order of last use and tags in order of registration,
    so :meth:`expire` costs O(expired), never a scan of the table (DESIGN.md "Security
    invariants").

    Args:
        max_entries: paths relayed at most; a setup beyond it is refused.
        max_per_peer: paths relayed at most for one predecessor, so one peer cannot take the
            whole table (the most a listed predecessor's share can be).
        max_tags: live reply tags at most; beyond it the oldest tag is forgotten.
        min_share: the least share of a listed predecessor (:meth:`listed_share`).
        max_unlisted, max_unlisted_per_peer, max_unlisted_per_origin: paths relayed at most
            for predecessors the directory does not list: in total, for one, and from one
            source network (see the module docstring).
    """

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        *,
        max_tags: int = DEFAULT_MAX_TAGS,
        min_share: int = DEFAULT_MIN_SHARE,
        max_unlisted: int = DEFAULT_MAX_UNLISTED,
        max_unlisted_per_peer: int = DEFAULT_MAX_UNLISTED_PER_PEER,
        max_unlisted_per_origin: int = DEFAULT_MAX_UNLISTED_PER_ORIGIN,
    ) -> None:
        self.max_entries = max_entries
        self.max_per_peer = max_per_peer
        self.max_tags = max_tags
        self.min_share = min_share
        self.max_unlisted = max_unlisted
        self.max_unlisted_per_peer = max_unlisted_per_peer
        self.max_unlisted_per_origin = max_unlisted_per_origin
        self._per_peer: dict[bytes, int] = {}
        self._unlisted = 0
        self._per_origin: dict[Hashable, int] = {}
        # (predecessor, incoming path ID) -> entry, least recently used first
        self._forward: OrderedDict[tuple[bytes, bytes], RelayEntry] = OrderedDict()
        self._backward: dict[tuple[bytes, bytes], RelayEntry] = {}
        # peer -> entries with that peer as predecessor or successor (for link loss)
        self._by_peer: dict[bytes, set[RelayEntry]] = {}
        self._tags: OrderedDict[bytes, ReplyTag] = OrderedDict()  # oldest registration first
        # model node -> its live reply tags (a proxy tells their users when it loses the node)
        self._tags_by_destination: dict[bytes, dict[bytes, None]] = {}

    def __len__(self) -> int:
        return len(self._forward)

    @property
    def tag_count(self) -> int:
        """Live (unexpired as of the last :meth:`expire`) reply tags."""
        return len(self._tags)

    @property
    def unlisted_count(self) -> int:
        """Entries whose predecessor was not a directory user at setup."""
        return self._unlisted

    def paths_from(self, peer: bytes) -> int:
        """Entries whose predecessor is ``peer``."""
        return self._per_peer.get(peer, 0)

    def listed_share(self, listed_peers: int) -> int:
        """The most entries one listed predecessor may hold when the directory lists
        ``listed_peers`` users: ``max_entries // listed_peers`` clamped to [``min_share``,
        ``max_per_peer``] (the listed users' shares together fit in the table unless there are
        more than ``max_entries / min_share`` of them)."""
        fair = self.max_entries // max(listed_peers, 1)
        return max(self.min_share, min(self.max_per_peer, fair))

    def refusal(
        self, in_peer: bytes, *, listed: bool = True, origin: Hashable | None = None,
        share: int | None = None,
    ) -> str | None:
        """Why :meth:`add` would refuse one more entry from ``in_peer`` (arguments as there),
        or None; O(1), so a relay can refuse before it spends an X25519 on the packet."""
        if len(self._forward) >= self.max_entries:
            return f"relay table full ({self.max_entries} paths)"
        held = self._per_peer.get(in_peer, 0)
        if listed:
            limit = self.max_per_peer if share is None else min(share, self.max_per_peer)
            if held >= limit:
                return f"too many paths from one peer ({limit})"
            return None
        if held >= self.max_unlisted_per_peer:
            return f"too many paths from one peer outside the directory ({self.max_unlisted_per_peer})"
        if self._unlisted >= self.max_unlisted:
            return f"too many paths from peers outside the directory ({self.max_unlisted})"
        if origin is not None and self._per_origin.get(origin, 0) >= self.max_unlisted_per_origin:
            return (f"too many paths from one network outside the directory "
                    f"({self.max_unlisted_per_origin})")
        return None

    def add(
        self, in_peer: bytes, in_path_id: bytes, hop: RelayHop, now: float, *,
        listed: bool = True, origin: Hashable | None = None, share: int | None = None,
    ) -> RelayEntry:
        """Record a path set up through this node.

        Args:
            listed: the directory lists ``in_peer`` as a user; otherwise the entry draws on the
                unlisted pool (``max_unlisted``, ``max_unlisted_per_peer``, and
                ``max_unlisted_per_origin`` for an ``origin`` that is not None).
            origin: ``in_peer``'s source network (any hashable; None: not counted).
            share: a listed predecessor's most entries (:meth:`listed_share`); None:
                ``max_per_peer``.

        Raises:
            RemoteProtocolError: the incoming or outgoing path ID is already in use on that link,
                or the table (or this predecessor's share of it) is full.
        """
        refusal = self.refusal(in_peer, listed=listed, origin=origin, share=share)
        if refusal is not None:
            raise RemoteProtocolError(refusal)
        held = self._per_peer.get(in_peer, 0)
        key = (in_peer, in_path_id)
        if key in self._forward:
            raise RemoteProtocolError("incoming path ID already in use on this link")
        if not hop.is_proxy:
            assert hop.next_peer_id is not None
            if (hop.next_peer_id, hop.out_path_id) in self._backward:
                raise RemoteProtocolError("outgoing path ID already in use on the next link")
        if listed:
            origin = None
        entry = RelayEntry(in_peer, in_path_id, hop, now, now, listed, origin)
        self._forward[key] = entry
        self._per_peer[in_peer] = held + 1
        if not listed:
            self._unlisted += 1
            if origin is not None:
                self._per_origin[origin] = self._per_origin.get(origin, 0) + 1
        self._by_peer.setdefault(in_peer, set()).add(entry)
        if not hop.is_proxy:
            assert hop.next_peer_id is not None
            self._backward[(hop.next_peer_id, hop.out_path_id)] = entry
            self._by_peer.setdefault(hop.next_peer_id, set()).add(entry)
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
        ttl: float, replies: int, max_per_path: int = DEFAULT_MAX_TAGS_PER_PATH,
    ) -> bool:
        """Register ``tag`` for replies to ``entry``'s path from ``destination``.

        ``ttl`` should be the same for every tag of a table: tags expire in registration order.

        Returns:
            False (nothing registered) when the tag is in use or the entry is no longer in the
            table. A path holding ``max_per_path`` live tags forgets its oldest one; a table
            holding ``max_tags`` forgets its oldest one.
        """
        if tag in self._tags or self._forward.get((entry.in_peer, entry.in_path_id)) is not entry:
            return False
        while len(entry.tags) >= max_per_path:
            self._drop_tag(next(iter(entry.tags)))
        while len(self._tags) >= self.max_tags:
            self._drop_tag(next(iter(self._tags)))
        self._tags[tag] = ReplyTag(entry, destination, now + ttl, replies)
        entry.tags[tag] = None
        self._tags_by_destination.setdefault(destination, {})[tag] = None
        return True

    def has_tags_for(self, destination: bytes) -> bool:
        """Whether reply tags (live or not yet expired by :meth:`expire`) wait for replies
        from model node ``destination``; O(1)."""
        return bool(self._tags_by_destination.get(destination))

    def take_tags_for(self, destination: bytes, now: float) -> list[tuple[bytes, RelayEntry]]:
        """Forget and return the live (unexpired, unspent) reply tags registered for replies
        from model node ``destination``, oldest first, with the path each one belongs to;
        O(tags of that destination)."""
        out = []
        for tag in list(self._tags_by_destination.get(destination, ())):
            registered = self._tags[tag]
            if now < registered.expires_at:
                out.append((tag, registered.entry))
            self._drop_tag(tag)
        return out

    def find_reply(self, tag: bytes, sender: bytes, now: float) -> RelayEntry | None:
        """The path a reply under ``tag`` from ``sender`` would go back on, spending nothing;
        None when the tag is unknown, expired, spent, or registered for another model node."""
        registered = self._tags.get(tag)
        if registered is None or registered.destination != sender:
            return None
        if now >= registered.expires_at:
            self._drop_tag(tag)
            return None
        return registered.entry

    def spend_reply(self, tag: bytes) -> None:
        """Spend one reply of ``tag`` (found with :meth:`find_reply`); the last one forgets it."""
        registered = self._tags.get(tag)
        if registered is not None:
            registered.replies_left -= 1
            if registered.replies_left <= 0:
                self._drop_tag(tag)

    def take_reply(self, tag: bytes, sender: bytes, now: float) -> RelayEntry | None:
        """:meth:`find_reply` and, when found, :meth:`spend_reply`."""
        entry = self.find_reply(tag, sender, now)
        if entry is not None:
            self.spend_reply(tag)
        return entry

    def _drop_tag(self, tag: bytes) -> None:
        registered = self._tags.pop(tag, None)
        if registered is not None:
            registered.entry.tags.pop(tag, None)
            tags = self._tags_by_destination.get(registered.destination)
            if tags is not None:
                tags.pop(tag, None)
                if not tags:
                    del self._tags_by_destination[registered.destination]

    def touch(self, entry: RelayEntry, now: float) -> None:
        """Mark ``entry`` used at ``now`` (moves it to the back of the expiry order)."""
        entry.last_used = now
        key = (entry.in_peer, entry.in_path_id)
        if self._forward.get(key) is entry:
            self._forward.move_to_end(key)

    def remove(self, entry: RelayEntry) -> None:
        """Forget ``entry`` (no error when it is already gone)."""
        if self._forward.get((entry.in_peer, entry.in_path_id)) is entry:
            del self._forward[(entry.in_peer, entry.in_path_id)]
            left = self._per_peer[entry.in_peer] - 1
            if left:
                self._per_peer[entry.in_peer] = left
            else:
                del self._per_peer[entry.in_peer]
            if not entry.listed:
                self._unlisted -= 1
                if entry.origin is not None:
                    left = self._per_origin[entry.origin] - 1
                    if left:
                        self._per_origin[entry.origin] = left
                    else:
                        del self._per_origin[entry.origin]
        for tag in list(entry.tags):
            self._drop_tag(tag)
        hop = entry.hop
        self._unindex(entry.in_peer, entry)
        if not hop.is_proxy and hop.next_peer_id is not None:
            key = (hop.next_peer_id, hop.out_path_id)
            if self._backward.get(key) is entry:
                del self._backward[key]
            self._unindex(hop.next_peer_id, entry)

    def _unindex(self, peer: bytes, entry: RelayEntry) -> None:
        entries = self._by_peer.get(peer)
        if entries is not None:
            entries.discard(entry)
            if not entries:
                del self._by_peer[peer]

    def remove_peer(self, peer: bytes) -> list[RelayEntry]:
        """Remove and return every entry whose predecessor or successor is ``peer``
        (O(entries of that peer))."""
        gone = list(self._by_peer.get(peer, ()))
        for entry in gone:
            self.remove(entry)
        return gone

    def next_expiry(self, idle_timeout: float) -> float | None:
        """When :meth:`expire` next has work (the oldest tag's expiry or the least recently
        used entry's idle deadline), or None for an empty table; O(1)."""
        times = []
        if self._tags:
            times.append(next(iter(self._tags.values())).expires_at)
        if self._forward:
            times.append(next(iter(self._forward.values())).last_used + idle_timeout)
        return min(times) if times else None

    def expire(self, now: float, idle_timeout: float) -> list[RelayEntry]:
        """Remove and return entries unused for ``idle_timeout`` seconds; forget expired tags.

        Costs O(expired entries and tags): both are kept in expiry order.
        """
        while self._tags:
            tag, registered = next(iter(self._tags.items()))
            if now < registered.expires_at:
                break
            self._drop_tag(tag)
        gone = []
        while self._forward:
            entry = next(iter(self._forward.values()))
            if now - entry.last_used < idle_timeout:
                break
            self.remove(entry)
            gone.append(entry)
        return gone


__all__ = ["Direction", "RelayEntry", "RelayTable", "ReplyTag"]
