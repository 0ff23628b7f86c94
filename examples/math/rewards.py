"""The math example's reward, named in config.toml as ``"rewards.py:numeric_answer"``.

Answer format: the response's **last number** is its answer. ``"Tom has 12 apples now."``,
``"5 + 7 = 12"`` and ``"12"`` all answer 12; ``"12 apples, not 13"`` answers 13. A number is
an optional ``-``, digits with optional thousands commas (``1,200``), an optional decimal part
(``2.5``) or a fraction (``3/4``). A response with no number scores 0.

The ``answer`` column holds the expected number as text (``"12"``), or text whose last number is
the answer (GSM8K's ``"... #### 12"``). For answers written as ``\\boxed{12}``, list the built-in
``verl_core.trainer.inputs.reward_functions:numeric_match`` instead, which reads the last box first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_core.trainer.inputs.reward_functions import parse_number


def numeric_answer(completions: Sequence[str], answer: Sequence[Any], **columns: Any) -> list[float]:
    """1.0 where the completion's last number equals the sample's ``answer``, else 0.0.

    Raises:
        ValueError: an ``answer`` holds no number (the trainer reports it as a ``RewardError``
            naming this function and the sample).
    """
    scores = []
    for i, (completion, expected) in enumerate(zip(completions, answer)):
        want = parse_number(str(expected))
        if want is None:
            raise ValueError(f"the answer {expected!r} of sample {i} holds no number")
        got = parse_number(completion)
        scores.append(1.0 if got is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want)) else 0.0)
    return scores
