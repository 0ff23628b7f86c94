"""GPU benchmarks of verl-hf and verl-megatron against plain-library anchors, side by side.

Run on a CUDA machine: ``python benchmarks/gpu/bench_gpu.py --out DIR [--sections ...]``.
Sections (each prints a table and appends it to DIR/bench_gpu.md):

* ``anchors``: bf16 matmul TFLOP/s and device-to-device copy TB/s (read + write);
* ``train``: training tokens/s and MFU of a plain transformers loop, the verl-hf engine and the
  verl-megatron engine on the 0.89B Llama-shaped model (bf16, micro-batch 8 x 2048);
* ``generate``: tokens/s of plain ``generate``, the verl-hf rollout engine with each decode mode
  (dynamic KV cache, static KV cache, static KV cache + CUDA graphs) and the megatron rollout
  engine (batch 64, 128-token prompts, 256 sampled tokens), plus how closely the CUDA-graph
  samples match the eager static ones (same seed);
* ``sync``: GB/s of a named-parameter copy against the canonical stream
  (``StreamWeightSync``: export_weights -> update_weights) at two bucket sizes, the registered
  direct hf -> hf path, and the export alone; checks that the rollout's parameters equal the
  actor's afterwards.

The model is random-initialised (hidden 2048, 16 layers, 16 heads, 8 KV groups, FFN 5632, vocab
32000) and built once next to DIR. ``--size small`` or ``--size tiny`` (``--tiny``) swap in a
four- or two-layer model and small batches, and ``--device cpu`` runs everything on the CPU (float32):
a dry run of the script, or a CPU comparison at the small size.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from verl_conformance.testkit import TinyModelSpec, build_tiny_model
from verl_core import (
    BatchMeta,
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    SamplingParams,
    StreamWeightSync,
    SyncReport,
    TensorBatch,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
)
from verl_core.algorithms import Algorithm

PEAK_BF16 = 989e12  # H200 dense bf16 FLOP/s (datasheet)
SPEC = TinyModelSpec(arch="llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                     head_dim=128, intermediate_size=5632, vocab_size=32000, max_position=4096,
                     init_std=0.02, seed=0)
TINY_SPEC = TinyModelSpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=32, intermediate_size=256, vocab_size=512, max_position=512, seed=0)


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run: the GPU sizes, or the tiny ones of a CPU dry run."""

    spec: TinyModelSpec
    train_mb: int
    train_prompt: int
    train_response: int
    gen_batch: int
    gen_prompt: int
    gen_new: int
    matmul: int
    copy_bytes: int


