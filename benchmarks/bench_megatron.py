"""Training throughput of the Megatron engine at TP=1 and TP=2 against plain transformers.

Run: .venv/bin/python benchmarks/bench_megatron.py [--size small|gpu] [--tp 1,2] [--steps N]
     [--attention sdpa,local]

Each row times ``forward_backward`` + ``optimizer_step`` of one policy-gradient mini-batch (micro-batch
of ``--batch`` samples x ``--seq`` tokens, half prompt, half response) after one warm-up step, and
reports tokens/s and the ratio to the plain-transformers baseline measured in the same run (the
same model, batch, loss and AdamW, ``attn_implementation="sdpa"``). Megatron rows run under
torchrun with ``tp`` processes; TP=1 is timed with each core attention of ``--attention``
(``sdpa``: torch's scaled_dot_product_attention, ``local``: megatron-core's DotProductAttention),
larger TP with SDPA. ``--size small`` is a tiny CPU model; ``--size gpu`` is the
0.89B Llama shape (hidden 2048, 16 layers, 16 heads, 8 KV groups, FFN 5632, vocab 32000) in
bfloat16 with 8 x 2048-token micro-batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIZES: dict[str, dict[str, Any]] = {
    "small": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
              "intermediate_size": 256, "vocab_size": 1024, "batch": 4, "seq": 256, "dtype": "float32"},
    "gpu": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
            "intermediate_size": 5632, "vocab_size": 32000, "batch": 8, "seq": 2048, "dtype": "bfloat16"},
}


def model_folder(size: str, root: Path) -> Path:
    from verl_conformance.testkit import TinyModelSpec, build_tiny_model

    s = SIZES[size]
    spec = TinyModelSpec(
        arch="llama", hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
        num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"], max_position=max(4096, s["seq"]), init_std=0.02,
    )
    path = root / f"bench-{size}"
    if not (path / "verl_tiny_model.json").exists():
        build_tiny_model(path, spec)
    return path


def make_batch(size: str) -> Any:
    from verl_conformance.testkit import random_batch

    s = SIZES[size]
    half = s["seq"] // 2
    return random_batch(batch_size=s["batch"], max_prompt=half, max_response=half, vocab_size=s["vocab_size"],
                        seed=0, with_rl_fields=True)


class PGLoss:
    """Token-mean policy-gradient loss (the same in every row)."""

    needs = frozenset({"log_probs"})

    def __call__(self, batch: Any, stats: Any) -> Any:
        from verl_core import LossOutput

        m = batch["response_mask"].float()
        return LossOutput(-(batch["log_probs"] * batch["advantages"] * m).sum() / max(stats.num_tokens, 1))


def worker(size: str, path: str, steps: int, attention: str) -> None:
    from verl_conformance.testkit import write_rank_result
    from verl_core import EngineSpec, GlobalBatchStats, OptimConfig, ParallelSizes
    from verl_megatron.training import MegatronTrainingEngine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = EngineSpec(path, "actor", dtype=SIZES[size]["dtype"], device=dev, parallel=ParallelSizes(tp=world),
                      optim=OptimConfig(lr=1e-5), max_prompt_len=4096, max_response_len=4096,
                      options={"attention": attention})
    engine = MegatronTrainingEngine(spec)
    batch = make_batch(size).to(dev)
    stats = GlobalBatchStats.of(batch)
    engine.forward_backward(batch, PGLoss(), stats)
    engine.optimizer_step()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.forward_backward(batch, PGLoss(), stats)
        engine.optimizer_step()
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    write_rank_result({"seconds": seconds})


def transformers_baseline(size: str, path: Path, steps: int) -> float:
    """Seconds per step of plain transformers on the same batch and loss."""
    import transformers

    from verl_conformance.testkit.reference import position_ids

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, SIZES[size]["dtype"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch(size).to(dev)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    pos = position_ids(mask)
    p, r = batch.prompt_len, batch.response_len
    rmask = batch["response_mask"]
    n = max(int(rmask.sum()), 1)

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits[:, p - 1 : p + r - 1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
        loss = -torch.where(rmask, lp * batch["advantages"], torch.zeros_like(lp)).sum() / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes to time")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention", default="sdpa,local", help="comma-separated core attentions to time at TP=1")
    parser.add_argument("--root", default=os.environ.get("VERL_BENCH_DIR", tempfile.gettempdir()))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size, args.path, args.steps, args.attention)
        return
    from verl_conformance.testkit import launch_torchrun

    path = model_folder(args.size, Path(args.root))
    s = SIZES[args.size]
    tokens = s["batch"] * s["seq"]
    rows: list[tuple[str, float]] = [("transformers (sdpa)", transformers_baseline(args.size, path, args.steps))]
    runs = [(1, a) for a in args.attention.split(",")]
    runs += [(int(tp), "sdpa") for tp in args.tp.split(",") if int(tp) != 1]
    for tp, attention in runs:
        res = launch_torchrun(
            Path(__file__), tp, ["--worker", "--size", args.size, "--path", str(path), "--steps", str(args.steps),
                                 "--attention", attention],
            timeout=3600, env={"PYTHONWARNINGS": "ignore"},
        )
        rows.append((f"megatron tp={tp} {attention}", max(r["seconds"] for r in res)))
    base = rows[0][1]
    print(f"model {args.size}: {json.dumps({k: v for k, v in s.items() if k not in ('batch', 'seq')})}")
    print(f"batch {s['batch']} x {s['seq']} tokens, {args.steps} timed steps, device "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}, torch threads {torch.get_num_threads()}")
    print(f"{'engine':<26} {'s/step':>9} {'tokens/s':>11} {'vs transformers':>16}")
    for name, sec in rows:
        print(f"{name:<26} {sec:>9.3f} {tokens / sec:>11.0f} {base / sec:>15.2f}x")


if __name__ == "__main__":
    sys.exit(main())
