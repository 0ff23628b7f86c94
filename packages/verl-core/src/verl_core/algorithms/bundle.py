"""The Algorithm bundle: the advantage step the trainer runs and the losses the engines run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from verl_core.algorithms.config import (
    ActorLossConfig,
    AggMode,
    CriticLossConfig,
    GAEConfig,
    GRPOConfig,
    KLName,
    PolicyLossConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    ReMaxConfig,
    RewardConfig,
    RLOOConfig,
    TISConfig,
)
from verl_core.algorithms.kl import KLController, compute_token_rewards, make_kl_controller
from verl_core.algorithms.losses import ActorLoss, CriticLoss
from verl_core.algorithms.presets import PRESET_TABLE, PRESETS
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError, UnknownNameError
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
        self.reward = reward or RewardConfig()
        self.kl_controller: KLController = make_kl_controller(self.reward)
        self.actor_loss = ActorLoss(actor or ActorLossConfig())
        registry.component("policy_loss", self.actor_loss.config.policy_loss)
        self.critic_loss: CriticLoss | None = CriticLoss(critic) if critic is not None else None
        if self.critic_loss is not None:
            registry.component("value_loss", self.critic_loss.config.value_loss)
        if estimator == "gae" and self.critic_loss is None:
            raise ConfigError("the 'gae' estimator needs a critic: pass critic=CriticLossConfig()")

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
    def advantage_fields(self) -> frozenset[str]:
        """Fields :meth:`compute_advantages` reads (besides ``scores`` / ``token_scores``)."""
        out = {"response_mask"}
        if self.estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
            out.add("group_ids")
        if self.estimator == "gae":
            out.add("values")
        if self.estimator == "remax":
            out.add("baseline_scores")
        if self.reward.kl_coef > 0:
            out |= {"old_log_probs", "ref_log_probs"}
        return frozenset(out)

    # ------------------------------------------------------------- the advantage step
    def compute_advantages_with_metrics(self, batch: TensorBatch) -> tuple[TensorBatch, Metrics]:
        """Token rewards (with the KL penalty) then advantages and returns, plus reward metrics.

        The rewards come from ``scores`` / ``token_scores``; a batch that holds only
        ``token_rewards`` is used as is when the algorithm has no KL penalty in the reward. Updates
        the adaptive KL controller once per call.
        """
        if "scores" in batch or "token_scores" in batch or self.kl_controller.value > 0:
            batch, metrics = compute_token_rewards(batch, self.reward, self.kl_controller)
        else:  # rewards already shaped by the caller (``token_rewards``), no KL penalty to add
            batch.require("token_rewards", where=f"{self.name} advantages")
            metrics = {}
        out = self._estimate(batch, self.estimator_config)
        return out, metrics

    def compute_advantages(self, batch: TensorBatch) -> TensorBatch:
        """The global batch with ``token_rewards``, ``advantages`` and ``returns`` added."""
        return self.compute_advantages_with_metrics(batch)[0]

    def state_dict(self) -> dict[str, float]:
        """Mutable state (the KL coefficient) for checkpoints."""
        return self.kl_controller.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.kl_controller.load_state_dict(state)

    # ------------------------------------------------------------- constructors
    @staticmethod
    def _actor(
        policy_loss: str,
        clip_low: float,
        clip_high: float | None,
        clip_ratio_c: float | None,
        loss_agg_mode: AggMode,
        entropy_coef: float,
        kl_loss_coef: float,
        kl_loss_estimator: KLName,
        tis: TISConfig | None,
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
            tis=tis,
        )

    @classmethod
    def ppo(
        cls,
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
        tis: TISConfig | None = None,
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
            actor=cls._actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                             0.0, "k3", tis),
            critic=CriticLossConfig(clip_range_value=clip_range_value, loss_agg_mode=loss_agg_mode),
            reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator,
                                controller=kl_controller, target_kl=target_kl, horizon=horizon),
        )

    @classmethod
    def grpo(
        cls,
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
        tis: TISConfig | None = None,
    ) -> Algorithm:
        """GRPO: group-normalised advantages, PPO clip, KL to the reference as a loss term.

        Defaults follow verl's GRPO recipe: KL loss coefficient 0.001 with k3 (``low_var_kl``),
        token-mean aggregation, clip 0.2 with dual clip 3; ``clip_high`` gives DAPO's clip-higher.
        """
        return cls(
            "grpo" if norm_by_std else "dr_grpo",
            "grpo",
            GRPOConfig(norm_by_std=norm_by_std, epsilon=epsilon),
            actor=cls._actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                             kl_loss_coef, kl_loss_estimator, tis),
        )

    @classmethod
    def dr_grpo(
        cls,
        *,
        norm_length: int | None = None,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        entropy_coef: float = 0.0,
        kl_loss_coef: float = 0.0,
        kl_loss_estimator: KLName = "k3",
        tis: TISConfig | None = None,
    ) -> Algorithm:
        """Dr. GRPO: no std normalisation, ``seq-mean-token-sum-norm`` aggregation, no KL.

        ``norm_length`` is the constant L of the aggregation (Dr. GRPO: the maximum response
        length); None uses the mini-batch's padded width.
        """
        return cls(
            "dr_grpo",
            "grpo",
            GRPOConfig(norm_by_std=False),
            actor=cls._actor("ppo", clip_low, clip_high, clip_ratio_c, "seq-mean-token-sum-norm",
                             entropy_coef, kl_loss_coef, kl_loss_estimator, tis, norm_length),
        )

    @classmethod
    def rloo(
        cls,
        *,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        loss_agg_mode: AggMode = "token-mean",
        entropy_coef: float = 0.0,
        kl_coef: float = 0.0,
        kl_estimator: KLName = "k1",
        kl_loss_coef: float = 0.0,
        tis: TISConfig | None = None,
    ) -> Algorithm:
        """RLOO: leave-one-out baseline, PPO clip; optional KL penalty in the reward."""
        return cls(
            "rloo",
            "rloo",
            RLOOConfig(),
            actor=cls._actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                             kl_loss_coef, "k3", tis),
            reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator),
        )

    @classmethod
    def reinforce_pp(
        cls,
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
        tis: TISConfig | None = None,
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
            actor=cls._actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                             kl_loss_coef, "k3", tis),
            reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator),
        )

    @classmethod
    def reinforce_pp_baseline(cls, **kwargs: Any) -> Algorithm:
        """REINFORCE++ with the group-mean baseline (see :meth:`reinforce_pp`)."""
        return cls.reinforce_pp(baseline=True, **kwargs)

    @classmethod
    def remax(
        cls,
        *,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        loss_agg_mode: AggMode = "token-mean",
        entropy_coef: float = 0.0,
        kl_coef: float = 0.001,
        kl_estimator: KLName = "k1",
        tis: TISConfig | None = None,
    ) -> Algorithm:
        """ReMax: the greedy response's score (``baseline_scores``) as baseline; KL in the reward."""
        return cls(
            "remax",
            "remax",
            ReMaxConfig(),
            actor=cls._actor("ppo", clip_low, clip_high, clip_ratio_c, loss_agg_mode, entropy_coef,
                             0.0, "k3", tis),
            reward=RewardConfig(kl_coef=kl_coef, kl_estimator=kl_estimator),
        )

    @classmethod
    def gspo(
        cls,
        *,
        clip_low: float = 3e-4,
        clip_high: float | None = 4e-4,
        loss_agg_mode: AggMode = "seq-mean-token-mean",
        norm_by_std: bool = True,
        entropy_coef: float = 0.0,
        kl_loss_coef: float = 0.0,
        tis: TISConfig | None = None,
    ) -> Algorithm:
        """GSPO: GRPO advantages with the sequence-level ratio (paper's clip 3e-4 / 4e-4)."""
        return cls(
            "gspo",
            "grpo",
            GRPOConfig(norm_by_std=norm_by_std),
            actor=cls._actor("gspo", clip_low, clip_high, None, loss_agg_mode, entropy_coef,
                             kl_loss_coef, "k3", tis),
        )

    @classmethod
    def cispo(
        cls,
        *,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        loss_agg_mode: AggMode = "token-mean",
        norm_by_std: bool = True,
        entropy_coef: float = 0.0,
        kl_loss_coef: float = 0.0,
        tis: TISConfig | None = None,
    ) -> Algorithm:
        """CISPO: GRPO advantages, REINFORCE weighted by the clipped stop-gradient ratio.

        The weight is clipped to [1 - clip_low, 1 + clip_high] (verl's defaults 0.2 / 0.2); the
        CISPO paper sets no lower bound (``clip_low=1.0``) and tunes only ``clip_high``.
        """
        return cls(
            "cispo",
            "grpo",
            GRPOConfig(norm_by_std=norm_by_std),
            actor=cls._actor("cispo", clip_low, clip_high, None, loss_agg_mode, entropy_coef,
                             kl_loss_coef, "k3", tis),
        )

    @classmethod
    def from_name(cls, name: str, **kwargs: Any) -> Algorithm:
        """The preset ``name`` (see :data:`~verl_core.algorithms.presets.PRESETS`) built with ``kwargs``.

        Raises:
            UnknownNameError: ``name`` is not a preset (the message lists them).
        """
        if name not in PRESETS:
            raise UnknownNameError(f"unknown algorithm {name!r}; available: {', '.join(PRESETS)}")
        preset = PRESET_TABLE[name]
        factory: Callable[..., Algorithm] = getattr(cls, preset.constructor)
        return factory(**preset.fixed, **kwargs)

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

