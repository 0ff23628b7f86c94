"""HybridReplayBuffer: a ReplayBuffer that keeps recent batches in memory and spills older ones to disk.

Batches are stored whole (one segment per :meth:`~HybridReplayBuffer.add`). When the memory tier
holds more samples or bytes than its bounds, the oldest in-memory segments are written to the spill
directory with :func:`~verl_core.trainer.batching.batch_io.save_batch` and read back with :func:`~verl_core.trainer.batching.batch_io.load_batch` when needed, so
nothing is lost and every value comes back bit for bit.

The buffer deletes only what it wrote: its spill files, the private folder it created for them
(when nothing else is in it) and the spill root when it created that too. Each spilled segment is
checked when read back (the file's size and CRC-32, and every field's shape, dtype and CRC-32 as
written), so a file truncated or changed on disk raises :class:`~verl_core.kernel.errors.CheckpointError`
naming it instead of feeding wrong samples to an update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import tempfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.buffer import ReplayBuffer
from verl_core.kernel.errors import BatchValidationError, CheckpointError, ConfigError, VerlError
from verl_core.trainer.batching.batch_io import load_batch, save_batch

__all__ = [
    "BufferClosedError",
    "BufferEmptyError",
    "BufferFullError",
    "HybridReplayBuffer",
    "remove_stale_spill",
]

_DIR_PREFIX: Final = "verl-replay-"
# what a buffer writes into its private folder: segments, and save_batch's temporary files
_OWN_FILE: Final = re.compile(r"segment-\d{8}\.pt|\.segment-\d{8}\.pt\.tmp-\d+")


class BufferFullError(VerlError, RuntimeError):
    """Adding a batch would exceed the buffer's bounds (and there is no disk tier to spill to)."""


class BufferEmptyError(VerlError, ValueError):
    """The buffer holds fewer samples than asked for (or none)."""


class BufferClosedError(VerlError, RuntimeError):
    """The buffer was closed and cannot be used any more."""


# (name, shape, dtype, CRC-32 of the bytes) of every field, then CRC-32 of the extras and meta
_Fingerprint = tuple[tuple[tuple[str, tuple[int, ...], str, int], ...], int]


def _fingerprint(batch: TensorBatch) -> _Fingerprint:
    fields = []
    for name in sorted(batch.keys()):
        t = batch[name].detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        fields.append((name, tuple(t.shape), str(t.dtype), zlib.crc32(raw.data)))
    rest = json.dumps([{k: list(v) for k, v in sorted(batch.extras.items())}, repr(batch.meta)], default=repr)
    return tuple(fields), zlib.crc32(rest.encode())


