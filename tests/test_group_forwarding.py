"""A model node's forwarding service (ps_p2p.roles.forwarding) and its gossip wire
(ps_p2p.protocols.hrtree_gossip): checks of what peers send, and routing on the real cores."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ps_p2p.config import ForwardingConfig
from ps_p2p.engines.base import SamplingParams as EngineParams
from ps_p2p.engines.sim_cost import SimParams
from ps_p2p.engines.sim_engine import SimEngine
from ps_p2p.errors import ConfigError, InvalidSignatureError, RemoteProtocolError
from ps_p2p.gossip.load import LoadTracker
from ps_p2p.inference import InferenceQuery, SamplingParams
from ps_p2p.keys import Identity
from ps_p2p.protocols import hrtree_gossip as wire
from ps_p2p.records import Directory, NodeRecord, Role

FAST = SimParams(prefill_tokens_per_s=1e9, step_time=1e-6)
CONFIG = ForwardingConfig(group_key="11" * 32, chunk_default=4, load_max_age=1e9,
                          prefill_tokens_per_s=100.0)  # a slow engine: a cached prefix matters


def _node(identity: Identity, model_id: str = "sim") -> NodeRecord:
    return NodeRecord(identity.peer_id, (), frozenset({Role.MODEL}), b"\x00" * 32,
                      model_id=model_id, capacity=2, issued_at_ms=0, expires_at_ms=10**13)


def _directory(*nodes: NodeRecord) -> Directory:
    return Directory(1, 0, 10**13, tuple(sorted(nodes, key=lambda r: r.peer_id)))


def _forwarding(identity: Identity, clock=lambda: 0.0):
    from ps_p2p.roles.forwarding import GroupForwarding

    engine = SimEngine("sim", FAST)
    return GroupForwarding(identity, engine, LoadTracker(2, 8), CONFIG, clock=clock), engine


def _query(prompt: str, preferred: bytes = b"") -> InferenceQuery:
    return InferenceQuery(b"r" * 16, "sim", prompt, SamplingParams(max_tokens=2), (),
                          preferred_model_node=preferred)


A, B, C, OUTSIDER = (Identity.generate() for _ in range(4))


G = wire.group_of("sim")


def test_an_envelope_opens_only_under_its_publishers_key_for_its_group_and_unchanged():
    sealed = wire.seal(A, wire.KIND_LOAD, b"body", G)
    assert len(sealed) == len(b"body") + wire.ENVELOPE_OVERHEAD == 4 + 65
    assert wire.open_envelope(sealed, A.peer_id, G) == (wire.KIND_LOAD, b"body")
    with pytest.raises(InvalidSignatureError):
        wire.open_envelope(sealed, B.peer_id, G)
    with pytest.raises(InvalidSignatureError):  # the group is signed, not sent
        wire.open_envelope(sealed, A.peer_id, wire.group_of("another-model"))
    flipped = bytearray(sealed)
    flipped[-66] ^= 1  # inside the body
    with pytest.raises(InvalidSignatureError):
        wire.open_envelope(bytes(flipped), A.peer_id, G)
    other_kind = bytes([wire.KIND_DELTA]) + sealed[1:]  # the kind is signed too
    with pytest.raises(InvalidSignatureError):
        wire.open_envelope(other_kind, A.peer_id, G)
    for bad in (sealed[:-1], sealed + b"x", b"nonsense", sealed.replace(b"body", b"bodies"),
                b"\x07" + sealed[1:], sealed[:64]):
        with pytest.raises(RemoteProtocolError):
            wire.open_envelope(bad, A.peer_id, G)
    with pytest.raises(RemoteProtocolError, match="max"):
        wire.open_envelope(sealed, A.peer_id, G, max_bytes=len(sealed) - 1)


async def test_gossip_from_a_non_member_or_forged_or_replayed_is_dropped():
    me, _ = _forwarding(A)
    peer, _ = _forwarding(B)
    outsider, _ = _forwarding(OUTSIDER)
    me.set_directory(_directory(_node(A), _node(B), _node(OUTSIDER, "another-model")))
    assert me.members == {B.peer_id}  # a model node of another model is no member
    me.receive(OUTSIDER.peer_id, outsider.load_envelope())
    assert me.dropped == {"not_member": 1}
    me.receive(B.peer_id, wire.seal(OUTSIDER, wire.KIND_LOAD, b"x", G))  # not signed by B
    assert me.dropped["InvalidSignatureError"] == 1
    report = peer.load_envelope()
    me.receive(B.peer_id, report)
    assert me.book.get(B.peer_id) is not None
    me.receive(B.peer_id, report)  # the same report again: a replay
    assert me.dropped["load_replayed"] == 1
    me.receive(B.peer_id, outsider.load_envelope())  # B relaying another node's report
    assert me.book.get(B.peer_id).seq != 0 and sum(me.dropped.values()) == 4


async def test_a_prompt_cached_on_a_peer_is_routed_there_once_its_delta_and_load_arrive():
    me, _ = _forwarding(A)
    peer, engine = _forwarding(B)
    directory = _directory(_node(A), _node(B))
    me.set_directory(directory)
    peer.set_directory(directory)
    prefix = "system prompt shared by the tools, " * 8
    await engine.complete(prefix + "first question", EngineParams(max_tokens=2))
    assert peer.absorb_engine_events() > 0
    assert await me.route(_query(prefix + "second question")) is None  # nothing known yet
    for envelope in [peer.load_envelope(), *peer.delta_envelopes()]:
        me.receive(B.peer_id, envelope)
    assert await me.route(_query(prefix + "second question")) == B.peer_id
    assert me.decisions["cache_hit"] == 1
    # counted against B until its next report, once: our own send (issue 19, third session)
    assert me.book.get(B.peer_id).forwarded == 1
    assert await me.route(_query("an unrelated prompt, nothing cached anywhere")) is None


async def test_a_holder_with_a_free_slot_left_gets_the_next_prompt_of_its_prefix_too():
    """Role level (issue 19, third session): a forward counted once per entry node of the
    group (here 2) made B, with 2 slots and 1 request of ours, look full, and the next prompt
    of the prefix B holds was served here, uncached."""
    me, _ = _forwarding(A)
    peer, engine = _forwarding(B)
    directory = _directory(_node(A), _node(B))
    me.set_directory(directory)
    peer.set_directory(directory)
    prefix = "system prompt shared by the tools, " * 8
    await engine.complete(prefix + "first question", EngineParams(max_tokens=2))
    peer.absorb_engine_events()
    for envelope in [peer.load_envelope(), *peer.delta_envelopes()]:
        me.receive(B.peer_id, envelope)
    assert await me.route(_query(prefix + "second question")) == B.peer_id
    assert await me.route(_query(prefix + "third question")) == B.peer_id
    assert me.decisions == {"cache_hit": 2}


async def test_a_gap_in_a_peers_deltas_is_closed_by_its_snapshot():
    me, _ = _forwarding(A)
    peer, engine = _forwarding(B)
    directory = _directory(_node(A), _node(B))
    me.set_directory(directory)
    peer.set_directory(directory)
    await engine.complete("one prompt that fills some blocks " * 4, EngineParams(max_tokens=2))
    peer.absorb_engine_events()
    lost = peer.delta_envelopes()  # never delivered
    await engine.complete("another prompt with other blocks " * 4, EngineParams(max_tokens=2))
    peer.absorb_engine_events()
    for envelope in peer.delta_envelopes():
        me.receive(B.peer_id, envelope)
    assert lost and B.peer_id in me._need_snapshot
    me.apply_snapshot(B.peer_id, peer.snapshot_envelope())
    assert me.tree.prefixes(B.peer_id) == peer.tree.prefixes(B.peer_id)
    with pytest.raises(RemoteProtocolError):
        me.apply_snapshot(B.peer_id, peer.load_envelope())  # not a snapshot


async def test_the_node_publishes_its_load_on_a_meaningful_change_or_the_heartbeat_only():
    now = [0.0]
    me, _ = _forwarding(A, clock=lambda: now[0])
    peer, _ = _forwarding(B, clock=lambda: now[0])
    directory = _directory(_node(A), _node(B))
    me.set_directory(directory)
    peer.set_directory(directory)

    def tick(at: float) -> bytes | None:
        now[0] = at
        envelope = peer.load_envelope_due()
        if envelope is not None:
            me.receive(B.peer_id, envelope)
        return envelope

    assert tick(0.0) is not None  # the first report
    assert tick(1.0) is None  # nothing changed within the heartbeat (2 s)
    peer.load.try_admit()
    peer.load.start()  # one of its 2 slots busy: a change past the deadband (1/8 of C, >= 1)
    assert tick(1.5) is not None
    assert me.book.get(B.peer_id).reported_requests == 1
    assert tick(2.5) is None
    assert tick(3.5) is not None  # the heartbeat, 2 s after the last report
    assert me.dropped == {}  # each one accepted: its seq is above the last


async def test_a_malformed_or_oversized_delta_costs_that_message_only():
    from ps_p2p.gossip.hr_tree import DELTA_DOMAIN, MAX_DELTA_BYTES

    me, _ = _forwarding(A)
    peer, engine = _forwarding(B)
    directory = _directory(_node(A), _node(B))
    me.set_directory(directory)
    peer.set_directory(directory)
    await engine.complete("one prompt that fills some blocks " * 4, EngineParams(max_tokens=2))
    peer.absorb_engine_events()
    good = peer.router.take_deltas()[0].encode()
    group = wire.group_of("sim")
    bad = [
        good[:-3],  # truncated
        b"planetserve/v1/hrtree-delta-v2\x00" + good[len(DELTA_DOMAIN):],  # the old encoding
        good + b"\x00",  # trailing byte
        DELTA_DOMAIN + b"\x00" * (MAX_DELTA_BYTES + 1),  # oversized
    ]
    for body in bad:
        me.receive(B.peer_id, wire.seal(B, wire.KIND_DELTA, body, group))
    assert sum(me.dropped.values()) == len(bad) and me.tree.entries(B.peer_id) == 0
    me.receive(B.peer_id, wire.seal(B, wire.KIND_DELTA, good, group))  # the next one applies
    assert me.tree.prefixes(B.peer_id) == peer.tree.prefixes(B.peer_id)
    assert sum(me.dropped.values()) == len(bad)


def test_bad_forwarding_settings_are_config_errors():
    with pytest.raises(ConfigError, match="hex"):
        ForwardingConfig(group_key="zz").validate()
    with pytest.raises(ConfigError, match="bytes"):
        ForwardingConfig(group_key="11").validate()
    with pytest.raises(ConfigError, match="load_interval"):
        dataclasses.replace(CONFIG, load_interval=0).validate()
    with pytest.raises(ConfigError, match="chunk lengths"):
        dataclasses.replace(CONFIG, chunk_lengths=[0]).validate()
    assert CONFIG.key_bytes("m") != CONFIG.key_bytes("n")  # one secret, a key per model


def test_without_a_group_secret_forwarding_is_off_and_no_public_key_is_derived():
    import hashlib

    from ps_p2p.config import NodeConfig, new_group_key

    assert not ForwardingConfig().active and CONFIG.active
    ForwardingConfig().validate()  # allowed: the node serves every request itself
    with pytest.raises(ConfigError, match="group_key"):
        ForwardingConfig().key_bytes("sim")
    # what an outsider could derive from the model ID alone is not the key any more
    public = hashlib.sha256(b"planetserve/v1/hrtree-group-key\x00sim").digest()
    keys = {CONFIG.key_bytes("sim"), ForwardingConfig(group_key=new_group_key()).key_bytes("sim"),
            public}
    assert len(keys) == 3 and len(new_group_key()) == 64
    # a model node without one serves no forwarding or gossip protocol
    from ps_p2p.keys import NodeKeys
    from ps_p2p.node import Node

    node_config = NodeConfig(roles=["model"], model="sim",
                             bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + A.peer_id_str])

    node = Node(node_config, NodeKeys.generate(), SimEngine("sim", FAST))
    assert not node.protocol_ids & {str(p) for p in wire.GOSSIPSUB_PROTOCOLS}
    node_config.forwarding.group_key = new_group_key()
    assert {str(p) for p in wire.GOSSIPSUB_PROTOCOLS} <= node.protocol_ids


def test_an_untrusted_model_node_is_no_member_of_the_group():
    from ps_p2p.records.types import reputation_subject

    me, _ = _forwarding(A)
    directory = _directory(_node(A), _node(B), _node(C))
    scored = Directory(directory.height, directory.issued_at_ms, directory.expires_at_ms,
                       directory.records,
                       reputations={reputation_subject(B.peer_id): 0.1,
                                    reputation_subject(C.peer_id): 0.9})
    me.set_directory(scored)
    assert me.members == {C.peer_id}  # never a forwarding target nor a gossip source
    assert not me.is_member(B.peer_id)  # and its forwards are refused


def test_a_provisional_model_node_joins_the_group_only_while_no_node_is_proven():
    from ps_p2p.records.types import reputation_subject

    me, _ = _forwarding(A)
    directory = _directory(_node(A), _node(B), _node(C))

    def with_scores(scores: dict[bytes, float]) -> Directory:
        return Directory(directory.height, directory.issued_at_ms, directory.expires_at_ms,
                         directory.records, reputations=scores, verified=True)

    me.set_directory(with_scores({}))  # a new network: nobody scored, all provisional
    assert me.members == {B.peer_id, C.peer_id}
    me.set_directory(with_scores({reputation_subject(C.peer_id): 0.9}))
    assert me.members == {C.peer_id}  # B (a fresh identity) waits for its own score
    assert not me.is_member(B.peer_id)


async def test_a_failed_forward_stops_forwards_to_that_peer_until_its_penalty_ends():
    from ps_p2p.gossip.load import DEFAULT_PENALTY, ForwardOutcome

    now = [0.0]
    me, _ = _forwarding(A, clock=lambda: now[0])
    peer, _ = _forwarding(B)
    me.set_directory(_directory(_node(A), _node(B)))
    me.load.latency_ewma, me.load.queued = 1.0, 4  # this node is busy: B (idle) is better
    me.receive(B.peer_id, peer.load_envelope())
    assert await me.route(_query("first")) == B.peer_id
    me.forward_done(B.peer_id, ForwardOutcome.FAILED, 5.0)  # timed out, or did not verify
    assert me.ledger.refusal(B.peer_id, now[0], 2) == "penalty"
    now[0] = DEFAULT_PENALTY - 0.1
    me.receive(B.peer_id, peer.load_envelope())
    assert await me.route(_query("second")) is None
    now[0] = DEFAULT_PENALTY
    assert await me.route(_query("third")) == B.peer_id  # on probation again


async def test_the_capacity_a_peer_claims_is_held_to_the_one_its_record_lists():
    me, _ = _forwarding(A)
    me.set_directory(_directory(_node(A), _node(B)))  # B's record: capacity 2
    liar = LoadTracker(4096, 0)
    liar.latency_ewma, liar.queued = 1.0, 8  # 8 waiting: F_LB 8/4096 claimed, 8/2 in truth
    liar_gossip = _gossip_of(B, liar)
    me.receive(B.peer_id, liar_gossip.load_envelope())
    load = me.book.get(B.peer_id)
    assert me.ledger.judge(load, 1.0) == pytest.approx(1.0 * 8 / 2)


def _gossip_of(identity: Identity, tracker: LoadTracker):
    from ps_p2p.roles.forwarding import GroupForwarding

    return GroupForwarding(identity, SimEngine("sim", FAST), tracker, CONFIG)


# -- issue 19: tie-breaks and the tree's bound ---------------------------------------------------


async def test_on_a_miss_entry_nodes_do_not_all_pick_the_same_idle_peer():
    # finding 3: without a random tie-break every busy entry node forwarded a miss to the
    # lowest-ID idle peer
    peers = [Identity.generate() for _ in range(3)]
    reports = []
    for p in peers:
        f, _ = _forwarding(p)
        reports.append((p.peer_id, f.load_envelope()))
    chosen = set()
    for _ in range(24):
        entry = Identity.generate()
        me, _ = _forwarding(entry)
        me.load.in_service = me.load.capacity  # busy: a miss is worth a hop to an idle peer
        me.set_directory(_directory(_node(entry), *(_node(p) for p in peers)))
        for peer_id, envelope in reports:
            me.receive(peer_id, envelope)
        chosen.add(await me.route(_query("nothing cached anywhere " * 10)))
    assert None not in chosen and len(chosen) >= 2  # all three: probability 1 - 3 * (2/3)^24


def test_the_tree_bound_is_sized_from_the_engines_cache():
    # finding 4: 2**20 // 65 = 16,131 entries per peer was below one node's 18,750 blocks
    from ps_p2p.gossip.router import tree_limits
    from ps_p2p.gossip.sentry import ChunkLengths

    per_peer, total = tree_limits(ChunkLengths(0, (), 16), 18_750, 16, 64)
    assert per_peer >= 18_750 * 1.25 and total == per_peer * 65
    me, engine = _forwarding(A)
    assert me.router.per_peer == math.ceil(engine.params.cache_blocks * 4 * 1.25)  # 4-token chunks
    explicit = dataclasses.replace(CONFIG, cache_blocks=100)
    from ps_p2p.roles.forwarding import GroupForwarding

    sized = GroupForwarding(A, engine, LoadTracker(2, 8), explicit)
    assert sized.router.per_peer == 500


async def test_past_the_tree_bound_prefixes_are_counted_and_logged_not_dropped_silently(caplog):
    from ps_p2p.roles.forwarding import GroupForwarding

    tiny = dataclasses.replace(CONFIG, cache_blocks=2)  # 10 entries per peer
    engine = SimEngine("sim", FAST)
    me = GroupForwarding(A, engine, LoadTracker(2, 8), tiny)
    peer = GroupForwarding(B, SimEngine("sim", FAST), LoadTracker(2, 8), CONFIG)
    directory = _directory(_node(A), _node(B))
    me.set_directory(directory)
    peer.set_directory(directory)
    await engine.complete("x" * 200, EngineParams(max_tokens=1))
    with caplog.at_level("WARNING"):
        me.absorb_engine_events()  # our own subtree: over its bound
        await peer.engine.complete("y" * 200, EngineParams(max_tokens=1))
        peer.absorb_engine_events()
        for envelope in peer.delta_envelopes():
            me.receive(B.peer_id, envelope)  # a peer's subtree over our bound
    assert me.dropped["own_tree_full"] >= 1 and me.dropped["peer_tree_full"] == 1
    assert me.tree.entries(A) <= me.router.per_peer and me.tree.entries(B) == 0
    assert "own HR-subtree full" in caplog.text and "routed by load only" in caplog.text
    assert B.peer_id in me._need_snapshot  # asked again (paced) until it fits
