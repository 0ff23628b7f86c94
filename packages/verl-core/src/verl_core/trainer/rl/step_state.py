"""The typed data of one RL step, passed from stage to stage (architecture.md, "One RL step as data flow").

:class:`StepState` starts with the step's prompts and sampling parameters; the step's tensors then
travel in two batches, ``samples`` (every response, scored) and ``batch`` (those kept for the
update), to which each later stage adds its fields. Both are :class:`Slot` fields: reading one before
the stage that sets it (:func:`~verl_core.trainer.rl.stages.producer`) has run, or setting it to a
value of the wrong type, raises a :class:`StepStateError` naming the field, the stage and what was
expected, so a stage run out of order fails at once with a clear message instead of an
``AttributeError`` or a wrong tensor; so does a stage reading a batch field no stage added
(:meth:`StepState.require`).

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
from verl_core.trainer.rl.stages import producer

__all__ = ["RunProgress", "Slot", "StepState", "StepStateError"]

T = TypeVar("T")


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
            expected = " or ".join(k.__name__ for k in self.kinds)
            raise StepStateError(
                f"step {obj.step + 1}: stage {self.set_by!r} set field {self.name!r} of the step state to "
                f"{describe(value)}; expected {expected}"
            )
        obj.__dict__[self.name] = value


@dataclasses.dataclass(eq=False)
class StepState:
    """One RL step's data: the prompts, then what the stages add (declared in :mod:`~verl_core.trainer.rl.stages`).

    The step's tensors travel in its batches: ``samples`` holds every response with its scores,
    ``batch`` the samples kept for the update, to which the forwards and the advantages add their
    fields (:meth:`add_fields`).

    Attributes:
        step: The 0-based index of the step (its metrics say ``step + 1``).
        prompts: The step's prompt batch.
        params: The step's sampling parameters.
        metrics: The step's metrics, filled by the stages.
        timings: Seconds per stage (``time/<stage>``).
        samples: The rollout's responses with ``scores`` (and ``token_scores`` of a dense reward) (``reward``).
        batch: The samples kept for the update (``select``; DAPO's dynamic sampling may keep
            fewer), with the fields the later stages add.
    """

    step: int
    prompts: TensorBatch
    params: SamplingParams
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    samples = Slot[TensorBatch](TensorBatch, producer("samples"))
    batch = Slot[TensorBatch](TensorBatch, producer("batch"))

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Record the seconds of a ``with`` block as ``timings["time/<stage>"]``."""
        t = time.perf_counter()
        yield
        self.timings[f"time/{stage}"] = time.perf_counter() - t

    def has(self, name: str) -> bool:
        """Whether the field ``name`` was set."""
        return name in self.__dict__

    def add_fields(self, fields: Mapping[str, torch.Tensor | None]) -> None:
        """Add the stages' outputs to ``batch`` as fields, in one update (a None output adds nothing).

        Raises:
            StepStateError: ``batch`` is not set yet, or an output is not a tensor.
        """
        for name, value in fields.items():
            if value is not None and not isinstance(value, torch.Tensor):
                raise StepStateError(
                    f"step {self.step + 1}: stage {producer(name)!r} gave {name!r} as {describe(value)}; "
                    "expected a tensor (a field of the batch) or None"
                )
        self.batch = self.batch.update({k: v for k, v in fields.items() if v is not None})

    def require(self, name: str, *, by: str) -> torch.Tensor:
        """The batch field ``name``, which stage ``by`` reads.

        Raises:
            StepStateError: the batch has no such field (its stage did not run, or gave nothing).
        """
        if name not in self.batch:
            raise StepStateError(
                f"step {self.step + 1}: stage {by!r} needs the batch field {name!r}, which stage "
                f"{producer(name)!r} adds, but the batch of {self.batch.batch_size} samples has none "
                f"(its fields: {sorted(self.batch)})"
            )
        return self.batch[name]


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
