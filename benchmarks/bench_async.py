"""Asynchronous against synchronous training, in one run: steps per second and their ratio.

    python benchmarks/bench_async.py [--steps 6] [--repeats 3] [--staleness 1 2] [--partial finish continue] [--tool-s 0.05]
        [--workloads tokens64 tokens256 slow-tool ragged] [--executor local|ray]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--size tiny|0.9b] [--model-dir DIR]
        [--turn-tokens N] [--max-turns N] [--out DIR]

Each workload runs ``verl train`` (hf backends, GRPO) with ``async_training.mode`` ``sync`` and
then ``async`` at each ``--staleness`` and each ``--partial`` (``async_training.partial_rollouts``:
``finish``, the setting ``async k=N``, produces one step at a time; ``continue``, the setting
``async k=N cont``, samples every released step at once, and in the multi-turn workloads their
episodes share the rollout's generate calls), ``--repeats`` times in turn, and prints the median seconds
per step (over every step of a run: see :func:`_seconds_per_step`) and the ratio of sync's to each async
setting (> 1: async is faster). Every setting of a workload trains on the same prompts, model,
batch, lengths and learning rate; only the schedule differs.

Workloads:

* ``tokensN``: the built-in task, 8 prompts x 8 samples, ``N`` new tokens (a random tiny model
  seldom ends early, so lengths are near ``N``);
* ``slow-tool``: multi-turn episodes with an environment (:func:`slow_tool`, in this file) that
  answers every turn like a tool taking ``--tool-s`` seconds, and ends each episode after 1 to 4
  turns (chosen from the row, so lengths are ragged and the same in every setting);
* ``ragged``: the same environment (:func:`ragged`) ending each episode after 1 to
  ``--max-turns`` turns, with generate calls of ``--turn-tokens`` tokens and
  ``agent.max_total_tokens`` = their product. A turn ends only at EOS or a stop token (``rollout.max_new_tokens`` is the size
  of one generate call, not a turn's length), and a random model samples neither on cue: at the
  0.9b size the multi-turn workloads list up to vocabulary // ``--turn-tokens`` of the tokenizer's
  81 visible characters in ``agent.stop_tokens``, so a turn ends at the first of them sampled,
  after about 32000 / 81 = 395 tokens of a random model's near-uniform draws (a spread from 1 up,
  not a cap). ``--turn-tokens 340 --max-turns 6`` then gives episodes of 1 to 2040 tokens.
  Without stop tokens every episode's first turn ran its whole ``agent.max_total_tokens``.
  The tool waits ``--tool-s`` after each turn (0 for ragged lengths alone). Before its rows the
  table prints the response lengths measured in the runs (``response/length_min``, ``_mean`` and
  ``_max`` of the steps), so the spread is the one trained on.

Sizes (``--size``):

* ``tiny`` (default): the built-in tiny model for ``tokensN``; the tool demo's tiny chat model
  (``examples/agent/model.py``) for the multi-turn workloads, 8 prompts x 8 samples per step;
  ``ragged`` runs 1 to 8 turns of 8 tokens;
* ``0.9b``: a random Llama-shaped model of 0.89B parameters with a chat-template tokenizer, built
  once by ``examples/math/make_model.py`` into ``--model-dir`` (reused when that folder already
  holds a model), for every workload; 16 prompts x 8 samples per step, learning rate 1e-6;
  ``slow-tool`` turns of ``--turn-tokens`` tokens. For a GPU: ``--device cuda`` (bfloat16 by
  default). On CUDA the multi-turn workloads set ``backends.options.rollout.rollout_compile=false``
  unless ``--multi-turn-compile``: the compiled decode step was compiled anew for each (rows, prompt
  width) it met (about 30 s each on an H200: ``benchmarks/results/gpu-h200-math-2026-12-04.md``),
  and an episode's turns meet a new one nearly every turn. It now compiles for the first shape and
  once more per size that changes (``CompiledOrEager``); whether it then pays over a multi-turn
  run is what ``--multi-turn-compile`` measures (not yet on a GPU). The static KV cache and CUDA
  graphs stay on either way.

Executors (``--executor``):

* ``local`` (default): every engine in the trainer's process; the producer is a thread of it. With
  ``--device cuda`` the engines share the one GPU (colocated);
* ``ray``: split placement (``executor = "ray"``, ``ray.placement = "split"``): the actor, the
  reference and the rollout engine each in a Ray worker process of its own, on a local cluster
  the run starts (its start is not part of any step's time), so the rollout and the update run
  in different processes. Each worker reserves half a CPU, so the three fit on a 2-CPU machine;
  the reservation is bookkeeping, not a limit.

On a CPU with the local executor the producer thread and the update share the process's cores,
so the single-turn ratio shows what overlap is left after the two compete; while tools wait, the
cores are free for the update. With ``ray`` the engines are processes of their own, which the
operating system spreads over the cores.

Each run's seconds per step go to stderr as it ends; a run that fails prints its error there,
its setting's row says ``failed``, the other settings still run, and the script exits with
status 1 at the end. ``--out DIR`` keeps every run's folder (``metrics.jsonl``, the run's log in
``bench-train.log``).

On one H200, colocated, 0.9b, sync against async at staleness 1 on ``ragged`` and ``slow-tool``
(estimated at about 4 minutes with the model's build, from the GPU figures in docs/benchmarks.md)::

    python benchmarks/bench_async.py --device cuda --size 0.9b --workloads ragged slow-tool \\
        --staleness 1 --steps 3 --repeats 1 --tool-s 0.1 --turn-tokens 340 --max-turns 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


def _episode(row: Mapping[str, Any], most_turns: int) -> _SlowTool:
    """An episode of 1 to ``most_turns`` turns, chosen from the row's answer (the same in every run)."""
    turns = 1 + zlib.crc32(json.dumps(row.get("answer", ""), sort_keys=True).encode()) % most_turns
    return _SlowTool(turns, float(os.environ.get("VERL_BENCH_TOOL_S", "0.05")))


