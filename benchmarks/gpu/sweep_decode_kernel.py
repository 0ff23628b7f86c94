"""Launch settings of the fused decode-attention kernel, swept on the hf rollout's decode shapes.

Run on a CUDA machine: ``python benchmarks/gpu/sweep_decode_kernel.py``. For each shape (rows,
mask width = the step's cache window, slots written), every :class:`Launch` of the grid (slots per
block, warps, pipeline stages) runs in a
CUDA graph. The table gives microseconds per layer, the attended bytes' bandwidth, the ratio to a
device copy of the same bytes measured in the same run (the bandwidth bound), and the error
against float64 attention; the kernel before the span scan (one program per row and head, every
block of the window visited, a branch per block) is the baseline of each shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_gpu import graph_time
from torch import Tensor

from verl_core.enginekit import _triton_decode
from verl_core.enginekit._triton_decode import Launch


@triton.jit  # type: ignore[untyped-decorator]
def _previous(q, k, v, mask, out, scale, slots,  # type: ignore[no-untyped-def]
              sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_s, so_b, so_h,
              groups: tl.constexpr, g_pad: tl.constexpr, dim: tl.constexpr, d_pad: tl.constexpr,
              block: tl.constexpr):
    """The kernel of commit e41739a: every block of the window visited, the mask tested per block."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, g_pad)
    d = tl.arange(0, d_pad)
    g_ok = g < groups
    d_ok = d < dim
    q_heads = head * groups + g
    query = tl.load(q + row * sq_b + q_heads[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    best = tl.full([g_pad], float("-inf"), tl.float32)
    total = tl.zeros([g_pad], tl.float32)
    acc = tl.zeros([g_pad, d_pad], tl.float32)
    k_base = k + row * sk_b + head * sk_h
    v_base = v + row * sv_b + head * sv_h
    m_base = mask + row * sm_b
    for start in range(0, slots, block):
        s = start + tl.arange(0, block)
        seen = tl.load(m_base + s * sm_s, mask=s < slots, other=0) != 0
        if tl.max(seen.to(tl.int32), axis=0) > 0:
            kv_ok = seen[:, None] & d_ok[None, :]
            keys = tl.load(k_base + s[:, None] * sk_s + d[None, :], mask=kv_ok, other=0.0)
            scores = tl.dot(query, tl.trans(keys)) * scale
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            shrink = tl.exp(best - new_best)
            p = tl.exp(scores - new_best[:, None])
            total = total * shrink + tl.sum(p, axis=1)
            values = tl.load(v_base + s[:, None] * sv_s + d[None, :], mask=kv_ok, other=0.0)
            acc = acc * shrink[:, None] + tl.dot(p.to(values.dtype), values)
            best = new_best
    total = tl.where(total > 0, total, 1.0)
    result = acc / total[:, None]
    tl.store(out + row * so_b + q_heads[:, None] * so_h + d[None, :], result.to(out.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def previous(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    flags = mask.view(torch.uint8)
    _previous[(rows, kv_heads)](
        query, key, value, flags, out, scale, mask.shape[-1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), flags.stride(0), flags.stride(3),
        out.stride(0), out.stride(2),
        groups=groups, g_pad=max(16, triton.next_power_of_2(groups)), dim=dim, d_pad=triton.next_power_of_2(dim),
        block=64, num_warps=4, num_stages=2,
    )
    return out


def reference(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    width, groups = mask.shape[-1], query.shape[1] // key.shape[1]
    k = key[:, :, :width].double().repeat_interleave(groups, 1)
    v = value[:, :, :width].double().repeat_interleave(groups, 1)
    scores = (torch.matmul(query.double(), k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2)


def sweep(rows: int, width: int, written: int, args: argparse.Namespace) -> Launch | None:
    """Every launch of the grid at one shape, ranked (the previous kernel and the default kept);
    returns the fastest launch of the grid."""
    kv_heads, groups, dim = 8, 2, 128
    scale = dim**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(rows, kv_heads * groups, 1, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    key = torch.randn(rows, kv_heads, width + 32, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn_like(key)
    slots = torch.arange(width, device="cuda")
    pad = torch.arange(rows, device="cuda") % 8  # left padding of 0..7 slots
    mask = ((slots[None] >= pad[:, None]) & (slots[None] < written))[:, None, None, :]
    want = reference(query, key, value, mask, scale)
    nbytes = int(mask.sum()) * kv_heads * dim * 2 * key.element_size()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    bound_us = graph_time(lambda: dst.copy_(src), 100) * 1e6 / 2  # a copy reads and writes the bytes
    results: list[tuple[float, str, float]] = []

    def measure(name: str, fn: Callable[[], Tensor]) -> None:
        try:
            us = graph_time(fn, 100) * 1e6
            err = float((fn().double() - want).abs().max())
        except Exception as e:  # a launch the device refuses (shared memory)
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:100]}")
            return
        results.append((us, name, err))

    measure("previous kernel (64, 4, 2, -)", partial(previous, query, key, value, mask, scale))
    default = _triton_decode.default_launch(rows, kv_heads, query.device)
    measure(f"default {tuple(default)}", partial(_triton_decode.launch, query, key, value, mask, scale, default))
    for block, warps, stages in itertools.product(args.blocks, args.warps, args.stages):
        how = Launch(block, warps, stages)
        measure(str(tuple(how)), partial(_triton_decode.launch, query, key, value, mask, scale, how))
    print(f"\n### rows {rows}, window {width}, written {written}: {nbytes / 1e6:.0f} MB attended, "
          f"copy bound {bound_us:.1f} us\n")
    print("| launch (block, warps, stages) | us/layer | GB/s | of bound | max err |\n|---|---|---|---|---|")
    ranked = sorted(results)
    shown = ranked[: args.top] + [r for r in ranked[args.top :] if r[1].startswith(("previous", "default"))]
    for us, name, err in shown:
        print(f"| {name} | {us:.1f} | {nbytes / us / 1e3:,.0f} | {bound_us / us:.2f} | {err:.1e} |", flush=True)
    grid = [name for _, name, _ in ranked if name.startswith("(")]
    return Launch(*(int(x) for x in grid[0].strip("()").split(","))) if grid else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--shapes", nargs="*", default=["128:2048:1056", "128:2080:2080", "128:256:160",
                                                         "16:2080:2080", "256:1024:544", "64:4096:4096"],
                        help="rows:window:written")
    parser.add_argument("--blocks", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4])
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--json", type=Path, help="write the fastest launch of each shape there")
    args = parser.parse_args()
    best = {}
    for shape in args.shapes:
        rows, width, written = (int(x) for x in shape.split(":"))
        best[shape] = sweep(rows, width, written, args)
    if args.json:
        args.json.write_text(json.dumps({k: None if v is None else list(v) for k, v in best.items()}, indent=1))


if __name__ == "__main__":
    main()
