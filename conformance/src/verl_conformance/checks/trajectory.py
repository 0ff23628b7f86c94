"""The same run, N steps: a GRPO loop with the candidate in its roles follows the --verl-against backend's.

Two runs from the same weights and seed, float32 on the suite's device:

* run A, the candidate: the backend under test as actor, reference and rollout (each role it
  provides; the --verl-against backend fills the others);
* run B, the reference: the --verl-against backend in every role.

Each of :data:`GRPO_STEPS` steps samples ``n`` responses for a few fixed prompts, scores them with
a fixed rule, and takes one GRPO update (group-normalised advantages, PPO clip, k3 KL loss to the
reference model) per run, then syncs run A's actor into its rollout engine.

Rollouts are *teacher forced*: the samples of a step come from run A's rollout engine and both
runs train on them. Backends map a seed to tokens differently (inverse CDF, multinomial, vLLM's own
sampler), so two independently sampled runs would part at the first sampled token and compare
nothing; forcing the samples keeps every step comparable. The rollout engine is still checked at
every step: its ``rollout_log_probs`` of the samples must equal run A's actor log-probs, so a
sync that serves stale or wrong weights fails at the step it happens. The reward is then the same
in both runs by construction; the per-step loss, KL to the reference, gradient norm and the
actor's log-probs are compared within the dtype's tier (``loss`` and ``log_probs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.harness import Harness, Subject
from verl_core import (
    GlobalBatchStats,
    OptimConfig,
    Role,
    RolloutEngine,
    SamplingParams,
    StreamWeightSync,
    TensorBatch,
    TrainingEngine,
    WeightSync,
)
from verl_core.algorithms import Algorithm

GRPO_STEPS = 5
PROMPTS_PER_STEP = 3
SAMPLES_PER_PROMPT = 4
RUN_OPTIM = OptimConfig(lr=0.1, eps=1.0, grad_clip=0.0)
"""AdamW with ``eps=1``: close to SGD for the tiny model's gradients, so float32 rounding is not
amplified the way Adam's normalised steps amplify it, yet the KL to the reference reaches ~0.1 in
five steps; no clipping, so the reported gradient norm is the raw one."""


def grpo() -> Algorithm:
    """The run's algorithm: verl's GRPO with a KL loss large enough to matter (k3, coefficient 0.1)."""
    return Algorithm.grpo(kl_loss_coef=0.1)


@dataclass
class Run:
    """One run's engines and what each step recorded."""

    label: str
    actor: TrainingEngine
    reference: TrainingEngine
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    log_probs: list[Tensor] = field(default_factory=list)


def step_prompts(h: Harness, step: int) -> TensorBatch:
    """The fixed prompts of ``step`` (group ids unique over the run)."""
    b = h.batch(seed=90 + step, batch_size=PROMPTS_PER_STEP).select("prompt_ids", "prompt_mask", "group_ids")
    return b.update(group_ids=torch.arange(PROMPTS_PER_STEP, dtype=torch.int64) + step * PROMPTS_PER_STEP)


def rule_scores(samples: TensorBatch) -> Tensor:
    """A fixed reward: the fraction of response tokens with an even id (varies within every group)."""
    mask = samples["response_mask"]
    even = ((samples["response_ids"] % 2) == 0) & mask
    return even.sum(1).float() / mask.sum(1).clamp_min(1).float()


def cut_at_pad(samples: TensorBatch) -> TensorBatch:
    """Cut each response before its first real pad token (the prefix and its log-probs stay as sampled).

    The tiny models' pad token is an ordinary vocabulary id whose embedding row is zero.
    transformers freezes that row (``padding_idx``) while other backends train it like any row,
    and a real pad token then gets a huge gradient through the first norm of a zero vector: a
    real difference between backends, but not one this run is about.
    """
    pad = samples.meta.pad_token_id
    mask = samples["response_mask"]
    real_pad = (samples["response_ids"] == pad) & mask
    if not bool(real_pad.any()):
        return samples
    keep = mask & (real_pad.long().cumsum(1) == 0)
    fields = {"response_ids": samples["response_ids"].masked_fill(~keep, pad), "response_mask": keep,
              "rollout_log_probs": samples["rollout_log_probs"].masked_fill(~keep, 0.0)}
    if "truncated" in samples:  # a cut response ends without EOS
        fields["truncated"] = samples["truncated"] | real_pad.any(1)
    return samples.update(fields)


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x.double() * mask).sum() / mask.sum().clamp_min(1))


