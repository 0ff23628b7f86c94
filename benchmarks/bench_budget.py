"""The default micro-batch budget against hand-set ``batch.micro_batch_tokens`` values: update s/step.

    python benchmarks/bench_budget.py [--size tiny|gpu] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--tokens 64 256 1024 ...] [--steps 2] [--repeats 2] [--options ROLE=JSON ...]

One trainer runs GRPO steps on one model. Its first (warm-up) step runs under the default budget
(``batch.micro_batch_tokens = 0``: the model-aware estimate, refined from the allocator's peak after
the first update on CUDA). Then, in interleaved rounds, each value of the sweep (the default among
them) gets ``--steps`` measured steps after one unmeasured step, with the actor's micro-batch scheduler
fixed to that budget (a fresh scheduler each time, as a run with ``batch.micro_batch_tokens``
set would have). The table gives per value: the budget, micro-batches per update, the median
update and step seconds, the update time relative to the default's, the out-of-memory retries and,
on CUDA, the allocator's peak. ``--size tiny`` is the trainer's small default model on the CPU;
``--size gpu`` the 0.89B Llama shape of the GPU benchmarks (hidden 2048, 16 layers, FFN 5632,
vocabulary 32000) with 16 prompts x 8 samples and 128 new tokens, a 128-sample batch of about
140 tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_step import _role_options

SIZES = {
    "tiny": ["model.hidden_size=64", "model.num_layers=2", "model.vocab_size=96", "rollout.max_new_tokens=16",
             "batch.prompts_per_step=4", "rollout.n=4", "batch.min_tokens=16"],
    "gpu": ["model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=8",
            "model.head_dim=128", "model.intermediate_size=5632", "model.vocab_size=32000", "model.tied=false",
            "rollout.max_new_tokens=128", "batch.prompts_per_step=16", "rollout.n=8"],
}
DEFAULT_TOKENS = {"tiny": [16, 64, 256, 1024], "gpu": [4096, 8192, 16384, 32768, 65536]}


def _config(args: argparse.Namespace, out: Path) -> Any:
    from verl_core.trainer.config import load_config

    return load_config(None, [
        f"output_dir={json.dumps(str(out))}", "seed=0", "steps=1000000", *SIZES[args.size],
        f"model.device={json.dumps(args.device)}", f"model.dtype={json.dumps(args.dtype)}",
        "task.name=copy", "task.digits=9", "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0",
        "batch.micro_batch_tokens=0", "logging.progress=false", "logging.plot=false", "logging.sinks=[]",
        "checkpoint.final=false",
        *(f"backends.options.{role}.{k}={json.dumps(v)}" for role, opts in args.options for k, v in opts.items()),
    ])


def _peak_reset(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else float("nan")


def sweep(args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    """Run the sweep; returns the default budget and one row per value (0 = the default)."""
    from verl_core.trainer.batching.scheduler import DynamicBatchScheduler, SchedulerConfig
    from verl_core.trainer.rl.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix="verl-bench-budget-"))
    values = [0, *args.tokens]
    times: dict[int, list[dict[str, float]]] = {v: [] for v in values}
    with Trainer(_config(args, out)) as trainer:
        trainer.setup()
        default = trainer.schedulers["actor"]
        trainer.train_step()  # warm-up under the default budget (its update refines it on CUDA)
        default_budget = default.fixed_budget or 0
        for _ in range(args.repeats):
            for v in values:
                if v:
                    trainer.schedulers["actor"] = DynamicBatchScheduler(
                        SchedulerConfig(min_tokens=v, max_tokens=v), device=args.device)
                    trainer.schedulers["actor"].fix_budget()
                else:
                    trainer.schedulers["actor"] = default
                trainer.train_step()  # unmeasured: allocator growth and new shapes
                _peak_reset(args.device)
                for _ in range(args.steps):
                    m = trainer.train_step()
                    times[v].append({"update": m["time/update"], "step": m["time/step"],
                                     "micro": m.get("actor/num_micro_batches", float("nan")),
                                     "ooms": m["scheduler/actor/ooms"], "budget": m["scheduler/actor/budget"],
                                     "peak": _peak(args.device)})
    rows = []
    for v in values:
        ms = times[v]
        rows.append({"value": v, "budget": ms[-1]["budget"], "micro": statistics.median(m["micro"] for m in ms),
                     "update": statistics.median(m["update"] for m in ms),
                     "step": statistics.median(m["step"] for m in ms), "ooms": sum(m["ooms"] for m in ms),
                     "peak": max(m["peak"] for m in ms)})
    return default_budget, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--tokens", type=int, nargs="*", default=None,
                        help="hand-set batch.micro_batch_tokens values (default per size)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per value and round")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds over the values")
    parser.add_argument("--options", nargs="*", type=_role_options, default=[], metavar="ROLE=JSON",
                        help="backend options of a role's engine, e.g. rollout='{\"rollout_compile\": false}'")
    args = parser.parse_args(argv)
    args.tokens = args.tokens if args.tokens is not None else DEFAULT_TOKENS[args.size]
    if any(v < 1 for v in args.tokens):
        parser.error(f"--tokens takes budgets >= 1, got {args.tokens}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    default_budget, rows = sweep(args)
    base = rows[0]["update"]
    print(f"micro-batch budget sweep: --size {args.size}, {args.dtype} on {args.device}, "
          f"{args.repeats} x {args.steps} measured steps per value; the default budget is {default_budget} tokens")
    print(f"{'micro_batch_tokens':<20}{'budget':>9}{'micro-batches':>15}{'update s/step':>15}"
          f"{'x default':>11}{'step s/step':>13}{'OOMs':>6}{'peak GiB':>10}")
    for r in rows:
        name = "0 (default)" if r["value"] == 0 else str(r["value"])
        print(f"{name:<20}{int(r['budget']):>9}{r['micro']:>15.1f}{r['update']:>15.3f}"
              f"{r['update'] / base:>11.2f}{r['step']:>13.3f}{int(r['ooms']):>6}{r['peak']:>10.2f}")
    best = min(rows[1:], key=lambda r: r["update"], default=None)
    if best is not None:
        print(f"best hand-set value {best['value']}: update {best['update']:.3f} s/step; "
              f"default / best = {base / best['update']:.2f} (within 10%: {base <= 1.10 * best['update']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
