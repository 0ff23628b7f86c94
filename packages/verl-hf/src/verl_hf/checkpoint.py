"""Atomic checkpoint folders: complete states in subfolders, a pointer file names the current one.

A save writes a fresh hidden subfolder, fsyncs it, renames it into place and then atomically
replaces the ``latest`` pointer file, so a crash at any point leaves the previous state loadable.
Older states are removed only after the pointer moved. Tensors are written with safetensors
(model) and ``torch.save`` (optimizer, scheduler, RNG, step), and read back with safetensors and
``torch.load(weights_only=True)``: loading never unpickles arbitrary objects.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any, Final

import torch

from verl_core.enginekit.checkpoint import fsync_dir, write_atomic
from verl_core.kernel.errors import CheckpointError, ConfigError

__all__ = [
    "CHECKPOINT_FORMAT",
    "commit_state_dir",
    "current_state_dir",
    "fsync_tree",
    "get_rng_state",
    "new_state_name",
    "set_rng_state",
    "verify_rng_state",
]

CHECKPOINT_FORMAT: Final = "verl_hf.checkpoint/1"
_POINTER: Final = "latest"


def new_state_name(step: int) -> str:
    """A fresh, unique subfolder name for the state of optimizer step ``step``."""
    return f"state-{step:08d}-{uuid.uuid4().hex[:8]}"


def partial_dir(root: Path, name: str) -> Path:
    """Where a state is written before it is committed."""
    return root / f".{name}.partial"


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the folder itself."""
    for sub in sorted(path.rglob("*")):
        if sub.is_file():
            with open(sub, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def commit_state_dir(root: Path, name: str) -> None:
    """Rename the written state into place, point ``latest`` at it, then drop older states."""
    part = partial_dir(root, name)
    fsync_tree(part)
    os.rename(part, root / name)
    fsync_dir(root)
    write_atomic(root / _POINTER, name + "\n")
    for old in root.iterdir():
        if old.name == name or old.name == _POINTER:
            continue
        if old.name.startswith(("state-", ".state-", f".{_POINTER}.")):
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def current_state_dir(root: str | os.PathLike[str]) -> Path:
    """The committed state folder of checkpoint ``root``.

    Raises:
        ConfigError: ``root`` holds no committed checkpoint.
    """
    base = Path(root)
    pointer = base / _POINTER
    if not pointer.is_file():
        raise ConfigError(
            f"no checkpoint at {str(base)!r}: expected a folder written by save_checkpoint with a "
            f"{_POINTER!r} file; check the path"
        )
    name = pointer.read_text().strip()
    state = base / name
    if not state.is_dir():
        raise ConfigError(f"checkpoint {str(base)!r} points at {name!r}, which is missing; the folder was edited")
    return state


def get_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA) and Python RNG states, storable with weights-only loading."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def verify_rng_state(state: Any, checkpoint: Path) -> None:
    """Check that ``state`` is what :func:`get_rng_state` returned, so :func:`set_rng_state` cannot fail.

    Raises:
        CheckpointError: the state is not a dict with a torch generator state like this process's
            and a Python ``random`` state; the message names the checkpoint.
    """
    live = torch.get_rng_state()
    saved = state.get("torch") if isinstance(state, dict) else None
    py = state.get("python") if isinstance(state, dict) else None
    if not (
        isinstance(saved, torch.Tensor) and saved.dtype == live.dtype and saved.shape == live.shape
        and isinstance(py, tuple | list) and len(py) == 3 and isinstance(py[1], tuple | list)
        and len(py[1]) == len(random.getstate()[1])
    ):
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: the RNG state is not a torch and Python generator state "
            f"(torch: uint8 tensor of shape {tuple(live.shape)}); the file is corrupted or foreign"
        )


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