def _train_step(run: Run, samples: TensorBatch, algorithm: Algorithm) -> None:
    old = run.actor.forward(samples)["log_probs"]
    ref = run.reference.forward(samples)["log_probs"]
    mask = samples["response_mask"]
    batch = samples.update(old_log_probs=old, ref_log_probs=ref)
    batch = algorithm.compute_advantages(batch)
    metrics = run.actor.forward_backward(batch, algorithm.actor_loss, GlobalBatchStats.of(batch))
    step = run.actor.optimizer_step()
    run.losses.append(metrics["loss"])
    run.grad_norms.append(step.grad_norm)
    run.kls.append(_masked_mean(old - ref, mask))
    run.log_probs.append(old)


def _sync(src: Subject, dst: Subject) -> WeightSync:
    if src.registered and dst.registered:
        from verl_core import get_weight_sync

        return get_weight_sync(src.name, dst.name)
    return StreamWeightSync()


@check("differential")
def check_against_grpo_run(h: Harness) -> None:
    """A 5-step GRPO run with the candidate as actor, reference and rollout equals the --verl-against backend's run, step by step."""
    other = h.require_against()
    me = h.subject
    if not (h.provides(me, "actor") or h.provides(me, "rollout")):
        h.skip(f"backend {me.name!r} provides neither an actor nor a rollout engine")
    roles_needed: tuple[Role, ...] = ("actor", "reference", "rollout")
    for role in roles_needed:
        if not (h.provides(me, role) or h.provides(other, role)):
            h.skip(f"neither {me.name!r} nor {other.name!r} provides a {role} engine")

    a_roles = {role: me if h.provides(me, role) else other for role in roles_needed}
    a = Run(f"{me.name} run", h.training(fresh=True, subject=a_roles["actor"], optim=RUN_OPTIM, micro_batch_size=4),
            h.training("reference", subject=a_roles["reference"]))
    b = Run(f"{other.name} run", h.training(fresh=True, subject=other, optim=RUN_OPTIM, micro_batch_size=6),
            h.training("reference", subject=other))
    rollout: RolloutEngine = h.rollout(fresh=True, subject=a_roles["rollout"])
    sync = _sync(a_roles["actor"], a_roles["rollout"])
    algorithm = grpo()
    roles = ", ".join(f"{r} {s.name}" for r, s in a_roles.items())
    h.note(f"{me.name} run: {roles}; against {other.name} in every role")
    for step in range(GRPO_STEPS):
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=SAMPLES_PER_PROMPT, seed=1000 + step)
        samples = cut_at_pad(rollout.generate(step_prompts(h, step), params))
        samples = samples.update(scores=rule_scores(samples))
        _train_step(a, samples, algorithm)
        _train_step(b, samples, algorithm)
        at = f"step {step + 1} of {GRPO_STEPS} ({me.name} run: {roles}; against {other.name} in every role)"
        mask = samples["response_mask"]
        if rollout.log_probs_exact(params):
            h.close_to(samples["rollout_log_probs"], a.log_probs[-1], "log_probs",
                       f"{at}: the rollout's rollout_log_probs vs its actor's log_probs (the rollout does not serve "
                       "the weights synced from the actor)", mask=mask)
        h.close_to(a.log_probs[-1], b.log_probs[-1], "log_probs", f"{at}: actor log_probs before the update", mask=mask)
        h.scalar_close(a.kls[-1], b.kls[-1], "loss", f"{at}: KL to the reference (mean old - ref log-prob)")
        h.scalar_close(a.losses[-1], b.losses[-1], "loss", f"{at}: loss")
        h.scalar_close(a.grad_norms[-1], b.grad_norms[-1], "loss", f"{at}: grad norm")
        sync.sync(a.actor, rollout, version=step + 1)
    h.expect(abs(a.kls[-1]) > 1e-4, f"after {GRPO_STEPS - 1} updates the actor's KL to the reference is "
             f"{a.kls[-1]:.3g}: the run did not move the model, so it compares nothing")
