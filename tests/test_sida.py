"""S-IDA core (ps_p2p.crypto.sida): correctness, secrecy of the key shares, tamper resistance."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_p2p.crypto import sida
from ps_p2p.errors import DecodeError, PsError, RemoteProtocolError

MESSAGE = b"Once upon a time, a little model answered a prompt it could not trace. " * 40
MESSAGE_ID = bytes(range(16))


# ---------------------------------------------------------------------------------------- helpers


class ScriptedRandom:
    """A ``random_bytes`` that returns scripted chunks, in order, and records the sizes asked."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.asked: list[int] = []

    def __call__(self, n: int) -> bytes:
        self.asked.append(n)
        chunk = self.chunks.pop(0)
        assert len(chunk) == n, f"asked for {n} bytes, script has {len(chunk)}"
        return chunk


def seeded_bytes(seed: int):
    rng = random.Random(seed)
    return rng.randbytes


def gf_mul(a: int, b: int) -> int:
    """GF(2^8) mod 0x11B by shift-and-add: independent of the module's tables."""
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11B
        b >>= 1
    return r


def gf_inv(a: int) -> int:
    return next(b for b in range(1, 256) if gf_mul(a, b) == 1)


def poly_eval(coeffs: list[int], x: int) -> int:
    acc = 0
    for c in reversed(coeffs):
        acc = gf_mul(acc, x) ^ c
    return acc


def poly_through(points: list[tuple[int, int]]) -> list[int]:
    """Coefficients (constant first) of the polynomial of degree < len(points) through them."""
    result = [0] * len(points)
    for i, (xi, yi) in enumerate(points):
        basis = [1]  # prod_{j != i} (X - x_j) / (x_i - x_j); minus is XOR in GF(2^8)
        denom = 1
        for j, (xj, _) in enumerate(points):
            if j == i:
                continue
            basis = [
                (basis[d - 1] if d > 0 else 0) ^ (gf_mul(basis[d], xj) if d < len(basis) else 0)
                for d in range(len(basis) + 1)
            ]
            denom = gf_mul(denom, xi ^ xj)
        scale = gf_mul(yi, gf_inv(denom))
        for d, b in enumerate(basis):
            result[d] ^= gf_mul(b, scale)
    return result


def flip(data: bytes, position: int, mask: int) -> bytes:
    position %= len(data)
    return data[:position] + bytes((data[position] ^ mask,)) + data[position + 1:]


# ---------------------------------------------------------------------------------------- decoding


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 8),
    data=st.data(),
    size=st.one_of(st.integers(0, 64), st.integers(0, 70 * 1024)),
    seed=st.integers(0, 2**32),
)
def test_any_k_of_n_cloves_decode_in_any_order(n, data, size, seed):
    k = data.draw(st.integers(1, n), label="k")
    order = data.draw(st.permutations(range(n)), label="order")
    message = random.Random(seed).randbytes(size)
    cloves = sida.encode(message, total=n, threshold=k)
    assert [c.index for c in cloves] == list(range(n))
    assert sida.decode([cloves[i] for i in order[:k]]) == message
    assert sida.decode([cloves[i] for i in order]) == message


