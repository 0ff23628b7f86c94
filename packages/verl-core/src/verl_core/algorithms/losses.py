"""Policy losses, the off-policy correction in the actor loss, the value loss, and the LossFn objects engines run.

Per-token policy losses (``r = exp(clamp(log_probs - old_log_probs, +-log_ratio_clamp))``, ``A``
the advantage, all to be minimised), matching verl 0.9.1 ``core_algos``:

* ``ppo``: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, and for ``A < 0`` with dual clip
  ``min(that, -A c)`` (verl's ``vanilla``; ``clip_ratio_c`` None turns the dual clip off).
* ``gspo``: as ppo without dual clip, with the sequence ratio
  ``s = exp(mean_t log r)`` applied per token as ``sg[s] * pi / sg[pi]`` (log clamped at 10, as verl).
* ``cispo``: ``-sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log_probs``.
* ``reinforce``: ``-A * log_probs`` (verl's ``gpg``; on-policy REINFORCE).
* ``importance_sampling``: ``-A * r`` (unclipped importance-sampled policy gradient).

The actor loss is ``agg(policy) - entropy_coef * agg(entropy) + kl_loss_coef * agg(kl)`` with one
aggregation mode for all three terms (as verl's actor), each normalised by the global counts (see
:mod:`verl_core.algorithms.aggregation`). With an off-policy correction
(:class:`~verl_core.algorithms.config.OffPolicyConfig`) each token's policy loss is first multiplied by
its weight (:mod:`verl_core.algorithms.offpolicy`). Metrics follow the same summing rule; the per-token
statistics (clip fractions, ``ppo_kl``, ``entropy``, ``kl``) are token means over the global
mini-batch whatever the loss's aggregation mode, the correction's are means over its level's units.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import torch
from torch import Tensor

from verl_core.algorithms._autograd import all_within, with_gradient
from verl_core.algorithms.aggregation import aggregate, mask_weights, masked_total
from verl_core.algorithms.config import (
    ActorLossConfig,
    CriticLossConfig,
    PolicyLossConfig,
)
from verl_core.algorithms.kl import kl_estimate
from verl_core.algorithms.offpolicy import correction_metrics, offpolicy_correction
from verl_core.kernel.algorithm import PolicyLossTerms, ValueLossTerms
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import BatchValidationError
from verl_core.kernel.training import GlobalBatchStats, LossFn, LossOutput, ModelOutput

__all__ = [
    "POLICY_LOSSES",
    "VALUE_LOSSES",
    "ActorLoss",
    "CriticLoss",
    "actor_loss",
    "clipped_value_loss",
    "cispo_loss",
    "critic_loss",
    "gspo_loss",
    "importance_sampling_loss",
    "ppo_loss",
    "reinforce_loss",
]

_GSPO_LOG_CLAMP: Final = 10.0


def _no(t: Tensor) -> Tensor:
    return torch.zeros(t.shape, dtype=torch.bool, device=t.device)


def _clipped_ratio_loss(
    ratio: Tensor, advantages: Tensor, config: PolicyLossConfig, dual: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Value of ``max(-A r, -A clip(r))`` (and the dual clip), its derivative in ``r``, and the flags.

    Buffers are reused in place: fresh ``[batch, response]`` tensors cost page faults on CPU that
    dominate these memory-bound steps.
    """
    neg_adv = -advantages
    value = neg_adv * ratio  # the unclipped loss, turned into the result in place
    loss2 = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high).mul_(neg_adv)
    clipped = loss2 > value  # then the clipped branch is active and has no gradient
    torch.maximum(value, loss2, out=value)
    keep = ~clipped
    if dual and config.clip_ratio_c is not None:
        # dual clip: for A < 0 the loss is capped at -A * c (no gradient there). For A >= 0 the
        # loss is <= 0, so capping at max(-A, 0) * c = 0 changes nothing: no select is needed
        cap = torch.clamp(neg_adv, min=0.0, out=loss2).mul_(config.clip_ratio_c)
        lower = value > cap
        torch.minimum(value, cap, out=value)
        keep &= ~lower
    else:
        lower = _no(ratio)
    return value, neg_adv.mul_(keep), clipped, lower


@torch.no_grad()
def _log_ratio(
    log_probs: Tensor, old_log_probs: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor | None]:
    """``clamp(log_probs - old, +-c)`` and where the clamp did not bind (None: nowhere)."""
    raw = log_probs.detach() - old_log_probs
    c = config.log_ratio_clamp
    if all_within(raw, -c, c):
        return raw, None
    clamped = raw.clamp(-c, c)
    return clamped, clamped == raw


