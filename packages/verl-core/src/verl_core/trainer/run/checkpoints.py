"""A run's checkpoints, one owner: layout, manifests, RNG state, resume rules, saving and loading.

Shared by ``verl train`` and ``verl sft``.

* Layout: ``<output_dir>/checkpoints/step-N`` holds each engine's folder, ``trainer_state.json``
  and ``manifest.json``; :func:`write_checkpoint` writes it atomically (the rename into place is
  the commit) and prunes old ones; :func:`latest_checkpoint` finds the newest.
* Manifests: :func:`write_manifest` lists every file with its size and SHA-256, so a checkpoint
  truncated or corrupted later (a full disk, a bad copy, bit rot) is reported as such by
  :func:`verify_checkpoint` instead of being loaded.
* State: :func:`read_state` checks ``trainer_state.json`` field by field; :func:`rng_state` and
  :func:`set_rng_state` carry the process RNG streams; :func:`load_engine_checkpoint` restores one
  engine.
* Resume rules: :func:`resume_config_changes` compares a resumed run's config with the
  checkpoint's (:data:`RESUME_SAFE_KEYS` may change).
* :class:`Checkpointer` ties these together for a runner: it saves the fields every runner saves
  (step, RNG streams, config, non-finite skips in a row) plus the runner's own, and loads a
  checkpoint only after every check passed (manifest, each state field, config changes, the data
  order's position).

``trainer_state.json`` holds ``step``, ``weight_version``, ``rng``, ``schedulers`` (one entry per
micro-batched role), ``algorithm``, ``config`` and, for runs other than RL, ``trainer`` naming the
runner (``"sft"``); a checkpoint is loaded only by the runner that wrote it.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import fnmatch
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from verl_core.enginekit.checkpoint import fsync_dir, write_atomic
from verl_core.kernel.errors import CheckpointError, ConfigError, StorageError, VerlError, describe
from verl_core.kernel.training import TrainingEngine
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler
from verl_core.trainer.config import RunConfig, config_to_dict
from verl_core.trainer.inputs.data import PromptSampler
from verl_core.trainer.run.folder import no_checkpoint_ways_out

__all__ = [
    "Checkpointer",
    "MANIFEST_FILE",
    "RESUME_SAFE_KEYS",
    "Restored",
    "STATE_FILE",
    "checkpoint_folders",
    "fsync_dir",
    "latest_checkpoint",
    "load_engine_checkpoint",
    "read_data_state",
    "read_state",
    "resume_config_changes",
    "rng_state",
    "set_rng_state",
    "verify_checkpoint",
    "write_failed",
    "write_checkpoint",
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
    "ray.max_rollout_restarts",  # a replaced rollout serves the same weights and samples the same
)
"""Config keys (``fnmatch`` patterns over dotted keys) a resumed run may change: none changes what
a step computes, so the resumed run still matches an uninterrupted one. Every other key must equal
the checkpoint's (the learning rate, the model, the batch and micro-batch bounds, the backends and
their options, the executor, the placement and parallel sizes, ...)."""

_ABSENT: Final = "(absent)"
_COSINE_STRETCHED_BY: Final = ("optim.schedule", "critic_optim.schedule")


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
        nothing changed), for the caller to log. A key the checkpoint's config does not have (a
        section added by a later release) is no change while it holds its default.

    Raises:
        ConfigError: a key outside :data:`RESUME_SAFE_KEYS` changed (or ``steps`` changed under a
            cosine learning-rate schedule, whose length it sets); every such key is listed with its
            old and new value, with the two ways to proceed.
    """
    old, new = _flat(saved), _flat(current)
    defaults = _flat(config_to_dict(RunConfig()))
    allowed: list[str] = []
    refused: list[str] = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before == after:
            continue
        if key not in old and key in defaults and after == defaults[key]:
            continue  # a key newer than the checkpoint, at the default that reproduces its behaviour
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


STATE_FILE: Final = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_COMMANDS: Final = {"rl": "verl train", "sft": "verl sft"}


