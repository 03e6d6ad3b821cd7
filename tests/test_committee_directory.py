"""Nodes and the committee: registration as REGISTER transactions, the committed directory over
``/planetserve/directory/2.0.0``, and nodes that trust a directory only with 2f+1 commit
signatures of the genesis validators.

The replica core (ps_p2p.consensus.replica) is tested without hosts; the protocol with a local
committee of real hosts (ps_p2p.testing.committee) and a lying verifier; the whole network
(4 committee verifiers, a model node, 6 users) with ps_p2p.testing.localnet.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import trio
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

from ps_p2p.config import NodeConfig
from ps_p2p.consensus import app
from ps_p2p.consensus.block import block_id, make_block
from ps_p2p.consensus.directory import DeltaPage, DirectoryHistory, directory_delta
from ps_p2p.consensus.replica import CommitteeReplica
from ps_p2p.consensus.signing import sign_vote
from ps_p2p.consensus.types import Validator, Vote, VoteType
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import (
    ConfigError,
    DirectoryRollbackError,
    ExpiredError,
    InvalidCommitError,
    InvalidDirectoryError,
    RemoteProtocolError,
)
from ps_p2p.keys import Identity, NodeKeys
from ps_p2p.metrics import status_line
from ps_p2p.node import Node
from ps_p2p.protocols.committee_directory import (
    COMMITTEE_DIRECTORY_PROTOCOL_ID,
    CommitteeDirectoryService,
    fetch_committed_directory,
    register_with_committee,
)
from ps_p2p.protocols.framing import encode_frame
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.testing.committee import LocalCommittee
from ps_p2p.testing.localnet import open_localnet, write_genesis

CHAIN = "committee-test"
T0 = 1_700_000_000_000
SECOND = 1000
KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
GENESIS = app.Genesis(CHAIN, T0, tuple(Validator(k.peer_id) for k in KEYS),
                      app.AdmissionPolicy(max_records_per_network=100))
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public


def who(i: int) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(b"node %d" % i).digest())


def record(i: int, issued: int = T0, lifetime: int = 3_600_000) -> NodeRecord:
    ident = who(i)
    return sign_record(ident, NodeRecord(
        ident.peer_id, (f"/ip4/10.0.0.{i}/tcp/4001",), frozenset({Role.USER}), ONION,
        issued_at_ms=issued, expires_at_ms=issued + lifetime))


def reg(rec: NodeRecord) -> bytes:
    return app.encode_tx(app.RegisterTx(rec))


def commit_for(header, signers=KEYS[:3]) -> list[Vote]:
    return [sign_vote(k, CHAIN, Vote(VoteType.PRECOMMIT, header.height, 0, block_id(header), b""))
            for k in signers]


class Chain:
    """Blocks executed by hand, with their commits, in a verifier's history."""

    def __init__(self) -> None:
        self.state = app.genesis_state(GENESIS)
        self.history = DirectoryHistory(self.state)

    def block(self, txs=()):
        s = self.state
        block = make_block(chain_id=CHAIN, height=s.height + 1, time_ms=s.time_ms + SECOND,
                           prev_block_id=s.block_id, app_hash=s.app_hash,
                           proposer=KEYS[0].peer_id, txs=txs)
        new, result = app.execute_block(s, block)
        assert all(r.ok for r in result.tx_results)
        self.history.add_block(block.header, commit_for(block.header), new, result)
        self.state = new
        return block.header

    def serve(self, since: int):
        h = self.history
        return h.header, h.commit, directory_delta(h, since, 1024)


# ---------------------------------------------------------------------------------- replica


def test_the_replica_adopts_a_committed_directory_and_lists_what_changed():
    chain = Chain()
    chain.block([reg(record(1)), reg(record(2))])
    header = chain.block()
    replica = CommitteeReplica(GENESIS)
    directory = replica.apply(*chain.serve(replica.since()), header.time_ms + SECOND)
    assert directory.height == 1 and replica.since() == 1
    assert {r.peer_id for r in directory.users()} == {who(1).peer_id, who(2).peer_id}
    assert directory.issued_at_ms == header.time_ms
    assert len(replica.last_changed) == 2

    chain.block([reg(record(3)), reg(record(1, issued=T0 + 1))])
    header = chain.block()
    directory = replica.apply(*chain.serve(replica.since()), header.time_ms + SECOND)
    assert directory.height == 3 and len(directory.records) == 3
    assert {r.peer_id for r in replica.last_changed} == {who(1).peer_id, who(3).peer_id}

    header = chain.block()  # an empty block: a fresher commit, the same records
    again = replica.apply(*chain.serve(replica.since()), header.time_ms + SECOND)
    assert again.records is directory.records and replica.last_changed == ()


