"""Weight sync from a Megatron training layout to a colocated Megatron rollout layout: direct vs canonical.

Run: .venv/bin/python benchmarks/bench_resharding.py [--size small|gpu] [--world 4]
     [--layouts 2x2:2,2x2:1,4x1:1,1x4:2] [--bucket-mb 4] [--reps 3]

Each layout ``TPxPP:RTP`` trains at TP x PP (data-parallel replicas fill the world) and rolls out
at TP=RTP (replicas fill the world), all on the same ranks. Every rank builds both engines, then
the same rollout engine is synced ``--reps`` times through each path after one warm-up each:

* ``canonical``: ``StreamWeightSync`` (every rank gathers each full tensor, converts it to
  transformers naming and cuts its shard back out);
* ``direct``: ``MegatronDirectSync`` (each rank receives only the slices of its rollout shard it
  does not hold, bucket by bucket).

Time is the slowest rank's mean seconds per sync; peak memory is the largest, over ranks, of the
bytes a sync allocates beyond both engines' own shards (``verl_megatron.memory.peak_extra_bytes``:
the CUDA allocator's peak on GPU, tensor storages alive on CPU), measured in a separate sync.
Ratios are canonical / direct (higher = direct better). Both paths use the same bucket size.
``--size small`` is a small CPU model (float32); ``--size gpu`` the 0.89B Llama shape in bfloat16.
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
              "intermediate_size": 512, "vocab_size": 4096, "dtype": "float32"},
    "gpu": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
            "intermediate_size": 5632, "vocab_size": 32000, "dtype": "bfloat16"},
}


def model_folder(size: str, root: Path) -> Path:
    from verl_conformance.testkit import TinyModelSpec, build_tiny_model

    s = SIZES[size]
    spec = TinyModelSpec(
        arch="llama", hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
        num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"], init_std=0.02,
    )
    path = root / f"bench-reshard-{size}"
    if not (path / "verl_tiny_model.json").exists():
        build_tiny_model(path, spec)
    return path


def worker(size: str, path: str, tp: int, pp: int, rollout_tps: list[int], bucket: int, reps: int) -> None:
    import torch.distributed as dist

    from verl_conformance.testkit import write_rank_result
    from verl_core import (
        EngineSpec,
        OptimConfig,
        ParallelSizes,
        StreamWeightSync,
        get_rollout_engine,
    )
    from verl_megatron.memory import peak_extra_bytes
    from verl_megatron.reshard import MegatronDirectSync
    from verl_megatron.training import MegatronTrainingEngine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = SIZES[size]["dtype"]
    actor = MegatronTrainingEngine(EngineSpec(path, "actor", dtype=dtype, device=dev,
                                              parallel=ParallelSizes(tp=tp, pp=pp, dp=world // (tp * pp)),
                                              optim=OptimConfig(lr=1e-5)))
    memory_device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {}
    for rtp in rollout_tps:
        rollout = get_rollout_engine("megatron", EngineSpec(path, "rollout", dtype=dtype, device=dev,
                                                            parallel=ParallelSizes(tp=rtp, dp=world // rtp)))
        paths = {"canonical": StreamWeightSync(bucket), "direct": MegatronDirectSync(bucket)}
        row: dict[str, Any] = {}
        version = 0
        for name, sync in paths.items():
            version += 1
            sync.sync(actor, rollout, version=version)  # warm-up (the direct path plans here)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                version += 1
                report = sync.sync(actor, rollout, version=version)
            dist.barrier()
            row[f"{name}_s"] = (time.perf_counter() - t0) / reps
            version += 1
            _, peak = peak_extra_bytes(lambda s=sync, v=version, r=rollout: s.sync(actor, r, version=v), memory_device)
            row[f"{name}_peak"] = peak
            row[f"{name}_bytes"] = report.details.get("received_bytes", report.bytes)
        row["shard_bytes"] = sum(p.numel() * p.element_size() for p in rollout.model.parameters())
        out[str(rtp)] = row
        rollout.close()
    write_rank_result(out)
    dist.barrier()


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--world", type=int, default=4, help="ranks (processes; GPUs on a GPU machine)")
    parser.add_argument("--layouts", default="2x2:2,2x2:1,4x1:1,1x4:2,2x1:1",
                        help="comma-separated TRAIN_TPxTRAIN_PP:ROLLOUT_TP")
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", default=os.environ.get("VERL_BENCH_DIR", tempfile.gettempdir()))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--rollout-tps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    bucket = int(args.bucket_mb * 2**20)
    if args.worker:
        tp, pp = (int(x) for x in args.train.split("x"))
        worker(args.size, args.path, tp, pp, [int(x) for x in args.rollout_tps.split(",")], bucket, args.reps)
        return
    from verl_conformance.testkit import launch_torchrun

    path = model_folder(args.size, Path(args.root))
    by_train: dict[str, list[str]] = {}
    for item in args.layouts.split(","):
        train, rtp = item.split(":")
        by_train.setdefault(train, []).append(rtp)
    rows = []
    for train, rtps in by_train.items():
        res = launch_torchrun(
            Path(__file__), args.world,
            ["--worker", "--size", args.size, "--path", str(path), "--train", train, "--rollout-tps", ",".join(rtps),
             "--bucket-mb", str(args.bucket_mb), "--reps", str(args.reps)],
            timeout=3600, env={"PYTHONWARNINGS": "ignore"},
        )
        for rtp in rtps:
            per_rank = [r[rtp] for r in res]
            row = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            rows.append((f"{train} -> tp{rtp}", row))
    s = SIZES[args.size]
    n_params = sum(
        p for p in [s["vocab_size"] * s["hidden_size"] * 2, s["hidden_size"]]
    ) + s["num_layers"] * (
        s["hidden_size"] * (s["num_heads"] + 2 * s["num_kv_heads"]) * s["head_dim"]
        + s["num_heads"] * s["head_dim"] * s["hidden_size"] + 3 * s["hidden_size"] * s["intermediate_size"]
        + 2 * s["hidden_size"]
    )
    print(f"model {args.size}: {n_params / 1e6:.1f}M parameters, {s['dtype']}; {args.world} ranks, device "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}; bucket {args.bucket_mb} MiB; {args.reps} timed syncs")
    print("time: slowest rank, s/sync; peak: largest rank, MiB beyond both engines' shards; "
          "recv: MiB a rank receives (max); ratio = canonical / direct")
    head = (f"{'train -> rollout':<16} {'canon s':>8} {'direct s':>9} {'speedup':>8} {'canon peak':>11} "
            f"{'direct peak':>12} {'mem ratio':>10} {'canon recv':>11} {'direct recv':>12} {'shard':>8}")
    print(head)
    for name, r in rows:
        speed = r["canonical_s"] / r["direct_s"] if r["direct_s"] > 0 else float("inf")
        mem = r["canonical_peak"] / r["direct_peak"] if r["direct_peak"] > 0 else float("inf")
        print(f"{name:<16} {r['canonical_s']:>8.3f} {r['direct_s']:>9.3f} {speed:>7.2f}x "
              f"{_mib(r['canonical_peak']):>11} {_mib(r['direct_peak']):>12} {mem:>9.1f}x "
              f"{_mib(r['canonical_bytes']):>11} {_mib(r['direct_bytes']):>12} {_mib(r['shard_bytes']):>8}")


if __name__ == "__main__":
    sys.exit(main())
