"""Challenge requests sealed for the committee: AES-256-GCM under a key only verifiers hold.

Pure but for :func:`generate_committee_key` (``os.urandom``) and :func:`load_committee_key` (a
file).

Why: an EPOCH_REPORT must carry each answered challenge's request Q, so that every verifier can
check that Q asks the planned prompt with the menu's parameters (the value check of
:mod:`ps_p2p.verification.service`). Blocks are served to every listed node (blocksync), so a
report that carried Q in clear published every challenge prompt: a model node could then flag
any later request whose prompt it had seen in a report (issue 16: with prompts reused 97.7% of
the time over 300 epochs). The model node's signature covers SHA-256(Q), not Q
(:mod:`ps_p2p.responses`), so the chain keeps that hash in clear for the deterministic
signature checks and carries Q sealed: only holders of the committee key read it.

Byte layouts (``bytes`` = u32 length || data, as in :mod:`ps_p2p.records.canonical`)::

    committee key   32 random bytes, generated once per chain (``ps-node testnet``), written
                    only into the verifiers' homes
    key commitment  hex SHA-256(KEY_COMMIT_DOMAIN || key): the genesis'
                    ``verification.committee_key_sha256``; a verifier with another key refuses
                    to start (:func:`check_committee_key`)
    sealing key     HKDF-SHA256(ikm = committee key, salt = none, info = SEAL_DOMAIN
                    || bytes(request hash), 32 bytes)
    sealed Q        AES-256-GCM(sealing key, nonce = 12 zero bytes, plaintext = Q,
                    associated data = SEAL_DOMAIN): len(Q) + 16 bytes

A fixed nonce is safe here: each request hash has its own sealing key, and a request hash names
one Q (SHA-256 collision resistance), so one (key, nonce) pair only ever seals one plaintext.
Sealing is thus deterministic and needs no randomness. The hash in clear lets nobody confirm a
guess of Q: Q holds a fresh random request ID and the reply proxies' path IDs.

Who can read Q: the committee (every verifier holds the key; a verifier can already choose the
prompts, so it learns nothing new). A model node, or anyone reading blocks, sees SHA-256(Q),
the sealed length (so Q's length to the byte) and the answer's signed fields in clear: the answer
text and token counts stay public, because the signature covers them and every validator checks
it (what a classifier can learn from those is the subject of a later issue; docs/verification.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ps_p2p.consensus.encoding import lp
from ps_p2p.errors import ConfigError, VerificationError

KEY_COMMIT_DOMAIN = b"planetserve/v1/committee-key\x00"
SEAL_DOMAIN = b"planetserve/v1/sealed-request\x00"
#: Bytes of a committee key.
COMMITTEE_KEY_BYTES = 32
#: Bytes a sealed request adds to Q (the GCM tag).
SEAL_OVERHEAD = 16
_NONCE = bytes(12)
_HASH_BYTES = 32


def key_commitment(key: bytes) -> str:
    """Hex SHA-256(KEY_COMMIT_DOMAIN || key): what the genesis commits (64 hex digits).

    Raises:
        ValueError: ``key`` is not 32 bytes.
    """
    _check_key(key, ValueError)
    return hashlib.sha256(KEY_COMMIT_DOMAIN + bytes(key)).hexdigest()


def check_committee_key(key: bytes, commitment: str) -> None:
    """Check a verifier's committee key against the genesis' commitment.

    Raises:
        ConfigError: no commitment in the genesis, a key that is not 32 bytes, or another key
            than the committed one.
    """
    if not commitment:
        raise ConfigError("the genesis commits no committee key (verification."
                          "committee_key_sha256): its reports could not seal the challenges")
    _check_key(key, ConfigError)
    if not hmac.compare_digest(key_commitment(key), commitment):
        raise ConfigError(f"[verification] committee_key is not the one the genesis commits "
                          f"({commitment[:12]}...)")


def generate_committee_key() -> bytes:
    """32 fresh random bytes (``os.urandom``) for a new chain."""
    return os.urandom(COMMITTEE_KEY_BYTES)


def load_committee_key(value: str) -> bytes:
    """A committee key from the ``[verification] committee_key`` setting: 64 hex digits, or the
    path of a file holding them (surrounding whitespace ignored).

    Raises:
        ConfigError: an unreadable file, or not 64 hex digits.
    """
    text = value.strip()
    if len(text) != 2 * COMMITTEE_KEY_BYTES or not _is_hex(text):
        path = pathlib.Path(text).expanduser()
        try:
            text = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"[verification] committee_key: cannot read {path}: {exc}") from exc
    if len(text) != 2 * COMMITTEE_KEY_BYTES or not _is_hex(text):
        raise ConfigError("[verification] committee_key must be 64 hex digits (32 bytes)")
    return bytes.fromhex(text)


def seal_request(key: bytes, request_hash: bytes, request: bytes) -> bytes:
    """Q sealed for the committee (module docstring): ``len(request) + 16`` bytes.

    Raises:
        ValueError: ``key`` not 32 bytes, ``request_hash`` not 32 bytes, or not SHA-256 of
            ``request`` (a local bug).
    """
    _check_key(key, ValueError)
    if hashlib.sha256(bytes(request)).digest() != bytes(request_hash):
        raise ValueError("request_hash is not SHA-256 of the request")
    return AESGCM(_sealing_key(key, request_hash)).encrypt(_NONCE, bytes(request), SEAL_DOMAIN)


def open_request(key: bytes, request_hash: bytes, sealed: bytes) -> bytes:
    """Q from a sealed request; checks that it hashes to ``request_hash``.

    Raises:
        VerificationError: the seal does not open under ``key`` for ``request_hash`` (another
            key, another hash, altered bytes), or what it holds is not the hashed request.
        ValueError: ``key`` or ``request_hash`` not 32 bytes.
    """
    _check_key(key, ValueError)
    try:
        request = AESGCM(_sealing_key(key, request_hash)).decrypt(
            _NONCE, bytes(sealed), SEAL_DOMAIN)
    except InvalidTag:
        raise VerificationError("the sealed request does not open under the committee key") \
            from None
    if hashlib.sha256(request).digest() != bytes(request_hash):  # pragma: no cover - HKDF binds
        raise VerificationError("the sealed request is not the signed one")
    return request


def _sealing_key(key: bytes, request_hash: bytes) -> bytes:
    if not isinstance(request_hash, (bytes, bytearray)) or len(request_hash) != _HASH_BYTES:
        raise ValueError("a request hash is 32 bytes")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=SEAL_DOMAIN + lp(bytes(request_hash))).derive(bytes(key))


def _check_key(key: bytes, error: type[Exception]) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != COMMITTEE_KEY_BYTES:
        raise error(f"a committee key is {COMMITTEE_KEY_BYTES} bytes")


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


__all__ = [
    "COMMITTEE_KEY_BYTES",
    "SEAL_OVERHEAD",
    "check_committee_key",
    "generate_committee_key",
    "key_commitment",
    "load_committee_key",
    "open_request",
    "seal_request",
]
