"""Organizations are keys (issue 16): ``ps-node org new`` / ``org sign`` make an organization key
and its members' certificates, a node loads its certificate (``membership``) and carries it in
its record, which then shares the organization key's reputation; no network."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from ps_p2p import cli, records
from ps_p2p.config import NodeConfig
from ps_p2p.errors import ConfigError, InvalidMembershipError
from ps_p2p.keys import (
    Identity,
    NodeKeys,
    load_membership,
    load_organization_key,
    membership_to_json,
)
from ps_p2p.node import Node
from ps_p2p.testing.fakes import InstantEngine

DAY_MS = 86_400_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_ps_node_org_new_and_sign_make_a_certificate_the_member_loads(tmp_path, capsys):
    member = NodeKeys.generate().identity
    key_file, cert = tmp_path / "acme.key", tmp_path / "member.json"
    assert cli.main(["org", "new", "--key-file", str(key_file)]) == 0
    org_id = capsys.readouterr().out.strip()
    assert load_organization_key(key_file).peer_id_str == org_id
    assert key_file.stat().st_mode & 0o077 == 0
    assert cli.main(["org", "sign", "--key-file", str(key_file), "--name", "acme",
                     "--member", member.peer_id_str, "--days", "7", "--out", str(cert)]) == 0
    name, membership = load_membership(cert, member.peer_id)
    assert name == "acme" and membership.org_key == load_organization_key(key_file).peer_id
    assert 6.9 * DAY_MS < membership.expires_at_ms - now_ms() <= 7 * DAY_MS
    # an organization key is never overwritten: its members and reputation hang on it
    assert cli.main(["org", "new", "--key-file", str(key_file)]) == 2
    assert "not overwritten" in capsys.readouterr().err


def _cert(tmp_path, member: bytes, *, org: Identity | None = None, name: str = "acme",
          expires: int | None = None, edit=None) -> str:
    org = org or Identity.from_private_bytes(b"\x05" * 32)
    m = records.sign_membership(org, name, member, expires or now_ms() + DAY_MS)
    data = json.loads(membership_to_json(name, member, m))
    if edit:
        edit(data)
    path = tmp_path / "cert.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(organization="other"), "does not verify"),  # a renamed organization
    (lambda d: d.update(expires_at_ms=d["expires_at_ms"] + 1), "does not verify"),
    (lambda d: d.update(org_key=Identity.generate().peer_id_str), "does not verify"),
    (lambda d: d.update(member=Identity.generate().peer_id_str), "not this node"),
    (lambda d: d.update(format="x"), "not a planetserve-org-membership"),
])
def test_a_certificate_that_does_not_certify_this_node_is_refused_at_load(tmp_path, edit,
                                                                           match):
    me = NodeKeys.generate().identity.peer_id
    with pytest.raises(ConfigError, match=match):
        load_membership(_cert(tmp_path, me, edit=edit), me)


def _node(tmp_path, membership: str | None) -> tuple[Node, NodeKeys]:
    keys = NodeKeys.generate()
    config = NodeConfig(roles=["model"], home=str(tmp_path / "home"), model="fake",
                        bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + keys.identity.peer_id_str],
                        membership=membership)
    return Node(config, keys, InstantEngine()), keys


def test_a_members_record_names_the_organization_and_ends_with_its_certificate(tmp_path):
    keys = NodeKeys.generate()
    t = now_ms()
    org = Identity.from_private_bytes(b"\x05" * 32)
    path = _cert(tmp_path, keys.identity.peer_id, org=org, expires=t + 60_000)
    node = Node(NodeConfig(roles=["model"], home=str(tmp_path / "home"), model="fake",
                           bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + keys.identity.peer_id_str],
                           membership=path), keys, InstantEngine())
    node.listen_addrs = ["/ip4/127.0.0.1/tcp/4001"]
    record = node.own_record(t, lifetime_ms=3_600_000)
    records.check_record(record, t)  # the record's and the certificate's signatures
    assert record.organization == "acme" and record.membership.org_key == org.peer_id
    assert record.expires_at_ms == t + 60_000  # clamped to the certificate
    assert records.record_subject(record) == b"orgkey\x00" + org.peer_id


def test_once_its_certificate_expired_a_node_registers_without_the_organization(tmp_path,
                                                                                 caplog):
    keys = NodeKeys.generate()
    t = now_ms()
    path = _cert(tmp_path, keys.identity.peer_id, expires=t + 1000)
    node = Node(NodeConfig(roles=["model"], home=str(tmp_path / "home"), model="fake",
                           bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + keys.identity.peer_id_str],
                           membership=path), keys, InstantEngine())
    node.listen_addrs = ["/ip4/127.0.0.1/tcp/4001"]
    with caplog.at_level("ERROR", logger="ps_p2p.node"):
        first = node.own_record(t + 1000, lifetime_ms=60_000)
        node.own_record(t + 2000, lifetime_ms=60_000)
    records.check_record(first, t + 1000)
    assert first.organization == "" and first.membership is None
    assert records.record_subject(first) == b"node\x00" + keys.identity.peer_id
    assert sum("expired" in r.getMessage() for r in caplog.records) == 1  # told once


def test_a_node_given_another_nodes_certificate_does_not_start(tmp_path):
    other = NodeKeys.generate().identity.peer_id
    with pytest.raises(ConfigError, match="not this node"):
        _node(tmp_path, _cert(tmp_path, other))


def test_a_sybil_cannot_reuse_a_members_published_certificate():
    # the directory is public: the sybil copies acme's member's certificate into its record
    acme = Identity.from_private_bytes(b"\x05" * 32)
    member, sybil = Identity.generate(), Identity.generate()
    onion = bytes.fromhex("e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c")
    t = now_ms()
    cert = records.sign_membership(acme, "acme", member.peer_id, t + DAY_MS)
    stolen = records.sign_record(sybil, records.NodeRecord(
        sybil.peer_id, ("/ip4/10.0.0.1/tcp/1",), frozenset({records.Role.MODEL}), onion,
        "m", "acme", 1, t, t + 60_000, membership=cert))
    with pytest.raises(InvalidMembershipError, match="membership certificate"):
        records.check_record(stolen, t)
    honest = dataclasses.replace(stolen, peer_id=member.peer_id)
    records.check_record(records.sign_record(member, honest), t)


async def test_a_localnet_lists_the_members_of_an_organization_under_its_key():
    import trio

    from ps_p2p.testing.localnet import open_localnet

    with trio.fail_after(60):
        async with open_localnet(users=4, models=3, forwarding=False,
                                 model_organization=lambda i: "acme" if i < 2 else "") as net:
            user = net.users[0]
            while user.directory is None or any(user.directory.record(m.peer_id) is None
                                                for m in net.models):
                await user.wait_directory_update()
            listed = [user.directory.record(m.peer_id) for m in net.models]
            assert [r.organization for r in listed] == ["acme", "acme", ""]
            subjects = [records.record_subject(r) for r in listed]
            assert subjects[0] == subjects[1] == b"orgkey\x00" + listed[0].membership.org_key
            assert subjects[2] == b"node\x00" + net.models[2].peer_id
            answer = await user.user.ask("Once upon a time", timeout=30)
            assert answer.ok, answer.error
