"""Moving the rollout engine between steps: sleep for the update, wake and sync the new weights after it.

:class:`WeightSyncStage` frees the rollout's device memory once a step's samples are scored and
forwarded (the update needs it), and after the update wakes the rollout engine and sends it the
actor's weights as the next weight version, so the next step samples from the new policy.
"""

from __future__ import annotations

import time

from verl_core.trainer.engines import RLEngines
from verl_core.trainer.step_state import RunProgress, StepState

__all__ = ["WeightSyncStage"]


class WeightSyncStage:
    """Sleep and weight sync of the rollout engine.

    Args:
        engines: The run's engines (read at call time).
        progress: The trainer's counters (the weight version, the running stage).
    """

    def __init__(self, engines: RLEngines, progress: RunProgress) -> None:
        self.engines = engines
        self.progress = progress

    def sleep(self, state: StepState) -> None:
        """Free the rollout's device memory for the update (woken by the weight sync)."""
        t = time.perf_counter()
        self.engines.rollout.sleep()
        state.timings["time/rollout_sleep"] = time.perf_counter() - t

    def sync(self, state: StepState) -> None:
        """Wake the rollout engine and send it the actor's weights as the next version; sets ``state.sync_bytes``."""
        t = time.perf_counter()
        self.progress.stage = "weight_sync"
        e = self.engines
        e.rollout.wake()
        report = e.sync.sync(e.actor, e.rollout, version=self.progress.weight_version + 1)
        self.progress.weight_version += 1
        self.progress.stage = "logging"
        state.timings["time/weight_sync"] = time.perf_counter() - t
        state.sync_bytes = report.bytes
        state.metrics["weight_sync/bytes"] = report.bytes

    def resync(self) -> None:
        """Wake the rollout engine and send it the actor's weights at the current version (after a load)."""
        e = self.engines
        e.rollout.wake()
        e.sync.sync(e.actor, e.rollout, version=self.progress.weight_version)
