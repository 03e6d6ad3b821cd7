"""A committee of validators on loopback in one trio run (tests and benchmarks).

:class:`LocalCommittee` makes N validator identities, a genesis, and one
:class:`~ps_p2p.protocols.consensus.ConsensusService` per member on its own py-libp2p host and
sqlite store under ``folder``. Each member runs in its own cancel scope, so a test can kill one
(:meth:`LocalCommittee.kill`: host, links and service stop at once; the store file stays) and
start it again from its store (:meth:`LocalCommittee.start`), reconnected to the running ones.

:class:`MemoryCommittee` runs the validators' glue (:class:`~ps_p2p.registry.validator.
Validator`) without libp2p: every action delivered in memory, on a fake clock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from ps_p2p import registry as app
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator as CommitteeMember
from ps_p2p.errors import InvalidTransactionError
from ps_p2p.keys import Identity
from ps_p2p.protocols.admission import LOOPBACK, InboundLimits
from ps_p2p.protocols.consensus import WIRE, ConsensusService, ConsensusServiceConfig
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.registry.validator import Committed, RelayTx, SendMessage, Validator

#: Connection limits of the members: every member is on 127.0.0.1, so per-address caps would
#: group them all (a committee of 31 dials one member 30 times at once).
LOOPBACK_EXEMPT = InboundLimits(exempt=LOOPBACK)

#: Small timeouts for loopback committees.
FAST_CONSENSUS = ConsensusConfig(
    timeout_propose=0.2, timeout_propose_delta=0.1, timeout_prevote=0.2,
    timeout_prevote_delta=0.1, timeout_precommit=0.2, timeout_precommit_delta=0.1,
)


@dataclass(eq=False)
class Member:
    """One validator of a :class:`LocalCommittee` (host and service exist while it runs)."""

    index: int
    identity: Identity
    store_path: pathlib.Path
    host: object | None = None
    service: ConsensusService | None = None
    scope: trio.CancelScope | None = None
    stopped: trio.Event = field(default_factory=trio.Event)
    #: every Committed this member saw, over all its runs
    commits: list[Committed] = field(default_factory=list)

    @property
    def peer_id(self) -> bytes:
        return self.identity.peer_id

    @property
    def running(self) -> bool:
        return self.service is not None


class LocalCommittee:
    """N validators on 127.0.0.1 (see the module docstring).

    Args:
        nursery: where members run.
        folder: their store files.
        n: committee size.
        consensus: the core's timeouts (default :data:`FAST_CONSENSUS`).
        config: the services' settings.
        genesis_time_ms: default: now.
        on_commit: called with (member, Committed) for every commit of every member.
        byzantine: indices of members that equivocate (TEST ONLY,
            ``ConsensusServiceConfig.byzantine``).
        joining: members beyond the ``n`` of the genesis (indices n, n+1, ...): they run
            with ``ConsensusServiceConfig.joining`` and vote once a VALSET_UPDATE adds them.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        folder: pathlib.Path,
        n: int = 4,
        *,
        consensus: ConsensusConfig = FAST_CONSENSUS,
        config: ConsensusServiceConfig | None = None,
        genesis_time_ms: int | None = None,
        policy: app.AdmissionPolicy | None = None,
        on_commit: Callable[[Member, Committed], None] | None = None,
        byzantine: tuple[int, ...] = (),
        joining: int = 0,
    ) -> None:
        import time

        self.nursery = nursery
        self.consensus = consensus
        # a test committee: an empty block every 0.5 s when idle (the default is 30 s), as
        # its tests wait for heights
        self.config = config or ConsensusServiceConfig(empty_block_interval=0.5)
        self.on_commit = on_commit
        self.byzantine = frozenset(byzantine)
        identities = [
            Identity.from_private_bytes(hashlib.sha256(b"validator %d" % i).digest())
            for i in range(n + joining)
        ]
        self.n = n
        self.genesis = app.Genesis(
            "local-committee",
            genesis_time_ms if genesis_time_ms is not None else time.time_ns() // 1_000_000 - 1000,
            tuple(CommitteeMember(k.peer_id) for k in identities[:n]),
            policy or app.AdmissionPolicy(max_records_per_network=10_000),
        )
        self.members = [
            Member(i, k, pathlib.Path(folder) / f"validator-{i}.sqlite")
            for i, k in enumerate(identities)
        ]

    async def start_all(self) -> None:
        """Start every member: hosts first, a full mesh of connections, then the services."""
        hosts_up = [trio.Event() for _ in self.members]
        go = trio.Event()
        started = []
        for m, up in zip(self.members, hosts_up):
            started.append(trio.Event())
            self.nursery.start_soon(self._run, m, up, go, started[-1])
        for up in hosts_up:
            await up.wait()
        for i, a in enumerate(self.members):
            for b in self.members[i + 1:]:
                await connect(a.host, listen_multiaddrs(b.host)[0])  # type: ignore[arg-type]
        go.set()
        for s in started:
            await s.wait()

    async def start(self, member: Member) -> None:
        """(Re)start one member from its store, connected to the running members."""
        up, go, started = trio.Event(), trio.Event(), trio.Event()
        self.nursery.start_soon(self._run, member, up, go, started)
        await up.wait()
        for other in self.members:
            if other is not member and other.running:
                await connect(member.host, listen_multiaddrs(other.host)[0])  # type: ignore[arg-type]
        go.set()
        await started.wait()

    async def kill(self, member: Member, *, close_timeout: float = 3.0) -> None:
        """Stop a member as a crashed process stops and wait until it is gone: its connections
        and listener close first (peers read EOF at once; a cancelled task alone can leave its
        sockets open, which peers take for a frozen node), then its nursery is cancelled."""
        assert member.scope is not None
        if member.host is not None:
            with trio.move_on_after(close_timeout):
                await member.host.get_network().close()  # type: ignore[attr-defined]
        member.scope.cancel()
        await member.stopped.wait()

    async def _run(self, m: Member, up: trio.Event, go: trio.Event, started: trio.Event) -> None:
        m.stopped = trio.Event()
        store = ConsensusStore(m.store_path)
        try:
            with trio.CancelScope() as m.scope:
                async with open_host(m.identity, ["/ip4/127.0.0.1/tcp/0"],
                                     inbound=LOOPBACK_EXEMPT) as host:
                    m.host = host
                    up.set()
                    await go.wait()

                    def commit(c: Committed) -> None:
                        m.commits.append(c)
                        if self.on_commit is not None:
                            self.on_commit(m, c)

                    config = self.config
                    if m.index in self.byzantine:
                        config = dataclasses.replace(config, byzantine=True)
                    if m.index >= self.n:
                        config = dataclasses.replace(config, joining=True)
                    m.service = ConsensusService(
                        host, m.identity, self.genesis, store, self.consensus, config,
                        on_commit=commit,
                    )
                    async with trio.open_nursery() as inner:
                        await inner.start(m.service.run)
                        started.set()
        finally:
            m.service = None
            m.host = None
            store.close()
            m.stopped.set()

    def running(self) -> list[Member]:
        return [m for m in self.members if m.running]

    async def wait_committed(self, height: int, members: list[Member] | None = None) -> None:
        """Wait until every given (default: running) member committed ``height``."""
        for m in members or self.running():
            assert m.service is not None
            await m.service.wait_committed(height)


