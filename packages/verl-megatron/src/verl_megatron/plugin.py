"""Entry point of the ``megatron`` backend (import-light: no engine library is imported here)."""

from __future__ import annotations

from verl_core import PROTOCOL_VERSION, BackendSpec, TrainingCapabilities, hookimpl

_TRAINING = "verl_megatron.training:build_training_engine"


def training_capabilities(role: str) -> TrainingCapabilities:
    """Capabilities of the Megatron training engine for ``role`` (actor, reference or critic)."""
    critic = role == "critic"
    return TrainingCapabilities(
        log_probs=not critic,
        entropy=not critic,
        values=critic,
        tensor_parallel=True,
        pipeline_parallel=True,
        data_parallel=True,
        micro_batch_tokens=True,
        packed_sequences=False,
        gradient_checkpointing=True,
        offload=False,
        checkpoint=True,
        dtypes=frozenset({"float32", "bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )


@hookimpl
def verl_backend() -> BackendSpec:
    """The ``megatron`` backend: megatron-core GPTModel training engines under TP/PP/DP."""
    return BackendSpec(
        name="megatron",
        roles={"actor": _TRAINING, "reference": _TRAINING, "critic": _TRAINING},
        capabilities={r: training_capabilities(r) for r in ("actor", "reference", "critic")},
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_megatron.options:MegatronOptions",
        description="megatron-core GPTModel (local layer spec) with tensor, pipeline and data parallelism",
    )
