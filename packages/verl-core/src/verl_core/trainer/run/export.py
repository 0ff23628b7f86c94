"""Export a checkpoint of ``verl train`` as a transformers folder that transformers and vLLM load.

:func:`export_checkpoint` reads the run config saved in the checkpoint, builds the actor engine
of the run's backend through the registry, restores the checkpoint into it and writes the
canonical weight stream (:meth:`~verl_core.kernel.training.TrainingEngine.export_weights`, transformers
naming) into safetensors shards next to the model folder's config, tokenizer and generation
config. For a run that trained a LoRA adapter (``model.lora``) that stream is the merged weights;
with ``adapter_only`` the adapter stream
(:meth:`~verl_core.kernel.training.TrainingEngine.export_adapter`) is written as a PEFT adapter
folder instead. Nothing here knows which backend wrote the checkpoint.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from verl_core.enginekit.checkpoint import fsync_dir
from verl_core.enginekit.lora import write_adapter_folder
from verl_core.enginekit.weight_stream import apply_weight_stream
from verl_core.kernel.errors import (
    CheckpointError,
    ConfigError,
    PluginError,
    UnknownNameError,
    VerlError,
)
from verl_core.kernel.registry import get_training_engine
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.weights import WeightManifest
from verl_core.trainer.config import RunConfig, config_from_dict
from verl_core.trainer.inputs.tasks import get_task
from verl_core.trainer.run.checkpoints import latest_checkpoint, verify_checkpoint
from verl_core.trainer.run.folder import MARKER_FILE, RunDir
from verl_core.trainer.run.model import engine_spec

__all__ = ["DEFAULT_SHARD_BYTES", "check_export_target", "export_checkpoint", "resolve_checkpoint"]

DEFAULT_SHARD_BYTES: Final = 5 * 1024**3
"""Largest safetensors shard :func:`export_checkpoint` writes (the size transformers shards at)."""

_STATE_FILE: Final = "trainer_state.json"
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
# The test kit marks a folder holding its own random init with this file; exported weights are not that.
_NOT_COPIED: Final = frozenset({"verl_tiny_model.json"})
_DTYPE_NAMES: Final = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MANIFEST_FILE: Final = "manifest.json"
_MANIFEST_FORMAT: Final = "verl.checkpoint-manifest/"
_STEP_NAME: Final = re.compile(r"\.?step-\d+.*")  # a checkpoint, or one being written, replaced or pruned


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``path`` names: a ``step-N`` folder, or a run's newest complete one.

    Args:
        path: A checkpoint folder (``<output_dir>/checkpoints/step-N``) or a run output folder
            (``<output_dir>``, whose newest complete checkpoint is taken).

    Raises:
        CheckpointError: ``path`` is neither, or the run has no complete checkpoint.
    """
    p = Path(path)
    if (p / _STATE_FILE).is_file():
        return p
    if not p.is_dir():
        what = "is a file, not a folder" if p.exists() else "does not exist"
        raise CheckpointError(
            f"checkpoint {str(p)!r} {what}; pass a run output folder or one of its checkpoints/step-N folders"
        )
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"{str(p)!r} is not a checkpoint (no {_STATE_FILE}) and holds no complete checkpoint under "
            f"checkpoints/step-*; pass the output_dir of a `verl train` run that saved one "
            "(checkpoint.final or checkpoint.every) or one of its checkpoints/step-N folders"
        )
    return latest


