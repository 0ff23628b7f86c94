"""Generation throughput of the Megatron rollout engine: KV-cached decoding vs recomputing every step.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_megatron_rollout.py [--size small|gpu]
     [--prompts 8] [--new-tokens 128]

Both rows are the same engine on the same weights (``options={"rollout_kv_cache": ...}``), seeded
sampling at T = 1 with no stop tokens but EOS, after one short warm-up call; throughput counts real
response tokens. The baseline is recomputing the whole sequence at every step (the engine's
previous decoding). The table also shows whether both sampled the same ids and the largest
difference of their rollout log-probs. ``--size small`` is a 4-layer, hidden-256 Llama in float32
(CPU); ``--size gpu`` the 0.89B Llama shape in bfloat16.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIZES: dict[str, dict[str, Any]] = {
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "head_dim": 32,
              "intermediate_size": 512, "vocab_size": 1024, "dtype": "float32", "prompt": 32},
    "gpu": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
            "intermediate_size": 5632, "vocab_size": 32000, "dtype": "bfloat16", "prompt": 512},
}


def model_folder(size: str, root: Path) -> Path:
    from verl_conformance.testkit import TinyModelSpec, build_tiny_model

    s = SIZES[size]
    spec = TinyModelSpec(
        arch="llama", hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
        num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"], max_position=4096, init_std=0.02,
    )
    path = root / f"bench-megatron-rollout-{size}"
    if not (path / "verl_tiny_model.json").exists():
        build_tiny_model(path, spec)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--root", default=os.environ.get("VERL_BENCH_DIR", tempfile.gettempdir()))
    args = parser.parse_args()
    from verl_conformance.testkit import random_batch
    from verl_core import EngineSpec, SamplingParams, get_rollout_engine

    s = SIZES[args.size]
    path = model_folder(args.size, Path(args.root))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = random_batch(batch_size=args.prompts, max_prompt=s["prompt"], max_response=1,
                           vocab_size=s["vocab_size"], seed=0).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=1)
    rows: dict[bool, tuple[float, int, Any]] = {}
    for cached in (False, True):
        engine = get_rollout_engine("megatron", EngineSpec(
            str(path), "rollout", dtype=s["dtype"], device=dev, max_prompt_len=s["prompt"] * 2,
            max_response_len=args.new_tokens, options={"rollout_kv_cache": cached}))
        engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        if dev == "cuda":
            torch.cuda.synchronize()
        rows[cached] = (time.perf_counter() - t0, int(out["response_mask"].sum()), out)
        engine.close()
    base_s, base_n, base = rows[False]
    same = torch.equal(rows[True][2]["response_ids"], base["response_ids"])
    diff = float((rows[True][2]["rollout_log_probs"] - base["rollout_log_probs"]).abs().max())
    print(f"model {args.size} ({s['dtype']}, {dev}), {args.prompts} prompts of <= {s['prompt']} tokens, "
          f"{args.new_tokens} new tokens, torch threads {torch.get_num_threads()}")
    print(f"{'decoding':<22} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs recompute':>13}")
    for cached, (sec, n, _) in rows.items():
        name = "KV cache" if cached else "recompute every step"
        print(f"{name:<22} {n:>7} {sec:>8.2f} {n / sec:>9.0f} {(n / sec) / (base_n / base_s):>12.2f}x")
    print(f"same sampled ids: {same}; largest |rollout log-prob difference|: {diff:.2e}")


if __name__ == "__main__":
    sys.exit(main())
