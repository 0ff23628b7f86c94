"""Off-policy correction against the rollout engine's log-probs: the ratio, the weights, the metrics.

The one owner of the rollout importance ratio ``rho = pi_old / pi_rollout``: the training engine's
log-probs of the sampled tokens (``old_log_probs``) against the rollout engine's
(``rollout_log_probs``), detached, computed in log space (:func:`rollout_log_ratio`) at the level
of :class:`~verl_core.algorithms.config.OffPolicyConfig`:

* ``token``: ``log rho_t = log pi_old(y_t) - log pi_rollout(y_t)``, one ratio per token;
* ``sequence``: ``log rho = sum_t log rho_t``, one per response (the product of its token ratios);
* ``geometric``: ``log rho = mean_t log rho_t``, one per response (their geometric mean).

:func:`offpolicy_correction` turns the ratios into the per-token weights of the policy loss
(``rho`` is exponentiated after clamping its log to +-20):

* ``tis``: ``w = min(rho, upper)`` (truncated importance sampling);
* ``mis``: ``w = rho`` where ``lower <= rho <= upper``, else 0 (masked importance sampling: the
  token or response is dropped from the policy loss).

At the sequence levels every token of a response gets its response's weight. The weights are 0 at
positions outside the loss mask. The actor loss multiplies each token's policy loss by them
(:func:`~verl_core.algorithms.losses.actor_loss`), and reports what the correction did
(:func:`correction_metrics`: contributions that sum over micro-batches, as every loss metric);
:func:`ratio_statistics` gives the ratio's mean, max and min over a whole batch, which do not sum
over micro-batches and so are computed where the whole batch is (the trainer's advantage step,
:meth:`~verl_core.algorithms.bundle.Algorithm.compute_advantages_with_metrics`).

The unit of every statistic is the level's: tokens of the loss mask at ``token`` level, responses
with at least one such token at the sequence levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import mask_weights
from verl_core.algorithms.config import OffPolicyConfig, OffPolicyLevel
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import BatchValidationError
from verl_core.kernel.training import GlobalBatchStats

__all__ = [
    "LOG_RATIO_CLAMP",
    "OffPolicyCorrection",
    "correction_metrics",
    "offpolicy_correction",
    "ratio_statistics",
    "rollout_log_ratio",
]

LOG_RATIO_CLAMP: Final = 20.0
"""``|log rho|`` is clamped to this before ``exp`` (verl's safety bound: ratios within [2e-9, 5e8])."""


@torch.no_grad()
def rollout_log_ratio(
    old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, level: OffPolicyLevel
) -> Tensor:
    """``log(pi_old / pi_rollout)`` at ``level``, detached and unclamped.

    Args:
        old_log_probs: The training engine's log-probs of the sampled tokens, ``[batch, response]``.
        rollout_log_probs: The rollout engine's, same shape.
        mask: The loss mask (bool, or 0/1 of any float dtype).
        level: ``token``, ``sequence`` or ``geometric``.

    Returns:
        ``[batch, response]`` (token level; 0 outside the mask) or ``[batch, 1]`` (sequence levels;
        0 for an empty response), in the dtype of ``old_log_probs``.
    """
    w = mask_weights(mask, old_log_probs.dtype)
    log_ratio = (old_log_probs - rollout_log_probs).detach() * w
    if level == "token":
        return log_ratio
    total = log_ratio.sum(-1, keepdim=True)
    if level == "sequence":
        return total
    return total / w.sum(-1, keepdim=True).clamp_min(1)


@dataclass(frozen=True)
class OffPolicyCorrection:
    """The correction of one batch (every tensor detached).

    Attributes:
        weights: ``[batch, response]`` weight of each token's policy loss, 0 outside the mask.
        ratio: ``rho`` per unit: ``[batch, response]`` (token level) or ``[batch, 1]``.
        unit_weights: The weight per unit, shaped as ``ratio``.
        units: bool, shaped as ``ratio``: the units that count (tokens of the mask, or responses
            with at least one).
        hit: bool, shaped as ``ratio``: the units truncated (``tis``: ``rho > upper``) or masked
            (``mis``: ``rho`` outside ``[lower, upper]``); False where ``units`` is.
    """

    weights: Tensor
    ratio: Tensor
    unit_weights: Tensor
    units: Tensor
    hit: Tensor


@torch.no_grad()
def offpolicy_correction(
    old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, config: OffPolicyConfig
) -> OffPolicyCorrection:
    """The weights of ``config``'s correction (see the module docstring for the formulas).

    Raises:
        ValueError: ``config.mode`` is ``none`` (there is nothing to weigh: skip the correction).
    """
    if not config.enabled:
        raise ValueError("offpolicy_correction: OffPolicyConfig.mode is 'none'; the loss takes no weights")
    w = mask_weights(mask, old_log_probs.dtype)
    ratio = rollout_log_ratio(old_log_probs, rollout_log_probs, w, config.level).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    flags = mask if mask.dtype == torch.bool else mask > 0
    units = flags if config.level == "token" else flags.any(-1, keepdim=True)
    if config.mode == "tis":
        hit = (ratio > config.upper) & units
        unit_weights = ratio.clamp(max=config.upper)
    else:
        hit = ((ratio < config.lower_bound) | (ratio > config.upper)) & units
        unit_weights = ratio * ~hit
    return OffPolicyCorrection(unit_weights * w, ratio, unit_weights, units, hit)


def correction_metrics(
    correction: OffPolicyCorrection, config: OffPolicyConfig, stats: GlobalBatchStats
) -> dict[str, Tensor]:
    """What the correction did to one micro-batch, as contributions that sum to the mini-batch's value.

    Divided by the mini-batch's count of units (``stats.num_tokens`` at token level,
    ``stats.num_sequences`` at the sequence levels).

    Returns:
        ``offpolicy/weight_mean`` (the mean weight applied) and ``offpolicy/truncated_frac`` (``tis``)
        or ``offpolicy/masked_frac`` (``mis``): the share of units truncated or masked.
    """
    c = correction
    n = max(stats.num_tokens if config.level == "token" else stats.num_sequences, 1)
    u = c.units.to(c.ratio.dtype)
    share = "offpolicy/truncated_frac" if config.mode == "tis" else "offpolicy/masked_frac"
    return {
        "offpolicy/weight_mean": (c.unit_weights * u).sum() / n,
        share: torch.count_nonzero(c.hit).to(c.ratio.dtype) / n,
    }


def ratio_statistics(batch: TensorBatch, config: OffPolicyConfig) -> dict[str, float]:
    """Mean, max and min of ``rho`` over the units of a whole batch (the trainer's step metrics).

    Reads ``old_log_probs``, ``rollout_log_probs`` and ``batch.loss_mask``. Computed at
    ``config.level`` whatever the mode (``none`` included). A batch without any token
    reports 1.0 (no mismatch) for each.

    Returns:
        ``offpolicy/ratio_mean``, ``offpolicy/ratio_max``, ``offpolicy/ratio_min``.

    Raises:
        BatchValidationError: the batch lacks ``old_log_probs`` or ``rollout_log_probs``.
    """
    missing = [f for f in ("old_log_probs", "rollout_log_probs") if f not in batch]
    if missing:
        raise BatchValidationError(
            f"the off-policy ratio statistics need {' and '.join(missing)}; compute the training engine's "
            "log-probs (old_log_probs) of a batch the rollout engine sampled (rollout_log_probs) first"
        )
    mask = batch.loss_mask
    log_ratio = rollout_log_ratio(batch["old_log_probs"], batch["rollout_log_probs"], mask, config.level)
    units = mask if config.level == "token" else mask.any(-1, keepdim=True)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()[units]
    if ratio.numel() == 0:
        return {"offpolicy/ratio_mean": 1.0, "offpolicy/ratio_max": 1.0, "offpolicy/ratio_min": 1.0}
    return {
        "offpolicy/ratio_mean": float(ratio.mean()),
        "offpolicy/ratio_max": float(ratio.max()),
        "offpolicy/ratio_min": float(ratio.min()),
    }
