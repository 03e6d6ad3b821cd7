"""/planetserve/directory/1.0.0 over real py-libp2p hosts on loopback."""

from __future__ import annotations

import dataclasses
import logging

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.network.config import RetryConfig
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

from ps_p2p import records
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import InvalidSignatureError, RemoteProtocolError
from ps_p2p.keys import Identity
from ps_p2p.pb.planetserve.v1 import directory_pb2, records_pb2
from ps_p2p.protocols import directory as dp
from ps_p2p.protocols.framing import encode_frame, encode_varint, read_frame
from ps_p2p.protocols.host import connect, listen_multiaddrs, open_host
from ps_p2p.records import NodeRecord, Role

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
NOW = 1_700_000_000_000
MINUTE = 60_000


class FakeClock:
    def __init__(self, now_ms: int = NOW) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def make_record(identity: Identity, *, issued: int = NOW, **fields) -> NodeRecord:
    base = dict(
        peer_id=identity.peer_id,
        addrs=("/ip4/127.0.0.1/tcp/4001",),
        roles=frozenset({Role.USER}),
        onion_key=OnionKeyPair.generate().public,
        issued_at_ms=issued,
        expires_at_ms=issued + 10 * MINUTE,
    )
    base.update(fields)
    return records.sign_record(identity, NodeRecord(**base))


@dataclasses.dataclass
class Net:
    verifier: Identity
    service: dp.DirectoryService
    verifier_host: object
    client: Identity
    client_host: object
    clock: FakeClock

    @property
    def trusted(self) -> frozenset[bytes]:
        return frozenset({self.verifier.peer_id})

    async def fetch(self, **kw):
        kw.setdefault("trusted_verifiers", self.trusted)
        kw.setdefault("quorum", 1)
        kw.setdefault("now_ms", self.clock.now_ms)
        return await dp.fetch_directory(self.client_host, self.verifier.peer_id, **kw)


@pytest.fixture
async def net():
    verifier, client = Identity.generate(), Identity.generate()
    clock = FakeClock()
    service = dp.DirectoryService(verifier, directory_lifetime_ms=2 * MINUTE, clock_ms=clock)
    async with open_host(verifier, [LOOPBACK]) as vhost, open_host(client, [LOOPBACK]) as chost:
        service.register_handlers(vhost)
        await connect(chost, listen_multiaddrs(vhost)[0])
        yield Net(verifier, service, vhost, client, chost, clock)


async def _open(net: Net):
    return await net.client_host.new_stream(ID(net.verifier.peer_id), [dp.DIRECTORY_PROTOCOL_ID])


async def _reply(stream) -> directory_pb2.DirectoryResponse:
    return directory_pb2.DirectoryResponse.FromString(
        await read_frame(stream, dp.MAX_RESPONSE_BYTES)
    )


# ---------------------------------------------------------------------------------- exchanges


async def test_register_then_fetch_round_trip(net):
    record = make_record(net.client, model_id="", organization="Lab", capacity=0)
    expires = await dp.register(net.client_host, net.verifier.peer_id, record)
    assert expires == record.expires_at_ms
    directory = await net.fetch()
    assert directory.records == (record,)
    assert directory.height == 1
    assert [s.verifier_id for s in directory.signatures] == [net.verifier.peer_id]
    assert directory.record(net.client.peer_id) == record


async def test_forged_record_is_refused_with_a_clear_error_and_service_keeps_serving(net):
    forged = dataclasses.replace(make_record(net.client), organization="forged")
    with pytest.raises(RemoteProtocolError, match="registration refused.*invalid signature"):
        await dp.register(net.client_host, net.verifier.peer_id, forged)
    assert len(net.service.registry) == 0
    record = make_record(net.client)
    await dp.register(net.client_host, net.verifier.peer_id, record)
    assert (await net.fetch()).records == (record,)


async def test_a_node_cannot_register_another_nodes_record(net):
    someone_else = make_record(Identity.generate())  # validly signed, but not by this client
    with pytest.raises(RemoteProtocolError, match="only its own record"):
        await dp.register(net.client_host, net.verifier.peer_id, someone_else)
    assert len(net.service.registry) == 0


async def test_expired_record_is_refused_with_a_clear_error(net):
    record = make_record(net.client, issued=NOW - 20 * MINUTE)
    with pytest.raises(RemoteProtocolError, match="expired"):
        await dp.register(net.client_host, net.verifier.peer_id, record)


