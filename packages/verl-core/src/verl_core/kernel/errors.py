"""The exceptions verl-core raises; each message says what was wrong, what was expected, what to do.

Also the argument checks the public API's constructors share (:func:`check_int`,
:func:`check_number`, :func:`check_bool`, :func:`check_str`): each raises one of these errors
naming the argument, the value it got and what is allowed.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["BatchValidationError", "CheckpointError", "ConfigError", "MissingFieldError",
           "NonFiniteError", "PluginError", "RewardError", "RequestTooLargeError",
           "StaleWeightsError", "StorageError", "UnknownNameError", "VerlError", "WeightSyncError", "check_bool",
           "check_int", "check_number", "check_str", "describe"]


class VerlError(Exception):
    """Base class of every error raised by the verl SDK."""


class BatchValidationError(VerlError, ValueError):
    """A TensorBatch (or an input at a protocol boundary) does not match the schema."""


class NonFiniteError(BatchValidationError):
    """A NaN or inf was found where only finite values are allowed."""


class MissingFieldError(BatchValidationError, KeyError):
    """A TensorBatch has no field of the requested name (a KeyError too, as a Mapping must raise)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ConfigError(VerlError, ValueError):
    """A configuration value or key is invalid."""


class RequestTooLargeError(ConfigError):
    """A request needs more memory than is available; it was refused before anything was allocated."""


class CheckpointError(VerlError, ValueError):
    """A checkpoint is missing, incomplete, truncated or corrupted (its files disagree with its manifest)."""


class StorageError(VerlError, OSError):
    """A file of the run could not be written (a full disk, a quota, a file too large, a permission).

    The message names the path, the system's reason and what was kept (e.g. the last complete
    checkpoint); nothing half-written is left looking complete.
    """


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
_REPR_LIMIT: Final = 60


def describe(value: object) -> str:
    """A short ``repr`` of ``value`` and its type, for error messages (long reprs are cut)."""
    kind = type(value).__name__
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits ({kind})"  # repr may exceed Python's digit limit
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{kind} object>"
    if len(text) > _REPR_LIMIT:
        text = text[: _REPR_LIMIT - 3] + "..."
    return f"{text} ({kind})"


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def check_int(
    value: object, name: str, *, low: int | None = None, high: int | None = None,
    error: type[VerlError] = ConfigError, hint: str = "",
) -> int:
    """``value`` if it is an ``int`` (not a bool) in ``[low, high]``, else ``error`` naming ``name``.

    Args:
        value: What the caller passed.
        name: How the message names the argument, e.g. ``"SamplingParams.n"``.
        low: Smallest allowed value (None = unbounded).
        high: Largest allowed value (None = unbounded).
        error: The error class to raise.
        hint: Appended to the message (what the value means, what to do).
    """
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) or (
        high is not None and value > high
    ):
        raise error(f"{name} must be an integer{_bounds(low, high, False, False)}{hint}, got {describe(value)}")
    return value


def check_number(
    value: object, name: str, *, low: float | None = None, high: float | None = None,
    low_open: bool = False, high_open: bool = False, error: type[VerlError] = ConfigError, hint: str = "",
) -> float:
    """``value`` if it is a finite ``int`` or ``float`` (not a bool) within the bounds, else ``error``.

    Args:
        value: What the caller passed.
        name: How the message names the argument.
        low: Lower bound (None = unbounded); excluded when ``low_open``.
        high: Upper bound (None = unbounded); excluded when ``high_open``.
        low_open: The lower bound itself is not allowed.
        high_open: The upper bound itself is not allowed.
        error: The error class to raise.
        hint: Appended to the message.
    """
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            number = None
    if (
        number is None or not math.isfinite(number)
        or (low is not None and (number <= low if low_open else number < low))
        or (high is not None and (number >= high if high_open else number > high))
    ):
        raise error(
            f"{name} must be a finite number{_bounds(low, high, low_open, high_open)}{hint}, got {describe(value)}"
        )
    return number


def check_bool(value: object, name: str, *, error: type[VerlError] = ConfigError) -> bool:
    """``value`` if it is a ``bool``, else ``error`` naming ``name`` (1, "yes" and None are refused)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {describe(value)}")
    return value


def check_str(value: object, name: str, *, error: type[VerlError] = ConfigError) -> str:
    """``value`` if it is a non-empty ``str``, else ``error`` naming ``name``."""
    if not isinstance(value, str) or not value:
        raise error(f"{name} must be a non-empty string, got {describe(value)}")
    return value
