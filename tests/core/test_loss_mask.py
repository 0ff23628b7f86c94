"""The multi-turn batch contract: ``loss_mask`` and ``turn_ids``, and every algorithm counting over
``TensorBatch.loss_mask``.

Three kinds of checks: a single-turn batch gives bit-equal results with and without a
``loss_mask`` equal to its ``response_mask``; tokens with ``loss_mask`` False (observation tokens)
change no loss, metric or advantage and get no gradient; the estimators on a multi-turn batch
match float64 loops that skip observation tokens as verl's multi-turn loops do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import (
    AlgorithmComponent,
    BatchValidationError,
    GlobalBatchStats,
    MissingFieldError,
    TensorBatch,
    hookimpl,
)
from verl_core.algorithms import (
    AGG_MODES,
    PRESETS,
    ActorLoss,
    ActorLossConfig,
    Algorithm,
    CriticLoss,
    CriticLossConfig,
    GAEConfig,
    OffPolicyConfig,
    ReinforcePPConfig,
    RewardConfig,
    compute_token_rewards,
    gae,
    grpo,
    outcome_rewards,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from verl_core.algorithms.onpolicy import OnPolicyActorLoss
from verl_core.kernel.registry import get_registry, reset_registry
from verl_core.kernel.schema import FIELDS, TURNS_EXTRA

F64 = torch.float64
PROPS = settings(max_examples=30, deadline=None)
POLICY_LOSSES = ["ppo", "gspo", "cispo", "reinforce", "importance_sampling"]
KL = ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"]
LOG_PROB_FIELDS = ("old_log_probs", "ref_log_probs", "rollout_log_probs")
CORRECTIONS = [OffPolicyConfig(), OffPolicyConfig("tis", "token"), OffPolicyConfig("tis", "sequence"),
               OffPolicyConfig("mis", "token", 1.5), OffPolicyConfig("mis", "geometric", 1.2)]


# ----------------------------------------------------------------------------- batches
def make_batch(seed: int, lengths: list[int], width: int, *, observations: float = 0.0) -> TensorBatch:
    """A batch with every field the algorithms read, groups of two.

    With ``observations`` > 0 about that fraction of each response's tokens are observation tokens
    (``loss_mask`` False, ``turn_ids`` counting the model turns); the model's outputs (log-probs,
    values) are 0 there, as engines leave them, while the scores there are not.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]
    loss = mask & (torch.rand(B, width, generator=g) >= observations)

    def tok(scale: float = 1.0, where: torch.Tensor = loss) -> torch.Tensor:
        return (torch.randn(B, width, generator=g) * scale).where(where, 0.0)

    lp = -tok().abs() - 0.05
    fields = {
        "response_mask": mask,
        "scores": torch.randn(B, generator=g),
        "baseline_scores": torch.randn(B, generator=g),
        "group_ids": torch.arange(B) // 2,
        "token_scores": tok(0.1, mask),
        "values": tok(),
        "old_values": tok(),
        "old_log_probs": lp,
        "ref_log_probs": (lp + tok(0.2)).where(loss, 0.0),
        "rollout_log_probs": (lp + tok(0.2)).where(loss, 0.0),
        "log_probs": (lp + tok(0.2)).where(loss, 0.0),
        "entropy": tok().abs(),
        "advantages": tok(),
        "returns": tok(),
    }
    if observations:
        fields["loss_mask"] = loss
        fields["turn_ids"] = turn_ids(loss, mask)
    return TensorBatch(fields)


