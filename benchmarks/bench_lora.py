"""GRPO steps with a LoRA adapter vs full fine-tuning: step time, memory, parameter and optimizer bytes.

    python benchmarks/bench_lora.py [--size tiny|small|1b|7b|14b] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--steps 2] [--rank 16] [--modes full,lora,lora-merged] [--kl] [--max-new-tokens N] [--prompts N]
        [--gradient-checkpointing] [--keep DIR]

Builds a random Llama of the chosen shape locally (``7b``: Llama-2-7B's 4096 x 32 layers, 32
heads, FFN 11008, vocabulary 32000; ``14b``: Qwen2.5-14B's body, 5120 x 48 layers, 40 heads over 8 KV heads, FFN
13824, vocabulary 32000, 13.5B parameters; initialised on the device, saved in ``--dtype``), then runs each
mode in its own process (so peak memory is that mode's): a warm-up GRPO step and ``--steps``
measured ones of the trainer (hf actor and rollout, the built-in copy task, 8 samples per prompt).
``lora`` trains a rank ``--rank`` adapter (alpha = 2 x rank) on every attention and MLP projection
and syncs it to the rollout as an adapter (the rollout decodes base + adapter); ``lora-merged``
syncs merged weights instead (the rollout decodes plain weights); ``full`` trains every weight. With ``--kl`` the loss has
a KL term: ``full`` then builds a reference engine (a second copy of the weights), ``lora`` uses
the actor's base with the adapter disabled. Prints one table: trainable parameters, parameter
bytes of the actor (and reference), optimizer bytes (Adam moments and float32 masters), median
seconds per step and per stage, and the peak memory (CUDA: the allocator's peak; CPU: the
process's peak resident set). ``--size tiny`` runs in seconds on a CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# hidden, layers, heads, kv heads, head dim, FFN, vocabulary, max new tokens, prompts per step
SIZES: dict[str, tuple[int, int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 2, 2, 32, 128, 96, 8, 4),
    "small": (512, 6, 8, 4, 64, 1376, 96, 32, 8),
    "base": (768, 12, 12, 12, 64, 2048, 96, 16, 4),
    "1b": (2048, 16, 16, 8, 128, 5632, 96, 128, 16),
    "0.9b": (2048, 16, 16, 8, 128, 5632, 32000, 128, 16),
    "7b": (4096, 32, 32, 32, 128, 11008, 32000, 128, 16),
    "14b": (5120, 48, 40, 8, 128, 13824, 32000, 128, 8),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(size: str, dtype: str, device: str, out: Path) -> Path:
    """A random Llama of ``size`` with the test kit's character tokenizer, in ``out``."""
    import torch
    import transformers

    from verl_core.trainer.inputs.tiny_model import char_tokenizer

    hidden, layers, heads, kv, head_dim, ffn, vocab, *_ = SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-6,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will run: a 7B model initialises in seconds on a GPU
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    char_tokenizer(vocab).save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _engine_bytes(engine: Any) -> dict[str, int]:
    """Parameter, trainable and optimizer bytes of an hf training engine (Adam's moments and masters)."""
    import torch

    params = list(engine.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt = engine._optimizer
    states = [v for s in (opt.state.values() if opt is not None else []) for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    master = engine._master
    masters = list(master.masters) if master is not None else []
    return {"param_bytes": _bytes(params), "trainable_params": sum(p.numel() for p in trainable),
            "optimizer_bytes": _bytes(states) + _bytes(masters)}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run the trainer for one mode and return its figures (in the worker process)."""
    import torch

    from verl_core.trainer.config import load_config
    from verl_core.trainer.rl.engines import BaseModelReference
    from verl_core.trainer.rl.trainer import Trainer

    *_, new_tokens, prompts = SIZES[args.size]
    overrides = [
        f"output_dir={json.dumps(str(Path(args.out) / args.worker))}", "seed=0", f"steps={args.steps + 1}",
        f"model.path={json.dumps(args.model)}", f"model.device={json.dumps(args.device)}",
        f"model.dtype={json.dumps(args.dtype)}", "task.name=copy", "task.digits=3",
        "algorithm.name=grpo", f"algorithm.options.kl_loss_coef={0.001 if args.kl else 0.0}",
        f"algorithm.use_reference={'true' if args.kl else 'false'}", "rollout.n=8",
        f"rollout.max_new_tokens={args.max_new_tokens or new_tokens}",
        f"batch.prompts_per_step={args.prompts or prompts}", "optim.lr=1e-4",
        "logging.progress=false", "logging.plot=false", "logging.sinks=[]", "checkpoint.final=false",
    ]
    if args.worker in ("lora", "lora-merged"):
        overrides += ["model.lora.enabled=true", f"model.lora.rank={args.rank}", f"model.lora.alpha={2.0 * args.rank}",
                      f"model.lora.targets={json.dumps(TARGETS)}",
                      f"model.lora.sync={'merged' if args.worker == 'lora-merged' else 'adapter'}"]
    cfg = load_config(None, overrides)
    cuda = args.device.startswith("cuda")
    t0 = time.perf_counter()
    try:
        with Trainer(cfg) as trainer:
            trainer.setup()
            if args.gradient_checkpointing:
                trainer.actor.model.gradient_checkpointing_enable(  # type: ignore[attr-defined]
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            setup = time.perf_counter() - t0
            history = trainer.train()
            figures = _engine_bytes(trainer.actor)
            ref = trainer.reference
            figures["reference_bytes"] = 0 if ref is None or isinstance(ref, BaseModelReference) else _bytes(
                list(ref.model.parameters()))  # type: ignore[attr-defined]
    except torch.OutOfMemoryError as e:
        return {"mode": args.worker, "error": f"out of memory: {str(e).splitlines()[0]}"}
    measured = history[1:] or history

    def med(key: str) -> float:
        values = [float(m[key]) for m in measured if key in m]
        return statistics.median(values) if values else float("nan")

    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"mode": args.worker, "setup_s": setup, "step_s": med("time/step"), "rollout_s": med("time/rollout"),
            "update_s": med("time/update"), "sync_s": med("time/weight_sync"), "sync_bytes": med("weight_sync/bytes"),
            "peak_bytes": peak, **figures}


def _size(n: float) -> str:
    """Bytes as MB below a GB, else GB."""
    return f"{n / 1024**3:.2f} GB" if n >= 1024**3 else f"{n / 1024**2:.2f} MB"


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (f"GRPO step, {args.size} Llama ({args.dtype}, {args.device}), "
            f"{'with' if args.kl else 'no'} KL, LoRA rank {args.rank} on {len(TARGETS)} projections")
    lines = [head, "",
             "| mode | trainable params | actor params | reference | optimizer | step s | rollout s | update s | "
             "sync s | sync bytes | peak memory |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} |")
            continue
        lines.append(
            f"| {r['mode']} | {r['trainable_params']:,} | {_size(r['param_bytes'])} | {_size(r['reference_bytes'])} | "
            f"{_size(r['optimizer_bytes'])} | {r['step_s']:.3f} | {r['rollout_s']:.3f} | {r['update_s']:.3f} | "
            f"{r['sync_s']:.3f} | {_size(r['sync_bytes'])} | {_size(r['peak_bytes'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", default="full,lora,lora-merged", help="comma-separated: full, lora, lora-merged")
    p.add_argument("--kl", action="store_true", help="a KL loss: full builds a reference engine, LoRA uses its base")
    p.add_argument("--max-new-tokens", type=int, default=0)
    p.add_argument("--prompts", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--keep", help="build (or reuse) the model folder here instead of a temporary folder")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.worker:
        print("VERL_BENCH_LORA " + json.dumps(worker(args)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="verl-bench-lora-") as tmp:
        model = Path(args.keep) if args.keep else Path(tmp) / "model"
        if not (model / "config.json").is_file():
            t0 = time.perf_counter()
            build_model(args.size, args.dtype, args.device, model)
            print(f"built a random {args.size} Llama in {time.perf_counter() - t0:.1f}s at {model}", file=sys.stderr)
        rows = []
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", mode, "--model", str(model), "--out", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VERL_BENCH_LORA ")), None)
            if line is None:
                rows.append({"mode": mode, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"})
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            rows.append(json.loads(line.removeprefix("VERL_BENCH_LORA ")))
    print(_table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
