"""Step 5: a DynamicBatchScheduler keeps a loop running while memory comes and goes.

The scheduler sizes micro-batches (padded tokens per micro-batch) from the free memory its probe
reports. Here the probe is simulated: halfway through, something else takes most of the memory,
and once it even takes memory between the probe and the forward, so the forward runs out of memory.
The scheduler shrinks the micro-batches, splits and retries the one that failed, grows back when
memory returns, and every sample is computed exactly once in every step.

    python examples/tutorial/05_dynamic_batches.py
"""

from __future__ import annotations

import torch

from verl_conformance.testkit import tiny_model
from verl_core import (
    EngineSpec,
    SamplingParams,
    TensorBatch,
    get_rollout_engine,
    get_training_engine,
)
from verl_core.trainer import DynamicBatchScheduler, MemoryInfo, SchedulerConfig, prompt_batch

MiB = 1 << 20
BYTES_PER_TOKEN = 1024


class SimulatedMemory:
    """A memory probe whose free bytes the loop sets (a stand-in for another process's allocations)."""

    def __init__(self) -> None:
        self.free = 4 * MiB  # what the probe reports
        self.really_free = 4 * MiB  # what a forward can actually use

    def __call__(self) -> MemoryInfo:
        return MemoryInfo(free_bytes=self.free, total_bytes=8 * MiB)


def main() -> None:
    folder = str(tiny_model())
    rollout = get_rollout_engine("hf", EngineSpec(model_path=folder, role="rollout", max_response_len=8))
    actor = get_training_engine("hf", EngineSpec(model_path=folder, role="actor", max_response_len=8))
    prompts = prompt_batch(["c1=", "c12=", "c123=", "r4567=", "a1+2=", "hello"], rollout.tokenizer,
                           group_ids=range(6))
    batch = rollout.generate(prompts, SamplingParams(max_new_tokens=6, n=4, seed=0))
    expected = actor.forward(batch, ("log_probs",))["log_probs"]  # the whole batch at once

    memory = SimulatedMemory()
    scheduler = DynamicBatchScheduler(
        SchedulerConfig(min_tokens=8, max_tokens=4096, bytes_per_token=BYTES_PER_TOKEN, memory_fraction=0.5,
                        grow_after=4),
        probe=memory,
    )

    def forward(micro: TensorBatch) -> TensorBatch:
        tokens = micro.batch_size * int(micro.seq_lengths().max())
        if tokens * BYTES_PER_TOKEN > memory.really_free * 0.5:
            raise torch.OutOfMemoryError(f"simulated: {tokens} tokens do not fit")
        return actor.forward(micro, ("log_probs",))

    # free memory the probe sees / the forward gets, per step (MiB)
    schedule = [(4, 4), (4, 4), (0.0625, 0.0625), (0.0625, 0.0625), (4, 0.03), (4, 4), (4, 4), (4, 4)]
    history = []
    for step, (seen, real) in enumerate(schedule):
        memory.free, memory.really_free = int(seen * MiB), int(real * MiB)
        out = scheduler.run_forward(batch, forward, key=f"step{step}/actor/forward")
        torch.testing.assert_close(out["log_probs"], expected, atol=1e-5, rtol=0)  # every sample, in order
        decision = scheduler.plan[-1]
        history.append((len(decision.groups), decision.budget, decision.ooms))
        print(f"step {step}: free {seen:>6} MiB -> budget {decision.budget:>4} tokens, "
              f"{len(decision.groups):>2} micro-batches, {decision.ooms} OOMs handled")

    micro_batches = [m for m, _, _ in history]
    budgets = [b for _, b, _ in history]
    assert len(history) == len(schedule)  # the loop never stopped
    assert micro_batches[0] == 1 and micro_batches[2] > micro_batches[0]  # memory taken: smaller pieces
    assert budgets[2] < budgets[0]
    assert history[4][2] > 0  # the spike ran out of memory, was split and retried
    assert budgets[-1] > budgets[4]  # memory came back: the budget grew again
    assert scheduler.metrics()["scheduler/ooms"] == history[4][2]


if __name__ == "__main__":
    main()
