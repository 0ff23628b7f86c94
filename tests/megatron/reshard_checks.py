"""Resharding checks at training TP=2 x PP=2 -> rollout TP=2 and TP=1, on 4 ranks.

Run by engine_checks.py in its TP=2 x PP=2 launch (shared with test_engine.py), or alone under
``torchrun --nproc_per_node 4``.

Each rank trains one step, then syncs two fresh rollout engines per rollout layout, one through the
direct path and one through the canonical stream, measuring the peak of memory each sync
allocates; both engines then generate the same seeded samples. Finally it runs the conformance
suite's trainer-to-rollout weight-sync check at the 4-rank layout through the registry (which picks
the direct path) and exercises the colocated switch (optimizer state offloaded, then back). It also
measures the peak memory of the canonical export stream alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from verl_conformance.checks import CHECKS
from verl_conformance.errors import CheckFailed, CheckSkipped
from verl_conformance.harness import Harness, Subject
from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model, write_rank_result
from verl_core import (
    EngineSpec,
    GlobalBatchStats,
    LossOutput,
    OptimConfig,
    ParallelSizes,
    SamplingParams,
    StreamWeightSync,
    TensorBatch,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
)
from verl_megatron.memory import peak_extra_bytes
from verl_megatron.reshard import MegatronDirectSync
from verl_megatron.rollout import MegatronRolloutEngine
from verl_megatron.training import MegatronTrainingEngine

TRAIN = ParallelSizes(tp=2, pp=2)
BUCKET = 12 * 1024
ROLLOUT_TPS = (2, 1)


class PG:
    """-mean(log_prob * advantage) over the global response tokens."""

    needs = frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        m = batch["response_mask"].float()
        return LossOutput(-(batch["log_probs"] * batch["advantages"] * m).sum() / max(stats.num_tokens, 1))


def train_step(actor: MegatronTrainingEngine) -> dict[str, float]:
    batch = random_batch(batch_size=4, max_prompt=6, max_response=5, seed=3, with_rl_fields=True)
    metrics = actor.forward_backward(batch, PG(), GlobalBatchStats.of(batch))
    actor.optimizer_step()
    return metrics


def compare_layouts(path: str, actor: MegatronTrainingEngine) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompts = random_batch(batch_size=3, max_prompt=6, max_response=1, seed=11).select(
        "prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(n=2, max_new_tokens=6, seed=5, temperature=0.9)
    for rtp in ROLLOUT_TPS:
        spec = EngineSpec(path, "rollout", parallel=ParallelSizes(tp=rtp, dp=4 // rtp), max_response_len=8)
        direct = get_rollout_engine("megatron", spec)
        canonical = get_rollout_engine("megatron", spec)
        assert isinstance(direct, MegatronRolloutEngine) and isinstance(canonical, MegatronRolloutEngine)
        sync = MegatronDirectSync(bucket_bytes=BUCKET)
        report, direct_peak = peak_extra_bytes(lambda s=sync, d=direct: s.sync(actor, d, version=1))
        creport, canonical_peak = peak_extra_bytes(
            lambda c=canonical: StreamWeightSync(BUCKET).sync(actor, c, version=1))
        plan = sync.plan(actor, direct)
        rank = dist.get_rank()
        same = all(torch.equal(a, b) for a, b in zip(direct.model.parameters(), canonical.model.parameters(),
                                                      strict=True))
        gd, gc = direct.generate(prompts, params), canonical.generate(prompts, params)
        out[f"tp{rtp}"] = {
            "params_equal": same,
            "versions": (direct.weight_version, canonical.weight_version),
            "direct": {k: gd[k] for k in ("response_ids", "response_mask", "rollout_log_probs")},
            "canonical": {k: gc[k] for k in ("response_ids", "response_mask", "rollout_log_probs")},
            "train_lp": actor.forward(gd)["log_probs"],
            "direct_peak": direct_peak,
            "canonical_peak": canonical_peak,
            "plan_peak": plan.peak_buffer_bytes(rank),
            "plan_received": plan.received_bytes(rank),
            "plan_remote": plan.received_bytes(rank, remote_only=True),
            "shard_bytes": sum(p.numel() * p.element_size() for p in direct.model.parameters()),
            "details": dict(report.details),
            "canonical_bytes": creport.bytes,
        }
        direct.close()
        canonical.close()
    return out


EXPORT_BUCKETS = (12 * 1024, 300 * 1024)


def export_peaks(actor: MegatronTrainingEngine) -> dict[str, Any]:
    """Peak tensor bytes export_weights allocates when the consumer drops each chunk after use."""
    def drain(stream: Any) -> int:
        n = 0
        for msg in stream:
            n += 1
            del msg  # a chunk is valid only until the next one is requested
        return n

    sizes = [torch.Size(actor.adapter.megatron_shape(n)).numel() * 4 for n in actor.adapter.megatron_names()]
    out: dict[str, Any] = {"largest": max(sizes), "model": sum(sizes)}
    for bucket in EXPORT_BUCKETS:
        for dtype in (None, torch.bfloat16):
            _, peak = peak_extra_bytes(lambda b=bucket, d=dtype: drain(actor.export_weights(bucket_bytes=b, dtype=d)))
            out[f"{bucket}-{dtype}"] = peak
    return out


def conformance_check() -> dict[str, str]:
    """The suite's trainer-to-rollout sync check at TP=2 x PP=2 -> TP=1 x 4, through the registry."""
    def training(spec: EngineSpec) -> Any:
        return get_training_engine("megatron", dataclasses.replace(spec, parallel=TRAIN))

    def rollout(spec: EngineSpec) -> Any:
        return get_rollout_engine("megatron", dataclasses.replace(spec, parallel=ParallelSizes(tp=1, dp=4)))

    subject = Subject("megatron", training, rollout, roles=frozenset({"actor", "rollout"}), registered=True)
    h = Harness(subject)
    results: dict[str, str] = {"sync": type(get_weight_sync("megatron", "megatron")).__name__}
    check = next(c for c in CHECKS.values() if c.name == "trainer_to_rollout_sync")
    try:
        check.func(h)
        results[check.name] = "passed"
    except CheckSkipped as e:
        results[check.name] = f"skipped: {e}"
    except CheckFailed as e:
        results[check.name] = f"failed: {e}"
    finally:
        h.close_fresh()
    return results


def run() -> dict[str, Any]:
    """Every check on this rank (4 ranks); returns what the tests compare."""
    path = str(tiny_model(TinyModelSpec(arch="qwen2", tied=True)))
    actor = MegatronTrainingEngine(EngineSpec(
        path, "actor", parallel=TRAIN, optim=OptimConfig(lr=1e-2), micro_batch_size=2,
        options={"during_rollout": "offload"}))
    train_step(actor)
    result: dict[str, Any] = {"export": export_peaks(actor), "layouts": compare_layouts(path, actor)}
    # colocated switch: the syncs above offloaded the optimizer state; the next step brings it back
    result["offloaded_after_sync"] = actor.training_state_offloaded
    metrics = train_step(actor)
    result["switch_metrics"] = {k: v for k, v in metrics.items() if k.startswith("switch_")}
    result["offloaded_after_step"] = actor.training_state_offloaded
    result["conformance"] = conformance_check()
    return result


def main() -> None:
    write_rank_result(run())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
