"""HFTokenizer: the verl_core Tokenizer protocol over a transformers tokenizer.

The adapter is shared by every backend that reads transformers folders; it lives in
:mod:`verl_core.enginekit.hf_tokenizer` and is re-exported here.
"""

from __future__ import annotations

from verl_core.enginekit.hf_tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFTokenizer", "load_tokenizer"]
