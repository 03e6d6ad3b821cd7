"""A cheaper substitute model for verification experiments (issue 18): TEST ONLY.

A dishonest operator that claims model M but serves a smaller model would train the smaller
one to imitate M on the text it expects to serve. :func:`substitute_model` does that on the CPU
in a few minutes, seeded: a Llama of the same tokenizer and a fraction of M's size, trained by
distillation (KL divergence to M's next-token distribution at every position) on sequences of
shared text (MT-Bench and ShareGPT first turns, cut to ``context`` tokens) continued by M's own
samples at temperature 1, so it learns both the prompts users send and the answers M gives.

The trained weights are cached under ``cache_dir`` (default: ``$PS_CACHE_DIR`` or the system's
temporary folder, ``ps_p2p-substitute/<key>``, the key a hash of the teacher's weights and the
training settings), never in the repository; a second call loads them.

Measured (stories260K, 2 shared cores, default settings): see benchmarks/README.md,
"Verification experiment".
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import tempfile
import time
from collections.abc import Sequence

#: Tokenizer files copied next to the trained weights (so the folder loads like the teacher).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "special_tokens_map.json", "generation_config.json")


def default_texts(shared: str | os.PathLike[str] | None = None, limit: int = 600) -> list[str]:
    """Prompts of the shared data (MT-Bench then ShareGPT first turns) of at most ``limit``
    characters; [] when the data is absent."""
    from ps_p2p.devnet import shared_dir
    from ps_p2p.prompts import load_prompts

    root = pathlib.Path(shared) if shared else shared_dir()
    out: list[str] = []
    for rel in ("data/mtbench/question.jsonl", "data/sharegpt/ShareGPT_V3_filtered_500.json"):
        path = root / rel
        if path.is_file():
            out += [p.text for p in load_prompts(path) if len(p.text) <= limit]
    return out


def substitute_model(
    path: str | os.PathLike[str],
    *,
    texts: Sequence[str] | None = None,
    hidden: int = 32,
    layers: int = 3,
    steps: int = 1500,
    batch: int = 16,
    context: int = 96,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    model_id: str | None = None,
):  # type: ignore[no-untyped-def]
    """A :class:`~ps_p2p.engines.transformers_engine.TransformersEngine` of a small Llama
    distilled from the model at ``path`` (module docstring), announced as ``model_id`` (default:
    the teacher's ID, which is the point).

    Args:
        path: the teacher (a Llama folder with its tokenizer).
        texts: training prompts (default :func:`default_texts`).
        hidden, layers: the student's width and depth (stories260K: 64 and 5).
        steps, batch, context: optimiser steps, sequences per step, tokens per sequence.
        seed: seeds data order, sampling and initialisation.
        cache_dir: where trained weights are kept (module docstring).

    Raises:
        ValueError: no training text.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ps_p2p.engines.transformers_engine import TransformersEngine

    texts = list(texts if texts is not None else default_texts())
    if not texts:
        raise ValueError("no training text for the substitute model")
    src = pathlib.Path(path)
    weights = sorted(src.glob("*.safetensors")) or sorted(src.glob("*.bin"))
    key = hashlib.sha256(json.dumps(
        [hidden, layers, steps, batch, context, seed, len(texts)]).encode())
    for w in weights:
        key.update(w.read_bytes())
    base = pathlib.Path(cache_dir or os.environ.get("PS_CACHE_DIR") or tempfile.gettempdir())
    out = base / "ps_p2p-substitute" / key.hexdigest()[:16]
    if not (out / "config.json").is_file():
        teacher = TransformersEngine.load(src, prefix_cache_blocks=0)
        tcfg = teacher.model.config
        cfg = LlamaConfig(
            vocab_size=tcfg.vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 8),
            num_key_value_heads=max(1, hidden // 16), max_position_embeddings=
            tcfg.max_position_embeddings, bos_token_id=tcfg.bos_token_id,
            eos_token_id=tcfg.eos_token_id, tie_word_embeddings=False)
        torch.manual_seed(seed)
        student = LlamaForCausalLM(cfg)
        _distil(teacher, student, texts, steps=steps, batch=batch, context=context, seed=seed)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        student.save_pretrained(tmp)
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, tmp / name)
        tmp.replace(out) if not out.exists() else shutil.rmtree(tmp)
    engine = TransformersEngine.load(out, prefix_cache_blocks=0)
    engine.model_id = model_id or TransformersEngine.load(src, prefix_cache_blocks=0).model_id
    return engine


def _distil(teacher, student, texts: Sequence[str], *, steps: int, batch: int,  # type: ignore
            context: int, seed: int, corpus: int = 1024) -> None:
    """KL(teacher || student) over every position of ``corpus`` sequences: a shared-text prompt
    (at most context / 2 tokens) continued by the teacher's samples at T = 1 to ``context``."""
    import torch

    rng = random.Random(seed)
    tok = teacher.tokenizer
    gen = torch.Generator().manual_seed(seed)
    tmodel = teacher.model
    started = time.monotonic()
    prompts = [ids[: context // 2] for ids in (tok(t)["input_ids"] for t in texts) if len(ids) > 1]
    by_len: dict[int, list[list[int]]] = {}
    for _ in range(corpus):
        p = rng.choice(prompts)
        by_len.setdefault(len(p), []).append(p)
    seqs: list[list[int]] = []
    with torch.no_grad():  # batched sampling, prompts of one length together
        for group in by_len.values():
            for lo in range(0, len(group), 64):
                x = torch.tensor(group[lo: lo + 64])
                past = None
                step_in = x
                while x.shape[1] < context:
                    out = tmodel(input_ids=step_in, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    nxt = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1,
                                            generator=gen)
                    x = torch.cat([x, nxt], dim=1)
                    step_in = nxt
                seqs += x.tolist()
    data = torch.tensor(seqs)
    print(f"substitute: {len(seqs)} sequences of {context} tokens sampled "
          f"({time.monotonic() - started:.0f} s)", flush=True)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps,
                                                pct_start=0.1)
    student.train()
    for step in range(steps):
        rows = data[torch.randint(0, len(seqs), (batch,), generator=gen)]
        with torch.no_grad():
            target = torch.log_softmax(tmodel(input_ids=rows, use_cache=False).logits.float(), -1)
        logp = torch.log_softmax(student(input_ids=rows, use_cache=False).logits.float(), -1)
        loss = (target.exp() * (target - logp)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"substitute: step {step} KL {loss.item():.3f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    student.eval()


__all__ = ["default_texts", "substitute_model"]