def test_every_k_subset_decodes_for_all_small_n_and_k():
    for n in range(1, 7):
        for k in range(1, n + 1):
            message = random.Random(n * 16 + k).randbytes(50 + n)
            cloves = sida.encode(message, n, k)
            for subset in itertools.combinations(cloves, k):
                assert sida.decode_subset(list(reversed(subset))) == message


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 1000, 30 * 1024])
@pytest.mark.parametrize("n,k", [(1, 1), (4, 1), (4, 3), (4, 4), (7, 7), (16, 16), (16, 5)])
def test_fragments_are_equal_and_ceil_of_sealed_size_over_k(size, n, k):
    cloves = sida.encode(bytes(size), n, k)
    assert {len(c.fragment) for c in cloves} == {-(-(size + sida.TAG_BYTES + 1) // k)}
    for clove in cloves:
        clove.check()
    assert sida.decode(cloves[n - k:]) == bytes(size)


def test_largest_message_gives_largest_fragment_and_passes_check():
    message = bytes(sida.MAX_MESSAGE_BYTES)
    cloves = sida.encode(message, total=2, threshold=1)
    assert len(cloves[1].fragment) == sida.MAX_FRAGMENT_BYTES
    cloves[1].check()
    assert sida.decode([cloves[1]]) == message


def test_data_fragments_are_the_padded_ciphertext_and_parity_differs():
    cloves = sida.encode(MESSAGE, 4, 3)
    joined = b"".join(c.fragment for c in cloves[:3])
    pad = joined[-1]
    assert joined[-pad:] == bytes((pad,)) * pad
    assert len(joined) - pad == len(MESSAGE) + sida.TAG_BYTES
    assert MESSAGE[:64] not in joined  # encrypted, not plain
    assert cloves[3].fragment not in {c.fragment for c in cloves[:3]}


def test_fewer_than_k_distinct_cloves_raise_decode_error():
    cloves = sida.encode(MESSAGE, 4, 3)
    with pytest.raises(DecodeError):
        sida.decode(cloves[:2])
    with pytest.raises(DecodeError):
        sida.decode([cloves[0], cloves[1], cloves[1], cloves[0]])  # 4 cloves, 2 indices
    with pytest.raises(DecodeError):
        sida.decode([])


def test_decode_subset_wants_exactly_k_distinct_cloves():
    cloves = sida.encode(MESSAGE, 4, 3)
    with pytest.raises(RemoteProtocolError):
        sida.decode_subset(cloves)
    with pytest.raises(RemoteProtocolError):
        sida.decode_subset([cloves[0], cloves[0], cloves[1]])
    assert sida.decode_subset([cloves[3], cloves[1], cloves[0]]) == MESSAGE


# ---------------------------------------------------------------------------------------- encode


def test_encode_draws_message_id_then_key_then_coefficients():
    key, coefficients = bytes([7]) * 32, bytes(range(64))
    rng = ScriptedRandom(MESSAGE_ID, key, coefficients)
    cloves = sida.encode(MESSAGE, 4, 3, random_bytes=rng)
    assert rng.asked == [16, 32, 64]
    assert {c.message_id for c in cloves} == {MESSAGE_ID}
    assert cloves[0].key_share == bytes(
        k ^ a ^ b for k, a, b in zip(key, coefficients[:32], coefficients[32:])
    )  # f(1) = K + a1 + a2


def test_encode_uses_the_given_message_id_and_is_deterministic_in_its_randomness():
    first = sida.encode(MESSAGE, 5, 2, random_bytes=seeded_bytes(1), message_id=MESSAGE_ID)
    second = sida.encode(MESSAGE, 5, 2, random_bytes=seeded_bytes(1), message_id=MESSAGE_ID)
    other = sida.encode(MESSAGE, 5, 2, random_bytes=seeded_bytes(2), message_id=MESSAGE_ID)
    assert first == second
    assert {c.message_id for c in first} == {MESSAGE_ID}
    assert first[0].fragment != other[0].fragment
    assert first[0].key_share != other[0].key_share


@pytest.mark.parametrize("total,threshold", [(0, 0), (3, 4), (4, 0), (17, 3), (17, 17), (-1, 1)])
def test_encode_rejects_bad_total_or_threshold(total, threshold):
    with pytest.raises(PsError):
        sida.encode(MESSAGE, total, threshold)


def test_encode_rejects_oversized_message_and_bad_message_id():
    with pytest.raises(PsError):
        sida.encode(bytes(sida.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(PsError):
        sida.encode(MESSAGE, message_id=bytes(15))


def test_encode_rejects_random_bytes_of_the_wrong_length():
    with pytest.raises(PsError):
        sida.encode(MESSAGE, random_bytes=lambda n: bytes(n - 1))


# -------------------------------------------------------------------------------------- key shares


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 8), data=st.data(), seed=st.integers(0, 2**32))
def test_key_shares_are_shamir_points_at_index_plus_one_over_0x11b(n, data, seed):
    k = data.draw(st.integers(2, n), label="k")
    rng = random.Random(seed)
    key, coefficients = rng.randbytes(32), rng.randbytes(32 * (k - 1))
    cloves = sida.encode(
        MESSAGE, n, k, random_bytes=ScriptedRandom(key, coefficients), message_id=MESSAGE_ID
    )
    for clove in cloves:
        for b in range(32):
            poly = [key[b]] + [coefficients[32 * j + b] for j in range(k - 1)]
            assert clove.key_share[b] == poly_eval(poly, clove.index + 1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 8), data=st.data(), seed=st.integers(0, 2**32))
def test_k_minus_1_key_shares_are_consistent_with_every_key(n, data, seed):
    """For any key K2 some coefficients give the same k - 1 shares: they reveal nothing of K.

    The coefficients are found by interpolating through (0, K2) and the k - 1 observed shares with
    independent field arithmetic; a scheme whose k - 1 shares depended on K would fail here.
    """
    k = data.draw(st.integers(2, n), label="k")
    seen = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=k - 1, max_size=k - 1)))
    rng = random.Random(seed)
    key1, coefficients1, key2 = rng.randbytes(32), rng.randbytes(32 * (k - 1)), rng.randbytes(32)
    assert key1 != key2
    first = sida.encode(
        MESSAGE, n, k, random_bytes=ScriptedRandom(key1, coefficients1), message_id=MESSAGE_ID
    )

    coefficients2 = bytearray(32 * (k - 1))
    for b in range(32):
        points = [(0, key2[b])] + [(i + 1, first[i].key_share[b]) for i in seen]
        poly = poly_through(points)
        for j in range(1, k):
            coefficients2[32 * (j - 1) + b] = poly[j]
    second = sida.encode(
        MESSAGE,
        n,
        k,
        random_bytes=ScriptedRandom(key2, bytes(coefficients2)),
        message_id=MESSAGE_ID,
    )

    assert [second[i].key_share for i in seen] == [first[i].key_share for i in seen]
    assert [c.key_share for c in second] != [c.key_share for c in first]  # k shares do differ
    assert sida.decode(second) == MESSAGE


