"""Rules every engine applies to a transformers model folder's ``config.json`` when it is built.

:func:`check_special_token_ids` refuses a config whose pad, EOS or BOS id is not a row of the
vocabulary: transformers' embedding asserts ``padding_idx < num_embeddings`` (a bare
``AssertionError`` from deep inside ``nn.Embedding``), takes a negative ``padding_idx`` as a row
counted from the end (``-1``: the last token's row silently gets no gradient), and a rollout that
stops on an EOS the model cannot emit runs every response to ``max_new_tokens``. Each backend calls
it where it reads the folder's config, before any weights load, so the user learns it as a
:class:`~verl_core.kernel.errors.ConfigError` naming the key, its value, the vocabulary size and
the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from verl_core.kernel.errors import ConfigError

__all__ = ["SPECIAL_TOKEN_KEYS", "check_special_token_ids"]

SPECIAL_TOKEN_KEYS: Final = ("pad_token_id", "eos_token_id", "bos_token_id")
"""The ``config.json`` keys of special token ids that must be rows of the vocabulary (each an
integer, a list of integers, or absent / ``null``)."""

_WHY: Final = {
    "pad_token_id": "the embedding's padding_idx must be one of its rows (transformers refuses to build the model)",
    "eos_token_id": "a rollout that stops on an id the model cannot emit never stops before max_new_tokens",
    "bos_token_id": "a prompt that begins with it would index outside the embedding",
}


def _ids(value: Any) -> list[Any] | None:
    """The ids of a config value (an int or a list of ints), or None when it is neither."""
    items = value if isinstance(value, list) else [value]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return items
    return None


def _read_config(folder: str | os.PathLike[str]) -> Mapping[str, Any] | None:
    """The folder's parsed ``config.json``, or None when there is none to read (the loader says why)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def check_special_token_ids(folder: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
    """Refuse a model folder whose pad, EOS or BOS token id is not in ``[0, vocab_size)``.

    Each of :data:`SPECIAL_TOKEN_KEYS` may be absent or ``null`` (no such token), an integer, or a
    list of integers (several EOS ids); every id must be a row of the vocabulary. A multimodal
    config's ``text_config`` (which holds the language model's ``vocab_size``) is checked too. A
    config without an integer ``vocab_size`` has nothing to compare with and passes (the loader
    refuses what it cannot read).

    Args:
        folder: The model folder (named in the error).
        config: Its parsed ``config.json``; None reads it from ``folder`` (a folder without a
            readable ``config.json`` passes: the engine's loader says what is missing).

    Raises:
        ConfigError: an id outside ``[0, vocab_size)``, or a value that is not an integer or a
            list of them; the message names the key, its value, the vocabulary size and the folder.
    """
    raw = _read_config(folder) if config is None else config
    if raw is None:
        return
    text = raw.get("text_config")
    scopes: list[tuple[str, Mapping[str, Any]]] = [("", raw)]
    if isinstance(text, Mapping):
        scopes.append(("text_config.", text))
    vocab = (text if isinstance(text, Mapping) and "vocab_size" in text else raw).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    for prefix, scope in scopes:
        for key in SPECIAL_TOKEN_KEYS:
            value = scope.get(key)
            if value is None:
                continue
            ids = _ids(value)
            where = f"model folder {str(folder)!r}: config.json sets {prefix}{key} = {value!r}"
            if ids is None:
                raise ConfigError(f"{where}; expected a token id (an integer in [0, {vocab}), vocab_size {vocab}), "
                                  "a list of them, or null")
            bad = [i for i in ids if not 0 <= i < vocab]
            if not bad:
                continue
            listed = f": {', '.join(map(str, bad))} {'is' if len(bad) == 1 else 'are'}" if isinstance(value, list) else ","
            none = " (a negative id does not mean none)" if any(i < 0 for i in bad) else ""
            raise ConfigError(
                f"{where}{listed} not in [0, {vocab}), the vocabulary (vocab_size {vocab}); {_WHY[key]}. Set it to "
                f"an id below {vocab}, or to null where the model has no such token{none}"
            )
