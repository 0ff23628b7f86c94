"""The faulty engines: each overrides one hook of the example backend's engines."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import replace

import torch
from torch import Tensor
from verl_example_backend.model import load_model
from verl_example_backend.rollout import ExampleRolloutEngine, sample_seed
from verl_example_backend.training import ExampleTrainingEngine, token_outputs

from verl_broken_backends.capabilities import (
    BFLOAT16_TRAINING,
    CHECKPOINTING_TRAINING,
    OFFLOAD_TRAINING,
    TENSOR_PARALLEL_ROLLOUT,
)
from verl_core import (
    ConfigError,
    EngineSpec,
    ModelOutput,
    ParallelSizes,
    RolloutCapabilities,
    SamplingParams,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    TrainingCapabilities,
    WeightMessage,
    apply_weight_stream,
)

__all__ = [
    "Bfloat16Refused",
    "CheckpointWithoutOptimizerState",
    "CheckpointingDoublesGradients",
    "IgnoredWeightSync",
    "LeftPaddedResponses",
    "LossScaledFromStep3",
    "MicroBatchAveragedLoss",
    "OffloadLosesTensor",
    "OptimizerStateDropped",
    "RankSeededRollout",
    "ResponseMaskIgnored",
    "ShiftedLogProbs",
    "TemperatureIgnored",
    "TopKIgnored",
    "UnseededSampling",
    "WakeReloadsFolder",
]


class ShiftedLogProbs(ExampleTrainingEngine):
    """Reads token t's log-prob from the logits at t's own position instead of the one before."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs of a batch whose logits are sliced one position late."""
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        p, r = batch.prompt_len, batch.response_len
        hidden = self.model.hidden(ids, mask)[:, p : p + r]
        logp = torch.log_softmax(self.model.logits(hidden).float() / batch.meta.temperature, -1)
        rmask = batch["response_mask"]
        out = {"log_probs": logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1).masked_fill(~rmask, 0.0)}
        if "entropy" in outputs:
            out["entropy"] = (-(logp.exp() * logp).sum(-1)).masked_fill(~rmask, 0.0)
        return {k: v for k, v in out.items() if k in outputs}


class TemperatureIgnored(ExampleTrainingEngine):
    """Computes log-probs at temperature 1 whatever the batch's temperature."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs at T = 1."""
        return token_outputs(self.model, batch.with_meta(temperature=1.0), outputs)


class ResponseMaskIgnored(ExampleTrainingEngine):
    """Leaves log-probs and entropy of padding positions in the output."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs as if every response position were real."""
        full = batch.update(response_mask=torch.ones_like(batch["response_mask"]))
        return token_outputs(self.model, full, outputs)


class MicroBatchAveragedLoss(ExampleTrainingEngine):
    """Divides each micro-batch's loss by the number of micro-batches (framework averaging not undone)."""

    def loss_scale(self, num_micro_batches: int) -> float:
        """1 / number of micro-batches."""
        return 1.0 / num_micro_batches


class OptimizerStateDropped(ExampleTrainingEngine):
    """Forgets AdamW's moments before every step (each step acts like the first one)."""

    def optimizer_step(self) -> StepMetrics:
        """Drop the optimizer state, then step."""
        self.optimizer.state.clear()
        return super().optimizer_step()


class LeftPaddedResponses(ExampleRolloutEngine):
    """Returns responses padded on the left instead of the right."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate, then move each response's padding to its left."""
        out = super().generate(prompts, params)
        mask = out["response_mask"]
        width = mask.shape[1]
        shift = width - mask.sum(1)
        idx = (torch.arange(width).unsqueeze(0) - shift.unsqueeze(1)) % width
        fields = {name: out[name].gather(1, idx) for name in ("response_ids", "response_mask", "rollout_log_probs")}
        return TensorBatch._trusted({**dict(out.items()), **fields}, dict(out.extras), out.meta, out.batch_size)


