"""Capabilities the faulty engines declare: the example backend's, with one capability turned on."""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from verl_example_backend.plugin import ROLLOUT_CAPABILITIES, TRAINING_CAPABILITIES

__all__ = ["BFLOAT16_ROLLOUT", "BFLOAT16_TRAINING", "CHECKPOINTING_TRAINING", "OFFLOAD_TRAINING",
           "TENSOR_PARALLEL_ROLLOUT", "VALUES_TRAINING"]

OFFLOAD_TRAINING: Final = replace(TRAINING_CAPABILITIES, offload=True)
BFLOAT16_TRAINING: Final = replace(TRAINING_CAPABILITIES, dtypes=frozenset({"float32", "bfloat16"}))
BFLOAT16_ROLLOUT: Final = replace(ROLLOUT_CAPABILITIES, dtypes=frozenset({"float32", "bfloat16"}))
CHECKPOINTING_TRAINING: Final = replace(TRAINING_CAPABILITIES, gradient_checkpointing=True)
TENSOR_PARALLEL_ROLLOUT: Final = replace(ROLLOUT_CAPABILITIES, tensor_parallel=True)
VALUES_TRAINING: Final = replace(TRAINING_CAPABILITIES, values=True)
