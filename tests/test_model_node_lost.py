"""A model node that dies mid-request: its proxies tell the users whose reply tags wait for it
(RelayCore.destination_lost), and the request core moves the request to another model node of
the model, or fails it with ModelNodeLostError, once more than n - k proxies said so. Pure cores
on injected time; one service test on real hosts with a model node whose host is stopped."""

from __future__ import annotations

import pickle
import random

import pytest

from ps_p2p.errors import ModelNodeLostError, NoModelNodeError
from ps_p2p.overlay import relay as r
from ps_p2p.overlay.requests import RequestConfig, RequestCore, RequestDone, RequestSpec, SendClove
from ps_p2p.pb.planetserve.v1 import clove_pb2
from ps_p2p.protocols.clove_relay import ProtobufPayloadCodec
from test_relay_core import MODEL, PREV, _core as _relay_core, _proxy_path
from test_requests import READY, PickleCodec, _of, _serve, _verify_clove, _verify_reply

M1, M2 = b"model-node-M", b"model-node-N"


# ------------------------------------------------------------------ proxy: the relay core


def _deliver(core, path, tag, destination=MODEL, now=1.0):
    deliver = r.DeliverClove(destination, b"clove", tag)
    return core.receive_cell(PREV, path.first_path_id, path.seal_forward(pickle.dumps(deliver)), now)


def test_a_proxy_that_loses_a_model_node_tells_each_live_reply_tag_on_its_own_path():
    core, key = _relay_core()
    path_a, path_b = _proxy_path(key, core=core), _proxy_path(key, core=core)
    _deliver(core, path_a, b"a" * 16)
    _deliver(core, path_b, b"b" * 16)

    assert core.link_failed(MODEL, "disconnected", connected=False, now=2.0) == [
        r.CheckDestination(MODEL, "disconnected")]  # redialled first
    out = core.destination_checked(MODEL, False, "disconnected", now=3.0)

    told = {}
    for cell in out:
        assert isinstance(cell, r.SendCell) and cell.peer == PREV
        path = path_a if cell.path_id == path_a.first_path_id else path_b
        told[cell.path_id] = pickle.loads(path.open_backward(cell.payload))
    assert told == {
        path_a.first_path_id: r.DeliveryFailed("model node lost: disconnected", b"a" * 16),
        path_b.first_path_id: r.DeliveryFailed("model node lost: disconnected", b"b" * 16),
    }
    assert core.table.tag_count == 0  # told once: the tags are forgotten


def test_a_model_node_whose_connection_closed_but_that_is_redialled_keeps_its_reply_tags():
    """Under load a proxy's connection to a live model node can close (both ends replacing
    it) and the node answer over a new one a moment later: the proxy must not tell the user
    the node is lost, nor drop the tag the answer comes under (the multihost test's proxy
    did both: 2 such proxies of 4 failed a request with ModelNodeLostError)."""
    core, key = _relay_core()
    path = _proxy_path(key, core=core)
    _deliver(core, path, b"a" * 16)

    out = core.link_failed(MODEL, "StreamReset", connected=False, now=2.0)
    assert out == [r.CheckDestination(MODEL, "StreamReset")]
    assert core.link_failed(MODEL, "disconnected", connected=False, now=2.1) == []  # one check
    assert core.destination_checked(MODEL, True, "StreamReset", now=2.5) == []
    assert core.table.tag_count == 1

    reply = core.receive_reply(MODEL, b"a" * 16, b"answer", b"good", now=3.0)
    assert len(reply) == 1 and isinstance(reply[0], r.SendCell) and reply[0].peer == PREV
    assert pickle.loads(path.open_backward(reply[0].payload)) == r.SignedClove(
        b"answer", b"good", b"a" * 16)


def test_a_model_node_closed_again_after_a_good_check_is_checked_again():
    core, key = _relay_core()
    _deliver(core, _proxy_path(key, core=core), b"a" * 16)
    core.link_failed(MODEL, "reset", connected=False, now=2.0)
    core.destination_checked(MODEL, True, "reset", now=3.0)

    assert core.link_failed(MODEL, "reset", connected=False, now=4.0) == [
        r.CheckDestination(MODEL, "reset")]
    assert len(core.destination_checked(MODEL, False, "reset; redial: timeout", now=9.0)) == 1
    assert core.table.tag_count == 0