async def test_one_stream_serves_several_requests(net):
    stream = await _open(net)
    record = make_record(net.client)
    register = directory_pb2.DirectoryRequest(register=dp.record_to_pb(record))
    get = directory_pb2.DirectoryRequest(get=directory_pb2.GetDirectory())
    await stream.write(encode_frame(register.SerializeToString()))
    ack = await _reply(stream)
    assert ack.ack.expires_at_ms == record.expires_at_ms
    await stream.write(encode_frame(get.SerializeToString()))
    reply = await _reply(stream)
    assert dp.page_from_pb(reply.page).records == (record,)
    await stream.close()


async def test_empty_request_gets_an_error_reply(net):
    stream = await _open(net)
    await stream.write(encode_frame(b""))
    reply = await _reply(stream)
    assert reply.WhichOneof("kind") == "error"
    assert reply.error.code == dp.ERROR_BAD_REQUEST
    await stream.close()


async def test_large_directory_is_fetched_and_verified(net):
    count = dp.THREAD_VERIFY_RECORDS + 44  # verified in a worker thread
    for _ in range(count):
        net.service.registry.register(make_record(Identity.generate()), NOW)
    directory = await net.fetch()
    assert len(directory.records) == count
    assert directory.height == count


# ---------------------------------------------------------------------------------- bad peers


async def _assert_stream_dropped(stream) -> None:
    # py-libp2p 0.8.1's Yamux reports a reset by the remote as end of stream (StreamEOF).
    with trio.fail_after(5), pytest.raises(StreamError):
        await stream.read(1)


async def test_malformed_frame_resets_one_stream_and_host_keeps_serving(net, caplog):
    good = await _open(net)
    bad = await _open(net)
    with caplog.at_level(logging.WARNING, logger="ps_p2p.protocols.directory"):
        await bad.write(encode_frame(b"\xff\xff\xff\xff"))
        await _assert_stream_dropped(bad)
    assert any("malformed DirectoryRequest" in r.getMessage() for r in caplog.records)
    get = directory_pb2.DirectoryRequest(get=directory_pb2.GetDirectory())
    await good.write(encode_frame(get.SerializeToString()))
    reply = await _reply(good)
    assert reply.WhichOneof("kind") == "page"
    assert (await net.fetch()).height == 0


async def test_oversized_frame_resets_the_stream_unread_and_host_keeps_serving(net, caplog):
    bad = await _open(net)
    with caplog.at_level(logging.WARNING, logger="ps_p2p.protocols.directory"):
        await bad.write(encode_varint(dp.MAX_REQUEST_BYTES + 1))  # the body never comes
        await _assert_stream_dropped(bad)
    assert any("exceeds the 4096-byte limit" in r.getMessage() for r in caplog.records)
    record = make_record(net.client)
    await dp.register(net.client_host, net.verifier.peer_id, record)
    assert (await net.fetch()).records == (record,)


async def test_frame_cut_short_resets_the_stream(net, caplog):
    bad = await _open(net)
    with caplog.at_level(logging.WARNING, logger="ps_p2p.protocols.directory"):
        await bad.write(encode_varint(100) + b"\x12\x00")
        await bad.close()  # half-close: EOF inside the frame
        await _assert_stream_dropped(bad)
    assert any("inside a frame" in r.getMessage() for r in caplog.records)
    assert (await net.fetch()).height == 0


async def test_plaintext_only_host_cannot_connect(net):
    identity = Identity.generate()
    key_pair = identity.libp2p_key_pair()
    plain = new_host(
        key_pair=key_pair, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)}
    )
    plain.get_network().retry_config = RetryConfig(max_retries=0)
    info = info_from_p2p_addr(multiaddr.Multiaddr(listen_multiaddrs(net.verifier_host)[0]))
    async with plain.run(listen_addrs=[multiaddr.Multiaddr(LOOPBACK)]):
        with trio.fail_after(10), pytest.raises(Exception, match="unable to connect"):
            await plain.connect(info)
        assert not net.verifier_host.get_network().get_connections(ID(identity.peer_id))
    assert (await net.fetch()).height == 0  # still serving the Noise client


