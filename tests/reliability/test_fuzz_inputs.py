"""Hypothesis-generated datasets, reward-function results, sink settings and export targets.

Each input may only give a correct result or a typed error (a ``VerlError`` subclass) whose
message names the config key or the file; and nothing is lost: no file outside the run's own
folder (or the folder the input names for writing) is deleted or changed.

* Datasets: rows of random columns and column types (text, numbers, NaN, None, lists, chat
  messages), written as JSONL, JSON, CSV or Parquet in UTF-8, UTF-8 with a byte-order mark, UTF-16
  or Latin-1, some cut short or with junk appended, sometimes with a repeated CSV column; loaded
  with a random length limit and policy. A file written faithfully (UTF-8, text prompts, one type
  per column) must load exactly: the kept prompts are those within the limit, in order.
* Reward-function results: lists and tuples of the right or a wrong length holding floats, NaN,
  inf, huge integers, None, strings, bools, fractions, decimals, complex numbers, NumPy scalars,
  tensors; tensors and arrays of any rank and dtype; non-sequences. Accepted exactly when an
  oracle here says it is one finite number per completion; otherwise ``RewardError`` naming the
  function.
* Sink settings: ``logging.sinks`` entries (built-ins, callbacks, junk, repeats), TensorBoard
  folders (new, existing, a file, under a file), W&B modes and projects, opened and used when valid.
* Export targets: paths of 1-4 parts through a run folder, its checkpoint, symbolic links to
  them, a user's folder and a file; the export succeeds only outside every run and checkpoint
  folder, and the run's checkpoint still verifies.

Generated inputs (``max_examples``): 120 datasets + 300 reward results + 80 sink settings + 30
export targets = 530 (about 40 s on two busy cores, most of it the exports).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import numbers
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reliability_helpers import tiny_config

from verl_core import ConfigError, RewardError, VerlError
from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.trainer import Trainer, latest_checkpoint, verify_checkpoint
from verl_core.trainer.inputs.data import PromptDataset
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import prompt_batch
from verl_core.trainer.inputs.tiny_model import char_tokenizer
from verl_core.trainer.run.export import export_checkpoint
from verl_core.trainer.run.folder import MARKER_FILE
from verl_core.trainer.sinks import (
    BUILTIN_SINKS,
    METRICS_FILE,
    MetricSinks,
    SinkConfig,
    check_sinks,
)

datasets.disable_progress_bars()
pytestmark = [pytest.mark.slow]
FILES = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return HFTokenizer(char_tokenizer(96), 96)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (symbolic links not followed) -> SHA-256 of its bytes."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def attempt(call: Callable[[], Any]) -> tuple[Any, VerlError | None]:
    """``call()``'s result, or the VerlError it raised (any other exception fails the test)."""
    try:
        return call(), None
    except VerlError as e:
        return None, e


def kept(before: dict[str, str], after: dict[str, str]) -> None:
    """No file of ``before`` was deleted or changed."""
    lost = sorted(k for k in before if after.get(k) != before[k])
    assert not lost, f"files deleted or changed: {lost}"


# ---------------------------------------------------------------------------------------- datasets
COLUMN_TYPES = ("text", "int", "float", "bool", "ints", "none", "messages", "mixed")
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)  # no lone surrogates


def column_values(kind: str) -> st.SearchStrategy[Any]:
    return {
        "text": TEXT,
        "int": st.integers(-(2**40), 2**40),
        "float": st.floats(allow_nan=True, allow_infinity=True),
        "bool": st.booleans(),
        "ints": st.lists(st.integers(0, 9), max_size=3),
        "none": st.none(),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
                             max_size=2),
        "mixed": st.one_of(TEXT, st.integers(), st.none(), st.booleans()),
    }[kind]


