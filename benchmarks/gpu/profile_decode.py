"""Where one decode step of the hf rollout goes on a GPU, at the GRPO benchmark's shape.

Run on a CUDA machine: ``python benchmarks/gpu/profile_decode.py --out DIR [--options JSON]``.
Builds the 0.89B model of ``bench_gpu.py`` (next to DIR), generates with the rollout engine's
default options (16 prompts x 8 samples, 32-token prompts, 128 new tokens, as
``benchmarks/bench_grpo_vs_trl.py --size 0.9b``), then prints, each against anchors measured in
the same run: the whole ``generate`` call, one captured decode step replayed, the step's model
forward and its sampling each in a graph of their own, the step's matrix multiplies alone and the
time to read the weights once (a device copy of the same bytes), the wall time of 20 replayed steps
against the sum of their kernels (what the device spends between kernels), and the profiler's
kernel table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from bench_gpu import SPEC, graph_time

from verl_conformance.testkit import build_tiny_model
from verl_core import BatchMeta, EngineSpec, SamplingParams, TensorBatch, get_rollout_engine
from verl_core.enginekit.sampling import sampling_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--options", default="{}", help="hf engine options, a JSON object")
    parser.add_argument("--calls", type=int, default=4, help="generate calls before the parts are timed")
    parser.add_argument("--whole-generate", action="store_true",
                        help="profile one whole generate call (every cache window) instead of the parts of "
                             "one step: its kernel table, grouped by kernel, with each group's share")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out.parent / "model-0.89b"
    if not (model_dir / "verl_tiny_model.json").exists():
        build_tiny_model(model_dir, SPEC)
    rows: list[tuple[str, float]] = []
    g = torch.Generator().manual_seed(0)
    prompts = TensorBatch({
        "prompt_ids": torch.randint(4, SPEC.vocab_size, (args.prompts, args.prompt_len), generator=g),
        "prompt_mask": torch.ones(args.prompts, args.prompt_len, dtype=torch.bool),
        "group_ids": torch.arange(args.prompts),
    }, meta=BatchMeta())
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, n=args.n, seed=0)
    engine: Any = get_rollout_engine("hf", EngineSpec(
        model_path=str(model_dir), role="rollout", dtype="bfloat16", device="cuda",
        max_prompt_len=args.prompt_len, max_response_len=args.new, options=json.loads(args.options)))
    for i in range(args.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        tokens = int(out["response_mask"].sum())
        print(f"generate {i}: {t:.3f} s, {tokens} tokens, {tokens / t:,.0f} tok/s", flush=True)
        if i >= 1:
            rows.append((f"generate call {i} (whole, {tokens} tokens)", t))
    print("decode mode:", getattr(engine, "decode_mode", "?"), flush=True)
    if args.whole_generate:
        _profile_whole(engine, prompts, params, args)
        return
    dec = engine._decoders.current
    chunk = prompts.repeat_interleave(args.n).to("cuda")
    steps = args.new - 2
    if dec.graph is not None:
        dec.start(chunk, None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            dec.graph.replay()
        end.record()
        torch.cuda.synchronize()
        rows.append(("one decode step (graph replay)", start.elapsed_time(end) / 1e3 / steps))
        t0 = time.perf_counter()
        dec.start(chunk, None)
        torch.cuda.synchronize()
        rows.append(("start: prefill + first sample", time.perf_counter() - t0))

    dec.start(chunk, None)
    rows.append(("model forward of a step alone (graph)", graph_time(dec._advance, 20)))
    logits = torch.randn(chunk.batch_size, SPEC.vocab_size, device="cuda")
    alive = torch.ones(chunk.batch_size, dtype=torch.bool, device="cuda")
    sampler = dec.sampler
    if sampler.uniforms is None:
        sampler.uniforms = torch.rand(chunk.batch_size, args.new, dtype=torch.float64, device="cuda")
    t = torch.full((1,), 3, dtype=torch.int64, device="cuda")
    rows.append(("sampling of a step alone, eager (graph)",
                 graph_time(lambda: sampling_step(sampler.params, sampler.pad, sampler.stops, sampler.uniforms,
                                                  logits, t, alive))))
    if sampler.compiled:
        rows.append(("sampling of a step alone, compiled (graph)", graph_time(lambda: sampler.step(logits, t, alive))))
    model = engine.model
    x = torch.randn(chunk.batch_size, SPEC.hidden_size, device="cuda", dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def matmuls() -> None:
        for m in linears:
            torch.matmul(x if m.in_features == x.shape[1] else xs[m.in_features], m.weight.t())

    xs = {m.in_features: torch.randn(chunk.batch_size, m.in_features, device="cuda", dtype=torch.bfloat16)
          for m in linears}
    rows.append((f"the step's {len(linears)} matmuls alone (graph)", graph_time(matmuls)))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    rows.append((f"read the weights once ({nbytes / 1e9:.2f} GB device copy / 2)",
                 graph_time(lambda: dst.copy_(src), 10) / 2))
    lines = [f"# hf decode profile, batch {chunk.batch_size}, {args.prompt_len}-token prompts, {args.new} new, "
             f"options {args.options}, mode {getattr(engine, 'decode_mode', '?')}",
             "| part | ms |", "|---|---|"]
    lines += [f"| {name} | {t * 1e3:.3f} |" for name, t in rows]
    if dec.graph is not None:
        from torch.profiler import ProfilerActivity, profile

        # The same 20 replays right after the prefill, timed without the profiler, then profiled: the
        # step's wall time against its kernels' sum is the time the device waits between kernels.
        dec.start(chunk, None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dec.graph.replay()
        end.record()
        torch.cuda.synchronize()
        wall_ms = start.elapsed_time(end) / 20
        dec.start(chunk, None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                dec.graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / 20
        launches = sum(e.count for e in kernels) / 20
        lines += [f"| 20 replays right after the prefill, a step (timed without the profiler) | {wall_ms:.3f} |",
                  f"| their kernels' sum, a step ({launches:.0f} kernels) | {kernel_ms:.3f} |",
                  f"| the device between kernels, a step | {wall_ms - kernel_ms:.3f} |"]
        lines.append("```\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n```")
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / "profile_decode.md").write_text(text + "\n")


def _profile_whole(engine: Any, prompts: TensorBatch, params: SamplingParams, args: argparse.Namespace) -> None:
    """The profiler's kernel table of one whole ``generate`` call, and each kernel's share of the device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = engine.generate(prompts, params)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = int(out["response_mask"].sum())
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    lines = [f"# hf generate profile, batch {prompts.batch_size * args.n}, {args.prompt_len}-token prompts, "
             f"{args.new} new, options {args.options}, mode {getattr(engine, 'decode_mode', '?')}",
             f"wall {wall:.3f} s under the profiler, {tokens} tokens; device kernels {total / 1e6:.3f} s in all "
             f"({total / 1e3 / max(args.new - 1, 1):.3f} ms a step)", "", "| kernel | calls | ms | share |",
             "|---|---|---|---|"]
    lines += [f"| {e.key[:110]} | {e.count} | {e.self_device_time_total / 1e3:.1f} | "
              f"{e.self_device_time_total / total:.3f} |" for e in events[:40]]
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / "profile_generate.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
