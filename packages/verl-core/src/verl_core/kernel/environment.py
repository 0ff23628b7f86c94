"""The Environment protocol: what a multi-turn episode talks to between the model's turns.

A user writes an environment in plain Python. The episode loop (:mod:`verl_core.agent.loop`)
builds one fresh environment per sample from its dataset row (an :data:`EnvironmentFactory`),
samples the model's turn, hands its text and exact token ids to :meth:`Environment.step`, and
appends the :class:`StepResult`'s observation to the episode as tokens, until the environment says
``done`` or a limit ends the episode. Environments of different episodes are stepped concurrently
on threads: an environment must not share mutable state with another one without a lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from verl_core.kernel.errors import VerlError, describe
from verl_core.kernel.tokenizer import ChatMessage

__all__ = ["Environment", "EnvironmentFactory", "Observation", "StepResult", "StepResultError",
           "check_messages"]

Observation = str | Sequence[ChatMessage]
"""What the model sees next: chat messages (rendered through the chat template, e.g. role ``tool``
or ``user``), or text appended verbatim as tokens (the environment then owns its formatting)."""


class StepResultError(VerlError, TypeError):
    """An environment's step returned something the episode loop cannot use (the message says what)."""


def check_messages(messages: object, name: str) -> tuple[dict[str, Any], ...]:
    """Chat messages as a tuple of plain dicts, each with a string ``role`` and ``content``.

    Args:
        messages: What was given (a list of mappings).
        name: How the message names it.

    Raises:
        StepResultError: not a list of mappings, or a message without a non-empty string ``role``
            or without a string ``content``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise StepResultError(f"{name} must be a list of chat messages, got {describe(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise StepResultError(f"{name}[{i}] must be a mapping with 'role' and 'content', got {describe(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise StepResultError(f"{name}[{i}]['role'] must be a non-empty string such as 'tool' or 'user', "
                                  f"got {describe(role)}")
        if not isinstance(content, str):
            raise StepResultError(f"{name}[{i}]['content'] must be a string, got {describe(content)}")
        out.append(dict(m))
    return tuple(out)


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one model turn; checked when built.

    Attributes:
        observation: What the model sees before its next turn: a list of chat messages (each a
            mapping with string ``role`` and ``content``), or text appended verbatim. Empty (``""``
            or ``()``) appends nothing; an observation is not appended after ``done``.
        reward: Reward of this turn (None = none); the loop records it per turn.
        done: The episode ends after this turn.
        metrics: Counts of this step (e.g. ``tool_calls``, ``tool_errors``, ``tool_timeouts``); the
            loop sums them per episode.

    Raises:
        StepResultError: a field of the wrong type, a non-finite reward or metric, or a malformed
            message; the message names the field.
    """

    observation: Observation = ""
    reward: float | None = None
    done: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.observation, str):
            object.__setattr__(self, "observation", check_messages(self.observation, "StepResult.observation"))
        if self.reward is not None and (
            isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward)
        ):
            raise StepResultError(f"StepResult.reward must be a finite number or None, got {describe(self.reward)}")
        if not isinstance(self.done, bool):
            raise StepResultError(f"StepResult.done must be True or False, got {describe(self.done)}")
        if not isinstance(self.metrics, Mapping):
            raise StepResultError(f"StepResult.metrics must be a mapping of names to numbers, got "
                                  f"{describe(self.metrics)}")
        for k, v in self.metrics.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise StepResultError(f"StepResult.metrics must map names to finite numbers, got {k!r}: {describe(v)}")


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: it reads each model turn and answers with a :class:`StepResult`.

    Contract:

    * one instance per episode, built fresh by an :data:`EnvironmentFactory` from the sample's
      dataset row, so no state leaks between episodes;
    * :meth:`step` is called once per completed model turn, in order, never concurrently for one
      instance, and never again after it returned ``done=True``;
    * a turn cut by the token budget is not handed to the environment (the episode ends truncated);
    * an exception, a return value that is not a :class:`StepResult`, or a step that outlives the
      loop's timeout ends the episode with an error the loop records (the run goes on);
    * an environment that never says ``done`` is ended by the loop's ``max_turns``.
    """

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        """Answer one model turn.

        Args:
            text: The turn's text, decoded without special tokens (so without the end-of-turn token).
            token_ids: The exact ids the model sampled in this turn, including a final EOS/stop token.

        Returns:
            The observation, the turn's reward and whether the episode is over.
        """
        ...


EnvironmentFactory = Callable[[Mapping[str, Any]], Environment]
"""Builds a fresh :class:`Environment` for one sample from its dataset row (the prompt batch's
extras of that sample, by key)."""
