"""Verification epochs as the committee's application executes them: when an epoch starts, the
leader's report (revealed seed, plan, signed answers), misses, recent prompts and the ledger in
the app hash (:mod:`ps_p2p.verification.ledger` run by :mod:`ps_p2p.registry`); pure table
tests, no network, no engine."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ps_p2p import registry as app
from ps_p2p import responses
from ps_p2p.consensus.block import block_id, make_block
from ps_p2p.consensus.types import Validator
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import InvalidTransactionError, LocalProtocolError
from ps_p2p.inference import InferenceReply
from ps_p2p.keys import Identity
from ps_p2p.records import (
    NodeRecord,
    Role,
    record_subject,
    sign_membership,
    sign_record,
)
from ps_p2p.records.limits import MAX_CLOCK_SKEW_MS
from ps_p2p.verification import epochs, ledger
from ps_p2p.verification.ledger import (
    MICRO,
    SamplingOption,
    VerificationParams,
    pool_digest,
)
from ps_p2p.verification.reputation import ReputationState
from ps_p2p.verification.reputation import update as reputation_step
from ps_p2p.verification.sealing import open_request, seal_request

CHAIN = "planetserve-epochs"
T0 = 1_700_000_000_000  # genesis time, unix ms
SECOND = 1000
HOUR = 3600 * SECOND
ATTEMPT_MS = 60 * SECOND
ONION = OnionKeyPair.from_private_bytes(b"\x07" * 32).public


def ident(name: str) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(name.encode()).digest())


KEYS = [Identity.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
EXTRA_KEYS = [ident(f"validator {i}") for i in range(4, 6)]  # for the power property
VALIDATORS = tuple(Validator(k.peer_id) for k in KEYS)
BY_ADDRESS = {k.peer_id: k for k in KEYS + EXTRA_KEYS}
MASTERS = {k.peer_id: hashlib.sha256(b"master " + k.peer_id).digest() for k in BY_ADDRESS.values()}

M1, M2, M3 = ident("model node 1"), ident("model node 2"), ident("model node 3")
M4 = ident("model node 4")  # joins later
OTHER = ident("a model node of another model")
OUTSIDER = ident("never registered")
NODES = {n.peer_id: n for n in (M1, M2, M3, M4, OTHER, OUTSIDER)}
ORG = {M1.peer_id: "Lab", M2.peer_id: "Lab", M3.peer_id: "", M4.peer_id: "", OTHER.peer_id: ""}
LAB = ident("Lab's organization key")

POOL = [f"challenge prompt {i}" for i in range(40)]
MENU = (SamplingOption(), SamplingOption(max_tokens=32, temperature=0.7, top_p=0.9))
COMMITTEE_KEY = hashlib.sha256(b"test committee key").digest()
PARAMS = VerificationParams(
    model_id="m", pool_sha256=pool_digest(POOL), pool_size=len(POOL), sampling=MENU,
    challenges_per_node=2, max_nodes=8, attempt_ms=ATTEMPT_MS, recent_epochs=2, miss_epochs=2)
GENESIS = app.Genesis(CHAIN, T0, VALIDATORS, verification=PARAMS)
REP = GENESIS.reputation
TAU = app.to_micro(REP.tau)
#: the leader's scores of the six challenges of epoch 1, in plan order (two each of M1, M2, M3):
#: above, below and at tau, and a pair whose mean needs rounding
#: (every pair sums to 1 mod 4, so each subject's mean, over 2 or 4 answers, ends in .5)
SCORES = (900_000, 300_001, 650_002, 499_999, 500_000, 999_997)


def record(who: Identity, *, host: int, model_id: str = "m", org: str | None = None,
           roles=frozenset({Role.MODEL}), issued: int = T0) -> NodeRecord:
    """A model node's record; naming an organization, with LAB's membership certificate."""
    org = ORG.get(who.peer_id, "") if org is None else org
    membership = sign_membership(LAB, org, who.peer_id, issued + 48 * HOUR) if org else None
    return sign_record(who, NodeRecord(
        who.peer_id, (f"/ip4/10.0.0.{host}/tcp/4001",), roles, ONION, model_id=model_id,
        organization=org, capacity=4, issued_at_ms=issued, expires_at_ms=issued + 12 * HOUR,
        membership=membership))


def subject(peer: bytes) -> bytes:
    return record_subject(record(NODES[peer], host=1))


def reg(rec: NodeRecord) -> bytes:
    return app.encode_tx(app.RegisterTx(rec))


def model_regs() -> list[bytes]:
    """M1 and M2 (organization "Lab"), M3 (none), and OTHER, a model node of model "other"."""
    return [reg(record(M1, host=1)), reg(record(M2, host=2)), reg(record(M3, host=3)),
            reg(record(OTHER, host=4, model_id="other"))]


def secret(validator: bytes, epoch: int) -> bytes:
    master = MASTERS.get(validator, hashlib.sha256(b"master " + validator).digest())
    return epochs.derive_secret(master, CHAIN, epoch)


def commit(key: Identity, epoch: int, chain: str = CHAIN) -> bytes:
    c = epochs.seed_commitment(CHAIN, epoch, key.peer_id, secret(key.peer_id, epoch))
    return app.encode_tx(ledger.sign_seed_commit(key, chain, epoch, c))


def run(state: app.AppState, txs, time_ms: int | None = None, proposer: bytes | None = None):
    """Execute one block of ``txs`` on ``state`` (default: one second after it)."""
    time_ms = time_ms if time_ms is not None else state.time_ms + SECOND
    block = make_block(chain_id=CHAIN, height=state.height + 1, time_ms=time_ms,
                       prev_block_id=state.block_id, app_hash=state.app_hash,
                       proposer=proposer or state.genesis.validators[0].address, txs=txs)
    new, result = app.execute_block(state, block)
    return new, result, block


def errors(result) -> list[str | None]:
    return [None if r.ok else str(r.error) for r in result.tx_results]


def start_epoch_1(genesis: app.Genesis = GENESIS) -> app.AppState:
    """One block: the model nodes register, three of four validators commit for epoch 1."""
    state, result, _ = run(app.genesis_state(genesis),
                           model_regs() + [commit(k, 1) for k in KEYS[:3]])
    assert errors(result) == [None] * 7 and state.ledger.started
    return state


@pytest.fixture(scope="module")
def epoch1() -> app.AppState:
    return start_epoch_1()


# ---------------------------------------------------------------------- answers and reports


def request_for(c: epochs.Challenge) -> bytes:
    """A request Q for a challenge (any bytes: the value check, not this one, reads them)."""
    return b"Q|%d|%d|" % (c.prompt_index, c.sampling) + c.model_node


def answer(server: Identity, request: bytes, *, at: int, forwarded_by: Identity | None = None,
           voucher_signer: Identity | None = None, status: int = 0) -> ledger.SignedAnswer:
    """``server``'s signed answer to ``request`` at ``at`` (unix ms), with ``forwarded_by``'s
    voucher (signed by ``voucher_signer``, default ``forwarded_by``) when set."""
    request_id = hashlib.sha256(b"request id" + request).digest()[:16]
    req_hash = responses.request_hash(request)
    ok = status == 0
    content = responses.ResponseContent(status, "an answer" if ok else "",
                                        "" if ok else "engine failed", "m", 7, 12,
                                        "stop" if ok else "")
    signature = responses.sign_response(server, request_id, req_hash, content, at)
    fwd, voucher = b"", b""
    if forwarded_by is not None:
        fwd = forwarded_by.peer_id
        voucher = responses.sign_forward(voucher_signer or forwarded_by, request_id, req_hash,
                                         server.peer_id)
    return ledger.SignedAnswer(seal_request(COMMITTEE_KEY, req_hash, request), InferenceReply(
        request_id, content.status, content.text, content.error, content.model_id,
        content.prompt_tokens, content.completion_tokens, req_hash, at, server.peer_id,
        signature, content.finish_reason, fwd, voucher))


def leader_key(state: app.AppState, attempt: int = 0) -> Identity:
    return BY_ADDRESS[state.ledger.leader(attempt)]


def plan_of(state: app.AppState, attempt: int = 0) -> epochs.Plan:
    led = state.ledger
    return led.plan(CHAIN, state.genesis.verification, attempt,
                    secret(led.leader(attempt), led.epoch))


def results_for(state: app.AppState, attempt: int = 0, *, signed_at: int | None = None,
                unanswered=(), scores=SCORES) -> list[ledger.ChallengeResult]:
    """The honest results of the leader of ``attempt``: every challenge of its plan answered
    by the challenged node (``scores[k]`` for the k-th), except those of ``unanswered``."""
    signed_at = state.ledger.start_ms + SECOND if signed_at is None else signed_at
    out = []
    for k, c in enumerate(plan_of(state, attempt).challenges):
        if c.model_node in unanswered:
            out.append(ledger.ChallengeResult(c, 0))
        else:
            out.append(ledger.ChallengeResult(
                c, scores[k % len(scores)],
                answer(NODES[c.model_node], request_for(c), at=signed_at),
                greedy=MENU[c.sampling].temperature == 0))  # as its request was sent
    return out


def report(state: app.AppState, results, attempt: int = 0, *, by: Identity | None = None,
           secret_: bytes | None = None, epoch: int | None = None) -> bytes:
    """The encoded EPOCH_REPORT, signed by ``by`` (default: the leader of ``attempt``) with its
    secret for the epoch unless ``secret_`` is given."""
    by = by or leader_key(state, attempt)
    epoch = state.ledger.epoch if epoch is None else epoch
    secret_ = secret(by.peer_id, epoch) if secret_ is None else secret_
    return app.encode_tx(ledger.sign_epoch_report(by, CHAIN, epoch, attempt, secret_, results))


def miss(key: Identity, node: Identity, epoch: int = 1) -> bytes:
    return app.encode_tx(ledger.sign_miss_report(key, CHAIN, epoch, node.peer_id))


def mean_micro(scores: list[int]) -> int:
    """The mean rounded half up, written independently of the ledger's integer formula."""
    return math.floor(Fraction(sum(scores), len(scores)) + Fraction(1, 2))