@st.composite
def dataset_files(draw: st.DrawFn) -> dict[str, Any]:
    """A dataset: its rows, how it is written and how it is loaded."""
    names = ["answer", "idx", "label", "Answer", "é", "a,b", "answer.1"] * 3 + ["completions"]
    extra = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
    prompt_kind = draw(st.sampled_from(["text"] * 12 + list(COLUMN_TYPES)))
    column_kinds = st.sampled_from(["text", "int", "bool", "ints"] * 2 + list(COLUMN_TYPES))
    kinds = {"prompt": prompt_kind, **{c: draw(column_kinds) for c in extra}}
    n = draw(st.sampled_from([0, 1, 1, 2, 2, 3, 4, 5, 6]))
    rows = []
    for _ in range(n):
        row = {c: draw(column_values(k)) for c, k in kinds.items()}
        if prompt_kind == "text" and draw(st.integers(0, 3)):
            row["prompt"] = draw(st.text(st.characters(codec="ascii", categories=("L", "N", "P")), min_size=1,
                                         max_size=10))
        if draw(st.integers(0, 29)) == 0:  # a row missing a column
            row.pop(draw(st.sampled_from(sorted(row))))
        rows.append(row)
    return {
        "rows": rows, "kinds": kinds,
        "format": draw(st.sampled_from([".jsonl", ".json", ".csv", ".parquet"])),
        "encoding": draw(st.sampled_from(["utf-8"] * 8 + ["utf-8-sig", "utf-16", "latin-1"])),
        "mutation": draw(st.sampled_from([None] * 10 + ["cut", "junk", "repeat column"])),
        "cut": draw(st.floats(0, 1)),
        "max_prompt_len": draw(st.none() | st.integers(1, 12)),
        "long_prompts": draw(st.sampled_from(["drop", "error"])),
        "chat_template": draw(st.booleans()) and draw(st.booleans()),
    }


def render(spec: dict[str, Any]) -> bytes | None:
    """The file's bytes (None: the writer cannot write these rows, e.g. Parquet of mixed types)."""
    rows, fmt = spec["rows"], spec["format"]
    if fmt == ".parquet":
        buf = io.BytesIO()
        try:
            datasets.Dataset.from_list(rows).to_parquet(buf)
        except Exception:
            return None
        return buf.getvalue()
    if fmt == ".jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif fmt == ".json":
        text = json.dumps(rows)
    else:
        names = list(dict.fromkeys(k for r in rows for k in r)) or list(spec["kinds"])
        if spec["mutation"] == "repeat column" and names:
            names.append(names[-1])
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(names)
        for r in rows:
            writer.writerow([r.get(k, "") for k in names])
        text = out.getvalue()
    data = text.encode(spec["encoding"], errors="replace")
    if spec["mutation"] == "cut":
        data = data[: int(len(data) * spec["cut"])]
    elif spec["mutation"] == "junk":
        data += b"\x00\xff{not data\xe9"
    return data


def faithful(spec: dict[str, Any]) -> bool:
    """Written exactly and loadable exactly: UTF-8, no mutation, text prompts, one type per column, no
    reserved or repeated names, and not CSV (whose parser turns "1" into a number)."""
    return (
        spec["format"] in (".jsonl", ".json", ".parquet") and spec["encoding"] in ("utf-8", "utf-8-sig")
        and spec["mutation"] is None and not spec["chat_template"] and bool(spec["rows"])
        and all(isinstance(r.get("prompt"), str) and r["prompt"] for r in spec["rows"])
        and all(set(r) == set(spec["kinds"]) for r in spec["rows"])
        and all(k in ("text", "int", "bool", "ints") for k in spec["kinds"].values())
        and "completions" not in spec["kinds"]
    )


