"""The committee's genesis file (ps_p2p.genesis) and ``ps-node testnet``."""

from __future__ import annotations

import json

import pytest

from ps_p2p import cli
from ps_p2p.config import load_config
from ps_p2p.consensus.block import BlockLimits
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import ConfigError
from ps_p2p.genesis import genesis_hash, genesis_json, load_genesis
from ps_p2p.keys import NodeKeys, load_or_create_keys
from ps_p2p.registry import AdmissionPolicy, Genesis
from ps_p2p.verification.reputation import ReputationParams

pytestmark = pytest.mark.usefixtures("restore_logging")


def _genesis(n=4) -> Genesis:
    keys = [NodeKeys.generate().identity for _ in range(n)]
    return Genesis("chain-x", 1_700_000_000_000, tuple(Validator(k.peer_id, 1 + i % 2) for i, k in enumerate(keys)),
                   AdmissionPolicy(max_records_per_network=7), BlockLimits(max_txs=50),
                   ReputationParams(window=7, untrusted_below=0.35))


def test_a_genesis_file_round_trips_every_committed_field(tmp_path):
    genesis = _genesis()
    consensus = ConsensusConfig(timeout_propose=0.5, timeout_prevote_delta=0.1)
    path = tmp_path / "genesis.json"
    path.write_text(genesis_json(genesis, consensus, ["v0", "v1", "v2", "v3"]))
    loaded = load_genesis(path)
    assert loaded.genesis == genesis
    assert loaded.genesis.reputation.untrusted_below == 0.35
    assert (loaded.consensus.timeout_propose, loaded.consensus.timeout_prevote_delta) == (0.5, 0.1)
    assert list(loaded.names.values()) == ["v0", "v1", "v2", "v3"]
    assert genesis_hash(path.read_bytes()) == genesis_hash(path.read_text())


