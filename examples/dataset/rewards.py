"""Reward functions of the dataset example, named in config.toml as "rewards.py:<function>".

Each is called once per batch with keywords: ``prompts`` and ``completions`` (decoded texts, one
per sample) and every other dataset column (here ``id`` and ``answer``), aligned with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def prefix_match(completions: Sequence[str], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """The share of the answer's characters that the completion gets right from its start."""
    scores = []
    for completion, want in zip(completions, answer):
        right = 0
        for got, expected in zip(completion, want):
            if got != expected:
                break
            right += 1
        scores.append(right / len(want))
    return scores


def same_length(completions: Sequence[str], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion is as long as the answer (it stopped in time): a signal found early."""
    return [1.0 if len(completion) == len(want) else 0.0 for completion, want in zip(completions, answer)]
