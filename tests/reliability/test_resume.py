"""Resuming a run is exact or refused.

A resume whose config changes what the remaining steps compute (the learning rate, ...) is
refused with every changed key; keys that cannot change the math (steps, logging, checkpoint
cadence, ...) are allowed and logged. The newest checkpoint is found, and old ones pruned, by step
number. A checkpoint whose manifest is empty or partial, or that holds a file the manifest does not
list, or whose ``trainer_state.json`` has a missing or ill-typed field, is refused with a
``CheckpointError`` naming the file and the field, before any state changes. Every RNG stream is
restored, and a run of 4 steps equals 2 steps plus a resume for 2 bit for bit (metrics and
weights) even when the resumed process sees different free memory, and after the budget was
refined from the allocator's peak of the first update.
"""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reliability_helpers import comparable, tiny_config
from safetensors.torch import load_file

from verl_core import CheckpointError, ConfigError
from verl_core.trainer import Trainer, latest_checkpoint, verify_checkpoint
from verl_core.trainer.batching.scheduler import MemoryInfo, PeakReading
from verl_core.trainer.config import RunConfig, config_to_dict, load_config
from verl_core.trainer.run.checkpoints import MANIFEST_FILE, resume_config_changes, write_manifest

STATE = "trainer_state.json"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("run")
    with Trainer(tiny_config(out, "steps=2", "checkpoint.every=1")) as t:
        t.train()
    return out


