"""OnPolicyActorLoss: the actor loss with old log-probs taken from the update's own forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_core import GlobalBatchStats, TensorBatch
from verl_core.algorithms import ActorLoss, ActorLossConfig, OffPolicyConfig
from verl_core.algorithms.onpolicy import OnPolicyActorLoss


def _batch(seed: int) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 0, 3, 7, 1, 7])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    noise = torch.randn(6, 7, generator=g)
    return TensorBatch({
        "prompt_ids": torch.ones(6, 2, dtype=torch.int64),
        "prompt_mask": torch.ones(6, 2, dtype=torch.bool),
        "response_mask": mask,
        "advantages": torch.randn(6, 7, generator=g) * mask,
        "ref_log_probs": (noise - 1.0) * mask,
        "rollout_log_probs": (noise - 1.1) * mask,
    })


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_loss_and_gradient_are_bit_equal_to_old_log_probs_from_a_separate_forward(policy_loss: str) -> None:
    batch = _batch(0)
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"]
    logits_lp = (torch.randn(6, 7, generator=g) - 2.0) * mask
    entropy = torch.rand(6, 7, generator=g) * mask
    stats = GlobalBatchStats.of(batch)
    config = ActorLossConfig(policy_loss=policy_loss, kl_loss_coef=0.1, offpolicy=OffPolicyConfig("tis", "token", 2.0))
    results = []
    for on_policy in (False, True):
        leaf = logits_lp.clone().requires_grad_(True)
        full = batch.update(log_probs=leaf, entropy=entropy)
        if on_policy:
            out = OnPolicyActorLoss(ActorLoss(config), compare_rollout=True)(full, stats)
        else:  # what the separate no-grad forward gives: the same log-probs, detached
            recompute = ActorLoss(dataclasses.replace(config, entropy_metric=True))
            out = recompute(full.update(old_log_probs=logits_lp.clone()), stats)
        out.loss.backward()
        assert leaf.grad is not None
        results.append((out.loss.detach(), leaf.grad, out.metrics))
    (loss0, grad0, m0), (loss1, grad1, m1) = results
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    for k, v in m0.items():
        assert torch.equal(v, m1[k]), k
    n = mask.sum()
    assert torch.allclose(m1["kl_ref"], ((logits_lp - batch["ref_log_probs"]) * mask).sum() / n)
    assert torch.allclose(m1["logprob_mismatch"], ((batch["rollout_log_probs"] - logits_lp).abs() * mask).sum() / n)
    assert float(m1["ppo_kl"]) == 0.0  # the ratio is exactly 1


def test_it_always_reports_entropy_and_does_not_need_old_log_probs() -> None:
    loss = OnPolicyActorLoss(ActorLoss())
    assert loss.needs == {"log_probs", "entropy"}
    assert "old_log_probs" not in loss.batch_fields and "advantages" in loss.batch_fields
    out = loss(_batch(2).update(log_probs=torch.zeros(6, 7), entropy=torch.ones(6, 7)),
               GlobalBatchStats.of(_batch(2)))
    assert float(out.metrics["entropy"]) == pytest.approx(1.0)
    assert "logprob_mismatch" not in out.metrics  # only when asked for
