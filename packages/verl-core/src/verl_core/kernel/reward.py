"""The RewardEngine protocol and FunctionReward, a reward engine over Python scoring functions."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.errors import BatchValidationError, NonFiniteError
from verl_core.kernel.tokenizer import Tokenizer

__all__ = ["FunctionReward", "RewardEngine", "ScoreFn"]


class RewardEngine(Protocol):
    """Scores responses: rule-based functions and reward models alike.

    Input batches need ``prompt_ids``, ``prompt_mask``, ``response_ids`` and ``response_mask``
    (and whatever extras the scorer reads); they are validated at the boundary.
    """

    @property
    @abstractmethod
    def capabilities(self) -> RewardCapabilities:
        """What this engine produces."""

    @abstractmethod
    def score(self, batch: TensorBatch) -> TensorBatch:
        """Return ``batch`` updated with ``scores`` [batch] and/or ``token_scores`` [batch, response].

        Scores are finite float32; an empty response is scored like any other.
        """

    def close(self) -> None:
        """Release resources."""
        return None


ScoreFn = Callable[[str, str, Mapping[str, Any]], float]
"""``fn(prompt_text, response_text, extras_of_the_sample) -> score``."""


class FunctionReward(RewardEngine):
    """A reward engine that decodes each response and calls a plain Python scoring function.

    Args:
        fn: Scoring function ``fn(prompt, response, extras) -> float``; ``extras`` holds the
            sample's per-sample extras (e.g. ``{"answer": "42"}``).
        tokenizer: Decodes prompt and response ids (special tokens such as EOS are dropped).

    Raises:
        NonFiniteError: the function returned NaN or inf (naming the sample).
    """

    def __init__(self, fn: ScoreFn, tokenizer: Tokenizer) -> None:
        self._fn = fn
        self._tokenizer = tokenizer
        self._caps = RewardCapabilities(needs_text=True)

    @property
    def capabilities(self) -> RewardCapabilities:
        """Sequence scores from text."""
        return self._caps

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Decode every sample and score it with the function."""
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="FunctionReward.score")
        prompts = batch["prompt_ids"].cpu().tolist()
        pmask = batch["prompt_mask"].cpu().tolist()
        responses = batch["response_ids"].cpu().tolist()
        rmask = batch["response_mask"].cpu().tolist()
        extras = batch.extras
        out = []
        for i in range(batch.batch_size):
            prompt = self._tokenizer.decode([t for t, m in zip(prompts[i], pmask[i]) if m])
            response = self._tokenizer.decode([t for t, m in zip(responses[i], rmask[i]) if m])
            value = float(self._fn(prompt, response, {k: v[i] for k, v in extras.items()}))
            if not math.isfinite(value):
                raise NonFiniteError(f"reward function returned {value} for sample {i}; scores must be finite")
            out.append(value)
        if batch.batch_size == 0:
            raise BatchValidationError("FunctionReward.score: the batch is empty")
        return batch.update(scores=torch.tensor(out, dtype=torch.float32, device=batch.device))
