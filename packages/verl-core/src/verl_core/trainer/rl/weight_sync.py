"""Moving the rollout engine between steps: sleep for the update, wake and sync the new weights after it.

:class:`WeightSyncStage` frees the rollout's device memory once a step's samples are scored and
forwarded (the update needs it), and after the update wakes the rollout engine and sends it the
actor's weights as the next weight version, so the next step samples from the new policy. Since a
complete sync always follows, the engine sleeps with ``sleep_until_sync`` and may drop its weights
instead of copying them to the host and back.
Whether a step sleeps at all is :class:`SleepPolicy`'s call (``rollout.sleep``): sleeping costs a
copy of the weights to the host and back, and a rollout that kept its memory keeps its compiled
decode state too, so a device with room for both engines skips it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

import torch

from verl_core.trainer.config import RunConfig
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.step_state import RunProgress, StepState

__all__ = ["SleepMode", "SleepPolicy", "WeightSyncStage"]

log = logging.getLogger(__name__)

SleepMode = Literal["auto", "always", "never"]
"""``rollout.sleep``: when the rollout engine sleeps during the update."""

FILL_LIMIT = 0.85
"""Share of the device the update's peak plus an awake rollout may fill under ``auto``."""


class SleepPolicy:
    """Decides, step by step, whether the rollout engine sleeps during the update.

    ``always`` and ``never`` are what they say. ``auto`` sleeps unless it can measure that the
    device has room for an awake rollout engine: the readings are this process's CUDA memory
    (``torch.cuda.mem_get_info`` and the caching allocator's peak), so engines in other processes
    (Ray workers) or off CUDA always sleep. The first step sleeps and measures what the sleep
    freed (the rollout's memory); every update's peak is read after it; the next step stays awake
    while the last update's peak of device use, plus the rollout's memory if it slept, is within
    :data:`FILL_LIMIT` of the device, and sleeps again as soon as it is not. The reading lags one
    step: an update that suddenly needs much more memory runs on the scheduler's out-of-memory
    retry, and the steps after it sleep.

    Args:
        mode: ``rollout.sleep``.
        measurable: Whether the readings describe the engines' memory (one process, CUDA).
        device: The CUDA device the default readings are of (None: the current one).
        used: Device bytes in use and the device's total (default: ``torch.cuda.mem_get_info``).
        peak: The allocator's reserved and peak reserved bytes since the last ``reset`` (default:
            ``torch.cuda.memory_reserved``/``max_memory_reserved``).
        reset: Starts a new peak reading (default: ``torch.cuda.reset_peak_memory_stats``).
    """

    def __init__(self, mode: SleepMode, *, measurable: bool, device: torch.device | None = None,
                 used: Callable[[], tuple[int, int]] | None = None,
                 peak: Callable[[], tuple[int, int]] | None = None,
                 reset: Callable[[], None] | None = None) -> None:
        self.mode = mode
        self.measurable = measurable
        self._used = used or (lambda: _cuda_used(device))
        self._peak = peak or (lambda: _cuda_peak(device))
        self._reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self.rollout_bytes: int | None = None  # what the first sleep freed
        self._fits = False  # the last update's reading says an awake rollout fits
        self._slept = False
        self._before = 0

    @classmethod
    def for_run(cls, config: RunConfig) -> SleepPolicy:
        """The policy of ``config.rollout.sleep``, measuring the run's CUDA device when it runs in this process."""
        device = torch.device(config.model.device)
        measurable = config.executor == "local" and device.type == "cuda" and torch.cuda.is_available()
        return cls(config.rollout.sleep, measurable=measurable, device=device)

    def sleeps(self) -> bool:
        """Whether this step's rollout sleeps (call once per step, before the update)."""
        if self.mode != "auto":
            self._slept = self.mode == "always"
        else:
            self._slept = not (self.measurable and self._fits)
        if self.mode == "auto" and self.measurable:
            self._before = self._used()[0] if self._slept and self.rollout_bytes is None else 0
        return self._slept

    def after_sleep(self) -> None:
        """Record what the first sleep freed, and start reading the update's peak."""
        if self.mode != "auto" or not self.measurable:
            return
        if self._slept and self.rollout_bytes is None:
            self.rollout_bytes = max(0, self._before - self._used()[0])
        self._reset()

    def after_update(self) -> None:
        """Read the update's peak and decide whether the next step's rollout may stay awake."""
        if self.mode != "auto" or not self.measurable or self.rollout_bytes is None:
            return
        in_use, total = self._used()
        reserved, peak = self._peak()
        at_peak = in_use - reserved + peak + (self.rollout_bytes if self._slept else 0)
        fits = at_peak <= FILL_LIMIT * total
        if fits != self._fits:
            log.info("rollout.sleep=auto: the rollout engine %s during the update (device use at the update's "
                     "peak with it awake: %.2f of %.2f GB, limit %.0f%%)", "stays awake" if fits else "sleeps",
                     at_peak / 1e9, total / 1e9, FILL_LIMIT * 100)
        self._fits = fits


