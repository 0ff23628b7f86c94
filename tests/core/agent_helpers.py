"""Helpers of the agent tests: a tiny model whose tokenizer has a chat template with tools."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import torch

from verl_conformance.testkit import TinyModelSpec, tiny_model
from verl_core import (
    EngineSpec,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    TensorBatch,
    Tokenizer,
)
from verl_core.kernel.weights import WeightMessage

SPECIALS: Final = ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
CHARS: Final = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n{}[]():;,.\"'_-+=*/<>?!#|&%$@`~\\^"

# ChatML, with the tool schemas in a system block and role "tool" messages.
CHAT_TEMPLATE: Final = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer_object(vocab_size: int = 128, template: str = CHAT_TEMPLATE) -> Any:
    """A character-level PreTrainedTokenizerFast of ``vocab_size`` ids with a ChatML template.

    ``<pad>`` is 0 and ``<eos>`` 1, as in the test kit's tiny models.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIALS) + list(CHARS)
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    raw = RawTokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], padding_side="left",
    )
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # existing ids; never split, kept when decoding
    tok.chat_template = template
    return tok


def chat_model_path(spec: TinyModelSpec | None = None) -> str:
    """A cached tiny model folder (the test kit's random weights) with :func:`chat_tokenizer_object`."""
    spec = spec if spec is not None else TinyModelSpec()
    base = tiny_model(spec)
    root = Path(os.environ.get("VERL_TESTKIT_CACHE") or Path(tempfile.gettempdir()) / "verl-testkit")
    key = json.dumps([CHARS, CHAT_TEMPLATE, SPECIALS])
    dest = root / f"{base.name}-chat-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (dest / "verl_chat.json").exists():
        return str(dest)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-chat-"))
    try:
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            if (base / name).exists():
                shutil.copy(base / name, tmp / name)
        chat_tokenizer_object(spec.vocab_size).save_pretrained(tmp)
        (tmp / "verl_chat.json").write_text(key)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "verl_chat.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


class RecordingRollout(RolloutEngine):
    """A real rollout engine, with every generate call's prompts and outputs kept for the checks."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[TensorBatch, SamplingParams, TensorBatch]] = []

    @property
    def spec(self) -> EngineSpec:
        return self.engine.spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        return self.engine.capabilities

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.engine.weight_dtype

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        out = self.engine.generate(prompts, params)
        self.calls.append((prompts, params, out))
        return out

    def log_probs_exact(self, params: SamplingParams) -> bool:
        return self.engine.log_probs_exact(params)

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        self.engine.update_weights(stream)

    def rows(self) -> list[tuple[list[int], list[int], list[float], int]]:
        """Every sampled row of every call: (prompt ids, sampled ids, their log-probs, max_new_tokens)."""
        out = []
        for prompts, params, result in self.calls:
            for r in range(prompts.batch_size):
                prompt = prompts["prompt_ids"][r][prompts["prompt_mask"][r]].tolist()
                mask = result["response_mask"][r]
                out.append((prompt, result["response_ids"][r][mask].tolist(),
                            result["rollout_log_probs"][r][mask].tolist(), params.max_new_tokens))
        return out


def ids_of(tokenizer: Tokenizer, chars: Sequence[str]) -> tuple[int, ...]:
    """The ids of single characters."""
    out = []
    for c in chars:
        ids = tokenizer.encode(c)
        assert len(ids) == 1, (c, ids)
        out.append(ids[0])
    return tuple(out)
