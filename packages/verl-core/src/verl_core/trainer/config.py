"""Typed configuration of a training run, loaded from TOML or YAML plus ``key.sub=value`` overrides.

Every section is a dataclass; :func:`load_config` reads a file, applies command-line overrides
(values parsed as TOML literals, bare words taken as strings) and builds :class:`RunConfig`. Any
unknown key, wrong type or out-of-range value raises :class:`~verl_core.kernel.errors.ConfigError` naming
the full dotted key and the valid choices.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from verl_core.kernel.engine import OptimConfig
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.executor.config import ExecutorName, RayConfig
from verl_core.trainer.inputs.agent import AgentConfig
from verl_core.trainer.inputs.data import DataConfig
from verl_core.trainer.inputs.rewards import RewardFunctionsConfig
from verl_core.trainer.sinks import SinkConfig, WandbMode

__all__ = [
    "AgentConfig",
    "AlgorithmConfig",
    "BackendsConfig",
    "BatchConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimSection",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "parse_override",
    "read_config_file",
]

TaskName = Literal["copy", "reverse", "add"]


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: a transformers folder, or a tiny random model built at start.

    Attributes:
        path: A transformers-format folder; empty = build a tiny random model with the fields below
            into ``<output_dir>/model`` (needs transformers).
        arch: Tiny-model architecture (llama, qwen2, qwen3).
        hidden_size: Tiny-model width.
        num_layers: Tiny-model decoder layers.
        num_heads: Tiny-model attention heads.
        num_kv_heads: Tiny-model key/value heads.
        head_dim: Tiny-model head width.
        intermediate_size: Tiny-model MLP width.
        vocab_size: Tiny-model vocabulary (>= the char tokenizer's 95 symbols).
        tied: Tie the tiny model's lm_head to its embedding.
        init_std: Std of the tiny model's random init.
        dtype: Parameter dtype of every engine.
        device: Device of every engine (cpu, cuda, cuda:N); with the local executor a CUDA device
            must be visible to this process.

    With ``path`` empty the tiny-model keys must describe a valid model: ``num_heads`` divides
    ``hidden_size``, ``num_kv_heads`` divides ``num_heads``, ``head_dim`` is even (and equals
    ``hidden_size / num_heads`` for qwen2, whose vLLM model derives it).
    """

    path: str = ""
    arch: Literal["llama", "qwen2", "qwen3"] = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    vocab_size: int = 96
    tied: bool = True
    init_std: float = 0.02
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"


@dataclass(frozen=True)
class TaskConfig:
    """The built-in task that supplies prompts and rewards.

    Attributes:
        name: ``copy`` (repeat the digits), ``reverse`` (reverse them) or ``add`` (a+b=).
        digits: Digits per number.
        reward: ``exact`` (1 for the answer then EOS, else 0), ``partial`` (share of matching
            positions; 1 only for an exact match) or ``token`` (``partial`` plus dense per-token
            scores summing to it; the algorithm then gets the dense scores alone, for per-token
            credit with ``grpo_token`` or GAE). The strict exact-match rate is always logged.
        eval_prompts: Prompts of the fixed greedy evaluation set (0 = no evaluation).
        eval_every: Steps between evaluations (0 = only at the end).
    """

    name: TaskName = "copy"
    digits: int = 3
    reward: Literal["exact", "partial", "token"] = "partial"
    eval_prompts: int = 0
    eval_every: int = 0