def test_a_single_share_of_2_of_n_takes_every_value_for_a_fixed_key():
    key = bytes([0x5A]) * 32
    values = set()
    for a in range(256):
        cloves = sida.encode(
            b"x", 3, 2, random_bytes=ScriptedRandom(key, bytes([a]) * 32), message_id=MESSAGE_ID
        )
        values.add(cloves[2].key_share[0])
    assert values == set(range(256))


# ---------------------------------------------------------------------------------------- tampering


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 6),
    data=st.data(),
    size=st.integers(0, 3000),
    field=st.sampled_from(["fragment", "key_share"]),
    position=st.integers(0, 2**20),
    mask=st.integers(1, 255),
)
def test_a_tampered_clove_never_yields_wrong_plaintext(n, data, size, field, position, mask):
    k = data.draw(st.integers(1, n - 1), label="k")
    bad_index = data.draw(st.integers(0, n - 1), label="bad_index")
    message = random.Random(size).randbytes(size)
    cloves = sida.encode(message, n, k)
    bad = cloves[bad_index]
    tampered = dataclasses.replace(bad, **{field: flip(getattr(bad, field), position, mask)})
    cloves[bad_index] = tampered

    assert sida.decode(cloves) == message  # another k-subset decodes
    with_bad = [tampered] + [c for c in cloves if c is not tampered][: k - 1]
    with pytest.raises(DecodeError):
        sida.decode(with_bad)  # exactly k cloves, one tampered


def test_tampered_first_clove_is_skipped_for_the_next_subset():
    cloves = sida.encode(MESSAGE, 4, 3)
    cloves[0] = dataclasses.replace(cloves[0], fragment=flip(cloves[0].fragment, 3, 0x80))
    assert sida.decode(cloves) == MESSAGE
    with pytest.raises(DecodeError):
        sida.decode(cloves, max_attempts=3)  # the three subsets with clove 0 fail first


