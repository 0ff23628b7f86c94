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
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.training import TrainingEngine
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import TaskReward
from verl_core.trainer.pipeline import HybridPipeline, Stage, StageThreads
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.episodes import EpisodeRollout
from verl_core.trainer.rl.stages import GENERATION, is_forward
from verl_core.trainer.rl.step_state import RunProgress, StepState

__all__ = ["GenerationStage", "Part", "groups_with_signal"]

#: Which stages of the generation half a call runs: the samples (rollout to select), the forwards, or all.
Part = Literal["all", "samples", "forwards"]


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

    def run(self, state: StepState, part: Part = "all") -> None:
        """Run the stages of ``part`` on the step; sets ``state.timings`` of each.

        Args:
            state: The step. ``samples`` and ``all`` start from ``state.prompts``; ``forwards``
                from ``state.batch`` (set by an earlier ``samples`` run).
            part: ``samples`` (rollout, baseline, reward, select: sets ``samples`` and ``batch``,
                and the reward's and dynamic sampling's metrics), ``forwards`` (reference, actor
                and critic forwards: their fields are added to ``batch``), or ``all`` (both, as one
                pipeline).
        """
        names = self._names(part)
        start = {"batch": state.batch} if part == "forwards" else {"prompts": state.prompts}
        res = self.pipeline(state, names, inputs=tuple(start)).run(**start)
        state.timings.update(res.timings)
        out = res.outputs
        if part != "forwards":
            state.samples = out["samples"]
            state.batch = out["batch"]
            state.metrics.update(out["reward_terms"])  # reward/<function>/mean of each reward function
            if self.dynamic_sampling:
                state.metrics["dynamic_sampling/dropped_groups"] = out["dropped_groups"]
                state.metrics["dynamic_sampling/kept_samples"] = state.batch.batch_size
        fields: dict[str, torch.Tensor | None] = {f: out[f] for s in GENERATION if s.name in names for f in s.fields}
        if "baseline_scores" in out:  # scored on every sample: cut by the rows select kept
            keep = out["keep"]
            fields["baseline_scores"] = out["baseline_scores"] if keep is None else out["baseline_scores"][keep]
        state.add_fields(fields)

    def _forward(self, role: str, engine: TrainingEngine, batch: TensorBatch, outputs: tuple[str, ...]) -> TensorBatch:
        def fn(mb: TensorBatch) -> TensorBatch:
            return engine.forward(mb, outputs)  # type: ignore[arg-type]

        return self.schedulers[role].run_forward(batch, fn, key=f"step{self.progress.step}/{role}/forward",
                                                 packed=engine.capabilities.packed_sequences)

    def _names(self, part: Part) -> tuple[str, ...]:
        """The stages of ``part`` this run has (ReMax's baseline only when the algorithm needs it)."""
        return tuple(
            s.name for s in GENERATION
            if (s.name != "baseline" or self.baseline) and (part == "all" or (part == "forwards") == is_forward(s))
        )

    def pipeline(
        self, state: StepState, names: tuple[str, ...] | None = None, inputs: tuple[str, ...] = ("prompts",)
    ) -> HybridPipeline:
        """The stage graph of ``names`` (default: every stage of the run), from
        :data:`~verl_core.trainer.rl.stages.GENERATION`, fed ``inputs``."""
        names = self._names("all") if names is None else names
        params = state.params
        e = self.engines
        episodes = self.episodes

        def rollout(prompts: TensorBatch) -> Mapping[str, Any]:
            e.rollout.wake()
            if episodes is not None:  # multi-turn: the episode loop calls generate once per turn
                return {"responses": episodes.run(prompts, params)}
            return {"responses": e.rollout.generate(prompts, params)}

        def baseline(prompts: TensorBatch) -> Mapping[str, Any]:
            greedy = dataclasses.replace(params, n=1, greedy=True)
            if episodes is not None:
                scored = e.reward.score(episodes.run(prompts, greedy))
            else:
                scored = e.reward.score(e.rollout.generate(prompts, greedy))
            return {"baseline_scores": scored["scores"].repeat_interleave(params.n)}

        def reward(responses: TensorBatch) -> Mapping[str, Any]:
            scored = e.reward.score(responses)
            token_scores = scored.get("token_scores")
            samples = responses.update(scores=scored["scores"])
            if token_scores is not None:
                samples = samples.update(token_scores=token_scores)
            return {"samples": samples, "reward_terms": RewardFunctions.metrics(scored)}

        dense_only = self.dense_only and isinstance(e.reward, TaskReward)

        def select(samples: TensorBatch) -> Mapping[str, Any]:
            # the task's dense scores sum to its sequence score: the algorithm gets them alone, so the
            # score is not counted twice (once spread over the tokens, once on the last token)
            batch = samples.drop("scores") if dense_only else samples
            if not self.dynamic_sampling:
                return {"batch": batch, "keep": None, "dropped_groups": 0}
            group_ids = samples["group_ids"]
            keep = groups_with_signal(group_ids, samples["scores"]).nonzero()[:, 0]
            dropped = int(torch.unique(group_ids).numel()) - int(torch.unique(group_ids[keep]).numel())
            return {"batch": batch.index(keep), "keep": keep, "dropped_groups": dropped}

        def reference(batch: TensorBatch) -> Mapping[str, Any]:
            if e.reference is None or batch.batch_size == 0:
                return {"ref_log_probs": None}
            return {"ref_log_probs": self._forward("reference", e.reference, batch, ("log_probs",))["log_probs"]}

        def actor_forward(batch: TensorBatch) -> Mapping[str, Any]:
            if batch.batch_size == 0 or not self.actor_forward:
                return {"old_log_probs": None, "entropy": None}
            out = self._forward("actor", e.actor, batch, ("log_probs", "entropy"))
            return {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}

        def critic_forward(batch: TensorBatch) -> Mapping[str, Any]:
            if e.critic is None or batch.batch_size == 0:
                return {"values": None, "old_values": None}
            values = self._forward("critic", e.critic, batch, ("values",))["values"]
            return {"values": values, "old_values": values}

        fns: dict[str, Callable[..., Mapping[str, Any]]] = {
            "rollout": rollout, "baseline": baseline, "reward": reward, "select": select,
            "reference": reference, "actor_forward": actor_forward, "critic_forward": critic_forward,
        }
        stages = [Stage(s.name, fns[s.name], s.reads, s.adds, after=s.after) for s in GENERATION if s.name in names]
        return HybridPipeline(stages, inputs=inputs, threads=self.threads)
