"""Typed, frozen configs of the built-in algorithms, validated on construction.

Bounds and choices are written once on the fields (``Annotated``, ``Literal``) and checked when a
config is built by the one typed converter (:mod:`verl_core.kernel.convert`): a value of the wrong
type or out of range raises :class:`~verl_core.kernel.errors.ConfigError` naming the config class, the
field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal, get_args

from verl_core.kernel.convert import Check, Ge, check_fields
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
    "OffPolicyConfig",
    "OffPolicyLevel",
    "OffPolicyMode",
    "PolicyLossConfig",
    "RLOOConfig",
    "ReMaxConfig",
    "ReinforcePPBaselineConfig",
    "ReinforcePPConfig",
    "RewardConfig",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How a per-token loss is reduced to a scalar (see :mod:`verl_core.algorithms.aggregation`)."""

AGG_MODES: Final[tuple[str, ...]] = get_args(AggMode)

KLName = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "kl", "mse", "low_var_kl", "low_var_kl+"]
"""A KL estimator name; ``+`` marks the straight-through variant (value of the estimator, gradient
of k2). ``kl``, ``mse`` and ``low_var_kl`` are verl's names for k1, k2 and k3."""

KL_ESTIMATORS: Final[tuple[str, ...]] = get_args(KLName)


def _range(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A bound written as an interval (``[0.0, 1.0]``, ``(0.0, inf]``), the form the configs' docs use."""

    def ok(v: float) -> bool:
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return Check(ok, f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


_UNIT = _range(0.0, 1.0)
_POSITIVE = _range(0.0, lo_open=True)
_NON_NEGATIVE = _range(0.0)


class _Checked:
    """Configs that check their fields against their annotations when built (the one converter)."""

    def __post_init__(self) -> None:
        check_fields(self, prefix=f"{type(self).__name__}.", label="option")



# ----------------------------------------------------------------------------- advantages
@dataclass(frozen=True)
class GAEConfig(_Checked):
    """Options of generalised advantage estimation.

    Attributes:
        gamma: Discount factor, in [0, 1].
        lam: GAE lambda, in [0, 1].
        whiten: Whiten the advantages over the batch's response tokens (verl does, always).
    """

    gamma: Annotated[float, _UNIT] = 1.0
    lam: Annotated[float, _UNIT] = 1.0
    whiten: bool = True



@dataclass(frozen=True)
class GRPOConfig(_Checked):
    """Options of GRPO's group-normalised outcome advantage.

    Attributes:
        norm_by_std: Divide by the group's (unbiased) std; False gives Dr. GRPO.
        epsilon: Added to the std before dividing, > 0 (verl: 1e-6).
    """

    norm_by_std: bool = True
    epsilon: Annotated[float, _POSITIVE] = 1e-6



@dataclass(frozen=True)
class RLOOConfig:
    """Options of RLOO (it has none; the baseline is the mean of the other samples of the group)."""


@dataclass(frozen=True)
class ReMaxConfig:
    """Options of ReMax (it has none; the baseline is the ``baseline_scores`` field)."""


@dataclass(frozen=True)
class ReinforcePPConfig(_Checked):
    """Options of REINFORCE++ (discounted returns, whitened over the batch).

    Attributes:
        gamma: Discount factor, in [0, 1].
        whiten: Whiten the returns over the batch's response tokens (verl does, always).
    """

    gamma: Annotated[float, _UNIT] = 1.0
    whiten: bool = True



@dataclass(frozen=True)
class ReinforcePPBaselineConfig:
    """Options of REINFORCE++ with a group-mean baseline.

    Attributes:
        whiten: Whiten the advantages over the batch's response tokens (verl does, always).
    """

    whiten: bool = True


# ----------------------------------------------------------------------------- rewards and KL
@dataclass(frozen=True)
class RewardConfig(_Checked):
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

    kl_coef: Annotated[float, _NON_NEGATIVE] = 0.0
    kl_estimator: KLName = "k1"
    controller: Literal["fixed", "adaptive"] = "fixed"
    target_kl: Annotated[float, _POSITIVE] = 0.1
    horizon: Annotated[float, _POSITIVE] = 10000.0



# ----------------------------------------------------------------------------- losses
@dataclass(frozen=True)
class PolicyLossConfig(_Checked):
    """Options shared by the built-in policy losses.

    Attributes:
        clip_low: Lower clip range eps_low: the ratio is clipped at 1 - eps_low; in [0, 1]
            (1 = no lower clip).
        clip_high: Upper clip range eps_high (DAPO's clip-higher): clipped at 1 + eps_high; >= 0.
        clip_ratio_c: Dual-clip bound c > 1 for negative advantages (PPO only; None = off).
        log_ratio_clamp: |log ratio| is clamped to this before exp (verl: 20), > 0.
    """

    clip_low: Annotated[float, _UNIT] = 0.2
    clip_high: Annotated[float, _NON_NEGATIVE] = 0.2
    clip_ratio_c: Annotated[float, _range(1.0, lo_open=True)] | None = 3.0
    log_ratio_clamp: Annotated[float, _POSITIVE] = 20.0



OffPolicyMode = Literal["none", "tis", "mis"]
"""Off-policy correction: ``none``, truncated (``tis``) or masked (``mis``) importance sampling."""

OffPolicyLevel = Literal["token", "sequence", "geometric"]
"""Where the correction's ratio is taken: per token, per response (product), or per response
(geometric mean)."""


@dataclass(frozen=True)
class OffPolicyConfig(_Checked):
    """Off-policy correction of the policy loss against the rollout engine's log-probs.

    The rollout engine samples from ``pi_rollout`` (its log-probs ``rollout_log_probs``) while the
    loss is built around the training engine's ``pi_old`` (``old_log_probs``, the same tokens); a
    different engine, precision or a stale rollout makes them differ. The importance ratio
    ``rho = pi_old / pi_rollout`` (detached) is computed in log space at ``level``:

    * ``token``: ``rho_t = exp(log pi_old(y_t) - log pi_rollout(y_t))``, one per token;
    * ``sequence``: ``rho = exp(sum_t (log pi_old(y_t) - log pi_rollout(y_t)))``, the product of
      the token ratios over the response, shared by its tokens;
    * ``geometric``: ``rho = exp(mean_t (...))``, their geometric mean, shared by its tokens;

    each log clamped to +-20 before ``exp``. ``tis`` multiplies each token's policy loss by
    ``min(rho, upper)`` (truncated importance sampling); ``mis`` by ``rho`` where ``lower <= rho <=
    upper`` and by 0 outside (masked importance sampling: the token, or the whole response at the
    sequence levels, is dropped from the policy loss; the loss's normalising counts stay those of
    the mini-batch). See :mod:`verl_core.algorithms.offpolicy`.

    Attributes:
        mode: ``none`` (no correction: the loss is exactly the uncorrected one), ``tis`` or ``mis``.
        level: ``token``, ``sequence`` or ``geometric``.
        upper: The truncation cap (``tis``) or the upper bound of the kept ratios (``mis``), >= 1
            (verl's default: 2.0; geometric-mean ratios stay near 1, so their bounds are tight,
            e.g. 1.001).
        lower: Lower bound of the kept ratios (``mis`` only), in [0, 1]; None = ``1 / upper``.
    """

    mode: OffPolicyMode = "none"
    level: OffPolicyLevel = "token"
    upper: Annotated[float, _range(1.0)] = 2.0
    lower: Annotated[float, _UNIT] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lower is not None and self.mode == "tis":
            raise ConfigError(
                f"option 'lower' = {self.lower} applies only to mode 'mis' (mode 'tis' truncates at 'upper' and "
                "has no lower bound); remove lower or set mode = 'mis'"
            )

    @property
    def enabled(self) -> bool:
        """True when the loss is corrected (``mode`` is not ``none``)."""
        return self.mode != "none"

    @property
    def lower_bound(self) -> float:
        """The lower bound ``mis`` keeps ratios from: ``lower``, else ``1 / upper``."""
        return 1.0 / self.upper if self.lower is None else self.lower



@dataclass(frozen=True)
class ActorLossConfig(_Checked):
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
        offpolicy: Off-policy correction against ``rollout_log_probs`` (default: none).
        entropy_metric: Report the entropy even when ``entropy_coef`` is 0 (costs the engine an
            entropy computation).
    """

    policy_loss: str = "ppo"
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: AggMode = "token-mean"
    norm_length: Annotated[int, Ge(1)] | None = None
    entropy_coef: Annotated[float, _NON_NEGATIVE] = 0.0
    kl_loss_coef: Annotated[float, _NON_NEGATIVE] = 0.0
    kl_loss_estimator: KLName = "k3"
    offpolicy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    entropy_metric: bool = False



@dataclass(frozen=True)
class CriticLossConfig(_Checked):
    """Options of the critic's clipped value loss.

    Attributes:
        value_loss: Registered value-loss name.
        clip_range_value: Clip range of the value prediction around ``old_values``, > 0 (verl:
            0.5); None disables clipping.
        loss_agg_mode: Aggregation of the per-token loss.
        norm_length: Length L of ``seq-mean-token-sum-norm`` (None: the padded response width).
    """

    value_loss: str = "clipped_mse"
    clip_range_value: Annotated[float, _POSITIVE] | None = 0.5
    loss_agg_mode: AggMode = "token-mean"
    norm_length: Annotated[int, Ge(1)] | None = None