async def test_directory_from_an_untrusted_verifier_is_refused(net):
    with pytest.raises(InvalidSignatureError, match="0 valid signature"):
        await net.fetch(trusted_verifiers=frozenset({Identity.generate().peer_id}))


async def test_directory_needs_the_quorum(net):
    other = Identity.generate().peer_id
    with pytest.raises(InvalidSignatureError):
        await net.fetch(trusted_verifiers=net.trusted | {other}, quorum=2)


# ---------------------------------------------------------------------------------- service core


def test_signed_head_is_cached_until_the_height_changes_or_half_its_lifetime():
    verifier = Identity.generate()
    service = dp.DirectoryService(verifier, directory_lifetime_ms=2 * MINUTE)
    first = service.signed_head(NOW)
    assert service.signed_head(NOW + MINUTE - 1) is first
    second = service.signed_head(NOW + MINUTE)
    assert second is not first and second.issued_at_ms == NOW + MINUTE
    service.registry.register(make_record(Identity.generate(), issued=NOW + MINUTE), NOW + MINUTE)
    third = service.signed_directory(NOW + MINUTE)
    assert third.height == 1 and len(third.records) == 1
    records.verify_directory(
        third, trusted_verifiers=frozenset({verifier.peer_id}), quorum=1, now_ms=NOW + MINUTE
    )
    assert service.heads_signed == 3


def test_signed_directory_drops_expired_records():
    service = dp.DirectoryService(Identity.generate())
    service.registry.register(make_record(Identity.generate()), NOW)
    assert len(service.signed_directory(NOW).records) == 1
    later = service.signed_directory(NOW + 10 * MINUTE)
    assert later.records == () and later.height == 2


def test_record_protobuf_round_trip():
    record = make_record(Identity.generate(), roles=frozenset({Role.MODEL, Role.USER}),
                         model_id="m", organization="o", capacity=3)
    wire = dp.record_to_pb(record).SerializeToString()
    assert dp.record_from_pb(records_pb2.NodeRecord.FromString(wire)) == record


@pytest.mark.parametrize("role", [0, 7])
def test_record_from_pb_refuses_unknown_roles(role):
    pb = dp.record_to_pb(make_record(Identity.generate()))
    pb.roles.append(role)
    with pytest.raises(RemoteProtocolError, match="role"):
        dp.record_from_pb(records_pb2.NodeRecord.FromString(pb.SerializeToString()))


def test_record_from_pb_refuses_oversized_fields():
    pb = dp.record_to_pb(make_record(Identity.generate()))
    pb.onion_key = bytes(64)
    with pytest.raises(RemoteProtocolError, match="onion key"):
        dp.record_from_pb(pb)
    pb = dp.record_to_pb(make_record(Identity.generate()))
    pb.addrs.extend([records.multiaddr_bytes("/ip4/1.1.1.1/tcp/1")] * 4)
    with pytest.raises(RemoteProtocolError, match="addresses"):
        dp.record_from_pb(pb)


def test_head_protobuf_round_trip():
    service = dp.DirectoryService(Identity.generate())
    service.registry.register(make_record(Identity.generate()), NOW)
    head = service.signed_head(NOW)
    wire = dp.head_to_pb(head).SerializeToString()
    assert dp.head_from_pb(records_pb2.DirectoryHead.FromString(wire)) == head


def test_head_from_pb_refuses_too_many_signatures():
    pb = records_pb2.DirectoryHead(height=1, root=bytes(32))
    for _ in range(dp.MAX_DIRECTORY_SIGNATURES + 1):
        pb.signatures.add(verifier_id=b"v", signature=b"s")
    with pytest.raises(RemoteProtocolError, match="signatures"):
        dp.head_from_pb(pb)


# ------------------------------------------------------------------------ size, pages, deltas

_DNS_100 = "/dns4/" + "a" * 63 + "." + "b" * 31 + "/tcp/1"  # 100 bytes in binary form


def max_record(identity: Identity, *, issued: int = NOW) -> NodeRecord:
    """A record with every field at its limit."""
    return make_record(
        identity, issued=issued,
        addrs=tuple(_DNS_100.replace("/tcp/1", f"/tcp/{i + 1}") for i in range(records.MAX_ADDRS)),
        roles=frozenset(Role), model_id="m" * records.MAX_MODEL_ID_BYTES,
        organization="o" * records.MAX_ORGANIZATION_BYTES, capacity=2**32 - 1,
    )


