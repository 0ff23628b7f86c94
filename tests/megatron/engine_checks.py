"""Launched under torchrun by test_engine.py: runs the Megatron engine at one TP/PP layout.

Every rank writes its results; the test compares layouts with each other and with the float64
transformers reference. Usage: ``engine_checks.py TP PP DP CKPT_DIR NAMES [LOADS]`` where NAMES
is a comma-separated subset of the actor archs, ``critic``, ``errors``, ``rollout`` and
``reshard`` (reshard_checks.py, at TP=2 x PP=2); the first actor saves
a checkpoint to CKPT_DIR and checks its round trip. LOADS (``arch=dir;arch=dir``) names
checkpoints saved by other layouts to restore and train on here; ``megatron_optimizer`` compares
megatron-core's optimizer with torch's AdamW (``optimizer_checks``).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model, write_rank_result
from verl_core import (
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LossOutput,
    OptimConfig,
    ParallelSizes,
    SamplingParams,
    TensorBatch,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    dp_shard,
    get_rollout_engine,
    get_training_engine,
)
from verl_megatron.training import MegatronTrainingEngine

ACTORS = (("llama", False, 1.0), ("qwen2", True, 0.7), ("qwen3", False, 1.0))

# What each layout (tp, pp, dp) runs; TP=1 runs everything: it is the baseline of the others. TP=2
# exercises QK-norm gradients and the replicated value head, TP=2xPP=2 QKV-bias sharding with a
# tied embedding split across stages (and the resharding checks of test_reshard.py), DP=2 gradient
# summation over data-parallel ranks. TP=1 also restores the checkpoints TP=2 and PP=2 saved.
RUNS: dict[tuple[int, int, int], tuple[str, ...]] = {
    (2, 1, 1): ("qwen3", "critic", "rollout", "megatron_optimizer"),
    (1, 2, 1): ("qwen2", "critic", "megatron_optimizer"),
    (2, 2, 1): ("qwen2", "reshard", "bf16_ckpt"),
    (1, 1, 2): ("qwen2", "accumulate", "megatron_optimizer"),
    (1, 1, 1): ("llama", "qwen2", "qwen3", "critic", "errors", "rollout"),
}
CROSS_LOADS = {(2, 1, 1): "qwen3", (1, 2, 1): "qwen2"}
BASE = (1, 1, 1)
# TP=2 x PP=2 saves a bfloat16 checkpoint with float32 masters; TP=1 restores it.
BF16_SAVER = (2, 2, 1)
# TP=2 saves a checkpoint of megatron-core's optimizer; DP=2 restores it into the distributed one.
MEGATRON_SAVER, MEGATRON_LOADER = (2, 1, 1), (1, 1, 2)
NOT_ACTORS = ("errors", "rollout", "reshard", "accumulate", "bf16_ckpt", "megatron_optimizer")


class TokenMeanPG:
    """-mean(log_prob * advantage) - 0.01 * mean(entropy) over the global response tokens."""

    needs = frozenset({"log_probs", "entropy"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        m = batch["response_mask"].float()
        n = max(stats.num_tokens, 1)
        pg = -(batch["log_probs"] * batch["advantages"] * m).sum() / n
        ent = (batch["entropy"] * m).sum() / n
        return LossOutput(pg - 0.01 * ent, {"pg": pg.detach(), "entropy": ent.detach()})


class TokenMeanValue:
    """0.5 * mean((value - return)^2) over the global response tokens."""

    needs = frozenset({"values"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        m = batch["response_mask"].float()
        err = (batch["values"] - batch["returns"]) * m
        return LossOutput(0.5 * err.pow(2).sum() / max(stats.num_tokens, 1))


def actor_batch(seed: int, temperature: float) -> TensorBatch:
    return random_batch(batch_size=5, max_prompt=6, max_response=5, seed=seed, with_rl_fields=True,
                        temperature=temperature, empty_responses=1)


def collect(stream: Any) -> dict[str, torch.Tensor]:
    msgs = list(stream)
    assert isinstance(msgs[0], WeightManifest) and isinstance(msgs[-1], WeightCommit)
    out: dict[str, torch.Tensor] = {}
    for m in msgs[1:-1]:
        assert isinstance(m, WeightChunk)
        out.update({n: t.clone() for n, t in m.tensors})
    assert set(out) == set(msgs[0].tensors), "stream names differ from the manifest"
    return out


def main() -> None:
    tp, pp, dp, ckpt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    names = sys.argv[5].split(",")
    loads = [x for x in (sys.argv[6] if len(sys.argv) > 6 else "").split(";") if x]
    par = ParallelSizes(tp=tp, pp=pp, dp=dp)
    dp_rank = int(os.environ["RANK"]) // (tp * pp)
    # eps well above gradient rounding noise keeps Adam's first update a smooth function of the
    # gradient (with eps=1e-8 it is ~lr * sign(g), which float noise flips for tiny g).
    optim = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.5)
    result: dict[str, Any] = {}
    first = True
    actors = {a: (i, tied, temp) for i, (a, tied, temp) in enumerate(ACTORS)}
    for arch in names:
        if arch not in actors:
            continue
        i, tied, temp = actors[arch]
        path = tiny_model(TinyModelSpec(arch=arch, tied=tied))
        spec = EngineSpec(str(path), "actor", parallel=par, optim=optim, micro_batch_size=2, seed=1)
        eng = MegatronTrainingEngine(spec)
        batch = actor_batch(i, temp)
        out = eng.forward(batch, ("log_probs", "entropy"))
        r: dict[str, Any] = {"log_probs": out["log_probs"], "entropy": out["entropy"]}
        r["export"] = collect(eng.export_weights(bucket_bytes=20_000))
        metrics = eng.forward_backward(dp_shard(batch, dp_rank, dp), TokenMeanPG(), GlobalBatchStats.of(batch))
        r["loss"] = metrics["loss"]
        r["pg"] = metrics["pg"]
        r["num_micro_batches"] = metrics["num_micro_batches"]
        r["grads"] = eng.hf_state_dict(grads=True)
        step = eng.optimizer_step()
        r["grad_norm"], r["skipped"] = step.grad_norm, step.skipped
        r["after"] = eng.hf_state_dict()
        if first:
            # Checkpoint round trip at this layout: the restored engine must forward and train on
            # exactly like the original (weights, Adam moments and step restored).
            first = False
            eng.save_checkpoint(ckpt)
            fresh = MegatronTrainingEngine(spec)
            fresh.load_checkpoint(ckpt)
            r["ckpt_lp"] = (eng.forward(batch)["log_probs"], fresh.forward(batch)["log_probs"])
            r["ckpt_step"] = fresh.step
            second = []
            for e in (eng, fresh):
                e.forward_backward(dp_shard(batch, dp_rank, dp), TokenMeanPG(), GlobalBatchStats.of(batch))
                e.optimizer_step()
                second.append(e.hf_state_dict())
            r["ckpt_after2"] = tuple(second)
        result[arch] = r
    for item in loads:
        # Checkpoints written by other layouts, restored at this one.
        arch, path = item.split("=", 1)
        if arch == "bf16":
            result["loaded:bf16"] = bf16_checkpoint(par, path, save=False)
            continue
        if arch == "megatron":
            continue  # restored by optimizer_checks
        i, tied, temp = actors[arch]
        spec = EngineSpec(str(tiny_model(TinyModelSpec(arch=arch, tied=tied))), "actor", parallel=par,
                          optim=optim, micro_batch_size=2, seed=1)
        eng = MegatronTrainingEngine(spec)
        eng.load_checkpoint(path)
        batch = actor_batch(i, temp)
        lp = eng.forward(batch)["log_probs"]
        eng.forward_backward(dp_shard(batch, dp_rank, dp), TokenMeanPG(), GlobalBatchStats.of(batch))
        eng.optimizer_step()
        result[f"loaded:{arch}"] = {"log_probs": lp, "after2": eng.hf_state_dict(), "step": eng.step}
    if "critic" in names:
        result["critic"] = run_critic(par, optim, dp_rank)
    if "errors" in names:
        result["errors"] = boundary_errors(par, f"{ckpt}-refused")
        qwen2 = str(tiny_model(TinyModelSpec(arch="qwen2", tied=True)))
        bf16 = MegatronTrainingEngine(EngineSpec(qwen2, "reference", dtype="bfloat16", parallel=par))
        result["bf16"] = bf16.forward(actor_batch(1, 0.7), ("log_probs", "entropy"))["log_probs"]
        # megatron-core's own DotProductAttention (the reference layer spec; the default is SDPA)
        local = MegatronTrainingEngine(EngineSpec(qwen2, "reference", parallel=par, options={"attention": "local"}))
        out = local.forward(actor_batch(1, 0.7), ("log_probs", "entropy"))
        result["local_attention"] = {"log_probs": out["log_probs"], "entropy": out["entropy"]}
        result["failed_call"] = failed_call(par)
        result["precision"] = precision_checks(par, ckpt)
    if "bf16_ckpt" in names:
        result["bf16_ckpt"] = bf16_checkpoint(par, f"{ckpt}-bf16", save=True)
    if "accumulate" in names:
        result["accumulate"] = accumulate(par, dp_rank)
    if "megatron_optimizer" in names:
        saved = dict(x.split("=", 1) for x in loads).get("megatron")
        result["megatron_optimizer"] = optimizer_checks(par, dp_rank, f"{ckpt}-megatron", saved)
    if "rollout" in names:
        result["rollout"] = run_rollout(par, optim)
    if "reshard" in names:
        import reshard_checks

        result["reshard"] = reshard_checks.run()
    write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def run_rollout(par: ParallelSizes, optim: OptimConfig) -> dict[str, Any]:
    """Seeded sampling, greedy decoding, training/rollout log-prob agreement and a weight sync."""
    path = str(tiny_model(TinyModelSpec(arch="qwen3")))
    rollout = get_rollout_engine("megatron", EngineSpec(path, "rollout", parallel=par, max_response_len=8))
    actor = MegatronTrainingEngine(EngineSpec(path, "actor", parallel=par, optim=optim, micro_batch_size=3))
    prompts = random_batch(batch_size=3, max_prompt=6, max_response=1, seed=11).select(
        "prompt_ids", "prompt_mask", "group_ids")
    sampled = SamplingParams(n=2, max_new_tokens=6, seed=3, temperature=0.8, top_k=40, top_p=0.9)
    first = rollout.generate(prompts, sampled)
    again = rollout.generate(prompts, sampled)
    reordered = rollout.generate(prompts.index([2, 1, 0]), sampled)
    greedy = rollout.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True, temperature=0.8))
    # a quarter of the vocabulary stops a response: rows end at different steps, and the static loop's
    # finished rows attend only the slot their step writes
    stopping = SamplingParams(n=2, max_new_tokens=6, seed=5, temperature=0.8,
                              stop_token_ids=tuple(range(4, 4 + rollout.tokenizer.vocab_size // 4)))
    stopped = rollout.generate(prompts, stopping)
    # the same engine without its KV cache (the whole sequence recomputed at every step)
    recompute = get_rollout_engine("megatron", EngineSpec(path, "rollout", parallel=par, max_response_len=8,
                                                          options={"rollout_kv_cache": False}))
    plain = recompute.generate(prompts, sampled)
    recompute.close()
    # the engine's own static decode loop (one shape per step, device-side positions); twice, so
    # the second call reuses the decoder and its caches. Its steps attend over cache windows of 34
    # slots (the first two steps after the 32-slot prompt) and then the whole cache (38 slots), so the
    # comparisons below also hold windowed attention to Megatron's KV cache and to the compiled
    # whole-cache step.
    static = get_rollout_engine("megatron", EngineSpec(path, "rollout", parallel=par, max_response_len=8,
                                                       options={"rollout_static_cache": True,
                                                                "rollout_decode_window": 34}))
    static_first, static_again = static.generate(prompts, sampled), static.generate(prompts, sampled)
    static_greedy = static.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True, temperature=0.8))
    static_stopped = static.generate(prompts, stopping)
    static_windows = static._decoders.current.windows
    static_mode = static.decode_mode
    static.close()
    # the same loop and windows with its decode step compiled (torch.compile; inductor on CPU), at
    # TP=2 only (where the tensor-parallel group lookup inside compiled code matters; each compile
    # costs seconds): the 34-slot window compiles with its width dynamic, the whole cache on its own
    compiled_out: dict[str, Any] | None = None
    if par.tp == 2:
        compiled = get_rollout_engine("megatron", EngineSpec(path, "rollout", parallel=par, max_response_len=8,
                                                             options={"rollout_static_cache": True,
                                                                      "rollout_compile": True,
                                                                      "rollout_decode_window": 34}))
        got = compiled.generate(prompts, sampled)
        compiled_out = {k: got[k] for k in ("response_ids", "response_mask", "rollout_log_probs")}
        compiled_out["mode"] = compiled.decode_mode
        compiled.close()
    out: dict[str, Any] = {
        "first": {k: first[k] for k in ("response_ids", "response_mask", "rollout_log_probs", "truncated",
                                         "group_ids", "sample_index")},
        "again_ids": again["response_ids"], "reordered_ids": reordered["response_ids"],
        "greedy_ids": greedy["response_ids"], "greedy_mask": greedy["response_mask"],
        "greedy_lp": greedy["rollout_log_probs"],
        "recompute": {k: plain[k] for k in ("response_ids", "response_mask", "rollout_log_probs")},
        "static": {k: static_first[k] for k in ("response_ids", "response_mask", "rollout_log_probs")},
        "static_again_ids": static_again["response_ids"], "static_greedy_ids": static_greedy["response_ids"],
        "static_windows": static_windows, "static_mode": static_mode,
        "stopped": {k: stopped[k] for k in ("response_ids", "response_mask")},
        "static_stopped": {k: static_stopped[k] for k in ("response_ids", "response_mask")},
        "compiled": compiled_out,
        "train_lp": actor.forward(first)["log_probs"],
        "temperature": first.meta.temperature,
    }
    batch = first.update(advantages=torch.randn(first["response_mask"].shape) * first["response_mask"])
    actor.forward_backward(batch, PGOnly(), GlobalBatchStats.of(batch))
    actor.optimizer_step()
    rollout.update_weights(actor.export_weights(dtype=rollout.weight_dtype, bucket_bytes=50_000))
    synced = rollout.generate(prompts, sampled)
    out["synced_version"] = rollout.weight_version
    out["synced_rollout_lp"] = synced["rollout_log_probs"]
    out["synced_train_lp"] = actor.forward(synced)["log_probs"]
    out["synced_mask"] = synced["response_mask"]
    return out


class PGOnly:
    """-mean(log_prob * advantage) over the global response tokens."""

    needs = frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        m = batch["response_mask"].float()
        return LossOutput(-(batch["log_probs"] * batch["advantages"] * m).sum() / max(stats.num_tokens, 1))


def boundary_errors(par: ParallelSizes, ckpt: str) -> dict[str, Any]:
    """Messages of inputs, configs and checkpoints the engine must reject (empty string: nothing raised)."""
    path = tiny_model(TinyModelSpec())
    eng = MegatronTrainingEngine(EngineSpec(str(path), "actor", parallel=par))
    eng.save_checkpoint(ckpt)
    loads = refused_loads(eng, ckpt, {
        "shape": lambda p: p["model"].update({"decoder.final_layernorm.weight": torch.ones(1)}),  # broadcasts
        "dtype": lambda p: p["model"].update({"decoder.layers.0.mlp.linear_fc2.weight":
                                              p["model"]["decoder.layers.0.mlp.linear_fc2.weight"].double()}),
        "missing": lambda p: p["model"].pop("decoder.layers.1.self_attention.linear_qkv.weight"),
    })
    batch = actor_batch(0, 1.0)
    before = eng.hf_state_dict()
    cases: dict[str, Any] = {
        "nan": lambda: eng.forward_backward(
            batch.update(advantages=batch["advantages"].masked_fill(batch["response_mask"], float("nan"))),
            TokenMeanPG(), GlobalBatchStats.of(batch)),
        "vocab": lambda: eng.forward(batch.update(response_ids=batch["response_ids"].index_fill(1, torch.tensor([0]), 128))),
        "values_on_actor": lambda: eng.forward(batch, ("values",)),
        "missing": lambda: eng.forward(batch.drop("response_mask")),
        "world": lambda: MegatronTrainingEngine(
            EngineSpec(str(path), "actor", parallel=ParallelSizes(tp=par.tp, pp=par.pp, dp=par.dp + 1))),
        "gc": lambda: MegatronTrainingEngine(EngineSpec(str(path), "actor", parallel=par, gradient_checkpointing=True)),
        "fp16": lambda: MegatronTrainingEngine(EngineSpec(str(path), "actor", parallel=par, dtype="float16")),
        "option": lambda: get_training_engine("megatron", EngineSpec(str(path), "actor", parallel=par,
                                                                      options={"bogus": 1})),
    }
    out: dict[str, str] = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = ""
        except Exception as e:  # the test checks the type through the message prefix
            out[name] = f"{type(e).__name__}: {e}"
    after = eng.hf_state_dict()
    out["unchanged"] = "yes" if all(torch.equal(before[k], after[k]) for k in before) else "no"
    out["checkpoint"] = loads
    # The CPU shims are active here (no CUDA) and route megatron's CUDA allocations to the CPU.
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.utils import get_default_causal_mask

    from verl_megatron.cpu_shims import cpu_shims_active

    out["shims"] = "yes" if (
        cpu_shims_active()
        and schedules.torch.zeros([], device="cuda").device.type == "cpu"
        and clip_grads.torch.zeros([], device="cuda").device.type == "cpu"
        and get_default_causal_mask(3).device.type == "cpu"
    ) else "no"
    return out


def refused_loads(eng: MegatronTrainingEngine, saved: str, edits: dict[str, Callable[[dict[str, Any]], Any]]
                  ) -> dict[str, Any]:
    """Load copies of checkpoint ``saved``, each with one tensor broken by an edit, into ``eng``.

    Every weight of each copy is moved by 1 first, so a tensor copied before the refusal would
    show. Returns each load's message (empty: it loaded) and whether ``eng``'s weights, Adam
    moments and step stayed as they were. A collective: every rank must call it.
    """
    names = eng.adapter.megatron_names()

    def state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        return ({n: eng._full_tensor(n).clone() for n in names},
                {n: eng._full_tensor(n, what="exp_avg").clone() for n in names}, eng.step)

    before = state()
    out: dict[str, Any] = {}
    for case, edit in edits.items():
        dest = f"{saved}-{case}"
        if dist.get_rank() == 0:
            shutil.copytree(saved, dest)
            payload = torch.load(Path(dest) / "state.pt", weights_only=True)
            payload["model"] = {n: t + 1 for n, t in payload["model"].items()}
            edit(payload)
            torch.save(payload, Path(dest) / "state.pt")
        dist.barrier()
        try:
            eng.load_checkpoint(dest)
            out[case] = ""
        except Exception as e:  # the test checks the type through the message prefix
            out[case] = f"{type(e).__name__}: {e}"
    after = state()
    out["unchanged"] = (all(torch.equal(after[0][n], t) for n, t in before[0].items())
                        and all(torch.equal(after[1][n], t) for n, t in before[1].items()) and after[2] == before[2])
    return out


class FailingPG(TokenMeanPG):
    """:class:`TokenMeanPG` that raises on its second micro-batch."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected failure in the second micro-batch")
        return super().__call__(batch, stats)


