"""The demo's reward: 1.0 for exactly the answer followed by EOS, else 0.0.

Used as ``reward.functions = ["examples/demo/reward.py:exact_answer_then_eos"]``. A reward function
is called once per batch with keywords (see :mod:`verl_core.trainer.inputs.rewards`): ``completions`` are
the decoded responses with EOS dropped, so ``"123"`` alone cannot tell a finished response from one
cut at ``rollout.max_new_tokens``; ``truncated`` says which were cut, and ``completion_ids`` holds
the response tokens (EOS included), which rules out special tokens hidden by decoding
(``"1<pad>23"`` decodes to ``"123"`` too). ``answer`` is the dataset column of the same name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def exact_answer_then_eos(
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    truncated: Sequence[bool],
    answer: Sequence[str],
    **kwargs: Any,
) -> list[float]:
    """1.0 where the response is the answer's characters then EOS and nothing else, else 0.0.

    The demo's tokenizer has one token per character, so such a response has ``len(answer) + 1``
    tokens and ended with EOS (it was not truncated).
    """
    return [
        1.0 if not cut and text == str(want) and len(ids) == len(str(want)) + 1 else 0.0
        for text, ids, cut, want in zip(completions, completion_ids, truncated, answer, strict=True)
    ]
