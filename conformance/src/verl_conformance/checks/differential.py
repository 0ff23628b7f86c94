"""Differential: trajectories and greedy sampling vs the reference, and everything vs a second backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.numerics import family_rollouts, one_update
from verl_conformance.checks.rope import greedy_tokens_match
from verl_conformance.harness import SUITE_OPTIM, Harness, Subject, exported_weights
from verl_conformance.losses import PPO_CLIP, TOKEN_MEAN_PG, grpo_advantages
from verl_conformance.reference import ReferenceModel, cached_outputs, greedy_reference
from verl_conformance.testkit import near_tie_margin, tolerance
from verl_core import GlobalBatchStats, RolloutEngine, SamplingParams, TensorBatch, TrainingEngine

TRAJECTORY_STEPS = 3


@dataclass
class Trajectory:
    """Per-step losses and grad norms, and the initial and final log-probs, of a fixed-rollout GRPO run."""

    losses: list[float]
    grad_norms: list[float]
    initial_log_probs: Tensor
    final_log_probs: Tensor


def fixed_rollouts(h: Harness, step: int) -> TensorBatch:
    """The fixed rollouts of step ``step``: 2 groups of 3 samples with scores (no sampling involved)."""
    b = h.batch(seed=40 + step, group_size=3, rl_fields=True, empty=0)
    return b.select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "scores")


def _grpo_batch(batch: TensorBatch, old_log_probs: Tensor) -> TensorBatch:
    adv = grpo_advantages(batch["scores"], batch["group_ids"], batch["response_mask"])
    return batch.update(old_log_probs=old_log_probs.float() * batch["response_mask"], advantages=adv.float())


def engine_trajectory(h: Harness, engine: TrainingEngine) -> Trajectory:
    """Run the fixed-rollout GRPO trajectory on ``engine`` (old log-probs from its own forward)."""
    losses, norms = [], []
    initial = engine.forward(fixed_rollouts(h, 0))["log_probs"]
    for step in range(TRAJECTORY_STEPS):
        batch = fixed_rollouts(h, step)
        old = engine.forward(batch)["log_probs"]
        batch = _grpo_batch(batch, old)
        m = engine.forward_backward(batch, PPO_CLIP, GlobalBatchStats.of(batch))
        s = engine.optimizer_step()
        losses.append(m["loss"])
        norms.append(s.grad_norm)
    final = engine.forward(fixed_rollouts(h, 0))["log_probs"]
    return Trajectory(losses, norms, initial, final)


def reference_trajectory(h: Harness, model: str = "llama") -> Trajectory:
    """The same trajectory in float64 with transformers and torch AdamW."""
    ref = ReferenceModel(h.model_path(model), SUITE_OPTIM)
    losses, norms = [], []
    initial = ref.outputs(fixed_rollouts(h, 0))["log_probs"]
    for step in range(TRAJECTORY_STEPS):
        batch = fixed_rollouts(h, step)
        old = ref.outputs(batch)["log_probs"]
        batch = _grpo_batch(batch, old)
        r = ref.step(batch, PPO_CLIP, GlobalBatchStats.of(batch))
        losses.append(r.loss)
        norms.append(r.grad_norm)
    final = ref.outputs(fixed_rollouts(h, 0))["log_probs"]
    return Trajectory(losses, norms, initial, final)


def compare_trajectories(h: Harness, got: Trajectory, want: Trajectory, label: str) -> None:
    """Fail at the first step where the trajectories part."""
    for i, (a, b) in enumerate(zip(got.losses, want.losses, strict=True)):
        h.scalar_close(a, b, "loss", f"{label}: loss at step {i}")
    for i, (a, b) in enumerate(zip(got.grad_norms, want.grad_norms, strict=True)):
        h.scalar_close(a, b, "loss", f"{label}: grad norm at step {i}")
    mask = fixed_rollouts(h, 0)["response_mask"].cpu().bool()
    what = f"{label}: log_probs after {TRAJECTORY_STEPS} steps"
    got_final = got.final_log_probs.detach().double().cpu()
    want_final = want.final_log_probs.detach().double().cpu()
    if not bool(torch.isfinite(got_final[mask]).all()):
        h.fail(f"{what}: non-finite log-probs")
    tier = tolerance(h.dtype, "loss")
    err = (got_final - want_final)[mask]
    if bool((err.abs() <= tier.atol + tier.rtol * want_final[mask].abs()).all()):
        return
    # The suite's optimizer moves log-probs by several nats in three steps, and each step's
    # update follows gradients that carry the dtype's rounding (~1e-2 relative in bfloat16). So
    # the error after the trajectory scales with how far it moved: it may exceed the elementwise
    # tier only while it stays within the gradient tier relative to the reference's displacement.
    moved = (want_final - want.initial_log_probs.detach().double().cpu())[mask]
    rel = float(err.norm()) / max(float(moved.norm()), 1e-30)
    limit = tolerance(h.dtype, "grad").rel_l2
    if rel > limit:
        worst = int(err.abs().argmax())
        h.fail(
            f"{what}: outside the {h.dtype} loss tier (worst error {float(err.abs()[worst]):.4g}) and "
            f"relative to the reference's displacement (L2 {float(moved.norm()):.4g}) the error is "
            f"{rel:.3g} > {limit:g}, the {h.dtype} gradient tier"
        )


@check("differential")
def check_trajectory_matches_reference(h: Harness) -> None:
    """A 3-step GRPO trajectory on fixed rollouts (teacher forcing) follows the float64 reference."""
    engine = h.training(fresh=True, micro_batch_size=2)
    compare_trajectories(h, engine_trajectory(h, engine), reference_trajectory(h),
                         f"{TRAJECTORY_STEPS}-step GRPO trajectory vs float64 reference")


def _greedy(h: Harness, subject: Subject | None = None, engine: RolloutEngine | None = None) -> TensorBatch:
    engine = engine or h.rollout(subject=subject)
    prompts = h.batch(seed=30, batch_size=4).select("prompt_ids", "prompt_mask", "group_ids")
    return engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8))


@check("differential")
def check_greedy_matches_reference(h: Harness) -> None:
    """Greedy decoding gives the float64 reference's tokens (up to the first near-tie); on a Qwen2 and a tied Qwen3 folder with every tensor moved (q/k/v biases and norm weights other than zeros and ones), each greedy token is the reference's most likely after its prefix (a near tie either way); a Qwen folder refused with a ConfigError naming its model_type is listed as refused (where both are, the perturbed Llama is compared instead: its norm weights)."""
    out = _greedy(h)
    eos = h.rollout().tokenizer.eos_token_id
    # A near tie is a top-2 logit gap the engine's dtype may break either way.
    margin = near_tie_margin(h.dtype)
    for b in range(out.batch_size):
        prompt = out["prompt_ids"][b][out["prompt_mask"][b]]
        toks = out["response_ids"][b][out["response_mask"][b]].tolist()
        want, decided = greedy_reference(h.model_path("llama"), prompt, 8, {eos}, margin=margin)
        n = min(decided, len(want))
        h.expect(toks[:n] == want[:n],
                 f"greedy sample {b}: got tokens {toks}, the float64 reference gives {want} "
                 f"(first {n} decided without near-ties)")
    engines, refused = family_rollouts(h)
    for model, what, engine in engines:
        out = _greedy(h, engine=engine)
        ref = cached_outputs(h.model_path(model), out, ("log_probs", "max_log_probs"))
        greedy_tokens_match(h, out, ref, f"greedy tokens on {what} vs the float64 reference")
    h.note(f"compared on llama and {', '.join(m for m, _, _ in engines)}"
           + (f"; refused (ConfigError naming the model_type): {', '.join(refused)}" if refused else ""))


@check("differential")
def check_against_log_probs(h: Harness) -> None:
    """log_probs and entropy equal those of the --verl-against backend on the same weights."""
    other = h.require_against()
    for model in ("llama", "qwen3-tied"):
        batch = h.batch(seed=31, temperature=0.8)
        a = h.training(model=model).forward(batch, ["log_probs"])["log_probs"]
        b = h.training(model=model, subject=other).forward(batch, ["log_probs"])["log_probs"]
        h.close_to(a, b, "log_probs", f"log_probs of {model}: {h.subject.name} vs {other.name}",
                   mask=batch["response_mask"])


@check("differential")
def check_against_one_update(h: Harness) -> None:
    """One update's loss, grad norm and gradients equal those of the --verl-against backend."""
    other = h.require_against()
    batch = h.batch(seed=32, rl_fields=True)
    ma, na, ga = one_update(h, h.training(fresh=True, micro_batch_size=2), batch, TOKEN_MEAN_PG)
    mb, nb, gb = one_update(h, h.training(fresh=True, subject=other, micro_batch_size=3), batch, TOKEN_MEAN_PG)
    label = f"{h.subject.name} vs {other.name}"
    h.scalar_close(ma["loss"], mb["loss"], "loss", f"loss: {label}")
    h.scalar_close(na, nb, "loss", f"grad norm: {label}")
    for name, g in gb.items():
        h.expect(name in ga, f"{h.subject.name} does not export {name}, which {other.name} does")
        h.close_to(ga[name], g, "grad", f"gradient of {name}: {label}")  # type: ignore[arg-type]


