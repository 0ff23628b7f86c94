"""HybridReplayBuffer: spill/reload is lossless, sampling is seeded, bounds raise clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import CheckpointError, ConfigError, VerlError
from verl_core.trainer.batching.batch_io import save_batch
from verl_core.trainer.batching.replay import (
    BufferClosedError,
    BufferEmptyError,
    BufferFullError,
    HybridReplayBuffer,
    remove_stale_spill,
)


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
    with pytest.raises(BufferClosedError, match="closed"):
        buf.add(make_batch(1, 1, seed=0))


@pytest.mark.parametrize("kind", ["truncate", "append", "flip", "same shape, other values", "delete", "empty"])
def test_a_spill_file_changed_on_disk_is_reported_when_read_back(kind: str, tmp_path: Path) -> None:
    buf = HybridReplayBuffer(memory_samples=1, spill_dir=tmp_path)
    buf.add(make_batch(4, 5, seed=0))
    buf.add(make_batch(4, 5, seed=1))  # the first batch spills
    assert buf.spill_path is not None
    path = next(buf.spill_path.glob("segment-*.pt"))
    raw = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "append":
        path.write_bytes(raw + b"\0")
    elif kind == "flip":
        path.write_bytes(raw[: len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF]) + raw[len(raw) // 2 + 1 :])
    elif kind == "same shape, other values":
        save_batch(make_batch(4, 5, seed=7), path)
    elif kind == "delete":
        path.unlink()
    else:
        path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"spill file '{path}'"):
        buf.drain()
    with pytest.raises(CheckpointError, match="restart from the last checkpoint"):
        list(buf.mini_batches(8))
    buf.close()


def test_a_spilled_field_of_another_shape_is_named(tmp_path: Path) -> None:
    buf = HybridReplayBuffer(memory_samples=1, spill_dir=tmp_path)
    buf.add(make_batch(3, 4, seed=0))
    buf.add(make_batch(3, 4, seed=1))
    assert buf.spill_path is not None
    path = next(buf.spill_path.glob("segment-*.pt"))
    save_batch(make_batch(3, 6, seed=0), path)  # a valid batch file, written by something else
    with pytest.raises(CheckpointError, match=r"field 'advantages' is torch.float32 \[3, 6\], torch.float32 \[3, 4\] was"):
        buf.sample(6, seed=0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"capacity": True}, "capacity must be an integer"),
    ({"memory_samples": 2.5}, "memory_samples must be an integer"),
    ({"memory_bytes": "1GB"}, "memory_bytes must be an integer"),
    ({"memory_bytes": -1}, "memory_bytes must be >= 1"),
    ({"spill_dir": 3}, "spill_dir must be a path"),
    ({"spill_dir": ""}, "spill_dir is empty"),
    ({"spill": "yes"}, "spill must be true or false"),
])
def test_constructor_arguments_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HybridReplayBuffer(**kwargs)  # type: ignore[arg-type]


def test_bad_calls_raise_project_errors_that_stay_value_errors() -> None:
    buf = HybridReplayBuffer()
    for call, match in [
        (lambda: buf.sample(0), r"sample\(n=0\)"),
        (lambda: buf.sample(True), r"sample\(n=True\)"),
        (lambda: buf.sample(1, seed="x"), r"seed must be an integer"),  # type: ignore[arg-type]
        (lambda: list(buf.mini_batches(0)), r"mini_batches\(size=0\)"),
        (lambda: list(buf.mini_batches(2, epochs=1.5)), r"epochs must be an integer >= 1"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ConfigError, match=match):
            call()
    with pytest.raises(BufferEmptyError, match="empty"):
        buf.sample(1)
    buf.add(make_batch(2, 3, seed=0))
    with pytest.raises(BufferEmptyError, match="holds only 2 samples") as info:
        buf.sample(3)
    assert isinstance(info.value, (VerlError, ValueError))


def test_the_buffer_deletes_only_what_it_wrote(tmp_path: Path) -> None:
    root = tmp_path / "made" / "by" / "buffer"
    buf = HybridReplayBuffer(memory_samples=1, spill_dir=root)
    buf.add(make_batch(2, 3, seed=0))
    buf.add(make_batch(2, 3, seed=1))
    d = buf.spill_path
    assert d is not None
    foreign = d / "notes.txt"
    foreign.write_text("not the buffer's")
    buf.clear()
    assert foreign.read_text() == "not the buffer's" and sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    foreign.unlink()
    d.rmdir()  # the buffer let go of the folder it could not empty
    buf.add(make_batch(2, 3, seed=2))
    buf.add(make_batch(2, 3, seed=3))
    buf.close()
    assert not (tmp_path / "made").exists(), "close() leaves the folders it created"
    # a spill root that was there stays, and so does one holding something else
    kept = tmp_path / "kept"
    kept.mkdir()
    other = HybridReplayBuffer(memory_samples=1, spill_dir=kept / "sub")
    other.add(make_batch(2, 3, seed=0))
    other.add(make_batch(2, 3, seed=1))
    (kept / "sub" / "mine.txt").write_text("x")
    other.close()
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*")) == ["sub", "sub/mine.txt"]


def test_remove_stale_spill_removes_only_what_buffers_write(tmp_path: Path) -> None:
    stale = tmp_path / "verl-replay-abc"
    stale.mkdir()
    (stale / "segment-00000000.pt").write_bytes(b"x")
    (stale / ".segment-00000001.pt.tmp-123").write_bytes(b"x")
    mixed = tmp_path / "verl-replay-def"
    mixed.mkdir()
    (mixed / "segment-00000002.pt").write_bytes(b"x")
    (mixed / "notes.txt").write_text("mine")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "segment-00000000.pt").write_bytes(b"mine")
    (tmp_path / "segment-00000003.pt").write_bytes(b"mine")
    assert remove_stale_spill(tmp_path) == 3
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "other", "other/segment-00000000.pt", "segment-00000003.pt", "verl-replay-def", "verl-replay-def/notes.txt",
    ]
    assert remove_stale_spill(tmp_path / "missing") == 0
