"""A data-parallel rank whose loss is NaN on rank 1 only (run by torchrun from test_nonfinite_dp.py).

Usage: ``nonfinite_worker.py BACKEND MODEL_PATH MODE [MODE ...]``. Per mode: one update where only
rank 1's loss is NaN (every rank must skip it and keep its weights), then one finite update (every
rank must take it, and the ranks must agree). Each rank reports what it saw.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from verl_conformance.testkit import random_batch, write_rank_result
from verl_core import (
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    ParallelSizes,
    TensorBatch,
    get_training_engine,
)
from verl_core.algorithms import Algorithm
from verl_core.kernel.training import LossOutput
from verl_core.kernel.weights import WeightChunk


class _NaNOnThisRank:
    def __init__(self, inner: object, poison: bool) -> None:
        self.inner = inner
        self.poison = poison
        self.needs = inner.needs  # type: ignore[attr-defined]

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        out = self.inner(batch, stats)  # type: ignore[operator]
        lp = batch["log_probs"]
        loss = out.loss - 1e-2 * (lp * batch["response_mask"]).sum() / max(stats.num_tokens, 1)
        return LossOutput(loss * float("nan") if self.poison else loss, out.metrics)


def _weights(engine: object) -> dict[str, torch.Tensor]:
    return {n: t.cpu().clone() for m in engine.export_weights() if isinstance(m, WeightChunk)  # type: ignore[attr-defined]
            for n, t in m.tensors}


def run(backend: str, path: str, mode: str) -> dict[str, object]:
    options = {"data_parallel": mode} if backend == "hf" else {}
    spec = EngineSpec(model_path=path, role="actor", parallel=ParallelSizes(dp=2), options=options,
                      optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    engine = get_training_engine(backend, spec)
    rank = dist.get_rank()
    batch = random_batch(batch_size=4, max_prompt=6, max_response=5, seed=5, with_rl_fields=True, group_size=2)
    shard = batch.split([2, 2])[rank]
    stats = GlobalBatchStats.of(batch)
    loss = Algorithm.grpo().actor_loss
    before = _weights(engine)
    engine.forward_backward(shard, _NaNOnThisRank(loss, poison=rank == 1), stats)
    bad = engine.optimizer_step()
    kept = _weights(engine)
    engine.forward_backward(shard, _NaNOnThisRank(loss, poison=False), stats)
    good = engine.optimizer_step()
    after = _weights(engine)
    return {
        "bad_skipped": bad.skipped, "bad_norm_finite": bool(torch.isfinite(torch.tensor(bad.grad_norm))),
        "unchanged": all(torch.equal(before[n], kept[n]) for n in before),
        "good_skipped": good.skipped, "moved": any(not torch.equal(kept[n], after[n]) for n in kept),
        "after": after,
    }


def main() -> None:
    backend, path, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    write_rank_result({mode: run(backend, path, mode) for mode in modes})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