# ---------------------------------------------------------------------------- checkpoints
def write_checkpoint(
    root: Path, step: int, engines: Mapping[str, TrainingEngine], state: Mapping[str, Any], *, keep: int
) -> Path:
    """Write ``root/step-<step>`` atomically and keep the newest ``keep`` checkpoints; returns the folder.

    Each engine saves into the folder named by its role; ``state`` is written as
    ``trainer_state.json``; a manifest lists every file with its size and SHA-256. The folder
    appears under its final name only when complete, and a checkpoint being replaced or pruned is
    renamed out of the ``step-*`` names before it is deleted.
    """
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for role, engine in engines.items():
            _save_engine(engine, role, tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)  # sizes and hashes, after every file is fsynced
    except OSError as e:  # a full disk, a quota, a file too large: the half-written folder goes
        shutil.rmtree(tmp, ignore_errors=True)
        kept = checkpoint_folders(root)
        raise StorageError(
            f"checkpoint {str(final)!r} could not be written: {e.strerror or e}"
            f"{f' ({e.filename})' if e.filename else ''}; nothing of it was kept, "
            + (f"the newest complete checkpoint is {str(kept[-1])!r}; free space and continue with --resume" if kept
               else "and the run has no checkpoint yet; free space and start it again")
        ) from e
    # Every step below is a rename, so a crash at any point leaves complete checkpoints only:
    # a folder being replaced or pruned is first renamed out of the step-* namespace.
    if final.exists():
        os.replace(final, root / f".trash-{final.name}-{time.monotonic_ns()}")
    os.replace(tmp, final)
    fsync_dir(root)
    for old in checkpoint_folders(root)[:-keep]:
        if old != final:  # never the one just written, even below older runs' step numbers
            os.replace(old, root / f".trash-{old.name}-{time.monotonic_ns()}")
    fsync_dir(root)
    for stale in root.glob(".trash-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def write_failed(error: BaseException) -> bool:
    """Whether ``error`` is a failed write (a full disk, a quota, a file too large) however the library said it.

    ``OSError`` itself, and what the writers of weights wrap it in: safetensors' "I/O error ... (os
    error N)", torch.save's stream errors ("unexpected pos", "iostream error", "failed writing").
    """
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError):
            return True
        text = str(e) if e is not None else ""
        if any(sign in text for sign in ("I/O error", "os error", "iostream error", "unexpected pos", "failed writing")):
            return True
    return False


def _save_engine(engine: TrainingEngine, role: str, folder: Path) -> None:
    """``engine.save_checkpoint`` into ``folder/role``; a failed write the engine's library wrapped is an OSError again."""
    try:
        engine.save_checkpoint(folder / role)
    except (OSError, VerlError):
        raise
    except Exception as e:
        if write_failed(e):
            raise OSError(f"the {role} engine could not write its state: {e}") from e
        raise


