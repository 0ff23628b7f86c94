"""HFTokenizer: the verl_core Tokenizer protocol over a transformers tokenizer."""

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
