"""Typed, frozen configs of the built-in algorithms, validated on construction.

Every out-of-range value raises :class:`~verl_core.kernel.errors.ConfigError` naming the config class, the
field, the value and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

from verl_core.kernel.errors import ConfigError

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "ActorLossConfig",
    "AggMode",
    "CriticLossConfig",
    "GAEConfig",
    "GRPOConfig",
    "KLName",
    "PolicyLossConfig",
    "RLOOConfig",
    "ReMaxConfig",
    "ReinforcePPBaselineConfig",
    "ReinforcePPConfig",
    "RewardConfig",
    "TISConfig",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How a per-token loss is reduced to a scalar (see :mod:`verl_core.algorithms.aggregation`)."""

AGG_MODES: Final[tuple[str, ...]] = get_args(AggMode)

KLName = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "kl", "mse", "low_var_kl", "low_var_kl+"]
"""A KL estimator name; ``+`` marks the straight-through variant (value of the estimator, gradient
of k2). ``kl``, ``mse`` and ``low_var_kl`` are verl's names for k1, k2 and k3."""

KL_ESTIMATORS: Final[tuple[str, ...]] = get_args(KLName)


def _fail(owner: object, name: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"{type(owner).__name__}.{name} = {value!r} is out of range; allowed: {allowed}")