def load_engine_checkpoint(ckpt: Path, role: str, engine: TrainingEngine, backend: str) -> None:
    """Restore ``role``'s engine from its folder of ``ckpt``.

    Raises:
        CheckpointError: the engine cannot load its state (naming the checkpoint, role and backend).
    """
    try:
        engine.load_checkpoint(ckpt / role)
    except VerlError:
        raise
    except Exception as e:  # e.g. a pickle that weights_only loading refuses
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: the {role} engine (backend {backend!r}) cannot load its state: "
            f"{type(e).__name__}: {e}"
        ) from e


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``<output_dir>/checkpoints`` (None when none).

    Newest is the highest step number N of the ``step-N`` folders holding a trainer state
    (``step-1000000`` after ``step-999999``); folders of other names are ignored.
    """
    done = checkpoint_folders(Path(output_dir) / "checkpoints")
    return done[-1] if done else None


def checkpoint_folders(root: Path) -> list[Path]:
    """Complete ``step-N`` folders under ``root``, oldest first by step number (N, not the name)."""
    found: list[tuple[int, str, Path]] = []
    if root.is_dir():
        for p in root.glob("step-*"):
            m = _STEP_DIR.fullmatch(p.name)
            if m and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p.name, p))
    return [p for _, _, p in sorted(found)]


def _b64_save(obj: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def rng_state() -> dict[str, Any]:
    """The process RNG streams (torch, Python, and numpy and CUDA when in use) as JSON-ready values."""
    state: dict[str, Any] = {"torch": _b64_save(torch.get_rng_state()), "python": repr(random.getstate())}
    np = sys.modules.get("numpy")  # its global generator can only have been used once it was imported
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = _b64_save(torch.cuda.get_rng_state_all())
    return state


def _decode_rng(rng: Any, field: Callable[[str, str, Any], CheckpointError]) -> dict[str, Any]:
    """Decode the saved RNG states, each tried on a scratch generator first (nothing global is set)."""
    if not isinstance(rng, dict):
        raise field("rng", "a table of RNG states (torch, python, and numpy/cuda when used)", rng)
    out: dict[str, Any] = {}
    for part in ("torch", "python"):
        if part not in rng:
            raise field(f"rng.{part}", f"the saved {part} RNG state", ...)
    try:
        out["torch"] = torch.load(io.BytesIO(base64.b64decode(rng["torch"], validate=True)), weights_only=True)
        torch.Generator().set_state(out["torch"])
    except Exception:
        raise field("rng.torch", "a base64 torch RNG state", rng["torch"]) from None
    try:
        out["python"] = ast.literal_eval(rng["python"])
        random.Random().setstate(out["python"])
    except Exception:
        raise field("rng.python", "a repr of random.getstate()", rng["python"]) from None
    if "numpy" in rng:
        try:
            import numpy as np

            name, keys, pos, has_gauss, gauss = rng["numpy"]
            out["numpy"] = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss)
            np.random.RandomState().set_state(out["numpy"])
        except ImportError:
            pass  # numpy is not installed here: nothing can draw from its generator
        except Exception:
            raise field("rng.numpy", "numpy.random.get_state() as a list", rng["numpy"]) from None
    if "cuda" in rng:
        try:
            out["cuda"] = torch.load(io.BytesIO(base64.b64decode(rng["cuda"], validate=True)), weights_only=True)
            if not isinstance(out["cuda"], list) or not all(isinstance(t, torch.Tensor) for t in out["cuda"]):
                raise TypeError
        except Exception:
            raise field("rng.cuda", "a base64 list of CUDA RNG states", rng["cuda"]) from None
    return out


def set_rng_state(rng: Mapping[str, Any]) -> None:
    """Restore the RNG streams that :func:`read_state` decoded."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        for i, st in enumerate(rng["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(st, i)


