"""A node's long-term keys: the Ed25519 identity (= libp2p peer ID) and the X25519 onion key.

The key file is JSON, written atomically with mode 0600::

    {"format": "planetserve-node-keys", "version": 1,
     "identity_ed25519": "<hex of the 32-byte seed>",
     "onion_x25519": "<hex of the 32-byte private key>",
     "peer_id": "12D3KooW..."}          # informational; checked against the identity on load

Source: DESIGN.md "Roles" (Ed25519 identity = peer ID) and "The anonymous overlay" (onion key);
libp2p peer ID spec (https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md): an Ed25519
peer ID is the identity multihash of the protobuf-encoded ``PublicKey``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import stat
from dataclasses import dataclass
from typing import Any

import base58
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import ConfigError

log = logging.getLogger(__name__)

#: identity multihash (0x00), length 36, then protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}.
ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"

KEY_FILE_FORMAT = "planetserve-node-keys"
KEY_FILE_VERSION = 1


class Identity:
    """An Ed25519 identity key; its public key is the node's libp2p peer ID.

    Attributes:
        public_key: the raw 32-byte Ed25519 public key.
        peer_id: libp2p peer ID bytes (38): ``ED25519_PEER_ID_PREFIX + public_key``.
    """

    __slots__ = ("_private", "public_key", "peer_id")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_key: bytes = private.public_key().public_bytes_raw()
        self.peer_id: bytes = ED25519_PEER_ID_PREFIX + self.public_key

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, seed: bytes) -> "Identity":
        """Raises ValueError unless ``seed`` is 32 bytes (an RFC 8032 private key seed)."""
        if len(seed) != 32:
            raise ValueError("an Ed25519 private key seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def private_bytes(self) -> bytes:
        """The 32-byte seed (keep it secret)."""
        return self._private.private_bytes_raw()

    @property
    def peer_id_str(self) -> str:
        """Base58 peer ID, ``12D3KooW...``."""
        return base58.b58encode(self.peer_id).decode("ascii")

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) over ``data``."""
        return self._private.sign(data)

    def libp2p_key_pair(self):  # type: ignore[no-untyped-def]
        """The same key as a py-libp2p ``KeyPair`` (``libp2p.crypto.ed25519``), for ``new_host``."""
        from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pPrivateKey
        from libp2p.crypto.keys import KeyPair

        private = Libp2pPrivateKey.from_bytes(self.private_bytes())
        return KeyPair(private, private.get_public_key())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity):
            return NotImplemented
        return self.public_key == other.public_key

    def __hash__(self) -> int:
        return hash(self.public_key)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id_str})"


@dataclass(eq=False)
class NodeKeys:
    """Everything secret a node keeps: its identity key and its onion key."""

    identity: Identity
    onion: OnionKeyPair

    @classmethod
    def generate(cls) -> "NodeKeys":
        return cls(Identity.generate(), OnionKeyPair.generate())

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": KEY_FILE_FORMAT,
                "version": KEY_FILE_VERSION,
                "identity_ed25519": self.identity.private_bytes().hex(),
                "onion_x25519": self.onion.private_bytes().hex(),
                "peer_id": self.identity.peer_id_str,
            },
            indent=2,
        ) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "key file") -> "NodeKeys":
        """Parse :meth:`to_json`'s output.

        Raises:
            ConfigError: not JSON, another format or version, or malformed keys.
        """
        try:
            data: Any = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{source} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != KEY_FILE_FORMAT:
            raise ConfigError(f"{source} is not a {KEY_FILE_FORMAT} file")
        if data.get("version") != KEY_FILE_VERSION:
            raise ConfigError(
                f"{source} has version {data.get('version')!r}; this ps_p2p reads version "
                f"{KEY_FILE_VERSION}"
            )
        try:
            identity = Identity.from_private_bytes(bytes.fromhex(data["identity_ed25519"]))
            onion = OnionKeyPair.from_private_bytes(bytes.fromhex(data["onion_x25519"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source} holds a malformed key: {exc!r}") from exc
        peer_id = data.get("peer_id")
        if peer_id is not None and peer_id != identity.peer_id_str:
            raise ConfigError(
                f"{source} says peer ID {peer_id} but its identity key is {identity.peer_id_str}"
            )
        return cls(identity, onion)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the keys to ``path`` atomically (temp file + rename), mode 0600.

        Parent directories are created (mode 0700). An existing file is replaced.

        Raises:
            OSError: the file cannot be written.
        """
        _write_private(pathlib.Path(path), self.to_json().encode("utf-8"), exclusive=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "NodeKeys":
        """Read a key file.

        Logs a warning when the file is readable by group or others.

        Raises:
            ConfigError: unreadable, corrupt, or writable by group/others (someone else could
                have replaced the key).
        """
        path = pathlib.Path(path)
        try:
            with open(path, "rb") as fh:
                mode = os.fstat(fh.fileno()).st_mode
                raw = fh.read(64 * 1024)
        except OSError as exc:
            raise ConfigError(f"cannot read key file {path}: {exc}") from exc
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"key file {path} is writable by group/others (mode {stat.S_IMODE(mode):04o}); "
                f"run: chmod 600 {path}"
            )
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning(
                "key file %s is readable by group/others (mode %04o); run: chmod 600 %s",
                path, stat.S_IMODE(mode), path,
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"key file {path} is not UTF-8 text") from exc
        return cls.from_json(text, source=f"key file {path}")


def load_or_create_keys(path: str | os.PathLike[str]) -> NodeKeys:
    """Load the key file at ``path``, creating it (new random keys, mode 0600) on first run.

    Two processes racing to create the same file end up with the same keys: the loser loads the
    winner's file.

    Raises:
        ConfigError: the file exists but is unreadable or corrupt, or it cannot be created.
    """
    path = pathlib.Path(path)
    if path.exists():
        return NodeKeys.load(path)
    keys = NodeKeys.generate()
    try:
        created = _write_private(path, keys.to_json().encode("utf-8"), exclusive=True)
    except OSError as exc:
        raise ConfigError(f"cannot create key file {path}: {exc}") from exc
    if not created:
        return NodeKeys.load(path)
    log.info("created key file %s for new peer ID %s", path, keys.identity.peer_id_str)
    return keys


def _write_private(path: pathlib.Path, data: bytes, *, exclusive: bool) -> bool:
    """Write ``data`` to ``path`` via a 0600 temp file in the same folder.

    Returns False (and writes nothing) when ``exclusive`` and ``path`` already exists.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # exact mode whatever the umask
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, path)  # fails if another process created it meanwhile
            except FileExistsError:
                return False
            except OSError:  # no hard links on this file system: best effort
                if path.exists():
                    return False
                os.replace(tmp, path)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
        return True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _fsync_dir(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = [
    "ED25519_PEER_ID_PREFIX",
    "Identity",
    "NodeKeys",
    "load_or_create_keys",
]
