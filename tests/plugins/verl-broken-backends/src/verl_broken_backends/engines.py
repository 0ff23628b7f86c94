"""The faulty engines: each overrides one hook of the example backend's engines."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import Tensor
from verl_example_backend.rollout import ExampleRolloutEngine
from verl_example_backend.training import ExampleTrainingEngine, token_outputs

from verl_core import (
    ModelOutput,
    SamplingParams,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    WeightMessage,
    apply_weight_stream,
)

__all__ = [
    "IgnoredWeightSync",
    "LeftPaddedResponses",
    "MicroBatchAveragedLoss",
    "OptimizerStateDropped",
    "ResponseMaskIgnored",
    "ShiftedLogProbs",
    "TemperatureIgnored",
    "UnseededSampling",
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
