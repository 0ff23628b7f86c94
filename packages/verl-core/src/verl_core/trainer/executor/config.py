"""RayConfig: where the Ray executor places each role's worker group (the ``[ray]`` config section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from verl_core.kernel.engine import ROLES, ParallelSizes
from verl_core.kernel.errors import ConfigError

__all__ = ["ExecutorName", "Placement", "RayConfig", "Strategy"]

ExecutorName = Literal["local", "ray"]
"""How engines run: ``local`` in the controller's process, ``ray`` in Ray worker groups."""

Placement = Literal["split", "colocated"]
"""``split``: one worker group per role; ``colocated``: every role shares one group."""

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""Ray placement-group strategy of a worker group's bundles."""

_PARALLEL_KEYS = ("tp", "pp", "dp")


@dataclass(frozen=True)
class RayConfig:
    """Placement and resources of the Ray executor (used when ``executor = "ray"``).

    Attributes:
        address: Cluster to join: empty = start a local cluster in this process (or use the one
            already started by ``ray.init``), ``auto`` = the running cluster, or ``ray://host:port``.
        placement: ``split`` (a worker group per role; weights travel actor -> rollout through
            Ray's object store) or ``colocated`` (every role in one group of processes; the rollout
            sleeps while training runs and the weight sync stays inside each process).
        num_cpus_per_worker: CPUs reserved for each worker process (one per rank).
        num_gpus_per_worker: GPUs per worker process; None = 1 when ``model.device`` is CUDA, else 0.
        strategy: Ray placement-group strategy for a group's bundles (STRICT_PACK keeps a group on
            one node).
        parallel: Per-role parallel sizes, e.g. ``{actor = {dp = 2}}``: a training role's group has
            ``tp * pp * dp`` ranks (SPMD over torch.distributed); rollout and reward run ``dp``
            replicas, each handed a share of the batch.
        num_cpus: CPUs of a local cluster started here (0 = every CPU of the machine).
        object_store_memory: Bytes of a local cluster's object store (0 = Ray's default).
        placement_timeout_s: Seconds to wait for a worker group's resources before failing.
        max_rollout_restarts: How many times in a run a rollout worker group whose worker died is
            replaced by fresh workers (same spec and placement), given the weights it was serving
            and the interrupted call retried; 0 = a dead rollout worker fails the step. Needs
            ``placement = "split"`` (a colocated rollout shares its processes with the training
            engines, whose state only a checkpoint restores).
    """

    address: str = ""
    placement: Placement = "split"
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float | None = None
    strategy: Strategy = "PACK"
    parallel: dict[str, dict[str, int]] = field(default_factory=dict)
    num_cpus: int = 0
    object_store_memory: int = 0
    placement_timeout_s: float = 120.0
    max_rollout_restarts: int = 3

    def __post_init__(self) -> None:
        if self.num_cpus_per_worker < 0:
            raise ConfigError(f"config key 'ray.num_cpus_per_worker' must be >= 0, got {self.num_cpus_per_worker}")
        if self.num_gpus_per_worker is not None and self.num_gpus_per_worker < 0:
            raise ConfigError(f"config key 'ray.num_gpus_per_worker' must be >= 0, got {self.num_gpus_per_worker}")
        if self.num_cpus < 0:
            raise ConfigError(f"config key 'ray.num_cpus' must be >= 0 (0 = every CPU), got {self.num_cpus}")
        if self.object_store_memory < 0:
            raise ConfigError(
                f"config key 'ray.object_store_memory' must be >= 0 (0 = Ray's default), got {self.object_store_memory}"
            )
        if not self.placement_timeout_s > 0:
            raise ConfigError(f"config key 'ray.placement_timeout_s' must be > 0, got {self.placement_timeout_s}")
        if self.max_rollout_restarts < 0:
            raise ConfigError(
                "config key 'ray.max_rollout_restarts' must be >= 0 (0 = a dead rollout worker fails the step), "
                f"got {self.max_rollout_restarts}"
            )
        for role, sizes in self.parallel.items():
            if role not in ROLES:
                raise ConfigError(
                    f"config key 'ray.parallel.{role}': unknown role; choices: {', '.join(ROLES)}"
                )
            if not isinstance(sizes, dict):
                raise ConfigError(f"config key 'ray.parallel.{role}': expected a table like {{dp = 2}}, got {sizes!r}")
            for key, value in sizes.items():
                if key not in _PARALLEL_KEYS:
                    raise ConfigError(
                        f"config key 'ray.parallel.{role}.{key}': unknown; valid keys: {', '.join(_PARALLEL_KEYS)}"
                    )
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(f"config key 'ray.parallel.{role}.{key}' must be an integer >= 1, got {value!r}")
            if role in ("rollout", "reward") and (sizes.get("tp", 1) != 1 or sizes.get("pp", 1) != 1):
                raise ConfigError(
                    f"config key 'ray.parallel.{role}': only dp (replicas) is placed by the executor; "
                    "tensor parallelism inside a rollout engine is the backend's own option"
                )

    def parallel_of(self, role: str) -> ParallelSizes | None:
        """The parallel sizes configured for ``role`` (None = keep the engine spec's)."""
        sizes = self.parallel.get(role)
        return ParallelSizes(**sizes) if sizes else None