def failed_call(par: ParallelSizes, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Gradients after a forward_backward whose loss raises, and after running that call again."""
    spec = EngineSpec(str(tiny_model(TinyModelSpec())), "actor", parallel=par, micro_batch_size=2, seed=1,
                      options=options or {})
    failing, clean = MegatronTrainingEngine(spec), MegatronTrainingEngine(spec)
    batch = actor_batch(4, 1.0)
    loss = FailingPG()
    try:
        failing.forward_backward(batch, loss, GlobalBatchStats.of(batch))
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    after_failure = failing.hf_state_dict(grads=True)
    for e in (failing, clean):
        e.forward_backward(batch, TokenMeanPG(), GlobalBatchStats.of(batch))
    return {"raised": raised, "calls": loss.calls, "after_failure": after_failure,
            "resumed": failing.hf_state_dict(grads=True), "clean": clean.hf_state_dict(grads=True)}


def accumulate(par: ParallelSizes, dp_rank: int) -> dict[str, Any]:
    """Under data parallelism: one call per step, and a per-call budget against the spec's micro-batches."""
    spec = EngineSpec(str(tiny_model(TinyModelSpec())), "actor", parallel=par, micro_batch_size=2, seed=1)
    by_size, by_budget = MegatronTrainingEngine(spec), MegatronTrainingEngine(spec)
    batch = actor_batch(5, 1.0)
    shard = dp_shard(batch, dp_rank, par.dp)
    stats = GlobalBatchStats.of(batch)
    sized = by_size.forward_backward(shard, TokenMeanPG(), stats)
    # a budget of the longest sample: the kernel partitioner's micro-batches instead of pairs
    budget = int(batch.seq_lengths().max())
    budgeted = by_budget.forward_backward(shard, TokenMeanPG(), stats, max_tokens=budget)
    try:
        by_size.forward_backward(shard, TokenMeanPG(), stats)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {"by_size": by_size.hf_state_dict(grads=True), "by_budget": by_budget.hf_state_dict(grads=True),
            "loss": (sized["loss"], budgeted["loss"]),
            "micro_batches": (sized["num_micro_batches"], budgeted["num_micro_batches"]),
            # every rank runs as many micro-batches as the busiest one
            "expected_micro_batches": max(len(dp_shard(batch, r, par.dp).micro_batches(max_tokens=budget))
                                          for r in range(par.dp)),
            "refused": refused}


# Adam's normalised step is at most ~lr per weight: 1.5e-3 is below half of bfloat16's spacing
# just under 1.0 (2**-8 / 2 = 1.95e-3), so a norm weight initialised to 1.0 never moves in pure bfloat16.
SMALL_STEPS = OptimConfig(lr=1.5e-3, eps=1e-8, grad_clip=0.0)


# Weight decay and clipping active, so the mapping of both to megatron's OptimizerConfig is checked.
DECAYED = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.5, weight_decay=0.1, betas=(0.8, 0.99))
MEGATRON_STEPS = 3


