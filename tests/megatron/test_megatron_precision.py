"""Megatron engine: float32 master weights under bfloat16, a failed forward_backward, accumulation.

The checks run in the TP=1 launch of ``engine_checks.py`` (``precision_checks``, ``failed_call``) and the
DP=2 launch (``accumulate``: a per-call token budget, one call per optimizer step); TP=2 x PP=2 saves a bfloat16 checkpoint (``bf16_ckpt``) that TP=1 restores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_checks import BASE, BF16_SAVER, SMALL_STEPS

from verl_conformance.testkit import assert_close

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def base(megatron_launch: Any) -> dict[str, Any]:
    """Rank 0's results of the TP=1 launch (shared with test_engine.py)."""
    result: dict[str, Any] = megatron_launch(BASE)[0]
    return result


def test_master_weights_let_small_updates_accumulate(base: dict[str, Any]) -> None:
    r = base["precision"]
    start = r["start"]
    assert bool((start == 1.0).all())  # norm weights start at 1.0
    moved32 = r["fp32"] - start
    assert float(moved32.abs().mean()) > SMALL_STEPS.lr  # the float32 run moves the norm weights
    # Pure bfloat16 rounds every one of those updates away.
    assert not r["pure_has_masters"] and not r["fp32_has_masters"]
    assert float((r["pure"] - start).abs().max()) == 0.0
    # With float32 masters the updates accumulate and follow the float32 run (up to the drift of
    # bfloat16 gradients); the model computes with the masters' bfloat16 rounding.
    masters = r["mixed_masters"]
    assert float(((masters - start) - moved32).abs().mean()) < 0.25 * float(moved32.abs().mean())
    assert torch.equal(r["mixed"], masters.bfloat16().float())
    assert float((r["mixed"] - start).abs().max()) > 0
    assert r["dtypes"] == ["torch.bfloat16"] and r["master_dtypes"] == ["torch.float32"]


def test_bfloat16_checkpoint_resume_equals_uninterrupted_run(base: dict[str, Any]) -> None:
    r = base["precision"]
    uninterrupted, resumed = r["resume"]
    for name, t in uninterrupted.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, resumed[name]), f"{name} differs after resuming from a bfloat16 checkpoint"
    assert torch.equal(*r["resume_masters"])


def test_failed_forward_backward_leaves_no_gradients(base: dict[str, Any]) -> None:
    r = base["failed_call"]
    assert r["raised"] == "injected failure in the second micro-batch" and r["calls"] == 2
    for name, g in r["after_failure"].items():
        assert not bool(g.any()), f"{name}: the failed call left gradients behind"
    # running the call again gives exactly the gradients of an engine that never failed
    assert any(float(g.abs().max()) > 0 for g in r["clean"].values())
    for name, g in r["clean"].items():
        assert torch.equal(r["resumed"][name], g), f"{name} differs from the run without a failure"


def test_a_per_call_budget_matches_the_spec_micro_batches_under_data_parallelism(megatron_launch: Any) -> None:
    for rank, res in enumerate(megatron_launch((1, 1, 2))):
        r = res["accumulate"]
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5)
        assert r["micro_batches"] == (2, r["expected_micro_batches"])  # pairs of the 3-sample shard; the partition
        for name, g in r["by_size"].items():
            assert_close(r["by_budget"][name], g, dtype="float32", quantity="grad",
                         what=f"{name} with a per-call budget vs micro_batch_size=2 (rank {rank})")
        assert "call optimizer_step() first" in r["refused"], r["refused"]


def test_bfloat16_checkpoint_with_masters_resumes_and_loads_at_another_layout(megatron_launch: Any) -> None:
    saver = megatron_launch(BF16_SAVER)[0]["bf16_ckpt"]
    uninterrupted, resumed = saver["resume"]
    for name, t in uninterrupted.items():
        assert torch.equal(t, resumed[name]), f"{name} differs after resuming at TP=2 x PP=2"
    loaded = megatron_launch(BASE)[0]["loaded:bf16"]
    assert loaded["step"] == 2
    for name, m in saver["masters"].items():
        assert m.dtype == torch.float32
        assert torch.equal(loaded["masters"][name], m), f"{name}: masters differ after loading at TP=1"
        assert torch.equal(loaded["model"][name], m.bfloat16()), f"{name}: weights are not the masters' rounding"
    moved = max(float((m - m.bfloat16().float()).abs().max()) for m in saver["masters"].values())
    assert moved > 0  # the masters hold more than the bfloat16 weights
