"""Tokens of prompts and observations: chat messages through the template, text as it is.

An episode is token in, token out: earlier turns are never re-tokenized. An observation is
appended as the tokens of the new message(s) alone, the *delta* :class:`ObservationRenderer`
computes with the chat template:

1. ``base`` = the rendering of a fixed dummy prefix, :data:`DUMMY_PREFIX` (a user message and an
   assistant reply ``"y"``), without a generation prompt; rendering it once more with the reply
   ``"z"`` locates the reply, and the *tail* is what the template puts after it (in ChatML
   ``<|im_end|>`` and a newline);
2. ``full`` = the rendering of the dummy prefix followed by the new messages, with the generation
   prompt (the header of the model's next turn);
3. ``full`` must start with ``base`` exactly, token for token; a template whose rendering of the
   earlier messages changes when messages follow (or whose tokens merge across the boundary) is
   refused with a :class:`~verl_core.kernel.errors.ConfigError` naming the position;
4. the delta is the tail, then ``full[len(base):]``; when the model's turn ended with the tail's
   first token (it sampled the template's end-of-turn token itself) that token is left out.

So ``turn + delta`` is what the template renders for the whole conversation when the model ended
its turn with the template's end-of-turn token; when it ended at another stop id (or EOS), the
template's end-of-turn token follows it as an observation token. The turn's tokens are never
touched.

Text observations are encoded as they are (the environment owns their formatting), and so are
messages when the tokenizer has no chat template: their contents joined by newlines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch

from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.environment import Observation, check_messages
from verl_core.kernel.errors import ConfigError, describe
from verl_core.kernel.tokenizer import ChatMessage, ChatTokenizer, Tokenizer

__all__ = ["DUMMY_PREFIX", "ObservationRenderer", "chat_tokenizer", "prompts_from_ids", "render_prompts"]

DUMMY_PREFIX: Final[tuple[Mapping[str, str], ...]] = (
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "y"},
)
"""The conversation an observation's delta is rendered after (see the module docstring)."""
_OTHER_REPLY: Final = ({"role": "assistant", "content": "z"},)


def chat_tokenizer(tokenizer: Tokenizer) -> ChatTokenizer | None:
    """``tokenizer`` as a :class:`ChatTokenizer` when it has a chat template, else None."""
    if isinstance(tokenizer, ChatTokenizer) and tokenizer.has_chat_template:
        return tokenizer
    return None