class NaNPG(TokenMeanPG):
    """:class:`TokenMeanPG` times NaN: every gradient is NaN."""

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        return LossOutput(super().__call__(batch, stats).loss * float("nan"))


def optimizer_checks(par: ParallelSizes, dp_rank: int, save_to: str, load_from: str | None) -> dict[str, Any]:
    """The same steps under torch's AdamW and megatron-core's optimizer (distributed too at DP>1).

    Per variant: loss, grad norm and weights after each step; then a NaN loss (the step must be
    skipped, weights unchanged) and one more good step (qwen3; at PP>1 the tied qwen2, whose
    embedding gradient is summed over the first and last stage). At TP>1 both optimizers also train in
    bfloat16 (torch's with float32 masters, megatron's with float32 main parameters). The
    ``megatron`` variant also checks a failed forward_backward and a checkpoint round trip;
    ``load_from`` (a megatron-optimizer checkpoint of another layout) is restored into the
    distributed optimizer, which then checks its own round trip.
    """
    # QK-norm (summed over TP ranks) at TP>1, a tied embedding split across stages at PP>1
    path = str(tiny_model(TinyModelSpec(arch="qwen2", tied=True) if par.pp > 1 else TinyModelSpec(arch="qwen3")))
    variants: dict[str, tuple[str, dict[str, Any]]] = {
        "torch": ("float32", {}), "megatron": ("float32", {"optimizer": "megatron"})}
    if par.dp > 1:
        variants["distributed"] = ("float32", {"optimizer": "megatron", "distributed_optimizer": True})
    if par.tp > 1:
        variants["torch_bf16"] = ("bfloat16", {})
        variants["megatron_bf16"] = ("bfloat16", {"optimizer": "megatron"})

    def spec(name: str) -> EngineSpec:
        dtype, options = variants[name]
        return EngineSpec(path, "actor", dtype=dtype, parallel=par, optim=DECAYED, micro_batch_size=2, seed=1,
                          options=options)

    def train(e: MegatronTrainingEngine, seed: int, loss: Any = None) -> dict[str, Any]:
        batch = actor_batch(seed, 0.7 if par.pp > 1 else 1.0)
        m = e.forward_backward(dp_shard(batch, dp_rank, par.dp), loss or TokenMeanPG(), GlobalBatchStats.of(batch))
        st = e.optimizer_step()
        return {"loss": m["loss"], "grad_norm": st.grad_norm, "skipped": st.skipped, "lr": st.lr, "step": e.step}

    out: dict[str, Any] = {}
    engines: dict[str, MegatronTrainingEngine] = {}
    for name in variants:
        eng = engines[name] = MegatronTrainingEngine(spec(name))
        steps, weights = [], []
        for s in range(MEGATRON_STEPS):
            steps.append(train(eng, 40 + s))
            weights.append(eng.hf_state_dict())
        before = weights[-1]
        nan = train(eng, 50, NaNPG())
        unchanged = all(torch.equal(t, before[n]) for n, t in eng.hf_state_dict().items())
        after_nan = train(eng, 51)
        core = eng._core
        out[name] = {"steps": steps, "weights": weights, "nan": nan, "unchanged": unchanged, "after_nan": after_nan,
                     "grad_none": all(p.grad is None for p in eng.model.parameters()),
                     "optimizer": "" if core is None else type(core._parts[0]).__name__}
        if name == "megatron_bf16":
            # megatron's float32 main parameters: float32 and more than the bfloat16 weights hold
            names = eng.adapter.megatron_names()
            masters = {n: eng._full_tensor(n, what="master") for n in names}
            out[name]["master_dtypes"] = sorted({str(m.dtype) for m in masters.values()})
            out[name]["master_gap"] = max(float((m - eng._full_tensor(n).float()).abs().max())
                                          for n, m in masters.items())
    eng = engines["megatron"]
    if par.pp == 1:  # under PP a loss that raises on the last stage leaves the first one waiting
        out["failed_call"] = failed_call(par, variants["megatron"][1])
    eng.save_checkpoint(save_to)
    fresh = MegatronTrainingEngine(spec("megatron"))
    fresh.load_checkpoint(save_to)
    out["ckpt_step"] = fresh.step
    # Broken copies of that checkpoint are refused on every rank, whether or not the rank holds
    # the broken tensor (layer 1 is on the last stage at PP=2; fc2 and the embedding are TP-split).
    hidden = TinyModelSpec().hidden_size
    out["refused"] = refused_loads(fresh, save_to, {
        "shape": lambda p: p["model"].update({"decoder.layers.1.mlp.linear_fc2.weight": torch.zeros(hidden, 1)}),
        "moment": lambda p: p["optimizer"]["exp_avg"].update({"embedding.word_embeddings.weight": torch.zeros(1, hidden)}),
    })
    out["ckpt_next"] = (train(eng, 52), train(fresh, 52), eng.hf_state_dict(), fresh.hf_state_dict())
    if load_from is not None and par.dp > 1:
        # TP=2's megatron-optimizer checkpoint restored into the distributed optimizer at DP=2 ...
        restored = MegatronTrainingEngine(spec("distributed"))
        restored.load_checkpoint(load_from)
        out["restored"] = {"step": restored.step, "next": train(restored, 52), "weights": restored.hf_state_dict()}
        # ... and the distributed optimizer's own round trip
        last = engines["distributed"]
        last.save_checkpoint(f"{save_to}-distributed")
        again = MegatronTrainingEngine(spec("distributed"))
        again.load_checkpoint(f"{save_to}-distributed")
        out["distributed_ckpt"] = (train(last, 53), train(again, 53), last.hf_state_dict(), again.hf_state_dict())
    return out


