"""Decode tokens/s of the hf (or megatron) rollout as responses grow, against the memory-bandwidth bound of each length.

Run on a CUDA machine: ``python benchmarks/gpu/bench_decode_long.py [--out DIR]``. For each response
length (``--lengths``, default 128 512 2048 new tokens) the rollout engine generates for ``--prompts``
x ``--n`` rows (16 x 8 = 128, the GRPO benchmark's batch) of ``--prompt-len``-token prompts (32),
every row to the full length, or with ``--stop-every N`` each ending at a step with a chance of
about 1/N (rows finish at different steps, as real responses do),
first ``--warmup`` calls (they compile the decode step and capture its CUDA graphs: one per cache
window), then ``--calls`` timed calls (median). Printed per length and engine variant: tokens,
seconds, tokens/s, and the memory-bandwidth bound of the shape: every decode step must read the
weights once (every parameter but the input embedding, of which only the rows' embeddings are
read) and the KV cache written so far of the rows still decoding (prompt + tokens drawn, x layers
x keys and values),
at ``--bandwidth`` bytes/s (4.8e12: the H200's HBM3e); the bound's tokens/s is the rows x steps
over the sum of those reads, and the ratio is what the engine reached of it. Prefill and sampling
are not in the bound, so a ratio near 1 is out of reach at short lengths.

Variants (``--variant NAME=JSON``, repeatable; JSON is the hf engine's options): by default the
engine's defaults (on CUDA: static cache, torch.compile, CUDA graphs, attention over cache
windows in the fused kernel) and ``whole-cache`` (``rollout_decode_window=0`` and
``rollout_decode_kernel=False``: every step attends over the whole preallocated cache through
matrix products, as before the windows and the kernel), plus on CUDA ``matmul-attention``
(``rollout_decode_kernel=False``: the windows' attention as two matrix products around a softmax
instead of the default's fused Triton kernel). ``--backend megatron`` runs the megatron rollout
(one process, tp=1) with the same variants (its options of the same names). ``--size tiny
--device cpu`` is a smoke run of the script on a CPU (float32), not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import torch

from verl_core import BatchMeta, EngineSpec, SamplingParams, TensorBatch, get_rollout_engine
from verl_core.enginekit.sampling import static_prompt_width
from verl_core.trainer.inputs.tiny_model import TinyModelSpec, build_tiny_model

SIZES = {
    "0.9b": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 5632, "vocab_size": 32000},
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
             "intermediate_size": 256, "vocab_size": 512},
}
DEFAULT_VARIANTS: dict[str, dict[str, Any]] = {"default": {}, "whole-cache": {"rollout_decode_window": 0, "rollout_decode_kernel": False}}


def bound(spec: TinyModelSpec, lengths: list[int], width: int, dtype_bytes: int, bandwidth: float) -> dict[str, float]:
    """The bandwidth bound of decoding responses of ``lengths`` tokens after a ``width``-slot prompt
    (see the module docstring): a row of ``n`` tokens takes ``n - 1`` decode steps, each reading its
    slots written so far; the weights are read at every step until the longest row ends."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * spec.intermediate_size + 2 * h
    embedding = spec.vocab_size * h
    head = 0 if spec.tied else embedding  # the LM head is read whole every step
    rows = len(lengths)
    weights = (spec.num_layers * layer + head + h + rows * h) * dtype_bytes
    per_slot = spec.num_layers * 2 * kv * dtype_bytes  # one row's keys and values of one slot
    steps = [max(0, n - 1) for n in lengths]
    kv_total = sum(per_slot * (width * s + s * (s + 1) // 2) for s in steps)  # slots width + 1 .. width + s
    seconds = (max(steps, default=0) * weights + kv_total) / bandwidth
    return {"weights_gb": weights / 1e9, "kv_last_gb": sum(per_slot * (width + s) for s in steps) / 1e9,
            "bound_tok_s": sum(steps) / seconds if seconds > 0 else float("inf")}


def timed_generate(engine: Any, prompts: TensorBatch, params: SamplingParams, cuda: bool) -> tuple[float, TensorBatch]:
    """Seconds of one ``generate`` call (device work included) and its output."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out: TensorBatch = engine.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size", choices=sorted(SIZES), default="0.9b")
    parser.add_argument("--backend", choices=("hf", "megatron"), default="hf",
                        help="the rollout engine (the variants' options are that backend's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per length (compilation, capture)")
    parser.add_argument("--calls", type=int, default=2, help="timed calls per length (median)")
    parser.add_argument("--stop-every", type=int, default=0, metavar="N",
                        help="responses end at each step with a chance of about 1/N (stop ids: an N-th of the "
                             "vocabulary), so rows finish at different steps; 0: every row decodes the full length")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="device memory bandwidth, bytes/s")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="an engine variant: hf options as a JSON object (default: default and whole-cache)")
    parser.add_argument("--model-dir", type=Path, help="where the model folder is built (default: a temp folder)")
    parser.add_argument("--out", type=Path, help="append the table to OUT/bench_decode_long.md")
    parser.add_argument("--kernel-launch", metavar="BLOCK,WARPS,STAGES",
                        help="the fused decode-attention kernel's launch for every call (default: the kernel's own "
                             "choice, verl_core.enginekit._triton_decode.default_launch); see sweep_decode_kernel.py")
    parser.add_argument("--finished-rows-read", action="store_true",
                        help="the baseline of --stop-every: a finished row's decode steps attend every slot it "
                             "wrote, as before StaticDecodeLoop.step_attends (the same samples, more cache read)")
    args = parser.parse_args()
    if args.finished_rows_read:
        from verl_core.enginekit.sampling import StaticDecodeLoop

        def every_written_slot(self: StaticDecodeLoop, valid: torch.Tensor, slots: torch.Tensor, slot: torch.Tensor,
                               seen: int) -> torch.Tensor:
            return valid[:, :seen] & (slots[:seen] <= slot)

        StaticDecodeLoop.step_attends = every_written_slot  # type: ignore[method-assign]
    if args.kernel_launch:
        from verl_core.enginekit import _triton_decode

        fixed = _triton_decode.Launch(*(int(x) for x in args.kernel_launch.split(",")))
        _triton_decode.default_launch = lambda rows, kv_heads, device: fixed  # type: ignore[assignment]
    cuda = args.device.startswith("cuda")
    dtype: Literal["bfloat16", "float32"] = "bfloat16" if cuda else "float32"
    dtype_bytes = 2 if cuda else 4
    variants = dict(DEFAULT_VARIANTS)
    if cuda:
        variants["matmul-attention"] = {"rollout_decode_kernel": False}
    if args.variant:
        variants = {name: json.loads(text) for name, _, text in (v.partition("=") for v in args.variant)}
    size = SIZES[args.size]
    spec = TinyModelSpec(arch="llama", tied=False, max_position=args.prompt_len + max(args.lengths) + 8, seed=0,
                         hidden_size=size["hidden_size"], num_layers=size["num_layers"], num_heads=size["num_heads"],
                         num_kv_heads=size["num_kv_heads"], head_dim=size["head_dim"],
                         intermediate_size=size["intermediate_size"], vocab_size=size["vocab_size"])
    model_dir = args.model_dir or Path(f"/tmp/verl-bench-decode-{args.size}-{spec.key()}")
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir, spec)
    g = torch.Generator().manual_seed(0)
    prompts = TensorBatch({
        "prompt_ids": torch.randint(4, spec.vocab_size, (args.prompts, args.prompt_len), generator=g),
        "prompt_mask": torch.ones(args.prompts, args.prompt_len, dtype=torch.bool),
        "group_ids": torch.arange(args.prompts),
    }, meta=BatchMeta())
    rows = args.prompts * args.n
    # --stop-every N: a random model draws each id about equally often, so N-th of the vocabulary as
    # stop ids ends a response at each step with a chance of about 1 / N
    stops = tuple(range(4, 4 + max(1, spec.vocab_size // args.stop_every))) if args.stop_every else ()
    width = static_prompt_width(args.prompt_len)
    lines = [f"# {args.backend} rollout decode as responses grow: {args.size} ({dtype}) on {args.device}, {rows} rows, "
             f"{args.prompt_len}-token prompts, bound at {args.bandwidth / 1e12:.1f} TB/s, torch {torch.__version__}"
             + (f", {len(stops)} stop ids (a response ends at a step with a chance of about 1/{args.stop_every})"
                if stops else "")
             + (f", kernel launch {args.kernel_launch}" if args.kernel_launch else "")
             + (", finished rows attend every slot they wrote (baseline)" if args.finished_rows_read else ""),
             "| variant | mode | new tokens | tokens | mean length | s | tok/s | bound tok/s | of bound | weights GB "
             "| KV at end GB | first call s | graphs (captured/failed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for line in lines:
        print(line, flush=True)
    for name, options in variants.items():
        engine: Any = get_rollout_engine(args.backend, EngineSpec(
            model_path=str(model_dir), role="rollout", dtype=dtype, device=args.device,
            max_prompt_len=args.prompt_len, max_response_len=max(args.lengths), options=options))
        for length in args.lengths:
            params = SamplingParams(temperature=1.0, max_new_tokens=length, n=args.n, seed=0, stop_token_ids=stops)
            first = [timed_generate(engine, prompts, params, cuda)[0] for _ in range(args.warmup)]
            timed = [timed_generate(engine, prompts, params, cuda) for _ in range(args.calls)]
            seconds = statistics.median(t for t, _ in timed)
            out = timed[-1][1]
            tokens = int(out["response_mask"].sum())
            mean_len = tokens / rows
            b = bound(spec, out["response_mask"].sum(1).tolist(), width, dtype_bytes, args.bandwidth)
            graphs = getattr(engine, "graph_captures", None)
            counts = "-" if graphs is None else f"{graphs.captured}/{graphs.failures}"
            row = (f"| {name} | {engine.decode_mode} | {length} | {tokens} | {mean_len:.1f} | {seconds:.3f} | "
                   f"{tokens / seconds:,.0f} | {b['bound_tok_s']:,.0f} | {tokens / seconds / b['bound_tok_s']:.2f} | "
                   f"{b['weights_gb']:.3g} | {b['kv_last_gb']:.3g} | {sum(first):.1f} | {counts} |")
            print(row, flush=True)
            lines.append(row)
        engine.close()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "bench_decode_long.md", "a") as fh:
            fh.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
