"""What ``verl train`` and ``verl sft`` share around their steps: the run folder, messages, metric
logs, checkpoints and the loop.

:class:`RunContext` claims the output folder (:class:`~verl_core.trainer.run.folder.RunDir`), prints
the run's messages above the progress bar, opens the metric sinks (afresh, or continuing the logs
of a loaded checkpoint), keeps the metrics of every step, owns the run's :class:`Checkpointer`, runs
the loop (a step, a periodic checkpoint, the final one), stops a run whose optimizer steps were
skipped too often in a row, and stops at a step boundary on SIGINT or SIGTERM
(:mod:`verl_core.trainer.run.interrupt`). A runner adds only its step, its engines and its
checkpoint fields.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from verl_core.kernel.errors import ConfigError, VerlError
from verl_core.trainer.batching.replay import remove_stale_spill
from verl_core.trainer.config import RunConfig, check_device_here, config_to_dict
from verl_core.trainer.pipeline import StageError
from verl_core.trainer.run.checkpoints import Checkpointer
from verl_core.trainer.run.folder import Mode, RunDir
from verl_core.trainer.run.interrupt import RunInterrupted, StopSignals
from verl_core.trainer.run.model import build_run_model
from verl_core.trainer.sinks import MetricSinks, ProgressBar, check_sinks, write_text_atomic

__all__ = ["RunContext", "StepFailedError", "TrainingDivergedError"]


class StepFailedError(StageError):
    """A stage of a training step raised; the step was abandoned and the last good state is on disk.

    Attributes:
        stage: The stage that failed (rollout, reward, reference, actor_forward, critic_forward,
            advantages, update, weight_sync, ...).
        backend: The backend that ran the stage (``rule`` for the built-in reward).
        step: The 1-based step that failed.
        checkpoint: The newest complete checkpoint (None when none was written yet).
    """

    def __init__(
        self, stage: str, backend: str, step: int, error: BaseException, checkpoint: Path | None
    ) -> None:
        where = f"resume from {str(checkpoint)!r} with `verl train CONFIG --resume`" if checkpoint else (
            "no checkpoint was written yet: restart the run"
        )
        VerlError.__init__(
            self,
            f"step {step}: stage {stage!r} (backend {backend!r}) failed: {type(error).__name__}: {error}. "
            f"The step was abandoned and nothing of it was saved; the last good state is on disk: {where}",
        )
        self.stage = stage
        self.backend = backend
        self.step = step
        self.checkpoint = checkpoint


class TrainingDivergedError(VerlError, RuntimeError):
    """Too many optimizer steps in a row were skipped for a non-finite loss or gradient."""

_log = logging.getLogger("verl_core.trainer.rl.trainer")
_COMMANDS = {"rl": "verl train", "sft": "verl sft"}


class RunContext:
    """The run folder, messages, metric logs, checkpoints and loop of one runner.

    Args:
        config: The run.
        runner: ``rl`` or ``sft`` (names the command in messages and the checkpoints' runner).
        stream: Where the progress bar and messages go (default stderr).
        base_dir: The config file's folder, where callbacks of ``logging.sinks`` are looked up first.

    Attributes:
        run_dir: The claim on the output folder (None until :meth:`claim`).
        sinks: The open metric sinks (None when closed).
        history: The metrics of every step (with those before a resume, as logged then).
        checkpoints: The run's checkpoints.
    """

    def __init__(
        self, config: RunConfig, *, runner: str = "rl", stream: IO[str] | None = None, base_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self.command = _COMMANDS[runner]
        self.stream = stream if stream is not None else sys.stderr
        self.base_dir = base_dir
        self.run_dir: RunDir | None = None
        self.sinks: MetricSinks | None = None
        self.history: list[dict[str, Any]] = []
        self.logs_from: int | None = None  # the step the metric logs continue from (None: start afresh)
        self.resumed_at = 0  # the checkpoint step this process resumed from (0: it started afresh)
        self.bar: ProgressBar | None = None
        self.checkpoints = Checkpointer(config, runner=runner, say=self.say)

    # ------------------------------------------------------------------ the run folder
    def say(self, text: str) -> None:
        """A message of the run: to the ``verl_core.trainer.rl.trainer`` logger, and above the progress bar."""
        _log.info(text)
        if not self.config.logging.progress:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def warn(self, text: str) -> None:
        """A message the user must see whatever ``logging.progress`` says (e.g. rows left out).

        With the progress bar on it is printed above the bar like :meth:`say`; with it off it goes to
        the ``verl_core.trainer.rl.trainer`` logger at WARNING level, which Python prints on stderr
        when logging is not configured.
        """
        if self.config.logging.progress:
            self.say(text)
        else:
            _log.warning(text)

    def claim(self, resume: bool | None) -> RunDir:
        """The run's claim on the output folder (made on first use; see :class:`RunDir`)."""
        run = self.run_dir
        if run is None:
            mode: Mode = "any" if resume is None else "resume" if resume else "fresh"
            run = self.run_dir = RunDir.claim(self.config.output_dir, self.config, mode=mode)
            if run.moved_aside is not None:
                self.say(f"overwrite=true: moved what {str(self.out)!r} held to {str(run.moved_aside)!r}")
            if not run.created:
                remove_stale_spill(run.spill_root)  # left by a killed process of this run (the claim locks it)
        elif not run.held:
            run.acquire()  # set up again after close()
        return run

    def model_path(self, *, max_position: int) -> str:
        """``model.path``, or a tiny random model of ``max_position`` positions built in the run's folder."""
        if self.config.model.path:
            return self.config.model.path
        return build_run_model(self.config, self.claim(None), max_position=max_position)

    def prepare(self, resume: bool | None) -> RunDir:
        """Before any engine is built: check the device, claim the folder, seed the process RNGs."""
        check_device_here(self.config)  # before the run folder is claimed or any engine is built
        check_sinks(self.out, self.config.logging)  # packages and folders of logging.sinks
        run = self.claim(resume)
        torch.manual_seed(self.config.seed)
        random.seed(self.config.seed)
        return run

    def begin(self, resume: bool) -> Path | None:
        """Check that the run may start (or go on) here; returns the checkpoint to resume from.

        Raises:
            ConfigError: a fresh run in a folder holding another run, a resume without the
                run's marker or without a checkpoint, or a folder another process runs in.
        """
        run = self.claim(resume)
        run.check_owned()
        if not resume:
            run.require_fresh(self.config)  # never restart a run this trainer opened rather than started
            return None
        return self.checkpoints.to_resume()

    def write_config(self) -> None:
        """``config.json``, written once the run is known to start (a refused resume leaves it as it was)."""
        write_text_atomic(self.out / "config.json", json.dumps(config_to_dict(self.config), indent=1))

    def abandon(self) -> None:
        """The run's setup failed after :meth:`prepare`: give the output folder back when this process
        started the run there (its marker and the tiny model it built go, and the folder if the claim
        made it: :meth:`RunDir.abandon`), so the corrected run can use the same ``output_dir``."""
        run, self.run_dir = self.run_dir, None
        if run is None:
            return
        written = (run.model_tmp.name, run.spill_root.name) + (() if self.config.model.path else ("model",))
        if run.abandon(written):
            _log.info("the run never started: %s is free again", self.out)

    def release(self) -> None:
        """Give up the claim on the output folder."""
        if self.run_dir is not None:
            self.run_dir.release()

    def resumed(self, step: int) -> None:
        """A checkpoint of ``step`` was loaded: the logs continue from it."""
        self.logs_from = self.resumed_at = step

    def steps_run_now(self) -> list[dict[str, Any]]:
        """The metrics of the steps this process ran (:attr:`history` also holds a resumed run's
        earlier steps, as logged then)."""
        return [m for m in self.history if int(m.get("step", 0)) > self.resumed_at]

    # ------------------------------------------------------------------ metric logs
    def open_sinks(self) -> MetricSinks:
        """The run's metric sinks, opened on first use: afresh, or continuing the logs of a loaded checkpoint."""
        if self.sinks is None:
            cfg = self.config
            self.sinks = MetricSinks.open(
                self.out, cfg.logging, run_name=self.out.name, resume_step=self.logs_from,
                hparams=config_to_dict(cfg), base_dir=self.base_dir,
            )
            if self.logs_from is not None and "jsonl" in self.sinks.names:
                self.history = list(self.sinks.history)  # the steps up to the checkpoint, as logged then
        return self.sinks

    def close_sinks(self, *, failed: bool, step: int) -> None:
        """Close the sinks; opened again, the logs continue from ``step``."""
        if self.sinks is not None:
            sinks, self.sinks = self.sinks, None
            self.logs_from = step
            sinks.close(failed=failed)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Keep a step's metrics and send them to the sinks."""
        self.history.append(metrics)
        self.open_sinks().log_step(step, metrics)

    def saved(self, step: int, path: Path) -> Path:
        """Tell the open sinks that ``path`` holds the checkpoint of ``step``; returns ``path``."""
        if self.sinks is not None:
            self.sinks.checkpoint(step, path)
        return path

    # ------------------------------------------------------------------ the loop
    def check_diverged(self, step: int, skips: int, save: Callable[[], Path], *, check: str) -> None:
        """Stop the run when ``max_consecutive_skips`` optimizer steps in a row were skipped.

        Raises:
            TrainingDivergedError: after writing a checkpoint with ``save``; ``check`` says what
                to look at (e.g. "the reward and the data").
        """
        limit = self.config.max_consecutive_skips
        if limit and skips >= limit:
            ckpt = save()
            raise TrainingDivergedError(
                f"step {step}: {skips} optimizer steps in a row were skipped because the loss or gradient "
                f"was NaN/inf (max_consecutive_skips={limit}); the weights are those of the last finite update, "
                f"saved in {str(ckpt)!r}. Lower optim.lr, check {check}, then resume with "
                f"`{self.command} CONFIG --resume`"
            )

    def run_steps(
        self, step: Callable[[], Mapping[str, Any]], save: Callable[[], Path], *, current: Callable[[], int],
        final: bool, after_step: Callable[[Mapping[str, Any]], None] | None = None, intro: str = "",
    ) -> None:
        """Run ``step`` until ``config.steps``, checkpointing every ``checkpoint.every`` steps and at the end.

        Args:
            step: Runs one step and returns its metrics.
            save: Writes a checkpoint of the current step.
            current: The steps completed.
            final: Write a checkpoint after the last step (unless it has one).
            after_step: Called with each step's metrics (e.g. to print a line).
            intro: A line printed above the progress bar first.

        The sinks are closed at the end, marked failed when a step raised. A SIGINT or SIGTERM lets
        the step under way finish, writes its checkpoint (whatever ``final`` says: it is what
        ``--resume`` continues from), closes the sinks and raises :class:`RunInterrupted`; a second
        signal abandons the step under way at once (see :mod:`verl_core.trainer.run.interrupt`).

        Raises:
            RunInterrupted: a SIGINT or SIGTERM stopped the run.
        """
        cfg = self.config
        self.open_sinks()
        self.bar = ProgressBar(cfg.steps, initial=current(), enabled=cfg.logging.progress, stream=self.stream)
        stop = StopSignals(defer=True, notify=self.warn)
        in_step = False
        try:
            with stop:
                if intro:
                    self.bar.write(intro)
                while current() < cfg.steps and stop.requested is None:
                    in_step = True
                    metrics = step()
                    in_step = False
                    self.bar.update(metrics)
                    if after_step is not None:
                        after_step(metrics)
                    every = cfg.checkpoint.every
                    if every and current() % every == 0 and current() < cfg.steps:
                        save()
                if stop.requested is not None:  # a step boundary: save what --resume continues from
                    if current() > 0 and self.checkpoints.on_disk_step != current():
                        save()
                    raise RunInterrupted(stop.requested)
                if final and self.checkpoints.on_disk_step != current():
                    save()
        except RunInterrupted as e:
            e.step, e.steps, e.abandoned, e.checkpoint = current(), cfg.steps, in_step, self._newest_checkpoint()
            self._close_after_error(failed=in_step, step=current())
            raise
        except BaseException:
            self._close_after_error(failed=True, step=current())
            raise
        finally:
            self.bar.close()
            self.bar = None
        self.close_sinks(failed=False, step=current())

    def _close_after_error(self, *, failed: bool, step: int) -> None:
        try:
            self.close_sinks(failed=failed, step=step)
        except Exception as e:  # the error that stopped the run is the one to report
            _log.warning("closing the metric sinks after a failed run: %s", e)

    def _newest_checkpoint(self) -> Path | None:
        try:
            return self.checkpoints.to_resume()
        except ConfigError:  # none written yet
            return None
