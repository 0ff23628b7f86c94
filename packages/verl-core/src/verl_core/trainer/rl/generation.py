"""The first half of an RL step: rollout, reward, and the reference / actor / critic forwards.

:class:`GenerationStage` runs them through :class:`~verl_core.trainer.pipeline.HybridPipeline`
from a declared graph of inputs and outputs, so the stages whose inputs are ready run concurrently
(the reference, actor and critic forwards; ReMax's greedy baseline beside the reward), each on its
long-lived thread; the rollout starts the step alone on the trainer's thread (with ``[agent]``, as
multi-turn episodes: :class:`~verl_core.trainer.rl.episodes.EpisodeRollout`). DAPO's dynamic sampling
(``select``) drops groups whose scores are all equal before the forwards. The outputs land in the
step's :class:`~verl_core.trainer.rl.step_state.StepState`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.training import TrainingEngine
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import TaskReward
from verl_core.trainer.pipeline import HybridPipeline, Stage, StageThreads
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.episodes import EpisodeRollout
from verl_core.trainer.rl.step_state import RunProgress, StepState

__all__ = ["GenerationStage", "groups_with_signal"]


def groups_with_signal(group_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Bool mask of samples whose group's scores are not all equal (DAPO dynamic sampling)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    n = uniq.numel()
    lo = torch.full((n,), math.inf).scatter_reduce(0, inverse, scores.float(), "amin")
    hi = torch.full((n,), -math.inf).scatter_reduce(0, inverse, scores.float(), "amax")
    return (hi > lo)[inverse]


class GenerationStage:
    """Samples, scores and the forwards of one step.

    Args:
        engines: The run's engines (read at call time).
        schedulers: The micro-batch scheduler of each training role.
        progress: The trainer's counters (the step names the scheduler's decisions).
        threads: The stage threads every step's pipeline runs on.
        baseline: Also generate a greedy response per prompt and score it (ReMax).
        dynamic_sampling: Drop groups whose scores are all equal (DAPO).
        dense_only: The reward's dense scores sum to its sequence score: the algorithm gets them alone.
        actor_forward: Run the actor's no-grad forward for ``old_log_probs`` and entropy (False when
            the update takes them from its own forward: the stage then gives None).
        episodes: Multi-turn runs (``[agent]``): the rollout (and ReMax's baseline) runs these
            episodes instead of one ``generate`` call; None = single-turn.
    """

    def __init__(
        self, engines: RLEngines, schedulers: Mapping[str, DynamicBatchScheduler], progress: RunProgress,
        threads: StageThreads, *, baseline: bool, dynamic_sampling: bool, dense_only: bool,
        actor_forward: bool = True, episodes: EpisodeRollout | None = None,
    ) -> None:
        self.engines = engines
        self.schedulers = schedulers
        self.progress = progress
        self.threads = threads
        self.baseline = baseline
        self.dynamic_sampling = dynamic_sampling
        self.dense_only = dense_only
        self.actor_forward = actor_forward
        self.episodes = episodes

    def run(self, state: StepState) -> None:
        """Run the stages on ``state.prompts``; sets every field up to the forwards and ``state.timings``."""
        res = self.pipeline(state).run(prompts=state.prompts)
        state.timings.update(res.timings)
        state.fill(res.outputs)

    def _forward(self, role: str, engine: TrainingEngine, batch: TensorBatch, outputs: tuple[str, ...]) -> TensorBatch:
        def fn(mb: TensorBatch) -> TensorBatch:
            return engine.forward(mb, outputs)  # type: ignore[arg-type]

        return self.schedulers[role].run_forward(batch, fn, key=f"step{self.progress.step}/{role}/forward",
                                                 packed=engine.capabilities.packed_sequences)

    def pipeline(self, state: StepState) -> HybridPipeline:
        """The step's stage graph (prompts -> samples -> scores -> batch -> forwards)."""
        params = state.params
        e = self.engines
        episodes = self.episodes

        def rollout(prompts: TensorBatch) -> Mapping[str, Any]:
            e.rollout.wake()
            if episodes is not None:  # multi-turn: the episode loop calls generate once per turn
                return {"samples": episodes.run(prompts, params)}
            return {"samples": e.rollout.generate(prompts, params)}

        def baseline(prompts: TensorBatch) -> Mapping[str, Any]:
            greedy = dataclasses.replace(params, n=1, greedy=True)
            if episodes is not None:
                scored = e.reward.score(episodes.run(prompts, greedy))
            else:
                scored = e.reward.score(e.rollout.generate(prompts, greedy))
            return {"baseline": scored["scores"].repeat_interleave(params.n)}

        def reward(samples: TensorBatch) -> Mapping[str, Any]:
            scored = e.reward.score(samples)
            return {"scores": scored["scores"], "token_scores": scored.get("token_scores"),
                    "reward_terms": RewardFunctions.metrics(scored)}

        dense_only = self.dense_only and isinstance(e.reward, TaskReward)

        def select(samples: TensorBatch, scores: torch.Tensor, token_scores: torch.Tensor | None) -> Mapping[str, Any]:
            # the task's dense scores sum to its sequence score: the algorithm gets them alone, so the
            # score is not counted twice (once spread over the tokens, once on the last token)
            batch = samples if dense_only else samples.update(scores=scores)
            if token_scores is not None:
                batch = batch.update(token_scores=token_scores)
            if not self.dynamic_sampling:
                return {"batch": batch, "dropped_groups": 0}
            keep = groups_with_signal(samples["group_ids"], scores)
            dropped = int(torch.unique(batch["group_ids"]).numel()) - int(torch.unique(batch["group_ids"][keep]).numel())
            return {"batch": batch.index(keep.nonzero()[:, 0]), "dropped_groups": dropped}

        def reference(batch: TensorBatch) -> Mapping[str, Any]:
            if e.reference is None or batch.batch_size == 0:
                return {"ref_log_probs": None}
            return {"ref_log_probs": self._forward("reference", e.reference, batch, ("log_probs",))["log_probs"]}

        def actor(batch: TensorBatch) -> Mapping[str, Any]:
            if batch.batch_size == 0 or not self.actor_forward:
                return {"old_log_probs": None, "entropy": None}
            out = self._forward("actor", e.actor, batch, ("log_probs", "entropy"))
            return {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}

        def critic(batch: TensorBatch) -> Mapping[str, Any]:
            if e.critic is None or batch.batch_size == 0:
                return {"values": None}
            return {"values": self._forward("critic", e.critic, batch, ("values",))["values"]}

        stages = [
            Stage("rollout", rollout, ("prompts",), ("samples",)),
            Stage("reward", reward, ("samples",), ("scores", "token_scores", "reward_terms")),
            Stage("select", select, ("samples", "scores", "token_scores"), ("batch", "dropped_groups")),
            Stage("reference", reference, ("batch",), ("ref_log_probs",)),
            Stage("actor_forward", actor, ("batch",), ("old_log_probs", "entropy")),
            Stage("critic_forward", critic, ("batch",), ("values",)),
        ]
        if self.baseline:
            stages.append(Stage("baseline", baseline, ("prompts",), ("baseline",), after=("rollout",)))
        return HybridPipeline(stages, inputs=("prompts",), threads=self.threads)