@given(spec=dataset_files())
@settings(FILES, max_examples=120)
def test_any_dataset_file_loads_exactly_or_is_refused_naming_it(
    spec: dict[str, Any], tok: HFTokenizer, tmp_path: Path, tally: Counter[str]
) -> None:
    data = render(spec)
    assume(data is not None)
    assert data is not None
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example (hypothesis shares tmp_path)
    path = folder / f"train{spec['format']}"
    path.write_bytes(data)
    (folder / "neighbour.txt").write_text("a user's file")
    before = snapshot(folder)
    ds, err = attempt(lambda: PromptDataset.load(
        str(path), tok, max_prompt_len=spec["max_prompt_len"], long_prompts=spec["long_prompts"],
        chat_template=spec["chat_template"], cache_dir=str(tmp_path / "cache"), where="data.train",
    ))
    kept(before, snapshot(folder))
    assert snapshot(folder).keys() == before.keys()
    if err is not None:
        tally["fuzz/dataset file"] += 1
        assert isinstance(err, ConfigError), repr(err)
        msg = str(err)  # names the file, or the config key that refuses every file (a column, the chat template)
        assert msg.startswith("data.train: ") and any(n in msg for n in (repr(str(path)), "data.train: column",
                                                                       "data.chat_template")), msg
        assert not faithful(spec) or spec["max_prompt_len"] is not None, f"a faithful file was refused: {err}"
        return
    tally["accepted/dataset file"] += 1
    assert all(isinstance(p, str) and p for p in ds.prompts)
    assert all(len(v) == len(ds) for v in ds.columns.values())
    assert ds.longest_prompt <= (spec["max_prompt_len"] or ds.longest_prompt)
    if faithful(spec):
        tally["accepted/dataset file (compared exactly)"] += 1
        limit = spec["max_prompt_len"]
        prompts = [r["prompt"] for r in spec["rows"]]
        fits = [p for p in prompts if limit is None or len(tok.encode(p)) <= limit]
        assert spec["long_prompts"] == "drop" or len(fits) == len(prompts)
        assert list(ds.prompts) == fits and ds.dropped == len(prompts) - len(fits)
        assert sorted(ds.columns) == sorted(k for k in spec["kinds"] if k != "prompt")
        for k, kind in spec["kinds"].items():
            if kind == "text" and k != "prompt":
                assert list(ds.columns[k]) == [r[k] for r in spec["rows"] if r["prompt"] in fits]


# ---------------------------------------------------------------------------------------- reward results
SIZE = 3
ELEMENTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**40), 10**40), st.just(10**400), st.none(),
    st.text(max_size=3), st.booleans(), st.fractions(max_denominator=7), st.just(Decimal("0.5")),
    st.complex_numbers(max_magnitude=2, allow_nan=False), st.just(np.float32(0.25)), st.just(np.int64(2)),
    st.just(np.float64("nan")), st.just(torch.tensor(1.0)), st.lists(st.floats(0, 1), max_size=2),
    st.sampled_from([1e38, 3.5e38, -1e308, 5e-324]),
)
LENGTHS = st.sampled_from([SIZE] * 4 + [0, SIZE - 1, SIZE + 1])
TENSOR_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.bfloat16])


@st.composite
def reward_results(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["numbers", "numbers", "list", "list", "tuple", "tensor", "array", "scalar", "other"]))
    if kind == "numbers":  # mostly valid: real numbers of any type, now and then one that is not
        items = [draw(st.one_of(st.floats(-1e6, 1e6), st.integers(-5, 5), st.booleans(), st.fractions(max_denominator=5),
                                st.just(np.float32(0.25)), st.just(np.int64(-2)))) for _ in range(SIZE)]
        if draw(st.integers(0, 3)) == 0:
            items[draw(st.integers(0, SIZE - 1))] = draw(ELEMENTS)
        return items
    if kind in ("list", "tuple"):
        items = draw(st.lists(ELEMENTS, min_size=draw(LENGTHS), max_size=SIZE + 1))
        return items if kind == "list" else tuple(items)
    if kind == "tensor":
        shape = draw(st.sampled_from([(SIZE,), (SIZE,), (SIZE - 1,), (), (SIZE, 1), (1, SIZE), (0,)]))
        values = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=math.prod(shape),
                               max_size=math.prod(shape)))
        return torch.tensor(values, dtype=torch.float32).reshape(shape).to(draw(TENSOR_DTYPES))
    if kind == "array":
        return draw(st.sampled_from([
            np.array([0.5, 1.0, 2.0]), np.array([1, 2, 3], dtype=np.int8), np.array(["a", "b", "c"]),
            np.array([0.5, np.nan, 1.0]), np.array([[1.0, 2.0, 3.0]]), np.array([True, False, True]),
            np.array([1.0, None, 2.0], dtype=object),
        ]))
    if kind == "scalar":
        return draw(ELEMENTS)
    return draw(st.sampled_from([{"a": 1.0}, {0.5, 1.0, 2.0}, iter([1.0, 2.0, 3.0]), "0.5", b"abc", object()]))