def _cuda_used(device: torch.device | None) -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free), int(total)


def _cuda_peak(device: torch.device | None) -> tuple[int, int]:
    return int(torch.cuda.memory_reserved(device)), int(torch.cuda.max_memory_reserved(device))


class WeightSyncStage:
    """Sleep and weight sync of the rollout engine.

    Args:
        engines: The run's engines (read at call time).
        progress: The trainer's counters (the weight version, the running stage).
        policy: When the rollout sleeps (default: every step).
    """

    def __init__(self, engines: RLEngines, progress: RunProgress, policy: SleepPolicy | None = None) -> None:
        self.engines = engines
        self.progress = progress
        self.policy = policy or SleepPolicy("always", measurable=False)
        self._asleep = False

    def sleep(self, state: StepState) -> None:
        """Free the rollout's device memory for the update when the policy says so (woken by the weight sync).

        Sets ``rollout/slept`` (1 or 0) and ``time/rollout_sleep``.
        """
        t = time.perf_counter()
        self._asleep = self.policy.sleeps()
        if self._asleep:  # a sync always follows (sync or restore), so the weights need not survive
            self.engines.rollout.sleep_until_sync()
        self.policy.after_sleep()
        state.metrics["rollout/slept"] = int(self._asleep)
        state.timings["time/rollout_sleep"] = time.perf_counter() - t

    def sync(self, state: StepState) -> None:
        """Wake the rollout engine and send it the actor's weights as the next version.

        Adds ``weight_sync/bytes`` (the bytes sent) to the step's metrics, and each entry of the
        sync's :attr:`~verl_core.kernel.weights.SyncReport.details` as ``weight_sync/<key>`` (a
        duration, a key ending in ``_s``, as ``time/weight_sync/<key>``: like every ``time/*``
        metric it is not expected to repeat in a resumed run).

        Sets ``time/rollout_wake`` (0 when the rollout stayed awake) and ``time/weight_sync`` (the
        sync alone).
        """
        self.policy.after_update()
        self.progress.stage = "weight_sync"
        e = self.engines
        t = time.perf_counter()
        if self._asleep:
            e.rollout.wake()
            self._asleep = False
        state.timings["time/rollout_wake"] = time.perf_counter() - t
        t = time.perf_counter()
        report = e.sync.sync(e.actor, e.rollout, version=self.progress.weight_version + 1)
        self.progress.weight_version += 1
        self.progress.stage = "logging"
        state.timings["time/weight_sync"] = time.perf_counter() - t
        state.metrics["weight_sync/bytes"] = report.bytes
        for key, value in report.details.items():
            if key.endswith("_s"):
                state.timings[f"time/weight_sync/{key}"] = float(value)
            else:
                state.metrics[f"weight_sync/{key}"] = float(value)

    def restore(self, state: StepState) -> None:
        """After a step that trained nothing: wake a rollout engine that slept and send it the
        actor's weights at the current version (its sleep may have dropped its own).

        Sets ``time/weight_sync`` (the wake and the sync; 0 when the rollout stayed awake).
        """
        t = time.perf_counter()
        if self._asleep:
            self.resync()
        state.timings["time/weight_sync"] = time.perf_counter() - t

    def resync(self) -> None:
        """Wake the rollout engine and send it the actor's weights at the current version (after a load)."""
        e = self.engines
        e.rollout.wake()
        self._asleep = False
        e.sync.sync(e.actor, e.rollout, version=self.progress.weight_version)
