"""System test: ``ps-node devnet`` as separate OS processes on the real TinyStories model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("perturb", ["none", "kill-relay", "tamper-clove"])
def test_devnet_answers_every_prompt_with_valid_signatures(shared, tmp_path, perturb):
    out = tmp_path / "results.jsonl"
    cmd = [
        sys.executable, "-m", "ps_p2p.cli", "--log-level", "WARNING", "devnet",
        "--model", str(shared / "models" / "stories260K"),
        "--prompts", str(shared / "data" / "mtbench" / "question.jsonl"),
        "--users", "6", "--models", "2", "--verifiers", "2",
        "--limit", "6", "--max-tokens", "24", "--concurrency", "3", "--timeout", "90",
        "--perturb", perturb, "--json", str(out), "--workdir", str(tmp_path / "net"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == ["81", "82", "83", "84", "85", "86"]
    served = set()
    for row in rows:
        assert row["ok"], row
        assert row["signature_valid"], row
        assert row["cloves_received"] >= 3
        assert row["response"], row
        assert row["error"] is None
        served.add(row["served_by"])
    assert served and all(s.startswith("12D3KooW") for s in served)
    assert "answered 6/6 prompts" in done.stdout
    if perturb == "kill-relay":
        assert "killed" in done.stdout