def read_state(
    ckpt: Path, schedulers: Collection[str], algorithm: Collection[str], *, trainer: str = "rl"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``trainer_state.json`` of ``ckpt`` checked field by field, and its decoded RNG states.

    Args:
        ckpt: The checkpoint folder.
        schedulers: The roles whose micro-batch scheduler state the file must hold.
        algorithm: The keys of the algorithm state, each a number.
        trainer: The runner that loads it: ``rl`` (``verl train``, whose states have no
            ``trainer`` field) or ``sft``; a checkpoint of the other runner is refused.

    Raises:
        CheckpointError: the file is not a JSON object, was written by the other runner, or a field
            is missing or has the wrong type or range; the message names the file and the field.
    """
    path = ckpt / STATE_FILE

    def field(name: str, expected: str, value: Any) -> CheckpointError:
        # value ... (Ellipsis) stands for a missing field
        got = "it is missing" if value is ... else f"got {_short(value)}"
        return CheckpointError(
            f"checkpoint {str(ckpt)!r}: {STATE_FILE} field {name!r} must be {expected}, {got}; the file "
            f"is damaged or was not written by `{_COMMANDS[trainer]}`: resume from another checkpoint "
            "or start a new run"
        )

    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: {STATE_FILE} is unreadable ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: {STATE_FILE} must hold a JSON object, got {_short(state)}")
    written_by = state.get("trainer", "rl")
    if written_by != trainer:
        by = _COMMANDS.get(written_by, repr(written_by)) if isinstance(written_by, str) else repr(written_by)
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} was written by `{by}` ({STATE_FILE} field 'trainer' = "
            f"{_short(written_by)}), so `{_COMMANDS[trainer]}` cannot resume it: resume it with the command "
            "that wrote it, or start a new run in another output_dir (a finished `verl sft` run's "
            "model-sft folder is a model.path for `verl train`)"
        )

    def count(table: Mapping[str, Any], key: str, name: str, low: int = 0, optional: bool = False) -> None:
        v = table.get(key, ...)
        if optional and v is ...:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise field(name, f"an integer >= {low}", v)

    count(state, "step", "step")
    count(state, "weight_version", "weight_version")
    count(state, "consecutive_nonfinite_skips", "consecutive_nonfinite_skips", optional=True)
    if not isinstance(state.get("config"), dict):
        raise field("config", "the run's config as a table", state.get("config", ...))
    saved = state.get("schedulers", ...)
    if not isinstance(saved, dict) or set(saved) != set(schedulers):
        raise field("schedulers", f"a table with one entry per role ({', '.join(sorted(schedulers))})", saved)
    for role, s in saved.items():
        if not isinstance(s, dict):
            raise field(f"schedulers.{role}", "a table (ceiling, successes, budget)", s)
        count(s, "ceiling", f"schedulers.{role}.ceiling", low=1)
        count(s, "successes", f"schedulers.{role}.successes")
        for key in ("budget", "refine_from"):  # null: not fixed / no refinement pending
            if s.get(key) is not None:
                count(s, key, f"schedulers.{role}.{key}", low=1 if key == "budget" else 0)
    algo = state.get("algorithm", ...)
    if not isinstance(algo, dict):
        raise field("algorithm", "a table of the algorithm's state", algo)
    for key in algorithm:
        v = algo.get(key, ...)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise field(f"algorithm.{key}", "a number", v)
    return state, _decode_rng(state.get("rng", ...), field)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_data_state(ckpt: Path, state: Mapping[str, Any], sampler: PromptSampler | None) -> dict[str, Any] | None:
    """The data-order position of ``trainer_state.json`` (``data``), checked against the run's sampler.

    A run reading ``data.train`` saves the position of its :class:`PromptSampler`; a run on the
    built-in task (``sampler`` None) saves none. Nothing is changed here: the caller restores it
    once every check passed.

    Raises:
        CheckpointError: the field is missing (or present for a run without data) or malformed.
        ConfigError: the position was saved for another number of rows, seed or shuffle setting
            (the dataset changed since the checkpoint).
    """
    saved = state.get("data", ...)
    if sampler is None and saved is ...:
        return None
    if sampler is None or saved is ... or not isinstance(saved, dict):
        expected = "absent (this run takes its prompts from the built-in task)" if sampler is None else (
            "the data order's position (epoch, index, size, seed, shuffle)"
        )
        got = "it is missing" if saved is ... else f"got {describe(saved)}"
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {STATE_FILE} field 'data' must be {expected}, {got}; the file is "
            "damaged or was not written by this runner's save_checkpoint: resume from another checkpoint or "
            "start a new run"
        )
    for key, kind in (("epoch", int), ("index", int), ("size", int), ("seed", int), ("shuffle", bool)):
        v = saved.get(key, ...)
        if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 0)):
            got = "it is missing" if v is ... else f"got {describe(v)}"
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r}: {STATE_FILE} field 'data.{key}' must be "
                f"{'true or false' if kind is bool else 'an integer >= 0'}, {got}; the file is damaged or was "
                "not written by this runner's save_checkpoint: resume from another checkpoint or start a new run"
            )
    PromptSampler(sampler.size, seed=sampler.seed, shuffle=sampler.shuffle).load_state_dict(saved)  # a dry run
    return saved


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.load` read and checked, for the runner to apply its own fields.

    Attributes:
        path: The checkpoint folder.
        state: ``trainer_state.json``, checked field by field.
        step: The saved step.
        consecutive_skips: Non-finite optimizer steps in a row when it was saved.
    """

    path: Path
    state: Mapping[str, Any]
    step: int
    consecutive_skips: int


class Checkpointer:
    """The checkpoints of one run.

    Args:
        config: The run.
        runner: ``rl`` (``verl train``) or ``sft``; a checkpoint is loaded only by the runner that wrote it.
        say: Where the allowed config changes of a resume are reported.

    Attributes:
        on_disk_step: The step whose checkpoint this run wrote or loaded last (-1: none).
    """

    def __init__(self, config: RunConfig, *, runner: str = "rl", say: Callable[[str], None]) -> None:
        self.config = config
        self.root = Path(config.output_dir) / "checkpoints"
        self.runner = runner
        self._say = say
        self._rng: dict[str, Any] = {}
        self.on_disk_step = -1

    def save(
        self, step: int, engines: Mapping[str, TrainingEngine], state: Mapping[str, Any], *, consecutive_skips: int,
    ) -> Path:
        """Write ``step-<step>`` with ``engines`` and ``state`` plus the common fields; returns its folder."""
        full: dict[str, Any] = {"step": step, "rng": rng_state(), **state, "config": config_to_dict(self.config),
                                "consecutive_nonfinite_skips": consecutive_skips}
        if self.runner != "rl":
            full = {"trainer": self.runner, **full}
        final = write_checkpoint(self.root, step, engines, full, keep=self.config.checkpoint.keep)
        self.on_disk_step = step
        return final

    def to_resume(self) -> Path:
        """The newest checkpoint, which ``--resume`` continues from.

        Raises:
            ConfigError: the run has no checkpoint.
        """
        ckpt = latest_checkpoint(self.root.parent)
        if ckpt is None:
            raise ConfigError(
                f"--resume: the run in {str(self.root.parent)!r} never reached a checkpoint (none under "
                f"{str(self.root)!r}), so there is nothing to resume; start it again without --resume: "
                f"{no_checkpoint_ways_out(self.root.parent)}"
            )
        return ckpt

    def load(
        self, path: Path, engines: Mapping[str, TrainingEngine], schedulers: Mapping[str, DynamicBatchScheduler], *,
        algorithm_state: Collection[str] = (), sampler: PromptSampler | None = None,
    ) -> Restored:
        """Check the checkpoint at ``path``, then restore ``engines``, ``schedulers`` and ``sampler`` from it.

        Nothing is restored unless every check passes. The process RNG streams are restored last,
        by :meth:`restore_rng`, once the runner applied its own fields.

        Raises:
            CheckpointError: the manifest, a file, or a field of ``trainer_state.json`` (named).
            ConfigError: config keys that change the math differ from the checkpoint's (all
                listed), or the dataset changed since it was written.
        """
        verify_checkpoint(path, required=(STATE_FILE, *engines))
        state, self._rng = read_state(path, schedulers, algorithm_state, trainer=self.runner)
        allowed = resume_config_changes(state["config"], config_to_dict(self.config), path)
        data = read_data_state(path, state, sampler)
        if allowed:
            self._say("resume: changed keys allowed: " + "; ".join(allowed))
        for role, engine in engines.items():
            load_engine_checkpoint(path, role, engine, getattr(self.config.backends, role))
        for role, s in state["schedulers"].items():
            schedulers[role].load_state_dict(s)
        if sampler is not None and data is not None:
            sampler.load_state_dict(data)
        step = int(state["step"])
        self.on_disk_step = step
        return Restored(path, state, step, int(state.get("consecutive_nonfinite_skips", 0)))

    def restore_rng(self) -> None:
        """Restore the RNG streams of the checkpoint :meth:`load` read last."""
        set_rng_state(self._rng)
