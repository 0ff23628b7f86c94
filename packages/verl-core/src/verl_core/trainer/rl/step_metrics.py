"""What an RL step reports: its metrics, the scheduler's plan, and the run's curves.

:func:`rollout_metrics` (rewards and response lengths of the samples, the episodes' counts of a
multi-turn run and the rollout's seconds in their environments) and :func:`finish_metrics`
(timings, throughput, the scheduler's micro-batches of the step) fill the step's
:class:`~verl_core.trainer.rl.step_state.StepState`; the stages add their own.
:class:`SchedulerPlanLog` keeps ``scheduler_plan.jsonl``, every decision of the micro-batch
schedulers, so a resumed run replays the decisions after its checkpoint exactly;
:func:`plot_metrics` draws ``curves.png``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_core.agent.loop import environment_seconds, episode_metrics
from verl_core.kernel.reward import RewardEngine
from verl_core.trainer.batching.scheduler import Decision, DynamicBatchScheduler
from verl_core.trainer.inputs.agent import is_episode_batch
from verl_core.trainer.inputs.data import PromptLoader
from verl_core.trainer.inputs.tasks import TaskReward
from verl_core.trainer.rl.step_state import StepState
from verl_core.trainer.sinks import read_json_lines, write_text_atomic

__all__ = ["SchedulerPlanLog", "finish_metrics", "plot_metrics", "rollout_metrics"]


def rollout_metrics(state: StepState, *, eos_token_id: int, reward: RewardEngine, loader: PromptLoader | None) -> None:
    """Rewards, response lengths and the data epoch of the step's samples; for episodes (``[agent]``) also
    their ``agent/...`` means and ``time/environment``, the wall-clock seconds of the rollout spent
    building and stepping their environments (running the tool calls), which ``time/rollout`` includes."""
    samples = state.samples
    scores = samples["scores"]
    rmask = samples["response_mask"]
    lengths = rmask.sum(1).float()
    ended = (samples["response_ids"] == eos_token_id) & rmask
    m = state.metrics
    m.update({
        "step": state.step + 1,
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "reward/max": float(scores.max()),
        "response/length_mean": float(lengths.mean()),
        "response/length_min": float(lengths.min()),
        "response/length_max": float(lengths.max()),
        "response/eos_fraction": float(ended.any(1).float().mean()),
        "response/truncated_fraction": float(samples["truncated"].float().mean()) if "truncated" in samples else 0.0,
        "samples": samples.batch_size,
    })
    if isinstance(reward, TaskReward):
        m["reward/exact_match"] = float(reward.exact_match(samples).mean())
    if is_episode_batch(samples):  # multi-turn: turns, tool calls, terminations (agent/...)
        m.update(episode_metrics(samples))
        m["time/environment"] = environment_seconds(samples)
    if loader is not None:
        m.setdefault("data/epoch", loader.epoch)  # epochs completed by the rows drawn so far (for this step)


def finish_metrics(
    state: StepState, started: float, schedulers: Mapping[str, DynamicBatchScheduler], *, weight_version: int
) -> None:
    """Timings, throughput and the schedulers' decisions of the step, added to ``state.metrics``."""
    metrics, timings = state.metrics, state.timings
    wall = time.perf_counter() - started
    timings["time/step"] = wall
    metrics.update(timings)
    tokens = int(state.samples["response_mask"].sum())
    metrics["throughput/response_tokens"] = tokens
    metrics["throughput/tokens_per_s"] = tokens / wall if wall > 0 else 0.0
    rollout_t = timings.get("time/rollout", 0.0)
    metrics["throughput/rollout_tokens_per_s"] = tokens / rollout_t if rollout_t > 0 else 0.0
    prefix = f"step{state.step}/"
    for role, sched in schedulers.items():
        decisions = [d for d in sched.plan if d.key.startswith(prefix)]
        if decisions:
            metrics[f"scheduler/{role}/micro_batches"] = sum(len(d.groups) for d in decisions)
            metrics[f"scheduler/{role}/ooms"] = sum(d.ooms for d in decisions)
            metrics[f"scheduler/{role}/oom_seconds"] = sched.oom_seconds(prefix)  # lost to the OOM back-off
            metrics[f"scheduler/{role}/budget"] = decisions[-1].budget
    metrics["weight_version"] = weight_version


class SchedulerPlanLog:
    """``<output_dir>/scheduler_plan.jsonl``: every micro-batch decision, one JSON line each.

    Args:
        out: The output folder.
        schedulers: The schedulers by role.
    """

    def __init__(self, out: Path, schedulers: Mapping[str, DynamicBatchScheduler]) -> None:
        self.path = out / "scheduler_plan.jsonl"
        self.schedulers = schedulers
        self._written: dict[str, int] = {}

    def reset(self) -> None:
        """Start the log afresh (a fresh run)."""
        self.path.unlink(missing_ok=True)

    def append(self) -> None:
        """Append the decisions made since the last call."""
        with open(self.path, "a") as fh:
            for role, sched in self.schedulers.items():
                plan = sched.plan
                for d in plan[self._written.get(role, 0):]:
                    fh.write(json.dumps({"role": role, **d.to_json()}) + "\n")
                self._written[role] = len(plan)

    def restore(self, step: int) -> None:
        """Replay the recorded decisions of ``step`` and after; the log is cut back to before ``step``."""
        if not self.path.is_file():
            return
        by_role: dict[str, list[Decision]] = {}
        kept_plan = []
        for ln in read_json_lines(self.path):
            d = json.loads(ln)
            at = int(str(d["key"]).split("/")[0].removeprefix("step"))
            if at >= step:
                by_role.setdefault(d.pop("role"), []).append(Decision.from_json(d))
            else:
                kept_plan.append(ln)
        for role, decisions in by_role.items():
            self.schedulers[role].add_replay(decisions)
        write_text_atomic(self.path, "".join(ln + "\n" for ln in kept_plan))


_PLOTTED: tuple[tuple[tuple[str, ...], str], ...] = (
    (("reward/mean", "reward/exact_match"), "reward"),
    (("response/length_mean",), "response length"),
    (("actor/entropy",), "entropy"),
    (("actor/kl_ref",), "KL to reference"),
    (("actor/grad_norm",), "actor grad norm"),
    (("time/step",), "seconds per step"),
)


def plot_metrics(history: list[dict[str, Any]], path: Path) -> str:
    """Write a PNG of the main curves; returns a line saying where (or why not)."""
    if not history:
        return "no steps: no plot written"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'verl-core[plot]')"

    def has(key: str) -> bool:
        return any(isinstance(m.get(key), (int, float)) for m in history)

    panels = [(tuple(k for k in keys if has(k)), title) for keys, title in _PLOTTED]
    panels = [(keys, title) for keys, title in panels if keys]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
    for ax, (keys, title) in zip(axes[0], panels):
        for key in keys:
            pts = [(m["step"], m[key]) for m in history if isinstance(m.get(key), (int, float))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"curves written to {path}"
