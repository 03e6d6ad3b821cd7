"""Prompt files for ``ps-node devnet --prompts`` (ps_p2p.devnet.load_prompts)."""

from __future__ import annotations

import json

import pytest

from ps_p2p.errors import ConfigError
from ps_p2p.devnet import load_prompts


@pytest.mark.parametrize(
    "relative, first_id",
    [
        ("mtbench/question.jsonl", "81"),
        ("sharegpt/ShareGPT_V3_filtered_500.json", None),
        ("toolbench/G1_instruction.json", None),
        ("code/HumanEval_for_code_generation.jsonl", None),
        ("loogle/shortdep_qa.jsonl", None),
    ],
)
def test_every_shared_prompt_set_yields_non_empty_prompts(shared, relative, first_id):
    prompts = load_prompts(shared / "data" / relative, limit=5)
    assert len(prompts) == 5
    assert all(p.text.strip() for p in prompts)
    assert len({p.prompt_id for p in prompts}) == 5
    if first_id is not None:
        assert prompts[0].prompt_id == first_id


def test_mtbench_prompts_are_the_first_turns(shared):
    path = shared / "data" / "mtbench" / "question.jsonl"
    first = json.loads(path.read_text().splitlines()[0])
    assert load_prompts(path, limit=1)[0].text == first["turns"][0]


def test_text_files_give_one_prompt_per_non_empty_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\n\n  \nThe fox and the crow\n")
    prompts = load_prompts(path)
    assert [(p.prompt_id, p.text) for p in prompts] == [
        ("1", "Once upon a time"), ("2", "The fox and the crow"),
    ]


def test_missing_or_promptless_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_prompts(tmp_path / "absent.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"nothing": 1}\n')
    with pytest.raises(ConfigError, match="no prompts"):
        load_prompts(empty)


_ENGINE: list = []


def _stories(shared):
    pytest.importorskip("transformers")
    if not _ENGINE:
        from ps_p2p.engines.transformers_engine import TransformersEngine

        _ENGINE.append(TransformersEngine.load(shared / "models" / "stories260K"))
    return _ENGINE[0]


@pytest.mark.needs_shared
async def test_a_generated_pool_is_distinct_secret_seeded_and_in_no_public_set(shared):
    from ps_p2p.prompts import generate_prompts

    engine = _stories(shared)
    pool = await generate_prompts(engine, 8, b"s" * 32)
    texts = [p.text for p in pool]
    assert len(set(texts)) == 8 and all(t.strip() for t in texts)
    assert texts == [p.text for p in await generate_prompts(engine, 8, b"s" * 32)]
    assert not set(texts) & {p.text for p in await generate_prompts(engine, 8, b"t" * 32)}
    public = {p.text for rel in ("mtbench/question.jsonl",
                                 "sharegpt/ShareGPT_V3_filtered_500.json")
              for p in load_prompts(shared / "data" / rel)}
    assert not set(texts) & public


@pytest.mark.parametrize("count, seed", [(0, b"s" * 32), (10_001, b"s" * 32), (1, b"short")])
async def test_generating_a_pool_refuses_a_bad_count_or_a_short_seed(count, seed):
    from ps_p2p.prompts import generate_prompts

    with pytest.raises(ValueError):
        await generate_prompts(None, count, seed)  # type: ignore[arg-type]
