"""The user's check of response cloves against a verified answer (ps_p2p.overlay.requests)."""

from __future__ import annotations

import dataclasses

from ps_p2p.crypto import sida
from ps_p2p.overlay.requests import Audit, consistent, verify_clove_signature

ANSWER = b"a signed answer from the model node" * 20


def _audit_and_cloves():
    cloves = sida.encode(ANSWER, total=4, threshold=3)
    return Audit(good=cloves[:3], payload=ANSWER), cloves


def test_an_untouched_clove_of_the_answer_is_consistent():
    audit, cloves = _audit_and_cloves()
    assert all(consistent(audit, c) for c in cloves)


def test_a_clove_with_an_altered_fragment_or_key_share_is_caught():
    audit, cloves = _audit_and_cloves()
    fragment = bytearray(cloves[3].fragment)
    fragment[5] ^= 1
    assert not consistent(audit, dataclasses.replace(cloves[3], fragment=bytes(fragment)))
    share = bytearray(cloves[3].key_share)
    share[0] ^= 1
    assert not consistent(audit, dataclasses.replace(cloves[3], key_share=bytes(share)))


def test_a_different_clove_at_an_index_already_verified_is_caught():
    audit, cloves = _audit_and_cloves()
    other = sida.encode(ANSWER, total=4, threshold=3, message_id=cloves[0].message_id)
    assert not consistent(audit, other[1])


def _signed_clove(identity):
    from ps_p2p import records
    from ps_p2p.protocols.clove_codec import clove_to_bytes

    (clove, *_) = sida.encode(ANSWER, total=4, threshold=3)
    raw = clove_to_bytes(clove)
    return clove, raw, identity.sign(records.clove_signing_bytes(clove.message_id, raw))


def test_a_clove_the_model_node_signed_verifies_under_its_key():
    from ps_p2p.keys import Identity

    model = Identity.generate()
    clove, raw, signature = _signed_clove(model)
    assert verify_clove_signature(model.peer_id, clove.message_id, raw, signature)


def test_a_clove_altered_after_signing_fails_the_model_nodes_signature():
    from ps_p2p.keys import Identity

    model = Identity.generate()
    clove, raw, signature = _signed_clove(model)
    altered = raw[:-1] + bytes([raw[-1] ^ 1])
    assert not verify_clove_signature(model.peer_id, clove.message_id, altered, signature)
    assert not verify_clove_signature(Identity.generate().peer_id, clove.message_id, raw, signature)
