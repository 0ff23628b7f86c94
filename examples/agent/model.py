"""The tool demo's tiny model: a random Llama whose word-level tokenizer has a chat template with tools.

    python examples/agent/model.py runs/agent/model-0 --seed 0

The vocabulary is tiny so the model learns fast: the chat markers, the roles, the digits, the
pieces of a calculator call (``<tool_call>``, ``{"name": "add", "arguments": {"a": ``, ``, "b": ``,
``}}``, ``</tool_call>``) and single characters for anything else. The template is ChatML; with
tools it lists their names in a system message. Everything is built offline.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path
from typing import Any, Final

SPECIALS: Final = ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")
CALL_TAGS: Final = ("<tool_call>", "</tool_call>")
# multi-character pieces, matched before single characters
WORDS: Final = ('{"name": "add", "arguments": {"a": ', ', "b": ', "}}", "tools:", "system", "user",
                "assistant", "tool", "add")
CHARS: Final = string.digits + string.ascii_lowercase + " \n+-=:,.'\"{}()[]_"

CHAT_TEMPLATE: Final = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer() -> Any:
    """The demo's word-level transformers tokenizer (``<pad>`` 0, ``<eos>`` 1) with :data:`CHAT_TEMPLATE`."""
    import re

    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIALS, *CALL_TAGS, *WORDS, *CHARS]
    raw = RawTokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    pieces = "|".join(re.escape(w) for w in WORDS)
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pieces}|\\n|."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens(list(CALL_TAGS))  # their ids already exist; never split, kept when decoding
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build(path: str | Path, *, seed: int = 0) -> Path:
    """Write the demo's random model (initialised with ``seed``) and tokenizer to ``path``."""
    from verl_core.trainer.inputs.tiny_model import TinyModelSpec, build_tiny_model

    tok = tokenizer()
    spec = TinyModelSpec(arch="llama", tied=True, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                         head_dim=32, intermediate_size=128, vocab_size=len(tok), max_position=256,
                         init_std=0.02, seed=seed)
    return build_tiny_model(path, spec, tokenizer=tok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the model folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    args = parser.parse_args()
    print(build(args.path, seed=args.seed))


if __name__ == "__main__":
    main()
