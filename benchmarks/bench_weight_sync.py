"""Benchmark of the canonical weight sync (hf actor -> hf rollout) against a plain parameter copy.

Prints one table. Every row is measured in the same run, interleaved with the anchor (median of
the repetitions), so a loaded machine shifts both sides alike:

* named-parameter copy: ``dst.copy_(src)`` for every named parameter of the actor into a second,
  preallocated copy of the model (the anchor: one read and one write of every byte);
* canonical stream: ``StreamWeightSync(bucket_bytes).sync(actor, rollout)``, i.e.
  ``rollout.update_weights(actor.export_weights(...))`` with the manifest, per-chunk checks
  (names, shapes, dtypes, finiteness) and the copy into the rollout engine's parameters;
* direct path: the sync registered for hf -> hf (``get_weight_sync("hf", "hf")``: one multi-tensor
  copy and one fused finiteness check, no stream);
* export only: consuming ``actor.export_weights(...)`` without applying it (the sender's share).

GB/s counts the bytes of the streamed tensors once (as the anchor counts each parameter once).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_sync.py`` (about a minute);
``--dtype bfloat16``, ``--bucket-mb``, ``--layers`` change the setup.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verl_conformance.testkit import TinyModelSpec, build_tiny_model
from verl_core import EngineSpec, StreamWeightSync, WeightChunk, get_weight_sync
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Median seconds of each function, run in turn ``reps`` times after one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            times[i].append(timed(fn))
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    spec = TinyModelSpec(arch="llama", hidden_size=768, num_layers=args.layers, num_heads=12, num_kv_heads=4,
                         head_dim=64, intermediate_size=2048, vocab_size=32000, max_position=1024, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(Path(tmp) / "model", spec))
        actor = HFTrainingEngine(EngineSpec(model_path=path, role="actor", dtype=args.dtype))
        rollout = HFRolloutEngine(EngineSpec(model_path=path, role="rollout", dtype=args.dtype))
    src = [p.detach() for p in actor.model.parameters()]
    dst = [torch.empty_like(p) for p in src]
    nbytes = sum(p.numel() * p.element_size() for p in src)
    bucket = args.bucket_mb << 20
    version = [0]
    sent = [0]

    def copy() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    def sync() -> None:
        version[0] += 1
        sent[0] = StreamWeightSync(bucket_bytes=bucket).sync(actor, rollout, version=version[0]).bytes

    direct = get_weight_sync("hf", "hf")

    def direct_sync() -> None:
        version[0] += 1
        direct.sync(actor, rollout, version=version[0])

    def export() -> None:
        for msg in actor.export_weights(dtype=rollout.weight_dtype, bucket_bytes=bucket):
            if isinstance(msg, WeightChunk):
                pass

    t_copy, t_sync, t_direct, t_export = interleaved([copy, sync, direct_sync, export], args.reps)
    assert rollout.weight_version == version[0]
    n_params = sum(p.numel() for p in src)
    print(f"Weight sync hf actor -> hf rollout, {n_params / 1e6:.0f}M params, {args.dtype}, "
          f"{nbytes / 1e9:.2f} GB, bucket {args.bucket_mb} MB, torch threads {torch.get_num_threads()}")
    print("| path | ms | GB/s | vs copy |\n|---|---|---|---|")
    print(f"| named-parameter copy | {t_copy * 1e3:.1f} | {nbytes / t_copy / 1e9:.2f} | 1.00x |")
    print(f"| canonical stream (export -> update_weights) | {t_sync * 1e3:.1f} | {sent[0] / t_sync / 1e9:.2f} | "
          f"{t_copy / t_sync:.2f}x |")
    print(f"| direct path ({type(direct).__name__}) | {t_direct * 1e3:.1f} | {nbytes / t_direct / 1e9:.2f} | "
          f"{t_copy / t_direct:.2f}x |")
    print(f"| export only (sender's share) | {t_export * 1e3:.1f} | {nbytes / t_export / 1e9:.2f} | "
          f"{t_copy / t_export:.2f}x |")


if __name__ == "__main__":
    main()
