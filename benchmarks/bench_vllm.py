"""Generation throughput and weight-sync bandwidth of the vLLM rollout engine on CPU.

Generation: 64 prompts of 32 tokens, 128 sampled tokens each (T = 1, seeded) on a ~19M-parameter
Llama-shaped model, with the ``vllm`` rollout engine against the ``hf`` rollout engine (verl-hf's
own decoding loop with a KV cache) and against a plain ``transformers`` ``generate`` call, all on
the same weights in the same run: each is built and warmed up, then the three run round-robin
``--repeats`` times and the table shows medians. Throughput counts real response tokens (EOS ends
a response early, so the engines need not produce the same number; the table shows it).

Weight sync: ``update_weights`` of a full canonical stream (64 MiB buckets) into the vLLM engine,
for the ~19M model and a ~104M one, against a plain copy of the same bytes into preallocated
tensors, median of a few repeats.

Log-prob parity: on the test kit's tiny Llama (float32), the largest and mean absolute difference
between the vLLM engine's ``rollout_log_probs`` and the ``hf`` training engine's ``log_probs`` of
the same tokens, at T = 1 and T = 0.7 (16 prompts x 4 samples x 32 tokens).

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_vllm.py [--repeats 5] [--only parity|generate|sync]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from verl_conformance.testkit import TinyModelSpec, tiny_model
from verl_core import (
    BatchMeta,
    EngineSpec,
    RolloutEngine,
    SamplingParams,
    TensorBatch,
    TensorInfo,
    WeightManifest,
    get_rollout_engine,
    stream_weights,
)
from verl_core.enginekit.weight_stream import fusion_group

NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 32, 128
SMALL = TinyModelSpec(arch="llama", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                      head_dim=64, intermediate_size=1536, seed=1)
LARGE = TinyModelSpec(arch="llama", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                      head_dim=64, intermediate_size=3072, seed=2)
MiB = 1024 * 1024


def _params(path: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            shape = f.get_slice(name).get_shape()
            k = 1
            for s in shape:
                k *= s
            n += k
    return n


def _prompts() -> TensorBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (NUM_PROMPTS, PROMPT_LEN), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return TensorBatch({"prompt_ids": ids, "prompt_mask": mask, "group_ids": torch.arange(NUM_PROMPTS)},
                       meta=BatchMeta(pad_token_id=0))


def _timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds of this process (all its threads) and the result of ``fn``.

    On a shared machine the wall time depends on the others' load; the CPU time much less.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def bench_generate(path: Path, repeats: int) -> list[tuple[str, float, float, int]]:
    """(name, median wall seconds, median CPU seconds, response tokens) of each generator on ``path``.

    All three generators are built and warmed up first, then run round-robin ``repeats`` times
    (vllm, hf, transformers, vllm, ...): on a shared machine a burst of other load then falls on
    every row alike instead of on whichever ran during it, and the medians drop single outliers.
    """
    prompts = _prompts()
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0)

    spec = EngineSpec(str(path), "rollout", max_prompt_len=PROMPT_LEN, max_response_len=NEW_TOKENS,
                      options={"kv_cache_bytes": 256 * MiB})
    t0 = time.perf_counter()
    vllm_engine = get_rollout_engine("vllm", spec)
    print(f"vllm engine start: {time.perf_counter() - t0:.1f} s")
    vllm_engine.generate(prompts.index(slice(0, 2)), SamplingParams(max_new_tokens=4, seed=0))  # warm-up

    hf_spec = EngineSpec(str(path), "rollout", max_prompt_len=PROMPT_LEN, max_response_len=NEW_TOKENS)
    hf_engine = get_rollout_engine("hf", hf_spec)
    hf_engine.generate(prompts.index(slice(0, 2)), SamplingParams(max_new_tokens=4, seed=0))

    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()

    def hf_generate(rows: int = NUM_PROMPTS, new_tokens: int = NEW_TOKENS) -> int:
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts["prompt_ids"][:rows], attention_mask=prompts["prompt_mask"][:rows].long(),
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                pad_token_id=0, eos_token_id=1,
            )
        resp = out[:, PROMPT_LEN:]
        ended = (resp == 1).cumsum(1)
        real = (ended == 0) | ((ended == 1) & (resp == 1))
        return int(real.sum())

    hf_generate(2, 4)  # warm-up
    generators: list[tuple[str, Callable[[], int]]] = [
        ("vllm rollout engine", lambda: int(vllm_engine.generate(prompts, params)["response_mask"].sum())),
        ("hf rollout engine", lambda: int(hf_engine.generate(prompts, params)["response_mask"].sum())),
        ("transformers generate", hf_generate),
    ]
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _ in generators}
    for r in range(repeats):
        for name, fn in generators:
            runs[name].append(_timed(fn))
            wall, cpu, toks = runs[name][-1]
            print(f"repeat {r + 1}/{repeats} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU, {toks} tokens", flush=True)
    vllm_engine.close()
    hf_engine.close()
    med = statistics.median
    return [(name, med(w for w, _, _ in rs), med(c for _, c, _ in rs), rs[-1][2]) for name, rs in runs.items()]


def bench_sync(path: Path, repeats: int) -> tuple[int, float, float, float, float]:
    """(bytes, median sync wall s, median copy wall s, median sync CPU s, median copy CPU s)."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    names = sorted(state, key=lambda n: (fusion_group(n), n))
    spec = EngineSpec(str(path), "rollout", max_prompt_len=32, max_response_len=32,
                      options={"kv_cache_bytes": 64 * MiB})
    engine = get_rollout_engine("vllm", spec)
    total = sum(t.numel() * t.element_size() for t in state.values())
    sync_times, copy_times, sync_cpu, copy_cpu = [], [], [], []
    dst = {n: torch.empty_like(t) for n, t in state.items()}
    for r in range(repeats):
        manifest = WeightManifest(r + 1, {n: TensorInfo(tuple(state[n].shape), state[n].dtype) for n in names})
        wall, cpu, _ = _timed(functools.partial(_sync, engine, state, names, manifest))
        sync_times.append(wall)
        sync_cpu.append(cpu)
        wall, cpu, _ = _timed(lambda: _copy(dst, state, names))
        copy_times.append(wall)
        copy_cpu.append(cpu)
    engine.close()
    med = statistics.median
    return total, med(sync_times), med(copy_times), med(sync_cpu), med(copy_cpu)


