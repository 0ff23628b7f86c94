"""A two-rank hf actor (data parallel over gloo) in a Ray worker group matches one process.

Also: two rollout replicas share the prompts and sample what one engine samples, and the split
weight sync (two actor ranks, two rollout readers) leaves every replica with the actor's weights;
two reward-model replicas score what one engine scores.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model
from verl_core import (
    BatchValidationError,
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    SamplingParams,
    TensorBatch,
)
from verl_core.algorithms import Algorithm
from verl_core.kernel.registry import (
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
)
from verl_core.kernel.weights import WeightChunk, WeightMessage
from verl_core.trainer.executor import RayConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
]


def _weights(stream: Any) -> dict[str, torch.Tensor]:
    msgs: list[WeightMessage] = list(stream)
    return {n: t.clone() for m in msgs if isinstance(m, WeightChunk) for n, t in m.tensors}


def _one_step(engine: Any, batch: TensorBatch) -> dict[str, Any]:
    loss = Algorithm.grpo(kl_loss_coef=0.01).actor_loss
    log_probs = engine.forward(batch)["log_probs"]
    metrics = engine.forward_backward(batch, loss, GlobalBatchStats.of(batch))
    step = engine.optimizer_step()
    return {"log_probs": log_probs, "metrics": metrics, "grad_norm": step.grad_norm,
            "weights": _weights(engine.export_weights())}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model(TinyModelSpec(arch="llama", tied=False)))


def test_two_rank_group_matches_one_process_and_syncs_two_replicas(ray_cluster: Any, model: str) -> None:
    from verl_core.trainer.executor.ray_executor import RayExecutor

    # eps=1: Adam's first step is then linear in the gradient, so float rounding stays rounding
    spec = EngineSpec(model_path=model, role="actor", optim=OptimConfig(lr=0.1, eps=1.0, grad_clip=1.0),
                      max_prompt_len=16, max_response_len=16)
    # 7 samples: the data-parallel shares are 4 and 3, one response empty
    batch = random_batch(batch_size=7, max_prompt=7, max_response=6, seed=11, with_rl_fields=True, empty_responses=1)
    local = _one_step(get_training_engine("hf", spec), batch)

    # 6 workers (actor, rollout and reward, two each) x 0.33 CPU fit the 2-CPU cluster
    ex = RayExecutor(RayConfig(num_cpus_per_worker=0.33,
                               parallel={"actor": {"dp": 2}, "rollout": {"dp": 2}, "reward": {"dp": 2}}))
    try:
        actor = ex.training_engine("actor", "hf", spec)
        group = ex.worker_group("actor")
        assert group.world == 2 and len(set(group.pids())) == 2
        # an error raised inside a worker arrives as itself, saying where it was raised
        with pytest.raises(BatchValidationError, match="response_mask") as info:
            actor.forward(batch.drop("response_mask"))
        assert any("of role 'actor'" in note for note in getattr(info.value, "__notes__", []))
        remote = _one_step(actor, batch)
        # the shards (4 and 3 samples, their own padding widths) round in float32 on their own: a few ulps
        torch.testing.assert_close(remote["log_probs"], local["log_probs"], rtol=1e-6, atol=1e-6)
        for key, value in local["metrics"].items():
            if key != "num_micro_batches":
                assert remote["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert remote["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-5)
        assert sorted(remote["weights"]) == sorted(local["weights"])
        for name, w in local["weights"].items():
            torch.testing.assert_close(remote["weights"][name], w, rtol=0, atol=1e-6, msg=name)

        # rollout: two replicas, each sampling its share of the prompts
        rollout_spec = EngineSpec(model_path=model, role="rollout", max_prompt_len=16, max_response_len=6)
        rollout = ex.rollout_engine("hf", rollout_spec)
        assert len(ex.worker_pids("rollout")) == 2
        report = ex.weight_sync("hf", "hf").sync(actor, rollout, version=1)
        assert report.version == 1 and report.bytes > 0
        assert rollout.weight_version == 1
        one = get_rollout_engine("hf", rollout_spec)
        one.update_weights(actor.export_weights(dtype=one.weight_dtype))
        prompts = random_batch(batch_size=5, max_prompt=6, max_response=1, seed=3).select(
            "prompt_ids", "prompt_mask", "group_ids")
        params = SamplingParams(max_new_tokens=6, n=2, seed=7)
        got, want = rollout.generate(prompts, params), one.generate(prompts, params)
        assert got.batch_size == want.batch_size == 10
        for name in ("response_ids", "response_mask", "group_ids", "sample_index"):
            assert torch.equal(got[name], want[name]), name
        torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], rtol=0, atol=1e-5)

        # reward model: two replicas score their shares; the scores are one engine's
        reward_spec = EngineSpec(model_path=str(tiny_model(TinyModelSpec(arch="llama", head="reward"))), role="reward",
                                 max_prompt_len=16, max_response_len=16)
        reward = ex.reward_engine("hf", reward_spec)
        assert len(ex.worker_pids("reward")) == 2
        scored = reward.score(batch)
        torch.testing.assert_close(scored["scores"], get_reward_engine("hf", reward_spec).score(batch)["scores"],
                                   rtol=0, atol=1e-5)
        assert torch.equal(scored["response_ids"], batch["response_ids"])
    finally:
        ex.close()


def test_a_group_the_cluster_cannot_place_fails_clearly(ray_cluster: Any, model: str) -> None:
    from verl_core.kernel.errors import ConfigError
    from verl_core.trainer.executor.ray_executor import RayExecutor

    ex = RayExecutor(RayConfig(parallel={"actor": {"dp": 3}}, placement_timeout_s=2))
    try:
        with pytest.raises(ConfigError, match=r"could not place worker group 'actor': it needs 3 bundle\(s\) of \{'CPU': 1.0\}"):
            ex.training_engine("actor", "hf", EngineSpec(model_path=model, role="actor"))
    finally:
        ex.close()



def test_a_build_error_arrives_as_itself_and_gives_the_bundles_back(ray_cluster: Any, model: str) -> None:
    import time

    from verl_core.kernel.errors import UnknownNameError
    from verl_core.trainer.executor.ray_executor import RayExecutor

    ex = RayExecutor(RayConfig(num_cpus_per_worker=2))
    try:
        with pytest.raises(UnknownNameError, match="'no-such-backend'"):
            ex.training_engine("actor", "no-such-backend", EngineSpec(model_path=model, role="actor"))
        assert ex.placed_roles() == []
        for _ in range(100):  # placement groups are removed asynchronously
            if ray_cluster.available_resources().get("CPU") == 2:
                break
            time.sleep(0.1)
        assert ray_cluster.available_resources().get("CPU") == 2
    finally:
        ex.close()


@pytest.mark.skipif(
    os.environ.get("VERL_TEST_RAY_MEGATRON") != "1",
    reason="opt-in (about a minute on 2 cores): set VERL_TEST_RAY_MEGATRON=1",
)
def test_megatron_tensor_parallel_group_matches_the_reference(ray_cluster: Any, model: str) -> None:
    from verl_core.trainer.executor.ray_executor import RayExecutor

    spec = EngineSpec(model_path=model, role="actor", optim=OptimConfig(lr=0.1, eps=1.0),
                      max_prompt_len=16, max_response_len=16)
    batch = random_batch(batch_size=4, max_prompt=7, max_response=6, seed=11, with_rl_fields=True)
    want = get_training_engine("hf", spec).forward(batch)["log_probs"]
    ex = RayExecutor(RayConfig(parallel={"actor": {"tp": 2}}))
    try:
        actor = ex.training_engine("actor", "megatron", spec)
        assert ex.worker_group("actor").world == 2
        torch.testing.assert_close(actor.forward(batch)["log_probs"], want, rtol=0, atol=1e-5)
        metrics = actor.forward_backward(batch, Algorithm.grpo(kl_loss_coef=0.01).actor_loss, GlobalBatchStats.of(batch))
        assert metrics["loss"] == metrics["loss"]  # finite, returned from rank 0
        assert not actor.optimizer_step().skipped
        assert sorted(_weights(actor.export_weights())) == sorted(_weights(get_training_engine("hf", spec).export_weights()))
    finally:
        ex.close()
