"""The exceptions verl-core raises; each message says what was wrong, what was expected, what to do."""

from __future__ import annotations

__all__ = [
    "BatchValidationError",
    "CheckpointError",
    "ConfigError",
    "NonFiniteError",
    "PluginError",
    "RewardError",
    "StaleWeightsError",
    "UnknownNameError",
    "VerlError",
    "WeightSyncError",
]


class VerlError(Exception):
    """Base class of every error raised by the verl SDK."""


class BatchValidationError(VerlError, ValueError):
    """A TensorBatch (or an input at a protocol boundary) does not match the schema."""


class NonFiniteError(BatchValidationError):
    """A NaN or inf was found where only finite values are allowed."""


class ConfigError(VerlError, ValueError):
    """A configuration value or key is invalid."""


class CheckpointError(VerlError, ValueError):
    """A checkpoint is missing, incomplete, truncated or corrupted (its files disagree with its manifest)."""


class PluginError(VerlError, RuntimeError):
    """A plugin could not be loaded, is incompatible, or two plugins claim the same name."""


class UnknownNameError(VerlError, KeyError):
    """A backend, algorithm or component name is not registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class WeightSyncError(VerlError, RuntimeError):
    """A weight stream is malformed, incomplete or does not match the receiving model."""


class StaleWeightsError(VerlError, RuntimeError):
    """A rollout engine was asked to generate after a failed weight sync."""


class RewardError(VerlError, RuntimeError):
    """A reward function raised, or returned a wrong number of scores or a non-finite or non-numeric one."""
