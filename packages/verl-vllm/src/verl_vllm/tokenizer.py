"""The verl_core Tokenizer protocol over the tokenizer vLLM loaded for the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_core import ConfigError, Tokenizer

__all__ = ["VllmTokenizer"]


class VllmTokenizer(Tokenizer):
    """Adapter of a transformers-style tokenizer (as returned by ``LLM.get_tokenizer()``).

    Args:
        tokenizer: The tokenizer object vLLM uses for the model.
        vocab_size: Rows of the model's input embedding (ids are valid in ``[0, vocab_size)``).

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tok = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ConfigError("the model's tokenizer has no eos_token_id; set eos_token in its tokenizer files")
        pad = getattr(tokenizer, "pad_token_id", None)
        self._eos = int(eos)
        # Without a pad token, padding positions hold EOS: a valid id, and masked out anyway.
        self._pad = int(pad) if pad is not None else self._eos
        self._vocab = int(vocab_size)

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-sequence token."""
        return self._eos

    @property
    def pad_token_id(self) -> int:
        """Id filling padding positions (EOS when the tokenizer defines no pad token)."""
        return self._pad

    @property
    def vocab_size(self) -> int:
        """Rows of the model's input embedding."""
        return self._vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