@pytest.fixture(scope="module")
def loader(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    """A set-up trainer of the run's config (in its own folder) to load checkpoint copies into."""
    with Trainer(tiny_config(tmp_path_factory.mktemp("loader"), "steps=2", "checkpoint.every=1")) as t:
        t.setup()
        yield t


def _copy(run: Path, dest: Path) -> tuple[Path, Path]:
    shutil.copytree(run, dest)
    ckpt = latest_checkpoint(dest)
    assert ckpt is not None
    return dest, ckpt


def _rewrite_manifest(ckpt: Path) -> None:
    (ckpt / MANIFEST_FILE).unlink()
    write_manifest(ckpt)


# ---------------------------------------------------------------------------------------- config on resume
def test_a_changed_learning_rate_is_refused_listing_every_changed_key(
    run: Path, tmp_path: Path, tally: Counter[str]
) -> None:
    out, ckpt = _copy(run, tmp_path / "run")
    metrics_before = (out / "metrics.jsonl").read_text()
    cfg = tiny_config(out, "steps=2", "checkpoint.every=1", "optim.lr=5e-3", "rollout.temperature=0.5")
    tally["fuzz/resume config (changed lr)"] += 1
    with Trainer(cfg) as trainer:
        with pytest.raises(ConfigError) as info:
            trainer.train(resume=True)
        assert trainer.step == 0 and trainer.weight_version == 0
    msg = str(info.value)
    assert str(ckpt) in msg
    assert "optim.lr: 0.01 -> 0.005" in msg and "rollout.temperature: 1.0 -> 0.5" in msg, msg
    assert "2 config key(s)" in msg and "output_dir" in msg.split("Resume with")[1]
    assert "trainer_state.json" in msg and "start a new run in another output_dir" in msg
    assert (out / "metrics.jsonl").read_text() == metrics_before, "a refused resume rewrote the logs"


def test_changed_steps_logging_and_checkpoint_keys_are_allowed_and_logged(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out, _ = _copy(run, tmp_path / "run")
    stream = io.StringIO()
    cfg = tiny_config(out, "steps=3", "checkpoint.every=1", "checkpoint.keep=3", "logging.progress=true")
    with caplog.at_level(logging.INFO, logger="verl_core.trainer"), Trainer(cfg, stream=stream) as trainer:
        history = trainer.train(resume=True)
    assert [m["step"] for m in history] == [1, 2, 3]
    line = next(ln for ln in stream.getvalue().splitlines() if ln.startswith("resume: changed keys allowed: "))
    for change in ("steps: 2 -> 3", "checkpoint.keep: 2 -> 3", "logging.progress: False -> True"):
        assert change in line, line
    assert any(r.getMessage() == line for r in caplog.records)
    assert latest_checkpoint(out) == out / "checkpoints" / "step-000003"


def _dict(*overrides: str) -> dict[str, Any]:
    return config_to_dict(load_config(None, list(overrides)))


def test_the_allow_list_names_what_may_change() -> None:
    base = _dict("algorithm.options.clip_high=0.3")
    allowed = resume_config_changes(
        base,
        _dict("algorithm.options.clip_high=0.3", "steps=7", "output_dir=elsewhere", "ray.address=auto",
              "checkpoint.every=5", "batch.buffer_memory_bytes=1024", "max_consecutive_skips=0"),
        "ckpt",
    )
    assert allowed == [
        "batch.buffer_memory_bytes: 0 -> 1024", "checkpoint.every: 0 -> 5", "max_consecutive_skips: 5 -> 0",
        "output_dir: 'runs/verl' -> 'elsewhere'", "ray.address: '' -> 'auto'", "steps: 100 -> 7",
    ]
    assert resume_config_changes(base, base, "ckpt") == []
    # a key an older checkpoint did not have is no change at its default, a change otherwise
    older = {k: v for k, v in base.items() if k != "overwrite"}
    assert resume_config_changes(older, base, "ckpt") == []
    assert resume_config_changes(older, {**base, "overwrite": True}, "ckpt") == ["overwrite: '(absent)' -> True"]
    refused = {
        "algorithm.options.clip_high: 0.3 -> 0.2": _dict("algorithm.options.clip_high=0.2"),
        "backends.options.rollout.rollout_cache: '(absent)' -> 'static'":
            _dict("algorithm.options.clip_high=0.3", "backends.options.rollout.rollout_cache=static"),
        "batch.max_tokens: 0 -> 4096": _dict("algorithm.options.clip_high=0.3", "batch.max_tokens=4096"),
        "executor: 'local' -> 'ray'": _dict("algorithm.options.clip_high=0.3", "executor=ray"),
        "ray.parallel.actor.dp: '(absent)' -> 2": _dict("algorithm.options.clip_high=0.3", "ray.parallel.actor.dp=2"),
        "model.path: '' -> 'm'": _dict("algorithm.options.clip_high=0.3", "model.path=m"),
    }
    for change, now in refused.items():
        with pytest.raises(ConfigError, match="cannot resume") as info:
            resume_config_changes(base, now, "ckpt")
        assert change in str(info.value)
    # steps stretch a cosine schedule: then they change the learning rate of every later step
    cosine = _dict("optim.schedule=cosine")
    with pytest.raises(ConfigError, match=r"steps: 100 -> 7 \(it sets the length of the cosine"):
        resume_config_changes(cosine, {**cosine, "steps": 7}, "ckpt")


# ---------------------------------------------------------------------------------------- step order
def test_latest_and_pruning_go_by_step_number(run: Path, tmp_path: Path) -> None:
    out, _ = _copy(run, tmp_path / "run")
    root = out / "checkpoints"
    for name in ("step-999998", "step-999999", "step-1000000", "step-2000000.old", "step-abc"):
        (root / name).mkdir()
        (root / name / STATE).write_text("{}")
    (root / "step-3000000").mkdir()  # no trainer state: not a complete checkpoint
    assert latest_checkpoint(out) == root / "step-1000000"
    with Trainer(tiny_config(out, "steps=2", "checkpoint.keep=2")) as trainer:
        trainer.setup()
        trainer.step = 1_000_001
        saved = trainer.save_checkpoint()
    assert saved == root / "step-1000001" and latest_checkpoint(out) == saved
    verify_checkpoint(saved)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step-1000000", "step-1000001", "step-2000000.old", "step-3000000", "step-abc"], left


# ---------------------------------------------------------------------------------------- manifest
def _drop_entry(ckpt: Path, rel: str) -> None:
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    del manifest["files"][rel]
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))


