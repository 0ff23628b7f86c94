"""The engines of an RL run, built by backend name and placed by the executor.

:class:`RLEngines` holds them; the trainer's components read them from it at call time, so an
engine replaced after setup (a wrapper that times calls, a test's fault) is the one they use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.weights import WeightSync
from verl_core.trainer.config import RunConfig
from verl_core.trainer.executor import Executor
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import DigitTask, TaskReward
from verl_core.trainer.rl.episodes import EpisodeRewards

__all__ = ["RLEngines", "stage_backend"]


def stage_backend(config: RunConfig, stage: str) -> str:
    """The backend that runs ``stage`` of a step, as a failed step's error names it."""
    b = config.backends
    reward = b.reward
    if config.reward.functions:
        reward = "reward.functions" + (f" + {b.reward}" if b.reward != "rule" else "")
    return {
        "rollout": b.rollout, "baseline": b.rollout, "reward": reward, "reference": b.reference,
        "actor_forward": b.actor, "actor_update": b.actor, "critic_forward": b.critic,
        "critic_update": b.critic, "weight_sync": f"{b.actor} -> {b.rollout}", "evaluation": b.rollout,
    }.get(stage, "trainer")


class RLEngines:
    """The actor, rollout, reward, reference and critic engines of a run and the weight sync.

    Attributes:
        executor: Where the engines run.
        actor: The policy being trained.
        rollout: The engine that samples responses.
        reward: Scores responses (reward functions, a reward model or the task's rule).
        reference: The frozen reference policy, or None when the algorithm needs none.
        critic: The value model, or None when the algorithm has no critic.
        sync: Sends the actor's weights to the rollout engine.
    """

    executor: Executor
    actor: TrainingEngine
    rollout: RolloutEngine
    reward: RewardEngine
    sync: WeightSync

    def __init__(self) -> None:
        self.reference: TrainingEngine | None = None
        self.critic: TrainingEngine | None = None

    def build(
        self, config: RunConfig, executor: Executor, spec: Callable[..., EngineSpec], path: str, *,
        use_reference: bool, use_critic: bool,
    ) -> None:
        """Build the training and rollout engines (the caller builds the reward, then the weight sync).

        Args:
            config: The run.
            executor: Where the engines run.
            spec: ``spec(role, path, optim)``: a role's :class:`EngineSpec`.
            path: The policy model folder.
            use_reference: Build the reference.
            use_critic: Build the critic (from ``critic_model`` when set).
        """
        cfg, b = config, config.backends
        self.executor = executor
        self.actor = executor.training_engine("actor", b.actor, spec("actor", path, cfg.optim.to_optim(cfg.steps)))
        self.rollout = executor.rollout_engine(b.rollout, spec("rollout", path))
        if use_reference:
            self.reference = executor.training_engine("reference", b.reference, spec("reference", path))
        if use_critic:
            self.critic = executor.training_engine(
                "critic", b.critic, spec("critic", cfg.critic_model or path, cfg.critic_optim.to_optim(cfg.steps))
            )

    def build_reward(
        self, config: RunConfig, spec: EngineSpec, task: DigitTask, *, columns: list[str], base_dir: Path | None,
    ) -> None:
        """The reward: ``reward.functions`` (with the reward model of ``backends.reward``, if any), the
        reward model alone, or the task's rule; after :meth:`build` (it tokenizes with the rollout's tokenizer).

        With ``[agent]``: the functions or the reward model (or neither), plus the environment's
        per-turn rewards (:class:`~verl_core.trainer.rl.episodes.EpisodeRewards`).
        """
        b = config.backends
        tokenizer = self.rollout.tokenizer
        model = None if b.reward == "rule" else self.executor.reward_engine(b.reward, spec)
        if config.reward.functions:
            self.reward = RewardFunctions.from_config(
                config.reward, tokenizer, model=model, columns=columns, base_dir=base_dir
            )
        elif model is not None:
            self.reward = model
        elif not config.agent.enabled:
            self.reward = TaskReward(task, tokenizer, mode=config.task.reward)
        if config.agent.enabled:
            inner = self.reward if config.reward.functions or model is not None else None
            self.reward = EpisodeRewards(inner)

    def trainable(self) -> dict[str, TrainingEngine]:
        """The engines a checkpoint holds, by role: the actor, and the critic when there is one."""
        return {"actor": self.actor} if self.critic is None else {"actor": self.actor, "critic": self.critic}

    def close(self) -> None:
        """Release every engine and the executor."""
        engines: tuple[Any, ...] = (self.rollout, self.actor, self.reference, self.critic, self.reward)
        for engine in engines:
            if engine is not None:
                close: Callable[[], None] | None = getattr(engine, "close", None)
                if close is not None:
                    close()
        self.executor.close()