def test_a_check_without_an_outcome_loses_the_model_node_at_its_deadline():
    core, key = _relay_core(destination_check_timeout=15.0)
    _deliver(core, _proxy_path(key, core=core), b"a" * 16)
    core.link_failed(MODEL, "reset", connected=False, now=2.0)
    assert core.next_deadline() <= 17.0

    assert core.tick(16.9) == []
    told = core.tick(17.0)
    assert len(told) == 1 and isinstance(told[0], r.SendCell) and core.table.tag_count == 0
    assert core.destination_checked(MODEL, True, "reset", now=18.0) == []  # too late: no-op


def test_a_proxy_without_tags_for_a_closed_peer_checks_nothing():
    core, _key = _relay_core()
    assert core.link_failed(MODEL, "disconnected", connected=False, now=2.0) == []


def test_a_proxy_tells_nothing_while_a_connection_to_the_model_node_lives():
    core, key = _relay_core()
    _deliver(core, _proxy_path(key, core=core), b"a" * 16)

    assert core.link_failed(MODEL, "stream reset", connected=True, now=2.0) == []
    assert core.table.tag_count == 1


def test_spent_and_expired_tags_are_not_told():
    core, key = _relay_core(reply_tag_ttl=10.0)
    path = _proxy_path(key, core=core)
    _deliver(core, path, b"a" * 16, now=0.0)  # expires at 10
    _deliver(core, path, b"b" * 16, now=5.0)
    core.receive_reply(MODEL, b"b" * 16, b"answer", b"good", now=6.0)  # spent

    assert core.destination_lost(MODEL, "gone", now=11.0) == []


def test_the_failed_reply_tag_survives_the_wire_codec():
    codec = ProtobufPayloadCodec()
    message = r.DeliveryFailed("model node lost: disconnected", b"t" * 16)

    data = codec.encode_backward(message)

    assert codec.decode_backward(data) == message
    parsed = clove_pb2.BackwardPayload.FromString(data)
    assert parsed.WhichOneof("kind") == "delivery_failed" and parsed.delivery_failed_tag == b"t" * 16


# ------------------------------------------------------------------ user: the request core


def _core(model_nodes=(M1,)) -> RequestCore:
    return RequestCore(
        RequestConfig(total=4, threshold=3), PickleCodec(), lambda peer: peer in (M1, M2),
        rng=random.Random(3), random_bytes=random.Random(5).randbytes,
        verify_clove=_verify_clove, verify_reply=_verify_reply,
        model_nodes=lambda model_id: list(model_nodes) if model_id == "fake-model" else [],
    )


def _spec(**kw):
    return RequestSpec(b"r" * 16, M1, "fake-model", "tell me a story",
                       r_params(), 120.0, **kw)


def r_params():
    from ps_p2p.inference import SamplingParams

    return SamplingParams(max_tokens=100)


def _started(core, **kw):
    sent = _of(core.start(_spec(**kw), 0.0, READY), SendClove)
    assert len(sent) == 4 and {s.destination for s in sent} == {M1}
    return sent


def test_one_proxy_losing_the_model_node_still_leaves_k_cloves_to_wait_for():
    core = _core(model_nodes=(M1, M2))
    sent = _started(core)

    assert core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0) == []  # n - k = 1
    assert core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0) == []  # counted once
    assert core.tick(1.0, READY) == []  # still waiting for that model node
    assert core.attempts(b"r" * 16) == 1


