"""Faulty replay buffers: HybridReplayBuffer with one fault each (for the buffer checks' meta-tests).

Each is a factory as :func:`verl_conformance.api.check_buffer` takes one (the class itself).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from verl_core import TensorBatch
from verl_core.trainer.batching.replay import HybridReplayBuffer

__all__ = ["DropOldestBuffer", "EpochOrderRepeatedBuffer", "LossySpillBuffer", "ReorderingBuffer", "SeedIgnoredBuffer"]


class DropOldestBuffer(HybridReplayBuffer):
    """At capacity, drops the oldest batches to make room instead of raising."""

    def add(self, batch: TensorBatch) -> None:
        """Add, dropping old batches past capacity."""
        with self._lock:
            while self.capacity is not None and self._segments and len(self) + batch.batch_size > self.capacity:
                self._segments.pop(0)
        super().add(batch)


class ReorderingBuffer(HybridReplayBuffer):
    """drain() returns the batches newest first."""

    def drain(self) -> TensorBatch:
        """Drain in reverse order of the batches."""
        with self._lock:
            self._segments.reverse()
            return super().drain()


class LossySpillBuffer(HybridReplayBuffer):
    """Rounds float fields to bfloat16 when spilling (to halve the disk tier)."""

    def _spill_excess(self) -> None:
        if self._over_memory():
            for seg in self._segments:
                if seg.batch is not None:
                    b = seg.batch
                    seg.batch = b.update({k: t.to(torch.bfloat16).to(t.dtype) for k, t in b.items()
                                          if t.is_floating_point()})
        super()._spill_excess()


class EpochOrderRepeatedBuffer(HybridReplayBuffer):
    """mini_batches() shuffles once and repeats that order in every epoch."""

    def mini_batches(self, size: int, *, epochs: int = 1, seed: int = 0) -> Iterator[TensorBatch]:
        """The first epoch's mini-batches, ``epochs`` times."""
        first = list(super().mini_batches(size, epochs=1, seed=seed))
        for _ in range(epochs):
            yield from first


class SeedIgnoredBuffer(HybridReplayBuffer):
    """sample() and mini_batches() ignore the seed."""

    def sample(self, n: int, *, replace: bool = False, seed: int | None = None) -> TensorBatch:
        """Sample unseeded."""
        return super().sample(n, replace=replace, seed=None)

    def mini_batches(self, size: int, *, epochs: int = 1, seed: int = 0) -> Iterator[TensorBatch]:
        """Mini-batches under a fresh random seed."""
        return super().mini_batches(size, epochs=epochs, seed=random.randrange(1 << 30))
