"""Tiny random transformers models with an offline character-level tokenizer (the trainer's default
model when `model.path` is empty; re-exported by the conformance test kit)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

import torch

from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.enginekit.hf_tokenizer import load_tokenizer as load_hf_tokenizer

__all__ = [
    "ARCHS",
    "SPECIAL_TOKENS",
    "Arch",
    "CharTokenizer",
    "ModelHead",
    "TinyModelSpec",
    "build_tiny_model",
    "char_tokenizer",
    "load_tokenizer",
    "no_progress_bars",
    "tiny_model",
]

Arch = Literal["llama", "qwen2", "qwen3"]
ARCHS: Final[tuple[Arch, ...]] = ("llama", "qwen2", "qwen3")
ModelHead = Literal["causal_lm", "value", "reward"]
"""``causal_lm`` (policy), ``value`` (critic: token classification, 1 label), ``reward``
(sequence classification, 1 label)."""

SPECIAL_TOKENS: Final = ("<pad>", "<eos>", "<bos>", "<unk>")
_CHARS: Final = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=.,:;?!()[]'\"#<>_"


def _vocab(size: int, extra_chars: str = "") -> dict[str, int]:
    known = "".join(c for c in dict.fromkeys(extra_chars) if c in _CHARS)
    if known:
        raise ValueError(f"extra_chars {extra_chars!r} holds characters the tokenizer already has ({known!r}); "
                         "give only new ones")
    if len(set(extra_chars)) != len(extra_chars):
        raise ValueError(f"extra_chars {extra_chars!r} repeats a character; give each once")
    tokens = list(SPECIAL_TOKENS) + list(_CHARS) + list(extra_chars)
    if size < len(tokens):
        raise ValueError(f"vocab_size must be >= {len(tokens)}, got {size}")
    tokens += [f"<extra_{i}>" for i in range(size - len(tokens))]
    return {t: i for i, t in enumerate(tokens)}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. Defaults divide by 2 for TP=2 (heads, KV groups, vocab) and PP=2 (layers).

    Attributes:
        arch: Architecture family.
        tied: Tie lm_head to the input embedding.
        head: Which head the folder's model has.
        hidden_size: Model width (num_heads * head_dim by default: vLLM's Qwen2 derives the head width from it).
        num_layers: Decoder layers.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads (query groups).
        head_dim: Per-head width (>= 32 for vLLM's CPU attention).
        intermediate_size: MLP width.
        vocab_size: Embedding rows (the tokenizer's extra ids fill up to it).
        max_position: Longest sequence.
        init_std: Std of the random init (larger than transformers' 0.02 so logits are peaked
            enough for checks to tell tokens apart).
        seed: Seed of the random init.
    """

    arch: Arch = "llama"
    tied: bool = False
    head: ModelHead = "causal_lm"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    vocab_size: int = 128
    max_position: int = 512
    init_std: float = 0.1
    seed: int = 0

    def key(self) -> str:
        """A stable hash of the spec (cache key)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _config(spec: TinyModelSpec) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tied,
        "initializer_range": spec.init_std,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "num_labels": 1,
    }
    if spec.arch == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.Qwen3Config(**common, attention_bias=False, use_sliding_window=False)


def char_tokenizer(vocab_size: int, extra_chars: str = "") -> Any:
    """The character-level transformers tokenizer a tiny model of ``vocab_size`` ids is saved with.

    Args:
        vocab_size: Ids of the vocabulary; those past the characters are ``<extra_i>`` tokens.
        extra_chars: Characters to add after the built-in ones (e.g. ``"{}\\n"`` for JSON tool
            calls and multi-line tool output), taking the first ``<extra_i>`` ids; the ids of the
            built-in characters do not change.

    Raises:
        ValueError: ``vocab_size`` too small for the characters, or ``extra_chars`` holds a
            character the tokenizer already has or repeats one.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(_vocab(vocab_size, extra_chars), unk_token="<unk>"))
    # "." does not match a newline: with one among the characters, every character is its own piece
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\\n" if "\n" in extra_chars else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        padding_side="left",
    )


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Turn transformers' progress bars off inside the block (e.g. ``save_pretrained``'s "Writing model
    shards" bar, noise on the trainer's stderr); the setting is restored after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def build_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec = TinyModelSpec(), *,
                     tokenizer: Any = None) -> Path:
    """Write a random-initialised model of ``spec`` and its tokenizer to the folder ``path``.

    The folder (config.json, model.safetensors, tokenizer files) loads with transformers,
    vLLM and the Megatron converter alike. Deterministic for a given spec.

    Args:
        path: The folder.
        spec: The model's shape and seed.
        tokenizer: A transformers tokenizer to save instead of the character tokenizer (e.g. one
            with a chat template); ``spec.vocab_size`` must equal its length, and its pad and EOS
            ids are written to the model's config.

    Raises:
        ValueError: ``tokenizer``'s length is not ``spec.vocab_size``.
    """
    if tokenizer is not None and len(tokenizer) != spec.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} ids but spec.vocab_size is {spec.vocab_size}; "
                         "build the model with vocab_size=len(tokenizer)")
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(spec)
    if tokenizer is not None:
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id
    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "value": transformers.AutoModelForTokenClassification,
        "reward": transformers.AutoModelForSequenceClassification,
    }[spec.head]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = auto.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    (tokenizer if tokenizer is not None else char_tokenizer(spec.vocab_size)).save_pretrained(out)
    (out / "verl_tiny_model.json").write_text(json.dumps(asdict(spec), indent=1))
    return out


def tiny_model(spec: TinyModelSpec = TinyModelSpec(), *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A cached folder for ``spec`` (built once per machine; safe under concurrent processes).

    The cache lives in ``$VERL_TESTKIT_CACHE`` or the system temp dir.
    """
    root = Path(cache_dir or os.environ.get("VERL_TESTKIT_CACHE") or Path(tempfile.gettempdir()) / "verl-testkit")
    dest = root / f"{spec.arch}-{spec.head}-{'tied' if spec.tied else 'untied'}-{spec.key()}"
    if (dest / "verl_tiny_model.json").exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        build_tiny_model(tmp, spec)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "verl_tiny_model.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class CharTokenizer(HFTokenizer):
    """The tokenizer of a tiny-model folder (one id per character, ``<pad>`` and ``<eos>``): the
    engine kit's :class:`~verl_core.enginekit.hf_tokenizer.HFTokenizer` over it, as the engines see it.

    Args:
        path: The model folder (see :func:`tiny_model`).

    Raises:
        ConfigError: the folder has no loadable tokenizer, or transformers is not installed.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(load_hf_tokenizer(path).wrapped)


def load_tokenizer(path: str | os.PathLike[str]) -> CharTokenizer:
    """The tokenizer of a test-kit model folder as a verl_core.Tokenizer."""
    return CharTokenizer(path)
