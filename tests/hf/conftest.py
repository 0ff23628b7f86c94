"""Shared helpers of the hf backend tests: tiny models, a padding-free reference, test-local losses."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from verl_conformance.testkit import TinyModelSpec, reference_forward, tiny_model
from verl_core import EngineSpec, GlobalBatchStats, LossOutput, OptimConfig, TensorBatch
from verl_core.training import ModelOutput


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


def model_path(arch: str = "llama", tied: bool = False, head: str = "causal_lm") -> str:
    """A cached test-kit model folder."""
    return str(tiny_model(TinyModelSpec(arch=arch, tied=tied, head=head)))  # type: ignore[arg-type]


def actor_spec(path: str, **kw: Any) -> EngineSpec:
    """An actor spec with a small constant learning rate and no clipping unless overridden."""
    kw.setdefault("optim", OptimConfig(lr=1e-3, grad_clip=0.0))
    kw.setdefault("max_prompt_len", 64)
    kw.setdefault("max_response_len", 64)
    return EngineSpec(model_path=path, role=kw.pop("role", "actor"), **kw)


def unpadded_reference(path: str, batch: TensorBatch, outputs: Collection[str]) -> dict[str, Tensor]:
    """The float64 reference computed one sample at a time with every padding column removed.

    Running each sample alone and unpadded keeps the reference independent of how the engine
    handles padding (what the tests check), and sidesteps padded-row NaNs of float64 eager attention.
    """
    out = {k: torch.zeros(batch.batch_size, batch.response_len, dtype=torch.float64) for k in outputs}
    for i in range(batch.batch_size):
        one = batch.index([i]).trim()
        if one.response_len == 0:
            continue
        ref = reference_forward(path, one, outputs)
        for k in outputs:
            assert bool(torch.isfinite(ref[k]).all()), f"reference {k} of sample {i} is not finite"
            out[k][i, : one.response_len] = ref[k][0]
    return out


class PPOClipLoss:
    """Token-mean PPO clipped surrogate normalised by the global token count (test-local)."""

    def __init__(self, clip: float = 0.2, kl_coef: float = 0.0) -> None:
        self.clip = clip
        self.kl_coef = kl_coef

    @property
    def needs(self) -> frozenset[ModelOutput]:
        return frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        mask = batch["response_mask"].float()
        lp = batch["log_probs"]
        ratio = torch.exp(lp - batch["old_log_probs"])
        adv = batch["advantages"]
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        per_tok = -surr
        if self.kl_coef:
            log_r = batch["ref_log_probs"] - lp
            per_tok = per_tok + self.kl_coef * (torch.exp(log_r) - log_r - 1)
        denom = max(stats.num_tokens, 1)
        loss = (per_tok * mask).sum() / denom
        clipped = ((ratio - 1).abs() > self.clip).float() * mask
        return LossOutput(loss, {"pg_clipfrac": clipped.sum().detach() / denom})


class ValueLoss:
    """Token-mean squared error of values against returns (test-local)."""

    @property
    def needs(self) -> frozenset[ModelOutput]:
        return frozenset({"values"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        mask = batch["response_mask"].float()
        err = (batch["values"] - batch["returns"]) ** 2 * mask
        return LossOutput(0.5 * err.sum() / max(stats.num_tokens, 1))


def grpo_advantages(batch: TensorBatch, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages: (score - group mean) / (group std + eps), broadcast over tokens."""
    scores = batch["scores"]
    groups = batch["group_ids"]
    adv = torch.zeros_like(scores)
    for g in groups.unique():
        sel = groups == g
        s = scores[sel]
        std = s.std() if s.numel() > 1 else torch.tensor(1.0)
        adv[sel] = (s - s.mean()) / (std + eps) if s.numel() > 1 else s
    return adv.unsqueeze(1) * batch["response_mask"].float()


def flat_grads(model: Any) -> Tensor:
    """All parameter gradients as one float64 vector (zeros where a gradient is missing)."""
    parts = []
    for p in model.parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(g.detach().double().reshape(-1))
    return torch.cat(parts)


HERE = Path(__file__).parent
