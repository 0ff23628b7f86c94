"""GRPO steps of TRL's ``GRPOTrainer`` and of ``verl train``, side by side, on the same work.

Both sides train the same model folder (a random model built with
``verl_core.trainer.inputs.tiny_model``: ``--size tiny`` for CPU, ``--size 0.9b`` for a GPU: the
Llama shape of 0.89B parameters of ``benchmarks/results/gpu-h200-*.md``) on the same prompts, with
the same batch (prompts x completions), max new tokens, temperature, learning rate, dtype and
AdamW settings, no gradient checkpointing, no KL term (beta = 0) and one optimizer step per batch.
Each side runs in its own process, one after the other.

Prompts and reward: the prompts of the built-in ``copy`` task are written to a JSONL file
(``prompt``, ``answer``), which TRL reads as its dataset with
``verl_core.trainer.inputs.reward_functions:exact_match`` as its reward function. ``verl train`` reads the
same file through ``data.train`` / ``data.prompt_key`` and the same function through
``reward.functions`` when its trainer supports datasets; otherwise (``--verl-data task``, or
``auto`` on a trainer without them) it draws the same prompts from the built-in task with its
exact-match reward. The header says which.

Printed: seconds per step and completion tokens per second of each side (median over the steps
after the first, which warms up), the mean completion length of each (random models rarely stop
early, so both usually generate the maximum; a warning is printed when the lengths differ by more
than 5%: the work is then not equal), the ratio, and the per-phase breakdown of verl's step (its
``time/*`` metrics).

TRL is not a dependency of this project: install it into an environment that also has this
project, e.g. a venv that sees the project's packages::

    python3 -m venv /tmp/trlbench
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/trlbench/lib/python3.11/site-packages/zz.pth
    /tmp/trlbench/bin/python -m pip install --no-deps trl==1.16.0 accelerate==1.16.0
    OMP_NUM_THREADS=2 /tmp/trlbench/bin/python benchmarks/bench_grpo_vs_trl.py --steps 4

(``--trl-python`` and ``--verl-python`` run a side with another interpreter than this one, e.g.
the project's own ``.venv/bin/python`` for ``verl train``, whose plugins then load as usual.)
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REWARD = "verl_core.trainer.inputs.reward_functions:exact_match"
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 32,
             "intermediate_size": 128, "vocab_size": 96},
    "0.9b": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 5632, "vocab_size": 32000},
}


def build_inputs(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """The model folder and the JSONL prompts (the copy task's prompts of every step)."""
    from verl_core.trainer.inputs.tasks import get_task
    from verl_core.trainer.inputs.tiny_model import TinyModelSpec, build_tiny_model

    task = get_task("copy", args.digits)
    model = out / f"model-{args.size}"
    if not (model / "config.json").is_file():
        spec = TinyModelSpec(arch="llama", tied=False, max_position=task.max_prompt_len() + args.max_new_tokens + 8,
                             seed=args.seed, **SIZES[args.size])
        build_tiny_model(model, spec)
    data = out / "prompts.jsonl"
    rows = [ex for step in range(args.steps) for ex in task.examples(args.prompts, seed=args.seed, step=step)]
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return model, data


def verl_has_datasets() -> bool:
    """Whether this checkout's trainer reads ``data.train`` (the prompt loader is wired in)."""
    try:
        from verl_core.trainer.inputs.data import PromptLoader  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- verl side
def run_verl(args: argparse.Namespace, model: Path, data: Path, out: Path, use_data: bool,
             extra: Sequence[str] = (), tag: str = "default") -> list[dict[str, Any]]:
    run_dir = out / f"verl-run-{tag}"
    overrides = [
        f"output_dir={json.dumps(str(run_dir))}", "overwrite=true", f"steps={args.steps}", f"seed={args.seed}",
        f"model.path={json.dumps(str(model))}", f"model.dtype={args.dtype}", f"model.device={args.device}",
        "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0", "algorithm.use_reference=false",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.temperature={args.temperature}", "rollout.top_p=1.0", "rollout.top_k=0",
        f"batch.prompts_per_step={args.prompts}", "batch.mini_batch_size=0", "batch.epochs=1",
        f"optim.lr={args.lr}", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
        "checkpoint.every=0", "checkpoint.final=false", "logging.progress=false", "logging.plot=false",
        "task.name=copy", f"task.digits={args.digits}", "task.reward=exact",
    ]
    if use_data:
        overrides += [f"data.train={json.dumps(str(data))}", "data.prompt_key=prompt",
                      f"reward.functions={json.dumps([REWARD])}"]
    overrides += list(extra)
    cmd = [args.verl_python or sys.executable, "-m", "verl_core.cli", "train", *overrides]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"verl train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    print(f"verl train ({tag}): {time.perf_counter() - t:.1f} s in all (process start, model load, steps)", flush=True)
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


# ----------------------------------------------------------------------------- TRL side
def trl_worker(args: argparse.Namespace) -> None:
    """Run TRL's GRPOTrainer and print one JSON line per step: seconds and mean completion length."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_core.trainer.inputs.reward_functions import exact_match

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    dataset = load_dataset("json", data_files=args.data, split="train")

    class StepTimes(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self._t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.steps.append({"seconds": time.perf_counter() - self._t})

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, Any] | None = None, **k: Any) -> None:
            if logs and "completions/mean_length" in logs and self.steps:
                self.steps[-1]["mean_length"] = float(logs["completions/mean_length"])

    cfg = GRPOConfig(
        output_dir=args.trl_out, per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, beta=0.0,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99,
        max_grad_norm=1.0, gradient_checkpointing=False, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", seed=args.seed, use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16", fp16=args.dtype == "float16", dataloader_num_workers=0,
        disable_tqdm=True,
    )
    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=cfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[times])
    trainer.train()
    print("TRL_STEPS " + json.dumps(times.steps), flush=True)


def run_trl(args: argparse.Namespace, model: Path, data: Path, out: Path) -> list[dict[str, float]]:
    python = args.trl_python or sys.executable
    cmd = [python, os.path.abspath(__file__), "--trl-worker", "--model", str(model), "--data", str(data),
           "--trl-out", str(out / "trl-run"), *_shared_flags(args)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("TRL_STEPS ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"the TRL side failed ({proc.returncode}); is trl installed for {python}?\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    print(f"TRL GRPOTrainer: {time.perf_counter() - t:.1f} s in all (process start, model load, steps)", flush=True)
    steps: list[dict[str, float]] = json.loads(line[len("TRL_STEPS "):])
    return steps


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
            "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
            "--lr", str(args.lr), "--dtype", args.dtype, "--device", args.device, "--seed", str(args.seed),
            "--digits", str(args.digits), "--size", args.size]


# ----------------------------------------------------------------------------- report
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model shape (0.9b: for a GPU)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per side (the first is a warm-up)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=3, help="digits of the copy task's prompts")
    p.add_argument("--verl-data", choices=["auto", "jsonl", "task"], default="auto",
                   help="verl reads the JSONL file (jsonl), the built-in task (task), or the file when it can")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="also run `verl train` with these config overrides (repeatable); each variant is "
                        "reported against the same TRL run")
    p.add_argument("--skip-trl", action="store_true", help="run only the verl side(s): no ratio is printed")
    p.add_argument("--trl-python", help="python that runs the TRL side (default: this one)")
    p.add_argument("--verl-python", help="python that runs `verl train` (default: this one)")
    p.add_argument("--out", help="folder for the model, prompts and runs (default: a temporary one)")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--trl-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        model, data = build_inputs(args, out)
        use_data = {"jsonl": True, "task": False, "auto": verl_has_datasets()}[args.verl_data]
        if args.verl_data == "jsonl" and not verl_has_datasets():
            raise SystemExit("--verl-data jsonl: this checkout's trainer does not read data.train yet")
        trl_steps = [] if args.skip_trl else run_trl(args, model, data, out)
        runs = {"default": run_verl(args, model, data, out, use_data)}
        for variant in args.variant:
            name, _, sets = variant.partition(":")
            runs[name] = run_verl(args, model, data, out, use_data, [x for x in sets.split(",") if x], name)
    labels = {"default": "the default config"} | {v.partition(":")[0]: v for v in args.variant}
    for name, hist in runs.items():
        report(args, trl_steps, hist, use_data, labels[name])


def report(args: argparse.Namespace, trl_steps: list[dict[str, float]], verl_hist: list[dict[str, Any]],
           use_data: bool, label: str = "verl train") -> None:
    """Print one verl run against the TRL run (when there is one) and its per-phase breakdown."""
    import torch

    batch = args.prompts * args.n
    timed_verl = verl_hist[1:] or verl_hist  # the first step warms up
    verl_s = statistics.median(float(m["time/step"]) for m in timed_verl)
    verl_len = statistics.mean(float(m["response/length_mean"]) for m in timed_verl)
    verl_tps = verl_len * batch / verl_s
    print(f"\nmodel {args.size}, {args.dtype} on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads; {args.prompts} prompts x {args.n} completions, "
          f"max {args.max_new_tokens} new tokens, T={args.temperature}, lr {args.lr}, beta 0, "
          f"one optimizer step per batch; median of steps 2..{args.steps}")
    print("verl prompts: " + ("the JSONL file through data.train, reward through reward.functions" if use_data
                              else "the built-in copy task and its exact-match reward (this trainer does not "
                                   "read data.train); TRL: the same task's prompts from the JSONL file"))
    head = f"{'side':<18} {'s/step':>8} {'compl. tok/s':>13} {'mean compl. len':>16}"
    print(head)
    print("-" * len(head))
    if trl_steps:
        timed_trl = trl_steps[1:] or trl_steps
        trl_s = statistics.median(s["seconds"] for s in timed_trl)
        trl_len = statistics.mean(s.get("mean_length", float("nan")) for s in timed_trl)
        trl_tps = trl_len * batch / trl_s
        print(f"{'TRL GRPOTrainer':<18} {trl_s:>8.3f} {trl_tps:>13.1f} {trl_len:>16.2f}")
    print(f"{'verl train':<18} {verl_s:>8.3f} {verl_tps:>13.1f} {verl_len:>16.2f}   <- {label}")
    if trl_steps:
        print(f"verl speed-up (TRL s/step / verl s/step): {trl_s / verl_s:.2f}x; "
              f"in completion tokens/s: {verl_tps / trl_tps:.2f}x")
        if abs(trl_len - verl_len) > 0.05 * max(trl_len, verl_len):
            print(f"WARNING: mean completion lengths differ by more than 5% ({trl_len:.2f} vs {verl_len:.2f}): "
                  "the two sides did not do the same work; compare tokens/s, not s/step")
    phases = sorted({k for m in timed_verl for k in m if k.startswith("time/") and k != "time/step"})
    print("\nverl step, per phase (median s over the same steps):")
    for k in phases:
        vals = [float(m[k]) for m in timed_verl if isinstance(m.get(k), (int, float))]
        if vals:
            print(f"  {k:<28} {statistics.median(vals):8.4f}")
    print(f"  {'time/step':<28} {verl_s:8.4f}")
    slept = [m.get("rollout/slept") for m in verl_hist]
    if any(x is not None for x in slept):
        print(f"  rollout slept per step: {slept}")


if __name__ == "__main__":
    main()
