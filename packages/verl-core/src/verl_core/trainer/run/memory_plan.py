"""The run's memory plan: what every engine of an RL run keeps on the device, checked before any model loads.

:func:`plan_memory` counts, from the policy folder's ``config.json`` (its parameter count,
:class:`~verl_core.trainer.batching.budget.ModelShape`, without loading weights), the run config
and the device's total memory (:func:`verl_core.kernel.memory.device_memory`), the bytes of:

* the actor: weights (model dtype), float32 master weights (``master_weights``, below float32),
  gradients (float32 on the masters at the optimizer step, else the model dtype) and AdamW's two
  moments (float32 with masters or in float32, else the model dtype, as torch's AdamW keeps them)
  (:class:`~verl_core.trainer.batching.budget.TrainedState`); with ``model.lora`` the frozen base's
  weights and those four for the adapter's parameters only (:func:`lora_parameters`);
* the critic (its own folder's shape) alike, a colocated reference policy (none with
  ``model.lora``: the reference is the actor's base) and reward model (weights; the shape of
  ``reward_model`` when set, else the policy's);
* the rollout engine's copy of the weights (its adapter only where an hf rollout takes an hf LoRA
  actor's adapter sync: it serves the actor's frozen base), its KV cache (rows x prompt + new tokens x layers x
  keys and values; the vLLM backend's ``kv_cache_bytes``) and its sampling working set;
* the update's activations for at least one sequence, checkpointed under
  ``model.gradient_checkpointing`` (the micro-batch scheduler fills what is left:
  :mod:`verl_core.trainer.batching.budget`).

Each term is on the device in the update, in the rollout, or in both: the rollout's copy and KV
cache are not there during the update when the rollout sleeps (``rollout.sleep`` ``auto`` or
``always``), gradients and activations only in the update. The plan's peak is the larger phase.

The choice: the plan as configured when its peak is within :data:`FILL_LIMIT` of the device;
else, when float32 master weights are what does not fit, the same plan in pure bfloat16/float16
(``master_weights=False`` for the actor and critic), said in a warning line and the
``memory_plan/master_weights_dropped`` metric, never silently; a plan over :data:`FILL_LIMIT` but
within :data:`REFUSE_ABOVE` runs with a warning; a plan above :data:`REFUSE_ABOVE` of the device
is refused before any model loads (:class:`~verl_core.kernel.errors.ConfigError` with the
figures and the options that would fit).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from verl_core.enginekit.sampling import static_prompt_width
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.memory import device_memory
from verl_core.trainer.batching.budget import (
    DTYPE_BYTES,
    ModelShape,
    TrainedState,
    estimate_token_bytes,
    lora_parameters,
)
from verl_core.trainer.config import RunConfig

__all__ = ["FILL_LIMIT", "REFUSE_ABOVE", "MemoryPlan", "MemoryTerm", "lora_parameters", "plan_memory",
           "plan_run_memory"]

_log = logging.getLogger(__name__)

FILL_LIMIT: Final = 0.85
"""Share of the device a plan may fill and still run as configured (the CUDA context, cuBLAS
workspaces, the allocator's fragmentation and the micro-batches' room take the rest; the same share
as the rollout's sleep policy)."""

REFUSE_ABOVE: Final = 0.95
"""Share of the device above which a plan is refused before loading the model."""

_MASTER_BACKENDS: Final = ("hf", "megatron")
"""Training backends whose ``master_weights`` option the plan may turn off."""

_SAMPLING_BYTES: Final = 28
"""Bytes per row and vocabulary entry of a decode step's sampling: float32 logits, log-softmax and
probabilities, and the float64 two-level CDF of the inverse-CDF draw."""

_FLOAT32: Final = 4
_GB: Final = 1e9

Phase = Literal["update", "rollout"]
_BOTH: Final[frozenset[Phase]] = frozenset(("update", "rollout"))
_UPDATE: Final[frozenset[Phase]] = frozenset(("update",))
_ROLLOUT: Final[frozenset[Phase]] = frozenset(("rollout",))


@dataclass(frozen=True)
class MemoryTerm:
    """One line of the plan.

    Attributes:
        what: What the bytes hold (``actor weights``).
        nbytes: How many.
        how: How they were counted.
        phases: When they are on the device: the update, the rollout, or both.
    """

    what: str
    nbytes: int
    how: str
    phases: frozenset[Phase]


@dataclass(frozen=True)
class MemoryPlan:
    """The memory an RL run's engines keep on one device, and the choice made from it.

    Attributes:
        device: The device planned for.
        total_bytes: Its total memory.
        terms: Every term of the chosen plan.
        master_weights: Whether the actor (and critic) step float32 master weights.
        dropped_masters: Float32 masters were asked for but do not fit: the plan runs without them.
        configured_peak: Peak bytes of the plan as configured (equals :attr:`peak_bytes` when it
            was kept).
        options: Backend options the plan sets, by role (``{"actor": {"master_weights": False}}``).
        notes: Warnings of the plan (a tight fit, masters dropped), each one line.
        dtype: The model dtype.
    """

    device: str
    total_bytes: int
    terms: tuple[MemoryTerm, ...]
    master_weights: bool
    dropped_masters: bool = False
    configured_peak: int = 0
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    dtype: str = "bfloat16"

    def phase_bytes(self, phase: Phase) -> int:
        """Bytes on the device during ``phase``."""
        return sum(t.nbytes for t in self.terms if phase in t.phases)

    @property
    def peak_bytes(self) -> int:
        """The larger phase."""
        return max(self.phase_bytes("update"), self.phase_bytes("rollout"))

    @property
    def share(self) -> float:
        """The peak as a share of the device."""
        return self.peak_bytes / self.total_bytes if self.total_bytes else math.inf

    @property
    def fits(self) -> bool:
        """Within :data:`REFUSE_ABOVE` of the device."""
        return self.share <= REFUSE_ABOVE

    def table(self, *, notes: bool = True) -> str:
        """The plan as a text table: each term, when it is on the device, the phase totals and the
        device (and its warnings, with ``notes``)."""
        rows = [(t.what, _gb(t.nbytes), "+".join(p for p in ("rollout", "update") if p in t.phases), t.how)
                for t in self.terms]
        rows += [("= rollout phase", _gb(self.phase_bytes("rollout")), "", ""),
                 ("= update phase", _gb(self.phase_bytes("update")), "", ""),
                 (f"device {self.device}", _gb(self.total_bytes), "",
                  f"peak {self.share:.0%} of it (limit {FILL_LIMIT:.0%}, refused above {REFUSE_ABOVE:.0%})")]
        width = max(len(r[0]) for r in rows)
        how = ("float32 master weights" if self.master_weights
               else "float32" if self.dtype == "float32" else f"pure {self.dtype}, no master weights")
        lines = [f"memory plan ({how}):"]
        lines += [f"  {a:<{width}}  {b:>9}  {c:<14} {d}".rstrip() for a, b, c, d in rows]
        return "\n".join(lines + [f"  {n}" for n in self.notes if notes])

    def metrics(self) -> dict[str, float]:
        """``memory_plan/*``: the planned peak and device size (GB), master weights and whether they were dropped."""
        return {
            "memory_plan/peak_gb": self.peak_bytes / _GB,
            "memory_plan/device_gb": self.total_bytes / _GB,
            "memory_plan/master_weights": float(self.master_weights),
            "memory_plan/master_weights_dropped": float(self.dropped_masters),
        }

    def apply(self, config: RunConfig) -> RunConfig:
        """``config`` with the backend options the plan sets (the config engines are built from)."""
        if not self.options:
            return config
        tables = {role: dict(table) for role, table in config.backends.options.items()}
        for role, opts in self.options.items():
            tables.setdefault(role, {}).update(opts)
        return dataclasses.replace(config, backends=dataclasses.replace(config.backends, options=tables))


def _gb(n: int) -> str:
    return f"{n / _GB:,.1f} GB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


@dataclass(frozen=True)
class _Trainable:
    """A trained role's state bytes, by term: ``trained`` parameters with their gradients, masters and
    moments, and ``frozen`` ones (a LoRA base) with their weights only."""

    role: str
    trained: int
    dtype: str
    masters: bool
    frozen: int = 0

    def terms(self) -> list[MemoryTerm]:
        n = self.trained
        part = TrainedState.of(self.dtype, master_weights=self.masters)
        p = f"{_count(n)} {'adapter ' if self.frozen else ''}params"
        role = f"{self.role} adapter" if self.frozen else self.role
        out = []
        if self.frozen:
            out.append(MemoryTerm(f"{self.role} weights (frozen base)", self.frozen * part.weights,
                                  f"{_count(self.frozen)} params x {part.weights} B ({self.dtype})", _BOTH))
        out.append(MemoryTerm(f"{role} weights", n * part.weights, f"{p} x {part.weights} B ({self.dtype})", _BOTH))
        if part.masters:
            out.append(MemoryTerm(f"{role} float32 masters", n * part.masters, f"{p} x {part.masters} B", _BOTH))
            out.append(MemoryTerm(f"{role} gradients", n * part.step_grads,
                                  f"{p} x {part.step_grads} B (on the masters at the optimizer step)", _UPDATE))
        else:
            out.append(MemoryTerm(f"{role} gradients", n * part.step_grads, f"{p} x {part.step_grads} B", _UPDATE))
        out.append(MemoryTerm(f"{role} AdamW moments", n * part.moments, f"{p} x 2 x {part.moments // 2} B", _BOTH))
        return out


def _masters_asked(config: RunConfig, role: str) -> bool:
    return bool(config.backends.options.get(role, {}).get("master_weights", True)) and config.model.dtype != "float32"


def _can_drop_masters(config: RunConfig, role: str) -> bool:
    backend = getattr(config.backends, role)
    opts = config.backends.options.get(role, {})
    return backend in _MASTER_BACKENDS and opts.get("optimizer", "torch") != "megatron"


def _awake_in_update(config: RunConfig) -> bool:
    """Whether the rollout engine stays on the device during the update (never sleeps, or samples ahead)."""
    return config.rollout.sleep == "never" or config.async_training.lookahead > 0


def _rollout_terms(config: RunConfig, shape: ModelShape, max_prompt_len: int) -> list[MemoryTerm]:
    """The rollout engine's weights, KV cache and sampling working set."""
    d = DTYPE_BYTES[config.model.dtype]
    # a sleeping rollout is on the host in the update; an asynchronous one samples during it
    awake = _BOTH if _awake_in_update(config) else _ROLLOUT
    n = shape.parameters
    lora = config.model.lora
    if lora.enabled and lora.sync == "adapter" and config.backends.actor == config.backends.rollout == "hf":
        # the colocated hf rollout serves the actor's frozen base (HFRolloutEngine.share_base)
        a = lora_parameters(shape, lora)
        out = [MemoryTerm("rollout adapter weights", a * _FLOAT32,
                          f"{_count(a)} adapter params x {_FLOAT32} B (the base is the actor's: adapter sync)",
                          awake)]
    else:
        out = [MemoryTerm("rollout weights", n * d, f"{_count(n)} params x {d} B", awake)]
    opts = config.backends.options.get("rollout", {})
    rows = config.batch.prompts_per_step * config.rollout.n
    if config.backends.rollout == "vllm":
        kv = int(opts.get("kv_cache_bytes", 256 * 2**20))
        out.append(MemoryTerm("rollout KV cache", kv, "backends.options.rollout.kv_cache_bytes", awake))
        return out
    at_once = min(rows, int(opts.get("rollout_batch_size") or rows))
    length = static_prompt_width(max_prompt_len) + config.rollout.max_new_tokens
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * d
    out.append(MemoryTerm("rollout KV cache", at_once * length * per_token,
                          f"{at_once} rows x {length} tokens x {shape.num_layers} layers x 2 x "
                          f"{shape.num_kv_heads * shape.head_dim} x {d} B", awake))
    out.append(MemoryTerm("rollout sampling", at_once * shape.vocab_size * _SAMPLING_BYTES,
                          f"{at_once} rows x vocab {shape.vocab_size} x {_SAMPLING_BYTES} B", awake))
    return out


def _terms(config: RunConfig, shape: ModelShape, critic: ModelShape | None, *, masters: bool, max_prompt_len: int,
           use_reference: bool, reward: ModelShape | None = None) -> list[MemoryTerm]:
    dtype = config.model.dtype
    d = DTYPE_BYTES[dtype]
    n = shape.parameters
    lora = config.model.lora
    actor_masters = masters and _masters_asked(config, "actor")
    if lora.enabled:  # the base is frozen; the reference is the actor with its adapter disabled
        trained = lora_parameters(shape, lora)
        terms = _Trainable("actor", trained, dtype, actor_masters, frozen=n).terms()
    else:
        terms = _Trainable("actor", n, dtype, actor_masters).terms()
    if critic is not None:
        terms += _Trainable("critic", critic.parameters, dtype, masters and _masters_asked(config, "critic")).terms()
    if use_reference and not lora.enabled:
        terms.append(MemoryTerm("reference weights", n * d, f"{_count(n)} params x {d} B", _BOTH))
    if config.backends.reward != "rule":
        r = (reward or shape).parameters
        whose = "reward_model's" if reward is not None else "the policy's"
        terms.append(MemoryTerm("reward model weights", r * d, f"{_count(r)} params x {d} B ({whose} shape)", _BOTH))
    terms += _rollout_terms(config, shape, max_prompt_len)
    est = estimate_token_bytes(shape, dtype, gradient_checkpointing=config.model.gradient_checkpointing)
    fixed = config.batch.micro_batch_tokens
    tokens = fixed or (max_prompt_len + config.rollout.max_new_tokens)
    what = (f"batch.micro_batch_tokens {tokens}" if fixed
            else f"at least one sequence of {tokens} tokens (the floor; the scheduler sizes micro-batches to "
                 "the memory left once the run has started)")
    terms.append(MemoryTerm("update activations", tokens * est.bytes_per_token,
                            f"{what} x {est.bytes_per_token:,} B/token", _UPDATE))
    return terms


def plan_memory(
    config: RunConfig, model_path: str, *, max_prompt_len: int, use_reference: bool, use_critic: bool,
    total_bytes: int | None = None,
) -> MemoryPlan | None:
    """The memory plan of an RL run on ``config.model.device`` (see the module docstring).

    Args:
        config: The run.
        model_path: The policy's folder (its ``config.json`` is read; no weights are loaded).
        max_prompt_len: The longest prompt the engines are built for.
        use_reference: A reference policy is built.
        use_critic: A critic is built (from ``config.critic_model`` when set).
            The reward model (``backends.reward`` other than ``rule``) is counted with the shape of
            ``config.reward_model`` when set.
        total_bytes: The device's total memory (default: :func:`~verl_core.kernel.memory.device_memory`).

    Returns:
        The chosen plan (check :attr:`MemoryPlan.fits`), or None when the folder has no
        transformers ``config.json`` with the sizes the plan needs.
    """
    shape = ModelShape.from_model_folder(model_path)
    if shape is None:
        return None
    critic: ModelShape | None = None
    if use_critic:
        critic = ModelShape.from_model_folder(config.critic_model) if config.critic_model else shape
        critic = critic or shape
    # the reward model's folder when set (None: unreadable or unset, the policy's shape is assumed)
    reward = ModelShape.from_model_folder(config.reward_model) if config.reward_model else None
    device = config.model.device
    total = device_memory(device)[1] if total_bytes is None else total_bytes
    asked = any(_masters_asked(config, r) for r in ("actor", "critic") if r == "actor" or use_critic)

    def build(masters: bool) -> MemoryPlan:
        terms = _terms(config, shape, critic, masters=masters, max_prompt_len=max_prompt_len,
                       use_reference=use_reference, reward=reward)
        return MemoryPlan(device, total, tuple(terms), master_weights=masters and asked, dtype=config.model.dtype)

    configured = build(True)
    chosen = configured
    droppable = asked and all(_can_drop_masters(config, r) for r in ("actor", "critic") if r == "actor" or use_critic)
    if configured.share > FILL_LIMIT and droppable:
        pure = build(False)
        roles = ("actor", "critic") if use_critic else ("actor",)
        if not configured.fits and not pure.fits:  # refused either way: the smaller plan is the one to report
            chosen = dataclasses.replace(pure, dropped_masters=True, options={r: {"master_weights": False} for r in roles})
        elif pure.share <= FILL_LIMIT or not configured.fits:
            note = (f"WARNING: float32 master weights do not fit: the plan needs {_gb(configured.peak_bytes)} "
                    f"({configured.share:.0%} of {_gb(total)} on {device}, limit {FILL_LIMIT:.0%}); training in "
                    f"pure {config.model.dtype} instead ({_gb(pure.peak_bytes)}, {pure.share:.0%}): "
                    f"{', '.join(f'backends.options.{r}.master_weights=false' for r in roles)}. Updates smaller "
                    f"than {config.model.dtype}'s spacing are rounded away; set them false yourself to silence "
                    "this, or give the run more memory to keep the masters")
            chosen = dataclasses.replace(pure, dropped_masters=True, options={r: {"master_weights": False} for r in roles},
                                         notes=(note,))
    if chosen.fits and chosen.share > FILL_LIMIT:
        note = (f"WARNING: the plan fills {chosen.share:.0%} of {device} ({_gb(chosen.peak_bytes)} of "
                f"{_gb(total)}), above {FILL_LIMIT:.0%}: the micro-batch scheduler has little room and "
                "the allocator may stall or run out of memory")
        chosen = dataclasses.replace(chosen, notes=(*chosen.notes, note))
    return dataclasses.replace(chosen, configured_peak=configured.peak_bytes)


def _alternatives(config: RunConfig, plan: MemoryPlan, shape_plan: Callable[[RunConfig], MemoryPlan]) -> list[str]:
    """What would bring ``plan`` under the limit, each with its figure (``shape_plan``: the plan of
    another config of the same run) where one can be given."""
    usable = REFUSE_ABOVE * plan.total_bytes
    out: list[str] = []
    if not config.model.lora.enabled and config.backends.actor == "hf":
        lora = shape_plan(dataclasses.replace(config, model=dataclasses.replace(
            config.model, lora=dataclasses.replace(config.model.lora, enabled=True))))
        out.append(f"model.lora.enabled=true: train a LoRA adapter of rank {config.model.lora.rank} (the frozen "
                   f"base has no gradients, masters or AdamW moments; the reference is the base: "
                   f"{_gb(lora.peak_bytes)}{'' if lora.fits else ', still too much'})")
    if plan.master_weights and _can_drop_masters(config, "actor"):
        pure = shape_plan(dataclasses.replace(config, backends=dataclasses.replace(config.backends, options={
            **config.backends.options, "actor": {**config.backends.options.get("actor", {}), "master_weights": False}})))
        out.append(f"backends.options.actor.master_weights=false: pure {config.model.dtype} "
                   f"({_gb(pure.peak_bytes)}{'' if pure.fits else ', still too much'})")
    if config.async_training.lookahead > 0:
        out.append("async_training.max_staleness=0: the rollout samples no step ahead, so it can sleep during the update")
    elif config.rollout.sleep == "never":
        out.append("rollout.sleep='auto': the rollout's weights and KV cache leave the device during the update")
    kv = sum(t.nbytes for t in plan.terms if t.what == "rollout KV cache")
    if plan.phase_bytes("rollout") >= plan.phase_bytes("update") and kv > 0.1 * plan.peak_bytes:
        out.append(f"a smaller rollout batch (backends.options.rollout.rollout_batch_size): its KV cache is {_gb(kv)}")
    state = sum(t.nbytes for t in plan.terms if t.what.startswith(("actor", "critic")))
    rest = plan.peak_bytes - state
    if usable > rest > 0:
        gpus = max(2, math.ceil(state / (usable - rest)))
        out.append(f"more devices: executor='ray' with ray.parallel.actor = {{dp = {gpus}}} or more (FSDP2 shards "
                   f"the actor's {_gb(state)} of weights, gradients and optimizer state over the ranks)")
    if config.backends.actor == "megatron" and plan.phase_bytes("rollout") >= plan.phase_bytes("update"):
        out.append("backends.options.actor.during_rollout='offload': the actor's optimizer state and gradients "
                   "move to host memory while the rollout runs")
    out.append("a smaller model, or a device with more memory")
    return out


def plan_run_memory(
    config: RunConfig, model_path: str, *, max_prompt_len: int, use_reference: bool, use_critic: bool,
    say: Callable[[str], None] | None = None, total_bytes: int | None = None,
) -> MemoryPlan | None:
    """Plan the run's memory before any engine is built: print the table, refuse what cannot fit.

    Planned for the local executor only (Ray workers have devices of their own). The table goes
    to ``say`` (default: this module's logger at INFO), each warning of the plan to this module's
    logger at WARNING (shown on stderr without any logging set-up).

    Returns:
        The chosen plan (its :meth:`~MemoryPlan.apply` gives the config the engines are built from),
        or None when nothing was planned.

    Raises:
        ConfigError: the plan needs more than :data:`REFUSE_ABOVE` of the device; the message
            gives the table and the options that would fit.
    """
    if config.executor != "local":
        _log.info("memory plan: not made (executor=%r: the engines run on their workers' devices)", config.executor)
        return None
    plan = plan_memory(config, model_path, max_prompt_len=max_prompt_len, use_reference=use_reference,
                       use_critic=use_critic, total_bytes=total_bytes)
    if plan is None:
        _log.info("memory plan: not made (%s has no transformers config.json with the model's sizes)", model_path)
        return None
    if not plan.fits:

        def again(other: RunConfig) -> MemoryPlan:
            got = plan_memory(other, model_path, max_prompt_len=max_prompt_len, use_reference=use_reference,
                              use_critic=use_critic, total_bytes=plan.total_bytes)
            assert got is not None
            return got

        options = "\n".join(f"  - {a}" for a in _alternatives(config, plan, again))
        without = (f" even without float32 master weights (with them: {_gb(plan.configured_peak)})"
                   if plan.dropped_masters else "")
        raise ConfigError(
            f"the run does not fit on {plan.device}: its engines need {_gb(plan.peak_bytes)} at the peak{without}, "
            f"{plan.share:.0%} of the device's {_gb(plan.total_bytes)} (refused above {REFUSE_ABOVE:.0%}, before "
            f"loading the model).\n{plan.table()}\nOptions that reduce it:\n{options}"
        )
    (say or _log.info)(plan.table(notes=False))
    for note in plan.notes:  # a logged warning: shown whatever the progress settings, never silent
        _log.warning(note.removeprefix("WARNING: "))
    return plan