def fresh_step(c_micro: int) -> app.ReputationEntry:
    """A never-scored subject's entry after one step at C = ``c_micro`` micro units."""
    return app.ReputationEntry.from_state(
        reputation_step(ReputationState.fresh(REP), c_micro / MICRO, REP))


def refused(state: app.AppState, tx: bytes, time_ms: int, match: str) -> None:
    """``tx`` is refused by the mempool and fails in a block at ``time_ms``, changing nothing."""
    with pytest.raises(InvalidTransactionError, match=match):
        app.check_tx(tx, state, time_ms)
    new, result, _ = run(state, [tx], time_ms)
    assert len(result.tx_results) == 1 and not result.tx_results[0].ok
    assert isinstance(result.tx_results[0].error, InvalidTransactionError)
    assert new.ledger.encode() == state.ledger.encode()
    assert result.reputation_changes == {} and new.reputations == state.reputations


def next_epoch(state: app.AppState, *, unanswered=()) -> tuple[app.AppState, app.BlockResult]:
    """Three validators commit for the next epoch, then the leader reports the current one: the
    next epoch starts at the end of the report's block."""
    e = state.ledger.epoch
    state, result, _ = run(state, [commit(k, e + 1) for k in KEYS[:3]])
    assert errors(result) == [None] * 3
    state, result, _ = run(state, [report(state, results_for(state, unanswered=unanswered))])
    assert errors(result) == [None]
    assert state.ledger.epoch == e + 1 and state.ledger.started
    return state, result


# ------------------------------------------------------------------------------- epoch start


def test_an_epoch_starts_after_the_first_block_with_two_thirds_committed_and_a_model_node():
    state, result, _ = run(app.genesis_state(GENESIS),
                           model_regs() + [commit(KEYS[0], 1), commit(KEYS[1], 1)])
    assert errors(result) == [None] * 6
    assert not state.ledger.started and state.ledger.epoch == 1  # 2 of 4: not > 2/3
    before = state.app_hash
    state, result, block = run(state, [commit(KEYS[2], 1)])
    led = state.ledger
    assert errors(result) == [None] and led.started and led.epoch == 1
    assert led.anchor == block_id(block.header) and led.start_ms == block.header.time_ms
    assert led.eligible == VALIDATORS[:3]  # the committers, not KEYS[3]
    # the model nodes of model "m" (not OTHER) with their subjects: M1 and M2 share "Lab"
    assert led.challenged == tuple(sorted((n.peer_id, subject(n.peer_id)) for n in (M1, M2, M3)))
    assert subject(M1.peer_id) == subject(M2.peer_id) != subject(M3.peer_id)
    assert state.app_hash != before
    # the next block does not move it
    later, _, _ = run(state, [commit(KEYS[3], 2)])
    assert later.ledger.anchor == led.anchor and later.ledger.start_ms == led.start_ms


def test_an_epoch_waits_for_a_model_node_of_the_verified_model():
    txs = [reg(record(OTHER, host=4, model_id="other")),
           reg(record(ident("a user"), host=5, roles=frozenset({Role.USER})))]
    state, result, _ = run(app.genesis_state(GENESIS), txs + [commit(k, 1) for k in KEYS])
    assert errors(result) == [None] * 6 and not state.ledger.started
    state, _, _ = run(state, [])
    assert not state.ledger.started
    state, result, block = run(state, [reg(record(M3, host=3))])
    assert state.ledger.started and state.ledger.anchor == block_id(block.header)
    assert state.ledger.challenged == ((M3.peer_id, subject(M3.peer_id)),)
    assert state.ledger.eligible == VALIDATORS


def test_a_sybil_naming_an_organization_cannot_move_the_organizations_reputation():
    """Issue 16: a node that writes "Lab" and answers badly once pulled Lab's shared
    reputation under the threshold. Without Lab's certificate it is refused; with a key of its
    own it is another organization, scored alone."""
    sybil = ident("a sybil naming Lab")
    free_text = sign_record(sybil, dataclasses.replace(
        record(sybil, host=9, org=""), organization="Lab"))
    state, result, _ = run(app.genesis_state(GENESIS), [reg(free_text)])
    assert errors(result) == ["malformed node record: names organization 'Lab' without a "
                              "membership certificate of its organization key"]
    impostor = ident("the sybil's own organization key")
    own_key = sign_record(sybil, dataclasses.replace(
        record(sybil, host=9, org=""), organization="Lab",
        membership=sign_membership(impostor, "Lab", sybil.peer_id, T0 + 48 * HOUR)))
    state, result, _ = run(app.genesis_state(GENESIS),
                           model_regs() + [reg(own_key)] + [commit(k, 1) for k in KEYS[:3]])
    assert errors(result) == [None] * 8 and state.ledger.started
    at = state.ledger.start_ms + SECOND
    nodes = {**NODES, sybil.peer_id: sybil}
    results = [ledger.ChallengeResult(c, 0 if c.model_node == sybil.peer_id else 900_000,
                                      answer(nodes[c.model_node], request_for(c), at=at))
               for c in plan_of(state).challenges]
    assert {r.challenge.model_node for r in results} >= {sybil.peer_id, M1.peer_id}
    state, result, _ = run(state, [report(state, results)])
    assert errors(result) == [None]
    assert state.reputation(subject(M1.peer_id)) == fresh_step(900_000)  # Lab: its own nodes
    assert state.reputation(record_subject(own_key)) == fresh_step(0)