def test_more_than_n_minus_k_lost_moves_the_request_to_another_model_node_at_once():
    core = _core(model_nodes=(M1, M2))
    sent = _started(core)

    assert core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0) == []
    assert core.delivery_failed(sent[1].reply_tag, sent[1].path_id, 1.0) == []
    resent = _of(core.tick(1.0, READY), SendClove)

    assert len(resent) == 4 and {s.destination for s in resent} == {M2}
    assert core.attempts(b"r" * 16) == 2
    # the other model node's answer ends the request
    replies = _serve(resent, signer=M2)
    from ps_p2p.overlay.requests import ResponseClove

    signed = [ResponseClove(c.path_id, c.clove, c.raw, b"signed by " + M2, c.reply_tag)
              for c in replies]
    done = [c for clove in signed for c in core.response_clove(clove, 2.0) if isinstance(c, RequestDone)]
    assert len(done) == 1 and done[0].outcome.ok and done[0].outcome.reply.model_node == M2


def test_a_late_notice_about_the_node_a_request_left_does_not_blame_the_new_one():
    """Found by the multi-host testnet (issue 20): a proxy whose dial of a vanished host timed
    out told its notice after the request had moved; it was counted against the new model
    node, which was then taken for lost too, and the request failed."""
    core = _core(model_nodes=(M1, M2))
    sent = _started(core)
    core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0)
    core.delivery_failed(sent[1].reply_tag, sent[1].path_id, 1.0)  # moves to M2 (next tick)

    assert core.delivery_failed(sent[2].reply_tag, sent[2].path_id, 1.2) == []  # about M1
    assert core.delivery_failed(sent[3].reply_tag, sent[3].path_id, 1.3) == []
    resent = _of(core.tick(1.5, READY), SendClove)
    assert len(resent) == 4 and {s.destination for s in resent} == {M2}


def test_with_no_other_model_node_the_request_fails_at_once_naming_the_lost_node():
    core = _core(model_nodes=(M1,))
    sent = _started(core)

    core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0)
    (done,) = core.delivery_failed(sent[1].reply_tag, sent[1].path_id, 1.5)

    assert isinstance(done, RequestDone)
    assert isinstance(done.outcome.error, ModelNodeLostError)
    assert "stopped answering (2 of 4 proxies lost it)" in str(done.outcome.error)
    assert done.outcome.latency == 1.5 and b"r" * 16 not in core


def test_a_request_for_a_named_model_node_fails_instead_of_moving():
    core = _core(model_nodes=(M1, M2))
    sent = _started(core, switch_model_node=False)

    core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0)
    (done,) = core.delivery_failed(sent[1].reply_tag, sent[1].path_id, 1.0)

    assert isinstance(done.outcome.error, ModelNodeLostError)


@pytest.mark.parametrize("wrong", ["tag", "path"])
def test_a_notice_under_an_unknown_tag_or_on_another_path_counts_for_nothing(wrong):
    core = _core(model_nodes=(M1,))
    sent = _started(core)

    for s in sent:
        tag = b"x" * 16 if wrong == "tag" else s.reply_tag
        path_id = s.path_id if wrong == "tag" else s.path_id + 100
        assert core.delivery_failed(tag, path_id, 1.0) == []

    assert b"r" * 16 in core and core.misrouted_cloves == 4


# ------------------------------------------------------------------ real hosts


