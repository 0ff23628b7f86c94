"""Where the hf actor's update goes on a GPU at the LoRA benchmark's 6.7B shape.

Run on a CUDA machine: ``python benchmarks/gpu/profile_update.py --out DIR [--size 7b] [--lora]``.
Builds the random Llama of ``benchmarks/bench_lora.py --size SIZE`` (or reuses ``DIR/model-SIZE``),
then for the GRPO benchmark's mini-batch (``--rows`` 64 sequences of ``--prompt`` + ``--response``
tokens, every response full length) prints, each the median of ``--reps`` calls after a warm-up,
against anchors measured in the same run:

* the transformers model's plain forward over the whole batch (no grad, no engine): the anchor;
* the engine's ``forward`` (log-probs), its ``forward_backward`` with the GRPO loss, and its
  ``optimizer_step``, at each micro-batch token budget of ``--budgets`` (0 = the whole batch in one);
* the profiler's kernel table of one ``forward_backward`` at the first budget (top ``--top`` by
  device time), and its CPU-side total, so launch-bound and kernel-bound time can be told apart;
  with ``--shapes N`` also the top N operators grouped by their input shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_lora import SIZES, TARGETS, build_model

from verl_conformance.testkit import random_batch
from verl_core import EngineSpec, GlobalBatchStats, LoraSpec, OptimConfig
from verl_core.algorithms import Algorithm
from verl_hf.modeling import position_ids
from verl_hf.training import HFTrainingEngine

LOSS = Algorithm.grpo(kl_loss_coef=0.0).actor_loss


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _drop_grads(engine: HFTrainingEngine) -> None:
    """Clear the gradients of a timed ``forward_backward`` without stepping (the next call is allowed)."""
    engine.model.zero_grad(set_to_none=True)
    engine._grads_pending = False


def timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after one warm-up (device synchronised)."""
    fn()
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", choices=list(SIZES), default="7b")
    p.add_argument("--lora", action="store_true", help="rank 16 (alpha 32) on the 7 projections, as bench_lora")
    p.add_argument("--master-weights", choices=["true", "false"], default="true")
    p.add_argument("--options", default="{}", help="more hf engine options, a JSON object (e.g. "
                   "'{\"fused_elementwise\": false}'); the anchor's forward is the engine's model, as routed")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 4096, 1024])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--compile-layers", choices=["auto", "true", "false"], default="auto",
                   help="HFOptions.compile_layers: each decoder layer torch.compile'd whole (auto: the engine's "
                   "default, on for CUDA in bfloat16)")
    p.add_argument("--shapes", type=int, default=0, help="also print the top N aten operators by device time "
                   "grouped by input shapes (which tensors the copies and element-wise kernels touch)")
    p.add_argument("--device", default="cuda", help="cpu with --size tiny: a smoke run of the script")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / f"model-{args.size}"
    if not (model / "config.json").is_file():
        t0 = time.perf_counter()
        build_model(args.size, "bfloat16", args.device, model)
        print(f"built {model} in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = SIZES[args.size][6]
    lora = LoraSpec(rank=16, alpha=32.0, targets=tuple(TARGETS)) if args.lora else None
    engine = HFTrainingEngine(EngineSpec(
        model_path=str(model), role="actor", dtype="bfloat16", device=args.device, lora=lora,
        optim=OptimConfig(lr=1e-6, grad_clip=1.0), max_prompt_len=args.prompt, max_response_len=args.response,
        options={"master_weights": args.master_weights == "true",
                 **({} if args.compile_layers == "auto" else {"compile_layers": args.compile_layers == "true"}),
                 **json.loads(args.options)}))
    batch = random_batch(batch_size=args.rows, max_prompt=args.prompt, max_response=args.response,
                         vocab_size=vocab, seed=0, with_rl_fields=True)
    # every response full length, as the benchmark's runs generate
    batch = batch.update(response_mask=torch.ones_like(batch["response_mask"]))
    tokens = int(batch.seq_lengths().sum())
    rows: list[tuple[str, float]] = []
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).to(args.device)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).to(args.device)
    pos = position_ids(mask)
    hf: Any = engine.model

    def plain() -> None:
        with torch.no_grad():
            hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)

    def row(name: str, seconds: float) -> None:
        rows.append((name, seconds))
        print(f"{name:<60} {seconds:8.4f} {seconds / rows[0][1]:9.2f}", flush=True)

    print(f"{'what':<60} {'s':>8} {'x anchor':>9}")
    row("plain transformers forward, no grad (anchor)", timed(plain, args.reps))
    stats = GlobalBatchStats.of(batch)
    for budget in args.budgets:
        b = budget or None
        row(f"engine forward (log-probs), budget {budget or 'all'}",
            timed(lambda b=b: engine._loop.forward(batch.to(engine._device), {"log_probs"}, b, None), args.reps))

        def fb(b: int | None = b) -> None:
            engine.forward_backward(batch, LOSS, stats, max_tokens=b)
            _drop_grads(engine)

        row(f"engine forward_backward, budget {budget or 'all'}", timed(fb, args.reps))
        print(f"budget {budget}: done, peak {_peak():.1f} GiB", flush=True)

    def step() -> None:
        engine.forward_backward(batch, LOSS, stats, max_tokens=args.budgets[0] or None)
        engine.optimizer_step()

    row(f"forward_backward + optimizer_step, budget {args.budgets[0] or 'all'}", timed(step, args.reps))
    anchor = rows[0][1]
    print(f"\n{args.size}, {'LoRA r16' if args.lora else 'full'}, master_weights={args.master_weights}, "
          f"options {args.options}, decoder layers compiled {engine.compiled_layers}, fused element-wise modules {engine.fused_elementwise_modules}, "
          f"{args.rows} rows x {args.prompt}+{args.response} tokens = {tokens} tokens, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}")
    print(f"{'what':<60} {'s':>8} {'x anchor':>9}")
    for name, s in rows:
        print(f"{name:<60} {s:8.4f} {s / anchor:9.2f}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.shapes > 0) as prof:
        engine.forward_backward(batch, LOSS, stats, max_tokens=args.budgets[0] or None)
        _sync()
    _drop_grads(engine)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))
    if args.shapes:
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total", row_limit=args.shapes, max_name_column_width=40, max_shapes_column_width=90))
    print(f"peak {_peak():.1f} GiB")


if __name__ == "__main__":
    main()
