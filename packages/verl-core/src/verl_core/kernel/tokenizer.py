"""The Tokenizer protocol: what rewards and the trainer need from a tokenizer, without transformers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """Encode and decode text; a transformers tokenizer satisfies it through a thin adapter.

    Implementations must be deterministic: the same text always gives the same ids.
    """

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-sequence token that terminates a response."""
        ...

    @property
    def pad_token_id(self) -> int:
        """Id that fills padding positions of id fields (a valid vocabulary id)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding accepts (ids are in ``[0, vocab_size)``)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens added."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (EOS, pad) are dropped unless asked otherwise."""
        ...