SMALL_SPEC = TinyModelSpec(arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                           head_dim=32, intermediate_size=688, vocab_size=512, max_position=1024, seed=0)
SIZES = {
    "full": Sizes(SPEC, 8, 1024, 1024, 64, 128, 256, 8192, int(4e9)),
    "small": Sizes(SMALL_SPEC, 4, 64, 64, 16, 16, 64, 1024, int(1e8)),
    "tiny": Sizes(TINY_SPEC, 2, 16, 16, 4, 8, 8, 256, int(4e6)),
}
DEVICE = "cuda"
DTYPE = torch.bfloat16
LINES: list[str] = []
GENERATORS: list[str] = []  # --generators: only the rollout rows whose names contain one of these


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def cuda_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Mean seconds of ``fn`` over ``reps`` calls after ``warmup`` calls, device work included."""
    for _ in range(warmup):
        fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / reps


def graph_time(fn: Callable[[], object], reps: int = 50) -> float:
    """Seconds per replay of ``fn`` captured in a CUDA graph (device time between events)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def free_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def anchors(sz: Sizes) -> None:
    n = sz.matmul
    a = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    t = cuda_time(lambda: a @ b, 10, 3)
    x = torch.empty(sz.copy_bytes // 2, device=DEVICE, dtype=DTYPE)
    y = torch.empty_like(x)
    tc = cuda_time(lambda: y.copy_(x), 10, 2)
    emit("| anchor | value |\n|---|---|")
    emit(f"| bf16 matmul {n}^3 | {2 * n**3 / t / 1e12:.0f} TFLOP/s |")
    emit(f"| device copy {sz.copy_bytes / 1e9:g} GB (read+write) | {2 * x.numel() * 2 / tc / 1e12:.2f} TB/s |")


def params_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_flops_per_token(spec: TinyModelSpec, n_params: int, seq: int) -> float:
    # 6N for the dense matmuls plus causal attention scores and values: 6 * L * s * h (fwd+bwd, halved by the mask)
    return 6 * n_params + 6 * spec.num_layers * seq * spec.num_heads * spec.head_dim


def rl_batch(batch: int, prompt: int, response: int, vocab: int, device: str = "cpu") -> TensorBatch:
    g = torch.Generator().manual_seed(0)
    fields = {
        "prompt_ids": torch.randint(4, vocab, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.bool),
        "response_ids": torch.randint(4, vocab, (batch, response), generator=g),
        "response_mask": torch.ones(batch, response, dtype=torch.bool),
        "advantages": torch.randn(batch, response, generator=g),
        "old_log_probs": torch.full((batch, response), -10.0),
        "group_ids": torch.arange(batch),
    }
    return TensorBatch({k: v.to(device) for k, v in fields.items()}, meta=BatchMeta())


def dtype_name() -> Literal["float32", "bfloat16"]:
    return "bfloat16" if torch.bfloat16 == DTYPE else "float32"


def plain_train(model_dir: Path, batch: TensorBatch, prompt: int, steps: int) -> tuple[float, int]:
    """Tokens/s and parameter count of a plain transformers loop (sdpa, AdamW) on ``batch``."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE)
    model.to(DEVICE)
    n_params = params_count(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=DEVICE == "cuda")
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).to(DEVICE)
    mask = torch.ones_like(ids, dtype=torch.bool)
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    adv = batch["advantages"].to(DEVICE)
    resp = batch["response_ids"].to(DEVICE)

    def plain_step() -> None:
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        lp = torch.log_softmax(logits[:, prompt - 1 : -1].float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        loss = -(lp * adv).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ids.numel() / cuda_time(plain_step, steps), n_params


def train(model_dir: Path, sz: Sizes, steps: int) -> None:
    mb, prompt, response = sz.train_mb, sz.train_prompt, sz.train_response
    tokens = mb * (prompt + response)
    batch = rl_batch(mb, prompt, response, sz.spec.vocab_size)
    rows: list[tuple[str, float]] = []

    tps, n_params = plain_train(model_dir, batch, prompt, steps)
    rows.append(("plain transformers", tps))
    free_memory()

    loss_fn = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
    stats = GlobalBatchStats.of(batch)
    # hf twice: float32 master weights (its default in bf16) and pure bf16 like the plain loop.
    runs: list[tuple[str, str, dict[str, object]]] = [
        ("verl-hf engine (fp32 master weights)", "hf", {}),
        ("verl-hf engine (pure bf16)", "hf", {"master_weights": False}),
        ("verl-megatron engine", "megatron", {}),
        ("verl-megatron engine (megatron-core optimizer)", "megatron", {"optimizer": "megatron"}),
    ]
    for label, backend, options in runs:
        try:
            engine = get_training_engine(backend, EngineSpec(
                model_path=str(model_dir), role="actor", dtype=dtype_name(), device=DEVICE,
                max_prompt_len=prompt, max_response_len=response, micro_batch_size=mb,
                optim=OptimConfig(lr=1e-6, grad_clip=1.0), options=options))

            def engine_step(engine: object = engine) -> None:
                engine.forward_backward(batch, loss_fn, stats)  # type: ignore[attr-defined]
                engine.optimizer_step()  # type: ignore[attr-defined]

            rows.append((label, tokens / cuda_time(engine_step, steps)))
            engine.close()
            del engine
        except Exception as e:  # report and go on: the table says what failed
            emit(f"{label} training failed: {type(e).__name__}: {e}")
        free_memory()

    flops = train_flops_per_token(sz.spec, n_params, prompt + response)
    base = rows[0][1]
    emit(f"\nTraining, {n_params / 1e9:.2f}B params, {dtype_name()}, micro-batch {mb} x {prompt + response}, "
         f"{steps} timed steps")
    emit("| trainer | tokens/s | MFU | vs plain |\n|---|---|---|---|")
    for name, tps in rows:
        emit(f"| {name} | {tps:,.0f} | {tps * flops / PEAK_BF16:.1%} | {tps / base:.3f}x |")


# The hf rollout's decode modes (HFOptions), each measured beside plain ``generate``.
HF_DECODE_MODES: dict[str, dict[str, object]] = {
    "dynamic KV cache": {},
    "static KV cache": {"rollout_cache": "static"},
    "static KV cache + CUDA graphs": {"rollout_cache": "static", "rollout_cuda_graphs": True},
    "static KV cache + torch.compile + CUDA graphs": {"rollout_cache": "static", "rollout_compile": True,
                                                      "rollout_cuda_graphs": True},
}
MEGATRON_DECODE_MODES: dict[str, dict[str, object]] = {
    "Megatron KV cache": {},
    "static cache": {"rollout_static_cache": True},
    "static cache + CUDA graphs": {"rollout_static_cache": True, "rollout_cuda_graphs": True},
    "static cache + torch.compile + CUDA graphs": {"rollout_static_cache": True, "rollout_compile": True,
                                                   "rollout_cuda_graphs": True},
}
DECODE_MODES = {"verl-hf": HF_DECODE_MODES, "verl-megatron": MEGATRON_DECODE_MODES}


def plain_generate(model_dir: Path, prompts: TensorBatch, new: int) -> float:
    """Tokens/s of transformers' ``generate`` sampling exactly ``new`` tokens per prompt."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE)
    model.to(DEVICE).eval()
    ids = prompts["prompt_ids"].to(DEVICE)

    def plain() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           max_new_tokens=new, min_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0,
                           pad_token_id=0)

    return ids.shape[0] * new / cuda_time(plain, 2, 1)