@pytest.mark.parametrize("from_end", [2, 3])
def test_a_flipped_padding_byte_is_caught(from_end):
    message = bytes(2)  # 2 + 16-byte tag = 18 = 0 mod 3: padded with three bytes of value 3
    cloves = sida.encode(message, 4, 3)
    assert cloves[2].fragment[-3:] == b"\x03\x03\x03"
    cloves[2] = dataclasses.replace(cloves[2], fragment=flip(cloves[2].fragment, -from_end, 0x10))
    with pytest.raises(DecodeError):
        sida.decode(cloves[:3])
    assert sida.decode(cloves) == message


def test_two_tampered_cloves_of_4_of_3_raise_decode_error():
    cloves = sida.encode(MESSAGE, 4, 3)
    cloves[1] = dataclasses.replace(cloves[1], key_share=flip(cloves[1].key_share, 0, 1))
    cloves[3] = dataclasses.replace(cloves[3], fragment=flip(cloves[3].fragment, -1, 1))
    with pytest.raises(DecodeError):
        sida.decode(cloves)


def test_relabelled_message_id_fails_the_aead_check():
    other_id = bytes(16)
    cloves = [dataclasses.replace(c, message_id=other_id) for c in sida.encode(MESSAGE, 4, 3)]
    with pytest.raises(DecodeError):
        sida.decode(cloves)


# ------------------------------------------------------------------------------------- bad headers


@pytest.mark.parametrize(
    "changes",
    [
        {"message_id": bytes(16)},
        {"total": 5},
        {"threshold": 2},
    ],
)
def test_cloves_disagreeing_on_header_raise_remote_protocol_error(changes):
    cloves = sida.encode(MESSAGE, 4, 3, message_id=MESSAGE_ID)
    cloves[2] = dataclasses.replace(cloves[2], **changes)
    with pytest.raises(RemoteProtocolError):
        sida.decode(cloves)
    with pytest.raises(RemoteProtocolError):
        sida.decode_subset(cloves[:3])


def test_cloves_disagreeing_on_fragment_size_raise_remote_protocol_error():
    cloves = sida.encode(MESSAGE, 4, 3)
    cloves[1] = dataclasses.replace(cloves[1], fragment=cloves[1].fragment + b"\x00")
    with pytest.raises(RemoteProtocolError):
        sida.decode(cloves)
    with pytest.raises(RemoteProtocolError):
        sida.decode_subset(cloves[:3])


GOOD = sida.Clove(MESSAGE_ID, 1, 4, 3, b"fragment", bytes(32))


@pytest.mark.parametrize(
    "changes",
    [
        {"message_id": bytes(15)},
        {"message_id": bytes(17)},
        {"index": -1},
        {"index": 4},
        {"total": 0, "threshold": 0, "index": 0},
        {"threshold": 0},
        {"threshold": 5},
        {"total": 17, "index": 16},
        {"key_share": bytes(31)},
        {"key_share": bytes(33)},
        {"fragment": b""},
        {"fragment": bytes(sida.MAX_FRAGMENT_BYTES + 1)},
    ],
)
def test_clove_check_rejects_out_of_range_fields(changes):
    GOOD.check()
    with pytest.raises(RemoteProtocolError):
        dataclasses.replace(GOOD, **changes).check()


def test_decode_checks_each_clove():
    cloves = sida.encode(MESSAGE, 4, 3)
    cloves[0] = dataclasses.replace(cloves[0], index=7)
    with pytest.raises(RemoteProtocolError):
        sida.decode(cloves)


# ---------------------------------------------------------------------------------------- field


def test_mul_tables_match_shift_and_add_multiplication():
    for a in range(256):
        row = sida.MUL[a]
        assert len(row) == 256
        for b in range(0, 256, 7):
            assert row[b] == gf_mul(a, b)
