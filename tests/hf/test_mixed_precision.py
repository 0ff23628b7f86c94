"""bfloat16 training with float32 master weights: small updates accumulate instead of rounding away."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import actor_spec, model_path

from verl_conformance.testkit import random_batch
from verl_core import GlobalBatchStats, OptimConfig, TensorBatch
from verl_core.algorithms import Algorithm
from verl_core.enginekit.precision import MasterWeights
from verl_hf.training import HFTrainingEngine

GRPO = Algorithm.grpo(kl_loss_coef=0.0)
# Adam's normalised step is at most ~lr per weight: 1.5e-3 is below half of bfloat16's spacing
# just under 1.0 (2**-8 / 2 = 1.95e-3), so a norm weight initialised to 1.0 never moves in pure bfloat16.
SMALL_STEPS = OptimConfig(lr=1.5e-3, eps=1e-8, grad_clip=0.0)
STEPS = 8


def _batch(engine: HFTrainingEngine, seed: int) -> TensorBatch:
    batch = random_batch(batch_size=4, max_prompt=6, max_response=5, seed=seed, with_rl_fields=True)
    old = engine.forward(batch, ["log_probs"])["log_probs"]
    return batch.update(old_log_probs=old, ref_log_probs=old)


def _train(engine: HFTrainingEngine, steps: int) -> None:
    for step in range(steps):
        batch = _batch(engine, seed=step)
        engine.forward_backward(batch, GRPO.actor_loss, GlobalBatchStats.of(batch))
        assert not engine.optimizer_step().skipped


def _norm_weights(engine: HFTrainingEngine) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for n, p in engine.model.named_parameters() if "norm" in n])


def _engine(dtype: str, **options: object) -> HFTrainingEngine:
    return HFTrainingEngine(actor_spec(model_path("llama"), dtype=dtype, optim=SMALL_STEPS, micro_batch_size=4,
                                       options=dict(options)))


def test_master_weights_let_small_updates_accumulate() -> None:
    fp32, mixed, pure = _engine("float32"), _engine("bfloat16"), _engine("bfloat16", master_weights=False)
    start = _norm_weights(fp32)
    for e in (fp32, mixed, pure):
        _train(e, STEPS)
    moved32 = _norm_weights(fp32) - start
    assert float(moved32.abs().mean()) > SMALL_STEPS.lr  # the float32 run moves the norm weights
    # Pure bfloat16 rounds every one of those updates away.
    assert float((_norm_weights(pure) - start).abs().max()) == 0.0
    # With float32 masters the updates accumulate: the masters follow the float32 run (up to the
    # drift of bfloat16 gradients) and the model computes with their bfloat16 rounding.
    assert mixed._master is not None
    masters = torch.cat([m.detach().flatten() for (n, _), m in zip(mixed.model.named_parameters(),
                                                                  mixed._master.masters, strict=True) if "norm" in n])
    assert float(((masters - start) - moved32).abs().mean()) < 0.25 * float(moved32.abs().mean())
    assert torch.equal(_norm_weights(mixed), masters.bfloat16().float())
    assert float((_norm_weights(mixed) - start).abs().max()) > 0
    assert all(p.dtype == torch.bfloat16 for p in mixed.model.parameters())


def test_master_weights_survive_a_checkpoint(tmp_path: Path) -> None:
    a = _engine("bfloat16")
    _train(a, 3)
    a.save_checkpoint(tmp_path / "ckpt")
    b = _engine("bfloat16")
    b.load_checkpoint(tmp_path / "ckpt")
    for e in (a, b):
        _train(e, 2)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_master_weights_state_mismatch_is_a_clear_error() -> None:
    masters = MasterWeights([torch.zeros(2, 3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="shape"):
        masters.load_state([torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="1 trainable"):
        masters.load_state([])
