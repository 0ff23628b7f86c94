"""Where the hf rollout's prefill goes on a GPU, at the GRPO benchmark's shape (16 x 8 rows, 32-token prompts).

Run on a CUDA machine: ``python benchmarks/gpu/profile_prefill.py --out DIR [--options JSON]``. Times (mean of 5
after 2 warm-up calls, device work included: ``bench_gpu.cuda_time``) the decoder's start (prefill
and first sample), its prefill alone, and a plain transformers forward of the same tokens with no
cache and no mask, then prints the kernel table of one prefill.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from bench_gpu import SPEC, cuda_time

from verl_conformance.testkit import build_tiny_model
from verl_core import BatchMeta, EngineSpec, SamplingParams, TensorBatch, get_rollout_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--options", default="{}", help="hf engine options, a JSON object")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out.parent / "model-0.89b"
    if not (model_dir / "verl_tiny_model.json").exists():
        build_tiny_model(model_dir, SPEC)
    g = torch.Generator().manual_seed(0)
    prompts = TensorBatch({"prompt_ids": torch.randint(4, SPEC.vocab_size, (16, 32), generator=g),
                           "prompt_mask": torch.ones(16, 32, dtype=torch.bool), "group_ids": torch.arange(16)},
                          meta=BatchMeta())
    params = SamplingParams(temperature=1.0, max_new_tokens=128, n=8, seed=0)
    engine: Any = get_rollout_engine("hf", EngineSpec(model_path=str(model_dir), role="rollout", dtype="bfloat16",
                                                      device="cuda", max_prompt_len=32, max_response_len=128,
                                                      options=json.loads(args.options)))
    engine.generate(prompts, params)
    dec = engine._decoders.current
    chunk = prompts.repeat_interleave(8).to("cuda")
    ids = chunk["prompt_ids"]
    with torch.no_grad():
        rows = [("start: prefill + first sample", cuda_time(lambda: dec.start(chunk, None), 5)),
                ("prefill alone", cuda_time(lambda: dec._prefill(chunk), 5)),
                ("plain forward, no cache or mask, last logits", cuda_time(lambda: engine.model(input_ids=ids, logits_to_keep=1), 5)),
                ("cache reset", cuda_time(lambda: dec.cache.reset(), 5))]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dec._prefill(chunk)
            torch.cuda.synchronize()
    text = f"options {args.options}\n" + "\n".join([f"| {n} | {t * 1e3:.2f} ms |" for n, t in rows])
    text += "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    print(text, flush=True)
    (args.out / "profile_prefill.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
