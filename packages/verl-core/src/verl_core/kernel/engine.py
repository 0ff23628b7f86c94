"""EngineSpec: the backend-neutral description every engine is built from."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from verl_core.kernel.errors import (
    ConfigError,
    check_bool,
    check_int,
    check_number,
    check_str,
    describe,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_LORA_TARGETS", "DType", "EngineSpec", "LoraSpec", "OptimConfig", "ParallelSizes", "Role", "lora_matches"]

Role = Literal["actor", "reference", "critic", "rollout", "reward"]
"""The part an engine plays in the RL loop."""

ROLES: tuple[Role, ...] = ("actor", "reference", "critic", "rollout", "reward")

DType = Literal["float32", "bfloat16", "float16"]
"""Parameter dtype of an engine's model. Log-probs are always computed in float32."""

DTYPES: Final[tuple[DType, ...]] = ("float32", "bfloat16", "float16")
_MAX_SEED: Final = 2**32 - 1  # numpy's seed range, which vLLM and others pass the seed on to


def _one_of(value: object, allowed: tuple[str, ...], name: str) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {describe(value)}")


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel degrees: tensor (tp), pipeline (pp) and data (dp) parallel.

    The world size of an SPMD training group is ``tp * pp * dp``; each degree is an integer >= 1.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            check_int(getattr(self, name), f"ParallelSizes.{name}", low=1)

    @property
    def world_size(self) -> int:
        """Number of ranks the layout needs."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule of a trainable engine (AdamW with warmup and cosine or constant decay).

    Attributes:
        lr: Peak learning rate (> 0).
        weight_decay: Decoupled weight decay (>= 0).
        betas: Adam betas, two numbers in [0, 1) (a list is turned into a tuple).
        eps: Adam epsilon (> 0).
        warmup_steps: Linear warmup steps from 0 to ``lr`` (>= 0).
        total_steps: Steps of the schedule (cosine decays to ``min_lr_ratio * lr`` at this step; >= 0).
        schedule: ``constant`` after warmup or ``cosine``.
        min_lr_ratio: Floor of the cosine schedule as a fraction of ``lr``, in [0, 1].
        grad_clip: Max global grad norm (0 disables clipping; the norm is still reported).

    Every value must be finite and of its type; anything else raises ConfigError naming the field.
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
        check_number(self.lr, "OptimConfig.lr", low=0, low_open=True)
        check_number(self.weight_decay, "OptimConfig.weight_decay", low=0)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigError(f"OptimConfig.betas must be two numbers in [0, 1), got {describe(betas)}")
        for i, b in enumerate(betas):
            check_number(b, f"OptimConfig.betas[{i}]", low=0, high=1, high_open=True)
        object.__setattr__(self, "betas", tuple(betas))
        check_number(self.eps, "OptimConfig.eps", low=0, low_open=True)
        check_int(self.warmup_steps, "OptimConfig.warmup_steps", low=0)
        check_int(self.total_steps, "OptimConfig.total_steps", low=0)
        _one_of(self.schedule, ("constant", "cosine"), "OptimConfig.schedule")
        check_number(self.min_lr_ratio, "OptimConfig.min_lr_ratio", low=0, high=1)
        check_number(self.grad_clip, "OptimConfig.grad_clip", low=0, hint=" (0 = off)")

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


DEFAULT_LORA_TARGETS: Final[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama, Qwen2/3 and Mistral layers."""