def _frame_body(frame: bytes) -> bytes:
    i = 0
    while frame[i] & 0x80:
        i += 1
    return frame[i + 1:]


def _spy_pages(service: dp.DirectoryService) -> list[bytes]:
    """Record every page frame the service sends."""
    frames: list[bytes] = []
    real = service.page

    def page(since_height: int, now_ms: int) -> bytes:
        frames.append(real(since_height, now_ms))
        return frames[-1]

    service.page = page
    return frames


def _pages(frames: list[bytes]) -> list[directory_pb2.DirectoryPage]:
    return [directory_pb2.DirectoryResponse.FromString(_frame_body(f)).page for f in frames]


def test_largest_record_is_under_1_kib_on_the_wire():
    record = max_record(Identity.generate())
    records.check_record(record, NOW)
    size = len(dp.record_to_pb(record).SerializeToString())
    assert 600 < size <= records.MAX_RECORD_WIRE_BYTES


async def test_2000_max_size_records_are_fetched_in_pages_under_the_frame_limit(net):
    count = 2000
    for _ in range(count):
        net.service.registry.register(max_record(Identity.generate()), NOW)
    frames = _spy_pages(net.service)
    directory = await net.fetch()
    assert len(directory.records) == count and directory.height == count
    assert all(len(f) <= dp.MAX_RESPONSE_BYTES for f in frames)
    whole = sum(len(dp.record_to_pb(r).SerializeToString()) for r in directory.records)
    assert whole > 5 * dp.MAX_RESPONSE_BYTES  # one frame could never hold it
    assert len(frames) >= whole // dp.MAX_RESPONSE_BYTES
    assert sum(len(p.records) for p in _pages(frames)) == count


async def test_renewal_without_change_does_not_bump_the_height(net):
    record = make_record(net.client)
    await dp.register(net.client_host, net.verifier.peer_id, record)
    replica = records.DirectoryReplica(trusted_verifiers=net.trusted, quorum=1)
    first = await net.fetch(replica=replica)
    heads = net.service.heads_signed
    net.clock.now_ms += 30_000
    renewal = records.sign_record(net.client, dataclasses.replace(
        record, issued_at_ms=net.clock.now_ms, expires_at_ms=net.clock.now_ms + 10 * MINUTE))
    expires = await dp.register(net.client_host, net.verifier.peer_id, renewal)
    assert expires == renewal.expires_at_ms
    assert net.service.registry.height == first.height == 1
    frames = _spy_pages(net.service)
    second = await net.fetch(replica=replica)
    assert second.height == first.height and second.records is first.records
    assert net.service.heads_signed == heads  # no new version, no new signature
    assert [len(p.records) for p in _pages(frames)] == [0]
    # the node stays listed past its first record's expiry, on the strength of its renewal
    net.clock.now_ms = record.expires_at_ms + 1
    assert (await net.fetch(replica=replica)).records == (record,)


async def test_delta_fetch_returns_only_changed_records(net):
    registry = net.service.registry
    peers = [Identity.generate() for _ in range(20)]
    held = {p.peer_id: make_record(p) for p in peers}
    for record in held.values():
        registry.register(record, NOW)
    leaving = make_record(Identity.generate(), expires_at_ms=NOW + MINUTE)
    registry.register(leaving, NOW)
    replica = records.DirectoryReplica(trusted_verifiers=net.trusted, quorum=1)
    await net.fetch(replica=replica)
    checks = replica.cache.checks
    changed = records.sign_record(peers[3], dataclasses.replace(
        held[peers[3].peer_id], capacity=5, issued_at_ms=NOW + 1))
    added = make_record(Identity.generate())
    registry.register(changed, NOW + 1)
    registry.register(added, NOW + 1)
    net.clock.now_ms = NOW + MINUTE  # ``leaving`` expires
    frames = _spy_pages(net.service)
    directory = await net.fetch(replica=replica)
    (page,) = _pages(frames)
    assert {bytes(r.peer_id) for r in page.records} == {changed.peer_id, added.peer_id}
    assert [bytes(p) for p in page.removed] == [leaving.peer_id]
    assert replica.cache.checks == checks + 2  # only the new records were verified
    assert directory.records == registry.records(net.clock.now_ms)
    assert directory.record(changed.peer_id) == changed
    assert directory.record(leaving.peer_id) is None


