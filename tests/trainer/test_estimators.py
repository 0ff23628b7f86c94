"""grpo_token: per-position group normalisation of dense token scores, registered through the hook."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algorithms.config import GRPOConfig
from verl_core.algorithms.token_estimators import grpo_token, register
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.registry import get_registry
from verl_core.trainer.rl.trainer import build_algorithm


def make(scores: torch.Tensor, lengths: list[int], groups: list[int]) -> TensorBatch:
    b, t = scores.shape
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    return TensorBatch({
        "response_ids": torch.zeros(b, t, dtype=torch.int64),
        "response_mask": mask,
        "token_scores": torch.where(mask, scores, 0.0),
        "group_ids": torch.tensor(groups),
    })


def test_each_position_is_normalised_within_its_group() -> None:
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    out = grpo_token(make(scores, [2, 2, 2, 2], [7, 7, 9, 9]))
    adv = out["advantages"]
    # group 7, position 0: scores (1, 0): mean 0.5, std 0.7071 -> +-0.7071
    assert torch.allclose(adv[:2, 0], torch.tensor([0.70710, -0.70710]), atol=1e-4)
    assert torch.equal(adv[:2, 1], torch.zeros(2))  # all equal at position 1 -> 0
    assert torch.allclose(adv[2:, 0], torch.tensor([0.70710, -0.70710]), atol=1e-4)
    assert torch.equal(out["returns"], adv)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=12), st.integers(1, 3))
def test_masked_positions_are_zero_and_values_finite(lengths: list[int], group_size: int) -> None:
    b = len(lengths)
    g = torch.Generator().manual_seed(b)
    scores = (torch.rand(b, 4, generator=g) > 0.5).float()
    out = grpo_token(make(scores, lengths, [i // group_size for i in range(b)]), GRPOConfig())
    adv = out["advantages"]
    mask = out["response_mask"]
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum())))


def test_registered_through_the_hook_and_built_by_name() -> None:
    register()
    register()  # idempotent
    comp = get_registry().component("advantage", "grpo_token")
    assert comp.impl is grpo_token
    algo = build_algorithm("grpo_token", {"kl_loss_coef": 0.0})
    assert algo.estimator == "grpo_token"
