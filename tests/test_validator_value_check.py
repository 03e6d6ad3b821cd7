"""A validator's own check of an epoch report (Tendermint's valid(v)), with 4 validators in
memory on a fake clock: a lying leader's report never commits, an honest one does, and a check
still running defers the validator's answer instead of refusing the proposal."""

from __future__ import annotations

import hashlib

from ps_p2p import registry as app
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.types import Validator as Member
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.inference import InferenceReply
from ps_p2p.keys import Identity
from ps_p2p.records import NodeRecord, Role, sign_record
from ps_p2p.registry.validator import (
    VALUE_CHECK_PENDING,
)
from ps_p2p.responses import ResponseContent, request_hash, sign_response
from ps_p2p.testing.committee import MemoryCommittee
from ps_p2p.verification import epochs, ledger

CHAIN = "value-check-test"
T0 = 1_700_000_000_000
KEYS = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(4)]
BY_ADDRESS = {k.peer_id: k for k in KEYS}
POOL = [f"prompt {i}" for i in range(10)]
PARAMS = ledger.VerificationParams(model_id="m", pool_sha256=ledger.pool_digest(POOL),
                                   pool_size=len(POOL), attempt_ms=600_000)
GENESIS = app.Genesis(CHAIN, T0, tuple(Member(k.peer_id) for k in KEYS), verification=PARAMS)
FAST = ConsensusConfig(timeout_propose=0.2, timeout_prevote=0.2, timeout_precommit=0.2,
                       timeout_propose_delta=0.1, timeout_prevote_delta=0.1,
                       timeout_precommit_delta=0.1)
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public
MODELS = [Identity.from_private_bytes(hashlib.sha256(b"model %d" % i).digest()) for i in range(2)]
OWN_SCORE = 500_000  # what every validator's reference model gives every answer here


def secret(validator: bytes, epoch: int) -> bytes:
    return epochs.derive_secret(hashlib.sha256(b"master" + validator).digest(), CHAIN, epoch)


def setup_txs() -> list[bytes]:
    txs = []
    for i, m in enumerate(MODELS):
        rec = sign_record(m, NodeRecord(
            m.peer_id, (f"/ip4/10.0.0.{i + 1}/tcp/4001",), frozenset({Role.MODEL}), ONION,
            model_id="m", issued_at_ms=T0, expires_at_ms=T0 + 3_600_000))
        txs.append(app.encode_tx(app.RegisterTx(rec)))
    for k in KEYS:
        c = epochs.seed_commitment(CHAIN, 1, k.peer_id, secret(k.peer_id, 1))
        txs.append(app.encode_tx(ledger.sign_seed_commit(k, CHAIN, 1, c)))
    return txs


class Checks:
    """Each validator's value check: agrees when every score is OWN_SCORE +- the tolerance;
    ``pending`` validators answer VALUE_CHECK_PENDING until released."""

    def __init__(self, pending=(), agrees=()):
        self.pending = set(pending)
        self.agrees = set(agrees)  # the leader: it scored its own report
        self.asked: list[int] = []

    def of(self, i: int):
        def check(raw: bytes) -> str | None:
            self.asked.append(i)
            if i in self.pending:
                return VALUE_CHECK_PENDING
            if i in self.agrees:
                return None
            tx = app.decode_tx(raw, 1 << 20)
            for r in tx.results:
                if r.answer is not None and abs(r.score - OWN_SCORE) > PARAMS.tolerance * 1e6:
                    return f"score {r.score} is off this verifier's {OWN_SCORE}"
            return None
        return check


def Net(checks: Checks) -> MemoryCommittee:
    return MemoryCommittee(KEYS, GENESIS, consensus=FAST, value_check=checks.of)


def started_net(checks: Checks) -> MemoryCommittee:
    net = Net(checks)
    for tx in setup_txs():
        net.route(0, net.vals[0].add_tx(tx, net.now))
    assert net.run_until(lambda: all(v.state.ledger.started for v in net.vals), 30.0)
    return net


def leader_report(net: MemoryCommittee, score: int) -> bytes:
    state = net.vals[0].state
    lead = BY_ADDRESS[state.ledger.leader(0)]
    plan = state.ledger.plan(CHAIN, PARAMS, 0, secret(lead.peer_id, 1))
    results = []
    for c in plan.challenges:
        model = next(m for m in MODELS if m.peer_id == c.model_node)
        q = b"Q%d" % c.prompt_index
        rid = hashlib.sha256(q).digest()[:16]
        content = ResponseContent(0, "text", "", "m", 3, 5, "stop")
        at = state.ledger.start_ms + 10
        sig = sign_response(model, rid, request_hash(q), content, at)
        results.append(ledger.ChallengeResult(c, score, ledger.SignedAnswer(q, InferenceReply(
            rid, 0, "text", "", "m", 3, 5, request_hash(q), at, model.peer_id, sig, "stop"))))
    tx = ledger.sign_epoch_report(lead, CHAIN, 1, 0, secret(lead.peer_id, 1), results)
    return app.encode_tx(tx)


def submit(net: MemoryCommittee, raw: bytes) -> int:
    """Submit at the leader's own validator; returns its index."""
    i = next(j for j, v in enumerate(net.vals) if v.address == v.state.ledger.leader(0))
    net.route(i, net.vals[i].add_tx(raw, net.now))
    return i


def test_a_lying_leaders_report_never_commits_and_the_others_say_why():
    checks = Checks()
    net = started_net(checks)
    raw = leader_report(net, OWN_SCORE + 30_000)  # 0.03 off: over the 0.02 tolerance
    liar = next(j for j, v in enumerate(net.vals) if v.address == v.state.ledger.leader(0))
    checks.agrees.add(liar)  # it proposes its report whenever it is the proposer
    submit(net, raw)
    committed = net.run_until(lambda: any(v.state.ledger.epoch == 2 for v in net.vals), 20.0)
    assert not committed and all(v.state.ledger.epoch == 1 for v in net.vals)
    assert all(v.state.reputations == {} for v in net.vals)
    # the liar proposed it in its rounds; every other validator refused it on its own check
    for i, v in enumerate(net.vals):
        if i != liar:
            assert v.stats.values_refused > 0 and "off this verifier's" in v.stats.last_refusal
    # and the chain did not race: a refused report does not start heights back to back
    assert net.vals[0].height < 20.0 / 0.5 * 4


def test_an_honest_report_within_the_tolerance_commits_on_every_validator():
    net = started_net(Checks())
    submit(net, leader_report(net, OWN_SCORE + 15_000))  # 0.015 off: within 0.02
    assert net.run_until(lambda: all(v.state.ledger.epoch == 2 for v in net.vals), 20.0)
    hashes = {v.state.app_hash for v in net.vals}
    assert len(hashes) == 1
    assert len(net.vals[0].state.reputations) == 2


def test_a_check_still_running_defers_the_answer_instead_of_refusing_the_proposal():
    checks = Checks(pending={0, 1, 2, 3})
    net = started_net(checks)
    submit(net, leader_report(net, OWN_SCORE))
    # every validator has been asked (mempool admission starts the check) and nothing commits
    assert not net.run_until(lambda: any(v.state.ledger.epoch == 2 for v in net.vals), 3.0)
    assert set(checks.asked) == {0, 1, 2, 3}
    checks.pending.clear()
    for i, v in enumerate(net.vals):
        net.route(i, v.revalidate(net.now))
    assert net.run_until(lambda: all(v.state.ledger.epoch == 2 for v in net.vals), 20.0)
    assert all(v.stats.values_refused == 0 for v in net.vals)
