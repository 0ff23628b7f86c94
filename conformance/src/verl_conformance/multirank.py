"""A data-parallel rank of the conformance suite, run under torchrun by the invariance checks.

Usage: ``python -m torch.distributed.run --nproc_per_node N multirank.py BACKEND MODEL_PATH SPEC_JSON``
where SPEC_JSON holds ``parallel`` (tp, pp, dp; their product is N) and other EngineSpec fields.
Each rank builds the backend's actor through the registry, takes its :func:`~verl_core.dp_shard`
of the suite's batch (the whole batch when dp = 1), runs forward, one forward_backward with the
global batch counts and one optimizer step, exports the weights and writes its result.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["dp_batch", "main"]


def dp_batch() -> Any:
    """The global batch of the data-parallel check (the single-process baseline uses the same)."""
    from verl_conformance.testkit import random_batch

    b = random_batch(batch_size=6, max_prompt=8, max_response=8, seed=70, empty_responses=1, with_rl_fields=True)
    return b.select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "truncated",
                    "old_log_probs", "advantages")


def main(argv: list[str]) -> None:
    """Run one rank (see the module docstring)."""
    from verl_conformance.harness import SUITE_OPTIM, collect_stream
    from verl_conformance.losses import TOKEN_MEAN_PG
    from verl_conformance.testkit import write_rank_result
    from verl_core import EngineSpec, GlobalBatchStats, ParallelSizes, dp_shard, get_training_engine

    backend, model_path, extra = argv[0], argv[1], json.loads(argv[2])
    rank = int(os.environ["RANK"])
    parallel = ParallelSizes(**extra.pop("parallel"))
    spec = EngineSpec(model_path=model_path, role="actor", optim=SUITE_OPTIM, max_prompt_len=12,
                      max_response_len=12, parallel=parallel, **extra)
    engine = get_training_engine(backend, spec)
    batch = dp_batch()
    # With only dp > 1 the data-parallel rank is the global rank; otherwise every rank takes it all.
    shard = dp_shard(batch, rank, parallel.dp) if parallel.dp > 1 else batch
    log_probs = engine.forward(shard)["log_probs"]
    metrics = engine.forward_backward(shard, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    step = engine.optimizer_step()
    weights = collect_stream(engine.export_weights())[1]
    write_rank_result({"log_probs": log_probs, "loss": metrics["loss"], "grad_norm": step.grad_norm,
                       "weights": weights})
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
