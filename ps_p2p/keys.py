"""A node's long-term keys: the Ed25519 identity (= libp2p peer ID) and the X25519 onion key;
an organization's key and the membership certificates it signs.

The key file is JSON, written atomically with mode 0600::

    {"format": "planetserve-node-keys", "version": 1,
     "identity_ed25519": "<hex of the 32-byte seed>",
     "onion_x25519": "<hex of the 32-byte private key>",
     "peer_id": "12D3KooW..."}          # informational; checked against the identity on load

An organization (issue 16: its nodes share one reputation, so only it may say who its nodes
are) keeps an Ed25519 *organization key* (``ps-node org new``; mode 0600, kept off the nodes)::

    {"format": "planetserve-organization-key", "version": 1,
     "organization_ed25519": "<hex of the 32-byte seed>",
     "org_key": "12D3KooW..."}          # the organization's ID; checked on load

and signs each member a certificate (``ps-node org sign``), which the member's node names in
its configuration (``membership = PATH``) and carries in its record
(:class:`~ps_p2p.records.Membership`)::

    {"format": "planetserve-org-membership", "version": 1, "organization": "acme",
     "org_key": "12D3KooW...", "member": "12D3KooW...", "expires_at_ms": 1700000000000,
     "signature": "<hex of 64 bytes>"}

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

from ps_p2p import records
from ps_p2p.crypto.onion import OnionKeyPair
from ps_p2p.errors import ConfigError, PsError

log = logging.getLogger(__name__)

#: identity multihash (0x00), length 36, then protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}.
ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"

KEY_FILE_FORMAT = "planetserve-node-keys"
KEY_FILE_VERSION = 1
ORG_KEY_FORMAT = "planetserve-organization-key"
MEMBERSHIP_FORMAT = "planetserve-org-membership"


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
        return cls.from_json(_read_private(path, "key file"), source=f"key file {path}")


def _read_private(path: pathlib.Path, what: str) -> str:
    """The text of a secret file, refused when group/others may write it (warned when they may
    read it)."""
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            raw = fh.read(64 * 1024)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{what} {path} is writable by group/others (mode {stat.S_IMODE(mode):04o}); "
            f"run: chmod 600 {path}"
        )
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "%s %s is readable by group/others (mode %04o); run: chmod 600 %s",
            what, path, stat.S_IMODE(mode), path,
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from exc


def _json_object(text: str, fmt: str, source: str) -> dict[str, Any]:
    try:
        data: Any = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise ConfigError(f"{source} is not a {fmt} file")
    if data.get("version") != 1:
        raise ConfigError(f"{source} has version {data.get('version')!r}; this ps_p2p reads 1")
    return data


def _peer_id_bytes(text: object, what: str) -> bytes:
    try:
        raw = base58.b58decode(str(text))
    except ValueError as exc:
        raise ConfigError(f"{what} {text!r} is not a base58 peer ID") from exc
    if not raw.startswith(ED25519_PEER_ID_PREFIX) or len(raw) != len(ED25519_PEER_ID_PREFIX) + 32:
        raise ConfigError(f"{what} {text!r} is not an Ed25519 peer ID")
    return raw


# ---------------------------------------------------------------------------- organizations


def new_organization_key(path: str | os.PathLike[str]) -> Identity:
    """Create an organization key file at ``path`` (mode 0600; module docstring).

    Raises:
        ConfigError: ``path`` exists (an organization key is never overwritten: its members'
            certificates and its reputation hang on it), or it cannot be written.
    """
    path = pathlib.Path(path)
    key = Identity.generate()
    text = json.dumps({"format": ORG_KEY_FORMAT, "version": 1,
                       "organization_ed25519": key.private_bytes().hex(),
                       "org_key": key.peer_id_str}, indent=2) + "\n"
    try:
        created = _write_private(path, text.encode("utf-8"), exclusive=True)
    except OSError as exc:
        raise ConfigError(f"cannot create organization key file {path}: {exc}") from exc
    if not created:
        raise ConfigError(f"organization key file {path} exists; not overwritten")
    return key


def load_organization_key(path: str | os.PathLike[str]) -> Identity:
    """Read an organization key file (:func:`new_organization_key`).

    Raises:
        ConfigError: unreadable, corrupt, writable by group/others, or its ``org_key`` does
            not match its key.
    """
    path = pathlib.Path(path)
    source = f"organization key file {path}"
    data = _json_object(_read_private(path, "organization key file"), ORG_KEY_FORMAT, source)
    try:
        key = Identity.from_private_bytes(bytes.fromhex(data["organization_ed25519"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source} holds a malformed key: {exc!r}") from exc
    if data.get("org_key", key.peer_id_str) != key.peer_id_str:
        raise ConfigError(f"{source} says {data.get('org_key')} but its key is {key.peer_id_str}")
    return key


def membership_to_json(organization: str, member: bytes, membership: records.Membership) -> str:
    """A membership certificate file's text (module docstring) for ``member`` (peer ID bytes)
    and a :class:`~ps_p2p.records.Membership`."""
    return json.dumps({
        "format": MEMBERSHIP_FORMAT, "version": 1, "organization": organization,
        "org_key": base58.b58encode(membership.org_key).decode("ascii"),
        "member": base58.b58encode(member).decode("ascii"),
        "expires_at_ms": membership.expires_at_ms, "signature": membership.signature.hex(),
    }, indent=2) + "\n"


def load_membership(path: str | os.PathLike[str],
                    member: bytes) -> tuple[str, records.Membership]:
    """Read a membership certificate file and check it for this node.

    Args:
        path: the file ``ps-node org sign`` wrote.
        member: this node's peer ID bytes: the certificate must name it.

    Returns:
        ``(organization name, Membership)`` for :class:`~ps_p2p.records.NodeRecord`.

    Raises:
        ConfigError: unreadable or malformed, for another peer ID, or its signature does not
            verify under its organization key (its expiry is the node's to watch).
    """
    path = pathlib.Path(path)
    source = f"membership certificate {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {source}: {exc}") from exc
    data = _json_object(text, MEMBERSHIP_FORMAT, source)
    organization = data.get("organization")
    expires = data.get("expires_at_ms")
    if not isinstance(organization, str) or not organization:
        raise ConfigError(f"{source} names no organization")
    if isinstance(expires, bool) or not isinstance(expires, int) or expires < 0:
        raise ConfigError(f"{source} has no valid expires_at_ms")
    if _peer_id_bytes(data.get("member"), f"{source}: member") != member:
        raise ConfigError(
            f"{source} certifies {data.get('member')}, not this node "
            f"({base58.b58encode(member).decode('ascii')}); ask the organization for one")
    org_key = _peer_id_bytes(data.get("org_key"), f"{source}: org_key")
    try:
        signature = bytes.fromhex(str(data.get("signature")))
    except ValueError as exc:
        raise ConfigError(f"{source} has a malformed signature") from exc
    membership = records.Membership(org_key, expires, signature)
    probe = records.NodeRecord(member, (), frozenset({records.Role.USER}), bytes(32),
                               organization=organization, membership=membership)
    try:
        records.verify_membership(probe)
    except PsError as exc:
        raise ConfigError(f"{source} does not verify under its organization key: {exc}") from exc
    if len(organization.encode("utf-8")) > records.MAX_ORGANIZATION_BYTES:
        raise ConfigError(f"{source}: organization name over "
                          f"{records.MAX_ORGANIZATION_BYTES} UTF-8 bytes")
    return organization, membership


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
    "load_membership",
    "load_or_create_keys",
    "load_organization_key",
    "membership_to_json",
    "new_organization_key",
]
