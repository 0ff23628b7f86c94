"""Entry point of the ``megatron`` backend (import-light: no engine library is imported here)."""

from __future__ import annotations

from verl_core import (
    PROTOCOL_VERSION,
    BackendSpec,
    RolloutCapabilities,
    TrainingCapabilities,
    hookimpl,
)
from verl_core.kernel.capabilities import Capabilities
from verl_core.kernel.engine import Role
from verl_core.kernel.weights import WeightSync

_TRAINING = "verl_megatron.training:build_training_engine"
_ROLLOUT = "verl_megatron.rollout:build_rollout_engine"


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
        sleep_frees_memory=False,
        tensor_parallel=True,
        pipeline_parallel=False,
        dtypes=frozenset({"float32", "bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )


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
        gradient_checkpointing=False,
        offload=False,
        checkpoint=True,
        dtypes=frozenset({"float32", "bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )


@hookimpl
def verl_backend() -> BackendSpec:
    """The ``megatron`` backend: megatron-core GPTModel training engines under TP/PP/DP, TP rollout."""
    roles: tuple[Role, ...] = ("actor", "reference", "critic")
    caps: dict[Role, Capabilities] = {r: training_capabilities(r) for r in roles}
    caps["rollout"] = rollout_capabilities()
    return BackendSpec(
        name="megatron",
        roles={"actor": _TRAINING, "reference": _TRAINING, "critic": _TRAINING, "rollout": _ROLLOUT},
        capabilities=caps,
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_megatron.options:MegatronOptions",
        description="megatron-core GPTModel (local layer spec): TP/PP/DP training, TP rollout",
    )


@hookimpl
def verl_weight_sync(source: str, target: str) -> WeightSync | None:
    """The direct megatron -> megatron path (colocated resharding); None for every other pair."""
    if source == "megatron" and target == "megatron":
        from verl_megatron.reshard import MegatronDirectSync

        return MegatronDirectSync()
    return None
