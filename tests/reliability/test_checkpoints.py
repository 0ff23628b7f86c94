"""Corrupted, truncated and malicious checkpoints are reported as such and never half-loaded.

Hypothesis picks a file of a real checkpoint (hf backend) and a corruption (truncation, flipped
byte, appended bytes, same-size garbage, an empty or deleted file, a broken manifest); the manifest
check must name the checkpoint and the file and say truncated / corrupted / missing. Resuming from
a corrupted checkpoint fails with that error before any state is restored, ``verl train --resume``
prints it and exits 2, and an engine file replaced by a code-running pickle (with the manifest
rewritten to match) is refused by ``torch.load(weights_only=True)`` without running the code.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import TINY, tiny_config

from verl_core import CheckpointError
from verl_core.cli import main
from verl_core.trainer import Trainer, latest_checkpoint, verify_checkpoint
from verl_core.trainer.run.integrity import MANIFEST_FILE, write_manifest

PWNED = Path("/tmp/verl-reliability-checkpoint-pwned")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("run")
    with Trainer(tiny_config(out, "steps=2", "checkpoint.every=1")) as t:
        t.train()
    return out


def _files(ckpt: Path) -> list[str]:
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())


@given(data=st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_corruption_of_a_checkpoint_is_reported(
    run: Path, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory, tally: Counter[str]
) -> None:
    src = latest_checkpoint(run)
    assert src is not None
    ckpt = tmp_path_factory.mktemp("ckpt") / src.name
    shutil.copytree(src, ckpt)
    verify_checkpoint(ckpt)  # intact before the corruption
    rel = data.draw(st.sampled_from(_files(ckpt)), label="file")
    target = ckpt / rel
    raw = target.read_bytes()
    kind = data.draw(st.sampled_from(["truncate", "flip", "append", "garbage", "empty", "delete"]), label="kind")
    if kind == "truncate" and raw:
        target.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    elif kind == "flip" and raw:
        pos = data.draw(st.integers(0, len(raw) - 1))
        target.write_bytes(raw[:pos] + bytes([raw[pos] ^ data.draw(st.integers(1, 255))]) + raw[pos + 1:])
    elif kind == "append":
        target.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64)))
    elif kind == "garbage" and raw:
        target.write_bytes(data.draw(st.binary(min_size=len(raw), max_size=len(raw))).replace(raw, b"") or b"\0")
    elif kind == "delete":
        target.unlink()
    else:
        target.write_bytes(b"")
    if target.exists() and target.read_bytes() == raw:
        return  # the draw happened to reproduce the original bytes
    tally[f"fuzz/checkpoint corruption ({kind})"] += 1
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(ckpt)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and str(ckpt) in msg
    if rel != MANIFEST_FILE:
        assert rel in msg, msg
        word = {"truncate": "truncated", "delete": "missing", "empty": "truncated"}.get(kind, "corrupted")
        assert word in msg, msg
    assert "move this checkpoint folder away" in msg


def _corrupt_latest(run: Path, dest: Path) -> tuple[Path, str]:
    shutil.copytree(run, dest)
    ckpt = latest_checkpoint(dest)
    assert ckpt is not None
    weights = next(p for p in ckpt.rglob("model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    return ckpt, weights.relative_to(ckpt).as_posix()


def test_resume_from_a_truncated_checkpoint_is_refused_before_any_state_changes(
    run: Path, tmp_path: Path, tally: Counter[str]
) -> None:
    out = tmp_path / "run"
    ckpt, rel = _corrupt_latest(run, out)
    metrics_before = (out / "metrics.jsonl").read_text()
    cfg = tiny_config(out, "steps=2", "checkpoint.every=1")
    tally["fuzz/checkpoint resume (truncated weights)"] += 1
    with Trainer(cfg) as trainer:
        with pytest.raises(CheckpointError, match=rf"{ckpt.name}.* is truncated: file '{rel}'"):
            trainer.train(resume=True)
        assert trainer.step == 0 and trainer.weight_version == 0
    assert (out / "metrics.jsonl").read_text() == metrics_before, "a refused resume rewrote the logs"


def test_verl_train_resume_reports_a_corrupted_checkpoint(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tally: Counter[str]
) -> None:
    out = tmp_path / "run"
    _, rel = _corrupt_latest(run, out)
    tally["fuzz/checkpoint resume (verl train --resume)"] += 1
    code = main(["train", *TINY, "steps=2", "checkpoint.every=1",
                 "--output-dir", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert "verl train: error: checkpoint" in err and "truncated" in err and rel in err
    assert "Traceback" not in err


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (PWNED,))


@pytest.mark.parametrize("name", ["trainer_state.pt", "rng_rank0.pt"])
def test_an_engine_file_holding_a_code_running_pickle_is_refused(
    name: str, run: Path, tmp_path: Path, tally: Counter[str]
) -> None:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    target = next(p for p in ckpt.rglob(name))
    torch.save({"step": 1, "payload": _Evil()}, target)
    (ckpt / MANIFEST_FILE).unlink()
    write_manifest(ckpt)  # an attacker can rewrite the manifest too: loading itself must be safe
    PWNED.unlink(missing_ok=True)
    tally["fuzz/checkpoint resume (malicious pickle)"] += 1
    with (
        Trainer(tiny_config(out, "steps=2", "checkpoint.every=1")) as trainer,
        pytest.raises(CheckpointError, match="cannot load its state"),
    ):
        trainer.train(resume=True)
    assert not PWNED.exists(), "loading a checkpoint ran code from a pickle"
