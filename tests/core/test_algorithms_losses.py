"""Policy, value and KL losses, the off-policy correction and aggregation: hand-computed values and split invariance."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import BatchValidationError, GlobalBatchStats, TensorBatch
from verl_core.algorithms import (
    ActorLoss,
    ActorLossConfig,
    CriticLoss,
    CriticLossConfig,
    OffPolicyConfig,
    PolicyLossConfig,
    actor_loss,
    aggregate,
    cispo_loss,
    clipped_value_loss,
    critic_loss,
    gspo_loss,
    importance_sampling_loss,
    kl_estimate,
    offpolicy_correction,
    ppo_loss,
    reinforce_loss,
)

F64 = torch.float64
PROPS = settings(max_examples=25, deadline=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def make_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]


def stats_of(mask: torch.Tensor) -> GlobalBatchStats:
    per = mask.sum(1)
    return GlobalBatchStats(mask.shape[0], int((per > 0).sum()), int(per.sum()), mask.shape[1])


# ----------------------------------------------------------------------------- hand-computed
def test_ppo_loss_hand_computed() -> None:
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    ratio = torch.tensor([[1.5, 0.5, 5.0, 0.5, 2.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0]], dtype=F64)
    old = torch.zeros_like(ratio)
    mask = torch.ones_like(ratio, dtype=torch.bool)
    t = ppo_loss(ratio.log(), old, adv, mask, cfg)
    torch.testing.assert_close(t.loss, torch.tensor([[-1.28, -0.5, 3.0, 0.8, 0.0]], dtype=F64))
    assert t.clipped.tolist() == [[True, False, False, True, False]]
    assert t.clipped_lower.tolist() == [[False, False, True, False, False]]
    no_dual = ppo_loss(ratio.log(), old, adv, mask, PolicyLossConfig(0.2, 0.28, None))
    assert float(no_dual.loss[0, 2]) == pytest.approx(5.0)
    # the log-ratio is clamped to +-20 before exp (verl)
    huge = ppo_loss(torch.tensor([[50.0]], dtype=F64), torch.zeros(1, 1, dtype=F64), torch.tensor([[-1.0]], dtype=F64),
                    torch.ones(1, 1, dtype=torch.bool), PolicyLossConfig(clip_ratio_c=None))
    assert float(huge.loss) == pytest.approx(math.exp(20.0))


def test_gspo_gradient_is_the_sequence_ratio_gradient() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.01, -1.99, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    adv = torch.tensor([[2.0, 2.0, 2.0]], dtype=F64)
    t = gspo_loss(lp, old, adv, mask, PolicyLossConfig(clip_low=0.1, clip_high=0.1))
    loss = aggregate(t.loss, mask, "seq-mean-token-mean", stats_of(mask))
    loss.backward()
    lp2 = lp.detach().clone().requires_grad_(True)
    s = torch.exp(((lp2 - old) * mask).sum() / 2)  # exp(mean log ratio) over 2 tokens
    (-2.0 * s).backward()
    assert lp.grad is not None and lp2.grad is not None
    torch.testing.assert_close(lp.grad, lp2.grad.where(mask, 0.0))
    assert float(loss.detach()) == pytest.approx(float(-2.0 * s.detach()))
    # clipped sequence: ratio exp(0.2) > 1.1 for a positive advantage -> -A (1 + eps), no gradient
    lp3 = torch.tensor([[-0.9, -1.7]], dtype=F64, requires_grad=True)
    t3 = gspo_loss(lp3, torch.tensor([[-1.0, -2.0]], dtype=F64), torch.ones(1, 2, dtype=F64),
                   torch.ones(1, 2, dtype=torch.bool), PolicyLossConfig(clip_low=0.1, clip_high=0.1))
    torch.testing.assert_close(t3.loss, torch.full((1, 2), -1.1, dtype=F64))
    assert t3.clipped.all()


def test_cispo_reinforce_and_is_gradients() -> None:
    lp = torch.tensor([[-1.0, -0.2]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.5, -0.1]], dtype=F64)
    adv = torch.tensor([[1.0, -2.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2)
    t = cispo_loss(lp, old, adv, mask, cfg)
    t.loss.sum().backward()
    r = torch.exp(lp.detach() - old)  # e^0.5 -> clipped to 1.2; e^-0.1 = 0.905 stays
    w = r.clamp(0.8, 1.2)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, -w * adv)
    assert t.clipped.tolist() == [[True, False]]
    for fn, grad in ((reinforce_loss, -adv), (importance_sampling_loss, -adv * r)):
        x = lp.detach().clone().requires_grad_(True)
        fn(x, old, adv, mask, cfg).loss.sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, grad)


def test_kl_estimators_hand_computed_and_straight_through() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5, -30.0], dtype=F64)
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0], dtype=F64)
    d = lp - ref
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_estimate(lp, ref, "kl"), d)
    torch.testing.assert_close(kl_estimate(lp, ref, "abs"), d.abs())
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), 0.5 * d * d)
    k3 = torch.exp(-d) + d - 1
    expect_k3 = torch.tensor([float(k3[0]), float(k3[1]), 0.0, 10.0], dtype=F64)  # last: clamped at 10
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), expect_k3)
    torch.testing.assert_close(kl_estimate(lp, ref, "low_var_kl"), expect_k3)
    for name, value in (("k1+", d), ("k3+", expect_k3), ("abs+", d.abs())):
        x = lp.clone().requires_grad_(True)
        out = kl_estimate(x, ref, name)
        torch.testing.assert_close(out.detach(), value)
        out.sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, d)  # gradient of k2 = d


def test_value_loss_hand_computed() -> None:
    v = torch.tensor([[1.0, 0.0, 3.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 2.9]], dtype=F64)
    ret = torch.tensor([[2.0, 1.0, 0.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    t = clipped_value_loss(v, old, ret, mask, CriticLossConfig(clip_range_value=0.5))
    # token 0: clip to 0.5 -> (0.5-2)^2 = 2.25 > (1-2)^2 = 1 -> clipped
    torch.testing.assert_close(t.loss.detach(), torch.tensor([[2.25, 1.0, 9.0]], dtype=F64))
    assert t.clipped.tolist() == [[True, False, False]]
    out = critic_loss(CriticLossConfig(clip_range_value=0.5), stats_of(mask), values=v, old_values=old,
                      returns=ret, mask=mask)
    assert float(out.loss.detach()) == pytest.approx(0.5 * (2.25 + 1 + 9) / 3)
    assert float(out.metrics["vf_clipfrac"]) == pytest.approx(1 / 3)
    out.loss.backward()
    assert v.grad is not None
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -1.0, 3.0]], dtype=F64) / 3)


def test_tis_weights_token_and_sequence() -> None:
    old = torch.tensor([[-1.0, -1.0, 0.0], [-0.5, -2.0, 0.0]])
    rollout = torch.tensor([[-2.0, -0.9, 0.0], [-0.5, -2.1, 0.0]])
    mask = make_mask([2, 2], 3)
    c = offpolicy_correction(old, rollout, mask, OffPolicyConfig("tis", "token", upper=2.0))
    torch.testing.assert_close(c.weights, torch.tensor([[2.0, math.exp(-0.1), 0], [1.0, math.exp(0.1), 0]]))
    assert c.hit.tolist() == [[True, False, False], [False, False, False]]
    s = offpolicy_correction(old, rollout, mask, OffPolicyConfig("tis", "sequence", upper=10.0))
    torch.testing.assert_close(s.weights, torch.tensor([[math.exp(0.9)] * 2 + [0], [math.exp(0.1)] * 2 + [0]]))
    assert s.ratio.shape == (2, 1) and not s.hit.any()


def test_aggregation_modes_hand_computed() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]], dtype=F64)
    mask = make_mask([3, 1, 0], 3)
    st_ = stats_of(mask)
    assert float(aggregate(loss, mask, "token-mean", st_)) == pytest.approx(10 / 4)
    assert float(aggregate(loss, mask, "seq-mean-token-sum", st_)) == pytest.approx(10 / 2)
    assert float(aggregate(loss, mask, "seq-mean-token-mean", st_)) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm", st_)) == pytest.approx(10 / (2 * 3))
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm", st_, 5)) == pytest.approx(10 / (2 * 5))
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        assert float(aggregate(loss[:2], empty, mode, stats_of(empty))) == 0.0


# ----------------------------------------------------------------------------- split invariance
def engine_grads(
    config: ActorLossConfig, tensors: dict[str, torch.Tensor], splits: list[int]
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """Emulate an engine: per micro-batch (trimmed to its longest response) loss + backward, summed."""
    mask = tensors["mask"]
    stats = stats_of(mask)
    leaf = tensors["log_probs"].clone().requires_grad_(True)
    ent = tensors["entropy"].clone().requires_grad_(True)
    total = 0.0
    metrics: dict[str, float] = {}
    start = 0
    for size in splits:
        sl = slice(start, start + size)
        start += size
        m = mask[sl]
        width = int(m.sum(1).max()) if size else 0
        part = {k: v[sl, :width] for k, v in tensors.items() if k not in ("log_probs", "entropy")}
        out = actor_loss(config, stats, log_probs=leaf[sl, :width], entropy=ent[sl, :width],
                         old_log_probs=part["old_log_probs"], advantages=part["advantages"], mask=part["mask"],
                         ref_log_probs=part["ref_log_probs"], rollout_log_probs=part["rollout_log_probs"])
        out.loss.backward()
        total += float(out.loss.detach())
        for k, v in out.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    assert leaf.grad is not None and ent.grad is not None
    return torch.cat([leaf.grad, ent.grad], 1), total, metrics


@st.composite
def split_case(draw: st.DrawFn) -> tuple[int, list[int], int, list[int]]:
    width = draw(st.integers(1, 7))
    B = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    cuts = sorted(draw(st.lists(st.integers(0, B), max_size=4)))
    bounds = [0, *cuts, B]
    return draw(st.integers(0, 2**31 - 1)), lengths, width, [b - a for a, b in itertools.pairwise(bounds)]


def random_tensors(seed: int, lengths: list[int], width: int, dtype: torch.dtype = F64,
                   junk: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    j = torch.Generator().manual_seed(seed + 7)
    mask = make_mask(lengths, width)
    B = len(lengths)

    def tok(scale: float = 1.0) -> torch.Tensor:
        x = (torch.randn(B, width, generator=g, dtype=F64) * scale)
        fill = torch.randn(B, width, generator=j, dtype=F64) * 50 if junk else torch.zeros((), dtype=F64)
        return torch.where(mask, x, fill).to(dtype)

    lp = -tok().abs() - 0.1
    return {
        "mask": mask,
        "log_probs": lp,
        "old_log_probs": torch.where(mask, lp + tok(0.3), lp),
        "ref_log_probs": torch.where(mask, lp + tok(0.3), lp),
        "rollout_log_probs": torch.where(mask, lp + tok(0.3), lp),
        "advantages": tok(),
        "entropy": tok().abs(),
    }


CORRECTIONS = [OffPolicyConfig(), OffPolicyConfig("tis", "token"), OffPolicyConfig("tis", "sequence", 3.0),
               OffPolicyConfig("mis", "token", 1.3), OffPolicyConfig("mis", "sequence", 2.0, 0.7),
               OffPolicyConfig("mis", "geometric", 1.1), OffPolicyConfig("tis", "geometric", 1.05)]


@PROPS
@given(split_case(), st.sampled_from(MODES), st.sampled_from(["ppo", "gspo", "cispo", "reinforce"]),
       st.sampled_from(CORRECTIONS))
def test_gradient_is_independent_of_the_micro_batch_split(
    case: tuple[int, list[int], int, list[int]], mode: str, loss: str, correction: OffPolicyConfig
) -> None:
    seed, lengths, width, splits = case
    tensors = random_tensors(seed, lengths, width)
    config = ActorLossConfig(policy_loss=loss, loss_agg_mode=mode,  # type: ignore[arg-type]
                             policy=PolicyLossConfig(clip_low=0.2, clip_high=0.28),
                             entropy_coef=0.01, kl_loss_coef=0.1, kl_loss_estimator="k3+",
                             offpolicy=correction)
    g_whole, l_whole, m_whole = engine_grads(config, tensors, [len(lengths)])
    g_split, l_split, m_split = engine_grads(config, tensors, splits)
    err = float((g_whole - g_split).abs().max()) / max(float(g_whole.abs().max()), 1e-300)
    assert err <= 1e-10
    assert l_split == pytest.approx(l_whole, rel=1e-10, abs=1e-12)
    assert m_split.keys() == m_whole.keys()
    for k in m_whole:
        assert m_split[k] == pytest.approx(m_whole[k], rel=1e-10, abs=1e-12), k


@PROPS
@given(split_case(), st.sampled_from(MODES))
def test_critic_gradient_is_independent_of_the_micro_batch_split(
    case: tuple[int, list[int], int, list[int]], mode: str
) -> None:
    seed, lengths, width, splits = case
    t = random_tensors(seed, lengths, width)
    cfg = CriticLossConfig(clip_range_value=0.2, loss_agg_mode=mode)  # type: ignore[arg-type]
    stats = stats_of(t["mask"])

    def run(parts: list[int]) -> torch.Tensor:
        v = t["log_probs"].clone().requires_grad_(True)
        start = 0
        for size in parts:
            sl = slice(start, start + size)
            start += size
            w = int(t["mask"][sl].sum(1).max()) if size else 0
            critic_loss(cfg, stats, values=v[sl, :w], old_values=t["old_log_probs"][sl, :w],
                        returns=t["advantages"][sl, :w], mask=t["mask"][sl, :w]).loss.backward()
        assert v.grad is not None
        return v.grad

    whole, split = run([len(lengths)]), run(splits)
    assert float((whole - split).abs().max()) <= 1e-10 * max(float(whole.abs().max()), 1e-300)


def test_actor_loss_through_real_micro_batches() -> None:
    """The LossFn on TensorBatch micro-batches (token budget, reordered, trimmed) sums to the whole."""
    lengths = [5, 0, 3, 7, 1, 7, 2, 4]
    t = random_tensors(11, lengths, 8, torch.float32)
    mask = t["mask"]
    batch = TensorBatch({
        "response_mask": mask, "old_log_probs": t["old_log_probs"], "advantages": t["advantages"],
        "ref_log_probs": t["ref_log_probs"], "rollout_log_probs": t["rollout_log_probs"],
        "prompt_mask": torch.ones(len(lengths), 2, dtype=torch.bool),
        "prompt_ids": torch.ones(len(lengths), 2, dtype=torch.int64),
    })
    stats = GlobalBatchStats.of(batch)
    for mode in MODES:
        fn = ActorLoss(ActorLossConfig(loss_agg_mode=mode, entropy_coef=0.01, kl_loss_coef=0.05,  # type: ignore[arg-type]
                                       offpolicy=OffPolicyConfig("tis", "token", 1.5)))
        assert fn.needs == {"log_probs", "entropy"}
        grads = []
        for mbs in (batch.micro_batches(size=len(lengths)), batch.micro_batches(max_tokens=20)):
            leaf = t["log_probs"].clone().requires_grad_(True)
            ent = t["entropy"].clone().requires_grad_(True)
            start = 0
            total = 0.0
            for mb in mbs:
                idx = mbs.order[start:start + mb.batch_size]
                start += mb.batch_size
                w = mb.response_len
                full = mb.update(log_probs=leaf[idx, :w], entropy=ent[idx, :w])
                out = fn(full, stats)
                out.loss.backward()
                total += float(out.loss.detach())
            assert leaf.grad is not None
            grads.append((leaf.grad, total))
        torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-7)
        assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-5)


def test_critic_loss_fn_needs_values() -> None:
    fn = CriticLoss()
    assert fn.needs == {"values"}
    mask = make_mask([2, 1], 2)
    b = TensorBatch({"response_mask": mask, "old_values": torch.zeros(2, 2), "returns": torch.ones(2, 2),
                     "values": torch.tensor([[0.5, 0.25], [1.0, 0.0]])})
    out = fn(b, GlobalBatchStats.of(b))
    # token (1, 0): V = 1 is clipped to 0 + 0.5, so max((1 - 1)^2, (0.5 - 1)^2) = 0.25
    assert float(out.loss) == pytest.approx(0.5 * (0.5**2 + 0.75**2 + 0.25) / 3)
    assert float(out.metrics["vf_clipfrac"]) == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------- properties
@PROPS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(0, 6), min_size=1, max_size=6),
       st.sampled_from(["ppo", "gspo", "cispo", "reinforce", "importance_sampling"]), st.sampled_from(MODES))
def test_masked_positions_never_change_losses(seed: int, lengths: list[int], loss: str, mode: str) -> None:
    width = max(lengths)
    cfg = ActorLossConfig(policy_loss=loss, loss_agg_mode=mode, entropy_coef=0.1, kl_loss_coef=0.1,  # type: ignore[arg-type]
                          offpolicy=OffPolicyConfig("tis", "sequence", 3.0))
    outs = []
    for junk in (False, True):
        t = random_tensors(seed, lengths, width, junk=junk)
        leaf = t["log_probs"].clone().requires_grad_(True)
        out = actor_loss(cfg, stats_of(t["mask"]), log_probs=leaf, old_log_probs=t["old_log_probs"],
                         advantages=t["advantages"], mask=t["mask"], entropy=t["entropy"],
                         ref_log_probs=t["ref_log_probs"], rollout_log_probs=t["rollout_log_probs"])
        out.loss.backward()
        assert leaf.grad is not None
        outs.append((out, leaf.grad))
    (a, ga), (b, gb) = outs
    assert torch.equal(a.loss, b.loss)
    assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in a.metrics)
    assert torch.equal(ga, gb)
    assert torch.isfinite(a.loss) and torch.isfinite(ga).all()


@PROPS
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.9), st.floats(0.0, 2.0), st.floats(1.01, 10.0))
def test_clipping_bounds(seed: int, lo: float, hi: float, c: float) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(4, 16, generator=g, dtype=F64)
    old = torch.randn(4, 16, generator=g, dtype=F64)
    adv = torch.randn(4, 16, generator=g, dtype=F64) * 3
    mask = torch.ones(4, 16, dtype=torch.bool)
    cfg = PolicyLossConfig(clip_low=lo, clip_high=hi, clip_ratio_c=c)
    ppo = ppo_loss(lp, old, adv, mask, cfg).loss
    pos, neg = adv > 0, adv < 0
    # the objective -loss never exceeds A (1 + eps_high) for A > 0; the loss never exceeds c |A| for A < 0
    assert bool((-ppo[pos] <= adv[pos] * (1 + hi) + 1e-12).all())
    assert bool((ppo[neg] <= -adv[neg] * c + 1e-12).all())
    gs = gspo_loss(lp, old, adv, mask, cfg).loss
    assert bool((-gs[pos] <= adv[pos] * (1 + hi) + 1e-12).all())
    x = lp.clone().requires_grad_(True)
    cispo_loss(x, old, adv, mask, cfg).loss.sum().backward()
    assert x.grad is not None
    w = (x.grad / -adv)[adv != 0]
    assert bool((w >= 1 - lo - 1e-12).all() and (w <= 1 + hi + 1e-12).all())
    v = torch.randn(4, 16, generator=g, dtype=F64)
    ov = torch.randn(4, 16, generator=g, dtype=F64)
    t = clipped_value_loss(v, ov, adv, mask, CriticLossConfig(clip_range_value=lo + 0.01))
    assert bool((t.loss >= (v - adv) ** 2 - 1e-12).all())
    weights = offpolicy_correction(lp, old, mask, OffPolicyConfig("tis", "token", upper=1.0 + hi)).weights
    assert bool((weights <= 1.0 + hi).all())
    kept = offpolicy_correction(lp, old, mask, OffPolicyConfig("mis", "token", upper=1.0 + hi)).weights
    assert bool(((kept == 0) | ((kept >= 1 / (1.0 + hi)) & (kept <= 1.0 + hi))).all())


def test_empty_micro_batch_and_all_empty_batch_are_finite() -> None:
    cfg = ActorLossConfig(entropy_coef=0.1, kl_loss_coef=0.1)
    empty = torch.zeros(3, 0, dtype=F64)
    for mode in MODES:
        c = ActorLossConfig(loss_agg_mode=mode, entropy_coef=0.1)  # type: ignore[arg-type]
        out = actor_loss(c, GlobalBatchStats(3, 0, 0, 0), log_probs=empty.requires_grad_(True),
                         old_log_probs=empty, advantages=empty, mask=torch.zeros(3, 0, dtype=torch.bool),
                         entropy=empty)
        assert float(out.loss.detach()) == 0.0
        assert all(math.isfinite(float(v)) for v in out.metrics.values())
    t = random_tensors(1, [0, 0], 3)
    out = actor_loss(cfg, stats_of(t["mask"]), log_probs=t["log_probs"], old_log_probs=t["old_log_probs"],
                     advantages=t["advantages"], mask=t["mask"], entropy=t["entropy"],
                     ref_log_probs=t["ref_log_probs"])
    assert float(out.loss) == 0.0


# ----------------------------------------------------------------------------- analytic gradients
def ref_policy(name: str, lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               cfg: PolicyLossConfig) -> torch.Tensor:
    """verl 0.9.1's formulas written with plain autograd (float64 reference)."""
    lr = (lp - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = lr.exp()
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    if name == "ppo":
        l1, l2 = -adv * ratio, -adv * ratio.clamp(lo, hi)
        c1 = torch.maximum(l1, l2)
        assert cfg.clip_ratio_c is not None
        return torch.where(adv < 0, torch.min(-adv * cfg.clip_ratio_c, c1), c1)
    if name == "gspo":
        n = mask.sum(-1).clamp(min=1)
        seq = ((lp - old) * mask).sum(-1) / n
        s = (lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0).exp()
        return torch.maximum(-adv * s, -adv * s.clamp(lo, hi))
    if name == "cispo":
        return -ratio.clamp(lo, hi).detach() * adv * lp
    if name == "reinforce":
        return -adv * lp
    return -adv * ratio


def ref_kl(name: str, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = lp - ref
    k3 = (torch.exp((ref - lp).clamp(-20, 20)) - (ref - lp).clamp(-20, 20) - 1).clamp(-10, 10)
    base = {"k1": d, "k2": 0.5 * d * d, "abs": d.abs(), "k3": k3}[name.rstrip("+")]
    if name.endswith("+"):
        k2 = 0.5 * d * d
        return k2 - k2.detach() + base.detach()
    return base


@PROPS
@given(st.integers(0, 2**31 - 1), st.sampled_from(["ppo", "gspo", "cispo", "reinforce", "importance_sampling"]),
       st.floats(0.05, 1.0), st.floats(0.0, 1.0))
def test_policy_losses_match_plain_autograd(seed: int, name: str, lo: float, hi: float) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (6,), generator=g).tolist()
    mask = make_mask(lengths, 8)
    lp = -torch.rand(6, 8, generator=g, dtype=F64) * 3
    old = lp + torch.randn(6, 8, generator=g, dtype=F64) * torch.tensor([0.01, 0.3, 1.0, 30.0, 0.2, 0.5],
                                                                        dtype=F64)[:, None]
    adv = torch.randn(6, 8, generator=g, dtype=F64)
    cfg = PolicyLossConfig(clip_low=lo, clip_high=hi, clip_ratio_c=3.0)
    fn = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss, "reinforce": reinforce_loss,
          "importance_sampling": importance_sampling_loss}[name]
    x1, x2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got = fn(x1, old, adv, mask, cfg).loss
    want = ref_policy(name, x2, old, adv, mask, cfg)
    weights = torch.randn(6, 8, generator=g, dtype=F64) * mask
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert x1.grad is not None and x2.grad is not None
    torch.testing.assert_close(got.detach() * mask, want.detach() * mask, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)


