"""The environment of tests/trainer/test_partial_rollouts.py: three turns per episode, where the
second step of every episode of the second training step (rows whose answer is 3 or more, in an
unshuffled data order of 3 prompts a step) waits for the trainer's first weight update. The
producer may build the two steps' environments side by side, so the row decides, not the order."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from verl_core.agent import StepResult

TRAINER: Any = None
"""The test's trainer (read for its ``weight_version``)."""
FIRST_STEP_ROWS = 3
"""Rows of the first training step; the episodes of later rows wait for version 1."""
WAIT_S = 30.0

_lock = threading.Lock()
_made = 0
reached = threading.Event()
"""Set when an episode of the second step has sampled its first turn (and waits for version 1)."""
waited: list[bool] = []
"""Per waiting episode: whether version 1 arrived within WAIT_S."""


class ThreeTurns:
    def __init__(self, waits: bool) -> None:
        self.waits = waits
        self.turns = 0

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        self.turns += 1
        if self.turns == 1 and self.waits:  # hold the episode between its turns until the weights change
            reached.set()
            deadline = time.monotonic() + WAIT_S
            while TRAINER.weight_version < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with _lock:
                waited.append(TRAINER.weight_version >= 1)
        if self.turns == 3:
            return StepResult(done=True, reward=1.0)
        return StepResult([{"role": "tool", "content": "ok"}], metrics={"tool_calls": 1.0})


def make(row: Mapping[str, Any]) -> ThreeTurns:
    global _made
    with _lock:
        _made += 1
        return ThreeTurns(waits=int(row["answer"]) >= FIRST_STEP_ROWS)


def made() -> int:
    """Environments built since :func:`reset`."""
    with _lock:
        return _made


def reset(trainer: Any) -> None:
    global TRAINER, _made
    TRAINER, _made = trainer, 0
    waited.clear()
    reached.clear()


class Turns:
    """An episode of ``turns`` turns, each answered at once."""

    def __init__(self, turns: int) -> None:
        self.left = turns

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        self.left -= 1
        if self.left <= 0:
            return StepResult(done=True, reward=1.0)
        return StepResult([{"role": "tool", "content": "ok"}], metrics={"tool_calls": 1.0})


def ragged(row: Mapping[str, Any]) -> Turns:
    """1 to 3 turns, from the row's answer."""
    return Turns(1 + int(row["answer"]) % 3)
