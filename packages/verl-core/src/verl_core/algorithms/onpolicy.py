"""The actor loss without a separate forward for ``old_log_probs``, when the update is on-policy.

When every batch gets exactly one optimizer step, the weights that produced the update's forward are
the weights the old log-probs would be computed with: ``old_log_probs`` equals the detached
``log_probs`` of the update's own forward, so the separate no-grad actor forward is redundant (TRL
skips it the same way). :class:`OnPolicyActorLoss` fills ``old_log_probs`` from that forward and
reports, as metrics, what the trainer would otherwise have computed from the separate forward: the
entropy, the KL to the reference and the rollout/training log-prob mismatch.

The loss value, its gradient and the metrics are the same tensors the separate forward would give
when both forwards compute the same log-probs (same micro-batches; on CPU in float32 they are
bit-equal, which tests/trainer/test_old_log_probs.py checks end to end).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl_core.algorithms.aggregation import mask_weights, masked_total
from verl_core.algorithms.losses import ActorLoss
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.training import GlobalBatchStats, LossOutput, ModelOutput

__all__ = ["OnPolicyActorLoss"]


@dataclass(frozen=True)
class OnPolicyActorLoss:
    """``loss`` with ``old_log_probs = log_probs.detach()`` of the same forward.

    Use it only when the batch gets one optimizer step (one mini-batch, one epoch) and nothing
    needed ``old_log_probs`` before the update (no KL penalty in the reward). Besides the wrapped
    loss's metrics it reports ``entropy`` (always on), ``kl_ref`` (token mean of ``log_probs -
    ref_log_probs`` when the batch holds reference log-probs) and ``logprob_mismatch`` (token mean
    of ``|rollout_log_probs - log_probs|`` when ``compare_rollout`` and the batch holds them), each
    a contribution that sums to the global value over micro-batches and ranks.

    Args:
        loss: The actor loss to run on-policy.
        compare_rollout: Report ``logprob_mismatch`` (only meaningful when the rollout's log-probs
            are exact).
    """

    loss: ActorLoss
    compare_rollout: bool = False

    def __post_init__(self) -> None:
        if not self.loss.config.entropy_metric:
            config = dataclasses.replace(self.loss.config, entropy_metric=True)
            object.__setattr__(self, "loss", dataclasses.replace(self.loss, config=config))

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """The wrapped loss's outputs (``log_probs`` and ``entropy``)."""
        return self.loss.needs

    @property
    def batch_fields(self) -> frozenset[str]:
        """The wrapped loss's fields, less ``old_log_probs`` (taken from the forward)."""
        return self.loss.batch_fields - {"old_log_probs"}

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """The wrapped loss of one micro-batch, its old log-probs those of this forward."""
        batch.require("log_probs", "response_mask", where="OnPolicyActorLoss")
        log_probs = batch["log_probs"].detach()
        out = self.loss(batch.update(old_log_probs=log_probs), stats)
        metrics = dict(out.metrics)
        w = mask_weights(batch.loss_mask, log_probs.dtype)
        n = max(stats.num_tokens, 1)
        if "ref_log_probs" in batch:
            metrics["kl_ref"] = masked_total(log_probs - batch["ref_log_probs"], w) / n
        if self.compare_rollout and "rollout_log_probs" in batch:
            metrics["logprob_mismatch"] = masked_total((batch["rollout_log_probs"] - log_probs).abs(), w) / n
        return LossOutput(out.loss, metrics)
