"""The built-in algorithm components and presets, registered through the same hooks as a plugin's.

The package facade (``verl_core/__init__``) hands this module to the registry as a built-in plugin,
loaded when algorithm components are first looked up and whatever the plugin autoload setting: the
kernel never imports the algorithms layer.
"""

from __future__ import annotations

from verl_core.algorithms import advantages as adv
from verl_core.algorithms import aggregation as agg
from verl_core.algorithms import kl, losses
from verl_core.algorithms.config import (
    CriticLossConfig,
    GAEConfig,
    GRPOConfig,
    PolicyLossConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    ReMaxConfig,
    RLOOConfig,
)
from verl_core.algorithms.presets import PRESET_TABLE
from verl_core.algorithms.token_estimators import grpo_token
from verl_core.kernel.algorithm import AlgorithmComponent, Preset
from verl_core.kernel.hookspecs import hookimpl


def _components() -> list[AlgorithmComponent]:
    c = AlgorithmComponent
    rewards = ("token_rewards",)
    grouped = ("token_rewards", "group_ids")
    out = [
        c.advantage("gae", adv.gae, GAEConfig, "Generalised advantage estimation with a critic.",
                    reads=(*rewards, "values"), needs=("critic",)),
        c.advantage("grpo", adv.grpo, GRPOConfig,
                    "Group-normalised outcome advantage (norm_by_std=False: Dr. GRPO).",
                    reads=grouped, needs=("groups",), outcome=True),
        c.advantage("rloo", adv.rloo, RLOOConfig, "Leave-one-out group baseline.",
                    reads=grouped, needs=("groups",), outcome=True),
        c.advantage("reinforce_pp", adv.reinforce_pp, ReinforcePPConfig,
                    "REINFORCE++: discounted returns whitened over the batch.", reads=rewards),
        c.advantage("reinforce_pp_baseline", adv.reinforce_pp_baseline, ReinforcePPBaselineConfig,
                    "REINFORCE++ with a group-mean baseline, whitened over the batch.",
                    reads=grouped, needs=("groups",), outcome=True),
        c.advantage("remax", adv.remax, ReMaxConfig, "Reward-to-go minus the greedy baseline score.",
                    reads=(*rewards, "baseline_scores"), needs=("greedy_baseline",)),
        c.advantage("grpo_token", grpo_token, GRPOConfig,
                    "GRPO with per-position group normalisation of dense token_scores.",
                    reads=("token_scores", "group_ids"), needs=("groups", "token_scores")),
        c.policy_loss("ppo", losses.ppo_loss, PolicyLossConfig, "PPO clip with clip-low/clip-high and dual clip."),
        c.policy_loss("gspo", losses.gspo_loss, PolicyLossConfig, "Sequence-level ratio clip (GSPO)."),
        c.policy_loss("cispo", losses.cispo_loss, PolicyLossConfig,
                      "Clipped stop-gradient IS weight times REINFORCE (CISPO)."),
        c.policy_loss("reinforce", losses.reinforce_loss, PolicyLossConfig, "-A * log pi."),
        c.policy_loss("importance_sampling", losses.importance_sampling_loss, PolicyLossConfig,
                      "-A * pi / pi_old, unclipped."),
        c.value_loss("clipped_mse", losses.clipped_value_loss, CriticLossConfig,
                     "Clipped squared error to the returns."),
    ]
    for name, fn in kl.KL_FUNCTIONS.items():
        doc = "straight-through: value of " + name[:-1] + ", gradient of k2" if name.endswith("+") else name
        out.append(c.kl(name, fn, f"KL estimator {doc}."))
    for mode, agg_fn in agg.AGGREGATIONS.items():
        out.append(c.aggregation(mode, agg_fn, (agg_fn.__doc__ or "").splitlines()[0]))
    return out


@hookimpl
def verl_algorithm_components() -> list[AlgorithmComponent]:
    """The algorithms verl-core ships."""
    return _components()


@hookimpl
def verl_algorithm_presets() -> list[Preset]:
    """The named algorithms verl-core ships (:data:`~verl_core.algorithms.presets.PRESET_TABLE`)."""
    return list(PRESET_TABLE.values())
