"""Entry points of the broken backends: one plugin object per fault, each a full backend."""

from __future__ import annotations

from verl_example_backend.plugin import ROLLOUT_CAPABILITIES, TRAINING_CAPABILITIES

from verl_core import PROTOCOL_VERSION, BackendSpec, hookimpl

__all__ = [
    "micro_batch_loss",
    "optimizer_state",
    "padding_side",
    "response_mask",
    "shifted_log_probs",
    "temperature",
    "unseeded",
    "weight_sync",
]

_ENGINES = "verl_broken_backends.engines"


class BrokenBackend:
    """A plugin declaring the example backend with one engine class replaced by a faulty one."""

    def __init__(self, name: str, fault: str, training: str = "", rollout: str = "") -> None:
        self.name = name
        self.fault = fault
        self.training = training or "verl_example_backend.training:build_training_engine"
        self.rollout = rollout or "verl_example_backend.rollout:build_rollout_engine"

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        """The backend with its fault."""
        return BackendSpec(
            name=self.name,
            roles={"actor": self.training, "critic": self.training, "rollout": self.rollout},
            capabilities={"actor": TRAINING_CAPABILITIES, "critic": TRAINING_CAPABILITIES,
                          "rollout": ROLLOUT_CAPABILITIES},
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
