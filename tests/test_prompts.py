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
