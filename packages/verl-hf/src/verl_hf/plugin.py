"""Entry point of the ``hf`` backend (import-light: no engine library is imported here)."""

from __future__ import annotations

from verl_core import PROTOCOL_VERSION, BackendSpec, WeightSync, hookimpl
from verl_hf.capabilities import REWARD_CAPABILITIES, ROLLOUT_CAPABILITIES, training_capabilities

_TRAINING = "verl_hf.training:build_training_engine"


@hookimpl
def verl_backend() -> BackendSpec:
    """The ``hf`` backend: transformers training engines, a sampling rollout engine, reward models."""
    return BackendSpec(
        name="hf",
        roles={
            "actor": _TRAINING,
            "reference": _TRAINING,
            "critic": _TRAINING,
            "rollout": "verl_hf.rollout:build_rollout_engine",
            "reward": "verl_hf.reward:build_reward_engine",
        },
        capabilities={
            "actor": training_capabilities("actor"),
            "reference": training_capabilities("reference"),
            "critic": training_capabilities("critic"),
            "rollout": ROLLOUT_CAPABILITIES,
            "reward": REWARD_CAPABILITIES,
        },
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_hf.config:HFOptions",
        description="transformers models: FSDP2/all-reduce training, KV-cache sampling, reward models",
    )


@hookimpl
def verl_weight_sync(source: str, target: str) -> WeightSync | None:
    """The direct hf -> hf path (parameter-to-parameter copies in one process); None for other pairs."""
    if source == "hf" and target == "hf":
        from verl_hf.rollout import HFDirectSync

        return HFDirectSync()
    return None
