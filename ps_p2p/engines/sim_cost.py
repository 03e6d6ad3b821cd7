"""The cost model and tokenizer of the simulated engine (pure: no clock, no sleeps).

:class:`~ps_p2p.engines.sim_engine.SimEngine` serves no model: it spends the time a GPU would
spend, by this model, and answers with deterministic dummy text. It lets a devnet or a benchmark
exercise overlay forwarding (PlanetServe sec. 3.3: KV-cache reuse and the load factor
F_LB = L * (Q / C)) with the latencies of a real deployment, on a machine without a GPU.

Cost model (:class:`SimCostModel`)::

    prefill seconds     = uncached prompt tokens / prefill_tokens_per_s
    decode step seconds = step_time * (1 + batch_growth * (batch - 1))

where ``batch`` is the number of requests decoding together at that step (at most
``max_batch``; more requests wait for a slot). Prompt tokens found in the prefix cache cost
nothing; at least the last prompt token is always computed (its logits pick the first output
token), as in vLLM.

Default parameters (:class:`SimParams`) are estimates for Llama 3 8B in float16 on one NVIDIA RTX
A6000 (48 GB), the paper's model node (sec. 5), not measurements:

* ``prefill_tokens_per_s = 4000``: about 16 GFLOP a token (2 x 8B parameters) at ~40% of the
  A6000's ~155 TFLOPS dense FP16 tensor throughput;
* ``step_time = 0.025`` s: one decode step reads the ~16 GB of weights at the A6000's 768 GB/s
  (21 ms), plus overhead;
* ``batch_growth = 0.03``: each further sequence adds its KV-cache reads and some compute, ~3%
  of a step (vLLM decode throughput grows nearly linearly with the batch at small batches);
* ``cache_blocks = 13_000``: 90% of 48 GB minus ~17 GB of weights and activations leaves ~26 GB
  of KV cache; at 128 KiB a token (2 x 32 layers x 8 KV heads x 128 x 2 bytes) that is ~213k
  tokens, 13,000 blocks of 16;
* ``max_context = 8192`` (Llama 3), ``max_batch = 32``, ``block_size = 16`` (vLLM's default).

Tokenizer (:func:`encode`, :func:`decode`): text's UTF-8 bytes, cut into groups of
:data:`BYTES_PER_TOKEN` (3: BPE tokenizers average about 4 on English, but real token IDs fit
in 32 bits, as the HR-tree's chunk hashes require); a group ``g`` is the token ID
``int.from_bytes(b"\\x01" + g, "big")`` (the leading 1 keeps the group's length), so IDs of text
are in [256, 2**25) and decode back exactly; IDs below 256 are special
(:data:`BOS_ID` = 1, added first when ``add_special_tokens``). Any UTF-8 text round-trips. A
prompt that shares its first ``3 * k`` bytes with another shares its first ``k`` text tokens.

Dummy text (:func:`dummy_text`): ``max_tokens`` words of exactly 3 ASCII bytes (one token each),
taken in turn from :data:`WORDS` from an offset that a hash of the prompt's tokens (and the seed)
picks: the same prompt always gets the same answer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ps_p2p.errors import EngineError

__all__ = [
    "BOS_ID",
    "BYTES_PER_TOKEN",
    "MAX_TOKEN_ID",
    "WORDS",
    "SimCostModel",
    "SimParams",
    "SimTiming",
    "decode",
    "dummy_text",
    "encode",
]

#: UTF-8 bytes per text token
BYTES_PER_TOKEN = 3
#: beginning of sequence, added first to a prompt
BOS_ID = 1
#: token IDs are in [0, MAX_TOKEN_ID]
MAX_TOKEN_ID = 2**25 - 1  # int.from_bytes(b"\x01\xff\xff\xff", "big")
_FIRST_TEXT_ID = 256

#: the dummy answer's words, each exactly BYTES_PER_TOKEN ASCII bytes (one token)
WORDS = (
    " to", " me", " we", " an", " be", " so", " go", " up", " it", " is", " no", " on",
    " do", " he", " by", " or",
)


@dataclass(frozen=True)
class SimParams:
    """Parameters of the simulated engine (config table ``[sim]``); defaults: module docstring.

    Attributes:
        prefill_tokens_per_s: prompt tokens computed per second (> 0).
        step_time: seconds of one decode step of a batch of one (> 0).
        batch_growth: relative growth of a step's time per further sequence in the batch (>= 0).
        max_batch: requests decoded together, >= 1; more wait for a slot (the engine's
            concurrent capacity).
        max_context: prompt + generated tokens, >= 2.
        block_size: tokens per prefix-cache block, >= 1.
        cache_blocks: prefix-cache capacity in blocks, >= 0 (0: no prefix cache).

    Raises:
        ValueError: a value out of its range.
    """

    prefill_tokens_per_s: float = 4000.0
    step_time: float = 0.025
    batch_growth: float = 0.03
    max_batch: int = 32
    max_context: int = 8192
    block_size: int = 16
    cache_blocks: int = 13_000

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "step_time"):
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, not {value!r}")
        if not _finite(self.batch_growth) or self.batch_growth < 0:
            raise ValueError(f"batch_growth must be a finite number >= 0, not {self.batch_growth!r}")
        for name, low in (("max_batch", 1), ("max_context", 2), ("block_size", 1),
                          ("cache_blocks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, not {value!r}")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SimTiming:
    """Seconds one request takes by the cost model.

    Attributes:
        prefill: computing the uncached prompt tokens.
        decode: all decode steps.
    """

    prefill: float
    decode: float

    @property
    def total(self) -> float:
        return self.prefill + self.decode


class SimCostModel:
    """Durations of prefill and decode steps (formulas in the module docstring).

    Args:
        params: the engine's parameters.
    """

    def __init__(self, params: SimParams) -> None:
        self.params = params

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Seconds to compute ``uncached_tokens`` (>= 0) prompt tokens."""
        if uncached_tokens < 0:
            raise ValueError(f"uncached_tokens must be >= 0, not {uncached_tokens}")
        return uncached_tokens / self.params.prefill_tokens_per_s

    def step_seconds(self, batch: int) -> float:
        """Seconds of one decode step while ``batch`` (>= 1) requests decode together."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, not {batch}")
        return self.params.step_time * (1.0 + self.params.batch_growth * (batch - 1))

    def request(
        self, *, cached_tokens: int, uncached_tokens: int, output_tokens: int, batch: int = 1
    ) -> SimTiming:
        """The time of one request whose batch stays ``batch`` throughout.

        Args:
            cached_tokens: prompt tokens found in the prefix cache (free; for the record).
            uncached_tokens: prompt tokens to compute.
            output_tokens: decode steps.
            batch: requests decoding together.
        """
        if cached_tokens < 0 or output_tokens < 0:
            raise ValueError("token counts must be >= 0")
        return SimTiming(
            prefill=self.prefill_seconds(uncached_tokens),
            decode=output_tokens * self.step_seconds(batch),
        )


def encode(text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token IDs of ``text`` (module docstring); ``[BOS_ID]`` first when ``add_special_tokens``.

    Lone surrogates (not UTF-8) are encoded as U+FFFD.
    """
    data = text.encode("utf-8", "replace")
    ids = [BOS_ID] if add_special_tokens else []
    for i in range(0, len(data), BYTES_PER_TOKEN):
        ids.append(int.from_bytes(b"\x01" + data[i : i + BYTES_PER_TOKEN], "big"))
    return ids


