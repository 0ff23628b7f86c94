"""Helpers for checkpoints: atomic file writes, and the checks an engine runs before a load.

:func:`write_atomic` is the one atomic file write of every package (batches, metric files,
manifests, checkpoint pointers): a crash at any moment leaves the old content or the new one.

A load must not copy anything until the whole checkpoint is known to fit the live engine:
``param.copy_(saved)`` broadcasts, so a tensor of the wrong shape (a ``(1, H)`` row into a
``(V, H)`` embedding) or dtype would otherwise load silently, and a load refused halfway leaves
an engine that is neither the old state nor the saved one. Engines build the expected
:class:`~verl_core.kernel.weights.TensorInfo` of every tensor they would restore, call
:func:`verify_tensors` (and :func:`verify_step_count` for counters) on everything they read, and
copy only after all of it passed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Final

import torch

from verl_core.kernel.errors import CheckpointError
from verl_core.kernel.weights import TensorInfo

__all__ = ["fsync_dir", "verify_step_count", "verify_tensors", "write_atomic"]

_LISTED: Final = 5  # names listed in a missing/unexpected message


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder so a rename inside it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes | Callable[[BinaryIO], object]) -> None:
    """Replace the file ``path`` by ``data`` atomically and durably.

    Writes a hidden temporary file beside ``path``, fsyncs it, renames it over ``path`` and fsyncs
    the folder; the temporary file is removed when anything fails.

    Args:
        path: The file to write.
        data: Text (UTF-8), bytes, or a function writing to the open binary file (``torch.save``).
    """
    dest = Path(path)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dest.parent)


def _names(names: set[str]) -> str:
    listed = sorted(names)
    more = f" and {len(listed) - _LISTED} more" if len(listed) > _LISTED else ""
    return ", ".join(repr(n) for n in listed[:_LISTED]) + more


def _desc(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"shape {shape} dtype {str(dtype).removeprefix('torch.')}"


def verify_tensors(
    saved: Mapping[str, Any],
    expected: Mapping[str, TensorInfo],
    *,
    checkpoint: str | os.PathLike[str],
    what: str = "model",
    exact_dtype: bool = True,
) -> None:
    """Check that ``saved`` holds exactly the tensors ``expected`` describes, before anything is copied.

    Args:
        saved: Name -> what the checkpoint holds under that name.
        expected: Name -> shape and dtype the live engine needs under that name (its
            parameter's; the whole tensor's for an engine that saves whole tensors and shards
            them on load).
        checkpoint: The checkpoint folder, named in the error.
        what: What the tensors are (``model``, ``float32 master``, ``optimizer state``), named
            in the error.
        exact_dtype: Require the expected dtype. False accepts any floating dtype for floating
            expectations (state the loader casts on purpose, e.g. Adam moments saved by a run
            without float32 masters and restored into one with them).

    Raises:
        CheckpointError: a tensor is missing or unexpected, is not a tensor, or has another shape
            or dtype. The message names the checkpoint folder, the tensor, what was saved and
            what the engine expects.
    """
    where = f"checkpoint {os.fspath(checkpoint)!r}"
    fix = "load a checkpoint saved by an engine of the same model, dtype and options"
    missing, extra = set(expected) - set(saved), set(saved) - set(expected)
    if missing or extra:
        parts = ([f"missing {len(missing)} {what} tensors ({_names(missing)})"] if missing else []) + (
            [f"{len(extra)} unexpected {what} tensors ({_names(extra)})"] if extra else [])
        raise CheckpointError(f"{where} does not fit this engine: {'; '.join(parts)}; {fix}")
    for name, want in expected.items():
        got = saved[name]
        if not isinstance(got, torch.Tensor):
            raise CheckpointError(
                f"{where}: {what} tensor {name!r} is a {type(got).__name__}, not a tensor "
                f"(expected {_desc(want.shape, want.dtype)}); the file is corrupted or foreign"
            )
        shape = tuple(got.shape)
        dtype_ok = got.dtype == want.dtype or (
            not exact_dtype and got.dtype.is_floating_point and want.dtype.is_floating_point
        )
        if shape != tuple(want.shape) or not dtype_ok:
            raise CheckpointError(
                f"{where}: {what} tensor {name!r} is saved with {_desc(shape, got.dtype)}, this engine "
                f"expects {_desc(tuple(want.shape), want.dtype)}; {fix}"
            )


def verify_step_count(value: Any, *, name: str, checkpoint: str | os.PathLike[str]) -> float:
    """Check a saved step counter: one finite, whole, non-negative number (a Python number or 1-element tensor).

    Returns:
        The counter as a float.

    Raises:
        CheckpointError: the counter is of another type, several numbers, negative, fractional
            or not finite; the message names the checkpoint, the counter and its value.
    """
    got = value
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.dtype.is_complex:
        got = got.item()
    ok = isinstance(got, int | float) and not isinstance(got, bool)
    number = float(got) if ok else math.nan
    if not (math.isfinite(number) and number >= 0 and number.is_integer()):
        shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
        raise CheckpointError(
            f"checkpoint {os.fspath(checkpoint)!r}: step counter {name!r} is {shown}; expected a whole "
            "number >= 0. The file is corrupted or foreign: load a checkpoint saved by this engine"
        )
    return number
