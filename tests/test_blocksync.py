"""Block sync (ps_p2p.protocols.blocksync) between real py-libp2p hosts: verified blocks come
over, and a server sending an under-signed commit or a block that does not chain is refused."""

from __future__ import annotations

import pytest
import trio

from ps_p2p.consensus import signing
from ps_p2p.consensus.block import BlockLimits, block_id, decode_block, encode_block, make_block
from ps_p2p.consensus.store import ConsensusStore
from ps_p2p.consensus.types import Validator, Vote, VoteType
from ps_p2p.errors import ConsensusError, InvalidCommitError
from ps_p2p.keys import NodeKeys
from ps_p2p.protocols import consensus_codec as cc
from ps_p2p.protocols.blocksync import BlockSyncServer, fetch_blocks, verify_synced
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.rate_limits import PeerBudgets

CHAIN = "sync-chain"
KEYS = [NodeKeys.generate().identity for _ in range(4)]
VALIDATORS = tuple(Validator(k.peer_id) for k in KEYS)
GENESIS_ID = bytes(32)


def _chain(count: int, signers: int = 3):
    """``count`` blocks, each committed by the first ``signers`` validators."""
    out, prev = [], GENESIS_ID
    for h in range(1, count + 1):
        block = make_block(chain_id=CHAIN, height=h, time_ms=1_000 * h, prev_block_id=prev,
                           app_hash=bytes(32), proposer=KEYS[h % 4].peer_id, txs=[b"tx%d" % h])
        bid = block_id(block.header)
        commit = tuple(
            signing.sign_vote(k, CHAIN, Vote(VoteType.PRECOMMIT, h, 0, bid, k.peer_id))
            for k in KEYS[:signers]
        )
        out.append((h, encode_block(block), commit))
        prev = bid
    return out


def _store(tmp_path, chain) -> ConsensusStore:
    store = ConsensusStore(tmp_path / "server.sqlite")
    for h, block, commit in chain:
        store.save_block(h, block, cc.encode_commit(commit))
    return store


async def test_a_node_that_is_behind_fetches_and_verifies_blocks_page_by_page(tmp_path):
    chain = _chain(7)
    server = BlockSyncServer(_store(tmp_path, chain))
    async with open_host(NodeKeys.generate().identity, ["/ip4/127.0.0.1/tcp/0"]) as a, \
            open_host(NodeKeys.generate().identity, ["/ip4/127.0.0.1/tcp/0"]) as b:
        handlers = server.register_handlers(a)
        await connect(b, listen_multiaddrs(a)[0])
        got, prev, height = [], GENESIS_ID, 1
        with trio.fail_after(30):
            while True:
                blocks, latest = await fetch_blocks(
                    b, a.get_id().to_bytes(), height, chain_id=CHAIN, validators=VALIDATORS,
                    previous_block_id=prev, max_blocks=3,
                )
                got += blocks
                if not blocks or blocks[-1].height >= latest:
                    break
                height = blocks[-1].height + 1
                prev = block_id(decode_block(blocks[-1].block, BlockLimits()).header)
        await handlers.aclose()
    assert [v.height for v in got] == list(range(1, 8))
    assert [v.block for v in got] == [block for _, block, _ in chain]
    assert server.served == 3  # pages of 3, 3 and 1


def test_an_under_signed_commit_is_refused():
    blocks = [cc.SyncedBlock(h, b, c) for h, b, c in _chain(2, signers=2)]
    with pytest.raises(InvalidCommitError):
        verify_synced(blocks, chain_id=CHAIN, validators=VALIDATORS, previous_block_id=GENESIS_ID,
                      limits=BlockLimits())


def test_blocks_that_do_not_chain_are_refused():
    one, two, three = (cc.SyncedBlock(h, b, c) for h, b, c in _chain(3))
    with pytest.raises(ConsensusError, match="does not follow"):
        verify_synced([one, three], chain_id=CHAIN, validators=VALIDATORS,
                      previous_block_id=GENESIS_ID, limits=BlockLimits())
    with pytest.raises(ConsensusError, match="does not follow"):
        verify_synced([two], chain_id=CHAIN, validators=VALIDATORS,
                      previous_block_id=GENESIS_ID, limits=BlockLimits())
    # a commit of another block of the same height does not cover this one
    forged = cc.SyncedBlock(1, one.block, two.commit)
    with pytest.raises(InvalidCommitError):
        verify_synced([forged], chain_id=CHAIN, validators=VALIDATORS,
                      previous_block_id=GENESIS_ID, limits=BlockLimits())


async def test_blocks_go_only_to_allowed_peers_within_their_rate(tmp_path):
    chain = _chain(3)
    a_key, b_key, c_key, d_key = (NodeKeys.generate().identity for _ in range(4))
    budgets = PeerBudgets(rate=1.0, burst=1.0, total_rate=1e9, total_burst=1e9)
    server = BlockSyncServer(_store(tmp_path, chain), budgets=budgets, clock=lambda: 0.0,
                             allow=lambda peer: peer != d_key.peer_id)
    kwargs = dict(chain_id=CHAIN, validators=VALIDATORS, previous_block_id=GENESIS_ID)
    async with open_host(a_key, ["/ip4/127.0.0.1/tcp/0"]) as a:
        handlers = server.register_handlers(a)
        served = a.get_id().to_bytes()
        for key in (b_key, c_key, d_key):
            async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as client:
                await connect(client, listen_multiaddrs(a)[0])
                if key is d_key:  # not allowed: reset before any request is read
                    with pytest.raises(Exception):
                        await fetch_blocks(client, served, 1, **kwargs)
                    continue
                blocks, latest = await fetch_blocks(client, served, 1, **kwargs)
                assert [b.height for b in blocks] == [1, 2, 3] and latest == 3
                with pytest.raises(Exception):  # in debt now (clock stands still)
                    await fetch_blocks(client, served, 1, **kwargs)
        await handlers.aclose()
    assert (server.served, server.rate_limited, server.not_allowed) == (2, 2, 1)


def test_a_batch_ends_at_the_first_commit_of_another_validator_set():
    # blocks 1-2 committed by the set asked with; block 3 by a set it does not know (a
    # VALSET_UPDATE executed in the batch): the verified prefix comes back, not an error
    full = [cc.SyncedBlock(h, b, c) for h, b, c in _chain(3)]
    other = [cc.SyncedBlock(h, b, c) for h, b, c in _chain(3, signers=2)]
    got = verify_synced(full[:2] + other[2:], chain_id=CHAIN, validators=VALIDATORS,
                        previous_block_id=GENESIS_ID, limits=BlockLimits())
    assert [v.height for v in got] == [1, 2]