def ppo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig
) -> PolicyLossTerms:
    """PPO clipped objective with asymmetric clip (clip-low / clip-high) and optional dual clip.

    ``r = exp(clamp(log_probs - old_log_probs, +-log_ratio_clamp))``; the loss is
    ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, capped at ``-A c`` for ``A < 0`` with the
    dual clip (verl's ``vanilla``). Its gradient w.r.t. ``log_probs`` is ``-A r`` where no clip
    binds and 0 elsewhere, attached analytically (see :mod:`verl_core.algorithms._autograd`).
    """
    with torch.no_grad():
        log_ratio, inside = _log_ratio(log_probs, old_log_probs, config)
        ratio = log_ratio.exp()
        value, d_ratio, clipped, lower = _clipped_ratio_loss(ratio, advantages, config, dual=True)
        coef = d_ratio.mul_(ratio)
        if inside is not None:
            coef.mul_(inside)
    return PolicyLossTerms(with_gradient(log_probs, value, coef), clipped, lower, log_ratio)


def gspo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig
) -> PolicyLossTerms:
    """GSPO: clipped objective with the length-normalised sequence ratio (Zheng et al. 2025).

    ``s_i = exp(mean_t (log_probs - old_log_probs))`` over the sequence's tokens, applied per token
    as ``sg[s_i] * pi / sg[pi]`` (its log clamped at 10, as verl), then
    ``max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))``. Gradient w.r.t. ``log_probs[t]``:
    ``-A s_i`` where neither clip binds, else 0.
    """
    with torch.no_grad():
        w = mask_weights(mask, log_probs.dtype)
        raw = (log_probs.detach() - old_log_probs).mul_(w)
        seq = raw.sum(-1) / w.sum(-1).clamp_min(1)
        log_s = seq.clamp(max=_GSPO_LOG_CLAMP)
        s = log_s.exp().unsqueeze(-1).expand_as(raw)
        value, d_s, clipped, lower = _clipped_ratio_loss(s, advantages, config, dual=False)
        coef = d_s.mul_(s).mul_((seq <= _GSPO_LOG_CLAMP).unsqueeze(-1))
    return PolicyLossTerms(with_gradient(log_probs, value, coef), clipped, lower, raw)


