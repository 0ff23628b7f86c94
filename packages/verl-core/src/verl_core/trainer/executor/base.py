"""The Executor protocol: where engines run and how the controller reaches them."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

from verl_core.kernel.engine import EngineSpec, Role
from verl_core.kernel.errors import VerlError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.weights import WeightSync

__all__ = ["Executor", "WorkerFailedError"]


class WorkerFailedError(VerlError, RuntimeError):
    """A worker process of a role died (or its node went away) during a call.

    Attributes:
        role: The role whose worker died (actor, critic, reference, rollout, reward).
        rank: Rank of the dead worker inside its group.
        method: The engine call that was running or submitted.
    """

    def __init__(self, message: str, *, role: str, rank: int, method: str) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.method = method


class Executor(Protocol):
    """Builds each role's engine somewhere and hands the controller an object that drives it.

    The returned engines satisfy the same protocols as the ones the registry builds, so the
    controller calls them without knowing where they run. :class:`~verl_core.trainer.executor.LocalExecutor`
    builds them in this process; :class:`~verl_core.trainer.executor.RayExecutor` builds them in Ray worker
    groups and returns proxies.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The executor's config name (``local`` or ``ray``)."""

    @abstractmethod
    def training_engine(self, role: Role, backend: str, spec: EngineSpec) -> TrainingEngine:
        """Build the training engine of ``role`` (actor, reference or critic) with backend ``backend``."""

    @abstractmethod
    def rollout_engine(self, backend: str, spec: EngineSpec) -> RolloutEngine:
        """Build the rollout engine."""

    @abstractmethod
    def reward_engine(self, backend: str, spec: EngineSpec) -> RewardEngine:
        """Build a model-based reward engine."""

    @abstractmethod
    def weight_sync(self, actor_backend: str, rollout_backend: str) -> WeightSync:
        """The weight sync between engines of these backends, as placed by this executor."""

    def metrics(self) -> dict[str, float]:
        """The executor's own numbers, added to every step's metrics (none by default; the Ray
        executor's ``ray/rollout_restarts``)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release what the executor started (worker processes, placement groups, a local cluster)."""
