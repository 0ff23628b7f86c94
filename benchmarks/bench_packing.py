"""Training tokens/s of the hf engine with padded against packed micro-batches (``HFOptions.pack_sequences``).

A ragged RL batch (``--batch`` sequences whose prompt + response lengths are spread uniformly over
``--min-len .. --max-len``, prompts of 8..256 tokens left-padded, responses right-padded) goes
through the hf training engine's ``forward_backward`` (GRPO's actor loss) with
``pack_sequences=False`` and ``True``; two engines of the same weights, repetitions interleaved
so a loaded machine slows both alike, the median of ``--reps`` after ``--warmup``. Throughput is
training tokens/s counting real tokens only (prompt + response, no padding), so the ratio is the
speed-up of the same work. The optimizer step between repetitions is not timed.

Two micro-batch layouts, each its own table row:

* ``size:N``: ``N`` consecutive sequences per micro-batch (``EngineSpec.micro_batch_size``);
* ``tokens:N``: a token budget (``forward_backward(max_tokens=N)``), cut by the kernel partitioner
  as the trainer's scheduler cuts it: padded tokens (size x longest, similar lengths grouped) for
  the padded engine, real tokens (the sum of the lengths) for the packing engine, which so holds
  more sequences per micro-batch. The micro-batch column gives both counts.

Before timing, the log-probs of both engines are compared (largest difference printed). The
header says which torch and transformers run, whether ``torch.nn.attention.varlen.varlen_attn``
exists and can run on the device, and after timing which packed attention kernel ran (the flash
``varlen_attn`` or the exact per-sequence SDPA loop that CPU and float32 use).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py --batch 16 --max-len 512   # CPU, tiny
    python benchmarks/bench_packing.py --device cuda --dtype bfloat16 --size 0.9b
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch

from verl_core import BatchMeta, EngineSpec, GlobalBatchStats, OptimConfig, TensorBatch
from verl_core.algorithms import Algorithm
from verl_core.enginekit.packed_attention import packed_attention_counts, varlen_attn_available
from verl_core.trainer.inputs.tiny_model import TinyModelSpec, tiny_model
from verl_hf.training import HFTrainingEngine

# The 0.89B Llama shape of benchmarks/gpu/bench_gpu.py (SPEC) and its tiny CPU shape (TINY_SPEC).
SIZES = {
    "0.9b": TinyModelSpec(arch="llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                          head_dim=128, intermediate_size=5632, vocab_size=32000, max_position=4096,
                          init_std=0.02, seed=0),
    "tiny": TinyModelSpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=32, intermediate_size=256, vocab_size=512, max_position=4096, seed=0),
}


def ragged_batch(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> TensorBatch:
    """``n`` sequences of prompt + response lengths uniform over ``min_len..max_len``."""
    g = torch.Generator().manual_seed(seed)
    total = torch.randint(min_len, max_len + 1, (n,), generator=g)
    prompts = torch.stack([torch.randint(8, max(9, min(256, int(t) // 2) + 1), (1,), generator=g)[0]
                           for t in total]).clamp(max=total - 1)
    responses = total - prompts
    p, r = int(prompts.max()), int(responses.max())
    cols_p, cols_r = torch.arange(p), torch.arange(r)
    pmask = cols_p.unsqueeze(0) >= (p - prompts).unsqueeze(1)  # left-padded
    rmask = cols_r.unsqueeze(0) < responses.unsqueeze(1)  # right-padded
    pids = torch.where(pmask, torch.randint(4, vocab, (n, p), generator=g), 0)
    rids = torch.where(rmask, torch.randint(4, vocab, (n, r), generator=g), 0)
    fields = {
        "prompt_ids": pids, "prompt_mask": pmask, "response_ids": rids, "response_mask": rmask,
        "advantages": torch.where(rmask, torch.randn(n, r, generator=g), 0.0),
        "old_log_probs": torch.where(rmask, -5.0, 0.0),
        "group_ids": torch.arange(n) // 8,
    }
    return TensorBatch(fields, meta=BatchMeta())


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--layouts", default="size:8,tokens:16384",
                    help="comma-separated micro-batch layouts: size:N (sequences) or tokens:N (token budget)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()
    dtype: Literal["float32", "bfloat16"] = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    device = torch.device(args.device)

    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
          + f", dtype {dtype}, model {args.size}, threads {torch.get_num_threads()}")
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        has_varlen = True
    except ImportError:
        has_varlen = False
    print(f"torch.nn.attention.varlen.varlen_attn: {'present' if has_varlen else 'absent'}; "
          f"runs on this device: {varlen_attn_available(device)}")

    spec_model = SIZES[args.size]
    cache = os.environ.get("VERL_TESTKIT_CACHE") or str(Path(tempfile.gettempdir()) / "verl-testkit")
    path = str(tiny_model(spec_model, cache_dir=cache))
    batch = ragged_batch(args.batch, args.min_len, args.max_len, spec_model.vocab_size)
    real = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    width = batch.prompt_len + batch.response_len
    print(f"batch: {args.batch} sequences, {real} real tokens, prompt+response widths {batch.prompt_len}+"
          f"{batch.response_len} (padded to the whole batch: {args.batch * width} tokens)")

    layouts: list[tuple[str, int]] = []
    for item in args.layouts.split(","):
        kind, _, n = item.partition(":")
        if kind not in ("size", "tokens") or not n.isdigit():
            raise SystemExit(f"--layouts: expected size:N or tokens:N, got {item!r}")
        layouts.append((kind, int(n)))
    size = next((n for k, n in layouts if k == "size"), args.batch)

    def engine(pack: bool) -> HFTrainingEngine:
        return HFTrainingEngine(EngineSpec(
            model_path=path, role="actor", dtype=dtype, device=args.device,
            max_prompt_len=batch.prompt_len, max_response_len=batch.response_len, micro_batch_size=size,
            gradient_checkpointing=args.gradient_checkpointing,
            optim=OptimConfig(lr=1e-9, grad_clip=1.0), options={"pack_sequences": pack}))

    engines = {"padded": engine(False), "packed": engine(True)}
    print(f"packed engine packs: {engines['packed'].packs_sequences}")
    lp = {name: e.forward(batch, ["log_probs"])["log_probs"] for name, e in engines.items()}
    diff = (lp["packed"] - lp["padded"]).abs()[batch["response_mask"]]
    print(f"log-probs, packed vs padded: max |diff| {float(diff.max()):.3g}, mean {float(diff.mean()):.3g} "
          "(float rounding: bfloat16's conformance tolerance is atol 0.1 + rtol 0.05)")

    loss_fn = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
    stats = GlobalBatchStats.of(batch)
    before = packed_attention_counts()
    print("\n| layout | micro-batches padded / packed | padded tok/s | packed tok/s | packed / padded |\n"
          "|---|---|---|---|---|")
    for kind, n in layouts:
        max_tokens = n if kind == "tokens" else None
        times: dict[str, list[float]] = {name: [] for name in engines}
        micro: dict[str, float] = {}

        def step(e: HFTrainingEngine, max_tokens: int | None = max_tokens) -> tuple[float, float]:
            synchronize(args.device)
            t0 = time.perf_counter()
            m = e.forward_backward(batch, loss_fn, stats, max_tokens=max_tokens)
            synchronize(args.device)
            dt = time.perf_counter() - t0
            e.optimizer_step()
            return dt, m["num_micro_batches"]

        names = list(engines)
        for rep in range(args.warmup + args.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                dt, micro[name] = step(engines[name])
                if rep >= args.warmup:
                    times[name].append(dt)
        tps = {name: real / statistics.median(ts) for name, ts in times.items()}
        print(f"| {kind}:{n} | {micro['padded']:.0f} / {micro['packed']:.0f} | {tps['padded']:,.0f} | {tps['packed']:,.0f} | "
              f"{tps['packed'] / tps['padded']:.2f}x |")
    after = packed_attention_counts()
    ran = {k: after[k] - before[k] for k in after}
    print(f"\npacked attention calls during timing: {ran} "
          f"({'flash varlen_attn' if ran['varlen_attn'] and not ran['sdpa_loop'] else 'per-sequence SDPA loop' if ran['sdpa_loop'] and not ran['varlen_attn'] else 'mixed'})")
    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