async def test_fetch_stays_consistent_while_the_directory_changes_between_pages():
    verifier, client = Identity.generate(), Identity.generate()
    clock = FakeClock()
    service = dp.DirectoryService(verifier, clock_ms=clock, max_response_bytes=20 * 1024)
    peers = [Identity.generate() for _ in range(100)]
    for p in peers:
        service.registry.register(max_record(p), NOW)
    frames: list[bytes] = []
    real = service.page

    def page(since_height: int, now_ms: int) -> bytes:
        if len(frames) == 1:  # between the first and second page: one change, one addition
            service.registry.register(max_record(peers[0], issued=NOW + 1), NOW + 1)
            service.registry.register(make_record(Identity.generate()), NOW + 1)
        frames.append(real(since_height, now_ms))
        return frames[-1]

    service.page = page
    async with open_host(verifier, [LOOPBACK]) as vhost, open_host(client, [LOOPBACK]) as chost:
        service.register_handlers(vhost)
        await connect(chost, listen_multiaddrs(vhost)[0])
        directory = await dp.fetch_directory(
            chost, verifier.peer_id, trusted_verifiers=frozenset({verifier.peer_id}),
            quorum=1, now_ms=NOW,
        )
    assert len(frames) >= 4
    assert directory.records == service.registry.records(NOW)
    assert directory.height == service.registry.height == 102


async def test_delta_from_a_verifier_that_restarted_falls_back_to_a_full_fetch(net):
    for _ in range(3):
        net.service.registry.register(make_record(Identity.generate()), NOW)
    replica = records.DirectoryReplica(trusted_verifiers=net.trusted, quorum=1)
    await net.fetch(replica=replica)
    net.service.registry = records.Registry()  # restarted: new records, heights from 0
    for _ in range(5):
        net.service.registry.register(make_record(Identity.generate()), NOW)
    directory = await net.fetch(replica=replica)
    assert directory.records == net.service.registry.records(NOW)
    assert replica.last_reset


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(addrs=(b"\xff\xff\x00",)), "not a multiaddr"),
        (dict(addrs=(records.multiaddr_bytes(_DNS_100) + b"\x00",)), "address of 101 bytes"),
        (dict(addrs=tuple(records.multiaddr_bytes(f"/ip4/10.0.0.{i}/tcp/1") for i in range(5))),
         "5 addresses"),
        (dict(organization="o" * 65), "organization of 65 UTF-8 bytes"),
        (dict(model_id="ø" * 33), "model ID of 66 UTF-8 bytes"),
    ],
)
async def test_oversized_or_non_multiaddr_field_is_refused_with_a_clear_error(net, fields, message):
    heads = net.service.heads_signed
    record = make_record(net.client, **fields)
    with pytest.raises(RemoteProtocolError, match=f"registration refused.*{message}"):
        await dp.register(net.client_host, net.verifier.peer_id, record)
    assert len(net.service.registry) == 0 and net.service.registry.height == 0
    assert net.service.heads_signed == heads
    assert (await net.fetch()).height == 0  # still serving


def test_record_from_pb_refuses_a_non_multiaddr_address():
    pb = dp.record_to_pb(make_record(Identity.generate()))
    pb.addrs[0] = b"\x04\x7f\x00"
    with pytest.raises(RemoteProtocolError, match="multiaddr"):
        dp.record_from_pb(pb)


def test_page_from_pb_refuses_too_many_entries():
    pb = directory_pb2.DirectoryPage(head=records_pb2.DirectoryHead(root=bytes(32)))
    pb.removed.extend([b"p"] * (dp.MAX_PAGE_ENTRIES + 1))
    with pytest.raises(RemoteProtocolError, match="entries"):
        dp.page_from_pb(pb)


def test_refresh_backs_off_while_nothing_changes_and_is_fast_after_a_change():
    from ps_p2p.node import directory_refresh_delay

    def delay(quiet: int, *, has_peers: bool = True, head_ttl: float | None = 120.0) -> float:
        return directory_refresh_delay(
            configured=5.0, quiet_refreshes=quiet, has_peers=has_peers, head_ttl=head_ttl
        )

    assert [delay(q) for q in range(6)] == [1.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert delay(0, has_peers=False) == 0.5
    assert delay(9, head_ttl=3.0) == 1.5  # refresh before the held head expires