def generate(model_dir: Path, sz: Sizes) -> None:
    batch, prompt, new = sz.gen_batch, sz.gen_prompt, sz.gen_new
    prompts = rl_batch(batch, prompt, 1, sz.spec.vocab_size).select("prompt_ids", "prompt_mask", "group_ids")
    rows: list[tuple[str, float, str]] = []
    rows.append(("plain generate", plain_generate(model_dir, prompts, new), ""))
    free_memory()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)
    runs = [(f"{who} rollout, {k}", v) for who, modes in DECODE_MODES.items() for k, v in modes.items()]
    if DEVICE != "cuda":
        runs = [r for r in runs if not r[1].get("rollout_cuda_graphs")]
    if GENERATORS:
        runs = [r for r in runs if any(g in r[0] for g in GENERATORS)]
    outputs: dict[str, TensorBatch] = {}
    for name, options in runs:
        backend = "megatron" if "megatron" in name else "hf"
        try:
            engine = get_rollout_engine(backend, EngineSpec(
                model_path=str(model_dir), role="rollout", dtype=dtype_name(), device=DEVICE,
                max_prompt_len=prompt, max_response_len=new, options=options))
            out: list[TensorBatch] = []

            def run(engine: object = engine, out: list[TensorBatch] = out) -> None:
                out.append(engine.generate(prompts, params))  # type: ignore[attr-defined]

            t = cuda_time(run, 2, 1)
            generated = int(out[-1]["response_mask"].sum())
            outputs[name] = out[-1]
            rows.append((name, generated / t, str(getattr(engine, "decode_mode", ""))))
            engine.close()
            del engine
        except Exception as e:
            emit(f"{name} failed: {type(e).__name__}: {e}")
        free_memory()
    emit(f"\nGeneration, batch {batch}, {prompt}-token prompts, {new} sampled tokens, {dtype_name()}")
    emit("| generator | tokens/s | vs plain | decode mode |\n|---|---|---|---|")
    for name, tps, mode in rows:
        emit(f"| {name} | {tps:,.0f} | {tps / rows[0][1]:.2f}x | {mode} |")
    # Same seed, same weights: the graph replays the eager step's kernels, so samples should agree.
    for who, modes in DECODE_MODES.items():
        keys = [f"{who} rollout, {k}" for k in modes]
        pairs = [(keys[0], other) for other in keys[1:]] + list(itertools.pairwise(keys[1:]))
        for a, b in pairs:
            if a in outputs and b in outputs:
                emit(f"{b} vs {a}: {agreement(outputs[a], outputs[b])}")


