"""Rules every engine applies to a transformers model folder when it is built: its special token ids
and its attention layer types.

:func:`check_special_token_ids` refuses a folder whose pad, EOS or BOS id is not a row of the
vocabulary, wherever the folder sets it: ``config.json``, ``generation_config.json`` and the
tokenizer's files (``tokenizer_config.json`` / ``special_tokens_map.json``, the token's id read from
``tokenizer.json``). transformers' embedding asserts ``padding_idx < num_embeddings`` (a bare
``AssertionError`` from deep inside ``nn.Embedding``), takes a negative ``padding_idx`` as a row
counted from the end (``-1``: the last token's row silently gets no gradient); a rollout that stops
on an EOS the model cannot emit (the tokenizer's, or the generation config's) runs every response to
``max_new_tokens``, and padding with a pad id past the table indexes outside the embedding. Each
backend calls it where it reads the folder's config, before any weights load, so the user learns it
as a :class:`~verl_core.kernel.errors.ConfigError` naming the file, the key, its value, the
vocabulary size and the folder.

:func:`check_layer_types` refuses a Qwen2 or Qwen3 config whose ``layer_types`` marks layers
``sliding_attention`` while ``use_sliding_window`` is false (no window: transformers' forward fails).

:func:`check_tokenizer_ids` applies the same rule to a tokenizer object given with a model built in
memory (``rollout_from_model`` of each backend), against the rows of the model's input embedding.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.kernel.errors import ConfigError

__all__ = [
    "SPECIAL_TOKEN_FILES",
    "SPECIAL_TOKEN_KEYS",
    "TOKENIZER_TOKEN_KEYS",
    "check_layer_types",
    "check_special_token_ids",
    "check_tokenizer_ids",
    "vocab_size",
]

SPECIAL_TOKEN_KEYS: Final = ("pad_token_id", "eos_token_id", "bos_token_id")
"""The ``config.json`` and ``generation_config.json`` keys of special token ids that must be rows of
the vocabulary (each an integer, a list of integers, or absent / ``null``)."""

TOKENIZER_TOKEN_KEYS: Final = ("pad_token", "eos_token", "bos_token")
"""The tokenizer files' keys of special tokens (a token's text, or an ``AddedToken`` mapping with
``content``) whose ids must be rows of the vocabulary."""

SPECIAL_TOKEN_FILES: Final = ("config.json", "generation_config.json", "tokenizer_config.json",
                              "special_tokens_map.json")
"""The files of a model folder :func:`check_special_token_ids` reads (``tokenizer.json`` too, for ids)."""

_WHY: Final = {
    "pad": "the embedding's padding_idx must be one of its rows (transformers refuses to build the model)",
    "eos": "a rollout that stops on an id the model cannot emit never stops before max_new_tokens",
    "bos": "a prompt that begins with it would index outside the embedding",
}
_WHY_PADDING: Final = "batches are padded with it, and every id of a batch is looked up in the embedding"


def _ids(value: Any) -> list[Any] | None:
    """The ids of a config value (an int or a list of ints), or None when it is neither."""
    items = value if isinstance(value, list) else [value]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return items
    return None


def _read_json(file: Path) -> Mapping[str, Any] | None:
    """The parsed JSON object in ``file``, or None when there is none to read (the loader says why)."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _vocab_size(config: Mapping[str, Any]) -> int | None:
    """The language model's ``vocab_size`` (a multimodal config's ``text_config`` holds it), or None."""
    text = config.get("text_config")
    vocab = (text if isinstance(text, Mapping) and "vocab_size" in text else config).get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def vocab_size(folder: str | os.PathLike[str]) -> int | None:
    """The ``vocab_size`` of the folder's ``config.json`` (a multimodal config's ``text_config``'s),
    or None when the file is absent, unreadable or sets no integer ``vocab_size``."""
    raw = _read_json(Path(folder) / "config.json")
    return None if raw is None else _vocab_size(raw)


