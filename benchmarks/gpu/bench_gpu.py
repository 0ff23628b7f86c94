"""GPU benchmarks of verl-hf and verl-megatron against plain-library anchors, side by side.

Run on a CUDA machine: ``python benchmarks/gpu/bench_gpu.py --out DIR [--sections ...]``.
Sections (each prints a table and appends it to DIR/bench_gpu.md):

* ``anchors``: bf16 matmul TFLOP/s and device-to-device copy TB/s (read + write);
* ``train``: training tokens/s and MFU of a plain transformers loop, the verl-hf engine and the
  verl-megatron engine on the 0.89B Llama-shaped model (bf16, micro-batch 8 x 2048);
* ``generate``: tokens/s of plain ``generate``, the verl-hf and the megatron rollout engines
  (batch 64, 128-token prompts, 256 sampled tokens);
* ``sync``: GB/s of a named-parameter copy against export_weights -> update_weights (canonical stream).

The model is random-initialised (hidden 2048, 16 layers, 16 heads, 8 KV groups, FFN 5632, vocab
32000) and built once into DIR/model.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verl_conformance.testkit import TinyModelSpec, build_tiny_model
from verl_core import (
    BatchMeta,
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    SamplingParams,
    StreamWeightSync,
    TensorBatch,
    get_rollout_engine,
    get_training_engine,
)
from verl_core.algorithms import Algorithm

PEAK_BF16 = 989e12  # H200 dense bf16 FLOP/s (datasheet)
SPEC = TinyModelSpec(arch="llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                     head_dim=128, intermediate_size=5632, vocab_size=32000, max_position=4096,
                     init_std=0.02, seed=0)
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def cuda_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def anchors() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, 10, 3)
    x = torch.empty(int(4e9) // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    tc = cuda_time(lambda: y.copy_(x), 10, 2)
    emit("| anchor | value |\n|---|---|")
    emit(f"| bf16 matmul 8192^3 | {2 * 8192**3 / t / 1e12:.0f} TFLOP/s |")
    emit(f"| device copy 4 GB (read+write) | {2 * x.numel() * 2 / tc / 1e12:.2f} TB/s |")


def params_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_flops_per_token(n_params: int, seq: int) -> float:
    # 6N for the dense matmuls plus causal attention scores and values: 6 * L * s * h (fwd+bwd, halved by the mask)
    return 6 * n_params + 6 * SPEC.num_layers * seq * SPEC.num_heads * SPEC.head_dim


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


def train(model_dir: Path, steps: int) -> None:
    import transformers

    mb, prompt, response = 8, 1024, 1024
    tokens = mb * (prompt + response)
    batch = rl_batch(mb, prompt, response, SPEC.vocab_size)
    rows: list[tuple[str, float]] = []

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    n_params = params_count(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).cuda()
    mask = torch.ones_like(ids, dtype=torch.bool)
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    adv = batch["advantages"].cuda()
    resp = batch["response_ids"].cuda()

    def plain_step() -> None:
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        lp = torch.log_softmax(logits[:, prompt - 1 : -1].float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        loss = -(lp * adv).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows.append(("plain transformers", tokens / cuda_time(plain_step, steps)))
    gc.collect()
    torch.cuda.empty_cache()

    loss_fn = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
    stats = GlobalBatchStats.of(batch)
    for backend in ("hf", "megatron"):
        try:
            engine = get_training_engine(backend, EngineSpec(
                model_path=str(model_dir), role="actor", dtype="bfloat16", device="cuda",
                max_prompt_len=prompt, max_response_len=response, micro_batch_size=mb,
                optim=OptimConfig(lr=1e-6, grad_clip=1.0)))

            def engine_step(engine: object = engine) -> None:
                engine.forward_backward(batch, loss_fn, stats)  # type: ignore[attr-defined]
                engine.optimizer_step()  # type: ignore[attr-defined]

            rows.append((f"verl-{backend} engine", tokens / cuda_time(engine_step, steps)))
            engine.close()
            del engine
        except Exception as e:  # report and go on: the table says what failed
            emit(f"verl-{backend} training failed: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()

    flops = train_flops_per_token(n_params, prompt + response)
    base = rows[0][1]
    emit(f"\nTraining, {n_params / 1e9:.2f}B params, bf16, micro-batch {mb} x {prompt + response}, {steps} timed steps")
    emit("| trainer | tokens/s | MFU | vs plain |\n|---|---|---|---|")
    for name, tps in rows:
        emit(f"| {name} | {tps:,.0f} | {tps * flops / PEAK_BF16:.1%} | {tps / base:.3f}x |")


def generate(model_dir: Path) -> None:
    import transformers

    batch, prompt, new = 64, 128, 256
    prompts = rl_batch(batch, prompt, 1, SPEC.vocab_size).select("prompt_ids", "prompt_mask", "group_ids")
    rows: list[tuple[str, float]] = []
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = prompts["prompt_ids"].cuda()

    def plain() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           max_new_tokens=new, min_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0,
                           pad_token_id=0)

    rows.append(("plain generate", batch * new / cuda_time(plain, 2, 1)))
    gc.collect()
    torch.cuda.empty_cache()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)
    for backend in ("hf", "megatron"):
        try:
            engine = get_rollout_engine(backend, EngineSpec(
                model_path=str(model_dir), role="rollout", dtype="bfloat16", device="cuda",
                max_prompt_len=prompt, max_response_len=new))
            out: list[TensorBatch] = []

            def run(engine: object = engine, out: list[TensorBatch] = out) -> None:
                out.append(engine.generate(prompts, params))  # type: ignore[attr-defined]

            t = cuda_time(run, 2, 1)
            generated = int(out[-1]["response_mask"].sum())
            rows.append((f"verl-{backend} rollout", generated / t))
            engine.close()
            del engine
        except Exception as e:
            emit(f"verl-{backend} rollout failed: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()
    emit(f"\nGeneration, batch {batch}, {prompt}-token prompts, {new} sampled tokens, bf16")
    emit("| generator | tokens/s | vs plain |\n|---|---|---|")
    for name, tps in rows:
        emit(f"| {name} | {tps:,.0f} | {tps / rows[0][1]:.2f}x |")


def sync(model_dir: Path) -> None:
    actor = get_training_engine("hf", EngineSpec(model_path=str(model_dir), role="actor", dtype="bfloat16",
                                                 device="cuda"))
    rollout = get_rollout_engine("hf", EngineSpec(model_path=str(model_dir), role="rollout",
                                                  dtype="bfloat16", device="cuda"))
    src = [p for p in actor._model.parameters()]  # type: ignore[attr-defined]
    dst = [torch.empty_like(p) for p in src]
    nbytes = sum(p.numel() * p.element_size() for p in src)

    def copy() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    t_copy = cuda_time(copy, 5)
    reports = []
    version = [0]

    def stream() -> None:
        version[0] += 1
        reports.append(StreamWeightSync(bucket_bytes=512 << 20).sync(actor, rollout, version=version[0]))

    t_sync = cuda_time(stream, 3, 1)
    emit(f"\nWeight sync actor -> rollout (hf -> hf), {nbytes / 1e9:.2f} GB bf16")
    emit("| path | GB/s | vs copy |\n|---|---|---|")
    emit(f"| named-parameter copy | {nbytes / t_copy / 1e9:.0f} | 1.00x |")
    emit(f"| canonical stream (export -> update) | {reports[-1].bytes / t_sync / 1e9:.0f} | {t_copy / t_sync:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="*", default=["anchors", "train", "generate", "sync"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out.parent / "model-0.89b"
    if not (model_dir / "verl_tiny_model.json").exists():
        t0 = time.perf_counter()
        build_tiny_model(model_dir, SPEC)
        print(f"built the 0.89B model in {time.perf_counter() - t0:.0f}s", flush=True)
    emit(f"# GPU benchmarks on {torch.cuda.get_device_name()} ({time.strftime('%Y-%m-%d')}, torch {torch.__version__})")
    for section in args.sections:
        t0 = time.perf_counter()
        {"anchors": anchors, "train": lambda: train(model_dir, args.steps), "generate": lambda: generate(model_dir),
         "sync": lambda: sync(model_dir)}[section]()
        print(f"[{section} took {time.perf_counter() - t0:.0f}s]", flush=True)
        (args.out / "bench_gpu.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
