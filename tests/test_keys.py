"""Identity and onion keys, and the key file."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
from libp2p.peer.id import ID

from ps_p2p import records
from ps_p2p.errors import ConfigError
from ps_p2p.keys import Identity, NodeKeys, load_or_create_keys


def test_peer_id_equals_libp2p_peer_id_of_the_same_key():
    identity = Identity.generate()
    key_pair = identity.libp2p_key_pair()
    assert identity.peer_id == ID.from_pubkey(key_pair.public_key).to_bytes()
    assert identity.peer_id_str == ID.from_pubkey(key_pair.public_key).to_base58()
    assert identity.peer_id_str.startswith("12D3KooW")
    assert key_pair.public_key.to_bytes() == identity.public_key


def test_libp2p_key_pair_signs_like_the_identity():
    identity = Identity.generate()
    assert identity.libp2p_key_pair().private_key.sign(b"data") == identity.sign(b"data")


def test_identity_round_trips_through_its_seed():
    identity = Identity.generate()
    again = Identity.from_private_bytes(identity.private_bytes())
    assert again.peer_id == identity.peer_id
    assert again == identity


def test_identity_signature_verifies_under_its_peer_id():
    identity = Identity.generate()
    records.verify_signature(identity.peer_id, b"hello", identity.sign(b"hello"))


def test_identity_repr_shows_no_secret():
    identity = Identity.generate()
    assert identity.private_bytes().hex() not in repr(identity)
    assert identity.peer_id_str in repr(identity)


def test_key_file_round_trip(tmp_path):
    keys = NodeKeys.generate()
    path = tmp_path / "node.key"
    keys.save(path)
    loaded = NodeKeys.load(path)
    assert loaded.identity.peer_id == keys.identity.peer_id
    assert loaded.identity.private_bytes() == keys.identity.private_bytes()
    assert loaded.onion.public == keys.onion.public
    assert loaded.onion.private_bytes() == keys.onion.private_bytes()


def test_key_file_has_a_format_version(tmp_path):
    path = tmp_path / "node.key"
    NodeKeys.generate().save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1
    assert data["format"] == "planetserve-node-keys"


def test_key_file_mode_is_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "deep" / "folder" / "node.key"
        load_or_create_keys(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left


def test_load_or_create_twice_gives_the_same_identity(tmp_path, caplog):
    path = tmp_path / "node.key"
    with caplog.at_level(logging.INFO, logger="ps_p2p.keys"):
        first = load_or_create_keys(path)
    assert any("created key file" in r.getMessage() for r in caplog.records)
    second = load_or_create_keys(path)
    assert second.identity.peer_id == first.identity.peer_id
    assert second.onion.public == first.onion.public


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "node.key"
    NodeKeys.generate().save(path)
    keys = NodeKeys.generate()
    keys.save(path)
    assert NodeKeys.load(path).identity == keys.identity


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'{"format": "planetserve-node-keys", "version": 99}',
        b'{"format": "planetserve-node-keys", "version": 1, "identity_ed25519": "zz", '
        b'"onion_x25519": "00"}',
        b'{"format": "planetserve-node-keys", "version": 1}',
    ],
)
def test_corrupt_key_file_is_a_config_error(tmp_path, content):
    path = tmp_path / "node.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ConfigError):
        load_or_create_keys(path)


def test_key_file_whose_peer_id_disagrees_is_a_config_error(tmp_path):
    path = tmp_path / "node.key"
    NodeKeys.generate().save(path)
    data = json.loads(path.read_text())
    data["peer_id"] = Identity.generate().peer_id_str
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="peer ID"):
        NodeKeys.load(path)


def test_unreadable_key_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError):
        NodeKeys.load(tmp_path / "missing.key")
    with pytest.raises(ConfigError):
        NodeKeys.load(tmp_path)  # a folder


def test_group_readable_key_file_warns_but_loads(tmp_path, caplog):
    path = tmp_path / "node.key"
    keys = NodeKeys.generate()
    keys.save(path)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="ps_p2p.keys"):
        loaded = NodeKeys.load(path)
    assert loaded.identity == keys.identity
    assert any("readable by group/others" in r.getMessage() for r in caplog.records)


def test_world_writable_key_file_is_a_config_error(tmp_path):
    path = tmp_path / "node.key"
    NodeKeys.generate().save(path)
    path.chmod(0o602)
    with pytest.raises(ConfigError, match="writable"):
        NodeKeys.load(path)