async def test_a_model_node_killed_mid_request_is_replaced_then_reported_without_the_deadline():
    """Without the proxies' notices the request would wait for its 60 s attempt timeout and
    then resend to the same dead node until the 50 s deadline: it would fail."""
    import trio

    from ps_p2p.roles.user import UserConfig
    from ps_p2p.testing.fakes import InstantEngine
    from ps_p2p.testing.localnet import open_localnet

    gate = trio.Event()
    engines = [InstantEngine(gate=gate), InstantEngine(gate=gate)]
    config = UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=60.0)
    # no forwarding between the two model nodes: the request whose engine we hold must be the
    # one its entry node serves itself (a loaded machine could otherwise see the entry node
    # forward it, and the forwarder, not the user, replace the killed node: attempts == 1)
    async with open_localnet(
        users=6, models=2, engine_factory=lambda i: engines[i], user_config=config,
        forwarding=False,
    ) as net:
        asker = net.users[0].user
        answers = []

        async def ask() -> None:
            answers.append(await asker.ask("Once upon a time", timeout=50))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            # the first model node asked holds the request in service: kill it there
            entered: list[int] = []
            async with trio.open_nursery() as race:
                for i, engine in enumerate(engines):
                    race.start_soon(_first_entered, engine, i, race.cancel_scope, entered)
            first = entered[0]
            killed_at = trio.current_time()
            await net.crash(net.models[first])
            gate.set()  # the other model node answers at once
        (answer,) = answers
        assert answer.ok, answer.error
        # replaced because the proxies reported the node lost, not because an attempt's wait
        # ran out (a loaded machine may add an attempt when a path drops: attempts >= 2)
        assert answer.served_by == net.models[1 - first].peer_id and answer.attempts >= 2
        assert trio.current_time() - killed_at < config.attempt_timeout
        print(f"answered by the other model node {trio.current_time() - killed_at:.2f} s after the kill")

        # both dead (their records still listed): the next ask fails naming a lost node
        await net.crash(net.models[1 - first])
        started = trio.current_time()
        answer = await asker.ask("Once upon a time", timeout=50)
        assert not answer.ok and answer.error_type is ModelNodeLostError, answer.error
        assert "stopped answering" in answer.error
        print(f"failed {trio.current_time() - started:.2f} s after the ask: {answer.error}")


async def test_a_user_that_found_the_only_model_node_lost_sends_nothing_more_to_it():
    """Issue 21: after the only model node died, /v1/models listed it and requests went to it
    (502) until its record expired. Once a request found it lost (its record still listed),
    nothing is reachable and the next ask fails at once with "no model node" (the API's 503)."""
    import trio

    from ps_p2p.roles.user import UserConfig
    from ps_p2p.testing.fakes import InstantEngine
    from ps_p2p.testing.localnet import open_localnet

    gate = trio.Event()
    engine = InstantEngine(gate=gate)
    config = UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=60.0)
    async with open_localnet(
        users=6, models=1, engine_factory=lambda i: engine, user_config=config
    ) as net:
        asker = net.users[0].user
        answers = []

        async def ask() -> None:
            answers.append(await asker.ask("Once upon a time", timeout=50))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await engine.entered.wait()  # in service: kill it there
            await net.crash(net.models[0])
        (lost,) = answers
        assert lost.error_type is ModelNodeLostError, lost.error

        assert [r.peer_id for r in asker.model_nodes()] == [net.models[0].peer_id]  # listed
        assert asker.reachable_model_nodes() == []
        answer = await asker.ask("Once upon a time", timeout=50)
        assert answer.error_type is NoModelNodeError and answer.attempts == 0, answer.error


async def _first_entered(engine, index, scope, out) -> None:
    await engine.entered.wait()
    out.append(index)
    scope.cancel()


# ------------------------------------------------------------------ user: who is still reachable


def test_the_core_names_each_model_node_it_found_lost_once():
    core = _core(model_nodes=(M1,))
    sent = _started(core)

    core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0)
    assert core.take_lost_model_nodes() == []  # one proxy of four: not lost yet
    core.delivery_failed(sent[1].reply_tag, sent[1].path_id, 1.0)

    assert core.take_lost_model_nodes() == [M1]
    assert core.take_lost_model_nodes() == []


def _model_record(peer: bytes, issued_at_ms: int):
    from ps_p2p.records import NodeRecord, Role

    return NodeRecord(peer, (), frozenset({Role.MODEL}), b"k" * 32, model_id="fake-model",
                      capacity=2, issued_at_ms=issued_at_ms, expires_at_ms=issued_at_ms + 1)


def test_a_lost_model_node_is_left_out_until_it_renews_its_record():
    from ps_p2p.roles.user import reachable_model_nodes

    lost = {M1: 1000}
    same = [_model_record(M1, 1000), _model_record(M2, 1000)]
    renewed = [_model_record(M1, 31_000), _model_record(M2, 1000)]

    assert [r.peer_id for r in reachable_model_nodes(same, lost)] == [M2]
    assert [r.peer_id for r in reachable_model_nodes(renewed, lost)] == [M1, M2]
    assert lost == {}  # a renewed record clears the loss
