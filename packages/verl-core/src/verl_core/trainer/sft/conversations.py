"""Whole conversations as SFT rows: rendered with the chat template, trained on the assistant's tokens only.

:func:`render_conversation` renders a conversation (system, user, assistant, tool messages, with
the tools' schemas) incrementally, never re-tokenizing what is already rendered: before each
assistant message, the conversation so far with the generation prompt (the assistant's header,
not trained); then the conversation including that message, whose new tokens are the message and
what the template puts after it. The message's tokens and the template's end-of-turn token (the
first token of :attr:`~verl_core.agent.render.ObservationRenderer.tail`) are trained; what
follows the end-of-turn token (a newline in ChatML) is not, as in a multi-turn rollout, where the
model's turn ends at that token and the rest is part of the next observation. Every rendering
must extend the previous one token for token (the rule multi-turn rollouts rely on), and the
tokens after the last assistant message are left out.

The result is the layout of a rollout: ``prompt`` (the tokens before the first assistant
message) and ``response`` with its ``loss_mask``, so the SFT loss (:class:`~verl_core.trainer.sft.trainer.SFTLoss`)
reads ``TensorBatch.loss_mask`` like every RL loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_core.agent.render import ObservationRenderer
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.tokenizer import ChatMessage, ChatTokenizer

__all__ = ["RenderedConversation", "render_conversation"]


@dataclass(frozen=True)
class RenderedConversation:
    """A conversation's tokens split like a rollout.

    Attributes:
        prompt: The tokens before the first assistant message (its header included).
        response: Every token after, up to the last assistant message's end-of-turn token.
        loss_mask: Per response token, whether it is trained (an assistant message's token).
    """

    prompt: list[int]
    response: list[int]
    loss_mask: list[bool]


def _mismatch(before: Sequence[int], after: Sequence[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after)))


def render_conversation(
    tokenizer: ChatTokenizer, messages: Sequence[ChatMessage], *, tools: Sequence[Mapping[str, Any]] | None = None,
    where: str = "conversation",
) -> RenderedConversation:
    """Render ``messages`` through the chat template and mark the assistant's tokens (see the module docstring).

    Args:
        tokenizer: A tokenizer with a chat template.
        messages: The conversation; it needs a message before the first assistant message and at
            least one assistant message.
        tools: JSON tool schemas the template lists (as in the multi-turn rollouts of the same model).
        where: How messages name the conversation (e.g. ``data.train: 'x.jsonl' row 3``).

    Raises:
        ConfigError: no assistant message, or one first; a template that puts no end-of-turn
            token after an assistant message; a rendering that does not extend the previous one
            (naming the message and the token where they differ).
    """
    roles = [m.get("role") for m in messages]
    if "assistant" not in roles:
        raise ConfigError(f"{where}: the conversation has no assistant message to train on (roles {roles})")
    if roles[0] == "assistant":
        raise ConfigError(f"{where}: the conversation starts with an assistant message; it needs the prompt "
                          "(a system or user message) first")
    tail = ObservationRenderer(tokenizer).tail
    if not tail:
        raise ConfigError(f"{where}: the chat template puts no token after an assistant message, so a turn has no "
                          "end-of-turn token to learn; use a template that closes each message (e.g. ChatML's <|im_end|>)")
    ids: list[int] = []
    trained: list[bool] = []

    def extend(rendered: list[int], what: str) -> list[int]:
        if rendered[: len(ids)] != ids:
            at = _mismatch(ids, rendered)
            raise ConfigError(
                f"{where}: rendering {what} changes the tokens already rendered at token {at} (before: "
                f"{ids[at:at + 8]}..., now: {rendered[at:at + 8]}...); the template does not render the "
                "conversation as a sequence of appended turns, which the loss mask needs"
            )
        return rendered[len(ids):]

    for i, role in enumerate(roles):
        if role != "assistant":
            continue
        head = extend(tokenizer.render(messages[:i], tools=tools, add_generation_prompt=True),
                      f"the messages before message {i} with the generation prompt")
        ids.extend(head)
        trained.extend([False] * len(head))
        reply = extend(tokenizer.render(messages[: i + 1], tools=tools, add_generation_prompt=False),
                       f"assistant message {i}")
        if len(reply) < len(tail) or reply[len(reply) - len(tail):] != tail:
            raise ConfigError(
                f"{where}: assistant message {i} does not end with what the template puts after a reply ({tail}); "
                f"its tokens end with {reply[-len(tail):]}"
            )
        cut = len(reply) - len(tail) + 1  # the message and the end-of-turn token
        ids.extend(reply)
        trained.extend([True] * cut + [False] * (len(reply) - cut))
    extend(tokenizer.render(messages, tools=tools, add_generation_prompt=False), "the whole conversation")
    end = len(trained) - trained[::-1].index(True)
    start = trained.index(True)
    return RenderedConversation(prompt=ids[:start], response=ids[start:end], loss_mask=trained[start:end])