def _weights(ckpt: Path) -> str:
    return next(ckpt.rglob("model.safetensors")).relative_to(ckpt).as_posix()


@pytest.mark.parametrize("case", ["empty", "partial", "unlisted file", "no engine folder"])
def test_an_empty_or_partial_manifest_is_refused(
    case: str, run: Path, loader: Trainer, tmp_path: Path, tally: Counter[str]
) -> None:
    _, ckpt = _copy(run, tmp_path / "run")
    if case == "empty":
        (ckpt / MANIFEST_FILE).write_text(json.dumps({"format": "verl.checkpoint-manifest/1", "files": {}}))
        named = "lists no files"
    elif case == "partial":
        rel = _weights(ckpt)
        _drop_entry(ckpt, rel)
        named = f"file {rel!r} is not listed in {MANIFEST_FILE}"
    elif case == "unlisted file":
        (ckpt / "actor" / "notes.txt").write_text("added later")
        named = f"file 'actor/notes.txt' is not listed in {MANIFEST_FILE}"
    else:  # a manifest rewritten to match a checkpoint without the actor's files
        shutil.rmtree(ckpt / "actor")
        _rewrite_manifest(ckpt)
        named = "'actor', which the loader reads, is missing"
    tally[f"fuzz/checkpoint manifest ({case})"] += 1
    if case != "no engine folder":  # the plain check; the loader also names what it reads
        with pytest.raises(CheckpointError, match="move this checkpoint folder away") as info:
            verify_checkpoint(ckpt)
        assert named in str(info.value)
    before = (loader.step, loader.weight_version)
    with pytest.raises(CheckpointError) as info:
        loader.load_checkpoint(ckpt)
    assert named in str(info.value) and str(ckpt) in str(info.value)
    assert (loader.step, loader.weight_version) == before


