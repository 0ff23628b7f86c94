"""Static capabilities of the ``hf`` backend per role (import-light: read by ``verl backends``)."""

from __future__ import annotations

from verl_core.kernel.capabilities import (
    RewardCapabilities,
    RolloutCapabilities,
    TrainingCapabilities,
)

__all__ = ["REWARD_CAPABILITIES", "ROLLOUT_CAPABILITIES", "training_capabilities"]


def training_capabilities(role: str) -> TrainingCapabilities:
    """Capabilities of the training engine for ``role`` (actor, reference or critic)."""
    critic = role == "critic"
    return TrainingCapabilities(
        log_probs=not critic,
        entropy=not critic,
        values=critic,
        tensor_parallel=False,
        pipeline_parallel=False,
        data_parallel=True,
        micro_batch_tokens=True,
        packed_sequences=False,  # an engine that packs (HFOptions.pack_sequences resolved) declares True
        gradient_checkpointing=True,
        offload=True,
        checkpoint=True,
        lora=role == "actor",
        dtypes=frozenset({"float32", "bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )


ROLLOUT_CAPABILITIES = RolloutCapabilities(
    temperature=True,
    top_p=True,
    top_k=True,
    stop_token_ids=True,
    seeding="per_sample",
    exact_log_probs=True,
    exact_log_probs_truncated=True,
    weight_update=True,
    lora_adapters=True,
    sleep_frees_memory=False,
    concurrent_weight_update=True,  # generate and weight writes take turns (RolloutEngineBase)
    tensor_parallel=False,
    pipeline_parallel=False,
    dtypes=frozenset({"float32", "bfloat16"}),
    devices=frozenset({"cpu", "cuda"}),
)
"""Capabilities of the rollout engine (its own sampling loop over the model with a KV cache)."""

REWARD_CAPABILITIES = RewardCapabilities(
    scores=True, token_scores=False, needs_text=False, sequence_classifier=True, devices=frozenset({"cpu", "cuda"})
)
"""Capabilities of the reward-model engine."""