def cispo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig
) -> PolicyLossTerms:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio (MiniMax-M1).

    ``-sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log_probs``; gradient ``-clip(r) A``.
    """
    with torch.no_grad():
        c = config.log_ratio_clamp
        log_ratio = (log_probs.detach() - old_log_probs).clamp_(-c, c)
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
        clipped = clipped_ratio != ratio
        coef = clipped_ratio.mul_(advantages).neg_()
        value = coef * log_probs.detach()
    return PolicyLossTerms(with_gradient(log_probs, value, coef), clipped, _no(mask), log_ratio)


def reinforce_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig
) -> PolicyLossTerms:
    """Plain REINFORCE: ``-A * log_probs`` (no ratio, no clip)."""
    with torch.no_grad():
        log_ratio = log_probs.detach() - old_log_probs
        coef = -advantages
        value = coef * log_probs.detach()
    return PolicyLossTerms(with_gradient(log_probs, value, coef), _no(mask), _no(mask), log_ratio)


def importance_sampling_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig
) -> PolicyLossTerms:
    """Unclipped importance-sampled policy gradient: ``-A * pi / pi_old`` (gradient ``-A r``)."""
    with torch.no_grad():
        log_ratio, inside = _log_ratio(log_probs, old_log_probs, config)
        ratio = log_ratio.exp()
        value = ratio.mul_(advantages).neg_()
        coef = value if inside is None else value * inside
    return PolicyLossTerms(with_gradient(log_probs, value, coef), _no(mask), _no(mask), log_ratio)


POLICY_LOSSES: Final = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "reinforce": reinforce_loss,
    "importance_sampling": importance_sampling_loss,
}
"""The built-in policy losses by name."""


def _token_mean(x: Tensor, w: Tensor, stats: GlobalBatchStats) -> Tensor:
    return masked_total(x.detach(), w) / max(stats.num_tokens, 1)


def _token_frac(flags: Tensor, mask: Tensor, stats: GlobalBatchStats, dtype: torch.dtype) -> Tensor:
    return torch.count_nonzero(flags & mask).to(dtype) / max(stats.num_tokens, 1)


def actor_loss(
    config: ActorLossConfig,
    stats: GlobalBatchStats,
    *,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    rollout_log_probs: Tensor | None = None,
) -> LossOutput:
    """The actor loss of one micro-batch from tensors (any float dtype; see :class:`ActorLoss`)."""
    fn = POLICY_LOSSES.get(config.policy_loss)
    if fn is None:
        from verl_core.kernel.registry import get_registry

        fn = get_registry().component("policy_loss", config.policy_loss).impl
    terms = fn(log_probs, old_log_probs, advantages, mask, config.policy)
    per_token = terms.loss
    dtype = per_token.dtype
    w = mask_weights(mask, dtype)
    flags = mask if mask.dtype == torch.bool else mask > 0
    metrics: dict[str, Tensor] = {}
    if config.offpolicy.enabled:
        if rollout_log_probs is None:
            raise BatchValidationError(
                f"the off-policy correction (ActorLossConfig.offpolicy, mode {config.offpolicy.mode!r}) needs "
                "rollout_log_probs; pass the rollout engine's log-probs or set mode='none'"
            )
        correction = offpolicy_correction(old_log_probs, rollout_log_probs, w, config.offpolicy)
        per_token = per_token * correction.weights
        metrics.update(correction_metrics(correction, config.offpolicy, stats))
    mode, L = config.loss_agg_mode, config.norm_length
    pg = aggregate(per_token, w, mode, stats, L)
    loss = pg
    metrics["pg_loss"] = pg.detach()
    metrics["pg_clipfrac"] = _token_frac(terms.clipped, flags, stats, dtype)
    metrics["pg_clipfrac_lower"] = _token_frac(terms.clipped_lower, flags, stats, dtype)
    metrics["ppo_kl"] = -_token_mean(terms.log_ratio, w, stats)
    if entropy is not None:
        metrics["entropy"] = _token_mean(entropy, w, stats)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * aggregate(entropy, w, mode, stats, L)
    if config.kl_loss_coef:
        if ref_log_probs is None:
            raise BatchValidationError(
                f"ActorLossConfig.kl_loss_coef = {config.kl_loss_coef} needs ref_log_probs; compute the "
                "reference policy's log-probs first or set kl_loss_coef=0"
            )
        kld = kl_estimate(log_probs, ref_log_probs, config.kl_loss_estimator)
        kl_term = aggregate(kld, w, mode, stats, L)
        loss = loss + config.kl_loss_coef * kl_term
        metrics["kl_loss"] = kl_term.detach()
        metrics["kl"] = _token_mean(kld, w, stats)
    return LossOutput(loss, metrics)


@dataclass(frozen=True)
class ActorLoss:
    """The actor's :class:`~verl_core.kernel.training.LossFn`: policy loss, entropy bonus, KL loss, correction.

    Reads from the micro-batch ``response_mask``, ``old_log_probs``, ``advantages``, the model's
    ``log_probs`` (and ``entropy`` when declared in :attr:`needs`), ``ref_log_probs`` when
    ``kl_loss_coef`` > 0 and ``rollout_log_probs`` when an off-policy correction is on. Every term, aggregation
    and metric is over ``batch.loss_mask`` (``loss_mask``, else ``response_mask``): observation
    tokens of a multi-turn response add nothing and get no gradient.

    Metrics (each a contribution; summed over micro-batches and ranks it is the global value):
    ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (token mean of
    ``old_log_probs - log_probs``), and when enabled ``entropy``, ``kl_loss``, ``kl``, and the
    correction's ``offpolicy/weight_mean`` with ``offpolicy/truncated_frac`` (``tis``) or
    ``offpolicy/masked_frac`` (``mis``) (see :func:`~verl_core.algorithms.offpolicy.correction_metrics`).
    """

    config: ActorLossConfig = field(default_factory=ActorLossConfig)

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """``log_probs``, plus ``entropy`` when the entropy bonus or metric is on."""
        if self.config.entropy_coef or self.config.entropy_metric:
            return frozenset({"log_probs", "entropy"})
        return frozenset({"log_probs"})

    @property
    def batch_fields(self) -> frozenset[str]:
        """Fields the micro-batch must hold besides the model outputs."""
        out = {"response_mask", "old_log_probs", "advantages"}
        if self.config.kl_loss_coef:
            out.add("ref_log_probs")
        if self.config.offpolicy.enabled:
            out.add("rollout_log_probs")
        return frozenset(out)

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """The loss of one micro-batch, normalised by the global ``stats``."""
        batch.require(*sorted(self.batch_fields | {"log_probs"} | self.needs), where="ActorLoss")
        return actor_loss(
            self.config,
            stats,
            log_probs=batch["log_probs"],
            old_log_probs=batch["old_log_probs"],
            advantages=batch["advantages"],
            mask=batch.loss_mask,
            entropy=batch["entropy"] if "entropy" in self.needs else None,
            ref_log_probs=batch["ref_log_probs"] if self.config.kl_loss_coef else None,
            rollout_log_probs=batch["rollout_log_probs"] if self.config.offpolicy.enabled else None,
        )


# ----------------------------------------------------------------------------- value loss
def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, config: CriticLossConfig
) -> ValueLossTerms:
    """``max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = clamp(V, old_V - c, old_V + c)`` (verl).

    Without ``clip_range_value`` it is ``(V - R)^2``. The aggregated loss is halved (see
    :func:`critic_loss`).
    """
    if config.clip_range_value is None:
        with torch.no_grad():
            err = values.detach() - returns
            value, coef = err.square(), 2.0 * err
        return ValueLossTerms(with_gradient(values, value, coef), _no(mask))
    with torch.no_grad():
        v = values.detach()
        err = v - returns
        c = config.clip_range_value
        # clamp into [old - c, old + c] as verl (inside the band the prediction is kept bit for
        # bit), reusing one bound buffer for both bounds
        bound = old_values - c
        v_clipped = torch.maximum(v, bound)
        torch.minimum(v_clipped, torch.add(old_values, c, out=bound), out=v_clipped)
        loss2 = v_clipped.sub_(returns).square_()
        value = err.square()
        clipped = loss2 > value  # the clipped prediction wins and has no gradient
        torch.maximum(value, loss2, out=value)
        coef = err.mul_(2.0).mul_(~clipped)
    return ValueLossTerms(with_gradient(values, value, coef), clipped)


VALUE_LOSSES: Final = {"clipped_mse": clipped_value_loss}
"""The built-in value losses by name."""


def critic_loss(
    config: CriticLossConfig,
    stats: GlobalBatchStats,
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
) -> LossOutput:
    """The critic loss ``0.5 * agg(value loss)`` of one micro-batch from tensors."""
    fn = VALUE_LOSSES.get(config.value_loss)
    if fn is None:
        from verl_core.kernel.registry import get_registry

        fn = get_registry().component("value_loss", config.value_loss).impl
    terms = fn(values, old_values, returns, mask, config)
    w = mask_weights(mask, values.dtype)
    flags = mask if mask.dtype == torch.bool else mask > 0
    vf = 0.5 * aggregate(terms.loss, w, config.loss_agg_mode, stats, config.norm_length)
    metrics: Mapping[str, Tensor] = {
        "vf_loss": vf.detach(),
        "vf_clipfrac": _token_frac(terms.clipped, flags, stats, values.dtype),
        "vpred_mean": _token_mean(values, w, stats),
    }
    return LossOutput(vf, metrics)


@dataclass(frozen=True)
class CriticLoss:
    """The critic's :class:`~verl_core.kernel.training.LossFn`: clipped value loss.

    Reads ``response_mask``, ``old_values``, ``returns`` and the model's ``values``; the loss and
    metrics are over ``batch.loss_mask``. Metrics: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``
    (contributions, as for :class:`ActorLoss`).
    """

    config: CriticLossConfig = field(default_factory=CriticLossConfig)

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """``values``."""
        return frozenset({"values"})

    @property
    def batch_fields(self) -> frozenset[str]:
        """Fields the micro-batch must hold besides the model outputs."""
        return frozenset({"response_mask", "old_values", "returns"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """The loss of one micro-batch, normalised by the global ``stats``."""
        batch.require(*sorted(self.batch_fields | {"values"}), where="CriticLoss")
        return critic_loss(
            self.config,
            stats,
            values=batch["values"],
            old_values=batch["old_values"],
            returns=batch["returns"],
            mask=batch.loss_mask,
        )


def _conforms(actor: ActorLoss, critic: CriticLoss) -> tuple[LossFn, LossFn]:
    """Static check (mypy) that both loss objects satisfy the LossFn protocol."""
    return actor, critic