def turn_ids(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The documented rule: k on model turn k and on the observation tokens after it, 0 at padding."""
    out = torch.zeros(loss.shape, dtype=torch.int64)
    for b in range(loss.shape[0]):
        turn, seen = 0, False
        for t in range(loss.shape[1]):
            if loss[b, t] and t > 0 and not loss[b, t - 1] and seen:
                turn += 1
            seen |= bool(loss[b, t])
            out[b, t] = turn if mask[b, t] else 0
    return out


def observation_positions(batch: TensorBatch) -> torch.Tensor:
    return batch["response_mask"] & ~batch.loss_mask


def perturbed(batch: TensorBatch, names: tuple[str, ...], seed: int) -> TensorBatch:
    """``batch`` with the named per-token fields replaced by other finite values at observation tokens."""
    g = torch.Generator().manual_seed(seed)
    obs = observation_positions(batch)
    assert bool(obs.any()), "the case needs observation tokens"
    return batch.update({
        n: torch.where(obs, torch.randn(batch[n].shape, generator=g) * 3 - 1, batch[n]) for n in names
    })


@st.composite
def shapes(draw: st.DrawFn, min_batch: int = 1) -> tuple[int, list[int], int]:
    width = draw(st.integers(1, 9))
    B = draw(st.integers(min_batch, 8))
    lengths = draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    return draw(st.integers(0, 2**31 - 1)), lengths, width


def assert_same(a: TensorBatch | dict[str, Any], b: TensorBatch | dict[str, Any], what: str) -> None:
    assert set(a) - {"loss_mask"} == set(b) - {"loss_mask"}, what
    for k in a:
        if k == "loss_mask":
            continue
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: {k} differs"
        else:
            assert x == y, f"{what}: {k} differs"


# ----------------------------------------------------------------------------- schema and validation
def test_schema_declares_the_fields() -> None:
    assert FIELDS["loss_mask"].dtype == torch.bool and FIELDS["loss_mask"].dims == ("batch", "response")
    assert FIELDS["turn_ids"].dtype == torch.int64 and FIELDS["turn_ids"].dims == ("batch", "response")
    assert "response_mask" in FIELDS["loss_mask"].doc and "0 elsewhere" in FIELDS["loss_mask"].doc
    assert TURNS_EXTRA == "turns"


def test_accessor_is_loss_mask_else_response_mask() -> None:
    single = make_batch(0, [3, 1, 0], 4)
    assert single.loss_mask is single["response_mask"]
    multi = make_batch(0, [4, 4, 2], 4, observations=0.4)
    assert multi.loss_mask is multi["loss_mask"]
    with pytest.raises(MissingFieldError, match="response_mask"):
        _ = TensorBatch({"scores": torch.zeros(2)}).loss_mask


def test_a_valid_multi_turn_batch_passes_check() -> None:
    batch = make_batch(1, [6, 5, 0, 3], 6, observations=0.4)
    batch = batch.update(extras={TURNS_EXTRA: [[{"tool": "calc"}]] * 4})
    assert batch.check(where="multi-turn") is batch


def test_loss_mask_outside_the_response_is_refused() -> None:
    batch = make_batch(2, [2, 3], 4, observations=0.3)
    bad = batch["loss_mask"].clone()
    bad[1, 3] = True  # past the response of sample 1
    with pytest.raises(BatchValidationError, match=r"here: field 'loss_mask' of sample 1 .* position 3.*subset of "
                                                   r"response_mask"):
        batch.update(loss_mask=bad).check(where="here")


@pytest.mark.parametrize("row", [[0, -1, 0, 0], [1, 1, 0, 0], [0, 2, 1, 0]])
def test_bad_turn_ids_are_refused(row: list[int]) -> None:
    batch = make_batch(3, [3, 3], 4, observations=0.3).update(turn_ids=torch.tensor([[0, 0, 0, 0], row]))
    with pytest.raises(BatchValidationError, match="field 'turn_ids' of sample 1.*>= 0 and never decreasing"):
        batch.check()
    # padding positions are not read
    batch.update(turn_ids=torch.tensor([[0, 0, 1, 0], [0, 1, 1, -5]])).check()


def test_batch_ops_keep_the_loss_mask_consistent() -> None:
    batch = make_batch(4, [5, 2, 4], 5, observations=0.4)
    padded, n = batch.pad_to_multiple(4)
    assert n == 1
    assert not bool(padded["loss_mask"][-1].any()) and not bool(padded["turn_ids"][-1].any())
    padded.check()
    joined = TensorBatch.concat([batch.index([0]), batch.index([1]).trim()])
    assert torch.equal(joined["loss_mask"], batch["loss_mask"][:2])
    for mb in batch.micro_batches(size=2):
        mb.check()
    assert GlobalBatchStats.of(padded) == dataclasses.replace(GlobalBatchStats.of(batch), num_samples=4)


def test_global_stats_count_loss_tokens() -> None:
    batch = make_batch(5, [4, 3, 2, 0], 4, observations=0.5)
    lm = batch["loss_mask"]
    stats = GlobalBatchStats.of(batch)
    assert stats.num_tokens == int(lm.sum()) < int(batch["response_mask"].sum())
    assert stats.num_sequences == int(lm.any(1).sum())
    assert stats.num_samples == 4 and stats.max_response_len == 4


# ----------------------------------------------------------------------------- single turn: bit-equal
Run = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
"""A loss, its gradient w.r.t. the model output, and its metrics."""


def actor_run(loss: ActorLoss | OnPolicyActorLoss, batch: TensorBatch, stats: GlobalBatchStats) -> Run:
    lp = batch["log_probs"].clone().requires_grad_(True)
    out = loss(batch.update(log_probs=lp), stats)
    out.loss.backward()  # type: ignore[no-untyped-call]
    assert lp.grad is not None
    return out.loss.detach(), lp.grad, dict(out.metrics)


def critic_run(loss: CriticLoss, batch: TensorBatch, stats: GlobalBatchStats) -> Run:
    v = batch["values"].clone().requires_grad_(True)
    out = loss(batch.update(values=v), stats)
    out.loss.backward()  # type: ignore[no-untyped-call]
    assert v.grad is not None
    return out.loss.detach(), v.grad, dict(out.metrics)


def assert_runs_equal(a: Run, b: Run, what: str) -> None:
    assert torch.equal(a[0], b[0]), f"{what}: loss {a[0]} != {b[0]}"
    assert torch.equal(a[1], b[1]), f"{what}: gradients differ"
    assert_same(a[2], b[2], f"{what} metrics")


@PROPS
@given(shapes(), st.sampled_from(sorted(PRESETS)))
def test_single_turn_presets_are_bit_equal_with_an_equal_loss_mask(case: tuple[int, list[int], int], name: str) -> None:
    seed, lengths, width = case
    plain = make_batch(seed, lengths, width)
    same = plain.update(loss_mask=plain["response_mask"].clone())
    results: list[tuple[TensorBatch, dict[str, float], GlobalBatchStats, Run, Run, Run | None]] = []
    for batch in (plain, same):
        algo = Algorithm.from_name(name)
        out, metrics = algo.compute_advantages_with_metrics(batch)
        stats = GlobalBatchStats.of(out)
        actor = actor_run(algo.actor_loss, out, stats)
        on_policy = actor_run(OnPolicyActorLoss(algo.actor_loss, compare_rollout=True), out, stats)
        critic = critic_run(algo.critic_loss, out, stats) if algo.critic_loss is not None else None
        results.append((out, metrics, stats, actor, on_policy, critic))
    a, b = results
    assert "loss_mask" in b[0] and "loss_mask" not in a[0]
    assert_same(a[0], b[0], f"{name} advantages")
    assert a[1] == b[1] and a[2] == b[2]
    assert_runs_equal(a[3], b[3], f"{name} actor")
    assert_runs_equal(a[4], b[4], f"{name} on-policy actor")
    if a[5] is not None and b[5] is not None:
        assert_runs_equal(a[5], b[5], f"{name} critic")


@PROPS
@given(shapes(), st.sampled_from(POLICY_LOSSES), st.sampled_from(AGG_MODES), st.sampled_from(KL),
       st.sampled_from(CORRECTIONS))
def test_single_turn_losses_are_bit_equal_with_an_equal_loss_mask(
    case: tuple[int, list[int], int], policy: str, mode: str, kl: str, correction: OffPolicyConfig
) -> None:
    seed, lengths, width = case
    plain = make_batch(seed, lengths, width)
    same = plain.update(loss_mask=plain["response_mask"].clone())
    config = ActorLossConfig(policy_loss=policy, loss_agg_mode=mode, entropy_coef=0.01,  # type: ignore[arg-type]
                             kl_loss_coef=0.1, kl_loss_estimator=kl,  # type: ignore[arg-type]
                             offpolicy=correction)
    runs = [actor_run(ActorLoss(config), b, GlobalBatchStats.of(b)) for b in (plain, same)]
    assert_runs_equal(runs[0], runs[1], f"{policy}/{mode}/{kl}/{correction}")
    critic = CriticLoss(CriticLossConfig(loss_agg_mode=mode))  # type: ignore[arg-type]
    c_plain, c_same = (critic_run(critic, b, GlobalBatchStats.of(b)) for b in (plain, same))
    assert_runs_equal(c_plain, c_same, f"critic {mode}")
    rewards = [compute_token_rewards(b, RewardConfig(kl_coef=0.1, kl_estimator=kl))  # type: ignore[arg-type]
               for b in (plain, same)]
    assert_same(rewards[0][0], rewards[1][0], "token rewards")
    assert rewards[0][1] == rewards[1][1]


# ----------------------------------------------------------------------------- observation tokens do not count
@PROPS
@given(shapes(min_batch=2), st.sampled_from(POLICY_LOSSES), st.sampled_from(AGG_MODES), st.sampled_from(KL),
       st.sampled_from(CORRECTIONS))
def test_observation_tokens_change_no_loss_and_get_no_gradient(
    case: tuple[int, list[int], int], policy: str, mode: str, kl: str, correction: OffPolicyConfig
) -> None:
    seed, lengths, width = case
    lengths[0] = width = max(width, 3)
    batch = make_batch(seed, lengths, width, observations=0.4)
    batch = batch.update(loss_mask=batch["loss_mask"].index_fill(1, torch.tensor([1]), False)
                         & batch["response_mask"])  # at least one observation token
    obs = observation_positions(batch)
    stats = GlobalBatchStats.of(batch)
    config = ActorLossConfig(policy_loss=policy, loss_agg_mode=mode, entropy_coef=0.01,  # type: ignore[arg-type]
                             kl_loss_coef=0.1, kl_loss_estimator=kl,  # type: ignore[arg-type]
                             offpolicy=correction)
    names = ("log_probs", "advantages", "entropy", *LOG_PROB_FIELDS)
    base = actor_run(ActorLoss(config), batch, stats)
    moved = actor_run(ActorLoss(config), perturbed(batch, names, seed), stats)
    assert_runs_equal(base, moved, f"{policy}/{mode}/{kl}/{correction}")
    assert not bool(base[1][obs].any()), "observation tokens got a gradient"
    on = OnPolicyActorLoss(ActorLoss(config), compare_rollout=True)
    assert_runs_equal(actor_run(on, batch, stats), actor_run(on, perturbed(batch, names, seed + 1), stats), "on-policy")
    critic = CriticLoss(CriticLossConfig(loss_agg_mode=mode))  # type: ignore[arg-type]
    c_base = critic_run(critic, batch, stats)
    assert_runs_equal(c_base, critic_run(critic, perturbed(batch, ("values", "old_values", "returns"), seed), stats),
                      "critic")
    assert not bool(c_base[1][obs].any())
    # the same tokens counted as sampled do change the loss: the check above can fail
    counted = actor_run(ActorLoss(config), perturbed(batch, names, seed).drop("loss_mask"),
                        GlobalBatchStats.of(batch.drop("loss_mask")))
    assert not torch.equal(counted[0], base[0]) or bool(counted[1][obs].any())


def test_observation_tokens_equal_removing_them() -> None:
    """A token-mean loss over a multi-turn batch equals the loss over its sampled tokens alone."""
    batch = make_batch(7, [6, 5, 3, 0], 6, observations=0.4)
    keep = batch["loss_mask"]
    order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)
    compact = {k: batch[k].gather(1, order).where(keep.gather(1, order), 0)
               for k in ("log_probs", "old_log_probs", "advantages", "entropy", "ref_log_probs")}
    alone = TensorBatch({**compact, "response_mask": keep.gather(1, order)})
    config = ActorLossConfig(entropy_coef=0.01, kl_loss_coef=0.1, loss_agg_mode="seq-mean-token-mean")
    a = actor_run(ActorLoss(config), batch, GlobalBatchStats.of(batch))
    b = actor_run(ActorLoss(config), alone, GlobalBatchStats.of(alone))
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1].gather(1, order).where(keep.gather(1, order), 0.0), b[1])


# ----------------------------------------------------------------------------- estimators over loss tokens
def ref_rewards(batch: TensorBatch, beta: float = 0.0) -> torch.Tensor:
    """Score on the last sampled token, token scores and the k1 penalty on sampled tokens only."""
    lm = batch.loss_mask
    r = torch.zeros(lm.shape, dtype=F64)
    for b in range(batch.batch_size):
        idx = lm[b].nonzero().squeeze(1).tolist()
        for t in idx:
            r[b, t] += float(batch["token_scores"][b, t])
            r[b, t] -= beta * (float(batch["old_log_probs"][b, t]) - float(batch["ref_log_probs"][b, t]))
        if idx:
            r[b, idx[-1]] += float(batch["scores"][b])
    return r


def ref_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = x[mask]
    if vals.numel() <= 1:
        return torch.zeros_like(x)
    mean = vals.mean()
    var = ((vals - mean) ** 2).sum() / (vals.numel() - 1)
    return torch.where(mask, (x - mean) / torch.sqrt(var + 1e-8), 0.0)


def ref_gae(batch: TensorBatch, gamma: float, lam: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's multi-turn GAE loop: value and advantage carried across observation tokens."""
    lm = batch.loss_mask
    r, v = ref_rewards(batch, beta), batch["values"].to(F64)
    adv = torch.zeros_like(r)
    for b in range(batch.batch_size):
        next_v, last = 0.0, 0.0
        for t in reversed(range(lm.shape[1])):
            if lm[b, t]:
                last = float(r[b, t]) + gamma * next_v - float(v[b, t]) + gamma * lam * last
                adv[b, t], next_v = last, float(v[b, t])
    return ref_whiten(adv, lm), torch.where(lm, adv + v, 0.0)


def ref_discounted(r: torch.Tensor, lm: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(r)
    for b in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            if lm[b, t]:
                g = float(r[b, t]) + gamma * g
                out[b, t] = g
    return out


def ref_outcome(batch: TensorBatch) -> torch.Tensor:
    total: torch.Tensor = batch["scores"].to(F64) + (batch["token_scores"].to(F64) * batch.loss_mask).sum(1)
    return total


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.to(F64), expected, rtol=1e-4, atol=1e-5)


@PROPS
@given(shapes(min_batch=2), st.floats(0.5, 1.0), st.floats(0.5, 1.0), st.sampled_from([0.0, 0.2]))
def test_estimators_skip_observation_tokens(case: tuple[int, list[int], int], gamma: float, lam: float,
                                            beta: float) -> None:
    seed, lengths, width = case
    batch = make_batch(seed, lengths, width, observations=0.4)
    lm = batch.loss_mask
    rewarded, _ = compute_token_rewards(batch, RewardConfig(kl_coef=beta))
    close(rewarded["token_rewards"], ref_rewards(batch, beta))
    outputs = {
        "gae": gae(rewarded, GAEConfig(gamma=gamma, lam=lam)),
        "reinforce_pp": reinforce_pp(rewarded, ReinforcePPConfig(gamma=gamma)),
        "remax": remax(rewarded),
        "grpo": grpo(batch), "rloo": rloo(batch), "reinforce_pp_baseline": reinforce_pp_baseline(batch),
    }
    adv, ret = ref_gae(batch, gamma, lam, beta)
    close(outputs["gae"]["advantages"], adv)
    close(outputs["gae"]["returns"], ret)
    g = ref_discounted(ref_rewards(batch, beta), lm, gamma)
    close(outputs["reinforce_pp"]["advantages"], ref_whiten(g, lm))
    close(outputs["reinforce_pp"]["returns"], g)
    to_go = ref_discounted(ref_rewards(batch, beta), lm, 1.0)
    close(outputs["remax"]["advantages"], torch.where(lm, to_go - batch["baseline_scores"].to(F64)[:, None], 0.0))
    close(outcome_rewards(batch), ref_outcome(batch))
    single = batch.drop("loss_mask", "token_scores").update(scores=outcome_rewards(batch).float())
    for name in ("grpo", "rloo"):
        # the per-sample advantage is that of the totals, broadcast over the sampled tokens only
        per_seq = globals()[name](single)["advantages"][:, 0] if width else torch.zeros(batch.batch_size)
        expected = torch.where(lm, per_seq.to(F64)[:, None], 0.0)
        nonempty = lm.any(1) & batch["response_mask"][:, 0]
        close(outputs[name]["advantages"][nonempty], expected[nonempty])
    for name, out in outputs.items():
        for field in ("advantages", "returns"):
            assert not bool(out[field][~lm].any()), f"{name} {field} not 0 at observation tokens"
        out.check(where=name)


@PROPS
@given(shapes(min_batch=2), st.sampled_from(sorted(PRESETS)))
def test_observation_tokens_change_no_advantage(case: tuple[int, list[int], int], name: str) -> None:
    seed, lengths, width = case
    lengths[0] = width = max(width, 3)
    batch = make_batch(seed, lengths, width, observations=0.4)
    batch = batch.update(loss_mask=batch["loss_mask"].index_fill(1, torch.tensor([1]), False) & batch["response_mask"])
    moved = perturbed(batch, ("token_scores", "values", "old_values", *LOG_PROB_FIELDS), seed)
    a, ma = Algorithm.from_name(name).compute_advantages_with_metrics(batch)
    b, mb = Algorithm.from_name(name).compute_advantages_with_metrics(moved)
    for k in ("advantages", "returns", "token_rewards"):
        if k in a:
            assert torch.equal(a[k], b[k]), f"{name}: {k}"
    assert ma == mb
    assert torch.equal(a["loss_mask"], batch["loss_mask"]) and torch.equal(a["values"], batch["values"])


class _Spy:
    """A plugin whose advantage estimator records the batches it is given."""

    def __init__(self) -> None:
        self.seen: list[TensorBatch] = []

    def estimate(self, batch: TensorBatch, config: Any) -> TensorBatch:
        self.seen.append(batch)
        return grpo(batch)

    @hookimpl
    def verl_algorithm_components(self) -> list[AlgorithmComponent]:
        return [AlgorithmComponent("advantage", "spy_grpo", self.estimate, None, "GRPO, recorded.")]


def test_a_registered_estimator_sees_only_sampled_tokens() -> None:
    reset_registry()
    try:
        spy = _Spy()
        get_registry().register(spy, "spy-algos")
        algo = Algorithm("spy", "spy_grpo")
        batch = make_batch(9, [5, 4, 3, 5], 5, observations=0.4)
        out = algo.compute_advantages(batch)
    finally:
        reset_registry()
    (seen,) = spy.seen
    assert "loss_mask" not in seen
    assert torch.equal(seen["response_mask"].sum(1), batch["loss_mask"].sum(1))
    assert torch.equal(out["advantages"], grpo(batch)["advantages"])
    assert not bool(out["advantages"][~batch["loss_mask"]].any())
