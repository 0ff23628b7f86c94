"""What keeps a run's work safe: checkpoint manifests, step failures that name their stage, the skip guard.

A checkpoint folder is complete once it has been renamed into place (the rename is the commit);
its ``manifest.json`` lists every file with its size and SHA-256, so a checkpoint truncated or
corrupted later (a full disk, a bad copy, bit rot) is reported as such instead of being loaded.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from verl_core.enginekit.checkpoint import fsync_dir, write_atomic
from verl_core.kernel.errors import CheckpointError, ConfigError, VerlError
from verl_core.trainer.pipeline import StageError

__all__ = [
    "MANIFEST_FILE",
    "RESUME_SAFE_KEYS",
    "StepFailedError",
    "TrainingDivergedError",
    "fsync_dir",
    "resume_config_changes",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST_FILE: Final = "manifest.json"
_FORMAT: Final = "verl.checkpoint-manifest/1"
_CHUNK: Final = 1 << 20

RESUME_SAFE_KEYS: Final[tuple[str, ...]] = (
    "steps",  # the length of the run; refused when a cosine schedule is stretched by it
    "max_consecutive_skips",  # when the divergence guard stops the run, not what a step computes
    "output_dir",  # the run folder may have been moved or copied
    "overwrite",  # whether a fresh run may take over a used output folder
    "logging.*",  # progress line, plot, metrics file
    "checkpoint.*",  # cadence, how many are kept, the final one
    "batch.buffer_memory_bytes",  # spilled samples are read back bit for bit, in the same order
    "ray.address",
    "ray.num_cpus_per_worker",
    "ray.num_gpus_per_worker",
    "ray.strategy",
    "ray.num_cpus",
    "ray.object_store_memory",
    "ray.placement_timeout_s",
)
"""Config keys (``fnmatch`` patterns over dotted keys) a resumed run may change: none changes what
a step computes, so the resumed run still matches an uninterrupted one. Every other key must equal
the checkpoint's (the learning rate, the model, the batch and micro-batch bounds, the backends and
their options, the executor, the placement and parallel sizes, ...)."""

_ABSENT: Final = "(absent)"
_COSINE_STRETCHED_BY: Final = ("optim.schedule", "critic_optim.schedule")


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


def _manifest_text(manifest: Any) -> str:
    """The one serialization of a manifest: a reader refuses any other bytes, even equal JSON."""
    return json.dumps(manifest, indent=1, sort_keys=True)


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
    write_atomic(dest, _manifest_text({"format": _FORMAT, "files": entries}))
    return dest


def verify_checkpoint(folder: str | os.PathLike[str], *, required: Iterable[str] = ()) -> None:
    """Check a checkpoint folder against its manifest: the same files, sizes and SHA-256.

    The manifest must list exactly the files in the folder (besides itself): a file present but not
    listed, a listed file absent, an empty manifest or one that misses a ``required`` file is
    refused, so nothing is loaded that the manifest does not vouch for. Sizes are compared for
    every file before any file is hashed, so a truncated checkpoint is refused without reading it.

    Args:
        folder: The checkpoint folder.
        required: Paths relative to ``folder`` that the loader reads: a file that must be listed,
            or a folder that must hold at least one listed file.

    Raises:
        CheckpointError: the folder or its manifest is missing or unreadable; the manifest lists no
            file, misses a file present or required, or lists one that is missing; a file is
            shorter or longer than recorded (truncated) or has other bytes (corrupted). The message
            names the checkpoint and the file and says what to do.
    """
    ckpt = Path(folder)
    fix = (
        "move this checkpoint folder away so --resume picks the previous one, or restore it from a copy"
    )
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not exist (expected a folder)")
    path = ckpt / MANIFEST_FILE
    try:
        text = path.read_text()
        manifest = json.loads(text)
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
    if not files:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: {MANIFEST_FILE} lists no files; {fix}")
    present = {p.relative_to(ckpt).as_posix(): p for p in _files(ckpt)}
    missing = sorted(files.keys() - present.keys())
    if missing:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} is incomplete: file {missing[0]!r} is missing"
            f"{_and_more(missing)}; {fix}"
        )
    unlisted = sorted(present.keys() - files.keys())
    if unlisted:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: file {unlisted[0]!r}{_and_more(unlisted)} is not listed in "
            f"{MANIFEST_FILE} (the manifest is partial, or the file was added after the checkpoint was "
            f"written); {fix}"
        )
    for need in required:
        if need not in files and not any(rel.startswith(need.rstrip("/") + "/") for rel in files):
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} is incomplete: {need!r}, which the loader reads, is missing "
                f"(not in {MANIFEST_FILE}); {fix}"
            )
    if text != _manifest_text(manifest):
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {MANIFEST_FILE} was changed after it was written (its bytes are "
            f"not the form Trainer.save_checkpoint writes); {fix}"
        )
    for rel, entry in sorted(files.items()):
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            raise CheckpointError(f"checkpoint {str(ckpt)!r}: {MANIFEST_FILE} entry {rel!r} is corrupted; {fix}")
        size = present[rel].stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "corrupted"
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} is {what}: file {rel!r} has {size} bytes, the manifest "
                f"records {entry['bytes']}; {fix}"
            )
    for rel, entry in sorted(files.items()):
        if _digest(present[rel]) != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} is corrupted: file {rel!r} does not match its SHA-256 in the "
                f"manifest; {fix}"
            )


def _and_more(names: list[str]) -> str:
    if len(names) < 2:
        return ""
    shown = ", ".join(repr(n) for n in names[1:4])
    return f" (and {len(names) - 1} more: {shown}{', ...' if len(names) > 4 else ''})"


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    # every table is flattened, options included, so a change names the one option that changed;
    # an empty table holds nothing and is left out
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_config_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], checkpoint: str | os.PathLike[str]
) -> list[str]:
    """Compare the config saved in a checkpoint with the current one, key by dotted key.

    Args:
        saved: The checkpoint's config (``config_to_dict`` form).
        current: The config of the run that resumes.
        checkpoint: The checkpoint folder (named in the error).

    Returns:
        ``"key: old -> new"`` for each changed key that :data:`RESUME_SAFE_KEYS` allows (empty when
        nothing changed), for the caller to log.

    Raises:
        ConfigError: a key outside :data:`RESUME_SAFE_KEYS` changed (or ``steps`` changed under a
            cosine learning-rate schedule, whose length it sets); every such key is listed with its
            old and new value, with the two ways to proceed.
    """
    old, new = _flat(saved), _flat(current)
    allowed: list[str] = []
    refused: list[str] = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before == after:
            continue
        line = f"{key}: {before!r} -> {after!r}"
        cosine = key == "steps" and any(new.get(k) == "cosine" for k in _COSINE_STRETCHED_BY)
        if any(fnmatch.fnmatchcase(key, pat) for pat in RESUME_SAFE_KEYS) and not cosine:
            allowed.append(line)
        else:
            refused.append(line + (" (it sets the length of the cosine learning-rate schedule)" if cosine else ""))
    if refused:
        raise ConfigError(
            f"cannot resume from {str(checkpoint)!r}: {len(refused)} config key(s) differ from the "
            f"checkpoint's and would change what the remaining steps compute: {'; '.join(refused)}. "
            "Resume with the checkpoint's values for these keys (the saved config is the 'config' "
            "entry of its trainer_state.json), or start a new run in another output_dir. Keys a "
            f"resume may change: {', '.join(RESUME_SAFE_KEYS)}"
        )
    return allowed
