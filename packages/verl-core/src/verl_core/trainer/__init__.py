"""The RL trainer: a single controller composing engines, the HybridPipeline that runs a step's
stages concurrently, the replay buffer, the dynamic micro-batch scheduler and typed run configs."""

from __future__ import annotations

from verl_core.trainer.pipeline import (
    HybridPipeline,
    PipelineError,
    PipelineResult,
    Stage,
    StageError,
)

__all__ = ["HybridPipeline", "PipelineError", "PipelineResult", "Stage", "StageError"]