def _check_id_keys(folder: str | os.PathLike[str], file: str, scope: Mapping[str, Any], prefix: str,
                   vocab: int, why_pad: str) -> None:
    """Refuse the first of :data:`SPECIAL_TOKEN_KEYS` in ``scope`` (read from ``file``) outside ``[0, vocab)``."""
    for key in SPECIAL_TOKEN_KEYS:
        value = scope.get(key)
        if value is None:
            continue
        ids = _ids(value)
        where = f"model folder {str(folder)!r}: {file} sets {prefix}{key} = {value!r}"
        if ids is None:
            raise ConfigError(f"{where}; expected a token id (an integer in [0, {vocab}), vocab_size {vocab}), "
                              "a list of them, or null")
        bad = [i for i in ids if not 0 <= i < vocab]
        if not bad:
            continue
        listed = f": {', '.join(map(str, bad))} {'is' if len(bad) == 1 else 'are'}" if isinstance(value, list) else ","
        none = " (a negative id does not mean none)" if any(i < 0 for i in bad) else ""
        why = why_pad if key == "pad_token_id" else _WHY[key[:3]]
        raise ConfigError(
            f"{where}{listed} not in [0, {vocab}), the vocabulary (vocab_size {vocab}); {why}. Set it to "
            f"an id below {vocab}, or to null where the model has no such token{none}"
        )


def _check_config_json(folder: str | os.PathLike[str], config: Mapping[str, Any]) -> None:
    """The rule on ``config.json`` alone (and its ``text_config``)."""
    vocab = _vocab_size(config)
    if vocab is None:
        return
    _check_id_keys(folder, "config.json", config, "", vocab, _WHY["pad"])
    text = config.get("text_config")
    if isinstance(text, Mapping):
        _check_id_keys(folder, "config.json", text, "text_config.", vocab, _WHY["pad"])


def _check_generation_config(folder: str | os.PathLike[str], vocab: int) -> None:
    """The rule on ``generation_config.json`` (absent or unreadable: nothing to check)."""
    gen = _read_json(Path(folder) / "generation_config.json")
    if gen is not None:
        _check_id_keys(folder, "generation_config.json", gen, "", vocab, _WHY_PADDING)


class _TokenTable(NamedTuple):
    """The ids ``tokenizer.json`` gives token texts."""

    ids: Mapping[str, int]  # read-only: the cached table is shared by every check of the file
    size: int  # one past the largest id


_NO_TABLE: Final = _TokenTable(MappingProxyType({}), 0)
"""What a folder without a readable ``tokenizer.json`` gives."""


