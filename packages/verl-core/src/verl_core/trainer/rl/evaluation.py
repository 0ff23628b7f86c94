"""Held-out evaluation of an RL run: ``data.eval`` and the built-in task's fixed prompts.

:class:`Evaluator` generates with the rollout engine and scores with the run's reward, on every
row of ``data.eval`` (``data.eval_n`` responses per prompt, greedy by default) and/or on the task's
``task.eval_prompts`` (greedy), when due (every ``eval_every`` steps and after the last).
"""

from __future__ import annotations

import time

from verl_core.agent.loop import episode_metrics
from verl_core.kernel.batch import BatchMeta
from verl_core.trainer.config import RunConfig
from verl_core.trainer.inputs.data import PromptDataset
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import TaskReward, prompt_batch
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.episodes import EpisodeRollout
from verl_core.trainer.rl.prompt_source import PromptSource
from verl_core.trainer.rl.step_state import RunProgress, StepState

__all__ = ["EVAL_GROUP_BASE", "Evaluator"]

EVAL_GROUP_BASE = 1 << 48
"""Group ids of evaluation prompts start here, far above any training group's."""


class Evaluator:
    """Evaluations of an RL run.

    Args:
        config: The run.
        engines: The run's engines (read at call time).
        source: The run's prompts (the eval dataset, the task, whether the task supplies training prompts).
        progress: The trainer's counters (step, weight version, the running stage).
        episodes: Multi-turn runs (``[agent]``): ``data.eval`` is answered in episodes, and the
            means of :func:`~verl_core.agent.loop.episode_metrics` are added (``eval/agent/...``).
    """

    def __init__(self, config: RunConfig, engines: RLEngines, source: PromptSource, progress: RunProgress, *,
                 episodes: EpisodeRollout | None = None) -> None:
        self.config = config
        self.engines = engines
        self.source = source
        self.progress = progress
        self.episodes = episodes

    def evaluate(self) -> dict[str, float]:
        """Evaluate on every row of ``data.eval`` and/or the task's fixed prompts; keys start with ``eval/``."""
        out: dict[str, float] = {}
        if self.source.evals is not None:
            out.update(self._dataset(self.source.evals))
        if self.config.task.eval_prompts and self.source.loader is None:
            out.update(self._task())
        return out

    def _due(self, step: int) -> tuple[PromptDataset | None, bool]:
        """The evaluation dataset due after ``step`` (None: none), and whether the task's prompts are."""
        tc, d = self.config.task, self.config.data

        def due(every: int) -> bool:  # the last step is always evaluated
            return step + 1 == self.config.steps or bool(every and (step + 1) % every == 0)

        on_data = self.source.evals if due(d.eval_every) else None
        on_task = bool(tc.eval_prompts) and self.source.loader is None and due(tc.eval_every)
        return on_data, on_task

    def due_after(self, step: int) -> bool:
        """Whether an evaluation runs after ``step`` (0-based)."""
        on_data, on_task = self._due(step)
        return on_data is not None or on_task

    def on_step(self, state: StepState) -> None:
        """Evaluate when due after ``state``'s step (the last step always is); adds the metrics and ``time/eval``."""
        on_data, on_task = self._due(state.step)
        if on_data is None and not on_task:
            return
        t = time.perf_counter()
        self.progress.stage = "evaluation"
        if on_data is not None:
            state.metrics.update(self._dataset(on_data))
        if on_task:
            state.metrics.update(self._task())
        state.metrics["time/eval"] = time.perf_counter() - t

    def _dataset(self, ds: PromptDataset) -> dict[str, float]:
        r, n = self.config.rollout, self.config.data.eval_n
        e = self.engines
        params = r.sampling_params(seed=0, n=n, greedy=n == 1)
        meta = BatchMeta(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, pad_token_id=ds.tokenizer.pad_token_id,
                         weight_version=self.progress.weight_version, step=self.progress.step)
        sums: dict[str, float] = {}
        count = 0
        e.rollout.wake()
        # ids far above any training group (rows drawn so far, or step * prompts_per_step + i)
        for prompts in ds.batches(self.config.batch.prompts_per_step, group_id_base=EVAL_GROUP_BASE, meta=meta):
            if self.episodes is not None:
                scored = e.reward.score(self.episodes.run(prompts, params))
            else:
                scored = e.reward.score(e.rollout.generate(prompts, params))
            size = scored.batch_size
            means = {
                "reward/mean": float(scored["scores"].mean()),
                **RewardFunctions.metrics(scored),
                "response/length_mean": float(scored["response_mask"].sum(1).float().mean()),
            }
            if self.episodes is not None:
                means.update(episode_metrics(scored))
            for k, v in means.items():
                sums[k] = sums.get(k, 0.0) + v * size
            count += size
        return {f"eval/{k}": v / count for k, v in sums.items()}

    def _task(self) -> dict[str, float]:
        n = self.config.task.eval_prompts
        e = self.engines
        examples = self.source.task.examples(n, seed=-1, step=0)  # the same set for every seed and step
        tok = e.rollout.tokenizer
        r = self.config.rollout
        prompts = prompt_batch(
            # ids far above any training group (step * prompts_per_step + i), so they never collide
            [p for p, _ in examples], tok, group_ids=[EVAL_GROUP_BASE + i for i in range(n)],
            extras={"answer": [a for _, a in examples]},
            meta=BatchMeta(temperature=r.temperature, pad_token_id=tok.pad_token_id, step=self.progress.step),
        )
        params = r.sampling_params(seed=0, n=1, greedy=True)
        e.rollout.wake()
        out = e.reward.score(e.rollout.generate(prompts, params))
        metrics = {"eval/reward_mean": float(out["scores"].mean())}
        if isinstance(e.reward, TaskReward):
            metrics["eval/exact_match"] = float(e.reward.exact_match(out).mean())
        return metrics