def oracle(result: Any) -> list[float] | None:
    """The scores a reward result stands for (None: it must be refused): a sequence of SIZE real numbers,
    each finite as a float and within float32."""
    if isinstance(result, (torch.Tensor, np.ndarray)):
        if result.ndim != 1:
            return None
        items: list[Any] = result.tolist()
    elif isinstance(result, (list, tuple)):
        items = list(result)
    else:
        return None
    if len(items) != SIZE:
        return None
    out = []
    for v in items:
        if not isinstance(v, (bool, int, float, Fraction, np.integer, np.floating)):
            return None
        try:
            f = float(v)
        except OverflowError:
            return None
        if not math.isfinite(f) or abs(f) > float(np.finfo(np.float32).max):
            return None
        out.append(f)
    return out


@given(result=reward_results())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_reward_result_is_scored_exactly_or_refused_naming_the_function(
    result: Any, tok: HFTokenizer, tally: Counter[str]
) -> None:
    batch = prompt_batch(["a", "b", "c"], tok, group_ids=[0, 1, 2], extras={"answer": ["1", "2", "3"]})
    ids = torch.tensor([[5, 6, tok.eos_token_id]] * SIZE)
    batch = batch.update(response_ids=ids, response_mask=torch.ones_like(ids, dtype=torch.bool))

    def grader(completions: list[str], **kwargs: Any) -> Any:
        return result

    expected = oracle(result)
    scored, err = attempt(lambda: RewardFunctions([grader], tok).score(batch))
    if err is not None:
        tally["fuzz/reward function result"] += 1
        assert isinstance(err, RewardError), repr(err)
        assert expected is None, f"{result!r} is one finite number per completion but was refused: {err}"
        assert "reward function 'grader'" in str(err) or "weighted reward of sample" in str(err), str(err)
        return
    assert expected is not None, f"{result!r} was accepted"
    assert list(scored.extras["reward/grader"]) == expected
    assert scored["scores"].tolist() == torch.tensor(expected, dtype=torch.float32).tolist()
    assert all(isinstance(v, float) for v in scored.extras["reward/grader"])
    assert all(isinstance(v, numbers.Real) for v in scored["scores"].tolist())


# ---------------------------------------------------------------------------------------- sink settings
VALID_ENTRIES = (*BUILTIN_SINKS, "cb.py:Record", "cb.py:Missing", "missing_module_xyz:Cb", "a:b:c")
ENTRIES = st.sampled_from([*VALID_ENTRIES, "JSONL", "", "nope", "cb.py", ":Cb", "cb.py:", "cb.py:1x"])
TB_DIRS = st.sampled_from(["", "tb", "afile", "afile/tb", "keep", "keep/tb", "run/tb", "new/deeper/tb", "run"])
CALLBACK = (
    "from pathlib import Path\n"
    "class Record:\n"
    "    def on_step_end(self, step, metrics):\n"
    "        (Path(__file__).parent / 'steps.txt').open('a').write(f'{step}\\n')\n"
)


@st.composite
def sink_settings(draw: st.DrawFn) -> dict[str, Any]:
    good = st.sampled_from(["jsonl", "tensorboard", "cb.py:Record"])
    sinks: Any = draw(st.lists(good, max_size=3, unique=True) | st.lists(good | ENTRIES, max_size=4)
                      | st.sampled_from(["jsonl", None, 3]))
    return {
        "sinks": sinks, "tensorboard_dir": draw(TB_DIRS),
        "wandb_mode": draw(st.sampled_from(["offline"] * 4 + ["online", "disabled", "Offline", ""])),
        "wandb_project": draw(st.sampled_from(["verl"] * 4 + [""])),
    }


