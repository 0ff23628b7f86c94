"""Packed micro-batches (HFOptions.pack_sequences): the same outputs and gradients as padded ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_helpers import actor_spec, flat_grads, model_path

from verl_conformance.testkit import TinyModelSpec, assert_close, random_batch, tiny_model
from verl_core import ConfigError, GlobalBatchStats, OptimConfig, TensorBatch
from verl_core.algorithms import Algorithm
from verl_core.enginekit.packed_attention import packed_attention_counts
from verl_core.kernel.batch import partition_by_token_budget
from verl_core.trainer.batching.scheduler import (
    DynamicBatchScheduler,
    SchedulerConfig,
    train_mini_batch,
)
from verl_hf.config import HFOptions
from verl_hf.training import HFTrainingEngine

PPO = Algorithm.ppo(kl_coef=0.0, entropy_coef=0.01)


def _ragged_batch(seed: int = 3, **kw: object) -> TensorBatch:
    """Ragged prompts and responses, with a one-token response and an empty response."""
    batch = random_batch(batch_size=5, max_prompt=7, max_response=6, temperature=0.7, seed=seed,
                         empty_responses=1, **kw)  # type: ignore[arg-type]
    lengths = batch["response_mask"].sum(1).tolist()
    assert 1 in lengths and 0 in lengths, lengths  # the edge cases this file is about
    return batch


def _pair(path: str, **kw: object) -> tuple[HFTrainingEngine, HFTrainingEngine]:
    padded = HFTrainingEngine(actor_spec(path, options={"pack_sequences": False}, **kw))
    packed = HFTrainingEngine(actor_spec(path, options={"pack_sequences": True}, **kw))
    assert not padded.packs_sequences and packed.packs_sequences
    return padded, packed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_log_probs_and_entropy_equal_padded(arch: str) -> None:
    padded, packed = _pair(model_path(arch), micro_batch_size=3)
    batch = _ragged_batch()
    before = packed_attention_counts()
    a = padded.forward(batch, ["log_probs", "entropy"])
    b = packed.forward(batch, ["log_probs", "entropy"])
    after = packed_attention_counts()
    assert after["sdpa_loop"] > before["sdpa_loop"]  # CPU: the exact per-sequence loop ran
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0)
        assert bool((b[name][~batch["response_mask"]] == 0).all())
        assert float(b[name].abs().max()) > 0


@pytest.mark.parametrize(("arch", "checkpointing"), [("llama", False), ("qwen2", True)])
def test_packed_forward_backward_gives_padded_gradients(arch: str, checkpointing: bool) -> None:
    padded, packed = _pair(model_path(arch), micro_batch_size=2, gradient_checkpointing=checkpointing)
    batch = _ragged_batch(seed=3, with_rl_fields=True)
    old = padded.forward(batch, ["log_probs"])["log_probs"]
    batch = batch.update(old_log_probs=old + 0.05, ref_log_probs=old)
    stats = GlobalBatchStats.of(batch)
    ma = padded.forward_backward(batch, PPO.actor_loss, stats)
    mb = packed.forward_backward(batch, PPO.actor_loss, stats)
    assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-5)
    ga, gb = flat_grads(padded.model), flat_grads(packed.model)
    assert float(ga.norm()) > 0
    assert_close(gb, ga, dtype="float32", quantity="grad")


def test_packed_critic_values_and_gradients_equal_padded() -> None:
    padded, packed = _pair(model_path("qwen2", head="value"), role="critic", micro_batch_size=3,
                           optim=OptimConfig(lr=1e-4))
    batch = _ragged_batch(seed=3, with_rl_fields=True)
    va = padded.forward(batch, ["values"])["values"]
    vb = packed.forward(batch, ["values"])["values"]
    torch.testing.assert_close(vb, va, atol=1e-5, rtol=0)
    assert bool((vb[~batch["response_mask"]] == 0).all())
    loss = PPO.critic_loss
    assert loss is not None
    batch = batch.update(old_values=va + 0.1)
    stats = GlobalBatchStats.of(batch)
    padded.forward_backward(batch, loss, stats)
    packed.forward_backward(batch, loss, stats)
    assert_close(flat_grads(packed.model), flat_grads(padded.model), dtype="float32", quantity="grad")


def test_auto_keeps_padding_on_cpu() -> None:
    engine = HFTrainingEngine(actor_spec(model_path()))
    assert HFOptions().pack_sequences is None
    assert not engine.packs_sequences


def test_invalid_packing_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pack_sequences"):
        HFOptions(attn_implementation="eager", pack_sequences=True)
    with pytest.raises(ConfigError, match="pack_sequences"):
        HFOptions(pack_sequences="yes")  # type: ignore[arg-type]
    # a qwen2 folder with sliding-window layers: packing is refused when forced, off in auto
    folder = tmp_path / "sliding"
    shutil.copytree(tiny_model(TinyModelSpec(arch="qwen2")), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="pack_sequences=True.*sliding-window"):
        HFTrainingEngine(actor_spec(str(folder), options={"pack_sequences": True}))
    assert not HFTrainingEngine(actor_spec(str(folder))).packs_sequences


def test_packed_budget_runs_fewer_micro_batches_with_the_padded_results() -> None:
    # one fixed budget, the smallest one (the longest sequence): the scheduler counts a packing
    # engine's micro-batches by their real tokens, the engine cuts them alike, and the results match
    batch = _ragged_batch(seed=3, with_rl_fields=True)
    budget = int(batch.seq_lengths().max())
    lengths = batch.seq_lengths().tolist()
    expected = {pack: partition_by_token_budget(lengths, budget, packed=pack) for pack in (False, True)}
    assert len(expected[True]) < len(expected[False])
    padded, packed = _pair(model_path("llama"))
    assert not padded.capabilities.packed_sequences and packed.capabilities.packed_sequences
    old = padded.forward(batch, ["log_probs"])["log_probs"]
    batch = batch.update(old_log_probs=old + 0.05, ref_log_probs=old)
    stats = GlobalBatchStats.of(batch)
    metrics, grads = {}, {}
    for engine in (padded, packed):
        pack = engine.packs_sequences
        scheduler = DynamicBatchScheduler(SchedulerConfig(min_tokens=1))
        scheduler.fix_budget(budget)
        metrics[pack] = scheduler.run(
            batch, lambda b, e=engine: e.forward_backward(batch, PPO.actor_loss, stats, max_tokens=b),
            key="step0/actor/update0", training=True, packed=engine.capabilities.packed_sequences,
        )
        assert [list(g) for g in scheduler.plan[0].groups] == expected[pack]
        assert metrics[pack]["num_micro_batches"] == len(expected[pack])  # the engine ran the recorded plan
        grads[pack] = flat_grads(engine.model)
        engine.optimizer_step()
    assert metrics[True]["loss"] == pytest.approx(metrics[False]["loss"], abs=1e-5)
    assert float(grads[False].norm()) > 0
    assert_close(grads[True], grads[False], dtype="float32", quantity="grad")
    # the trainer's training call threads the engine's packing through to the recorded plan
    scheduler = DynamicBatchScheduler(SchedulerConfig(min_tokens=1))
    scheduler.fix_budget(budget)
    step = train_mini_batch(packed, scheduler, batch, PPO.actor_loss, key="step1/actor/update0")
    assert [list(g) for g in scheduler.plan[0].groups] == expected[True]
    assert step["num_micro_batches"] == len(expected[True])