def _forged_commit() -> bytes:
    c = epochs.seed_commitment(CHAIN, 1, KEYS[1].peer_id, secret(KEYS[1].peer_id, 1))
    unsigned = ledger.SeedCommitTx(KEYS[1].peer_id, 1, c)
    return app.encode_tx(dataclasses.replace(
        unsigned, signature=KEYS[0].sign(unsigned.signing_bytes(CHAIN))))


def _pending_state() -> app.AppState:
    """Epoch 1 not started: model nodes listed, KEYS[0] committed for epoch 1."""
    state, _, _ = run(app.genesis_state(GENESIS), model_regs() + [commit(KEYS[0], 1)])
    assert not state.ledger.started
    return state


@pytest.mark.parametrize("started, tx, match", [
    (False, lambda: commit(KEYS[1], 3), r"epoch 3; epoch 1 is not started \(accepted: \(1, 2\)\)"),
    (False, lambda: commit(KEYS[1], 0), "seed commitment for epoch 0"),
    (False, lambda: commit(KEYS[0], 1), "already committed a seed for epoch 1"),
    (False, lambda: commit(M1, 1), "not a validator"),
    (False, _forged_commit, "seed commitment is not signed by"),
    (False, lambda: commit(KEYS[1], 1, chain="another-chain"), "is not signed by"),
    (True, lambda: commit(KEYS[3], 1), r"epoch 1; epoch 1 is started \(accepted: \(2,\)\)"),
    (True, lambda: commit(KEYS[0], 3), "seed commitment for epoch 3"),
], ids=["two ahead", "past", "duplicate", "non-validator", "forged", "other chain",
        "already started", "two ahead of a started one"])
def test_seed_commitments_outside_the_epoch_rules_are_refused(started, tx, match, epoch1):
    state = epoch1 if started else _pending_state()
    refused(state, tx(), state.time_ms + SECOND, match)


def test_seed_commitments_for_the_current_and_the_next_epoch_are_accepted_once(epoch1):
    state = _pending_state()
    state, result, _ = run(state, [commit(KEYS[1], 2), commit(KEYS[1], 1), commit(KEYS[1], 2)])
    assert errors(result)[:2] == [None, None] and "already committed" in errors(result)[2]
    assert set(state.ledger.commitments) == {1, 2}
    state, result, _ = run(epoch1, [commit(KEYS[3], 2)])  # during epoch 1: for epoch 2
    assert errors(result) == [None] and KEYS[3].peer_id in state.ledger.commitments[2]


# ------------------------------------------------------------------------------ the report


def test_the_honest_leaders_report_steps_reputations_credits_and_ends_the_epoch(epoch1):
    time_ms = epoch1.ledger.start_ms + 10 * SECOND
    results = results_for(epoch1)
    assert len(results) == 6 and {r.challenge.model_node for r in results} == {
        M1.peer_id, M2.peer_id, M3.peer_id}  # two per node, OTHER is not of model "m"
    tx = report(epoch1, results)
    app.check_tx(tx, epoch1, time_ms)
    idle, _, _ = run(epoch1, [], time_ms)
    state, result, _ = run(epoch1, [tx], time_ms)
    assert errors(result) == [None]

    by_subject: dict[bytes, list[int]] = {}
    greedy: dict[bytes, list[int]] = {}
    for r in results:
        by_subject.setdefault(subject(r.challenge.model_node), []).append(r.score)
        if MENU[r.challenge.sampling].temperature == 0:
            greedy.setdefault(subject(r.challenge.model_node), []).append(r.score)
    assert len(by_subject[subject(M1.peer_id)]) == 4  # Lab: M1's and M2's answers
    # the lowest greedy score caps the mean
    expected = {s: fresh_step(min([mean_micro(v)] + greedy.get(s, [])))
                for s, v in by_subject.items()}
    assert result.reputation_changes == expected
    assert {s: state.reputation(s) for s in expected} == expected
    assert state.reputation_epoch == 1

    for n in (M1, M2, M3):
        scores = [r.score for r in results if r.challenge.model_node == n.peer_id]
        assert state.ledger.credits[n.peer_id] == ledger.Credit(
            answered=2, passed=sum(s >= TAU for s in scores), missed=0)
    assert sum(c.passed for c in state.ledger.credits.values()) == 4  # 500_000 passes

    led = state.ledger
    assert led.epoch == 2 and not led.started  # nobody committed for epoch 2 yet
    assert led.anchor is None and led.eligible == () and led.challenged == ()
    assert 1 not in led.commitments and led.misses == {}
    assert led.recent == {1: tuple(sorted(r.challenge.prompt_index for r in results))}
    assert state.app_hash != idle.app_hash and state.height == idle.height


def test_the_next_epoch_starts_in_the_reports_block_when_its_seeds_are_committed(epoch1):
    state, result, _ = run(epoch1, [commit(k, 2) for k in KEYS[1:]])
    time_ms = state.time_ms + SECOND
    state, result, block = run(state, [report(state, results_for(state))], time_ms)
    assert errors(result) == [None]
    assert state.ledger.epoch == 2 and state.ledger.started
    assert state.ledger.anchor == block_id(block.header) and state.ledger.start_ms == time_ms
    assert state.ledger.eligible == VALIDATORS[1:]


def test_the_next_epoch_waits_for_epoch_ms_of_block_time_after_the_last_start():
    spaced = dataclasses.replace(GENESIS, verification=dataclasses.replace(
        PARAMS, epoch_ms=10 * SECOND))
    state = start_epoch_1(spaced)
    first_start = state.ledger.start_ms
    state, result, _ = run(state, [commit(k, 2) for k in KEYS[:3]])
    state, result, _ = run(state, [report(state, results_for(state))], first_start + 2 * SECOND)
    assert errors(result) == [None]
    assert state.ledger.epoch == 2 and not state.ledger.started  # not yet: 2 s of 10
    state, _, _ = run(state, [], first_start + 10 * SECOND - 1)
    assert not state.ledger.started
    state, _, block = run(state, [], first_start + 10 * SECOND)
    assert state.ledger.started and state.ledger.anchor == block_id(block.header)
    assert state.ledger.start_ms == first_start + 10 * SECOND


# --------------------------------------------------------------------------- plan steering


def _unused_prompt(results) -> int:
    return min(set(range(len(POOL))) - {r.challenge.prompt_index for r in results})


def _answered(c: epochs.Challenge, score: int = 600_000) -> ledger.ChallengeResult:
    server = NODES[c.model_node]
    return ledger.ChallengeResult(c, score, answer(server, request_for(c), at=T0 + 2 * SECOND),
                                  greedy=MENU[c.sampling].temperature == 0)