# ---------------------------------------------------------------------------------------- trainer state
def _set(path: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(state: dict[str, Any]) -> Any:
        *parents, last = path.split(".")
        node = state
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
        return state

    return edit


MALFORMED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "step negative": (_set("step", -1), "field 'step' must be an integer >= 0, got -1"),
    "step a string": (_set("step", "2"), "field 'step' must be an integer >= 0, got '2'"),
    "step missing": (_set("step", KeyError), "field 'step' must be an integer >= 0, it is missing"),
    "weight_version float": (_set("weight_version", 1.5), "field 'weight_version' must be an integer"),
    "rng torch missing": (_set("rng.torch", KeyError), "field 'rng.torch' must be the saved torch RNG state"),
    "rng python garbage": (_set("rng.python", "(3, ("), "field 'rng.python' must be a repr"),
    "rng torch garbage": (_set("rng.torch", "bm90IGEgc3RhdGU="), "field 'rng.torch' must be a base64"),
    "rng numpy garbage": (_set("rng.numpy", [1, 2]), "field 'rng.numpy' must be"),
    "rng not a table": (_set("rng", []), "field 'rng' must be a table"),
    "schedulers a list": (_set("schedulers", []), "field 'schedulers' must be a table with one entry per role"),
    "scheduler role missing": (_set("schedulers.critic", KeyError), "field 'schedulers' must be a table"),
    "ceiling zero": (_set("schedulers.actor.ceiling", 0), "field 'schedulers.actor.ceiling' must be an integer >= 1"),
    "budget a string": (_set("schedulers.actor.budget", "64"), "field 'schedulers.actor.budget' must be an integer"),
    "algorithm value": (_set("algorithm.value", None), "field 'algorithm.value' must be a number"),
    "config missing": (_set("config", KeyError), "field 'config' must be the run's config"),
    "not an object": (lambda state: [state], "must hold a JSON object"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_trainer_state_is_refused_naming_the_field(
    case: str, run: Path, loader: Trainer, tmp_path: Path, tally: Counter[str]
) -> None:
    _, ckpt = _copy(run, tmp_path / "run")
    edit, named = MALFORMED[case]
    (ckpt / STATE).write_text(json.dumps(edit(json.loads((ckpt / STATE).read_text()))))
    _rewrite_manifest(ckpt)  # the file is damaged at the source, not on disk afterwards
    tally[f"fuzz/trainer state ({case})"] += 1
    before = (loader.step, loader.weight_version, torch.get_rng_state())
    with pytest.raises(CheckpointError) as info:
        loader.load_checkpoint(ckpt)
    msg = str(info.value)
    assert named in msg and STATE in msg and str(ckpt) in msg, msg
    assert (loader.step, loader.weight_version) == before[:2] and torch.equal(torch.get_rng_state(), before[2])


def test_every_rng_stream_is_restored(run: Path, loader: Trainer) -> None:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    assert {"torch", "python", "numpy"} <= json.loads((ckpt / STATE).read_text())["rng"].keys()

    def draws() -> tuple[list[float], float, list[float]]:
        return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist()

    loader.load_checkpoint(ckpt)
    first = draws()
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    loader.load_checkpoint(ckpt)
    assert draws() == first


# ---------------------------------------------------------------------------------------- exact resume
# the default micro-batch bounds; 4 prompts x 4 samples make a step larger than the smallest budget
EXACT = ("batch.micro_batch_tokens=0", "batch.buffer_memory_bytes=0", "batch.prompts_per_step=4", "rollout.n=4")
PLENTY = MemoryInfo(free_bytes=1 << 40, total_bytes=1 << 40)  # budget: the whole batch
SCARCE = MemoryInfo(free_bytes=0, total_bytes=1 << 40)  # budget: min_tokens
MODERATE = MemoryInfo(free_bytes=64 << 20, total_bytes=1 << 40)  # the tiny model's estimate fits the batch


class FixedPeak:
    """A peak probe that reports ``transient`` bytes above the resident memory (the CPU has no
    allocator peak to read, so the tests set the measurement)."""

    def __init__(self, transient: int) -> None:
        self.transient = transient
        self.calls = 0

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, PeakReading]:
        self.calls += 1
        return fn(), PeakReading(before=0, peak=self.transient, after=0)


def _train(
    cfg: RunConfig, free: MemoryInfo, *, resume: bool = False, peak: FixedPeak | None = None
) -> list[dict[str, Any]]:
    with Trainer(cfg, memory_probe=lambda: free, peak_probe=peak) as trainer:
        return trainer.train(resume=resume)


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the actor's checkpoint: the weights and the optimizer state."""
    out = {f"weights/{k}": v for k, v in load_file(next(ckpt.rglob("model.safetensors"))).items()}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    walk("state", torch.load(next(ckpt.rglob("trainer_state.pt")), weights_only=True))
    return out


def test_two_steps_plus_a_resume_equal_four_steps_whatever_memory_the_resume_finds(tmp_path: Path) -> None:
    straight = _train(tiny_config(tmp_path / "straight", *EXACT, "steps=4"), PLENTY)
    # the budget is bounded by each step's batch: its update (whose forward gives the old log-probs) runs whole
    assert all(64 < m["scheduler/actor/budget"] < 1000 for m in straight)
    assert [m["scheduler/actor/micro_batches"] for m in straight] == [1] * 4

    half = tmp_path / "half"
    _train(tiny_config(half, *EXACT, "steps=2"), PLENTY)
    ckpt = latest_checkpoint(half)
    assert ckpt is not None
    control = tmp_path / "control"  # the same checkpoint without the stored budget
    shutil.copytree(half, control)
    resumed = _train(tiny_config(half, *EXACT, "steps=4"), SCARCE, resume=True)
    assert comparable(resumed) == comparable(straight)
    a = _tensors(tmp_path / "straight" / "checkpoints" / "step-000004")
    b = _tensors(half / "checkpoints" / "step-000004")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the resume"

    # The control: a checkpoint without the budget (as older versions wrote) keeps the budget of the
    # resuming process, which SCARCE makes split every step into more micro-batches.
    cstate = latest_checkpoint(control)
    assert cstate is not None
    state = json.loads((cstate / STATE).read_text())
    for s in state["schedulers"].values():
        del s["budget"]
    (cstate / STATE).write_text(json.dumps(state))
    _rewrite_manifest(cstate)
    squeezed = _train(tiny_config(control, *EXACT, "steps=4"), SCARCE, resume=True)
    assert squeezed[-1]["scheduler/actor/budget"] == 64
    assert squeezed[-1]["scheduler/actor/micro_batches"] > straight[-1]["scheduler/actor/micro_batches"]
    # ... and other float sums: the comparison above is sharp enough to see a different partition
    c = _tensors(control / "checkpoints" / "step-000004")
    assert any(not torch.equal(a[k], c[k]) for k in a)


def _tensors_equal(a: Path, b: Path) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 0
    return all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_resume_after_the_refinement_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    # the estimate lets step 1 run whole; its update's measured peak (1 GiB for the batch) then cuts
    # the budget to min_tokens, so steps 2.. run in several micro-batches
    peak = FixedPeak(1 << 30)
    straight = _train(tiny_config(tmp_path / "straight", *EXACT, "steps=4"), MODERATE, peak=peak)
    assert peak.calls == 1  # once, and only once
    micro = [m["scheduler/actor/micro_batches"] for m in straight]
    assert micro[0] == 1 and all(n > 1 for n in micro[1:]), micro
    assert [m["scheduler/actor/budget"] for m in straight[1:]] == [64] * 3

    half = tmp_path / "half"
    _train(tiny_config(half, *EXACT, "steps=2"), MODERATE, peak=FixedPeak(1 << 30))
    control = tmp_path / "control"
    shutil.copytree(half, control)
    # the resumed process finds other memory and would measure another peak: neither is used
    other = FixedPeak(1)
    resumed = _train(tiny_config(half, *EXACT, "steps=4"), PLENTY, resume=True, peak=other)
    assert other.calls == 0
    assert comparable(resumed) == comparable(straight)
    assert _tensors_equal(tmp_path / "straight" / "checkpoints" / "step-000004", half / "checkpoints" / "step-000004")

    # The control: the checkpoint's schedulers put back to before the refinement (the estimate's
    # budget, the refinement pending) refine again in the resumed process, from its own peak.
    ckpt = latest_checkpoint(control)
    assert ckpt is not None
    state = json.loads((ckpt / STATE).read_text())
    assert state["schedulers"]["actor"]["refine_from"] is None and state["schedulers"]["actor"]["budget"] == 64
    assert state["schedulers"]["reference"]["refine_from"] is None  # never trains, never measures
    state["schedulers"]["actor"].update(budget=1 << 20, refine_from=MODERATE.free_bytes)
    (ckpt / STATE).write_text(json.dumps(state))
    _rewrite_manifest(ckpt)
    again = FixedPeak(1)
    redone = _train(tiny_config(control, *EXACT, "steps=4"), PLENTY, resume=True, peak=again)
    assert again.calls == 1
    assert [m["scheduler/actor/micro_batches"] for m in redone[2:]] == [1, 1]  # the history holds all 4 steps
    assert not _tensors_equal(tmp_path / "straight" / "checkpoints" / "step-000004",
                              control / "checkpoints" / "step-000004")


def test_a_checkpoint_older_than_a_config_section_resumes_at_its_defaults(tmp_path: Path) -> None:
    """A section added after the checkpoint was written ([agent], model.lora) is no change at its default."""
    from verl_core.trainer.config import RunConfig, config_to_dict

    current = config_to_dict(RunConfig())
    saved = {k: v for k, v in current.items() if k != "agent"}
    saved["model"] = {k: v for k, v in current["model"].items() if k != "lora"}
    assert resume_config_changes(saved, current, tmp_path) == []
    changed = {**current, "agent": {**current["agent"], "max_turns": 3}}
    with pytest.raises(ConfigError, match=r"agent.max_turns: '\(absent\)' -> 3"):
        resume_config_changes(saved, changed, tmp_path)
