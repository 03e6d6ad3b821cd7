"""The registry's mempool: transactions waiting for a block, in two lanes; pure.

:class:`Mempool` keeps checked transactions (:func:`~ps_p2p.registry.execution.check_tx`),
deduplicated and bounded, in a lane for listed peers, evidence and the epochs' transactions and
a lane for new identities (:class:`Lane`), re-checks them against each committed state and
reaps what a block should carry.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from ps_p2p.consensus.block import BlockLimits
from ps_p2p.errors import (
    AdmissionError,
    InvalidTransactionError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ps_p2p.records.limits import MAX_RECORDS
from ps_p2p.records.peer_ids import peer_label
from ps_p2p.registry.execution import _admit, _verify_tx
from ps_p2p.registry.state import AppState
from ps_p2p.registry.tx import DeregisterTx, RegisterTx, Tx, TxKind, decode_tx, tx_hash


class Lane(enum.IntEnum):
    """The two parts of the :class:`Mempool`: what a new identity may take, and what it may not."""

    #: renewals and deregistrations of listed peers, evidence, the epochs' transactions
    LISTED = 0
    #: REGISTER of a peer the state does not list (a new identity)
    NEW = 1


@dataclass
class _Pending:
    tx: bytes
    decoded: Tx
    lane: Lane
    #: the claimed source networks of a NEW registration (:func:`source_networks`; ``""``:
    #: none), counted against the per-network caps with the listed records
    nets: frozenset[str] = frozenset()


class Mempool:
    """Transactions waiting for a block, in two lanes, deduplicated, bounded (sans-I/O).

    Why two lanes (issue 16): identities are free, so REGISTERs of fresh peers can arrive
    faster than blocks take them (``max_registrations_per_block``). In one FIFO pool they
    kept it full, every honest renewal was refused as "mempool full", and after one record
    lifetime the directory listed no honest node. Now:

    * lane :attr:`Lane.NEW`, REGISTERs of peers the state does not list: at most ``max_new``
      transactions and ``max_new_bytes`` bytes, and per claimed source network (an IPv4 /24,
      IPv6 /48 or DNS domain of the record's addresses, :func:`source_networks`; records
      without address count as one network) no more pending than the committed cap still
      leaves room for (``max_records_per_network`` or ``max_records_without_address`` minus
      the records listed there): a pending registration that could never be listed is refused
      at once instead of holding room.
    * lane :attr:`Lane.LISTED`, everything else: renewals and deregistrations of listed peers,
      EVIDENCE, SEED_COMMIT, EPOCH_REPORT, MISS_REPORT. A new identity never takes room here:
      a full NEW lane refuses only new registrations. At most one REGISTER and one DEREGISTER
      per peer are pending (a newer one, by ``issued_at_ms``, takes the older one's place; an
      older or equal one is refused), and ``max_per_subject`` of any other kind about one
      subject (the accused validator, the reporting validator). So this lane holds at most
      two transactions per listed peer plus the committee's own, and its bounds ``max_txs``
      / ``max_bytes`` are sized to the registry (``MAX_RECORDS``), not to a flood.

    :meth:`reap` takes the LISTED lane first (oldest first), then the NEW lane within
    ``max_registrations_per_block``. Each transaction passes :func:`check_tx` before it
    enters; after each block :meth:`update` drops the committed ones and re-checks the rest
    against the new state without their signatures (checked on entry; the bytes cannot have
    changed): expiry and the state rules, moving a REGISTER to the lane its peer now belongs
    in.

    Args:
        max_txs: LISTED lane, default ``2 * MAX_RECORDS + 4096``. max_bytes: LISTED lane,
            default 256 MiB (~1.2 KiB per REGISTER at most).
        max_per_subject: default 4. max_new: NEW lane, default 1024 (16 blocks of the default
            ``max_registrations_per_block``). max_new_bytes: NEW lane, default 2 MiB.
    """

    def __init__(self, *, max_txs: int = 2 * MAX_RECORDS + 4096,
                 max_bytes: int = 256 * 1024 * 1024, max_per_subject: int = 4,
                 max_new: int = 1024, max_new_bytes: int = 2 * 1024 * 1024) -> None:
        if min(max_txs, max_bytes, max_per_subject, max_new, max_new_bytes) < 1:
            raise LocalProtocolError("mempool bounds must be >= 1")
        self.max_txs = max_txs
        self.max_bytes = max_bytes
        self.max_per_subject = max_per_subject
        self.max_new = max_new
        self.max_new_bytes = max_new_bytes
        self._lanes: tuple[collections.OrderedDict[bytes, _Pending], ...] = (
            collections.OrderedDict(), collections.OrderedDict())
        self._lane_bytes = [0, 0]
        self._subjects: collections.Counter[bytes] = collections.Counter()
        #: (kind, peer ID) -> key of its pending REGISTER / DEREGISTER (one each)
        self._slots: dict[tuple[int, bytes], bytes] = {}
        #: claimed source network -> pending NEW registrations listing it
        self._new_nets: collections.Counter[str] = collections.Counter()

    @property
    def bytes(self) -> int:
        """Bytes pending in both lanes."""
        return sum(self._lane_bytes)

    def __len__(self) -> int:
        return len(self._lanes[Lane.LISTED]) + len(self._lanes[Lane.NEW])

    def __contains__(self, tx_hash_: bytes) -> bool:
        return any(tx_hash_ in lane for lane in self._lanes)

    def lane_size(self, lane: Lane) -> int:
        """Transactions pending in ``lane``."""
        return len(self._lanes[lane])

    def pending_in_network(self, network: str) -> int:
        """NEW registrations pending whose record claims an address in ``network`` (a
        :func:`source_networks` key; ``""``: records without address)."""
        return self._new_nets[network]

    def txs(self) -> list[bytes]:
        """The pending transactions: the LISTED lane, then the NEW lane, oldest first."""
        return [p.tx for lane in self._lanes for p in lane.values()]

    @staticmethod
    def lane_of(tx: Tx, state: AppState) -> Lane:
        """:attr:`Lane.NEW` for a REGISTER of a peer ``state`` does not list, else LISTED."""
        if isinstance(tx, RegisterTx) and tx.record.peer_id not in state.records:
            return Lane.NEW
        return Lane.LISTED

    def add(self, tx: bytes, state: AppState, now_ms: int) -> bool:
        """Check ``tx`` (:func:`check_tx`) and queue it in its lane (class docstring).

        Cheapest first: decoding, the lane's room and the per-peer slot, then the signature
        and the state rules.

        Returns:
            True if added (possibly in place of an older REGISTER / DEREGISTER of the same
            peer), False if the same transaction is already pending.

        Raises:
            InvalidTransactionError: as :func:`check_tx`.
            AdmissionError: as :func:`check_tx`; its lane is full (count or bytes); a record
                or deregistration of the peer as new or newer is already pending;
                ``max_per_subject`` reached; the claimed network's cap is taken by listed and
                pending registrations (NEW lane).
        """
        raw = bytes(tx)
        key = tx_hash(raw)
        if key in self:
            return False
        decoded = decode_tx(raw, state.genesis.limits.max_tx_bytes)
        lane = self.lane_of(decoded, state)
        replaced = self._slot_check(decoded)
        old = self._find(replaced) if replaced is not None else None
        nets = self._room_check(decoded, lane, len(raw), state, old)
        _verify_tx(decoded, state, now_ms)
        _admit(decoded, state, None)
        if replaced is not None:
            self._drop(replaced)
        self._insert(key, _Pending(raw, decoded, lane, nets))
        return True

    def _slot_check(self, decoded: Tx) -> bytes | None:
        """The key of the pending transaction ``decoded`` replaces, if any."""
        subject = decoded.subject
        if isinstance(decoded, (RegisterTx, DeregisterTx)):
            kind = TxKind.REGISTER if isinstance(decoded, RegisterTx) else TxKind.DEREGISTER
            held = self._slots.get((kind, subject))
            if held is None:
                return None
            held_tx = self._find(held).decoded
            assert isinstance(held_tx, (RegisterTx, DeregisterTx))
            if _issued_at(decoded) <= _issued_at(held_tx):
                raise AdmissionError(
                    f"a {kind.name} of {peer_label(subject)} as new or newer is already pending"
                )
            return held
        if self._subjects[subject] >= self.max_per_subject:
            raise AdmissionError(
                f"{self.max_per_subject} transactions about {peer_label(subject)} already pending"
            )
        return None

    def _room_check(self, decoded: Tx, lane: Lane, size: int, state: AppState,
                    old: _Pending | None) -> frozenset[str]:
        """Refuse when ``lane`` has no room (``old`` leaves it); the NEW entry's networks."""
        freed, freed_bytes = (1, len(old.tx)) if old is not None and old.lane == lane else (0, 0)
        count = len(self._lanes[lane]) - freed
        used = self._lane_bytes[lane] - freed_bytes
        if lane == Lane.LISTED:
            if count >= self.max_txs or used + size > self.max_bytes:
                raise AdmissionError(f"mempool full ({count} transactions, {used} bytes)")
            return frozenset()
        if count >= self.max_new or used + size > self.max_new_bytes:
            raise AdmissionError(
                f"mempool full for new registrations ({count} pending, {used} bytes; renewals "
                "of listed peers still get in)"
            )
        assert isinstance(decoded, RegisterTx)
        try:
            nets = state._networks_of(decoded.record)
        except RemoteProtocolError as exc:
            raise InvalidTransactionError(f"record refused: {exc}") from None
        policy = state.policy
        held = old.nets if old is not None and old.lane == Lane.NEW else frozenset()
        for net in nets - held:
            cap = policy.max_records_without_address if net == "" else \
                policy.max_records_per_network
            if state.live_network_count(net) + self._new_nets[net] >= cap:
                where = "without address" if net == "" else f"in network {net}"
                raise AdmissionError(
                    f"{cap} records already listed or pending {where} (admission cap)")
        return nets

    def _find(self, key: bytes) -> _Pending:
        for lane in self._lanes:
            if key in lane:
                return lane[key]
        raise KeyError(key)

    def _insert(self, key: bytes, p: _Pending) -> None:
        self._lanes[p.lane][key] = p
        self._lane_bytes[p.lane] += len(p.tx)
        d = p.decoded
        if isinstance(d, (RegisterTx, DeregisterTx)):
            kind = TxKind.REGISTER if isinstance(d, RegisterTx) else TxKind.DEREGISTER
            self._slots[(kind, d.subject)] = key
        else:
            self._subjects[d.subject] += 1
        self._new_nets.update(p.nets)

    def _drop(self, key: bytes) -> _Pending:
        for lane in self._lanes:
            p = lane.pop(key, None)
            if p is not None:
                break
        else:
            raise KeyError(key)
        self._lane_bytes[p.lane] -= len(p.tx)
        d = p.decoded
        if isinstance(d, (RegisterTx, DeregisterTx)):
            kind = TxKind.REGISTER if isinstance(d, RegisterTx) else TxKind.DEREGISTER
            del self._slots[(kind, d.subject)]
        else:
            self._subjects[d.subject] -= 1
            if not self._subjects[d.subject]:
                del self._subjects[d.subject]
        for net in p.nets:
            self._new_nets[net] -= 1
            if not self._new_nets[net]:
                del self._new_nets[net]
        return p

    def reap(self, state: AppState, limits: BlockLimits | None = None) -> list[bytes]:
        """The pending transactions that fit one block on ``state`` (a proposer's choice):
        the LISTED lane first, then the NEW lane, oldest first in each; within ``limits``
        (default: the genesis') in count and bytes, and at most
        ``max_registrations_per_block`` registrations of new peers."""
        limits = limits or state.genesis.limits
        budget = limits.max_block_bytes - 1024  # the header and framing
        out: list[bytes] = []
        new_peers: set[bytes] = set()
        for lane in self._lanes:
            for p in lane.values():
                if len(out) >= limits.max_txs:
                    return out
                tx = p.tx
                if len(tx) + 4 > budget:
                    continue
                subject = p.decoded.subject
                if isinstance(p.decoded, RegisterTx) and subject not in state.records:
                    if subject not in new_peers and \
                            len(new_peers) >= state.policy.max_registrations_per_block:
                        continue
                    new_peers.add(subject)
                out.append(tx)
                budget -= len(tx) + 4
        return out

    def update(self, state: AppState, committed: Iterable[bytes], now_ms: int) -> int:
        """After a block: drop ``committed`` transactions, re-check the rest on ``state``
        (expiry and state rules; signatures were checked on entry), and move a REGISTER whose
        peer was listed or removed meanwhile to its lane (dropped when that lane has no room).
        Cost: O(pending), no signature check but an evidence's or an epoch transaction's.

        Returns:
            how many were dropped by the re-check (no longer valid, over a cap or no room).
        """
        for tx in committed:
            key = tx_hash(bytes(tx))
            if key in self:
                self._drop(key)
        dropped = 0
        for lane in self._lanes:
            for key, p in list(lane.items()):
                try:
                    _recheck(p.decoded, state, now_ms)
                    want = self.lane_of(p.decoded, state)
                    if want != p.lane:
                        self._drop(key)
                        nets = self._room_check(p.decoded, want, len(p.tx), state, None)
                        self._insert(key, _Pending(p.tx, p.decoded, want, nets))
                except InvalidTransactionError:
                    if key in self:
                        self._drop(key)
                    dropped += 1
        return dropped


def _issued_at(tx: RegisterTx | DeregisterTx) -> int:
    return tx.record.issued_at_ms if isinstance(tx, RegisterTx) else tx.issued_at_ms


def _recheck(tx: Tx, state: AppState, now_ms: int) -> None:
    """What may have changed for a pending transaction since :func:`check_tx` took it: the
    state and the time. REGISTER and DEREGISTER skip their signature (checked on entry);
    evidence and the epoch transactions are checked whole (their rules read the state).

    Raises:
        InvalidTransactionError, AdmissionError: as :func:`check_tx`.
    """
    if isinstance(tx, RegisterTx):
        if now_ms >= tx.record.expires_at_ms:
            raise InvalidTransactionError(f"record of {peer_label(tx.subject)} expired")
    elif not isinstance(tx, DeregisterTx):
        _verify_tx(tx, state, now_ms)
    _admit(tx, state, None)


__all__ = [
    "Lane",
    "Mempool",
]
