"""Prompt datasets: every file format, chat templates, checks at load, the resumable data order."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets  # the data extra (scripts/setup.sh installs it)
import pytest

from verl_conformance.testkit import TinyModelSpec, tiny_model
from verl_core.kernel.batch import BatchMeta
from verl_core.kernel.errors import ConfigError
from verl_core.trainer.inputs.data import (
    DataConfig,
    PromptDataset,
    PromptLoader,
    PromptSampler,
    require_datasets,
)
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

datasets.disable_progress_bars()  # the writers below report progress otherwise

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}; {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ROWS = [{"prompt": f"q{i}", "answer": f"a{i}", "idx": i} for i in range(5)]


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    """The character-level tokenizer the hf rollout engine exposes, with a chat template."""
    t = load_tokenizer(tiny_model(TinyModelSpec(vocab_size=96, tied=True)))
    t.wrapped.chat_template = CHAT_TEMPLATE
    return t


@pytest.fixture
def cache(tmp_path: Path) -> str:
    return str(tmp_path / "hf-cache")


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_json(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    path.write_text(json.dumps(list(rows)))
    return str(path)


def write_parquet(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(list(rows)).to_parquet(str(path))
    return str(path)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(list(rows)).to_csv(str(path), index=False)
    return str(path)


def write_folder(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(list(rows)).save_to_disk(str(path))
    return str(path)


WRITERS: dict[str, tuple[str, Callable[[Path, Sequence[dict[str, Any]]], str]]] = {
    "jsonl": ("d.jsonl", write_jsonl),
    "json": ("d.json", write_json),
    "parquet": ("d.parquet", write_parquet),
    "csv": ("d.csv", write_csv),
    "save_to_disk": ("folder", write_folder),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_format_loads_prompts_and_columns(fmt: str, tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    name, write = WRITERS[fmt]
    ds = PromptDataset.load(write(tmp_path / name, ROWS), tok, cache_dir=cache)
    assert ds.prompts == tuple(r["prompt"] for r in ROWS)
    assert ds.columns == {"answer": tuple(r["answer"] for r in ROWS), "idx": tuple(range(5))}
    assert ds.column_names == ["answer", "idx"] and ds.dropped == 0 and len(ds) == 5
    batch = ds.to_batch([3, 1], group_ids=[7, 8])
    assert batch.extras == {"answer": ("a3", "a1"), "idx": (3, 1)}
    assert batch["group_ids"].tolist() == [7, 8]
    texts = [tok.decode([t for t, m in zip(r, k) if m]) for r, k in zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist())]
    assert texts == ["q3", "q1"]


def test_a_list_of_files_is_concatenated_in_order(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    b = write_parquet(tmp_path / "b.parquet", ROWS[2:])
    ds = PromptDataset.from_config(DataConfig(train=[a, b]), tok, cache_dir=cache)
    assert ds.prompts == tuple(r["prompt"] for r in ROWS)
    assert ds.columns["idx"] == tuple(range(5))
    assert ds.sources == (a, b)


def test_chat_messages_are_rendered_with_the_chat_template(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    rows = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}], "answer": "4"},
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"},
    ]
    ds = PromptDataset.load(write_parquet(tmp_path / "chat.parquet", rows), tok, cache_dir=cache)
    assert ds.prompts == ("system: be brief; user: 2+2?; assistant:", "user: hi; assistant:")
    batch = ds.to_batch([0], group_ids=[0])
    assert batch["prompt_ids"][0].tolist() == tok.encode(ds.prompts[0])


def test_chat_messages_need_a_chat_template(tmp_path: Path, cache: str) -> None:
    plain = load_tokenizer(tiny_model(TinyModelSpec(vocab_size=96, tied=True)))
    plain.wrapped.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="holds chat messages, but the tokenizer has no chat_template"):
        PromptDataset.load(path, plain, cache_dir=cache)


def test_chat_template_option_renders_text_prompts_as_a_user_message(
    tok: HFTokenizer, tmp_path: Path, cache: str
) -> None:
    rows = [{"question": "2+2?", "answer": "4"}, {"question": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "answer": "x"}]
    path = write_parquet(tmp_path / "q.parquet", rows[:1]), write_jsonl(tmp_path / "m.jsonl", rows[1:])
    ds = PromptDataset.from_config(DataConfig(train=list(path), prompt_key="question", chat_template=True), tok, cache_dir=cache)
    assert ds.prompts == ("user: 2+2?; assistant:", "system: s; user: hi; assistant:")  # messages as before
    assert ds.columns == {"answer": ("4", "x")}
    assert ds.longest_prompt == len(tok.encode("system: s; user: hi; assistant:"))
    plain = PromptDataset.from_config(DataConfig(train=path[0], prompt_key="question"), tok, cache_dir=cache)
    assert plain.prompts == ("2+2?",)  # off by default: text is used as written


def test_chat_template_option_needs_a_chat_template(tmp_path: Path, cache: str) -> None:
    plain = load_tokenizer(tiny_model(TinyModelSpec(vocab_size=96, tied=True)))
    plain.wrapped.chat_template = None
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigError, match=r"data.train: data.chat_template is true, but the tokenizer has no chat_template"):
        PromptDataset.from_config(DataConfig(train=path, chat_template=True), plain, cache_dir=cache)
    with pytest.raises(ConfigError, match=r"config key 'data.chat_template': expected true or false, got 'yes'"):
        DataConfig(train=path, chat_template="yes")  # type: ignore[arg-type]


def test_malformed_chat_message_names_the_row(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "ok"}, {"prompt": [{"role": "user", "text": "hi"}]}])
    with pytest.raises(ConfigError, match=r"'.*chat.jsonl' row 1: message 0 is .*'role': str, 'content': str"):
        PromptDataset.load(path, tok, cache_dir=cache)


def test_prompt_of_another_type_names_the_row(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": 12}])
    with pytest.raises(ConfigError, match=r"row 1: the prompt is 12; expected a string or a list of chat messages"):
        PromptDataset.load(path, tok, cache_dir=cache)


def test_missing_prompt_column_is_named_with_the_columns(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ConfigError, match=r"has no column 'prompt' .*its columns: question, answer; set data.prompt_key"):
        PromptDataset.load(path, tok, cache_dir=cache)
    ds = PromptDataset.from_config(DataConfig(train=path, prompt_key="question"), tok, cache_dir=cache)
    assert ds.prompts == ("q",) and ds.columns == {"answer": ("a",)}


def test_malformed_jsonl_names_the_line(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", oops}\n')
    with pytest.raises(ConfigError, match=r"'.*bad.jsonl' cannot be read as JSONL: line 3 is not valid JSON"):
        PromptDataset.load(str(path), tok, cache_dir=cache)


@pytest.mark.parametrize(("name", "content", "kind"), [
    ("bad.json", '[{"prompt": "a"}, {"prompt": ', "JSON"),
    ("bad.parquet", "not a parquet file at all", "PARQUET"),
    ("bad.csv", 'prompt,answer\n"a,1\nb,2,3,4\n', "CSV"),
])
def test_unreadable_files_are_one_config_error(
    name: str, content: str, kind: str, tok: HFTokenizer, tmp_path: Path, cache: str
) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=rf"'.*{name}' cannot be read as {kind}: \w+"):
        PromptDataset.load(str(tmp_path / name), tok, cache_dir=cache)


def test_empty_datasets_are_refused(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"'.*empty.jsonl' is empty"):
        PromptDataset.load(str(tmp_path / "empty.jsonl"), tok, cache_dir=cache)
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"'.*header.csv' has no rows"):
        PromptDataset.load(str(tmp_path / "header.csv"), tok, cache_dir=cache)


def test_unsupported_extension_and_missing_path(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    (tmp_path / "d.txt").write_text("q1\n")
    with pytest.raises(ConfigError, match=r"unsupported extension '.txt'; supported: .jsonl, .json, .parquet, .csv"):
        PromptDataset.load(str(tmp_path / "d.txt"), tok, cache_dir=cache)
    with pytest.raises(ConfigError, match=r"'.*nowhere.jsonl' does not exist"):
        PromptDataset.load(str(tmp_path / "nowhere.jsonl"), tok, cache_dir=cache)


def test_folder_of_splits_asks_for_one_split(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    one = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"holds the splits \['test', 'train'\] .*e.g. '.*dd/train'"):
        PromptDataset.load(str(tmp_path / "dd"), tok, cache_dir=cache)
    assert len(PromptDataset.load(str(tmp_path / "dd" / "train"), tok, cache_dir=cache)) == 5


def test_files_with_different_columns_and_reserved_names(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "answer": "1"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "label": "1"}])
    with pytest.raises(ConfigError, match=r"'.*b.jsonl' has the columns \['label', 'prompt'\] but .*concatenated files need the same columns"):
        PromptDataset.load([a, b], tok, cache_dir=cache)
    c = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "completions": "x"}])
    with pytest.raises(ConfigError, match=r"has the column\(s\) \['completions'\], names reward functions receive"):
        PromptDataset.load(c, tok, cache_dir=cache)


def test_long_prompts_are_dropped_and_counted(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    rows = [{"prompt": "x" * k, "idx": k} for k in (2, 7, 3, 9, 4)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = PromptDataset.from_config(DataConfig(train=path, max_prompt_len=4), tok, cache_dir=cache)
    assert ds.columns["idx"] == (2, 3, 4) and ds.dropped == 2
    assert ds.stats() == {"data/rows": 3.0, "data/dropped_long_prompts": 2.0}
    with pytest.raises(ConfigError, match=r"all 5 prompts of '.*d.jsonl' are longer than max_prompt_len = 1"):
        PromptDataset.load(path, tok, max_prompt_len=1, cache_dir=cache)


def test_long_prompt_error_names_the_file_and_row(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "ab"}, {"prompt": "cd"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "ef"}, {"prompt": "too long"}])
    cfg = DataConfig(train=[a, b], max_prompt_len=4, long_prompts="error")
    with pytest.raises(ConfigError, match=r"data.train: '.*b.jsonl' row 1: the prompt has 8 tokens, more than max_prompt_len = 4"):
        PromptDataset.from_config(cfg, tok, cache_dir=cache)


def test_data_config_checks_its_values() -> None:
    assert DataConfig().train_paths == [] and DataConfig(train="a.jsonl", eval=["b", "c"]).eval_paths == ["b", "c"]
    with pytest.raises(ConfigError, match=r"config key 'data.max_prompt_len' = 0 is out of range; allowed: >= 1"):
        DataConfig(train="a.jsonl", max_prompt_len=0)
    with pytest.raises(ConfigError, match=r"config key 'data.long_prompts': 'cut' is not valid; choices: 'drop', 'error'"):
        DataConfig(train="a.jsonl", long_prompts="cut")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="config key 'data.train' is an empty list"):
        DataConfig(train=[])
    with pytest.raises(ConfigError, match=r"'data.eval' is an empty list; .* 'data.eval=\"\"' unsets"):
        DataConfig(train="a.jsonl", eval=[])
    assert DataConfig(train="a.jsonl", eval="").eval_paths == []  # what data.eval="" gives: no evaluation set
    with pytest.raises(ConfigError, match=r"config key 'data.eval\[1\]' = '' is not valid; allowed: a non-empty path"):
        DataConfig(train="a.jsonl", eval=["a", ""])
    with pytest.raises(ConfigError, match="config key 'data.prompt_key' = '' is not valid; allowed: a non-empty column name"):
        DataConfig(train="a.jsonl", prompt_key="")
    with pytest.raises(ConfigError, match="data.eval is not set"):
        PromptDataset.from_config(DataConfig(train="a.jsonl"), load_tokenizer(tiny_model(TinyModelSpec(vocab_size=96, tied=True))), split="eval")


def test_missing_datasets_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install 'verl-core\[data\]'"):
        require_datasets()


def test_importing_the_modules_does_not_import_datasets() -> None:
    code = (
        "import sys\n"
        "import verl_core.trainer.inputs.data, verl_core.trainer.inputs.rewards, verl_core.trainer.inputs.reward_functions\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'datasets', 'pyarrow', 'pandas', 'transformers'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- the data order
def test_order_is_a_function_of_seed_and_epoch() -> None:
    a, b = PromptSampler(50, seed=3), PromptSampler(50, seed=3)
    assert a.order(0) == b.order(0) and a.order(4) == b.order(4)
    assert sorted(a.order(0)) == list(range(50)) and a.order(0) != a.order(1)
    assert PromptSampler(50, seed=4).order(0) != a.order(0)
    assert PromptSampler(50, seed=3, shuffle=False).order(2) == list(range(50))
    drawn = PromptSampler(50, seed=3).take(120)  # two epochs and a part
    assert drawn == a.order(0) + a.order(1) + a.order(2)[:20]


def test_loader_continues_exactly_after_load_state_dict(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    rows = [{"prompt": f"q{i}", "idx": i} for i in range(7)]
    ds = PromptDataset.load(write_jsonl(tmp_path / "d.jsonl", rows), tok, cache_dir=cache)
    first = PromptLoader(ds, seed=11)
    for step in range(3):
        first.batch(step, 3)
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    assert (state["epoch"], state["index"]) == (1, 2)
    expected = [first.batch(step, 3) for step in range(3, 8)]
    resumed = PromptLoader(ds, seed=11)
    resumed.load_state_dict(state)
    got = [resumed.batch(step, 3) for step in range(3, 8)]
    for e, g in zip(expected, got):
        assert g.extras == e.extras
        assert g["group_ids"].tolist() == e["group_ids"].tolist()
        assert g["prompt_ids"].tolist() == e["prompt_ids"].tolist()
    assert got[-1].meta.step == 7
    # a fresh loader replays the whole order deterministically
    again = PromptLoader(ds, seed=11)
    assert [again.batch(s, 3).extras["idx"] for s in range(8)][3:] == [e.extras["idx"] for e in expected]


def test_group_ids_are_unique_for_the_run(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    ds = PromptDataset.load(write_jsonl(tmp_path / "d.jsonl", ROWS[:3]), tok, cache_dir=cache)
    loader = PromptLoader(ds, seed=0)
    meta = BatchMeta(temperature=0.7, pad_token_id=tok.pad_token_id)
    batches = [loader.batch(s, n, meta=meta) for s, n in enumerate((2, 5, 1, 4))]  # n > rows crosses epochs
    ids = [g for b in batches for g in b["group_ids"].tolist()]
    assert ids == list(range(12))
    assert batches[1].meta.temperature == 0.7 and batches[1].meta.step == 1
    # every epoch serves every row once
    idx = [i for b in batches for i in b.extras["idx"]]
    assert sorted(idx[:3]) == sorted(idx[3:6]) == sorted(idx[6:9]) == [0, 1, 2]


def test_resuming_with_other_data_is_refused() -> None:
    state = PromptSampler(10, seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"saved for 10 rows, seed 1, shuffle True; now 12 rows, seed 1"):
        PromptSampler(12, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="data sampler state .* is malformed"):
        PromptSampler(10, seed=1).load_state_dict({"epoch": 0})


def test_eval_batches_cover_every_row_in_order(tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    ds = PromptDataset.load(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, cache_dir=cache)
    batches = list(ds.batches(2, group_id_base=1000))
    assert [b.extras["idx"] for b in batches] == [(0, 1), (2, 3), (4,)]
    assert batches[2]["group_ids"].tolist() == [1004]


@pytest.mark.parametrize("header", ["prompt,answer,answer", "answer,prompt,idx,answer", "\ufeffprompt,x,x,y,y"])
def test_a_csv_naming_a_column_twice_is_refused(header: str, tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    """The CSV parser would rename the second column ``answer.1`` silently; the file is refused instead."""
    path = tmp_path / "d.csv"
    cells = len(header.split(","))
    path.write_text(f"\n{header}\n" + ",".join(["q1"] * cells) + "\n", encoding="utf-8")
    repeated = sorted({n for n in header.lstrip("\ufeff").split(",") if header.count(n) > 1})
    with pytest.raises(ConfigError, match=rf"data.train: dataset '.*d.csv' names the column\(s\) {re.escape(str(repeated))} "
                                          r"more than once in its header \(line 2\)"):
        PromptDataset.load(str(path), tok, cache_dir=cache, where="data.train")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_file_that_is_not_utf8_names_its_line_and_byte(suffix: str, tok: HFTokenizer, tmp_path: Path, cache: str) -> None:
    rows = {".jsonl": b'{"prompt": "q1"}\n{"prompt": "q2"}\n{"prompt": "caf\xe9"}\n',
            ".json": b'[{"prompt": "q1"},\n{"prompt": "q2"},\n{"prompt": "caf\xe9"}]\n',
            ".csv": b"prompt\nq1\ncaf\xe9\n"}[suffix]
    path = tmp_path / f"d{suffix}"
    path.write_bytes(rows)
    byte = rows.splitlines()[2].index(b"\xe9") + 1
    with pytest.raises(ConfigError, match=rf"data.eval: dataset '.*d{suffix}' is not UTF-8 text: line 3, byte {byte} is "
                                          r"0xe9 \(invalid continuation byte\); save the file as UTF-8"):
        PromptDataset.load(str(path), tok, cache_dir=cache, where="data.eval")
    path.write_bytes(rows.replace(b"\xe9", b"e").decode().encode("utf-16"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(it starts with a UTF-16 byte-order mark\): line 1, byte 1"):
        PromptDataset.load(str(path), tok, cache_dir=cache)
    path.write_bytes(b"\xef\xbb\xbf" + rows.replace(b"\xe9", b"e"))  # UTF-8 with a byte-order mark loads
    expected = ("q1", "cafe") if suffix == ".csv" else ("q1", "q2", "cafe")
    assert PromptDataset.load(str(path), tok, cache_dir=cache).prompts == expected
