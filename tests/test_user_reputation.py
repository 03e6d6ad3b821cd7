"""Users act on the committed reputations (issue 9 part 4): they never send to an untrusted
model node, neither first nor as the replacement of a lost one, and prefer higher reputation
among nodes of the same model. Pure helpers, the request core's replacement choice, and the
user client with a real :class:`Directory` and a fake overlay (no network)."""

from __future__ import annotations

import collections
import math
import random

import pytest
import trio
from test_model_node_lost import _spec
from test_requests import READY, PickleCodec, _of, _verify_clove, _verify_reply
from test_user_client import FakeOverlay

from ps_p2p.config import UserConfig
from ps_p2p.errors import NoModelNodeError
from ps_p2p.overlay.requests import RequestConfig, RequestCore, SendClove
from ps_p2p.records import Directory, Membership, NodeRecord, Role, reputation_subject
from ps_p2p.roles.user import (
    UserClient,
    choose_model_node,
    choose_probation_node,
    probation_model_nodes,
    trusted_model_nodes,
)
from ps_p2p.testing.fakes import FakeUserClient

T0 = 1_700_000_000_000


ACME_KEY = b"\x00\x24\x08\x01\x12\x20" + b"\x0a" * 32  # acme's organization key (peer ID)


def model(name: bytes, model_id: str = "fake-model", org: str = "") -> NodeRecord:
    """A model node's record (unsigned: a Directory is trusted for its commit); naming ``org``,
    it is a member of ``ACME_KEY``'s organization."""
    membership = Membership(ACME_KEY, T0 + 1, bytes(64)) if org else None
    return NodeRecord(name, (), frozenset({Role.MODEL}), bytes(32), model_id, org,
                      issued_at_ms=T0, expires_at_ms=T0 + 1, membership=membership)


A, B, C, D = (model(b"model-" + bytes([x])) for x in b"ABCD")
E = model(b"model-E", org="acme")


def directory(*records: NodeRecord, verified: bool = False, **reputations: float) -> Directory:
    """``reputations``: by the record's last letter (``acme`` for the organization);
    ``verified``: the chain runs challenge epochs."""
    by_name = {r.peer_id[-1:].decode(): r for r in records}
    reps = {}
    for name, value in reputations.items():
        if name == "acme":
            reps[reputation_subject(b"", ACME_KEY)] = value
        else:
            reps[reputation_subject(by_name[name].peer_id)] = value
    return Directory(1, T0, T0 + 1, tuple(records), reps, untrusted_below=0.4,
                     initial_reputation=0.5, verified=verified)


def test_directory_trust_follows_the_committed_reputation_and_the_threshold():
    d = directory(A, B, C, E, A=0.39, B=0.4, acme=0.1)
    assert not d.trusted(A.peer_id) and d.reputation(A.peer_id) == 0.39
    assert d.trusted(B.peer_id)  # at the threshold: trusted
    assert d.trusted(C.peer_id) and d.reputation(C.peer_id) is None  # never scored
    assert d.reputation_or_initial(C.peer_id) == 0.5
    assert not d.trusted(E.peer_id)  # its organization's reputation
    assert d.trusted(b"unlisted") and d.reputation(b"unlisted") is None


def test_untrusted_model_nodes_are_left_out_and_the_rest_ranked_by_reputation():
    other = model(b"model-X", model_id="other")
    d = directory(A, B, C, D, E, other, A=0.2, B=0.6, D=0.9, acme=0.3)
    assert [r.peer_id for r in trusted_model_nodes(d, "fake-model")] == \
        [D.peer_id, B.peer_id, C.peer_id]  # 0.9, 0.6, unscored 0.5; A and E untrusted
    assert [r.peer_id for r in trusted_model_nodes(d)][-1] in (C.peer_id, other.peer_id)
    assert other.peer_id not in [r.peer_id for r in trusted_model_nodes(d, "fake-model")]


