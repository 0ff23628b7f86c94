"""The RL trainer: a single controller composing engines, the HybridPipeline that runs a step's
stages concurrently, the replay buffer, the dynamic micro-batch scheduler, typed run configs and
the built-in tasks. Importing this package loads no engine library."""

from __future__ import annotations

from verl_core.trainer.batching.replay import (
    BufferClosedError,
    BufferEmptyError,
    BufferFullError,
    HybridReplayBuffer,
)
from verl_core.trainer.batching.scheduler import (
    Decision,
    DynamicBatchScheduler,
    MemoryInfo,
    MicroBatchOOMError,
    PeakProbe,
    PeakReading,
    SchedulerConfig,
)
from verl_core.trainer.config import RunConfig, load_config
from verl_core.trainer.inputs.tasks import DigitTask, TaskReward, get_task, prompt_batch
from verl_core.trainer.pipeline import (
    HybridPipeline,
    PipelineError,
    PipelineResult,
    Stage,
    StageError,
)
from verl_core.trainer.rl.trainer import Trainer, build_algorithm, latest_checkpoint
from verl_core.trainer.run.export import export_checkpoint
from verl_core.trainer.run.folder import RunDir, RunMarker
from verl_core.trainer.run.integrity import (
    StepFailedError,
    TrainingDivergedError,
    verify_checkpoint,
)

__all__ = [
    "BufferClosedError",
    "BufferEmptyError",
    "BufferFullError",
    "Decision",
    "DigitTask",
    "DynamicBatchScheduler",
    "HybridPipeline",
    "HybridReplayBuffer",
    "MemoryInfo",
    "MicroBatchOOMError",
    "PeakProbe",
    "PeakReading",
    "PipelineError",
    "PipelineResult",
    "RunConfig",
    "RunDir",
    "RunMarker",
    "SchedulerConfig",
    "Stage",
    "StageError",
    "StepFailedError",
    "TaskReward",
    "Trainer",
    "TrainingDivergedError",
    "build_algorithm",
    "export_checkpoint",
    "get_task",
    "latest_checkpoint",
    "load_config",
    "prompt_batch",
    "verify_checkpoint",
]
