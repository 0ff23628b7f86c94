"""Advantage estimators and the reward step: float64 references, hand-computed cases, properties."""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import TensorBatch
from verl_core.algorithms import (
    Algorithm,
    GAEConfig,
    GRPOConfig,
    ReinforcePPConfig,
    RewardConfig,
    compute_token_rewards,
    discounted_cumsum,
    gae,
    grpo,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from verl_core.algorithms.advantages import _lengths, group_index
from verl_core.algorithms.kl import AdaptiveKLController, FixedKLController
from verl_core.kernel.errors import BatchValidationError
from verl_core.kernel.registry import get_registry

F64 = torch.float64
PROPS = settings(max_examples=30, deadline=None)


def make_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]


def random_batch(seed: int, lengths: list[int], width: int, groups: list[int], *, masked_junk: bool = False,
                 extra: bool = True) -> TensorBatch:
    """A batch with every field the estimators read; masked float positions hold 0 (or junk)."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.Generator().manual_seed(seed + 1)
    B = len(lengths)
    mask = make_mask(lengths, width)

    def tok(scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(B, width, generator=g) * scale
        if masked_junk:
            return torch.where(mask, x, torch.randn(B, width, generator=junk) * 100)
        return x.where(mask, 0.0)

    fields = {
        "response_mask": mask,
        "scores": torch.randn(B, generator=g),
        "group_ids": torch.tensor(groups, dtype=torch.int64),
    }
    if extra:
        fields |= {
            "values": tok(),
            "baseline_scores": torch.randn(B, generator=g),
            "old_log_probs": -tok().abs(),
            "ref_log_probs": -tok().abs(),
            "token_scores": tok(0.1),
        }
    return TensorBatch(fields)


# ----------------------------------------------------------------------------- float64 references
def ref_rewards(batch: TensorBatch) -> torch.Tensor:
    mask = batch["response_mask"]
    r = torch.zeros(mask.shape, dtype=F64)
    for b in range(batch.batch_size):
        n = int(mask[b].sum())
        for t in range(n):
            if "token_scores" in batch:
                r[b, t] += float(batch["token_scores"][b, t])
        if n and "scores" in batch:
            r[b, n - 1] += float(batch["scores"][b])
    return r


def ref_total(batch: TensorBatch) -> torch.Tensor:
    out = torch.zeros(batch.batch_size, dtype=F64)
    for b in range(batch.batch_size):
        out[b] = float(batch["scores"][b]) if "scores" in batch else 0.0
        n = int(batch["response_mask"][b].sum())
        if "token_scores" in batch:
            out[b] += sum(float(batch["token_scores"][b, t]) for t in range(n))
    return out


def ref_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = x[mask]
    n = vals.numel()
    if n <= 1:
        return torch.zeros_like(x)
    mean = vals.mean()
    var = ((vals - mean) ** 2).sum() / (n - 1)
    return torch.where(mask, (x - mean) / torch.sqrt(var + 1e-8), 0.0)


def ref_gae(batch: TensorBatch, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = batch["response_mask"]
    r = ref_rewards(batch)
    v = batch["values"].to(F64)
    adv = torch.zeros_like(r)
    for b in range(batch.batch_size):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = float(v[b, t + 1]) if t + 1 < n else 0.0
            delta = float(r[b, t]) + gamma * nv - float(v[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
    returns = torch.where(mask, adv + v, 0.0)
    return ref_whiten(adv, mask), returns


def ref_group_stats(batch: TensorBatch) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, gid in enumerate(batch["group_ids"].tolist()):
        groups.setdefault(gid, []).append(i)
    return groups


def ref_grpo(batch: TensorBatch, norm: bool, eps: float = 1e-6) -> torch.Tensor:
    s = ref_total(batch)
    out = torch.zeros_like(s)
    for members in ref_group_stats(batch).values():
        x = s[members]
        mean, std = (x.mean(), x.std()) if len(members) > 1 else (torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64))
        out[members] = (x - mean) / (std + eps) if norm else x - mean
    return torch.where(batch["response_mask"], out[:, None], 0.0)


def ref_rloo(batch: TensorBatch) -> torch.Tensor:
    s = ref_total(batch)
    out = s.clone()
    for members in ref_group_stats(batch).values():
        if len(members) > 1:
            for i in members:
                others = [s[j] for j in members if j != i]
                out[i] = s[i] - sum(others) / len(others)
    return torch.where(batch["response_mask"], out[:, None], 0.0)


def ref_discounted(x: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=F64)
    running = torch.zeros(x.shape[0], dtype=F64)
    for t in reversed(range(x.shape[1])):
        running = x[:, t].to(F64) + gamma * running
        out[:, t] = running
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(a.to(F64), b.to(F64), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- hand-computed cases
def test_grpo_hand_computed() -> None:
    mask = make_mask([2, 1, 3, 1], 3)
    b = TensorBatch({"response_mask": mask, "scores": torch.tensor([1.0, 0.0, 1.0, 5.0]),
                     "group_ids": torch.tensor([7, 7, 7, 9])})
    out = grpo(b)
    # group 7: mean 2/3, unbiased std sqrt(1/3); group 9 (size one): mean 0, std 1
    s = 1 / math.sqrt(3)
    expect = [[(1 / 3) / (s + 1e-6)] * 2 + [0], [(-2 / 3) / (s + 1e-6), 0, 0], [(1 / 3) / (s + 1e-6)] * 3,
              [5 / (1 + 1e-6), 0, 0]]
    close(out["advantages"], torch.tensor(expect, dtype=F64), 1e-6)
    assert torch.equal(out["advantages"], out["returns"])
    dr = grpo(b, GRPOConfig(norm_by_std=False))
    close(dr["advantages"][:, 0], torch.tensor([1 / 3, -2 / 3, 1 / 3, 5.0], dtype=F64), 1e-6)


def test_rloo_hand_computed() -> None:
    b = TensorBatch({"response_mask": make_mask([1, 1, 1, 1], 1), "scores": torch.tensor([1.0, 2.0, 6.0, 4.0]),
                     "group_ids": torch.tensor([0, 0, 0, 1])})
    out = rloo(b)["advantages"][:, 0]
    close(out, torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 4.0], dtype=F64), 1e-6)


def test_gae_hand_computed() -> None:
    # one response of 3 tokens, reward 1 on the last token, gamma=0.5, lam=0.5, no whitening
    b = TensorBatch({"response_mask": make_mask([3], 4), "scores": torch.tensor([1.0]),
                     "values": torch.tensor([[0.5, 0.25, 1.0, 0.0]])})
    out = gae(b, GAEConfig(gamma=0.5, lam=0.5, whiten=False))
    d2 = 1.0 - 1.0  # r + 0 - V2
    d1 = 0.0 + 0.5 * 1.0 - 0.25
    d0 = 0.0 + 0.5 * 0.25 - 0.5
    a2 = d2
    a1 = d1 + 0.25 * a2
    a0 = d0 + 0.25 * a1
    close(out["advantages"], torch.tensor([[a0, a1, a2, 0]], dtype=F64), 1e-7)
    close(out["returns"], torch.tensor([[a0 + 0.5, a1 + 0.25, a2 + 1.0, 0]], dtype=F64), 1e-7)


def test_remax_and_reinforce_pp_hand_computed() -> None:
    b = TensorBatch({"response_mask": make_mask([3, 2], 3), "scores": torch.tensor([2.0, -1.0]),
                     "baseline_scores": torch.tensor([0.5, 1.0]), "token_scores": torch.tensor([[0.1, 0.2, 0.3], [1.0, 0.0, 9.0]])})
    out = remax(b)
    close(out["returns"], torch.tensor([[2.6, 2.5, 2.3], [0.0, -1.0, 0.0]], dtype=F64), 1e-6)
    close(out["advantages"], torch.tensor([[2.1, 2.0, 1.8], [-1.0, -2.0, 0.0]], dtype=F64), 1e-6)
    rpp = reinforce_pp(b, ReinforcePPConfig(gamma=0.5, whiten=False))
    close(rpp["returns"], torch.tensor([[0.1 + 0.5 * 0.2 + 0.25 * 2.3, 0.2 + 0.5 * 2.3, 2.3], [1 - 0.5, -1.0, 0]],
                                       dtype=F64), 1e-6)


def test_reinforce_pp_baseline_matches_reference() -> None:
    b = random_batch(3, [3, 0, 2, 4, 1], 4, [0, 0, 0, 1, 2], extra=False)
    out = reinforce_pp_baseline(b)
    s = ref_total(b)
    mean = {0: s[:3].mean(), 1: 0.0, 2: 0.0}
    base = torch.stack([s[i] - mean[g] for i, g in enumerate([0, 0, 0, 1, 2])])
    expect = ref_whiten(torch.where(b["response_mask"], base[:, None], 0.0), b["response_mask"])
    close(out["advantages"], expect)
    assert torch.equal(out["advantages"], out["returns"])


@pytest.mark.parametrize("gamma", [0.0, 0.3, 0.99, 1.0])
@pytest.mark.parametrize("width", [1, 5, 64, 65, 200])
def test_discounted_cumsum_matches_recursion(gamma: float, width: int) -> None:
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(width), dtype=F64)
    close(discounted_cumsum(x, gamma), ref_discounted(x, gamma), 1e-12)
    close(discounted_cumsum(x.float(), gamma), ref_discounted(x, gamma), 1e-5)


def test_masked_whiten_edge_cases() -> None:
    x = torch.tensor([[3.0, 1.0], [2.0, 7.0]])
    assert torch.equal(masked_whiten(x, torch.zeros(2, 2, dtype=torch.bool)), torch.zeros(2, 2))
    one = torch.tensor([[True, False], [False, False]])
    assert torch.equal(masked_whiten(x, one), torch.zeros(2, 2))
    m = torch.tensor([[True, True], [True, False]])
    close(masked_whiten(x, m), ref_whiten(x.double(), m))


# ----------------------------------------------------------------------------- random vs references
@st.composite
def shapes(draw: st.DrawFn, max_b: int = 8, max_t: int = 7) -> tuple[int, list[int], int, list[int]]:
    width = draw(st.integers(0, max_t))
    B = draw(st.integers(1, max_b))
    lengths = draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    groups = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    return draw(st.integers(0, 2**31 - 1)), lengths, width, groups


@PROPS
@given(shapes(), st.sampled_from([0.0, 0.7, 1.0]), st.sampled_from([0.0, 0.9, 1.0]))
def test_gae_matches_reference(shape: tuple[int, list[int], int, list[int]], gamma: float, lam: float) -> None:
    b = random_batch(*shape)
    out = gae(b, GAEConfig(gamma=gamma, lam=lam))
    adv, ret = ref_gae(b, gamma, lam)
    close(out["returns"], ret)
    close(out["advantages"], adv, 1e-4)


@PROPS
@given(shapes(), st.booleans())
def test_group_estimators_match_reference(shape: tuple[int, list[int], int, list[int]], norm: bool) -> None:
    b = random_batch(*shape)
    close(grpo(b, GRPOConfig(norm_by_std=norm))["advantages"], ref_grpo(b, norm), 1e-4)
    close(rloo(b)["advantages"], ref_rloo(b))


@PROPS
@given(shapes())
def test_reinforce_pp_and_remax_match_reference(shape: tuple[int, list[int], int, list[int]]) -> None:
    b = random_batch(*shape)
    mask = b["response_mask"]
    g = ref_discounted(ref_rewards(b), 0.9)
    out = reinforce_pp(b, ReinforcePPConfig(gamma=0.9))
    close(out["returns"], torch.where(mask, g, 0.0))
    close(out["advantages"], ref_whiten(torch.where(mask, g, 0.0), mask), 1e-4)
    rm = remax(b)
    g1 = torch.where(mask, ref_discounted(ref_rewards(b), 1.0), 0.0)
    close(rm["returns"], g1)
    close(rm["advantages"], torch.where(mask, g1 - b["baseline_scores"].double()[:, None], 0.0))


# ----------------------------------------------------------------------------- properties
ESTIMATORS = {
    "gae": lambda b: gae(b, GAEConfig(gamma=0.9, lam=0.8)),
    "grpo": grpo,
    "dr_grpo": lambda b: grpo(b, GRPOConfig(norm_by_std=False)),
    "rloo": rloo,
    "reinforce_pp": lambda b: reinforce_pp(b, ReinforcePPConfig(gamma=0.95)),
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "remax": remax,
}


@PROPS
@given(shapes(), st.sampled_from(sorted(ESTIMATORS)))
def test_masked_positions_never_change_results(shape: tuple[int, list[int], int, list[int]], name: str) -> None:
    clean = random_batch(*shape)
    junk = random_batch(*shape, masked_junk=True)
    a, b = ESTIMATORS[name](clean), ESTIMATORS[name](junk)
    assert torch.equal(a["advantages"], b["advantages"])
    assert torch.equal(a["returns"], b["returns"])
    mask = a["response_mask"]
    assert not a["advantages"][~mask].any() and not a["returns"][~mask].any()
    assert torch.isfinite(a["advantages"]).all() and torch.isfinite(a["returns"]).all()


@PROPS
@given(shapes(max_b=12))
def test_grpo_zero_mean_per_group(shape: tuple[int, list[int], int, list[int]]) -> None:
    seed, lengths, width, groups = shape
    b = random_batch(seed, [max(1, n) for n in lengths], max(width, 1), groups, extra=False)
    for norm in (True, False):
        first = grpo(b, GRPOConfig(norm_by_std=norm))["advantages"][:, 0].double()
        for gid in set(groups):
            members = [i for i, g in enumerate(groups) if g == gid]
            if len(members) > 1:
                assert abs(float(first[members].sum())) < 1e-5 * len(members)


@PROPS
@given(st.integers(1, 6), st.floats(-1e3, 1e3), st.integers(0, 4))
def test_identical_rewards_give_zero_advantages(n: int, score: float, width: int) -> None:
    b = TensorBatch({"response_mask": make_mask([width] * n, width), "scores": torch.full((n,), score),
                     "group_ids": torch.zeros(n, dtype=torch.int64)})
    for est in (grpo, rloo, reinforce_pp_baseline):
        adv = est(b)["advantages"]
        assert torch.isfinite(adv).all()
        if n > 1:
            assert torch.equal(adv, torch.zeros_like(adv))


@PROPS
@given(shapes(), st.floats(-10, 10))
def test_rloo_baseline_excludes_self(shape: tuple[int, list[int], int, list[int]], new_score: float) -> None:
    seed, lengths, width, groups = shape
    b = random_batch(seed, [max(1, n) for n in lengths], max(width, 1), groups, extra=False)
    scores = b["scores"].clone()
    scores[0] = new_score
    b2 = b.update(scores=scores)
    base1 = b["scores"].double() - rloo(b)["advantages"][:, 0].double()
    base2 = b2["scores"].double() - rloo(b2)["advantages"][:, 0].double()
    if groups.count(groups[0]) > 1:  # the baseline of sample 0 does not see its own score
        assert abs(float(base1[0] - base2[0])) < 1e-5


@PROPS
@given(shapes())
def test_gae_gamma_lambda_one_is_reward_to_go_minus_values(shape: tuple[int, list[int], int, list[int]]) -> None:
    b = random_batch(*shape)
    out = gae(b, GAEConfig(gamma=1.0, lam=1.0, whiten=False))
    mask = b["response_mask"]
    to_go = ref_discounted(ref_rewards(b), 1.0)
    close(out["advantages"], torch.where(mask, to_go - b["values"].double(), 0.0))
    close(out["advantages"], (out["returns"] - b["values"]).where(mask, 0.0))


def test_empty_responses_and_groups_of_one_are_finite() -> None:
    b = random_batch(0, [0, 0, 3, 0], 3, [0, 1, 1, 2])
    for name, est in ESTIMATORS.items():
        out = est(b)
        assert torch.isfinite(out["advantages"]).all(), name
        assert not out["advantages"][0].any() and not out["advantages"][3].any(), name
    all_empty = random_batch(1, [0, 0], 0, [0, 0])
    for est in ESTIMATORS.values():
        assert est(all_empty)["advantages"].shape == (2, 0)
    no_samples = random_batch(2, [], 70, [])
    for est in ESTIMATORS.values():
        assert est(no_samples)["advantages"].shape == (0, 70)
    # a group of one under GRPO is its raw score (mean 0, std 1)
    single = grpo(b)["advantages"]
    assert single[2, 0] != 0


def test_empty_response_keeps_its_score_in_group_stats() -> None:
    b = TensorBatch({"response_mask": make_mask([0, 2], 2), "scores": torch.tensor([1.0, 3.0]),
                     "group_ids": torch.tensor([0, 0])})
    with_rewards, _ = compute_token_rewards(b)
    adv = grpo(with_rewards)["advantages"]
    # mean 2, std sqrt(2): sample 1 gets (3 - 2) / sqrt(2)
    close(adv[1], torch.full((2,), 1 / (math.sqrt(2) + 1e-6), dtype=F64), 1e-6)


def test_estimators_require_fields() -> None:
    b = TensorBatch({"response_mask": make_mask([1], 1), "scores": torch.ones(1)})
    with pytest.raises(BatchValidationError, match="group_ids"):
        grpo(b)
    with pytest.raises(BatchValidationError, match="values"):
        gae(b)
    with pytest.raises(BatchValidationError, match="baseline_scores"):
        remax(b)
    with pytest.raises(BatchValidationError, match="scores"):
        rloo(TensorBatch({"response_mask": make_mask([1], 1), "group_ids": torch.zeros(1, dtype=torch.int64)}))


# ----------------------------------------------------------------------------- reward step and KL controllers
def test_token_rewards_place_score_on_last_token_with_kl_penalty() -> None:
    mask = make_mask([2, 3, 0], 3)
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.5, -0.25], [0.0, 0.0, 0.0]])
    b = TensorBatch({"response_mask": mask, "scores": torch.tensor([1.0, 2.0, 3.0]),
                     "old_log_probs": old, "ref_log_probs": ref})
    out, metrics = compute_token_rewards(b, RewardConfig(kl_coef=0.1, kl_estimator="k1"))
    k1 = torch.where(mask, old - ref, 0.0)
    expect = torch.tensor([[0, 1.0, 0], [0, 0, 2.0], [0, 0, 0]]) - 0.1 * k1
    close(out["token_rewards"], expect, 1e-6)
    per_seq = [float(k1[0].sum()) / 2, float(k1[1].sum()) / 3]
    assert metrics["reward_kl"] == pytest.approx(sum(per_seq) / 2)
    assert metrics["reward_kl_coef"] == 0.1


def test_adaptive_kl_controller_follows_verl_rule() -> None:
    ctl = AdaptiveKLController(value=0.2, target=0.1, horizon=100.0)
    ctl.update(current_kl=0.3, n_steps=10)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 10 / 100))
    ctl.update(current_kl=0.09, n_steps=10)  # error -0.1
    assert ctl.value == pytest.approx(0.2 * 1.02 * (1 - 0.1 * 0.1))
    fixed = FixedKLController(0.5)
    fixed.update(1.0, 10)
    assert fixed.value == 0.5


def test_algorithm_updates_adaptive_coefficient_per_call() -> None:
    algo = Algorithm.ppo(kl_coef=0.1, kl_controller="adaptive", target_kl=0.01, horizon=10)
    b = random_batch(5, [3, 2], 3, [0, 0])
    out, metrics = algo.compute_advantages_with_metrics(b)
    assert metrics["reward_kl_coef"] == 0.1
    assert algo.kl_controller.value != 0.1
    assert {"token_rewards", "advantages", "returns"} <= set(out)
    state = algo.state_dict()
    fresh = Algorithm.ppo(kl_coef=0.1, kl_controller="adaptive", target_kl=0.01, horizon=10)
    fresh.load_state_dict(state)
    assert fresh.kl_controller.value == algo.kl_controller.value


# ----------------------------------------------------------------------------- outcome estimators from scores
OUTCOME_ALGORITHMS: dict[str, Callable[[], Algorithm]] = {
    "grpo": Algorithm.grpo,
    "dr_grpo": Algorithm.dr_grpo,
    "rloo": Algorithm.rloo,
    "reinforce_pp_baseline": lambda: Algorithm.reinforce_pp_baseline(kl_coef=0.0),
    "gspo": Algorithm.gspo,
    "cispo": Algorithm.cispo,
}


def through_token_rewards(algo: Algorithm, batch: TensorBatch) -> tuple[TensorBatch, dict[str, float]]:
    """The advantage step that builds ``token_rewards`` from the scores, then sums them back per row."""
    shaped, metrics = compute_token_rewards(batch, algo.reward, algo.kl_controller)
    impl = get_registry().component("advantage", algo.estimator).impl
    return impl(shaped, algo.estimator_config), metrics


def assert_same_bits(a: TensorBatch, b: TensorBatch) -> None:
    """Equal advantages and returns, bit for bit (the sign of zero included)."""
    for k in ("advantages", "returns"):
        assert a[k].dtype == b[k].dtype == torch.float32
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


@PROPS
@given(shapes(max_t=140), st.sampled_from(sorted(OUTCOME_ALGORITHMS)), st.booleans(), st.booleans())
def test_outcome_estimators_from_scores_equal_summed_token_rewards(
    shape: tuple[int, list[int], int, list[int]], name: str, junk: bool, zeros: bool
) -> None:
    """Without KL in the reward the step takes ``scores`` directly: same bits, no ``token_rewards``."""
    b = random_batch(*shape, masked_junk=junk).drop("token_scores")
    if zeros:  # signed zeros, whose sign the row sum of the built rewards drops (0 + -0 = +0)
        s = b["scores"]
        b = b.update(scores=torch.where(s < 0, -0.0, torch.where(s < 0.5, 0.0, s)))
    algo = OUTCOME_ALGORITHMS[name]()
    out, metrics = algo.compute_advantages_with_metrics(b)
    ref, ref_metrics = through_token_rewards(algo, b)
    assert "token_rewards" not in out and set(out) == set(ref) - {"token_rewards"}
    assert_same_bits(out, ref)
    assert metrics == ref_metrics == {"reward_kl_coef": 0.0}


def test_outcome_step_from_scores_on_empty_responses_groups_of_one_and_block_edges() -> None:
    lengths = [0, 5, 64, 0, 130, 1, 128, 127, 0]
    groups = [0, 0, 0, 1, 2, 2, 3, 3, 4]  # groups 1 and 4 hold one (empty) response
    b = random_batch(3, lengths, 130, groups, masked_junk=True).drop("token_scores")
    b = b.update(scores=torch.tensor([-0.0, 1.0, 0.0, -0.0, 3e38, -2.5, 0.0, -0.0, 7.0]))
    for name, make in OUTCOME_ALGORITHMS.items():
        algo = make()
        out = algo.compute_advantages(b)
        assert "token_rewards" not in out, name
        assert_same_bits(out, through_token_rewards(algo, b)[0])
    # an empty group of one keeps its raw score under GRPO (verl's mean 0, std 1): nothing in the row
    assert not Algorithm.grpo().compute_advantages(b)["advantages"][[0, 3, 8]].any()


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (lambda: Algorithm.rloo(kl_coef=0.1), ("scores",)),  # KL in the reward
        (Algorithm.reinforce_pp_baseline, ("scores",)),  # its default KL coefficient, 0.001
        (Algorithm.grpo, ("scores", "token_scores")),  # dense scores
        (lambda: Algorithm.reinforce_pp(kl_coef=0.0), ("scores",)),  # a per-token estimator
        (lambda: Algorithm.remax(kl_coef=0.0), ("scores",)),
    ],
)
def test_token_rewards_are_still_built_when_the_outcome_is_not_the_score(
    make: Callable[[], Algorithm], fields: tuple[str, ...]
) -> None:
    b = random_batch(4, [0, 3, 7, 2, 7, 1], 7, [0, 0, 1, 1, 2, 3], masked_junk=True)
    b = b.drop(*({"scores", "token_scores"} - set(fields)))
    algo, ref_algo = make(), make()
    out, metrics = algo.compute_advantages_with_metrics(b)
    ref, ref_metrics = through_token_rewards(ref_algo, b)
    assert "token_rewards" in out and torch.equal(out["token_rewards"], ref["token_rewards"])
    assert_same_bits(out, ref)
    assert metrics == ref_metrics


def test_scores_replace_given_token_rewards_as_before() -> None:
    """A batch with both ``scores`` and ``token_rewards`` still takes the rewards built from the scores."""
    b = random_batch(6, [2, 3, 0, 1], 3, [0, 0, 1, 1], extra=False)
    given_rewards = b.update(token_rewards=torch.ones(4, 3))
    out = Algorithm.grpo().compute_advantages(given_rewards)
    assert_same_bits(out, through_token_rewards(Algorithm.grpo(), b)[0])
    assert torch.equal(out["token_rewards"], compute_token_rewards(b)[0]["token_rewards"])


def _python_calls(fn: Callable[[], object]) -> int:
    """Number of function calls (Python and builtin, so tensor ops count) ``fn`` makes."""
    count = 0

    def prof(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    gc.disable()  # garbage-collector callbacks would add calls at random points
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_no_python_loop_over_samples_or_groups(name: str) -> None:
    """The Python work is the same for 8 samples in 2 groups and 2048 samples in 512 groups, 200 tokens."""
    small = random_batch(0, [3] * 8, 200, [i // 4 for i in range(8)])
    large = random_batch(0, [150] * 2048, 200, [i // 4 for i in range(2048)])
    ESTIMATORS[name](small)  # warm caches (lazy imports)
    assert _python_calls(lambda: ESTIMATORS[name](small)) == _python_calls(lambda: ESTIMATORS[name](large))


@PROPS
@given(shapes(), st.sampled_from(["k1", "k2", "k3", "abs", "k3+"]), st.floats(0.0, 1.0))
def test_reward_step_ignores_masked_positions(shape: tuple[int, list[int], int, list[int]], est: str,
                                              beta: float) -> None:
    cfg = RewardConfig(kl_coef=beta, kl_estimator=est)  # type: ignore[arg-type]
    a, ma = compute_token_rewards(random_batch(*shape), cfg)
    b, mb = compute_token_rewards(random_batch(*shape, masked_junk=True), cfg)
    assert torch.equal(a["token_rewards"], b["token_rewards"])
    assert ma == mb
    assert not a["token_rewards"][~a["response_mask"]].any()


def test_whitening_statistics_are_accurate_on_a_large_batch() -> None:
    """Mean and variance over 4M tokens within 1e-5 of float64 (a float32 dot product is ~1e-4 off)."""
    g = torch.Generator().manual_seed(0)
    B, T = 4096, 1024
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    x = (torch.randn(B, T, generator=g) * 3 + 0.7).where(mask, 0.0)
    out = masked_whiten(x, mask)
    xd = x.double()[mask]
    ref = (xd - xd.mean()) * torch.rsqrt(xd.var() + 1e-8)
    # a whitened output is scale-free: its own mean and unbiased variance show the statistics' error
    got = out.double()[mask]
    assert abs(float(got.mean())) < 1e-5
    assert abs(float(got.var()) - 1.0) < 1e-5
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    assert not out[~mask].any()
    # the same through an estimator (REINFORCE++ whitens its discounted returns over the batch)
    adv = reinforce_pp(TensorBatch({"response_mask": mask, "token_rewards": x}), ReinforcePPConfig(gamma=1.0))
    a = adv["advantages"].double()[mask]
    assert abs(float(a.var()) - 1.0) < 1e-5


def test_outcome_sums_read_each_row_up_to_its_length() -> None:
    """Totals over the blocked path (whole blocks, the end block, columns past the last block)."""
    g = torch.Generator().manual_seed(1)
    for width in (1, 63, 64, 65, 200, 256):
        lengths = torch.randint(0, width + 1, (37,), generator=g)
        lengths[:3] = torch.tensor([0, width, min(64, width)])
        mask = make_mask(lengths.tolist(), width)
        r = torch.randn(37, width, generator=g, dtype=F64).float()
        junk = torch.where(mask, r, torch.full_like(r, 1e30))
        b = TensorBatch({"response_mask": mask, "token_rewards": junk, "group_ids": torch.arange(37)})
        ref = (r.double() * mask).sum(-1)
        close(rloo(b)["advantages"][:, 0].where(lengths > 0, 0.0), ref.where(lengths > 0, 0.0), 1e-5)


def _implied_variance(out: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> float:
    """The variance a whitened output was divided by: fit ``out = k (x - mean)``, var = 1/k^2 - eps."""
    c = x.double()[mask] - x.double()[mask].mean()
    k = (out.double()[mask] * c).sum() / c.square().sum()
    return float(1.0 / k**2 - 1e-8)


@pytest.mark.parametrize(("scale", "offset"), [(3.0, 0.7), (1.0, 100.0), (0.01, 0.0)])
def test_whitening_variance_relative_error_against_float64(scale: float, offset: float) -> None:
    """Over 4M tokens the variance is within 5e-7 relative of float64 (a float32 dot: ~8e-6)."""
    g = torch.Generator().manual_seed(0)
    B, T = 4096, 1024
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    x = (torch.randn(B, T, generator=g) * scale + offset).where(mask, 0.0)
    xd = x.double()[mask]
    var = float(xd.var())
    bound = 5e-7
    # the check can fail: a float32 dot product over the centred values is well outside it
    xf = x[mask]
    centred = xf - xf.mean()
    assert abs(float(torch.dot(centred, centred)) / (xf.numel() - 1) - var) / var > 4 * bound
    assert abs(_implied_variance(masked_whiten(x, mask), x, mask) - var) / var < bound
    adv = gae(TensorBatch({"response_mask": mask, "token_rewards": x, "values": torch.zeros_like(x)}),
              GAEConfig(gamma=0.0, lam=0.0))["advantages"]  # whitens the rewards themselves
    assert abs(_implied_variance(adv, x, mask) - var) / var < bound
    ref = (xd - xd.mean()) * torch.rsqrt(torch.tensor(var, dtype=F64) + 1e-8)
    assert float((adv.double()[mask] - ref).abs().max() / ref.abs().max()) < 1e-6


@pytest.mark.parametrize("width", [8, 96, 200, 1024, 1032])
def test_wide_rows_match_reference(width: int) -> None:
    """Wide rows take the blocked paths (lengths from mask words, block sums, blocked suffix sums)."""
    g = torch.Generator().manual_seed(width)
    B = 6
    lengths = torch.randint(0, width + 1, (B,), generator=g).tolist()
    lengths[:3] = [0, width, min(width, 64)]
    b = random_batch(width, lengths, width, [0, 0, 0, 1, 1, 2])
    junk = random_batch(width, lengths, width, [0, 0, 0, 1, 1, 2], masked_junk=True)
    mask = b["response_mask"]
    for norm in (True, False):
        close(grpo(b, GRPOConfig(norm_by_std=norm))["advantages"], ref_grpo(b, norm), 1e-4)
    close(rloo(b)["advantages"], ref_rloo(b))
    g1 = torch.where(mask, ref_discounted(ref_rewards(b), 1.0), 0.0)
    rm = remax(b)
    close(rm["returns"], g1)
    close(rm["advantages"], torch.where(mask, g1 - b["baseline_scores"].double()[:, None], 0.0))
    close(reinforce_pp(b, ReinforcePPConfig(gamma=1.0, whiten=False))["returns"], g1)
    for name, fn in ESTIMATORS.items():
        a, j = fn(b), fn(junk)
        assert torch.equal(a["advantages"], j["advantages"]), name
        assert not a["advantages"][~mask].any() and not a["returns"][~mask].any(), name
    # a mask that is a view into a wider one is not read as whole words
    wide = torch.cat([torch.zeros(B, 8, dtype=torch.bool), mask], 1)[:, 8:]
    assert torch.equal(grpo(b.update(response_mask=wide))["advantages"], grpo(b)["advantages"])


@pytest.mark.parametrize("width", [8, 1024, 1032, 2040, 2048, 8 * 257])
def test_lengths_from_mask_words_count_every_true(width: int) -> None:
    """The word sums count the True bytes of a row (sums of up to 255 words never carry)."""
    g = torch.Generator().manual_seed(width)
    lengths = torch.randint(0, width + 1, (9,), generator=g)
    lengths[:2] = torch.tensor([0, width])
    assert torch.equal(_lengths(make_mask(lengths.tolist(), width)), lengths)
    scattered = torch.rand(9, width, generator=g) < 0.5  # not right-padded: still the count of True
    assert torch.equal(_lengths(scattered), scattered.sum(-1))


@pytest.mark.parametrize("ids", [[3, 3, 5, 5, 5, 9], [5, 3, 5, 9, 3, 5], [4], [2, 2], []])
def test_group_index_matches_unique_for_sorted_and_unsorted_ids(ids: list[int]) -> None:
    gid = torch.tensor(ids, dtype=torch.int64)
    _, inverse, counts = torch.unique(gid, return_inverse=True, return_counts=True)
    got_inverse, got_counts = group_index(gid)
    assert torch.equal(got_inverse, inverse) and torch.equal(got_counts, counts)


def test_outcome_sums_ignore_junk_whose_block_sums_overflow() -> None:
    """Finite junk past the length whose block sums overflow to inf leaves the totals finite and exact."""
    width = 256
    lengths = [0, 5, 64, 100, 255, 256]
    mask = make_mask(lengths, width)
    r = torch.randn(len(lengths), width, generator=torch.Generator().manual_seed(0)).where(mask, 0.0)
    junk = torch.where(mask, r, 3e38)
    assert torch.isinf(junk.view(len(lengths), -1, 64).sum(-1)).any()  # the junk blocks do overflow
    clean = TensorBatch({"response_mask": mask, "token_rewards": r, "group_ids": torch.arange(len(lengths))})
    for est in (grpo, rloo):
        a, j = est(clean)["advantages"], est(clean.update(token_rewards=junk))["advantages"]
        assert torch.isfinite(j).all() and torch.equal(a, j)


@pytest.mark.parametrize("size", [1, 2, 5])
def test_groups_of_consecutive_samples_match_reference_and_shuffled_ids(size: int) -> None:
    """Runs of equal size are reduced along rows; the result is the reference's and the shuffled batch's."""
    B = 4 * size
    lengths = [(3 * i) % 7 for i in range(B)]
    runs = random_batch(size, lengths, 6, [i // size for i in range(B)])
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(size))
    shuffled = TensorBatch({k: v[perm] for k, v in runs.items()})
    assert not bool((shuffled["group_ids"][1:] >= shuffled["group_ids"][:-1]).all())  # takes the general path
    for norm in (True, False):
        out = grpo(runs, GRPOConfig(norm_by_std=norm))["advantages"]
        close(out, ref_grpo(runs, norm), 1e-4)
        close(grpo(shuffled, GRPOConfig(norm_by_std=norm))["advantages"], out[perm], 1e-6)
    close(rloo(runs)["advantages"], ref_rloo(runs))
    close(rloo(shuffled)["advantages"], rloo(runs)["advantages"][perm], 1e-6)
    base = reinforce_pp_baseline(runs)["advantages"]
    close(reinforce_pp_baseline(shuffled)["advantages"], base[perm], 1e-6)
