"""HFTokenizer: the verl_core Tokenizer protocol over a transformers tokenizer."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from verl_core.errors import ConfigError
from verl_core.tokenizer import Tokenizer

__all__ = ["HFTokenizer", "load_tokenizer"]


class HFTokenizer(Tokenizer):
    """A transformers tokenizer seen through :class:`verl_core.Tokenizer`.

    Args:
        tokenizer: A transformers ``PreTrainedTokenizerBase``.
        vocab_size: Rows of the model's embedding (ids accepted by the model); defaults to
            ``len(tokenizer)``.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(
                "the model's tokenizer has no eos_token_id; set eos_token in the tokenizer files"
            )
        self._tok = tokenizer
        self._vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer."""
        return self._tok

    @property
    def eos_token_id(self) -> int:
        """Id of the EOS token."""
        return int(self._tok.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        """Id of the pad token (the EOS id when the tokenizer defines no pad token)."""
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding accepts."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))


def load_tokenizer(path: str | os.PathLike[str], vocab_size: int | None = None) -> HFTokenizer:
    """Load the tokenizer of a transformers folder as an :class:`HFTokenizer`.

    Raises:
        ConfigError: the folder has no loadable tokenizer, or its tokenizer needs custom code
            (code shipped with a model folder is never run).
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot load the tokenizer of {str(path)!r} with transformers ({type(e).__name__}: {e}); "
            "expected a transformers folder with a tokenizer that needs no custom code"
        ) from e
    return HFTokenizer(tok, vocab_size)
