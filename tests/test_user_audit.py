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
