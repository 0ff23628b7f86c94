"""The Algorithm bundle: the advantage step the trainer runs and the losses the engines run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_core.algorithms import constructors as _ctors
from verl_core.algorithms.config import ActorLossConfig, CriticLossConfig, RewardConfig
from verl_core.algorithms.kl import KLController, compute_token_rewards, make_kl_controller
from verl_core.algorithms.loss_tokens import over_loss_tokens
from verl_core.algorithms.losses import ActorLoss, CriticLoss
from verl_core.algorithms.offpolicy import ratio_statistics
from verl_core.algorithms.presets import PRESETS, SECTION_OPTIONS, build_preset
from verl_core.kernel.algorithm import Need
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.training import Metrics

__all__ = ["PRESETS", "Algorithm"]

class Algorithm:
    """An RL algorithm: an advantage estimator, a reward step, the actor loss and the critic loss.

    The trainer calls :meth:`compute_advantages` on the global batch (after scoring and the
    reference/critic forwards), then passes :attr:`actor_loss` (and :attr:`critic_loss` when the
    algorithm has a critic) to ``TrainingEngine.forward_backward``. The constructors
    (:meth:`ppo`, :meth:`grpo`, ...) set verl's defaults for each algorithm; every part can be
    replaced by passing a config.

    Example::

        algo = Algorithm.grpo(clip_high=0.28)            # DAPO-style clip-higher
        batch = algo.compute_advantages(batch)            # global batch: scores, group_ids, ...
        for mini in batch.chunk(num_mini_batches):
            stats = GlobalBatchStats.of(mini)             # counts of the whole mini-batch
            actor.forward_backward(dp_shard(mini, rank, world), algo.actor_loss, stats)
            actor.optimizer_step()

    Args:
        name: Display name.
        estimator: Registered advantage-estimator name (``gae``, ``grpo``, ``rloo``,
            ``reinforce_pp``, ``reinforce_pp_baseline``, ``remax`` or a plugin's).
        estimator_config: Its config (an instance of the registered config class), or None for
            the defaults.
        actor: The actor loss config.
        critic: The critic loss config, or None for critic-free algorithms.
        reward: How scores become token rewards (KL penalty in the reward).

    Raises:
        UnknownNameError: ``estimator`` or the policy loss is not registered (lists the registered).
        ConfigError: the estimator config has the wrong type, or GAE is used without a critic.
    """

    def __init__(
        self,
        name: str,
        estimator: str,
        estimator_config: Any = None,
        *,
        actor: ActorLossConfig | None = None,
        critic: CriticLossConfig | None = None,
        reward: RewardConfig | None = None,
    ) -> None:
        from verl_core.kernel.registry import get_registry

        registry = get_registry()
        comp = registry.component("advantage", estimator)
        if estimator_config is None and comp.config_class is not None:
            estimator_config = comp.config_class()
        if comp.config_class is not None and not isinstance(estimator_config, comp.config_class):
            raise ConfigError(
                f"advantage estimator {estimator!r} takes a {comp.config_class.__name__}, "
                f"got {type(estimator_config).__name__}"
            )
        self.name = name
        self.estimator = estimator
        self.estimator_config = estimator_config
        self._estimate: Callable[[TensorBatch, Any], TensorBatch] = comp.impl
        self._estimator_component = comp
        self.reward = reward or RewardConfig()
        self.kl_controller: KLController = make_kl_controller(self.reward)
        self.actor_loss = ActorLoss(actor or ActorLossConfig())
        registry.component("policy_loss", self.actor_loss.config.policy_loss)
        self.critic_loss: CriticLoss | None = CriticLoss(critic) if critic is not None else None
        if self.critic_loss is not None:
            registry.component("value_loss", self.critic_loss.config.value_loss)
        if "critic" in comp.needs and self.critic_loss is None:
            raise ConfigError(f"the {estimator!r} estimator needs a critic: pass critic=CriticLossConfig()")

    def __repr__(self) -> str:
        return (
            f"Algorithm({self.name!r}, estimator={self.estimator!r}, {self.estimator_config!r}, "
            f"actor={self.actor_loss.config!r}, critic={self.critic_loss.config if self.critic_loss else None!r}, "
            f"reward={self.reward!r})"
        )

    # ------------------------------------------------------------- what it needs
    @property
    def uses_critic(self) -> bool:
        """True when the algorithm trains a critic (values and old_values are needed)."""
        return self.critic_loss is not None

    @property
    def uses_reference(self) -> bool:
        """True when ``ref_log_probs`` are needed (KL in the reward or a KL loss)."""
        return self.reward.kl_coef > 0 or self.actor_loss.config.kl_loss_coef > 0

    @property
    def needs(self) -> frozenset[Need]:
        """What the algorithm needs from the run: its components' declared needs, plus ``critic``
        when it trains one and ``reference`` when it uses ``ref_log_probs`` (the trainer builds
        engines and stages from this, never from component names)."""
        out: set[Need] = set(self._estimator_component.needs)
        if self.uses_critic:
            out.add("critic")
        if self.uses_reference:
            out.add("reference")
        return frozenset(out)

    @property
    def advantage_fields(self) -> frozenset[str]:
        """Fields :meth:`compute_advantages` reads (besides ``scores`` / ``token_scores``): the
        estimator's declared ``reads``, plus the log-probs a KL penalty in the reward needs."""
        out = {"response_mask", *self._estimator_component.reads} - {"token_rewards", "token_scores"}
        if self.reward.kl_coef > 0:
            out |= {"old_log_probs", "ref_log_probs"}
        return frozenset(out)

    # ------------------------------------------------------------- the advantage step
    def compute_advantages_with_metrics(self, batch: TensorBatch) -> tuple[TensorBatch, Metrics]:
        """Token rewards (with the KL penalty) then advantages and returns, plus reward metrics.

        The rewards come from ``scores`` / ``token_scores``; a batch that holds only
        ``token_rewards`` is used as is when the algorithm has no KL penalty in the reward. Updates
        the adaptive KL controller once per call.

        An outcome estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++ with baseline) reads only each
        sample's total reward. When that total is the sequence's score (``scores`` and no
        ``token_scores``, ``token_rewards`` or KL penalty in the reward), it takes ``scores``
        directly and ``token_rewards`` is not built: the result is bit for bit what summing the
        built rows gives, without writing and reading a ``[batch, response]`` tensor.
        :func:`~verl_core.algorithms.kl.compute_token_rewards` builds them when they are wanted.

        A multi-turn batch (``loss_mask`` differing from ``response_mask``) runs all of this, a
        registered estimator too, on its loss tokens (:mod:`verl_core.algorithms.loss_tokens`):
        observation tokens are skipped and get 0.

        With an off-policy correction in the actor loss and a batch holding ``old_log_probs`` and
        ``rollout_log_probs``, the metrics also give the importance ratio's mean, max and min over
        the whole batch (``offpolicy/ratio_mean``, ``offpolicy/ratio_max``, ``offpolicy/ratio_min``;
        :func:`~verl_core.algorithms.offpolicy.ratio_statistics`): the loss reports only what sums
        over micro-batches.
        """
        out, metrics = over_loss_tokens(self._advantages)(batch)
        correction = self.actor_loss.config.offpolicy
        if correction.enabled and "old_log_probs" in batch and "rollout_log_probs" in batch:
            metrics = {**metrics, **ratio_statistics(batch, correction)}
        return out, metrics

    def _advantages(self, batch: TensorBatch) -> tuple[TensorBatch, Metrics]:
        """:meth:`compute_advantages_with_metrics` of a single-turn batch."""
        beta = self.kl_controller.value
        if (
            self._estimator_component.outcome
            and not beta > 0
            and "scores" in batch
            and "token_scores" not in batch
            and "token_rewards" not in batch
        ):
            return self._estimate(batch, self.estimator_config), {"reward_kl_coef": float(beta)}
        if "scores" in batch or "token_scores" in batch or beta > 0:
            batch, metrics = compute_token_rewards(batch, self.reward, self.kl_controller)
        else:  # rewards already shaped by the caller (``token_rewards``), no KL penalty to add
            batch.require("token_rewards", where=f"{self.name} advantages")
            metrics = {}
        out = self._estimate(batch, self.estimator_config)
        return out, metrics

    def compute_advantages(self, batch: TensorBatch) -> TensorBatch:
        """The global batch with ``advantages`` and ``returns`` added (and ``token_rewards`` when built).

        See :meth:`compute_advantages_with_metrics` for when ``token_rewards`` is built.
        """
        return self.compute_advantages_with_metrics(batch)[0]

    def state_dict(self) -> dict[str, float]:
        """Mutable state (the KL coefficient) for checkpoints."""
        return self.kl_controller.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.kl_controller.load_state_dict(state)

    # ------------------------------------------------------------- constructors (in algorithms.constructors)
    ppo = classmethod(_ctors.ppo)
    grpo = classmethod(_ctors.grpo)
    dr_grpo = classmethod(_ctors.dr_grpo)
    rloo = classmethod(_ctors.rloo)
    reinforce_pp = classmethod(_ctors.reinforce_pp)
    reinforce_pp_baseline = classmethod(_ctors.reinforce_pp_baseline)
    remax = classmethod(_ctors.remax)
    gspo = classmethod(_ctors.gspo)
    cispo = classmethod(_ctors.cispo)

    @classmethod
    def from_name(cls, name: str, **kwargs: Any) -> Algorithm:
        """The registered preset ``name`` built with ``kwargs``: what a run's ``algorithm.name`` and
        ``algorithm.options`` build (:func:`~verl_core.algorithms.presets.build_preset`), verl-core's
        presets (``dapo`` and ``grpo_token`` included) and a plugin's.

        Args:
            name: The preset (:meth:`~verl_core.kernel.registry.Registry.presets`).
            **kwargs: Its options, and ``offpolicy=`` (an
                :class:`~verl_core.algorithms.config.OffPolicyConfig`).

        Raises:
            UnknownNameError: ``name`` is not a registered preset (the message lists them).
            ConfigError: an option the preset does not take, or a value it refuses.
        """
        from verl_core.kernel.registry import get_registry

        sections = {k: kwargs.pop(k) for k in SECTION_OPTIONS if k in kwargs}
        return build_preset(get_registry().preset(name), kwargs, **sections)

    def replace(self, **changes: Any) -> Algorithm:
        """A copy with constructor arguments replaced (``actor=``, ``critic=``, ``reward=``, ...)."""
        args: dict[str, Any] = {
            "name": self.name,
            "estimator": self.estimator,
            "estimator_config": self.estimator_config,
            "actor": self.actor_loss.config,
            "critic": self.critic_loss.config if self.critic_loss else None,
            "reward": self.reward,
        }
        unknown = sorted(set(changes) - set(args))
        if unknown:
            raise ConfigError(f"Algorithm.replace: unknown argument(s) {unknown}; valid: {sorted(args)}")
        args.update(changes)
        name = args.pop("name")
        estimator = args.pop("estimator")
        estimator_config = args.pop("estimator_config")
        return Algorithm(name, estimator, estimator_config, **args)

