"""LocalExecutor: every engine in the controller's own process (the default)."""

from __future__ import annotations

from typing import final

from verl_core.kernel.engine import EngineSpec, Role
from verl_core.kernel.registry import (
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
)
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.weights import WeightSync
from verl_core.trainer.executor.base import Executor

__all__ = ["LocalExecutor"]


@final
class LocalExecutor(Executor):
    """Builds engines through the registry in this process; calls are plain method calls."""

    @property
    def name(self) -> str:
        """``local``."""
        return "local"

    def training_engine(self, role: Role, backend: str, spec: EngineSpec) -> TrainingEngine:
        """The registry's training engine for ``spec`` (``role`` is the spec's)."""
        return get_training_engine(backend, spec)

    def rollout_engine(self, backend: str, spec: EngineSpec) -> RolloutEngine:
        """The registry's rollout engine for ``spec``."""
        return get_rollout_engine(backend, spec)

    def reward_engine(self, backend: str, spec: EngineSpec) -> RewardEngine:
        """The registry's reward engine for ``spec``."""
        return get_reward_engine(backend, spec)

    def weight_sync(self, actor_backend: str, rollout_backend: str) -> WeightSync:
        """The registry's sync for the pair (a direct path when one is registered)."""
        return get_weight_sync(actor_backend, rollout_backend)

    def close(self) -> None:
        """Nothing to release: engines are closed by their owner."""
        return None