def _sync(engine: RolloutEngine, state: dict[str, torch.Tensor], names: list[str], manifest: WeightManifest) -> int:
    engine.update_weights(
        stream_weights(((n, state[n]) for n in names), manifest, bucket_bytes=64 * MiB)
    )
    return 0


def _copy(dst: dict[str, torch.Tensor], state: dict[str, torch.Tensor], names: list[str]) -> int:
    for n in names:
        dst[n].copy_(state[n])
    return 0


def bench_parity() -> list[tuple[float, float, float, int]]:
    """(temperature, max |diff|, mean |diff|, tokens) of vLLM vs the hf training engine."""
    from verl_core import get_training_engine

    path = tiny_model(TinyModelSpec(arch="llama"))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 17, (16,), generator=g)
    ids = torch.zeros(16, 16, dtype=torch.int64)
    mask = torch.arange(16)[None, :] >= (16 - lengths)[:, None]
    ids[mask] = torch.randint(4, 128, (int(mask.sum()),), generator=g)
    prompts = TensorBatch({"prompt_ids": ids, "prompt_mask": mask, "group_ids": torch.arange(16)},
                          meta=BatchMeta(pad_token_id=0))
    spec = EngineSpec(str(path), "rollout", max_prompt_len=16, max_response_len=32,
                      options={"kv_cache_bytes": 64 * MiB})
    rollout = get_rollout_engine("vllm", spec)
    actor = get_training_engine("hf", EngineSpec(str(path), "actor", max_prompt_len=16, max_response_len=32))
    rows = []
    for temperature in (1.0, 0.7):
        out = rollout.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=32, n=4, seed=1))
        diff = (out["rollout_log_probs"] - actor.forward(out)["log_probs"]).abs()[out["response_mask"]]
        rows.append((temperature, float(diff.max()), float(diff.mean()), int(diff.numel())))
    rollout.close()
    actor.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per row (medians)")
    ap.add_argument("--only", choices=("parity", "generate", "sync"), default=None)
    args = ap.parse_args()
    run = {"parity", "generate", "sync"} if args.only is None else {args.only}
    if "parity" in run:
        print("\nLog-prob parity, vllm rollout_log_probs vs hf training engine log_probs (float32, tiny Llama)")
        print(f"| {'T':>4} | {'max |diff|':>10} | {'mean |diff|':>11} | {'tokens':>6} |")
        print(f"|{'-' * 6}|{'-' * 12}|{'-' * 13}|{'-' * 8}|")
        for temperature, mx, mean, n in bench_parity():
            print(f"| {temperature:4.1f} | {mx:10.2e} | {mean:11.2e} | {n:6d} |")
    small, large = tiny_model(SMALL), tiny_model(LARGE)
    print(f"models: small {_params(small) / 1e6:.1f}M params, large {_params(large) / 1e6:.1f}M params; "
          f"torch threads {torch.get_num_threads()}")
    if "generate" in run:
        rows = bench_generate(small, args.repeats)
        base_wall, base_cpu = rows[1][3] / rows[1][1], rows[1][3] / rows[1][2]
        print(f"\nGeneration: {NUM_PROMPTS} prompts x {PROMPT_LEN} tokens, up to {NEW_TOKENS} sampled tokens, "
              f"{_params(small) / 1e6:.1f}M-param model, float32, CPU, median of {args.repeats} interleaved runs")
        print(f"| {'generator':<22} | {'wall s':>7} | {'CPU s':>7} | {'tokens':>6} | {'tok/wall s':>10} | "
              f"{'tok/CPU s':>9} | {'vs hf (wall)':>12} | {'vs hf (CPU)':>11} |")
        print(f"|{'-' * 24}|{'-' * 9}|{'-' * 9}|{'-' * 8}|{'-' * 12}|{'-' * 11}|{'-' * 14}|{'-' * 13}|")
        for name, wall, cpu, toks in rows:
            print(f"| {name:<22} | {wall:7.1f} | {cpu:7.1f} | {toks:6d} | {toks / wall:10.0f} | {toks / cpu:9.0f} | "
                  f"{toks / wall / base_wall:11.2f}x | {toks / cpu / base_cpu:10.2f}x |")
    if "sync" not in run:
        return
    print("\nWeight sync (full stream, 64 MiB buckets) vs a plain copy of the same bytes, "
          f"median of {args.repeats}")
    print(f"| {'model':<12} | {'MB':>6} | {'sync s':>6} | {'sync GB/s':>9} | {'copy s':>7} | {'copy GB/s':>9} | "
          f"{'sync/copy':>9} | {'sync CPU s':>10} | {'copy CPU s':>10} |")
    print(f"|{'-' * 14}|{'-' * 8}|{'-' * 8}|{'-' * 11}|{'-' * 9}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 12}|")
    for label, path in (("small", small), ("large", large)):
        total, sync_s, copy_s, sync_c, copy_c = bench_sync(path, args.repeats)
        name = f"{label} {_params(path) / 1e6:.0f}M"
        print(f"| {name:<12} | {total / 1e6:6.1f} | {sync_s:6.3f} | {total / 1e9 / sync_s:9.2f} | "
              f"{copy_s:7.4f} | {total / 1e9 / copy_s:9.2f} | {sync_s / copy_s:8.1f}x | {sync_c:10.3f} | {copy_c:10.4f} |")


if __name__ == "__main__":
    main()
