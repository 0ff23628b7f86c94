"""A run callback that stops a run whose reward has died out, with a message saying why.

Listed in ``logging.sinks`` as ``"examples/demo/guard.py:StopWhenRewardIsZero"``. With a 0/1
reward, a group of samples that all score 0 gets zero GRPO advantages: once no sample of a step
earns a reward the update is zero, and a policy that has drifted there (too high a temperature or
learning rate, or too weak a warm start) stays there. Rather than spend the remaining steps on
nothing, the callback raises after ``patience`` such steps in a row; the trainer stops with a
``CallbackError`` carrying the message below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class StopWhenRewardIsZero:
    """Raise once ``reward/mean`` has been 0 for ``patience`` consecutive steps.

    Args:
        patience: Consecutive zero-reward steps tolerated.
        key: The metric watched.
    """

    def __init__(self, patience: int = 20, key: str = "reward/mean") -> None:
        self.patience = patience
        self.key = key
        self.zero_steps = 0

    def on_step_end(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Count the zero-reward steps in a row and stop the run at ``patience``."""
        value = metrics.get(self.key)
        if not isinstance(value, (int, float)):
            return
        self.zero_steps = self.zero_steps + 1 if value <= 0 else 0
        if self.zero_steps >= self.patience:
            raise RuntimeError(
                f"no sample earned a reward in the last {self.zero_steps} steps ({self.key} = 0), so GRPO has "
                "no learning signal left: the policy collapsed or never found the answer. Start from a longer "
                "SFT warm start, or lower rollout.temperature or optim.lr"
            )
