"""The Triton kernel behind :func:`verl_core.enginekit.weight_stream.copy_finite` on CUDA.

Imported only where Triton is installed (it comes with PyTorch's CUDA wheels). One pass over the
source: every block is stored to the destination as raw bits (a bit-exact copy of any dtype) and
its exponent fields are tested for all ones (inf or NaN); a block holding one bumps a counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 8192
# exponent bits of float32 / float16 / bfloat16 (all ones: inf or NaN)
_EXPONENT = {torch.float32: (torch.int32, 0x7F800000), torch.float16: (torch.int16, 0x7C00),
             torch.bfloat16: (torch.int16, 0x7F80)}


@triton.jit  # type: ignore[untyped-decorator]
def _copy_count_non_finite(src, dst, bad, n, exponent: tl.constexpr, block: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
    keep = offs < n
    bits = tl.load(src + offs, mask=keep, other=0)
    tl.store(dst + offs, bits, mask=keep)
    hit = tl.max(((bits & exponent) == exponent).to(tl.int32), axis=0)
    if hit > 0:
        tl.atomic_add(bad, 1)


def copy_count_non_finite(dst: Tensor, src: Tensor) -> Tensor:
    """Copy the contiguous 1-D ``src`` into ``dst``; an int32 ``[1]`` count of blocks holding NaN/inf."""
    int_dtype, exponent = _EXPONENT[src.dtype]
    bad = torch.zeros(1, dtype=torch.int32, device=src.device)
    n = src.numel()
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _copy_count_non_finite[grid](src.view(int_dtype), dst.view(int_dtype), bad, n,
                                     exponent=exponent, block=_BLOCK, num_warps=8)
    return bad