def export_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    device: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    run: RunDir | None = None,
    adapter_only: bool = False,
) -> Path:
    """Write the actor of a ``verl train`` checkpoint as a transformers folder; returns the folder
    (as an absolute path, symbolic links and ``..`` resolved).

    The folder holds the weights as safetensors (``model.safetensors``, or numbered shards and
    their index), the model folder's ``config.json`` (``tie_word_embeddings`` and ``dtype`` set to
    what the weights are), its tokenizer files and its ``generation_config.json`` (created with
    the tokenizer's EOS and pad ids when the model folder has none).
    ``AutoModelForCausalLM.from_pretrained`` and vLLM load it as they load any model folder.
    Everything is written into a temporary folder next to ``out_dir`` that is renamed into place
    at the end, so ``out_dir`` never holds a partial export.

    ``out_dir`` must lie outside every checkpoint folder and outside every run folder (a folder
    holding ``verl_run.json``) but ``run``'s: files added there would not be listed in a
    checkpoint's manifest (``--resume`` would then refuse the checkpoint), and a run's folder holds
    only what its run writes. This is checked before anything is written.

    Args:
        checkpoint_dir: A checkpoint folder (``<output_dir>/checkpoints/step-N``) or a run output
            folder (its newest complete checkpoint is exported).
        out_dir: The folder to create; it must not exist or be empty.
        device: Device to load the actor on (default: the run's ``model.device``).
        max_shard_bytes: Largest safetensors file; bigger models are split into shards.
        run: The claim of the run folder that may hold ``out_dir`` (``verl sft`` exports into
            its own folder); never inside that run's ``checkpoints``.

    Raises:
        ConfigError: ``out_dir`` is not empty, lies inside a checkpoint or another run's folder,
            lies under a file, or cannot be written; the saved config does not load, the run's
            model folder is missing, or the actor's backend is not installed.
        adapter_only: Write only the LoRA adapter of a ``model.lora`` run, as a PEFT adapter
            folder (``adapter_config.json``, ``adapter_model.safetensors``) that
            ``PeftModel.from_pretrained`` loads onto the run's base model.

    Raises:
        ConfigError: ``out_dir`` is not empty, the saved config does not load, the run's model
            folder is missing, the actor's backend is not installed, or ``adapter_only`` for a
            run that trained no adapter.
        CheckpointError: not a checkpoint, or a file of it is missing, corrupted or unreadable.
    """
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"export folder {str(out)!r} already exists and is not an empty folder; "
            "pass a new folder, or move that one away first"
        )
    dest = check_export_target(out, run=run)  # where the files land: links and '..' resolved
    ckpt = resolve_checkpoint(checkpoint_dir)
    verify_checkpoint(ckpt)
    config = _saved_config(ckpt, device)
    if adapter_only and not config.model.lora.enabled:
        raise ConfigError(
            f"checkpoint {str(ckpt)!r}: --adapter-only (adapter_only=True) needs a run that trained a LoRA adapter, "
            "but its model.lora.enabled is false; export its full weights without it"
        )
    model_dir = _model_folder(ckpt, config)
    engine = _build_actor(ckpt, config, model_dir)
    tmp = dest.parent / f".{dest.name}.export-{os.getpid()}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if adapter_only:
            _write_adapter(ckpt, engine, tmp, config, model_dir)
        else:
            manifest = _write_weights(ckpt, engine, tmp, max_shard_bytes)
            _copy_model_files(model_dir, tmp, manifest)
            _ensure_generation_config(tmp, engine.tokenizer)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, dest)  # replaces an empty folder too
        fsync_dir(dest.parent)
    except OSError as e:  # a full disk, no permission, a folder that appeared meanwhile
        raise ConfigError(
            f"export folder {str(out)!r} cannot be written ({type(e).__name__}: {e}); nothing was left "
            "there: free some space or choose a folder you can write"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        engine.close()
    return dest


def check_export_target(out_dir: str | os.PathLike[str], *, run: RunDir | None = None) -> Path:
    """Refuse an export folder that lies inside a checkpoint, inside a run folder other than
    ``run``'s, or under a file; writes nothing. Returns where the folder really is (symbolic links
    and ``..`` resolved), which is where the export writes.

    Raises:
        ConfigError: naming ``out_dir``, the folder it lies in and what to do.
    """
    out = Path(out_dir)
    try:
        target = out.resolve()  # through symbolic links: where the files would really land
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"export folder {str(out)!r} cannot be resolved ({e}); choose another folder") from e
    own = run.path.resolve() if run is not None and run.held else None
    for folder in (target, *target.parents):
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise ConfigError(
                f"export folder {str(out)!r}: {str(folder)!r} is a file, so no folder can be created under it; "
                "choose a path whose parent folders are folders"
            )
        if _is_checkpoint(folder):
            raise ConfigError(
                f"export folder {str(out)!r} lies inside the checkpoint {str(folder)!r}; files added there are "
                "not in its manifest, and --resume would refuse the checkpoint. Export to a folder outside the "
                f"run, e.g. {str(_beside(folder))!r}"
            )
        if (folder / MARKER_FILE).is_file() and folder != own:
            raise ConfigError(
                f"export folder {str(out)!r} lies inside the run folder {str(folder)!r} (it holds {MARKER_FILE}); "
                "a run's folder holds only what its run writes (overwrite=true moves it aside as a whole). "
                f"Export to a folder outside the run, e.g. {str(_beside(folder))!r}"
            )
        if folder.name == "checkpoints" and folder.parent == own:
            raise ConfigError(
                f"export folder {str(out)!r} lies inside the checkpoints of the run in {str(own)!r}; "
                "export next to them, not among them"
            )
    if target == Path(target.anchor):
        raise ConfigError(f"export folder {str(out)!r} is the filesystem root; name a folder to create")
    return target