def _finite(owner: object, name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _fail(owner, name, value, "a finite number")


def _in_range(owner: object, name: str, value: float, lo: float, hi: float, *,
              lo_open: bool = False, hi_open: bool = False) -> None:
    _finite(owner, name, value)
    if (value < lo or (lo_open and value == lo)) or (value > hi or (hi_open and value == hi)):
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise _fail(owner, name, value, f"{lb}{lo}, {hi}{rb}")


def _positive(owner: object, name: str, value: float) -> None:
    _in_range(owner, name, value, 0.0, math.inf, lo_open=True)


def _non_negative(owner: object, name: str, value: float) -> None:
    _in_range(owner, name, value, 0.0, math.inf)


def _choice(owner: object, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _fail(owner, name, value, "one of " + ", ".join(repr(a) for a in allowed))


def _opt_length(owner: object, name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise _fail(owner, name, value, "None or an integer >= 1")


# ----------------------------------------------------------------------------- advantages
@dataclass(frozen=True)
class GAEConfig:
    """Options of generalised advantage estimation.

    Attributes:
        gamma: Discount factor, in [0, 1].
        lam: GAE lambda, in [0, 1].
        whiten: Whiten the advantages over the batch's response tokens (verl does, always).
    """

    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True

    def __post_init__(self) -> None:
        _in_range(self, "gamma", self.gamma, 0.0, 1.0)
        _in_range(self, "lam", self.lam, 0.0, 1.0)


@dataclass(frozen=True)
class GRPOConfig:
    """Options of GRPO's group-normalised outcome advantage.

    Attributes:
        norm_by_std: Divide by the group's (unbiased) std; False gives Dr. GRPO.
        epsilon: Added to the std before dividing, > 0 (verl: 1e-6).
    """

    norm_by_std: bool = True
    epsilon: float = 1e-6

    def __post_init__(self) -> None:
        _positive(self, "epsilon", self.epsilon)


@dataclass(frozen=True)
class RLOOConfig:
    """Options of RLOO (it has none; the baseline is the mean of the other samples of the group)."""


@dataclass(frozen=True)
class ReMaxConfig:
    """Options of ReMax (it has none; the baseline is the ``baseline_scores`` field)."""


@dataclass(frozen=True)
class ReinforcePPConfig:
    """Options of REINFORCE++ (discounted returns, whitened over the batch).

    Attributes:
        gamma: Discount factor, in [0, 1].
        whiten: Whiten the returns over the batch's response tokens (verl does, always).
    """

    gamma: float = 1.0
    whiten: bool = True

    def __post_init__(self) -> None:
        _in_range(self, "gamma", self.gamma, 0.0, 1.0)


@dataclass(frozen=True)
class ReinforcePPBaselineConfig:
    """Options of REINFORCE++ with a group-mean baseline.

    Attributes:
        whiten: Whiten the advantages over the batch's response tokens (verl does, always).
    """

    whiten: bool = True


# ----------------------------------------------------------------------------- rewards and KL
@dataclass(frozen=True)
class RewardConfig:
    """How scores become ``token_rewards``, with an optional KL penalty against the reference.

    Attributes:
        kl_coef: Initial coefficient beta of the KL penalty in the reward, >= 0 (0 = no penalty,
            and ``ref_log_probs`` is not needed).
        kl_estimator: Estimator of the per-token penalty (of ``old_log_probs`` vs ``ref_log_probs``).
        controller: ``fixed`` keeps beta; ``adaptive`` moves it towards ``target_kl`` (Ziegler et
            al. 2019, as verl's AdaptiveKLController).
        target_kl: Target KL of the adaptive controller, > 0.
        horizon: Horizon of the adaptive controller (samples), > 0.
    """

    kl_coef: float = 0.0
    kl_estimator: KLName = "k1"
    controller: Literal["fixed", "adaptive"] = "fixed"
    target_kl: float = 0.1
    horizon: float = 10000.0

    def __post_init__(self) -> None:
        _non_negative(self, "kl_coef", self.kl_coef)
        _choice(self, "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice(self, "controller", self.controller, ("fixed", "adaptive"))
        _positive(self, "target_kl", self.target_kl)
        _positive(self, "horizon", self.horizon)


# ----------------------------------------------------------------------------- losses
@dataclass(frozen=True)
class PolicyLossConfig:
    """Options shared by the built-in policy losses.

    Attributes:
        clip_low: Lower clip range eps_low: the ratio is clipped at 1 - eps_low; in [0, 1]
            (1 = no lower clip).
        clip_high: Upper clip range eps_high (DAPO's clip-higher): clipped at 1 + eps_high; >= 0.
        clip_ratio_c: Dual-clip bound c > 1 for negative advantages (PPO only; None = off).
        log_ratio_clamp: |log ratio| is clamped to this before exp (verl: 20), > 0.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:
        _in_range(self, "clip_low", self.clip_low, 0.0, 1.0)
        _non_negative(self, "clip_high", self.clip_high)
        if self.clip_ratio_c is not None:
            _in_range(self, "clip_ratio_c", self.clip_ratio_c, 1.0, math.inf, lo_open=True)
        _positive(self, "log_ratio_clamp", self.log_ratio_clamp)


@dataclass(frozen=True)
class TISConfig:
    """Truncated importance sampling against the rollout engine's log-probs.

    The weight ``min(pi_old / pi_rollout, cap)`` (token level) or
    ``min(prod_t pi_old / pi_rollout, cap)`` (sequence level) multiplies each token's policy loss;
    it corrects the mismatch between the rollout and the training engine. Needs
    ``rollout_log_probs``.

    Attributes:
        level: ``token`` or ``sequence``.
        cap: Upper bound of the weight, > 0 (verl's default threshold: 2.0).
    """

    level: Literal["token", "sequence"] = "token"
    cap: float = 2.0

    def __post_init__(self) -> None:
        _choice(self, "level", self.level, ("token", "sequence"))
        _positive(self, "cap", self.cap)


@dataclass(frozen=True)
class ActorLossConfig:
    """Everything the actor's loss needs besides the batch.

    Attributes:
        policy_loss: Registered policy-loss name (``ppo``, ``gspo``, ``cispo``, ``reinforce``,
            ``importance_sampling`` or a plugin's).
        policy: Options of the policy loss.
        loss_agg_mode: Aggregation of every per-token term (policy, entropy, KL loss).
        norm_length: Length L of ``seq-mean-token-sum-norm``; None uses the mini-batch's padded
            response width (``GlobalBatchStats.max_response_len``).
        entropy_coef: Weight of the entropy bonus (subtracted from the loss), >= 0.
        kl_loss_coef: Weight of the KL-to-reference loss term, >= 0 (needs ``ref_log_probs``).
        kl_loss_estimator: Estimator of that term (verl's default: ``low_var_kl`` = k3).
        tis: Truncated importance sampling against ``rollout_log_probs``, or None.
        entropy_metric: Report the entropy even when ``entropy_coef`` is 0 (costs the engine an
            entropy computation).
    """

    policy_loss: str = "ppo"
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: AggMode = "token-mean"
    norm_length: int | None = None
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_estimator: KLName = "k3"
    tis: TISConfig | None = None
    entropy_metric: bool = False

    def __post_init__(self) -> None:
        _choice(self, "loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        _opt_length(self, "norm_length", self.norm_length)
        _non_negative(self, "entropy_coef", self.entropy_coef)
        _non_negative(self, "kl_loss_coef", self.kl_loss_coef)
        _choice(self, "kl_loss_estimator", self.kl_loss_estimator, KL_ESTIMATORS)
        if not isinstance(self.policy, PolicyLossConfig):
            raise _fail(self, "policy", self.policy, "a PolicyLossConfig")
        if self.tis is not None and not isinstance(self.tis, TISConfig):
            raise _fail(self, "tis", self.tis, "None or a TISConfig")


@dataclass(frozen=True)
class CriticLossConfig:
    """Options of the critic's clipped value loss.

    Attributes:
        value_loss: Registered value-loss name.
        clip_range_value: Clip range of the value prediction around ``old_values``, > 0 (verl:
            0.5); None disables clipping.
        loss_agg_mode: Aggregation of the per-token loss.
        norm_length: Length L of ``seq-mean-token-sum-norm`` (None: the padded response width).
    """

    value_loss: str = "clipped_mse"
    clip_range_value: float | None = 0.5
    loss_agg_mode: AggMode = "token-mean"
    norm_length: int | None = None

    def __post_init__(self) -> None:
        if self.clip_range_value is not None:
            _positive(self, "clip_range_value", self.clip_range_value)
        _choice(self, "loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        _opt_length(self, "norm_length", self.norm_length)
