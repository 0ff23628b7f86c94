"""SIGINT and SIGTERM stop a run at a step boundary, with a checkpoint, one line and exit 130 / 143.

A real ``verl train`` process on the tiny built-in model gets SIGINT once its first step's metrics
are in ``metrics.jsonl``: it finishes the step under way, writes its checkpoint, closes the sinks,
prints one line naming the step and the resume command and exits 130; the metrics file is whole
JSON lines, one per step, and the printed command continues the run. ``verl sft`` does the same on
SIGTERM (exit 143). In-process runs send the signal from a metrics callback at a known step: one
signal stops after that step; a second one abandons the step under way at once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from reliability_helpers import TINY, tiny_config

from verl_core.cli import main
from verl_core.trainer import Trainer, latest_checkpoint
from verl_core.trainer.run.folder import MARKER_FILE
from verl_core.trainer.run.interrupt import RunInterrupted, StopSignals

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "verl_core.cli"]
LINE = re.compile(
    r"^verl (train|sft): interrupted by (SIGINT|SIGTERM): stopped after step (\d+) of (\d+); newest checkpoint "
    r"'(.+)'; continue with `(.+)`$"
)


def _metrics(out: Path) -> list[dict[str, object]]:
    """Every line of ``metrics.jsonl``: whole JSON objects only (a torn line fails the test)."""
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n"), "the metrics file ends in the middle of a line"
    return [json.loads(line) for line in text.splitlines()]


def _default_signals() -> None:
    """The child's SIGINT and SIGTERM as a terminal gives them (a shell's background job ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start(argv: list[str], out: Path) -> subprocess.Popen[str]:
    """Start ``verl ARGV`` and wait until its first step's metrics line is complete."""
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=_default_signals)
    deadline = time.monotonic() + 300
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().endswith("\n")):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before its first step: {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no step within 300 s")
        time.sleep(0.05)
    return proc


def _interrupt(proc: subprocess.Popen[str], sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _resume(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
    tokens = shlex.split(command)
    assert tokens[0] == "verl" and tokens[-1] == "--resume", command
    return subprocess.run([*CLI, *tokens[1:], *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigint_stops_verl_train_after_the_step_and_resume_continues(tmp_path: Path, tally: Counter[str]) -> None:
    out = tmp_path / "run"
    proc = _start(["train", *TINY, "steps=200", f"output_dir={out}"], out)
    code, err = _interrupt(proc, signal.SIGINT)
    tally["fault/SIGINT to verl train"] += 1
    assert code == 130, err
    last = err.strip().splitlines()[-1]
    m = LINE.match(last)
    assert m is not None, err
    assert "Traceback" not in err
    step = int(m.group(3))
    assert (m.group(1), m.group(2), m.group(4)) == ("train", "SIGINT", "200")
    assert 1 <= step < 200
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and m.group(5) == str(ckpt)
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 1))

    done = _resume(m.group(6), f"steps={step + 2}")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 3))
    assert json.loads((out / MARKER_FILE).read_text())["run_id"]  # the same run folder, continued


def test_sigterm_stops_verl_sft_after_the_step_and_resume_continues(tmp_path: Path, tally: Counter[str]) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"c{n}=", "response": str(n)}) + "\n" for n in range(40)))
    out = tmp_path / "run"
    argv = ["sft", f"data.train={data}", f"output_dir={out}", "steps=300", "batch.prompts_per_step=4",
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1",
            "model.num_layers=1", "logging.progress=false"]
    proc = _start(argv, out)
    code, err = _interrupt(proc, signal.SIGTERM)
    tally["fault/SIGTERM to verl sft"] += 1
    assert code == 143, err
    m = LINE.match(err.strip().splitlines()[-1])
    assert m is not None, err
    step = int(m.group(3))
    assert (m.group(1), m.group(2)) == ("sft", "SIGTERM")
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 1))
    assert not (out / "model-sft").exists()  # the export is what a finished run writes

    done = _resume(m.group(6), f"steps={step + 1}")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 2))
    assert (out / "model-sft" / "model.safetensors").is_file()


