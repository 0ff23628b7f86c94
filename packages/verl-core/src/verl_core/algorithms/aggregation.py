"""Loss aggregation over the global mini-batch.

Each mode reduces a per-token loss ``l[b, t]`` (mask ``m[b, t]``: ``TensorBatch.loss_mask``, which
leaves out the observation tokens of a multi-turn response) of one micro-batch to that
micro-batch's share of the global loss, normalised by the counts of the whole mini-batch across
data-parallel ranks (:class:`~verl_core.kernel.training.GlobalBatchStats`). Every normaliser is a global
constant, so the sum over micro-batches and ranks of the shares (and of their gradients) is the
global loss (and its gradient) whatever the split. With ``N`` = ``stats.num_tokens``,
``S`` = ``stats.num_sequences`` (samples with >= 1 loss token) and ``n_b = sum_t m[b, t]``:

* ``token-mean``: ``sum_{b,t} m l / N``.
* ``seq-mean-token-sum``: ``sum_b (sum_t m l) / S``.
* ``seq-mean-token-mean``: ``sum_{b: n_b > 0} (sum_t m l / n_b) / S``.
* ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum_b (sum_t m l) / (S * L)`` where ``L`` is
  ``norm_length`` when given, else ``stats.max_response_len``.

Empty responses contribute 0 and are not counted; a mini-batch without tokens gives 0 (the
normalisers are clamped at 1), never NaN. ``mask`` may be bool or 0/1 of the loss dtype; masked
positions are multiplied by 0, so they must hold finite values (batches are checked for that at
protocol boundaries).

Differences from verl 0.9.1's ``agg_loss`` (all deliberate):

* ``seq-mean-token-sum-norm`` without ``loss_scale_factor`` divides by ``loss_mask.shape[-1]``, the
  width of the *micro-batch*, which changes with the micro-batch split when micro-batches are
  trimmed; here the default is the mini-batch's padded width (a global constant).
* verl's trainer passes ``global_batch_size`` = the number of samples of the mini-batch (empty
  responses included) to the seq-mean modes; here ``S`` counts only samples with >= 1 token, as
  verl's local fallback (``seq_mask.sum()``) does.
* verl multiplies by ``dp_size`` to undo DDP/FSDP gradient averaging; here engines undo framework
  averaging themselves (docs/architecture.md, "Loss and distribution"), so no factor appears.
* ``seq-mean-token-mean`` divides each sequence by ``n_b`` exactly (verl: ``n_b + 1e-8``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch
from torch import Tensor

from verl_core.kernel.errors import ConfigError
from verl_core.kernel.training import GlobalBatchStats

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "mask_weights",
    "masked_row_sums",
    "masked_total",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]


def mask_weights(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as 0/1 values of ``dtype`` (returned as is when it already has that dtype).

    Multiplying by a float mask is several times faster on CPU than ``torch.where`` with a bool
    one, and converting through a ``uint8`` view is an order of magnitude faster than ``bool.to``.
    """
    if mask.dtype == dtype:
        return mask
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8).to(dtype)
    return mask.to(dtype)


def masked_total(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """``sum_{b,t} mask * loss_mat`` as one fused dot product (inputs must be finite)."""
    w = mask_weights(mask, loss_mat.dtype)
    return torch.dot(loss_mat.reshape(-1), w.reshape(-1))


def masked_row_sums(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """``sum_t mask * loss_mat`` per row."""
    return (loss_mat * mask_weights(mask, loss_mat.dtype)).sum(-1)


def token_mean(loss_mat: Tensor, mask: Tensor, stats: GlobalBatchStats, norm_length: int | None = None) -> Tensor:
    """Sum of the masked per-token loss divided by the global token count."""
    return masked_total(loss_mat, mask) / max(stats.num_tokens, 1)


def seq_mean_token_sum(
    loss_mat: Tensor, mask: Tensor, stats: GlobalBatchStats, norm_length: int | None = None
) -> Tensor:
    """Per-sequence token sums, averaged over the global count of non-empty sequences."""
    return masked_total(loss_mat, mask) / max(stats.num_sequences, 1)


def seq_mean_token_mean(
    loss_mat: Tensor, mask: Tensor, stats: GlobalBatchStats, norm_length: int | None = None
) -> Tensor:
    """Per-sequence token means, averaged over the global count of non-empty sequences."""
    w = mask_weights(mask, loss_mat.dtype)
    per_seq = masked_row_sums(loss_mat, w) / w.sum(-1).clamp_min(1)
    return per_seq.sum() / max(stats.num_sequences, 1)


def seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, stats: GlobalBatchStats, norm_length: int | None = None
) -> Tensor:
    """Per-sequence token sums divided by a constant length, averaged over non-empty sequences."""
    length = norm_length if norm_length is not None else max(stats.max_response_len, 1)
    return masked_total(loss_mat, mask) / (max(stats.num_sequences, 1) * length)


AGGREGATIONS: Final[dict[str, Callable[[Tensor, Tensor, GlobalBatchStats, int | None], Tensor]]] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}
"""The built-in aggregation modes by name."""


def aggregate(
    loss_mat: Tensor, mask: Tensor, mode: str, stats: GlobalBatchStats, norm_length: int | None = None
) -> Tensor:
    """Reduce ``loss_mat`` with the aggregation ``mode`` (a built-in or a registered plugin's).

    Raises:
        UnknownNameError: ``mode`` is not registered (the message lists the registered modes).
    """
    fn = AGGREGATIONS.get(mode)
    if fn is None:
        from verl_core.kernel.registry import get_registry

        fn = get_registry().component("aggregation", mode).impl
    if norm_length is not None and norm_length < 1:
        raise ConfigError(f"norm_length must be None or >= 1, got {norm_length}")
    out: Tensor = fn(loss_mat, mask, stats, norm_length)
    return out