def _swap_prompt(s):
    results = results_for(s)
    c = results[1].challenge
    results[1] = _answered(epochs.Challenge(c.model_node, _unused_prompt(results), c.sampling))
    return report(s, results)


def _swap_nodes(s):
    results = results_for(s)
    first, last = results[0].challenge, results[-1].challenge
    assert first.model_node != last.model_node
    results[0] = _answered(epochs.Challenge(last.model_node, first.prompt_index, first.sampling))
    results[-1] = _answered(epochs.Challenge(first.model_node, last.prompt_index, last.sampling))
    return report(s, results)


def _other_sampling(s):
    results = results_for(s)
    c = results[2].challenge
    results[2] = _answered(epochs.Challenge(c.model_node, c.prompt_index, 1 - c.sampling))
    return report(s, results)


def _added(s):
    results = results_for(s)
    results.append(_answered(epochs.Challenge(M3.peer_id, _unused_prompt(results))))
    return report(s, results)


def _node(who: Identity):
    def build(s):
        results = results_for(s)
        c = results[0].challenge
        results[0] = _answered(epochs.Challenge(who.peer_id, c.prompt_index, c.sampling))
        return report(s, results)
    return build


def _non_leader(s):
    other = next(k for k in KEYS[:3] if k.peer_id != s.ledger.leader(0))
    return report(s, results_for(s), by=other)


def _forged_signature(s):
    lead = leader_key(s)
    other = next(k for k in KEYS if k is not lead)
    tx = ledger.EpochReportTx(1, 0, lead.peer_id, secret(lead.peer_id, 1), tuple(results_for(s)))
    return app.encode_tx(dataclasses.replace(tx, signature=other.sign(tx.signing_bytes(CHAIN))))


STEERING = [
    ("another secret", lambda s: report(s, results_for(s), secret_=secret(s.ledger.leader(0), 2)),
     "revealed secret of .* does not open its commitment for epoch 1"),
    ("a prompt swapped", _swap_prompt, "differs from the committed one at challenge 1"),
    ("two nodes swapped", _swap_nodes, "differs from the committed one at challenge 0"),
    ("another sampling option", _other_sampling, "differs from the committed one at challenge 2"),
    ("a challenge removed", lambda s: report(s, results_for(s)[:-1]),
     "plan has 5 challenges, the committed one 6"),
    ("the first challenge removed", lambda s: report(s, results_for(s)[1:]),
     "differs from the committed one at challenge 0"),
    ("a challenge added", _added, "plan has 7 challenges, the committed one 6"),
    ("an unregistered node", _node(OUTSIDER), "which is not a registered model node"),
    ("a node of another model", _node(OTHER), "differs from the committed one at challenge 0"),
    ("a non-leader", _non_leader, "but .* leads epoch 1 attempt 0"),
    ("a forged leader signature", _forged_signature, "epoch report is not signed by"),
    ("a future attempt", lambda s: report(s, results_for(s, 1), 1),
     "report for attempt 1; at most 0 now"),
    ("another epoch", lambda s: report(s, results_for(s), epoch=2),
     "report for epoch 2; the current epoch is 1$"),
]


@pytest.mark.parametrize("build, match", [(b, m) for _, b, m in STEERING],
                         ids=[name for name, _, _ in STEERING])
def test_a_report_that_does_not_follow_the_committed_plan_is_refused(build, match, epoch1):
    refused(epoch1, build(epoch1), epoch1.ledger.start_ms + 10 * SECOND, match)


def test_a_report_before_the_epoch_starts_is_refused(epoch1):
    pending = _pending_state()
    tx = report(epoch1, results_for(epoch1))  # a valid report, on a chain where 1 has not started
    refused(pending, tx, pending.time_ms + SECOND, r"current epoch is 1 \(not started\)")


def test_a_later_attempts_leader_reports_after_attempt_ms_and_earlier_attempts_still_may(epoch1):
    start = epoch1.ledger.start_ms
    late = report(epoch1, results_for(epoch1, 1), 1)
    early = report(epoch1, results_for(epoch1, 0), 0)
    refused(epoch1, late, start + ATTEMPT_MS - 1, "report for attempt 1; at most 0 now")
    # attempt 1 draws its own plan (its seed names the attempt): attempt 0's plan is refused
    assert plan_of(epoch1, 1) != plan_of(epoch1, 0)
    refused(epoch1, report(epoch1, results_for(epoch1, 0), 1, by=leader_key(epoch1, 1)),
            start + ATTEMPT_MS, "differs from the committed one|plan has")
    for attempt, tx in ((1, late), (0, early)):
        state, result, _ = run(epoch1, [tx], start + ATTEMPT_MS)
        assert errors(result) == [None], attempt
        assert state.ledger.epoch == 2
        assert state.ledger.recent[1] == tuple(
            sorted(c.prompt_index for c in plan_of(epoch1, attempt).challenges))
    # Observed: once attempt 1 is under way, attempt 0's leader may still report, and whichever
    # report comes first in block order ends the epoch; the other one is then for a past epoch.
    state, result, _ = run(epoch1, [early, late], start + ATTEMPT_MS)
    assert errors(result)[0] is None and "report for epoch 1; the current epoch is 2" in \
        errors(result)[1]
    assert state.ledger.recent[1] == tuple(
        sorted(c.prompt_index for c in plan_of(epoch1, 0).challenges))


# ------------------------------------------------------------------------------ the answers


def _m1_slot(s) -> int:
    return next(k for k, c in enumerate(plan_of(s).challenges) if c.model_node == M1.peer_id)


def _with_answer(make):
    """A report whose first challenge of M1 carries ``make(challenge, state)`` as answer."""
    def build(s):
        results = results_for(s)
        k = _m1_slot(s)
        c = results[k].challenge
        results[k] = dataclasses.replace(results[k], answer=make(c, s))
        return report(s, results)
    return build


def _changed(a: ledger.SignedAnswer, **reply_fields) -> ledger.SignedAnswer:
    """``a`` with other reply fields (after it was signed)."""
    return ledger.SignedAnswer(a.sealed_request, dataclasses.replace(a.reply, **reply_fields))


def _at(c, s) -> int:
    return s.ledger.start_ms + SECOND


BAD_ANSWERS = [
    ("signed by another node", _with_answer(
        lambda c, s: answer(M2, request_for(c), at=_at(c, s))),
     "answer signed by .*, not by the challenged .* nor forwarded by it"),
    ("a forged voucher", _with_answer(
        lambda c, s: answer(M3, request_for(c), at=_at(c, s), forwarded_by=M1,
                            voucher_signer=M3)),
     "forward voucher of .* does not verify"),
    ("a voucher for another request", _with_answer(
        lambda c, s: _changed(
            answer(M3, request_for(c), at=_at(c, s), forwarded_by=M1),
            forward_signature=answer(M3, b"another Q", at=_at(c, s),
                                     forwarded_by=M1).reply.forward_signature)),
     "forward voucher of .* does not verify"),
    ("forwarded outside the challenged set", _with_answer(
        lambda c, s: answer(OTHER, request_for(c), at=_at(c, s), forwarded_by=M1)),
     "answer served by .*, not a challenged model node"),
    ("text changed after signing", _with_answer(
        lambda c, s: _changed(answer(M1, request_for(c), at=_at(c, s)), text="x")),
     "answer not signed by"),
    ("another request hash", _with_answer(
        lambda c, s: _changed(answer(M1, request_for(c), at=_at(c, s)),
                              request_hash=responses.request_hash(b"another Q"))),
     "answer not signed by"),
    ("the server's own answer with a voucher", _with_answer(
        lambda c, s: _changed(answer(M1, request_for(c), at=_at(c, s)),
                              forwarded_by=M2.peer_id, forward_signature=b"v" * 64)),
     "an answer served by the challenged node has a voucher"),
    ("signed before the epoch", _with_answer(
        lambda c, s: answer(M1, request_for(c), at=s.ledger.start_ms - MAX_CLOCK_SKEW_MS - 1)),
     r"response signed at \d+ ms, before its epoch began"),
    ("signed after the report's block", _with_answer(
        lambda c, s: answer(M1, request_for(c),
                            at=s.ledger.start_ms + 10 * SECOND + MAX_CLOCK_SKEW_MS + 1)),
     r"response signed at \d+ ms, after its epoch ended"),
    ("status not OK", _with_answer(
        lambda c, s: answer(M1, request_for(c), at=_at(c, s), status=2)),
     "answer of status 2, not OK"),
]


