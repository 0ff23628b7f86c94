"""HybridReplayBuffer: spill/reload is lossless, sampling is seeded, bounds raise clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.batch import TensorBatch
from verl_core.errors import ConfigError
from verl_core.trainer.replay import BufferFullError, HybridReplayBuffer


def make_batch(size: int, width: int, seed: int, first_group: int = 0) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (size,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.where(mask, torch.randint(1, 50, (size, width), generator=g), 0)
    prompt_mask = torch.ones(size, 3, dtype=torch.bool)
    return TensorBatch(
        {
            "prompt_ids": torch.randint(1, 50, (size, 3), generator=g),
            "prompt_mask": prompt_mask,
            "response_ids": ids,
            "response_mask": mask,
            "advantages": torch.where(mask, torch.randn(size, width, generator=g), 0.0),
            "scores": torch.randn(size, generator=g),
            "group_ids": torch.arange(first_group, first_group + size),
        },
        extras={"answer": [f"a{first_group + i}" for i in range(size)]},
    )


def assert_same(a: TensorBatch, b: TensorBatch) -> None:
    assert a.batch_size == b.batch_size
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert torch.equal(a[k], b[k]), k
    assert a.extras == b.extras


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    widths=st.lists(st.integers(1, 7), min_size=6, max_size=6),
    memory_samples=st.integers(1, 10),
)
def test_spill_and_reload_preserve_every_sample_bit_for_bit(
    sizes: list[int], widths: list[int], memory_samples: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    batches, start = [], 0
    for i, n in enumerate(sizes):
        batches.append(make_batch(n, widths[i], seed=i, first_group=start))
        start += n
    root = tmp_path_factory.mktemp("spill")
    buf = HybridReplayBuffer(memory_samples=memory_samples, spill_dir=root)
    for b in batches:
        buf.add(b)
    assert len(buf) == sum(sizes)
    assert buf.samples_in_memory <= memory_samples
    assert buf.samples_in_memory + buf.samples_on_disk == sum(sizes)
    expected = TensorBatch.concat(batches)
    # sampling every sample without replacement, then sorting by group id, gives them all back
    every = buf.sample(len(buf), seed=3)
    order = torch.argsort(every["group_ids"])
    assert_same(every.index(order), expected)
    spilled = buf.spill_path
    assert_same(buf.drain(), expected)
    assert len(buf) == 0
    if spilled is not None:
        assert not spilled.exists(), "drain() must remove the spill files"


def test_byte_bound_spills_oldest_whole_batches(tmp_path: Path) -> None:
    a, b, c = (make_batch(4, 5, seed=s, first_group=4 * s) for s in range(3))
    one = sum(t.numel() * t.element_size() for t in a.values())
    buf = HybridReplayBuffer(memory_bytes=int(one * 1.5), spill_dir=tmp_path)
    buf.add(a)
    assert buf.samples_on_disk == 0
    buf.add(b)
    assert buf.samples_on_disk == 4
    buf.add(c)
    assert buf.samples_on_disk == 8
    assert buf.bytes_in_memory <= one * 1.5
    assert buf.spill_path is not None
    assert len(list(buf.spill_path.iterdir())) == 2
    assert_same(buf.drain(), TensorBatch.concat([a, b, c]))


def test_seeded_sampling_is_reproducible(tmp_path: Path) -> None:
    def filled() -> HybridReplayBuffer:
        buf = HybridReplayBuffer(memory_samples=5, spill_dir=tmp_path)
        for s in range(4):
            buf.add(make_batch(4, 6, seed=s, first_group=4 * s))
        return buf

    one, two = filled(), filled()
    for replace in (False, True):
        x = one.sample(10, replace=replace, seed=7)
        y = two.sample(10, replace=replace, seed=7)
        assert_same(x, y)
    no_rep = one.sample(16, seed=1)["group_ids"]
    assert sorted(no_rep.tolist()) == list(range(16))
    with_rep = one.sample(64, replace=True, seed=1)["group_ids"]
    assert len(set(with_rep.tolist())) < 64  # draws repeat
    assert not torch.equal(one.sample(16, seed=1)["group_ids"], one.sample(16, seed=2)["group_ids"])
    one.close()
    two.close()


def test_mini_batches_cover_every_sample_once_per_epoch(tmp_path: Path) -> None:
    buf = HybridReplayBuffer(memory_samples=4, spill_dir=tmp_path)
    for s in range(3):
        buf.add(make_batch(5, 4, seed=s, first_group=5 * s))
    epochs = list(buf.mini_batches(4, epochs=2, seed=0))
    assert [m.batch_size for m in epochs] == [4, 4, 4, 3] * 2
    first = torch.cat([m["group_ids"] for m in epochs[:4]])
    second = torch.cat([m["group_ids"] for m in epochs[4:]])
    assert sorted(first.tolist()) == list(range(15))
    assert sorted(second.tolist()) == list(range(15))
    assert not torch.equal(first, second)
    again = torch.cat([m["group_ids"] for m in buf.mini_batches(4, epochs=1, seed=0)])
    assert torch.equal(again, first)
    assert len(buf) == 15  # iteration does not consume


def test_capacity_and_memory_errors_are_clear() -> None:
    buf = HybridReplayBuffer(capacity=6)
    buf.add(make_batch(4, 3, seed=0))
    with pytest.raises(BufferFullError, match=r"holds 4 of capacity=6 samples and cannot add 4"):
        buf.add(make_batch(4, 3, seed=1))
    assert len(buf) == 4  # the failed add changed nothing
    mem = HybridReplayBuffer(memory_samples=3, spill=False)
    with pytest.raises(BufferFullError, match=r"memory_samples=3.*spill=True"):
        mem.add(make_batch(4, 3, seed=0))
    with pytest.raises(ConfigError, match="capacity must be >= 1"):
        HybridReplayBuffer(capacity=0)
    with pytest.raises(ValueError, match=r"holds only 4 samples"):
        buf.sample(5)
    with pytest.raises(ValueError, match="empty"):
        HybridReplayBuffer().drain()


def test_mismatched_fields_rejected() -> None:
    buf = HybridReplayBuffer()
    buf.add(make_batch(2, 3, seed=0))
    with pytest.raises(ConfigError, match="same ones"):
        buf.add(make_batch(2, 3, seed=0).drop("scores"))


def test_clear_and_close_remove_the_spill_directory(tmp_path: Path) -> None:
    buf = HybridReplayBuffer(memory_samples=1, spill_dir=tmp_path)
    buf.add(make_batch(2, 3, seed=0))
    buf.add(make_batch(2, 3, seed=1))
    d = buf.spill_path
    assert d is not None
    assert d.exists()
    buf.clear()
    assert not d.exists()
    assert len(buf) == 0
    buf.add(make_batch(2, 3, seed=2))
    buf.add(make_batch(2, 3, seed=3))
    d2 = buf.spill_path
    assert d2 is not None
    buf.close()
    assert not d2.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        buf.add(make_batch(1, 1, seed=0))
