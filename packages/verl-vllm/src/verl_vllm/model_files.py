"""What a transformers model folder holds: tensor names and shapes, tying and lengths.

The weight-sync receiver checks a stream's manifest against this before applying anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_core import ConfigError, TensorInfo
from verl_core.enginekit.model_folder import check_layer_types, check_special_token_ids

__all__ = ["ModelFiles", "read_model_files"]

_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ModelFiles:
    """Tensor layout and config facts of a transformers folder.

    Attributes:
        tensors: Name -> shape, in the receiving engine's dtype, of every tensor in the folder's
            safetensors files (transformers naming).
        optional: Names a stream may leave out (the lm_head of a model with tied embeddings).
        tied_embeddings: Whether lm_head shares the input embedding.
        max_positions: ``max_position_embeddings`` of the config (GPT-2: ``n_positions``), or None when absent.
        vocab_size: Rows of the input embedding.
    """

    tensors: Mapping[str, TensorInfo]
    optional: frozenset[str]
    tied_embeddings: bool
    max_positions: int | None
    vocab_size: int


_SILU_ONLY = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""Model types whose vLLM MLP refuses any other ``hidden_act`` (with a bare ValueError, after loading)."""


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({folder / f for f in weight_map.values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"model folder {str(folder)!r} has no *.safetensors files; the vllm backend needs a "
            "transformers folder saved with safe_serialization=True"
        )
    return files


def read_model_files(path: str | os.PathLike[str], dtype: torch.dtype) -> ModelFiles:
    """Read tensor names and shapes (headers only) and the config of the folder ``path``.

    Raises:
        ConfigError: no ``config.json`` or no safetensors files; a ``pad_token_id``,
            ``eos_token_id`` or ``bos_token_id`` outside ``[0, vocab_size)`` in ``config.json``
            or ``generation_config.json``, or a tokenizer pad, EOS or BOS token whose id lies
            there (:func:`verl_core.enginekit.model_folder.check_special_token_ids`, the rule
            every backend applies; vLLM itself would build the model and stop on ids it cannot
            sample); a Llama, Qwen2, Qwen3 or Mistral config whose ``hidden_act`` is not ``silu``; a
            ``layer_types`` marking ``sliding_attention`` layers while ``use_sliding_window`` is false
            (:func:`verl_core.enginekit.model_folder.check_layer_types`).
    """
    from safetensors import safe_open

    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ConfigError(f"model folder {str(folder)!r} has no config.json; expected a transformers folder")
    config = json.loads(config_path.read_text())
    check_special_token_ids(folder, config)
    check_layer_types(folder, config.get("text_config", config))  # sliding_attention layers without a window
    text_config = config.get("text_config", config)
    model_type, act = text_config.get("model_type"), text_config.get("hidden_act", "silu")
    if model_type in _SILU_ONLY and act != "silu":
        raise ConfigError(f"vLLM's {model_type} MLP runs hidden_act 'silu' only; {str(folder)!r} sets hidden_act "
                          f"{act!r}")
    tied = bool(text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    tensors: dict[str, TensorInfo] = {}
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = tuple(int(s) for s in f.get_slice(name).get_shape())
                tensors[name] = TensorInfo(shape, dtype)
    optional = frozenset({_LM_HEAD}) if tied else frozenset()
    if tied and _LM_HEAD not in tensors:
        embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            tensors[_LM_HEAD] = tensors[embed]
    # GPT-2 folders name their learned position table n_positions
    max_pos = text_config.get("max_position_embeddings") or text_config.get("n_positions")
    vocab = int(text_config.get("vocab_size", 0))
    return ModelFiles(tensors, optional, tied, int(max_pos) if max_pos else None, vocab)
