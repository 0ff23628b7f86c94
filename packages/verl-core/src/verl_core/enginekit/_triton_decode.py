"""The Triton kernel behind :func:`verl_core.enginekit.decode_attention.grouped_decode_attention` on CUDA.

Imported only where Triton is installed (it comes with PyTorch's CUDA wheels). Flash decoding: one
program per (row, key/value head) first finds the span of slots its row's mask attends (from the
first attended slot to the last, a scan of the mask alone), then walks that span's blocks with an
online softmax. Each block's keys and values
are read once, for every query head of the group at the same time; slots the mask hides inside the
span are masked out of the loads, so no hidden slot is read, and the slots past the last attended
one (the unwritten end of a preallocated cache) are not visited at all, so a step reads the slots
written so far whatever the cache's length. The walk has no branch, so Triton pipelines its loads.
Scores and the softmax run in float32; the probabilities meet
the values in the cache's dtype with a float32 accumulator.

The kernel is registered as the custom operator ``verl_core::decode_attention`` so that
``torch.compile`` treats it as one opaque call and CUDA graphs capture its launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor


class Launch(NamedTuple):
    """How the kernel is launched: cache slots per block, warps and pipeline stages per program."""

    block: int
    warps: int
    stages: int


_SCAN = 1024  # mask slots per iteration of the span scan


@triton.jit  # type: ignore[untyped-decorator]
def _decode_attention(q, k, v, mask, out, scale, slots,  # type: ignore[no-untyped-def]
                      sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_s, so_b, so_h,
                      groups: tl.constexpr, g_pad: tl.constexpr, dim: tl.constexpr, d_pad: tl.constexpr,
                      block: tl.constexpr, scan: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, g_pad)
    d = tl.arange(0, d_pad)
    g_ok = g < groups
    d_ok = d < dim
    m_base = mask + row * sm_b
    # The attended span [first, last]: a branch-free scan of the mask row.
    first = slots
    last = -1
    for start in range(0, slots, scan):
        s = start + tl.arange(0, scan)
        seen = tl.load(m_base + s * sm_s, mask=s < slots, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(seen, s, slots), axis=0))
        last = tl.maximum(last, tl.max(tl.where(seen, s, -1), axis=0))
    lo = (first // block) * block
    hi = last + 1
    q_heads = head * groups + g
    query = tl.load(q + row * sq_b + q_heads[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    best = tl.full([g_pad], float("-inf"), tl.float32)
    total = tl.zeros([g_pad], tl.float32)
    acc = tl.zeros([g_pad, d_pad], tl.float32)
    k_base = k + row * sk_b + head * sk_h
    v_base = v + row * sv_b + head * sv_h
    for start in range(lo, hi, block):
        s = start + tl.arange(0, block)
        seen = tl.load(m_base + s * sm_s, mask=s < hi, other=0) != 0
        kv_ok = seen[:, None] & d_ok[None, :]
        keys = tl.load(k_base + s[:, None] * sk_s + d[None, :], mask=kv_ok, other=0.0)
        scores = tl.dot(query, tl.trans(keys)) * scale  # [g_pad, block], float32
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        base = tl.where(new_best == float("-inf"), 0.0, new_best)  # a block with no attended slot yet
        shrink = tl.exp(best - base)
        p = tl.exp(scores - base[:, None])
        total = total * shrink + tl.sum(p, axis=1)
        values = tl.load(v_base + s[:, None] * sv_s + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * shrink[:, None] + tl.dot(p.to(values.dtype), values)
        best = new_best
    total = tl.where(total > 0, total, 1.0)  # a row with no attended slot (never read) gets zeros
    result = acc / total[:, None]
    tl.store(out + row * so_b + q_heads[:, None] * so_h + d[None, :], result.to(out.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def default_launch(rows: int, kv_heads: int, device: torch.device) -> Launch:
    """The launch the operator uses for a call of this shape: blocks of 64 slots, 4 warps, and 3
    pipeline stages where the programs (rows x key/value heads) are fewer than twice the device's
    multiprocessors, else 2 (benchmarks/gpu/sweep_decode_kernel.py on an H100: 16 rows x 8 heads
    read 0.89 of the copy bound with 3 stages against 0.66 with 2; from 512 programs up 2 stages
    are as fast or faster)."""
    few = device.type == "cuda" and rows * kv_heads < 2 * _multiprocessors(device)
    return Launch(block=64, warps=4, stages=3 if few else 2)


_SMS: dict[int | None, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def launch(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float, how: Launch) -> Tensor:
    """The kernel on these tensors with an explicit :class:`Launch` (the operator's body; benchmarks
    call it to compare launches)."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    slots = mask.shape[-1]
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    flags = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    _decode_attention[(rows, kv_heads)](
        query, key, value, flags, out, scale, slots,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), flags.stride(0), flags.stride(3),
        out.stride(0), out.stride(2),
        groups=groups, g_pad=max(16, triton.next_power_of_2(groups)), dim=dim, d_pad=triton.next_power_of_2(dim),
        block=how.block, scan=_SCAN, num_warps=how.warps, num_stages=how.stages,
    )
    return out


@torch.library.custom_op("verl_core::decode_attention", mutates_args=())
def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of one query token per row: ``query`` [rows, heads, 1, dim], ``key``/``value``
    [rows, kv heads, slots, dim] (head ``h`` reads key/value head ``h // (heads // kv heads)``),
    ``mask`` [rows, 1, 1, slots] boolean (True = attend) or narrower than the cache (its first
    slots only are read). Returns [rows, 1, heads, dim] in the query's dtype."""
    return launch(query, key, value, mask, scale, default_launch(query.shape[0], key.shape[1], query.device))


@decode_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)
