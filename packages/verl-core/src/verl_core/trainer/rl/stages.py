"""The stages of one RL step, declared once: name, what each reads, what it adds, which engine runs it.

:data:`STAGES` is the one list of an RL step's stages (architecture.md, "One RL step as data flow").
The generation pipeline is built from it (:class:`~verl_core.trainer.rl.generation.GenerationStage`
gives each declared stage its function), a failed step names the backend of its stage from it
(:func:`stage_backend`), and the step state's early-read errors name the stage that produces a
field from it (:func:`producer`). The step's data travels in its batch: the forwards' outputs are
fields of the batch, added in one place (:meth:`StepState.add_fields
<verl_core.trainer.rl.step_state.StepState.add_fields>`), never kept beside it.

Adding a stage to the generation half of the step: its :class:`StageSpec` here, its function in
:mod:`verl_core.trainer.rl.generation`, and its entry in docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from verl_core.trainer.config import RunConfig

__all__ = ["GENERATION", "STAGES", "Role", "StageSpec", "is_forward", "producer", "stage_backend"]

Role = Literal["rollout", "reward", "reference", "actor", "critic", "sync", "trainer"]


@dataclass(frozen=True)
class StageSpec:
    """One stage of the RL step.

    Attributes:
        name: The stage's name (``time/<name>`` in the metrics, named by a failed step's error).
        role: The engine that runs it (its backend is named when the stage fails); ``trainer`` for
            the trainer's own work.
        reads: The values of the step it reads: ``prompts``, ``samples`` (the rollout's responses,
            scored), ``batch`` (the samples kept for the update), or values other stages add.
        adds: What it produces: batch fields (e.g. ``old_log_probs``, added to the step's batch)
            or values of the step (``samples``, ``batch``, ``keep``; ``reward_terms`` metrics).
        fields: The subset of ``adds`` that are fields of the step's batch (added by one ``update``).
        after: Stages that must finish first although no value flows between them.
    """

    name: str
    role: Role
    reads: tuple[str, ...] = ()
    adds: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


#: The generation half of the step, in graph order: the pipeline runs each stage as soon as what it reads is there.
GENERATION: Final[tuple[StageSpec, ...]] = (
    StageSpec("rollout", "rollout", ("prompts",), ("responses",)),
    StageSpec("baseline", "rollout", ("prompts",), ("baseline_scores",), after=("rollout",)),  # ReMax's greedy baseline
    StageSpec("reward", "reward", ("responses",), ("samples", "reward_terms")),
    # DAPO dynamic sampling: the kept rows (``keep``, None = all) are chosen once, here
    StageSpec("select", "trainer", ("samples",), ("batch", "keep", "dropped_groups")),
    StageSpec("reference", "reference", ("batch",), ("ref_log_probs",), fields=("ref_log_probs",)),
    StageSpec("actor_forward", "actor", ("batch",), ("old_log_probs", "entropy"), fields=("old_log_probs", "entropy")),
    StageSpec("critic_forward", "critic", ("batch",), ("values", "old_values"), fields=("values", "old_values")),
)

#: Every stage of the step, in order; the update half runs on the trainer's thread.
STAGES: Final[tuple[StageSpec, ...]] = (
    StageSpec("prompts", "trainer", (), ("prompts",)),
    *GENERATION,
    StageSpec("advantages", "trainer", ("batch",), ("advantages", "returns"), fields=("advantages", "returns")),
    StageSpec("actor_update", "actor", ("batch",)),
    StageSpec("critic_update", "critic", ("batch",)),
    StageSpec("weight_sync", "sync"),
    StageSpec("evaluation", "rollout"),
    StageSpec("logging", "trainer"),  # the step's metrics to the sinks
)

_BY_NAME: Final = {s.name: s for s in STAGES}


def is_forward(spec: StageSpec) -> bool:
    """Whether ``spec`` is a forward of the kept batch (it runs with the current training weights)."""
    return "batch" in spec.reads


def producer(value: str) -> str:
    """The stage that adds ``value`` (a value of the step or a batch field); ``""`` when none does."""
    return next((s.name for s in STAGES if value in s.adds), "")


def stage_backend(config: RunConfig, stage: str) -> str:
    """The backend that runs ``stage`` of a step, as a failed step's error names it."""
    b = config.backends
    spec = _BY_NAME.get(stage)
    if spec is None or spec.role == "trainer":
        return "trainer"
    if spec.role == "reward" and config.reward.functions:
        return "reward.functions" + (f" + {b.reward}" if b.reward != "rule" else "")
    if spec.role == "reference" and config.model.lora.enabled:
        return f"{b.actor} (base of the LoRA actor)"
    if spec.role == "sync":
        return f"{b.actor} -> {b.rollout}"
    return str(getattr(b, spec.role))
