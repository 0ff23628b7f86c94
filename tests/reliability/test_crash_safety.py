"""SIGKILL at 200 seeded random points while a run writes checkpoints, spills its replay buffer or logs.

A forked child runs a tiny training run (hf backend, one-layer model, a checkpoint every step, a
replay buffer that spills every batch to disk), resuming from the newest checkpoint when there is
one. Kill points are chosen by a seeded generator: the child counts its write events (files opened
for writing, renames, removals, folder creation, ``torch.save``, safetensors writes, fsync) and at
the chosen one (uniform within about one and a half steps' worth of events after the resume point)
kills itself with SIGKILL, either at once (before the write happens) or after a
random delay of up to a few milliseconds (in the middle of it). After every kill the newest
complete checkpoint must verify against its manifest, the next child must resume from it, and
every run that reaches the end must give exactly the metrics and weights of an uninterrupted run.

Two more kills check what a run may delete: a run killed in the middle of spilling its replay
buffer leaves stale spill files that only the resumed run of the same id removes (nothing else
in the folder or the spill folder), and of two runs started at the same moment in one folder
exactly one runs while the other is refused before writing anything.

The child turns ``fsync`` into a counted no-op: a killed process loses nothing the kernel already
has, so fsync only matters for power loss, which a test cannot simulate; it would only slow the
test down.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from reliability_helpers import comparable, tiny_config

from verl_core.kernel.errors import ConfigError
from verl_core.trainer import Trainer, latest_checkpoint, verify_checkpoint
from verl_core.trainer.run.folder import MARKER_FILE, read_marker

KILLS = int(os.environ.get("VERL_RELIABILITY_KILLS", "200"))
SEED = 20261202
STEPS = 4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]

_WRITE_EVENTS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install_kill_point(kill_at: int | None, delay: float, report_fd: int, only: str = "") -> list[int]:
    """Count write events (those matching the regex ``only``) in this (child) process; SIGKILL it at event ``kill_at``."""
    count = [0]

    def event(what: str) -> None:
        if not re.search(only, what):
            return
        count[0] += 1
        if count[0] != kill_at:
            return
        os.write(report_fd, (what[:400] + "\n").encode())
        if delay <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def audit(name: str, args: tuple[Any, ...]) -> None:
        if name == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
            if writing:
                event(f"open {path}")
        elif name in _WRITE_EVENTS:
            event(f"{name} {args[0]}")

    sys.addaudithook(audit)
    real_save = torch.save

    def save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        if isinstance(f, (str, os.PathLike)):  # not in-memory buffers
            event(f"torch.save {f}")
        real_save(obj, f, *a, **k)

    torch.save = save  # type: ignore[assignment]
    import safetensors.torch as st

    real_save_file = st.save_file

    def save_file(tensors: Any, filename: Any, *a: Any, **k: Any) -> None:
        event(f"safetensors {filename}")
        real_save_file(tensors, filename, *a, **k)

    st.save_file = save_file

    def fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = "?"
        event(f"fsync {path}")

    os.fsync = fsync
    return count


def _own_tqdm_lock() -> None:
    """Give this (forked) process a tqdm lock of its own.

    tqdm guards every bar (creating, drawing, closing: transformers draws one per checkpoint it
    saves) with a multiprocessing lock made once and shared by every process forked afterwards; a
    sibling SIGKILLed while holding it would leave it held for good and block this child forever.
    """
    import multiprocessing

    from tqdm import std

    std.TqdmDefaultWriteLock.mp_lock = multiprocessing.RLock()
    std.TqdmDefaultWriteLock.th_lock = std.TRLock()
    lock = std.TqdmDefaultWriteLock()
    classes: list[type] = [std.tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if cls is std.tqdm or "_lock" in vars(cls):
            cls._lock = lock  # type: ignore[attr-defined]


def _child(trainer: Trainer, kill_at: int | None, delay: float, report_fd: int, only: str = "") -> None:
    # OpenMP's thread team does not survive fork(): a forked child that runs torch ops on its stage
    # threads with several intra-op threads can hit "Invalid thread pool"; every child (the
    # uninterrupted run included) computes with one, so their results stay comparable bit for bit
    torch.set_num_threads(1)
    _own_tqdm_lock()
    count = _install_kill_point(kill_at, delay, report_fd, only)
    trainer.train(resume=latest_checkpoint(trainer.out) is not None)
    os.write(report_fd, f"done {count[0]}\n".encode())


def _fork(trainer: Trainer, kill_at: int | None, delay: float, only: str = "") -> tuple[int, str, str]:
    """Run one child from a copy of ``trainer``; returns (wait status, its report, its traceback if it failed)."""
    r, w = os.pipe()
    err = trainer.out.parent / "child-error.txt"
    err.unlink(missing_ok=True)
    # fork only a single-threaded process: the stage threads (and the OpenMP state they hold) do not
    # survive a fork, so end them first; both processes start new ones when they next run a step
    trainer._stage_threads.close()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 3
        try:
            os.close(r)
            _child(trainer, kill_at, delay, w, only)
            code = 0
        except BaseException:
            err.write_text(traceback.format_exc())
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return status, b"".join(chunks).decode(), err.read_text() if err.exists() else ""


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    state = (ckpt / "actor" / "latest").read_text().strip()
    return load_file(str(ckpt / "actor" / state / "model.safetensors"))


def _results(out: Path) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return comparable([json.loads(ln) for ln in lines]), _final_weights(out)


def _reset(out: Path) -> None:
    """Remove what a run wrote (the tiny model folder and the run marker stay)."""
    for p in out.iterdir():
        if p.name not in ("model", MARKER_FILE):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _where(report: str) -> str:
    if "/checkpoints" in report:
        return "checkpoint write"
    if "/spill" in report:
        return "replay-buffer spill"
    if "metrics.jsonl" in report or "scheduler_plan" in report:
        return "log append"
    if report.startswith(("os.remove", "os.rmdir")):
        return "tree removal (checkpoint pruning, spill cleanup)"
    if ".config.json" in report or "config.json" in report:
        return "run config write"
    return "other write: " + report.split()[0] if report else "other write"


def test_sigkill_at_seeded_random_points_never_loses_a_checkpoint(
    tmp_path: Path, tally: Counter[str]
) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    out = tmp_path / "run"
    # Every child is forked from this set-up trainer (engines built, no step run), so a child
    # starts in milliseconds; it resumes from the newest checkpoint when there is one.
    trainer = Trainer(tiny_config(out, f"steps={STEPS}", "checkpoint.every=1", "checkpoint.keep=2"))
    trainer.setup()
    status, report, err = _fork(trainer, None, 0.0)  # the uninterrupted run
    assert os.waitstatus_to_exitcode(status) == 0, err
    events = int(report.split()[-1])
    ref_metrics, ref_weights = _results(out)
    assert len(ref_metrics) == STEPS
    _reset(out)

    rng = random.Random(SEED)
    # Kill within about one and a half steps of writes after the resume point: every child is
    # short, most kills land after some progress, and a chain resumed near the end finishes.
    window = max(1, events * 3 // (2 * STEPS))
    kinds: Counter[str] = Counter()
    completed = kills = 0
    t0 = time.perf_counter()
    while kills < KILLS:
        kill_at = rng.randint(1, window)
        delay = 0.0 if rng.random() < 0.5 else rng.uniform(0.0, 0.004)
        status, report, err = _fork(trainer, kill_at, delay)
        if os.WIFSIGNALED(status):
            assert os.WTERMSIG(status) == signal.SIGKILL
            kills += 1
            kinds[_where(report)] += 1
            ckpt = latest_checkpoint(out)
            if ckpt is not None:
                verify_checkpoint(ckpt)  # the newest complete checkpoint is intact
            continue
        assert os.waitstatus_to_exitcode(status) == 0, f"child failed after a kill:\n{err}"
        metrics, weights = _results(out)  # the run reached the end after its kills
        assert metrics == ref_metrics, "a resumed run differs from the uninterrupted one"
        assert weights.keys() == ref_weights.keys()
        assert all(torch.equal(weights[k], ref_weights[k]) for k in weights), "resumed weights differ"
        completed += 1
        _reset(out)
    trainer.close()
    for where, n in kinds.items():
        tally[f"kill/SIGKILL during {where}"] += n
    tally["resumed/runs finished after SIGKILLs, identical to the uninterrupted run"] += completed
    print(f"\n{kills} SIGKILLs at seeded points ({dict(kinds)}), {events} write events per run, "
          f"{completed} runs finished after kills with identical metrics and weights, "
          f"{time.perf_counter() - t0:.0f}s")
    assert completed >= 3, "too few runs reached the end to compare with the uninterrupted one"
    assert kinds["checkpoint write"] > 0 and kinds["replay-buffer spill"] > 0


def test_sigkill_while_spilling_leaves_stale_files_only_the_same_run_removes(
    tmp_path: Path, tally: Counter[str]
) -> None:
    out = tmp_path / "run"
    cfg = tiny_config(out, "steps=2", "checkpoint.every=1")
    trainer = Trainer(cfg)
    trainer.setup()
    assert trainer.run_dir is not None
    spill = trainer.run_dir.spill_root
    # files of the user in the run folder and in its spill folder, one in a folder named like a
    # buffer's and one named like a segment: none of them was written by a buffer
    mine = {out / "notes.txt": b"mine", spill / "keep.txt": b"kept", spill / "verl-replay-mine" / "a.bin": b"a",
            spill / "mine" / "segment-00000000.pt": b"not a segment"}
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    # kill step 2 as it renames its spilled segment into place (the first spill was step 1's)
    status, report, err = _fork(trainer, 2, 0.0, only=r"^os\.rename .*/spill-.*segment-")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, err
    assert report.startswith("os.rename") and "segment-" in report, report
    tally["kill/SIGKILL during replay-buffer spill (stale files checked)"] += 1
    trainer.close()
    stale = [p for p in spill.glob("verl-replay-*/*") if p.name != "a.bin"]
    assert stale, "the killed run left no spill file behind"
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step-000001"
    verify_checkpoint(ckpt)
    with Trainer(cfg) as resumed:  # same run id: its stale spill files go, nothing else
        assert len(resumed.train(resume=True)) == 2
    assert not any(p.exists() for p in stale)
    assert all(p.read_bytes() == data for p, data in mine.items())
    assert sorted(p.relative_to(spill).as_posix() for p in spill.rglob("*") if p.is_file()) == [
        "keep.txt", "mine/segment-00000000.pt", "verl-replay-mine/a.bin"]


def _racer(out: Path, model: Path, go: int, report: Path) -> int:
    """One of two runs started at once: waits for the start signal, then trains one step."""
    os.read(go, 1)
    try:
        with Trainer(tiny_config(out, "steps=1", model=model)) as trainer:
            trainer.train()
            assert trainer.run_dir is not None
            report.write_text(json.dumps({"won": trainer.run_dir.run_id}))
        return 0
    except ConfigError as e:
        report.write_text(json.dumps({"refused": str(e)}))
        return 2


def test_two_runs_started_at_once_in_one_folder_one_wins_the_other_is_refused(
    tmp_path: Path, tally: Counter[str]
) -> None:
    with Trainer(tiny_config(tmp_path / "model-run", "steps=1")) as t:
        t.setup()  # the shared model; also loads every library before the fork
    model = tmp_path / "model-run" / "model"
    out = tmp_path / "run"
    go_r, go_w = os.pipe()
    children = []
    for i in range(2):
        report = tmp_path / f"racer-{i}.json"
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 3
            try:
                os.close(go_w)
                code = _racer(out, model, go_r, report)
            except BaseException:
                (tmp_path / f"racer-{i}-error.txt").write_text(traceback.format_exc())
            finally:
                os._exit(code)
        children.append((pid, report))
    os.close(go_r)
    os.write(go_w, b"go")  # both start at once
    os.close(go_w)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, _ in children]
    errors = [p.read_text() for p in tmp_path.glob("racer-*-error.txt")]
    assert sorted(codes) == [0, 2], (codes, errors)
    tally["race/two trainers started at once in one folder"] += 1
    reports = [json.loads(r.read_text()) for _, r in children]
    won = next(r["won"] for r in reports if "won" in r)
    refused = next(r["refused"] for r in reports if "refused" in r)
    assert str(out) in refused and "output_dir" in refused, refused
    marker = read_marker(out)
    assert marker is not None and marker.run_id == won
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step-000001"
    verify_checkpoint(ckpt)
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints", "config.json", "metrics.jsonl", "scheduler_plan.jsonl", MARKER_FILE]
