"""Blocks of the registry chain: header, transactions, canonical encoding, ID, validation; pure.

A block is the value the committee agrees on at one height (Algorithm 1 of Buchman, Kwon,
Milosevic; PlanetServe sec. 3.4). Its header links it to the chain and to the application state
*before* it (as in Tendermint: the app hash of height h is carried by block h+1)::

    header   = b"planetserve/v1/block-header\\x00" || str(chain_id) || u64(height)
               || u64(time_ms) || bytes(prev_block_id) || bytes(app_hash) || bytes(proposer)
               || u32(#txs) || bytes(txs_hash)
    txs_hash = SHA-256(b"planetserve/v1/block-txs\\x00" || u32(#txs) || bytes(tx)*)
    block ID = SHA-256(header)                                           (32 bytes)
    block    = b"planetserve/v1/block\\x00" || bytes(header) || u32(#txs) || bytes(tx)*

(``bytes(b) = u32(len(b)) || b``, integers big-endian, as in :mod:`ps_p2p.records.canonical`).
``time_ms`` is the proposer's clock (unix ms); ``prev_block_id`` and ``app_hash`` are 32 bytes
(the genesis app hash and 32 zero bytes at height 1); ``proposer`` is an Ed25519 peer ID. The
encoding is the hashing form too: no protobuf is hashed.

The block ID is the hash of the header alone, which commits to the transactions through
``txs_hash``: a node checks a commit (2f+1 precommits of the block ID) from the header alone,
without the transactions (:mod:`ps_p2p.registry.directory`). The consensus core identifies
values by ``types.value_id`` (SHA-256 of the whole value); for this application the driver maps
an encoded block to its ID with :func:`value_block_id`, so votes and commits carry the block ID.

Bounds (:class:`BlockLimits`, committed in the genesis): bytes of the encoded block, transaction
count, bytes of one transaction.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ps_p2p.consensus.encoding import Reader, lp, lps, u32, u64
from ps_p2p.consensus.signing import MAX_CHAIN_ID_BYTES, VALUE_ID_BYTES
from ps_p2p.errors import InvalidBlockError, LocalProtocolError, RemoteProtocolError
from ps_p2p.records.limits import SECOND_MS, UINT64_BOUND
from ps_p2p.records.peer_ids import ED25519_PEER_ID_BYTES, public_key_from_peer_id

HEADER_DOMAIN = b"planetserve/v1/block-header\x00"
TXS_DOMAIN = b"planetserve/v1/block-txs\x00"
BLOCK_DOMAIN = b"planetserve/v1/block\x00"
#: The previous block ID of height 1.
ZERO_ID = bytes(32)
#: Default bound of the proposer's clock ahead of (or, for a fresh proposal, behind) a
#: validator's own clock.
MAX_CLOCK_DRIFT_MS = 10 * SECOND_MS
#: Longest encoded header (chain ID 64, 3 IDs, a peer ID, integers).
MAX_HEADER_BYTES = 512


@dataclass(frozen=True)
class BlockLimits:
    """Committed bounds of a block (every node of the chain uses the same).

    Attributes:
        max_block_bytes: encoded block (:func:`encode_block`), default 1 MiB.
        max_txs: transactions in one block, default 1000.
        max_tx_bytes: one encoded transaction, default 8 KiB (a register is ~0.8 KiB, an
            evidence ~0.5 KiB).
    """

    max_block_bytes: int = 1024 * 1024
    max_txs: int = 1000
    max_tx_bytes: int = 8 * 1024

    def __post_init__(self) -> None:
        if not 1024 <= self.max_block_bytes < 2**31:
            raise LocalProtocolError("max_block_bytes must be in [1 KiB, 2 GiB)")
        if not 1 <= self.max_txs < 2**31 or not 1 <= self.max_tx_bytes <= self.max_block_bytes:
            raise LocalProtocolError("max_txs >= 1 and 1 <= max_tx_bytes <= max_block_bytes")


@dataclass(frozen=True)
class Header:
    """A block header (module docstring). ``txs_hash`` must be :func:`txs_hash` of the block's
    transactions and ``tx_count`` their number; :func:`make_block` fills both."""

    chain_id: str
    height: int
    time_ms: int
    prev_block_id: bytes
    app_hash: bytes
    proposer: bytes
    tx_count: int
    txs_hash: bytes


@dataclass(frozen=True)
class Block:
    """A header and the encoded transactions it commits to (in execution order)."""

    header: Header
    txs: tuple[bytes, ...] = field(default=())


def txs_hash(txs: Sequence[bytes]) -> bytes:
    """SHA-256 over the transactions (module docstring), 32 bytes; O(bytes)."""
    h = hashlib.sha256(TXS_DOMAIN + u32(len(txs)))
    for tx in txs:
        h.update(lp(bytes(tx)))
    return h.digest()


def header_bytes(header: Header) -> bytes:
    """The canonical header (module docstring).

    Raises:
        LocalProtocolError: a field out of its range (a bug of whoever built the header; a
            decoded header is always in range).
    """
    try:
        if not isinstance(header.chain_id, str) or not header.chain_id:
            raise ValueError("empty chain ID")
        chain = lps(header.chain_id)
        if len(chain) - 4 > MAX_CHAIN_ID_BYTES:
            raise ValueError("chain ID too long")
        for name in ("prev_block_id", "app_hash", "txs_hash"):
            if len(getattr(header, name)) != VALUE_ID_BYTES:
                raise ValueError(f"{name} is not 32 bytes")
        if len(header.proposer) != ED25519_PEER_ID_BYTES:
            raise ValueError("proposer is not an Ed25519 peer ID")
        return b"".join((
            HEADER_DOMAIN, chain, u64(header.height), u64(header.time_ms),
            lp(bytes(header.prev_block_id)), lp(bytes(header.app_hash)),
            lp(bytes(header.proposer)), u32(header.tx_count), lp(bytes(header.txs_hash)),
        ))
    except (struct.error, ValueError, TypeError, OverflowError) as exc:
        raise LocalProtocolError(f"block header field out of range: {exc}") from exc


def block_id(header: Header) -> bytes:
    """The block ID: SHA-256 of :func:`header_bytes` (32 bytes)."""
    return hashlib.sha256(header_bytes(header)).digest()


def make_block(
    *, chain_id: str, height: int, time_ms: int, prev_block_id: bytes, app_hash: bytes,
    proposer: bytes, txs: Sequence[bytes] = (),
) -> Block:
    """A block over ``txs`` with ``tx_count`` and ``txs_hash`` filled in."""
    txs = tuple(bytes(t) for t in txs)
    header = Header(chain_id, height, time_ms, prev_block_id, app_hash, proposer, len(txs),
                    txs_hash(txs))
    return Block(header, txs)


def encode_block(block: Block) -> bytes:
    """The canonical encoding (the consensus value of a height); see the module docstring.

    Raises:
        LocalProtocolError: a header field out of range.
    """
    parts = [BLOCK_DOMAIN, lp(header_bytes(block.header)), u32(len(block.txs))]
    parts.extend(lp(bytes(tx)) for tx in block.txs)
    return b"".join(parts)


def decode_header(data: bytes) -> Header:
    """Parse :func:`header_bytes` strictly (the inverse; trailing bytes refused).

    Raises:
        InvalidBlockError: malformed, over :data:`MAX_HEADER_BYTES`, or a field out of range.
    """
    if len(data) > MAX_HEADER_BYTES:
        raise InvalidBlockError(f"block header of {len(data)} bytes (max {MAX_HEADER_BYTES})")
    r = Reader(data, InvalidBlockError, "block header")
    r.prefix(HEADER_DOMAIN, "header domain")
    chain_id = r.lps("chain ID", MAX_CHAIN_ID_BYTES)
    height = r.u64("height")
    time_ms = r.u64("time")
    prev = r.lp("previous block ID", VALUE_ID_BYTES, exact=VALUE_ID_BYTES)
    app_hash = r.lp("app hash", VALUE_ID_BYTES, exact=VALUE_ID_BYTES)
    proposer = r.lp("proposer", ED25519_PEER_ID_BYTES, exact=ED25519_PEER_ID_BYTES)
    tx_count = r.u32("transaction count")
    t_hash = r.lp("transactions hash", VALUE_ID_BYTES, exact=VALUE_ID_BYTES)
    r.done()
    if not chain_id:
        raise InvalidBlockError("block header has an empty chain ID")
    try:
        public_key_from_peer_id(proposer)
    except RemoteProtocolError:
        raise InvalidBlockError("block proposer is not an Ed25519 peer ID") from None
    return Header(chain_id, height, time_ms, prev, app_hash, proposer, tx_count, t_hash)


def decode_block(data: bytes, limits: BlockLimits) -> Block:
    """Parse :func:`encode_block` strictly, within ``limits``.

    Raises:
        InvalidBlockError: over ``limits.max_block_bytes``, more than ``limits.max_txs``
            transactions or one over ``limits.max_tx_bytes``, a count or hash that disagrees
            with the transactions, or malformed.
    """
    if len(data) > limits.max_block_bytes:
        raise InvalidBlockError(f"block of {len(data)} bytes (max {limits.max_block_bytes})")
    r = Reader(data, InvalidBlockError, "block")
    r.prefix(BLOCK_DOMAIN, "block domain")
    header = decode_header(r.lp("header", MAX_HEADER_BYTES))
    n = r.u32("transaction count")
    if n > limits.max_txs:
        raise InvalidBlockError(f"block of {n} transactions (max {limits.max_txs})")
    txs = tuple(r.lp("transaction", limits.max_tx_bytes) for _ in range(n))
    r.done()
    block = Block(header, txs)
    check_block_body(block, limits)
    return block


def value_block_id(value: bytes, limits: BlockLimits) -> bytes:
    """The block ID of an encoded block (what votes for it carry).

    Raises:
        InvalidBlockError: as :func:`decode_block`.
    """
    return block_id(decode_block(value, limits).header)


_UNDECODABLE_DOMAIN = b"planetserve/v1/undecodable-value\x00"


def consensus_value_id(limits: BlockLimits) -> Callable[[bytes], bytes]:
    """The value-ID function the consensus core uses for registry blocks
    (``ConsensusConfig.value_id``): the block ID of a value that decodes within ``limits``;
    for one that does not, a domain-separated hash of its bytes (it fails validation anyway,
    and no block ID can equal it without a SHA-256 collision)."""

    def value_id_of(value: bytes) -> bytes:
        try:
            return value_block_id(value, limits)
        except (RemoteProtocolError, LocalProtocolError, ValueError, struct.error):
            return hashlib.sha256(_UNDECODABLE_DOMAIN + value).digest()

    return value_id_of


def check_block_body(block: Block, limits: BlockLimits) -> None:
    """Check a block's transactions against its header and ``limits``.

    Raises:
        InvalidBlockError: too many or too large transactions, an encoded block over
            ``limits.max_block_bytes``, or a ``tx_count``/``txs_hash`` that disagrees.
    """
    txs = block.txs
    if len(txs) > limits.max_txs:
        raise InvalidBlockError(f"block of {len(txs)} transactions (max {limits.max_txs})")
    size = len(BLOCK_DOMAIN) + 4 + MAX_HEADER_BYTES + 4
    for tx in txs:
        if not isinstance(tx, bytes) or len(tx) > limits.max_tx_bytes:
            raise InvalidBlockError(
                f"transaction of {len(tx)} bytes (max {limits.max_tx_bytes})"
            )
        size += 4 + len(tx)
    if size > limits.max_block_bytes:
        raise InvalidBlockError(f"block of ~{size} bytes (max {limits.max_block_bytes})")
    if block.header.tx_count != len(txs):
        raise InvalidBlockError(
            f"header counts {block.header.tx_count} transactions, the block has {len(txs)}"
        )
    if block.header.txs_hash != txs_hash(txs):
        raise InvalidBlockError("header transactions hash does not match the transactions")


@dataclass(frozen=True)
class ChainTip:
    """What a block must follow: the last committed height and its block, and the app hash
    after it (``height`` 0: the genesis, ``block_id`` :data:`ZERO_ID`, ``time_ms`` the genesis
    time)."""

    chain_id: str
    height: int
    block_id: bytes
    time_ms: int
    app_hash: bytes


def validate_block(
    block: Block,
    tip: ChainTip,
    *,
    limits: BlockLimits,
    now_ms: int | None,
    max_clock_drift_ms: int = MAX_CLOCK_DRIFT_MS,
    timely: bool = True,
    proposer: bytes | None = None,
) -> None:
    """Check a proposed block against the chain before voting for it (Algorithm 1's
    ``valid(v)``; the transactions are checked by the application, :mod:`ps_p2p.registry`).

    Time: ``time_ms`` must be after ``tip.time_ms`` (strictly monotonic) and at most
    ``max_clock_drift_ms`` ahead of ``now_ms``, this validator's own clock (unix ms). When
    ``timely`` (a fresh proposal, POL round -1) it must also be at most ``max_clock_drift_ms``
    behind ``now_ms``; a value re-proposed after a polka (POL round >= 0) keeps the time it was
    first proposed with, which may be older, so the driver passes ``timely=False`` for it.
    ``now_ms`` None skips both clock bounds: Algorithm 1's ``valid(v)`` as the validator caches
    it per value must not depend on when it is asked (issue 17); the clock bounds are then
    checked once per fresh proposal, on arrival, by :func:`check_timely`.

    Args:
        proposer: the round's proposer, when known: the header must name it.

    Raises:
        InvalidBlockError: another chain ID; height not ``tip.height + 1``; previous block ID
            or app hash not the tip's; time not after the tip's, or beyond the drift; another
            proposer; or over ``limits`` (:func:`check_block_body`).
    """
    h = block.header
    if h.chain_id != tip.chain_id:
        raise InvalidBlockError(f"block of chain {h.chain_id!r}, not {tip.chain_id!r}")
    if h.height != tip.height + 1:
        raise InvalidBlockError(f"block at height {h.height}, expected {tip.height + 1}")
    if h.prev_block_id != tip.block_id:
        raise InvalidBlockError(f"block {h.height} does not follow block {tip.height}")
    if h.app_hash != tip.app_hash:
        raise InvalidBlockError(
            f"block {h.height} carries another app hash than the state after {tip.height}"
        )
    if not isinstance(h.time_ms, int) or not 0 <= h.time_ms < UINT64_BOUND:
        raise InvalidBlockError(f"block time {h.time_ms!r} out of range")
    if h.time_ms <= tip.time_ms:
        raise InvalidBlockError(
            f"block {h.height} time {h.time_ms} not after the previous block's {tip.time_ms}"
        )
    if now_ms is not None:
        _check_clock(h, now_ms, max_clock_drift_ms, behind=timely)
    if proposer is not None and h.proposer != proposer:
        raise InvalidBlockError(f"block {h.height} names another proposer than the round's")
    check_block_body(block, limits)


def check_timely(
    header: Header, *, now_ms: int, proposer: bytes,
    max_clock_drift_ms: int = MAX_CLOCK_DRIFT_MS,
) -> None:
    """Whether a *fresh* proposal (POL round -1) is timely on arrival (proposer-based
    timestamps): its block time at most ``max_clock_drift_ms`` ahead of or behind ``now_ms``
    (this validator's clock, unix ms) and its header naming ``proposer``, the round's proposer.

    Evaluated once, when the proposal arrives, and read only by Algorithm 1's L22 (through
    :attr:`~ps_p2p.consensus.types.ProposalReceived.timely`); never part of ``valid(v)``.

    Raises:
        InvalidBlockError: the block time is beyond the drift, or another proposer is named.
    """
    _check_clock(header, now_ms, max_clock_drift_ms, behind=True)
    if header.proposer != proposer:
        raise InvalidBlockError(f"block {header.height} names another proposer than the round's")


def _check_clock(h: Header, now_ms: int, max_clock_drift_ms: int, *, behind: bool) -> None:
    if h.time_ms > now_ms + max_clock_drift_ms:
        raise InvalidBlockError(
            f"block {h.height} time is {h.time_ms - now_ms} ms ahead of our clock "
            f"(max {max_clock_drift_ms} ms)"
        )
    if behind and h.time_ms < now_ms - max_clock_drift_ms:
        raise InvalidBlockError(
            f"block {h.height} time is {now_ms - h.time_ms} ms behind our clock "
            f"(max {max_clock_drift_ms} ms for a fresh proposal)"
        )


__all__ = [
    "BLOCK_DOMAIN",
    "HEADER_DOMAIN",
    "MAX_CLOCK_DRIFT_MS",
    "MAX_HEADER_BYTES",
    "TXS_DOMAIN",
    "ZERO_ID",
    "Block",
    "BlockLimits",
    "consensus_value_id",
    "ChainTip",
    "Header",
    "block_id",
    "check_block_body",
    "check_timely",
    "decode_block",
    "decode_header",
    "encode_block",
    "header_bytes",
    "make_block",
    "txs_hash",
    "validate_block",
    "value_block_id",
]
