"""Parallel layout and process-group setup: torch.distributed plus Megatron's parallel state.

:func:`init_distributed` reads the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` as set by torchrun), initialises
torch.distributed (gloo on CPU, nccl on GPU) and Megatron's tensor/pipeline/data-parallel groups.
Without a launcher it starts a single-process group, so TP=PP=DP=1 runs in a plain ``python``.

Megatron's global parallel state holds one layout per process. A rollout engine colocated with a
training engine of another layout (e.g. training TP=2 x PP=2, rollout TP=1 on the same 4 ranks)
gets its own groups from :func:`rollout_groups`: tensor-parallel groups of consecutive ranks and
single-rank pipeline/context/embedding groups, passed to its GPTModel as a
``ProcessGroupCollection``. Build the training engine first: it owns the global state.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_core import ConfigError, ParallelSizes

__all__ = ["ParallelConfig", "ParallelState", "RolloutGroups", "init_distributed", "rollout_groups"]


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor, pipeline and data-parallel degrees of a Megatron run.

    Attributes:
        tp: Tensor-parallel size (must divide attention heads, KV groups and vocabulary).
        pp: Pipeline-parallel size (must divide the number of layers).
        dp: Data-parallel size; None derives it as ``world_size // (tp * pp)``.
        virtual_pp: Virtual pipeline stages per rank (interleaved 1F1B); None disables it.
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    virtual_pp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp is not None and self.dp < 1:
            raise ConfigError(f"ParallelConfig.dp must be >= 1 or None, got {self.dp}")
        if self.virtual_pp is not None:
            raise ConfigError(
                "ParallelConfig.virtual_pp is not supported by this version of verl-megatron; "
                "leave it None"
            )

    @classmethod
    def from_sizes(cls, sizes: ParallelSizes) -> ParallelConfig:
        """The config of an EngineSpec's parallel sizes (dp is checked against the world size)."""
        return cls(tp=sizes.tp, pp=sizes.pp, dp=sizes.dp)

    def resolve(self, world_size: int) -> ParallelState:
        """Check the layout against ``world_size`` and fill in dp.

        Raises:
            ConfigError: tp * pp does not divide the world size, or dp disagrees with it.
        """
        mp = self.tp * self.pp
        if world_size % mp != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp * pp = {self.tp} * {self.pp} = {mp}; "
                f"launch a multiple of {mp} processes (torchrun --nproc_per_node) or change tp/pp"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                f"tp={self.tp} x pp={self.pp} x dp={self.dp} needs {mp * self.dp} processes, but the "
                f"world size is {world_size}; launch {mp * self.dp} processes or set dp={dp}"
            )
        return ParallelState(tp=self.tp, pp=self.pp, dp=dp)