@given(setting=sink_settings())
@settings(FILES, max_examples=80)
def test_any_sink_setting_opens_and_logs_or_is_refused_naming_the_key(
    setting: dict[str, Any], tmp_path: Path, tally: Counter[str]
) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example (hypothesis shares tmp_path)
    (root / "keep").mkdir()
    (root / "keep" / "notes.txt").write_text("a user's notes")
    (root / "afile").write_text("a file")
    (root / "cb.py").write_text(CALLBACK)
    out = root / "run"
    before = snapshot(root)
    tb = setting["tensorboard_dir"]
    entries = setting["sinks"]
    valid = (
        isinstance(entries, list) and all(e in VALID_ENTRIES for e in entries) and len(set(entries)) == len(entries)
        and setting["wandb_mode"] in ("offline", "online", "disabled") and bool(setting["wandb_project"])
    )

    def use() -> SinkConfig:
        config = SinkConfig(sinks=entries, tensorboard_dir=str(root / tb) if tb else "",
                            wandb_mode=setting["wandb_mode"], wandb_project=setting["wandb_project"])
        check_sinks(out, config)
        if "wandb" not in config.sinks:  # W&B itself is not what is fuzzed here (and starts slowly)
            sinks = MetricSinks.open(out, config, run_name="run", base_dir=root)
            sinks.log_step(1, {"reward/mean": 0.5, "note": "text"})
            sinks.close()
        return config

    config, err = attempt(use)
    after = snapshot(root)
    kept(before, after)
    if err is not None:
        tally["fuzz/sink setting"] += 1
        assert isinstance(err, ConfigError), repr(err)
        msg = str(err)
        assert any(k in msg for k in ("'logging.sinks'", "'logging.tensorboard_dir'", "'output_dir'",
                                      "'logging.wandb_mode'", "'logging.wandb_project'")), msg
        assert after.keys() == before.keys(), "a refused setting wrote files"
        return
    tally["accepted/sink setting"] += 1
    assert valid, f"{setting} was accepted"
    if "wandb" in config.sinks:
        return
    if "jsonl" in config.sinks:
        assert [json.loads(ln)["step"] for ln in (out / METRICS_FILE).read_text().splitlines()] == [1]
    if "tensorboard" in config.sinks:
        folder = root / tb if tb else out / "tensorboard"
        assert any(p.name.startswith("events.out.tfevents") for p in folder.iterdir())
    if "cb.py:Record" in config.sinks:
        assert (root / "steps.txt").read_text() == "1\n"
        (root / "steps.txt").unlink()


# ---------------------------------------------------------------------------------------- export targets
PARTS = st.sampled_from(["run", "checkpoints", "step-000001", "actor", "model", "user", "afile", "link", "runlink",
                         "hf", "new", "..", "."])


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with one checkpoint, a user's folder, a file and links into the run, side by side."""
    root = tmp_path_factory.mktemp("exports")
    with Trainer(tiny_config(root / "run", "steps=1")) as trainer:
        trainer.train()
    (root / "user").mkdir()
    (root / "user" / "notes.txt").write_text("a user's notes")
    (root / "afile").write_text("a file")
    ckpt = latest_checkpoint(root / "run")
    assert ckpt is not None
    (root / "link").symlink_to(ckpt, target_is_directory=True)
    (root / "runlink").symlink_to(root / "run", target_is_directory=True)
    return root


def inside_a_run(path: Path) -> bool:
    """Whether ``path`` lies in a run folder or a checkpoint (found here by their marker files)."""
    return any((p / MARKER_FILE).exists() or (p / "trainer_state.json").exists() or (p / "manifest.json").exists()
               for p in (path, *path.parents) if p.is_dir())


@given(parts=st.lists(PARTS, min_size=1, max_size=4))
@settings(FILES, max_examples=30)
def test_any_export_target_is_written_outside_runs_or_refused_naming_it(
    parts: list[str], sandbox: Path, tally: Counter[str]
) -> None:
    out = sandbox.joinpath(*parts)
    resolved = out.resolve()
    assume(resolved == sandbox.resolve() or sandbox.resolve() in resolved.parents)  # stay in the sandbox
    ckpt = latest_checkpoint(sandbox / "run")
    assert ckpt is not None
    before = snapshot(sandbox)
    under_file = any(p.exists() and not p.is_dir() for p in resolved.parents)
    free = not resolved.exists() or (resolved.is_dir() and not any(resolved.iterdir()))
    written, err = attempt(lambda: export_checkpoint(sandbox / "run", out))
    after = snapshot(sandbox)
    kept(before, after)
    if err is not None:
        tally["fuzz/export target"] += 1
        assert isinstance(err, ConfigError), repr(err)
        assert f"export folder {str(out)!r}" in str(err), str(err)
        assert under_file or not free or inside_a_run(resolved), f"{out} is a valid target but was refused: {err}"
        assert after.keys() == before.keys(), "a refused export wrote files"
        return
    tally["accepted/export target"] += 1
    assert not under_file and free and not inside_a_run(resolved.parent), f"{out} was accepted"
    assert (written / "model.safetensors").is_file() and (written / "config.json").is_file()
    new = [k for k in after if k not in before]
    assert all((sandbox / k).resolve().is_relative_to(resolved) for k in new), new
    verify_checkpoint(ckpt)
