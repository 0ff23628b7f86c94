"""The verl_core Tokenizer protocol over the tokenizer vLLM loaded for the model."""

from __future__ import annotations

from typing import Any

from verl_core.kernel.tokenizer import TokenizerAdapter

__all__ = ["VllmTokenizer"]


class VllmTokenizer(TokenizerAdapter):
    """Adapter of a transformers-style tokenizer (as returned by ``LLM.get_tokenizer()``).

    Without a pad token, padding positions hold EOS: a valid id, and masked out anyway.

    Args:
        tokenizer: The tokenizer object vLLM uses for the model.
        vocab_size: Rows of the model's input embedding (ids are valid in ``[0, vocab_size)``).

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
