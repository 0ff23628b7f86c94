"""Atomic file writes: a crash at any moment leaves a file's old content or its new one, never a mix.

The one implementation for every package (batches, metric files, manifests, checkpoint pointers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["fsync_dir", "write_atomic"]


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