class MemoryCommittee:
    """Validators exchanging their actions in memory on a fake clock (tests; no trio).

    Every :class:`~ps_p2p.registry.validator.SendMessage` / ``RelayTx`` reaches the other
    running validators in FIFO order; a validator behind a message's height first takes the
    sender's stored blocks (block sync). Time jumps to the earliest deadline when nothing is
    queued.

    Args:
        keys: the validators' identities (``genesis``' validators, in order; more keys are
            validators a VALSET_UPDATE may add: they follow the chain until then).
        genesis: the chain.
        consensus: the timeouts (default :data:`FAST_CONSENSUS`).
        stores: one per validator (default in-memory ones), e.g. to restart from.
        down: indices not started (and deaf).
        value_check: ``value_check(i)``, validator i's own check of epoch reports (or None).
        genesis_offset_ms: the validators' unix clock is ``genesis time + offset + now``.
        validator_options: more keyword arguments of every :class:`Validator` (e.g.
            ``snapshot_every``).
    """

    def __init__(self, keys: Sequence[Identity], genesis: app.Genesis, *,
                 consensus: ConsensusConfig | None = None,
                 stores: list[ConsensusStore] | None = None, down: Sequence[int] = (),
                 value_check: Callable[[int], Callable[[bytes], str | None] | None] | None = None,
                 empty_block_interval: float = 0.5, genesis_offset_ms: int = 1000,
                 validator_options: dict[str, object] | None = None) -> None:
        self.keys = list(keys)
        self._options = dict(validator_options or {})
        self.genesis = genesis
        self.consensus = consensus or FAST_CONSENSUS
        self.now = 0.0
        self.stores = stores or [ConsensusStore(":memory:") for _ in self.keys]
        self.down = set(down)
        self._value_check = value_check
        self._interval = empty_block_interval
        self._offset = genesis_offset_ms
        self.vals = [self.make(i) for i in range(len(self.keys))]
        self.queue: deque[tuple[int, object, int]] = deque()
        self.committed: list[list[Committed]] = [[] for _ in self.keys]
        for i, v in enumerate(self.vals):
            if i not in self.down:
                self.route(i, v.start(self.now))

    def make(self, i: int) -> Validator:
        """A new validator i on its store (a restart when the store holds blocks)."""
        return Validator(
            self.keys[i], self.genesis, self.stores[i], WIRE, self.consensus,
            empty_block_interval=self._interval,
            unix_ms=lambda: self.genesis.time_ms + self._offset + int(self.now * 1000),
            value_check=self._value_check(i) if self._value_check is not None else None,
            joining=all(v.address != self.keys[i].peer_id for v in self.genesis.validators),
            **self._options)  # type: ignore[arg-type]

    def route(self, src: int, actions: Sequence[object]) -> None:
        """Deliver validator ``src``'s actions (queued for the others; commits recorded)."""
        for a in actions:
            if isinstance(a, Committed):
                self.committed[src].append(a)
            elif isinstance(a, (SendMessage, RelayTx)):
                for dst in range(len(self.vals)):
                    if dst != src:
                        self.queue.append((dst, a, src))

    def step(self) -> None:
        """Deliver one queued action, or advance the clock to the next deadline."""
        if self.queue:
            dst, a, src = self.queue.popleft()
            if dst in self.down:
                return
            v = self.vals[dst]
            if isinstance(a, SendMessage):
                if a.message.height > v.height:  # behind: block sync from the sender's store
                    rows = self.stores[src].blocks_from(v.height, 64)
                    self.route(dst, v.apply_synced(
                        [(h, b, WIRE.decode_commit(c)) for h, b, c in rows], self.now))
                self.route(dst, v.receive(a.message, self.now))
            else:
                assert isinstance(a, RelayTx)
                try:
                    self.route(dst, v.add_tx(a.tx, self.now, self.keys[src].peer_id))
                except InvalidTransactionError:
                    pass
            return
        deadlines = [d for i, v in enumerate(self.vals)
                     if i not in self.down and (d := v.next_deadline()) is not None]
        self.now = max(self.now, min(deadlines))
        for i, v in enumerate(self.vals):
            if i not in self.down:
                self.route(i, v.tick(self.now))

    def run_until(self, cond: Callable[[], bool], limit: float = 30.0) -> bool:
        """Step until ``cond()``; False when the fake clock passes ``limit`` seconds first."""
        while not cond():
            if self.now >= limit:
                return False
            self.step()
        return True


__all__ = ["FAST_CONSENSUS", "LocalCommittee", "Member", "MemoryCommittee"]
