"""The verl_core Tokenizer protocol over a transformers folder's tokenizer."""

from __future__ import annotations

import os

from verl_core.kernel.tokenizer import TokenizerAdapter

__all__ = ["HFTokenizer"]


class HFTokenizer(TokenizerAdapter):
    """The tokenizer of a transformers folder seen through verl_core's Tokenizer protocol.

    Args:
        path: A transformers folder holding tokenizer files (code shipped with it is never run).

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        super().__init__(AutoTokenizer.from_pretrained(str(path), trust_remote_code=False))