def decode(token_ids: Sequence[int]) -> str:
    """Text of ``token_ids``; special tokens (below 256) are skipped; bytes that are not UTF-8
    (a character cut between two token lists) decode as U+FFFD.

    Raises:
        EngineError: an ID that is not an int in [0, MAX_TOKEN_ID], or an ID of 256 or more
            that no text encodes to (its first byte is not the length marker 1).
    """
    data = bytearray()
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise EngineError(f"token ID {t!r} is out of the sim vocabulary [0, {MAX_TOKEN_ID}]")
        if t >= _FIRST_TEXT_ID:
            if t.bit_length() % 8 != 1:
                raise EngineError(f"token ID {t} encodes no text in the sim vocabulary")
            data += t.to_bytes((t.bit_length() + 7) // 8, "big")[1:]
    return data.decode("utf-8", "replace")


def dummy_text(prompt_ids: Sequence[int], max_tokens: int, seed: int = 0) -> list[str]:
    """The answer's ``max_tokens`` pieces, one token each (module docstring)."""
    h = hashlib.blake2b(digest_size=8, person=b"ps-sim-answer")
    h.update(seed.to_bytes(8, "big"))
    h.update(b"".join(t.to_bytes(8, "big") for t in prompt_ids))
    start = int.from_bytes(h.digest(), "big") % len(WORDS)
    return [WORDS[(start + i) % len(WORDS)] for i in range(max_tokens)]
