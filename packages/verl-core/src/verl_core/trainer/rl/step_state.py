"""The typed data of one RL step, passed from stage to stage (architecture.md, "One RL step as data flow").

:class:`StepState` starts with the step's prompts and sampling parameters; each stage reads the
fields it needs and sets the ones it makes. A field is a :class:`Slot`: reading it before the
stage that sets it has run, or setting it to a value of the wrong type, raises a
:class:`StepStateError` naming the field, the stage and what was expected, so a stage run out of
order fails at once with a clear message instead of an ``AttributeError`` or a wrong tensor.

:class:`RunProgress` holds the counters the components of one trainer share (step, weight version,
non-finite skips in a row, the stage running outside the pipeline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar, overload

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import VerlError, describe
from verl_core.kernel.rollout import SamplingParams

__all__ = ["RunProgress", "Slot", "StepState", "StepStateError"]

T = TypeVar("T")
_NONE = type(None)


class StepStateError(VerlError, RuntimeError):
    """A field of a :class:`StepState` was read before its stage ran, or set to a value of the wrong type."""


class Slot(Generic[T]):
    """A checked field of :class:`StepState`, set once its stage has run.

    Args:
        kinds: The types a value may have (``type(None)`` among them for an optional output).
        set_by: The stage that sets the field, named in the error of an early read.
    """

    def __init__(self, kinds: type | tuple[type, ...], set_by: str) -> None:
        self.kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        self.set_by = set_by
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Slot[T]: ...

    @overload
    def __get__(self, obj: StepState, owner: type | None = None) -> T: ...

    def __get__(self, obj: StepState | None, owner: type | None = None) -> Slot[T] | T:
        if obj is None:
            return self
        try:
            value: T = obj.__dict__[self.name]
        except KeyError:
            raise StepStateError(
                f"step {obj.step + 1}: field {self.name!r} of the step state was read before stage "
                f"{self.set_by!r}, which sets it, ran; run the stages in the order of the step "
                "(rollout -> reward -> forwards -> advantages -> update -> weight sync)"
            ) from None
        return value

    def __set__(self, obj: StepState, value: T) -> None:
        if not isinstance(value, self.kinds):
            expected = " or ".join("None" if k is _NONE else k.__name__ for k in self.kinds)
            raise StepStateError(
                f"step {obj.step + 1}: stage {self.set_by!r} set field {self.name!r} of the step state to "
                f"{describe(value)}; expected {expected}"
            )
        obj.__dict__[self.name] = value


_Tensor = Slot[torch.Tensor]
_MaybeTensor = Slot["torch.Tensor | None"]


@dataclasses.dataclass(eq=False)
class StepState:
    """One RL step's data: the prompts, then what each stage adds.

    Attributes:
        step: The 0-based index of the step (its metrics say ``step + 1``).
        prompts: The step's prompt batch.
        params: The step's sampling parameters.
        metrics: The step's metrics, filled by the stages.
        timings: Seconds per stage (``time/<stage>``).
        samples: The rollout's responses (set by ``rollout``).
        scores: One score per response (``reward``).
        token_scores: Dense per-token scores, or None (``reward``).
        reward_terms: ``reward/<function>/mean`` of each reward function (``reward``).
        baseline: The greedy response's score per sample, ReMax only (``baseline``).
        batch: The samples kept for the update, with their scores (``select``); DAPO's dynamic
            sampling may keep fewer.
        dropped_groups: Groups dropped by dynamic sampling (``select``).
        ref_log_probs: The reference's log-probs, or None without a reference (``reference``).
        old_log_probs: The actor's log-probs, or None for an empty batch (``actor_forward``).
        entropy: The actor's entropy, or None for an empty batch (``actor_forward``).
        values: The critic's values, or None without a critic (``critic_forward``).
        train_batch: ``batch`` with the forwards' outputs and the advantages (``advantages``).
        update: Metrics of the optimizer steps (``update``).
        sync_bytes: Bytes the weight sync sent (``weight_sync``).
    """

    step: int
    prompts: TensorBatch
    params: SamplingParams
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    samples = Slot[TensorBatch](TensorBatch, "rollout")
    scores = _Tensor(torch.Tensor, "reward")
    token_scores = _MaybeTensor((torch.Tensor, _NONE), "reward")
    reward_terms = Slot[Mapping[str, float]](dict, "reward")
    baseline = _Tensor(torch.Tensor, "baseline")
    batch = Slot[TensorBatch](TensorBatch, "select")
    dropped_groups = Slot[int](int, "select")
    ref_log_probs = _MaybeTensor((torch.Tensor, _NONE), "reference")
    old_log_probs = _MaybeTensor((torch.Tensor, _NONE), "actor_forward")
    entropy = _MaybeTensor((torch.Tensor, _NONE), "actor_forward")
    values = _MaybeTensor((torch.Tensor, _NONE), "critic_forward")
    train_batch = Slot[TensorBatch](TensorBatch, "advantages")
    update = Slot[Mapping[str, float]](dict, "update")
    sync_bytes = Slot[int](int, "weight_sync")

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Record the seconds of a ``with`` block as ``timings["time/<stage>"]``."""
        t = time.perf_counter()
        yield
        self.timings[f"time/{stage}"] = time.perf_counter() - t

    def has(self, name: str) -> bool:
        """Whether the field ``name`` was set."""
        return name in self.__dict__

    def fill(self, outputs: Mapping[str, Any]) -> None:
        """Set the fields named by ``outputs`` (a pipeline's outputs); each is checked.

        Raises:
            StepStateError: an output is no field of the step state, or has the wrong type.
        """
        for name, value in outputs.items():
            if not isinstance(getattr(type(self), name, None), Slot):
                raise StepStateError(f"step {self.step + 1}: {name!r} is not a field of the step state")
            setattr(self, name, value)


@dataclasses.dataclass
class RunProgress:
    """The counters shared by the components of one trainer.

    Attributes:
        step: Steps completed.
        weight_version: Weight syncs done (the rollout samples from this version).
        consecutive_skips: Optimizer steps skipped in a row for a non-finite loss or gradient.
        stage: The stage running outside the pipeline, named when it fails.
    """

    step: int = 0
    weight_version: int = 0
    consecutive_skips: int = 0
    stage: str = "prompts"