def agreement(a: TensorBatch, b: TensorBatch) -> str:
    """Share of identical responses and the largest log-prob gap over the tokens before any fork."""
    n = a.batch_size
    width = min(a.response_len, b.response_len)
    ids_a, ids_b = a["response_ids"][:, :width], b["response_ids"][:, :width]
    same_rows = sum(torch.equal(a.index([i]).trim()["response_ids"], b.index([i]).trim()["response_ids"])
                    for i in range(n))
    # Tokens up to (and including) the first differing one share their context.
    prefix = (ids_a == ids_b).long().cumprod(1).bool()
    prefix = prefix & a["response_mask"][:, :width] & b["response_mask"][:, :width]
    gap = (a["rollout_log_probs"][:, :width] - b["rollout_log_probs"][:, :width]).abs()[prefix]
    worst = float(gap.max()) if gap.numel() else 0.0
    return f"{same_rows}/{n} responses identical, max |log-prob gap| {worst:.2e} over {int(prefix.sum())} shared tokens"


def sync(model_dir: Path) -> None:
    from verl_core import WeightChunk
    from verl_core.enginekit.weight_stream import copy_checked

    actor = get_training_engine("hf", EngineSpec(model_path=str(model_dir), role="actor", dtype=dtype_name(),
                                                 device=DEVICE))
    rollout = get_rollout_engine("hf", EngineSpec(model_path=str(model_dir), role="rollout",
                                                  dtype=dtype_name(), device=DEVICE))
    src = [p.detach() for p in actor.model.parameters()]  # type: ignore[attr-defined]
    dst = [torch.empty_like(p) for p in src]
    nbytes = sum(p.numel() * p.element_size() for p in src)

    def copy() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    t_copy = cuda_time(copy, 5)
    version = [0]
    rows: list[tuple[str, float, int]] = []
    # What one buffer-to-buffer move costs: a plain copy (the floor), the fused copy-and-check the
    # receivers use on CUDA, and the unfused reduction-then-copy it replaces.
    flat_src = actor._flat.buffer  # type: ignore[attr-defined]
    flat_dst = torch.empty_like(flat_src)
    flat_bytes = flat_src.numel() * flat_src.element_size()
    rows.append(("one buffer copy (whole flat buffer)", cuda_time(lambda: flat_dst.copy_(flat_src), 5), flat_bytes))
    rows.append(("copy_checked (fused copy + NaN/inf check)", cuda_time(lambda: copy_checked(flat_dst, flat_src), 5),
                 flat_bytes))

    def norm_then_copy() -> None:
        torch.linalg.vector_norm(flat_src).isfinite()
        flat_dst.copy_(flat_src)

    rows.append(("2-norm reduction, then buffer copy (unfused)", cuda_time(norm_then_copy, 5), flat_bytes))
    for bucket_mb in (64, 256, 512, 1024):
        reports: list[SyncReport] = []

        def stream(bucket: int = bucket_mb << 20, reports: list[SyncReport] = reports) -> None:
            version[0] += 1
            reports.append(StreamWeightSync(bucket_bytes=bucket).sync(actor, rollout, version=version[0]))

        t_sync = cuda_time(stream, 5, 2)
        rows.append((f"canonical stream (export -> update_weights), {bucket_mb} MB buckets", t_sync,
                     reports[-1].bytes))

    direct = get_weight_sync("hf", "hf")
    direct_reports: list[SyncReport] = []

    def direct_sync() -> None:
        version[0] += 1
        direct_reports.append(direct.sync(actor, rollout, version=version[0]))

    t_direct = cuda_time(direct_sync, 5, 2)
    rows.append((f"direct path ({type(direct).__name__}, registered for hf -> hf)", t_direct,
                 direct_reports[-1].bytes))

    def export() -> None:
        for msg in actor.export_weights(dtype=rollout.weight_dtype, bucket_bytes=512 << 20):
            if isinstance(msg, WeightChunk):
                pass

    rows.append(("export_weights alone (512 MB buckets)", cuda_time(export, 5), nbytes))
    sent = dict(actor.model.named_parameters())  # type: ignore[attr-defined]
    exact = all(torch.equal(p, sent[n]) for n, p in rollout.model.named_parameters())  # type: ignore[attr-defined]
    emit(f"\nWeight sync actor -> rollout (hf -> hf), {nbytes / 1e9:.2f} GB {dtype_name()}; rollout weights "
         f"equal the actor's after the sync: {exact}")
    emit("| path | ms | GB/s | vs copy |\n|---|---|---|---|")
    emit(f"| named-parameter copy | {t_copy * 1e3:.2f} | {nbytes / t_copy / 1e9:.0f} | 1.00x |")
    for name, t, moved in rows:
        emit(f"| {name} | {t * 1e3:.2f} | {moved / t / 1e9:.0f} | {t_copy / t:.2f}x |")


