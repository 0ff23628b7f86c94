"""The second half of an RL step: advantages on the global batch, then the optimizer steps.

:class:`UpdateStage` gathers the forwards' outputs into the training batch and computes the
advantages (:class:`~verl_core.algorithms.Algorithm`), then takes the step's mini-batches from the
replay buffer and trains each engine on them: per mini-batch, ``forward_backward`` over the
micro-batches the :class:`~verl_core.trainer.batching.scheduler.DynamicBatchScheduler` picks, then
``optimizer_step`` (actor, and critic when the algorithm has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_core.algorithms.onpolicy import OnPolicyActorLoss
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.training import LossFn, TrainingEngine
from verl_core.trainer.batching.replay import HybridReplayBuffer
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler, train_mini_batch
from verl_core.trainer.config import RunConfig
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.step_state import RunProgress, StepState

__all__ = ["UpdateStage", "masked_mean"]

_NOT_COMPARABLE = "not comparable"


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` where ``mask`` is True (0 for an empty mask)."""
    n = int(mask.sum())
    return float((values * mask).sum() / n) if n else 0.0


class UpdateStage:
    """Advantages and optimizer steps of one RL step.

    Args:
        config: The run.
        engines: The run's engines (read at call time).
        algorithm: The run's :class:`~verl_core.algorithms.Algorithm`.
        schedulers: The micro-batch scheduler of each training role.
        buffer: The replay buffer the mini-batches are drawn from.
        progress: The trainer's counters (step, non-finite skips in a row, the running stage).
        dynamic_sampling: The batch keeps only groups with signal (the baseline is cut alike).
        on_policy_old_log_probs: The batch gets one optimizer step and no separate actor forward ran:
            the actor trains under :class:`~verl_core.algorithms.onpolicy.OnPolicyActorLoss`, whose
            old log-probs are its own forward's, and the entropy, KL-to-reference and log-prob
            mismatch metrics come from that forward.
    """

    def __init__(
        self, config: RunConfig, engines: RLEngines, algorithm: Any, schedulers: Mapping[str, DynamicBatchScheduler],
        buffer: HybridReplayBuffer, progress: RunProgress, *, dynamic_sampling: bool,
        on_policy_old_log_probs: bool = False,
    ) -> None:
        self.config = config
        self.engines = engines
        self.algorithm = algorithm
        self.schedulers = schedulers
        self.buffer = buffer
        self.progress = progress
        self.dynamic_sampling = dynamic_sampling
        self.on_policy = on_policy_old_log_probs
        self._compare_rollout = False

    @property
    def step(self) -> int:
        """The steps completed (the running step's index)."""
        return self.progress.step

    @property
    def _stage(self) -> str:
        return self.progress.stage

    @_stage.setter
    def _stage(self, name: str) -> None:
        self.progress.stage = name

    # ------------------------------------------------------------------ advantages
    def advantages(self, state: StepState) -> None:
        """Add the advantages (and returns) to ``state.batch``, with their metrics and the forwards'."""
        metrics = state.metrics
        batch = state.batch
        # on policy, the update's own forward gives the old log-probs, entropy and KL to the reference
        if not self.on_policy:
            state.require("old_log_probs", by="advantages")
            metrics["actor/entropy"] = masked_mean(state.require("entropy", by="advantages"), batch.loss_mask)
            if "ref_log_probs" in batch:
                metrics["actor/kl_ref"] = masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], batch.loss_mask)
        # rollout vs training log-prob mismatch (only meaningful when the rollout's are exact); on
        # policy, the update's forward reports the mean only (a max does not sum over micro-batches)
        exact = "rollout_log_probs" in batch and self.engines.rollout.log_probs_exact(state.params)
        if self.on_policy:
            self._compare_rollout = exact
        elif exact:
            delta = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * batch.loss_mask
            n = int(batch.loss_mask.sum())
            metrics["logprob_mismatch/mean"] = float(delta.sum() / n) if n else 0.0
            metrics["logprob_mismatch/max"] = float(delta.max()) if n else 0.0
        else:
            metrics["logprob_mismatch/mean"] = _NOT_COMPARABLE
            metrics["logprob_mismatch/max"] = _NOT_COMPARABLE
        self._stage = "advantages"
        state.batch, adv_metrics = self.algorithm.compute_advantages_with_metrics(batch)
        metrics.update({f"algorithm/{k}": float(v) for k, v in adv_metrics.items()})
        metrics["algorithm/advantage_abs_mean"] = masked_mean(state.require("advantages", by="advantages").abs(),
                                                              batch.loss_mask)

    # ------------------------------------------------------------------ optimizer steps
    def _actor_loss(self) -> LossFn:
        if not self.on_policy:
            return self.algorithm.actor_loss  # type: ignore[no-any-return]
        return OnPolicyActorLoss(self.algorithm.actor_loss, compare_rollout=self._compare_rollout)

    def run(self, state: StepState) -> None:
        """Train on ``state.batch`` (with its advantages); adds the optimizer steps' metrics to the step's."""
        state.require("advantages", by="actor_update")
        state.metrics.update(self._update(state.batch))

    def _update(self, batch: TensorBatch) -> dict[str, float]:
        cfg = self.config.batch
        fields_drop = [f for f in ("log_probs", "entropy", "values") if f in batch]
        batch = batch.drop(*fields_drop)
        self.buffer.add(batch)
        spilled = self.buffer.samples_on_disk
        size = cfg.mini_batch_size or batch.batch_size
        sums: dict[str, float] = {}
        updates = 0
        skipped_updates = 0
        p = self.progress

        def add(prefix: str, values: Mapping[str, float]) -> None:
            for k, v in values.items():
                sums[f"{prefix}/{k}"] = sums.get(f"{prefix}/{k}", 0.0) + float(v)

        try:
            seed = self.config.seed * 1_000_003 + self.step
            actor, critic, critic_loss = self.engines.actor, self.engines.critic, self.algorithm.critic_loss
            for i, mb in enumerate(self.buffer.mini_batches(size, epochs=cfg.epochs, seed=seed)):
                actor_m = self._train_engine("actor", actor, mb, self._actor_loss(), i)
                add("actor", actor_m)
                skipped = actor_m["skipped"] > 0
                if critic is not None and critic_loss is not None:
                    critic_m = self._train_engine("critic", critic, mb, critic_loss, i)
                    add("critic", critic_m)
                    skipped = skipped or critic_m["skipped"] > 0
                updates += 1
                # an engine skips a non-finite update on every rank (docs/architecture.md, "Loss and distribution")
                skipped_updates += skipped
                p.consecutive_skips = p.consecutive_skips + 1 if skipped else 0
        finally:
            self.buffer.clear()
        out = {k: v / max(updates, 1) for k, v in sums.items()}
        if self.on_policy:
            mismatch = out.pop("actor/logprob_mismatch", None)
            out["logprob_mismatch/mean"] = _NOT_COMPARABLE if mismatch is None else mismatch  # type: ignore[assignment]
        out["buffer/spilled_samples"] = float(spilled)
        out["update/optimizer_steps"] = float(updates)
        out["update/nonfinite_skips"] = float(skipped_updates)
        out["update/consecutive_nonfinite_skips"] = float(p.consecutive_skips)
        return out

    def _train_engine(
        self, role: str, engine: TrainingEngine, mb: TensorBatch, loss: LossFn, index: int
    ) -> dict[str, float]:
        self._stage = f"{role}_update"
        return train_mini_batch(engine, self.schedulers[role], mb, loss, key=f"step{self.step}/{role}/update{index}")
