"""The Sentry (ps_p2p.gossip.sentry): common prefix detection, L by Appendix A3 eqs. (1)-(3), the
versioned ChunkLengths value and its canonical bytes."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps_p2p.consensus.encoding import u32, u64
from ps_p2p.errors import LocalProtocolError, RemoteProtocolError
from ps_p2p.gossip.hr_tree import chunk_hashes
from ps_p2p.gossip.sentry import (
    CHUNK_LENGTHS_DOMAIN,
    MAX_CHUNK_LENGTHS,
    ChunkLengths,
    Sentry,
    common_prefix_lengths,
    lengths_from_prefixes,
)

KEY = b"model-group-key-" * 2


def words(rng: random.Random, n: int) -> list[int]:
    """n random token IDs from a Llama-3-sized vocabulary."""
    return [rng.randrange(128_000) for _ in range(n)]


def prompt_set(seed: int = 1) -> tuple[list[int], list[list[int]]]:
    """100 prompts: 70 start with one 40-token system prompt, 30 share nothing."""
    rng = random.Random(seed)
    system = words(rng, 40)
    prompts = [system + words(rng, rng.randrange(5, 60)) for _ in range(70)]
    prompts += [words(rng, rng.randrange(20, 100)) for _ in range(30)]
    rng.shuffle(prompts)
    return system, prompts


def boundaries(lengths) -> set[int]:
    return set(itertools.accumulate(lengths))


# -------------------------------------------------------------------------------- detection


def test_a_system_prompt_shared_by_70_percent_is_detected():
    _, prompts = prompt_set()
    assert common_prefix_lengths(prompts, min_count=10) == (40,)


def test_the_sentry_turns_a_detected_system_prompt_into_l():
    _, prompts = prompt_set()
    sentry = Sentry(ChunkLengths(0), refresh_requests=100, separator_tokens=4)
    proposals = [sentry.observe(p) for p in prompts]
    assert proposals[:-1] == [None] * 99
    assert proposals[-1] == ChunkLengths(1, (40, 4), 32)


def test_prompts_sharing_the_system_prompt_share_exactly_its_chunk():
    system, prompts = prompt_set()
    detected = common_prefix_lengths(prompts, min_count=10)
    lengths = ChunkLengths(1, lengths_from_prefixes(detected, 4))
    rng = random.Random(2)
    a = chunk_hashes(system + words(rng, 60), lengths, KEY)
    b = chunk_hashes(system + words(rng, 60), lengths, KEY)
    assert a[0] == b[0] and a[1] != b[1]


def test_nested_prefixes_are_both_detected():
    rng = random.Random(3)
    system, tools = words(rng, 40), words(rng, 60)
    prompts = [system + tools + words(rng, 30) for _ in range(30)]  # a tool schema up to 100
    prompts += [system + words(rng, 30) for _ in range(30)]
    prompts += [words(rng, 50) for _ in range(40)]
    assert common_prefix_lengths(prompts, min_count=10) == (40, 100)


def test_a_system_prompt_where_two_tool_schemas_branch_off_is_detected():
    rng = random.Random(11)
    system, tool_a, tool_b = words(rng, 40), words(rng, 60), words(rng, 80)
    prompts = [system + tool_a + words(rng, 20) for _ in range(35)]
    prompts += [system + tool_b + words(rng, 20) for _ in range(35)]
    prompts += [words(rng, 60) for _ in range(30)]
    assert common_prefix_lengths(prompts, min_count=10) == (40, 100, 120)


def test_nothing_common_gives_default_chunking():
    rng = random.Random(4)
    prompts = [words(rng, 80) for _ in range(100)]
    assert common_prefix_lengths(prompts, min_count=10) == ()
    sentry = Sentry(ChunkLengths(0), refresh_requests=100)
    assert [sentry.observe(p) for p in prompts] == [None] * 100
    assert sentry.propose() == ChunkLengths(0, (), 32)


def test_a_shared_beginning_token_is_not_a_common_prefix():
    rng = random.Random(5)
    prompts = [[128_000] + words(rng, 50) for _ in range(100)]  # every prompt starts with BOS
    assert common_prefix_lengths(prompts, min_count=10) == ()


def test_user_text_that_often_starts_alike_adds_no_chunk_within_delta():
    rng = random.Random(6)
    system, what_is = words(rng, 40), words(rng, 3)
    prompts = [system + what_is + words(rng, 20) for _ in range(15)]  # "What is ..."
    prompts += [system + words(rng, 20) for _ in range(55)]
    prompts += [words(rng, 60) for _ in range(30)]
    assert common_prefix_lengths(prompts, min_count=10) == (40, 43)  # 15 prompts leave at 43
    assert lengths_from_prefixes((40, 43), 4) == (40, 4)  # 43 - 40 - 4 < 1: dropped
    assert common_prefix_lengths(prompts, min_count=16) == (40,)


def test_a_prefix_below_the_threshold_is_ignored():
    rng = random.Random(7)
    system = words(rng, 40)
    prompts = [system + words(rng, 20) for _ in range(9)] + [words(rng, 60) for _ in range(91)]
    assert common_prefix_lengths(prompts, min_count=10) == ()
    assert common_prefix_lengths(prompts, min_count=9) == (40,)


def test_identical_prompts_share_their_whole_length():
    assert common_prefix_lengths([list(range(50))] * 5, min_count=2) == (50,)


def test_prompts_are_cut_to_max_prefix_tokens():
    rng = random.Random(8)
    document = words(rng, 300)
    prompts = [document + words(rng, 10) for _ in range(20)]
    assert common_prefix_lengths(prompts, min_count=10) == (300,)
    # cut at 200 tokens, the shared document does not end there: no boundary at the cut
    assert common_prefix_lengths(prompts, min_count=10, max_prefix_tokens=200) == ()


def test_the_truncation_is_not_counted_as_a_common_prefix():
    # issue 19 finding 6: two long documents after one system prompt; the Sentry cuts every
    # prompt to max_prefix_tokens, which must not show up as a "common prefix length"
    rng = random.Random(18)
    system = words(rng, 40)
    docs = [words(rng, 500), words(rng, 500)]
    prompts = [system + docs[i % 2] + words(rng, 10) for i in range(40)]
    assert common_prefix_lengths(prompts, min_count=10, max_prefix_tokens=300) == (40,)
    sentry = Sentry(ChunkLengths(0), refresh_requests=40, max_samples=40, max_prefix_tokens=300)
    for p in prompts:
        sentry.observe(p)
    assert sentry.prefix_lengths() == (40,)


def test_at_most_max_prefixes_lengths_are_kept_those_most_prompts_leave_at():
    rng = random.Random(9)
    prompts = []
    for length, count in ((20, 5), (50, 12), (90, 8)):
        shared = words(rng, length)
        prompts += [shared + words(rng, 10) for _ in range(count)]
    assert common_prefix_lengths(prompts, min_count=4) == (20, 50, 90)
    assert common_prefix_lengths(prompts, min_count=4, max_prefixes=2) == (50, 90)


def test_min_count_must_be_at_least_two():
    with pytest.raises(LocalProtocolError):
        common_prefix_lengths([[1, 2]], min_count=1)


# ------------------------------------------------------------------------ L, eqs. (1)-(3)


@pytest.mark.parametrize(
    ("prefixes", "delta", "expected"),
    [
        ([40], 4, (40, 4)),  # eq. (1), eq. (2)
        ([40, 100, 250], 4, (40, 4, 56, 4, 146, 4)),  # 100 - 40 - 4 = 56, 250 - 100 - 4 = 146
        ([250, 40, 100, 100], 4, (40, 4, 56, 4, 146, 4)),  # any order, repeats ignored
        ([16, 21], 4, (16, 4, 1, 4)),  # 21 - 16 - 4 = 1: the shortest chunk eq. (3) allows
        ([16, 20, 60], 4, (16, 4, 40, 4)),  # 20 - 16 - 4 = 0: 20 dropped
        ([30], 1, (30, 1)),
        ([], 4, ()),
    ],
)
def test_l_follows_eqs_1_to_3(prefixes, delta, expected):
    assert lengths_from_prefixes(prefixes, delta) == expected


@given(st.lists(st.integers(1, 5000), max_size=20), st.integers(1, 16))
def test_every_kept_prefix_ends_on_a_chunk_boundary_followed_by_a_delta_chunk(prefixes, delta):
    lengths = lengths_from_prefixes(prefixes, delta)
    assert all(n >= 1 for n in lengths)
    kept = list(itertools.accumulate(lengths))[0::2]
    assert set(kept) <= set(prefixes)
    assert lengths[1::2] == (delta,) * len(kept)
    assert boundaries(lengths) == {b for s in kept for b in (s, s + delta)}
    for s in prefixes:  # a prefix is dropped only when within delta tokens after a kept one
        assert s in kept or any(0 < s - k <= delta for k in kept)


@pytest.mark.parametrize("bad", [([40], 0), ([0], 4)])
def test_bad_l_inputs_are_refused(bad):
    with pytest.raises(LocalProtocolError):
        lengths_from_prefixes(*bad)


# --------------------------------------------------------------------------------- Sentry


def test_the_sentry_samples_within_its_bound_across_the_window():
    rng = random.Random(10)
    sentry = Sentry(ChunkLengths(0), refresh_requests=1000, max_samples=10)
    for _ in range(1000):
        sentry.observe(words(rng, 30))
    assert sentry.sample_size == 10  # one prompt in every 100
    assert sentry.requests == 1000


def test_a_proposal_bumps_the_version_only_when_l_changes():
    _, prompts = prompt_set()
    sentry = Sentry(ChunkLengths(7, (), 16), refresh_requests=100)
    proposal = None
    for p in prompts:
        proposal = sentry.observe(p) or proposal
    assert proposal == ChunkLengths(8, (40, 4), 16)
    sentry.adopt(proposal)
    assert [sentry.observe(p) for p in prompts] == [None] * 100  # same L again
    with pytest.raises(LocalProtocolError):
        sentry.adopt(ChunkLengths(3))


def test_sentry_arguments_are_checked():
    with pytest.raises(LocalProtocolError):
        Sentry(ChunkLengths(0), separator_tokens=0)
    with pytest.raises(LocalProtocolError):
        Sentry(ChunkLengths(0), min_fraction=1.5)


# --------------------------------------------------------------------------- ChunkLengths


lengths_values = st.builds(
    ChunkLengths,
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(1, 1 << 16), max_size=10).map(tuple),
    st.integers(1, 1 << 16),
)


@given(lengths_values)
def test_chunk_lengths_round_trip_through_canonical_bytes(value):
    data = value.encode()
    assert data.startswith(CHUNK_LENGTHS_DOMAIN)
    assert ChunkLengths.decode(data) == value
    assert hash(ChunkLengths.decode(data)) == hash(value)


@given(lengths_values, st.integers(0, 300))
def test_chunk_ends_and_counts_agree(value, index):
    end = value.end(index)
    assert end == sum(value.length(i) for i in range(index + 1))
    assert value.chunk_count(end) == index + 1
    assert value.chunk_count(end - 1) == index


def encoded(version=1, default=32, lengths=(40, 4)) -> bytes:
    return (CHUNK_LENGTHS_DOMAIN + u64(version) + u32(default) + u32(len(lengths))
            + b"".join(u32(n) for n in lengths))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(encoded(default=0), id="default 0"),
        pytest.param(encoded(lengths=(40, 0)), id="a length of 0"),
        pytest.param(encoded(lengths=(1 << 16 + 1,)), id="a length over the limit"),
        pytest.param(encoded()[:-1], id="truncated"),
        pytest.param(encoded() + b"\x00", id="trailing byte"),
        pytest.param(b"planetserve/v1/other\x00" + encoded()[len(CHUNK_LENGTHS_DOMAIN):],
                     id="wrong domain"),
        pytest.param(encoded(lengths=(1,) * (MAX_CHUNK_LENGTHS + 1)), id="too many lengths"),
    ],
)
def test_malformed_chunk_lengths_are_refused(data):
    with pytest.raises(RemoteProtocolError):
        ChunkLengths.decode(data)


def test_chunk_lengths_out_of_range_are_refused_locally():
    with pytest.raises(LocalProtocolError):
        ChunkLengths(-1)
    with pytest.raises(LocalProtocolError):
        ChunkLengths(0, (0,))
    with pytest.raises(LocalProtocolError):
        ChunkLengths(0, (), 0)
