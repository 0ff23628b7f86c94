"""Engines of the toy backend (imported only when an engine is built)."""

from __future__ import annotations

import torch

from verl_core import EngineSpec, RewardCapabilities, RewardEngine, TensorBatch, parse_options
from verl_toy_plugin.plugin import ToyOptions


class LengthReward(RewardEngine):
    """Scores a response by its length plus a bonus."""

    def __init__(self, options: ToyOptions) -> None:
        self.options = options

    @property
    def capabilities(self) -> RewardCapabilities:
        """Sequence scores."""
        return RewardCapabilities()

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Length of each response plus the bonus."""
        lengths = batch["response_mask"].sum(1).to(torch.float32)
        return batch.update(scores=lengths + self.options.bonus)


def build_reward(spec: EngineSpec) -> LengthReward:
    """Factory named in the BackendSpec."""
    return LengthReward(parse_options(ToyOptions, spec.options))
