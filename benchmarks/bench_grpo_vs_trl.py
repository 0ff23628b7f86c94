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
than 5%: the work is then not equal), the peak device memory of each side's process (on CUDA:
the GPU's used memory from ``nvidia-smi`` above the idle reading, polled; on the CPU: the process's
peak resident set), the
ratio, and the per-phase breakdown of verl's step (its ``time/*`` metrics). The header shows
``verl train``'s memory plan for the run (:mod:`verl_core.trainer.run.memory_plan`, computed in a
short process of its own before the runs).

Shapes: ``--shape`` picks a preset of the GPU issue's measurements (model, prompts x completions x
new tokens, bfloat16, TRL's gradient accumulation): ``0.9b-16x8x128``, ``0.9b-32x8x512``,
``0.9b-16x8x2048``, ``6.7b-8x8x128``, ``14b-8x8x128``; flags given explicitly override the preset.
The 6.7B and 14B (13.5B parameters) folders are written in bfloat16, initialised on the GPU when
there is one (a float32 14B folder would need 54 GB of disk). TRL takes the whole batch in one
forward/backward unless ``--trl-accumulation N`` splits it into N passes (the preset's value where
one pass does not fit; one optimizer step per batch either way, generation of the whole batch at
once); a TRL run that fails with CUDA out-of-memory is run again with twice the accumulation (up to
``--trl-oom-retries`` times). Each side's result is saved in ``--out`` (``result-trl.json``,
``result-verl-<variant>.json``): ``--sides trl`` and ``--sides verl`` run one side in a call (for
large shapes, each within a time limit) and the report includes the other side's saved result.

LoRA: ``--lora RANK`` trains a rank-RANK adapter (alpha = 2 x RANK, no dropout) on every attention
and MLP projection on both sides: TRL through ``peft_config`` (PEFT's ``LoraConfig``; TRL generates
through the unmerged adapter), ``verl train`` through ``model.lora.*`` (its default sync: merged
weights into the rollout). The presets ``6.7b-lora-8x8x128`` and ``14b-lora-8x8x128`` set rank 16.

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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
    # Llama-7B's shape (6.74B parameters)
    "6.7b": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32, "head_dim": 128,
             "intermediate_size": 11008, "vocab_size": 32000},
    # a 14B-class shape with grouped KV heads (13.54B parameters)
    "14b": {"hidden_size": 5120, "num_layers": 48, "num_heads": 40, "num_kv_heads": 8, "head_dim": 128,
            "intermediate_size": 13824, "vocab_size": 32000},
}
BF16_FOLDERS = ("6.7b", "14b")
"""Sizes written in bfloat16 (with Llama's 0.02 init; the smaller ones keep the test kit's float32 folders)."""

PRESETS: dict[str, dict[str, Any]] = {
    # size, prompts, n, max new tokens, steps (first warms up), TRL gradient accumulation
    "0.9b-16x8x128": {"size": "0.9b", "prompts": 16, "n": 8, "max_new_tokens": 128, "steps": 6, "trl_accumulation": 1},
    "0.9b-32x8x512": {"size": "0.9b", "prompts": 32, "n": 8, "max_new_tokens": 512, "steps": 4, "trl_accumulation": 4},
    "0.9b-16x8x2048": {"size": "0.9b", "prompts": 16, "n": 8, "max_new_tokens": 2048, "steps": 3,
                       "trl_accumulation": 8},
    "6.7b-8x8x128": {"size": "6.7b", "prompts": 8, "n": 8, "max_new_tokens": 128, "steps": 4, "trl_accumulation": 2},
    "14b-8x8x128": {"size": "14b", "prompts": 8, "n": 8, "max_new_tokens": 128, "steps": 3, "trl_accumulation": 4},
    "6.7b-lora-8x8x128": {"size": "6.7b", "prompts": 8, "n": 8, "max_new_tokens": 128, "steps": 4,
                          "trl_accumulation": 1, "lora": 16},
    "14b-lora-8x8x128": {"size": "14b", "prompts": 8, "n": 8, "max_new_tokens": 128, "steps": 3,
                         "trl_accumulation": 1, "lora": 16},
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The modules ``--lora`` adapts on both sides: every attention and MLP projection."""
DEFAULTS: dict[str, Any] = {"size": "tiny", "prompts": 8, "n": 8, "max_new_tokens": 32, "steps": 4,
                            "trl_accumulation": 1, "dtype": "float32", "lr": 1e-5, "lora": 0}
"""Values of the flags a preset sets, when neither the preset nor the command line does."""


def build_inputs(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """The model folder and the JSONL prompts (the copy task's prompts of every step)."""
    from verl_core.trainer.inputs.tasks import get_task
    from verl_core.trainer.inputs.tiny_model import TinyModelSpec, build_tiny_model

    task = get_task("copy", args.digits)
    model = out / f"model-{args.size}"
    if not (model / "config.json").is_file():
        spec = TinyModelSpec(arch="llama", tied=False, max_position=task.max_prompt_len() + args.max_new_tokens + 8,
                             seed=args.seed, **SIZES[args.size])  # type: ignore[arg-type]
        if args.size in BF16_FOLDERS:
            build_bf16_model(model, spec)
        else:
            build_tiny_model(model, spec)
    data = out / "prompts.jsonl"
    rows = [ex for step in range(args.steps) for ex in task.examples(args.prompts, seed=args.seed, step=step)]
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return model, data


def build_bf16_model(path: Path, spec: Any) -> None:
    """A random Llama folder of ``spec`` in bfloat16 (init std 0.02), initialised on the GPU when there is one."""
    import torch
    import transformers

    from verl_core.trainer.inputs.tiny_model import char_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position, tie_word_embeddings=spec.tied,
        initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, attention_bias=False, mlp_bias=False)
    t = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(spec.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    char_tokenizer(spec.vocab_size).save_pretrained(tmp)
    os.replace(tmp, path)
    n = sum(p.numel() for p in model.parameters())
    del model
    print(f"wrote {path}: {n / 1e9:.2f}B parameters in bfloat16, {time.perf_counter() - t:.0f} s", flush=True)


def verl_has_datasets() -> bool:
    """Whether this checkout's trainer reads ``data.train`` (the prompt loader is wired in)."""
    try:
        from verl_core.trainer.inputs.data import PromptLoader  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- measuring a side
class PeakMemory:
    """The peak device memory of a child process: on CUDA the GPU's used memory (``nvidia-smi``,
    polled every 0.25 s) above what was in use before the child started (one side runs at a time;
    device-wide, so process ids of another namespace do not matter); elsewhere the child's peak
    resident set (``wait4``'s rusage)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda") and shutil.which("nvidia-smi") is not None
        self.index = device.partition(":")[2] or "0"
        self.peak = 0
        self._stop = threading.Event()

    def _used(self) -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", self.index], capture_output=True, text=True).stdout.strip()
        return int(out) * 2**20 if out.isdigit() else 0  # MiB

    def run(self, cmd: list[str], log: Path) -> tuple[int, str]:
        """Run ``cmd`` (stdout and stderr into ``log``); its exit status and output."""
        before = self._used() if self.cuda else 0
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
            poller = None
            if self.cuda:
                def poll() -> None:
                    while not self._stop.wait(0.25):
                        self.peak = max(self.peak, self._used() - before)

                poller = threading.Thread(target=poll, daemon=True)
                poller.start()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            self._stop.set()
            if poller is not None:
                poller.join()
            else:
                self.peak = int(usage.ru_maxrss) * 1024  # KiB on Linux
        return proc.returncode, log.read_text()

    @property
    def how(self) -> str:
        return "nvidia-smi, the GPU's use above the idle reading" if self.cuda else "peak resident set"


def _out_of_memory(text: str) -> bool:
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


# ----------------------------------------------------------------------------- verl side
def verl_overrides(args: argparse.Namespace, model: Path, data: Path, run_dir: Path, use_data: bool) -> list[str]:
    """The ``verl train`` overrides of the run (the memory plan reads the same config)."""
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
    if args.lora:
        overrides += ["model.lora.enabled=true", f"model.lora.rank={args.lora}", f"model.lora.alpha={2.0 * args.lora}",
                      "model.lora.dropout=0.0", f"model.lora.targets={json.dumps(LORA_TARGETS)}"]
    if use_data:
        overrides += [f"data.train={json.dumps(str(data))}", "data.prompt_key=prompt",
                      f"reward.functions={json.dumps([REWARD])}"]
    return overrides


def run_verl(args: argparse.Namespace, model: Path, data: Path, out: Path, use_data: bool,
             extra: Sequence[str] = (), tag: str = "default") -> dict[str, Any]:
    run_dir = out / f"verl-run-{tag}"
    overrides = verl_overrides(args, model, data, run_dir, use_data) + list(extra)
    cmd = [args.verl_python or sys.executable, "-m", "verl_core.cli", "train", *overrides]
    t = time.perf_counter()
    meter = PeakMemory(args.device)
    rc, text = meter.run(cmd, out / f"verl-{tag}.log")
    if rc != 0:
        raise SystemExit(f"verl train failed ({rc}):\n{text[-8000:]}")
    print(f"verl train ({tag}): {time.perf_counter() - t:.1f} s in all (process start, model load, steps); "
          f"peak memory {meter.peak / 1e9:.1f} GB ({meter.how})", flush=True)
    hist = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {"steps": hist, "peak_bytes": meter.peak, "peak_how": meter.how}


def plan_text(args: argparse.Namespace, model: Path, data: Path, run_dir: Path) -> str:
    """``verl train``'s memory plan of the run, as its table."""
    from verl_core.trainer.config import load_config
    from verl_core.trainer.inputs.tasks import get_task
    from verl_core.trainer.run.memory_plan import plan_memory

    cfg = load_config(None, verl_overrides(args, model, data, run_dir, True))
    plan = plan_memory(cfg, str(model), max_prompt_len=get_task("copy", args.digits).max_prompt_len(),
                       use_reference=False, use_critic=False)
    if plan is None:
        return "memory plan: none (the model folder has no config.json)"
    return plan.table() + ("" if plan.fits else "\n  REFUSED: the run does not fit")


def plan_worker(args: argparse.Namespace) -> None:
    """Print the memory plan in a process of its own (its CUDA context goes with it)."""
    print("PLAN " + json.dumps(plan_text(args, Path(args.model), Path(args.data), Path(args.trl_out))), flush=True)


def memory_plan(args: argparse.Namespace, model: Path, data: Path, out: Path) -> str:
    if not args.device.startswith("cuda"):
        return plan_text(args, model, data, out / "verl-run-plan")
    cmd = [args.verl_python or sys.executable, os.path.abspath(__file__), "--plan-worker", "--model", str(model),
           "--data", str(data), "--trl-out", str(out / "verl-run-plan"), *_shared_flags(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PLAN ")), None)
    if line is None:
        return f"memory plan: not available ({proc.stderr.strip().splitlines()[-1:] or proc.returncode})"
    text: str = json.loads(line[5:])
    return text


# ----------------------------------------------------------------------------- TRL side
def trl_worker(args: argparse.Namespace) -> None:
    """Run TRL's GRPOTrainer and print one JSON line per step: seconds and mean completion length."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[import-not-found,unused-ignore]

    from verl_core.trainer.inputs.reward_functions import exact_match

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    dataset = load_dataset("json", data_files=args.data, split="train")

    class StepTimes(TrainerCallback):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self._t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.steps.append({"seconds": time.perf_counter() - self._t})

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if logs and "completions/mean_length" in logs and self.steps:
                self.steps[-1]["mean_length"] = float(logs["completions/mean_length"])

    batch = args.prompts * args.n
    accumulation = args.trl_accumulation
    # one optimizer step per batch in `accumulation` forward/backward passes; the whole batch is
    # generated at once (steps_per_generation defaults to the accumulation)
    cfg = GRPOConfig(
        output_dir=args.trl_out, per_device_train_batch_size=batch // accumulation, num_generations=args.n,
        gradient_accumulation_steps=accumulation, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, beta=0.0,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99,
        max_grad_norm=1.0, gradient_checkpointing=False, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", seed=args.seed, use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16", fp16=args.dtype == "float16", dataloader_num_workers=0,
        disable_tqdm=True,
    )
    times = StepTimes()
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=cfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[times], peft_config=peft_config)
    trainer.train()
    print("TRL_STEPS " + json.dumps(times.steps), flush=True)


def run_trl(args: argparse.Namespace, model: Path, data: Path, out: Path) -> dict[str, Any]:
    python = args.trl_python or sys.executable
    batch = args.prompts * args.n
    accumulation = args.trl_accumulation
    for attempt in range(args.trl_oom_retries + 1):
        cmd = [python, os.path.abspath(__file__), "--trl-worker", "--model", str(model), "--data", str(data),
               "--trl-out", str(out / "trl-run"), *_shared_flags(args, trl_accumulation=accumulation)]
        t = time.perf_counter()
        meter = PeakMemory(args.device)
        rc, text = meter.run(cmd, out / f"trl-{accumulation}.log")
        line = next((ln for ln in text.splitlines() if ln.startswith("TRL_STEPS ")), None)
        if rc == 0 and line is not None:
            print(f"TRL GRPOTrainer: {time.perf_counter() - t:.1f} s in all (process start, model load, steps), "
                  f"{accumulation} pass(es) per step; peak memory {meter.peak / 1e9:.1f} GB ({meter.how})", flush=True)
            steps: list[dict[str, float]] = json.loads(line[len("TRL_STEPS "):])
            return {"steps": steps, "peak_bytes": meter.peak, "peak_how": meter.how, "accumulation": accumulation}
        more = accumulation * 2
        if _out_of_memory(text) and attempt < args.trl_oom_retries and batch % more == 0:
            print(f"TRL GRPOTrainer ran out of memory with {accumulation} pass(es) per step; again with {more}",
                  flush=True)
            accumulation = more
            continue
        raise SystemExit(f"the TRL side failed ({rc}); is trl installed for {python}?\n{text[-8000:]}")
    raise AssertionError("unreachable")


def _shared_flags(args: argparse.Namespace, **override: Any) -> list[str]:
    values = {"steps": args.steps, "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "lr": args.lr, "dtype": args.dtype, "device": args.device,
              "seed": args.seed, "digits": args.digits, "size": args.size, "trl_accumulation": args.trl_accumulation,
              "lora": args.lora, **override}
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]


# ----------------------------------------------------------------------------- report
def resolve_preset(args: argparse.Namespace) -> None:
    """Fill the flags a preset sets (explicit flags win), then the defaults."""
    preset = PRESETS.get(args.shape, {}) if args.shape else {}
    if preset:
        preset = {**preset, "dtype": "bfloat16", "lr": 1e-6}
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    if args.trl_accumulation < 1 or args.prompts * args.n % args.trl_accumulation:
        raise SystemExit(f"--trl-accumulation {args.trl_accumulation} must divide the batch of "
                         f"{args.prompts} x {args.n} completions")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--shape", choices=sorted(PRESETS), help="a preset: model, prompts x n x new tokens, bf16 (GPU)")
    p.add_argument("--size", choices=sorted(SIZES), help="model shape (default tiny; 0.9b and larger: for a GPU)")
    p.add_argument("--steps", type=int, help="optimizer steps per side (the first is a warm-up; default 4)")
    p.add_argument("--prompts", type=int, help="prompts per step (default 8)")
    p.add_argument("--n", type=int, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="default 32")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, help="default 1e-5 (presets: 1e-6)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32 (presets: bfloat16)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=3, help="digits of the copy task's prompts")
    p.add_argument("--lora", type=int, metavar="RANK",
                   help="train a LoRA adapter of this rank on both sides (0: full fine-tuning, the default)")
    p.add_argument("--trl-accumulation", type=int,
                   help="forward/backward passes TRL splits each step's batch into (default 1, or the preset's)")
    p.add_argument("--trl-oom-retries", type=int, default=2,
                   help="times a TRL run that ran out of CUDA memory is run again with twice the accumulation")
    p.add_argument("--verl-data", choices=["auto", "jsonl", "task"], default="auto",
                   help="verl reads the JSONL file (jsonl), the built-in task (task), or the file when it can")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="also run `verl train` with these config overrides (repeatable); each variant is "
                        "reported against the same TRL run")
    p.add_argument("--sides", default="trl,verl",
                   help="which sides run in this call (trl, verl or both); the report adds results saved in --out")
    p.add_argument("--skip-trl", action="store_true", help="the same as --sides verl")
    p.add_argument("--trl-python", help="python that runs the TRL side (default: this one)")
    p.add_argument("--verl-python", help="python that runs `verl train` (default: this one)")
    p.add_argument("--out", help="folder for the model, prompts, runs and results (default: a temporary one)")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--trl-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    resolve_preset(args)
    if args.trl_worker:
        trl_worker(args)
        return
    if args.plan_worker:
        plan_worker(args)
        return
    sides = {"verl"} if args.skip_trl else {x.strip() for x in args.sides.split(",") if x.strip()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        model, data = build_inputs(args, out)
        use_data = {"jsonl": True, "task": False, "auto": verl_has_datasets()}[args.verl_data]
        if args.verl_data == "jsonl" and not verl_has_datasets():
            raise SystemExit("--verl-data jsonl: this checkout's trainer does not read data.train yet")
        plan = memory_plan(args, model, data, out)
        trl = _saved(out, "trl", args)
        if "trl" in sides:
            trl = run_trl(args, model, data, out)
            _save(out, "trl", args, trl)
        runs: dict[str, dict[str, Any] | None] = {}
        for name, sets in [("default", ""), *[v.partition(":")[::2] for v in args.variant]]:
            runs[name] = _saved(out, f"verl-{name}", args)
            if "verl" in sides:
                ran = run_verl(args, model, data, out, use_data, [x for x in sets.split(",") if x], name)
                _save(out, f"verl-{name}", args, ran)
                runs[name] = ran
    print("\n" + plan)
    labels = {"default": "the default config"} | {v.partition(":")[0]: v for v in args.variant}
    for name, hist in runs.items():
        report(args, trl, hist, use_data, labels[name])


def _key(args: argparse.Namespace) -> dict[str, Any]:
    """What a saved result must share with this call to be reported beside it."""
    return {k: getattr(args, k) for k in ("size", "prompts", "n", "max_new_tokens", "dtype", "device", "lr",
                                           "temperature", "seed", "digits", "steps", "lora")}


def _save(out: Path, side: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    (out / f"result-{side}.json").write_text(json.dumps({"key": _key(args), **result}))


def _saved(out: Path, side: str, args: argparse.Namespace) -> dict[str, Any] | None:
    path = out / f"result-{side}.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    if data.pop("key") != _key(args):
        print(f"({path} is of another run configuration: not reported)")
        return None
    return data


def report(args: argparse.Namespace, trl: dict[str, Any] | None, verl: dict[str, Any] | None,
           use_data: bool, label: str = "verl train") -> None:
    """Print one verl run against the TRL run (when there is one) and its per-phase breakdown."""
    import torch

    batch = args.prompts * args.n
    print(f"\nmodel {args.size}, {args.dtype} on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads; {args.prompts} prompts x {args.n} completions, "
          f"max {args.max_new_tokens} new tokens, T={args.temperature}, lr {args.lr}, beta 0, "
          f"one optimizer step per batch; median of steps 2..{args.steps}"
          + (f"; LoRA rank {args.lora}, alpha {2 * args.lora} on {', '.join(LORA_TARGETS)} (both sides)" if args.lora
             else "; full fine-tuning"))
    print("verl prompts: " + ("the JSONL file through data.train, reward through reward.functions" if use_data
                              else "the built-in copy task and its exact-match reward (this trainer does not "
                                   "read data.train); TRL: the same task's prompts from the JSONL file"))
    if trl is not None:
        print(f"TRL: {trl.get('accumulation', 1)} forward/backward pass(es) per step; with {args.dtype} weights its "
              "AdamW moments are in that dtype (no float32 master weights)")
    head = f"{'side':<18} {'s/step':>8} {'compl. tok/s':>13} {'mean compl. len':>16} {'peak GB':>8}"
    print(head)
    print("-" * len(head))
    trl_s = trl_tps = trl_len = 0.0
    if trl is not None:
        steps = trl["steps"]
        timed_trl = steps[1:] or steps
        trl_s = statistics.median(s["seconds"] for s in timed_trl)
        trl_len = statistics.mean(s.get("mean_length", float("nan")) for s in timed_trl)
        trl_tps = trl_len * batch / trl_s
        print(f"{'TRL GRPOTrainer':<18} {trl_s:>8.3f} {trl_tps:>13.1f} {trl_len:>16.2f} "
              f"{trl['peak_bytes'] / 1e9:>8.1f}")
    if verl is None:
        print(f"{'verl train':<18} (no result: run with --sides verl)   <- {label}")
        return
    verl_hist = verl["steps"]
    timed_verl = verl_hist[1:] or verl_hist  # the first step warms up
    verl_s = statistics.median(float(m["time/step"]) for m in timed_verl)
    verl_len = statistics.mean(float(m["response/length_mean"]) for m in timed_verl)
    verl_tps = verl_len * batch / verl_s
    print(f"{'verl train':<18} {verl_s:>8.3f} {verl_tps:>13.1f} {verl_len:>16.2f} "
          f"{verl['peak_bytes'] / 1e9:>8.1f}   <- {label}")
    print(f"(peak memory: {verl['peak_how']})")
    if trl is not None:
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
    for key in ("rollout/slept", "memory_plan/master_weights", "memory_plan/master_weights_dropped",
                "scheduler/actor/budget", "scheduler/actor/micro_batches", "scheduler/actor/ooms"):
        values = [m.get(key) for m in verl_hist]
        if any(x is not None for x in values):
            print(f"  {key} per step: {values}")


if __name__ == "__main__":
    main()
