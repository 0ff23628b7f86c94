"""What keeps a run's work safe: checkpoint manifests, step failures that name their stage, the skip guard.

A checkpoint folder is complete once it has been renamed into place (the rename is the commit);
its ``manifest.json`` lists every file with its size and SHA-256, so a checkpoint truncated or
corrupted later (a full disk, a bad copy, bit rot) is reported as such instead of being loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Final

from verl_core.checkpoint import fsync_dir
from verl_core.errors import CheckpointError, VerlError
from verl_core.trainer.pipeline import StageError

__all__ = [
    "MANIFEST_FILE",
    "StepFailedError",
    "TrainingDivergedError",
    "fsync_dir",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST_FILE: Final = "manifest.json"
_FORMAT: Final = "verl.checkpoint-manifest/1"
_CHUNK: Final = 1 << 20


class StepFailedError(StageError):
    """A stage of a training step raised; the step was abandoned and the last good state is on disk.

    Attributes:
        stage: The stage that failed (rollout, reward, reference, actor_forward, critic_forward,
            advantages, update, weight_sync, ...).
        backend: The backend that ran the stage (``rule`` for the built-in reward).
        step: The 1-based step that failed.
        checkpoint: The newest complete checkpoint (None when none was written yet).
    """

    def __init__(
        self, stage: str, backend: str, step: int, error: BaseException, checkpoint: Path | None
    ) -> None:
        where = f"resume from {str(checkpoint)!r} with `verl train CONFIG --resume`" if checkpoint else (
            "no checkpoint was written yet: restart the run"
        )
        VerlError.__init__(
            self,
            f"step {step}: stage {stage!r} (backend {backend!r}) failed: {type(error).__name__}: {error}. "
            f"The step was abandoned and nothing of it was saved; the last good state is on disk: {where}",
        )
        self.stage = stage
        self.backend = backend
        self.step = step
        self.checkpoint = checkpoint


class TrainingDivergedError(VerlError, RuntimeError):
    """Too many optimizer steps in a row were skipped for a non-finite loss or gradient."""


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(folder: Path) -> Path:
    """fsync every file under ``folder`` and write ``manifest.json`` with their sizes and SHA-256."""
    entries: dict[str, dict[str, Any]] = {}
    for p in _files(folder):
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
        entries[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size, "sha256": _digest(p)}
    for d in sorted({p.parent for p in _files(folder)} | {folder}):
        fsync_dir(d)
    dest = folder / MANIFEST_FILE
    with open(dest, "w") as fh:
        json.dump({"format": _FORMAT, "files": entries}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(folder)
    return dest


def verify_checkpoint(folder: str | os.PathLike[str]) -> None:
    """Check every file of a checkpoint folder against its manifest.

    Raises:
        CheckpointError: the folder or its manifest is missing or unreadable, or a listed file is
            missing, shorter or longer than recorded (truncated), or has other bytes (corrupted).
            The message names the checkpoint and the file and says what to do.
    """
    ckpt = Path(folder)
    fix = (
        "move this checkpoint folder away so --resume picks the previous one, or restore it from a copy"
    )
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not exist (expected a folder)")
    path = ckpt / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} has no {MANIFEST_FILE}: it is incomplete or was not written by "
            f"Trainer.save_checkpoint; {fix}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: {MANIFEST_FILE} is corrupted ({e}); {fix}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or not isinstance(files, dict):
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {MANIFEST_FILE} is not a {_FORMAT} manifest; {fix}"
        )
    for rel, entry in sorted(files.items()):
        p = ckpt / rel
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            raise CheckpointError(f"checkpoint {str(ckpt)!r}: {MANIFEST_FILE} entry {rel!r} is corrupted; {fix}")
        if not p.is_file():
            raise CheckpointError(f"checkpoint {str(ckpt)!r} is incomplete: file {rel!r} is missing; {fix}")
        size = p.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "corrupted"
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} is {what}: file {rel!r} has {size} bytes, the manifest "
                f"records {entry['bytes']}; {fix}"
            )
        if _digest(p) != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} is corrupted: file {rel!r} does not match its SHA-256 in the "
                f"manifest; {fix}"
            )
