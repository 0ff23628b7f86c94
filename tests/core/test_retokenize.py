"""verl_core.enginekit.retokenize: scoring the policy's samples with a reward engine of another tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import BatchMeta, FunctionReward, TensorBatch
from verl_core.enginekit.retokenize import (
    CrossTokenizerReward,
    max_token_bytes,
    retokenize,
    same_vocabulary,
)

ALPHABET = "abcdefgh0123456789=+"


class CharTok:
    """A character tokenizer: ids 0 = pad, 1 = eos, then the alphabet in the given order (plus offset)."""

    def __init__(self, order: str, offset: int = 0) -> None:
        self.chars = order
        self.offset = offset

    @property
    def eos_token_id(self) -> int:
        return 1

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return 2 + self.offset + len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [2 + self.offset + self.chars.index(c) for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i < 2 + self.offset:
                if not skip_special_tokens:
                    out.append(f"<{i}>")
                continue
            out.append(self.chars[i - 2 - self.offset])
        return "".join(out)


POLICY = CharTok(ALPHABET)
REWARD = CharTok(ALPHABET[::-1], offset=3)  # the same characters under other ids


def samples(tok: CharTok, rows: list[tuple[str, str, bool]]) -> TensorBatch:
    """A policy batch: left-padded prompts, right-padded responses (EOS appended when the flag is set)."""
    p = [tok.encode(a) for a, _, _ in rows]
    r = [tok.encode(b) + ([tok.eos_token_id] if end else []) for _, b, end in rows]
    pw, rw = max(len(x) for x in p), max(len(x) for x in r)
    pid = torch.tensor([[0] * (pw - len(x)) + x for x in p], dtype=torch.int64)
    rid = torch.tensor([x + [0] * (rw - len(x)) for x in r], dtype=torch.int64).reshape(len(rows), rw)
    pm = torch.tensor([[False] * (pw - len(x)) + [True] * len(x) for x in p])
    rm = torch.tensor([[True] * len(x) + [False] * (rw - len(x)) for x in r], dtype=torch.bool).reshape(len(rows), rw)
    return TensorBatch(
        {"prompt_ids": pid, "prompt_mask": pm, "response_ids": rid, "response_mask": rm,
         "group_ids": torch.arange(len(rows)), "rollout_log_probs": torch.where(rm, -0.5, 0.0)},
        extras={"answer": [a for a, _, _ in rows]}, meta=BatchMeta(pad_token_id=0, temperature=0.7),
    )


texts = st.text(alphabet=ALPHABET, min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(texts, st.text(alphabet=ALPHABET, max_size=5), st.booleans()), min_size=1, max_size=4))
def test_retokenize_keeps_the_text_and_round_trips(rows: list[tuple[str, str, bool]]) -> None:
    batch = samples(POLICY, rows)
    converted = retokenize(batch, POLICY, REWARD)
    assert converted.meta.pad_token_id == REWARD.pad_token_id and converted.meta.temperature == 0.7
    assert "rollout_log_probs" not in converted  # token positions no longer line up
    assert torch.equal(converted["group_ids"], batch["group_ids"]) and converted.extras == batch.extras
    for i, (prompt, response, ended) in enumerate(rows):
        p = converted["prompt_ids"][i][converted["prompt_mask"][i]].tolist()
        r = converted["response_ids"][i][converted["response_mask"][i]].tolist()
        assert REWARD.decode(p) == prompt and REWARD.decode(r) == response
        assert (bool(r) and r[-1] == REWARD.eos_token_id) == ended
    back = retokenize(converted, REWARD, POLICY)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        assert torch.equal(back[name], batch[name]), name


def test_reward_engine_with_another_tokenizer_sees_the_policy_text() -> None:
    seen: list[tuple[str, str]] = []

    def fn(prompt: str, response: str, extras: Mapping[str, Any]) -> float:
        seen.append((prompt, response))
        return float(len(response))

    batch = samples(POLICY, [("ab=", "123", True), ("c+d=", "9", False)])
    wrapped = CrossTokenizerReward(FunctionReward(fn, REWARD), POLICY, REWARD)
    assert wrapped.converts and wrapped.tokenizer is POLICY
    out = wrapped.score(batch)
    assert seen == [("ab=", "123"), ("c+d=", "9")]
    assert out["scores"].tolist() == [3.0, 1.0]
    assert torch.equal(out["response_ids"], batch["response_ids"]) and "rollout_log_probs" in out
    # without the wrapper the reward engine reads the policy's ids with its own vocabulary: wrong text
    seen.clear()
    FunctionReward(fn, REWARD).score(batch)
    assert seen != [("ab=", "123"), ("c+d=", "9")]


def test_same_vocabulary_passes_ids_through() -> None:
    calls: list[TensorBatch] = []

    class Recording(FunctionReward):
        def score(self, batch: TensorBatch) -> TensorBatch:
            calls.append(batch)
            return super().score(batch)

    twin = CharTok(ALPHABET)
    assert same_vocabulary(POLICY, twin) and not same_vocabulary(POLICY, REWARD)
    assert not same_vocabulary(POLICY, CharTok(ALPHABET[:-1]))
    batch = samples(POLICY, [("ab=", "12", True)])
    wrapped = CrossTokenizerReward(Recording(lambda p, r, e: 1.0, twin), POLICY, twin)
    assert not wrapped.converts
    wrapped.score(batch)
    assert calls[0] is batch


def test_missing_reward_tokenizer_is_a_clear_error() -> None:
    class NoTokenizer(FunctionReward):
        pass

    engine = NoTokenizer(lambda p, r, e: 0.0, REWARD)
    with pytest.raises(Exception, match="pass reward_tokenizer="):
        CrossTokenizerReward(engine, POLICY)


def test_max_token_bytes_bounds_a_re_encoded_sample() -> None:
    """One byte per character of these tokenizers, plus one; specials add none; multi-byte characters count
    their UTF-8 bytes, and a sample re-encoded one token per byte stays within n * max_token_bytes."""
    assert max_token_bytes(POLICY) == 2
    wide = CharTok("aé€😀")
    assert max_token_bytes(wide) == 1 + 4
    ids = [2, 3, 4, 5, 5]
    assert len(wide.decode(ids).encode("utf-8")) <= len(ids) * max_token_bytes(wide)
