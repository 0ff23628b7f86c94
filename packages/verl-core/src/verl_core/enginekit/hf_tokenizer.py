"""The tokenizer of a transformers folder seen through :class:`verl_core.kernel.tokenizer.Tokenizer`.

One adapter for every engine that loads its tokenizer from a transformers folder (hf, megatron,
third-party backends). transformers is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

import os

from verl_core.kernel.errors import ConfigError
from verl_core.kernel.tokenizer import TokenizerAdapter

__all__ = ["HFTokenizer", "load_tokenizer"]


class HFTokenizer(TokenizerAdapter):
    """A transformers tokenizer seen through :class:`verl_core.Tokenizer`.

    Args:
        tokenizer: A transformers ``PreTrainedTokenizerBase``.
        vocab_size: Rows of the model's embedding (ids accepted by the model); defaults to
            ``len(tokenizer)``.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """


def load_tokenizer(path: str | os.PathLike[str], vocab_size: int | None = None) -> HFTokenizer:
    """Load the tokenizer of a transformers folder as an :class:`HFTokenizer`.

    Code shipped with a model folder is never run (``trust_remote_code=False``).

    Raises:
        ConfigError: the folder has no loadable tokenizer, its tokenizer needs custom code, or
            transformers is not installed.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(
            f"loading the tokenizer of {str(path)!r} needs transformers: pip install transformers"
        ) from e
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot load the tokenizer of {str(path)!r} with transformers ({type(e).__name__}: {e}); "
            "expected a transformers folder with a tokenizer that needs no custom code"
        ) from e
    return HFTokenizer(tok, vocab_size)
