"""State snapshots: the registry application's state at one height as bytes, and back; pure.

Why (issue 17, finding 4): a restarted validator rebuilt its state by executing every stored
block from the genesis (0.25 ms of CPU per empty block: ~22 s of restart per day of chain at a
block a second). With a snapshot every ``snapshot_every`` heights
(:class:`~ps_p2p.registry.validator.Validator`) it loads the latest one and executes only the
blocks after it, so the restart time no longer grows with the chain's age; the blocks before
it may then be pruned (:meth:`~ps_p2p.consensus.store.ConsensusStore.prune_blocks`). CometBFT's
application snapshots (ABCI ``ListSnapshots``/``LoadSnapshotChunk``) play the same part.

The bytes are canonical and self-checking: :func:`decode_state` rebuilds the state, recomputes
its app hash (:func:`~ps_p2p.registry.app_hash`, which covers every field below) and
refuses a snapshot whose hash differs from the one it carries; the caller also compares that
hash with the app hash the next stored block's header commits to (a header with 2f+1
precommits), so a snapshot that is corrupt, truncated, or of another version is never used::

    snapshot   = SNAPSHOT_DOMAIN || u64(height) || bytes(block_id) || u64(time_ms)
                 || bytes(app_hash)
                 || u32(#records) || (bytes(record signing bytes) || bytes(signature))*
                 || u32(#evidence) || (bytes(key) || bytes(validator) || u64(height))*
                 || u32(#departed) || (bytes(peer_id) || u64(issued_at_ms))*
                 || u64(reputation epoch) || u32(#subjects) || (bytes(subject) || entry)*
                 || ledger            (:meth:`~ps_p2p.verification.ledger.EpochLedger.encode`)
                 || valset            (the validator set of the next height, its pending
                                       VALSET_UPDATE, the executed ones)
                 || bytes(ledger mix) (:meth:`~ps_p2p.verification.ledger.EpochLedger.
                                       encode_mix`, b"" when no mix report ever executed)

    valset     = u32(#validators) || (bytes(peer_id) || u64(power))*
                 || u8(pending?) [|| u64(effective_height) || u32(#new) || (bytes || u64)*]
                 || u32(#updates) || bytes(VALSET_UPDATE transaction)*

(maps ascending by key; ``entry`` as in :mod:`ps_p2p.registry`). Records are not
re-checked for signatures or expiry: they were executed before, and the app hash (the records
root) proves them unchanged. Cost: O(records) both ways (~0.1 s and ~10 MB at 100,000 records).

Errors: :class:`~ps_p2p.errors.RemoteProtocolError` (malformed bytes, a hash that does not
match): the caller treats the snapshot as absent.
"""

from __future__ import annotations

import heapq

from ps_p2p.consensus.block import ZERO_ID
from ps_p2p.consensus.encoding import Reader, lp, u8, u32, u64
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import RemoteProtocolError
from ps_p2p.records.canonical import record_signing_bytes
from ps_p2p.registry import (
    AppState,
    ReputationEntry,
    ValsetUpdateTx,
    app_hash,
    decode_record,
    decode_tx,
    encode_tx,
)
from ps_p2p.verification.ledger import LEDGER_DOMAIN, Credit, EpochLedger

SNAPSHOT_DOMAIN = b"planetserve/v1/state-snapshot\x00"
#: Bound of any one byte string in a snapshot (a record's signing bytes are far below it).
_MAX_FIELD = 1 << 20
_MAX_COUNT = 1 << 24


def encode_state(state: AppState) -> bytes:
    """The snapshot bytes of ``state`` (module docstring); ``state`` is not changed."""
    parts = [SNAPSHOT_DOMAIN, u64(state.height), lp(state.block_id), u64(state.time_ms),
             lp(state.app_hash)]
    records = sorted(state.records.records(), key=lambda r: r.peer_id)
    parts.append(u32(len(records)))
    parts += [lp(bytes(record_signing_bytes(r))) + lp(r.signature) for r in records]
    parts.append(u32(len(state.evidence)))
    for key in sorted(state.evidence):
        validator, height = state.evidence[key]
        parts.append(lp(key) + lp(validator) + u64(height))
    parts.append(u32(len(state.departed)))
    parts += [lp(p) + u64(state.departed[p]) for p in sorted(state.departed)]
    parts += [u64(state.reputation_epoch), u32(len(state.reputations))]
    parts += [lp(s) + state.reputations[s].encode() for s in sorted(state.reputations)]
    parts.append(state.ledger.encode(mix=False))
    parts.append(_encode_set(state.validators))
    if state.pending_valset is None:
        parts.append(u8(0))
    else:
        parts += [u8(1), u64(state.pending_valset[0]), _encode_set(state.pending_valset[1])]
    parts.append(u32(len(state.valset_updates)))
    parts += [lp(encode_tx(tx)) for tx in state.valset_updates]
    parts.append(lp(state.ledger.encode_mix()))
    return b"".join(parts)


def _encode_set(validators: tuple[Validator, ...]) -> bytes:
    return u32(len(validators)) + b"".join(lp(v.address) + u64(v.power) for v in validators)


def _read_set(r: Reader, what: str) -> tuple[Validator, ...]:
    return tuple(Validator(r.lp(what, 64), r.u64(f"{what} power"))
                 for _ in range(_count(r, what)))


