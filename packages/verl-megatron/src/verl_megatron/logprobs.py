"""Vocab-parallel log-probs and entropy: no rank ever holds the full vocabulary's logits.

Each tensor-parallel rank holds the logits of its vocabulary slice. The log-softmax needs the
maximum (all-reduce MAX, treated as a constant: log-softmax does not depend on the shift) and the
sum of exponentials (all-reduce SUM); the target logit is taken on the rank that owns the target id
and summed over the group. The sums go through Megatron's ``reduce_from_tensor_model_parallel_region``
(forward all-reduce, backward identity), which is the right gradient because everything after
the reduction is computed identically on every TP rank. On one rank the full vocabulary is local
and the engine kit's chunked ``token_log_probs`` computes both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core.enginekit.token_stats import token_log_probs

__all__ = ["vocab_parallel_log_probs"]


def vocab_parallel_log_probs(
    logits: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    tp_group: dist.ProcessGroup | None,
    tp_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` (and the entropy) under softmax(logits / T) over the full vocabulary.

    Args:
        logits: This rank's logits ``[..., vocab_local]`` (any float dtype; computed in float32).
        targets: Global token ids ``[...]``.
        vocab_start: First vocabulary id of this rank's slice.
        tp_group: The tensor-parallel group (None when ``tp_size`` is 1).
        tp_size: Tensor-parallel world size.
        temperature: Sampling temperature T.
        entropy: Also return the entropy of softmax(logits / T).

    Returns:
        Float32 log-probs ``[...]`` and entropy ``[...]`` (or None), differentiable w.r.t. ``logits``.
    """
    if tp_size == 1:
        return token_log_probs(logits, targets, temperature=temperature, entropy=entropy)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def reduce(x: Tensor) -> Tensor:
        out: Tensor = reduce_from_tensor_model_parallel_region(x, group=tp_group)
        return out

    z = logits.float() / temperature
    shift = z.detach().amax(-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    z = z - shift
    exp = z.exp()
    sum_exp = reduce(exp.sum(-1))
    log_norm = sum_exp.log()
    n_local = logits.shape[-1]
    local = targets - vocab_start
    owned = (local >= 0) & (local < n_local)
    picked = z.gather(-1, local.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
    target_z = reduce(torch.where(owned, picked, torch.zeros_like(picked)))
    log_probs = target_z - log_norm
    if not entropy:
        return log_probs, None
    # H = log Z - sum_v p_v z_v, with p = exp(z) / Z
    expected_z = reduce((exp * z).sum(-1)) / sum_exp
    return log_probs, log_norm - expected_z
