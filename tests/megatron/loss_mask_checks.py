"""Launched under torchrun by test_loss_mask_megatron.py: a multi-turn batch through the Megatron engine.

Usage: ``loss_mask_checks.py TP PP``. Every rank writes the forward's outputs with and without the
batch's ``loss_mask`` and the loss, metrics and gradients of two engines trained on the batch with
different values at its observation tokens.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model, write_rank_result
from verl_core import EngineSpec, GlobalBatchStats, OptimConfig, ParallelSizes, TensorBatch
from verl_core.algorithms import Algorithm, OffPolicyConfig
from verl_megatron.training import MegatronTrainingEngine

LOSS = Algorithm.grpo(kl_loss_coef=0.1, entropy_coef=0.01, offpolicy=OffPolicyConfig("tis", "token")).actor_loss


def multi_turn() -> TensorBatch:
    """Ragged samples (one empty) whose responses hold observation tokens at positions 2 and 3."""
    batch = random_batch(batch_size=5, max_prompt=6, max_response=7, seed=4, with_rl_fields=True,
                         empty_responses=1)
    loss_mask = batch["response_mask"].clone()
    loss_mask[:, 2:4] = False
    return batch.update(loss_mask=loss_mask).check(where="multi-turn batch")


def other_values_at_observations(batch: TensorBatch) -> TensorBatch:
    g = torch.Generator().manual_seed(1)
    obs = batch["response_mask"] & ~batch["loss_mask"]
    names = ("advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs")
    return batch.update({n: torch.where(obs, torch.randn(obs.shape, generator=g) * 2 - 3, batch[n]) for n in names})


def main() -> None:
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    path = tiny_model(TinyModelSpec(arch="qwen2", tied=True))
    spec = EngineSpec(str(path), "actor", parallel=ParallelSizes(tp=tp, pp=pp), optim=OptimConfig(lr=1e-3),
                      micro_batch_size=2, seed=1)
    batch = multi_turn()
    first = MegatronTrainingEngine(spec)
    out = first.forward(batch, ("log_probs", "entropy"))
    full = first.forward(batch.drop("loss_mask"), ("log_probs", "entropy"))
    batch = batch.update(old_log_probs=out["log_probs"], ref_log_probs=out["log_probs"],
                         rollout_log_probs=out["log_probs"])
    stats = GlobalBatchStats.of(batch)
    result: dict[str, Any] = {
        "loss_mask": batch["loss_mask"], "response_mask": batch["response_mask"],
        "out": {k: out[k] for k in ("log_probs", "entropy")}, "full": {k: full[k] for k in ("log_probs", "entropy")},
        "metrics": [first.forward_backward(batch, LOSS, stats)], "grads": [first.hf_state_dict(grads=True)],
    }
    second = MegatronTrainingEngine(spec)
    result["metrics"].append(second.forward_backward(other_values_at_observations(batch), LOSS, stats))
    result["grads"].append(second.hf_state_dict(grads=True))
    write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