@pytest.mark.parametrize("build, match", [(b, m) for _, b, m in BAD_ANSWERS],
                         ids=[name for name, _, _ in BAD_ANSWERS])
def test_a_report_with_an_answer_that_does_not_verify_is_refused(build, match, epoch1):
    refused(epoch1, build(epoch1), epoch1.ledger.start_ms + 10 * SECOND,
            "challenge of .* prompt \\d+: " + match)


def test_an_unanswered_challenge_with_a_score_is_refused(epoch1):
    results = results_for(epoch1)
    k = _m1_slot(epoch1)
    results[k] = ledger.ChallengeResult(results[k].challenge, 1)
    refused(epoch1, report(epoch1, results), epoch1.ledger.start_ms + 10 * SECOND,
            "an unanswered challenge must score 0")


@pytest.mark.parametrize("skew", [-MAX_CLOCK_SKEW_MS, MAX_CLOCK_SKEW_MS])
def test_answers_signed_within_the_clock_skew_of_the_epoch_are_accepted(skew, epoch1):
    time_ms = epoch1.ledger.start_ms + 10 * SECOND
    signed_at = (epoch1.ledger.start_ms if skew < 0 else time_ms) + skew
    tx = report(epoch1, results_for(epoch1, signed_at=signed_at))
    state, result, _ = run(epoch1, [tx], time_ms)
    assert errors(result) == [None] and state.ledger.epoch == 2


def test_a_forwarded_answer_counts_for_the_challenged_node_and_for_the_server(epoch1):
    """Issue 18, finding 5: a node that forwards its challenge to a peer answers for it (it
    chose the peer), and the peer that served it is scored too."""
    results = results_for(epoch1)
    k = _m1_slot(epoch1)
    c = results[k].challenge
    at = epoch1.ledger.start_ms + SECOND
    results[k] = dataclasses.replace(results[k], answer=answer(M3, request_for(c), at=at,
                                                               forwarded_by=M1), score=0)
    state, result, _ = run(epoch1, [report(epoch1, results)], at + 9 * SECOND)
    assert errors(result) == [None]
    credits = state.ledger.credits
    assert (credits[M1.peer_id].answered, credits[M2.peer_id].answered,
            credits[M3.peer_id].answered) == (2, 2, 3)
    # (node, score, greedy) of every answer, the forwarded one for both M1 and M3
    counted = [(r.challenge.model_node, r.score, MENU[r.challenge.sampling].temperature == 0)
               for r in results] + [(M3.peer_id, 0, MENU[c.sampling].temperature == 0)]
    expected = {}
    for s in {subject(n) for n, _, _ in counted}:
        mine = [(v, g) for n, v, g in counted if subject(n) == s]
        expected[s] = fresh_step(min([mean_micro([v for v, _ in mine])]
                                     + [v for v, g in mine if g]))
    assert result.reputation_changes == expected
    # the forwarded answer's 0 reaches the challenged node's subject
    assert result.reputation_changes[subject(M1.peer_id)].window[0] < fresh_step(
        mean_micro([r.score for r in results_for(epoch1)
                    if subject(r.challenge.model_node) == subject(M1.peer_id)])).window[0]


def test_a_score_above_one_million_micro_units_is_refused_at_decode(epoch1):
    tx = report(epoch1, results_for(epoch1))
    # the first result's score: domain, kind, epoch, attempt, leader, secret, count, node,
    # prompt index, sampling option
    offset = len(app.TX_DOMAIN) + 1 + 8 + 4 + (4 + 38) + (4 + 32) + 4 + (4 + 38) + 4 + 4
    assert struct.unpack(">I", tx[offset:offset + 4])[0] == results_for(epoch1)[0].score
    for score, ok in ((MICRO, True), (MICRO + 1, False), (2**32 - 1, False)):
        raw = tx[:offset] + struct.pack(">I", score) + tx[offset + 4:]
        if ok:
            decoded = app.decode_tx(raw, 8192)
            assert decoded.results[0].score == MICRO
        else:
            with pytest.raises(InvalidTransactionError, match=f"score {score} micro units"):
                app.decode_tx(raw, 8192)
            with pytest.raises(InvalidTransactionError, match="outside \\[0, 1\\]"):
                app.check_tx(raw, epoch1, epoch1.time_ms)


# ----------------------------------------------------------------------------------- misses


@pytest.fixture(scope="module")
def missed() -> tuple[app.AppState, app.BlockResult]:
    """Epoch 1 reported with M3's challenges unanswered; epoch 2 started."""
    state, _, _ = run(start_epoch_1(), [commit(k, 2) for k in KEYS[:3]])
    results = results_for(state, unanswered={M3.peer_id})
    state, result, _ = run(state, [report(state, results)])
    assert errors(result) == [None] and state.ledger.epoch == 2
    return state, result


def _epoch1_leader(state: app.AppState) -> bytes:
    return next(iter(state.ledger.misses[(1, M3.peer_id)]))


def test_an_unanswered_challenge_costs_nothing_by_the_leaders_report_alone(missed):
    state, result = missed
    assert subject(M3.peer_id) not in result.reputation_changes
    assert state.reputation(subject(M3.peer_id)) is None
    assert set(result.reputation_changes) == {subject(M1.peer_id)}
    assert state.ledger.open_misses() == [(1, M3.peer_id)]
    assert len(state.ledger.misses[(1, M3.peer_id)]) == 1  # the leader's own report
    assert M3.peer_id not in state.ledger.credits


def test_a_second_validators_miss_report_steps_the_subject_at_zero_once(missed):
    state, _ = missed
    lead = _epoch1_leader(state)
    second, third = [k for k in KEYS if k.peer_id != lead][:2]
    state, result, _ = run(state, [miss(second, M3)])
    assert errors(result) == [None]
    assert result.reputation_changes == {subject(M3.peer_id): fresh_step(0)}
    assert state.ledger.credits[M3.peer_id] == ledger.Credit(0, 0, 1)
    assert state.ledger.open_misses() == []
    reputations = dict(state.reputations)
    state, result, _ = run(state, [miss(third, M3)])  # recorded, counted already
    assert errors(result) == [None] and result.reputation_changes == {}
    assert state.reputations == reputations
    assert state.ledger.credits[M3.peer_id].missed == 1
    assert len(state.ledger.misses[(1, M3.peer_id)]) == 3


