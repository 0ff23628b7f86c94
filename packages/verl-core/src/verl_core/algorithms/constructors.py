"""The constructors of :class:`~verl_core.algorithms.bundle.Algorithm` (verl's defaults per algorithm).

Each takes the class as its first argument; Algorithm binds them as its classmethods
(``Algorithm.ppo(...)``, ``Algorithm.grpo(...)``, ...), which is how they are called. Every one takes
``offpolicy``: the off-policy correction of the actor loss
(:class:`~verl_core.algorithms.config.OffPolicyConfig`; None = none). A run's config sets it in its
own section, ``[algorithm.offpolicy]``, not among a preset's options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from verl_core.algorithms.config import (
    ActorLossConfig,
    AggMode,
    CriticLossConfig,
    GAEConfig,
    GRPOConfig,
    KLName,
    OffPolicyConfig,
    PolicyLossConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    ReMaxConfig,
    RewardConfig,
    RLOOConfig,
)

if TYPE_CHECKING:
    from verl_core.algorithms.bundle import Algorithm

__all__ = ["cispo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "remax", "rloo"]
"""Every constructor; :class:`Algorithm` binds each as its classmethod, and a preset names one."""


def _actor(
    policy_loss: str,
    clip_low: float,
    clip_high: float | None,
    clip_ratio_c: float | None,
    loss_agg_mode: AggMode,
    entropy_coef: float,
    kl_loss_coef: float,
    kl_loss_estimator: KLName,
    offpolicy: OffPolicyConfig | None,
    norm_length: int | None = None,
) -> ActorLossConfig:
    return ActorLossConfig(
        policy_loss=policy_loss,
        policy=PolicyLossConfig(
            clip_low=clip_low,
            clip_high=clip_low if clip_high is None else clip_high,
            clip_ratio_c=clip_ratio_c,
        ),
        loss_agg_mode=loss_agg_mode,
        norm_length=norm_length,
        entropy_coef=entropy_coef,
        kl_loss_coef=kl_loss_coef,
        kl_loss_estimator=kl_loss_estimator,
        offpolicy=offpolicy if offpolicy is not None else OffPolicyConfig(),
    )


def ppo(
    cls: type[Algorithm],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    clip_range_value: float | None = 0.5,
    loss_agg_mode: AggMode = "token-mean",
    entropy_coef: float = 0.0,
    kl_coef: float = 0.001,
    kl_estimator: KLName = "k1",
    kl_controller: Literal["fixed", "adaptive"] = "fixed",
    target_kl: float = 0.1,
    horizon: float = 10000.0,
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """PPO: GAE with a critic, clipped policy and value losses, dual clip.

    Defaults are verl's (clip 0.2, dual clip 3, value clip 0.5, gamma = lam = 1, KL coefficient
    0.001 with the k1 estimator), except that the KL penalty is in the reward by default (verl's
    ``use_kl_in_reward`` is off by default): pass ``kl_coef=0`` to turn it off.
    """
    return cls(
        "ppo",
        "gae",
        GAEConfig(gamma=gamma, lam=lam),
        actor=_actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                     0.0, "k3", offpolicy),
        critic=CriticLossConfig(clip_range_value=clip_range_value, loss_agg_mode=loss_agg_mode),
        reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator,
                            controller=kl_controller, target_kl=target_kl, horizon=horizon),
    )


def grpo(
    cls: type[Algorithm],
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: AggMode = "token-mean",
    entropy_coef: float = 0.0,
    kl_loss_coef: float = 0.001,
    kl_loss_estimator: KLName = "k3",
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """GRPO: group-normalised advantages, PPO clip, KL to the reference as a loss term.

    Defaults follow verl's GRPO recipe: KL loss coefficient 0.001 with k3 (``low_var_kl``),
    token-mean aggregation, clip 0.2 with dual clip 3; ``clip_high`` gives DAPO's clip-higher.
    """
    return cls(
        "grpo" if norm_by_std else "dr_grpo",
        "grpo",
        GRPOConfig(norm_by_std=norm_by_std, epsilon=epsilon),
        actor=_actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                     kl_loss_coef, kl_loss_estimator, offpolicy),
    )


def dr_grpo(
    cls: type[Algorithm],
    *,
    norm_length: int | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    entropy_coef: float = 0.0,
    kl_loss_coef: float = 0.0,
    kl_loss_estimator: KLName = "k3",
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """Dr. GRPO: no std normalisation, ``seq-mean-token-sum-norm`` aggregation, no KL.

    ``norm_length`` is the constant L of the aggregation (Dr. GRPO: the maximum response
    length); None uses the mini-batch's padded width.
    """
    return cls(
        "dr_grpo",
        "grpo",
        GRPOConfig(norm_by_std=False),
        actor=_actor("ppo", clip_low, clip_high, clip_ratio_c, "seq-mean-token-sum-norm",
                     entropy_coef, kl_loss_coef, kl_loss_estimator, offpolicy, norm_length),
    )


def rloo(
    cls: type[Algorithm],
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: AggMode = "token-mean",
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: KLName = "k1",
    kl_loss_coef: float = 0.0,
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """RLOO: leave-one-out baseline, PPO clip; optional KL penalty in the reward."""
    return cls(
        "rloo",
        "rloo",
        RLOOConfig(),
        actor=_actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                     kl_loss_coef, "k3", offpolicy),
        reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator),
    )


def reinforce_pp(
    cls: type[Algorithm],
    *,
    baseline: bool = False,
    gamma: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: AggMode = "token-mean",
    entropy_coef: float = 0.0,
    kl_coef: float = 0.001,
    kl_estimator: KLName = "k1",
    kl_loss_coef: float = 0.0,
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """REINFORCE++ (``baseline=True``: with the group-mean baseline); KL penalty in the reward.

    The KL coefficient defaults to 0.001 (k1); pass ``kl_coef=0`` to turn the penalty off.
    """
    estimator = "reinforce_pp_baseline" if baseline else "reinforce_pp"
    config: Any = ReinforcePPBaselineConfig() if baseline else ReinforcePPConfig(gamma=gamma)
    return cls(
        estimator,
        estimator,
        config,
        actor=_actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                     kl_loss_coef, "k3", offpolicy),
        reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator),
    )


def reinforce_pp_baseline(cls: type[Algorithm], /, **kwargs: Any) -> Algorithm:
    """REINFORCE++ with the group-mean baseline (see :meth:`reinforce_pp`)."""
    return cls.reinforce_pp(baseline=True, **kwargs)


def remax(
    cls: type[Algorithm],
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: AggMode = "token-mean",
    entropy_coef: float = 0.0,
    kl_coef: float = 0.001,
    kl_estimator: KLName = "k1",
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """ReMax: the greedy response's score (``baseline_scores``) as baseline; KL in the reward."""
    return cls(
        "remax",
        "remax",
        ReMaxConfig(),
        actor=_actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                     0.0, "k3", offpolicy),
        reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator),
    )


