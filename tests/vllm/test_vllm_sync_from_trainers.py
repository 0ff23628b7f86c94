"""Weight sync from the hf and megatron training engines into the vLLM rollout engine.

Everything goes through the registry and the canonical stream. A tiny tied Qwen3 (QK norm; lm_head
shares the embedding and is not streamed): the rollout's log-probs equal the trainer's after a
first sync, and again after an optimizer step and a second sync. One rollout engine serves the
module; each trainer starts from the folder's weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm_testing import KV_CACHE_BYTES, MAX_PROMPT, MAX_RESPONSE, make_prompts, reference_log_probs

from verl_conformance.testkit import assert_close
from verl_core import (
    EngineSpec,
    GlobalBatchStats,
    LossOutput,
    ModelOutput,
    OptimConfig,
    RolloutEngine,
    SamplingParams,
    TensorBatch,
    TrainingEngine,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
)

PROMPTS = [[4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]
PARAMS = SamplingParams(temperature=0.7, max_new_tokens=12, n=2, seed=9)


class _NegLogLikelihood:
    """Mean negative log-likelihood of the response tokens over the global token count."""

    @property
    def needs(self) -> frozenset[ModelOutput]:
        return frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        mask = batch["response_mask"].float()
        loss = -(batch["log_probs"] * mask).sum() / max(stats.num_tokens, 1)
        return LossOutput(loss, {"nll": loss.detach()})


@pytest.fixture(scope="module")
def rollout(qwen3_tied_path: Path) -> Iterator[RolloutEngine]:
    spec = EngineSpec(
        str(qwen3_tied_path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE,
        options={"kv_cache_bytes": KV_CACHE_BYTES, "max_num_seqs": 32},
    )
    eng = get_rollout_engine("vllm", spec)
    yield eng
    eng.close()


@pytest.fixture(params=["hf", "megatron"])
def trainer(request: pytest.FixtureRequest, qwen3_tied_path: Path) -> Iterator[tuple[str, TrainingEngine]]:
    spec = EngineSpec(
        str(qwen3_tied_path), "actor", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE,
        optim=OptimConfig(lr=2e-2, grad_clip=0.0),
    )
    eng = get_training_engine(request.param, spec)
    yield request.param, eng
    eng.close()


def _parity(rollout_batch: TensorBatch, actor: TrainingEngine, what: str) -> float:
    trained = actor.forward(rollout_batch)["log_probs"]
    got = rollout_batch["rollout_log_probs"]
    assert_close(got, trained, dtype="float32", quantity="log_probs", what=what)
    mask = rollout_batch["response_mask"]
    mean_abs = float((got - trained).abs()[mask].mean())
    assert mean_abs < 1e-5, f"{what}: mean |diff| {mean_abs:.3g} >= 1e-5"
    return float((got - trained).abs().max())


def test_rollout_log_probs_track_the_trainer_across_a_step_and_a_sync(
    rollout: RolloutEngine, trainer: tuple[str, TrainingEngine], qwen3_tied_path: Path
) -> None:
    prompts = make_prompts(PROMPTS, [0, 1, 2])
    assert rollout.log_probs_exact(PARAMS)
    name, actor = trainer
    sync = get_weight_sync(name, "vllm")
    first = sync.sync(actor, rollout, version=10)
    assert first.version == 10 and rollout.weight_version == 10
    batch = rollout.generate(prompts, PARAMS)
    _parity(batch, actor, "after the first sync")
    assert_close(batch["rollout_log_probs"], reference_log_probs(qwen3_tied_path, batch),
                 dtype="float32", quantity="log_probs", what="after the first sync vs float64 reference")

    stats = GlobalBatchStats.of(batch)
    actor.forward_backward(batch, _NegLogLikelihood(), stats)
    step = actor.optimizer_step()
    assert not step.skipped

    # Until the sync, the rollout engine still serves the old policy.
    stale = actor.forward(batch)["log_probs"]
    assert float((stale - batch["rollout_log_probs"]).abs().max()) > 1e-3

    report = sync.sync(actor, rollout, version=11)
    assert report.version == 11 and report.num_tensors > 0 and report.bytes > 0
    assert rollout.weight_version == 11
    after = rollout.generate(prompts, PARAMS)
    assert after.meta.weight_version == 11
    _parity(after, actor, "after an optimizer step and a sync")
    # The step really changed the policy the rollout engine now serves.
    assert float(after["rollout_log_probs"][after["response_mask"]].mean()) != pytest.approx(
        float(batch["rollout_log_probs"][batch["response_mask"]].mean()), abs=1e-4
    )
    assert torch.isfinite(after["rollout_log_probs"]).all()