def slow_tool(row: Mapping[str, Any]) -> _SlowTool:
    """The ``slow-tool`` workload's environment: 1 to 4 turns per episode, from the row's text."""
    return _episode(row, 4)


def ragged(row: Mapping[str, Any]) -> _SlowTool:
    """The ``ragged`` workload's environment: 1 to ``$VERL_BENCH_MAX_TURNS`` turns per episode, from the row's text."""
    return _episode(row, int(os.environ.get("VERL_BENCH_MAX_TURNS", "16")))


@dataclass(frozen=True)
class _Size:
    """What one ``--size`` runs.

    Attributes:
        prompts: Prompts per step (each with 8 samples).
        slow_tool: ``slow-tool``'s tokens per turn and per episode (None: ``--turn-tokens`` and 4 turns of it).
        turn_tokens: ``ragged``'s default tokens per turn.
        max_turns: ``ragged``'s default most turns.
        extra: More overrides of every run.
        vocab: The model's vocabulary when its turns need stop tokens to end (0: the model ends them).
    """

    prompts: int
    slow_tool: tuple[int, int] | None
    turn_tokens: int
    max_turns: int
    extra: tuple[str, ...] = ()
    vocab: int = 0


SIZES = {
    "tiny": _Size(prompts=8, slow_tool=(16, 96), turn_tokens=8, max_turns=8),
    "0.9b": _Size(prompts=16, slow_tool=None, turn_tokens=128, max_turns=16, extra=("optim.lr=1e-6",),
                  vocab=32000),
}
MULTI_TURN = ("slow-tool", "ragged")
_STOP_CHARS = string.digits + string.ascii_letters + "+-*/=.,:;?!()[]'\"#_"
"""Characters of the character tokenizer (``examples/math/make_model.py``'s) that end a turn at the 0.9b size."""


