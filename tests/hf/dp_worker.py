"""A data-parallel rank of the hf training engine (run by torchrun from test_data_parallel.py).

Usage: ``dp_worker.py MODEL_PATH MICRO_BATCH_TOKENS MODE [MODE ...]``: one engine per mode, one
after the other in the same process group. The global batch is split unevenly
(rank 0 gets six samples, rank 1 one) so the ranks need different numbers of micro-batches. Each
rank reports its gradients (gathered to full tensors), metrics, grad norm, log-probs after the
step and the exported weights, by mode.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_conformance.testkit import random_batch, write_rank_result
from verl_core import EngineSpec, GlobalBatchStats, OptimConfig, ParallelSizes, TensorBatch
from verl_core.algorithms import Algorithm
from verl_core.kernel.weights import WeightChunk

SPLIT = (6, 1)


def global_batch() -> TensorBatch:
    """The global batch of the run (the same on every rank and in the single-process baseline)."""
    return random_batch(batch_size=sum(SPLIT), max_prompt=7, max_response=6, seed=11,
                        with_rl_fields=True, empty_responses=1)


def run(mode: str, path: str, budget: int) -> dict[str, object]:
    """Train one step in ``mode`` (a data-parallel mode, ``+packed`` for packed sequences) and
    return what the test compares."""
    from verl_hf.training import HFTrainingEngine

    data_parallel, _, extra = mode.partition("+")
    spec = EngineSpec(
        model_path=path, role="actor", parallel=ParallelSizes(dp=2), micro_batch_tokens=budget,
        optim=OptimConfig(lr=1e-3, grad_clip=1.0),
        options={"data_parallel": data_parallel, **({"pack_sequences": True} if extra == "packed" else {})},
        device=os.environ.get("VERL_HF_TEST_DEVICE", "cpu"),
    )
    engine = HFTrainingEngine(spec)
    batch = global_batch()
    shard = batch.split(list(SPLIT))[dist.get_rank()]
    loss = Algorithm.grpo(kl_loss_coef=0.01).actor_loss
    metrics = engine.forward_backward(shard, loss, GlobalBatchStats.of(batch))
    grads = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        full = getattr(g, "full_tensor", None)
        grads[name] = (full() if full is not None else g).detach().clone()
    step = engine.optimizer_step()
    lp = engine.forward(shard)["log_probs"].cpu()
    weights = {
        n: t.cpu().clone() for m in engine.export_weights() if isinstance(m, WeightChunk) for n, t in m.tensors
    }
    grads = {k: v.cpu() for k, v in grads.items()}
    # Checkpoint round trip under data parallel: a fresh engine loads the state, and one more
    # step on each gives the same weights.
    folder = Path(os.environ["VERL_TESTKIT_RESULT_DIR"]) / f"ckpt-{mode}"
    engine.save_checkpoint(folder)
    restored = HFTrainingEngine(spec)
    restored.load_checkpoint(folder)
    for e in (engine, restored):
        e.forward_backward(shard, loss, GlobalBatchStats.of(batch))
        e.optimizer_step()
    exported = [
        {n: t.cpu().clone() for m in e.export_weights() if isinstance(m, WeightChunk) for n, t in m.tensors}
        for e in (engine, restored)
    ]
    ckpt_equal = all(torch.equal(exported[0][n], exported[1][n]) for n in exported[0])
    return {
        "grads": grads, "metrics": metrics, "grad_norm": step.grad_norm, "log_probs": lp,
        "weights": weights, "mode": engine.data_parallel_mode + ("+packed" if engine.packs_sequences else ""),
        "ckpt_equal": ckpt_equal,
        "step_after_load": restored.step,
    }


def main() -> None:
    path, budget, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    write_rank_result({mode: run(mode, path, budget) for mode in modes})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
