"""The Triton kernel behind :func:`verl_core.enginekit.decode_attention.grouped_decode_attention` on CUDA.

Imported only where Triton is installed (it comes with PyTorch's CUDA wheels). One program per
(row, key/value head) walks the cache in blocks of slots with an online softmax (flash decoding):
each block's keys and values are read once, for every query head of the group at the same time,
and a block whose mask holds no attended slot is not read at all, so a step reads the slots written
so far whatever the cache's length. Scores and the softmax run in float32; the probabilities meet
the values in the cache's dtype with a float32 accumulator.

The kernel is registered as the custom operator ``verl_core::decode_attention`` so that
``torch.compile`` treats it as one opaque call and CUDA graphs capture its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 64  # cache slots per iteration


@triton.jit  # type: ignore[untyped-decorator]
def _decode_attention(q, k, v, mask, out, scale, slots,  # type: ignore[no-untyped-def]
                      sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_s, so_b, so_h,
                      groups: tl.constexpr, g_pad: tl.constexpr, dim: tl.constexpr, d_pad: tl.constexpr,
                      block: tl.constexpr):
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
            scores = tl.dot(query, tl.trans(keys)) * scale  # [g_pad, block], float32
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            shrink = tl.exp(best - new_best)
            p = tl.exp(scores - new_best[:, None])
            total = total * shrink + tl.sum(p, axis=1)
            values = tl.load(v_base + s[:, None] * sv_s + d[None, :], mask=kv_ok, other=0.0)
            acc = acc * shrink[:, None] + tl.dot(p.to(values.dtype), values)
            best = new_best
    total = tl.where(total > 0, total, 1.0)  # a row with no attended slot (never read) gets zeros
    result = acc / total[:, None]
    tl.store(out + row * so_b + q_heads[:, None] * so_h + d[None, :], result.to(out.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


@torch.library.custom_op("verl_core::decode_attention", mutates_args=())
def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of one query token per row: ``query`` [rows, heads, 1, dim], ``key``/``value``
    [rows, kv heads, slots, dim] (head ``h`` reads key/value head ``h // (heads // kv heads)``),
    ``mask`` [rows, 1, 1, slots] boolean (True = attend) or narrower than the cache (its first
    slots only are read). Returns [rows, 1, heads, dim] in the query's dtype."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    slots = mask.shape[-1]
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    flags = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    grid = (rows, kv_heads)
    _decode_attention[grid](
        query, key, value, flags, out, scale, slots,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), flags.stride(0), flags.stride(3),
        out.stride(0), out.stride(2),
        groups=groups, g_pad=max(16, triton.next_power_of_2(groups)), dim=dim, d_pad=triton.next_power_of_2(dim),
        block=_BLOCK, num_warps=4, num_stages=2,
    )
    return out


@decode_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)
