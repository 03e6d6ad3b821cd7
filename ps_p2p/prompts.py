"""Real prompts from files: the devnet's workload and the verifiers' challenge pool.

Reads a text file (one prompt per line) or one of the JSON/JSONL shapes of ../shared/data
(MT-Bench, ShareGPT, ToolBench, the code sets, LooGLE), and generates a private challenge pool
(:func:`generate_prompts`).

A challenge pool must be private (issue 16): a model node that has the pool's prompts (a public
data set such as MT-Bench or ShareGPT) flags every request that asks one of them as a challenge,
answers those honestly and serves its users with a cheaper model. ``ps-node testnet
--challenge-pool generate`` therefore samples the pool from the committee's model under a
secret seed and writes it only into the verifiers' homes; a real network uses the committee's
own unpublished prompts, drawn from what its users ask (docs/verification.md).
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ps_p2p.errors import ConfigError

if TYPE_CHECKING:
    from ps_p2p.engines.base import Engine

GENERATE_DOMAIN = b"planetserve/v1/generated-prompt\x00"
#: Most draws :func:`generate_prompts` makes per prompt asked (empty or repeated samples).
MAX_GENERATE_DRAWS = 4

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


async def generate_prompts(engine: Engine, count: int, seed: bytes, *,
                           max_tokens: int = 32) -> list[Prompt]:
    """``count`` distinct prompts sampled from ``engine`` (the committee's model) under ``seed``.

    Draw k is ``engine.complete("", temperature 1, max_tokens, seed = the first 8 bytes of
    HMAC-SHA256(seed, GENERATE_DOMAIN || u32(k)))`` cut after its last complete word; empty or
    repeated texts are skipped. Whoever knows ``seed`` and the model can re-make the pool, so
    keep it secret (``ps-node testnet`` draws it from ``os.urandom`` and forgets it). The texts
    look like the model's own output (for stories260K: TinyStories openings), not like user
    traffic: they hide a challenge from look-ups in public data sets and in the chain, not from
    a classifier of style (docs/verification.md).

    Args:
        count: prompts wanted, in [1, :data:`MAX_PROMPTS`].
        seed: >= 16 secret bytes.
        max_tokens: tokens sampled per draw, >= 2.

    Raises:
        ValueError: an argument out of range.
        ConfigError: fewer than ``count`` distinct texts in ``MAX_GENERATE_DRAWS * count``
            draws.
        EngineError: the engine failed.
    """
    from ps_p2p.engines.base import SamplingParams

    if not 1 <= count <= MAX_PROMPTS or len(seed) < 16 or max_tokens < 2:
        raise ValueError("count in [1, 10000], seed >= 16 bytes, max_tokens >= 2")
    texts: dict[str, None] = {}
    for k in range(MAX_GENERATE_DRAWS * count):
        if len(texts) == count:
            break
        digest = hmac.new(seed, GENERATE_DOMAIN + k.to_bytes(4, "big"), hashlib.sha256).digest()
        c = await engine.complete("", SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=int.from_bytes(digest[:8], "big")))
        text = c.text.strip()
        if c.finish_reason == "length" and " " in text:
            text = text.rsplit(" ", 1)[0].rstrip()  # the last word may be cut
        if text and text not in texts:
            texts[text] = None
    if len(texts) < count:
        raise ConfigError(f"the model gave {len(texts)} distinct prompts, not {count}")
    return [Prompt(f"g{i}", t) for i, t in enumerate(texts)]


__all__ = ["MAX_PROMPTS", "Prompt", "generate_prompts", "load_prompts"]
