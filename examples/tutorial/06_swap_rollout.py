"""Step 6: swap the rollout engine in one line of config.

The same run (task, model, GRPO, evaluation, transformers actor) with transformers, vLLM and
Megatron generating. Only ``backends.rollout`` changes; the trainer syncs the actor's weights into
whichever engine it is. transformers and Megatron share the SDK's per-sample seeded sampling, so
on the same weights they draw the same samples and the two runs are identical step for step.

    python examples/tutorial/06_swap_rollout.py
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from verl_core.trainer import RunConfig, Trainer, load_config

RUN = [
    "steps=2", "seed=0", "task.name=copy", "task.digits=1", "task.reward=partial",
    "task.eval_prompts=4", "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0",
    "rollout.n=4", "rollout.max_new_tokens=3", "batch.prompts_per_step=4",
    "model.hidden_size=64", "model.intermediate_size=64", "model.num_heads=2", "model.num_kv_heads=2",
    "logging.progress=false", "logging.plot=false", "checkpoint.final=false",
]


def run(config: RunConfig) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    with Trainer(config) as trainer:
        trainer.setup()
        first = trainer.rollout.generate(trainer.prompts(0), trainer.sampling_params())
        history = trainer.train()
    return history, {k: first[k] for k in ("response_ids", "response_mask", "rollout_log_probs")}


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for backend in ("hf", "vllm", "megatron"):
            config = load_config(None, [*RUN, f"output_dir={out}/{backend}",
                                        f"backends.rollout={backend}"])  # <- the one line that changes
            results[backend] = run(config)
            history, first = results[backend]
            print(f"rollout={backend:<8} " + "  ".join(
                f"step {m['step']}: entropy {m['actor/entropy']:.4f} length {m['response/length_mean']:.2f}"
                for m in history))

    keys = {b: [sorted(k for k in m if not k.startswith(("time/", "throughput/"))) for m in h]
            for b, (h, _) in results.items()}
    assert keys["hf"] == keys["vllm"] == keys["megatron"]  # the same metrics, whatever generates
    for backend, (history, first) in results.items():
        assert [m["weight_version"] for m in history] == [1, 2], backend  # weights synced every step
        assert "eval/exact_match" in history[-1], backend
        # every engine's log-probs are those of the policy the actor trains (T=1, no truncation)
        assert all(m["logprob_mismatch/mean"] < 1e-3 for m in history), backend
        assert bool((first["rollout_log_probs"] <= 0).all())
        assert bool((first["response_mask"][:, 1:] <= first["response_mask"][:, :-1]).all())  # right-padded
        assert first["response_ids"].dtype == torch.int64 and first["response_mask"].dtype == torch.bool
        assert first["response_ids"].shape[0] == 16 and first["rollout_log_probs"].shape == first["response_ids"].shape
    hf, megatron = results["hf"], results["megatron"]
    assert torch.equal(hf[1]["response_ids"], megatron[1]["response_ids"])  # the same samples
    torch.testing.assert_close(hf[1]["rollout_log_probs"], megatron[1]["rollout_log_probs"], atol=1e-4, rtol=0)
    for a, b in zip(hf[0], megatron[0], strict=True):  # same samples -> the same training steps
        for key in a:
            if key.startswith(("reward/", "response/", "actor/", "eval/")):
                assert a[key] == b[key], (key, a[key], b[key])
    print("hf and megatron runs are identical; vllm runs the same pipeline with its own sampler")


if __name__ == "__main__":
    main()
