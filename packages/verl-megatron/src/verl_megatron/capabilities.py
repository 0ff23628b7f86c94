"""What the Megatron engines declare they support (read by the plugin and by the engines)."""

from __future__ import annotations

from verl_core import RolloutCapabilities, TrainingCapabilities

__all__ = ["rollout_capabilities", "training_capabilities"]


def rollout_capabilities() -> RolloutCapabilities:
    """Capabilities of the Megatron rollout engine."""
    return RolloutCapabilities(
        temperature=True,
        top_p=True,
        top_k=True,
        stop_token_ids=True,
        seeding="per_sample",
        exact_log_probs=True,
        exact_log_probs_truncated=True,
        weight_update=True,
        lora_adapters=False,  # merged weights only (the trainer merges LoRA before the stream)
        sleep_frees_memory=False,
        tensor_parallel=True,
        pipeline_parallel=False,
        dtypes=frozenset({"float32", "bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )


def training_capabilities(role: str, *, packed: bool = False) -> TrainingCapabilities:
    """Capabilities of the Megatron training engine for ``role`` (actor, reference or critic).

    ``packed``: the engine runs its micro-batches packed (``MegatronOptions.pack_sequences``
    resolved on), so its token budget counts real tokens.
    """
    critic = role == "critic"
    return TrainingCapabilities(
        log_probs=not critic,
        entropy=not critic,
        values=critic,
        tensor_parallel=True,
        pipeline_parallel=True,
        data_parallel=True,
        micro_batch_tokens=True,
        packed_sequences=packed,
        gradient_checkpointing=False,
        offload=False,
        checkpoint=True,
        # LoRA needs column- and row-parallel adapters (A split like the layer's input, B like its
        # output, the tp all-reduce placed accordingly) and their merge under tp/pp: not implemented yet
        lora=False,
        dtypes=frozenset({"float32", "bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )
