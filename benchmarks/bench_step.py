"""One GRPO step on a ~20M-parameter model: time per stage and the SDK's own overhead.

    python benchmarks/bench_step.py [--backend hf] [--rollout hf] [--steps 2] [--device cpu]
        [--size small|gpu] [--dtype float32|bfloat16] [--options ROLE=JSON ...]

Builds a random ~20M-parameter Llama-shaped model (test kit), runs a warm-up step and then
``--steps`` measured GRPO steps of 8 prompts x 8 samples with up to 64 new tokens, and prints a
table: wall seconds per stage, and the SDK overhead = (step time - time inside engine calls) /
step time (target < 3%). Engine calls are timed by a thin proxy around each engine, so the
overhead is everything the trainer, HybridPipeline, TensorBatch ops and the scheduler add.
``--size gpu`` uses the 0.89B Llama shape of the GPU benchmarks (hidden 2048, 16 layers, 16 heads,
8 KV heads, FFN 5632; the task's 96-symbol vocabulary) with 16 prompts x 8 samples and up to 128
new tokens; ``--options rollout='{"rollout_cache": "static"}'`` gives a role's engine backend
options (``backends.options`` of the run config).

When ``trl`` is installed, TRL's GRPOTrainer runs on the same model, batch and lengths in the
same process and its completion tokens/s is printed beside ours (the ratio is the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_TIMED = {"generate", "forward", "forward_backward", "optimizer_step", "score", "update_weights",
          "export_weights", "save_checkpoint", "sleep", "wake"}


class _Timed:
    """Forwards every attribute to an engine; accumulates wall time of its main calls."""

    def __init__(self, engine: Any, role: str, totals: dict[str, float]) -> None:
        self._engine = engine
        self._role = role
        self._totals = totals

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in _TIMED or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._totals[f"{self._role}.{name}"] += time.perf_counter() - t

        return call


def _config(args: argparse.Namespace, out: Path) -> Any:
    from verl_core.trainer.config import load_config

    return load_config(None, [
        f"output_dir={json.dumps(str(out))}", "seed=0", f"steps={args.steps + 1}", *SIZES[args.size],
        "model.vocab_size=96", f"model.device={json.dumps(args.device)}", f"model.dtype={json.dumps(args.dtype)}",
        "task.name=copy", "task.digits=3", f"backends.actor={args.backend}", f"backends.rollout={args.rollout}",
        "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0", "rollout.n=8",
        "logging.progress=false", "logging.plot=false", "logging.sinks=[]", "checkpoint.final=false",
        *(f"backends.options.{role}.{k}={json.dumps(v)}" for role, opts in args.options for k, v in opts.items()),
    ])


SIZES = {
    "small": ["model.hidden_size=512", "model.num_layers=6", "model.num_heads=8", "model.num_kv_heads=4",
              "model.head_dim=64", "model.intermediate_size=1376", "model.tied=true",
              "rollout.max_new_tokens=64", "batch.prompts_per_step=8"],
    "gpu": ["model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=8",
            "model.head_dim=128", "model.intermediate_size=5632", "model.tied=false",
            "rollout.max_new_tokens=128", "batch.prompts_per_step=16"],
}


def _role_options(text: str) -> tuple[str, dict[str, Any]]:
    role, sep, raw = text.partition("=")
    options = json.loads(raw) if sep else None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"--options takes ROLE=JSON-object, got {text!r}")
    return role, options


def bench_sdk(args: argparse.Namespace) -> dict[str, Any]:
    from verl_core.trainer.rl.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix="verl-bench-step-"))
    cfg = _config(args, out)
    totals: dict[str, float] = defaultdict(float)
    with Trainer(cfg) as trainer:
        trainer.setup()
        model_path = trainer.model_path()
        params = sum(p.numel() for p in _model_params(model_path))
        trainer.actor = _Timed(trainer.actor, "actor", totals)
        trainer.rollout = _Timed(trainer.rollout, "rollout", totals)
        trainer.reward = _Timed(trainer.reward, "reward", totals)
        trainer.train_step()  # warm-up
        totals.clear()
        steps = [trainer.train_step() for _ in range(args.steps)]
    step_time = sum(m["time/step"] for m in steps)
    engine_time = sum(totals.values())
    stages: dict[str, float] = defaultdict(float)
    for m in steps:
        for k, v in m.items():
            if k.startswith("time/"):
                stages[k.removeprefix("time/")] += v
    tokens = sum(m["throughput/response_tokens"] for m in steps)
    return {
        "params": params, "steps": len(steps), "step_time": step_time, "engine_time": engine_time,
        "engine_calls": dict(totals), "stages": dict(stages), "tokens": tokens,
        "rollout_time": stages.get("rollout", 0.0), "model_path": model_path,
    }


def _model_params(path: str) -> list[Any]:
    import torch
    from safetensors.torch import load_file

    return [t for t in load_file(str(Path(path) / "model.safetensors")).values() if isinstance(t, torch.Tensor)]


def bench_trl(args: argparse.Namespace, model_path: str) -> dict[str, Any] | None:
    """TRL's GRPOTrainer on the same model, batch and lengths (None when trl is not installed)."""
    try:
        import trl  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return None
    from datasets import Dataset  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verl_core.trainer.inputs.tasks import get_task

    task = get_task("copy", 3)
    examples = task.examples(8 * (args.steps + 1), seed=0, step=0)
    data = Dataset.from_dict({"prompt": [p for p, _ in examples], "answer": [a for _, a in examples]})

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    out = tempfile.mkdtemp(prefix="verl-bench-trl-")
    cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=64, num_generations=8,
                     max_completion_length=64, max_steps=args.steps + 1, logging_steps=1,
                     report_to=[], save_strategy="no", use_cpu=args.device == "cpu", beta=0.0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), reward_funcs=reward,
                          args=cfg, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_path))
    times: list[float] = []
    tokens: list[float] = []

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t)

        def on_log(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            logs = k.get("logs")
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * 64)

    trainer.add_callback(StepTimer())
    trainer.train()
    t = sum(times[1:])
    n = sum(tokens[1:]) if len(tokens) > 1 else 0.0
    return {"step_time": t, "tokens": n, "steps": len(times) - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="hf", help="training backend (default hf)")
    parser.add_argument("--rollout", default="hf", help="rollout backend (default hf; vllm when installed)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--options", nargs="*", type=_role_options, default=[], metavar="ROLE=JSON",
                        help="backend options of a role's engine, e.g. rollout='{\"rollout_cache\": \"static\"}'")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    res = bench_sdk(args)
    cfg = _config(args, Path("unused"))
    print(f"GRPO step, {res['params'] / 1e6:.1f}M-parameter model, {cfg.batch.prompts_per_step} prompts x "
          f"{cfg.rollout.n} samples, <= {cfg.rollout.max_new_tokens} new tokens, {args.dtype} on {args.device}, "
          f"backends actor={args.backend} rollout={args.rollout} {dict(args.options) or ''}, "
          f"{res['steps']} measured step(s)")
    print(f"{'stage':<22}{'seconds/step':>14}{'share':>9}")
    per = res["steps"]
    for name, sec in sorted(res["stages"].items(), key=lambda kv: -kv[1]):
        if name in ("step", "pipeline"):
            continue
        print(f"{name:<22}{sec / per:>14.3f}{sec / res['step_time']:>9.1%}")
    print(f"{'step (wall)':<22}{res['step_time'] / per:>14.3f}{1:>9.1%}")
    print(f"{'inside engine calls':<22}{res['engine_time'] / per:>14.3f}{res['engine_time'] / res['step_time']:>9.1%}")
    overhead = (res["step_time"] - res["engine_time"]) / res["step_time"]
    print(f"SDK overhead (step - engine calls) / step: {overhead:.2%} (target < 3%)")
    ours = res["tokens"] / res["step_time"]
    print(f"completion tokens/s (whole step): {ours:,.0f}; rollout only: {res['tokens'] / res['rollout_time']:,.0f}")
    for call, sec in sorted(res["engine_calls"].items(), key=lambda kv: -kv[1]):
        print(f"  {call:<28}{sec / per:>10.3f} s/step")
    if not args.no_trl:
        trl_res = bench_trl(args, res["model_path"])
        if trl_res is None:
            print("TRL comparison skipped: trl is not installed in this environment (pip install trl)")
        elif trl_res["step_time"] > 0:
            theirs = trl_res["tokens"] / trl_res["step_time"]
            print(f"TRL GRPOTrainer completion tokens/s: {theirs:,.0f}; ours / TRL = {ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
