"""Entry point of the ``tiny`` backend: import strings and static capabilities only."""

from __future__ import annotations

from verl_core import (
    PROTOCOL_VERSION,
    BackendSpec,
    RolloutCapabilities,
    TrainingCapabilities,
    hookimpl,
)

__all__ = ["ACTOR_CAPABILITIES", "CRITIC_CAPABILITIES", "ROLLOUT_CAPABILITIES", "verl_backend"]

ACTOR_CAPABILITIES = TrainingCapabilities(values=False)
"""Actor and reference: causal-LM folders, no value head."""
CRITIC_CAPABILITIES = TrainingCapabilities(values=True, log_probs=False, entropy=False)
"""The critic: a value-head folder (values only: it has no lm_head)."""
ROLLOUT_CAPABILITIES = RolloutCapabilities(exact_log_probs_truncated=True, concurrent_weight_update=True)
"""Log-probs of the untruncated tempered distribution, whatever top-k/top-p; weight updates on another
thread take turns with generate (the engine kit's facade)."""


@hookimpl
def verl_backend() -> BackendSpec:
    """Declare the backend: roles as import strings (no engine is imported here)."""
    return BackendSpec(
        name="tiny",
        roles={"actor": "verl_tiny_backend.training:build_training_engine",
               "reference": "verl_tiny_backend.training:build_training_engine",
               "critic": "verl_tiny_backend.training:build_training_engine",
               "rollout": "verl_tiny_backend.rollout:build_rollout_engine"},
        capabilities={"actor": ACTOR_CAPABILITIES, "reference": ACTOR_CAPABILITIES,
                      "critic": CRITIC_CAPABILITIES, "rollout": ROLLOUT_CAPABILITIES},
        protocol_version=PROTOCOL_VERSION,
        description="Pure-torch Llama/Qwen2/Qwen3 training and rollout (the backend guide's worked example)",
    )
