"""A LoRA actor (hf, EngineSpec.lora) syncs merged weights into the vLLM rollout engine.

vLLM does not declare ``lora_adapters``, so the stream carries ``W + alpha / rank * B A`` of every
target, merged tensor by tensor; after an update that moved the adapter the rollout's log-probs
equal the actor's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_testing import KV_CACHE_BYTES, MAX_PROMPT, MAX_RESPONSE, make_prompts

from verl_conformance.testkit import assert_close
from verl_core import (
    EngineSpec,
    GlobalBatchStats,
    LoraSpec,
    OptimConfig,
    SamplingParams,
    get_backend,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
)
from verl_core.algorithms import Algorithm

PARAMS = SamplingParams(temperature=0.7, max_new_tokens=10, n=2, seed=4)

pytestmark = [pytest.mark.slow]


def test_lora_actor_syncs_merged_weights_into_vllm(qwen3_tied_path: Path) -> None:
    assert not get_backend("vllm").capabilities("rollout").lora_adapters  # type: ignore[union-attr]
    limits = {"max_prompt_len": MAX_PROMPT, "max_response_len": MAX_RESPONSE}
    actor = get_training_engine("hf", EngineSpec(str(qwen3_tied_path), "actor", optim=OptimConfig(lr=5e-2, grad_clip=0.0),
                                                 lora=LoraSpec(rank=4, alpha=8.0), **limits))  # type: ignore[arg-type]
    rollout = get_rollout_engine("vllm", EngineSpec(str(qwen3_tied_path), "rollout", **limits,  # type: ignore[arg-type]
                                                    options={"kv_cache_bytes": KV_CACHE_BYTES, "max_num_seqs": 32}))
    try:
        batch = rollout.generate(make_prompts([[4, 5, 6, 7], [9, 10], [11, 12, 13]], [0, 1, 2]), PARAMS)
        batch = batch.update(old_log_probs=actor.forward(batch)["log_probs"],
                             advantages=batch["response_mask"].float() * 1.0)
        loss = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
        actor.forward_backward(batch, loss, GlobalBatchStats.of(batch))
        assert not actor.optimizer_step().skipped
        moved = actor.forward(batch)["log_probs"]
        assert float((moved - actor.base_forward(batch)["log_probs"]).abs().max()) > 1e-3
        report = get_weight_sync("hf", "vllm").sync(actor, rollout, version=1)
        assert report.version == 1 and rollout.weight_version == 1
        after = rollout.generate(batch.select("prompt_ids", "prompt_mask", "group_ids").index([0, 2, 4]), PARAMS)
        assert_close(after["rollout_log_probs"], actor.forward(after)["log_probs"], dtype="float32",
                     quantity="log_probs", what="vLLM after a merged LoRA sync vs the LoRA actor")
    finally:
        rollout.close()
        actor.close()
