"""Write a random-initialised model folder for the math example, built locally (no hub download).

The folder is what ``model.path`` takes: a transformers ``config.json``, ``model.safetensors`` and
a character-level tokenizer whose ``tokenizer_config.json`` has a chat template, so
``data.chat_template = true`` renders each question as
``"<user> Tom has 3 apples. ... How many apples does Tom have now? <assistant> "``, and the model's
response follows.

Sizes (``--size``):

* ``tiny``: 2 layers of width 64 (about 0.1M parameters), float32 on a CPU in seconds: for tests
  and a dry run;
* ``0.9b``: a Llama-shaped (or, with ``--arch qwen2``, Qwen2-shaped) model of 0.89B parameters
  (width 2048, 16 layers, 16 heads, 8 key/value heads, MLP 5632, vocabulary 32000, 4096
  positions), for a GPU in bfloat16.

A random model answers nothing right: use it to check that the pipeline runs and how fast, then
point ``model.path`` at a real instruction-tuned model folder to learn the task.

Usage: ``python examples/math/make_model.py --size 0.9b --out runs/math-model-0.9b [--arch llama]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Final

from verl_core.trainer.inputs.tiny_model import (
    ARCHS,
    Arch,
    TinyModelSpec,
    build_tiny_model,
    char_tokenizer,
)

CHAT_TEMPLATE: Final = (
    "{% if tools %}<system> tools:{% for tool in tools %} {{ tool['function']['name'] }}"
    "({{ tool['function']['parameters']['properties'] | join(', ') }}){% endfor %} {% endif %}"
    "{% for message in messages %}<{{ message['role'] }}> {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
"""Roles in angle brackets, one space between turns: every character is one of the tokenizer's.

With tools (a multi-turn run's ``agent.tools``, or SFT on tool conversations), a first line lists
them, ``<system> tools: python(code) ``; a tool's result is a ``<tool>`` turn. Without tools the
rendering is the same as before tools were supported."""

EXTRA_CHARS: Final = "{}\n"
"""Characters added to the tokenizer's built-in ones (taking the first ``<extra_i>`` ids), for JSON
tool calls (``<tool_call>{"name": "python", ...}</tool_call>``) and tool output, which ends with a
newline."""

SIZES: Final = {
    "tiny": TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
                          intermediate_size=128, vocab_size=96, tied=True, max_position=512,
                          init_std=0.02),
    "0.9b": TinyModelSpec(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128,
                          intermediate_size=5632, vocab_size=32000, tied=False, max_position=4096,
                          init_std=0.02),
}


def make_model(out: Path, size: str, arch: Arch = "llama", seed: int = 0) -> Path:
    """Write the model of ``size`` and its tokenizer (with :data:`CHAT_TEMPLATE`) to ``out``."""
    spec = dataclasses.replace(SIZES[size], arch=arch, seed=seed)
    build_tiny_model(out, spec)
    tokenizer = char_tokenizer(spec.vocab_size, EXTRA_CHARS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)  # replaces the tokenizer files build_tiny_model wrote
    return out


def parameter_count(folder: Path) -> int:
    """Parameters in the folder's safetensors file (read from its header, no weights loaded)."""
    with (folder / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    count = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for dim in entry["shape"]:
                n *= dim
            count += n
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    p.add_argument("--out", type=Path, required=True, help="model folder to write (created)")
    args = p.parse_args()
    make_model(args.out, args.size, args.arch, args.seed)
    print(f"wrote a random {args.arch} model of {parameter_count(args.out) / 1e6:,.1f}M parameters to {args.out}")


if __name__ == "__main__":
    main()