def _is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint (its trainer state or a verl manifest), or named like one in a
    ``checkpoints`` folder."""
    if (folder / _STATE_FILE).is_file():
        return True
    if _STEP_NAME.fullmatch(folder.name) and folder.parent.name == "checkpoints":
        return True
    manifest = folder / _MANIFEST_FILE
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).startswith(_MANIFEST_FORMAT)


def _beside(folder: Path) -> Path:
    """A suggested export folder next to the run that holds ``folder``."""
    run = next((p for p in (folder, *folder.parents) if (p / MARKER_FILE).is_file()), folder)
    return run.with_name(f"{run.name}-hf")


def _saved_config(ckpt: Path, device: str | None) -> RunConfig:
    try:
        state = json.loads((ckpt / _STATE_FILE).read_text())
        saved = state["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {_STATE_FILE} is unreadable or has no run config "
            f"({type(e).__name__}: {e}); export a checkpoint written by `verl train`"
        ) from e
    if device is not None and isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        # the device is checked with the rest of the config: a CUDA run loads on a CPU-only machine
        saved = {**saved, "model": {**saved["model"], "device": device}}
    try:
        return config_from_dict(saved)
    except ConfigError as e:
        hint = "; load it on another device with --device (device= in Python)" if "model.device" in str(e) else ""
        raise ConfigError(
            f"checkpoint {str(ckpt)!r}: the run config saved in its {_STATE_FILE} does not load with "
            f"this verl-core: {e}{hint}"
        ) from e


def _model_folder(ckpt: Path, config: RunConfig) -> Path:
    """The run's model folder: ``model.path``, or the tiny model ``verl train`` built in the run folder."""
    if config.model.path:
        folder = Path(config.model.path)
        where = f"config key 'model.path' of the run ({config.model.path!r})"
    else:
        # The run folder is the checkpoint's grandparent, wherever the run has been moved since.
        folder = ckpt.parent.parent / "model"
        where = "the run's tiny model folder (model.path was empty)"
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{where}: {str(folder)!r} has no config.json; the export copies the model config and "
            "tokenizer from the folder the run trained from, so it must still be there"
        )
    return folder


def _build_actor(ckpt: Path, config: RunConfig, model_dir: Path) -> TrainingEngine:
    """The run's actor engine with the checkpoint's state restored."""
    backend = config.backends.actor
    # The run's engine spec; the export generates nothing, so the prompt bound only has to be valid.
    prompt_len = config.data.max_prompt_len or get_task(config.task.name, config.task.digits).max_prompt_len()
    spec = engine_spec(
        config, "actor", str(model_dir), optim=config.optim.to_optim(config.steps),
        max_prompt_len=prompt_len, max_response_len=config.rollout.max_new_tokens,
    )
    try:
        engine = get_training_engine(backend, spec)
    except (UnknownNameError, PluginError) as e:
        raise ConfigError(
            f"checkpoint {str(ckpt)!r} was trained with actor backend {backend!r}, which cannot be "
            f"loaded here: {e}"
        ) from e
    except VerlError:
        raise
    except Exception as e:  # e.g. the run's CUDA device on a machine without one
        raise ConfigError(
            f"checkpoint {str(ckpt)!r}: its actor engine (backend {backend!r}, device "
            f"{config.model.device!r}) cannot be built here: {type(e).__name__}: {e}; export on a machine "
            "like the run's, or load it on another device with --device (device= in Python)"
        ) from e
    try:
        engine.load_checkpoint(ckpt / "actor")
    except VerlError:
        engine.close()
        raise
    except Exception as e:  # e.g. a pickle that weights-only loading refuses
        engine.close()
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: the actor engine (backend {backend!r}) cannot load its state: "
            f"{type(e).__name__}: {e}"
        ) from e
    return engine


