"""Old log-probs from the update's own forward when each batch gets one optimizer step.

With ``batch.old_log_probs = "auto"`` (the default) and one optimizer step per batch, the trainer
skips the actor's separate no-grad forward and the actor loss takes the detached log-probs of the
update's forward. Both give the same numbers: the runs below, one with each setting, produce the
same losses, gradient norms, metrics and weights, bit for bit (CPU, float32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core.trainer.config import load_config
from verl_core.trainer.rl.trainer import Trainer

BASE = [
    "task.name=copy", "task.digits=2", "task.reward=partial", "seed=3",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2", "model.num_kv_heads=1",
    "rollout.n=4", "rollout.max_new_tokens=4", "batch.prompts_per_step=4", "steps=3",
    "optim.lr=1e-2", "logging.progress=false", "logging.plot=false", "checkpoint.final=false",
    "batch.micro_batch_tokens=4096",
]


def _run(tmp: Path, *extra: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], int, bool]:
    cfg = load_config(None, [*BASE, f"output_dir={json.dumps(str(tmp))}", *extra])
    with Trainer(cfg) as trainer:
        trainer.setup()
        calls = 0
        actor = trainer.actor
        forward = actor.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return forward(*args, **kwargs)

        actor.forward = counted  # type: ignore[method-assign]
        history = trainer.train()
        weights = {n: t.detach().clone() for n, t in actor.model.named_parameters()}  # type: ignore[attr-defined]
        return history, weights, calls, trainer.on_policy_old_log_probs


@pytest.mark.parametrize("algorithm", [[], ["algorithm.options.kl_loss_coef=0.05"]], ids=["grpo", "grpo+kl_loss"])
def test_update_forward_old_log_probs_equal_a_separate_forward_bit_for_bit(tmp_path: Path, algorithm: list[str]) -> None:
    auto, w_auto, calls_auto, on_auto = _run(tmp_path / "auto", *algorithm)
    recompute, w_re, calls_re, on_re = _run(tmp_path / "recompute", *algorithm, "batch.old_log_probs=recompute")
    assert on_auto and not on_re
    assert calls_auto == 0 and calls_re == 3  # one separate actor forward per step, or none
    for a, r in zip(auto, recompute, strict=True):
        for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "reward/mean",
                    "actor/pg_clipfrac", "response/length_mean"):
            assert a[key] == r[key], (a["step"], key, a[key], r[key])
        # metrics only: the same values summed per micro-batch instead of over the whole batch
        assert a["actor/entropy"] == pytest.approx(r["actor/entropy"], rel=1e-6)
        if "actor/kl_ref" in r:
            assert a["actor/kl_ref"] == pytest.approx(r["actor/kl_ref"], rel=1e-6, abs=1e-9)
        assert a["logprob_mismatch/mean"] == pytest.approx(r["logprob_mismatch/mean"], rel=1e-5, abs=1e-9)
        assert a["actor/ppo_kl"] == 0.0
    assert w_auto.keys() == w_re.keys()
    for name in w_auto:
        assert torch.equal(w_auto[name], w_re[name]), name


@pytest.mark.parametrize("extra", [
    ["batch.epochs=2"],
    ["batch.mini_batch_size=8"],  # 16 samples: two optimizer steps per batch
    ["algorithm.name=rloo", "algorithm.options.kl_coef=0.05"],  # the KL penalty in the reward needs them before the update
])
def test_a_separate_forward_runs_when_the_batch_gets_more_than_one_update_or_needs_them_first(
    tmp_path: Path, extra: list[str]
) -> None:
    cfg = load_config(None, [*BASE, f"output_dir={json.dumps(str(tmp_path))}", *extra])
    with Trainer(cfg) as trainer:
        trainer.setup()
        assert not trainer.on_policy_old_log_probs