def _edit(tmp_path, change):
    data = json.loads(genesis_json(_genesis(), ConsensusConfig()))
    change(data)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("chain_id"), "chain_id"),
    (lambda d: d.update(genesis_time_ms=-1), "genesis_time_ms"),
    (lambda d: d.update(validators=[]), "validators"),
    (lambda d: d["validators"][0].update(peer_id="not-a-peer"), r"validators\[0\].peer_id"),
    (lambda d: d["validators"][1].update(power=0), r"validators\[1\].power"),
    (lambda d: d.update(extra=1), "unknown key"),
    (lambda d: d["consensus"].update(timeout_propose="soon"), "consensus.timeout_propose"),
    (lambda d: d["admission"].update(bogus=1), "unknown key"),
    (lambda d: d["block_limits"].update(max_block_bytes=10), "block_limits"),
    (lambda d: d["validators"].append(dict(d["validators"][0])), "listed twice"),
    (lambda d: d["reputation"].update(untrusted_below=1.5), "reputation.*untrusted_below"),
    (lambda d: d["reputation"].update(window=2.5), "reputation.*window"),
])
def test_a_bad_genesis_file_is_refused_naming_the_field(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_genesis(_edit(tmp_path, change))


def test_unreadable_and_non_json_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_genesis(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        load_genesis(tmp_path / "bad.json")


def test_testnet_writes_a_genesis_and_a_home_per_verifier_that_ps_node_run_reads(tmp_path, capsys):
    out = tmp_path / "net"
    assert cli.main(["testnet", "--verifiers", "4", "--out", str(out), "--base-port", "30000"]) == 0
    genesis = load_genesis(out / "genesis.json")
    assert len(genesis.genesis.validators) == 4
    for i in range(4):
        home = out / f"verifier{i}"
        keys = load_or_create_keys(home / "node.key")  # the key file written, not a new one
        assert genesis.genesis.validators[i].address == keys.identity.peer_id
        config = load_config(home / "config.toml")
        config.validate()
        assert config.roles == ["verifier"] and config.listen == f"/ip4/127.0.0.1/tcp/{30000 + i}"
        assert config.genesis == str(out / "genesis.json")
        assert len(config.bootstrap) == 3 and all(
            keys.identity.peer_id_str not in b for b in config.bootstrap
        )
    printed = capsys.readouterr().out
    assert "4 verifiers" in printed and printed.count("ps-node run --config") == 4
    # the model nodes' shared group secret, readable by its owner only, in config form
    group = out / "model-group.toml"
    assert group.stat().st_mode & 0o777 == 0o600 and "model-group.toml" in printed
    import tomllib

    from ps_p2p.config import ForwardingConfig

    forwarding = ForwardingConfig(**tomllib.loads(group.read_text())["forwarding"])
    assert forwarding.active and len(bytes.fromhex(forwarding.group_key)) == 32
    # a second run never overwrites keys
    assert cli.main(["testnet", "--verifiers", "4", "--out", str(out)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def _write_status(home, *, age_s: float, committee: bool):
    import time

    home.mkdir(parents=True, exist_ok=True)
    status = {
        "pid": 1, "peer_id": "12D3KooWTest", "roles": ["verifier"],
        "listen": ["/ip4/127.0.0.1/tcp/26656/p2p/12D3KooWTest"], "api": None,
        "directory": {"height": 7, "users": 5, "model_nodes": 1}, "ready_paths": 0,
        "committee": None if not committee else {
            "chain_id": "c", "height": 9, "round": 1, "step": "prevote", "committed_height": 8,
            "last_commit_time_ms": int(time.time() * 1000), "mempool": 2,
            "validators": [{"peer_id": "12D3KooWA", "power": 1, "connected": True},
                           {"peer_id": "12D3KooWB", "power": 1, "connected": False}],
        },
        "written_at_ms": int((time.time() - age_s) * 1000),
    }
    (home / "status.json").write_text(json.dumps(status))


def test_status_prints_the_consensus_of_a_running_committee_verifier(tmp_path, capsys):
    _write_status(tmp_path / "v0", age_s=0.5, committee=True)
    assert cli.main(["status", "--home", str(tmp_path / "v0")]) == 0
    out = capsys.readouterr().out
    assert "height 9 round 1 (prevote); committed 8" in out
    assert "1 of 2 connected" in out and "12D3KooWB  power 1  NOT connected" in out
    assert "height 7: 5 users, 1 model nodes" in out


def test_status_of_a_stopped_node_says_so_and_a_missing_one_is_an_error(tmp_path, capsys):
    _write_status(tmp_path / "old", age_s=60, committee=False)
    assert cli.main(["status", "--home", str(tmp_path / "old")]) == 1
    out = capsys.readouterr().out
    assert "STALE" in out and "consensus" not in out
    assert cli.main(["status", "--home", str(tmp_path / "nothing")]) == 2
    assert "no status file" in capsys.readouterr().err


@pytest.mark.needs_shared
def test_testnet_generates_a_private_pool_and_a_committee_key_only_verifiers_hold(
        tmp_path, capsys, shared):
    from ps_p2p.prompts import load_prompts
    from ps_p2p.verification.ledger import pool_digest
    from ps_p2p.verification.sealing import key_commitment, load_committee_key

    out = tmp_path / "net"
    assert cli.main(["testnet", "--verifiers", "4", "--out", str(out),
                     "--challenge-model", str(shared / "models" / "stories260K"),
                     "--challenge-pool", "generate", "--challenge-pool-size", "6"]) == 0
    params = load_genesis(out / "genesis.json").genesis.verification
    assert params is not None and params.pool_size == 6
    public = {p.text for p in load_prompts(shared / "data" / "mtbench" / "question.jsonl")}
    pools, keys = set(), set()
    for i in range(4):
        home = out / f"verifier{i}"
        config = load_config(home / "config.toml")
        config.validate()
        [pool_file] = config.verification.pool
        assert pool_file == str(home / "challenge-pool.jsonl")
        pool = [p.text for p in load_prompts(pool_file)]
        assert pool_digest(pool) == params.pool_sha256 and not set(pool) & public
        key = load_committee_key(config.verification.committee_key)
        assert key_commitment(key) == params.committee_key_sha256
        for secret_file in (home / "challenge-pool.jsonl", home / "committee.key"):
            assert secret_file.stat().st_mode & 0o077 == 0
        pools.add(tuple(pool))
        keys.add(key)
    assert len(pools) == 1 and len(keys) == 1
    # nothing of the pool or the key outside the verifiers' homes
    shared_text = (out / "genesis.json").read_text()
    assert all(p not in shared_text for p in pools.pop()) and keys.pop().hex() not in shared_text
    assert "warning" not in capsys.readouterr().err


def test_testnet_warns_that_a_pool_from_prompt_files_is_only_private_if_nobody_has_them(
        tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    out = tmp_path / "net"
    assert cli.main(["testnet", "--verifiers", "1", "--out", str(out),
                     "--challenge-model", str(tmp_path), "--challenge-pool",
                     str(prompts)]) == 0
    assert "lets model nodes recognise every challenge" in capsys.readouterr().err
    config = load_config(out / "verifier0" / "config.toml")
    config.validate()
    assert config.verification.pool == [str(prompts)] and config.verification.committee_key
