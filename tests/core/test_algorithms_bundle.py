"""The Algorithm bundle, registration by name, and config validation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from verl_core import (
    AlgorithmComponent,
    BatchValidationError,
    ConfigError,
    GlobalBatchStats,
    TensorBatch,
    UnknownNameError,
    hookimpl,
)
from verl_core.algorithms import (
    PRESETS,
    ActorLossConfig,
    Algorithm,
    CriticLossConfig,
    GAEConfig,
    GRPOConfig,
    OffPolicyConfig,
    PolicyLossConfig,
    RewardConfig,
    aggregate,
    kl_estimate,
)
from verl_core.kernel.algorithm import PolicyLossTerms
from verl_core.kernel.registry import get_registry, reset_registry


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    reset_registry()
    yield
    reset_registry()


def rl_batch(seed: int = 0) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4, 2, 0, 3, 4, 1])
    mask = torch.arange(4)[None, :] < lengths[:, None]

    def tok() -> torch.Tensor:
        return torch.randn(6, 4, generator=g).where(mask, 0.0)

    lp = -tok().abs()
    return TensorBatch({
        "response_mask": mask,
        "scores": torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 2.0]),
        "group_ids": torch.tensor([3, 3, 3, 8, 8, 9]),
        "values": tok(),
        "old_values": tok(),
        "old_log_probs": lp,
        "ref_log_probs": (lp - tok().abs() * 0.1).where(mask, 0.0),
        "rollout_log_probs": (lp + tok() * 0.05).where(mask, 0.0),
        "baseline_scores": torch.full((6,), 0.5),
    })


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_runs_a_full_step(name: str) -> None:
    algo = Algorithm.from_name(name)
    batch = rl_batch()
    out = algo.compute_advantages(batch)
    assert {"advantages", "returns"} <= set(out)
    # outcome estimators without KL in the reward take the scores as they are (no token rewards)
    from_scores = algo.estimator in ("grpo", "rloo", "reinforce_pp_baseline") and algo.reward.kl_coef == 0
    assert ("token_rewards" in out) != from_scores
    out.check(where=name)  # finite, canonical layout
    assert algo.advantage_fields <= set(batch)
    stats = GlobalBatchStats.of(out)
    lp = out["old_log_probs"].clone().requires_grad_(True)
    fields: dict[str, Any] = {"log_probs": lp}
    if "entropy" in algo.actor_loss.needs:
        fields["entropy"] = torch.ones_like(lp)
    res = algo.actor_loss(out.update(fields), stats)
    res.loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert {"pg_loss", "pg_clipfrac", "ppo_kl"} <= set(res.metrics)
    assert algo.uses_critic == (name == "ppo")
    if algo.critic_loss is not None:
        v = out["values"].clone().requires_grad_(True)
        algo.critic_loss(out.update(values=v), stats).loss.backward()
        assert v.grad is not None and torch.isfinite(v.grad).all()


def test_presets_set_the_documented_parts() -> None:
    assert Algorithm.grpo().estimator_config == GRPOConfig(norm_by_std=True)
    dr = Algorithm.dr_grpo(norm_length=512)
    assert dr.estimator_config == GRPOConfig(norm_by_std=False)
    assert dr.actor_loss.config.loss_agg_mode == "seq-mean-token-sum-norm"
    assert dr.actor_loss.config.norm_length == 512
    assert Algorithm.gspo().actor_loss.config.policy_loss == "gspo"
    assert Algorithm.gspo().actor_loss.config.loss_agg_mode == "seq-mean-token-mean"
    assert Algorithm.cispo().actor_loss.config.policy_loss == "cispo"
    dapo_like = Algorithm.grpo(clip_low=0.2, clip_high=0.28)
    assert dapo_like.actor_loss.config.policy == PolicyLossConfig(0.2, 0.28, 3.0)
    ppo = Algorithm.ppo(gamma=0.99, lam=0.95)
    assert ppo.estimator_config == GAEConfig(0.99, 0.95)
    assert ppo.uses_reference and ppo.critic_loss is not None
    assert Algorithm.reinforce_pp_baseline().estimator == "reinforce_pp_baseline"
    assert not Algorithm.dr_grpo().uses_reference
    assert Algorithm.grpo(offpolicy=OffPolicyConfig("tis", "sequence", 3.0)).actor_loss.batch_fields >= {"rollout_log_probs"}
    assert "rollout_log_probs" not in Algorithm.grpo(offpolicy=OffPolicyConfig("none", "sequence")).actor_loss.batch_fields


def test_dr_grpo_step_matches_manual_computation() -> None:
    algo = Algorithm.dr_grpo()
    batch = algo.compute_advantages(rl_batch())
    adv = batch["advantages"]
    # group 3: scores 1, 0, 1 (the empty response keeps its score) -> mean 2/3, no std division
    torch.testing.assert_close(adv[0], torch.full((4,), 1 / 3))
    torch.testing.assert_close(adv[1, :2], torch.full((2,), -2 / 3))
    stats = GlobalBatchStats.of(batch)
    lp = batch["old_log_probs"].clone().requires_grad_(True)
    out = algo.actor_loss(batch.update(log_probs=lp), stats)
    # on-policy: ratio 1, loss = -sum A / (S * L) with S = 5 non-empty sequences, L = 4
    mask = batch["response_mask"]
    assert float(out.loss.detach()) == pytest.approx(float(-(adv * mask).sum() / (5 * 4)), rel=1e-6)


def test_grpo_kl_loss_uses_reference() -> None:
    algo = Algorithm.grpo(kl_loss_coef=0.5, kl_loss_estimator="k3")
    batch = algo.compute_advantages(rl_batch())
    stats = GlobalBatchStats.of(batch)
    lp = batch["old_log_probs"]
    out = algo.actor_loss(batch.update(log_probs=lp), stats)
    mask = batch["response_mask"]
    kl = aggregate(kl_estimate(lp, batch["ref_log_probs"], "k3"), mask, "token-mean", stats)
    assert float(out.metrics["kl_loss"]) == pytest.approx(float(kl))
    assert float(out.loss) == pytest.approx(float(out.metrics["pg_loss"]) + 0.5 * float(kl), rel=1e-6)


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown algorithm 'ppg'; choices: ppo, grpo"):
        Algorithm.from_name("ppg")
    with pytest.raises(UnknownNameError, match=r"unknown advantage 'gea'; registered: .*gae.*grpo"):
        Algorithm("x", "gea")
    with pytest.raises(UnknownNameError, match=r"unknown policy_loss 'ppo2'; registered: .*cispo.*gspo.*ppo"):
        Algorithm("x", "grpo", actor=ActorLossConfig(policy_loss="ppo2"))
    with pytest.raises(UnknownNameError, match=r"unknown kl 'k4'; registered: .*k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(UnknownNameError, match=r"unknown aggregation 'mean'; registered: .*token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "mean", GlobalBatchStats(1, 1, 1, 1))


def test_builtin_components_are_registered_by_kind() -> None:
    reg = get_registry()
    assert {"gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"} <= set(reg.components("advantage"))
    assert {"ppo", "gspo", "cispo", "reinforce", "importance_sampling"} <= set(reg.components("policy_loss"))
    assert {"k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"} <= set(reg.components("kl"))
    assert {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"} <= set(
        reg.components("aggregation"))
    assert "clipped_mse" in reg.components("value_loss")
    assert reg.component("advantage", "gae").config_class is GAEConfig


class _ThirdParty:
    """A plugin adding an estimator and a policy loss through the public hook."""

    @staticmethod
    def const(batch: TensorBatch, config: Any) -> TensorBatch:
        adv = batch["response_mask"].float() * 2.0
        return batch.update(advantages=adv, returns=adv)

    @staticmethod
    def half_reinforce(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                       config: Any) -> PolicyLossTerms:
        no = torch.zeros_like(mask)
        return PolicyLossTerms(-0.5 * adv * lp, no, no, (lp - old).detach())

    @hookimpl
    def verl_algorithm_components(self) -> list[AlgorithmComponent]:
        return [AlgorithmComponent("advantage", "const2", self.const, None, "Advantage 2."),
                AlgorithmComponent("policy_loss", "half_reinforce", self.half_reinforce, None, "Half.")]


def test_third_party_components_plug_into_the_bundle() -> None:
    get_registry().register(_ThirdParty(), "third-party-algos")
    algo = Algorithm("custom", "const2", actor=ActorLossConfig(policy_loss="half_reinforce"))
    batch = algo.compute_advantages(rl_batch())
    assert torch.equal(batch["advantages"], batch["response_mask"].float() * 2)
    lp = batch["old_log_probs"].clone().requires_grad_(True)
    out = algo.actor_loss(batch.update(log_probs=lp), GlobalBatchStats.of(batch))
    out.loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, -batch["response_mask"].float() / int(batch["response_mask"].sum()))


class _DeclaringPlugin:
    """A third-party outcome estimator that declares a critic and a greedy baseline."""

    @staticmethod
    def estimate(batch: TensorBatch, config: Any) -> TensorBatch:
        adv = batch["response_mask"].float() * (batch["scores"] - batch["baseline_scores"])[:, None]
        return batch.update(advantages=adv, returns=adv)

    @hookimpl
    def verl_algorithm_components(self) -> list[AlgorithmComponent]:
        return [AlgorithmComponent.advantage(
            "declared", self.estimate, None, "Score minus a greedy baseline, with a critic.",
            reads=("baseline_scores", "values"), needs=("critic", "greedy_baseline"),
        )]


def test_what_an_algorithm_needs_comes_from_its_components_declarations() -> None:
    get_registry().register(_DeclaringPlugin(), "declaring-algos")
    with pytest.raises(ConfigError, match="'declared' estimator needs a critic"):
        Algorithm("custom", "declared")
    algo = Algorithm("custom", "declared", critic=CriticLossConfig())
    assert algo.needs == {"critic", "greedy_baseline"}
    assert algo.advantage_fields == {"response_mask", "baseline_scores", "values"}
    grpo = Algorithm.grpo()
    assert grpo.needs == {"groups", "reference"}  # GRPO's default KL loss reads the reference
    assert "group_ids" in grpo.advantage_fields
    assert Algorithm.remax().needs >= {"greedy_baseline"}
    assert Algorithm.ppo().needs >= {"critic"}


def test_builtin_components_are_built_with_the_typed_constructors() -> None:
    """Each kind's constructor fixes what the kind needs (mypy checks ``impl``'s signature)."""
    reg = get_registry()
    assert all(c.needs == {"reference"} for c in reg.components("kl").values())
    assert all("critic" in c.needs for c in reg.components("value_loss").values())
    outcome = sorted(n for n, c in reg.components("advantage").items() if c.outcome)
    assert outcome == ["grpo", "reinforce_pp_baseline", "rloo"]
    builtin = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "grpo_token")
    assert all("response_mask" in reg.component("advantage", n).reads for n in builtin)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: GAEConfig(gamma=1.5), r"option 'GAEConfig.gamma' = 1.5 is out of range; allowed: \[0.0, 1.0\]"),
    (lambda: GAEConfig(lam=-0.1), r"GAEConfig.lam"),
    (lambda: GRPOConfig(epsilon=0.0), r"'GRPOConfig.epsilon' = 0.0 .*\(0.0, inf\]"),
    (lambda: PolicyLossConfig(clip_low=-0.1), r"PolicyLossConfig.clip_low"),
    (lambda: PolicyLossConfig(clip_high=float("nan")), r"'PolicyLossConfig.clip_high': expected a finite number, got nan"),
    (lambda: PolicyLossConfig(clip_ratio_c=1.0), r"clip_ratio_c' = 1.0 .*\(1.0, inf\]"),
    (lambda: OffPolicyConfig("tis", upper=0.5), r"'OffPolicyConfig.upper' = 0.5 is out of range; allowed: \[1.0, inf\]"),
    (lambda: OffPolicyConfig("mis", lower=1.5), r"'OffPolicyConfig.lower' = 1.5 is out of range; allowed: \[0.0, 1.0\]"),
    (lambda: OffPolicyConfig(level="batch"), r"OffPolicyConfig.level': 'batch'.*'token', 'sequence', 'geometric'"),  # type: ignore[arg-type]
    (lambda: OffPolicyConfig(mode="is"), r"OffPolicyConfig.mode': 'is'.*'none', 'tis', 'mis'"),  # type: ignore[arg-type]
    (lambda: OffPolicyConfig("tis", lower=0.5), r"'lower' = 0.5 applies only to mode 'mis'.*remove lower or set mode"),
    (lambda: ActorLossConfig(loss_agg_mode="mean"), r"loss_agg_mode': 'mean'.*token-mean"),  # type: ignore[arg-type]
    (lambda: ActorLossConfig(entropy_coef=-1), r"entropy_coef"),
    (lambda: ActorLossConfig(norm_length=0), r"norm_length' = 0 .*>= 1"),
    (lambda: ActorLossConfig(kl_loss_estimator="k5"), r"kl_loss_estimator"),  # type: ignore[arg-type]
    (lambda: CriticLossConfig(clip_range_value=0.0), r"clip_range_value"),
    (lambda: RewardConfig(kl_coef=-0.1), r"RewardConfig.kl_coef"),
    (lambda: RewardConfig(controller="pid"), r"controller': 'pid'"),  # type: ignore[arg-type]
    (lambda: Algorithm("gae without critic", "gae"), r"needs a critic"),
    (lambda: Algorithm("x", "grpo", GAEConfig()), r"takes a GRPOConfig, got GAEConfig"),
    (lambda: Algorithm.grpo().replace(bogus=1), r"unknown argument"),
])
def test_configs_are_validated_on_construction(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_configs_are_frozen_and_replace_rebuilds() -> None:
    cfg = GAEConfig()
    with pytest.raises(AttributeError):
        cfg.gamma = 0.5  # type: ignore[misc]
    algo = Algorithm.grpo().replace(actor=ActorLossConfig(entropy_coef=0.01))
    assert algo.actor_loss.needs == {"log_probs", "entropy"}
    assert "grpo" in repr(algo)


def test_precomputed_token_rewards_are_used_without_kl_penalty() -> None:
    b = rl_batch()
    shaped = b.drop("scores").update(token_rewards=b["response_mask"].float() * 0.25)
    out, metrics = Algorithm.rloo().compute_advantages_with_metrics(shaped)
    assert metrics == {}
    assert torch.equal(out["token_rewards"], shaped["token_rewards"])
    with pytest.raises(BatchValidationError, match="scores"):
        Algorithm.ppo(kl_coef=0.1).compute_advantages(shaped)
    with pytest.raises(BatchValidationError, match="token_rewards"):
        Algorithm.rloo().compute_advantages(b.drop("scores"))
