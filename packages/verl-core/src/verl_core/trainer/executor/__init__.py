"""Executors: where engines run. ``local`` (this process, the default) or ``ray`` (worker groups).

The trainer builds every engine through an :class:`Executor` chosen by the config key
``executor``; what it gets back implements the usual engine protocols either way. Importing this
package never imports Ray: :class:`RayExecutor` loads it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_core.kernel.errors import ConfigError
from verl_core.trainer.executor.base import Executor, WorkerFailedError
from verl_core.trainer.executor.config import ExecutorName, Placement, RayConfig, Strategy
from verl_core.trainer.executor.local import LocalExecutor
from verl_core.trainer.executor.wire import (
    WIRE_FORMAT,
    from_wire,
    register_batch_serializer,
    to_wire,
)

if TYPE_CHECKING:
    from verl_core.trainer.executor.ray_executor import RayExecutor

__all__ = [
    "WIRE_FORMAT",
    "Executor",
    "ExecutorName",
    "LocalExecutor",
    "Placement",
    "RayConfig",
    "RayExecutor",
    "Strategy",
    "WorkerFailedError",
    "from_wire",
    "make_executor",
    "register_batch_serializer",
    "to_wire",
]


def make_executor(
    name: str, ray: RayConfig | None = None, *, device: str = "cpu", rollout_during_update: bool = False
) -> Executor:
    """The executor called ``name`` (``local`` or ``ray``).

    Args:
        name: ``local`` or ``ray``.
        ray: The ``[ray]`` config section (``ray`` only).
        device: Device of the engines (``model.device``).
        rollout_during_update: Whether the rollout samples while the actor trains (asynchronous
            training with ``max_staleness`` >= 1); the Ray executor then keeps the last weights sent
            to the rollout, for a rollout worker group it replaces (see :class:`RayExecutor`).

    Raises:
        ConfigError: an unknown name, or ``ray`` without Ray installed.
    """
    if name == "local":
        return LocalExecutor()
    if name == "ray":
        from verl_core.trainer.executor.ray_executor import RayExecutor

        return RayExecutor(ray, device=device, rollout_during_update=rollout_during_update)
    raise ConfigError(f"config key 'executor': unknown executor {name!r}; choices: 'local', 'ray'")


def __getattr__(name: str) -> Any:
    if name == "RayExecutor":  # lazy: keeps Ray out of `import verl_core.trainer.executor`
        from verl_core.trainer.executor.ray_executor import RayExecutor

        return RayExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
