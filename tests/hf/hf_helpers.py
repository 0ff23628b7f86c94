"""Helpers of the hf backend tests: tiny models and a padding-free float64 reference."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verl_conformance.testkit import TinyModelSpec, reference_forward, tiny_model
from verl_core import EngineSpec, OptimConfig, TensorBatch


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


def flat_grads(model: Any) -> Tensor:
    """All parameter gradients as one float64 vector (zeros where a gradient is missing)."""
    parts = []
    for p in model.parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(g.detach().double().reshape(-1))
    return torch.cat(parts)


HERE = Path(__file__).parent
