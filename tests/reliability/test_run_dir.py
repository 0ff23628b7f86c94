"""The trainer deletes only what its run created, and never mixes two runs in one output folder.

Each case runs a real trainer (tiny config, one step, a replay buffer that spills every batch)
with an ``output_dir`` next to and around sentinel files: an empty value and ``.`` (from inside
the sentinel folder), the home directory, a folder holding files and a ``spill/`` folder, a
folder of another run, one with checkpoints but no run marker, and ``overwrite=true``. Every
sentinel must survive byte for byte, a refusal must come before any engine is built and name the
folder and the ways out, and ``overwrite`` must only move things aside.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import TINY, tiny_config

from verl_core import ConfigError
from verl_core.cli import main
from verl_core.kernel.version import __version__
from verl_core.trainer import Trainer, latest_checkpoint, verify_checkpoint
from verl_core.trainer.config import RunConfig
from verl_core.trainer.run.folder import MARKER_FILE, RunDir, config_hash, read_marker

# A folder of the user's: files, a nested folder, and a spill/ folder (the name the trainer once
# cleared), with a file named like a spill segment in it.
SENTINELS = {
    "notes.txt": b"my notes\n",
    "data/train.jsonl": b'{"prompt": "c12="}\n' * 3,
    "spill/segment-00000000.pt": b"not a spill file of any run",
    "spill/keep/deep.bin": bytes(range(256)),
    ".model-tmp/config.json": b"{}",
}


def _plant(root: Path) -> None:
    for rel, data in SENTINELS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder the runs here share (built once)."""
    out = tmp_path_factory.mktemp("model-run") / "run"
    with Trainer(tiny_config(out, "steps=1")) as t:
        t.setup()
    return out / "model"


