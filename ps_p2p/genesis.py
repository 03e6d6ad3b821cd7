"""The genesis file of a committee: what every node of one chain starts from (JSON).

Like CometBFT's ``genesis.json``: the chain ID (part of every consensus signature), the genesis
time, the validators (peer IDs in base58 and voting powers), the consensus timeouts, and the
committed rules of the registry (the sybil admission policy, the block limits and the
reputation rule's parameters, paper sec. 3.4). Every
validator runs the chain from it, and every node checks directories against its validator set
(:func:`ps_p2p.registry.directory.verify_directory`), so it must be the same file everywhere:
:func:`genesis_hash` names it in logs and status. This module reads and writes the file (the
service layer, beside :mod:`ps_p2p.config`); the pure consensus package only sees the parsed
:class:`~ps_p2p.registry.Genesis`.

Format (all keys required except ``consensus``, ``admission``, ``block_limits`` and
``reputation``, whose missing fields take the defaults of
:class:`~ps_p2p.consensus.core.ConsensusConfig`, :class:`~ps_p2p.registry.AdmissionPolicy`,
:class:`~ps_p2p.consensus.block.BlockLimits` and
:class:`~ps_p2p.verification.reputation.ReputationParams`)::

    {
      "chain_id": "planetserve-testnet",
      "genesis_time_ms": 1795000000000,
      "validators": [{"peer_id": "12D3KooW...", "power": 1, "name": "verifier0"}, ...],
      "consensus": {"timeout_propose": 3.0, "timeout_propose_delta": 0.5, ...},
      "admission": {"max_records_per_network": 32, ...},
      "block_limits": {"max_block_bytes": 1048576, "max_txs": 1000, "max_tx_bytes": 8192},
      "reputation": {"alpha": 0.4, "beta": 0.6, "window": 5, "tau": 0.5, "gamma": 0.2,
                     "untrusted_below": 0.4, "initial": 0.5, "probation": 8,
                     "max_probation": 1024, "forgive": 100},
      "verification": {"model_id": "stories260K", "pool_sha256": "<64 hex digits>",
                       "pool_size": 80, "sampling": [{"max_tokens": 64, "temperature": 0.0,
                       "top_p": 1.0}], "attempt_ms": 60000, ...}
    }

``verification`` (optional: without it the chain runs no challenge epochs) is
:class:`~ps_p2p.verification.ledger.VerificationParams`: ``model_id``, ``pool_sha256`` (the
:func:`~ps_p2p.verification.ledger.pool_digest` of the prompt pool every verifier loads) and
``pool_size`` are required.

Errors: :class:`~ps_p2p.errors.ConfigError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libp2p.peer.id import ID

from ps_p2p.consensus.block import BlockLimits
from ps_p2p.consensus.core import ConsensusConfig
from ps_p2p.consensus.types import Validator
from ps_p2p.errors import ConfigError, PsError
from ps_p2p.registry import AdmissionPolicy, Genesis
from ps_p2p.verification.ledger import SamplingOption, VerificationParams
from ps_p2p.verification.reputation import ReputationParams

#: Largest genesis file read (bytes): 128 validators with names fit many times over.
MAX_GENESIS_BYTES = 1024 * 1024
_CONSENSUS_FIELDS = (
    "timeout_propose", "timeout_propose_delta", "timeout_prevote", "timeout_prevote_delta",
    "timeout_precommit", "timeout_precommit_delta",
)


@dataclass(frozen=True)
class GenesisFile:
    """A parsed genesis file.

    Attributes:
        genesis: the chain's committed start (:class:`~ps_p2p.registry.Genesis`).
        consensus: the consensus timeouts every validator uses.
        names: validator peer ID -> its name in the file ("" when none).
        text: the file's bytes as read (what a verifier serves to nodes that ask for its
            genesis, and what :func:`genesis_hash` names); empty when built in memory.
    """

    genesis: Genesis
    consensus: ConsensusConfig
    names: dict[bytes, str]
    text: bytes = b""

    @property
    def hash(self) -> str:
        """:func:`genesis_hash` of :attr:`text` (or of the canonical JSON when built in
        memory)."""
        return genesis_hash(self.text or genesis_json(
            self.genesis, self.consensus, [self.names.get(v.address, "")
                                           for v in self.genesis.validators]))


def genesis_json(
    genesis: Genesis, consensus: ConsensusConfig, names: Sequence[str] = ()
) -> str:
    """The genesis file's text (indented JSON, keys in a fixed order)."""
    validators = []
    for i, v in enumerate(genesis.validators):
        entry: dict[str, Any] = {"peer_id": ID(v.address).to_base58(), "power": v.power}
        if i < len(names) and names[i]:
            entry["name"] = names[i]
        validators.append(entry)
    data = {
        "chain_id": genesis.chain_id,
        "genesis_time_ms": genesis.time_ms,
        "validators": validators,
        "consensus": {f: getattr(consensus, f) for f in _CONSENSUS_FIELDS},
        "admission": dataclasses.asdict(genesis.policy),
        "block_limits": dataclasses.asdict(genesis.limits),
        "reputation": dataclasses.asdict(genesis.reputation),
    }
    if genesis.verification is not None:
        data["verification"] = dataclasses.asdict(genesis.verification)
    return json.dumps(data, indent=2) + "\n"


