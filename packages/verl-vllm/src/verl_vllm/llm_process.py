"""The in-process ``vllm.LLM`` of the vLLM rollout engine: starting it with the process
environment it needs (and without what it would leak) and the folder's LongRoPE attention factor
as transformers reads it, the tied lm_head's refresh after a reload, and shutting it down while
other engines of the process keep the shared state."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any, Final

from verl_core import ConfigError, EngineSpec
from verl_vllm._import import import_vllm
from verl_vllm.config import VllmRolloutConfig

import_vllm()

from vllm import LLM  # noqa: E402  (after the import check, which explains a missing vLLM)

__all__ = [
    "LEAKED_ENV",
    "check_platform",
    "long_rope_attention_factor",
    "refresh_tied_lm_head",
    "restored_environ",
    "shutdown_llm",
    "start_llm",
]

# What LLM() writes into os.environ; it only matters for child processes, which must not inherit it.
LEAKED_ENV: Final = ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")
# vLLM's CPU platform lets this legacy variable override kv_cache_memory_bytes; the engine's
# explicit kv_cache_bytes wins, so it is hidden while the engine starts.
_KV_ENV: Final = "VLLM_CPU_KVCACHE_SPACE"


@contextlib.contextmanager
def restored_environ(keys: Iterable[str]) -> Iterator[None]:
    """Put ``keys`` of ``os.environ`` back as they were (set, or absent) when the block ends."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_platform(device: str) -> bool:
    """Whether the installed vLLM runs on CUDA, after checking it runs on ``device``'s type.

    Raises:
        ConfigError: the installed vLLM is built for another device type.
    """
    from vllm.platforms import current_platform

    platform = str(current_platform.device_type)
    wanted = device.split(":", 1)[0]
    if wanted != platform:
        raise ConfigError(
            f"EngineSpec.device is {device!r}, but the installed vLLM runs on {platform!r}; "
            f"set device={platform!r} or install the other build ({'verl-vllm[cuda]' if wanted == 'cuda' else 'verl-vllm[cpu]'})"
        )
    return platform == "cuda"


def long_rope_attention_factor(config: Any) -> Any:
    """``config`` (a transformers config, as vLLM loaded it) with a LongRoPE scaling's attention
    factor written as vLLM reads it: ``short_mscale`` and ``long_mscale`` of ``rope_parameters``.

    transformers scales cos and sin by ``attention_factor`` when the config sets it, else by
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` with the config's ``factor``
    (``max_position_embeddings / original_max_position_embeddings`` when it has none). vLLM's
    LongRoPE reads neither: without ``short_mscale``/``long_mscale`` it computes the default from
    ``max_position_embeddings``, so a folder that sets ``attention_factor`` (or a ``factor`` other
    than that ratio) ran with other cos and sin at every position. A ``rope_parameters`` that
    names either mscale itself, per-layer-type parameters and other rope types are left as they are.
    """
    params = getattr(config, "rope_parameters", None)
    if (not isinstance(params, dict) or params.get("rope_type") != "longrope"
            or "short_mscale" in params or "long_mscale" in params):
        return config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    config.rope_parameters = {**config.rope_parameters, "short_mscale": float(factor), "long_mscale": float(factor)}
    return config


def _own_mscale_keys(record: logging.LogRecord) -> bool:
    """False for transformers' warning about exactly the keys :func:`long_rope_attention_factor` writes."""
    ours = ("{'long_mscale', 'short_mscale'}", "{'short_mscale', 'long_mscale'}")
    return not record.getMessage().endswith(ours)


def start_llm(spec: EngineSpec, cfg: VllmRolloutConfig, *, on_gpu: bool, max_model_len: int) -> Any:
    """Start the in-process ``vllm.LLM`` of ``spec`` with ``cfg``'s options."""
    # In-process engine: weight chunks reach the model by reference, no copies over IPC.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not on_gpu:
        # vLLM would otherwise pin the calling process's OpenMP threads to cores; this process
        # also runs the trainer and other engines.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vllm-cpu 0.32 saves an AOT artifact of the compiled model that it then fails to load
        # ("'function' object has no attribute 'finalize_loading'"), so every start would
        # compile again (~10 s here); the plain torch.compile path reuses vLLM's and inductor's
        # on-disk caches (~4 s warm). vLLM reads this at every compiled call: it stays set.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    kwargs: dict[str, Any] = {
        "model": str(spec.model_path),
        "dtype": spec.dtype,
        "seed": spec.seed,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": cfg.kv_cache_bytes,
        "logprobs_mode": cfg.logprobs_mode,
        "max_num_seqs": cfg.max_num_seqs,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        # On CPU vLLM compiles the model with inductor and captures no graphs: compiled decode
        # steps are faster at the cost of a compile at start-up (cached on disk by vLLM).
        "enforce_eager": on_gpu if cfg.enforce_eager is None else cfg.enforce_eager,
        # Sampling follows the request exactly, never the folder's generation_config defaults.
        "generation_config": "vllm",
        "tensor_parallel_size": 1,
        # LongRoPE's attention factor as transformers computes it (vLLM ignores attention_factor)
        "hf_overrides": long_rope_attention_factor,
    }
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if not on_gpu:
        # vLLM's own CPU kernels (its default custom ops when eager) compute RMSNorm in bfloat16,
        # which tips tokens on a bfloat16 model (numerics::bfloat16_rms_norm_in_float32); the
        # native torch ops compute the norm in float32, as transformers does. Compiled CPU engines
        # use the native ops anyway; this makes eager ones (enforce_eager=True) do the same.
        kwargs["compilation_config"] = {"custom_ops": ["none"]}
    if on_gpu:
        kwargs["enable_sleep_mode"] = True
    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    rope_log.addFilter(_own_mscale_keys)  # vLLM validates the config after the override
    try:
        with restored_environ((*LEAKED_ENV, _KV_ENV)):
            os.environ.pop(_KV_ENV, None)
            return LLM(**kwargs)
    finally:
        rope_log.removeFilter(_own_mscale_keys)


def refresh_tied_lm_head(worker: Any) -> None:
    """Rebuild the lm_head's kernel state from the (shared) embedding weight, inside a worker.

    vLLM's CPU backend keeps a packed copy of every GEMM weight, the tied lm_head's included; an
    in-place reload that updates the embedding re-packs only the embedding, so the head would keep
    computing logits with the old weights. Elsewhere this processing is a no-op.
    """
    inner = getattr(worker, "worker", worker)
    model = inner.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None:
        method.process_weights_after_loading(head)


def shutdown_llm(llm: Any, *, others_open: bool) -> None:
    """Shut ``llm`` down; while ``others_open``, only its own parts.

    vLLM's engine shutdown also destroys the process-wide distributed state (model-parallel
    groups) that every in-process engine uses, so the last engine to close does the rest.
    """
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if others_open and core is not None and finalizer is not None:
        finalizer.detach()  # the client's finalizer would run the full shutdown when collected
        for part in ("model_executor", "scheduler"):
            stop = getattr(getattr(core, part, None), "shutdown", None)
            if callable(stop):
                stop()
        gc.unfreeze()  # what EngineCore.shutdown does besides destroying the shared state
    else:
        shutdown = getattr(client, "shutdown", None)
        if callable(shutdown):
            shutdown()
