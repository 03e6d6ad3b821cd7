"""How a node without a genesis file learns which committee to follow
(ps_p2p.directory_client.CommitteeClient.accept_genesis), and that it works on real hosts."""

from __future__ import annotations

import pytest
import trio

from ps_p2p.config import NodeConfig
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.types import Validator
from ps_p2p.directory_client import CommitteeClient, GenesisPendingError
from ps_p2p.errors import RemoteProtocolError, UntrustedGenesisError
from ps_p2p.genesis import genesis_json
from ps_p2p.keys import Identity, NodeKeys
from ps_p2p.node import Node
from ps_p2p.registry import Genesis

V = [Identity.generate().peer_id for _ in range(5)]


def _text(validators, chain="c", powers=None) -> bytes:
    powers = powers or [1] * len(validators)
    genesis = Genesis(chain, 1_000, tuple(Validator(v, p) for v, p in zip(validators, powers)))
    return genesis_json(genesis, ConsensusConfig()).encode()


def test_a_lone_configured_verifier_serving_a_committee_of_one_is_followed():
    client = CommitteeClient(None, frozenset(V[:1]))
    followed = client.accept_genesis(V[0], _text(V[:1]))
    assert client.genesis == followed.genesis and client.trusted_verifiers == {V[0]}
    assert client.registrations_needed == 1


def test_one_lying_verifier_of_four_cannot_move_the_node_onto_its_own_chain():
    client = CommitteeClient(None, frozenset(V[:4]))
    for lie in (_text(V[:1], "evil"), _text(V[:4], "evil", powers=[1, 1, 1, 10])):
        with pytest.raises(GenesisPendingError, match="1 of 4"):
            client.accept_genesis(V[0], lie)
    assert client.genesis is None
    honest = _text(V[:4])
    for i, verifier in enumerate(V[1:3]):  # 2 of 4 agree: not yet more than 2/3
        with pytest.raises(GenesisPendingError, match=f"{i + 1} of 4"):
            client.accept_genesis(verifier, honest)
    client.accept_genesis(V[3], honest)  # the third: 3 of 4
    assert client.genesis.chain_id == "c" and client.trusted_verifiers == set(V[:4])
    assert client.registrations_needed == 2  # f + 1
    with pytest.raises(UntrustedGenesisError, match="not the 'c'"):
        client.accept_genesis(V[0], _text(V[:1], "evil"))  # never another chain later


def test_a_genesis_naming_a_validator_not_configured_is_refused():
    client = CommitteeClient(None, frozenset(V[:1]))
    with pytest.raises(UntrustedGenesisError, match="not all trusted"):
        client.accept_genesis(V[0], _text([V[0], V[4]]))
    with pytest.raises(UntrustedGenesisError):  # the server is not among its validators
        CommitteeClient(None, frozenset(V[:2])).accept_genesis(V[1], _text(V[:1]))
    with pytest.raises(RemoteProtocolError, match="not JSON"):
        client.accept_genesis(V[0], b"{nope")


async def test_a_user_without_a_genesis_file_follows_a_lone_verifier_started_without_one(tmp_path):
    async with trio.open_nursery() as nursery:
        verifier = Node(NodeConfig(roles=["verifier"], home=str(tmp_path / "v"),
                                   directory_refresh=0.5), NodeKeys.generate())
        await nursery.start(verifier.run)
        assert (tmp_path / "v" / "genesis.json").is_file()  # a committee of one, kept
        user = Node(NodeConfig(roles=["user"], bootstrap=verifier.listen_addrs[:1],
                               home=str(tmp_path / "u"), directory_refresh=0.5),
                    NodeKeys.generate())
        await nursery.start(user.run)
        with trio.fail_after(30):
            while user.directory is None or user.directory.record(user.peer_id) is None:
                await user.wait_directory_update()
        assert user._client.genesis == verifier.genesis_file.genesis
        nursery.cancel_scope.cancel()


async def test_a_user_given_another_chains_genesis_says_so_once_at_warning_and_backs_off(
    tmp_path, caplog
):
    """Issue 21: such a user logged ~450 INFO lines a minute ("directory from ... refused")
    and never named the cause."""
    import logging

    from ps_p2p.testing.waits import wait_until

    other = tmp_path / "other-genesis.json"
    other.write_text(_text([Identity.generate().peer_id], chain="the-other-chain").decode())
    caplog.set_level(logging.DEBUG, logger="ps_p2p.node")
    async with trio.open_nursery() as nursery:
        verifier = Node(NodeConfig(roles=["verifier"], home=str(tmp_path / "v"),
                                   directory_refresh=0.5), NodeKeys.generate())
        await nursery.start(verifier.run)
        user = Node(NodeConfig(roles=["user"], bootstrap=verifier.listen_addrs[:1],
                               genesis=str(other), home=str(tmp_path / "u"),
                               directory_refresh=0.5), NodeKeys.generate())
        await nursery.start(user.run)
        await wait_until(lambda: "wrong chain" in caplog.text, timeout=30)
        with trio.move_on_after(3):  # what the next seconds log
            await trio.sleep_forever()
        nursery.cancel_scope.cancel()

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name == "ps_p2p.node" and "wrong chain" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    chain = verifier.genesis_file.genesis.chain_id
    assert "'the-other-chain'" in message and f"'{chain}'" in message and str(other) in message
    failures = [r.getMessage() for r in caplog.records
                if r.name == "ps_p2p.node" and r.levelno == logging.INFO
                and ("refused" in r.getMessage() or "failed" in r.getMessage())]
    assert len(failures) <= 2, failures  # the first of each kind, not one a round
    assert user.directory is None
