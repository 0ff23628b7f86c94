"""The tool demo's user code: the calculator tool, the reward, and the environment of the no-tool baseline.

Named in the demo's configs as ``examples/agent/calculator.py:add`` (``agent.tools``),
``examples/agent/calculator.py:exact_answer`` (``reward.functions``) and
``examples/agent/calculator.py:answer_only`` (``agent.environment`` of the baseline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl_core.agent import StepResult


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def exact_answer(completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """1 when the final model turn is exactly the sum's digits, else 0.

    In a multi-turn run ``completions`` holds each episode's last model turn (decoded without the
    end-of-turn token): an episode that stops at a tool call, or answers anything else, gets 0.
    """
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


class AnswerOnly:
    """An environment that ends the episode after the model's first turn: the same episode loop, no tool."""

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        """End the episode."""
        return StepResult(done=True)


def answer_only(row: Mapping[str, Any]) -> AnswerOnly:
    """The baseline's environment factory: one turn, no tool."""
    return AnswerOnly()