def _tokenizer_table(file: Path) -> _TokenTable | None:
    """The token table of ``file`` (a ``tokenizer.json``), parsed once per version of the file.

    Every engine of a run checks its model folder when it is built (actor, rollout and reference
    build one after another on the policy's folder), and a tokenizer.json is megabytes of JSON
    (about 0.3 s to read for a 150k-token BPE); the parse is cached per resolved path,
    modification time and size, so a file written again is read again. The cache keeps the two
    latest files (a 150k-token table holds about 20 MB). None when the file is absent, unreadable
    or holds no JSON object.
    """
    try:
        resolved = file.resolve()
        stat = resolved.stat()
    except (OSError, ValueError):
        return None
    return _parse_tokenizer_table(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parse_tokenizer_table(file: str, mtime_ns: int, size: int) -> _TokenTable | None:
    """The token table of ``file``; ``mtime_ns`` and ``size`` only key the cache."""
    tok = _read_json(Path(file))
    if tok is None:
        return None
    model = tok.get("model")
    vocab = model.get("vocab") if isinstance(model, Mapping) else None
    known: dict[str, int] = {}
    if isinstance(vocab, Mapping):  # BPE, WordPiece, WordLevel: text -> id
        known.update((t, i) for t, i in vocab.items() if isinstance(i, int))
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
        known.update((p[0], i) for i, p in enumerate(vocab) if isinstance(p, list) and p and isinstance(p[0], str))
    for token in tok.get("added_tokens") or []:
        if isinstance(token, Mapping) and isinstance(token.get("content"), str) and isinstance(token.get("id"), int):
            known[token["content"]] = token["id"]
    return _TokenTable(MappingProxyType(known), max(known.values(), default=-1) + 1)


class _TokenIds:
    """Ids of token texts as a folder's tokenizer files give them (``tokenizer.json`` read on first need)."""

    def __init__(self, folder: Path, tokenizer_config: Mapping[str, Any] | None) -> None:
        self._folder = folder
        self._ids: dict[str, tuple[int, str]] = {}  # text -> (id, the file that gives it)
        decoder = (tokenizer_config or {}).get("added_tokens_decoder")
        if isinstance(decoder, Mapping):
            for key, token in decoder.items():
                content = token.get("content") if isinstance(token, Mapping) else None
                if isinstance(content, str) and str(key).isdigit():
                    self._ids.setdefault(content, (int(key), "tokenizer_config.json's added_tokens_decoder"))
        self._table: _TokenTable | None = None  # tokenizer.json's ids, once read

    @property
    def has_table(self) -> bool:
        """tokenizer.json was read and holds ids: a token it lacks is one transformers adds."""
        return self._table is not None and bool(self._table.ids)

    @property
    def size(self) -> int:
        """One past the largest id tokenizer.json holds (0 before it is read)."""
        return 0 if self._table is None else self._table.size

    def id_of(self, text: str) -> tuple[int, str] | None:
        """The id of ``text`` and the file that gives it, or None when no file holds it."""
        if text in self._ids:  # tokenizer_config.json's added_tokens_decoder goes before tokenizer.json
            return self._ids[text]
        if self._table is None:
            self._table = _tokenizer_table(self._folder / "tokenizer.json") or _NO_TABLE
        i = self._table.ids.get(text)
        return None if i is None else (i, "tokenizer.json")


def _check_tokenizer(folder: str | os.PathLike[str], vocab: int) -> None:
    """The rule on the tokenizer's special tokens (absent files, or a token whose id no file gives: nothing to check)."""
    config = _read_json(Path(folder) / "tokenizer_config.json")
    ids = _TokenIds(Path(folder), config)
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        scope = config if file == "tokenizer_config.json" else _read_json(Path(folder) / file)
        if scope is None:
            continue
        for key in TOKENIZER_TOKEN_KEYS:
            value = scope.get(key)
            text = value.get("content") if isinstance(value, Mapping) else value
            if not isinstance(text, str):
                continue
            found = ids.id_of(text)
            if found is not None:
                i, source = found
                if 0 <= i < vocab:
                    continue
                how = f"id {i} in {source}"
            elif ids.has_table and ids.size >= vocab:
                i = ids.size
                how = (f"a token tokenizer.json does not hold, which transformers adds after every id the tokenizer "
                       f"has: id {i}")
            else:
                continue
            kind = key[:3]
            why = _WHY_PADDING if kind == "pad" else _WHY[kind]
            raise ConfigError(
                f"model folder {str(folder)!r}: {file} sets {key} = {text!r}, {how} (the tokenizer's {key}_id), not "
                f"in [0, {vocab}), the vocabulary (vocab_size {vocab}); {why}. Name a token whose id is below "
                f"{vocab} (a row of the model's embedding), or resize the model's embedding to the tokenizer"
            )


def check_special_token_ids(folder: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
    """Refuse a model folder whose pad, EOS or BOS token id is not in ``[0, vocab_size)``.

    ``vocab_size`` is ``config.json``'s (a multimodal config's ``text_config``'s, which holds the
    language model's). Every place a run reads those ids from is checked:

    * ``config.json`` (and its ``text_config``): each of :data:`SPECIAL_TOKEN_KEYS` may be absent
      or ``null`` (no such token), an integer, or a list of integers (several EOS ids).
    * ``generation_config.json``: the same keys, the same forms (its EOS list is where generation
      stops).
    * The tokenizer: each of :data:`TOKENIZER_TOKEN_KEYS` in ``tokenizer_config.json`` and
      ``special_tokens_map.json`` names a token (its text, or a mapping with ``content``), whose id
      comes from ``tokenizer_config.json``'s ``added_tokens_decoder`` or ``tokenizer.json`` (its
      ``added_tokens`` and its model's vocabulary). A token ``tokenizer.json`` does not hold is one
      transformers adds after every id the tokenizer has, so it is refused when that id is past the
      vocabulary. A tokenizer with fewer ids than ``vocab_size`` is fine (the embedding's extra
      rows are padding); one with more ids is too, as long as its special tokens are rows.

    A config without an integer ``vocab_size`` has nothing to compare with and passes, and so does a
    file that is absent or unreadable, or a token whose id no file gives (a SentencePiece
    ``tokenizer.model`` alone): the loader refuses what it cannot read. ``tokenizer.json`` is read
    only for a token ``added_tokens_decoder`` lacks, and parsed once per version of the file in a
    process (each engine of a run checks the folder it is built on).

    Args:
        folder: The model folder (named in the error; its generation config and tokenizer files
            are read from it).
        config: Its parsed ``config.json``; None reads it from ``folder`` (a folder without a
            readable ``config.json`` passes: the engine's loader says what is missing).

    Raises:
        ConfigError: an id outside ``[0, vocab_size)``, or a value that is not an integer or a
            list of them; the message names the file, the key, its value, the vocabulary size and
            the folder.
    """
    raw = _read_json(Path(folder) / "config.json") if config is None else config
    if raw is None:
        return
    vocab = _vocab_size(raw)
    if vocab is None:
        return
    _check_config_json(folder, raw)
    _check_generation_config(folder, vocab)
    _check_tokenizer(folder, vocab)


def check_layer_types(folder: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
    """Refuse a folder whose ``layer_types`` lists ``sliding_attention`` layers that have no window.

    Qwen2 and Qwen3 configs carry ``use_sliding_window``; when it is false (or ``sliding_window`` is
    ``null``) transformers sets ``sliding_window`` to None, and a ``layer_types`` that still marks a
    layer ``sliding_attention`` makes its forward raise at the first call. Such a folder is
    contradictory: no engine can tell whether the layers attend to a window or to every key, so it is
    refused before any weights load, naming ``layer_types``. A config without ``use_sliding_window``
    (Llama, whose modelling reads no window) passes, as does one whose ``layer_types`` is absent or
    all ``full_attention``.

    Args:
        folder: The model folder (named in the error).
        config: Its parsed ``config.json``; None reads it from ``folder`` (an unreadable one passes:
            the loader says what is missing).

    Raises:
        ConfigError: naming ``layer_types``, the sliding layers, ``use_sliding_window``,
            ``sliding_window`` and the folder.
    """
    raw = _read_json(Path(folder) / "config.json") if config is None else config
    if raw is None or "use_sliding_window" not in raw:
        return
    types = raw.get("layer_types")
    if not isinstance(types, list):
        return
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if not sliding or (raw.get("use_sliding_window") and raw.get("sliding_window")):
        return
    raise ConfigError(
        f"model folder {str(folder)!r}: config.json's layer_types marks layers {sliding} "
        f"{types[sliding[0]]!r}, but use_sliding_window is {raw.get('use_sliding_window')} and sliding_window "
        f"{raw.get('sliding_window')}, so those layers have no window (transformers sets sliding_window to None "
        "and its forward fails); expected layer_types all 'full_attention', or use_sliding_window true with a "
        "sliding_window"
    )


def check_tokenizer_ids(tokenizer: Any, vocab_size: int) -> None:
    """Refuse a tokenizer object whose pad, EOS or BOS id is not a row of a model's embedding.

    The rule of :func:`check_special_token_ids` for a model built in memory, which has no folder to
    read: ``rollout_from_model`` calls it with the rows of the model's input embedding (all tensor
    parallel ranks' together), so a tokenizer that is not the model's fails at build rather than
    deep in generation (padding indexes outside the embedding; a rollout stopping on an EOS the
    model cannot emit runs every response to ``max_new_tokens``).

    Args:
        tokenizer: A transformers tokenizer, an :class:`~verl_core.enginekit.hf_tokenizer.HFTokenizer`
            (its wrapped tokenizer is read) or a :class:`~verl_core.kernel.tokenizer.Tokenizer`. Its
            ``pad_token_id``, ``eos_token_id`` and ``bos_token_id`` are checked where it has them
            (None, or no such attribute, is no such token).
        vocab_size: The model's embedding rows.

    Raises:
        ConfigError: an id outside ``[0, vocab_size)``, or one that is not an integer; the message
            names the token, its id, the vocabulary size and what to do.
    """
    raw = tokenizer.wrapped if isinstance(tokenizer, HFTokenizer) else tokenizer
    for key in SPECIAL_TOKEN_KEYS:
        value = getattr(raw, key, None)
        if value is None:
            continue
        kind = key[:3]
        text = getattr(raw, f"{kind}_token", None)
        named = f" ({text!r})" if isinstance(text, str) else ""
        where = f"tokenizer {type(raw).__name__}: its {key} = {value!r}{named}"
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} is not a token id (an integer in [0, {vocab_size}), the model's vocabulary)")
        if 0 <= value < vocab_size:
            continue
        none = " (a negative id does not mean none)" if value < 0 else ""
        why = _WHY_PADDING if kind == "pad" else _WHY[kind]
        raise ConfigError(
            f"{where} is not in [0, {vocab_size}), the model's vocabulary ({vocab_size} rows of its input "
            f"embedding){none}; {why}. Pass the tokenizer the model was built for, give it a {kind}_token whose id "
            f"is below {vocab_size}, or resize the model's embedding to the tokenizer"
        )