def test_a_directory_signed_by_fewer_than_2f_plus_1_is_refused_and_the_view_kept():
    chain = Chain()
    chain.block([reg(record(1))])
    header = chain.block()
    replica = CommitteeReplica(GENESIS)
    good = replica.apply(*chain.serve(0), header.time_ms)
    chain.block([reg(record(2))])
    header = chain.block()
    _, _, pages = chain.serve(replica.since())
    with pytest.raises(InvalidCommitError, match="more than 2/3"):
        replica.apply(header, commit_for(header, KEYS[:2]), pages, header.time_ms)
    outsiders = [who(100 + i) for i in range(3)]
    with pytest.raises(InvalidCommitError):
        replica.apply(header, commit_for(header, outsiders), pages, header.time_ms)
    assert replica.directory is good and replica.since() == 1
    assert replica.apply(header, commit_for(header), pages, header.time_ms).height == 3


def test_a_rollback_a_stale_header_and_a_tampered_page_are_refused():
    chain = Chain()
    chain.block([reg(record(1))])
    old_header = chain.block()
    old_pages = chain.serve(0)[2]
    chain.block([reg(record(2))])
    header = chain.block()
    replica = CommitteeReplica(GENESIS, max_age_ms=30 * SECOND)
    replica.apply(*chain.serve(0), header.time_ms)
    with pytest.raises(DirectoryRollbackError):
        replica.apply(old_header, commit_for(old_header), old_pages, header.time_ms)
    with pytest.raises(ExpiredError):
        replica.apply(*chain.serve(replica.since()), header.time_ms + 31 * SECOND)
    chain.block([reg(record(3))])
    header = chain.block()
    _, commit, pages = chain.serve(replica.since())
    data = b"".join(p.data for p in pages)
    with pytest.raises(InvalidDirectoryError):  # the new record left out
        replica.apply(header, commit, [DeltaPage(0, True, data[:-200])], header.time_ms)
    assert replica.since() == 3
    assert replica.apply(header, commit, pages, header.time_ms).height == 5


# ---------------------------------------------------------------------------------- protocol


class LyingDirectoryService(CommitteeDirectoryService):
    """Serves the real header and pages with a commit cut to one signature, or (``forge``)
    the real commit over pages that list a record the committee never committed."""

    forge = False

    def snapshot(self, since_height):
        header, commit, pages = super().snapshot(since_height)
        if not self.forge:
            return header, commit[:1], pages
        data = b"".join(p.data for p in pages)
        forged = user_record(who(66), "/ip4/10.6.6.6/tcp/4001")
        from ps_p2p.consensus.encoding import lp, u8
        from ps_p2p.records.canonical import record_signing_bytes
        entry = u8(1) + lp(record_signing_bytes(forged)) + lp(forged.signature)
        return header, commit, iter([DeltaPage(0, True, data + entry)])


def user_record(identity: Identity, addr: str) -> NodeRecord:
    now = time.time_ns() // 1_000_000
    return sign_record(identity, NodeRecord(
        identity.peer_id, (addr,), frozenset({Role.USER}), ONION,
        issued_at_ms=now - 1000, expires_at_ms=now + 600_000))


