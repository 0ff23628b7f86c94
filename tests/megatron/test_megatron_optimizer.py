"""megatron-core's own optimizer (``optimizer="megatron"``) against the engine's torch AdamW.

The checks run in the TP=2, PP=2 and DP=2 launches of ``engine_checks.py`` (``optimizer_checks``):
the same three steps (weight decay and clipping active) under both optimizers, megatron's
distributed optimizer at DP=2, bfloat16 at TP=2, a tied embedding split across stages at PP=2; a
NaN loss; a failed forward_backward (without PP); checkpoints (a round trip at each layout, and
TP=2's checkpoint restored into DP=2's distributed optimizer).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_checks import MEGATRON_LOADER, MEGATRON_SAVER, MEGATRON_STEPS, RUNS

from verl_conformance.testkit import assert_close
from verl_core import ConfigError
from verl_megatron.options import MegatronOptions

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LAYOUTS = [layout for layout, names in RUNS.items() if "megatron_optimizer" in names]  # TP=2, PP=2, DP=2


def _id(layout: tuple[int, int, int]) -> str:
    return "tp{}pp{}dp{}".format(*layout)


def _results(megatron_launch: Any, layout: tuple[int, int, int]) -> list[dict[str, Any]]:
    return [res["megatron_optimizer"] for res in megatron_launch(layout)]


def _assert_same_training(got: dict[str, Any], ref: dict[str, Any], dtype: str, what: str) -> None:
    for s in range(MEGATRON_STEPS):
        a, b = got["steps"][s], ref["steps"][s]
        assert not a["skipped"] and a["step"] == s + 1 and a["lr"] == b["lr"]
        assert_close(torch.tensor(a["loss"]), torch.tensor(b["loss"]), dtype=dtype, quantity="loss",
                     what=f"{what} loss of step {s + 1}")
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5 if dtype == "float32" else 1e-2)
        for name, w in ref["weights"][s].items():
            assert got["weights"][s][name].dtype == w.dtype
            assert_close(got["weights"][s][name], w, dtype=dtype, quantity="weights",
                         what=f"{what} {name} after step {s + 1}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_megatron_optimizer_trains_like_torch_adamw(megatron_launch: Any, layout: tuple[int, int, int]) -> None:
    for rank, r in enumerate(_results(megatron_launch, layout)):
        assert r["torch"]["optimizer"] == "" and r["megatron"]["optimizer"] == "FP32Optimizer"
        _assert_same_training(r["megatron"], r["torch"], "float32", f"rank {rank} {_id(layout)} megatron")
        # the first update moved the weights far beyond the tolerance
        moved = max(float((r["torch"]["weights"][1][n] - w).abs().max()) for n, w in r["torch"]["weights"][0].items())
        assert moved > 1e-3


def test_distributed_optimizer_trains_like_torch_adamw_at_dp2(megatron_launch: Any) -> None:
    for rank, r in enumerate(_results(megatron_launch, MEGATRON_LOADER)):
        assert r["distributed"]["optimizer"] == "DistributedOptimizer"
        _assert_same_training(r["distributed"], r["torch"], "float32", f"rank {rank} distributed")


def test_megatron_optimizer_in_bfloat16_keeps_float32_main_params(megatron_launch: Any) -> None:
    for rank, r in enumerate(_results(megatron_launch, MEGATRON_SAVER)):
        got = r["megatron_bf16"]
        assert got["optimizer"] == "Float16OptimizerWithFloat16Params"
        _assert_same_training(got, r["torch_bf16"], "bfloat16", f"rank {rank} megatron bfloat16")
        assert got["master_dtypes"] == ["torch.float32"] and got["master_gap"] > 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_non_finite_gradients_skip_the_step(megatron_launch: Any, layout: tuple[int, int, int]) -> None:
    for r in _results(megatron_launch, layout):
        for name in [n for n in ("megatron", "distributed", "megatron_bf16", "torch") if n in r]:
            got = r[name]
            nan = got["nan"]
            assert nan["skipped"] and not torch.isfinite(torch.tensor(nan["grad_norm"])), name
            assert nan["step"] == MEGATRON_STEPS and got["unchanged"], f"{name}: a skipped step changed weights"
            after = got["after_nan"]  # the next step runs from clean gradients
            assert not after["skipped"] and after["step"] == MEGATRON_STEPS + 1 and got["grad_none"]
            assert after["grad_norm"] == pytest.approx(r["torch"]["after_nan"]["grad_norm"],
                                                       rel=1e-5 if "bf16" not in name else 1e-2)


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay[1] == 1], ids=_id)
def test_failed_forward_backward_leaves_no_gradients(megatron_launch: Any, layout: tuple[int, int, int]) -> None:
    for r in _results(megatron_launch, layout):
        f = r["failed_call"]
        assert f["raised"] == "injected failure in the second micro-batch" and f["calls"] == 2
        for name, g in f["after_failure"].items():
            assert not bool(g.any()), f"{name}: the failed call left gradients behind"
        assert any(float(g.abs().max()) > 0 for g in f["clean"].values())
        for name, g in f["clean"].items():
            assert torch.equal(f["resumed"][name], g), f"{name} differs from the run without a failure"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_checkpoint_round_trip_is_exact(megatron_launch: Any, layout: tuple[int, int, int]) -> None:
    for r in _results(megatron_launch, layout):
        assert r["ckpt_step"] == MEGATRON_STEPS + 1
        mine, restored, w_mine, w_restored = r["ckpt_next"]
        assert mine == restored
        for name, t in w_mine.items():
            assert torch.equal(t, w_restored[name]), f"{name} differs after a step from the restored checkpoint"
    for r in _results(megatron_launch, MEGATRON_LOADER):
        mine, restored, w_mine, w_restored = r["distributed_ckpt"]
        assert mine == restored
        for name, t in w_mine.items():
            assert torch.equal(t, w_restored[name]), f"{name}: distributed optimizer's checkpoint round trip"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_a_broken_checkpoint_is_refused_on_every_rank(megatron_launch: Any, layout: tuple[int, int, int]) -> None:
    for rank, r in enumerate(_results(megatron_launch, layout)):
        got = r["refused"]
        assert got["shape"].startswith("CheckpointError") and (
            "model tensor 'decoder.layers.1.mlp.linear_fc2.weight' is saved with shape (128, 1) dtype float32, "
            "this engine expects shape (128, 128) dtype float32") in got["shape"], (rank, got["shape"])
        assert got["moment"].startswith("CheckpointError") and (
            "optimizer state (exp_avg) tensor 'embedding.word_embeddings.weight' is saved with shape (1, 128)"
        ) in got["moment"], (rank, got["moment"])
        assert got["unchanged"], f"rank {rank}: a refused load changed the engine"


def test_tp2_checkpoint_loads_into_the_distributed_optimizer_at_dp2(megatron_launch: Any) -> None:
    saver = _results(megatron_launch, MEGATRON_SAVER)[0]
    next_step, _, weights, _ = saver["ckpt_next"]
    for rank, r in enumerate(_results(megatron_launch, MEGATRON_LOADER)):
        got = r["restored"]
        assert got["step"] == MEGATRON_STEPS + 1 and got["next"]["step"] == MEGATRON_STEPS + 2
        assert got["next"]["grad_norm"] == pytest.approx(next_step["grad_norm"], rel=1e-5)
        for name, w in weights.items():
            assert_close(got["weights"][name], w, dtype="float32", quantity="weights",
                         what=f"rank {rank} {name} after a step from TP=2's checkpoint")


@pytest.mark.parametrize(("options", "message"), [
    ({"distributed_optimizer": True}, "needs optimizer='megatron'"),
    ({"optimizer": "megatron", "during_rollout": "offload"}, "during_rollout='offload' is not supported"),
    ({"optimizer": "megatron", "master_weights": False}, "master_weights=False is not supported"),
    ({"optimizer": "adamw"}, r"'megatron.optimizer': 'adamw' is not valid; choices: 'torch', 'megatron'"),
    ({"optimizer": "megatron", "distributed_optimizer": 1}, "'megatron.distributed_optimizer': expected true or false, got 1"),
])
def test_unsupported_optimizer_options_are_rejected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MegatronOptions(**options)


def test_restored_adam_step_lives_where_the_optimizer_keeps_it() -> None:
    """A fused or capturable AdamW keeps ``step`` on the parameter's device (its CUDA kernel refuses a CPU
    step: the bfloat16 round trip on CUDA failed with "state_steps is on cpu"); a plain one on the CPU."""
    import torch

    from verl_megatron.core_optimizer import adam_step_tensor

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    on_meta = torch.zeros(2, device="meta")
    plain = adam_step_tensor(opt, 3, on_meta)
    assert plain.device.type == "cpu" and plain.dtype == torch.float32 and float(plain) == 3.0
    for flag in ("fused", "capturable"):
        opt.defaults[flag] = True
        assert adam_step_tensor(opt, 3, on_meta).device.type == "meta"
        opt.defaults[flag] = False
