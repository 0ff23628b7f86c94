"""The Tokenizer protocol: what rewards and the trainer need from a tokenizer, without transformers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from verl_core.kernel.errors import ConfigError

__all__ = ["Tokenizer", "TokenizerAdapter"]


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


class TokenizerAdapter(Tokenizer):
    """The :class:`Tokenizer` protocol over a transformers-style tokenizer object (duck-typed).

    Args:
        tokenizer: An object with ``encode(text, add_special_tokens=...)``, ``decode(ids,
            skip_special_tokens=...)``, ``eos_token_id``, ``pad_token_id`` and ``__len__`` (any
            transformers tokenizer).
        vocab_size: Ids the model accepts (default ``len(tokenizer)``).

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ConfigError(
                f"tokenizer {type(tokenizer).__name__} has no eos_token_id; responses need an EOS token "
                "(set eos_token when building the tokenizer)"
            )
        self._tok = tokenizer
        self._vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)

    @property
    def wrapped(self) -> Any:
        """The wrapped tokenizer object."""
        return self._tok

    @property
    def eos_token_id(self) -> int:
        """Id of the EOS token."""
        return int(self._tok.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        """Id of the pad token (the EOS id when the tokenizer has none)."""
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the model accepts."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens."""
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))
