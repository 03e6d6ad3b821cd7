"""A validator's write-ahead log and block store (ps_p2p.consensus.store), on sqlite3 files."""

from __future__ import annotations

import pytest

from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Step
from ps_p2p.errors import DoubleSignError, StoreError

A = b"a" * 32
B = b"b" * 32


def test_a_signed_vote_survives_a_restart_and_a_second_value_is_refused(tmp_path):
    path = tmp_path / "home" / "consensus.sqlite"
    store = ConsensusStore(path)
    assert store.record_signed(5, 2, Step.PREVOTE, A, b"vote for A") == b"vote for A"
    store.close()

    restarted = ConsensusStore(path)
    (entry,) = restarted.signed_at(5)
    assert (entry.height, entry.round, entry.step, entry.value_id, entry.message) == (
        5, 2, Step.PREVOTE, A, b"vote for A"
    )
    assert restarted.last_signed_height() == 5
    with pytest.raises(DoubleSignError, match="refusing to sign"):
        restarted.record_signed(5, 2, Step.PREVOTE, B, b"vote for B")
    with pytest.raises(DoubleSignError):
        restarted.record_signed(5, 2, Step.PREVOTE, None, b"nil vote")
    # the same value again: the first message, byte for byte (a retransmission)
    assert restarted.record_signed(5, 2, Step.PREVOTE, A, b"re-signed") == b"vote for A"
    assert [e.message for e in restarted.signed_at(5)] == [b"vote for A"]


def test_other_steps_and_rounds_are_free_and_replay_in_order(tmp_path):
    store = ConsensusStore(tmp_path / "c.sqlite")
    store.record_signed(5, 1, Step.PRECOMMIT, None, b"precommit nil r1")
    store.record_signed(5, 0, Step.PREVOTE, A, b"prevote r0")
    store.record_signed(5, 0, Step.PROPOSE, A, b"proposal r0")
    store.record_signed(6, 0, Step.PREVOTE, B, b"next height")
    assert [(e.round, e.step) for e in store.signed_at(5)] == [(0, 0), (0, 1), (1, 2)]
    assert store.prune_signed(6) == 3
    assert store.signed_at(5) == [] and len(store.signed_at(6)) == 1


def test_blocks_are_kept_with_their_commits_and_never_replaced(tmp_path):
    store = ConsensusStore(tmp_path / "c.sqlite")
    assert store.latest_height() == 0
    for h in (1, 2, 3):
        store.save_block(h, b"block %d" % h, b"commit %d" % h)
    store.save_block(2, b"block 2", b"commit 2")  # the same again: nothing changes
    with pytest.raises(StoreError, match="different block"):
        store.save_block(2, b"forked block 2", b"commit")
    assert store.block(2) == (b"block 2", b"commit 2") and store.block(9) is None
    assert store.latest_height() == 3
    assert [h for h, _, _ in store.blocks_from(2, limit=5)] == [2, 3]
    assert [h for h, _, _ in store.blocks_from(1, limit=2)] == [1, 2]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_store_is_refused_with_a_clear_error(tmp_path, damage):
    path = tmp_path / "c.sqlite"
    store = ConsensusStore(path)
    for r in range(200):
        store.record_signed(1, r, Step.PREVOTE, A, b"x" * 100)
    store.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"not a database" * 100)
    with pytest.raises(StoreError, match="cannot be read"):
        ConsensusStore(path).signed_at(1)


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "c.sqlite"
    ConsensusStore(path).close()
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema 99"):
        ConsensusStore(path)


def _synchronous(store: ConsensusStore) -> int:
    return store._db.execute("PRAGMA synchronous").fetchone()[0]


def test_only_own_signed_messages_are_fsynced_and_blocks_ride_on_the_next_one(tmp_path):
    """Issue 17: a signed vote must be durable before it is sent (synchronous=FULL, 2); a
    block, a snapshot or pruning need no fsync of their own (NORMAL, 1): the journal is
    appended in order, so the next signed message's fsync covers them."""
    store = ConsensusStore(tmp_path / "c.sqlite")
    store.save_block(1, b"block 1", b"commit 1")
    assert _synchronous(store) == 1 and store.grouped_writes == 1 and store.synced_writes == 0
    store.record_signed(2, 0, Step.PREVOTE, A, b"prevote")
    assert _synchronous(store) == 2 and store.synced_writes == 1
    store.save_snapshot(1, b"h" * 32, b"state")
    store.prune_signed(2)
    assert _synchronous(store) == 1 and store.grouped_writes == 3
    store.close()
    reopened = ConsensusStore(tmp_path / "c.sqlite")  # all of it is there after a reopen
    assert reopened.block(1) == (b"block 1", b"commit 1")
    assert reopened.snapshots() == [(1, b"h" * 32)] and reopened.snapshot(1) == b"state"
    assert [e.message for e in reopened.signed_at(2)] == [b"prevote"]


def test_a_schema_2_store_opens_and_gains_the_snapshot_table(tmp_path):
    import sqlite3
    path = tmp_path / "old.sqlite"
    ConsensusStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='2' WHERE key='schema'")
    db.execute("DROP TABLE snapshots")
    db.execute("DROP TABLE lock_votes")
    db.commit()
    db.close()
    store = ConsensusStore(path)
    assert store.snapshots() == []
    assert store._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "4"


def test_a_lock_keeps_its_pol_certificate_across_a_restart_and_pruning_drops_it(tmp_path):
    """Issue 17 (simulator seeds 2268, 2529, 5802, 9265): a precommit of a value keeps the
    2f+1 prevotes of its polka with the lock, so a restart can replay them (L28 needs them
    for the re-proposal); a nil or unlocked message carries none; pruning forgets them."""
    path = tmp_path / "c.sqlite"
    store = ConsensusStore(path)
    store.record_signed(5, 0, Step.PREVOTE, A, b"own prevote")
    store.record_signed(5, 0, Step.PRECOMMIT, A, b"own precommit", locked=b"value A",
                        certificate=[b"prevote 1", b"prevote 2", b"prevote 3"])
    store.record_signed(5, 1, Step.PRECOMMIT, None, b"nil precommit")
    store.close()

    restarted = ConsensusStore(path)
    by_key = {(e.round, e.step): e for e in restarted.signed_at(5)}
    lock = by_key[(0, Step.PRECOMMIT)]
    assert lock.locked == b"value A"
    assert lock.certificate == (b"prevote 1", b"prevote 2", b"prevote 3")
    assert by_key[(0, Step.PREVOTE)].certificate == ()
    assert by_key[(1, Step.PRECOMMIT)].certificate == ()
    assert restarted.prune_signed(6) == 3
    assert restarted._db.execute("SELECT COUNT(*) FROM lock_votes").fetchone()[0] == 0


def test_a_schema_3_store_opens_and_gains_the_lock_certificate_table(tmp_path):
    import sqlite3
    path = tmp_path / "old.sqlite"
    ConsensusStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='3' WHERE key='schema'")
    db.execute("DROP TABLE lock_votes")
    db.commit()
    db.close()
    store = ConsensusStore(path)
    store.record_signed(1, 0, Step.PRECOMMIT, A, b"pc", locked=b"v", certificate=[b"p"])
    assert store.signed_at(1)[0].certificate == (b"p",)
    assert store._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "4"
