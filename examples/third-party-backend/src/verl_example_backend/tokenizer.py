"""The verl_core Tokenizer protocol over a folder's ``tokenizer.json`` (the ``tokenizers`` library)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from verl_core import ConfigError, Tokenizer

__all__ = ["FolderTokenizer"]


class FolderTokenizer(Tokenizer):
    """Encode/decode with the folder's tokenizer; EOS and pad ids come from its config."""

    def __init__(self, path: str | Path, *, eos_token_id: int, pad_token_id: int, vocab_size: int) -> None:
        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise ConfigError(f"{path} has no tokenizer.json; save the tokenizer into the model folder")
        self._tok = _HFTokenizer.from_file(str(file))
        self._special = {eos_token_id, pad_token_id}
        cfg_file = Path(path) / "tokenizer_config.json"
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())
            for key in ("bos_token", "unk_token"):
                tok = cfg.get(key)
                tid = self._tok.token_to_id(tok) if isinstance(tok, str) else None
                if tid is not None:
                    self._special.add(int(tid))
        self._eos = eos_token_id
        self._pad = pad_token_id
        self._vocab = vocab_size

    @property
    def eos_token_id(self) -> int:
        """Id that ends a response."""
        return self._eos

    @property
    def pad_token_id(self) -> int:
        """Id that fills padding."""
        return self._pad

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding."""
        return self._vocab

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        keep = [i for i in ids if not (skip_special_tokens and i in self._special)]
        return str(self._tok.decode(keep, skip_special_tokens=False))
