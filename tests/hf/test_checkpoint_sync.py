"""Checkpoints (exact round trip, crash safety) and weight sync from the actor to the rollout engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import actor_spec, model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import (
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    SamplingParams,
    StreamWeightSync,
    TensorBatch,
)
from verl_core.algorithms import Algorithm
from verl_hf import checkpoint as ckpt_mod
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine

LOSS = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10, schedule="cosine", grad_clip=1.0)


def _batch(engine: HFTrainingEngine, seed: int) -> TensorBatch:
    b = random_batch(batch_size=4, max_prompt=5, max_response=5, seed=seed, with_rl_fields=True)
    return b.update(old_log_probs=engine.forward(b)["log_probs"])


def _train(engine: HFTrainingEngine, seed: int) -> None:
    b = _batch(engine, seed)
    engine.forward_backward(b, LOSS, GlobalBatchStats.of(b))
    assert not engine.optimizer_step().skipped


def _state(engine: HFTrainingEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_round_trip_is_exact(tmp_path: Path, tied: bool) -> None:
    path = model_path("qwen3", tied=tied)
    a = HFTrainingEngine(actor_spec(path, optim=OPTIM))
    _train(a, 0)
    a.save_checkpoint(tmp_path / "ck")
    rng_after_save = torch.rand(3)
    _train(a, 1)
    _train(a, 2)
    b = HFTrainingEngine(actor_spec(path, optim=OPTIM))
    b.load_checkpoint(tmp_path / "ck")
    assert b.step == 1
    assert torch.equal(torch.rand(3), rng_after_save)
    _train(b, 1)
    _train(b, 2)
    assert b.step == a.step == 3
    sa, sb = _state(a), _state(b)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert a.optimizer_step().lr == b.optimizer_step().lr


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_path()
    a = HFTrainingEngine(actor_spec(path, optim=OPTIM))
    _train(a, 0)
    a.save_checkpoint(tmp_path / "ck")
    saved = _state(a)
    _train(a, 1)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", crash)  # the model file is written, the trainer state is not
    with pytest.raises(OSError, match="simulated"):
        a.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    monkeypatch.setattr(ckpt_mod, "commit_state_dir", crash)  # everything written, not committed
    with pytest.raises(OSError, match="simulated"):
        a.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    b = HFTrainingEngine(actor_spec(path, optim=OPTIM))
    b.load_checkpoint(tmp_path / "ck")
    assert b.step == 1
    for k, v in _state(b).items():
        assert torch.equal(v, saved[k]), k
    # The next successful save replaces it and clears the leftovers.
    a.save_checkpoint(tmp_path / "ck")
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert len(names) == 2 and names[0] == "latest" and names[1].startswith("state-00000002-"), names
    b.load_checkpoint(tmp_path / "ck")
    assert b.step == 2


def test_loading_a_missing_checkpoint_says_what_to_do(tmp_path: Path) -> None:
    engine = HFTrainingEngine(actor_spec(model_path()))
    with pytest.raises(ConfigError, match="no checkpoint"):
        engine.load_checkpoint(tmp_path / "nothing")


@pytest.mark.parametrize("tied", [False, True])
def test_weight_sync_after_training_matches_actor(tied: bool) -> None:
    path = model_path("qwen2", tied=tied)
    actor = HFTrainingEngine(actor_spec(path, optim=OptimConfig(lr=1e-2, grad_clip=0.0)))
    engine = HFRolloutEngine(EngineSpec(model_path=path, role="rollout", max_response_len=16))
    prompts = random_batch(batch_size=3, max_prompt=5, max_response=1, seed=1).select(
        "prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(n=2, max_new_tokens=6, seed=3, temperature=0.8)
    before = engine.generate(prompts, params)
    _train(actor, 0)
    stale = actor.forward(before.with_meta(temperature=0.8))["log_probs"]
    assert (stale - before["rollout_log_probs"]).abs().max() > 1e-3, "training must change log-probs"
    report = StreamWeightSync(bucket_bytes=16_384).sync(actor, engine, version=1)
    manifest = next(iter(actor.export_weights()))
    assert report.num_tensors == len(manifest.tensors)  # type: ignore[union-attr]
    assert engine.weight_version == 1
    after = engine.generate(prompts, params)
    assert after.meta.weight_version == 1
    lp = actor.forward(after)["log_probs"]
    assert_close(after["rollout_log_probs"], lp, dtype="float32", quantity="log_probs")