def profile_rollout(model_dir: Path, sz: Sizes) -> None:
    """Where the time of the CUDA-graph rollout goes (diagnostics)."""
    batch, prompt, new = sz.gen_batch, sz.gen_prompt, sz.gen_new
    prompts = rl_batch(batch, prompt, 1, sz.spec.vocab_size).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)
    rows: list[tuple[str, float]] = []
    options: dict[str, object] = {"rollout_cache": "static", "rollout_cuda_graphs": DEVICE == "cuda"}
    engine: Any = get_rollout_engine("hf", EngineSpec(
        model_path=str(model_dir), role="rollout", dtype=dtype_name(), device=DEVICE,
        max_prompt_len=prompt, max_response_len=new, options=options))
    out = engine.generate(prompts, params)
    tokens = int(out["response_mask"].sum())
    rows.append(("generate (whole call)", cuda_time(lambda: engine.generate(prompts, params), 2, 0)))
    decoder = engine._decoder[1]
    chunk = prompts.to(DEVICE)
    rows.append(("start (prefill + first sample)", cuda_time(lambda: decoder.start(chunk, None), 3, 1)))
    steps = min(50, new - 2)

    def replays(fn: Callable[[], None]) -> float:
        decoder.start(chunk, None)
        synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        synchronize()
        return (time.perf_counter() - t0) / steps

    if decoder.graph is not None:
        rows.append(("one decode step, graph replay", replays(decoder.graph.replay)))
    rows.append(("one decode step, eager", replays(decoder.step)))
    config = engine.model.config
    attn = config._attn_implementation
    if attn != "sdpa":
        config._attn_implementation = "sdpa"
        rows.append(("one decode step, eager, transformers' sdpa (repeat_kv)", replays(decoder.step)))
        config._attn_implementation = attn
    logits = torch.randn(batch, sz.spec.vocab_size, device=DEVICE)
    alive = torch.ones(batch, dtype=torch.bool, device=DEVICE)
    sampler = decoder.sampler
    if sampler.uniforms is None:
        sampler.uniforms = torch.rand(batch, new, dtype=torch.float64, device=DEVICE)
    rows.append(("sampler alone (eager)", cuda_time(lambda: sampler.step(logits, 3, alive), 20, 3)))
    rows.append(("result()", cuda_time(decoder.result, 5, 1)))
    emit(f"\nRollout breakdown (hf, static cache, graphs={decoder.graph is not None}), batch {batch}, "
         f"{prompt}-token prompts, {new} new, {tokens} tokens")
    emit("| part | ms |\n|---|---|")
    for name, t in rows:
        emit(f"| {name} | {t * 1e3:.3f} |")
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        decoder.start(chunk, None)
        synchronize()
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                decoder.step()
            synchronize()
        emit("```\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30) + "\n```")
    engine.close()


def profile(model_dir: Path, sz: Sizes) -> None:
    """Both breakdowns: the rollout's, then the weight syncs'."""
    profile_rollout(model_dir, sz)
    free_memory()
    profile_sync(model_dir)


def profile_sync(model_dir: Path) -> None:
    """Where the time of the weight syncs goes (diagnostics)."""
    from verl_core.enginekit.weight_stream import all_finite_flag, tensor_norms

    actor: Any = get_training_engine("hf", EngineSpec(model_path=str(model_dir), role="actor",
                                                      dtype=dtype_name(), device=DEVICE))
    rollout: Any = get_rollout_engine("hf", EngineSpec(model_path=str(model_dir), role="rollout",
                                                       dtype=dtype_name(), device=DEVICE))
    src = [p.detach() for p in actor.model.parameters()]
    dst = [torch.empty_like(p) for p in src]
    nbytes = sum(p.numel() * p.element_size() for p in src)
    flat_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)
    flat_dst = torch.empty_like(flat_src)
    parts: list[tuple[str, Callable[[], object]]] = [
        ("state_dict()", lambda: actor.model.state_dict()),
        ("named_parameters()", lambda: list(actor.model.named_parameters())),
        ("export_weights consumed (host only)", lambda: list(actor.export_weights(bucket_bytes=512 << 20))),
        ("all_finite_flag (foreach 2-norm) + sync", lambda: bool(all_finite_flag(src))),
        ("tensor_norms (foreach inf-norm) + sync", lambda: bool(torch.as_tensor(tensor_norms(src)).isfinite().all())),
        ("_foreach_copy_", lambda: torch._foreach_copy_(dst, src)),
        ("one flat copy of the same bytes", lambda: flat_dst.copy_(flat_src)),
        ("one flat 2-norm + sync", lambda: bool(torch.linalg.vector_norm(flat_src).isfinite())),
        ("direct sync (HFDirectSync)", lambda: get_weight_sync("hf", "hf").sync(actor, rollout, version=1)),
        ("canonical stream, 512 MB", lambda: StreamWeightSync(512 << 20).sync(actor, rollout, version=1)),
    ]
    probe = [torch.ones(1000, dtype=DTYPE, device=DEVICE) for _ in range(3)]
    probe[1][7], probe[2][999] = float("nan"), float("-inf")
    emit(f"\ntensor_norms of [finite, NaN, -inf] on {DEVICE}: {torch.as_tensor(tensor_norms(probe)).tolist()}")
    emit(f"\nWeight-sync breakdown, {nbytes / 1e9:.2f} GB")
    emit("| part | ms | GB/s of the model's bytes |\n|---|---|---|")
    for name, fn in parts:
        t = cuda_time(fn, 10, 2)
        emit(f"| {name} | {t * 1e3:.3f} | {nbytes / t / 1e9:.0f} |")
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        for label, fn in parts[-2:]:
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                synchronize()
            emit(f"{label}:\n```\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=15) + "\n```")