def test_a_fresh_identity_gets_no_requests_while_proven_nodes_serve_its_model():
    # issue 16: a node caught cheating comes back as a new identity (C, never scored)
    other = model(b"model-X", model_id="other")
    d = directory(A, B, C, other, verified=True, A=0.2, B=0.6)
    assert d.provisional(C.peer_id) and not d.trusted(C.peer_id)
    assert [r.peer_id for r in trusted_model_nodes(d, "fake-model")] == [B.peer_id]
    # a model nobody proved yet is still served by its provisional nodes
    assert [r.peer_id for r in trusted_model_nodes(d, "other")] == [other.peer_id]
    assert {r.peer_id for r in trusted_model_nodes(d)} == {B.peer_id, other.peer_id}


def test_provisional_nodes_serve_when_no_node_of_the_model_is_proven():
    d = directory(A, C, D, verified=True, A=0.2)  # a new network, or only a cheater scored
    assert [r.peer_id for r in trusted_model_nodes(d, "fake-model")] == [C.peer_id, D.peer_id]
    unverified = directory(A, C, D, A=0.2)  # no challenge epochs: never-scored is trusted
    assert not unverified.provisional(C.peer_id) and unverified.trusted(C.peer_id)


def test_the_choice_prefers_higher_reputation_in_proportion():
    d = directory(A, B, C, A=0.9, B=0.45)
    rng = random.Random(7)
    peers = [A.peer_id, B.peer_id, C.peer_id]
    counts = collections.Counter(choose_model_node(peers, d, rng) for _ in range(6000))
    # expected shares 0.9 : 0.45 : 0.5 (C unscored, at initial) of 1.85
    assert counts[A.peer_id] == pytest.approx(6000 * 0.9 / 1.85, rel=0.08)
    assert counts[B.peer_id] == pytest.approx(6000 * 0.45 / 1.85, rel=0.12)
    assert counts[A.peer_id] > counts[C.peer_id] > counts[B.peer_id]
    with pytest.raises(ValueError):
        choose_model_node([], d, rng)


def test_a_lost_model_node_is_replaced_by_the_users_choice_only():
    chosen: list[list[bytes]] = []

    def choose(peers):
        chosen.append(list(peers))
        return peers[-1]

    m1, m2, m3 = b"model-node-M", b"model-node-N", b"model-node-O"
    core = RequestCore(
        RequestConfig(total=4, threshold=3), PickleCodec(), lambda p: p in (m1, m2, m3),
        rng=random.Random(3), random_bytes=random.Random(5).randbytes,
        verify_clove=_verify_clove, verify_reply=_verify_reply,
        model_nodes=lambda model_id: [m1, m2, m3], choose_model_node=choose,
    )
    sent = _of(core.start(_spec(), 0.0, READY), SendClove)
    core.delivery_failed(sent[0].reply_tag, sent[0].path_id, 1.0)
    core.delivery_failed(sent[1].reply_tag, sent[1].path_id, 1.0)
    resent = _of(core.tick(1.0, READY), SendClove)
    assert chosen == [[m2, m3]]  # the lost one left out, the rest offered to the user's choice
    assert {s.destination for s in resent} == {m3}


async def test_a_user_never_sends_to_an_untrusted_model_node(autojump_clock):
    d = directory(A, B, A=0.1, B=0.2)
    client = UserClient(FakeOverlay(answer_probes=False), lambda: d, UserConfig(),
                        rng=random.Random(1))  # type: ignore[arg-type]
    assert client.model_nodes() == []
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        answer = await client.ask("hello", timeout=5.0)
        assert not answer.ok and isinstance(answer.exception, NoModelNodeError)
        named = await client.ask("hello", model_node=A.peer_id, timeout=5.0)  # asked by name
        assert not named.ok and isinstance(named.exception, NoModelNodeError)
        nursery.cancel_scope.cancel()
    d2 = directory(A, B, A=0.1)
    client2 = UserClient(FakeOverlay(answer_probes=False), lambda: d2, UserConfig(),
                         rng=random.Random(1))  # type: ignore[arg-type]
    assert [r.peer_id for r in client2.model_nodes()] == [B.peer_id]
    assert {client2._choose_model_node([B.peer_id]) for _ in range(5)} == {B.peer_id}


async def test_the_fake_user_client_follows_the_same_rule():
    d = directory(A, B, C, A=0.95, B=0.1, C=0.6)
    fake = FakeUserClient(lambda: d, [[b"relay-1", b"relay-2", b"proxy"]])
    answer = await fake.ask("hello")
    assert answer.ok and answer.served_by == A.peer_id  # the best trusted one
    assert B.peer_id not in [r.peer_id for r in fake.model_nodes()]


