"""Inference engines of model nodes: one interface, in-process transformers, a vLLM server, or
a simulated GPU.

Public face::

    from ps_p2p.engines import load_engine, Engine, SamplingParams, Completion, TokenScores

    engine = load_engine("transformers", model="../shared/models/stories260K")
    completion = await engine.complete("Once upon a time", SamplingParams(max_tokens=32))
    scores = await engine.score("Once upon a time", completion.text)   # scores.perplexity

See :mod:`ps_p2p.engines.base` for the interface, :mod:`ps_p2p.engines.transformers_engine`,
:mod:`ps_p2p.engines.vllm_engine` and :mod:`ps_p2p.engines.sim_engine` (no model: a cost model's
latencies and dummy text) for the implementations, :mod:`ps_p2p.engines.prefix_cache` for the
prefix-cache index whose KV-cache events (:mod:`ps_p2p.engines.kv_events`) engines report.
"""

from __future__ import annotations

import pathlib

from ps_p2p.engines.base import Completion, Engine, SamplingParams, StreamChunk, TokenScores
from ps_p2p.engines.sim_cost import SimParams
from ps_p2p.errors import ConfigError, EngineError

__all__ = [
    "ENGINE_KINDS",
    "Completion",
    "Engine",
    "SamplingParams",
    "SimParams",
    "StreamChunk",
    "TokenScores",
    "default_model_id",
    "load_engine",
]

ENGINE_KINDS = ("transformers", "vllm", "sim")


def default_model_id(model: str) -> str:
    """The model ID announced for ``model`` when none is configured.

    The last path component: the folder name (``models/stories260K`` -> ``stories260K``), a
    ``.gguf`` file's stem (``stories260K.gguf`` -> ``stories260K``), or the last part of a hub
    name as vLLM serves it (``meta-llama/Llama-3.1-8B`` -> ``Llama-3.1-8B``).
    """
    path = pathlib.PurePath(model.rstrip("/\\"))
    if path.suffix.lower() == ".gguf":
        return path.stem
    return path.name or model


def load_engine(
    kind: str,
    *,
    model: str,
    device: str = "cpu",
    base_url: str = "http://127.0.0.1:8000",
    model_id: str | None = None,
    prefix_cache_blocks: int | None = None,
    sim: SimParams | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
) -> Engine:
    """A ready engine (blocking: loading a model takes seconds to minutes).

    Args:
        kind: ``"transformers"`` (``model`` is a local model folder or ``.gguf`` file, run on
            ``device``), ``"vllm"`` (``model`` is the name the vLLM server at ``base_url``
            serves; the server is asked for its context window now) or ``"sim"`` (``model`` is
            only a name: no weights; :mod:`ps_p2p.engines.sim_engine`).
        model: see ``kind``.
        device: torch device of the transformers engine (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        base_url: the vLLM server.
        model_id: announced model ID; defaults to :func:`default_model_id` of ``model``.
        prefix_cache_blocks: transformers: blocks of its prefix cache (0: none); None: the
            engine's default.
        sim: sim: its parameters; None: :class:`SimParams` defaults.
        kv_events_endpoint, kv_events_replay_endpoint: vLLM: where the server publishes its
            KV-cache events (``--kv-events-config``; DESIGN.md "vLLM 0.33"), e.g.
            ``tcp://127.0.0.1:5557`` and ``tcp://127.0.0.1:5558``; None: not subscribed (the
            node's HR-subtree then stays empty and it forwards by load only).

    Raises:
        ConfigError: unknown ``kind``; no ``model``; for transformers, no file or folder at
            ``model``; for vLLM, the server does not serve ``model``.
        EngineError: loading failed (bad checkpoint, device unavailable, transformers not
            installed), or the vLLM server cannot be reached.
    """
    if kind not in ENGINE_KINDS:
        raise ConfigError(f"unknown engine {kind!r}: expected one of {', '.join(ENGINE_KINDS)}")
    if not model:
        raise ConfigError(f"the {kind} engine needs a model")
    model_id = model_id or default_model_id(model)
    if kind == "transformers":
        path = pathlib.Path(model).expanduser()
        if not path.exists():
            raise ConfigError(f"no model folder or .gguf file at {path}")
        try:
            from ps_p2p.engines.transformers_engine import TransformersEngine
        except ImportError as exc:
            raise EngineError(
                f"the transformers engine needs torch and transformers "
                f"(pip install 'ps_p2p[transformers]'): {exc}"
            ) from exc
        options = {} if prefix_cache_blocks is None else {"prefix_cache_blocks": prefix_cache_blocks}
        return TransformersEngine.load(path, device=device, model_id=model_id, **options)

    if kind == "sim":
        from ps_p2p.engines.sim_engine import SimEngine

        return SimEngine(model_id, sim)

    from ps_p2p.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(base_url, model, model_id=model_id,
                        kv_events_endpoint=kv_events_endpoint,
                        kv_events_replay_endpoint=kv_events_replay_endpoint)
    served = engine.served_models_blocking()
    if model not in served:
        raise ConfigError(
            f"the vLLM server at {engine.base_url} serves {sorted(served)}, not {model!r}"
        )
    engine.max_context = served[model]
    return engine
