"""The algorithm of an RL run from its config: the preset, and which engines and stages it needs.

The presets are the registry's (:meth:`~verl_core.kernel.registry.Registry.presets`: verl-core's
:data:`~verl_core.algorithms.presets.PRESET_TABLE` and a plugin's); :func:`build_algorithm`
builds one (with the ``[algorithm.offpolicy]`` correction) and :class:`AlgorithmSetup` checks the
``algorithm`` section against the rest of the config before anything is built;
:func:`check_offpolicy_rollout` checks the correction against the rollout engine once it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl_core.algorithms.bundle import Algorithm
from verl_core.algorithms.config import OffPolicyConfig
from verl_core.algorithms.losses import ActorLoss
from verl_core.algorithms.presets import build_preset
from verl_core.kernel.algorithm import Preset
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.registry import get_registry
from verl_core.kernel.rollout import RolloutEngine
from verl_core.trainer.config import RunConfig

__all__ = ["AlgorithmSetup", "build_algorithm", "check_offpolicy_rollout", "find_preset"]


def build_algorithm(name: str, options: Mapping[str, Any], offpolicy: OffPolicyConfig | None = None) -> Algorithm:
    """The :class:`verl_core.algorithms.Algorithm` preset ``name`` with ``options``.

    ``offpolicy`` is the actor loss's off-policy correction (the ``[algorithm.offpolicy]``
    section; None = none); every preset takes it.

    The names and what each one sets are the registered presets: the rows of
    :data:`~verl_core.algorithms.presets.PRESET_TABLE` and those of plugins (the
    ``verl_algorithm_presets`` hook). E.g. ``dapo`` is GRPO with clip-higher
    (``clip_high=0.28``) and no KL loss, for which the trainer turns on dynamic sampling;
    ``grpo_token`` is GRPO's loss with the per-position estimator of
    :mod:`verl_core.algorithms.token_estimators` (it needs dense ``token_scores``: ``task.reward="token"``).

    Raises:
        ConfigError: an unknown name (listing the presets), or an option the preset does not take
            (naming ``algorithm.options.<key>``).
    """
    return build_preset(find_preset(name), options, offpolicy=offpolicy)


def find_preset(name: str) -> Preset:
    """The registered preset ``name`` (verl-core's or a plugin's).

    Raises:
        ConfigError: no preset of that name, naming ``algorithm.name`` and listing the registered ones.
    """
    presets = get_registry().presets()
    if name not in presets:
        raise ConfigError(f"config key 'algorithm.name': unknown algorithm {name!r}; choices: {', '.join(presets)}")
    return presets[name]


def check_offpolicy_rollout(config: RunConfig, rollout: RolloutEngine) -> None:
    """Refuse an off-policy correction whose ratio would be built on inexact rollout log-probs.

    The correction's ratio is ``pi_old / pi_rollout``: when the rollout engine's
    ``rollout_log_probs`` do not follow the schema's definition under the run's sampling (e.g.
    vLLM with top-k/top-p truncation, see ``RolloutEngine.log_probs_exact``), the ratio measures
    the difference of definitions, not the mismatch of the engines, and would reweigh the loss by
    it. Called when the rollout engine is built, before any step; nothing to check with ``mode``
    ``none``.

    Raises:
        ConfigError: naming ``algorithm.offpolicy.mode``, the rollout backend and the sampling.
    """
    correction = config.algorithm.offpolicy
    if not correction.enabled:
        return
    r = config.rollout
    if rollout.log_probs_exact(r.sampling_params()):
        return
    raise ConfigError(
        f"config key 'algorithm.offpolicy.mode' = {correction.mode!r} corrects the loss by the ratio of the training "
        f"engine's log-probs to the rollout engine's, but the rollout backend {config.backends.rollout!r} reports "
        f"log-probs that are not exact under this run's sampling (rollout.temperature = {r.temperature}, "
        f"rollout.top_p = {r.top_p}, rollout.top_k = {r.top_k}); sample without truncation (rollout.top_p = 1.0, "
        "rollout.top_k = 0), configure the rollout backend to report exact log-probs, or set "
        "algorithm.offpolicy.mode = 'none'"
    )


@dataclasses.dataclass(frozen=True)
class AlgorithmSetup:
    """The run's algorithm and what it needs.

    Attributes:
        algorithm: The :class:`~verl_core.algorithms.Algorithm`.
        use_critic: A critic is built and trained.
        use_reference: A reference is built (KL in the reward, a KL loss, or ``algorithm.use_reference``).
        dynamic_sampling: Groups whose scores are all equal are dropped (``algorithm.dynamic_sampling``
            or the preset's).
        on_policy_old_log_probs: The old log-probs are the update's own (``batch.old_log_probs``
            = ``auto``, one optimizer step per batch, nothing needs them before the update): the
            separate actor forward is skipped. Never with an off-policy correction: the step's
            ratio statistics (max and min over the batch) are computed before the update, from
            the separate forward's log-probs.
    """

    algorithm: Any
    use_critic: bool
    use_reference: bool
    dynamic_sampling: bool
    on_policy_old_log_probs: bool = False

    @classmethod
    def from_config(cls, config: RunConfig) -> AlgorithmSetup:
        """Build and check the ``algorithm`` section against the reward and data of ``config``.

        Raises:
            ConfigError: an unknown preset or option, a critic the algorithm has no loss for (or
                GAE without one), ``grpo_token`` without dense token scores, or a dataset without a
                reward for its prompts.
        """
        a = config.algorithm
        algorithm = build_algorithm(a.name, a.options, a.offpolicy)
        use_critic = a.use_critic if a.use_critic is not None else algorithm.uses_critic
        if use_critic and not algorithm.uses_critic:
            raise ConfigError(
                f"config key 'algorithm.use_critic' is true but algorithm {a.name!r} has no "
                "critic loss; use algorithm.name='ppo' or set use_critic=false"
            )
        needs = algorithm.needs
        if not use_critic and "critic" in needs:
            raise ConfigError(
                f"config key 'algorithm.use_critic' is false, but the {algorithm.estimator} estimator needs a critic"
            )
        if "token_scores" in needs and config.reward.functions:
            raise ConfigError(
                f"algorithm {a.name!r} needs dense token scores, but the reward functions of 'reward.functions' "
                "give one score per response; use algorithm 'grpo'"
            )
        if "token_scores" in needs and config.task.reward != "token" and config.backends.reward == "rule":
            raise ConfigError(
                f"algorithm {a.name!r} needs dense token scores: set config key 'task.reward' to 'token' "
                f"(it is {config.task.reward!r})"
            )
        data = config.data
        # an environment ([agent]) may reward the episodes itself; tools alone give no reward
        if (data.train_paths or data.eval_paths) and not config.reward.functions and config.backends.reward == "rule" \
                and not config.agent.environment:
            raise ConfigError(
                f"config key 'data.{'train' if data.train_paths else 'eval'}' is set but the run has no reward "
                "for its prompts: list functions in 'reward.functions' (e.g. "
                "['verl_core.trainer.inputs.reward_functions:exact_match']) or name a reward-model backend in "
                "'backends.reward'"
            )
        b = config.batch
        samples = config.batch.prompts_per_step * config.rollout.n  # dynamic sampling only drops samples
        one_update = b.epochs == 1 and (b.mini_batch_size == 0 or b.mini_batch_size >= samples)
        return cls(
            algorithm=algorithm, use_critic=use_critic,
            use_reference=a.use_reference or algorithm.uses_reference,
            dynamic_sampling=a.dynamic_sampling or find_preset(a.name).dynamic_sampling,
            on_policy_old_log_probs=(
                b.old_log_probs == "auto" and one_update and isinstance(algorithm.actor_loss, ActorLoss)
                and "old_log_probs" not in algorithm.advantage_fields and not a.offpolicy.enabled
            ),
        )