def precision_checks(par: ParallelSizes, ckpt: str) -> dict[str, Any]:
    """Small Adam steps in float32, bfloat16 with float32 masters and pure bfloat16; a bf16 resume."""
    path = str(tiny_model(TinyModelSpec()))

    def engine(dtype: str, **options: Any) -> MegatronTrainingEngine:
        return MegatronTrainingEngine(EngineSpec(path, "actor", dtype=dtype, parallel=par, optim=SMALL_STEPS,
                                                 micro_batch_size=5, seed=1, options=options))

    def train(e: MegatronTrainingEngine, steps: range) -> None:
        for s in steps:
            batch = actor_batch(20 + s, 1.0)
            e.forward_backward(batch, TokenMeanPG(), GlobalBatchStats.of(batch))
            assert not e.optimizer_step().skipped

    def norms(e: MegatronTrainingEngine, masters: bool = False) -> torch.Tensor:
        ps = [p for n, p in e.model.named_parameters() if "norm" in n]
        return torch.cat([(e._stepped(p) if masters else p).detach().float().flatten() for p in ps])

    fp32, mixed, pure = engine("float32"), engine("bfloat16"), engine("bfloat16", master_weights=False)
    out: dict[str, Any] = {"start": norms(fp32)}
    for e in (fp32, mixed, pure):
        train(e, range(8))
    out.update(fp32=norms(fp32), mixed=norms(mixed), mixed_masters=norms(mixed, masters=True), pure=norms(pure),
               dtypes=sorted({str(p.dtype) for p in mixed.model.parameters()}),
               master_dtypes=sorted({str(m.dtype) for m in mixed._master.masters}) if mixed._master else [],
               fp32_has_masters=fp32._master is not None, pure_has_masters=pure._master is not None)
    # bfloat16 save -> load -> continue equals the uninterrupted run bitwise
    a = engine("bfloat16")
    train(a, range(3))
    a.save_checkpoint(f"{ckpt}-bf16")
    b = engine("bfloat16")
    b.load_checkpoint(f"{ckpt}-bf16")
    a.offload_training_state()  # masters and moments go to CPU memory and come back with the next call
    for e in (a, b):
        train(e, range(3, 5))
    out["resume"] = (a.hf_state_dict(), b.hf_state_dict())
    out["resume_masters"] = (norms(a, masters=True), norms(b, masters=True))
    return out