def test_a_miss_report_by_a_validator_that_did_not_commit_counts(missed):
    state, _ = missed
    assert KEYS[3].peer_id not in {v.address for v in start_epoch_1().ledger.eligible}
    state, result, _ = run(state, [miss(KEYS[3], M3)])
    assert errors(result) == [None] and subject(M3.peer_id) in result.reputation_changes


def _forged_miss(state: app.AppState) -> bytes:
    tx = ledger.MissReportTx(KEYS[3].peer_id, 1, M3.peer_id)
    return app.encode_tx(dataclasses.replace(tx, signature=KEYS[0].sign(tx.signing_bytes(CHAIN))))


@pytest.mark.parametrize("build, match", [
    (lambda s: miss(KEYS[3], M1), "has no open miss in epoch 1"),
    (lambda s: miss(KEYS[3], OUTSIDER), "has no open miss in epoch 1"),
    (lambda s: miss(KEYS[3], M3, epoch=2), "has no open miss in epoch 2"),
    (lambda s: miss(BY_ADDRESS[_epoch1_leader(s)], M3), "already reported it"),
    (lambda s: miss(M1, M3), "miss report from .*, not a validator"),
    (_forged_miss, "miss report is not signed by"),
], ids=["answered node", "unknown node", "another epoch", "duplicate of the leader's",
        "non-validator", "forged"])
def test_miss_reports_without_an_open_miss_or_a_validator_are_refused(build, match, missed):
    state, _ = missed
    refused(state, build(state), state.time_ms + SECOND, match)


def test_a_duplicate_miss_report_in_one_block_is_refused(missed):
    state, _ = missed
    state, result, _ = run(state, [miss(KEYS[3], M3), miss(KEYS[3], M3)])
    assert errors(result)[0] is None and "already reported it" in errors(result)[1]
    assert state.ledger.credits[M3.peer_id].missed == 1


def test_open_misses_expire_after_miss_epochs_epochs(missed):
    state, _ = missed
    assert PARAMS.miss_epochs == 2
    state, _ = next_epoch(state)  # epoch 2 reported: epoch 1's miss is still open
    assert state.ledger.epoch == 3 and state.ledger.open_misses() == [(1, M3.peer_id)]
    app.check_tx(miss(KEYS[3], M3), state, state.time_ms)
    state, _ = next_epoch(state)  # epoch 3 reported: epoch 1 is miss_epochs behind
    assert state.ledger.epoch == 4 and state.ledger.misses == {}
    refused(state, miss(KEYS[3], M3), state.time_ms + SECOND, "has no open miss in epoch 1")


def test_a_counted_miss_is_forgotten_with_its_epoch(missed):
    state, _ = missed
    state, _, _ = run(state, [miss(KEYS[3], M3)])
    assert (1, M3.peer_id) in state.ledger.counted
    state, _ = next_epoch(state)
    state, _ = next_epoch(state)
    assert state.ledger.counted == set() and state.ledger.misses == {}
    assert state.ledger.credits[M3.peer_id].missed == 1  # the credit stays


# ---------------------------------------------------------------------------- recent prompts


def _tight_genesis(pool: int, recent: int, max_nodes: int = 4) -> app.Genesis:
    prompts = [f"p{i}" for i in range(pool)]
    params = VerificationParams(model_id="m", pool_sha256=pool_digest(prompts), pool_size=pool,
                                challenges_per_node=1, max_nodes=max_nodes, recent_epochs=recent,
                                attempt_ms=ATTEMPT_MS)
    return app.Genesis(CHAIN, T0, VALIDATORS, verification=params)


def _prompts(state: app.AppState) -> set[int]:
    return {c.prompt_index for c in plan_of(state).challenges}


def test_prompts_of_the_last_recent_epochs_are_not_asked_again():
    # 9 prompts, 3 model nodes, one challenge each: epochs 1-3 must partition the pool, and
    # epoch 4 (which excludes epochs 2 and 3 only) must ask exactly epoch 1's prompts again
    state = start_epoch_1(_tight_genesis(9, recent=2))
    asked = []
    for _ in range(4):
        asked.append(_prompts(state))
        assert state.ledger.excluded_prompts() == set().union(*asked[-3:-1])
        state, _ = next_epoch(state)
    assert all(len(p) == 3 for p in asked)
    assert asked[0] | asked[1] | asked[2] == set(range(9))
    assert asked[3] == asked[0]
    assert set(state.ledger.recent) == {3, 4}


def test_without_recent_epochs_a_prompt_may_come_back_at_once():
    # 3 prompts, 3 nodes: every epoch asks the whole pool
    state = start_epoch_1(_tight_genesis(3, recent=0, max_nodes=3))
    for _ in range(2):
        assert _prompts(state) == {0, 1, 2} and state.ledger.excluded_prompts() == set()
        state, _ = next_epoch(state)
    assert state.ledger.recent == {}


def test_a_pool_too_small_for_the_recent_epochs_gives_back_the_oldest_prompts_first():
    # 8 prompts, 3 nodes, recent_epochs 2: epoch 3 cannot leave out both earlier epochs (6
    # prompts, 2 left for 3 challenges), so it leaves out epoch 2's only (before: its plan raised
    # ValueError, out of check_tx and execute_block, and no epoch could end again)
    state = start_epoch_1(_tight_genesis(8, recent=2))
    asked = []
    for _ in range(4):
        asked.append(_prompts(state))
        state, _ = next_epoch(state)
    assert not asked[1] & asked[0] and not asked[2] & asked[1] and not asked[3] & asked[2]
    assert asked[2] & asked[0]


def test_model_nodes_that_join_cannot_make_the_next_plan_impossible():
    # 9 prompts, recent_epochs 2: three nodes use them all in three epochs; a fourth node joins
    # and epoch 3 needs 4 prompts with 6 of 9 recent: the oldest epoch's come back
    state = start_epoch_1(_tight_genesis(9, recent=2))
    state, _ = next_epoch(state)
    state, result, _ = run(state, [reg(record(M4, host=5))])
    assert errors(result) == [None]
    state, _ = next_epoch(state)
    assert len(state.ledger.challenged) == 4 and len(plan_of(state).challenges) == 4
    assert state.ledger.excluded_prompts(state.genesis.verification) == set(state.ledger.recent[2])
    state, _ = next_epoch(state)
    assert state.ledger.epoch == 4


def test_by_default_no_prompt_is_asked_twice_until_the_pool_is_exhausted():
    # 60 prompts, 3 nodes, the default recent_epochs: epochs 1-20 ask 60 distinct prompts (a
    # model node that saw a prompt once could flag it when it came back: issue 16); epoch 21
    # finds the pool exhausted and asks the oldest epoch's prompts again
    genesis = _tight_genesis(60, recent=ledger.NEVER_REUSE)
    assert VerificationParams(model_id="m", pool_sha256="00" * 32,
                              pool_size=1).recent_epochs == ledger.NEVER_REUSE
    state = start_epoch_1(genesis)
    asked = []
    for _ in range(21):
        asked.append(_prompts(state))
        assert state.ledger.fresh_prompts(genesis.verification) == 60 - 3 * (len(asked) - 1) \
            or len(asked) == 21
        state, _ = next_epoch(state)
    assert len(set().union(*asked[:20])) == 60
    assert asked[20] == asked[0]
    # the ledger forgets what no plan can exclude any more: at most the pool's size
    assert sum(len(p) for p in state.ledger.recent.values()) <= 60


