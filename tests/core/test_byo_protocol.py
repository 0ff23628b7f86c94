"""verl_core.enginekit.byo: cutting user-generated ids at the stop token, and the tokenizer adapter."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verl_core import BatchValidationError, ConfigError, HFTokenizer, Tokenizer
from verl_core.enginekit.byo import (
    IN_MEMORY_MODEL,
    as_tokenizer,
    finish_responses,
    in_memory_spec,
)

EOS, STOP, PAD, VOCAB = 1, 7, 0, 16


@given(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=6), min_size=1, max_size=5), st.integers(6, 8))
def test_responses_end_at_the_first_stop_token(rows: list[list[int]], max_new: int) -> None:
    width = max(len(r) for r in rows)
    raw = torch.tensor([r + [3] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
    ids, mask, truncated = finish_responses(raw, stop_ids=[EOS, STOP], pad_id=PAD, max_new_tokens=max_new,
                                            vocab_size=VOCAB)
    assert ids.shape == raw.shape and mask.dtype == torch.bool
    for b in range(len(rows)):
        row = raw[b].tolist()
        stops = [i for i, t in enumerate(row) if t in (EOS, STOP)]
        end = stops[0] + 1 if stops else width
        assert mask[b].tolist() == [i < end for i in range(width)]
        assert ids[b, :end].tolist() == row[:end]
        assert all(t == PAD for t in ids[b, end:].tolist())
        assert bool(truncated[b]) == (not stops)


def test_bad_generated_ids_are_rejected_with_what_was_expected() -> None:
    with pytest.raises(BatchValidationError, match="more than max_new_tokens=2"):
        finish_responses(torch.ones(1, 3, dtype=torch.int64) * 4, stop_ids=[EOS], pad_id=PAD, max_new_tokens=2,
                         vocab_size=VOCAB)
    with pytest.raises(BatchValidationError, match="integer ids"):
        finish_responses(torch.zeros(2, 2), stop_ids=[EOS], pad_id=PAD, max_new_tokens=2, vocab_size=VOCAB)
    with pytest.raises(BatchValidationError, match="outside the vocabulary"):
        finish_responses(torch.tensor([[4, 99]]), stop_ids=[EOS], pad_id=PAD, max_new_tokens=2, vocab_size=VOCAB)
    # ids after the stop token are not checked: they are not part of the response
    ids, mask, _ = finish_responses(torch.tensor([[EOS, 99]]), stop_ids=[EOS], pad_id=PAD, max_new_tokens=2,
                                    vocab_size=VOCAB)
    assert ids.tolist() == [[EOS, PAD]] and mask.tolist() == [[True, False]]


class _Plain:
    """A verl Tokenizer that is not transformers-like: returned as is."""

    eos_token_id = 1
    pad_token_id = 0
    vocab_size = 4

    def encode(self, text: str) -> list[int]:
        return [2] * len(text)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class _TransformersLike:
    """Duck-typed like a transformers tokenizer: encode adds a BOS unless told not to."""

    eos_token_id = 1
    pad_token_id = None

    def __len__(self) -> int:
        return 5

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([4] if add_special_tokens else []) + [3] * len(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("a" for i in ids if not (skip_special_tokens and i == 1))


def test_as_tokenizer_wraps_transformers_tokenizers_and_keeps_others() -> None:
    plain = _Plain()
    assert as_tokenizer(plain) is plain
    wrapped = as_tokenizer(_TransformersLike(), vocab_size=8)
    assert isinstance(wrapped, HFTokenizer) and isinstance(wrapped, Tokenizer)
    assert wrapped.encode("ab") == [3, 3]  # no special tokens added
    assert wrapped.pad_token_id == 1 and wrapped.vocab_size == 8  # pad falls back to EOS
    assert wrapped.decode([3, 1, 3]) == "aa"
    with pytest.raises(ConfigError, match="expected a tokenizer"):
        as_tokenizer(object())


def test_in_memory_spec_names_the_dtype_and_placeholder_path() -> None:
    spec = in_memory_spec(dtype=torch.bfloat16, device="cpu", tp=2, max_response_len=9)
    assert spec.model_path == IN_MEMORY_MODEL and spec.dtype == "bfloat16" and spec.parallel.tp == 2
    with pytest.raises(ConfigError, match="float32, bfloat16 or float16"):
        in_memory_spec(dtype=torch.float64, device="cpu")


def test_hf_tokenizer_decodes_arrays_for_transformers_and_lists_for_others() -> None:
    """A transformers tokenizer gets the ids as one array (the same text as from a list); another
    tokenizer-like object gets a list of Python ints."""
    from verl_core.trainer.inputs.tiny_model import char_tokenizer

    inner = char_tokenizer(128)
    wrapped = HFTokenizer(inner)
    ids = inner.encode("hello world", add_special_tokens=False) + [inner.eos_token_id]
    assert wrapped.decode(ids) == inner.decode(ids, skip_special_tokens=True) == "hello world"
    assert wrapped.decode(tuple(ids), skip_special_tokens=False) == inner.decode(ids, skip_special_tokens=False)

    class Plain:
        eos_token_id, pad_token_id = 1, 0

        def __init__(self) -> None:
            self.seen: list[object] = []

        def __len__(self) -> int:
            return 8

        def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
            self.seen.append(ids)
            return "x"

    plain = Plain()
    assert HFTokenizer(plain).decode(torch.tensor([3, 4])) == "x"
    assert plain.seen == [[3, 4]] and all(type(i) is int for i in plain.seen[0])  # type: ignore[union-attr]
