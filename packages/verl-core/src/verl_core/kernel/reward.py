"""The RewardEngine protocol (reward functions over decoded text: :mod:`verl_core.trainer.inputs.rewards`)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities

__all__ = ["RewardEngine"]


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
        """Release resources.

        Ends every child process and non-daemon thread the engine started, and may be called
        more than once (``robustness::close_ends_what_the_engine_started``).
        """
        return None
