"""EngineSpec: the backend-neutral description every engine is built from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from verl_core.kernel.errors import ConfigError

__all__ = ["DType", "EngineSpec", "OptimConfig", "ParallelSizes", "Role"]

Role = Literal["actor", "reference", "critic", "rollout", "reward"]
"""The part an engine plays in the RL loop."""

ROLES: tuple[Role, ...] = ("actor", "reference", "critic", "rollout", "reward")

DType = Literal["float32", "bfloat16", "float16"]
"""Parameter dtype of an engine's model. Log-probs are always computed in float32."""


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel degrees: tensor (tp), pipeline (pp) and data (dp) parallel.

    The world size of an SPMD training group is ``tp * pp * dp``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ParallelSizes.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Number of ranks the layout needs."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule of a trainable engine (AdamW with warmup and cosine or constant decay).

    Attributes:
        lr: Peak learning rate.
        weight_decay: Decoupled weight decay.
        betas: Adam betas.
        eps: Adam epsilon.
        warmup_steps: Linear warmup steps from 0 to ``lr``.
        total_steps: Steps of the schedule (cosine decays to ``min_lr_ratio * lr`` at this step).
        schedule: ``constant`` after warmup or ``cosine``.
        min_lr_ratio: Floor of the cosine schedule as a fraction of ``lr``.
        grad_clip: Max global grad norm (0 disables clipping; the norm is still reported).
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    total_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ConfigError("OptimConfig.warmup_steps and total_steps must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError(f"OptimConfig.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        import math

        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "cosine" and self.total_steps > self.warmup_steps:
            progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
            scale = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
            return self.lr * scale
        return self.lr


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build an engine of any backend.

    Attributes:
        model_path: A transformers-format folder (config, safetensors weights, tokenizer).
        role: The part the engine plays.
        dtype: Parameter dtype.
        device: ``cpu``, ``cuda`` or ``cuda:N``; under torchrun each rank uses its local device.
        seed: Seed of initialisation (value heads) and sampling.
        max_prompt_len: Longest prompt the engine must accept.
        max_response_len: Longest response the engine must accept or generate.
        parallel: Tensor, pipeline and data parallel sizes.
        optim: Optimizer settings (trainable roles: actor and critic).
        micro_batch_tokens: Token budget per micro-batch (padded tokens); None uses micro_batch_size.
        micro_batch_size: Samples per micro-batch when no token budget is set (None = whole batch).
        gradient_checkpointing: Recompute activations in backward to save memory.
        options: Backend-specific options, validated by the backend's own config class.
    """

    model_path: str
    role: Role
    dtype: DType = "float32"
    device: str = "cpu"
    seed: int = 0
    max_prompt_len: int = 512
    max_response_len: int = 512
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_tokens: int | None = None
    micro_batch_size: int | None = None
    gradient_checkpointing: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"EngineSpec.role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"EngineSpec.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_prompt_len < 1 or self.max_response_len < 1:
            raise ConfigError("EngineSpec.max_prompt_len and max_response_len must be >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"EngineSpec.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"EngineSpec.micro_batch_size must be >= 1, got {self.micro_batch_size}")

    @property
    def torch_dtype(self) -> Any:
        """The dtype as a ``torch.dtype``."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
