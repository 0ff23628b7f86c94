"""GPU validation of the hf backend (run on a CUDA machine; not collected by pytest).

Usage: ``python tests/hf/gpu_smoke.py OUT_DIR``. Checks on ``cuda``: log-probs against the float64
reference, a float32 and a bfloat16 training step, packed against padded bfloat16 micro-batches
(``varlen_attn``), offload/onload round trip, rollout log-probs against the actor after a weight sync, the rollout's sleep/wake round trip, and, with two or more GPUs, two-rank FSDP2 over NCCL
against one process. Prints one line per check and writes the lines to ``OUT_DIR/gpu_smoke.txt``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from hf_helpers import flat_grads, unpadded_reference  # noqa: E402

from verl_conformance.testkit import (  # noqa: E402
    TinyModelSpec,
    assert_close,
    build_tiny_model,
    launch_torchrun,
    random_batch,
)
from verl_core import (  # noqa: E402
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    SamplingParams,
    StreamWeightSync,
)
from verl_core.algorithms import Algorithm  # noqa: E402
from verl_core.enginekit.packed_attention import packed_attention_counts  # noqa: E402
from verl_hf.rollout import HFRolloutEngine  # noqa: E402
from verl_hf.training import HFTrainingEngine  # noqa: E402

LINES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    line = f"{'PASS' if ok else 'FAIL'} {name} {detail}"
    print(line, flush=True)
    LINES.append(line)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    path = str(build_tiny_model(tmp / "m", TinyModelSpec(arch="qwen3", tied=True)))
    loss = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
    batch = random_batch(batch_size=6, max_prompt=7, max_response=6, seed=1, with_rl_fields=True)
    try:
        actor = HFTrainingEngine(EngineSpec(model_path=path, role="actor", device="cuda",
                                            optim=OptimConfig(lr=1e-2, grad_clip=1.0)))
        report("data parallel mode", True, actor.data_parallel_mode)
        lp = actor.forward(batch, ["log_probs", "entropy"])
        ref = unpadded_reference(path, batch, ["log_probs", "entropy"])
        assert_close(lp["log_probs"], ref["log_probs"], dtype="float32", quantity="log_probs")
        assert_close(lp["entropy"], ref["entropy"], dtype="float32", quantity="entropy")
        report("cuda float32 log-probs/entropy vs float64 reference", True,
               f"max diff {float((lp['log_probs'].double() - ref['log_probs']).abs().max()):.2e}")
        b = batch.update(old_log_probs=lp["log_probs"])
        stats = GlobalBatchStats.of(b)
        before = actor.forward_backward(b, loss, stats)["loss"]
        step = actor.optimizer_step()
        after = actor.forward_backward(b, loss, stats)["loss"]
        actor.optimizer_step()
        report("cuda float32 step lowers loss", after < before and not step.skipped, f"{before:.4f} -> {after:.4f}")
        state = {k: v.clone() for k, v in actor.model.state_dict().items()}
        free0 = torch.cuda.memory_allocated()
        actor.offload()
        free1 = torch.cuda.memory_allocated()
        actor.onload()
        same = all(torch.equal(v, state[k]) for k, v in actor.model.state_dict().items())
        report("offload frees device memory and onload restores", same and free1 < free0,
               f"allocated {free0} -> {free1} bytes")
        rollout = HFRolloutEngine(EngineSpec(model_path=path, role="rollout", device="cuda", max_response_len=16))
        StreamWeightSync(bucket_bytes=32_768).sync(actor, rollout, version=2)
        prompts = batch.select("prompt_ids", "prompt_mask", "group_ids")
        gen = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=0, temperature=0.7, top_k=20))
        lp2 = actor.forward(gen)["log_probs"]
        assert_close(gen["rollout_log_probs"], lp2, dtype="float32", quantity="log_probs")
        report("cuda rollout log-probs == actor after sync", True, f"weight_version {rollout.weight_version}")
        # sleep/wake of a rollout whose weights live in one buffer (untied): pinned host memory and back
        untied = str(build_tiny_model(tmp / "untied", TinyModelSpec(arch="llama")))
        slept_engine = HFRolloutEngine(EngineSpec(model_path=untied, role="rollout", device="cuda",
                                                  max_response_len=16, options={"rollout_cache": "static"}))
        params = SamplingParams(n=2, max_new_tokens=8, seed=0)
        first = slept_engine.generate(prompts, params)
        weights = {n: p.detach().clone() for n, p in slept_engine.model.named_parameters()}
        awake = torch.cuda.memory_allocated()
        for _ in range(2):  # the second sleep reuses the pinned buffer
            slept_engine.sleep()
            asleep = torch.cuda.memory_allocated()
            slept_engine.wake()
        again = slept_engine.generate(prompts, params)
        restored = all(p.is_cuda and torch.equal(p, weights[n]) for n, p in slept_engine.model.named_parameters())
        report("rollout sleep frees device memory, wake restores the one-buffer weights",
               restored and asleep < awake and slept_engine._flat is not None
               and torch.equal(first["response_ids"], again["response_ids"]),
               f"allocated {awake} -> {asleep} bytes; same samples after wake")
        bf = HFTrainingEngine(EngineSpec(model_path=path, role="actor", device="cuda", dtype="bfloat16",
                                         optim=OptimConfig(lr=1e-2, grad_clip=1.0), micro_batch_size=2))
        lpb = bf.forward(batch)
        assert_close(lpb["log_probs"], ref["log_probs"], dtype="bfloat16", quantity="log_probs")
        bb = batch.update(old_log_probs=lpb["log_probs"])
        before = bf.forward_backward(bb, loss, stats)["loss"]
        step = bf.optimizer_step()
        after = bf.forward_backward(bb, loss, stats)["loss"]
        report("cuda bfloat16 step lowers loss", after < before and not step.skipped, f"{before:.4f} -> {after:.4f}")
        # packed micro-batches (on by default here: bfloat16 on CUDA) against padded ones
        runs = {}
        for pack in (False, True):
            e = HFTrainingEngine(EngineSpec(model_path=path, role="actor", device="cuda", dtype="bfloat16",
                                            micro_batch_size=3, options={"pack_sequences": pack}))
            out = e.forward(bb, ["log_probs", "entropy"])
            e.forward_backward(bb, loss, stats)
            runs[pack] = (e.packs_sequences, out, flat_grads(e.model))
        counts = packed_attention_counts()
        for name in ("log_probs", "entropy"):
            assert_close(runs[True][1][name], runs[False][1][name], dtype="bfloat16", quantity=name)
        assert_close(runs[True][2], runs[False][2], dtype="bfloat16", quantity="grad")
        report("cuda bfloat16 packed == padded (log-probs, entropy, grads)",
               bf.packs_sequences and runs[True][0] and not runs[False][0] and counts["varlen_attn"] > 0,
               f"packed attention calls {counts}; log-prob max diff "
               f"{float((runs[True][1]['log_probs'] - runs[False][1]['log_probs']).abs().max()):.2e}")
    except Exception as e:  # report and continue to the multi-GPU part
        report("single-GPU checks", False, f"{type(e).__name__}: {e}")
    if torch.cuda.device_count() >= 2:
        try:
            ranks = launch_torchrun(HERE / "dp_worker.py", 2, [path, "30", "fsdp2", "allreduce"],
                                    timeout=300, env={"VERL_HF_TEST_DEVICE": "cuda"})
            one = HFTrainingEngine(EngineSpec(model_path=path, role="actor", device="cuda",
                                              optim=OptimConfig(lr=1e-3, grad_clip=1.0)))
            from dp_worker import global_batch

            g = global_batch()
            one.forward_backward(g, Algorithm.grpo(kl_loss_coef=0.01).actor_loss, GlobalBatchStats.of(g))
            grads = {n: p.grad.detach().cpu() for n, p in one.model.named_parameters()}
            for mode in ("fsdp2", "allreduce"):
                worst = 0.0
                for r in ranks:
                    for n, gr in grads.items():
                        rel = float((r[mode]["grads"][n] - gr).norm() / gr.norm().clamp_min(1e-30))
                        worst = max(worst, rel)
                report(f"2-GPU {mode} (NCCL) grads == one process", worst < 1e-3 and ranks[0][mode]["mode"] == mode,
                       f"worst relative L2 {worst:.2e}")
        except Exception as e:
            report("2-GPU data parallel", False, f"{type(e).__name__}: {str(e)[-2000:]}")
    (out_dir / "gpu_smoke.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    main()
