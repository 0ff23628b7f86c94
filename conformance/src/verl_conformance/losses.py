"""The loss functions the suite trains with: pure functions of batch fields and global counts.

Each is normalised by the *global* :class:`~verl_core.GlobalBatchStats`, so summing its value
and gradients over micro-batches gives the global loss: an engine that averages per micro-batch
(or forgets to undo a framework's averaging) gets a different result and fails.
Algorithm components registered in verl-core (``policy_loss`` kind) are added by
:func:`suite_losses` when their calling convention is available.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import torch
from torch import Tensor

from verl_core import GlobalBatchStats, LossFn, LossOutput, ModelOutput, TensorBatch

__all__ = [
    "NamedLoss",
    "SuiteLoss",
    "grpo_advantages",
    "registered_critic_loss",
    "registered_policy_losses",
    "role_loss",
    "role_output",
    "suite_losses",
]


@dataclass(frozen=True)
class SuiteLoss:
    """A named LossFn built from a function of (batch, stats) -> (loss, metrics)."""

    name: str
    fn: Callable[[TensorBatch, GlobalBatchStats], tuple[Tensor, dict[str, Tensor]]]
    outputs: frozenset[ModelOutput] = field(default_factory=lambda: frozenset({"log_probs"}))
    inputs: tuple[str, ...] = ()

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """Model outputs the engine fills in."""
        return self.outputs

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """The micro-batch's share of the global loss."""
        loss, metrics = self.fn(batch, stats)
        return LossOutput(loss=loss, metrics=metrics)


def _ratio(batch: TensorBatch) -> Tensor:
    return torch.exp(batch["log_probs"] - batch["old_log_probs"])


def _token_mean_pg(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    mask = batch["response_mask"].to(batch["log_probs"].dtype)
    per_token = -batch["advantages"] * _ratio(batch) * mask
    loss = per_token.sum() / max(stats.num_tokens, 1)
    return loss, {"pg_loss": loss.detach()}


def _seq_mean_pg_entropy(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    mask = batch["response_mask"].to(batch["log_probs"].dtype)
    per_token = (-batch["advantages"] * _ratio(batch) - 0.05 * batch["entropy"]) * mask
    per_seq = per_token.sum(1) / mask.sum(1).clamp_min(1)
    loss = per_seq.sum() / max(stats.num_sequences, 1)
    return loss, {"entropy_sum": (batch["entropy"] * mask).sum().detach() / max(stats.num_tokens, 1)}


def _ppo_clip(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    mask = batch["response_mask"].to(batch["log_probs"].dtype)
    ratio = _ratio(batch)
    adv = batch["advantages"]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask
    loss = per_token.sum() / max(stats.num_tokens, 1)
    clipped = ((ratio - 1).abs() > 0.2).to(mask.dtype) * mask
    return loss, {"clip_fraction": clipped.sum().detach() / max(stats.num_tokens, 1)}


def _value_mse(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    mask = batch["response_mask"].to(batch["values"].dtype)
    loss = 0.5 * ((batch["values"] - batch["returns"]) ** 2 * mask).sum() / max(stats.num_tokens, 1)
    return loss, {"vf_loss": loss.detach()}


TOKEN_MEAN_PG: Final = SuiteLoss("token_mean_pg", _token_mean_pg, inputs=("advantages", "old_log_probs"))
SEQ_MEAN_PG_ENTROPY: Final = SuiteLoss(
    "seq_mean_pg_entropy", _seq_mean_pg_entropy, frozenset({"log_probs", "entropy"}),
    inputs=("advantages", "old_log_probs"),
)
PPO_CLIP: Final = SuiteLoss("ppo_clip", _ppo_clip, inputs=("advantages", "old_log_probs"))
VALUE_MSE: Final = SuiteLoss("value_mse", _value_mse, frozenset({"values"}), inputs=("returns",))


def role_loss(role: str) -> SuiteLoss:
    """The suite's loss for training ``role``: the value MSE for a critic, else the token-mean policy gradient."""
    return VALUE_MSE if role == "critic" else TOKEN_MEAN_PG


def role_output(role: str) -> ModelOutput:
    """The model output a forward of ``role`` is compared on: ``values`` for a critic, else ``log_probs``."""
    return "values" if role == "critic" else "log_probs"


@dataclass(frozen=True)
class NamedLoss:
    """A registered algorithm loss (any :class:`~verl_core.LossFn`) under a display name."""

    name: str
    loss: LossFn

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """Model outputs the loss reads."""
        return self.loss.needs

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """Delegate to the registered loss."""
        return self.loss(batch, stats)


def registered_policy_losses() -> list[NamedLoss]:
    """The actor loss of every registered policy loss (token-mean, with an entropy bonus and a KL
    loss on ``ppo``), and ``ppo`` under every registered aggregation mode.

    Empty when this verl-core has no algorithm bundle (the suite's own losses still apply).
    """
    try:
        from verl_core.algorithms import ActorLoss, ActorLossConfig
    except ImportError:
        return []
    from verl_core import get_registry

    reg = get_registry()
    out = []
    for name in reg.components("policy_loss"):
        extra = {"entropy_coef": 0.01, "kl_loss_coef": 0.1} if name == "ppo" else {}
        out.append(NamedLoss(f"{name} (token-mean)", ActorLoss(ActorLossConfig(policy_loss=name, **extra))))  # type: ignore[arg-type]
    for mode in reg.components("aggregation"):
        if mode != "token-mean":
            out.append(NamedLoss(f"ppo ({mode})", ActorLoss(ActorLossConfig(loss_agg_mode=mode))))  # type: ignore[arg-type]
    return out


def registered_critic_loss() -> NamedLoss | None:
    """verl-core's clipped value loss, when this verl-core has it."""
    try:
        from verl_core.algorithms import CriticLossConfig
        from verl_core.algorithms.losses import CriticLoss
    except ImportError:
        return None
    return NamedLoss("clipped_mse", CriticLoss(CriticLossConfig()))


def suite_losses() -> list[SuiteLoss | NamedLoss]:
    """The policy losses every actor is checked under: the suite's own plus every registered one."""
    own: list[SuiteLoss | NamedLoss] = [TOKEN_MEAN_PG, SEQ_MEAN_PG_ENTROPY, PPO_CLIP]
    return own + list(registered_policy_losses())


def grpo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: (score - group mean) / (group std + eps), broadcast over the response."""
    adv = torch.zeros_like(scores)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        s = scores[sel]
        std = s.std() if s.numel() > 1 else torch.ones((), dtype=s.dtype)
        mean = s.mean() if s.numel() > 1 else torch.zeros((), dtype=s.dtype)
        adv[sel] = (s - mean) / (std + eps)
    return adv.unsqueeze(1) * mask.to(adv.dtype)
