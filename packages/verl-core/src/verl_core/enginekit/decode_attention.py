"""Attention of one decode step over a static KV cache with grouped key/value heads.

One owner for what the rollout engines' static decode steps compute: the query heads of a group
folded onto their key/value head (no ``repeat_kv`` copy of the cache), a mask narrower than the
cache read as "its first slots only", and on CUDA, where Triton is installed, one fused kernel
(flash decoding: keys and values read once per block, an online float32 softmax, blocks with no
attended slot not read at all). Elsewhere, and for float32, two batched matrix products around a
float32 softmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from verl_core.kernel.errors import ConfigError

__all__ = ["fused_decode_kernel", "fused_decode_takes", "grouped_decode_attention", "resolve_decode_kernel"]

FusedKernel = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]


_KERNEL: list[FusedKernel | None] = []
"""The kernel once looked up (a plain list rather than ``functools.cache``: dynamo traces a list read
inside a compiled decode step without a warning)."""


def fused_decode_kernel() -> FusedKernel | None:
    """The fused Triton decode-attention kernel, or None where Triton is not installed."""
    if not _KERNEL:
        try:
            from verl_core.enginekit import _triton_decode
        except ImportError:
            _KERNEL.append(None)
        else:
            del _triton_decode
            _KERNEL.append(torch.ops.verl_core.decode_attention)
    return _KERNEL[0]


def fused_decode_takes(query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> bool:
    """Whether the fused kernel takes these tensors: CUDA, bfloat16 or float16, a boolean mask, the
    head dimension contiguous, and a kernel installed."""
    return (query.is_cuda and mask.dtype == torch.bool and query.dtype in (torch.bfloat16, torch.float16)
            and key.dtype == value.dtype == query.dtype and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
            and fused_decode_kernel() is not None)


def resolve_decode_kernel(wanted: bool | None, device: torch.device, dtype: torch.dtype, option: str) -> bool:
    """Whether a rollout on ``device`` in ``dtype`` runs the fused kernel, the engine's option
    ``option`` (its name in messages, e.g. ``HFOptions.rollout_decode_kernel``) set to ``wanted``.

    None: on exactly where it can run (CUDA, bfloat16 or float16, Triton installed), never an error.
    True: on, and a :class:`~verl_core.kernel.errors.ConfigError` naming what is missing where it
    cannot run. False: off.
    """
    if wanted is False:
        return False
    takes = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if wanted is None:
        return takes and fused_decode_kernel() is not None
    name = option.split(".")[-1].split()[-1]
    if not takes:
        raise ConfigError(
            f"{option}=True needs a CUDA device and a bfloat16 rollout, the engine runs on {device} in "
            f"{str(dtype).removeprefix('torch.')}; set {name}=False (or leave it unset: on where it can run)"
        )
    if fused_decode_kernel() is None:
        raise ConfigError(
            f"{option}=True needs Triton, which is not installed (it comes with PyTorch's CUDA wheels); "
            f"set {name}=False"
        )
    return True


def grouped_decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float, *,
                             fused: bool = False) -> Tensor:
    """Attention of one query token per row over a KV cache with grouped heads.

    Args:
        query: ``[rows, heads, 1, dim]``.
        key: ``[rows, kv_heads, slots, dim]``; query head ``h`` reads key/value head
            ``h // (heads // kv_heads)``, as ``repeat_kv`` lays them out.
        value: like ``key``.
        mask: ``[rows, 1, 1, width]``, boolean (True = attend) or additive (0 or a large negative
            number), with ``width <= slots``: only the first ``width`` slots are read.
        scale: the factor of the scores (``dim ** -0.5`` for plain attention).
        fused: run the fused kernel where it takes the tensors (:func:`fused_decode_takes`); the
            same attention up to float rounding (float32 scores before the softmax rather than
            scores rounded to the cache's dtype).

    Returns:
        ``[rows, 1, heads, dim]`` in the query's dtype.
    """
    rows, heads, _, dim = query.shape
    width = mask.shape[-1]
    kernel = fused_decode_kernel() if fused and fused_decode_takes(query, key, value, mask) else None
    if kernel is not None:
        return kernel(query, key, value, mask, scale)
    key, value = key[:, :, :width], value[:, :, :width]  # views: the slots past the mask are not read
    folded = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    scores = torch.matmul(folded, key.transpose(-1, -2)).float() * scale  # [rows, kv heads, groups, slots]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:  # an additive mask
        scores = scores + mask.float()
    out = torch.matmul(torch.softmax(scores, -1).to(value.dtype), value)
    return out.reshape(rows, 1, heads, dim)