@pytest.fixture(scope="module")
def finished(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step run (with a checkpoint)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with Trainer(tiny_config(out, "steps=1", model=model)) as t:
        t.train()
    return out


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """A folder of sentinel files the runs of a test start in and next to."""
    root = tmp_path / "world"
    root.mkdir()
    _plant(root)
    return root


def _refused(cfg: RunConfig, *, resume: bool = False) -> str:
    """Run ``cfg``; it must be refused with a ConfigError before any engine is built."""
    with Trainer(cfg) as trainer:
        with pytest.raises(ConfigError) as info:
            trainer.train(resume=resume)
        assert getattr(trainer, "actor", None) is None, "an engine was built before the refusal"
    return str(info.value)


# ---------------------------------------------------------------------------- places never used
@pytest.mark.parametrize("where", ["empty", "dot", "home", "parent of home", "home with overwrite"])
def test_output_dir_in_or_around_the_working_or_home_folder_is_refused(
    where: str, world: Path, model: Path, monkeypatch: pytest.MonkeyPatch, tally: Counter[str]
) -> None:
    before = _snapshot(world.parent)
    monkeypatch.chdir(world)
    extra: tuple[str, ...] = ()
    if where == "empty":  # refused when the config loads, before any trainer exists
        with pytest.raises(ConfigError, match="'output_dir'.*non-empty path"):
            tiny_config(Path("x"), "steps=1", 'output_dir=""', model=model)
        tally[f"fuzz/output_dir ({where})"] += 1
        assert _snapshot(world.parent) == before, "a refused run changed files"
        return
    if where == "dot":
        cfg = tiny_config(Path("."), "steps=1", model=model)
    else:
        monkeypatch.chdir(world.parent)
        home = world / "data" if where == "parent of home" else world
        monkeypatch.setenv("HOME", str(home))
        extra = ("overwrite=true",) if where == "home with overwrite" else ()
        cfg = tiny_config(world, "steps=1", *extra, model=model)
    tally[f"fuzz/output_dir ({where})"] += 1
    msg = _refused(cfg)
    assert "output_dir=runs/NAME" in msg, msg
    what = {"empty": "is empty", "dot": "is the current directory", "home": "is your home directory",
            "parent of home": "contains your home directory", "home with overwrite": "is your home directory"}
    assert what[where] in msg, msg
    assert _snapshot(world.parent) == before, "a refused run changed files"


# ---------------------------------------------------------------------------- folders that hold something
def test_a_folder_of_other_files_and_a_spill_folder_is_refused_and_left_alone(
    world: Path, model: Path, tally: Counter[str]
) -> None:
    before = _snapshot(world.parent)
    tally["fuzz/output_dir (non-empty, not a run)"] += 1
    msg = _refused(tiny_config(world, "steps=1", model=model))
    assert str(world) in msg and "is not a verl run" in msg and "spill" in msg, msg
    assert "choose another output_dir" in msg and "overwrite=true" in msg, msg
    msg = _refused(tiny_config(world, "steps=1", model=model), resume=True)
    assert "--resume" in msg and "is not a verl run" in msg, msg
    assert _snapshot(world.parent) == before


def test_a_fresh_run_in_another_run_s_folder_is_refused(
    finished: Path, world: Path, model: Path, capsys: pytest.CaptureFixture[str], tally: Counter[str]
) -> None:
    other = world / "other"
    shutil.copytree(finished, other)
    before = _snapshot(world.parent)
    marker = read_marker(other)
    assert marker is not None
    tally["fuzz/output_dir (another run)"] += 1
    msg = _refused(tiny_config(other, "steps=1", model=model))
    assert str(other) in msg and f"run {marker.run_id}" in msg and "checkpoints up to step-000001" in msg, msg
    for way in ("--resume", "choose another output_dir", "overwrite=true"):
        assert way in msg, msg
    # the command says the same, exits 2, and builds nothing
    code = main(["train", *TINY, "steps=1", f"model.path={json.dumps(str(model))}", "--output-dir", str(other)])
    err = capsys.readouterr().err
    assert code == 2 and "already holds a run" in err and "--resume" in err and "Traceback" not in err, err
    assert _snapshot(world.parent) == before, "a refused run changed the other run's folder"


def test_a_run_that_never_reached_a_checkpoint_is_not_offered_to_resume(
    model: Path, world: Path, tally: Counter[str]
) -> None:
    """A run stopped before its first checkpoint (here: set up, never trained) has nothing to resume:
    the refusals say so and offer only the ways that work, in both modes."""
    other = world / "started"
    shutil.copytree(model.parent, other)
    assert read_marker(other) is not None and latest_checkpoint(other) is None
    before = _snapshot(world.parent)
    tally["fuzz/output_dir (a run without a checkpoint)"] += 2
    msg = _refused(tiny_config(other, "steps=2", model=model))
    assert "already holds a run that never reached a checkpoint" in msg and "a different config" in msg, msg
    assert "nothing to resume" in msg and "--resume" not in msg, msg
    for way in ("choose another output_dir", f"remove {str(other)!r} if it is yours", "overwrite=true"):
        assert way in msg, msg
    with Trainer(tiny_config(other, "steps=2", model=model)) as trainer, pytest.raises(ConfigError) as info:
        trainer.train(resume=True)  # refused once the engines are built, when the checkpoint is looked up
    msg = str(info.value)
    assert msg.startswith("--resume:") and "never reached a checkpoint" in msg, msg
    assert "run without --resume to start fresh" not in msg, msg  # a fresh run there is refused (above)
    for way in ("choose another output_dir", f"remove {str(other)!r} if it is yours", "overwrite=true"):
        assert way in msg, msg
    assert _snapshot(world.parent) == before, "a refused run changed the folder"
    # the way it names works: overwrite=true moves the run aside and starts fresh
    with Trainer(tiny_config(other, "steps=1", "overwrite=true", model=model)) as t:
        assert len(t.train()) == 1


def test_a_run_under_way_before_its_first_checkpoint_is_in_use(model: Path, world: Path) -> None:
    """A fresh run is not told to remove the folder of a run that is running there."""
    other = world / "running"
    shutil.copytree(model.parent, other)
    holder = RunDir.claim(str(other), tiny_config(other, "steps=1", model=model), mode="resume")
    try:
        msg = _refused(tiny_config(other, "steps=2", model=model))
        assert "is in use" in msg and "remove" not in msg, msg
    finally:
        holder.release()


def test_checkpoints_without_a_run_marker_are_refused_in_both_modes(
    finished: Path, world: Path, model: Path, tally: Counter[str]
) -> None:
    old = world / "old"
    shutil.copytree(finished, old)
    (old / MARKER_FILE).unlink()
    before = _snapshot(world.parent)
    tally["fuzz/output_dir (checkpoints, no marker)"] += 2
    msg = _refused(tiny_config(old, "steps=1", model=model))
    assert "holds checkpoints (step-000001) but no run marker" in msg and "overwrite=true" in msg, msg
    msg = _refused(tiny_config(old, "steps=2", model=model), resume=True)
    assert msg.startswith("--resume:") and f"no run marker {MARKER_FILE}" in msg, msg
    assert "another output_dir" in msg and "overwrite=true" in msg, msg
    assert _snapshot(world.parent) == before


def test_resume_needs_a_run_and_overwrite_does_not_mix_with_it(world: Path, model: Path) -> None:
    before = _snapshot(world.parent)
    msg = _refused(tiny_config(world / "new", "steps=1", model=model), resume=True)
    assert "holds no run" in msg and "run without --resume" in msg, msg
    msg = _refused(tiny_config(world / "new", "steps=1", "overwrite=true", model=model), resume=True)
    assert "drop one of the two" in msg, msg
    assert _snapshot(world.parent) == before


def test_a_run_in_progress_is_neither_resumed_nor_overwritten_by_another(
    finished: Path, world: Path, model: Path
) -> None:
    other = world / "other"
    shutil.copytree(finished, other)
    before = _snapshot(world.parent)
    holder = RunDir.claim(str(other), tiny_config(other, "steps=1", model=model), mode="resume")
    try:
        for extra, resume in ((("steps=2",), True), (("overwrite=true",), False)):
            msg = _refused(tiny_config(other, *extra, model=model), resume=resume)
            assert "is in use" in msg and "not closed" in msg, msg
    finally:
        holder.release()
    assert _snapshot(world.parent) == before
    with Trainer(tiny_config(other, "steps=2", model=model)) as t:  # released: it resumes
        assert len(t.train(resume=True)) == 2


# ---------------------------------------------------------------------------- overwrite moves aside
@pytest.mark.parametrize("holding", ["other files", "another run"])
def test_overwrite_moves_the_folder_aside_and_deletes_nothing(
    holding: str, finished: Path, world: Path, model: Path
) -> None:
    target = world / "target"
    if holding == "another run":
        shutil.copytree(finished, target)
    else:
        target.mkdir()
        _plant(target)
    before = _snapshot(target)
    around = _snapshot(world)
    with Trainer(tiny_config(target, "steps=1", "overwrite=true", model=model)) as t:
        hist = t.train()
        assert t.run_dir is not None and t.run_dir.moved_aside is not None
        aside = t.run_dir.moved_aside
    assert len(hist) == 1
    assert aside.parent == world and aside.name.startswith("target.old-")
    assert _snapshot(aside) == before, "overwrite changed what it moved aside"
    for rel, data in around.items():  # everything else in the world is as it was
        if not rel.startswith("target"):
            assert _snapshot(world).get(rel) == data, rel
    marker = read_marker(target)
    assert marker is not None and (holding != "another run" or marker != read_marker(aside))
    ckpt = latest_checkpoint(target)
    assert ckpt is not None
    verify_checkpoint(ckpt)
    # the run spilled its replay buffer and removed exactly its own spill folder
    assert hist[0]["buffer/spilled_samples"] > 0
    assert not list(target.glob("spill*")) and not list(target.glob(".model-tmp*"))


def test_a_run_next_to_sentinels_touches_only_its_folder(world: Path, model: Path) -> None:
    before = _snapshot(world)
    with Trainer(tiny_config(world / "runs" / "a", "steps=1", "checkpoint.every=1", model=model)) as t:
        hist = t.train()
    assert hist[0]["buffer/spilled_samples"] > 0
    after = _snapshot(world)
    assert {k: v for k, v in after.items() if not k.startswith("runs")} == before
    assert sorted(p.name for p in (world / "runs" / "a").iterdir()) == [
        "checkpoints", "config.json", "metrics.jsonl", "scheduler_plan.jsonl", MARKER_FILE,
    ]


# ---------------------------------------------------------------------------- the marker
def test_the_marker_names_the_run_and_its_config(world: Path, model: Path) -> None:
    cfg = tiny_config(world / "run", "steps=1", model=model)
    run = RunDir.claim(cfg.output_dir, cfg, mode="fresh")
    try:
        data = json.loads((world / "run" / MARKER_FILE).read_text())
        assert data["format"] == "verl.run/1"
        assert len(data["run_id"]) == 32 and int(data["run_id"], 16) >= 0
        assert data["created_by"] == f"verl-core {__version__}"
        assert data["config_hash"] == config_hash(cfg) == config_hash(tiny_config(world / "elsewhere", "steps=1", model=model))
        assert data["created"].endswith("+00:00")
        assert read_marker(world / "run") == run.marker
        assert sorted(p.name for p in (world / "run").iterdir()) == [MARKER_FILE]  # no temporary left
    finally:
        run.release()
    (world / "run" / MARKER_FILE).write_text("{")
    msg = _refused(cfg, resume=True)
    assert "cannot be read" in msg, msg


def _race(out: Path, cfg: RunConfig, racers: int) -> tuple[list[RunDir], list[str]]:
    """``racers`` threads claim ``out`` for a fresh run at the same moment."""
    barrier = threading.Barrier(racers)
    won: list[RunDir] = []
    refused: list[str] = []

    def claim() -> None:
        barrier.wait()
        try:
            won.append(RunDir.claim(str(out), cfg, mode="fresh"))
        except ConfigError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=claim) for _ in range(racers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return won, refused


def test_claims_racing_for_one_folder_have_exactly_one_winner(tmp_path: Path, model: Path, tally: Counter[str]) -> None:
    racers = 6
    for round_ in range(15):
        out = tmp_path / f"race-{round_}"
        won, refused = _race(out, tiny_config(out, "steps=1", model=model), racers)
        tally["race/six fresh claims of one folder at once"] += 1
        assert len(won) == 1 and len(refused) == racers - 1, refused
        assert all(str(out) in m and "output_dir" in m for m in refused), refused
        assert read_marker(out) == won[0].marker
        assert sorted(os.listdir(out)) == [MARKER_FILE]
        won[0].release()


# ---------------------------------------------------------------------------- a setup that fails
@pytest.mark.parametrize("place", ["new folder, tiny model", "empty folder of the user's"])
def test_a_run_whose_setup_fails_after_the_claim_gives_the_folder_back(model: Path, world: Path, place: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward model the engine refuses (here a causal LM) is found after the claim, once the engines are
    built: the failed run takes back its marker and the tiny model it built, and the folder when it made it,
    so the corrected run starts in the same ``output_dir``; the user's files around it stay."""
    out = world / "reward-run"
    tiny = place.startswith("new")
    if not tiny:
        out.mkdir()
    refused = ["backends.reward=hf", f"reward_model={json.dumps(str(model))}"]
    before = {k: v for k, v in _snapshot(world).items() if not k.startswith("reward-run")}
    closed = _record_closes(monkeypatch)
    with Trainer(tiny_config(out, "steps=1", *refused, model=None if tiny else model)) as trainer:
        with pytest.raises(ConfigError, match="LlamaForCausalLM"):
            trainer.train()
        if tiny:
            assert trainer.run_dir is None
        # the engines built before the failure are released then, not left for the process's end
        assert sorted(closed) == ["actor", "reference", "rollout"], closed
    if tiny:
        assert not out.exists(), f"the failed run left {sorted(p.name for p in out.iterdir())}"
    else:
        assert out.is_dir() and not any(out.iterdir()), "the user's empty folder must stay, empty"
    assert {k: v for k, v in _snapshot(world).items() if not k.startswith("reward-run")} == before
    with Trainer(tiny_config(out, "steps=1", model=model)) as t:
        assert len(t.train()) == 1


def _record_closes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roles of the hf engines closed from now on (the list fills as they close)."""
    from verl_hf.rollout import HFRolloutEngine
    from verl_hf.training import HFTrainingEngine

    closed: list[str] = []
    for cls in (HFTrainingEngine, HFRolloutEngine):
        def recording(engine: Any, _close: Any = cls.close) -> None:
            closed.append(engine.spec.role)
            _close(engine)

        monkeypatch.setattr(cls, "close", recording)
    return closed


def test_abandon_removes_only_the_claim_s_own_marker_and_entries(world: Path, model: Path) -> None:
    """What abandon leaves: a file that appeared in the folder, a run it opened, a run with a checkpoint."""
    cfg = tiny_config(world / "a", "steps=1", model=model)
    run = RunDir.claim(str(world / "a"), cfg, mode="fresh")
    (world / "a" / "mine.txt").write_text("a user's file")
    (world / "a" / "model").mkdir()
    assert run.abandon(("model",)) is True
    assert sorted(p.name for p in (world / "a").iterdir()) == ["mine.txt"], "only the marker and model go"
    # a claim that opened the run that was there only lets it go
    other = world / "opened"
    shutil.copytree(model.parent, other)
    before = _snapshot(other)
    opened = RunDir.claim(str(other), tiny_config(other, "steps=1", model=model), mode="resume")
    assert opened.abandon(("model",)) is False and _snapshot(other) == before and not opened.held
