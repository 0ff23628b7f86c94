"""The Megatron rollout engine's eager decode loops: recomputing the whole sequence at every
step, or Megatron's static KV cache (one prefill, then one token per step).

Each source of logits is a generator that yields the next-token logits of every row and is sent
the chosen tokens; :func:`verl_core.enginekit.sampling.eager_decode` drives one with a
:class:`~verl_core.enginekit.sampling.TokenSampler`.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import TensorBatch

__all__ = ["cached_logits", "next_logits", "recomputed_logits"]


def next_logits(model: Any, tokens: Tensor, last: Tensor, *, tp: int, tp_group: Any) -> Tensor:
    """Full-vocabulary float32 logits at column ``last[b]`` of each row of ``tokens`` (vocabulary
    slices gathered over ``tp_group`` under tensor parallelism)."""
    b, s = tokens.shape
    dev = tokens.device
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=dev), 1).view(1, 1, s, s)
    positions = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
    out: Tensor = model(tokens, positions, mask)  # [b, s, vocab / tp]
    local = out[torch.arange(b, device=out.device), last].float().contiguous()
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=tp_group)
    return torch.cat(parts, -1)


def recomputed_logits(model: Any, batch: TensorBatch, max_new: int, *, pad: int, device: torch.device, tp: int,
                      tp_group: Any) -> Generator[Tensor, Tensor, None]:
    """Next-token logits, recomputing the whole left-shifted sequence at every step.

    Yields the logits of the next token of every row and is sent the chosen tokens.
    """
    dev = device
    prompt_mask = batch["prompt_mask"].to(dev)
    rows, p = prompt_mask.shape
    lengths = prompt_mask.sum(1)
    cols = torch.arange(p, device=dev).unsqueeze(0)
    src = (cols + (p - lengths).unsqueeze(1)).clamp(max=p - 1)
    # Left-shift the prompts (real tokens at 0..L-1) and leave room for the response.
    tokens = torch.full((rows, p + max_new), pad, dtype=torch.int64, device=dev)
    tokens[:, :p] = batch["prompt_ids"].to(dev).gather(1, src).masked_fill(cols >= lengths.unsqueeze(1), pad)
    for t in range(max_new):
        tok = yield next_logits(model, tokens[:, : int(lengths.max()) + t], lengths + t - 1, tp=tp, tp_group=tp_group)
        tokens[torch.arange(rows, device=dev), lengths + t] = tok


def cached_logits(model: Any, batch: TensorBatch, max_new: int, *,
                  device: torch.device) -> Generator[Tensor, Tensor, None]:
    """Next-token logits with Megatron's static KV cache: one prefill, then one token per step.

    Rows stay left-padded so every row's next token sits in one column (the cache appends at
    one offset); RoPE scores depend only on the distance between positions, so each row's
    real tokens attend as they would at positions ``0..L-1``. Pad keys are masked out (a pad
    query sees only itself, so no row of the softmax is empty).
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    dev = device
    prompt_mask = batch["prompt_mask"].to(dev)
    rows, p = prompt_mask.shape
    total = p + max_new
    ctx = StaticInferenceContext(rows, total)
    real = torch.zeros(rows, total, dtype=torch.bool, device=dev)
    real[:, :p] = prompt_mask
    pos = torch.arange(p, device=dev)
    visible = (pos.view(1, p, 1) >= pos.view(1, 1, p)) & (real[:, :p].unsqueeze(1) | torch.eye(p, dtype=torch.bool, device=dev))
    # Megatron's inference mode gathers the vocabulary slices itself (runtime_gather_output)
    # and returns the last position's logits only.
    out: Tensor = model(batch["prompt_ids"].to(dev), pos.unsqueeze(0).expand(rows, p),
                        (~visible).unsqueeze(1), inference_context=ctx, runtime_gather_output=True)
    ctx.sequence_len_offset += p
    for t in range(max_new):
        tok = yield out[:, -1].float()
        at = p + t
        real[:, at] = True
        position = torch.full((rows, 1), at, dtype=torch.int64, device=dev)
        out = model(tok.view(rows, 1), position, (~real[:, : at + 1]).view(rows, 1, 1, at + 1),
                    inference_context=ctx, runtime_gather_output=True)
        ctx.sequence_len_offset += 1