def bf16_checkpoint(par: ParallelSizes, path: str, *, save: bool) -> dict[str, Any]:
    """Save (two steps) or restore a bfloat16 checkpoint of the tied qwen2 model; the gathered masters."""
    model = str(tiny_model(TinyModelSpec(arch="qwen2", tied=True)))
    spec = EngineSpec(model, "actor", dtype="bfloat16", parallel=par, optim=SMALL_STEPS, micro_batch_size=5, seed=1)
    eng = MegatronTrainingEngine(spec)

    def masters(e: MegatronTrainingEngine) -> dict[str, torch.Tensor]:
        return {n: e._full_tensor(n, what="master").cpu().clone() for n in e.adapter.megatron_names()}

    def step(e: MegatronTrainingEngine, seed: int) -> None:
        batch = actor_batch(seed, 0.7)
        e.forward_backward(batch, TokenMeanPG(), GlobalBatchStats.of(batch))
        assert not e.optimizer_step().skipped

    out: dict[str, Any] = {}
    if save:
        for seed in (30, 31):
            step(eng, seed)
        eng.save_checkpoint(path)
        out["masters"] = masters(eng)
        fresh = MegatronTrainingEngine(spec)
        fresh.load_checkpoint(path)
        for e in (eng, fresh):
            step(e, 32)
        out["resume"] = (eng.hf_state_dict(), fresh.hf_state_dict())
    else:
        eng.load_checkpoint(path)
        out["masters"] = masters(eng)
        out["model"] = {n: eng._full_tensor(n).cpu().clone() for n in eng.adapter.megatron_names()}
        out["step"] = eng.step
    return out


def run_critic(par: ParallelSizes, optim: OptimConfig, dp_rank: int) -> dict[str, Any]:
    path = tiny_model(TinyModelSpec(arch="qwen2", head="value"))
    # Built through the plugin registry, as the trainer and third parties do.
    critic = get_training_engine(
        "megatron", EngineSpec(str(path), "critic", parallel=par, optim=optim, micro_batch_tokens=40)
    )
    batch = actor_batch(7, 1.0)
    out = critic.forward(batch, ("values",))
    metrics = critic.forward_backward(dp_shard(batch, dp_rank, par.dp), TokenMeanValue(), GlobalBatchStats.of(batch))
    assert isinstance(critic, MegatronTrainingEngine)
    return {"values": out["values"], "loss": metrics["loss"], "grads": critic.hf_state_dict(grads=True),
            "export": collect(critic.export_weights())}


if __name__ == "__main__":
    main()
