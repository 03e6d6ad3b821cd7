"""Node configuration: defaults, a TOML file, then command-line overrides.

Times are in seconds, sizes in bytes. A TOML file holds the same keys as :class:`NodeConfig`
(``[user]`` and ``[model_node]`` tables for the nested settings), e.g.::

    roles = ["user"]
    listen = "/ip4/0.0.0.0/tcp/4001"
    bootstrap = ["/ip4/10.0.0.5/tcp/4001/p2p/12D3KooW..."]
    key_file = "~/.ps_p2p/node.key"

    [user]
    total = 4
    threshold = 3
    rotate_period = 900

Unknown keys are an error (a typo should not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ps_p2p.errors import ConfigError
from ps_p2p.roles.model import ModelNodeConfig
from ps_p2p.roles.user import UserConfig

ROLES = ("user", "model", "verifier")
ENGINES = ("transformers", "vllm")
SECONDS = 1.0
MINUTES = 60 * SECONDS


@dataclass
class NodeConfig:
    """Everything one ``ps-node run`` needs.

    Attributes:
        roles: any of "user", "model", "verifier".
        listen: listen multiaddr (port 0 picks a free port).
        bootstrap: multiaddrs (with /p2p/<peer ID>) dialled at start.
        verifiers: trusted verifier peer IDs (base58); empty = the bootstrap peers.
        quorum: verifier signatures a directory needs (2f+1 once consensus lands).
        key_file: identity + onion key file, created on first run.
        organization: shown in the node record.
        model: model path (HF folder or .gguf) or, with engine "vllm", the served model name.
        engine, vllm_url, device, model_id: inference engine settings (model role).
        register_interval: seconds between re-registrations with the verifiers.
        record_lifetime: seconds a node record stays valid.
        directory_refresh: seconds between directory fetches.
        directory_lifetime: seconds a directory signed by this verifier stays valid.
        relay: user nodes relay other users' paths (``ps-node ask`` turns it off).
        register: register this node's record with the verifiers (off for a one-shot ``ask``).
        tamper: TEST ONLY: corrupt relayed cells and cloves (``devnet --perturb tamper-clove``).
    """

    roles: list[str] = field(default_factory=lambda: ["user"])
    listen: str = "/ip4/127.0.0.1/tcp/0"
    bootstrap: list[str] = field(default_factory=list)
    verifiers: list[str] = field(default_factory=list)
    quorum: int = 1
    key_file: str = "~/.ps_p2p/node.key"
    organization: str = ""
    model: str | None = None
    engine: str = "transformers"
    vllm_url: str = "http://127.0.0.1:8000"
    device: str = "cpu"
    model_id: str | None = None
    register_interval: float = 30 * SECONDS
    record_lifetime: float = 2 * MINUTES
    directory_refresh: float = 5 * SECONDS
    directory_lifetime: float = 2 * MINUTES
    relay: bool = True
    register: bool = True
    tamper: bool = False
    user: UserConfig = field(default_factory=UserConfig)
    model_node: ModelNodeConfig = field(default_factory=ModelNodeConfig)

    def validate(self) -> None:
        """Raise ConfigError on an impossible combination."""
        if not self.roles:
            raise ConfigError("at least one --role is needed")
        for role in self.roles:
            if role not in ROLES:
                raise ConfigError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        if "model" in self.roles and not self.model:
            raise ConfigError("the model role needs --model PATH (or the served name with --engine vllm)")
        if self.quorum < 1:
            raise ConfigError("quorum must be >= 1")
        if "verifier" not in self.roles and not self.bootstrap:
            raise ConfigError("a node without the verifier role needs --multiaddr of a verifier")
        for addr in self.bootstrap:
            if "/p2p/" not in addr:
                raise ConfigError(f"bootstrap multiaddr {addr!r} lacks /p2p/<peer ID>")

    @property
    def key_path(self) -> pathlib.Path:
        return pathlib.Path(self.key_file).expanduser()


_NESTED = {"user": UserConfig, "model_node": ModelNodeConfig}


def load_config(path: str | pathlib.Path | None, overrides: dict[str, Any] | None = None) -> NodeConfig:
    """Build a :class:`NodeConfig` from defaults, the TOML file at ``path`` and ``overrides``.

    ``overrides`` (from the command line) win over the file; None values are ignored.

    Raises:
        ConfigError: unreadable file, bad TOML, unknown key or a wrong type.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(pathlib.Path(path).expanduser(), "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"bad TOML in {path}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    known = {f.name for f in dataclasses.fields(NodeConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"unknown config key {key!r}")
        if key in _NESTED:
            cls = _NESTED[key]
            if isinstance(value, cls):
                kwargs[key] = value
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            sub_known = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - sub_known
            if unknown:
                raise ConfigError(f"unknown key(s) in [{key}]: {', '.join(sorted(unknown))}")
            try:
                kwargs[key] = cls(**value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"[{key}]: {exc}") from exc
        else:
            kwargs[key] = value
    try:
        config = NodeConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
    config.validate()
    return config