@dataclass(frozen=True)
class BackendsConfig:
    """Backend name per role (as listed by ``verl backends``).

    Attributes:
        actor: Backend of the trained policy.
        rollout: Backend that generates responses.
        reference: Backend of the frozen reference policy (used when the algorithm needs KL).
        critic: Backend of the value model (used when the algorithm needs values).
        reward: ``rule`` (the task's exact-match reward) or a backend with a reward-model engine.
        options: Backend options per role: a table for each of ``actor``, ``rollout``,
            ``reference``, ``critic`` and ``reward``, given to that role's engine as
            ``EngineSpec.options`` and validated by its backend when the engine is built (e.g.
            ``backends.options.rollout.rollout_cache = "static"`` for the hf rollout).
    """

    actor: str = "hf"
    rollout: str = "hf"
    reference: str = "hf"
    critic: str = "hf"
    reward: str = "rule"
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        roles = ("actor", "rollout", "reference", "critic", "reward")
        for role, table in self.options.items():
            if role not in roles:
                raise ConfigError(f"config key {'backends.options.' + role!r}: unknown role; choices: {', '.join(roles)}")
            if not isinstance(table, Mapping):
                raise ConfigError(f"config key {'backends.options.' + role!r}: expected a table of backend options, got {table!r}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL algorithm, by registered name, and its options.

    Attributes:
        name: Algorithm name (grpo, grpo_token, dr_grpo, dapo, rloo, reinforce_pp, remax, ppo, ...).
        options: Options of the algorithm, validated by the algorithm's own config.
        use_reference: Compute reference log-probs (needed for a KL loss or KL reward penalty).
        use_critic: Train a critic (PPO with GAE); None = as the algorithm needs.
        dynamic_sampling: Drop groups whose scores are all equal (DAPO) before the update.
    """

    name: str = "grpo"
    options: dict[str, Any] = field(default_factory=dict)
    use_reference: bool = False
    use_critic: bool | None = None
    dynamic_sampling: bool = False


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling parameters of the rollout.

    Attributes:
        n: Samples per prompt (the group size).
        temperature: Sampling temperature.
        top_p: Nucleus threshold.
        top_k: Top-k (0 = off).
        max_new_tokens: Longest response.
        sleep: When the rollout engine sleeps during the update (freeing its device memory):
            ``always`` every step; ``never``; ``auto`` (default) every step unless the run is in
            one process on a CUDA device with room for both: then the first step sleeps and
            measures, and later steps keep the rollout awake while the update's measured peak
            plus the rollout's memory stays within 85% of the device (see
            :class:`~verl_core.trainer.rl.weight_sync.SleepPolicy`).

    The sampling values are checked by :class:`~verl_core.kernel.rollout.SamplingParams` (bounds there).
    """

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    sleep: Literal["auto", "always", "never"] = "auto"


@dataclass(frozen=True)
class BatchConfig:
    """Batch sizes.

    Attributes:
        prompts_per_step: Prompts sampled per step (each gives ``rollout.n`` samples).
        mini_batch_size: Samples per optimizer step (0 = the whole step's batch, one update).
        epochs: Passes over the step's samples.
        micro_batch_tokens: Fixed token budget per micro-batch (0 = pick it at run start from the
            free memory and the model's bytes per token, estimated from its config.json and refined
            once from the allocator's peak after the first update on CUDA; checkpoints keep it, so
            a resume splits steps the same way). See :mod:`verl_core.trainer.batching.budget`.
        min_tokens: Smallest dynamic budget.
        max_tokens: Largest dynamic budget (0 = no cap: a budget above a batch's padded tokens
            runs that batch as one micro-batch).
        buffer_memory_bytes: Tensor bytes the replay buffer keeps in memory before it spills
            whole batches to ``<output_dir>/spill-<run id>`` (0 = no bound).
        old_log_probs: Where the PPO ratio's old log-probs come from. ``auto``: when each step's
            batch gets exactly one optimizer step (one mini-batch, one epoch) and nothing needs them
            before the update (no KL penalty in the reward), the detached log-probs of the update's
            own forward (the same numbers, one actor forward less per step); otherwise a separate
            actor forward. ``recompute``: always the separate forward.
    """

    prompts_per_step: int = 16
    mini_batch_size: int = 0
    epochs: int = 1
    micro_batch_tokens: int = 0
    min_tokens: int = 64
    max_tokens: int = 0
    buffer_memory_bytes: int = 0
    old_log_probs: Literal["auto", "recompute"] = "auto"


@dataclass(frozen=True)
class OptimSection:
    """Optimizer settings of a trainable engine (see :class:`verl_core.OptimConfig`)."""

    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def to_optim(self, total_steps: int) -> OptimConfig:
        """The engine-level OptimConfig."""
        return OptimConfig(
            lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps,
            warmup_steps=self.warmup_steps, total_steps=total_steps, schedule=self.schedule,
            min_lr_ratio=self.min_lr_ratio, grad_clip=self.grad_clip,
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing.

    Attributes:
        every: Steps between checkpoints (0 = only the final one).
        keep: Most recent checkpoints kept (older ones are deleted).
        final: Write a checkpoint at the end of the run.
    """

    every: int = 0
    keep: int = 2
    final: bool = True


@dataclass(frozen=True)
class LoggingConfig:
    """What the run reports.

    Attributes:
        progress: A progress bar with the live reward on stderr.
        plot: A PNG of the curves at the end (needs the ``plot`` extra: matplotlib).
        sinks: Where every step's metrics go: ``jsonl`` (``<output_dir>/metrics.jsonl``),
            ``tensorboard``, ``wandb``, and callbacks named ``module:attr`` or
            ``path/to/file.py:attr`` (see :mod:`verl_core.trainer.sinks`); empty = none.
        wandb_project: The W&B project (``wandb`` sink).
        wandb_mode: ``offline`` (files under the run folder, no network), ``online`` or ``disabled``.
        tensorboard_dir: Folder of TensorBoard's event files; empty = ``<output_dir>/tensorboard``.
    """

    progress: bool = True
    plot: bool = True
    sinks: tuple[str, ...] = ("jsonl",)
    wandb_project: str = "verl"
    wandb_mode: WandbMode = "offline"
    tensorboard_dir: str = ""

    def __post_init__(self) -> None:
        self.sink_config()  # the sink names and settings are checked when the config loads

    def sink_config(self) -> SinkConfig:
        """The :class:`~verl_core.trainer.sinks.SinkConfig` of these settings."""
        return SinkConfig(sinks=self.sinks, wandb_project=self.wandb_project, wandb_mode=self.wandb_mode,
                          tensorboard_dir=self.tensorboard_dir)


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs.

    Attributes:
        steps: Training steps.
        seed: Seed of prompts, sampling and initialisation (0 to 2**24 - 1).
        output_dir: Folder of the run: metrics, checkpoints, the plot and the built model. A fresh
            run needs a new or empty folder and marks it with ``verl_run.json``; ``--resume``
            needs that marker (see :mod:`verl_core.trainer.run.folder`).
        overwrite: Let a fresh run start in an ``output_dir`` that holds something (another run,
            or other files): the folder is renamed to ``<output_dir>.old-<time>`` first, so
            nothing is deleted. Not allowed with ``--resume``.
        model: The policy model.
        critic_model: Folder of the critic's model (empty = the policy model).
        task: The built-in task (its prompts and rule reward are used when ``data.train`` and
            ``reward.functions`` are empty).
        data: The user's dataset: training and evaluation prompts (``data.train``, ``data.eval``).
        reward: Reward functions by import path and their weights.
        backends: Backend per role.
        algorithm: Algorithm and options.
        rollout: Sampling parameters.
        agent: Multi-turn episodes with tools or an environment (off unless ``agent.environment``
            or ``agent.tools`` is set); see :class:`~verl_core.trainer.inputs.agent.AgentConfig`.
        batch: Batch sizes.
        optim: Actor optimizer.
        critic_optim: Critic optimizer.
        checkpoint: Checkpointing.
        logging: Reporting.
        max_consecutive_skips: Optimizer steps in a row skipped for a non-finite loss or gradient
            (on any rank, actor or critic) after which the run writes a checkpoint and stops with
            TrainingDivergedError; 0 = never stop.
        executor: Where engines run: ``local`` (this process) or ``ray`` (Ray worker groups).
        ray: Placement and resources of the ``ray`` executor.
    """

    steps: int = 100
    seed: int = 0
    output_dir: str = "runs/verl"
    overwrite: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    critic_model: str = ""
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardFunctionsConfig = field(default_factory=RewardFunctionsConfig)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    critic_optim: OptimSection = field(default_factory=lambda: OptimSection(lr=5e-3))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    max_consecutive_skips: int = 5
    executor: ExecutorName = "local"
    ray: RayConfig = field(default_factory=RayConfig)


# ---------------------------------------------------------------------------- rules
_D = TypeVar("_D")

_INT64 = 2**63
# The trainer mixes seed and step into 64-bit generator seeds (about seed * 1e12): larger seeds overflow.
_SEEDS = 2**24
# Special tokens plus the printable ASCII characters of the char tokenizer every built-in task uses.
_TOKENIZER_SYMBOLS = 95


@dataclass(frozen=True)
class _Rule:
    """What one config value must satisfy (``ok(value)``) and the text saying so."""

    ok: Callable[[Any], bool]
    allowed: str


def _at_least(n: int, note: str = "") -> _Rule:
    return _Rule(lambda v: v >= n, f">= {n}{note}")


def _above(x: int) -> _Rule:
    return _Rule(lambda v: v > x, f"> {x}")


_OPTIM_RULES: dict[str, _Rule] = {
    "lr": _above(0),
    "weight_decay": _at_least(0),
    "betas": _Rule(lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "eps": _above(0),
    "warmup_steps": _at_least(0),
    "min_lr_ratio": _Rule(lambda v: 0 <= v <= 1, "in [0, 1]"),
    "grad_clip": _at_least(0, " (0 = no clipping)"),
}

# Dotted key -> rule, checked after every value has its declared type (which _convert enforces from
# the dataclass annotations, so a field without a rule here still gets its type checked). The
# ``ray`` section checks its own values (RayConfig.__post_init__); options tables are validated
# by the algorithm and the backends that read them.
_RULES: dict[str, _Rule] = {
    "steps": _at_least(1),
    "seed": _Rule(lambda v: 0 <= v < _SEEDS, f"0 to {_SEEDS - 1}"),
    "data.eval_every": _at_least(0, " (0 = only after the last step)"),
    "data.eval_n": _at_least(1),
    "reward.model_weight": _Rule(math.isfinite, "any finite number (the reward model's weight; negative flips it)"),
    "output_dir": _Rule(bool, "a non-empty path"),
    "model.hidden_size": _at_least(1),
    "model.num_layers": _at_least(1),
    "model.num_heads": _at_least(1),
    "model.num_kv_heads": _at_least(1),
    "model.head_dim": _at_least(1),
    "model.intermediate_size": _at_least(1),
    "model.vocab_size": _at_least(_TOKENIZER_SYMBOLS, " (the char tokenizer's symbols)"),
    "model.init_std": _above(0),
    "model.device": _Rule(lambda v: re.fullmatch(r"cpu|cuda(:[0-9]+)?", v) is not None, "cpu, cuda or cuda:N"),
    "task.digits": _Rule(lambda v: 1 <= v <= 9, "1 to 9"),
    "task.eval_prompts": _at_least(0, " (0 = no evaluation)"),
    "task.eval_every": _at_least(0, " (0 = only at the end)"),
    "batch.prompts_per_step": _at_least(1),
    "batch.mini_batch_size": _at_least(0, " (0 = whole batch)"),
    "batch.epochs": _at_least(1),
    "batch.micro_batch_tokens": _at_least(0, " (0 = dynamic)"),
    "batch.min_tokens": _at_least(1),
    "batch.max_tokens": _at_least(0, " (0 = no cap)"),
    "batch.buffer_memory_bytes": _at_least(0, " (0 = no bound)"),
    **{f"{section}.{key}": rule for section in ("optim", "critic_optim") for key, rule in _OPTIM_RULES.items()},
    "checkpoint.every": _at_least(0, " (0 = final only)"),
    "checkpoint.keep": _at_least(1),
    "max_consecutive_skips": _at_least(0, " (0 = never stop)"),
    "agent.max_turns": _at_least(1),
    "agent.max_total_tokens": _at_least(1),
    "agent.tool_timeout_s": _above(0),
    "agent.step_timeout_s": _above(0),
    "agent.concurrency": _at_least(0, " (0 = every episode of a step at once)"),
}


def _check_rollout(cfg: RunConfig) -> None:
    """The rollout section is checked by SamplingParams itself: one rule for sampling parameters."""
    r = cfg.rollout
    try:
        SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens, n=r.n)
    except ConfigError as e:
        raise ConfigError(re.sub(r"SamplingParams\.(\w+)", r"config key 'rollout.\1'", str(e))) from None


def _check_tokens(cfg: RunConfig) -> None:
    if 0 < cfg.batch.max_tokens < cfg.batch.min_tokens:
        raise ConfigError(
            f"config keys 'batch.min_tokens' ({cfg.batch.min_tokens}) must be <= 'batch.max_tokens' "
            f"({cfg.batch.max_tokens})"
        )
    if cfg.data.train_paths:
        return  # the dataset supplies the prompts: the built-in task's answer length does not apply
    need = cfg.task.digits + (2 if cfg.task.name == "add" else 1)  # the answer, then EOS
    if cfg.rollout.max_new_tokens < need:
        raise ConfigError(
            f"config key 'rollout.max_new_tokens' = {cfg.rollout.max_new_tokens} is too short for 'task.name' = "
            f"{cfg.task.name!r} with 'task.digits' = {cfg.task.digits}; allowed: >= {need} (answers take "
            f"{'up to ' * (cfg.task.name == 'add')}{need} tokens with EOS)"
        )


def _check_agent(cfg: RunConfig) -> None:
    """Multi-turn episodes draw their prompts (and the rows environments are built from) from a dataset."""
    if cfg.agent.enabled and not cfg.data.train_paths:
        key = "agent.environment" if cfg.agent.environment else "agent.tools"
        raise ConfigError(
            f"config key {key!r} is set, which runs multi-turn episodes, but 'data.train' is empty; episodes start "
            "from the prompts of a dataset (chat messages, rendered with the tools): set data.train"
        )


def _check_model_shape(cfg: RunConfig) -> None:
    m = cfg.model
    if m.path:
        return  # the shape keys describe only the tiny model built when no folder is given
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"config key 'model.num_heads' = {m.num_heads} does not divide 'model.hidden_size' = {m.hidden_size}; "
            "allowed: a divisor of hidden_size"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"config key 'model.num_kv_heads' = {m.num_kv_heads} does not divide 'model.num_heads' = {m.num_heads}; "
            "allowed: a divisor of num_heads (each key/value head serves a whole group of query heads)"
        )
    if m.arch == "qwen2" and m.head_dim * m.num_heads != m.hidden_size:
        raise ConfigError(
            f"config key 'model.head_dim' = {m.head_dim} must be 'model.hidden_size' / 'model.num_heads' = "
            f"{m.hidden_size // m.num_heads} with 'model.arch' = 'qwen2' (vLLM's Qwen2 derives the head width from them)"
        )
    if m.head_dim % 2:
        raise ConfigError(
            f"config key 'model.head_dim' = {m.head_dim} must be even (rotary embeddings turn pairs of channels)"
        )


def check_device_here(cfg: RunConfig) -> None:
    """Refuse a ``model.device`` this machine does not have (the local executor only).

    Not part of loading a config: a config written for a GPU machine is valid anywhere; this runs
    where the run starts (``Trainer.setup``, ``verl train --check``).

    Raises:
        ConfigError: ``cuda`` without CUDA, or a CUDA index beyond the devices present.
    """
    device = cfg.model.device
    if device == "cpu" or cfg.executor != "local":
        return  # Ray workers may see GPUs this process does not; each checks its own device
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"config key 'model.device' = {device!r}, but CUDA is not available here "
            "(torch.cuda.is_available() is false); use model.device='cpu' or run on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if int(device.partition(":")[2] or 0) >= count:
        raise ConfigError(
            f"config key 'model.device' = {device!r}, but this machine has {count} CUDA device(s): "
            f"cuda:0 to cuda:{count - 1}"
        )


# Checks that involve several keys, run in order after every single-key rule passed.
_CHECKS: tuple[Callable[[RunConfig], None], ...] = (_check_rollout, _check_tokens, _check_agent, _check_model_shape)


# ---------------------------------------------------------------------------- building
def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return "a list of " + ", ".join(_type_name(a) for a in get_args(tp))
    if origin is dict:
        return "a table"
    if tp is type(None):
        return "none"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ConfigError(
                f"config key {key!r}: {value!r} is not valid; choices: {', '.join(repr(c) for c in choices)}"
            )
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: expected a table of {sorted(f.name for f in dataclasses.fields(tp))}, got {value!r}")
        return _build(typing.cast(type, tp), value, key + ".")
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: expected a table, got {value!r}")
        value_type = get_args(tp)[1]
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise ConfigError(f"config key {key!r}: keys must be non-empty strings, got {k!r}")
            out[k] = _convert(v, value_type, f"{key}.{k}")
        return out
    if origin is list or (origin is tuple and len(get_args(tp)) == 2 and get_args(tp)[1] is Ellipsis):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r}: expected a list, got {value!r}")
        items = [_convert(v, get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {value!r}")
        return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r}: expected an integer, got {value!r}")
        if not -_INT64 <= value < _INT64:
            raise ConfigError(f"config key {key!r} = {value!r} is out of range; allowed: a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(_as_float(value)):
            raise ConfigError(f"config key {key!r}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(f"config key {key!r}: expected a string (without NUL characters), got {value!r}")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"config key {key!r}: unsupported type {tp!r}")  # pragma: no cover


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def _build(cls: type[_D], data: Mapping[str, Any], prefix: str) -> _D:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = prefix + str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            raise ConfigError(
                f"unknown config key {full!r}; valid keys{' in ' + repr(prefix[:-1]) if prefix else ''}: "
                f"{', '.join(names)}" + (f"; did you mean {prefix + close[0]!r}?" if close else "")
            )
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"config section {prefix[:-1] or 'top level'!r}: {e}") from e


def config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from nested mappings (as read from TOML/YAML).

    Every value is checked against its field's type (from the dataclass annotation), then against
    its rule (bounds, choices, formats), then the checks across keys run (token budgets, the tiny
    model's shape, the device).

    Raises:
        ConfigError: naming the full dotted key of the first unknown key or invalid value, the
            value, and what is allowed.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a table of keys at the top level, got {data!r}")
    cfg = _build(RunConfig, data, "")
    flat = _flatten(config_to_dict(cfg))
    for key, rule in _RULES.items():
        value = flat[key]
        if not rule.ok(value):
            problem = "is not valid" if isinstance(value, str) else "is out of range"
            raise ConfigError(f"config key {key!r} = {value!r} {problem}; allowed: {rule.allowed}")
    for check in _CHECKS:
        check(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain values (tuples as lists), e.g. to save as JSON."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = config_to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        elif isinstance(v, dict):
            out[f.name] = dict(v)
        else:
            out[f.name] = v
    return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and k != "options":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# ---------------------------------------------------------------------------- files and overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and value (a TOML literal, or a bare string).

    Raises:
        ConfigError: no ``=`` or an empty key part.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value (e.g. optim.lr=1e-3)")
    raw = raw.strip()
    try:
        doc = tomllib.loads(f"v = {raw}")
    except (tomllib.TOMLDecodeError, RecursionError):
        return key.split("."), raw
    # "1\nx = 2" parses as two keys: the value was not one TOML literal, so it is the text itself
    return key.split("."), doc["v"] if list(doc) == ["v"] else raw


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``key.sub=value`` override set (tables created as needed)."""
    out = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"override {text!r}: {'.'.join(path[: i + 1])!r} is a value, not a table"
                )
            node = child
        node[path[-1]] = value
    return out


def _deep_copy(d: Mapping[str, Any], memo: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    # memo: YAML anchors share one table in many places; copying each use would grow exponentially
    memo = {} if memo is None else memo
    if id(d) not in memo:
        out = memo[id(d)] = {}
        for k, v in d.items():
            out[k] = _deep_copy(v, memo) if isinstance(v, Mapping) else v
    return memo[id(d)]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file into nested mappings.

    Raises:
        ConfigError: the file is missing or unreadable, not UTF-8, not valid TOML/YAML (naming the
            line), of another format, or (YAML) not a table at the top level.
    """
    p = Path(path)
    where = f"config file {str(path)!r}"
    if not p.is_file():
        raise ConfigError(f"{where} is a folder, not a file" if p.is_dir() else f"{where} does not exist")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"{where}: unknown format {suffix!r}; use .toml, .yaml or .yml")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from e
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{where} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}; save it as UTF-8") from e
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{where} is not valid TOML: {e}") from e
        except RecursionError:
            raise ConfigError(f"{where} is not valid TOML: arrays or tables nested too deeply") from None
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"{where} is YAML, which needs PyYAML: pip install 'verl-core[yaml]' (or write the config as TOML)"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {_yaml_error(e)}") from e
    except ValueError as e:  # PyYAML's scanner lets some bad escapes through (e.g. "\U7fffffff")
        raise ConfigError(f"{where} is not valid YAML: {e}") from e
    except RecursionError:
        raise ConfigError(f"{where} is not valid YAML: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a table of keys at the top level, got {type(data).__name__}")
    return data


def _yaml_error(e: Exception) -> str:
    """One line of a YAML error: where it is (1-based line and column) and what is wrong."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(e).split())


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read ``path`` (or start from the defaults), apply ``overrides`` and build the RunConfig."""
    data = read_config_file(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides))
