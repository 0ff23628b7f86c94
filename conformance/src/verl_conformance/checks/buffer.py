"""Replay buffer: capacity, order, spill to disk and back bit for bit, seeded sampling.

These checks run on a replay buffer implementation (:class:`verl_core.ReplayBuffer`) selected with
pytest's ``--verl-buffer MODULE:FACTORY`` or :func:`verl_conformance.api.check_buffer` (the ``verl
conformance`` command has no buffer option); they skip when none is selected. Every sample carries its own id (``group_ids``) and an extra (``uid``), so a sample
that comes back is recognised, and compared byte for byte with the one that went in.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import torch

from verl_conformance.checks._registry import check
from verl_conformance.harness import Harness
from verl_core import ReplayBuffer, TensorBatch, VerlError

_SIZES = (3, 2, 4)  # samples per added batch (ids 0..8)


def samples(h: Harness, first: int, n: int) -> TensorBatch:
    """``n`` samples with ids ``first..first+n-1`` (every field dtype of an RL batch, an extra per sample)."""
    b = h.batch(seed=80 + first, batch_size=n, rl_fields=True, empty=0)
    ids = list(range(first, first + n))
    return b.update(group_ids=torch.tensor(ids, dtype=torch.int64), extras={"uid": [f"sample-{i}" for i in ids]})


def batches(h: Harness, sizes: tuple[int, ...] = _SIZES) -> list[TensorBatch]:
    """Batches of ``sizes`` samples with consecutive ids."""
    out, first = [], 0
    for n in sizes:
        out.append(samples(h, first, n))
        first += n
    return out


def ids(batch: TensorBatch) -> list[int]:
    """The sample ids of ``batch`` in its order."""
    return [int(i) for i in batch["group_ids"].tolist()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_samples(h: Harness, got: TensorBatch, want: TensorBatch, what: str) -> None:
    """Fail unless ``got`` holds ``want``'s samples in ``want``'s order, bit for bit (fields and extras)."""
    h.expect(ids(got) == ids(want), f"{what}: sample ids {ids(got)}, expected {ids(want)}")
    h.expect(set(got.keys()) == set(want.keys()),
             f"{what}: fields {sorted(got.keys())}, expected {sorted(want.keys())}")
    for name in want:
        a, b = got[name], want[name]
        same = a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(_bits(a), _bits(b)))
        h.expect(same, f"{what}: field {name!r} is not bit-identical to what was added "
                 f"(got {a.dtype} {list(a.shape)}, added {b.dtype} {list(b.shape)})")
    for key, values in want.extras.items():
        h.expect(tuple(got.extras.get(key, ())) == tuple(values), f"{what}: extra {key!r} differs from what was added")


def _make(h: Harness, spill_dir: Path | None = None, **kw: int | None) -> ReplayBuffer:
    buffer = h.require_buffer()
    return buffer.make(spill_dir=None if spill_dir is None else str(spill_dir), **kw)


def _close(buf: ReplayBuffer) -> None:
    close = getattr(buf, "close", None)
    if callable(close):
        close()


@check("buffer")
def check_buffer_capacity(h: Harness) -> None:
    """Adding past capacity raises a VerlError and drops nothing; drain and clear empty the buffer."""
    parts = batches(h)
    cap = sum(_SIZES[:2])
    buf = _make(h, capacity=cap)
    try:
        for b in parts[:2]:
            buf.add(b)
        h.expect(len(buf) == cap, f"len() is {len(buf)} after adding {cap} samples")
        try:
            buf.add(parts[2])
        except VerlError:
            pass
        except Exception as e:
            h.fail(f"adding past capacity={cap} raised {type(e).__name__}: {e}; expected a VerlError")
        else:
            h.fail(f"adding {parts[2].batch_size} samples to a buffer holding {cap} of capacity={cap} was accepted "
                   f"(len() is now {len(buf)}); it must raise, never drop samples")
        h.expect(len(buf) == cap, f"len() is {len(buf)} after a refused add; the buffer held {cap}")
        same_samples(h, buf.drain(), TensorBatch.concat(parts[:2]),
                     "drain() after a refused add (no sample may be dropped or half-added)")
        h.expect(len(buf) == 0, f"len() is {len(buf)} after drain()")
        buf.add(parts[2])
        buf.clear()
        h.expect(len(buf) == 0, f"len() is {len(buf)} after clear()")
    finally:
        _close(buf)


@check("buffer")
def check_buffer_order(h: Harness) -> None:
    """drain() returns every sample once, in the order added, bit for bit; the buffer is reusable after."""
    parts = batches(h)
    buf = _make(h)
    try:
        for b in parts:
            buf.add(b)
        h.expect(len(buf) == sum(_SIZES), f"len() is {len(buf)} after adding {sum(_SIZES)} samples")
        same_samples(h, buf.drain(), TensorBatch.concat(parts), "drain()")
        buf.add(parts[1])
        buf.add(parts[0])
        same_samples(h, buf.drain(), TensorBatch.concat([parts[1], parts[0]]), "drain() of a reused buffer")
    finally:
        _close(buf)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@check("buffer")
def check_buffer_spill(h: Harness) -> None:
    """Past memory_samples the buffer spills to spill_dir; samples, sample() and drain() come back bit for bit; clear() removes its files."""
    buffer = h.require_buffer()
    if not buffer.disk_tier:
        h.skip(f"buffer {buffer.name} has no disk tier (disk_tier=False)")
    parts = batches(h)
    everything = TensorBatch.concat(parts)
    with tempfile.TemporaryDirectory(prefix="verl-conformance-") as tmp:
        root = Path(tmp) / "spill"
        buf = _make(h, spill_dir=root, memory_samples=_SIZES[0])
        try:
            for b in parts:
                buf.add(b)
            h.expect(root.exists() and bool(_files(root)),
                     f"holding {sum(_SIZES)} samples with memory_samples={_SIZES[0]}, the buffer wrote nothing under "
                     "spill_dir (it must spill the samples past the memory bound to disk)")
            picked = buf.sample(5, seed=3)
            h.expect(len(set(ids(picked))) == 5, f"sample(5) without replacement repeated samples: {ids(picked)}")
            same_samples(h, picked, everything.index(ids(picked)), "sample(5, seed=3) across memory and disk")
            seen: list[int] = []
            for mb in buf.mini_batches(4, seed=1):
                same_samples(h, mb, everything.index(ids(mb)), "mini_batches(4) across memory and disk")
                seen += ids(mb)
            h.expect(sorted(seen) == list(range(sum(_SIZES))),
                     f"mini_batches(4) over spilled samples gave ids {seen}; each sample must come once")
            same_samples(h, buf.drain(), everything, "drain() of spilled and in-memory samples")
            buf.add(parts[0])
            buf.add(parts[1])
            buf.clear()
            left = _files(root)
            h.expect(not left, f"clear() left files under spill_dir: {[str(p.relative_to(root)) for p in left][:4]}")
        finally:
            _close(buf)


@check("buffer")
def check_buffer_seeded_sampling(h: Harness) -> None:
    """sample() and mini_batches() are reproducible under a seed, differ across seeds, and cover every sample once per epoch, each epoch in an order of its own (reshuffled, not one order repeated)."""
    parts = batches(h)
    everything = TensorBatch.concat(parts)
    n = everything.batch_size
    buf = _make(h)
    try:
        for b in parts:
            buf.add(b)
        a, b = buf.sample(6, seed=11), buf.sample(6, seed=11)
        same_samples(h, b, a, "sample(6, seed=11) twice")
        same_samples(h, a, everything.index(ids(a)), "sample(6, seed=11)")
        draws = {tuple(ids(buf.sample(6, seed=s))) for s in range(4)}
        h.expect(len(draws) > 1, "sample(6, seed=s) gave the same samples for seeds 0..3: the seed is ignored")
        h.expect(len(buf) == n, f"len() is {len(buf)} after sample(); sampling must not remove samples")
        with_replacement = buf.sample(2 * n, replace=True, seed=5)
        h.expect(with_replacement.batch_size == 2 * n, f"sample({2 * n}, replace=True) returned "
                 f"{with_replacement.batch_size} samples")
        epochs = [ids(mb) for mb in buf.mini_batches(4, epochs=2, seed=7)]
        again = [ids(mb) for mb in buf.mini_batches(4, epochs=2, seed=7)]
        h.expect(epochs == again, f"mini_batches(4, epochs=2, seed=7) twice gave {epochs} then {again}")
        flat = [i for mb in epochs for i in mb]
        counts = Counter(flat)
        h.expect(len(flat) == 2 * n and all(counts[i] == 2 for i in range(n)),
                 f"mini_batches(4, epochs=2) gave ids {epochs}; each sample must come once per epoch")
        h.expect(all(len(mb) == 4 for mb in epochs[:2]),
                 f"mini_batches(4) gave sizes {[len(mb) for mb in epochs]}; every mini-batch but an epoch's last holds 4")
        other = [ids(mb) for mb in buf.mini_batches(4, epochs=2, seed=8)]
        h.expect(other != epochs, "mini_batches with seeds 7 and 8 gave the same order: the seed is ignored")
        # every epoch a fresh order: a correct shuffle repeats the last epoch's order with
        # probability 1/n! per pair (n >= 6 here), so 3 seeds all repeating it is a fault
        per_epoch = len(epochs) // 2
        runs = [flat, [i for mb in other for i in mb],
                [i for mb in buf.mini_batches(4, epochs=2, seed=9) for i in ids(mb)]]  # seeds 7, 8, 9
        repeats = [run[:n] == run[n:] for run in runs]
        h.expect(not all(repeats), f"mini_batches(4, epochs=2, seed=s) for s in 7, 8, 9 gave the same order in "
                 f"both epochs (first epoch {epochs[:per_epoch]}): each epoch must be reshuffled, not one order "
                 "repeated (HybridReplayBuffer seeds epoch e with (seed, e))")
    finally:
        _close(buf)
