"""Typed configuration of a training run, loaded from TOML or YAML plus ``key.sub=value`` overrides.

Every section is a dataclass; :func:`load_config` reads a file, applies command-line overrides
(values parsed as TOML literals, bare words taken as strings) and builds :class:`RunConfig`. Any
unknown key, wrong type or out-of-range value raises :class:`~verl_core.kernel.errors.ConfigError` naming
the full dotted key and the valid choices.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from verl_core.algorithms.config import OffPolicyConfig
from verl_core.kernel.convert import Check, Ge, Gt, build
from verl_core.kernel.engine import DEFAULT_LORA_TARGETS, LoraSpec, OptimConfig
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.executor.config import ExecutorName, RayConfig
from verl_core.trainer.inputs.agent import AgentConfig
from verl_core.trainer.inputs.data import DataConfig
from verl_core.trainer.inputs.rewards import RewardFunctionsConfig
from verl_core.trainer.sinks import SinkConfig

__all__ = [
    "AgentConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "BackendsConfig",
    "BatchConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "LoraSection",
    "ModelConfig",
    "OptimSection",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "is_file",
    "load_config",
    "parse_override",
    "read_config_file",
]

TaskName = Literal["copy", "reverse", "add"]

# The trainer mixes seed and step into 64-bit generator seeds (about seed * 1e12): larger seeds overflow.
_SEEDS = 2**24
# Special tokens plus the printable ASCII characters of the char tokenizer every built-in task uses.
_TOKENIZER_SYMBOLS = 95


# Predicates of annotations are module-level functions: a lambda evaluated in an annotation does not
# see this module's globals (typing.get_type_hints evaluates class annotations in the class namespace).
def _is_device(value: str) -> bool:
    return re.fullmatch(r"cpu|cuda(:[0-9]+)?", value) is not None


def _is_seed(value: int) -> bool:
    return 0 <= value < _SEEDS


def _min(n: int, note: str) -> Check:
    """``>= n`` with a note on what the bound value means (``>= 0 (0 = no cap)``)."""
    return Check(lambda v: v >= n, f">= {n}{note}")


@dataclass(frozen=True)
class LoraSection:
    """Train a LoRA adapter instead of the whole policy (``model.lora``; see docs/lora.md).

    Attributes:
        enabled: Train the actor's LoRA adapter (the base frozen). The reference policy, when the
            algorithm needs one, is then the actor with its adapter disabled: no reference engine
            is built. Checkpoints hold the adapter and the base's identity.
        rank: Inner width of each adapter (>= 1).
        alpha: The update is ``alpha / rank * B A`` (> 0).
        dropout: Dropout on each adapter's input during updates, in [0, 1) (0 keeps PPO's ratio exact).
        targets: Linear modules that get an adapter, by name pattern: a module's last name part
            (``q_proj``), a dotted suffix, or a regular expression over the whole name; each must
            match a linear module. Default: the attention and MLP projections.
        full: Modules trained fully beside the adapters (e.g. ``embed_tokens``), by the same
            patterns; empty = none.
        init_path: A PEFT adapter folder the adapter starts from (empty = ``B = 0``: the base model).
        sync: What the weight sync sends the rollout: ``merged`` weights (default: ``W + alpha /
            rank * B A``, merged tensor by tensor; any rollout backend, which then decodes plain
            weights at full speed), or the ``adapter`` (a few MB; a rollout backend declaring
            ``RolloutCapabilities.lora_adapters`` and the local executor; the rollout decodes base +
            adapter, slower per token, with no rounding of merged weights in bfloat16).
    """

    enabled: bool = False
    rank: Annotated[int, Ge(1)] = 8
    alpha: Annotated[float, Gt(0)] = 16.0
    dropout: Annotated[float, Check(lambda v: 0 <= v < 1, "in [0, 1)")] = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    full: tuple[str, ...] = ()
    init_path: str = ""
    sync: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        try:
            self.spec()
        except ConfigError as e:
            raise ConfigError(re.sub(r"LoraSpec\.(\w+)", r"config key 'model.lora.\1'", str(e))) from None

    def spec(self) -> LoraSpec:
        """The engines' :class:`~verl_core.kernel.engine.LoraSpec` of this section."""
        return LoraSpec(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=self.targets,
                        full=self.full, init_path=self.init_path)


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
        lora: Train a LoRA adapter of the policy instead of all its weights (see :class:`LoraSection`).
        gradient_checkpointing: Recompute the trained roles' (actor, critic) activations in the
            backward pass instead of keeping them: less activation memory, so larger micro-batches
            (the token budget counts it), for about a third more compute in the update. Refused
            where the role's backend does not declare ``TrainingCapabilities.gradient_checkpointing``.

    With ``path`` empty the tiny-model keys must describe a valid model: ``num_heads`` divides
    ``hidden_size``, ``num_kv_heads`` divides ``num_heads``, ``head_dim`` is even (and equals
    ``hidden_size / num_heads`` for qwen2, whose vLLM model derives it).
    """

    path: str = ""
    arch: Literal["llama", "qwen2", "qwen3"] = "llama"
    hidden_size: Annotated[int, Ge(1)] = 64
    num_layers: Annotated[int, Ge(1)] = 2
    num_heads: Annotated[int, Ge(1)] = 2
    num_kv_heads: Annotated[int, Ge(1)] = 2
    head_dim: Annotated[int, Ge(1)] = 32
    intermediate_size: Annotated[int, Ge(1)] = 128
    vocab_size: Annotated[int, _min(_TOKENIZER_SYMBOLS, " (the char tokenizer's symbols)")] = 96
    tied: bool = True
    init_std: Annotated[float, Gt(0)] = 0.02
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Annotated[str, Check(_is_device, "cpu, cuda or cuda:N")] = "cpu"
    lora: LoraSection = field(default_factory=LoraSection)
    gradient_checkpointing: bool = False


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
    digits: Annotated[int, Check(lambda v: 1 <= v <= 9, "1 to 9")] = 3
    reward: Literal["exact", "partial", "token"] = "partial"
    eval_prompts: Annotated[int, _min(0, " (0 = no evaluation)")] = 0
    eval_every: Annotated[int, _min(0, " (0 = only at the end)")] = 0


@dataclass(frozen=True)
class BackendsConfig:
    """Backend name per role (as listed by ``verl backends``).

    A role left unset runs on ``hf`` (``reward``: the ``rule`` reward), whatever the other roles
    name: a run with ``actor``, ``rollout`` and ``reference`` on another backend and an algorithm
    that needs a critic (``ppo``) builds its critic with ``hf`` unless ``backends.critic`` names
    that backend too. When the roles of a run use more than one backend, the run prints the
    backend of each role as it starts.

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
        offpolicy: Off-policy correction of the actor loss against the rollout engine's log-probs
            (``[algorithm.offpolicy]``: ``mode`` none, tis or mis; ``level`` token, sequence or
            geometric; ``upper``, ``lower``); see
            :class:`~verl_core.algorithms.config.OffPolicyConfig`. Off by default.
    """

    name: str = "grpo"
    options: dict[str, Any] = field(default_factory=dict)
    use_reference: bool = False
    use_critic: bool | None = None
    dynamic_sampling: bool = False
    offpolicy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling parameters of the rollout.

    Attributes:
        n: Samples per prompt (the group size).
        temperature: Sampling temperature.
        top_p: Nucleus threshold.
        top_k: Top-k (0 = off).
        max_new_tokens: Longest response.
        stop_token_ids: Token ids that end a response besides the tokenizer's EOS (kept in the
            response, as EOS is), passed to every rollout call, evaluation included, as
            ``SamplingParams.stop_token_ids``: for example the further EOS ids a folder's
            ``generation_config.json`` lists (Llama 3's), which no rollout stops on by itself.
            Each must be below the model's ``vocab_size``; the rollout backend must declare
            ``stop_token_ids``. Empty (default): responses end at EOS or ``max_new_tokens``.
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
    stop_token_ids: tuple[int, ...] = ()
    sleep: Literal["auto", "always", "never"] = "auto"

    def sampling_params(self, *, seed: int | None = None, n: int | None = None, greedy: bool = False) -> SamplingParams:
        """The rollout's :class:`~verl_core.kernel.rollout.SamplingParams`: ``seed`` each step's,
        ``n`` samples per prompt (default ``self.n``), ``greedy`` for evaluation."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, n=self.n if n is None else n, seed=seed,
                              greedy=greedy, stop_token_ids=self.stop_token_ids)


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

    prompts_per_step: Annotated[int, Ge(1)] = 16
    mini_batch_size: Annotated[int, _min(0, " (0 = whole batch)")] = 0
    epochs: Annotated[int, Ge(1)] = 1
    micro_batch_tokens: Annotated[int, _min(0, " (0 = dynamic)")] = 0
    min_tokens: Annotated[int, Ge(1)] = 64
    max_tokens: Annotated[int, _min(0, " (0 = no cap)")] = 0
    buffer_memory_bytes: Annotated[int, _min(0, " (0 = no bound)")] = 0
    old_log_probs: Literal["auto", "recompute"] = "auto"


@dataclass(frozen=True)
class OptimSection:
    """Optimizer settings of a trainable engine (see :class:`verl_core.OptimConfig`)."""

    lr: Annotated[float, Gt(0)] = 2e-3
    weight_decay: Annotated[float, Ge(0)] = 0.0
    betas: Annotated[tuple[float, float], Check(lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)")] = (0.9, 0.99)
    eps: Annotated[float, Gt(0)] = 1e-8
    warmup_steps: Annotated[int, Ge(0)] = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, Check(lambda v: 0 <= v <= 1, "in [0, 1]")] = 0.0
    grad_clip: Annotated[float, _min(0, " (0 = no clipping)")] = 1.0

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

    every: Annotated[int, _min(0, " (0 = final only)")] = 0
    keep: Annotated[int, Ge(1)] = 2
    final: bool = True


@dataclass(frozen=True)
class AsyncTrainingConfig:
    """Asynchronous training: the next steps' samples are generated while the policy updates.

    Attributes:
        mode: ``sync`` (each step samples from the newest weights) or ``async`` (a producer thread
            generates the samples of up to ``max_staleness`` steps ahead while the trainer updates;
            see :mod:`verl_core.trainer.rl.producer`).
        max_staleness: With ``async``: how many weight versions older than the policy being trained
            a step's samples may be (0 = the synchronous schedule, run by the producer).
        partial_rollouts: With ``async``: what happens to the rollout under way when the weights
            are updated. ``finish`` (default): the weight sync waits until the producer has
            generated every step it was allowed, so each step's samples come from one version and
            the schedule does not depend on timing. ``continue``: the sync waits only for the
            ``generate`` call in flight; the rest (later turns of an episode, later steps) samples
            from the new weights, each turn's versions recorded (``TurnInfo.weight_versions``).
            ``restart``: the sync waits as with ``continue``, but a multi-turn episode whose next
            ``generate`` call comes from another version than its first is abandoned and sampled
            again from its first turn, with a fresh environment, so no episode mixes versions (at
            most ``max_staleness`` restarts an episode, which is as many updates as can land
            while its step is generated); a single-turn rollout behaves as with ``continue``.
            Under ``continue`` and ``restart`` the producer also samples every released step at
            once (up to ``max_staleness + 1``), and a multi-turn run's steps share the rollout's
            generate calls. They need a rollout engine that declares
            ``concurrent_weight_update`` and ``max_staleness >= 1``; a run's numbers then depend
            on timing.
    """

    mode: Literal["sync", "async"] = "sync"
    max_staleness: Annotated[int, Ge(0)] = 1
    partial_rollouts: Literal["finish", "continue", "restart"] = "finish"

    def __post_init__(self) -> None:
        if self.partial_rollouts != "finish" and (self.mode != "async" or self.max_staleness < 1):
            raise ConfigError(
                f"async_training.partial_rollouts={self.partial_rollouts!r} lets rollouts run across a weight update, "
                f"which only happens with mode='async' and max_staleness >= 1; got mode={self.mode!r}, "
                f"max_staleness={self.max_staleness}: set both, or partial_rollouts='finish'")

    @property
    def max_restarts(self) -> int:
        """Times a multi-turn episode may be restarted at a weight update (``max_staleness`` with
        ``partial_rollouts = "restart"``, else 0: see :class:`~verl_core.agent.loop.AgentLoop`)."""
        return self.max_staleness if self.partial_rollouts == "restart" else 0

    @property
    def lookahead(self) -> int:
        """Steps the rollout may run ahead of the update (0 in ``sync`` mode)."""
        return self.max_staleness if self.mode == "async" else 0


@dataclass(frozen=True)
class LoggingConfig(SinkConfig):
    """What the run reports: the metric sinks and their settings (the fields and rules of
    :class:`~verl_core.trainer.sinks.SinkConfig`, declared there once), a progress bar and a plot.

    Attributes:
        sinks: Where every step's metrics go: ``jsonl`` (``<output_dir>/metrics.jsonl``),
            ``tensorboard``, ``wandb``, and callbacks named ``module:attr`` or
            ``path/to/file.py:attr`` (see :mod:`verl_core.trainer.sinks`); empty = none.
        wandb_project: The W&B project (``wandb`` sink).
        wandb_mode: ``offline`` (files under the run folder, no network), ``online`` or ``disabled``.
        tensorboard_dir: Folder of TensorBoard's event files; empty = ``<output_dir>/tensorboard``.
        progress: A progress bar with the live reward on stderr.
        plot: A PNG of the curves at the end (needs the ``plot`` extra: matplotlib).
    """

    progress: bool = True
    plot: bool = True


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
        reward_model: Folder of the reward model (empty = the policy model), the folder the reward
            engine of ``backends.reward`` is built on (which must then name a backend, not ``rule``). The
            ``hf`` backend needs a trained sequence-classification model here (it refuses a
            causal-LM folder such as the policy's). With the local executor it must be an
            existing folder, checked before the output folder is claimed.
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
        async_training: Rollout ahead of the update, with a bound on the samples' staleness.
        logging: Reporting.
        max_consecutive_skips: Optimizer steps in a row skipped for a non-finite loss or gradient
            (on any rank, actor or critic) after which the run writes a checkpoint and stops with
            TrainingDivergedError; 0 = never stop.
        executor: Where engines run: ``local`` (this process) or ``ray`` (Ray worker groups).
        ray: Placement and resources of the ``ray`` executor.
    """

    steps: Annotated[int, Ge(1)] = 100
    seed: Annotated[int, Check(_is_seed, f"0 to {_SEEDS - 1}")] = 0
    output_dir: Annotated[str, Check(bool, "a non-empty path")] = "runs/verl"
    overwrite: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    critic_model: str = ""
    reward_model: str = ""
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
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    max_consecutive_skips: Annotated[int, _min(0, " (0 = never stop)")] = 5
    executor: ExecutorName = "local"
    ray: RayConfig = field(default_factory=RayConfig)


# ---------------------------------------------------------------------------- rules


def _check_rollout(cfg: RunConfig) -> None:
    """The rollout section is checked by SamplingParams itself: one rule for sampling parameters."""
    try:
        cfg.rollout.sampling_params()
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


def _check_async(cfg: RunConfig) -> None:
    """The rollout must be able to run while the update does: not in the training engines' own Ray workers."""
    if cfg.async_training.mode == "async" and cfg.executor == "ray" and cfg.ray.placement == "colocated":
        raise ConfigError(
            "config key 'async_training.mode' = 'async' generates the next steps' samples while the policy "
            "updates, but 'ray.placement' = 'colocated' puts the rollout in the training engines' worker "
            "processes, which run one call at a time, so the two could never overlap; set ray.placement = "
            "\"split\" (the rollout in worker processes of its own) or async_training.mode = \"sync\""
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


def _check_reward_model(cfg: RunConfig) -> None:
    if cfg.reward_model and cfg.backends.reward == "rule":
        raise ConfigError(
            f"config key 'reward_model' = {cfg.reward_model!r} names a reward model, but 'backends.reward' = 'rule' "
            "builds no reward-model engine (the reward is reward.functions or the task's rule); set backends.reward "
            "to a backend with a reward engine (e.g. \"hf\"), or leave reward_model empty"
        )


def _check_lora(cfg: RunConfig) -> None:
    if cfg.model.lora.enabled and cfg.model.lora.sync == "adapter" and cfg.executor != "local":
        raise ConfigError(
            f"config key 'model.lora.sync' = 'adapter' needs 'executor' = 'local' (it is {cfg.executor!r}): adapter "
            "streams are not carried between Ray worker groups; use 'merged'"
        )


# Checks that involve several keys, run in order after every single-key rule passed.
_CHECKS: tuple[Callable[[RunConfig], None], ...] = (
    _check_rollout, _check_tokens, _check_agent, _check_async, _check_model_shape, _check_lora, _check_reward_model,
)


# ---------------------------------------------------------------------------- building
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
    cfg = build(RunConfig, data)
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


def is_file(path: str | Path) -> bool:
    """Whether ``path`` names a file; False for a name the system refuses (too long, a NUL byte)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file into nested mappings.

    Raises:
        ConfigError: the file is missing or unreadable, not UTF-8, not valid TOML/YAML (naming the
            line), of another format, or (YAML) not a table at the top level.
    """
    p = Path(path)
    where = f"config file {str(path)!r}"
    if not is_file(p):
        try:
            folder = p.is_dir()
        except (OSError, ValueError) as e:  # a name the system refuses: too long, a NUL byte
            raise ConfigError(f"{where} cannot be a file name: {getattr(e, 'strerror', None) or e}") from None
        raise ConfigError(f"{where} is a folder, not a file" if folder else f"{where} does not exist")
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
