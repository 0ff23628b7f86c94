"""Entry point of the ``example`` backend: import strings and static capabilities only."""

from __future__ import annotations

from dataclasses import dataclass

from verl_core import (
    PROTOCOL_VERSION,
    BackendSpec,
    RolloutCapabilities,
    TrainingCapabilities,
    hookimpl,
)

__all__ = ["CRITIC_CAPABILITIES", "ExampleOptions", "TRAINING_CAPABILITIES", "ROLLOUT_CAPABILITIES", "verl_backend"]


@dataclass(frozen=True)
class ExampleOptions:
    """Options of the example backend (``EngineSpec.options``).

    Attributes:
        num_threads: torch intra-op threads for this process (0 = leave as is).
    """

    num_threads: int = 0


TRAINING_CAPABILITIES = TrainingCapabilities(
    log_probs=True, entropy=True, values=False, micro_batch_tokens=True, checkpoint=True
)
"""The actor's and the reference's: log-probs and entropy (no value head)."""
CRITIC_CAPABILITIES = TrainingCapabilities(
    log_probs=False, entropy=False, values=True, micro_batch_tokens=True, checkpoint=True
)
"""The critic's: values only (a value head; a causal-LM folder gets one from the seed)."""
ROLLOUT_CAPABILITIES = RolloutCapabilities(
    temperature=True, top_p=True, top_k=True, stop_token_ids=True, seeding="per_sample",
    exact_log_probs=True, exact_log_probs_truncated=True, weight_update=True,
)


@hookimpl
def verl_backend() -> BackendSpec:
    """Declare the backend: roles as import strings (no engine is imported here)."""
    return BackendSpec(
        name="example",
        roles={
            "actor": "verl_example_backend.training:build_training_engine",
            "reference": "verl_example_backend.training:build_training_engine",
            "critic": "verl_example_backend.training:build_training_engine",
            "rollout": "verl_example_backend.rollout:build_rollout_engine",
        },
        capabilities={
            "actor": TRAINING_CAPABILITIES,
            "reference": TRAINING_CAPABILITIES,
            "critic": CRITIC_CAPABILITIES,
            "rollout": ROLLOUT_CAPABILITIES,
        },
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_example_backend.plugin:ExampleOptions",
        description="Plain-torch Llama/Qwen2/Qwen3 training and rollout (the backend guide's example)",
    )
