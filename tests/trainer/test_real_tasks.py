"""`verl train` on a user's dataset: reward functions, evaluation, metric sinks, exact resume, bad input.

Every run trains the testkit's tiny character-level model for a few steps; the reward functions
live in files next to the config and record what they were called with, so the tests see exactly
which prompts reached them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import datasets
import pytest

from verl_conformance.testkit import TinyModelSpec, tiny_model
from verl_core.cli import main
from verl_core.kernel.errors import CheckpointError, ConfigError, RewardError
from verl_core.trainer.config import RunConfig, load_config
from verl_core.trainer.rl.trainer import Trainer, latest_checkpoint
from verl_core.trainer.run.checkpoints import MANIFEST_FILE, write_manifest
from verl_core.trainer.run.context import StepFailedError

datasets.disable_progress_bars()

# "q<id>=" -> the id's digit; the id column lets a reward function check that rows stay aligned
ROWS = [{"prompt": f"q{i}=", "answer": str(i), "id": i} for i in range(7)]
EVAL_ROWS = [{"prompt": f"q{i}=", "answer": str(i), "id": i} for i in (7, 8, 9)]

REWARDS = '''
import json
from pathlib import Path

CALLS = Path(__file__).with_name("calls.jsonl")


def aligned(prompts, completions, id, **kwargs):
    """Rewards short completions; checks each completion's prompt is its row's (the id column)."""
    for prompt, i in zip(prompts, id):
        assert prompt == f"q{i}=", f"prompt {prompt!r} arrived with the id {i!r} of another row"
    with CALLS.open("a") as fh:
        fh.write(json.dumps(prompts) + "\\n")
    return [1.0 - min(len(c), 4) / 4 for c in completions]


def needs_label(completions, label):
    return [0.0] * len(completions)


def two_args(x, y):
    return [0.0]


def boom(completions, **kwargs):
    raise ValueError("the grader crashed")
'''

CALLBACKS = '''
import json
from pathlib import Path


class Record:
    def _write(self, hook, step, extra=None):
        with Path(__file__).with_name("hooks.jsonl").open("a") as fh:
            fh.write(json.dumps({"hook": hook, "step": step, "extra": extra}) + "\\n")

    def on_step_end(self, step, metrics):
        self._write("step", step, sorted(k for k in metrics if k.startswith("reward/")))

    def on_eval(self, step, metrics):
        self._write("eval", step, sorted(metrics))

    def on_checkpoint(self, step, path):
        self._write("checkpoint", step, Path(path).name)
'''

TINY = {
    "seed": 3,
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 1, "num_kv_heads": 1, "num_layers": 1},
    "rollout": {"n": 2, "max_new_tokens": 3},
    "batch": {"prompts_per_step": 2, "micro_batch_tokens": 64},
    "optim": {"lr": 1e-2},
    "logging": {"progress": False, "plot": False},
}


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_heads=1, num_kv_heads=1,
                                    num_layers=1, vocab_size=96, tied=True))


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def project(folder: Path) -> Path:
    """A folder holding the datasets, the reward functions and the callback, as a user would keep them."""
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "train.jsonl", ROWS)
    write_jsonl(folder / "eval.jsonl", EVAL_ROWS)
    (folder / "rewards.py").write_text(REWARDS)
    (folder / "callbacks.py").write_text(CALLBACKS)
    return folder


def toml(value: Any) -> str:
    if isinstance(value, dict):
        raise TypeError("tables are written by write_config")
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def write_config(path: Path, tables: dict[str, Any]) -> Path:
    """``tables`` as a TOML file (top-level keys, then one [section] per nested table)."""
    lines = [f"{k} = {toml(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]", *(f"{k} = {toml(v)}" for k, v in table.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def run_config(folder: Path, model: Path, out: Path, **tables: Any) -> dict[str, Any]:
    base = {
        "output_dir": str(out),
        "model": {"path": str(model)},
        "data": {"train": "train.jsonl"},
        "reward": {"functions": ["rewards.py:aligned"]},
    }
    return merged(TINY, base, tables)


def calls(folder: Path) -> list[list[str]]:
    return [json.loads(ln) for ln in (folder / "calls.jsonl").read_text().splitlines()]


def comparable(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))} for m in history]


# ---------------------------------------------------------------------------------------- a full run
def test_verl_train_on_a_dataset_with_reward_functions_eval_and_every_sink(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = project(tmp_path / "project")
    out = tmp_path / "run"
    config = write_config(folder / "run.toml", run_config(
        folder, model, out, steps=3,
        data={"eval": "eval.jsonl", "eval_every": 2, "eval_n": 2},
        reward={"functions": ["verl_core.trainer.inputs.reward_functions:exact_match", "rewards.py:aligned"],
                "weights": [2.0, 0.5]},
        logging={"sinks": ["jsonl", "tensorboard", "callbacks.py:Record"]},
        checkpoint={"every": 2},
    ))
    monkeypatch.chdir(tmp_path)  # relative paths in the config are found next to it
    assert main(["train", str(config)]) == 0

    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        # the score is the weighted sum of the functions, so its mean is the weighted sum of their means
        combined = 2.0 * m["reward/exact_match/mean"] + 0.5 * m["reward/aligned/mean"]
        assert m["reward/mean"] == pytest.approx(combined, abs=1e-6), m
    assert any(m["reward/aligned/mean"] > 0 for m in metrics)  # the file's function really scored
    eval_keys = {"eval/reward/mean", "eval/reward/exact_match/mean", "eval/reward/aligned/mean",
                 "eval/response/length_mean"}
    assert [sorted(eval_keys & m.keys()) for m in metrics] == [[], sorted(eval_keys), sorted(eval_keys)]
    last = metrics[-1]
    assert last["eval/reward/mean"] == pytest.approx(
        2.0 * last["eval/reward/exact_match/mean"] + 0.5 * last["eval/reward/aligned/mean"], abs=1e-6)

    # training calls: 2 prompts x 2 samples; evaluation: all 3 eval rows x eval_n=2 in batches of 2 prompts
    seen = calls(folder)
    train_calls = [c for c in seen if c[0] in {r["prompt"] for r in ROWS}]
    eval_calls = [c for c in seen if c not in train_calls]
    assert [len(c) for c in train_calls] == [4, 4, 4]
    assert [len(c) for c in eval_calls] == [4, 2, 4, 2]
    assert sorted(set(eval_calls[0] + eval_calls[1])) == ["q7=", "q8=", "q9="]
    assert all(c[0] == c[1] and c[2] == c[3] for c in train_calls)  # n samples of a prompt are adjacent

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    aligned = [(e.step, e.value) for e in events.Scalars("reward/aligned/mean")]
    assert aligned == [(m["step"], pytest.approx(m["reward/aligned/mean"])) for m in metrics]
    assert [e.step for e in events.Scalars("eval/reward/mean")] == [2, 3]

    hooks = [json.loads(ln) for ln in (folder / "hooks.jsonl").read_text().splitlines()]
    reward_keys = ["reward/aligned/mean", "reward/exact_match/mean", "reward/max", "reward/mean", "reward/std"]
    assert [(h["hook"], h["step"]) for h in hooks] == [
        ("step", 1), ("step", 2), ("eval", 2), ("checkpoint", 2), ("step", 3), ("eval", 3), ("checkpoint", 3)]
    assert hooks[0]["extra"] == reward_keys
    assert hooks[2]["extra"] == sorted(eval_keys)
    assert hooks[3]["extra"] == "step-000002"


# ---------------------------------------------------------------------------------------- exact resume
def test_resume_continues_the_data_order_exactly(model: Path, tmp_path: Path) -> None:
    def parquet_project(name: str) -> Path:
        folder = project(tmp_path / name)
        datasets.Dataset.from_list(ROWS).to_parquet(str(folder / "train.parquet"))
        return folder

    def cfg(folder: Path, steps: int) -> RunConfig:
        tables = run_config(folder, model, folder / "out", steps=steps,
                            data={"train": "train.parquet", "eval": "eval.jsonl", "eval_every": 2})
        return load_config(write_config(folder / "run.toml", tables))

    # 4 steps of 2 prompts cross the 7-row epoch; the resumed run continues from step 2
    straight = parquet_project("straight")
    with Trainer(cfg(straight, 4), base_dir=straight) as trainer:
        full = trainer.train()
    cut = parquet_project("cut")
    with Trainer(cfg(cut, 2), base_dir=cut) as trainer:
        trainer.train()
    with Trainer(cfg(cut, 4), base_dir=cut) as trainer:
        resumed = trainer.train(resume=True)
    assert comparable(resumed) == comparable(full)
    assert calls(cut) == calls(straight)  # the same prompts, in the same order, evaluations included
    train = [c for c in calls(straight) if c[0] in {r["prompt"] for r in ROWS}]
    drawn = [p for c in train for p in c[::2]]  # each prompt's first sample: 2 prompts per step
    assert len(drawn) == 8 and sorted(drawn[:7]) == sorted(r["prompt"] for r in ROWS)  # epoch 0, then epoch 1
    ckpt = latest_checkpoint(cut / "out")
    assert ckpt is not None
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["data"] == {"epoch": 1, "index": 1, "size": 7, "seed": 3, "shuffle": True}
    assert [m["data/epoch"] for m in resumed] == [0, 0, 0, 1]

    # a damaged position is refused as a damaged checkpoint; a dataset of another size as a config change
    state["data"]["index"] = "one"
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / MANIFEST_FILE).unlink()
    write_manifest(ckpt)
    with Trainer(cfg(cut, 4), base_dir=cut) as trainer, pytest.raises(CheckpointError, match=r"field 'data.index'"):
        trainer.load_checkpoint(ckpt)
    datasets.Dataset.from_list(ROWS[:6]).to_parquet(str(cut / "train.parquet"))
    with Trainer(cfg(cut, 4), base_dir=cut) as trainer, pytest.raises(ConfigError, match=r"saved for 7 rows.*now 6"):
        trainer.load_checkpoint(ckpt.parent / "step-000002")


# ---------------------------------------------------------------------------------------- bad input
def _refused(folder: Path, model: Path, **tables: Any) -> str:
    """The ConfigError of setting up a run of ``tables``; nothing may be written."""
    out = folder / "out"
    config = load_config(write_config(folder / "run.toml", run_config(folder, model, out, steps=2, **tables)))
    with Trainer(config, base_dir=folder) as trainer, pytest.raises(ConfigError) as info:
        trainer.setup()
    assert not out.exists(), "a refused run wrote to its output folder"
    return str(info.value)


def test_bad_datasets_and_reward_functions_are_refused_before_anything_is_written(
    model: Path, tmp_path: Path
) -> None:
    folder = project(tmp_path / "p")
    lines = (folder / "train.jsonl").read_text().splitlines()
    (folder / "broken.jsonl").write_text("\n".join([*lines[:2], '{"prompt": "q9=", ', *lines[2:]]) + "\n")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"data": {"prompt_key": "question"}}, "has no column 'question' (the prompt column); its columns: prompt, answer, id"),
        ({"data": {"train": "broken.jsonl"}}, "cannot be read as JSONL: line 3 is not valid JSON"),
        ({"data": {"train": "missing.jsonl"}}, "data.train: dataset '" + str(folder / "missing.jsonl") + "' does not exist"),
        ({"reward": {"functions": ["rewards.py:needs_label"]}},
         "'rewards.py:needs_label' requires ['label'], which are neither 'prompts', 'completions', "
         "'completion_ids', 'truncated' nor dataset columns (answer, id)"),
        ({"reward": {"functions": ["no_such_module_xyz:fn"]}}, "cannot import module 'no_such_module_xyz'"),
        ({"reward": {"functions": ["nowhere.py:fn"]}}, "nowhere.py' does not exist (relative paths are looked up in"),
        ({"reward": {"functions": ["rewards.py:nope"]}}, "has no attribute 'nope'; its public callables: Path, aligned, boom"),
        ({"reward": {"functions": ["rewards.py:two_args"]}}, "cannot take the keyword 'completions'"),
        ({"logging": {"sinks": ["jsonl", "callbacks.py:Missing"]}},
         "callback 'callbacks.py:Missing': 'callbacks.py' has no attribute 'Missing'"),
        ({"data": {"train": "latin1.jsonl"}}, "latin1.jsonl' is not UTF-8 text: line 2, byte 16 is 0xe9"),
        ({"data": {"train": "twice.csv"}}, "twice.csv' names the column(s) ['answer'] more than once"),
        ({"logging": {"sinks": ["jsonl", "tensorboard"], "tensorboard_dir": str(folder / "rewards.py" / "tb")}},
         f"config key 'logging.tensorboard_dir': the folder {str(folder / 'rewards.py' / 'tb')!r} lies under "
         f"{str(folder / 'rewards.py')!r}, which is a file"),
    ]
    (folder / "latin1.jsonl").write_bytes(b'{"prompt": "q1=", "answer": "1", "id": 1}\n{"prompt": "caf\xe9", "answer": "1", "id": 2}\n')
    (folder / "twice.csv").write_text("prompt,answer,id,answer\nq1=,1,1,2\n")
    for tables, message in cases:
        assert message in _refused(folder, model, **tables)
    # a dataset without a reward for it is refused when the trainer is made
    with pytest.raises(ConfigError, match=r"'data.train' is set but the run has no reward"):
        Trainer(load_config(None, ["data.train=train.jsonl", f"output_dir={json.dumps(str(tmp_path / 'o'))}"]))


def test_a_reward_function_that_raises_fails_the_first_step_naming_it(model: Path, tmp_path: Path) -> None:
    folder = project(tmp_path / "p")
    out = folder / "out"
    config = load_config(write_config(folder / "run.toml", run_config(
        folder, model, out, steps=2, reward={"functions": ["rewards.py:aligned", "rewards.py:boom"]})))
    with Trainer(config, base_dir=folder) as trainer:
        with pytest.raises(StepFailedError) as info:
            trainer.train()
        assert trainer.step == 0
    err = info.value
    assert (err.stage, err.backend, err.step) == ("reward", "reward.functions", 1)
    assert isinstance(err.__cause__, RewardError)
    assert "reward function 'boom' raised ValueError: the grader crashed" in str(err)
    assert not (out / "metrics.jsonl").read_text(), "the failed step left metrics behind"
    assert latest_checkpoint(out) is None


def test_reward_functions_score_the_built_in_task_s_prompts(model: Path, tmp_path: Path) -> None:
    config = load_config(None, [
        f"output_dir={json.dumps(str(tmp_path / 'out'))}", f"model.path={json.dumps(str(model))}", "steps=1",
        "task.digits=1", "rollout.n=2", "rollout.max_new_tokens=2", "batch.prompts_per_step=2",
        'reward.functions=["verl_core.trainer.inputs.reward_functions:exact_match"]', "logging.progress=false",
        "logging.plot=false",
    ])
    with Trainer(config) as trainer:
        (step,) = trainer.train()
    assert "reward/exact_match/mean" in step and "reward/exact_match" not in step  # not the task's rule
    assert "data/epoch" not in step


def test_a_latin1_dataset_and_an_impossible_tensorboard_folder_are_one_typed_line_before_the_model(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """These used to end as "unexpected UnicodeDecodeError ... position 4" and "unexpected NotADirectoryError"
    after the model was built."""
    folder = project(tmp_path / "p")
    (folder / "latin1.jsonl").write_bytes(b'{"prompt": "q1=", "answer": "1", "id": 1}\n{"prompt": "\xe9", "id": 2}\n')
    (folder / "afile").write_text("a file")
    out = tmp_path / "out"
    base = ["steps=1", f"output_dir={out}", f"model.path={model}", 'reward.functions=["rewards.py:aligned"]',
            "logging.progress=false"]
    cases = {
        f"data.train={folder / 'latin1.jsonl'}": f"verl train: error: data.train: dataset {str(folder / 'latin1.jsonl')!r} "
        "is not UTF-8 text: line 2, byte 13 is 0xe9 (invalid continuation byte); save the file as UTF-8",
        f"logging.tensorboard_dir={folder / 'afile' / 'tb'}": "verl train: error: config key 'logging.tensorboard_dir': "
        f"the folder {str(folder / 'afile' / 'tb')!r} lies under {str(folder / 'afile')!r}, which is a file; "
        "name a folder that can be created",
    }
    for override, line in cases.items():
        args = [*base, f"data.train={folder / 'train.jsonl'}", 'logging.sinks=["jsonl", "tensorboard"]', override]
        assert main(["train", *args]) == 2
        assert capsys.readouterr().err == line + "\n"
        assert not out.exists(), "the run folder was claimed (and the model built) before the check"


def test_rows_left_out_for_long_prompts_are_reported_with_the_progress_bar_off(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = project(tmp_path / "p")
    long_rows = [{"prompt": f"q{i}=" + "x" * 8, "answer": str(i), "id": i} for i in (100, 101)]
    write_jsonl(folder / "train.jsonl", [*ROWS, *long_rows])
    write_jsonl(folder / "eval.jsonl", [*EVAL_ROWS, long_rows[0]])
    config = load_config(write_config(folder / "run.toml", run_config(
        folder, model, folder / "out", steps=2, data={"max_prompt_len": 4, "eval": "eval.jsonl"})))
    assert config.logging.progress is False
    with caplog.at_level(logging.WARNING, logger="verl_core.trainer.rl.trainer"), \
            Trainer(config, base_dir=folder) as trainer:
        history = trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("data.train: 7 prompts from") and "2 rows left out: their prompts are longer than "
               "data.max_prompt_len = 4 tokens (data.long_prompts = 'drop')" in w for w in warnings), warnings
    assert any(w.startswith("data.eval: 3 prompts from") and "1 rows left out" in w for w in warnings), warnings
    logged = [json.loads(ln) for ln in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    for m in (*history, *logged):
        assert (m["data/rows"], m["data/dropped_long_prompts"]) == (7, 2)
        assert (m["data/eval_rows"], m["data/eval_dropped_long_prompts"]) == (3, 1)


# ---------------------------------------------------------------------------------------- the example
def test_the_dataset_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).parents[2] / "examples" / "dataset"
    monkeypatch.chdir(tmp_path)  # `verl train examples/dataset/config.toml` from anywhere finds its files
    assert main(["train", str(example / "config.toml"), "steps=2", "logging.progress=false",
                 "logging.plot=false"]) == 0
    metrics = [json.loads(ln) for ln in (tmp_path / "runs" / "dataset_example" / "metrics.jsonl").read_text().splitlines()]
    for name in ("exact_match", "prefix_match", "same_length"):
        assert f"reward/{name}/mean" in metrics[0] and f"eval/reward/{name}/mean" in metrics[-1]