# ---------------------------------------------------------------------------------- model node


def test_an_untrusted_model_node_is_told_once_per_change_in_its_log_and_status(tmp_path, caplog):
    import logging

    from ps_p2p.config import NodeConfig
    from ps_p2p.keys import NodeKeys
    from ps_p2p.node import Node
    from ps_p2p.testing.fakes import InstantEngine

    keys = NodeKeys.generate()
    node = Node(NodeConfig(roles=["model"], home=str(tmp_path), model="fake",
                           bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + keys.identity.peer_id_str]),
                keys,
                InstantEngine())
    me = model(keys.identity.peer_id)
    assert node.reputation_status() == {"reputation": None, "trusted": True,
                                        "untrusted_below": None, "provisional": False}

    def install(reputation: float | None) -> list[str]:
        caplog.clear()
        reps = {} if reputation is None else {reputation_subject(me.peer_id): reputation}
        d = Directory(1, T0, T0 + 1, (me,), reps, untrusted_below=0.4)
        with caplog.at_level(logging.INFO, logger="ps_p2p.node"):
            node._note_own_trust(d)
        node.directory = d
        return [r.levelname + " " + r.getMessage() for r in caplog.records]

    assert install(None) == []  # never scored: trusted, nothing to say
    assert install(0.7) == []
    (warning,) = install(0.3)
    assert warning.startswith("WARNING") and "UNTRUSTED" in warning and "0.300" in warning
    assert install(0.25) == []  # still untrusted: told once
    assert node.reputation_status() == {"reputation": 0.25, "trusted": False,
                                        "untrusted_below": 0.4, "provisional": False}
    (info,) = install(0.45)
    assert info.startswith("INFO") and "trusted again" in info
    assert node.trusted is True


def test_a_model_node_never_scored_on_a_chain_with_epochs_is_told_it_is_provisional(
        tmp_path, caplog):
    import logging

    from ps_p2p.config import NodeConfig
    from ps_p2p.keys import NodeKeys
    from ps_p2p.node import Node
    from ps_p2p.testing.fakes import InstantEngine

    keys = NodeKeys.generate()
    node = Node(NodeConfig(roles=["model"], home=str(tmp_path), model="fake",
                           bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + keys.identity.peer_id_str]),
                keys, InstantEngine())
    me = model(keys.identity.peer_id)
    d = Directory(1, T0, T0 + 1, (me,), {}, untrusted_below=0.4, verified=True)
    with caplog.at_level(logging.INFO, logger="ps_p2p.node"):
        node._note_own_trust(d)
    node.directory = d
    (info,) = [r for r in caplog.records if r.name == "ps_p2p.node"]
    assert info.levelname == "INFO" and "provisional" in info.getMessage()
    assert node.reputation_status() == {"reputation": None, "trusted": False,
                                        "untrusted_below": 0.4, "provisional": True}