class _ShardWriter:
    """Collects streamed tensors into safetensors files of at most ``max_bytes`` each."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0
        self._pending: dict[str, Tensor] = {}
        self._size = 0

    def add(self, chunk: list[tuple[str, Tensor]]) -> None:
        for name, t in chunk:
            nbytes = t.numel() * t.element_size()
            if self._pending and self._size + nbytes > self.max_bytes:
                self.flush()
            # the stream may reuse a chunk's memory for the next one: keep a copy
            self._pending[name] = t.to("cpu", copy=True).contiguous()
            self._size += nbytes
            self.total += nbytes

    def flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        path = self.folder / f".part-{len(self.files):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self._pending)))
        self._pending, self._size = {}, 0

    def finish(self) -> None:
        """Give the files transformers' names; several get an index mapping each tensor to its file."""
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.files[0][0], self.folder / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_weights(ckpt: Path, engine: TrainingEngine, folder: Path, max_shard_bytes: int) -> WeightManifest:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ConfigError("exporting needs the safetensors package: pip install safetensors") from None
    writer = _ShardWriter(folder, max_shard_bytes)
    stream = iter(engine.export_weights())
    first = next(stream, None)
    if not isinstance(first, WeightManifest):
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: the actor engine's weight stream did not start with a manifest"
        )
    try:
        # the receiver's checks (every listed tensor once, shapes, dtypes, finite values, a commit)
        manifest = apply_weight_stream(
            itertools.chain([first], stream), first.tensors, writer.add, copy=False
        )
    except VerlError as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: its actor weights cannot be exported: {e}") from e
    writer.finish()
    return manifest


def _write_adapter(ckpt: Path, engine: TrainingEngine, folder: Path, config: RunConfig, model_dir: Path) -> None:
    """The actor's adapter stream, checked as a receiver checks it, as a PEFT adapter folder."""
    tensors: dict[str, Tensor] = {}

    def keep(chunk: list[tuple[str, Tensor]]) -> None:
        tensors.update(chunk)

    stream = iter(engine.export_adapter())
    first = next(stream, None)
    if not isinstance(first, WeightManifest):
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: the actor engine's adapter stream did not start with a manifest")
    try:
        apply_weight_stream(itertools.chain([first], stream), first.tensors, keep, copy=True)
    except VerlError as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: its adapter cannot be exported: {e}") from e
    tied = bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False))
    write_adapter_folder(folder, config.model.lora.spec(), tensors, base_model=str(model_dir.resolve()), tied=tied)


def _copy_model_files(model_dir: Path, folder: Path, manifest: WeightManifest) -> None:
    """Copy config, tokenizer and other non-weight files; make config.json describe the exported weights."""
    for f in sorted(model_dir.iterdir()):
        name = f.name
        if not f.is_file() or name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        shutil.copyfile(f, folder / name)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    changed = False
    if bool(config.get("tie_word_embeddings", False)) != manifest.tied_embeddings:
        # a tied stream has no lm_head: the loader must tie it; an untied one must not be tied
        config["tie_word_embeddings"] = manifest.tied_embeddings
        changed = True
    dtypes = {info.dtype for info in manifest.tensors.values() if info.dtype.is_floating_point}
    if len(dtypes) == 1 and (dtype := next(iter(dtypes))) in _DTYPE_NAMES:
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        if config.get(key) != _DTYPE_NAMES[dtype]:
            config[key] = _DTYPE_NAMES[dtype]
            changed = True
    if changed:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _ensure_generation_config(folder: Path, tokenizer: Tokenizer) -> None:
    """Write a generation config when the model folder had none, so generation stops at EOS."""
    path = folder / "generation_config.json"
    if path.is_file():
        return
    model = json.loads((folder / "config.json").read_text())
    gen: dict[str, Any] = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if model.get("bos_token_id") is not None:
        gen["bos_token_id"] = model["bos_token_id"]
    path.write_text(json.dumps(dict(sorted(gen.items())), indent=2) + "\n")