@PROPS
@given(st.integers(0, 2**31 - 1), st.sampled_from(["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"]))
def test_kl_estimators_match_plain_autograd(seed: int, name: str) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(64, generator=g, dtype=F64) * 5
    ref = lp + torch.randn(64, generator=g, dtype=F64) * torch.logspace(-3, 1.5, 64, dtype=F64)
    x1, x2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got, want = kl_estimate(x1, ref, name), ref_kl(name, x2, ref)
    w = torch.randn(64, generator=g, dtype=F64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert x1.grad is not None and x2.grad is not None
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)


@PROPS
@given(st.integers(0, 2**31 - 1), st.sampled_from([None, 0.05, 0.5, 5.0]))
def test_value_loss_matches_plain_autograd(seed: int, clip: float | None) -> None:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(4, 16, generator=g, dtype=F64)
    old = v + torch.randn(4, 16, generator=g, dtype=F64) * 0.3
    ret = torch.randn(4, 16, generator=g, dtype=F64)
    mask = torch.ones(4, 16, dtype=torch.bool)
    x1, x2 = v.clone().requires_grad_(True), v.clone().requires_grad_(True)
    got = clipped_value_loss(x1, old, ret, mask, CriticLossConfig(clip_range_value=clip)).loss
    if clip is None:
        want = (x2 - ret) ** 2
    else:
        want = torch.max((x2 - ret) ** 2, (torch.clamp(x2, old - clip, old + clip) - ret) ** 2)
    w = torch.randn(4, 16, generator=g, dtype=F64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert x1.grad is not None and x2.grad is not None
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)