class IgnoredWeightSync(ExampleRolloutEngine):
    """Checks the stream and bumps the version, but never copies the weights."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Consume the stream; apply nothing."""
        expected = {n: TensorInfo(tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}
        manifest = apply_weight_stream(stream, expected, lambda chunk: None)
        self._version = manifest.version


class UnseededSampling(ExampleRolloutEngine):
    """Draws from fresh random generators whatever the seed."""

    def generators(self, batch: TensorBatch, params: SamplingParams) -> list[torch.Generator]:
        """Unseeded generators."""
        gens = []
        for _ in range(batch.batch_size):
            g = torch.Generator()
            g.seed()
            gens.append(g)
        return gens


class CheckpointWithoutOptimizerState(ExampleTrainingEngine):
    """save_checkpoint writes the weights, step and RNG but not AdamW's moments."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save with the optimizer's per-parameter state left out."""
        moments = dict(self.optimizer.state)
        self.optimizer.state.clear()
        try:
            super().save_checkpoint(path)
        finally:
            self.optimizer.state.update(moments)


class OffloadLosesTensor(ExampleTrainingEngine):
    """Declares offload; offload() keeps AdamW's state in a host copy, onload() zeroes one parameter's second moments."""

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities with offload=True."""
        return OFFLOAD_TRAINING

    def offload(self) -> None:
        """Move the optimizer state into a host copy."""
        self._host = {p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
                      for p, st in self.optimizer.state.items()}
        self.optimizer.state.clear()

    def onload(self) -> None:
        """Put the state back, with the first parameter's exp_avg_sq lost (zeros)."""
        for i, (p, st) in enumerate(self._host.items()):
            if i == 0:
                st["exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
            self.optimizer.state[p] = st
        self._host = {}


class LossScaledFromStep3(ExampleTrainingEngine):
    """From the third optimizer step on, the loss (and with it every gradient) is scaled by 1.01."""

    def loss_scale(self, num_micro_batches: int) -> float:
        """1.01 once two optimizer steps ran."""
        return 1.01 if self.step >= 2 else 1.0


class Bfloat16Refused(ExampleTrainingEngine):
    """Declares bfloat16 but refuses to build in it."""

    def __init__(self, spec: EngineSpec) -> None:
        if spec.dtype == "bfloat16":
            raise ConfigError("bfloat16 is not implemented")
        super().__init__(spec)

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities with dtypes float32 and bfloat16."""
        return BFLOAT16_TRAINING


class CheckpointingDoublesGradients(ExampleTrainingEngine):
    """Declares gradient checkpointing; with it on, gradients are accumulated twice (a recompute that also backpropagates)."""

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities with gradient_checkpointing=True."""
        return CHECKPOINTING_TRAINING

    def loss_scale(self, num_micro_batches: int) -> float:
        """2 with gradient checkpointing on."""
        return 2.0 if self.spec.gradient_checkpointing else 1.0


class WakeReloadsFolder(ExampleRolloutEngine):
    """wake() reloads the model folder's weights, losing those synced since the engine was built."""

    def wake(self) -> None:
        """Reload from the folder."""
        self.model = load_model(self.spec.model_path, self.spec.torch_dtype).eval()


class TopKIgnored(ExampleRolloutEngine):
    """Samples from the whole distribution whatever top_k says."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate with top_k turned off."""
        return super().generate(prompts, replace(params, top_k=0))


class RankSeededRollout(ExampleRolloutEngine):
    """Declares tensor parallel rollout; runs the whole model on each rank but mixes the rank into the sample seeds."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, parallel=ParallelSizes()))
        self._spec = spec
        self._rank = int(os.environ.get("RANK", "0"))

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The example's capabilities with tensor_parallel=True."""
        return TENSOR_PARALLEL_ROLLOUT

    def generators(self, batch: TensorBatch, params: SamplingParams) -> list[torch.Generator]:
        """Per-sample generators seeded from (seed + rank, group id, sample index)."""
        if params.seed is None:
            return super().generators(batch, params)
        seed = params.seed + self._rank
        return [torch.Generator().manual_seed(sample_seed(seed, int(g), int(i)))
                for g, i in zip(batch["group_ids"].tolist(), batch["sample_index"].tolist(), strict=True)]
