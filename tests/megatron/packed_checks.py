"""Launched under torchrun by test_packed_megatron.py: packed against padded micro-batches.

Usage: ``packed_checks.py TP``. For an actor (qwen3: QK-norm, grouped query heads) and a critic
(qwen2: QKV bias, value head), two float32 engines of one spec, one with
``pack_sequences=False`` and one with ``pack_sequences=True``, run ``forward`` and one update
(``forward_backward`` + ``optimizer_step``) on the same ragged batch (one empty response) under
the same token budget; every rank writes their outputs, losses, grad norms, gradients and
updated weights, and the default (auto) choice on CPU.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from engine_checks import TokenMeanPG, TokenMeanValue

from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model, write_rank_result
from verl_core import (
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    ParallelSizes,
    TensorBatch,
)
from verl_core.enginekit.packed_attention import packed_attention_counts
from verl_megatron.training import MegatronTrainingEngine

BUDGET = 40


def ragged_batch() -> TensorBatch:
    return random_batch(batch_size=7, max_prompt=8, max_response=7, seed=11, with_rl_fields=True,
                        temperature=0.7, empty_responses=1)


def run(role: str, tp: int, pack: bool | None) -> dict[str, Any]:
    head = "value" if role == "critic" else "causal_lm"
    path = tiny_model(TinyModelSpec(arch="qwen2" if role == "critic" else "qwen3", head=head))
    spec = EngineSpec(str(path), role, parallel=ParallelSizes(tp=tp), optim=OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.5),
                      micro_batch_tokens=BUDGET, seed=3, options={"pack_sequences": pack})
    eng = MegatronTrainingEngine(spec)
    batch = ragged_batch()
    outputs = ("values",) if role == "critic" else ("log_probs", "entropy")
    before = packed_attention_counts()["sdpa_loop"]
    out = eng.forward(batch, outputs)
    loss = TokenMeanValue() if role == "critic" else TokenMeanPG()
    metrics = eng.forward_backward(batch, loss, GlobalBatchStats.of(batch))
    grads = eng.hf_state_dict(grads=True)
    step = eng.optimizer_step()
    result = {
        "packs": eng.packs_sequences, "declared": eng.capabilities.packed_sequences,
        "outputs": {k: out[k] for k in outputs}, "metrics": metrics, "grad_norm": step.grad_norm,
        "grads": grads, "weights": eng.hf_state_dict(), "packed_calls": packed_attention_counts()["sdpa_loop"] - before,
    }
    eng.close()
    return result


def main() -> None:
    tp = int(sys.argv[1])
    result: dict[str, Any] = {"mask": ragged_batch()["response_mask"]}
    for role in ("actor", "critic"):
        result[role] = {"padded": run(role, tp, False), "packed": run(role, tp, True)}
    result["auto"] = run("actor", tp, None)["packs"]  # float32 on CPU: off
    write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