def test_a_report_carries_the_challenges_requests_sealed_not_in_clear(epoch1):
    # each request Q holds its pool prompt (as a real one does); blocks reach every listed node
    signed_at = epoch1.ledger.start_ms + SECOND
    results = [ledger.ChallengeResult(c, SCORES[k], answer(
        NODES[c.model_node], request_for(c) + POOL[c.prompt_index].encode(), at=signed_at))
        for k, c in enumerate(plan_of(epoch1).challenges)]
    tx = report(epoch1, results)
    for c in plan_of(epoch1).challenges:
        assert POOL[c.prompt_index].encode() not in tx
        assert request_for(c) not in tx
    state, result, _ = run(epoch1, [tx], epoch1.ledger.start_ms + 10 * SECOND)
    assert errors(result) == [None] and state.ledger.epoch == 2
    decoded = app.decode_tx(tx, 1 << 30)
    for res in decoded.results:
        q = open_request(COMMITTEE_KEY, res.answer.reply.request_hash, res.answer.sealed_request)
        assert q == request_for(res.challenge) + POOL[res.challenge.prompt_index].encode()


@pytest.mark.parametrize("kwargs, nodes", [
    ({"pool_size": 63}, 63),  # max_nodes 64 x 1: the pool gives 63 distinct prompts
    ({"pool_size": 100, "challenges_per_node": 2}, 50),
    ({"pool_size": 2**20, "max_nodes": 1024, "challenges_per_node": 10}, 1000),  # 10,000 max
    ({"pool_size": 64}, 64),
])
def test_a_plan_challenges_no_more_nodes_than_the_pool_and_the_plan_limit_allow(kwargs, nodes):
    assert VerificationParams(model_id="m", pool_sha256="00" * 32, **kwargs).plan_nodes == nodes


def test_verification_params_refuse_more_challenges_per_node_than_prompts():
    with pytest.raises(LocalProtocolError, match="challenges per node but a pool of 2"):
        VerificationParams(model_id="m", pool_sha256="00" * 32, pool_size=2,
                           challenges_per_node=3)


def dereg(who: Identity, issued: int) -> bytes:
    return app.encode_tx(app.sign_deregister(who, CHAIN, issued))


@pytest.mark.parametrize("leave", ["deregisters", "drops its organization"])
def test_a_confirmed_miss_steps_the_subject_the_node_had_when_challenged(leave):
    state = start_epoch_1()
    state, result, _ = run(state, [report(state, results_for(state, unanswered={M2.peer_id}))])
    assert errors(result) == [None] and not state.ledger.started  # epoch 2: no seeds yet
    lab = subject(M2.peer_id)
    stepped = state.reputation(lab)  # by M1's answers
    # M2 sees itself listed as unanswered and leaves, or renews without "Lab", before the
    # confirmation: Lab must still carry the miss (before: a node subject did)
    moved = dereg(M2, state.time_ms) if leave == "deregisters" else \
        reg(record(M2, host=2, org="", issued=state.time_ms))
    state, result, _ = run(state, [moved])
    assert errors(result) == [None]
    lead = next(iter(state.ledger.misses[(1, M2.peer_id)]))
    second = next(k for k in KEYS if k.peer_id != lead)
    state, result, _ = run(state, [miss(second, M2)])
    assert errors(result) == [None]
    assert result.reputation_changes == {lab: app.ReputationEntry.from_state(
        reputation_step(stepped.state(), 0.0, REP))}
    assert state.reputation(record_subject(record(M2, host=2, org=""))) is None


# ------------------------------------------------------------------------ app hash, copies


def _blocks() -> list:
    """The blocks of a short chain: epoch 1 with a miss, its confirmation, epoch 2 reported."""
    state = app.genesis_state(GENESIS)
    blocks = []

    def step(txs):
        nonlocal state
        state, result, block = run(state, txs)
        assert all(r.ok for r in result.tx_results), errors(result)
        blocks.append(block)

    step(model_regs() + [commit(k, 1) for k in KEYS[:3]])
    step([commit(k, 2) for k in KEYS[1:]])
    step([report(state, results_for(state, unanswered={M2.peer_id}))])
    step([miss(next(k for k in KEYS if k.peer_id not in state.ledger.misses[(1, M2.peer_id)]),
               M2)])
    step([commit(k, 3) for k in KEYS[:3]])
    step([report(state, results_for(state))])
    return blocks


def test_the_same_blocks_give_the_same_ledger_and_app_hash():
    blocks = _blocks()
    replays = []
    for _ in range(2):
        state, hashes = app.genesis_state(GENESIS), []
        for block in blocks:
            state, result = app.execute_block(state, block)
            hashes.append((result.app_hash, state.ledger.encode()))
        replays.append(hashes)
    assert replays[0] == replays[1]
    assert len({h for h, _ in replays[0]}) == len(blocks)
    ledger_bytes = [b for _, b in replays[0]]
    assert ledger_bytes[-1] != ledger_bytes[-2]  # the report changed the ledger


def test_the_ledger_bytes_do_not_depend_on_insertion_order():
    state = app.genesis_state(GENESIS)
    for block in _blocks()[:4]:
        state, _ = app.execute_block(state, block)
    led = state.ledger
    assert led.commitments and led.recent and led.misses and led.counted and led.credits
    shuffled = led.copy()
    shuffled.commitments = {e: dict(reversed(c.items()))
                            for e, c in reversed(led.commitments.items())}
    shuffled.misses = dict(reversed(led.misses.items()))
    shuffled.credits = dict(reversed(led.credits.items()))
    assert shuffled.encode() == led.encode()


def _bump_credit(led: ledger.EpochLedger, **delta: int) -> None:
    old = led.credits[M1.peer_id]
    led.credits[M1.peer_id] = dataclasses.replace(
        old, **{k: getattr(old, k) + v for k, v in delta.items()})


@pytest.mark.parametrize("change", [
    lambda led: setattr(led, "epoch", led.epoch + 1),
    lambda led: setattr(led, "anchor", b"\x01" * 32),
    lambda led: setattr(led, "start_ms", led.start_ms + 1),
    lambda led: setattr(led, "eligible", led.eligible[:-1]),
    lambda led: setattr(led, "challenged", led.challenged[:-1]),
    lambda led: led.commitments[2].update({KEYS[0].peer_id: b"\x02" * 32}),
    lambda led: led.recent.update({1: led.recent[1][:-1]}),
    lambda led: led.misses.update({(1, M2.peer_id): frozenset({KEYS[0].peer_id})}),
    lambda led: led.missed_subjects.update({(1, M2.peer_id): subject(M3.peer_id)}),
    lambda led: led.counted.clear(),
    lambda led: _bump_credit(led, answered=1),
    lambda led: _bump_credit(led, passed=1),
    lambda led: _bump_credit(led, missed=1),
], ids=["epoch", "anchor", "start", "eligible", "challenged", "commitment", "recent", "misses",
        "missed subject", "counted", "answered", "passed", "missed"])
def test_the_app_hash_commits_every_ledger_field(change):
    state = app.genesis_state(GENESIS)
    for block in _blocks()[:5]:
        state, _ = app.execute_block(state, block)
    assert state.ledger.started and state.ledger.counted and 2 in state.ledger.commitments
    variant = state.copy()
    variant.ledger = state.ledger.copy()
    change(variant.ledger)
    variant._registry_aux = None
    assert variant.ledger.encode() != state.ledger.encode()
    assert app.app_hash(variant) != app.app_hash(state) == state.app_hash


