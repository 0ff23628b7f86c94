"""A user-built GPTModel through verl_megatron.byo at TP=2 (one torchrun launch of byo_checks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_conformance.testkit import launch_torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("byo_checks.py")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch_torchrun(SCRIPT, 2, ["2"], timeout=300)


def test_ranks_agree_and_weights_arrived_through_the_stream(ranks: list[dict[str, Any]]) -> None:
    a, b = ranks
    assert a["version"] == b["version"] == 3
    assert not a["user_generates"] and a["own_generates"]
    assert not a["missing"], f"MegatronModelRollout.__init__ must set {a['missing']} like MegatronRolloutEngine does"
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", ["sampled", "greedy"])
def test_tp2_samples_equal_the_hf_engine_on_the_same_weights(ranks: list[dict[str, Any]], name: str) -> None:
    r = ranks[0]
    assert torch.equal(r[f"{name}/response_ids"], r[f"{name}/hf/response_ids"])
    assert torch.equal(r[f"{name}/response_mask"], r[f"{name}/hf/response_mask"])
    torch.testing.assert_close(r[f"{name}/rollout_log_probs"], r[f"{name}/hf/rollout_log_probs"], atol=1e-4, rtol=0)


def test_own_generation_gets_vocab_parallel_log_probs(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    assert torch.equal(r["replay/response_ids"], r["greedy/response_ids"])
    torch.testing.assert_close(r["replay/rollout_log_probs"], r["greedy/rollout_log_probs"], atol=1e-5, rtol=0)


def test_unsupported_layouts_are_rejected(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["errors"]
    assert len(errors) == 2
    assert "pp=1" in errors[0]
    assert "parallel_output=True" in errors[1]


def test_a_tokenizer_whose_special_id_is_past_the_embedding_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        eos, pad = r["refusals"]
        assert "its eos_token_id = 128 ('<|eos|>') is not in [0, 128)" in eos, eos
        assert "never stops before max_new_tokens" in eos
        assert "its pad_token_id = 128 ('<|pad|>') is not in [0, 128)" in pad, pad
        assert "batches are padded with it" in pad
        for message in (eos, pad):
            assert "the model's vocabulary (128 rows of its input embedding)" in message
            assert "resize the model's embedding to the tokenizer" in message
