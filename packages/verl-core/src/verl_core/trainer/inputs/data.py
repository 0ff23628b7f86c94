"""Prompt datasets from the user's files: loading, checking, a resumable data order, prompt batches.

* :class:`DataConfig`: which files (``data.train`` / ``data.eval``), the prompt column, the prompt
  length policy and shuffling.
* :class:`PromptDataset`: the rows of one or more JSONL, JSON, Parquet or CSV files, or folders
  written by ``datasets``' ``save_to_disk``, loaded with the ``datasets`` library (the ``data``
  extra) and checked at load: every problem is one :class:`~verl_core.kernel.errors.ConfigError` before
  any training step. The prompt column holds text, or chat messages rendered with the tokenizer's
  chat template; every other column travels with its sample as a per-sample extra of the batch
  (and reaches reward functions as a keyword argument).
* :class:`PromptSampler`: the data order, shuffled per epoch as a function of (seed, epoch), with a
  position (epoch, index) that a checkpoint saves so a resumed run continues the order exactly.
* :class:`PromptLoader`: the prompt :class:`~verl_core.kernel.batch.TensorBatch` of each step.

The rows are held in memory as Python values (prompt datasets for RL are small next to the model).
``datasets`` is imported inside the functions that load files, so importing this module does not
import it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.convert import Check, Ge, check_fields
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.trainer.inputs.tasks import prompt_batch

__all__ = [
    "FORMATS",
    "RESERVED_COLUMNS",
    "DataConfig",
    "LongPromptPolicy",
    "PromptDataset",
    "PromptLoader",
    "PromptSampler",
    "check_dataset_files",
    "require_datasets",
]

LongPromptPolicy = Literal["drop", "error"]
"""What happens to a prompt longer than ``max_prompt_len`` tokens: ``drop`` leaves the row out and
counts it (:attr:`PromptDataset.dropped`); ``error`` refuses the dataset, naming the row."""

FORMATS: Final = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> ``datasets`` builder; a folder is read with ``datasets.load_from_disk``."""

_TEXT_FORMATS: Final = (".jsonl", ".json", ".csv")  # read as UTF-8 text
_UTF8_BLOCK: Final = 1 << 24

RESERVED_COLUMNS: Final = ("prompts", "completions", "completion_ids", "truncated")
"""Column names a dataset may not use: reward functions get these keywords for each sample's texts,
response ids and truncation (:data:`verl_core.trainer.inputs.rewards.SAMPLE_KEYWORDS`)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The user's prompt dataset.

    Attributes:
        train: A file or ``save_to_disk`` folder, or a list of them (their rows concatenated in the
            given order). Files: ``.jsonl``, ``.json``, ``.parquet``, ``.csv``. Empty = no dataset
            (the built-in task supplies prompts).
        eval: The evaluation set, in the same forms (``None`` = none); read in order, never shuffled.
        prompt_key: Column holding each prompt: a string, or a list of chat messages
            (``{"role": ..., "content": ...}``) rendered with the tokenizer's chat template and
            the generation prompt appended.
        chat_template: Render text prompts through the tokenizer's chat template too, each as one
            user message (``[{"role": "user", "content": text}]``) with the generation prompt
            appended: a column of plain questions becomes chat prompts for an instruction-tuned
            model. Needs a tokenizer with a chat template.
        response_key: Column holding reference responses (for supervised fine-tuning; RL runs
            pass it along like any other column).
        max_prompt_len: Longest prompt in tokens (after the chat template); ``None`` = no limit.
        long_prompts: ``drop`` (leave longer prompts out and count them) or ``error`` (refuse
            the dataset, naming the first such row).
        shuffle: Shuffle the training rows every epoch (with the run seed; deterministic).
        eval_every: Steps between evaluations on ``eval`` (0 = only after the last step; the
            last step is always evaluated).
        eval_n: Responses per evaluation prompt: 1 = one greedy response (the default); more =
            that many sampled with the rollout's temperature, top-p and top-k.
    """

    train: str | list[Annotated[str, Check(bool, "a non-empty path")]] = ""
    eval: str | list[Annotated[str, Check(bool, "a non-empty path")]] | None = None
    prompt_key: Annotated[str, Check(bool, "a non-empty column name")] = "prompt"
    chat_template: bool = False
    response_key: Annotated[str, Check(bool, "a non-empty column name")] = "response"
    max_prompt_len: Annotated[int, Ge(1)] | None = None
    long_prompts: LongPromptPolicy = "drop"
    shuffle: bool = True
    eval_every: Annotated[int, Check(lambda v: v >= 0, ">= 0 (0 = only after the last step)")] = 0
    eval_n: Annotated[int, Ge(1)] = 1

    def __post_init__(self) -> None:
        check_fields(self, prefix="data.")
        for name in ("train", "eval"):
            if getattr(self, name) == []:
                raise ConfigError(f"config key 'data.{name}' is an empty list; give at least one path, or leave "
                                  f"the key out for none (on the command line: 'data.{name}=\"\"' unsets a "
                                  f"config file's value)")

    @property
    def train_paths(self) -> list[str]:
        """``train`` as a list (empty when no dataset is configured)."""
        return _as_list(self.train)

    @property
    def eval_paths(self) -> list[str]:
        """``eval`` as a list (empty when there is no evaluation set)."""
        return _as_list(self.eval)


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None or value == "":
        return []
    return list(value) if isinstance(value, list) else [value]


