"""The user's check of response cloves against a verified answer (ps_p2p.roles.user._consistent)."""

from __future__ import annotations

import dataclasses

from ps_p2p.crypto import sida
from ps_p2p.roles.user import _Audit, _consistent

ANSWER = b"a signed answer from the model node" * 20


def _audit_and_cloves():
    cloves = sida.encode(ANSWER, total=4, threshold=3)
    return _Audit(good=cloves[:3], payload=ANSWER), cloves


def test_an_untouched_clove_of_the_answer_is_consistent():
    audit, cloves = _audit_and_cloves()
    assert all(_consistent(audit, c) for c in cloves)


def test_a_clove_with_an_altered_fragment_or_key_share_is_caught():
    audit, cloves = _audit_and_cloves()
    fragment = bytearray(cloves[3].fragment)
    fragment[5] ^= 1
    assert not _consistent(audit, dataclasses.replace(cloves[3], fragment=bytes(fragment)))
    share = bytearray(cloves[3].key_share)
    share[0] ^= 1
    assert not _consistent(audit, dataclasses.replace(cloves[3], key_share=bytes(share)))


def test_a_different_clove_at_an_index_already_verified_is_caught():
    audit, cloves = _audit_and_cloves()
    other = sida.encode(ANSWER, total=4, threshold=3, message_id=cloves[0].message_id)
    assert not _consistent(audit, other[1])


class _StubOverlay:
    peer_id = b"me"
    on_backward = None
    on_path_down = None


class _StubHandle:
    class path:  # noqa: N801 - mimics PathHandle.path
        proxy = b"the-proxy"


def _signed_clove(identity):
    from ps_p2p import records
    from ps_p2p.protocols.clove_codec import clove_to_bytes

    (clove, *_) = sida.encode(ANSWER, total=4, threshold=3)
    raw = clove_to_bytes(clove)
    return clove, raw, identity.sign(records.clove_signing_bytes(clove.message_id, raw))


def test_a_clove_the_model_node_signed_passes_and_flags_nobody():
    from ps_p2p.keys import Identity
    from ps_p2p.roles.user import UserClient

    model = Identity.generate()
    client = UserClient(_StubOverlay(), lambda: None)
    clove, raw, signature = _signed_clove(model)
    assert client._signed_by(model.peer_id, clove, raw, signature, _StubHandle(), 0.0)
    assert not client._bad_proxies


def test_a_clove_altered_after_signing_convicts_the_proxy():
    from ps_p2p.keys import Identity
    from ps_p2p.roles.user import UserClient

    model = Identity.generate()
    client = UserClient(_StubOverlay(), lambda: None)
    clove, raw, signature = _signed_clove(model)
    altered = raw[:-1] + bytes([raw[-1] ^ 1])
    assert not client._signed_by(model.peer_id, clove, altered, signature, _StubHandle(), 0.0)
    assert b"the-proxy" in client._bad_proxies
