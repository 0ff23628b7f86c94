"""Metric sinks: JSON lines, TensorBoard, W&B offline and user callbacks, each read back from disk."""

from __future__ import annotations

import io
import json
import re
import struct
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from verl_core.kernel.errors import ConfigError
from verl_core.trainer.sinks import (
    METRICS_FILE,
    CallbackError,
    MetricSinks,
    ProgressBar,
    RunCallback,
    SinkConfig,
    load_callback,
    truncate_metrics,
)


def step_metrics(step: int, scale: float = 1.0) -> dict[str, Any]:
    return {
        "step": step, "reward/mean": scale * step / 10, "reward/std": 0.1, "response/length_mean": 4.0,
        "time/step": 0.25, "logprob_mismatch/mean": "not comparable", "update/skipped": True,
    }


# ---------------------------------------------------------------------------- config
def test_config_accepts_lists_and_rejects_unknown_sinks() -> None:
    cfg = SinkConfig(sinks=["jsonl", "tensorboard", "pkg.mod:cb", "cbs/file.py:make"])  # type: ignore[arg-type]
    assert cfg.sinks == ("jsonl", "tensorboard", "pkg.mod:cb", "cbs/file.py:make")
    assert cfg.callbacks == ("pkg.mod:cb", "cbs/file.py:make")
    with pytest.raises(ConfigError, match=r"'logging.sinks': unknown sink 'tensorbord'; choices: 'jsonl', "
                                          r"'tensorboard', 'wandb', or a callback as 'package.module:attr'"):
        SinkConfig(sinks=("jsonl", "tensorbord"))
    with pytest.raises(ConfigError, match=r"'jsonl' is listed twice"):
        SinkConfig(sinks=("jsonl", "jsonl"))
    with pytest.raises(ConfigError, match=r"expected a list of sink names, got 'jsonl'"):
        SinkConfig(sinks="jsonl")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"'logging.wandb_mode': 'offlne' is not valid; choices: 'offline'"):
        SinkConfig(wandb_mode="offlne")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown sink ':cb'"):
        SinkConfig(sinks=(":cb",))


# ---------------------------------------------------------------------------- jsonl
def test_jsonl_one_line_per_step_and_truncate_on_resume(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 9, "old": 1}\n')  # a previous run's file: a fresh run starts it anew
    with MetricSinks.open(tmp_path, SinkConfig(), "run") as sinks:
        assert sinks.names == ("jsonl",)
        for s in range(1, 6):
            sinks.log_step(s, step_metrics(s))
            assert len(path.read_text().splitlines()) == s  # flushed at once, not at close
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert lines[2] == step_metrics(3)
    with open(path, "a") as fh:
        fh.write('{"step": 6, "reward/me')  # a run killed mid-write

    with MetricSinks.open(tmp_path, SinkConfig(), "run", resume_step=3) as sinks:
        assert [m["step"] for m in sinks.history] == [1, 2, 3]
        assert sinks.history[1] == step_metrics(2)
        sinks.log_step(4, step_metrics(4, scale=2.0))
        sinks.log_eval(4, {"eval/exact_match": 0.5})
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 4]
    assert lines[3]["reward/mean"] == pytest.approx(0.8)
    assert lines[4] == {"step": 4, "eval/exact_match": 0.5}


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path: Path) -> None:
    assert truncate_metrics(tmp_path / "missing.jsonl", 3) == []
    assert not (tmp_path / "missing.jsonl").exists()
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n{"step": 4}\n')
    assert truncate_metrics(path, 2) == [{"step": 1}, {"step": 2}]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


# ---------------------------------------------------------------------------- tensorboard
def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return {tag: points for tag, points in got.items() if points}  # a purged tag stays, empty


