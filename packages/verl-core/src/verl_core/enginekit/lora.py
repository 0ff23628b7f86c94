"""LoRA adapters as backends share them: the merged weight, adapter stream names and PEFT adapter folders.

The adapter stream (:meth:`~verl_core.kernel.training.TrainingEngine.export_adapter`) names each
target module's factors ``<module>.lora_A.weight`` (rank x in) and ``<module>.lora_B.weight``
(out x rank) and the tensors of fully trained modules by their own names. An adapter folder is what
the ``peft`` library saves and loads (``PeftModel.from_pretrained``): ``adapter_config.json`` and
``adapter_model.safetensors``, whose tensor names are the stream's behind ``base_model.model.``.
Nothing here imports peft.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from verl_core.kernel.engine import LoraSpec
from verl_core.kernel.errors import ConfigError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LORA_A",
    "LORA_B",
    "PEFT_PREFIX",
    "adapter_layout",
    "merge_lora",
    "read_adapter_folder",
    "write_adapter_folder",
]

ADAPTER_CONFIG: Final = "adapter_config.json"
ADAPTER_WEIGHTS: Final = "adapter_model.safetensors"
PEFT_PREFIX: Final = "base_model.model."
"""What peft puts before a transformers name in an adapter file."""
LORA_A: Final = ".lora_A.weight"
LORA_B: Final = ".lora_B.weight"


def merge_lora(weight: Tensor, a: Tensor, b: Tensor, scale: float, dtype: torch.dtype | None = None) -> Tensor:
    """``weight + scale * b @ a`` computed in float32 (at least), returned in ``dtype`` (default: ``weight``'s).

    One new tensor of the weight's size; ``weight`` is not changed.
    """
    wide = torch.promote_types(weight.dtype, torch.float32)
    with torch.no_grad():
        merged = torch.addmm(weight.to(wide), b.to(wide), a.to(wide), alpha=scale)
    return merged.to(dtype if dtype is not None else weight.dtype)


def adapter_layout(names: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The target modules and the fully trained tensors of an adapter stream's names, in order."""
    targets = [n[: -len(LORA_A)] for n in names if n.endswith(LORA_A)]
    full = [n for n in names if not (n.endswith(LORA_A) or n.endswith(LORA_B))]
    return targets, full


def write_adapter_folder(
    path: str | os.PathLike[str], spec: LoraSpec, tensors: Mapping[str, Tensor], *, base_model: str,
    tied: bool = False,
) -> None:
    """Write ``tensors`` (adapter stream names) as a PEFT LoRA adapter folder ``PeftModel.from_pretrained`` loads.

    Args:
        path: An existing folder (its two files are written).
        spec: The adapter's rank, alpha and dropout.
        tensors: The adapter tensors by stream name (see the module docstring).
        base_model: The base model folder, recorded as ``base_model_name_or_path``.
        tied: The base ties lm_head to the input embedding (a fully trained embedding stays tied).
    """
    from safetensors.torch import save_file

    targets, full = adapter_layout(list(tensors))
    modules_to_save = sorted({n.rpartition(".")[0] for n in full})
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(targets),
        "modules_to_save": modules_to_save or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
        "ensure_weight_tying": bool(tied and modules_to_save),
    }
    folder = Path(path)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    out = {PEFT_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(out, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter_folder(path: str | os.PathLike[str], spec: LoraSpec) -> dict[str, Tensor]:
    """The tensors of a PEFT LoRA adapter folder by adapter stream name, checked against ``spec``.

    Raises:
        ConfigError: the folder lacks its two files, is not a LoRA adapter, or its rank or alpha
            differ from ``spec``'s.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    where = f"LoRA adapter folder {str(folder)!r} (LoraSpec.init_path)"
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{where} must hold {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (a PEFT adapter, as "
                          "`verl export --adapter-only` or PeftModel.save_pretrained writes)")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {ADAPTER_CONFIG} is unreadable ({e})") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: {ADAPTER_CONFIG} does not describe a LoRA adapter (peft_type "
                          f"{config.get('peft_type') if isinstance(config, dict) else config!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if rank != spec.rank or alpha is None or float(alpha) != float(spec.alpha):
        raise ConfigError(f"{where} has rank {rank} and alpha {alpha}; the spec asks for rank {spec.rank} and "
                          f"alpha {spec.alpha}: set them to the folder's")
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    return {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}
