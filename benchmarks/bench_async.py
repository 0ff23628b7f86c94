"""Asynchronous against synchronous training, in one run: steps per second and their ratio.

    python benchmarks/bench_async.py [--steps 6] [--repeats 3] [--staleness 1 2] [--tool-s 0.05]
        [--workloads tokens64 tokens256 slow-tool] [--executor local|ray]

Each workload runs ``verl train`` (the tiny model, hf backends, GRPO) with ``async_training.mode``
``sync`` and then ``async`` at each ``--staleness``, ``--repeats`` times in turn, and prints the
median seconds per step (the first step, which builds caches, left out) and the ratio of sync's
to each async setting (> 1: async is faster). Every setting of a workload trains on the same
prompts, model, batch, lengths and learning rate; only the schedule differs.

Workloads:

* ``tokensN``: the built-in task, 8 prompts x 8 samples, ``N`` new tokens (a random tiny model
  seldom ends early, so lengths are near ``N``);
* ``slow-tool``: multi-turn episodes of the tool demo's tiny chat model with an environment
  (:func:`slow_tool`, in this file) that answers every turn like a tool taking ``--tool-s``
  seconds, and ends each episode after 1 to 4 turns (chosen from the row, so lengths are ragged
  and the same in every setting).

Executors (``--executor``):

* ``local`` (default): every engine in the trainer's process; the producer is a thread of it;
* ``ray``: split placement (``executor = "ray"``, ``ray.placement = "split"``): the actor, the
  reference and the rollout engine each in a Ray worker process of its own, on a local cluster
  the run starts (its start is not part of any step's time), so the rollout and the update run
  in different processes. Each worker reserves half a CPU, so the three fit on a 2-CPU machine;
  the reservation is bookkeeping, not a limit.

On a CPU with the local executor the producer thread and the update share the process's cores,
so the single-turn ratio shows what overlap is left after the two compete; while tools wait, the
cores are free for the update. With ``ray`` the engines are processes of their own, which the
operating system spreads over the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class _SlowTool:
    """An episode that calls a slow tool after each model turn until its last turn."""

    def __init__(self, turns: int, seconds: float) -> None:
        self.left = turns
        self.seconds = seconds

    def step(self, text: str, token_ids: Sequence[int]) -> Any:
        from verl_core.agent import StepResult

        self.left -= 1
        if self.left <= 0:
            return StepResult(done=True)
        time.sleep(self.seconds)  # the tool's latency: no CPU used
        return StepResult(observation=[{"role": "tool", "content": "42"}], metrics={"tool_calls": 1})


def slow_tool(row: Mapping[str, Any]) -> _SlowTool:
    """The ``slow-tool`` workload's environment: 1 to 4 turns per episode, from the row's text."""
    turns = 1 + zlib.crc32(json.dumps(row.get("answer", ""), sort_keys=True).encode()) % 4
    return _SlowTool(turns, float(os.environ.get("VERL_BENCH_TOOL_S", "0.05")))


def _workload(name: str, tmp: Path) -> list[str]:
    base = ["seed=0", "logging.progress=false", "logging.plot=false", "checkpoint.final=false",
            "algorithm.name=grpo", "rollout.n=8", "batch.prompts_per_step=8"]
    if name.startswith("tokens"):
        return [*base, f"rollout.max_new_tokens={int(name.removeprefix('tokens'))}"]
    if name == "slow-tool":
        model = tmp / "agent-model"
        if not model.exists():
            subprocess.run([sys.executable, str(ROOT / "examples/agent/model.py"), str(model), "--seed", "0"],
                           check=True, capture_output=True)
        return [*base, f"model.path={json.dumps(str(model))}", 'data.train="examples/agent/train.jsonl"',
                'data.prompt_key="messages"', f'agent.environment="{Path(__file__).resolve()}:slow_tool"',
                "agent.max_turns=4", "agent.max_total_tokens=96", "rollout.max_new_tokens=16"]
    raise SystemExit(f"unknown workload {name!r}; choices: tokensN (e.g. tokens64), slow-tool")


# split placement: actor, reference and rollout in Ray worker processes of their own
RAY_SPLIT = ("executor=ray", "ray.placement=split", "ray.num_cpus_per_worker=0.5")
# the workers inherit the cluster's environment: no usage reporting, no runtime-env probing
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_DEDUP_LOGS": "0"}


def _seconds_per_step(overrides: list[str], out: Path, steps: int, tool_s: float) -> float:
    env = {**os.environ, "VERL_BENCH_TOOL_S": str(tool_s), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **RAY_ENV}
    cmd = [sys.executable, "-m", "verl_core.cli", "train", *overrides, f"steps={steps}",
           f"output_dir={json.dumps(str(out))}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    steps_m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.fmean(m["time/step"] for m in steps_m[1:])


def main(argv: Sequence[str] | None = None) -> None:
    """Run the comparison and print its table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tool-s", type=float, default=0.05, help="seconds each tool call of slow-tool waits")
    p.add_argument("--workloads", nargs="+", default=["tokens64", "tokens256", "slow-tool"])
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where the engines run: this process, or split Ray worker processes")
    args = p.parse_args(argv)
    placement = list(RAY_SPLIT) if args.executor == "ray" else ["executor=local"]
    settings = [("sync", ["async_training.mode=sync"])] + [
        (f"async k={k}", ["async_training.mode=async", f"async_training.max_staleness={k}"]) for k in args.staleness
    ]
    load = os.getloadavg()[0]
    where = "ray, split placement (actor, reference and rollout in worker processes of their own)" if args.executor == "ray" \
        else "local (every engine in the trainer's process)"
    print(f"# executor {where}")
    print(f"# {args.repeats} repeats x {args.steps} steps; load average at start {load:.2f} on {os.cpu_count()} CPUs")
    print(f"{'workload':<11} {'setting':<10} {'s/step (median)':>16} {'runs':>24} {'sync/this':>10}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for workload in args.workloads:
            base = [*_workload(workload, tmp), *placement]
            times: dict[str, list[float]] = {name: [] for name, _ in settings}
            for r in range(args.repeats):  # settings in turn, so a change of load touches each alike
                for name, extra in settings:
                    out = tmp / f"{workload}-{args.executor}-{name.replace(' ', '')}-{r}"
                    times[name].append(_seconds_per_step([*base, *extra], out, args.steps, args.tool_s))
            sync = statistics.median(times["sync"])
            for name, _ in settings:
                med = statistics.median(times[name])
                runs = " ".join(f"{t:.3f}" for t in times[name])
                print(f"{workload:<11} {name:<10} {med:>16.3f} {runs:>24} {sync / med:>10.2f}")
    print(f"# load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