def lora_matches(pattern: str, name: str) -> bool:
    """Whether a LoRA target ``pattern`` names the module ``name`` (its dotted path in the model).

    A pattern matches a module whose name equals it, ends with ``"." + pattern`` (``q_proj``
    matches every layer's ``self_attn.q_proj``), or matches it whole as a regular expression
    (``model\\.layers\\.[0-3]\\..*_proj``). Every backend matches patterns by this one rule.
    """
    if name == pattern or name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter the engine trains instead of the whole model (low-rank adaptation).

    Each target linear layer ``W`` (out x in) gets ``A`` (rank x in) and ``B`` (out x rank); the
    adapted layer computes ``x W^T + scale * x A^T B^T`` with ``scale = alpha / rank``, the same
    as the merged weight ``W + scale * B A``. ``B`` starts at zero, so the adapted model starts as
    the base model. Only the adapter (and the modules in ``full``) gets gradients and optimizer
    state; the base weights stay frozen in the engine's dtype.

    Attributes:
        rank: Inner width of each adapter (>= 1).
        alpha: Scale numerator: the update is ``alpha / rank * B A`` (> 0).
        dropout: Dropout on the adapter's input while training, in [0, 1). 0 keeps the update's
            forward equal to the no-grad forward of the same weights (what PPO's ratio assumes).
        targets: Patterns of the linear modules that get an adapter (see :func:`lora_matches`);
            each must match at least one linear module of the model.
        full: Patterns of modules trained fully beside the adapters (e.g. ``embed_tokens``,
            ``lm_head``); each must match at least one module. A module cannot be both.
        init_path: A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
            whose tensors the adapter starts from instead of ``B = 0``; its rank, targets and
            tensors must be this spec's ("" = start from ``B = 0``).

    Every value is checked when the spec is built; anything else raises ConfigError naming the field.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    full: tuple[str, ...] = ()
    init_path: str = ""

    def __post_init__(self) -> None:
        check_int(self.rank, "LoraSpec.rank", low=1, hint=" (the adapter's inner width)")
        check_number(self.alpha, "LoraSpec.alpha", low=0, low_open=True, hint=" (the update is alpha / rank * B A)")
        check_number(self.dropout, "LoraSpec.dropout", low=0, high=1, high_open=True)
        for key in ("targets", "full"):
            value = getattr(self, key)
            if isinstance(value, str) or not isinstance(value, (tuple, list)) or not all(
                    isinstance(v, str) and v for v in value):
                raise ConfigError(f"LoraSpec.{key} must be a list of module name patterns (non-empty strings), "
                                  f"got {describe(value)}")
            object.__setattr__(self, key, tuple(value))
        if not self.targets:
            raise ConfigError("LoraSpec.targets is empty; name the linear modules that get an adapter, e.g. "
                              f"{list(DEFAULT_LORA_TARGETS)}")
        if not isinstance(self.init_path, str):
            raise ConfigError(f"LoraSpec.init_path must be a folder path or '', got {describe(self.init_path)}")
        both = sorted(set(self.targets) & set(self.full))
        if both:
            raise ConfigError(f"LoraSpec: {both} are both adapter targets and fully trained modules; a module "
                              "is one or the other")

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor of ``B A`` in the merged weight."""
        return float(self.alpha) / self.rank


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build an engine of any backend.

    Every field is checked when the spec is built (types, ranges, that ``device`` parses as a
    torch device); anything else raises ConfigError naming the field, the value and what is allowed.

    Attributes:
        model_path: A transformers-format folder (config, safetensors weights, tokenizer); a
            ``pathlib.Path`` is turned into a string. An engine refuses, when it is built, a
            folder it cannot run with a ConfigError naming what it found: an architecture or
            RoPE type it does not implement, or a ``pad_token_id``, ``eos_token_id`` or
            ``bos_token_id`` (an id or a list of ids) outside ``[0, vocab_size)`` in
            ``config.json`` or ``generation_config.json``, or a tokenizer pad, EOS or BOS token
            whose id lies there (:func:`verl_core.enginekit.model_folder.check_special_token_ids`;
            ``robustness::special_token_ids_outside_vocab_refused``).
        role: The part the engine plays.
        dtype: Parameter dtype.
        device: ``cpu``, ``cuda`` or ``cuda:N`` (a ``torch.device`` is turned into its string);
            under torchrun each rank uses its local device.
        seed: Seed of what the engine initialises itself (a value head, a fresh LoRA adapter's
            ``A``), in [0, 2**32 - 1]. Sampling does not read it: a rollout seeds each sample from
            ``SamplingParams.seed`` (``sample_seed(seed, group id, sample index)``), and a call
            without one draws from torch's generator.
        max_prompt_len: Longest prompt the engine must accept (>= 1).
        max_response_len: Longest response the engine must accept or generate (>= 1).
        parallel: Tensor, pipeline and data parallel sizes.
        optim: Optimizer settings (trainable roles: actor and critic).
        micro_batch_tokens: Token budget per micro-batch (>= 1): padded tokens (rows x the longest
            sequence), or real tokens (the sum of the sequences' lengths) for an engine declaring
            ``TrainingCapabilities.packed_sequences``, as for ``forward_backward``'s ``max_tokens``
            (``partition_by_token_budget(..., packed=True)``); None uses micro_batch_size.
        micro_batch_size: Samples per micro-batch (>= 1) when no token budget is set (None = whole batch).
        gradient_checkpointing: Recompute activations in backward to save memory.
        options: Backend-specific options (a mapping with string keys), validated by the backend's
            own config class when the engine is built.
        lora: Train a LoRA adapter instead of the whole model (training engines), or apply the
            adapter streams of such a trainer (rollout engines); None trains and serves full
            weights. Building an engine refuses it where the backend does not declare
            ``TrainingCapabilities.lora`` / ``RolloutCapabilities.lora_adapters``.
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
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        path = self.model_path
        object.__setattr__(self, "model_path", os.fspath(path) if isinstance(path, os.PathLike) else path)
        check_str(self.model_path, "EngineSpec.model_path")
        _one_of(self.role, ROLES, "EngineSpec.role")
        _one_of(self.dtype, DTYPES, "EngineSpec.dtype")
        object.__setattr__(self, "device", _device_string(self.device))
        check_int(self.seed, "EngineSpec.seed", low=0, high=_MAX_SEED)
        check_int(self.max_prompt_len, "EngineSpec.max_prompt_len", low=1)
        check_int(self.max_response_len, "EngineSpec.max_response_len", low=1)
        if not isinstance(self.parallel, ParallelSizes):
            raise ConfigError(f"EngineSpec.parallel must be a ParallelSizes, got {describe(self.parallel)}")
        if not isinstance(self.optim, OptimConfig):
            raise ConfigError(f"EngineSpec.optim must be an OptimConfig, got {describe(self.optim)}")
        for name in ("micro_batch_tokens", "micro_batch_size"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), f"EngineSpec.{name}", low=1, hint=" or None")
        check_bool(self.gradient_checkpointing, "EngineSpec.gradient_checkpointing")
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise ConfigError(
                f"EngineSpec.options must be a mapping with string keys (the backend's options), got "
                f"{describe(self.options)}"
            )
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ConfigError(f"EngineSpec.lora must be a LoraSpec or None, got {describe(self.lora)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def _device_string(device: object) -> str:
    """``device`` as a string that ``torch.device`` accepts (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    import torch

    if isinstance(device, torch.device):
        return str(device)
    check_str(device, "EngineSpec.device")
    assert isinstance(device, str)
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"EngineSpec.device must be a torch device such as 'cpu', 'cuda' or 'cuda:0', got "
                          f"{describe(device)}") from None
    return device