def _agent_model(tmp: Path) -> Path:
    """The tool demo's tiny chat model, built once into ``tmp``."""
    model = tmp / "agent-model"
    if not model.exists():
        subprocess.run([sys.executable, str(ROOT / "examples/agent/model.py"), str(model), "--seed", "0"],
                       check=True, capture_output=True)
    return model


def _sized_model(size: str, folder: Path) -> str:
    """``folder`` holding the ``size`` model of ``examples/math/make_model.py`` (built when it holds none), described."""
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        return (f"{folder} (reused: width {config.get('hidden_size')}, {config.get('num_hidden_layers')} layers; "
                "remove it or pass another --model-dir to build afresh)")
    t = time.perf_counter()
    part = folder.with_name(folder.name + ".part")  # renamed once whole: an interrupted build is never reused
    shutil.rmtree(part, ignore_errors=True)
    done = subprocess.run([sys.executable, str(ROOT / "examples/math/make_model.py"), "--size", size, "--out",
                           str(part)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"examples/math/make_model.py --size {size} --out {part} failed:\n{done.stderr[-2000:]}")
    os.replace(part, folder)
    return f"{done.stdout.strip().replace(str(part), str(folder))} in {time.perf_counter() - t:.0f} s"


def _workload(name: str, tmp: Path, *, size: str, model: Path | None, turn_tokens: int, max_turns: int,
              device: str, multi_turn_compile: bool = False) -> list[str]:
    """The ``verl train`` overrides of workload ``name`` (``model``: the sized model folder, None for tiny)."""
    sized = SIZES[size]
    base = ["seed=0", "logging.progress=false", "logging.plot=false", "checkpoint.final=false",
            "algorithm.name=grpo", "rollout.n=8", f"batch.prompts_per_step={sized.prompts}", *sized.extra]
    if model is not None:
        base.append(f"model.path={json.dumps(str(model))}")
    if name.startswith("tokens") and name.removeprefix("tokens").isdigit():
        return [*base, f"rollout.max_new_tokens={int(name.removeprefix('tokens'))}"]
    if name not in MULTI_TURN:
        raise SystemExit(f"unknown workload {name!r}; choices: tokensN (e.g. tokens64), {', '.join(MULTI_TURN)}")
    if model is None:
        base.append(f"model.path={json.dumps(str(_agent_model(tmp)))}")
    if device != "cpu" and not multi_turn_compile:  # the module doc says why
        base.append("backends.options.rollout.rollout_compile=false")
    if name == "slow-tool":
        per_turn, per_episode = sized.slow_tool or (turn_tokens, 4 * turn_tokens)
        most, env = 4, "slow_tool"
    else:
        per_turn, per_episode, most, env = turn_tokens, turn_tokens * max_turns, max_turns, "ragged"
    if sized.vocab:  # a turn ends at the first of these characters sampled
        stops = list(_STOP_CHARS[: max(1, sized.vocab // per_turn)])
        base.append(f"agent.stop_tokens={json.dumps(stops)}")
    return [*base, 'data.train="examples/agent/train.jsonl"', 'data.prompt_key="messages"',
            f'agent.environment="{Path(__file__).resolve()}:{env}"', f"agent.max_turns={most}",
            f"agent.max_total_tokens={per_episode}", f"rollout.max_new_tokens={per_turn}"]


# split placement: actor, reference and rollout in Ray worker processes of their own
RAY_SPLIT = ("executor=ray", "ray.placement=split", "ray.num_cpus_per_worker=0.5")
# the workers inherit the cluster's environment: no usage reporting, no runtime-env probing
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_DEDUP_LOGS": "0"}


class RunError(Exception):
    """A ``verl train`` run that exited with an error (the message: its command and the end of its stderr)."""


def _train(overrides: list[str], out: Path, steps: int, env: Mapping[str, str]) -> list[dict[str, Any]]:
    """Run ``verl train`` with ``overrides`` for ``steps`` steps; every step's metrics.

    Raises:
        RunError: the run exited with an error.
    """
    env = {**os.environ, **env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **RAY_ENV}
    cmd = [sys.executable, "-m", "verl_core.cli", "train", *overrides, f"steps={steps}",
           f"output_dir={json.dumps(str(out))}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.is_dir():
        (out / "bench-train.log").write_text(f"{' '.join(cmd)}\n{done.stdout}{done.stderr}")
    if done.returncode:
        raise RunError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _seconds_per_step(metrics: Sequence[Mapping[str, Any]]) -> float:
    """Mean seconds per step over every step of the run, the first included.

    Both schedules do the same work over a run (one rollout and one update per step), but not in
    the same steps: an asynchronous run's first step also generates (under ``partial_rollouts =
    "finish"``, waits for) the samples of the steps released ahead, and its last ``max_staleness``
    steps have nothing left to produce (no rollout). Leaving the first step out would count those free steps
    and not the rollouts they skipped, which flatters async; the whole run's mean does not (the
    first step's caches and compilation are in both schedules' means).
    """
    return statistics.fmean(float(m["time/step"]) for m in metrics)


def _stages(metrics: Sequence[Mapping[str, Any]]) -> str:
    """Mean seconds of the step's main stages (the first step left out), in words."""
    keys = ("time/rollout", "time/update", "time/reference", "time/weight_sync", "time/rollout_sleep", "async/wait_s")
    rest = metrics[1:] or metrics
    return ", ".join(f"{k.removeprefix('time/')} {statistics.fmean(float(m.get(k, 0.0)) for m in rest):.2f}"
                     for k in keys if any(k in m for m in rest))


def _length_spread(metrics: Sequence[Mapping[str, Any]]) -> str:
    """The shortest, mean and longest response in tokens over ``metrics``' steps (their
    ``response/length_min``, ``response/length_mean`` and ``response/length_max``), in words."""
    low = min(float(m["response/length_min"]) for m in metrics)
    mean = statistics.fmean(float(m["response/length_mean"]) for m in metrics)
    return f"min {low:.0f}, mean {mean:.1f}, max {max(float(m['response/length_max']) for m in metrics):.0f}"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the comparison and print its table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--partial", nargs="+", choices=["finish", "continue"], default=["finish", "continue"],
                   help="async_training.partial_rollouts of the async settings")
    p.add_argument("--tool-s", type=float, default=0.05,
                   help="seconds each tool call of slow-tool and ragged waits (0: no wait)")
    p.add_argument("--workloads", nargs="+", default=["tokens64", "tokens256", "slow-tool"],
                   help=f"tokensN (e.g. tokens64), {', '.join(MULTI_TURN)}")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where the engines run: this process, or split Ray worker processes")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="model.device of every run")
    p.add_argument("--multi-turn-compile", action="store_true",
                   help="keep the rollout's compiled decode step on for the multi-turn workloads on CUDA (module doc)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="model.dtype of every run (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the model (see the module doc)")
    p.add_argument("--model-dir", type=Path,
                   help="folder of the 0.9b model: built there once, reused when it holds a model (default: a temp folder)")
    p.add_argument("--turn-tokens", type=int,
                   help="rollout.max_new_tokens of ragged (and of slow-tool above tiny) (default: 8 tiny, 128 0.9b)")
    p.add_argument("--max-turns", type=int, help="ragged: most turns of an episode (default: 8 tiny, 16 0.9b)")
    p.add_argument("--out", type=Path,
                   help="keep each run's folder (its metrics.jsonl) under this new folder (default: a temp folder, removed)")
    args = p.parse_args(argv)
    sized = SIZES[args.size]
    turn_tokens = sized.turn_tokens if args.turn_tokens is None else args.turn_tokens
    max_turns = sized.max_turns if args.max_turns is None else args.max_turns
    if turn_tokens < 1 or max_turns < 1:
        raise SystemExit(f"--turn-tokens and --max-turns must be >= 1, got {turn_tokens} and {max_turns}")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} holds files already; give a new or empty folder")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    placement = list(RAY_SPLIT) if args.executor == "ray" else ["executor=local"]
    placement += [f"model.device={args.device}", f"model.dtype={dtype}"]
    settings = [("sync", ["async_training.mode=sync"])] + [
        (f"async k={k}{' cont' if partial == 'continue' else ''}",
         ["async_training.mode=async", f"async_training.max_staleness={k}", f"async_training.partial_rollouts={partial}"])
        for partial in args.partial for k in args.staleness
    ]
    env = {"VERL_BENCH_TOOL_S": str(args.tool_s), "VERL_BENCH_MAX_TURNS": str(max_turns)}
    load = os.getloadavg()[0]
    where = "ray, split placement (actor, reference and rollout in worker processes of their own)" if args.executor == "ray" \
        else "local (every engine in the trainer's process)"
    print(f"# executor {where}", flush=True)
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        run_dirs = args.out.resolve() if args.out is not None else tmp
        model: Path | None = None
        if args.size != "tiny":
            model = (args.model_dir or tmp / f"model-{args.size}").resolve()
            print(f"# model {args.size}: {_sized_model(args.size, model)}", flush=True)
        if (args.device, dtype, args.size) != ("cpu", "float32", "tiny"):
            print(f"# device {args.device}, {dtype}", flush=True)
        print(f"# {args.repeats} repeats x {args.steps} steps; load average at start {load:.2f} on {os.cpu_count()} CPUs")
        print(f"{'workload':<11} {'setting':<14} {'s/step (median)':>16} {'runs':>24} {'sync/this':>10}", flush=True)
        for workload in args.workloads:
            base = [*_workload(workload, tmp, size=args.size, model=model, turn_tokens=turn_tokens,
                               max_turns=max_turns, device=args.device,
                               multi_turn_compile=args.multi_turn_compile), *placement]
            times: dict[str, list[float]] = {name: [] for name, _ in settings}
            steps_seen: list[dict[str, Any]] = []
            for r in range(args.repeats):  # settings in turn, so a change of load touches each alike
                for name, extra in settings:
                    out = run_dirs / f"{workload}-{args.executor}-{name.replace(' ', '').replace('=', '')}-{r}"
                    started = time.perf_counter()
                    try:
                        metrics = _train([*base, *extra], out, args.steps, env)
                    except RunError as e:  # the other settings still run; the exit status says so at the end
                        failed.append(f"{workload} {name} run {r}")
                        print(f"# {workload} {name} run {r}: {e}", file=sys.stderr, flush=True)
                        continue
                    times[name].append(_seconds_per_step(metrics))
                    steps_seen += metrics
                    print(f"# {workload} {name} run {r}: {times[name][-1]:.3f} s/step, "
                          f"{time.perf_counter() - started:.0f} s in all; {_stages(metrics)}", file=sys.stderr, flush=True)
            if workload == "ragged" and steps_seen:
                print(f"# ragged: response tokens per sample {_length_spread(steps_seen)} "
                      f"({len(steps_seen)} steps of every setting; {max_turns} turns of {turn_tokens} tokens "
                      f"at most, tool {args.tool_s:g} s a turn)")
            sync = statistics.median(times["sync"]) if times["sync"] else None
            for name, _ in settings:
                if not times[name]:
                    print(f"{workload:<11} {name:<14} {'failed':>16}", flush=True)
                    continue
                med = statistics.median(times[name])
                runs = " ".join(f"{t:.3f}" for t in times[name])
                ratio = f"{sync / med:>10.2f}" if sync is not None else f"{'-':>10}"
                print(f"{workload:<11} {name:<14} {med:>16.3f} {runs:>24} {ratio}", flush=True)
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed ({', '.join(failed)}); their errors are above")


if __name__ == "__main__":
    main()
