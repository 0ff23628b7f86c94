"""A disk that refuses a write: one typed error line naming the file, nothing half-written kept.

The refusal is real: the run's process gets a file-size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ``
ignored), so the kernel fails the write that crosses it with ``EFBIG``, as a full disk fails one
with ``ENOSPC``; the libraries that write weights wrap it in errors of their own (safetensors,
torch.save), which the run must still name as a failed write.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE semantics are Linux's")

BASE = ["logging.progress=false", "logging.plot=false", "model.hidden_size=128", "model.intermediate_size=256"]


def _limit(size: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


def _verl(*args: str, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "verl_core.cli", "train", *BASE, *args], capture_output=True,
                          text=True, preexec_fn=_limit(limit) if limit else None, env={**os.environ}, timeout=600)


@pytest.mark.slow
def test_a_checkpoint_the_disk_refuses_is_one_error_and_leaves_no_half_folder(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert _verl("steps=1", f"output_dir={json.dumps(str(first))}").returncode == 0
    model = first / "model"
    big = max(p.stat().st_size for p in model.iterdir())
    out = tmp_path / "run"
    # the model's files fit; the optimizer state of the first checkpoint (twice the weights) does not
    done = _verl("steps=2", "checkpoint.every=1", f"model.path={json.dumps(str(model))}",
                 f"output_dir={json.dumps(str(out))}", limit=int(big * 1.4))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1].startswith("verl train: error: checkpoint "), done.stderr
    assert "could not be written" in lines[-1] and "nothing of it was kept" in lines[-1], lines[-1]
    assert "the run has no checkpoint yet" in lines[-1] and "error: unexpected" not in done.stderr
    ckpts = out / "checkpoints"
    assert not list(ckpts.glob("step-*")) and not list(ckpts.glob(".tmp-*")), sorted(ckpts.iterdir())
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.slow
def test_a_tiny_model_the_disk_refuses_is_one_error_naming_model_path(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = _verl("steps=1", f"output_dir={json.dumps(str(out))}", limit=200_000)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("verl train: error: the tiny model (config key 'model.path' is empty) could not be written")
    assert "error: unexpected" not in done.stderr
    assert not (out / "model").exists() and not list(out.glob(".model*")) and not list(out.glob("*tmp*"))


class _Engine:
    """Saves one file; the disk is full from the ``full_from``-th save on."""

    def __init__(self, full_from: int) -> None:
        self.saves = 0
        self.full_from = full_from

    def save_checkpoint(self, path: Path) -> None:
        self.saves += 1
        path.mkdir(parents=True)
        if self.saves >= self.full_from:
            raise OSError(28, "No space left on device", str(path / "weights.bin"))
        (path / "weights.bin").write_bytes(b"w" * 64)


def test_a_later_checkpoint_the_disk_refuses_names_the_newest_complete_one(tmp_path: Path) -> None:
    from typing import Any, cast

    from verl_core.kernel.errors import StorageError
    from verl_core.trainer.run.checkpoints import checkpoint_folders, write_checkpoint

    engine = cast(Any, _Engine(full_from=2))
    first = write_checkpoint(tmp_path, 1, {"actor": engine}, {"step": 1}, keep=2)
    with pytest.raises(StorageError, match=r"step-000002' could not be written: No space left on device \(.*weights.bin\); "
                                           r"nothing of it was kept, the newest complete checkpoint is '.*step-000001'"):
        write_checkpoint(tmp_path, 2, {"actor": engine}, {"step": 2}, keep=2)
    assert checkpoint_folders(tmp_path) == [first] and (first / "actor" / "weights.bin").read_bytes() == b"w" * 64
    assert not list(tmp_path.glob(".tmp-*"))
