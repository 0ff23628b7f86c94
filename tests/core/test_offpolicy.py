"""The off-policy correction against the rollout engine's log-probs: ratios, weights, metrics.

Hand-computed values of every mode and level on tiny tensors, the loss with ``mode = "none"`` bit
for bit the uncorrected one, what masking does to the gradient, and the ratio statistics of a
whole batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_core import BatchValidationError, GlobalBatchStats, TensorBatch
from verl_core.algorithms import (
    ActorLoss,
    ActorLossConfig,
    Algorithm,
    OffPolicyConfig,
    actor_loss,
    correction_metrics,
    offpolicy_correction,
    ratio_statistics,
    rollout_log_ratio,
)

# two responses of 3 and 2 tokens (width 3); log(pi_old / pi_rollout) per token:
#   row 0: 0.5, -1.0, 0.2    row 1: 1.0, 0.1, (padding)
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.4, 0.0]])
DELTA = torch.tensor([[0.5, -1.0, 0.2], [1.0, 0.1, 0.0]])
ROLLOUT = (OLD - DELTA) * MASK


def _close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def _stats(mask: torch.Tensor) -> GlobalBatchStats:
    per = mask.sum(1)
    return GlobalBatchStats(mask.shape[0], int((per > 0).sum()), int(per.sum()), mask.shape[1])


def test_log_ratio_per_level_is_the_sum_or_mean_of_the_token_log_ratios() -> None:
    _close(rollout_log_ratio(OLD, ROLLOUT, MASK, "token"), [[0.5, -1.0, 0.2], [1.0, 0.1, 0.0]])
    _close(rollout_log_ratio(OLD, ROLLOUT, MASK, "sequence"), [[-0.3], [1.1]])
    _close(rollout_log_ratio(OLD, ROLLOUT, MASK, "geometric"), [[-0.1], [0.55]])


def test_tis_truncates_at_upper_per_token_and_per_response() -> None:
    e = math.exp
    tok = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("tis", "token", upper=1.5))
    _close(tok.weights, [[1.5, e(-1.0), e(0.2)], [1.5, e(0.1), 0.0]])
    assert tok.hit.tolist() == [[True, False, False], [True, False, False]]
    seq = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("tis", "sequence", upper=2.0))
    _close(seq.weights, [[e(-0.3)] * 3, [2.0, 2.0, 0.0]])  # exp(1.1) = 3.004 is truncated
    assert seq.hit.tolist() == [[False], [True]]
    geo = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("tis", "geometric", upper=1.5))
    _close(geo.weights, [[e(-0.1)] * 3, [1.5, 1.5, 0.0]])  # exp(0.55) = 1.733 is truncated
    _close(geo.unit_weights, [[e(-0.1)], [1.5]])
    assert geo.hit.tolist() == [[False], [True]]


def test_mis_keeps_ratios_inside_the_bounds_and_zeroes_the_rest() -> None:
    e = math.exp
    # lower defaults to 1 / upper = 0.5: e^-1 = 0.37 (too low) and e^1 = 2.7 (too high) are masked
    tok = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("mis", "token", upper=2.0))
    _close(tok.weights, [[e(0.5), 0.0, e(0.2)], [0.0, e(0.1), 0.0]])
    assert tok.hit.tolist() == [[False, True, False], [True, False, False]]
    low = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("mis", "token", upper=2.0, lower=0.3))
    _close(low.weights, [[e(0.5), e(-1.0), e(0.2)], [0.0, e(0.1), 0.0]])
    seq = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("mis", "sequence", upper=2.0))
    _close(seq.weights, [[e(-0.3)] * 3, [0.0, 0.0, 0.0]])  # the whole second response is dropped
    geo = offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig("mis", "geometric", upper=1.2))
    _close(geo.weights, [[e(-0.1)] * 3, [0.0, 0.0, 0.0]])


def test_sequence_ratios_are_taken_in_log_space_and_clamped() -> None:
    """200 tokens of log ratio 0.5: the product e^100 is clamped at e^20, never inf."""
    mask = torch.ones(1, 200, dtype=torch.bool)
    old = torch.full((1, 200), -1.0)
    c = offpolicy_correction(old, old - 0.5, mask, OffPolicyConfig("mis", "sequence", upper=10.0))
    assert float(c.ratio) == pytest.approx(math.exp(20.0), rel=1e-6)
    assert bool(c.hit.all()) and float(c.weights.abs().sum()) == 0.0
    t = offpolicy_correction(old, old - 0.5, mask, OffPolicyConfig("tis", "sequence", upper=10.0))
    assert torch.equal(t.weights, torch.full((1, 200), 10.0))


def test_an_empty_response_counts_as_no_unit() -> None:
    mask = torch.tensor([[True, False], [False, False]])
    old = torch.tensor([[-1.0, 0.0], [0.0, 0.0]])
    c = offpolicy_correction(old, old - 5.0, mask, OffPolicyConfig("tis", "sequence", upper=2.0))
    assert c.units.tolist() == [[True], [False]] and c.hit.tolist() == [[True], [False]]
    assert c.weights.tolist() == [[2.0, 0.0], [0.0, 0.0]]
    m = correction_metrics(c, OffPolicyConfig("tis", "sequence", upper=2.0), _stats(mask))
    assert float(m["offpolicy/truncated_frac"]) == 1.0 and float(m["offpolicy/weight_mean"]) == 2.0


def test_correction_metrics_are_means_over_the_level_s_units() -> None:
    e = math.exp
    cfg = OffPolicyConfig("tis", "token", upper=1.5)
    m = correction_metrics(offpolicy_correction(OLD, ROLLOUT, MASK, cfg), cfg, _stats(MASK))
    assert set(m) == {"offpolicy/weight_mean", "offpolicy/truncated_frac"}
    assert float(m["offpolicy/weight_mean"]) == pytest.approx((1.5 + e(-1.0) + e(0.2) + 1.5 + e(0.1)) / 5, rel=1e-6)
    assert float(m["offpolicy/truncated_frac"]) == pytest.approx(2 / 5)
    mis = OffPolicyConfig("mis", "sequence", upper=2.0)
    m = correction_metrics(offpolicy_correction(OLD, ROLLOUT, MASK, mis), mis, _stats(MASK))
    assert set(m) == {"offpolicy/weight_mean", "offpolicy/masked_frac"}
    assert float(m["offpolicy/weight_mean"]) == pytest.approx(e(-0.3) / 2, rel=1e-6)  # per response
    assert float(m["offpolicy/masked_frac"]) == pytest.approx(1 / 2)


def test_mode_none_takes_no_weights() -> None:
    with pytest.raises(ValueError, match="mode is 'none'"):
        offpolicy_correction(OLD, ROLLOUT, MASK, OffPolicyConfig())


LossRun = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _loss_run(config: ActorLossConfig, rollout: torch.Tensor | None) -> LossRun:
    g = torch.Generator().manual_seed(5)
    lp = (OLD + 0.1 * torch.randn(2, 3, generator=g)) * MASK
    adv = torch.randn(2, 3, generator=g) * MASK
    leaf = lp.clone().requires_grad_(True)
    out = actor_loss(config, _stats(MASK), log_probs=leaf, old_log_probs=OLD, advantages=adv, mask=MASK,
                     rollout_log_probs=rollout)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach(), grad, dict(out.metrics)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo", "reinforce", "importance_sampling"])
def test_mode_none_is_bit_for_bit_the_uncorrected_loss_whatever_the_other_keys(policy_loss: str) -> None:
    plain = _loss_run(ActorLossConfig(policy_loss=policy_loss), None)
    off = OffPolicyConfig("none", "sequence", upper=7.0)
    assert not ActorLoss(ActorLossConfig(policy_loss=policy_loss, offpolicy=off)).batch_fields & {"rollout_log_probs"}
    for rollout in (None, ROLLOUT):
        same = _loss_run(ActorLossConfig(policy_loss=policy_loss, offpolicy=off), rollout)
        assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])
        assert plain[2].keys() == same[2].keys()
        assert all(torch.equal(plain[2][k], same[2][k]) for k in plain[2])


def test_the_corrected_loss_weighs_each_token_s_gradient_and_masked_tokens_get_none() -> None:
    _, plain_grad, _ = _loss_run(ActorLossConfig(policy_loss="reinforce"), None)
    mis = OffPolicyConfig("mis", "token", upper=2.0)
    _, grad, metrics = _loss_run(ActorLossConfig(policy_loss="reinforce", offpolicy=mis), ROLLOUT)
    w = offpolicy_correction(OLD, ROLLOUT, MASK, mis).weights
    torch.testing.assert_close(grad, plain_grad * w)  # reinforce: d loss / d log pi_t = -A_t / N, weighted
    assert grad[0, 1] == 0.0 and grad[1, 0] == 0.0  # the masked tokens
    assert float(metrics["offpolicy/masked_frac"]) == pytest.approx(2 / 5)
    tis = OffPolicyConfig("tis", "sequence", upper=2.0)
    _, grad_s, _ = _loss_run(ActorLossConfig(policy_loss="reinforce", offpolicy=tis), ROLLOUT)
    torch.testing.assert_close(grad_s, plain_grad * torch.tensor([[math.exp(-0.3)] * 3, [2.0, 2.0, 0.0]]))


def test_ratio_statistics_of_a_whole_batch() -> None:
    batch = TensorBatch({"response_mask": MASK, "old_log_probs": OLD, "rollout_log_probs": ROLLOUT})
    tok = ratio_statistics(batch, OffPolicyConfig("tis", "token"))
    ratios = [math.exp(d) for d in (0.5, -1.0, 0.2, 1.0, 0.1)]
    assert tok["offpolicy/ratio_mean"] == pytest.approx(sum(ratios) / 5, rel=1e-6)
    assert tok["offpolicy/ratio_max"] == pytest.approx(math.exp(1.0), rel=1e-6)
    assert tok["offpolicy/ratio_min"] == pytest.approx(math.exp(-1.0), rel=1e-6)
    seq = ratio_statistics(batch, OffPolicyConfig("mis", "sequence"))
    assert seq["offpolicy/ratio_max"] == pytest.approx(math.exp(1.1), rel=1e-6)
    assert seq["offpolicy/ratio_min"] == pytest.approx(math.exp(-0.3), rel=1e-6)
    empty = batch.update(response_mask=torch.zeros(2, 3, dtype=torch.bool), old_log_probs=torch.zeros(2, 3),
                         rollout_log_probs=torch.zeros(2, 3))
    assert set(ratio_statistics(empty, OffPolicyConfig("tis")).values()) == {1.0}
    with pytest.raises(BatchValidationError, match="need rollout_log_probs"):
        ratio_statistics(TensorBatch({"response_mask": MASK, "old_log_probs": OLD}), OffPolicyConfig("tis"))


def test_the_advantage_step_reports_the_ratio_statistics_only_with_a_correction() -> None:
    batch = TensorBatch({"response_mask": MASK, "old_log_probs": OLD, "rollout_log_probs": ROLLOUT,
                         "scores": torch.tensor([1.0, 0.0]), "group_ids": torch.tensor([0, 0])})
    _, plain = Algorithm.grpo().compute_advantages_with_metrics(batch)
    assert not any(k.startswith("offpolicy/") for k in plain)
    _, on = Algorithm.grpo(offpolicy=OffPolicyConfig("tis", "geometric", 1.01)).compute_advantages_with_metrics(batch)
    assert on["offpolicy/ratio_max"] == pytest.approx(math.exp(0.55), rel=1e-6)
    assert on["offpolicy/ratio_min"] == pytest.approx(math.exp(-0.1), rel=1e-6)
    _, no_old = Algorithm.grpo(offpolicy=OffPolicyConfig("tis")).compute_advantages_with_metrics(
        batch.drop("old_log_probs"))
    assert not any(k.startswith("offpolicy/") for k in no_old)
