"""Run callbacks of the demo, listed in ``logging.sinks`` of ``examples/configs/grpo_demo.toml``.

* :class:`ShowHeldOut` prints each evaluation's held-out exact match above the progress bar.
* :class:`StopWhenRewardIsZero` stops a run whose reward has died out, with a message saying why.
  With a 0/1 reward, a group of samples that all score 0 gets zero GRPO advantages: once no sample
  of a step earns a reward the update is zero, and a policy that has drifted there (too high a
  temperature or learning rate, or too weak a warm start) stays there. Rather than spend the
  remaining steps on nothing, the callback raises after ``patience`` such steps in a row and the
  trainer stops with a ``CallbackError`` carrying its message.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

HELD_OUT = "eval/reward/exact_answer_then_eos/mean"
"""The exact reward's mean over one greedy response per held-out prompt: the exact-match rate."""


class ShowHeldOut:
    """Print ``step N: held-out exact match X`` after every evaluation."""

    def on_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write the line through tqdm, so the progress bar is redrawn below it."""
        from tqdm import tqdm

        if isinstance(metrics.get(HELD_OUT), (int, float)):
            tqdm.write(f"step {step}: held-out exact match {metrics[HELD_OUT]:.3f}", file=sys.stderr)


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