class ObservationRenderer:
    """The tokens an observation appends to an episode (the module docstring says how).

    Args:
        tokenizer: The model's tokenizer; with a chat template messages are rendered through it.

    Raises:
        ConfigError: the chat template fails on the dummy prefix.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._chat = chat_tokenizer(tokenizer)
        self._base: list[int] = []
        self._tail: list[int] = []
        if self._chat is not None:
            self._base = self._chat.render(DUMMY_PREFIX, add_generation_prompt=False)
            other = self._chat.render([DUMMY_PREFIX[0], *_OTHER_REPLY], add_generation_prompt=False)
            same_end = 0
            while same_end < min(len(self._base), len(other)) and self._base[-1 - same_end] == other[-1 - same_end]:
                same_end += 1
            self._tail = self._base[len(self._base) - same_end :]

    @property
    def uses_chat_template(self) -> bool:
        """Whether messages are rendered through the chat template."""
        return self._chat is not None

    @property
    def tail(self) -> list[int]:
        """What the chat template puts after an assistant reply (empty without a template)."""
        return list(self._tail)

    def tokens(self, observation: Observation, *, after: int | None = None) -> list[int]:
        """The ids ``observation`` appends (empty for ``""`` or no messages).

        Args:
            observation: Text, or chat messages.
            after: The last token of the model's turn: when it is the template's end-of-turn
                token, the delta does not repeat it.

        Raises:
            ConfigError: the template fails on the messages, or does not render the dummy prefix
                as a stable prefix of the conversation.
            StepResultError: malformed messages.
        """
        if isinstance(observation, str):
            return self._tok.encode(observation) if observation else []
        messages = check_messages(observation, "observation")
        if not messages:
            return []
        if self._chat is None:
            return self._tok.encode("\n".join(m["content"] for m in messages))
        full = self._chat.render([*DUMMY_PREFIX, *messages], add_generation_prompt=True)
        if full[: len(self._base)] != self._base:
            at = next((i for i, (a, b) in enumerate(zip(full, self._base, strict=False)) if a != b),
                      min(len(full), len(self._base)))
            raise ConfigError(
                f"the chat template does not render observations as a suffix: the rendering of "
                f"{list(DUMMY_PREFIX)} changes at token {at} when {[m['role'] for m in messages]} messages "
                f"follow (alone: {self._base[at:at + 8]}..., followed: {full[at:at + 8]}...); the episode "
                "loop cannot append this observation without re-tokenizing earlier turns; give it as text"
            )
        tail = self._tail[1:] if self._tail and after == self._tail[0] else self._tail
        return [*tail, *full[len(self._base):]]


def prompts_from_ids(
    ids: Sequence[Sequence[int]], pad_token_id: int, *, group_ids: Sequence[int],
    extras: Mapping[str, Sequence[Any]] | None = None, meta: BatchMeta | None = None,
) -> TensorBatch:
    """A prompt batch (``prompt_ids`` left-padded, ``prompt_mask``, ``group_ids``) of token id lists.

    Raises:
        ConfigError: an empty prompt, or as many group ids as prompts not given.
    """
    if len(group_ids) != len(ids):
        raise ConfigError(f"prompt batch: {len(ids)} prompts but {len(group_ids)} group ids; give one group id per prompt")
    if any(len(row) == 0 for row in ids):
        raise ConfigError("prompt batch: a prompt has no tokens; every prompt needs at least one")
    width = max((len(row) for row in ids), default=0)
    out = torch.full((len(ids), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, row in enumerate(ids):
        out[i, width - len(row):] = torch.tensor(list(row), dtype=torch.int64)
        mask[i, width - len(row):] = True
    return TensorBatch(
        {"prompt_ids": out, "prompt_mask": mask, "group_ids": torch.tensor(list(group_ids), dtype=torch.int64)},
        extras=extras, meta=meta or BatchMeta(pad_token_id=pad_token_id),
    )


def render_prompts(
    tokenizer: Tokenizer, conversations: Sequence[Sequence[ChatMessage] | str], *, group_ids: Sequence[int],
    tools: Sequence[Mapping[str, Any]] | None = None, extras: Mapping[str, Sequence[Any]] | None = None,
) -> TensorBatch:
    """The prompt batch of conversations rendered with a generation prompt (and ``tools=``).

    A conversation is a list of chat messages (rendered by the chat template) or a text (encoded
    as it is). The result is what :class:`~verl_core.agent.loop.AgentLoop` takes.

    Raises:
        ConfigError: messages given to a tokenizer without a chat template, or a prompt that
            renders to no tokens.
    """
    if isinstance(conversations, str) or not isinstance(conversations, Sequence):
        raise ConfigError(f"render_prompts() takes a list of conversations, got {describe(conversations)}")
    chat = chat_tokenizer(tokenizer)
    rows: list[list[int]] = []
    for i, conv in enumerate(conversations):
        if isinstance(conv, str):
            rows.append(tokenizer.encode(conv))
            continue
        if chat is None:
            raise ConfigError(
                f"conversation {i} is a list of messages but the tokenizer {type(tokenizer).__name__} has no "
                "chat template; give the prompt as text or use a tokenizer with a chat template"
            )
        messages = check_messages(conv, f"conversations[{i}]")
        rows.append(chat.render(messages, tools=tools, add_generation_prompt=True))
    return prompts_from_ids(rows, tokenizer.pad_token_id, group_ids=group_ids, extras=extras)