def require_datasets() -> Any:
    """The ``datasets`` module, imported on first use.

    Raises:
        ConfigError: ``datasets`` is not installed (it comes with verl-core's ``data`` extra).
    """
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"reading dataset files needs the 'datasets' library ({e}); install it with "
            "pip install 'verl-core[data]'"
        ) from e
    return datasets


# ----------------------------------------------------------------------------- reading files
def check_dataset_files(paths: Sequence[str], where: str) -> None:
    """What can be checked of dataset files without parsing them, before any model is built.

    Each path exists; a file has a supported extension, is not empty, is UTF-8 (``.jsonl``,
    ``.json``, ``.csv``; the first bad byte is named with its line) and, for CSV, has no column
    name twice in its header. :meth:`PromptDataset.load` checks the same (and everything else).

    Args:
        paths: The files or ``save_to_disk`` folders.
        where: How messages name the dataset (e.g. ``data.train``).

    Raises:
        ConfigError: naming ``where``, the file and, where it applies, the line.
    """
    for path in paths:
        _check_file(Path(path), path, where)


def _check_file(p: Path, path: str, where: str) -> None:
    try:
        if not p.exists():
            raise ConfigError(
                f"{where}: dataset {path!r} does not exist; expected a file ({', '.join(FORMATS)}) or a save_to_disk folder"
            )
        if p.is_dir():
            return
        suffix = p.suffix.lower()
        if suffix not in FORMATS:
            raise ConfigError(
                f"{where}: dataset {path!r} has the unsupported extension {p.suffix or '(none)'!r}; supported: "
                f"{', '.join(FORMATS)} files, or a folder written by datasets' save_to_disk"
            )
        size = p.stat().st_size
        if size == 0 or (suffix != ".parquet" and size < 1 << 16 and not p.read_bytes().strip()):
            raise ConfigError(f"{where}: dataset {path!r} is empty; expected rows with at least a prompt column")
        if suffix in _TEXT_FORMATS:
            _check_utf8(p, path, where)
        if suffix == ".csv":
            _check_csv_header(p, path, where)
    except OSError as e:
        raise ConfigError(f"{where}: dataset {path!r} cannot be read ({type(e).__name__}: {e})") from e


def _check_utf8(p: Path, path: str, where: str) -> None:
    """Refuse a text file that is not UTF-8, naming the line and byte of the first bad byte."""
    line = 1
    rest = b""
    with p.open("rb") as fh:
        while True:
            block = fh.read(_UTF8_BLOCK)
            data = rest + block
            if block:  # decode whole lines only (a UTF-8 sequence never holds a newline byte)
                cut = data.rfind(b"\n") + 1
                data, rest = data[:cut], data[cut:]
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                line += data.count(b"\n", 0, e.start)
                column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
                bom = " (it starts with a UTF-16 byte-order mark)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
                raise ConfigError(
                    f"{where}: dataset {path!r} is not UTF-8 text{bom}: line {line}, byte {column} is "
                    f"0x{data[e.start]:02x} ({e.reason}); save the file as UTF-8"
                ) from None
            line += data.count(b"\n")
            if not block:
                return


