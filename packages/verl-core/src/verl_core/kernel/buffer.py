"""The ReplayBuffer protocol."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Protocol

from verl_core.kernel.batch import TensorBatch

__all__ = ["ReplayBuffer"]


class ReplayBuffer(Protocol):
    """Holds samples between rollout and training, with bounded memory.

    Samples are never silently dropped: adding past the capacity raises (or spills to disk when
    the implementation has a disk tier), and every sample added is returned exactly once by
    :meth:`drain` unless :meth:`clear` removed it.
    """

    @abstractmethod
    def add(self, batch: TensorBatch) -> None:
        """Append every sample of ``batch`` (an empty batch adds nothing); every batch of one buffer
        has the same fields and extras."""

    @abstractmethod
    def sample(self, n: int, *, replace: bool = False, seed: int | None = None) -> TensorBatch:
        """``n`` samples drawn uniformly (seeded when ``seed`` is given); the buffer keeps them."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples held."""

    @abstractmethod
    def drain(self) -> TensorBatch:
        """Remove and return every sample, in the order added."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every sample."""

    @abstractmethod
    def mini_batches(self, size: int, *, epochs: int = 1, seed: int = 0) -> Iterator[TensorBatch]:
        """Shuffled mini-batches of ``size`` over all held samples, for ``epochs`` passes, each pass
        reshuffled (a fresh order per epoch, reproducible under ``seed``); the last mini-batch of a
        pass holds the remainder."""