def test_tensorboard_scalars_read_back_and_resume_hides_later_steps(tmp_path: Path) -> None:
    cfg = SinkConfig(sinks=("tensorboard",))
    with MetricSinks.open(tmp_path, cfg, "run") as sinks:
        for s in range(1, 5):
            sinks.log_step(s, step_metrics(s))
        sinks.log_eval(4, {"eval/reward_mean": 0.75})
    got = read_scalars(tmp_path / "tensorboard")
    assert got["reward/mean"] == [(s, pytest.approx(s / 10)) for s in range(1, 5)]
    assert got["update/skipped"] == [(s, 1.0) for s in range(1, 5)]
    assert got["eval/reward_mean"] == [(4, 0.75)]
    assert "logprob_mismatch/mean" not in got  # a string is no scalar
    assert "step" not in got

    with MetricSinks.open(tmp_path, cfg, "run", resume_step=2) as sinks:  # steps 3 and 4 run again
        for s in (3, 4):
            sinks.log_step(s, step_metrics(s, scale=10.0))
    got = read_scalars(tmp_path / "tensorboard")
    assert got["reward/mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, 3.0), (4, 4.0)]
    assert "eval/reward_mean" not in got  # logged at step 4 before the resume: hidden

    custom = tmp_path / "tb-elsewhere"
    with MetricSinks.open(tmp_path, SinkConfig(sinks=("tensorboard",), tensorboard_dir=str(custom)), "r") as sinks:
        sinks.log_step(1, {"step": 1, "loss": 2.0})
    assert read_scalars(custom) == {"loss": [(1, 2.0)]}
    # a fresh run in the same folder hides the earlier runs' events
    with MetricSinks.open(tmp_path, cfg, "run") as sinks:
        sinks.log_step(1, {"step": 1, "reward/mean": -1.0})
    assert read_scalars(tmp_path / "tensorboard") == {"reward/mean": [(1, -1.0)]}


# ---------------------------------------------------------------------------- wandb
def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a LevelDB-style log of
    ``wandb_internal_pb2.Record`` messages, in 32 KiB blocks after a 7-byte file header.

    W&B's service process writes the log after ``finish()`` returns: wait for its exit record.
    """
    deadline = time.monotonic() + 60
    while True:
        raw = run_file.read_bytes()
        assert raw[:4] == b":W&B", f"{run_file} is not a W&B transaction log"
        records = _parse_wandb_log(raw)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _parse_wandb_log(raw: bytes) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    block, i, buf, out = 32768, 7, b"", []
    while i + 7 <= len(raw):
        if block - i % block < 7:  # a block's tail too short for a record header is padding
            i += block - i % block
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[i:i + 7])
        if kind == 0 and n == 0:
            break
        buf += raw[i + 7:i + 7 + n]
        i += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    rows = [
        {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"
    ]
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


@pytest.mark.timeout(120)
def test_wandb_offline_run_logs_history_and_resume_continues_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
                       "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    out = tmp_path / "run"
    cfg = SinkConfig(sinks=("wandb",), wandb_project="sinks-test")
    with MetricSinks.open(out, cfg, "my-run", hparams={"seed": 3}) as sinks:
        for s in (1, 2, 3):
            sinks.log_step(s, step_metrics(s))
        sinks.log_eval(3, {"eval/exact_match": 0.5})
    run_id = (out / "wandb_run_id").read_text().strip()
    first = list((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(first) == 1, sorted(p.name for p in (out / "wandb").iterdir())
    records = wandb_records(first[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.display_name, run.project) == (run_id, "my-run", "sinks-test")
    assert {u.key: json.loads(u.value_json) for u in run.config.update}["seed"] == 3  # hparams
    history = wandb_history(first[0])
    assert [h["step"] for h in history] == [1, 2, 3, 3]
    assert history[1]["reward/mean"] == pytest.approx(0.2)
    assert "logprob_mismatch/mean" not in history[1]
    assert history[3] == {"step": 3, "eval/exact_match": 0.5}

    # W&B names an offline run's folder by the second it starts: a resume within the same second
    # would write into the first run's folder, so the resumed run starts in the next second.
    time.sleep(1.05 - time.time() % 1)
    with MetricSinks.open(out, cfg, "my-run", resume_step=2) as sinks:
        sinks.log_step(3, step_metrics(3, scale=10.0))
    assert (out / "wandb_run_id").read_text().strip() == run_id  # the same W&B run continues
    second = [p for p in (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb") if p != first[0]]
    assert len(second) == 1
    assert wandb_history(second[0])[0]["reward/mean"] == pytest.approx(3.0)


# ---------------------------------------------------------------------------- callbacks
CALLBACKS = '''
from pathlib import Path

calls = []


class Recorder:
    def on_step_end(self, step, metrics):
        calls.append(("on_step_end", step, dict(metrics)))

    def on_eval(self, step, metrics):
        calls.append(("on_eval", step, dict(metrics)))

    def on_checkpoint(self, step, path):
        calls.append(("on_checkpoint", step, path))


class OnlyCheckpoints:
    def on_checkpoint(self, step, path):
        calls.append(("only_checkpoint", step, path))


RECORDER = Recorder()


def make():
    return RECORDER


class Broken:
    def on_eval(self, step, metrics):
        raise ValueError("eval hook exploded")


class NoHooks:
    pass
'''


def test_callbacks_by_module_and_by_file_get_every_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "sinks_test_callbacks.py").write_text(CALLBACKS)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.delitem(sys.modules, "sinks_test_callbacks", raising=False)
    file_spec = f"{tmp_path / 'pkg' / 'sinks_test_callbacks.py'}:make"
    cfg = SinkConfig(sinks=("jsonl", "sinks_test_callbacks:OnlyCheckpoints", file_spec))

    class InCode(RunCallback):  # inherits no-op on_eval and on_checkpoint
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, step: int, metrics: Mapping[str, Any]) -> None:
            self.steps.append(step)
            with pytest.raises(TypeError):
                metrics["reward/mean"] = 0.0  # type: ignore[index]

    in_code = InCode()
    with MetricSinks.open(tmp_path / "out", cfg, "run", callbacks=[in_code]) as sinks:
        assert sinks.names == ("jsonl", "sinks_test_callbacks:OnlyCheckpoints", file_spec, "InCode")
        sinks.log_step(1, step_metrics(1))
        sinks.log_step(2, {**step_metrics(2), "eval/exact_match": 0.25, "eval/reward_mean": 0.5})
        sinks.checkpoint(2, str(tmp_path / "out" / "checkpoints" / "step-2"))
        sinks.log_eval(2, {"eval/exact_match": 0.75})

    by_module = sys.modules["sinks_test_callbacks"]
    by_file = next(m for n, m in sys.modules.items() if n.startswith("verl_user_sinks_test_callbacks_"))
    assert by_file is not by_module  # the file was imported on its own
    ckpt = tmp_path / "out" / "checkpoints" / "step-2"
    assert by_module.calls == [("only_checkpoint", 2, ckpt)]
    assert by_file.calls == [
        ("on_step_end", 1, step_metrics(1)),
        ("on_step_end", 2, {**step_metrics(2), "eval/exact_match": 0.25, "eval/reward_mean": 0.5}),
        ("on_eval", 2, {"eval/exact_match": 0.25, "eval/reward_mean": 0.5}),
        ("on_checkpoint", 2, ckpt),
        ("on_eval", 2, {"eval/exact_match": 0.75}),
    ]
    assert in_code.steps == [1, 2]


def test_a_raising_callback_fails_with_an_error_naming_it(tmp_path: Path) -> None:
    cb_file = tmp_path / "cbs.py"
    cb_file.write_text(CALLBACKS)
    spec = f"{cb_file}:Broken"
    with MetricSinks.open(tmp_path, SinkConfig(sinks=("jsonl", spec)), "run") as sinks:
        sinks.log_step(1, step_metrics(1))  # no eval metrics: the broken hook is not called
        with pytest.raises(CallbackError, match=r"callback '.*cbs.py:Broken' raised in on_eval at step 2: "
                                                r"ValueError: eval hook exploded") as info:
            sinks.log_step(2, {**step_metrics(2), "eval/exact_match": 1.0})
    assert (info.value.callback, info.value.hook, info.value.step) == (spec, "on_eval", 2)
    assert isinstance(info.value.__cause__, ValueError)
    # the built-in sinks had written the step before the callback ran
    assert [json.loads(ln)["step"] for ln in (tmp_path / METRICS_FILE).read_text().splitlines()] == [1, 2]


def test_bad_callback_specs_are_config_errors(tmp_path: Path) -> None:
    cb_file = tmp_path / "cbs.py"
    cb_file.write_text(CALLBACKS)
    (tmp_path / "raises.py").write_text("raise RuntimeError('import-time failure')\n")
    cases = {
        f"{tmp_path / 'nope.py'}:make": r"callback '.*nope.py:make': the file '.*nope.py' does not exist",
        f"{cb_file}:missing": r"cbs.py' has no attribute 'missing'",
        f"{cb_file}:NoHooks": r"has none of the hooks on_step_end, on_eval, on_checkpoint",
        f"{tmp_path / 'raises.py'}:x": r"running '.*raises.py' raised RuntimeError: import-time failure",
        "verl_core_no_such_module:cb": r"cannot import module 'verl_core_no_such_module'",
        "verl_core.kernel.errors:NoSuchThing": r"has no attribute 'NoSuchThing'",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_callback(spec)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"has none of the hooks"):
        MetricSinks.open(out, SinkConfig(), "run", callbacks=[object()])
    with pytest.raises(ConfigError, match=r"NoHooks"):
        MetricSinks.open(out, SinkConfig(sinks=("jsonl", f"{cb_file}:NoHooks")), "run")
    assert not out.exists()  # a bad config writes nothing


# ---------------------------------------------------------------------------- missing packages
@pytest.mark.parametrize(("sink", "modules", "pip"), [
    ("tensorboard", ("tensorboard", "torch.utils.tensorboard"), "pip install 'verl-core[tensorboard]'"),
    ("wandb", ("wandb",), "pip install 'verl-core[wandb]'"),
])
def test_a_missing_package_is_a_config_error_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sink: str, modules: tuple[str, ...], pip: str
) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without it looks like
    with pytest.raises(ConfigError, match=rf"'logging.sinks' lists '{sink}', which needs .*: {re.escape(pip)}"):
        MetricSinks.open(tmp_path / "out", SinkConfig(sinks=("jsonl", sink)), "run")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- closing
def test_closed_sinks_refuse_more_metrics(tmp_path: Path) -> None:
    sinks = MetricSinks.open(tmp_path, SinkConfig(), "run")
    sinks.close()
    sinks.close()  # twice is fine
    with pytest.raises(Exception, match=r"metric sinks are closed"):
        sinks.log_step(1, {"step": 1})


# ---------------------------------------------------------------------------- progress bar
def test_progress_bar_shows_step_reward_length_and_time() -> None:
    stream = io.StringIO()
    with ProgressBar(4, initial=1, stream=stream) as bar:
        bar.write("resumed at step 1")
        for s in (2, 3, 4):
            bar.update(step_metrics(s))
    text = stream.getvalue()
    assert "resumed at step 1" in text
    assert "4/4" in text
    assert "reward 0.400 +- 0.100" in text
    assert "len 4.0" in text and "0.25s/step" in text
    quiet = io.StringIO()
    with ProgressBar(2, enabled=False, stream=quiet) as bar:
        bar.write("hidden")
        bar.update(step_metrics(1))
    assert quiet.getvalue() == ""


def test_progress_bar_without_reward_metrics_still_counts() -> None:
    stream = io.StringIO()
    with ProgressBar(2, stream=stream) as bar:
        bar.update({"step": 1, "reward/mean": "n/a"})
        bar.update({"step": 2})
    assert "2/2" in stream.getvalue()
    assert "reward" not in stream.getvalue()