async def test_a_node_registers_with_one_verifier_and_every_verifier_serves_it_committed(
        tmp_path):
    async with trio.open_nursery() as nursery:
        committee = LocalCommittee(nursery, tmp_path, 4)
        with trio.fail_after(30):
            await committee.start_all()
            services = []
            for i, m in enumerate(committee.members):
                cls = LyingDirectoryService if i == 0 else CommitteeDirectoryService
                service = cls(lambda m=m: m.service.validator.history,
                              lambda tx, m=m: m.service.submit_tx(app.encode_tx(tx)),
                              page_bytes=256)  # many pages even for a few records
                await nursery.start(service.serve, m.host)
                services.append(service)
            await committee.wait_committed(1)
            me = Identity.from_private_bytes(b"\x42" * 32)
            async with open_host(me, ["/ip4/127.0.0.1/tcp/0"]) as host:
                for m in committee.members:
                    await connect(host, listen_multiaddrs(m.host)[0])
                peers = [m.peer_id for m in committee.members]
                mine = user_record(me, "/ip4/127.0.0.1/tcp/4001")
                expires = await register_with_committee(host, peers[1], mine)
                assert expires == mine.expires_at_ms
                raw = await host.new_stream(ID(peers[1]), [COMMITTEE_DIRECTORY_PROTOCOL_ID])
                await raw.write(encode_frame(b"\x0a" * 5000))  # over the 4 KiB request bound
                with trio.fail_after(5), pytest.raises(StreamError):  # reset: this stream only
                    await raw.read(1)
                assert services[1].reset == 1
                other = user_record(who(7), "/ip4/127.0.0.1/tcp/4002")
                with pytest.raises(RemoteProtocolError, match="only its own record"):
                    await register_with_committee(host, peers[2], other)

                replica = CommitteeReplica(committee.genesis)
                with pytest.raises(InvalidCommitError, match="more than 2/3"):
                    await fetch_committed_directory(host, peers[0], replica,
                                                    now_ms=lambda: time.time_ns() // 1_000_000)
                assert replica.directory is None  # the lying verifier's answer changed nothing
                while True:  # listed once a block commits it, served one block later
                    directory = await fetch_committed_directory(
                        host, peers[3], replica, now_ms=lambda: time.time_ns() // 1_000_000)
                    if directory.record(me.peer_id) is not None:
                        break
                    h = committee.members[3].service.validator.committed_height
                    await committee.members[3].service.wait_committed(h + 1)
                assert directory.record(who(7).peer_id) is None
                assert replica.source == peers[3]
                assert all(m.service.validator.state.records.get(me.peer_id) is not None
                           for m in committee.members)  # relayed to every mempool
                services[0].forge = True  # the real commit over a forged record
                held = replica.directory
                await committee.members[0].service.wait_committed(
                    committee.members[0].service.validator.committed_height + 1)
                with pytest.raises(InvalidDirectoryError, match="app hash"):
                    await fetch_committed_directory(host, peers[0], replica,
                                                    now_ms=lambda: time.time_ns() // 1_000_000)
                assert replica.directory is held
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------- node


def test_a_verifier_outside_the_genesis_validator_set_is_a_config_error(tmp_path):
    members = [NodeKeys.generate() for _ in range(4)]
    path = write_genesis(tmp_path, members)
    config = NodeConfig(roles=["verifier"], genesis=str(path), home=str(tmp_path / "v"))
    with pytest.raises(ConfigError, match="not in the validator set"):
        Node(config, NodeKeys.generate())
    Node(config, members[2])  # a member is fine
    user = NodeConfig(roles=["user"], genesis=str(path),
                      bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + members[0].identity.peer_id_str])
    assert Node(user, NodeKeys.generate()).trusted_verifiers == {
        k.identity.peer_id for k in members}


def test_a_missing_genesis_file_is_a_config_error(tmp_path):
    config = NodeConfig(roles=["verifier"], genesis=str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="cannot read genesis"):
        Node(config, NodeKeys.generate())


async def test_users_of_a_committee_network_get_a_verified_directory_and_answers():
    async with open_localnet(users=6, committee=4) as net:
        assert len(net.verifiers) == 4
        for v in net.verifiers:
            assert v.consensus is not None and v.committee_directory is not None
            assert (v.config.home_path / "consensus.sqlite").is_file()
            assert "committed height" in status_line(v)
            status = v.committee_status()  # what `ps-node status` prints
            assert status["committed_height"] >= 1 and len(status["validators"]) == 4
            assert sum(x["connected"] for x in status["validators"]) >= 3
        assert net.users[0].committee_status() is None
        user = net.users[0]
        directory = user.directory
        assert user.genesis_file is not None and directory.height >= 1
        assert len(directory.users()) == 6 and len(directory.model_nodes()) == 1
        assert {r.peer_id for r in directory.records if Role.VERIFIER in r.roles} <= {
            v.peer_id for v in net.verifiers}
        view = user._client.replica.view
        assert view is not None and view.header is not None  # verified against a commit
        answer = await user.user.ask("Once upon a time there was a fox", timeout=30)
        assert answer.ok, answer.error
        assert answer.text == "xof a saw ereht emit a nopu ecnO"
        assert answer.served_by == net.models[0].peer_id


async def test_a_killed_verifier_stops_neither_registrations_nor_answers():
    async with open_localnet(users=6, committee=4) as net:
        dead = net.verifiers[1]
        await net.crash(dead)
        newcomer = await net.start_user()
        with trio.fail_after(30):
            for node in [newcomer, *net.users[:3]]:
                await node.wait_directory(min_users=7, min_models=1, timeout=30)
        assert newcomer.directory.record(newcomer.peer_id) is not None
        answer = await net.users[0].user.ask("a killed verifier", timeout=30)
        assert answer.ok, answer.error
        height = net.users[1].directory.height
        with trio.fail_after(10):  # the three left keep committing
            while net.users[1].directory.height <= height + 2:
                await net.users[1].wait_directory_update()
