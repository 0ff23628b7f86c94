"""Multi-turn responses in the hf training engine: observation tokens (``loss_mask`` False) are
attended to but get no log-prob, entropy or value, and change neither the loss nor the gradients."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import actor_spec, flat_grads, model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import GlobalBatchStats, TensorBatch
from verl_core.algorithms import Algorithm, OffPolicyConfig
from verl_hf.training import HFTrainingEngine

# every actor term: policy loss, entropy bonus, KL loss, TIS weights
GRPO = Algorithm.grpo(kl_loss_coef=0.1, entropy_coef=0.01, offpolicy=OffPolicyConfig("tis", "token"))


def _multi_turn() -> TensorBatch:
    """Ragged samples whose responses hold observation tokens (two runs of them in sample 0)."""
    batch = random_batch(batch_size=5, max_prompt=6, max_response=9, seed=4, with_rl_fields=True,
                         empty_responses=1)
    rm = batch["response_mask"]
    loss_mask = rm.clone()
    loss_mask[:, 2:4] = False
    loss_mask[0, 6] = False
    # turn k: model turn k and the observation tokens after it
    turns = (torch.arange(9) >= 4).long().repeat(5, 1)
    turns[0, 7:] = 2
    out = batch.update(loss_mask=loss_mask, turn_ids=turns.where(rm, 0))
    assert bool((rm & ~loss_mask).any()) and int(loss_mask.sum()) > 5
    return out.check(where="test batch")


def _other_values_at_observations(batch: TensorBatch, seed: int) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    obs = batch["response_mask"] & ~batch["loss_mask"]
    names = ("advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs", "returns", "old_values")
    return batch.update({n: torch.where(obs, torch.randn(obs.shape, generator=g) * 2 - 3, batch[n]) for n in names})


@pytest.mark.parametrize("packed", [False, True])
def test_observation_tokens_get_no_outputs_but_are_attended_to(packed: bool) -> None:
    path = model_path("qwen2")
    engine = HFTrainingEngine(actor_spec(path, options={"pack_sequences": packed}, micro_batch_size=2))
    batch = _multi_turn()
    lm = batch["loss_mask"]
    out = engine.forward(batch, ["log_probs", "entropy"])
    assert not bool(out["log_probs"][~lm].any()) and not bool(out["entropy"][~lm].any())
    assert bool((out["log_probs"][lm] < 0).all()) and bool((out["entropy"][lm] > 0).all())
    # the sampled tokens read the observation tokens before them: the same numbers as a forward
    # that counts every response token
    full = engine.forward(batch.drop("loss_mask"), ["log_probs", "entropy"])
    for k in ("log_probs", "entropy"):
        assert_close(out[k][lm], full[k][lm], dtype="float32", quantity=k)
        assert bool(full[k][batch["response_mask"] & ~lm].ne(0).any())


@pytest.mark.parametrize("packed", [False, True])
def test_observation_tokens_change_neither_loss_nor_gradients(packed: bool) -> None:
    path = model_path("qwen2")

    def engine() -> HFTrainingEngine:
        return HFTrainingEngine(actor_spec(path, options={"pack_sequences": packed}, micro_batch_size=2))

    first = engine()
    batch = _multi_turn()
    old = first.forward(batch, ["log_probs"])["log_probs"]
    batch = batch.update(old_log_probs=old, ref_log_probs=old, rollout_log_probs=old)
    stats = GlobalBatchStats.of(batch)
    assert stats.num_tokens == int(batch["loss_mask"].sum())
    metrics_a = first.forward_backward(batch, GRPO.actor_loss, stats)
    second = engine()
    metrics_b = second.forward_backward(_other_values_at_observations(batch, 1), GRPO.actor_loss, stats)
    assert metrics_a == metrics_b
    grads = flat_grads(first.model)
    assert float(grads.norm()) > 0
    assert torch.equal(grads, flat_grads(second.model))
    # counting the observation tokens changes the result: the comparison above can fail
    counted = engine()
    single = _other_values_at_observations(batch, 1).drop("loss_mask")
    counted.forward_backward(single, GRPO.actor_loss, GlobalBatchStats.of(single))
    assert not torch.equal(grads, flat_grads(counted.model))


def test_critic_values_and_loss_ignore_observation_tokens() -> None:
    path = model_path("llama", head="value")
    ppo = Algorithm.ppo(kl_coef=0.0)
    assert ppo.critic_loss is not None
    critics = [HFTrainingEngine(actor_spec(path, role="critic")) for _ in range(2)]
    batch = _multi_turn()
    values = critics[0].forward(batch, ["values"])["values"]
    assert not bool(values[~batch["loss_mask"]].any()) and bool(values[batch["loss_mask"]].ne(0).any())
    batch = batch.update(values=values, old_values=values)
    stats = GlobalBatchStats.of(batch)
    m = [c.forward_backward(b, ppo.critic_loss, stats)
         for c, b in zip(critics, (batch, _other_values_at_observations(batch, 2)), strict=True)]
    assert m[0] == m[1]
    assert torch.equal(flat_grads(critics[0].model), flat_grads(critics[1].model))