def _check_csv_header(p: Path, path: str, where: str) -> None:
    """Refuse a CSV whose header names a column twice (the parser would rename the second ``name.1``)."""
    with p.open(encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next((row for row in reader if any(cell.strip() for cell in row)), [])
        except csv.Error as e:
            raise ConfigError(f"{where}: dataset {path!r} cannot be read as CSV: line {reader.line_num}: {e}") from e
        line = reader.line_num
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise ConfigError(
            f"{where}: dataset {path!r} names the column(s) {repeated} more than once in its header (line {line}); "
            "give every column a name of its own"
        )


def _columns(ds: Any, path: str, where: str) -> dict[str, list[Any]]:
    """The columns of a loaded ``datasets.Dataset`` as Python lists."""
    names = list(ds.column_names)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"{where}: dataset {path!r} has the column(s) {repeated} more than once; give every column a name of its own"
        )
    try:
        return dict(ds.to_dict())
    except Exception as e:  # e.g. bytes that are not UTF-8 in a string column
        raise ConfigError(
            f"{where}: dataset {path!r} was parsed but its values cannot be read ({type(e).__name__}: {e}); "
            "check the file's encoding (UTF-8) and column types"
        ) from e


def _read(path: str, cache_dir: str | None, where: str) -> dict[str, list[Any]]:
    """The columns of one file or ``save_to_disk`` folder, as Python lists (``where`` starts every message)."""
    p = Path(path)
    _check_file(p, path, where)
    datasets = require_datasets()
    progress = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the trainer's own progress line owns stderr
    # datasets logs parser failures before raising; the ConfigError below says it once, better
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        if p.is_dir():
            return _read_folder(datasets, path, where)
        suffix = p.suffix.lower()
        try:
            ds = datasets.load_dataset(FORMATS[suffix], data_files=[str(p)], split="train", cache_dir=cache_dir)
        except Exception as e:  # datasets wraps parser errors in its own exception types
            if suffix == ".csv" and sum(1 for line in p.open(errors="replace") if line.strip()) <= 1:
                raise ConfigError(f"{where}: dataset {path!r} has no rows (only a header)") from e
            if suffix == ".json" and _empty_json(p):
                raise ConfigError(f"{where}: dataset {path!r} has no rows (an empty JSON list or object)") from e
            raise ConfigError(f"{where}: dataset {path!r} cannot be read as {suffix[1:].upper()}: {_why(p, e)}") from e
        return _columns(ds, path, where)
    finally:
        log.setLevel(level)
        if progress:
            datasets.enable_progress_bars()