def main() -> None:
    global DEVICE, DTYPE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="*", default=["anchors", "train", "generate", "sync"],
                        choices=["anchors", "train", "generate", "sync", "profile"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--generators", nargs="*", default=[],
                        help="generate section: only the engine rows whose names contain one of these (plain "
                             "generate always runs)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="full", choices=sorted(SIZES),
                        help="full: the 0.89B model; small (4 layers) and tiny (2 layers): CPU runs")
    parser.add_argument("--tiny", action="store_true", help="same as --size tiny (a dry run)")
    args = parser.parse_args()
    DEVICE = args.device
    GENERATORS[:] = args.generators
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    size = "tiny" if args.tiny else args.size
    sz = SIZES[size]
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out.parent / ("model-0.89b" if size == "full" else f"model-{size}")
    if not (model_dir / "verl_tiny_model.json").exists():
        t0 = time.perf_counter()
        build_tiny_model(model_dir, sz.spec)
        print(f"built the model in {time.perf_counter() - t0:.0f}s", flush=True)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    emit(f"# GPU benchmarks on {where} ({time.strftime('%Y-%m-%d')}, torch {torch.__version__})")
    sections: dict[str, Callable[[], None]] = {
        "anchors": lambda: anchors(sz),
        "train": lambda: train(model_dir, sz, args.steps),
        "generate": lambda: generate(model_dir, sz),
        "sync": lambda: sync(model_dir),
        "profile": lambda: profile(model_dir, sz),
    }
    for section in args.sections:
        t0 = time.perf_counter()
        sections[section]()
        print(f"[{section} took {time.perf_counter() - t0:.0f}s]", flush=True)
        (args.out / "bench_gpu.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