def _signalling_callback(tmp_path: Path, *, at: int, times: int) -> str:
    """A ``logging.sinks`` callback that sends SIGTERM ``times`` times to this process at step ``at``."""
    path = tmp_path / "signal_callback.py"
    path.write_text(
        "import os, signal, time\n"
        "class Send:\n"
        "    def on_step_end(self, step, metrics):\n"
        f"        if step == {at}:\n"
        f"            for _ in range({times}):\n"
        "                os.kill(os.getpid(), signal.SIGTERM)\n"
        "                time.sleep(0.05)\n"
    )
    return f"{path}:Send"


def test_one_signal_in_process_stops_after_the_step_with_a_checkpoint(tmp_path: Path, tally: Counter[str]) -> None:
    out = tmp_path / "run"
    sinks = json.dumps(["jsonl", _signalling_callback(tmp_path, at=2, times=1)])
    handler = signal.getsignal(signal.SIGTERM)
    with Trainer(tiny_config(out, "steps=50", f"logging.sinks={sinks}")) as trainer, \
            pytest.raises(RunInterrupted) as info:
        trainer.train()
    tally["fault/SIGTERM in process"] += 1
    e = info.value
    assert (e.step, e.steps, e.abandoned, e.exit_code) == (2, 50, False, 143)
    assert e.checkpoint == latest_checkpoint(out) and e.checkpoint is not None and e.checkpoint.name.endswith("2")
    assert str(e) == f"interrupted by SIGTERM: stopped after step 2 of 50; newest checkpoint {str(e.checkpoint)!r}"
    assert signal.getsignal(signal.SIGTERM) is handler  # the handlers in place before are back
    assert [r["step"] for r in _metrics(out)] == [1, 2]
    with Trainer(tiny_config(out, "steps=3")) as again:
        assert [m["step"] for m in again.train(resume=True)] == [1, 2, 3]


def test_a_second_signal_abandons_the_step_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    tally: Counter[str]) -> None:
    out = tmp_path / "run"
    sinks = json.dumps(["jsonl", _signalling_callback(tmp_path, at=2, times=2)])
    args = [*TINY, "steps=50", f"output_dir={out}", f"logging.sinks={sinks}"]
    assert main(["train", *args]) == 143
    tally["fault/SIGTERM twice in process"] += 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "verl train: interrupted by SIGTERM during a step (steps completed: 2 of 50), which was abandoned; no "
        f"checkpoint was written; nothing to resume: start again with `{shlex.join(['verl', 'train', *args, 'overwrite=true'])}`"
    ), err
    assert latest_checkpoint(out) is None
    assert all(isinstance(r, dict) for r in _metrics(out))  # whole lines only


def test_an_ignored_signal_stays_ignored_and_handlers_are_put_back() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with StopSignals(defer=False):
            os.kill(os.getpid(), signal.SIGTERM)  # ignored, as the process was told before
            time.sleep(0.05)
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # ours, while active
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def send_sigint() -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler raises before this ends

        with StopSignals(defer=False), pytest.raises(RunInterrupted) as info:
            send_sigint()
        assert (info.value.signal_name, info.value.exit_code, info.value.step) == ("SIGINT", 130, None)
        assert str(info.value) == "interrupted by SIGINT while the run was being set up; no checkpoint was written"
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def test_the_resume_line_names_the_command_as_it_was_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started as ``python -m verl_core`` (``verl`` not on the PATH), the line to continue says so."""
    import argparse
    import types

    from verl_core.trainer.cli.train import resume_command

    args = argparse.Namespace(config="run.toml", overrides=["steps=4", "overwrite=true"], output_dir=None)
    assert resume_command(args, "train") == "verl train run.toml steps=4 --resume"
    module = types.ModuleType("__main__")
    module.__spec__ = types.SimpleNamespace(name="verl_core.__main__")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", module)
    assert resume_command(args, "sft") == "python -m verl_core sft run.toml steps=4 --resume"
