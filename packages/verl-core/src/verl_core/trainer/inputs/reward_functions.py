"""Built-in reward functions for ``reward.functions``, e.g. ``"verl_core.trainer.inputs.reward_functions:exact_match"``.

Each takes ``completions`` and dataset columns as keywords (see :mod:`verl_core.trainer.inputs.rewards`)
and returns 1.0 or 0.0 per completion:

* :func:`exact_match`: the stripped completion equals the stripped ``answer`` column.
* :func:`numeric_match`: the completion's final answer (the content of its last ``\\boxed{...}``,
  else its last number) equals the ``answer`` column as a number.
* :func:`format_match`: the stripped completion matches the regular expression in the ``pattern``
  column; :func:`regex_reward` makes a function for one fixed pattern instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

__all__ = ["exact_match", "extract_answer", "format_match", "numeric_match", "parse_number", "regex_reward"]

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def exact_match(completions: Sequence[str], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where the completion, stripped, equals ``str(answer)`` stripped; else 0.0."""
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no final answer


def parse_number(text: str) -> float | None:
    """The last number in ``text`` (thousands commas, decimals, ``a/b`` fractions), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    token = found[-1].replace(",", "")
    try:
        return float(Fraction(token))
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion: str) -> float | None:
    """The final numeric answer of a completion: its last ``\\boxed{...}`` content, else its last number."""
    boxed = _boxed(completion)
    return parse_number(boxed if boxed is not None else completion)


def numeric_match(completions: Sequence[str], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where the completion's final answer equals ``answer`` numerically (relative tolerance 1e-6).

    ``answer`` may be a number or text whose last number is the answer (e.g. GSM8K's ``"... #### 72"``).

    Raises:
        ValueError: an ``answer`` holds no number (naming the sample).
    """
    out = []
    for i, (c, a) in enumerate(zip(completions, answer)):
        want = float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else parse_number(str(a))
        if want is None:
            raise ValueError(f"the answer {a!r} of sample {i} holds no number")
        got = extract_answer(c)
        out.append(1.0 if got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else 0.0)
    return out


def format_match(completions: Sequence[str], pattern: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 where the stripped completion fully matches the sample's ``pattern`` column (``re.DOTALL``).

    Raises:
        re.error: a pattern does not compile.
    """
    return [1.0 if re.fullmatch(p, c.strip(), re.DOTALL) else 0.0 for c, p in zip(completions, pattern)]


def regex_reward(pattern: str, *, name: str = "format") -> Callable[..., list[float]]:
    """A reward function giving 1.0 where the stripped completion fully matches ``pattern`` (``re.DOTALL``).

    For ``reward.functions``, bind it to a name in your own file and name that, e.g. in
    ``rewards.py``: ``think_format = regex_reward(r"<think>.*</think>.*", name="think_format")``,
    then ``"rewards.py:think_format"``.

    Raises:
        re.error: ``pattern`` does not compile (at once, not at the first step).
    """
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [1.0 if compiled.fullmatch(c.strip()) else 0.0 for c in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"1.0 where the stripped completion fully matches {pattern!r}."
    return reward
