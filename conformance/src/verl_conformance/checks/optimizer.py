"""The optimizer as ``OptimConfig`` describes it, and updates skipped on a non-finite gradient.

The other checks train with the suite's optimizer (AdamW ``lr=1, eps=1``, default betas, no weight
decay, no clipping, a constant schedule) or compare an engine only with itself, so an engine that
ignores weight decay, betas, clipping or the learning-rate schedule, or reports the grad norm after
clipping, passes them. Here a few updates under an optimizer that uses every setting are compared
with torch's AdamW in float64; and a non-finite loss must skip its update without touching the
weights, the optimizer's state or the schedule. Both hold the actor and, beside it, a critic that
declares values (under the suite's value loss).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.stateful import STATE_OPTIM, compare_next_update
from verl_conformance.harness import (
    BFLOAT16_RUN,
    SUITE_OPTIM,
    Harness,
    collect_stream,
    exported_weights,
)
from verl_conformance.losses import SuiteLoss, role_loss
from verl_conformance.reference import ReferenceModel
from verl_core import (
    GlobalBatchStats,
    LossOutput,
    OptimConfig,
    Role,
    StepMetrics,
    TensorBatch,
    TrainingEngine,
    WeightCommit,
    WeightManifest,
)

OPTIM_STEPS = 4
"""Updates of :func:`check_optimizer_matches_reference` (two of warmup, the peak, then cosine decay) and of
:func:`check_lr_schedule_past_warmup_and_decay` under each schedule (one of warmup, the cosine's peak, its floor
at ``total_steps`` (2), then one past it)."""


def every_setting(grad_clip: float) -> OptimConfig:
    """AdamW with decoupled weight decay, non-default betas, clipping at ``grad_clip`` and a 2-step
    warmup into a cosine decay over 4 steps (learning rates 0.25, 0.5, 0.5, 0.275)."""
    return OptimConfig(lr=0.5, eps=1.0, betas=(0.8, 0.95), weight_decay=0.1, warmup_steps=2, schedule="cosine",
                       total_steps=OPTIM_STEPS, min_lr_ratio=0.1, grad_clip=grad_clip)


def _batches(h: Harness) -> list[TensorBatch]:
    return [h.batch(seed=70 + k, rl_fields=True) for k in range(OPTIM_STEPS)]


@check("numerics", gates=("training.values",))
def check_optimizer_matches_reference(h: Harness) -> None:
    """Four updates under AdamW with weight decay, betas (0.8, 0.95), gradient clipping and a warmup-then-cosine schedule equal torch AdamW in float64: each step's lr and grad norm (before clipping), the weights after, and the stream's version (4); for the actor, and for the critic under the value loss where the backend provides one declaring values (a critic-only backend: the critic)."""
    batches = _batches(h)
    for role in h.trained_roles():
        _optimizer_matches_reference(h, role, batches)
        h.close_fresh()  # the role's engine, before the next role's is built


def _optimizer_matches_reference(h: Harness, role: Role, batches: list[TensorBatch]) -> None:
    """:func:`check_optimizer_matches_reference` on an engine of ``role`` (an actor's messages unprefixed)."""
    path = h.model_path("value" if role == "critic" else "llama")
    loss = role_loss(role)
    who = "" if role == "actor" else f"the {role}: "
    # clip at half the first step's gradient norm, so clipping acts
    first = ReferenceModel(path, SUITE_OPTIM).loss_and_grads(batches[0], loss, GlobalBatchStats.of(batches[0]))
    optim = every_setting(round(0.5 * first.grad_norm, 4))
    settings = (f"lr {optim.lr}, betas {optim.betas}, weight_decay {optim.weight_decay}, grad_clip {optim.grad_clip}, "
                f"warmup_steps {optim.warmup_steps}, cosine over {optim.total_steps} steps")
    engine = h.training(role, fresh=True, optim=optim, micro_batch_size=2)
    ref = ReferenceModel(path, optim)
    before = exported_weights(engine)
    ref_before = ref.state()
    for k, batch in enumerate(batches):
        stats = GlobalBatchStats.of(batch)
        metrics = engine.forward_backward(batch, loss, stats)
        step = engine.optimizer_step()
        want = ref.step(batch, loss, stats)
        at = f"{who}update {k} under AdamW ({settings})"
        _applied_at_schedule(h, at, step, optim, k, "the warmup and cosine schedule of spec.optim")
        h.scalar_close(metrics["loss"], want.loss, "loss", f"{at}: loss vs float64 reference")
        h.scalar_close(step.grad_norm, want.grad_norm, "loss",
                       f"{at}: grad norm vs float64 reference (the global norm before clipping, "
                       f"{'clipped to' if want.grad_norm > optim.grad_clip else 'under'} {optim.grad_clip:g})")
    version = export_version(engine)
    h.expect(version == OPTIM_STEPS, f"{who}after {OPTIM_STEPS} applied updates export_weights streams version "
             f"{version}; the version is the count of applied optimizer steps, {OPTIM_STEPS}")
    _moved_as_reference(h, engine, before, ref, ref_before, who,
                        f"{OPTIM_STEPS} updates under AdamW ({settings}) vs torch AdamW in float64 (weight decay "
                        "decoupled and on every parameter, betas, clipping by the global norm, lr of the schedule)")


def _applied_at_schedule(h: Harness, at: str, step: StepMetrics, optim: OptimConfig, k: int, why: str) -> None:
    """Update ``k`` was applied (not skipped) at ``optim.lr_at(k)``; ``why`` names the rule in the message."""
    h.expect(not step.skipped, f"{at}: optimizer_step skipped a finite update")
    h.expect(abs(step.lr - optim.lr_at(k)) <= 1e-9 * optim.lr,
             f"{at}: optimizer_step ran at lr {step.lr:.6g}, OptimConfig.lr_at({k}) is {optim.lr_at(k):.6g} ({why})")


def _moved_as_reference(h: Harness, engine: TrainingEngine, before: dict[str, Tensor], ref: ReferenceModel,
                        ref_before: dict[str, Tensor], who: str, updates: str) -> None:
    """Each exported parameter moved from ``before`` as the float64 reference's did from ``ref_before``
    (the gradient tier); ``updates`` says which updates, after "moved by"."""
    after = exported_weights(engine)
    for name, w in ref.state().items():
        h.expect(name in after, f"{who}export_weights lacks {name} after {OPTIM_STEPS} updates")
        h.close_to(after[name].double() - before[name].double(), w - ref_before[name], "grad",
                   f"{who}{name} moved by {updates}")


def past_the_schedule(schedule: Literal["constant", "cosine"]) -> OptimConfig:
    """AdamW (no weight decay or clipping) with a 1-step warmup and ``total_steps=2``: the cosine's
    learning rates are 0.5, 0.5, 0.05, 0.05 (held at ``min_lr_ratio * lr`` past ``total_steps``), the
    constant schedule's 0.5 at every step (``total_steps`` set, but it does not decay)."""
    return OptimConfig(lr=0.5, eps=1.0, betas=(0.8, 0.95), weight_decay=0.0, warmup_steps=1, schedule=schedule,
                       total_steps=2, min_lr_ratio=0.1, grad_clip=0.0)


@check("numerics")
def check_lr_schedule_past_warmup_and_decay(h: Harness) -> None:
    """The learning rate is OptimConfig.lr_at(k) where numerics::optimizer_matches_reference does not look: with total_steps=2, a cosine schedule holds min_lr_ratio * lr at its floor and past it (it does not climb back as torch's CosineAnnealingLR does), and schedule='constant' stays at lr after the warmup (total_steps set, no decay); four updates under each, each step's reported lr and the weights after vs torch AdamW in float64 at lr_at(k); for the actor (a critic-only backend: the critic)."""
    role = h.trained_role()
    who = "" if role == "actor" else f"the {role}: "
    path = h.model_path("value" if role == "critic" else "llama")
    loss = role_loss(role)
    batches = _batches(h)
    for schedule in ("cosine", "constant"):
        optim = past_the_schedule(schedule)
        lrs = ", ".join(f"{optim.lr_at(k):g}" for k in range(OPTIM_STEPS))
        settings = (f"schedule={schedule!r}, lr {optim.lr}, warmup_steps {optim.warmup_steps}, total_steps "
                    f"{optim.total_steps}, min_lr_ratio {optim.min_lr_ratio}: lr_at(0..{OPTIM_STEPS - 1}) = {lrs}")
        engine = h.training(role, fresh=True, optim=optim)
        ref = ReferenceModel(path, optim)
        before = exported_weights(engine)
        ref_before = ref.state()
        for k, batch in enumerate(batches):
            stats = GlobalBatchStats.of(batch)
            engine.forward_backward(batch, loss, stats)
            step = engine.optimizer_step()
            ref.step(batch, loss, stats)
            _applied_at_schedule(h, f"{who}update {k} ({settings})", step, optim, k,
                                 "a cosine stays at its floor past total_steps" if schedule == "cosine"
                                 else "a constant schedule does not decay, total_steps or not")
        _moved_as_reference(h, engine, before, ref, ref_before, who,
                            f"{OPTIM_STEPS} updates ({settings}) vs torch AdamW in float64 at lr_at(k) (the lr "
                            "applied, not only the one reported)")
        h.close_fresh()


def export_version(engine: TrainingEngine) -> int:
    """The version of the engine's weight stream (its manifest's; the commit must say the same)."""
    msgs = collect_stream(engine.export_weights())[0]
    manifest, commit = msgs[0], msgs[-1]
    assert isinstance(manifest, WeightManifest) and isinstance(commit, WeightCommit)
    return manifest.version if manifest.version == commit.version else -1


class _NonFiniteLoss:
    """A suite loss times NaN (the role's: the token-mean policy gradient, a critic's value MSE): every gradient is NaN."""

    def __init__(self, loss: SuiteLoss) -> None:
        self.loss = loss
        self.needs = loss.needs

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        out = self.loss(batch, stats)
        return LossOutput(out.loss * float("nan"), dict(out.metrics))


@check("robustness", gates=("training.values",))
def check_nonfinite_update_skipped(h: Harness) -> None:
    """A NaN loss makes optimizer_step skip (skipped=True, a non-finite grad norm) and leaves weights, weight version, optimizer state and schedule as they were: the next three updates equal an engine's that never saw it; for the actor, and for the critic under the value loss where the backend provides one declaring values (a critic-only backend: the critic)."""
    for role in h.trained_roles():
        _nonfinite_update_skipped(h, role)
        h.close_fresh()  # the role's engines, before the next role's are built


def _nonfinite_update_skipped(h: Harness, role: Role) -> None:
    """:func:`check_nonfinite_update_skipped` on engines of ``role`` (an actor's messages unprefixed)."""
    optim = STATE_OPTIM
    who = "" if role == "actor" else f"the {role}: "
    engine = h.training(role, fresh=True, optim=optim, micro_batch_size=2)
    clean = h.training(role, fresh=True, optim=optim, micro_batch_size=2)
    batch = h.batch(seed=68, rl_fields=True)
    before = exported_weights(engine)
    what = f"{who}after a forward_backward whose loss is NaN and its optimizer_step"
    try:
        engine.forward_backward(batch, _NonFiniteLoss(role_loss(role)), GlobalBatchStats.of(batch))
    except Exception as e:
        h.fail(f"{who}forward_backward raised {type(e).__name__} on a NaN loss: {e}; it must return (the loss and "
               "metrics are NaN) so that optimizer_step sees the non-finite grad norm and skips the update")
    step = engine.optimizer_step()
    h.expect(step.skipped and not math.isfinite(step.grad_norm),
             f"{who}optimizer_step after a NaN loss returned skipped={step.skipped}, grad_norm={step.grad_norm}: a "
             "non-finite global grad norm must skip the update (skipped=True, the non-finite norm reported)")
    h.expect(abs(step.lr - optim.lr_at(0)) <= 1e-9 * optim.lr,
             f"{who}the skipped step reports lr {step.lr:.6g}; it is the lr the update would have run at, lr_at(0) = "
             f"{optim.lr_at(0):.6g}")
    changed = sorted(n for n, w in exported_weights(engine).items() if not torch.equal(w, before[n]))
    h.expect(not changed, f"{what}: the weights changed ({changed[:3]}); a skipped update leaves them untouched")
    version = export_version(engine)
    h.expect(version == 0, f"{what}: export_weights streams version {version}; the version counts applied optimizer "
             "steps, and a skipped one is not applied")
    compare_next_update(h, engine, clean, what,
                        "the skipped step touched the optimizer's state or advanced its step count or schedule")


SMALL_STEPS = 32
"""Updates of :func:`check_bfloat16_small_updates_accumulate`."""
SMALL_LR = 1e-5
"""Its learning rate: AdamW moves each weight by about this much a step, a sixth of half of
bfloat16's spacing around the test kit's typical weight (|w| ~ 0.02: spacing 1.2e-4), so a
bfloat16 parameter stepped directly keeps almost none of it, while 32 of them add up to a few
spacings."""


@check("numerics", gates=("training.values",))
def check_bfloat16_small_updates_accumulate(h: Harness) -> None:
    """In bfloat16, updates each below half of bfloat16's spacing around a weight still add up: after 32 AdamW steps at lr=1e-5 the exported projection weights moved at least 0.5 of the float64 reference's displacement (L2; float32 master weights keep them), not stayed put; for the actor, and for the critic under the value loss on the value-head folder where the backend provides one declaring values (a critic-only backend: the critic); runs in bfloat16 only."""
    if h.dtype != "bfloat16":
        h.skip(f"runs in bfloat16 only ({BFLOAT16_RUN}); {h.dtype} parameters keep every update")
    optim = OptimConfig(lr=SMALL_LR, eps=1e-8, weight_decay=0.0, grad_clip=0.0)
    batch = h.batch(seed=90, rl_fields=True)  # the same batch every step: each weight keeps its direction
    moved = []
    for role in h.trained_roles():
        moved.append(f"{role} {_small_updates_accumulate(h, role, optim, batch):.3f}")
        h.close_fresh()  # the role's engine, before the next role's is built
    h.note(f"share of the float64 reference's displacement (L2) the projection weights moved: {', '.join(moved)}")


def _small_updates_accumulate(h: Harness, role: Role, optim: OptimConfig, batch: TensorBatch) -> float:
    """:func:`check_bfloat16_small_updates_accumulate` on an engine of ``role``: how much of the float64
    reference's displacement (L2) its projection weights moved (an actor's messages unprefixed)."""
    who = "" if role == "actor" else f"the {role}: "
    loss = role_loss(role)
    engine = h.training(role, fresh=True, optim=optim)
    ref = ReferenceModel(h.model_path("value" if role == "critic" else "llama"), optim)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    stats = GlobalBatchStats.of(batch)
    for _ in range(SMALL_STEPS):
        engine.forward_backward(batch, loss, stats)
        engine.optimizer_step()
        ref.step(batch, loss, stats)
    got = exported_weights(engine)
    want = dict(ref.named_parameters())
    moved = kept = 0.0
    for name, w0 in start.items():
        if w0.dim() != 2 or "embed" in name or name not in got:
            continue  # the projections: 2-D weights of a typical magnitude (norm weights sit at 1.0)
        moved += float((want[name].detach() - w0).pow(2).sum())
        kept += float((got[name].double() - w0.to(torch.bfloat16).double()).pow(2).sum())
    h.expect(moved > 0, f"{who}the float64 reference did not move: no projection weights to compare")
    # the size of the displacement, not its direction: AdamW moves every weight by about lr a step,
    # and in bfloat16 the sign of a tiny gradient may differ from float64's
    rel = math.sqrt(kept / moved)
    h.expect(rel >= 0.5,
             f"{who}after {SMALL_STEPS} AdamW steps at lr={SMALL_LR:g} in bfloat16 "
             f"{'under the value loss ' if role == 'critic' else ''}the projection weights moved "
             f"{rel:.2f} of the float64 reference's displacement (L2); at least 0.5 keeps the updates. Each "
             "step is below half of bfloat16's spacing around a weight, so stepping bfloat16 parameters "
             "directly drops it: keep float32 master weights (backend-training-engine.md, Declaring bfloat16)")
    return rel
