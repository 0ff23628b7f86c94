"""One grouped-query decode step's attention over a static KV cache, implementation by implementation.

Run on a CUDA machine: ``python benchmarks/gpu/bench_decode_attention.py``. Shapes of the 0.89B
model (8 KV heads of 128, 2 query heads per KV head) at a batch of rows and a cache length; the
mask hides left padding and unwritten slots, as in the hf rollout's static decode step. Each
implementation runs in a CUDA graph; the table gives microseconds per layer, the cache bandwidth
that implies, and the largest difference from float64 attention.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from bench_gpu import graph_time
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from verl_core.enginekit.decode_attention import grouped_decode_attention


def explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)


def sdpa(backend: SDPBackend | None, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """torch's sdpa with the kernel it picks (None) or the one named."""
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """verl_core's decode-attention kernel (the hf rollout's default on CUDA), [rows, heads, 1, dim] out."""
    rows, kv, groups, dim = q.shape
    query = q.reshape(rows, kv * groups, 1, dim)
    out = grouped_decode_attention(query, k, v, mask, scale, fused=True)
    return out.reshape(rows, kv, groups, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, nargs="*", default=[128])
    parser.add_argument("--lengths", type=int, nargs="*", default=[160, 1056])
    args = parser.parse_args()
    kv_heads, groups, dim = 8, 2, 128
    scale = dim**-0.5
    compiled = torch.compile(explicit, dynamic=False)
    print("| rows | cache | implementation | us/layer | cache GB/s | max err |\n|---|---|---|---|---|---|")
    for rows in args.rows:
        for length in args.lengths:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(rows, kv_heads, groups, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            # Left padding of 0..7 slots and the last third of the cache not yet written.
            slots = torch.arange(length, device="cuda")
            pad = torch.arange(rows, device="cuda") % 8
            mask = ((slots[None] >= pad[:, None]) & (slots[None] < 2 * length // 3))[:, None, None, :]
            ref = explicit(q.double(), k.double(), v.double(), mask, scale)
            args = (q, k, v, mask, scale)
            impls: dict[str, Callable[[], Tensor]] = {
                "sdpa (default choice)": partial(sdpa, None, *args),
                "explicit matmuls, eager": partial(explicit, *args),
                "explicit matmuls, compiled": partial(compiled, *args),
                "sdpa efficient": partial(sdpa, SDPBackend.EFFICIENT_ATTENTION, *args),
                "sdpa math": partial(sdpa, SDPBackend.MATH, *args),
                "sdpa cudnn": partial(sdpa, SDPBackend.CUDNN_ATTENTION, *args),
                "fused Triton kernel": partial(fused, *args),
            }
            nbytes = 2 * k.numel() * k.element_size()
            for name, fn in impls.items():
                try:
                    us = graph_time(fn, 100) * 1e6
                    out = fn()
                except Exception as e:  # a backend refusing these shapes
                    print(f"| {rows} | {length} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
                    continue
                err = float((out.double() - ref).abs().max())
                print(f"| {rows} | {length} | {name} | {us:.1f} | {nbytes / us / 1e3:,.0f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
