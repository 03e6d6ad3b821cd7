"""Real prompts from files: the devnet's workload and the verifiers' challenge pool.

Reads a text file (one prompt per line) or one of the JSON/JSONL shapes of ../shared/data
(MT-Bench, ShareGPT, ToolBench, the code sets, LooGLE).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from ps_p2p.errors import ConfigError

#: Most prompts read from one file.
MAX_PROMPTS = 10_000


@dataclass
class Prompt:
    prompt_id: str
    text: str


def load_prompts(path: str | os.PathLike[str], limit: int | None = None) -> list[Prompt]:
    """Read prompts from a text file (one per line) or a ../shared/data JSON/JSONL file.

    Understood shapes: MT-Bench (``question_id``, ``turns``: first turn), ShareGPT (``id``,
    ``conversations``: first human turn), ToolBench (``query_id``, ``query``), code sets and other
    JSONL with ``prompt``/``query``/``question``/``input``/``text``.

    Raises:
        ConfigError: missing file, unknown shape, or no prompt in it.
    """
    p = pathlib.Path(path).expanduser()
    try:
        raw = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read prompts from {p}: {exc}") from exc
    items: list[Any]
    if p.suffix == ".jsonl":
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    elif p.suffix == ".json":
        data = json.loads(raw)
        items = data if isinstance(data, list) else [data]
    else:
        items = [line for line in raw.splitlines() if line.strip()]
    prompts: list[Prompt] = []
    for i, item in enumerate(items):
        prompt = _extract_prompt(item, i)
        if prompt is not None and prompt.text.strip():
            prompts.append(prompt)
        if len(prompts) >= min(limit or MAX_PROMPTS, MAX_PROMPTS):
            break
    if not prompts:
        raise ConfigError(f"no prompts found in {p}")
    return prompts


def _extract_prompt(item: Any, i: int) -> Prompt | None:
    if isinstance(item, str):
        return Prompt(str(i + 1), item.strip())
    if not isinstance(item, dict):
        return None
    pid = str(item.get("question_id") or item.get("query_id") or item.get("id")
              or item.get("task_id") or i + 1)
    if isinstance(item.get("turns"), list) and item["turns"]:
        return Prompt(pid, str(item["turns"][0]))
    if isinstance(item.get("conversations"), list):
        for turn in item["conversations"]:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                return Prompt(pid, str(turn.get("value", "")))
        return None
    for key in ("query", "prompt", "question", "text"):
        if isinstance(item.get(key), str):
            return Prompt(pid, item[key])
    if isinstance(item.get("qa_pairs"), str):
        try:
            pairs = ast.literal_eval(item["qa_pairs"])
            return Prompt(pid, str(pairs[0]["Q"]))
        except (ValueError, SyntaxError, LookupError, TypeError):
            return None
    return None


__all__ = ["MAX_PROMPTS", "Prompt", "load_prompts"]