@check("differential")
def check_against_trajectory(h: Harness) -> None:
    """A 3-step GRPO trajectory on fixed rollouts equals the --verl-against backend's."""
    other = h.require_against()
    a = engine_trajectory(h, h.training(fresh=True))
    b = engine_trajectory(h, h.training(fresh=True, subject=other))
    compare_trajectories(h, a, b, f"trajectory: {h.subject.name} vs {other.name}")


@check("differential")
def check_against_greedy(h: Harness) -> None:
    """Greedy decoding gives the same tokens as the --verl-against backend, up to the first near-tie of the float64 reference (where the two may break a tie their dtype makes apart)."""
    other = h.require_against()
    a, b = _greedy(h), _greedy(h, other)
    eos = h.rollout().tokenizer.eos_token_id
    margin = near_tie_margin(h.dtype)
    for i in range(a.batch_size):
        ta = a["response_ids"][i][a["response_mask"][i]].tolist()
        tb = b["response_ids"][i][b["response_mask"][i]].tolist()
        if ta == tb:
            continue
        apart = next((t for t, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        prompt = a["prompt_ids"][i][a["prompt_mask"][i]]
        want, decided = greedy_reference(h.model_path("llama"), prompt, 8, {eos}, margin=margin)
        h.expect(apart >= decided and ta[:apart] == want[:apart],
                 f"greedy sample {i}: {h.subject.name} gives {ta}, {other.name} gives {tb}: apart at token {apart}, "
                 f"where the float64 reference ({want}) has no near-tie (its first {decided} tokens are decided "
                 f"by more than the {h.dtype} near-tie margin {margin:g})")


@check("differential")
def check_against_weights(h: Harness) -> None:
    """Both backends export the same weights for the same folder (names, shapes, values)."""
    other = h.require_against()
    wa = exported_weights(h.training())
    wb = exported_weights(h.training(subject=other))
    h.expect(set(wa) == set(wb), f"exported names differ: only {h.subject.name}: {sorted(set(wa) - set(wb))[:4]}, "
             f"only {other.name}: {sorted(set(wb) - set(wa))[:4]}")
    for name in wa:
        h.close_to(wa[name].float(), wb[name].float(), "weights", f"exported {name}")
