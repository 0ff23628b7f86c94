"""The built-in RL algorithms: advantage estimators, policy and value losses, KL, aggregation.

Everything here is registered by name through the ``verl_algorithm_components`` and
``verl_algorithm_presets`` hooks (see :mod:`verl_core.algorithms.builtin`); :class:`Algorithm`
bundles the parts an RL step uses.

The numerics follow verl 0.9.1's ``verl.trainer.ppo.core_algos`` (cross-checked by
``benchmarks/bench_algorithms.py --verl``). The deliberate differences, each documented where it
lives:

* aggregation is normalised by the global mini-batch (``GlobalBatchStats``), and
  ``seq-mean-token-sum-norm`` divides by a constant length, not the micro-batch's padded width
  (:mod:`~verl_core.algorithms.aggregation`);
* advantages and returns are 0 at masked positions; whitening one or no token gives 0 instead of
  raising; group statistics are computed in float64 (:mod:`~verl_core.algorithms.advantages`);
* an empty response keeps its score in its group's statistics (verl would place it on the last
  padding token); the reward-KL metric averages over non-empty responses
  (:mod:`~verl_core.algorithms.kl`);
* a multi-turn batch (``loss_mask``) is estimated over its sampled tokens, observation tokens
  skipped, and every loss, KL and aggregation reads ``TensorBatch.loss_mask``
  (:mod:`~verl_core.algorithms.loss_tokens`);
* losses attach their analytic gradient (identical to autograd of verl's formulas except at
  measure-zero ties between clip branches); gradients flow through the model outputs only
  (:mod:`~verl_core.algorithms.losses`).
"""

from __future__ import annotations

from verl_core.algorithms.advantages import (
    discounted_cumsum,
    gae,
    group_index,
    grpo,
    masked_whiten,
    outcome_rewards,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from verl_core.algorithms.aggregation import (
    AGGREGATIONS,
    aggregate,
    mask_weights,
    masked_row_sums,
    masked_total,
)
from verl_core.algorithms.bundle import Algorithm
from verl_core.algorithms.config import (
    AGG_MODES,
    KL_ESTIMATORS,
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
from verl_core.algorithms.kl import (
    KL_FUNCTIONS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    compute_token_rewards,
    kl_estimate,
    make_kl_controller,
)
from verl_core.algorithms.loss_tokens import LossTokenLayout, over_loss_tokens
from verl_core.algorithms.losses import (
    POLICY_LOSSES,
    ActorLoss,
    CriticLoss,
    actor_loss,
    cispo_loss,
    clipped_value_loss,
    critic_loss,
    gspo_loss,
    importance_sampling_loss,
    ppo_loss,
    reinforce_loss,
)
from verl_core.algorithms.offpolicy import (
    OffPolicyCorrection,
    correction_metrics,
    offpolicy_correction,
    ratio_statistics,
    rollout_log_ratio,
)
from verl_core.algorithms.presets import PRESET_TABLE, PRESETS, Preset, build_preset, preset_options

__all__ = [
    "AGGREGATIONS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "KL_FUNCTIONS",
    "POLICY_LOSSES",
    "PRESETS",
    "PRESET_TABLE",
    "ActorLoss",
    "ActorLossConfig",
    "AdaptiveKLController",
    "AggMode",
    "Algorithm",
    "CriticLoss",
    "CriticLossConfig",
    "FixedKLController",
    "GAEConfig",
    "GRPOConfig",
    "KLController",
    "KLName",
    "LossTokenLayout",
    "OffPolicyConfig",
    "OffPolicyCorrection",
    "PolicyLossConfig",
    "Preset",
    "RLOOConfig",
    "ReMaxConfig",
    "ReinforcePPBaselineConfig",
    "ReinforcePPConfig",
    "RewardConfig",
    "actor_loss",
    "aggregate",
    "build_preset",
    "cispo_loss",
    "clipped_value_loss",
    "compute_token_rewards",
    "correction_metrics",
    "critic_loss",
    "discounted_cumsum",
    "gae",
    "group_index",
    "grpo",
    "gspo_loss",
    "importance_sampling_loss",
    "kl_estimate",
    "make_kl_controller",
    "mask_weights",
    "masked_row_sums",
    "masked_total",
    "masked_whiten",
    "offpolicy_correction",
    "outcome_rewards",
    "over_loss_tokens",
    "ppo_loss",
    "preset_options",
    "ratio_statistics",
    "reinforce_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "rollout_log_ratio",
]