def _read_folder(datasets: Any, path: str, where: str) -> dict[str, list[Any]]:
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise ConfigError(
            f"{where}: dataset folder {path!r} cannot be read with datasets.load_from_disk ({type(e).__name__}: {e}); "
            "expected a folder written by Dataset.save_to_disk"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        example = "train" if "train" in ds else sorted(ds)[0]
        raise ConfigError(
            f"{where}: dataset folder {path!r} holds the splits {sorted(ds)} (a DatasetDict); point at one split's "
            f"folder, e.g. {str(Path(path) / example)!r}"
        )
    return _columns(ds, path, where)


def _empty_json(path: Path) -> bool:
    """Whether a JSON file holds an empty list or object (no rows)."""
    try:
        return json.loads(path.read_text(encoding="utf-8-sig")) in ([], {})
    except ValueError:
        return False


def _why(path: Path, error: BaseException) -> str:
    """The reason a file did not parse: for JSONL the first malformed line, else the parser's words."""
    if path.suffix.lower() == ".jsonl":
        columns = False
        with path.open(encoding="utf-8-sig", errors="replace") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    return f"line {number} is not valid JSON ({e})"
                if not isinstance(row, dict):
                    return f"line {number} is not a JSON object (got {type(row).__name__})"
                columns = columns or bool(row)
        if not columns:
            return "every line is an empty JSON object {}: there are no columns"
    cause = error.__cause__ or error.__context__ or error
    return f"{type(cause).__name__}: {cause}"


# ----------------------------------------------------------------------------- chat templates
def _chat_renderer(tokenizer: Tokenizer, why: str) -> Any:
    """The object whose ``apply_chat_template`` renders chat messages (a transformers tokenizer).

    ``why`` says what needs the chat template (it starts the error message).
    """
    inner = tokenizer.wrapped if isinstance(tokenizer, HFTokenizer) else tokenizer
    if not callable(getattr(inner, "apply_chat_template", None)):
        raise ConfigError(
            f"{why}, but the tokenizer {type(inner).__name__} has no "
            "apply_chat_template; use a transformers tokenizer with a chat template, or text prompts"
        )
    if getattr(inner, "chat_template", "unknown") is None:
        raise ConfigError(
            f"{why}, but the tokenizer has no chat_template; use a model whose "
            "tokenizer_config.json has one, or text prompts"
        )
    return inner


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(
                f"{where}: message {j} is {m!r}; a chat prompt is a list of {{'role': str, 'content': str}}"
            )
        # Arrow gives every message the union of the keys of all rows' messages (missing ones None).
        out.append({k: v for k, v in m.items() if v is not None})
    if not out:
        raise ConfigError(f"{where}: the chat prompt has no messages")
    return out


# ----------------------------------------------------------------------------- the dataset
class PromptDataset:
    """The checked rows of a prompt dataset: prompt texts plus the other columns.

    Build it with :meth:`load` (or :meth:`from_config`). Prompts are kept as text (chat messages
    already rendered through the chat template); :meth:`to_batch` encodes the rows it is given.

    Attributes:
        prompts: The prompt text of every kept row.
        columns: Every other column, one value per kept row.
        dropped: Rows left out because their prompt was longer than ``max_prompt_len``.
        sources: The files or folders the rows came from, in order.
        messages: The chat messages each kept prompt was rendered from (a text prompt rendered
            with ``chat_template`` as its one user message; None for a text prompt used as it is).

    Args:
        longest: Tokens of the longest prompt when already known (:meth:`load` measures every
            prompt); ``None`` = encode them when :attr:`longest_prompt` is first read.
    """

    def __init__(
        self,
        prompts: Sequence[str],
        columns: Mapping[str, Sequence[Any]],
        tokenizer: Tokenizer,
        *,
        dropped: int = 0,
        sources: Sequence[str] = (),
        longest: int | None = None,
        messages: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
    ) -> None:
        self.prompts: tuple[str, ...] = tuple(prompts)
        self.messages: tuple[tuple[dict[str, Any], ...] | None, ...] = (
            tuple(None if m is None else tuple(dict(x) for x in m) for m in messages)
            if messages is not None else (None,) * len(self.prompts)
        )
        if len(self.messages) != len(self.prompts):
            raise ConfigError(f"{len(self.messages)} message lists for {len(self.prompts)} prompts")
        self.columns: dict[str, tuple[Any, ...]] = {k: tuple(v) for k, v in columns.items()}
        for key, values in self.columns.items():
            if len(values) != len(self.prompts):
                raise ConfigError(f"column {key!r} has {len(values)} values for {len(self.prompts)} prompts")
        self.tokenizer = tokenizer
        self.dropped = dropped
        self.sources: tuple[str, ...] = tuple(sources)
        self._longest = longest

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt (as measured at load, else encoded with :attr:`tokenizer` now)."""
        if self._longest is None:
            self._longest = max((len(self.tokenizer.encode(p)) for p in self.prompts), default=0)
        return self._longest

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def column_names(self) -> list[str]:
        """The columns that travel with each sample (every column but the prompt's)."""
        return list(self.columns)

    def stats(self) -> dict[str, float]:
        """``data/rows`` (kept) and ``data/dropped_long_prompts``, for the run's metrics."""
        return {"data/rows": float(len(self)), "data/dropped_long_prompts": float(self.dropped)}

    @classmethod
    def from_config(
        cls, config: DataConfig, tokenizer: Tokenizer, *, split: Literal["train", "eval"] = "train",
        cache_dir: str | None = None,
    ) -> PromptDataset:
        """Load ``config.train`` or ``config.eval`` with the config's prompt column and length policy.

        Raises:
            ConfigError: the split has no paths, or any problem :meth:`load` reports.
        """
        paths = config.train_paths if split == "train" else config.eval_paths
        if not paths:
            raise ConfigError(f"data.{split} is not set; give a dataset file or folder")
        return cls.load(
            paths, tokenizer, prompt_key=config.prompt_key, chat_template=config.chat_template,
            max_prompt_len=config.max_prompt_len, long_prompts=config.long_prompts, cache_dir=cache_dir,
            where=f"data.{split}",
        )

    @classmethod
    def load(
        cls,
        paths: str | Sequence[str],
        tokenizer: Tokenizer,
        *,
        prompt_key: str = "prompt",
        chat_template: bool = False,
        max_prompt_len: int | None = None,
        long_prompts: LongPromptPolicy = "drop",
        cache_dir: str | None = None,
        where: str = "dataset",
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> PromptDataset:
        """Read, concatenate and check one or more dataset files or folders.

        Args:
            paths: A path or a list of paths; rows are concatenated in this order.
            tokenizer: Renders chat prompts (its chat template) and measures prompt lengths.
            prompt_key: The prompt column.
            chat_template: Render text prompts through the chat template as one user message each
                (chat-message prompts always are).
            max_prompt_len: Longest prompt in tokens; ``None`` = no limit.
            long_prompts: ``drop`` or ``error`` for longer prompts (see :data:`LongPromptPolicy`).
            cache_dir: ``datasets``' cache folder (``None`` = its default, ``HF_DATASETS_CACHE``).
            where: How messages name the dataset (e.g. ``data.train``).
            tools: JSON tool schemas the chat template lists in chat prompts (multi-turn runs).

        Raises:
            ConfigError: a path that does not exist or has an unsupported extension; a file that
                is empty or does not parse (for JSONL: the line); files with different columns;
                a missing prompt column (naming the columns there are) or one named like a reward
                keyword (:data:`RESERVED_COLUMNS`); a prompt that is neither text nor chat
                messages, or is empty; chat prompts (or ``chat_template``) with a tokenizer that has no
                chat template; a too-long prompt under ``long_prompts="error"``; no rows
                left; ``datasets`` not installed.
        """
        path_list = [paths] if isinstance(paths, str) else list(paths)
        if not path_list:
            raise ConfigError(f"{where}: no dataset paths given")
        if long_prompts not in ("drop", "error"):
            raise ConfigError(f"long_prompts must be 'drop' or 'error', got {long_prompts!r}")
        merged: dict[str, list[Any]] = {}
        origin: list[tuple[str, int]] = []  # (path, first row) of each file, for error messages
        first_columns: list[str] = []
        for path in path_list:
            data = _read(path, cache_dir, where)
            names = list(data)
            if prompt_key not in data:
                raise ConfigError(
                    f"{where}: {path!r} has no column {prompt_key!r} (the prompt column); its columns: "
                    f"{', '.join(names) or '(none)'}; set data.prompt_key to the column holding the prompts"
                )
            clash = [c for c in RESERVED_COLUMNS if c in data]
            if clash:
                raise ConfigError(
                    f"{where}: {path!r} has the column(s) {clash}, names reward functions receive the "
                    "samples' texts, response ids and truncation under; rename them"
                )
            if not merged:
                first_columns = names
                merged = {k: [] for k in names}
            elif set(names) != set(first_columns):
                raise ConfigError(
                    f"{where}: {path!r} has the columns {sorted(names)} but {path_list[0]!r} has "
                    f"{sorted(first_columns)}; concatenated files need the same columns"
                )
            origin.append((path, len(merged[prompt_key])))
            for k in first_columns:
                merged[k].extend(data[k])
        if not merged[prompt_key]:
            raise ConfigError(f"{where}: {', '.join(map(repr, path_list))} has no rows")

        def row_name(i: int) -> str:
            path, start = next(o for o in reversed(origin) if o[1] <= i)
            return f"{where}: {path!r} row {i - start}"

        renderer = None
        if chat_template:  # refused here even when every prompt is text
            renderer = _chat_renderer(tokenizer, f"{where}: data.chat_template is true")
        keep: list[int] = []
        texts: list[str] = []
        conversations: list[list[dict[str, Any]] | None] = []
        dropped = 0
        longest = 0
        for i, value in enumerate(merged[prompt_key]):
            messages = None
            if isinstance(value, str) and not chat_template:
                text = value
            elif isinstance(value, (str, Sequence)) and not isinstance(value, (bytes, bytearray)):
                if renderer is None:
                    renderer = _chat_renderer(tokenizer, f"{where}: column {prompt_key!r} holds chat messages")
                messages = [{"role": "user", "content": value}] if isinstance(value, str) else _messages(value, row_name(i))
                try:
                    text = renderer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
                except Exception as e:  # Jinja errors, template-specific checks
                    raise ConfigError(
                        f"{row_name(i)}: the chat template cannot render the messages ({type(e).__name__}: {e})"
                    ) from e
                if not isinstance(text, str):
                    raise ConfigError(f"{row_name(i)}: the chat template rendered {type(text).__name__}, not text")
            else:
                raise ConfigError(
                    f"{row_name(i)}: the prompt is {value!r}; expected a string or a list of chat messages"
                )
            length = len(tokenizer.encode(text))
            if length == 0:
                raise ConfigError(f"{row_name(i)}: the prompt {text!r} encodes to no tokens")
            if max_prompt_len is not None and length > max_prompt_len:
                if long_prompts == "error":
                    raise ConfigError(
                        f"{row_name(i)}: the prompt has {length} tokens, more than max_prompt_len = "
                        f"{max_prompt_len}; raise data.max_prompt_len or set data.long_prompts = 'drop'"
                    )
                dropped += 1
                continue
            keep.append(i)
            texts.append(text)
            conversations.append(messages)
            longest = max(longest, length)
        if not keep:
            raise ConfigError(
                f"{where}: all {dropped} prompts of {', '.join(map(repr, path_list))} are longer than max_prompt_len "
                f"= {max_prompt_len} tokens; raise data.max_prompt_len"
            )
        columns = {k: [v[i] for i in keep] for k, v in merged.items() if k != prompt_key}
        return cls(texts, columns, tokenizer, dropped=dropped, sources=path_list, longest=longest,
                   messages=conversations)

    def to_batch(
        self, rows: Sequence[int], *, group_ids: Sequence[int], meta: BatchMeta | None = None
    ) -> TensorBatch:
        """The prompt batch of ``rows`` (left-padded ids, ``group_ids``, the other columns as extras)."""
        return prompt_batch(
            [self.prompts[i] for i in rows], self.tokenizer, group_ids=group_ids,
            extras={k: [v[i] for i in rows] for k, v in self.columns.items()}, meta=meta,
        )

    def batches(
        self, n: int, *, group_id_base: int = 0, meta: BatchMeta | None = None
    ) -> Iterator[TensorBatch]:
        """Every row once, in order, ``n`` at a time (the last batch may be smaller); for evaluation.

        Group ids are ``group_id_base + row``.
        """
        if n < 1:
            raise ConfigError(f"batches() needs n >= 1, got {n}")
        for start in range(0, len(self), n):
            rows = range(start, min(start + n, len(self)))
            yield self.to_batch(rows, group_ids=[group_id_base + i for i in rows], meta=meta)


# ----------------------------------------------------------------------------- the data order
@dataclasses.dataclass
class PromptSampler:
    """The training data order: every epoch a permutation of the rows, as many epochs as needed.

    The permutation of an epoch is a function of (seed, epoch) alone (the identity when
    ``shuffle`` is off); the position is (epoch, index into that epoch's order), which
    :meth:`state_dict` saves and :meth:`load_state_dict` restores so a resumed run continues the
    order exactly.

    Attributes:
        size: Rows in the dataset.
        seed: The run seed.
        shuffle: Shuffle each epoch.
        epoch: Epoch of the next row.
        index: Position of the next row in that epoch's order.
    """

    size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    index: int = 0
    _order: tuple[int, list[int]] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"PromptSampler needs at least one row, got size={self.size}")

    def order(self, epoch: int) -> list[int]:
        """The row order of ``epoch``."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        rows = list(range(self.size))
        if self.shuffle:
            # a string seed is hashed with SHA-512: the same order on every machine and Python run
            random.Random(f"data/{self.seed}/{epoch}").shuffle(rows)
        self._order = (epoch, rows)
        return rows

    @property
    def position(self) -> int:
        """Rows drawn so far in the run (``epoch * size + index``)."""
        return self.epoch * self.size + self.index

    def take(self, n: int) -> list[int]:
        """The next ``n`` rows, crossing into following epochs as needed."""
        if n < 1:
            raise ConfigError(f"PromptSampler.take needs n >= 1, got {n}")
        out: list[int] = []
        while len(out) < n:
            rows = self.order(self.epoch)
            chunk = rows[self.index : self.index + n - len(out)]
            out.extend(chunk)
            self.index += len(chunk)
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int | bool]:
        """The position and what it is valid for (JSON-serialisable)."""
        return {"epoch": self.epoch, "index": self.index, "size": self.size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position.

        Raises:
            ConfigError: the state is malformed, or was saved for a dataset of another size, another
                seed or another shuffle setting (the order would not continue).
        """
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
            size, seed, shuffle = int(state["size"]), int(state["seed"]), bool(state["shuffle"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"data sampler state {dict(state)!r} is malformed ({e}); expected epoch, index, size, seed, shuffle"
            ) from e
        if (size, seed, shuffle) != (self.size, self.seed, self.shuffle):
            raise ConfigError(
                f"cannot resume the data order: it was saved for {size} rows, seed {seed}, shuffle {shuffle}; "
                f"now {self.size} rows, seed {self.seed}, shuffle {self.shuffle}; resume with the same data and seed"
            )
        if epoch < 0 or not 0 <= index < size:
            raise ConfigError(f"data sampler state has epoch {epoch}, index {index}; expected epoch >= 0 and 0 <= index < {size}")
        self.epoch, self.index = epoch, index


class PromptLoader:
    """Prompt batches of a training run, drawn from a :class:`PromptDataset` in the sampler's order.

    Args:
        dataset: The training rows.
        seed: The run seed (the data order is a function of it and the epoch).
        shuffle: Shuffle every epoch.
    """

    def __init__(self, dataset: PromptDataset, *, seed: int = 0, shuffle: bool = True) -> None:
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), seed=seed, shuffle=shuffle)

    @classmethod
    def from_config(
        cls, config: DataConfig, tokenizer: Tokenizer, *, seed: int, cache_dir: str | None = None
    ) -> PromptLoader:
        """Load ``config.train`` and order it with ``seed`` and ``config.shuffle``."""
        return cls(PromptDataset.from_config(config, tokenizer, cache_dir=cache_dir), seed=seed, shuffle=config.shuffle)

    @property
    def epoch(self) -> int:
        """Epoch of the next row."""
        return self.sampler.epoch

    def batch(self, step: int, n: int, *, meta: BatchMeta | None = None) -> TensorBatch:
        """The prompt batch of ``step``: the next ``n`` rows of the data order (advancing it).

        Group ids are the rows' positions in the run's data stream (rows drawn before them), so they
        are unique for the whole run, even if ``n`` changes on resume. ``meta`` defaults to the
        tokenizer's pad id; its ``step`` is set to ``step``.
        """
        start = self.sampler.position
        rows = self.sampler.take(n)
        pad = self.dataset.tokenizer.pad_token_id
        meta = BatchMeta(pad_token_id=pad, step=step) if meta is None else dataclasses.replace(meta, step=step)
        return self.dataset.to_batch(rows, group_ids=[start + i for i in range(n)], meta=meta)

    def state_dict(self) -> dict[str, int | bool]:
        """The sampler's position (save it with the checkpoint)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        self.sampler.load_state_dict(state)