def gspo(
    cls: type[Algorithm],
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    loss_agg_mode: AggMode = "seq-mean-token-mean",
    norm_by_std: bool = True,
    entropy_coef: float = 0.0,
    kl_loss_coef: float = 0.0,
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """GSPO: GRPO advantages with the sequence-level ratio (paper's clip 3e-4 / 4e-4)."""
    return cls(
        "gspo",
        "grpo",
        GRPOConfig(norm_by_std=norm_by_std),
        actor=_actor("gspo", clip_low, clip_high, None, loss_agg_mode, entropy_coef,
                     kl_loss_coef, "k3", offpolicy),
    )


def cispo(
    cls: type[Algorithm],
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    loss_agg_mode: AggMode = "token-mean",
    norm_by_std: bool = True,
    entropy_coef: float = 0.0,
    kl_loss_coef: float = 0.0,
    offpolicy: OffPolicyConfig | None = None,
) -> Algorithm:
    """CISPO: GRPO advantages, REINFORCE weighted by the clipped stop-gradient ratio.

    The weight is clipped to [1 - clip_low, 1 + clip_high] (verl's defaults 0.2 / 0.2); the
    CISPO paper sets no lower bound (``clip_low=1.0``) and tunes only ``clip_high``.
    """
    return cls(
        "cispo",
        "grpo",
        GRPOConfig(norm_by_std=norm_by_std),
        actor=_actor("cispo", clip_low, clip_high, None, loss_agg_mode, entropy_coef,
                     kl_loss_coef, "k3", offpolicy),
    )