@dataclass
class _Segment:
    size: int
    nbytes: int
    batch: TensorBatch | None  # None once spilled
    path: Path | None = None
    file_bytes: int = 0  # size of the spill file as written
    file_crc: int = 0  # CRC-32 of the spill file as written
    written: _Fingerprint | None = None  # the batch as spilled

    def load(self) -> TensorBatch:
        if self.batch is not None:
            return self.batch
        assert self.path is not None and self.written is not None
        fix = (
            "the file was cut short or changed after the buffer wrote it (a full disk, or another process "
            "writing into the run's spill folder); its samples are lost: restart from the last checkpoint "
            "(`verl train CONFIG --resume`)"
        )
        where = f"replay-buffer spill file {str(self.path)!r}"
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise CheckpointError(f"{where} is missing ({e}); {fix}") from e
        what = "truncated" if size < self.file_bytes else "corrupted"
        sizes = f"it has {size} bytes, {self.file_bytes} were written"
        try:
            batch = load_batch(self.path)
        except BatchValidationError as e:
            detail = sizes if size != self.file_bytes else str(e)
            raise CheckpointError(f"{where} is {what}: {detail}; {fix}") from e
        read = _fingerprint(batch)
        if read != self.written or batch.batch_size != self.size:
            raise CheckpointError(f"{where} is corrupted: {_difference(self.written, read)}; {fix}")
        if size != self.file_bytes:
            raise CheckpointError(f"{where} is {what}: {sizes}; {fix}")
        if _file_crc(self.path) != self.file_crc:  # a change outside the tensors' bytes (e.g. the zip records)
            raise CheckpointError(f"{where} is corrupted: its bytes differ from those written (CRC-32); {fix}")
        return batch


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _difference(written: _Fingerprint, read: _Fingerprint) -> str:
    """Which part of a spilled segment differs from what was written."""
    names_w, names_r = [f[0] for f in written[0]], [f[0] for f in read[0]]
    if names_w != names_r:
        return f"it holds fields {names_r}, {names_w} were written"
    for (name, shape, dtype, crc), (_, shape_r, dtype_r, crc_r) in zip(written[0], read[0]):
        if (shape, dtype) != (shape_r, dtype_r):
            return f"field {name!r} is {dtype_r} {list(shape_r)}, {dtype} {list(shape)} was written"
        if crc != crc_r:
            return f"the bytes of field {name!r} differ from those written (CRC-32)"
    return "its extras or meta differ from those written"


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
    concatenated). :meth:`clear` removes the spill files the buffer wrote and its private folder;
    :meth:`close` also removes ``spill_dir`` when the buffer created it and it is empty. Nothing
    else is ever deleted.

    Raises:
        ConfigError: a bound is not a positive integer or None, ``spill_dir`` is not a path, or
            ``spill`` is not a bool.
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
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(
                    f"HybridReplayBuffer.{name} must be an integer >= 1 or None (unbounded), got {value!r}"
                )
            if value is not None and value < 1:
                raise ConfigError(f"HybridReplayBuffer.{name} must be >= 1 or None (unbounded), got {value}")
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise ConfigError(f"HybridReplayBuffer.spill_dir must be a path or None, got {spill_dir!r}")
        if spill_dir is not None and not str(spill_dir).strip():
            raise ConfigError("HybridReplayBuffer.spill_dir is empty; pass a folder, or None for the system temp dir")
        if not isinstance(spill, bool):
            raise ConfigError(f"HybridReplayBuffer.spill must be true or false, got {spill!r}")
        self.capacity = capacity
        self.memory_samples = memory_samples
        self.memory_bytes = memory_bytes
        self._spill = spill
        self._spill_root = Path(spill_dir) if spill_dir is not None else None
        self._made_root: list[Path] = []  # folders of spill_dir this buffer created, deepest first
        self._dir: Path | None = None  # the private folder (mkdtemp) holding this buffer's files
        self._files: list[Path] = []  # the spill files this buffer wrote into it
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
            written = _fingerprint(seg.batch)
            self._files.append(path)
            save_batch(seg.batch, path)
            seg.file_bytes, seg.file_crc = path.stat().st_size, _file_crc(path)
            seg.path, seg.written = path, written
            seg.batch = None

    def _spill_dir(self) -> Path:
        if self._dir is None:
            root = self._spill_root
            if root is not None and not root.exists():
                missing = [root, *(p for p in root.parents if not p.exists())]
                root.mkdir(parents=True, exist_ok=True)
                self._made_root = self._made_root or missing
            self._dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=root))
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
            ConfigError: ``n`` is not an integer >= 1, or ``seed`` not an integer or None.
            BufferEmptyError: the buffer is empty, or ``n`` exceeds the samples held when
                ``replace`` is False (both are ValueErrors).
        """
        _check_int("sample", "n", n, 1)
        if seed is not None:
            _check_int("sample", "seed", seed, None)
        with self._lock:
            self._check_open()
            total = len(self)
            if total == 0:
                raise BufferEmptyError("sample() on an empty HybridReplayBuffer; add() batches first")
            if not replace and n > total:
                raise BufferEmptyError(
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
        _check_int("mini_batches", "size", size, 1)
        _check_int("mini_batches", "epochs", epochs, 1)
        _check_int("mini_batches", "seed", seed, None)
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
        snap._segments = [dataclasses.replace(s) for s in self._segments]
        snap._dir, snap._files, snap._made_root = None, [], []  # owns no file: never deletes one
        return snap

    def drain(self) -> TensorBatch:
        """Remove and return every sample, in insertion order (memory and disk tiers alike).

        Raises:
            BufferEmptyError: the buffer is empty.
        """
        with self._lock:
            self._check_open()
            if not self._segments:
                raise BufferEmptyError("drain() on an empty HybridReplayBuffer; add() batches first")
            out = TensorBatch.concat([s.load() for s in self._segments])
            self.clear()
            return out

    def clear(self) -> None:
        """Remove every sample, the spill files this buffer wrote and its private spill folder."""
        with self._lock:
            self._segments = []
            self._signature = None
            self._remove_own_files()

    def close(self) -> None:
        """Clear the buffer and remove ``spill_dir`` if it created it (and it is empty); the buffer is unusable afterwards."""
        with self._lock:
            self.clear()
            for folder in self._made_root:
                with contextlib.suppress(OSError):  # not empty: something else lives there
                    folder.rmdir()
            self._made_root = []
            self._closed = True

    def _remove_own_files(self) -> None:
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files = []
        if self._dir is not None:
            with contextlib.suppress(OSError):  # left alone when it holds files this buffer did not write
                self._dir.rmdir()
            self._dir = None

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("HybridReplayBuffer is closed; create a new one")

    def __enter__(self) -> HybridReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_dir", None) is not None:
            self._remove_own_files()


def _check_int(method: str, name: str, value: Any, low: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        need = "an integer" + (f" >= {low}" if low is not None else "")
        raise ConfigError(f"HybridReplayBuffer.{method}({name}={value!r}): {name} must be {need}")


def remove_stale_spill(root: str | os.PathLike[str]) -> int:
    """Remove what buffers of a killed process left under ``root``; returns the files removed.

    Only files a buffer writes (``segment-*.pt`` and their temporaries) inside the private
    ``verl-replay-*`` folders are removed, then those folders when empty; anything else stays.
    Call it only when no live buffer uses ``root`` (the trainer does on resume, holding the run's
    lock).
    """
    base = Path(root)
    if not base.is_dir():
        return 0
    removed = 0
    for folder in base.glob(f"{_DIR_PREFIX}*"):
        if folder.is_symlink() or not folder.is_dir():
            continue
        for f in folder.iterdir():
            if _OWN_FILE.fullmatch(f.name) and f.is_file() and not f.is_symlink():
                f.unlink()
                removed += 1
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed
