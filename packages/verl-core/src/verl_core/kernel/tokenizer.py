"""The Tokenizer protocol: what rewards and the trainer need from a tokenizer, without transformers.

:class:`ChatTokenizer` adds rendering chat messages through the model's chat template (multi-turn
episodes render their prompts, and the observations they append, with it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["ChatMessage", "ChatTokenizer", "Tokenizer"]

ChatMessage = Mapping[str, Any]
"""One chat message: ``role`` and ``content`` strings, plus what the template reads (``name``,
``tool_calls``, ``tool_call_id``)."""


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


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A :class:`Tokenizer` that renders chat messages through the model's chat template."""

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`render` can be used (the tokenizer has a chat template)."""
        ...

    def render(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, special tokens included.

        Args:
            messages: The conversation.
            tools: JSON tool schemas (``{"type": "function", "function": {...}}``) the template
                lists for the model, or None.
            add_generation_prompt: Append the header of a new assistant turn.
        """
        ...
