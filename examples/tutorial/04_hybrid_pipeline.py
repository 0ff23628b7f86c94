"""Step 4: a HybridPipeline of three stages with declared dependencies.

Actor rollout -> critic evaluation -> buffer processing (score, GAE advantages, add to the replay
buffer). Each stage names the values it reads and writes; the pipeline checks the graph when it is
built, runs every stage as soon as its inputs are ready, and times each one.

    python examples/tutorial/04_hybrid_pipeline.py
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_conformance.testkit import tiny_model
from verl_core import (
    Algorithm,
    EngineSpec,
    SamplingParams,
    TensorBatch,
    get_rollout_engine,
    get_training_engine,
)
from verl_core.trainer import HybridPipeline, HybridReplayBuffer, PipelineError, Stage, prompt_batch
from verl_core.trainer.inputs.rewards import RewardFunctions


def digits_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Share of each completion's characters that are digits (the call of ``reward.functions``)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def main() -> None:
    torch.manual_seed(0)
    folder = str(tiny_model())
    rollout = get_rollout_engine("hf", EngineSpec(model_path=folder, role="rollout", max_response_len=8))
    critic = get_training_engine("hf", EngineSpec(model_path=folder, role="critic", max_response_len=8))
    reward = RewardFunctions([digits_reward], rollout.tokenizer)
    algorithm = Algorithm.ppo(kl_coef=0.0, lam=0.95)
    buffer = HybridReplayBuffer(memory_samples=64)
    params = SamplingParams(max_new_tokens=6, n=4, seed=0)

    def actor_rollout(prompts: TensorBatch) -> Mapping[str, Any]:
        return {"samples": rollout.generate(prompts, params)}

    def critic_evaluation(samples: TensorBatch) -> Mapping[str, Any]:
        return {"values": critic.forward(samples, ["values"])["values"]}

    def buffer_processing(samples: TensorBatch, values: torch.Tensor) -> Mapping[str, Any]:
        scored = reward.score(samples).update(values=values, old_values=values)
        batch = algorithm.compute_advantages(scored)
        buffer.add(batch)
        return {"advantages": batch["advantages"], "buffered": len(buffer)}

    pipeline = HybridPipeline(
        [
            Stage("buffer_processing", buffer_processing, inputs=("samples", "values"),
                  outputs=("advantages", "buffered")),
            Stage("critic_evaluation", critic_evaluation, inputs=("samples",), outputs=("values",)),
            Stage("actor_rollout", actor_rollout, inputs=("prompts",), outputs=("samples",)),
        ],
        inputs=("prompts",),
    )
    # the order comes from the declared inputs and outputs, not from the list
    assert pipeline.stages == ("actor_rollout", "critic_evaluation", "buffer_processing")

    for step in range(2):
        prompts = prompt_batch(["c12=", "r34=", "a1+2="], rollout.tokenizer,
                               group_ids=[3 * step + i for i in range(3)])
        result = pipeline.run(prompts=prompts)
        print(f"step {step}: " + "  ".join(f"{k} {v * 1000:.1f} ms" for k, v in result.timings.items()))
        assert set(result.timings) == {"time/actor_rollout", "time/critic_evaluation",
                                       "time/buffer_processing", "time/pipeline"}
        assert result.timings["time/pipeline"] >= result.timings["time/actor_rollout"]
        samples: TensorBatch = result["samples"]
        advantages: torch.Tensor = result["advantages"]
        assert samples.batch_size == 12 and advantages.shape == samples["response_mask"].shape
        assert bool(torch.isfinite(advantages).all())
        assert bool((advantages[~samples["response_mask"]] == 0).all())
        assert result["buffered"] == 12 * (step + 1)
    assert len(buffer) == 24 and buffer.sample(8, seed=0).batch_size == 8

    try:  # a stage whose input nobody produces is rejected when the pipeline is built
        HybridPipeline([Stage("buffer_processing", buffer_processing, inputs=("samples", "values"))],
                       inputs=("prompts",))
    except PipelineError as e:
        print(f"rejected as expected: {e}")
    else:
        raise AssertionError("a pipeline with a missing input was accepted")


if __name__ == "__main__":
    main()
