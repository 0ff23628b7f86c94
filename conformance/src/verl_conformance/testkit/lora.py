"""LoRA folders of the test kit: a PEFT adapter with nonzero factors, and its merged float64 model.

A LoRA engine starts from ``B = 0`` (its adapted model is the base), which hides a wrong scale or a
swapped factor. :func:`lora_adapter` writes an adapter whose ``A`` and ``B`` are both nonzero
(seeded, small: the adapted model stays close to the base), for an engine to start from through
``LoraSpec.init_path``; :func:`merged_model` writes the base folder with every target weight
replaced by ``W + alpha / rank * B A`` computed in float64 (saved in float64), the float64
reference of the adapted model. Both are cached like the other crafted folders.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Final

import torch

from verl_conformance.testkit.crafted import _copy_with_weights, _crafted, _weights
from verl_core.enginekit.lora import LORA_A, LORA_B, read_adapter_folder, write_adapter_folder
from verl_core.kernel.engine import DEFAULT_LORA_TARGETS, LoraSpec, lora_matches
from verl_core.trainer.inputs.tiny_model import TinyModelSpec, tiny_model

__all__ = ["LORA_ALPHA", "LORA_RANK", "lora_adapter", "lora_spec", "merged_model", "target_weights"]

LORA_RANK: Final = 4
LORA_ALPHA: Final = 8.0  # scale 2: a factor applied as alpha (or as 1) shows in every output
_LLAMA: Final = TinyModelSpec()


def target_weights(base: Path, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> dict[str, tuple[int, int]]:
    """The linear weights of ``base`` whose module matches a target: module name -> (out, in)."""
    out: dict[str, tuple[int, int]] = {}
    for name, t in _weights(base).items():
        module, _, attr = name.rpartition(".")
        if attr == "weight" and t.dim() == 2 and any(lora_matches(p, module) for p in targets):
            out[module] = (int(t.shape[0]), int(t.shape[1]))
    return out


def _recipe(targets: tuple[str, ...]) -> dict[str, object]:
    """The targets' part of a folder's recipe (none for the default targets, so their folders keep their names)."""
    return {} if targets == DEFAULT_LORA_TARGETS else {"targets": list(targets)}


def lora_adapter(spec: TinyModelSpec = _LLAMA, seed: int = 0, *, spread: float = 0.05,
                 targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> Path:
    """A PEFT adapter folder for ``tiny_model(spec)`` on every linear module ``targets`` match (by default
    every attention and MLP projection), with rank :data:`LORA_RANK`, alpha :data:`LORA_ALPHA` and
    seeded nonzero ``A`` and ``B`` of ``spread``."""

    def build(out: Path) -> None:
        base = tiny_model(spec)
        tensors: dict[str, torch.Tensor] = {}
        for module, (n_out, n_in) in sorted(target_weights(base, targets).items()):
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(module.encode()))
            tensors[module + LORA_A] = spread * torch.randn(LORA_RANK, n_in, generator=g)
            tensors[module + LORA_B] = spread * torch.randn(n_out, LORA_RANK, generator=g)
        write_adapter_folder(out, LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, targets=targets), tensors,
                             base_model=str(base), tied=spec.tied)

    return _crafted("lora-adapter", {"base": asdict(spec), "seed": seed, "spread": spread,
                                     "rank": LORA_RANK, "alpha": LORA_ALPHA, **_recipe(targets)}, build)


def lora_spec(spec: TinyModelSpec = _LLAMA, seed: int = 0, *,
              targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> LoraSpec:
    """The LoraSpec of :func:`lora_adapter`, starting from it (``init_path``)."""
    return LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, targets=targets,
                    init_path=str(lora_adapter(spec, seed, targets=targets)))


def merged_model(spec: TinyModelSpec = _LLAMA, seed: int = 0, *,
                 targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> Path:
    """``tiny_model(spec)`` with each target weight ``W + alpha / rank * B A`` of :func:`lora_adapter`,
    computed and saved in float64 (other tensors as they are)."""

    def build(out: Path) -> None:
        base = tiny_model(spec)
        adapter = read_adapter_folder(lora_adapter(spec, seed, targets=targets),
                                      LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, targets=targets))
        w = _weights(base)
        scale = LORA_ALPHA / LORA_RANK
        for module in target_weights(base, targets):
            a, b = adapter[module + LORA_A].double(), adapter[module + LORA_B].double()
            w[module + ".weight"] = w[module + ".weight"].double() + scale * (b @ a)
        _copy_with_weights(base, out, w)

    # keyed by the adapter's folder, whose name carries its own recipe's hash
    return _crafted("lora-merged", {"base": asdict(spec), "adapter": lora_adapter(spec, seed, targets=targets).name},
                    build)
