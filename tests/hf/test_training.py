"""forward_backward, optimizer_step and export_weights of the hf training engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import actor_spec, flat_grads, model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import (
    ConfigError,
    GlobalBatchStats,
    LossOutput,
    OptimConfig,
    TensorBatch,
    WeightChunk,
    WeightCommit,
    WeightManifest,
)
from verl_core.algorithms import Algorithm
from verl_core.enginekit.weight_stream import fusion_group
from verl_core.kernel.training import ModelOutput
from verl_hf.training import HFTrainingEngine

PPO = Algorithm.ppo(kl_coef=0.0, entropy_coef=0.01)
GRPO = Algorithm.grpo(kl_loss_coef=0.01)


def _ppo_batch(engine: HFTrainingEngine, seed: int = 0, batch_size: int = 6) -> TensorBatch:
    batch = random_batch(batch_size=batch_size, max_prompt=7, max_response=6, seed=seed,
                         with_rl_fields=True, empty_responses=1)
    old = engine.forward(batch, ["log_probs"])["log_probs"]
    return batch.update(old_log_probs=old, ref_log_probs=old)


@pytest.mark.parametrize("layout", [{"micro_batch_size": 1}, {"micro_batch_size": 2}, {"micro_batch_tokens": 24}])
def test_gradients_do_not_depend_on_micro_batching(layout: dict[str, int]) -> None:
    path = model_path("qwen2")
    full = HFTrainingEngine(actor_spec(path))
    batch = _ppo_batch(full)
    stats = GlobalBatchStats.of(batch)
    loss = PPO.actor_loss
    assert "entropy" in loss.needs
    m_full = full.forward_backward(batch, loss, stats)
    split = HFTrainingEngine(actor_spec(path, **layout))
    m_split = split.forward_backward(batch, loss, stats)
    assert m_split["num_micro_batches"] > 1
    assert m_full["num_micro_batches"] == 1
    assert_close(torch.tensor(m_split["loss"]), torch.tensor(m_full["loss"]), dtype="float32", quantity="loss")
    assert set(m_split) == set(m_full)
    for key in m_full:
        if key != "num_micro_batches":
            assert m_split[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key
    assert_close(flat_grads(split.model), flat_grads(full.model), dtype="float32", quantity="grad")
    assert float(flat_grads(full.model).norm()) > 0


def test_ppo_update_lowers_the_loss() -> None:
    path = model_path("llama")
    engine = HFTrainingEngine(actor_spec(path, micro_batch_size=2, optim=OptimConfig(lr=1e-3, grad_clip=1.0)))
    batch = _ppo_batch(engine, seed=1)
    stats = GlobalBatchStats.of(batch)
    loss = PPO.actor_loss
    before = engine.forward_backward(batch, loss, stats)["loss"]
    step = engine.optimizer_step()
    assert not step.skipped and step.grad_norm > 0 and step.lr == pytest.approx(1e-3)
    after = engine.forward_backward(batch, loss, stats)["loss"]
    assert after < before


def test_grpo_update_lowers_the_loss() -> None:
    path = model_path("qwen3", tied=True)
    engine = HFTrainingEngine(actor_spec(path, micro_batch_tokens=30))
    batch = random_batch(batch_size=8, max_prompt=6, max_response=6, seed=2, with_rl_fields=True, group_size=4)
    old = engine.forward(batch, ["log_probs"])["log_probs"]
    batch = GRPO.compute_advantages(batch.update(old_log_probs=old, ref_log_probs=old))
    assert float(batch["advantages"].abs().sum()) > 0
    stats = GlobalBatchStats.of(batch)
    loss = GRPO.actor_loss
    before = engine.forward_backward(batch, loss, stats)["loss"]
    assert not engine.optimizer_step().skipped
    after = engine.forward_backward(batch, loss, stats)["loss"]
    assert after < before


def test_critic_update_lowers_value_loss() -> None:
    path = model_path("llama", head="value")
    # Adam's first step moves every weight by about lr; 1e-4 keeps the clipped value loss monotone.
    engine = HFTrainingEngine(actor_spec(path, role="critic", micro_batch_size=3, optim=OptimConfig(lr=1e-4)))
    batch = random_batch(batch_size=5, max_prompt=5, max_response=5, seed=3, with_rl_fields=True)
    stats = GlobalBatchStats.of(batch)
    loss = PPO.critic_loss
    assert loss is not None
    old = engine.forward(batch, ["values"])["values"]
    batch = batch.update(old_values=old)
    before = engine.forward_backward(batch, loss, stats)["loss"]
    engine.optimizer_step()
    after = engine.forward_backward(batch, loss, stats)["loss"]
    assert after < before


class _NaNLoss:
    @property
    def needs(self) -> frozenset[ModelOutput]:
        return frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        return LossOutput(batch["log_probs"].sum() * float("nan"))


class _RaisingLoss(_NaNLoss):
    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        raise RuntimeError("a failing loss")


def test_non_finite_grad_norm_skips_the_step() -> None:
    engine = HFTrainingEngine(actor_spec(model_path()))
    batch = _ppo_batch(engine)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.forward_backward(batch, _NaNLoss(), GlobalBatchStats.of(batch))
    step = engine.optimizer_step()
    assert step.skipped and not torch.isfinite(torch.tensor(step.grad_norm))
    assert engine.step == 0
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in engine.model.parameters())
    # The next good step runs from a clean slate.
    engine.forward_backward(batch, PPO.actor_loss, GlobalBatchStats.of(batch))
    assert not engine.optimizer_step().skipped and engine.step == 1


def test_lr_schedule_warmup_and_cosine() -> None:
    optim = OptimConfig(lr=1e-3, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.1)
    engine = HFTrainingEngine(actor_spec(model_path(), optim=optim))
    batch = _ppo_batch(engine)
    seen = []
    for _ in range(4):
        engine.forward_backward(batch, PPO.actor_loss, GlobalBatchStats.of(batch))
        seen.append(engine.optimizer_step().lr)
    assert seen == pytest.approx([optim.lr_at(i) for i in range(4)])


def test_gradient_clipping_bounds_the_update() -> None:
    path = model_path()
    engine = HFTrainingEngine(actor_spec(path, optim=OptimConfig(lr=1e-3, grad_clip=1e-3)))
    batch = _ppo_batch(engine)
    engine.forward_backward(batch, PPO.actor_loss, GlobalBatchStats.of(batch))
    raw = float(flat_grads(engine.model).norm())
    step = engine.optimizer_step()
    assert step.grad_norm == pytest.approx(raw, rel=1e-5)
    assert raw > 1e-3


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    path = model_path("qwen3")
    plain = HFTrainingEngine(actor_spec(path))
    ckpt = HFTrainingEngine(actor_spec(path, gradient_checkpointing=True))
    batch = _ppo_batch(plain)
    stats = GlobalBatchStats.of(batch)
    plain.forward_backward(batch, PPO.actor_loss, stats)
    ckpt.forward_backward(batch, PPO.actor_loss, stats)
    assert_close(flat_grads(ckpt.model), flat_grads(plain.model), dtype="float32", quantity="grad")


@pytest.mark.parametrize("tied", [False, True])
def test_export_weights_stream(tied: bool) -> None:
    engine = HFTrainingEngine(actor_spec(model_path("qwen2", tied=tied)))
    msgs = list(engine.export_weights(dtype=torch.bfloat16, bucket_bytes=20_000))
    manifest, chunks, commit = msgs[0], msgs[1:-1], msgs[-1]
    assert isinstance(manifest, WeightManifest) and isinstance(commit, WeightCommit)
    assert manifest.tied_embeddings is tied
    assert ("lm_head.weight" in manifest.tensors) is not tied
    assert all(isinstance(c, WeightChunk) for c in chunks) and len(chunks) > 2
    sent = [(n, t) for c in chunks if isinstance(c, WeightChunk) for n, t in c.tensors]
    assert [n for n, _ in sent] == list(manifest.tensors)
    assert all(t.dtype == torch.bfloat16 for _, t in sent)
    where: dict[str, set[int]] = {}
    for i, c in enumerate(chunks):
        assert isinstance(c, WeightChunk)
        for n, _ in c.tensors:
            where.setdefault(fusion_group(n), set()).add(i)
    assert all(len(v) == 1 for v in where.values())
    state = engine.model.state_dict()
    for n, t in sent:
        assert torch.equal(t, state[n].to(torch.bfloat16))


def test_bfloat16_training_step() -> None:
    engine = HFTrainingEngine(actor_spec(model_path("qwen2"), dtype="bfloat16", micro_batch_size=3))
    batch = _ppo_batch(engine, seed=4)
    assert batch["old_log_probs"].dtype == torch.float32
    stats = GlobalBatchStats.of(batch)
    before = engine.forward_backward(batch, GRPO.actor_loss, stats)["loss"]
    step = engine.optimizer_step()
    assert not step.skipped and step.grad_norm > 0
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    after = engine.forward_backward(batch, GRPO.actor_loss, stats)["loss"]
    assert after < before


def test_offload_round_trip_keeps_training_state() -> None:
    engine = HFTrainingEngine(actor_spec(model_path()))
    batch = _ppo_batch(engine)
    engine.forward_backward(batch, PPO.actor_loss, GlobalBatchStats.of(batch))
    engine.optimizer_step()
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.offload()
    engine.onload()
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, state[k])
    engine.forward_backward(batch, PPO.actor_loss, GlobalBatchStats.of(batch))
    assert not engine.optimizer_step().skipped


def test_the_shared_training_rules_hold(tmp_path: Path) -> None:
    """TrainingEngineBase's gates on a real engine: one call per optimizer step, the frozen reference,
    a failed call leaves nothing pending, a checkpoint load clears pending gradients."""
    path = model_path()
    engine = HFTrainingEngine(actor_spec(path))
    batch = _ppo_batch(engine)
    stats = GlobalBatchStats.of(batch)
    engine.forward_backward(batch, PPO.actor_loss, stats)
    with pytest.raises(ConfigError, match=r"forward_backward \(actor\): the gradients of the previous call"):
        engine.forward_backward(batch, PPO.actor_loss, stats)
    assert not engine.optimizer_step().skipped and engine.step == 1
    with pytest.raises(RuntimeError, match="a failing loss"):  # a call that raises leaves nothing pending
        engine.forward_backward(batch, _RaisingLoss(), stats)
    engine.forward_backward(batch, PPO.actor_loss, stats)
    engine.save_checkpoint(tmp_path / "ckpt")  # gradients pending at save time are not state
    engine.load_checkpoint(tmp_path / "ckpt")
    assert engine.step == 1
    engine.forward_backward(batch, PPO.actor_loss, stats)  # the load cleared the pending gradients
    reference = HFTrainingEngine(actor_spec(path, role="reference"))
    with pytest.raises(ConfigError, match=r"forward_backward \(reference\): the reference engine is frozen"):
        reference.forward_backward(batch, PPO.actor_loss, stats)
    with pytest.raises(ConfigError, match=r"optimizer_step \(reference\): the reference engine has no optimizer"):
        reference.optimizer_step()