def genesis_hash(text: str | bytes) -> str:
    """SHA-256 of the genesis file's bytes, hex (to compare files between nodes)."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def load_genesis(path: str | pathlib.Path) -> GenesisFile:
    """Read and check a genesis file.

    Raises:
        ConfigError: unreadable, too large, not JSON, a missing or mistyped field, an unknown
            key, a bad peer ID, or a validator set or chain ID that the consensus refuses.
    """
    p = pathlib.Path(path).expanduser()
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read genesis file {p}: {exc}") from exc
    return parse_genesis_text(raw, source=f"genesis file {p}")


def parse_genesis_text(raw: bytes, *, source: str = "genesis") -> GenesisFile:
    """Parse and check a genesis file's bytes (as :func:`load_genesis`; also what a verifier
    answers to a genesis request).

    Raises:
        ConfigError: too large, not UTF-8 JSON, or as :func:`parse_genesis`.
    """
    if len(raw) > MAX_GENESIS_BYTES:
        raise ConfigError(f"{source} is over {MAX_GENESIS_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{source} is not JSON: {exc}") from exc
    return dataclasses.replace(parse_genesis(data, source=source), text=bytes(raw))


def init_genesis(path: pathlib.Path, validator: bytes, *, now_ms: int) -> GenesisFile:
    """The genesis of a committee of one (``ps-node run --role verifier`` without
    ``--genesis``, like ``cometbft init``): read ``path`` when it exists, else write a genesis
    whose only validator is ``validator`` (chain ``planetserve-<last 8 characters of its peer
    ID>``, genesis time ``now_ms``, default timeouts, admission policy and block limits) and
    read it back. The file must survive restarts: the validator's store belongs to its chain.

    Raises:
        ConfigError: the file exists but is invalid, or cannot be written.
    """
    if path.exists():
        return load_genesis(path)
    peer = ID(validator).to_base58()
    genesis = Genesis(f"planetserve-{peer[-8:]}", now_ms, (Validator(validator),))
    text = genesis_json(genesis, ConsensusConfig(), ["verifier"])
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write genesis file {path}: {exc}") from exc
    return load_genesis(path)


def parse_genesis(data: Any, *, source: str = "genesis") -> GenesisFile:
    """:func:`load_genesis` on already-parsed JSON. Raises ConfigError."""
    def fail(message: str) -> ConfigError:
        return ConfigError(f"{source}: {message}")

    if not isinstance(data, dict):
        raise fail("not a JSON object")
    unknown = set(data) - {"chain_id", "genesis_time_ms", "validators", "consensus",
                           "admission", "block_limits", "reputation", "verification"}
    if unknown:
        raise fail(f"unknown key(s) {sorted(unknown)}")
    chain_id = data.get("chain_id")
    if not isinstance(chain_id, str) or not chain_id:
        raise fail("'chain_id' must be a non-empty string")
    time_ms = data.get("genesis_time_ms")
    if not isinstance(time_ms, int) or isinstance(time_ms, bool) or time_ms < 0:
        raise fail("'genesis_time_ms' must be a non-negative integer (unix ms)")
    entries = data.get("validators")
    if not isinstance(entries, list) or not entries:
        raise fail("'validators' must be a non-empty list")
    validators: list[Validator] = []
    names: dict[bytes, str] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"peer_id", "power", "name"}:
            raise fail(f"validators[{i}] must be an object with peer_id, power and name")
        try:
            peer = ID.from_base58(str(entry.get("peer_id", ""))).to_bytes()
        except Exception as exc:
            raise fail(f"validators[{i}].peer_id is not a peer ID: {exc}") from exc
        power = entry.get("power", 1)
        if not isinstance(power, int) or isinstance(power, bool) or power < 1:
            raise fail(f"validators[{i}].power must be an integer >= 1")
        validators.append(Validator(peer, power))
        names[peer] = str(entry.get("name", ""))
    consensus = _section(data, "consensus", ConsensusConfig, _CONSENSUS_FIELDS, fail)
    policy = _section(data, "admission", AdmissionPolicy,
                      tuple(f.name for f in dataclasses.fields(AdmissionPolicy)), fail)
    limits = _section(data, "block_limits", BlockLimits,
                      tuple(f.name for f in dataclasses.fields(BlockLimits)), fail)
    reputation = _section(data, "reputation", ReputationParams,
                          tuple(f.name for f in dataclasses.fields(ReputationParams)), fail)
    verification = _verification(data.get("verification"), fail)
    try:
        genesis = Genesis(chain_id, time_ms, tuple(validators), policy, limits, reputation,
                          verification)
    except PsError as exc:
        raise fail(str(exc)) from exc
    return GenesisFile(genesis, consensus, names)


def _verification(section: Any, fail: Any) -> VerificationParams | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise fail("'verification' must be an object")
    known = {f.name for f in dataclasses.fields(VerificationParams)}
    unknown = set(section) - known
    if unknown:
        raise fail(f"unknown key(s) in 'verification': {sorted(unknown)}")
    values = dict(section)
    try:
        menu = values.get("sampling", [{}])
        if not isinstance(menu, list) or not all(isinstance(m, dict) for m in menu):
            raise TypeError("'sampling' must be a list of objects")
        values["sampling"] = tuple(SamplingOption(**m) for m in menu)
        return VerificationParams(**values)
    except (PsError, TypeError, ValueError) as exc:
        raise fail(f"'verification': {exc}") from exc


def _section(data: dict[str, Any], key: str, cls: type, fields: Sequence[str], fail: Any) -> Any:
    section = data.get(key, {})
    if not isinstance(section, dict):
        raise fail(f"'{key}' must be an object")
    unknown = set(section) - set(fields)
    if unknown:
        raise fail(f"unknown key(s) in '{key}': {sorted(unknown)}")
    for name, value in section.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise fail(f"'{key}.{name}' must be a non-negative number")
    try:
        return cls(**section)
    except (PsError, TypeError, ValueError) as exc:
        raise fail(f"'{key}': {exc}") from exc


__all__ = ["GenesisFile", "MAX_GENESIS_BYTES", "genesis_hash", "genesis_json", "init_genesis",
           "load_genesis", "parse_genesis", "parse_genesis_text"]
