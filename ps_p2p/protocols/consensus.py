"""``/planetserve/consensus/1.0.0``: a verifier's consensus service, a thin libp2p adapter around
:class:`ps_p2p.registry.validator.Validator` (DESIGN.md "Verifier committee", "Layers").

Wire: one-way message links among the committee (:mod:`ps_p2p.protocols.links`): each frame is
one ``ConsensusMessage`` (:mod:`ps_p2p.protocols.consensus_codec`): a signed proposal, a signed
vote, or a registry transaction. Direct streams among validators, no GossipSub (it drops
silently).

Inbound, on the stream handler's task, cheapest first, before the driver sees anything:

1. the sending peer must be a validator (else the stream is reset: nobody else speaks this
   protocol); at most ``max_inflight_per_peer`` of its inputs wait in the driver's inbox (more
   are dropped);
2. the frame decodes within the codec's bounds (frame size: the block limit plus framing);
3. a proposal's or vote's signer must be a validator, then, with no signature check: heights
   below the one being decided are dropped (stale), heights above the next one while a block
   sync from that peer is not due (``min_sync_interval``), and messages the validator would
   drop whatever their signature (:meth:`~ps_p2p.registry.validator.Validator.ignores`: a
   round the vote keeper refuses, a vote already held, a full next-height buffer; issue 16: a
   validator's flood of such valid votes cost a signature check and a pass of the core each);
   then the signature must verify (:func:`~ps_p2p.consensus.signing.verify_proposal` /
   ``verify_vote``; a cache of verified frames spares re-broadcasts a second check); heights
   above the next one are dropped and start a block sync from that peer.

A frame that fails 1-3 (but for stale or future heights) resets that stream only; every
refusal is counted by reason in :attr:`ConsensusService.refused`. Transactions go to the
mempool (:func:`~ps_p2p.registry.check_tx` first) in the driver task and a new one is
relayed once to the other validators; a refused one is counted, not reset (the sender's state
may differ).

Outbound: a :class:`~ps_p2p.protocols.links.LinkManager` (bounded per-peer queues, dial
back-off capped at :data:`VALIDATOR_REDIAL_MAX`, past py-libp2p's negative dial cache) and :class:`~ps_p2p.consensus.gossip.Gossip` (Algorithm 1's "gossip communication",
issue 17): a peer is sent what it lacks, never twice while its link stays up. A new own message
goes to every peer; a proposal with a POL round goes with its POL certificate (the 2f+1
prevotes of that round, L28) to the peers that lack them. Every ``rebroadcast_interval`` seconds
(default the core's ``timeout_prevote``) the gossip plan sends each peer its missing own
messages (after a lost link or a restart), the relay set of other validators' messages when it
has not moved for ``relay_after`` seconds (default twice the interval; longer while our own
heights take longer: ``Gossip.stall_after``), the rounds above its own when it is behind in
round, and the last commit when it is still in a later round of the height we decided.
Own signed messages are written to the WAL without an fsync on the event loop; the fsync runs
in a worker thread and the messages written before it are sent once it returned, in order
(group commit, ``deferred_sync``; issue 17: a signed message is still durable before it
leaves).

Block sync (:mod:`ps_p2p.protocols.blocksync`, served here too, to the validators and the
nodes listed in the committed registry only, with rates): a validator fetches, verifies
and executes blocks from a peer when a signed message of a height above its next one arrives,
when a message of its next height has waited ``sync_after`` seconds without its own height
moving (it missed the commit of its height), and at start from every connected validator (a
restarted validator that is behind).

A :class:`~ps_p2p.errors.StoreError` (the WAL or block store failed) stops the service: a
validator must not sign from a state it does not know.

TEST ONLY: ``ConsensusServiceConfig(byzantine=True)`` makes this validator equivocate
(:class:`ByzantineSender`, ``ps-node devnet --committee --perturb byzantine-verifier``): next to
each own message sent the normal way (through the WAL), it signs and sends a conflicting one to
half of the other validators, bypassing the WAL. Never set it outside tests.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol

from ps_p2p.consensus.block import decode_block, encode_block, make_block
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.gossip_policy import ServiceGossip
from ps_p2p.consensus.signing import (
    sign_proposal,
    sign_vote,
    verify_proposal,
    verify_vote,
)
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Proposal, Vote
from ps_p2p.errors import (
    ConfigError,
    InvalidSignatureError,
    PsError,
    RemoteProtocolError,
    StoreError,
)
from ps_p2p.protocols import consensus_codec as cc
from ps_p2p.protocols.blocksync import BlockSyncServer, fetch_blocks
from ps_p2p.protocols.driver import CoreDriver
from ps_p2p.protocols.handlers import StreamHandlers
from ps_p2p.protocols.host import is_connected
from ps_p2p.protocols.links import LinkManager, make_frame_handler
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.records.types import Signer
from ps_p2p.registry import AppState, Genesis, Mempool
from ps_p2p.registry.snapshot import encode_state
from ps_p2p.registry.validator import (
    EMPTY_BLOCK_INTERVAL,
    SNAPSHOT_EVERY,
    Action,
    Committed,
    RelayTx,
    SendMessage,
    Validator,
    WireCodec,
    unix_ms,
)

log = logging.getLogger(__name__)

CONSENSUS_PROTOCOL_ID = TProtocol("/planetserve/consensus/1.0.0")
#: Largest frame: a proposal carrying the largest value plus its fields.
MAX_FRAME_BYTES = cc.MAX_VALUE_BYTES + 1024
#: Verified frames remembered (their hashes), so a re-broadcast is not checked twice.
VERIFIED_CACHE = 4096
#: Seconds between two dials of an unreachable validator at most (times 0.5-1.5 jitter): the
#: validators are few and must stay linked, so a healed partition is reconnected within a
#: round's timeout, not after the overlay's 30 s back-off and py-libp2p's 60 s negative dial
#: cache (issue 17: ~50 s after a 2|2 partition; :class:`~ps_p2p.protocols.links.LinkManager`
#: ``persistent``).
VALIDATOR_REDIAL_MAX = 2.0

#: The wire form the validator stores its own messages and commits in.
WIRE = WireCodec(
    encode_message=cc.encode_message,
    decode_message=cc.decode_message,
    encode_commit=cc.encode_commit,
    decode_commit=cc.decode_commit,
)


@dataclass(frozen=True)
class ConsensusServiceConfig:
    """Settings of :class:`ConsensusService` (seconds unless said otherwise).

    Attributes:
        rebroadcast_interval: the gossip plan runs this often (what a peer lacks is sent);
            None: the core's ``timeout_prevote``.
        relay_after: a peer that has not moved for this long (or for our own smoothed time
            per height, when longer) is sent the other validators' messages it lacks; None:
            twice ``rebroadcast_interval`` (above a healthy height's decision time, so a
            healthy committee relays nothing).
        sync_after: a message of the next height waits this long before a block sync; None:
            the sum of the core's three base timeouts.
        empty_block_interval: an idle chain makes an empty block this often.
        queue_frames: frames queued per outbound link.
        max_inflight_per_peer: inputs of one peer waiting in the driver's inbox.
        sync_timeout: one block-sync request's deadline.
        min_sync_interval: between two syncs from one peer.
        snapshot_every, keep_blocks: state snapshots and block pruning
            (:class:`~ps_p2p.registry.validator.Validator`).
        deferred_sync: the WAL's fsync runs in a worker thread, grouped, and own messages
            are sent once it returned (:meth:`ConsensusService._flush_held`); False: each
            own message's write fsyncs on the event loop.
        byzantine: TEST ONLY: equivocate (:class:`ByzantineSender`); never set by users.
        joining: this identity need not be a genesis validator (one a VALSET_UPDATE adds:
            it follows the chain and votes once the committed set lists it).
    """

    rebroadcast_interval: float | None = None
    relay_after: float | None = None
    sync_after: float | None = None
    empty_block_interval: float = EMPTY_BLOCK_INTERVAL
    queue_frames: int = 1024
    max_inflight_per_peer: int = 1024
    sync_timeout: float = 10.0
    min_sync_interval: float = 0.5
    snapshot_every: int = SNAPSHOT_EVERY
    keep_blocks: int | None = None
    deferred_sync: bool = True
    byzantine: bool = False
    joining: bool = False


class ByzantineSender:
    """TEST ONLY: the equivocations of a Byzantine validator (``ConsensusServiceConfig.byzantine``).

    For each own message the service sends (already in the WAL and sent to everyone), it
    signs a conflicting one of the same (height, round, step) and returns it with the peers to
    send it to, half of the other validators (rounded up): a vote for a value gets a nil vote,
    a nil vote one for another value ID; a proposal gets a second block, the same one with
    the block time one millisecond later. Once per (height, round, step); never written to the
    WAL (a correct validator's WAL would refuse it). Correct validators that receive both
    votes turn them into equivocation evidence (an EVIDENCE transaction).
    """

    def __init__(self, identity: Signer, genesis: Genesis, peers: tuple[bytes, ...]) -> None:
        self.identity = identity
        self.genesis = genesis
        self.targets = peers[: (len(peers) + 1) // 2]
        self._done: set[tuple[int, int, int]] = set()
        self.sent = 0

    def conflicting(self, message: Proposal | Vote) -> Proposal | Vote | None:
        """The conflicting message for ``message`` (None: already sent, or not ours)."""
        step = 0 if isinstance(message, Proposal) else int(message.type)
        key = (message.height, message.round, step)
        if key in self._done:
            return None
        self._done = {k for k in self._done if k[0] >= message.height}
        self._done.add(key)
        chain = self.genesis.chain_id
        if isinstance(message, Vote):
            if message.validator != self.identity.peer_id:
                return None
            other = (None if message.value_id is not None
                     else hashlib.sha256(b"byzantine" + message.signature).digest())
            conflict: Proposal | Vote = sign_vote(self.identity, chain, Vote(
                message.type, message.height, message.round, other, self.identity.peer_id))
        else:
            if message.proposer != self.identity.peer_id:
                return None
            try:
                honest = decode_block(message.value, self.genesis.limits)
            except PsError:
                return None
            h = honest.header
            block = make_block(
                chain_id=h.chain_id, height=h.height, time_ms=h.time_ms + 1,
                prev_block_id=h.prev_block_id, app_hash=h.app_hash, proposer=h.proposer,
                txs=honest.txs)
            conflict = sign_proposal(self.identity, chain, Proposal(
                message.height, message.round, encode_block(block), message.pol_round,
                self.identity.peer_id))
        self.sent += 1
        return conflict


class ConsensusService:
    """One validator on one host (see the module docstring).

    Args:
        host: a running py-libp2p host whose identity is ``identity``.
        identity: the validator's Ed25519 identity (signs proposals and votes).
        genesis: the chain (validators, chain ID, policy, limits).
        store: the validator's store (WAL, blocks); the caller opens and closes it.
        consensus: the core's timeouts.
        config: :class:`ConsensusServiceConfig`.
        mempool: default ``Mempool()``.
        on_commit: called (synchronously, in the driver task) with each :class:`Committed`.
        clock: trio's clock (seconds). unix_ms: wall clock (unix ms) for block times.
        value_check: the validator's own check of an EPOCH_REPORT
            (:attr:`~ps_p2p.registry.validator.Validator.value_check`).

    Attributes:
        validator: the :class:`~ps_p2p.registry.validator.Validator`.
        refused: inbound frames refused or dropped, by reason.
        fatal: the StoreError that stopped the service, if any.

    Raises:
        ConfigError: ``identity`` is not the host's, or not a validator of ``genesis``.
    """

    def __init__(
        self,
        host: IHost,
        identity: Signer,
        genesis: Genesis,
        store: ConsensusStore,
        consensus: ConsensusConfig | None = None,
        config: ConsensusServiceConfig | None = None,
        *,
        mempool: Mempool | None = None,
        on_commit: Callable[[Committed], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
        unix_ms: Callable[[], int] = unix_ms,
        value_check: Callable[[bytes], str | None] | None = None,
    ) -> None:
        if identity.peer_id != host.get_id().to_bytes():
            raise ConfigError("the validator identity is not the host's identity")
        self.host = host
        self.config = config or ConsensusServiceConfig()
        try:
            self.validator = Validator(
                identity, genesis, store, WIRE, consensus, mempool=mempool,
                empty_block_interval=self.config.empty_block_interval, unix_ms=unix_ms,
                value_check=value_check, snapshot_every=self.config.snapshot_every,
                keep_blocks=self.config.keep_blocks, snapshot_writer=self._write_snapshot,
                joining=self.config.joining,
            )
        except PsError as exc:
            raise ConfigError(str(exc)) from exc
        core = self.validator.config
        self.rebroadcast_interval = self.config.rebroadcast_interval or core.timeout_prevote
        self.sync_after = self.config.sync_after or (
            core.timeout_propose + core.timeout_prevote + core.timeout_precommit)
        self.address = identity.peer_id
        v = self.validator
        #: the gossip policy the simulator runs too (gossip="service"); ``gossip`` its Gossip
        self.policy = ServiceGossip(
            self.address, self.peers, lambda: v.core, self.rebroadcast_interval,
            relay_after=self.config.relay_after or 2 * self.rebroadcast_interval,
            own=v.own_messages, commit=lambda: v.last_commit)
        self.gossip = self.policy.gossip
        self.on_commit = on_commit
        self._clock = clock
        self.driver: CoreDriver[Action] = CoreDriver(
            "consensus", execute=self._execute, tick=self._tick,
            next_deadline=self._next_deadline, clock=clock,
        )
        self.blocksync = BlockSyncServer(store, allow=self._may_sync, clock=clock)
        self.refused: collections.Counter[str] = collections.Counter()
        self.fatal: StoreError | None = None
        #: state snapshots encoded in a worker thread and written
        self.snapshots_written = 0
        #: own messages waiting for the WAL's fsync (a worker thread), and its counters
        self._held: list[SendMessage] = []
        self._flushing = False
        self.fsyncs = 0
        self.fsync_seconds = 0.0
        if self.config.deferred_sync:
            store.deferred_sync = store.path != ":memory:"
        self._links: LinkManager | None = None
        self._inflight: collections.Counter[bytes] = collections.Counter()
        self._verified: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._next_rebroadcast = 0.0
        self._ahead: tuple[int, float, bytes] | None = None  # (our height, since, peer)
        self._sync_send, self._sync_receive = trio.open_memory_channel[bytes](16)
        self._last_sync: dict[bytes, float] = {}
        self._committed = trio.Event()
        self._cancel: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self.byzantine: ByzantineSender | None = None
        if self.config.byzantine:
            self.byzantine = ByzantineSender(identity, genesis, self.peers)

    @property
    def peers(self) -> tuple[bytes, ...]:
        """The validators to send to: the committed set's, plus the members of a pending
        VALSET_UPDATE (so a joining validator hears the height it starts deciding); none
        while this validator is not in the committed set (a joining or removed one: the
        members would refuse its messages)."""
        state = self.validator.state
        if not state.is_validator(self.address):
            return ()
        members = [v.address for v in state.validators]
        if state.pending_valset is not None:
            members += [v.address for v in state.pending_valset[1]]
        return tuple(dict.fromkeys(a for a in members if a != self.address))

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Restore the validator from its store, serve the consensus and block-sync protocols
        and take part in consensus until cancelled (or a StoreError: then :attr:`fatal`).

        Raises:
            ConfigError: the host already serves one of the protocols.
            StoreError: the store cannot be read at start.
        """
        handlers = StreamHandlers(self.host)
        sync_handlers: StreamHandlers | None = None
        if self.byzantine is not None:
            log.warning("!!! TEST ONLY: validator %s is BYZANTINE: it equivocates (conflicting "
                        "proposals and votes to %d of %d peers) !!!", peer_label(self.address),
                        len(self.byzantine.targets), len(self.peers))
        try:
            with trio.CancelScope() as self._cancel:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._links = LinkManager(
                        self.host, nursery, CONSENSUS_PROTOCOL_ID,
                        queue_frames=self.config.queue_frames,
                        backoff_max=VALIDATOR_REDIAL_MAX, persistent=True,
                        on_link_down=lambda peer, _reason: self.gossip.link_down(peer),
                    )
                    await nursery.start(self.driver.run)
                    now = self._clock()
                    self._next_rebroadcast = now + self.rebroadcast_interval
                    self.driver.run_commands(self.validator.start(now))
                    self.driver.wake()
                    handlers.add(CONSENSUS_PROTOCOL_ID, make_frame_handler(
                        CONSENSUS_PROTOCOL_ID, MAX_FRAME_BYTES, self._on_frame))
                    sync_handlers = self.blocksync.register_handlers(self.host)
                    nursery.start_soon(self._sync_loop)
                    for peer in self.peers:  # a restarted validator may be behind
                        if is_connected(self.host, peer):
                            self._request_sync(peer)
                    task_status.started()
                    try:
                        await trio.sleep_forever()
                    finally:
                        self._links.close_all()
        finally:
            await handlers.aclose()
            if sync_handlers is not None:
                await sync_handlers.aclose()

    # ------------------------------------------------------------------ local API

    def submit_tx(self, tx: bytes) -> bool:
        """Queue a registry transaction from this node (checked at once, then relayed).

        Returns:
            True when new; False when already pending.

        Raises:
            InvalidTransactionError, AdmissionError: refused (see
                :func:`~ps_p2p.registry.check_tx`); nothing is relayed.
        """
        actions = self.validator.add_tx(tx, self._clock())
        self.driver.run_commands(actions)
        self.driver.wake()
        return bool(actions)

    def revalidate(self) -> None:
        """The validator's value check may have finished: answer the validations it deferred
        (:meth:`~ps_p2p.registry.validator.Validator.revalidate`)."""
        actions = self.validator.revalidate(self._clock())
        if actions:
            self.driver.run_commands(actions)
            self.driver.wake()

    async def wait_committed(self, height: int) -> None:
        """Wait until block ``height`` is committed here (wrap it in a deadline)."""
        while self.validator.committed_height < height:
            await self._committed.wait()

    def link_stats(self):  # type: ignore[no-untyped-def]
        """Counters of the outbound links (None before :meth:`run`)."""
        return None if self._links is None else self._links.stats

    # ------------------------------------------------------------------ inbound

    def _refuse(self, reason: str, peer: bytes, detail: object = "") -> None:
        self.refused[reason] += 1
        if self.refused[reason] in (1, 10, 100, 1000) or self.refused[reason] % 10_000 == 0:
            log.warning("consensus: %s from %s (%d so far) %s", reason, peer_label(peer),
                        self.refused[reason], detail)

    def _on_frame(self, peer: bytes, data: bytes) -> None:
        """One inbound frame (handler task); raises RemoteProtocolError to reset the stream."""
        v = self.validator
        if not v.is_validator(peer):
            self._refuse("peer not a validator", peer)
            raise RemoteProtocolError("the consensus protocol is for validators only")
        if self._inflight[peer] >= self.config.max_inflight_per_peer:
            self._refuse("peer inbox full", peer)
            return
        try:
            message = cc.decode_message(data)
        except RemoteProtocolError as exc:
            self._refuse("malformed", peer, exc)
            raise
        if isinstance(message, cc.Tx):
            self._submit(peer, functools.partial(self._apply_tx, peer, message.tx))
            return
        signer = message.proposer if isinstance(message, Proposal) else message.validator
        if not v.is_validator(signer):
            self._refuse("signer not a validator", peer)
            raise RemoteProtocolError(f"a message signed by {peer_label(signer)}, no validator")
        if message.height < v.height - 1:
            self.refused["stale height"] += 1
            return
        if message.height < v.height:  # the peer is one height behind: where it is (gossip)
            self.gossip.heard(peer, message, self._clock())
            self.refused["stale height"] += 1
            return
        if message.height > v.height + 1 and not self._sync_due(peer):
            self.refused["future height"] += 1  # a sync from this peer runs or just ran
            return
        if message.height <= v.height + 1 and v.ignores(message):
            self.gossip.heard(peer, message, self._clock())  # it has it (unchecked: its loss)
            self.refused["ignored"] += 1  # would change nothing: no signature check
            return
        self._check_signature(peer, data, message)
        # it has it; a prevote against a re-proposal whose certificate we hold: send it again
        self._send_planned(self.policy.on_receive(message, peer, self._clock()))
        if message.height > v.height + 1:
            self._refuse("future height", peer, f"(height {message.height}, ours {v.height})")
            self._request_sync(peer)
            return
        if message.height == v.height + 1 and self._ahead is None:
            self._ahead = (v.height, self._clock(), peer)
        self._submit(peer, functools.partial(self._apply_message, peer, message))

    def _check_signature(self, peer: bytes, data: bytes, message: Proposal | Vote) -> None:
        key = hashlib.sha256(data).digest()
        if key in self._verified:
            self._verified.move_to_end(key)
            return
        try:
            if isinstance(message, Proposal):
                verify_proposal(self.validator.genesis.chain_id, message)
            else:
                verify_vote(self.validator.genesis.chain_id, message)
        except InvalidSignatureError as exc:
            self._refuse("bad signature", peer, exc)
            raise
        except RemoteProtocolError as exc:
            self._refuse("malformed", peer, exc)
            raise
        self._verified[key] = None
        if len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)

    def _submit(self, peer: bytes, event: Callable[[float], Iterable[Action]]) -> None:
        if self.driver.submit(event):
            self._inflight[peer] += 1
        else:
            self.refused["inbox full"] += 1

    def _apply_message(self, peer: bytes, message: Proposal | Vote, now: float) -> list[Action]:
        self._done(peer)
        return self._guard(self.validator.receive, message, now)

    def _apply_tx(self, peer: bytes, tx: bytes, now: float) -> list[Action]:
        self._done(peer)
        try:
            return self._guard(self.validator.add_tx, tx, now, peer)
        except RemoteProtocolError as exc:  # InvalidTransactionError, AdmissionError
            self.refused["transaction refused"] += 1
            log.debug("transaction from %s refused: %s", peer_label(peer), exc)
            return []

    def _done(self, peer: bytes) -> None:
        self._inflight[peer] -= 1
        if self._inflight[peer] <= 0:
            del self._inflight[peer]

    def _guard(self, call: Callable[..., list[Action]], *args: object) -> list[Action]:
        try:
            return call(*args)
        except StoreError as exc:
            self._stop(exc)
            return []

    def _stop(self, exc: StoreError) -> None:
        log.critical("consensus store failed, validator stops: %s", exc)
        self.fatal = exc
        if self._cancel is not None:
            self._cancel.cancel()

    # ------------------------------------------------------------------ outputs and timers

    def _execute(self, action: Action) -> None:
        assert self._links is not None
        if isinstance(action, SendMessage):
            if self.validator.store.needs_sync or self._flushing:
                self._hold(action)
            else:
                self._send_own(action)
        elif isinstance(action, RelayTx):
            data = cc.encode_message(cc.Tx(action.tx))
            for peer in self.peers:
                if peer != action.exclude:
                    self._links.send(peer, data)
        elif isinstance(action, Committed):
            self.gossip.new_height(self.validator.height)
            self._ahead = None
            self._committed.set()
            self._committed = trio.Event()
            if self.on_commit is not None:
                self.on_commit(action)

    def _hold(self, action: SendMessage) -> None:
        """Keep an own message until the fsync of the WAL writes before it returned (the store
        commits them without one: ``deferred_sync``); starts the flush task if none runs."""
        if self._nursery is None:  # not running: fsync here
            self.validator.store.sync_target()()
            self._send_own(action)
            return
        self._held.append(action)
        if not self._flushing:
            self._flushing = True
            self._nursery.start_soon(self._flush_held)

    async def _flush_held(self) -> None:
        """Group commit (issue 17): fsync the WAL in a worker thread, off the event loop, then
        send every message held before that fsync started, in order; again while more came
        in. A signed message therefore still leaves only once it is durable (a message held
        behind one that waits is held too, so the order is kept)."""
        store = self.validator.store
        try:
            while self._held:
                batch, self._held = self._held, []
                if store.needs_sync:
                    fsync = store.sync_target()  # covers every write committed so far
                    start = trio.current_time()
                    await trio.to_thread.run_sync(fsync)
                    self.fsync_seconds += trio.current_time() - start
                    self.fsyncs += 1
                for action in batch:
                    self._send_own(action)
        except (OSError, StoreError) as exc:
            self._held = []
            self._stop(exc if isinstance(exc, StoreError)
                       else StoreError(f"consensus store fsync failed: {exc}"))
        finally:
            self._flushing = False

    def _send_own(self, action: SendMessage) -> None:
        """Send an own message (durable by now) to every peer that lacks it; a proposal with a
        POL round goes with its POL certificate (L28 at the receiver needs it)."""
        assert self._links is not None
        message = action.message
        data = cc.encode_message(message)
        self.gossip.set_peers(self.peers)
        targets = [peer for peer in self.peers if self.gossip.lacks(peer, message)]
        certificate = self.policy.on_send(message)  # marks ``targets`` sent
        for peer in targets:
            self._send(peer, message, data)
        self._send_planned(certificate)
        if self.byzantine is not None:  # TEST ONLY: equivocate, bypassing the WAL
            conflict = self.byzantine.conflicting(action.message)
            if conflict is not None:
                data = cc.encode_message(conflict)
                for peer in self.byzantine.targets:
                    self._links.send(peer, data)

    def _send(self, peer: bytes, message: Proposal | Vote, data: bytes) -> None:
        assert self._links is not None
        self.gossip.sent(peer, message)
        if not self._links.send(peer, data):
            self.gossip.unsent(peer, message)

    def _gossip(self, now: float) -> None:
        """Send each peer what it lacks (:meth:`~ps_p2p.consensus.gossip.Gossip.plan`)."""
        v = self.validator
        core = v.core
        if core.height is None:
            return
        self.gossip.set_peers(self.peers)
        self._send_planned(self.policy.plan(now, core.height, core.round))

    def _send_planned(self, plan: list[tuple[bytes | None, Proposal | Vote]]) -> None:
        """Send (peer, message) pairs of the gossip policy, each message encoded once."""
        encoded: dict[Proposal | Vote, bytes] = {}
        for peer, message in plan:
            if peer is None:
                continue  # ServiceGossip names every peer
            data = encoded.get(message)
            if data is None:
                data = encoded[message] = cc.encode_message(message)
            self._send(peer, message, data)

    def _next_deadline(self) -> float:
        deadline = self.validator.next_deadline()
        at = self._next_rebroadcast
        if self._ahead is not None:
            at = min(at, self._ahead[1] + self.sync_after)
        return at if deadline is None else min(at, deadline)

    def _tick(self, now: float) -> list[Action]:
        actions = self._guard(self.validator.tick, now)
        if now >= self._next_rebroadcast:
            self._next_rebroadcast = now + self.rebroadcast_interval
            self._gossip(now)
        ahead = self._ahead
        if ahead is not None:
            if ahead[0] != self.validator.height:
                self._ahead = None
            elif now >= ahead[1] + self.sync_after:
                self._ahead = None
                self._request_sync(ahead[2])
        return actions

    # ------------------------------------------------------------------ state snapshots

    def _write_snapshot(self, state: AppState) -> None:
        """The validator's ``snapshot_writer``: encode ``state`` (immutable once committed) in
        a worker thread, O(records), so a large registry's snapshot does not stall the event
        loop for a round's timeout; then write it on the loop (the sqlite connection's
        thread). A snapshot lost to a stop is simply not there (the previous one is)."""
        if self._nursery is None:
            self.validator.keep_snapshot(state.height, state.app_hash, encode_state(state))
            return
        self._nursery.start_soon(self._encode_and_keep, state)

    async def _encode_and_keep(self, state: AppState) -> None:
        data = await trio.to_thread.run_sync(encode_state, state)
        self._guard(self.validator.keep_snapshot, state.height, state.app_hash, data)
        self.snapshots_written += 1

    # ------------------------------------------------------------------ block sync

    def _may_sync(self, peer: bytes) -> bool:
        """Block sync is served to the validators and the nodes listed in the registry."""
        v = self.validator
        return v.is_validator(peer) or peer in v.state.records

    def _request_sync(self, peer: bytes) -> None:
        try:
            self._sync_send.send_nowait(peer)
        except trio.WouldBlock:
            pass  # a sync is due anyway

    def _sync_due(self, peer: bytes) -> bool:
        """Whether a block sync from ``peer`` would start now (none within
        ``min_sync_interval``)."""
        return self._clock() >= self._last_sync.get(peer, -1e18) + self.config.min_sync_interval

    async def _sync_loop(self) -> None:
        async with self._sync_receive:
            async for peer in self._sync_receive:
                if not self._sync_due(peer):
                    continue
                now = self._clock()
                self._last_sync[peer] = now
                await self._sync_from(peer)

    async def _sync_from(self, peer: bytes) -> None:
        v = self.validator
        while True:
            start = v.committed_height + 1
            try:
                blocks, latest = await fetch_blocks(
                    self.host, peer, start, chain_id=v.genesis.chain_id,
                    validators=v.validators, previous_block_id=v.state.block_id,
                    limits=v.genesis.limits, timeout=self.config.sync_timeout,
                )
            except RemoteProtocolError as exc:
                self._refuse("bad block sync answer", peer, exc)
                return
            except trio.Cancelled:
                raise
            except Exception as exc:  # dial, stream or deadline: try another time
                log.info("block sync from %s failed: %r", peer_label(peer), exc)
                return
            if not blocks:
                return
            try:
                actions = self._guard(
                    v.apply_synced, [(b.height, b.block, b.commit) for b in blocks], self._clock())
            except RemoteProtocolError as exc:
                self._refuse("bad synced block", peer, exc)
                return
            self.driver.run_commands(actions)
            self.driver.wake()
            log.info("synced blocks %d-%d from %s", blocks[0].height, blocks[-1].height,
                     peer_label(peer))
            if blocks[-1].height >= latest or self.fatal is not None:
                return


__all__ = [
    "CONSENSUS_PROTOCOL_ID",
    "MAX_FRAME_BYTES",
    "WIRE",
    "ByzantineSender",
    "ConsensusService",
    "ConsensusServiceConfig",
]
