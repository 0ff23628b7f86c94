"""What a training run keeps in its output folder, shared by ``verl train`` and ``verl sft``.

* :func:`build_run_model`: the tiny random model a run builds in ``<output_dir>/model`` when
  ``model.path`` is empty;
* :func:`engine_spec`: the :class:`~verl_core.kernel.engine.EngineSpec` of a role from the run config;
* checkpoints: :func:`write_checkpoint` writes ``<output_dir>/checkpoints/step-N`` atomically (each
  engine's folder, ``trainer_state.json`` and a manifest of sizes and hashes) and prunes old ones;
  :func:`latest_checkpoint` finds the newest; :func:`read_state` checks ``trainer_state.json``
  field by field; :func:`load_engine_checkpoint` restores one engine; :func:`rng_state` and
  :func:`set_rng_state` carry the process RNG streams.

``trainer_state.json`` holds ``step``, ``weight_version``, ``rng``, ``schedulers`` (one entry per
micro-batched role), ``algorithm``, ``config`` and, for runs other than RL, ``trainer`` naming the
runner (``"sft"``); a checkpoint is loaded only by the runner that wrote it.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from verl_core.kernel.engine import EngineSpec, OptimConfig, Role
from verl_core.kernel.errors import CheckpointError, ConfigError, VerlError
from verl_core.kernel.training import TrainingEngine
from verl_core.trainer.config import RunConfig
from verl_core.trainer.run.folder import RunDir
from verl_core.trainer.run.integrity import fsync_dir, write_manifest

__all__ = [
    "STATE_FILE",
    "build_run_model",
    "checkpoint_folders",
    "engine_spec",
    "latest_checkpoint",
    "load_engine_checkpoint",
    "read_state",
    "rng_state",
    "set_rng_state",
    "write_checkpoint",
]

STATE_FILE: Final = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_COMMANDS: Final = {"rl": "verl train", "sft": "verl sft"}


# ---------------------------------------------------------------------------- model and engines
def build_run_model(config: RunConfig, run: RunDir, *, max_position: int) -> str:
    """The run's model folder: ``model.path``, or a tiny random model built in ``<output_dir>/model``.

    The tiny model (shape from the ``model`` section, init seeded by ``seed``) is built once, in a
    temporary folder named by the run id that is renamed into place, so a killed build never
    leaves a partial model and never touches another run's files.

    Raises:
        ConfigError: ``model.path`` is empty and transformers is not installed.
    """
    m = config.model
    if m.path:
        return m.path
    dest = run.path / "model"
    if (dest / "config.json").is_file():
        return str(dest)
    from verl_core.trainer.inputs.tiny_model import TinyModelSpec, build_tiny_model

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "config key 'model.path' is empty, which builds a tiny random model with transformers; "
            "install it (pip install verl-hf) or set model.path to a transformers folder"
        )
    spec = TinyModelSpec(
        arch=m.arch, tied=m.tied, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        intermediate_size=m.intermediate_size, vocab_size=m.vocab_size, max_position=max_position,
        init_std=m.init_std, seed=config.seed,
    )
    tmp = run.model_tmp  # named by the run id: a leftover of this run's killed build, never another's
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, spec)
    os.replace(tmp, dest)
    return str(dest)


def engine_spec(
    config: RunConfig, role: Role, path: str, *, max_prompt_len: int, max_response_len: int,
    optim: OptimConfig | None = None,
) -> EngineSpec:
    """The spec a run builds ``role``'s engine from: the ``model`` section, the seed and the role's options."""
    m = config.model
    kwargs: dict[str, Any] = {}
    if optim is not None:
        kwargs["optim"] = optim
    return EngineSpec(
        model_path=path, role=role, dtype=m.dtype, device=m.device, seed=config.seed,
        options=dict(config.backends.options.get(role, {})),
        max_prompt_len=max_prompt_len, max_response_len=max_response_len, **kwargs,
    )


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
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for role, engine in engines.items():
        engine.save_checkpoint(tmp / role)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    write_manifest(tmp)  # sizes and hashes, after every file is fsynced
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
