"""Saving, checking and loading a run's checkpoints, shared by ``verl train`` and ``verl sft``.

:class:`Checkpointer` writes ``<output_dir>/checkpoints/step-N`` atomically with the fields every
runner saves (step, RNG streams, config, non-finite skips in a row) plus the runner's own, prunes
to ``checkpoint.keep``, finds the checkpoint a ``--resume`` continues from, and loads one only
after every check passed: the manifest, each field of ``trainer_state.json``, the config changes
(:func:`~verl_core.trainer.run.integrity.resume_config_changes`) and the data order's position. The
file layout and the field checks are :mod:`verl_core.trainer.run.state`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from verl_core.kernel.errors import CheckpointError, ConfigError, describe
from verl_core.kernel.training import TrainingEngine
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler
from verl_core.trainer.config import RunConfig, config_to_dict
from verl_core.trainer.inputs.data import PromptSampler
from verl_core.trainer.run.integrity import resume_config_changes, verify_checkpoint
from verl_core.trainer.run.state import (
    STATE_FILE,
    latest_checkpoint,
    load_engine_checkpoint,
    read_state,
    rng_state,
    set_rng_state,
    write_checkpoint,
)

__all__ = ["Checkpointer", "Restored", "read_data_state"]


def read_data_state(ckpt: Path, state: Mapping[str, Any], sampler: PromptSampler | None) -> dict[str, Any] | None:
    """The data-order position of ``trainer_state.json`` (``data``), checked against the run's sampler.

    A run reading ``data.train`` saves the position of its :class:`PromptSampler`; a run on the
    built-in task (``sampler`` None) saves none. Nothing is changed here: the caller restores it
    once every check passed.

    Raises:
        CheckpointError: the field is missing (or present for a run without data) or malformed.
        ConfigError: the position was saved for another number of rows, seed or shuffle setting
            (the dataset changed since the checkpoint).
    """
    saved = state.get("data", ...)
    if sampler is None and saved is ...:
        return None
    if sampler is None or saved is ... or not isinstance(saved, dict):
        expected = "absent (this run takes its prompts from the built-in task)" if sampler is None else (
            "the data order's position (epoch, index, size, seed, shuffle)"
        )
        got = "it is missing" if saved is ... else f"got {describe(saved)}"
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {STATE_FILE} field 'data' must be {expected}, {got}; the file is "
            "damaged or was not written by this runner's save_checkpoint: resume from another checkpoint or "
            "start a new run"
        )
    for key, kind in (("epoch", int), ("index", int), ("size", int), ("seed", int), ("shuffle", bool)):
        v = saved.get(key, ...)
        if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 0)):
            got = "it is missing" if v is ... else f"got {describe(v)}"
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r}: {STATE_FILE} field 'data.{key}' must be "
                f"{'true or false' if kind is bool else 'an integer >= 0'}, {got}; the file is damaged or was "
                "not written by this runner's save_checkpoint: resume from another checkpoint or start a new run"
            )
    PromptSampler(sampler.size, seed=sampler.seed, shuffle=sampler.shuffle).load_state_dict(saved)  # a dry run
    return saved


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.load` read and checked, for the runner to apply its own fields.

    Attributes:
        path: The checkpoint folder.
        state: ``trainer_state.json``, checked field by field.
        step: The saved step.
        consecutive_skips: Non-finite optimizer steps in a row when it was saved.
    """

    path: Path
    state: Mapping[str, Any]
    step: int
    consecutive_skips: int


class Checkpointer:
    """The checkpoints of one run.

    Args:
        config: The run.
        runner: ``rl`` (``verl train``) or ``sft``; a checkpoint is loaded only by the runner that wrote it.
        say: Where the allowed config changes of a resume are reported.

    Attributes:
        on_disk_step: The step whose checkpoint this run wrote or loaded last (-1: none).
    """

    def __init__(self, config: RunConfig, *, runner: str = "rl", say: Callable[[str], None]) -> None:
        self.config = config
        self.root = Path(config.output_dir) / "checkpoints"
        self.runner = runner
        self._say = say
        self._rng: dict[str, Any] = {}
        self.on_disk_step = -1

    def save(
        self, step: int, engines: Mapping[str, TrainingEngine], state: Mapping[str, Any], *, consecutive_skips: int,
    ) -> Path:
        """Write ``step-<step>`` with ``engines`` and ``state`` plus the common fields; returns its folder."""
        full: dict[str, Any] = {"step": step, "rng": rng_state(), **state, "config": config_to_dict(self.config),
                                "consecutive_nonfinite_skips": consecutive_skips}
        if self.runner != "rl":
            full = {"trainer": self.runner, **full}
        final = write_checkpoint(self.root, step, engines, full, keep=self.config.checkpoint.keep)
        self.on_disk_step = step
        return final

    def to_resume(self) -> Path:
        """The newest checkpoint, which ``--resume`` continues from.

        Raises:
            ConfigError: the run has no checkpoint.
        """
        ckpt = latest_checkpoint(self.root.parent)
        if ckpt is None:
            raise ConfigError(f"--resume: no checkpoint under {str(self.root)!r}; run without --resume to start fresh")
        return ckpt

    def load(
        self, path: Path, engines: Mapping[str, TrainingEngine], schedulers: Mapping[str, DynamicBatchScheduler], *,
        algorithm_state: Collection[str] = (), sampler: PromptSampler | None = None,
    ) -> Restored:
        """Check the checkpoint at ``path``, then restore ``engines``, ``schedulers`` and ``sampler`` from it.

        Nothing is restored unless every check passes. The process RNG streams are restored last,
        by :meth:`restore_rng`, once the runner applied its own fields.

        Raises:
            CheckpointError: the manifest, a file, or a field of ``trainer_state.json`` (named).
            ConfigError: config keys that change the math differ from the checkpoint's (all
                listed), or the dataset changed since it was written.
        """
        verify_checkpoint(path, required=(STATE_FILE, *engines))
        state, self._rng = read_state(path, schedulers, algorithm_state, trainer=self.runner)
        allowed = resume_config_changes(state["config"], config_to_dict(self.config), path)
        data = read_data_state(path, state, sampler)
        if allowed:
            self._say("resume: changed keys allowed: " + "; ".join(allowed))
        for role, engine in engines.items():
            load_engine_checkpoint(path, role, engine, getattr(self.config.backends, role))
        for role, s in state["schedulers"].items():
            schedulers[role].load_state_dict(s)
        if sampler is not None and data is not None:
            sampler.load_state_dict(data)
        step = int(state["step"])
        self.on_disk_step = step
        return Restored(path, state, step, int(state.get("consecutive_nonfinite_skips", 0)))

    def restore_rng(self) -> None:
        """Restore the RNG streams of the checkpoint :meth:`load` read last."""
        set_rng_state(self._rng)
