"""``/planetserve/blocksync/1.0.0``: committed blocks with their commits, for a validator or node
that fell behind (service layer; DESIGN.md "Verifier committee": block sync).

One stream, any number of request/response pairs: the client writes a ``BlockSyncRequest``
(from height, blocks wanted) as one frame and reads one ``BlockSyncResponse`` frame: consecutive
blocks from that height (at most :data:`~ps_p2p.protocols.consensus_codec.MAX_SYNC_BLOCKS`, and
as many as fit :data:`MAX_RESPONSE_BYTES`; always at least one when the server has it) and the
server's latest committed height. The server only reads its :class:`ConsensusStore`.

Who is served (issue 16: an outsider's flood of block-sync requests slowed the committee's
commits): only peers that ``allow`` admits (the consensus service: the validators and the nodes
listed in the committed registry); any other peer's stream is reset before its first request is
read. Each peer's answers are charged (bytes) to a token bucket (:data:`PEER_SYNC_RATE`,
:data:`PEER_SYNC_BURST`) and all peers' to one more (:data:`TOTAL_SYNC_RATE`,
:data:`TOTAL_SYNC_BURST`), by peer ID (:class:`~ps_p2p.rate_limits.PeerBudgets`); a request
over either is refused by resetting the stream (the protocol has no error frame; the client
retries later or asks another validator), and a stream serves at most
:data:`MAX_REQUESTS_PER_STREAM` requests.

The client (:func:`fetch_blocks`) trusts nothing it receives: each block's commit must be a
quorum certificate (more than 2/3 of the voting power of the validator set from the genesis
file, :func:`ps_p2p.consensus.signing.verify_commit`) for that height and that block's ID, and
the blocks must chain (each header names the previous block's ID); only then are they returned
for the application to execute. A server that sends anything else is a
:class:`~ps_p2p.errors.RemoteProtocolError` (and the stream is reset).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamError

from ps_p2p.consensus.block import BlockLimits, block_id, decode_block
from ps_p2p.consensus.signing import verify_commit
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import ConsensusError, InvalidCommitError, RemoteProtocolError
from ps_p2p.protocols import consensus_codec as cc
from ps_p2p.protocols.framing import encode_frame, read_frame
from ps_p2p.protocols.handlers import StreamHandlers, exchange, reset_quietly
from ps_p2p.rate_limits import PeerBudgets
from ps_p2p.records.peer_ids import peer_label

log = logging.getLogger(__name__)

BLOCKSYNC_PROTOCOL_ID = TProtocol("/planetserve/blocksync/1.0.0")
#: Largest request frame.
MAX_REQUEST_BYTES = 64
#: Largest response frame: a few blocks of the default 1 MiB limit.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024
#: Requests served on one stream before the server closes it.
MAX_REQUESTS_PER_STREAM = 1024
#: Bytes a second of answers one peer is given, and the most it saves up (a validator that
#: restarts far behind fetches two full answers at once, then 4 MiB a second: 64 empty blocks
#: are ~100 KiB).
PEER_SYNC_RATE = 4 * 1024 * 1024
PEER_SYNC_BURST = 2 * MAX_RESPONSE_BYTES
#: Bytes a second of answers to all peers together, and the most saved up.
TOTAL_SYNC_RATE = 16 * 1024 * 1024
TOTAL_SYNC_BURST = 4 * MAX_RESPONSE_BYTES


@dataclass(frozen=True)
class VerifiedBlock:
    """A block whose commit verified: its height, encoded block, and commit votes."""

    height: int
    block: bytes
    commit: tuple


class BlockSyncServer:
    """Serves committed blocks from ``store`` (see the module docstring).

    Args:
        store: the validator's store (read only).
        max_response_bytes: bound of one answer frame.
        allow: ``allow(peer_id) -> bool``, whether a peer is served (None: everyone).
        budgets: the answer rates (default the ``*_SYNC_*`` bounds).
        clock: seconds, monotonic (trio's by default), for ``budgets``.

    Attributes:
        served: requests answered; refused: streams reset for bad input; not_allowed: streams
            of peers ``allow`` refused; rate_limited: requests refused for their rate.
    """

    def __init__(self, store: ConsensusStore, *, max_response_bytes: int = MAX_RESPONSE_BYTES,
                 allow: Callable[[bytes], bool] | None = None,
                 budgets: PeerBudgets | None = None,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.store = store
        self.max_response_bytes = max_response_bytes
        self.allow = allow
        self.budgets = budgets if budgets is not None else PeerBudgets(
            rate=PEER_SYNC_RATE, burst=PEER_SYNC_BURST, total_rate=TOTAL_SYNC_RATE,
            total_burst=TOTAL_SYNC_BURST, max_inflight_per_peer=2, max_inflight=16)
        self._clock = clock
        self.served = 0
        self.refused = 0
        self.not_allowed = 0
        self.rate_limited = 0

    def response(self, from_height: int, max_blocks: int) -> bytes:
        """The response frame body for a request (pure apart from reading the store)."""
        latest = self.store.latest_height()
        blocks: list[cc.SyncedBlock] = []
        size = 64
        if from_height > latest:  # nothing to send (and u64 heights beyond SQLite's int64)
            return cc.encode_sync_response(blocks, latest)
        if from_height < self.store.first_height():  # pruned here: another peer may serve it
            return cc.encode_sync_response(blocks, latest)
        for height, block, commit in self.store.blocks_from(from_height, max_blocks):
            item = cc.SyncedBlock(height, block, cc.decode_commit(commit))
            item_size = len(block) + len(commit) + 32
            if blocks and size + item_size > self.max_response_bytes:
                break
            blocks.append(item)
            size += item_size
        return cc.encode_sync_response(blocks, latest)

    def register_handlers(self, host: IHost) -> StreamHandlers:
        """Serve :data:`BLOCKSYNC_PROTOCOL_ID` on ``host`` until the handlers are closed.

        Raises:
            ConfigError: the host already serves it.
        """
        handlers = StreamHandlers(host)
        handlers.add(BLOCKSYNC_PROTOCOL_ID, self._handle_stream)
        return handlers

    def _count(self, attribute: str, peer: bytes, reason: str) -> None:
        count = getattr(self, attribute) + 1
        setattr(self, attribute, count)
        if count in (1, 10, 100, 1000) or count % 10_000 == 0:
            log.warning("block sync from %s refused: %s (%d so far)", peer_label(peer), reason,
                        count)

    async def _handle_stream(self, stream: INetStream) -> None:
        # guarded: an exception escaping a handler kills the py-libp2p host
        peer = stream.muxed_conn.peer_id.to_bytes()
        try:
            if self.allow is not None and not self.allow(peer):
                self._count("not_allowed", peer, "neither a validator nor a listed node")
                await reset_quietly(stream)
                return
            for _ in range(MAX_REQUESTS_PER_STREAM):
                try:
                    frame = await read_frame(stream, MAX_REQUEST_BYTES)
                except StreamEOF:
                    break
                from_height, max_blocks = cc.decode_sync_request(frame)
                reason = self.budgets.admit(peer, self._clock())
                if reason is not None:
                    self._count("rate_limited", peer, reason)
                    await reset_quietly(stream)
                    return
                try:
                    answer = encode_frame(self.response(from_height, max_blocks))
                    self.budgets.charge(peer, len(answer), self._clock())
                    await stream.write(answer)
                finally:
                    self.budgets.release(peer)
                self.served += 1
            await stream.close()
        except RemoteProtocolError as exc:
            self.refused += 1
            log.warning("block sync stream from %s reset: %s", peer_label(peer), exc)
            await reset_quietly(stream)
        except StreamError as exc:
            log.info("block sync stream failed: %r", exc)
            await reset_quietly(stream)
        except Exception:
            log.exception("block sync stream: unexpected error")
            await reset_quietly(stream)


def verify_synced(
    blocks: Sequence[cc.SyncedBlock],
    *,
    chain_id: str,
    validators: Sequence[Validator],
    previous_block_id: bytes | None,
    limits: BlockLimits,
) -> list[VerifiedBlock]:
    """Check synced blocks: each decodes within ``limits``, names the previous block's ID
    (``previous_block_id`` for the first; None skips that check for it), and carries a
    commit for its own height and ID by more than 2/3 of ``validators``' power.

    ``validators`` is the set of the first block's height; a VALSET_UPDATE executed by a block
    of the batch changes the set after it, so a later commit that does not verify ends the
    batch there (the verified blocks are returned; the caller executes them and asks again
    from the next height with the new set, :meth:`~ps_p2p.registry.validator.Validator.
    apply_synced` checking every commit against the set of its height).

    Raises:
        RemoteProtocolError (a ConsensusError for a bad block or commit): the first block that
            fails, by height (a commit only when it is the first block's).
    """
    out: list[VerifiedBlock] = []
    previous = previous_block_id
    for item in blocks:
        block = decode_block(item.block, limits)
        header = block.header
        if header.height != item.height:
            raise ConsensusError(f"block sent as height {item.height} says {header.height}")
        if previous is not None and header.prev_block_id != previous:
            raise ConsensusError(f"block {item.height} does not follow the block before it")
        this_id = block_id(header)
        try:
            verify_commit(chain_id, validators, item.height, this_id, item.commit)
        except InvalidCommitError:
            if out:  # the set may change after a block of the batch (a VALSET_UPDATE): the
                break  # verified blocks first; the rest is asked again with the set after them
            raise
        out.append(VerifiedBlock(item.height, item.block, item.commit))
        previous = this_id
    return out


async def fetch_blocks(
    host: IHost,
    peer: bytes,
    from_height: int,
    *,
    chain_id: str,
    validators: Sequence[Validator],
    previous_block_id: bytes | None,
    limits: BlockLimits | None = None,
    max_blocks: int = cc.MAX_SYNC_BLOCKS,
    timeout: float = 10.0,
) -> tuple[list[VerifiedBlock], int]:
    """Fetch and verify blocks from ``from_height`` on from ``peer`` (one request).

    Returns:
        (verified blocks in height order, the peer's latest height): ask again from the next
        height while it is behind the peer's.

    Raises:
        RemoteProtocolError: the peer sent a malformed response or a block or commit that
            does not verify (see :func:`verify_synced`).
        trio.TooSlowError: no answer within ``timeout`` seconds.
        StreamError, SwarmException: the stream could not be opened or failed.
    """
    limits = limits or BlockLimits()

    async def body(stream: INetStream) -> tuple[list[VerifiedBlock], int]:
        with trio.fail_after(timeout):
            await stream.write(encode_frame(cc.encode_sync_request(from_height, max_blocks)))
            data = await read_frame(stream, MAX_RESPONSE_BYTES)
        blocks, latest = cc.decode_sync_response(data)
        if blocks and blocks[0].height != from_height:
            raise RemoteProtocolError(
                f"asked blocks from {from_height}, got from {blocks[0].height}"
            )
        verified = verify_synced(
            blocks, chain_id=chain_id, validators=validators,
            previous_block_id=previous_block_id, limits=limits,
        )
        return verified, latest

    return await exchange(host, peer, BLOCKSYNC_PROTOCOL_ID, body, timeout=timeout)


__all__ = [
    "BLOCKSYNC_PROTOCOL_ID", "BlockSyncServer", "VerifiedBlock", "fetch_blocks", "verify_synced",
]
