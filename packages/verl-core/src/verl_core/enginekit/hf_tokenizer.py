"""Transformers-style tokenizers seen through :class:`verl_core.kernel.tokenizer.Tokenizer`.

The one adapter for every transformers-style tokenizer object: engines that load a transformers
folder (hf, megatron, third-party backends), vLLM's tokenizer, the trainer's character tokenizer.
transformers is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from verl_core.kernel.errors import ConfigError
from verl_core.kernel.tokenizer import ChatMessage, ChatTokenizer

__all__ = ["HFTokenizer", "load_tokenizer"]


class HFTokenizer(ChatTokenizer):
    """The :class:`~verl_core.kernel.tokenizer.ChatTokenizer` protocol over a transformers-style tokenizer.

    Without a pad token, padding positions hold EOS: a valid id, and masked out anyway. Chat
    rendering uses the wrapped tokenizer's ``chat_template`` (``apply_chat_template``).

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
        # transformers' tokenizers take an array of ids and list it in one call; a list of ids they
        # check element by element (half of a 512-token decode's time)
        self._arrays = any(c.__name__ == "PreTrainedTokenizerBase" for c in type(tokenizer).__mro__)

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
        if self._arrays:
            import numpy as np  # a dependency of transformers

            return str(self._tok.decode(np.asarray(ids, dtype=np.int64), skip_special_tokens=skip_special_tokens))
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        """Whether the wrapped tokenizer has a chat template."""
        return bool(getattr(self._tok, "chat_template", None))

    def render(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """Ids of ``messages`` rendered by the chat template (special tokens included).

        The template's text is encoded without adding special tokens, as ``apply_chat_template``
        does when it tokenizes.

        Raises:
            ConfigError: the tokenizer has no chat template, or the template fails on the messages.
        """
        if not self.has_chat_template:
            raise ConfigError(
                f"tokenizer {type(self._tok).__name__} has no chat template; set its chat_template, or "
                "give the episode loop prompts and observations as text"
            )
        try:
            text = self._tok.apply_chat_template(
                [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=False,
            )
        except Exception as e:  # jinja2 raises its own exception types (TemplateError, UndefinedError)
            raise ConfigError(
                f"the chat template of tokenizer {type(self._tok).__name__} failed on {len(messages)} "
                f"message(s) (roles {[m.get('role') for m in messages]}): {type(e).__name__}: {e}"
            ) from e
        return self.encode(str(text))


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
