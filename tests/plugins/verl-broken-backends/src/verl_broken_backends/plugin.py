"""Entry points of the broken backends: one plugin object per fault, each a full backend."""

from __future__ import annotations

from verl_example_backend.plugin import ROLLOUT_CAPABILITIES, TRAINING_CAPABILITIES

from verl_broken_backends.capabilities import (
    BFLOAT16_TRAINING,
    CHECKPOINTING_TRAINING,
    OFFLOAD_TRAINING,
    TENSOR_PARALLEL_ROLLOUT,
)
from verl_core import (
    PROTOCOL_VERSION,
    BackendSpec,
    RolloutCapabilities,
    TrainingCapabilities,
    hookimpl,
)

__all__ = [
    "bfloat16",
    "checkpoint_optimizer",
    "checkpointing_grads",
    "loss_scale",
    "micro_batch_loss",
    "offload_tensor",
    "optimizer_state",
    "padding_side",
    "response_mask",
    "rollout_tp",
    "shifted_log_probs",
    "temperature",
    "top_k",
    "unseeded",
    "wake_reload",
    "weight_sync",
]

_ENGINES = "verl_broken_backends.engines"


class BrokenBackend:
    """A plugin declaring the example backend with one engine class replaced by a faulty one."""

    def __init__(self, name: str, fault: str, training: str = "", rollout: str = "",
                 training_caps: TrainingCapabilities = TRAINING_CAPABILITIES,
                 rollout_caps: RolloutCapabilities = ROLLOUT_CAPABILITIES) -> None:
        self.name = name
        self.fault = fault
        self.training = training or "verl_example_backend.training:build_training_engine"
        self.rollout = rollout or "verl_example_backend.rollout:build_rollout_engine"
        self.training_caps = training_caps
        self.rollout_caps = rollout_caps

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        """The backend with its fault."""
        return BackendSpec(
            name=self.name,
            roles={"actor": self.training, "critic": self.training, "rollout": self.rollout},
            capabilities={"actor": self.training_caps, "critic": self.training_caps, "rollout": self.rollout_caps},
            protocol_version=PROTOCOL_VERSION,
            config_class="verl_example_backend.plugin:ExampleOptions",
            description=f"BROKEN on purpose: {self.fault}",
        )


shifted_log_probs = BrokenBackend("broken-shifted-log-probs", "log-probs read one position late",
                                  training=f"{_ENGINES}:ShiftedLogProbs")
padding_side = BrokenBackend("broken-padding-side", "responses come back left-padded",
                             rollout=f"{_ENGINES}:LeftPaddedResponses")
weight_sync = BrokenBackend("broken-weight-sync", "update_weights validates the stream and applies nothing",
                            rollout=f"{_ENGINES}:IgnoredWeightSync")
micro_batch_loss = BrokenBackend("broken-micro-batch-loss", "the loss is averaged over micro-batches",
                                 training=f"{_ENGINES}:MicroBatchAveragedLoss")
optimizer_state = BrokenBackend("broken-optimizer-state", "AdamW's moments are dropped before every step",
                                training=f"{_ENGINES}:OptimizerStateDropped")
temperature = BrokenBackend("broken-temperature", "log-probs ignore the temperature",
                            training=f"{_ENGINES}:TemperatureIgnored")
response_mask = BrokenBackend("broken-response-mask", "outputs are not masked by response_mask",
                              training=f"{_ENGINES}:ResponseMaskIgnored")
unseeded = BrokenBackend("broken-unseeded", "sampling ignores the seed",
                         rollout=f"{_ENGINES}:UnseededSampling")
checkpoint_optimizer = BrokenBackend("broken-checkpoint-optimizer", "save_checkpoint leaves AdamW's moments out",
                                     training=f"{_ENGINES}:CheckpointWithoutOptimizerState")
offload_tensor = BrokenBackend("broken-offload-tensor", "onload() brings one parameter's second moments back as zeros",
                               training=f"{_ENGINES}:OffloadLosesTensor", training_caps=OFFLOAD_TRAINING)
wake_reload = BrokenBackend("broken-wake-reload", "wake() reloads the folder's weights, losing the synced ones",
                            rollout=f"{_ENGINES}:WakeReloadsFolder")
loss_scale = BrokenBackend("broken-loss-scale", "from the third optimizer step the loss is scaled by 1.01",
                           training=f"{_ENGINES}:LossScaledFromStep3")
bfloat16 = BrokenBackend("broken-bfloat16", "declares bfloat16 but refuses to build in it",
                         training=f"{_ENGINES}:Bfloat16Refused", training_caps=BFLOAT16_TRAINING)
checkpointing_grads = BrokenBackend("broken-checkpointing-grads", "gradient checkpointing doubles the gradients",
                                    training=f"{_ENGINES}:CheckpointingDoublesGradients",
                                    training_caps=CHECKPOINTING_TRAINING)
top_k = BrokenBackend("broken-top-k", "sampling ignores top_k", rollout=f"{_ENGINES}:TopKIgnored")
rollout_tp = BrokenBackend("broken-rollout-tp", "each tensor-parallel rank samples with its own seed",
                           rollout=f"{_ENGINES}:RankSeededRollout", rollout_caps=TENSOR_PARALLEL_ROLLOUT)
