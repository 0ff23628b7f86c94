"""The engines of an RL run, built by backend name and placed by the executor.

:class:`RLEngines` holds them; the trainer's components read them from it at call time, so an
engine replaced after setup (a wrapper that times calls, a test's fault) is the one they use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from verl_core.enginekit.byo import as_tokenizer
from verl_core.enginekit.retokenize import CrossTokenizerReward, max_token_bytes, same_vocabulary
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import TrainingCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.kernel.training import (
    DEFAULT_BUCKET_BYTES,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TrainingEngine,
)
from verl_core.kernel.weights import WeightMessage, WeightSync
from verl_core.trainer.config import RunConfig
from verl_core.trainer.executor import Executor
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import DigitTask, TaskReward
from verl_core.trainer.rl.algorithm_setup import check_offpolicy_rollout
from verl_core.trainer.rl.episodes import EpisodeRewards

__all__ = ["BaseModelReference", "RLEngines"]

_log = logging.getLogger(__name__)


class BaseModelReference(TrainingEngine):
    """The reference policy of a LoRA run: the actor's model with its adapter disabled.

    Its :meth:`forward` is the actor's :meth:`~verl_core.kernel.training.TrainingEngine.base_forward`,
    so the run holds one copy of the base weights instead of two. It trains nothing, owns no
    memory of its own (offloading and closing are the actor's) and writes no checkpoint.

    Args:
        actor: The actor engine; it must declare ``capabilities.lora`` and be built with ``spec.lora``.

    Raises:
        ConfigError: the actor trains no adapter.
    """

    def __init__(self, actor: TrainingEngine) -> None:
        if actor.spec.lora is None or not actor.capabilities.lora:
            raise ConfigError(
                "the LoRA reference is the actor with its adapter disabled, but the actor trains no adapter "
                f"(spec.lora {'is None' if actor.spec.lora is None else 'is set'}, capabilities.lora "
                f"{actor.capabilities.lora}); build a reference engine instead"
            )
        self._actor = actor
        self._spec = dataclasses.replace(actor.spec, role="reference", lora=None)

    @property
    def spec(self) -> EngineSpec:
        """The actor's spec, as the reference's role, without the adapter."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The actor's capabilities."""
        return self._actor.capabilities

    @property
    def tokenizer(self) -> Tokenizer:
        """The actor's tokenizer."""
        return self._actor.tokenizer

    def forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The base model's outputs: the actor's ``base_forward``."""
        return self._actor.base_forward(batch, outputs)

    def _frozen(self, what: str) -> ConfigError:
        return ConfigError(f"BaseModelReference.{what}: the reference is the actor's frozen base model; train the actor")

    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """Refused: the reference is frozen."""
        raise self._frozen("forward_backward")

    def optimizer_step(self) -> StepMetrics:
        """Refused: the reference is frozen."""
        raise self._frozen("optimizer_step")

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Refused: the base weights are the model folder's."""
        raise self._frozen("export_weights")

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Refused: the actor's checkpoint holds everything (the base is the model folder)."""
        raise self._frozen("save_checkpoint")

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Refused: the actor's checkpoint holds everything."""
        raise self._frozen("load_checkpoint")

    def offload(self) -> None:
        """Nothing to move: the memory is the actor's."""

    def onload(self) -> None:
        """Nothing to move: the memory is the actor's."""


class RLEngines:
    """The actor, rollout, reward, reference and critic engines of a run and the weight sync.

    Attributes:
        executor: Where the engines run.
        actor: The policy being trained.
        rollout: The engine that samples responses.
        reward: Scores responses (reward functions, a reward model or the task's rule).
        reference: The frozen reference policy, or None when the algorithm needs none; with
            ``model.lora`` the actor with its adapter disabled (:class:`BaseModelReference`).
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
            use_reference: Build the reference (with ``model.lora``: the actor's base, no engine).
            use_critic: Build the critic (from ``critic_model`` when set).

        Raises:
            ConfigError: ``algorithm.offpolicy`` corrects against log-probs the rollout engine does not
                report exactly under the run's sampling (:func:`~verl_core.trainer.rl.algorithm_setup.check_offpolicy_rollout`).
        """
        cfg, b = config, config.backends
        self.executor = executor
        self.actor = executor.training_engine("actor", b.actor, spec("actor", path, cfg.optim.to_optim(cfg.steps)))
        self.rollout = executor.rollout_engine(b.rollout, spec("rollout", path))
        check_offpolicy_rollout(cfg, self.rollout)  # before the reference and critic are built
        if use_reference and cfg.model.lora.enabled:
            self.reference = BaseModelReference(self.actor)  # the frozen base is the actor's own
        elif use_reference:
            self.reference = executor.training_engine("reference", b.reference, spec("reference", path))
        if use_critic:
            self.critic = executor.training_engine(
                "critic", b.critic, spec("critic", cfg.critic_model or path, cfg.critic_optim.to_optim(cfg.steps))
            )

    def build_reward(
        self, config: RunConfig, spec: EngineSpec, task: DigitTask, *, columns: list[str], base_dir: Path | None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """The reward: ``reward.functions`` (with the reward model of ``backends.reward``, if any), the
        reward model alone, or the task's rule; after :meth:`build` (it tokenizes with the rollout's tokenizer).

        The reward model (``backends.reward`` other than ``rule``) is built on ``spec``, whose
        folder is ``reward_model`` (the policy's when empty). It takes the rollout's token ids; when
        the engine has a ``tokenizer`` attribute whose vocabulary is not the rollout tokenizer's
        (:func:`~verl_core.enginekit.retokenize.same_vocabulary`), it is wrapped in
        :class:`~verl_core.enginekit.retokenize.CrossTokenizerReward`, which decodes each sample
        with the rollout's tokenizer and encodes it with the reward model's (the engine is built
        again with length limits that hold in its own tokens, see :meth:`_reward_model`), and
        ``say`` gets one line saying so. An engine without a ``tokenizer`` attribute (the Ray executor's proxy of a
        reward engine has none) gets the rollout's ids as they are. Alone or beside functions it
        is a :class:`~verl_core.trainer.inputs.rewards.RewardFunctions` term: the score is
        ``reward.model_weight`` times its score (plus the weighted functions), and its own score is
        the extra ``reward/model`` (so the metric ``reward/model/mean``).

        With ``[agent]``: the functions or the reward model (or neither), plus the environment's
        per-turn rewards (:class:`~verl_core.trainer.rl.episodes.EpisodeRewards`).

        Args:
            config: The run.
            spec: The reward model's engine spec (role ``reward``).
            task: The built-in task (its rule is the reward when there is nothing else).
            columns: The dataset's columns (offered to the reward functions).
            base_dir: Where relative paths of reward-function files are looked up first.
            say: Where the line about a converting reward model goes (default: this module's logger).
        """
        b = config.backends
        tokenizer = self.rollout.tokenizer
        model = None if b.reward == "rule" else self._reward_model(b.reward, spec, say or _log.info)
        if config.reward.functions or model is not None:
            self.reward = RewardFunctions.from_config(
                config.reward, tokenizer, model=model, columns=columns, base_dir=base_dir
            )
        elif not config.agent.enabled:
            self.reward = TaskReward(task, tokenizer, mode=config.task.reward)
        if config.agent.enabled:
            inner = self.reward if config.reward.functions or model is not None else None
            self.reward = EpisodeRewards(inner)

    def _reward_model(self, backend: str, spec: EngineSpec, say: Callable[[str], None]) -> RewardEngine:
        """The reward engine of ``backend`` on ``spec``, in a :class:`CrossTokenizerReward` when its
        tokenizer's vocabulary is not the rollout's.

        ``spec``'s length limits count the rollout's tokens; a sample re-encoded by the reward
        model's tokenizer may take more of its own, so a converting engine is built again with the
        limits times :func:`~verl_core.enginekit.retokenize.max_token_bytes` of the rollout's
        tokenizer (one more response token for the EOS the conversion appends).
        """
        policy = self.rollout.tokenizer
        engine = self.executor.reward_engine(backend, spec)
        try:
            own = getattr(engine, "tokenizer", None)
            converts = own is not None and not same_vocabulary(as_tokenizer(policy), as_tokenizer(own))
        except Exception:  # the reward model's tokenizer cannot be read: release the engine built
            engine.close()
            raise
        if not converts:
            return engine
        engine.close()
        per_token = max_token_bytes(policy)
        spec = dataclasses.replace(spec, max_prompt_len=spec.max_prompt_len * per_token,
                                   max_response_len=spec.max_response_len * per_token + 1)
        engine = self.executor.reward_engine(backend, spec)
        try:
            wrapped = CrossTokenizerReward(engine, policy)
        except Exception:
            engine.close()
            raise
        say(f"reward model {spec.model_path!r} (backend {backend!r}): its tokenizer's vocabulary is not the "
            "rollout's, so each sample is decoded with the rollout's tokenizer and encoded with the reward "
            f"model's before it is scored (its engine takes up to {spec.max_prompt_len} prompt and "
            f"{spec.max_response_len} response tokens of its own)")
        return wrapped

    def trainable(self) -> dict[str, TrainingEngine]:
        """The engines a checkpoint holds, by role: the actor, and the critic when there is one."""
        return {"actor": self.actor} if self.critic is None else {"actor": self.actor, "critic": self.critic}

    def close(self) -> None:
        """Release every engine and the executor; after a :meth:`build` that failed part way, those built."""
        reference = None if isinstance(self.reference, BaseModelReference) else self.reference
        engines: tuple[Any, ...] = (getattr(self, "rollout", None), getattr(self, "actor", None), reference,
                                    self.critic, getattr(self, "reward", None))
        for engine in engines:
            if engine is not None:
                close: Callable[[], None] | None = getattr(engine, "close", None)
                if close is not None:
                    close()
        executor: Executor | None = getattr(self, "executor", None)
        if executor is not None:
            executor.close()
