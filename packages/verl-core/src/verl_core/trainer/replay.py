"""HybridReplayBuffer: a ReplayBuffer that keeps recent batches in memory and spills older ones to disk.

Batches are stored whole (one segment per :meth:`~HybridReplayBuffer.add`). When the memory tier
holds more samples or bytes than its bounds, the oldest in-memory segments are written to the spill
directory with :meth:`TensorBatch.save` and read back with :meth:`TensorBatch.load` when needed, so
nothing is lost and every value comes back bit for bit.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_core.batch import TensorBatch
from verl_core.buffer import ReplayBuffer
from verl_core.errors import ConfigError, VerlError

__all__ = ["BufferFullError", "HybridReplayBuffer"]


class BufferFullError(VerlError, RuntimeError):
    """Adding a batch would exceed the buffer's bounds (and there is no disk tier to spill to)."""


@dataclass
class _Segment:
    size: int
    nbytes: int
    batch: TensorBatch | None  # None once spilled
    path: Path | None = None

    def load(self) -> TensorBatch:
        if self.batch is not None:
            return self.batch
        assert self.path is not None
        return TensorBatch.load(self.path)


def _nbytes(batch: TensorBatch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


class HybridReplayBuffer(ReplayBuffer):
    """A replay buffer with a bounded memory tier and an optional disk tier.

    Args:
        capacity: Most samples held in total (memory plus disk); adding past it raises
            :class:`BufferFullError`. None = unbounded.
        memory_samples: Most samples kept in memory before the oldest batches spill to disk.
        memory_bytes: Most tensor bytes kept in memory before the oldest batches spill to disk.
        spill_dir: Folder under which a private spill directory is created (the system temp dir
            when None). ``spill=False`` turns the disk tier off: exceeding a memory bound then raises.
        spill: Whether batches past the memory bounds go to disk.

    Every added batch must have the same fields and extras keys as the first one (so samples can be
    concatenated). The spill directory is removed by :meth:`clear` (its files) and :meth:`close`.
    """

    def __init__(
        self,
        *,
        capacity: int | None = None,
        memory_samples: int | None = None,
        memory_bytes: int | None = None,
        spill_dir: str | Path | None = None,
        spill: bool = True,
    ) -> None:
        for name, value in (("capacity", capacity), ("memory_samples", memory_samples),
                            ("memory_bytes", memory_bytes)):
            if value is not None and value < 1:
                raise ConfigError(f"HybridReplayBuffer.{name} must be >= 1 or None (unbounded), got {value}")
        self.capacity = capacity
        self.memory_samples = memory_samples
        self.memory_bytes = memory_bytes
        self._spill = spill
        self._spill_root = Path(spill_dir) if spill_dir is not None else None
        self._dir: Path | None = None
        self._segments: list[_Segment] = []
        self._counter = itertools.count()
        self._signature: tuple[frozenset[str], frozenset[str]] | None = None
        self._lock = threading.RLock()
        self._closed = False

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        """Samples held (memory plus disk)."""
        with self._lock:
            return sum(s.size for s in self._segments)

    @property
    def samples_in_memory(self) -> int:
        """Samples held in the memory tier."""
        with self._lock:
            return sum(s.size for s in self._segments if s.batch is not None)

    @property
    def samples_on_disk(self) -> int:
        """Samples held in the disk tier."""
        with self._lock:
            return sum(s.size for s in self._segments if s.batch is None)

    @property
    def bytes_in_memory(self) -> int:
        """Tensor bytes held in the memory tier."""
        with self._lock:
            return sum(s.nbytes for s in self._segments if s.batch is not None)

    @property
    def spill_path(self) -> Path | None:
        """The private spill directory (None until something spilled)."""
        return self._dir

    # ------------------------------------------------------------------ add and spill
    def add(self, batch: TensorBatch) -> None:
        """Append every sample of ``batch`` (spilling older batches to disk past the memory bounds).

        Raises:
            BufferFullError: ``capacity`` would be exceeded, or a memory bound would be exceeded
                and spilling is off.
            ConfigError: the batch's fields or extras differ from the batches already held.
        """
        with self._lock:
            self._check_open()
            if batch.batch_size == 0:
                return
            sig = (frozenset(batch.keys()), frozenset(batch.extras))
            if self._signature is not None and sig != self._signature:
                raise ConfigError(
                    f"HybridReplayBuffer.add: batch has fields {sorted(sig[0])} and extras {sorted(sig[1])}, "
                    f"but the buffer holds fields {sorted(self._signature[0])} and extras "
                    f"{sorted(self._signature[1])}; every batch in one buffer must have the same ones"
                )
            held = len(self)
            if self.capacity is not None and held + batch.batch_size > self.capacity:
                raise BufferFullError(
                    f"HybridReplayBuffer is full: it holds {held} of capacity={self.capacity} samples and "
                    f"cannot add {batch.batch_size}; drain() or clear() it first, or raise capacity"
                )
            nbytes = _nbytes(batch)
            if not self._spill:
                self._check_memory_without_spill(batch.batch_size, nbytes)
            self._signature = sig
            self._segments.append(_Segment(batch.batch_size, nbytes, batch.to("cpu")))
            self._spill_excess()

    def _check_memory_without_spill(self, size: int, nbytes: int) -> None:
        if self.memory_samples is not None and self.samples_in_memory + size > self.memory_samples:
            raise BufferFullError(
                f"HybridReplayBuffer: adding {size} samples exceeds memory_samples={self.memory_samples} "
                f"(holding {self.samples_in_memory}) and spilling to disk is off; pass spill=True or raise "
                "memory_samples"
            )
        if self.memory_bytes is not None and self.bytes_in_memory + nbytes > self.memory_bytes:
            raise BufferFullError(
                f"HybridReplayBuffer: adding {nbytes} bytes exceeds memory_bytes={self.memory_bytes} "
                f"(holding {self.bytes_in_memory}) and spilling to disk is off; pass spill=True or raise "
                "memory_bytes"
            )

    def _over_memory(self) -> bool:
        if self.memory_samples is not None and self.samples_in_memory > self.memory_samples:
            return True
        return self.memory_bytes is not None and self.bytes_in_memory > self.memory_bytes

    def _spill_excess(self) -> None:
        for seg in self._segments:
            if not self._over_memory():
                return
            if seg.batch is None:
                continue
            path = self._spill_dir() / f"segment-{next(self._counter):08d}.pt"
            seg.batch.save(path)
            seg.path = path
            seg.batch = None

    def _spill_dir(self) -> Path:
        if self._dir is None:
            if self._spill_root is not None:
                self._spill_root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="verl-replay-", dir=self._spill_root))
        return self._dir

    # ------------------------------------------------------------------ read
    def _gather(self, indices: list[int]) -> TensorBatch:
        """Samples at global ``indices`` (insertion order numbering), in the order given."""
        starts = list(itertools.accumulate((s.size for s in self._segments), initial=0))
        by_seg: dict[int, list[tuple[int, int]]] = {}
        for pos, g in enumerate(indices):
            lo, hi = 0, len(self._segments) - 1
            while lo < hi:  # last segment whose start <= g
                mid = (lo + hi + 1) // 2
                if starts[mid] <= g:
                    lo = mid
                else:
                    hi = mid - 1
            by_seg.setdefault(lo, []).append((pos, g - starts[lo]))
        pieces: list[TensorBatch] = []
        positions: list[int] = []
        for seg_i in sorted(by_seg):
            picks = by_seg[seg_i]
            pieces.append(self._segments[seg_i].load().index([local for _, local in picks]))
            positions.extend(pos for pos, _ in picks)
        merged = TensorBatch.concat(pieces)
        inverse = torch.empty(len(positions), dtype=torch.int64)
        inverse[torch.tensor(positions, dtype=torch.int64)] = torch.arange(len(positions))
        return merged.index(inverse)

    def sample(self, n: int, *, replace: bool = False, seed: int | None = None) -> TensorBatch:
        """``n`` samples drawn uniformly; the same ``seed`` and contents give the same samples.

        Raises:
            ValueError: ``n`` exceeds the samples held when ``replace`` is False, or the buffer is empty.
        """
        with self._lock:
            self._check_open()
            total = len(self)
            if n < 1:
                raise ValueError(f"sample(n={n}) needs n >= 1")
            if total == 0:
                raise ValueError("sample() on an empty HybridReplayBuffer; add() batches first")
            if not replace and n > total:
                raise ValueError(
                    f"sample(n={n}, replace=False) but the buffer holds only {total} samples; "
                    "lower n or pass replace=True"
                )
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            if replace:
                idx = torch.randint(total, (n,), generator=gen)
            else:
                idx = torch.randperm(total, generator=gen)[:n]
            return self._gather(idx.tolist())

    def mini_batches(self, size: int, *, epochs: int = 1, seed: int = 0) -> Iterator[TensorBatch]:
        """Shuffled mini-batches of ``size`` for ``epochs`` passes over a snapshot of the samples.

        Each pass is a fresh permutation seeded by ``(seed, epoch)``; every sample appears exactly
        once per pass; the last mini-batch of a pass holds the remainder when ``size`` does not
        divide the number of samples.
        """
        if size < 1 or epochs < 1:
            raise ValueError(f"mini_batches(size={size}, epochs={epochs}) needs size >= 1 and epochs >= 1")
        with self._lock:
            self._check_open()
            total = len(self)
            snapshot = self._snapshot()
        for epoch in range(epochs):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perm = torch.randperm(total, generator=gen).tolist()
            for start in range(0, total, size):
                yield snapshot._gather(perm[start : start + size])

    def _snapshot(self) -> HybridReplayBuffer:
        # the segments as they are now; spilled ones stay on disk and load per mini-batch
        snap = HybridReplayBuffer.__new__(HybridReplayBuffer)
        snap._segments = [_Segment(s.size, s.nbytes, s.batch, s.path) for s in self._segments]
        snap._dir = None
        return snap

    def drain(self) -> TensorBatch:
        """Remove and return every sample, in insertion order (memory and disk tiers alike).

        Raises:
            ValueError: the buffer is empty.
        """
        with self._lock:
            self._check_open()
            if not self._segments:
                raise ValueError("drain() on an empty HybridReplayBuffer")
            out = TensorBatch.concat([s.load() for s in self._segments])
            self.clear()
            return out

    def clear(self) -> None:
        """Remove every sample and the spill files."""
        with self._lock:
            self._segments = []
            self._signature = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def close(self) -> None:
        """Clear the buffer and remove its spill directory; the buffer is unusable afterwards."""
        self.clear()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HybridReplayBuffer is closed")

    def __enter__(self) -> HybridReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        d = getattr(self, "_dir", None)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