def test_a_state_copy_shares_the_ledger_and_execution_never_mutates_it():
    state = app.genesis_state(GENESIS)
    for block in _blocks()[:2]:
        state, _ = app.execute_block(state, block)
    assert state.ledger.started and len(state.ledger.commitments[2]) == 3
    assert state.copy().ledger is state.ledger
    before, digest, hash_ = state.ledger.encode(), state.ledger.digest(), state.app_hash
    commitments_2 = state.ledger.commitments[2]
    blocks = [
        [commit(KEYS[0], 2)],  # adds to the inner map of epoch 2's commitments
        [report(state, results_for(state, unanswered={M3.peer_id}))],
        [report(state, results_for(state)), commit(KEYS[1], 3)],
        [report(state, results_for(state, 1), 1)],  # refused: nothing may leak either
    ]
    for txs in blocks:
        new, _, _ = run(state, txs)
        assert new.ledger is not state.ledger or new.ledger.encode() == before
    assert state.ledger.encode() == before and state.ledger.digest() == digest
    assert state.ledger.commitments[2] is commitments_2 and len(commitments_2) == 3
    assert app.app_hash(state) == hash_ and state.reputations == {}


# ------------------------------------------------------------------------ power property


def _property_genesis(powers: tuple[int, ...]) -> app.Genesis:
    keys = (KEYS + EXTRA_KEYS)[:len(powers)]
    validators = tuple(Validator(k.peer_id, p) for k, p in zip(keys, powers))
    return app.Genesis(CHAIN, T0, validators, verification=PARAMS)


_COMMITS = {k.peer_id: commit(k, 1) for k in KEYS + EXTRA_KEYS}
_M1_REG = reg(record(M1, host=1))


@st.composite
def _committee(draw):
    powers = tuple(draw(st.lists(st.integers(1, 10), min_size=1, max_size=6)))
    when = tuple(draw(st.lists(st.sampled_from((0, 1, 2)), min_size=len(powers),
                               max_size=len(powers))))  # commit in block 1, 2, or never
    return powers, when


@settings(max_examples=60, deadline=None)
@given(_committee())
@example(((1, 1, 1), (1, 1, 0)))  # exactly 2/3: not enough
@example(((1, 1, 1), (1, 2, 2)))
@example(((3, 1, 1, 1), (1, 0, 0, 2)))  # 3 of 6: exactly half
@example(((3, 1, 1, 1), (1, 2, 0, 0)))  # 4 of 6: exactly 2/3, then 5 of 6 in block 2
def test_an_epoch_starts_exactly_when_committed_power_is_over_two_thirds(committee):
    powers, when = committee
    genesis = _property_genesis(powers)
    total = sum(powers)
    state = app.genesis_state(genesis)
    anchor = None
    committed = 0
    for block_no in (1, 2):
        keys = [v.address for v, w in zip(genesis.validators, when) if w == block_no]
        committed += sum(p for p, w in zip(powers, when) if w == block_no)
        txs = ([_M1_REG] if block_no == 1 else []) + [_COMMITS[k] for k in keys]
        was_started = state.ledger.started
        state, result, block = run(state, txs)
        # once the epoch started, commitments for it are refused
        assert errors(result) == [None] * (block_no == 1) + [
            "seed commitment for epoch 1; epoch 1 is started (accepted: (2,))" if was_started
            else None for _ in keys]
        if was_started:
            committed -= sum(p for p, w in zip(powers, when) if w == block_no)
        due = 3 * committed > 2 * total
        if due and anchor is None:
            anchor = block_id(block.header)
        assert state.ledger.started == due
        assert state.ledger.anchor == anchor
    if anchor is not None:
        first = [v for v, w in zip(genesis.validators, when) if w == 1]
        eligible = first if 3 * sum(v.power for v in first) > 2 * total else \
            [v for v, w in zip(genesis.validators, when) if w in (1, 2)]
        assert state.ledger.eligible == tuple(eligible)


def test_the_greedy_flag_of_an_answered_challenge_survives_encoding_and_decides_the_cap(
        epoch1):
    """The request's temperature is sealed and drawn from the users' mix, not the menu: the
    leader states which answers were greedy (checked by every verifier, test_epoch_service)
    and only those cap the node's epoch score."""
    results = results_for(epoch1)
    k = _m1_slot(epoch1)
    marked = [dataclasses.replace(r, greedy=i == k, score=100_000 if i == k else r.score)
              for i, r in enumerate(results)]
    decoded = app.decode_tx(report(epoch1, marked), 1 << 30)
    assert [r.greedy for r in decoded.results] == [i == k for i in range(len(results))]
    _, result, _ = run(epoch1, [report(epoch1, marked)], epoch1.ledger.start_ms + 9 * SECOND)
    unmarked = [dataclasses.replace(r, greedy=False) for r in marked]
    _, plain, _ = run(epoch1, [report(epoch1, unmarked)], epoch1.ledger.start_ms + 9 * SECOND)
    s1 = subject(M1.peer_id)
    assert result.reputation_changes[s1].window[0] == fresh_step(100_000).window[0]
    assert plain.reputation_changes[s1].window[0] > result.reputation_changes[s1].window[0]


def test_a_sampled_answer_scored_zero_caps_the_epoch_score_as_a_greedy_one_does(epoch1):
    """A sampled answer whose calibrated statistics are decisive (score 0) is not averaged away
    by the node's other answers: a node honest only on what it takes for challenges hid its
    cheap sampled answers in the mean (issue 18, the forwarder). A low non-zero sampled score
    is only averaged."""
    results = results_for(epoch1)
    k = _m1_slot(epoch1)
    s1 = subject(M1.peer_id)
    steps = {}
    for low in (0, 1):
        marked = [dataclasses.replace(r, greedy=False, score=low if i == k else r.score)
                  for i, r in enumerate(results)]
        _, result, _ = run(epoch1, [report(epoch1, marked)], epoch1.ledger.start_ms + 9 * SECOND)
        steps[low] = result.reputation_changes[s1].window[0]
    assert steps[0] == fresh_step(0).window[0]
    assert steps[1] > steps[0]


def test_the_lowest_greedy_score_caps_a_subjects_epoch_score(epoch1):
    """Issue 18, finding 6: a greedy answer is deterministic, so its low score is no bad luck
    and is not averaged away by sampled answers that pass."""
    node = M3.peer_id
    sampled_only = ledger.ServedScores([900_000, 900_000, 900_000])
    with_greedy = ledger.ServedScores([900_000, 900_000, 100_000], binding=[100_000])
    assert ledger.subject_scores({node: sampled_only}, epoch1.ledger) == {subject(node): 900_000}
    assert ledger.subject_scores({node: with_greedy}, epoch1.ledger) == {subject(node): 100_000}
    # without binding scores it is the plain mean (rounded half up)
    plain = ledger.ServedScores([900_000, 900_000, 100_000])
    assert ledger.subject_scores({node: plain}, epoch1.ledger) == {subject(node): 633_333}


def test_the_sampling_menu_takes_the_apis_temperatures_up_to_2():
    """Issue 18: challenges ask what users ask (the API allows T up to 2), and the challenge
    scores are calibrated at every temperature."""
    assert SamplingOption(temperature=2.0).temperature == 2.0
    with pytest.raises(LocalProtocolError, match=r"not in \[0, 2\]"):
        SamplingOption(temperature=2.01)