def test_ps_node_status_shows_a_model_nodes_trust(tmp_path, capsys):
    import json
    import time

    from ps_p2p import cli

    status = {
        "pid": 1, "peer_id": "12D3KooWTest", "roles": ["model"], "listen": [], "api": None,
        "directory": {"height": 7, "users": 5, "model_nodes": 2}, "ready_paths": 0,
        "committee": None, "written_at_ms": int(time.time() * 1000),
        "reputation": {"reputation": 0.123, "trusted": False, "untrusted_below": 0.4},
    }
    (tmp_path / "status.json").write_text(json.dumps(status))
    assert cli.main(["status", "--home", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reputation 0.123: UNTRUSTED (below 0.4)" in out
    status["reputation"] = {"reputation": 0.399999, "trusted": False, "untrusted_below": 0.4}
    (tmp_path / "status.json").write_text(json.dumps(status))
    assert cli.main(["status", "--home", str(tmp_path)]) == 0
    assert "reputation 0.399999: UNTRUSTED" in capsys.readouterr().out  # on probation
    status["reputation"] = {"reputation": None, "trusted": False, "untrusted_below": 0.4,
                            "provisional": True}
    (tmp_path / "status.json").write_text(json.dumps(status))
    assert cli.main(["status", "--home", str(tmp_path)]) == 0
    assert "reputation not scored: provisional" in capsys.readouterr().out


# ------------------------------------------------------------------------ probation traffic


def test_nodes_on_probation_are_the_untrusted_and_provisional_ones_of_the_model():
    other = model(b"model-X", model_id="other")
    d = directory(A, B, C, D, other, verified=True, A=0.2, B=0.6, D=0.3)
    # A and D untrusted, C provisional beside proven B; the other model's node is not asked
    assert [r.peer_id for r in probation_model_nodes(d, "fake-model")] == \
        [A.peer_id, C.peer_id, D.peer_id]
    assert probation_model_nodes(d, "other") == []  # its only node serves (provisional)
    assert probation_model_nodes(directory(A, B, A=0.9, B=0.5), "fake-model") == []


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_a_request_is_hedged_to_a_node_on_probation_at_the_configured_share(share):
    rng = random.Random(11)
    peers = [A.peer_id, D.peer_id]
    n = 20_000
    counts = collections.Counter(choose_probation_node(peers, share, rng) for _ in range(n))
    hedged = n - counts[None]
    sigma = (n * share * (1 - share)) ** 0.5
    assert abs(hedged - n * share) < 4 * sigma
    assert counts[A.peer_id] == pytest.approx(hedged / 2, rel=0.15)  # uniform, not by R


def test_no_hedge_without_a_share_or_a_node_on_probation():
    rng = random.Random(3)
    state = rng.getstate()
    assert choose_probation_node([], 1.0, rng) is None
    assert choose_probation_node([A.peer_id], 0.0, rng) is None
    assert rng.getstate() == state  # no draw: the user's other choices are unchanged
    assert {choose_probation_node([A.peer_id], 1.0, rng) for _ in range(20)} == {A.peer_id}


@pytest.mark.parametrize("bad", [{"probation_share": 1.5}, {"probation_share": -0.1},
                                 {"probation_share": math.nan}, {"probation_in_flight": -1}])
def test_probation_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="probation"):
        UserConfig(**bad)


async def test_an_untrusted_node_gets_hedged_user_requests_and_the_user_the_trusted_answer():
    """Issue 18: the untrusted node receives real users' requests at the configured share
    (here 1: every one), the same request as the trusted node's, and the user gets the
    trusted node's answer."""
    import dataclasses

    from ps_p2p.testing.fakes import InstantEngine
    from ps_p2p.testing.localnet import open_localnet

    trusted, untrusted = InstantEngine(), InstantEngine(reply_bytes=5)
    config = UserConfig(probe_interval=0.5, probe_timeout=2.0, attempt_timeout=5.0,
                        probation_share=1.0)
    async with open_localnet(users=6, models=2, engine_factory=[trusted, untrusted].__getitem__,
                             user_config=config, forwarding=False) as net:
        good, bad = net.models[0].peer_id, net.models[1].peer_id
        asker = net.users[0].user
        committed = asker._directory

        def with_reputations():  # the committee scored node 1 below the threshold
            d = committed()
            return None if d is None else dataclasses.replace(
                d, verified=True, reputations={reputation_subject(good): 0.9,
                                               reputation_subject(bad): 0.1})

        asker._directory = with_reputations
        assert [r.peer_id for r in asker.model_nodes()] == [good]
        prompts = [f"Once upon a time {i}" for i in range(6)]
        for i, prompt in enumerate(prompts):
            streamed: list[str] = []
            answer = await asker.ask(prompt, max_tokens=16, timeout=30,
                                     on_text=streamed.append if i % 2 else None)
            assert answer.ok and answer.served_by == good, answer.error
            assert answer.text == trusted.answer_for(prompt, 16)
        with trio.fail_after(30):
            while sum(v for k, v in asker.probation.items() if k not in ("sent", "skipped")) \
                    < len(prompts):
                await asker.wait_processed()
        assert asker.probation == {"sent": 6, "ok": 6}
        assert untrusted.calls == 6 and trusted.calls == 6
        assert asker.outcomes == {"ok": 6}  # hedges are not the user's requests

        asker.config = dataclasses.replace(config, probation_share=0.0)
        answer = await asker.ask("no hedge now", max_tokens=16, timeout=30)
        assert answer.ok and untrusted.calls == 6 and asker.probation["sent"] == 6