@dataclass(frozen=True)
class ParallelState:
    """The resolved layout of this process group (dp filled in)."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        """Processes the layout spans."""
        return self.tp * self.pp * self.dp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(config: ParallelConfig, *, device: str = "auto", seed: int = 0) -> ParallelState:
    """Initialise torch.distributed and Megatron's parallel state for ``config``.

    Idempotent: a second call with the same layout returns the existing state; a different layout
    in the same process raises.

    Args:
        config: The parallel layout.
        device: ``cpu``, ``cuda`` or ``auto`` (cuda when available). Picks gloo or nccl.
        seed: Seed of Megatron's model-parallel RNG streams.

    Raises:
        ConfigError: the layout does not fit the world size, or differs from an existing one.
    """
    from verl_megatron.cpu_shims import apply_cpu_shims

    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was requested but no CUDA device is available; use device='cpu'")
    if not use_cuda:
        apply_cpu_shims()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    state = config.resolve(world)

    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if use_cuda else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, rank=rank, world_size=world)
        else:
            if world != 1:
                raise ConfigError(
                    f"WORLD_SIZE={world} but MASTER_ADDR is not set; launch with torchrun"
                )
            dist.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    elif dist.get_world_size() != world:
        raise ConfigError(
            f"torch.distributed is initialised with world size {dist.get_world_size()}, "
            f"but WORLD_SIZE={world}"
        )

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (state.tp, state.pp):
            raise ConfigError(
                f"Megatron's parallel state is already initialised with tp={have[0]}, pp={have[1]}; "
                f"this process cannot also run tp={state.tp}, pp={state.pp}. Use one layout per "
                "process group (a rollout engine of another layout builds its own groups when the "
                "training engine is built first)"
            )
        return state
    ps.initialize_model_parallel(
        tensor_model_parallel_size=state.tp, pipeline_model_parallel_size=state.pp
    )
    # On CPU there is no CUDA generator to fork: the inference tracker's fork() is a no-op
    # (dropout is off in these models, so no RNG stream is consumed inside the forks).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not use_cuda)
    return state


@dataclass(frozen=True)
class RolloutGroups:
    """The tensor-parallel layout of a rollout engine (pp = 1) and the groups its model uses.

    Attributes:
        tp: Tensor-parallel size.
        dp: Replicas (``world_size // tp``).
        tp_rank: This rank's place in its tensor-parallel group.
        tp_group: The tensor-parallel group.
        pg_collection: A megatron ``ProcessGroupCollection`` for the model, or None when Megatron's
            global parallel state already has this layout.
    """

    tp: int
    dp: int
    tp_rank: int
    tp_group: Any
    pg_collection: Any


_ROLLOUT_GROUPS: dict[tuple[int, int], RolloutGroups] = {}  # (tp, id of the world group) -> groups


def rollout_groups(sizes: ParallelSizes, *, device: str = "auto", seed: int = 0) -> RolloutGroups:
    """The process groups of a rollout engine with ``sizes.tp`` (pp must be 1) on every rank.

    When torch.distributed or Megatron's parallel state is not yet initialised, this initialises
    them with the rollout's layout (:func:`init_distributed`). When Megatron's state already holds
    another layout (a colocated training engine), it builds (once per process and tp, collectively
    on every rank) tensor-parallel groups of consecutive ranks plus single-rank groups for the
    other dimensions, so the rollout model never touches the training engine's groups.

    Raises:
        ConfigError: pp is not 1, or ``tp * dp`` does not match the world size.
    """
    if sizes.pp != 1:
        raise ConfigError(f"a rollout layout has pp=1 (tensor parallel only), got pp={sizes.pp}")
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        state = init_distributed(ParallelConfig.from_sizes(sizes), device=device, seed=seed)
        return RolloutGroups(state.tp, state.dp, ps.get_tensor_model_parallel_rank(),
                             ps.get_tensor_model_parallel_group(), None)
    world = dist.get_world_size()
    if sizes.tp * sizes.dp != world:
        raise ConfigError(
            f"rollout tp={sizes.tp} x dp={sizes.dp} needs {sizes.tp * sizes.dp} processes, but the "
            f"world size is {world}; set dp={world // sizes.tp if world % sizes.tp == 0 else '?'} "
            f"(replicas) and a tp that divides {world}"
        )
    if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (sizes.tp, 1):
        return RolloutGroups(sizes.tp, sizes.dp, ps.get_tensor_model_parallel_rank(),
                             ps.get_tensor_model_parallel_group(), None)
    key = (sizes.tp, id(dist.group.WORLD))
    cached = _ROLLOUT_GROUPS.get(key)
    if cached is not None:
        return cached
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    tp_group: Any = None
    for start in range(0, world, sizes.tp):
        group = dist.new_group(list(range(start, start + sizes.tp)))
        if start <= rank < start + sizes.tp:
            tp_group = group
    single: Any = None
    for r in range(world):
        group = dist.new_group([r])
        if r == rank:
            single = group
    pgs = ProcessGroupCollection(tp=tp_group, pp=single, cp=single, tp_cp=tp_group, mp=tp_group,
                                 embd=single, pos_embd=single, dp=single, hcp=[single])
    groups = RolloutGroups(sizes.tp, sizes.dp, rank % sizes.tp, tp_group, pgs)
    _ROLLOUT_GROUPS[key] = groups
    return groups