def snapshot_header(data: bytes) -> tuple[int, bytes]:
    """(height, app hash) a snapshot claims, read without decoding the rest.

    Raises:
        RemoteProtocolError: not a snapshot.
    """
    r = Reader(data, RemoteProtocolError, "state snapshot")
    r.prefix(SNAPSHOT_DOMAIN, "snapshot domain")
    height = r.u64("height")
    r.lp("block ID", 64)
    r.u64("time")
    return height, r.lp("app hash", 64)


def decode_state(data: bytes, genesis_state: AppState) -> AppState:
    """Rebuild the state of a snapshot (module docstring) on ``genesis_state``'s genesis.

    Args:
        data: :func:`encode_state`'s bytes.
        genesis_state: the chain's state at height 0 (gives the genesis; not changed).

    Returns:
        the state, its app hash recomputed and equal to the one the snapshot carries.

    Raises:
        RemoteProtocolError: malformed, or the recomputed app hash differs.
    """
    r = Reader(data, RemoteProtocolError, "state snapshot")
    r.prefix(SNAPSHOT_DOMAIN, "snapshot domain")
    state = genesis_state.copy()
    state.height = r.u64("height")
    state.block_id = r.lp("block ID", 64)
    state.time_ms = r.u64("time")
    claimed = r.lp("app hash", 64)
    for _ in range(_count(r, "records")):
        signing = r.lp("record", _MAX_FIELD)
        signature = r.lp("record signature", _MAX_FIELD)
        try:
            record = decode_record(signing, signature)
        except RemoteProtocolError as exc:
            raise r.fail(f"record: {exc}") from None
        state._put(record)
    for _ in range(_count(r, "evidence")):
        key = r.lp("evidence key", 64)
        state.evidence[key] = (r.lp("evidence validator", 64), r.u64("evidence height"))
    for _ in range(_count(r, "departed")):
        peer = r.lp("departed peer", 64)
        state.departed[peer] = r.u64("departed time")
    state._departed_heap = [(t, p) for p, t in state.departed.items()]
    heapq.heapify(state._departed_heap)
    state.reputation_epoch = r.u64("reputation epoch")
    for _ in range(_count(r, "reputations")):
        subject = r.lp("subject", 256)
        state.reputations[subject] = ReputationEntry.read(r)
    state.ledger = _read_ledger(r)
    state._set_validators(_read_set(r, "validator"))
    if r.u8("pending valset"):
        state.pending_valset = (r.u64("effective height"), _read_set(r, "pending validator"))
    updates = []
    for _ in range(_count(r, "valset updates")):
        try:
            tx = decode_tx(r.lp("valset update", _MAX_FIELD), _MAX_FIELD)
        except RemoteProtocolError as exc:
            raise r.fail(f"valset update: {exc}") from None
        if not isinstance(tx, ValsetUpdateTx):
            raise r.fail("a valset update that is another transaction")
        updates.append(tx)
    state.valset_updates = tuple(updates)
    mix = r.lp("ledger mix", _MAX_FIELD)
    if mix:
        mr = Reader(mix, RemoteProtocolError, "ledger mix")
        state.ledger.read_mix(mr)
        mr.done()
    r.done()
    state._registry_aux = None
    state._reputation_root = None
    state.app_hash = app_hash(state)
    if state.app_hash != claimed or (state.height == 0 and state.block_id != ZERO_ID):
        raise r.fail("the state does not give the app hash it claims")
    return state


def _count(r: Reader, what: str) -> int:
    n = r.u32(f"{what} count")
    if n > _MAX_COUNT or n > r.remaining:
        raise r.fail(f"{n} {what}")
    return n


def _read_ledger(r: Reader) -> EpochLedger:
    """:meth:`EpochLedger.encode`'s bytes back (the ledger bytes of ledger.py's docstring)."""
    r.prefix(LEDGER_DOMAIN, "ledger domain")
    ledger = EpochLedger(epoch=r.u64("epoch"), start_ms=r.u64("epoch start"))
    if r.u8("started"):
        ledger.anchor = r.lp("anchor", 64)
        ledger.eligible = tuple(Validator(r.lp("eligible", 64), r.u64("power"))
                                for _ in range(_count(r, "eligible")))
        ledger.challenged = tuple((r.lp("node", 64), r.lp("subject", 256))
                                  for _ in range(_count(r, "challenged")))
    for _ in range(_count(r, "commitment epochs")):
        epoch = r.u64("commitment epoch")
        ledger.commitments[epoch] = {r.lp("validator", 64): r.lp("commitment", 64)
                                     for _ in range(_count(r, "commitments"))}
    for _ in range(_count(r, "recent epochs")):
        epoch = r.u64("recent epoch")
        ledger.recent[epoch] = tuple(r.u32("prompt") for _ in range(_count(r, "prompts")))
    for _ in range(_count(r, "misses")):
        key = (r.u64("miss epoch"), r.lp("missed node", 64))
        ledger.missed_subjects[key] = r.lp("missed subject", 256)
        if r.u8("counted"):
            ledger.counted.add(key)
        ledger.misses[key] = frozenset(r.lp("reporter", 64) for _ in range(_count(r, "reporters")))
    for _ in range(_count(r, "credits")):
        node = r.lp("credit node", 64)
        ledger.credits[node] = Credit(r.u64("answered"), r.u64("passed"), r.u64("missed"))
    return ledger


__all__ = ["SNAPSHOT_DOMAIN", "decode_state", "encode_state", "snapshot_header"]
