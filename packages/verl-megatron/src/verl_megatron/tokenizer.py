"""The verl_core Tokenizer protocol over a transformers folder's tokenizer."""

from __future__ import annotations

import os
from collections.abc import Sequence

from verl_core import Tokenizer

__all__ = ["HFTokenizer"]


class HFTokenizer(Tokenizer):
    """A transformers tokenizer seen through verl_core's Tokenizer protocol.

    Args:
        path: A transformers folder holding tokenizer files.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        if self._tok.pad_token_id is None and self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer of {path} has neither a pad nor an eos token")

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-sequence token."""
        return int(self._tok.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        """Id of the pad token (the eos token when the tokenizer has none)."""
        pad = self._tok.pad_token_id
        return int(pad if pad is not None else self._tok.eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer produces."""
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