def test_missing_inputs_say_what_to_do() -> None:
    t = random_tensors(0, [2, 1], 2)
    base = {"log_probs": t["log_probs"], "old_log_probs": t["old_log_probs"], "advantages": t["advantages"],
            "mask": t["mask"]}
    with pytest.raises(BatchValidationError, match="mode 'mis'.*needs rollout_log_probs.*set mode='none'"):
        actor_loss(ActorLossConfig(offpolicy=OffPolicyConfig("mis")), stats_of(t["mask"]), **base)
    with pytest.raises(BatchValidationError, match="needs ref_log_probs.*kl_loss_coef=0"):
        actor_loss(ActorLossConfig(kl_loss_coef=0.1), stats_of(t["mask"]), **base)
    with pytest.raises(BatchValidationError, match="ActorLoss needs field.*advantages"):
        ActorLoss()(TensorBatch({"response_mask": t["mask"], "log_probs": t["log_probs"].float()}),
                    stats_of(t["mask"]))


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "reinforce", "importance_sampling"])
def test_no_python_loop_over_samples_in_losses(name: str) -> None:
    import gc
    import sys

    def calls(lengths: list[int]) -> int:
        t = random_tensors(0, lengths, 64)
        cfg = ActorLossConfig(policy_loss=name, loss_agg_mode="seq-mean-token-mean", kl_loss_coef=0.1,
                              entropy_coef=0.1, offpolicy=OffPolicyConfig("mis", "sequence"))
        count = 0

        def prof(frame: object, event: str, arg: object) -> None:
            nonlocal count
            count += event in ("call", "c_call")

        lp = t["log_probs"].clone().requires_grad_(True)
        gc.disable()  # garbage-collector callbacks would add calls at random points
        sys.setprofile(prof)
        try:
            out = actor_loss(cfg, stats_of(t["mask"]), log_probs=lp, old_log_probs=t["old_log_probs"],
                             advantages=t["advantages"], mask=t["mask"], entropy=t["entropy"],
                             ref_log_probs=t["ref_log_probs"], rollout_log_probs=t["rollout_log_probs"])
            out.loss.backward()
        finally:
            sys.setprofile(None)
            gc.enable()
        return count

    calls([3, 4])
    assert calls([3, 4]) == calls([40] * 300)
