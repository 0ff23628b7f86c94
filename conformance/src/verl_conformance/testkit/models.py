"""Tiny random transformers models with an offline character-level tokenizer.

The builder lives in :mod:`verl_core.trainer.inputs.tiny_model` (the trainer builds its default model
with it); the test kit re-exports it so every package's tests build the same folders.
"""

from __future__ import annotations

from verl_core.trainer.inputs.tiny_model import (
    ARCHS,
    SPECIAL_TOKENS,
    Arch,
    CharTokenizer,
    ModelHead,
    TinyModelSpec,
    build_tiny_model,
    load_tokenizer,
    tiny_model,
)

__all__ = [
    "ARCHS",
    "SPECIAL_TOKENS",
    "Arch",
    "CharTokenizer",
    "ModelHead",
    "TinyModelSpec",
    "build_tiny_model",
    "load_tokenizer",
    "tiny_model",
]
