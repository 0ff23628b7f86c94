"""TensorBatch files: how the replay buffer spills whole batches to disk and reads them back.

A file holds the batch's tensors (on the CPU), its extras and meta as JSON text, and a format tag;
it is written atomically and read without unpickling arbitrary objects.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Final

import torch

from verl_core.enginekit.checkpoint import write_atomic
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.errors import BatchValidationError, describe

__all__ = ["BATCH_FILE_FORMAT", "load_batch", "save_batch"]

BATCH_FILE_FORMAT: Final = "verl.TensorBatch/1"


def _checked_path(path: object, name: str) -> str | os.PathLike[str]:
    if not isinstance(path, (str, os.PathLike)):
        raise BatchValidationError(f"{name} must be a str or os.PathLike, got {describe(path)}")
    return path


def save_batch(batch: TensorBatch, path: str | os.PathLike[str]) -> None:
    """Write ``batch`` to the file ``path`` atomically.

    Extras must be JSON values (str, int, float, bool, None, lists and dicts of them).

    Raises:
        BatchValidationError: an extra that is not a JSON value, or a path that is not one.
    """
    dest = _checked_path(path, "save_batch() path")
    try:
        extras_json = json.dumps({k: list(v) for k, v in batch.extras.items()})
    except TypeError as e:
        raise BatchValidationError(f"save_batch(): extras must be JSON values: {e}") from None
    payload = {
        "format": BATCH_FILE_FORMAT,
        "tensors": {k: v.detach().cpu().contiguous() for k, v in batch.items()},
        "extras": extras_json,
        "meta": json.dumps(dataclasses.asdict(batch.meta)),
        "batch_size": batch.batch_size,
    }
    write_atomic(dest, lambda fh: torch.save(payload, fh))


def load_batch(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> TensorBatch:
    """Read a batch written by :func:`save_batch` (never unpickles arbitrary objects).

    Raises:
        BatchValidationError: the file is unreadable, truncated, corrupted, of another format, or
            holds a batch that fails validation; the message names the file.
    """
    where = f"load_batch({str(_checked_path(path, 'load_batch() path'))!r})"
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise BatchValidationError(f"{where}: not a readable TensorBatch file: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != BATCH_FILE_FORMAT:
        raise BatchValidationError(f"{where}: not a {BATCH_FILE_FORMAT} file")
    try:
        meta = BatchMeta(**json.loads(payload["meta"]))
        return TensorBatch(payload["tensors"], json.loads(payload["extras"]), meta, batch_size=payload["batch_size"])
    except BatchValidationError as e:
        raise BatchValidationError(f"{where}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BatchValidationError(
            f"{where}: a malformed {BATCH_FILE_FORMAT} file ({type(e).__name__}: {e}); write it with save_batch"
        ) from e
